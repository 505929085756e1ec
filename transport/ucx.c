/*
 * The UCX ring link's API: connect, isend/irecv, wait, cancel, abort and
 * destroy. These run on the callers' threads and only take ctx->lock: they
 * queue requests and flag links for the progress thread, wake it, and wait
 * on ctx->cond. A connect registers the link under a slot; the progress
 * thread takes the pooled endpoint to the successor and binds both sides
 * (ucx_state.c, ucx_bind.c).
 */
#include "ucx_int.h"

#include <stdio.h>
#include <string.h>

static stria_status_t post(stria_link_t *base, bool is_send, uint64_t tag, void *buf, size_t len,
                           stria_link_req_t **req_out)
{
    stria__ucx_link_t *link = (stria__ucx_link_t *)base;
    stria_ucx_ctx_t *ctx = link->ctx;
    stria_link_req_t *req = calloc(1, sizeof(*req));
    if (req == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "ucx link: out of memory for a request");
    stria__list_init(&req->queue_node);
    req->link = link;
    req->is_send = is_send;
    req->tag = tag;
    req->buf = buf;
    req->len = len;
    if (is_send) {
        stria__ucx_data_hdr_encode(req->hdr, link->out_slot, tag);
    }
    pthread_mutex_lock(&ctx->lock);
    if (link->failed) {
        stria_status_t st = stria__ucx_link_error_locked(link);
        pthread_mutex_unlock(&ctx->lock);
        free(req);
        return st;
    }
    req->state = STRIA__REQ_QUEUED;
    stria__list_push(&link->reqs, &req->link_node);
    stria__list_push(&ctx->queue, &req->queue_node);
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_kick(ctx);
    *req_out = req;
    return STRIA_OK;
}

static stria_status_t ucx_isend(stria_link_t *base, uint64_t tag, const void *buf, size_t len,
                                stria_link_req_t **req_out)
{
    return post(base, true, tag, (void *)buf, len, req_out);
}

static stria_status_t ucx_irecv(stria_link_t *base, uint64_t tag, void *buf, size_t len,
                                stria_link_req_t **req_out)
{
    return post(base, false, tag, buf, len, req_out);
}

/* Waits (lock held) until UCX lets go of a request of a failed link. Returns
 * false when the safety bound passed first. */
static bool wait_release_locked(stria_ucx_ctx_t *ctx, stria_link_req_t *req)
{
    double until = stria_time_now() + STRIA__UCX_RELEASE_WAIT_S;
    while (req->state != STRIA__REQ_DONE && stria_time_now() < until)
        stria__ucx_cond_wait_until(ctx, until);
    if (req->state == STRIA__REQ_DONE)
        return true;
    stria_log_error("ucx link: UCX did not release a %s of tag %#llx within %.0f s; leaving it",
                    stria__req_kind(req), (unsigned long long)req->tag, STRIA__UCX_RELEASE_WAIT_S);
    req->abandoned = true;
    return false;
}

/* Releases a finished request and returns its status (setting the message). */
static stria_status_t req_release_locked(stria__ucx_link_t *link, stria_link_req_t *req)
{
    stria_status_t st = req->status;
    if (st != STRIA_OK && req->msg[0] == '\0' && link->failed)
        st = link->fail_status;
    if (st != STRIA_OK && req->msg[0] != '\0')
        stria_error_set(st, "%s", req->msg);
    else if (st != STRIA_OK)
        stria_error_set(st, "%s", link->failed ? link->fail_msg : link->settle_msg);
    stria__list_del(&req->link_node);
    free(req);
    return st;
}

/* Waits (lock held) until the request is done, the link fails or the
 * deadline passes; a request that failed with a dropped connection also
 * waits for the link's verdict on whom to blame (a notice from the ring,
 * or the drop itself). */
