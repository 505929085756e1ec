/* One call on a session's engine: the pass thread's own part of a session.
 *
 * A call's geometry (its shape checked against the session's bounds by the
 * rule libstria and the coordinator use, the layout of its seq_len, the
 * bytes of its tensors and where they lie in a region), the session's
 * regions and held forwards, the tensors the ring engine reads (the compact
 * ones when the rank's shard has no padding, else padded copies; on a
 * staged device the session's device tensors), the ring link bound for the
 * call's epoch, the pass object of its shape (a few kept: a model's layers
 * alternate a few shapes), the run and its records. Nothing here knows
 * which door a call came through. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "worker_int.h"

/* ---- geometry and memory ---------------------------------------------------- */

stria_status_t stria__wcall_geom(const stria__wsess_t *s, const stria_call_shape_t *shape,
                                 bool backward, bool use_held, stria__wgeom_t *g)
{
    const stria_call_bounds_t b = {.max_batch = s->max_batch,
                                   .max_seq_len = s->max_seq_len,
                                   .n_ranks = s->n_ranks,
                                   .layout = (int)s->layout_kind};
    stria_status_t st = stria_call_shape_check(shape, &b);
    if (st != STRIA_OK)
        return st;
    memset(g, 0, sizeof(*g));
    g->shape = *shape;
    g->backward = backward;
    g->use_held = backward && use_held;
    stria_docplan_t *plan; /* packed: the call's plan; the pass keeps its own reference */
    if ((st = stria_docplan_layout(s->layout_kind, shape, s->n_ranks, &g->layout, &plan)) !=
        STRIA_OK)
        return st;
    g->valid = stria_layout_shard_valid(&g->layout, s->rank);
    g->layout.plan = NULL;
    stria_docplan_unref(plan);
    uint64_t rows = (uint64_t)shape->batch * (uint64_t)g->layout.shard_tokens;
    uint64_t bound = (uint64_t)s->max_batch * (uint64_t)s->layout.shard_tokens;
    if (rows > bound)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "call batch x seq_len (%lld x %lld) needs %llu shard rows on rank "
                               "%d, more than the session's bounds hold (%llu)",
                               (long long)shape->batch, (long long)shape->seq_len,
                               (unsigned long long)rows, s->rank, (unsigned long long)bound);
    g->shard = g->layout.shard_tokens;
    size_t es = stria_dtype_size(s->dtype);
    g->qrow = (size_t)(s->heads * s->head_dim) * es;
    g->kvrow = (size_t)(s->kv_heads * s->head_dim) * es;
    g->lrow = (size_t)s->heads * 4u;
    uint64_t tok = (uint64_t)shape->batch * (uint64_t)g->valid;
    const size_t rowb[STRIA__T_COUNT] = {g->qrow, g->kvrow, g->kvrow, g->qrow, g->lrow,
                                         g->qrow, g->qrow,  g->kvrow, g->kvrow};
    uint64_t at = 0;
    for (int t = 0; t < STRIA__T_COUNT; t++) {
        if (t == STRIA__T_DQ)
            at = s->in_room; /* a backward's outputs after the region's inputs */
        g->bytes[t] = tok * rowb[t];
        g->at[t] = at;
        at += g->bytes[t];
    }
    if (!backward) {
        g->in_bytes = g->at[STRIA__T_O];
        g->out_off = g->at[STRIA__T_O];
        g->out_bytes = g->bytes[STRIA__T_O] + g->bytes[STRIA__T_LSE];
    } else {
        g->in_off = g->use_held ? g->at[STRIA__T_DO] : 0;
        g->in_bytes = g->at[STRIA__T_DO] + g->bytes[STRIA__T_DO] - g->in_off;
        g->out_off = g->at[STRIA__T_DQ];
        g->out_bytes = g->bytes[STRIA__T_DQ] + g->bytes[STRIA__T_DK] + g->bytes[STRIA__T_DV];
    }
    return STRIA_OK;
}

/* Bytes of one row of tensor t as it lies ([outer][tokens][row]; LSE's
 * rows are [batch][heads][tokens] floats). */
