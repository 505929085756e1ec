/*
 * Internals of the UCX ring link, shared by its files (never installed).
 *
 * Rooms, from the ground up; a file calls only functions of the files above
 * it in this list (none calls one listed below it, so no calls go round in
 * a loop). Shared functions are stria__ucx_*, declared here under their
 * room; file-local ones are static and unprefixed.
 *
 *   ucx_wire.c       the control-message codec, the data header and the MACs
 *                    (pure: no UCX, no locks)
 *   ucx_heartbeat.c  heartbeats and the stalled-rank logic (pure)
 *   ucx_base.c       what every room uses: waking the progress thread, timed
 *                    waits, addresses, UCX statuses, sending a control
 *                    message, recording events, finishing requests and
 *                    failing links
 *   ucx_ep.c         the endpoint pool: one UCX endpoint per successor
 *                    listener address (made here) and one per predecessor
 *                    context (accepted), each with a one-time handshake
 *                    (version, nonces, the endpoint key), their errors, the
 *                    peers' restarts, drops and closes
 *   ucx_data.c       the data path: posting requests, the data callback,
 *                    completions, matching
 *   ucx_bind.c       binding a link to its endpoints: BIND and BOUND on both
 *                    sides, binds that wait for their link, the counters
 *   ucx_state.c      a link's life: its notices (abort, goodbye, heartbeat)
 *                    and the per-link step of the progress thread (endpoint,
 *                    bind, settle, teardown, reclaim, goodbye, drain)
 *   ucx_progress.c   the progress thread: what the UCX callbacks recorded,
 *                    handed to the rooms above, and the thread's loop
 *   ucx.c            the link API: connect, isend/irecv, wait, cancel,
 *                    abort, destroy
 *   ucx_ctx.c        the context: configuration, environment, listener,
 *                    create/destroy, stats, the endpoint list, drops
 *
 * Threads: every UCX call after set-up happens on the context's progress
 * thread (the worker is UCS_THREAD_MODE_SINGLE). Callers' threads queue
 * requests and flag links under ctx->lock, wake the progress thread through
 * an eventfd, and wait on ctx->cond. The progress thread posts what was
 * queued, drains ucp_worker_progress(), then handles what the UCX callbacks
 * recorded (connection requests, control messages, endpoint errors), then
 * advances every link and endpoint, then sleeps in epoll on the worker's
 * event fd and the eventfd after ucp_worker_arm(). UCX callbacks take
 * ctx->lock themselves, so the progress thread never holds it across a UCX
 * call. No thread per link.
 *
 * Ownership: the context owns its endpoints (ctx->eps) and its links'
 * slots; a link holds a reference (ep->refs) on the endpoint to its
 * successor (link->out) and on the one its predecessor bound it on
 * (link->in) from the time it takes them until it is CLOSED. An endpoint is
 * freed only when its UCX endpoint is closed and nobody holds it. Links are
 * freed by their owner (stria_link_destroy) once CLOSED, which only the
 * progress thread sets. Under ctx->lock: the lists, slots, request states,
 * stats, a link's state and failure, and the endpoint fields other threads
 * read (state, links, peer, incarnation, times); the rest is the progress
 * thread's.
 *
 * Wire: two active-message ids. CTRL carries the control messages (sent
 * with the reply flag, so the receiver knows the endpoint they came on):
 * the endpoint handshake (EP_HELLO, EP_WELCOME, EP_PROOF, EP_READY) once
 * per UCX endpoint, then per link BIND and BOUND, and ABORT, BYE and PING,
 * each naming the receiving link's slot. DATA carries one tensor block: a
 * 16-byte header (receiver's slot, tag) and the payload, also with the
 * reply flag: a block is taken only from the endpoint its slot's link was
 * bound on (others are dropped and counted), forced to rendezvous from
 * STRIA__UCX_RNDV_MIN bytes so a matched receive lands in its own buffer.
 * Matching is ours: per link, receives match arrivals by tag in posting
 * order; an arrival with no receive yet keeps its UCX descriptor
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

#define STRIA__UCX_MAGIC 0x53545241u /* "STRA" */
/* The link protocol's version: every control message carries it, and a peer
 * of another version is refused naming both (3: pooled endpoints and
 * binds; 2: a connection and handshake per link). */
