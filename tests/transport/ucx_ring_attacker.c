/*
 * An attacker of the UCX ring link, for the security tests: raw UCX
 * endpoints to a victim's ring listener that speak the link's wire format
 * (transport/ucx_wire.c) without being a member of the ring.
 *
 *   ucx_ring_attacker --port P --mode inject|replay|flood|redial [options]
 *
 * inject: announces itself as the victim's predecessor (HELLO with the job,
 *   ring and rank given, no proof) and sprays DATA blocks of --bytes at
 *   slots 1..--slots with the tags ucx_ring_rank uses (passes
 *   0..--passes, step 0; with --engine-tags the ring engine's of the first
 *   pass: calls 0..--passes / --size, every step, K/V), each once (again
 *   and again with --repeat, at most --inflight in flight), half of them
 *   with the reply flag; then stays connected until --duration seconds
 *   passed. Prints "sent N".
 * replay: plays the predecessor with the ring key (--key-seed N): HELLO on
 *   connection A, then the same HELLO (the same nonce) on connection B, and
 *   B answers B's challenge with the proof made for A's, as an attacker who
 *   captured A's handshake would; then A completes with its own proof.
 *   Prints "replayed STATUS honest STATUS" (B's acknowledgement, then A's).
 * flood: opens --conns connections that never send a byte and keeps them
 *   for --duration seconds. Prints "rejected N closed M" (refused at once;
 *   closed by the victim later).
 * redial: plays a peer whose handshake waits (HELLO for --job/--ring, which
 *   the victim does not have) and, each time the victim closes that
 *   connection, connects again at once with the same HELLO, until a connect
 *   fails other than by the victim's refusal (its listener is gone) or
 *   --duration passed. Prints "redials N refused R last STATUS" (R: redials
 *   the victim's listener took and then refused).
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

typedef struct {
    ucp_ep_h ep;
    bool failed;
    ucs_status_t why;
} ep_t;

typedef struct {
    ucp_context_h context;
    ucp_worker_h worker;
    ep_t eps[MAX_EPS];
    int n_eps;
    /* the last control message per endpoint */
    stria__ctrl_t ctrl[MAX_EPS];
    bool have_ctrl[MAX_EPS];
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

static ucs_status_t on_ctrl(void *arg, const void *header, size_t header_length, void *data,
                            size_t length, const ucp_am_recv_param_t *param)
{
    (void)arg, (void)header, (void)header_length;
    stria__ctrl_t c;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        stria__ucx_ctrl_decode(data, length, &c) != STRIA_OK)
        return UCS_OK;
    for (int i = 0; i < g.n_eps; i++)
        if (g.eps[i].ep == param->reply_ep) {
            g.ctrl[i] = c;
            g.have_ctrl[i] = true;
        }
    return UCS_OK;
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

static int connect_ep(const char *host, int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (g.n_eps >= MAX_EPS || inet_pton(AF_INET, host, &a.sin_addr) != 1)
        return -1;
    ep_t *e = &g.eps[g.n_eps];
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = ep_err, .arg = e}};
    ep.sockaddr.addr = (const struct sockaddr *)&a;
    ep.sockaddr.addrlen = sizeof(a);
    if (ucp_ep_create(g.worker, &ep, &e->ep) != UCS_OK)
        return -1;
    return g.n_eps++;
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
static void am_send(int i, unsigned id, void *hdr, size_t hl, void *buf, size_t len, uint32_t flags)
{
    void *owned = hdr != NULL ? hdr : buf;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                             UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
                             .cb = {.send = send_done},
                             .user_data = owned,
                             .flags = flags};
    void *r = ucp_am_send_nbx(g.eps[i].ep, id, hdr, hl, buf, len, &p);
    if (r == NULL || UCS_PTR_IS_ERR(r))
        free(owned);
    else
        g.inflight++;
}

static void send_ctrl(int i, const stria__ctrl_t *c)
{
    uint8_t *buf = malloc(STRIA__UCX_CTRL_MAX);
    size_t len = stria__ucx_ctrl_encode(c, buf);
    am_send(i, STRIA__UCX_AM_CTRL, NULL, 0, buf, len,
            UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER);
}

static stria__ctrl_t hello_of(uint64_t job, uint64_t ring, int rank, int size, const uint8_t *nonce)
{
    stria__ctrl_t c;
    memset(&c, 0, sizeof(c));
    c.type = STRIA__CTRL_HELLO;
    c.job_id = job;
    c.ring_id = ring;
    c.rank = rank;
    c.size = size;
    c.origin = rank;
    if (nonce != NULL)
        memcpy(c.nonce, nonce, sizeof(c.nonce));
    return c;
}

/* Waits for a control message of `type` on endpoint i. */
static bool wait_ctrl(int i, uint16_t type, double timeout_s)
{
    double end = stria_time_now() + timeout_s;
    while (stria_time_now() < end) {
        if (g.have_ctrl[i] && g.ctrl[i].type == type)
            return true;
        if (ucp_worker_progress(g.worker) == 0)
            usleep(100);
    }
    return false;
}

typedef struct {
    const char *host, *mode;
    int port, rank, size, slots, passes, conns, key_seed, inflight;
    bool engine_tags, repeat;
    uint64_t job, ring;
    size_t bytes;
    double duration;
} opts_t;

/* The tag of the k-th block to inject: ucx_ring_rank's (pass k, step 0), or
 * the ring engine's (pass 0, call k / size, step k % size, K/V). */
