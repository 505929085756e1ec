/*
 * The progress thread of a UCX context: the UCX callbacks (they only record
 * what they saw, or complete requests under ctx->lock), the handling of what
 * they recorded after ucp_worker_progress() returns (connection requests,
 * handshakes, acknowledgements, notices, endpoint errors), the posting of
 * queued requests, and the thread's loop. Every UCX call after setup is made
 * here or in ucx_state.c, on this thread.
 */
#include "ucx_int.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

/* An endpoint close in flight. */
typedef struct {
    stria__ucx_link_t *link; /* decrement link->eps_closing when done */
    stria__ucx_conn_t *conn; /* free the conn when done */
    stria_ucx_ctx_t *ctx;
} stria__closing_t;

/* A control message being sent; freed by its completion. */
typedef struct {
    int *pending;
    uint8_t buf[STRIA__UCX_CTRL_MAX];
} stria__ctrl_send_t;

stria_status_t stria__ucx_status(ucs_status_t s)
{
    switch (s) {
    case UCS_OK:
        return STRIA_OK;
    case UCS_ERR_NO_MEMORY:
        return STRIA_ERR_NO_MEMORY;
    case UCS_ERR_CANCELED:
        return STRIA_ERR_CANCELLED;
    case UCS_ERR_TIMED_OUT:
        return STRIA_ERR_TIMEOUT;
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
        return STRIA_ERR_PEER;
    case UCS_ERR_MESSAGE_TRUNCATED:
        return STRIA_ERR_PROTOCOL;
    case UCS_ERR_BUSY:
        return STRIA_ERR_BUSY;
    default:
        return STRIA_ERR_TRANSPORT;
    }
}

static bool stria__ucs_is_peer_error(ucs_status_t s)
{
    return s == UCS_ERR_CONNECTION_RESET || s == UCS_ERR_ENDPOINT_TIMEOUT ||
           s == UCS_ERR_UNREACHABLE || s == UCS_ERR_NOT_CONNECTED || s == UCS_ERR_IO_ERROR ||
           s == UCS_ERR_REJECTED || s == UCS_ERR_CANCELED;
}

/* ---- UCX callbacks (progress thread, inside ucp_worker_progress) ---------------- */

static void stria__event_push(stria_ucx_ctx_t *ctx, stria__event_t *ev)
{
    stria__list_push(&ctx->events, &ev->node);
}

void stria__ucx_conn_req_cb(ucp_conn_request_h conn_request, void *arg)
{
    stria_ucx_ctx_t *ctx = arg;
    stria__event_t *ev = calloc(1, sizeof(*ev));
    if (ev == NULL) {
        ucp_listener_reject(ctx->listener, conn_request);
        return;
    }
    ev->type = STRIA__EV_CONN_REQ;
    ev->conn_req = conn_request;
    stria__event_push(ctx, ev);
}

/* Records an endpoint error of a link (successor) or a connection. */
static void stria__err_event(stria_ucx_ctx_t *ctx, stria__ev_type_t type, void *obj, ucp_ep_h ep,
                             ucs_status_t status)
{
    stria__event_t *ev = calloc(1, sizeof(*ev));
    if (ev == NULL)
        return;
    ev->type = type;
    ev->ep = ep;
    ev->obj = obj;
    ev->status = status;
    stria__event_push(ctx, ev);
}

void stria__ucx_out_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    stria__ucx_link_t *link = arg;
    stria__err_event(link->ctx, STRIA__EV_OUT_ERR, link, ep, status);
}

void stria__ucx_in_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    stria__ucx_conn_t *conn = arg;
    stria__err_event(conn->ctx, STRIA__EV_IN_ERR, conn, ep, status);
}

ucs_status_t stria__ucx_am_ctrl_cb(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param)
{
    stria_ucx_ctx_t *ctx = arg;
    (void)header;
    (void)header_length;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        stria_log_warn("ucx link: dropping a rendezvous control message");
        return UCS_ERR_UNSUPPORTED;
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
        stria_log_warn("ucx link: dropping a control message without a reply endpoint");
        return UCS_OK;
    }
    stria__event_t *ev = calloc(1, sizeof(*ev));
    if (ev == NULL)
        return UCS_OK;
    if (stria__ucx_ctrl_decode(data, length, &ev->ctrl) != STRIA_OK) {
        stria_log_warn("ucx link: dropping a control message: %s", stria_error_msg());
        free(ev);
        return UCS_OK;
    }
    ev->type = STRIA__EV_CTRL;
    ev->ep = param->reply_ep;
    stria__event_push(ctx, ev);
    return UCS_OK;
}

