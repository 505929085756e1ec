/* The configuration files: the examples in deploy/config/ start the real
 * daemons (with loopback addresses), every setting of each daemon is
 * documented there and every documented setting exists, per-instance ports
 * follow --instance, and a bad file gets exit status 2 and a message naming
 * the file and the line. */
#include <criterion/criterion.h>

#include <ctype.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy_util.h"

#define SUITE_TIMEOUT 120

static char *const daemon_env[] = {"UCX_HANDLE_ERRORS=none", "UCX_TLS=tcp,sm,self",
                                   "STRIA_LOG_LEVEL=info", NULL};

/* `text` with the active `key = ...` line replaced by `key = value` (or the
 * line appended); malloc'ed. */
static char *conf_set(const char *text, const char *key, const char *value)
{
    size_t kl = strlen(key), n = strlen(text);
    char *out = malloc(n + strlen(key) + strlen(value) + 8), *o = out;
    bool done = false;
    cr_assert_not_null(out);
    for (const char *p = text; *p;) {
        size_t ll = strcspn(p, "\n");
        bool hit = !done && ll > kl && memcmp(p, key, kl) == 0 && (p[kl] == ' ' || p[kl] == '=');
        if (hit) {
            o += sprintf(o, "%s = %s\n", key, value);
            done = true;
        } else {
            memcpy(o, p, ll);
            o += ll;
            *o++ = '\n';
        }
        p += ll;
        if (*p == '\n')
            p++;
    }
    if (!done)
        o += sprintf(o, "%s = %s\n", key, value);
    *o = '\0';
    return out;
}

static char *example(const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/deploy/config/%s", STRIA_SOURCE_DIR, name);
    char *text = dc_read(path);
    cr_assert(text[0] != '\0', "%s is missing", path);
    return text;
}

/* Starts a daemon with --config path (and extra flags); returns its stdout
 * line starting with `prefix`. */
static test_proc_t *start_with_config(const char *bin, const char *conf, const char *log,
                                      const char *extra, const char *prefix, char *line, size_t len)
{
    char *argv[] = {(char *)bin, "--config", (char *)conf, (char *)extra, NULL};
    test_proc_t *p = test_proc_start(argv, log, daemon_env);
    cr_assert_not_null(p);
    char *logtext = NULL;
    bool ok = test_proc_wait_line(p, prefix, 15, line, len);
    if (!ok)
        logtext = dc_read(log);
    cr_assert(ok, "%s --config %s did not start:\n%s", bin, conf, logtext);
    return p;
}

