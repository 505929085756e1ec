/*
 * An attacker of the UCX ring link, for the security tests: raw UCX
 * endpoints to a victim's ring listener that speak the link's wire format
 * (transport/ucx_wire.c) without being a member of the ring.
 *
 *   ucx_ring_attacker --port P --mode inject|replay|forge|flood|redial|version
 *   ucx_ring_attacker --mode listen-version --version V
 *
 * inject: connects and announces itself (EP_HELLO, then, as far as the
 *   victim lets it, the endpoint handshake and a BIND as the victim's
 *   predecessor: the job, ring and rank given, no proof), and at once sprays
 *   DATA blocks of --bytes at slots 1..--slots with the tags ucx_ring_rank
 *   uses (passes 0..--passes, step 0; with --engine-tags the ring engine's
 *   of the first pass: calls 0..--passes / --size, every step, K/V), each
 *   once (again and again with --repeat, at most --inflight in flight), half
 *   of them with the reply flag; then stays connected until --duration
 *   seconds passed. Prints "sent N".
 * replay: plays the predecessor with the ring key (--key-seed N) on two
 *   endpoints A and B (their handshakes done, with --endpoint-key-seed if
 *   the victim wants one): the BIND made for A is sent on B first (a bind
 *   captured and replayed on another endpoint), then on A (the honest one),
 *   then on A again (replayed on its own endpoint). Prints "elsewhere
 *   STATUS honest STATUS same STATUS" (the BOUND statuses).
 * forge: one endpoint (handshake done), then --binds BINDs for the job and
 *   ring given with a wrong ring key, each with a new counter, and one with
 *   a counter used before. Prints "forged STATUS stale STATUS" (the last
 *   forged bind's answer, the stale one's; "no-answer" after --wait seconds,
 *   default 10: a bind for a ring the victim does not have waits there).
 * flood: opens --conns connections that never send a byte and keeps them
 *   for --duration seconds. Prints "rejected N closed M" (refused at once;
 *   closed by the victim later).
 * redial: plays a peer whose handshake waits (an EP_HELLO, nothing more)
 *   and, each time the victim closes that connection, connects again at
 *   once, until a connect fails other than by the victim's refusal (its
 *   listener is gone) or --duration passed. Prints "redials N refused R last
 *   STATUS" (R: redials the victim's listener took and then refused).
 * version: connects and sends a HELLO of link protocol --version V (2: that
 *   version's own format), as a worker of another version would. Prints
 *   "answer STATUS TEXT" (the refusal the victim sent), or "answer none".
 * listen-version: listens on --port (0: any; prints "port P") and answers
 *   the first control message of each connection with a message of link
 *   protocol --version V, as a successor of another version would; runs for
 *   --duration seconds. Prints "answered N".
 * Exit status: 0 when the attack ran (whatever it achieved), 2 on usage or
 * set-up errors.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tucx.h"
#include "ucx_int.h"

#define MAX_EPS 256
#define N_TYPES (STRIA__CTRL_LAST + 1)
#define INC_ATK 0xA77AC0ull /* the attacker's "incarnation" */
#define V2_HDR  110

typedef struct {
    ucp_ep_h ep;
    bool failed;
    ucs_status_t why;
    uint8_t nonce_c[STRIA_AUTH_NONCE_BYTES], nonce_s[STRIA_AUTH_NONCE_BYTES];
} ep_t;

typedef struct {
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_listener_h listener;
    ep_t eps[MAX_EPS];
    int n_eps;
    /* the last control message of each type per endpoint, and how many came */
    stria__ctrl_t last[MAX_EPS][N_TYPES];
    int got[MAX_EPS][N_TYPES];
    /* a message of another version: its status and text (version 2's ACK) */
    bool other_version;
    int32_t other_status;
    char other_text[STRIA__UCX_TEXT_MAX + 1];
    /* listen-version: connection requests to accept, the version to answer */
    ucp_conn_request_h pending[16];
    int n_pending;
    int answer_version, answered;
    int inflight;
} atk_t;

