/* Security of the service, with the real daemons on loopback, each test
 * written as the attack: another client's job read, overwritten, run or
 * dropped; a client (or an admin) acting as a worker; every method with a
 * missing, wrong or other role's credential and job secret; blocks injected
 * into a running pass over a worker's ring port; listeners beyond loopback
 * without credentials; and the credentials never in a log. See
 * docs/SECURITY.md. */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy_util.h"
#include "stria.pb-c.h"
#include "stria_auth.h"
#include "stria_rpc.h"
#include "tcheck.h"
#include "tjob.h"

#define SUITE_TIMEOUT 300

/* ---- credentials ------------------------------------------------------------ */

typedef struct {
    char dir[256];
    char path[3][300];  /* client, worker, admin */
    char token[3][128]; /* their contents */
} creds_t;

enum { CLIENT = 0, WORKER = 1, ADMIN = 2 };

/* New credentials in c->dir/credentials, made by the coordinator. */
static void make_creds(const dcluster_t *c, creds_t *cr)
{
    static const char *const names[3] = {"client-token", "worker-token", "admin-token"};
    snprintf(cr->dir, sizeof(cr->dir), "%s/credentials", c->dir);
    char *argv[] = {STRIA_COORDINATOR_BIN, "--gen-credentials", cr->dir, NULL};
    char *err = NULL;
    cr_assert_eq(dc_run(argv, NULL, 30, NULL, &err), 0, "--gen-credentials: %s", err);
    free(err);
    for (int i = 0; i < 3; i++) {
        snprintf(cr->path[i], sizeof(cr->path[i]), "%s/%s", cr->dir, names[i]);
        char *t = dc_read(cr->path[i]);
        t[strcspn(t, "\n")] = '\0';
        snprintf(cr->token[i], sizeof(cr->token[i]), "%s", t);
        free(t);
    }
}

static dc_opts_t secure(const creds_t *cr)
{
    /* Heartbeats with slack (dead after 3 s): these tests run an attacker
     * and several clusters at once on a small machine. */
    dc_opts_t o = {.heartbeat_period_s = 1.0,
                   .token_file = cr->path[CLIENT],
                   .worker_token_file = cr->path[WORKER],
                   .admin_token_file = cr->path[ADMIN]};
    return o;
}

/* ---- raw RPC ------------------------------------------------------------------ */

static stria_rpc_client_t *rpc_open(const char *addr, const ProtobufCServiceDescriptor *svc,
                                    const char *token, stria_status_t *st)
{
    stria_rpc_client_params_t p = {0};
    stria_rpc_client_t *cl = NULL;
    p.address = addr;
    p.service = svc;
    p.token = token;
    p.client_name = "test_security";
    p.connect_timeout_s = 5;
    *st = stria_rpc_client_connect(&p, &cl);
    return cl;
}

/* One call; proves `secret` for `job` unless NULL. The reply goes to *rep
 * (freed here when rep is NULL). */
static stria_status_t rpc_call(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                               const void *payload, uint64_t len, const stria_job_secret_t *secret,
                               uint64_t job, stria_rpc_reply_t *rep)
{
    stria_rpc_request_t r = {.method = method,
                             .request = req,
                             .payload = payload,
                             .payload_len = len,
                             .timeout_s = 10,
                             .job_secret = secret,
                             .job_id = job};
    stria_rpc_reply_t tmp = {0};
    stria_status_t st = stria_rpc_client_call(cl, &r, rep != NULL ? rep : &tmp);
    if (rep == NULL)
        stria_rpc_reply_free(&tmp);
    return st;
}

/* ---- a job held by its owner ------------------------------------------------- */

typedef struct {
    stria_client_t *client;
    stria_job_t *job;
    tjob_t t; /* fp32: the values are the inputs */
} owned_t;

/* Submits a causal fp32 job (kv_heads = heads) with `token` and runs its
 * forward pass; the job stays open. */
static void owned_start(owned_t *j, const dcluster_t *c, const char *token, int64_t seq,
                        int64_t heads, int64_t dim, int ring)
{
    stria_client_params_t p = {0};
    memset(j, 0, sizeof(*j));
    p.struct_size = sizeof(p);
    p.coordinator = c->coord_addr;
    p.token = token;
    p.client_name = "owner";
    p.rpc_timeout_s = 60;
    cr_assert_eq(stria_client_connect(&p, &j->client), STRIA_OK, "%s", stria_error_msg());
    cr_assert(tjob_init(&j->t, 1, seq, heads, heads, dim, STRIA_DTYPE_F32, true, 700),
              "out of memory");
    j->t.spec.ring_size = ring;
    j->t.spec.step_timeout_s = 60;
    cr_assert_eq(stria_client_forward(j->client, &j->t.spec, j->t.q, j->t.k, j->t.v, j->t.o,
                                      j->t.lse, NULL, NULL, NULL, &j->job),
                 STRIA_OK, "the owner's forward: %s", stria_error_msg());
}

