/*
 * The UCX context of the ring link: configuration (parameters and the
 * environment UCX reads), the ucp context and worker, the listener, the
 * progress thread's wake-up fds, create/destroy, what it counted, the list
 * of its endpoints and their drop.
 */
#include "ucx_int.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>

/* ---- environment ------------------------------------------------------------------- */

/* Whether a UCX_TLS list can select one of the named transports (UCX's
 * aliases "all", "sm" and "shm" and exclusion lists included). */
static bool tls_may_use(const char *tls, const char *const *names)
{
    if (tls == NULL || tls[0] == '^')
        return true;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", tls);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        if (strcmp(t, "all") == 0 || strcmp(t, "shm") == 0 || strcmp(t, "sm") == 0)
            return true;
        for (size_t i = 0; names[i] != NULL; i++)
            if (strcmp(t, names[i]) == 0)
                return true;
    }
    return false;
}

static void env_default(const char *name, const char *value)
{
    if (setenv(name, value, 0) != 0)
        stria_log_warn("ucx link: cannot set %s=%s: %s", name, value, strerror(errno));
}

/* UCX 1.13 reads the settings of its transports and connection managers
 * from the environment only (ucp_config_modify() does not reach them), so
 * the defaults the link needs go there, unless the user set them. Each is
 * set only where its transport may be used, as UCX warns about settings of
 * transports it did not load.
 * - TCP_CM_REUSEADDR: a restarted process listens on its port at once.
 * - POSIX/SYSV_ERROR_HANDLING: shared memory stays usable for endpoints in
 *   peer error mode (else UCX falls back to TCP between local processes).
 * - CMA_MEMORY_INVALIDATE: lets UCX use cma for rendezvous in peer error
 *   mode (else it moves large blocks over TCP at a third of the speed). cma
 *   cannot actually revoke access: after a failure a surviving peer could
 *   still read (never write) a send buffer the link already released.
 * - POSIX/SYSV_FIFO_ELEM_SIZE: shared memory's "short" messages hold up to
 *   996 bytes instead of 100, more than the largest control message
 *   (STRIA__UCX_CTRL_MAX and UCX's headers). UCX 1.13 picks the protocol of
 *   a message sent while an endpoint still wires up from the lane it has
 *   then (TCP, short up to 8 KiB) and replays it on the final one: between
 *   two processes of a host that is shared memory, where a 110-byte
 *   handshake did not fit as a short message. UCX then failed it ("Invalid
 *   am_short_iov length: 126 (expected: <= 100)") and retried it for ever:
 *   the link never completed its handshake, every later link between the
 *   pair queued behind it, and the progress thread logged the error in a
 *   busy loop. */
static void env_defaults(const char *tls)
{
    static pthread_mutex_t env_lock = PTHREAD_MUTEX_INITIALIZER;
    static const char *const posix[] = {"posix", NULL};
    static const char *const sysv[] = {"sysv", NULL};
    static const char *const cma[] = {"cma", NULL};
    const char *eff = tls != NULL ? tls : getenv("UCX_TLS");
    pthread_mutex_lock(&env_lock);
    env_default("UCX_TCP_CM_REUSEADDR", "y");
    if (tls_may_use(eff, posix)) {
        env_default("UCX_POSIX_ERROR_HANDLING", "y");
        env_default("UCX_POSIX_FIFO_ELEM_SIZE", STRIA__UCX_MM_ELEM);
    }
    if (tls_may_use(eff, sysv)) {
        env_default("UCX_SYSV_ERROR_HANDLING", "y");
        env_default("UCX_SYSV_FIFO_ELEM_SIZE", STRIA__UCX_MM_ELEM);
    }
    if (tls_may_use(eff, cma))
        env_default("UCX_CMA_MEMORY_INVALIDATE", "y");
    pthread_mutex_unlock(&env_lock);
}

/* ---- create ---------------------------------------------------------------------------- */