static atk_t g;

static void ep_err(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    ep_t *e = arg;
    (void)ep;
    e->failed = true;
    e->why = status;
}

static int ep_index(ucp_ep_h ep)
{
    for (int i = 0; i < g.n_eps; i++)
        if (g.eps[i].ep == ep)
            return i;
    return -1;
}

static void send_raw(ucp_ep_h ep, const uint8_t *buf, size_t len);

/* listen-version: every first message of a connection is answered with an
 * endpoint welcome of the version asked for. */
static void answer_other_version(ucp_ep_h ep)
{
    stria__ctrl_t w;
    uint8_t buf[STRIA__UCX_CTRL_MAX];
    memset(&w, 0, sizeof(w));
    w.type = STRIA__CTRL_EP_WELCOME;
    w.incarnation = INC_ATK;
    size_t n = stria__ucx_ctrl_encode(&w, buf);
    stria_put_le16(buf + 4, (uint16_t)g.answer_version);
    send_raw(ep, buf, n);
    g.answered++;
}

static ucs_status_t on_ctrl(void *arg, const void *header, size_t header_length, void *data,
                            size_t length, const ucp_am_recv_param_t *param)
{
    (void)arg, (void)header, (void)header_length;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
        return UCS_OK;
    if (g.answer_version > 0) {
        answer_other_version(param->reply_ep);
        return UCS_OK;
    }
    const uint8_t *b = data;
    if (stria__ucx_ctrl_version(b, length) == 2 && length >= V2_HDR) {
        /* version 2's acknowledgement: status at 32, text length at 44 */
        size_t tl = stria_get_le16(b + 44);
        g.other_version = true;
        g.other_status = (int32_t)stria_get_le32(b + 32);
        snprintf(g.other_text, sizeof(g.other_text), "%.*s",
                 (int)(tl < length - V2_HDR ? tl : length - V2_HDR), (const char *)b + V2_HDR);
        return UCS_OK;
    }
    stria__ctrl_t c;
    int i = ep_index(param->reply_ep);
    if (i < 0 || stria__ucx_ctrl_decode(data, length, &c) != STRIA_OK)
        return UCS_OK;
    g.last[i][c.type] = c;
    g.got[i][c.type]++;
    return UCS_OK;
}

static void on_conn(ucp_conn_request_h req, void *arg)
{
    (void)arg;
    if (g.n_pending < 16)
        g.pending[g.n_pending++] = req;
    else
        ucp_listener_reject(g.listener, req);
}

static int setup(void)
{
    ucp_config_t *config = NULL;
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM};
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_config_read(NULL, NULL, &config) != UCS_OK)
        return -1;
    ucs_status_t s = ucp_init(&p, config, &g.context);
    ucp_config_release(config);
    if (s != UCS_OK || ucp_worker_create(g.context, &wp, &g.worker) != UCS_OK)
        return -1;
    ucp_am_handler_param_t am = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB,
                                 .id = STRIA__UCX_AM_CTRL,
                                 .flags = UCP_AM_FLAG_WHOLE_MSG,
                                 .cb = on_ctrl};
    return ucp_worker_set_am_recv_handler(g.worker, &am) == UCS_OK ? 0 : -1;
}

static int add_ep(ucp_ep_params_t *ep)
{
    if (g.n_eps >= MAX_EPS)
        return -1;
    ep_t *e = &g.eps[g.n_eps];
    ep->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep->err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep->err_handler.cb = ep_err;
    ep->err_handler.arg = e;
    if (ucp_ep_create(g.worker, ep, &e->ep) != UCS_OK)
        return -1;
    for (int k = 0; k < STRIA_AUTH_NONCE_BYTES; k++)
        e->nonce_c[k] = (uint8_t)(0x40 + g.n_eps + k);
    return g.n_eps++;
}

