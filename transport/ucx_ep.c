/*
 * The endpoint pool of a UCX context (progress thread): one UCX endpoint per
 * successor listener address, made on a link's first need and kept for the
 * links after it, and the endpoints predecessors made to this context's
 * listener, accepted. Each runs one handshake when it is made:
 *
 *   connector                                  acceptor
 *   EP_HELLO  nonce_c, incarnation, port  ->
 *                                          <-  EP_WELCOME nonce_s, incarnation,
 *                                              MAC(endpoint key, nonces, incarnations)
 *   EP_PROOF  MAC(endpoint key, ...)      ->
 *                                          <-  EP_READY
 *
 * Every message carries the link protocol version: a peer of another one is
 * refused naming both. Without an endpoint key the MACs are left out (each
 * bind still proves its ring key). Binds go only on a READY endpoint.
 *
 * An endpoint is closed only when it broke (UCX reported it failed; its
 * handshake was refused: version, endpoint key, a message out of turn; its
 * peer restarted; a failed link's transfer had to be reclaimed from it, see
 * ucx_state.c), when it was dropped (stria_ucx_ctx_drop_endpoints(): once no
 * link is bound), when an accepted one was not trusted within the handshake
 * timeout, when one being made is no longer wanted, or with its context. A
 * broken endpoint is closed STRIA__UCX_SETTLE_S later (notices already on
 * their way are still read), by force.
 */
#include "ucx_int.h"

#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ---- the table ---------------------------------------------------------------------- */

stria__ucx_ep_t *stria__ucx_ep_find_locked(stria_ucx_ctx_t *ctx, ucp_ep_h ep)
{
    if (ep == NULL)
        return NULL;
    for (stria__node_t *n = ctx->eps.next; n != &ctx->eps; n = n->next) {
        stria__ucx_ep_t *e = STRIA__OF(n, stria__ucx_ep_t, node);
        if (e->ep == ep)
            return e;
    }
    return NULL;
}

stria__ucx_ep_t *stria__ucx_ep_find(stria_ucx_ctx_t *ctx, ucp_ep_h ep)
{
    pthread_mutex_lock(&ctx->lock);
    stria__ucx_ep_t *e = stria__ucx_ep_find_locked(ctx, ep);
    pthread_mutex_unlock(&ctx->lock);
    return e;
}

/* Whether two socket addresses are the same address and port. */
static bool same_addr(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family != b->ss_family)
        return false;
    if (a->ss_family == AF_INET) {
        const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
        return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
    }
    if (a->ss_family == AF_INET6) {
        const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
        return x->sin6_port == y->sin6_port &&
               memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(x->sin6_addr)) == 0;
    }
    return false;
}

/* An endpoint record, not yet in the table. */
static stria__ucx_ep_t *ep_new(stria_ucx_ctx_t *ctx, bool outgoing)
{
    stria__ucx_ep_t *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return NULL;
    e->ctx = ctx;
    e->outgoing = outgoing;
    e->state = STRIA__EP_HANDSHAKE;
    e->made_at = stria_time_now();
    e->next_counter = 1;
    stria__list_init(&e->parked);
    return e;
}

static void ep_insert(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e)
{
    pthread_mutex_lock(&ctx->lock);
    stria__list_push(&ctx->eps, &e->node);
    pthread_mutex_unlock(&ctx->lock);
}

/* The error handler of every endpoint: recorded, handled after progress. */
static void err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    stria__ucx_ep_t *e = arg;
    stria__event_t *ev = calloc(1, sizeof(*ev));
    if (ev == NULL)
        return;
    ev->type = STRIA__EV_EP_ERR;
    ev->ep = ep;
    ev->obj = e;
    ev->status = status;
    stria__ucx_event_push(e->ctx, ev);
}

/* ---- closing -------------------------------------------------------------------------- */

/* An endpoint close in flight. */
typedef struct {
    stria__ucx_ep_t *e;
} closing_t;

static void close_done(stria__ucx_ep_t *e)
{
    e->ctx->closing--;
    e->closing--;
}

static void close_cb(void *request, ucs_status_t status, void *user_data)
{
    closing_t *cl = user_data;
    (void)status;
    close_done(cl->e);
    free(cl);
    ucp_request_free(request);
}