static size_t row_bytes(const stria__wgeom_t *g, int t)
{
    if (t == STRIA__T_LSE)
        return 4;
    return t == STRIA__T_K || t == STRIA__T_V || t == STRIA__T_DK || t == STRIA__T_DV ? g->kvrow
                                                                                      : g->qrow;
}

/* Outer rows of tensor t (batch; batch x heads for LSE). */
static int64_t outer_rows(const stria__wgeom_t *g, int t)
{
    return t == STRIA__T_LSE ? g->shape.batch * (int64_t)(g->lrow / 4) : g->shape.batch;
}

void stria__wcall_inputs(const stria__wgeom_t *g, int *t0, int *t1)
{
    *t0 = g->use_held ? STRIA__T_DO : STRIA__T_Q;
    *t1 = g->backward ? STRIA__T_DO + 1 : STRIA__T_O;
}

void stria__wcall_outputs(const stria__wgeom_t *g, int *t0, int *t1)
{
    *t0 = g->backward ? STRIA__T_DQ : STRIA__T_O;
    *t1 = g->backward ? STRIA__T_DV + 1 : STRIA__T_LSE + 1;
}

int64_t stria__wcall_part_rows(const stria__wsess_t *s, const stria__wgeom_t *g, uint32_t part,
                               uint32_t parts)
{
    stria_layout_t all;
    if (stria_layout_init(STRIA_LAYOUT_STRIPED, s->n_ranks * (int)parts, g->shape.seq_len, &all) !=
        STRIA_OK)
        return -1;
    return stria_layout_shard_valid(&all, (int)part * s->n_ranks + s->rank);
}

uint64_t stria__wcall_part_bytes(const stria__wgeom_t *g, int64_t rows, int t0, int t1)
{
    uint64_t n = 0;
    for (int t = t0; t < t1; t++)
        n += (uint64_t)outer_rows(g, t) * (uint64_t)rows * row_bytes(g, t);
    return n;
}

void stria__wcall_part_move(const stria__wgeom_t *g, uint32_t part, uint32_t parts, int64_t rows,
                            int t0, int t1, char *region, char *buf, bool to_region)
{
    for (int t = t0; t < t1; t++) {
        const size_t row = row_bytes(g, t);
        for (int64_t o = 0; o < outer_rows(g, t); o++) {
            char *r = region + g->at[t] + ((size_t)(o * g->valid) + part) * row;
            for (int64_t m = 0; m < rows; m++, buf += row, r += (size_t)parts * row) {
                if (to_region)
                    memcpy(r, buf, row);
                else
                    memcpy(buf, r, row);
            }
        }
    }
}

uint64_t stria__wcall_region_bytes(const stria__wsess_t *s, uint64_t *in_room_out)
{
    return stria_session_region_bytes(s->max_batch, s->layout.shard_tokens, s->heads, s->kv_heads,
                                      s->head_dim, s->dtype, in_room_out);
}

stria_status_t stria__wcall_memory(const stria__wsess_t *s, uint64_t *bytes_out)
{
    return stria_session_rank_memory(s->max_batch, s->layout.shard_tokens, s->heads, s->kv_heads,
                                     s->head_dim, s->dtype, s->max_held, bytes_out);
}

int stria__wcall_held_slot(const stria__wsess_t *s, uint64_t call)
{
    for (uint32_t i = 0; i <= s->max_held; i++)
        if ((s->sh.held_mask >> i & 1) && s->sh.held_call[i] == call)
            return (int)i;
    return -1;
}

int stria__wcall_free_slot(const stria__wsess_t *s)
{
    for (uint32_t i = 0; i <= s->max_held; i++)
        if (!(s->sh.held_mask >> i & 1))
            return (int)i;
    return -1;
}

/* ---- the parked link: what kept pass objects are bound to between links -- */

static stria_status_t parked_post(stria_link_t *link, uint64_t tag, const void *buf, size_t len,
                                  stria_link_req_t **req_out)
{
    (void)tag, (void)buf, (void)len;
    *req_out = NULL;
    return stria_error_set(STRIA_ERR_CLOSED, "rank %d: no call runs (parked link)", link->rank);
}

