/* The data path with real daemons on loopback: the workers' memory pools
 * (a second identical job reuses the first one's memory; a job that does not
 * fit is refused at admission naming the need and the offer, and runs once
 * memory is free; a client that dies in the middle of a call's inputs
 * leaves the pool where it was), on a host worker and on a staged device
 * (cpu:staged: device and pinned pools), and libstria's transfers against
 * the in-process ring, bit for bit. */
#include <criterion/criterion.h>

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy_util.h"
#include "proc.h"
#include "stria.pb-c.h"
#include "stria_client.h"
#include "stria_ring.h"
#include "stria_rpc.h"
#include "tcheck.h"
#include "tjob.h"
#include "tsess.h"

#define T_TIMEOUT 240
#define MiB       ((uint64_t)1 << 20)

/* ---- RPC to the daemons ------------------------------------------------------ */

static stria_rpc_client_t *rpc_to(const char *addr, const ProtobufCServiceDescriptor *svc)
{
    stria_rpc_client_params_t p;
    stria_rpc_client_t *cl = NULL;
    memset(&p, 0, sizeof(p));
    p.address = addr;
    p.service = svc;
    p.client_name = "test_datapath";
    p.connect_timeout_s = 5;
    cr_assert_eq(stria_rpc_client_connect(&p, &cl), STRIA_OK, "%s: %s", addr, stria_error_msg());
    return cl;
}

/* The secrets of the jobs submit_raw() made (a request about one proves it). */
static struct {
    uint64_t id;
    stria_job_secret_t secret;
} g_jobs[16];
static int g_n_jobs;

static const stria_job_secret_t *secret_of(uint64_t id)
{
    for (int i = 0; i < g_n_jobs; i++)
        if (g_jobs[i].id == id)
            return &g_jobs[i].secret;
    return NULL;
}

/* A call; about job `job` (its secret proven) when it is one submit_raw() made. */
static stria_status_t call_job(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                               uint64_t job, const void *payload, uint64_t len,
                               stria_rpc_reply_t *rep)
{
    stria_rpc_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.method = method;
    rq.request = req;
    rq.payload = payload;
    rq.payload_len = len;
    rq.timeout_s = 20;
    rq.job_secret = secret_of(job);
    rq.job_id = job;
    memset(rep, 0, sizeof(*rep));
    return stria_rpc_client_call(cl, &rq, rep);
}

static stria_status_t call(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                           const void *payload, uint64_t len, stria_rpc_reply_t *rep)
{
    return call_job(cl, method, req, 0, payload, len, rep);
}

/* A worker's memory figures, as its last heartbeat told the coordinator. */
typedef struct {
    uint64_t admitted, reserved, in_use, high_water, committed;
} pool_t;

static pool_t pool_of(const dcluster_t *c, int i)
{
    stria_rpc_client_t *cl = rpc_to(c->coord_addr, &stria__v1__coordinator__descriptor);
    Stria__V1__ListWorkersRequest req = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    cr_assert_eq(call(cl, STRIA_RPC_COORDINATOR_LIST_WORKERS, &req.base, NULL, 0, &rep), STRIA_OK,
                 "%s", stria_error_msg());
    const Stria__V1__ListWorkersReply *r = (const Stria__V1__ListWorkersReply *)rep.msg;
    pool_t p = {0};
    bool found = false;
    for (size_t k = 0; k < r->n_workers; k++) {
        const Stria__V1__WorkerInfo *w = r->workers[k];
        if (strcmp(w->rpc_address, c->worker_rpc[i]) != 0)
            continue;
        p = (pool_t){w->memory_in_use_bytes, w->pool_reserved_bytes, w->pool_in_use_bytes,
                     w->pool_high_water_bytes, w->pool_committed_bytes};
        found = true;
    }
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);
    cr_assert(found, "worker %s is not listed", c->worker_rpc[i]);
    return p;
}

