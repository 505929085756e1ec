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
    const char *token_file; /* the client credential (the older name) */
    const char *client_token_file;
    const char *worker_token_file;
    const char *admin_token_file;
    const char *gen_credentials;
    bool insecure;
    const char *metrics_listen;
    const char *port_file;
    const char *log_level;
    int64_t max_jobs;
    int64_t history;
    int64_t max_jobs_per_client;
    int64_t max_sessions_per_client;
    int64_t max_session_bytes_per_client;
    double max_step_timeout_s;
    double worker_retention_s;
    double recovery_window_s; /* < 0: not given (3 heartbeat periods) */
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
    "Credentials: with --client-token-file and --worker-token-file (and\n"
    "--admin-token-file for operators) every connection proves one of them in\n"
    "its hello; without, every connection may do everything, which is refused\n"
    "on a non-loopback --listen or --metrics-listen unless --insecure is given.\n"
    "--gen-credentials DIR writes new ones (mode 0600) and exits.\n"
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

static void stria__coord_on_signal(void *arg, int signum)
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

/* The coordinator's credentials, read from their files. */
typedef struct {
    char *client, *worker, *admin;
} stria__coord_creds_t;

/* Reads the credential files and applies the exposure rule. */
static stria_status_t stria__coord_credentials(stria__coord_config_t *c, const stria_cli_t *cli,
                                               stria__coord_creds_t *cr)
{
    char what[512];
    stria_status_t st = STRIA_OK;
    const char *client_file, *client_opt;
    st = stria_service_client_credential(cli, c->client_token_file, c->token_file, &client_file,
                                         &client_opt);
    if (st == STRIA_OK && client_file != NULL)
        st = stria_service_read_credential(stria_cli_origin(cli, client_opt, what, sizeof(what)),
                                           client_file, &cr->client);
    if (st == STRIA_OK && c->worker_token_file != NULL)
        st = stria_service_read_credential(
            stria_cli_origin(cli, "worker-token-file", what, sizeof(what)), c->worker_token_file,
            &cr->worker);
    if (st == STRIA_OK && c->admin_token_file != NULL)
        st = stria_service_read_credential(
            stria_cli_origin(cli, "admin-token-file", what, sizeof(what)), c->admin_token_file,
            &cr->admin);
    if (st != STRIA_OK)
        return st;
    if ((cr->client || cr->worker || cr->admin) && !(cr->client && cr->worker))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "with credentials, both --client-token-file (or --token-file) and "
                               "--worker-token-file are needed: workers and clients prove "
                               "different ones");
    bool has = cr->client != NULL;
    st = stria_service_check_exposure(stria_cli_origin(cli, "listen", what, sizeof(what)),
                                      c->listen, has, c->insecure);
    if (st == STRIA_OK)
        st = stria_service_check_exposure(
            stria_cli_origin(cli, "metrics-listen", what, sizeof(what)), c->metrics_listen, has,
            c->insecure);
    return st;
}

/* Parses the options (exit status 2 and a message on a usage or
 * configuration error) and reads the credential files. Returns -1 to go on,
 * 0 after --gen-credentials. */
