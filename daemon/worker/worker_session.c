/* Sessions (JobSpec.session): a trainer's ring opened once on this worker
 * and the calls that run on it.
 *
 * OpenSession finds or creates the session's job (its assignment from the
 * coordinator, on a thread of its own when the worker does not hold it yet),
 * checks the proof of its secret, allocates the rank's buffers for the
 * bounds and starts the session's pass thread, which connects the ring link
 * and answers the open once it is up. Each SessionCall is checked (its
 * shape against the bounds, by the same function libstria uses, from the
 * worker's own decoded copy), its payload read straight into the session's
 * input buffer and handed to the pass thread, which runs the pass on the
 * link it keeps (a new one only when the client's link epoch moved, after a
 * failed call) with the call's number in every tag, and replies with the
 * outputs from the session's output buffer. No coordinator call, no new
 * link, thread or mapping per call; the pass object is made again only when
 * the call's shape differs from the last one's (its buffers come from the
 * worker's pool). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "worker_int.h"

#define STRIA__LAT_KEPT    256
#define STRIA__PASSES_KEPT 4
/* Calls whose number is a multiple of this keep their step times for the
 * next heartbeat (striactl session ID --timeline): every rank samples the
 * same calls, so the coordinator gets whole rings, at a cost of one
 * timeline per 64 calls. */
#define STRIA__TL_EVERY 64

struct stria__wsess {
    stria__wjob_t *j;
    pthread_cond_t cv; /* with w->lock */
    bool stop;         /* the job was dropped, or the worker stops: the thread ends */
    bool started;      /* the thread runs */
    /* OpenSession calls answered when the link is up (or failed) */
    stria_rpc_call_t *opens[4];
    int n_opens;
    bool link_up;
    char link_error[512];
    stria_rpc_call_t *call; /* the call handed to the thread */
    bool busy;              /* a call was accepted and is not answered yet */
    /* the thread's own */
    stria_link_t *link;
    uint64_t epoch;
    /* pass objects of the last shapes called, least recently used replaced
     * first (a model's layers alternate a few shapes: none is remade) */
    struct {
        stria_ring_pass_t *pass;
        stria_call_shape_t shape; /* an owning copy */
        uint64_t used;
    } passes[STRIA__PASSES_KEPT];
    stria_ring_pass_t *pass; /* the current call's */
    uint64_t uses;
    /* buffers for the bounds, from the job pool: the request payload (inputs,
     * real tokens only) and the reply payload */
    char *in, *out;
    size_t in_cap, out_cap;
    uint64_t rows; /* batch x shard tokens the bounds allow */
    /* A co-located client's arena (OP_ARENA): its sealed memfd mapped here;
     * calls name their inputs and outputs in it. arena_closed (its
     * connection closed) makes the thread unmap it between calls. */
    char *arena;
    size_t arena_size;
    bool arena_closed;
    /* under w->lock: calls, bytes moved, the latencies of the last
     * STRIA__LAT_KEPT calls (seconds; a ring) */
    uint64_t calls, failed, bytes;
    float lat[STRIA__LAT_KEPT];
    unsigned n_lat;
    /* under w->lock: the step times of the latest sampled call
     * (STRIA__TL_EVERY), until a heartbeat takes them */
    stria__wtimeline_t tl;
    bool tl_new;
};

/* The geometry of one call on this rank. */
typedef struct {
    stria_call_shape_t shape;
    stria_layout_t layout;
    int64_t valid;                         /* real tokens of this rank */
    bool padded;                           /* valid < layout.shard_tokens */
    size_t qrow, kvrow;                    /* bytes per token */
    uint64_t q_bytes, kv_bytes, lse_bytes; /* compact */
    bool backward;
} stria__wcall_t;

static stria_status_t stria__call_geom(const stria__wjob_t *j, const stria_call_shape_t *shape,
                                       bool backward, stria__wcall_t *g)
{
    const stria_call_bounds_t b = {.max_batch = j->batch,
                                   .max_seq_len = j->seq_len,
                                   .n_ranks = j->n_ranks,
                                   .layout = (int)j->layout_kind};
    stria_status_t st = stria_call_shape_check(shape, &b);
    if (st != STRIA_OK)
        return st;
    memset(g, 0, sizeof(*g));
    g->shape = *shape;
    g->backward = backward;
    if ((st = stria_layout_init(j->layout_kind, j->n_ranks, shape->seq_len, &g->layout)) !=
        STRIA_OK)
        return st;
    uint64_t rows = (uint64_t)shape->batch * (uint64_t)g->layout.shard_tokens;
    if (rows > j->sess->rows)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "call batch x seq_len (%lld x %lld) needs %llu shard rows on rank "
                               "%d, more than the session's bounds hold (%llu)",
                               (long long)shape->batch, (long long)shape->seq_len,
                               (unsigned long long)rows, j->rank,
                               (unsigned long long)j->sess->rows);
    g->valid = stria_layout_shard_valid(&g->layout, j->rank);
    g->padded = g->valid < g->layout.shard_tokens;
    size_t es = stria_dtype_size(j->dtype);
    g->qrow = (size_t)(j->heads * j->head_dim) * es;
    g->kvrow = (size_t)(j->kv_heads * j->head_dim) * es;
    uint64_t tok = (uint64_t)shape->batch * (uint64_t)g->valid;
    g->q_bytes = tok * g->qrow;
    g->kv_bytes = tok * g->kvrow;
    g->lse_bytes = tok * (uint64_t)j->heads * 4u;
    return STRIA_OK;
}

static uint64_t stria__call_in_bytes(const stria__wcall_t *g)
{
    return g->backward ? 3 * g->q_bytes + 2 * g->kv_bytes + g->lse_bytes
                       : g->q_bytes + 2 * g->kv_bytes;
}

static uint64_t stria__call_out_bytes(const stria__wcall_t *g)
{
    return g->backward ? g->q_bytes + 2 * g->kv_bytes : g->q_bytes + g->lse_bytes;
}

/* ---- buffers ------------------------------------------------------------------ */

/* The session's buffers for its bounds: inputs Q, K, V, O, LSE, dO and
 * outputs (the larger of O + LSE and dQ + dK + dV), for every shard row the
 * bounds allow. */