/* Waits (10 s) until worker i reports nothing admitted and nothing in use. */
static pool_t wait_pool_idle(const dcluster_t *c, int i)
{
    pool_t p;
    for (int t = 0; t < 200; t++) {
        p = pool_of(c, i);
        if (p.admitted == 0 && p.in_use == 0 && p.reserved > 0)
            return p;
        usleep(50000);
    }
    cr_assert_fail("worker %d: the pool did not return to idle (admitted %llu, in use %llu)", i,
                   (unsigned long long)p.admitted, (unsigned long long)p.in_use);
    return p;
}

static Stria__V1__JobState job_state(const dcluster_t *c, uint64_t id, uint64_t *per_rank)
{
    stria_rpc_client_t *cl = rpc_to(c->coord_addr, &stria__v1__coordinator__descriptor);
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.job_id = id;
    cr_assert_eq(call_job(cl, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, id, NULL, 0, &rep),
                 STRIA_OK, "%s", stria_error_msg());
    const Stria__V1__JobInfo *j = ((Stria__V1__GetJobReply *)rep.msg)->job;
    Stria__V1__JobState st = j->state;
    if (per_rank != NULL)
        *per_rank = j->assignment ? j->assignment->memory_per_rank_bytes : 0;
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);
    return st;
}

/* ---- a job's tensors and its in-process reference ----------------------------- */

/* A causal job's tensors (tests/support/tjob.h) for a ring of `ring` in
 * `layout`, with steps of 10 s at most. */
static void tj_init(tjob_t *t, int64_t B, int64_t S, int64_t H, int64_t Hkv, int64_t D,
                    stria_dtype_t dt, stria_layout_kind_t layout, int ring, uint64_t seed)
{
    cr_assert(tjob_init(t, B, S, H, Hkv, D, dt, true, seed), "out of memory");
    t->spec.layout = layout;
    t->spec.ring_size = ring;
    t->spec.step_timeout_s = 10;
}

/* Forward and backward through libstria; the job's id and its admission
 * figure per rank. */
static void tj_run(const dcluster_t *c, tjob_t *t, uint64_t *id, uint64_t *per_rank)
{
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *client = NULL;
    stria_job_t *job = NULL;
    p.coordinator = c->coord_addr;
    p.data_path = STRIA_DATA_PATH_TCP;
    cr_assert_eq(stria_client_connect(&p, &client), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_client_forward(client, &t->spec, t->q, t->k, t->v, t->o, t->lse, NULL, NULL,
                                      NULL, &job),
                 STRIA_OK, "forward: %s", stria_error_msg());
    cr_assert_eq(stria_client_backward(job, t->g, t->dq, t->dk, t->dv, NULL, NULL, NULL), STRIA_OK,
                 "backward: %s", stria_error_msg());
    *id = stria_job_id(job);
    job_state(c, *id, per_rank);
    cr_expect_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(client);
}

/* The same job through the in-process ring: every output bit for bit. */
static void tj_expect_in_process(const tjob_t *t, const char *what)
{
    stria_ring_local_opts_t lo = {
        .layout = t->spec.layout, .n_ranks = t->spec.ring_size, .passes = STRIA_RING_PASS_FWD_BWD};
    tcheck_in_process(t, &lo, what);
}

/* ---- tests --------------------------------------------------------------------- */

/* Two identical jobs, one after the other: the second runs on the memory
 * of the first (the pool neither commits more nor reaches a new high),
 * every rank used no more than its admission figure, and both give the
 * in-process ring's bits. Batch 3 of an odd length (padded shards),
 * GQA, bf16 rows of 512 bytes (Q) and 256 (K/V, staged): every kind of
 * transfer piece. */
