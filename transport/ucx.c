/*
 * The ring link over UCX (ucp).
 *
 * Threading: every UCX call after setup happens on the context's progress
 * thread (the worker is created UCS_THREAD_MODE_SINGLE). Callers' threads
 * queue requests and flag links under ctx->lock, wake the progress thread
 * through an eventfd, and wait on ctx->cond. The progress thread drains
 * ucp_worker_progress(), then handles what the UCX callbacks recorded
 * (connection requests, control messages, endpoint errors), then sleeps in
 * epoll on the worker's event fd and the eventfd after ucp_worker_arm(). UCX
 * callbacks take ctx->lock themselves, so the progress thread never holds it
 * across a UCX call.
 *
 * Wire: two active-message ids. CTRL carries the handshake, acknowledgement,
 * abort, goodbye and heartbeat messages (sent with the reply flag, so the
 * receiver knows the endpoint they came on). DATA carries one tensor block: a 16-byte
 * header (receiver's slot, tag) and the payload, forced to rendezvous from
 * STRIA__UCX_RNDV_MIN bytes so a matched receive lands in its own buffer.
 * Matching is ours: per link, receives match arrivals by tag in posting
 * order; an arrival with no receive yet keeps its UCX descriptor (rendezvous:
 * the bytes stay at the sender) until one is posted.
 */
#include "stria_transport.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <ucp/api/ucp.h>

/* ---- constants ----------------------------------------------------------- */

#define STRIA__UCX_MAGIC     0x53545241u /* "STRA" */
#define STRIA__UCX_VERSION   1
#define STRIA__UCX_AM_CTRL   1
#define STRIA__UCX_AM_DATA   2
#define STRIA__UCX_RNDV_MIN  (64 * 1024)
#define STRIA__UCX_DATA_HDR  16
#define STRIA__UCX_TEXT_MAX  400
#define STRIA__UCX_CTRL_HDR  46
#define STRIA__UCX_CTRL_MAX  (STRIA__UCX_CTRL_HDR + STRIA__UCX_TEXT_MAX)
#define STRIA__UCX_SLOTS     65536
#define STRIA__UCX_MAX_CONNS 256
/* Eager bytes that may wait for a receive on one link before it is treated as
 * a protocol error (large blocks are rendezvous and cost nothing here). */
#define STRIA__UCX_UNEXP_MAX (64u << 20)
/* Time a failed link gives its abort notices before closing endpoints. */
#define STRIA__UCX_NOTIFY_GRACE_S 0.3
/* Time a graceful close may take before endpoints are closed by force. */
#define STRIA__UCX_CLOSE_GRACE_S 1.0
/* Safety bound on waiting for UCX to release a request after teardown. */
#define STRIA__UCX_RELEASE_WAIT_S 10.0
/* Heartbeats between neighbours. They never fail a link by themselves (a
 * busy host may delay them); they tell a missed deadline whether the peer
 * is stalled or alive and waiting on someone else. */
#define STRIA__UCX_PING_S  0.1
#define STRIA__UCX_STALE_S 0.5
/* Bounds of the injectable heartbeat period and stall time (the context's
 * params): a stall time of at least two periods, so that one late heartbeat
 * never makes a neighbour look stalled. */
#define STRIA__UCX_PING_MAX_S  10.0
#define STRIA__UCX_STALE_MAX_S 60.0
/* Extra time a missed deadline waits when the peer is alive, so that the
 * report of the rank actually at fault can arrive first. */
#define STRIA__UCX_GRACE_MAX_S 2.0
/* A connection that drops is blamed on the peer only after this long: a
 * peer that failed for another reason sends its ABORT first, but over
 * shared memory the ABORT and the TCP disconnect can arrive out of order. */
#define STRIA__UCX_SETTLE_S 0.1
/* UCX 1.13 does not always complete a rendezvous request whose peer is
 * stopped when the endpoint is closed by force; such requests are handed
 * back to UCX (ucp_request_free) this long after the close. */
#define STRIA__UCX_DETACH_S 0.2
/* How long the progress thread polls after the last activity before it
 * sleeps, while transfers are in flight (stria_ucx_ctx_params_t.poll_us). */
#define STRIA__UCX_POLL_DEFAULT_US 50
#define STRIA__UCX_POLL_MAX_US     100000

enum {
    STRIA__CTRL_HELLO = 1,
    STRIA__CTRL_ACK = 2,
    STRIA__CTRL_ABORT = 3,
    STRIA__CTRL_BYE = 4,
    STRIA__CTRL_PING = 5,
};

enum {
    STRIA__NOTIFY_NEXT = 1,
    STRIA__NOTIFY_PREV = 2,
};

/* ---- intrusive lists ------------------------------------------------------ */

typedef struct stria__node {
    struct stria__node *prev, *next;
} stria__node_t;

#define STRIA__OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

static void stria__list_init(stria__node_t *h)
{
    h->prev = h->next = h;
}

static bool stria__list_empty(const stria__node_t *h)
{
    return h->next == h;
}

static void stria__list_push(stria__node_t *h, stria__node_t *n)
{
    n->prev = h->prev;
    n->next = h;
    h->prev->next = n;
    h->prev = n;
}

static void stria__list_del(stria__node_t *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = n;
}

/* Moves every node of src to the end of dst. */
static void stria__list_splice(stria__node_t *dst, stria__node_t *src)
{
    if (stria__list_empty(src))
        return;
    src->next->prev = dst->prev;
    dst->prev->next = src->next;
    src->prev->next = dst;
    dst->prev = src->prev;
    stria__list_init(src);
}

/* ---- types ----------------------------------------------------------------- */

typedef struct stria__ucx_link stria__ucx_link_t;
typedef struct stria__ucx_conn stria__ucx_conn_t;

typedef struct {
    uint16_t type;
    uint64_t job_id;
    uint64_t ring_id;
    int32_t rank;
    int32_t size;
    int32_t status;
    uint32_t slot;
    int32_t origin;
    char text[STRIA__UCX_TEXT_MAX + 1];
} stria__ctrl_t;

typedef enum {
    STRIA__REQ_QUEUED = 0, /* on ctx->queue, not seen by the progress thread */
    STRIA__REQ_POSTED = 1, /* owned by the progress thread / UCX */
    STRIA__REQ_DONE = 2,   /* finished; UCX holds nothing of it */
} stria__req_state_t;

struct stria_link_req {
    stria__node_t link_node;  /* link->reqs until released */
    stria__node_t queue_node; /* ctx->queue, link->posted or ctx->starts */
    stria__ucx_link_t *link;
    bool is_send;
    uint64_t tag;
    void *buf;
    size_t len;
    uint8_t hdr[STRIA__UCX_DATA_HDR];
    stria__req_state_t state;
    bool matched;   /* receive: data arrived, transfer in flight */
    bool abandoned; /* the owner stopped waiting; free when done */
    void *desc;     /* receive: UCX rendezvous descriptor to start */
    void *ucp_req;  /* progress thread only */
    stria_status_t status;
    char msg[256];
};

/* A message that arrived before its receive was posted. */
typedef struct {
    stria__node_t node;
    uint64_t tag;
    size_t len;
    void *desc; /* UCX descriptor (rendezvous or persistent eager data) */
    bool rndv;
    void *copy; /* eager data copied out of UCX when it could not be kept */
} stria__unexp_t;

struct stria__ucx_conn {
    stria__node_t node; /* ctx->conns; progress thread only */
    stria_ucx_ctx_t *ctx;
    ucp_ep_h ep;
    bool closing;
    stria__ucx_link_t *link; /* the link that claimed it (under ctx->lock) */
    bool have_hello;
    stria__ctrl_t hello;
    char peer[80];
    int ctrl_pending;
};

struct stria__ucx_link {
    stria_link_t base;
    stria__node_t ctx_node;
    stria_ucx_ctx_t *ctx;
    uint64_t job_id, ring_id;
    uint32_t in_slot;  /* slot the predecessor's data is addressed to */
    uint32_t out_slot; /* the successor's slot for this link's data */
    char next_desc[300];
    struct sockaddr_storage next_addr;
    socklen_t next_addrlen;
    double connect_deadline;

    /* Under ctx->lock. */
    bool out_ready, in_ready;
    bool failed;
    stria_status_t fail_status;
    char fail_msg[512];
    int notify_mask;
    int notify_origin;
    int notify_reporter;
    char notify_text[STRIA__UCX_TEXT_MAX + 1];
    bool want_connect, want_teardown, want_destroy;
    bool prev_closed, next_closed; /* a neighbour said goodbye */
    double settle_at;              /* > 0: a connection dropped; fail then */
    int settle_side;               /* STRIA__NOTIFY_NEXT or _PREV */
    char settle_msg[300];
    double last_prev, last_next; /* when each neighbour was last heard */
    /* A stalled rank somewhere in the ring, as the heartbeats tell it (a
     * neighbour's own silent neighbour, passed on hop by hop), by the way it
     * travels: [STRIA__FROM_PREV] came from the predecessor and goes on to
     * the successor, [STRIA__FROM_NEXT] the other way. A report only moves
     * on in the direction it came, so it never echoes between two ranks; it
     * stops at the suspect and at the rank that first made it, and dies out
     * a second per hop after its first-hand source stops sending it.
     * suspect is -1 if none. */
    struct {
        int suspect;
        int reporter;
        double silence;
        double at;
    } heard[2];
    bool closed; /* no endpoint and no UCX request left */
    stria__node_t reqs;
    stria__node_t posted; /* unmatched receives, in posting order */
    stria__node_t unexp;  /* arrivals without a receive, in arrival order */
    size_t unexp_bytes;

    /* Progress thread only. */
    ucp_ep_h out_ep;
    stria__ucx_conn_t *in_conn;
    int eps_closing;
    int ctrl_pending;
    int flush_pending;
    double retry_at; /* > 0: reconnect to the successor then */
    double retry_delay;
    bool torn;          /* teardown notices sent */
    double close_at;    /* > 0: close endpoints by force then */
    bool graceful;      /* graceful close started */
    double next_ping;   /* when the next heartbeats go out */
    int logged_suspect; /* the stalled rank last logged, or -1 */
    double detach_at;   /* > 0: detach requests UCX still holds then */
};

/* Index of link->heard: the neighbour a heartbeat's report came from. */
#define STRIA__FROM_PREV 0
#define STRIA__FROM_NEXT 1

typedef enum {
    STRIA__EV_CONN_REQ = 1,
    STRIA__EV_CTRL = 2,
    STRIA__EV_OUT_ERR = 3,
    STRIA__EV_IN_ERR = 4,
} stria__ev_type_t;

/* What a UCX callback saw, handled after ucp_worker_progress() returns. */
typedef struct {
    stria__node_t node;
    stria__ev_type_t type;
    ucp_conn_request_h conn_req;
    ucp_ep_h ep;
    void *obj;
    ucs_status_t status;
    stria__ctrl_t ctrl;
} stria__event_t;

/* An endpoint close in flight. */
typedef struct {
    stria__ucx_link_t *link; /* decrement link->eps_closing when done */
    stria__ucx_conn_t *conn; /* free the conn when done */
    stria_ucx_ctx_t *ctx;
} stria__closing_t;

/* A control message being sent; freed by its completion. */
typedef struct {
    int *pending;
    uint8_t buf[STRIA__UCX_CTRL_MAX];
} stria__ctrl_send_t;

struct stria_ucx_ctx {
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_listener_h listener;
    uint16_t port;
    int ucp_fd;
    int kick_fd;
    int ep_fd;
    pthread_t thread;
    bool thread_started;

    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool stop;
    stria__node_t links;
    stria__node_t queue; /* QUEUED requests of every link, in posting order */
    stria__ucx_link_t **slots;
    uint32_t next_slot;
    int closing;    /* endpoint closes in flight (progress thread) */
    int in_flight;  /* requests posted and not finished, all links */
    double poll_s;  /* polling window of the progress thread */
    double ping_s;  /* heartbeat period of every link */
    double stale_s; /* silence after which a neighbour counts as stalled */

    /* Progress thread only. */
    stria__ucx_link_t **todo;
    size_t todo_cap;
    stria__node_t conns;
    int n_conns;
    stria__node_t events;
    stria__node_t starts; /* matched rendezvous receives to start */
};

/* ---- small helpers ----------------------------------------------------------- */

static stria_status_t stria__ucs_status(ucs_status_t s)
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

