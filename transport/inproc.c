/*
 * In-process ring link: ranks are threads sharing a hub of mailboxes. Box r
 * holds the sends from rank r - 1 not yet matched and the receives rank r
 * posted and not yet matched; only ranks r - 1 and r touch it, so each box has
 * its own lock and the copy happens under it. The hub-wide state (abort,
 * faults) has a separate lock, taken before a box lock and never after.
 */
#include "stria_transport.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STRIA__INPROC_MSG_LEN 512

enum { STRIA__REQ_SEND = 0, STRIA__REQ_RECV = 1 };
enum { STRIA__REQ_PENDING = 0, STRIA__REQ_DONE = 1, STRIA__REQ_FAILED = 2 };

struct stria_link_req {
    stria_link_req_t *next; /* in its mailbox list while queued */
    int kind;
    int state;
    bool queued;
    uint64_t tag;
    const void *sbuf;
    void *rbuf;
    size_t len;
    stria_status_t status; /* when FAILED */
    char msg[STRIA__INPROC_MSG_LEN];
};

typedef struct {
    stria_link_req_t *head, *tail;
} stria__req_list_t;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cv;
    stria__req_list_t sends; /* from the predecessor, unmatched */
    stria__req_list_t recvs; /* of the owner, unmatched */
} stria__mailbox_t;

typedef struct {
    stria_inproc_fault_t fault;
    uint64_t after_ops;
    uint64_t ops;
} stria__fault_state_t;

struct stria_inproc_hub {
    int size;
    int refs; /* atomic */
    stria__mailbox_t *boxes;
    pthread_mutex_t state_lock;
    int aborted; /* atomic; the fields below are fixed once it is set */
    int abort_rank;
    stria_status_t abort_reason;
    char abort_msg[STRIA__INPROC_MSG_LEN];
    stria__fault_state_t *faults;
    bool *has_link;
};

typedef struct {
    stria_link_t base;
    stria_inproc_hub_t *hub;
} stria__inproc_link_t;

/* ---- lists --------------------------------------------------------------- */

static void stria__list_push(stria__req_list_t *l, stria_link_req_t *r)
{
    r->next = NULL;
    if (l->tail != NULL)
        l->tail->next = r;
    else
        l->head = r;
    l->tail = r;
    r->queued = true;
}

static void stria__list_remove(stria__req_list_t *l, stria_link_req_t *r)
{
    stria_link_req_t *prev = NULL;
    for (stria_link_req_t *it = l->head; it != NULL; prev = it, it = it->next) {
        if (it != r)
            continue;
        if (prev != NULL)
            prev->next = it->next;
        else
            l->head = it->next;
        if (l->tail == it)
            l->tail = prev;
        r->next = NULL;
        r->queued = false;
        return;
    }
}

static stria_link_req_t *stria__list_take_tag(stria__req_list_t *l, uint64_t tag)
{
    for (stria_link_req_t *it = l->head; it != NULL; it = it->next) {
        if (it->tag == tag) {
            stria__list_remove(l, it);
            return it;
        }
    }
    return NULL;
}

/* ---- hub ----------------------------------------------------------------- */

static bool stria__hub_aborted(const stria_inproc_hub_t *hub)
{
    return __atomic_load_n(&hub->aborted, __ATOMIC_ACQUIRE) != 0;
}

/* The error of rank `rank`'s operations once the hub is aborted: the
 * aborting rank's own reason, the kind of the failure for the others
 * (stria_link_abort_status()). */
static stria_status_t stria__hub_abort_error(const stria_inproc_hub_t *hub, int rank)
{
    stria_status_t own = hub->abort_reason == STRIA_OK ? STRIA_ERR_CANCELLED : hub->abort_reason;
    return stria_error_set(rank == hub->abort_rank ? own : stria_link_abort_status(own),
                           "rank %d aborted the pass (%s): %s", hub->abort_rank,
                           stria_status_name(hub->abort_reason), hub->abort_msg);
}

