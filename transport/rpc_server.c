/* The RPC server: a libuv loop on a thread of its own, connections, calls
 * and their replies from any thread. See stria_rpc.h for the contract. */
#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "rpc_server_int.h"
#include "stria.pb-c.h"

/* ---- server: connections ----------------------------------------------- */

static _Thread_local stria_rpc_server_t *stria__loop_server;

void stria__conn_unref(stria__rpc_conn_t *c)
{
    if (--c->refs == 0) {
        free(c->pb);
        free(c);
    }
}

static void stria__on_conn_closed(uv_handle_t *handle)
{
    stria__conn_unref(handle->data);
}

void stria__call_destroy(stria_rpc_call_t *call);

void stria__conn_close(stria__rpc_conn_t *c)
{
    stria_rpc_server_t *srv = c->server;

    if (c->closing)
        return;
    c->closing = true;
    if (c->prev != NULL)
        c->prev->next = c->next;
    else if (srv->conns == c)
        srv->conns = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    c->prev = c->next = NULL;
    srv->n_conns--;
    if (c->cur != NULL) {
        stria_rpc_call_t *cur = c->cur;
        c->cur = NULL;
        if (cur->payload_wait)
            cur->orphan = true; /* destroyed when its buffer is named */
        else
            stria__call_destroy(cur);
    }
    uv_close((uv_handle_t *)&c->tcp, stria__on_conn_closed);
}

void stria__conn_read_start(stria__rpc_conn_t *c)
{
    if (c->reading || c->closing || c->phase == STRIA__RD_WAIT)
        return;
    if (uv_read_start((uv_stream_t *)&c->tcp, stria__on_alloc, stria__on_read) == 0)
        c->reading = true;
    else
        stria__conn_close(c);
}

void stria__conn_read_stop(stria__rpc_conn_t *c)
{
    if (!c->reading)
        return;
    uv_read_stop((uv_stream_t *)&c->tcp);
    c->reading = false;
}

typedef struct {
    uv_write_t req;
    stria__rpc_conn_t *conn;
    uint8_t *frame;
    stria_rpc_done_cb done;
    void *done_arg;
    stria_rpc_call_t *call;
} stria__rpc_write_t;

static void stria__on_write(uv_write_t *req, int status)
{
    stria__rpc_write_t *w = (stria__rpc_write_t *)req;
    stria__rpc_conn_t *c = w->conn;

    if (status < 0 && status != UV_ECANCELED) {
        stria_log_debug("%s: write to %s failed: %s", c->server->name, c->peer,
                        uv_strerror(status));
        stria__conn_close(c);
    }
    free(w->frame);
    if (w->done != NULL)
        w->done(w->done_arg);
    if (w->call != NULL)
        stria__call_destroy(w->call);
    stria__conn_unref(c);
    free(w);
}

void stria__conn_write(stria__rpc_conn_t *c, uint8_t *frame, size_t frame_len, const void *payload,
                       uint64_t payload_len, stria_rpc_done_cb done, void *done_arg,
                       stria_rpc_call_t *call)
{
    stria__rpc_write_t *w;
    uv_buf_t bufs[2];
    unsigned nbufs = 1;
    int rc;

    if (c->closing || frame == NULL || (w = calloc(1, sizeof(*w))) == NULL) {
        if (frame == NULL && !c->closing)
            stria_log_error("%s: out of memory building a reply to %s", c->server->name, c->peer);
        free(frame);
        if (done != NULL)
            done(done_arg);
        if (call != NULL)
            stria__call_destroy(call);
        return;
    }
    w->conn = c;
    w->frame = frame;
    w->done = done;
    w->done_arg = done_arg;
    w->call = call;
    bufs[0].base = (char *)frame;
    bufs[0].len = frame_len;
    if (payload_len > 0) {
        bufs[1].base = (char *)payload;
        bufs[1].len = (size_t)payload_len;
        nbufs = 2;
    }
    c->refs++;
    rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, bufs, nbufs, stria__on_write);
    if (rc < 0) {
        stria_log_debug("%s: write to %s failed: %s", c->server->name, c->peer, uv_strerror(rc));
        stria__conn_close(c);
        stria__on_write(&w->req, UV_ECANCELED);
    }
}

/* ---- server: calls ----------------------------------------------------- */