#define STRIA__UCX_VERSION  3
#define STRIA__UCX_AM_CTRL  1
#define STRIA__UCX_AM_DATA  2
#define STRIA__UCX_RNDV_MIN (64 * 1024)
#define STRIA__UCX_DATA_HDR 16
#define STRIA__UCX_TEXT_MAX 400
#define STRIA__UCX_CTRL_HDR 136 /* 72 bytes of fields, a nonce and a MAC */
#define STRIA__UCX_CTRL_MAX (STRIA__UCX_CTRL_HDR + STRIA__UCX_TEXT_MAX)
/* Shared memory's FIFO element (see env_defaults in ucx_ctx.c): its short
 * messages (the element less 28 bytes) must hold any control message with
 * UCX's AM headers (at most 32 bytes). */
#define STRIA__UCX_MM_ELEM "1024"
_Static_assert(1024 - 28 >= STRIA__UCX_CTRL_MAX + 32, "control messages fit a shm short message");
/* Slots: a link's slot is an index below STRIA__UCX_SLOTS in its low 16
 * bits and the index's generation in the high 16, so a message for a link
 * that is gone never reaches the next link of the same index. */
#define STRIA__UCX_SLOTS            65536
#define STRIA__UCX_SLOT_INDEX(slot) ((slot)&0xFFFFu)
/* Accepted endpoints a context keeps at most. */
#define STRIA__UCX_MAX_CONNS 256
/* Connection requests a context being destroyed holds at most (the rest are
 * refused at once). */
#define STRIA__UCX_HELD_REQUESTS 64
/* How often a connect with a cancel flag looks at it. */
#define STRIA__UCX_CANCEL_POLL_S 0.05
/* The quiet spell before the listener of a context being destroyed goes. */
#define STRIA__UCX_QUIET_S 0.05
/* Accepted endpoints of one source address not trusted yet (their
 * handshake and first bind not done); more are rejected
 * (stria_ucx_ctx_params_t.max_pending_per_source). The same bound caps the
 * binds one endpoint may park. */
#define STRIA__UCX_PENDING_PER_SOURCE 64
/* How long an accepted endpoint may take to be trusted, and a parked bind
 * to find its link (stria_ucx_ctx_params_t.handshake_timeout_s). */
#define STRIA__UCX_HANDSHAKE_TIMEOUT_S 30.0
/* Bind counters below the highest one an endpoint saw that may still come
 * (once each): UCX does not promise the order of messages on one endpoint
 * across its lanes. */
#define STRIA__UCX_BIND_WINDOW 64
/* Eager bytes that may wait for a receive on one link before it is treated as
 * a protocol error (large blocks are rendezvous and cost nothing here). */
#define STRIA__UCX_UNEXP_MAX (64u << 20)
/* How long a failed link waits for UCX to give back its transfers before it
 * closes the endpoint that holds them: a silent neighbour, a neighbour that
 * is alive (failing its own side, it releases them). */
#define STRIA__UCX_RECLAIM_SILENT_S 0.3
#define STRIA__UCX_RECLAIM_ALIVE_S  1.0
/* Safety bound on waiting for UCX to release a request after teardown. */
#define STRIA__UCX_RELEASE_WAIT_S 10.0
/* Extra time a missed deadline waits when the peer is alive, so that the
 * report of the rank actually at fault can arrive first. */
#define STRIA__UCX_GRACE_MAX_S 2.0
/* An endpoint that drops is blamed on the peer only after this long (and
 * closed only then): a peer that failed for another reason sends its ABORT
 * first, but over shared memory the ABORT and the TCP disconnect can arrive
 * out of order. */