static int connect_ep(const char *host, int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
        return -1;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER};
    ep.sockaddr.addr = (const struct sockaddr *)&a;
    ep.sockaddr.addrlen = sizeof(a);
    return add_ep(&ep);
}

static void progress_for(double seconds)
{
    double end = stria_time_now() + seconds;
    while (stria_time_now() < end) {
        if (ucp_worker_progress(g.worker) == 0)
            usleep(1000);
    }
}

static void send_done(void *request, ucs_status_t status, void *user_data)
{
    (void)status;
    free(user_data);
    g.inflight--;
    ucp_request_free(request);
}

/* Sends an active message; its allocation (the header's when there is one,
 * else the buffer's) is freed when it is sent. */
static void am_send(ucp_ep_h ep, unsigned id, void *hdr, size_t hl, void *buf, size_t len,
                    uint32_t flags)
{
    void *owned = hdr != NULL ? hdr : buf;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                             UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
                             .cb = {.send = send_done},
                             .user_data = owned,
                             .flags = flags};
    void *r = ucp_am_send_nbx(ep, id, hdr, hl, buf, len, &p);
    if (r == NULL || UCS_PTR_IS_ERR(r))
        free(owned);
    else
        g.inflight++;
}

static void send_raw(ucp_ep_h ep, const uint8_t *buf, size_t len)
{
    uint8_t *copy = malloc(len);
    memcpy(copy, buf, len);
    am_send(ep, STRIA__UCX_AM_CTRL, NULL, 0, copy, len,
            UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER);
}

static void send_ctrl(int i, const stria__ctrl_t *c)
{
    uint8_t buf[STRIA__UCX_CTRL_MAX];
    send_raw(g.eps[i].ep, buf, stria__ucx_ctrl_encode(c, buf));
}

/* Waits for the count of `type` messages on endpoint i to pass `seen`. */
static bool wait_type(int i, uint16_t type, int seen, double timeout_s)
{
    double end = stria_time_now() + timeout_s;
    while (stria_time_now() < end) {
        if (g.got[i][type] > seen)
            return true;
        if (g.eps[i].failed)
            return false;
        if (ucp_worker_progress(g.worker) == 0)
            usleep(100);
    }
    return false;
}

static void send_hello(int i, bool keyed)
{
    stria__ctrl_t c;
    memset(&c, 0, sizeof(c));
    c.type = STRIA__CTRL_EP_HELLO;
    c.flags = keyed ? STRIA__CTRL_FLAG_KEYED : 0;
    c.incarnation = INC_ATK;
    memcpy(c.nonce, g.eps[i].nonce_c, sizeof(c.nonce));
    send_ctrl(i, &c);
}

/* The endpoint proof after the victim's welcome (MAC with ekey if given). */
static void send_proof(int i, const uint8_t *ekey)
{
    const stria__ctrl_t *w = &g.last[i][STRIA__CTRL_EP_WELCOME];
    stria__ctrl_t c;
    memset(&c, 0, sizeof(c));
    c.type = STRIA__CTRL_EP_PROOF;
    memcpy(g.eps[i].nonce_s, w->nonce, sizeof(w->nonce));
    if (ekey != NULL) {
        c.flags = STRIA__CTRL_FLAG_KEYED;
        stria__ucx_ep_mac(ekey, false, g.eps[i].nonce_c, w->nonce, INC_ATK, w->incarnation, c.mac);
    }
    send_ctrl(i, &c);
}

/* The endpoint handshake on i; returns the status of the victim's answer. */
static stria_status_t handshake(int i, const uint8_t *ekey)
{
    send_hello(i, ekey != NULL);
    if (!wait_type(i, STRIA__CTRL_EP_WELCOME, 0, 10))
        return STRIA_ERR_TIMEOUT;
    if (g.last[i][STRIA__CTRL_EP_WELCOME].status != STRIA_OK)
        return g.last[i][STRIA__CTRL_EP_WELCOME].status;
    send_proof(i, ekey);
    if (!wait_type(i, STRIA__CTRL_EP_READY, 0, 10))
        return STRIA_ERR_TIMEOUT;
    return g.last[i][STRIA__CTRL_EP_READY].status;
}

