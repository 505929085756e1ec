/* The blocking RPC client: one connection, calls with deadlines, payloads
 * straight into the caller's buffers. See stria_rpc.h for the contract. No
 * libuv: trainers link this through libstria. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "rpc_int.h"
#include "stria.pb-c.h"

/* ---- client ------------------------------------------------------------ */

struct stria_rpc_client {
    pthread_mutex_t lock;
    char *address;
    char *token;
    char *name;
    const ProtobufCServiceDescriptor *service;
    double connect_timeout_s;
    uint32_t max_pb;
    uint64_t max_payload;

    int fd;
    uint64_t next_id;
    unsigned roles;
    stria_auth_session_t session;
    bool server_error; /* the last failure was an error reply, stream in step */
    uint64_t server_max_payload;
    int abort_fd; /* an eventfd stria_rpc_client_abort() wakes waits with */
    bool aborted; /* atomic; sticky */
};

static void stria__cl_drop(stria_rpc_client_t *cl)
{
    if (cl->fd >= 0) {
        close(cl->fd);
        cl->fd = -1;
    }
}

/* Waits until fd is ready for `events` or the deadline passes. */
static stria_status_t stria__cl_wait(stria_rpc_client_t *cl, short events, double deadline)
{
    struct pollfd pfd[2] = {{.fd = cl->fd, .events = events},
                            {.fd = cl->abort_fd, .events = POLLIN}};
    int rc, ms = -1;

    for (;;) {
        if (__atomic_load_n(&cl->aborted, __ATOMIC_ACQUIRE))
            return stria_error_set(STRIA_ERR_CANCELLED, "call to %s abandoned", cl->address);
        if (deadline > 0) {
            double left = deadline - stria_time_now();
            if (left <= 0)
                return stria_error_set(STRIA_ERR_TIMEOUT, "deadline passed talking to %s",
                                       cl->address);
            ms = left > 3600.0 ? 3600000 : (int)ceil(left * 1000.0);
        }
        rc = poll(pfd, cl->abort_fd >= 0 ? 2 : 1, ms);
        if (rc > 0 && pfd[0].revents != 0)
            return STRIA_OK;
        if (rc < 0 && errno != EINTR)
            return stria_error_set(STRIA_ERR_IO, "poll on %s: %s", cl->address, strerror(errno));
    }
}

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

/* Steps *iov, *n past `done` bytes and past empty entries. */
static void stria__iov_advance(struct iovec **iov, size_t *n, size_t done)
{
    while (*n > 0 && done >= (*iov)->iov_len) {
        done -= (*iov)->iov_len;
        (*iov)++, (*n)--;
    }
    if (*n > 0) {
        (*iov)->iov_base = (char *)(*iov)->iov_base + done;
        (*iov)->iov_len -= done;
    }
}

/* After a receive that returned r <= 0: STRIA_OK to receive again (it was
 * interrupted, or the socket became readable), else the error. */
static stria_status_t stria__cl_recv_again(stria_rpc_client_t *cl, ssize_t r, double deadline)
{
    if (r == 0)
        return stria_error_set(STRIA_ERR_CLOSED, "%s closed the connection", cl->address);
    if (errno == EINTR)
        return STRIA_OK;
    if (errno == EAGAIN || errno == EWOULDBLOCK)
        return stria__cl_wait(cl, POLLIN, deadline);
    return stria_error_set(errno == ECONNRESET ? STRIA_ERR_CLOSED : STRIA_ERR_IO,
                           "receive from %s: %s", cl->address, strerror(errno));
}

/* Sends every byte of iov[0..n), which it consumes (advances). */
static stria_status_t stria__cl_send(stria_rpc_client_t *cl, struct iovec *iov, size_t n,
                                     double deadline)
{
    stria__iov_advance(&iov, &n, 0);
    while (n > 0) {
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = n < IOV_MAX ? n : IOV_MAX};
        ssize_t w = sendmsg(cl->fd, &mh, MSG_NOSIGNAL);
        if (w < 0) {
            stria_status_t st;
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return stria_error_set(errno == EPIPE || errno == ECONNRESET ? STRIA_ERR_CLOSED
                                                                             : STRIA_ERR_IO,
                                       "send to %s: %s", cl->address, strerror(errno));
            st = stria__cl_wait(cl, POLLOUT, deadline);
            if (st != STRIA_OK)
                return st;
            continue;
        }
        stria__iov_advance(&iov, &n, (size_t)w);
    }
    return STRIA_OK;
}