static stria_status_t parked_recv(stria_link_t *link, uint64_t tag, void *buf, size_t len,
                                  stria_link_req_t **req_out)
{
    return parked_post(link, tag, buf, len, req_out);
}

static stria_status_t parked_wait(stria_link_t *link, stria_link_req_t *req, double timeout_s)
{
    (void)req, (void)timeout_s;
    return stria_error_set(STRIA_ERR_CLOSED, "rank %d: no call runs (parked link)", link->rank);
}

static void parked_cancel(stria_link_t *link, stria_link_req_t *req)
{
    (void)link, (void)req;
}

static void parked_abort(stria_link_t *link, stria_status_t reason, const char *msg)
{
    (void)link, (void)reason, (void)msg;
}

static void parked_destroy(stria_link_t *link)
{
    (void)link;
}

/* name, isend, irecv, wait, cancel, abort, destroy */
static const stria_link_ops_t parked_ops = {"parked",      parked_post,  parked_recv,   parked_wait,
                                            parked_cancel, parked_abort, parked_destroy};

void stria__wcall_park_init(stria__wsess_t *s)
{
    s->eng.parked.ops = &parked_ops;
    s->eng.parked.rank = s->rank;
    s->eng.parked.size = s->n_ranks;
}

void stria__wcall_park(stria__wsess_t *s)
{
    for (int i = 0; i < STRIA__PASSES_KEPT; i++)
        if (s->eng.passes[i].pass != NULL) /* cannot fail: no call runs */
            stria_ring_pass_set_link(s->eng.passes[i].pass, &s->eng.parked);
}

/* ---- the ring link -------------------------------------------------------------- */

/* A ring of one has no peer: its link is in-process (no connection, no
 * handshake); *out stays NULL for a ring of more. */
static stria_status_t solo_link(int n_ranks, stria_link_t **out)
{
    stria_inproc_hub_t *hub = NULL;
    *out = NULL;
    if (n_ranks != 1)
        return STRIA_OK;
    stria_status_t st = stria_inproc_hub_create(1, &hub);
    if (st == STRIA_OK) {
        st = stria_inproc_link_create(hub, 0, out);
        stria_inproc_hub_release(hub); /* the link holds its own reference */
    }
    return st;
}

void stria__wcall_unbind(stria__wsess_t *s)
{
    if (s->eng.link == NULL)
        return;
    stria__wcall_park(s);
    pthread_mutex_lock(&s->lock);
    s->sh.link = NULL; /* no drop aborts it any more */
    pthread_mutex_unlock(&s->lock);
    stria_link_destroy(s->eng.link);
    s->eng.link = NULL;
}

stria_status_t stria__wcall_bind(stria__wsess_t *s, uint64_t epoch)
{
    stria_worker_t *w = s->w;
    stria__wcall_unbind(s);
    const stria_worker_link_request_t rq = {.job_id = s->id,
                                            .ring_id = 0x80000000u | (uint32_t)(epoch & 0x7fffffff),
                                            .rank = s->rank,
                                            .size = s->n_ranks,
                                            .next_address = s->next_ucx,
                                            .connect_timeout_s = w->connect_timeout_s,
                                            .key = s->ring_key,
                                            .cancel = &s->sh.connect_cancel};
    stria_link_t *link = NULL;
    stria_status_t st = solo_link(s->n_ranks, &link);
    if (st == STRIA_OK && link == NULL)
        st = w->factory.connect(w->factory.ctx, &rq, &link);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "session %llu rank %d: ring link to %s",
                                (unsigned long long)s->id, s->rank, s->next_ucx);
    char reason[128] = "";
    stria_status_t why = STRIA_ERR_CANCELLED;
    pthread_mutex_lock(&w->lock);
    if (w->abort_calls) { /* the worker leaves (see stria_worker_shutdown()) */
        snprintf(reason, sizeof(reason), "%s", w->abort_reason);
        why = STRIA_ERR_CLOSED;
    }
    pthread_mutex_unlock(&w->lock);
    pthread_mutex_lock(&s->lock);
    s->sh.link = link; /* a drop or a shutdown aborts it */
    if (s->sh.stop && reason[0] == '\0')
        snprintf(reason, sizeof(reason), "session %llu is closing", (unsigned long long)s->id);
    pthread_mutex_unlock(&s->lock);
    if (reason[0] != '\0')
        stria_link_abort(link, why, reason);
    s->eng.link = link;
    s->eng.epoch = epoch;
    return STRIA_OK; /* the kept pass objects are bound to it when used */
}

