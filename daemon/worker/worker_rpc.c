/* The Worker service: OpenSession (the session's assignment fetched on a
 * thread of its own when this worker does not hold it yet), SessionCall
 * (checked before a byte of it is read, its inputs read straight into
 * their place, the pieces of large inputs put together, then handed to the
 * session's pass thread) and DropJob. Every handler runs on the RPC loop
 * thread and never waits for a pass or for the coordinator. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker_int.h"

/* ---- OpenSession ------------------------------------------------------------------ */

typedef struct {
    stria_worker_t *w;
    stria_rpc_call_t *call;
    uint64_t id;
    uint32_t rank;
    stria__wsess_t *s;
    stria_status_t st;
    bool retryable;
    char error[512];
} fetch_t;

/* On the loop thread again: the proof, then the open. */
static void fetched(void *arg)
{
    fetch_t *f = arg;
    if (f->st != STRIA_OK) {
        stria_rpc_call_fail_r(f->call, f->st, f->retryable, "%s", f->error);
    } else if (stria_rpc_call_check_job(f->call, &f->s->secret, f->id) != STRIA_OK) {
        stria_rpc_call_fail(f->call, STRIA_ERR_AUTH, "%s", stria_error_msg());
        stria__wsess_unref(f->s);
    } else {
        const Stria__V1__OpenSessionRequest *req =
            (const Stria__V1__OpenSessionRequest *)stria_rpc_call_request(f->call);
        stria__wsess_open(f->s, f->call, req->early);
    }
    free(f);
}

static void *fetch_main(void *arg)
{
    fetch_t *f = arg;
    stria_worker_t *w = f->w;
    f->st = stria__wsess_get(w, f->id, f->rank, true, &f->s);
    if (f->st != STRIA_OK) {
        snprintf(f->error, sizeof(f->error), "%s", stria_error_msg());
        f->retryable = stria_error_retryable();
    }
    if (stria_rpc_server_post(w->server, fetched, f) != STRIA_OK) {
        stria_rpc_call_fail(f->call, STRIA_ERR_NO_MEMORY, "out of memory");
        if (f->st == STRIA_OK)
            stria__wsess_unref(f->s);
        free(f);
    }
    pthread_mutex_lock(&w->lock);
    w->fetching--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

void stria__wrpc_on_open(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__OpenSessionRequest *req =
        (const Stria__V1__OpenSessionRequest *)stria_rpc_call_request(call);
    stria__wsess_t *s;
    stria_status_t st = stria__wsess_get(w, req->job_id, req->rank, false, &s);
    if (st == STRIA_OK) {
        if (stria_rpc_call_check_job(call, &s->secret, req->job_id) != STRIA_OK) {
            stria__wsess_unref(s);
            stria_rpc_call_fail(call, STRIA_ERR_AUTH, "%s", stria_error_msg());
        } else {
            stria__wsess_open(s, call, req->early);
        }
        return;
    }
    if (st != STRIA_ERR_NOT_FOUND) {
        stria_rpc_call_fail(call, st, "%s", stria_error_msg());
        return;
    }
    /* not held yet: its assignment from the coordinator, off the loop */
    fetch_t *f = calloc(1, sizeof(*f));
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
    *f = (fetch_t){.w = w, .call = call, .id = req->job_id, .rank = req->rank};
    if (stria__wthr_run(w, fetch_main, f) == STRIA_OK)
        return;
    free(f);
    pthread_mutex_lock(&w->lock);
    w->fetching--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "cannot start a thread");
}

/* ---- SessionCall ------------------------------------------------------------------ */

/* Fails parts taken from the session (its lock not held). */
static void fail_parts(stria_rpc_call_t **calls, int n, stria_status_t st, const char *msg)
{
    for (int i = 0; i < n; i++)
        stria_rpc_call_fail_r(calls[i], st, stria_status_retryable(st), "%s", msg);
}

/* An accepted call is destroyed: one that was neither handed to the pass
 * thread nor answered lost its connection in the middle of its inputs, so
 * it cannot run, and the ring it was to join fails now. */
