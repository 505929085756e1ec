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
    int64_t max_jobs_per_client;
    double max_step_timeout_s;
    double worker_retention_s;
} stria__coord_config_t;

typedef struct {
    uv_loop_t loop;
    stria_service_t *svc;
    stria_http_metrics_t *http;
} stria__main_loop_t;

static const char stria__coord_description[] =
    "The control plane of the stria attention service: workers register and\n"
    "heartbeat here, clients submit jobs and get their ring assignment, admins\n"
    "watch the ring, drain workers and cancel jobs. Every option is also a\n"
    "'name = value' setting of the --config file.";

static const char stria__coord_epilog[] =
    "On start it prints 'stria-coordinator listening on HOST:PORT' on stdout.\n"
    "Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 on a start-up\n"
    "failure, 2 on a usage or configuration error.";

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

/* Parses the options (exit status 2 and a message on a usage or
 * configuration error) and reads the token files. Returns -1 to go on. */
static int stria__coord_options(int argc, char **argv, stria__coord_config_t *c, stria_cli_t *cli,
                                char **token, char **admin_token)
{
    const stria_option_t opts[] = {
        {.name = "listen",
         .type = STRIA_OPT_ADDR,
         .dst = &c->listen,
         .dflt = "127.0.0.1:7400",
         .metavar = "HOST:PORT",
         .help = "RPC address (port 0 picks a free port)"},
        {.name = "heartbeat-period",
         .type = STRIA_OPT_DURATION,
         .dst = &c->heartbeat_period_s,
         .dflt = "1",
         .min = 0.01,
         .max = 3600,
         .metavar = "TIME",
         .help = "heartbeat period of the workers; 3 missed mark one dead"},
        {.name = "job-ttl",
         .type = STRIA_OPT_DURATION,
         .dst = &c->job_ttl_s,
         .dflt = "600",
         .min = 0.01,
         .max = STRIA_COORD_MAX_TTL_S,
         .metavar = "TIME",
         .help = "a job idle this long is cleaned up"},
        {.name = "token-file",
         .type = STRIA_OPT_STRING,
         .dst = &c->token_file,
         .metavar = "FILE",
         .help = "shared secret every connection must present (first line of FILE)"},
        {.name = "admin-token-file",
         .type = STRIA_OPT_STRING,
         .dst = &c->admin_token_file,
         .metavar = "FILE",
         .help = "secret needed to drain workers and cancel jobs"},
        {.name = "metrics-listen",
         .type = STRIA_OPT_ADDR,
         .dst = &c->metrics_listen,
         .metavar = "HOST:PORT",
         .help = "Prometheus /metrics endpoint (default: none)"},
        {.name = "port-file",
         .type = STRIA_OPT_STRING,
         .dst = &c->port_file,
         .metavar = "FILE",
         .help = "write the bound RPC port to FILE once listening"},
        {.name = "max-jobs",
         .type = STRIA_OPT_INT,
         .dst = &c->max_jobs,
         .dflt = "4096",
         .min = 0,
         .max = 1 << 20,
         .metavar = "N",
         .help = "pending and active jobs at most"},
        {.name = "history",
         .type = STRIA_OPT_INT,
         .dst = &c->history,
         .dflt = "1024",
         .min = 0,
         .max = 1 << 20,
         .metavar = "N",
         .help = "finished jobs kept for the admin tools"},
        {.name = "max-jobs-per-client",
         .type = STRIA_OPT_INT,
         .dst = &c->max_jobs_per_client,
         .dflt = "256",
         .min = 1,
         .max = 1 << 20,
         .metavar = "N",
         .help = "pending and active jobs of one client (host address) at most"},
        {.name = "max-step-timeout",
         .type = STRIA_OPT_DURATION,
         .dst = &c->max_step_timeout_s,
         .dflt = "600",
         .min = 0.001,
         .max = STRIA_COORD_MAX_STEP_TIMEOUT_S,
         .metavar = "TIME",
         .help = "longest ring step deadline a job may ask for (step_timeout_ms)"},
        {.name = "worker-retention",
         .type = STRIA_OPT_DURATION,
         .dst = &c->worker_retention_s,
         .dflt = "1h",
         .min = 0.01,
         .max = 365 * 86400.0,
         .metavar = "TIME",
         .help = "a dead or departed worker is forgotten this long after it was last heard of"},
        {.name = "log-level",
         .type = STRIA_OPT_STRING,
         .dst = &c->log_level,
         .metavar = "LEVEL",
         .help = "error, warn, info or debug (default info, or $STRIA_LOG_LEVEL)"},
        {.name = NULL},
    };
    const stria_command_t cmd = {.name = "stria-coordinator",
                                 .description = stria__coord_description,
                                 .epilog = stria__coord_epilog,
                                 .options = opts,
                                 .config = true};
    stria_status_t st = STRIA_OK;
    stria_log_level_t lvl = STRIA_LOG_INFO;

    int rc = stria_cli_main(&cmd, argc, argv, cli);
    if (rc >= 0)
        return rc;
    if (c->log_level != NULL && (st = stria_log_parse_level(c->log_level, &lvl)) != STRIA_OK)
        stria_cli_wrap(cli, "log-level", st);
    else if (c->log_level != NULL || getenv("STRIA_LOG_LEVEL") == NULL)
        stria_log_set_level(lvl);
    if (st == STRIA_OK && c->token_file != NULL &&
        (st = stria_rpc_token_read(c->token_file, token)) != STRIA_OK)
        stria_cli_wrap(cli, "token-file", st);
    if (st == STRIA_OK && c->admin_token_file != NULL &&
        (st = stria_rpc_token_read(c->admin_token_file, admin_token)) != STRIA_OK)
        stria_cli_wrap(cli, "admin-token-file", st);
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-coordinator: %s\n(see stria-coordinator --help)\n",
                stria_error_msg());
        return 2;
    }
    stria_cli_log(cli);
    return -1;
}

int main(int argc, char **argv)
{
    stria__coord_config_t c;
    stria_coord_params_t p;
    stria__main_loop_t ml;
    stria_coord_t *co = NULL;
    stria_metrics_t *metrics = NULL;
    char *token = NULL, *admin_token = NULL;
    char status[128];
    stria_cli_t cli;
    stria_status_t st;
    int rc;

    memset(&c, 0, sizeof(c));
    rc = stria__coord_options(argc, argv, &c, &cli, &token, &admin_token);
    if (rc >= 0)
        goto free_opts;
    rc = 1;
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
    p.max_jobs_per_client = (uint32_t)c.max_jobs_per_client;
    p.max_step_timeout_s = c.max_step_timeout_s;
    p.worker_retention_s = c.worker_retention_s;
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
    stria_cli_free(&cli);
    return rc;
}
