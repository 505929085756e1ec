/* RPC server bounds and loops: a payload buffer named later from another
 * thread (the loop serves other connections meanwhile; a refusal keeps the
 * connection; a connection that closes while it waits loses nothing), a
 * per-method limit on the message size, and a server without a loop thread
 * driven on the caller's thread over an adopted socket. */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rpc_testutil.h"

/* One timeout for every test of the binary (see rpc_test_services.h). */
#define TEST_TIMEOUT_S 30

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- a Worker service whose SessionCall names its buffer 0.5 s later ------- */

static uint8_t g_buf[4096];
static int g_cleanups; /* cleanups of SessionCall calls (loop thread) */
static bool g_refuse;  /* the later answer is an error */
static double g_later_s = 0.5;

typedef struct {
    stria_rpc_call_t *call;
} later_t;

static void *name_later(void *arg)
{
    later_t *l = arg;
    usleep((useconds_t)(g_later_s * 1e6));
    if (g_refuse)
        stria_rpc_call_payload_ready(l->call, STRIA_ERR_NOT_FOUND, NULL, "job 5 is unknown");
    else
        stria_rpc_call_payload_ready(l->call, STRIA_OK, g_buf, NULL);
    free(l);
    return NULL;
}

static void count_cleanup(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&g_cleanups, 1, __ATOMIC_SEQ_CST);
}

static stria_status_t put_payload(void *ctx, stria_rpc_call_t *call, uint64_t len, void **buf)
{
    (void)ctx;
    (void)buf;
    if (len > sizeof(g_buf))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "too large");
    later_t *l = malloc(sizeof(*l));
    pthread_t th;
    l->call = call;
    stria_rpc_call_set_cleanup(call, count_cleanup, NULL);
    cr_assert_eq(pthread_create(&th, NULL, name_later, l), 0);
    pthread_detach(th);
    return STRIA_RPC_PAYLOAD_LATER;
}