static stria_status_t stria__sess_buffers(stria_worker_t *w, stria__wjob_t *j)
{
    stria__wsess_t *s = j->sess;
    size_t es = stria_dtype_size(j->dtype);
    uint64_t qrow = (uint64_t)(j->heads * j->head_dim) * es;
    uint64_t kvrow = (uint64_t)(j->kv_heads * j->head_dim) * es;
    uint64_t lrow = (uint64_t)j->heads * 4u;
    s->rows = (uint64_t)j->batch * (uint64_t)j->layout.shard_tokens;
    s->in_cap = (size_t)(s->rows * (3 * qrow + 2 * kvrow + lrow));
    uint64_t fo = qrow + lrow, bo = qrow + 2 * kvrow;
    s->out_cap = (size_t)(s->rows * (fo > bo ? fo : bo));
    stria_status_t st = stria_mempool_alloc(w->mem_jobs, s->in_cap, (void **)&s->in);
    if (st == STRIA_OK)
        st = stria_mempool_alloc(w->mem_jobs, s->out_cap, (void **)&s->out);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "session %llu: its buffers", (unsigned long long)j->id);
    return STRIA_OK;
}

/* ---- the pass thread ---------------------------------------------------------- */

static void stria__sess_on_step(void *arg, int step, int n_steps)
{
    stria__wjob_t *j = arg;
    pthread_mutex_lock(&j->w->lock);
    j->step = (uint32_t)step;
    j->steps_total = (uint32_t)n_steps;
    pthread_mutex_unlock(&j->w->lock);
}

/* Connects the session's link of `epoch` (its ring id: every rank of a
 * call asks for the same), replacing the one it had. */
static stria_status_t stria__sess_connect(stria_worker_t *w, stria__wjob_t *j, uint64_t epoch)
{
    stria__wsess_t *s = j->sess;
    if (s->link != NULL) {
        for (int i = 0; i < STRIA__PASSES_KEPT; i++)
            if (s->passes[i].pass != NULL)
                stria_ring_pass_set_link(s->passes[i].pass, &j->parked);
        pthread_mutex_lock(&w->lock);
        j->link = NULL;
        pthread_mutex_unlock(&w->lock);
        stria_link_destroy(s->link);
        s->link = NULL;
    }
    stria_link_t *link = NULL;
    stria_status_t st =
        stria__wjob_connect(w, j, 0x80000000u | (uint32_t)(epoch & 0x7fffffff), &link);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "session %llu rank %d: ring link to %s",
                                (unsigned long long)j->id, j->rank, j->next_ucx);
    pthread_mutex_lock(&w->lock);
    j->link = link; /* a drop or a shutdown aborts it */
    if (s->stop || w->abort_passes)
        stria_link_abort(link, STRIA_ERR_CANCELLED, "the session is closing");
    pthread_mutex_unlock(&w->lock);
    s->link = link;
    s->epoch = epoch;
    return STRIA_OK; /* the kept pass objects are bound to it when used */
}

/* The pass object of the call's shape, bound to the session's link: a kept
 * one of the same shape, else a new one (its buffers from the worker's
 * pool) in place of the least recently used. */
static stria_status_t stria__sess_pass(stria_worker_t *w, stria__wjob_t *j,
                                       const stria_call_shape_t *shape)
{
    stria__wsess_t *s = j->sess;
    int slot = 0;
    for (int i = 0; i < STRIA__PASSES_KEPT; i++) {
        if (s->passes[i].pass != NULL && stria_call_shape_equal(&s->passes[i].shape, shape)) {
            s->passes[i].used = ++s->uses;
            s->pass = s->passes[i].pass;
            return stria_ring_pass_set_link(s->pass, s->link);
        }
        if (s->passes[i].used < s->passes[slot].used) /* an empty slot's is 0 */
            slot = i;
    }
    s->pass = NULL;
    stria_ring_pass_destroy(s->passes[slot].pass);
    s->passes[slot].pass = NULL;
    stria_call_shape_free(&s->passes[slot].shape);
    if (stria_call_shape_copy(shape, &s->passes[slot].shape) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_NO_MEMORY, "session %llu", (unsigned long long)j->id);
    s->passes[slot].used = ++s->uses;
    stria_ring_shape_t rs = stria__wjob_ring_shape(j, &s->passes[slot].shape);
    stria_ring_opts_t opts;
    memset(&opts, 0, sizeof(opts));
    opts.step_timeout_s = j->step_timeout_s;
    opts.pool = w->pool;
    opts.device = j->dev;
    opts.step_cb = stria__sess_on_step;
    opts.step_cb_ctx = j;
    opts.host_memory = &w->alloc_host;
    stria_status_t st =
        stria_ring_pass_create(s->link, &rs, j->layout_kind, &opts, &s->passes[slot].pass);
    s->pass = s->passes[slot].pass;
    return st;
}

/* Views of the call's tensors: in the session's buffers when the shard has
 * no padding, else in the job's padded tensors (j->buf, allocated at the
 * first such call) with the inputs copied there. */
typedef struct {
    stria_tensor_t q, k, v, o, d_o, dq, dk, dv;
    float *lse;
} stria__views_t;

static void stria__compact_copy(void *dst, const void *src, int64_t outer, int64_t valid,
                                int64_t padded, size_t row, bool to_padded)
{
    for (int64_t i = 0; i < outer; i++) {
        size_t c = (size_t)(i * valid) * row, p = (size_t)(i * padded) * row;
        if (to_padded)
            memcpy((char *)dst + p, (const char *)src + c, (size_t)valid * row);
        else
            memcpy((char *)dst + c, (const char *)src + p, (size_t)valid * row);
    }
}