static void stria__kick(stria_ucx_ctx_t *ctx)
{
    uint64_t one = 1;
    ssize_t n;
    do {
        n = write(ctx->kick_fd, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
}

static struct timespec stria__abs_time(double t)
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

static void stria__cond_wait_until(stria_ucx_ctx_t *ctx, double t)
{
    struct timespec ts = stria__abs_time(t);
    pthread_cond_timedwait(&ctx->cond, &ctx->lock, &ts);
}

static void stria__put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t stria__get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void stria__put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t stria__get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static void stria__put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static uint16_t stria__get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static size_t stria__ctrl_encode(const stria__ctrl_t *c, uint8_t *buf)
{
    size_t tl = strnlen(c->text, STRIA__UCX_TEXT_MAX);
    stria__put32(buf, STRIA__UCX_MAGIC);
    stria__put16(buf + 4, STRIA__UCX_VERSION);
    stria__put16(buf + 6, c->type);
    stria__put64(buf + 8, c->job_id);
    stria__put64(buf + 16, c->ring_id);
    stria__put32(buf + 24, (uint32_t)c->rank);
    stria__put32(buf + 28, (uint32_t)c->size);
    stria__put32(buf + 32, (uint32_t)c->status);
    stria__put32(buf + 36, c->slot);
    stria__put32(buf + 40, (uint32_t)c->origin);
    stria__put16(buf + 44, (uint16_t)tl);
    memcpy(buf + STRIA__UCX_CTRL_HDR, c->text, tl);
    return STRIA__UCX_CTRL_HDR + tl;
}

/* Decodes and validates a control message from a peer. */
static stria_status_t stria__ctrl_decode(const uint8_t *buf, size_t len, stria__ctrl_t *c)
{
    if (len < STRIA__UCX_CTRL_HDR)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message of %zu bytes is too short",
                               len);
    if (stria__get32(buf) != STRIA__UCX_MAGIC)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message with a bad magic number");
    if (stria__get16(buf + 4) != STRIA__UCX_VERSION)
        return stria_error_set(STRIA_ERR_PROTOCOL, "peer speaks link protocol version %u, not %u",
                               stria__get16(buf + 4), STRIA__UCX_VERSION);
    memset(c, 0, sizeof(*c));
    c->type = stria__get16(buf + 6);
    c->job_id = stria__get64(buf + 8);
    c->ring_id = stria__get64(buf + 16);
    c->rank = (int32_t)stria__get32(buf + 24);
    c->size = (int32_t)stria__get32(buf + 28);
    c->status = (int32_t)stria__get32(buf + 32);
    c->slot = stria__get32(buf + 36);
    c->origin = (int32_t)stria__get32(buf + 40);
    size_t tl = stria__get16(buf + 44);
    if (c->type < STRIA__CTRL_HELLO || c->type > STRIA__CTRL_PING)
        return stria_error_set(STRIA_ERR_PROTOCOL, "unknown control message type %u", c->type);
    if (tl > STRIA__UCX_TEXT_MAX || STRIA__UCX_CTRL_HDR + tl != len)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message length %zu does not match",
                               len);
    if (c->size < 1 || c->size > 65535 || c->rank < 0 || c->rank >= c->size)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message with rank %d of %d",
                               (int)c->rank, (int)c->size);
    memcpy(c->text, buf + STRIA__UCX_CTRL_HDR, tl);
    c->text[tl] = '\0';
    for (size_t i = 0; i < tl; i++)
        if ((unsigned char)c->text[i] < 0x20)
            c->text[i] = '?';
    return STRIA_OK;
}

static void stria__addr_str(const struct sockaddr *sa, char *out, size_t n)
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

/* Resolves host:port to one socket address (the first the resolver gives). */
static stria_status_t stria__resolve(const char *host, uint16_t port, bool passive,
                                     struct sockaddr_storage *out, socklen_t *len_out)
{
    struct addrinfo hints, *res = NULL;
    char port_s[8];
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    snprintf(port_s, sizeof(port_s), "%u", (unsigned)port);
    int rc = getaddrinfo(host, port_s, &hints, &res);
    if (rc != 0 || res == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "cannot resolve address '%s': %s", host,
                               rc != 0 ? gai_strerror(rc) : "no result");
    if (res->ai_addrlen > sizeof(*out)) {
        freeaddrinfo(res);
        return stria_error_set(STRIA_ERR_INVALID_ARG, "address '%s' is too long", host);
    }
    memset(out, 0, sizeof(*out));
    memcpy(out, res->ai_addr, res->ai_addrlen);
    *len_out = (socklen_t)res->ai_addrlen;
    freeaddrinfo(res);
    return STRIA_OK;
}

static const char *stria__req_kind(const stria_link_req_t *req)
{
    return req->is_send ? "send" : "receive";
}

/* ---- request and link state (ctx->lock held) ------------------------------------ */

/* Frees a released request; the caller has unlinked it. */
static void stria__req_free(stria_link_req_t *req)
{
    free(req);
}

/* Marks a request finished. A request whose owner stopped waiting is freed. */
static void stria__req_finish_locked(stria_link_req_t *req, stria_status_t status, const char *msg)
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
        stria__req_free(req);
    }
    pthread_cond_broadcast(&ctx->cond);
}

/* Fails the link once: records the first error, asks the progress thread to
 * tell the neighbours in notify_mask and to release every UCX resource of
 * the link. origin: the rank at fault, for the notices. */
static void stria__link_fail_locked(stria__ucx_link_t *link, stria_status_t status, int origin,
                                    int notify_mask, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static void stria__link_fail_locked(stria__ucx_link_t *link, stria_status_t status, int origin,
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
    snprintf(link->notify_text, sizeof(link->notify_text), "%.400s", link->fail_msg);
    link->want_teardown = true;
    stria_log_info("ucx link rank %d/%d (job %llu ring %llu) failed: %s", link->base.rank,
                   link->base.size, (unsigned long long)link->job_id,
                   (unsigned long long)link->ring_id, link->fail_msg);
    pthread_cond_broadcast(&link->ctx->cond);
}

static stria_status_t stria__link_error_locked(const stria__ucx_link_t *link)
{
    return stria_error_set(link->fail_status, "%s", link->fail_msg);
}

/* A connection to a neighbour dropped: the link fails STRIA__UCX_SETTLE_S
 * later with this message, unless a notice from elsewhere comes first. */
static void stria__link_peer_error_locked(stria__ucx_link_t *link, int side, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void stria__link_peer_error_locked(stria__ucx_link_t *link, int side, const char *fmt, ...)
{
    if (link->failed || link->settle_at > 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(link->settle_msg, sizeof(link->settle_msg), fmt, ap);
    va_end(ap);
    link->settle_side = side;
    link->settle_at = stria_time_now() + STRIA__UCX_SETTLE_S;
}

/* The rank this link believes stalled, or -1: a connected neighbour silent
 * for the context's stall time, else what the heartbeats reported within the
 * last two stall times. `from` is STRIA__FROM_PREV or STRIA__FROM_NEXT to consider only
 * reports that came that way (what a heartbeat passes on in the other
 * direction), or -1 for the latest report from either side. */
static int stria__link_suspect_locked(const stria__ucx_link_t *link, double now, int from,
                                      int *reporter, double *silence)
{
    double qp = now - link->last_prev, qn = now - link->last_next;
    double stale = link->ctx->stale_s;
    *reporter = link->base.rank;
    if (link->in_ready && qp >= stale && !link->prev_closed) {
        *silence = qp;
        return stria_link_prev(&link->base);
    }
    if (link->out_ready && qn >= stale && !link->next_closed) {
        *silence = qn;
        return stria_link_next(&link->base);
    }
    int best = -1;
    for (int d = 0; d < 2; d++) {
        if ((from >= 0 && d != from) || link->heard[d].suspect < 0 ||
            now - link->heard[d].at >= 2 * stale)
            continue;
        if (best < 0 || link->heard[d].at > link->heard[best].at)
            best = d;
    }
    if (best >= 0) {
        *reporter = link->heard[best].reporter;
        *silence = link->heard[best].silence + (now - link->heard[best].at);
        return link->heard[best].suspect;
    }
    *silence = 0;
    return -1;
}

/* Logs when this link starts and stops believing a rank stalled, so that an
 * operator sees a stall as it happens, not only in the deadline it causes. */
static void stria__link_log_suspect_locked(stria__ucx_link_t *link, double now)
{
    int reporter;
    double silence;
    int suspect = stria__link_suspect_locked(link, now, -1, &reporter, &silence);
    if (suspect == link->logged_suspect)
        return;
    if (suspect >= 0)
        stria_log_warn("ucx link rank %d/%d (job %llu): rank %d looks stalled (silent for %.1f s, "
                       "seen by rank %d)",
                       link->base.rank, link->base.size, (unsigned long long)link->job_id, suspect,
                       silence, reporter);
    else
        stria_log_info("ucx link rank %d/%d (job %llu): rank %d is no longer reported stalled",
                       link->base.rank, link->base.size, (unsigned long long)link->job_id,
                       link->logged_suspect);
    link->logged_suspect = suspect;
}

static bool stria__ucs_is_peer_error(ucs_status_t s)
{
    return s == UCS_ERR_CONNECTION_RESET || s == UCS_ERR_ENDPOINT_TIMEOUT ||
           s == UCS_ERR_UNREACHABLE || s == UCS_ERR_NOT_CONNECTED || s == UCS_ERR_IO_ERROR ||
           s == UCS_ERR_REJECTED || s == UCS_ERR_CANCELED;
}

/* ---- UCX callbacks (progress thread, inside ucp_worker_progress) ---------------- */

static void stria__event_push(stria_ucx_ctx_t *ctx, stria__event_t *ev)
{
    stria__list_push(&ctx->events, &ev->node);
}

static void stria__conn_req_cb(ucp_conn_request_h conn_request, void *arg)
{
    stria_ucx_ctx_t *ctx = arg;
    stria__event_t *ev = calloc(1, sizeof(*ev));
    if (ev == NULL) {
        ucp_listener_reject(ctx->listener, conn_request);
        return;
    }
    ev->type = STRIA__EV_CONN_REQ;
    ev->conn_req = conn_request;
    stria__event_push(ctx, ev);
}

static void stria__out_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    stria__ucx_link_t *link = arg;
    stria__event_t *ev = calloc(1, sizeof(*ev));
    if (ev == NULL)
        return;
    ev->type = STRIA__EV_OUT_ERR;
    ev->ep = ep;
    ev->obj = link;
    ev->status = status;
    stria__event_push(link->ctx, ev);
}

static void stria__in_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    stria__ucx_conn_t *conn = arg;
    stria__event_t *ev = calloc(1, sizeof(*ev));
    if (ev == NULL)
        return;
    ev->type = STRIA__EV_IN_ERR;
    ev->ep = ep;
    ev->obj = conn;
    ev->status = status;
    stria__event_push(conn->ctx, ev);
}

static ucs_status_t stria__am_ctrl_cb(void *arg, const void *header, size_t header_length,
                                      void *data, size_t length, const ucp_am_recv_param_t *param)
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
    if (stria__ctrl_decode(data, length, &ev->ctrl) != STRIA_OK) {
        stria_log_warn("ucx link: dropping a control message: %s", stria_error_msg());
        free(ev);
        return UCS_OK;
    }
    ev->type = STRIA__EV_CTRL;
    ev->ep = param->reply_ep;
    stria__event_push(ctx, ev);
    return UCS_OK;
}

static void stria__data_recv_cb(void *request, ucs_status_t status, size_t length, void *user_data);

