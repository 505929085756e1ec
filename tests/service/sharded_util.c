#include "sharded_util.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tcheck.h"
#include "tref.h"

tcluster_t cl;

char *const sh_env[] = {"UCX_HANDLE_ERRORS=none", "UCX_TLS=tcp,sm,self", "STRIA_LOG_LEVEL=info",
                        NULL};

void sh_start_worker(int i, bool shm)
{
    static const char *const hosts[MAX_WORKERS] = {"hA", "hA", "hB", "hB", "hB"};
    static const char *const inst[MAX_WORKERS] = {"0", "1", "0", "1", "2"};
    char *argv[] = {STRIA_WORKER_BIN,
                    "--coordinator",
                    cl.coord_addr,
                    "--threads",
                    "1",
                    "--step-timeout",
                    "5",
                    "--memory",
                    "1G",
                    "--host",
                    (char *)hosts[i],
                    "--instance",
                    (char *)inst[i],
                    "--listen",
                    "127.0.0.1:0",
                    "--ucx-listen",
                    "127.0.0.1:0",
                    "--metrics-listen",
                    "127.0.0.1:0",
                    shm ? "--runtime-dir" : NULL, /* without shm the list ends here */
                    cl.dir,
                    NULL};
    tcl_start_worker(&cl, i, argv);
}

void sh_start_cluster_n(int n)
{
    tcl_init(&cl, "sharded", sh_env);
    /* 0.5 s heartbeats: dead after 1.5 s of silence, which a loaded
     * machine's scheduler can cause at 0.2 s */
    char *cargv[] = {STRIA_COORDINATOR_BIN, "--listen", "127.0.0.1:0",
                     "--heartbeat-period",  "0.5",      NULL};
    tcl_start_coordinator(&cl, cargv);
    for (int i = 0; i < n; i++)
        sh_start_worker(i, true);
    sh_wait_healthy();
}

void sh_start_cluster(void)
{
    sh_start_cluster_n(N_WORKERS);
}

void sh_wait_healthy(void)
{
    unsigned got = 0;
    for (int i = 0; i < 300 && got != (unsigned)cl.alive; i++) {
        Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
        stria_rpc_reply_t rep;
        cr_assert_eq(sh_coord_call(STRIA_RPC_COORDINATOR_GET_STATUS, &req.base, &rep), STRIA_OK);
        got = ((Stria__V1__GetStatusReply *)rep.msg)->workers_healthy;
        stria_rpc_reply_free(&rep);
        if (got != (unsigned)cl.alive)
            usleep(50000);
    }
    cr_assert_eq(got, (unsigned)cl.alive, "%u healthy workers", got);
}

void sh_stop_cluster(void)
{
    tcl_stop(&cl);
}

