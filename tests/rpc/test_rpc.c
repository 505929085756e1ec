/* RPC suite: frame format, helpers, a libuv server with test handlers on the
 * real stria.v1 service descriptors, the blocking client, authentication and
 * every kind of bad input a peer can send. */
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
#define M_PUT    STRIA_RPC_WORKER_PUT_INPUT       /* payload into a buffer of the test */
#define M_GET    STRIA_RPC_WORKER_GET_OUTPUT      /* replies with a payload */
#define M_DROP   STRIA_RPC_WORKER_DROP_JOB        /* not served */

static uint8_t *g_dest; /* where PutInput payloads land */
static size_t g_dest_cap;
static int g_cleanups;        /* cleanup callbacks run (loop thread) */
static double g_hold_s = 0.3; /* SubmitJob reply delay */
static int g_posted;

static void status_handler(void *ctx, stria_rpc_call_t *call)
{
    Stria__V1__GetStatusReply rep = STRIA__V1__GET_STATUS_REPLY__INIT;
    (void)ctx;
    rep.software_version = (char *)"test";
    rep.uptime_ms = 42;
    rep.auth_required = stria_rpc_call_admin(call);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static void cancel_handler(void *ctx, stria_rpc_call_t *call)
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

static void *reply_later(void *arg)
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

static void async_handler(void *ctx, stria_rpc_call_t *call)
{
    later_t *l = malloc(sizeof(*l));
    (void)ctx;
    l->call = call;
    l->delay_s = stria_rpc_call_method(call) == M_SUBMIT ? g_hold_s : 0.0;
    pthread_create(&g_later[g_n_later++], NULL, reply_later, l);
}

static void join_later(void)
{
    for (int i = 0; i < g_n_later; i++)
        pthread_join(g_later[i], NULL);
    g_n_later = 0;
}

static void count_cleanup(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&g_cleanups, 1, __ATOMIC_SEQ_CST);
}

static stria_status_t put_payload(void *ctx, stria_rpc_call_t *call, uint64_t len, void **buf_out)
{
    const Stria__V1__PutInputRequest *req =
        (const Stria__V1__PutInputRequest *)stria_rpc_call_request(call);
    (void)ctx;
    if (req->tensor != STRIA__V1__TENSOR__TENSOR_Q)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "only Q is accepted here");
    if (req->offset + len > g_dest_cap)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "bytes [%llu, %llu) outside the tensor",
                               (unsigned long long)req->offset,
                               (unsigned long long)(req->offset + len));
    stria_rpc_call_set_cleanup(call, count_cleanup, NULL);
    *buf_out = g_dest + req->offset;
    return STRIA_OK;
}

static void put_handler(void *ctx, stria_rpc_call_t *call)
{
    Stria__V1__PutInputReply rep = STRIA__V1__PUT_INPUT_REPLY__INIT;
    uint64_t len = 0;
    uint8_t *p = stria_rpc_call_payload(call, &len);
    uint64_t sum = 0;
    (void)ctx;
    for (uint64_t i = 0; i < len; i++)
        sum += p[i];
    /* The reply reports the checksum of what landed, and where it landed. */
    rep.received_bytes = sum;
    rep.complete = p >= g_dest && p < g_dest + g_dest_cap;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static uint8_t *g_out;
static size_t g_out_len;
static int g_out_done;

static void out_done(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&g_out_done, 1, __ATOMIC_SEQ_CST);
}

static void get_handler(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__GetOutputRequest *req =
        (const Stria__V1__GetOutputRequest *)stria_rpc_call_request(call);
    Stria__V1__GetOutputReply rep = STRIA__V1__GET_OUTPUT_REPLY__INIT;
    uint64_t n;
    (void)ctx;
    if (req->offset > g_out_len) {
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "offset past the end");
        return;
    }
    n = g_out_len - req->offset;
    if (req->max_bytes && req->max_bytes < n)
        n = req->max_bytes;
    rep.tensor = req->tensor;
    rep.total_bytes = g_out_len;
    rep.offset = req->offset;
    stria_rpc_call_reply(call, &rep.base, g_out + req->offset, n, out_done, NULL);
}

static void posted(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&g_posted, 1, __ATOMIC_SEQ_CST);
}

static void posted_block(void *arg)
{
    (void)arg;
    usleep(1600000);
    __atomic_add_fetch(&g_posted, 1, __ATOMIC_SEQ_CST);
}

static stria_rpc_method_t g_coord_methods[STRIA_RPC_COORDINATOR_N_METHODS];
static stria_rpc_method_t g_worker_methods[STRIA_RPC_WORKER_N_METHODS];

static stria_rpc_server_t *start_coord(const char *token, const char *admin, double hello_s)
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

static stria_rpc_server_t *start_worker(uint64_t max_payload)
{
    stria_rpc_server_params_t p = {0};
    stria_rpc_server_t *srv = NULL;
    memset(g_worker_methods, 0, sizeof(g_worker_methods));
    g_worker_methods[M_PUT] = (stria_rpc_method_t){
        .handler = put_handler, .payload = put_payload, .name = STRIA_RPC_WORKER_PUT_INPUT_NAME};
    g_worker_methods[M_GET] =
        (stria_rpc_method_t){.handler = get_handler, .name = STRIA_RPC_WORKER_GET_OUTPUT_NAME};
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__worker__descriptor;
    p.methods = g_worker_methods;
    p.max_payload_bytes = max_payload;
    p.name = "test-worker";
    cr_assert_eq(stria_rpc_server_start(&p, &srv), STRIA_OK, "%s", stria_error_msg());
    return srv;
}

static stria_rpc_client_t *connect_to(uint16_t port, const ProtobufCServiceDescriptor *svc,
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

static stria_status_t call_status(stria_rpc_client_t *cl, uint64_t *uptime_out)
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
static void raw_status_ok(int fd, uint64_t id)
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

static int raw_greeted(uint16_t port)
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

/* ---- pure helpers ------------------------------------------------------ */

Test(rpc_frame, header_roundtrip_little_endian, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_header_t h = {.magic = STRIA_RPC_MAGIC,
                            .version = 1,
                            .flags = 3,
                            .method = 0x01020304,
                            .status = -13,
                            .request_id = 0x1122334455667788ull,
                            .pb_len = 0xa0b0c0d0,
                            .timeout_ms = 5000,
                            .payload_len = 0x0102030405060708ull};
    stria_rpc_header_t d;
    uint8_t b[STRIA_RPC_HEADER_SIZE];
    stria_rpc_header_encode(&h, b);
    cr_expect_eq(memcmp(b, "STRA", 4), 0, "magic bytes on the wire");
    cr_expect_eq(b[8], 0x04);
    cr_expect_eq(b[16], 0x88);
    cr_expect_eq(b[39], 0x01);
    stria_rpc_header_decode(b, &d);
    cr_expect_eq(memcmp(&h, &d, sizeof(h)), 0);
}

Test(rpc_frame, addr_parse, .timeout = TEST_TIMEOUT_S)
{
    char host[64];
    uint16_t port = 0;
    cr_expect_eq(stria_addr_parse("127.0.0.1:7000", host, sizeof(host), &port), STRIA_OK);
    cr_expect_str_eq(host, "127.0.0.1");
    cr_expect_eq(port, 7000);
    cr_expect_eq(stria_addr_parse("[::1]:0", host, sizeof(host), &port), STRIA_OK);
    cr_expect_str_eq(host, "::1");
    cr_expect_eq(port, 0);
    cr_expect_eq(stria_addr_parse("node-3:65535", host, sizeof(host), &port), STRIA_OK);
    const char *bad[] = {"",      "nohost", ":80",     "h:",      "h:65536",
                         "h:12a", "::1:80", "[::1]80", "h:123456"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_expect_eq(stria_addr_parse(bad[i], host, sizeof(host), &port), STRIA_ERR_INVALID_ARG,
                     "'%s' accepted", bad[i]);
        cr_expect(strstr(stria_error_msg(), "address") != NULL, "%s", stria_error_msg());
    }
    cr_expect_eq(stria_addr_parse("averyveryverylonghostname:1", host, 8, &port),
                 STRIA_ERR_INVALID_ARG);
}

Test(rpc_frame, token_compare, .timeout = TEST_TIMEOUT_S)
{
    cr_expect(stria_rpc_token_equal("secret", "secret"));
    cr_expect(!stria_rpc_token_equal("secret", "secreT"));
    cr_expect(!stria_rpc_token_equal("secret", "secret2"));
    cr_expect(!stria_rpc_token_equal("secret2", "secret"));
    cr_expect(!stria_rpc_token_equal("", "x"));
    cr_expect(stria_rpc_token_equal(NULL, ""));
}

Test(rpc_frame, token_file, .timeout = TEST_TIMEOUT_S)
{
    char path[] = "/tmp/stria-token-XXXXXX";
    int fd = mkstemp(path);
    char *tok = NULL;
    cr_assert_geq(fd, 0);
    cr_assert(write(fd, "  s3cr3t-token \nsecond line\n", 28) == 28);
    close(fd);
    cr_expect_eq(stria_rpc_token_read(path, &tok), STRIA_OK, "%s", stria_error_msg());
    cr_expect_str_eq(tok, "s3cr3t-token");
    free(tok);
    tok = NULL;
    fd = open(path, O_WRONLY | O_TRUNC);
    cr_assert(write(fd, "\n", 1) == 1);
    close(fd);
    cr_expect_eq(stria_rpc_token_read(path, &tok), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "empty") != NULL, "%s", stria_error_msg());
    fd = open(path, O_WRONLY | O_TRUNC);
    cr_assert(write(fd,
                    "ab\x01"
                    "cd",
                    5) == 5);
    close(fd);
    cr_expect_eq(stria_rpc_token_read(path, &tok), STRIA_ERR_INVALID_ARG);
    unlink(path);
    cr_expect_eq(stria_rpc_token_read(path, &tok), STRIA_ERR_IO);
    cr_expect(strstr(stria_error_msg(), path) != NULL, "%s", stria_error_msg());
    cr_expect_null(tok);
}