static void accepted_done(void *arg)
{
    stria__waccept_t *acc = arg;
    stria__wsess_t *s = acc->s;
    if (!acc->handed && !acc->answered) {
        stria_rpc_call_t *others[STRIA_CALL_MAX_PARTS];
        int n = 0;
        pthread_mutex_lock(&s->lock);
        if (acc->parts > 0 && s->sh.part_calls[acc->part] == acc->call)
            s->sh.part_calls[acc->part] = NULL;
        if (acc->parts > 0 || s->sh.asm_parts > 0)
            n = stria__wsess_take_parts(s, others);
        s->sh.busy = false;
        s->sh.assembling = false;
        pthread_cond_broadcast(&s->sh.cv);
        pthread_mutex_unlock(&s->lock);
        char msg[256];
        snprintf(msg, sizeof(msg),
                 "rank %d: its client's connection was lost in the middle of an upload", s->rank);
        fail_parts(others, n, STRIA_ERR_PEER, msg);
        stria__wsess_fail(s, msg);
    }
    stria__wsess_unref(s);
    free(acc->stage);
    free(acc);
}

/* Whether [off, off + len) lies inside `size` bytes. */
static bool inside(uint64_t off, uint64_t len, uint64_t size)
{
    return off <= size && len <= size - off;
}

/* Whether a request is a piece of a call's inputs (or the last of them). */
static bool is_piece(const stria__wsess_t *s, const stria_call_place_t *p)
{
    return p->more || p->piece_offset > 0 || (s->sh.assembling && s->sh.asm_call == p->call);
}

/* What a call's place asks, against the session (s->lock held). */
static stria_status_t check_place(const stria__wsess_t *s, const stria_call_place_t *p,
                                  const stria__wgeom_t *g, uint64_t payload_len)
{
    const stria__wshared_t *sh = &s->sh;
    const unsigned long long id = (unsigned long long)s->id, call = (unsigned long long)p->call;
    if (p->hold && p->backward)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session %llu call %llu: a backward call holds nothing", id, call);
    if (p->use_held && !p->backward)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session %llu call %llu: only a backward call uses a held forward",
                               id, call);
    if (p->hold && __builtin_popcountll(sh->held_mask) >= (int)s->max_held)
        return stria_error_set(STRIA_ERR_BUSY,
                               "session %llu call %llu: %u forward(s) held already, the session's "
                               "max_held (run their backward, or release them)",
                               id, call, s->max_held);
    if (p->parts > 0) {
        if (p->parts < 2 || p->parts > STRIA_CALL_MAX_PARTS || p->part >= p->parts)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu: part %u of %u (parts: 2..%d, each "
                                   "below their number)",
                                   id, call, p->part, p->parts, STRIA_CALL_MAX_PARTS);
        if (!s->sharded || s->layout_kind != STRIA_LAYOUT_STRIPED)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu: only a sharded striped session takes "
                                   "a rank's inputs in parts",
                                   id, call);
        if (p->arena || p->more || p->piece_offset != 0)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu: a part comes whole in its payload "
                                   "(never in the arena or in pieces)",
                                   id, call);
        if ((int64_t)s->n_ranks * p->parts > STRIA_LAYOUT_MAX_RANKS)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu: %d ranks x %u parts is more than %d "
                                   "stripes",
                                   id, call, s->n_ranks, p->parts, STRIA_LAYOUT_MAX_RANKS);
        int t0, t1;
        stria__wcall_inputs(g, &t0, &t1);
        int64_t rows = stria__wcall_part_rows(s, g, p->part, p->parts);
        uint64_t want = stria__wcall_part_bytes(g, rows < 0 ? 0 : rows, t0, t1);
        if (payload_len != want)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu rank %d: the payload is %llu bytes; "
                                   "part %u of %u brings %llu (%lld tokens)",
                                   id, call, s->rank, (unsigned long long)payload_len, p->part,
                                   p->parts, (unsigned long long)want, (long long)rows);
        return STRIA_OK;
    }
    if (p->arena) {
        if (payload_len != 0)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu: inputs in the arena and a payload too",
                                   id, call);
        if (p->hold || p->use_held || p->more || p->piece_offset != 0)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu: an arena call keeps its forwards in "
                                   "the arena and never comes in pieces",
                                   id, call);
        uint64_t size = sh->arena != NULL && !sh->arena_closed ? sh->arena_size : 0;
        if (size == 0)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu rank %d: no arena is registered with "
                                   "this worker (or its connection closed)",
                                   id, call, s->rank);
        if (!inside(p->arena_in, g->in_bytes, size) || !inside(p->arena_out, g->out_bytes, size))
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu rank %d: inputs at %llu (%llu bytes) "
                                   "or outputs at %llu (%llu bytes) outside the %llu-byte arena",
                                   id, call, s->rank, (unsigned long long)p->arena_in,
                                   (unsigned long long)g->in_bytes,
                                   (unsigned long long)p->arena_out,
                                   (unsigned long long)g->out_bytes, (unsigned long long)size);
        return STRIA_OK;
    }
    if (is_piece(s, p)) {
        if (!inside(p->piece_offset, payload_len, g->in_bytes))
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu rank %d: a piece of %llu bytes at %llu "
                                   "lies outside the call's %llu bytes of inputs",
                                   id, call, s->rank, (unsigned long long)payload_len,
                                   (unsigned long long)p->piece_offset,
                                   (unsigned long long)g->in_bytes);
        return STRIA_OK;
    }
    if (payload_len != g->in_bytes)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session %llu call %llu rank %d: the payload is %llu bytes; the "
                               "call's %s inputs are %llu",
                               id, call, s->rank, (unsigned long long)payload_len,
                               !p->backward  ? "forward"
                               : p->use_held ? "held backward's"
                                             : "backward",
                               (unsigned long long)g->in_bytes);
    return STRIA_OK;
}