#define STRIA__UCX_SETTLE_S 0.1
/* UCX 1.13 does not always complete a rendezvous request whose peer is
 * stopped when the endpoint is closed by force; such requests are handed
 * back to UCX (ucp_request_free) this long after the close. */
#define STRIA__UCX_DETACH_S 0.2
/* How long an idle endpoint being dropped may flush before it is closed by
 * force. */
#define STRIA__UCX_CLOSE_GRACE_S 1.0
/* Heartbeats an endpoint may have in flight (a stalled peer stops reading:
 * they must not pile up). */
#define STRIA__UCX_PINGS_IN_FLIGHT 64
/* The longest the progress thread sleeps while a link connects or an
 * endpoint runs its handshake (ucx_progress.c), for the first
 * STRIA__UCX_SETUP_FAST_S of it (then ten times that). */
#define STRIA__UCX_SETUP_POLL_S 0.001
#define STRIA__UCX_SETUP_FAST_S 0.5
/* How long the progress thread polls after the last activity before it
 * sleeps, while transfers are in flight (stria_ucx_ctx_params_t.poll_us). */
#define STRIA__UCX_POLL_DEFAULT_US 50
#define STRIA__UCX_POLL_MAX_US     100000

/* Control message types of version 3. */
enum {
    /* The endpoint handshake, once per UCX endpoint: the connector's
     * EP_HELLO (its nonce, its context's incarnation and listening port),
     * the acceptor's EP_WELCOME (its nonce and incarnation; with an
     * endpoint key its MAC), the connector's EP_PROOF (its MAC), the
     * acceptor's EP_READY. WELCOME and READY may carry a refusal instead
     * (status and text), and the endpoint is closed. */
    STRIA__CTRL_EP_HELLO = 1,
    STRIA__CTRL_EP_WELCOME,
    STRIA__CTRL_EP_PROOF,
    STRIA__CTRL_EP_READY,
    /* A link's bind on a ready endpoint: the connector's BIND (job, ring,
     * its rank and ring size, its slot, the endpoint's next counter, MAC),
     * the acceptor's BOUND (its slot, the counter, MAC, or a refusal). */
    STRIA__CTRL_BIND,
    STRIA__CTRL_BOUND,
    /* A bound link's notices, to the neighbour's slot. */
    STRIA__CTRL_ABORT,
    STRIA__CTRL_BYE,
    STRIA__CTRL_PING,
};
#define STRIA__CTRL_LAST STRIA__CTRL_PING
/* flags: the sender holds the key of this step (the endpoint key in the
 * endpoint handshake, the ring key in a bind) and its MAC is there. */
#define STRIA__CTRL_FLAG_KEYED 1u

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

/* ---- wire codec (ucx_wire.c): pure --------------------------------------- */

typedef struct {
    uint16_t type;
    uint16_t flags;
    uint64_t job_id;
    uint64_t ring_id;
    int32_t rank; /* link messages: the sender's rank; endpoint messages: 0 */
    int32_t size; /* link messages: the ring size; endpoint messages: 0 */
    int32_t status;
    /* BIND: the connector's slot; BOUND: the acceptor's; EP_HELLO: the
     * connector's listening port. */
    uint32_t slot;
    uint32_t dst;                          /* BOUND, ABORT, BYE, PING: the receiving link's slot */
    int32_t origin;                        /* ABORT: the rank at fault; PING: the rank suspected */
    int32_t reporter;                      /* ABORT, PING: the rank that saw it first */
    uint64_t counter;                      /* BIND, BOUND: the endpoint's bind counter */
    uint64_t incarnation;                  /* EP_HELLO, EP_WELCOME: the sender context's */
    uint8_t nonce[STRIA_AUTH_NONCE_BYTES]; /* EP_HELLO, EP_WELCOME */
    uint8_t mac[STRIA_AUTH_MAC_BYTES];     /* EP_WELCOME, EP_PROOF, BIND, BOUND */
    char text[STRIA__UCX_TEXT_MAX + 1];
} stria__ctrl_t;