static void stria__data_recv_cb(void *request, ucs_status_t status, size_t length, void *user_data);

ucs_status_t stria__ucx_am_data_cb(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param)
{
    stria_ucx_ctx_t *ctx = arg;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    bool keep = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
    ucs_status_t drop = rndv ? UCS_ERR_CANCELED : UCS_OK;

    if (header_length != STRIA__UCX_DATA_HDR) {
        stria_log_warn("ucx link: dropping a data message with a %zu-byte header", header_length);
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    uint32_t slot;
    uint64_t tag;
    stria__ucx_data_hdr_decode(header, &slot, &tag);

    pthread_mutex_lock(&ctx->lock);
    stria__ucx_link_t *link = slot < STRIA__UCX_SLOTS ? ctx->slots[slot] : NULL;
    /* Only the endpoint that completed this slot's handshake may fill its
     * receives (link->in_conn is set there, on this thread). */
    bool from_peer = link != NULL && link->in_conn != NULL &&
                     (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) &&
                     param->reply_ep == link->in_conn->ep;
    if (link == NULL || !from_peer) {
        uint64_t dropped = ++ctx->stats.data_dropped;
        pthread_mutex_unlock(&ctx->lock);
        if (dropped == 1 || dropped % 1000 == 0)
            stria_log_warn("ucx link: dropped a data block for slot %u from an endpoint that did "
                           "not complete its handshake (%llu so far)",
                           slot, (unsigned long long)dropped);
        return drop;
    }
    if (link->failed) {
        pthread_mutex_unlock(&ctx->lock);
        return drop;
    }
    stria__ucx_hb_heard(&link->hb, STRIA__FROM_PREV, stria_time_now());
    stria_link_req_t *req = NULL;
    for (stria__node_t *n = link->posted.next; n != &link->posted; n = n->next) {
        stria_link_req_t *r = STRIA__OF(n, stria_link_req_t, queue_node);
        if (r->tag == tag) {
            req = r;
            break;
        }
    }
    if (req != NULL) {
        stria__list_del(&req->queue_node);
        if (length != req->len) {
            stria__ucx_link_fail_locked(
                link, STRIA_ERR_PROTOCOL, stria_link_prev(&link->base),
                STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                "message tag %#llx from rank %d has %zu bytes, the receive expects %zu",
                (unsigned long long)tag, stria_link_prev(&link->base), length, req->len);
            stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
            pthread_mutex_unlock(&ctx->lock);
            return rndv ? UCS_ERR_MESSAGE_TRUNCATED : UCS_OK;
        }
        req->matched = true;
        if (rndv) {
            /* Started after progress returns, outside this callback. */
            req->desc = data;
            stria__list_push(&ctx->starts, &req->queue_node);
            pthread_mutex_unlock(&ctx->lock);
            return UCS_INPROGRESS;
        }
        if (length > 0)
            memcpy(req->buf, data, length);
        stria__ucx_req_finish_locked(req, STRIA_OK, NULL);
        pthread_mutex_unlock(&ctx->lock);
        return UCS_OK;
    }

    /* No receive yet: keep the arrival. */
    if (!rndv && link->unexp_bytes + length > STRIA__UCX_UNEXP_MAX) {
        stria__ucx_link_fail_locked(link, STRIA_ERR_PROTOCOL, stria_link_prev(&link->base),
                                    STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                                    "rank %d sent more than %u bytes of small messages nobody "
                                    "receives",
                                    stria_link_prev(&link->base), STRIA__UCX_UNEXP_MAX);
        pthread_mutex_unlock(&ctx->lock);
        return UCS_OK;
    }
    stria__unexp_t *u = calloc(1, sizeof(*u));
    if (u != NULL && !rndv && !keep && length > 0) {
        u->copy = malloc(length);
        if (u->copy == NULL) {
            free(u);
            u = NULL;
        } else {
            memcpy(u->copy, data, length);
        }
    }
    if (u == NULL) {
        stria__ucx_link_fail_locked(link, STRIA_ERR_NO_MEMORY, link->base.rank,
                                    STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                                    "out of memory keeping an early message");
        pthread_mutex_unlock(&ctx->lock);
        return drop;
    }
    u->tag = tag;
    u->len = length;
    u->rndv = rndv;
    if (rndv || keep)
        u->desc = data;
    if (!rndv)
        link->unexp_bytes += length;
    stria__list_push(&link->unexp, &u->node);
    pthread_mutex_unlock(&ctx->lock);
    return (rndv || keep) ? UCS_INPROGRESS : UCS_OK;
}

/* Completion of a UCX data request (send or rendezvous receive). */
static void stria__data_done(stria_link_req_t *req, ucs_status_t status, size_t length)
{
    stria__ucx_link_t *link = req->link;
    stria_ucx_ctx_t *ctx = link->ctx;
    pthread_mutex_lock(&ctx->lock);
    if (status == UCS_OK && !req->is_send && length != req->len) {
        stria__ucx_link_fail_locked(
            link, STRIA_ERR_PROTOCOL, stria_link_prev(&link->base),
            STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "message tag %#llx from rank %d delivered %zu bytes, expected %zu",
            (unsigned long long)req->tag, stria_link_prev(&link->base), length, req->len);
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
    } else if (status == UCS_OK) {
        stria__ucx_req_finish_locked(req, STRIA_OK, NULL);
    } else if (link->failed) {
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
    } else if (link->hb.nb[req->is_send ? STRIA__FROM_NEXT : STRIA__FROM_PREV].bye) {
        char msg[200];
        int peer = req->is_send ? stria_link_next(&link->base) : stria_link_prev(&link->base);
        snprintf(msg, sizeof(msg), "rank %d left the ring before the %s of tag %#llx completed",
                 peer, stria__req_kind(req), (unsigned long long)req->tag);
        stria__ucx_req_finish_locked(req, STRIA_ERR_CLOSED, msg);
    } else if (stria__ucs_is_peer_error(status)) {
        /* The link's failure (and this request's message) is decided when
         * the connection's fate has settled; see stria__ucx_wait(). */
        int peer = req->is_send ? stria_link_next(&link->base) : stria_link_prev(&link->base);
        stria__ucx_link_peer_error_locked(
            link, req->is_send ? STRIA__NOTIFY_NEXT : STRIA__NOTIFY_PREV,
            "rank %d (%s) failed during the %s of tag %#llx: %s", peer,
            req->is_send ? "successor" : "predecessor", stria__req_kind(req),
            (unsigned long long)req->tag, ucs_status_string(status));
        stria__ucx_req_finish_locked(req, STRIA_ERR_PEER, "");
    } else {
        int peer = req->is_send ? stria_link_next(&link->base) : stria_link_prev(&link->base);
        stria__ucx_link_fail_locked(
            link, stria__ucx_status(status), peer, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "%s of tag %#llx %s rank %d (%s) failed: %s", stria__req_kind(req),
            (unsigned long long)req->tag, req->is_send ? "to" : "from", peer,
            req->is_send ? "successor" : "predecessor", ucs_status_string(status));
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
    }
    pthread_mutex_unlock(&ctx->lock);
}

static void stria__data_send_cb(void *request, ucs_status_t status, void *user_data)
{
    stria__data_done(user_data, status, 0);
    ucp_request_free(request);
}

static void stria__data_recv_cb(void *request, ucs_status_t status, size_t length, void *user_data)
{
    stria__data_done(user_data, status, length);
    ucp_request_free(request);
}

static void stria__ctrl_send_cb(void *request, ucs_status_t status, void *user_data)
{
    stria__ctrl_send_t *cs = user_data;
    (void)status;
    (*cs->pending)--;
    free(cs);
    ucp_request_free(request);
}

/* Drops recorded endpoint errors of an object about to be freed (its
 * endpoint may have failed and been closed in the same progress round). */
void stria__ucx_events_forget(stria_ucx_ctx_t *ctx, const void *obj)
{
    for (stria__node_t *n = ctx->events.next; n != &ctx->events;) {
        stria__event_t *ev = STRIA__OF(n, stria__event_t, node);
        n = n->next;
        if (ev->obj == obj) {
            stria__list_del(&ev->node);
            free(ev);
        }
    }
}

static void stria__close_done(stria__closing_t *cl)
{
    stria_ucx_ctx_t *ctx = cl->ctx;
    ctx->closing--;
    if (cl->link != NULL)
        cl->link->eps_closing--;
    if (cl->conn != NULL) {
        stria__ucx_events_forget(ctx, cl->conn);
        stria__list_del(&cl->conn->node);
        ctx->n_conns--;
        free(cl->conn);
    }
    free(cl);
}

static void stria__close_cb(void *request, ucs_status_t status, void *user_data)
{
    (void)status;
    stria__close_done(user_data);
    ucp_request_free(request);
}

/* ---- progress-thread actions ------------------------------------------------------ */

/* Starts closing an endpoint; the closing record tells whom to update. */
void stria__ucx_ep_close(stria_ucx_ctx_t *ctx, ucp_ep_h ep, bool force, stria__ucx_link_t *link,
                         stria__ucx_conn_t *conn)
{
    stria__closing_t *cl = calloc(1, sizeof(*cl));
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    if (cl != NULL) {
        cl->ctx = ctx;
        cl->link = link;
        cl->conn = conn;
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = stria__close_cb;
        param.user_data = cl;
    }
    ctx->closing++;
    if (link != NULL)
        link->eps_closing++;
    void *r = ucp_ep_close_nbx(ep, &param);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        if (cl != NULL) {
            stria__close_done(cl);
        } else {
            ctx->closing--;
            if (link != NULL)
                link->eps_closing--;
        }
    } else if (cl == NULL) {
        /* Without a record nobody would be told; wait here (rare: no memory). */
        while (ucp_request_check_status(r) == UCS_INPROGRESS)
            ucp_worker_progress(ctx->worker);
        ucp_request_free(r);
        ctx->closing--;
        if (link != NULL)
            link->eps_closing--;
    }
}