/* ---- tensors --------------------------------------------------------------------- */

/* The inputs and outputs of a call's kind. */
static const int fwd_in[] = {STRIA__T_Q, STRIA__T_K, STRIA__T_V};
static const int bwd_in[] = {STRIA__T_Q, STRIA__T_K,   STRIA__T_V,
                             STRIA__T_O, STRIA__T_LSE, STRIA__T_DO};
static const int fwd_out[] = {STRIA__T_O, STRIA__T_LSE};
static const int bwd_out[] = {STRIA__T_DQ, STRIA__T_DK, STRIA__T_DV};

/* Where each tensor of the call lies: in the session's region (at their
 * offsets), or in the client's arena (inputs from arena_in in payload
 * order, outputs from arena_out). */
static void places(const stria__wgeom_t *g, char *region, const stria_call_place_t *p, char *arena,
                   char *ptr[STRIA__T_COUNT])
{
    if (!p->arena) {
        for (int t = 0; t < STRIA__T_COUNT; t++)
            ptr[t] = region + g->at[t];
        return;
    }
    char *in = arena + p->arena_in, *out = arena + p->arena_out;
    memset(ptr, 0, STRIA__T_COUNT * sizeof(char *));
    for (int i = 0; i < (g->backward ? 6 : 3); i++) {
        int t = g->backward ? bwd_in[i] : fwd_in[i];
        ptr[t] = in;
        in += g->bytes[t];
    }
    for (int i = 0; i < (g->backward ? 3 : 2); i++) {
        int t = g->backward ? bwd_out[i] : fwd_out[i];
        ptr[t] = out;
        out += g->bytes[t];
    }
}

/* Bytes per token of tensor t, and its outer rows in a call of `batch`. */
static size_t row_of(const stria__wgeom_t *g, int t)
{
    return t == STRIA__T_LSE                                                            ? g->lrow
           : t == STRIA__T_K || t == STRIA__T_V || t == STRIA__T_DK || t == STRIA__T_DV ? g->kvrow
                                                                                        : g->qrow;
}

static int64_t outer_of(const stria__wsess_t *s, const stria__wgeom_t *g, int t)
{
    return t == STRIA__T_LSE ? g->shape.batch * s->heads : g->shape.batch;
}

/* Bytes of tensor t at the session's bounds, padding included. */
static size_t bound_bytes(const stria__wsess_t *s, const stria__wgeom_t *g, int t)
{
    size_t row = t == STRIA__T_LSE ? 4 : row_of(g, t);
    int64_t outer = t == STRIA__T_LSE ? s->max_batch * s->heads : s->max_batch;
    return (size_t)outer * (size_t)s->layout.shard_tokens * row;
}

/* Copies between a compact tensor ([outer][valid][row]) and a padded one
 * ([outer][shard][row]); into the padded one, its padding rows zeroed (a
 * masked position must never hold a value, however stale). */
static void repack(const stria__wsess_t *s, const stria__wgeom_t *g, int t, char *compact,
                   char *padded, bool to_padded)
{
    size_t row = t == STRIA__T_LSE ? 4 : row_of(g, t);
    size_t real = (size_t)g->valid * row, full = (size_t)g->shard * row;
    for (int64_t o = 0; o < outer_of(s, g, t); o++) {
        char *c = compact + (size_t)o * real, *p = padded + (size_t)o * full;
        if (to_padded) {
            memcpy(p, c, real);
            memset(p + real, 0, full - real);
        } else {
            memcpy(c, p, real);
        }
    }
}