/* Encodes into buf (STRIA__UCX_CTRL_MAX bytes); returns the length. */
size_t stria__ucx_ctrl_encode(const stria__ctrl_t *c, uint8_t *buf);
/* Decodes and validates a control message of this version from a peer. */
stria_status_t stria__ucx_ctrl_decode(const uint8_t *buf, size_t len, stria__ctrl_t *c);
/* The link protocol version of a control message with our magic number
 * (every version starts with magic, version and type), or -1. */
int stria__ucx_ctrl_version(const uint8_t *buf, size_t len);
/* A version 2 peer's HELLO answered in its own format: an acknowledgement
 * that refuses it with `text` (a v2 peer then fails its link with it).
 * Returns the length written into out (STRIA__UCX_CTRL_MAX bytes), or 0 when
 * buf is not a version 2 HELLO. */
size_t stria__ucx_v2_refusal(const uint8_t *buf, size_t len, const char *text, uint8_t *out);
/* The header of a DATA message: the receiver's slot and the tag. */
void stria__ucx_data_hdr_encode(uint8_t hdr[STRIA__UCX_DATA_HDR], uint32_t slot, uint64_t tag);
void stria__ucx_data_hdr_decode(const void *hdr, uint32_t *slot, uint64_t *tag);
/* The MAC of the endpoint handshake: HMAC(endpoint key, label, both nonces,
 * both incarnations); `acceptor` tells the acceptor's (EP_WELCOME) from the
 * connector's (EP_PROOF). */
void stria__ucx_ep_mac(const uint8_t key[STRIA_AUTH_KEY_BYTES], bool acceptor,
                       const uint8_t *nonce_c, const uint8_t *nonce_s, uint64_t inc_c,
                       uint64_t inc_s, uint8_t out[STRIA_AUTH_MAC_BYTES]);
/* What a bind's MACs cover: both endpoint nonces, the endpoint's counter,
 * the ring, the connector's rank, the size and both slots (the acceptor's
 * is 0 in BIND). */
typedef struct {
    const uint8_t *nonce_c, *nonce_s;
    uint64_t counter;
    uint64_t job_id, ring_id;
    int32_t rank, size;
    uint32_t slot_c, slot_a;
} stria__bind_fields_t;
/* HMAC(ring key, label, the fields); `acceptor` tells BOUND's from BIND's. */
void stria__ucx_bind_mac(const uint8_t key[STRIA_AUTH_KEY_BYTES], bool acceptor,
                         const stria__bind_fields_t *f, uint8_t out[STRIA_AUTH_MAC_BYTES]);

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
        bool up;     /* bound: the predecessor's bind taken, the successor's BOUND in */
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
 * saw it (`reporter`, or the sender `sender` if out of range) and the
 * silence in ms. Reports about this rank and its own reports come round are
 * dropped. Returns whether the report was kept. */
bool stria__ucx_hb_report(stria__ucx_hb_link_t *link, int side, double now, int origin,
                          int reporter, int sender, int32_t silence_ms);
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

/* ---- types ----------------------------------------------------------------- */

typedef struct stria__ucx_link stria__ucx_link_t;
typedef struct stria__ucx_ep stria__ucx_ep_t;

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

/* The life of a pooled endpoint. */
typedef enum {
    STRIA__EP_HANDSHAKE = 0, /* made or accepted; the endpoint handshake is under way */
    STRIA__EP_READY,         /* handshake done: binds may go */
    STRIA__EP_BROKEN,        /* failed or refused: no new bind; closed at close_at */
    STRIA__EP_CLOSING,       /* the UCX endpoint is closing or closed */
} stria__ucx_ep_state_t;

/* A bind that came before its link (acceptor side). */
typedef struct {
    stria__node_t node; /* ep->parked */
    stria__ctrl_t bind;
    double at;
} stria__parked_t;

