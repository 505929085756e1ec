/* The worker's sessions: the table (every job and session this worker
 * holds a rank of), a session's creation from the coordinator's assignment
 * (its memory admitted), references and drop, its pass thread (the ring
 * link bound once at open, then the calls handed to it, one at a time, each
 * answered from the thread; a job's calls reported to the coordinator), its
 * held forwards, and a co-located client's arena. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "worker_int.h"

/* ---- the table ------------------------------------------------------------------ */

stria__wsess_t *stria__wsess_find(stria_worker_t *w, uint64_t id)
{
    for (stria__wsess_t *s = w->sessions; s != NULL; s = s->next)
        if (s->id == id)
            return s;
    return NULL;
}

static void sess_discard(stria__wsess_t *s);

/* Frees a session nothing refers to any more (w->lock held). Its pass
 * thread, if it ran, has freed the engine. */
static void sess_free(stria__wsess_t *s)
{
    stria_worker_t *w = s->w;
    stria__wpool_free(w, s->slots);
    stria__wpool_unmap(w, &s->sh.arena_map);
    stria_ranges_free(&s->sh.asm_got);
    stria__wtimeline_free(&s->sh.tl);
    stria__wpool_retire(w, s->bytes);
    sess_discard(s);
    stria__wpool_publish(w);
}

void stria__wsess_unref(stria__wsess_t *s)
{
    stria_worker_t *w = s->w;
    pthread_mutex_lock(&w->lock);
    if (--s->refs == 0 && s->dropped)
        sess_free(s);
    pthread_mutex_unlock(&w->lock);
}

void stria__wsess_drop_locked(stria__wsess_t *s, stria_status_t why, const char *reason)
{
    stria_worker_t *w = s->w;
    stria__wsess_t **pp = &w->sessions;
    while (*pp != NULL && *pp != s)
        pp = &(*pp)->next;
    if (*pp == s)
        *pp = s->next;
    s->next = NULL;
    s->dropped = true;
    __atomic_store_n(&s->sh.connect_cancel, true, __ATOMIC_RELEASE);
    pthread_mutex_lock(&s->lock);
    s->sh.stop = true;
    pthread_cond_broadcast(&s->sh.cv);
    if (s->sh.link != NULL && s->sh.running) {
        stria_log_info("session %llu: aborting its running call: %s", (unsigned long long)s->id,
                       reason);
        stria_link_abort(s->sh.link, why, reason);
    }
    pthread_mutex_unlock(&s->lock);
    if (s->refs == 0)
        sess_free(s);
}

void stria__wsess_fail(stria__wsess_t *s, const char *message)
{
    stria_worker_t *w = s->w;
    pthread_mutex_lock(&s->lock);
    if (s->sh.link != NULL) /* the other ranks, waiting for this one, fail now */
        stria_link_abort(s->sh.link, STRIA_ERR_CANCELLED, message);
    pthread_mutex_unlock(&s->lock);
    if (!s->report_calls)
        return;
    stria__wcoord_fail_later(w, s->id, s->rank, false, message);
    pthread_mutex_lock(&w->lock);
    if (!s->dropped)
        stria__wsess_drop_locked(s, STRIA_ERR_CANCELLED, message);
    pthread_mutex_unlock(&w->lock);
}

/* ---- creation from the assignment ---------------------------------------------- */

/* Opens the session's secret and ring key, sealed for the worker's
 * connection to the coordinator. */
static stria_status_t open_keys(stria__wsess_t *s, const stria_auth_session_t *session,
                                const Stria__V1__GetJobReply *gr)
{
    if (stria_auth_open(session, "job secret", s->id, gr->job_secret.data, gr->job_secret.len,
                        s->secret.bytes) != STRIA_OK ||
        stria_auth_open(session, "ring key", s->id, gr->ring_key.data, gr->ring_key.len,
                        s->ring_key) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_AUTH,
                                "job %llu: the coordinator's assignment has no usable keys (does "
                                "this worker prove the worker credential?)",
                                (unsigned long long)s->id);
    return STRIA_OK;
}

/* Copies the rank's spec from its assignment, checked as libstria and the
 * coordinator checked it. */
