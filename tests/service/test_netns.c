/* Fault tests across hosts: the coordinator and workers on three test hosts
 * (network namespaces joined by a switch, see tests/common/netns.h). A job
 * across them works; a cable cut (the interface of one host down) in the
 * middle of a pass ends in an error naming the unreachable rank within
 * about the step deadline, and the job retried runs on the hosts left, with
 * results bit for bit those of the in-process ring of that size. Skipped with
 * a message where namespaces cannot be made (not root, no `ip`). */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "deploy_util.h"
#include "fault_util.h"
#include "netns.h"

#define STEP_S 2.0 /* the workers' step deadline */

static test_hosts_t hosts;

static void hosts_fini(void)
{
    test_hosts_destroy(&hosts);
}

/* Starts worker i on host h, through `ip netns exec` even on host 0 (the
 * test's own network): it mounts the namespace's /sys, where UCX looks for
 * the network devices. */
static void start_worker(dcluster_t *c, int i, int h)
{
    static char *worker_args[] = {"--insecure", "--ucx-tls=tcp", NULL};
    char devices[64];
    snprintf(devices, sizeof(devices), "UCX_NET_DEVICES=%s", hosts.dev[h]);
    char *env[] = {devices, NULL};
    dc_opts_t o = {.heartbeat_period_s = 0.2,
                   .step_timeout_s = STEP_S,
                   .host = hosts.addr[h],
                   .netns = hosts.ns[h],
                   .env = env,
                   .worker_args = worker_args};
    dc_start_worker(c, i, &o);
}

typedef struct {
    stria_client_t *cl;
    fu_job_t *j;
    stria_status_t st;
    bool retryable;
    char msg[2048];
    double ended;
    int ring;
} fwd_call_t;

static void *forward_thread(void *arg)
{
    fwd_call_t *f = arg;
    stria_job_t *job = NULL;
    f->st = stria_client_forward(f->cl, &f->j->spec, f->j->q, f->j->k, f->j->v, f->j->o, f->j->lse,
                                 NULL, NULL, NULL, &job);
    f->ended = stria_time_now();
    f->retryable = stria_error_retryable();
    snprintf(f->msg, sizeof(f->msg), "%s", stria_error_msg());
    if (f->st == STRIA_OK) {
        f->ring = stria_job_ring_size(job);
        stria_client_release(job);
    }
    return NULL;
}

/* Forward of j; its results must be those of the in-process ring of the
 * size that ran it, which is returned. */
static int forward_checked(stria_client_t *cl, fu_job_t *j, bool backward)
{
    stria_job_t *job = NULL;
    cr_assert_eq(
        stria_client_forward(cl, &j->spec, j->q, j->k, j->v, j->o, j->lse, NULL, NULL, NULL, &job),
        STRIA_OK, "%s", stria_error_msg());
    if (backward)
        cr_assert_eq(stria_client_backward(job, j->g, j->dq, j->dk, j->dv, NULL, NULL, NULL),
                     STRIA_OK, "%s", stria_error_msg());
    int ring = stria_job_ring_size(job);
    stria_layout_kind_t layout = stria_job_layout(job);
    cr_assert_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
    char why[256];
    cr_expect(fu_ring_equal(j, ring, layout, backward, why, sizeof(why)), "%s", why);
    return ring;
}

/* Whether `striactl --json jobs` shows a job running its forward. */
static bool forward_running(const dcluster_t *c)
{
    char *out = NULL;
    bool yes = dc_striactl(c, NULL, &out, NULL, "--json", "jobs", NULL) == 0 &&
               strstr(out, "\"state\":\"forward\"") != NULL;
    free(out);
    return yes;
}

/* Three hosts: host 0 the coordinator and worker 0 (and the test process),
 * host 1 workers 1 and 2, host 2 worker 3; skips the test where namespaces
 * cannot be made. */
