/*
 * The ring engine: one rank's side of a forward or backward pass. See
 * stria_ring.h for the algorithm; the comments here explain the choices the
 * header does not.
 */
#include "stria_ring.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* Message kinds, the low byte of a tag. */
enum { STRIA__MSG_KV = 1, STRIA__MSG_DKV = 2, STRIA__MSG_DONE = 3 };

struct stria_ring_pass {
    stria_link_t *link;
    stria_ring_shape_t shape;
    stria_layout_t layout;
    stria_pool_t *pool;
    stria_ring_opts_t hooks; /* only the compute_* and step hooks are used */
    double timeout_s;
    uint32_t pass_id;
    uint32_t calls; /* fwd/bwd calls so far */
    uint32_t call;  /* number of the running call: part of every tag */
    double t_start; /* start of the running call, for deadlines */
    int rank, n;
    /* Per rank of the ring: the runs of its real tokens, their number, and
     * the lowest and highest real position (for skipping masked blocks). */
    stria_pos_run_t (*runs)[STRIA_LAYOUT_MAX_RUNS];
    size_t *n_runs;
    int64_t *valid;
    int64_t *pos_min, *pos_max;
    stria_ring_step_stats_t *stats;
    void *arena; /* working buffers, kept between calls */
    size_t arena_size;
};

/* Tag = pass id (32 bits) | call number mod 256 (8) | step (16) | kind (8):
 * a message of another pass, call, step or kind can never match. */
static uint64_t stria__tag(const stria_ring_pass_t *p, int step, int kind)
{
    return ((uint64_t)p->pass_id << 32) | ((uint64_t)(p->call & 0xffu) << 24) |
           ((uint64_t)(unsigned)step << 8) | (uint64_t)kind;
}

/* ---- creation ------------------------------------------------------------ */

static stria_status_t stria__check_shape(const stria_ring_shape_t *s)
{
    if (s->batch < 1 || s->seq < 1 || s->heads < 1 || s->kv_heads < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ring shape: batch (%lld), seq (%lld), heads (%lld) and kv_heads "
                               "(%lld) must be >= 1",
                               (long long)s->batch, (long long)s->seq, (long long)s->heads,
                               (long long)s->kv_heads);
    if (s->heads % s->kv_heads != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ring shape: heads (%lld) must be a multiple of kv_heads (%lld)",
                               (long long)s->heads, (long long)s->kv_heads);
    if (s->head_dim < STRIA_HEAD_DIM_MIN || s->head_dim > STRIA_HEAD_DIM_MAX ||
        s->head_dim % 8 != 0)
        return stria_error_set(STRIA_ERR_UNSUPPORTED,
                               "ring shape: head_dim %lld unsupported (a multiple of 8 in %d..%d)",
                               (long long)s->head_dim, STRIA_HEAD_DIM_MIN, STRIA_HEAD_DIM_MAX);
    if (!(s->scale >= 0.0f) || isinf(s->scale))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ring shape: scale must be finite and > 0 (0 for the default)");
    if (stria_dtype_size(s->dtype) == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ring shape: unknown dtype %d",
                               (int)s->dtype);
    return STRIA_OK;
}

void stria_ring_pass_destroy(stria_ring_pass_t *pass)
{
    if (pass == NULL)
        return;
    free(pass->runs);
    free(pass->n_runs);
    free(pass->valid);
    free(pass->pos_min);
    free(pass->pos_max);
    free(pass->stats);
    free(pass->arena);
    free(pass);
}