/* The region a call's inputs go to (s->lock held): a held forward's for
 * its backward, else one no forward holds; -1 for an arena call. */
static stria_status_t pick_slot(stria__wsess_t *s, const stria_call_place_t *p,
                                const stria__wgeom_t *g, int *slot_out)
{
    *slot_out = -1;
    if (p->arena)
        return STRIA_OK;
    if (!p->use_held) {
        *slot_out = stria__wcall_free_slot(s);
        return STRIA_OK; /* there is always one: at most max_held are held */
    }
    int slot = stria__wcall_held_slot(s, p->held_call);
    if (slot < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session %llu rank %d: call %llu holds no forward here (never held, "
                               "used by its backward or released)",
                               (unsigned long long)s->id, s->rank,
                               (unsigned long long)p->held_call);
    if (s->sh.held_digest[slot] !=
        stria_call_shape_digest(&g->shape, (int)s->layout_kind, 0, false))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session %llu rank %d: call %llu's shape is not the held forward's "
                               "(call %llu)",
                               (unsigned long long)s->id, s->rank, (unsigned long long)p->call,
                               (unsigned long long)p->held_call);
    *slot_out = slot;
    return STRIA_OK;
}

/* Parts of a call that can no longer run, taken from the session under its
 * lock and failed once it is let go. */
typedef struct {
    stria_rpc_call_t *calls[STRIA_CALL_MAX_PARTS];
    int n;
    stria_status_t st;
    char msg[600];
} stale_t;

/* Takes the parts waiting on s, to fail with `st` and msg (s->lock held);
 * the session then assembles nothing and is free. */
static void stale_take_locked(stria__wsess_t *s, stale_t *x, stria_status_t st, const char *msg)
{
    x->n = stria__wsess_take_parts(s, x->calls);
    x->st = st;
    snprintf(x->msg, sizeof(x->msg), "%s", msg);
    s->sh.assembling = false;
    s->sh.busy = false;
}

/* Fails what stale_take_locked() took (s->lock not held), keeping the
 * thread's error of `st` (the refusal of the call at hand, if any). */
static void stale_fail(stale_t *x, stria_status_t st)
{
    if (x->n == 0)
        return;
    char msg[512];
    snprintf(msg, sizeof(msg), "%s", stria_error_msg());
    fail_parts(x->calls, x->n, x->st, x->msg);
    if (st != STRIA_OK)
        stria_error_set(st, "%s", msg);
}

/* Where call p goes among the session's (s->lock held): a later piece or
 * part of the call being put together (named alike: `identity`), or a new
 * call, which takes the session (one at a time) and a region (*slot_out).
 * A part waits in the session for the others. */
