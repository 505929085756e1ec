/* The service end to end, with real processes on loopback: a coordinator,
 * several workers over UCX, and clients through libstria. Results must equal
 * the in-process computation; failures must name the worker; the daemons must
 * keep serving after bad input. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proc.h"
#include "ref.h"
#include "stria.pb-c.h"
#include "stria_client.h"
#include "stria_kernels.h"
#include "stria_ring.h"
#include "stria_rpc.h"
#include "tcheck.h"
#include "tcluster.h"
#include "tjob.h"
#include "tsess.h"

static tcluster_t cl;

static char *const ucx_env[] = {"UCX_HANDLE_ERRORS=none", "UCX_TLS=tcp,sm,self",
                                "STRIA_LOG_LEVEL=info", NULL};

/* The workers' credential of clusters with a client one (token_file). */
static void worker_token_arg(const char *token_file, char *out, size_t len)
{
    char path[300];
    snprintf(path, sizeof(path), "%s.worker", token_file);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("the-workers-own-secret\n", f);
    fclose(f);
    snprintf(out, len, "--worker-token-file=%s", path);
}

static void start_coordinator(const char *token_file)
{
    char tok[256] = "", wtok[320] = "";
    if (token_file) {
        snprintf(tok, sizeof(tok), "--token-file=%s", token_file);
        worker_token_arg(token_file, wtok, sizeof(wtok));
    }
    char *argv[] = {STRIA_COORDINATOR_BIN,
                    "--listen",
                    "127.0.0.1:0",
                    "--heartbeat-period",
                    "0.2",
                    "--job-ttl",
                    "60",
                    token_file ? tok : NULL,
                    wtok,
                    NULL};
    tcl_start_coordinator(&cl, argv);
}

static const char *worker_device; /* --device of the workers started next; NULL: none */

static void start_worker(int i, const char *token_file)
{
    char tok[256] = "", wtok[320] = "";
    if (token_file) {
        snprintf(tok, sizeof(tok), "--token-file=%s", token_file);
        worker_token_arg(token_file, wtok, sizeof(wtok));
    }
    char *argv[] = {STRIA_WORKER_BIN,
                    "--coordinator",
                    cl.coord_addr,
                    "--threads",
                    "1",
                    "--step-timeout",
                    "5",
                    "--memory",
                    "2G", /* a size with a suffix, as operators write it */
                    token_file ? tok : NULL,
                    wtok,
                    NULL,
                    NULL,
                    NULL};
    if (worker_device != NULL) {
        int at = token_file ? 11 : 9;
        argv[at] = "--device";
        argv[at + 1] = (char *)worker_device;
    }
    tcl_start_worker(&cl, i, argv);
}

