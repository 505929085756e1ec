#include "stria_rpc.h"
#include "stria_service.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define STRIA__HTTP_MAX_REQUEST 8192
#define STRIA__HTTP_IDLE_MS     5000

struct stria_http_metrics {
    uv_loop_t *loop;
    uv_tcp_t listener;
    stria_metrics_t *reg;
    int port;
    int open_handles; /* listener + connections, for deferred free */
    bool stopping;
    struct stria__http_conn *conns;
};

typedef struct stria__http_conn {
    uv_tcp_t tcp;
    uv_timer_t idle;
    stria_http_metrics_t *srv;
    char req[STRIA__HTTP_MAX_REQUEST];
    size_t req_len;
    char *resp;
    bool responded;
    int closing_handles;
    struct stria__http_conn *next, *prev;
} stria__http_conn_t;

static void stria__http_maybe_free(stria_http_metrics_t *srv)
{
    if (srv->stopping && srv->open_handles == 0)
        free(srv);
}

static void stria__conn_handle_closed(uv_handle_t *h)
{
    stria__http_conn_t *c = h->data;
    if (--c->closing_handles > 0)
        return;
    stria_http_metrics_t *srv = c->srv;
    free(c->resp);
    free(c);
    srv->open_handles--;
    stria__http_maybe_free(srv);
}

static void stria__http_conn_close(stria__http_conn_t *c)
{
    if (c->closing_handles > 0)
        return;
    if (c->prev)
        c->prev->next = c->next;
    else
        c->srv->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->closing_handles = 2;
    uv_timer_stop(&c->idle);
    uv_close((uv_handle_t *)&c->idle, stria__conn_handle_closed);
    uv_close((uv_handle_t *)&c->tcp, stria__conn_handle_closed);
}

static void stria__conn_written(uv_write_t *w, int status)
{
    stria__http_conn_t *c = w->data;
    (void)status;
    free(w);
    stria__http_conn_close(c);
}

static void stria__conn_respond(stria__http_conn_t *c, int code, const char *reason,
                                const char *ctype, const char *body, size_t body_len)
{
    char head[256];
    int n = snprintf(head, sizeof(head),
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n\r\n",
                     code, reason, ctype, body_len);
    uv_write_t *w = malloc(sizeof(*w));
    c->resp = malloc((size_t)n + body_len);
    if (w == NULL || c->resp == NULL) {
        free(w);
        stria__http_conn_close(c);
        return;
    }
    memcpy(c->resp, head, (size_t)n);
    memcpy(c->resp + n, body, body_len);
    c->responded = true;
    uv_read_stop((uv_stream_t *)&c->tcp);
    uv_buf_t buf = uv_buf_init(c->resp, (unsigned)((size_t)n + body_len));
    w->data = c;
    if (uv_write(w, (uv_stream_t *)&c->tcp, &buf, 1, stria__conn_written) != 0) {
        free(w);
        stria__http_conn_close(c);
    }
}

static void stria__conn_error(stria__http_conn_t *c, int code, const char *reason)
{
    char body[128];
    int n = snprintf(body, sizeof(body), "%d %s\n", code, reason);
    stria__conn_respond(c, code, reason, "text/plain; charset=utf-8", body, (size_t)n);
}

int stria_http_metrics_route(const char *req, size_t len, size_t cap, bool *head_out)
{
    char method[16], path[256];
    *head_out = false;
    if (strstr(req, "\r\n\r\n") == NULL && strstr(req, "\n\n") == NULL)
        return len >= cap ? 400 : 0;
    if (sscanf(req, "%15s %255s HTTP/1.%*c", method, path) != 2)
        return 400;
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return 405;
    char *q = strchr(path, '?');
    if (q)
        *q = '\0';
    if (strcmp(path, "/metrics") != 0)
        return 404;
    *head_out = strcmp(method, "HEAD") == 0;
    return 200;
}

static void stria__conn_request(stria__http_conn_t *c, int code, bool head)
{
    static const char *const reasons[] = {"Bad Request", "Not Found", "Method Not Allowed"};
    if (code != 200) {
        stria__conn_error(c, code, reasons[code == 404 ? 1 : code == 405 ? 2 : 0]);
        return;
    }
    char *text;
    size_t len;
    if (stria_metrics_render(c->srv->reg, &text, &len) != STRIA_OK) {
        stria__conn_error(c, 500, "Internal Server Error");
        return;
    }
    stria__conn_respond(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", text,
                        head ? 0 : len);
    free(text);
}

