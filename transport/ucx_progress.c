/*
 * The progress thread of a UCX context: the UCX callbacks of the listener
 * and of control messages (they only record what they saw), the handling
 * of what was recorded after ucp_worker_progress() returns, handed to the
 * rooms below (endpoints, binds, notices), and the thread's loop. The data
 * callback is the data room's (ucx_data.c); endpoint errors are recorded by
 * the endpoint room's handler (ucx_ep.c).
 */
#include "ucx_int.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

/* ---- UCX callbacks (progress thread, inside ucp_worker_progress) ---------------- */

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
    stria__ucx_event_push(ctx, ev);
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
    ev->ep = param->reply_ep;
    int version = stria__ucx_ctrl_version(data, length);
    if (version >= 0 && version != STRIA__UCX_VERSION) {
        ev->type = STRIA__EV_VERSION;
        ev->version = version;
        ev->raw_len = length < sizeof(ev->raw) ? length : sizeof(ev->raw);
        memcpy(ev->raw, data, ev->raw_len);
    } else if (stria__ucx_ctrl_decode(data, length, &ev->ctrl) == STRIA_OK) {
        ev->type = STRIA__EV_CTRL;
    } else {
        stria_log_warn("ucx link: dropping a control message: %s", stria_error_msg());
        free(ev);
        return UCS_OK;
    }
    stria__ucx_event_push(ctx, ev);
    return UCS_OK;
}

/* ---- what the callbacks recorded ----------------------------------------------------- */

/* A control message on the endpoint e. */
static void handle_ctrl(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c)
{
    switch (c->type) {
    case STRIA__CTRL_EP_HELLO:
    case STRIA__CTRL_EP_WELCOME:
    case STRIA__CTRL_EP_PROOF:
    case STRIA__CTRL_EP_READY:
        stria__ucx_ep_handle(ctx, e, c);
        break;
    case STRIA__CTRL_BIND:
        stria__ucx_bind_handle(ctx, e, c);
        break;
    case STRIA__CTRL_BOUND:
        stria__ucx_bound_handle(ctx, e, c);
        break;
    default:
        stria__ucx_notice_handle(ctx, e, c);
        break;
    }
}

bool stria__ucx_run_events(stria_ucx_ctx_t *ctx)
{
    bool any = false;
    while (!stria__list_empty(&ctx->events)) {
        stria__node_t *n = ctx->events.next;
        stria__list_del(n);
        stria__event_t *ev = STRIA__OF(n, stria__event_t, node);
        any = true;
        if (ev->type == STRIA__EV_CONN_REQ) {
            stria__ucx_ep_accept(ctx, ev->conn_req);
        } else if (ev->type == STRIA__EV_EP_ERR) {
            stria__ucx_ep_error(ctx, ev->obj, ev->status);
        } else if (ev->type == STRIA__EV_VERSION) {
            stria__ucx_ep_version(ctx, ev->ep, ev->version, ev->raw, ev->raw_len);
        } else {
            stria__ucx_ep_t *e = stria__ucx_ep_find(ctx, ev->ep);
            if (e != NULL)
                handle_ctrl(ctx, e, &ev->ctrl);
            else
                stria_log_debug("ucx link: a control message on an endpoint closed since");
        }
        free(ev);
    }
    return any;
}

/* ---- the loop ----------------------------------------------------------------------- */

/* Sleeps in epoll on the worker's event fd and the kick fd until something
 * happens or `due` (0: 100 ms at most). */
static void sleep_until(stria_ucx_ctx_t *ctx, double due)
{
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

static double earliest(double a, double b)
{
    return a == 0 ? b : b == 0 ? a : a < b ? a : b;
}

/* Whether a link is connecting or an endpoint in its handshake: UCX does
 * not always wake the worker's event fd for the steps of a connection
 * (its connection manager runs on UCX's async thread), so the loop polls
 * (STRIA__UCX_SETUP_POLL_S) while one is under way. */
static bool setting_up(stria_ucx_ctx_t *ctx)
{
    bool any = false;
    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *n = ctx->links.next; n != &ctx->links && !any; n = n->next)
        any = STRIA__OF(n, stria__ucx_link_t, ctx_node)->state == STRIA__LINK_CONNECTING;
    for (stria__node_t *n = ctx->eps.next; n != &ctx->eps && !any; n = n->next)
        any = STRIA__OF(n, stria__ucx_ep_t, node)->state == STRIA__EP_HANDSHAKE;
    pthread_mutex_unlock(&ctx->lock);
    return any;
}

void *stria__ucx_progress_main(void *arg)
{
    stria_ucx_ctx_t *ctx = arg;
    int busy_rounds = 0;
    double last_active = 0, setup_since = 0;
    for (;;) {
        bool any = false;
        any |= stria__ucx_run_queue(ctx);
        while (ucp_worker_progress(ctx->worker) != 0)
            any = true;
        any |= stria__ucx_run_events(ctx);
        double due = stria__ucx_run_links(ctx, &any);
        double now = stria_time_now();
        if (now >= ctx->next_sweep) {
            double d = earliest(stria__ucx_binds_expire(ctx, now), stria__ucx_eps_sweep(ctx, now));
            ctx->next_sweep = earliest(now + 0.1, d);
        }
        due = earliest(due, ctx->next_sweep);
        if (!setting_up(ctx))
            setup_since = 0;
        else if (setup_since == 0)
            setup_since = now;
        /* A connect waiting long (for a neighbour that starts late) polls
         * less often. */
        if (setup_since > 0)
            due = earliest(due, now + (now - setup_since < STRIA__UCX_SETUP_FAST_S
                                           ? STRIA__UCX_SETUP_POLL_S
                                           : 10 * STRIA__UCX_SETUP_POLL_S));

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
        sleep_until(ctx, due);
    }
    return NULL;
}
