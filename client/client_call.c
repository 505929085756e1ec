/* libstria: one try of a call on some ranks of a session.
 *
 * Each rank's inputs are placed: in the rank's arena (this process's own
 * memory, registered with a worker of this host) at the call's region, or
 * in the request's payload (a whole-sequence call's rank gathered into the
 * rank's buffer; a sharded rank's own tensors sent as they lie, or for a
 * head group its heads' bytes of them gathered like a whole call's); inputs
 * larger than the worker takes in one request go first in pieces. Every
 * rank's request is sent before any reply is read (the workers meet on
 * their ring), then the replies are read and the outputs gathered (from the
 * arena, or straight into the caller's tensors). The try's verdict: the
 * rank whose failure explains the others, whether another try may succeed,
 * and the workers lost (blamed). With a progress callback the requests and
 * replies go through a helper thread while the caller's thread reports. */
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>

#include "client_int.h"

uint64_t stria__lcall_epoch(uint64_t call, int attempt)
{
    return (call << 8) | (uint64_t)((attempt + 1) & 0xff);
}

/* ---- the geometry of one rank's part -------------------------------------------- */

enum { T_Q, T_K, T_V, T_O, T_LSE, T_DO, T_DQ, T_DK, T_DV, T_N };

/* One rank's part of a try. */
typedef struct {
    stria__lrank_t *r;
    stria__lout_t *o;
    int64_t valid;
    uint64_t bytes[T_N], at[T_N]; /* compact bytes, offsets in a region */
    size_t row[T_N];              /* bytes per token */
    int64_t outer[T_N];           /* outer rows (batch; batch x heads for LSE) */
    /* a head group's rows within the caller's full tensors (client_groups.c):
     * bytes per token there, where the group's start in one, and the group's
     * heads and all heads (LSE's outer rows); a plain session's are its own */
    size_t full_row[T_N], full_off[T_N];
    int64_t heads, full_heads, head0;
    bool arena;   /* the rank's inputs and outputs are in its arena */
    char *region; /* arena: the call's region */
    stria_call_place_t place;
    uint8_t bound[STRIA_CALL_BINDING_BYTES];
    Stria__V1__SessionCallRequest req;
    stria_rpc_request_t rq;
    stria_rpc_pending_t pend;
    struct iovec in_iov[6], out_iov[3];
    uint64_t in_bytes, out_bytes;
    uint64_t moved_in, moved_out; /* the bytes that reach the worker and come back (arena too) */
    double t_sent_done;           /* when its request and inputs were sent */
    bool sent, received;
    /* a sender thread of its own (large uploads): running until sent_done */
    pthread_t sender;
    bool sending, sent_done, aborted;
    stria_status_t send_st;
    char send_error[512];
    struct try *x;
    double pass_s, compute_s, wait_s;
    uint32_t steps;
    uint64_t ring_bytes, minflt;
} part_t;

/* What the whole try shares with its helper thread. */
typedef struct
try {
    stria_session_t *s;
    const stria__lcall_t *c;
    part_t *p;
    int n;
    stria_layout_t lay;
    stria_docplan_t *plan; /* packed with documents: the call's plan, which lay borrows */
    Stria__V1__CallShape shape;
    Stria__V1__JobSpec__Window win;
    /* progress (lock) */
    pthread_mutex_t lock;
    pthread_cond_t cv;
    stria_phase_t phase;
    uint64_t sent_bytes, total_up;
    bool done;
    double t_sent, t_first_reply;
}
try_t;