static void stria__conn_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    stria__http_conn_t *c = h->data;
    (void)suggested;
    buf->base = c->req + c->req_len;
    buf->len = sizeof(c->req) - 1 - c->req_len;
}

static void stria__conn_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    stria__http_conn_t *c = s->data;
    (void)buf;
    if (nread < 0) {
        stria__http_conn_close(c);
        return;
    }
    if (nread == 0 || c->responded)
        return;
    c->req_len += (size_t)nread;
    c->req[c->req_len] = '\0';
    bool head;
    int code = stria_http_metrics_route(c->req, c->req_len, sizeof(c->req) - 1, &head);
    if (code != 0)
        stria__conn_request(c, code, head);
}

static void stria__conn_idle(uv_timer_t *t)
{
    stria__http_conn_close(t->data);
}

static void stria__http_accept(uv_stream_t *server, int status)
{
    stria_http_metrics_t *srv = server->data;
    stria__http_conn_t *c;
    if (status < 0 || srv->stopping)
        return;
    c = calloc(1, sizeof(*c));
    if (c == NULL)
        return;
    c->srv = srv;
    uv_tcp_init(srv->loop, &c->tcp);
    uv_timer_init(srv->loop, &c->idle);
    c->tcp.data = c;
    c->idle.data = c;
    srv->open_handles++;
    c->next = srv->conns;
    if (srv->conns)
        srv->conns->prev = c;
    srv->conns = c;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0 ||
        uv_read_start((uv_stream_t *)&c->tcp, stria__conn_alloc, stria__conn_read) != 0) {
        stria__http_conn_close(c);
        return;
    }
    uv_timer_start(&c->idle, stria__conn_idle, STRIA__HTTP_IDLE_MS, 0);
}

static void stria__http_listener_closed(uv_handle_t *h)
{
    stria_http_metrics_t *srv = h->data;
    srv->open_handles--;
    stria__http_maybe_free(srv);
}

stria_status_t stria_http_metrics_start(uv_loop_t *loop, const char *listen, stria_metrics_t *reg,
                                        stria_http_metrics_t **out)
{
    char host[256];
    uint16_t port;
    int rc;
    struct sockaddr_storage addr;
    stria_http_metrics_t *srv;
    stria_status_t st;

    st = stria_addr_parse(listen, host, sizeof(host), &port);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "metrics address");
    if (uv_ip4_addr(host, port, (struct sockaddr_in *)&addr) != 0 &&
        uv_ip6_addr(host, port, (struct sockaddr_in6 *)&addr) != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "metrics address '%s': host must be a numeric IP address", listen);
    srv = calloc(1, sizeof(*srv));
    if (srv == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate metrics server");
    srv->loop = loop;
    srv->reg = reg;
    uv_tcp_init(loop, &srv->listener);
    srv->listener.data = srv;
    srv->open_handles = 1;
    rc = uv_tcp_bind(&srv->listener, (struct sockaddr *)&addr, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&srv->listener, 64, stria__http_accept);
    if (rc != 0) {
        st = stria_error_set(STRIA_ERR_IO, "metrics endpoint %s: %s", listen, uv_strerror(rc));
        srv->stopping = true;
        uv_close((uv_handle_t *)&srv->listener, stria__http_listener_closed);
        return st;
    }
    struct sockaddr_storage bound;
    int blen = sizeof(bound);
    uv_tcp_getsockname(&srv->listener, (struct sockaddr *)&bound, &blen);
    srv->port = bound.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                                            : ntohs(((struct sockaddr_in *)&bound)->sin_port);
    *out = srv;
    return STRIA_OK;
}

int stria_http_metrics_port(const stria_http_metrics_t *srv)
{
    return srv->port;
}

void stria_http_metrics_stop(stria_http_metrics_t *srv)
{
    if (srv == NULL || srv->stopping)
        return;
    srv->stopping = true;
    while (srv->conns != NULL)
        stria__http_conn_close(srv->conns);
    uv_close((uv_handle_t *)&srv->listener, stria__http_listener_closed);
}

