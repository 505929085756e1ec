/* Coordinator suite: registration, ring order, heartbeats and dead workers,
 * admission, queueing, the job state machine, TTL, admin methods, and the
 * stria-coordinator daemon as a real process against bad peers. Workers are
 * played by the test through the Coordinator service itself. */
#include <criterion/criterion.h>

#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../rpc/rpc_testutil.h"
#include "proc.h"
#include "stria_coordinator.h"

/* Criterion 2.4.1 leaks a timer in its runner when a test with a longer
 * timeout runs before one with a shorter one: one timeout for every test. */
#define TEST_TIMEOUT_S 60

enum {
    M_REGISTER = STRIA_RPC_COORDINATOR_REGISTER_WORKER,
    M_HEARTBEAT = STRIA_RPC_COORDINATOR_HEARTBEAT,
    M_REPORT = STRIA_RPC_COORDINATOR_REPORT_JOB,
    M_SUBMIT = STRIA_RPC_COORDINATOR_SUBMIT_JOB,
    M_GET_JOB = STRIA_RPC_COORDINATOR_GET_JOB,
    M_RELEASE = STRIA_RPC_COORDINATOR_RELEASE_JOB,
    M_CANCEL = STRIA_RPC_COORDINATOR_CANCEL_JOB,
    M_STATUS = STRIA_RPC_COORDINATOR_GET_STATUS,
    M_RING = STRIA_RPC_COORDINATOR_GET_RING,
    M_LIST_WORKERS = STRIA_RPC_COORDINATOR_LIST_WORKERS,
    M_LIST_JOBS = STRIA_RPC_COORDINATOR_LIST_JOBS,
    M_DRAIN = STRIA_RPC_COORDINATOR_DRAIN_WORKER,
};

#define JS(x)  STRIA__V1__JOB_STATE__JOB_STATE_##x
#define EV(x)  STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_##x
#define WST(x) STRIA__V1__WORKER_STATE__WORKER_STATE_##x

/* ---- fixture ------------------------------------------------------------- */

typedef struct {
    stria_coord_t *co; /* in-process coordinator, or NULL */
    test_proc_t *proc; /* daemon process, or NULL */
    uint16_t port;
    stria_rpc_client_t *cl;   /* the admin's connection (without credentials: every role) */
    stria_rpc_client_t *wk;   /* the workers' (the test plays every worker) */
    stria_rpc_client_t *user; /* a client's */
} fx_t;

/* The worker credential of the fixtures that have credentials. */
#define FX_WORKER_TOKEN "worker-secret"

/* Jobs this test submitted, with their secrets (opened from the replies):
 * job-scoped calls about them prove the secret. */
static struct {
    uint64_t id;
    stria_job_secret_t secret;
} g_jobs[64];
static size_t g_n_jobs;

static const stria_job_secret_t *secret_of(uint64_t id)
{
    for (size_t i = 0; i < g_n_jobs; i++)
        if (g_jobs[i].id == id)
            return &g_jobs[i].secret;
    return NULL;
}

static stria_rpc_client_t *fx_connect(const fx_t *fx, const char *token, stria_status_t *st)
{
    char addr[64];
    stria_rpc_client_params_t p = {0};
    stria_rpc_client_t *cl = NULL;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", fx->port);
    p.address = addr;
    p.service = &stria__v1__coordinator__descriptor;
    p.token = token;
    p.client_name = "coordinator test";
    p.connect_timeout_s = 5;
    *st = stria_rpc_client_connect(&p, &cl);
    return cl;
}

/* The recovery window of the next fx_start() (coordinator restarts); the
 * tests of a fresh coordinator have none: unknown jobs are unknown at once. */
static double g_recovery_window_s = -1;

static void fx_start(fx_t *fx, double hb, double ttl, const char *token, const char *admin)
{
    stria_coord_params_t p = {0};
    stria_status_t st;
    memset(fx, 0, sizeof(*fx));
    p.listen = "127.0.0.1:0";
    p.recovery_window_s = g_recovery_window_s;
    p.heartbeat_period_s = hb;
    p.job_ttl_s = ttl;
    p.token = token;
    p.admin_token = admin;
    p.worker_token = token ? FX_WORKER_TOKEN : NULL;
    cr_assert_eq(stria_coord_start(&p, &fx->co), STRIA_OK, "%s", stria_error_msg());
    fx->port = stria_coord_port(fx->co);
    fx->cl = fx_connect(fx, admin ? admin : token, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    fx->wk = fx->user = fx->cl;
    if (token != NULL) {
        fx->wk = fx_connect(fx, FX_WORKER_TOKEN, &st);
        cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
        fx->user = fx_connect(fx, token, &st);
        cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    }
}

static void fx_stop(fx_t *fx)
{
    if (fx->wk != fx->cl)
        stria_rpc_client_close(fx->wk);
    if (fx->user != fx->cl)
        stria_rpc_client_close(fx->user);
    stria_rpc_client_close(fx->cl);
    fx->cl = fx->wk = fx->user = NULL;
    if (fx->co != NULL)
        stria_coord_stop(fx->co);
    fx->co = NULL;
    if (fx->proc != NULL) {
        int status = test_proc_stop(fx->proc, SIGTERM, 5.0);
        cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "stria-coordinator did not exit cleanly on SIGTERM (status 0x%x)", status);
        fx->proc = NULL;
    }
}

static stria_status_t fx_call(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                              stria_rpc_reply_t *rep)
{
    stria_rpc_request_t r = {.method = method, .request = req, .timeout_s = 10};
    memset(rep, 0, sizeof(*rep));
    return stria_rpc_client_call(cl, &r, rep);
}

/* A job-scoped call proving `secret` (NULL: no proof). */
static stria_status_t fx_call_job(stria_rpc_client_t *cl, uint32_t method,
                                  const ProtobufCMessage *req, uint64_t job,
                                  const stria_job_secret_t *secret, stria_rpc_reply_t *rep)
{
    stria_rpc_request_t r = {
        .method = method, .request = req, .timeout_s = 10, .job_secret = secret, .job_id = job};
    memset(rep, 0, sizeof(*rep));
    return stria_rpc_client_call(cl, &r, rep);
}

typedef struct {
    uint64_t id;
    uint64_t incarnation;
} wk_t;

/* Registers a worker at 127.0.0.1:port that had id `previous` before (0:
 * none). */
static wk_t reg_worker_was(const fx_t *fx, const char *host, int port, uint64_t memory,
                           uint64_t previous)
{
    Stria__V1__RegisterWorkerRequest req = STRIA__V1__REGISTER_WORKER_REQUEST__INIT;
    stria_rpc_reply_t rep;
    char rpc[64], ucx[64];
    wk_t w = {0, 1000u + (uint64_t)port};
    snprintf(rpc, sizeof(rpc), "127.0.0.1:%d", port);
    snprintf(ucx, sizeof(ucx), "127.0.0.1:%d", port + 100);
    req.rpc_address = rpc;
    req.ucx_address = ucx;
    req.host = (char *)host;
    req.device = (char *)"cpu";
    req.memory_bytes = memory;
    req.software_version = (char *)"test";
    req.incarnation = w.incarnation;
    req.previous_worker_id = previous;
    cr_assert_eq(fx_call(fx->wk, M_REGISTER, &req.base, &rep), STRIA_OK, "%s", stria_error_msg());
    w.id = ((Stria__V1__RegisterWorkerReply *)rep.msg)->worker_id;
    cr_assert_gt(w.id, 0);
    stria_rpc_reply_free(&rep);
    return w;
}

static wk_t reg_worker(const fx_t *fx, const char *host, int port, uint64_t memory)
{
    return reg_worker_was(fx, host, port, memory, 0);
}

/* A heartbeat reporting the given jobs; drop ids come back in drop[]. */
static stria_status_t heartbeat(const fx_t *fx, wk_t w, const uint64_t *jobs, size_t n_jobs,
                                uint32_t idle_ms, uint64_t *drop, size_t *n_drop, bool *rejoined)
{
    Stria__V1__HeartbeatRequest req = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    Stria__V1__WorkerJobStatus js[8], *jp[8];
    stria_rpc_reply_t rep;
    stria_status_t st;
    req.worker_id = w.id;
    req.incarnation = w.incarnation;
    for (size_t i = 0; i < n_jobs; i++) {
        stria__v1__worker_job_status__init(&js[i]);
        js[i].job_id = jobs[i];
        js[i].phase = JS(LOADING);
        js[i].idle_ms = idle_ms;
        jp[i] = &js[i];
    }
    req.n_jobs = n_jobs;
    req.jobs = jp;
    st = fx_call(fx->wk, M_HEARTBEAT, &req.base, &rep);
    if (st != STRIA_OK)
        return st;
    Stria__V1__HeartbeatReply *r = (Stria__V1__HeartbeatReply *)rep.msg;
    if (n_drop != NULL) {
        *n_drop = r->n_drop_job_ids;
        for (size_t i = 0; i < r->n_drop_job_ids && i < 8; i++)
            drop[i] = r->drop_job_ids[i];
    }
    if (rejoined != NULL)
        *rejoined = r->rejoined;
    stria_rpc_reply_free(&rep);
    return STRIA_OK;
}

static Stria__V1__JobSpec spec_default(void)
{
    Stria__V1__JobSpec s = STRIA__V1__JOB_SPEC__INIT;
    s.batch = 1;
    s.seq_len = 1024;
    s.heads = 4;
    s.kv_heads = 2;
    s.head_dim = 64;
    s.causal = true;
    return s;
}

/* Per-rank memory of spec_default() on n ranks. */
static uint64_t mem_default(int n)
{
    uint64_t m = 0;
    cr_assert_eq(stria_rank_memory(1, (1024 + n - 1) / n, 4, 2, 64, STRIA_DTYPE_F32, &m), STRIA_OK);
    return m;
}

static stria_status_t submit(const fx_t *fx, const Stria__V1__JobSpec *s, stria_rpc_reply_t *rep)
{
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    req.spec = (Stria__V1__JobSpec *)s;
    stria_status_t st = fx_call(fx->user, M_SUBMIT, &req.base, rep);
    if (st == STRIA_OK && g_n_jobs < sizeof(g_jobs) / sizeof(g_jobs[0])) {
        Stria__V1__SubmitJobReply *r = (Stria__V1__SubmitJobReply *)rep->msg;
        g_jobs[g_n_jobs].id = r->assignment->job_id;
        cr_assert_eq(stria_auth_open(&rep->session, "job secret", r->assignment->job_id,
                                     r->job_secret.data, r->job_secret.len,
                                     g_jobs[g_n_jobs].secret.bytes),
                     STRIA_OK, "%s", stria_error_msg());
        g_n_jobs++;
    }
    return st;
}

/* Submits and returns the job id; asserts success. */
static uint64_t submit_ok(const fx_t *fx, const Stria__V1__JobSpec *s, Stria__V1__JobState want)
{
    stria_rpc_reply_t rep;
    cr_assert_eq(submit(fx, s, &rep), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__SubmitJobReply *r = (Stria__V1__SubmitJobReply *)rep.msg;
    uint64_t id = r->assignment->job_id;
    cr_expect_eq(r->state, want, "job %llu: state %d, expected %d", (unsigned long long)id,
                 r->state, want);
    stria_rpc_reply_free(&rep);
    return id;
}

/* Job detail; caller frees rep. */
static Stria__V1__JobInfo *get_job(const fx_t *fx, uint64_t id, stria_rpc_reply_t *rep)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    req.job_id = id;
    cr_assert_eq(fx_call_job(fx->user, M_GET_JOB, &req.base, id, secret_of(id), rep), STRIA_OK,
                 "%s", stria_error_msg());
    return ((Stria__V1__GetJobReply *)rep->msg)->job;
}

static Stria__V1__JobState job_state(const fx_t *fx, uint64_t id)
{
    stria_rpc_reply_t rep;
    Stria__V1__JobState s = get_job(fx, id, &rep)->state;
    stria_rpc_reply_free(&rep);
    return s;
}

static stria_status_t release(const fx_t *fx, uint64_t id)
{
    Stria__V1__ReleaseJobRequest req = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    stria_status_t st;
    req.job_id = id;
    st = fx_call_job(fx->user, M_RELEASE, &req.base, id, secret_of(id), &rep);
    stria_rpc_reply_free(&rep);
    return st;
}

static stria_status_t report(const fx_t *fx, wk_t w, uint64_t job, uint32_t rank, int event,
                             const char *msg, Stria__V1__JobState *state_out)
{
    Stria__V1__ReportJobRequest req = STRIA__V1__REPORT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    stria_status_t st;
    req.worker_id = w.id;
    req.job_id = job;
    req.rank = rank;
    req.event = event;
    req.message = (char *)(msg ? msg : "");
    st = fx_call(fx->wk, M_REPORT, &req.base, &rep);
    if (st == STRIA_OK && state_out != NULL)
        *state_out = ((Stria__V1__ReportJobReply *)rep.msg)->state;
    stria_rpc_reply_free(&rep);
    return st;
}

