/*
 * stria service helpers shared by the daemons: the Prometheus /metrics HTTP
 * endpoint, the systemd watchdog, and shutdown signals, all on a libuv loop.
 *
 * Everything here runs on the loop's thread; create, use and stop the objects
 * from that thread only.
 */
#ifndef STRIA_SERVICE_H
#define STRIA_SERVICE_H

#include <uv.h>

#include "stria_common.h"
#include "stria_rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct stria_http_metrics stria_http_metrics_t;

/* Serves GET /metrics (text exposition of `reg`) on `listen` ("HOST:PORT";
 * port 0 picks a free port, read it with stria_http_metrics_port()). Other
 * paths get 404, other methods 405, oversized or malformed requests 400;
 * idle connections are closed after a few seconds. `reg` must outlive the
 * server. Stop with stria_http_metrics_stop(). */
stria_status_t stria_http_metrics_start(uv_loop_t *loop, const char *listen, stria_metrics_t *reg,
                                        stria_http_metrics_t **out);
int stria_http_metrics_port(const stria_http_metrics_t *srv);
/* What the request received so far asks for: `req` holds `len` bytes and a
 * NUL after them, `cap` is the most the server reads. Returns 0 while the
 * request is incomplete (no blank line yet, fewer than cap bytes), else the
 * status to answer: 200 (GET or HEAD /metrics; *head_out for HEAD), 400
 * (malformed or too long), 404 (another path) or 405 (another method).
 * Pure; the request parser of the endpoint. */
int stria_http_metrics_route(const char *req, size_t len, size_t cap, bool *head_out);
/* Closes the listener and every open connection; frees the server once libuv
 * has released the handles (run the loop to completion). */
void stria_http_metrics_stop(stria_http_metrics_t *srv);

typedef void (*stria_shutdown_cb)(void *arg, int signum);

typedef struct stria_service stria_service_t;

/* Starts the watchdog (WATCHDOG=1 every half of $WATCHDOG_USEC, if set) and
 * watches SIGTERM and SIGINT, calling `on_shutdown` once per signal. SIGPIPE
 * is ignored. Stop with stria_service_stop(). */
stria_status_t stria_service_start(uv_loop_t *loop, stria_shutdown_cb on_shutdown, void *arg,
                                   stria_service_t **out);
void stria_service_stop(stria_service_t *svc);

/* A liveness probe: true when the daemon can serve; false with a reason in
 * why[0..cap). Called on the service loop's thread. */
typedef bool (*stria_liveness_cb)(void *arg, char *why, size_t cap);

/* Makes the watchdog ping only while `alive` says so, so that a daemon
 * whose serving thread hangs (a blocked RPC loop) stops pinging and systemd
 * restarts it after WatchdogSec, although the service loop still runs. The
 * first failure logs an error with the reason. */
void stria_service_set_liveness(stria_service_t *svc, stria_liveness_cb alive, void *arg);

/* The usual probe: alive while `server`'s loop thread ran its housekeeping
 * within max(1 s, half the watchdog interval). `server` must outlive svc. */
void stria_service_watch_rpc(stria_service_t *svc, const stria_rpc_server_t *server);

/* ---- credentials and exposure (both daemons) ------------------------------ */

/* Reads the credential of a setting (`what` names it: "--client-token-file"
 * or "FILE:LINE: --client-token-file", see stria_cli_origin()) from `path`
 * (stria_rpc_token_read()) into *token_out; warns when others than the
 * owner and its group may read the file. The message of an error names the
 * setting and the file, never the token. */
stria_status_t stria_service_read_credential(const char *what, const char *path, char **token_out);

/* Which of --client-token-file (`client_file`) and its older name
 * --token-file (`token_file`) applies: either when only one is set; the one
 * a flag gave over the one the configuration file gave (flags override the
 * file); both from the same place is an error. *file_out and *opt_out (the
 * option's name) are NULL when neither is set. */
stria_status_t stria_service_client_credential(const stria_cli_t *cli, const char *client_file,
                                               const char *token_file, const char **file_out,
                                               const char **opt_out);

/* The safe default: a listener (the setting `what` names, at `addr`) that
 * other machines can reach needs credentials, unless the operator said
 * --insecure. Returns STRIA_ERR_INVALID_ARG with a message naming the
 * setting, the address and what to do. */
stria_status_t stria_service_check_exposure(const char *what, const char *addr,
                                            bool has_credentials, bool insecure);

/* The options both daemons take, for their tables: the clients' credential
 * (and its older name), the workers' credential, --insecure, the metrics
 * endpoint and the log level. `c` points to settings with the fields
 * client_token_file, token_file, worker_token_file, insecure,
 * metrics_listen and log_level. */
#define STRIA_SERVICE_OPTIONS(c, client_help, worker_help)                                         \
    STRIA_OPTION("client-token-file", STRING, &(c)->client_token_file, "FILE", client_help),       \
        STRIA_OPTION("token-file", STRING, &(c)->token_file, "FILE",                               \
                     "the older name of --client-token-file"),                                     \
        STRIA_OPTION("worker-token-file", STRING, &(c)->worker_token_file, "FILE", worker_help),   \
        STRIA_OPTION("insecure", BOOL, &(c)->insecure, NULL,                                       \
                     "allow listening beyond loopback without credentials", .dflt = "false"),      \
        STRIA_OPTION("metrics-listen", ADDR, &(c)->metrics_listen, "HOST:PORT",                    \
                     "Prometheus /metrics endpoint (default: none)"),                              \
        STRIA_OPTION("log-level", STRING, &(c)->log_level, "LEVEL",                                \
                     "error, warn, info or debug (default info, or $STRIA_LOG_LEVEL)")

/* Applies --log-level (`level`, NULL when unset): its level, else
 * $STRIA_LOG_LEVEL's, else info. A bad level's message names where it came
 * from. */
stria_status_t stria_service_log_level(const stria_cli_t *cli, const char *level);

/* stria-coordinator --gen-credentials DIR: makes DIR (mode 0700) if needed
 * and writes DIR/client-token, DIR/worker-token and DIR/admin-token, new
 * random credentials, mode 0600; refuses to replace an existing one. */
stria_status_t stria_service_gen_credentials(const char *dir);

#ifdef __cplusplus
}
#endif

#endif
