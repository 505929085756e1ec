/* Helpers of the RPC suites: raw sockets that speak (or mis-speak) the frame
 * format, for tests that a well-behaved client cannot express. */
#ifndef STRIA_RPC_TESTUTIL_H
#define STRIA_RPC_TESTUTIL_H

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "stria.pb-c.h"
#include "stria_rpc.h"

/* Connects to 127.0.0.1:port; -1 on failure. */
static inline int rt_connect(uint16_t port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static inline bool rt_send(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t w = send(fd, p, len, MSG_NOSIGNAL);
        if (w <= 0)
            return false;
        p += w;
        len -= (size_t)w;
    }
    return true;
}

/* Reads exactly len bytes within timeout_ms. Returns len, 0 on EOF before
 * any byte, -1 on error or timeout. */
static inline ssize_t rt_recv(int fd, void *buf, size_t len, int timeout_ms)
{
    size_t got = 0;
    while (got < len) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        ssize_t r;
        if (poll(&pfd, 1, timeout_ms) <= 0)
            return -1;
        r = recv(fd, (char *)buf + got, len - got, 0);
        if (r == 0)
            return got == 0 ? 0 : -1;
        if (r < 0)
            return -1;
        got += (size_t)r;
    }
    return (ssize_t)len;
}

/* Waits for the peer to close: true when EOF (or a reset) arrives within
 * timeout_ms, discarding any bytes before it. */
static inline bool rt_wait_closed(int fd, int timeout_ms)
{
    char buf[4096];
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        ssize_t r;
        if (poll(&pfd, 1, timeout_ms) <= 0)
            return false;
        r = recv(fd, buf, sizeof(buf), 0);
        if (r <= 0)
            return true;
    }
}

/* Sends a frame with the given header fields and a packed message. */
static inline bool rt_send_frame(int fd, stria_rpc_header_t h, const ProtobufCMessage *msg,
                                 const void *payload, size_t payload_len)
{
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    size_t pb = msg ? protobuf_c_message_get_packed_size(msg) : 0;
    uint8_t *buf = malloc(pb + 1);
    bool ok;
    if (msg)
        protobuf_c_message_pack(msg, buf);
    h.pb_len = (uint32_t)pb;
    h.payload_len = payload_len;
    stria_rpc_header_encode(&h, hb);
    ok = rt_send(fd, hb, sizeof(hb)) && rt_send(fd, buf, pb) &&
         (payload_len == 0 || rt_send(fd, payload, payload_len));
    free(buf);
    return ok;
}

static inline stria_rpc_header_t rt_header(uint32_t method, uint64_t id)
{
    stria_rpc_header_t h = {
        .magic = STRIA_RPC_MAGIC, .version = STRIA_RPC_VERSION, .method = method, .request_id = id};
    return h;
}

/* The client nonce of the last rt_hello() (one handshake at a time). */
static uint8_t rt_client_nonce[STRIA_AUTH_NONCE_BYTES];

/* Sends the first hello frame for `service` (protocol `version`), with a
 * fresh client nonce. The server answers with the final HelloReply (no
 * credentials), an error, or a challenge (see rt_prove()). */
static inline bool rt_hello(int fd, const char *service, uint32_t version)
{
    Stria__V1__HelloRequest hello = STRIA__V1__HELLO_REQUEST__INIT;
    stria_rpc_header_t h = rt_header(0, 1);
    h.flags = STRIA_RPC_FLAG_HELLO;
    if (stria_auth_random(rt_client_nonce, sizeof(rt_client_nonce)) != STRIA_OK)
        return false;
    hello.protocol_version = version;
    hello.service = (char *)service;
    hello.client_name = (char *)"raw test";
    hello.client_nonce.data = rt_client_nonce;
    hello.client_nonce.len = sizeof(rt_client_nonce);
    return rt_send_frame(fd, h, &hello.base, NULL, 0);
}

/* Reads the challenge the first hello got and sends the second hello frame
 * with the proof of `token` (NULL: an empty proof). The final reply (or the
 * refusal) is left for the caller to read. False when no challenge came. */
static inline bool rt_prove(int fd, const char *service, const char *token)
{
    uint8_t hb[STRIA_RPC_HEADER_SIZE], pb[4096], mac[STRIA_AUTH_MAC_BYTES];
    stria_rpc_header_t rh, h = rt_header(0, 2);
    Stria__V1__HelloRequest hello = STRIA__V1__HELLO_REQUEST__INIT;
    if (rt_recv(fd, hb, sizeof(hb), 5000) != (ssize_t)sizeof(hb))
        return false;
    stria_rpc_header_decode(hb, &rh);
    if (rh.status != 0 || rh.pb_len > sizeof(pb) ||
        rt_recv(fd, pb, rh.pb_len, 5000) != (ssize_t)rh.pb_len)
        return false;
    Stria__V1__HelloReply *rep = stria__v1__hello_reply__unpack(NULL, rh.pb_len, pb);
    if (rep == NULL)
        return false;
    bool ok = rep->challenge && rep->server_nonce.len == STRIA_AUTH_NONCE_BYTES;
    if (ok && token != NULL) {
        stria_auth_hello_mac(token, service, rt_client_nonce, rep->server_nonce.data, false, mac);
        hello.proof.data = mac;
        hello.proof.len = sizeof(mac);
    }
    stria__v1__hello_reply__free_unpacked(rep, NULL);
    h.flags = STRIA_RPC_FLAG_HELLO;
    hello.protocol_version = STRIA_RPC_VERSION;
    hello.service = (char *)service;
    hello.client_name = (char *)"raw test";
    return ok && rt_send_frame(fd, h, &hello.base, NULL, 0);
}

/* A reply frame: header, message bytes (malloc'd) and the decoded error when
 * the status is not 0. */
typedef struct {
    stria_rpc_header_t h;
    uint8_t *pb;
    uint8_t *payload;
    Stria__V1__RpcError *err;
} rt_reply_t;

static inline void rt_reply_free(rt_reply_t *r)
{
    if (r->err)
        stria__v1__rpc_error__free_unpacked(r->err, NULL);
    free(r->pb);
    free(r->payload);
    memset(r, 0, sizeof(*r));
}

/* Reads one frame within timeout_ms; false on EOF, error or timeout. */
static inline bool rt_read_reply(int fd, rt_reply_t *r, int timeout_ms)
{
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    memset(r, 0, sizeof(*r));
    if (rt_recv(fd, hb, sizeof(hb), timeout_ms) != (ssize_t)sizeof(hb))
        return false;
    stria_rpc_header_decode(hb, &r->h);
    if (r->h.pb_len > (16u << 20) || r->h.payload_len > (64u << 20))
        return false;
    r->pb = malloc(r->h.pb_len + 1);
    r->payload = malloc(r->h.payload_len + 1);
    if (rt_recv(fd, r->pb, r->h.pb_len, timeout_ms) != (ssize_t)r->h.pb_len ||
        rt_recv(fd, r->payload, r->h.payload_len, timeout_ms) != (ssize_t)r->h.payload_len) {
        rt_reply_free(r);
        return false;
    }
    if (r->h.status != 0)
        r->err = stria__v1__rpc_error__unpack(NULL, r->h.pb_len, r->pb);
    return true;
}

#endif
