/*
 * Binding a link to the pooled endpoints (progress thread): one round trip
 * on the ready endpoint to the successor.
 *
 *   connector (rank r)                         acceptor (rank r + 1)
 *   BIND  job, ring, r, size, slot_c, counter,
 *         MAC_c(ring key, nonces, counter, job, ring, r, size, slot_c)  ->
 *                                          <-  BOUND slot_a, counter,
 *                                              MAC_a(..., slot_c, slot_a)
 *
 * Both MACs cover both endpoint nonces (from the endpoint's handshake), so a
 * bind captured on one endpoint is refused on any other; the counter of an
 * endpoint goes up with every bind, and the acceptor takes each counter once
 * (a bind replayed on its own endpoint is refused; one that comes out of
 * order within STRIA__UCX_BIND_WINDOW of the highest is taken). Neither side
 * sends a tensor to, nor takes one from, a neighbour that did not prove the
 * ring key. Without a ring key the MACs are left out and a neighbour only
 * names the ring. A bind that comes before its link exists is parked on its
 * endpoint (at most max_pending_per_source per endpoint) until the link is
 * made or the handshake timeout passes.
 */
#include "ucx_int.h"

#include <stdio.h>
#include <string.h>

/* The bind MAC fields of a link's bind on endpoint e. */
static stria__bind_fields_t fields_of(const stria__ucx_ep_t *e, const stria__ctrl_t *bind,
                                      uint32_t slot_a)
{
    stria__bind_fields_t f = {.nonce_c = e->nonce_c,
                              .nonce_s = e->nonce_s,
                              .counter = bind->counter,
                              .job_id = bind->job_id,
                              .ring_id = bind->ring_id,
                              .rank = bind->rank,
                              .size = bind->size,
                              .slot_c = bind->slot,
                              .slot_a = slot_a};
    return f;
}

/* ---- the connector's side ------------------------------------------------------------ */

void stria__ucx_bind_send(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    stria__ucx_ep_t *e = link->out;
    stria__ctrl_t c;
    (void)ctx;
    stria__ucx_link_ctrl_init(link, &c, STRIA__CTRL_BIND, STRIA__FROM_NEXT);
    c.dst = 0;
    c.slot = link->in_slot;
    c.counter = e->next_counter++;
    if (link->has_key) {
        c.flags = STRIA__CTRL_FLAG_KEYED;
        stria__bind_fields_t f = fields_of(e, &c, 0);
        stria__ucx_bind_mac(link->key, false, &f, c.mac);
    }
    link->bind_counter = c.counter;
    stria__ucx_ctrl_send(e->ep, &c, &e->ctrl_pending);
}

/* Fails the link for a BOUND it cannot take (lock held). */
static void refused_locked(stria__ucx_link_t *link, const stria__ctrl_t *c)
{
    stria_status_t st =
        c->status == STRIA_ERR_BUSY || c->status == STRIA_ERR_CLOSED || c->status == STRIA_ERR_AUTH
            ? (stria_status_t)c->status
            : STRIA_ERR_PROTOCOL;
    stria__ucx_link_fail_locked(link, st, stria_link_next(&link->base), 0,
                                "successor at %s refused the bind: %s", link->next_desc, c->text);
}

/* Checks a BOUND's proof and fields (lock held); fails the link if wrong. */
static bool bound_ok_locked(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link, stria__ucx_ep_t *e,
                            const stria__ctrl_t *c)
{
    int next = stria_link_next(&link->base);
    if (c->status != STRIA_OK) {
        refused_locked(link, c);
        return false;
    }
    if (link->has_key) {
        stria__ctrl_t bind;
        stria__ucx_link_ctrl_init(link, &bind, STRIA__CTRL_BIND, STRIA__FROM_NEXT);
        bind.slot = link->in_slot;
        bind.counter = link->bind_counter;
        stria__bind_fields_t f = fields_of(e, &bind, c->slot);
        uint8_t want[STRIA_AUTH_MAC_BYTES];
        stria__ucx_bind_mac(link->key, true, &f, want);
        bool keyed = (c->flags & STRIA__CTRL_FLAG_KEYED) != 0;
        if (!keyed || !stria_auth_equal(want, c->mac, sizeof(want))) {
            ctx->stats.binds_refused++;
            /* Our data goes only to a successor that proved the key. */
            stria__ucx_link_fail_locked(link, STRIA_ERR_AUTH, next, 0,
                                        keyed ? "successor at %s did not prove the ring key of "
                                                "job %llu"
                                              : "successor at %s accepted without proving the "
                                                "ring key of job %llu",
                                        link->next_desc, (unsigned long long)link->job_id);
            return false;
        }
    }
    if (c->rank != next || c->size != link->base.size) {
        stria__ucx_link_fail_locked(link, STRIA_ERR_PROTOCOL, next, 0,
                                    "successor at %s is rank %d of %d, expected rank %d of %d",
                                    link->next_desc, (int)c->rank, (int)c->size, next,
                                    link->base.size);
        return false;
    }
    if (c->slot == 0) {
        stria__ucx_link_fail_locked(link, STRIA_ERR_PROTOCOL, next, 0,
                                    "successor at %s gave an invalid slot %u", link->next_desc,
                                    c->slot);
        return false;
    }
    return true;
}

