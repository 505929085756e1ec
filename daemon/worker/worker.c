/*
 * stria worker: start, accessors, graceful shutdown and stop (see
 * stria_worker.h; the rooms are listed in worker_int.h).
 *
 * Its threads, locks and ownership are described in worker_int.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "stria_kernels.h"
#include "worker_int.h"

/* Waits until no call runs or `until` (stria_time_now()) passes. Lock held. */
static void wait_calls_locked(stria_worker_t *w, double until)
{
    while (w->running_calls > 0 && stria_time_now() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&w->cv, &w->lock, &ts);
    }
}

/* Graceful shutdown: no new sessions or calls. A running call gets one step
 * deadline to end on its own; then its ring link is aborted, which fails its
 * current step cleanly (its peers hear that this rank left) and it ends
 * within a ring link bind or the release of its transfers. Heartbeats go on
 * meanwhile, so the coordinator does not take the worker for dead; then the
 * worker deregisters, which takes it out of the ring at once and fails its
 * unfinished jobs with a reason naming it. Returns the calls still running. */
int stria_worker_shutdown(stria_worker_t *w, const char *reason)
{
    char status[128];
    pthread_mutex_lock(&w->lock);
    if (w->shut_down) {
        int still = w->running_calls;
        pthread_mutex_unlock(&w->lock);
        return still;
    }
    w->shut_down = true;
    w->stopping = true;
    int running = w->running_calls;
    double deadline = w->step_timeout_s;
    for (stria__wsess_t *s = w->sessions; s != NULL; s = s->next)
        if (s->step_timeout_s > deadline)
            deadline = s->step_timeout_s;
    pthread_mutex_unlock(&w->lock);
    if (running > 0) {
        snprintf(status, sizeof(status), "STATUS=shutting down: finishing %d running call(s)",
                 running);
        if (w->notify_status)
            stria_notify(status);
        stria_log_info("shutting down: %d running call(s) get %.1f s to finish", running, deadline);
    }
    pthread_mutex_lock(&w->lock);
    wait_calls_locked(w, stria_time_now() + deadline);
    if (w->running_calls > 0) {
        stria_log_warn("shutting down: aborting %d call(s) still running", w->running_calls);
        snprintf(w->abort_reason, sizeof(w->abort_reason), "worker %s", reason);
        w->abort_calls = true;
        for (stria__wsess_t *s = w->sessions; s != NULL; s = s->next) {
            __atomic_store_n(&s->sh.connect_cancel, true, __ATOMIC_RELEASE); /* binds under way */
            pthread_mutex_lock(&s->lock);
            if (s->sh.link != NULL)
                /* this rank leaves: its peers fail as for a lost peer
                 * (retryable), not as for a cancelled session */
                stria_link_abort(s->sh.link, STRIA_ERR_CLOSED, w->abort_reason);
            pthread_mutex_unlock(&s->lock);
        }
        /* An aborted call ends once the transport has its transfers in
         * flight back (seconds each). */
        wait_calls_locked(w, stria_time_now() + w->connect_timeout_s + 25.0);
    }
    int still_running = w->running_calls;
    w->heartbeat_stop = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    if (w->hb_started)
        pthread_join(w->hb_thread, NULL);
    w->hb_started = false;
    /* Read only now: a registration in flight when the stop came lands
     * before the join, and the coordinator must hear this worker leave. */
    if (!w->registered)
        return still_running;

    stria__wbeat_leave(w, reason);
    return still_running;
}

/* The address others use for a listener bound to `bound` (HOST:PORT): the
 * advertised host if set, else the bound host; the real port. */
