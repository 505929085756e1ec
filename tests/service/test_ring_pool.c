/* The workers' pooled ring endpoints, seen from outside: real daemons on
 * loopback, libstria's session API, the workers' metrics and ring ports
 * (black box). A peer worker killed and restarted between two sessions is
 * met on new endpoints by the next open, which works; a bind replayed on a
 * pooled endpoint is refused and counted, and the worker serves on. */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "deploy_util.h"
#include "fault_util.h"
#include "session_util.h"

/* The value of the series `series` (name and labels, then a space) in
 * worker i's metrics, -1 when absent. */
static double metric(const dcluster_t *c, int i, const char *series)
{
    char *body = NULL;
    double v = -1;
    if (dc_http_get(c->worker_metrics[i], "/metrics", &body) != 200) {
        free(body);
        return -1;
    }
    for (const char *p = body; (p = strstr(p, series)) != NULL; p++)
        if (p == body || p[-1] == '\n') {
            v = atof(p + strlen(series));
            break;
        }
    free(body);
    return v;
}

/* Waits (10 s: the metrics follow the workers' heartbeats) until worker i's
 * series reaches `at_least`; returns its last value. */
static double metric_reaches(const dcluster_t *c, int i, const char *series, double at_least)
{
    double v = -1;
    for (int t = 0; t < 200 && (v = metric(c, i, series)) < at_least; t++)
        usleep(50000);
    return v;
}

/* A session of two ranks, one call checked against the in-process ring,
 * closed. */
static void one_session(stria_client_t *cl, uint64_t seed, const char *what)
{
    stria_session_spec_t sp = se_spec_of(1, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    stria_session_t *s = se_open_session(cl, &sp);
    stria_call_t call = se_call_of(1, 96, true);
    se_check_call(s, &sp, &call, true, seed, what);
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(st.reopened, 0u, "%s: the session was reopened", what);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s: %s", what, stria_error_msg());
}

/* Worker 1 on ports of its own (RPC and ring), so that it comes back on
 * them. */
typedef struct {
    char listen[64], ucx[64];
    char *args[3];
    dc_opts_t o;
    int ucx_port;
} fixed_t;

static void fixed_init(fixed_t *f)
{
    memset(f, 0, sizeof(*f));
    f->ucx_port = dc_free_port();
    int rpc_port = dc_free_port();
    while (rpc_port == f->ucx_port)
        rpc_port = dc_free_port();
    snprintf(f->listen, sizeof(f->listen), "--listen=127.0.0.1:%d", rpc_port);
    snprintf(f->ucx, sizeof(f->ucx), "--ucx-listen=127.0.0.1:%d", f->ucx_port);
    f->args[0] = f->listen;
    f->args[1] = f->ucx;
    f->o.worker_args = f->args;
}

/* A coordinator, worker 0 and worker 1 on its fixed ports, and a client. */
static stria_client_t *two_workers(dcluster_t *c, fixed_t *f)
{
    fixed_init(f);
    dc_init(c);
    dc_start_coordinator(c, NULL);
    dc_start_worker(c, 0, NULL);
    dc_start_worker(c, 1, &f->o);
    dc_wait_healthy(c, 2, NULL);
    return dc_client(c, NULL, "test_ring_pool", 0);
}

static const char made[] = "stria_worker_ring_endpoint_events_total{event=\"made\"} ";
static const char dropped[] = "stria_worker_ring_endpoint_events_total{event=\"dropped\"} ";
static const char replaced[] = "stria_worker_ring_endpoint_events_total{event=\"replaced\"} ";

Test(ring_pool, a_restarted_peer_worker_is_met_on_new_endpoints_by_the_next_open,
     .timeout = T_TIMEOUT)
{
    dcluster_t c;
    fixed_t f;
    stria_client_t *cl = two_workers(&c, &f);
    one_session(cl, 2100, "the first session");
    one_session(cl, 2101, "the second session");
    /* two sessions, one endpoint each way */
    cr_expect_eq(metric_reaches(&c, 0, made, 2), 2, "worker 0 made endpoints per session");
    cr_expect_geq(metric_reaches(&c, 0, "stria_worker_ring_binds_total ", 2), 2);

    test_proc_stop(c.workers[1], SIGKILL, 5);
    c.workers[1] = NULL;
    dc_start_worker(&c, 1, &f.o);
    dc_wait_healthy(&c, 2, NULL);
    one_session(cl, 2102, "the session after the restart");
    cr_expect_geq(metric_reaches(&c, 0, made, 4), 4, "no new endpoints to the new process");
    double gone = metric(&c, 0, dropped) + metric(&c, 0, replaced);
    cr_expect_geq(gone, 2, "the stale endpoints were neither dropped nor replaced (%g)", gone);
    cr_expect_eq(metric(&c, 0, "stria_worker_ring_endpoints "), 2, "one endpoint each way");
    stria_client_close(cl);
    dc_stop(&c);
}

Test(ring_pool, a_replayed_bind_is_refused_and_the_worker_serves_on, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    fixed_t f;
    stria_client_t *cl = two_workers(&c, &f);
    one_session(cl, 2200, "before the attack");

    /* An endpoint to worker 1's ring port (its handshake done: the workers
     * have no credential here), a bind for a ring it does not have (it
     * waits there), and the same counter again: refused at once. */
    char port[16], log[300], line[256];
    snprintf(port, sizeof(port), "%d", f.ucx_port);
    snprintf(log, sizeof(log), "%s/attacker.log", c.dir);
    char *argv[] = {STRIA_UCX_RING_ATTACKER,
                    "--port",
                    port,
                    "--mode",
                    "forge",
                    "--job",
                    "12345",
                    "--binds",
                    "1",
                    "--wait",
                    "0.5",
                    NULL};
    char *env[] = {"UCX_TLS=tcp", "UCX_HANDLE_ERRORS=none", NULL};
    test_proc_t *atk = test_proc_start(argv, log, env);
    cr_assert_not_null(atk);
    cr_assert(test_proc_wait_line(atk, "forged ", 30, line, sizeof(line)),
              "the attacker did not finish");
    test_proc_wait(atk, 10);
    cr_expect(strstr(line, "stale STRIA_ERR_AUTH") != NULL, "%s", line);
    cr_expect_geq(
        metric_reaches(&c, 1, "stria_worker_ring_refused_total{reason=\"bind_replayed\"} ", 1), 1,
        "worker 1 did not count the replayed bind");
    one_session(cl, 2201, "after the attack");
    stria_client_close(cl);
    dc_stop(&c);
}
