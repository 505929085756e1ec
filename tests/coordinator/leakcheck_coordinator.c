/* Leak check of the RPC layer and the coordinator: a plain program (not a
 * Criterion suite, whose runner hides LeakSanitizer reports) that drives the
 * success and error paths once each and exits 0. In the sanitizer build,
 * LeakSanitizer turns any leak into a non-zero exit status. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../rpc/rpc_testutil.h"
#include "stria_coordinator.h"
#include "tleak.h"

/* Jobs submitted, with their secrets. */
static uint64_t g_ids[8];
static stria_job_secret_t g_secrets[8];
static int g_n;

static stria_status_t call_job(stria_rpc_client_t *cl, uint32_t m, const ProtobufCMessage *req,
                               double timeout_s, int job)
{
    stria_rpc_request_t r = {.method = m, .request = req, .timeout_s = timeout_s};
    stria_rpc_reply_t rep = {0};
    if (job >= 0) {
        r.job_secret = &g_secrets[job];
        r.job_id = g_ids[job];
    }
    stria_status_t st = stria_rpc_client_call(cl, &r, &rep);
    if (st == STRIA_OK && m == STRIA_RPC_COORDINATOR_SUBMIT_JOB && g_n < 8) {
        Stria__V1__SubmitJobReply *sr = (Stria__V1__SubmitJobReply *)rep.msg;
        g_ids[g_n] = sr->assignment->job_id;
        st = stria_auth_open(&rep.session, "job secret", g_ids[g_n], sr->job_secret.data,
                             sr->job_secret.len, g_secrets[g_n].bytes);
        g_n++;
    }
    stria_rpc_reply_free(&rep);
    return st;
}

static stria_status_t call(stria_rpc_client_t *cl, uint32_t m, const ProtobufCMessage *req,
                           double timeout_s)
{
    return call_job(cl, m, req, timeout_s, -1);
}