static stria_status_t stria__sess_views(stria_worker_t *w, stria__wjob_t *j,
                                        const stria__wcall_t *g, char *in_base, char *out_base,
                                        stria__views_t *v)
{
    int64_t L = g->layout.shard_tokens, B = g->shape.batch;
    /* compact inputs, then outputs, in payload order */
    char *in[6], *out[3];
    in[0] = in_base;
    in[1] = in[0] + g->q_bytes;
    in[2] = in[1] + g->kv_bytes;
    in[3] = in[2] + g->kv_bytes;  /* backward: O */
    in[4] = in[3] + g->q_bytes;   /* LSE */
    in[5] = in[4] + g->lse_bytes; /* dO */
    out[0] = out_base;
    out[1] = out[0] + g->q_bytes;  /* forward LSE; backward dK */
    out[2] = out[1] + g->kv_bytes; /* backward dV */
    if (g->padded) {
        if (j->buf[STRIA__T_Q] == NULL) {
            stria_status_t st = stria__wpool_tensors(w, j);
            if (st != STRIA_OK)
                return st;
        }
        static const int fwd_in[] = {STRIA__T_Q, STRIA__T_K, STRIA__T_V};
        static const int bwd_in[] = {STRIA__T_Q, STRIA__T_K,   STRIA__T_V,
                                     STRIA__T_O, STRIA__T_LSE, STRIA__T_DO};
        const int *ids = g->backward ? bwd_in : fwd_in;
        for (int i = 0; i < (g->backward ? 6 : 3); i++) {
            int t = ids[i];
            bool lse = t == STRIA__T_LSE;
            size_t row = lse ? 4 : (t == STRIA__T_K || t == STRIA__T_V) ? g->kvrow : g->qrow;
            stria__compact_copy(j->buf[t], in[i], lse ? B * j->heads : B, g->valid, L, row, true);
            in[i] = j->buf[t];
        }
        out[0] = j->buf[g->backward ? STRIA__T_DQ : STRIA__T_O];
        out[1] = j->buf[g->backward ? STRIA__T_DK : STRIA__T_LSE];
        out[2] = j->buf[STRIA__T_DV];
    }
    v->q = stria_tensor_contiguous(in[0], j->dtype, L, j->heads, j->head_dim);
    v->k = stria_tensor_contiguous(in[1], j->dtype, L, j->kv_heads, j->head_dim);
    v->v = stria_tensor_contiguous(in[2], j->dtype, L, j->kv_heads, j->head_dim);
    if (!g->backward) {
        v->o = stria_tensor_contiguous(out[0], j->dtype, L, j->heads, j->head_dim);
        v->lse = (float *)out[1];
    } else {
        v->o = stria_tensor_contiguous(in[3], j->dtype, L, j->heads, j->head_dim);
        v->lse = (float *)in[4];
        v->d_o = stria_tensor_contiguous(in[5], j->dtype, L, j->heads, j->head_dim);
        v->dq = stria_tensor_contiguous(out[0], j->dtype, L, j->heads, j->head_dim);
        v->dk = stria_tensor_contiguous(out[1], j->dtype, L, j->kv_heads, j->head_dim);
        v->dv = stria_tensor_contiguous(out[2], j->dtype, L, j->kv_heads, j->head_dim);
    }
    return STRIA_OK;
}

/* After a padded call: its outputs, real tokens only, into the reply buffer. */
static void stria__sess_compact_out(stria__wjob_t *j, const stria__wcall_t *g, char *out)
{
    int64_t L = g->layout.shard_tokens, B = g->shape.batch;
    if (!g->backward) {
        stria__compact_copy(out, j->buf[STRIA__T_O], B, g->valid, L, g->qrow, false);
        stria__compact_copy(out + g->q_bytes, j->buf[STRIA__T_LSE], B * j->heads, g->valid, L, 4,
                            false);
    } else {
        stria__compact_copy(out, j->buf[STRIA__T_DQ], B, g->valid, L, g->qrow, false);
        stria__compact_copy(out + g->q_bytes, j->buf[STRIA__T_DK], B, g->valid, L, g->kvrow, false);
        stria__compact_copy(out + g->q_bytes + g->kv_bytes, j->buf[STRIA__T_DV], B, g->valid, L,
                            g->kvrow, false);
    }
}

/* Sharded sessions: every rank compares its call's digest with its
 * predecessor's before step 0, waiting up to the arrival timeout for it. A
 * rank that finds a difference aborts the link, so every rank fails, the
 * message naming both ranks. */
static stria_status_t stria__sess_agree(stria__wjob_t *j, uint64_t call, uint64_t digest)
{
    stria_link_t *link = j->sess->link;
    if (j->n_ranks < 2)
        return STRIA_OK;
    uint8_t mine[8], theirs[8];
    stria_put_le64(mine, digest);
    uint64_t tag = ((call & STRIA_RING_CALL_ID_MASK) << 24) | (0xffffu << 8) | 0xd1u;
    stria_link_req_t *sreq = NULL, *rreq = NULL;
    stria_status_t st = stria_link_isend(link, tag, mine, sizeof(mine), &sreq);
    if (st == STRIA_OK)
        st = stria_link_irecv(link, tag, theirs, sizeof(theirs), &rreq);
    if (st == STRIA_OK) {
        st = stria_link_wait(link, rreq, j->arrival_timeout_s);
        rreq = NULL;
    }
    if (st == STRIA_OK) {
        st = stria_link_wait(link, sreq, j->step_timeout_s);
        sreq = NULL;
    }
    stria_link_cancel(link, rreq);
    stria_link_cancel(link, sreq);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "rank %d: waiting for rank %d's call %llu", j->rank,
                                stria_link_prev(link), (unsigned long long)call);
    if (stria_get_le64(theirs) != digest) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "rank %d: call %llu differs between rank %d and rank %d (every rank "
                             "must make the same calls, with the same shape, in the same order)",
                             j->rank, (unsigned long long)call, stria_link_prev(link), j->rank);
        stria_link_abort(link, st, stria_error_msg());
    }
    return st;
}

static uint64_t stria__minflt(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? (uint64_t)ru.ru_minflt : 0;
}