typedef struct {
    const char *host, *mode;
    int port, rank, size, slots, passes, conns, key_seed, ep_key_seed, inflight, binds, version;
    bool engine_tags, repeat;
    uint64_t job, ring;
    size_t bytes;
    double duration;
    double wait_s; /* how long a bind waits for its answer */
} opts_t;

/* A BIND of endpoint i for the options' ring with `counter`, proven with
 * key (NULL: unproven). */
static stria__ctrl_t bind_of(const opts_t *o, int i, uint64_t counter, const uint8_t *key)
{
    stria__ctrl_t c;
    memset(&c, 0, sizeof(c));
    c.type = STRIA__CTRL_BIND;
    c.job_id = o->job;
    c.ring_id = o->ring;
    c.rank = o->rank;
    c.size = o->size;
    c.origin = c.reporter = o->rank;
    c.slot = 1;
    c.counter = counter;
    if (key != NULL) {
        c.flags = STRIA__CTRL_FLAG_KEYED;
        stria__bind_fields_t f = {.nonce_c = g.eps[i].nonce_c,
                                  .nonce_s = g.eps[i].nonce_s,
                                  .counter = counter,
                                  .job_id = c.job_id,
                                  .ring_id = c.ring_id,
                                  .rank = c.rank,
                                  .size = c.size,
                                  .slot_c = c.slot,
                                  .slot_a = 0};
        stria__ucx_bind_mac(key, false, &f, c.mac);
    }
    return c;
}

/* Sends a bind on i and returns the status of its BOUND ("no-answer" as
 * STRIA_ERR_TIMEOUT: a bind for a ring the victim does not have waits). */
static double g_wait_s = 10;

static stria_status_t bind_on(int i, const stria__ctrl_t *bind)
{
    int seen = g.got[i][STRIA__CTRL_BOUND];
    send_ctrl(i, bind);
    if (!wait_type(i, STRIA__CTRL_BOUND, seen, g_wait_s))
        return STRIA_ERR_TIMEOUT;
    return g.last[i][STRIA__CTRL_BOUND].status;
}

/* The tag of the k-th block to inject: ucx_ring_rank's (pass k, step 0), or
 * the ring engine's (pass 0, call k / size, step k % size, K/V). */
static uint64_t inject_tag(const opts_t *o, int k)
{
    if (o->engine_tags)
        return ((uint64_t)(k / o->size) << 24) | ((uint64_t)(k % o->size) << 8) | 1u;
    return 0xA5A5000000000000ull | ((uint64_t)(uint32_t)k << 16);
}

/* inject: the handshake and an unproven bind go on as the victim answers. */
static void inject_handshake(const opts_t *o, int i, bool *proof_sent, bool *bind_sent)
{
    if (!*proof_sent && g.got[i][STRIA__CTRL_EP_WELCOME] > 0 &&
        g.last[i][STRIA__CTRL_EP_WELCOME].status == STRIA_OK) {
        send_proof(i, NULL);
        *proof_sent = true;
    }
    if (!*bind_sent && g.got[i][STRIA__CTRL_EP_READY] > 0 &&
        g.last[i][STRIA__CTRL_EP_READY].status == STRIA_OK) {
        stria__ctrl_t b = bind_of(o, i, 1, NULL);
        send_ctrl(i, &b);
        *bind_sent = true;
    }
}