/* Decoding depth is bounded only if no message type contains itself. */
static bool reaches(const ProtobufCMessageDescriptor *from, const ProtobufCMessageDescriptor *to,
                    int depth)
{
    if (depth > 32)
        return true;
    for (unsigned i = 0; i < from->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &from->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (f->descriptor == to || reaches(f->descriptor, to, depth + 1))
            return true;
    }
    return false;
}

Test(rpc_frame, no_recursive_message_types, .timeout = TEST_TIMEOUT_S)
{
    const ProtobufCServiceDescriptor *svcs[] = {&stria__v1__coordinator__descriptor,
                                                &stria__v1__worker__descriptor};
    int checked = 0;
    for (int s = 0; s < 2; s++) {
        for (unsigned m = 0; m < svcs[s]->n_methods; m++) {
            const ProtobufCMessageDescriptor *io[] = {svcs[s]->methods[m].input,
                                                      svcs[s]->methods[m].output};
            for (int k = 0; k < 2; k++) {
                cr_expect(!reaches(io[k], io[k], 0), "%s is recursive", io[k]->name);
                checked++;
            }
        }
    }
    cr_expect_eq(checked, 2 * (13 + 7));
    cr_expect_eq(stria__v1__coordinator__descriptor.n_methods, 13);
    cr_expect_eq(stria__v1__worker__descriptor.n_methods, 7);
    cr_expect_str_eq(stria__v1__coordinator__descriptor.methods[M_CANCEL].name, "CancelJob");
    cr_expect_str_eq(stria__v1__worker__descriptor.methods[M_PUT].name, "PutInput");
}

Test(rpc_frame, decoding_budget_refuses_expansion, .timeout = TEST_TIMEOUT_S)
{
    /* 20000 empty job entries: 2 bytes each on the wire, far more unpacked. */
    Stria__V1__HeartbeatRequest hb = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    Stria__V1__WorkerJobStatus js = STRIA__V1__WORKER_JOB_STATUS__INIT;
    size_t n = 20000;
    Stria__V1__WorkerJobStatus **jobs = malloc(n * sizeof(*jobs));
    for (size_t i = 0; i < n; i++)
        jobs[i] = &js;
    hb.n_jobs = n;
    hb.jobs = jobs;
    size_t len = protobuf_c_message_get_packed_size(&hb.base);
    uint8_t *buf = malloc(len);
    protobuf_c_message_pack(&hb.base, buf);
    cr_expect_lt(len, 50000u);

    stria__rpc_arena_t *arena = stria__rpc_arena_create(len);
    cr_assert_not_null(
        stria__rpc_unpack(&stria__v1__heartbeat_request__descriptor, buf, len, arena),
        "a legitimate message fits the default budget: %s", stria_error_msg());
    stria__rpc_arena_destroy(arena);

    arena = stria__rpc_arena_create(len);
    arena->budget = 100000; /* less than 20000 unpacked entries need */
    cr_expect_null(stria__rpc_unpack(&stria__v1__heartbeat_request__descriptor, buf, len, arena));
    cr_expect(strstr(stria_error_msg(), "budget") != NULL, "%s", stria_error_msg());
    stria__rpc_arena_destroy(arena);
    free(buf);
    free(jobs);
}

/* ---- server and client ------------------------------------------------- */

Test(rpc, call_and_async_replies, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    stria_status_t st;
    stria_rpc_client_t *cl =
        connect_to(stria_rpc_server_port(srv), &stria__v1__coordinator__descriptor, NULL, &st);
    uint64_t up = 0;
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect(stria_rpc_client_admin(cl), "no admin token configured: admin for all");
    cr_expect_eq(stria_rpc_client_max_payload(cl), STRIA_RPC_DEFAULT_MAX_PAYLOAD);
    for (int i = 0; i < 50; i++) {
        cr_assert_eq(call_status(cl, &up), STRIA_OK, "%s", stria_error_msg());
        cr_assert_eq(up, 42);
    }
    /* A reply written by another thread. */
    Stria__V1__GetJobRequest gj = STRIA__V1__GET_JOB_REQUEST__INIT;
    gj.job_id = 21;
    stria_rpc_request_t r = {.method = M_GETJOB, .request = &gj.base, .timeout_s = 5};
    stria_rpc_reply_t rep = {0};
    cr_assert_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(((Stria__V1__GetJobReply *)rep.msg)->job->job_id, 42);
    stria_rpc_reply_free(&rep);
    /* An error reply keeps the connection in step. */
    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    stria_rpc_request_t rc = {.method = M_CANCEL, .request = &cj.base, .timeout_s = 5};
    cr_expect_eq(stria_rpc_client_call(cl, &rc, &rep), STRIA_ERR_NOT_FOUND);
    cr_expect(strstr(stria_error_msg(), "CancelJob: job 0 does not exist") != NULL, "%s",
              stria_error_msg());
    cr_expect_eq(call_status(cl, &up), STRIA_OK);
    /* A method without a handler. */
    Stria__V1__ListJobsRequest lj = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    stria_rpc_request_t rl = {
        .method = STRIA_RPC_COORDINATOR_LIST_JOBS, .request = &lj.base, .timeout_s = 5};
    cr_expect_eq(stria_rpc_client_call(cl, &rl, &rep), STRIA_ERR_UNSUPPORTED);
    cr_expect(strstr(stria_error_msg(), "ListJobs is not served") != NULL, "%s", stria_error_msg());
    /* Wrong request type for the method: refused locally. */
    stria_rpc_request_t rw = {.method = M_STATUS, .request = &lj.base, .timeout_s = 5};
    cr_expect_eq(stria_rpc_client_call(cl, &rw, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(call_status(cl, &up), STRIA_OK);
    /* Posted functions run on the loop thread. */
    cr_expect_eq(stria_rpc_server_post(srv, posted, NULL), STRIA_OK);
    for (int i = 0; i < 200 && __atomic_load_n(&g_posted, __ATOMIC_SEQ_CST) == 0; i++)
        usleep(5000);
    cr_expect_eq(g_posted, 1);
    /* The loop-age probe: small while the loop runs, growing while a
     * callback blocks it, small again after. */
    cr_expect_lt(stria_rpc_server_loop_age(srv), 0.6);
    cr_expect_eq(stria_rpc_server_post(srv, posted_block, NULL), STRIA_OK);
    usleep(1200000);
    double blocked_age = stria_rpc_server_loop_age(srv);
    cr_expect_gt(blocked_age, 0.8, "loop age %.3f s while the loop is blocked", blocked_age);
    for (int i = 0; i < 400 && __atomic_load_n(&g_posted, __ATOMIC_SEQ_CST) < 2; i++)
        usleep(5000);
    usleep(400000);
    cr_expect_lt(stria_rpc_server_loop_age(srv), 0.6);
    stria_rpc_client_close(cl);
    join_later();
    stria_rpc_server_stop(srv);
}

Test(rpc, deadline_then_reconnect, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    stria_status_t st;
    stria_rpc_client_t *cl =
        connect_to(stria_rpc_server_port(srv), &stria__v1__coordinator__descriptor, NULL, &st);
    Stria__V1__SubmitJobRequest sj = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_request_t r = {.method = M_SUBMIT, .request = &sj.base, .timeout_s = 0.1};
    stria_rpc_reply_t rep = {0};
    uint64_t up = 0;
    double t0 = stria_time_now();
    cr_assert_eq(st, STRIA_OK);
    g_hold_s = 0.5;
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_ERR_TIMEOUT);
    cr_expect_lt(stria_time_now() - t0, 0.4, "the deadline was not kept");
    cr_expect(strstr(stria_error_msg(), "SubmitJob") != NULL, "%s", stria_error_msg());
    /* The next call reconnects. */
    cr_expect_eq(call_status(cl, &up), STRIA_OK, "%s", stria_error_msg());
    /* With time enough, the same slow method answers. */
    r.timeout_s = 5;
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(((Stria__V1__SubmitJobReply *)rep.msg)->state,
                 STRIA__V1__JOB_STATE__JOB_STATE_LOADING);
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);
    join_later(); /* the late reply to the closed connection is dropped */
    stria_rpc_server_stop(srv);
}