static void stria__hub_abort(stria_inproc_hub_t *hub, int rank, stria_status_t reason,
                             const char *msg)
{
    pthread_mutex_lock(&hub->state_lock);
    if (!stria__hub_aborted(hub)) {
        hub->abort_rank = rank;
        hub->abort_reason = reason;
        snprintf(hub->abort_msg, sizeof(hub->abort_msg), "%s", msg);
        __atomic_store_n(&hub->aborted, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&hub->state_lock);
    /* Waiters test the flag under their box lock, so taking each lock before
     * the broadcast means no waiter can miss it. */
    for (int i = 0; i < hub->size; i++) {
        pthread_mutex_lock(&hub->boxes[i].lock);
        pthread_cond_broadcast(&hub->boxes[i].cv);
        pthread_mutex_unlock(&hub->boxes[i].lock);
    }
}

static void stria__hub_free(stria_inproc_hub_t *hub, int n_boxes)
{
    for (int i = 0; i < n_boxes; i++) {
        pthread_cond_destroy(&hub->boxes[i].cv);
        pthread_mutex_destroy(&hub->boxes[i].lock);
    }
    pthread_mutex_destroy(&hub->state_lock);
    free(hub->boxes);
    free(hub->faults);
    free(hub->has_link);
    free(hub);
}

stria_status_t stria_inproc_hub_create(int size, stria_inproc_hub_t **hub_out)
{
    stria_inproc_hub_t *hub;
    pthread_condattr_t attr;
    int n_boxes = 0;

    if (hub_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_inproc_hub_create: hub_out is NULL");
    if (size < 1 || size > 65535)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_inproc_hub_create: ring size %d (must be 1..65535)", size);
    hub = calloc(1, sizeof(*hub));
    if (hub == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_inproc_hub_create: out of memory");
    pthread_mutex_init(&hub->state_lock, NULL);
    hub->size = size;
    hub->refs = 1;
    hub->abort_rank = -1;
    hub->boxes = calloc((size_t)size, sizeof(*hub->boxes));
    hub->faults = calloc((size_t)size, sizeof(*hub->faults));
    hub->has_link = calloc((size_t)size, sizeof(*hub->has_link));
    if (hub->boxes == NULL || hub->faults == NULL || hub->has_link == NULL)
        goto err_free;
    /* Deadlines are monotonic: a clock step must not end or extend a wait. */
    if (pthread_condattr_init(&attr) != 0)
        goto err_free;
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    for (; n_boxes < size; n_boxes++) {
        pthread_mutex_init(&hub->boxes[n_boxes].lock, NULL);
        if (pthread_cond_init(&hub->boxes[n_boxes].cv, &attr) != 0) {
            pthread_mutex_destroy(&hub->boxes[n_boxes].lock);
            pthread_condattr_destroy(&attr);
            goto err_free;
        }
    }
    pthread_condattr_destroy(&attr);
    *hub_out = hub;
    return STRIA_OK;
err_free:
    stria__hub_free(hub, n_boxes);
    return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_inproc_hub_create: out of memory");
}

void stria_inproc_hub_release(stria_inproc_hub_t *hub)
{
    if (hub != NULL && __atomic_sub_fetch(&hub->refs, 1, __ATOMIC_ACQ_REL) == 0)
        stria__hub_free(hub, hub->size);
}

void stria_inproc_hub_reset(stria_inproc_hub_t *hub)
{
    if (hub == NULL)
        return;
    pthread_mutex_lock(&hub->state_lock);
    __atomic_store_n(&hub->aborted, 0, __ATOMIC_RELEASE);
    hub->abort_rank = -1;
    hub->abort_msg[0] = '\0';
    memset(hub->faults, 0, (size_t)hub->size * sizeof(*hub->faults));
    pthread_mutex_unlock(&hub->state_lock);
}

int stria_inproc_hub_aborted_by(stria_inproc_hub_t *hub)
{
    if (hub == NULL || !stria__hub_aborted(hub))
        return -1;
    return hub->abort_rank; /* fixed once the flag is set */
}

stria_status_t stria_inproc_fault_inject(stria_inproc_hub_t *hub, int rank,
                                         stria_inproc_fault_t fault, uint64_t after_ops)
{
    if (hub == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_inproc_fault_inject: hub is NULL");
    if (rank < 0 || rank >= hub->size)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_inproc_fault_inject: rank %d outside the ring of %d", rank,
                               hub->size);
    if (fault != STRIA_INPROC_FAULT_NONE && fault != STRIA_INPROC_FAULT_FAIL &&
        fault != STRIA_INPROC_FAULT_STALL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_inproc_fault_inject: unknown fault %d",
                               (int)fault);
    pthread_mutex_lock(&hub->state_lock);
    hub->faults[rank].fault = fault;
    hub->faults[rank].after_ops = after_ops;
    hub->faults[rank].ops = 0;
    pthread_mutex_unlock(&hub->state_lock);
    return STRIA_OK;
}

/* Counts one operation of `rank` and returns the fault that applies to it. */
static stria_inproc_fault_t stria__fault_tick(stria_inproc_hub_t *hub, int rank)
{
    stria_inproc_fault_t f = STRIA_INPROC_FAULT_NONE;
    pthread_mutex_lock(&hub->state_lock);
    stria__fault_state_t *fs = &hub->faults[rank];
    if (fs->fault != STRIA_INPROC_FAULT_NONE && ++fs->ops > fs->after_ops)
        f = fs->fault;
    pthread_mutex_unlock(&hub->state_lock);
    return f;
}

/* ---- operations ---------------------------------------------------------- */

static stria_status_t stria__req_new(int kind, uint64_t tag, size_t len, stria_link_req_t **out)
{
    stria_link_req_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "in-process link: out of memory");
    r->kind = kind;
    r->tag = tag;
    r->len = len;
    *out = r;
    return STRIA_OK;
}

static void stria__req_fail(stria_link_req_t *r, stria_status_t st, const char *msg)
{
    r->state = STRIA__REQ_FAILED;
    r->status = st;
    snprintf(r->msg, sizeof(r->msg), "%s", msg);
}

/* Completes a matched pair under the box lock. `receiver` is the rank that
 * owns the box. */
static void stria__match(stria__mailbox_t *box, stria_link_req_t *send, stria_link_req_t *recv,
                         int receiver, int size)
{
    if (send->len != recv->len) {
        char msg[STRIA__INPROC_MSG_LEN];
        snprintf(msg, sizeof(msg),
                 "message tag %#llx from rank %d to rank %d has %zu bytes, the receive expects %zu",
                 (unsigned long long)send->tag, (receiver + size - 1) % size, receiver, send->len,
                 recv->len);
        stria__req_fail(send, STRIA_ERR_PROTOCOL, msg);
        stria__req_fail(recv, STRIA_ERR_PROTOCOL, msg);
    } else {
        if (send->len > 0)
            memcpy(recv->rbuf, send->sbuf, send->len);
        send->state = STRIA__REQ_DONE;
        recv->state = STRIA__REQ_DONE;
    }
    pthread_cond_broadcast(&box->cv);
}

/* Checks abort and faults before posting; returns STRIA_OK or an error. On
 * *stalled the send must be accepted and never delivered. */
static stria_status_t stria__pre_post(stria__inproc_link_t *l, bool *stalled)
{
    stria_inproc_hub_t *hub = l->hub;
    int rank = l->base.rank;
    stria_inproc_fault_t f;

    *stalled = false;
    if (stria__hub_aborted(hub))
        return stria__hub_abort_error(hub, rank);
    f = stria__fault_tick(hub, rank);
    if (f == STRIA_INPROC_FAULT_FAIL) {
        char msg[128];
        snprintf(msg, sizeof(msg), "rank %d failed (injected fault)", rank);
        stria__hub_abort(hub, rank, STRIA_ERR_TRANSPORT, msg);
        return stria_error_set(STRIA_ERR_TRANSPORT, "link failed (injected fault)");
    }
    *stalled = f == STRIA_INPROC_FAULT_STALL;
    return STRIA_OK;
}

/* stria__pre_post(), then a new request of `kind` in *req_out. */
static stria_status_t stria__req_post(stria__inproc_link_t *l, int kind, uint64_t tag, size_t len,
                                      bool *stalled, stria_link_req_t **req_out)
{
    stria_status_t st = stria__pre_post(l, stalled);
    return st != STRIA_OK ? st : stria__req_new(kind, tag, len, req_out);
}

static stria_status_t stria__inproc_isend(stria_link_t *link, uint64_t tag, const void *buf,
                                          size_t len, stria_link_req_t **req_out)
{
    stria__inproc_link_t *l = (stria__inproc_link_t *)link;
    int next = stria_link_next(link);
    stria__mailbox_t *box = &l->hub->boxes[next];
    stria_link_req_t *req = NULL, *recv;
    bool stalled;
    stria_status_t st = stria__req_post(l, STRIA__REQ_SEND, tag, len, &stalled, &req);
    if (st != STRIA_OK)
        return st;
    req->sbuf = buf;
    if (!stalled) {
        pthread_mutex_lock(&box->lock);
        recv = stria__list_take_tag(&box->recvs, tag);
        if (recv != NULL)
            stria__match(box, req, recv, next, link->size);
        else
            stria__list_push(&box->sends, req);
        pthread_mutex_unlock(&box->lock);
    }
    *req_out = req;
    return STRIA_OK;
}

static stria_status_t stria__inproc_irecv(stria_link_t *link, uint64_t tag, void *buf, size_t len,
                                          stria_link_req_t **req_out)
{
    stria__inproc_link_t *l = (stria__inproc_link_t *)link;
    stria__mailbox_t *box = &l->hub->boxes[link->rank];
    stria_link_req_t *req = NULL, *send;
    bool stalled; /* a stalled rank's receives are posted as usual */
    stria_status_t st = stria__req_post(l, STRIA__REQ_RECV, tag, len, &stalled, &req);
    if (st != STRIA_OK)
        return st;
    req->rbuf = buf;
    pthread_mutex_lock(&box->lock);
    send = stria__list_take_tag(&box->sends, tag);
    if (send != NULL)
        stria__match(box, send, req, link->rank, link->size);
    else
        stria__list_push(&box->recvs, req);
    pthread_mutex_unlock(&box->lock);
    *req_out = req;
    return STRIA_OK;
}

static stria__mailbox_t *stria__req_box(stria__inproc_link_t *l, const stria_link_req_t *req)
{
    int owner = req->kind == STRIA__REQ_SEND ? stria_link_next(&l->base) : l->base.rank;
    return &l->hub->boxes[owner];
}

static void stria__unqueue(stria__mailbox_t *box, stria_link_req_t *req)
{
    if (req->queued)
        stria__list_remove(req->kind == STRIA__REQ_SEND ? &box->sends : &box->recvs, req);
}

static stria_status_t stria__inproc_wait(stria_link_t *link, stria_link_req_t *req,
                                         double timeout_s)
{
    stria__inproc_link_t *l = (stria__inproc_link_t *)link;
    stria__mailbox_t *box = stria__req_box(l, req);
    struct timespec deadline;
    stria_status_t st = STRIA_OK;
    char msg[STRIA__INPROC_MSG_LEN];
    bool timed_out = false, aborted = false;

    if (timeout_s >= 0) {
        double t = timeout_s > 1e9 ? 1e9 : timeout_s;
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += (time_t)t;
        deadline.tv_nsec += (long)((t - (double)(time_t)t) * 1e9);
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    msg[0] = '\0';
    pthread_mutex_lock(&box->lock);
    while (req->state == STRIA__REQ_PENDING && !stria__hub_aborted(l->hub) && !timed_out) {
        if (timeout_s < 0)
            pthread_cond_wait(&box->cv, &box->lock);
        else
            timed_out = pthread_cond_timedwait(&box->cv, &box->lock, &deadline) != 0 &&
                        req->state == STRIA__REQ_PENDING;
    }
    stria__unqueue(box, req);
    if (req->state == STRIA__REQ_FAILED) {
        st = req->status;
        memcpy(msg, req->msg, sizeof(msg));
    } else if (req->state == STRIA__REQ_PENDING && !timed_out) {
        aborted = true;
    } else if (req->state == STRIA__REQ_PENDING) {
        st = STRIA_ERR_TIMEOUT;
    }
    pthread_mutex_unlock(&box->lock);

    if (aborted)
        st = stria__hub_abort_error(l->hub, link->rank);
    else if (st == STRIA_ERR_TIMEOUT && req->kind == STRIA__REQ_SEND)
        stria_error_set(st, "rank %d did not take message tag %#llx (%zu bytes) within %.3g s",
                        stria_link_next(link), (unsigned long long)req->tag, req->len, timeout_s);
    else if (st == STRIA_ERR_TIMEOUT)
        stria_error_set(st, "no message tag %#llx from rank %d within %.3g s",
                        (unsigned long long)req->tag, stria_link_prev(link), timeout_s);
    else if (st != STRIA_OK)
        stria_error_set(st, "%s", msg);
    free(req);
    return st;
}

static void stria__inproc_cancel(stria_link_t *link, stria_link_req_t *req)
{
    stria__inproc_link_t *l = (stria__inproc_link_t *)link;
    stria__mailbox_t *box = stria__req_box(l, req);

    pthread_mutex_lock(&box->lock);
    stria__unqueue(box, req);
    pthread_mutex_unlock(&box->lock);
    free(req);
}

static void stria__inproc_abort(stria_link_t *link, stria_status_t reason, const char *msg)
{
    stria__inproc_link_t *l = (stria__inproc_link_t *)link;
    stria__hub_abort(l->hub, link->rank, reason, msg);
}

static void stria__inproc_destroy(stria_link_t *link)
{
    stria__inproc_link_t *l = (stria__inproc_link_t *)link;
    stria_inproc_hub_t *hub = l->hub;

    pthread_mutex_lock(&hub->state_lock);
    hub->has_link[link->rank] = false;
    pthread_mutex_unlock(&hub->state_lock);
    free(l);
    stria_inproc_hub_release(hub);
}

/* name, isend, irecv, wait, cancel, abort, destroy */
static const stria_link_ops_t stria__inproc_ops = {"inproc",
                                                   stria__inproc_isend,
                                                   stria__inproc_irecv,
                                                   stria__inproc_wait,
                                                   stria__inproc_cancel,
                                                   stria__inproc_abort,
                                                   stria__inproc_destroy};

stria_status_t stria_inproc_link_create(stria_inproc_hub_t *hub, int rank, stria_link_t **link_out)
{
    stria__inproc_link_t *l;

    if (hub == NULL || link_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_inproc_link_create: NULL argument");
    if (rank < 0 || rank >= hub->size)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_inproc_link_create: rank %d outside the ring of %d", rank,
                               hub->size);
    l = calloc(1, sizeof(*l));
    if (l == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_inproc_link_create: out of memory");
    pthread_mutex_lock(&hub->state_lock);
    if (hub->has_link[rank]) {
        pthread_mutex_unlock(&hub->state_lock);
        free(l);
        return stria_error_set(STRIA_ERR_BUSY,
                               "stria_inproc_link_create: rank %d already has a link", rank);
    }
    hub->has_link[rank] = true;
    pthread_mutex_unlock(&hub->state_lock);
    __atomic_add_fetch(&hub->refs, 1, __ATOMIC_ACQ_REL);
    l->base.ops = &stria__inproc_ops;
    l->base.rank = rank;
    l->base.size = hub->size;
    l->hub = hub;
    *link_out = &l->base;
    return STRIA_OK;
}