static stria_status_t read_spec(stria__wsess_t *s, uint32_t rank, const Stria__V1__Assignment *a)
{
    stria_worker_t *w = s->w;
    const Stria__V1__JobSpec *sp = a->spec;
    s->rank = (int)rank;
    s->n_ranks = (int)a->n_ranks;
    s->max_batch = sp->batch;
    s->max_seq_len = (int64_t)sp->seq_len;
    s->heads = sp->heads;
    s->kv_heads = sp->kv_heads;
    s->head_dim = sp->head_dim;
    s->dtype = (stria_dtype_t)sp->dtype;
    s->layout_kind = (stria_layout_kind_t)sp->layout;
    s->sharded = sp->sharded;
    s->report_calls = !sp->session;
    s->max_held = sp->max_held;
    s->arrival_timeout_s = sp->arrival_timeout_s > 0 ? sp->arrival_timeout_s : 60.0;
    s->step_timeout_s = sp->step_timeout_ms > 0 ? sp->step_timeout_ms / 1000.0 : w->step_timeout_s;
    if (s->step_timeout_s > STRIA__MAX_STEP_TIMEOUT_S) /* whatever the coordinator allowed */
        s->step_timeout_s = STRIA__MAX_STEP_TIMEOUT_S;
    if (s->max_held > STRIA__MAX_HELD)
        return stria_error_set(STRIA_ERR_PROTOCOL, "job %llu: %u held forwards, more than %d",
                               (unsigned long long)s->id, s->max_held, STRIA__MAX_HELD);
    /* a job's own call, checked here as libstria and the coordinator did */
    stria_call_shape_t c;
    stria_call_shape_from_spec(sp, &c);
    const stria_call_bounds_t bounds = {.max_batch = s->max_batch,
                                        .max_seq_len = s->max_seq_len,
                                        .n_ranks = s->n_ranks,
                                        .layout = sp->layout};
    if (stria_call_shape_check(&c, &bounds) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_INVALID_ARG, "job %llu's assignment",
                                (unsigned long long)s->id);
    const char *next = a->ranks[(rank + 1) % a->n_ranks]->ucx_address;
    if (stria_dtype_size(s->dtype) == 0 || next == NULL || strlen(next) >= sizeof(s->next_ucx))
        return stria_error_set(STRIA_ERR_PROTOCOL, "job %llu: malformed assignment",
                               (unsigned long long)s->id);
    snprintf(s->next_ucx, sizeof(s->next_ucx), "%s", next);
    stria_status_t st = stria_layout_init(s->layout_kind, s->n_ranks, s->max_seq_len, &s->layout);
    if (st != STRIA_OK)
        return st;
    int64_t valid = stria_layout_shard_valid(&s->layout, s->rank);
    if ((int64_t)a->ranks[rank]->tokens != valid)
        return stria_error_set(STRIA_ERR_PROTOCOL,
                               "job %llu rank %u: the assignment says %llu tokens, the layout %lld",
                               (unsigned long long)s->id, rank,
                               (unsigned long long)a->ranks[rank]->tokens, (long long)valid);
    s->spec_len = stria__v1__job_spec__get_packed_size(sp);
    if ((s->spec_pb = malloc(s->spec_len + 1)) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
    stria__v1__job_spec__pack(sp, s->spec_pb);
    s->region = stria__wcall_region_bytes(s, &s->in_room);
    if (s->region == 0)
        return stria_error_set(STRIA_ERR_PROTOCOL, "job %llu: its bounds are too large",
                               (unsigned long long)s->id);
    s->sh.phase = STRIA__V1__JOB_STATE__JOB_STATE_LOADING;
    s->sh.steps_total = (uint32_t)s->n_ranks;
    s->sh.last_activity = stria_time_now();
    return STRIA_OK;
}

static stria__wsess_t *sess_new(stria_worker_t *w, uint64_t id)
{
    stria__wsess_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->w = w;
    s->id = id;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->sh.cv, NULL);
    s->sh.asm_slot = -1;
    return s;
}

/* Frees a session that never entered the table (nothing admitted). */
static void sess_discard(stria__wsess_t *s)
{
    free(s->spec_pb);
    pthread_cond_destroy(&s->sh.cv);
    pthread_mutex_destroy(&s->lock);
    stria_auth_wipe(&s->secret, sizeof(s->secret));
    stria_auth_wipe(s->ring_key, sizeof(s->ring_key));
    free(s);
}

/* Fetches a session's assignment from the coordinator and creates it with
 * its memory admitted (bounded memory: a session that does not fit is
 * refused here, never mid-call). It comes with a reference for the caller,
 * taken under the lock where it became visible (or was found, made by
 * another request meanwhile). w->lock not held. */
