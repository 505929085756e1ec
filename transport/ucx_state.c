/*
 * A UCX link's life: its state (stria__ucx_link_state_t), failing it, and the
 * per-link step of the progress thread, one small function per concern:
 * connecting, retrying, settling a dropped connection, tearing down after a
 * failure, the graceful close, closing the endpoints, heartbeats, and
 * draining what UCX still holds before the link is CLOSED.
 *
 *   NEW -> CONNECTING -> READY -> CLOSING_GRACEFUL -> DRAINING -> CLOSED
 *   (any but CLOSED) -> FAILED -> TORN_DOWN -> DRAINING -> CLOSED
 */
#include "ucx_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ---- request and link state (ctx->lock held) ------------------------------------ */

/* ---- state (ctx->lock held) ------------------------------------------------------ */

void stria__ucx_req_finish_locked(stria_link_req_t *req, stria_status_t status, const char *msg)
{
    stria_ucx_ctx_t *ctx = req->link->ctx;
    if (req->state == STRIA__REQ_POSTED)
        ctx->in_flight--;
    req->state = STRIA__REQ_DONE;
    req->status = status;
    req->ucp_req = NULL;
    req->desc = NULL;
    if (msg != NULL)
        snprintf(req->msg, sizeof(req->msg), "%s", msg);
    if (req->abandoned) {
        stria__list_del(&req->link_node);
        free(req);
    }
    pthread_cond_broadcast(&ctx->cond);
}

void stria__ucx_link_fail_locked(stria__ucx_link_t *link, stria_status_t status, int origin,
                                 int notify_mask, const char *fmt, ...)
{
    if (link->failed)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(link->fail_msg, sizeof(link->fail_msg), fmt, ap);
    va_end(ap);
    link->failed = true;
    link->fail_status = status;
    link->notify_mask = notify_mask;
    link->notify_origin = origin;
    link->notify_reporter = link->base.rank;
    snprintf(link->notify_text, sizeof(link->notify_text), "%.400s", link->fail_msg);
    if (link->state != STRIA__LINK_CLOSED)
        link->state = STRIA__LINK_FAILED;
    stria_log_info("ucx link rank %d/%d (job %llu ring %llu) failed: %s", link->base.rank,
                   link->base.size, (unsigned long long)link->job_id,
                   (unsigned long long)link->ring_id, link->fail_msg);
    pthread_cond_broadcast(&link->ctx->cond);
}

stria_status_t stria__ucx_link_error_locked(const stria__ucx_link_t *link)
{
    return stria_error_set(link->fail_status, "%s", link->fail_msg);
}

void stria__ucx_link_peer_error_locked(stria__ucx_link_t *link, int side, const char *fmt, ...)
{
    if (link->failed || link->settle_at > 0)
        return;
    link->settle_side = side;
    link->settle_at = stria_time_now() + STRIA__UCX_SETTLE_S;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(link->settle_msg, sizeof(link->settle_msg), fmt, ap);
    va_end(ap);
}

void stria__ucx_link_up_locked(stria__ucx_link_t *link, int side)
{
    link->hb.nb[side].up = true;
    stria__ucx_hb_heard(&link->hb, side, stria_time_now());
    if (link->state == STRIA__LINK_CONNECTING && link->hb.nb[STRIA__FROM_PREV].up &&
        link->hb.nb[STRIA__FROM_NEXT].up)
        link->state = STRIA__LINK_READY;
}

/* Moves the link on from a state the progress thread saw, unless it failed
 * meanwhile: then the next step tears it down. */
static void stria__link_enter_locked(stria__ucx_link_t *link, stria__ucx_link_state_t to)
{
    if (link->state != STRIA__LINK_FAILED)
        link->state = to;
}

/* Logs when this link starts and stops believing a rank stalled, so that an
 * operator sees a stall as it happens, not only in the deadline it causes. */
static void stria__link_log_suspect_locked(stria__ucx_link_t *link, double now)
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

/* ---- progress-thread actions -------------------------------------------------------- */

void stria__ucx_link_ctrl_init(const stria__ucx_link_t *link, stria__ctrl_t *c, uint16_t type)
{
    memset(c, 0, sizeof(*c));
    c->type = type;
    c->job_id = link->job_id;
    c->ring_id = link->ring_id;
    c->rank = link->base.rank;
    c->size = link->base.size;
    c->origin = link->base.rank;
}