static void wait_done_locked(stria__ucx_link_t *link, stria_link_req_t *req, double timeout_s)
{
    stria_ucx_ctx_t *ctx = link->ctx;
    double deadline = timeout_s < 0 ? 0 : stria_time_now() + timeout_s;
    while (req->state != STRIA__REQ_DONE && !link->failed) {
        double now = stria_time_now();
        if (deadline > 0 && now >= deadline)
            break;
        if (timeout_s == 0)
            break;
        stria__ucx_cond_wait_until(ctx, deadline > 0 ? deadline : now + 3600);
    }
    if (req->state == STRIA__REQ_DONE && req->status != STRIA_OK && req->msg[0] == '\0') {
        double until = stria_time_now() + STRIA__UCX_SETTLE_S + 1.0;
        while (!link->failed && stria_time_now() < until)
            stria__ucx_cond_wait_until(ctx, until);
    }
}

/* When the last time `req`'s peer was heard. */
static double peer_heard_locked(const stria__ucx_link_t *link, const stria_link_req_t *req)
{
    return link->hb.nb[req->is_send ? STRIA__FROM_NEXT : STRIA__FROM_PREV].last;
}

/* After a missed deadline (lock held): blame the peer only if it went
 * quiet. A peer that is alive is itself waiting on someone: the stalled rank
 * the heartbeats report is named, or that rank's own report is given a
 * moment to arrive (this waits for it). */
static void wait_for_culprit_locked(stria__ucx_link_t *link, stria_link_req_t *req,
                                    double timeout_s)
{
    stria_ucx_ctx_t *ctx = link->ctx;
    double now = stria_time_now();
    int reporter;
    double silence;
    if (!(now - peer_heard_locked(link, req) < ctx->stale_s &&
          stria__ucx_hb_suspect(&link->hb, now, -1, &reporter, &silence) < 0))
        return;
    double grace = timeout_s < 0.2 ? 0.2 : timeout_s;
    double until = now + (grace < STRIA__UCX_GRACE_MAX_S ? grace : STRIA__UCX_GRACE_MAX_S);
    while (req->state != STRIA__REQ_DONE && !link->failed && stria_time_now() < until &&
           stria__ucx_hb_suspect(&link->hb, stria_time_now(), -1, &reporter, &silence) < 0)
        stria__ucx_cond_wait_until(ctx, stria_time_now() + 0.05 < until ? stria_time_now() + 0.05
                                                                        : until);
}

/* Fails the link for a missed deadline (lock held), naming the rank at
 * fault: the silent peer, else the stalled rank the heartbeats report. */
static void wait_blame_locked(stria__ucx_link_t *link, stria_link_req_t *req, double timeout_s)
{
    stria_ucx_ctx_t *ctx = link->ctx;
    int peer = req->is_send ? stria_link_next(&link->base) : stria_link_prev(&link->base);
    double now = stria_time_now();
    double quiet = now - peer_heard_locked(link, req);
    int reporter;
    double silence;
    int suspect = stria__ucx_hb_suspect(&link->hb, now, -1, &reporter, &silence);
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
                 "rank %d is alive but did not %s it (too slow, or waiting on another rank)", peer,
                 req->is_send ? "take" : "send");
    }
    stria__ucx_link_fail_locked(
        link, STRIA_ERR_TIMEOUT, origin, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
        "deadline of %.3g s exceeded %s tag %#llx (%zu bytes) %s rank %d "
        "(%s): %s",
        timeout_s, req->is_send ? "sending" : "receiving", (unsigned long long)req->tag, req->len,
        req->is_send ? "to" : "from", peer, req->is_send ? "successor" : "predecessor", why);
    stria__ucx_kick(ctx);
}