/* Runs one call on the pass thread and answers it. */
static void stria__sess_run(stria_worker_t *w, stria__wjob_t *j, stria_rpc_call_t *call)
{
    stria__wsess_t *s = j->sess;
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    Stria__V1__PassStats stats = STRIA__V1__PASS_STATS__INIT;
    stria__wcall_t g;
    stria__views_t v;
    stria_call_shape_t shape;
    uint64_t flt0 = stria__minflt();
    double t0 = stria_time_now();
    int b = req->backward ? 1 : 0;
    stria__wtimeline_t tl;
    bool have_tl = false;
    memset(&tl, 0, sizeof(tl));

    /* the arena's place was checked when the call was accepted; it stays
     * mapped until this thread unmaps it */
    char *in = req->arena ? s->arena + req->arena_in : s->in;
    char *out = req->arena ? s->arena + req->arena_out : s->out;
    stria_call_shape_from_pb(req->shape, &shape);
    stria_status_t st = stria__call_geom(j, &shape, req->backward, &g);
    if (st == STRIA_OK && (s->link == NULL || s->epoch != req->link_epoch))
        st = stria__sess_connect(w, j, req->link_epoch);
    if (st == STRIA_OK && j->sharded)
        st = stria__sess_agree(j, req->call,
                               stria_call_shape_digest(&shape, req->call, req->backward));
    if (st == STRIA_OK && (st = stria__sess_views(w, j, &g, in, out, &v)) != STRIA_OK)
        stria_link_abort(s->link, st, stria_error_msg());
    if (st == STRIA_OK && (st = stria__sess_pass(w, j, &shape)) != STRIA_OK)
        stria_link_abort(s->link, st, stria_error_msg());
    if (st == STRIA_OK && (st = stria_ring_pass_set_call(s->pass, req->call)) == STRIA_OK) {
        st = req->backward ? stria_ring_bwd(s->pass, &v.q, &v.k, &v.v, &v.o, v.lse, &v.d_o, &v.dq,
                                            &v.dk, &v.dv)
                           : stria_ring_fwd(s->pass, &v.q, &v.k, &v.v, &v.o, v.lse);
        size_t n = 0;
        const stria_ring_step_stats_t *ss = stria_ring_pass_stats(s->pass, &n);
        for (size_t i = 0; i < n; i++) {
            stats.compute_seconds += ss[i].compute_wall_s;
            stats.wait_seconds += ss[i].wait_s;
            stats.bytes_sent += ss[i].bytes_sent;
            stria_metric_observe(w->m_step_compute, ss[i].compute_wall_s);
            stria_metric_observe(w->m_step_wait, ss[i].wait_s);
            stria_metric_add(w->m_bytes_sent, (double)ss[i].bytes_sent);
            stria_metric_add(w->m_bytes_recv, (double)ss[i].bytes_recv);
        }
        stats.steps = (uint32_t)stria_ring_pass_steps(s->pass);
        have_tl =
            st == STRIA_OK && req->call % STRIA__TL_EVERY == 0 &&
            stria__wtimeline_build(j, s->pass, (uint32_t)req->call, req->backward, &tl) == STRIA_OK;
    }
    if (st == STRIA_OK && g.padded)
        stria__sess_compact_out(j, &g, out);
    stats.seconds = stria_time_now() - t0;
    stria_metric_add(w->m_passes[b], 1);
    stria_metric_observe(w->m_pass_s[b], stats.seconds);
    stria_metric_observe(w->m_call_s[b], stats.seconds);

    pthread_mutex_lock(&w->lock);
    j->running = false;
    j->last_activity = stria_time_now();
    j->phase = st == STRIA_OK ? STRIA__V1__JOB_STATE__JOB_STATE_FORWARD_DONE
                              : STRIA__V1__JOB_STATE__JOB_STATE_LOADING;
    if (st == STRIA_OK) {
        s->calls++;
        s->bytes += stria__call_in_bytes(&g) + stria__call_out_bytes(&g);
        s->lat[s->n_lat++ % STRIA__LAT_KEPT] = (float)stats.seconds;
        if (have_tl) {
            stria__wtimeline_free(&s->tl);
            s->tl = tl;
            s->tl_new = true;
            have_tl = false;
        }
    } else {
        s->failed++;
    }
    pthread_mutex_unlock(&w->lock);
    if (have_tl)
        stria__wtimeline_free(&tl);

    if (st == STRIA_OK) {
        Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
        rep.stats = &stats;
        rep.worker_minflt = stria__minflt() - flt0;
        uint64_t call_no = req->call;
        /* The reply takes a copy of the outputs before it returns, so the
         * next call may be taken at once: its inputs go to the input
         * buffer, and its pass runs on this thread after the copy. (A
         * reply sent from the buffer would keep the session busy until
         * the loop saw the write done, which may come after the client,
         * which has read the reply, sent its next call: refused busy.) */
        pthread_mutex_lock(&w->lock);
        s->busy = false;
        pthread_cond_broadcast(&s->cv); /* an arena to unmap may wait for it */
        pthread_mutex_unlock(&w->lock);
        if (stria_rpc_call_reply(call, &rep.base, req->arena ? NULL : s->out,
                                 req->arena ? 0 : stria__call_out_bytes(&g), NULL,
                                 NULL) != STRIA_OK)
            stria_log_warn("session %llu: the reply to call %llu could not be sent",
                           (unsigned long long)j->id, (unsigned long long)call_no);
    } else {
        char msg[1024];
        int n = snprintf(msg, sizeof(msg), "rank %d", j->rank);
        if (strncmp(stria_error_msg(), msg, (size_t)n) != 0)
            snprintf(msg, sizeof(msg), "rank %d: %s", j->rank, stria_error_msg());
        else
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria_metric_add(w->m_pass_fail[b], 1);
        /* a link or a peer: retryable; but not a peer's abort of a call it
         * found bad (its input: ranks that disagree, a shape it refused) */
        bool retryable =
            (st == STRIA_ERR_PEER || st == STRIA_ERR_TRANSPORT || st == STRIA_ERR_CLOSED ||
             st == STRIA_ERR_TIMEOUT || st == STRIA_ERR_IO) &&
            strstr(msg, "(invalid argument)") == NULL;
        stria_log_info("session %llu call %llu failed: %s", (unsigned long long)j->id,
                       (unsigned long long)req->call, msg);
        pthread_mutex_lock(&w->lock);
        s->busy = false;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&w->lock);
        stria_rpc_call_fail_r(call, st, retryable, "%s", msg);
    }
}