Test(config, example_files_run_the_daemons, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_init(&c);
    char line[512], cpath[256], wpath[256], clog[256], wlog[256];
    snprintf(cpath, sizeof(cpath), "%s/coordinator.conf", c.dir);
    snprintf(wpath, sizeof(wpath), "%s/worker.conf", c.dir);
    snprintf(clog, sizeof(clog), "%s/coordinator.log", c.dir);
    snprintf(wlog, sizeof(wlog), "%s/worker.log", c.dir);

    /* the credentials the examples name, made as docs/DEPLOY.md says */
    char creds[256], cred[3][300];
    snprintf(creds, sizeof(creds), "%s/credentials", c.dir);
    char *gen[] = {STRIA_COORDINATOR_BIN, "--gen-credentials", creds, NULL};
    cr_assert_eq(dc_run(gen, NULL, 30, NULL, NULL), 0, "--gen-credentials %s", creds);
    const char *names[3] = {"client-token", "worker-token", "admin-token"};
    for (int i = 0; i < 3; i++)
        snprintf(cred[i], sizeof(cred[i]), "%s/%s", creds, names[i]);

    /* the coordinator's example, on loopback */
    char *t0 = example("coordinator.conf");
    char *t1 = conf_set(t0, "listen", "127.0.0.1:0");
    char *t2 = conf_set(t1, "metrics-listen", "127.0.0.1:0");
    char *c3 = conf_set(t2, "client-token-file", cred[0]);
    char *c4 = conf_set(c3, "worker-token-file", cred[1]);
    char *c5 = conf_set(c4, "admin-token-file", cred[2]);
    dc_write(cpath, c5);
    free(t0), free(t1), free(t2), free(c3), free(c4), free(c5);
    test_proc_t *co = start_with_config(STRIA_COORDINATOR_BIN, cpath, clog, NULL,
                                        "stria-coordinator listening on ", line, sizeof(line));
    snprintf(c.coord_addr, sizeof(c.coord_addr), "%.200s",
             line + strlen("stria-coordinator listening on "));
    cr_expect(test_proc_wait_line(co, "stria-coordinator metrics port ", 5, line, sizeof(line)),
              "the example's metrics-listen was not used");

    /* the workers' example, pointed at it, as instance 2 of a host whose
     * configuration sets base ports: the RPC port is the base + 2 */
    int port = dc_free_port();
    char base[64];
    snprintf(base, sizeof(base), "127.0.0.1:%d", port - 2);
    t0 = example("worker.conf");
    t1 = conf_set(t0, "coordinator", c.coord_addr);
    t2 = conf_set(t1, "listen", base);
    char *t3 = conf_set(t2, "ucx-listen", "127.0.0.1:0");
    char *t4 = conf_set(t3, "metrics-listen", "127.0.0.1:0");
    char *t5 = conf_set(t4, "threads", "1");
    char *t6 = conf_set(t5, "client-token-file", cred[0]);
    char *t7 = conf_set(t6, "worker-token-file", cred[1]);
    dc_write(wpath, t7);
    free(t0), free(t1), free(t2), free(t3), free(t4), free(t5), free(t6), free(t7);
    test_proc_t *w = start_with_config(STRIA_WORKER_BIN, wpath, wlog, "--instance=2",
                                       "stria-worker listening rpc=", line, sizeof(line));
    char want[96];
    snprintf(want, sizeof(want), "rpc=127.0.0.1:%d ", port);
    cr_expect(strstr(line, want) != NULL, "instance 2 with base %s: '%s'", base, line);
    cr_expect(strstr(line, " metrics=127.0.0.1:") != NULL, "%s", line);
    dc_wait_healthy(&c, 1, cred[0]);

    int st = test_proc_stop(w, SIGTERM, 15);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker status %#x", st);
    st = test_proc_stop(co, SIGTERM, 10);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "coordinator status %#x", st);
    dc_stop(&c);
}

/* Option names listed by `bin --help` ("  --name ..."), except help,
 * config and gen-credentials; newline-separated. */
static char *help_options(const char *bin)
{
    char *argv[] = {(char *)bin, "--help", NULL};
    char *out = NULL;
    cr_assert_eq(dc_run(argv, NULL, 30, &out, NULL), 0);
    char *names = calloc(strlen(out) + 1, 1);
    for (const char *p = out; *p;) {
        size_t ll = strcspn(p, "\n");
        if (ll > 4 && strncmp(p, "  --", 4) == 0) {
            size_t nl = strcspn(p + 4, " \n");
            /* --gen-credentials is an action, not a setting */
            if (strncmp(p + 4, "config", nl) != 0 && strncmp(p + 4, "help", nl) != 0 &&
                strncmp(p + 4, "gen-credentials", nl) != 0) {
                strncat(names, p + 4, nl);
                strcat(names, "\n");
            }
        }
        p += ll;
        if (*p == '\n')
            p++;
    }
    free(out);
    return names;
}

/* Whether `name` is set in the file, active or commented out ("# name = "). */
static bool documented(const char *text, const char *name)
{
    size_t nl = strlen(name);
    for (const char *p = text; *p;) {
        size_t ll = strcspn(p, "\n");
        const char *q = p;
        if (*q == '#')
            q++;
        while (*q == ' ')
            q++;
        if (strncmp(q, name, nl) == 0 && strncmp(q + nl, " = ", 3) == 0)
            return true;
        p += ll;
        if (*p == '\n')
            p++;
    }
    return false;
}