/* The ring (ranks >= 0) as worker ids; returns its length. */
static size_t ring_ids(const fx_t *fx, uint64_t *ids, size_t cap, int *states)
{
    Stria__V1__GetRingRequest req = STRIA__V1__GET_RING_REQUEST__INIT;
    stria_rpc_reply_t rep;
    size_t n = 0;
    cr_assert_eq(fx_call(fx->cl, M_RING, &req.base, &rep), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__GetRingReply *r = (Stria__V1__GetRingReply *)rep.msg;
    for (size_t i = 0; i < r->n_members && n < cap; i++) {
        if (states != NULL)
            states[i] = r->members[i]->worker->state;
        if (r->members[i]->rank >= 0) {
            cr_expect_eq(r->members[i]->rank, (int)n, "ring ranks must be 0, 1, ...");
            ids[n++] = r->members[i]->worker->worker_id;
        }
    }
    stria_rpc_reply_free(&rep);
    return n;
}

/* Keeps `keep` alive with heartbeats until `pred` holds or timeout_s. */
static bool wait_until(const fx_t *fx, const wk_t *keep, size_t n_keep,
                       bool (*pred)(const fx_t *, void *), void *arg, double timeout_s)
{
    double end = stria_time_now() + timeout_s;
    while (stria_time_now() < end) {
        for (size_t i = 0; i < n_keep; i++)
            heartbeat(fx, keep[i], NULL, 0, 0, NULL, NULL, NULL);
        if (pred(fx, arg))
            return true;
        usleep(20000);
    }
    return false;
}

/* A job's state without touching it (GetJob would keep it alive). */
static Stria__V1__JobState job_state_quiet(const fx_t *fx, uint64_t id)
{
    Stria__V1__ListJobsRequest req = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    Stria__V1__JobState s = 0;
    req.include_finished = true;
    cr_assert_eq(fx_call(fx->cl, M_LIST_JOBS, &req.base, &rep), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__ListJobsReply *r = (Stria__V1__ListJobsReply *)rep.msg;
    for (size_t i = 0; i < r->n_jobs; i++)
        if (r->jobs[i]->job_id == id)
            s = r->jobs[i]->state;
    stria_rpc_reply_free(&rep);
    return s;
}

static bool pred_ring_len(const fx_t *fx, void *arg)
{
    uint64_t ids[16];
    return ring_ids(fx, ids, 16, NULL) == *(size_t *)arg;
}

/* ---- workers and the ring ------------------------------------------------ */

Test(coord, ring_order_groups_hosts, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t a = reg_worker(&fx, "node-b", 7002, 1 << 30);
    wk_t b = reg_worker(&fx, "node-a", 7003, 1 << 30);
    wk_t c = reg_worker(&fx, "node-b", 7001, 1 << 30);
    wk_t d = reg_worker(&fx, "node-a", 7000, 1 << 30);
    uint64_t ids[8];
    cr_assert_eq(ring_ids(&fx, ids, 8, NULL), 4);
    cr_expect_eq(ids[0], d.id);
    cr_expect_eq(ids[1], b.id);
    cr_expect_eq(ids[2], c.id);
    cr_expect_eq(ids[3], a.id);
    /* Registering again keeps the id and the order. */
    wk_t a2 = reg_worker(&fx, "node-b", 7002, 1 << 30);
    cr_expect_eq(a2.id, a.id);
    cr_assert_eq(ring_ids(&fx, ids, 8, NULL), 4);
    cr_expect_eq(ids[3], a.id);

    Stria__V1__ListWorkersRequest lw = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    cr_assert_eq(fx_call(fx.cl, M_LIST_WORKERS, &lw.base, &rep), STRIA_OK);
    Stria__V1__ListWorkersReply *r = (Stria__V1__ListWorkersReply *)rep.msg;
    cr_assert_eq(r->n_workers, 4);
    cr_expect_str_eq(r->workers[0]->rpc_address, "127.0.0.1:7000");
    cr_expect_str_eq(r->workers[0]->ucx_address, "127.0.0.1:7100");
    cr_expect_str_eq(r->workers[0]->host, "node-a");
    cr_expect_eq(r->workers[0]->state, WST(HEALTHY));
    cr_expect_eq(r->workers[0]->memory_bytes, 1 << 30);
    cr_expect_eq(r->workers[3]->ring_index, 3);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

Test(coord, registration_is_validated, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    Stria__V1__RegisterWorkerRequest req = STRIA__V1__REGISTER_WORKER_REQUEST__INIT;
    stria_rpc_reply_t rep;
    char longhost[400];
    fx_start(&fx, 1.0, 60, NULL, NULL);
    req.rpc_address = (char *)"127.0.0.1:7000";
    req.ucx_address = (char *)"127.0.0.1:7100";
    req.host = (char *)"h";
    req.device = (char *)"cpu";
    req.memory_bytes = 1;

    req.ucx_address = (char *)"";
    cr_expect_eq(fx_call(fx.cl, M_REGISTER, &req.base, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "ucx_address is missing") != NULL, "%s", stria_error_msg());
    req.ucx_address = (char *)"127.0.0.1:7100";
    req.rpc_address = (char *)"127.0.0.1:0";
    cr_expect_eq(fx_call(fx.cl, M_REGISTER, &req.base, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "port 0") != NULL, "%s", stria_error_msg());
    req.rpc_address = (char *)"nonsense";
    cr_expect_eq(fx_call(fx.cl, M_REGISTER, &req.base, &rep), STRIA_ERR_INVALID_ARG);
    req.rpc_address = (char *)"127.0.0.1:7000";
    req.memory_bytes = 0;
    cr_expect_eq(fx_call(fx.cl, M_REGISTER, &req.base, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "memory_bytes") != NULL, "%s", stria_error_msg());
    req.memory_bytes = 1;
    memset(longhost, 'x', sizeof(longhost) - 1);
    longhost[sizeof(longhost) - 1] = '\0';
    req.host = longhost;
    cr_expect_eq(fx_call(fx.cl, M_REGISTER, &req.base, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "longer than") != NULL, "%s", stria_error_msg());
    req.host = (char *)"h";
    cr_expect_eq(fx_call(fx.cl, M_REGISTER, &req.base, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    /* An unknown worker's heartbeat asks it to register. */
    wk_t ghost = {12345, 1};
    cr_expect_eq(heartbeat(&fx, ghost, NULL, 0, 0, NULL, NULL, NULL), STRIA_ERR_NOT_FOUND);
    cr_expect(strstr(stria_error_msg(), "register again") != NULL, "%s", stria_error_msg());
    fx_stop(&fx);
}

/* Workers that register again with a restarted coordinator keep their ids
 * where no known worker holds them; new ids follow the largest one given. */
Test(coord, a_worker_gets_its_previous_id_back_when_free, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    cr_expect_eq(reg_worker_was(&fx, "h", 7001, 1 << 30, 7).id, 7);
    cr_expect_eq(reg_worker_was(&fx, "h", 7002, 1 << 30, 7).id, 8, "7 is taken");
    cr_expect_eq(reg_worker_was(&fx, "h", 7003, 1 << 30, 3).id, 3, "3 is free");
    cr_expect_eq(reg_worker(&fx, "h", 7004, 1 << 30).id, 9);
    cr_expect_eq(reg_worker_was(&fx, "h", 7005, 1 << 30, 1ull << 50).id, 10, "out of range");
    /* the same address registering again keeps the id it has here */
    cr_expect_eq(reg_worker_was(&fx, "h", 7001, 1 << 30, 5).id, 7);
    fx_stop(&fx);
}

Test(coord, silent_worker_dies_and_rejoins, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    uint64_t ids[8];
    int states[8];
    size_t want;
    bool rejoined = false;
    /* Dead after 3 missed periods of 0.2 s: 0.6 s of silence. */
    const double period = 0.2, nominal = 3 * period;
    fx_start(&fx, period, 60, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1 << 30);
    wk_t b = reg_worker(&fx, "h", 7001, 1 << 30);
    double t0 = stria_time_now(); /* b's last word */
    cr_assert_eq(ring_ids(&fx, ids, 8, NULL), 2);

    /* A 2-rank job on both; then b goes silent. */
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));
    want = 1;
    cr_assert(wait_until(&fx, &a, 1, pred_ring_len, &want, 10), "b was never marked dead");
    double took = stria_time_now() - t0;
    cr_expect_geq(took, nominal - 0.05, "marked dead after %.3f s, before 3 periods", took);
    /* Bounded above too: detection that is several times slower than its
     * nominal time leaves every job on the dead worker hanging that long. */
    cr_expect_leq(took, 3 * nominal, "marked dead after %.3f s, more than 3x the nominal %.1f s",
                  took, nominal);
    cr_assert_eq(ring_ids(&fx, ids, 8, states), 1);
    cr_expect_eq(ids[0], a.id);
    cr_expect_eq(states[1], WST(DEAD));

    stria_rpc_reply_t rep;
    Stria__V1__JobInfo *info = get_job(&fx, job, &rep);
    cr_expect_eq(info->state, JS(FAILED));
    cr_expect(strstr(info->failure, "missed 3 heartbeats") != NULL, "%s", info->failure);
    cr_expect(strstr(info->failure, "127.0.0.1:7001") != NULL, "%s", info->failure);
    cr_expect(info->failure_retryable, "a dead worker's job may succeed elsewhere");
    cr_expect(info->n_blamed_worker_ids == 1 && info->blamed_worker_ids[0] == b.id);
    stria_rpc_reply_free(&rep);

    /* The default ring is what is healthy now. */
    uint64_t job1 = submit_ok(&fx, &s, JS(LOADING));
    info = get_job(&fx, job1, &rep);
    cr_expect_eq(info->assignment->n_ranks, 1);
    stria_rpc_reply_free(&rep);

    /* b comes back: it rejoins and is told to drop the failed job. */
    uint64_t drop[8];
    size_t n_drop = 0;
    cr_assert_eq(heartbeat(&fx, b, &job, 1, 0, drop, &n_drop, &rejoined), STRIA_OK);
    cr_expect(rejoined);
    cr_expect_eq(n_drop, 1);
    cr_expect_eq(drop[0], job);
    cr_expect_eq(ring_ids(&fx, ids, 8, NULL), 2);
    fx_stop(&fx);
}

Test(coord, restarted_worker_loses_its_jobs, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1 << 30);
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));
    /* Same address, new incarnation: the old process is gone. */
    Stria__V1__RegisterWorkerRequest req = STRIA__V1__REGISTER_WORKER_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.rpc_address = (char *)"127.0.0.1:7000";
    req.ucx_address = (char *)"127.0.0.1:7999";
    req.host = (char *)"h";
    req.device = (char *)"cpu";
    req.memory_bytes = 1 << 30;
    req.incarnation = a.incarnation + 1;
    cr_assert_eq(fx_call(fx.cl, M_REGISTER, &req.base, &rep), STRIA_OK);
    cr_expect_eq(((Stria__V1__RegisterWorkerReply *)rep.msg)->worker_id, a.id);
    cr_expect(((Stria__V1__RegisterWorkerReply *)rep.msg)->rejoined);
    stria_rpc_reply_free(&rep);
    Stria__V1__JobInfo *info = get_job(&fx, job, &rep);
    cr_expect_eq(info->state, JS(FAILED));
    cr_expect(strstr(info->failure, "restarted") != NULL, "%s", info->failure);
    cr_expect(info->failure_retryable);
    cr_expect(info->n_blamed_worker_ids == 1 && info->blamed_worker_ids[0] == a.id);
    stria_rpc_reply_free(&rep);
    /* The old incarnation's heartbeats are refused. */
    cr_expect_eq(heartbeat(&fx, a, NULL, 0, 0, NULL, NULL, NULL), STRIA_ERR_NOT_FOUND);
    fx_stop(&fx);
}

/* ---- admission ----------------------------------------------------------- */

typedef struct {
    const char *what;
    void (*mutate)(Stria__V1__JobSpec *s);
    const char *msg;
} bad_spec_t;

static void m_batch0(Stria__V1__JobSpec *s)
{
    s->batch = 0;
}
static void m_seq0(Stria__V1__JobSpec *s)
{
    s->seq_len = 0;
}
static void m_seq_huge(Stria__V1__JobSpec *s)
{
    s->seq_len = (uint64_t)1 << 62;
}
static void m_heads0(Stria__V1__JobSpec *s)
{
    s->heads = 0;
}
static void m_kv_not_div(Stria__V1__JobSpec *s)
{
    s->heads = 6, s->kv_heads = 4;
}
static void m_kv_more(Stria__V1__JobSpec *s)
{
    s->kv_heads = 8;
}
static void m_dim12(Stria__V1__JobSpec *s)
{
    s->head_dim = 12;
}
static void m_dim_odd(Stria__V1__JobSpec *s)
{
    s->head_dim = 68;
}
static void m_dim_big(Stria__V1__JobSpec *s)
{
    s->head_dim = 512;
}
static void m_dtype(Stria__V1__JobSpec *s)
{
    s->dtype = 7;
}
static void m_layout(Stria__V1__JobSpec *s)
{
    s->layout = 9;
}
static void m_scale_nan(Stria__V1__JobSpec *s)
{
    s->scale = NAN;
}
static void m_scale_neg(Stria__V1__JobSpec *s)
{
    s->scale = -1;
}
static void m_ttl(Stria__V1__JobSpec *s)
{
    s->ttl_s = 100000000;
}
static void m_short_seq(Stria__V1__JobSpec *s)
{
    s->seq_len = 1;
}

static int64_t cu_bad_start[] = {1, 1024}, cu_bad_end[] = {0, 17, 1000},
               cu_decreasing[] = {0, 300, 17, 1024}, cu_past_end[] = {0, 2048};
static int64_t cu_too_many[STRIA_COORD_MAX_CU_SEQLENS + 1];
static Stria__V1__JobSpec__Window
    win_left_bad = {PROTOBUF_C_MESSAGE_INIT(&stria__v1__job_spec__window__descriptor), -2, 0},
    win_right_bad = {PROTOBUF_C_MESSAGE_INIT(&stria__v1__job_spec__window__descriptor), 5, -7},
    win_causal_right = {PROTOBUF_C_MESSAGE_INIT(&stria__v1__job_spec__window__descriptor), 5, 1};