typedef struct {
    stria_rpc_client_t *cl;
    double delay_s;
} abort_arg_t;

static void *abort_later(void *arg)
{
    abort_arg_t *a = arg;
    usleep((useconds_t)(a->delay_s * 1e6));
    stria_rpc_client_abort(a->cl);
    return NULL;
}

/* A call another thread gives up on ends at once, long before its deadline;
 * so does every later call on that client. */
Test(rpc, abort_ends_a_waiting_call, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    stria_status_t st;
    stria_rpc_client_t *cl =
        connect_to(stria_rpc_server_port(srv), &stria__v1__coordinator__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK);
    Stria__V1__SubmitJobRequest sj = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_request_t r = {.method = M_SUBMIT, .request = &sj.base, .timeout_s = 10};
    stria_rpc_reply_t rep = {0};
    g_hold_s = 3; /* the server sits on the call */
    abort_arg_t a = {.cl = cl, .delay_s = 0.2};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, abort_later, &a), 0);
    double t0 = stria_time_now();
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_ERR_CANCELLED, "%s", stria_error_msg());
    double took = stria_time_now() - t0;
    cr_expect_lt(took, 1.5, "the abandoned call took %.2f s", took);
    cr_expect(strstr(stria_error_msg(), "abandoned") != NULL, "%s", stria_error_msg());
    pthread_join(th, NULL);
    uint64_t up = 0;
    cr_expect_eq(call_status(cl, &up), STRIA_ERR_CANCELLED, "later calls fail too");
    stria_rpc_client_close(cl);
    join_later();
    stria_rpc_server_stop(srv);
}

Test(rpc, payloads_land_in_place, .timeout = TEST_TIMEOUT_S)
{
    size_t n = 3u << 20;
    stria_rpc_server_t *srv;
    stria_rpc_client_t *cl;
    stria_status_t st;
    uint8_t *src = malloc(n);
    uint64_t sum = 0;
    g_dest = calloc(1, n);
    g_dest_cap = n;
    for (size_t i = 0; i < n; i++) {
        src[i] = (uint8_t)(i * 7 + (i >> 13));
        sum += src[i];
    }
    srv = start_worker(0);
    cl = connect_to(stria_rpc_server_port(srv), &stria__v1__worker__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());

    /* Two frames, each straight into its half of the destination. */
    Stria__V1__PutInputRequest put = STRIA__V1__PUT_INPUT_REQUEST__INIT;
    stria_rpc_reply_t rep = {0};
    uint64_t got = 0;
    put.tensor = STRIA__V1__TENSOR__TENSOR_Q;
    put.total_bytes = n;
    for (size_t off = 0; off < n; off += n / 2) {
        stria_rpc_request_t r = {.method = M_PUT,
                                 .request = &put.base,
                                 .payload = src + off,
                                 .payload_len = n / 2,
                                 .timeout_s = 10};
        put.offset = off;
        cr_assert_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_OK, "%s", stria_error_msg());
        got += ((Stria__V1__PutInputReply *)rep.msg)->received_bytes;
        cr_expect(((Stria__V1__PutInputReply *)rep.msg)->complete);
        stria_rpc_reply_free(&rep);
    }
    cr_expect_eq(got, sum);
    cr_expect_eq(memcmp(g_dest, src, n), 0, "payload bytes differ at the destination");

    /* Refused by the payload callback: skipped, error, connection in step. */
    stria_rpc_request_t bad = {.method = M_PUT,
                               .request = &put.base,
                               .payload = src,
                               .payload_len = 4096,
                               .timeout_s = 10};
    put.offset = n - 100;
    cr_expect_eq(stria_rpc_client_call(cl, &bad, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "outside the tensor") != NULL, "%s", stria_error_msg());
    put.offset = 0;
    put.tensor = STRIA__V1__TENSOR__TENSOR_K;
    cr_expect_eq(stria_rpc_client_call(cl, &bad, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "only Q") != NULL, "%s", stria_error_msg());

    /* A payload to a method that takes none. */
    Stria__V1__GetOutputRequest go = STRIA__V1__GET_OUTPUT_REQUEST__INIT;
    stria_rpc_request_t gp = {
        .method = M_GET, .request = &go.base, .payload = src, .payload_len = 10, .timeout_s = 10};
    cr_expect_eq(stria_rpc_client_call(cl, &gp, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "takes no payload") != NULL, "%s", stria_error_msg());

    /* Reply payload into the caller's buffer, sent from the handler's. */
    g_out = src;
    g_out_len = n;
    uint8_t *dst = calloc(1, n);
    stria_rpc_request_t gr = {.method = M_GET,
                              .request = &go.base,
                              .reply_buf = dst,
                              .reply_buf_cap = n,
                              .timeout_s = 10};
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload, dst);
    cr_expect_eq(rep.payload_len, n);
    cr_expect_eq(memcmp(dst, src, n), 0);
    stria_rpc_reply_free(&rep);
    /* Too small a buffer: clear error, connection still usable. */
    gr.reply_buf_cap = n / 2;
    cr_expect_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_ERR_NO_MEMORY);
    cr_expect(strstr(stria_error_msg(), "does not fit") != NULL, "%s", stria_error_msg());
    /* An allocated reply payload, part of the tensor. */
    go.offset = 5;
    go.max_bytes = 1000;
    gr.reply_buf = NULL;
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload_len, 1000);
    cr_expect_eq(memcmp(rep.payload, src + 5, 1000), 0);
    stria_rpc_reply_free(&rep);
    /* Not served. */
    Stria__V1__DropJobRequest dj = STRIA__V1__DROP_JOB_REQUEST__INIT;
    stria_rpc_request_t dr = {.method = M_DROP, .request = &dj.base, .timeout_s = 10};
    cr_expect_eq(stria_rpc_client_call(cl, &dr, &rep), STRIA_ERR_UNSUPPORTED);
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
    cr_expect_eq(g_out_done, 3, "payload_done must run once per payload reply");
    cr_expect_eq(g_cleanups, 2, "cleanup must run once per accepted payload");
    free(dst);
    free(src);
    free(g_dest);
}

/* Cuts [0, n) into `count` pieces of pseudo-random sizes (some empty), in
 * an order that is not the address order: piece i covers the bytes after
 * piece i - 1 of a permutation of the buffer's blocks. */
static struct iovec *pieces(uint8_t *buf, size_t n, size_t count, size_t **order_out)
{
    struct iovec *iov = calloc(count, sizeof(*iov));
    size_t *cut = calloc(count + 1, sizeof(*cut)), *order = calloc(count, sizeof(*order));
    uint64_t s = 12345;
    for (size_t i = 1; i < count; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        cut[i] = (size_t)(s >> 33) % n;
    }
    cut[count] = n;
    for (size_t i = 1; i < count; i++) /* sorted cuts: pieces of the buffer */
        for (size_t j = i; j > 1 && cut[j - 1] > cut[j]; j--) {
            size_t t = cut[j];
            cut[j] = cut[j - 1];
            cut[j - 1] = t;
        }
    for (size_t i = 0; i < count; i++) /* sent in the order 0, 2, 4, ..., then 1, 3, ... */
        order[i] = i < (count + 1) / 2 ? 2 * i : 2 * (i - (count + 1) / 2) + 1;
    for (size_t i = 0; i < count; i++) {
        iov[i].iov_base = buf + cut[order[i]];
        iov[i].iov_len = cut[order[i] + 1] - cut[order[i]];
    }
    free(cut);
    *order_out = order;
    return iov;
}