/* ---- watchdog and signals ---------------------------------------------- */

struct stria_service {
    uv_signal_t sigterm, sigint;
    uv_timer_t watchdog;
    bool watchdog_on;
    bool watchdog_held; /* the probe failed last time: pings withheld */
    stria_liveness_cb alive;
    void *alive_arg;
    stria_shutdown_cb cb;
    void *arg;
    int open_handles;
};

static void stria__svc_signal(uv_signal_t *h, int signum)
{
    stria_service_t *svc = h->data;
    svc->cb(svc->arg, signum);
}

static void stria__svc_watchdog(uv_timer_t *t)
{
    stria_service_t *svc = t->data;
    char why[256] = "";

    if (svc->alive != NULL && !svc->alive(svc->alive_arg, why, sizeof(why))) {
        /* no ping: systemd's WatchdogSec ends the process if this lasts */
        if (!svc->watchdog_held)
            stria_log_error("watchdog: withholding keep-alive pings: %s", why);
        svc->watchdog_held = true;
        return;
    }
    if (svc->watchdog_held)
        stria_log_warn("watchdog: healthy again, keep-alive pings resumed");
    svc->watchdog_held = false;
    stria_notify("WATCHDOG=1");
}

void stria_service_set_liveness(stria_service_t *svc, stria_liveness_cb alive, void *arg)
{
    svc->alive = alive;
    svc->alive_arg = arg;
}

static bool stria__svc_rpc_alive(void *arg, char *why, size_t cap)
{
    /* the loop's housekeeping timer runs every 0.25 s; allow a busy second */
    double limit = stria_notify_watchdog_interval() / 2.0;
    double age = stria_rpc_server_loop_age(arg);
    if (limit < 1.0)
        limit = 1.0;
    if (age <= limit)
        return true;
    snprintf(why, cap, "the RPC loop has not run for %.1f s", age);
    return false;
}

void stria_service_watch_rpc(stria_service_t *svc, const stria_rpc_server_t *server)
{
    stria_service_set_liveness(svc, stria__svc_rpc_alive, (void *)server);
}

stria_status_t stria_service_start(uv_loop_t *loop, stria_shutdown_cb on_shutdown, void *arg,
                                   stria_service_t **out)
{
    stria_service_t *svc = calloc(1, sizeof(*svc));
    double wd = stria_notify_watchdog_interval();

    if (svc == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate service state");
    signal(SIGPIPE, SIG_IGN);
    svc->cb = on_shutdown;
    svc->arg = arg;
    uv_signal_init(loop, &svc->sigterm);
    uv_signal_init(loop, &svc->sigint);
    uv_timer_init(loop, &svc->watchdog);
    svc->sigterm.data = svc->sigint.data = svc->watchdog.data = svc;
    uv_signal_start(&svc->sigterm, stria__svc_signal, SIGTERM);
    uv_signal_start(&svc->sigint, stria__svc_signal, SIGINT);
    if (wd > 0.0) {
        uint64_t ms = (uint64_t)(wd * 500.0);
        uv_timer_start(&svc->watchdog, stria__svc_watchdog, 0, ms > 0 ? ms : 1);
        svc->watchdog_on = true;
    }
    *out = svc;
    return STRIA_OK;
}

static void stria__svc_closed(uv_handle_t *h)
{
    stria_service_t *svc = h->data;
    if (--svc->open_handles == 0)
        free(svc);
}

void stria_service_stop(stria_service_t *svc)
{
    if (svc == NULL)
        return;
    svc->open_handles = 3;
    uv_close((uv_handle_t *)&svc->sigterm, stria__svc_closed);
    uv_close((uv_handle_t *)&svc->sigint, stria__svc_closed);
    uv_close((uv_handle_t *)&svc->watchdog, stria__svc_closed);
}

/* ---- credentials and exposure ------------------------------------------------ */

stria_status_t stria_service_read_credential(const char *what, const char *path, char **token_out)
{
    struct stat sb;
    stria_status_t st = stria_rpc_token_read(path, token_out);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "%s", what);
    if (stat(path, &sb) == 0 && (sb.st_mode & S_IRWXO) != 0)
        stria_log_warn("%s %s: others may read this credential (mode %04o); chmod 0600 or 0640",
                       what, path, (unsigned)(sb.st_mode & 07777));
    return STRIA_OK;
}

