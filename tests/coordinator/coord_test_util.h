/* Helpers of the coordinator suites (test_coordinator_*): the fixture (an
 * in-process coordinator, or the daemon as a process, with the admin's, the
 * workers' and a client's connections), workers played by the test through
 * the Coordinator service itself, and submissions whose job secrets are
 * kept for the job-scoped calls. Static inline: each suite is one file. */
#ifndef STRIA_TEST_COORD_TEST_UTIL_H
#define STRIA_TEST_COORD_TEST_UTIL_H

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

static inline const stria_job_secret_t *secret_of(uint64_t id)
{
    for (size_t i = 0; i < g_n_jobs; i++)
        if (g_jobs[i].id == id)
            return &g_jobs[i].secret;
    return NULL;
}

static inline stria_rpc_client_t *fx_connect(const fx_t *fx, const char *token, stria_status_t *st)
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

static inline void fx_start(fx_t *fx, double hb, double ttl, const char *token, const char *admin)
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

static inline void fx_stop(fx_t *fx)
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

static inline stria_status_t fx_call(stria_rpc_client_t *cl, uint32_t method,
                                     const ProtobufCMessage *req, stria_rpc_reply_t *rep)
{
    stria_rpc_request_t r = {.method = method, .request = req, .timeout_s = 10};
    memset(rep, 0, sizeof(*rep));
    return stria_rpc_client_call(cl, &r, rep);
}

/* A job-scoped call proving `secret` (NULL: no proof). */
static inline stria_status_t fx_call_job(stria_rpc_client_t *cl, uint32_t method,
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
static inline wk_t reg_worker_was(const fx_t *fx, const char *host, int port, uint64_t memory,
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

static inline wk_t reg_worker(const fx_t *fx, const char *host, int port, uint64_t memory)
{
    return reg_worker_was(fx, host, port, memory, 0);
}

/* A heartbeat reporting the given jobs; drop ids come back in drop[]. */
static inline stria_status_t heartbeat(const fx_t *fx, wk_t w, const uint64_t *jobs, size_t n_jobs,
                                       uint32_t idle_ms, uint64_t *drop, size_t *n_drop,
                                       bool *rejoined)
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

static inline Stria__V1__JobSpec spec_default(void)
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

/* Per-rank memory of spec_default() on n ranks: the pass and one call's
 * region (max_held 0). */
static inline uint64_t mem_default(int n)
{
    uint64_t m = 0;
    cr_assert_eq(stria_session_rank_memory(1, (1024 + n - 1) / n, 4, 2, 64, STRIA_DTYPE_F32, 0, &m),
                 STRIA_OK);
    return m;
}

static inline stria_status_t submit(const fx_t *fx, const Stria__V1__JobSpec *s,
                                    stria_rpc_reply_t *rep)
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
static inline uint64_t submit_ok(const fx_t *fx, const Stria__V1__JobSpec *s,
                                 Stria__V1__JobState want)
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
static inline Stria__V1__JobInfo *get_job(const fx_t *fx, uint64_t id, stria_rpc_reply_t *rep)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    req.job_id = id;
    cr_assert_eq(fx_call_job(fx->user, M_GET_JOB, &req.base, id, secret_of(id), rep), STRIA_OK,
                 "%s", stria_error_msg());
    return ((Stria__V1__GetJobReply *)rep->msg)->job;
}

static inline Stria__V1__JobState job_state(const fx_t *fx, uint64_t id)
{
    stria_rpc_reply_t rep;
    Stria__V1__JobState s = get_job(fx, id, &rep)->state;
    stria_rpc_reply_free(&rep);
    return s;
}

static inline stria_status_t release(const fx_t *fx, uint64_t id)
{
    Stria__V1__ReleaseJobRequest req = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    stria_status_t st;
    req.job_id = id;
    st = fx_call_job(fx->user, M_RELEASE, &req.base, id, secret_of(id), &rep);
    stria_rpc_reply_free(&rep);
    return st;
}

static inline stria_status_t report(const fx_t *fx, wk_t w, uint64_t job, uint32_t rank, int event,
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
static inline size_t ring_ids(const fx_t *fx, uint64_t *ids, size_t cap, int *states)
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
static inline bool wait_until(const fx_t *fx, const wk_t *keep, size_t n_keep,
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
static inline Stria__V1__JobState job_state_quiet(const fx_t *fx, uint64_t id)
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

static inline bool pred_ring_len(const fx_t *fx, void *arg)
{
    uint64_t ids[16];
    return ring_ids(fx, ids, 16, NULL) == *(size_t *)arg;
}

#endif
