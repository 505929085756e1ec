/*
 * Internals of the UCX ring link, shared by its files (never installed):
 *
 *   ucx_wire.c       the control-message codec and the data header (pure)
 *   ucx_heartbeat.c  heartbeats and the stalled-rank logic (pure: no UCX, no locks)
 *   ucx_ctx.c        the context: configuration, environment, listener, create/destroy
 *   ucx_progress.c   the progress thread: UCX callbacks, events, connections, the queue
 *   ucx_state.c      a link's life: its state, failure, and the per-link progress step
 *   ucx_handshake.c  accepting connections and the handshakes of both sides
 *   ucx.c            the link API: connect, isend/irecv, wait, cancel, abort, destroy
 *
 * Threading: every UCX call after setup happens on the context's progress
 * thread (the worker is created UCS_THREAD_MODE_SINGLE). Callers' threads
 * queue requests and flag links under ctx->lock, wake the progress thread
 * through an eventfd, and wait on ctx->cond. The progress thread drains
 * ucp_worker_progress(), then handles what the UCX callbacks recorded
 * (connection requests, control messages, endpoint errors), then advances
 * every link, then sleeps in epoll on the worker's event fd and the eventfd
 * after ucp_worker_arm(). UCX callbacks take ctx->lock themselves, so the
 * progress thread never holds it across a UCX call.
 *
 * Wire: two active-message ids. CTRL carries the handshake, acknowledgement,
 * abort, goodbye and heartbeat messages (sent with the reply flag, so the
 * receiver knows the endpoint they came on). DATA carries one tensor block: a
 * 16-byte header (receiver's slot, tag) and the payload, also sent with the
 * reply flag: a block is taken only from the endpoint that completed the
 * handshake of its slot (others are dropped and counted), forced to rendezvous
 * from STRIA__UCX_RNDV_MIN bytes so a matched receive lands in its own
 * buffer. Matching is ours: per link, receives match arrivals by tag in
 * posting order; an arrival with no receive yet keeps its UCX descriptor
 * (rendezvous: the bytes stay at the sender) until one is posted.
 */
#ifndef STRIA_UCX_INT_H
#define STRIA_UCX_INT_H

#include "stria_auth.h"
#include "stria_transport.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>

#include <ucp/api/ucp.h>

/* ---- constants ----------------------------------------------------------- */

#define STRIA__UCX_MAGIC    0x53545241u /* "STRA" */
#define STRIA__UCX_VERSION  2
#define STRIA__UCX_AM_CTRL  1
#define STRIA__UCX_AM_DATA  2
#define STRIA__UCX_RNDV_MIN (64 * 1024)
#define STRIA__UCX_DATA_HDR 16
#define STRIA__UCX_TEXT_MAX 400
#define STRIA__UCX_CTRL_HDR 110 /* 46 bytes of fields, a nonce and a MAC */
#define STRIA__UCX_CTRL_MAX (STRIA__UCX_CTRL_HDR + STRIA__UCX_TEXT_MAX)
/* Shared memory's FIFO element (see stria__env_defaults): its short
 * messages (the element less 28 bytes) must hold any control message with
 * UCX's AM headers (at most 32 bytes). */
#define STRIA__UCX_MM_ELEM "1024"
_Static_assert(1024 - 28 >= STRIA__UCX_CTRL_MAX + 32, "control messages fit a shm short message");
#define STRIA__UCX_SLOTS     65536
#define STRIA__UCX_MAX_CONNS 256
/* Connection requests a context being destroyed holds at most (the rest are
 * refused at once). */
#define STRIA__UCX_HELD_REQUESTS 64
/* How often a connect with a cancel flag looks at it. */
#define STRIA__UCX_CANCEL_POLL_S 0.05
/* The quiet spell before the listener of a context being destroyed goes. */
#define STRIA__UCX_QUIET_S 0.05
/* Connections of one source address that have not completed a handshake;
 * more are rejected (stria_ucx_ctx_params_t.max_pending_per_source). */
#define STRIA__UCX_PENDING_PER_SOURCE 64
/* How long a connection may take to complete its handshake before it is
 * closed (stria_ucx_ctx_params_t.handshake_timeout_s). */
#define STRIA__UCX_HANDSHAKE_TIMEOUT_S 30.0
/* Eager bytes that may wait for a receive on one link before it is treated as
 * a protocol error (large blocks are rendezvous and cost nothing here). */