/* Starts closing the UCX endpoint (by force: a peer that does not answer
 * must not hold it; both sides are in peer error mode). */
static void ep_close(stria__ucx_ep_t *e)
{
    stria_ucx_ctx_t *ctx = e->ctx;
    pthread_mutex_lock(&ctx->lock);
    ucp_ep_h ep = e->ep;
    if (!e->gone && e->ready_at > 0)
        ctx->stats.endpoints_dropped++;
    e->gone = true;
    e->ep = NULL;
    e->state = STRIA__EP_CLOSING;
    pthread_mutex_unlock(&ctx->lock);
    if (ep == NULL)
        return;
    stria_log_debug("ucx link: closing the endpoint %s %s", e->outgoing ? "to" : "from", e->peer);
    closing_t *cl = malloc(sizeof(*cl));
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    if (cl != NULL) {
        cl->e = e;
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = close_cb;
        param.user_data = cl;
    }
    ctx->closing++;
    e->closing++;
    void *r = ucp_ep_close_nbx(ep, &param);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        free(cl);
        close_done(e);
    } else if (cl == NULL) {
        /* Without a record nobody would be told; wait here (rare: no memory). */
        while (ucp_request_check_status(r) == UCS_INPROGRESS)
            ucp_worker_progress(ctx->worker);
        ucp_request_free(r);
        close_done(e);
    }
}

void stria__ucx_ep_break_locked(stria__ucx_ep_t *e, stria_status_t st, double delay,
                                const char *fmt, ...)
{
    if (e->state == STRIA__EP_BROKEN || e->state == STRIA__EP_CLOSING)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->why, sizeof(e->why), fmt, ap);
    va_end(ap);
    e->why_status = st;
    e->state = STRIA__EP_BROKEN;
    if (!e->gone && e->ready_at > 0)
        e->ctx->stats.endpoints_dropped++; /* out of the pool from now on */
    e->gone = true;
    e->close_at = stria_time_now() + delay;
    if (e->close_at < e->ctx->next_sweep)
        e->ctx->next_sweep = e->close_at; /* the progress thread's: it breaks endpoints */
    pthread_cond_broadcast(&e->ctx->cond);
}

/* Marks the endpoint broken for st and `text`, which the peer is told in a
 * `type` message (EP_WELCOME or EP_READY) first. */
static void refuse(stria__ucx_ep_t *e, uint16_t type, stria_status_t st, const char *text)
{
    stria__ctrl_t c;
    memset(&c, 0, sizeof(c));
    c.type = type;
    c.status = st;
    snprintf(c.text, sizeof(c.text), "%s", text);
    stria__ucx_ctrl_send(e->ep, &c, &e->ctrl_pending);
    pthread_mutex_lock(&e->ctx->lock);
    stria__ucx_ep_break_locked(e, st, STRIA__UCX_SETTLE_S, "refused: %s", text);
    pthread_mutex_unlock(&e->ctx->lock);
}

