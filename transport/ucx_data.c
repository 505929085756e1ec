/*
 * The data path of the UCX link (progress thread): the data callback (a
 * block is taken only from the endpoint its slot's link was bound on, and
 * matched to the first posted receive of its tag, or kept until one is
 * posted), the completions of sends and rendezvous receives, and the
 * posting of what callers queued.
 */
#include "ucx_int.h"

#include <stdio.h>
#include <string.h>

/* Completion of a UCX data request (send or rendezvous receive). */
static void data_done(stria_link_req_t *req, ucs_status_t status, size_t length)
{
    stria__ucx_link_t *link = req->link;
    stria_ucx_ctx_t *ctx = link->ctx;
    int peer = req->is_send ? stria_link_next(&link->base) : stria_link_prev(&link->base);
    const char *role = req->is_send ? "successor" : "predecessor";
    pthread_mutex_lock(&ctx->lock);
    if (status == UCS_OK && !req->is_send && length != req->len) {
        stria__ucx_link_fail_locked(
            link, STRIA_ERR_PROTOCOL, peer, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "message tag %#llx from rank %d delivered %zu bytes, expected %zu",
            (unsigned long long)req->tag, peer, length, req->len);
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
    } else if (status == UCS_OK) {
        stria__ucx_req_finish_locked(req, STRIA_OK, NULL);
    } else if (link->failed) {
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
    } else if (link->hb.nb[req->is_send ? STRIA__FROM_NEXT : STRIA__FROM_PREV].bye) {
        char msg[200];
        snprintf(msg, sizeof(msg), "rank %d left the ring before the %s of tag %#llx completed",
                 peer, stria__req_kind(req), (unsigned long long)req->tag);
        stria__ucx_req_finish_locked(req, STRIA_ERR_CLOSED, msg);
    } else if (stria__ucx_is_peer_error(status)) {
        /* The link's failure (and this request's message) is decided when
         * the endpoint's fate has settled; see the link's wait (ucx.c). */
        stria__ucx_link_peer_error_locked(
            link, req->is_send ? STRIA__NOTIFY_NEXT : STRIA__NOTIFY_PREV,
            "rank %d (%s) failed during the %s of tag %#llx: %s", peer, role, stria__req_kind(req),
            (unsigned long long)req->tag, ucs_status_string(status));
        stria__ucx_req_finish_locked(req, STRIA_ERR_PEER, "");
    } else {
        stria__ucx_link_fail_locked(
            link, stria__ucx_status(status), peer, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "%s of tag %#llx %s rank %d (%s) failed: %s", stria__req_kind(req),
            (unsigned long long)req->tag, req->is_send ? "to" : "from", peer, role,
            ucs_status_string(status));
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
    }
    pthread_mutex_unlock(&ctx->lock);
}

static void data_send_cb(void *request, ucs_status_t status, void *user_data)
{
    data_done(user_data, status, 0);
    ucp_request_free(request);
}

static void data_recv_cb(void *request, ucs_status_t status, size_t length, void *user_data)
{
    data_done(user_data, status, length);
    ucp_request_free(request);
}

/* A block its slot's link does not take from this endpoint (lock held):
 * counted as dropped (a stranger's, or an endpoint nobody bound) or, from
 * an endpoint that carries links, as late (for a link gone or failed). */
static void count_refused_locked(stria_ucx_ctx_t *ctx, ucp_ep_h ep, uint32_t slot)
{
    stria__ucx_ep_t *e = stria__ucx_ep_find_locked(ctx, ep);
    if (e != NULL && e->trusted && e->state == STRIA__EP_READY) {
        ctx->stats.data_late++;
        return;
    }
    uint64_t dropped = ++ctx->stats.data_dropped;
    if (dropped == 1 || dropped % 1000 == 0)
        stria_log_warn("ucx link: dropped a data block for slot %#x from an endpoint not bound to "
                       "it (%llu so far)",
                       slot, (unsigned long long)dropped);
}

/* A block for a receive posted before it (lock held). Returns the status
 * for UCX. */