static stria_status_t join_locked(stria__wsess_t *s, stria_rpc_call_t *call,
                                  const stria_call_place_t *p, const stria__wgeom_t *g,
                                  const uint8_t *identity, bool piece, bool part, int *slot_out)
{
    stria__wshared_t *sh = &s->sh;
    const unsigned long long id = (unsigned long long)s->id, no = (unsigned long long)p->call;
    stria_status_t st = STRIA_OK;
    if ((piece || part) && sh->assembling) { /* a later piece or part */
        if (memcmp(identity, sh->asm_binding, STRIA_CALL_BINDING_BYTES) != 0)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu rank %d: a %s that differs from the "
                                   "call's first (shape, direction, held forward, parts)",
                                   id, no, s->rank, part ? "part" : "piece");
        if (part && (sh->parts_accepted >> p->part & 1))
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "session %llu call %llu rank %d: part %u of %u came twice", id,
                                   no, s->rank, p->part, p->parts);
        *slot_out = sh->asm_slot;
    } else {
        if (sh->busy)
            return stria_error_set(STRIA_ERR_BUSY,
                                   "session %llu rank %d: a call is running (calls of a session "
                                   "run one at a time)",
                                   id, s->rank);
        if ((st = pick_slot(s, p, g, slot_out)) != STRIA_OK)
            return st;
        sh->busy = true;
        if (piece || part) {
            sh->assembling = true;
            sh->asm_call = p->call;
            sh->asm_slot = *slot_out;
            memcpy(sh->asm_binding, identity, STRIA_CALL_BINDING_BYTES);
            stria_ranges_free(&sh->asm_got); /* empty again */
            sh->asm_parts = part ? p->parts : 0;
            sh->asm_epoch = p->link_epoch;
            sh->parts_accepted = sh->parts_in = 0;
        }
    }
    if (part) { /* it waits here for the others (the arrival timeout counts from now) */
        sh->parts_accepted |= UINT64_C(1) << p->part;
        sh->part_calls[p->part] = call;
        sh->last_activity = stria_time_now();
    }
    return STRIA_OK;
}

/* The accepted record of call p (a part's with its own buffer, sized for
 * its inputs and its outputs); NULL when out of memory, the call then
 * given up in the session. */
static stria__waccept_t *record(stria__wsess_t *s, stria_rpc_call_t *call,
                                const stria_call_place_t *p, const stria__wgeom_t *g, int slot,
                                bool part)
{
    stria__waccept_t *acc = calloc(1, sizeof(*acc));
    if (acc != NULL && part) {
        int t0, t1, u0, u1;
        stria__wcall_inputs(g, &t0, &t1);
        stria__wcall_outputs(g, &u0, &u1);
        acc->rows = stria__wcall_part_rows(s, g, p->part, p->parts);
        acc->stage_in = stria__wcall_part_bytes(g, acc->rows, t0, t1);
        acc->stage_out = stria__wcall_part_bytes(g, acc->rows, u0, u1);
        acc->stage = malloc(acc->stage_in > acc->stage_out ? acc->stage_in : acc->stage_out);
        if (acc->stage == NULL) {
            free(acc);
            acc = NULL;
        }
    }
    if (acc == NULL) {
        pthread_mutex_lock(&s->lock);
        if (part) {
            s->sh.parts_accepted &= ~(UINT64_C(1) << p->part);
            s->sh.part_calls[p->part] = NULL;
        }
        if (!part || s->sh.parts_accepted == 0)
            s->sh.busy = s->sh.assembling = false;
        pthread_mutex_unlock(&s->lock);
        return NULL;
    }
    acc->s = s;
    acc->g = *g;
    acc->slot = slot;
    acc->region = slot >= 0 ? s->slots + (uint64_t)slot * s->region : NULL;
    acc->call = call;
    acc->part = part ? p->part : 0;
    acc->parts = part ? p->parts : 0;
    return acc;
}

/* The checks of a call before anything of it is read: the proof (binding
 * its number, epoch, shape, places, piece, held forward and part), the
 * session open here, the shape against the bounds (from the worker's own
 * decoded copy), its inputs (payload bytes, or their place in the arena),
 * one call at a time (its pieces or parts put together); then the region
 * its inputs go to. On success the call carries its accepted record (the
 * cleanup's argument, which holds the session's reference). A refused call
 * aborts the ring link: the other ranks may be in it already, and fail
 * now; so do the parts of its call waiting here. */
