/* striactl against a real coordinator and workers: every command in human
 * and --json form (JSON checked by python3's json module, field names
 * included), drain and undrain, cancel with a reason, and the documented exit
 * codes and messages (0 ok, 1 refused, 2 usage, 3 unreachable, 4 auth). */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "deploy_util.h"

#define SUITE_TIMEOUT 120

/* The documented --json field names (docs/DEPLOY.md). */
#define PY_FIELDS                                                                                  \
    "import json, sys\n"                                                                           \
    "WORKER = {'id', 'state', 'host', 'device', 'rpc_address', 'ucx_address',\n"                   \
    "          'heartbeat_age_ms', 'memory_bytes', 'memory_reserved_bytes',\n"                     \
    "          'memory_in_use_bytes', 'pool_reserved_bytes', 'pool_in_use_bytes',\n"               \
    "          'pool_high_water_bytes', 'pool_committed_bytes', 'current_job', 'step',\n"          \
    "          'steps_total', 'ring_index',\n"                                                     \
    "          'draining', 'version', 'kernel', 'jobs'}\n"                                         \
    "STATUS = {'coordinator', 'version', 'protocol_version', 'uptime_ms',\n"                       \
    "          'heartbeat_period_ms', 'job_ttl_s', 'workers_healthy', 'workers_draining',\n"       \
    "          'workers_dead', 'workers_left', 'jobs_pending', 'jobs_active', 'jobs_submitted',\n" \
    "          'jobs_failed', 'ring'}\n"                                                           \
    "JOB = {'id', 'state', 'failure', 'failure_retryable', 'blamed_worker_ids',\n"                 \
    "       'replaced_by', 'replaces', 'generation', 'replacement_pending',\n"                     \
    "       'queue_position', 'step', 'steps_total', 'spec',\n"                                    \
    "       'memory_per_rank_bytes', 'ranks', 'timings_ms'}\n"                                     \
    "SPEC = {'batch', 'seq_len', 'heads', 'kv_heads', 'head_dim', 'dtype', 'causal',\n"            \
    "        'layout', 'ring_size', 'scale', 'label', 'sharded', 'arrival_timeout_s',\n"           \
    "        'session'}\n"                                                                         \
    "RANK = {'rank', 'worker', 'host', 'rpc_address', 'device', 'tokens'}\n"                       \
    "RANK_OPTIONAL = {'device_index', 'placed_on', 'placed_device_index', 'placement_fallback'}\n" \
    "TIMINGS = {'submitted', 'started', 'forward_started', 'forward_done',\n"                      \
    "           'backward_started', 'backward_done', 'finished', 'last_activity'}\n"               \
    "def job_ok(j):\n"                                                                             \
    "    assert JOB <= set(j) <= JOB | {'session'}, set(j) ^ JOB\n"                                \
    "    assert set(j['spec']) == SPEC, set(j['spec']) ^ SPEC\n"                                   \
    "    assert set(j['timings_ms']) == TIMINGS, set(j['timings_ms']) ^ TIMINGS\n"                 \
    "    for r in j['ranks']:\n"                                                                   \
    "        assert RANK <= set(r) <= RANK | RANK_OPTIONAL, set(r) ^ RANK\n"                       \
    "d = json.loads(sys.argv[1])\n"

/* Runs `script` (after PY_FIELDS) on JSON text; fails the test with python's
 * message. */
static void check_json(const char *what, const char *json, const char *script)
{
    size_t n = strlen(PY_FIELDS) + strlen(script) + 1;
    char *full = malloc(n), *err = NULL;
    cr_assert_not_null(full);
    snprintf(full, n, "%s%s", PY_FIELDS, script);
    int rc = dc_python(full, json, &err);
    cr_expect_eq(rc, 0, "%s: %s\n%s", what, err, json);
    free(err);
    free(full);
}

/* striactl [--token-file tok] ARGS... (NULL-terminated); expects exit code
 * `want`; returns stdout (or stderr when `want_err`), malloc'ed. */
static char *ctl_v(const dcluster_t *c, const char *tok, int want, bool want_err, va_list ap)
{
    char *argv[32], tokopt[300], cmdline[512] = "";
    int n = 0;
    argv[n++] = STRIACTL_BIN;
    argv[n++] = "--coordinator";
    argv[n++] = (char *)c->coord_addr;
    if (tok != NULL) {
        snprintf(tokopt, sizeof(tokopt), "--token-file=%.250s", tok);
        argv[n++] = tokopt;
    }
    for (char *a; (a = va_arg(ap, char *)) != NULL && n < 31;) {
        argv[n++] = a;
        strncat(cmdline, " ", sizeof(cmdline) - strlen(cmdline) - 1);
        strncat(cmdline, a, sizeof(cmdline) - strlen(cmdline) - 1);
    }
    argv[n] = NULL;
    char *out = NULL, *err = NULL;
    int rc = dc_run(argv, NULL, 30, &out, &err);
    cr_expect_eq(rc, want, "striactl%s: exit %d, expected %d\nstdout: %s\nstderr: %s", cmdline, rc,
                 want, out, err);
    if (want_err) {
        free(out);
        return err;
    }
    free(err);
    return out;
}

