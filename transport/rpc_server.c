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

static void stria__conn_unref(stria__rpc_conn_t *c)
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

static void stria__call_destroy(stria_rpc_call_t *call);

static void stria__conn_close(stria__rpc_conn_t *c)
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
        stria__call_destroy(cur);
    }
    uv_close((uv_handle_t *)&c->tcp, stria__on_conn_closed);
}

static void stria__on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf);
static void stria__on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf);

static void stria__conn_read_start(stria__rpc_conn_t *c)
{
    if (c->reading || c->closing)
        return;
    if (uv_read_start((uv_stream_t *)&c->tcp, stria__on_alloc, stria__on_read) == 0)
        c->reading = true;
    else
        stria__conn_close(c);
}

static void stria__conn_read_stop(stria__rpc_conn_t *c)
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

/* Writes a frame and an optional payload; afterwards runs done(done_arg) and
 * destroys `call`. Takes ownership of `frame`. */
static void stria__conn_write(stria__rpc_conn_t *c, uint8_t *frame, size_t frame_len,
                              const void *payload, uint64_t payload_len, stria_rpc_done_cb done,
                              void *done_arg, stria_rpc_call_t *call)
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

static void stria__on_shutdown(uv_shutdown_t *req, int status)
{
    (void)status;
    stria__conn_unref(req->data);
    free(req);
}

/* A frame that cannot be trusted or a refused hello: send the error, half
 * close, and drain what the peer still sends (closing with unread input
 * would reset the connection and could destroy the error before the peer
 * reads it). The sweep timer or the peer's EOF ends the connection. */