/* The parameters of an active-message send that completes through cb. */
static ucp_request_param_t stria__am_send_param(ucp_send_nbx_callback_t cb, void *user_data,
                                                uint32_t flags)
{
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = cb;
    param.user_data = user_data;
    param.flags = flags;
    return param;
}

/* Sends a control message; the pending counter tracks its completion. */
void stria__ucx_ctrl_send(ucp_ep_h ep, const stria__ctrl_t *c, int *pending)
{
    stria__ctrl_send_t *cs = malloc(sizeof(*cs));
    if (cs == NULL)
        return;
    size_t len = stria__ucx_ctrl_encode(c, cs->buf);
    cs->pending = pending;
    ucp_request_param_t param = stria__am_send_param(
        stria__ctrl_send_cb, cs, UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER);
    (*pending)++;
    void *r = ucp_am_send_nbx(ep, STRIA__UCX_AM_CTRL, NULL, 0, cs->buf, len, &param);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        if (UCS_PTR_IS_ERR(r))
            stria_log_debug("ucx link: control message not sent: %s",
                            ucs_status_string(UCS_PTR_STATUS(r)));
        (*pending)--;
        free(cs);
    }
}

/* A neighbour destroyed its link after finishing its requests: the side
 * towards it is closed. What it sent before stays receivable; receives it
 * cannot satisfy fail with STRIA_ERR_CLOSED, and so do sends to it. Closing
 * our endpoint tells it we are done with the connection. */