void stria__call_destroy(stria_rpc_call_t *call)
{
    stria__rpc_conn_t *c = call->conn;
    stria_rpc_server_t *srv = c->server;

    if (call->cleanup != NULL)
        call->cleanup(call->cleanup_arg);
    stria__rpc_arena_destroy(call->arena);
    free(call);
    c->inflight--;
    if (c->paused && !c->closing && c->inflight < srv->max_inflight) {
        c->paused = false;
        stria__conn_read_start(c);
    }
    stria__conn_unref(c);
}

const ProtobufCMessage *stria_rpc_call_request(const stria_rpc_call_t *call)
{
    return call->request;
}

void *stria_rpc_call_payload(const stria_rpc_call_t *call, uint64_t *len_out)
{
    if (len_out != NULL)
        *len_out = call->payload_len;
    return call->payload;
}

uint32_t stria_rpc_call_method(const stria_rpc_call_t *call)
{
    return call->method;
}

bool stria_rpc_call_admin(const stria_rpc_call_t *call)
{
    return (call->conn->roles & STRIA_RPC_ROLE_ADMIN) != 0;
}

unsigned stria_rpc_call_roles(const stria_rpc_call_t *call)
{
    return call->conn->roles;
}

const stria_auth_session_t *stria_rpc_call_session(const stria_rpc_call_t *call)
{
    return &call->conn->session;
}

uint64_t stria_rpc_call_request_id(const stria_rpc_call_t *call)
{
    return call->request_id;
}

double stria_rpc_call_deadline(const stria_rpc_call_t *call)
{
    return call->deadline;
}

const char *stria_rpc_call_peer(const stria_rpc_call_t *call)
{
    return call->conn->peer;
}

void stria_rpc_call_set_cleanup(stria_rpc_call_t *call, stria_rpc_done_cb fn, void *arg)
{
    call->cleanup = fn;
    call->cleanup_arg = arg;
}

void *stria_rpc_call_cleanup_arg(const stria_rpc_call_t *call)
{
    return call->cleanup != NULL ? call->cleanup_arg : NULL;
}

static void stria__async_wake(stria_rpc_server_t *srv);

/* Queues a job for the loop thread (srv->lock held). */
static void stria__job_append_locked(stria_rpc_server_t *srv, stria__rpc_job_t *job)
{
    if (srv->jobs_tail != NULL)
        srv->jobs_tail->next = job;
    else
        srv->jobs_head = job;
    srv->jobs_tail = job;
}

/* Hands a finished frame to the loop thread (or writes it when already
 * there). */
static void stria__call_send(stria_rpc_call_t *call, uint8_t *frame, size_t frame_len,
                             const void *payload, uint64_t payload_len, stria_rpc_done_cb done,
                             void *done_arg)
{
    stria_rpc_server_t *srv = call->conn->server;
    stria__rpc_job_t *job;

    if (stria__loop_server == srv) {
        stria__conn_write(call->conn, frame, frame_len, payload, payload_len, done, done_arg, call);
        return;
    }
    job = calloc(1, sizeof(*job));
    if (job == NULL) {
        /* No way to reach the loop thread without memory: the reply is lost
         * and the client's deadline reports it. */
        stria_log_error("%s: out of memory queueing a reply", srv->name);
        free(frame);
        return;
    }
    *job = (stria__rpc_job_t){.call = call,
                              .frame = frame,
                              .frame_len = frame_len,
                              .payload = payload,
                              .payload_len = payload_len,
                              .done = done,
                              .done_arg = done_arg};
    pthread_mutex_lock(&srv->lock);
    stria__job_append_locked(srv, job);
    pthread_mutex_unlock(&srv->lock);
    stria__async_wake(srv);
}

void stria_rpc_call_payload_ready(stria_rpc_call_t *call, stria_status_t status, void *buf,
                                  const char *message)
{
    stria_rpc_server_t *srv = call->conn->server;
    stria__rpc_job_t *job = calloc(1, sizeof(*job));
    if (job == NULL) {
        /* No way to reach the loop thread without memory: the connection
         * stays stopped until the client gives up and closes it. */
        stria_log_error("%s: out of memory naming a payload buffer", srv->name);
        return;
    }
    job->call = call;
    job->payload_ready = true;
    job->status = status;
    job->buf = buf;
    snprintf(job->message, sizeof(job->message), "%s", message ? message : "");
    pthread_mutex_lock(&srv->lock);
    stria__job_append_locked(srv, job);
    pthread_mutex_unlock(&srv->lock);
    stria__async_wake(srv);
}