static void geometry(const stria_session_t *s, const stria__lcall_t *c, const stria_layout_t *lay,
                     size_t in_room, part_t *p)
{
    size_t es = stria_dtype_size(s->spec.dtype);
    size_t q = (size_t)(s->spec.heads * s->spec.head_dim) * es;
    size_t kv = (size_t)(s->spec.kv_heads * s->spec.head_dim) * es;
    const size_t row[T_N] = {q, kv, kv, q, 4, q, q, kv, kv};
    p->valid = stria_layout_shard_valid(lay, p->r->rank);
    stria_layout_t all; /* a part: its trainer rank's stripe of a striping over all parts */
    if (c->parts > 0 && stria_layout_init(STRIA_LAYOUT_STRIPED, s->n_ranks * (int)c->parts,
                                          lay->seq_len, &all) == STRIA_OK)
        p->valid = stria_layout_shard_valid(&all, (int)c->part * s->n_ranks + p->r->rank);
    /* a head group's part of a parent's call: its heads among all of the
     * caller's (a call on the ring's own handle brings its heads only) */
    const int64_t G = c->all_heads && s->group_of > 1 ? s->group_of : 1;
    const int group = G > 1 ? s->group : 0;
    p->heads = s->spec.heads;
    p->full_heads = p->heads * G;
    p->head0 = p->heads * group;
    uint64_t at = 0;
    for (int t = 0; t < T_N; t++) {
        if (t == T_DQ)
            at = in_room;
        p->row[t] = row[t];
        p->full_row[t] = t == T_LSE ? row[t] : row[t] * (size_t)G;
        p->full_off[t] = t == T_LSE ? 0 : row[t] * (size_t)group;
        p->outer[t] = t == T_LSE ? c->shape->batch * s->spec.heads : c->shape->batch;
        p->bytes[t] = (uint64_t)p->outer[t] * (uint64_t)p->valid * row[t];
        p->at[t] = at;
        at += p->bytes[t];
    }
}

/* The tensors of the call's kind: inputs in payload order, then outputs. */
static int inputs_of(const stria__lcall_t *c, int ids[6])
{
    if (!c->backward) {
        ids[0] = T_Q, ids[1] = T_K, ids[2] = T_V;
        return 3;
    }
    if (c->use_held) {
        ids[0] = T_DO;
        return 1;
    }
    for (int i = 0; i < 6; i++)
        ids[i] = T_Q + i;
    return 6;
}

static int outputs_of(const stria__lcall_t *c, int ids[3])
{
    if (!c->backward) {
        ids[0] = T_O, ids[1] = T_LSE;
        return 2;
    }
    ids[0] = T_DQ, ids[1] = T_DK, ids[2] = T_DV;
    return 3;
}

/* The caller's tensor of input t (io->in is in payload order). */
static const void *io_in(const stria__lcall_t *c, int t)
{
    return c->io->in[t == T_DO ? 5 : t];
}

static void *io_out(const stria__lcall_t *c, int t)
{
    return c->io->out[t == T_O ? 0 : t == T_LSE ? 1 : t - T_DQ];
}

/* The caller's outer row of a part's outer row o of tensor t: itself, or
 * for a head group's LSE ([batch][heads] rows) the group's heads' place
 * among all heads. */
static int64_t full_outer(const part_t *p, int t, int64_t o)
{
    if (t != T_LSE || p->full_heads == p->heads)
        return o;
    return o / p->heads * p->full_heads + p->head0 + o % p->heads;
}

/* Whether the caller's tensors are the rank's shard as the worker takes
 * it (a sharded session's own tokens, all its heads), sent and received as
 * they lie; else each part moves its rows (and a head group its heads'
 * bytes of them) between the caller's tensors and a compact shard. */
static bool as_they_lie(const stria_session_t *s, const stria__lcall_t *c)
{
    return s->sharded && !(c->all_heads && s->group_of > 1);
}

/* Moves a rank's real tokens between the caller's [outer][tokens][full_row]
 * tensor (a head group's: its heads' bytes of every row) and its compact
 * [outer][valid][row] shard: the whole sequence's tokens at the layout's
 * positions, or a sharded rank's own tokens, in their order. */
