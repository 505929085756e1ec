/*
 * stria-coordinator: the control plane daemon. The coordinator itself runs
 * on the RPC server's thread; the main thread runs a small libuv loop for
 * shutdown signals, the systemd watchdog and the optional /metrics endpoint.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stria_coordinator.h"
#include "stria_rpc.h"
#include "stria_service.h"

typedef struct {
    const char *listen;
    double heartbeat_period_s;
    double job_ttl_s;
    const char *token_file;
    const char *admin_token_file;
    const char *metrics_listen;
    const char *port_file;
    const char *log_level;
    int64_t max_jobs;
    int64_t history;
} stria__coord_config_t;

typedef struct {
    uv_loop_t loop;
    stria_service_t *svc;
    stria_http_metrics_t *http;
} stria__main_loop_t;

static void stria__usage(FILE *out, const stria_opt_t *opts)
{
    fprintf(out, "usage: stria-coordinator [options]\n"
                 "\n"
                 "The control plane of the stria attention service: workers register and\n"
                 "heartbeat here, clients submit jobs and get their ring assignment, admins\n"
                 "watch the ring, drain workers and cancel jobs.\n"
                 "\n"
                 "options (each is also a 'name = value' setting of the --config file):\n");
    stria_opts_print_help(opts, out);
    fprintf(out, "  %-28s %s\n", "-h, --help", "this help");
    fprintf(out, "\n"
                 "On start it prints 'stria-coordinator listening on HOST:PORT' on stdout.\n"
                 "Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 on a start-up\n"
                 "failure, 2 on a usage or configuration error.\n");
}

/* Writes the port to `path` atomically, so a reader never sees a partial
 * file. */
static stria_status_t stria__write_port_file(const char *path, unsigned port)
{
    size_t n = strlen(path) + 16;
    char *tmp = malloc(n);
    FILE *f;
    stria_status_t st = STRIA_OK;

    if (tmp == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "--port-file: out of memory");
    snprintf(tmp, n, "%s.tmp", path);
    f = fopen(tmp, "w");
    if (f == NULL) {
        st = stria_error_set(STRIA_ERR_IO, "--port-file %s: cannot write", path);
        goto free_tmp;
    }
    fprintf(f, "%u\n", port);
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        unlink(tmp);
        st = stria_error_set(STRIA_ERR_IO, "--port-file %s: cannot write", path);
    }
free_tmp:
    free(tmp);
    return st;
}

static void stria__on_signal(void *arg, int signum)
{
    stria__main_loop_t *ml = arg;
    stria_log_info("signal %d: shutting down", signum);
    stria_notify("STOPPING=1\nSTATUS=shutting down");
    if (ml->http != NULL) {
        stria_http_metrics_stop(ml->http);
        ml->http = NULL;
    }
    if (ml->svc != NULL) {
        stria_service_stop(ml->svc);
        ml->svc = NULL;
    }
}