/* A successor took the bind of a link that has failed or is gone since
 * (lock held): it is told at once (it would wait for its deadline else). */
static void disowned_locked(stria__ucx_ep_t *e, const stria__ctrl_t *c,
                            const stria__ucx_link_t *link)
{
    stria__ctrl_t n;
    memset(&n, 0, sizeof(n));
    n.type = STRIA__CTRL_ABORT;
    n.job_id = c->job_id;
    n.ring_id = c->ring_id;
    n.size = c->size;
    n.rank = (c->rank + c->size - 1) % c->size;
    n.dst = c->slot;
    n.status = link != NULL ? link->notify_status : STRIA_ERR_PEER;
    n.origin = link != NULL ? link->notify_origin : n.rank;
    n.reporter = link != NULL ? link->notify_reporter : n.rank;
    if (link != NULL)
        snprintf(n.text, sizeof(n.text), "%s", link->notify_text);
    else
        snprintf(n.text, sizeof(n.text),
                 "rank %d's link of ring %llu (job %llu) ended before its bind was answered",
                 n.rank, (unsigned long long)c->ring_id, (unsigned long long)c->job_id);
    stria__ucx_ctrl_send(e->ep, &n, &e->ctrl_pending);
}

void stria__ucx_bound_handle(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c)
{
    pthread_mutex_lock(&ctx->lock);
    stria__ucx_link_t *link = stria__ucx_link_of_slot_locked(ctx, c->dst);
    /* Only the answer to the bind this link has outstanding on e. */
    bool ours = link != NULL && link->out == e && link->bind_counter != 0 &&
                link->bind_counter == c->counter && !link->hb.nb[STRIA__FROM_NEXT].up;
    if (!ours || link->failed) {
        if (c->status == STRIA_OK && c->slot != 0 && (link == NULL || ours))
            disowned_locked(e, c, link);
        pthread_mutex_unlock(&ctx->lock);
        stria_log_debug("ucx link: a bind answer from %s for no live bind", e->peer);
        return;
    }
    if (bound_ok_locked(ctx, link, e, c)) {
        link->out_slot = c->slot;
        link->out_bound = true;
        link->bind_counter = 0;
        e->links++;
        e->binds++;
        stria__ucx_link_up_locked(link, STRIA__FROM_NEXT);
    }
    pthread_mutex_unlock(&ctx->lock);
}

/* ---- the acceptor's side -------------------------------------------------------------- */

/* Answers a bind on e: BOUND with `status` (a refusal with `text`), or the
 * link's acceptance (its slot and MAC) when link is given and status OK. */
static void answer(stria__ucx_ep_t *e, const stria__ctrl_t *bind, const stria__ucx_link_t *link,
                   stria_status_t status, const char *text)
{
    stria__ctrl_t c;
    memset(&c, 0, sizeof(c));
    c.type = STRIA__CTRL_BOUND;
    c.job_id = bind->job_id;
    c.ring_id = bind->ring_id;
    c.rank = (bind->rank + 1) % bind->size;
    c.size = bind->size;
    c.status = status;
    c.dst = bind->slot;
    c.counter = bind->counter;
    c.origin = c.reporter = c.rank;
    snprintf(c.text, sizeof(c.text), "%s", text != NULL ? text : "");
    if (status == STRIA_OK && link != NULL) {
        c.rank = link->base.rank;
        c.slot = link->in_slot;
        if (link->has_key) {
            c.flags = STRIA__CTRL_FLAG_KEYED;
            stria__bind_fields_t f = fields_of(e, bind, link->in_slot);
            stria__ucx_bind_mac(link->key, true, &f, c.mac);
        }
    }
    stria__ucx_ctrl_send(e->ep, &c, &e->ctrl_pending);
}

