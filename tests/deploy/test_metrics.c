/* The /metrics endpoints of the coordinator and the workers after real work
 * (a refused submission, then one job forward, backward and released on a
 * ring of two), scraped over HTTP and read with the Prometheus text parser of
 * prometheus_client: families, types, labels and values. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "deploy_util.h"

#define SUITE_TIMEOUT 120

#define SEQ      96
#define HEADS    2
#define HEAD_DIM 32
#define STR_(x)  #x
#define STR(x)   STR_(x)

/* Reads the three scrapes (argv[1..3]) and checks them; argv[4], argv[5]:
 * the workers' RPC addresses. */
static const char *const check_script =
    "import sys\n"
    "from prometheus_client.parser import text_string_to_metric_families as parse\n"
    "def load(path):\n"
    "    return {f.name: f for f in parse(open(path).read())}\n"
    "def one(fams, family, sample=None, **labels):\n"
    "    f = fams[family]\n"
    "    got = [s for s in f.samples if (sample is None or s.name == sample)\n"
    "           and all(s.labels.get(k) == v for k, v in labels.items())]\n"
    "    assert len(got) == 1, (family, sample, labels, f.samples)\n"
    "    return got[0].value\n"
    "co = load(sys.argv[1])\n"
    "ws = [load(sys.argv[2]), load(sys.argv[3])]\n"
    "S, H, D = " STR(SEQ) ", " STR(HEADS) ", " STR(
        HEAD_DIM) "\n"
                  "types = {'stria_coordinator_jobs_submitted': 'counter',\n"
                  "         'stria_coordinator_jobs_finished': 'counter',\n"
                  "         'stria_coordinator_passes': 'counter',\n"
                  "         'stria_coordinator_pass_seconds': 'histogram',\n"
                  "         'stria_coordinator_errors': 'counter',\n"
                  "         'stria_coordinator_jobs': 'gauge',\n"
                  "         'stria_coordinator_workers': 'gauge',\n"
                  "         'stria_coordinator_worker_heartbeat_age_seconds': 'gauge',\n"
                  "         'stria_coordinator_worker_memory_in_use_bytes': 'gauge',\n"
                  "         'stria_coordinator_worker_memory_reserved_bytes': 'gauge',\n"
                  "         'stria_coordinator_loop_stalls': 'counter',\n"
                  "         'stria_coordinator_loop_stall_seconds': 'counter',\n"
                  "         'stria_coordinator_uptime_seconds': 'gauge'}\n"
                  "for name, t in types.items():\n"
                  "    assert name in co, ('missing', name, sorted(co))\n"
                  "    assert co[name].type == t, (name, co[name].type)\n"
                  "# coordinator: one job submitted, both passes, released; one refused spec\n"
                  "assert one(co, 'stria_coordinator_jobs_submitted') == 1\n"
                  "assert one(co, 'stria_coordinator_jobs_finished', state='released') == 1\n"
                  "for s in ('failed', 'cancelled', 'expired'):\n"
                  "    assert one(co, 'stria_coordinator_jobs_finished', state=s) == 0, s\n"
                  "for p in ('forward', 'backward'):\n"
                  "    v = [x.value for x in co['stria_coordinator_passes'].samples if "
                  "x.labels['pass'] == p]\n"
                  "    assert v == [1.0], (p, v)\n"
                  "    c = [x.value for x in co['stria_coordinator_pass_seconds'].samples\n"
                  "         if x.labels.get('pass') == p and x.name.endswith('_count')]\n"
                  "    assert c == [1.0], (p, c)\n"
                  "assert one(co, 'stria_coordinator_errors', kind='submit_invalid') == 1\n"
                  "kinds = {s.labels['kind']: s.value for s in "
                  "co['stria_coordinator_errors'].samples}\n"
                  "assert set(kinds) >= {'submit_invalid', 'submit_no_workers', "
                  "'submit_no_memory',\n"
                  "                      'submit_busy', 'pass_failed', 'worker_dead', "
                  "'bad_request'}, kinds\n"
                  "assert sum(kinds.values()) == 1, kinds\n"
                  "assert one(co, 'stria_coordinator_workers', state='healthy') == 2\n"
                  "for s in ('draining', 'dead', 'left'):\n"
                  "    assert one(co, 'stria_coordinator_workers', state=s) == 0, s\n"
                  "jobs = {s.labels['state']: s.value for s in "
                  "co['stria_coordinator_jobs'].samples}\n"
                  "assert set(jobs) == {'pending', 'loading', 'running_forward', 'forward_done',\n"
                  "                     'running_backward', 'done'}, jobs\n"
                  "assert sum(jobs.values()) == 0, jobs\n"
                  "ages = {s.labels['address']: s.value\n"
                  "        for s in co['stria_coordinator_worker_heartbeat_age_seconds'].samples}\n"
                  "assert set(ages) == {sys.argv[4], sys.argv[5]}, ages\n"
                  "assert all(0 <= a < 5 for a in ages.values()), ages\n"
                  "assert one(co, 'stria_coordinator_uptime_seconds') > 0\n"
                  "# workers: each ran both passes of the job, two ring steps each\n"
                  "wtypes = {'stria_worker_passes': 'counter', 'stria_worker_pass_failures': "
                  "'counter',\n"
                  "          'stria_worker_pass_seconds': 'histogram', 'stria_worker_ring_steps': "
                  "'counter',\n"
                  "          'stria_worker_step_seconds': 'histogram', 'stria_worker_ring_bytes': "
                  "'counter',\n"
                  "          'stria_worker_rpc_bytes': 'counter', "
                  "'stria_worker_memory_in_use_bytes': 'gauge',\n"
                  "          'stria_worker_jobs': 'gauge', 'stria_worker_heartbeat_age_seconds': "
                  "'gauge',\n"
                  "          'stria_worker_errors': 'counter', 'stria_worker_info': 'gauge',\n"
                  "          'stria_worker_pool_reserved_bytes': 'gauge',\n"
                  "          'stria_worker_pool_in_use_bytes': 'gauge',\n"
                  "          'stria_worker_pool_high_water_bytes': 'gauge',\n"
                  "          'stria_worker_pool_committed_bytes': 'gauge',\n"
                  "          'stria_worker_heap_in_use_bytes': 'gauge',\n"
                  "          'stria_worker_heap_free_bytes': 'gauge',\n"
                  "          'stria_worker_doc_plans': 'gauge',\n"
                  "          'stria_worker_doc_plan_bytes': 'gauge',\n"
                  "          'stria_worker_doc_plan_lookups': 'counter'}\n"
                  "rpc_in = rpc_out = 0\n"
                  "for w in ws:\n"
                  "    for name, t in wtypes.items():\n"
                  "        assert name in w and w[name].type == t, (name, sorted(w))\n"
                  "    for p in ('forward', 'backward'):\n"
                  "        assert one(w, 'stria_worker_passes', **{'pass': p}) == 1, p\n"
                  "        assert one(w, 'stria_worker_pass_failures', **{'pass': p}) == 0, p\n"
                  "        assert one(w, 'stria_worker_ring_steps', **{'pass': p}) == 2, p\n"
                  "        assert one(w, 'stria_worker_pass_seconds', "
                  "'stria_worker_pass_seconds_count',\n"
                  "                   **{'pass': p}) == 1, p\n"
                  "    for k in ('compute', 'communication'):\n"
                  "        assert one(w, 'stria_worker_step_seconds', "
                  "'stria_worker_step_seconds_count',\n"
                  "                   kind=k) == 4, k\n"
                  "        assert one(w, 'stria_worker_step_seconds', "
                  "'stria_worker_step_seconds_bucket',\n"
                  "                   kind=k, le='+Inf') == 4, k\n"
                  "    assert one(w, 'stria_worker_ring_bytes', direction='sent') > 0\n"
                  "    assert one(w, 'stria_worker_ring_bytes', direction='received') > 0\n"
                  "    rpc_in += one(w, 'stria_worker_rpc_bytes', direction='in')\n"
                  "    rpc_out += one(w, 'stria_worker_rpc_bytes', direction='out')\n"
                  "    assert one(w, 'stria_worker_memory_in_use_bytes') == 0\n"
                  "    # the job's memory is back in the pool, and kept (or, a minute later,\n"
                  "    # given back whole)\n"
                  "    assert one(w, 'stria_worker_pool_reserved_bytes', pool='host') == 1e9\n"
                  "    assert one(w, 'stria_worker_pool_in_use_bytes', pool='host') == 0\n"
                  "    hw = one(w, 'stria_worker_pool_high_water_bytes', pool='host')\n"
                  "    committed = one(w, 'stria_worker_pool_committed_bytes', pool='host')\n"
                  "    assert 0 < hw and (hw <= committed or committed == 0), (hw, committed)\n"
                  "    # the C heap: some in use, none of it the pool's (under the sanitizers\n"
                  "    # their allocator serves malloc, and glibc's mallinfo2() counts 0)\n"
                  "    heap = one(w, 'stria_worker_heap_in_use_bytes')\n"
                  "    assert (0 if sys.argv[6] == 'sanitized' else 1) <= heap < 1e9, heap\n"
                  "    assert one(w, 'stria_worker_heap_free_bytes') >= 0\n"
                  "    assert one(w, 'stria_worker_jobs') == 0\n"
                  "    assert 0 <= one(w, 'stria_worker_heartbeat_age_seconds') < 5\n"
                  "    errs = {s.labels['kind']: s.value for s in "
                  "w['stria_worker_errors'].samples}\n"
                  "    assert set(errs) == {'step_timeout', 'peer', 'pass', 'coordinator'}, errs\n"
                  "    assert sum(errs.values()) == 0, errs\n"
                  "    info = w['stria_worker_info'].samples[0]\n"
                  "    assert info.value == 1 and info.labels['device'] == 'cpu' and "
                  "info.labels['version']\n"
                  "# what one worker sent over the ring the other received\n"
                  "assert one(ws[0], 'stria_worker_ring_bytes', direction='sent') == \\\n"
                  "       one(ws[1], 'stria_worker_ring_bytes', direction='received')\n"
                  "assert one(ws[1], 'stria_worker_ring_bytes', direction='sent') == \\\n"
                  "       one(ws[0], 'stria_worker_ring_bytes', direction='received')\n"
                  "# clients sent Q, K, V, dO and fetched O, LSE, dQ, dK, dV: fp32, no padding\n"
                  "t = S * H * D * 4\n"
                  "assert rpc_in == 4 * t, (rpc_in, 4 * t)\n"
                  "assert rpc_out == 4 * t + H * S * 4, (rpc_out, 4 * t + H * S * 4)\n"
                  "print('coordinator', len(co), 'families; workers', len(ws[0]), 'families')\n";