static ucs_status_t match_locked(stria__ucx_link_t *link, stria_link_req_t *req, void *data,
                                 size_t length, bool rndv)
{
    stria_ucx_ctx_t *ctx = link->ctx;
    stria__list_del(&req->queue_node);
    if (length != req->len) {
        int prev = stria_link_prev(&link->base);
        stria__ucx_link_fail_locked(
            link, STRIA_ERR_PROTOCOL, prev, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "message tag %#llx from rank %d has %zu bytes, the receive expects %zu",
            (unsigned long long)req->tag, prev, length, req->len);
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
        return rndv ? UCS_ERR_MESSAGE_TRUNCATED : UCS_OK;
    }
    req->matched = true;
    if (rndv) {
        /* Started after progress returns, outside this callback. */
        req->desc = data;
        stria__list_push(&ctx->starts, &req->queue_node);
        return UCS_INPROGRESS;
    }
    if (length > 0)
        memcpy(req->buf, data, length);
    stria__ucx_req_finish_locked(req, STRIA_OK, NULL);
    return UCS_OK;
}

/* A block no receive waits for yet: kept (lock held). */
static ucs_status_t keep_locked(stria__ucx_link_t *link, uint64_t tag, void *data, size_t length,
                                bool rndv, bool keep)
{
    int prev = stria_link_prev(&link->base);
    if (!rndv && link->unexp_bytes + length > STRIA__UCX_UNEXP_MAX) {
        stria__ucx_link_fail_locked(link, STRIA_ERR_PROTOCOL, prev,
                                    STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                                    "rank %d sent more than %u bytes of small messages nobody "
                                    "receives",
                                    prev, STRIA__UCX_UNEXP_MAX);
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
        return rndv ? UCS_ERR_CANCELED : UCS_OK;
    }
    u->tag = tag;
    u->len = length;
    u->rndv = rndv;
    if (rndv || keep)
        u->desc = data;
    if (!rndv)
        link->unexp_bytes += length;
    stria__list_push(&link->unexp, &u->node);
    return (rndv || keep) ? UCS_INPROGRESS : UCS_OK;
}