static void start_hosts(dcluster_t *c)
{
    const char *why = test_hosts_create(&hosts, 3);
    if (why != NULL)
        cr_skip_test("skipped: network namespaces cannot be made here (%s)", why);
    cr_assert_eq(test_hosts_enter(&hosts, 0), 0, "cannot enter host 0's network");
    dc_init(c);
    static char *coord_args[] = {"--insecure", NULL};
    dc_opts_t oc = {.heartbeat_period_s = 0.2, .host = hosts.addr[0], .coord_args = coord_args};
    dc_start_coordinator(c, &oc);
    const int host_of[4] = {0, 1, 1, 2};
    for (int i = 0; i < 4; i++)
        start_worker(c, i, host_of[i]);
    dc_wait_healthy(c, 4, NULL);
}

/* Waits until a job runs its forward, then a moment more, and cuts host 2's
 * cable; returns when. */
static double cut_host2_mid_forward(const dcluster_t *c)
{
    double until = stria_time_now() + 60;
    while (!forward_running(c) && stria_time_now() < until)
        usleep(20000);
    usleep(300000);
    double cut = stria_time_now();
    cr_assert_eq(test_hosts_link(&hosts, 2, false), 0, "cannot take host 2's link down");
    return cut;
}

Test(netns, three_hosts_job_and_a_cut_cable, .fini = hosts_fini, .timeout = 400)
{
    dcluster_t c;
    start_hosts(&c);

    /* a job across the three hosts */
    fu_job_t small;
    cr_assert(fu_job_init(&small, 1, 1024, 2, 1, 32, STRIA_DTYPE_F32, true, 5));
    small.spec.layout = STRIA_LAYOUT_STRIPED;
    stria_client_t *cl = dc_client(&c, NULL, "test_netns", -1);
    cr_expect_eq(forward_checked(cl, &small, true), 4, "the job spans every worker");

    /* a long forward; host 2's cable is cut while it runs */
    fu_job_t big;
    cr_assert(fu_job_init(&big, 1, 16384, 4, 4, 64, STRIA_DTYPE_F32, true, 6));
    big.spec.layout = STRIA_LAYOUT_STRIPED;
    fwd_call_t f = {.cl = cl, .j = &big};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, forward_thread, &f), 0);
    double cut = cut_host2_mid_forward(&c);
    pthread_join(th, NULL);
    double took = f.ended - cut;
    cr_assert_neq(f.st, STRIA_OK, "the forward ended before the cut (make the job longer)");
    fprintf(stderr, "netns: the cut cable failed the pass in %.2f s: %s\n", took, f.msg);
    cr_expect(f.retryable, "a cut cable is retryable: %s", f.msg);
    cr_expect(strstr(f.msg, "rank ") != NULL, "the error names no rank: %s", f.msg);
    cr_expect(strstr(f.msg, hosts.addr[2]) != NULL, "the error does not name host 2 (%s): %s",
              hosts.addr[2], f.msg);
    cr_expect_lt(took, 2 * STEP_S + 2, "the error came %.2f s after the cut", took);

    /* the job again, with retries: it runs on the hosts left. Its steps are
     * larger on three workers, and this machine may be busy: the short step
     * deadline was for the cut, this try gets a generous one of its own. */
    big.spec.step_timeout_s = 60;
    stria_client_t *cl2 = dc_client(&c, NULL, "test_netns", 0);
    cr_expect_eq(forward_checked(cl2, &big, false), 3,
                 "the retried job runs on the 3 workers left");

    /* the cable back: worker 3 rejoins (so that it can leave cleanly) */
    cr_assert_eq(test_hosts_link(&hosts, 2, true), 0);
    dc_wait_healthy(&c, 4, NULL);
    stria_client_close(cl2);
    stria_client_close(cl);
    fu_job_free(&big);
    fu_job_free(&small);
    dc_stop(&c);
}

/* One rank of a sharded job, as a trainer's process would run it: its own
 * client and handle, its stripe's forward. */
