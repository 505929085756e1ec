/*
 * The ring engine: one rank's side of a forward or backward pass. See
 * stria_ring.h for the algorithm; the comments here explain the choices the
 * header does not.
 */
#include "ring_int.h"
#include "validate_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* Tag = call id (40 bits) | step (16) | kind (8): a message of another call,
 * step or kind can never match. The call id is the caller's (a session's
 * call number, stria_ring_pass_set_call()) or pass id (32 bits) | call
 * number on the link mod 256 (8). */
uint64_t stria__tag(const stria_ring_pass_t *p, int step, int kind)
{
    return ((p->call_id & STRIA_RING_CALL_ID_MASK) << 24) | ((uint64_t)(unsigned)step << 8) |
           (uint64_t)kind;
}

stria_status_t stria_ring_pass_set_call(stria_ring_pass_t *pass, uint64_t call_id)
{
    if (pass == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_ring_pass_set_call: NULL pass");
    if (atomic_load(&pass->running))
        return stria_error_set(
            STRIA_ERR_BUSY, "stria_ring_pass_set_call: a pass of rank %d is running", pass->rank);
    pass->next_call_id = call_id;
    pass->has_next_call_id = true;
    return STRIA_OK;
}

/* ---- creation ------------------------------------------------------------ */

stria_status_t stria__check_shape(const stria_ring_shape_t *s)
{
    const stria_call_shape_t *c = &s->call;
    if (c->batch < 1 || c->seq_len < 1 || s->heads < 1 || s->kv_heads < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ring shape: batch (%lld), seq_len (%lld), heads (%lld) and "
                               "kv_heads (%lld) must be >= 1",
                               (long long)c->batch, (long long)c->seq_len, (long long)s->heads,
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
    if (!(c->scale >= 0.0f) || isinf(c->scale))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ring shape: scale must be finite and > 0 (0 for the default)");
    if (stria_dtype_size(s->dtype) == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ring shape: unknown dtype %d",
                               (int)s->dtype);
    stria_status_t st = stria_call_masks_check(c);
    return st == STRIA_OK ? st : stria_error_wrap(st, "ring shape");
}

static void stria__ring_arena_free(stria_ring_pass_t *p);

void stria_ring_pass_destroy(stria_ring_pass_t *pass)
{
    if (pass == NULL)
        return;
    stria__pass_positions_free(pass);
    stria_docplan_unref(pass->plan);
    free(pass->stats);
    stria__ring_arena_free(pass);
    if (pass->dev != NULL) {
        stria_device_free(pass->dev, pass->dmem);
        stria_device_host_free(pass->dev, pass->hmem);
        if (pass->own_dev)
            stria_device_close(pass->dev);
    }
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
    if ((st = stria_docplan_layout(layout, &shape->call, stria_link_size(link), &p->layout,
                                   &p->plan)) != STRIA_OK)
        goto err;
    /* Every buffer of a pass must be addressable: reject shapes whose largest
     * tensor (a shard of Q or K/V in fp32, twice) does not fit in memory
     * sizes. */
    if (p->layout.shard_tokens > INT32_MAX ||
        __builtin_mul_overflow(shape->call.batch, p->layout.shard_tokens, &elems) ||
        __builtin_mul_overflow(elems, shape->heads, &elems) ||
        __builtin_mul_overflow(elems, shape->head_dim, &elems) ||
        __builtin_mul_overflow(elems, (int64_t)8, &elems)) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "stria_ring_pass_create: shards of %lld tokens x batch %lld x %lld "
                             "heads x %lld are too large",
                             (long long)p->layout.shard_tokens, (long long)shape->call.batch,
                             (long long)shape->heads, (long long)shape->head_dim);
        goto err;
    }
    p->link = link;
    p->shape = *shape;
    p->pool = opts->pool;
    if (opts->device != NULL) {
        p->dev = opts->device;
    } else {
        if ((st = stria_device_open("cpu", opts->pool, &p->dev)) != STRIA_OK)
            goto err;
        p->own_dev = true;
    }
    p->staged = !stria_device_host_visible(p->dev);
    if (p->staged && p->plan != NULL) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "stria_ring_pass_create: the packed layout "
                             "runs on host memory only (device %s)",
                             stria_device_name(p->dev));
        goto err;
    }
    p->dev_timed = stria_device_kind(p->dev) != STRIA_DEVICE_CPU;
    p->hooks = *opts;
    if (opts->host_memory != NULL)
        p->mem = *opts->host_memory;
    p->timeout_s =
        opts->step_timeout_s == 0.0 ? STRIA_RING_DEFAULT_TIMEOUT_S : opts->step_timeout_s;
    p->pass_id = opts->pass_id;
    p->rank = stria_link_rank(link);
    p->n = stria_link_size(link);
    n = (size_t)p->n;
    p->stats = calloc(n, sizeof(*p->stats));
    if (p->stats == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "stria_ring_pass_create: out of memory");
        goto err;
    }
    if ((st = stria__pass_positions(p)) != STRIA_OK)
        goto err;
    p->fwd_steps = opts->all_hops ? p->n : stria__fwd_steps(p);
    *pass_out = p;
    return STRIA_OK;
err:
    stria_ring_pass_destroy(p);
    return st;
}

stria_status_t stria_ring_pass_set_link(stria_ring_pass_t *pass, stria_link_t *link)
{
    static const char fn[] = "stria_ring_pass_set_link";
    if (pass == NULL || link == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: NULL argument", fn);
    if (atomic_load(&pass->running))
        return stria_error_set(STRIA_ERR_BUSY,
                               "%s: a pass of rank %d is running on this object; rebind only "
                               "between passes",
                               fn, pass->rank);
    if (stria_link_rank(link) != pass->rank || stria_link_size(link) != pass->n)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: the pass object is rank %d of a ring of %d, the link (%s) is "
                               "rank %d of a ring of %d",
                               fn, pass->rank, pass->n, link->ops->name, stria_link_rank(link),
                               stria_link_size(link));
    if (link == pass->link)
        return STRIA_OK;
    /* A new link is a new message space: calls count from 0 again, so the
     * tags are those of a fresh pass object, and a rank that skipped a call
     * on the old link (it failed before calling) agrees with the others. */
    pass->link = link;
    pass->calls = 0;
    return STRIA_OK;
}