static void stria__handle_bye(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, int from_mask)
{
    pthread_mutex_lock(&ctx->lock);
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
    pthread_cond_broadcast(&ctx->cond);
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_link_close_eps(ctx, link, from_mask, true);
}

/* ABORT, BYE or PING from a neighbour: ABORT fails the link and is passed
 * on; every message shows the neighbour is alive. */
static void stria__handle_notice(stria_ucx_ctx_t *ctx, ucp_ep_h ep, const stria__ctrl_t *c)
{
    stria__ucx_link_t *link = stria__ucx_link_by_out_ep(ctx, ep);
    int from_mask = STRIA__NOTIFY_NEXT; /* came from the successor */
    if (link == NULL) {
        stria__ucx_conn_t *conn = stria__ucx_conn_by_ep(ctx, ep);
        if (conn == NULL || conn->link == NULL)
            return;
        link = conn->link;
        from_mask = STRIA__NOTIFY_PREV;
    }
    if (c->job_id != link->job_id || c->ring_id != link->ring_id)
        return;
    int forward = (STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV) & ~from_mask;
    int side = from_mask == STRIA__NOTIFY_PREV ? STRIA__FROM_PREV : STRIA__FROM_NEXT;
    double now = stria_time_now();
    pthread_mutex_lock(&ctx->lock);
    stria__ucx_hb_heard(&link->hb, side, now);
    if (c->type == STRIA__CTRL_PING) {
        /* A heartbeat's origin names the rank its sender (or someone
         * before it) found silent, its slot the rank that saw it, its
         * status the silence in ms. */
        stria__ucx_hb_report(&link->hb, side, now, (int)c->origin, c->slot, (int)c->rank,
                             c->status);
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    if (c->type == STRIA__CTRL_BYE) {
        pthread_mutex_unlock(&ctx->lock);
        stria__handle_bye(ctx, link, from_mask);
        return;
    }
    if (!link->failed) {
        /* Every failure seen from elsewhere is STRIA_ERR_PEER; the text
         * says what happened and names the rank at fault. An abort's slot
         * field carries the rank that first reported it. */
        int reporter = c->slot < (uint32_t)link->base.size ? (int)c->slot : (int)c->rank;
        if (c->origin != reporter)
            stria__ucx_link_fail_locked(link, STRIA_ERR_PEER, (int)c->origin, forward,
                                        "%s (reported by rank %d)", c->text, reporter);
        else
            stria__ucx_link_fail_locked(link, STRIA_ERR_PEER, (int)c->origin, forward, "%s",
                                        c->text);
        /* Passed on unchanged. */
        link->notify_reporter = reporter;
        snprintf(link->notify_text, sizeof(link->notify_text), "%s", c->text);
    }
    pthread_mutex_unlock(&ctx->lock);
}

static void stria__handle_out_err(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, ucp_ep_h ep,
                                  ucs_status_t status)
{
    if (link->out_ep != ep)
        return; /* an endpoint of an earlier attempt */
    int next = stria_link_next(&link->base);
    bool retry = false;
    pthread_mutex_lock(&ctx->lock);
    bool next_up = link->hb.nb[STRIA__FROM_NEXT].up;
    if (link->state == STRIA__LINK_CLOSING_GRACEFUL || link->hb.nb[STRIA__FROM_NEXT].bye) {
        /* The successor closed its side after our goodbye or its own. */
    } else if (!next_up && !link->failed && stria_time_now() < link->connect_deadline &&
               (status == UCS_ERR_UNREACHABLE || status == UCS_ERR_CONNECTION_RESET ||
                status == UCS_ERR_REJECTED || status == UCS_ERR_NOT_CONNECTED ||
                status == UCS_ERR_ENDPOINT_TIMEOUT || status == UCS_ERR_IO_ERROR)) {
        retry = true;
    } else if (next_up && !link->failed) {
        /* Kept open until the failure settles, so that a notice still on
         * its way over this connection is read. */
        stria__ucx_link_peer_error_locked(link, STRIA__NOTIFY_NEXT,
                                          "rank %d (successor at %s) failed: %s", next,
                                          link->next_desc, ucs_status_string(status));
        pthread_mutex_unlock(&ctx->lock);
        return;
    } else {
        stria__ucx_link_fail_locked(link, STRIA_ERR_PEER, next, STRIA__NOTIFY_PREV,
                                    "rank %d (successor at %s) failed: %s", next, link->next_desc,
                                    ucs_status_string(status));
    }
    pthread_mutex_unlock(&ctx->lock);
    link->out_ep = NULL;
    stria__ucx_ep_close(ctx, ep, true, link, NULL);
    if (retry) {
        if (link->retry_delay <= 0)
            link->retry_delay = 0.05;
        link->retry_at = stria_time_now() + link->retry_delay;
        link->retry_delay = link->retry_delay * 2 > 1.0 ? 1.0 : link->retry_delay * 2;
        stria_log_debug("ucx link rank %d: successor at %s not reachable (%s), retrying",
                        link->base.rank, link->next_desc, ucs_status_string(status));
    }
}

static void stria__handle_in_err(stria_ucx_ctx_t *ctx, stria__ucx_conn_t *conn, ucs_status_t status)
{
    if (conn->closing)
        return;
    stria__ucx_link_t *link = conn->link;
    if (link != NULL) {
        int prev = stria_link_prev(&link->base);
        pthread_mutex_lock(&ctx->lock);
        if (link->state != STRIA__LINK_CLOSING_GRACEFUL && !link->hb.nb[STRIA__FROM_PREV].bye &&
            !link->failed) {
            /* Kept open until the failure settles (see the successor's). */
            stria__ucx_link_peer_error_locked(link, STRIA__NOTIFY_PREV,
                                              "rank %d (predecessor at %s) failed: %s", prev,
                                              conn->peer, ucs_status_string(status));
            pthread_mutex_unlock(&ctx->lock);
            return;
        }
        link->in_conn = NULL;
        conn->link = NULL;
        pthread_mutex_unlock(&ctx->lock);
        conn->closing = true;
        stria__ucx_ep_close(ctx, conn->ep, true, link, conn);
    } else {
        stria_log_debug("ucx link: connection from %s dropped: %s", conn->peer,
                        ucs_status_string(status));
        conn->closing = true;
        stria__ucx_ep_close(ctx, conn->ep, true, NULL, conn);
    }
}

/* Handles what the callbacks recorded. Returns whether there was anything. */
bool stria__ucx_run_events(stria_ucx_ctx_t *ctx)
{
    bool any = false;
    while (!stria__list_empty(&ctx->events)) {
        stria__node_t *n = ctx->events.next;
        stria__list_del(n);
        stria__event_t *ev = STRIA__OF(n, stria__event_t, node);
        any = true;
        switch (ev->type) {
        case STRIA__EV_CONN_REQ:
            stria__ucx_handle_conn_req(ctx, ev->conn_req);
            break;
        case STRIA__EV_CTRL:
            if (ev->ctrl.type == STRIA__CTRL_HELLO) {
                stria__ucx_conn_t *conn = stria__ucx_conn_by_ep(ctx, ev->ep);
                if (conn == NULL) {
                    stria_log_debug("ucx link: handshake on an unknown endpoint");
                } else if (conn->have_hello) {
                    stria_log_warn("ucx link: second handshake from %s; closing it", conn->peer);
                    stria__handle_in_err(ctx, conn, UCS_ERR_INVALID_PARAM);
                } else {
                    conn->hello = ev->ctrl;
                    conn->have_hello = true;
                    stria__ucx_conn_try_claim(ctx, conn);
                }
            } else if (ev->ctrl.type == STRIA__CTRL_PROOF) {
                stria__ucx_conn_t *conn = stria__ucx_conn_by_ep(ctx, ev->ep);
                if (conn != NULL)
                    stria__ucx_handle_proof(ctx, conn, &ev->ctrl);
            } else if (ev->ctrl.type == STRIA__CTRL_CHALLENGE) {
                stria__ucx_handle_challenge(ctx, ev->ep, &ev->ctrl);
            } else if (ev->ctrl.type == STRIA__CTRL_ACK) {
                stria__ucx_handle_ack(ctx, ev->ep, &ev->ctrl);
            } else {
                stria__handle_notice(ctx, ev->ep, &ev->ctrl);
            }
            break;
        case STRIA__EV_OUT_ERR:
            stria__handle_out_err(ctx, ev->obj, ev->ep, ev->status);
            break;
        case STRIA__EV_IN_ERR:
            stria__handle_in_err(ctx, ev->obj, ev->status);
            break;
        }
        free(ev);
    }
    return any;
}

/* Starts the transfer of a matched rendezvous receive. */
static void stria__recv_start(stria_ucx_ctx_t *ctx, stria_link_req_t *req, void *desc)
{
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv_am = stria__data_recv_cb;
    param.user_data = req;
    void *r = ucp_am_recv_data_nbx(ctx->worker, desc, req->buf, req->len, &param);
    if (r == NULL) {
        stria__data_done(req, UCS_OK, req->len);
    } else if (UCS_PTR_IS_ERR(r)) {
        stria__data_done(req, UCS_PTR_STATUS(r), 0);
    } else {
        req->ucp_req = r;
    }
}

static void stria__send_start(stria_ucx_ctx_t *ctx, stria_link_req_t *req)
{
    stria__ucx_link_t *link = req->link;
    (void)ctx;
    if (link->out_ep == NULL) {
        stria__data_done(req, UCS_ERR_NOT_CONNECTED, 0);
        return;
    }
    /* The reply flag names our endpoint to the receiver, which takes data
     * only from the endpoint that completed the handshake. */
    ucp_request_param_t param = stria__am_send_param(
        stria__data_send_cb, req,
        UCP_AM_SEND_FLAG_REPLY | (req->len >= STRIA__UCX_RNDV_MIN ? UCP_AM_SEND_FLAG_RNDV : 0));
    void *r = ucp_am_send_nbx(link->out_ep, STRIA__UCX_AM_DATA, req->hdr, STRIA__UCX_DATA_HDR,
                              req->buf, req->len, &param);
    if (r == NULL) {
        stria__data_done(req, UCS_OK, 0);
    } else if (UCS_PTR_IS_ERR(r)) {
        stria__data_done(req, UCS_PTR_STATUS(r), 0);
    } else {
        req->ucp_req = r;
    }
}

/* Frees an arrival once a receive has taken it (or refused it); called with
 * ctx->lock held, which it drops while it hands the UCX
 * descriptor back (UCX is not called under the context lock). */
static void stria__unexp_drop_locked(stria_ucx_ctx_t *ctx, stria__unexp_t *u)
{
    pthread_mutex_unlock(&ctx->lock);
    if (u->desc != NULL)
        ucp_am_data_release(ctx->worker, u->desc);
    free(u->copy);
    free(u);
    pthread_mutex_lock(&ctx->lock);
}

/* Posts queued requests and starts matched rendezvous receives. */
static bool stria__run_queue(stria_ucx_ctx_t *ctx)
{
    stria__node_t local;
    stria__list_init(&local);
    pthread_mutex_lock(&ctx->lock);
    stria__list_splice(&local, &ctx->queue);
    stria__list_splice(&local, &ctx->starts);
    bool any = !stria__list_empty(&local);
    while (!stria__list_empty(&local)) {
        stria_link_req_t *req = STRIA__OF(local.next, stria_link_req_t, queue_node);
        stria__ucx_link_t *link = req->link;
        stria__list_del(&req->queue_node);
        if (req->matched) {
            /* A rendezvous arrival matched in the data callback. */
            void *desc = req->desc;
            req->desc = NULL;
            if (link->failed) {
                stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
                pthread_mutex_unlock(&ctx->lock);
                ucp_am_data_release(ctx->worker, desc);
            } else {
                pthread_mutex_unlock(&ctx->lock);
                stria__recv_start(ctx, req, desc);
            }
            pthread_mutex_lock(&ctx->lock);
            continue;
        }
        req->state = STRIA__REQ_POSTED;
        ctx->in_flight++;
        if (link->failed) {
            stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
            continue;
        }
        if (req->is_send && link->hb.nb[STRIA__FROM_NEXT].bye) {
            char msg[200];
            snprintf(msg, sizeof(msg), "rank %d left the ring; cannot send tag %#llx",
                     stria_link_next(&link->base), (unsigned long long)req->tag);
            stria__ucx_req_finish_locked(req, STRIA_ERR_CLOSED, msg);
            continue;
        }
        if (req->is_send) {
            pthread_mutex_unlock(&ctx->lock);
            stria__send_start(ctx, req);
            pthread_mutex_lock(&ctx->lock);
            continue;
        }
        stria__unexp_t *u = NULL;
        for (stria__node_t *n = link->unexp.next; n != &link->unexp; n = n->next) {
            stria__unexp_t *x = STRIA__OF(n, stria__unexp_t, node);
            if (x->tag == req->tag) {
                u = x;
                break;
            }
        }
        if (u == NULL && link->hb.nb[STRIA__FROM_PREV].bye) {
            char msg[200];
            snprintf(msg, sizeof(msg), "rank %d left the ring; no message tag %#llx will come",
                     stria_link_prev(&link->base), (unsigned long long)req->tag);
            stria__ucx_req_finish_locked(req, STRIA_ERR_CLOSED, msg);
            continue;
        }
        if (u == NULL) {
            stria__list_push(&link->posted, &req->queue_node);
            continue;
        }
        stria__list_del(&u->node);
        if (!u->rndv)
            link->unexp_bytes -= u->len;
        if (u->len != req->len) {
            stria__ucx_link_fail_locked(
                link, STRIA_ERR_PROTOCOL, stria_link_prev(&link->base),
                STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                "message tag %#llx from rank %d has %zu bytes, the receive expects %zu",
                (unsigned long long)req->tag, stria_link_prev(&link->base), u->len, req->len);
            stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
            stria__unexp_drop_locked(ctx, u);
            continue;
        }
        req->matched = true;
        if (u->rndv) {
            pthread_mutex_unlock(&ctx->lock);
            stria__recv_start(ctx, req, u->desc);
            free(u);
            pthread_mutex_lock(&ctx->lock);
            continue;
        }
        if (u->len > 0)
            memcpy(req->buf, u->copy != NULL ? u->copy : u->desc, u->len);
        stria__ucx_req_finish_locked(req, STRIA_OK, NULL);
        stria__unexp_drop_locked(ctx, u);
    }
    pthread_mutex_unlock(&ctx->lock);
    return any;
}

void *stria__ucx_progress_main(void *arg)
{
    stria_ucx_ctx_t *ctx = arg;
    int busy_rounds = 0;
    double last_active = 0;
    for (;;) {
        bool any = false;
        any |= stria__run_queue(ctx);
        while (ucp_worker_progress(ctx->worker) != 0)
            any = true;
        any |= stria__ucx_run_events(ctx);
        double due = stria__ucx_run_links(ctx, &any);
        double sweep = stria__ucx_conns_sweep(ctx, stria_time_now());
        if (sweep > 0 && (due == 0 || sweep < due))
            due = sweep;

        pthread_mutex_lock(&ctx->lock);
        bool stop = ctx->stop;
        bool queued = !stria__list_empty(&ctx->queue) || !stria__list_empty(&ctx->starts);
        bool transfers = ctx->in_flight > 0;
        pthread_mutex_unlock(&ctx->lock);
        if (stop)
            break;
        if (any || queued || !stria__list_empty(&ctx->events)) {
            busy_rounds = 0;
            last_active = stria_time_now();
            continue;
        }
        /* While transfers are in flight, poll a little before sleeping: the
         * next piece of a transfer usually follows within microseconds,
         * and an arm/epoll/wake round costs more than it. */
        if (transfers && stria_time_now() - last_active < ctx->poll_s)
            continue;
        ucs_status_t s = ucp_worker_arm(ctx->worker);
        if (s == UCS_ERR_BUSY) {
            /* Events pending that progress does not consume (seen with a
             * transport waiting on a stopped peer): poll, but do not spin;
             * the worker's fd stays readable, so epoll would not sleep. */
            if (++busy_rounds >= 64)
                usleep(1000);
            continue;
        }
        busy_rounds = 0;
        int timeout_ms = 100;
        if (due > 0) {
            double dt = due - stria_time_now();
            timeout_ms = dt <= 0 ? 0 : (int)(dt * 1000) + 1;
            if (timeout_ms > 100)
                timeout_ms = 100;
        }
        struct epoll_event evs[2];
        int n = epoll_wait(ctx->ep_fd, evs, 2, timeout_ms);
        for (int i = 0; i < n; i++) {
            if (evs[i].data.fd == ctx->kick_fd) {
                uint64_t v;
                ssize_t rd = read(ctx->kick_fd, &v, sizeof(v));
                (void)rd;
            }
        }
    }
    return NULL;
}
