/* Helpers of the RPC suites test_rpc_*: a libuv server with test handlers
 * on the real stria.v1 service descriptors (a coordinator and a worker),
 * the blocking client's connection, and raw sockets that see a greeting
 * through. Static inline: each suite is one file. */
#ifndef STRIA_TEST_RPC_TEST_SERVICES_H
#define STRIA_TEST_RPC_TEST_SERVICES_H

#include <criterion/criterion.h>

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc_int.h"
#include "rpc_testutil.h"

/* Criterion 2.4.1 leaks a timer in its runner when a test with a longer
 * timeout runs before one with a shorter one: one timeout for every test. */
#define TEST_TIMEOUT_S 30

/* ---- test services ----------------------------------------------------- */

/* Coordinator.SubmitJob: replies after a delay, from a thread */
#define M_SUBMIT STRIA_RPC_COORDINATOR_SUBMIT_JOB
/* Coordinator.GetJob: replies from another thread at once */
#define M_GETJOB STRIA_RPC_COORDINATOR_GET_JOB
#define M_CANCEL STRIA_RPC_COORDINATOR_CANCEL_JOB /* admin */
#define M_STATUS STRIA_RPC_COORDINATOR_GET_STATUS /* replies inline */
/* Worker.SessionCall, a payload both ways: a put (put_req(), backward
 * unset) lands its payload in a buffer of the test; a get (get_req(),
 * backward set) replies with a payload */
#define M_CALL STRIA_RPC_WORKER_SESSION_CALL
#define M_OPEN STRIA_RPC_WORKER_OPEN_SESSION /* replies inline; takes no payload */
#define M_DROP STRIA_RPC_WORKER_DROP_JOB     /* not served */

static uint8_t *g_dest; /* where put payloads land */
static size_t g_dest_cap;
static int g_cleanups;        /* cleanup callbacks run (loop thread) */
static double g_hold_s = 0.3; /* SubmitJob reply delay */
static int g_posted;

static inline void status_handler(void *ctx, stria_rpc_call_t *call)
{
    Stria__V1__GetStatusReply rep = STRIA__V1__GET_STATUS_REPLY__INIT;
    (void)ctx;
    rep.software_version = (char *)"test";
    rep.uptime_ms = 42;
    rep.auth_required = stria_rpc_call_admin(call);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static inline void cancel_handler(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__CancelJobRequest *req =
        (const Stria__V1__CancelJobRequest *)stria_rpc_call_request(call);
    Stria__V1__CancelJobReply rep = STRIA__V1__CANCEL_JOB_REPLY__INIT;
    (void)ctx;
    if (req->job_id == 0) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "job 0 does not exist");
        return;
    }
    rep.state = STRIA__V1__JOB_STATE__JOB_STATE_CANCELLED;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

typedef struct {
    stria_rpc_call_t *call;
    double delay_s;
} later_t;

static inline void *reply_later(void *arg)
{
    later_t *l = arg;
    if (l->delay_s > 0)
        usleep((useconds_t)(l->delay_s * 1e6));
    if (stria_rpc_call_method(l->call) == M_GETJOB) {
        Stria__V1__GetJobReply rep = STRIA__V1__GET_JOB_REPLY__INIT;
        Stria__V1__JobInfo job = STRIA__V1__JOB_INFO__INIT;
        const Stria__V1__GetJobRequest *req =
            (const Stria__V1__GetJobRequest *)stria_rpc_call_request(l->call);
        job.job_id = req->job_id * 2;
        rep.job = &job;
        stria_rpc_call_reply(l->call, &rep.base, NULL, 0, NULL, NULL);
    } else {
        Stria__V1__SubmitJobReply rep = STRIA__V1__SUBMIT_JOB_REPLY__INIT;
        rep.state = STRIA__V1__JOB_STATE__JOB_STATE_LOADING;
        stria_rpc_call_reply(l->call, &rep.base, NULL, 0, NULL, NULL);
    }
    free(l);
    return NULL;
}

static pthread_t g_later[64];
static int g_n_later;

static inline void async_handler(void *ctx, stria_rpc_call_t *call)
{
    later_t *l = malloc(sizeof(*l));
    (void)ctx;
    l->call = call;
    l->delay_s = stria_rpc_call_method(call) == M_SUBMIT ? g_hold_s : 0.0;
    pthread_create(&g_later[g_n_later++], NULL, reply_later, l);
}