/* The owner's backward pass; every output against the fp64 reference (the
 * tolerance of the kernels' tests), then the release. */
static void owned_finish(owned_t *j)
{
    cr_assert_eq(stria_client_backward(j->job, j->t.g, j->t.dq, j->t.dk, j->t.dv, NULL, NULL, NULL),
                 STRIA_OK, "the owner's backward: %s", stria_error_msg());
    tcheck_job(&j->t, true, false, "the owner's job");
    cr_expect_eq(stria_client_release(j->job), STRIA_OK, "%s", stria_error_msg());
    j->job = NULL;
    stria_client_close(j->client);
    tjob_free(&j->t);
}

/* ---- another client's job ------------------------------------------------------ */

/* The job-scoped requests of the Worker service, as an attacker sends them
 * for `job` on `rank`: a forward call (inputs of its own over the owner's,
 * a pass run), a backward of the owner's held forward (its outputs read),
 * a piece of a call's inputs, the held forward let go, the job dropped, its
 * rank opened. */
#define N_ATTEMPTS 6
static const char *const attempt_names[N_ATTEMPTS] = {"SessionCall",
                                                      "SessionCall (held backward)",
                                                      "SessionCall (a piece)",
                                                      "DropJob (held forward)",
                                                      "DropJob",
                                                      "OpenSession"};

static stria_status_t worker_attempt(stria_rpc_client_t *w, int m, uint64_t job, uint32_t rank,
                                     const stria_job_secret_t *secret)
{
    static uint8_t zeros[4096];
    Stria__V1__DropJobRequest dr = STRIA__V1__DROP_JOB_REQUEST__INIT;
    Stria__V1__OpenSessionRequest os = STRIA__V1__OPEN_SESSION_REQUEST__INIT;
    Stria__V1__SessionCallRequest sc = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    Stria__V1__CallShape shape = STRIA__V1__CALL_SHAPE__INIT;
    dr.job_id = os.job_id = sc.job_id = job;
    dr.rank = os.rank = sc.rank = rank;
    shape.batch = 1;
    shape.seq_len = 64;
    sc.shape = &shape; /* a call with inputs: its proof is checked before they are read */
    switch (m) {
    case 0:
        return rpc_call(w, STRIA_RPC_WORKER_SESSION_CALL, &sc.base, zeros, sizeof(zeros), secret,
                        job, NULL);
    case 1:
        sc.backward = sc.use_held = true; /* the owner's forward is call 0 */
        return rpc_call(w, STRIA_RPC_WORKER_SESSION_CALL, &sc.base, zeros, 1024, secret, job, NULL);
    case 2:
        sc.more = true;
        return rpc_call(w, STRIA_RPC_WORKER_SESSION_CALL, &sc.base, zeros, 1024, secret, job, NULL);
    case 3:
        dr.release_held = true;
        return rpc_call(w, STRIA_RPC_WORKER_DROP_JOB, &dr.base, NULL, 0, secret, job, NULL);
    case 4:
        return rpc_call(w, STRIA_RPC_WORKER_DROP_JOB, &dr.base, NULL, 0, secret, job, NULL);
    default:
        return rpc_call(w, STRIA_RPC_WORKER_OPEN_SESSION, &os.base, NULL, 0, secret, job, NULL);
    }
}

/* Whether a text holds any of the credentials. */
static void expect_no_token(const creds_t *cr, const char *what, const char *text)
{
    for (int i = 0; i < 3; i++)
        cr_expect(strstr(text, cr->token[i]) == NULL, "%s shows a credential", what);
}