static int stria__coord_options(int argc, char **argv, stria__coord_config_t *c, stria_cli_t *cli,
                                stria__coord_creds_t *cr)
{
    stria_command_t cmd = {.name = "stria-coordinator",
                           .description = stria__coord_description,
                           .epilog = stria__coord_epilog,
                           .config = true};
    const stria_option_t opts[] = {
        STRIA_OPTION("listen", ADDR, &c->listen, "HOST:PORT",
                     "RPC address (port 0 picks a free port)", .dflt = "127.0.0.1:7400"),
        STRIA_OPTION("heartbeat-period", DURATION, &c->heartbeat_period_s, "TIME",
                     "heartbeat period of the workers; 3 missed mark one dead", .dflt = "1",
                     .min = 0.01, .max = 3600),
        STRIA_OPTION("job-ttl", DURATION, &c->job_ttl_s, "TIME",
                     "a job idle this long is cleaned up", .dflt = "600", .min = 0.01,
                     .max = STRIA_COORD_MAX_TTL_S),
        STRIA_OPTION("admin-token-file", STRING, &c->admin_token_file, "FILE",
                     "credential of the operators: drain, cancel, list and view any job"),
        STRIA_OPTION("gen-credentials", STRING, &c->gen_credentials, "DIR",
                     "write new client, worker and admin credentials (mode 0600) into DIR and exit",
                     .flags = STRIA_OPT_FLAG_ONLY),
        STRIA_OPTION("port-file", STRING, &c->port_file, "FILE",
                     "write the bound RPC port to FILE once listening"),
        STRIA_OPTION("max-jobs", INT, &c->max_jobs, "N", "pending and active jobs at most",
                     .dflt = "4096", .min = 0, .max = 1 << 20),
        STRIA_OPTION("history", INT, &c->history, "N", "finished jobs kept for the admin tools",
                     .dflt = "1024", .min = 0, .max = 1 << 20),
        STRIA_OPTION("max-jobs-per-client", INT, &c->max_jobs_per_client, "N",
                     "pending and active jobs of one client (host address) at most", .dflt = "256",
                     .min = 1, .max = 1 << 20),
        STRIA_OPTION("max-sessions-per-client", INT, &c->max_sessions_per_client, "N",
                     "open sessions and jobs (a job is a session of two calls) of one client "
                     "(host address) at most",
                     .dflt = "256", .min = 1, .max = 1 << 20),
        STRIA_OPTION("max-session-memory-per-client", BYTES, &c->max_session_bytes_per_client,
                     "SIZE",
                     "worker memory the open sessions and jobs of one client may hold in all (0: "
                     "no limit beyond the workers' pools)",
                     .dflt = "0", .min = 0, .max = 9e18),
        STRIA_OPTION("max-step-timeout", DURATION, &c->max_step_timeout_s, "TIME",
                     "longest ring step deadline a job may ask for (step_timeout_ms)",
                     .dflt = "600", .min = 0.001, .max = STRIA_COORD_MAX_STEP_TIMEOUT_S),
        STRIA_OPTION("worker-retention", DURATION, &c->worker_retention_s, "TIME",
                     "a dead or departed worker is forgotten this long after it was last heard of",
                     .dflt = "1h", .min = 0.01, .max = 365 * 86400.0),
        STRIA_OPTION(
            "recovery-window", DURATION, &c->recovery_window_s, "TIME",
            "after a (re)start, jobs the workers report holding are rebuilt for this long; "
            "one whose ranks are not all reported by then fails (default 3 heartbeat "
            "periods; 0: none, the workers drop their jobs)",
            .min = 0, .max = 3600),
        STRIA_SERVICE_OPTIONS(c,
                              "credential of the clients (first line of FILE): submit and own jobs",
                              "credential of the workers: register, heartbeat, report"),
        {.name = NULL},
    };
    cmd.options = opts;
    int rc = stria_cli_main(&cmd, argc, argv, cli);
    if (rc >= 0)
        return rc;
    stria_status_t st = stria_service_log_level(cli, c->log_level);
    if (st == STRIA_OK && c->gen_credentials != NULL) {
        st = stria_service_gen_credentials(c->gen_credentials);
        if (st != STRIA_OK) {
            fprintf(stderr, "stria-coordinator: %s\n", stria_error_msg());
            return 1;
        }
        printf("stria-coordinator: wrote %s/client-token, worker-token and admin-token (mode "
               "0600)\n",
               c->gen_credentials);
        return 0;
    }
    if (st == STRIA_OK)
        st = stria__coord_credentials(c, cli, cr);
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
    stria__coord_creds_t cr = {0};
    char status[128];
    stria_cli_t cli;
    stria_status_t st;
    int rc;

    memset(&c, 0, sizeof(c));
    c.recovery_window_s = -1;
    rc = stria__coord_options(argc, argv, &c, &cli, &cr);
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
    p.token = cr.client;
    p.worker_token = cr.worker;
    p.admin_token = cr.admin;
    p.max_jobs = (uint32_t)c.max_jobs;
    p.history = (uint32_t)c.history;
    p.max_jobs_per_client = (uint32_t)c.max_jobs_per_client;
    p.max_sessions_per_client = (uint32_t)c.max_sessions_per_client;
    p.max_session_bytes_per_client = (uint64_t)c.max_session_bytes_per_client;
    p.max_step_timeout_s = c.max_step_timeout_s;
    p.worker_retention_s = c.worker_retention_s;
    p.recovery_window_s = c.recovery_window_s < 0    ? 0
                          : c.recovery_window_s == 0 ? -1
                                                     : c.recovery_window_s;
    p.metrics = metrics;
    p.notify_status = true;
    st = stria_coord_start(&p, &co);
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-coordinator: %s\n", stria_error_msg());
        goto free_metrics;
    }

    memset(&ml, 0, sizeof(ml));
    uv_loop_init(&ml.loop);
    st = stria_service_start(&ml.loop, stria__coord_on_signal, &ml, &ml.svc);
    if (st == STRIA_OK)
        stria_service_watch_rpc(ml.svc, stria_coord_server(co));
    if (st == STRIA_OK && c.metrics_listen != NULL)
        st = stria_http_metrics_start(&ml.loop, c.metrics_listen, metrics, &ml.http);
    if (st == STRIA_OK && c.port_file != NULL)
        st = stria__write_port_file(c.port_file, stria_coord_port(co));
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-coordinator: %s\n", stria_error_msg());
        stria__coord_on_signal(&ml, 0);
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
    stria_auth_free_secret(cr.client);
    stria_auth_free_secret(cr.worker);
    stria_auth_free_secret(cr.admin);
    stria_cli_free(&cli);
    return rc;
}