static void stria__conn_fatal(stria__rpc_conn_t *c, stria_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void stria__conn_fatal(stria__rpc_conn_t *c, stria_status_t status, const char *fmt, ...)
{
    char msg[512];
    size_t len = 0;
    uint8_t *frame;
    uv_shutdown_t *sreq;
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    stria_log_warn("%s: closing connection from %s: %s", c->server->name, c->peer, msg);
    frame =
        stria__rpc_error_frame(c->h.request_id, c->h.method,
                               (uint16_t)(c->h.flags & STRIA_RPC_FLAG_HELLO), status, msg, &len);
    stria__conn_write(c, frame, len, NULL, 0, NULL, NULL, NULL);
    if (c->closing)
        return;
    c->phase = STRIA__RD_LINGER;
    c->discard_left = 64u << 20;
    c->linger_until = stria_time_now() + 1.0;
    sreq = calloc(1, sizeof(*sreq));
    if (sreq != NULL) {
        sreq->data = c;
        c->refs++;
        if (uv_shutdown(sreq, (uv_stream_t *)&c->tcp, stria__on_shutdown) < 0) {
            c->refs--;
            free(sreq);
            stria__conn_close(c);
        }
    }
}

/* Refuses the current request without closing: skips its payload, then
 * replies with the error. */
static void stria__conn_refuse(stria__rpc_conn_t *c, stria_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void stria__conn_refuse(stria__rpc_conn_t *c, stria_status_t status, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(c->pending_msg, sizeof(c->pending_msg), fmt, ap);
    va_end(ap);
    c->pending_status = status;
    stria_log_info("%s: refusing request %llu from %s: %s", c->server->name,
                   (unsigned long long)c->h.request_id, c->peer, c->pending_msg);
    c->discard_left = c->h.payload_len;
    if (c->discard_left > 0) {
        c->phase = STRIA__RD_DISCARD;
    } else {
        size_t len = 0;
        uint8_t *frame =
            stria__rpc_error_frame(c->h.request_id, c->h.method, 0, status, c->pending_msg, &len);
        c->phase = STRIA__RD_HEADER;
        stria__conn_write(c, frame, len, NULL, 0, NULL, NULL, NULL);
    }
}

/* ---- server: calls ----------------------------------------------------- */

static void stria__call_destroy(stria_rpc_call_t *call)
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
    return call->conn->admin;
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
    return call->cleanup_arg;
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

void stria_rpc_call_fail(stria_rpc_call_t *call, stria_status_t status, const char *fmt, ...)
{
    char msg[1024];
    uint8_t *frame;
    size_t len = 0;
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (status >= 0)
        status = STRIA_ERR_INTERNAL;
    frame = stria__rpc_error_frame(call->request_id, call->method, 0, status, msg, &len);
    stria__call_send(call, frame, len, NULL, 0, NULL, NULL);
}

/* ---- server: reading --------------------------------------------------- */

static void stria__on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf)
{
    stria__rpc_conn_t *c = handle->data;
    uint64_t left;

    (void)suggested;
    /* Hand out exactly the bytes of the current section, so that a read never
     * crosses from one section into the next and payloads land in place. */
    switch (c->phase) {
    case STRIA__RD_HEADER:
        buf->base = (char *)c->hdr + c->hdr_got;
        buf->len = STRIA_RPC_HEADER_SIZE - c->hdr_got;
        return;
    case STRIA__RD_PB:
        buf->base = (char *)c->pb + c->pb_got;
        buf->len = c->h.pb_len - c->pb_got;
        return;
    case STRIA__RD_PAYLOAD:
        left = c->cur->payload_len - c->payload_got;
        buf->base = (char *)c->cur->payload + c->payload_got;
        buf->len = left > (1u << 30) ? (1u << 30) : (size_t)left;
        return;
    case STRIA__RD_DISCARD:
    case STRIA__RD_LINGER:
        left = c->discard_left;
        buf->base = (char *)c->scratch;
        buf->len = left > sizeof(c->scratch) ? sizeof(c->scratch) : (size_t)left;
        return;
    }
}

static void stria__dispatch(stria__rpc_conn_t *c, stria_rpc_call_t *call)
{
    stria_rpc_server_t *srv = c->server;

    c->phase = STRIA__RD_HEADER;
    if (c->inflight >= srv->max_inflight) {
        c->paused = true;
        stria__conn_read_stop(c);
    }
    srv->methods[call->method].handler(srv->ctx, call);
}

static void stria__on_hello(stria__rpc_conn_t *c)
{
    stria_rpc_server_t *srv = c->server;
    stria__rpc_arena_t *arena = stria__rpc_arena_create(c->h.pb_len);
    Stria__V1__HelloRequest *req;
    Stria__V1__HelloReply rep = STRIA__V1__HELLO_REPLY__INIT;
    stria_rpc_header_t h = {.magic = STRIA_RPC_MAGIC,
                            .version = STRIA_RPC_VERSION,
                            .flags = STRIA_RPC_FLAG_REPLY | STRIA_RPC_FLAG_HELLO,
                            .request_id = c->h.request_id};
    bool admin;
    uint8_t *frame;
    size_t len = 0;

    if (arena == NULL) {
        stria__conn_fatal(c, STRIA_ERR_NO_MEMORY, "out of memory");
        return;
    }
    req = (Stria__V1__HelloRequest *)stria__rpc_unpack(&stria__v1__hello_request__descriptor, c->pb,
                                                       c->h.pb_len, arena);
    if (req == NULL) {
        stria__conn_fatal(c, STRIA_ERR_FORMAT, "hello: %s", stria_error_msg());
        goto free_arena;
    }
    if (req->protocol_version != STRIA_RPC_VERSION) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL,
                          "client speaks protocol version %u; this server speaks version %d",
                          req->protocol_version, STRIA_RPC_VERSION);
        goto free_arena;
    }
    if (strcmp(req->service, srv->service->name) != 0) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL, "this server exposes %s, not '%.64s'",
                          srv->service->name, req->service);
        goto free_arena;
    }
    admin = srv->admin_token != NULL && stria_rpc_token_equal(req->token, srv->admin_token);
    if (srv->token != NULL && !admin && !stria_rpc_token_equal(req->token, srv->token)) {
        stria__conn_fatal(c, STRIA_ERR_AUTH, "%s token", req->token[0] ? "wrong" : "missing");
        goto free_arena;
    }
    if (srv->admin_token == NULL)
        admin = true;
    c->hello_done = true;
    c->admin = admin;
    stria_log_info("%s: hello from %s (%.64s %.32s)%s", srv->name, c->peer, req->client_name,
                   req->software_version, admin ? ", admin" : "");
    rep.protocol_version = STRIA_RPC_VERSION;
    rep.software_version = (char *)STRIA_VERSION;
    rep.service = (char *)srv->service->name;
    rep.admin = admin;
    rep.max_pb_bytes = srv->max_pb;
    rep.max_payload_bytes = srv->max_payload;
    frame = stria__rpc_frame_build(&h, &rep.base, &len);
    c->phase = STRIA__RD_HEADER;
    stria__conn_write(c, frame, len, NULL, 0, NULL, NULL, NULL);
free_arena:
    stria__rpc_arena_destroy(arena);
}