static void m_cu_start(Stria__V1__JobSpec *s)
{
    s->cu_seqlens = cu_bad_start, s->n_cu_seqlens = 2;
}

static void m_cu_end(Stria__V1__JobSpec *s)
{
    s->cu_seqlens = cu_bad_end, s->n_cu_seqlens = 3;
}

static void m_cu_dec(Stria__V1__JobSpec *s)
{
    s->cu_seqlens = cu_decreasing, s->n_cu_seqlens = 4;
}

static void m_cu_past(Stria__V1__JobSpec *s)
{
    s->cu_seqlens = cu_past_end, s->n_cu_seqlens = 2;
}

static void m_cu_many(Stria__V1__JobSpec *s)
{
    for (size_t i = 0; i <= STRIA_COORD_MAX_CU_SEQLENS; i++)
        cu_too_many[i] = (int64_t)(i * 1024 / STRIA_COORD_MAX_CU_SEQLENS);
    s->cu_seqlens = cu_too_many, s->n_cu_seqlens = STRIA_COORD_MAX_CU_SEQLENS + 1;
}

static void m_win_left(Stria__V1__JobSpec *s)
{
    s->window = &win_left_bad;
}

static void m_win_right(Stria__V1__JobSpec *s)
{
    s->window = &win_right_bad;
}

static void m_win_causal(Stria__V1__JobSpec *s)
{
    s->window = &win_causal_right;
}

Test(coord, nonsense_specs_are_refused, .timeout = TEST_TIMEOUT_S)
{
    static const bad_spec_t cases[] = {
        {"batch 0", m_batch0, "batch must be"},
        {"seq_len 0", m_seq0, "seq_len must be"},
        {"huge seq_len", m_seq_huge, "seq_len must be 1..1099511627776"},
        {"heads 0", m_heads0, "heads must be"},
        {"heads % kv_heads", m_kv_not_div, "heads (6) must be a multiple of kv_heads (4)"},
        {"kv_heads > heads", m_kv_more, "kv_heads must be 1..heads"},
        {"head_dim 12", m_dim12, "head_dim must be"},
        {"head_dim 68", m_dim_odd, "head_dim must be"},
        {"head_dim 512", m_dim_big, "head_dim must be"},
        {"dtype 7", m_dtype, "dtype 7"},
        {"layout 9", m_layout, "layout 9"},
        {"scale NaN", m_scale_nan, "scale must be finite"},
        {"scale < 0", m_scale_neg, "scale must be finite"},
        {"ttl", m_ttl, "ttl_s"},
        {"seq shorter than ring", m_short_seq, "without tokens"},
        {"cu_seqlens from 1", m_cu_start, "cu_seqlens must start at 0 (got 1)"},
        {"cu_seqlens short", m_cu_end, "cu_seqlens must end at seq_len (1024) (got 1000)"},
        {"cu_seqlens decreasing", m_cu_dec,
         "cu_seqlens must not decrease (entry 2 is 17 after 300)"},
        {"cu_seqlens long", m_cu_past, "cu_seqlens must end at seq_len (1024) (got 2048)"},
        {"cu_seqlens too many", m_cu_many,
         "cu_seqlens has 65537 entries, more than the limit of 65536"},
        {"window left -2", m_win_left, "window.left must be >= -1"},
        {"window right -7", m_win_right, "window.right must be >= -1 (-1: unbounded) (got -7)"},
        {"causal window right 1", m_win_causal, "window.right must be 0 or -1 with causal"},
    };
    fx_t fx;
    stria_rpc_reply_t rep;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    reg_worker(&fx, "h", 7000, 1ull << 34);
    reg_worker(&fx, "h", 7001, 1ull << 34);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        Stria__V1__JobSpec s = spec_default();
        cases[i].mutate(&s);
        cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_INVALID_ARG, "%s accepted", cases[i].what);
        cr_expect(strstr(stria_error_msg(), cases[i].msg) != NULL, "%s: '%s'", cases[i].what,
                  stria_error_msg());
    }
    Stria__V1__SubmitJobRequest empty = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    cr_expect_eq(fx_call(fx.cl, M_SUBMIT, &empty.base, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "spec is missing") != NULL, "%s", stria_error_msg());
    /* Still serving. */
    Stria__V1__JobSpec s = spec_default();
    submit_ok(&fx, &s, JS(LOADING));
    fx_stop(&fx);
}

Test(coord, too_few_workers_or_too_little_memory, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    Stria__V1__JobSpec s = spec_default();
    fx_start(&fx, 1.0, 60, NULL, NULL);
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "0 are available") != NULL, "%s", stria_error_msg());
    reg_worker(&fx, "h", 7000, mem_default(2));
    reg_worker(&fx, "h", 7001, mem_default(2));
    s.ring_size = 3;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "needs 3 workers but 2 are available (2 healthy") != NULL,
              "%s", stria_error_msg());
    /* Fits on two ranks, not on one. */
    s.ring_size = 1;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_NO_MEMORY);
    cr_expect(strstr(stria_error_msg(), "MiB per rank") != NULL, "%s", stria_error_msg());
    s.ring_size = 0;
    s.batch = 64;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_NO_MEMORY);
    cr_expect(strstr(stria_error_msg(), "use a larger ring") != NULL, "%s", stria_error_msg());
    /* Astronomical: the estimate itself overflows. */
    s.batch = 65536;
    s.heads = s.kv_heads = 65536;
    s.head_dim = 256;
    s.seq_len = (uint64_t)1 << 40;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_NO_MEMORY, "%s", stria_error_msg());
    /* Exactly the workers' memory: admitted at once, even when it may not
     * queue; then nothing is free, and a job that may not queue is refused. */
    s = spec_default();
    s.no_queue = true;
    submit_ok(&fx, &s, JS(LOADING));
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "no_queue is set") != NULL, "%s", stria_error_msg());
    fx_stop(&fx);
}

Test(coord, assignment_stripes_and_defaults, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    Stria__V1__JobSpec s = spec_default();
    fx_start(&fx, 1.0, 77, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    s.seq_len = 11;
    s.label = (char *)"layer 3";
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__Assignment *as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    cr_assert_eq(as->n_ranks, 2);
    cr_expect_eq(as->spec->ring_size, 2);
    cr_expect_eq(as->spec->ttl_s, 77);
    cr_expect_float_eq(as->spec->scale, 0.125f, 1e-7);
    cr_expect_str_eq(as->spec->label, "layer 3");
    cr_expect_eq(as->spec->layout, STRIA__V1__LAYOUT__LAYOUT_STRIPED);
    cr_expect_eq(as->max_tokens_per_rank, 6, "11 tokens on 2 ranks pad to 6 each");
    cr_expect_gt(as->memory_per_rank_bytes, 0);
    /* Rank r holds r, r + 2, ...: 6 real tokens on rank 0, 5 on rank 1. */
    const uint64_t want_tokens[2] = {6, 5};
    const uint64_t want_worker[2] = {a.id, b.id};
    for (uint32_t r = 0; r < 2; r++) {
        Stria__V1__RankAssignment *ra = as->ranks[r];
        uint64_t sum = 0;
        cr_expect_eq(ra->rank, r);
        cr_expect_eq(ra->worker_id, want_worker[r]);
        cr_expect_eq(ra->tokens, want_tokens[r]);
        cr_expect_str_eq(ra->rpc_address, r == 0 ? "127.0.0.1:7000" : "127.0.0.1:7001");
        cr_expect_str_eq(ra->ucx_address, r == 0 ? "127.0.0.1:7100" : "127.0.0.1:7101");
        cr_assert_geq(ra->n_runs, 1);
        cr_expect_eq(ra->runs[0]->first, r);
        cr_expect_eq(ra->runs[0]->stride, 2);
        for (size_t k = 0; k < ra->n_runs; k++)
            sum += ra->runs[k]->count;
        cr_expect_eq(sum, ra->tokens);
    }
    cr_expect_eq(as->spec->n_cu_seqlens, 0);
    cr_expect_null(as->spec->window);
    stria_rpc_reply_free(&rep);
    /* Documents and a window travel in the assignment (and GetJob), not in
     * ListJobs. */
    static int64_t cu[] = {0, 1, 5, 5, 11};
    Stria__V1__JobSpec__Window win = STRIA__V1__JOB_SPEC__WINDOW__INIT;
    win.left = 3;
    win.right = -1;
    s.cu_seqlens = cu;
    s.n_cu_seqlens = 5;
    s.window = &win;
    s.causal = false;
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    uint64_t masked_id = as->job_id;
    cr_assert_eq(as->spec->n_cu_seqlens, 5);
    for (size_t i = 0; i < 5; i++)
        cr_expect_eq(as->spec->cu_seqlens[i], cu[i]);
    cr_assert_not_null(as->spec->window);
    cr_expect_eq(as->spec->window->left, 3);
    cr_expect_eq(as->spec->window->right, -1);
    stria_rpc_reply_free(&rep);
    /* auto: contiguous with a window, striped without; the assignment (what
     * workers and the client see) names the layout chosen. */
    s.layout = STRIA__V1__LAYOUT__LAYOUT_AUTO;
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    cr_expect_eq(as->spec->layout, STRIA__V1__LAYOUT__LAYOUT_CONTIGUOUS);
    cr_expect_eq(as->ranks[1]->runs[0]->first, 6, "contiguous: rank 1 starts at token 6");
    stria_rpc_reply_free(&rep);
    s.window = NULL;
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    cr_expect_eq(as->spec->layout, STRIA__V1__LAYOUT__LAYOUT_STRIPED);
    stria_rpc_reply_free(&rep);
    s.window = &win;
    s.layout = STRIA__V1__LAYOUT__LAYOUT_STRIPED;
    Stria__V1__JobInfo *info = get_job(&fx, masked_id, &rep);
    cr_assert_not_null(info);
    cr_expect_eq(info->assignment->spec->n_cu_seqlens, 5);
    cr_expect_eq(info->assignment->spec->cu_seqlens[3], 5);
    cr_expect_eq(info->assignment->spec->window->left, 3);
    stria_rpc_reply_free(&rep);
    Stria__V1__ListJobsRequest lreq = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    cr_assert_eq(fx_call(fx.cl, M_LIST_JOBS, &lreq.base, &rep), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__ListJobsReply *lr = (Stria__V1__ListJobsReply *)rep.msg;
    bool listed = false;
    for (size_t i = 0; i < lr->n_jobs; i++)
        if (lr->jobs[i]->job_id == masked_id) {
            listed = true;
            cr_expect_eq(lr->jobs[i]->assignment->spec->n_cu_seqlens, 0, "ListJobs sent documents");
            cr_expect_not_null(lr->jobs[i]->assignment->spec->window);
        }
    cr_expect(listed, "job %llu not listed", (unsigned long long)masked_id);
    stria_rpc_reply_free(&rep);
    s.cu_seqlens = NULL;
    s.n_cu_seqlens = 0;
    s.window = NULL;
    s.causal = true;
    /* Zigzag: two runs per rank. */
    s.layout = STRIA__V1__LAYOUT__LAYOUT_ZIGZAG;
    s.seq_len = 16;
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    cr_expect_eq(as->ranks[0]->n_runs, 2);
    cr_expect_eq(as->ranks[0]->runs[0]->first, 0);
    cr_expect_eq(as->ranks[0]->runs[1]->first, 12);
    cr_expect_eq(as->ranks[1]->runs[0]->first, 4);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

/* ---- queueing ------------------------------------------------------------ */

Test(coord, jobs_queue_in_order_on_shared_workers, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    uint64_t m = mem_default(2);
    fx_start(&fx, 1.0, 60, NULL, NULL);
    /* Room for one default job and a bit: 1.7x its need. */
    reg_worker(&fx, "h", 7000, m + m * 7 / 10);
    reg_worker(&fx, "h", 7001, m + m * 7 / 10);
    Stria__V1__JobSpec s = spec_default();
    uint64_t ja = submit_ok(&fx, &s, JS(LOADING));
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK);
    Stria__V1__SubmitJobReply *r = (Stria__V1__SubmitJobReply *)rep.msg;
    uint64_t jb = r->assignment->job_id;
    cr_expect_eq(r->state, JS(PENDING));
    cr_expect_eq(r->queue_position, 1);
    stria_rpc_reply_free(&rep);
    /* A smaller job would fit now, but must not overtake the queued one. */
    Stria__V1__JobSpec small = spec_default();
    small.seq_len = 512;
    uint64_t jc = submit_ok(&fx, &small, JS(PENDING));
    Stria__V1__JobInfo *info = get_job(&fx, jc, &rep);
    cr_expect_eq(info->queue_position, 2);
    stria_rpc_reply_free(&rep);
    /* no_queue refuses instead of waiting. */
    s.no_queue = true;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "no_queue") != NULL, "%s", stria_error_msg());
    /* Releasing the first starts the queued ones that now fit, in order. */
    cr_expect_eq(release(&fx, ja), STRIA_OK);
    cr_expect_eq(job_state(&fx, ja), JS(RELEASED));
    cr_expect_eq(job_state(&fx, jb), JS(LOADING));
    cr_expect_eq(job_state(&fx, jc), JS(LOADING), "b (1.0) and c (0.5) fit in 1.7 together");
    cr_expect_eq(release(&fx, ja), STRIA_OK, "release is idempotent");
    cr_expect_eq(release(&fx, 999), STRIA_ERR_NOT_FOUND);
    fx_stop(&fx);
}

/* A coordinator with four workers on two hosts, each with room for one
 * two-rank job of the default spec (which *s becomes, with ring size 2). */