static void reuse_case(const char *device, stria_layout_kind_t layout)
{
    dcluster_t c;
    dc_opts_t o = {.worker_device = device};
    dc_init(&c);
    dc_start(&c, 2, &o);
    tjob_t t;
    tj_init(&t, 3, 203, 4, 2, 64, STRIA_DTYPE_BF16, layout, 2, 7);
    uint64_t id, per_rank;
    tj_run(&c, &t, &id, &per_rank);
    tj_expect_in_process(&t, "first job");
    pool_t first[2], second[2];
    for (int i = 0; i < 2; i++) {
        first[i] = wait_pool_idle(&c, i);
        cr_expect_eq(first[i].reserved, 1000000000, "worker %d: the pool holds --memory", i);
        cr_expect_gt(first[i].high_water, 0, "worker %d: the job used no pool memory", i);
        cr_expect_leq(first[i].high_water, per_rank,
                      "worker %d: a rank used %llu bytes, more than its admission (%llu)", i,
                      (unsigned long long)first[i].high_water, (unsigned long long)per_rank);
        cr_expect_geq(first[i].committed, first[i].high_water);
    }
    memset(t.o, 0, t.nq * t.es);
    memset(t.dq, 0, t.nq * t.es);
    memset(t.lse, 0, t.nl * 4);
    tj_run(&c, &t, &id, &per_rank);
    tj_expect_in_process(&t, "second job");
    for (int i = 0; i < 2; i++) {
        second[i] = wait_pool_idle(&c, i);
        cr_expect_eq(second[i].committed, first[i].committed,
                     "worker %d: the second job committed more (%llu, then %llu bytes)", i,
                     (unsigned long long)first[i].committed,
                     (unsigned long long)second[i].committed);
        cr_expect_eq(second[i].high_water, first[i].high_water,
                     "worker %d: the second job went past the first's high water", i);
    }
    /* the pools in /metrics, by pool */
    char *body = NULL;
    cr_assert_eq(dc_http_get(c.worker_metrics[0], "/metrics", &body), 200);
    const char *want[] = {"stria_worker_pool_reserved_bytes{pool=\"host\"}",
                          "stria_worker_pool_in_use_bytes{pool=\"host\"} 0",
                          "stria_worker_pool_high_water_bytes{pool=\"host\"}",
                          "stria_worker_pool_committed_bytes{pool=\"host\"}",
                          device ? "stria_worker_pool_high_water_bytes{pool=\"device\"}" : "",
                          device ? "stria_worker_pool_in_use_bytes{pool=\"pinned\"} 0" : ""};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        cr_expect(strstr(body, want[i]) != NULL, "/metrics lacks '%s'", want[i]);
    free(body);
    tjob_free(&t);
    dc_stop(&c);
}

Test(datapath, second_identical_job_reuses_the_pool_host, .timeout = T_TIMEOUT)
{
    reuse_case(NULL, STRIA_LAYOUT_STRIPED);
}

Test(datapath, second_identical_job_reuses_the_pools_staged_device, .timeout = T_TIMEOUT)
{
    reuse_case("cpu:staged", STRIA_LAYOUT_ZIGZAG);
}

/* Submits a job (1 rank, causal fp32) over raw RPC; returns its id and its
 * worker's address. */
static uint64_t submit_raw(const dcluster_t *c, int64_t seq, uint32_t ttl_s)
{
    stria_rpc_client_t *cl = rpc_to(c->coord_addr, &stria__v1__coordinator__descriptor);
    Stria__V1__JobSpec spec = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    spec.batch = 1;
    spec.seq_len = (uint64_t)seq;
    spec.heads = spec.kv_heads = 4;
    spec.head_dim = 64;
    spec.dtype = STRIA__V1__DTYPE__DTYPE_FP32;
    spec.causal = true;
    spec.ring_size = 1;
    spec.ttl_s = ttl_s;
    spec.no_queue = true;
    spec.max_held = 1; /* as libstria submits a job */
    req.spec = &spec;
    stria_rpc_reply_t rep;
    cr_assert_eq(call(cl, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, NULL, 0, &rep), STRIA_OK,
                 "%s", stria_error_msg());
    const Stria__V1__SubmitJobReply *sr = (const Stria__V1__SubmitJobReply *)rep.msg;
    uint64_t id = sr->assignment->job_id;
    cr_assert_lt(g_n_jobs, 16);
    g_jobs[g_n_jobs].id = id;
    cr_assert_eq(stria_auth_open(&rep.session, "job secret", id, sr->job_secret.data,
                                 sr->job_secret.len, g_jobs[g_n_jobs].secret.bytes),
                 STRIA_OK, "%s", stria_error_msg());
    g_n_jobs++;
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);
    return id;
}