static ucs_status_t stria__am_data_cb(void *arg, const void *header, size_t header_length,
                                      void *data, size_t length, const ucp_am_recv_param_t *param)
{
    stria_ucx_ctx_t *ctx = arg;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    bool keep = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
    ucs_status_t drop = rndv ? UCS_ERR_CANCELED : UCS_OK;

    if (header_length != STRIA__UCX_DATA_HDR) {
        stria_log_warn("ucx link: dropping a data message with a %zu-byte header", header_length);
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    uint32_t slot = stria__get32(header);
    uint64_t tag = stria__get64((const uint8_t *)header + 8);

    pthread_mutex_lock(&ctx->lock);
    stria__ucx_link_t *link = slot < STRIA__UCX_SLOTS ? ctx->slots[slot] : NULL;
    if (link == NULL || link->failed) {
        pthread_mutex_unlock(&ctx->lock);
        return drop;
    }
    link->last_prev = stria_time_now();
    stria_link_req_t *req = NULL;
    for (stria__node_t *n = link->posted.next; n != &link->posted; n = n->next) {
        stria_link_req_t *r = STRIA__OF(n, stria_link_req_t, queue_node);
        if (r->tag == tag) {
            req = r;
            break;
        }
    }
    if (req != NULL) {
        stria__list_del(&req->queue_node);
        if (length != req->len) {
            stria__link_fail_locked(
                link, STRIA_ERR_PROTOCOL, stria_link_prev(&link->base),
                STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                "message tag %#llx from rank %d has %zu bytes, the receive expects %zu",
                (unsigned long long)tag, stria_link_prev(&link->base), length, req->len);
            stria__req_finish_locked(req, link->fail_status, link->fail_msg);
            pthread_mutex_unlock(&ctx->lock);
            return rndv ? UCS_ERR_MESSAGE_TRUNCATED : UCS_OK;
        }
        req->matched = true;
        if (rndv) {
            /* Started after progress returns, outside this callback. */
            req->desc = data;
            stria__list_push(&ctx->starts, &req->queue_node);
            pthread_mutex_unlock(&ctx->lock);
            return UCS_INPROGRESS;
        }
        if (length > 0)
            memcpy(req->buf, data, length);
        stria__req_finish_locked(req, STRIA_OK, NULL);
        pthread_mutex_unlock(&ctx->lock);
        return UCS_OK;
    }

    /* No receive yet: keep the arrival. */
    if (!rndv && link->unexp_bytes + length > STRIA__UCX_UNEXP_MAX) {
        stria__link_fail_locked(link, STRIA_ERR_PROTOCOL, stria_link_prev(&link->base),
                                STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                                "rank %d sent more than %u bytes of small messages nobody "
                                "receives",
                                stria_link_prev(&link->base), STRIA__UCX_UNEXP_MAX);
        pthread_mutex_unlock(&ctx->lock);
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
        stria__link_fail_locked(link, STRIA_ERR_NO_MEMORY, link->base.rank,
                                STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                                "out of memory keeping an early message");
        pthread_mutex_unlock(&ctx->lock);
        return drop;
    }
    u->tag = tag;
    u->len = length;
    u->rndv = rndv;
    if (rndv || keep)
        u->desc = data;
    if (!rndv)
        link->unexp_bytes += length;
    stria__list_push(&link->unexp, &u->node);
    pthread_mutex_unlock(&ctx->lock);
    return (rndv || keep) ? UCS_INPROGRESS : UCS_OK;
}

/* Completion of a UCX data request (send or rendezvous receive). */
static void stria__data_done(stria_link_req_t *req, ucs_status_t status, size_t length)
{
    stria__ucx_link_t *link = req->link;
    stria_ucx_ctx_t *ctx = link->ctx;
    pthread_mutex_lock(&ctx->lock);
    if (status == UCS_OK && !req->is_send && length != req->len) {
        stria__link_fail_locked(link, STRIA_ERR_PROTOCOL, stria_link_prev(&link->base),
                                STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                                "message tag %#llx from rank %d delivered %zu bytes, expected %zu",
                                (unsigned long long)req->tag, stria_link_prev(&link->base), length,
                                req->len);
        stria__req_finish_locked(req, link->fail_status, link->fail_msg);
    } else if (status == UCS_OK) {
        stria__req_finish_locked(req, STRIA_OK, NULL);
    } else if (link->failed) {
        stria__req_finish_locked(req, link->fail_status, link->fail_msg);
    } else if (req->is_send ? link->next_closed : link->prev_closed) {
        char msg[200];
        int peer = req->is_send ? stria_link_next(&link->base) : stria_link_prev(&link->base);
        snprintf(msg, sizeof(msg), "rank %d left the ring before the %s of tag %#llx completed",
                 peer, stria__req_kind(req), (unsigned long long)req->tag);
        stria__req_finish_locked(req, STRIA_ERR_CLOSED, msg);
    } else if (stria__ucs_is_peer_error(status)) {
        /* The link's failure (and this request's message) is decided when
         * the connection's fate has settled; see stria__ucx_wait(). */
        int peer = req->is_send ? stria_link_next(&link->base) : stria_link_prev(&link->base);
        stria__link_peer_error_locked(link, req->is_send ? STRIA__NOTIFY_NEXT : STRIA__NOTIFY_PREV,
                                      "rank %d (%s) failed during the %s of tag %#llx: %s", peer,
                                      req->is_send ? "successor" : "predecessor",
                                      stria__req_kind(req), (unsigned long long)req->tag,
                                      ucs_status_string(status));
        stria__req_finish_locked(req, STRIA_ERR_PEER, "");
    } else {
        int peer = req->is_send ? stria_link_next(&link->base) : stria_link_prev(&link->base);
        stria__link_fail_locked(
            link, stria__ucs_status(status), peer, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "%s of tag %#llx %s rank %d (%s) failed: %s", stria__req_kind(req),
            (unsigned long long)req->tag, req->is_send ? "to" : "from", peer,
            req->is_send ? "successor" : "predecessor", ucs_status_string(status));
        stria__req_finish_locked(req, link->fail_status, link->fail_msg);
    }
    pthread_mutex_unlock(&ctx->lock);
}

static void stria__data_send_cb(void *request, ucs_status_t status, void *user_data)
{
    stria__data_done(user_data, status, 0);
    ucp_request_free(request);
}

static void stria__data_recv_cb(void *request, ucs_status_t status, size_t length, void *user_data)
{
    stria__data_done(user_data, status, length);
    ucp_request_free(request);
}

static void stria__ctrl_send_cb(void *request, ucs_status_t status, void *user_data)
{
    stria__ctrl_send_t *cs = user_data;
    (void)status;
    (*cs->pending)--;
    free(cs);
    ucp_request_free(request);
}

/* Drops recorded endpoint errors of an object about to be freed (its
 * endpoint may have failed and been closed in the same progress round). */
static void stria__events_forget(stria_ucx_ctx_t *ctx, const void *obj)
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

static void stria__close_done(stria__closing_t *cl)
{
    stria_ucx_ctx_t *ctx = cl->ctx;
    ctx->closing--;
    if (cl->link != NULL)
        cl->link->eps_closing--;
    if (cl->conn != NULL) {
        stria__events_forget(ctx, cl->conn);
        stria__list_del(&cl->conn->node);
        ctx->n_conns--;
        free(cl->conn);
    }
    free(cl);
}

static void stria__close_cb(void *request, ucs_status_t status, void *user_data)
{
    (void)status;
    stria__close_done(user_data);
    ucp_request_free(request);
}

/* ---- progress-thread actions ------------------------------------------------------ */

/* Starts closing an endpoint; the closing record tells whom to update. */
static void stria__ep_close(stria_ucx_ctx_t *ctx, ucp_ep_h ep, bool force, stria__ucx_link_t *link,
                            stria__ucx_conn_t *conn)
{
    stria__closing_t *cl = calloc(1, sizeof(*cl));
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    if (cl != NULL) {
        cl->ctx = ctx;
        cl->link = link;
        cl->conn = conn;
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = stria__close_cb;
        param.user_data = cl;
    }
    ctx->closing++;
    if (link != NULL)
        link->eps_closing++;
    void *r = ucp_ep_close_nbx(ep, &param);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        if (cl != NULL) {
            stria__close_done(cl);
        } else {
            ctx->closing--;
            if (link != NULL)
                link->eps_closing--;
        }
    } else if (cl == NULL) {
        /* Without a record nobody would be told; wait here (rare: no memory). */
        while (ucp_request_check_status(r) == UCS_INPROGRESS)
            ucp_worker_progress(ctx->worker);
        ucp_request_free(r);
        ctx->closing--;
        if (link != NULL)
            link->eps_closing--;
    }
}

/* Sends a control message; the pending counter tracks its completion. */
static void stria__ctrl_send(ucp_ep_h ep, const stria__ctrl_t *c, int *pending)
{
    stria__ctrl_send_t *cs = malloc(sizeof(*cs));
    if (cs == NULL)
        return;
    size_t len = stria__ctrl_encode(c, cs->buf);
    cs->pending = pending;
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = stria__ctrl_send_cb;
    param.user_data = cs;
    param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    (*pending)++;
    void *r = ucp_am_send_nbx(ep, STRIA__UCX_AM_CTRL, NULL, 0, cs->buf, len, &param);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        if (UCS_PTR_IS_ERR(r))
            stria_log_debug("ucx link: control message not sent: %s",
                            ucs_status_string(UCS_PTR_STATUS(r)));
        (*pending)--;
        free(cs);
    }
}

static void stria__link_ctrl_init(const stria__ucx_link_t *link, stria__ctrl_t *c, uint16_t type)
{
    memset(c, 0, sizeof(*c));
    c->type = type;
    c->job_id = link->job_id;
    c->ring_id = link->ring_id;
    c->rank = link->base.rank;
    c->size = link->base.size;
    c->origin = link->base.rank;
}

/* Creates the endpoint to the successor and sends the handshake. */
static void stria__link_connect_out(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    ucp_ep_params_t ep_params;
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                           UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep_params.sockaddr.addr = (const struct sockaddr *)&link->next_addr;
    ep_params.sockaddr.addrlen = link->next_addrlen;
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = stria__out_err_cb;
    ep_params.err_handler.arg = link;
    link->retry_at = 0;
    ucs_status_t s = ucp_ep_create(ctx->worker, &ep_params, &link->out_ep);
    if (s != UCS_OK) {
        link->out_ep = NULL;
        pthread_mutex_lock(&ctx->lock);
        stria__link_fail_locked(link, stria__ucs_status(s), stria_link_next(&link->base), 0,
                                "cannot create an endpoint to successor rank %d at %s: %s",
                                stria_link_next(&link->base), link->next_desc,
                                ucs_status_string(s));
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    stria__ctrl_t hello;
    stria__link_ctrl_init(link, &hello, STRIA__CTRL_HELLO);
    stria__ctrl_send(link->out_ep, &hello, &link->ctrl_pending);
}

static void stria__conn_ack(stria__ucx_conn_t *conn, const stria__ucx_link_t *link,
                            stria_status_t status, const char *text)
{
    stria__ctrl_t ack;
    memset(&ack, 0, sizeof(ack));
    ack.type = STRIA__CTRL_ACK;
    ack.job_id = conn->hello.job_id;
    ack.ring_id = conn->hello.ring_id;
    ack.rank = link != NULL ? link->base.rank : (conn->hello.rank + 1) % conn->hello.size;
    ack.size = link != NULL ? link->base.size : conn->hello.size;
    ack.status = status;
    ack.slot = (status == STRIA_OK && link != NULL) ? link->in_slot : 0;
    ack.origin = ack.rank;
    snprintf(ack.text, sizeof(ack.text), "%s", text != NULL ? text : "");
    stria__ctrl_send(conn->ep, &ack, &conn->ctrl_pending);
}

/* Gives a connection whose handshake arrived to the link of its ring, if that
 * link exists yet. */
static void stria__conn_try_claim(stria_ucx_ctx_t *ctx, stria__ucx_conn_t *conn)
{
    if (conn->link != NULL || !conn->have_hello || conn->closing)
        return;
    const stria__ctrl_t *h = &conn->hello;
    stria__ucx_link_t *link = NULL;
    char text[STRIA__UCX_TEXT_MAX];
    stria_status_t status = STRIA_OK;

    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *n = ctx->links.next; n != &ctx->links; n = n->next) {
        stria__ucx_link_t *l = STRIA__OF(n, stria__ucx_link_t, ctx_node);
        if (l->job_id == h->job_id && l->ring_id == h->ring_id && !l->want_destroy) {
            link = l;
            break;
        }
    }
    if (link == NULL) {
        pthread_mutex_unlock(&ctx->lock);
        return; /* parked until the ring's link connects here */
    }
    int prev = stria_link_prev(&link->base);
    if (link->failed) {
        status = STRIA_ERR_CLOSED;
        snprintf(text, sizeof(text), "rank %d of ring %llu (job %llu) has failed: %.200s",
                 link->base.rank, (unsigned long long)link->ring_id,
                 (unsigned long long)link->job_id, link->fail_msg);
    } else if (link->in_ready) {
        status = STRIA_ERR_BUSY;
        snprintf(text, sizeof(text),
                 "rank %d of ring %llu (job %llu) already has its predecessor connected",
                 link->base.rank, (unsigned long long)link->ring_id,
                 (unsigned long long)link->job_id);
    } else if (h->size != link->base.size || h->rank != prev) {
        status = STRIA_ERR_PROTOCOL;
        snprintf(text, sizeof(text),
                 "rank %d of %d (ring %llu, job %llu) expects its predecessor to be rank %d of "
                 "%d, got rank %d of %d",
                 link->base.rank, link->base.size, (unsigned long long)link->ring_id,
                 (unsigned long long)link->job_id, prev, link->base.size, (int)h->rank,
                 (int)h->size);
        stria__link_fail_locked(link, STRIA_ERR_PROTOCOL, (int)h->rank, STRIA__NOTIFY_NEXT,
                                "predecessor at %s announced rank %d of %d, expected rank %d of %d",
                                conn->peer, (int)h->rank, (int)h->size, prev, link->base.size);
    } else {
        conn->link = link;
        link->in_conn = conn;
        link->in_ready = true;
        link->last_prev = stria_time_now();
        pthread_cond_broadcast(&ctx->cond);
    }
    pthread_mutex_unlock(&ctx->lock);

    if (status == STRIA_OK) {
        stria_log_debug("ucx link rank %d: predecessor rank %d connected from %s", link->base.rank,
                        (int)h->rank, conn->peer);
        stria__conn_ack(conn, link, STRIA_OK, NULL);
    } else {
        stria__conn_ack(conn, link, status, text);
        conn->closing = true;
        stria__ep_close(ctx, conn->ep, false, NULL, conn);
    }
}