static void fx_start_two_hosts(fx_t *fx, wk_t w[4], Stria__V1__JobSpec *s)
{
    uint64_t m = mem_default(2);
    fx_start(fx, 1.0, 60, NULL, NULL);
    for (int i = 0; i < 4; i++)
        w[i] = reg_worker(fx, i < 2 ? "host-0" : "host-1", 7000 + i, m + m / 2);
    *s = spec_default();
    s->ring_size = 2;
}

/* A submission sent again with its key (its reply was lost with the
 * connection) gets the job its first copy made, its secret sealed again; a
 * new key makes a new job; a key of another size is refused. */
Test(coord, a_resent_submission_gets_its_first_job, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    uint8_t key[16];
    uint64_t ids[3];
    stria_job_secret_t secrets[3];
    fx_start(&fx, 1.0, 60, NULL, NULL);
    reg_worker(&fx, "h", 7000, 1ull << 30);
    reg_worker(&fx, "h", 7001, 1ull << 30);
    Stria__V1__JobSpec s = spec_default();
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    req.spec = &s;
    memset(key, 7, sizeof(key));
    req.submit_key.data = key;
    req.submit_key.len = sizeof(key);
    for (int i = 0; i < 3; i++) {
        if (i == 2)
            key[0] ^= 1; /* another submission */
        cr_assert_eq(fx_call(fx.user, M_SUBMIT, &req.base, &rep), STRIA_OK, "%s",
                     stria_error_msg());
        const Stria__V1__SubmitJobReply *r = (const Stria__V1__SubmitJobReply *)rep.msg;
        ids[i] = r->assignment->job_id;
        cr_expect_eq(stria_auth_open(&rep.session, "job secret", ids[i], r->job_secret.data,
                                     r->job_secret.len, secrets[i].bytes),
                     STRIA_OK, "submission %d: the secret does not open", i);
        stria_rpc_reply_free(&rep);
    }
    cr_expect_eq(ids[1], ids[0], "the resend made job %llu beside job %llu",
                 (unsigned long long)ids[1], (unsigned long long)ids[0]);
    cr_expect_eq(memcmp(secrets[1].bytes, secrets[0].bytes, sizeof(secrets[0].bytes)), 0);
    cr_expect_neq(ids[2], ids[0], "a new key made no new job");
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    cr_assert_eq(fx_call(fx.cl, M_STATUS, &gs.base, &rep), STRIA_OK);
    cr_expect_eq(((const Stria__V1__GetStatusReply *)rep.msg)->jobs_submitted, 2u);
    stria_rpc_reply_free(&rep);
    req.submit_key.len = 5;
    cr_expect_eq(fx_call(fx.user, M_SUBMIT, &req.base, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "submit_key has 5 bytes") != NULL, "%s", stria_error_msg());
    fx_stop(&fx);
}

Test(coord, jobs_on_disjoint_workers_run_together, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[4];
    Stria__V1__JobSpec s;
    fx_start_two_hosts(&fx, w, &s);
    uint64_t ja = submit_ok(&fx, &s, JS(LOADING));
    uint64_t jb = submit_ok(&fx, &s, JS(LOADING));
    uint64_t jc = submit_ok(&fx, &s, JS(PENDING));
    Stria__V1__JobInfo *ia = get_job(&fx, ja, &rep);
    cr_expect_eq(ia->assignment->ranks[0]->worker_id, w[0].id);
    cr_expect_eq(ia->assignment->ranks[1]->worker_id, w[1].id);
    stria_rpc_reply_free(&rep);
    Stria__V1__JobInfo *ib = get_job(&fx, jb, &rep);
    cr_expect_eq(ib->assignment->ranks[0]->worker_id, w[2].id, "one host's workers together");
    cr_expect_eq(ib->assignment->ranks[1]->worker_id, w[3].id);
    stria_rpc_reply_free(&rep);

    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    cr_assert_eq(fx_call(fx.cl, M_STATUS, &gs.base, &rep), STRIA_OK);
    Stria__V1__GetStatusReply *st = (Stria__V1__GetStatusReply *)rep.msg;
    cr_expect_eq(st->jobs_active, 2);
    cr_expect_eq(st->jobs_pending, 1);
    cr_expect_eq(st->workers_healthy, 4);
    cr_expect_eq(st->jobs_submitted, 3);
    cr_expect_str_eq(st->software_version, STRIA_VERSION);
    cr_expect_eq(st->protocol_version, STRIA_RPC_VERSION);
    stria_rpc_reply_free(&rep);

    /* c waits for the workers of a (the least loaded window when it came). */
    cr_expect_eq(release(&fx, jb), STRIA_OK);
    cr_expect_eq(job_state(&fx, jc), JS(PENDING));
    cr_expect_eq(release(&fx, ja), STRIA_OK);
    cr_expect_eq(job_state(&fx, jc), JS(LOADING));
    fx_stop(&fx);
}

/* Draining a worker fails the jobs queued on it (their workers were bound at
 * submission; a drained worker must run down), with a reason that says to
 * submit again; its running job and the queued jobs on other workers stay. */
Test(coord, drain_fails_the_jobs_queued_on_the_worker, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[4];
    Stria__V1__JobSpec s;
    fx_start_two_hosts(&fx, w, &s);
    uint64_t ja = submit_ok(&fx, &s, JS(LOADING));
    uint64_t jb = submit_ok(&fx, &s, JS(LOADING));
    uint64_t jc = submit_ok(&fx, &s, JS(PENDING)); /* waits for a's workers */
    uint64_t jd = submit_ok(&fx, &s, JS(PENDING)); /* b's */
    Stria__V1__JobInfo *ic = get_job(&fx, jc, &rep);
    uint64_t c0 = ic->assignment->ranks[0]->worker_id, c1 = ic->assignment->ranks[1]->worker_id;
    stria_rpc_reply_free(&rep);
    cr_assert(c0 == w[0].id || c1 == w[0].id || c0 == w[2].id || c1 == w[2].id);
    uint64_t drained = c0; /* a worker of c, busy with a or b */

    Stria__V1__DrainWorkerRequest dw = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    dw.worker_id = drained;
    dw.drain = true;
    cr_assert_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    ic = get_job(&fx, jc, &rep);
    cr_expect_eq(ic->state, JS(FAILED));
    cr_expect(strstr(ic->failure, "was drained while the job was queued: submit it again") != NULL,
              "%s", ic->failure);
    cr_expect(ic->failure_retryable);
    cr_expect(ic->n_blamed_worker_ids == 1 && ic->blamed_worker_ids[0] == drained);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(job_state(&fx, ja), JS(LOADING), "a running job keeps its drained worker");
    cr_expect_eq(job_state(&fx, jb), JS(LOADING));
    cr_expect_eq(job_state(&fx, jd), JS(PENDING), "a job queued on other workers stays queued");
    fx_stop(&fx);
}

/* ---- failure classes and retries ------------------------------------------ */

/* A worker's FAILED report with its judgement; the reply's verdict. */
static bool report_failed(const fx_t *fx, wk_t w, uint64_t job, uint32_t rank, bool retryable)
{
    Stria__V1__ReportJobRequest req = STRIA__V1__REPORT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.worker_id = w.id;
    req.job_id = job;
    req.rank = rank;
    req.event = EV(FAILED);
    req.message = (char *)"ring link broke";
    req.retryable = retryable;
    cr_assert_eq(fx_call(fx->wk, M_REPORT, &req.base, &rep), STRIA_OK, "%s", stria_error_msg());
    const Stria__V1__ReportJobReply *r = (const Stria__V1__ReportJobReply *)rep.msg;
    cr_expect_eq(r->state, JS(FAILED));
    bool verdict = r->failure_retryable;
    stria_rpc_reply_free(&rep);
    return verdict;
}

Test(coord, the_first_failure_decides_the_class, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));
    cr_expect(report_failed(&fx, a, job, 0, true), "the worker's judgement is recorded");
    /* a later report cannot change it: the first verdict stands */
    cr_expect(report_failed(&fx, b, job, 1, false));
    Stria__V1__JobInfo *info = get_job(&fx, job, &rep);
    cr_expect(info->failure_retryable);
    cr_expect_eq(info->n_blamed_worker_ids, 0, "a ring failure blames no worker in particular");
    stria_rpc_reply_free(&rep);
    uint64_t job2 = submit_ok(&fx, &s, JS(LOADING));
    cr_expect(!report_failed(&fx, b, job2, 1, false));
    cr_expect(!report_failed(&fx, a, job2, 0, true));
    fx_stop(&fx);
}

/* SubmitJob with exclude_worker_ids; the reply's ranks' worker ids into
 * ids[] (at most 8). */
static stria_status_t submit_excluding(const fx_t *fx, Stria__V1__JobSpec *s, uint64_t *ex,
                                       size_t n_ex, uint64_t *ids, size_t *n_ids)
{
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.spec = s;
    req.exclude_worker_ids = ex;
    req.n_exclude_worker_ids = n_ex;
    stria_status_t st = fx_call(fx->user, M_SUBMIT, &req.base, &rep);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__Assignment *a = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    *n_ids = a->n_ranks;
    for (size_t i = 0; i < a->n_ranks && i < 8; i++)
        ids[i] = a->ranks[i]->worker_id;
    stria_rpc_reply_free(&rep);
    return STRIA_OK;
}

Test(coord, a_submission_excludes_the_workers_it_names, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t w[3];
    for (int i = 0; i < 3; i++)
        w[i] = reg_worker(&fx, "h", 7000 + i, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t ex[2] = {w[1].id, 424242 /* unknown: ignored */}, ids[8];
    size_t n = 0;
    /* ring_size 0: the healthy workers less the excluded */
    cr_assert_eq(submit_excluding(&fx, &s, ex, 2, ids, &n), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(n, 2);
    for (size_t i = 0; i < n; i++)
        cr_expect_neq(ids[i], w[1].id, "rank %zu is on the excluded worker", i);
    /* a fixed size that only the excluded worker could fill: busy, saying so */
    s.ring_size = 3;
    cr_expect_eq(submit_excluding(&fx, &s, ex, 1, ids, &n), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "1 excluded by the request") != NULL, "%s",
              stria_error_msg());
    /* a bounded list */
    uint64_t *many = calloc(1025, sizeof(*many));
    cr_assert_not_null(many);
    cr_expect_eq(submit_excluding(&fx, &s, many, 1025, ids, &n), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "exclude_worker_ids") != NULL, "%s", stria_error_msg());
    free(many);
    fx_stop(&fx);
}

/* ---- the job state machine ----------------------------------------------- */

/* ---- replacing a sharded job's lost worker --------------------------------- */

/* The replacement of a job proves the same secret. */
static void same_secret(uint64_t y, uint64_t x)
{
    cr_assert_lt(g_n_jobs, sizeof(g_jobs) / sizeof(g_jobs[0]));
    g_jobs[g_n_jobs].id = y;
    g_jobs[g_n_jobs].secret = *secret_of(x);
    g_n_jobs++;
}

static bool pred_replaced(const fx_t *fx, void *arg)
{
    stria_rpc_reply_t rep;
    bool done = get_job(fx, *(uint64_t *)arg, &rep)->replaced_by != 0;
    stria_rpc_reply_free(&rep);
    return done;
}

static bool pred_settled(const fx_t *fx, void *arg)
{
    stria_rpc_reply_t rep;
    Stria__V1__JobInfo *info = get_job(fx, *(uint64_t *)arg, &rep);
    bool done = info->replaced_by != 0 || !info->replacement_pending;
    stria_rpc_reply_free(&rep);
    return done;
}

static bool pred_failed(const fx_t *fx, void *arg)
{
    return job_state(fx, *(uint64_t *)arg) == JS(FAILED);
}

static Stria__V1__JobSpec spec_sharded(uint32_t ring_size)
{
    Stria__V1__JobSpec s = spec_default();
    s.sharded = true;
    s.ring_size = ring_size;
    s.layout = STRIA__V1__LAYOUT__LAYOUT_STRIPED;
    return s;
}

/* A coordinator with n workers on host "h" (room for one job each) and a
 * sharded job of ring_size ranks on them; its ranks' worker ids in was[]. */
static uint64_t sharded_on(fx_t *fx, wk_t *w, int n, uint32_t ring_size, uint64_t *was)
{
    stria_rpc_reply_t rep;
    uint64_t m = mem_default((int)ring_size);
    fx_start(fx, 0.2, 60, NULL, NULL);
    for (int i = 0; i < n; i++)
        w[i] = reg_worker(fx, "h", 7000 + i, m + m / 2);
    Stria__V1__JobSpec s = spec_sharded(ring_size);
    uint64_t x = submit_ok(fx, &s, JS(LOADING));
    Stria__V1__JobInfo *info = get_job(fx, x, &rep);
    for (uint32_t r = 0; r < ring_size; r++)
        was[r] = info->assignment->ranks[r]->worker_id;
    stria_rpc_reply_free(&rep);
    return x;
}

/* The job replacing x (which proves x's secret). */
static uint64_t replacement(const fx_t *fx, uint64_t x)
{
    stria_rpc_reply_t rep;
    uint64_t y = get_job(fx, x, &rep)->replaced_by;
    stria_rpc_reply_free(&rep);
    cr_assert_neq(y, 0, "job %llu was not replaced", (unsigned long long)x);
    same_secret(y, x);
    return y;
}

/* A pass fails at a ring peer's report (its link to the lost worker broke)
 * before the verdict on the worker; the job waits for it, and is replaced
 * when it comes: same ranks and spec, the lost rank on the spare. A rank
 * that never moved to the replacement releases it too. */