#define STRIA__UCX_UNEXP_MAX (64u << 20)
/* Time a failed link gives its abort notices before closing endpoints. */
#define STRIA__UCX_NOTIFY_GRACE_S 0.3
/* Time a graceful close may take before endpoints are closed by force. */
#define STRIA__UCX_CLOSE_GRACE_S 1.0
/* Safety bound on waiting for UCX to release a request after teardown. */
#define STRIA__UCX_RELEASE_WAIT_S 10.0
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

/* Control message types, numbered from 1 on the wire: append, never reorder
 * (stria__ucx_ctrl_decode accepts HELLO..PROOF). */
enum {
    STRIA__CTRL_HELLO = 1,
    STRIA__CTRL_ACK,
    STRIA__CTRL_ABORT,
    STRIA__CTRL_BYE,
    STRIA__CTRL_PING,
    /* With a ring key (stria_ucx_link_params_t.key): HELLO carries the
     * connector's nonce; the acceptor answers CHALLENGE (its nonce and its
     * MAC), the connector PROOF (its MAC), the acceptor ACK. */
    STRIA__CTRL_CHALLENGE,
    STRIA__CTRL_PROOF,
};

/* Which neighbours a failure notice goes to (a mask), or one side. */
enum {
    STRIA__NOTIFY_NEXT = 1,
    STRIA__NOTIFY_PREV = 2,
};

/* ---- intrusive lists ------------------------------------------------------ */

typedef struct stria__node {
    struct stria__node *prev, *next;
} stria__node_t;

#define STRIA__OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

static inline void stria__list_init(stria__node_t *h)
{
    h->prev = h->next = h;
}

static inline bool stria__list_empty(const stria__node_t *h)
{
    return h->next == h;
}

static inline void stria__list_push(stria__node_t *h, stria__node_t *n)
{
    n->prev = h->prev;
    n->next = h;
    h->prev->next = n;
    h->prev = n;
}

static inline void stria__list_del(stria__node_t *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = n;
}

/* Moves every node of src to the end of dst. */
static inline void stria__list_splice(stria__node_t *dst, stria__node_t *src)
{
    if (stria__list_empty(src))
        return;
    src->next->prev = dst->prev;
    dst->prev->next = src->next;
    src->prev->next = dst;
    dst->prev = src->prev;
    stria__list_init(src);
}

/* ---- heartbeats (ucx_heartbeat.c): pure, no UCX, no locks -------------------
 *
 * Neighbours exchange a heartbeat (PING) every period. Each carries the rank
 * its sender believes stalled: its own connected neighbour if silent for the
 * stall time, else the suspect it heard within the last two stall times from
 * the other side. A report thus travels the ring hop by hop, each copy in one
 * direction only (passed back the way it came it would echo between two live
 * ranks forever); it stops at the suspect and at the rank that first made it,
 * and dies out two stall times per hop after its first-hand source stops
 * sending it. A neighbour that said goodbye is never suspected. */

/* Index of a link's neighbours, and of the way a heartbeat's report came:
 * [STRIA__FROM_PREV] is the predecessor (what came from it goes on to the
 * successor), [STRIA__FROM_NEXT] the successor. */
#define STRIA__FROM_PREV 0
#define STRIA__FROM_NEXT 1

/* A link as the heartbeat logic sees it (the UCX link keeps it under
 * ctx->lock). */
typedef struct {
    int rank, size;
    double stale; /* silence after which a connected neighbour counts as stalled */
    struct {
        bool up;     /* handshake done: predecessor connected, successor acknowledged */
        bool bye;    /* it said goodbye (destroyed its link): never suspected */
        double last; /* when it was last heard */
    } nb[2];
    /* The latest report that came from each neighbour: a stalled rank
     * somewhere in the ring (suspect -1: none), the rank that first saw it,
     * its silence then, and when the report arrived. */
    struct {
        int suspect;
        int reporter;
        double silence;
        double at;
    } heard[2];
    int logged; /* the stalled rank last logged, or -1 */
} stria__ucx_hb_link_t;

/* Resolves the context's heartbeat period and stall time (0: the defaults)
 * and checks their bounds. */
stria_status_t stria__ucx_hb_config(double heartbeat_s, double stall_s, double *ping_s_out,
                                    double *stale_s_out);
void stria__ucx_hb_init(stria__ucx_hb_link_t *link, int rank, int size, double stale);
/* A message from neighbour `side` (STRIA__FROM_*) arrived: it is alive. */
void stria__ucx_hb_heard(stria__ucx_hb_link_t *link, int side, double now);
/* A heartbeat from neighbour `side`: its suspect (`origin`), the rank that
 * saw it (`slot`, or the sender `sender` if out of range) and the silence
 * in ms. Reports about this rank and its own reports come round are
 * dropped. Returns whether the report was kept. */
