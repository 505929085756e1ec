/*
 * A UCX link's life (progress thread): the notices its neighbours send it
 * (abort, goodbye, heartbeat), and its step in every progress round, one
 * small function per concern: taking the endpoint to the successor and
 * binding on it (replacing a stale endpoint), settling a dropped endpoint,
 * tearing down after a failure, the goodbye, giving back what UCX holds,
 * heartbeats, and unbinding once nothing is left.
 *
 *   NEW -> CONNECTING -> READY -> CLOSING_GRACEFUL -> DRAINING -> CLOSED
 *   (any but CLOSED) -> FAILED -> TORN_DOWN -> DRAINING -> CLOSED
 *
 * A link never closes an endpoint other links use, with one exception: a
 * failed or destroyed link whose transfers UCX still holds after
 * STRIA__UCX_RECLAIM_SILENT_S (the neighbour is silent) or
 * STRIA__UCX_RECLAIM_ALIVE_S (it is alive, and fails its own side) closes
 * the endpoint that holds them (UCX gives a rendezvous buffer back no other
 * way); the other links bound on it fail, naming the neighbour.
 */
#include "ucx_int.h"

#include <stdio.h>
#include <string.h>

/* ---- notices ------------------------------------------------------------------------- */

/* A neighbour destroyed its link after finishing its requests: the side
 * towards it is closed. What it sent before stays receivable; receives it
 * cannot satisfy fail with STRIA_ERR_CLOSED, and so do sends to it. */
static void bye_locked(stria__ucx_link_t *link, int from_mask)
{
    if (from_mask == STRIA__NOTIFY_PREV) {
        link->hb.nb[STRIA__FROM_PREV].bye = true;
        while (!stria__list_empty(&link->posted)) {
            stria_link_req_t *req = STRIA__OF(link->posted.next, stria_link_req_t, queue_node);
            char msg[200];
            stria__list_del(&req->queue_node);
            snprintf(msg, sizeof(msg), "rank %d left the ring; no message tag %#llx will come",
                     stria_link_prev(&link->base), (unsigned long long)req->tag);
            stria__ucx_req_finish_locked(req, STRIA_ERR_CLOSED, msg);
        }
    } else {
        link->hb.nb[STRIA__FROM_NEXT].bye = true;
    }
    pthread_cond_broadcast(&link->ctx->cond);
}

/* Whether a peer's abort status is one of ours (else it counts as
 * STRIA_ERR_PEER). */
static bool status_known(int32_t st)
{
    return st < 0 && strcmp(stria_status_name((stria_status_t)st), "STRIA_UNKNOWN") != 0;
}

/* An abort from a neighbour (lock held): the link fails with the status the
 * origin gave the ring (the kind of the failure), and passes it on. */
static void abort_locked(stria__ucx_link_t *link, const stria__ctrl_t *c, int forward)
{
    if (link->failed)
        return;
    stria_status_t st = status_known(c->status) ? (stria_status_t)c->status : STRIA_ERR_PEER;
    int reporter = c->reporter >= 0 && c->reporter < link->base.size ? c->reporter : c->rank;
    if (c->origin != reporter)
        stria__ucx_link_fail_locked(link, st, (int)c->origin, forward, "%s (reported by rank %d)",
                                    c->text, reporter);
    else
        stria__ucx_link_fail_locked(link, st, (int)c->origin, forward, "%s", c->text);
    /* Passed on unchanged. */
    link->notify_reporter = reporter;
    link->notify_status = st;
    snprintf(link->notify_text, sizeof(link->notify_text), "%s", c->text);
}

