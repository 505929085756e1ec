/* Fuzz target: the RPC server's byte stream (transport/rpc_server*.c), as a
 * peer that reached the port sends it: hello (challenge and response),
 * frame headers, protobuf messages, payloads, pipelined requests,
 * truncation, in any order. Three servers run in this process:
 *   0. the real coordinator without credentials (every connection has every
 *      role), with small tables: every Coordinator method's handler sees what
 *      decodes, and one input can register workers, submit a job and prove
 *      its secret;
 *   1. a Worker-service server with a client and an admin credential, whose
 *      stub handlers take payloads (into a buffer, refused, without a buffer,
 *      or with the buffer named later from another thread), reply with
 *      payloads (copied or sent in place), and reply later from the loop or
 *      from another thread; they check the job proof of jobs from
 *      FUZZ_PROVEN_JOBS on with the secret fuzz_job_secret (see "the stub
 *      Worker service" below for which method does what);
 *   2. the real coordinator with a client, a worker and an admin credential
 *      (the roles of its methods).
 * They run without a loop thread (no_thread): this thread drives their
 * loops, so an input costs no thread switch. The first byte picks the server
 * (modulo 3); the rest is written into one end of a socketpair whose other
 * end the server adopts as a connection, then that write side is closed and
 * everything the server sends is read until it closes its end. A server that
 * keeps the connection open 10 s after the input ended, or dies, is a
 * finding.
 *
 * Each input starts the fuzz build's random generator over
 * (fuzz_random_reset()) and meets a coordinator without jobs or workers (one
 * that an earlier input left some is restarted): its server nonce, and the
 * ids and secrets of the jobs it submits, are then known in advance, so the
 * seeds (gen_seeds.c) answer the challenge and prove job secrets, and each
 * input does the same thing every time it runs. */
#include <errno.h>
#include <stdio.h>
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

#include "fuzz_rpc.h"

static stria_coord_t *coords[2];
static stria_metrics_t *metrics[2];
static stria_rpc_server_t *wsrv;
static stria_job_secret_t fuzz_job_secret;
static bool verbose; /* STRIA_FUZZ_VERBOSE: print the replies */

/* ---- the stub Worker service ---------------------------------------------- */
/* SessionCall (client): a forward call (backward unset) is a put: its
 * payload is taken in one of five ways by job_id % 5 (refused, into a
 * buffer, without a buffer, into a buffer named later from another thread,
 * refused later from another thread) and the reply counts its bytes
 * (worker_minflt); a backward call is a get: the reply payload is at most
 * `call` bytes (64 KiB), copied, or sent in place when piece_offset is odd,
 * and use_held is refused. Jobs from FUZZ_PROVEN_JOBS on need their proof.
 * OpenSession (admin): replies later by job_id % 3: 0 at once with an error
 * (busy), 1 from the loop (posted), 2 from the helper thread.
 * DropJob (client): proven; replies at once. */

static uint8_t out_bytes[1 << 16];

/* Work of the helper thread, in order: replies to OpenSession, and payload
 * buffers of puts whose callback answered "later". */
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
    Stria__V1__OpenSessionReply rep = STRIA__V1__OPEN_SESSION_REPLY__INIT;
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

/* The stub's job check: jobs from FUZZ_PROVEN_JOBS on need the proof of
 * fuzz_job_secret (the error is set when it fails). */
static bool job_proven(stria_rpc_call_t *call, uint64_t job_id)
{
    return job_id < FUZZ_PROVEN_JOBS ||
           stria_rpc_call_check_job(call, &fuzz_job_secret, job_id) == STRIA_OK;
}

/* Fails the call when its job is not proven. */
static bool job_refused(stria_rpc_call_t *call, uint64_t job_id)
{
    if (job_proven(call, job_id))
        return false;
    stria_rpc_call_fail(call, STRIA_ERR_AUTH, "%s", stria_error_msg());
    return true;
}

static void reply_open_later(void *arg)
{
    Stria__V1__OpenSessionReply rep = STRIA__V1__OPEN_SESSION_REPLY__INIT;
    stria_rpc_call_reply(arg, &rep.base, NULL, 0, NULL, NULL);
}

