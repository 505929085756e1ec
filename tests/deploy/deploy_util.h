/* Test-only helpers of the deployment suites: a coordinator and workers as
 * real processes on loopback, running the installed-to-be programs
 * (striactl, python3) and collecting their output, HTTP scrapes, a
 * NOTIFY_SOCKET that plays the service manager, and jobs held open through
 * libstria. Every process is killed at exit if a test fails half-way. */
#ifndef STRIA_TEST_DEPLOY_UTIL_H
#define STRIA_TEST_DEPLOY_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proc.h"
#include "stria_client.h"
#include "stria_common.h"

#define DC_MAX_WORKERS 8

typedef struct {
    char dir[128]; /* scratch folder of the test (logs, copies), removed by dc_stop() */
    test_proc_t *coord;
    char coord_addr[256];
    char coord_metrics[256]; /* HOST:PORT of its /metrics */
    char coord_log[256];
    test_proc_t *workers[DC_MAX_WORKERS];
    char worker_rpc[DC_MAX_WORKERS][256];
    char worker_metrics[DC_MAX_WORKERS][256];
    char worker_log[DC_MAX_WORKERS][256];
    int n_workers;
} dcluster_t;

/* Options of the daemons a test starts; zero-initialise. */
typedef struct {
    double heartbeat_period_s;     /* default 0.2 */
    double step_timeout_s;         /* workers' default step deadline; default 5 */
    const char *token_file;        /* the clients' credential: coordinator and workers */
    const char *worker_token_file; /* the workers' credential (required with token_file) */
    const char *admin_token_file;
    char *const *env;          /* extra NAME=value entries for every daemon, or NULL */
    const char *worker_memory; /* the workers' --memory; default 1000000000 */
    const char *worker_device; /* the workers' --device; NULL: theirs */
    char *const *coord_args;   /* extra flags of the coordinator, NULL-terminated, or NULL */
    char *const *worker_args;  /* extra flags of the workers, NULL-terminated, or NULL */
    const char *host;          /* the address the daemons listen on; default 127.0.0.1 */
    const char *netns;         /* run the daemons in this network namespace (`ip netns exec`) */
} dc_opts_t;

/* A fresh scratch folder for the calling test process. */
void dc_init(dcluster_t *c);
/* Starts the coordinator on 127.0.0.1:0 with /metrics on 127.0.0.1:0 and waits
 * for its "listening" line. */
void dc_start_coordinator(dcluster_t *c, const dc_opts_t *o);
/* Stops the coordinator (unless stopped already: c->coord NULL) with `sig`
 * (SIGTERM: it must exit cleanly; SIGKILL) and, down_s seconds later, starts a new one on the same
 * address (its log replaces the first one's, which is kept as coordinator.log.SIG). */
void dc_restart_coordinator(dcluster_t *c, const dc_opts_t *o, int sig, double down_s);
/* Starts worker i (1 thread, metrics on 127.0.0.1:0) and waits for its line. */
void dc_start_worker(dcluster_t *c, int i, const dc_opts_t *o);
/* Coordinator and n workers; waits until the ring has n healthy workers. */
void dc_start(dcluster_t *c, int n, const dc_opts_t *o);
/* Polls `striactl --json status` until workers_healthy == n (10 s). */
void dc_wait_healthy(dcluster_t *c, int n, const char *token_file);
/* SIGTERM to everything still running (each must exit 0), then removes the
 * scratch folder. */
void dc_stop(dcluster_t *c);

/* Runs argv (argv[0] a path) with `env` added, waits up to timeout_s (then
 * SIGKILL), and returns its exit code (-1 when killed by a signal). stdout and
 * stderr are returned malloc'ed in *out / *err when non-NULL. */
int dc_run(char *const argv[], char *const env[], double timeout_s, char **out, char **err);
/* A libstria client of the cluster's coordinator (token_file: NULL for
 * none; forward_retries as in stria_client_params_t), or the test fails. */
stria_client_t *dc_client(const dcluster_t *c, const char *token_file, const char *name,
                          int forward_retries);
/* `striactl --json job ID`'s output (malloc'ed), NULL when striactl fails
 * (e.g. the coordinator does not know the job). */
char *dc_job_json(const dcluster_t *c, const char *token_file, uint64_t id);
/* striactl --coordinator ADDR [--token-file F] ARGS...; NULL-terminated args. */
int dc_striactl(const dcluster_t *c, const char *token_file, char **out, char **err, ...);
/* Runs STRIA_SYSTEM_PYTHON with a script, `arg` as sys.argv[1]; returns its
 * exit code and its stderr in *err (when non-NULL). */
int dc_python(const char *script, const char *arg, char **err);
/* Writes text to dir/name and returns the path (static buffer per call site:
 * copy it). */
void dc_write(const char *path, const char *text);
/* Contents of a file, malloc'ed ("" when missing). */
char *dc_read(const char *path);

/* GET http://addr/path; returns the status code and the body in *body. */
int dc_http_get(const char *addr, const char *path, char **body);

/* A port that was free a moment ago on 127.0.0.1, below the ephemeral port
 * range (so no process the test starts takes it by binding port 0). */
int dc_free_port(void);

/* A NOTIFY_SOCKET: a unix datagram socket bound in the scratch folder. */
typedef struct {
    int fd;
    char path[108];
    char env[160]; /* "NOTIFY_SOCKET=<path>" */
} dc_notify_t;
void dc_notify_open(dc_notify_t *n, const dcluster_t *c, const char *name);
/* Receives datagrams for up to timeout_s until one contains `needle` (a
 * whole "KEY=value" line, or a prefix of one when it ends in '=' or ' '); appends
 * every datagram received to log (log_len bytes, NUL-terminated). */
bool dc_notify_wait(dc_notify_t *n, const char *needle, double timeout_s, char *log,
                    size_t log_len);
void dc_notify_close(dc_notify_t *n);

/* A small job through libstria, held open after its forward pass. */
typedef struct {
    stria_client_t *client;
    stria_job_t *job;
    stria_job_spec_t spec;
    float *q, *k, *v, *o, *lse, *g, *dq, *dk, *dv;
} dc_job_t;
/* Fills random fp32 inputs of [1, seq, heads, head_dim] (kv_heads = heads). */
void dc_job_init(dc_job_t *j, const dcluster_t *c, int64_t seq, int64_t heads, int64_t head_dim,
                 int ring_size);
stria_status_t dc_job_forward(dc_job_t *j, stria_progress_cb progress, void *arg);
stria_status_t dc_job_backward(dc_job_t *j);
/* Releases the job (if open), closes the client, frees the buffers. */
void dc_job_free(dc_job_t *j);

/* The value of "key": in a flat JSON text, as a number (NAN when absent);
 * only for quick checks, the suites validate JSON with python3. */
double dc_json_number(const char *json, const char *key);

#endif