/* The tensors the ring engine reads and writes (view[t]), the inputs
 * copied in: the compact ones when the shard has no padding, else the
 * session's padded tensors (made at first need); on a staged device its
 * device tensors, the inputs uploaded. */
static stria_status_t views_in(stria__wsess_t *s, const stria__wgeom_t *g,
                               char *const ptr[STRIA__T_COUNT], void *view[STRIA__T_COUNT])
{
    stria_worker_t *w = s->w;
    const bool padded = g->valid < g->shard;
    const int *in = g->backward ? bwd_in : fwd_in, *out = g->backward ? bwd_out : fwd_out;
    const int n_in = g->backward ? 6 : 3, n_out = g->backward ? 3 : 2;
    stria_status_t st;
    memset(view, 0, STRIA__T_COUNT * sizeof(void *));
    for (int i = 0; i < n_in + n_out; i++) {
        int t = i < n_in ? in[i] : out[i - n_in];
        view[t] = ptr[t];
        if (!padded)
            continue;
        if (s->eng.pad[t] == NULL) {
            size_t bytes = bound_bytes(s, g, t);
            if ((st = stria__wpool_alloc(w, bytes, &s->eng.pad[t])) != STRIA_OK)
                return stria_error_wrap(st, "session %llu: its padded tensors",
                                        (unsigned long long)s->id);
            memset(s->eng.pad[t], 0, bytes);
        }
        if (i < n_in)
            repack(s, g, t, ptr[t], s->eng.pad[t], true);
        view[t] = s->eng.pad[t];
    }
    if (!w->dev_staged)
        return STRIA_OK;
    if (s->eng.dev == NULL) {
        if ((st = stria_device_open(stria_device_name(w->dev), w->pool, &s->eng.dev)) != STRIA_OK)
            return stria_error_wrap(st, "session %llu", (unsigned long long)s->id);
        /* its device tensors, the ring's and their pinned messages: the pools */
        if ((st = stria__wpool_device(w, s->eng.dev)) != STRIA_OK)
            return st;
    }
    for (int i = 0; i < n_in + n_out; i++) {
        int t = i < n_in ? in[i] : out[i - n_in];
        size_t bytes = (size_t)outer_of(s, g, t) * (size_t)g->shard * row_of(g, t);
        if (s->eng.dbuf[t] == NULL && (st = stria_device_alloc(s->eng.dev, bound_bytes(s, g, t),
                                                               &s->eng.dbuf[t])) != STRIA_OK)
            return stria_error_wrap(st, "session %llu: device tensors", (unsigned long long)s->id);
        if (i < n_in && (st = stria_device_copy(s->eng.dev, STRIA_STREAM_COPY, s->eng.dbuf[t],
                                                view[t], bytes)) != STRIA_OK)
            return st;
        view[t] = s->eng.dbuf[t];
    }
    return stria_device_sync(s->eng.dev, STRIA_STREAM_COPY);
}

/* After a successful pass: the outputs from the device and out of the
 * padded tensors into their compact places. */
static stria_status_t views_out(stria__wsess_t *s, const stria__wgeom_t *g,
                                char *const ptr[STRIA__T_COUNT])
{
    const bool padded = g->valid < g->shard;
    const int *out = g->backward ? bwd_out : fwd_out;
    const int n_out = g->backward ? 3 : 2;
    stria_status_t st;
    for (int i = 0; i < n_out && s->eng.dev != NULL; i++) {
        int t = out[i];
        size_t bytes = (size_t)outer_of(s, g, t) * (size_t)g->shard * row_of(g, t);
        if ((st = stria_device_copy(s->eng.dev, STRIA_STREAM_COPY, padded ? s->eng.pad[t] : ptr[t],
                                    s->eng.dbuf[t], bytes)) != STRIA_OK)
            return st;
    }
    if (s->eng.dev != NULL && (st = stria_device_sync(s->eng.dev, STRIA_STREAM_COPY)) != STRIA_OK)
        return st;
    for (int i = 0; i < n_out && padded; i++)
        repack(s, g, out[i], ptr[out[i]], s->eng.pad[out[i]], false);
    return STRIA_OK;
}