/* Creates the endpoint to the successor and sends the handshake. */
static void stria__link_connect_out(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    ucp_ep_params_t ep_params;
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                           UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep_params.sockaddr.addr = (const struct sockaddr *)&link->next_addr;
    ep_params.sockaddr.addrlen = link->next_addrlen;
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = stria__ucx_out_err_cb;
    ep_params.err_handler.arg = link;
    link->retry_at = 0;
    link->next_proven = false; /* a new endpoint proves the key anew */
    ucs_status_t s = ucp_ep_create(ctx->worker, &ep_params, &link->out_ep);
    if (s != UCS_OK) {
        link->out_ep = NULL;
        pthread_mutex_lock(&ctx->lock);
        stria__ucx_link_fail_locked(link, stria__ucx_status(s), stria_link_next(&link->base), 0,
                                    "cannot create an endpoint to successor rank %d at %s: %s",
                                    stria_link_next(&link->base), link->next_desc,
                                    ucs_status_string(s));
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    stria__ctrl_t hello;
    stria__ucx_link_ctrl_init(link, &hello, STRIA__CTRL_HELLO);
    /* A fresh nonce for every attempt: the successor's MAC must cover it. */
    if (stria_auth_random(link->nonce_c, sizeof(link->nonce_c)) != STRIA_OK) {
        pthread_mutex_lock(&ctx->lock);
        stria__ucx_link_fail_locked(link, STRIA_ERR_INTERNAL, link->base.rank, 0, "%s",
                                    stria_error_msg());
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    memcpy(hello.nonce, link->nonce_c, sizeof(hello.nonce));
    stria__ucx_ctrl_send(link->out_ep, &hello, &link->ctrl_pending);
}

static void stria__flush_cb(void *request, ucs_status_t status, void *user_data)
{
    stria__ucx_link_t *link = user_data;
    (void)status;
    link->flush_pending--;
    ucp_request_free(request);
}

/* Flushes both endpoints of a link; flush_pending counts the flushes. */
static void stria__link_flush_eps(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    ucp_ep_h eps[2] = {link->out_ep, link->in_conn != NULL ? link->in_conn->ep : NULL};
    (void)ctx;
    for (int i = 0; i < 2; i++) {
        if (eps[i] == NULL)
            continue;
        ucp_request_param_t param;
        memset(&param, 0, sizeof(param));
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = stria__flush_cb;
        param.user_data = link;
        void *r = ucp_ep_flush_nbx(eps[i], &param);
        if (r != NULL && !UCS_PTR_IS_ERR(r))
            link->flush_pending++;
    }
}

/* Releases the arrivals no receive took. */
static void stria__link_drop_unexp(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    stria__node_t drop;
    stria__list_init(&drop);
    pthread_mutex_lock(&ctx->lock);
    stria__list_splice(&drop, &link->unexp);
    link->unexp_bytes = 0;
    pthread_mutex_unlock(&ctx->lock);
    while (!stria__list_empty(&drop)) {
        stria__unexp_t *u = STRIA__OF(drop.next, stria__unexp_t, node);
        stria__list_del(&u->node);
        if (u->desc != NULL)
            ucp_am_data_release(ctx->worker, u->desc);
        free(u->copy);
        free(u);
    }
}

/* FAILED -> TORN_DOWN: sends the failure notices, finishes unmatched
 * receives, drops early arrivals and schedules the endpoints' forced close. */
static void stria__link_teardown(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    stria__ctrl_t notice;

    pthread_mutex_lock(&ctx->lock);
    stria__ucx_link_ctrl_init(link, &notice, STRIA__CTRL_ABORT);
    notice.status = link->fail_status;
    notice.origin = link->notify_origin;
    notice.slot = (uint32_t)link->notify_reporter;
    snprintf(notice.text, sizeof(notice.text), "%s", link->notify_text);
    int mask = link->notify_mask;
    bool next_up = link->hb.nb[STRIA__FROM_NEXT].up;
    while (!stria__list_empty(&link->posted)) {
        stria_link_req_t *req = STRIA__OF(link->posted.next, stria_link_req_t, queue_node);
        stria__list_del(&req->queue_node);
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
    }
    link->state = STRIA__LINK_TORN_DOWN;
    pthread_mutex_unlock(&ctx->lock);

    if ((mask & STRIA__NOTIFY_NEXT) && link->out_ep != NULL && next_up)
        stria__ucx_ctrl_send(link->out_ep, &notice, &link->ctrl_pending);
    if ((mask & STRIA__NOTIFY_PREV) && link->in_conn != NULL)
        stria__ucx_ctrl_send(link->in_conn->ep, &notice, &link->in_conn->ctrl_pending);
    stria__link_drop_unexp(ctx, link);
    link->retry_at = 0;
    stria__link_flush_eps(ctx, link);
    link->close_at = stria_time_now() + STRIA__UCX_NOTIFY_GRACE_S;
}

void stria__ucx_link_close_eps(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, int mask, bool force)
{
    if ((mask & STRIA__NOTIFY_NEXT) && link->out_ep != NULL) {
        ucp_ep_h ep = link->out_ep;
        link->out_ep = NULL;
        stria__ucx_ep_close(ctx, ep, force, link, NULL);
    }
    if ((mask & STRIA__NOTIFY_PREV) && link->in_conn != NULL) {
        stria__ucx_conn_t *conn = link->in_conn;
        pthread_mutex_lock(&ctx->lock);
        link->in_conn = NULL;
        conn->link = NULL;
        pthread_mutex_unlock(&ctx->lock);
        conn->closing = true;
        stria__ucx_ep_close(ctx, conn->ep, force, link, conn);
    }
}

/* Whether the link still has requests the progress thread or UCX holds. */
static bool stria__link_busy_locked(const stria__ucx_link_t *link)
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
} stria__step_t;

static void stria__step_due(stria__step_t *step, double t)
{
    if (step->due == 0 || t < step->due)
        step->due = t;
}

static bool stria__state_live(stria__ucx_link_state_t st)
{
    return st == STRIA__LINK_CONNECTING || st == STRIA__LINK_READY;
}

/* Under the lock: fails the link once a dropped connection has settled,
 * takes the owner's destroy request, and moves NEW on to CONNECTING. Returns
 * the state the rest of the step works from. */
static stria__ucx_link_state_t stria__ucx_step_begin(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link,
                                                     stria__step_t *step, bool *connect,
                                                     bool *destroy)
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

/* NEW -> CONNECTING: connects to the successor and claims a predecessor's
 * connection that arrived before the link. */
static void stria__step_connect(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, stria__step_t *step)
{
    *step->any = true;
    stria__link_connect_out(ctx, link);
    for (stria__node_t *n = ctx->conns.next; n != &ctx->conns;) {
        stria__ucx_conn_t *c = STRIA__OF(n, stria__ucx_conn_t, node);
        n = n->next;
        stria__ucx_conn_try_claim(ctx, c);
    }
}

/* CONNECTING: connects to the successor again when its retry is due. */
static void stria__step_retry(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, stria__step_t *step)
{
    if (step->now >= link->retry_at) {
        *step->any = true;
        stria__link_connect_out(ctx, link);
    } else {
        stria__step_due(step, link->retry_at);
    }
}

/* CONNECTING or READY -> CLOSING_GRACEFUL, on the owner's destroy: goodbye
 * on both endpoints, then (stria__step_close) closed. */
static stria__ucx_link_state_t stria__step_goodbye(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link,
                                                   stria__step_t *step)
{
    *step->any = true;
    pthread_mutex_lock(&ctx->lock);
    stria__link_enter_locked(link, STRIA__LINK_CLOSING_GRACEFUL);
    pthread_mutex_unlock(&ctx->lock);
    link->retry_at = 0;
    /* The peers close their side when they have handled it; ours close
     * then (or after the grace), so the goodbye is never overtaken by the
     * disconnect. */
    stria__ctrl_t bye;
    stria__ucx_link_ctrl_init(link, &bye, STRIA__CTRL_BYE);
    if (link->out_ep != NULL)
        stria__ucx_ctrl_send(link->out_ep, &bye, &link->ctrl_pending);
    if (link->in_conn != NULL)
        stria__ucx_ctrl_send(link->in_conn->ep, &bye, &link->in_conn->ctrl_pending);
    stria__link_drop_unexp(ctx, link);
    link->close_at = step->now + STRIA__UCX_CLOSE_GRACE_S;
    return STRIA__LINK_CLOSING_GRACEFUL;
}

/* TORN_DOWN or CLOSING_GRACEFUL -> DRAINING: closes the endpoints by force
 * once they are gone or flushed (after a failure), or at close_at. */
static stria__ucx_link_state_t stria__step_close(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link,
                                                 stria__ucx_link_state_t st, stria__step_t *step)
{
    bool gone = link->out_ep == NULL && link->in_conn == NULL;
    if (!gone && step->now < link->close_at &&
        !(st == STRIA__LINK_TORN_DOWN && link->flush_pending == 0)) {
        stria__step_due(step, link->close_at);
        return st;
    }
    *step->any = true;
    link->close_at = 0;
    pthread_mutex_lock(&ctx->lock);
    stria__link_enter_locked(link, STRIA__LINK_DRAINING);
    pthread_mutex_unlock(&ctx->lock);
    /* Forced: a peer that does not answer must not hold the close (every
     * endpoint is in peer error mode on both sides). */
    stria__ucx_link_close_eps(ctx, link, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV, true);
    return STRIA__LINK_DRAINING;
}

/* CONNECTING or READY with both endpoints: heartbeats to both neighbours,
 * each passing on what came from the other side. */
static void stria__step_heartbeat(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link,
                                  stria__step_t *step)
{
    if (step->now >= link->next_ping) {
        stria__ctrl_t ping[2];
        pthread_mutex_lock(&ctx->lock);
        for (int d = 0; d < 2; d++) {
            int reporter;
            int32_t silence_ms;
            stria__ucx_link_ctrl_init(link, &ping[d], STRIA__CTRL_PING);
            ping[d].origin = stria__ucx_hb_ping(&link->hb, step->now, d, &reporter, &silence_ms);
            ping[d].slot = (uint32_t)reporter;
            ping[d].status = silence_ms;
        }
        stria__link_log_suspect_locked(link, step->now);
        pthread_mutex_unlock(&ctx->lock);
        /* A stalled peer stops reading: do not pile heartbeats up. */
        if (link->ctrl_pending < 4)
            stria__ucx_ctrl_send(link->out_ep, &ping[STRIA__FROM_PREV], &link->ctrl_pending);
        if (link->in_conn->ctrl_pending < 4)
            stria__ucx_ctrl_send(link->in_conn->ep, &ping[STRIA__FROM_NEXT],
                                 &link->in_conn->ctrl_pending);
        link->next_ping = step->now + ctx->ping_s;
    }
    stria__step_due(step, link->next_ping);
}

/* DRAINING, lock held: finishes the requests UCX still holds
 * STRIA__UCX_DETACH_S after the close and returns them (n_out) to be handed
 * back to UCX. */
static void **stria__link_detach_locked(stria__ucx_link_t *link, stria__step_t *step, size_t *n_out)
{
    if (link->detach_at == 0)
        link->detach_at = step->now + STRIA__UCX_DETACH_S;
    if (step->now < link->detach_at) {
        stria__step_due(step, link->detach_at);
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

/* DRAINING -> CLOSED once the endpoints are closed, flushed and no request
 * is left with UCX (detaching those UCX keeps too long). */
static void stria__step_drain(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link,
                              stria__ucx_link_state_t st, stria__step_t *step)
{
    void **detached = NULL;
    size_t n_detached = 0;
    pthread_mutex_lock(&ctx->lock);
    bool quiet = st == STRIA__LINK_DRAINING && link->out_ep == NULL && link->in_conn == NULL &&
                 link->eps_closing == 0 && link->flush_pending == 0;
    if (quiet && stria__link_busy_locked(link))
        detached = stria__link_detach_locked(link, step, &n_detached);
    if (quiet && !stria__link_busy_locked(link)) {
        stria__ucx_events_forget(ctx, link);
        link->state = STRIA__LINK_CLOSED;
        *step->any = true;
        pthread_cond_broadcast(&ctx->cond);
    }
    pthread_mutex_unlock(&ctx->lock);
    if (n_detached > 0) {
        /* UCX keeps them (a rendezvous whose peer stopped); released, they
         * call nobody back. The peer may still read a detached send
         * buffer should it resume; its connections are closed, so nothing
         * is written into a detached receive buffer. */
        stria_log_warn("ucx link rank %d: UCX kept %zu requests after closing the endpoints; "
                       "handed back",
                       link->base.rank, n_detached);
        for (size_t i = 0; i < n_detached; i++)
            ucp_request_free(detached[i]);
        *step->any = true;
    }
    free(detached);
}

/* Advances one link's life by one step. Returns when something is due next
 * (0: nothing). */
static double stria__run_link(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, double now, bool *any)
{
    stria__step_t step = {.now = now, .due = 0, .any = any};
    bool connect, destroy;
    stria__ucx_link_state_t st = stria__ucx_step_begin(ctx, link, &step, &connect, &destroy);
    if (connect)
        stria__step_connect(ctx, link, &step);
    if (stria__state_live(st) && link->retry_at > 0)
        stria__step_retry(ctx, link, &step);
    if (st == STRIA__LINK_FAILED) {
        *any = true;
        stria__link_teardown(ctx, link);
        st = STRIA__LINK_TORN_DOWN;
    }
    if (destroy && stria__state_live(st))
        st = stria__step_goodbye(ctx, link, &step);
    if (st == STRIA__LINK_TORN_DOWN || st == STRIA__LINK_CLOSING_GRACEFUL)
        st = stria__step_close(ctx, link, st, &step);
    if (stria__state_live(st) && link->out_ep != NULL && link->in_conn != NULL)
        stria__step_heartbeat(ctx, link, &step);
    stria__step_drain(ctx, link, st, &step);
    return step.due;
}

/* Advances every link. Returns the earliest time something is due (0: none). */
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
        double d = stria__run_link(ctx, ctx->step_links[i], now, any);
        if (d > 0 && (due == 0 || d < due))
            due = d;
    }
    return due;
}