/* Checks the parameters and resolves the listen address. */
static stria_status_t ctx_check(const stria_ucx_ctx_params_t *params, double *ping_s,
                                double *stale_s, struct sockaddr_storage *addr, socklen_t *addrlen)
{
    const char *host = params->listen_host != NULL ? params->listen_host : "0.0.0.0";
    if (host[0] == '\0')
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ucx context: empty listen address");
    if (params->tls != NULL && params->tls[0] == '\0')
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ucx context: empty transport list");
    if (params->net_devices != NULL && params->net_devices[0] == '\0')
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ucx context: empty device list");
    if (params->poll_us > STRIA__UCX_POLL_MAX_US)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ucx context: polling window of %d us is above %d us",
                               params->poll_us, STRIA__UCX_POLL_MAX_US);
    if (!(params->handshake_timeout_s >= 0 && params->handshake_timeout_s <= 3600) ||
        params->max_pending_per_source < 0 || params->max_pending_per_source > STRIA__UCX_MAX_CONNS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ucx context: handshake timeout %g s must be in 0..3600 and pending "
                               "connections per source %d in 0..%d",
                               params->handshake_timeout_s, params->max_pending_per_source,
                               STRIA__UCX_MAX_CONNS);
    stria_status_t st = stria__ucx_hb_config(params->heartbeat_s, params->stall_s, ping_s, stale_s);
    if (st != STRIA_OK)
        return st;
    size_t len = 0;
    st = stria_addr_resolve(host, params->listen_port, true, addr, &len);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "ucx context: listen address");
    *addrlen = (socklen_t)len;
    return STRIA_OK;
}

/* Frees what create made so far (every field NULL or -1 when not made). */
static void ctx_unwind(stria_ucx_ctx_t *ctx)
{
    if (ctx->kick_fd >= 0)
        close(ctx->kick_fd);
    if (ctx->ep_fd >= 0)
        close(ctx->ep_fd);
    if (ctx->listener != NULL)
        ucp_listener_destroy(ctx->listener);
    if (ctx->worker != NULL)
        ucp_worker_destroy(ctx->worker);
    if (ctx->context != NULL)
        ucp_cleanup(ctx->context);
    if (ctx->sync_init) {
        pthread_cond_destroy(&ctx->cond);
        pthread_mutex_destroy(&ctx->lock);
    }
    free(ctx->slots);
    free(ctx->slot_gen);
    stria_auth_wipe(ctx->ep_key, sizeof(ctx->ep_key));
    free(ctx);
}

/* The context's memory, lists, lock and condition variable. */
static stria_status_t ctx_alloc(const stria_ucx_ctx_params_t *params, double ping_s, double stale_s,
                                stria_ucx_ctx_t **ctx_out)
{
    stria_ucx_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "ucx context: out of memory");
    ctx->ucp_fd = ctx->kick_fd = ctx->ep_fd = -1;
    stria__list_init(&ctx->links);
    stria__list_init(&ctx->queue);
    stria__list_init(&ctx->eps);
    stria__list_init(&ctx->events);
    stria__list_init(&ctx->starts);
    ctx->next_slot = 1;
    ctx->poll_s = params->poll_us < 0    ? 0
                  : params->poll_us == 0 ? STRIA__UCX_POLL_DEFAULT_US * 1e-6
                                         : params->poll_us * 1e-6;
    ctx->ping_s = ping_s;
    ctx->stale_s = stale_s;
    ctx->handshake_timeout_s = params->handshake_timeout_s > 0 ? params->handshake_timeout_s
                                                               : STRIA__UCX_HANDSHAKE_TIMEOUT_S;
    ctx->max_pending_per_source = params->max_pending_per_source > 0
                                      ? params->max_pending_per_source
                                      : STRIA__UCX_PENDING_PER_SOURCE;
    if (params->endpoint_key != NULL) {
        ctx->has_ep_key = true;
        memcpy(ctx->ep_key, params->endpoint_key, sizeof(ctx->ep_key));
    }
    ctx->slots = calloc(STRIA__UCX_SLOTS, sizeof(*ctx->slots));
    ctx->slot_gen = calloc(STRIA__UCX_SLOTS, sizeof(*ctx->slot_gen));
    if (ctx->slots == NULL || ctx->slot_gen == NULL ||
        stria_auth_random(&ctx->incarnation, sizeof(ctx->incarnation)) != STRIA_OK) {
        ctx_unwind(ctx);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "ucx context: out of memory");
    }
    pthread_mutex_init(&ctx->lock, NULL);
    pthread_condattr_t cattr;
    pthread_condattr_init(&cattr);
    pthread_condattr_setclock(&cattr, CLOCK_MONOTONIC);
    pthread_cond_init(&ctx->cond, &cattr);
    pthread_condattr_destroy(&cattr);
    ctx->sync_init = true;
    *ctx_out = ctx;
    return STRIA_OK;
}

/* The transport error of a failed UCX call of the context's set-up:
 * "ucx context: WHAT: UCX's reason". */
static stria_status_t ucs_error(ucs_status_t s, const char *what)
{
    return stria_error_set(STRIA_ERR_TRANSPORT, "ucx context: %s: %s", what, ucs_status_string(s));
}