static stria_status_t advertised(const char *advertise, const char *bound, int port, char *out,
                                 size_t len)
{
    char host[256];
    uint16_t ignored;
    stria_status_t st = stria_addr_parse(bound, host, sizeof(host), &ignored);
    if (st != STRIA_OK)
        return st;
    const char *h = advertise ? advertise : host;
    if (strcmp(h, "0.0.0.0") == 0 || strcmp(h, "::") == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "listening on %s needs --advertise HOST (the address other "
                               "machines reach this worker at)",
                               bound);
    snprintf(out, len, strchr(h, ':') ? "[%s]:%d" : "%s:%d", h, port);
    return STRIA_OK;
}

/* The default link factory: a UCX context of the worker's own. */
static stria_status_t ucx_start(stria_worker_t *w, const stria_worker_params_t *p)
{
    stria_ucx_ctx_params_t up;
    char ucx_host[256];
    uint16_t ucx_port;
    const char *listen = p->ucx_listen != NULL ? p->ucx_listen : "127.0.0.1:0";
    stria_status_t st = stria_addr_parse(listen, ucx_host, sizeof(ucx_host), &ucx_port);
    if (st != STRIA_OK)
        return st;
    memset(&up, 0, sizeof(up));
    up.listen_host = ucx_host;
    up.listen_port = ucx_port;
    up.tls = p->ucx_tls;
    up.net_devices = p->ucx_net_devices;
    /* With the workers' credential, ring endpoints prove a key derived
     * from it: only workers of this service keep endpoints with each other. */
    uint8_t ep_key[STRIA_AUTH_MAC_BYTES];
    if (w->worker_token != NULL) {
        static const char label[] = "stria ring endpoint key v1";
        stria_auth_part_t part = {label, sizeof(label)};
        stria_auth_hmac(w->worker_token, strlen(w->worker_token), &part, 1, ep_key);
        up.endpoint_key = ep_key;
    }
    st = stria_ucx_ctx_create(&up, &w->ucx);
    stria_auth_wipe(ep_key, sizeof(ep_key));
    if (st != STRIA_OK)
        return st;
    if ((st = advertised(p->advertise, listen, stria_ucx_ctx_port(w->ucx), w->ucx_address,
                         sizeof(w->ucx_address))) != STRIA_OK)
        return st;
    w->factory = stria_worker_ucx_links(w->ucx, w->ucx_address);
    return STRIA_OK;
}

/* Settings, and what the worker owns unless the caller lends it. */
static stria_status_t setup(stria_worker_t *w, const stria_worker_params_t *p)
{
    stria_status_t st;
    if (p->coordinator == NULL || p->coordinator[0] == '\0')
        return stria_error_set(STRIA_ERR_INVALID_ARG, "the coordinator address is required");
    if (strlen(p->coordinator) >= sizeof(w->coordinator))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "coordinator address too long");
    snprintf(w->coordinator, sizeof(w->coordinator), "%s", p->coordinator);
    if ((p->token != NULL && (w->token = strdup(p->token)) == NULL) ||
        (p->worker_token != NULL && (w->worker_token = strdup(p->worker_token)) == NULL))
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    w->memory_bytes = p->memory_bytes;
    if (w->memory_bytes <= 0) {
        long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
        w->memory_bytes = pages > 0 && psize > 0 ? (int64_t)pages * psize / 2 : (int64_t)1 << 30;
    }
    w->step_timeout_s = p->step_timeout_s > 0 ? p->step_timeout_s : 60.0;
    w->connect_timeout_s = p->connect_timeout_s > 0 ? p->connect_timeout_s : 30.0;
    w->notify_status = p->notify_status;
    if (p->host == NULL)
        gethostname(w->host, sizeof(w->host) - 1);
    else
        snprintf(w->host, sizeof(w->host), "%s", p->host);
    /* the worker's proof in GetJob: unguessable */
    if ((st = stria_random_bytes(&w->incarnation, sizeof(w->incarnation))) != STRIA_OK)
        return st;
    w->pool = p->pool;
    if (w->pool == NULL) {
        if ((st = stria_pool_create(p->threads, &w->pool)) != STRIA_OK)
            return st;
        w->own_pool = true;
    }
    w->dev = p->device;
    if (w->dev == NULL) {
        if ((st = stria_device_open("cpu", w->pool, &w->dev)) != STRIA_OK)
            return st;
        w->own_dev = true;
    }
    w->dev_staged = !stria_device_host_visible(w->dev);
    if ((st = stria__wpool_start(w)) != STRIA_OK)
        return st;
    unsigned cuda_index;
    w->has_device_index = p->has_device_index;
    w->device_index = p->device_index;
    if (sscanf(stria_device_name(w->dev), "cuda:%u", &cuda_index) == 1) {
        w->has_device_index = true;
        w->device_index = cuda_index;
    }
    w->metrics = p->metrics;
    if (w->metrics == NULL) {
        if ((st = stria_metrics_create(&w->metrics)) != STRIA_OK)
            return st;
        w->own_metrics = true;
    }
    stria__wmet_init(w);
    return STRIA_OK;
}

