/*
 * stria transport: the ring link.
 *
 * A ring link is one rank's view of a ring of `size` ranks: it sends to its
 * successor (rank + 1) mod size and receives from its predecessor
 * (rank - 1) mod size. Transfers are non-blocking and tagged; a receive
 * matches the send with the same tag from the predecessor. Implementations:
 * in-process (threads of one process, for tests and benchmarks) and UCX
 * (separate processes, one or many hosts). The ring engine only sees this
 * interface.
 *
 * Ownership: buffers passed to isend/irecv belong to the caller and must stay
 * valid (and, for sends, unmodified) until the request completes or is
 * cancelled. Requests are released by stria_link_wait() or
 * stria_link_cancel(), whatever the outcome. A link is used by one thread at
 * a time.
 */
#ifndef STRIA_TRANSPORT_H
#define STRIA_TRANSPORT_H

#include "stria_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct stria_link stria_link_t;
typedef struct stria_link_req stria_link_req_t;

/* The operations of a link implementation. */
typedef struct {
    const char *name;
    stria_status_t (*isend)(stria_link_t *link, uint64_t tag, const void *buf, size_t len,
                            stria_link_req_t **req_out);
    stria_status_t (*irecv)(stria_link_t *link, uint64_t tag, void *buf, size_t len,
                            stria_link_req_t **req_out);
    /* Waits until the request completes or `timeout_s` passes (< 0: no
     * deadline) and releases it. */
    stria_status_t (*wait)(stria_link_t *link, stria_link_req_t *req, double timeout_s);
    /* Cancels a pending request and releases it. */
    void (*cancel)(stria_link_t *link, stria_link_req_t *req);
    /* Tells the other ranks that this rank abandons the current pass, so they
     * fail fast instead of waiting for their deadline. */
    void (*abort)(stria_link_t *link, stria_status_t reason, const char *msg);
    void (*destroy)(stria_link_t *link);
} stria_link_ops_t;

/* Every implementation's link starts with this header. */
struct stria_link {
    const stria_link_ops_t *ops;
    int rank;
    int size;
};

static inline int stria_link_rank(const stria_link_t *link)
{
    return link->rank;
}
static inline int stria_link_size(const stria_link_t *link)
{
    return link->size;
}
/* Successor and predecessor ranks. */
static inline int stria_link_next(const stria_link_t *link)
{
    return (link->rank + 1) % link->size;
}
static inline int stria_link_prev(const stria_link_t *link)
{
    return (link->rank + link->size - 1) % link->size;
}

/* Posts a send of len bytes to the successor. */
stria_status_t stria_link_isend(stria_link_t *link, uint64_t tag, const void *buf, size_t len,
                                stria_link_req_t **req_out);
/* Posts a receive of exactly len bytes from the predecessor. */
stria_status_t stria_link_irecv(stria_link_t *link, uint64_t tag, void *buf, size_t len,
                                stria_link_req_t **req_out);
/* Waits for a request (timeout_s < 0: forever) and releases it. Errors:
 * STRIA_ERR_TIMEOUT, STRIA_ERR_PEER (the message names the rank),
 * STRIA_ERR_CANCELLED, STRIA_ERR_TRANSPORT, STRIA_ERR_PROTOCOL, and after
 * another rank's abort the status of that abort (see below). */
stria_status_t stria_link_wait(stria_link_t *link, stria_link_req_t *req, double timeout_s);
/* Cancels and releases a pending request; NULL is ignored. */
void stria_link_cancel(stria_link_t *link, stria_link_req_t *req);
/* Makes the other ranks' pending and future operations of this pass fail
 * with stria_link_abort_status(reason), the message naming this rank and
 * `msg`; this rank's own fail with `reason` (STRIA_OK: STRIA_ERR_CANCELLED).
 *
 * Failures by kind: what a rank reports after a failure elsewhere in the
 * ring says what kind of failure it was, so that callers decide retries and
 * what a client is told from status codes alone, never from messages:
 * - a rank that aborted the pass for its own reason (a bad input, no
 *   memory, a cancellation, a kernel error: anything but a link's failure)
 *   makes every other rank report that reason's status, e.g.
 *   STRIA_ERR_INVALID_ARG;
 * - a failure of the link itself anywhere (a rank died, stalled or left, a
 *   missed deadline, a transport or protocol error), or an abort whose
 *   reason is one (STRIA_ERR_PEER, STRIA_ERR_TRANSPORT, STRIA_ERR_TIMEOUT,
 *   STRIA_ERR_PROTOCOL, STRIA_ERR_CLOSED), is STRIA_ERR_PEER on the ranks
 *   that heard of it; the rank that saw it first reports its own status.
 * Either way the message names the rank at fault. */