static void stria__sess_answer_opens(stria_worker_t *w, stria__wjob_t *j, stria_status_t st,
                                     double connect_s)
{
    stria__wsess_t *s = j->sess;
    stria_rpc_call_t *opens[4];
    pthread_mutex_lock(&w->lock);
    int n = s->n_opens;
    memcpy(opens, s->opens, sizeof(opens));
    s->n_opens = 0;
    s->link_up = st == STRIA_OK;
    if (st != STRIA_OK)
        snprintf(s->link_error, sizeof(s->link_error), "%s", stria_error_msg());
    pthread_mutex_unlock(&w->lock);
    for (int i = 0; i < n; i++) {
        if (st != STRIA_OK) {
            stria_rpc_call_fail_r(opens[i], st, true, "%s", s->link_error);
            continue;
        }
        Stria__V1__OpenSessionReply rep = STRIA__V1__OPEN_SESSION_REPLY__INIT;
        rep.buffer_bytes = s->in_cap + s->out_cap;
        rep.connect_seconds = connect_s;
        stria_rpc_call_reply(opens[i], &rep.base, NULL, 0, NULL, NULL);
    }
}

static void *stria__sess_thread(void *arg)
{
    stria__wjob_t *j = arg;
    stria_worker_t *w = j->w;
    stria__wsess_t *s = j->sess;

    /* the link, once, at open (a running pass for the shutdown's count) */
    double t0 = stria_time_now();
    stria_status_t st = stria__sess_connect(w, j, 0);
    if (st != STRIA_OK)
        stria_log_warn("session %llu rank %d: %s", (unsigned long long)j->id, j->rank,
                       stria_error_msg());
    else
        stria_log_info("session %llu rank %d: ring link up in %.3f s", (unsigned long long)j->id,
                       j->rank, stria_time_now() - t0);
    stria__sess_answer_opens(w, j, st, stria_time_now() - t0);
    pthread_mutex_lock(&w->lock);
    w->running_passes--;
    pthread_cond_broadcast(&w->cv);
    for (;;) {
        while (!s->stop && s->call == NULL && s->n_opens == 0 &&
               !(s->arena_closed && s->arena != NULL && !s->busy))
            pthread_cond_wait(&s->cv, &w->lock);
        if (s->arena_closed && s->arena != NULL && !s->busy) {
            /* its client's connection closed: no call of it runs or waits */
            munmap(s->arena, s->arena_size);
            s->arena = NULL;
            s->arena_closed = false;
            continue;
        }
        if (s->stop)
            break;
        if (s->n_opens > 0) { /* another client of the session opened it again */
            bool up = s->link_up;
            pthread_mutex_unlock(&w->lock);
            if (!up)
                stria_error_set(STRIA_ERR_TRANSPORT, "%s", s->link_error);
            stria__sess_answer_opens(w, j, up ? STRIA_OK : STRIA_ERR_TRANSPORT, 0);
            pthread_mutex_lock(&w->lock);
            continue;
        }
        stria_rpc_call_t *call = s->call;
        s->call = NULL;
        pthread_mutex_unlock(&w->lock);
        stria__sess_run(w, j, call);
        pthread_mutex_lock(&w->lock);
        w->running_passes--;
        pthread_cond_broadcast(&w->cv);
    }
    /* closing: answer what waits, give everything back */
    stria_rpc_call_t *call = s->call;
    s->call = NULL;
    int n_opens = s->n_opens;
    pthread_mutex_unlock(&w->lock);
    if (call != NULL) {
        stria_rpc_call_fail_r(call, STRIA_ERR_CANCELLED, false, "session %llu is closed",
                              (unsigned long long)j->id);
        pthread_mutex_lock(&w->lock);
        w->running_passes--;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->lock);
    }
    if (n_opens > 0) {
        stria_error_set(STRIA_ERR_CANCELLED, "session %llu is closed", (unsigned long long)j->id);
        stria__sess_answer_opens(w, j, STRIA_ERR_CANCELLED, 0);
    }
    for (int i = 0; i < STRIA__PASSES_KEPT; i++) {
        stria_ring_pass_destroy(s->passes[i].pass);
        s->passes[i].pass = NULL;
        stria_call_shape_free(&s->passes[i].shape);
    }
    s->pass = NULL;
    pthread_mutex_lock(&w->lock);
    if (s->arena != NULL) /* a reply still being written reads no arena: it has no payload */
        munmap(s->arena, s->arena_size);
    s->arena = NULL;
    j->link = NULL;
    pthread_mutex_unlock(&w->lock);
    stria_link_destroy(s->link);
    s->link = NULL;
    stria_log_info("session %llu rank %d closed after %llu calls (%llu failed)",
                   (unsigned long long)j->id, j->rank, (unsigned long long)s->calls,
                   (unsigned long long)s->failed);
    pthread_mutex_lock(&w->lock);
    w->session_threads--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    stria__wjob_unref(w, j);
    return NULL;
}

/* ---- with the job ------------------------------------------------------------- */