/* ---- pass objects --------------------------------------------------------------- */

static void on_step(void *arg, int step, int n_steps)
{
    stria__wsess_t *s = arg;
    pthread_mutex_lock(&s->lock);
    s->sh.step = (uint32_t)step;
    s->sh.steps_total = (uint32_t)n_steps;
    pthread_mutex_unlock(&s->lock);
}

static void forget_pass(stria__wsess_t *s, int i)
{
    stria_ring_pass_destroy(s->eng.passes[i].pass);
    stria_call_shape_free(&s->eng.passes[i].shape);
    memset(&s->eng.passes[i], 0, sizeof(s->eng.passes[i]));
}

/* The pass object of the call's shape, bound to the session's link: a kept
 * one of the same shape, else a new one (its buffers from the worker's
 * pool) in place of the least recently used. */
static stria_status_t pass_of(stria__wsess_t *s, const stria_call_shape_t *shape,
                              stria_ring_pass_t **out)
{
    stria_worker_t *w = s->w;
    int slot = 0;
    for (int i = 0; i < STRIA__PASSES_KEPT; i++) {
        if (s->eng.passes[i].pass != NULL &&
            stria_call_shape_equal(&s->eng.passes[i].shape, shape)) {
            s->eng.passes[i].used = ++s->eng.uses;
            *out = s->eng.passes[i].pass;
            return stria_ring_pass_set_link(*out, s->eng.link);
        }
        if (s->eng.passes[i].used < s->eng.passes[slot].used) /* an empty slot's is 0 */
            slot = i;
    }
    forget_pass(s, slot);
    /* the pass keeps the record it is made for: an owning copy */
    stria_call_shape_t kept;
    if (stria_call_shape_copy(shape, &kept) != STRIA_OK)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session %llu: out of memory",
                               (unsigned long long)s->id);
    const stria_ring_shape_t rs = {.call = kept,
                                   .heads = s->heads,
                                   .kv_heads = s->kv_heads,
                                   .head_dim = s->head_dim,
                                   .dtype = s->dtype};
    stria_ring_opts_t opts;
    memset(&opts, 0, sizeof(opts));
    opts.step_timeout_s = s->step_timeout_s;
    opts.pool = w->pool;
    opts.device = s->eng.dev; /* NULL on the host: the pass's own cpu device over w->pool */
    opts.step_cb = on_step;
    opts.step_cb_ctx = s;
    opts.host_memory = &w->alloc_host; /* ring buffers and kernel workspaces: the pool */
    stria_ring_pass_t *pass = NULL;
    stria_status_t st = stria_ring_pass_create(s->eng.link, &rs, s->layout_kind, &opts, &pass);
    if (st != STRIA_OK) {
        stria_call_shape_free(&kept);
        return st;
    }
    s->eng.passes[slot].pass = pass;
    s->eng.passes[slot].shape = kept;
    s->eng.passes[slot].used = ++s->eng.uses;
    *out = pass;
    return STRIA_OK;
}

void stria__wcall_engine_free(stria__wsess_t *s)
{
    for (int i = 0; i < STRIA__PASSES_KEPT; i++)
        forget_pass(s, i);
    for (int t = 0; t < STRIA__T_COUNT; t++) {
        stria__wpool_free(s->w, s->eng.pad[t]);
        stria_device_free(s->eng.dev, s->eng.dbuf[t]);
        s->eng.pad[t] = s->eng.dbuf[t] = NULL;
    }
    stria_device_close(s->eng.dev);
    s->eng.dev = NULL;
}

/* ---- a sharded call's agreement ------------------------------------------------- */

/* Every rank compares its call's digest with its predecessor's before step
 * 0, waiting up to the arrival timeout for it: a rank whose trainer rank
 * did not call in time is named, and ranks that disagree are refused; the
 * rank that finds it aborts the link with it, so every rank fails so. */
