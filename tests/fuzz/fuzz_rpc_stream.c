/* Fuzz target: the RPC server's byte stream (transport/rpc_server*.c), as a
 * peer that reached the port sends it: hello, frame headers, protobuf
 * messages, payloads, pipelined requests, truncation, in any order. Two
 * servers run in this process:
 *   - the real coordinator, no token, with small tables: every Coordinator
 *     method's handler sees what decodes;
 *   - a Worker-service server with a token and an admin token, whose stub
 *     handlers take payloads (into a buffer, refused, without a buffer, or
 *     with the buffer named later from another thread), reply with payloads
 *     (copied or sent in place), and reply later from the loop or from
 *     another thread.
 * Both run without a loop thread (no_thread): this thread drives their loops,
 * so an input costs no thread switch. The first byte picks the server; the
 * rest is written into one end of a socketpair whose other end the server
 * adopts as a connection, then that write side is closed and everything the
 * server sends is read until it closes its end. A server that keeps the
 * connection open 10 s after the input ended, or dies, is a finding. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "stria.pb-c.h"
#include "coord_int.h"
#include "stria_rpc.h"

#define FUZZ_TOKEN       "fuzz-client-token"
#define FUZZ_ADMIN_TOKEN "fuzz-admin-token"

static stria_coord_t *coord;
static stria_metrics_t *metrics;
static stria_rpc_server_t *wsrv;
static stria_rpc_server_t *servers[2];

/* ---- the stub Worker service ---------------------------------------------- */

static uint8_t out_bytes[1 << 16];

/* Work of the helper thread, in order: replies to RunBackward, and payload
 * buffers of PutInputs whose callback answered "later". */
typedef enum { HELP_REPLY, HELP_BUFFER, HELP_REFUSE } help_kind_t;
typedef struct {
    stria_rpc_call_t *call;
    help_kind_t kind;
    void *buf;
} help_t;

static pthread_mutex_t q_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t q_cv = PTHREAD_COND_INITIALIZER;
static help_t q_items[256];
static size_t q_head, q_len;

static void help(const help_t *h)
{
    Stria__V1__RunBackwardReply rep = STRIA__V1__RUN_BACKWARD_REPLY__INIT;
    switch (h->kind) {
    case HELP_REPLY:
        stria_rpc_call_reply(h->call, &rep.base, NULL, 0, NULL, NULL);
        break;
    case HELP_BUFFER:
        stria_rpc_call_payload_ready(h->call, STRIA_OK, h->buf, NULL);
        break;
    case HELP_REFUSE:
        stria_rpc_call_payload_ready(h->call, STRIA_ERR_NOT_FOUND, NULL, "no such job");
        break;
    }
}

static void *helper_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&q_lock);
    for (;;) {
        while (q_len == 0)
            pthread_cond_wait(&q_cv, &q_lock);
        help_t h = q_items[q_head];
        q_head = (q_head + 1) % 256;
        q_len--;
        pthread_mutex_unlock(&q_lock);
        help(&h);
        pthread_mutex_lock(&q_lock);
    }
    return NULL;
}

/* Hands work to the helper thread (or does it here when the queue is full). */
static void help_later(stria_rpc_call_t *call, help_kind_t kind, void *buf)
{
    help_t h = {.call = call, .kind = kind, .buf = buf};
    pthread_mutex_lock(&q_lock);
    if (q_len == 256) {
        pthread_mutex_unlock(&q_lock);
        help(&h);
        return;
    }
    q_items[(q_head + q_len) % 256] = h;
    q_len++;
    pthread_cond_signal(&q_cv);
    pthread_mutex_unlock(&q_lock);
}

static void on_backward(void *ctx, stria_rpc_call_t *call)
{
    (void)ctx;
    help_later(call, HELP_REPLY, NULL);
}

static void reply_forward_later(void *arg)
{
    Stria__V1__RunForwardReply rep = STRIA__V1__RUN_FORWARD_REPLY__INIT;
    stria_rpc_call_reply(arg, &rep.base, NULL, 0, NULL, NULL);
}

static void on_forward(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__RunForwardRequest *req = (const void *)stria_rpc_call_request(call);
    (void)ctx;
    if (req->job_id % 2 == 0 || stria_rpc_server_post(wsrv, reply_forward_later, call) != STRIA_OK)
        stria_rpc_call_fail(call, STRIA_ERR_BUSY, "job %llu is busy",
                            (unsigned long long)req->job_id);
}