static void stria__on_pb(stria__rpc_conn_t *c)
{
    stria_rpc_server_t *srv = c->server;
    uint32_t mi = c->h.method;
    const ProtobufCMethodDescriptor *md;
    const stria_rpc_method_t *m;
    stria__rpc_arena_t *arena;
    ProtobufCMessage *msg;
    stria_rpc_call_t *call;
    void *buf = NULL;
    stria_status_t st;

    if (c->h.flags & STRIA_RPC_FLAG_HELLO) {
        stria__on_hello(c);
        goto free_pb;
    }
    if (mi >= srv->service->n_methods) {
        stria__conn_refuse(c, STRIA_ERR_UNSUPPORTED,
                           "method index %u does not exist (%s has %u methods)", mi,
                           srv->service->name, srv->service->n_methods);
        goto free_pb;
    }
    md = &srv->service->methods[mi];
    m = &srv->methods[mi];
    if (m->handler == NULL) {
        stria__conn_refuse(c, STRIA_ERR_UNSUPPORTED, "method %s is not served here", md->name);
        goto free_pb;
    }
    if ((m->flags & STRIA_RPC_METHOD_ADMIN) && !c->admin) {
        stria__conn_refuse(c, STRIA_ERR_AUTH, "%s needs the admin token", md->name);
        goto free_pb;
    }
    if (c->h.payload_len > 0 && m->payload == NULL) {
        stria__conn_refuse(c, STRIA_ERR_INVALID_ARG, "%s takes no payload (got %llu bytes)",
                           md->name, (unsigned long long)c->h.payload_len);
        goto free_pb;
    }
    arena = stria__rpc_arena_create(c->h.pb_len);
    if (arena == NULL) {
        stria__conn_refuse(c, STRIA_ERR_NO_MEMORY, "%s: out of memory", md->name);
        goto free_pb;
    }
    msg = stria__rpc_unpack(md->input, c->pb, c->h.pb_len, arena);
    if (msg == NULL) {
        stria__rpc_arena_destroy(arena);
        stria__conn_refuse(c, STRIA_ERR_FORMAT, "%s: %s", md->name, stria_error_msg());
        goto free_pb;
    }
    call = calloc(1, sizeof(*call));
    if (call == NULL) {
        stria__rpc_arena_destroy(arena);
        stria__conn_refuse(c, STRIA_ERR_NO_MEMORY, "%s: out of memory", md->name);
        goto free_pb;
    }
    call->conn = c;
    call->request_id = c->h.request_id;
    call->method = mi;
    call->deadline = c->h.timeout_ms ? stria_time_now() + 1e-3 * c->h.timeout_ms : 0.0;
    call->request = msg;
    call->arena = arena;
    c->refs++;
    c->inflight++;
    free(c->pb);
    c->pb = NULL;
    if (c->h.payload_len == 0) {
        stria__dispatch(c, call);
        return;
    }
    stria_error_clear();
    st = m->payload(srv->ctx, call, c->h.payload_len, &buf);
    if (st != STRIA_OK || buf == NULL) {
        char msg_copy[512];
        snprintf(msg_copy, sizeof(msg_copy), "%s", stria_error_msg());
        stria__call_destroy(call);
        stria__conn_refuse(c, st != STRIA_OK ? st : STRIA_ERR_INTERNAL, "%s: %s", md->name,
                           msg_copy[0] ? msg_copy : "no buffer for the payload");
        return;
    }
    call->payload = buf;
    call->payload_len = c->h.payload_len;
    c->cur = call;
    c->payload_got = 0;
    c->phase = STRIA__RD_PAYLOAD;
    return;
free_pb:
    free(c->pb);
    c->pb = NULL;
}

static void stria__on_header(stria__rpc_conn_t *c)
{
    stria_rpc_server_t *srv = c->server;
    stria_rpc_header_t *h = &c->h;
    bool hello;

    stria_rpc_header_decode(c->hdr, h);
    c->hdr_got = 0;
    if (h->magic != STRIA_RPC_MAGIC) {
        h->request_id = 0;
        h->method = 0;
        h->flags = 0;
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL, "bad frame magic 0x%08x: not a stria RPC stream",
                          h->magic);
        return;
    }
    if (h->version != STRIA_RPC_VERSION) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL,
                          "frame of protocol version %u; this server speaks version %d", h->version,
                          STRIA_RPC_VERSION);
        return;
    }
    if ((h->flags & ~(STRIA_RPC_FLAG_HELLO)) != 0) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL, "unexpected flags 0x%x in a request frame",
                          h->flags);
        return;
    }
    if (h->status != 0) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL, "request frame carries status %d", h->status);
        return;
    }
    hello = (h->flags & STRIA_RPC_FLAG_HELLO) != 0;
    if (!c->hello_done && !hello) {
        stria__conn_fatal(c, STRIA_ERR_AUTH, "the first frame of a connection must be a hello");
        return;
    }
    if (c->hello_done && hello) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL, "hello sent twice");
        return;
    }
    if (h->pb_len > (hello ? STRIA_RPC_MAX_HELLO_PB : srv->max_pb)) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL,
                          "protobuf message of %u bytes exceeds the limit of %u bytes", h->pb_len,
                          hello ? STRIA_RPC_MAX_HELLO_PB : srv->max_pb);
        return;
    }
    if (h->payload_len > (hello ? 0 : srv->max_payload)) {
        stria__conn_fatal(
            c, STRIA_ERR_PROTOCOL, "payload of %llu bytes exceeds the limit of %llu bytes",
            (unsigned long long)h->payload_len, (unsigned long long)(hello ? 0 : srv->max_payload));
        return;
    }
    if (h->pb_len == 0) {
        stria__on_pb(c);
        return;
    }
    c->pb = malloc(h->pb_len);
    if (c->pb == NULL) {
        stria__conn_fatal(c, STRIA_ERR_NO_MEMORY, "out of memory for a %u-byte message", h->pb_len);
        return;
    }
    c->pb_got = 0;
    c->phase = STRIA__RD_PB;
}