Test(rpc, scattered_payloads_in_pieces, .timeout = TEST_TIMEOUT_S)
{
    const size_t n = 1u << 20, count = 3000; /* more pieces than one sendmsg takes */
    stria_rpc_server_t *srv;
    stria_rpc_client_t *cl;
    stria_status_t st;
    uint8_t *src = malloc(n), *dst = calloc(1, n);
    size_t *order;
    for (size_t i = 0; i < n; i++)
        src[i] = (uint8_t)(i * 13 + (i >> 11));
    g_dest = calloc(1, n);
    g_dest_cap = n;
    srv = start_worker(0);
    cl = connect_to(stria_rpc_server_port(srv), &stria__v1__worker__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());

    /* A request payload gathered from the pieces lands as their concatenation. */
    struct iovec *iov = pieces(src, n, count, &order);
    Stria__V1__PutInputRequest put = STRIA__V1__PUT_INPUT_REQUEST__INIT;
    put.tensor = STRIA__V1__TENSOR__TENSOR_Q;
    put.total_bytes = n;
    stria_rpc_request_t r = {.method = M_PUT,
                             .request = &put.base,
                             .payload_iov = iov,
                             .payload_iovcnt = count,
                             .timeout_s = 10};
    stria_rpc_reply_t rep = {0};
    cr_assert_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    size_t at = 0;
    for (size_t i = 0; i < count; at += iov[i].iov_len, i++)
        cr_assert_eq(memcmp(g_dest + at, iov[i].iov_base, iov[i].iov_len), 0,
                     "piece %zu (of %zu bytes) landed wrong", i, iov[i].iov_len);
    cr_assert_eq(at, n);
    free(iov);
    free(order);

    /* A reply payload scattered into pieces of the caller's buffer. */
    g_out = src;
    g_out_len = n;
    iov = pieces(dst, n, count, &order);
    Stria__V1__GetOutputRequest go = STRIA__V1__GET_OUTPUT_REQUEST__INIT;
    stria_rpc_request_t gr = {.method = M_GET,
                              .request = &go.base,
                              .reply_iov = iov,
                              .reply_iovcnt = count,
                              .timeout_s = 10};
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload_len, n);
    stria_rpc_reply_free(&rep);
    at = 0;
    for (size_t i = 0; i < count; at += iov[i].iov_len, i++)
        cr_assert_eq(memcmp(iov[i].iov_base, src + at, iov[i].iov_len), 0,
                     "reply piece %zu (of %zu bytes) wrong", i, iov[i].iov_len);
    /* a shorter reply fills the first pieces only */
    memset(dst, 0, n);
    go.max_bytes = 1000;
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload_len, 1000);
    stria_rpc_reply_free(&rep);
    at = 0;
    for (size_t i = 0; i < count && at < 1000; at += iov[i].iov_len, i++) {
        size_t len = iov[i].iov_len < 1000 - at ? iov[i].iov_len : 1000 - at;
        cr_assert_eq(memcmp(iov[i].iov_base, src + at, len), 0);
    }
    /* pieces too small for the reply: a clear error, the connection in step */
    go.max_bytes = 0;
    gr.reply_iovcnt = 1;
    cr_expect_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_ERR_NO_MEMORY);
    cr_expect(strstr(stria_error_msg(), "does not fit") != NULL, "%s", stria_error_msg());
    /* a payload and pieces at once: refused */
    r.payload = src;
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_ERR_INVALID_ARG);
    r.payload = NULL;
    go.max_bytes = 10;
    gr.reply_iovcnt = count;
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
    free(iov);
    free(order);
    free(src);
    free(dst);
    free(g_dest);
}

/* Calls pipelined on one connection: every payload lands, a refused one in
 * the middle reports its error while the others still land and the
 * connection stays in step, and replies come back to their own requests. */
Test(rpc, pipelined_batch, .timeout = TEST_TIMEOUT_S)
{
    const size_t n = 6u << 20, k = 6, part = n / k;
    stria_rpc_server_t *srv;
    stria_rpc_client_t *cl;
    stria_status_t st;
    uint8_t *src = malloc(n), *dst = calloc(1, n);
    for (size_t i = 0; i < n; i++)
        src[i] = (uint8_t)(i * 31 + (i >> 9));
    g_dest = calloc(1, n);
    g_dest_cap = n;
    srv = start_worker(0);
    cl = connect_to(stria_rpc_server_port(srv), &stria__v1__worker__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());

    Stria__V1__PutInputRequest put[6];
    stria_rpc_request_t rq[6];
    stria_rpc_reply_t rep[6];
    for (size_t i = 0; i < k; i++) {
        put[i] = (Stria__V1__PutInputRequest)STRIA__V1__PUT_INPUT_REQUEST__INIT;
        put[i].tensor = STRIA__V1__TENSOR__TENSOR_Q;
        put[i].offset = i * part;
        put[i].total_bytes = n;
        rq[i] = (stria_rpc_request_t){.method = M_PUT,
                                      .request = &put[i].base,
                                      .payload = src + i * part,
                                      .payload_len = part,
                                      .timeout_s = 10};
    }
    cr_assert_eq(stria_rpc_client_call_batch(cl, rq, k, rep), STRIA_OK, "%s", stria_error_msg());
    for (size_t i = 0; i < k; i++) {
        uint64_t sum = 0;
        for (size_t b = 0; b < part; b++)
            sum += src[i * part + b];
        cr_expect_eq(((Stria__V1__PutInputReply *)rep[i].msg)->received_bytes, sum,
                     "reply %zu is not its own request's", i);
        stria_rpc_reply_free(&rep[i]);
    }
    cr_expect_eq(memcmp(g_dest, src, n), 0);

    /* the third is refused (outside the tensor): its error, the rest lands */
    memset(g_dest, 0, n);
    put[2].offset = n;
    cr_expect_eq(stria_rpc_client_call_batch(cl, rq, k, rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "outside the tensor") != NULL, "%s", stria_error_msg());
    for (size_t i = 0; i < k; i++) {
        cr_expect_null(rep[i].msg, "replies are freed after a failure");
        if (i != 2)
            cr_expect_eq(memcmp(g_dest + i * part, src + i * part, part), 0, "part %zu", i);
    }
    put[2].offset = 2 * part;

    /* pipelined replies into their own buffers */
    g_out = src;
    g_out_len = n;
    Stria__V1__GetOutputRequest go[6];
    for (size_t i = 0; i < k; i++) {
        go[i] = (Stria__V1__GetOutputRequest)STRIA__V1__GET_OUTPUT_REQUEST__INIT;
        go[i].offset = i * part;
        go[i].max_bytes = part;
        rq[i] = (stria_rpc_request_t){.method = M_GET,
                                      .request = &go[i].base,
                                      .reply_buf = dst + (k - 1 - i) * part,
                                      .reply_buf_cap = part,
                                      .timeout_s = 10};
    }
    cr_assert_eq(stria_rpc_client_call_batch(cl, rq, k, rep), STRIA_OK, "%s", stria_error_msg());
    for (size_t i = 0; i < k; i++) {
        cr_expect_eq(rep[i].payload_len, part);
        cr_expect_eq(memcmp(dst + (k - 1 - i) * part, src + i * part, part), 0, "reply %zu", i);
        stria_rpc_reply_free(&rep[i]);
    }
    cr_expect_eq(stria_rpc_client_call_batch(cl, rq, 0, rep), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_rpc_client_call_batch(cl, rq, STRIA_RPC_MAX_BATCH + 1, rep),
                 STRIA_ERR_INVALID_ARG);
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
    free(src);
    free(dst);
    free(g_dest);
}

Test(rpc, oversized_payload_refused_before_sending, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_worker(1000);
    stria_status_t st;
    stria_rpc_client_t *cl =
        connect_to(stria_rpc_server_port(srv), &stria__v1__worker__descriptor, NULL, &st);
    uint8_t buf[2000] = {0};
    Stria__V1__PutInputRequest put = STRIA__V1__PUT_INPUT_REQUEST__INIT;
    stria_rpc_request_t r = {.method = M_PUT,
                             .request = &put.base,
                             .payload = buf,
                             .payload_len = sizeof(buf),
                             .timeout_s = 5};
    stria_rpc_reply_t rep = {0};
    cr_assert_eq(st, STRIA_OK);
    cr_expect_eq(stria_rpc_client_max_payload(cl), 1000);
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "exceeds the server's limit") != NULL, "%s",
              stria_error_msg());
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
}