static void move(const stria_session_t *s, const stria_layout_t *lay, const part_t *p, int t,
                 char *compact, void *full, bool to_full)
{
    stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS];
    size_t nr = 1;
    const stria_layout_run_t own = {.first = 0, .stride = 1, .count = p->valid};
    const stria_layout_run_t *runs =
        s->sharded ? &own : stria_layout_runs(lay, p->r->rank, false, &nr, tmp);
    const int64_t tokens = s->sharded ? p->valid : lay->seq_len;
    const size_t row = p->row[t], frow = p->full_row[t];
    for (int64_t o = 0; o < p->outer[t]; o++) {
        char *f = (char *)full + (size_t)(full_outer(p, t, o) * tokens) * frow + p->full_off[t];
        char *cp = compact + (size_t)(o * p->valid) * row;
        for (size_t k = 0; k < nr; k++) {
            if (runs[k].stride == 1 && frow == row) {
                size_t n = (size_t)runs[k].count * row;
                if (to_full)
                    memcpy(f + (size_t)runs[k].first * row, cp, n);
                else
                    memcpy(cp, f + (size_t)runs[k].first * row, n);
                cp += n;
                continue;
            }
            for (int64_t i = 0; i < runs[k].count; i++, cp += row) {
                char *x = f + (size_t)(runs[k].first + i * runs[k].stride) * frow;
                if (to_full)
                    memcpy(x, cp, row);
                else
                    memcpy(cp, x, row);
            }
        }
    }
}

/* ---- placing a rank's inputs ------------------------------------------------------ */

/* Places rank p's inputs and builds its request. */
static stria_status_t prepare(try_t *x, part_t *p, uint64_t epoch)
{
    stria_session_t *s = x->s;
    const stria__lcall_t *c = x->c;
    stria__lrank_t *r = p->r;
    int in[6], out[3];
    int n_in = inputs_of(c, in), n_out = outputs_of(c, out);
    size_t in_room = 0, region = stria__lrank_region(s, &in_room);
    p->arena = r->arena != NULL && r->arena_sock >= 0 && c->parts == 0; /* parts: TCP */
    p->region = p->arena ? r->arena + (size_t)c->region * region : NULL;
    uint64_t out_at = p->at[out[0]];
    p->in_bytes = p->out_bytes = 0;
    for (int i = 0; i < n_in; i++)
        p->in_bytes += p->bytes[in[i]];
    for (int i = 0; i < n_out; i++)
        p->out_bytes += p->bytes[out[i]];
    p->moved_in = p->in_bytes; /* written into the arena, or sent */
    p->moved_out = p->out_bytes;
    p->place = (stria_call_place_t){.call = c->call,
                                    .link_epoch = epoch,
                                    .backward = c->backward,
                                    .arena = p->arena,
                                    .hold = c->hold && !p->arena,
                                    .use_held = c->use_held && !p->arena,
                                    .held_call = c->held_call,
                                    .part = c->part,
                                    .parts = c->parts};
    if (p->arena) { /* a held forward's inputs and outputs stay in its region */
        p->place.arena_in = (uint64_t)c->region * region;
        p->place.arena_out = p->place.arena_in + out_at;
        for (int i = 0; i < n_in; i++) {
            int t = in[i];
            char *dst = p->region + p->at[t];
            if (as_they_lie(s, c)) {
                if (io_in(c, t) != dst) /* else built in place */
                    memcpy(dst, io_in(c, t), p->bytes[t]);
            } else {
                move(s, &x->lay, p, t, dst, (void *)io_in(c, t), false);
            }
        }
        p->in_bytes = 0;            /* nothing travels */
    } else if (as_they_lie(s, c)) { /* its own tensors, sent as they lie */
        for (int i = 0; i < n_in; i++)
            p->in_iov[i] = (struct iovec){(void *)io_in(c, in[i]), p->bytes[in[i]]};
        for (int i = 0; i < n_out; i++)
            p->out_iov[i] = (struct iovec){io_out(c, out[i]), p->bytes[out[i]]};
    } else { /* gathered from the caller's tensors */
        stria_status_t st = stria__lrank_grow(s->client, &r->up, &r->up_cap, p->in_bytes);
        if (st == STRIA_OK)
            st = stria__lrank_grow(s->client, &r->down, &r->down_cap, p->out_bytes);
        if (st != STRIA_OK)
            return st;
        char *up = r->up;
        for (int i = 0; i < n_in; i++) {
            move(s, &x->lay, p, in[i], up, (void *)io_in(c, in[i]), false);
            up += p->bytes[in[i]];
        }
        p->in_iov[0] = (struct iovec){r->up, p->in_bytes};
        p->out_iov[0] = (struct iovec){r->down, p->out_bytes};
    }
    stria__v1__session_call_request__init(&p->req);
    p->req.job_id = s->id;
    p->req.rank = (uint32_t)r->rank;
    p->req.shape = &x->shape;
    p->req.digest = stria_call_shape_digest(c->shape, (int)s->layout, c->call, c->backward);
    memset(&p->rq, 0, sizeof(p->rq));
    p->rq.method = STRIA_RPC_WORKER_SESSION_CALL;
    p->rq.request = &p->req.base;
    p->rq.timeout_s = s->call_timeout_s;
    p->rq.job_secret = &s->secret;
    p->rq.job_id = s->id;
    p->rq.proof_extra = p->bound;
    p->rq.proof_extra_len = STRIA_CALL_BINDING_BYTES;
    return STRIA_OK;
}