/* Breaks the endpoint for st and the message (no word to the peer). */
static void fail(stria__ucx_ep_t *e, stria_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fail(stria__ucx_ep_t *e, stria_status_t st, const char *fmt, ...)
{
    char why[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&e->ctx->lock);
    stria__ucx_ep_break_locked(e, st, STRIA__UCX_SETTLE_S, "%s", why);
    pthread_mutex_unlock(&e->ctx->lock);
}

static void count(stria_ucx_ctx_t *ctx, uint64_t *counter)
{
    pthread_mutex_lock(&ctx->lock);
    (*counter)++;
    pthread_mutex_unlock(&ctx->lock);
}

/* ---- outgoing endpoints ----------------------------------------------------------------- */

/* Creates the UCX endpoint to addr and sends the EP_HELLO. */
static stria_status_t ep_connect(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e)
{
    ucp_ep_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                   UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = (const struct sockaddr *)&e->addr;
    p.sockaddr.addrlen = e->addrlen;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = err_cb;
    p.err_handler.arg = e;
    if (stria_auth_random(e->nonce_c, sizeof(e->nonce_c)) != STRIA_OK)
        return STRIA_ERR_INTERNAL;
    ucp_ep_h ep = NULL;
    ucs_status_t s = ucp_ep_create(ctx->worker, &p, &ep);
    if (s != UCS_OK)
        return stria_error_set(stria__ucx_status(s), "cannot create an endpoint to %s: %s", e->peer,
                               ucs_status_string(s));
    e->ep = ep;
    stria__ctrl_t hello;
    memset(&hello, 0, sizeof(hello));
    hello.type = STRIA__CTRL_EP_HELLO;
    hello.flags = ctx->has_ep_key ? STRIA__CTRL_FLAG_KEYED : 0;
    hello.slot = ctx->port;
    hello.incarnation = ctx->incarnation;
    memcpy(hello.nonce, e->nonce_c, sizeof(hello.nonce));
    stria__ucx_ctrl_send(ep, &hello, &e->ctrl_pending);
    return STRIA_OK;
}

stria__ucx_ep_t *stria__ucx_ep_get(stria_ucx_ctx_t *ctx, const struct sockaddr_storage *addr,
                                   socklen_t addrlen, const char *desc)
{
    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *n = ctx->eps.next; n != &ctx->eps; n = n->next) {
        stria__ucx_ep_t *e = STRIA__OF(n, stria__ucx_ep_t, node);
        if (e->outgoing && !e->drop && same_addr(&e->addr, addr) &&
            (e->state == STRIA__EP_HANDSHAKE || e->state == STRIA__EP_READY)) {
            e->refs++;
            pthread_mutex_unlock(&ctx->lock);
            return e;
        }
    }
    pthread_mutex_unlock(&ctx->lock);
    stria__ucx_ep_t *e = ep_new(ctx, true);
    if (e == NULL) {
        stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for an endpoint");
        return NULL;
    }
    memcpy(&e->addr, addr, sizeof(e->addr));
    e->addrlen = addrlen;
    snprintf(e->peer, sizeof(e->peer), "%s", desc);
    if (ep_connect(ctx, e) != STRIA_OK) {
        free(e);
        return NULL;
    }
    e->refs = 1;
    ep_insert(ctx, e);
    stria_log_debug("ucx link: making an endpoint to %s", e->peer);
    return e;
}

void stria__ucx_ep_hold(stria__ucx_ep_t *e)
{
    e->refs++;
}

void stria__ucx_ep_release(stria__ucx_ep_t *e)
{
    if (--e->refs > 0 || e->state == STRIA__EP_CLOSING)
        return;
    /* Nobody waits on a handshake any more, or a dropped endpoint's last
     * link is gone: close it. A broken one closes at its time (sweep). */
    pthread_mutex_lock(&e->ctx->lock);
    bool close = e->links == 0 && ((e->outgoing && e->state == STRIA__EP_HANDSHAKE) || e->drop);
    pthread_mutex_unlock(&e->ctx->lock);
    if (close)
        ep_close(e);
}

/* The connector's side: the acceptor's EP_WELCOME and EP_READY. */
static void handle_welcome(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c)
{
    if (e->state != STRIA__EP_HANDSHAKE || e->hello_seen) {
        fail(e, STRIA_ERR_PROTOCOL, "sent a second endpoint welcome");
        return;
    }
    e->hello_seen = true;
    if (c->status != STRIA_OK) {
        fail(e, c->status == STRIA_ERR_AUTH ? STRIA_ERR_AUTH : STRIA_ERR_PROTOCOL,
             "refused the endpoint: %s", c->text);
        return;
    }
    memcpy(e->nonce_s, c->nonce, sizeof(e->nonce_s));
    pthread_mutex_lock(&ctx->lock);
    e->peer_incarnation = c->incarnation;
    pthread_mutex_unlock(&ctx->lock);
    stria__ctrl_t proof;
    memset(&proof, 0, sizeof(proof));
    proof.type = STRIA__CTRL_EP_PROOF;
    if (ctx->has_ep_key) {
        uint8_t want[STRIA_AUTH_MAC_BYTES];
        stria__ucx_ep_mac(ctx->ep_key, true, e->nonce_c, e->nonce_s, ctx->incarnation,
                          c->incarnation, want);
        if (!(c->flags & STRIA__CTRL_FLAG_KEYED) || !stria_auth_equal(want, c->mac, sizeof(want))) {
            count(ctx, &ctx->stats.handshakes_refused);
            stria_log_warn("ucx link: the endpoint at %s did not prove the endpoint key; closed",
                           e->peer);
            fail(e, STRIA_ERR_AUTH, "did not prove the endpoint key (the workers' credential)");
            return;
        }
        proof.flags = STRIA__CTRL_FLAG_KEYED;
        stria__ucx_ep_mac(ctx->ep_key, false, e->nonce_c, e->nonce_s, ctx->incarnation,
                          c->incarnation, proof.mac);
    }
    stria__ucx_ctrl_send(e->ep, &proof, &e->ctrl_pending);
}