/* One UCX endpoint to a peer context, shared by every link bound on it:
 * outgoing (made to a successor's listener address; this context sends the
 * data of its links there) or incoming (accepted; the predecessor's data
 * comes on it). */
struct stria__ucx_ep {
    stria__node_t node; /* ctx->eps */
    stria_ucx_ctx_t *ctx;
    bool outgoing;
    /* Under ctx->lock (read by other threads, the data callback among them). */
    ucp_ep_h ep; /* NULL once its close started */
    stria__ucx_ep_state_t state;
    int links;       /* links bound on it */
    uint64_t binds;  /* binds done on it */
    bool keyed;      /* the endpoint key was proven both ways */
    bool trusted;    /* accepted: handshake done and keyed, or a link bound on it */
    bool drop;       /* dropped (drain): no new bind; closed once no link is bound */
    double made_at;  /* made or accepted */
    double ready_at; /* the handshake completed */
    uint64_t peer_incarnation;
    char peer[300]; /* outgoing: "host:port" of the listener; accepted: the source */
    char why[300];  /* BROKEN: what happened (links bound on it fail with it) */
    stria_status_t why_status;
    /* Progress thread only. */
    int refs;                     /* links holding it (binding or bound) */
    struct sockaddr_storage addr; /* outgoing: the listener; accepted: the source, port cleared */
    socklen_t addrlen;
    uint16_t peer_port; /* accepted: the connector's listening port (its EP_HELLO) */
    uint8_t nonce_c[STRIA_AUTH_NONCE_BYTES], nonce_s[STRIA_AUTH_NONCE_BYTES];
    bool hello_seen;       /* accepted: EP_HELLO in; outgoing: EP_WELCOME in */
    uint64_t next_counter; /* outgoing: the counter of the next bind */
    uint64_t counter_max;  /* accepted: the highest bind counter seen */
    uint64_t counter_seen; /* accepted: bit i set: counter_max - i was seen */
    stria__node_t parked;  /* accepted: binds waiting for their link */
    int n_parked;
    double close_at;  /* BROKEN: close the UCX endpoint then; dropped: force it then */
    bool flushing;    /* dropped while idle: flushed before it closes */
    int ctrl_pending; /* control messages in flight */
    int closing;      /* UCX closes in flight (0 or 1) */
    bool gone;        /* counted in endpoints_dropped */
};

/* The life of a link. The progress thread moves it forward (under
 * ctx->lock); stria__ucx_link_fail_locked(), on any thread, moves every
 * state but CLOSED to FAILED. The steps of the progress thread never leave
 * FAILED except by tearing down (or, as ever, once nothing is left, by
 * CLOSED). */
typedef enum {
    STRIA__LINK_NEW = 0,          /* registered; the progress thread has not started */
    STRIA__LINK_CONNECTING,       /* taking the endpoint to the successor, binding both sides */
    STRIA__LINK_READY,            /* both sides bound */
    STRIA__LINK_FAILED,           /* the first error is recorded; notices not sent yet */
    STRIA__LINK_TORN_DOWN,        /* notices sent; waiting for UCX to give transfers back */
    STRIA__LINK_CLOSING_GRACEFUL, /* goodbyes sent */
    STRIA__LINK_DRAINING,         /* UCX requests detached at detach_at (a closed endpoint) */
    STRIA__LINK_CLOSED,           /* unbound: no endpoint held, no UCX request left */
} stria__ucx_link_state_t;