/* The iovecs of bytes [off, off + len) of a list (into out, at most cap). */
static size_t slice(const struct iovec *iov, size_t n, uint64_t off, uint64_t len,
                    struct iovec *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < n && len > 0 && k < cap; i++) {
        if (off >= iov[i].iov_len) {
            off -= iov[i].iov_len;
            continue;
        }
        size_t take = iov[i].iov_len - off < len ? iov[i].iov_len - (size_t)off : (size_t)len;
        out[k++] = (struct iovec){(char *)iov[i].iov_base + off, take};
        len -= take;
        off = 0;
    }
    return k;
}

/* Sends rank p's request: its inputs beyond what the worker takes at once
 * first, in pieces (each answered), then the call itself. */
static stria_status_t send_part(try_t *x, part_t *p)
{
    stria__lrank_t *r = p->r;
    uint64_t max = stria_rpc_client_max_payload(r->conn);
    uint64_t piece = p->in_bytes > max ? (max < STRIA__PIECE_MAX ? max : STRIA__PIECE_MAX) : 0;
    size_t n_iov = p->arena                  ? 0
                   : as_they_lie(x->s, x->c) ? (size_t)inputs_of(x->c, (int[6]){0})
                                             : 1;
    struct iovec cut[8];
    uint64_t off = 0;
    stria_status_t st = STRIA_OK;
    if (piece == 0 && p->in_bytes > 0 && max == 0)
        return stria_error_set(STRIA_ERR_PROTOCOL, "worker %s takes no payload", r->rpc_address);
    if (piece > 0 && p->place.parts > 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "part %u of %u of rank %d's inputs is %llu bytes; worker %s takes "
                               "%llu at once and a part never comes in pieces (a smaller batch "
                               "or seq_len per call)",
                               p->place.part, p->place.parts, r->rank,
                               (unsigned long long)p->in_bytes, r->rpc_address,
                               (unsigned long long)max);
    while (piece > 0 && p->in_bytes - off > piece) { /* pieces with more to come */
        stria_rpc_reply_t reply;
        p->place.more = true;
        p->place.piece_offset = off;
        stria_call_place_to_pb(&p->place, &p->req);
        stria_call_binding(x->c->shape, (int)x->s->layout, &p->place, p->bound);
        p->rq.payload_iov = cut;
        p->rq.payload_iovcnt = slice(p->in_iov, n_iov, off, piece, cut, 8);
        p->rq.payload_len = piece;
        p->rq.reply_iov = NULL;
        p->rq.reply_iovcnt = 0;
        if ((st = stria_rpc_client_call(r->conn, &p->rq, &reply)) != STRIA_OK)
            return st;
        stria_rpc_reply_free(&reply);
        off += piece;
        pthread_mutex_lock(&x->lock);
        x->sent_bytes += piece;
        pthread_mutex_unlock(&x->lock);
    }
    p->place.more = false;
    p->place.piece_offset = off;
    stria_call_place_to_pb(&p->place, &p->req);
    stria_call_binding(x->c->shape, (int)x->s->layout, &p->place, p->bound);
    p->rq.payload_iov = n_iov > 0 ? cut : NULL;
    p->rq.payload_iovcnt = n_iov > 0 ? slice(p->in_iov, n_iov, off, p->in_bytes - off, cut, 8) : 0;
    p->rq.payload_len = p->in_bytes - off;
    if (!p->arena) {
        p->rq.reply_iov = p->out_iov;
        p->rq.reply_iovcnt = as_they_lie(x->s, x->c) ? (size_t)outputs_of(x->c, (int[3]){0}) : 1;
    }
    if ((st = stria_rpc_client_send(r->conn, &p->rq, &p->pend)) == STRIA_OK) {
        p->sent = true;
        pthread_mutex_lock(&x->lock);
        x->sent_bytes += p->in_bytes - off;
        pthread_mutex_unlock(&x->lock);
    }
    return st;
}