stria_status_t stria_rpc_call_reply(stria_rpc_call_t *call, const ProtobufCMessage *reply,
                                    const void *payload, uint64_t payload_len,
                                    stria_rpc_done_cb payload_done, void *payload_done_arg)
{
    stria_rpc_server_t *srv = call->conn->server;
    const ProtobufCMethodDescriptor *m = &srv->service->methods[call->method];
    stria_rpc_header_t h = {.magic = STRIA_RPC_MAGIC,
                            .version = STRIA_RPC_VERSION,
                            .flags = STRIA_RPC_FLAG_REPLY,
                            .method = call->method,
                            .request_id = call->request_id,
                            .payload_len = payload_len};
    uint8_t *frame;
    size_t len = 0;

    if (reply == NULL || reply->descriptor != m->output || (payload == NULL && payload_len > 0)) {
        stria_log_error("%s: handler of %s replied with %s", srv->name, m->name,
                        reply ? reply->descriptor->name : "no message");
        if (payload_done != NULL)
            payload_done(payload_done_arg);
        stria_rpc_call_fail(call, STRIA_ERR_INTERNAL, "%s: the server built an invalid reply",
                            m->name);
        return stria_error_set(STRIA_ERR_INVALID_ARG, "reply to %s must be a %s", m->name,
                               m->output->name);
    }
    frame = stria__rpc_frame_build(&h, reply, &len);
    if (frame != NULL && payload_done == NULL && payload_len > 0) {
        uint8_t *joined = realloc(frame, len + (size_t)payload_len);
        if (joined == NULL) {
            free(frame);
            frame = NULL;
        } else {
            memcpy(joined + len, payload, (size_t)payload_len);
            frame = joined;
            len += (size_t)payload_len;
            payload = NULL;
            payload_len = 0;
        }
    }
    if (frame == NULL) {
        if (payload_done != NULL)
            payload_done(payload_done_arg);
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "%s: the server ran out of memory", m->name);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "reply to %s: out of memory", m->name);
    }
    stria__call_send(call, frame, len, payload, payload_len, payload_done, payload_done_arg);
    return STRIA_OK;
}

static void stria__call_fail_v(stria_rpc_call_t *call, stria_status_t status, bool retryable,
                               const char *fmt, va_list ap)
{
    char msg[1024];
    uint8_t *frame;
    size_t len = 0;

    vsnprintf(msg, sizeof(msg), fmt, ap);
    if (status >= 0)
        status = STRIA_ERR_INTERNAL;
    frame =
        stria__rpc_error_frame_r(call->request_id, call->method, 0, status, msg, retryable, &len);
    stria__call_send(call, frame, len, NULL, 0, NULL, NULL);
}

void stria_rpc_call_fail(stria_rpc_call_t *call, stria_status_t status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    stria__call_fail_v(call, status, false, fmt, ap);
    va_end(ap);
}

void stria_rpc_call_fail_r(stria_rpc_call_t *call, stria_status_t status, bool retryable,
                           const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    stria__call_fail_v(call, status, retryable, fmt, ap);
    va_end(ap);
}

/* A new connection object, linked into the server's list. */
static stria__rpc_conn_t *stria__conn_new(stria_rpc_server_t *srv)
{
    stria__rpc_conn_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        stria_log_error("%s: out of memory accepting a connection", srv->name);
        return NULL;
    }
    c->server = srv;
    c->refs = 1;
    c->tcp.data = c;
    uv_tcp_init(&srv->loop, &c->tcp);
    c->next = srv->conns;
    if (srv->conns != NULL)
        srv->conns->prev = c;
    srv->conns = c;
    srv->n_conns++;
    snprintf(c->peer, sizeof(c->peer), "?");
    return c;
}

/* A connection whose socket is open: over the limit it is closed, else it
 * waits for its hello. */