/* Whether the bind's counter is new on e; remembers it. */
static bool counter_fresh(stria__ucx_ep_t *e, uint64_t counter)
{
    if (counter == 0)
        return false;
    if (counter > e->counter_max) {
        uint64_t shift = counter - e->counter_max;
        e->counter_seen = shift >= 64 ? 0 : e->counter_seen << shift;
        e->counter_seen |= 1;
        e->counter_max = counter;
        return true;
    }
    uint64_t back = e->counter_max - counter;
    if (back >= STRIA__UCX_BIND_WINDOW || (e->counter_seen >> back) & 1)
        return false;
    e->counter_seen |= 1ull << back;
    return true;
}

/* The live link of (job, ring), or NULL (lock held). */
static stria__ucx_link_t *link_find_locked(stria_ucx_ctx_t *ctx, uint64_t job_id, uint64_t ring_id)
{
    for (stria__node_t *n = ctx->links.next; n != &ctx->links; n = n->next) {
        stria__ucx_link_t *l = STRIA__OF(n, stria__ucx_link_t, ctx_node);
        if (l->job_id == job_id && l->ring_id == ring_id && !l->want_destroy &&
            l->state != STRIA__LINK_NEW)
            return l;
    }
    return NULL;
}

/* Whether the bind proves the link's ring key (lock held); if not, the
 * refusal's text. */
static bool proof_ok_locked(stria__ucx_link_t *link, const stria__ucx_ep_t *e,
                            const stria__ctrl_t *c, char *text, size_t len)
{
    if (!link->has_key)
        return true; /* a keyed connector refuses our unproven answer itself */
    if (!(c->flags & STRIA__CTRL_FLAG_KEYED)) {
        snprintf(text, len,
                 "rank %d of ring %llu (job %llu) needs the ring key, the bind proves "
                 "none",
                 link->base.rank, (unsigned long long)link->ring_id,
                 (unsigned long long)link->job_id);
        return false;
    }
    uint8_t want[STRIA_AUTH_MAC_BYTES];
    stria__bind_fields_t f = fields_of(e, c, 0);
    stria__ucx_bind_mac(link->key, false, &f, want);
    if (!stria_auth_equal(want, c->mac, sizeof(want))) {
        snprintf(text, len, "the proof of the ring key is wrong");
        return false;
    }
    return true;
}

/* Whether the bind may become the link's predecessor now (lock held); if
 * not, the status and text of the refusal. A wrong rank or size fails the
 * link (the bind proved the key, or the link has none): a ring member
 * disagrees. */
static stria_status_t claim_check_locked(stria__ucx_link_t *link, const stria__ucx_ep_t *e,
                                         const stria__ctrl_t *c, char *text, size_t len)
{
    int prev = stria_link_prev(&link->base);
    if (link->failed) {
        snprintf(text, len, "rank %d of ring %llu (job %llu) has failed: %.200s", link->base.rank,
                 (unsigned long long)link->ring_id, (unsigned long long)link->job_id,
                 link->fail_msg);
        return STRIA_ERR_CLOSED;
    }
    if (link->hb.nb[STRIA__FROM_PREV].up) {
        snprintf(text, len, "rank %d of ring %llu (job %llu) already has its predecessor bound",
                 link->base.rank, (unsigned long long)link->ring_id,
                 (unsigned long long)link->job_id);
        return STRIA_ERR_BUSY;
    }
    if (c->size != link->base.size || c->rank != prev) {
        snprintf(text, len,
                 "rank %d of %d (ring %llu, job %llu) expects its predecessor to be rank %d of "
                 "%d, got rank %d of %d",
                 link->base.rank, link->base.size, (unsigned long long)link->ring_id,
                 (unsigned long long)link->job_id, prev, link->base.size, (int)c->rank,
                 (int)c->size);
        stria__ucx_link_fail_locked(
            link, STRIA_ERR_PROTOCOL, (int)c->rank, STRIA__NOTIFY_NEXT,
            "predecessor at %s announced rank %d of %d, expected rank %d of %d", e->peer,
            (int)c->rank, (int)c->size, prev, link->base.size);
        return STRIA_ERR_PROTOCOL;
    }
    return STRIA_OK;
}