const stria_layout_t *stria_ring_pass_layout(const stria_ring_pass_t *pass)
{
    return pass != NULL ? &pass->layout : NULL;
}

int stria_ring_pass_steps(const stria_ring_pass_t *pass)
{
    return pass != NULL ? pass->steps_run : 0;
}

int stria_ring_pass_fwd_steps(const stria_ring_pass_t *pass)
{
    return pass != NULL ? pass->fwd_steps : 0;
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
 * every time. Large ones ask for transparent huge pages. From the options'
 * allocator when there is one (a worker's pool, which does the same). */
static void stria__ring_arena_free(stria_ring_pass_t *p)
{
    if (p->mem.alloc != NULL)
        p->mem.free(p->mem.ctx, p->arena);
    else
        free(p->arena);
    p->arena = NULL;
    p->arena_size = 0;
}

static char *stria__arena(stria_ring_pass_t *p, size_t size)
{
    void *ptr = NULL;
    size_t align = size >= STRIA__HUGE_PAGE ? STRIA__HUGE_PAGE : 64;

    if (p->arena != NULL && p->arena_size >= size)
        return p->arena;
    stria__ring_arena_free(p);
    size = (size + align - 1) / align * align;
    if (p->mem.alloc != NULL) {
        if ((ptr = p->mem.alloc(p->mem.ctx, size)) == NULL)
            return NULL;
    } else {
        if (posix_memalign(&ptr, align, size) != 0)
            return NULL;
        if (align == STRIA__HUGE_PAGE)
            (void)madvise(ptr, size, MADV_HUGEPAGE); /* advisory: ignore failure */
    }
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
    stria_status_t st = stria__validate_view(t, fn, name);
    if (st != STRIA_OK)
        return st;
    if (need_storage_dtype && t->dtype != dtype)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: tensor %s is %s but the pass computes in %s", fn, name,
                               stria_dtype_name(t->dtype), stria_dtype_name(dtype));
    if (t->stride_batch < 0 || t->stride_token < 0 || t->stride_head < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: tensor %s has negative strides", fn,
                               name);
    return STRIA_OK;
}

/* Copies a [B, L, heads, D] view into a head-major message block of the same
 * dtype ([B][heads][L][D], stria_tensor_head_major): the rows of one head are
 * adjacent, so the forward kernel reads fp32 V rows in place. */
void stria__pack_view(const stria_tensor_t *t, int64_t B, int64_t L, int64_t heads, int64_t D,
                      char *dst)
{
    size_t row = (size_t)D * stria_dtype_size(t->dtype);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t i = 0; i < L; i++) {
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

/* ---- the K/V steps, shared by both directions ---------------------------- */

/* One fwd/bwd call: what its K/V steps share. The direction's own state
 * (stria__fwd_t, stria__bwd_t) starts with this struct, and its step
 * callbacks get this struct back. */
typedef struct {
    stria_ring_pass_t *p;
    const char *what; /* "forward" or "backward": error messages */
    stria__reqs_t reqs;
    const stria_tensor_t *k, *v; /* the caller's K/V: this rank's own block */
    /* The K/V blocks: messages in host memory (kvh) and, staged, their
     * device copies (kvd); on a host-visible device they are the same. K
     * then V, each head-major [B][Hkv][L][D]. */
    char *kvh[2], *kvd[2];
    size_t kv_bytes, msg; /* K (or V) of a block; a message: K then V */
    int steps;            /* K/V steps of this call (p->steps_run) */
} stria__call_t;

/* What a direction adds to the K/V steps of stria__ring_steps(). */
typedef struct {
    /* Opens the query side once, before step 0 (timed as step 0's compute);
     * only called when this rank has real queries. */
    stria_status_t (*open)(stria__call_t *c);
    /* Optional: after the K/V transfers of the step are posted, before its
     * compute. */
    stria_status_t (*prepare)(stria__call_t *c, int step, stria_ring_step_stats_t *ss);
    /* The compute of a step on block a->kv (visible: some real key of it is
     * visible to some real query here): enqueued or run, timed into ss with
     * stria__compute_end_dev(). */
    stria_status_t (*compute)(stria__call_t *c, int step, bool visible,
                              const stria_attn_params_t *a, const stria_tensor_t *k,
                              const stria_tensor_t *v, stria_ring_step_stats_t *ss, double *t_dev0);
    /* Optional: the step's own traffic after its compute (the dK/dV sum).
     * On the host it runs before the step's K/V waits, so that its send is
     * under way while they block; staged it runs after them, so that the
     * host -> device copy of the next block is enqueued before the host
     * waits for the compute stream. */
    stria_status_t (*traffic)(stria__call_t *c, int step, stria_ring_step_stats_t *ss);
    /* Optional: after the last step, before the agreement (the dK/dV sum
     * coming home): step N for errors and deadlines. */
    stria_status_t (*tail)(stria__call_t *c);
    int tail_steps; /* deadline steps the tail takes: the agreement's first
                     * round counts as step N + tail_steps */
} stria__dir_ops_t;

/* Starts a call of `steps` K/V steps: its number (part of every tag), its
 * clock (deadlines), and the checks of the views both directions take. */
/* Bytes of K (or V) in rank j's message: its stria__msg_rows() rows of every
 * batch row, head-major. */
static size_t stria__kv_half(const stria_ring_pass_t *p, int j)
{
    return (size_t)(p->shape.call.batch * stria__msg_rows(p, j) * p->shape.kv_heads *
                    p->shape.head_dim) *
           stria_dtype_size(p->shape.dtype);
}

static stria_status_t stria__call_begin(stria__call_t *c, stria_ring_pass_t *p, int steps,
                                        const char *fn, const char *what, const stria_tensor_t *q,
                                        const stria_tensor_t *k, const stria_tensor_t *v,
                                        const stria_tensor_t *o)
{
    stria_status_t st;
    memset(c, 0, sizeof(*c));
    c->p = p;
    c->what = what;
    c->k = k;
    c->v = v;
    c->kv_bytes = 0; /* the largest block's */
    for (int j = 0; j < p->n; j++)
        c->kv_bytes = stria__kv_half(p, j) > c->kv_bytes ? stria__kv_half(p, j) : c->kv_bytes;
    c->msg = 2 * c->kv_bytes;
    c->steps = steps;
    p->steps_run = steps;
    p->call = p->calls++;
    p->call_id = p->has_next_call_id ? p->next_call_id
                                     : ((uint64_t)p->pass_id << 8) | (uint64_t)(p->call & 0xffu);
    p->has_next_call_id = false;
    /* sends of a failed call were cancelled: none is waited for now */
    memset(p->sends, 0, sizeof(p->sends));
    p->t_start = stria_time_now();
    if ((st = stria__check_view(q, fn, "q", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(k, fn, "k", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(v, fn, "v", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(o, fn, "o", false, p->shape.dtype)) != STRIA_OK)
        return stria__fail(p, &c->reqs, st, what, 0);
    return STRIA_OK;
}

/* The working memory of a call, kept by the pass object: on the host one
 * arena of host_bytes (need_bytes, for the error message, is its main
 * part); staged, dev_bytes of device memory and pinned_bytes of pinned host
 * memory. The two K/V blocks come first; *dcur (staged only) and *hcur
 * point after them. This rank's own K/V are made a message in kvh[0]:
 * packed on the host, or downloaded once (for sending) when staged. */
static stria_status_t stria__call_mem(stria__call_t *c, size_t host_bytes, size_t need_bytes,
                                      size_t dev_bytes, size_t pinned_bytes, char **dcur,
                                      char **hcur)
{
    stria_ring_pass_t *p = c->p;
    const int64_t B = p->shape.call.batch, L = p->layout.shard_tokens, Hkv = p->shape.kv_heads;
    const int64_t D = p->shape.head_dim;
    const size_t msg64 = stria__round64(c->msg);
    stria_status_t st;
    if (!p->staged) {
        char *arena = stria__arena(p, host_bytes);
        if (arena == NULL)
            return p->mem.alloc != NULL
                       ? stria_error_wrap(STRIA_ERR_NO_MEMORY,
                                          "cannot allocate %zu MiB of ring buffers",
                                          need_bytes >> 20)
                       : stria_error_set(STRIA_ERR_NO_MEMORY,
                                         "cannot allocate %zu MiB of ring buffers",
                                         need_bytes >> 20);
        c->kvh[0] = c->kvd[0] = stria__carve(&arena, msg64);
        c->kvh[1] = c->kvd[1] = stria__carve(&arena, msg64);
        *dcur = NULL;
        *hcur = arena;
        /* the rows that travel (packed: its spread rows, a prefix) */
        const int64_t rows = stria__msg_rows(p, p->rank);
        stria__pack_view(c->k, B, rows, Hkv, D, c->kvh[0]);
        stria__pack_view(c->v, B, rows, Hkv, D, c->kvh[0] + stria__kv_half(p, p->rank));
        (void)L;
        return STRIA_OK;
    }
    if ((st = stria__staged_mem(p, dev_bytes, pinned_bytes, dcur, hcur)) != STRIA_OK)
        return st;
    c->kvd[0] = stria__carve(dcur, msg64);
    c->kvd[1] = stria__carve(dcur, msg64);
    c->kvh[0] = stria__carve(hcur, msg64);
    c->kvh[1] = stria__carve(hcur, msg64);
    /* Step 0's kernel reads the caller's k and v in place. */
    if (c->steps > 1)
        return stria__download_kv(p, c->k, c->v, c->kvh[0], c->kvh[1]);
    return STRIA_OK;
}

/* The end of a step's K/V transfers: block s + 1 has arrived and block s
 * has left. Staged, block s + 1 then goes to the device on the copy stream
 * while kernel s runs: the previous copy (which read the message buffer the
 * next receive lands in) is known done first, and kernel s + 1 is ordered
 * after the new copy. */
static stria_status_t stria__kv_arrived(stria__call_t *c, int step, stria_ring_step_stats_t *ss)
{
    stria_ring_pass_t *p = c->p;
    stria_status_t st;
    if ((st = stria__wait(p, &c->reqs.kv_recv, step, ss)) != STRIA_OK ||
        (st = stria__wait(p, &c->reqs.kv_send, step, ss)) != STRIA_OK)
        return st;
    if (!p->staged || step + 1 >= c->steps)
        return STRIA_OK;
    if ((st = stria_device_sync(p->dev, STRIA_STREAM_COPY)) != STRIA_OK ||
        (st = stria_device_copy(p->dev, STRIA_STREAM_COPY, c->kvd[(step + 1) % 2],
                                c->kvh[(step + 1) % 2], c->msg)) != STRIA_OK)
        return st;
    return stria_device_order(p->dev, STRIA_STREAM_COMPUTE, STRIA_STREAM_COPY);
}

/* Step s of rank r: the block of rank (r - s) mod N. The receive of block
 * s + 1 and the send of block s are posted before the compute on block s
 * (double buffering), and waited for after it. Staged, the device copy of
 * block s was enqueued at the end of step s - 1 and the compute stream
 * ordered after it; before anything of step s is enqueued on the compute
 * stream, the copy stream is ordered after the kernel of step s - 1, whose
 * device buffer the copy of block s + 1 will overwrite. */
static stria_status_t stria__kv_step(stria__call_t *c, const stria__dir_ops_t *ops, int step)
{
    stria_ring_pass_t *p = c->p;
    const int N = p->n, r = p->rank;
    const int64_t L = p->layout.shard_tokens, Hkv = p->shape.kv_heads, D = p->shape.head_dim;
    stria_ring_step_stats_t *ss = &p->stats[step];
    int j = (r - step + N) % N, next = (r - step - 1 + N) % N;
    char *blk = c->kvd[step % 2];
    /* step 0 reads this rank's k and v in place when its message is not the
     * whole shard (staged: downloaded; packed: its travelling rows only) */
    bool own = (p->staged || p->plan != NULL) && step == 0;
    const int64_t Lj = stria__msg_rows(p, j);
    const size_t half = stria__kv_half(p, j);
    double t_dev0 = 0.0;
    stria_status_t st;

    stria__step_begin(p, step);
    ss->src_rank = j;
    if (step + 1 < c->steps &&
        ((st = stria__post(p, false, step + 1, STRIA__MSG_KV, c->kvh[(step + 1) % 2],
                           p->plan != NULL ? 2 * stria__kv_half(p, next) : c->msg, &c->reqs.kv_recv,
                           ss)) != STRIA_OK ||
         (st = stria__post(p, true, step + 1, STRIA__MSG_KV, c->kvh[step % 2],
                           p->plan != NULL ? 2 * half : c->msg, &c->reqs.kv_send, ss)) != STRIA_OK))
        return st;
    if (p->staged && step + 1 < c->steps &&
        (st = stria_device_order(p->dev, STRIA_STREAM_COPY, STRIA_STREAM_COMPUTE)) != STRIA_OK)
        return st;
    if (ops->prepare != NULL && (st = ops->prepare(c, step, ss)) != STRIA_OK)
        return st;
    stria_attn_params_t a = stria__params(p, j, step > 0);
    stria_tensor_t tk = stria_tensor_head_major(blk, p->shape.dtype, Lj, Hkv, D);
    stria_tensor_t tv = stria_tensor_head_major(blk + (p->plan != NULL ? half : c->kv_bytes),
                                                p->shape.dtype, Lj, Hkv, D);
    (void)L;
    if ((st = ops->compute(c, step, stria__visible(p, j, step), &a, own ? c->k : &tk,
                           own ? c->v : &tv, ss, &t_dev0)) != STRIA_OK)
        return st;
    if (!p->staged && ops->traffic != NULL && (st = ops->traffic(c, step, ss)) != STRIA_OK)
        return st;
    if ((st = stria__kv_arrived(c, step, ss)) != STRIA_OK ||
        (st = stria__device_step_time(p, t_dev0, ss)) != STRIA_OK)
        return st;
    if (p->staged && ops->traffic != NULL)
        return ops->traffic(c, step, ss);
    return STRIA_OK;
}

/* The ring part of a call: the query side opened, N K/V steps, the tail and
 * the agreement. On failure the link is aborted, every request cancelled,
 * and the message names the rank and step. */
static stria_status_t stria__ring_steps(stria__call_t *c, const stria__dir_ops_t *ops)
{
    stria_ring_pass_t *p = c->p;
    stria_ring_step_stats_t *first = &p->stats[0], *last = &p->stats[c->steps - 1];
    stria_status_t st = STRIA_OK;
    int step = 0;
    if (p->valid[p->rank] > 0) {
        stria__clock_t clk;
        double t_dev0 = 0.0;
        stria__compute_begin(&clk);
        st = ops->open(c);
        stria__compute_end_dev(p, &clk, first, &t_dev0);
        if (st == STRIA_OK)
            st = stria__device_step_time(p, t_dev0, first);
        if (st != STRIA_OK)
            return stria__fail(p, &c->reqs, st, c->what, 0);
    }
    for (step = 0; step < c->steps; step++)
        if ((st = stria__kv_step(c, ops, step)) != STRIA_OK)
            break;
    if (st == STRIA_OK && ops->tail != NULL)
        st = ops->tail(c);
    if (st == STRIA_OK)
        st = stria__agree(p, &c->reqs, p->n + ops->tail_steps, last);
    if (st != STRIA_OK)
        return stria__fail(p, &c->reqs, st, c->what, step);
    return STRIA_OK;
}

/* ---- forward ------------------------------------------------------------- */

typedef struct {
    stria__call_t c; /* first: the step callbacks get &c */
    const stria_tensor_t *q;
    stria_device_fwd_pass_t *fpass; /* the query side, prepared once */
    stria_tensor_t to;              /* the fp32 O accumulator, head-major */
    float *o_acc, *lse_acc, *lse_h;
} stria__fwd_t;

static stria_status_t stria__fwd_open(stria__call_t *c)
{
    stria__fwd_t *f = (stria__fwd_t *)c;
    stria_attn_params_t base = stria__params(c->p, c->p->rank, false);
    stria_status_t st = stria_device_attn_partial_init(c->p->dev, &base, &f->to, f->lse_acc);
    if (st == STRIA_OK)
        st = stria_device_attn_fwd_begin(c->p->dev, &base, f->q, &f->fpass);
    return st;
}

/* Merges block j into the partial (O, LSE); an invisible block is skipped. */
static stria_status_t stria__fwd_compute(stria__call_t *c, int step, bool visible,
                                         const stria_attn_params_t *a, const stria_tensor_t *k,
                                         const stria_tensor_t *v, stria_ring_step_stats_t *ss,
                                         double *t_dev0)
{
    stria__fwd_t *f = (stria__fwd_t *)c;
    stria__clock_t clk;
    stria_status_t st;
    (void)step;
    if (!visible)
        return STRIA_OK;
    stria__compute_begin(&clk);
    st = stria_device_attn_fwd_block(f->fpass, a, k, v, &f->to, f->lse_acc, true);
    stria__compute_end_dev(c->p, &clk, ss, t_dev0);
    ss->computed = true;
    return st;
}

static const stria__dir_ops_t stria__fwd_ops = {
    .open = stria__fwd_open, .compute = stria__fwd_compute, .tail_steps = 0};

/* The forward pass's buffers. The O accumulator is head-major like the K/V
 * blocks: a query tile's rows are then adjacent, which cuts the cost of
 * merging each step's partial into it (cold, once per step). Staged: on the
 * device two K/V blocks, O and LSE accumulators; on the host two K/V
 * messages and room to pad the LSE ([B*H, L] + [B*H, qv]). */
static stria_status_t stria__fwd_buffers(stria__fwd_t *f)
{
    stria_ring_pass_t *p = f->c.p;
    const int64_t B = p->shape.call.batch, L = p->layout.shard_tokens, H = p->shape.heads;
    const int64_t D = p->shape.head_dim, qv = p->valid[p->rank];
    const size_t msg64 = stria__round64(f->c.msg);
    const size_t o_bytes = (size_t)(B * L * H * D) * sizeof(float);
    const size_t lse_bytes = (size_t)(B * H * (qv > 0 ? qv : 1)) * sizeof(float);
    const size_t lse_host = stria__round64((size_t)(B * H * L) * sizeof(float)) + lse_bytes;
    const size_t accs = stria__round64(o_bytes) + stria__round64(lse_bytes);
    char *dcur, *hcur;
    stria_status_t st;

    memset(p->stats, 0, (size_t)p->n * sizeof(*p->stats));
    if ((st = stria__call_mem(&f->c, 2 * msg64 + accs, 2 * f->c.msg + o_bytes, 2 * msg64 + accs,
                              2 * msg64 + lse_host, &dcur, &hcur)) != STRIA_OK)
        return st;
    char **acc = p->staged ? &dcur : &hcur;
    f->o_acc = stria__carve(acc, o_bytes);
    f->lse_acc = stria__carve(acc, lse_bytes);
    if (p->staged)
        f->lse_h = stria__carve(&hcur, lse_host);
    f->to = stria_tensor_head_major(f->o_acc, STRIA_DTYPE_F32, L, H, D);
    return STRIA_OK;
}

/* O rounded once to the caller's dtype, padded rows zeroed, LSE padded. */
static stria_status_t stria__fwd_store(stria__fwd_t *f, const stria_tensor_t *o, float *lse)
{
    stria_ring_pass_t *p = f->c.p;
    const int64_t B = p->shape.call.batch, L = p->layout.shard_tokens, H = p->shape.heads;
    const int64_t D = p->shape.head_dim, qv = p->valid[p->rank];
    stria_attn_params_t base = stria__params(p, p->rank, false);
    stria_status_t st;
    if (qv > 0 && (st = stria_device_attn_finalize(p->dev, &base, &f->to, o)) != STRIA_OK)
        return st;
    if (!p->staged) {
        stria__zero_rows(o, B, qv, L, H, D);
        return stria__store_lse(p, f->lse_acc, lse, NULL, B * H, L, qv);
    }
    if ((st = stria__device_zero_rows(p, o, B, qv, L, H, D)) != STRIA_OK ||
        (st = stria__store_lse(p, f->lse_acc, lse, f->lse_h, B * H, L, qv)) != STRIA_OK)
        return st;
    return stria__device_drain(p);
}

static stria_status_t stria__fwd(stria_ring_pass_t *p, const stria_tensor_t *q,
                                 const stria_tensor_t *k, const stria_tensor_t *v,
                                 const stria_tensor_t *o, float *lse)
{
    static const char fn[] = "stria_ring_fwd";
    stria__fwd_t f = {.q = q};
    stria_status_t st;

    if ((st = stria__call_begin(&f.c, p, p->fwd_steps, fn, "forward", q, k, v, o)) != STRIA_OK)
        return st;
    if (lse == NULL)
        return stria__fail(p, &f.c.reqs,
                           stria_error_set(STRIA_ERR_INVALID_ARG, "%s: lse is NULL", fn), "forward",
                           0);
    if ((st = stria__fwd_buffers(&f)) != STRIA_OK)
        st = stria__fail(p, &f.c.reqs, st, "forward", 0);
    else if ((st = stria__ring_steps(&f.c, &stria__fwd_ops)) == STRIA_OK &&
             (st = stria__fwd_store(&f, o, lse)) != STRIA_OK)
        st = stria__fail(p, &f.c.reqs, st, "forward", f.c.steps - 1);
    stria_device_attn_fwd_end(f.fpass);
    stria__drain_on_error(p, st);
    return st;
}

/* ---- backward ------------------------------------------------------------ */

/* Writes the fp32 [B, L, heads, D] accumulator rows [0, valid) to a view of
 * the caller (converting to its dtype) and zeros the padded rows. */
static stria_status_t stria__store_grad(stria_ring_pass_t *p, const stria_attn_params_t *base,
                                        float *acc, int64_t heads, const stria_tensor_t *t)
{
    const int64_t B = p->shape.call.batch, L = p->layout.shard_tokens, D = p->shape.head_dim;
    const int64_t valid = p->valid[p->rank];
    stria_status_t st;
    if (!p->staged) {
        stria__store_view(acc, B, L, valid, heads, D, t);
        return STRIA_OK;
    }
    /* On the device, finalize is the conversion of fp32 rows to a dtype. */
    stria_attn_params_t a = *base;
    a.heads = a.kv_heads = heads;
    stria_tensor_t ta = stria_tensor_contiguous(acc, STRIA_DTYPE_F32, L, heads, D);
    if (valid > 0 && (st = stria_device_attn_finalize(p->dev, &a, &ta, t)) != STRIA_OK)
        return st;
    return stria__device_zero_rows(p, t, B, valid, L, heads, D);
}

typedef struct {
    stria__call_t c; /* first: the step callbacks get &c */
    const stria_tensor_t *q, *o, *d_o;
    const float *lse;
    stria_device_bwd_pass_t *bpass; /* the query side, prepared once */
    float *dq_acc, *lse_c, *delta;
    /* dkv: two host buffers for this rank's contributions (one may still be
     * in flight while the next step fills the other), then the running sum
     * received from the predecessor. Each is dK then dV, fp32 [B, L, Hkv,
     * D]. Staged, the kernel writes a contribution into part_d on the device
     * and it is copied to part[step % 2] for the sum and the send. */
    float *part[2], *dkv_in, *part_d;
    /* Packed: this rank's own contribution to its whole block at step 0,
     * kept here (fp32 [B, L, Hkv, D], dK then dV); the sum of its travelling
     * rows from the other ranks is added to it at the end. */
    float *own;
    float *total, *total_dv;             /* where the finished dK and dV of this rank's block are */
    size_t dkv_elems, dkv_bytes;         /* of the largest travelling block */
    size_t dkv_elems_own, dkv_bytes_own; /* packed: of the whole own block */
} stria__bwd_t;

/* Floats of dK (or dV) of rank j's block as it travels: packed, its
 * travelling rows; else the whole shard. */
static size_t stria__dkv_half(const stria__bwd_t *b, int j)
{
    const stria_ring_pass_t *p = b->c.p;
    if (p->plan == NULL)
        return b->dkv_elems / 2;
    return (size_t)(p->shape.call.batch * p->travel[j] * p->shape.kv_heads * p->shape.head_dim);
}

/* D = rowsum(dO * O), then the device backward pass over Q and dO. */
static stria_status_t stria__bwd_open(stria__call_t *c)
{
    stria__bwd_t *b = (stria__bwd_t *)c;
    stria_ring_pass_t *p = c->p;
    stria_attn_params_t base = stria__params(p, p->rank, false);
    stria_tensor_t tdq = stria_tensor_contiguous(b->dq_acc, STRIA_DTYPE_F32, p->layout.shard_tokens,
                                                 p->shape.heads, p->shape.head_dim);
    stria_status_t st = stria_device_attn_bwd_delta(p->dev, &base, b->o, b->d_o, b->delta);
    if (st == STRIA_OK)
        st = stria_device_attn_bwd_begin(p->dev, &base, b->q, b->d_o, b->lse_c, b->delta, &tdq,
                                         &b->bpass);
    return st;
}

/* The running dK/dV sum of block j from ranks j .. r - 1 is posted; the
 * send of the contribution buffer this step reuses (two steps ago) must be
 * done, then it is cleared. */
static stria_status_t stria__bwd_prepare(stria__call_t *c, int step, stria_ring_step_stats_t *ss)
{
    stria__bwd_t *b = (stria__bwd_t *)c;
    stria_ring_pass_t *p = c->p;
    const int j = (p->rank - step + p->n) % p->n;
    const size_t bytes = 2 * stria__dkv_half(b, j) * sizeof(float);
    stria_status_t st;
    /* packed: a block's running sum starts at step 1, on the rank after its
     * owner */
    if (step > (p->plan != NULL ? 1 : 0) &&
        (st = stria__post(p, false, step, STRIA__MSG_DKV, b->dkv_in, bytes, &c->reqs.dkv_recv,
                          ss)) != STRIA_OK)
        return st;
    if ((st = stria__wait(p, &c->reqs.dkv_send[step % 2], step, ss)) != STRIA_OK)
        return st;
    if (p->plan != NULL && step == 0) {
        memset(b->own, 0, b->dkv_bytes_own);
        return STRIA_OK;
    }
    if (!p->staged) {
        memset(b->part[step % 2], 0, bytes);
        return STRIA_OK;
    }
    return stria_device_zero(p->dev, STRIA_STREAM_COMPUTE, b->part_d, b->dkv_bytes);
}

/* This rank's contribution to block j's dK/dV (dQ accumulates in the device
 * pass); staged, copied to the host on the compute stream after it. */
static stria_status_t stria__bwd_compute(stria__call_t *c, int step, bool visible,
                                         const stria_attn_params_t *a, const stria_tensor_t *k,
                                         const stria_tensor_t *v, stria_ring_step_stats_t *ss,
                                         double *t_dev0)
{
    stria__bwd_t *b = (stria__bwd_t *)c;
    stria_ring_pass_t *p = c->p;
    const int64_t Hkv = p->shape.kv_heads, D = p->shape.head_dim;
    const int j = (p->rank - step + p->n) % p->n;
    const bool own = p->plan != NULL && step == 0; /* packed: the whole own block, kept */
    const int64_t rows = own ? p->layout.shard_tokens : stria__msg_rows(p, j);
    float *mine = b->part[step % 2], *acc = own ? b->own : p->staged ? b->part_d : mine;
    const size_t half = own ? b->dkv_elems_own / 2 : stria__dkv_half(b, j);
    stria_status_t st = STRIA_OK;
    stria__clock_t clk;
    stria__compute_begin(&clk);
    if (visible) {
        stria_tensor_t tdk = stria_tensor_contiguous(acc, STRIA_DTYPE_F32, rows, Hkv, D);
        stria_tensor_t tdv = stria_tensor_contiguous(acc + half, STRIA_DTYPE_F32, rows, Hkv, D);
        st = stria_device_attn_bwd_block(b->bpass, a, k, v, &tdk, &tdv);
        ss->computed = true;
    }
    if (st == STRIA_OK && p->staged)
        st = stria_device_copy(p->dev, STRIA_STREAM_COMPUTE, mine, b->part_d, b->dkv_bytes);
    stria__compute_end_dev(p, &clk, ss, t_dev0);
    return st;
}

/* The contribution on the host (staged: the compute stream is done), plus
 * the running sum from r - 1, sent on to r + 1. The host add is the least
 * data movement: a device-side sum would move the running sum up and the
 * result back down. */
static stria_status_t stria__bwd_traffic(stria__call_t *c, int step, stria_ring_step_stats_t *ss)
{
    stria__bwd_t *b = (stria__bwd_t *)c;
    stria_ring_pass_t *p = c->p;
    const bool packed = p->plan != NULL;
    const size_t half = stria__dkv_half(b, (p->rank - step + p->n) % p->n);
    float *mine = b->part[step % 2];
    stria_status_t st;
    if (p->staged && (st = stria_device_sync(p->dev, STRIA_STREAM_COMPUTE)) != STRIA_OK)
        return st;
    if (packed && step == 0) /* the own block's part stays home */
        return STRIA_OK;
    if (step > (packed ? 1 : 0)) {
        stria__clock_t clk;
        if ((st = stria__wait(p, &c->reqs.dkv_recv, step, ss)) != STRIA_OK)
            return st;
        stria__compute_begin(&clk);
        stria_f32_add(mine, b->dkv_in, 2 * half);
        stria__compute_end(p, &clk, ss);
    }
    if (p->n > 1)
        return stria__post(p, true, step + 1, STRIA__MSG_DKV, mine, 2 * half * sizeof(float),
                           &c->reqs.dkv_send[step % 2], ss);
    return STRIA_OK;
}

/* Packed: the other ranks' sum of this rank's travelling rows ([B, T, Hkv,
 * D] dK then dV, `half` floats each) into its own whole-block part. */
static void stria__bwd_add_home(stria__bwd_t *b, size_t half)
{
    stria_ring_pass_t *p = b->c.p;
    const int64_t B = p->shape.call.batch, L = p->layout.shard_tokens, T = p->travel[p->rank];
    const size_t row = (size_t)(p->shape.kv_heads * p->shape.head_dim);
    if (T == 0)
        return;
    for (int part = 0; part < 2; part++)
        for (int64_t i = 0; i < B; i++)
            stria_f32_add(b->own + part * (b->dkv_elems_own / 2) + (size_t)(i * L) * row,
                          b->dkv_in + part * half + (size_t)(i * T) * row, (size_t)T * row);
}

/* After N hops the sum of this rank's own block comes back from r - 1. */
static stria_status_t stria__bwd_tail(stria__call_t *c)
{
    stria__bwd_t *b = (stria__bwd_t *)c;
    stria_ring_pass_t *p = c->p;
    const int N = p->n;
    stria_ring_step_stats_t *ss = &p->stats[N - 1];
    const size_t half = stria__dkv_half(b, p->rank);
    stria_status_t st;
    b->total = p->plan != NULL ? b->own : p->staged ? b->part_d : b->part[0];
    b->total_dv = b->total + (p->plan != NULL ? b->dkv_elems_own : b->dkv_elems) / 2;
    if (N == 1)
        return STRIA_OK;
    if ((st = stria__post(p, false, N, STRIA__MSG_DKV, b->dkv_in, 2 * half * sizeof(float),
                          &c->reqs.dkv_recv, ss)) == STRIA_OK &&
        (st = stria__wait(p, &c->reqs.dkv_recv, N, ss)) == STRIA_OK &&
        (st = stria__wait(p, &c->reqs.dkv_send[0], N, ss)) == STRIA_OK)
        st = stria__wait(p, &c->reqs.dkv_send[1], N, ss);
    if (st == STRIA_OK && p->plan != NULL) {
        stria__bwd_add_home(b, half);
        return STRIA_OK;
    }
    if (!p->staged)
        b->total = b->dkv_in;
    else if (st == STRIA_OK)
        st = stria_device_copy(p->dev, STRIA_STREAM_COMPUTE, b->part_d, b->dkv_in, b->dkv_bytes);
    b->total_dv = b->total + b->dkv_elems / 2;
    return st;
}

static const stria__dir_ops_t stria__bwd_ops = {.open = stria__bwd_open,
                                                .prepare = stria__bwd_prepare,
                                                .compute = stria__bwd_compute,
                                                .traffic = stria__bwd_traffic,
                                                .tail = stria__bwd_tail,
                                                .tail_steps = 1};

/* The backward pass's buffers; dQ cleared, LSE compacted to the real query
 * rows (the kernels take LSE and D for those only). Staged, the real LSE
 * rows are gathered on the host (a few bytes per row) unless there are no
 * padded rows, when the kernels read the caller's LSE in place. */
static stria_status_t stria__bwd_buffers(stria__bwd_t *b)
{
    stria_ring_pass_t *p = b->c.p;
    const int64_t B = p->shape.call.batch, L = p->layout.shard_tokens, H = p->shape.heads;
    const int64_t D = p->shape.head_dim, qv = p->valid[p->rank], rows = qv > 0 ? qv : 1;
    const size_t msg64 = stria__round64(b->c.msg), dkv64 = stria__round64(b->dkv_bytes);
    const size_t dq_bytes = (size_t)(B * L * H * D) * sizeof(float);
    const size_t row_bytes = (size_t)(B * H * rows) * sizeof(float);
    const size_t lse_all = (size_t)(B * H * L) * sizeof(float);
    const size_t q_side = stria__round64(dq_bytes) + 2 * stria__round64(row_bytes);
    char *dcur, *hcur;
    float *lse_h;
    stria_status_t st;

    memset(p->stats, 0, (size_t)p->n * sizeof(*p->stats));
    const size_t own64 = stria__round64(b->dkv_bytes_own); /* 0 unless packed */
    if ((st = stria__call_mem(&b->c, 2 * msg64 + 3 * dkv64 + own64 + q_side,
                              2 * b->c.msg + 3 * b->dkv_bytes + b->dkv_bytes_own,
                              2 * msg64 + dkv64 + q_side, 2 * msg64 + 3 * dkv64 + lse_all, &dcur,
                              &hcur)) != STRIA_OK)
        return st;
    if (p->staged)
        b->part_d = stria__carve(&dcur, b->dkv_bytes);
    char **qside = p->staged ? &dcur : &hcur;
    if (!p->staged) { /* host: the contributions before the query side */
        b->part[0] = stria__carve(&hcur, b->dkv_bytes);
        b->part[1] = stria__carve(&hcur, b->dkv_bytes);
        b->dkv_in = stria__carve(&hcur, b->dkv_bytes);
        if (p->plan != NULL)
            b->own = stria__carve(&hcur, b->dkv_bytes_own);
    }
    b->dq_acc = stria__carve(qside, dq_bytes);
    b->lse_c = stria__carve(qside, row_bytes);
    b->delta = stria__carve(qside, row_bytes);
    if (!p->staged) {
        memset(b->dq_acc, 0, dq_bytes);
        for (int64_t bh = 0; bh < B * H; bh++)
            for (int64_t i = 0; i < qv; i++)
                b->lse_c[bh * qv + i] = b->lse[bh * L + i];
        return STRIA_OK;
    }
    b->part[0] = stria__carve(&hcur, b->dkv_bytes);
    b->part[1] = stria__carve(&hcur, b->dkv_bytes);
    b->dkv_in = stria__carve(&hcur, b->dkv_bytes);
    lse_h = stria__carve(&hcur, lse_all);
    if ((qv > 0 && qv < L &&
         (st = stria_device_copy(p->dev, STRIA_STREAM_COPY, lse_h, b->lse, lse_all)) != STRIA_OK) ||
        (st = stria_device_sync(p->dev, STRIA_STREAM_COPY)) != STRIA_OK ||
        (st = stria_device_zero(p->dev, STRIA_STREAM_COMPUTE, b->dq_acc, dq_bytes)) != STRIA_OK)
        return st;
    if (qv == L) {
        b->lse_c = (float *)b->lse;
        return STRIA_OK;
    }
    if (qv == 0)
        return STRIA_OK;
    for (int64_t bh = 0; bh < B * H; bh++) /* in place: bh * qv + i <= bh * L + i */
        memmove(lse_h + bh * qv, lse_h + bh * L, (size_t)qv * sizeof(float));
    return stria_device_copy(p->dev, STRIA_STREAM_COMPUTE, b->lse_c, lse_h,
                             (size_t)(B * H * qv) * sizeof(float));
}

/* dQ of the device pass, then dQ, dK, dV to the caller's dtypes. */
static stria_status_t stria__bwd_store(stria__bwd_t *b, const stria_tensor_t *dq,
                                       const stria_tensor_t *dk, const stria_tensor_t *dv)
{
    stria_ring_pass_t *p = b->c.p;
    stria_attn_params_t base = stria__params(p, p->rank, false);
    const int64_t H = p->shape.heads, Hkv = p->shape.kv_heads;
    stria_status_t st;
    if (b->bpass != NULL) { /* the pass's dQ into dq_acc */
        stria__clock_t clk;
        stria__compute_begin(&clk);
        st = stria_device_attn_bwd_end(b->bpass, true);
        b->bpass = NULL;
        stria__compute_end(p, &clk, &p->stats[p->n - 1]);
        if (st != STRIA_OK)
            return st;
    }
    if ((st = stria__store_grad(p, &base, b->dq_acc, H, dq)) != STRIA_OK ||
        (st = stria__store_grad(p, &base, b->total, Hkv, dk)) != STRIA_OK ||
        (st = stria__store_grad(p, &base, b->total_dv, Hkv, dv)) != STRIA_OK)
        return st;
    return p->staged ? stria__device_drain(p) : STRIA_OK;
}

static stria_status_t stria__bwd(stria_ring_pass_t *p, const stria_tensor_t *q,
                                 const stria_tensor_t *k, const stria_tensor_t *v,
                                 const stria_tensor_t *o, const float *lse,
                                 const stria_tensor_t *d_o, const stria_tensor_t *dq,
                                 const stria_tensor_t *dk, const stria_tensor_t *dv)
{
    static const char fn[] = "stria_ring_bwd";
    stria__bwd_t b = {.q = q, .o = o, .d_o = d_o, .lse = lse};
    stria_status_t st;

    /* Always N steps: every rank's dK/dV sum must travel all N hops home. */
    if ((st = stria__call_begin(&b.c, p, p->n, fn, "backward", q, k, v, o)) != STRIA_OK)
        return st;
    if ((st = stria__check_view(d_o, fn, "d_o", true, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(dq, fn, "dq", false, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(dk, fn, "dk", false, p->shape.dtype)) != STRIA_OK ||
        (st = stria__check_view(dv, fn, "dv", false, p->shape.dtype)) != STRIA_OK)
        return stria__fail(p, &b.c.reqs, st, "backward", 0);
    if (lse == NULL)
        return stria__fail(p, &b.c.reqs,
                           stria_error_set(STRIA_ERR_INVALID_ARG, "%s: lse is NULL", fn),
                           "backward", 0);
    if (dq->data == dk->data || dq->data == dv->data || dk->data == dv->data)
        return stria__fail(
            p, &b.c.reqs,
            stria_error_set(STRIA_ERR_INVALID_ARG, "%s: dq, dk and dv must not alias", fn),
            "backward", 0);
    b.dkv_elems = 2 * (b.c.kv_bytes / stria_dtype_size(p->shape.dtype));
    b.dkv_bytes = b.dkv_elems * sizeof(float);
    if (p->plan != NULL) {
        b.dkv_elems_own = (size_t)(2 * p->shape.call.batch * p->layout.shard_tokens *
                                   p->shape.kv_heads * p->shape.head_dim);
        b.dkv_bytes_own = b.dkv_elems_own * sizeof(float);
    }
    if ((st = stria__bwd_buffers(&b)) != STRIA_OK)
        st = stria__fail(p, &b.c.reqs, st, "backward", 0);
    else if ((st = stria__ring_steps(&b.c, &stria__bwd_ops)) == STRIA_OK &&
             (st = stria__bwd_store(&b, dq, dk, dv)) != STRIA_OK)
        st = stria__fail(p, &b.c.reqs, st, "backward", p->n);
    (void)stria_device_attn_bwd_end(b.bpass, false);
    stria__drain_on_error(p, st);
    return st;
}

/* ---- entry points ------------------------------------------------------- */

stria_status_t stria_ring_fwd(stria_ring_pass_t *pass, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *o, float *lse)
{
    stria_status_t st;
    if (pass == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_ring_fwd: pass is NULL");
    atomic_store(&pass->running, true);
    st = stria__fwd(pass, q, k, v, o, lse);
    stria__times_finish(pass);
    atomic_store(&pass->running, false);
    return st;
}

stria_status_t stria_ring_bwd(stria_ring_pass_t *pass, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *o, const float *lse, const stria_tensor_t *d_o,
                              const stria_tensor_t *dq, const stria_tensor_t *dk,
                              const stria_tensor_t *dv)
{
    stria_status_t st;
    if (pass == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_ring_bwd: pass is NULL");
    atomic_store(&pass->running, true);
    st = stria__bwd(pass, q, k, v, o, lse, d_o, dq, dk, dv);
    stria__times_finish(pass);
    atomic_store(&pass->running, false);
    return st;
}