/* Reads rank p's reply and gathers its outputs. */
static stria_status_t recv_part(try_t *x, part_t *p)
{
    stria_rpc_reply_t reply;
    const stria__lcall_t *c = x->c;
    stria_status_t st = stria_rpc_client_recv(p->r->conn, &p->rq, &p->pend, &reply);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__SessionCallReply *rep = (const Stria__V1__SessionCallReply *)reply.msg;
    uint64_t want = p->arena ? 0 : p->out_bytes;
    if (reply.payload_len != want) {
        stria_rpc_reply_free(&reply);
        return stria_error_set(
            STRIA_ERR_PROTOCOL, "rank %d: the reply carries %llu bytes of outputs, not %llu",
            p->r->rank, (unsigned long long)reply.payload_len, (unsigned long long)want);
    }
    if (rep->stats != NULL) {
        p->pass_s = rep->stats->seconds;
        p->compute_s = rep->stats->compute_seconds;
        p->wait_s = rep->stats->wait_seconds;
        p->steps = rep->stats->steps;
        p->ring_bytes = rep->stats->bytes_sent;
    }
    p->minflt = rep->worker_minflt;
    stria_rpc_reply_free(&reply);
    int out[3], n_out = outputs_of(c, out);
    if (p->arena) {
        for (int i = 0; i < n_out; i++) {
            int t = out[i];
            char *src = p->region + p->at[t];
            if (as_they_lie(x->s, x->c)) {
                if (io_out(c, t) != src) /* else read in place */
                    memcpy(io_out(c, t), src, p->bytes[t]);
            } else {
                move(x->s, &x->lay, p, t, src, io_out(c, t), true);
            }
        }
    } else if (!as_they_lie(x->s, x->c)) {
        char *down = p->r->down;
        for (int i = 0; i < n_out; i++) {
            move(x->s, &x->lay, p, out[i], down, io_out(c, out[i]), true);
            down += p->bytes[out[i]];
        }
    }
    return STRIA_OK;
}

/* Gives up on rank p, silent STRIA__ABANDON_S after another rank failed
 * the call: its connection goes (its reply would come later, out of step),
 * and its outcome explains nothing. */
static void abandon(part_t *p)
{
    stria_rpc_client_close(p->r->conn);
    p->r->conn = NULL; /* the next call connects anew; the rank stays open there */
    p->received = true;
    *p->o = (stria__lout_t){.st = STRIA_ERR_CANCELLED, .retryable = true, .abandoned = true};
    snprintf(p->o->error, sizeof(p->o->error),
             "given up on: no answer %.0f s after another rank failed the call", STRIA__ABANDON_S);
}

/* The next rank whose reply is there to read (waiting for the first of
 * them), or NULL once every rank's is read or given up on. Without a
 * failure yet it waits up to the call's deadline (the rank whose deadline
 * comes first is then read, to fail with it). */