/* The raw session of job `id`'s rank 0 on a worker connection. */
static tsess_rank_t rank0(stria_rpc_client_t *w, uint64_t id)
{
    tsess_rank_t r = {.c = w, .id = id, .timeout_s = 20};
    const stria_job_secret_t *secret = secret_of(id);
    cr_assert_not_null(secret);
    r.secret = *secret;
    return r;
}

/* A piece of bytes [off, off + len) of the inputs of call 0 of job `id`
 * (seq tokens), more to come. */
static stria_status_t put_piece(stria_rpc_client_t *w, uint64_t id, int64_t seq, const void *bytes,
                                uint64_t off, uint64_t len)
{
    tsess_rank_t r = rank0(w, id);
    const stria_call_shape_t shape = {.batch = 1, .seq_len = seq, .causal = true};
    const stria_call_place_t place = {.more = true, .piece_offset = off};
    return tsess_call(&r, &shape, &place, (const char *)bytes + off, len, NULL, 0, NULL);
}

static bool log_has(const char *path, const char *needle)
{
    char *text = dc_read(path);
    bool has = strstr(text, needle) != NULL;
    free(text);
    return has;
}

/* A worker whose pool is taken refuses a job when it arrives, with the need
 * and the offer; the job runs once the memory is free. The coordinator
 * forgets a released job at once while its worker hears of it at its next
 * heartbeat: in between, only the worker's own admission stands between
 * the next job and its memory (heartbeats every 10 s here; should one
 * still fall in between, the log says so and the round is tried again). */