/* Fills iov[0..n) (which it consumes) from the socket. */
static stria_status_t stria__cl_recv_iov(stria_rpc_client_t *cl, struct iovec *iov, size_t n,
                                         double deadline)
{
    for (;;) {
        stria__iov_advance(&iov, &n, 0);
        if (n == 0)
            return STRIA_OK;
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = n < IOV_MAX ? n : IOV_MAX};
        ssize_t r = recvmsg(cl->fd, &mh, 0);
        stria_status_t st = STRIA_OK;
        if (r > 0)
            stria__iov_advance(&iov, &n, (size_t)r);
        else
            st = stria__cl_recv_again(cl, r, deadline);
        if (st != STRIA_OK)
            return st;
    }
}

/* Reads exactly len bytes; buf NULL discards them. */
static stria_status_t stria__cl_recv(stria_rpc_client_t *cl, void *buf, uint64_t len,
                                     double deadline)
{
    uint8_t scratch[16384];
    uint64_t got = 0;

    while (got < len) {
        size_t want = (size_t)(len - got > (1u << 30) ? (1u << 30) : len - got);
        void *dst = scratch;
        ssize_t r;
        if (buf != NULL)
            dst = (char *)buf + got;
        else if (want > sizeof(scratch))
            want = sizeof(scratch);
        r = recv(cl->fd, dst, want, 0);
        stria_status_t st = STRIA_OK;
        if (r > 0)
            got += (uint64_t)r;
        else
            st = stria__cl_recv_again(cl, r, deadline);
        if (st != STRIA_OK)
            return st;
    }
    return STRIA_OK;
}

/* Reads a reply header and its protobuf message, checks them against the
 * request, and decodes the message (or the RpcError) into `arena`. */
static stria_status_t stria__cl_read_reply(stria_rpc_client_t *cl, uint64_t request_id,
                                           uint32_t method, bool hello,
                                           const ProtobufCMessageDescriptor *desc, double deadline,
                                           stria__rpc_arena_t **arena_out,
                                           ProtobufCMessage **msg_out, uint64_t *payload_len_out)
{
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    stria_rpc_header_t h;
    uint16_t want_flags = STRIA_RPC_FLAG_REPLY | (hello ? STRIA_RPC_FLAG_HELLO : 0);
    stria__rpc_arena_t *arena;
    ProtobufCMessage *msg;
    uint8_t *pb = NULL;
    stria_status_t st;

    st = stria__cl_recv(cl, hb, sizeof(hb), deadline);
    if (st != STRIA_OK)
        return st;
    stria_rpc_header_decode(hb, &h);
    if (h.magic != STRIA_RPC_MAGIC)
        return stria_error_set(STRIA_ERR_PROTOCOL, "%s is not a stria RPC server (bad magic)",
                               cl->address);
    if (h.version != STRIA_RPC_VERSION)
        return stria_error_set(STRIA_ERR_PROTOCOL,
                               "%s speaks protocol version %u; this client speaks version %d",
                               cl->address, h.version, STRIA_RPC_VERSION);
    if (h.flags != want_flags || h.request_id != request_id || (!hello && h.method != method))
        return stria_error_set(STRIA_ERR_PROTOCOL,
                               "%s sent a reply that does not match the request (flags 0x%x, id "
                               "%llu, method %u)",
                               cl->address, h.flags, (unsigned long long)h.request_id, h.method);
    if (h.status > 0)
        return stria_error_set(STRIA_ERR_PROTOCOL, "%s sent status %d", cl->address, h.status);
    if (h.pb_len > cl->max_pb)
        return stria_error_set(STRIA_ERR_PROTOCOL,
                               "reply message of %u bytes from %s exceeds the limit of %u",
                               h.pb_len, cl->address, cl->max_pb);
    if (h.payload_len > cl->max_payload || (h.status != 0 && h.payload_len > 0))
        return stria_error_set(
            STRIA_ERR_PROTOCOL, "reply payload of %llu bytes from %s exceeds the limit of %llu",
            (unsigned long long)h.payload_len, cl->address, (unsigned long long)cl->max_payload);
    if (h.pb_len > 0) {
        pb = malloc(h.pb_len);
        if (pb == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for a %u-byte reply",
                                   h.pb_len);
        st = stria__cl_recv(cl, pb, h.pb_len, deadline);
        if (st != STRIA_OK)
            goto free_pb;
    }
    arena = stria__rpc_arena_create(h.pb_len);
    if (arena == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory decoding a reply");
        goto free_pb;
    }
    if (h.status != 0) {
        Stria__V1__RpcError *err = (Stria__V1__RpcError *)stria__rpc_unpack(
            &stria__v1__rpc_error__descriptor, pb, h.pb_len, arena);
        cl->server_error = true;
        st = stria_error_set((stria_status_t)h.status, "%s",
                             err && err->message[0] ? err->message
                                                    : stria_status_str((stria_status_t)h.status));
        stria_error_set_retryable(err != NULL && err->retryable);
        stria__rpc_arena_destroy(arena);
        goto free_pb;
    }
    msg = stria__rpc_unpack(desc, pb, h.pb_len, arena);
    if (msg == NULL) {
        st = stria_error_wrap(STRIA_ERR_PROTOCOL, "reply from %s", cl->address);
        stria__rpc_arena_destroy(arena);
        goto free_pb;
    }
    *arena_out = arena;
    *msg_out = msg;
    *payload_len_out = h.payload_len;
    st = STRIA_OK;
free_pb:
    free(pb);
    return st;
}