static void handle_ready(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c)
{
    if (e->state != STRIA__EP_HANDSHAKE || !e->hello_seen) {
        fail(e, STRIA_ERR_PROTOCOL, "sent an endpoint ready out of turn");
        return;
    }
    if (c->status != STRIA_OK) {
        fail(e, c->status == STRIA_ERR_AUTH ? STRIA_ERR_AUTH : STRIA_ERR_PROTOCOL,
             "refused the endpoint: %s", c->text);
        return;
    }
    pthread_mutex_lock(&ctx->lock);
    e->state = STRIA__EP_READY;
    e->ready_at = stria_time_now();
    e->keyed = ctx->has_ep_key;
    ctx->stats.endpoints_made++;
    pthread_cond_broadcast(&ctx->cond);
    pthread_mutex_unlock(&ctx->lock);
    stria_log_debug("ucx link: endpoint to %s ready%s", e->peer,
                    e->keyed ? " (endpoint key proven)" : "");
    if (stria_log_level() >= STRIA_LOG_DEBUG)
        ucp_ep_print_info(e->ep, stderr); /* the lanes UCX chose */
}

/* ---- accepted endpoints --------------------------------------------------------------------- */

/* The address of a socket address without its port, for counting per
 * source. */
static void source_of(const struct sockaddr_storage *in, struct sockaddr_storage *out)
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

/* Accepted endpoints of a source not trusted yet. */
static int pending_of(stria_ucx_ctx_t *ctx, const struct sockaddr_storage *source)
{
    int n = 0;
    for (stria__node_t *x = ctx->eps.next; x != &ctx->eps; x = x->next) {
        stria__ucx_ep_t *e = STRIA__OF(x, stria__ucx_ep_t, node);
        n += !e->outgoing && !e->trusted && e->state != STRIA__EP_CLOSING &&
             same_addr(&e->addr, source);
    }
    return n;
}

void stria__ucx_ep_accept(stria_ucx_ctx_t *ctx, ucp_conn_request_h req)
{
    char peer[80] = "unknown peer";
    struct sockaddr_storage source;
    ucp_conn_request_attr_t attr;
    memset(&attr, 0, sizeof(attr));
    memset(&source, 0, sizeof(source));
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ucp_conn_request_query(req, &attr) == UCS_OK) {
        stria__ucx_addr_str((const struct sockaddr *)&attr.client_address, peer, sizeof(peer));
        source_of(&attr.client_address, &source);
    }

    pthread_mutex_lock(&ctx->lock);
    bool stopping = ctx->stop;
    const char *why = stopping                                  ? "shutting down"
                      : ctx->n_accepted >= STRIA__UCX_MAX_CONNS ? "too many connections"
                      : pending_of(ctx, &source) >= ctx->max_pending_per_source
                          ? "too many connections from it without a completed handshake"
                          : NULL;
    pthread_mutex_unlock(&ctx->lock);
    if (ctx->listener == NULL) /* destroyed with its pending requests (cannot happen) */
        return;
    if (stopping && ctx->n_held < STRIA__UCX_HELD_REQUESTS) {
        /* answered right before the listener goes (stria_ucx_ctx_destroy) */
        ctx->held[ctx->n_held++] = req;
        return;
    }
    stria__ucx_ep_t *e = why == NULL ? ep_new(ctx, false) : NULL;
    if (why == NULL && e == NULL)
        why = "out of memory";
    if (why != NULL) {
        stria_log_warn("ucx link: rejecting a connection from %s (%s)", peer, why);
        if (!stopping)
            count(ctx, &ctx->stats.connections_rejected);
        ucp_listener_reject(ctx->listener, req);
        return;
    }
    e->addr = source;
    snprintf(e->peer, sizeof(e->peer), "%s", peer);
    ucp_ep_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.conn_request = req;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = err_cb;
    p.err_handler.arg = e;
    ucp_ep_h ep = NULL;
    ucs_status_t s = ucp_ep_create(ctx->worker, &p, &ep);
    if (s != UCS_OK) {
        stria_log_warn("ucx link: cannot accept a connection from %s: %s", peer,
                       ucs_status_string(s));
        free(e);
        return;
    }
    e->ep = ep;
    ctx->n_accepted++;
    ep_insert(ctx, e);
    stria_log_debug("ucx link: accepted a connection from %s", peer);
}