static void on_open(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__OpenSessionRequest *req = (const void *)stria_rpc_call_request(call);
    (void)ctx;
    if (req->job_id % 3 == 2)
        help_later(call, HELP_REPLY, NULL);
    else if (req->job_id % 3 == 0 ||
             stria_rpc_server_post(wsrv, reply_open_later, call) != STRIA_OK)
        stria_rpc_call_fail(call, STRIA_ERR_BUSY, "job %llu is busy",
                            (unsigned long long)req->job_id);
}

static stria_status_t on_call_payload(void *ctx, stria_rpc_call_t *call, uint64_t len, void **buf)
{
    const Stria__V1__SessionCallRequest *req = (const void *)stria_rpc_call_request(call);
    (void)ctx;
    void *b;
    if (!job_proven(call, req->job_id))
        return STRIA_ERR_AUTH;
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

static void on_put(stria_rpc_call_t *call)
{
    Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
    uint64_t len = 0;
    stria_rpc_call_payload(call, &len);
    rep.worker_minflt = len;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static void nothing(void *arg)
{
    (void)arg;
}

static void on_get(stria_rpc_call_t *call)
{
    const Stria__V1__SessionCallRequest *req = (const void *)stria_rpc_call_request(call);
    Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
    uint64_t n = req->call < sizeof(out_bytes) ? req->call : sizeof(out_bytes);
    if (job_refused(call, req->job_id))
        return;
    if (req->use_held) {
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "call %llu holds no forward",
                            (unsigned long long)req->held_call);
        return;
    }
    stria_rpc_call_reply(call, &rep.base, out_bytes, n, req->piece_offset % 2 ? nothing : NULL,
                         NULL);
}

static void on_call(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__SessionCallRequest *req = (const void *)stria_rpc_call_request(call);
    (void)ctx;
    if (req->backward)
        on_get(call);
    else
        on_put(call);
}

static void on_drop(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__DropJobRequest *req = (const void *)stria_rpc_call_request(call);
    Stria__V1__DropJobReply rep = STRIA__V1__DROP_JOB_REPLY__INIT;
    (void)ctx;
    if (job_refused(call, req->job_id))
        return;
    rep.dropped = req->job_id % 2;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* ---- set-up ------------------------------------------------------------------ */

/* Starts coordinator i (FUZZ_SERVER_COORD or FUZZ_SERVER_COORD_ROLES) with
 * a metrics registry of its own. */
static void coord_start(int i)
{
    stria_coord_params_t cp;
    if (stria_metrics_create(&metrics[i / 2]) != STRIA_OK)
        fuzz_fail("metrics: %s", stria_error_msg());
    memset(&cp, 0, sizeof(cp));
    cp.listen = "127.0.0.1:0";
    cp.heartbeat_period_s = 0.05; /* a busy tick: dead workers, expiries */
    cp.job_ttl_s = 1;
    /* small tables: what one input can fill */
    cp.max_workers = 32;
    cp.max_jobs = 32;
    cp.history = 16;
    cp.worker_retention_s = 0.5;
    cp.metrics = metrics[i / 2];
    if (i == FUZZ_SERVER_COORD_ROLES) {
        cp.token = FUZZ_TOKEN;
        cp.worker_token = FUZZ_WORKER_TOKEN;
        cp.admin_token = FUZZ_ADMIN_TOKEN;
    }
    if (stria__coord_start(&cp, true, &coords[i / 2]) != STRIA_OK)
        fuzz_fail("coordinator: %s", stria_error_msg());
}

/* The server of selector i, a coordinator without jobs or workers. */
static stria_rpc_server_t *server_for(int i)
{
    if (i == FUZZ_SERVER_WORKER)
        return wsrv;
    stria_coord_t *co = coords[i / 2];
    if (co->n_jobs > 0 || co->n_workers > 0) {
        stria_coord_stop(co);
        stria_metrics_destroy(metrics[i / 2]);
        coord_start(i);
    }
    return coords[i / 2]->server;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    static const stria_rpc_method_t methods[STRIA_RPC_WORKER_N_METHODS] = {
        STRIA_RPC_SERVE(WORKER_DROP_JOB, .handler = on_drop),
        STRIA_RPC_SERVE(WORKER_OPEN_SESSION, .handler = on_open, .flags = STRIA_RPC_METHOD_ADMIN),
        STRIA_RPC_SERVE(WORKER_SESSION_CALL, .handler = on_call, .payload = on_call_payload),
    };
    stria_rpc_server_params_t sp;
    pthread_t th;
    (void)argc;
    (void)argv;

    stria_log_set_level(STRIA_LOG_ERROR);
    verbose = getenv("STRIA_FUZZ_VERBOSE") != NULL;
    signal(SIGPIPE, SIG_IGN);
    memset(out_bytes, 0x5a, sizeof(out_bytes));
    memset(fuzz_job_secret.bytes, FUZZ_JOB_SECRET_BYTE, sizeof(fuzz_job_secret.bytes));
    fuzz_random_reset();
    coord_start(FUZZ_SERVER_COORD);
    coord_start(FUZZ_SERVER_COORD_ROLES);

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
    if (pthread_create(&th, NULL, helper_main, NULL) != 0)
        fuzz_fail("helper thread");
    pthread_detach(th);
    return 0;
}

/* ---- what the server answered (STRIA_FUZZ_VERBOSE=1) ---------------------- */

static uint8_t *seen;
static size_t seen_len, seen_cap;

static void seen_add(const void *p, size_t n)
{
    if (seen_len + n > seen_cap) {
        seen_cap = (seen_len + n) * 2;
        seen = realloc(seen, seen_cap);
        if (seen == NULL)
            fuzz_fail("out of memory");
    }
    memcpy(seen + seen_len, p, n);
    seen_len += n;
}

/* Prints one line per reply frame the server sent: request id, method,
 * status, and the error's message (to check that seeds get past the hello
 * and the job proofs: tests/fuzz/run.sh --check-seeds). */
static void seen_print(void)
{
    size_t off = 0;
    while (off + STRIA_RPC_HEADER_SIZE <= seen_len) {
        stria_rpc_header_t h;
        stria_rpc_header_decode(seen + off, &h);
        off += STRIA_RPC_HEADER_SIZE;
        if (off + h.pb_len + h.payload_len > seen_len)
            break;
        if (h.flags & STRIA_RPC_FLAG_HELLO) {
            Stria__V1__HelloReply *r = stria__v1__hello_reply__unpack(NULL, h.pb_len, seen + off);
            fprintf(stderr, "  reply %llu: hello, status %d, %s, roles %u\n",
                    (unsigned long long)h.request_id, (int)h.status,
                    r != NULL && r->challenge ? "challenge" : "final", r != NULL ? r->roles : 0);
            stria__v1__hello_reply__free_unpacked(r, NULL);
        } else if (h.status != 0) {
            Stria__V1__RpcError *e = stria__v1__rpc_error__unpack(NULL, h.pb_len, seen + off);
            fprintf(stderr, "  reply %llu: method %u, status %d: %s\n",
                    (unsigned long long)h.request_id, h.method, (int)h.status,
                    e != NULL ? e->message : "?");
            stria__v1__rpc_error__free_unpacked(e, NULL);
        } else {
            fprintf(stderr, "  reply %llu: method %u, ok\n", (unsigned long long)h.request_id,
                    h.method);
        }
        off += h.pb_len + h.payload_len;
    }
    seen_len = 0;
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
        if (n > 0) {
            progress = true;
            if (verbose)
                seen_add(sink, (size_t)n);
        }
        if (!progress) {
            if (stria_time_now() > deadline)
                fuzz_fail("the server kept the connection open for 10 s after the input ended");
            stria_rpc_server_run(srv, true);
        }
    }
    close(sv[0]);
    if (verbose)
        seen_print();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    stria_rpc_server_t *srv = server_for(data[0] % FUZZ_N_SERVERS);
    fuzz_random_reset();
    exchange(srv, data + 1, size - 1);
    return 0;
}