void stria_link_abort(stria_link_t *link, stria_status_t reason, const char *msg);
void stria_link_destroy(stria_link_t *link);

/* The status the other ranks report after an abort for `reason` (the rule
 * above): STRIA_ERR_PEER for a link's failure, else the reason itself
 * (STRIA_OK counts as STRIA_ERR_CANCELLED). */
stria_status_t stria_link_abort_status(stria_status_t reason);

/* ---- in-process link ------------------------------------------------------
 *
 * A ring of `size` ranks that are threads of one process, for tests and
 * benchmarks. The ranks share a hub of mailboxes; a send completes when its
 * bytes have been copied into the matching receive (rendezvous: whichever of
 * the two is posted second does the copy). Receives match sends from the
 * predecessor by tag, in posting order; a tag match with a different length
 * fails both requests with STRIA_ERR_PROTOCOL.
 *
 * stria_link_abort() marks the hub aborted: from then on every pending and
 * new operation of every rank fails, the aborting rank's with its reason,
 * the others' with stria_link_abort_status(reason), each with a message
 * naming the aborting rank (the first abort wins). stria_inproc_hub_reset()
 * clears that state for the next pass.
 */

typedef struct stria_inproc_hub stria_inproc_hub_t;

/* Creates a hub for a ring of `size` ranks (1..65535). The caller holds one
 * reference, dropped with stria_inproc_hub_release(); every link holds one
 * more until stria_link_destroy(), so the order of releases does not
 * matter. */
stria_status_t stria_inproc_hub_create(int size, stria_inproc_hub_t **hub_out);
void stria_inproc_hub_release(stria_inproc_hub_t *hub);

/* Creates rank `rank`'s link (one per rank and hub). Free with
 * stria_link_destroy() after releasing every request of the link. */
stria_status_t stria_inproc_link_create(stria_inproc_hub_t *hub, int rank, stria_link_t **link_out);

/* Clears the aborted state and every fault. Only while no rank has a
 * request pending. */
void stria_inproc_hub_reset(stria_inproc_hub_t *hub);

/* The rank whose abort (or injected failure) ended the pass, or -1. */
int stria_inproc_hub_aborted_by(stria_inproc_hub_t *hub);

/* Faults injected into one rank, counted in posted operations (isend and
 * irecv calls) of that rank since the fault was set. */
typedef enum {
    STRIA_INPROC_FAULT_NONE = 0,
    /* The rank dies: its operation number after_ops + 1 and all later ones
     * fail with STRIA_ERR_TRANSPORT, and the hub is aborted in its name, as a
     * transport would report a dead peer (the others: STRIA_ERR_PEER). */
    STRIA_INPROC_FAULT_FAIL = 1,
    /* The rank hangs: sends from operation after_ops + 1 on are accepted but
     * never delivered, so only deadlines (or an abort) end the pass. */
    STRIA_INPROC_FAULT_STALL = 2,
} stria_inproc_fault_t;

stria_status_t stria_inproc_fault_inject(stria_inproc_hub_t *hub, int rank,
                                         stria_inproc_fault_t fault, uint64_t after_ops);

/* ---- end of in-process link --------------------------------------------- */