Test(rpc, oversized_reply_refused_by_the_client, .timeout = TEST_TIMEOUT_S)
{
    /* The server may send any reply; the client's own cap protects it from a
     * server that announces more than the caller is willing to receive. */
    enum { CAP = 1000 };
    size_t n = 5000;
    char addr[64];
    stria_rpc_client_params_t p = {0};
    stria_rpc_client_t *cl = NULL;
    stria_rpc_server_t *srv = start_worker(0);
    uint8_t *src = malloc(n);
    for (size_t i = 0; i < n; i++)
        src[i] = (uint8_t)i;
    g_out = src;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", stria_rpc_server_port(srv));
    p.address = addr;
    p.service = &stria__v1__worker__descriptor;
    p.client_name = "test";
    p.connect_timeout_s = 5;
    p.max_payload_bytes = CAP;
    cr_assert_eq(stria_rpc_client_connect(&p, &cl), STRIA_OK, "%s", stria_error_msg());

    Stria__V1__GetOutputRequest go = STRIA__V1__GET_OUTPUT_REQUEST__INIT;
    stria_rpc_request_t gr = {.method = M_GET, .request = &go.base, .timeout_s = 10};
    stria_rpc_reply_t rep = {0};
    /* At the cap: accepted. */
    g_out_len = CAP;
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload_len, CAP);
    stria_rpc_reply_free(&rep);
    /* One byte over: refused before it is read, naming the limit. */
    g_out_len = CAP + 1;
    cr_expect_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "reply payload of 1001 bytes") != NULL, "%s",
              stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "limit of 1000") != NULL, "%s", stria_error_msg());
    cr_expect_null(rep.payload);
    /* Far over: the same, without trying to allocate it. */
    g_out_len = n;
    cr_expect_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "exceeds the limit") != NULL, "%s", stria_error_msg());
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
    free(src);
}

/* ---- authentication ---------------------------------------------------- */

Test(rpc_auth, tokens, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord("user-token", "admin-token", 0);
    uint16_t port = stria_rpc_server_port(srv);
    stria_status_t st;
    stria_rpc_client_t *cl;
    uint64_t up = 0;

    cl = connect_to(port, &stria__v1__coordinator__descriptor, NULL, &st);
    cr_expect_eq(st, STRIA_ERR_AUTH, "no token: %s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "missing token") != NULL, "%s", stria_error_msg());
    cr_expect_null(cl);
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "user-tokeN", &st);
    cr_expect_eq(st, STRIA_ERR_AUTH, "wrong token: %s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "wrong token") != NULL, "%s", stria_error_msg());
    cr_expect_null(cl);
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "user-token-longer", &st);
    cr_expect_eq(st, STRIA_ERR_AUTH);

    /* The right user token: normal calls yes, admin calls no. */
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "user-token", &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect(!stria_rpc_client_admin(cl));
    cr_expect_eq(call_status(cl, &up), STRIA_OK);
    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    cj.job_id = 5;
    stria_rpc_request_t rc = {.method = M_CANCEL, .request = &cj.base, .timeout_s = 5};
    stria_rpc_reply_t rep = {0};
    cr_expect_eq(stria_rpc_client_call(cl, &rc, &rep), STRIA_ERR_AUTH);
    cr_expect(strstr(stria_error_msg(), "CancelJob needs the admin token") != NULL, "%s",
              stria_error_msg());
    cr_expect_eq(call_status(cl, &up), STRIA_OK, "refused admin call keeps the connection");
    stria_rpc_client_close(cl);

    /* The admin token: everything. */
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "admin-token", &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect(stria_rpc_client_admin(cl));
    cr_expect_eq(stria_rpc_client_call(cl, &rc, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(((Stria__V1__CancelJobReply *)rep.msg)->state,
                 STRIA__V1__JOB_STATE__JOB_STATE_CANCELLED);
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);

    /* A raw request before any hello is refused and the connection closed. */
    int fd = rt_connect(port);
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    rt_reply_t r;
    cr_assert(rt_send_frame(fd, rt_header(M_STATUS, 9), &gs.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH);
    cr_expect(strstr(r.err->message, "must be a hello") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);
    stria_rpc_server_stop(srv);
}

Test(rpc_auth, admin_token_only, .timeout = TEST_TIMEOUT_S)
{
    /* Any credential turns every hello into a challenge: with only an admin
     * one, a connection without it is refused (no role is open by
     * default), and the admin one gets the admin role only. */
    stria_rpc_server_t *srv = start_coord(NULL, "admin-token", 0);
    uint16_t port = stria_rpc_server_port(srv);
    stria_status_t st;
    stria_rpc_client_t *cl = connect_to(port, &stria__v1__coordinator__descriptor, NULL, &st);
    cr_expect_eq(st, STRIA_ERR_AUTH, "%s", stria_error_msg());
    cr_expect_null(cl);
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "admin-token", &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect(stria_rpc_client_admin(cl));
    cr_expect_eq(stria_rpc_client_roles(cl), STRIA_RPC_ROLE_ADMIN);
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
}

/* Answers every call "served" (status not found): the call got through. */
static void served_handler(void *ctx, stria_rpc_call_t *call)
{
    (void)ctx;
    stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "served");
}

/* A server with the three credentials, methods restricted by role. */
static stria_rpc_server_t *start_roles(void)
{
    stria_rpc_server_params_t p = {0};
    stria_rpc_server_t *srv = NULL;
    memset(g_coord_methods, 0, sizeof(g_coord_methods));
    g_coord_methods[M_STATUS] = (stria_rpc_method_t){.handler = status_handler,
                                                     .name = STRIA_RPC_COORDINATOR_GET_STATUS_NAME};
    g_coord_methods[M_CANCEL] = (stria_rpc_method_t){.handler = served_handler,
                                                     .flags = STRIA_RPC_METHOD_ADMIN,
                                                     .name = STRIA_RPC_COORDINATOR_CANCEL_JOB_NAME};
    g_coord_methods[STRIA_RPC_COORDINATOR_REGISTER_WORKER] =
        (stria_rpc_method_t){.handler = served_handler,
                             .flags = STRIA_RPC_METHOD_WORKER,
                             .name = STRIA_RPC_COORDINATOR_REGISTER_WORKER_NAME};
    g_coord_methods[M_SUBMIT] = (stria_rpc_method_t){.handler = served_handler,
                                                     .flags = STRIA_RPC_METHOD_CLIENT,
                                                     .name = STRIA_RPC_COORDINATOR_SUBMIT_JOB_NAME};
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__coordinator__descriptor;
    p.methods = g_coord_methods;
    p.token = "client-token";
    p.worker_token = "worker-token";
    p.admin_token = "admin-token";
    p.name = "test-roles";
    cr_assert_eq(stria_rpc_server_start(&p, &srv), STRIA_OK, "%s", stria_error_msg());
    return srv;
}

/* The status of calling `method` (STRIA_ERR_NOT_FOUND "served" when the
 * handler ran). */
static stria_status_t call_method(stria_rpc_client_t *cl, uint32_t method)
{
    Stria__V1__RegisterWorkerRequest rw = STRIA__V1__REGISTER_WORKER_REQUEST__INIT;
    Stria__V1__SubmitJobRequest sj = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    const ProtobufCMessage *req = method == M_SUBMIT   ? &sj.base
                                  : method == M_CANCEL ? &cj.base
                                                       : &rw.base;
    stria_rpc_request_t r = {.method = method, .request = req, .timeout_s = 5};
    stria_rpc_reply_t rep = {0};
    stria_status_t st = stria_rpc_client_call(cl, &r, &rep);
    stria_rpc_reply_free(&rep);
    return st;
}

Test(rpc_auth, each_credential_is_one_role, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_roles();
    uint16_t port = stria_rpc_server_port(srv);
    const char *tokens[3] = {"client-token", "worker-token", "admin-token"};
    const unsigned roles[3] = {STRIA_RPC_ROLE_CLIENT, STRIA_RPC_ROLE_WORKER, STRIA_RPC_ROLE_ADMIN};
    /* register (worker only), submit (client or admin), cancel (admin only) */
    const bool allowed[3][3] = {{false, true, false}, {true, false, false}, {false, true, true}};
    const uint32_t methods[3] = {STRIA_RPC_COORDINATOR_REGISTER_WORKER, M_SUBMIT, M_CANCEL};
    for (int i = 0; i < 3; i++) {
        stria_status_t st;
        stria_rpc_client_t *cl =
            connect_to(port, &stria__v1__coordinator__descriptor, tokens[i], &st);
        cr_assert_eq(st, STRIA_OK, "%s: %s", tokens[i], stria_error_msg());
        cr_expect_eq(stria_rpc_client_roles(cl), roles[i], "%s", tokens[i]);
        for (int m = 0; m < 3; m++) {
            st = call_method(cl, methods[m]);
            if (allowed[i][m]) {
                cr_expect_eq(st, STRIA_ERR_NOT_FOUND, "%s method %u: %s", tokens[i], methods[m],
                             stria_error_msg());
                cr_expect(strstr(stria_error_msg(), "served") != NULL, "%s", stria_error_msg());
            } else {
                cr_expect_eq(st, STRIA_ERR_AUTH, "%s method %u refused", tokens[i], methods[m]);
                cr_expect(strstr(stria_error_msg(), "needs the") != NULL, "%s", stria_error_msg());
            }
        }
        stria_rpc_client_close(cl);
    }
    stria_rpc_server_stop(srv);

    /* Two roles with one credential would make the role ambiguous. */
    stria_rpc_server_params_t p = {0};
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__coordinator__descriptor;
    p.methods = g_coord_methods;
    p.token = "same";
    p.worker_token = "same";
    cr_expect_eq(stria_rpc_server_start(&p, &srv), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "client and worker credentials are the same") != NULL, "%s",
              stria_error_msg());
}