static part_t *pick_reply(try_t *x, double *t_failed_io)
{
    double next_watch = stria_time_now() + STRIA__WATCH_S;
    for (;;) {
        double t_failed = *t_failed_io;
        struct pollfd fds[x->n];
        part_t *who[x->n];
        int n = 0;
        double deadline = 0;
        part_t *first_due = NULL;
        bool sending = false;
        for (int i = 0; i < x->n; i++) {
            part_t *p = &x->p[i];
            if (p->sending && !__atomic_load_n(&p->sent_done, __ATOMIC_ACQUIRE)) {
                sending = true;
                continue;
            }
            if (!p->sent || p->received)
                continue;
            int fd = stria_rpc_client_fd(p->r->conn);
            if (fd < 0) /* closed: its receive says so */
                return p;
            fds[n] = (struct pollfd){.fd = fd, .events = POLLIN};
            who[n++] = p;
            if (first_due == NULL)
                first_due = p;
            if (p->pend.deadline > 0 && (deadline <= 0 || p->pend.deadline < deadline)) {
                first_due = p;
                deadline = p->pend.deadline;
            }
        }
        if (n == 0 && !sending)
            return NULL;
        double now = stria_time_now(), until = deadline;
        if (t_failed > 0 && (until <= 0 || t_failed + STRIA__ABANDON_S < until))
            until = t_failed + STRIA__ABANDON_S;
        if (until > 0 && now >= until) {
            if (t_failed > 0 && now >= t_failed + STRIA__ABANDON_S) {
                for (int i = 0; i < n; i++)
                    abandon(who[i]);
                for (int i = 0; i < x->n; i++) /* an upload stuck on a silent worker */
                    if (x->p[i].sending && !__atomic_load_n(&x->p[i].sent_done, __ATOMIC_ACQUIRE)) {
                        x->p[i].aborted = true;
                        stria_rpc_client_abort(x->p[i].r->conn);
                    }
                return NULL;
            }
            if (first_due != NULL)
                return first_due; /* past its deadline: its receive fails with it */
        }
        if (t_failed == 0 && now >= next_watch) { /* over at the coordinator: no reply comes */
            stria__linfo_t info;
            stria_status_t st =
                stria__lcoord_info(x->s->client, x->s->id, &x->s->secret, false, &info, NULL);
            if (st == STRIA_ERR_NOT_FOUND ||
                (st == STRIA_OK && info.state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED)) {
                *t_failed_io = now - STRIA__ABANDON_S;
                continue;
            }
            next_watch = now + 1.0;
        }
        int ms = until > 0 ? (int)ceil((until - now) * 1000.0) : 1000;
        if (sending && ms > 20) /* a sender finishing adds its reply to wait for */
            ms = 20;
        int rc = poll(fds, (nfds_t)n, ms > 1000 ? 1000 : ms);
        for (int i = 0; rc > 0 && i < n; i++)
            if (fds[i].revents != 0)
                return who[i];
    }
}

/* Every rank's request, then every reply as it comes (the helper thread's
 * work, or the caller's without progress). */
static void *sender_main(void *arg)
{
    part_t *p = arg;
    p->send_st = send_part(p->x, p);
    p->t_sent_done = stria_time_now();
    if (p->send_st != STRIA_OK)
        snprintf(p->send_error, sizeof(p->send_error), "%s", stria_error_msg());
    __atomic_store_n(&p->sent_done, true, __ATOMIC_RELEASE);
    return NULL;
}