/* ---- UCX link ---------------------------------------------------------------
 *
 * The ring link between processes, over UCX (ucp): TCP, shared memory (posix,
 * sysv, cma) or RDMA, whatever UCX_TLS allows.
 *
 * A UCX context (stria_ucx_ctx_t) owns one ucp worker, one listener on a
 * configured address and port, one progress thread, and a pool of
 * endpoints: one to each successor listener address it sends to (made on
 * the first link that needs it and kept for the links after it), and the
 * ones predecessors made to its listener. Any number of ring links share a
 * context (one per ring this process is a member of) and its endpoints;
 * they are told apart by (job_id, ring_id) when they bind, and every
 * message carries the receiving link's slot, so tags of different rings
 * never meet. Tags are full 64-bit values.
 *
 * Create one context per process. UCX's async thread files events it could not
 * deliver under the file descriptor number, and a second context in the same
 * process that reuses a descriptor the first just closed can trip an assertion
 * inside UCX (seen with 1.13). Two contexts in one process work otherwise, and
 * the tests use that, but long-running programs should not.
 *
 * Endpoints: a new endpoint runs one handshake: the link protocol's version
 * (a peer of another version is refused, the message naming both), a fresh
 * nonce from each side and each context's incarnation (random per context:
 * a peer that restarted shows a new one), and with an endpoint key
 * (stria_ucx_ctx_params_t.endpoint_key, the same in every context of a
 * service) a MAC of each side over both, so that neither keeps an endpoint
 * with a context that does not hold the key. Without one the endpoint is
 * not authenticated, and only the binds prove anything.
 *
 * Connecting: stria_link_ucx_connect() takes the pooled endpoint to the
 * successor (making it if there is none) and binds the link on it in one
 * round trip (BIND and BOUND: job id, ring id, rank, ring size, both links'
 * slots and a counter of the endpoint that goes up with every bind), and
 * waits both for that and for the predecessor's bind to arrive on its
 * endpoint to this context. No UCX connect happens per link once the
 * endpoints exist; no tensor byte moves before both binds are checked. A
 * successor that does not listen yet is retried until the connect timeout;
 * an endpoint found stale (the peer restarted or went away since the last
 * link) is replaced inside the connect, once. A bind that arrives before
 * its link exists waits for it (up to handshake_timeout_s).
 *
 * Authentication: with a ring key (stria_ucx_link_params_t.key, the same
 * for every rank of the ring), both sides of a bind MAC both endpoint
 * nonces, the counter, the ring, the connector's rank, the size and the
 * slots with it. Neither side accepts a neighbour that does not prove the
 * key; a bind captured on one endpoint is refused on any other (other
 * nonces), and one replayed on its own endpoint is refused for its counter.
 * Every data block is taken only from the endpoint its link was bound on;
 * others are dropped and counted (stria_ucx_ctx_stats()). An accepted
 * endpoint that is not trusted (its handshake done and, without an endpoint
 * key, a link bound on it) within handshake_timeout_s is closed, and one
 * source address may hold at most max_pending_per_source such endpoints
 * (more are rejected). Nothing is encrypted: an attacker on the path can
 * still read and change the bytes of an authenticated connection.
 *
 * Transfers: blocks of 64 KiB and more go by rendezvous, straight from the
 * sender's buffer into the receiver's (a receive that is posted late leaves
 * the data at the sender until it is posted); smaller ones are copied once.
 * Completion, including immediate completion, is driven by the context's
 * progress thread; the caller's thread only posts and waits.
 *
 * Failures are sticky: a dead peer (reported about 0.1 s after its
 * endpoint drops), a missed deadline in stria_link_wait(), an abort, a
 * cancel of an in-flight transfer or a malformed message fails the link,
 * tells both neighbours (who pass it on around the ring) and gives back
 * every UCX request of the link. From then on every operation returns the
 * first error, whose message names the rank at fault (see "Failures by
 * kind" above for the status). Destroy the link and connect again to
 * recover. A missed deadline names the neighbour if it went silent
 * (neighbours exchange heartbeats, which also carry which rank looks
 * stalled); if it is alive, the stalled rank the heartbeats report is named,
 * or the wait gives the report of the rank at fault up to min(timeout, 2 s)
 * more to arrive.
 *
 * When an endpoint closes: a link's failure, abort, cancel or destroy never
 * closes an endpoint other links use, except in the last case below. An
 * endpoint closes when UCX reports it failed (the peer died or the
 * connection broke: every link bound on it fails, naming the rank); when
 * its handshake is refused (another link version, a wrong or missing
 * endpoint key, a message out of turn); when the peer restarted (a new
 * process connected from the same address and port); when it was dropped
 * (stria_ucx_ctx_drop_endpoints(), once no link is bound on it); when an
 * accepted one is not trusted in time; with its context; and when a failed
 * or destroyed link's transfer is still held by UCX 0.3 s later (the
 * neighbour is silent) or 1 s later (it is alive): UCX gives a rendezvous
 * buffer back no other way, so that endpoint is closed and its other links
 * fail. UCX 1.13 may keep a rendezvous send to a stopped peer after the
 * endpoint is closed; the link hands it back to UCX 0.2 s later, after which
 * that peer, should it resume, could still read (never write) the buffer.
 *
 * Destroying a healthy link says goodbye to both neighbours: what it sent
 * stays receivable there, later operations towards it fail with
 * STRIA_ERR_CLOSED. The endpoints stay for the next links.
 *
 * Cancelling a receive that no data has matched yet is clean and leaves the
 * link usable; cancelling a send or a receive whose data is in flight fails
 * the link as above (UCX cannot otherwise give the buffer back).
 */