/* The first hello's reply on a raw connection: its server nonce. */
static void raw_challenge(int fd, uint8_t nonce[STRIA_AUTH_NONCE_BYTES], bool *challenge)
{
    rt_reply_t r;
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_assert_eq(r.h.status, 0);
    Stria__V1__HelloReply *rep = stria__v1__hello_reply__unpack(NULL, r.h.pb_len, r.pb);
    cr_assert_not_null(rep);
    cr_assert_eq(rep->server_nonce.len, STRIA_AUTH_NONCE_BYTES);
    memcpy(nonce, rep->server_nonce.data, STRIA_AUTH_NONCE_BYTES);
    *challenge = rep->challenge;
    stria__v1__hello_reply__free_unpacked(rep, NULL);
    rt_reply_free(&r);
}

/* Sends the second hello with a given proof. */
static void raw_send_proof(int fd, const uint8_t *proof, size_t len)
{
    Stria__V1__HelloRequest hello = STRIA__V1__HELLO_REQUEST__INIT;
    stria_rpc_header_t h = rt_header(0, 2);
    h.flags = STRIA_RPC_FLAG_HELLO;
    hello.protocol_version = STRIA_RPC_VERSION;
    hello.service = (char *)"stria.v1.Coordinator";
    hello.proof.data = (uint8_t *)proof;
    hello.proof.len = len;
    cr_assert(rt_send_frame(fd, h, &hello.base, NULL, 0));
}

Test(rpc_auth, a_captured_handshake_replayed_on_a_new_connection_is_refused,
     .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_roles();
    uint16_t port = stria_rpc_server_port(srv);
    uint8_t sn[STRIA_AUTH_NONCE_BYTES], cn[STRIA_AUTH_NONCE_BYTES], proof[STRIA_AUTH_MAC_BYTES];
    bool challenge = false;
    rt_reply_t r;

    /* An honest handshake, as an eavesdropper records it: both hellos. */
    int fd = rt_connect(port);
    cr_assert(rt_hello(fd, "stria.v1.Coordinator", STRIA_RPC_VERSION));
    memcpy(cn, rt_client_nonce, sizeof(cn));
    raw_challenge(fd, sn, &challenge);
    cr_assert(challenge);
    stria_auth_hello_mac("admin-token", "stria.v1.Coordinator", cn, sn, false, proof);
    raw_send_proof(fd, proof, sizeof(proof));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_assert_eq(r.h.status, 0, "the honest proof: %s", r.err ? r.err->message : "");
    rt_reply_free(&r);
    close(fd);

    /* The attacker replays the recorded client frames on a new connection:
     * the same client nonce, the same proof; the server's nonce is new. */
    fd = rt_connect(port);
    Stria__V1__HelloRequest hello = STRIA__V1__HELLO_REQUEST__INIT;
    stria_rpc_header_t h = rt_header(0, 1);
    h.flags = STRIA_RPC_FLAG_HELLO;
    hello.protocol_version = STRIA_RPC_VERSION;
    hello.service = (char *)"stria.v1.Coordinator";
    hello.client_nonce.data = cn;
    hello.client_nonce.len = sizeof(cn);
    cr_assert(rt_send_frame(fd, h, &hello.base, NULL, 0));
    uint8_t sn2[STRIA_AUTH_NONCE_BYTES];
    raw_challenge(fd, sn2, &challenge);
    cr_expect(memcmp(sn, sn2, sizeof(sn)) != 0, "every connection gets a fresh server nonce");
    raw_send_proof(fd, proof, sizeof(proof));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH, "a replayed proof must be refused");
    cr_expect(r.err && strstr(r.err->message, "wrong token") != NULL, "%s",
              r.err ? r.err->message : "");
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);

    /* A token sent in clear (as older clients did) is refused too. */
    fd = rt_connect(port);
    hello.token = (char *)"admin-token";
    cr_assert(rt_send_frame(fd, h, &hello.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH);
    cr_expect(r.err && strstr(r.err->message, "clear text") != NULL, "%s",
              r.err ? r.err->message : "");
    rt_reply_free(&r);
    close(fd);
    stria_rpc_server_stop(srv);
}

/* A fake server that records what a client sends in its hello: it answers
 * the first hello with a challenge and the second with an error. */
typedef struct {
    int listen_fd;
    uint8_t seen[8192];
    size_t n_seen;
} fake_srv_t;

static void *fake_server(void *arg)
{
    fake_srv_t *f = arg;
    int fd = accept(f->listen_fd, NULL, NULL);
    if (fd < 0)
        return NULL;
    for (int frame = 0; frame < 2; frame++) {
        uint8_t hb[STRIA_RPC_HEADER_SIZE];
        stria_rpc_header_t h;
        if (rt_recv(fd, hb, sizeof(hb), 5000) != (ssize_t)sizeof(hb))
            break;
        stria_rpc_header_decode(hb, &h);
        if (h.pb_len > sizeof(f->seen) - f->n_seen - sizeof(hb))
            break;
        memcpy(f->seen + f->n_seen, hb, sizeof(hb));
        f->n_seen += sizeof(hb);
        if (rt_recv(fd, f->seen + f->n_seen, h.pb_len, 5000) != (ssize_t)h.pb_len)
            break;
        f->n_seen += h.pb_len;
        Stria__V1__HelloReply rep = STRIA__V1__HELLO_REPLY__INIT;
        uint8_t nonce[STRIA_AUTH_NONCE_BYTES] = {1, 2, 3};
        stria_rpc_header_t rh = rt_header(0, h.request_id);
        rh.flags = STRIA_RPC_FLAG_REPLY | STRIA_RPC_FLAG_HELLO;
        rep.protocol_version = STRIA_RPC_VERSION;
        rep.service = (char *)"stria.v1.Coordinator";
        rep.server_nonce.data = nonce;
        rep.server_nonce.len = sizeof(nonce);
        rep.challenge = frame == 0;
        if (!rt_send_frame(fd, rh, &rep.base, NULL, 0))
            break;
    }
    close(fd);
    return NULL;
}