int main(void)
{
    stria_coord_params_t p = {0};
    stria_coord_t *co = NULL;
    stria_rpc_client_params_t cp = {0};
    stria_rpc_client_t *cl = NULL, *bad = NULL, *wk = NULL, *adm = NULL;
    char addr[64];
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    rt_reply_t rr;
    int fd;

    p.listen = "127.0.0.1:0";
    p.heartbeat_period_s = 0.05;
    p.job_ttl_s = 0.1;
    p.token = "tok";
    p.worker_token = "wtok";
    p.admin_token = "adm";
    p.history = 2;
    CHECK(stria_coord_start(&p, &co) == STRIA_OK, "start");
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", stria_coord_port(co));
    cp.address = addr;
    cp.service = &stria__v1__coordinator__descriptor;
    cp.token = "wrong";
    CHECK(stria_rpc_client_connect(&cp, &bad) == STRIA_ERR_AUTH, "wrong token accepted");
    cp.token = "adm";
    CHECK(stria_rpc_client_connect(&cp, &adm) == STRIA_OK, "connect");
    cp.token = "wtok";
    CHECK(stria_rpc_client_connect(&cp, &wk) == STRIA_OK, "connect");
    cp.token = "tok";
    CHECK(stria_rpc_client_connect(&cp, &cl) == STRIA_OK, "connect");

    /* Workers, jobs, every method, and errors. */
    Stria__V1__RegisterWorkerRequest reg = STRIA__V1__REGISTER_WORKER_REQUEST__INIT;
    reg.rpc_address = (char *)"127.0.0.1:7000";
    reg.ucx_address = (char *)"127.0.0.1:7100";
    reg.host = (char *)"h";
    reg.device = (char *)"cpu";
    reg.memory_bytes = 1ull << 32;
    CHECK(call(cl, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &reg.base, 5) == STRIA_ERR_AUTH,
          "a client registers a worker");
    CHECK(call(wk, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &reg.base, 5) == STRIA_OK, "register");
    reg.rpc_address = (char *)"127.0.0.1:7001";
    CHECK(call(wk, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &reg.base, 5) == STRIA_OK, "register");
    reg.memory_bytes = 0;
    CHECK(call(wk, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &reg.base, 5) == STRIA_ERR_INVALID_ARG,
          "bad register");

    Stria__V1__JobSpec s = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__SubmitJobRequest sj = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    s.batch = 1;
    s.seq_len = 4096;
    s.heads = 4;
    s.kv_heads = 4;
    s.head_dim = 64;
    sj.spec = &s;
    for (int i = 0; i < 6; i++)
        CHECK(call(cl, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &sj.base, 5) == STRIA_OK, "submit");
    s.heads = 3;
    CHECK(call(cl, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &sj.base, 5) == STRIA_ERR_INVALID_ARG,
          "bad spec");
    Stria__V1__GetJobRequest gj = STRIA__V1__GET_JOB_REQUEST__INIT;
    gj.job_id = g_ids[0];
    CHECK(call_job(cl, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, 5, 0) == STRIA_OK, "get job");
    CHECK(call_job(cl, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, 5, 1) == STRIA_ERR_AUTH,
          "another job's secret");
    CHECK(call(wk, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, 5) == STRIA_OK, "worker get job");
    Stria__V1__ReportJobRequest rj = STRIA__V1__REPORT_JOB_REQUEST__INIT;
    rj.worker_id = 1;
    rj.job_id = g_ids[0];
    rj.event = STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED;
    rj.message = (char *)"boom";
    CHECK(call(wk, STRIA_RPC_COORDINATOR_REPORT_JOB, &rj.base, 5) == STRIA_OK, "report");
    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    cj.job_id = g_ids[1];
    CHECK(call(adm, STRIA_RPC_COORDINATOR_CANCEL_JOB, &cj.base, 5) == STRIA_OK, "cancel");
    Stria__V1__ReleaseJobRequest rl = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    rl.job_id = g_ids[2];
    CHECK(call_job(cl, STRIA_RPC_COORDINATOR_RELEASE_JOB, &rl.base, 5, 2) == STRIA_OK, "release");
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    Stria__V1__GetRingRequest gr = STRIA__V1__GET_RING_REQUEST__INIT;
    Stria__V1__ListWorkersRequest lw = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    Stria__V1__ListJobsRequest lj = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    Stria__V1__DrainWorkerRequest dw = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    lj.include_finished = true;
    dw.worker_id = 2;
    dw.drain = true;
    CHECK(call(cl, STRIA_RPC_COORDINATOR_GET_STATUS, &gs.base, 5) == STRIA_OK, "status");
    CHECK(call(cl, STRIA_RPC_COORDINATOR_GET_RING, &gr.base, 5) == STRIA_OK, "ring");
    CHECK(call(cl, STRIA_RPC_COORDINATOR_LIST_WORKERS, &lw.base, 5) == STRIA_OK, "workers");
    CHECK(call(adm, STRIA_RPC_COORDINATOR_LIST_JOBS, &lj.base, 5) == STRIA_OK, "jobs");
    CHECK(call(adm, STRIA_RPC_COORDINATOR_DRAIN_WORKER, &dw.base, 5) == STRIA_OK, "drain");

    /* Bad frames: a malformed body (kept), then an oversized one (closed). */
    fd = rt_connect(stria_coord_port(co));
    CHECK(fd >= 0 && rt_hello(fd, "stria.v1.Coordinator", STRIA_RPC_VERSION) &&
              rt_prove(fd, "stria.v1.Coordinator", "tok"),
          "raw hello");
    CHECK(rt_read_reply(fd, &rr, 5000) && rr.h.status == 0, "raw hello reply");
    rt_reply_free(&rr);
    stria_rpc_header_t h = rt_header(STRIA_RPC_COORDINATOR_SUBMIT_JOB, 2);
    h.pb_len = 4;
    stria_rpc_header_encode(&h, hb);
    CHECK(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, "\xff\xff\xff\xff", 4), "send");
    CHECK(rt_read_reply(fd, &rr, 5000) && rr.h.status == STRIA_ERR_FORMAT, "malformed");
    rt_reply_free(&rr);
    h.pb_len = 0xffffffffu;
    stria_rpc_header_encode(&h, hb);
    CHECK(rt_send(fd, hb, sizeof(hb)), "send");
    CHECK(rt_read_reply(fd, &rr, 5000) && rr.h.status == STRIA_ERR_PROTOCOL, "oversized");
    rt_reply_free(&rr);
    close(fd);
    /* A truncated frame left behind on a connection the server must clean. */
    fd = rt_connect(stria_coord_port(co));
    CHECK(fd >= 0 && rt_hello(fd, "stria.v1.Coordinator", STRIA_RPC_VERSION) &&
              rt_prove(fd, "stria.v1.Coordinator", "tok"),
          "raw hello");
    CHECK(rt_read_reply(fd, &rr, 5000), "hello reply");
    rt_reply_free(&rr);
    h = rt_header(STRIA_RPC_COORDINATOR_SUBMIT_JOB, 3);
    h.pb_len = 1000;
    stria_rpc_header_encode(&h, hb);
    CHECK(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, "abc", 3), "send");
    close(fd);

    /* Let the workers die and the jobs expire, so the timers' paths run. */
    usleep(1500 * 1000);
    CHECK(call(adm, STRIA_RPC_COORDINATOR_LIST_JOBS, &lj.base, 5) == STRIA_OK, "jobs after expiry");
    stria_rpc_client_close(cl);
    stria_rpc_client_close(wk);
    stria_rpc_client_close(adm);
    stria_coord_stop(co);
    printf("leakcheck: ok\n");
    return 0;
}