ucs_status_t stria__ucx_am_data_cb(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param)
{
    stria_ucx_ctx_t *ctx = arg;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    bool keep = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
    ucs_status_t drop = rndv ? UCS_ERR_CANCELED : UCS_OK;
    ucp_ep_h from = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;

    if (header_length != STRIA__UCX_DATA_HDR) {
        stria_log_warn("ucx link: dropping a data message with a %zu-byte header", header_length);
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    uint32_t slot;
    uint64_t tag;
    stria__ucx_data_hdr_decode(header, &slot, &tag);

    pthread_mutex_lock(&ctx->lock);
    stria__ucx_link_t *link = stria__ucx_link_of_slot_locked(ctx, slot);
    /* Only the endpoint the predecessor bound this link on may fill its
     * receives (link->in is set when the bind is taken). */
    if (link == NULL || link->in == NULL || from == NULL || link->in->ep != from) {
        count_refused_locked(ctx, from, slot);
        pthread_mutex_unlock(&ctx->lock);
        return drop;
    }
    if (link->failed) {
        ctx->stats.data_late++;
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
    ucs_status_t s = req != NULL ? match_locked(link, req, data, length, rndv)
                                 : keep_locked(link, tag, data, length, rndv, keep);
    pthread_mutex_unlock(&ctx->lock);
    return s;
}

/* Starts the transfer of a matched rendezvous receive. */
static void recv_start(stria_ucx_ctx_t *ctx, stria_link_req_t *req, void *desc)
{
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv_am = data_recv_cb;
    param.user_data = req;
    void *r = ucp_am_recv_data_nbx(ctx->worker, desc, req->buf, req->len, &param);
    if (r == NULL)
        data_done(req, UCS_OK, req->len);
    else if (UCS_PTR_IS_ERR(r))
        data_done(req, UCS_PTR_STATUS(r), 0);
    else
        req->ucp_req = r;
}

static void send_start(stria_link_req_t *req)
{
    stria__ucx_link_t *link = req->link;
    ucp_ep_h ep = link->out != NULL ? link->out->ep : NULL;
    if (ep == NULL) {
        data_done(req, UCS_ERR_NOT_CONNECTED, 0);
        return;
    }
    /* The reply flag names our endpoint to the receiver, which takes data
     * only from the endpoint its link was bound on. */
    ucp_request_param_t param = stria__ucx_send_param(
        data_send_cb, req,
        UCP_AM_SEND_FLAG_REPLY | (req->len >= STRIA__UCX_RNDV_MIN ? UCP_AM_SEND_FLAG_RNDV : 0));
    void *r = ucp_am_send_nbx(ep, STRIA__UCX_AM_DATA, req->hdr, STRIA__UCX_DATA_HDR, req->buf,
                              req->len, &param);
    if (r == NULL)
        data_done(req, UCS_OK, 0);
    else if (UCS_PTR_IS_ERR(r))
        data_done(req, UCS_PTR_STATUS(r), 0);
    else
        req->ucp_req = r;
}

/* Frees an arrival once a receive has taken it (or refused it); called with
 * ctx->lock held, which it drops while it hands the UCX descriptor back
 * (UCX is not called under the context lock). */
static void unexp_drop_locked(stria_ucx_ctx_t *ctx, stria__unexp_t *u)
{
    pthread_mutex_unlock(&ctx->lock);
    if (u->desc != NULL)
        ucp_am_data_release(ctx->worker, u->desc);
    free(u->copy);
    free(u);
    pthread_mutex_lock(&ctx->lock);
}

void stria__ucx_drop_unexp(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
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

/* A matched rendezvous arrival (lock held): started, or released when its
 * link failed meanwhile. */
static void start_matched_locked(stria_ucx_ctx_t *ctx, stria_link_req_t *req)
{
    stria__ucx_link_t *link = req->link;
    void *desc = req->desc;
    req->desc = NULL;
    if (link->failed) {
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
        pthread_mutex_unlock(&ctx->lock);
        ucp_am_data_release(ctx->worker, desc);
    } else {
        pthread_mutex_unlock(&ctx->lock);
        recv_start(ctx, req, desc);
    }
    pthread_mutex_lock(&ctx->lock);
}

/* The first arrival of the receive's tag, or NULL (lock held). */
static stria__unexp_t *take_arrival_locked(stria__ucx_link_t *link, uint64_t tag)
{
    for (stria__node_t *n = link->unexp.next; n != &link->unexp; n = n->next) {
        stria__unexp_t *x = STRIA__OF(n, stria__unexp_t, node);
        if (x->tag == tag) {
            stria__list_del(&x->node);
            if (!x->rndv)
                link->unexp_bytes -= x->len;
            return x;
        }
    }
    return NULL;
}

/* A receive just posted (lock held): matched with an arrival, or kept. */
static void post_recv_locked(stria_ucx_ctx_t *ctx, stria_link_req_t *req)
{
    stria__ucx_link_t *link = req->link;
    stria__unexp_t *u = take_arrival_locked(link, req->tag);
    if (u == NULL && link->hb.nb[STRIA__FROM_PREV].bye) {
        char msg[200];
        snprintf(msg, sizeof(msg), "rank %d left the ring; no message tag %#llx will come",
                 stria_link_prev(&link->base), (unsigned long long)req->tag);
        stria__ucx_req_finish_locked(req, STRIA_ERR_CLOSED, msg);
        return;
    }
    if (u == NULL) {
        stria__list_push(&link->posted, &req->queue_node);
        return;
    }
    if (u->len != req->len) {
        int prev = stria_link_prev(&link->base);
        stria__ucx_link_fail_locked(
            link, STRIA_ERR_PROTOCOL, prev, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "message tag %#llx from rank %d has %zu bytes, the receive expects %zu",
            (unsigned long long)req->tag, prev, u->len, req->len);
        stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
        unexp_drop_locked(ctx, u);
        return;
    }
    req->matched = true;
    if (u->rndv) {
        pthread_mutex_unlock(&ctx->lock);
        recv_start(ctx, req, u->desc);
        free(u);
        pthread_mutex_lock(&ctx->lock);
        return;
    }
    if (u->len > 0)
        memcpy(req->buf, u->copy != NULL ? u->copy : u->desc, u->len);
    stria__ucx_req_finish_locked(req, STRIA_OK, NULL);
    unexp_drop_locked(ctx, u);
}

bool stria__ucx_run_queue(stria_ucx_ctx_t *ctx)
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
            start_matched_locked(ctx, req);
            continue;
        }
        req->state = STRIA__REQ_POSTED;
        ctx->in_flight++;
        if (link->failed) {
            stria__ucx_req_finish_locked(req, link->fail_status, link->fail_msg);
        } else if (req->is_send && link->hb.nb[STRIA__FROM_NEXT].bye) {
            char msg[200];
            snprintf(msg, sizeof(msg), "rank %d left the ring; cannot send tag %#llx",
                     stria_link_next(&link->base), (unsigned long long)req->tag);
            stria__ucx_req_finish_locked(req, STRIA_ERR_CLOSED, msg);
        } else if (req->is_send) {
            pthread_mutex_unlock(&ctx->lock);
            send_start(req);
            pthread_mutex_lock(&ctx->lock);
        } else {
            post_recv_locked(ctx, req);
        }
    }
    pthread_mutex_unlock(&ctx->lock);
    return any;
}