stria_rpc_client_t *sh_coord_rpc(void)
{
    stria_rpc_client_params_t p = {.address = cl.coord_addr,
                                   .service = &stria__v1__coordinator__descriptor,
                                   .connect_timeout_s = 5};
    stria_rpc_client_t *c = NULL;
    cr_assert_eq(stria_rpc_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    return c;
}

stria_status_t sh_coord_call(uint32_t method, const ProtobufCMessage *req, stria_rpc_reply_t *rep)
{
    stria_rpc_client_t *c = sh_coord_rpc();
    stria_rpc_request_t rq = {.method = method, .request = req, .timeout_s = 10};
    memset(rep, 0, sizeof(*rep));
    stria_status_t st = stria_rpc_client_call(c, &rq, rep);
    stria_rpc_client_close(c);
    return st;
}

bool sh_workers_idle(double timeout_s)
{
    double until = stria_time_now() + timeout_s;
    do {
        Stria__V1__ListWorkersRequest req = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
        stria_rpc_reply_t rep;
        if (sh_coord_call(STRIA_RPC_COORDINATOR_LIST_WORKERS, &req.base, &rep) == STRIA_OK) {
            const Stria__V1__ListWorkersReply *r = (const Stria__V1__ListWorkersReply *)rep.msg;
            size_t idle = 0;
            for (size_t i = 0; i < r->n_workers; i++)
                idle += r->workers[i]->state == STRIA__V1__WORKER_STATE__WORKER_STATE_HEALTHY &&
                        r->workers[i]->memory_in_use_bytes == 0 && r->workers[i]->n_job_ids == 0;
            stria_rpc_reply_free(&rep);
            if (idle == (size_t)cl.alive)
                return true;
        }
        usleep(100000);
    } while (stria_time_now() < until);
    return false;
}

uint64_t sh_worker_in_use(uint64_t worker_id)
{
    Stria__V1__ListWorkersRequest req = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    uint64_t used = UINT64_MAX;
    usleep(1200000);
    cr_assert_eq(sh_coord_call(STRIA_RPC_COORDINATOR_LIST_WORKERS, &req.base, &rep), STRIA_OK);
    const Stria__V1__ListWorkersReply *r = (const Stria__V1__ListWorkersReply *)rep.msg;
    for (size_t i = 0; i < r->n_workers; i++)
        if (r->workers[i]->worker_id == worker_id)
            used = r->workers[i]->memory_in_use_bytes;
    stria_rpc_reply_free(&rep);
    return used;
}

stria_client_t *sh_client(stria_data_path_t path)
{
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *c = NULL;
    p.coordinator = cl.coord_addr;
    p.client_name = "test_sharded";
    p.data_path = path;
    cr_assert_eq(stria_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    return c;
}

void sh_case_init(case_t *c, int64_t B, int64_t S, int64_t H, int64_t Hkv, stria_dtype_t dt,
                  bool causal, stria_layout_kind_t layout, uint64_t seed)
{
    memset(c, 0, sizeof(*c));
    cr_assert(tjob_init(&c->j, B, S, H, Hkv, 32, dt, causal, seed), "out of memory");
    c->j.spec.layout = layout;
    c->j.spec.ring_size = N_WORKERS;
    c->j.spec.step_timeout_s = 5;
    c->seed = seed;
    tjob_outputs(&c->j, c->got, c->bytes);
    for (int i = 0; i < TJ_N_OUT; i++)
        cr_assert_not_null(c->ref[i] = calloc(1, c->bytes[i]));
    const stria_ring_shape_t shape = tjob_ring_shape(&c->j);
    const stria_ring_local_opts_t lo = {
        .layout = layout, .n_ranks = N_WORKERS, .passes = STRIA_RING_PASS_FWD_BWD};
    cr_assert_eq(tref_ring_run(&shape, &lo, c->j.q, c->j.k, c->j.v, c->j.g, c->ref, NULL), STRIA_OK,
                 "%s", stria_error_msg());
}

void sh_case_free(case_t *c)
{
    tjob_free(&c->j);
    for (int i = 0; i < TJ_N_OUT; i++)
        free(c->ref[i]);
}

void sh_case_check_reference(const case_t *c)
{
    tcheck_job(&c->j, true, false, "the ranks' outputs");
}

void sh_case_gather(case_t *c, stria_job_t *job)
{
    static const char *const names[5] = {"o", "lse", "dq", "dk", "dv"};
    const stria_job_spec_t *s = &c->j.spec;
    for (int r = 0; r < N_WORKERS; r++) {
        int64_t T = stria_job_shard_tokens(job, r);
        int64_t *pos = malloc((size_t)T * sizeof(int64_t));
        cr_assert_eq(stria_job_positions(job, r, pos), STRIA_OK);
        for (int i = 0; i < 5; i++) {
            int64_t outer = i == 1 ? s->batch * s->heads : s->batch;
            size_t row = i == 1 ? 4 : c->bytes[i] / (size_t)(s->batch * s->seq_len);
            size_t len = (size_t)(outer * T) * row;
            char path[300], *shard = malloc(len);
            snprintf(path, sizeof(path), "%s/rank%d.%s", cl.dir, r, names[i]);
            FILE *f = fopen(path, "rb");
            cr_assert_not_null(f, "rank %d wrote no %s", r, names[i]);
            cr_assert_eq(fread(shard, 1, len, f), len, "rank %d: short %s", r, names[i]);
            fclose(f);
            unlink(path);
            for (int64_t o = 0; o < outer; o++)
                for (int64_t t = 0; t < T; t++)
                    memcpy((char *)c->got[i] + (size_t)(o * s->seq_len + pos[t]) * row,
                           shard + (size_t)(o * T + t) * row, row);
            free(shard);
        }
        free(pos);
    }
}

test_proc_t *sh_start_rank(const case_t *c, stria_job_t *job, int r, const char *path,
                           const char *mode)
{
    uint8_t exp[STRIA_JOB_EXPORT_BYTES];
    size_t len = 0;
    char hex[2 * STRIA_JOB_EXPORT_BYTES + 1], a[8][32], log[256];
    cr_assert_eq(stria_job_export(job, exp, sizeof(exp), &len), STRIA_OK, "%s", stria_error_msg());
    for (size_t i = 0; i < len; i++)
        snprintf(hex + 2 * i, 3, "%02x", exp[i]);
    const stria_job_spec_t *s = &c->j.spec;
    snprintf(a[0], 32, "%d", r);
    snprintf(a[1], 32, "%lld", (long long)s->batch);
    snprintf(a[2], 32, "%lld", (long long)s->seq_len);
    snprintf(a[3], 32, "%lld", (long long)s->heads);
    snprintf(a[4], 32, "%lld", (long long)s->kv_heads);
    snprintf(a[5], 32, "%lld", (long long)s->head_dim);
    snprintf(a[6], 32, "%d", (int)s->dtype);
    snprintf(a[7], 32, "%llu", (unsigned long long)c->seed);
    snprintf(log, sizeof(log), "%s/rank%d.log", cl.dir, r);
    char *argv[] = {SHARD_RANK_BIN, cl.coord_addr, hex,  a[0], (char *)path,
                    (char *)mode,   cl.dir,        a[1], a[2], a[3],
                    a[4],           a[5],          a[6], a[7], NULL};
    test_proc_t *p = test_proc_start(argv, log, sh_env);
    cr_assert_not_null(p);
    return p;
}

void sh_rank_result(test_proc_t *p, char *line, size_t len)
{
    line[0] = '\0';
    test_proc_wait_line(p, "shard_rank: ", HELPER_S, line, len);
    test_proc_wait(p, 30);
}