/* A restarted peer connects again with a new incarnation: its endpoints
 * of before (same source address and listening port) are stale. */
static void drop_stale(stria_ucx_ctx_t *ctx, const stria__ucx_ep_t *fresh)
{
    pthread_mutex_lock(&ctx->lock);
    for (stria__node_t *x = ctx->eps.next; x != &ctx->eps; x = x->next) {
        stria__ucx_ep_t *e = STRIA__OF(x, stria__ucx_ep_t, node);
        if (e == fresh || e->outgoing || !e->hello_seen || e->peer_port != fresh->peer_port ||
            e->peer_incarnation == fresh->peer_incarnation || !same_addr(&e->addr, &fresh->addr) ||
            (e->state != STRIA__EP_HANDSHAKE && e->state != STRIA__EP_READY))
            continue;
        stria_log_info("ucx link: the peer at %s restarted (it connected again from %s as a "
                       "new process); its endpoint of before is closed",
                       e->peer, fresh->peer);
        ctx->stats.endpoints_replaced++;
        stria__ucx_ep_break_locked(e, STRIA_ERR_PEER, 0, "restarted (a new process connected)");
    }
    pthread_mutex_unlock(&ctx->lock);
}

/* The acceptor's side: EP_HELLO, then EP_PROOF. */
static void handle_hello(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c)
{
    if (e->hello_seen || e->state != STRIA__EP_HANDSHAKE) {
        fail(e, STRIA_ERR_PROTOCOL, "sent a second endpoint hello");
        return;
    }
    memcpy(e->nonce_c, c->nonce, sizeof(e->nonce_c));
    pthread_mutex_lock(&ctx->lock);
    e->hello_seen = true;
    e->peer_port = (uint16_t)c->slot;
    e->peer_incarnation = c->incarnation;
    size_t at = strnlen(e->peer, 80);
    snprintf(e->peer + at, sizeof(e->peer) - at, " (listening on port %u)", (unsigned)e->peer_port);
    pthread_mutex_unlock(&ctx->lock);
    if (ctx->has_ep_key && !(c->flags & STRIA__CTRL_FLAG_KEYED)) {
        count(ctx, &ctx->stats.handshakes_refused);
        stria_log_warn("ucx link: refusing the endpoint from %s: it has no endpoint key", e->peer);
        refuse(e, STRIA__CTRL_EP_WELCOME, STRIA_ERR_AUTH,
               "this worker's ring endpoints need the endpoint key (the workers' credential)");
        return;
    }
    drop_stale(ctx, e);
    stria__ctrl_t w;
    memset(&w, 0, sizeof(w));
    w.type = STRIA__CTRL_EP_WELCOME;
    w.incarnation = ctx->incarnation;
    if (stria_auth_random(e->nonce_s, sizeof(e->nonce_s)) != STRIA_OK) {
        refuse(e, STRIA__CTRL_EP_WELCOME, STRIA_ERR_INTERNAL, "no random bytes");
        return;
    }
    memcpy(w.nonce, e->nonce_s, sizeof(w.nonce));
    if (ctx->has_ep_key) {
        w.flags = STRIA__CTRL_FLAG_KEYED;
        stria__ucx_ep_mac(ctx->ep_key, true, e->nonce_c, e->nonce_s, c->incarnation,
                          ctx->incarnation, w.mac);
    }
    stria__ucx_ctrl_send(e->ep, &w, &e->ctrl_pending);
}