/* Sends one hello frame and reads its reply (in *arena_out, *rep_out). */
static stria_status_t stria__cl_hello_frame(stria_rpc_client_t *cl,
                                            const Stria__V1__HelloRequest *hello, double deadline,
                                            stria__rpc_arena_t **arena_out,
                                            Stria__V1__HelloReply **rep_out)
{
    stria_rpc_header_t h = {
        .magic = STRIA_RPC_MAGIC, .version = STRIA_RPC_VERSION, .flags = STRIA_RPC_FLAG_HELLO};
    ProtobufCMessage *msg = NULL;
    uint64_t plen = 0;
    struct iovec iov;
    size_t flen = 0;
    h.request_id = cl->next_id++;
    uint8_t *frame = stria__rpc_frame_build(&h, &hello->base, &flen);
    if (frame == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory building a hello");
    iov.iov_base = frame;
    iov.iov_len = flen;
    stria_status_t st = stria__cl_send(cl, &iov, 1, deadline);
    free(frame);
    if (st == STRIA_OK)
        st = stria__cl_read_reply(cl, h.request_id, 0, true, &stria__v1__hello_reply__descriptor,
                                  deadline, arena_out, &msg, &plen);
    if (st != STRIA_OK)
        return st;
    Stria__V1__HelloReply *rep = (Stria__V1__HelloReply *)msg;
    if (rep->protocol_version != STRIA_RPC_VERSION || strcmp(rep->service, cl->service->name) ||
        rep->server_nonce.len != STRIA_AUTH_NONCE_BYTES) {
        st = stria_error_set(STRIA_ERR_PROTOCOL,
                             "%s answered as %s version %u (%zu-byte nonce), expected %s %d",
                             cl->address, rep->service, rep->protocol_version,
                             rep->server_nonce.len, cl->service->name, STRIA_RPC_VERSION);
        stria__rpc_arena_destroy(*arena_out);
        *arena_out = NULL;
        return st;
    }
    *rep_out = rep;
    return STRIA_OK;
}

/* The hello: nonces, then (when the server challenges) the proof of the
 * token and the check of the server's; see proto/stria.proto. */
static stria_status_t stria__cl_hello(stria_rpc_client_t *cl, double deadline)
{
    Stria__V1__HelloRequest hello = STRIA__V1__HELLO_REQUEST__INIT;
    Stria__V1__HelloReply *rep = NULL;
    stria__rpc_arena_t *arena = NULL;
    uint8_t proof[STRIA_AUTH_MAC_BYTES], want[STRIA_AUTH_MAC_BYTES];
    stria_status_t st;

    hello.protocol_version = STRIA_RPC_VERSION;
    hello.software_version = (char *)STRIA_VERSION;
    hello.service = (char *)cl->service->name;
    hello.client_name = cl->name ? cl->name : (char *)"";
    st = stria_auth_random(cl->session.client_nonce, STRIA_AUTH_NONCE_BYTES);
    if (st != STRIA_OK)
        return st;
    hello.client_nonce.data = cl->session.client_nonce;
    hello.client_nonce.len = STRIA_AUTH_NONCE_BYTES;
    st = stria__cl_hello_frame(cl, &hello, deadline, &arena, &rep);
    if (st != STRIA_OK)
        return st;
    memcpy(cl->session.server_nonce, rep->server_nonce.data, STRIA_AUTH_NONCE_BYTES);
    if (rep->challenge) {
        stria__rpc_arena_destroy(arena);
        arena = NULL;
        hello.client_nonce.len = 0;
        if (cl->token != NULL) {
            stria_auth_hello_mac(cl->token, cl->service->name, cl->session.client_nonce,
                                 cl->session.server_nonce, false, proof);
            hello.proof.data = proof;
            hello.proof.len = sizeof(proof);
        }
        st = stria__cl_hello_frame(cl, &hello, deadline, &arena, &rep);
        if (st != STRIA_OK)
            return st;
        if (rep->challenge || stria_auth_equal(rep->server_nonce.data, cl->session.server_nonce,
                                               STRIA_AUTH_NONCE_BYTES) == false) {
            stria__rpc_arena_destroy(arena);
            return stria_error_set(STRIA_ERR_PROTOCOL, "%s changed its nonce in the hello",
                                   cl->address);
        }
    }
    if (cl->token != NULL) {
        /* Only a server that knows the same token can answer this. */
        stria_auth_hello_mac(cl->token, cl->service->name, cl->session.client_nonce,
                             cl->session.server_nonce, true, want);
        bool ok = rep->challenge == false && rep->proof.len == STRIA_AUTH_MAC_BYTES &&
                  stria_auth_equal(want, rep->proof.data, STRIA_AUTH_MAC_BYTES);
        if (!ok) {
            const char *why = rep->proof.len == 0 ? "it checks no credential" : "wrong proof";
            stria__rpc_arena_destroy(arena);
            return stria_error_set(STRIA_ERR_AUTH,
                                   "%s did not prove that it knows the token (%s); refusing to "
                                   "talk to it",
                                   cl->address, why);
        }
    }
    cl->roles = rep->roles;
    cl->server_max_payload = rep->max_payload_bytes;
    stria_auth_session_derive(&cl->session, cl->token);
    stria__rpc_arena_destroy(arena);
    return STRIA_OK;
}

static stria_status_t stria__cl_open(stria_rpc_client_t *cl, double deadline)
{
    char host[256], ps[8];
    uint16_t port;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL, *ai;
    stria_status_t st;
    int rc, one = 1, err = 0;

    st = stria_addr_parse(cl->address, host, sizeof(host), &port);
    if (st != STRIA_OK)
        return st;
    snprintf(ps, sizeof(ps), "%u", port);
    rc = getaddrinfo(host, ps, &hints, &res);
    if (rc != 0)
        return stria_error_set(STRIA_ERR_IO, "cannot resolve '%s': %s", host, gai_strerror(rc));
    st = stria_error_set(STRIA_ERR_IO, "cannot connect to %s", cl->address);
    for (ai = res; ai != NULL; ai = ai->ai_next) {
        socklen_t el = sizeof(err);
        cl->fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (cl->fd < 0) {
            st = stria_error_set(STRIA_ERR_IO, "socket: %s", strerror(errno));
            continue;
        }
        rc = connect(cl->fd, ai->ai_addr, ai->ai_addrlen);
        if (rc < 0 && errno == EINPROGRESS) {
            st = stria__cl_wait(cl, POLLOUT, deadline);
            if (st == STRIA_OK && getsockopt(cl->fd, SOL_SOCKET, SO_ERROR, &err, &el) == 0)
                rc = err ? -1 : 0;
            errno = err;
            if (st != STRIA_OK) {
                stria__cl_drop(cl);
                continue;
            }
        }
        if (rc == 0)
            break;
        st =
            stria_error_set(STRIA_ERR_IO, "cannot connect to %s: %s", cl->address, strerror(errno));
        stria__cl_drop(cl);
    }
    freeaddrinfo(res);
    if (cl->fd < 0)
        return st;
    setsockopt(cl->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    st = stria__cl_hello(cl, deadline);
    if (st != STRIA_OK) {
        stria_error_wrap(st, "hello to %s", cl->address);
        stria__cl_drop(cl);
    }
    return st;
}

stria_status_t stria_rpc_client_connect(const stria_rpc_client_params_t *p,
                                        stria_rpc_client_t **client_out)
{
    stria_rpc_client_t *cl;
    stria_status_t st;

    if (p == NULL || client_out == NULL || p->address == NULL || p->service == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "rpc client: address and service are required");
    st = stria__rpc_endpoint(p->service, p->address, "rpc client", NULL, 0, NULL);
    if (st != STRIA_OK)
        return st;
    cl = calloc(1, sizeof(*cl));
    if (cl == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "rpc client: out of memory");
    cl->fd = -1;
    cl->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK); /* -1: no abort, waits still work */
    cl->next_id = 1;
    pthread_mutex_init(&cl->lock, NULL);
    cl->service = p->service;
    cl->address = strdup(p->address);
    cl->token = stria__rpc_strdup_or_null(p->token);
    cl->name = stria__rpc_strdup_or_null(p->client_name);
    cl->connect_timeout_s = p->connect_timeout_s > 0 ? p->connect_timeout_s : 10.0;
    cl->max_pb = p->max_pb_bytes ? p->max_pb_bytes : STRIA_RPC_DEFAULT_MAX_PB;
    cl->max_payload = p->max_payload_bytes ? p->max_payload_bytes : STRIA_RPC_DEFAULT_MAX_PAYLOAD;
    if (cl->address == NULL || (p->token && p->token[0] && !cl->token) ||
        (p->client_name && p->client_name[0] && !cl->name)) {
        stria_rpc_client_close(cl);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "rpc client: out of memory");
    }
    st = stria__cl_open(cl, stria_time_now() + cl->connect_timeout_s);
    if (st != STRIA_OK) {
        stria_rpc_client_close(cl);
        return st;
    }
    *client_out = cl;
    return STRIA_OK;
}