Test(coord, a_sharded_job_that_lost_a_worker_is_replaced, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[5];
    uint64_t was[4], spare = 0;
    uint64_t x = sharded_on(&fx, w, 5, 4, was);
    Stria__V1__JobSpec s = spec_sharded(4);
    Stria__V1__JobInfo *info;
    for (int i = 0; i < 5; i++)
        spare = was[0] != w[i].id && was[1] != w[i].id && was[2] != w[i].id && was[3] != w[i].id
                    ? w[i].id
                    : spare;
    cr_assert_neq(spare, 0);

    /* rank 1's link to rank 2 broke: failed, waiting for a verdict */
    wk_t lost = {0}, keep[4];
    size_t n_keep = 0;
    for (int i = 0; i < 5; i++) {
        if (w[i].id == was[2])
            lost = w[i];
        else
            keep[n_keep++] = w[i];
        if (w[i].id == was[1])
            cr_expect(report_failed(&fx, w[i], x, 1, true));
    }
    info = get_job(&fx, x, &rep);
    cr_expect_eq(info->state, JS(FAILED));
    cr_expect(info->failure_retryable);
    cr_expect(info->replacement_pending, "a sharded job waits for the verdict on its workers");
    cr_expect_eq(info->replaced_by, 0);
    stria_rpc_reply_free(&rep);

    /* rank 2's worker goes silent: dead after 0.6 s, and replaced */
    cr_assert(wait_until(&fx, keep, n_keep, pred_replaced, &x, 10), "never replaced");
    info = get_job(&fx, x, &rep);
    uint64_t y = info->replaced_by;
    cr_expect(!info->replacement_pending);
    cr_expect(info->n_blamed_worker_ids == 1 && info->blamed_worker_ids[0] == lost.id);
    char want[96];
    snprintf(want, sizeof(want), "replaced by job %llu: rank 2 on worker %llu",
             (unsigned long long)y, (unsigned long long)spare);
    cr_expect(strstr(info->failure, want) != NULL, "%s", info->failure);
    stria_rpc_reply_free(&rep);
    same_secret(y, x);
    info = get_job(&fx, y, &rep);
    cr_expect_eq(info->state, JS(LOADING), "the spare had room: it starts at once");
    cr_expect_eq(info->replaces, x);
    cr_expect_eq(info->generation, 1);
    cr_expect(info->assignment->spec->sharded);
    cr_expect_eq(info->assignment->spec->seq_len, s.seq_len);
    cr_expect_eq(info->assignment->spec->layout, s.layout);
    for (int r = 0; r < 4; r++)
        cr_expect_eq(info->assignment->ranks[r]->worker_id, r == 2 ? spare : was[r],
                     "rank %d of the replacement", r);
    stria_rpc_reply_free(&rep);

    /* every rank releases the old handle: the replacement is released too */
    Stria__V1__ReleaseJobRequest rq = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    uint32_t ranks[4] = {0, 1, 2, 3};
    rq.job_id = x;
    rq.ranks = ranks;
    rq.n_ranks = 4;
    cr_assert_eq(fx_call_job(fx.user, M_RELEASE, &rq.base, x, secret_of(x), &rep), STRIA_OK, "%s",
                 stria_error_msg());
    stria_rpc_reply_free(&rep);
    cr_expect_eq(job_state(&fx, y), JS(RELEASED));
    fx_stop(&fx);
}

static bool pred_loading(const fx_t *fx, void *arg)
{
    return job_state(fx, *(uint64_t *)arg) == JS(LOADING);
}

/* The worker of job x's rank `rank` among w[0 .. n). */
static wk_t worker_of(const wk_t *w, int n, const uint64_t *was, int rank)
{
    for (int i = 0; i < n; i++)
        if (w[i].id == was[rank])
            return w[i];
    cr_assert_fail("no worker %llu", (unsigned long long)was[rank]);
    return w[0];
}

/* A job queued behind a failed sharded job does not take the room its
 * replacement needs while the failure waits for the verdict: the
 * replacement starts at once, in the failed job's place; a wait that ends
 * without a verdict gives the room to the queue. */
Test(coord, a_replacement_keeps_its_jobs_place_in_the_queue, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    wk_t w[5], keep[4];
    uint64_t was[4];
    size_t n_keep = 0;
    uint64_t x = sharded_on(&fx, w, 5, 4, was);
    Stria__V1__JobSpec s = spec_default();
    s.ring_size = 4;
    uint64_t q = submit_ok(&fx, &s, JS(PENDING)); /* no room on x's workers */
    wk_t lost = worker_of(w, 5, was, 2);
    for (int i = 0; i < 5; i++)
        if (w[i].id != lost.id)
            keep[n_keep++] = w[i];

    cr_expect(report_failed(&fx, worker_of(w, 5, was, 1), x, 1, true));
    cr_expect_eq(job_state(&fx, q), JS(PENDING), "the queued job took the failed job's room");
    cr_assert(wait_until(&fx, keep, n_keep, pred_replaced, &x, 10), "never replaced");
    uint64_t y = replacement(&fx, x);
    cr_expect_eq(job_state(&fx, y), JS(LOADING), "the replacement waits behind a later job");
    cr_expect_neq(job_state(&fx, q), JS(LOADING));

    /* the replacement ends: the queued job (unless it was on the lost
     * worker) gets the room */
    cr_expect_eq(release(&fx, y), STRIA_OK);
    if (job_state(&fx, q) == JS(PENDING))
        cr_expect(wait_until(&fx, keep, n_keep, pred_loading, &q, 5), "the room never came free");
    fx_stop(&fx);

    /* no verdict: the wait's end frees the room */
    x = sharded_on(&fx, w, 5, 4, was);
    q = submit_ok(&fx, &s, JS(PENDING));
    cr_expect(report_failed(&fx, worker_of(w, 5, was, 1), x, 1, true));
    cr_expect_eq(job_state(&fx, q), JS(PENDING));
    cr_expect(wait_until(&fx, w, 5, pred_loading, &q, 10),
              "the failed job kept its room after its wait");
    fx_stop(&fx);
}

/* A failed sharded job without a lost worker stays failed once the wait is
 * over; a failure that is not retryable, and a whole-sequence job's, do not
 * wait; nor is a job replaced without a spare (it says why). */