int main(int argc, char **argv)
{
    stria__coord_config_t c = {.heartbeat_period_s = 1.0, .job_ttl_s = 600.0};
    stria_coord_params_t p;
    stria__main_loop_t ml;
    stria_coord_t *co = NULL;
    stria_metrics_t *metrics = NULL;
    char *token = NULL, *admin_token = NULL;
    char status[128];
    stria_status_t st;
    int rc = 1;
    const stria_opt_t opts[] = {
        {"listen", STRIA_OPT_STRING, &c.listen, 0, 0, "HOST:PORT",
         "RPC address (default 127.0.0.1:7400; port 0 picks a free port)"},
        {"heartbeat-period", STRIA_OPT_DOUBLE, &c.heartbeat_period_s, 0.01, 3600, "SECONDS",
         "heartbeat period of the workers; 3 missed mark one dead (default 1)"},
        {"job-ttl", STRIA_OPT_DOUBLE, &c.job_ttl_s, 0.01, STRIA_COORD_MAX_TTL_S, "SECONDS",
         "a job idle this long is cleaned up (default 600)"},
        {"token-file", STRIA_OPT_STRING, &c.token_file, 0, 0, "FILE",
         "shared secret every connection must present (first line of FILE)"},
        {"admin-token-file", STRIA_OPT_STRING, &c.admin_token_file, 0, 0, "FILE",
         "secret needed to drain workers and cancel jobs"},
        {"metrics-listen", STRIA_OPT_STRING, &c.metrics_listen, 0, 0, "HOST:PORT",
         "Prometheus /metrics endpoint (default: none)"},
        {"port-file", STRIA_OPT_STRING, &c.port_file, 0, 0, "FILE",
         "write the bound RPC port to FILE once listening"},
        {"max-jobs", STRIA_OPT_INT, &c.max_jobs, 0, 1 << 20, "N",
         "pending and active jobs at most (default 4096)"},
        {"history", STRIA_OPT_INT, &c.history, 0, 1 << 20, "N",
         "finished jobs kept for the admin tools (default 1024)"},
        {"log-level", STRIA_OPT_STRING, &c.log_level, 0, 0, "LEVEL",
         "error, warn, info (default) or debug"},
        {NULL, 0, NULL, 0, 0, NULL, NULL},
    };

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            stria__usage(stdout, opts);
            return 0;
        }
    }
    if (getenv("STRIA_LOG_LEVEL") == NULL)
        stria_log_set_level(STRIA_LOG_INFO);
    st = stria_opts_parse(opts, argc, argv, 1, NULL);
    if (st == STRIA_OK && c.log_level != NULL) {
        stria_log_level_t lvl;
        st = stria_log_parse_level(c.log_level, &lvl);
        if (st == STRIA_OK)
            stria_log_set_level(lvl);
        else
            stria_error_wrap(st, "--log-level");
    }
    if (st == STRIA_OK && c.listen == NULL)
        c.listen = "127.0.0.1:7400";
    if (st == STRIA_OK) {
        char host[256];
        uint16_t port;
        st = stria_addr_parse(c.listen, host, sizeof(host), &port);
        if (st != STRIA_OK)
            stria_error_wrap(st, "--listen");
    }
    if (st == STRIA_OK && c.token_file != NULL &&
        (st = stria_rpc_token_read(c.token_file, &token)) != STRIA_OK)
        stria_error_wrap(st, "--token-file");
    if (st == STRIA_OK && c.admin_token_file != NULL &&
        (st = stria_rpc_token_read(c.admin_token_file, &admin_token)) != STRIA_OK)
        stria_error_wrap(st, "--admin-token-file");
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-coordinator: %s\n(see stria-coordinator --help)\n",
                stria_error_msg());
        rc = 2;
        goto free_opts;
    }

    if (c.metrics_listen != NULL && stria_metrics_create(&metrics) != STRIA_OK) {
        fprintf(stderr, "stria-coordinator: %s\n", stria_error_msg());
        goto free_opts;
    }
    memset(&p, 0, sizeof(p));
    p.listen = c.listen;
    p.heartbeat_period_s = c.heartbeat_period_s;
    p.job_ttl_s = c.job_ttl_s;
    p.token = token;
    p.admin_token = admin_token;
    p.max_jobs = (uint32_t)c.max_jobs;
    p.history = (uint32_t)c.history;
    p.metrics = metrics;
    p.notify_status = true;
    st = stria_coord_start(&p, &co);
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-coordinator: %s\n", stria_error_msg());
        goto free_metrics;
    }

    memset(&ml, 0, sizeof(ml));
    uv_loop_init(&ml.loop);
    st = stria_service_start(&ml.loop, stria__on_signal, &ml, &ml.svc);
    if (st == STRIA_OK)
        stria_service_watch_rpc(ml.svc, stria_coord_server(co));
    if (st == STRIA_OK && c.metrics_listen != NULL)
        st = stria_http_metrics_start(&ml.loop, c.metrics_listen, metrics, &ml.http);
    if (st == STRIA_OK && c.port_file != NULL)
        st = stria__write_port_file(c.port_file, stria_coord_port(co));
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-coordinator: %s\n", stria_error_msg());
        stria__on_signal(&ml, 0);
        uv_run(&ml.loop, UV_RUN_DEFAULT);
        uv_loop_close(&ml.loop);
        goto stop_coord;
    }
    {
        char host[256];
        uint16_t ignored;
        stria_addr_parse(c.listen, host, sizeof(host), &ignored);
        printf(strchr(host, ':') ? "stria-coordinator listening on [%s]:%u\n"
                                 : "stria-coordinator listening on %s:%u\n",
               host, stria_coord_port(co));
        if (ml.http != NULL)
            printf("stria-coordinator metrics port %d\n", stria_http_metrics_port(ml.http));
        fflush(stdout);
    }
    snprintf(status, sizeof(status), "READY=1\nSTATUS=serving on port %u", stria_coord_port(co));
    stria_notify(status);
    uv_run(&ml.loop, UV_RUN_DEFAULT);
    uv_loop_close(&ml.loop);
    rc = 0;

stop_coord:
    stria_coord_stop(co);
free_metrics:
    stria_metrics_destroy(metrics);
free_opts:
    free(token);
    free(admin_token);
    stria_opts_free(opts);
    return rc;
}