/* Reads the UCX configuration and applies the transports and devices. */
static stria_status_t ctx_config(const stria_ucx_ctx_params_t *params, ucp_config_t **config_out)
{
    ucp_config_t *config = NULL;
    ucs_status_t s;
    env_defaults(params->tls);
    s = ucp_config_read(NULL, NULL, &config);
    if (s != UCS_OK)
        return ucs_error(s, "cannot read the UCX configuration");
    if (params->tls != NULL && (s = ucp_config_modify(config, "TLS", params->tls)) != UCS_OK) {
        ucp_config_release(config);
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ucx context: invalid transport list '%s': %s", params->tls,
                               ucs_status_string(s));
    }
    if (params->net_devices != NULL &&
        (s = ucp_config_modify(config, "NET_DEVICES", params->net_devices)) != UCS_OK) {
        ucp_config_release(config);
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ucx context: invalid device list '%s': %s",
                               params->net_devices, ucs_status_string(s));
    }
    *config_out = config;
    return STRIA_OK;
}

/* The ucp context, the worker, its message handlers and its event fd. */
static stria_status_t ctx_ucp_init(stria_ucx_ctx_t *ctx, const stria_ucx_ctx_params_t *params)
{
    ucp_config_t *config = NULL;
    stria_status_t st = ctx_config(params, &config);
    if (st != STRIA_OK)
        return st;
    ucp_params_t ucp_params;
    memset(&ucp_params, 0, sizeof(ucp_params));
    ucp_params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    ucp_params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    ucp_params.mt_workers_shared = 0;
    ucs_status_t s = ucp_init(&ucp_params, config, &ctx->context);
    ucp_config_release(config);
    if (s != UCS_OK) {
        ctx->context = NULL;
        return ucs_error(s, "ucp_init failed");
    }

    ucp_worker_params_t wparams;
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    s = ucp_worker_create(ctx->context, &wparams, &ctx->worker);
    if (s != UCS_OK) {
        ctx->worker = NULL;
        return ucs_error(s, "cannot create a worker");
    }

    ucp_am_handler_param_t am;
    memset(&am, 0, sizeof(am));
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = STRIA__UCX_AM_CTRL;
    am.flags = UCP_AM_FLAG_WHOLE_MSG;
    am.cb = stria__ucx_am_ctrl_cb;
    am.arg = ctx;
    if ((s = ucp_worker_set_am_recv_handler(ctx->worker, &am)) == UCS_OK) {
        am.id = STRIA__UCX_AM_DATA;
        am.cb = stria__ucx_am_data_cb;
        s = ucp_worker_set_am_recv_handler(ctx->worker, &am);
    }
    if (s != UCS_OK)
        return ucs_error(s, "cannot set message handlers");
    s = ucp_worker_get_efd(ctx->worker, &ctx->ucp_fd);
    if (s != UCS_OK)
        return ucs_error(s, "no worker event fd");
    return STRIA_OK;
}

/* Listens on the address and reads back the port. */
static stria_status_t ctx_listen(stria_ucx_ctx_t *ctx, const struct sockaddr_storage *addr,
                                 socklen_t addrlen)
{
    ucp_listener_params_t lparams;
    memset(&lparams, 0, sizeof(lparams));
    lparams.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lparams.sockaddr.addr = (const struct sockaddr *)addr;
    lparams.sockaddr.addrlen = addrlen;
    lparams.conn_handler.cb = stria__ucx_conn_req_cb;
    lparams.conn_handler.arg = ctx;
    ucs_status_t s = ucp_listener_create(ctx->worker, &lparams, &ctx->listener);
    if (s != UCS_OK) {
        char where[120];
        ctx->listener = NULL;
        stria__ucx_addr_str((const struct sockaddr *)addr, where, sizeof(where));
        return stria_error_set(s == UCS_ERR_BUSY ? STRIA_ERR_BUSY : STRIA_ERR_TRANSPORT,
                               "ucx context: cannot listen on %s: %s", where, ucs_status_string(s));
    }
    ucp_listener_attr_t lattr;
    memset(&lattr, 0, sizeof(lattr));
    lattr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(ctx->listener, &lattr);
    if (s != UCS_OK)
        return ucs_error(s, "cannot query the listener");
    if (lattr.sockaddr.ss_family == AF_INET)
        ctx->port = ntohs(((struct sockaddr_in *)(void *)&lattr.sockaddr)->sin_port);
    else
        ctx->port = ntohs(((struct sockaddr_in6 *)(void *)&lattr.sockaddr)->sin6_port);
    return STRIA_OK;
}