static int do_inject(const opts_t *o)
{
    int i = connect_ep(o->host, o->port);
    if (i < 0)
        return 2;
    bool proof_sent = false, bind_sent = false;
    send_hello(i, false);
    /* Every (slot, tag) once, in order (again and again with --repeat),
     * then wait out the duration. */
    long sent = 0;
    double end = stria_time_now() + o->duration;
    do {
        for (int slot = 1; slot <= o->slots; slot++)
            for (int k = 0; k <= o->passes && stria_time_now() < end && !g.eps[i].failed;) {
                inject_handshake(o, i, &proof_sent, &bind_sent);
                if (g.inflight >= o->inflight) {
                    progress_for(0.001);
                    continue;
                }
                /* The header and the block in one buffer: UCX may read both
                 * until the send completes (then the buffer is freed). */
                uint8_t *hdr = malloc(STRIA__UCX_DATA_HDR + o->bytes);
                uint8_t *buf = hdr + STRIA__UCX_DATA_HDR;
                stria__ucx_data_hdr_encode(hdr, (uint32_t)slot, inject_tag(o, k));
                memset(buf, 0x5a, o->bytes);
                uint32_t flags = (sent & 1) ? UCP_AM_SEND_FLAG_REPLY : 0;
                if (o->bytes >= STRIA__UCX_RNDV_MIN)
                    flags |= UCP_AM_SEND_FLAG_RNDV;
                am_send(g.eps[i].ep, STRIA__UCX_AM_DATA, hdr, STRIA__UCX_DATA_HDR, buf, o->bytes,
                        flags);
                sent++;
                k++;
            }
    } while (o->repeat && stria_time_now() < end && !g.eps[i].failed);
    progress_for(end - stria_time_now());
    printf("sent %ld\n", sent);
    return 0;
}

static const char *status_or_none(stria_status_t st)
{
    return st == STRIA_ERR_TIMEOUT ? "no-answer" : stria_status_name(st);
}

static int do_replay(const opts_t *o)
{
    uint8_t key[STRIA_AUTH_KEY_BYTES], ekey[STRIA_AUTH_KEY_BYTES];
    tucx_key_of_seed(o->key_seed, key);
    tucx_key_of_seed(o->ep_key_seed, ekey);
    const uint8_t *ek = o->ep_key_seed >= 0 ? ekey : NULL;
    int a = connect_ep(o->host, o->port), b = connect_ep(o->host, o->port);
    if (a < 0 || b < 0)
        return 2;
    stria_status_t ha = handshake(a, ek), hb = handshake(b, ek);
    if (ha != STRIA_OK || hb != STRIA_OK) {
        printf("handshake %s %s\n", stria_status_name(ha), stria_status_name(hb));
        return 0;
    }
    /* The bind an honest predecessor would send on A, as captured. */
    stria__ctrl_t captured = bind_of(o, a, 1, key);
    stria_status_t elsewhere = bind_on(b, &captured);
    stria_status_t honest = bind_on(a, &captured);
    stria_status_t same = bind_on(a, &captured);
    printf("elsewhere %s honest %s same %s\n", status_or_none(elsewhere), status_or_none(honest),
           status_or_none(same));
    fflush(stdout);
    progress_for(0.5);
    return 0;
}

static int do_forge(const opts_t *o)
{
    uint8_t wrong[STRIA_AUTH_KEY_BYTES], ekey[STRIA_AUTH_KEY_BYTES];
    tucx_key_of_seed(o->key_seed + 1000, wrong);
    tucx_key_of_seed(o->ep_key_seed, ekey);
    int a = connect_ep(o->host, o->port);
    if (a < 0)
        return 2;
    stria_status_t h = handshake(a, o->ep_key_seed >= 0 ? ekey : NULL);
    if (h != STRIA_OK) {
        printf("handshake %s\n", stria_status_name(h));
        return 0;
    }
    stria_status_t forged = STRIA_OK, stale;
    for (int k = 1; k <= o->binds; k++) {
        stria__ctrl_t f = bind_of(o, a, (uint64_t)k, wrong);
        forged = bind_on(a, &f);
    }
    stria__ctrl_t again = bind_of(o, a, 1, wrong);
    stale = bind_on(a, &again);
    printf("forged %s stale %s\n", status_or_none(forged), status_or_none(stale));
    fflush(stdout);
    progress_for(0.2);
    return 0;
}