bool stria__ucx_hb_report(stria__ucx_hb_link_t *link, int side, double now, int origin,
                          uint32_t slot, int sender, int32_t silence_ms);
/* The rank this link believes stalled, or -1: a connected neighbour silent
 * for the stall time, else what the heartbeats reported within the last two
 * stall times. `from` is STRIA__FROM_PREV or STRIA__FROM_NEXT to consider only
 * reports that came that way (what a heartbeat passes on in the other
 * direction), or -1 for the latest report from either side. */
int stria__ucx_hb_suspect(const stria__ucx_hb_link_t *link, double now, int from, int *reporter,
                          double *silence);
/* The heartbeat that passes on what came from `from` (to the other
 * neighbour): its suspect (returned, -1: none), reporter and silence in ms. */
int stria__ucx_hb_ping(const stria__ucx_hb_link_t *link, double now, int from, int *reporter,
                       int32_t *silence_ms);
/* Whether the suspect changed since it was last logged; if so, remembers it
 * and returns true with the new suspect (-1: none), the reporter, the
 * silence and the suspect logged before. */
bool stria__ucx_hb_log_due(stria__ucx_hb_link_t *link, double now, int *suspect, int *reporter,
                           double *silence, int *before);

/* ---- wire codec (ucx_wire.c): pure --------------------------------------- */

typedef struct {
    uint16_t type;
    uint64_t job_id;
    uint64_t ring_id;
    int32_t rank;
    int32_t size;
    int32_t status;
    uint32_t slot;
    int32_t origin;
    uint8_t nonce[STRIA_AUTH_NONCE_BYTES]; /* HELLO, CHALLENGE, PROOF */
    uint8_t mac[STRIA_AUTH_MAC_BYTES];     /* CHALLENGE, PROOF */
    char text[STRIA__UCX_TEXT_MAX + 1];
} stria__ctrl_t;

/* Encodes into buf (STRIA__UCX_CTRL_MAX bytes); returns the length. */
size_t stria__ucx_ctrl_encode(const stria__ctrl_t *c, uint8_t *buf);
/* Decodes and validates a control message from a peer. */
stria_status_t stria__ucx_ctrl_decode(const uint8_t *buf, size_t len, stria__ctrl_t *c);
/* The header of a DATA message: the receiver's slot and the tag. */
void stria__ucx_data_hdr_encode(uint8_t hdr[STRIA__UCX_DATA_HDR], uint32_t slot, uint64_t tag);
void stria__ucx_data_hdr_decode(const void *hdr, uint32_t *slot, uint64_t *tag);
/* The MAC of a ring link handshake: HMAC(key, label, job, ring, the
 * connector's rank, size, both nonces); `acceptor` tells the acceptor's
 * (in CHALLENGE) from the connector's (in PROOF). */
void stria__ucx_ring_mac(const uint8_t key[STRIA_AUTH_KEY_BYTES], bool acceptor, uint64_t job_id,
                         uint64_t ring_id, int32_t connector_rank, int32_t size,
                         const uint8_t *nonce_c, const uint8_t *nonce_s,
                         uint8_t out[STRIA_AUTH_MAC_BYTES]);

/* ---- types ----------------------------------------------------------------- */

typedef struct stria__ucx_link stria__ucx_link_t;
typedef struct stria__ucx_conn stria__ucx_conn_t;

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

/* A connection accepted by the listener (the predecessor's side of a link). */
struct stria__ucx_conn {
    stria__node_t node; /* ctx->conns; progress thread only */
    stria_ucx_ctx_t *ctx;
    ucp_ep_h ep;
    bool closing;
    stria__ucx_link_t *link; /* the link that claimed it (under ctx->lock) */
    bool have_hello;
    stria__ctrl_t hello;
    bool challenged;                         /* CHALLENGE sent; PROOF due */
    uint8_t nonce_s[STRIA_AUTH_NONCE_BYTES]; /* the acceptor's, in the CHALLENGE */
    double accepted_at;                      /* handshake deadline from here */
    struct sockaddr_storage source;          /* the peer, port cleared */
    char peer[80];
    int ctrl_pending;
};

/* The life of a link. The progress thread moves it forward (under
 * ctx->lock); stria__ucx_link_fail_locked(), on any thread, moves every
 * state but CLOSED to FAILED. The steps of the progress thread never leave
 * FAILED except by tearing down (or, as ever, once nothing is left, by
 * CLOSED). */