static stria_rpc_client_t *coord_client(const char *token)
{
    stria_rpc_client_params_t p;
    stria_rpc_client_t *c = NULL;
    memset(&p, 0, sizeof(p));
    p.address = cl.coord_addr;
    p.service = &stria__v1__coordinator__descriptor;
    p.token = token;
    p.connect_timeout_s = 5;
    cr_assert_eq(stria_rpc_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    return c;
}

/* Waits until the coordinator counts `healthy` healthy workers. */
static void wait_healthy(unsigned healthy, const char *token)
{
    stria_rpc_client_t *c = coord_client(token);
    unsigned got = 0;
    for (int i = 0; i < 200; i++) {
        Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
        stria_rpc_request_t rq = {
            .method = STRIA_RPC_COORDINATOR_GET_STATUS, .request = &req.base, .timeout_s = 5};
        stria_rpc_reply_t reply;
        memset(&reply, 0, sizeof(reply));
        cr_assert_eq(stria_rpc_client_call(c, &rq, &reply), STRIA_OK, "%s", stria_error_msg());
        got = ((Stria__V1__GetStatusReply *)reply.msg)->workers_healthy;
        stria_rpc_reply_free(&reply);
        if (got == healthy)
            break;
        usleep(50000);
    }
    stria_rpc_client_close(c);
    cr_assert_eq(got, healthy, "coordinator has %u healthy workers, expected %u", got, healthy);
}

static void start_cluster(int n, const char *token_file, const char *token)
{
    tcl_init(&cl, "e2e", ucx_env);
    start_coordinator(token_file);
    for (int i = 0; i < n; i++)
        start_worker(i, token_file);
    wait_healthy((unsigned)n, token);
}

static void stop_cluster(void)
{
    tcl_stop(&cl);
}

/* ---- a job and its in-process reference ------------------------------------ */

/* A job's tensors (tests/support/tjob.h) with steps of 5 s at most. */
static void job_data_init(tjob_t *j, int64_t B, int64_t S, int64_t H, int64_t Hkv, int64_t D,
                          stria_dtype_t dt, bool causal, uint64_t seed)
{
    cr_assert(tjob_init(j, B, S, H, Hkv, D, dt, causal, seed), "out of memory");
    j->spec.step_timeout_s = 5;
}

/* The service's outputs against the fp64 reference (tests/support/tcheck.h),
 * bf16 on the workers' bf16 dot product judged by the kernels' bf16 bar. */
static void check_outputs(const tjob_t *j, bool backward)
{
    tcheck_job(j, backward, ref_bf16_dot_default(), "the service's outputs");
}

static stria_client_t *connect_client(const char *token)
{
    stria_client_params_t p;
    stria_client_t *c = NULL;
    memset(&p, 0, sizeof(p));
    p.struct_size = sizeof(p);
    p.coordinator = cl.coord_addr;
    p.token = token;
    p.client_name = "test_e2e";
    cr_assert_eq(stria_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    return c;
}

static void run_job(stria_client_t *c, tjob_t *j)
{
    stria_job_t *job = NULL;
    cr_assert_eq(
        stria_client_forward(c, &j->spec, j->q, j->k, j->v, j->o, j->lse, NULL, NULL, NULL, &job),
        STRIA_OK, "forward: %s", stria_error_msg());
    cr_assert_eq(stria_client_backward(job, j->g, j->dq, j->dk, j->dv, NULL, NULL, NULL), STRIA_OK,
                 "backward: %s", stria_error_msg());
    int alive = 0;
    for (int i = 0; i < cl.n; i++)
        alive += cl.workers[i] != NULL;
    cr_expect_eq(stria_job_ring_size(job), j->spec.ring_size ? j->spec.ring_size : alive);
    /* (the test's workers run on host memory: auto packs documents) */
    cr_expect_eq(
        stria_job_layout(job),
        stria_layout_kind_resolve(j->spec.layout, j->spec.has_window, j->spec.n_cu_seqlens > 2));
    cr_expect_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
}

/* ---- tests ------------------------------------------------------------------ */

Test(e2e, rings_of_2_3_4_workers_gqa_and_odd_lengths, .timeout = 300)
{
    start_cluster(4, NULL, NULL);
    stria_client_t *c = connect_client(NULL);
    static const struct {
        int ring;
        int64_t S, H, Hkv;
        stria_dtype_t dt;
        bool causal;
        stria_layout_kind_t layout;
    } cases[] = {
        {2, 96, 4, 4, STRIA_DTYPE_F32, true, STRIA_LAYOUT_STRIPED},
        {3, 101, 4, 2, STRIA_DTYPE_BF16, true, STRIA_LAYOUT_STRIPED}, /* 101 % 3 != 0, GQA */
        {4, 77, 4, 1, STRIA_DTYPE_F32, false, STRIA_LAYOUT_ZIGZAG},   /* 77 % 8 != 0 */
        {4, 130, 2, 2, STRIA_DTYPE_F16, true, STRIA_LAYOUT_CONTIGUOUS},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        tjob_t j;
        job_data_init(&j, 2, cases[i].S, cases[i].H, cases[i].Hkv, 32, cases[i].dt, cases[i].causal,
                      10 + i);
        j.spec.ring_size = cases[i].ring;
        j.spec.layout = cases[i].layout;
        run_job(c, &j);
        check_outputs(&j, true);
        tjob_free(&j);
    }
    stria_client_close(c);
    stop_cluster();
}

typedef struct {
    tjob_t j;
    stria_status_t st;
    char err[512];
} concurrent_t;

static void *client_thread(void *arg)
{
    concurrent_t *cc = arg;
    stria_client_params_t p;
    stria_client_t *c = NULL;
    stria_job_t *job = NULL;
    memset(&p, 0, sizeof(p));
    p.struct_size = sizeof(p);
    p.coordinator = cl.coord_addr;
    cc->st = stria_client_connect(&p, &c);
    if (cc->st == STRIA_OK)
        cc->st = stria_client_forward(c, &cc->j.spec, cc->j.q, cc->j.k, cc->j.v, cc->j.o, cc->j.lse,
                                      NULL, NULL, NULL, &job);
    if (cc->st == STRIA_OK)
        cc->st =
            stria_client_backward(job, cc->j.g, cc->j.dq, cc->j.dk, cc->j.dv, NULL, NULL, NULL);
    if (cc->st != STRIA_OK)
        snprintf(cc->err, sizeof(cc->err), "%s", stria_error_msg());
    stria_client_release(job);
    stria_client_close(c);
    return NULL;
}

Test(e2e, two_clients_at_the_same_time, .timeout = 300)
{
    start_cluster(3, NULL, NULL);
    concurrent_t cc[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        memset(&cc[i], 0, sizeof(cc[i]));
        job_data_init(&cc[i].j, 1, 120 + 7 * i, 4, 2, 32, STRIA_DTYPE_F32, true, 40 + 10 * i);
        pthread_create(&th[i], NULL, client_thread, &cc[i]);
    }
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(cc[i].st, STRIA_OK, "client %d: %s", i, cc[i].err);
        if (cc[i].st == STRIA_OK)
            check_outputs(&cc[i].j, true);
        tjob_free(&cc[i].j);
    }
    stop_cluster();
}

Test(e2e, killed_worker_fails_the_job_and_the_ring_goes_on, .timeout = 300)
{
    start_cluster(3, NULL, NULL);
    stria_client_t *c = connect_client(NULL);
    tjob_t j;
    job_data_init(&j, 1, 90, 2, 2, 32, STRIA_DTYPE_F32, true, 70);
    stria_job_t *job = NULL;
    cr_assert_eq(
        stria_client_forward(c, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job),
        STRIA_OK, "%s", stria_error_msg());
    /* kill -9 one worker between the passes: the backward pass must fail
     * naming it, without hanging */
    int victim = 1;
    kill(test_proc_pid(cl.workers[victim]), SIGKILL);
    test_proc_wait(cl.workers[victim], 5);
    cl.workers[victim] = NULL;
    double t0 = stria_time_now();
    stria_status_t st = stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, NULL);
    double took = stria_time_now() - t0;
    cr_expect_neq(st, STRIA_OK);
    cr_expect(took < 20, "the failure took %.1f s to surface", took);
    const char *msg = stria_error_msg();
    cr_expect(strstr(msg, cl.worker_rpc[victim]) != NULL || strstr(msg, "rank") != NULL,
              "the error does not name the worker: %s", msg);
    cr_log_info("backward with a killed worker: %s", msg);
    stria_client_release(job);

    /* the coordinator notices the dead worker; the next job runs on the other two */
    wait_healthy(2, NULL);
    tjob_t j2;
    job_data_init(&j2, 1, 64, 2, 1, 32, STRIA_DTYPE_BF16, true, 80);
    run_job(c, &j2);
    check_outputs(&j2, true);
    tjob_free(&j);
    tjob_free(&j2);
    stria_client_close(c);
    stop_cluster();
}