static int do_flood(const opts_t *o)
{
    for (int k = 0; k < o->conns; k++)
        if (connect_ep(o->host, o->port) < 0)
            return 2;
    /* The victim rejects some at once, closes the rest at its handshake
     * deadline; both reach us as endpoint errors. */
    double t0 = stria_time_now();
    int early = 0;
    while (stria_time_now() - t0 < o->duration) {
        progress_for(0.05);
        if (stria_time_now() - t0 < 0.5) {
            early = 0;
            for (int k = 0; k < g.n_eps; k++)
                early += g.eps[k].failed;
        }
    }
    int failed = 0;
    for (int k = 0; k < g.n_eps; k++)
        failed += g.eps[k].failed;
    printf("rejected %d closed %d\n", early, failed - early);
    return 0;
}

static int do_redial(const opts_t *o)
{
    int i = connect_ep(o->host, o->port), redials = 0, refused = 0;
    if (i < 0)
        return 2;
    send_hello(i, false);
    double end = stria_time_now() + o->duration;
    while (stria_time_now() < end) {
        if (ucp_worker_progress(g.worker) == 0)
            usleep(100);
        if (!g.eps[i].failed)
            continue;
        if (i > 0 && g.eps[i].why != UCS_ERR_REJECTED)
            break; /* nothing listens there any more */
        refused += i > 0;
        if ((i = connect_ep(o->host, o->port)) < 0)
            break;
        redials++;
        send_hello(i, false);
    }
    printf("redials %d refused %d last %s\n", redials, refused,
           i >= 0 && g.eps[i].failed ? ucs_status_string(g.eps[i].why) : "open");
    return 0;
}

/* A HELLO of another link protocol version: version 2's own (its layout:
 * 8 job, 16 ring, 24 rank, 28 size, 44 text length, 46 nonce, 110 text), or
 * this version's layout with another version number. */
static int do_version(const opts_t *o)
{
    int i = connect_ep(o->host, o->port);
    if (i < 0)
        return 2;
    uint8_t buf[STRIA__UCX_CTRL_MAX];
    size_t n;
    if (o->version == 2) {
        memset(buf, 0, V2_HDR);
        stria_put_le32(buf, STRIA__UCX_MAGIC);
        stria_put_le16(buf + 4, 2);
        stria_put_le16(buf + 6, 1); /* HELLO */
        stria_put_le64(buf + 8, o->job);
        stria_put_le64(buf + 16, o->ring);
        stria_put_le32(buf + 24, (uint32_t)o->rank);
        stria_put_le32(buf + 28, (uint32_t)o->size);
        n = V2_HDR;
    } else {
        stria__ctrl_t c;
        memset(&c, 0, sizeof(c));
        c.type = STRIA__CTRL_EP_HELLO;
        n = stria__ucx_ctrl_encode(&c, buf);
        stria_put_le16(buf + 4, (uint16_t)o->version);
    }
    send_raw(g.eps[i].ep, buf, n);
    double end = stria_time_now() + 10;
    while (stria_time_now() < end && !g.other_version && g.got[i][STRIA__CTRL_EP_WELCOME] == 0)
        if (ucp_worker_progress(g.worker) == 0)
            usleep(100);
    if (g.other_version)
        printf("answer %s %s\n", stria_status_name(g.other_status), g.other_text);
    else if (g.got[i][STRIA__CTRL_EP_WELCOME] > 0)
        printf("answer %s %s\n", stria_status_name(g.last[i][STRIA__CTRL_EP_WELCOME].status),
               g.last[i][STRIA__CTRL_EP_WELCOME].text);
    else
        printf("answer none\n");
    fflush(stdout);
    progress_for(0.2);
    return 0;
}