static double heartbeat_s(stria_worker_t *w)
{
    pthread_mutex_lock(&w->lock);
    double s = w->heartbeat_ms / 1000.0;
    pthread_mutex_unlock(&w->lock);
    return s;
}

static stria_status_t agree(stria__wsess_t *s, uint64_t call, bool backward, uint64_t digest)
{
    stria_link_t *link = s->eng.link;
    if (s->n_ranks < 2)
        return STRIA_OK;
    uint8_t mine[8], theirs[8];
    stria_put_le64(mine, digest);
    uint64_t tag = ((call & STRIA_RING_CALL_ID_MASK) << 24) | (0xffffu << 8) | 0xd1u;
    stria_link_req_t *sreq = NULL, *rreq = NULL;
    int prev = stria_link_prev(link);
    double t0 = stria_time_now();
    stria_status_t st = stria_link_isend(link, tag, mine, sizeof(mine), &sreq);
    if (st == STRIA_OK)
        st = stria_link_irecv(link, tag, theirs, sizeof(theirs), &rreq);
    /* a job's ranks report their arrival: the coordinator names every rank
     * that did not come (within arrival_timeout_s of the first, and a few
     * heartbeats to hear of its worker) before this wait, which names only
     * the predecessor, gives up */
    double wait_s = s->arrival_timeout_s;
    if (s->report_calls)
        wait_s += 4.0 * heartbeat_s(s->w) + 2.0;
    if (st == STRIA_OK) {
        st = stria_link_wait(link, rreq, wait_s);
        rreq = NULL;
        if (st == STRIA_ERR_TIMEOUT) {
            char why[400];
            snprintf(why, sizeof(why), "%s", stria_error_msg());
            st = stria_error_set(STRIA_ERR_TIMEOUT,
                                 "rank %d did not arrive for the %s pass (call %llu) within %.1f s "
                                 "(%s)",
                                 prev, backward ? "backward" : "forward", (unsigned long long)call,
                                 stria_time_now() - t0, why);
            stria_link_abort(link, st, stria_error_msg());
        }
    }
    if (st == STRIA_OK) {
        st = stria_link_wait(link, sreq, s->step_timeout_s);
        sreq = NULL;
    }
    stria_link_cancel(link, rreq);
    stria_link_cancel(link, sreq);
    if (st != STRIA_OK)
        return st;
    if (stria_get_le64(theirs) != digest) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "rank %d: call %llu differs between rank %d and rank %d (every rank "
                             "must make the same calls, with the same shape, in the same order)",
                             s->rank, (unsigned long long)call, prev, s->rank);
        stria_link_abort(link, st, stria_error_msg());
    }
    return st;
}

/* ---- the run --------------------------------------------------------------------- */

/* Whether tensor t has the K/V heads (K, V, dK, dV) rather than the query's. */
static bool kv_tensor(int t)
{
    return t == STRIA__T_K || t == STRIA__T_V || t == STRIA__T_DK || t == STRIA__T_DV;
}

static uint64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Adds up a pass's step statistics into the call's and the metrics. */
static void records(stria__wsess_t *s, stria_ring_pass_t *pass, bool backward,
                    Stria__V1__PassStats *stats)
{
    stria_worker_t *w = s->w;
    size_t n = 0;
    const stria_ring_step_stats_t *ss = stria_ring_pass_stats(pass, &n);
    for (size_t i = 0; i < n; i++) {
        stats->compute_seconds += ss[i].compute_wall_s;
        stats->wait_seconds += ss[i].wait_s;
        stats->bytes_sent += ss[i].bytes_sent;
        stria_metric_observe(w->m_step_compute, ss[i].compute_wall_s);
        stria_metric_observe(w->m_step_wait, ss[i].wait_s);
        stria_metric_add(w->m_bytes_sent, (double)ss[i].bytes_sent);
        stria_metric_add(w->m_bytes_recv, (double)ss[i].bytes_recv);
    }
    stats->steps = (uint32_t)stria_ring_pass_steps(pass);
    stria_metric_add(w->m_steps[backward ? 1 : 0], (double)stats->steps);
}