static void stria__conn_begin(stria__rpc_conn_t *c)
{
    stria_rpc_server_t *srv = c->server;
    if (srv->n_conns > srv->max_connections) {
        stria_log_warn("%s: refusing %s: %u connections already open", srv->name, c->peer,
                       srv->max_connections);
        stria__conn_close(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    c->accepted_at = stria_time_now();
    c->phase = STRIA__RD_HEADER;
    stria__conn_read_start(c);
}

static void stria__on_connection(uv_stream_t *listener, int status)
{
    stria_rpc_server_t *srv = listener->data;
    stria__rpc_conn_t *c;
    struct sockaddr_storage ss;
    int sl = sizeof(ss);

    if (status < 0) {
        stria_log_warn("%s: accept: %s", srv->name, uv_strerror(status));
        return;
    }
    c = stria__conn_new(srv);
    if (c == NULL)
        return;
    if (uv_accept(listener, (uv_stream_t *)&c->tcp) < 0) {
        stria__conn_close(c);
        return;
    }
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &sl) == 0) {
        char ip[INET6_ADDRSTRLEN] = "?";
        if (ss.ss_family == AF_INET) {
            struct sockaddr_in *a = (struct sockaddr_in *)&ss;
            uv_ip4_name(a, ip, sizeof(ip));
            snprintf(c->peer, sizeof(c->peer), "%s:%u", ip, ntohs(a->sin_port));
        } else if (ss.ss_family == AF_INET6) {
            struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
            uv_ip6_name(a, ip, sizeof(ip));
            snprintf(c->peer, sizeof(c->peer), "[%s]:%u", ip, ntohs(a->sin6_port));
        }
    }
    stria__conn_begin(c);
}

stria_status_t stria_rpc_server_adopt(stria_rpc_server_t *srv, int fd, const char *peer)
{
    stria__rpc_conn_t *c = stria__conn_new(srv);
    int rc;
    if (c == NULL) {
        close(fd);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", srv->name);
    }
    snprintf(c->peer, sizeof(c->peer), "%s", peer ? peer : "?");
    rc = uv_tcp_open(&c->tcp, fd);
    if (rc < 0) {
        close(fd);
        stria__conn_close(c);
        return stria_error_set(STRIA_ERR_IO, "%s: cannot adopt a socket: %s", srv->name,
                               uv_strerror(rc));
    }
    stria__conn_begin(c);
    return STRIA_OK;
}

/* ---- server: loop ------------------------------------------------------ */

static void stria__on_handle_closed(uv_handle_t *handle)
{
    (void)handle;
}

static void stria__server_close_all(stria_rpc_server_t *srv)
{
    uv_close((uv_handle_t *)&srv->listener, stria__on_handle_closed);
    uv_close((uv_handle_t *)&srv->sweep, stria__on_handle_closed);
    if (srv->tick_cb != NULL)
        uv_close((uv_handle_t *)&srv->tick, stria__on_handle_closed);
    uv_close((uv_handle_t *)&srv->async, stria__on_handle_closed);
    while (srv->conns != NULL)
        stria__conn_close(srv->conns);
}

static void stria__on_async(uv_async_t *async)
{
    stria_rpc_server_t *srv = async->data;
    stria__rpc_job_t *job;
    bool stopping;

    pthread_mutex_lock(&srv->lock);
    job = srv->jobs_head;
    srv->jobs_head = srv->jobs_tail = NULL;
    stopping = srv->stopping;
    pthread_mutex_unlock(&srv->lock);
    while (job != NULL) {
        stria__rpc_job_t *next = job->next;
        if (job->payload_ready)
            stria__on_payload_ready(job);
        else if (job->call != NULL)
            stria__conn_write(job->call->conn, job->frame, job->frame_len, job->payload,
                              job->payload_len, job->done, job->done_arg, job->call);
        else
            job->done(job->done_arg);
        free(job);
        job = next;
    }
    if (stopping)
        stria__server_close_all(srv);
}

static void stria__async_wake(stria_rpc_server_t *srv)
{
    uv_async_send(&srv->async);
}

static void stria__on_sweep(uv_timer_t *timer)
{
    stria_rpc_server_t *srv = timer->data;
    double now = stria_time_now();
    stria__rpc_conn_t *c = srv->conns;

    __atomic_store_n(&srv->loop_alive_us, (int64_t)(now * 1e6), __ATOMIC_RELAXED);

    while (c != NULL) {
        stria__rpc_conn_t *next = c->next;
        if (!c->hello_done && c->phase != STRIA__RD_LINGER &&
            now - c->accepted_at > srv->hello_timeout_s) {
            stria_log_info("%s: closing %s: no hello within %.3g s", srv->name, c->peer,
                           srv->hello_timeout_s);
            stria__conn_close(c);
        } else if (c->phase == STRIA__RD_LINGER && now > c->linger_until) {
            stria__conn_close(c);
        }
        c = next;
    }
}

static void stria__rpcs_on_tick(uv_timer_t *timer)
{
    stria_rpc_server_t *srv = timer->data;
    srv->tick_cb(srv->ctx);
}