stria_status_t stria_ring_pass_create(stria_link_t *link, const stria_ring_shape_t *shape,
                                      stria_layout_kind_t layout, const stria_ring_opts_t *opts,
                                      stria_ring_pass_t **pass_out)
{
    static const stria_ring_opts_t defaults;
    stria_ring_pass_t *p;
    stria_status_t st;
    size_t n;
    int64_t elems;

    if (link == NULL || shape == NULL || pass_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_ring_pass_create: NULL argument");
    if (opts == NULL)
        opts = &defaults;
    if ((st = stria__check_shape(shape)) != STRIA_OK)
        return st;
    if (stria_link_size(link) < 1 || stria_link_rank(link) < 0 ||
        stria_link_rank(link) >= stria_link_size(link))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_ring_pass_create: link has rank %d in a ring of %d",
                               stria_link_rank(link), stria_link_size(link));
    if (isnan(opts->step_timeout_s))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_ring_pass_create: timeout is NaN");

    p = calloc(1, sizeof(*p));
    if (p == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_ring_pass_create: out of memory");
    if ((st = stria_layout_init(layout, stria_link_size(link), shape->seq, &p->layout)) != STRIA_OK)
        goto err;
    /* Every buffer of a pass must be addressable: reject shapes whose largest
     * tensor (a shard of Q or K/V in fp32, twice) does not fit in memory
     * sizes. */
    if (p->layout.shard_tokens > INT32_MAX ||
        __builtin_mul_overflow(shape->batch, p->layout.shard_tokens, &elems) ||
        __builtin_mul_overflow(elems, shape->heads, &elems) ||
        __builtin_mul_overflow(elems, shape->head_dim, &elems) ||
        __builtin_mul_overflow(elems, (int64_t)8, &elems)) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "stria_ring_pass_create: shards of %lld tokens x batch %lld x %lld "
                             "heads x %lld are too large",
                             (long long)p->layout.shard_tokens, (long long)shape->batch,
                             (long long)shape->heads, (long long)shape->head_dim);
        goto err;
    }
    p->link = link;
    p->shape = *shape;
    p->pool = opts->pool;
    p->hooks = *opts;
    p->timeout_s =
        opts->step_timeout_s == 0.0 ? STRIA_RING_DEFAULT_TIMEOUT_S : opts->step_timeout_s;
    p->pass_id = opts->pass_id;
    p->rank = stria_link_rank(link);
    p->n = stria_link_size(link);
    n = (size_t)p->n;
    p->runs = calloc(n, sizeof(*p->runs));
    p->n_runs = calloc(n, sizeof(*p->n_runs));
    p->valid = calloc(n, sizeof(*p->valid));
    p->pos_min = calloc(n, sizeof(*p->pos_min));
    p->pos_max = calloc(n, sizeof(*p->pos_max));
    p->stats = calloc(n, sizeof(*p->stats));
    if (p->runs == NULL || p->n_runs == NULL || p->valid == NULL || p->pos_min == NULL ||
        p->pos_max == NULL || p->stats == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "stria_ring_pass_create: out of memory");
        goto err;
    }
    for (int r = 0; r < p->n; r++) {
        stria_layout_run_t lr[STRIA_LAYOUT_MAX_RUNS];
        size_t nr = stria_layout_shard_runs(&p->layout, r, false, lr);
        p->n_runs[r] = nr;
        p->pos_min[r] = INT64_MAX;
        p->pos_max[r] = INT64_MIN;
        for (size_t i = 0; i < nr; i++) {
            int64_t last = lr[i].first + (lr[i].count - 1) * lr[i].stride;
            p->runs[r][i] = (stria_pos_run_t){lr[i].first, lr[i].stride, lr[i].count};
            p->valid[r] += lr[i].count;
            p->pos_min[r] = lr[i].first < p->pos_min[r] ? lr[i].first : p->pos_min[r];
            p->pos_max[r] = last > p->pos_max[r] ? last : p->pos_max[r];
        }
    }
    *pass_out = p;
    return STRIA_OK;
err:
    stria_ring_pass_destroy(p);
    return st;
}

const stria_layout_t *stria_ring_pass_layout(const stria_ring_pass_t *pass)
{
    return pass != NULL ? &pass->layout : NULL;
}

const stria_ring_step_stats_t *stria_ring_pass_stats(const stria_ring_pass_t *pass,
                                                     size_t *n_steps_out)
{
    if (pass == NULL)
        return NULL;
    if (n_steps_out != NULL)
        *n_steps_out = (size_t)pass->n;
    return pass->stats;
}

/* ---- helpers ------------------------------------------------------------- */

#define STRIA__HUGE_PAGE ((size_t)2 << 20)

static size_t stria__round64(size_t x)
{
    return (x + 63) & ~(size_t)63;
}