typedef struct stria_ucx_ctx stria_ucx_ctx_t;

/* Configuration of a context. Zero-initialise and set the fields; zero or
 * NULL is the default of every field. */
typedef struct {
    /* Address to listen on: a numeric IPv4/IPv6 address or a host name.
     * NULL: "0.0.0.0" (every IPv4 interface). */
    const char *listen_host;
    /* Port to listen on; 0 lets the kernel choose (read it back with
     * stria_ucx_ctx_port()). */
    uint16_t listen_port;
    /* UCX transports, in UCX_TLS syntax ("tcp", "posix,cma,tcp", "all").
     * NULL: $UCX_TLS if set, else UCX's default. Connection setup needs tcp. */
    const char *tls;
    /* Network devices, in UCX_NET_DEVICES syntax ("eth0", "mlx5_0:1").
     * NULL: $UCX_NET_DEVICES if set, else all. */
    const char *net_devices;
    /* While transfers are in flight, the progress thread keeps polling UCX
     * for this many microseconds after the last activity before it sleeps
     * (waking costs more than the gap between two pieces of a transfer).
     * 0: 50; < 0: never poll (lowest CPU use on a crowded host); at most
     * 100000. */
    int poll_us;
    /* Heartbeats between the neighbours of every link: the period (0: 0.1 s;
     * at most 10 s) and the silence after which a neighbour counts as
     * stalled (0: 0.5 s, or five periods when that is longer; at least two
     * periods, at most 60 s). A stalled
     * rank is reported around the ring (and logged as a warning) for up to
     * two stall times after its first-hand report stops. A missed deadline
     * blames a neighbour only once it has been silent this long. */
    double heartbeat_s;
    double stall_s;
    /* An accepted endpoint that is not trusted within this is closed, and a
     * bind that waits longer for its link is refused (0: 30 s). */
    double handshake_timeout_s;
    /* Accepted endpoints not trusted yet one source address may hold; more
     * are rejected (0: 64). Also the binds one endpoint may have waiting
     * for their links. */
    int max_pending_per_source;
    /* NULL, or the endpoint key (STRIA_AUTH_KEY_BYTES, copied) that every
     * endpoint's handshake proves both ways; contexts that peer must all
     * have the same one or none (a worker derives it from the workers'
     * credential). */
    const uint8_t *endpoint_key;
} stria_ucx_ctx_params_t;

/* Creates a context: reads the UCX configuration from the environment,
 * applies params, starts listening and starts the progress thread. Unless
 * the environment sets them, these are set in the environment (UCX 1.13
 * reads them nowhere else): UCX_TCP_CM_REUSEADDR=y (a restarted process can
 * listen on the same port at once), UCX_POSIX/SYSV_ERROR_HANDLING=y (shared
 * memory stays usable with peer failure detection) and
 * UCX_CMA_MEMORY_INVALIDATE=y (rendezvous over cma with peer failure
 * detection; cma cannot revoke a peer's read access to a released send
 * buffer). Call it before starting threads that use the environment.
 * Errors: STRIA_ERR_INVALID_ARG (bad address), STRIA_ERR_BUSY (port in use),
 * STRIA_ERR_TRANSPORT (UCX). Free with stria_ucx_ctx_destroy(). */
stria_status_t stria_ucx_ctx_create(const stria_ucx_ctx_params_t *params,
                                    stria_ucx_ctx_t **ctx_out);

/* Destroys every link still using the context, stops the progress thread and
 * closes the listener and every endpoint. NULL is ignored. */
void stria_ucx_ctx_destroy(stria_ucx_ctx_t *ctx);

/* The port the context listens on (the real one when 0 was asked for). */
uint16_t stria_ucx_ctx_port(const stria_ucx_ctx_t *ctx);

/* What a context counted since it was created (endpoints_open: now). Fields
 * are appended, never reordered. */