/* The eventfd and epoll set the progress thread sleeps on, and the thread. */
static stria_status_t ctx_start(stria_ucx_ctx_t *ctx)
{
    ctx->kick_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    ctx->ep_fd = epoll_create1(EPOLL_CLOEXEC);
    if (ctx->kick_fd < 0 || ctx->ep_fd < 0)
        return stria_error_set(STRIA_ERR_IO, "ucx context: eventfd/epoll: %s", strerror(errno));
    struct epoll_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.fd = ctx->ucp_fd;
    if (epoll_ctl(ctx->ep_fd, EPOLL_CTL_ADD, ctx->ucp_fd, &ev) != 0)
        return stria_error_set(STRIA_ERR_IO, "ucx context: epoll_ctl: %s", strerror(errno));
    ev.data.fd = ctx->kick_fd;
    if (epoll_ctl(ctx->ep_fd, EPOLL_CTL_ADD, ctx->kick_fd, &ev) != 0)
        return stria_error_set(STRIA_ERR_IO, "ucx context: epoll_ctl: %s", strerror(errno));
    int rc = pthread_create(&ctx->thread, NULL, stria__ucx_progress_main, ctx);
    if (rc != 0)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "ucx context: cannot start a thread: %s",
                               strerror(rc));
    ctx->thread_started = true;
    return STRIA_OK;
}

stria_status_t stria_ucx_ctx_create(const stria_ucx_ctx_params_t *params, stria_ucx_ctx_t **ctx_out)
{
    struct sockaddr_storage addr;
    socklen_t addrlen = 0;
    double ping_s, stale_s;
    stria_ucx_ctx_t *ctx = NULL;

    if (params == NULL || ctx_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_ucx_ctx_create: NULL argument");
    stria_status_t st = ctx_check(params, &ping_s, &stale_s, &addr, &addrlen);
    if (st == STRIA_OK)
        st = ctx_alloc(params, ping_s, stale_s, &ctx);
    if (st != STRIA_OK)
        return st;
    st = ctx_ucp_init(ctx, params);
    if (st == STRIA_OK)
        st = ctx_listen(ctx, &addr, addrlen);
    if (st == STRIA_OK)
        st = ctx_start(ctx);
    if (st != STRIA_OK) {
        ctx_unwind(ctx);
        return st;
    }
    stria_log_debug("ucx context listening on port %u", (unsigned)ctx->port);
    *ctx_out = ctx;
    return STRIA_OK;
}

uint16_t stria_ucx_ctx_port(const stria_ucx_ctx_t *ctx)
{
    return ctx != NULL ? ctx->port : 0;
}

void stria_ucx_ctx_stats(stria_ucx_ctx_t *ctx, stria_ucx_ctx_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    if (ctx == NULL)
        return;
    pthread_mutex_lock(&ctx->lock);
    *out = ctx->stats;
    for (stria__node_t *n = ctx->eps.next; n != &ctx->eps; n = n->next) {
        const stria__ucx_ep_t *e = STRIA__OF(n, stria__ucx_ep_t, node);
        out->endpoints_open += e->state == STRIA__EP_READY;
    }
    pthread_mutex_unlock(&ctx->lock);
}

size_t stria_ucx_ctx_endpoints(stria_ucx_ctx_t *ctx, stria_ucx_endpoint_info_t *out, size_t max)
{
    size_t n = 0;
    if (ctx == NULL)
        return 0;
    double now = stria_time_now();
    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *x = ctx->eps.next; x != &ctx->eps; x = x->next) {
        const stria__ucx_ep_t *e = STRIA__OF(x, stria__ucx_ep_t, node);
        if (e->state != STRIA__EP_READY)
            continue;
        if (n < max && out != NULL) {
            stria_ucx_endpoint_info_t *i = &out[n];
            memset(i, 0, sizeof(*i));
            snprintf(i->peer, sizeof(i->peer), "%s", e->peer);
            i->outgoing = e->outgoing;
            i->incarnation = e->peer_incarnation;
            i->age_s = now - e->ready_at;
            i->links = e->links;
            i->binds = e->binds;
            i->authenticated = e->keyed;
            i->dropping = e->drop;
        }
        n++;
    }
    pthread_mutex_unlock(&ctx->lock);
    return n;
}

int stria_ucx_ctx_drop_endpoints(stria_ucx_ctx_t *ctx, const char *peer)
{
    int n = 0;
    if (ctx == NULL)
        return 0;
    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *x = ctx->eps.next; x != &ctx->eps; x = x->next) {
        stria__ucx_ep_t *e = STRIA__OF(x, stria__ucx_ep_t, node);
        if (e->drop || e->state == STRIA__EP_CLOSING ||
            (peer != NULL && strcmp(peer, e->peer) != 0))
            continue;
        e->drop = true;
        n++;
    }
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_kick(ctx);
    return n;
}