static char *ctl(const dcluster_t *c, const char *tok, int want, ...)
{
    va_list ap;
    va_start(ap, want);
    char *out = ctl_v(c, tok, want, false, ap);
    va_end(ap);
    return out;
}

static char *ctl_err(const dcluster_t *c, const char *tok, int want, ...)
{
    va_list ap;
    va_start(ap, want);
    char *err = ctl_v(c, tok, want, true, ap);
    va_end(ap);
    return err;
}

#define CTL(c, tok, want, ...)     ctl(c, tok, want, __VA_ARGS__, (char *)NULL)
#define CTL_ERR(c, tok, want, ...) ctl_err(c, tok, want, __VA_ARGS__, (char *)NULL)

static void expect_has(const char *what, const char *text, const char *needle)
{
    cr_expect(strstr(text, needle) != NULL, "%s lacks '%s':\n%s", what, needle, text);
}

/* In an aligned table, the column `col` starts at the same offset in the
 * header line and in every line that contains `row_key`, and holds `value`
 * there. */
static void expect_aligned(const char *table, const char *col, const char *row_key,
                           const char *value)
{
    const char *head = strstr(table, "RANK ");
    cr_assert_not_null(head, "no table header:\n%s", table);
    const char *h = strstr(head, col);
    cr_assert_not_null(h);
    size_t off = (size_t)(h - head);
    int rows = 0;
    for (const char *p = head; *p;) {
        size_t ll = strcspn(p, "\n");
        if (p != head && memmem(p, ll, row_key, strlen(row_key)) != NULL) {
            cr_expect(ll > off && strncmp(p + off, value, strlen(value)) == 0,
                      "column %s is not aligned in '%.*s'", col, (int)ll, p);
            rows++;
        }
        p += ll;
        if (*p == '\n')
            p++;
    }
    cr_expect(rows > 0, "no row with '%s':\n%s", row_key, table);
}