static stria_status_t serve(stria_worker_t *w, const stria_worker_params_t *p)
{
    static const stria_rpc_method_t methods[STRIA_RPC_WORKER_N_METHODS] = {
        STRIA_RPC_SERVE(WORKER_DROP_JOB, .handler = stria__wrpc_on_drop),
        STRIA_RPC_SERVE(WORKER_OPEN_SESSION, .handler = stria__wrpc_on_open),
        STRIA_RPC_SERVE(WORKER_SESSION_CALL, .handler = stria__wrpc_on_call,
                        .payload = stria__wrpc_on_call_payload),
    };
    stria_rpc_server_params_t sp;
    stria_status_t st;
    memset(&sp, 0, sizeof(sp));
    sp.listen = p->listen != NULL ? p->listen : "127.0.0.1:0";
    sp.service = &stria__v1__worker__descriptor;
    sp.methods = methods;
    sp.ctx = w;
    sp.token = w->token;
    sp.max_payload_bytes = p->max_payload_bytes;
    sp.tick = stria__wrpc_on_tick;
    sp.tick_period_s = STRIA__TICK_S;
    sp.name = "worker";
    if ((st = stria_rpc_server_start(&sp, &w->server)) != STRIA_OK)
        return st;
    return advertised(p->advertise, sp.listen, stria_rpc_server_port(w->server), w->rpc_address,
                      sizeof(w->rpc_address));
}

stria_status_t stria_worker_start(const stria_worker_params_t *params, stria_worker_t **worker_out)
{
    stria_status_t st;
    if (params == NULL || worker_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_worker_start: NULL argument");
    *worker_out = NULL;
    stria_worker_t *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    pthread_mutex_init(&w->lock, NULL);
    pthread_mutex_init(&w->coord_lock, NULL);
    pthread_mutex_init(&w->maps_lock, NULL);
    stria__wthr_init(w);
    pthread_cond_init(&w->cv, NULL);
    if ((st = setup(w, params)) != STRIA_OK)
        goto fail;
    if (params->links == NULL) {
        if ((st = ucx_start(w, params)) != STRIA_OK)
            goto fail;
    } else if (params->links->connect == NULL) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "the link factory has no connect function");
        goto fail;
    } else {
        w->factory = *params->links;
    }
    if ((st = serve(w, params)) != STRIA_OK)
        goto fail;
    if (params->runtime_dir != NULL && (st = stria__wshm_start(w, params->runtime_dir)) != STRIA_OK)
        goto fail;
    if (w->ucx == NULL)
        snprintf(w->ucx_address, sizeof(w->ucx_address), "%s",
                 w->factory.address != NULL ? w->factory.address : w->rpc_address);
    stria_log_info("worker on %s (ring link %s%s%s), device %s: %s, kernel %s, %d threads, %lld "
                   "MiB offered (memory pools reserved, committed on first use)",
                   w->rpc_address, w->ucx_address, w->shm ? ", local socket " : "", w->shm_socket,
                   stria_device_name(w->dev), stria_device_description(w->dev),
                   stria_kernels_variant(), stria_pool_size(w->pool),
                   (long long)(w->memory_bytes >> 20));
    if (pthread_create(&w->hb_thread, NULL, stria__wbeat_thread, w) != 0) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot start the heartbeat thread");
        goto fail;
    }
    w->hb_started = true;
    *worker_out = w;
    return STRIA_OK;