static void exchange(try_t *x)
{
    /* Uploads of a megabyte or more a rank go on a thread per rank, so that
     * a rank whose worker stopped answering holds up neither the others'
     * uploads nor the replies (or the coordinator's word) that tell of the
     * failure; smaller ones fit the sockets' buffers and go in turn. */
    bool threads = x->total_up >= ((uint64_t)1 << 20) * (uint64_t)x->n;
    for (int i = 0; i < x->n; i++) {
        part_t *p = &x->p[i];
        if (p->o->st != STRIA_OK)
            continue;
        p->x = x;
        if (threads && pthread_create(&p->sender, NULL, sender_main, p) == 0) {
            p->sending = true;
            continue;
        }
        stria_status_t st = send_part(x, p);
        p->t_sent_done = stria_time_now();
        if (st != STRIA_OK)
            stria__lrank_fail(p->r, st, p->o);
    }
    pthread_mutex_lock(&x->lock);
    x->t_sent = stria_time_now();
    x->phase = x->c->backward ? STRIA_PHASE_BACKWARD : STRIA_PHASE_FORWARD;
    pthread_cond_broadcast(&x->cv);
    pthread_mutex_unlock(&x->lock);
    double t_failed = 0;
    for (;;) {
        part_t *next = pick_reply(x, &t_failed);
        if (next == NULL)
            break;
        pthread_mutex_lock(&x->lock); /* its reply is there: the download starts */
        if (x->t_first_reply == 0)
            x->t_first_reply = stria_time_now();
        x->phase = STRIA_PHASE_DOWNLOAD;
        pthread_mutex_unlock(&x->lock);
        stria_status_t st = recv_part(x, next);
        next->received = true;
        if (st != STRIA_OK) {
            stria__lrank_fail(next->r, st, next->o);
            if (t_failed == 0)
                t_failed = stria_time_now();
        }
    }
    for (int i = 0; i < x->n; i++) { /* the senders are done (or aborted) */
        part_t *p = &x->p[i];
        if (!p->sending)
            continue;
        pthread_join(p->sender, NULL);
        p->sending = false;
        if (p->aborted) /* given up on mid-upload: its connection goes */
            abandon(p);
        else if (p->send_st != STRIA_OK && !p->received) {
            stria_error_set(p->send_st, "%s", p->send_error);
            stria__lrank_fail(p->r, p->send_st, p->o);
        }
    }
    pthread_mutex_lock(&x->lock);
    x->done = true;
    pthread_cond_broadcast(&x->cv);
    pthread_mutex_unlock(&x->lock);
}

static void *exchange_main(void *arg)
{
    exchange(arg);
    return NULL;
}

/* With a progress callback: the exchange on a helper thread, the caller
 * reporting bytes sent, the slowest rank's ring step (from the
 * coordinator) and the download. */
static void exchange_reporting(try_t *x)
{
    pthread_t th;
    const stria__lcall_t *c = x->c;
    if (pthread_create(&th, NULL, exchange_main, x) != 0) {
        exchange(x);
        return;
    }
    pthread_mutex_lock(&x->lock);
    while (!x->done) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)(STRIA__POLL_S * 1e9);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&x->cv, &x->lock, &ts);
        if (x->done)
            break;
        stria_phase_t phase = x->phase;
        double sent = (double)x->sent_bytes, total = (double)x->total_up;
        pthread_mutex_unlock(&x->lock);
        if (phase == STRIA_PHASE_UPLOAD) {
            c->progress(c->progress_arg, phase, sent, total);
        } else if (phase != STRIA_PHASE_DOWNLOAD) {
            stria__linfo_t info;
            if (stria__lcoord_info(x->s->client, x->s->id, &x->s->secret, false, &info, NULL) ==
                    STRIA_OK &&
                info.steps_total > 0)
                c->progress(c->progress_arg, phase, info.step, info.steps_total);
        }
        pthread_mutex_lock(&x->lock);
    }
    pthread_mutex_unlock(&x->lock);
    pthread_join(th, NULL);
}

/* ---- the verdict ------------------------------------------------------------------ */

/* The try's verdict over its ranks: the first failure that is not an echo
 * of another rank's (a peer's abort) names the cause; the try is retryable
 * when a worker was lost or that cause is. */
static stria_status_t verdict(stria_session_t *s, try_t *x, const char *what, stria__lresult_t *res)
{
    int pick = -1;
    for (int i = 0; i < x->n; i++) {
        const stria__lout_t *o = x->p[i].o;
        if (o->st == STRIA_OK)
            continue;
        res->expired = res->expired || o->st == STRIA_ERR_NOT_FOUND;
        if (pick < 0 || stria__lrank_explains(o) > stria__lrank_explains(x->p[pick].o))
            pick = i;
    }
    if (pick < 0)
        return STRIA_OK;
    bool retryable = false;
    for (int i = 0; i < x->n; i++) {
        const stria__lout_t *o = x->p[i].o;
        if (o->st == STRIA_OK || !o->lost)
            continue;
        retryable = true;
        bool known = false; /* not on the next open */
        for (size_t k = 0; k < s->n_blamed && !known; k++)
            known = s->blamed[k] == x->p[i].r->worker_id;
        if (!known && s->n_blamed < STRIA__MAX_BLAMED)
            s->blamed[s->n_blamed++] = x->p[i].r->worker_id;
    }
    const stria__lout_t *o = x->p[pick].o;
    retryable = retryable || (o->retryable && o->st != STRIA_ERR_INVALID_ARG);
    res->retryable = retryable;
    stria_error_set(o->st, "%s %llu %s, rank %d (worker %s): %s", s->job ? "job" : "session",
                    (unsigned long long)s->id, what, x->p[pick].r->rank, x->p[pick].r->rpc_address,
                    o->error);
    stria_error_set_retryable(retryable);
    return o->st;
}