static stria_status_t accept(stria_worker_t *w, stria_rpc_call_t *call, uint64_t payload_len,
                             stria__waccept_t **out)
{
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    Stria__V1__CallShape none = STRIA__V1__CALL_SHAPE__INIT;
    stria_call_shape_t shape;
    stria_call_place_t p;
    uint8_t bound[STRIA_CALL_BINDING_BYTES], identity[STRIA_CALL_BINDING_BYTES];
    stria_call_shape_from_pb(req->shape != NULL ? req->shape : &none, &shape);
    stria_call_place_from_pb(req, &p);

    stria__wsess_t *s;
    stria_status_t st = stria__wsess_get(w, req->job_id, req->rank, false, &s);
    if (st != STRIA_OK)
        return st;
    stria_call_binding(&shape, (int)s->layout_kind, &p, bound);
    stria_call_place_t whole = p; /* what every piece or part of one call names alike */
    whole.more = false;
    whole.piece_offset = 0;
    whole.part = 0;
    stria_call_binding(&shape, (int)s->layout_kind, &whole, identity);
    if ((st = stria_rpc_call_check_job_extra(call, &s->secret, req->job_id, bound,
                                             sizeof(bound))) != STRIA_OK) {
        stria__wsess_unref(s);
        return st;
    }
    pthread_mutex_lock(&w->lock);
    bool draining = w->draining;
    pthread_mutex_unlock(&w->lock);
    stria__wgeom_t g;
    int slot = -1;
    stale_t stale = {.n = 0};
    pthread_mutex_lock(&s->lock);
    stria__wshared_t *sh = &s->sh;
    const bool open = sh->started; /* its link bound, or being bound: the thread waits for it */
    if (!open)
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "session %llu rank %u is not open here",
                             (unsigned long long)req->job_id, req->rank);
    else if (draining && !s->report_calls && !req->use_held)
        /* at a call boundary: the client opens the session elsewhere (a
         * job's passes, and a backward of a forward held here, finish) */
        st = stria_error_set(STRIA_ERR_CLOSED,
                             "worker %llu is draining: session %llu moves off it at this call",
                             (unsigned long long)w->worker_id, (unsigned long long)req->job_id);
    else if (req->shape == NULL)
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "SessionCall: no shape");
    if (st == STRIA_OK)
        st = stria__wcall_geom(s, &shape, req->backward, req->use_held, &g);
    if (st == STRIA_OK && sh->assembling &&
        (sh->asm_call != p.call ||
         (sh->asm_parts > 0 && p.parts > 0 && sh->asm_epoch != p.link_epoch))) {
        /* a call whose pieces or parts stopped coming: its clients moved
         * on (to a later call, or a later try of this one) */
        char why[256];
        stria_log_info("session %llu: the %s of call %llu stopped coming; dropped",
                       (unsigned long long)s->id, sh->asm_parts > 0 ? "parts" : "pieces",
                       (unsigned long long)sh->asm_call);
        snprintf(why, sizeof(why),
                 "session %llu rank %d: the call's other parts did not come (call %llu came "
                 "instead)",
                 (unsigned long long)s->id, s->rank, (unsigned long long)p.call);
        stale_take_locked(s, &stale, STRIA_ERR_CANCELLED, why);
    }
    if (st == STRIA_OK)
        st = check_place(s, &p, &g, payload_len);
    const bool part = st == STRIA_OK && p.parts > 0;
    const bool piece = st == STRIA_OK && !p.arena && !part && is_piece(s, &p);
    if (st == STRIA_OK)
        st = join_locked(s, call, &p, &g, identity, piece, part, &slot);
    if (st != STRIA_OK && st != STRIA_ERR_BUSY && sh->assembling && sh->asm_parts > 0 &&
        sh->asm_call == p.call && stale.n == 0) /* the call cannot run: its parts fail too */
        stale_take_locked(s, &stale, st, stria_error_msg());
    stria_link_t *link = open ? sh->link : NULL;
    if (st != STRIA_OK && st != STRIA_ERR_BUSY && link != NULL) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria_link_abort(link, st, msg);
        stria_error_set(st, "%s", msg);
    }
    pthread_mutex_unlock(&s->lock);
    stale_fail(&stale, st);
    stria__waccept_t *acc = st == STRIA_OK ? record(s, call, &p, &g, slot, part) : NULL;
    if (acc == NULL) {
        stria__wsess_unref(s);
        return st != STRIA_OK ? st : stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    }
    stria_rpc_call_set_cleanup(call, accepted_done, acc);
    stria_metric_add(w->m_in_bytes, (double)payload_len);
    *out = acc;
    return STRIA_OK;
}