static void handle_proof(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c)
{
    if (!e->hello_seen || e->state != STRIA__EP_HANDSHAKE) {
        count(ctx, &ctx->stats.handshakes_refused);
        fail(e, STRIA_ERR_PROTOCOL, "sent an endpoint proof out of turn");
        return;
    }
    if (ctx->has_ep_key) {
        uint8_t want[STRIA_AUTH_MAC_BYTES];
        stria__ucx_ep_mac(ctx->ep_key, false, e->nonce_c, e->nonce_s, e->peer_incarnation,
                          ctx->incarnation, want);
        if (!(c->flags & STRIA__CTRL_FLAG_KEYED) || !stria_auth_equal(want, c->mac, sizeof(want))) {
            count(ctx, &ctx->stats.handshakes_refused);
            stria_log_warn("ucx link: %s proved a wrong endpoint key; refused", e->peer);
            refuse(e, STRIA__CTRL_EP_READY, STRIA_ERR_AUTH,
                   "the proof of the endpoint key is wrong");
            return;
        }
    }
    pthread_mutex_lock(&ctx->lock);
    e->state = STRIA__EP_READY;
    e->ready_at = stria_time_now();
    e->keyed = ctx->has_ep_key;
    e->trusted = e->keyed;
    ctx->stats.endpoints_made++;
    pthread_mutex_unlock(&ctx->lock);
    stria__ctrl_t r;
    memset(&r, 0, sizeof(r));
    r.type = STRIA__CTRL_EP_READY;
    stria__ucx_ctrl_send(e->ep, &r, &e->ctrl_pending);
    stria_log_debug("ucx link: endpoint from %s ready%s", e->peer,
                    e->keyed ? " (endpoint key proven)" : "");
}

void stria__ucx_ep_handle(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, const stria__ctrl_t *c)
{
    if (e->state == STRIA__EP_BROKEN || e->state == STRIA__EP_CLOSING)
        return;
    bool ours = e->outgoing ? c->type == STRIA__CTRL_EP_WELCOME || c->type == STRIA__CTRL_EP_READY
                            : c->type == STRIA__CTRL_EP_HELLO || c->type == STRIA__CTRL_EP_PROOF;
    if (!ours) {
        fail(e, STRIA_ERR_PROTOCOL, "sent an endpoint message of the other side (type %u)",
             c->type);
        return;
    }
    switch (c->type) {
    case STRIA__CTRL_EP_HELLO:
        handle_hello(ctx, e, c);
        break;
    case STRIA__CTRL_EP_WELCOME:
        handle_welcome(ctx, e, c);
        break;
    case STRIA__CTRL_EP_PROOF:
        handle_proof(ctx, e, c);
        break;
    default:
        handle_ready(ctx, e, c);
        break;
    }
}

void stria__ucx_ep_version(stria_ucx_ctx_t *ctx, ucp_ep_h ep, int version, const uint8_t *raw,
                           size_t len)
{
    stria__ucx_ep_t *e = stria__ucx_ep_find(ctx, ep);
    if (e == NULL || e->state == STRIA__EP_BROKEN || e->state == STRIA__EP_CLOSING)
        return;
    char text[STRIA__UCX_TEXT_MAX];
    snprintf(text, sizeof(text),
             "link protocol version %d here, version %d at the peer: every worker must run the "
             "same stria link version",
             STRIA__UCX_VERSION, version);
    count(ctx, &ctx->stats.version_refused);
    stria_log_warn("ucx link: the endpoint %s %s speaks link protocol version %d, this context "
                   "version %d; refused",
                   e->outgoing ? "to" : "from", e->peer, version, STRIA__UCX_VERSION);
    if (e->outgoing) {
        fail(e, STRIA_ERR_PROTOCOL, "speaks link protocol version %d, this worker version %d",
             version, STRIA__UCX_VERSION);
        return;
    }
    /* Told in the peer's own format where it is known (version 2), else in
     * ours, which a later version reads as a refusal naming both. */
    uint8_t out[STRIA__UCX_CTRL_MAX];
    size_t n = stria__ucx_v2_refusal(raw, len, text, out);
    if (n > 0) {
        stria__ucx_raw_send(e->ep, out, n, &e->ctrl_pending);
        fail(e, STRIA_ERR_PROTOCOL, "refused: %s", text);
    } else {
        refuse(e, STRIA__CTRL_EP_WELCOME, STRIA_ERR_PROTOCOL, text);
    }
}

