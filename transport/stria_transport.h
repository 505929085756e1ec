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
 * STRIA_ERR_CANCELLED, STRIA_ERR_TRANSPORT. */
stria_status_t stria_link_wait(stria_link_t *link, stria_link_req_t *req, double timeout_s);
/* Cancels and releases a pending request; NULL is ignored. */
void stria_link_cancel(stria_link_t *link, stria_link_req_t *req);
/* Makes the other ranks' pending and future operations of this pass fail
 * with STRIA_ERR_PEER naming this rank. */
void stria_link_abort(stria_link_t *link, stria_status_t reason, const char *msg);
void stria_link_destroy(stria_link_t *link);

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
 * new operation of every rank fails with STRIA_ERR_PEER and a message naming
 * the aborting rank (the first abort wins). stria_inproc_hub_reset() clears
 * that state for the next pass.
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

/* Faults injected into one rank, counted in posted operations (isend and
 * irecv calls) of that rank since the fault was set. */
typedef enum {
    STRIA_INPROC_FAULT_NONE = 0,
    /* The rank dies: its operation number after_ops + 1 and all later ones
     * fail with STRIA_ERR_TRANSPORT, and the hub is aborted in its name, as a
     * transport would report a dead peer. */
    STRIA_INPROC_FAULT_FAIL = 1,
    /* The rank hangs: sends from operation after_ops + 1 on are accepted but
     * never delivered, so only deadlines (or an abort) end the pass. */
    STRIA_INPROC_FAULT_STALL = 2,
} stria_inproc_fault_t;

stria_status_t stria_inproc_fault_inject(stria_inproc_hub_t *hub, int rank,
                                         stria_inproc_fault_t fault, uint64_t after_ops);

/* ---- end of in-process link --------------------------------------------- */


#ifdef __cplusplus
}
#endif

#endif /* STRIA_TRANSPORT_H */