Test(datapath, pool_exhaustion_refused_at_admission, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_opts_t o = {.worker_memory = "20M", .heartbeat_period_s = 10};
    dc_init(&c);
    dc_start(&c, 1, &o);
    stria_client_params_t cp = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *client = NULL;
    cp.coordinator = c.coord_addr;
    cr_assert_eq(stria_client_connect(&cp, &client), STRIA_OK, "%s", stria_error_msg());
    tjob_t t;
    stria_job_t *job = NULL;

    /* more than the worker offers: the coordinator refuses, naming both */
    tj_init(&t, 1, 4096, 4, 4, 64, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 1, 3);
    cr_expect_eq(
        stria_client_forward(client, &t.spec, t.q, t.k, t.v, t.o, t.lse, NULL, NULL, NULL, &job),
        STRIA_ERR_NO_MEMORY);
    uint64_t big = 0, need = 0;
    cr_assert_eq(stria_session_rank_memory(1, 4096, 4, 4, 64, STRIA_DTYPE_F32, 1, &big), STRIA_OK);
    char want[160];
    snprintf(want, sizeof(want), "needs %llu MiB per rank", (unsigned long long)(big >> 20));
    cr_expect(strstr(stria_error_msg(), want) != NULL &&
                  strstr(stria_error_msg(), "offer 20 MiB") != NULL,
              "%s", stria_error_msg());
    tjob_free(&t);

    /* a job that fits once, not twice */
    uint64_t cap = 20 * MiB;
    int64_t seq = 512;
    for (; seq > 64; seq -= 32) {
        cr_assert_eq(stria_session_rank_memory(1, seq, 4, 4, 64, STRIA_DTYPE_F32, 1, &need),
                     STRIA_OK);
        if (need < cap && 2 * need > cap)
            break;
    }
    cr_assert(need < cap && 2 * need > cap, "the test's job must fit once, not twice");
    tj_init(&t, 1, seq, 4, 4, 64, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 1, 4);
    /* the need rounded up, the offer down */
    snprintf(want, sizeof(want), "needs %llu MiB of the host pool, %llu MiB of %llu MiB are free",
             (unsigned long long)((need + MiB - 1) >> 20), (unsigned long long)((cap - need) >> 20),
             (unsigned long long)(cap >> 20));
    stria_rpc_client_t *w = rpc_to(c.worker_rpc[0], &stria__v1__worker__descriptor);
    stria_rpc_client_t *co = rpc_to(c.coord_addr, &stria__v1__coordinator__descriptor);
    bool refused = false;
    for (int round = 0; round < 3 && !refused; round++) {
        /* job A holds the worker's memory, released at the coordinator only */
        uint64_t a = submit_raw(&c, seq, 600);
        tsess_rank_t ra = rank0(w, a);
        cr_assert_eq(tsess_open(&ra), STRIA_OK, "%s", stria_error_msg());
        Stria__V1__ReleaseJobRequest rel = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
        stria_rpc_reply_t rep;
        rel.job_id = a;
        cr_assert_eq(call_job(co, STRIA_RPC_COORDINATOR_RELEASE_JOB, &rel.base, a, NULL, 0, &rep),
                     STRIA_OK, "%s", stria_error_msg());
        stria_rpc_reply_free(&rep);
        /* job B: admitted by the coordinator, refused by the worker */
        stria_status_t st = stria_client_forward(client, &t.spec, t.q, t.k, t.v, t.o, t.lse, NULL,
                                                 NULL, NULL, &job);
        char dropped[96];
        snprintf(dropped, sizeof(dropped), "job %llu: dropped at the coordinator's request",
                 (unsigned long long)a);
        if (st == STRIA_OK) {
            stria_client_release(job);
            job = NULL;
            cr_assert(log_has(c.worker_log[0], dropped),
                      "job B ran while job A held the pool, and no heartbeat dropped A");
            continue; /* a heartbeat fell in between: again */
        }
        refused = true;
        cr_expect_eq(st, STRIA_ERR_NO_MEMORY, "%s", stria_error_msg());
        const char *msg = stria_error_msg();
        cr_expect(strstr(msg, "open") != NULL && strstr(msg, want) != NULL,
                  "the refusal names the need and the offer ('%s'): %s", want, msg);
        pool_t p = pool_of(&c, 0);
        cr_expect_leq(p.in_use, p.reserved);
        /* A goes (as libstria's release does); B runs to the end */
        Stria__V1__DropJobRequest dj = STRIA__V1__DROP_JOB_REQUEST__INIT;
        dj.job_id = a;
        cr_assert_eq(call_job(w, STRIA_RPC_WORKER_DROP_JOB, &dj.base, a, NULL, 0, &rep), STRIA_OK,
                     "%s", stria_error_msg());
        stria_rpc_reply_free(&rep);
        cr_assert_eq(stria_client_forward(client, &t.spec, t.q, t.k, t.v, t.o, t.lse, NULL, NULL,
                                          NULL, &job),
                     STRIA_OK, "%s", stria_error_msg());
        cr_assert_eq(stria_client_backward(job, t.g, t.dq, t.dk, t.dv, NULL, NULL, NULL), STRIA_OK,
                     "%s", stria_error_msg());
        stria_client_release(job);
        tj_expect_in_process(&t, "job B");
    }
    cr_expect(refused, "three rounds in a row had a heartbeat in between");
    stria_rpc_client_close(w);
    stria_rpc_client_close(co);
    stria_client_close(client);
    tjob_free(&t);
    dc_stop(&c);
}

/* A client killed in the middle of a call's inputs (one piece in, the last
 * cut mid-payload): the job fails, its worker frees it, and the pool is
 * back where it was before the job, memory kept for the next; the worker
 * serves on. */