/* The working buffers of a call, kept for the next call: a daemon runs many
 * passes on one object, and fresh buffers would cost a page fault per 4 KiB
 * every time. Large ones ask for transparent huge pages. */
static char *stria__arena(stria_ring_pass_t *p, size_t size)
{
    void *ptr = NULL;
    size_t align = size >= STRIA__HUGE_PAGE ? STRIA__HUGE_PAGE : 64;

    if (p->arena != NULL && p->arena_size >= size)
        return p->arena;
    free(p->arena);
    p->arena = NULL;
    p->arena_size = 0;
    size = (size + align - 1) / align * align;
    if (posix_memalign(&ptr, align, size) != 0)
        return NULL;
    if (align == STRIA__HUGE_PAGE)
        (void)madvise(ptr, size, MADV_HUGEPAGE); /* advisory: ignore failure */
    p->arena = ptr;
    p->arena_size = size;
    return ptr;
}

/* Next `bytes` of an arena, 64-byte aligned. */
static void *stria__carve(char **cursor, size_t bytes)
{
    void *at = *cursor;
    *cursor += stria__round64(bytes);
    return at;
}

static stria_status_t stria__check_view(const stria_tensor_t *t, const char *fn, const char *name,
                                        bool need_storage_dtype, stria_dtype_t dtype)
{
    if (t == NULL || t->data == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: tensor %s is NULL", fn, name);
    if (stria_dtype_size(t->dtype) == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: tensor %s has unknown dtype %d", fn,
                               name, (int)t->dtype);
    if (need_storage_dtype && t->dtype != dtype)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: tensor %s is %s but the pass computes in %s", fn, name,
                               stria_dtype_name(t->dtype), stria_dtype_name(dtype));
    if (t->stride_batch < 0 || t->stride_token < 0 || t->stride_head < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: tensor %s has negative strides", fn,
                               name);
    return STRIA_OK;
}

static inline char *stria__row(const stria_tensor_t *t, int64_t b, int64_t tok, int64_t h)
{
    return (char *)t->data +
           (size_t)(b * t->stride_batch + tok * t->stride_token + h * t->stride_head) *
               stria_dtype_size(t->dtype);
}

/* Copies a [B, L, heads, D] view into contiguous memory of the same dtype. */
static void stria__pack_view(const stria_tensor_t *t, int64_t B, int64_t L, int64_t heads,
                             int64_t D, char *dst)
{
    size_t row = (size_t)D * stria_dtype_size(t->dtype);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < L; i++)
            for (int64_t h = 0; h < heads; h++) {
                memcpy(dst, stria__row(t, b, i, h), row);
                dst += row;
            }
}

/* Writes contiguous fp32 [B, L, heads, D] rows [0, valid) into a view of any
 * dtype and zeros rows [valid, L). */
static void stria__store_view(const float *src, int64_t B, int64_t L, int64_t valid, int64_t heads,
                              int64_t D, const stria_tensor_t *t)
{
    size_t es = stria_dtype_size(t->dtype);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < L; i++)
            for (int64_t h = 0; h < heads; h++) {
                char *dst = stria__row(t, b, i, h);
                if (i < valid)
                    stria_dtype_convert(STRIA_DTYPE_F32, src + ((b * L + i) * heads + h) * D,
                                        t->dtype, dst, (size_t)D);
                else
                    memset(dst, 0, (size_t)D * es);
            }
}

/* Zeros rows [from, L) of a [B, L, heads, D] view: the padded tokens. */
static void stria__zero_rows(const stria_tensor_t *t, int64_t B, int64_t from, int64_t L,
                             int64_t heads, int64_t D)
{
    size_t row = (size_t)D * stria_dtype_size(t->dtype);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = from; i < L; i++)
            for (int64_t h = 0; h < heads; h++)
                memset(stria__row(t, b, i, h), 0, row);
}

/* Whether some real key of block j is visible to some real query of this
 * rank's shard. Skipping the others is Ring Attention's causal block
 * skipping; the kernel would skip their tiles anyway, this also saves the
 * packing. */