struct stria__ucx_link {
    stria_link_t base;
    stria__node_t ctx_node;
    stria_ucx_ctx_t *ctx;
    uint64_t job_id, ring_id;
    bool has_key; /* binds prove key; without, a neighbour only names the ring */
    uint8_t key[STRIA_AUTH_KEY_BYTES];
    uint32_t in_slot;   /* this link's slot: the predecessor's data and every notice name it */
    uint32_t out_slot;  /* the successor's slot for this link's data and notices */
    uint32_t prev_slot; /* the predecessor's slot, for notices to it */
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
    /* The status the other ranks report (stria_link_abort_status()). */
    stria_status_t notify_status;
    char notify_text[STRIA__UCX_TEXT_MAX + 1];
    bool want_destroy; /* the owner is destroying the link */
    double settle_at;  /* > 0: an endpoint dropped; fail then */
    int settle_side;   /* STRIA__NOTIFY_NEXT or _PREV */
    char settle_msg[300];
    /* Neighbours' binds, goodbyes, liveness and stall reports. */
    stria__ucx_hb_link_t hb;
    stria__node_t reqs;
    stria__node_t posted; /* unmatched receives, in posting order */
    stria__node_t unexp;  /* arrivals without a receive, in arrival order */
    size_t unexp_bytes;
    stria__ucx_ep_t *out; /* the endpoint to the successor (held) */
    stria__ucx_ep_t *in;  /* the endpoint the predecessor bound this link on (held) */

    /* Progress thread only. */
    bool out_bound;        /* counted in out->links */
    bool in_bound;         /* counted in in->links */
    uint64_t bind_counter; /* 0: no bind outstanding on out */
    bool replaced;         /* a stale endpoint to the successor was replaced */
    double retry_at;       /* CONNECTING, > 0: take an endpoint again then */
    double retry_delay;
    double reclaim_at; /* TORN_DOWN: close the endpoints still holding transfers then */
    double next_ping;  /* when the next heartbeats go out */
    double detach_at;  /* DRAINING, > 0: detach requests UCX still holds then */
};

typedef enum {
    STRIA__EV_CONN_REQ = 1,
    STRIA__EV_CTRL = 2,
    STRIA__EV_EP_ERR = 3,
    STRIA__EV_VERSION = 4, /* a control message of another protocol version */
} stria__ev_type_t;