/* A call with inputs in its payload: read straight into their place. */
stria_status_t stria__wrpc_on_call_payload(void *ctx, stria_rpc_call_t *call, uint64_t payload_len,
                                           void **buf_out)
{
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    stria__waccept_t *acc;
    stria_status_t st = accept(ctx, call, payload_len, &acc);
    if (st == STRIA_OK)
        *buf_out = acc->parts > 0 ? acc->stage : acc->region + acc->g.in_off + req->piece_offset;
    return st;
}

void stria__wrpc_on_call(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    stria__waccept_t *acc = stria_rpc_call_cleanup_arg(call);
    if (acc == NULL) { /* no payload: inputs in the arena, or none */
        stria_status_t st = accept(w, call, 0, &acc);
        if (st != STRIA_OK) {
            stria_rpc_call_fail(call, st, "%s", stria_error_msg());
            return;
        }
    }
    stria__wsess_t *s = acc->s;
    pthread_mutex_lock(&s->lock);
    stria__wshared_t *sh = &s->sh;
    if (acc->parts > 0) { /* the call runs once every part is in */
        bool current = sh->assembling && sh->asm_parts == acc->parts && sh->asm_call == req->call &&
                       sh->part_calls[acc->part] == call;
        if (!current) {
            pthread_mutex_unlock(&s->lock);
            acc->answered = true;
            stria_rpc_call_fail(call, STRIA_ERR_CANCELLED,
                                "session %llu rank %d: call %llu part %u gave way to a later try "
                                "or call",
                                (unsigned long long)s->id, s->rank, (unsigned long long)req->call,
                                acc->part);
            return;
        }
        sh->parts_in |= UINT64_C(1) << acc->part;
        sh->last_activity = stria_time_now();
        bool all =
            sh->parts_in == (acc->parts == 64 ? UINT64_MAX : (UINT64_C(1) << acc->parts) - 1);
        if (all)
            sh->assembling = false;
        pthread_mutex_unlock(&s->lock);
        if (all)
            stria__wsess_hand(s, call);
        return;
    }
    if (sh->assembling && sh->asm_call == req->call) {
        uint64_t len = 0;
        stria_rpc_call_payload(call, &len);
        stria_status_t st = stria_ranges_add(&sh->asm_got, req->piece_offset, len);
        uint64_t got = sh->asm_got.covered,
                 gap = stria_ranges_first_gap(&sh->asm_got, acc->g.in_bytes);
        if (st == STRIA_OK && req->more) { /* more to come: this piece is in */
            sh->last_activity = stria_time_now();
            pthread_mutex_unlock(&s->lock);
            acc->answered = true;
            Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
            stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
            return;
        }
        if (st == STRIA_OK && got < acc->g.in_bytes)
            st = stria_error_set(STRIA_ERR_INVALID_ARG,
                                 "session %llu call %llu rank %d: its inputs are incomplete (%llu "
                                 "of %llu bytes; the first missing byte is at %llu)",
                                 (unsigned long long)s->id, (unsigned long long)req->call, s->rank,
                                 (unsigned long long)got, (unsigned long long)acc->g.in_bytes,
                                 (unsigned long long)gap);
        sh->assembling = false;
        if (st != STRIA_OK) {
            char msg[512];
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
            sh->busy = false;
            if (sh->link != NULL)
                stria_link_abort(sh->link, st, msg);
            pthread_mutex_unlock(&s->lock);
            acc->answered = true;
            stria_rpc_call_fail(call, st, "%s", msg);
            return;
        }
    }
    pthread_mutex_unlock(&s->lock);
    stria__wsess_hand(s, call);
}