static bool stria__visible(const stria_ring_pass_t *p, int j)
{
    if (p->valid[p->rank] == 0 || p->valid[j] == 0)
        return false;
    return !p->shape.causal || p->pos_min[j] <= p->pos_max[p->rank];
}

static stria_attn_params_t stria__params(const stria_ring_pass_t *p, int j)
{
    stria_attn_params_t a;
    memset(&a, 0, sizeof(a));
    a.batch = p->shape.batch;
    a.q_tokens = p->valid[p->rank];
    a.kv_tokens = p->valid[j] > 0 ? p->valid[j] : 1;
    a.heads = p->shape.heads;
    a.kv_heads = p->shape.kv_heads;
    a.head_dim = p->shape.head_dim;
    a.scale = p->shape.scale;
    a.causal = p->shape.causal;
    a.q_pos.runs = p->runs[p->rank];
    a.q_pos.n_runs = p->n_runs[p->rank];
    a.kv_pos.runs = p->runs[j];
    a.kv_pos.n_runs = p->n_runs[j];
    a.pool = p->pool;
    return a;
}

static void stria__step_begin(stria_ring_pass_t *p, int step)
{
    if (p->hooks.step_cb != NULL)
        p->hooks.step_cb(p->hooks.step_cb_ctx, step, p->n);
}

/* Compute of a step: timed as thread CPU and wall time, between the
 * caller's hooks. */
typedef struct {
    double cpu, wall;
} stria__clock_t;

static void stria__compute_begin(stria_ring_pass_t *p, stria__clock_t *clk)
{
    if (p->hooks.compute_begin_cb != NULL)
        p->hooks.compute_begin_cb(p->hooks.compute_cb_ctx);
    clk->cpu = stria_time_thread_cpu();
    clk->wall = stria_time_now();
}

static void stria__compute_end(stria_ring_pass_t *p, const stria__clock_t *clk,
                               stria_ring_step_stats_t *ss)
{
    ss->compute_s += stria_time_thread_cpu() - clk->cpu;
    ss->compute_wall_s += stria_time_now() - clk->wall;
    if (p->hooks.compute_end_cb != NULL)
        p->hooks.compute_end_cb(p->hooks.compute_cb_ctx);
}

/* The requests a pass may have outstanding at once. */
typedef struct {
    stria_link_req_t *kv_send, *kv_recv, *dkv_recv, *dkv_send[2];
} stria__reqs_t;

static void stria__cancel_all(stria_ring_pass_t *p, stria__reqs_t *r)
{
    stria_link_req_t **all[] = {&r->kv_send, &r->kv_recv, &r->dkv_recv, &r->dkv_send[0],
                                &r->dkv_send[1]};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        stria_link_cancel(p->link, *all[i]);
        *all[i] = NULL;
    }
}

/* Waits for *req (if any) within the step deadline and clears it; the link
 * releases the request whatever the outcome. */
static stria_status_t stria__wait(stria_ring_pass_t *p, stria_link_req_t **req, int step,
                                  stria_ring_step_stats_t *stats)
{
    stria_status_t st;
    double t0, timeout = -1.0;
    if (*req == NULL)
        return STRIA_OK;
    t0 = stria_time_now();
    /* Cumulative deadlines: when ranks block on each other in a chain, the
     * one blocked since the earliest step (next to the failed rank) reaches
     * its deadline first, so the abort names the right rank. The floor keeps
     * a rank that was itself slow from failing a transfer that is about to
     * complete. */
    if (p->timeout_s >= 0) {
        timeout = p->t_start + (double)(step + 1) * p->timeout_s - t0;
        if (timeout < 0.1 * p->timeout_s)
            timeout = 0.1 * p->timeout_s;
    }
    st = stria_link_wait(p->link, *req, timeout);
    *req = NULL;
    stats->wait_s += stria_time_now() - t0;
    return st;
}

static stria_status_t stria__post(stria_ring_pass_t *p, bool send, int step, int kind, void *buf,
                                  size_t len, stria_link_req_t **req,
                                  stria_ring_step_stats_t *stats)
{
    uint64_t tag = stria__tag(p, step, kind);
    stria_status_t st = send ? stria_link_isend(p->link, tag, buf, len, req)
                             : stria_link_irecv(p->link, tag, buf, len, req);
    if (st == STRIA_OK) {
        if (send)
            stats->bytes_sent += len;
        else
            stats->bytes_recv += len;
    }
    return st;
}