static int stria__float_cmp(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

void stria__wsess_stats_locked(const stria__wjob_t *j, Stria__V1__SessionStats *out)
{
    const stria__wsess_t *s = j->sess;
    float sorted[STRIA__LAT_KEPT];
    unsigned n = s->n_lat < STRIA__LAT_KEPT ? s->n_lat : STRIA__LAT_KEPT;
    stria__v1__session_stats__init(out);
    out->calls = s->calls;
    out->failed_calls = s->failed;
    out->bytes = s->bytes;
    if (n == 0)
        return;
    memcpy(sorted, s->lat, n * sizeof(float));
    qsort(sorted, n, sizeof(float), stria__float_cmp);
    out->call_p50_ms = 1000.0f * sorted[n / 2];
    out->call_p99_ms = 1000.0f * sorted[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1];
}

bool stria__wsess_timeline_take_locked(stria__wjob_t *j, stria__wtimeline_t *out)
{
    stria__wsess_t *s = j->sess;
    if (s == NULL || !s->tl_new)
        return false;
    *out = s->tl;
    memset(&s->tl, 0, sizeof(s->tl));
    s->tl_new = false;
    return true;
}

void stria__wsess_stop_locked(stria__wjob_t *j)
{
    if (j->sess == NULL)
        return;
    j->sess->stop = true;
    pthread_cond_broadcast(&j->sess->cv);
}

void stria__wsess_free(stria_worker_t *w, stria__wjob_t *j)
{
    stria__wsess_t *s = j->sess;
    if (s == NULL)
        return;
    stria_mempool_free(w->mem_jobs, s->in);
    stria_mempool_free(w->mem_jobs, s->out);
    stria__wtimeline_free(&s->tl);
    pthread_cond_destroy(&s->cv);
    free(s);
    j->sess = NULL;
}

/* Opens the session on this rank (the OpenSession call, proof checked):
 * the first open starts its thread, which answers once the link is up; a
 * later one is answered at once (or when the link is). Consumes the job's
 * reference. */
static void stria__sess_open(stria_worker_t *w, stria__wjob_t *j, stria_rpc_call_t *call)
{
    stria_status_t st = STRIA_OK;
    if (!j->session) {
        stria__wjob_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "job %llu is not a session",
                            (unsigned long long)j->id);
        return;
    }
    pthread_mutex_lock(&w->lock);
    if (j->sess == NULL) {
        j->sess = calloc(1, sizeof(*j->sess));
        if (j->sess == NULL)
            st = stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
        else {
            j->sess->j = j;
            pthread_cond_init(&j->sess->cv, NULL);
            stria__wpass_park_init(j);
        }
    }
    stria__wsess_t *s = j->sess;
    if (st == STRIA_OK && (j->dropped || w->stopping))
        st = stria_error_set(STRIA_ERR_CANCELLED, "session %llu is closing",
                             (unsigned long long)j->id);
    if (st == STRIA_OK && s->n_opens == (int)(sizeof(s->opens) / sizeof(s->opens[0])))
        st = stria_error_set(STRIA_ERR_BUSY, "session %llu rank %d: too many opens at once",
                             (unsigned long long)j->id, j->rank);
    bool start = st == STRIA_OK && !s->started;
    if (st == STRIA_OK) {
        s->opens[s->n_opens++] = call;
        if (!start)
            pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&w->lock);
    if (st != STRIA_OK) {
        stria__wjob_unref(w, j);
        stria_rpc_call_fail(call, st, "%s", stria_error_msg());
        return;
    }
    if (!start) {
        stria__wjob_unref(w, j);
        return;
    }
    if ((st = stria__sess_buffers(w, j)) == STRIA_OK) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_mutex_lock(&w->lock);
        s->started = true;
        w->session_threads++;
        w->running_passes++; /* the link's set-up, as a pass */
        pthread_mutex_unlock(&w->lock);
        int rc = pthread_create(&th, &attr, stria__sess_thread, j); /* keeps our reference */
        pthread_attr_destroy(&attr);
        if (rc == 0)
            return;
        pthread_mutex_lock(&w->lock);
        s->started = false;
        w->session_threads--;
        w->running_passes--;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->lock);
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot start the session's thread");
    }
    stria__sess_answer_opens(w, j, st, 0);
    stria__wjob_unref(w, j);
}

typedef struct {
    stria_worker_t *w;
    stria_rpc_call_t *call;
    uint64_t job_id;
    uint32_t rank;
    stria__wjob_t *job;
    stria_status_t st;
    char error[512];
} stria__open_fetch_t;

/* On the loop thread again: the proof, then the open. */
static void stria__open_fetched(void *arg)
{
    stria__open_fetch_t *f = arg;
    stria_worker_t *w = f->w;
    if (f->st != STRIA_OK) {
        stria_rpc_call_fail(f->call, f->st, "%s", f->error);
    } else if (stria_rpc_call_check_job(f->call, &f->job->secret, f->job_id) != STRIA_OK) {
        stria_rpc_call_fail(f->call, STRIA_ERR_AUTH, "%s", stria_error_msg());
        stria__wjob_unref(w, f->job);
    } else {
        stria__sess_open(w, f->job, f->call);
    }
    free(f);
}

static void *stria__open_fetch(void *arg)
{
    stria__open_fetch_t *f = arg;
    stria_worker_t *w = f->w;
    f->st = stria__wjob_get(w, f->job_id, f->rank, true, &f->job);
    if (f->st != STRIA_OK)
        snprintf(f->error, sizeof(f->error), "%s", stria_error_msg());
    if (stria_rpc_server_post(w->server, stria__open_fetched, f) != STRIA_OK) {
        stria_rpc_call_fail(f->call, STRIA_ERR_NO_MEMORY, "out of memory");
        if (f->st == STRIA_OK)
            stria__wjob_unref(w, f->job);
        free(f);
    }
    pthread_mutex_lock(&w->lock);
    w->fetching--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

void stria__w_on_open_session(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__OpenSessionRequest *req =
        (const Stria__V1__OpenSessionRequest *)stria_rpc_call_request(call);
    stria__wjob_t *j;
    stria_status_t st = stria__wjob_get_checked(w, call, req->job_id, req->rank, false, &j);
    if (st == STRIA_OK) {
        stria__sess_open(w, j, call);
        return;
    }
    if (st != STRIA_ERR_NOT_FOUND) {
        stria_rpc_call_fail(call, st, "%s", stria_error_msg());
        return;
    }
    /* not held yet: its assignment from the coordinator, off the loop */
    stria__open_fetch_t *f = calloc(1, sizeof(*f));
    pthread_mutex_lock(&w->lock);
    bool room = w->fetching < STRIA__MAX_FETCHES && !w->stopping;
    if (room && f != NULL)
        w->fetching++;
    pthread_mutex_unlock(&w->lock);
    if (f == NULL || !room) {
        free(f);
        stria_rpc_call_fail_r(call, STRIA_ERR_BUSY, true,
                              "this worker is fetching %d job assignments already, or stopping",
                              STRIA__MAX_FETCHES);
        return;
    }
    *f = (stria__open_fetch_t){.w = w, .call = call, .job_id = req->job_id, .rank = req->rank};
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&th, &attr, stria__open_fetch, f);
    pthread_attr_destroy(&attr);
    if (rc == 0)
        return;
    free(f);
    pthread_mutex_lock(&w->lock);
    w->fetching--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "cannot start a thread");
}

/* ---- calls ---------------------------------------------------------------------- */