static stria_status_t ucx_wait(stria_link_t *base, stria_link_req_t *req, double timeout_s)
{
    stria__ucx_link_t *link = (stria__ucx_link_t *)base;
    stria_ucx_ctx_t *ctx = link->ctx;

    pthread_mutex_lock(&ctx->lock);
    wait_done_locked(link, req, timeout_s);
    if (req->state != STRIA__REQ_DONE && !link->failed)
        wait_for_culprit_locked(link, req, timeout_s);
    if (req->state == STRIA__REQ_DONE) {
        stria_status_t st = req_release_locked(link, req);
        pthread_mutex_unlock(&ctx->lock);
        return st;
    }
    if (!link->failed)
        wait_blame_locked(link, req, timeout_s);
    stria_status_t st = link->fail_status;
    char msg[sizeof(link->fail_msg)];
    snprintf(msg, sizeof(msg), "%s", link->fail_msg);
    if (wait_release_locked(ctx, req)) {
        stria__list_del(&req->link_node);
        free(req);
    }
    pthread_mutex_unlock(&ctx->lock);
    return stria_error_set(st, "%s", msg);
}

static void ucx_cancel(stria_link_t *base, stria_link_req_t *req)
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
        stria__ucx_link_fail_locked(
            link, STRIA_ERR_CANCELLED, base->rank, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "rank %d cancelled a %s of tag %#llx (%zu bytes) in flight", base->rank,
            stria__req_kind(req), (unsigned long long)req->tag, req->len);
        stria__ucx_kick(ctx);
        if (!wait_release_locked(ctx, req)) {
            pthread_mutex_unlock(&ctx->lock);
            return;
        }
    }
    stria__list_del(&req->link_node);
    free(req);
    pthread_mutex_unlock(&ctx->lock);
}

static void ucx_abort(stria_link_t *base, stria_status_t reason, const char *msg)
{
    stria__ucx_link_t *link = (stria__ucx_link_t *)base;
    stria_ucx_ctx_t *ctx = link->ctx;
    pthread_mutex_lock(&ctx->lock);
    if (!link->failed) {
        stria_status_t own = reason == STRIA_OK ? STRIA_ERR_CANCELLED : reason;
        stria__ucx_link_fail_locked(link, own, base->rank, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                                    "rank %d aborted the pass (%s): %s", base->rank,
                                    stria_status_str(own), msg);
        /* The other ranks report the kind of the failure, not a peer's. */
        link->notify_status = stria_link_abort_status(own);
    }
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_kick(ctx);
}

void stria__ucx_link_destroy(stria_link_t *base)
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
        stria__ucx_link_fail_locked(
            link, STRIA_ERR_CANCELLED, base->rank, STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
            "rank %d closed its link with %zu requests pending", base->rank, pending);
    link->want_destroy = true;
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_kick(ctx);

    pthread_mutex_lock(&ctx->lock);
    double until = stria_time_now() + 2 * STRIA__UCX_CLOSE_GRACE_S + 1.0;
    while (link->state != STRIA__LINK_CLOSED && stria_time_now() < until)
        stria__ucx_cond_wait_until(ctx, until);
    if (link->state != STRIA__LINK_CLOSED) {
        /* A graceful close the peer never confirmed: force it. */
        if (!link->failed)
            stria__ucx_link_fail_locked(link, STRIA_ERR_CLOSED, base->rank, 0,
                                        "link of rank %d closed", base->rank);
        stria__ucx_kick(ctx);
        until = stria_time_now() + STRIA__UCX_RELEASE_WAIT_S;
        while (link->state != STRIA__LINK_CLOSED && stria_time_now() < until)
            stria__ucx_cond_wait_until(ctx, until);
    }
    bool closed = link->state == STRIA__LINK_CLOSED;
    stria__list_del(&link->ctx_node);
    uint32_t index = STRIA__UCX_SLOT_INDEX(link->in_slot);
    if (ctx->slots[index] == link) {
        ctx->slots[index] = NULL;
        ctx->slot_gen[index]++; /* what comes for this link now finds no link */
    }
    while (!stria__list_empty(&link->reqs)) {
        stria_link_req_t *r = STRIA__OF(link->reqs.next, stria_link_req_t, link_node);
        stria__list_del(&r->link_node);
        if (r->state == STRIA__REQ_QUEUED)
            stria__list_del(&r->queue_node);
        free(r);
    }
    pthread_mutex_unlock(&ctx->lock);
    if (!closed) {
        /* The progress thread may still touch the link: keep its memory. */
        stria_log_error("ucx link of rank %d: UCX did not give its transfers back; leaking the "
                        "link",
                        base->rank);
        return;
    }
    free(link);
}