static stria_status_t create(stria_worker_t *w, uint64_t id, uint32_t rank, stria__wsess_t **out)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    stria__wsess_t *s = NULL;
    req.job_id = id;
    stria_status_t st = stria__wcoord_call(w, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, &reply);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "job %llu", (unsigned long long)id);
    const Stria__V1__GetJobReply *gr = (const Stria__V1__GetJobReply *)reply.msg;
    const Stria__V1__JobInfo *info = gr->job;
    const Stria__V1__Assignment *a = info ? info->assignment : NULL;
    uint64_t need = 0;
    if (a == NULL || a->spec == NULL || rank >= a->n_ranks || a->ranks[rank] == NULL) {
        st = stria_error_set(STRIA_ERR_NOT_FOUND, "job %llu has no rank %u", (unsigned long long)id,
                             rank);
    } else if (info->state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
        st = stria_error_set(STRIA_ERR_CANCELLED, "job %llu is over (%s)", (unsigned long long)id,
                             info->failure && info->failure[0] ? info->failure : "released");
        /* failed for a cause outside it (a worker restarted or left as it
         * opened): the client opens it anew */
        stria_error_set_retryable(info->failure_retryable);
    } else if (a->ranks[rank]->worker_id != w->worker_id) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "job %llu rank %u belongs to worker %llu, not to this worker (%llu)",
                             (unsigned long long)id, rank,
                             (unsigned long long)a->ranks[rank]->worker_id,
                             (unsigned long long)w->worker_id);
    } else if ((s = sess_new(w, id)) == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
    } else if ((st = open_keys(s, &reply.session, gr)) == STRIA_OK &&
               (st = read_spec(s, rank, a)) == STRIA_OK &&
               (st = stria__wcall_memory(s, &need)) == STRIA_OK) {
        s->replaces = info->replaces;
        s->generation = info->generation;
        if (a->memory_per_rank_bytes > need)
            need = a->memory_per_rank_bytes;
    }
    stria_rpc_reply_free(&reply);
    if (st != STRIA_OK) {
        if (s != NULL)
            sess_discard(s);
        return st;
    }
    pthread_mutex_lock(&w->lock);
    stria__wsess_t *other = stria__wsess_find(w, id);
    if (other != NULL) { /* created meanwhile by another request */
        other->refs++;   /* taken under the lock: a drop cannot free it now */
        pthread_mutex_unlock(&w->lock);
        sess_discard(s);
        *out = other;
        return STRIA_OK;
    }
    /* admitted under the lock: two requests of one session never both are */
    if (w->stopping)
        st = stria_error_set(STRIA_ERR_BUSY, "this worker is shutting down");
    else
        st = stria__wpool_admit(w, id, need);
    if (st != STRIA_OK) {
        pthread_mutex_unlock(&w->lock);
        sess_discard(s);
        return st;
    }
    s->bytes = need;
    s->refs = 1; /* the caller's, taken before a drop can see the session */
    s->next = w->sessions;
    w->sessions = s;
    pthread_mutex_unlock(&w->lock);
    stria__wpool_publish(w);
    stria_log_info("%s %llu rank %d/%d: %lld of %lld tokens at its bounds (%s), %llu MiB reserved",
                   s->report_calls ? "job" : "session", (unsigned long long)s->id, s->rank,
                   s->n_ranks, (long long)stria_layout_shard_valid(&s->layout, s->rank),
                   (long long)s->max_seq_len, stria_layout_kind_name(s->layout_kind),
                   (unsigned long long)(need >> 20));
    *out = s;
    return STRIA_OK;
}

stria_status_t stria__wsess_get(stria_worker_t *w, uint64_t id, uint32_t rank, bool create_it,
                                stria__wsess_t **out)
{
    stria__wsess_t *s;
    pthread_mutex_lock(&w->lock);
    s = stria__wsess_find(w, id);
    if (s != NULL)
        s->refs++;
    bool stopping = w->stopping;
    pthread_mutex_unlock(&w->lock);
    if (stopping && s == NULL)
        return stria_error_set(STRIA_ERR_BUSY, "this worker is shutting down");
    if (s == NULL) {
        if (!create_it)
            return stria_error_set(STRIA_ERR_NOT_FOUND,
                                   "job %llu is not held by this worker (never opened, closed, "
                                   "released or expired)",
                                   (unsigned long long)id);
        stria_status_t st = create(w, id, rank, &s);
        if (st != STRIA_OK)
            return st; /* else it comes with our reference */
    }
    if ((uint32_t)s->rank != rank) {
        int held = s->rank;
        stria__wsess_unref(s);
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job %llu: this worker holds rank %d, not %u",
                               (unsigned long long)id, held, rank);
    }
    *out = s;
    return STRIA_OK;
}

/* ---- the pass thread ------------------------------------------------------------ */

static uint64_t minflt(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? (uint64_t)ru.ru_minflt : 0;
}