/* An accepted call until its handler hands it to the pass thread: when the
 * connection goes first (mid-payload), the session is no longer busy. */
typedef struct {
    stria__wjob_t *j;
    bool handed;
} stria__accepted_t;

static void stria__call_cleanup(void *arg)
{
    stria__accepted_t *a = arg;
    stria_worker_t *w = a->j->w;
    if (!a->handed) {
        pthread_mutex_lock(&w->lock);
        a->j->sess->busy = false;
        pthread_cond_broadcast(&a->j->sess->cv);
        pthread_mutex_unlock(&w->lock);
    }
    stria__wjob_unref(w, a->j);
    free(a);
}

/* Whether [off, off + len) lies inside `size` bytes. */
static bool stria__inside(uint64_t off, uint64_t len, uint64_t size)
{
    return off <= size && len <= size - off;
}

/* The checks of a call before anything of it is read: the proof, the
 * session open here, the shape against the bounds (the worker's own copy),
 * the inputs (payload_len bytes of payload, or their place in the arena),
 * one call at a time. On success *out holds the job's reference for the
 * handler (the call's cleanup releases it). A refused call aborts the ring
 * link: the other ranks may be in it already, and fail now. */
static stria_status_t stria__call_accept(stria_worker_t *w, stria_rpc_call_t *call,
                                         uint64_t payload_len, stria__wjob_t **out)
{
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    stria__wjob_t *j;
    stria__wcall_t g;
    stria_call_shape_t shape;
    /* the proof binds the call's number, epoch, shape and arena places */
    uint8_t bound[STRIA_CALL_BINDING_BYTES];
    Stria__V1__CallShape none = STRIA__V1__CALL_SHAPE__INIT;
    stria_call_shape_from_pb(req->shape != NULL ? req->shape : &none, &shape);
    stria_call_binding(&shape, req->call, req->link_epoch, req->backward, req->arena, req->arena_in,
                       req->arena_out, bound);
    stria_status_t st = stria__wjob_get(w, req->job_id, req->rank, false, &j);
    if (st != STRIA_OK)
        return st;
    if ((st = stria_rpc_call_check_job_extra(call, &j->secret, req->job_id, bound,
                                             sizeof(bound))) != STRIA_OK) {
        stria__wjob_unref(w, j);
        return st;
    }
    pthread_mutex_lock(&w->lock);
    stria__wsess_t *s = j->sess;
    bool open = s != NULL && s->started && s->link_up;
    bool draining = w->draining;
    uint64_t arena_size = open && s->arena != NULL && !s->arena_closed ? s->arena_size : 0;
    pthread_mutex_unlock(&w->lock);
    if (!open)
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "session %llu rank %u is not open here",
                             (unsigned long long)req->job_id, req->rank);
    else if (draining) /* at a call boundary: the client opens the session elsewhere */
        st = stria_error_set(STRIA_ERR_CLOSED,
                             "worker %llu is draining: session %llu moves off it at this call",
                             (unsigned long long)w->worker_id, (unsigned long long)req->job_id);
    if (st == STRIA_OK && req->shape == NULL)
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "SessionCall: no shape");
    if (st == STRIA_OK)
        st = stria__call_geom(j, &shape, req->backward, &g);
    uint64_t in_bytes = st == STRIA_OK ? stria__call_in_bytes(&g) : 0;
    uint64_t out_bytes = st == STRIA_OK ? stria__call_out_bytes(&g) : 0;
    if (st == STRIA_OK && req->arena && payload_len != 0)
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "session %llu call %llu: inputs in the arena and a payload too",
                             (unsigned long long)j->id, (unsigned long long)req->call);
    else if (st == STRIA_OK && req->arena && arena_size == 0)
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "session %llu call %llu rank %u: no arena is registered with this "
                             "worker (or its connection closed)",
                             (unsigned long long)j->id, (unsigned long long)req->call, req->rank);
    else if (st == STRIA_OK && req->arena &&
             (!stria__inside(req->arena_in, in_bytes, arena_size) ||
              !stria__inside(req->arena_out, out_bytes, arena_size)))
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "session %llu call %llu rank %u: inputs at %llu (%llu bytes) or "
                             "outputs at %llu (%llu bytes) outside the %llu-byte arena",
                             (unsigned long long)j->id, (unsigned long long)req->call, req->rank,
                             (unsigned long long)req->arena_in, (unsigned long long)in_bytes,
                             (unsigned long long)req->arena_out, (unsigned long long)out_bytes,
                             (unsigned long long)arena_size);
    else if (st == STRIA_OK && !req->arena && payload_len != in_bytes)
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "session %llu call %llu rank %u: the payload is %llu bytes; the "
                             "call's %s inputs are %llu",
                             (unsigned long long)j->id, (unsigned long long)req->call, req->rank,
                             (unsigned long long)payload_len,
                             req->backward ? "backward" : "forward", (unsigned long long)in_bytes);
    if (st == STRIA_OK) {
        pthread_mutex_lock(&w->lock);
        if (s->busy)
            st = stria_error_set(STRIA_ERR_BUSY,
                                 "session %llu rank %u: a call is running (calls of a session "
                                 "run one at a time)",
                                 (unsigned long long)j->id, req->rank);
        else
            s->busy = true;
        pthread_mutex_unlock(&w->lock);
    }
    if (st != STRIA_OK) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        pthread_mutex_lock(&w->lock);
        if (open && st != STRIA_ERR_BUSY && j->link != NULL)
            stria_link_abort(j->link, st, msg);
        pthread_mutex_unlock(&w->lock);
        stria__wjob_unref(w, j);
        return stria_error_set(st, "%s", msg);
    }
    stria__accepted_t *acc = calloc(1, sizeof(*acc));
    if (acc == NULL) {
        pthread_mutex_lock(&w->lock);
        s->busy = false;
        pthread_mutex_unlock(&w->lock);
        stria__wjob_unref(w, j);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    }
    acc->j = j;
    stria_rpc_call_set_cleanup(call, stria__call_cleanup, acc);
    stria_metric_add(w->m_in_bytes, (double)in_bytes);
    *out = j;
    return STRIA_OK;
}