static void put_handler(void *ctx, stria_rpc_call_t *call)
{
    Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
    uint64_t len = 0;
    (void)ctx;
    cr_assert_eq(stria_rpc_call_payload(call, &len), g_buf);
    rep.worker_minflt = len; /* the bytes received */
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static void drop_handler(void *ctx, stria_rpc_call_t *call)
{
    Stria__V1__DropJobReply rep = STRIA__V1__DROP_JOB_REPLY__INIT;
    (void)ctx;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static stria_rpc_server_t *start_worker(bool no_thread)
{
    static const stria_rpc_method_t methods[STRIA_RPC_WORKER_N_METHODS] = {
        STRIA_RPC_SERVE(WORKER_SESSION_CALL, .handler = put_handler, .payload = put_payload),
        /* a small limit: DropJob messages are a few bytes */
        STRIA_RPC_SERVE(WORKER_DROP_JOB, .handler = drop_handler, .max_pb_bytes = 16),
    };
    stria_rpc_server_params_t p;
    stria_rpc_server_t *srv = NULL;
    memset(&p, 0, sizeof(p));
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__worker__descriptor;
    p.methods = methods;
    p.no_thread = no_thread;
    cr_assert_eq(stria_rpc_server_start(&p, &srv), STRIA_OK, "%s", stria_error_msg());
    return srv;
}

static stria_rpc_client_t *connect_worker(uint16_t port)
{
    char addr[32];
    stria_rpc_client_params_t p;
    stria_rpc_client_t *cl = NULL;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    memset(&p, 0, sizeof(p));
    p.address = addr;
    p.service = &stria__v1__worker__descriptor;
    cr_assert_eq(stria_rpc_client_connect(&p, &cl), STRIA_OK, "%s", stria_error_msg());
    return cl;
}

static stria_status_t put(stria_rpc_client_t *cl, size_t len)
{
    static uint8_t bytes[4096];
    Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    stria_rpc_request_t rq = {.method = STRIA_RPC_WORKER_SESSION_CALL,
                              .request = &req.base,
                              .payload = bytes,
                              .payload_len = len,
                              .timeout_s = 10};
    stria_rpc_reply_t rep = {0};
    memset(bytes, 0x5c, len);
    req.job_id = 5;
    stria_status_t st = stria_rpc_client_call(cl, &rq, &rep);
    if (st == STRIA_OK)
        cr_assert_eq(((Stria__V1__SessionCallReply *)rep.msg)->worker_minflt, len);
    stria_rpc_reply_free(&rep);
    return st;
}

static stria_status_t drop(stria_rpc_client_t *cl, const char *pad)
{
    Stria__V1__DropJobRequest req = STRIA__V1__DROP_JOB_REQUEST__INIT;
    stria_rpc_request_t rq = {
        .method = STRIA_RPC_WORKER_DROP_JOB, .request = &req.base, .timeout_s = 10};
    stria_rpc_reply_t rep = {0};
    ProtobufCMessageUnknownField unknown = {.tag = 15,
                                            .wire_type = PROTOBUF_C_WIRE_TYPE_LENGTH_PREFIXED};
    req.job_id = 5;
    if (pad != NULL) { /* an unknown field makes the message as long as we like */
        unknown.len = strlen(pad);
        unknown.data = (uint8_t *)pad;
        req.base.n_unknown_fields = 1;
        req.base.unknown_fields = &unknown;
    }
    stria_status_t st = stria_rpc_client_call(cl, &rq, &rep);
    stria_rpc_reply_free(&rep);
    return st;
}

typedef struct {
    uint16_t port;
    stria_status_t st;
    double seconds;
} put_job_t;

static void *put_main(void *arg)
{
    put_job_t *p = arg;
    stria_rpc_client_t *cl = connect_worker(p->port);
    double t0 = now_s();
    p->st = put(cl, 1000);
    p->seconds = now_s() - t0;
    stria_rpc_client_close(cl);
    return NULL;
}

Test(rpc_later, payload_named_later_while_the_loop_serves_others, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_worker(false);
    uint16_t port = stria_rpc_server_port(srv);
    stria_rpc_client_t *other = connect_worker(port);
    put_job_t pj = {.port = port};
    pthread_t th;

    g_refuse = false;
    memset(g_buf, 0, sizeof(g_buf));
    cr_assert_eq(pthread_create(&th, NULL, put_main, &pj), 0);
    usleep(100000);
    double t0 = now_s();
    cr_assert_eq(drop(other, NULL), STRIA_OK, "%s", stria_error_msg());
    cr_assert_lt(now_s() - t0, 0.3, "another connection waited for the payload's buffer");
    pthread_join(th, NULL);
    cr_assert_eq(pj.st, STRIA_OK, "%s", stria_error_msg());
    cr_assert_geq(pj.seconds, 0.4);
    cr_assert_eq(g_buf[0], 0x5c);
    cr_assert_eq(g_buf[999], 0x5c);
    cr_assert_eq(g_buf[1000], 0);

    /* a later refusal: the request fails with its message, the payload is
     * skipped, the connection serves the next request */
    g_refuse = true;
    cr_assert_eq(put(other, 3000), STRIA_ERR_NOT_FOUND);
    cr_assert(strstr(stria_error_msg(), "SessionCall: job 5 is unknown") != NULL, "%s",
              stria_error_msg());
    cr_assert_eq(drop(other, NULL), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_client_close(other);
    stria_rpc_server_stop(srv);
}

Test(rpc_later, connection_closed_while_waiting, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_worker(false);
    uint16_t port = stria_rpc_server_port(srv);
    int fd = rt_connect(port);
    static uint8_t payload[2000];

    g_refuse = false;
    g_cleanups = 0;
    cr_assert(rt_hello(fd, stria__v1__worker__descriptor.name, STRIA_RPC_VERSION));
    Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    cr_assert(rt_send_frame(fd, rt_header(STRIA_RPC_WORKER_SESSION_CALL, 2), &req.base, payload,
                            sizeof(payload)));
    usleep(100000);
    close(fd); /* before the buffer is named */
    usleep((useconds_t)(g_later_s * 1e6) + 300000);
    cr_assert_eq(__atomic_load_n(&g_cleanups, __ATOMIC_SEQ_CST), 1,
                 "the waiting call's cleanup ran %d times", g_cleanups);
    /* the server goes on */
    stria_rpc_client_t *cl = connect_worker(port);
    cr_assert_eq(drop(cl, NULL), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
}

Test(rpc_limits, per_method_message_limit, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_worker(false);
    stria_rpc_client_t *cl = connect_worker(stria_rpc_server_port(srv));
    /* DropJob allows 16 bytes: a larger one is refused unread, naming the
     * limit, and the connection stays usable */
    cr_assert_eq(drop(cl, "0123456789012345678901234567890123456789"), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "DropJob: message of") != NULL &&
                  strstr(stria_error_msg(), "exceeds the method's limit of 16 bytes") != NULL,
              "%s", stria_error_msg());
    cr_assert_eq(drop(cl, NULL), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
}

Test(rpc_inline, server_without_thread_over_an_adopted_socket, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_worker(true);
    int sv[2];
    rt_reply_t r;

    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    cr_assert_eq(stria_rpc_server_adopt(srv, sv[1], "test"), STRIA_OK, "%s", stria_error_msg());
    cr_assert(rt_hello(sv[0], stria__v1__worker__descriptor.name, STRIA_RPC_VERSION));
    Stria__V1__DropJobRequest req = STRIA__V1__DROP_JOB_REQUEST__INIT;
    cr_assert(rt_send_frame(sv[0], rt_header(STRIA_RPC_WORKER_DROP_JOB, 7), &req.base, NULL, 0));
    /* nothing is served until this thread runs the loop */
    struct pollfd p = {.fd = sv[0], .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 200), 0);
    for (int i = 0; i < 100 && poll(&p, 1, 0) == 0; i++)
        stria_rpc_server_run(srv, false);
    cr_assert(rt_read_reply(sv[0], &r, 1000));
    cr_assert(r.h.flags & STRIA_RPC_FLAG_HELLO);
    rt_reply_free(&r);
    for (int i = 0; i < 100 && poll(&p, 1, 0) == 0; i++)
        stria_rpc_server_run(srv, false);
    cr_assert(rt_read_reply(sv[0], &r, 1000));
    cr_assert_eq(r.h.request_id, 7);
    cr_assert_eq(r.h.status, 0);
    rt_reply_free(&r);
    close(sv[0]);
    stria_rpc_server_stop(srv);
}