/* name, isend, irecv, wait, cancel, abort, destroy */
static const stria_link_ops_t ucx_ops = {
    "ucx", ucx_isend, ucx_irecv, ucx_wait, ucx_cancel, ucx_abort, stria__ucx_link_destroy};

static stria_status_t connect_check(const stria_ucx_link_params_t *params)
{
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
    return STRIA_OK;
}

/* A new link (state NEW), not yet known to the context. */
static stria_status_t link_new(stria_ucx_ctx_t *ctx, const stria_ucx_link_params_t *params,
                               stria__ucx_link_t **link_out)
{
    stria__ucx_link_t *link = calloc(1, sizeof(*link));
    if (link == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "ucx link: out of memory");
    link->base.ops = &ucx_ops;
    link->base.rank = params->rank;
    link->base.size = params->size;
    link->ctx = ctx;
    link->job_id = params->job_id;
    link->ring_id = params->ring_id;
    if (params->key != NULL) {
        link->has_key = true;
        memcpy(link->key, params->key, STRIA_AUTH_KEY_BYTES);
    }
    link->state = STRIA__LINK_NEW;
    stria__ucx_hb_init(&link->hb, params->rank, params->size, ctx->stale_s);
    stria__list_init(&link->reqs);
    stria__list_init(&link->posted);
    stria__list_init(&link->unexp);
    stria__list_init(&link->ctx_node);
    size_t len = 0;
    stria_status_t st =
        stria_addr_resolve(params->next_host, params->next_port, false, &link->next_addr, &len);
    if (st != STRIA_OK) {
        free(link);
        return stria_error_wrap(st, "ucx link rank %d: successor address", params->rank);
    }
    link->next_addrlen = (socklen_t)len;
    snprintf(link->next_desc, sizeof(link->next_desc), "%s:%u", params->next_host,
             (unsigned)params->next_port);
    *link_out = link;
    return STRIA_OK;
}

/* Gives the link a slot and hands it to the progress thread (lock held). */
static stria_status_t link_register_locked(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    for (stria__node_t *n = ctx->links.next; n != &ctx->links; n = n->next) {
        stria__ucx_link_t *l = STRIA__OF(n, stria__ucx_link_t, ctx_node);
        if (l->job_id == link->job_id && l->ring_id == link->ring_id)
            return stria_error_set(
                STRIA_ERR_BUSY, "ucx link: this context already has ring %llu of job %llu",
                (unsigned long long)link->ring_id, (unsigned long long)link->job_id);
    }
    uint32_t index = 0;
    for (uint32_t i = 0; i < STRIA__UCX_SLOTS - 1; i++) {
        uint32_t s = ctx->next_slot;
        ctx->next_slot = ctx->next_slot + 1 >= STRIA__UCX_SLOTS ? 1 : ctx->next_slot + 1;
        if (ctx->slots[s] == NULL) {
            index = s;
            break;
        }
    }
    if (index == 0)
        return stria_error_set(STRIA_ERR_BUSY, "ucx link: the context has no free link slot");
    link->in_slot = ((uint32_t)ctx->slot_gen[index] << 16) | index;
    ctx->slots[index] = link;
    stria__list_push(&ctx->links, &link->ctx_node);
    return STRIA_OK;
}

/* Fails a link whose neighbours did not both connect in time (lock held),
 * saying which did not. */
