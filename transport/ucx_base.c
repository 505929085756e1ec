/*
 * What every room of the UCX link uses: waking the progress thread, timed
 * waits on ctx->cond, socket addresses, UCX's statuses in ours, sending a
 * control message, recording what a UCX callback saw, and the small state
 * changes of requests and links that any thread may make under ctx->lock
 * (finishing a request, failing a link, a neighbour bound).
 */
#include "ucx_int.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>

/* ---- waking and waiting ------------------------------------------------------------ */

void stria__ucx_kick(stria_ucx_ctx_t *ctx)
{
    uint64_t one = 1;
    ssize_t n;
    do {
        n = write(ctx->kick_fd, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
}

static struct timespec abs_time(double t)
{
    /* ctx->cond runs on CLOCK_MONOTONIC, the clock of stria_time_now(). */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double delta = t - stria_time_now();
    if (delta < 0)
        delta = 0;
    if (delta > 3600)
        delta = 3600;
    long sec = (long)delta;
    long nsec = (long)((delta - (double)sec) * 1e9);
    now.tv_sec += sec;
    now.tv_nsec += nsec;
    if (now.tv_nsec >= 1000000000L) {
        now.tv_sec++;
        now.tv_nsec -= 1000000000L;
    }
    return now;
}

void stria__ucx_cond_wait_until(stria_ucx_ctx_t *ctx, double t)
{
    struct timespec ts = abs_time(t);
    pthread_cond_timedwait(&ctx->cond, &ctx->lock, &ts);
}

void stria__ucx_addr_str(const struct sockaddr *sa, char *out, size_t n)
{
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)(const void *)sa;
        inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
        port = ntohs(in->sin_port);
        snprintf(out, n, "%s:%d", host, port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)(const void *)sa;
        inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
        port = ntohs(in6->sin6_port);
        snprintf(out, n, "[%s]:%d", host, port);
    } else {
        snprintf(out, n, "(address family %d)", sa->sa_family);
    }
}

/* ---- UCX statuses ------------------------------------------------------------------- */

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

bool stria__ucx_is_peer_error(ucs_status_t s)
{
    return s == UCS_ERR_CONNECTION_RESET || s == UCS_ERR_ENDPOINT_TIMEOUT ||
           s == UCS_ERR_UNREACHABLE || s == UCS_ERR_NOT_CONNECTED || s == UCS_ERR_IO_ERROR ||
           s == UCS_ERR_REJECTED || s == UCS_ERR_CANCELED;
}

/* ---- control messages ------------------------------------------------------------------ */

/* A control message being sent; freed by its completion. */
typedef struct {
    int *pending;
    uint8_t buf[STRIA__UCX_CTRL_MAX];
} ctrl_send_t;

static void ctrl_send_cb(void *request, ucs_status_t status, void *user_data)
{
    ctrl_send_t *cs = user_data;
    (void)status;
    (*cs->pending)--;
    free(cs);
    ucp_request_free(request);
}

ucp_request_param_t stria__ucx_send_param(ucp_send_nbx_callback_t cb, void *user_data,
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

/* Sends cs->buf (len bytes) on ep, eagerly, with the reply flag. */
static void send_buf(ucp_ep_h ep, ctrl_send_t *cs, size_t len)
{
    ucp_request_param_t param =
        stria__ucx_send_param(ctrl_send_cb, cs, UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER);
    (*cs->pending)++;
    void *r = ucp_am_send_nbx(ep, STRIA__UCX_AM_CTRL, NULL, 0, cs->buf, len, &param);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        if (UCS_PTR_IS_ERR(r))
            stria_log_debug("ucx link: control message not sent: %s",
                            ucs_status_string(UCS_PTR_STATUS(r)));
        (*cs->pending)--;
        free(cs);
    }
}

void stria__ucx_ctrl_send(ucp_ep_h ep, const stria__ctrl_t *c, int *pending)
{
    ctrl_send_t *cs = ep != NULL ? malloc(sizeof(*cs)) : NULL;
    if (cs == NULL)
        return;
    cs->pending = pending;
    send_buf(ep, cs, stria__ucx_ctrl_encode(c, cs->buf));
}

void stria__ucx_raw_send(ucp_ep_h ep, const uint8_t *buf, size_t len, int *pending)
{
    ctrl_send_t *cs = ep != NULL && len <= STRIA__UCX_CTRL_MAX ? malloc(sizeof(*cs)) : NULL;
    if (cs == NULL)
        return;
    cs->pending = pending;
    memcpy(cs->buf, buf, len);
    send_buf(ep, cs, len);
}

/* ---- events ------------------------------------------------------------------------------ */

void stria__ucx_event_push(stria_ucx_ctx_t *ctx, stria__event_t *ev)
{
    stria__list_push(&ctx->events, &ev->node);
}

void stria__ucx_events_forget(stria_ucx_ctx_t *ctx, const stria__ucx_ep_t *obj)
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

/* ---- requests and links (ctx->lock held) -------------------------------------------------- */

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
    link->notify_status = STRIA_ERR_PEER;
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
    pthread_cond_broadcast(&link->ctx->cond);
}

void stria__ucx_link_ctrl_init(const stria__ucx_link_t *link, stria__ctrl_t *c, uint16_t type,
                               int side)
{
    memset(c, 0, sizeof(*c));
    c->type = type;
    c->job_id = link->job_id;
    c->ring_id = link->ring_id;
    c->rank = link->base.rank;
    c->size = link->base.size;
    c->origin = link->base.rank;
    c->reporter = link->base.rank;
    c->dst = side == STRIA__FROM_NEXT ? link->out_slot : link->prev_slot;
}

stria__ucx_link_t *stria__ucx_link_of_slot_locked(stria_ucx_ctx_t *ctx, uint32_t slot)
{
    stria__ucx_link_t *link = ctx->slots[STRIA__UCX_SLOT_INDEX(slot)];
    return link != NULL && link->in_slot == slot ? link : NULL;
}