static void *stria__loop_main(void *arg)
{
    stria_rpc_server_t *srv = arg;
    stria__loop_server = srv;
    uv_run(&srv->loop, UV_RUN_DEFAULT);
    return NULL;
}

static void stria__server_free(stria_rpc_server_t *srv)
{
    free(srv->methods);
    stria__rpc_server_tokens_free(srv);
    free(srv->name);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
}

/* Every served slot of the table must name the descriptor's method of that
 * index: a table written against another version of the proto is refused
 * at start, not discovered when a request reaches the wrong handler. */
static stria_status_t stria__check_methods(const stria_rpc_server_params_t *p)
{
    const ProtobufCServiceDescriptor *svc = p->service;
    for (unsigned i = 0; i < svc->n_methods; i++) {
        const stria_rpc_method_t *m = &p->methods[i];
        if (m->handler == NULL) {
            if (m->payload != NULL)
                return stria_error_set(STRIA_ERR_INVALID_ARG,
                                       "rpc server %s: method %u (%s) has a payload callback "
                                       "but no handler",
                                       svc->name, i, svc->methods[i].name);
            continue;
        }
        if (m->name == NULL || strcmp(m->name, svc->methods[i].name) != 0)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "rpc server %s: the handler in slot %u is for '%s', but the "
                                   "service's method %u is '%s' (handler table out of step with "
                                   "stria.proto)",
                                   svc->name, i, m->name ? m->name : "(no name)", i,
                                   svc->methods[i].name);
    }
    return STRIA_OK;
}

stria_status_t stria_rpc_server_start(const stria_rpc_server_params_t *p,
                                      stria_rpc_server_t **server_out)
{
    stria_rpc_server_t *srv;
    char host[256];
    uint16_t port;
    struct sockaddr_storage ss;
    struct sockaddr_storage bound;
    int bl = sizeof(bound);
    struct sigaction sa;
    stria_status_t st;
    int rc;

    if (p == NULL || server_out == NULL || p->listen == NULL || p->service == NULL ||
        p->methods == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "rpc server: listen address, service and methods are required");
    if (p->tick != NULL && !(p->tick_period_s > 0.0 && p->tick_period_s < 86400.0))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "rpc server: tick period must be in (0, 1 day)");
    st = stria__rpc_endpoint(p->service, p->listen, "rpc server", host, sizeof(host), &port);
    if (st == STRIA_OK)
        st = stria__check_methods(p);
    if (st != STRIA_OK)
        return st;
    size_t ss_len;
    st = stria_addr_resolve(host, port, true, &ss, &ss_len);
    if (st != STRIA_OK)
        return st;

    srv = calloc(1, sizeof(*srv));
    if (srv == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "rpc server: out of memory");
    pthread_mutex_init(&srv->lock, NULL);
    srv->service = p->service;
    srv->ctx = p->ctx;
    srv->methods = calloc(p->service->n_methods ? p->service->n_methods : 1, sizeof(*srv->methods));
    srv->name = strdup(p->name ? p->name : p->service->short_name);
    if (srv->methods == NULL || srv->name == NULL) {
        stria__server_free(srv);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "rpc server: out of memory");
    }
    st = stria__rpc_server_tokens(srv, p);
    if (st != STRIA_OK) {
        stria__server_free(srv);
        return st;
    }
    memcpy(srv->methods, p->methods, p->service->n_methods * sizeof(*srv->methods));
    srv->max_pb = p->max_pb_bytes ? p->max_pb_bytes : STRIA_RPC_DEFAULT_MAX_PB;
    srv->max_payload = p->max_payload_bytes ? p->max_payload_bytes : STRIA_RPC_DEFAULT_MAX_PAYLOAD;
    srv->max_connections = p->max_connections ? p->max_connections : 1024;
    srv->max_inflight = p->max_inflight ? p->max_inflight : 64;
    srv->hello_timeout_s = p->hello_timeout_s > 0 ? p->hello_timeout_s : 10.0;
    srv->tick_cb = p->tick;
    srv->tick_period_s = p->tick_period_s;

    /* Writes to a vanished peer must fail with EPIPE, not kill the process. */
    if (sigaction(SIGPIPE, NULL, &sa) == 0 && sa.sa_handler == SIG_DFL)
        signal(SIGPIPE, SIG_IGN);

    rc = uv_loop_init(&srv->loop);
    if (rc < 0) {
        stria__server_free(srv);
        return stria_error_set(STRIA_ERR_IO, "rpc server: event loop: %s", uv_strerror(rc));
    }
    uv_tcp_init(&srv->loop, &srv->listener);
    srv->listener.data = srv;
    uv_async_init(&srv->loop, &srv->async, stria__on_async);
    srv->async.data = srv;
    uv_timer_init(&srv->loop, &srv->sweep);
    srv->sweep.data = srv;
    if (srv->tick_cb != NULL) {
        uv_timer_init(&srv->loop, &srv->tick);
        srv->tick.data = srv;
    }
    rc = uv_tcp_bind(&srv->listener, (struct sockaddr *)&ss, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&srv->listener, 128, stria__on_connection);
    if (rc == 0)
        rc = uv_tcp_getsockname(&srv->listener, (struct sockaddr *)&bound, &bl);
    if (rc < 0) {
        st = stria_error_set(STRIA_ERR_IO, "%s: cannot listen on %s: %s", srv->name, p->listen,
                             uv_strerror(rc));
        goto close_loop;
    }
    srv->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                  : ((struct sockaddr_in *)&bound)->sin_port);
    srv->loop_alive_us = (int64_t)(stria_time_now() * 1e6);
    uv_timer_start(&srv->sweep, stria__on_sweep, 250, 250);
    if (srv->tick_cb != NULL) {
        uint64_t ms = (uint64_t)ceil(srv->tick_period_s * 1000.0);
        uv_timer_start(&srv->tick, stria__rpcs_on_tick, ms, ms);
    }
    srv->no_thread = p->no_thread;
    rc = p->no_thread ? 0 : pthread_create(&srv->thread, NULL, stria__loop_main, srv);
    if (rc != 0) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot start the loop thread: %s", srv->name,
                             strerror(rc));
        goto close_loop;
    }
    srv->thread_started = !p->no_thread;
    stria_log_info("%s: listening on %s (port %u)", srv->name, p->listen, srv->port);
    *server_out = srv;
    return STRIA_OK;