/* ---- destroy --------------------------------------------------------------------------- */

/* With the progress thread gone: waits for a quiet spell, then refuses the
 * held connection requests and destroys the listener, with no time in
 * between. UCX 1.13's TCP connection manager keeps the connections it
 * accepted but whose request it has not delivered yet pointing at their
 * listener until the worker closes them: data that reaches one of those
 * after ucp_listener_destroy runs the callback of a freed listener on UCX's
 * async thread (openucx/ucx#11087). So no new connection may be under way
 * then: requests that arrive meanwhile (a ring peer retrying while this rank
 * shuts down) are held unanswered, which keeps their peers waiting instead
 * of retrying, until no new one came for STRIA__UCX_QUIET_S (1 s at most),
 * and refused ("shutting down") right before the listener goes; a refused
 * peer tries again 50 ms later at the soonest, when the listening socket is
 * closed. The accepted connections stay open until the listener is gone
 * (ctx_close_eps): a peer whose handshake is under way waits on its
 * connection, and the retry that closing it prompts finds no listener. */
static void ctx_close_listener(stria_ucx_ctx_t *ctx)
{
    stria__ucx_run_events(ctx);
    double quiet_until = stria_time_now() + STRIA__UCX_QUIET_S;
    double until = stria_time_now() + 1.0;
    for (int seen = ctx->n_held; stria_time_now() < quiet_until && stria_time_now() < until;) {
        if (ucp_worker_progress(ctx->worker) == 0) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
        stria__ucx_run_events(ctx);
        if (ctx->n_held != seen) {
            seen = ctx->n_held;
            quiet_until = stria_time_now() + STRIA__UCX_QUIET_S;
        }
    }
    for (int i = 0; i < ctx->n_held; i++)
        ucp_listener_reject(ctx->listener, ctx->held[i]);
    if (ctx->n_held > 0)
        stria_log_info("ucx context: %d connection request(s) refused (shutting down)",
                       ctx->n_held);
    ctx->n_held = 0;
    ucp_listener_destroy(ctx->listener);
    ctx->listener = NULL;
}

/* With the listener gone: closes every endpoint, waits (a bounded time)
 * for UCX to finish the closes, and frees the records. */
static void ctx_close_eps(stria_ucx_ctx_t *ctx)
{
    stria__ucx_run_events(ctx);
    stria__ucx_eps_close_all(ctx);
    while (!stria__list_empty(&ctx->events)) {
        stria__node_t *n = ctx->events.next;
        stria__list_del(n);
        free(STRIA__OF(n, stria__event_t, node));
    }
}

/* Frees the endpoint records left (the worker is gone: no callback comes). */
static void ctx_free_eps(stria_ucx_ctx_t *ctx)
{
    while (!stria__list_empty(&ctx->eps)) {
        stria__ucx_ep_t *e = STRIA__OF(ctx->eps.next, stria__ucx_ep_t, node);
        stria__list_del(&e->node);
        while (!stria__list_empty(&e->parked)) {
            stria__node_t *n = e->parked.next;
            stria__list_del(n);
            free(STRIA__OF(n, stria__parked_t, node));
        }
        free(e);
    }
}

void stria_ucx_ctx_destroy(stria_ucx_ctx_t *ctx)
{
    if (ctx == NULL)
        return;
    for (;;) {
        pthread_mutex_lock(&ctx->lock);
        stria__ucx_link_t *link = stria__list_empty(&ctx->links)
                                      ? NULL
                                      : STRIA__OF(ctx->links.next, stria__ucx_link_t, ctx_node);
        pthread_mutex_unlock(&ctx->lock);
        if (link == NULL)
            break;
        stria_log_warn("ucx context destroyed with the link of rank %d still open",
                       link->base.rank);
        stria__ucx_link_destroy(&link->base);
    }
    pthread_mutex_lock(&ctx->lock);
    ctx->stop = true;
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_kick(ctx);
    pthread_join(ctx->thread, NULL);

    /* The progress thread is gone: this thread now owns the worker. */
    ctx_close_listener(ctx);
    ctx_close_eps(ctx);
    ucp_worker_destroy(ctx->worker);
    ucp_cleanup(ctx->context);
    ctx_free_eps(ctx);
    close(ctx->kick_fd);
    close(ctx->ep_fd);
    pthread_cond_destroy(&ctx->cond);
    pthread_mutex_destroy(&ctx->lock);
    free(ctx->step_links);
    free(ctx->slots);
    free(ctx->slot_gen);
    stria_auth_wipe(ctx->ep_key, sizeof(ctx->ep_key));
    free(ctx);
}