/* Ends a failed pass: names this rank and step, tells the other ranks, and
 * releases every request. */
static stria_status_t stria__fail(stria_ring_pass_t *p, stria__reqs_t *reqs, stria_status_t st,
                                  const char *what, int step)
{
    stria_error_wrap(st, "rank %d, %s step %d", p->rank, what, step);
    /* Abort even when a peer's abort caused this error: a link that only
     * detects failures of its neighbours relies on every rank passing it on
     * (the first abort's origin is what the other ranks report). */
    stria_link_abort(p->link, st, stria_error_msg());
    stria__cancel_all(p, reqs);
    return st;
}

/* Agreement at the end of a pass: no rank returns success unless every rank
 * finished. Every rank sends one token per round and sends round t only after
 * it received round t - 1, so a token of round t from r - 1 proves that ranks
 * r - t .. r - 1 finished; after N - 1 rounds each rank has heard from all.
 * A rank that failed never sends, and its abort wakes the ranks waiting for
 * it. (A rank that fails during the agreement itself may leave others
 * reporting success: their outputs are complete by then.) */
static stria_status_t stria__agree(stria_ring_pass_t *p, stria__reqs_t *reqs, int first_step,
                                   stria_ring_step_stats_t *ss)
{
    uint64_t token = 0, in = 0;
    stria_status_t st = STRIA_OK;
    for (int t = 1; t < p->n && st == STRIA_OK; t++) {
        st = stria__post(p, false, t, STRIA__MSG_DONE, &in, sizeof(in), &reqs->kv_recv, ss);
        if (st == STRIA_OK)
            st =
                stria__post(p, true, t, STRIA__MSG_DONE, &token, sizeof(token), &reqs->kv_send, ss);
        if (st == STRIA_OK)
            st = stria__wait(p, &reqs->kv_recv, first_step + t - 1, ss);
        if (st == STRIA_OK)
            st = stria__wait(p, &reqs->kv_send, first_step + t - 1, ss);
    }
    return st;
}

/* ---- forward ------------------------------------------------------------- */

