/* Coordinator suite, workers: registration and its checks, the ring order,
 * a returning worker's id, heartbeats and dead workers, restarted workers.
 * Workers are played by the test through the Coordinator service itself. */
#include <criterion/criterion.h>

#include "coord_test_util.h"

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