stria_status_t stria__wcall_run(stria__wsess_t *s, const Stria__V1__SessionCallRequest *req,
                                const stria__wgeom_t *g, char *region, stria__wrun_t *run)
{
    stria_call_place_t p;
    char *ptr[STRIA__T_COUNT];
    void *view[STRIA__T_COUNT];
    stria_ring_pass_t *pass = NULL;
    stria_call_place_from_pb(req, &p);
    memset(run, 0, sizeof(*run));
    stria__v1__pass_stats__init(&run->stats);
    run->started = stria_time_now();
    run->started_ms = wall_ms();
    /* the arena stays mapped until this thread unmaps it */
    pthread_mutex_lock(&s->lock);
    char *arena = s->sh.arena;
    pthread_mutex_unlock(&s->lock);
    places(g, region, &p, arena, ptr);
    stria_status_t st = STRIA_OK;
    if (s->eng.link == NULL || s->eng.epoch != req->link_epoch)
        st = stria__wcall_bind(s, req->link_epoch);
    if (st == STRIA_OK && s->sharded) {
        /* a scale of 0 and the value it stands for are one call */
        stria_call_shape_t same = g->shape;
        same.scale = stria_call_scale(same.scale, s->head_dim);
        st = agree(s, req->call, req->backward,
                   stria_call_shape_digest(&same, (int)s->layout_kind, req->call, req->backward));
    }
    bool own = false; /* a failure of this rank's own: the others must hear of it */
    if (st == STRIA_OK && (st = views_in(s, g, ptr, view)) != STRIA_OK)
        own = true;
    if (st == STRIA_OK && (st = pass_of(s, &g->shape, &pass)) != STRIA_OK)
        own = true;
    if (st == STRIA_OK && (st = stria_ring_pass_set_call(pass, req->call)) != STRIA_OK)
        own = true;
    if (own) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        if (s->eng.link != NULL)
            stria_link_abort(s->eng.link, st, msg);
        stria_error_set(st, "%s", msg);
    }
    if (st == STRIA_OK) {
        const int64_t L = g->shard;
        stria_log_debug("session %llu rank %d: call %llu (%s) runs its ring pass",
                        (unsigned long long)s->id, s->rank, (unsigned long long)req->call,
                        req->backward ? "backward" : "forward");
        stria_tensor_t t[STRIA__T_COUNT];
        for (int i = 0; i < STRIA__T_COUNT; i++)
            if (i != STRIA__T_LSE)
                t[i] = stria_tensor_contiguous(view[i], s->dtype, L,
                                               kv_tensor(i) ? s->kv_heads : s->heads, s->head_dim);
        float *lse = view[STRIA__T_LSE];
        if (!req->backward)
            st = stria_ring_fwd(pass, &t[STRIA__T_Q], &t[STRIA__T_K], &t[STRIA__T_V],
                                &t[STRIA__T_O], lse);
        else
            st = stria_ring_bwd(pass, &t[STRIA__T_Q], &t[STRIA__T_K], &t[STRIA__T_V],
                                &t[STRIA__T_O], lse, &t[STRIA__T_DO], &t[STRIA__T_DQ],
                                &t[STRIA__T_DK], &t[STRIA__T_DV]);
        records(s, pass, req->backward, &run->stats);
        if (st == STRIA_OK && (st = views_out(s, g, ptr)) != STRIA_OK)
            stria_error_wrap(st, "rank %d: the outputs", s->rank);
        /* the step times of sampled calls (every rank samples the same), and
         * of every call of a job (its reports carry them) */
        if (st == STRIA_OK && (req->call % STRIA__TL_EVERY == 0 || s->report_calls))
            run->have_tl = stria__wtimeline_build(s->rank, s->n_ranks, pass, (uint32_t)req->call,
                                                  req->backward, &run->tl) == STRIA_OK;
    }
    run->stats.seconds = stria_time_now() - run->started;
    return st;
}