void stria__ucx_ep_error(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, ucs_status_t status)
{
    if (e->state == STRIA__EP_CLOSING)
        return;
    stria_log_debug("ucx link: the endpoint %s %s failed: %s", e->outgoing ? "to" : "from", e->peer,
                    ucs_status_string(status));
    pthread_mutex_lock(&ctx->lock);
    /* Kept open until the failure settles, so that a notice still on its
     * way over it is read. */
    stria__ucx_ep_break_locked(e, STRIA_ERR_PEER, STRIA__UCX_SETTLE_S, "failed: %s",
                               ucs_status_string(status));
    pthread_mutex_unlock(&ctx->lock);
}

/* ---- the sweep ---------------------------------------------------------------------------------
 */

/* Whether an endpoint is due to close now; else *due says when to look again. */
static bool close_due(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e, double now, double *due)
{
    bool close = false;
    pthread_mutex_lock(&ctx->lock);
    if (e->state == STRIA__EP_BROKEN) {
        close = now >= e->close_at;
        if (!close)
            *due = e->close_at;
    } else if (e->state != STRIA__EP_CLOSING && e->drop && e->links == 0 && e->refs == 0) {
        /* An idle dropped endpoint: its last messages (goodbyes) go first. */
        if (e->close_at == 0)
            e->close_at = now + STRIA__UCX_CLOSE_GRACE_S;
        close = e->ctrl_pending == 0 || now >= e->close_at;
        if (!close)
            *due = now + 0.01;
    } else if (!e->outgoing && !e->trusted && e->state != STRIA__EP_CLOSING) {
        close = now - e->made_at >= ctx->handshake_timeout_s;
        if (close) {
            ctx->stats.handshakes_timed_out++;
            stria_log_warn("ucx link: closing the connection from %s: no completed handshake "
                           "within %.3g s",
                           e->peer, ctx->handshake_timeout_s);
        } else {
            *due = e->made_at + ctx->handshake_timeout_s;
        }
    }
    pthread_mutex_unlock(&ctx->lock);
    return close;
}

double stria__ucx_eps_sweep(stria_ucx_ctx_t *ctx, double now)
{
    double next = 0;
    for (stria__node_t *x = ctx->eps.next; x != &ctx->eps;) {
        stria__ucx_ep_t *e = STRIA__OF(x, stria__ucx_ep_t, node);
        x = x->next;
        double due = 0;
        if (close_due(ctx, e, now, &due))
            ep_close(e);
        if (due > 0 && (next == 0 || due < next))
            next = due;
    }
    stria__ucx_eps_reap(ctx);
    return next;
}

/* Frees an endpoint record (its UCX endpoint closed, nobody holds it). */
static void ep_free(stria_ucx_ctx_t *ctx, stria__ucx_ep_t *e)
{
    stria__ucx_events_forget(ctx, e);
    pthread_mutex_lock(&ctx->lock);
    stria__list_del(&e->node);
    pthread_mutex_unlock(&ctx->lock);
    if (!e->outgoing)
        ctx->n_accepted--;
    while (!stria__list_empty(&e->parked)) {
        stria__node_t *n = e->parked.next;
        stria__list_del(n);
        free(STRIA__OF(n, stria__parked_t, node));
    }
    free(e);
}

void stria__ucx_eps_reap(stria_ucx_ctx_t *ctx)
{
    for (stria__node_t *x = ctx->eps.next; x != &ctx->eps;) {
        stria__ucx_ep_t *e = STRIA__OF(x, stria__ucx_ep_t, node);
        x = x->next;
        if (e->state == STRIA__EP_CLOSING && e->closing == 0 && e->refs == 0 &&
            e->ctrl_pending == 0)
            ep_free(ctx, e);
    }
}

void stria__ucx_eps_close_all(stria_ucx_ctx_t *ctx)
{
    for (stria__node_t *x = ctx->eps.next; x != &ctx->eps; x = x->next)
        ep_close(STRIA__OF(x, stria__ucx_ep_t, node));
    double until = stria_time_now() + 2.0;
    while (ctx->closing > 0 && stria_time_now() < until)
        ucp_worker_progress(ctx->worker);
    if (ctx->closing > 0)
        stria_log_warn("ucx context: %d endpoint closes did not finish", ctx->closing);
}