static stria__ucx_link_t *stria__link_by_out_ep(stria_ucx_ctx_t *ctx, ucp_ep_h ep)
{
    stria__ucx_link_t *found = NULL;
    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *n = ctx->links.next; n != &ctx->links; n = n->next) {
        stria__ucx_link_t *l = STRIA__OF(n, stria__ucx_link_t, ctx_node);
        if (l->out_ep == ep && ep != NULL) {
            found = l;
            break;
        }
    }
    pthread_mutex_unlock(&ctx->lock);
    return found;
}

static stria__ucx_conn_t *stria__conn_by_ep(stria_ucx_ctx_t *ctx, ucp_ep_h ep)
{
    for (stria__node_t *n = ctx->conns.next; n != &ctx->conns; n = n->next) {
        stria__ucx_conn_t *c = STRIA__OF(n, stria__ucx_conn_t, node);
        if (c->ep == ep && !c->closing)
            return c;
    }
    return NULL;
}

static void stria__handle_conn_req(stria_ucx_ctx_t *ctx, ucp_conn_request_h req)
{
    char peer[80] = "unknown peer";
    ucp_conn_request_attr_t attr;
    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ucp_conn_request_query(req, &attr) == UCS_OK)
        stria__addr_str((const struct sockaddr *)&attr.client_address, peer, sizeof(peer));

    bool stopping;
    pthread_mutex_lock(&ctx->lock);
    stopping = ctx->stop;
    pthread_mutex_unlock(&ctx->lock);
    if (stopping || ctx->n_conns >= STRIA__UCX_MAX_CONNS) {
        stria_log_warn("ucx link: rejecting a connection from %s (%s)", peer,
                       stopping ? "shutting down" : "too many connections");
        ucp_listener_reject(ctx->listener, req);
        return;
    }
    stria__ucx_conn_t *conn = calloc(1, sizeof(*conn));
    if (conn == NULL) {
        ucp_listener_reject(ctx->listener, req);
        return;
    }
    conn->ctx = ctx;
    snprintf(conn->peer, sizeof(conn->peer), "%s", peer);
    ucp_ep_params_t ep_params;
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                           UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.conn_request = req;
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = stria__in_err_cb;
    ep_params.err_handler.arg = conn;
    ucs_status_t s = ucp_ep_create(ctx->worker, &ep_params, &conn->ep);
    if (s != UCS_OK) {
        stria_log_warn("ucx link: cannot accept a connection from %s: %s", peer,
                       ucs_status_string(s));
        free(conn);
        return;
    }
    stria__list_push(&ctx->conns, &conn->node);
    ctx->n_conns++;
    stria_log_debug("ucx link: accepted a connection from %s", peer);
}