typedef enum {
    STRIA__LINK_NEW = 0,          /* registered; the progress thread has not started connecting */
    STRIA__LINK_CONNECTING,       /* endpoint to the successor made (or retried at retry_at) */
    STRIA__LINK_READY,            /* both handshakes done */
    STRIA__LINK_FAILED,           /* the first error is recorded; notices not sent yet */
    STRIA__LINK_TORN_DOWN,        /* notices sent; endpoints closed once flushed or at close_at */
    STRIA__LINK_CLOSING_GRACEFUL, /* goodbyes sent; endpoints closed when the peers closed theirs
                            or at close_at */
    STRIA__LINK_DRAINING,         /* endpoints closing; UCX requests detached at detach_at */
    STRIA__LINK_CLOSED,           /* no endpoint and no UCX request left */
} stria__ucx_link_state_t;

struct stria__ucx_link {
    stria_link_t base;
    stria__node_t ctx_node;
    stria_ucx_ctx_t *ctx;
    uint64_t job_id, ring_id;
    bool has_key; /* handshakes prove key; without, a neighbour only names the ring */
    uint8_t key[STRIA_AUTH_KEY_BYTES];
    uint8_t nonce_c[STRIA_AUTH_NONCE_BYTES]; /* this link's, in its HELLO to the successor */
    bool next_proven;                        /* the successor proved the key (its CHALLENGE) */
    uint32_t in_slot;                        /* slot the predecessor's data is addressed to */
    uint32_t out_slot;                       /* the successor's slot for this link's data */
    char next_desc[300];
    struct sockaddr_storage next_addr;
    socklen_t next_addrlen;
    double connect_deadline;

    /* Under ctx->lock. */
    stria__ucx_link_state_t state;
    bool failed; /* the first error is recorded (sticky; a link closed
                    gracefully reaches CLOSED without one) */
    stria_status_t fail_status;
    char fail_msg[512];
    int notify_mask;
    int notify_origin;
    int notify_reporter;
    char notify_text[STRIA__UCX_TEXT_MAX + 1];
    bool want_destroy; /* the owner is destroying the link */
    double settle_at;  /* > 0: a connection dropped; fail then */
    int settle_side;   /* STRIA__NOTIFY_NEXT or _PREV */
    char settle_msg[300];
    /* Neighbours' handshakes, goodbyes, liveness and stall reports. */
    stria__ucx_hb_link_t hb;
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
    double retry_at; /* CONNECTING, > 0: reconnect to the successor then */
    double retry_delay;
    double close_at;  /* TORN_DOWN, CLOSING_GRACEFUL: close endpoints by force then */
    double next_ping; /* when the next heartbeats go out */
    double detach_at; /* DRAINING, > 0: detach requests UCX still holds then */
};

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
    bool sync_init; /* lock and cond initialised */

    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool stop;
    stria__node_t links;
    stria__node_t queue; /* QUEUED requests of every link, in posting order */
    stria__ucx_link_t **slots;
    uint32_t next_slot;
    int closing;                 /* endpoint closes in flight (progress thread) */
    int in_flight;               /* requests posted and not finished, all links */
    stria_ucx_ctx_stats_t stats; /* refusals, counted */
    double handshake_timeout_s;
    int max_pending_per_source;
    double poll_s;  /* polling window of the progress thread */
    double ping_s;  /* heartbeat period of every link */
    double stale_s; /* silence after which a neighbour counts as stalled */

    /* Progress thread only. */
    stria__ucx_link_t **step_links; /* the links one progress round steps (a snapshot) */
    size_t step_links_cap;
    stria__node_t conns;
    int n_conns;
    stria__node_t events;
    stria__node_t starts; /* matched rendezvous receives to start */
    double next_sweep;    /* when connections are next checked for their deadline */
    /* Connection requests that came while the context is being destroyed,
     * held unanswered (their peers wait instead of retrying) and refused
     * right before the listener goes (stria_ucx_ctx_destroy). */
    ucp_conn_request_h held[STRIA__UCX_HELD_REQUESTS];
    int n_held;
};

static inline const char *stria__req_kind(const stria_link_req_t *req)
{
    return req->is_send ? "send" : "receive";
}

/* ---- ucx_ctx.c ------------------------------------------------------------ */

/* Wakes the progress thread. */
void stria__ucx_kick(stria_ucx_ctx_t *ctx);
/* Waits on ctx->cond (lock held) until monotonic time t at the latest. */
void stria__ucx_cond_wait_until(stria_ucx_ctx_t *ctx, double t);
void stria__ucx_addr_str(const struct sockaddr *sa, char *out, size_t n);

/* ---- ucx_progress.c (progress thread) --------------------------------------- */