Test(striactl, every_command_human_and_json, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 3, NULL);
    dc_job_t j;
    dc_job_init(&j, &c, 96, 2, 32, 0);
    cr_assert_eq(dc_job_forward(&j, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    char id[32], script[2048];
    snprintf(id, sizeof(id), "%llu", (unsigned long long)stria_job_id(j.job));

    /* status */
    char *out = CTL(&c, NULL, 0, "status");
    expect_has("status", out, c.coord_addr);
    expect_has("status", out, "version 0.1.0");
    expect_has("status", out, "workers: 3 healthy, 0 draining, 0 dead, 0 left");
    expect_has("status", out, "jobs: 1 active, 0 pending, 1 submitted, 0 failed");
    expect_has("status", out,
               "RANK  WORKER  HOST  DEVICE  STATE    HEARTBEAT  JOB  STEP  JOBS  MEMORY");
    expect_has("status", out, "  POOL  ");
    for (int i = 0; i < 3; i++) {
        expect_has("status", out, c.worker_rpc[i]);
        expect_aligned(out, "STATE", c.worker_rpc[i], "healthy");
        expect_aligned(out, "DEVICE", c.worker_rpc[i], "cpu");
    }
    cr_log_info("striactl status:\n%s", out);
    free(out);
    out = CTL(&c, NULL, 0, "--json", "status");
    snprintf(script, sizeof(script),
             "assert set(d) == STATUS, set(d) ^ STATUS\n"
             "assert d['coordinator'] == '%s' and d['version'] == '0.1.0', d\n"
             "assert d['workers_healthy'] == 3 and d['jobs_active'] == 1, d\n"
             "assert [m['rank'] for m in d['ring']] == [0, 1, 2], d['ring']\n"
             "for m in d['ring']:\n"
             "    w = m['worker']\n"
             "    assert set(w) == WORKER, set(w) ^ WORKER\n"
             "    assert w['state'] == 'healthy' and w['ring_index'] == m['rank'], w\n"
             "    assert w['jobs'] == [%s] and w['memory_reserved_bytes'] > 0, w\n"
             "    assert w['pool_reserved_bytes'] == 1000000000, w\n"
             "    assert 0 <= w['heartbeat_age_ms'] < 5000, w\n",
             c.coord_addr, id);
    check_json("status --json", out, script);
    free(out);
    /* global options may follow the command */
    out = CTL(&c, NULL, 0, "status", "--json");
    check_json("status --json (after)", out, "assert d['workers_healthy'] == 3\n");
    free(out);

    /* workers */
    out = CTL(&c, NULL, 0, "workers");
    for (int i = 0; i < 3; i++)
        expect_aligned(out, "ADDRESS", c.worker_rpc[i], c.worker_rpc[i]);
    free(out);
    out = CTL(&c, NULL, 0, "--json", "workers");
    check_json("workers --json", out,
               "assert set(d) == {'workers'} and len(d['workers']) == 3, d\n"
               "for w in d['workers']:\n"
               "    assert set(w) == WORKER, set(w) ^ WORKER\n");
    free(out);

    /* jobs, job ID */
    out = CTL(&c, NULL, 0, "jobs");
    expect_has("jobs", out, "forward-done");
    expect_has("jobs", out, "deploy test");
    expect_has("jobs", out, "b1 h2/2 d32 fp32 causal");
    free(out);
    out = CTL(&c, NULL, 0, "--json", "jobs");
    snprintf(script, sizeof(script),
             "assert set(d) == {'jobs'} and len(d['jobs']) == 1, d\n"
             "job_ok(d['jobs'][0])\n"
             "assert d['jobs'][0]['id'] == %s\n",
             id);
    check_json("jobs --json", out, script);
    free(out);
    out = CTL(&c, NULL, 0, "job", id);
    expect_has("job", out, "forward-done");
    expect_has("job", out,
               "spec: batch 1, seq_len 96, heads 2, kv_heads 2, head_dim 32, fp32, "
               "causal, striped layout");
    expect_has("job", out, "assignment: 3 ranks");
    expect_has("job", out, "forward done");
    for (int i = 0; i < 3; i++)
        expect_has("job", out, c.worker_rpc[i]);
    free(out);
    out = CTL(&c, NULL, 0, "--json", "job", id);
    snprintf(script, sizeof(script),
             "job_ok(d)\n"
             "assert d['id'] == %s and d['state'] == 'forward-done', d\n"
             "assert d['spec']['seq_len'] == 96 and d['spec']['ring_size'] == 3, d['spec']\n"
             "assert d['spec']['label'] == 'deploy test' and d['spec']['causal'] is True\n"
             "assert [r['rank'] for r in d['ranks']] == [0, 1, 2]\n"
             "assert sum(r['tokens'] for r in d['ranks']) == 96\n"
             "t = d['timings_ms']\n"
             "assert 0 < t['submitted'] <= t['forward_started'] <= t['forward_done'], t\n"
             "assert t['backward_started'] == 0 and t['finished'] == 0, t\n",
             id);
    check_json("job --json", out, script);
    free(out);

    /* finished jobs appear with --all only */
    cr_expect_eq(dc_job_backward(&j), STRIA_OK, "%s", stria_error_msg());
    dc_job_free(&j);
    out = CTL(&c, NULL, 0, "jobs");
    expect_has("jobs", out, "no active or queued jobs");
    free(out);
    out = CTL(&c, NULL, 0, "jobs", "--all");
    expect_has("jobs --all", out, "released");
    free(out);
    out = CTL(&c, NULL, 0, "--json", "jobs", "--all");
    check_json("jobs --all --json", out,
               "assert [j['state'] for j in d['jobs']] == ['released'], d\n"
               "job_ok(d['jobs'][0])\n"
               "t = d['jobs'][0]['timings_ms']\n"
               "assert t['backward_done'] <= t['finished'], t\n");
    free(out);
    dc_stop(&c);
}

/* The rpc addresses of a job's ranks, from `striactl --json job`. */
static void expect_job_workers(dcluster_t *c, uint64_t job, const char *has, const char *lacks)
{
    char id[32], script[1024];
    snprintf(id, sizeof(id), "%llu", (unsigned long long)job);
    char *out = CTL(c, NULL, 0, "--json", "job", id);
    snprintf(script, sizeof(script),
             "addrs = [r['rpc_address'] for r in d['ranks']]\n"
             "assert '%s' in addrs and '%s' not in addrs, addrs\n",
             has, lacks);
    check_json("job --json", out, script);
    free(out);
}

Test(striactl, drain_keeps_running_jobs_and_takes_no_new_ones, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 3, NULL);
    dc_job_t a, b;
    dc_job_init(&a, &c, 96, 2, 32, 0);
    cr_assert_eq(dc_job_forward(&a, NULL, NULL), STRIA_OK, "%s", stria_error_msg());

    /* drain worker 0 by its id while it holds job a; in the JSON a worker
     * object starts with its id, so the id is the last one before its address */
    char script[1024], wid[16] = "";
    char *out = CTL(&c, NULL, 0, "--json", "workers");
    const char *p = strstr(out, c.worker_rpc[0]);
    cr_assert_not_null(p);
    for (const char *q = out; (q = strstr(q, "\"id\":")) != NULL && q < p; q++)
        snprintf(wid, sizeof(wid), "%ld", strtol(q + 5, NULL, 10));
    free(out);
    cr_assert(wid[0] != '\0');
    out = CTL(&c, NULL, 0, "drain", wid);
    char want[400];
    snprintf(want, sizeof(want), "worker %s (%.200s): draining (finishing its jobs)", wid,
             c.worker_rpc[0]);
    expect_has("drain", out, want);
    free(out);
    out = CTL(&c, NULL, 0, "--json", "status");
    snprintf(script, sizeof(script),
             "assert d['workers_healthy'] == 2 and d['workers_draining'] == 1, d\n"
             "w = [m for m in d['ring'] if m['worker']['id'] == %s][0]\n"
             "assert w['rank'] == -1 and w['worker']['state'] == 'draining', w\n"
             "assert w['worker']['draining'] is True and w['worker']['jobs'] == [%llu], w\n",
             wid, (unsigned long long)stria_job_id(a.job));
    check_json("status after drain", out, script);
    free(out);
    out = CTL(&c, NULL, 0, "status");
    expect_aligned(out, "STATE", c.worker_rpc[0], "draining");
    free(out);

    /* the next job runs on the two others; job a still finishes on all three */
    dc_job_init(&b, &c, 64, 2, 32, 0);
    cr_assert_eq(dc_job_forward(&b, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(stria_job_ring_size(b.job), 2);
    expect_job_workers(&c, stria_job_id(b.job), c.worker_rpc[1], c.worker_rpc[0]);
    cr_expect_eq(dc_job_backward(&a), STRIA_OK, "the drained worker did not finish its job: %s",
                 stria_error_msg());
    cr_expect_eq(dc_job_backward(&b), STRIA_OK, "%s", stria_error_msg());
    dc_job_free(&a);
    dc_job_free(&b);

    /* undrain by RPC address: back in the ring, and in new jobs */
    out = CTL(&c, NULL, 0, "--json", "undrain", c.worker_rpc[0]);
    snprintf(script, sizeof(script),
             "assert set(d) == {'worker'}, d\n"
             "assert set(d['worker']) == WORKER, set(d['worker']) ^ WORKER\n"
             "assert d['worker']['state'] == 'healthy' and d['worker']['rpc_address'] == '%s'\n",
             c.worker_rpc[0]);
    check_json("undrain --json", out, script);
    free(out);
    out = CTL(&c, NULL, 0, "undrain", c.worker_rpc[0]); /* idempotent */
    expect_has("undrain", out, "undrained");
    free(out);
    dc_job_init(&b, &c, 64, 2, 32, 0);
    cr_assert_eq(dc_job_forward(&b, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(stria_job_ring_size(b.job), 3);
    dc_job_free(&b);
    dc_stop(&c);
}

Test(striactl, cancel_with_a_reason, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    dc_job_t j;
    dc_job_init(&j, &c, 64, 2, 32, 0);
    cr_assert_eq(dc_job_forward(&j, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    char id[32], script[1024];
    snprintf(id, sizeof(id), "%llu", (unsigned long long)stria_job_id(j.job));
    char *out = CTL(&c, NULL, 0, "cancel", id, "--reason", "maintenance window");
    char want[64];
    snprintf(want, sizeof(want), "job %s: cancelled", id);
    expect_has("cancel", out, want);
    free(out);
    out = CTL(&c, NULL, 0, "--json", "job", id);
    snprintf(script, sizeof(script),
             "job_ok(d)\n"
             "assert d['state'] == 'cancelled', d\n"
             "assert 'cancelled by an admin' in d['failure'], d['failure']\n"
             "assert d['failure'].endswith(': maintenance window'), d['failure']\n"
             "assert d['failure_retryable'] is False, d\n"
             "assert d['timings_ms']['finished'] > 0\n");
    check_json("job after cancel", out, script);
    free(out);
    out = CTL(&c, NULL, 0, "job", id);
    expect_has("job", out, "maintenance window");
    free(out);
    /* again, JSON, reason first: the state stays */
    out = CTL(&c, NULL, 0, "--json", "cancel", "--reason", "again", id);
    snprintf(script, sizeof(script), "assert d == {'id': %s, 'state': 'cancelled'}, d\n", id);
    check_json("cancel --json", out, script);
    free(out);
    /* the client hears it */
    cr_expect_neq(dc_job_backward(&j), STRIA_OK);
    cr_log_info("backward of a cancelled job: %s", stria_error_msg());
    dc_job_free(&j);
    dc_stop(&c);
}

Test(striactl, exit_codes_and_messages, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_init(&c);
    /* 3: nobody listens there, with a message naming the address */
    snprintf(c.coord_addr, sizeof(c.coord_addr), "127.0.0.1:%d", dc_free_port());
    char want[300];
    snprintf(want, sizeof(want), "cannot reach the coordinator at %.200s", c.coord_addr);
    char *err = CTL_ERR(&c, NULL, 3, "status");
    expect_has("unreachable", err, want);
    free(err);
    err = CTL_ERR(&c, NULL, 3, "--json", "drain", "1");
    expect_has("unreachable", err, want);
    free(err);
    /* 2: usage errors are caught before connecting */
    const char *usage[][3] = {
        {"frobnicate", NULL, NULL},  {"job", NULL, NULL},     {"job", "abc", NULL},
        {"cancel", "-4", NULL},      {"drain", NULL, NULL},   {"status", "extra", NULL},
        {"--bogus", "status", NULL}, {"jobs", "--bad", NULL}, {"--timeout", "-1", "status"},
        {"cancel", "7", "--why"},
    };
    for (size_t i = 0; i < sizeof(usage) / sizeof(usage[0]); i++) {
        char *out = NULL;
        int rc = dc_striactl(&c, NULL, &out, &err, usage[i][0], usage[i][1], usage[i][2], NULL);
        cr_expect_eq(rc, 2, "striactl %s %s: exit %d, expected 2 (%s)", usage[i][0],
                     usage[i][1] ? usage[i][1] : "", rc, err);
        cr_expect(strstr(err, "striactl") != NULL && strlen(err) > 20, "no message: '%s'", err);
        free(out);
        free(err);
    }
    char *argv[] = {STRIACTL_BIN, NULL};
    char *out = NULL;
    cr_expect_eq(dc_run(argv, NULL, 10, &out, &err), 2);
    expect_has("no command", err, "usage: striactl");
    free(out);
    free(err);
    char *help[] = {STRIACTL_BIN, "--help", NULL};
    cr_expect_eq(dc_run(help, NULL, 10, &out, &err), 0);
    expect_has("--help", out, "exit status: 0 success; 1");
    free(out);
    free(err);

    /* 1: a running coordinator that does not know the names */
    dc_start_coordinator(&c, NULL);
    dc_start_worker(&c, 0, NULL);
    dc_wait_healthy(&c, 1, NULL);
    err = CTL_ERR(&c, NULL, 1, "drain", "999");
    expect_has("unknown worker", err, "no worker '999'");
    free(err);
    err = CTL_ERR(&c, NULL, 1, "undrain", "10.9.9.9:7500");
    expect_has("unknown worker", err, "no worker '10.9.9.9:7500'");
    free(err);
    err = CTL_ERR(&c, NULL, 1, "job", "999");
    expect_has("unknown job", err, "striactl: GetJob: job 999 is unknown");
    free(err);
    err = CTL_ERR(&c, NULL, 1, "--json", "cancel", "999");
    expect_has("unknown job", err, "job 999 is unknown");
    free(err);

    /* $STRIA_COORDINATOR names the coordinator when --coordinator is absent */
    char env_coord[300];
    snprintf(env_coord, sizeof(env_coord), "STRIA_COORDINATOR=%.200s", c.coord_addr);
    char *env[] = {env_coord, NULL};
    char *plain[] = {STRIACTL_BIN, "workers", NULL};
    cr_expect_eq(dc_run(plain, env, 10, &out, &err), 0, "%s", err);
    expect_has("workers via $STRIA_COORDINATOR", out, c.worker_rpc[0]);
    free(out);
    free(err);
    dc_stop(&c);
}

Test(striactl, tokens_and_exit_code_4, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_init(&c);
    char tok[256], wtok[256], adm[256];
    snprintf(tok, sizeof(tok), "%s/token", c.dir);
    snprintf(wtok, sizeof(wtok), "%s/worker-token", c.dir);
    snprintf(adm, sizeof(adm), "%s/admin-token", c.dir);
    dc_write(tok, "service-secret\n");
    dc_write(wtok, "worker-secret\n");
    dc_write(adm, "admin-secret\n");
    dc_opts_t o = {.token_file = tok, .worker_token_file = wtok, .admin_token_file = adm};
    dc_start_coordinator(&c, &o);
    dc_start_worker(&c, 0, &o);
    dc_wait_healthy(&c, 1, tok);

    char *err = CTL_ERR(&c, NULL, 4, "status");
    expect_has("no token", err, "token");
    free(err);
    char *out = CTL(&c, tok, 0, "workers");
    expect_has("workers with the token", out, c.worker_rpc[0]);
    free(out);
    err = CTL_ERR(&c, tok, 4, "drain", c.worker_rpc[0]);
    expect_has("drain without the admin token", err, "admin token");
    free(err);
    out = CTL(&c, adm, 0, "drain", c.worker_rpc[0]);
    free(out);
    out = CTL(&c, adm, 0, "undrain", c.worker_rpc[0]);
    free(out);
    char missing[300];
    snprintf(missing, sizeof(missing), "%s/nope", c.dir);
    err = CTL_ERR(&c, missing, 2, "status");
    expect_has("missing token file", err, missing);
    free(err);
    dc_stop(&c);
}

typedef struct {
    dc_job_t job;
    stria_status_t st;
    char msg[512]; /* the thread's error message when st is not STRIA_OK */
    volatile bool done;
} bg_job_t;

/* The job's forward pass, then its backward pass: two passes of three steps
 * each give the status checks a window of several heartbeats however fast
 * the kernels are. */
static void *bg_job_thread(void *arg)
{
    bg_job_t *b = arg;
    b->st = dc_job_forward(&b->job, NULL, NULL);
    if (b->st == STRIA_OK)
        b->st = dc_job_backward(&b->job);
    if (b->st != STRIA_OK)
        snprintf(b->msg, sizeof(b->msg), "%s", stria_error_msg());
    b->done = true;
    return NULL;
}

/* The first worker's job running now in `--json status` (job ids are random:
 * the test learns them from the service), or 0. */
static uint64_t running_job(const char *json)
{
    for (const char *p = json; (p = strstr(p, "\"current_job\":")) != NULL;) {
        p += strlen("\"current_job\":");
        uint64_t id = strtoull(p, NULL, 10);
        if (id != 0)
            return id;
    }
    return 0;
}

Test(striactl, status_shows_the_running_job_and_its_step, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 3, NULL);
    bg_job_t b;
    memset(&b, 0, sizeof(b));
    /* passes long enough for heartbeats (every 0.2 s) to report their steps;
     * the sanitizer build computes several times slower */
    dc_job_init(&b.job, &c, STRIA_TEST_SANITIZE ? 8192 : 32768, 2, 64, 3);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, bg_job_thread, &b), 0);
    bool json_seen = false, human_seen = false;
    char id_text[32] = "";
    while (!b.done && !(json_seen && human_seen)) {
        char *out = NULL;
        if (!json_seen) {
            out = CTL(&c, NULL, 0, "--json", "status");
            /* past the first step of a pass: the ring engine reports its steps */
            uint64_t id = running_job(out);
            json_seen = id != 0 && strstr(out, "\"steps_total\":3,") != NULL &&
                        (strstr(out, "\"step\":1,") != NULL || strstr(out, "\"step\":2,") != NULL);
            snprintf(id_text, sizeof(id_text), "%llu ", (unsigned long long)id);
        } else {
            out = CTL(&c, NULL, 0, "status");
            const char *row = strstr(out, c.worker_rpc[0]);
            human_seen = row != NULL && (strstr(out, " 1/3 ") || strstr(out, " 2/3 "));
            if (human_seen) {
                expect_aligned(out, "JOB", c.worker_rpc[0], id_text);
                cr_log_info("striactl status during a pass:\n%s", out);
            }
        }
        free(out);
        usleep(20000);
    }
    pthread_join(th, NULL);
    cr_expect_eq(b.st, STRIA_OK, "%s", b.msg);
    cr_expect(json_seen, "--json status never showed the job past the first step of 3 of a pass");
    cr_expect(human_seen, "status never showed the step of the job");
    dc_job_free(&b.job);
    dc_stop(&c);
}

/* striactl session ID --timeline: every rank keeps the step times of the
 * calls numbered 0, 64, 128, ... and reports them in its next heartbeat; the
 * SVG holds the latest sampled forward and backward call, a row per rank. */
static const char session_svg_check[] =
    "import sys, xml.etree.ElementTree as ET\n"
    "NS = '{http://www.w3.org/2000/svg}'\n"
    "root = ET.parse(sys.argv[1]).getroot()\n"
    "cls = lambda e: e.get('class', '')\n"
    "panels = [g for g in root.iter(NS + 'g') if cls(g) == 'panel']\n"
    "names = [p.get('data-name') for p in panels]\n"
    "assert names == ['forward call 0', 'backward call 64'], names\n"
    "for p in panels:\n"
    "    rows = [g for g in p.iter(NS + 'g') if cls(g) == 'row']\n"
    "    assert [int(r.get('data-rank')) for r in rows] == [0, 1, 2], rows\n"
    "texts = {cls(t): ''.join(t.itertext()) for t in root.iter(NS + 'text')}\n"
    "assert texts['title'].startswith('session '), texts['title']\n"
    "assert 'sampled calls' in texts['subtitle'], texts['subtitle']\n";

Test(striactl, session_timeline_draws_the_sampled_calls, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 3, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_striactl", 0);
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    sp.max_batch = 1;
    sp.max_seq_len = 96;
    sp.heads = sp.kv_heads = 2;
    sp.head_dim = 16;
    sp.dtype = STRIA_DTYPE_F32;
    sp.layout = STRIA_LAYOUT_STRIPED;
    sp.ring_size = 3;
    stria_session_t *s = NULL;
    cr_assert_eq(stria_session_open(cl, &sp, &s), STRIA_OK, "%s", stria_error_msg());
    char path[300], id[24];
    snprintf(id, sizeof(id), "%llu", (unsigned long long)stria_session_id(s));
    snprintf(path, sizeof(path), "%s/session-timeline.svg", c.dir);
    char *err = CTL_ERR(&c, NULL, 1, "session", id, "--timeline", path);
    expect_has("session --timeline before a call", err, "no call timelines yet");
    free(err);
    err = NULL;

    enum { N = 96 * 2 * 16 };
    float *t = calloc(8 * (size_t)N + 96 * 2, sizeof(float));
    cr_assert_not_null(t);
    float *q = t, *k = t + N, *v = t + 2 * N, *o = t + 3 * N, *d_o = t + 4 * N, *dq = t + 5 * N,
          *dk = t + 6 * N, *dv = t + 7 * N, *lse = t + 8 * N;
    for (int i = 0; i < 5 * N; i++)
        t[i] = (float)((i * 37 % 101) - 50) / 64.0f;
    stria_call_t call = STRIA_CALL_INIT;
    call.batch = 1;
    call.seq_len = 96;
    call.causal = true;
    for (int i = 0; i < 64; i++) /* calls 0..63 */
        cr_assert_eq(stria_session_forward(s, &call, q, k, v, o, lse), STRIA_OK, "call %d: %s", i,
                     stria_error_msg());
    cr_assert_eq(stria_session_backward(s, &call, q, k, v, o, lse, d_o, dq, dk, dv), STRIA_OK,
                 "call 64: %s", stria_error_msg());
    /* heartbeats every 0.2 s bring every rank's timelines */
    int rc = -1;
    for (int tries = 0; tries < 50 && rc != 0; tries++) {
        char *out = NULL;
        free(err);
        err = NULL;
        if (dc_striactl(&c, NULL, &out, &err, "session", id, "--timeline", path, NULL) == 0 &&
            strstr(out, "timeline written to") != NULL) {
            free(err);
            rc = dc_python(session_svg_check, path, &err);
        }
        free(out);
        if (rc != 0)
            usleep(100000);
    }
    cr_expect_eq(rc, 0, "the SVG of striactl session --timeline: %s", err);
    free(err);
    free(t);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

/* A job cancelled while its forward pass runs: every worker aborts the pass
 * at its next step (it hears of the cancel in a heartbeat reply) instead of
 * computing to the end; the workers log the failure, the client gets an
 * error, and the workers serve the next job. */
static bool all_workers_logged(const dcluster_t *c, int n, const char *needle)
{
    for (int i = 0; i < n; i++) {
        char *log = dc_read(c->worker_log[i]);
        bool has = log != NULL && strstr(log, needle) != NULL;
        free(log);
        if (!has)
            return false;
    }
    return true;
}

Test(striactl, cancel_stops_a_running_pass, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    /* Three steps of about a second each here (two in the sanitizer build),
     * several times longer on a loaded machine: the step deadline (5 s, and
     * 20 s by the end of a pass of three ranks) must not be what ends a pass
     * in this test. Heartbeats every 0.5 s: the cancel still reaches the
     * workers within a step, and a worker starved of the CPU for 0.6 s by
     * the sanitizer build's other suites is not declared dead (3 periods). */
    dc_opts_t o = {.heartbeat_period_s = 0.5, .step_timeout_s = 60.0};
    dc_start(&c, 3, &o);
    const int64_t seq = STRIA_TEST_SANITIZE ? 16384 : 32768;
    dc_job_t a;
    dc_job_init(&a, &c, seq, 4, 64, 3);
    double t0 = stria_time_now();
    cr_assert_eq(dc_job_forward(&a, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    double full = stria_time_now() - t0; /* the first job: the whole pass */
    dc_job_free(&a);

    bg_job_t b;
    memset(&b, 0, sizeof(b));
    dc_job_init(&b.job, &c, seq, 4, 64, 3);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, bg_job_thread, &b), 0);
    uint64_t id = 0;
    while (!b.done && id == 0) {
        char *out = CTL(&c, NULL, 0, "--json", "status");
        id = running_job(out);
        free(out);
        if (id == 0)
            usleep(20000);
    }
    cr_assert(id != 0, "the second job never showed as running");
    char id_text[32], failed[96];
    snprintf(id_text, sizeof(id_text), "%llu", (unsigned long long)id);
    snprintf(failed, sizeof(failed), "job %llu forward pass failed", (unsigned long long)id);
    double tc = stria_time_now();
    char *out = CTL(&c, NULL, 0, "cancel", id_text, "--reason", "test of a running pass");
    free(out);
    bool all = false;
    while (!all && stria_time_now() - tc < full + 30.0) {
        all = all_workers_logged(&c, 3, failed);
        if (!all)
            usleep(50000);
    }
    double took = stria_time_now() - tc;
    pthread_join(th, NULL);
    cr_expect(all, "not every worker ended the second job's pass with a failure in %.1f s", took);
    cr_expect(took < 0.8 * full + 0.5,
              "the passes ended %.2f s after the cancel; a whole pass takes %.2f s", took, full);
    cr_expect_neq(b.st, STRIA_OK, "the client's forward of a cancelled job succeeded");
    /* the client's message says why, naming the phase and the rank once
     * (the function, or the pass the workers failed) */
    const char *first = strstr(b.msg, "forward");
    /* the workers' account, or (a worker still inside a long step 2 s
     * after the cancel) libstria's, which gave up on it */
    cr_expect(strstr(b.msg, "is over at the coordinator") != NULL ||
                  strstr(b.msg, "(cancelled): cancelled by an admin") != NULL,
              "%s", b.msg);
    cr_expect(first != NULL && strstr(first + 1, "forward") == NULL, "%s", b.msg);
    cr_expect(strstr(b.msg, "rank 0: rank 0") == NULL && strstr(b.msg, "rank 1: rank 1") == NULL &&
                  strstr(b.msg, "rank 2: rank 2") == NULL,
              "%s", b.msg);
    cr_log_info("cancelled pass: ended %.2f s after the cancel (whole pass %.2f s); client: %s",
                took, full, b.msg);
    dc_job_free(&b.job);
    /* the workers are free for the next job */
    dc_job_t d;
    dc_job_init(&d, &c, 256, 2, 32, 3);
    cr_expect_eq(dc_job_forward(&d, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    dc_job_free(&d);
    dc_stop(&c);
}

/* A pass of a job cancelled since the workers' last heartbeat fails: the
 * workers hear that the job is over in the reply to their report of the
 * pass, not only in a heartbeat reply (here 30 s away), and its outputs
 * never reach the client. */
Test(striactl, cancel_reaches_the_next_pass_before_a_heartbeat, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_opts_t o = {.heartbeat_period_s = 30.0};
    dc_start(&c, 2, &o);
    dc_job_t j;
    dc_job_init(&j, &c, 64, 2, 32, 0);
    cr_assert_eq(dc_job_forward(&j, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    char id[32];
    snprintf(id, sizeof(id), "%llu", (unsigned long long)stria_job_id(j.job));
    free(CTL(&c, NULL, 0, "cancel", id, "--reason", "between passes"));
    double t0 = stria_time_now();
    cr_expect_neq(dc_job_backward(&j), STRIA_OK, "the backward of a cancelled job ran");
    double took = stria_time_now() - t0;
    /* every worker failed the pass (the client's message names one rank's
     * view; a rank whose link setup lost the race to its peer's abort may
     * explain it otherwise) */
    bool all = false;
    for (int tries = 0; tries < 100 && !all; tries++) {
        all = all_workers_logged(&c, 2, "backward pass failed");
        if (!all)
            usleep(50000);
    }
    cr_expect(all, "not every worker failed the pass of the cancelled job");
    cr_expect(took < 10.0, "the backward failed only after %.1f s", took);
    cr_log_info("backward %.2f s after the cancel: %s", took, stria_error_msg());
    dc_job_free(&j);
    dc_stop(&c);
}

/* striactl job ID --timeline: the step times the workers reported with the
 * passes of a real job, drawn as an SVG that python3's XML parser reads: a
 * forward and a backward panel, a row per rank, compute and wait shapes, a
 * legend, an axis label and the job's shape in the title. */
Test(striactl, job_timeline_draws_the_reported_passes, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_job_t j;
    char path[300], id[24];
    dc_start(&c, 3, NULL);
    dc_job_init(&j, &c, 3000, 2, 64, 3);
    cr_assert_eq(dc_job_forward(&j, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(dc_job_backward(&j), STRIA_OK, "%s", stria_error_msg());
    snprintf(id, sizeof(id), "%llu", (unsigned long long)stria_job_id(j.job));
    snprintf(path, sizeof(path), "%s/job-timeline.svg", c.dir);
    char *out = CTL(&c, NULL, 0, "job", id, "--timeline", path);
    expect_has("job --timeline", out, "timeline written to");
    free(out);
    char *err = NULL;
    char script[2048];
    snprintf(script, sizeof(script),
             "import sys, xml.etree.ElementTree as ET\n"
             "NS = '{http://www.w3.org/2000/svg}'\n"
             "root = ET.parse(sys.argv[1]).getroot()\n"
             "assert root.tag == NS + 'svg', root.tag\n"
             "cls = lambda e: e.get('class', '')\n"
             "panels = [g for g in root.iter(NS + 'g') if cls(g) == 'panel']\n"
             "names = [p.get('data-name') for p in panels]\n"
             "assert names == ['forward pass 0', 'backward pass 1'], names\n"
             "for p in panels:\n"
             "    rows = [g for g in p.iter(NS + 'g') if cls(g) == 'row']\n"
             "    assert [int(r.get('data-rank')) for r in rows] == [0, 1, 2], rows\n"
             "kinds = {cls(r) for r in root.iter(NS + 'rect')}\n"
             "assert {'compute', 'wait', 'bg'} <= kinds, kinds\n"
             "texts = {cls(t): ''.join(t.itertext()) for t in root.iter(NS + 'text')}\n"
             "assert 'job %s: 3 ranks, seq 3000' in texts['title'], texts['title']\n"
             "assert 'own pass start' in texts['subtitle'], texts['subtitle']\n"
             "assert 'time' in texts['axis-label']\n"
             "legend = [g for g in root.iter(NS + 'g') if cls(g) == 'legend']\n"
             "assert len(legend) == 1\n",
             id);
    int rc = dc_python(script, path, &err);
    cr_expect_eq(rc, 0, "the SVG of striactl job --timeline: %s", err);
    free(err);
    /* a file that cannot be written: exit 1, the file named */
    err = CTL_ERR(&c, NULL, 1, "job", id, "--timeline", "/nonexistent-dir/t.svg");
    expect_has("job --timeline to a bad path", err, "/nonexistent-dir/t.svg");
    free(err);
    dc_job_free(&j);
    dc_stop(&c);
}