static void stria__handle_ack(stria_ucx_ctx_t *ctx, ucp_ep_h ep, const stria__ctrl_t *c)
{
    stria__ucx_link_t *link = stria__link_by_out_ep(ctx, ep);
    if (link == NULL) {
        stria_log_debug("ucx link: acknowledgement on an unknown endpoint");
        return;
    }
    int next = stria_link_next(&link->base);
    pthread_mutex_lock(&ctx->lock);
    if (link->out_ready || link->failed) {
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    if (c->job_id != link->job_id || c->ring_id != link->ring_id) {
        stria__link_fail_locked(link, STRIA_ERR_PROTOCOL, next, 0,
                                "successor at %s acknowledged ring %llu of job %llu, expected ring "
                                "%llu of job %llu",
                                link->next_desc, (unsigned long long)c->ring_id,
                                (unsigned long long)c->job_id, (unsigned long long)link->ring_id,
                                (unsigned long long)link->job_id);
    } else if (c->status != STRIA_OK) {
        stria_status_t st = c->status == STRIA_ERR_BUSY || c->status == STRIA_ERR_CLOSED
                                ? (stria_status_t)c->status
                                : STRIA_ERR_PROTOCOL;
        stria__link_fail_locked(link, st, next, 0, "successor at %s refused the handshake: %s",
                                link->next_desc, c->text);
    } else if (c->rank != next || c->size != link->base.size) {
        stria__link_fail_locked(link, STRIA_ERR_PROTOCOL, next, 0,
                                "successor at %s is rank %d of %d, expected rank %d of %d",
                                link->next_desc, (int)c->rank, (int)c->size, next, link->base.size);
    } else if (c->slot == 0 || c->slot >= STRIA__UCX_SLOTS) {
        stria__link_fail_locked(link, STRIA_ERR_PROTOCOL, next, 0,
                                "successor at %s gave an invalid slot %u", link->next_desc,
                                c->slot);
    } else {
        link->out_slot = c->slot;
        link->out_ready = true;
        link->last_next = stria_time_now();
        pthread_cond_broadcast(&ctx->cond);
    }
    bool ready = link->out_ready && !link->failed;
    pthread_mutex_unlock(&ctx->lock);
    if (ready && stria_log_level() >= STRIA_LOG_DEBUG)
        ucp_ep_print_info(link->out_ep, stderr); /* the lanes UCX chose */
}

/* A neighbour destroyed its link after finishing its requests: the side
 * towards it is closed. What it sent before stays receivable; receives it
 * cannot satisfy fail with STRIA_ERR_CLOSED, and so do sends to it. Closing
 * our endpoint tells it we are done with the connection. */
static void stria__handle_bye(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, int from_mask)
{
    pthread_mutex_lock(&ctx->lock);
    if (from_mask == STRIA__NOTIFY_PREV) {
        link->prev_closed = true;
        while (!stria__list_empty(&link->posted)) {
            stria_link_req_t *req = STRIA__OF(link->posted.next, stria_link_req_t, queue_node);
            char msg[200];
            stria__list_del(&req->queue_node);
            snprintf(msg, sizeof(msg), "rank %d left the ring; no message tag %#llx will come",
                     stria_link_prev(&link->base), (unsigned long long)req->tag);
            stria__req_finish_locked(req, STRIA_ERR_CLOSED, msg);
        }
    } else {
        link->next_closed = true;
    }
    pthread_cond_broadcast(&ctx->cond);
    pthread_mutex_unlock(&ctx->lock);
    if (from_mask == STRIA__NOTIFY_PREV && link->in_conn != NULL) {
        stria__ucx_conn_t *conn = link->in_conn;
        pthread_mutex_lock(&ctx->lock);
        link->in_conn = NULL;
        conn->link = NULL;
        pthread_mutex_unlock(&ctx->lock);
        conn->closing = true;
        stria__ep_close(ctx, conn->ep, true, link, conn);
    } else if (from_mask == STRIA__NOTIFY_NEXT && link->out_ep != NULL) {
        ucp_ep_h ep = link->out_ep;
        link->out_ep = NULL;
        stria__ep_close(ctx, ep, true, link, NULL);
    }
}

/* ABORT, BYE or PING from a neighbour: ABORT fails the link and is passed
 * on; every message shows the neighbour is alive. */
static void stria__handle_notice(stria_ucx_ctx_t *ctx, ucp_ep_h ep, const stria__ctrl_t *c)
{
    stria__ucx_link_t *link = stria__link_by_out_ep(ctx, ep);
    int from_mask = STRIA__NOTIFY_NEXT; /* came from the successor */
    if (link == NULL) {
        stria__ucx_conn_t *conn = stria__conn_by_ep(ctx, ep);
        if (conn == NULL || conn->link == NULL)
            return;
        link = conn->link;
        from_mask = STRIA__NOTIFY_PREV;
    }
    if (c->job_id != link->job_id || c->ring_id != link->ring_id)
        return;
    int forward = (STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV) & ~from_mask;
    pthread_mutex_lock(&ctx->lock);
    if (from_mask == STRIA__NOTIFY_NEXT)
        link->last_next = stria_time_now();
    else
        link->last_prev = stria_time_now();
    if (c->type == STRIA__CTRL_PING) {
        /* A heartbeat's origin names the rank its sender (or someone
         * before it) found silent, its slot the rank that saw it, its
         * status the silence in ms. Suspicion of ourselves is not ours to
         * pass on, nor our own report come round the ring. */
        int reporter = c->slot < (uint32_t)link->base.size ? (int)c->slot : c->rank;
        if (c->origin >= 0 && c->origin < link->base.size && c->origin != link->base.rank &&
            reporter != link->base.rank && c->status >= 0) {
            int d = from_mask == STRIA__NOTIFY_PREV ? STRIA__FROM_PREV : STRIA__FROM_NEXT;
            link->heard[d].suspect = (int)c->origin;
            link->heard[d].reporter = reporter;
            link->heard[d].silence = c->status / 1000.0;
            link->heard[d].at = stria_time_now();
        }
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    if (c->type == STRIA__CTRL_BYE) {
        pthread_mutex_unlock(&ctx->lock);
        stria__handle_bye(ctx, link, from_mask);
        return;
    }
    if (!link->failed) {
        /* Every failure seen from elsewhere is STRIA_ERR_PEER; the text
         * says what happened and names the rank at fault. An abort's slot
         * field carries the rank that first reported it. */
        int reporter = c->slot < (uint32_t)link->base.size ? (int)c->slot : (int)c->rank;
        if (c->origin != reporter)
            stria__link_fail_locked(link, STRIA_ERR_PEER, (int)c->origin, forward,
                                    "%s (reported by rank %d)", c->text, reporter);
        else
            stria__link_fail_locked(link, STRIA_ERR_PEER, (int)c->origin, forward, "%s", c->text);
        /* Passed on unchanged. */
        link->notify_reporter = reporter;
        snprintf(link->notify_text, sizeof(link->notify_text), "%s", c->text);
    }
    pthread_mutex_unlock(&ctx->lock);
}

static void stria__handle_out_err(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, ucp_ep_h ep,
                                  ucs_status_t status)
{
    if (link->out_ep != ep)
        return; /* an endpoint of an earlier attempt */
    int next = stria_link_next(&link->base);
    bool retry = false;
    pthread_mutex_lock(&ctx->lock);
    if (link->graceful || link->next_closed) {
        /* The successor closed its side after our goodbye or its own. */
    } else if (!link->out_ready && !link->failed && stria_time_now() < link->connect_deadline &&
               (status == UCS_ERR_UNREACHABLE || status == UCS_ERR_CONNECTION_RESET ||
                status == UCS_ERR_REJECTED || status == UCS_ERR_NOT_CONNECTED ||
                status == UCS_ERR_ENDPOINT_TIMEOUT || status == UCS_ERR_IO_ERROR)) {
        retry = true;
    } else if (link->out_ready && !link->failed) {
        /* Kept open until the failure settles, so that a notice still on
         * its way over this connection is read. */
        stria__link_peer_error_locked(link, STRIA__NOTIFY_NEXT,
                                      "rank %d (successor at %s) failed: %s", next, link->next_desc,
                                      ucs_status_string(status));
        pthread_mutex_unlock(&ctx->lock);
        return;
    } else {
        stria__link_fail_locked(link, STRIA_ERR_PEER, next, STRIA__NOTIFY_PREV,
                                "rank %d (successor at %s) failed: %s", next, link->next_desc,
                                ucs_status_string(status));
    }
    pthread_mutex_unlock(&ctx->lock);
    link->out_ep = NULL;
    stria__ep_close(ctx, ep, true, link, NULL);
    if (retry) {
        if (link->retry_delay <= 0)
            link->retry_delay = 0.05;
        link->retry_at = stria_time_now() + link->retry_delay;
        link->retry_delay = link->retry_delay * 2 > 1.0 ? 1.0 : link->retry_delay * 2;
        stria_log_debug("ucx link rank %d: successor at %s not reachable (%s), retrying",
                        link->base.rank, link->next_desc, ucs_status_string(status));
    }
}

static void stria__handle_in_err(stria_ucx_ctx_t *ctx, stria__ucx_conn_t *conn, ucs_status_t status)
{
    if (conn->closing)
        return;
    stria__ucx_link_t *link = conn->link;
    if (link != NULL) {
        int prev = stria_link_prev(&link->base);
        pthread_mutex_lock(&ctx->lock);
        if (!link->graceful && !link->prev_closed && !link->failed) {
            /* Kept open until the failure settles (see the successor's). */
            stria__link_peer_error_locked(link, STRIA__NOTIFY_PREV,
                                          "rank %d (predecessor at %s) failed: %s", prev,
                                          conn->peer, ucs_status_string(status));
            pthread_mutex_unlock(&ctx->lock);
            return;
        }
        link->in_conn = NULL;
        conn->link = NULL;
        pthread_mutex_unlock(&ctx->lock);
        conn->closing = true;
        stria__ep_close(ctx, conn->ep, true, link, conn);
    } else {
        stria_log_debug("ucx link: connection from %s dropped: %s", conn->peer,
                        ucs_status_string(status));
        conn->closing = true;
        stria__ep_close(ctx, conn->ep, true, NULL, conn);
    }
}

/* Handles what the callbacks recorded. Returns whether there was anything. */
static bool stria__run_events(stria_ucx_ctx_t *ctx)
{
    bool any = false;
    while (!stria__list_empty(&ctx->events)) {
        stria__node_t *n = ctx->events.next;
        stria__list_del(n);
        stria__event_t *ev = STRIA__OF(n, stria__event_t, node);
        any = true;
        switch (ev->type) {
        case STRIA__EV_CONN_REQ:
            stria__handle_conn_req(ctx, ev->conn_req);
            break;
        case STRIA__EV_CTRL:
            if (ev->ctrl.type == STRIA__CTRL_HELLO) {
                stria__ucx_conn_t *conn = stria__conn_by_ep(ctx, ev->ep);
                if (conn == NULL) {
                    stria_log_debug("ucx link: handshake on an unknown endpoint");
                } else if (conn->have_hello) {
                    stria_log_warn("ucx link: second handshake from %s; closing it", conn->peer);
                    stria__handle_in_err(ctx, conn, UCS_ERR_INVALID_PARAM);
                } else {
                    conn->hello = ev->ctrl;
                    conn->have_hello = true;
                    stria__conn_try_claim(ctx, conn);
                }
            } else if (ev->ctrl.type == STRIA__CTRL_ACK) {
                stria__handle_ack(ctx, ev->ep, &ev->ctrl);
            } else {
                stria__handle_notice(ctx, ev->ep, &ev->ctrl);
            }
            break;
        case STRIA__EV_OUT_ERR:
            stria__handle_out_err(ctx, ev->obj, ev->ep, ev->status);
            break;
        case STRIA__EV_IN_ERR:
            stria__handle_in_err(ctx, ev->obj, ev->status);
            break;
        }
        free(ev);
    }
    return any;
}

/* Starts the transfer of a matched rendezvous receive. */
static void stria__recv_start(stria_ucx_ctx_t *ctx, stria_link_req_t *req, void *desc)
{
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv_am = stria__data_recv_cb;
    param.user_data = req;
    void *r = ucp_am_recv_data_nbx(ctx->worker, desc, req->buf, req->len, &param);
    if (r == NULL) {
        stria__data_done(req, UCS_OK, req->len);
    } else if (UCS_PTR_IS_ERR(r)) {
        stria__data_done(req, UCS_PTR_STATUS(r), 0);
    } else {
        req->ucp_req = r;
    }
}

static void stria__send_start(stria_ucx_ctx_t *ctx, stria_link_req_t *req)
{
    stria__ucx_link_t *link = req->link;
    (void)ctx;
    if (link->out_ep == NULL) {
        stria__data_done(req, UCS_ERR_NOT_CONNECTED, 0);
        return;
    }
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = stria__data_send_cb;
    param.user_data = req;
    param.flags = req->len >= STRIA__UCX_RNDV_MIN ? UCP_AM_SEND_FLAG_RNDV : 0;
    void *r = ucp_am_send_nbx(link->out_ep, STRIA__UCX_AM_DATA, req->hdr, STRIA__UCX_DATA_HDR,
                              req->buf, req->len, &param);
    if (r == NULL) {
        stria__data_done(req, UCS_OK, 0);
    } else if (UCS_PTR_IS_ERR(r)) {
        stria__data_done(req, UCS_PTR_STATUS(r), 0);
    } else {
        req->ucp_req = r;
    }
}

/* Posts queued requests and starts matched rendezvous receives. */
static bool stria__run_queue(stria_ucx_ctx_t *ctx)
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
            /* A rendezvous arrival matched in the data callback. */
            void *desc = req->desc;
            req->desc = NULL;
            if (link->failed) {
                stria__req_finish_locked(req, link->fail_status, link->fail_msg);
                pthread_mutex_unlock(&ctx->lock);
                ucp_am_data_release(ctx->worker, desc);
            } else {
                pthread_mutex_unlock(&ctx->lock);
                stria__recv_start(ctx, req, desc);
            }
            pthread_mutex_lock(&ctx->lock);
            continue;
        }
        req->state = STRIA__REQ_POSTED;
        ctx->in_flight++;
        if (link->failed) {
            stria__req_finish_locked(req, link->fail_status, link->fail_msg);
            continue;
        }
        if (req->is_send && link->next_closed) {
            char msg[200];
            snprintf(msg, sizeof(msg), "rank %d left the ring; cannot send tag %#llx",
                     stria_link_next(&link->base), (unsigned long long)req->tag);
            stria__req_finish_locked(req, STRIA_ERR_CLOSED, msg);
            continue;
        }
        if (req->is_send) {
            pthread_mutex_unlock(&ctx->lock);
            stria__send_start(ctx, req);
            pthread_mutex_lock(&ctx->lock);
            continue;
        }
        stria__unexp_t *u = NULL;
        for (stria__node_t *n = link->unexp.next; n != &link->unexp; n = n->next) {
            stria__unexp_t *x = STRIA__OF(n, stria__unexp_t, node);
            if (x->tag == req->tag) {
                u = x;
                break;
            }
        }
        if (u == NULL && link->prev_closed) {
            char msg[200];
            snprintf(msg, sizeof(msg), "rank %d left the ring; no message tag %#llx will come",
                     stria_link_prev(&link->base), (unsigned long long)req->tag);
            stria__req_finish_locked(req, STRIA_ERR_CLOSED, msg);
            continue;
        }
        if (u == NULL) {
            stria__list_push(&link->posted, &req->queue_node);
            continue;
        }
        stria__list_del(&u->node);
        if (!u->rndv)
            link->unexp_bytes -= u->len;
        if (u->len != req->len) {
            stria__link_fail_locked(
                link, STRIA_ERR_PROTOCOL, stria_link_prev(&link->base),
                STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                "message tag %#llx from rank %d has %zu bytes, the receive expects %zu",
                (unsigned long long)req->tag, stria_link_prev(&link->base), u->len, req->len);
            stria__req_finish_locked(req, link->fail_status, link->fail_msg);
            pthread_mutex_unlock(&ctx->lock);
            if (u->desc != NULL)
                ucp_am_data_release(ctx->worker, u->desc);
            free(u->copy);
            free(u);
            pthread_mutex_lock(&ctx->lock);
            continue;
        }
        req->matched = true;
        if (u->rndv) {
            pthread_mutex_unlock(&ctx->lock);
            stria__recv_start(ctx, req, u->desc);
            free(u);
            pthread_mutex_lock(&ctx->lock);
            continue;
        }
        if (u->len > 0)
            memcpy(req->buf, u->copy != NULL ? u->copy : u->desc, u->len);
        stria__req_finish_locked(req, STRIA_OK, NULL);
        pthread_mutex_unlock(&ctx->lock);
        if (u->desc != NULL)
            ucp_am_data_release(ctx->worker, u->desc);
        free(u->copy);
        free(u);
        pthread_mutex_lock(&ctx->lock);
    }
    pthread_mutex_unlock(&ctx->lock);
    return any;
}

static void stria__flush_cb(void *request, ucs_status_t status, void *user_data)
{
    stria__ucx_link_t *link = user_data;
    (void)status;
    link->flush_pending--;
    ucp_request_free(request);
}

/* Flushes both endpoints of a link; flush_pending counts the flushes. */
static void stria__link_flush_eps(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    ucp_ep_h eps[2] = {link->out_ep, link->in_conn != NULL ? link->in_conn->ep : NULL};
    (void)ctx;
    for (int i = 0; i < 2; i++) {
        if (eps[i] == NULL)
            continue;
        ucp_request_param_t param;
        memset(&param, 0, sizeof(param));
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = stria__flush_cb;
        param.user_data = link;
        void *r = ucp_ep_flush_nbx(eps[i], &param);
        if (r != NULL && !UCS_PTR_IS_ERR(r))
            link->flush_pending++;
    }
}