stria_status_t stria_service_client_credential(const stria_cli_t *cli, const char *client_file,
                                               const char *token_file, const char **file_out,
                                               const char **opt_out)
{
    bool flag_client = stria_cli_from(cli, "client-token-file") == STRIA_OPT_FROM_FLAG;
    bool flag_token = stria_cli_from(cli, "token-file") == STRIA_OPT_FROM_FLAG;
    if (client_file != NULL && token_file != NULL && flag_client == flag_token)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "--token-file and --client-token-file name the same credential; "
                               "give one");
    bool use_client = client_file != NULL && (token_file == NULL || flag_client);
    *file_out = use_client ? client_file : token_file;
    *opt_out = *file_out == NULL ? NULL : use_client ? "client-token-file" : "token-file";
    return STRIA_OK;
}

stria_status_t stria_service_log_level(const stria_cli_t *cli, const char *level)
{
    stria_log_level_t lvl = STRIA_LOG_INFO;
    stria_status_t st;
    if (level != NULL && (st = stria_log_parse_level(level, &lvl)) != STRIA_OK)
        return stria_cli_wrap(cli, "log-level", st);
    if (level != NULL || getenv("STRIA_LOG_LEVEL") == NULL)
        stria_log_set_level(lvl);
    return STRIA_OK;
}

stria_status_t stria_service_check_exposure(const char *what, const char *addr,
                                            bool has_credentials, bool insecure)
{
    if (addr == NULL || has_credentials || insecure || stria_addr_listen_is_loopback(addr))
        return STRIA_OK;
    return stria_error_set(STRIA_ERR_INVALID_ARG,
                           "%s %s: refusing to listen where other machines reach it without "
                           "credentials; set --client-token-file and --worker-token-file "
                           "(stria-coordinator --gen-credentials DIR makes them; see "
                           "docs/SECURITY.md), listen on a loopback address, or pass --insecure "
                           "to serve anyone who reaches the port",
                           what, addr);
}

/* Writes one new credential to dir/name, mode 0600, never over a file. */
static stria_status_t stria__write_credential(const char *dir, const char *name)
{
    char path[4096], token[STRIA_AUTH_TOKEN_CHARS + 2];
    stria_status_t st = stria_auth_token_generate(token);
    if (st != STRIA_OK)
        return st;
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        memset(token, 0, sizeof(token));
        return stria_error_set(STRIA_ERR_IO, "%s: %s%s", path, strerror(errno),
                               errno == EEXIST ? " (remove it first to make a new one)" : "");
    }
    strcat(token, "\n");
    size_t len = strlen(token);
    ssize_t w = write(fd, token, len);
    memset(token, 0, sizeof(token));
    if (w != (ssize_t)len || fsync(fd) != 0 || close(fd) != 0) {
        if (w != (ssize_t)len)
            close(fd);
        unlink(path);
        return stria_error_set(STRIA_ERR_IO, "%s: cannot write", path);
    }
    return STRIA_OK;
}

stria_status_t stria_service_gen_credentials(const char *dir)
{
    static const char *const names[] = {"client-token", "worker-token", "admin-token"};
    struct stat sb;
    if (dir == NULL || dir[0] == '\0')
        return stria_error_set(STRIA_ERR_INVALID_ARG, "--gen-credentials: no folder given");
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return stria_error_set(STRIA_ERR_IO, "--gen-credentials %s: %s", dir, strerror(errno));
    if (lstat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return stria_error_set(STRIA_ERR_IO, "--gen-credentials %s: not a folder", dir);
    if ((sb.st_mode & (S_IRWXG | S_IRWXO)) != 0 && chmod(dir, 0700) != 0)
        return stria_error_set(STRIA_ERR_IO, "--gen-credentials %s: chmod 0700: %s", dir,
                               strerror(errno));
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        if (lstat(path, &sb) == 0)
            return stria_error_set(STRIA_ERR_IO,
                                   "--gen-credentials: %s exists; remove the old credentials "
                                   "first (nothing was written)",
                                   path);
    }
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        stria_status_t st = stria__write_credential(dir, names[i]);
        if (st != STRIA_OK)
            return stria_error_wrap(st, "--gen-credentials");
    }
    return STRIA_OK;
}