static void connect_timeout_locked(stria__ucx_link_t *link, double timeout)
{
    char what[800];
    int prev = stria_link_prev(&link->base), next = stria_link_next(&link->base);
    bool in_up = link->hb.nb[STRIA__FROM_PREV].up, out_up = link->hb.nb[STRIA__FROM_NEXT].up;
    if (!out_up && !in_up)
        snprintf(what, sizeof(what),
                 "successor rank %d at %s did not accept the handshake and predecessor rank "
                 "%d did not connect",
                 next, link->next_desc, prev);
    else if (!out_up)
        snprintf(what, sizeof(what),
                 "successor rank %d at %s did not accept the handshake (not listening, another "
                 "link protocol version, or no ring %llu of job %llu there)",
                 next, link->next_desc, (unsigned long long)link->ring_id,
                 (unsigned long long)link->job_id);
    else
        snprintf(what, sizeof(what),
                 "predecessor rank %d did not bind ring %llu of job %llu on port %u", prev,
                 (unsigned long long)link->ring_id, (unsigned long long)link->job_id,
                 (unsigned)link->ctx->port);
    stria__ucx_link_fail_locked(link, STRIA_ERR_TIMEOUT, out_up ? prev : next,
                                STRIA__NOTIFY_NEXT | STRIA__NOTIFY_PREV,
                                "connect timeout of %.3g s: %s", timeout, what);
}

stria_status_t stria_link_ucx_connect(stria_ucx_ctx_t *ctx, const stria_ucx_link_params_t *params,
                                      stria_link_t **link_out)
{
    if (ctx == NULL || params == NULL || link_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_link_ucx_connect: NULL argument");
    stria__ucx_link_t *link = NULL;
    stria_status_t st = connect_check(params);
    if (st == STRIA_OK)
        st = link_new(ctx, params, &link);
    if (st != STRIA_OK)
        return st;
    double timeout =
        params->connect_timeout_s > 0 ? params->connect_timeout_s : STRIA_UCX_CONNECT_TIMEOUT_S;
    link->connect_deadline = stria_time_now() + timeout;

    pthread_mutex_lock(&ctx->lock);
    st = link_register_locked(ctx, link);
    pthread_mutex_unlock(&ctx->lock);
    if (st != STRIA_OK) {
        free(link);
        return st;
    }
    stria__ucx_kick(ctx);

    pthread_mutex_lock(&ctx->lock);
    bool cancelled = false;
    while (link->state != STRIA__LINK_READY && !link->failed &&
           stria_time_now() < link->connect_deadline) {
        double until = link->connect_deadline;
        if (params->cancel != NULL) {
            if ((cancelled = __atomic_load_n(params->cancel, __ATOMIC_ACQUIRE)))
                break;
            if (until > stria_time_now() + STRIA__UCX_CANCEL_POLL_S)
                until = stria_time_now() + STRIA__UCX_CANCEL_POLL_S;
        }
        stria__ucx_cond_wait_until(ctx, until);
    }
    if (cancelled) {
        pthread_mutex_unlock(&ctx->lock);
        stria__ucx_link_destroy(&link->base);
        return stria_error_set(STRIA_ERR_CANCELLED, "ucx link rank %d: connect cancelled",
                               params->rank);
    }
    if (link->state == STRIA__LINK_READY) {
        pthread_mutex_unlock(&ctx->lock);
        stria_log_debug("ucx link rank %d/%d (job %llu ring %llu) connected", params->rank,
                        params->size, (unsigned long long)params->job_id,
                        (unsigned long long)params->ring_id);
        *link_out = &link->base;
        return STRIA_OK;
    }
    if (!link->failed)
        connect_timeout_locked(link, timeout);
    st = stria__ucx_link_error_locked(link);
    char msg[sizeof(link->fail_msg)];
    snprintf(msg, sizeof(msg), "%s", link->fail_msg);
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_link_destroy(&link->base);
    return stria_error_set(st, "ucx link rank %d: %s", params->rank, msg);
}