void stria_rpc_client_close(stria_rpc_client_t *cl)
{
    if (cl == NULL)
        return;
    stria__cl_drop(cl);
    if (cl->abort_fd >= 0)
        close(cl->abort_fd);
    free(cl->address);
    if (cl->token != NULL)
        memset(cl->token, 0, strlen(cl->token));
    stria_auth_free_secret(cl->token);
    free(cl->name);
    pthread_mutex_destroy(&cl->lock);
    free(cl);
}

void stria_rpc_client_abort(stria_rpc_client_t *cl)
{
    if (cl == NULL)
        return;
    __atomic_store_n(&cl->aborted, true, __ATOMIC_RELEASE);
    if (cl->abort_fd >= 0)
        (void)eventfd_write(cl->abort_fd, 1);
}

int stria_rpc_client_fd(stria_rpc_client_t *cl)
{
    pthread_mutex_lock(&cl->lock);
    int fd = cl->fd;
    pthread_mutex_unlock(&cl->lock);
    return fd;
}

bool stria_rpc_client_check_idle(stria_rpc_client_t *cl)
{
    if (__atomic_load_n(&cl->aborted, __ATOMIC_ACQUIRE))
        return false;
    pthread_mutex_lock(&cl->lock);
    if (cl->fd >= 0) {
        struct pollfd p = {.fd = cl->fd, .events = POLLIN};
        if (poll(&p, 1, 0) != 0) /* readable (EOF, a reset, bytes unasked) or an error */
            stria__cl_drop(cl);
    }
    pthread_mutex_unlock(&cl->lock);
    return true;
}