void stria__ucx_notice_handle(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c)
{
    pthread_mutex_lock(&ctx->lock);
    stria__ucx_link_t *link = stria__ucx_link_of_slot_locked(ctx, c->dst);
    /* Only from an endpoint a neighbour bound this link on. */
    int from_mask = link == NULL                        ? 0
                    : link->out == e && link->out_bound ? STRIA__NOTIFY_NEXT
                    : link->in == e && link->in_bound   ? STRIA__NOTIFY_PREV
                                                        : 0;
    if (from_mask == 0 || c->job_id != link->job_id || c->ring_id != link->ring_id) {
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    int side = from_mask == STRIA__NOTIFY_PREV ? STRIA__FROM_PREV : STRIA__FROM_NEXT;
    double now = stria_time_now();
    stria__ucx_hb_heard(&link->hb, side, now);
    if (c->type == STRIA__CTRL_PING)
        stria__ucx_hb_report(&link->hb, side, now, (int)c->origin, (int)c->reporter, (int)c->rank,
                             c->status);
    else if (c->type == STRIA__CTRL_BYE)
        bye_locked(link, from_mask);
    else
        abort_locked(link, c, (STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV) & ~from_mask);
    pthread_mutex_unlock(&ctx->lock);
}

/* ---- helpers ------------------------------------------------------------------------- */

/* Moves the link on from a state the progress thread saw, unless it failed
 * meanwhile: then the next step tears it down. */
static void enter_locked(stria__ucx_link_t *link, stria__ucx_link_state_t to)
{
    if (link->state != STRIA__LINK_FAILED)
        link->state = to;
}

/* Logs when this link starts and stops believing a rank stalled, so that an
 * operator sees a stall as it happens, not only in the deadline it causes. */
static void log_suspect_locked(stria__ucx_link_t *link, double now)
{
    int suspect, reporter, before;
    double silence;
    if (!stria__ucx_hb_log_due(&link->hb, now, &suspect, &reporter, &silence, &before))
        return;
    if (suspect >= 0)
        stria_log_warn("ucx link rank %d/%d (job %llu): rank %d looks stalled (silent for %.1f s, "
                       "seen by rank %d)",
                       link->base.rank, link->base.size, (unsigned long long)link->job_id, suspect,
                       silence, reporter);
    else
        stria_log_info("ucx link rank %d/%d (job %llu): rank %d is no longer reported stalled",
                       link->base.rank, link->base.size, (unsigned long long)link->job_id, before);
}

/* Whether the link still has requests the progress thread or UCX holds. */
static bool busy_locked(const stria__ucx_link_t *link)
{
    for (stria__node_t *n = link->reqs.next; n != &link->reqs; n = n->next) {
        const stria_link_req_t *r = STRIA__OF(n, stria_link_req_t, link_node);
        if (r->state == STRIA__REQ_POSTED)
            return true;
    }
    return false;
}

/* ---- the per-link step ------------------------------------------------------------- */

/* One step of the progress thread over one link. */
typedef struct {
    double now;
    double due; /* when something is due next (0: nothing) */
    bool *any;  /* set when the step did something */
} step_t;

static void step_due(step_t *step, double t)
{
    if (step->due == 0 || t < step->due)
        step->due = t;
}

static bool state_live(stria__ucx_link_state_t st)
{
    return st == STRIA__LINK_CONNECTING || st == STRIA__LINK_READY;
}

/* Under the lock: fails the link once a dropped endpoint has settled,
 * takes the owner's destroy request, and moves NEW on to CONNECTING. Returns
 * the state the rest of the step works from. */
static stria__ucx_link_state_t step_begin(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link,
                                          step_t *step, bool *connect, bool *destroy)
{
    pthread_mutex_lock(&ctx->lock);
    if (link->settle_at > 0 && !link->failed) {
        if (step->now >= link->settle_at) {
            int side = link->settle_side;
            int peer = side == STRIA__NOTIFY_NEXT ? stria_link_next(&link->base)
                                                  : stria_link_prev(&link->base);
            stria__ucx_link_fail_locked(link, STRIA_ERR_PEER, peer,
                                        (STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV) & ~side, "%s",
                                        link->settle_msg);
            *step->any = true;
        } else {
            step->due = link->settle_at;
        }
    }
    stria__ucx_link_state_t st = link->state;
    *connect = st == STRIA__LINK_NEW;
    if (*connect)
        link->state = st = STRIA__LINK_CONNECTING;
    *destroy = link->want_destroy;
    pthread_mutex_unlock(&ctx->lock);
    return st;
}

/* CONNECTING, no endpoint to the successor: takes one (a new one starts
 * its handshake). */
static void take_out(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, step_t *step)
{
    if (link->retry_at > step->now) {
        step_due(step, link->retry_at);
        return;
    }
    link->retry_at = 0;
    *step->any = true;
    stria__ucx_ep_t *e =
        stria__ucx_ep_get(ctx, &link->next_addr, link->next_addrlen, link->next_desc);
    pthread_mutex_lock(&ctx->lock);
    if (e == NULL)
        stria__ucx_link_fail_locked(link, STRIA_ERR_TRANSPORT, stria_link_next(&link->base), 0,
                                    "successor rank %d at %s: %s", stria_link_next(&link->base),
                                    link->next_desc, stria_error_msg());
    link->out = e;
    pthread_mutex_unlock(&ctx->lock);
}

/* CONNECTING: the endpoint to the successor broke before the link was bound
 * on it. A stale one (it was ready: the peer restarted or went away since
 * the last link) is replaced at once; one that never became ready is
 * retried with back-off (the successor does not listen yet), until the
 * connect's deadline; a refusal (version, endpoint key) fails the link. */
static void out_broken_unbound(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, step_t *step)
{
    stria__ucx_ep_t *e = link->out;
    int next = stria_link_next(&link->base);
    *step->any = true;
    pthread_mutex_lock(&ctx->lock);
    link->out = NULL;
    link->bind_counter = 0;
    if (e->why_status != STRIA_ERR_PEER) {
        stria__ucx_link_fail_locked(link, e->why_status, next, 0, "successor rank %d at %s %s",
                                    next, link->next_desc, e->why);
    } else if (e->ready_at > 0 && !link->replaced) {
        link->replaced = true;
        ctx->stats.endpoints_replaced++;
        stria_log_info("ucx link rank %d: the endpoint to successor rank %d at %s was stale (%s); "
                       "replacing it",
                       link->base.rank, next, link->next_desc, e->why);
    } else {
        if (link->retry_delay <= 0)
            link->retry_delay = 0.05;
        link->retry_at = step->now + link->retry_delay;
        link->retry_delay = link->retry_delay * 2 > 1.0 ? 1.0 : link->retry_delay * 2;
        stria_log_debug("ucx link rank %d: successor at %s not reachable (%s), retrying",
                        link->base.rank, link->next_desc, e->why);
    }
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_ep_release(e);
}

/* A bound side's endpoint broke (lock held): the link fails once that
 * settles, naming the neighbour, unless it said goodbye. */
static void side_broken_locked(stria__ucx_link_t *link, int side)
{
    bool next = side == STRIA__NOTIFY_NEXT;
    stria__ucx_ep_t *e = next ? link->out : link->in;
    if (link->failed || link->hb.nb[next ? STRIA__FROM_NEXT : STRIA__FROM_PREV].bye ||
        e->state == STRIA__EP_READY || e->state == STRIA__EP_HANDSHAKE)
        return;
    stria__ucx_link_peer_error_locked(
        link, side, "rank %d (%s at %s) %s",
        next ? stria_link_next(&link->base) : stria_link_prev(&link->base),
        next ? "successor" : "predecessor", next ? link->next_desc : e->peer, e->why);
}

/* CONNECTING or READY: the endpoints' side of the link. */
static void step_sides(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, step_t *step)
{
    if (link->out == NULL)
        take_out(ctx, link, step);
    if (link->out == NULL)
        return;
    pthread_mutex_lock(&ctx->lock);
    stria__ucx_ep_state_t out_st = link->out->state;
    bool failed = link->failed;
    if (link->out_bound)
        side_broken_locked(link, STRIA__NOTIFY_NEXT);
    if (link->in != NULL && link->in_bound)
        side_broken_locked(link, STRIA__NOTIFY_PREV);
    pthread_mutex_unlock(&ctx->lock);
    if (failed || link->out_bound)
        return;
    if (out_st == STRIA__EP_BROKEN || out_st == STRIA__EP_CLOSING)
        out_broken_unbound(ctx, link, step);
    else if (out_st == STRIA__EP_READY && link->bind_counter == 0) {
        *step->any = true;
        stria__ucx_bind_send(ctx, link);
    }
}

/* FAILED -> TORN_DOWN: sends the failure notices, finishes unmatched
 * receives, drops early arrivals; the link then waits for UCX to give its
 * transfers back. */
static void step_teardown(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, step_t *step)
{
    stria__ctrl_t notice[2];
    *step->any = true;
    pthread_mutex_lock(&ctx->lock);
    for (int d = 0; d < 2; d++) {
        stria__ucx_link_ctrl_init(link, &notice[d], STRIA__CTRL_ABORT, d);
        notice[d].status = link->notify_status;
        notice[d].origin = link->notify_origin;
        notice[d].reporter = link->notify_reporter;
        snprintf(notice[d].text, sizeof(notice[d].text), "%s", link->notify_text);
    }
    int mask = link->notify_mask;
    ucp_ep_h next_ep = link->out_bound ? link->out->ep : NULL;
    ucp_ep_h prev_ep = link->in_bound ? link->in->ep : NULL;
    while (!stria__list_empty(&link->posted)) {
        stria_link_req_t *req = STRIA__OF(link->posted.next, stria_link_req_t, queue_node);
        stria__list_del(&req->queue_node);
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
    }
    link->state = STRIA__LINK_TORN_DOWN;
    double now = step->now;
    bool alive = now - link->hb.nb[STRIA__FROM_NEXT].last < ctx->stale_s &&
                 now - link->hb.nb[STRIA__FROM_PREV].last < ctx->stale_s;
    link->reclaim_at = now + (alive ? STRIA__UCX_RECLAIM_ALIVE_S : STRIA__UCX_RECLAIM_SILENT_S);
    pthread_mutex_unlock(&ctx->lock);

    if ((mask & STRIA__NOTIFY_NEXT) && next_ep != NULL)
        stria__ucx_ctrl_send(next_ep, &notice[STRIA__FROM_NEXT], &link->out->ctrl_pending);
    if ((mask & STRIA__NOTIFY_PREV) && prev_ep != NULL)
        stria__ucx_ctrl_send(prev_ep, &notice[STRIA__FROM_PREV], &link->in->ctrl_pending);
    stria__ucx_drop_unexp(ctx, link);
}

/* CONNECTING or READY -> CLOSING_GRACEFUL, on the owner's destroy: goodbye
 * to both neighbours; the endpoints stay for the links after it. */
static void step_goodbye(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, step_t *step)
{
    *step->any = true;
    stria__ctrl_t bye[2];
    pthread_mutex_lock(&ctx->lock);
    enter_locked(link, STRIA__LINK_CLOSING_GRACEFUL);
    for (int d = 0; d < 2; d++)
        stria__ucx_link_ctrl_init(link, &bye[d], STRIA__CTRL_BYE, d);
    ucp_ep_h next_ep = link->out_bound ? link->out->ep : NULL;
    ucp_ep_h prev_ep = link->in_bound ? link->in->ep : NULL;
    link->reclaim_at = step->now + STRIA__UCX_RECLAIM_ALIVE_S;
    pthread_mutex_unlock(&ctx->lock);
    if (next_ep != NULL)
        stria__ucx_ctrl_send(next_ep, &bye[STRIA__FROM_NEXT], &link->out->ctrl_pending);
    if (prev_ep != NULL)
        stria__ucx_ctrl_send(prev_ep, &bye[STRIA__FROM_PREV], &link->in->ctrl_pending);
    stria__ucx_drop_unexp(ctx, link);
}

/* TORN_DOWN or CLOSING_GRACEFUL -> DRAINING once UCX holds no request of
 * the link, or at reclaim_at: then the endpoints holding its transfers are
 * closed (the only way UCX gives them back), failing their other links. */
static stria__ucx_link_state_t step_reclaim(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link,
                                            stria__ucx_link_state_t st, step_t *step)
{
    pthread_mutex_lock(&ctx->lock);
    bool busy = busy_locked(link);
    if (busy && step->now < link->reclaim_at) {
        pthread_mutex_unlock(&ctx->lock);
        step_due(step, link->reclaim_at);
        return st;
    }
    *step->any = true;
    for (stria__node_t *n = link->reqs.next; busy && n != &link->reqs; n = n->next) {
        const stria_link_req_t *r = STRIA__OF(n, stria_link_req_t, link_node);
        stria__ucx_ep_t *e = r->is_send ? link->out : link->in;
        if (r->state != STRIA__REQ_POSTED || r->ucp_req == NULL || e == NULL)
            continue;
        if (e->state == STRIA__EP_READY || e->state == STRIA__EP_HANDSHAKE)
            stria_log_warn("ucx link rank %d: UCX still holds a %s of tag %#llx after the link "
                           "ended; closing the endpoint %s %s to give it back",
                           link->base.rank, stria__req_kind(r), (unsigned long long)r->tag,
                           e->outgoing ? "to" : "from", e->peer);
        stria__ucx_ep_break_locked(e, STRIA_ERR_PEER, 0,
                                   "did not give back a transfer of a link that ended "
                                   "(unresponsive); its endpoint was closed");
    }
    enter_locked(link, STRIA__LINK_DRAINING);
    pthread_mutex_unlock(&ctx->lock);
    return STRIA__LINK_DRAINING;
}

/* CONNECTING or READY, both sides bound: heartbeats to both neighbours,
 * each passing on what came from the other side. */
static void step_heartbeat(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, step_t *step)
{
    if (step->now >= link->next_ping) {
        stria__ctrl_t ping[2];
        pthread_mutex_lock(&ctx->lock);
        for (int d = 0; d < 2; d++) {
            int reporter;
            int32_t silence_ms;
            /* [FROM_PREV] goes to the successor, passing on what came from
             * the predecessor, and the other way round. */
            stria__ucx_link_ctrl_init(link, &ping[d], STRIA__CTRL_PING, 1 - d);
            ping[d].origin = stria__ucx_hb_ping(&link->hb, step->now, d, &reporter, &silence_ms);
            ping[d].reporter = reporter;
            ping[d].status = silence_ms;
        }
        log_suspect_locked(link, step->now);
        stria__ucx_ep_t *out = link->out, *in = link->in;
        ucp_ep_h next_ep = out->ep, prev_ep = in->ep;
        pthread_mutex_unlock(&ctx->lock);
        /* A stalled peer stops reading: do not pile heartbeats up. */
        if (out->ctrl_pending < STRIA__UCX_PINGS_IN_FLIGHT)
            stria__ucx_ctrl_send(next_ep, &ping[STRIA__FROM_PREV], &out->ctrl_pending);
        if (in->ctrl_pending < STRIA__UCX_PINGS_IN_FLIGHT)
            stria__ucx_ctrl_send(prev_ep, &ping[STRIA__FROM_NEXT], &in->ctrl_pending);
        link->next_ping = step->now + ctx->ping_s;
    }
    step_due(step, link->next_ping);
}

/* DRAINING, lock held: finishes the requests UCX still holds
 * STRIA__UCX_DETACH_S after their endpoints were closed and returns them
 * (n_out) to be handed back to UCX. */
static void **detach_locked(stria__ucx_link_t *link, step_t *step, size_t *n_out)
{
    if (link->detach_at == 0)
        link->detach_at = step->now + STRIA__UCX_DETACH_S;
    if (step->now < link->detach_at) {
        step_due(step, link->detach_at);
        return NULL;
    }
    size_t cap = 0, n = 0;
    for (stria__node_t *x = link->reqs.next; x != &link->reqs; x = x->next)
        cap++;
    void **detached = calloc(cap, sizeof(*detached));
    for (stria__node_t *x = link->reqs.next; x != &link->reqs && detached != NULL;) {
        stria_link_req_t *r = STRIA__OF(x, stria_link_req_t, link_node);
        x = x->next;
        if (r->state == STRIA__REQ_POSTED && r->ucp_req != NULL) {
            detached[n++] = r->ucp_req;
            stria__ucx_req_finish_locked(r, link->fail_status, link->fail_msg);
        }
    }
    *n_out = n;
    return detached;
}

/* Gives the endpoints back (the link is CLOSED). */
static void unbind(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    stria__ucx_ep_t *out = link->out, *in = link->in;
    pthread_mutex_lock(&ctx->lock);
    if (link->out_bound)
        out->links--;
    if (link->in_bound)
        in->links--;
    link->out_bound = link->in_bound = false;
    link->out = link->in = NULL;
    link->state = STRIA__LINK_CLOSED;
    pthread_cond_broadcast(&ctx->cond);
    pthread_mutex_unlock(&ctx->lock);
    if (out != NULL)
        stria__ucx_ep_release(out);
    if (in != NULL)
        stria__ucx_ep_release(in);
}

/* DRAINING -> CLOSED once no request is left with UCX (detaching those UCX
 * keeps too long). */
static void step_drain(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, step_t *step)
{
    void **detached = NULL;
    size_t n_detached = 0;
    pthread_mutex_lock(&ctx->lock);
    if (busy_locked(link))
        detached = detach_locked(link, step, &n_detached);
    bool done = !busy_locked(link);
    pthread_mutex_unlock(&ctx->lock);
    if (n_detached > 0) {
        /* UCX keeps them (a rendezvous whose peer stopped); released, they
         * call nobody back. The peer may still read a detached send
         * buffer should it resume; its endpoint is closed, so nothing is
         * written into a detached receive buffer. */
        stria_log_warn("ucx link rank %d: UCX kept %zu requests after closing the endpoints; "
                       "handed back",
                       link->base.rank, n_detached);
        for (size_t i = 0; i < n_detached; i++)
            ucp_request_free(detached[i]);
        *step->any = true;
    }
    free(detached);
    if (done) {
        *step->any = true;
        unbind(ctx, link);
    }
}

/* Advances one link's life by one step. Returns when something is due next
 * (0: nothing). */
static double run_link(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, double now, bool *any)
{
    step_t step = {.now = now, .due = 0, .any = any};
    bool connect, destroy;
    stria__ucx_link_state_t st = step_begin(ctx, link, &step, &connect, &destroy);
    if (connect) {
        *any = true;
        stria__ucx_binds_claim(ctx, link);
    }
    if (state_live(st)) {
        step_sides(ctx, link, &step);
        pthread_mutex_lock(&ctx->lock);
        st = link->state;
        pthread_mutex_unlock(&ctx->lock);
    }
    if (st == STRIA__LINK_FAILED) {
        step_teardown(ctx, link, &step);
        st = STRIA__LINK_TORN_DOWN;
    }
    if (destroy && state_live(st)) {
        step_goodbye(ctx, link, &step);
        st = STRIA__LINK_CLOSING_GRACEFUL;
    }
    if (st == STRIA__LINK_TORN_DOWN || st == STRIA__LINK_CLOSING_GRACEFUL)
        st = step_reclaim(ctx, link, st, &step);
    if (state_live(st) && link->out_bound && link->in_bound)
        step_heartbeat(ctx, link, &step);
    if (st == STRIA__LINK_DRAINING)
        step_drain(ctx, link, &step);
    return step.due;
}

double stria__ucx_run_links(stria_ucx_ctx_t *ctx, bool *any)
{
    double due = 0, now = stria_time_now();
    size_t n_step = 0;

    /* Links are only freed by their owner once CLOSED, which only this
     * thread sets, so pointers taken under the lock stay valid here. */
    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *n = ctx->links.next; n != &ctx->links; n = n->next) {
        stria__ucx_link_t *l = STRIA__OF(n, stria__ucx_link_t, ctx_node);
        if (l->state == STRIA__LINK_CLOSED)
            continue;
        stria__ucx_link_t **t =
            stria_grow(ctx->step_links, &ctx->step_links_cap, n_step + 1, sizeof(*t), 16);
        if (t == NULL)
            break; /* the rest waits for the next round */
        ctx->step_links = t;
        ctx->step_links[n_step++] = l;
    }
    pthread_mutex_unlock(&ctx->lock);

    for (size_t i = 0; i < n_step; i++) {
        double d = run_link(ctx, ctx->step_links[i], now, any);
        if (d > 0 && (due == 0 || d < due))
            due = d;
    }
    return due;
}