static void scrape(const char *addr, const char *path)
{
    char *body = NULL;
    int code = dc_http_get(addr, "/metrics", &body);
    cr_assert_eq(code, 200, "GET http://%s/metrics: %d", addr, code);
    dc_write(path, body);
    free(body);
}

/* Waits until a worker holds no job (the coordinator tells it to drop a
 * released job at its next heartbeat). */
static void wait_worker_idle(const char *addr)
{
    for (int i = 0; i < 100; i++) {
        char *body = NULL;
        dc_http_get(addr, "/metrics", &body);
        bool idle = strstr(body, "\nstria_worker_jobs 0\n") != NULL &&
                    strstr(body, "\nstria_worker_memory_in_use_bytes 0\n") != NULL;
        free(body);
        if (idle)
            return;
        usleep(50000);
    }
}

Test(metrics, both_endpoints_after_a_job, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    dc_job_t j;
    dc_job_init(&j, &c, SEQ, HEADS, HEAD_DIM, 2);
    /* a refused submission first: counted as an error of its kind */
    j.spec.kv_heads = 3;
    cr_expect_neq(dc_job_forward(&j, NULL, NULL), STRIA_OK);
    j.spec.kv_heads = HEADS;
    cr_assert_eq(dc_job_forward(&j, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(dc_job_backward(&j), STRIA_OK, "%s", stria_error_msg());
    dc_job_free(&j);
    for (int i = 0; i < 2; i++)
        wait_worker_idle(c.worker_metrics[i]);
    usleep(200000); /* a coordinator tick refreshes its gauges */

    char paths[3][256];
    snprintf(paths[0], sizeof(paths[0]), "%s/coordinator.prom", c.dir);
    scrape(c.coord_metrics, paths[0]);
    for (int i = 0; i < 2; i++) {
        snprintf(paths[1 + i], sizeof(paths[1 + i]), "%s/worker%d.prom", c.dir, i);
        scrape(c.worker_metrics[i], paths[1 + i]);
    }
    char *argv[] = {STRIA_SYSTEM_PYTHON,
                    "-c",
                    (char *)check_script,
                    paths[0],
                    paths[1],
                    paths[2],
                    c.worker_rpc[0],
                    c.worker_rpc[1],
                    STRIA_TEST_SANITIZE ? "sanitized" : "plain",
                    NULL};
    char *out = NULL, *err = NULL;
    int rc = dc_run(argv, NULL, 60, &out, &err);
    if (rc != 0) {
        char *t0 = dc_read(paths[0]), *t1 = dc_read(paths[1]);
        cr_log_error("coordinator:\n%s\nworker 0:\n%s", t0, t1);
        free(t0);
        free(t1);
    }
    cr_expect_eq(rc, 0, "the scrapes do not hold what they should:\n%s", err);
    cr_log_info("%s", out);
    free(out);
    free(err);

    /* other paths are refused */
    char *body = NULL;
    cr_expect_eq(dc_http_get(c.coord_metrics, "/", &body), 404);
    free(body);
    cr_expect_eq(dc_http_get(c.worker_metrics[0], "/metricsx", &body), 404);
    free(body);
    dc_stop(&c);
}