static inline void join_later(void)
{
    for (int i = 0; i < g_n_later; i++)
        pthread_join(g_later[i], NULL);
    g_n_later = 0;
}

static inline void count_cleanup(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&g_cleanups, 1, __ATOMIC_SEQ_CST);
}

/* A put: its payload lands at byte `offset` of g_dest (SessionCallRequest
 * .piece_offset). The payload callback takes rank 0 only. */
static inline Stria__V1__SessionCallRequest put_req(uint64_t offset)
{
    Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    req.piece_offset = offset;
    return req;
}

/* What a put's reply reports: the byte sum of what landed (worker_minflt),
 * and whether it landed in g_dest (stats.steps 1). */
static inline uint64_t put_sum(const stria_rpc_reply_t *rep)
{
    return ((const Stria__V1__SessionCallReply *)rep->msg)->worker_minflt;
}

static inline bool put_in_place(const stria_rpc_reply_t *rep)
{
    const Stria__V1__SessionCallReply *m = (const Stria__V1__SessionCallReply *)rep->msg;
    return m->stats != NULL && m->stats->steps == 1;
}

/* A get: the reply payload is bytes [offset, offset + n) of g_out, n the
 * rest of g_out, or at most max_bytes when not 0 (piece_offset and call of
 * a backward SessionCallRequest). */
static inline Stria__V1__SessionCallRequest get_req(uint64_t offset, uint64_t max_bytes)
{
    Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    req.backward = true;
    req.piece_offset = offset;
    req.call = max_bytes;
    return req;
}

static inline stria_status_t put_payload(void *ctx, stria_rpc_call_t *call, uint64_t len,
                                         void **buf_out)
{
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    (void)ctx;
    if (req->backward)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "a get takes no payload");
    if (req->rank != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "only rank 0 is accepted here");
    if (req->piece_offset + len > g_dest_cap)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "bytes [%llu, %llu) outside the tensor",
                               (unsigned long long)req->piece_offset,
                               (unsigned long long)(req->piece_offset + len));
    stria_rpc_call_set_cleanup(call, count_cleanup, NULL);
    *buf_out = g_dest + req->piece_offset;
    return STRIA_OK;
}

static inline void put_handler(stria_rpc_call_t *call)
{
    Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
    Stria__V1__PassStats stats = STRIA__V1__PASS_STATS__INIT;
    uint64_t len = 0;
    uint8_t *p = stria_rpc_call_payload(call, &len);
    uint64_t sum = 0;
    for (uint64_t i = 0; i < len; i++)
        sum += p[i];
    /* The reply reports the checksum of what landed, and where it landed. */
    rep.worker_minflt = sum;
    stats.steps = p >= g_dest && p < g_dest + g_dest_cap;
    rep.stats = &stats;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static uint8_t *g_out;
static size_t g_out_len;
static int g_out_done;

static inline void out_done(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&g_out_done, 1, __ATOMIC_SEQ_CST);
}

static inline void get_handler(stria_rpc_call_t *call)
{
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
    uint64_t n;
    if (req->piece_offset > g_out_len) {
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "offset past the end");
        return;
    }
    n = g_out_len - req->piece_offset;
    if (req->call && req->call < n)
        n = req->call;
    stria_rpc_call_reply(call, &rep.base, g_out + req->piece_offset, n, out_done, NULL);
}

/* SessionCall: a put or a get. */
static inline void call_handler(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    (void)ctx;
    if (req->backward)
        get_handler(call);
    else
        put_handler(call);
}

static inline void open_handler(void *ctx, stria_rpc_call_t *call)
{
    Stria__V1__OpenSessionReply rep = STRIA__V1__OPEN_SESSION_REPLY__INIT;
    (void)ctx;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static inline void posted(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&g_posted, 1, __ATOMIC_SEQ_CST);
}

static inline void posted_block(void *arg)
{
    (void)arg;
    usleep(1600000);
    __atomic_add_fetch(&g_posted, 1, __ATOMIC_SEQ_CST);
}

static stria_rpc_method_t g_coord_methods[STRIA_RPC_COORDINATOR_N_METHODS];
static stria_rpc_method_t g_worker_methods[STRIA_RPC_WORKER_N_METHODS];