/* Releases the arrivals no receive took. */
static void stria__link_drop_unexp(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
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

/* Sends the failure notices, finishes unmatched receives, drops early
 * arrivals and schedules the endpoints' forced close. */
static void stria__link_teardown(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    stria__ctrl_t notice;

    pthread_mutex_lock(&ctx->lock);
    stria__link_ctrl_init(link, &notice, STRIA__CTRL_ABORT);
    notice.status = link->fail_status;
    notice.origin = link->notify_origin;
    notice.slot = (uint32_t)link->notify_reporter;
    snprintf(notice.text, sizeof(notice.text), "%s", link->notify_text);
    int mask = link->notify_mask;
    while (!stria__list_empty(&link->posted)) {
        stria_link_req_t *req = STRIA__OF(link->posted.next, stria_link_req_t, queue_node);
        stria__list_del(&req->queue_node);
        stria__req_finish_locked(req, link->fail_status, link->fail_msg);
    }
    pthread_mutex_unlock(&ctx->lock);

    if ((mask & STRIA__NOTIFY_NEXT) && link->out_ep != NULL && link->out_ready)
        stria__ctrl_send(link->out_ep, &notice, &link->ctrl_pending);
    if ((mask & STRIA__NOTIFY_PREV) && link->in_conn != NULL)
        stria__ctrl_send(link->in_conn->ep, &notice, &link->in_conn->ctrl_pending);
    stria__link_drop_unexp(ctx, link);
    link->torn = true;
    link->retry_at = 0;
    stria__link_flush_eps(ctx, link);
    link->close_at = stria_time_now() + STRIA__UCX_NOTIFY_GRACE_S;
}

static void stria__link_close_eps(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, bool force)
{
    if (link->out_ep != NULL) {
        ucp_ep_h ep = link->out_ep;
        link->out_ep = NULL;
        stria__ep_close(ctx, ep, force, link, NULL);
    }
    if (link->in_conn != NULL) {
        stria__ucx_conn_t *conn = link->in_conn;
        pthread_mutex_lock(&ctx->lock);
        link->in_conn = NULL;
        conn->link = NULL;
        pthread_mutex_unlock(&ctx->lock);
        conn->closing = true;
        stria__ep_close(ctx, conn->ep, force, link, conn);
    }
}

/* Whether the link still has requests the progress thread or UCX holds. */
static bool stria__link_busy_locked(const stria__ucx_link_t *link)
{
    for (stria__node_t *n = link->reqs.next; n != &link->reqs; n = n->next) {
        const stria_link_req_t *r = STRIA__OF(n, stria_link_req_t, link_node);
        if (r->state == STRIA__REQ_POSTED)
            return true;
    }
    return false;
}

/* Advances one link's connect, teardown and close. Returns when something
 * is due next (0: nothing). */
static double stria__run_link(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, double now, bool *any)
{
    double due = 0;
    pthread_mutex_lock(&ctx->lock);
    if (link->settle_at > 0 && !link->failed) {
        if (now >= link->settle_at) {
            int side = link->settle_side;
            int peer = side == STRIA__NOTIFY_NEXT ? stria_link_next(&link->base)
                                                  : stria_link_prev(&link->base);
            stria__link_fail_locked(link, STRIA_ERR_PEER, peer,
                                    (STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV) & ~side, "%s",
                                    link->settle_msg);
            *any = true;
        } else {
            due = link->settle_at;
        }
    }
    bool want_connect = link->want_connect;
    bool want_teardown = link->want_teardown && !link->torn;
    bool want_destroy = link->want_destroy;
    bool failed = link->failed;
    link->want_connect = false;
    pthread_mutex_unlock(&ctx->lock);

    if (want_connect && !failed) {
        *any = true;
        stria__link_connect_out(ctx, link);
        for (stria__node_t *n = ctx->conns.next; n != &ctx->conns;) {
            stria__ucx_conn_t *c = STRIA__OF(n, stria__ucx_conn_t, node);
            n = n->next;
            stria__conn_try_claim(ctx, c);
        }
    }
    if (!failed && link->retry_at > 0) {
        if (now >= link->retry_at) {
            *any = true;
            stria__link_connect_out(ctx, link);
        } else {
            due = link->retry_at;
        }
    }
    if (want_teardown) {
        *any = true;
        stria__link_teardown(ctx, link);
    }
    if (want_destroy && !failed && !link->graceful && !link->torn) {
        /* Goodbye on both endpoints, flushed, then closed. */
        *any = true;
        link->graceful = true;
        link->retry_at = 0;
        /* The peers close their side when they have handled it; ours
         * close then (or after the grace), so the goodbye is never
         * overtaken by the disconnect. */
        stria__ctrl_t bye;
        stria__link_ctrl_init(link, &bye, STRIA__CTRL_BYE);
        if (link->out_ep != NULL)
            stria__ctrl_send(link->out_ep, &bye, &link->ctrl_pending);
        if (link->in_conn != NULL)
            stria__ctrl_send(link->in_conn->ep, &bye, &link->in_conn->ctrl_pending);
        stria__link_drop_unexp(ctx, link);
        link->close_at = now + STRIA__UCX_CLOSE_GRACE_S;
    }
    if ((link->torn || link->graceful) && link->close_at > 0) {
        bool gone = link->out_ep == NULL && link->in_conn == NULL;
        if (gone || now >= link->close_at || (link->torn && link->flush_pending == 0)) {
            *any = true;
            link->close_at = 0;
            /* Forced: a peer that does not answer must not hold the close
             * (every endpoint is in peer error mode on both sides). */
            stria__link_close_eps(ctx, link, true);
        } else if (due == 0 || link->close_at < due) {
            due = link->close_at;
        }
    }
    if (!link->torn && !link->graceful && !failed && link->out_ep != NULL &&
        link->in_conn != NULL) {
        if (now >= link->next_ping) {
            /* Each heartbeat passes on what came from the other side. */
            stria__ctrl_t ping[2];
            pthread_mutex_lock(&ctx->lock);
            for (int d = 0; d < 2; d++) {
                int reporter;
                double silence;
                stria__link_ctrl_init(link, &ping[d], STRIA__CTRL_PING);
                ping[d].origin = stria__link_suspect_locked(link, now, d, &reporter, &silence);
                ping[d].slot = (uint32_t)reporter;
                ping[d].status = ping[d].origin >= 0 ? (int32_t)(silence * 1000) : 0;
            }
            stria__link_log_suspect_locked(link, now);
            pthread_mutex_unlock(&ctx->lock);
            /* A stalled peer stops reading: do not pile heartbeats up. */
            if (link->ctrl_pending < 4)
                stria__ctrl_send(link->out_ep, &ping[STRIA__FROM_PREV], &link->ctrl_pending);
            if (link->in_conn->ctrl_pending < 4)
                stria__ctrl_send(link->in_conn->ep, &ping[STRIA__FROM_NEXT],
                                 &link->in_conn->ctrl_pending);
            link->next_ping = now + ctx->ping_s;
        }
        if (due == 0 || link->next_ping < due)
            due = link->next_ping;
    }
    void **detached = NULL;
    size_t n_detached = 0;
    pthread_mutex_lock(&ctx->lock);
    bool quiet = !link->closed && (link->torn || link->graceful) && link->close_at == 0 &&
                 link->out_ep == NULL && link->in_conn == NULL && link->eps_closing == 0 &&
                 link->flush_pending == 0;
    if (quiet && stria__link_busy_locked(link)) {
        if (link->detach_at == 0)
            link->detach_at = now + STRIA__UCX_DETACH_S;
        if (now >= link->detach_at) {
            size_t cap = 0;
            for (stria__node_t *n = link->reqs.next; n != &link->reqs; n = n->next)
                cap++;
            detached = calloc(cap, sizeof(*detached));
            for (stria__node_t *n = link->reqs.next; n != &link->reqs && detached != NULL;) {
                stria_link_req_t *r = STRIA__OF(n, stria_link_req_t, link_node);
                n = n->next;
                if (r->state == STRIA__REQ_POSTED && r->ucp_req != NULL) {
                    detached[n_detached++] = r->ucp_req;
                    stria__req_finish_locked(r, link->fail_status, link->fail_msg);
                }
            }
        } else if (due == 0 || link->detach_at < due) {
            due = link->detach_at;
        }
    }
    if (quiet && !stria__link_busy_locked(link)) {
        stria__events_forget(ctx, link);
        link->closed = true;
        *any = true;
        pthread_cond_broadcast(&ctx->cond);
    }
    pthread_mutex_unlock(&ctx->lock);
    if (n_detached > 0) {
        /* UCX keeps them (a rendezvous whose peer stopped); released, they
         * call nobody back. The peer may still read a detached send
         * buffer should it resume; its connections are closed, so nothing
         * is written into a detached receive buffer. */
        stria_log_warn("ucx link rank %d: UCX kept %zu requests after closing the endpoints; "
                       "handed back",
                       link->base.rank, n_detached);
        for (size_t i = 0; i < n_detached; i++)
            ucp_request_free(detached[i]);
        *any = true;
    }
    free(detached);
    return due;
}

/* Advances every link. Returns the earliest time something is due (0: none). */
static double stria__run_links(stria_ucx_ctx_t *ctx, bool *any)
{
    double due = 0, now = stria_time_now();
    size_t n_todo = 0;

    /* Links are only freed by their owner after `closed`, which only this
     * thread sets, so pointers taken under the lock stay valid here. */
    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *n = ctx->links.next; n != &ctx->links; n = n->next) {
        stria__ucx_link_t *l = STRIA__OF(n, stria__ucx_link_t, ctx_node);
        if (l->closed)
            continue;
        if (n_todo == ctx->todo_cap) {
            size_t cap = ctx->todo_cap ? 2 * ctx->todo_cap : 16;
            stria__ucx_link_t **t = realloc(ctx->todo, cap * sizeof(*t));
            if (t == NULL)
                break; /* the rest waits for the next round */
            ctx->todo = t;
            ctx->todo_cap = cap;
        }
        ctx->todo[n_todo++] = l;
    }
    pthread_mutex_unlock(&ctx->lock);

    for (size_t i = 0; i < n_todo; i++) {
        double d = stria__run_link(ctx, ctx->todo[i], now, any);
        if (d > 0 && (due == 0 || d < due))
            due = d;
    }
    return due;
}

static void *stria__progress_main(void *arg)
{
    stria_ucx_ctx_t *ctx = arg;
    int busy_rounds = 0;
    double last_active = 0;
    for (;;) {
        bool any = false;
        any |= stria__run_queue(ctx);
        while (ucp_worker_progress(ctx->worker) != 0)
            any = true;
        any |= stria__run_events(ctx);
        double due = stria__run_links(ctx, &any);

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
    return NULL;
}

/* ---- context ------------------------------------------------------------------------- */

/* Whether a UCX_TLS list can select one of the named transports (UCX's
 * aliases "all", "sm" and "shm" and exclusion lists included). */
static bool stria__tls_may_use(const char *tls, const char *const *names)
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

static void stria__env_default(const char *name, const char *value)
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
 *   still read (never write) a send buffer the link already released. */
static void stria__env_defaults(const char *tls)
{
    static pthread_mutex_t env_lock = PTHREAD_MUTEX_INITIALIZER;
    static const char *const posix[] = {"posix", NULL};
    static const char *const sysv[] = {"sysv", NULL};
    static const char *const cma[] = {"cma", NULL};
    const char *eff = tls != NULL ? tls : getenv("UCX_TLS");
    pthread_mutex_lock(&env_lock);
    stria__env_default("UCX_TCP_CM_REUSEADDR", "y");
    if (stria__tls_may_use(eff, posix))
        stria__env_default("UCX_POSIX_ERROR_HANDLING", "y");
    if (stria__tls_may_use(eff, sysv))
        stria__env_default("UCX_SYSV_ERROR_HANDLING", "y");
    if (stria__tls_may_use(eff, cma))
        stria__env_default("UCX_CMA_MEMORY_INVALIDATE", "y");
    pthread_mutex_unlock(&env_lock);
}

stria_status_t stria_ucx_ctx_create(const stria_ucx_ctx_params_t *params, stria_ucx_ctx_t **ctx_out)
{
    stria_status_t st;
    ucs_status_t s;
    ucp_config_t *config = NULL;
    struct sockaddr_storage addr;
    socklen_t addrlen;

    if (params == NULL || ctx_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_ucx_ctx_create: NULL argument");
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
    double ping_s = params->heartbeat_s > 0 ? params->heartbeat_s : STRIA__UCX_PING_S;
    double stale_s = params->stall_s > 0 ? params->stall_s : STRIA__UCX_STALE_S;
    if (!(params->heartbeat_s >= 0 && ping_s <= STRIA__UCX_PING_MAX_S))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ucx context: heartbeat period %g s is not in (0, %g] s",
                               params->heartbeat_s, STRIA__UCX_PING_MAX_S);
    if (!(params->stall_s >= 0 && stale_s >= 2 * ping_s && stale_s <= STRIA__UCX_STALE_MAX_S))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ucx context: stall time %g s is not in [%g, %g] s (at least two "
                               "heartbeat periods of %g s)",
                               stale_s, 2 * ping_s, STRIA__UCX_STALE_MAX_S, ping_s);
    st = stria__resolve(host, params->listen_port, true, &addr, &addrlen);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "ucx context: listen address");

    stria_ucx_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "ucx context: out of memory");
    ctx->ucp_fd = ctx->kick_fd = ctx->ep_fd = -1;
    stria__list_init(&ctx->links);
    stria__list_init(&ctx->queue);
    stria__list_init(&ctx->conns);
    stria__list_init(&ctx->events);
    stria__list_init(&ctx->starts);
    ctx->next_slot = 1;
    ctx->poll_s = params->poll_us < 0    ? 0
                  : params->poll_us == 0 ? STRIA__UCX_POLL_DEFAULT_US * 1e-6
                                         : params->poll_us * 1e-6;
    ctx->ping_s = ping_s;
    ctx->stale_s = stale_s;
    ctx->slots = calloc(STRIA__UCX_SLOTS, sizeof(*ctx->slots));
    if (ctx->slots == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "ucx context: out of memory");
        goto err_free;
    }
    pthread_mutex_init(&ctx->lock, NULL);
    pthread_condattr_t cattr;
    pthread_condattr_init(&cattr);
    pthread_condattr_setclock(&cattr, CLOCK_MONOTONIC);
    pthread_cond_init(&ctx->cond, &cattr);
    pthread_condattr_destroy(&cattr);

    stria__env_defaults(params->tls);
    s = ucp_config_read(NULL, NULL, &config);
    if (s != UCS_OK) {
        st = stria_error_set(STRIA_ERR_TRANSPORT,
                             "ucx context: cannot read the UCX configuration: %s",
                             ucs_status_string(s));
        goto err_lock;
    }
    if (params->tls != NULL && (s = ucp_config_modify(config, "TLS", params->tls)) != UCS_OK) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "ucx context: invalid transport list '%s': %s",
                             params->tls, ucs_status_string(s));
        goto err_config;
    }
    if (params->net_devices != NULL &&
        (s = ucp_config_modify(config, "NET_DEVICES", params->net_devices)) != UCS_OK) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "ucx context: invalid device list '%s': %s",
                             params->net_devices, ucs_status_string(s));
        goto err_config;
    }

    ucp_params_t ucp_params;
    memset(&ucp_params, 0, sizeof(ucp_params));
    ucp_params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    ucp_params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    ucp_params.mt_workers_shared = 0;
    s = ucp_init(&ucp_params, config, &ctx->context);
    if (s != UCS_OK) {
        st = stria_error_set(STRIA_ERR_TRANSPORT, "ucx context: ucp_init failed: %s",
                             ucs_status_string(s));
        goto err_config;
    }
    ucp_config_release(config);
    config = NULL;

    ucp_worker_params_t wparams;
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    s = ucp_worker_create(ctx->context, &wparams, &ctx->worker);
    if (s != UCS_OK) {
        st = stria_error_set(STRIA_ERR_TRANSPORT, "ucx context: cannot create a worker: %s",
                             ucs_status_string(s));
        goto err_context;
    }

    ucp_am_handler_param_t am;
    memset(&am, 0, sizeof(am));
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = STRIA__UCX_AM_CTRL;
    am.flags = UCP_AM_FLAG_WHOLE_MSG;
    am.cb = stria__am_ctrl_cb;
    am.arg = ctx;
    if ((s = ucp_worker_set_am_recv_handler(ctx->worker, &am)) == UCS_OK) {
        am.id = STRIA__UCX_AM_DATA;
        am.cb = stria__am_data_cb;
        s = ucp_worker_set_am_recv_handler(ctx->worker, &am);
    }
    if (s != UCS_OK) {
        st = stria_error_set(STRIA_ERR_TRANSPORT, "ucx context: cannot set message handlers: %s",
                             ucs_status_string(s));
        goto err_worker;
    }

    s = ucp_worker_get_efd(ctx->worker, &ctx->ucp_fd);
    if (s != UCS_OK) {
        st = stria_error_set(STRIA_ERR_TRANSPORT, "ucx context: no worker event fd: %s",
                             ucs_status_string(s));
        goto err_worker;
    }

    ucp_listener_params_t lparams;
    memset(&lparams, 0, sizeof(lparams));
    lparams.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lparams.sockaddr.addr = (const struct sockaddr *)&addr;
    lparams.sockaddr.addrlen = addrlen;
    lparams.conn_handler.cb = stria__conn_req_cb;
    lparams.conn_handler.arg = ctx;
    s = ucp_listener_create(ctx->worker, &lparams, &ctx->listener);
    if (s != UCS_OK) {
        char where[120];
        stria__addr_str((const struct sockaddr *)&addr, where, sizeof(where));
        st = stria_error_set(s == UCS_ERR_BUSY ? STRIA_ERR_BUSY : STRIA_ERR_TRANSPORT,
                             "ucx context: cannot listen on %s: %s", where, ucs_status_string(s));
        goto err_worker;
    }
    ucp_listener_attr_t lattr;
    memset(&lattr, 0, sizeof(lattr));
    lattr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(ctx->listener, &lattr);
    if (s != UCS_OK) {
        st = stria_error_set(STRIA_ERR_TRANSPORT, "ucx context: cannot query the listener: %s",
                             ucs_status_string(s));
        goto err_listener;
    }
    if (lattr.sockaddr.ss_family == AF_INET)
        ctx->port = ntohs(((struct sockaddr_in *)(void *)&lattr.sockaddr)->sin_port);
    else
        ctx->port = ntohs(((struct sockaddr_in6 *)(void *)&lattr.sockaddr)->sin6_port);

    ctx->kick_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    ctx->ep_fd = epoll_create1(EPOLL_CLOEXEC);
    if (ctx->kick_fd < 0 || ctx->ep_fd < 0) {
        st = stria_error_set(STRIA_ERR_IO, "ucx context: eventfd/epoll: %s", strerror(errno));
        goto err_fds;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.fd = ctx->ucp_fd;
    if (epoll_ctl(ctx->ep_fd, EPOLL_CTL_ADD, ctx->ucp_fd, &ev) != 0) {
        st = stria_error_set(STRIA_ERR_IO, "ucx context: epoll_ctl: %s", strerror(errno));
        goto err_fds;
    }
    ev.data.fd = ctx->kick_fd;
    if (epoll_ctl(ctx->ep_fd, EPOLL_CTL_ADD, ctx->kick_fd, &ev) != 0) {
        st = stria_error_set(STRIA_ERR_IO, "ucx context: epoll_ctl: %s", strerror(errno));
        goto err_fds;
    }
    int rc = pthread_create(&ctx->thread, NULL, stria__progress_main, ctx);
    if (rc != 0) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "ucx context: cannot start a thread: %s",
                             strerror(rc));
        goto err_fds;
    }
    ctx->thread_started = true;
    stria_log_debug("ucx context listening on port %u", (unsigned)ctx->port);
    *ctx_out = ctx;
    return STRIA_OK;