close_loop:
    stria__server_close_all(srv);
    uv_run(&srv->loop, UV_RUN_DEFAULT);
    uv_loop_close(&srv->loop);
    stria__server_free(srv);
    return st;
}

bool stria_rpc_server_run(stria_rpc_server_t *srv, bool wait)
{
    stria__loop_server = srv;
    return uv_run(&srv->loop, wait ? UV_RUN_ONCE : UV_RUN_NOWAIT) != 0;
}

uint16_t stria_rpc_server_port(const stria_rpc_server_t *server)
{
    return server->port;
}

double stria_rpc_server_loop_age(const stria_rpc_server_t *server)
{
    int64_t at_us = __atomic_load_n(&server->loop_alive_us, __ATOMIC_RELAXED);
    return stria_time_now() - (double)at_us * 1e-6;
}

stria_status_t stria_rpc_server_post(stria_rpc_server_t *srv, stria_rpc_done_cb fn, void *arg)
{
    stria__rpc_job_t *job;

    if (srv == NULL || fn == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rpc server post: NULL argument");
    job = calloc(1, sizeof(*job));
    if (job == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "rpc server post: out of memory");
    job->done = fn;
    job->done_arg = arg;
    pthread_mutex_lock(&srv->lock);
    if (srv->stopping) {
        pthread_mutex_unlock(&srv->lock);
        free(job);
        return stria_error_set(STRIA_ERR_CLOSED, "rpc server post: the server is stopping");
    }
    stria__job_append_locked(srv, job);
    pthread_mutex_unlock(&srv->lock);
    stria__async_wake(srv);
    return STRIA_OK;
}

void stria_rpc_server_stop(stria_rpc_server_t *srv)
{
    int rc;

    if (srv == NULL)
        return;
    pthread_mutex_lock(&srv->lock);
    srv->stopping = true;
    pthread_mutex_unlock(&srv->lock);
    uv_async_send(&srv->async);
    if (srv->no_thread) {
        stria__loop_server = srv;
        uv_run(&srv->loop, UV_RUN_DEFAULT);
        stria__loop_server = NULL;
    } else {
        pthread_join(srv->thread, NULL);
    }
    rc = uv_loop_close(&srv->loop);
    if (rc < 0)
        stria_log_warn("%s: event loop closed with handles open: %s", srv->name, uv_strerror(rc));
    stria__server_free(srv);
}