bool stria_rpc_client_admin(const stria_rpc_client_t *cl)
{
    return (cl->roles & STRIA_RPC_ROLE_ADMIN) != 0;
}

unsigned stria_rpc_client_roles(const stria_rpc_client_t *cl)
{
    return cl->roles;
}

/* Packs a request, proving its job secret in field 60 when it names one
 * (on a shallow copy: the caller's message stays as it was). */
static stria_status_t stria__cl_frame(stria_rpc_client_t *cl, const stria_rpc_request_t *req,
                                      const stria_rpc_header_t *h, uint8_t **frame_out,
                                      size_t *flen)
{
    const ProtobufCMessageDescriptor *d = req->request->descriptor;
    *frame_out = NULL;
    if (req->job_secret == NULL) {
        *frame_out = stria__rpc_frame_build(h, req->request, flen);
        return *frame_out
                   ? STRIA_OK
                   : stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory building the request");
    }
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(d, 60);
    if (f == NULL || f->type != PROTOBUF_C_TYPE_BYTES || f->label == PROTOBUF_C_LABEL_REPEATED)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s has no job_proof field (60)", d->name);
    uint8_t proof[STRIA_AUTH_MAC_BYTES];
    void *copy = malloc(d->sizeof_message);
    if (copy == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory building the request");
    memcpy(copy, req->request, d->sizeof_message);
    stria_job_secret_prove_extra(req->job_secret, &cl->session, h->request_id, h->method,
                                 req->job_id, req->proof_extra, req->proof_extra_len, proof);
    ProtobufCBinaryData *bd = (ProtobufCBinaryData *)(void *)((char *)copy + f->offset);
    bd->data = proof;
    bd->len = sizeof(proof);
    *frame_out = stria__rpc_frame_build(h, copy, flen);
    free(copy);
    return *frame_out ? STRIA_OK
                      : stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory building the request");
}

uint64_t stria_rpc_client_max_payload(const stria_rpc_client_t *cl)
{
    return cl->server_max_payload;
}

bool stria_rpc_client_server_error(const stria_rpc_client_t *client)
{
    return client != NULL && client->server_error;
}

/* Prefixes the method name to the thread's message, unless the server's
 * message names it already ("GetJob: job 9 is unknown"). */
static stria_status_t stria__wrap_method(stria_status_t st, const char *method)
{
    const char *msg = stria_error_msg();
    size_t n = strlen(method);
    if (strncmp(msg, method, n) == 0 && msg[n] == ':')
        return st;
    return stria_error_wrap(st, "%s", method);
}

/* The request's payload pieces after the frame, in iov[1..]; returns their
 * number (the frame's included) or 0 when out of memory. */
static size_t stria__cl_request_iov(const stria_rpc_request_t *req, uint8_t *frame, size_t flen,
                                    struct iovec *two, struct iovec **iov_out)
{
    struct iovec *iov = two;
    size_t n = 1;
    if (req->payload_iov != NULL) {
        if ((iov = malloc((req->payload_iovcnt + 1) * sizeof(*iov))) == NULL)
            return 0;
        memcpy(iov + 1, req->payload_iov, req->payload_iovcnt * sizeof(*iov));
        n += req->payload_iovcnt;
    } else if (req->payload_len > 0) {
        iov[1].iov_base = (void *)req->payload;
        iov[1].iov_len = (size_t)req->payload_len;
        n = 2;
    }
    iov[0].iov_base = frame;
    iov[0].iov_len = flen;
    *iov_out = iov;
    return n;
}

void stria_rpc_reply_free(stria_rpc_reply_t *reply)
{
    if (reply == NULL)
        return;
    stria__rpc_arena_destroy(reply->stria__arena);
    if (reply->stria__payload_owned)
        free(reply->payload);
    memset(reply, 0, sizeof(*reply));
}

/* Reads a reply payload of plen bytes into the request's buffer, its pieces,
 * or an allocated buffer. On failure the stream is dropped unless it stayed
 * in step (a payload that did not fit, skipped). */
static stria_status_t stria__cl_reply_payload(stria_rpc_client_t *cl,
                                              const stria_rpc_request_t *req, const char *method,
                                              uint64_t plen, double deadline, void **payload_out,
                                              bool *owned_out)
{
    uint64_t cap = req->reply_buf_cap;
    stria_status_t st;
    if (req->reply_iov != NULL) {
        cap = 0;
        for (size_t i = 0; i < req->reply_iovcnt; i++)
            cap += req->reply_iov[i].iov_len;
    }
    if ((req->reply_buf != NULL || req->reply_iov != NULL) && plen > cap) {
        if ((st = stria__cl_recv(cl, NULL, plen, deadline)) != STRIA_OK) {
            stria__cl_drop(cl);
            return stria__wrap_method(st, method);
        }
        return stria_error_set(STRIA_ERR_NO_MEMORY,
                               "%s: reply payload of %llu bytes does not fit the %llu-byte buffer",
                               method, (unsigned long long)plen, (unsigned long long)cap);
    }
    if (req->reply_iov != NULL) {
        struct iovec *iov = malloc(req->reply_iovcnt * sizeof(*iov));
        size_t n = 0;
        for (uint64_t left = plen; iov != NULL && left > 0; n++) {
            iov[n] = req->reply_iov[n];
            if (iov[n].iov_len > left)
                iov[n].iov_len = (size_t)left;
            left -= iov[n].iov_len;
        }
        st = iov != NULL ? stria__cl_recv_iov(cl, iov, n, deadline)
                         : stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
        free(iov);
        *payload_out = req->reply_iovcnt > 0 ? req->reply_iov[0].iov_base : NULL;
        *owned_out = false;
    } else {
        void *payload = req->reply_buf;
        *owned_out = payload == NULL;
        if (payload == NULL && (payload = malloc((size_t)plen)) == NULL) {
            if ((st = stria__cl_recv(cl, NULL, plen, deadline)) != STRIA_OK)
                stria__cl_drop(cl);
            return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory for a %llu-byte reply",
                                   method, (unsigned long long)plen);
        }
        st = stria__cl_recv(cl, payload, plen, deadline);
        if (st != STRIA_OK && *owned_out)
            free(payload);
        *payload_out = st == STRIA_OK ? payload : NULL;
    }
    if (st != STRIA_OK) {
        stria__cl_drop(cl);
        return stria__wrap_method(st, method);
    }
    return STRIA_OK;
}