static stria_status_t on_put_payload(void *ctx, stria_rpc_call_t *call, uint64_t len, void **buf)
{
    const Stria__V1__PutInputRequest *req = (const void *)stria_rpc_call_request(call);
    (void)ctx;
    void *b;
    switch (req->job_id % 5) {
    case 0:
        return stria_error_set(STRIA_ERR_NOT_FOUND, "job %llu is unknown",
                               (unsigned long long)req->job_id);
    case 1:
    case 3:
        if (len > (1u << 20))
            return stria_error_set(STRIA_ERR_INVALID_ARG, "too large");
        b = malloc(len);
        if (b == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
        stria_rpc_call_set_cleanup(call, free, b);
        if (req->job_id % 5 == 1) {
            *buf = b;
            return STRIA_OK;
        }
        help_later(call, HELP_BUFFER, b); /* named later, by another thread */
        return STRIA_RPC_PAYLOAD_LATER;
    case 4:
        help_later(call, HELP_REFUSE, NULL);
        return STRIA_RPC_PAYLOAD_LATER;
    default:
        return STRIA_OK; /* and no buffer */
    }
}

static void on_put(void *ctx, stria_rpc_call_t *call)
{
    Stria__V1__PutInputReply rep = STRIA__V1__PUT_INPUT_REPLY__INIT;
    uint64_t len = 0;
    (void)ctx;
    stria_rpc_call_payload(call, &len);
    rep.received_bytes = len;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static void nothing(void *arg)
{
    (void)arg;
}

static void on_get(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__GetOutputRequest *req = (const void *)stria_rpc_call_request(call);
    Stria__V1__GetOutputReply rep = STRIA__V1__GET_OUTPUT_REPLY__INIT;
    uint64_t n = req->max_bytes < sizeof(out_bytes) ? req->max_bytes : sizeof(out_bytes);
    (void)ctx;
    if (req->tensor == STRIA__V1__TENSOR__TENSOR_Q) {
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "tensor %d is not an output",
                            (int)req->tensor);
        return;
    }
    rep.offset = req->offset;
    rep.total_bytes = sizeof(out_bytes);
    stria_rpc_call_reply(call, &rep.base, out_bytes, n, req->offset % 2 ? nothing : NULL, NULL);
}

static void on_drop(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__DropJobRequest *req = (const void *)stria_rpc_call_request(call);
    Stria__V1__DropJobReply rep = STRIA__V1__DROP_JOB_REPLY__INIT;
    (void)ctx;
    rep.dropped = req->job_id % 2;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* ---- set-up ------------------------------------------------------------------ */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    static const stria_rpc_method_t methods[STRIA_RPC_WORKER_N_METHODS] = {
        STRIA_RPC_SERVE(WORKER_PUT_INPUT, .handler = on_put, .payload = on_put_payload),
        STRIA_RPC_SERVE(WORKER_RUN_FORWARD, .handler = on_forward),
        STRIA_RPC_SERVE(WORKER_RUN_BACKWARD, .handler = on_backward,
                        .flags = STRIA_RPC_METHOD_ADMIN),
        STRIA_RPC_SERVE(WORKER_GET_OUTPUT, .handler = on_get),
        STRIA_RPC_SERVE(WORKER_DROP_JOB, .handler = on_drop),
    };
    stria_coord_params_t cp;
    stria_rpc_server_params_t sp;
    pthread_t th;
    (void)argc;
    (void)argv;

    stria_log_set_level(STRIA_LOG_ERROR);
    signal(SIGPIPE, SIG_IGN);
    memset(out_bytes, 0x5a, sizeof(out_bytes));
    if (stria_metrics_create(&metrics) != STRIA_OK)
        fuzz_fail("metrics: %s", stria_error_msg());
    memset(&cp, 0, sizeof(cp));
    cp.listen = "127.0.0.1:0";
    cp.heartbeat_period_s = 0.05; /* a busy tick: dead workers, expiries */
    cp.job_ttl_s = 1;
    /* small tables: the state that inputs leave behind stays small, so an
     * input costs about the same after millions of them */
    cp.max_workers = 32;
    cp.max_jobs = 32;
    cp.history = 16;
    cp.worker_retention_s = 0.5;
    cp.metrics = metrics;
    if (stria__coord_start(&cp, true, &coord) != STRIA_OK)
        fuzz_fail("coordinator: %s", stria_error_msg());
    servers[0] = coord->server;

    memset(&sp, 0, sizeof(sp));
    sp.listen = "127.0.0.1:0";
    sp.service = &stria__v1__worker__descriptor;
    sp.methods = methods;
    sp.token = FUZZ_TOKEN;
    sp.admin_token = FUZZ_ADMIN_TOKEN;
    sp.max_payload_bytes = 4u << 20;
    sp.max_inflight = 8;
    sp.name = "fuzz-worker";
    sp.no_thread = true;
    if (stria_rpc_server_start(&sp, &wsrv) != STRIA_OK)
        fuzz_fail("worker server: %s", stria_error_msg());
    servers[1] = wsrv;
    if (pthread_create(&th, NULL, helper_main, NULL) != 0)
        fuzz_fail("helper thread");
    pthread_detach(th);
    return 0;
}

/* ---- one connection ----------------------------------------------------------- */

static void exchange(stria_rpc_server_t *srv, const uint8_t *data, size_t size)
{
    static char sink[1 << 16];
    size_t off = 0;
    bool shut = false;
    double deadline = stria_time_now() + 10.0;
    int sv[2];

    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0)
        fuzz_fail("socketpair: %s", strerror(errno));
    if (stria_rpc_server_adopt(srv, sv[1], "fuzz") != STRIA_OK)
        fuzz_fail("adopt: %s", stria_error_msg());
    for (;;) {
        bool progress = false;
        if (off < size) {
            ssize_t n = send(sv[0], data + off, size - off, MSG_NOSIGNAL);
            if (n > 0) {
                off += (size_t)n;
                progress = true;
            } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
                off = size; /* the server closed first */
            }
        }
        if (off == size && !shut) {
            shutdown(sv[0], SHUT_WR);
            shut = true;
        }
        stria_rpc_server_run(srv, false);
        ssize_t n = read(sv[0], sink, sizeof(sink));
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
            break; /* the server closed its end */
        if (n > 0)
            progress = true;
        if (!progress) {
            if (stria_time_now() > deadline)
                fuzz_fail("the server kept the connection open for 10 s after the input ended");
            stria_rpc_server_run(srv, true);
        }
    }
    close(sv[0]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    exchange(servers[data[0] & 1], data + 1, size - 1);
    return 0;
}