err_fds:
    if (ctx->kick_fd >= 0)
        close(ctx->kick_fd);
    if (ctx->ep_fd >= 0)
        close(ctx->ep_fd);
err_listener:
    ucp_listener_destroy(ctx->listener);
err_worker:
    ucp_worker_destroy(ctx->worker);
err_context:
    ucp_cleanup(ctx->context);
err_config:
    if (config != NULL)
        ucp_config_release(config);
err_lock:
    pthread_cond_destroy(&ctx->cond);
    pthread_mutex_destroy(&ctx->lock);
err_free:
    free(ctx->slots);
    free(ctx);
    return st;
}

uint16_t stria_ucx_ctx_port(const stria_ucx_ctx_t *ctx)
{
    return ctx != NULL ? ctx->port : 0;
}

static void stria__ucx_link_destroy(stria_link_t *base);

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
    stria__kick(ctx);
    pthread_join(ctx->thread, NULL);

    /* The progress thread is gone: this thread now owns the worker. */
    ucp_listener_destroy(ctx->listener);
    stria__run_events(ctx);
    for (stria__node_t *n = ctx->conns.next; n != &ctx->conns;) {
        stria__ucx_conn_t *c = STRIA__OF(n, stria__ucx_conn_t, node);
        n = n->next;
        if (!c->closing) {
            c->closing = true;
            stria__ep_close(ctx, c->ep, true, NULL, c);
        }
    }
    double until = stria_time_now() + 2.0;
    while ((ctx->closing > 0 || !stria__list_empty(&ctx->events)) && stria_time_now() < until) {
        ucp_worker_progress(ctx->worker);
        stria__run_events(ctx);
    }
    if (ctx->closing > 0)
        stria_log_warn("ucx context: %d endpoint closes did not finish", ctx->closing);
    while (!stria__list_empty(&ctx->events)) {
        stria__node_t *n = ctx->events.next;
        stria__list_del(n);
        stria__event_t *ev = STRIA__OF(n, stria__event_t, node);
        if (ev->type == STRIA__EV_CONN_REQ)
            ucp_listener_reject(ctx->listener, ev->conn_req);
        free(ev);
    }
    ucp_worker_destroy(ctx->worker);
    ucp_cleanup(ctx->context);
    close(ctx->kick_fd);
    close(ctx->ep_fd);
    pthread_cond_destroy(&ctx->cond);
    pthread_mutex_destroy(&ctx->lock);
    free(ctx->todo);
    free(ctx->slots);
    free(ctx);
}

/* ---- link operations ------------------------------------------------------------------- */

static stria_status_t stria__ucx_post(stria_link_t *base, bool is_send, uint64_t tag, void *buf,
                                      size_t len, stria_link_req_t **req_out)
{
    stria__ucx_link_t *link = (stria__ucx_link_t *)base;
    stria_ucx_ctx_t *ctx = link->ctx;
    stria_link_req_t *req = calloc(1, sizeof(*req));
    if (req == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "ucx link: out of memory for a request");
    req->link = link;
    req->is_send = is_send;
    req->tag = tag;
    req->buf = buf;
    req->len = len;
    stria__list_init(&req->queue_node);
    if (is_send) {
        stria__put32(req->hdr, link->out_slot);
        stria__put32(req->hdr + 4, 0);
        stria__put64(req->hdr + 8, tag);
    }
    pthread_mutex_lock(&ctx->lock);
    if (link->failed) {
        stria_status_t st = stria__link_error_locked(link);
        pthread_mutex_unlock(&ctx->lock);
        free(req);
        return st;
    }
    req->state = STRIA__REQ_QUEUED;
    stria__list_push(&link->reqs, &req->link_node);
    stria__list_push(&ctx->queue, &req->queue_node);
    pthread_mutex_unlock(&ctx->lock);
    stria__kick(ctx);
    *req_out = req;
    return STRIA_OK;
}

static stria_status_t stria__ucx_isend(stria_link_t *base, uint64_t tag, const void *buf,
                                       size_t len, stria_link_req_t **req_out)
{
    return stria__ucx_post(base, true, tag, (void *)buf, len, req_out);
}

static stria_status_t stria__ucx_irecv(stria_link_t *base, uint64_t tag, void *buf, size_t len,
                                       stria_link_req_t **req_out)
{
    return stria__ucx_post(base, false, tag, buf, len, req_out);
}

/* Waits (lock held) until UCX lets go of a request of a failed link. Returns
 * false when the safety bound passed first. */
static bool stria__wait_release_locked(stria_ucx_ctx_t *ctx, stria_link_req_t *req)
{
    double until = stria_time_now() + STRIA__UCX_RELEASE_WAIT_S;
    while (req->state != STRIA__REQ_DONE && stria_time_now() < until)
        stria__cond_wait_until(ctx, until);
    if (req->state == STRIA__REQ_DONE)
        return true;
    stria_log_error("ucx link: UCX did not release a %s of tag %#llx within %.0f s; leaving it",
                    stria__req_kind(req), (unsigned long long)req->tag, STRIA__UCX_RELEASE_WAIT_S);
    req->abandoned = true;
    return false;
}

/* Releases a finished request and returns its status (setting the message). */
static stria_status_t stria__req_release_locked(stria__ucx_link_t *link, stria_link_req_t *req)
{
    stria_status_t st = req->status;
    if (st != STRIA_OK && req->msg[0] == '\0' && link->failed)
        st = link->fail_status;
    if (st != STRIA_OK && req->msg[0] != '\0')
        stria_error_set(st, "%s", req->msg);
    else if (st != STRIA_OK)
        stria_error_set(st, "%s", link->failed ? link->fail_msg : link->settle_msg);
    stria__list_del(&req->link_node);
    stria__req_free(req);
    return st;
}