static int do_listen_version(const opts_t *o)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o->port)};
    inet_pton(AF_INET, o->host, &a.sin_addr);
    ucp_listener_params_t lp = {.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                                              UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
                                .conn_handler = {.cb = on_conn}};
    lp.sockaddr.addr = (const struct sockaddr *)&a;
    lp.sockaddr.addrlen = sizeof(a);
    if (ucp_listener_create(g.worker, &lp, &g.listener) != UCS_OK)
        return 2;
    ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if (ucp_listener_query(g.listener, &la) != UCS_OK)
        return 2;
    printf("port %u\n", (unsigned)ntohs(((struct sockaddr_in *)(void *)&la.sockaddr)->sin_port));
    fflush(stdout);
    g.answer_version = o->version;
    double end = stria_time_now() + o->duration;
    while (stria_time_now() < end) {
        while (g.n_pending > 0) {
            ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST,
                                  .conn_request = g.pending[--g.n_pending]};
            add_ep(&ep);
        }
        if (ucp_worker_progress(g.worker) == 0)
            usleep(1000);
    }
    printf("answered %d\n", g.answered);
    return 0;
}

int main(int argc, char **argv)
{
    opts_t o = {.host = "127.0.0.1",
                .mode = "inject",
                .rank = 0,
                .size = 2,
                .slots = 4,
                .passes = 200,
                .conns = 8,
                .job = 1,
                .ring = 1,
                .bytes = 4096,
                .duration = 2,
                .inflight = 256,
                .key_seed = 0,
                .ep_key_seed = -1,
                .binds = 1,
                .version = 2,
                .wait_s = 10};
    const tucx_opt_t opts[] = {{"host", TUCX_STR, &o.host},
                               {"port", TUCX_INT, &o.port},
                               {"mode", TUCX_STR, &o.mode},
                               {"key-seed", TUCX_INT, &o.key_seed},
                               {"endpoint-key-seed", TUCX_INT, &o.ep_key_seed},
                               {"rank", TUCX_INT, &o.rank},
                               {"size", TUCX_INT, &o.size},
                               {"slots", TUCX_INT, &o.slots},
                               {"passes", TUCX_INT, &o.passes},
                               {"conns", TUCX_INT, &o.conns},
                               {"binds", TUCX_INT, &o.binds},
                               {"version", TUCX_INT, &o.version},
                               {"job", TUCX_U64, &o.job},
                               {"ring", TUCX_U64, &o.ring},
                               {"bytes", TUCX_SIZE, &o.bytes},
                               {"duration", TUCX_DOUBLE, &o.duration},
                               {"engine-tags", TUCX_FLAG, &o.engine_tags},
                               {"repeat", TUCX_FLAG, &o.repeat},
                               {"inflight", TUCX_INT, &o.inflight},
                               {"wait", TUCX_DOUBLE, &o.wait_s},
                               {NULL, 0, NULL}};
    if (!tucx_parse(argc, argv, opts))
        return 2;
    bool listen = strcmp(o.mode, "listen-version") == 0;
    g_wait_s = o.wait_s;
    if ((o.port <= 0 && !listen) || o.bytes == 0 || o.conns < 1 || o.conns > MAX_EPS - 2 ||
        o.binds < 1 || setup() != 0) {
        fprintf(stderr, "ucx_ring_attacker: bad arguments or no UCX\n");
        return 2;
    }
    int rc = strcmp(o.mode, "replay") == 0    ? do_replay(&o)
             : strcmp(o.mode, "forge") == 0   ? do_forge(&o)
             : strcmp(o.mode, "flood") == 0   ? do_flood(&o)
             : strcmp(o.mode, "redial") == 0  ? do_redial(&o)
             : strcmp(o.mode, "version") == 0 ? do_version(&o)
             : listen                         ? do_listen_version(&o)
                                              : do_inject(&o);
    fflush(stdout);
    /* Exit without closing: the victim sees the connections drop. */
    _exit(rc);
}