static void stria__on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    stria__rpc_conn_t *c = stream->data;
    size_t n = (size_t)nread;

    (void)buf;
    if (nread < 0) {
        if (nread != UV_EOF)
            stria_log_debug("%s: read from %s: %s", c->server->name, c->peer,
                            uv_strerror((int)nread));
        stria__conn_close(c);
        return;
    }
    if (nread == 0 || c->closing)
        return;
    switch (c->phase) {
    case STRIA__RD_HEADER:
        c->hdr_got += n;
        if (c->hdr_got == STRIA_RPC_HEADER_SIZE)
            stria__on_header(c);
        return;
    case STRIA__RD_PB:
        c->pb_got += n;
        if (c->pb_got == c->h.pb_len)
            stria__on_pb(c);
        return;
    case STRIA__RD_PAYLOAD:
        c->payload_got += n;
        if (c->payload_got == c->cur->payload_len) {
            stria_rpc_call_t *call = c->cur;
            c->cur = NULL;
            stria__dispatch(c, call);
        }
        return;
    case STRIA__RD_DISCARD:
        c->discard_left -= n;
        if (c->discard_left == 0) {
            size_t len = 0;
            uint8_t *frame = stria__rpc_error_frame(c->h.request_id, c->h.method, 0,
                                                    c->pending_status, c->pending_msg, &len);
            c->phase = STRIA__RD_HEADER;
            stria__conn_write(c, frame, len, NULL, 0, NULL, NULL, NULL);
        }
        return;
    case STRIA__RD_LINGER:
        c->discard_left -= n;
        if (c->discard_left == 0)
            stria__conn_close(c);
        return;
    }
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
    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        stria_log_error("%s: out of memory accepting a connection", srv->name);
        return;
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
    if (uv_accept(listener, (uv_stream_t *)&c->tcp) < 0) {
        stria__conn_close(c);
        return;
    }
    snprintf(c->peer, sizeof(c->peer), "?");
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
        if (job->call != NULL)
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

static void stria__on_tick(uv_timer_t *timer)
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
    free(srv->token);
    free(srv->admin_token);
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
    if (p->service->magic != PROTOBUF_C__SERVICE_DESCRIPTOR_MAGIC)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rpc server: not a service descriptor");
    if (p->tick != NULL && !(p->tick_period_s > 0.0 && p->tick_period_s < 86400.0))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "rpc server: tick period must be in (0, 1 day)");
    st = stria__check_methods(p);
    if (st != STRIA_OK)
        return st;
    st = stria_addr_parse(p->listen, host, sizeof(host), &port);
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
    srv->token = stria__rpc_strdup_or_null(p->token);
    srv->admin_token = stria__rpc_strdup_or_null(p->admin_token);
    if (srv->methods == NULL || srv->name == NULL || (p->token && p->token[0] && !srv->token) ||
        (p->admin_token && p->admin_token[0] && !srv->admin_token)) {
        stria__server_free(srv);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "rpc server: out of memory");
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
        uv_timer_start(&srv->tick, stria__on_tick, ms, ms);
    }
    rc = pthread_create(&srv->thread, NULL, stria__loop_main, srv);
    if (rc != 0) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot start the loop thread: %s", srv->name,
                             strerror(rc));
        goto close_loop;
    }
    srv->thread_started = true;
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
    pthread_join(srv->thread, NULL);
    rc = uv_loop_close(&srv->loop);
    if (rc < 0)
        stria_log_warn("%s: event loop closed with handles open: %s", srv->name, uv_strerror(rc));
    stria__server_free(srv);
}