static uint64_t inject_tag(const opts_t *o, int k)
{
    if (o->engine_tags)
        return ((uint64_t)(k / o->size) << 24) | ((uint64_t)(k % o->size) << 8) | 1u;
    return 0xA5A5000000000000ull | ((uint64_t)(uint32_t)k << 16);
}

static int do_inject(const opts_t *o)
{
    int i = connect_ep(o->host, o->port);
    if (i < 0)
        return 2;
    stria__ctrl_t h = hello_of(o->job, o->ring, o->rank, o->size, NULL);
    send_ctrl(i, &h);
    /* Every (slot, tag) once, in order (again and again with --repeat),
     * then wait out the duration. */
    long sent = 0;
    double end = stria_time_now() + o->duration;
    do {
        for (int slot = 1; slot <= o->slots; slot++)
            for (int k = 0; k <= o->passes && stria_time_now() < end && !g.eps[i].failed;) {
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
                am_send(i, STRIA__UCX_AM_DATA, hdr, STRIA__UCX_DATA_HDR, buf, o->bytes, flags);
                sent++;
                k++;
            }
    } while (o->repeat && stria_time_now() < end && !g.eps[i].failed);
    progress_for(end - stria_time_now());
    printf("sent %ld\n", sent);
    return 0;
}

static int do_replay(const opts_t *o)
{
    uint8_t key[STRIA_AUTH_KEY_BYTES], nonce[STRIA_AUTH_NONCE_BYTES] = {42, 1, 2, 3};
    stria__ctrl_t proof;
    tucx_key_of_seed(o->key_seed, key);
    int a = connect_ep(o->host, o->port), b = connect_ep(o->host, o->port);
    if (a < 0 || b < 0)
        return 2;
    stria__ctrl_t h = hello_of(o->job, o->ring, o->rank, o->size, nonce);
    send_ctrl(a, &h);
    if (!wait_ctrl(a, STRIA__CTRL_CHALLENGE, 10)) {
        printf("no challenge on A\n");
        return 0;
    }
    /* The proof an honest predecessor would send on A, as captured. */
    memset(&proof, 0, sizeof(proof));
    proof.type = STRIA__CTRL_PROOF;
    proof.job_id = o->job;
    proof.ring_id = o->ring;
    proof.rank = o->rank;
    proof.size = o->size;
    memcpy(proof.nonce, nonce, sizeof(nonce));
    stria__ucx_ring_mac(key, false, o->job, o->ring, o->rank, o->size, nonce, g.ctrl[a].nonce,
                        proof.mac);
    /* The replay: the same HELLO and the same proof on B. */
    send_ctrl(b, &h);
    bool b_challenged = wait_ctrl(b, STRIA__CTRL_CHALLENGE, 10);
    send_ctrl(b, &proof);
    bool b_acked = wait_ctrl(b, STRIA__CTRL_ACK, 10);
    send_ctrl(a, &proof);
    bool a_acked = wait_ctrl(a, STRIA__CTRL_ACK, 10);
    printf("replayed %s%s honest %s\n", b_acked ? stria_status_name(g.ctrl[b].status) : "no-answer",
           b_challenged ? "" : " (not challenged)",
           a_acked ? stria_status_name(g.ctrl[a].status) : "no-answer");
    fflush(stdout);
    progress_for(0.5);
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
    stria__ctrl_t h = hello_of(o->job, o->ring, o->rank, o->size, NULL);
    int i = connect_ep(o->host, o->port), redials = 0, refused = 0;
    if (i < 0)
        return 2;
    send_ctrl(i, &h);
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
        send_ctrl(i, &h);
    }
    printf("redials %d refused %d last %s\n", redials, refused,
           i >= 0 && g.eps[i].failed ? ucs_status_string(g.eps[i].why) : "open");
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
                .inflight = 256};
    const tucx_opt_t opts[] = {{"host", TUCX_STR, &o.host},
                               {"port", TUCX_INT, &o.port},
                               {"mode", TUCX_STR, &o.mode},
                               {"key-seed", TUCX_INT, &o.key_seed},
                               {"rank", TUCX_INT, &o.rank},
                               {"size", TUCX_INT, &o.size},
                               {"slots", TUCX_INT, &o.slots},
                               {"passes", TUCX_INT, &o.passes},
                               {"conns", TUCX_INT, &o.conns},
                               {"job", TUCX_U64, &o.job},
                               {"ring", TUCX_U64, &o.ring},
                               {"bytes", TUCX_SIZE, &o.bytes},
                               {"duration", TUCX_DOUBLE, &o.duration},
                               {"engine-tags", TUCX_FLAG, &o.engine_tags},
                               {"repeat", TUCX_FLAG, &o.repeat},
                               {"inflight", TUCX_INT, &o.inflight},
                               {NULL, 0, NULL}};
    if (!tucx_parse(argc, argv, opts))
        return 2;
    if (o.port <= 0 || o.bytes == 0 || o.conns < 1 || o.conns > MAX_EPS - 2 || setup() != 0) {
        fprintf(stderr, "ucx_ring_attacker: bad arguments or no UCX\n");
        return 2;
    }
    int rc = strcmp(o.mode, "replay") == 0   ? do_replay(&o)
             : strcmp(o.mode, "flood") == 0  ? do_flood(&o)
             : strcmp(o.mode, "redial") == 0 ? do_redial(&o)
                                             : do_inject(&o);
    fflush(stdout);
    /* Exit without closing: the victim sees the connections drop. */
    _exit(rc);
}