static void open_reply(stria__wsess_t *s, stria_rpc_call_t *call, double bind_s)
{
    Stria__V1__OpenSessionReply rep = STRIA__V1__OPEN_SESSION_REPLY__INIT;
    rep.buffer_bytes = s->region * (1u + s->max_held);
    rep.connect_seconds = bind_s;
    rep.arena_bound_bytes = s->region * (1u + s->max_held);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* Answers the opens waiting for the link (st: how it went). */
static void answer_opens(stria__wsess_t *s, stria_status_t st, double bind_s)
{
    stria_rpc_call_t *opens[STRIA__MAX_OPENS];
    pthread_mutex_lock(&s->lock);
    int n = s->sh.n_opens;
    memcpy(opens, s->sh.opens, sizeof(opens));
    s->sh.n_opens = 0;
    if (st == STRIA_OK)
        s->sh.link_up = true;
    else if (!s->sh.link_up)
        snprintf(s->sh.link_error, sizeof(s->sh.link_error), "%s", stria_error_msg());
    pthread_mutex_unlock(&s->lock);
    for (int i = 0; i < n; i++) {
        if (st != STRIA_OK) {
            stria_rpc_call_fail_r(opens[i], st, stria_status_retryable(st), "%s", s->sh.link_error);
            continue;
        }
        open_reply(s, opens[i], bind_s);
    }
}

/* A call's outputs are written from its region: the session takes its next
 * call once they are (the region is the next call's). The client sends
 * that call only once it read this reply, which the loop has finished
 * writing by then; and a client that does not read keeps one call's outputs
 * here, not a copy per request. */
static void reply_written(void *arg)
{
    stria__wsess_t *s = arg;
    pthread_mutex_lock(&s->lock);
    s->sh.busy = false;
    pthread_cond_broadcast(&s->sh.cv); /* an arena to unmap may wait for it */
    pthread_mutex_unlock(&s->lock);
}

/* What a call did, into the session's records (s->lock held). */
static void account(stria__wsess_t *s, const stria__waccept_t *acc,
                    const Stria__V1__SessionCallRequest *req, stria_status_t st, stria__wrun_t *run)
{
    stria__wshared_t *sh = &s->sh;
    sh->running = false;
    sh->last_activity = stria_time_now();
    if (st != STRIA_OK) {
        sh->failed++;
        sh->phase = STRIA__V1__JOB_STATE__JOB_STATE_FAILED;
        return;
    }
    sh->phase = req->backward ? STRIA__V1__JOB_STATE__JOB_STATE_DONE
                              : STRIA__V1__JOB_STATE__JOB_STATE_FORWARD_DONE;
    sh->step = sh->steps_total;
    sh->calls++;
    sh->bytes += acc->g.in_bytes + acc->g.out_bytes;
    sh->lat[sh->n_lat++ % STRIA__LAT_KEPT] = (float)run->stats.seconds;
    if (acc->slot >= 0 && req->hold) { /* kept for its backward */
        sh->held_mask |= UINT64_C(1) << acc->slot;
        sh->held_call[acc->slot] = req->call;
        sh->held_digest[acc->slot] =
            stria_call_shape_digest(&acc->g.shape, (int)s->layout_kind, 0, false);
    }
    if (acc->slot >= 0 && req->use_held) /* its backward ran: let go */
        sh->held_mask &= ~(UINT64_C(1) << acc->slot);
    if (run->have_tl && req->call % STRIA__TL_EVERY == 0) {
        stria__wtimeline_free(&sh->tl);
        sh->tl = run->tl;
        sh->tl_new = true;
        run->have_tl = false;
    }
}

/* A call in parts: their calls (in part order) taken from the session,
 * each part's rows put in their place in the shard (rows part, part +
 * parts, ... of each input tensor). */
static void parts_in(stria__wsess_t *s, const stria__waccept_t *acc, stria_rpc_call_t **parts)
{
    int t0, t1;
    pthread_mutex_lock(&s->lock);
    for (uint32_t i = 0; i < acc->parts; i++) {
        parts[i] = s->sh.part_calls[i];
        s->sh.part_calls[i] = NULL;
    }
    s->sh.asm_parts = 0;
    s->sh.parts_accepted = s->sh.parts_in = 0;
    pthread_mutex_unlock(&s->lock);
    stria__wcall_inputs(&acc->g, &t0, &t1);
    for (uint32_t i = 0; i < acc->parts; i++) {
        stria__waccept_t *a = stria_rpc_call_cleanup_arg(parts[i]);
        stria__wcall_part_move(&acc->g, a->part, a->parts, a->rows, t0, t1, acc->region, a->stage,
                               true);
    }
}

/* Each part's rows of the outputs, into its own buffer for its reply (the
 * region is then free for the next call). */
static void parts_out(const stria__waccept_t *acc, stria_rpc_call_t **parts)
{
    int t0, t1;
    stria__wcall_outputs(&acc->g, &t0, &t1);
    for (uint32_t i = 0; i < acc->parts; i++) {
        stria__waccept_t *a = stria_rpc_call_cleanup_arg(parts[i]);
        stria__wcall_part_move(&acc->g, a->part, a->parts, a->rows, t0, t1, acc->region, a->stage,
                               false);
    }
}

/* Answers every part of a call: its rows of the outputs, or the failure. */
static void parts_reply(stria_worker_t *w, stria_rpc_call_t **parts, int n, stria_status_t st,
                        bool retryable, const char *msg, stria__wrun_t *run, uint64_t minflt)
{
    for (int i = 0; i < n; i++) {
        if (st != STRIA_OK) {
            stria_rpc_call_fail_r(parts[i], st, retryable, "%s", msg);
            continue;
        }
        stria__waccept_t *a = stria_rpc_call_cleanup_arg(parts[i]);
        Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
        rep.stats = &run->stats;
        rep.worker_minflt = minflt;
        char *out = a->stage; /* the reply's now: freed once written */
        a->stage = NULL;
        stria_metric_add(w->m_out_bytes, (double)a->stage_out);
        if (stria_rpc_call_reply(parts[i], &rep.base, out, a->stage_out, free, out) != STRIA_OK)
            stria_log_warn("the reply to part %d of %d of a call could not be sent", i, n);
    }
}

/* Runs one call handed to the thread and answers it. */
static void serve(stria__wsess_t *s, stria_rpc_call_t *call)
{
    stria_worker_t *w = s->w;
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    stria__waccept_t *acc = stria_rpc_call_cleanup_arg(call);
    const int b = req->backward ? 1 : 0;
    uint64_t flt0 = minflt();
    stria__wrun_t run;
    stria_rpc_call_t *parts[STRIA_CALL_MAX_PARTS];
    const int n_parts = (int)acc->parts;
    if (n_parts > 0) /* each trainer rank's rows to their place in the shard */
        parts_in(s, acc, parts);
    stria_status_t st = stria__wcall_run(s, req, &acc->g, acc->region, &run);
    char msg[1024] = "";
    if (st != STRIA_OK) {
        /* the ring engine's messages name the rank already */
        int n = snprintf(msg, sizeof(msg), "rank %d", s->rank);
        if (strncmp(stria_error_msg(), msg, (size_t)n) != 0)
            snprintf(msg, sizeof(msg), "rank %d: %s", s->rank, stria_error_msg());
        else
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
    }
    stria_metric_add(w->m_passes[b], 1);
    stria_metric_observe(w->m_pass_s[b], run.stats.seconds);
    stria_metric_observe(w->m_call_s[b], run.stats.seconds);
    bool retryable = stria_status_retryable(st);
    if (st != STRIA_OK) {
        stria_metric_add(w->m_pass_fail[b], 1);
        stria_metric_add(st == STRIA_ERR_TIMEOUT                             ? w->m_err_timeout
                         : st == STRIA_ERR_PEER || st == STRIA_ERR_TRANSPORT ? w->m_err_peer
                                                                             : w->m_err_pass,
                         1);
    }
    if (s->report_calls) { /* a job: the coordinator moves it through its states */
        pthread_mutex_lock(&s->lock);
        uint32_t step = s->sh.step, steps = s->sh.steps_total;
        pthread_mutex_unlock(&s->lock);
        const stria__wreport_t r = {
            .job_id = s->id,
            .rank = s->rank,
            .event = st != STRIA_OK ? STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED
                     : b            ? STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_DONE
                                    : STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_DONE,
            .message = st != STRIA_OK ? msg : NULL,
            .step = st == STRIA_OK ? steps : step,
            .steps_total = steps,
            .pass = (uint32_t)req->call,
            .started_ms = run.started_ms,
            .timeline = run.have_tl ? &run.tl.msg : NULL,
            .retryable = retryable};
        stria__wverdict_t v;
        stria__wcoord_report(w, &r, &v);
        retryable = v.retryable;
        /* a job over at the coordinator (cancelled, say, before a heartbeat
         * could tell): its call fails, as the coordinator has it */
        if (st == STRIA_OK && v.state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
            st = v.failure_status < 0 ? v.failure_status : STRIA_ERR_CANCELLED;
            snprintf(msg, sizeof(msg), "rank %d: job %llu is over at the coordinator: %s", s->rank,
                     (unsigned long long)s->id, v.failure[0] ? v.failure : "released");
        }
    }
    if (st != STRIA_OK)
        stria_log_info("%s %llu %s pass failed (call %llu): %s",
                       s->report_calls ? "job" : "session", (unsigned long long)s->id,
                       b ? "backward" : "forward", (unsigned long long)req->call, msg);
    else if (s->report_calls) /* a job's passes are few: each is worth a line */
        stria_log_info("job %llu %s pass done (call %llu) in %.3f s", (unsigned long long)s->id,
                       b ? "backward" : "forward", (unsigned long long)req->call,
                       run.stats.seconds);
    else
        stria_log_debug("session %llu %s pass done (call %llu) in %.3f s",
                        (unsigned long long)s->id, b ? "backward" : "forward",
                        (unsigned long long)req->call, run.stats.seconds);
    uint64_t out_bytes = st == STRIA_OK && !req->arena && n_parts == 0 ? acc->g.out_bytes : 0;
    if (n_parts > 0 && st == STRIA_OK)
        parts_out(acc, parts);
    pthread_mutex_lock(&s->lock);
    account(s, acc, req, st, &run);
    if (out_bytes == 0) {
        s->sh.busy = false;
        pthread_cond_broadcast(&s->sh.cv); /* an arena to unmap may wait for it */
    }
    pthread_mutex_unlock(&s->lock);
    if (run.have_tl)
        stria__wtimeline_free(&run.tl);
    if (n_parts > 0) {
        parts_reply(w, parts, n_parts, st, retryable, msg, &run, minflt() - flt0);
    } else if (st != STRIA_OK) {
        stria_rpc_call_fail_r(call, st, retryable, "%s", msg);
    } else {
        stria_metric_add(w->m_out_bytes, (double)out_bytes);
        Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
        rep.stats = &run.stats;
        rep.worker_minflt = minflt() - flt0;
        uint64_t call_no = req->call;
        if (stria_rpc_call_reply(call, &rep.base, out_bytes ? acc->region + acc->g.out_off : NULL,
                                 out_bytes, out_bytes ? reply_written : NULL, s) != STRIA_OK)
            stria_log_warn("session %llu: the reply to call %llu could not be sent",
                           (unsigned long long)s->id, (unsigned long long)call_no);
    }
    /* answered: only now may a stopping worker free the server the call
     * belongs to (stria_worker_stop waits for running_calls) */
    pthread_mutex_lock(&w->lock);
    w->running_calls--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
}

static void *pass_thread(void *arg)
{
    stria__wsess_t *s = arg;
    stria_worker_t *w = s->w;
    /* the link, once, at open (counted as a running call for a shutdown) */
    double t0 = stria_time_now();
    stria_status_t st = stria__wcall_bind(s, 0);
    if (st != STRIA_OK) /* the message names the session and rank */
        stria_log_warn("%s", stria_error_msg());
    else
        stria_log_info("session %llu rank %d: ring link bound in %.3f ms",
                       (unsigned long long)s->id, s->rank, (stria_time_now() - t0) * 1e3);
    answer_opens(s, st, stria_time_now() - t0);
    pthread_mutex_lock(&w->lock);
    w->running_calls--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    pthread_mutex_lock(&s->lock);
    for (;;) {
        stria__wshared_t *sh = &s->sh;
        while (!sh->stop && sh->call == NULL && sh->n_opens == 0 &&
               !(sh->arena_closed && sh->arena != NULL && !sh->busy))
            pthread_cond_wait(&sh->cv, &s->lock);
        if (sh->arena_closed && sh->arena != NULL && !sh->busy) {
            /* its client's connection closed: no call of it runs or waits */
            stria__wpool_unmap(w, &sh->arena_map);
            sh->arena = NULL;
            sh->arena_closed = false;
            continue;
        }
        if (sh->stop)
            break;
        if (sh->n_opens > 0) { /* another client of the session opened it again */
            bool up = sh->link_up;
            pthread_mutex_unlock(&s->lock);
            if (!up)
                stria_error_set(STRIA_ERR_TRANSPORT, "%s", sh->link_error);
            answer_opens(s, up ? STRIA_OK : STRIA_ERR_TRANSPORT, 0);
            pthread_mutex_lock(&s->lock);
            continue;
        }
        stria_rpc_call_t *call = sh->call;
        sh->call = NULL;
        pthread_mutex_unlock(&s->lock);
        serve(s, call);
        pthread_mutex_lock(&s->lock);
    }
    /* closing: answer what waits, give everything back */
    stria_rpc_call_t *call = s->sh.call;
    s->sh.call = NULL;
    int n_opens = s->sh.n_opens;
    pthread_mutex_unlock(&s->lock);
    if (call != NULL) {
        stria_rpc_call_fail_r(call, STRIA_ERR_CANCELLED, false, "session %llu is closed",
                              (unsigned long long)s->id);
        pthread_mutex_lock(&w->lock);
        w->running_calls--;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->lock);
    }
    if (n_opens > 0) {
        stria_error_set(STRIA_ERR_CANCELLED, "session %llu is closed", (unsigned long long)s->id);
        answer_opens(s, STRIA_ERR_CANCELLED, 0);
    }
    stria__wcall_unbind(s);
    stria__wcall_engine_free(s);
    stria_log_info("session %llu rank %d closed after %llu calls (%llu failed)",
                   (unsigned long long)s->id, s->rank, (unsigned long long)s->sh.calls,
                   (unsigned long long)s->sh.failed);
    /* the last reference goes in the same section that counts the thread
     * out: stria_worker_stop() frees the pools once none is left */
    pthread_mutex_lock(&w->lock);
    w->session_threads--;
    if (--s->refs == 0 && s->dropped)
        sess_free(s);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

void stria__wsess_open(stria__wsess_t *s, stria_rpc_call_t *call, bool early)
{
    stria_worker_t *w = s->w;
    stria_status_t st = STRIA_OK;
    pthread_mutex_lock(&w->lock);
    bool closing = s->dropped || w->stopping;
    pthread_mutex_unlock(&w->lock);
    pthread_mutex_lock(&s->lock);
    stria__wshared_t *sh = &s->sh;
    if (closing)
        st = stria_error_set(STRIA_ERR_CANCELLED, "session %llu is closing",
                             (unsigned long long)s->id);
    else if (sh->n_opens == STRIA__MAX_OPENS)
        st = stria_error_set(STRIA_ERR_BUSY, "session %llu rank %d: too many opens at once",
                             (unsigned long long)s->id, s->rank);
    bool start = st == STRIA_OK && !sh->started;
    if (st == STRIA_OK) {
        if (!early)
            sh->opens[sh->n_opens++] = call;
        sh->last_activity = stria_time_now();
        if (!start)
            pthread_cond_broadcast(&sh->cv);
        else
            sh->started = true;
    }
    pthread_mutex_unlock(&s->lock);
    if (st == STRIA_OK && early && !start) { /* running: answered now */
        open_reply(s, call, 0);
        stria__wsess_unref(s);
        return;
    }
    if (st != STRIA_OK) {
        stria__wsess_unref(s);
        stria_rpc_call_fail(call, st, "%s", stria_error_msg());
        return;
    }
    if (!start) {
        stria__wsess_unref(s);
        return;
    }
    /* the first open: the regions, the thread (which keeps our reference) */
    stria__wcall_park_init(s);
    st = stria__wpool_alloc(w, (size_t)(s->region * (1u + s->max_held)), (void **)&s->slots);
    if (st != STRIA_OK) {
        stria_error_wrap(st, "session %llu: its buffers", (unsigned long long)s->id);
    } else {
        pthread_mutex_lock(&w->lock);
        w->session_threads++;
        w->running_calls++; /* the link's bind, as a call */
        pthread_mutex_unlock(&w->lock);
        int rc = stria__wthr_run(w, pass_thread, s) == STRIA_OK ? 0 : -1;
        if (rc == 0 && early) /* its thread binds the link meanwhile */
            open_reply(s, call, 0);
        if (rc == 0)
            return;
        pthread_mutex_lock(&w->lock);
        w->session_threads--;
        w->running_calls--;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->lock);
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot start the session's thread");
    }
    pthread_mutex_lock(&s->lock);
    sh->started = false;
    pthread_mutex_unlock(&s->lock);
    if (early)
        stria_rpc_call_fail(call, st, "%s", stria_error_msg());
    else
        answer_opens(s, st, 0);
    stria__wsess_unref(s);
}