/* Raw frames to a worker: garbage, wrong version, unknown methods, nonsense
 * requests. Each gets an error or a closed connection, and the worker serves
 * the next valid request. */
static int raw_connect(const char *addr)
{
    char host[64];
    uint16_t port;
    cr_assert_eq(stria_addr_parse(addr, host, sizeof(host), &port), STRIA_OK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, host, &a.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

/* Reads until EOF or an error reply header; true when the server answered
 * with an error status or closed. */
static bool refused(int fd)
{
    uint8_t hdr[STRIA_RPC_HEADER_SIZE];
    size_t got = 0;
    while (got < sizeof(hdr)) {
        ssize_t n = recv(fd, hdr + got, sizeof(hdr) - got, 0);
        if (n <= 0)
            return true; /* closed */
        got += (size_t)n;
    }
    stria_rpc_header_t h;
    stria_rpc_header_decode(hdr, &h);
    return h.status < 0;
}

static void worker_still_serves(int w)
{
    stria_rpc_client_params_t p;
    stria_rpc_client_t *c = NULL;
    memset(&p, 0, sizeof(p));
    p.address = cl.worker_rpc[w];
    p.service = &stria__v1__worker__descriptor;
    p.connect_timeout_s = 5;
    cr_assert_eq(stria_rpc_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__DropJobRequest req = STRIA__V1__DROP_JOB_REQUEST__INIT;
    req.job_id = 424242;
    stria_rpc_request_t rq = {
        .method = STRIA_RPC_WORKER_DROP_JOB, .request = &req.base, .timeout_s = 5};
    stria_rpc_reply_t reply;
    memset(&reply, 0, sizeof(reply));
    cr_assert_eq(stria_rpc_client_call(c, &rq, &reply), STRIA_OK, "%s", stria_error_msg());
    cr_expect(!((Stria__V1__DropJobReply *)reply.msg)->dropped);
    stria_rpc_reply_free(&reply);

    /* a nonsense request through a proper connection gets a clear error */
    tsess_rank_t r = {.c = c, .id = 999999, .timeout_s = 5};
    const stria_call_shape_t shape = {.batch = 1, .seq_len = 16, .causal = true};
    const stria_call_place_t place = {.call = 0};
    char payload[16] = {0};
    stria_status_t st = tsess_call(&r, &shape, &place, payload, sizeof(payload), NULL, 0, NULL);
    cr_expect_neq(st, STRIA_OK);
    cr_expect(strstr(stria_error_msg(), "999999") != NULL, "unclear error: %s", stria_error_msg());
    /* letting go of a held forward of a session it does not hold */
    r.id = 1;
    cr_expect_neq(tsess_drop(&r, true, 7), STRIA_OK);
    cr_expect(strstr(stria_error_msg(), "not held by this worker") != NULL, "unclear error: %s",
              stria_error_msg());
    stria_rpc_client_close(c);
}

/* ---- a call's inputs in pieces, through the worker's RPC directly ------------ */

/* One piece of call `call`'s inputs (bytes [off, off + len) of src), with
 * more to come or not; the outputs of the last piece into out. */
static stria_status_t piece(const tsess_rank_t *r, uint64_t call, uint64_t epoch,
                            const uint8_t *src, uint64_t off, uint64_t len, bool more, void *out,
                            uint64_t cap)
{
    const stria_call_shape_t shape = {.batch = 1, .seq_len = 64, .causal = true};
    const stria_call_place_t place = {
        .call = call, .link_epoch = epoch, .more = more, .piece_offset = off};
    return tsess_call(r, &shape, &place, src + off, len, out, cap, NULL);
}

/* A call whose inputs come in pieces runs only when every byte of them is
 * in: pieces in any order count exactly, a re-sent piece counts once, and a
 * missing byte is refused naming where the hole is. The output proves that
 * the pieces landed where their offsets said. */
Test(e2e, pieces_count_every_byte_once, .timeout = 300)
{
    enum { S = 64, H = 2, D = 16 };
    start_cluster(1, NULL, NULL);
    stria_rpc_client_t *cc = coord_client(NULL);
    Stria__V1__JobSpec spec = STRIA__V1__JOB_SPEC__INIT;
    spec.batch = 1;
    spec.seq_len = S;
    spec.heads = H;
    spec.kv_heads = H;
    spec.head_dim = D;
    spec.dtype = STRIA__V1__DTYPE__DTYPE_FP32;
    spec.causal = true;
    spec.ring_size = 1;
    spec.session = true;
    Stria__V1__SubmitJobRequest sreq = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    sreq.spec = &spec;
    stria_rpc_request_t srq = {
        .method = STRIA_RPC_COORDINATOR_SUBMIT_JOB, .request = &sreq.base, .timeout_s = 10};
    stria_rpc_reply_t sreply;
    memset(&sreply, 0, sizeof(sreply));
    cr_assert_eq(stria_rpc_client_call(cc, &srq, &sreply), STRIA_OK, "%s", stria_error_msg());
    const Stria__V1__Assignment *as = ((Stria__V1__SubmitJobReply *)sreply.msg)->assignment;
    cr_assert_not_null(as);
    cr_assert_eq(as->n_ranks, 1);

    size_t n = (size_t)S * H * D;
    const uint64_t tensor = n * sizeof(float), total = 3 * tensor;
    uint8_t *in = malloc(total);
    float *qkv[3], o[S * H * D + S * H]; /* O, then LSE */
    for (int t = 0; t < 3; t++) {
        qkv[t] = (float *)(in + (size_t)t * tensor);
        ref_fill(qkv[t], n, 100 + (uint64_t)t, 1.0f, STRIA_DTYPE_F32);
    }
    stria_rpc_client_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.address = as->ranks[0]->rpc_address;
    wp.service = &stria__v1__worker__descriptor;
    wp.connect_timeout_s = 5;
    tsess_rank_t r = {.id = as->job_id, .timeout_s = 10};
    const Stria__V1__SubmitJobReply *sr = (const Stria__V1__SubmitJobReply *)sreply.msg;
    cr_assert_eq(stria_auth_open(&sreply.session, "job secret", as->job_id, sr->job_secret.data,
                                 sr->job_secret.len, r.secret.bytes),
                 STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_rpc_client_connect(&wp, &r.c), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(tsess_open(&r), STRIA_OK, "%s", stria_error_msg());
    const uint64_t half = tensor / 2;

    /* Call 0: Q's second half, then its first; V; K's first half twice;
     * all of K but its last byte; then the last piece lies elsewhere and
     * leaves that byte out: refused, the hole named. */
    cr_assert_eq(piece(&r, 0, 0, in, half, half, true, NULL, 0), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(piece(&r, 0, 0, in, 0, half, true, NULL, 0), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(piece(&r, 0, 0, in, 2 * tensor, tensor, true, NULL, 0), STRIA_OK, "%s",
                 stria_error_msg());
    for (int k = 0; k < 2; k++)
        cr_assert_eq(piece(&r, 0, 0, in, tensor, half, true, NULL, 0), STRIA_OK, "%s",
                     stria_error_msg());
    cr_assert_eq(piece(&r, 0, 0, in, tensor + half / 2, tensor - half / 2 - 2, true, NULL, 0),
                 STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(piece(&r, 0, 0, in, 2 * tensor - 1, 1, false, o, sizeof(o)),
                 STRIA_ERR_INVALID_ARG);
    char want[160];
    snprintf(want, sizeof(want), "%llu of %llu bytes; the first missing byte is at %llu",
             (unsigned long long)(total - 1), (unsigned long long)total,
             (unsigned long long)(2 * tensor - 2));
    cr_expect(strstr(stria_error_msg(), "inputs are incomplete") != NULL &&
                  strstr(stria_error_msg(), want) != NULL,
              "not naming the hole (\"%s\"): %s", want, stria_error_msg());

    /* Call 1 (a fresh link after the failed call): the same pieces, a
     * repeat, and the missing byte; it runs on exactly the bytes sent. */
    const uint64_t epoch = 1u << 8;
    cr_assert_eq(piece(&r, 1, epoch, in, half, tensor + half, true, NULL, 0), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(piece(&r, 1, epoch, in, half, half, true, NULL, 0), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(piece(&r, 1, epoch, in, 2 * tensor, tensor, true, NULL, 0), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(piece(&r, 1, epoch, in, 0, half, false, o, sizeof(o)), STRIA_OK, "%s",
                 stria_error_msg());
    ref_shape_t rs = {.batch = 1,
                      .q_tokens = S,
                      .kv_tokens = S,
                      .heads = H,
                      .kv_heads = H,
                      .head_dim = D,
                      .scale = 1.0 / sqrt((double)D),
                      .causal = true};
    ref_out_t r64, r32;
    ref_f64_run(&rs, qkv[0], qkv[1], qkv[2], NULL, &r64);
    ref_f32_run(&rs, qkv[0], qkv[1], qkv[2], NULL, &r32);
    float o32[S * H * D];
    for (size_t i = 0; i < n; i++)
        o32[i] = (float)r32.o[i];
    double err = ref_max_err_f32(o, r64.o, n), yard = ref_max_err_f32(o32, r64.o, n);
    cr_expect_leq(err, 4 * yard + 1e-6, "O error %.3g against fp64 (plain fp32: %.3g)", err, yard);
    ref_out_free(&r64);
    ref_out_free(&r32);

    stria_rpc_client_close(r.c);
    stria_rpc_reply_free(&sreply);
    stria_rpc_client_close(cc);
    free(in);
    stop_cluster();
}

Test(e2e, worker_survives_malformed_frames, .timeout = 300)
{
    start_cluster(1, NULL, NULL);
    /* garbage bytes */
    int fd = raw_connect(cl.worker_rpc[0]);
    const char junk[] = "GET / HTTP/1.1\r\n\r\n this is not a stria frame at all.......";
    send(fd, junk, sizeof(junk), MSG_NOSIGNAL);
    cr_expect(refused(fd));
    close(fd);
    worker_still_serves(0);
    /* a header announcing an absurd payload */
    fd = raw_connect(cl.worker_rpc[0]);
    stria_rpc_header_t h = {
        STRIA_RPC_MAGIC,  STRIA_RPC_VERSION, STRIA_RPC_FLAG_HELLO, 0, 0, 1, 16, 0,
        (uint64_t)1 << 50};
    uint8_t buf[STRIA_RPC_HEADER_SIZE];
    stria_rpc_header_encode(&h, buf);
    send(fd, buf, sizeof(buf), MSG_NOSIGNAL);
    cr_expect(refused(fd));
    close(fd);
    /* wrong protocol version */
    fd = raw_connect(cl.worker_rpc[0]);
    h.version = 99;
    h.payload_len = 0;
    stria_rpc_header_encode(&h, buf);
    send(fd, buf, sizeof(buf), MSG_NOSIGNAL);
    cr_expect(refused(fd));
    close(fd);
    /* truncated: half a header, then hang up */
    fd = raw_connect(cl.worker_rpc[0]);
    send(fd, buf, 17, MSG_NOSIGNAL);
    close(fd);
    worker_still_serves(0);
    stop_cluster();
}

Test(e2e, token_required_everywhere, .timeout = 300)
{
    char tok_dir[128];
    snprintf(tok_dir, sizeof(tok_dir), "/tmp/stria_e2e_tok_%d", (int)getpid());
    char path[200];
    snprintf(path, sizeof(path), "%s.token", tok_dir);
    FILE *f = fopen(path, "w");
    fputs("s3cret-token\n", f);
    fclose(f);
    start_cluster(2, path, "s3cret-token");
    /* no token and a wrong token are refused */
    stria_client_params_t p;
    stria_client_t *c = NULL;
    memset(&p, 0, sizeof(p));
    p.struct_size = sizeof(p);
    p.coordinator = cl.coord_addr;
    cr_expect_eq(stria_client_connect(&p, &c), STRIA_ERR_AUTH, "%s", stria_error_msg());
    p.token = "wrong";
    cr_expect_eq(stria_client_connect(&p, &c), STRIA_ERR_AUTH, "%s", stria_error_msg());
    /* token_file: both at once are refused, a missing file is named, the
     * daemons' file (newline and all) connects; a caller of the first ABI 1
     * size (without token_file) still connects */
    p.token_file = path;
    cr_expect_eq(stria_client_connect(&p, &c), STRIA_ERR_INVALID_ARG, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "token_file") != NULL, "%s", stria_error_msg());
    p.token = NULL;
    p.token_file = "/nonexistent/stria.token";
    cr_expect_eq(stria_client_connect(&p, &c), STRIA_ERR_IO, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "/nonexistent/stria.token") != NULL, "%s",
              stria_error_msg());
    p.token_file = path;
    cr_assert_eq(stria_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(c);
    p.token_file = NULL;
    p.token = "s3cret-token";
    p.struct_size = offsetof(stria_client_params_t, token_file);
    cr_assert_eq(stria_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(c);
    /* the right token runs a job (the workers check it too) */
    c = connect_client("s3cret-token");
    tjob_t j;
    job_data_init(&j, 1, 50, 2, 2, 16, STRIA_DTYPE_F32, true, 90);
    run_job(c, &j);
    check_outputs(&j, true);
    tjob_free(&j);
    stria_client_close(c);
    stop_cluster();
    unlink(path);
    strcat(path, ".worker");
    unlink(path);
}

Test(e2e, nonsense_specs_get_clear_errors, .timeout = 300)
{
    start_cluster(2, NULL, NULL);
    stria_client_t *c = connect_client(NULL);
    float x[64];
    float lse[64];
    stria_job_t *job = NULL;
    struct {
        stria_job_spec_t spec;
        const char *needle;
    } bad[] = {
        {{.struct_size = sizeof(stria_job_spec_t),
          .batch = 1,
          .seq_len = 16,
          .heads = 3,
          .kv_heads = 2,
          .head_dim = 16},
         "multiple"},
        {{.struct_size = sizeof(stria_job_spec_t),
          .batch = 1,
          .seq_len = 16,
          .heads = 2,
          .kv_heads = 2,
          .head_dim = 20},
         "head_dim"},
        {{.struct_size = sizeof(stria_job_spec_t),
          .batch = 1,
          .seq_len = (int64_t)1 << 45,
          .heads = 2,
          .kv_heads = 2,
          .head_dim = 16},
         "seq_len"},
        {{.struct_size = sizeof(stria_job_spec_t),
          .batch = 1,
          .seq_len = 16,
          .heads = 2,
          .kv_heads = 2,
          .head_dim = 16,
          .ring_size = 9},
         "worker"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        stria_status_t st =
            stria_client_forward(c, &bad[i].spec, x, x, x, x, lse, NULL, NULL, NULL, &job);
        cr_expect_neq(st, STRIA_OK, "spec %zu was accepted", i);
        cr_expect(strstr(stria_error_msg(), bad[i].needle) != NULL,
                  "spec %zu: message '%s' lacks '%s'", i, stria_error_msg(), bad[i].needle);
    }
    /* still serving */
    tjob_t j;
    job_data_init(&j, 1, 40, 2, 2, 16, STRIA_DTYPE_F32, false, 95);
    run_job(c, &j);
    check_outputs(&j, true);
    tjob_free(&j);
    stria_client_close(c);
    stop_cluster();
}

/* ---- devices -------------------------------------------------------------------- */

/* Workers on the staged device (device buffers apart from the RPC layer's
 * host buffers, every staging copy of a GPU) give exactly the in-process
 * ring's results, and say which device they run on. */
/* The service's outputs of a job are bit for bit those of the same ring
 * (spec's ring_size and layout, documents and window) in this process, on
 * the plain cpu device. */
static void expect_in_process_ring(const tjob_t *j, size_t i)
{
    const stria_job_spec_t *s = &j->spec;
    stria_ring_local_opts_t lo = {
        .layout = stria_layout_kind_resolve(s->layout, s->has_window, s->n_cu_seqlens > 2),
        .n_ranks = s->ring_size,
        .passes = STRIA_RING_PASS_FWD_BWD};
    char what[32];
    snprintf(what, sizeof(what), "case %zu", i);
    tcheck_in_process(j, &lo, what);
}

Test(e2e, documents_and_window_through_4_workers, .timeout = 300)
{
    static const int64_t cu[] = {0, 1, 17, 300, 301, 1024};
    /* auto: the coordinator chooses contiguous for a windowed job. */
    static const stria_layout_kind_t layouts[] = {STRIA_LAYOUT_ZIGZAG, STRIA_LAYOUT_STRIPED,
                                                  STRIA_LAYOUT_AUTO};
    start_cluster(4, NULL, NULL);
    stria_client_t *c = connect_client(NULL);
    for (size_t i = 0; i < 3; i++) {
        tjob_t j;
        job_data_init(&j, 1, 1024, 4, 2, 64, STRIA_DTYPE_BF16, true, 60 + i);
        j.spec.ring_size = 4;
        j.spec.layout = layouts[i];
        j.spec.cu_seqlens = cu;
        j.spec.n_cu_seqlens = 6;
        j.spec.has_window = true;
        j.spec.window_left = 255;
        j.spec.window_right = 0;
        run_job(c, &j);
        expect_in_process_ring(&j, i);
        if (i == 0)
            check_outputs(&j, true);
        if (layouts[i] == STRIA_LAYOUT_AUTO) {
            /* contiguous shards of 256 and a window of 255: the forward's K/V
             * goes one hop (2 steps); the backward's dK/dV all 4. */
            stria_job_t *job = NULL;
            stria_call_stats_t fs = STRIA_CALL_STATS_INIT, bs = STRIA_CALL_STATS_INIT;
            cr_assert_eq(
                stria_client_forward(c, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, &fs, &job),
                STRIA_OK, "%s", stria_error_msg());
            cr_assert_eq(stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, &bs),
                         STRIA_OK, "%s", stria_error_msg());
            uint64_t block = 2u * 256 * 2 * 64 * 2; /* K and V of a bf16 shard */
            cr_expect_eq(fs.ring_steps, 2, "forward ran %u steps", fs.ring_steps);
            cr_expect_eq(bs.ring_steps, 4, "backward ran %u steps", bs.ring_steps);
            cr_expect_geq(fs.ring_bytes_sent, 4 * block);
            cr_expect_lt(fs.ring_bytes_sent, 5 * block, "forward sent %llu bytes",
                         (unsigned long long)fs.ring_bytes_sent);
            cr_expect_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
        }
        tjob_free(&j);
    }
    /* Bad documents are refused with the message of the one check every door
     * runs (libstria first, then the coordinator and the worker). */
    static const int64_t bad[] = {0, 17, 1000};
    tjob_t j;
    stria_job_t *job = NULL;
    job_data_init(&j, 1, 1024, 4, 2, 64, STRIA_DTYPE_F32, true, 70);
    j.spec.cu_seqlens = bad;
    j.spec.n_cu_seqlens = 3;
    cr_expect_eq(
        stria_client_forward(c, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job),
        STRIA_ERR_INVALID_ARG);
    /* libstria's door: nothing was sent (the coordinator's refusal would
     * name the RPC) */
    cr_expect(strncmp(stria_error_msg(),
                      "job spec: cu_seqlens must end at seq_len (1024) (got 1000)", 58) == 0,
              "%s", stria_error_msg());
    tjob_free(&j);
    stria_client_close(c);
    stop_cluster();
}

Test(e2e, staged_device_workers_equal_the_in_process_ring, .timeout = 300)
{
    worker_device = "cpu:staged";
    start_cluster(3, NULL, NULL);
    worker_device = NULL;
    char log[300], text[8192] = "";
    snprintf(log, sizeof(log), "%s/worker0.log", cl.dir);
    stria_client_t *c = connect_client(NULL);
    static const struct {
        int ring;
        int64_t S, H, Hkv;
        stria_dtype_t dt;
        bool causal;
        stria_layout_kind_t layout;
    } cases[] = {
        {3, 101, 4, 2, STRIA_DTYPE_BF16, true, STRIA_LAYOUT_STRIPED},
        {2, 77, 4, 1, STRIA_DTYPE_F32, false, STRIA_LAYOUT_ZIGZAG},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        tjob_t j;
        job_data_init(&j, 2, cases[i].S, cases[i].H, cases[i].Hkv, 32, cases[i].dt, cases[i].causal,
                      40 + i);
        j.spec.ring_size = cases[i].ring;
        j.spec.layout = cases[i].layout;
        run_job(c, &j);
        expect_in_process_ring(&j, i);
        check_outputs(&j, true);
        tjob_free(&j);
    }
    stria_client_close(c);
    FILE *f = fopen(log, "r");
    cr_assert_not_null(f);
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    text[n] = '\0';
    fclose(f);
    cr_expect(strstr(text, "device cpu:staged") != NULL, "worker log does not name the device:\n%s",
              text);
    stop_cluster();
}

/* Runs stria-worker with extra arguments that must stop it at start: exit
 * status 2 and a message on stderr containing every `want`. */
static void expect_startup_error(char *const extra[], size_t n_extra, const char *const want[],
                                 size_t n_want)
{
    char dir[128], log[200], text[4096] = "";
    snprintf(dir, sizeof(dir), "/tmp/stria_e2e_dev_%d", (int)getpid());
    snprintf(log, sizeof(log), "%s.log", dir);
    char *argv[16] = {STRIA_WORKER_BIN, "--coordinator", "127.0.0.1:9", "--threads", "1"};
    size_t argc = 5;
    for (size_t i = 0; i < n_extra; i++)
        argv[argc++] = extra[i];
    argv[argc] = NULL;
    test_proc_t *p = test_proc_start(argv, log, ucx_env);
    cr_assert_not_null(p);
    int st = test_proc_wait(p, 20);
    FILE *f = fopen(log, "r");
    cr_assert_not_null(f);
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    text[n] = '\0';
    fclose(f);
    unlink(log);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 2, "%s %s: status %#x, stderr: %s", extra[0],
              n_extra > 1 ? extra[1] : "", st, text);
    for (size_t i = 0; i < n_want; i++)
        cr_expect(strstr(text, want[i]) != NULL, "stderr does not say '%s': %s", want[i], text);
}

Test(e2e, bad_devices_stop_the_worker_at_start, .timeout = 300)
{
    char *cuda7[] = {"--device", "cuda:7"};
    const char *cuda7_want[] = {"--device: ", "cuda:7",
                                stria_cuda_built() ? "no such GPU"
                                                   : "this build has no CUDA support"};
    expect_startup_error(cuda7, 2, cuda7_want, 3);

    char *bogus[] = {"--device=bogus"};
    const char *bogus_want[] = {"--device: ", "unknown device 'bogus'"};
    expect_startup_error(bogus, 1, bogus_want, 2);

    /* from the configuration file: the error names the file and the line */
    char conf[128], arg[160];
    snprintf(conf, sizeof(conf), "/tmp/stria_e2e_dev_%d.conf", (int)getpid());
    FILE *f = fopen(conf, "w");
    cr_assert_not_null(f);
    fprintf(f, "# a worker\nthreads = 1\n\n  device = gpu0\n");
    fclose(f);
    snprintf(arg, sizeof(arg), "--config=%s", conf);
    char *from_file[] = {arg};
    char where[160];
    snprintf(where, sizeof(where), "%s:4: --device: ", conf);
    const char *file_want[] = {where, "unknown device 'gpu0'"};
    expect_startup_error(from_file, 1, file_want, 2);
    unlink(conf);
}