static inline stria_rpc_server_t *start_coord(const char *token, const char *admin, double hello_s)
{
    stria_rpc_server_params_t p = {0};
    stria_rpc_server_t *srv = NULL;
    memset(g_coord_methods, 0, sizeof(g_coord_methods));
    g_coord_methods[M_STATUS] = (stria_rpc_method_t){.handler = status_handler,
                                                     .name = STRIA_RPC_COORDINATOR_GET_STATUS_NAME};
    g_coord_methods[M_CANCEL] = (stria_rpc_method_t){.handler = cancel_handler,
                                                     .flags = STRIA_RPC_METHOD_ADMIN,
                                                     .name = STRIA_RPC_COORDINATOR_CANCEL_JOB_NAME};
    g_coord_methods[M_SUBMIT] = (stria_rpc_method_t){.handler = async_handler,
                                                     .name = STRIA_RPC_COORDINATOR_SUBMIT_JOB_NAME};
    g_coord_methods[M_GETJOB] =
        (stria_rpc_method_t){.handler = async_handler, .name = STRIA_RPC_COORDINATOR_GET_JOB_NAME};
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__coordinator__descriptor;
    p.methods = g_coord_methods;
    p.token = token;
    p.admin_token = admin;
    p.hello_timeout_s = hello_s;
    p.name = "test-coord";
    cr_assert_eq(stria_rpc_server_start(&p, &srv), STRIA_OK, "%s", stria_error_msg());
    cr_assert_gt(stria_rpc_server_port(srv), 0);
    return srv;
}

static inline stria_rpc_server_t *start_worker(uint64_t max_payload)
{
    stria_rpc_server_params_t p = {0};
    stria_rpc_server_t *srv = NULL;
    memset(g_worker_methods, 0, sizeof(g_worker_methods));
    g_worker_methods[M_CALL] = (stria_rpc_method_t){.handler = call_handler,
                                                    .payload = put_payload,
                                                    .name = STRIA_RPC_WORKER_SESSION_CALL_NAME};
    g_worker_methods[M_OPEN] =
        (stria_rpc_method_t){.handler = open_handler, .name = STRIA_RPC_WORKER_OPEN_SESSION_NAME};
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__worker__descriptor;
    p.methods = g_worker_methods;
    p.max_payload_bytes = max_payload;
    p.name = "test-worker";
    cr_assert_eq(stria_rpc_server_start(&p, &srv), STRIA_OK, "%s", stria_error_msg());
    return srv;
}

static inline stria_rpc_client_t *connect_to(uint16_t port, const ProtobufCServiceDescriptor *svc,
                                             const char *token, stria_status_t *st_out)
{
    char addr[64];
    stria_rpc_client_params_t p = {0};
    stria_rpc_client_t *cl = NULL;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    p.address = addr;
    p.service = svc;
    p.token = token;
    p.client_name = "test";
    p.connect_timeout_s = 5;
    *st_out = stria_rpc_client_connect(&p, &cl);
    return cl;
}

static inline stria_status_t call_status(stria_rpc_client_t *cl, uint64_t *uptime_out)
{
    Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
    stria_rpc_request_t r = {.method = M_STATUS, .request = &req.base, .timeout_s = 5};
    stria_rpc_reply_t rep = {0};
    stria_status_t st = stria_rpc_client_call(cl, &r, &rep);
    if (st == STRIA_OK) {
        *uptime_out = ((Stria__V1__GetStatusReply *)rep.msg)->uptime_ms;
        stria_rpc_reply_free(&rep);
    }
    return st;
}

/* A valid GetStatus over a raw, already greeted socket. */
static inline void raw_status_ok(int fd, uint64_t id)
{
    Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
    rt_reply_t r;
    cr_assert(rt_send_frame(fd, rt_header(M_STATUS, id), &req.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000), "no reply to a valid request");
    cr_expect_eq(r.h.status, 0, "status %d: %s", r.h.status, r.err ? r.err->message : "");
    cr_expect_eq(r.h.request_id, id);
    cr_expect_eq(r.h.flags, STRIA_RPC_FLAG_REPLY);
    rt_reply_free(&r);
}

static inline int raw_greeted(uint16_t port)
{
    rt_reply_t r;
    int fd = rt_connect(port);
    cr_assert_geq(fd, 0);
    cr_assert(rt_hello(fd, "stria.v1.Coordinator", STRIA_RPC_VERSION));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_assert_eq(r.h.status, 0);
    cr_assert_eq(r.h.flags, STRIA_RPC_FLAG_REPLY | STRIA_RPC_FLAG_HELLO);
    rt_reply_free(&r);
    return fd;
}

#endif
