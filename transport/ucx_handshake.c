/*
 * The handshakes of the UCX ring link (progress thread): accepting
 * connections (with a cap per source address and a deadline for the
 * handshake), the acceptor's side (HELLO, and with a ring key CHALLENGE and
 * PROOF, then ACK: the connection becomes the link's predecessor) and the
 * connector's (the successor's CHALLENGE and ACK).
 *
 *   connector (rank r)                     acceptor (rank r + 1)
 *   HELLO  job, ring, r, size, nonce_c  ->
 *                                       <-  CHALLENGE nonce_s, MAC_a(key, ..., nonce_c, nonce_s)
 *   PROOF  MAC_c(key, ..., nonce_c, nonce_s) ->
 *                                       <-  ACK slot
 *
 * Without a ring key the acceptor answers the HELLO with the ACK at once.
 * A connection is bound to its link (link->in_conn) only when the ACK goes
 * out; data is taken from that endpoint only (ucx_progress.c).
 */
#include "ucx_int.h"

#include <netinet/in.h>
#include <stdio.h>
#include <string.h>

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
    stria__ucx_ctrl_send(conn->ep, &ack, &conn->ctrl_pending);
}

/* Refuses a connection: the reason in an ACK, then the endpoint closed. */
static void stria__conn_refuse(stria_ucx_ctx_t *ctx, stria__ucx_conn_t *conn,
                               const stria__ucx_link_t *link, stria_status_t status,
                               const char *text)
{
    stria__conn_ack(conn, link, status, text);
    conn->closing = true;
    stria__ucx_ep_close(ctx, conn->ep, false, NULL, conn);
}

/* The live link of (job, ring), or NULL (lock held). */
static stria__ucx_link_t *stria__link_find_locked(stria_ucx_ctx_t *ctx, uint64_t job_id,
                                                  uint64_t ring_id)
{
    for (stria__node_t *n = ctx->links.next; n != &ctx->links; n = n->next) {
        stria__ucx_link_t *l = STRIA__OF(n, stria__ucx_link_t, ctx_node);
        if (l->job_id == job_id && l->ring_id == ring_id && !l->want_destroy)
            return l;
    }
    return NULL;
}

/* Whether the connection may become the link's predecessor now (lock
 * held); if not, the status and text of the refusal. A wrong rank or size
 * fails the link only once the connection proved the key (or when the link
 * has none): an unproven stranger must not break a ring. */
static stria_status_t stria__claim_check_locked(stria__ucx_link_t *link, stria__ucx_conn_t *conn,
                                                bool proven, char *text, size_t len)
{
    const stria__ctrl_t *h = &conn->hello;
    int prev = stria_link_prev(&link->base);
    if (link->failed) {
        snprintf(text, len, "rank %d of ring %llu (job %llu) has failed: %.200s", link->base.rank,
                 (unsigned long long)link->ring_id, (unsigned long long)link->job_id,
                 link->fail_msg);
        return STRIA_ERR_CLOSED;
    }
    if (link->hb.nb[STRIA__FROM_PREV].up) {
        snprintf(text, len, "rank %d of ring %llu (job %llu) already has its predecessor connected",
                 link->base.rank, (unsigned long long)link->ring_id,
                 (unsigned long long)link->job_id);
        return STRIA_ERR_BUSY;
    }
    if (h->size != link->base.size || h->rank != prev) {
        snprintf(text, len,
                 "rank %d of %d (ring %llu, job %llu) expects its predecessor to be rank %d of "
                 "%d, got rank %d of %d",
                 link->base.rank, link->base.size, (unsigned long long)link->ring_id,
                 (unsigned long long)link->job_id, prev, link->base.size, (int)h->rank,
                 (int)h->size);
        if (proven)
            stria__ucx_link_fail_locked(
                link, STRIA_ERR_PROTOCOL, (int)h->rank, STRIA__NOTIFY_NEXT,
                "predecessor at %s announced rank %d of %d, expected rank %d of %d", conn->peer,
                (int)h->rank, (int)h->size, prev, link->base.size);
        return STRIA_ERR_PROTOCOL;
    }
    return STRIA_OK;
}

/* Binds the connection to the link as its predecessor and acknowledges. */
static void stria__conn_bind(stria_ucx_ctx_t *ctx, stria__ucx_conn_t *conn, stria__ucx_link_t *link)
{
    pthread_mutex_lock(&ctx->lock);
    conn->link = link;
    link->in_conn = conn;
    stria__ucx_link_up_locked(link, STRIA__FROM_PREV);
    pthread_cond_broadcast(&ctx->cond);
    pthread_mutex_unlock(&ctx->lock);
    stria_log_debug("ucx link rank %d: predecessor rank %d connected from %s%s", link->base.rank,
                    (int)conn->hello.rank, conn->peer, link->has_key ? " (key proven)" : "");
    stria__conn_ack(conn, link, STRIA_OK, NULL);
}