typedef struct {
    /* Data blocks from an endpoint that was not bound to the slot they named
     * (or named no link): dropped. */
    uint64_t data_dropped;
    /* Endpoint handshakes whose endpoint key proof was wrong or missing
     * (either side), and binds whose ring key proof was (binds_refused). */
    uint64_t handshakes_refused;
    /* Accepted endpoints closed for not being trusted in time. */
    uint64_t handshakes_timed_out;
    /* Connections rejected at accept: too many pending from one source, or
     * too many in all. */
    uint64_t connections_rejected;
    /* Endpoints ready now (both directions), and since the start: made
     * (handshake done), replaced (stale ones a connect replaced, or a
     * restarted peer's), dropped (closed after they were made). */
    uint64_t endpoints_open;
    uint64_t endpoints_made;
    uint64_t endpoints_replaced;
    uint64_t endpoints_dropped;
    /* Binds this context took for its links (one per link, from the
     * predecessor), binds refused for a wrong or missing ring key proof
     * (either side; also counted in handshakes_refused), binds refused for
     * a counter used before on their endpoint (replayed). */
    uint64_t binds_done;
    uint64_t binds_refused;
    uint64_t binds_replayed;
    /* Peers refused for speaking another link protocol version. */
    uint64_t version_refused;
    /* Data blocks for a link that failed or is gone, from an endpoint that
     * carries links: dropped (not an attack: a neighbour's last blocks). */
    uint64_t data_late;
} stria_ucx_ctx_stats_t;
void stria_ucx_ctx_stats(stria_ucx_ctx_t *ctx, stria_ucx_ctx_stats_t *out);

/* One ready endpoint of a context. */
typedef struct {
    /* Outgoing: the successor's listener as links named it ("host:port");
     * accepted: the source address and the peer's listening port. */
    char peer[300];
    bool outgoing;
    uint64_t incarnation; /* the peer context's (changes when it restarts) */
    double age_s;         /* since its handshake completed */
    int links;            /* links bound on it now */
    uint64_t binds;       /* binds done on it since it was made */
    bool authenticated;   /* the endpoint key was proven both ways */
    bool dropping;        /* dropped: closes once no link is bound */
} stria_ucx_endpoint_info_t;

/* Lists the context's ready endpoints into out (up to max; out may be NULL
 * with max 0) and returns how many there are. */
size_t stria_ucx_ctx_endpoints(stria_ucx_ctx_t *ctx, stria_ucx_endpoint_info_t *out, size_t max);

/* Drops the context's endpoints (peer NULL), or those whose peer is `peer`
 * as stria_ucx_ctx_endpoints() lists it: no new link binds on them (the
 * next connect makes a new endpoint), and each is closed once no link is
 * bound on it. For a worker that is drained or told a peer went away.
 * Returns how many were dropped. Any thread. */
int stria_ucx_ctx_drop_endpoints(stria_ucx_ctx_t *ctx, const char *peer);

/* Ring membership of one link. Zero-initialise and set the fields. */
typedef struct {
    uint64_t job_id;
    uint64_t ring_id;
    int rank; /* 0 <= rank < size */
    int size; /* 1..65535 ranks */
    /* The successor's listener: numeric address or host name, and port. */
    const char *next_host;
    uint16_t next_port;
    /* Time allowed for both neighbours to bind (making the endpoints first
     * if need be): 0 means STRIA_UCX_CONNECT_TIMEOUT_S. */
    double connect_timeout_s;
    /* The ring's key (STRIA_AUTH_KEY_BYTES, copied), which both binds
     * prove; NULL: the neighbours only name the ring (tests, benchmarks and
     * trusted single-host setups). */
    const uint8_t *key;
    /* NULL, or a flag the caller sets (with __atomic_store_n) to give up a
     * connect under way: stria_link_ucx_connect() then fails within 50 ms
     * with STRIA_ERR_CANCELLED instead of waiting out its timeout. Once the
     * link is connected, stria_link_abort() ends its operations instead. */
    const bool *cancel;
} stria_ucx_link_params_t;

#define STRIA_UCX_CONNECT_TIMEOUT_S 30.0

/* Connects this process's rank of a ring (see above) and returns its link.
 * Every rank of the ring calls it, in any order. One link per (job_id,
 * ring_id) per context. Errors: STRIA_ERR_INVALID_ARG, STRIA_ERR_BUSY (the
 * context already has that ring), STRIA_ERR_TIMEOUT (a neighbour did not
 * bind in time; the message says which), STRIA_ERR_PROTOCOL (a neighbour
 * has a different rank or ring size than expected, or speaks another link
 * protocol version), STRIA_ERR_AUTH (a key was not proven), STRIA_ERR_PEER,
 * STRIA_ERR_TRANSPORT. The link borrows ctx, which must outlive it; free it
 * with stria_link_destroy() after releasing every request. */
stria_status_t stria_link_ucx_connect(stria_ucx_ctx_t *ctx, const stria_ucx_link_params_t *params,
                                      stria_link_t **link_out);

/* ---- end of UCX link ---------------------------------------------------- */

#ifdef __cplusplus
}
#endif

#endif /* STRIA_TRANSPORT_H */