void *stria__ucx_progress_main(void *arg);
void stria__ucx_conn_req_cb(ucp_conn_request_h conn_request, void *arg);
ucs_status_t stria__ucx_am_ctrl_cb(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param);
ucs_status_t stria__ucx_am_data_cb(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param);
void stria__ucx_out_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status);
stria_status_t stria__ucx_status(ucs_status_t s);
/* Handles what the callbacks recorded. Returns whether there was anything. */
bool stria__ucx_run_events(stria_ucx_ctx_t *ctx);
/* Drops recorded endpoint errors of an object about to be freed. */
void stria__ucx_events_forget(stria_ucx_ctx_t *ctx, const void *obj);
/* Starts closing an endpoint; link's eps_closing and conn's memory follow it. */
void stria__ucx_ep_close(stria_ucx_ctx_t *ctx, ucp_ep_h ep, bool force, stria__ucx_link_t *link,
                         stria__ucx_conn_t *conn);
/* Sends a control message; the pending counter tracks its completion. */
void stria__ucx_ctrl_send(ucp_ep_h ep, const stria__ctrl_t *c, int *pending);
/* The error handler of accepted connections' endpoints. */
void stria__ucx_in_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status);

/* ---- ucx_handshake.c (progress thread) -------------------------------------- */

/* The link whose endpoint to its successor is ep; the accepted connection
 * of ep (NULL: none, or closing). */
stria__ucx_link_t *stria__ucx_link_by_out_ep(stria_ucx_ctx_t *ctx, ucp_ep_h ep);
stria__ucx_conn_t *stria__ucx_conn_by_ep(stria_ucx_ctx_t *ctx, ucp_ep_h ep);
/* A connection request: accepted, unless its source has too many
 * connections without a completed handshake (or the context too many). */
void stria__ucx_handle_conn_req(stria_ucx_ctx_t *ctx, ucp_conn_request_h req);
/* The connector's side: the successor's CHALLENGE, then its ACK. */
void stria__ucx_handle_challenge(stria_ucx_ctx_t *ctx, ucp_ep_h ep, const stria__ctrl_t *c);
void stria__ucx_handle_ack(stria_ucx_ctx_t *ctx, ucp_ep_h ep, const stria__ctrl_t *c);
/* The acceptor's side: the predecessor's PROOF after our CHALLENGE. */
void stria__ucx_handle_proof(stria_ucx_ctx_t *ctx, stria__ucx_conn_t *conn, const stria__ctrl_t *c);
/* Gives a connection whose handshake arrived to the link of its ring (or,
 * with a ring key, challenges it). */
void stria__ucx_conn_try_claim(stria_ucx_ctx_t *ctx, stria__ucx_conn_t *conn);
/* Closes the connections that did not complete a handshake in time; returns
 * when the next check is due. */
double stria__ucx_conns_sweep(stria_ucx_ctx_t *ctx, double now);

/* ---- ucx_state.c ------------------------------------------------------------ */

/* Marks a request finished (lock held). A request whose owner stopped
 * waiting is freed. */
void stria__ucx_req_finish_locked(stria_link_req_t *req, stria_status_t status, const char *msg);
/* Fails the link once (lock held): records the first error, moves it to
 * FAILED so that the progress thread tells the neighbours in notify_mask and
 * releases every UCX resource of the link. origin: the rank at fault. */
void stria__ucx_link_fail_locked(stria__ucx_link_t *link, stria_status_t status, int origin,
                                 int notify_mask, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Sets the thread's error to the link's and returns its status. */
stria_status_t stria__ucx_link_error_locked(const stria__ucx_link_t *link);
/* A connection to a neighbour dropped: the link fails STRIA__UCX_SETTLE_S
 * later with this message, unless a notice from elsewhere comes first. */
void stria__ucx_link_peer_error_locked(stria__ucx_link_t *link, int side, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A neighbour's handshake is done (lock held): READY once both are. */
void stria__ucx_link_up_locked(stria__ucx_link_t *link, int side);
/* Closes the link's endpoint to the successor (STRIA__NOTIFY_NEXT in mask)
 * and its predecessor's connection (STRIA__NOTIFY_PREV). */
void stria__ucx_link_close_eps(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, int mask, bool force);
void stria__ucx_link_ctrl_init(const stria__ucx_link_t *link, stria__ctrl_t *c, uint16_t type);
/* Advances every link. Returns the earliest time something is due (0: none). */
double stria__ucx_run_links(stria_ucx_ctx_t *ctx, bool *any);

/* ---- ucx.c ------------------------------------------------------------------- */

void stria__ucx_link_destroy(stria_link_t *base);

#endif /* STRIA_UCX_INT_H */
