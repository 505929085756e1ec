/* The RPC server's reading side: the byte stream of a connection through
 * its phases (header, protobuf message, payload, discarding, lingering), the
 * hello, the checks of every frame and request, and the dispatch to the
 * method's handler. Everything here runs on the loop thread. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc_server_int.h"
#include "stria.pb-c.h"

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
void stria__conn_fatal(stria__rpc_conn_t *c, stria_status_t status, const char *fmt, ...)
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

/* Refuses the current request without closing: skips `skip` more bytes of
 * it (its payload, or its message and payload), then replies with the
 * error. */
static void stria__conn_refuse(stria__rpc_conn_t *c, uint64_t skip, stria_status_t status,
                               const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static void stria__conn_refuse(stria__rpc_conn_t *c, uint64_t skip, stria_status_t status,
                               const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(c->pending_msg, sizeof(c->pending_msg), fmt, ap);
    va_end(ap);
    c->pending_status = status;
    stria_log_info("%s: refusing request %llu from %s: %s", c->server->name,
                   (unsigned long long)c->h.request_id, c->peer, c->pending_msg);
    c->discard_left = skip;
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

/* ---- server: reading --------------------------------------------------- */

void stria__on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf)
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
    case STRIA__RD_WAIT: /* not reading */
        buf->base = NULL;
        buf->len = 0;
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
    char why[256];
    stria_status_t st;

    if (c->h.flags & STRIA_RPC_FLAG_HELLO) {
        stria__rpc_on_hello(c);
        goto free_pb;
    }
    if (mi >= srv->service->n_methods) {
        stria__conn_refuse(c, c->h.payload_len, STRIA_ERR_UNSUPPORTED,
                           "method index %u does not exist (%s has %u methods)", mi,
                           srv->service->name, srv->service->n_methods);
        goto free_pb;
    }
    md = &srv->service->methods[mi];
    m = &srv->methods[mi];
    if (m->handler == NULL) {
        stria__conn_refuse(c, c->h.payload_len, STRIA_ERR_UNSUPPORTED,
                           "method %s is not served here", md->name);
        goto free_pb;
    }
    if (!stria__rpc_method_allowed(c, m->flags, md->name, why, sizeof(why))) {
        stria__conn_refuse(c, c->h.payload_len, STRIA_ERR_AUTH, "%s", why);
        goto free_pb;
    }
    if (c->h.payload_len > 0 && m->payload == NULL) {
        stria__conn_refuse(c, c->h.payload_len, STRIA_ERR_INVALID_ARG,
                           "%s takes no payload (got %llu bytes)", md->name,
                           (unsigned long long)c->h.payload_len);
        goto free_pb;
    }
    arena = stria__rpc_arena_create(c->h.pb_len);
    if (arena == NULL) {
        stria__conn_refuse(c, c->h.payload_len, STRIA_ERR_NO_MEMORY, "%s: out of memory", md->name);
        goto free_pb;
    }
    msg = stria__rpc_unpack(md->input, c->pb, c->h.pb_len, arena);
    if (msg == NULL) {
        stria__rpc_arena_destroy(arena);
        stria__conn_refuse(c, c->h.payload_len, STRIA_ERR_FORMAT, "%s: %s", md->name,
                           stria_error_msg());
        goto free_pb;
    }
    call = calloc(1, sizeof(*call));
    if (call == NULL) {
        stria__rpc_arena_destroy(arena);
        stria__conn_refuse(c, c->h.payload_len, STRIA_ERR_NO_MEMORY, "%s: out of memory", md->name);
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
    call->payload_len = c->h.payload_len;
    st = m->payload(srv->ctx, call, c->h.payload_len, &buf);
    if (st == STRIA_RPC_PAYLOAD_LATER) {
        /* stop reading until stria_rpc_call_payload_ready() names the buffer */
        call->payload_wait = true;
        c->cur = call;
        c->phase = STRIA__RD_WAIT;
        stria__conn_read_stop(c);
        return;
    }
    if (st != STRIA_OK || buf == NULL) {
        char msg_copy[512];
        snprintf(msg_copy, sizeof(msg_copy), "%s", stria_error_msg());
        stria__call_destroy(call);
        stria__conn_refuse(c, c->h.payload_len, st != STRIA_OK ? st : STRIA_ERR_INTERNAL, "%s: %s",
                           md->name, msg_copy[0] ? msg_copy : "no buffer for the payload");
        return;
    }
    call->payload = buf;
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
    if (!hello && h->method < srv->service->n_methods && srv->methods[h->method].max_pb_bytes > 0 &&
        h->pb_len > srv->methods[h->method].max_pb_bytes) {
        stria__conn_refuse(c, (uint64_t)h->pb_len + h->payload_len, STRIA_ERR_INVALID_ARG,
                           "%s: message of %u bytes exceeds the method's limit of %u bytes",
                           srv->service->methods[h->method].name, h->pb_len,
                           srv->methods[h->method].max_pb_bytes);
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

void stria__on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
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
    case STRIA__RD_WAIT: /* not reading */
        return;
    }
}

void stria__on_payload_ready(stria__rpc_job_t *job)
{
    stria_rpc_call_t *call = job->call;
    stria__rpc_conn_t *c = call->conn;

    call->payload_wait = false;
    if (call->orphan) { /* the connection closed while the buffer was awaited */
        stria__call_destroy(call);
        return;
    }
    c->cur = NULL;
    if (job->status != STRIA_OK || job->buf == NULL) {
        const ProtobufCMethodDescriptor *md = &c->server->service->methods[call->method];
        stria__call_destroy(call);
        c->phase = STRIA__RD_HEADER; /* what conn_refuse leaves it in, or DISCARD */
        stria__conn_refuse(c, c->h.payload_len,
                           job->status != STRIA_OK ? job->status : STRIA_ERR_INTERNAL, "%s: %s",
                           md->name, job->message[0] ? job->message : "no buffer for the payload");
    } else {
        call->payload = job->buf;
        c->cur = call;
        c->payload_got = 0;
        c->phase = STRIA__RD_PAYLOAD;
    }
    stria__conn_read_start(c);
}