static void check_documented(const char *bin, const char *file)
{
    char *names = help_options(bin), *text = example(file);
    int n = 0;
    for (char *p = names; *p;) {
        size_t ll = strcspn(p, "\n");
        p[ll] = '\0';
        cr_expect(documented(text, p), "deploy/config/%s does not document the setting '%s'", file,
                  p);
        n++;
        p += ll + 1;
    }
    cr_expect(n >= 8, "%s --help lists only %d options", bin, n);
    /* names is "a\0b\0...": rebuild "\na\nb\n" to look whole lines up */
    char *wrapped = calloc(strlen(text) + 4 * (size_t)n + 64 * (size_t)n + 2, 1);
    cr_assert_not_null(wrapped);
    strcat(wrapped, "\n");
    for (const char *p = names; *p; p += strlen(p) + 1) {
        strcat(wrapped, p);
        strcat(wrapped, "\n");
    }
    /* and every setting the file shows exists */
    for (const char *p = text; *p;) {
        size_t ll = strcspn(p, "\n");
        const char *q = p;
        if (*q == '#')
            q++;
        while (*q == ' ')
            q++;
        size_t k = 0;
        while (islower((unsigned char)q[k]) || q[k] == '-')
            k++;
        if (k > 0 && strncmp(q + k, " = ", 3) == 0) {
            char name[64];
            snprintf(name, sizeof(name), "\n%.*s\n", (int)k, q);
            cr_expect(strstr(wrapped, name) != NULL,
                      "deploy/config/%s shows a setting '%.*s' that %s does not know", file, (int)k,
                      q, bin);
        }
        p += ll;
        if (*p == '\n')
            p++;
    }
    free(wrapped);
    free(names);
    free(text);
}

Test(config, every_setting_is_documented_in_the_examples, .timeout = SUITE_TIMEOUT)
{
    check_documented(STRIA_COORDINATOR_BIN, "coordinator.conf");
    check_documented(STRIA_WORKER_BIN, "worker.conf");
}

static void expect_bad(const char *bin, const char *path, const char *text, const char *needle)
{
    if (text != NULL)
        dc_write(path, text);
    char *argv[] = {(char *)bin, "--config", (char *)path, "--coordinator=127.0.0.1:1", NULL};
    if (strstr(bin, "coordinator") != NULL)
        argv[3] = NULL;
    char *out = NULL, *err = NULL;
    int rc = dc_run(argv, daemon_env, 30, &out, &err);
    cr_expect_eq(rc, 2, "%s with a bad config: exit %d (%s)", bin, rc, err);
    /* syntax and range errors name the file and line; values checked later
     * (addresses, log level) name the setting */
    char want[512];
    snprintf(want, sizeof(want), "%s%s", needle[0] == ':' ? path : "", needle);
    cr_expect(strstr(err, want) != NULL, "%s: message '%s' lacks '%s'", bin, err, want);
    free(out);
    free(err);
}

Test(config, a_bad_file_names_the_line_and_exits_2, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_init(&c);
    char path[256];
    snprintf(path, sizeof(path), "%s/bad.conf", c.dir);
    const char *bins[] = {STRIA_COORDINATOR_BIN, STRIA_WORKER_BIN};
    for (int i = 0; i < 2; i++) {
        expect_bad(bins[i], path, "# comment\nlisten = 127.0.0.1:0\nthis is not a setting\n",
                   ":3: expected 'name = value'");
        expect_bad(bins[i], path, "log-level = info\n\ncolour = blue\n",
                   ":3: unknown setting 'colour'");
        expect_bad(bins[i], path, "listen = 127.0.0.1:0\nlog-level = loud\n",
                   "--log-level: unknown log level 'loud'");
    }
    expect_bad(STRIA_COORDINATOR_BIN, path, "heartbeat-period = 0\n", ":1: --heartbeat-period");
    expect_bad(STRIA_COORDINATOR_BIN, path, "max-jobs = many\n", ":1: --max-jobs");
    expect_bad(STRIA_WORKER_BIN, path, "threads = 2\nstep-timeout = fast\n", ":2: --step-timeout");
    expect_bad(STRIA_WORKER_BIN, path, "instance = 5000\n", ":1: --instance");
    /* sizes take K/M/G/T; anything else names the line and the setting */
    expect_bad(STRIA_WORKER_BIN, path, "coordinator = 127.0.0.1:1\nmemory = 2X\n",
               ":2: --memory '2X'");
    /* a file that is not there is named too */
    snprintf(path, sizeof(path), "%s/missing.conf", c.dir);
    expect_bad(STRIA_COORDINATOR_BIN, path, NULL, ": cannot open configuration file");
    expect_bad(STRIA_WORKER_BIN, path, NULL, ": cannot open configuration file");
    dc_stop(&c);
}