/* A call with inputs in its payload: read straight into the session's
 * input buffer. */
stria_status_t stria__w_on_call_payload(void *ctx, stria_rpc_call_t *call, uint64_t payload_len,
                                        void **buf_out)
{
    stria__wjob_t *j;
    stria_status_t st = stria__call_accept(ctx, call, payload_len, &j);
    if (st == STRIA_OK)
        *buf_out = j->sess->in;
    return st;
}

void stria__w_on_call(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    stria__wjob_t *j;
    if (stria_rpc_call_cleanup_arg(call) == NULL) { /* no payload: inputs in the arena, or none */
        stria_status_t st = stria__call_accept(w, call, 0, &j);
        if (st != STRIA_OK) {
            stria_rpc_call_fail(call, st, "%s", stria_error_msg());
            return;
        }
    }
    stria__accepted_t *acc = stria_rpc_call_cleanup_arg(call);
    j = acc->j;
    acc->handed = true; /* from here on the thread, or this refusal, ends busy */
    pthread_mutex_lock(&w->lock);
    if (j->sess->stop || w->stopping) {
        bool stopping = w->stopping;
        j->sess->busy = false;
        pthread_cond_broadcast(&j->sess->cv);
        pthread_mutex_unlock(&w->lock);
        stria_rpc_call_fail_r(call, stopping ? STRIA_ERR_BUSY : STRIA_ERR_CANCELLED, stopping,
                              stopping ? "this worker is shutting down" : "the session is closed");
        return;
    }
    j->sess->call = call;
    j->running = true;
    j->phase = STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_FORWARD;
    j->last_activity = stria_time_now();
    w->running_passes++;
    pthread_cond_broadcast(&j->sess->cv);
    pthread_mutex_unlock(&w->lock);
}

/* ---- the arena of a co-located client -------------------------------------------- */

#ifndef HUGETLBFS_MAGIC
#define HUGETLBFS_MAGIC 0x958458f6
#endif

/* What a worker requires of an arena before it maps it: sealed against
 * shrinking (a mapping would fault past the end: SIGBUS) and growing, not
 * hugetlbfs, the size it was said to be and no larger than the session's
 * bound, and no holes (a page the worker faulted in first would be charged
 * to it). */
static stria_status_t stria__arena_check(int fd, uint64_t size, uint64_t bound)
{
    struct stat sb;
    struct statfs fs;
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "the arena is not sealed against shrinking and growing "
                               "(memfd_create with MFD_ALLOW_SEALING, then F_ADD_SEALS)");
    if (fstatfs(fd, &fs) != 0 || fs.f_type == HUGETLBFS_MAGIC)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "the arena is on hugetlbfs (refused)");
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size <= 0 ||
        (uint64_t)sb.st_size != size)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "the arena's size is %lld bytes, not the %llu it was said to be",
                               (long long)sb.st_size, (unsigned long long)size);
    if (size > bound)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "the arena's %llu bytes exceed the session rank's bound of %llu",
                               (unsigned long long)size, (unsigned long long)bound);
    off_t hole = lseek(fd, 0, SEEK_HOLE);
    if (hole < 0 || (uint64_t)hole < size)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "the arena has a hole at byte %lld of %llu (allocate its pages "
                               "first, with fallocate)",
                               (long long)hole, (unsigned long long)size);
    return STRIA_OK;
}

stria_status_t stria__wsess_arena(stria_worker_t *w, uint64_t job_id, uint32_t rank,
                                  const stria_job_secret_t *secret, int fd, uint64_t size)
{
    stria__wjob_t *j;
    stria_status_t st = stria__wjob_get(w, job_id, rank, false, &j);
    if (st != STRIA_OK)
        return st;
    if (!stria_auth_equal(secret->bytes, j->secret.bytes, sizeof(j->secret))) {
        stria__wjob_unref(w, j);
        return stria_error_set(STRIA_ERR_AUTH, "session %llu: the secret is not the session's",
                               (unsigned long long)job_id);
    }
    pthread_mutex_lock(&w->lock);
    stria__wsess_t *s = j->sess;
    if (s == NULL || !s->started || !s->link_up)
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "job %llu rank %u is no session open on this worker (open it first)",
                             (unsigned long long)job_id, rank);
    else if (s->arena != NULL)
        st = stria_error_set(STRIA_ERR_BUSY, "session %llu rank %u has an arena already",
                             (unsigned long long)job_id, rank);
    uint64_t bound = s != NULL ? s->in_cap + s->out_cap : 0;
    pthread_mutex_unlock(&w->lock);
    void *base = MAP_FAILED;
    if (st == STRIA_OK && (st = stria__arena_check(fd, size, bound)) == STRIA_OK) {
        base = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base == MAP_FAILED)
            st = stria_error_set(STRIA_ERR_IO, "cannot map the arena's %llu bytes: %m",
                                 (unsigned long long)size);
    }
    if (st == STRIA_OK) {
        pthread_mutex_lock(&w->lock);
        if (s->arena == NULL && !s->stop) {
            s->arena = base;
            s->arena_size = (size_t)size;
            s->arena_closed = false;
            base = MAP_FAILED;
        } else {
            st = stria_error_set(STRIA_ERR_BUSY, "session %llu rank %u has an arena already",
                                 (unsigned long long)job_id, rank);
        }
        pthread_mutex_unlock(&w->lock);
    }
    if (base != MAP_FAILED)
        munmap(base, (size_t)size);
    if (st == STRIA_OK)
        stria_log_info("session %llu rank %u: a %llu-byte arena registered",
                       (unsigned long long)job_id, rank, (unsigned long long)size);
    stria__wjob_unref(w, j);
    return st;
}

void stria__wsess_arena_closed(stria_worker_t *w, uint64_t job_id, uint32_t rank)
{
    pthread_mutex_lock(&w->lock);
    stria__wjob_t *j = stria__wjob_find(w, job_id);
    if (j != NULL && (uint32_t)j->rank == rank && j->sess != NULL && j->sess->arena != NULL) {
        j->sess->arena_closed = true; /* unmapped by the thread between calls */
        pthread_cond_broadcast(&j->sess->cv);
    }
    pthread_mutex_unlock(&w->lock);
}