Test(rpc_auth, the_token_never_travels_and_the_server_must_prove_it, .timeout = TEST_TIMEOUT_S)
{
    fake_srv_t f = {0};
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t al = sizeof(a);
    pthread_t th;
    stria_status_t st;
    const char *token = "a-token-that-must-not-travel-0123456789";
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    f.listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(bind(f.listen_fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
              listen(f.listen_fd, 1) == 0 &&
              getsockname(f.listen_fd, (struct sockaddr *)&a, &al) == 0);
    pthread_create(&th, NULL, fake_server, &f);
    stria_rpc_client_t *cl =
        connect_to(ntohs(a.sin_port), &stria__v1__coordinator__descriptor, token, &st);
    pthread_join(th, NULL);
    close(f.listen_fd);
    /* The fake server knows no token: its final reply proves nothing. */
    cr_expect_null(cl);
    cr_expect_eq(st, STRIA_ERR_AUTH, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "did not prove") != NULL, "%s", stria_error_msg());
    cr_assert_gt(f.n_seen, 2 * STRIA_RPC_HEADER_SIZE, "both hellos were sent");
    cr_expect_null(memmem(f.seen, f.n_seen, token, strlen(token)),
                   "the token appears in the bytes the client sent");
    cr_expect_null(memmem(f.seen, f.n_seen, token + 8, 8), "a piece of the token was sent");

    /* A client with a token refuses a server that checks none. */
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    cl = connect_to(stria_rpc_server_port(srv), &stria__v1__coordinator__descriptor, token, &st);
    cr_expect_null(cl);
    cr_expect_eq(st, STRIA_ERR_AUTH);
    cr_expect(strstr(stria_error_msg(), "checks no credential") != NULL, "%s", stria_error_msg());
    stria_rpc_server_stop(srv);
}

/* A GetOutput handler that serves job 7 only to who proves g_job_secret. */
static stria_job_secret_t g_job_secret = {{7, 7, 7}};

static void proof_handler(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__GetOutputRequest *req =
        (const Stria__V1__GetOutputRequest *)stria_rpc_call_request(call);
    Stria__V1__GetOutputReply rep = STRIA__V1__GET_OUTPUT_REPLY__INIT;
    (void)ctx;
    if (stria_rpc_call_check_job(call, &g_job_secret, req->job_id) != STRIA_OK) {
        stria_rpc_call_fail(call, STRIA_ERR_AUTH, "%s", stria_error_msg());
        return;
    }
    rep.offset = req->job_id;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static stria_status_t get_output(stria_rpc_client_t *cl, uint64_t job,
                                 const stria_job_secret_t *secret, uint64_t proven_job)
{
    Stria__V1__GetOutputRequest req = STRIA__V1__GET_OUTPUT_REQUEST__INIT;
    req.job_id = job;
    stria_rpc_request_t r = {.method = M_GET,
                             .request = &req.base,
                             .timeout_s = 5,
                             .job_secret = secret,
                             .job_id = proven_job};
    stria_rpc_reply_t rep = {0};
    stria_status_t st = stria_rpc_client_call(cl, &r, &rep);
    stria_rpc_reply_free(&rep);
    return st;
}

/* A GetOutput frame of job 7 with a proof for the session (cn, sn). */
static void raw_get_proven(int fd, uint64_t id, const uint8_t *cn, const uint8_t *sn)
{
    stria_auth_session_t session;
    uint8_t proof[STRIA_AUTH_MAC_BYTES];
    Stria__V1__GetOutputRequest req = STRIA__V1__GET_OUTPUT_REQUEST__INIT;
    memcpy(session.client_nonce, cn, STRIA_AUTH_NONCE_BYTES);
    memcpy(session.server_nonce, sn, STRIA_AUTH_NONCE_BYTES);
    stria_job_secret_prove(&g_job_secret, &session, id, M_GET, 7, proof);
    req.job_id = 7;
    req.job_proof.data = proof;
    req.job_proof.len = sizeof(proof);
    cr_assert(rt_send_frame(fd, rt_header(M_GET, id), &req.base, NULL, 0));
}

Test(rpc_auth, job_secrets_are_proven_per_request_never_sent, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_params_t p = {0};
    stria_rpc_server_t *srv = NULL;
    stria_job_secret_t wrong = {{8}};
    stria_status_t st;
    memset(g_worker_methods, 0, sizeof(g_worker_methods));
    g_worker_methods[M_GET] =
        (stria_rpc_method_t){.handler = proof_handler, .name = STRIA_RPC_WORKER_GET_OUTPUT_NAME};
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__worker__descriptor;
    p.methods = g_worker_methods;
    cr_assert_eq(stria_rpc_server_start(&p, &srv), STRIA_OK, "%s", stria_error_msg());
    uint16_t port = stria_rpc_server_port(srv);

    stria_rpc_client_t *cl = connect_to(port, &stria__v1__worker__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(get_output(cl, 7, &g_job_secret, 7), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(get_output(cl, 7, NULL, 0), STRIA_ERR_AUTH);
    cr_expect(strstr(stria_error_msg(), "missing job secret proof") != NULL, "%s",
              stria_error_msg());
    cr_expect_eq(get_output(cl, 7, &wrong, 7), STRIA_ERR_AUTH);
    cr_expect(strstr(stria_error_msg(), "wrong job secret") != NULL, "%s", stria_error_msg());
    cr_expect_eq(get_output(cl, 8, &g_job_secret, 7), STRIA_ERR_AUTH,
                 "a proof for job 7 does not open job 8");
    cr_expect_eq(get_output(cl, 7, &g_job_secret, 7), STRIA_OK, "refusals keep the connection");
    stria_rpc_client_close(cl);

    /* A proven request captured on one connection and replayed on another,
     * or again on the same one after a newer request: refused. */
    uint8_t cn[STRIA_AUTH_NONCE_BYTES], sn[STRIA_AUTH_NONCE_BYTES];
    bool challenge = true;
    rt_reply_t r;
    int fd = rt_connect(port);
    cr_assert(rt_hello(fd, "stria.v1.Worker", STRIA_RPC_VERSION));
    memcpy(cn, rt_client_nonce, sizeof(cn));
    raw_challenge(fd, sn, &challenge);
    cr_assert(!challenge, "no credentials: the hello is done at once");
    raw_get_proven(fd, 5, cn, sn);
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, 0, "%s", r.err ? r.err->message : "");
    rt_reply_free(&r);
    raw_get_proven(fd, 6, cn, sn);
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, 0, "%s", r.err ? r.err->message : "");
    rt_reply_free(&r);
    raw_get_proven(fd, 5, cn, sn);
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH, "an older request id replayed in the connection");
    rt_reply_free(&r);
    int fd2 = rt_connect(port);
    cr_assert(rt_hello(fd2, "stria.v1.Worker", STRIA_RPC_VERSION));
    uint8_t sn2[STRIA_AUTH_NONCE_BYTES];
    raw_challenge(fd2, sn2, &challenge);
    raw_get_proven(fd2, 7, cn, sn); /* the first connection's proof */
    cr_assert(rt_read_reply(fd2, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH, "a proof of another connection");
    cr_expect(r.err && strstr(r.err->message, "wrong job secret") != NULL, "%s",
              r.err ? r.err->message : "");
    rt_reply_free(&r);
    close(fd2);
    close(fd);
    stria_rpc_server_stop(srv);
}

/* ---- bad peers --------------------------------------------------------- */

Test(rpc_bad, version_and_service_mismatch, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    uint16_t port = stria_rpc_server_port(srv);
    stria_status_t st;
    rt_reply_t r;
    int fd;

    /* Version 2 in the frame header. */
    fd = rt_connect(port);
    Stria__V1__HelloRequest hello = STRIA__V1__HELLO_REQUEST__INIT;
    hello.protocol_version = 2;
    hello.service = (char *)"stria.v1.Coordinator";
    stria_rpc_header_t h = rt_header(0, 1);
    h.flags = STRIA_RPC_FLAG_HELLO;
    h.version = 2;
    cr_assert(rt_send_frame(fd, h, &hello.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_PROTOCOL);
    cr_expect_eq(r.h.version, STRIA_RPC_VERSION, "the error names the server's version");
    cr_expect(strstr(r.err->message, "version 2") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);

    /* Version 2 in the hello message. */
    fd = rt_connect(port);
    cr_assert(rt_hello(fd, "stria.v1.Coordinator", 2));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_PROTOCOL);
    cr_expect(strstr(r.err->message, "protocol version 2") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);

    /* A worker client dialling the coordinator. */
    stria_rpc_client_t *cl = connect_to(port, &stria__v1__worker__descriptor, NULL, &st);
    cr_expect_eq(st, STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "exposes stria.v1.Coordinator, not 'stria.v1.Worker'") !=
                  NULL,
              "%s", stria_error_msg());
    cr_expect_null(cl);

    fd = raw_greeted(port);
    raw_status_ok(fd, 2);
    close(fd);
    stria_rpc_server_stop(srv);
}