/* ---- the try ---------------------------------------------------------------------- */

stria_status_t stria__lcall_try(stria_session_t *s, const stria__lcall_t *c, const int *ranks,
                                int n, stria__lresult_t *res)
{
    try_t x;
    size_t in_room = 0;
    memset(&x, 0, sizeof(x));
    x.s = s;
    x.c = c;
    x.n = n;
    x.phase = STRIA_PHASE_UPLOAD;
    stria_status_t st = stria_docplan_layout(s->layout, c->shape, s->n_ranks, &x.lay, &x.plan);
    if (st != STRIA_OK)
        return st;
    stria__lrank_region(s, &in_room);
    x.p = calloc((size_t)(n > 0 ? n : 1), sizeof(*x.p));
    if (x.p == NULL) {
        stria_docplan_unref(x.plan);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    }
    pthread_mutex_init(&x.lock, NULL);
    pthread_cond_init(&x.cv, NULL);
    stria_call_shape_to_pb(c->shape, &x.shape, &x.win);
    uint64_t epoch = s->epoch;
    double t0 = stria_time_now();
    for (int i = 0; i < n; i++) {
        part_t *p = &x.p[i];
        p->r = &s->ranks[ranks[i]];
        p->o = &res->out[i];
        memset(p->o, 0, sizeof(*p->o));
        if (!p->r->opened) /* this handle's first call of the rank */
            stria__lrank_open(s, &ranks[i], 1, s->sharded, p->o);
        if (p->o->st != STRIA_OK)
            continue;
        geometry(s, c, &x.lay, in_room, p);
        if ((st = prepare(&x, p, epoch)) != STRIA_OK)
            stria__lrank_fail(p->r, st, p->o);
        x.total_up += p->in_bytes;
    }
    if (c->progress != NULL)
        exchange_reporting(&x);
    else
        exchange(&x);
    double t_end = stria_time_now(), t_sent = 0;
    for (int i = 0; i < n; i++) /* the upload ends with the last rank's */
        t_sent = fmax(t_sent, x.p[i].t_sent_done);
    res->upload_s = (t_sent > 0 ? t_sent : t_end) - t0;
    res->download_s = x.t_first_reply > 0 ? t_end - x.t_first_reply : 0;
    res->compute_min_s = INFINITY;
    for (int i = 0; i < n; i++) {
        const part_t *p = &x.p[i];
        if (!p->sent || p->o->st != STRIA_OK)
            continue;
        res->pass_max_s = fmax(res->pass_max_s, p->pass_s);
        res->compute_max_s = fmax(res->compute_max_s, p->compute_s);
        res->compute_min_s = fmin(res->compute_min_s, p->compute_s);
        res->wait_max_s = fmax(res->wait_max_s, p->wait_s);
        res->steps = p->steps > res->steps ? p->steps : res->steps;
        res->ring_bytes += p->ring_bytes;
        res->up_bytes += p->moved_in;
        res->down_bytes += p->moved_out;
        res->tcp_up_bytes += p->in_bytes; /* an arena's travel no byte */
        res->tcp_down_bytes += p->arena ? 0 : p->out_bytes;
        res->minflt += p->minflt;
    }
    if (!isfinite(res->compute_min_s))
        res->compute_min_s = 0;
    /* a job's call is its pass (one each way) */
    st = verdict(s, &x,
                 c->backward ? (s->job ? "backward pass" : "backward call")
                             : (s->job ? "forward pass" : "forward call"),
                 res);
    pthread_cond_destroy(&x.cv);
    pthread_mutex_destroy(&x.lock);
    free(x.p);
    stria_docplan_unref(x.plan);
    return st;
}