Test(datapath, client_killed_mid_upload_leaves_the_pool_as_it_was, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_init(&c);
    dc_start(&c, 1, NULL);
    pool_t before = wait_pool_idle(&c, 0);
    uint64_t id = submit_raw(&c, 512, 2);
    uint64_t total = 3 * 512 * 4 * 64 * 4; /* the forward's Q, K, V */
    int fds[2], back[2];
    cr_assert_eq(pipe(fds), 0);
    cr_assert_eq(pipe(back), 0);
    pid_t parent = getpid(), pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        test_proc_child_setup(parent);
        stria_rpc_client_params_t p;
        stria_rpc_client_t *w = NULL;
        memset(&p, 0, sizeof(p));
        p.address = c.worker_rpc[0];
        p.service = &stria__v1__worker__descriptor;
        p.connect_timeout_s = 5;
        char *buf = calloc(1, total);
        tsess_rank_t r = {.id = id, .timeout_s = 5};
        r.secret = *secret_of(id);
        if (stria_rpc_client_connect(&p, &w) != STRIA_OK || buf == NULL)
            _exit(3);
        r.c = w;
        if (tsess_open(&r) != STRIA_OK || put_piece(w, id, 512, buf, 0, total / 2) != STRIA_OK)
            _exit(3);
        /* the first half is in: the parent looks at the pool, then says go */
        char go = '1';
        if (write(fds[1], &go, 1) != 1 || read(back[0], &go, 1) != 1)
            _exit(4);
        /* the second half stops after 64 KiB: the rest is unreadable */
        char *bad = mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        struct iovec iov[2] = {{buf, 65536}, {bad, total - total / 2 - 65536}};
        const stria_call_shape_t shape = {.batch = 1, .seq_len = 512, .causal = true};
        const stria_call_place_t place = {.piece_offset = total / 2};
        Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
        Stria__V1__CallShape pb;
        Stria__V1__JobSpec__Window win;
        uint8_t bound[STRIA_CALL_BINDING_BYTES];
        stria_call_shape_to_pb(&shape, &pb, &win);
        req.job_id = id;
        req.shape = &pb;
        stria_call_place_to_pb(&place, &req);
        stria_call_binding(&shape, STRIA_LAYOUT_STRIPED, &place, bound);
        stria_rpc_request_t rq = {.method = STRIA_RPC_WORKER_SESSION_CALL,
                                  .request = &req.base,
                                  .payload_iov = iov,
                                  .payload_iovcnt = 2,
                                  .job_secret = secret_of(id),
                                  .job_id = id,
                                  .proof_extra = bound,
                                  .proof_extra_len = sizeof(bound),
                                  .timeout_s = 5};
        stria_rpc_reply_t rep = {0};
        stria_status_t st = stria_rpc_client_call(w, &rq, &rep);
        char ok = st != STRIA_OK ? 'x' : '!';
        if (write(fds[1], &ok, 1) != 1)
            _exit(4);
        pause();
        _exit(0);
    }
    close(fds[1]);
    close(back[0]);
    char ok = 0;
    cr_assert_eq(read(fds[0], &ok, 1), 1, "the uploading client died early");
    cr_assert_eq(ok, '1');
    pool_t during = pool_of(&c, 0);
    for (int t = 0; t < 100 && during.admitted == 0; t++, usleep(50000))
        during = pool_of(&c, 0);
    cr_expect_gt(during.admitted, 0, "the job held no memory mid-upload");
    cr_assert_eq(write(back[1], &ok, 1), 1);
    cr_assert_eq(read(fds[0], &ok, 1), 1, "the uploading client died early");
    cr_expect_eq(ok, 'x', "the cut upload went through");
    close(back[1]);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    close(fds[0]);

    /* (asking about the job would keep it alive: watch the worker) */
    pool_t after = wait_pool_idle(&c, 0);
    Stria__V1__JobState st = job_state(&c, id, NULL);
    /* the worker failed it: its client's connection was lost mid-upload */
    cr_expect_eq(st, STRIA__V1__JOB_STATE__JOB_STATE_FAILED, "the abandoned job is %d", (int)st);
    cr_expect_eq(after.in_use, before.in_use);
    cr_expect_eq(after.admitted, before.admitted);
    cr_expect_gt(after.committed, before.committed, "the job's memory is kept for the next");

    /* the worker serves on */
    tjob_t t;
    uint64_t id2, per_rank;
    tj_init(&t, 1, 300, 4, 4, 64, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 1, 9);
    tj_run(&c, &t, &id2, &per_rank);
    tj_expect_in_process(&t, "the next job");
    tjob_free(&t);
    dc_stop(&c);
}

Test(datapath, unknown_data_path_refused_clearly, .timeout = T_TIMEOUT)
{
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *client = NULL;
    p.coordinator = "127.0.0.1:9";
    p.data_path = (stria_data_path_t)7;
    cr_expect_eq(stria_client_connect(&p, &client), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "data_path 7") != NULL, "%s", stria_error_msg());
    cr_expect_null(client);
}