static stria_status_t stria__ucx_wait(stria_link_t *base, stria_link_req_t *req, double timeout_s)
{
    stria__ucx_link_t *link = (stria__ucx_link_t *)base;
    stria_ucx_ctx_t *ctx = link->ctx;
    double start = stria_time_now();
    double deadline = timeout_s < 0 ? 0 : start + timeout_s;

    pthread_mutex_lock(&ctx->lock);
    while (req->state != STRIA__REQ_DONE && !link->failed) {
        double now = stria_time_now();
        if (deadline > 0 && now >= deadline)
            break;
        if (timeout_s == 0)
            break;
        stria__cond_wait_until(ctx, deadline > 0 ? deadline : now + 3600);
    }
    if (req->state == STRIA__REQ_DONE && req->status != STRIA_OK && req->msg[0] == '\0') {
        /* A connection dropped: wait for the link's verdict on whom to
         * blame (a notice from the ring, or the drop itself). */
        double until = stria_time_now() + STRIA__UCX_SETTLE_S + 1.0;
        while (!link->failed && stria_time_now() < until)
            stria__cond_wait_until(ctx, until);
    }
    if (req->state == STRIA__REQ_DONE) {
        stria_status_t st = stria__req_release_locked(link, req);
        pthread_mutex_unlock(&ctx->lock);
        return st;
    }
    if (!link->failed) {
        /* Blame the peer only if it went quiet. A peer that is alive is
         * itself waiting on someone: name the stalled rank the heartbeats
         * report, or give that rank's own report a moment to arrive. */
        double now = stria_time_now();
        double heard = req->is_send ? link->last_next : link->last_prev;
        int reporter;
        double silence;
        if (now - heard < ctx->stale_s &&
            stria__link_suspect_locked(link, now, -1, &reporter, &silence) < 0) {
            double grace = timeout_s < 0.2 ? 0.2 : timeout_s;
            double until = now + (grace < STRIA__UCX_GRACE_MAX_S ? grace : STRIA__UCX_GRACE_MAX_S);
            while (req->state != STRIA__REQ_DONE && !link->failed && stria_time_now() < until &&
                   stria__link_suspect_locked(link, stria_time_now(), -1, &reporter, &silence) < 0)
                stria__cond_wait_until(
                    ctx, stria_time_now() + 0.05 < until ? stria_time_now() + 0.05 : until);
            if (req->state == STRIA__REQ_DONE) {
                stria_status_t st = stria__req_release_locked(link, req);
                pthread_mutex_unlock(&ctx->lock);
                return st;
            }
        }
    }
    if (!link->failed) {
        int peer = req->is_send ? stria_link_next(base) : stria_link_prev(base);
        double now = stria_time_now();
        double quiet = now - (req->is_send ? link->last_next : link->last_prev);
        int reporter;
        double silence;
        int suspect = stria__link_suspect_locked(link, now, -1, &reporter, &silence);
        int origin = peer;
        char why[240];
        if (quiet >= ctx->stale_s) {
            snprintf(why, sizeof(why),
                     "rank %d is stalled or unreachable (nothing heard from it for %.1f s)", peer,
                     quiet);
        } else if (suspect >= 0) {
            origin = suspect;
            snprintf(why, sizeof(why),
                     "rank %d is alive but waiting; rank %d is stalled or unreachable (silent "
                     "for %.1f s, seen by rank %d)",
                     peer, suspect, silence, reporter);
        } else {
            snprintf(why, sizeof(why),
                     "rank %d is alive but did not %s it (too slow, or waiting on another rank)",
                     peer, req->is_send ? "take" : "send");
        }
        stria__link_fail_locked(
            link, STRIA_ERR_TIMEOUT, origin, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "deadline of %.3g s exceeded %s tag %#llx (%zu bytes) %s rank %d "
            "(%s): %s",
            timeout_s, req->is_send ? "sending" : "receiving", (unsigned long long)req->tag,
            req->len, req->is_send ? "to" : "from", peer,
            req->is_send ? "successor" : "predecessor", why);
        stria__kick(ctx);
    }
    stria_status_t st = link->fail_status;
    char msg[sizeof(link->fail_msg)];
    snprintf(msg, sizeof(msg), "%s", link->fail_msg);
    if (stria__wait_release_locked(ctx, req)) {
        stria__list_del(&req->link_node);
        stria__req_free(req);
    }
    pthread_mutex_unlock(&ctx->lock);
    return stria_error_set(st, "%s", msg);
}

static void stria__ucx_cancel(stria_link_t *base, stria_link_req_t *req)
{
    stria__ucx_link_t *link = (stria__ucx_link_t *)base;
    stria_ucx_ctx_t *ctx = link->ctx;
    pthread_mutex_lock(&ctx->lock);
    if (req->state == STRIA__REQ_QUEUED) {
        stria__list_del(&req->queue_node);
        req->state = STRIA__REQ_DONE;
    } else if (req->state == STRIA__REQ_POSTED && !req->is_send && !req->matched) {
        /* An unmatched receive is only ours: nothing in UCX to undo. */
        stria__list_del(&req->queue_node);
        req->state = STRIA__REQ_DONE;
        ctx->in_flight--;
    } else if (req->state == STRIA__REQ_POSTED) {
        stria__link_fail_locked(
            link, STRIA_ERR_CANCELLED, base->rank, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "rank %d cancelled a %s of tag %#llx (%zu bytes) in flight", base->rank,
            stria__req_kind(req), (unsigned long long)req->tag, req->len);
        stria__kick(ctx);
        if (!stria__wait_release_locked(ctx, req)) {
            pthread_mutex_unlock(&ctx->lock);
            return;
        }
    }
    stria__list_del(&req->link_node);
    stria__req_free(req);
    pthread_mutex_unlock(&ctx->lock);
}

static void stria__ucx_abort(stria_link_t *base, stria_status_t reason, const char *msg)
{
    stria__ucx_link_t *link = (stria__ucx_link_t *)base;
    stria_ucx_ctx_t *ctx = link->ctx;
    pthread_mutex_lock(&ctx->lock);
    if (!link->failed) {
        stria__link_fail_locked(
            link, STRIA_ERR_PEER, base->rank, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "rank %d aborted the pass (%s): %s", base->rank, stria_status_str(reason), msg);
        link->fail_status = reason == STRIA_OK ? STRIA_ERR_CANCELLED : reason;
    }
    pthread_mutex_unlock(&ctx->lock);
    stria__kick(ctx);
}

static void stria__ucx_link_destroy(stria_link_t *base)
{
    stria__ucx_link_t *link = (stria__ucx_link_t *)base;
    stria_ucx_ctx_t *ctx = link->ctx;
    pthread_mutex_lock(&ctx->lock);
    size_t pending = 0;
    for (stria__node_t *n = link->reqs.next; n != &link->reqs; n = n->next) {
        stria_link_req_t *r = STRIA__OF(n, stria_link_req_t, link_node);
        if (r->state != STRIA__REQ_DONE && !r->abandoned)
            pending++;
    }
    if (pending > 0)
        stria__link_fail_locked(
            link, STRIA_ERR_CANCELLED, base->rank, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "rank %d closed its link with %zu requests pending", base->rank, pending);
    link->want_destroy = true;
    pthread_mutex_unlock(&ctx->lock);
    stria__kick(ctx);

    pthread_mutex_lock(&ctx->lock);
    double until = stria_time_now() + 2 * STRIA__UCX_CLOSE_GRACE_S + 1.0;
    while (!link->closed && stria_time_now() < until)
        stria__cond_wait_until(ctx, until);
    if (!link->closed) {
        /* A graceful close the peer never confirmed: force it. */
        if (!link->failed)
            stria__link_fail_locked(link, STRIA_ERR_CLOSED, base->rank, 0, "link of rank %d closed",
                                    base->rank);
        stria__kick(ctx);
        until = stria_time_now() + STRIA__UCX_RELEASE_WAIT_S;
        while (!link->closed && stria_time_now() < until)
            stria__cond_wait_until(ctx, until);
    }
    bool closed = link->closed;
    stria__list_del(&link->ctx_node);
    if (ctx->slots[link->in_slot] == link)
        ctx->slots[link->in_slot] = NULL;
    while (!stria__list_empty(&link->reqs)) {
        stria_link_req_t *r = STRIA__OF(link->reqs.next, stria_link_req_t, link_node);
        stria__list_del(&r->link_node);
        if (r->state == STRIA__REQ_QUEUED)
            stria__list_del(&r->queue_node);
        stria__req_free(r);
    }
    pthread_mutex_unlock(&ctx->lock);
    if (!closed) {
        /* The progress thread may still touch the link: keep its memory. */
        stria_log_error("ucx link of rank %d: UCX did not close its endpoints; leaking the link",
                        base->rank);
        return;
    }
    free(link);
}

static const stria_link_ops_t stria__ucx_ops = {
    .name = "ucx",
    .isend = stria__ucx_isend,
    .irecv = stria__ucx_irecv,
    .wait = stria__ucx_wait,
    .cancel = stria__ucx_cancel,
    .abort = stria__ucx_abort,
    .destroy = stria__ucx_link_destroy,
};

stria_status_t stria_link_ucx_connect(stria_ucx_ctx_t *ctx, const stria_ucx_link_params_t *params,
                                      stria_link_t **link_out)
{
    stria_status_t st;
    if (ctx == NULL || params == NULL || link_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_link_ucx_connect: NULL argument");
    if (params->size < 1 || params->size > 65535)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ucx link: ring size %d is not in 1..65535",
                               params->size);
    if (params->rank < 0 || params->rank >= params->size)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ucx link: rank %d is not in 0..%d",
                               params->rank, params->size - 1);
    if (params->next_host == NULL || params->next_host[0] == '\0')
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ucx link: no successor address");
    if (params->next_port == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ucx link: successor port 0");
    if (!(params->connect_timeout_s >= 0))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ucx link: negative connect timeout");

    stria__ucx_link_t *link = calloc(1, sizeof(*link));
    if (link == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "ucx link: out of memory");
    link->base.ops = &stria__ucx_ops;
    link->heard[0].suspect = link->heard[1].suspect = -1;
    link->logged_suspect = -1;
    link->base.rank = params->rank;
    link->base.size = params->size;
    link->ctx = ctx;
    link->job_id = params->job_id;
    link->ring_id = params->ring_id;
    stria__list_init(&link->reqs);
    stria__list_init(&link->posted);
    stria__list_init(&link->unexp);
    stria__list_init(&link->ctx_node);
    st = stria__resolve(params->next_host, params->next_port, false, &link->next_addr,
                        &link->next_addrlen);
    if (st != STRIA_OK) {
        free(link);
        return stria_error_wrap(st, "ucx link rank %d: successor address", params->rank);
    }
    snprintf(link->next_desc, sizeof(link->next_desc), "%s:%u", params->next_host,
             (unsigned)params->next_port);
    double timeout =
        params->connect_timeout_s > 0 ? params->connect_timeout_s : STRIA_UCX_CONNECT_TIMEOUT_S;
    link->connect_deadline = stria_time_now() + timeout;

    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *n = ctx->links.next; n != &ctx->links; n = n->next) {
        stria__ucx_link_t *l = STRIA__OF(n, stria__ucx_link_t, ctx_node);
        if (l->job_id == link->job_id && l->ring_id == link->ring_id) {
            pthread_mutex_unlock(&ctx->lock);
            free(link);
            return stria_error_set(
                STRIA_ERR_BUSY, "ucx link: this context already has ring %llu of job %llu",
                (unsigned long long)params->ring_id, (unsigned long long)params->job_id);
        }
    }
    uint32_t slot = 0;
    for (uint32_t i = 0; i < STRIA__UCX_SLOTS - 1; i++) {
        uint32_t s = ctx->next_slot;
        ctx->next_slot = ctx->next_slot + 1 >= STRIA__UCX_SLOTS ? 1 : ctx->next_slot + 1;
        if (ctx->slots[s] == NULL) {
            slot = s;
            break;
        }
    }
    if (slot == 0) {
        pthread_mutex_unlock(&ctx->lock);
        free(link);
        return stria_error_set(STRIA_ERR_BUSY, "ucx link: the context has no free link slot");
    }
    link->in_slot = slot;
    ctx->slots[slot] = link;
    stria__list_push(&ctx->links, &link->ctx_node);
    link->want_connect = true;
    pthread_mutex_unlock(&ctx->lock);
    stria__kick(ctx);

    pthread_mutex_lock(&ctx->lock);
    while (!(link->out_ready && link->in_ready) && !link->failed &&
           stria_time_now() < link->connect_deadline)
        stria__cond_wait_until(ctx, link->connect_deadline);
    if (link->out_ready && link->in_ready && !link->failed) {
        pthread_mutex_unlock(&ctx->lock);
        stria_log_debug("ucx link rank %d/%d (job %llu ring %llu) connected", params->rank,
                        params->size, (unsigned long long)params->job_id,
                        (unsigned long long)params->ring_id);
        *link_out = &link->base;
        return STRIA_OK;
    }
    if (!link->failed) {
        char what[800];
        int prev = stria_link_prev(&link->base), next = stria_link_next(&link->base);
        if (!link->out_ready && !link->in_ready)
            snprintf(what, sizeof(what),
                     "successor rank %d at %s did not accept the handshake and predecessor rank "
                     "%d did not connect",
                     next, link->next_desc, prev);
        else if (!link->out_ready)
            snprintf(what, sizeof(what),
                     "successor rank %d at %s did not accept the handshake (not listening, or no "
                     "ring %llu of job %llu there)",
                     next, link->next_desc, (unsigned long long)link->ring_id,
                     (unsigned long long)link->job_id);
        else
            snprintf(what, sizeof(what),
                     "predecessor rank %d did not connect to port %u for ring %llu of job %llu",
                     prev, (unsigned)ctx->port, (unsigned long long)link->ring_id,
                     (unsigned long long)link->job_id);
        stria__link_fail_locked(link, STRIA_ERR_TIMEOUT, link->out_ready ? prev : next,
                                STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                                "connect timeout of %.3g s: %s", timeout, what);
    }
    st = stria__link_error_locked(link);
    char msg[sizeof(link->fail_msg)];
    snprintf(msg, sizeof(msg), "%s", link->fail_msg);
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_link_destroy(&link->base);
    return stria_error_set(st, "ucx link rank %d: %s", params->rank, msg);
}