stria_status_t stria_ring_fwd(stria_ring_pass_t *pass, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *o, float *lse)
{
    static const char fn[] = "stria_ring_fwd";
    stria_ring_pass_t *p = pass;
    stria__reqs_t reqs;
    stria_status_t st;
    char *kvbuf = NULL;
    float *o_acc = NULL, *lse_acc = NULL;
    int step = 0;

    memset(&reqs, 0, sizeof(reqs));
    if (p == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: pass is NULL", fn);
    p->call = p->calls++;
    p->t_start = stria_time_now();
    if ((st = stria__check_view(q, fn, "q", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(k, fn, "k", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(v, fn, "v", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(o, fn, "o", false, p->shape.dtype)) != STRIA_OK)
        return stria__fail(p, &reqs, st, "forward", 0);
    if (lse == NULL)
        return stria__fail(p, &reqs, stria_error_set(STRIA_ERR_INVALID_ARG, "%s: lse is NULL", fn),
                           "forward", 0);

    const int N = p->n, r = p->rank;
    const int64_t B = p->shape.batch, L = p->layout.shard_tokens, H = p->shape.heads;
    const int64_t Hkv = p->shape.kv_heads, D = p->shape.head_dim, qv = p->valid[r];
    const size_t es = stria_dtype_size(p->shape.dtype);
    const size_t kv_bytes = (size_t)(B * L * Hkv * D) * es, msg = 2 * kv_bytes;

    const size_t o_bytes = (size_t)(B * L * H * D) * sizeof(float);
    const size_t lse_bytes = (size_t)(B * H * (qv > 0 ? qv : 1)) * sizeof(float);
    char *arena = stria__arena(p, 2 * stria__round64(msg) + stria__round64(o_bytes) +
                                      stria__round64(lse_bytes));

    memset(p->stats, 0, (size_t)N * sizeof(*p->stats));
    if (arena == NULL) {
        st = stria__fail(p, &reqs,
                         stria_error_set(STRIA_ERR_NO_MEMORY,
                                         "cannot allocate %zu MiB of ring buffers",
                                         (2 * msg + o_bytes) >> 20),
                         "forward", 0);
        goto out;
    }
    kvbuf = stria__carve(&arena, 2 * stria__round64(msg));
    o_acc = stria__carve(&arena, o_bytes);
    lse_acc = stria__carve(&arena, lse_bytes);
    stria__pack_view(k, B, L, Hkv, D, kvbuf);
    stria__pack_view(v, B, L, Hkv, D, kvbuf + kv_bytes);

    stria_attn_params_t base = stria__params(p, r);
    stria_tensor_t to = stria_tensor_contiguous(o_acc, STRIA_DTYPE_F32, L, H, D);
    if (qv > 0 && (st = stria_attn_partial_init(&base, &to, lse_acc)) != STRIA_OK) {
        st = stria__fail(p, &reqs, st, "forward", 0);
        goto out;
    }
    for (step = 0; step < N; step++) {
        stria__step_begin(p, step);
        stria_ring_step_stats_t *ss = &p->stats[step];
        int j = (r - step + N) % N;
        char *cur = kvbuf + (size_t)(step % 2) * stria__round64(msg);
        char *nxt = kvbuf + (size_t)((step + 1) % 2) * stria__round64(msg);

        ss->src_rank = j;
        /* Post the next block's transfer before computing on this one. */
        if (step + 1 < N) {
            st = stria__post(p, false, step + 1, STRIA__MSG_KV, nxt, msg, &reqs.kv_recv, ss);
            if (st == STRIA_OK)
                st = stria__post(p, true, step + 1, STRIA__MSG_KV, cur, msg, &reqs.kv_send, ss);
            if (st != STRIA_OK)
                break;
        }
        if (stria__visible(p, j)) {
            stria_attn_params_t a = stria__params(p, j);
            stria_tensor_t tk = stria_tensor_contiguous(cur, p->shape.dtype, L, Hkv, D);
            stria_tensor_t tv = stria_tensor_contiguous(cur + kv_bytes, p->shape.dtype, L, Hkv, D);
            stria__clock_t clk;
            stria__compute_begin(p, &clk);
            st = stria_attn_fwd(&a, q, &tk, &tv, &to, lse_acc, true);
            stria__compute_end(p, &clk, ss);
            ss->computed = true;
            if (st != STRIA_OK)
                break;
        }
        if ((st = stria__wait(p, &reqs.kv_recv, step, ss)) != STRIA_OK ||
            (st = stria__wait(p, &reqs.kv_send, step, ss)) != STRIA_OK)
            break;
    }
    if (st == STRIA_OK)
        st = stria__agree(p, &reqs, N, &p->stats[N - 1]);
    if (st != STRIA_OK) {
        st = stria__fail(p, &reqs, st, "forward", step);
        goto out;
    }

    if (qv > 0 && (st = stria_attn_finalize(&base, &to, o)) != STRIA_OK) {
        st = stria__fail(p, &reqs, st, "forward", N - 1);
        goto out;
    }
    stria__zero_rows(o, B, qv, L, H, D);
    for (int64_t bh = 0; bh < B * H; bh++)
        for (int64_t i = 0; i < L; i++)
            lse[bh * L + i] = i < qv ? lse_acc[bh * qv + i] : -INFINITY;
    st = STRIA_OK;
out:
    return st;
}

/* ---- backward ------------------------------------------------------------ */

stria_status_t stria_ring_bwd(stria_ring_pass_t *pass, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *o, const float *lse, const stria_tensor_t *d_o,
                              const stria_tensor_t *dq, const stria_tensor_t *dk,
                              const stria_tensor_t *dv)
{
    static const char fn[] = "stria_ring_bwd";
    stria_ring_pass_t *p = pass;
    stria__reqs_t reqs;
    stria_status_t st;
    char *kvbuf = NULL;
    float *dq_acc = NULL, *lse_c = NULL, *delta = NULL;
    int step = 0;

    memset(&reqs, 0, sizeof(reqs));
    if (p == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: pass is NULL", fn);
    p->call = p->calls++;
    p->t_start = stria_time_now();
    if ((st = stria__check_view(q, fn, "q", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(k, fn, "k", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(v, fn, "v", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(o, fn, "o", false, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(d_o, fn, "d_o", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(dq, fn, "dq", false, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(dk, fn, "dk", false, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(dv, fn, "dv", false, p->shape.dtype)) != STRIA_OK)
        return stria__fail(p, &reqs, st, "backward", 0);
    if (lse == NULL)
        return stria__fail(p, &reqs, stria_error_set(STRIA_ERR_INVALID_ARG, "%s: lse is NULL", fn),
                           "backward", 0);
    if (dq->data == dk->data || dq->data == dv->data || dk->data == dv->data)
        return stria__fail(
            p, &reqs,
            stria_error_set(STRIA_ERR_INVALID_ARG, "%s: dq, dk and dv must not alias", fn),
            "backward", 0);

    const int N = p->n, r = p->rank;
    const int64_t B = p->shape.batch, L = p->layout.shard_tokens, H = p->shape.heads;
    const int64_t Hkv = p->shape.kv_heads, D = p->shape.head_dim, qv = p->valid[r];
    const int64_t rows = qv > 0 ? qv : 1;
    const size_t es = stria_dtype_size(p->shape.dtype);
    const size_t kv_elems = (size_t)(B * L * Hkv * D);
    const size_t kv_bytes = kv_elems * es, msg = 2 * kv_bytes;
    const size_t dkv_elems = 2 * kv_elems, dkv_bytes = dkv_elems * sizeof(float);

    const size_t dq_bytes = (size_t)(B * L * H * D) * sizeof(float);
    const size_t row_bytes = (size_t)(B * H * rows) * sizeof(float);
    char *arena = stria__arena(p, 2 * stria__round64(msg) + 3 * stria__round64(dkv_bytes) +
                                      stria__round64(dq_bytes) + 2 * stria__round64(row_bytes));

    memset(p->stats, 0, (size_t)N * sizeof(*p->stats));
    if (arena == NULL) {
        st = stria__fail(p, &reqs,
                         stria_error_set(STRIA_ERR_NO_MEMORY,
                                         "cannot allocate %zu MiB of ring buffers",
                                         (2 * msg + 3 * dkv_bytes) >> 20),
                         "backward", 0);
        goto out;
    }
    kvbuf = stria__carve(&arena, 2 * stria__round64(msg));
    /* dkv: two buffers for this rank's contributions (one may still be in
     * flight while the next step fills the other), then the running sum
     * received from the predecessor. Each is dK then dV, fp32 [B, L, Hkv, D]. */
    float *part[2] = {stria__carve(&arena, dkv_bytes), stria__carve(&arena, dkv_bytes)};
    float *dkv_in = stria__carve(&arena, dkv_bytes);
    dq_acc = stria__carve(&arena, dq_bytes);
    lse_c = stria__carve(&arena, row_bytes);
    delta = stria__carve(&arena, row_bytes);
    memset(dq_acc, 0, dq_bytes);

    stria__pack_view(k, B, L, Hkv, D, kvbuf);
    stria__pack_view(v, B, L, Hkv, D, kvbuf + kv_bytes);
    /* The kernels take LSE and D for the real query rows only. */
    for (int64_t bh = 0; bh < B * H; bh++)
        for (int64_t i = 0; i < qv; i++)
            lse_c[bh * qv + i] = lse[bh * L + i];
    stria_attn_params_t base = stria__params(p, r);
    stria_tensor_t tdq = stria_tensor_contiguous(dq_acc, STRIA_DTYPE_F32, L, H, D);
    if (qv > 0) {
        stria__clock_t clk;
        stria__compute_begin(p, &clk);
        st = stria_attn_bwd_delta(&base, o, d_o, delta);
        stria__compute_end(p, &clk, &p->stats[0]);
        if (st != STRIA_OK) {
            st = stria__fail(p, &reqs, st, "backward", 0);
            goto out;
        }
    }

    for (step = 0; step < N; step++) {
        stria__step_begin(p, step);
        stria_ring_step_stats_t *ss = &p->stats[step];
        int j = (r - step + N) % N;
        char *cur = kvbuf + (size_t)(step % 2) * stria__round64(msg);
        char *nxt = kvbuf + (size_t)((step + 1) % 2) * stria__round64(msg);
        float *mine = part[step % 2];

        ss->src_rank = j;
        if (step + 1 < N) {
            st = stria__post(p, false, step + 1, STRIA__MSG_KV, nxt, msg, &reqs.kv_recv, ss);
            if (st == STRIA_OK)
                st = stria__post(p, true, step + 1, STRIA__MSG_KV, cur, msg, &reqs.kv_send, ss);
            if (st != STRIA_OK)
                break;
        }
        /* The running dK/dV sum of block j from ranks j .. r-1. */
        if (step > 0 && (st = stria__post(p, false, step, STRIA__MSG_DKV, dkv_in, dkv_bytes,
                                          &reqs.dkv_recv, ss)) != STRIA_OK)
            break;
        if ((st = stria__wait(p, &reqs.dkv_send[step % 2], step, ss)) != STRIA_OK)
            break;
        memset(mine, 0, dkv_bytes);
        stria__clock_t clk;
        stria__compute_begin(p, &clk);
        if (stria__visible(p, j)) {
            stria_attn_params_t a = stria__params(p, j);
            stria_tensor_t tk = stria_tensor_contiguous(cur, p->shape.dtype, L, Hkv, D);
            stria_tensor_t tv = stria_tensor_contiguous(cur + kv_bytes, p->shape.dtype, L, Hkv, D);
            stria_tensor_t tdk = stria_tensor_contiguous(mine, STRIA_DTYPE_F32, L, Hkv, D);
            stria_tensor_t tdv =
                stria_tensor_contiguous(mine + kv_elems, STRIA_DTYPE_F32, L, Hkv, D);
            st = stria_attn_bwd(&a, q, &tk, &tv, d_o, lse_c, delta, &tdq, &tdk, &tdv);
            ss->computed = true;
        }
        stria__compute_end(p, &clk, ss);
        if (st != STRIA_OK)
            break;
        if (step > 0) {
            if ((st = stria__wait(p, &reqs.dkv_recv, step, ss)) != STRIA_OK)
                break;
            stria__compute_begin(p, &clk);
            for (size_t i = 0; i < dkv_elems; i++)
                mine[i] += dkv_in[i];
            stria__compute_end(p, &clk, ss);
        }
        if (N > 1 && (st = stria__post(p, true, step + 1, STRIA__MSG_DKV, mine, dkv_bytes,
                                       &reqs.dkv_send[step % 2], ss)) != STRIA_OK)
            break;
        if ((st = stria__wait(p, &reqs.kv_recv, step, ss)) != STRIA_OK ||
            (st = stria__wait(p, &reqs.kv_send, step, ss)) != STRIA_OK)
            break;
    }
    /* After N hops the sum of this rank's own block comes back from r - 1. */
    const float *total = part[0];
    if (st == STRIA_OK && N > 1) {
        stria_ring_step_stats_t *ss = &p->stats[N - 1];
        step = N;
        total = dkv_in;
        if ((st = stria__post(p, false, N, STRIA__MSG_DKV, dkv_in, dkv_bytes, &reqs.dkv_recv,
                              ss)) == STRIA_OK &&
            (st = stria__wait(p, &reqs.dkv_recv, N, ss)) == STRIA_OK &&
            (st = stria__wait(p, &reqs.dkv_send[0], N, ss)) == STRIA_OK)
            st = stria__wait(p, &reqs.dkv_send[1], N, ss);
    }
    if (st == STRIA_OK)
        st = stria__agree(p, &reqs, N + 1, &p->stats[N - 1]);
    if (st != STRIA_OK) {
        st = stria__fail(p, &reqs, st, "backward", step);
        goto out;
    }
    stria__store_view(dq_acc, B, L, qv, H, D, dq);
    stria__store_view(total, B, L, qv, Hkv, D, dk);
    stria__store_view(total + kv_elems, B, L, qv, Hkv, D, dv);
    st = STRIA_OK;
out:
    return st;
}