/* Sends one request (frame and payload); its id in *id_out. */
static stria_status_t stria__cl_send_request(stria_rpc_client_t *cl, const stria_rpc_request_t *req,
                                             uint64_t payload_len, double deadline,
                                             uint64_t *id_out)
{
    const ProtobufCMethodDescriptor *md = &cl->service->methods[req->method];
    stria_rpc_header_t h = {.magic = STRIA_RPC_MAGIC,
                            .version = STRIA_RPC_VERSION,
                            .method = req->method,
                            .payload_len = payload_len};
    struct iovec two[2], *iov = NULL;
    size_t flen = 0;
    stria_status_t st;

    if (cl->fd < 0) {
        double cd = stria_time_now() + cl->connect_timeout_s;
        st = stria__cl_open(cl, deadline > 0 && deadline < cd ? deadline : cd);
        if (st != STRIA_OK)
            return st;
    }
    if (payload_len > cl->server_max_payload)
        return stria_error_set(
            STRIA_ERR_INVALID_ARG, "%s: payload of %llu bytes exceeds the server's limit of %llu",
            md->name, (unsigned long long)payload_len, (unsigned long long)cl->server_max_payload);
    if (req->timeout_s > 0)
        h.timeout_ms = req->timeout_s * 1000.0 >= UINT32_MAX
                           ? UINT32_MAX
                           : (uint32_t)ceil(req->timeout_s * 1000.0);
    h.request_id = cl->next_id++;
    uint8_t *frame = NULL;
    st = stria__cl_frame(cl, req, &h, &frame, &flen);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "%s", md->name);
    size_t n = stria__cl_request_iov(req, frame, flen, two, &iov);
    if (n == 0) {
        free(frame);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory building the request",
                               md->name);
    }
    st = stria__cl_send(cl, iov, n, deadline);
    if (iov != two)
        free(iov);
    free(frame);
    if (st != STRIA_OK) {
        stria__cl_drop(cl);
        return stria__wrap_method(st, md->name);
    }
    *id_out = h.request_id;
    return STRIA_OK;
}