Test(rpc_bad, unknown_method_and_malformed_body_keep_the_connection, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    int fd = raw_greeted(stria_rpc_server_port(srv));
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    rt_reply_t r;
    uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};

    /* Unknown method index, with a payload to skip. */
    cr_assert(rt_send_frame(fd, rt_header(999, 5), &gs.base, junk, sizeof(junk)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_UNSUPPORTED);
    cr_expect_eq(r.h.request_id, 5);
    cr_expect(strstr(r.err->message, "method index 999 does not exist") != NULL, "%s",
              r.err->message);
    rt_reply_free(&r);
    raw_status_ok(fd, 6);

    /* A body that is not a valid message. */
    stria_rpc_header_t h = rt_header(M_STATUS, 7);
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    h.pb_len = sizeof(junk);
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, junk, sizeof(junk)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_FORMAT);
    cr_expect(strstr(r.err->message, "malformed stria.v1.GetStatusRequest") != NULL, "%s",
              r.err->message);
    rt_reply_free(&r);
    raw_status_ok(fd, 8);

    /* A payload to a method that takes none. */
    cr_assert(rt_send_frame(fd, rt_header(M_STATUS, 9), &gs.base, junk, sizeof(junk)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_INVALID_ARG);
    rt_reply_free(&r);
    raw_status_ok(fd, 10);
    close(fd);
    stria_rpc_server_stop(srv);
}

/* Sends a bad header on a greeted connection; expects an error naming
 * `what`, the connection closed, and the server still serving. */
static void bad_header_case(stria_rpc_server_t *srv, stria_rpc_header_t h, stria_status_t want,
                            const char *what)
{
    uint16_t port = stria_rpc_server_port(srv);
    int fd = raw_greeted(port);
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    rt_reply_t r;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)));
    /* Extra bytes the server must drain rather than reset the connection. */
    char trailing[8192] = {0};
    rt_send(fd, trailing, sizeof(trailing));
    cr_assert(rt_read_reply(fd, &r, 5000), "%s: no error reply", what);
    cr_expect_eq(r.h.status, want, "%s: status %d", what, r.h.status);
    cr_expect(r.err != NULL && strstr(r.err->message, what) != NULL, "expected '%s', got '%s'",
              what, r.err ? r.err->message : "");
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000), "%s: connection not closed", what);
    close(fd);
    fd = raw_greeted(port);
    raw_status_ok(fd, 77);
    close(fd);
}

Test(rpc_bad, untrustworthy_headers_close_the_connection, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    stria_rpc_header_t h;

    h = rt_header(M_STATUS, 3);
    h.magic = 0x50545448; /* "HTTP" */
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "bad frame magic");
    h = rt_header(M_STATUS, 3);
    h.pb_len = STRIA_RPC_DEFAULT_MAX_PB + 1;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "exceeds the limit of 16777216 bytes");
    h = rt_header(M_STATUS, 3);
    h.payload_len = STRIA_RPC_DEFAULT_MAX_PAYLOAD + 1;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "payload of 1073741825 bytes exceeds the limit");
    h = rt_header(M_STATUS, 3);
    h.payload_len = UINT64_MAX;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "exceeds the limit");
    h = rt_header(M_STATUS, 3);
    h.flags = STRIA_RPC_FLAG_REPLY;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "unexpected flags");
    h = rt_header(M_STATUS, 3);
    h.flags = STRIA_RPC_FLAG_HELLO;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "hello sent twice");
    h = rt_header(M_STATUS, 3);
    h.status = -1;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "carries status");
    h = rt_header(M_STATUS, 3);
    h.version = 7;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "protocol version 7");
    stria_rpc_server_stop(srv);
}

Test(rpc_bad, truncated_frames_and_silent_peers, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0.3);
    uint16_t port = stria_rpc_server_port(srv);
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    stria_rpc_header_t h = rt_header(M_STATUS, 4);
    int fd;

    /* Half a header, then gone. */
    fd = raw_greeted(port);
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, 17));
    close(fd);
    /* A header promising a body that never comes, then gone. */
    fd = raw_greeted(port);
    h.pb_len = 1000;
    h.payload_len = 5000;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, "abc", 3));
    close(fd);
    /* Garbage shorter than a header, before any hello. */
    fd = rt_connect(port);
    cr_assert(rt_send(fd, "GET / HTTP/1.0\r\n", 16));
    close(fd);
    /* Connected and silent: closed after the hello timeout. */
    fd = rt_connect(port);
    double t0 = stria_time_now();
    cr_expect(rt_wait_closed(fd, 5000), "a silent connection must be closed");
    cr_expect_lt(stria_time_now() - t0, 2.0);
    close(fd);
    /* Still serving. */
    fd = raw_greeted(port);
    raw_status_ok(fd, 11);
    close(fd);
    stria_rpc_server_stop(srv);
}

/* A handler table out of step with the service (a slot naming another
 * method, a handler without a name, a payload callback without a handler)
 * is refused at start, naming the slot and both methods. */
Test(rpc_bad, handler_tables_must_match_the_descriptor, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_method_t m[STRIA_RPC_WORKER_N_METHODS];
    stria_rpc_server_params_t p = {0};
    stria_rpc_server_t *srv = NULL;
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__worker__descriptor;
    p.methods = m;
    memset(m, 0, sizeof(m));
    /* GetOutput's handler in RunForward's slot */
    m[STRIA_RPC_WORKER_RUN_FORWARD] =
        (stria_rpc_method_t){.handler = get_handler, .name = STRIA_RPC_WORKER_GET_OUTPUT_NAME};
    cr_expect_eq(stria_rpc_server_start(&p, &srv), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "slot 1 is for 'GetOutput'") != NULL &&
                  strstr(stria_error_msg(), "method 1 is 'RunForward'") != NULL,
              "%s", stria_error_msg());
    memset(m, 0, sizeof(m));
    m[STRIA_RPC_WORKER_GET_OUTPUT].handler = get_handler;
    cr_expect_eq(stria_rpc_server_start(&p, &srv), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "(no name)") != NULL, "%s", stria_error_msg());
    memset(m, 0, sizeof(m));
    m[STRIA_RPC_WORKER_PUT_INPUT].payload = put_payload;
    cr_expect_eq(stria_rpc_server_start(&p, &srv), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "payload callback but no handler") != NULL, "%s",
              stria_error_msg());
    cr_expect_null(srv);
    /* The generated indices are the descriptor's, name for name. */
    static const struct {
        const ProtobufCServiceDescriptor *svc;
        unsigned index;
        const char *name;
    } known[] = {
        {&stria__v1__coordinator__descriptor, STRIA_RPC_COORDINATOR_SUBMIT_JOB, "SubmitJob"},
        {&stria__v1__coordinator__descriptor, STRIA_RPC_COORDINATOR_DEREGISTER_WORKER,
         "DeregisterWorker"},
        {&stria__v1__worker__descriptor, STRIA_RPC_WORKER_DROP_JOB, "DropJob"},
    };
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        cr_expect_str_eq(known[i].svc->methods[known[i].index].name, known[i].name);
    cr_expect_eq(stria__v1__coordinator__descriptor.n_methods, STRIA_RPC_COORDINATOR_N_METHODS);
    cr_expect_eq(stria__v1__worker__descriptor.n_methods, STRIA_RPC_WORKER_N_METHODS);
}

Test(rpc_bad, listen_errors, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0), *srv2 = NULL;
    stria_rpc_server_params_t p = {0};
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", stria_rpc_server_port(srv));
    p.listen = addr;
    p.service = &stria__v1__coordinator__descriptor;
    p.methods = g_coord_methods;
    cr_expect_eq(stria_rpc_server_start(&p, &srv2), STRIA_ERR_IO);
    cr_expect(strstr(stria_error_msg(), "cannot listen on") != NULL, "%s", stria_error_msg());
    p.listen = "127.0.0.1";
    cr_expect_eq(stria_rpc_server_start(&p, &srv2), STRIA_ERR_INVALID_ARG);
    p.listen = "no-such-host.invalid:0";
    cr_expect_eq(stria_rpc_server_start(&p, &srv2), STRIA_ERR_INVALID_ARG);
    cr_expect_null(srv2);
    /* Nobody listening. */
    stria_status_t st;
    stria_rpc_server_stop(srv);
    cr_expect_null(connect_to(1, &stria__v1__coordinator__descriptor, NULL, &st));
    cr_expect_eq(st, STRIA_ERR_IO, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "cannot connect") != NULL, "%s", stria_error_msg());
}