fail:
    stria_worker_stop(w);
    return st;
}

void stria_worker_stop(stria_worker_t *w)
{
    if (w == NULL)
        return;
    stria_worker_shutdown(w, "shut down");
    /* Aborted calls end within their deadlines: wait for every one, as each
     * holds the server's call and the session's buffers. */
    pthread_mutex_lock(&w->lock);
    while (w->running_calls > 0 || w->fetching > 0)
        pthread_cond_wait(&w->cv, &w->lock);
    pthread_mutex_unlock(&w->lock);
    stria__wshm_stop(w);
    stria_rpc_server_stop(w->server);
    pthread_mutex_lock(&w->lock);
    while (w->sessions != NULL)
        stria__wsess_drop_locked(w->sessions, STRIA_ERR_CANCELLED, "the worker stops");
    while (w->session_threads > 0) /* they use the link factory to the end */
        pthread_cond_wait(&w->cv, &w->lock);
    while (w->later != NULL) { /* not reported: the worker left */
        stria__wlater_t *f = w->later;
        w->later = f->next;
        free(f);
    }
    pthread_mutex_unlock(&w->lock);
    stria__wthr_stop(w); /* the pass threads ended their sessions */
    stria_ucx_ctx_destroy(w->ucx);
    stria_rpc_client_close(w->coord);
    stria__wpool_stop(w); /* before the device its segments come from */
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->coord_lock);
    pthread_mutex_destroy(&w->maps_lock);
    pthread_mutex_destroy(&w->lock);
    if (w->own_dev)
        stria_device_close(w->dev);
    if (w->own_pool)
        stria_pool_destroy(w->pool);
    if (w->own_metrics)
        stria_metrics_destroy(w->metrics);
    stria_auth_free_secret(w->token);
    stria_auth_free_secret(w->worker_token);
    free(w);
}

uint16_t stria_worker_port(const stria_worker_t *w)
{
    return w != NULL && w->server != NULL ? (uint16_t)stria_rpc_server_port(w->server) : 0;
}

const char *stria_worker_address(const stria_worker_t *w)
{
    return w->rpc_address;
}

const char *stria_worker_link_address(const stria_worker_t *w)
{
    return w->ucx_address;
}

const char *stria_worker_shm_socket(const stria_worker_t *w)
{
    return w->shm_socket;
}

const stria_rpc_server_t *stria_worker_server(const stria_worker_t *w)
{
    return w->server;
}

uint64_t stria_worker_id(const stria_worker_t *w)
{
    stria_worker_t *mw = (stria_worker_t *)w; /* the lock only */
    pthread_mutex_lock(&mw->lock);
    uint64_t id = w->registered ? w->worker_id : 0;
    pthread_mutex_unlock(&mw->lock);
    return id;
}

void stria_worker_usage(stria_worker_t *w, stria_worker_usage_t *out)
{
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&w->lock);
    for (stria__wsess_t *s = w->sessions; s != NULL; s = s->next)
        out->jobs++;
    out->running_passes = (uint32_t)w->running_calls;
    pthread_mutex_unlock(&w->lock);
    stria_mempool_stats_t s;
    stria__wpool_figures(w, &s);
    out->memory_in_use_bytes = s.admitted;
    out->pool_reserved_bytes = s.capacity;
    out->pool_in_use_bytes = s.in_use;
    out->pool_high_water_bytes = s.high_water;
    out->pool_committed_bytes = s.committed;
}