/* Parts that waited longer than their session's arrival timeout for the
 * others (since the last part came) fail, naming the parts that did not
 * come, and so does the call on the other ranks (the link aborted): the
 * loop's tick. */
void stria__wrpc_on_tick(void *ctx)
{
    stria_worker_t *w = ctx;
    const double now = stria_time_now();
    for (;;) { /* one late session at a time, its reference held */
        stria__wsess_t *late = NULL;
        pthread_mutex_lock(&w->lock);
        for (stria__wsess_t *s = w->sessions; s != NULL && late == NULL; s = s->next) {
            pthread_mutex_lock(&s->lock);
            if (s->sh.assembling && s->sh.asm_parts > 0 &&
                now - s->sh.last_activity > s->arrival_timeout_s) {
                late = s;
                s->refs++;
            }
            pthread_mutex_unlock(&s->lock);
        }
        pthread_mutex_unlock(&w->lock);
        if (late == NULL)
            return;
        stale_t stale = {.n = 0};
        pthread_mutex_lock(&late->lock);
        stria__wshared_t *sh = &late->sh;
        if (sh->assembling && sh->asm_parts > 0) {
            char why[512], missing[256] = "";
            size_t at = 0;
            for (uint32_t i = 0; i < sh->asm_parts && at < sizeof(missing) - 8; i++)
                if (!(sh->parts_in >> i & 1))
                    at += (size_t)snprintf(missing + at, sizeof(missing) - at, "%s%u",
                                           at > 0 ? ", " : "", i);
            snprintf(why, sizeof(why),
                     "session %llu rank %d: call %llu: part(s) %s of %u did not come within the "
                     "arrival timeout (%.1f s)",
                     (unsigned long long)late->id, late->rank, (unsigned long long)sh->asm_call,
                     missing, sh->asm_parts, late->arrival_timeout_s);
            stale_take_locked(late, &stale, STRIA_ERR_TIMEOUT, why);
            if (sh->link != NULL)
                stria_link_abort(sh->link, STRIA_ERR_TIMEOUT, why);
            stria_log_info("%s", why);
        }
        pthread_mutex_unlock(&late->lock);
        stale_fail(&stale, STRIA_OK);
        stria__wsess_unref(late);
    }
}

/* ---- DropJob ---------------------------------------------------------------------- */

void stria__wrpc_on_drop(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__DropJobRequest *req =
        (const Stria__V1__DropJobRequest *)stria_rpc_call_request(call);
    Stria__V1__DropJobReply rep = STRIA__V1__DROP_JOB_REPLY__INIT;
    stria__wsess_t *s = NULL;
    pthread_mutex_lock(&w->lock);
    stria__wsess_t *f = stria__wsess_find(w, req->job_id);
    if (f != NULL) {
        s = f;
        s->refs++;
    }
    pthread_mutex_unlock(&w->lock);
    if (s != NULL && stria_rpc_call_check_job(call, &s->secret, req->job_id) != STRIA_OK) {
        stria__wsess_unref(s);
        stria_rpc_call_fail(call, STRIA_ERR_AUTH, "%s", stria_error_msg());
        return;
    }
    if (req->release_held) {
        stria_status_t st =
            s == NULL ? stria_error_set(STRIA_ERR_NOT_FOUND, "job %llu is not held by this worker",
                                        (unsigned long long)req->job_id)
            : (uint32_t)s->rank != req->rank
                ? stria_error_set(STRIA_ERR_INVALID_ARG,
                                  "job %llu: this worker holds rank %d, not %u",
                                  (unsigned long long)req->job_id, s->rank, req->rank)
                : stria__wsess_release_held(s, req->held_call);
        if (s != NULL)
            stria__wsess_unref(s);
        if (st != STRIA_OK)
            stria_rpc_call_fail(call, st, "%s", stria_error_msg());
        else
            stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
        return;
    }
    if (s != NULL) {
        pthread_mutex_lock(&w->lock);
        if (!s->dropped) {
            rep.dropped = true;
            rep.freed_bytes = s->bytes;
            stria__wsess_drop_locked(s, STRIA_ERR_CANCELLED, "its client closed it");
        }
        pthread_mutex_unlock(&w->lock);
        stria__wsess_unref(s);
    }
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}