/* Gives a connection whose HELLO arrived to the link of its ring, if that
 * link exists yet (else it stays parked until the link connects here); with
 * a ring key it is challenged first. */
void stria__ucx_conn_try_claim(stria_ucx_ctx_t *ctx, stria__ucx_conn_t *conn)
{
    if (conn->link != NULL || !conn->have_hello || conn->closing || conn->challenged)
        return;
    char text[STRIA__UCX_TEXT_MAX];
    stria__ctrl_t ch;

    pthread_mutex_lock(&ctx->lock);
    stria__ucx_link_t *link = stria__link_find_locked(ctx, conn->hello.job_id, conn->hello.ring_id);
    if (link == NULL) {
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    stria_status_t status =
        stria__claim_check_locked(link, conn, !link->has_key, text, sizeof(text));
    bool keyed = link->has_key;
    if (status == STRIA_OK && keyed) {
        stria__ucx_link_ctrl_init(link, &ch, STRIA__CTRL_CHALLENGE);
        if (stria_auth_random(conn->nonce_s, sizeof(conn->nonce_s)) != STRIA_OK) {
            status = STRIA_ERR_INTERNAL;
            snprintf(text, sizeof(text), "no random bytes for the handshake");
        }
        memcpy(ch.nonce, conn->nonce_s, sizeof(ch.nonce));
        stria__ucx_ring_mac(link->key, true, link->job_id, link->ring_id, conn->hello.rank,
                            link->base.size, conn->hello.nonce, conn->nonce_s, ch.mac);
    }
    pthread_mutex_unlock(&ctx->lock);
    if (status != STRIA_OK) {
        stria__conn_refuse(ctx, conn, link, status, text);
    } else if (keyed) {
        conn->challenged = true;
        stria__ucx_ctrl_send(conn->ep, &ch, &conn->ctrl_pending);
    } else {
        stria__conn_bind(ctx, conn, link);
    }
}

void stria__ucx_handle_proof(stria_ucx_ctx_t *ctx, stria__ucx_conn_t *conn, const stria__ctrl_t *c)
{
    char text[STRIA__UCX_TEXT_MAX];
    uint8_t want[STRIA_AUTH_MAC_BYTES];
    if (!conn->challenged || conn->link != NULL || conn->closing) {
        stria_log_warn("ucx link: unexpected handshake proof from %s; closing it", conn->peer);
        pthread_mutex_lock(&ctx->lock);
        ctx->stats.handshakes_refused++;
        pthread_mutex_unlock(&ctx->lock);
        stria__conn_refuse(ctx, conn, NULL, STRIA_ERR_PROTOCOL, "unexpected proof");
        return;
    }
    pthread_mutex_lock(&ctx->lock);
    stria__ucx_link_t *link = stria__link_find_locked(ctx, conn->hello.job_id, conn->hello.ring_id);
    stria_status_t status = STRIA_ERR_CLOSED;
    snprintf(text, sizeof(text), "ring %llu of job %llu is gone here",
             (unsigned long long)conn->hello.ring_id, (unsigned long long)conn->hello.job_id);
    if (link != NULL) {
        stria__ucx_ring_mac(link->key, false, link->job_id, link->ring_id, conn->hello.rank,
                            link->base.size, conn->hello.nonce, conn->nonce_s, want);
        bool proven = c->job_id == link->job_id && c->ring_id == link->ring_id &&
                      stria_auth_equal(want, c->mac, sizeof(want));
        if (!proven) {
            status = STRIA_ERR_AUTH;
            snprintf(text, sizeof(text), "the proof of the ring key is wrong");
            ctx->stats.handshakes_refused++;
        } else {
            status = stria__claim_check_locked(link, conn, true, text, sizeof(text));
        }
    }
    pthread_mutex_unlock(&ctx->lock);
    if (status == STRIA_ERR_AUTH)
        stria_log_warn("ucx link: %s (job %llu ring %llu) proved a wrong ring key; refused",
                       conn->peer, (unsigned long long)conn->hello.job_id,
                       (unsigned long long)conn->hello.ring_id);
    if (status != STRIA_OK)
        stria__conn_refuse(ctx, conn, link, status, text);
    else
        stria__conn_bind(ctx, conn, link);
}

stria__ucx_link_t *stria__ucx_link_by_out_ep(stria_ucx_ctx_t *ctx, ucp_ep_h ep)
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

stria__ucx_conn_t *stria__ucx_conn_by_ep(stria_ucx_ctx_t *ctx, ucp_ep_h ep)
{
    for (stria__node_t *n = ctx->conns.next; n != &ctx->conns; n = n->next) {
        stria__ucx_conn_t *c = STRIA__OF(n, stria__ucx_conn_t, node);
        if (c->ep == ep && !c->closing)
            return c;
    }
    return NULL;
}

/* The address of a socket address without its port, for counting per
 * source. */
static void stria__source_of(const struct sockaddr_storage *in, struct sockaddr_storage *out)
{
    memset(out, 0, sizeof(*out));
    out->ss_family = in->ss_family;
    if (in->ss_family == AF_INET)
        ((struct sockaddr_in *)(void *)out)->sin_addr =
            ((const struct sockaddr_in *)(const void *)in)->sin_addr;
    else if (in->ss_family == AF_INET6)
        ((struct sockaddr_in6 *)(void *)out)->sin6_addr =
            ((const struct sockaddr_in6 *)(const void *)in)->sin6_addr;
}

/* Connections of a source that have not completed a handshake. */
static int stria__pending_of(stria_ucx_ctx_t *ctx, const struct sockaddr_storage *source)
{
    int n = 0;
    for (stria__node_t *x = ctx->conns.next; x != &ctx->conns; x = x->next) {
        stria__ucx_conn_t *c = STRIA__OF(x, stria__ucx_conn_t, node);
        n += c->link == NULL && !c->closing && memcmp(&c->source, source, sizeof(*source)) == 0;
    }
    return n;
}

void stria__ucx_handle_conn_req(stria_ucx_ctx_t *ctx, ucp_conn_request_h req)
{
    char peer[80] = "unknown peer";
    struct sockaddr_storage source;
    ucp_conn_request_attr_t attr;
    memset(&attr, 0, sizeof(attr));
    memset(&source, 0, sizeof(source));
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ucp_conn_request_query(req, &attr) == UCS_OK) {
        stria__ucx_addr_str((const struct sockaddr *)&attr.client_address, peer, sizeof(peer));
        stria__source_of(&attr.client_address, &source);
    }

    bool stopping;
    pthread_mutex_lock(&ctx->lock);
    stopping = ctx->stop;
    pthread_mutex_unlock(&ctx->lock);
    const char *why = stopping                               ? "shutting down"
                      : ctx->n_conns >= STRIA__UCX_MAX_CONNS ? "too many connections"
                      : stria__pending_of(ctx, &source) >= ctx->max_pending_per_source
                          ? "too many connections from it without a completed handshake"
                          : NULL;
    if (ctx->listener == NULL) /* destroyed with its pending requests (cannot happen) */
        return;
    if (stopping && ctx->n_held < STRIA__UCX_HELD_REQUESTS) {
        /* answered right before the listener goes (stria_ucx_ctx_destroy) */
        ctx->held[ctx->n_held++] = req;
        return;
    }
    stria__ucx_conn_t *conn = why == NULL ? calloc(1, sizeof(*conn)) : NULL;
    if (why == NULL && conn == NULL)
        why = "out of memory";
    if (why != NULL) {
        stria_log_warn("ucx link: rejecting a connection from %s (%s)", peer, why);
        if (!stopping) {
            pthread_mutex_lock(&ctx->lock);
            ctx->stats.connections_rejected++;
            pthread_mutex_unlock(&ctx->lock);
        }
        ucp_listener_reject(ctx->listener, req);
        return;
    }
    conn->ctx = ctx;
    conn->source = source;
    conn->accepted_at = stria_time_now();
    snprintf(conn->peer, sizeof(conn->peer), "%s", peer);
    ucp_ep_params_t ep_params;
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                           UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.conn_request = req;
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = stria__ucx_in_err_cb;
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

double stria__ucx_conns_sweep(stria_ucx_ctx_t *ctx, double now)
{
    if (now < ctx->next_sweep)
        return ctx->next_sweep;
    ctx->next_sweep = now + 0.1;
    for (stria__node_t *x = ctx->conns.next; x != &ctx->conns;) {
        stria__ucx_conn_t *c = STRIA__OF(x, stria__ucx_conn_t, node);
        x = x->next;
        if (c->link != NULL || c->closing || now - c->accepted_at < ctx->handshake_timeout_s)
            continue;
        stria_log_warn("ucx link: closing the connection from %s: no completed handshake within "
                       "%.3g s",
                       c->peer, ctx->handshake_timeout_s);
        pthread_mutex_lock(&ctx->lock);
        ctx->stats.handshakes_timed_out++;
        pthread_mutex_unlock(&ctx->lock);
        c->closing = true;
        stria__ucx_ep_close(ctx, c->ep, true, NULL, c);
    }
    return stria__list_empty(&ctx->conns) ? 0 : ctx->next_sweep;
}

/* ---- the connector's side ------------------------------------------------------ */

void stria__ucx_handle_challenge(stria_ucx_ctx_t *ctx, ucp_ep_h ep, const stria__ctrl_t *c)
{
    stria__ucx_link_t *link = stria__ucx_link_by_out_ep(ctx, ep);
    uint8_t want[STRIA_AUTH_MAC_BYTES];
    stria__ctrl_t proof;
    if (link == NULL)
        return;
    int next = stria_link_next(&link->base);
    pthread_mutex_lock(&ctx->lock);
    if (link->hb.nb[STRIA__FROM_NEXT].up || link->failed || link->next_proven) {
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    if (!link->has_key) {
        stria__ucx_link_fail_locked(link, STRIA_ERR_AUTH, next, 0,
                                    "successor at %s asks for a ring key this link was not given",
                                    link->next_desc);
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    stria__ucx_ring_mac(link->key, true, link->job_id, link->ring_id, link->base.rank,
                        link->base.size, link->nonce_c, c->nonce, want);
    if (c->job_id != link->job_id || c->ring_id != link->ring_id || c->rank != next ||
        c->size != link->base.size || !stria_auth_equal(want, c->mac, sizeof(want))) {
        ctx->stats.handshakes_refused++;
        stria__ucx_link_fail_locked(link, STRIA_ERR_AUTH, next, 0,
                                    "successor at %s did not prove the ring key of job %llu",
                                    link->next_desc, (unsigned long long)link->job_id);
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    link->next_proven = true;
    stria__ucx_link_ctrl_init(link, &proof, STRIA__CTRL_PROOF);
    memcpy(proof.nonce, link->nonce_c, sizeof(proof.nonce));
    stria__ucx_ring_mac(link->key, false, link->job_id, link->ring_id, link->base.rank,
                        link->base.size, link->nonce_c, c->nonce, proof.mac);
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_ctrl_send(link->out_ep, &proof, &link->ctrl_pending);
}

void stria__ucx_handle_ack(stria_ucx_ctx_t *ctx, ucp_ep_h ep, const stria__ctrl_t *c)
{
    stria__ucx_link_t *link = stria__ucx_link_by_out_ep(ctx, ep);
    if (link == NULL) {
        stria_log_debug("ucx link: acknowledgement on an unknown endpoint");
        return;
    }
    int next = stria_link_next(&link->base);
    pthread_mutex_lock(&ctx->lock);
    if (link->hb.nb[STRIA__FROM_NEXT].up || link->failed) {
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    if (c->job_id != link->job_id || c->ring_id != link->ring_id) {
        stria__ucx_link_fail_locked(
            link, STRIA_ERR_PROTOCOL, next, 0,
            "successor at %s acknowledged ring %llu of job %llu, expected ring "
            "%llu of job %llu",
            link->next_desc, (unsigned long long)c->ring_id, (unsigned long long)c->job_id,
            (unsigned long long)link->ring_id, (unsigned long long)link->job_id);
    } else if (c->status != STRIA_OK) {
        stria_status_t st = c->status == STRIA_ERR_BUSY || c->status == STRIA_ERR_CLOSED ||
                                    c->status == STRIA_ERR_AUTH
                                ? (stria_status_t)c->status
                                : STRIA_ERR_PROTOCOL;
        stria__ucx_link_fail_locked(link, st, next, 0, "successor at %s refused the handshake: %s",
                                    link->next_desc, c->text);
    } else if (link->has_key && !link->next_proven) {
        /* Our data goes only to a successor that proved the key. */
        ctx->stats.handshakes_refused++;
        stria__ucx_link_fail_locked(link, STRIA_ERR_AUTH, next, 0,
                                    "successor at %s accepted without proving the ring key",
                                    link->next_desc);
    } else if (c->rank != next || c->size != link->base.size) {
        stria__ucx_link_fail_locked(link, STRIA_ERR_PROTOCOL, next, 0,
                                    "successor at %s is rank %d of %d, expected rank %d of %d",
                                    link->next_desc, (int)c->rank, (int)c->size, next,
                                    link->base.size);
    } else if (c->slot == 0 || c->slot >= STRIA__UCX_SLOTS) {
        stria__ucx_link_fail_locked(link, STRIA_ERR_PROTOCOL, next, 0,
                                    "successor at %s gave an invalid slot %u", link->next_desc,
                                    c->slot);
    } else {
        link->out_slot = c->slot;
        stria__ucx_link_up_locked(link, STRIA__FROM_NEXT);
        pthread_cond_broadcast(&ctx->cond);
    }
    bool ready = link->hb.nb[STRIA__FROM_NEXT].up && !link->failed;
    pthread_mutex_unlock(&ctx->lock);
    if (ready && stria_log_level() >= STRIA_LOG_DEBUG)
        ucp_ep_print_info(link->out_ep, stderr); /* the lanes UCX chose */
}