typedef struct {
    const dcluster_t *c;
    const uint8_t *exported;
    size_t len;
    int rank;
    stria_status_t st;
    bool retryable;
    double ended;
    char msg[2048];
} shard_call_t;

static void *shard_thread(void *arg)
{
    shard_call_t *a = arg;
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *cl = NULL;
    stria_job_t *job = NULL;
    p.coordinator = a->c->coord_addr;
    p.client_name = "test_netns rank";
    p.rpc_timeout_s = 600;
    a->st = stria_client_connect(&p, &cl);
    if (a->st == STRIA_OK)
        a->st = stria_job_import(cl, a->exported, a->len, &job);
    if (a->st == STRIA_OK) {
        int64_t t = stria_job_shard_tokens(job, a->rank);
        size_t n = (size_t)t * 4 * 64;
        float *x = calloc(n, sizeof(float)), *o = calloc(n, sizeof(float));
        float *lse = calloc((size_t)t * 4, sizeof(float));
        a->st = x && o && lse ? stria_client_forward_shard(job, a->rank, x, x, x, o, lse)
                              : STRIA_ERR_NO_MEMORY;
        free(x);
        free(o);
        free(lse);
    }
    a->ended = stria_time_now();
    a->retryable = stria_error_retryable();
    snprintf(a->msg, sizeof(a->msg), "%s", stria_error_msg());
    stria_client_close(cl); /* releases the handle */
    return NULL;
}

/* A sharded job's ranks, one thread each: host 2's cable is cut during the
 * forward. Every rank's call ends, retryable, within about the step
 * deadline, the one whose worker is cut off too (it would otherwise wait
 * out its call's deadline, minutes). */
Test(netns, sharded_ranks_return_when_a_host_is_cut_off, .fini = hosts_fini, .timeout = 400)
{
    dcluster_t c;
    start_hosts(&c);
    stria_client_t *sub = dc_client(&c, NULL, "test_netns", -1);
    stria_job_spec_t spec = STRIA_JOB_SPEC_INIT;
    spec.batch = 1;
    spec.seq_len = 16384;
    spec.heads = spec.kv_heads = 4;
    spec.head_dim = 64;
    spec.dtype = STRIA_DTYPE_F32;
    spec.causal = true;
    spec.layout = STRIA_LAYOUT_STRIPED;
    spec.ring_size = 4;
    stria_job_t *job = NULL;
    cr_assert_eq(stria_client_submit(sub, &spec, &job), STRIA_OK, "%s", stria_error_msg());
    uint8_t exported[STRIA_JOB_EXPORT_BYTES];
    size_t len = 0;
    cr_assert_eq(stria_job_export(job, exported, sizeof(exported), &len), STRIA_OK);
    shard_call_t a[4];
    pthread_t th[4];
    for (int r = 0; r < 4; r++) {
        a[r] = (shard_call_t){.c = &c, .exported = exported, .len = len, .rank = r};
        cr_assert_eq(pthread_create(&th[r], NULL, shard_thread, &a[r]), 0);
    }
    double cut = cut_host2_mid_forward(&c);
    for (int r = 0; r < 4; r++) {
        pthread_join(th[r], NULL);
        double took = a[r].ended - cut;
        fprintf(stderr, "netns: sharded rank %d ended %.2f s after the cut: %s\n", r, took,
                a[r].msg);
        cr_expect_neq(a[r].st, STRIA_OK, "rank %d: the forward ended before the cut", r);
        cr_expect(a[r].retryable, "rank %d: a cut cable is retryable: %s", r, a[r].msg);
        cr_expect_lt(took, 2 * STEP_S + 3, "rank %d ended %.2f s after the cut", r, took);
    }
    stria_client_release(job);
    stria_client_close(sub);
    cr_assert_eq(test_hosts_link(&hosts, 2, true), 0);
    dc_wait_healthy(&c, 4, NULL);
    dc_stop(&c);
}