/* Reads the reply of request `id` (and its payload). An error reply leaves
 * the stream in step (cl->server_error); any other failure drops it. */
static stria_status_t stria__cl_recv_reply(stria_rpc_client_t *cl, const stria_rpc_request_t *req,
                                           uint64_t id, double deadline,
                                           stria_rpc_reply_t *reply_out)
{
    const ProtobufCMethodDescriptor *md = &cl->service->methods[req->method];
    stria__rpc_arena_t *arena = NULL;
    ProtobufCMessage *msg = NULL;
    uint64_t plen = 0;
    void *payload = NULL;
    bool owned = false;

    cl->server_error = false;
    stria_status_t st =
        stria__cl_read_reply(cl, id, req->method, false, md->output, deadline, &arena, &msg, &plen);
    if (st != STRIA_OK) {
        if (!cl->server_error)
            stria__cl_drop(cl);
        return stria__wrap_method(st, md->name);
    }
    if (plen > 0 && (st = stria__cl_reply_payload(cl, req, md->name, plen, deadline, &payload,
                                                  &owned)) != STRIA_OK) {
        stria__rpc_arena_destroy(arena);
        return st;
    }
    reply_out->msg = msg;
    reply_out->session = cl->session;
    reply_out->payload = payload;
    reply_out->payload_len = plen;
    reply_out->stria__arena = arena;
    reply_out->stria__payload_owned = owned;
    return STRIA_OK;
}

/* Checks a request and computes its payload's length. */
static stria_status_t stria__cl_check(const stria_rpc_client_t *cl, const stria_rpc_request_t *req,
                                      uint64_t *payload_len)
{
    if (req == NULL || req->request == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rpc call: NULL argument");
    if (req->method >= cl->service->n_methods)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rpc call: %s has no method %u",
                               cl->service->name, req->method);
    if (req->request->descriptor != cl->service->methods[req->method].input)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rpc call: %s takes a %s, not a %s",
                               cl->service->methods[req->method].name,
                               cl->service->methods[req->method].input->name,
                               req->request->descriptor->name);
    if (req->payload == NULL && req->payload_len > 0 && req->payload_iov == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rpc call: NULL payload");
    if ((req->payload_iov != NULL && req->payload != NULL) ||
        (req->reply_iov != NULL && req->reply_buf != NULL))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "rpc call: a payload (or reply buffer) and pieces both given");
    *payload_len = req->payload_len;
    if (req->payload_iov != NULL) {
        *payload_len = 0;
        for (size_t i = 0; i < req->payload_iovcnt; i++)
            *payload_len += req->payload_iov[i].iov_len;
    }
    return STRIA_OK;
}