int stria__wsess_take_parts(stria__wsess_t *s, stria_rpc_call_t *out[STRIA_CALL_MAX_PARTS])
{
    stria__wshared_t *sh = &s->sh;
    int n = 0;
    for (uint32_t i = 0; i < sh->asm_parts && i < STRIA_CALL_MAX_PARTS; i++) {
        stria_rpc_call_t *c = sh->part_calls[i];
        sh->part_calls[i] = NULL;
        if (c == NULL || !(sh->parts_in >> i & 1))
            continue; /* still reading its payload: refused once it is in */
        ((stria__waccept_t *)stria_rpc_call_cleanup_arg(c))->answered = true;
        out[n++] = c;
    }
    sh->asm_parts = 0;
    sh->parts_accepted = sh->parts_in = 0;
    return n;
}

void stria__wsess_hand(stria__wsess_t *s, stria_rpc_call_t *call)
{
    stria_worker_t *w = s->w;
    stria__waccept_t *acc = stria_rpc_call_cleanup_arg(call);
    pthread_mutex_lock(&w->lock);
    bool stopping = w->stopping;
    if (!stopping && !s->dropped)
        w->running_calls++;
    pthread_mutex_unlock(&w->lock);
    pthread_mutex_lock(&s->lock);
    acc->handed = true; /* from here on the thread, or this refusal, ends busy */
    if (s->sh.stop || stopping) {
        stria_rpc_call_t *parts[STRIA_CALL_MAX_PARTS];
        int n = acc->parts > 0 ? stria__wsess_take_parts(s, parts) : 0;
        s->sh.busy = false;
        pthread_cond_broadcast(&s->sh.cv);
        pthread_mutex_unlock(&s->lock);
        for (int i = 0; i < n; i++)
            if (parts[i] != call)
                stria_rpc_call_fail_r(
                    parts[i], stopping ? STRIA_ERR_BUSY : STRIA_ERR_CANCELLED, stopping, "%s",
                    stopping ? "this worker is shutting down" : "the session is closed");
        if (!stopping) {
            pthread_mutex_lock(&w->lock);
            w->running_calls--;
            pthread_cond_broadcast(&w->cv);
            pthread_mutex_unlock(&w->lock);
        }
        stria_rpc_call_fail_r(call, stopping ? STRIA_ERR_BUSY : STRIA_ERR_CANCELLED, stopping,
                              stopping ? "this worker is shutting down" : "the session is closed");
        return;
    }
    if (s->sharded && s->report_calls) { /* the coordinator judges who did not arrive */
        const Stria__V1__SessionCallRequest *req =
            (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
        stria__wcoord_arrived_later(w, s->id, s->rank, req->call, req->backward);
    }
    for (uint32_t i = 0; i < acc->parts; i++) /* the thread answers every part */
        if (s->sh.part_calls[i] != NULL)
            ((stria__waccept_t *)stria_rpc_call_cleanup_arg(s->sh.part_calls[i]))->handed = true;
    s->sh.call = call;
    s->sh.running = true;
    s->sh.step = 0;
    s->sh.phase = acc->g.backward ? STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_BACKWARD
                                  : STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_FORWARD;
    s->sh.last_activity = stria_time_now();
    pthread_cond_broadcast(&s->sh.cv);
    pthread_mutex_unlock(&s->lock);
}

stria_status_t stria__wsess_release_held(stria__wsess_t *s, uint64_t call)
{
    pthread_mutex_lock(&s->lock);
    int slot = stria__wcall_held_slot(s, call);
    bool running = s->sh.busy;
    if (slot >= 0 && !running)
        s->sh.held_mask &= ~(UINT64_C(1) << slot);
    pthread_mutex_unlock(&s->lock);
    if (slot < 0)
        return stria_error_set(STRIA_ERR_NOT_FOUND,
                               "session %llu rank %d: call %llu holds no forward here (never "
                               "held, used by its backward or released)",
                               (unsigned long long)s->id, s->rank, (unsigned long long)call);
    if (running)
        return stria_error_set(STRIA_ERR_BUSY, "session %llu rank %d: a call is running",
                               (unsigned long long)s->id, s->rank);
    return STRIA_OK;
}

/* ---- heartbeats ------------------------------------------------------------------ */

static int float_cmp(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

void stria__wsess_status(stria__wsess_t *s, double now, Stria__V1__WorkerJobStatus *st,
                         Stria__V1__SessionStats *ss, stria__wtimeline_t *tl)
{
    float sorted[STRIA__LAT_KEPT];
    pthread_mutex_lock(&s->lock);
    const stria__wshared_t *sh = &s->sh;
    stria__v1__worker_job_status__init(st);
    st->job_id = s->id;
    st->phase = sh->phase;
    st->step = sh->step;
    st->steps_total = sh->steps_total;
    double idle = sh->running ? 0.0 : (now - sh->last_activity) * 1000.0;
    st->idle_ms = idle > 4e9 ? 4000000000u : (uint32_t)idle;
    stria__v1__session_stats__init(ss);
    ss->calls = sh->calls;
    ss->failed_calls = sh->failed;
    ss->bytes = sh->bytes;
    unsigned n = sh->n_lat < STRIA__LAT_KEPT ? sh->n_lat : STRIA__LAT_KEPT;
    if (n > 0) {
        memcpy(sorted, sh->lat, n * sizeof(float));
        qsort(sorted, n, sizeof(float), float_cmp);
        ss->call_p50_ms = 1000.0f * sorted[n / 2];
        ss->call_p99_ms = 1000.0f * sorted[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1];
    }
    st->session = ss;
    if (s->sh.tl_new) {
        *tl = s->sh.tl;
        memset(&s->sh.tl, 0, sizeof(s->sh.tl));
        s->sh.tl_new = false;
        st->timeline = &tl->msg;
    }
    pthread_mutex_unlock(&s->lock);
}

/* ---- the arena of a co-located client ------------------------------------------- */

#ifndef HUGETLBFS_MAGIC
#define HUGETLBFS_MAGIC 0x958458f6
#endif

/* What a worker requires of an arena before it maps it: sealed against
 * shrinking (a mapping would fault past the end: SIGBUS) and growing, not
 * hugetlbfs, the size it was said to be and no larger than the session's
 * bound, and no holes (a page the worker faulted in first would be charged
 * to it). */
static stria_status_t arena_check(int fd, uint64_t size, uint64_t bound)
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

stria_status_t stria__wsess_arena(stria_worker_t *w, uint64_t id, uint32_t rank,
                                  const stria_job_secret_t *secret, int fd, uint64_t size)
{
    stria__wsess_t *s;
    stria_status_t st = stria__wsess_get(w, id, rank, false, &s);
    if (st != STRIA_OK)
        return st;
    if (!stria_auth_equal(secret->bytes, s->secret.bytes, sizeof(s->secret))) {
        stria__wsess_unref(s);
        return stria_error_set(STRIA_ERR_AUTH, "session %llu: the secret is not the session's",
                               (unsigned long long)id);
    }
    pthread_mutex_lock(&s->lock);
    if (!s->sh.started)
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "job %llu rank %u is no session open on this worker (open it first)",
                             (unsigned long long)id, rank);
    else if (s->sh.arena != NULL)
        st = stria_error_set(STRIA_ERR_BUSY, "session %llu rank %u has an arena already",
                             (unsigned long long)id, rank);
    pthread_mutex_unlock(&s->lock);
    stria__wmap_t map = {0};
    if (st == STRIA_OK && (st = arena_check(fd, size, s->region * (1u + s->max_held))) == STRIA_OK)
        st = stria__wpool_map(w, fd, (size_t)size, &map);
    if (st == STRIA_OK) {
        pthread_mutex_lock(&s->lock);
        if (s->sh.arena == NULL && !s->sh.stop) {
            s->sh.arena = map.base;
            s->sh.arena_size = (size_t)size;
            s->sh.arena_map = map;
            s->sh.arena_closed = false;
            map.base = NULL;
        } else {
            st = stria_error_set(STRIA_ERR_BUSY, "session %llu rank %u has an arena already",
                                 (unsigned long long)id, rank);
        }
        pthread_mutex_unlock(&s->lock);
    }
    stria__wpool_unmap(w, &map);
    if (st == STRIA_OK)
        stria_log_info("session %llu rank %u: a %llu-byte arena registered", (unsigned long long)id,
                       rank, (unsigned long long)size);
    stria__wsess_unref(s);
    return st;
}

void stria__wsess_arena_closed(stria_worker_t *w, uint64_t id, uint32_t rank, int pid)
{
    stria__wsess_t *s = NULL;
    pthread_mutex_lock(&w->lock);
    stria__wsess_t *f = stria__wsess_find(w, id);
    if (f != NULL && (uint32_t)f->rank == rank) {
        s = f;
        s->refs++;
    }
    bool stopping = w->stopping;
    pthread_mutex_unlock(&w->lock);
    if (s == NULL)
        return;
    pthread_mutex_lock(&s->lock);
    if (s->sh.arena != NULL) {
        s->sh.arena_closed = true; /* unmapped by the thread between calls */
        pthread_cond_broadcast(&s->sh.cv);
    }
    pthread_mutex_unlock(&s->lock);
    if (s->report_calls && !stopping) { /* a job: its client is gone */
        char msg[256];
        snprintf(msg, sizeof(msg),
                 "rank %u: its client (pid %d) closed its shared-memory connection without "
                 "releasing the job",
                 rank, pid);
        stria__wsess_fail(s, msg);
    }
    stria__wsess_unref(s);
}