/* Checks a bind against its link and binds it, or refuses it. */
static void bind_to(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c,
                    stria__ucx_link_t *link)
{
    char text[STRIA__UCX_TEXT_MAX];
    stria_status_t st;
    pthread_mutex_lock(&ctx->lock);
    if (!proof_ok_locked(link, e, c, text, sizeof(text))) {
        st = STRIA_ERR_AUTH;
        ctx->stats.binds_refused++;
    } else {
        st = claim_check_locked(link, e, c, text, sizeof(text));
    }
    if (st == STRIA_OK) {
        link->in = e;
        stria__ucx_ep_hold(e);
        link->in_bound = true;
        link->prev_slot = c->slot;
        e->links++;
        e->binds++;
        e->trusted = true;
        ctx->stats.binds_done++;
        stria__ucx_link_up_locked(link, STRIA__FROM_PREV);
    }
    pthread_mutex_unlock(&ctx->lock);
    if (st == STRIA_ERR_AUTH)
        stria_log_warn("ucx link: a bind from %s (job %llu ring %llu) proved a wrong ring key; "
                       "refused",
                       e->peer, (unsigned long long)c->job_id, (unsigned long long)c->ring_id);
    else if (st == STRIA_OK)
        stria_log_debug("ucx link rank %d: predecessor rank %d bound from %s%s", link->base.rank,
                        (int)c->rank, e->peer, link->has_key ? " (ring key proven)" : "");
    answer(e, c, link, st, st == STRIA_OK ? NULL : text);
}

void stria__ucx_bind_handle(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c)
{
    if (e->outgoing || e->state != STRIA__EP_READY) {
        if (e->state == STRIA__EP_HANDSHAKE)
            answer(e, c, NULL, STRIA_ERR_PROTOCOL, "a bind before the endpoint handshake");
        return;
    }
    if (!counter_fresh(e, c->counter)) {
        pthread_mutex_lock(&ctx->lock);
        ctx->stats.binds_replayed++;
        pthread_mutex_unlock(&ctx->lock);
        stria_log_warn("ucx link: a bind from %s (job %llu ring %llu) reused counter %llu of its "
                       "endpoint (replayed); refused",
                       e->peer, (unsigned long long)c->job_id, (unsigned long long)c->ring_id,
                       (unsigned long long)c->counter);
        answer(e, c, NULL, STRIA_ERR_AUTH,
               "the bind's counter was used before on this endpoint (a replayed bind)");
        return;
    }
    pthread_mutex_lock(&ctx->lock);
    stria__ucx_link_t *link = link_find_locked(ctx, c->job_id, c->ring_id);
    pthread_mutex_unlock(&ctx->lock);
    if (link != NULL) {
        bind_to(ctx, e, c, link);
        return;
    }
    stria__parked_t *p = e->n_parked < ctx->max_pending_per_source ? calloc(1, sizeof(*p)) : NULL;
    if (p == NULL) {
        answer(e, c, NULL, STRIA_ERR_BUSY, "too many binds wait for their ring here");
        return;
    }
    p->bind = *c;
    p->at = stria_time_now();
    stria__list_push(&e->parked, &p->node);
    e->n_parked++;
}

void stria__ucx_binds_claim(stria_ucx_ctx_t *ctx, stria__ucx_link_t *link)
{
    for (stria__node_t *x = ctx->eps.next; x != &ctx->eps; x = x->next) {
        stria__ucx_ep_t *e = STRIA__OF(x, stria__ucx_ep_t, node);
        if (e->outgoing || e->state != STRIA__EP_READY)
            continue;
        for (stria__node_t *n = e->parked.next; n != &e->parked;) {
            stria__parked_t *p = STRIA__OF(n, stria__parked_t, node);
            n = n->next;
            if (p->bind.job_id != link->job_id || p->bind.ring_id != link->ring_id)
                continue;
            stria__list_del(&p->node);
            e->n_parked--;
            bind_to(ctx, e, &p->bind, link);
            free(p);
        }
    }
}

double stria__ucx_binds_expire(stria_ucx_ctx_t *ctx, double now)
{
    double next = 0;
    for (stria__node_t *x = ctx->eps.next; x != &ctx->eps; x = x->next) {
        stria__ucx_ep_t *e = STRIA__OF(x, stria__ucx_ep_t, node);
        for (stria__node_t *n = e->parked.next; n != &e->parked;) {
            stria__parked_t *p = STRIA__OF(n, stria__parked_t, node);
            n = n->next;
            double due = p->at + ctx->handshake_timeout_s;
            if (now < due) {
                next = next == 0 || due < next ? due : next;
                continue;
            }
            char text[200];
            snprintf(text, sizeof(text), "no ring %llu of job %llu here within %.3g s",
                     (unsigned long long)p->bind.ring_id, (unsigned long long)p->bind.job_id,
                     ctx->handshake_timeout_s);
            if (e->state == STRIA__EP_READY)
                answer(e, &p->bind, NULL, STRIA_ERR_CLOSED, text);
            stria__list_del(&p->node);
            e->n_parked--;
            free(p);
        }
    }
    return next;
}