stria_status_t stria_rpc_client_call(stria_rpc_client_t *cl, const stria_rpc_request_t *req,
                                     stria_rpc_reply_t *reply_out)
{
    return stria_rpc_client_call_batch(cl, req, 1, reply_out);
}

stria_status_t stria_rpc_client_call_batch(stria_rpc_client_t *cl, const stria_rpc_request_t *reqs,
                                           size_t n, stria_rpc_reply_t *replies)
{
    uint64_t ids[STRIA_RPC_MAX_BATCH], len;
    stria_status_t st = STRIA_OK;

    if (cl == NULL || reqs == NULL || replies == NULL || n == 0 || n > STRIA_RPC_MAX_BATCH)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "rpc call: NULL argument or %zu requests (1..%d)", n,
                               STRIA_RPC_MAX_BATCH);
    for (size_t i = 0; i < n; i++) {
        memset(&replies[i], 0, sizeof(replies[i]));
        if ((st = stria__cl_check(cl, &reqs[i], &len)) != STRIA_OK)
            return st;
    }
    pthread_mutex_lock(&cl->lock);
    double now = stria_time_now();
    size_t sent = 0;
    for (; sent < n; sent++) {
        double deadline = reqs[sent].timeout_s > 0 ? now + reqs[sent].timeout_s : 0.0;
        (void)stria__cl_check(cl, &reqs[sent], &len);
        if ((st = stria__cl_send_request(cl, &reqs[sent], len, deadline, &ids[sent])) != STRIA_OK)
            break;
    }
    /* every reply in order, also after an error reply (the stream stays in
     * step); the first failure is the call's */
    stria_status_t first = st;
    char msg[1024] = "";
    bool retryable = false, server_error = false;
    if (first != STRIA_OK)
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
    for (size_t i = 0; i < sent && cl->fd >= 0; i++) {
        double deadline = reqs[i].timeout_s > 0 ? now + reqs[i].timeout_s : 0.0;
        st = stria__cl_recv_reply(cl, &reqs[i], ids[i], deadline, &replies[i]);
        if (st != STRIA_OK && first == STRIA_OK) {
            first = st;
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
            retryable = stria_error_retryable();
            server_error = cl->server_error;
        }
    }
    /* the first failure's: its message, class and kind */
    cl->server_error = server_error;
    pthread_mutex_unlock(&cl->lock);
    if (first != STRIA_OK) {
        for (size_t i = 0; i < n; i++)
            stria_rpc_reply_free(&replies[i]);
        stria_error_set(first, "%s", msg);
        stria_error_set_retryable(retryable);
        return first;
    }
    return STRIA_OK;
}

stria_status_t stria_rpc_client_send(stria_rpc_client_t *cl, const stria_rpc_request_t *req,
                                     stria_rpc_pending_t *pending_out)
{
    uint64_t len, id = 0;
    stria_status_t st;
    if (cl == NULL || pending_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rpc send: NULL argument");
    if ((st = stria__cl_check(cl, req, &len)) != STRIA_OK)
        return st;
    double deadline = req->timeout_s > 0 ? stria_time_now() + req->timeout_s : 0.0;
    pthread_mutex_lock(&cl->lock);
    st = stria__cl_send_request(cl, req, len, deadline, &id);
    pthread_mutex_unlock(&cl->lock);
    if (st != STRIA_OK)
        return st;
    pending_out->request_id = id;
    pending_out->deadline = deadline;
    return STRIA_OK;
}

stria_status_t stria_rpc_client_recv(stria_rpc_client_t *cl, const stria_rpc_request_t *req,
                                     const stria_rpc_pending_t *pending,
                                     stria_rpc_reply_t *reply_out)
{
    if (cl == NULL || req == NULL || pending == NULL || reply_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rpc receive: NULL argument");
    memset(reply_out, 0, sizeof(*reply_out));
    pthread_mutex_lock(&cl->lock);
    stria_status_t st;
    if (cl->fd < 0)
        st = stria_error_set(STRIA_ERR_CLOSED, "%s: the connection closed before the reply",
                             cl->service->methods[req->method].name);
    else
        st = stria__cl_recv_reply(cl, req, pending->request_id, pending->deadline, reply_out);
    pthread_mutex_unlock(&cl->lock);
    return st;
}