Test(coord, a_sharded_job_is_replaced_only_for_a_lost_worker_with_a_spare,
     .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[2];
    fx_start(&fx, 0.2, 60, NULL, NULL);
    w[0] = reg_worker(&fx, "h", 7000, 1ull << 32);
    w[1] = reg_worker(&fx, "h", 7001, 1ull << 32);
    Stria__V1__JobSpec s = spec_sharded(2);
    uint64_t x = submit_ok(&fx, &s, JS(LOADING));
    cr_expect(report_failed(&fx, w[0], x, 0, true));
    double t0 = stria_time_now();
    cr_assert(wait_until(&fx, w, 2, pred_settled, &x, 10));
    cr_expect_geq(stria_time_now() - t0, 5 * 0.2, "the wait is a few heartbeat periods");
    Stria__V1__JobInfo *info = get_job(&fx, x, &rep);
    cr_expect_eq(info->replaced_by, 0);
    cr_expect(info->failure_retryable);
    stria_rpc_reply_free(&rep);

    uint64_t x2 = submit_ok(&fx, &s, JS(LOADING));
    cr_expect(!report_failed(&fx, w[0], x2, 0, false));
    info = get_job(&fx, x2, &rep);
    cr_expect(!info->replacement_pending, "bad input is no lost worker");
    stria_rpc_reply_free(&rep);
    Stria__V1__JobSpec whole = spec_default();
    whole.ring_size = 2;
    uint64_t x3 = submit_ok(&fx, &whole, JS(LOADING));
    cr_expect(report_failed(&fx, w[0], x3, 0, true));
    info = get_job(&fx, x3, &rep);
    cr_expect(!info->replacement_pending, "the client library retries whole-sequence jobs");
    stria_rpc_reply_free(&rep);

    /* no spare: w[1] dies, and nothing can take its rank */
    uint64_t x4 = submit_ok(&fx, &s, JS(LOADING));
    cr_assert(wait_until(&fx, &w[0], 1, pred_failed, &x4, 10));
    info = get_job(&fx, x4, &rep);
    cr_expect_eq(info->state, JS(FAILED));
    cr_expect_eq(info->replaced_by, 0);
    cr_expect(info->failure_retryable, "the trainer may try again once a worker is back");
    cr_expect(strstr(info->failure, "not replaced: no healthy worker outside the job has") != NULL,
              "%s", info->failure);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

/* Every lost member gets a spare at once: two workers silent together die in
 * one tick (neither is the other's spare), and a draining member is moved
 * too (a queued job with a draining worker would fail). The two go silent
 * a moment apart, as two workers of a host that went down would: deaths
 * due within a tick of each other are one. */
Test(coord, lost_and_draining_members_all_get_spares, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[7];
    uint64_t was[3];
    uint64_t x = sharded_on(&fx, w, 7, 3, was);
    Stria__V1__JobInfo *info;
    Stria__V1__DrainWorkerRequest dw = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    dw.worker_id = was[0];
    dw.drain = true;
    cr_assert_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    wk_t keep[7];
    size_t n_keep = 0;
    for (int i = 0; i < 7; i++)
        if (w[i].id != was[1] && w[i].id != was[2])
            keep[n_keep++] = w[i];
    for (int k = 1; k < 3; k++) /* their last words, 10 ms apart */
        for (int i = 0; i < 7; i++)
            if (w[i].id == was[k]) {
                cr_assert_eq(heartbeat(&fx, w[i], NULL, 0, 0, NULL, NULL, NULL), STRIA_OK);
                usleep(10000);
            }
    cr_assert(wait_until(&fx, keep, n_keep, pred_replaced, &x, 10), "never replaced");
    info = get_job(&fx, replacement(&fx, x), &rep);
    cr_expect_eq(info->state, JS(LOADING), "%s", info->failure);
    cr_expect_eq(info->generation, 1, "both deaths in one replacement");
    for (int r = 0; r < 3; r++)
        for (int k = 0; k < 3; k++)
            cr_expect_neq(info->assignment->ranks[r]->worker_id, was[k],
                          "rank %d of the replacement is on a lost or draining worker", r);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

/* A placed rank's spare comes from its host; with none there, the job is
 * not replaced unless the spec allows another host. */
Test(coord, a_placed_ranks_spare_keeps_its_placement, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[5];
    uint64_t m = mem_default(2);
    fx_start(&fx, 0.2, 60, NULL, NULL);
    for (int i = 0; i < 5; i++) /* hA: 7000-7002, hB: 7003-7004 */
        w[i] = reg_worker(&fx, i < 3 ? "hA" : "hB", 7000 + i, m + m / 2);
    Stria__V1__JobSpec s = spec_sharded(2);
    Stria__V1__JobSpec__Placement pa = STRIA__V1__JOB_SPEC__PLACEMENT__INIT,
                                  pb = STRIA__V1__JOB_SPEC__PLACEMENT__INIT, *pl[2] = {&pa, &pb};
    pa.host = (char *)"hA";
    pb.host = (char *)"hB";
    s.placement = pl;
    s.n_placement = 2;
    uint64_t x = submit_ok(&fx, &s, JS(LOADING));
    Stria__V1__JobInfo *info = get_job(&fx, x, &rep);
    uint64_t r0 = info->assignment->ranks[0]->worker_id, r1 = info->assignment->ranks[1]->worker_id;
    stria_rpc_reply_free(&rep);
    cr_assert(r1 == w[3].id || r1 == w[4].id);
    wk_t keep[4], other = r1 == w[3].id ? w[4] : w[3];
    size_t n_keep = 0;
    for (int i = 0; i < 5; i++)
        if (w[i].id != r1)
            keep[n_keep++] = w[i];
    cr_assert(wait_until(&fx, keep, n_keep, pred_replaced, &x, 10), "never replaced");
    uint64_t y = replacement(&fx, x);
    info = get_job(&fx, y, &rep);
    cr_expect_eq(info->assignment->ranks[0]->worker_id, r0);
    cr_expect_eq(info->assignment->ranks[1]->worker_id, other.id,
                 "rank 1 is placed on hB: the spare there, not the idle ones of hA");
    cr_expect(!info->assignment->ranks[1]->placement_fallback);
    stria_rpc_reply_free(&rep);

    /* now hB has no worker left for it */
    n_keep = 0;
    for (int i = 0; i < 3; i++)
        keep[n_keep++] = w[i];
    cr_assert(wait_until(&fx, keep, n_keep, pred_failed, &y, 10));
    info = get_job(&fx, y, &rep);
    cr_expect_eq(info->replaced_by, 0);
    cr_expect(strstr(info->failure, "not replaced: no healthy worker on host 'hB'") != NULL, "%s",
              info->failure);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

Test(coord, job_lifecycle_through_reports, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    Stria__V1__JobState st = 0;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));

    cr_expect_eq(report(&fx, b, job, 0, EV(LOADED), NULL, &st), STRIA_ERR_INVALID_ARG,
                 "b is rank 1, not rank 0");
    cr_expect(strstr(stria_error_msg(), "is not rank 0") != NULL, "%s", stria_error_msg());
    cr_expect_eq(report(&fx, a, 777, 0, EV(LOADED), NULL, &st), STRIA_ERR_NOT_FOUND);
    cr_expect_eq(report(&fx, a, job, 0, EV(BACKWARD_STARTED), NULL, &st), STRIA_ERR_INVALID_ARG,
                 "backward before forward");
    cr_expect_eq(report(&fx, a, job, 0, 42, NULL, &st), STRIA_ERR_INVALID_ARG);

    cr_expect_eq(report(&fx, a, job, 0, EV(LOADED), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(LOADING));
    cr_expect_eq(report(&fx, a, job, 0, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(RUNNING_FORWARD));
    cr_expect_eq(report(&fx, b, job, 1, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);
    cr_expect_eq(report(&fx, a, job, 0, EV(FORWARD_DONE), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(RUNNING_FORWARD), "one rank done is not the job done");
    cr_expect_eq(report(&fx, b, job, 1, EV(FORWARD_DONE), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(FORWARD_DONE));
    cr_expect_eq(report(&fx, a, job, 0, EV(BACKWARD_STARTED), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(RUNNING_BACKWARD));
    cr_expect_eq(report(&fx, a, job, 0, EV(BACKWARD_DONE), NULL, &st), STRIA_OK);
    cr_expect_eq(report(&fx, b, job, 1, EV(BACKWARD_DONE), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(DONE));
    Stria__V1__JobInfo *info = get_job(&fx, job, &rep);
    cr_expect_gt(info->timings->submitted_ms, 0);
    cr_expect_geq(info->timings->forward_started_ms, info->timings->started_ms);
    cr_expect_geq(info->timings->forward_done_ms, info->timings->forward_started_ms);
    cr_expect_geq(info->timings->backward_done_ms, info->timings->backward_started_ms);
    cr_expect_eq(info->timings->finished_ms, 0);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(release(&fx, job), STRIA_OK);
    cr_expect_eq(report(&fx, a, job, 0, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(RELEASED), "a report on a finished job tells the worker to drop it");

    /* A failure names the rank, the worker and the reason. */
    uint64_t job2 = submit_ok(&fx, &s, JS(LOADING));
    cr_expect_eq(report(&fx, b, job2, 1, EV(FAILED), "step 3: peer timed out", &st), STRIA_OK);
    cr_expect_eq(st, JS(FAILED));
    info = get_job(&fx, job2, &rep);
    cr_expect(strstr(info->failure, "rank 1 (worker") != NULL, "%s", info->failure);
    cr_expect(strstr(info->failure, "step 3: peer timed out") != NULL, "%s", info->failure);
    cr_expect_gt(info->timings->finished_ms, 0);
    cr_expect(!info->failure_retryable, "the worker did not judge it retryable");
    stria_rpc_reply_free(&rep);

    Stria__V1__ListJobsRequest lj = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    cr_assert_eq(fx_call(fx.cl, M_LIST_JOBS, &lj.base, &rep), STRIA_OK);
    cr_expect_eq(((Stria__V1__ListJobsReply *)rep.msg)->n_jobs, 0, "both jobs are finished");
    stria_rpc_reply_free(&rep);
    lj.include_finished = true;
    cr_assert_eq(fx_call(fx.cl, M_LIST_JOBS, &lj.base, &rep), STRIA_OK);
    cr_expect_eq(((Stria__V1__ListJobsReply *)rep.msg)->n_jobs, 2);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

Test(coord, abandoned_jobs_expire, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    fx_start(&fx, 0.1, 0.4, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t idle = submit_ok(&fx, &s, JS(LOADING));
    uint64_t busy = submit_ok(&fx, &s, JS(LOADING));
    /* `busy` is in use on the worker (heartbeats say it was used just now);
     * `idle` is not. The TTL is whole seconds: 0.4 rounds up to 1. */
    double t0 = stria_time_now(), end = t0 + 10;
    bool expired = false;
    while (stria_time_now() < end && !expired) {
        heartbeat(&fx, a, &busy, 1, 0, NULL, NULL, NULL);
        expired = job_state_quiet(&fx, idle) == JS(EXPIRED);
        usleep(20000);
    }
    cr_assert(expired, "the abandoned job never expired");
    cr_expect_geq(stria_time_now() - t0, 0.95, "expired before its TTL");
    cr_expect_eq(job_state_quiet(&fx, busy), JS(LOADING), "a job in use must not expire");
    Stria__V1__JobInfo *info = get_job(&fx, idle, &rep);
    cr_expect(strstr(info->failure, "abandoned") != NULL, "%s", info->failure);
    stria_rpc_reply_free(&rep);
    /* The worker is told to drop the expired job. */
    uint64_t both[2] = {idle, busy}, drop[8];
    size_t n_drop = 0;
    cr_assert_eq(heartbeat(&fx, a, both, 2, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 1);
    cr_expect_eq(drop[0], idle);
    fx_stop(&fx);
}

/* A job stays alive for its owner only: GetJob proving the job's secret
 * renews its TTL; a view without the secret (an admin's, a worker's) does
 * not, so nobody but the owner can keep another client's job (and its
 * memory on the workers) alive. */
Test(coord, only_the_owner_renews_a_job, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    fx_start(&fx, 0.1, 0.4, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t owned = submit_ok(&fx, &s, JS(LOADING));
    uint64_t viewed = submit_ok(&fx, &s, JS(LOADING));
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    double end = stria_time_now() + 10;
    bool expired = false;
    while (stria_time_now() < end && !expired) {
        heartbeat(&fx, a, NULL, 0, 0, NULL, NULL, NULL); /* alive, holding nothing */
        req.job_id = owned;
        cr_assert_eq(fx_call_job(fx.cl, M_GET_JOB, &req.base, owned, secret_of(owned), &rep),
                     STRIA_OK, "%s", stria_error_msg());
        stria_rpc_reply_free(&rep);
        req.job_id = viewed;
        cr_assert_eq(fx_call_job(fx.cl, M_GET_JOB, &req.base, viewed, NULL, &rep), STRIA_OK,
                     "a view without the secret (every role here): %s", stria_error_msg());
        stria_rpc_reply_free(&rep);
        expired = job_state_quiet(&fx, viewed) == JS(EXPIRED);
        usleep(20000);
    }
    cr_expect(expired, "views without the secret kept a job alive");
    cr_expect_eq(job_state_quiet(&fx, owned), JS(LOADING), "the owner's GetJob renews its job");
    /* A wrong secret is refused even where a view is allowed. */
    stria_job_secret_t wrong = *secret_of(owned);
    wrong.bytes[0] ^= 1;
    req.job_id = owned;
    cr_expect_eq(fx_call_job(fx.cl, M_GET_JOB, &req.base, owned, &wrong, &rep), STRIA_ERR_AUTH);
    fx_stop(&fx);
}

/* Job ids say nothing: random, unique, not consecutive, exact in JSON
 * (below 2^53); each job has its own secret. */
Test(coord, job_ids_are_random_and_each_job_has_its_own_secret, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    reg_worker(&fx, "h", 7000, 1ull << 40);
    Stria__V1__JobSpec s = spec_default();
    uint64_t ids[40];
    for (int i = 0; i < 40; i++) {
        ids[i] = submit_ok(&fx, &s, JS(LOADING));
        cr_expect(ids[i] > 0 && ids[i] < (1ull << 53), "id %llu", (unsigned long long)ids[i]);
        for (int k = 0; k < i; k++) {
            cr_expect_neq(ids[i], ids[k]);
            cr_expect(memcmp(secret_of(ids[i]), secret_of(ids[k]), sizeof(stria_job_secret_t)),
                      "two jobs with one secret");
        }
        if (i > 0)
            cr_expect(ids[i] != ids[i - 1] + 1, "consecutive ids %llu, %llu",
                      (unsigned long long)ids[i - 1], (unsigned long long)ids[i]);
    }
    /* The high bits vary: not a counter from a random start. */
    uint64_t or_bits = 0, and_bits = ~0ull;
    for (int i = 0; i < 40; i++)
        or_bits |= ids[i], and_bits &= ids[i];
    cr_expect_geq(__builtin_popcountll(or_bits & ~and_bits), 48, "bits that vary: %llx",
                  (unsigned long long)(or_bits & ~and_bits));
    fx_stop(&fx);
}

/* ---- admin --------------------------------------------------------------- */

Test(coord, cancel_and_drain_need_the_admin_token, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    stria_status_t st;
    uint64_t ids[8];
    fx_start(&fx, 1.0, 60, "user", "admin");
    cr_expect(stria_rpc_client_admin(fx.cl));
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));

    stria_rpc_client_t *user = fx_connect(&fx, "user", &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect_null(fx_connect(&fx, "wrong", &st));
    cr_expect_eq(st, STRIA_ERR_AUTH);
    cr_expect_null(fx_connect(&fx, NULL, &st));
    cr_expect_eq(st, STRIA_ERR_AUTH);

    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    cj.job_id = job;
    cj.reason = (char *)"maintenance";
    cr_expect_eq(fx_call(user, M_CANCEL, &cj.base, &rep), STRIA_ERR_AUTH);
    Stria__V1__DrainWorkerRequest dw = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    dw.worker_id = b.id;
    dw.drain = true;
    cr_expect_eq(fx_call(user, M_DRAIN, &dw.base, &rep), STRIA_ERR_AUTH);
    cr_expect_eq(ring_ids(&fx, ids, 8, NULL), 2);

    cr_assert_eq(fx_call(fx.cl, M_CANCEL, &cj.base, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(((Stria__V1__CancelJobReply *)rep.msg)->state, JS(CANCELLED));
    stria_rpc_reply_free(&rep);
    Stria__V1__JobInfo *info = get_job(&fx, job, &rep);
    cr_expect_eq(info->state, JS(CANCELLED));
    cr_expect(strstr(info->failure, "cancelled by an admin") != NULL, "%s", info->failure);
    cr_expect(strstr(info->failure, "maintenance") != NULL, "%s", info->failure);
    stria_rpc_reply_free(&rep);
    uint64_t drop[8];
    size_t n_drop = 0;
    cr_assert_eq(heartbeat(&fx, a, &job, 1, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 1, "the worker is told to drop the cancelled job");

    cr_assert_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__WorkerInfo *wi = ((Stria__V1__DrainWorkerReply *)rep.msg)->worker;
    cr_expect_eq(wi->state, WST(DRAINING));
    cr_expect_eq(wi->ring_index, -1);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(ring_ids(&fx, ids, 8, NULL), 1);
    uint64_t j1 = submit_ok(&fx, &s, JS(LOADING));
    info = get_job(&fx, j1, &rep);
    cr_expect_eq(info->assignment->n_ranks, 1, "a draining worker takes no new job");
    cr_expect_eq(info->assignment->ranks[0]->worker_id, a.id);
    stria_rpc_reply_free(&rep);
    dw.drain = false;
    cr_assert_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_OK);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(ring_ids(&fx, ids, 8, NULL), 2);
    dw.worker_id = 4242;
    cr_expect_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_ERR_NOT_FOUND);
    stria_rpc_client_close(user);
    fx_stop(&fx);
}

/* ---- the daemon as a process --------------------------------------------- */

static char g_dir[64];

static void write_file(const char *name, const char *text)
{
    char path[128];
    FILE *f;
    snprintf(path, sizeof(path), "%s/%s", g_dir, name);
    f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

/* Runs stria-coordinator with extra arguments; reads its port from the line
 * it prints and checks the --port-file agrees. */
static void fx_spawn(fx_t *fx, const char *const *extra, const char *client_token)
{
    char port_file[128], log_path[128], line[256], buf[32] = {0};
    const char *argv[32];
    const char *colon;
    int n = 0;
    stria_status_t st;
    FILE *f;
    memset(fx, 0, sizeof(*fx));
    snprintf(port_file, sizeof(port_file), "%s/port", g_dir);
    snprintf(log_path, sizeof(log_path), "%s/coordinator.log", g_dir);
    unlink(port_file);
    argv[n++] = STRIA_COORDINATOR_BIN;
    argv[n++] = "--listen";
    argv[n++] = "127.0.0.1:0";
    argv[n++] = "--port-file";
    argv[n++] = port_file;
    argv[n++] = "--log-level";
    argv[n++] = "error";
    for (; extra != NULL && *extra != NULL; extra++)
        argv[n++] = *extra;
    argv[n] = NULL;
    fx->proc = test_proc_start((char *const *)argv, log_path, NULL);
    cr_assert_not_null(fx->proc, "cannot start %s", STRIA_COORDINATOR_BIN);
    cr_assert(
        test_proc_wait_line(fx->proc, "stria-coordinator listening on ", 10.0, line, sizeof(line)),
        "stria-coordinator did not report its address (log in %s)", log_path);
    colon = strrchr(line, ':');
    cr_assert_not_null(colon, "%s", line);
    fx->port = (uint16_t)atoi(colon + 1);
    cr_assert_gt(fx->port, 0, "%s", line);
    f = fopen(port_file, "r");
    cr_assert_not_null(f, "no --port-file written");
    cr_expect_not_null(fgets(buf, sizeof(buf), f));
    fclose(f);
    cr_expect_eq(atoi(buf), fx->port, "--port-file says %s", buf);
    fx->cl = fx_connect(fx, client_token, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    fx->wk = fx->user = fx->cl;
}

static void setup_dir(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/stria-coord-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
}

static void teardown_dir(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        cr_log_warn("could not remove %s", g_dir);
}

/* A raw connection to the daemon, greeted with `token`. */
static int raw_greeted(const fx_t *fx, const char *token)
{
    rt_reply_t r;
    int fd = rt_connect(fx->port);
    cr_assert_geq(fd, 0);
    cr_assert(rt_hello(fd, "stria.v1.Coordinator", STRIA_RPC_VERSION));
    cr_assert(token == NULL || rt_prove(fd, "stria.v1.Coordinator", token));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_assert_eq(r.h.status, 0, "hello refused: %s", r.err ? r.err->message : "");
    rt_reply_free(&r);
    return fd;
}

/* The daemon still answers a valid request on a fresh connection. */
static void still_serving(const fx_t *fx)
{
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    stria_status_t st;
    stria_rpc_client_t *cl = fx_connect(fx, "tok", &st);
    cr_assert_eq(st, STRIA_OK, "daemon stopped serving: %s", stria_error_msg());
    cr_expect_eq(fx_call(cl, M_STATUS, &gs.base, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);
}

Test(daemon, bad_peers_get_errors_and_the_daemon_keeps_serving, .timeout = TEST_TIMEOUT_S,
     .init = setup_dir, .fini = teardown_dir)
{
    fx_t fx;
    rt_reply_t r;
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    stria_rpc_header_t h;
    int fd;
    char tok_arg[128];
    char wtok_arg[128];
    write_file("token", "tok\n");
    write_file("worker-token", "wtok\n");
    snprintf(tok_arg, sizeof(tok_arg), "%s/token", g_dir);
    snprintf(wtok_arg, sizeof(wtok_arg), "%s/worker-token", g_dir);
    const char *extra[] = {"--token-file", tok_arg, "--worker-token-file", wtok_arg, NULL};
    fx_spawn(&fx, extra, "tok");

    /* Wrong version in the header: error naming both versions, closed. */
    fd = rt_connect(fx.port);
    h = rt_header(0, 1);
    h.flags = STRIA_RPC_FLAG_HELLO;
    h.version = 9;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_PROTOCOL);
    cr_expect(strstr(r.err->message, "version 9") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);
    still_serving(&fx);

    /* No token, wrong token. */
    const char *toks[] = {NULL, "tok2"};
    for (int i = 0; i < 2; i++) {
        fd = rt_connect(fx.port);
        cr_assert(rt_hello(fd, "stria.v1.Coordinator", STRIA_RPC_VERSION));
        cr_assert(rt_prove(fd, "stria.v1.Coordinator", toks[i]));
        cr_assert(rt_read_reply(fd, &r, 5000));
        cr_expect_eq(r.h.status, STRIA_ERR_AUTH);
        rt_reply_free(&r);
        cr_expect(rt_wait_closed(fd, 5000));
        close(fd);
    }
    still_serving(&fx);

    /* Oversized message length: error, closed. */
    fd = raw_greeted(&fx, "tok");
    h = rt_header(M_STATUS, 2);
    h.pb_len = 0xffffffffu;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_PROTOCOL);
    cr_expect(strstr(r.err->message, "exceeds the limit") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);
    still_serving(&fx);

    /* Truncated: a header promising 100 bytes, 10 sent, then gone. */
    fd = raw_greeted(&fx, "tok");
    h = rt_header(M_SUBMIT, 3);
    h.pb_len = 100;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, "0123456789", 10));
    close(fd);
    still_serving(&fx);

    /* Malformed body and unknown method: errors, the connection lives on. */
    fd = raw_greeted(&fx, "tok");
    uint8_t junk[16];
    memset(junk, 0xff, sizeof(junk));
    h = rt_header(M_SUBMIT, 4);
    h.pb_len = sizeof(junk);
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, junk, sizeof(junk)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_FORMAT);
    cr_expect(strstr(r.err->message, "SubmitJobRequest") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    cr_assert(rt_send_frame(fd, rt_header(13, 5), &gs.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_UNSUPPORTED);
    cr_expect(strstr(r.err->message, "method index 13 does not exist") != NULL, "%s",
              r.err->message);
    rt_reply_free(&r);
    /* A nonsense spec, on the same connection. */
    Stria__V1__SubmitJobRequest sj = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    Stria__V1__JobSpec s = spec_default();
    s.heads = 5;
    s.kv_heads = 2;
    sj.spec = &s;
    cr_assert(rt_send_frame(fd, rt_header(M_SUBMIT, 6), &sj.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(r.err->message, "multiple of kv_heads") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_assert(rt_send_frame(fd, rt_header(M_STATUS, 7), &gs.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, 0, "valid request after errors");
    rt_reply_free(&r);
    close(fd);
    still_serving(&fx);
    fx_stop(&fx);
}

Test(daemon, workers_die_and_rejoin_across_processes, .timeout = TEST_TIMEOUT_S, .init = setup_dir,
     .fini = teardown_dir)
{
    fx_t fx;
    uint64_t ids[8];
    size_t want = 1;
    bool rejoined = false;
    const char *extra[] = {"--heartbeat-period", "0.2", NULL};
    fx_spawn(&fx, extra, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    cr_assert_eq(ring_ids(&fx, ids, 8, NULL), 2);
    cr_assert(wait_until(&fx, &a, 1, pred_ring_len, &want, 10), "b never marked dead");
    cr_assert_eq(heartbeat(&fx, b, NULL, 0, 0, NULL, NULL, &rejoined), STRIA_OK);
    cr_expect(rejoined);
    cr_expect_eq(ring_ids(&fx, ids, 8, NULL), 2);
    fx_stop(&fx);
}

Test(daemon, bad_flags_exit_2, .timeout = TEST_TIMEOUT_S, .init = setup_dir, .fini = teardown_dir)
{
    const char *cases[][4] = {
        {"--bogus", NULL, NULL, "unknown option"},
        {"--heartbeat-period", "0", NULL, "--heartbeat-period"},
        {"--job-ttl", "abc", NULL, "--job-ttl"},
        {"--listen", "nohost", NULL, "--listen"},
        {"--token-file", "/nonexistent/token", NULL, "--token-file"},
        {"--log-level", "loud", NULL, "--log-level"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char err_path[128], cmd[512], msg[1024] = {0};
        FILE *f;
        int status;
        snprintf(err_path, sizeof(err_path), "%s/err", g_dir);
        snprintf(cmd, sizeof(cmd), "'%s' %s %s >/dev/null 2>'%s'", STRIA_COORDINATOR_BIN,
                 cases[i][0], cases[i][1] ? cases[i][1] : "", err_path);
        status = system(cmd);
        cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 2, "%s: status 0x%x", cmd, status);
        f = fopen(err_path, "r");
        cr_assert_not_null(f);
        if (fread(msg, 1, sizeof(msg) - 1, f) == 0)
            msg[0] = '\0';
        fclose(f);
        cr_expect(strstr(msg, cases[i][3]) != NULL, "%s: stderr '%s'", cmd, msg);
    }
    /* A busy port: start-up failure, status 1. */
    fx_t fx;
    char listen[64], cmd[256];
    fx_spawn(&fx, NULL, NULL);
    snprintf(listen, sizeof(listen), "127.0.0.1:%u", fx.port);
    snprintf(cmd, sizeof(cmd), "'%s' --listen %s >/dev/null 2>&1", STRIA_COORDINATOR_BIN, listen);
    int status = system(cmd);
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 1, "busy port: status 0x%x", status);
    fx_stop(&fx);
}

/* ---- pass timelines ---------------------------------------------------------- */

/* A rank's timeline of `steps` steps: one entry per step with spans, or
 * (summarised) one group; `bad` breaks it (entries out of order). */
static void timeline_of(Stria__V1__PassTimeline *t, Stria__V1__StepTimes *e,
                        Stria__V1__StepTimes **ptrs, uint64_t *spans, uint32_t rank, uint32_t pass,
                        bool backward, uint32_t steps, bool summarised, bool bad)
{
    stria__v1__pass_timeline__init(t);
    t->rank = rank;
    t->pass = pass;
    t->backward = backward;
    t->steps = steps;
    t->summarised = summarised;
    t->seconds_us = 1000u * steps;
    t->n_entries = summarised ? 1 : steps;
    t->entries = ptrs;
    for (uint32_t s = 0; s < t->n_entries; s++) {
        stria__v1__step_times__init(&e[s]);
        ptrs[s] = &e[s];
        e[s].first_step = summarised ? 0 : (bad && s == 1 ? 0 : s);
        e[s].steps = summarised ? steps : 1;
        e[s].begin_us = 1000u * s;
        e[s].end_us = summarised ? 1000u * steps : 1000u * (s + 1);
        e[s].compute_us = 600;
        e[s].wait_us = 300;
        e[s].computed = 1;
        if (!summarised) {
            spans[4 * s] = e[s].begin_us;
            spans[4 * s + 1] = e[s].begin_us + 600;
            spans[4 * s + 2] = e[s].begin_us + 600;
            spans[4 * s + 3] = e[s].begin_us + 900;
            e[s].compute_spans = &spans[4 * s];
            e[s].n_compute_spans = 2;
            e[s].wait_spans = &spans[4 * s + 2];
            e[s].n_wait_spans = 2;
        }
    }
}

static stria_status_t report_tl(const fx_t *fx, wk_t w, uint64_t job, uint32_t rank, int event,
                                Stria__V1__PassTimeline *t)
{
    Stria__V1__ReportJobRequest req = STRIA__V1__REPORT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.worker_id = w.id;
    req.job_id = job;
    req.rank = rank;
    req.event = event;
    req.message = (char *)"";
    req.timeline = t;
    stria_status_t st = fx_call(fx->cl, M_REPORT, &req.base, &rep);
    stria_rpc_reply_free(&rep);
    return st;
}

/* The timelines of a job as (backward << 8 | rank) codes, sorted by arrival
 * in the reply; returns their number. */
static size_t job_timelines(const fx_t *fx, uint64_t id, bool include, uint32_t *codes,
                            uint32_t *passes, uint32_t *entries)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.job_id = id;
    req.include_timelines = include;
    cr_assert_eq(fx_call(fx->cl, M_GET_JOB, &req.base, &rep), STRIA_OK, "%s", stria_error_msg());
    const Stria__V1__JobInfo *j = ((Stria__V1__GetJobReply *)rep.msg)->job;
    size_t n = j->n_timelines;
    for (size_t i = 0; i < n && i < 8; i++) {
        codes[i] = (j->timelines[i]->backward ? 256u : 0u) | j->timelines[i]->rank;
        passes[i] = j->timelines[i]->pass;
        entries[i] = (uint32_t)j->timelines[i]->n_entries;
    }
    stria_rpc_reply_free(&rep);
    return n;
}

Test(coord, pass_timelines_are_checked_kept_and_replaced, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    Stria__V1__PassTimeline t;
    Stria__V1__StepTimes e[2], *ptrs[2];
    uint64_t spans[8];
    uint32_t codes[8], passes[8], entries[8];
    Stria__V1__JobState st = 0;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7100, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7101, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));
    cr_assert_eq(report(&fx, a, job, 0, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);

    /* rank 0: a well-formed timeline of 2 steps; rank 1: entries out of
     * order (ignored, but its FORWARD_DONE counts) */
    timeline_of(&t, e, ptrs, spans, 0, 0, false, 2, false, false);
    cr_assert_eq(report_tl(&fx, a, job, 0, EV(FORWARD_DONE), &t), STRIA_OK);
    timeline_of(&t, e, ptrs, spans, 1, 0, false, 2, false, true);
    cr_assert_eq(report_tl(&fx, b, job, 1, EV(FORWARD_DONE), &t), STRIA_OK);
    cr_expect_eq(job_state(&fx, job), JS(FORWARD_DONE), "a bad timeline still reports the event");
    cr_expect_eq(job_timelines(&fx, job, false, codes, passes, entries), 0,
                 "only asked for, they stay out of GetJob");
    cr_assert_eq(job_timelines(&fx, job, true, codes, passes, entries), 1);
    cr_expect_eq(codes[0], 0u);
    cr_expect_eq(entries[0], 2u);

    /* a timeline naming another rank than the reporter's, or more steps than
     * ranks, is ignored too */
    timeline_of(&t, e, ptrs, spans, 0, 0, false, 2, false, false);
    t.rank = 1;
    cr_expect_eq(report_tl(&fx, a, job, 0, EV(FORWARD_DONE), &t), STRIA_OK);
    t.rank = 0;
    t.steps = 3;
    cr_expect_eq(report_tl(&fx, a, job, 0, EV(FORWARD_DONE), &t), STRIA_OK);
    cr_expect_eq(job_timelines(&fx, job, true, codes, passes, entries), 1);

    /* backward timelines (summarised) sit beside the forward ones */
    cr_assert_eq(report(&fx, a, job, 0, EV(BACKWARD_STARTED), NULL, &st), STRIA_OK);
    timeline_of(&t, e, ptrs, spans, 1, 1, true, 2, true, false);
    cr_assert_eq(report_tl(&fx, b, job, 1, EV(BACKWARD_DONE), &t), STRIA_OK);
    cr_assert_eq(job_timelines(&fx, job, true, codes, passes, entries), 2);
    cr_expect_eq(codes[1], 256u | 1u);
    cr_expect_eq(entries[1], 1u);
    /* spans in a summarised entry are refused */
    timeline_of(&t, e, ptrs, spans, 0, 1, true, 2, false, false);
    t.summarised = true;
    cr_expect_eq(report_tl(&fx, a, job, 0, EV(BACKWARD_DONE), &t), STRIA_OK);
    cr_expect_eq(job_timelines(&fx, job, true, codes, passes, entries), 2);

    /* a newer forward pass replaces the older one's timelines */
    cr_assert_eq(report(&fx, a, job, 0, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);
    timeline_of(&t, e, ptrs, spans, 1, 2, false, 2, false, false);
    cr_assert_eq(report_tl(&fx, b, job, 1, EV(FORWARD_DONE), &t), STRIA_OK);
    cr_assert_eq(job_timelines(&fx, job, true, codes, passes, entries), 2);
    cr_expect_eq(codes[0], 1u, "rank 0's pass 0 is gone, rank 1's pass 2 is there");
    cr_expect_eq(passes[0], 2u);
    /* ... and a late report of the older pass does not bring it back */
    timeline_of(&t, e, ptrs, spans, 0, 0, false, 2, false, false);
    cr_assert_eq(report_tl(&fx, a, job, 0, EV(FORWARD_DONE), &t), STRIA_OK);
    cr_expect_eq(job_timelines(&fx, job, true, codes, passes, entries), 2);
    fx_stop(&fx);
}

/* ---- restart: jobs rebuilt from the workers' descriptions ------------------ */

typedef struct {
    uint64_t id;
    stria_job_secret_t secret;
    uint8_t ring_key[STRIA_AUTH_KEY_BYTES];
    Stria__V1__JobSpec spec;
    uint64_t replaces; /* HeldJob.replaces, .generation */
    uint32_t generation;
} held_t;

static void held_init(held_t *h, uint64_t id, uint32_t ring)
{
    memset(h, 0, sizeof(*h));
    h->id = id;
    cr_assert_eq(stria_job_secret_generate(&h->secret), STRIA_OK);
    cr_assert_eq(stria_auth_random(h->ring_key, sizeof(h->ring_key)), STRIA_OK);
    h->spec = spec_default();
    h->spec.ring_size = ring;
    h->spec.ttl_s = 60;
}

/* A heartbeat of worker w describing rank `rank` of h (phase, purposes of
 * the seals as given: "held job secret" and "held ring key" are right);
 * the drops and describe_jobs come back. */
static stria_status_t heartbeat_held(const fx_t *fx, wk_t w, const held_t *h, uint32_t rank,
                                     Stria__V1__JobState phase, const char *secret_purpose,
                                     size_t *n_drop, bool *describe)
{
    Stria__V1__HeartbeatRequest req = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    Stria__V1__GetStatusRequest sq = STRIA__V1__GET_STATUS_REQUEST__INIT;
    Stria__V1__WorkerJobStatus js = STRIA__V1__WORKER_JOB_STATUS__INIT, *jp = &js;
    Stria__V1__HeldJob hj = STRIA__V1__HELD_JOB__INIT, *hp = &hj;
    uint8_t sealed[2][STRIA_AUTH_SEALED_BYTES];
    stria_rpc_reply_t rep;
    /* the session of the workers' connection: what the keys are sealed in */
    cr_assert_eq(fx_call(fx->wk, M_STATUS, &sq.base, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_auth_session_t session = rep.session;
    stria_rpc_reply_free(&rep);
    cr_assert_eq(stria_auth_seal(&session, secret_purpose, h->id, h->secret.bytes, sealed[0]),
                 STRIA_OK);
    cr_assert_eq(stria_auth_seal(&session, "held ring key", h->id, h->ring_key, sealed[1]),
                 STRIA_OK);
    hj.job_id = h->id;
    hj.rank = rank;
    hj.spec = (Stria__V1__JobSpec *)&h->spec;
    hj.phase = phase;
    hj.replaces = h->replaces;
    hj.generation = h->generation;
    hj.job_secret.data = sealed[0];
    hj.job_secret.len = sizeof(sealed[0]);
    hj.ring_key.data = sealed[1];
    hj.ring_key.len = sizeof(sealed[1]);
    js.job_id = h->id;
    js.phase = phase;
    req.worker_id = w.id;
    req.incarnation = w.incarnation;
    req.n_jobs = 1;
    req.jobs = &jp;
    req.n_held_jobs = 1;
    req.held_jobs = &hp;
    stria_status_t st = fx_call(fx->wk, M_HEARTBEAT, &req.base, &rep);
    if (st != STRIA_OK)
        return st;
    Stria__V1__HeartbeatReply *r = (Stria__V1__HeartbeatReply *)rep.msg;
    *n_drop = r->n_drop_job_ids;
    *describe = r->describe_jobs;
    stria_rpc_reply_free(&rep);
    return STRIA_OK;
}

/* GetJob of h's id proving `secret`. */
static stria_status_t get_held(const fx_t *fx, const held_t *h, const stria_job_secret_t *secret,
                               Stria__V1__JobState *state, char *failure, size_t cap)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.job_id = h->id;
    stria_status_t st = fx_call_job(fx->user, M_GET_JOB, &req.base, h->id, secret, &rep);
    if (st == STRIA_OK) {
        const Stria__V1__JobInfo *info = ((Stria__V1__GetJobReply *)rep.msg)->job;
        *state = info->state;
        snprintf(failure, cap, "%s", info->failure);
    }
    stria_rpc_reply_free(&rep);
    return st;
}

Test(coord, restart_rebuilds_jobs_from_the_workers, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    size_t n_drop = 0;
    bool describe = false;
    char failure[512];
    Stria__V1__JobState state = 0;
    g_recovery_window_s = 1.5;
    fx_start(&fx, 1.0, 60, "client-secret", "admin-secret");
    g_recovery_window_s = -1;
    wk_t a = reg_worker(&fx, "h", 7100, 1ull << 30), b = reg_worker(&fx, "h", 7101, 1ull << 30);
    held_t h;
    held_init(&h, 123456789, 2);
    h.spec.label = (char *)"before the restart";

    /* rank 0 described: not known yet to clients (busy), kept by the worker */
    cr_assert_eq(
        heartbeat_held(&fx, a, &h, 0, JS(FORWARD_DONE), "held job secret", &n_drop, &describe),
        STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(n_drop, 0u);
    cr_expect_not(describe);
    cr_expect_eq(get_held(&fx, &h, &h.secret, &state, failure, sizeof(failure)), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "rebuilds its jobs") != NULL, "%s", stria_error_msg());

    /* rank 1 too: the job is back, in the state of its slowest rank */
    cr_assert_eq(heartbeat_held(&fx, b, &h, 1, JS(DONE), "held job secret", &n_drop, &describe),
                 STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(n_drop, 0u);
    cr_assert_eq(get_held(&fx, &h, &h.secret, &state, failure, sizeof(failure)), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(state, JS(FORWARD_DONE));
    stria_rpc_reply_t rep;
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    gq.job_id = h.id;
    cr_assert_eq(fx_call_job(fx.user, M_GET_JOB, &gq.base, h.id, &h.secret, &rep), STRIA_OK);
    const Stria__V1__Assignment *as = ((Stria__V1__GetJobReply *)rep.msg)->job->assignment;
    cr_expect_eq(as->n_ranks, 2u);
    cr_expect_eq(as->ranks[0]->worker_id, a.id);
    cr_expect_eq(as->ranks[1]->worker_id, b.id);
    cr_expect_str_eq(as->spec->label, "before the restart");
    stria_rpc_reply_free(&rep);

    /* only its secret opens it: another tenant's proof is refused */
    stria_job_secret_t other;
    cr_assert_eq(stria_job_secret_generate(&other), STRIA_OK);
    cr_expect_eq(get_held(&fx, &h, &other, &state, failure, sizeof(failure)), STRIA_ERR_AUTH);
    cr_expect_eq(get_held(&fx, &h, NULL, &state, failure, sizeof(failure)), STRIA_ERR_AUTH);

    /* the next heartbeats keep it; the owner releases it */
    uint64_t id = h.id, drop[8];
    cr_expect_eq(heartbeat(&fx, a, &id, 1, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 0u);
    Stria__V1__ReleaseJobRequest rq = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    rq.job_id = h.id;
    cr_expect_eq(fx_call_job(fx.user, M_RELEASE, &rq.base, h.id, &h.secret, &rep), STRIA_OK);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(heartbeat(&fx, a, &id, 1, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 1u, "released: dropped");
    fx_stop(&fx);
}

/* A rebuilt replacement links the job it replaces again: that job comes
 * back failed, naming it, and opens with the replacement's secret; a
 * replacement naming a known job of another secret links nothing. */
Test(coord, restart_links_a_replacement_to_its_job, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    size_t n_drop = 0;
    bool describe = false;
    char failure[512], want[64];
    Stria__V1__JobState state = 0;
    g_recovery_window_s = 1.5;
    fx_start(&fx, 1.0, 60, "client-secret", "admin-secret");
    g_recovery_window_s = -1;
    wk_t a = reg_worker(&fx, "h", 7300, 1ull << 30), b = reg_worker(&fx, "h", 7301, 1ull << 30);
    held_t y, x, other, forged;
    held_init(&y, 7770002, 2);
    y.replaces = 7770001;
    y.generation = 1;
    x = y; /* the replaced job: the replacement's secret */
    x.id = y.replaces;
    for (uint32_t r = 0; r < 2; r++)
        cr_assert_eq(heartbeat_held(&fx, r ? b : a, &y, r, JS(FORWARD_DONE), "held job secret",
                                    &n_drop, &describe),
                     STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(get_held(&fx, &x, &x.secret, &state, failure, sizeof(failure)), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(state, JS(FAILED));
    snprintf(want, sizeof(want), "replaced by job %llu", (unsigned long long)y.id);
    cr_expect(strstr(failure, want) != NULL, "%s", failure);
    cr_expect_eq(get_held(&fx, &y, &y.secret, &state, failure, sizeof(failure)), STRIA_OK);
    cr_expect_eq(state, JS(FORWARD_DONE));

    /* a known job of another secret is left alone */
    held_init(&other, 7770011, 2);
    held_init(&forged, 7770012, 2);
    forged.replaces = other.id;
    forged.generation = 1;
    for (uint32_t r = 0; r < 2; r++)
        cr_assert_eq(heartbeat_held(&fx, r ? b : a, &other, r, JS(LOADING), "held job secret",
                                    &n_drop, &describe),
                     STRIA_OK);
    for (uint32_t r = 0; r < 2; r++)
        cr_assert_eq(heartbeat_held(&fx, r ? b : a, &forged, r, JS(LOADING), "held job secret",
                                    &n_drop, &describe),
                     STRIA_OK);
    cr_assert_eq(get_held(&fx, &other, &other.secret, &state, failure, sizeof(failure)), STRIA_OK);
    cr_expect_eq(state, JS(LOADING), "a forged link failed job %llu: %s",
                 (unsigned long long)other.id, failure);
    fx_stop(&fx);
}

Test(coord, restart_refuses_bad_descriptions, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    size_t n_drop = 0;
    bool describe = false;
    char failure[512];
    Stria__V1__JobState state = 0;
    g_recovery_window_s = 1.0;
    fx_start(&fx, 1.0, 60, "client-secret", "admin-secret");
    g_recovery_window_s = -1;
    wk_t a = reg_worker(&fx, "h", 7200, 1ull << 30), b = reg_worker(&fx, "h", 7201, 1ull << 30),
         c = reg_worker(&fx, "h", 7202, 1ull << 30);
    held_t h, bad;
    held_init(&h, 5550001, 2);

    /* nonsense: the worker is told to drop it, the coordinator serves on */
    held_init(&bad, 5550002, 2);
    bad.spec.head_dim = 12;
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a bad spec is refused");
    held_init(&bad, 5550003, 2);
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 2, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "rank 2 of a ring of 2 is refused");
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(UNSPECIFIED), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a phase outside LOADING .. DONE is refused");
    held_init(&bad, 0, 2);
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "job id 0 is refused");
    held_init(&bad, 5550004, 2);
    bad.replaces = 5550001;
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a replacement of generation 0 is refused");
    bad.replaces = bad.id;
    bad.generation = 1;
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a job replacing itself is refused");
    /* keys sealed for something else: not opened, asked again */
    cr_assert_eq(heartbeat_held(&fx, a, &h, 0, JS(LOADING), "job secret", &n_drop, &describe),
                 STRIA_OK);
    cr_expect_eq(n_drop, 0u);
    cr_expect(describe, "keys that do not open are asked for again");

    /* the first description fixes spec and keys; a later one that differs,
     * or a second worker for a rank, is refused */
    cr_assert_eq(heartbeat_held(&fx, a, &h, 0, JS(LOADING), "held job secret", &n_drop, &describe),
                 STRIA_OK);
    cr_expect_eq(n_drop, 0u);
    cr_expect_not(describe);
    held_t forged = h;
    cr_assert_eq(stria_job_secret_generate(&forged.secret), STRIA_OK);
    cr_assert_eq(
        heartbeat_held(&fx, b, &forged, 1, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "another secret for the same job is refused");
    held_t other_spec = h;
    other_spec.spec.heads = 8;
    cr_assert_eq(
        heartbeat_held(&fx, b, &other_spec, 1, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "another spec for the same job is refused");
    cr_assert_eq(heartbeat_held(&fx, c, &h, 0, JS(LOADING), "held job secret", &n_drop, &describe),
                 STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a second worker for rank 0 is refused");
    cr_expect_eq(get_held(&fx, &forged, &forged.secret, &state, failure, sizeof(failure)),
                 STRIA_ERR_BUSY, "the forged description did not make a job");

    /* rank 1 never comes: after the window the job fails, naming it, and
     * the worker of rank 0 is told to drop it */
    usleep(1300000);
    cr_assert_eq(get_held(&fx, &h, &h.secret, &state, failure, sizeof(failure)), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(state, JS(FAILED));
    cr_expect(strstr(failure, "rank(s) 1 ") != NULL && strstr(failure, "recovery window"), "%s",
              failure);
    uint64_t id = h.id, drop[8];
    cr_expect_eq(heartbeat(&fx, a, &id, 1, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 1u);
    /* after the window a description is refused outright (dropped) */
    held_t late;
    held_init(&late, 5550009, 2);
    cr_assert_eq(
        heartbeat_held(&fx, a, &late, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u);
    cr_expect_eq(get_held(&fx, &late, &late.secret, &state, failure, sizeof(failure)),
                 STRIA_ERR_NOT_FOUND);
    fx_stop(&fx);
}