Test(security, another_clients_job_cannot_be_read_overwritten_run_or_dropped,
     .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    creds_t cr;
    dc_init(&c);
    make_creds(&c, &cr);
    dc_opts_t o = secure(&cr);
    dc_start_coordinator(&c, &o);
    for (int i = 0; i < 2; i++)
        dc_start_worker(&c, i, &o);
    dc_wait_healthy(&c, 2, cr.path[CLIENT]);
    owned_t own;
    owned_start(&own, &c, cr.token[CLIENT], 256, 2, 16, 2);
    uint64_t id = stria_job_id(own.job);

    /* The attacker holds the client credential too. It learns the job's id
     * from the workers' list, as any client may. */
    stria_status_t st;
    stria_rpc_client_t *co =
        rpc_open(c.coord_addr, &stria__v1__coordinator__descriptor, cr.token[CLIENT], &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    Stria__V1__ListWorkersRequest lw = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    cr_assert_eq(rpc_call(co, STRIA_RPC_COORDINATOR_LIST_WORKERS, &lw.base, NULL, 0, NULL, 0, &rep),
                 STRIA_OK, "%s", stria_error_msg());
    const Stria__V1__ListWorkersReply *lr = (const Stria__V1__ListWorkersReply *)rep.msg;
    bool listed = false;
    for (size_t w = 0; w < lr->n_workers; w++)
        for (size_t k = 0; k < lr->workers[w]->n_job_ids; k++)
            listed |= lr->workers[w]->job_ids[k] == id;
    stria_rpc_reply_free(&rep);
    cr_expect(listed, "the job's id is public (ListWorkers); its secret must be what protects it");

    /* At the coordinator: view, renew, release, without and with a guessed
     * secret. */
    stria_job_secret_t guess;
    stria_auth_random(guess.bytes, sizeof(guess.bytes));
    const stria_job_secret_t *secrets[2] = {NULL, &guess};
    Stria__V1__GetJobRequest gj = STRIA__V1__GET_JOB_REQUEST__INIT;
    Stria__V1__ReleaseJobRequest rl = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    gj.job_id = rl.job_id = id;
    for (int s = 0; s < 2; s++) {
        cr_expect_eq(
            rpc_call(co, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, NULL, 0, secrets[s], id, NULL),
            STRIA_ERR_AUTH, "GetJob of another client's job (%s secret)", s ? "a guessed" : "no");
        cr_expect_eq(rpc_call(co, STRIA_RPC_COORDINATOR_RELEASE_JOB, &rl.base, NULL, 0, secrets[s],
                              id, NULL),
                     STRIA_ERR_AUTH, "ReleaseJob of another client's job (%s secret)",
                     s ? "a guessed" : "no");
    }

    /* At each worker: every job-scoped method on each rank, without and
     * with a guessed secret. None may succeed; on the rank a worker holds
     * the refusal is the secret's. */
    for (int w = 0; w < 2; w++) {
        stria_rpc_client_t *wc =
            rpc_open(c.worker_rpc[w], &stria__v1__worker__descriptor, cr.token[CLIENT], &st);
        cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
        for (int m = 0; m < N_ATTEMPTS; m++) {
            int auth = 0;
            for (uint32_t r = 0; r < 2; r++)
                for (int s = 0; s < 2; s++) {
                    st = worker_attempt(wc, m, id, r, secrets[s]);
                    cr_expect_neq(st, STRIA_OK, "%s of another client's job on worker %d rank %u",
                                  attempt_names[m], w, r);
                    auth += st == STRIA_ERR_AUTH;
                }
            cr_expect_geq(auth, 2, "%s on worker %d: not refused for the secret", attempt_names[m],
                          w);
        }
        stria_rpc_client_close(wc);
    }
    stria_rpc_client_close(co);

    /* An admin may view any job (without renewing it) but not release it. */
    stria_rpc_client_t *adm =
        rpc_open(c.coord_addr, &stria__v1__coordinator__descriptor, cr.token[ADMIN], &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rpc_call(adm, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, NULL, 0, NULL, id, NULL),
                 STRIA_OK, "an admin views any job: %s", stria_error_msg());
    cr_expect_eq(
        rpc_call(adm, STRIA_RPC_COORDINATOR_RELEASE_JOB, &rl.base, NULL, 0, NULL, id, NULL),
        STRIA_ERR_AUTH);
    stria_rpc_client_close(adm);

    /* The owner's job is whole: its backward and every output are right. */
    owned_finish(&own);

    /* No credential in any log or in what striactl prints. */
    char *out = NULL, *err = NULL;
    char idtext[32];
    snprintf(idtext, sizeof(idtext), "%llu", (unsigned long long)id);
    cr_expect_eq(dc_striactl(&c, cr.path[ADMIN], &out, &err, "--json", "job", idtext, NULL), 0,
                 "%s", err);
    expect_no_token(&cr, "striactl job", out);
    free(out), free(err);
    cr_expect_eq(dc_striactl(&c, cr.path[CLIENT], &out, &err, "job", idtext, NULL), 4,
                 "a client views only its own jobs: %s", out);
    expect_no_token(&cr, "striactl's refusal", err);
    free(out), free(err);
    char *logs[3] = {dc_read(c.coord_log), dc_read(c.worker_log[0]), dc_read(c.worker_log[1])};
    for (int i = 0; i < 3; i++) {
        expect_no_token(&cr, i ? "a worker's log" : "the coordinator's log", logs[i]);
        free(logs[i]);
    }
    dc_stop(&c);
}

/* ---- acting as a worker ---------------------------------------------------------- */

Test(security, a_client_or_admin_credential_cannot_act_as_a_worker, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    creds_t cr;
    dc_init(&c);
    make_creds(&c, &cr);
    dc_opts_t o = secure(&cr);
    dc_start_coordinator(&c, &o);
    for (int i = 0; i < 2; i++)
        dc_start_worker(&c, i, &o);
    dc_wait_healthy(&c, 2, cr.path[CLIENT]);
    owned_t own;
    owned_start(&own, &c, cr.token[CLIENT], 128, 2, 16, 2);
    uint64_t id = stria_job_id(own.job);

    stria_status_t st;
    stria_rpc_client_t *adm =
        rpc_open(c.coord_addr, &stria__v1__coordinator__descriptor, cr.token[ADMIN], &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    Stria__V1__ListWorkersRequest lw = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    cr_assert_eq(
        rpc_call(adm, STRIA_RPC_COORDINATOR_LIST_WORKERS, &lw.base, NULL, 0, NULL, 0, &rep),
        STRIA_OK);
    const Stria__V1__ListWorkersReply *lr = (const Stria__V1__ListWorkersReply *)rep.msg;
    cr_assert_eq(lr->n_workers, 2);
    const Stria__V1__WorkerInfo *victim = lr->workers[0];
    uint64_t victim_id = victim->worker_id, victim_mem = victim->memory_bytes;
    char rpc_addr[256], ucx_addr[256];
    snprintf(rpc_addr, sizeof(rpc_addr), "%s", victim->rpc_address);
    snprintf(ucx_addr, sizeof(ucx_addr), "%s", victim->ucx_address);
    stria_rpc_reply_free(&rep);

    /* Register over the live worker (its address, huge memory), heartbeat
     * in its name, fail the owner's job, deregister it: with the client
     * credential and with the admin one. */
    const int roles[2] = {CLIENT, ADMIN};
    for (int k = 0; k < 2; k++) {
        stria_rpc_client_t *cl =
            rpc_open(c.coord_addr, &stria__v1__coordinator__descriptor, cr.token[roles[k]], &st);
        cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
        Stria__V1__RegisterWorkerRequest rw = STRIA__V1__REGISTER_WORKER_REQUEST__INIT;
        rw.rpc_address = rpc_addr;
        rw.ucx_address = ucx_addr;
        rw.host = (char *)"impostor";
        rw.device = (char *)"cpu";
        rw.memory_bytes = 1ull << 50;
        rw.incarnation = 42;
        Stria__V1__HeartbeatRequest hb = STRIA__V1__HEARTBEAT_REQUEST__INIT;
        hb.worker_id = victim_id;
        Stria__V1__ReportJobRequest rj = STRIA__V1__REPORT_JOB_REQUEST__INIT;
        rj.worker_id = victim_id;
        rj.job_id = id;
        rj.event = STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED;
        rj.message = (char *)"forged";
        Stria__V1__DeregisterWorkerRequest dw = STRIA__V1__DEREGISTER_WORKER_REQUEST__INIT;
        dw.worker_id = victim_id;
        const struct {
            uint32_t m;
            const ProtobufCMessage *req;
            const char *name;
        } calls[4] = {{STRIA_RPC_COORDINATOR_REGISTER_WORKER, &rw.base, "RegisterWorker"},
                      {STRIA_RPC_COORDINATOR_HEARTBEAT, &hb.base, "Heartbeat"},
                      {STRIA_RPC_COORDINATOR_REPORT_JOB, &rj.base, "ReportJob"},
                      {STRIA_RPC_COORDINATOR_DEREGISTER_WORKER, &dw.base, "DeregisterWorker"}};
        for (int i = 0; i < 4; i++) {
            st = rpc_call(cl, calls[i].m, calls[i].req, NULL, 0, NULL, 0, NULL);
            cr_expect_eq(st, STRIA_ERR_AUTH, "%s with the %s credential: %s", calls[i].name,
                         k ? "admin" : "client", stria_error_msg());
            cr_expect(strstr(stria_error_msg(), "needs the worker token") != NULL, "%s",
                      stria_error_msg());
        }
        stria_rpc_client_close(cl);
    }

    /* Nothing changed: the same two workers, the victim's memory as it
     * registered, the owner's job whole. */
    cr_assert_eq(
        rpc_call(adm, STRIA_RPC_COORDINATOR_LIST_WORKERS, &lw.base, NULL, 0, NULL, 0, &rep),
        STRIA_OK);
    lr = (const Stria__V1__ListWorkersReply *)rep.msg;
    cr_expect_eq(lr->n_workers, 2);
    for (size_t w = 0; w < lr->n_workers; w++) {
        cr_expect_eq(lr->workers[w]->state, STRIA__V1__WORKER_STATE__WORKER_STATE_HEALTHY);
        cr_expect_str_neq(lr->workers[w]->host, "impostor");
        if (lr->workers[w]->worker_id == victim_id)
            cr_expect_eq(lr->workers[w]->memory_bytes, victim_mem);
    }
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(adm);
    owned_finish(&own);
    dc_stop(&c);
}

/* ---- every method, every credential -------------------------------------------------- */

/* Who may call each Coordinator method (bit i: role i of CLIENT, WORKER,
 * ADMIN), in the service's order. */
static const unsigned coord_roles[STRIA_RPC_COORDINATOR_N_METHODS] = {
    [STRIA_RPC_COORDINATOR_REGISTER_WORKER] = 1u << WORKER,
    [STRIA_RPC_COORDINATOR_HEARTBEAT] = 1u << WORKER,
    [STRIA_RPC_COORDINATOR_REPORT_JOB] = 1u << WORKER,
    [STRIA_RPC_COORDINATOR_SUBMIT_JOB] = 1u << CLIENT | 1u << ADMIN,
    [STRIA_RPC_COORDINATOR_GET_JOB] = 1u << WORKER | 1u << ADMIN, /* clients: with the secret */
    [STRIA_RPC_COORDINATOR_RELEASE_JOB] = 0,                      /* with the secret only */
    [STRIA_RPC_COORDINATOR_CANCEL_JOB] = 1u << ADMIN,
    [STRIA_RPC_COORDINATOR_GET_STATUS] = 7,
    [STRIA_RPC_COORDINATOR_GET_RING] = 7,
    [STRIA_RPC_COORDINATOR_LIST_WORKERS] = 7,
    [STRIA_RPC_COORDINATOR_LIST_JOBS] = 1u << ADMIN,
    [STRIA_RPC_COORDINATOR_DRAIN_WORKER] = 1u << ADMIN,
    [STRIA_RPC_COORDINATOR_DEREGISTER_WORKER] = 1u << WORKER,
};

Test(security, every_method_checks_the_credential_its_role_and_the_job_secret,
     .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    creds_t cr;
    dc_init(&c);
    make_creds(&c, &cr);
    dc_opts_t o = secure(&cr);
    dc_start_coordinator(&c, &o);
    dc_start_worker(&c, 0, &o);
    dc_wait_healthy(&c, 1, cr.path[CLIENT]);
    owned_t own;
    owned_start(&own, &c, cr.token[CLIENT], 64, 2, 16, 1);
    uint64_t id = stria_job_id(own.job);
    stria_status_t st;

    /* No credential, or a wrong one: no hello, at either daemon. */
    const char *bad[2] = {NULL, "not-a-credential"};
    for (int b = 0; b < 2; b++) {
        cr_expect_null(rpc_open(c.coord_addr, &stria__v1__coordinator__descriptor, bad[b], &st));
        cr_expect_eq(st, STRIA_ERR_AUTH, "coordinator, %s: %s", bad[b] ? "wrong" : "none",
                     stria_error_msg());
        cr_expect_null(rpc_open(c.worker_rpc[0], &stria__v1__worker__descriptor, bad[b], &st));
        cr_expect_eq(st, STRIA_ERR_AUTH, "worker, %s: %s", bad[b] ? "wrong" : "none",
                     stria_error_msg());
    }
    /* A worker serves clients only: the worker and admin credentials are
     * not its clients'. */
    for (int r = WORKER; r <= ADMIN; r++) {
        cr_expect_null(rpc_open(c.worker_rpc[0], &stria__v1__worker__descriptor, cr.token[r], &st));
        cr_expect_eq(st, STRIA_ERR_AUTH);
    }

    /* Each role against each Coordinator method (requests with nothing in
     * them: a refusal other than the role's is fine where allowed). */
    ProtobufCMessage *reqs[STRIA_RPC_COORDINATOR_N_METHODS];
    const ProtobufCServiceDescriptor *svc = &stria__v1__coordinator__descriptor;
    for (unsigned m = 0; m < svc->n_methods; m++) {
        reqs[m] = calloc(1, svc->methods[m].input->sizeof_message);
        svc->methods[m].input->message_init(reqs[m]);
    }
    ((Stria__V1__GetJobRequest *)reqs[STRIA_RPC_COORDINATOR_GET_JOB])->job_id = id;
    ((Stria__V1__ReleaseJobRequest *)reqs[STRIA_RPC_COORDINATOR_RELEASE_JOB])->job_id = id;
    for (int r = CLIENT; r <= ADMIN; r++) {
        stria_rpc_client_t *cl = rpc_open(c.coord_addr, svc, cr.token[r], &st);
        cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
        for (unsigned m = 0; m < svc->n_methods; m++) {
            if (m == STRIA_RPC_COORDINATOR_SUBMIT_JOB || m == STRIA_RPC_COORDINATOR_CANCEL_JOB ||
                m == STRIA_RPC_COORDINATOR_DRAIN_WORKER)
                continue; /* below, with requests that do nothing harmful */
            st = rpc_call(cl, m, reqs[m], NULL, 0, NULL, 0, NULL);
            bool allowed = (coord_roles[m] >> r) & 1u;
            if (allowed)
                cr_expect_neq(st, STRIA_ERR_AUTH, "%s with the %d credential: %s",
                              svc->methods[m].name, r, stria_error_msg());
            else
                cr_expect_eq(st, STRIA_ERR_AUTH, "%s with the %d credential", svc->methods[m].name,
                             r);
        }
        /* Admin-only methods on a job and worker that do not exist: the
         * role is checked first. */
        Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
        Stria__V1__DrainWorkerRequest dw = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
        cj.job_id = 1;
        dw.worker_id = 99999;
        st = rpc_call(cl, STRIA_RPC_COORDINATOR_CANCEL_JOB, &cj.base, NULL, 0, NULL, 0, NULL);
        cr_expect_eq(st, r == ADMIN ? STRIA_ERR_NOT_FOUND : STRIA_ERR_AUTH, "CancelJob, role %d",
                     r);
        st = rpc_call(cl, STRIA_RPC_COORDINATOR_DRAIN_WORKER, &dw.base, NULL, 0, NULL, 0, NULL);
        cr_expect_eq(st, r == ADMIN ? STRIA_ERR_NOT_FOUND : STRIA_ERR_AUTH, "DrainWorker, role %d",
                     r);
        /* SubmitJob with an empty spec: refused for the spec, or the role. */
        st = rpc_call(cl, STRIA_RPC_COORDINATOR_SUBMIT_JOB, reqs[STRIA_RPC_COORDINATOR_SUBMIT_JOB],
                      NULL, 0, NULL, 0, NULL);
        cr_expect_eq(st, r == WORKER ? STRIA_ERR_AUTH : STRIA_ERR_INVALID_ARG, "SubmitJob, role %d",
                     r);
        stria_rpc_client_close(cl);
    }
    for (unsigned m = 0; m < svc->n_methods; m++)
        free(reqs[m]);

    /* The job-scoped calls of the owner's own job with a wrong secret (a
     * client's connection): refused everywhere, at the coordinator and the
     * worker; the owner's library, which proves it, works (its backward). */
    stria_job_secret_t wrong;
    stria_auth_random(wrong.bytes, sizeof(wrong.bytes));
    stria_rpc_client_t *cl = rpc_open(c.coord_addr, svc, cr.token[CLIENT], &st);
    cr_assert_eq(st, STRIA_OK);
    Stria__V1__GetJobRequest gj = STRIA__V1__GET_JOB_REQUEST__INIT;
    gj.job_id = id;
    st = rpc_call(cl, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, NULL, 0, &wrong, id, NULL);
    cr_expect_eq(st, STRIA_ERR_AUTH);
    cr_expect(strstr(stria_error_msg(), "wrong job secret") != NULL, "%s", stria_error_msg());
    stria_rpc_client_close(cl);
    stria_rpc_client_t *wc =
        rpc_open(c.worker_rpc[0], &stria__v1__worker__descriptor, cr.token[CLIENT], &st);
    cr_assert_eq(st, STRIA_OK);
    for (int m = 0; m < 7; m++) {
        cr_expect_eq(worker_attempt(wc, m, id, 0, &wrong), STRIA_ERR_AUTH, "worker method %d", m);
        cr_expect(strstr(stria_error_msg(), "wrong job secret") != NULL, "%s", stria_error_msg());
        cr_expect_eq(worker_attempt(wc, m, id, 0, NULL), STRIA_ERR_AUTH, "worker method %d", m);
        cr_expect(strstr(stria_error_msg(), "missing job secret proof") != NULL, "%s",
                  stria_error_msg());
    }
    stria_rpc_client_close(wc);
    owned_finish(&own);
    dc_stop(&c);
}

/* ---- the ring port ------------------------------------------------------------------- */

/* The value of a metric line that starts with `series` in a scrape (-1). */
static double metric_value(const char *text, const char *series)
{
    for (const char *p = text; (p = strstr(p, series)) != NULL; p++)
        if (p == text || p[-1] == '\n')
            return atof(p + strlen(series));
    return -1;
}

Test(security, blocks_injected_into_a_running_pass_are_dropped_and_counted,
     .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    creds_t cr;
    dc_init(&c);
    make_creds(&c, &cr);
    dc_opts_t o = secure(&cr);
    o.step_timeout_s = 120;
    /* The attacker keeps a core busy: heartbeats get slack (dead after 6 s,
     * not 0.6 s) so that a loaded machine does not fail the job. */
    o.heartbeat_period_s = 2.0;
    dc_start_coordinator(&c, &o);
    for (int i = 0; i < 2; i++)
        dc_start_worker(&c, i, &o);
    dc_wait_healthy(&c, 2, cr.path[CLIENT]);

    /* Worker 1's ring port, as anyone may read it from the coordinator. */
    stria_status_t st;
    stria_rpc_client_t *co =
        rpc_open(c.coord_addr, &stria__v1__coordinator__descriptor, cr.token[CLIENT], &st);
    cr_assert_eq(st, STRIA_OK);
    Stria__V1__ListWorkersRequest lw = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    cr_assert_eq(rpc_call(co, STRIA_RPC_COORDINATOR_LIST_WORKERS, &lw.base, NULL, 0, NULL, 0, &rep),
                 STRIA_OK);
    const Stria__V1__ListWorkersReply *lr = (const Stria__V1__ListWorkersReply *)rep.msg;
    char ucx_port[16] = "";
    for (size_t w = 0; w < lr->n_workers; w++)
        if (strcmp(lr->workers[w]->rpc_address, c.worker_rpc[1]) == 0)
            snprintf(ucx_port, sizeof(ucx_port), "%s",
                     strrchr(lr->workers[w]->ucx_address, ':') + 1);
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(co);
    cr_assert(ucx_port[0] != '\0');

    /* K/V blocks of the job's exact size with the ring engine's tags of the
     * first pass, at the first slots, again and again while the pass
     * runs; half with the reply flag, claiming to be rank 0. */
    const int64_t seq = STRIA_TEST_SANITIZE ? 2048 : 4096, heads = 2, dim = 64;
    char bytes[32];
    snprintf(bytes, sizeof(bytes), "%lld", (long long)(2 * (seq / 2) * heads * dim * 4));
    char log[300];
    snprintf(log, sizeof(log), "%s/attacker.log", c.dir);
    char *argv[] = {STRIA_UCX_RING_ATTACKER,
                    "--port",
                    ucx_port,
                    "--mode",
                    "inject",
                    "--engine-tags",
                    "--size",
                    "2",
                    "--slots",
                    "2",
                    "--passes",
                    "3",
                    "--bytes",
                    bytes,
                    "--repeat",
                    "--inflight",
                    "2",
                    "--duration",
                    "8",
                    NULL};
    char *env[] = {"UCX_TLS=tcp", "UCX_HANDLE_ERRORS=none", NULL};
    test_proc_t *atk = test_proc_start(argv, log, env);
    cr_assert_not_null(atk);
    usleep(300000);
    owned_t own;
    owned_start(&own, &c, cr.token[CLIENT], seq, heads, dim, 2);
    owned_finish(&own);
    char line[128];
    cr_expect(test_proc_wait_line(atk, "sent ", 20, line, sizeof(line)), "the attacker did not "
                                                                         "finish");
    test_proc_wait(atk, 10);
    cr_expect_gt(atol(line + 5), 0, "%s", line);

    /* The worker counted what it dropped (its metrics follow its heartbeat). */
    double dropped = -1;
    for (int i = 0; i < 50 && dropped <= 0; i++) {
        char *body = NULL;
        cr_assert_eq(dc_http_get(c.worker_metrics[1], "/metrics", &body), 200);
        dropped = metric_value(body, "stria_worker_ring_refused_total{reason=\"data_dropped\"} ");
        free(body);
        if (dropped <= 0)
            usleep(100000);
    }
    cr_expect_gt(dropped, 0, "worker 1 counted no dropped block");
    dc_stop(&c);
}

/* ---- safe defaults --------------------------------------------------------------------- */

/* Runs a daemon that must refuse to start: exit status 2, stderr with
 * every `want`. */
static void expect_refused(char *const argv[], const char *const *want)
{
    char *out = NULL, *err = NULL;
    int rc = dc_run(argv, NULL, 30, &out, &err);
    cr_expect_eq(rc, 2, "%s %s ... exited %d: %s", argv[0], argv[1], rc, err);
    for (; *want != NULL; want++)
        cr_expect(strstr(err, *want) != NULL, "%s %s ...: no '%s' in: %s", argv[0], argv[1], *want,
                  err);
    free(out), free(err);
}

/* Starts a daemon that must come up (its listening line), then stops it. */
static void expect_started(char *const argv[], const char *line_prefix, const char *log)
{
    char line[512];
    test_proc_t *p = test_proc_start(argv, log, NULL);
    cr_assert_not_null(p);
    bool up = test_proc_wait_line(p, line_prefix, 15, line, sizeof(line));
    char *text = up ? NULL : dc_read(log);
    cr_expect(up, "%s did not start:\n%s", argv[0], text);
    free(text);
    test_proc_stop(p, SIGTERM, 15);
}

Test(security, listening_beyond_loopback_needs_credentials, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    creds_t cr;
    dc_init(&c);
    make_creds(&c, &cr);
    char log[300], ctok[320], wtok[320];
    snprintf(log, sizeof(log), "%s/daemon.log", c.dir);
    snprintf(ctok, sizeof(ctok), "--client-token-file=%s", cr.path[CLIENT]);
    snprintf(wtok, sizeof(wtok), "--worker-token-file=%s", cr.path[WORKER]);
    const char *no_creds[] = {"refusing to listen", "--insecure", "--client-token-file", NULL};

    char *c1[] = {STRIA_COORDINATOR_BIN, "--listen", "0.0.0.0:0", NULL};
    expect_refused(c1, no_creds);
    char *c2[] = {STRIA_COORDINATOR_BIN, "--listen",  "127.0.0.1:0",
                  "--metrics-listen",    "0.0.0.0:0", NULL};
    expect_refused(c2, (const char *[]){"--metrics-listen 0.0.0.0:0", "refusing", NULL});
    char *c3[] = {STRIA_COORDINATOR_BIN, "--listen", "0.0.0.0:0", ctok, NULL};
    expect_refused(c3, (const char *[]){"--worker-token-file", NULL});
    char *c4[] = {STRIA_COORDINATOR_BIN, "--listen", "0.0.0.0:0", "--insecure", NULL};
    expect_started(c4, "stria-coordinator listening on ", log);
    char *c5[] = {STRIA_COORDINATOR_BIN, "--listen", "0.0.0.0:0", ctok, wtok, NULL};
    expect_started(c5, "stria-coordinator listening on ", log);

    char *w1[] = {STRIA_WORKER_BIN, "--coordinator", "127.0.0.1:9", "--listen",
                  "0.0.0.0:0",      "--advertise",   "127.0.0.1",   NULL};
    expect_refused(w1, no_creds);
    char *w2[] = {STRIA_WORKER_BIN, "--coordinator", "127.0.0.1:9",
                  "--ucx-listen",   "0.0.0.0:0",     NULL};
    expect_refused(w2, (const char *[]){"--ucx-listen 0.0.0.0:0", "refusing", NULL});
    char *w3[] = {STRIA_WORKER_BIN,   "--coordinator", "127.0.0.1:9",
                  "--metrics-listen", "0.0.0.0:0",     NULL};
    expect_refused(w3, (const char *[]){"--metrics-listen 0.0.0.0:0", "refusing", NULL});
    char *w4[] = {STRIA_WORKER_BIN, "--coordinator", "127.0.0.1:9", ctok, NULL};
    expect_refused(w4, (const char *[]){"--worker-token-file", NULL});
    char *w5[] = {
        STRIA_WORKER_BIN, "--coordinator", "127.0.0.1:9", "--listen", "0.0.0.0:0", "--advertise",
        "127.0.0.1",      "--insecure",    "--threads",   "1",        NULL};
    expect_started(w5, "stria-worker listening rpc=", log);

    /* The example configurations, as installed, name credential files: a
     * host without them does not start the daemons (the units then stop;
     * status 2 is not restarted). */
    char conf[512];
    snprintf(conf, sizeof(conf), "%s/deploy/config/coordinator.conf", STRIA_SOURCE_DIR);
    if (access("/etc/stria/credentials/client-token", F_OK) != 0) {
        char *e1[] = {STRIA_COORDINATOR_BIN, "--config", conf, NULL};
        expect_refused(e1, (const char *[]){"/etc/stria/credentials/client-token", NULL});
        snprintf(conf, sizeof(conf), "%s/deploy/config/worker.conf", STRIA_SOURCE_DIR);
        char *e2[] = {STRIA_WORKER_BIN, "--config", conf, NULL};
        expect_refused(e2, (const char *[]){"/etc/stria/credentials/client-token", NULL});
    }
    dc_stop(&c);
}

Test(security, gen_credentials_writes_private_distinct_tokens_once, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    creds_t cr;
    struct stat sb;
    dc_init(&c);
    make_creds(&c, &cr);
    cr_assert_eq(stat(cr.dir, &sb), 0);
    cr_expect_eq(sb.st_mode & 0777, 0700, "the folder is %o", sb.st_mode & 0777);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(stat(cr.path[i], &sb), 0);
        cr_expect_eq(sb.st_mode & 0777, 0600, "%s is %o", cr.path[i], sb.st_mode & 0777);
        cr_expect_eq(strlen(cr.token[i]), STRIA_AUTH_TOKEN_CHARS, "%s", cr.path[i]);
        cr_expect_eq(strspn(cr.token[i], "0123456789abcdef"), STRIA_AUTH_TOKEN_CHARS);
        for (int k = 0; k < i; k++)
            cr_expect_str_neq(cr.token[i], cr.token[k]);
    }
    /* A second run replaces nothing. */
    char *argv[] = {STRIA_COORDINATOR_BIN, "--gen-credentials", cr.dir, NULL};
    char *err = NULL;
    cr_expect_eq(dc_run(argv, NULL, 30, NULL, &err), 1);
    cr_expect(strstr(err, "exists") != NULL, "%s", err);
    free(err);
    char *again = dc_read(cr.path[CLIENT]);
    cr_expect(strncmp(again, cr.token[CLIENT], strlen(cr.token[CLIENT])) == 0);
    free(again);
    /* The files work: a secure service starts with them. */
    dc_opts_t o = secure(&cr);
    dc_start_coordinator(&c, &o);
    dc_start_worker(&c, 0, &o);
    dc_wait_healthy(&c, 1, cr.path[CLIENT]);
    dc_stop(&c);
}