/* What a UCX callback saw, handled after ucp_worker_progress() returns. */
typedef struct {
    stria__node_t node;
    stria__ev_type_t type;
    ucp_conn_request_h conn_req;
    ucp_ep_h ep;
    stria__ucx_ep_t *obj; /* EP_ERR: the endpoint */
    ucs_status_t status;
    int version; /* VERSION: the peer's */
    size_t raw_len;
    stria__ctrl_t ctrl;
    uint8_t raw[STRIA__UCX_CTRL_MAX]; /* VERSION: the message as it came */
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
    bool sync_init;       /* lock and cond initialised */
    uint64_t incarnation; /* random at create: a restarted peer shows a new one */
    bool has_ep_key;      /* endpoints prove ep_key both ways */
    uint8_t ep_key[STRIA_AUTH_KEY_BYTES];

    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool stop;
    bool drop_all; /* stria_ucx_ctx_drop_endpoints(): drop every endpoint */
    stria__node_t links;
    stria__node_t queue; /* QUEUED requests of every link, in posting order */
    stria__node_t eps;   /* every endpoint, outgoing and accepted */
    stria__ucx_link_t **slots;
    uint16_t *slot_gen; /* the generation of each slot index */
    uint32_t next_slot;
    int in_flight;               /* requests posted and not finished, all links */
    stria_ucx_ctx_stats_t stats; /* counted under the lock */
    double handshake_timeout_s;
    int max_pending_per_source;
    double poll_s;  /* polling window of the progress thread */
    double ping_s;  /* heartbeat period of every link */
    double stale_s; /* silence after which a neighbour counts as stalled */

    /* Progress thread only. */
    int closing;                    /* endpoint closes in flight */
    stria__ucx_link_t **step_links; /* the links one progress round steps (a snapshot) */
    size_t step_links_cap;
    int n_accepted; /* accepted endpoints not closed */
    stria__node_t events;
    stria__node_t starts; /* matched rendezvous receives to start */
    double next_sweep;    /* when endpoints are next checked for their deadlines */
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

/* ---- ucx_base.c ----------------------------------------------------------- */

/* Wakes the progress thread. */
void stria__ucx_kick(stria_ucx_ctx_t *ctx);
/* Waits on ctx->cond (lock held) until monotonic time t at the latest. */
void stria__ucx_cond_wait_until(stria_ucx_ctx_t *ctx, double t);
void stria__ucx_addr_str(const struct sockaddr *sa, char *out, size_t n);
stria_status_t stria__ucx_status(ucs_status_t s);
/* Whether a UCX status says the peer or the connection is gone. */
bool stria__ucx_is_peer_error(ucs_status_t s);
/* The parameters of a send that completes through cb. */
ucp_request_param_t stria__ucx_send_param(ucp_send_nbx_callback_t cb, void *user_data,
                                          uint32_t flags);
/* Sends a control message (progress thread); *pending counts it until it
 * completes, so it must outlive the send (an endpoint's counter: the
 * endpoint is freed only after its UCX endpoint closed). */
void stria__ucx_ctrl_send(ucp_ep_h ep, const stria__ctrl_t *c, int *pending);
/* Sends raw control bytes (a refusal in another version's format). */
void stria__ucx_raw_send(ucp_ep_h ep, const uint8_t *buf, size_t len, int *pending);
/* Appends an event for the progress thread (inside a UCX callback). */
void stria__ucx_event_push(stria_ucx_ctx_t *ctx, stria__event_t *ev);
/* Drops recorded events about an endpoint about to be freed. */
void stria__ucx_events_forget(stria_ucx_ctx_t *ctx, const stria__ucx_ep_t *obj);
/* Marks a request finished (lock held). A request whose owner stopped
 * waiting is freed. */
void stria__ucx_req_finish_locked(stria_link_req_t *req, stria_status_t status, const char *msg);
/* Fails the link once (lock held): records the first error, moves it to
 * FAILED so that the progress thread tells the neighbours in notify_mask
 * (the other ranks report STRIA_ERR_PEER) and gives back every UCX resource
 * of the link. origin: the rank at fault. */
void stria__ucx_link_fail_locked(stria__ucx_link_t *link, stria_status_t status, int origin,
                                 int notify_mask, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Sets the thread's error to the link's and returns its status. */
stria_status_t stria__ucx_link_error_locked(const stria__ucx_link_t *link);
/* An endpoint to a neighbour dropped: the link fails STRIA__UCX_SETTLE_S
 * later with this message, unless a notice from elsewhere comes first. */
void stria__ucx_link_peer_error_locked(stria__ucx_link_t *link, int side, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A neighbour's bind is done (lock held): READY once both are. */
void stria__ucx_link_up_locked(stria__ucx_link_t *link, int side);
/* A control message of this link, addressed to the neighbour on `side`
 * (STRIA__FROM_NEXT: the successor). */
void stria__ucx_link_ctrl_init(const stria__ucx_link_t *link, stria__ctrl_t *c, uint16_t type,
                               int side);
/* The link of a slot (lock held), or NULL. */
stria__ucx_link_t *stria__ucx_link_of_slot_locked(stria_ucx_ctx_t *ctx, uint32_t slot);

/* ---- ucx_ep.c (progress thread unless said) ----------------------------------- */

/* The endpoint whose UCX endpoint is ep (NULL: none). */
stria__ucx_ep_t *stria__ucx_ep_find(stria_ucx_ctx_t *ctx, ucp_ep_h ep);
/* The same, lock held (any thread). */
stria__ucx_ep_t *stria__ucx_ep_find_locked(stria_ucx_ctx_t *ctx, ucp_ep_h ep);
/* Takes (one more reference on) the endpoint to a successor's listener: a
 * live one (handshake under way or ready, not dropped), else a new one, its
 * handshake started. NULL when UCX cannot make one (the message set). */
stria__ucx_ep_t *stria__ucx_ep_get(stria_ucx_ctx_t *ctx, const struct sockaddr_storage *addr,
                                   socklen_t addrlen, const char *desc);
/* Holds one more reference / gives one back (a released endpoint nobody
 * holds that is not ready, or broken, or dropped, is closed). */
void stria__ucx_ep_hold(stria__ucx_ep_t *e);
void stria__ucx_ep_release(stria__ucx_ep_t *e);
/* Marks an endpoint broken (lock held): no new bind goes on it, the links
 * bound on it fail with `why` (their step sees it), and it is closed by
 * force after `delay` seconds (the settle time for a dropped connection, so
 * that notices already on their way are read). */
void stria__ucx_ep_break_locked(stria__ucx_ep_t *e, stria_status_t st, double delay,
                                const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* A connection request: accepted, unless its source has too many endpoints
 * not trusted yet (or the context too many). */
void stria__ucx_ep_accept(stria_ucx_ctx_t *ctx, ucp_conn_request_h req);
/* The endpoint handshake's messages, both sides. */
void stria__ucx_ep_handle(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c);
/* A control message of another protocol version on ep: refused, naming both. */
void stria__ucx_ep_version(stria_ucx_ctx_t *ctx, ucp_ep_h ep, int version, const uint8_t *raw,
                           size_t len);
/* UCX reported an endpoint failed. */
void stria__ucx_ep_error(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, ucs_status_t status);
/* Closes what is due: broken endpoints at close_at, dropped idle ones, the
 * accepted ones not trusted in time (and their parked binds past their
 * time are refused by the bind room). Returns when the next check is due. */
double stria__ucx_eps_sweep(stria_ucx_ctx_t *ctx, double now);
/* Closes every endpoint by force (the context's destroy, progress thread
 * gone). */
void stria__ucx_eps_close_all(stria_ucx_ctx_t *ctx);
/* Frees the endpoints whose close finished. */
void stria__ucx_eps_reap(stria_ucx_ctx_t *ctx);

/* ---- ucx_data.c (progress thread) ------------------------------------------------ */

ucs_status_t stria__ucx_am_data_cb(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param);
/* Posts queued requests and starts matched rendezvous receives. Returns
 * whether there was anything. */
bool stria__ucx_run_queue(stria_ucx_ctx_t *ctx);
/* Releases a link's arrivals no receive took. */
void stria__ucx_drop_unexp(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link);

/* ---- ucx_bind.c (progress thread) ------------------------------------------------ */

/* Sends the link's BIND on its endpoint to the successor (ready). */
void stria__ucx_bind_send(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link);
/* A BIND on an accepted endpoint: checked at once, or parked until its link
 * exists. */
void stria__ucx_bind_handle(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c);
/* A BOUND on an endpoint this context made. */
void stria__ucx_bound_handle(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c);
/* Gives a new link the binds parked for it. */
void stria__ucx_binds_claim(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link);
/* Refuses the parked binds older than the handshake timeout; returns when
 * the next one is due (0: none). */
double stria__ucx_binds_expire(stria_ucx_ctx_t *ctx, double now);

/* ---- ucx_state.c (progress thread) ------------------------------------------------ */

/* ABORT, BYE or PING for a link, from the endpoint e. */
void stria__ucx_notice_handle(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c);
/* Advances every link. Returns the earliest time something is due (0: none). */
double stria__ucx_run_links(stria_ucx_ctx_t *ctx, bool *any);

/* ---- ucx_progress.c (progress thread) --------------------------------------------- */

void *stria__ucx_progress_main(void *arg);
void stria__ucx_conn_req_cb(ucp_conn_request_h conn_request, void *arg);
ucs_status_t stria__ucx_am_ctrl_cb(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param);
/* Handles what the callbacks recorded. Returns whether there was anything. */
bool stria__ucx_run_events(stria_ucx_ctx_t *ctx);

/* ---- ucx.c ------------------------------------------------------------------- */

void stria__ucx_link_destroy(stria_link_t *base);

#endif /* STRIA_UCX_INT_H */
