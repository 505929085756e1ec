/*
 * stria-worker: the main program around the worker library (stria_worker.h):
 * the flags and the configuration file, the service loop (/metrics, the
 * systemd watchdog, signals), systemd notifications and the graceful
 * shutdown on SIGTERM/SIGINT.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stria_service.h"
#include "stria_worker.h"

/* Settings of a worker (flags and configuration file). */
typedef struct {
    const char *coordinator; /* HOST:PORT */
    const char *listen;      /* RPC HOST:PORT */
    const char *ucx_listen;  /* ring link HOST:PORT */
    const char *advertise;   /* host name/address others use to reach us */
    const char *device;      /* --device: "auto", "cpu", "cuda:0", ... */
    const char *host;        /* host name for ring grouping; default gethostname() */
    const char *token_file;
    const char *metrics_listen;
    const char *log_level;
    const char *ucx_tls; /* UCX_TLS for the ring link; NULL: UCX default */
    const char *ucx_net_devices;
    int64_t instance;         /* GPU index: derives ports and device; -1 = none */
    int64_t memory_bytes;     /* offered to jobs; 0 = half of physical memory */
    int64_t threads;          /* kernel threads; 0 = online CPUs */
    double step_timeout_s;    /* default deadline of one ring step */
    double connect_timeout_s; /* ring link set-up */
} stria_worker_config_t;

/* What the program owns around the worker. */
typedef struct {
    stria_worker_config_t cfg;
    char *token;
    stria_pool_t *pool;
    stria_device_t *dev;
    stria_metrics_t *metrics;
    stria_worker_t *worker;
    char listen_buf[300], ucx_buf[300], metrics_buf[300];
} stria__main_t;

/* ---- service loop: metrics endpoint, watchdog, signals ------------------------- */

typedef struct {
    stria__main_t *m;
    uv_loop_t loop;
    uv_async_t stop, watch;
    stria_service_t *svc;
    stria_http_metrics_t *http;
    stria_status_t start_status;
    char start_error[512];
    pthread_mutex_t lock;
    pthread_cond_t cv;
    int state; /* 0 starting, 1 running, 2 failed */
    int signum;
} stria__svc_loop_t;

static void stria__on_signal(void *arg, int signum)
{
    stria__svc_loop_t *sl = arg;
    pthread_mutex_lock(&sl->lock);
    sl->signum = signum;
    pthread_cond_broadcast(&sl->cv);
    pthread_mutex_unlock(&sl->lock);
}

static void stria__svc_stop(uv_async_t *a)
{
    stria__svc_loop_t *sl = a->data;
    stria_http_metrics_stop(sl->http);
    stria_service_stop(sl->svc);
    uv_close((uv_handle_t *)&sl->watch, NULL);
    uv_close((uv_handle_t *)a, NULL);
}

/* Once the worker serves: the watchdog pings only while its RPC loop runs. */
static void stria__svc_watch(uv_async_t *a)
{
    stria__svc_loop_t *sl = a->data;
    stria_service_watch_rpc(sl->svc, stria_worker_server(sl->m->worker));
}

static void *stria__svc_thread(void *arg)
{
    stria__svc_loop_t *sl = arg;
    const stria_worker_config_t *c = &sl->m->cfg;
    stria_status_t st;
    uv_loop_init(&sl->loop);
    uv_async_init(&sl->loop, &sl->stop, stria__svc_stop);
    uv_async_init(&sl->loop, &sl->watch, stria__svc_watch);
    sl->stop.data = sl->watch.data = sl;
    st = stria_service_start(&sl->loop, stria__on_signal, sl, &sl->svc);
    if (st == STRIA_OK && c->metrics_listen != NULL && c->metrics_listen[0])
        st = stria_http_metrics_start(&sl->loop, c->metrics_listen, sl->m->metrics, &sl->http);
    pthread_mutex_lock(&sl->lock);
    sl->start_status = st;
    if (st != STRIA_OK)
        snprintf(sl->start_error, sizeof(sl->start_error), "%s", stria_error_msg());
    sl->state = st == STRIA_OK ? 1 : 2;
    pthread_cond_broadcast(&sl->cv);
    pthread_mutex_unlock(&sl->lock);
    if (st != STRIA_OK)
        stria__svc_stop(&sl->stop);
    uv_run(&sl->loop, UV_RUN_DEFAULT);
    uv_loop_close(&sl->loop);
    return NULL;
}

/* Starts the service loop's thread and waits until it serves (or failed). */
static stria_status_t stria__svc_begin(stria__svc_loop_t *sl, pthread_t *th)
{
    if (pthread_create(th, NULL, stria__svc_thread, sl) != 0)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot start the service thread");
    pthread_mutex_lock(&sl->lock);
    while (sl->state == 0)
        pthread_cond_wait(&sl->cv, &sl->lock);
    pthread_mutex_unlock(&sl->lock);
    if (sl->state == 2) {
        pthread_join(*th, NULL);
        return stria_error_set(sl->start_status, "%s", sl->start_error);
    }
    return STRIA_OK;
}

/* ---- configuration --------------------------------------------------------------- */

static void stria__usage(FILE *out, const stria_opt_t *opts)
{
    fprintf(out, "usage: stria-worker --coordinator HOST:PORT [options]\n"
                 "\n"
                 "One worker of the stria attention service: it registers with the coordinator,\n"
                 "receives the shards of jobs from clients and runs ring passes with the other\n"
                 "workers of each job over UCX.\n"
                 "\n"
                 "options (each is also a 'name = value' setting of the --config file):\n");
    stria_opts_print_help(opts, out);
    fprintf(out, "  %-28s %s\n", "-h, --help", "this help");
    fprintf(out, "\n"
                 "With --instance N (the GPU index, as in the systemd unit stria-worker@N), the\n"
                 "ports of --listen, --ucx-listen and --metrics-listen are bases and N is added\n"
                 "to each (port 0 stays a free port); their defaults become 127.0.0.1:7500,\n"
                 "127.0.0.1:7600 and 127.0.0.1:9500, so instance N listens on 7500+N, 7600+N\n"
                 "and 9500+N.\n"
                 "Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 on a start-up\n"
                 "failure, 2 on a usage or configuration error.\n");
}

/* The address of `instance`: the port of `given` (else of `dflt`) plus the
 * instance number; port 0 stays 0 (a free port). */
static stria_status_t stria__instance_addr(const char *what, const char *given, const char *dflt,
                                           int64_t instance, char *out, size_t len)
{
    char host[256];
    int port;
    stria_status_t st = stria_parse_host_port(given ? given : dflt, host, sizeof(host), &port);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "%s", what);
    if (port != 0)
        port += (int)instance;
    if (port > 65535)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s %s: with --instance %lld the port would be %d, above 65535",
                               what, given ? given : dflt, (long long)instance, port);
    snprintf(out, len, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
    return STRIA_OK;
}

static stria_status_t stria__config_finish(stria_worker_config_t *c, char *listen_buf,
                                           char *ucx_buf, char *metrics_buf, size_t len)
{
    if (c->coordinator == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "--coordinator HOST:PORT is required");
    char host[256];
    int port;
    stria_status_t st = stria_parse_host_port(c->coordinator, host, sizeof(host), &port);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "--coordinator");
    if (c->instance >= 0) {
        /* One configuration file serves every instance of a host: its ports
         * are bases, and instance N listens N ports above them. */
        if ((st = stria__instance_addr("--listen", c->listen, "127.0.0.1:7500", c->instance,
                                       listen_buf, len)) != STRIA_OK ||
            (st = stria__instance_addr("--ucx-listen", c->ucx_listen, "127.0.0.1:7600", c->instance,
                                       ucx_buf, len)) != STRIA_OK ||
            (st = stria__instance_addr("--metrics-listen", c->metrics_listen, "127.0.0.1:9500",
                                       c->instance, metrics_buf, len)) != STRIA_OK)
            return st;
        c->listen = listen_buf;
        c->ucx_listen = ucx_buf;
        c->metrics_listen = metrics_buf;
    }
    if (c->listen == NULL)
        c->listen = "127.0.0.1:0";
    if (c->ucx_listen == NULL)
        c->ucx_listen = "127.0.0.1:0";
    if ((st = stria_parse_host_port(c->listen, host, sizeof(host), &port)) != STRIA_OK)
        return stria_error_wrap(st, "--listen");
    if ((st = stria_parse_host_port(c->ucx_listen, host, sizeof(host), &port)) != STRIA_OK)
        return stria_error_wrap(st, "--ucx-listen");
    if (c->memory_bytes == 0) {
        long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
        c->memory_bytes = pages > 0 && psize > 0 ? (int64_t)pages * psize / 2 : (int64_t)1 << 30;
    }
    if (c->log_level != NULL) {
        stria_log_level_t lvl;
        if ((st = stria_log_parse_level(c->log_level, &lvl)) != STRIA_OK)
            return stria_error_wrap(st, "--log-level");
        stria_log_set_level(lvl);
    }
    return STRIA_OK;
}

/* Where the --device value came from, for its error: the flag, or the line
 * of the configuration file that set it (the last one, which wins). */
static void stria__device_origin(int argc, char **argv, const char *config_path, const char *value,
                                 char *out, size_t len)
{
    char line[1024];
    int lineno = 0, found = 0;
    FILE *f;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--device") == 0 || strncmp(argv[i], "--device=", 9) == 0) {
            snprintf(out, len, "--device %s", value);
            return;
        }
    if (config_path != NULL && (f = fopen(config_path, "r")) != NULL) {
        while (fgets(line, sizeof(line), f) != NULL) {
            const char *p = line + strspn(line, " \t");
            lineno++;
            if (strncmp(p, "device", 6) == 0 && p[6 + strspn(p + 6, " \t")] == '=')
                found = lineno;
        }
        fclose(f);
    }
    if (found > 0)
        snprintf(out, len, "%s:%d: device = %s", config_path, found, value);
    else
        snprintf(out, len, "device %s", value);
}

/* Opens the device of --device (auto: cuda:N of --instance N, or cuda:0,
 * when a GPU is visible; else cpu) over the program's pool; a GPU's memory
 * bounds what is offered to jobs unless --memory says otherwise. */
static stria_status_t stria__device_start(stria__main_t *m, bool memory_given, int argc,
                                          char **argv, const char *config_path)
{
    stria_worker_config_t *c = &m->cfg;
    char name[32], origin[1200];
    size_t dev_free = 0, dev_total = 0;
    stria_status_t st;
    snprintf(name, sizeof(name), "%s", c->device);
    if (strcmp(c->device, "auto") == 0 && c->instance >= 0 && stria_cuda_device_count() > 0)
        snprintf(name, sizeof(name), "cuda:%lld", (long long)c->instance);
    if ((st = stria_device_open(strlen(c->device) < sizeof(name) ? name : c->device, m->pool,
                                &m->dev)) != STRIA_OK) {
        stria__device_origin(argc, argv, config_path, c->device, origin, sizeof(origin));
        return stria_error_wrap(st, "%s", origin);
    }
    if (stria_device_kind(m->dev) != STRIA_DEVICE_CPU && !memory_given) {
        if ((st = stria_device_memory(m->dev, &dev_free, &dev_total)) != STRIA_OK)
            return stria_error_wrap(st, "%s", stria_device_name(m->dev));
        if ((int64_t)dev_free < c->memory_bytes)
            c->memory_bytes = (int64_t)dev_free;
    }
    return STRIA_OK;
}

/* Flags, configuration file, token, pool and device: a failure here is a
 * usage or configuration error (exit status 2). */
static stria_status_t stria__configure(stria__main_t *m, const stria_opt_t *opts, int argc,
                                       char **argv)
{
    stria_worker_config_t *c = &m->cfg;
    const char *config_path = NULL;
    stria_status_t st = stria_opts_parse(opts, argc, argv, 1, &config_path);
    bool memory_given = c->memory_bytes != 0;
    if (st == STRIA_OK)
        st = stria__config_finish(c, m->listen_buf, m->ucx_buf, m->metrics_buf,
                                  sizeof(m->listen_buf));
    if (st == STRIA_OK && c->token_file != NULL &&
        (st = stria_rpc_token_read(c->token_file, &m->token)) != STRIA_OK)
        stria_error_wrap(st, "--token-file");
    if (st == STRIA_OK && (st = stria_pool_create((int)c->threads, &m->pool)) == STRIA_OK)
        st = stria__device_start(m, memory_given, argc, argv, config_path);
    return st;
}

static stria_status_t stria__start_worker(stria__main_t *m)
{
    const stria_worker_config_t *c = &m->cfg;
    stria_worker_params_t p;
    memset(&p, 0, sizeof(p));
    p.coordinator = c->coordinator;
    p.listen = c->listen;
    p.advertise = c->advertise;
    p.host = c->host;
    p.token = m->token;
    p.memory_bytes = c->memory_bytes;
    p.step_timeout_s = c->step_timeout_s;
    p.connect_timeout_s = c->connect_timeout_s;
    p.pool = m->pool;
    p.device = m->dev;
    p.metrics = m->metrics;
    p.notify_status = true;
    p.ucx_listen = c->ucx_listen;
    p.ucx_tls = c->ucx_tls;
    p.ucx_net_devices = c->ucx_net_devices;
    return stria_worker_start(&p, &m->worker);
}

/* Machine-readable lines for scripts and tests that start workers on port 0. */
static void stria__print_listening(const stria__main_t *m, const stria__svc_loop_t *sl)
{
    char metrics_addr[300] = "";
    if (sl->http) {
        char mhost[256];
        int ignored;
        stria_parse_host_port(m->cfg.metrics_listen, mhost, sizeof(mhost), &ignored);
        snprintf(metrics_addr, sizeof(metrics_addr),
                 strchr(mhost, ':') ? " metrics=[%s]:%d" : " metrics=%s:%d", mhost,
                 stria_http_metrics_port(sl->http));
    }
    printf("stria-worker listening rpc=%s ucx=%s%s\n", stria_worker_address(m->worker),
           stria_worker_link_address(m->worker), metrics_addr);
    if (sl->http)
        printf("stria-worker metrics port %d\n", stria_http_metrics_port(sl->http));
    fflush(stdout);
}

/* Waits for SIGTERM/SIGINT and shuts down; 0 unless a pass still runs. */
static int stria__serve_until_signal(stria__main_t *m, stria__svc_loop_t *sl, pthread_t svc_th)
{
    char reason[64];
    pthread_mutex_lock(&sl->lock);
    while (sl->signum == 0)
        pthread_cond_wait(&sl->cv, &sl->lock);
    int signum = sl->signum;
    pthread_mutex_unlock(&sl->lock);
    stria_log_info("signal %d: shutting down", signum);
    stria_notify("STOPPING=1\nSTATUS=shutting down");
    snprintf(reason, sizeof(reason), "shut down (%s)",
             signum == SIGTERM  ? "SIGTERM"
             : signum == SIGINT ? "SIGINT"
                                : "signal");
    int still_running = stria_worker_shutdown(m->worker, reason);
    uv_async_send(&sl->stop);
    pthread_join(svc_th, NULL);
    if (still_running > 0) /* a pass still holds a call: the server cannot be stopped safely */
        stria_log_warn("%d pass(es) still running at exit", still_running);
    return still_running;
}

int main(int argc, char **argv)
{
    stria__main_t *m = calloc(1, sizeof(*m));
    stria_worker_config_t *c = &m->cfg;
    stria__svc_loop_t sl;
    pthread_t svc_th;
    stria_status_t st;

    if (m == NULL)
        return 1;
    c->instance = -1;
    c->step_timeout_s = 60.0;
    c->connect_timeout_s = 30.0;
    c->device = "auto";
    const stria_opt_t opts[] = {
        {"coordinator", STRIA_OPT_STRING, &c->coordinator, 0, 0, "HOST:PORT",
         "the coordinator (required)"},
        {"listen", STRIA_OPT_STRING, &c->listen, 0, 0, "HOST:PORT",
         "RPC address for clients (default 127.0.0.1:0, a free port)"},
        {"ucx-listen", STRIA_OPT_STRING, &c->ucx_listen, 0, 0, "HOST:PORT",
         "ring link listener (default 127.0.0.1:0)"},
        {"advertise", STRIA_OPT_STRING, &c->advertise, 0, 0, "HOST",
         "host that clients and peers use to reach this worker (default: the listen host)"},
        {"instance", STRIA_OPT_INT, &c->instance, -1, 1023, "N",
         "GPU index of this worker: its ports are the bases plus N (see below)"},
        {"device", STRIA_OPT_STRING, &c->device, 0, 0, "NAME",
         "cpu, cuda:N (cuda = cuda:0), cpu:staged (tests) or auto (default: cuda:0, or cuda:N "
         "with --instance N, when a GPU is visible, else cpu)"},
        {"host", STRIA_OPT_STRING, &c->host, 0, 0, "NAME",
         "host name for ring grouping (default: this machine's)"},
        {"memory", STRIA_OPT_INT, &c->memory_bytes, 0, 1e18, "BYTES",
         "memory offered to jobs (default half of physical memory)"},
        {"threads", STRIA_OPT_INT, &c->threads, 0, 1024, "N",
         "kernel threads (default: online CPUs)"},
        {"step-timeout", STRIA_OPT_DOUBLE, &c->step_timeout_s, 0.01, 86400, "SECONDS",
         "default deadline of one ring step (default 60)"},
        {"connect-timeout", STRIA_OPT_DOUBLE, &c->connect_timeout_s, 0.1, 3600, "SECONDS",
         "deadline of ring link set-up (default 30)"},
        {"ucx-tls", STRIA_OPT_STRING, &c->ucx_tls, 0, 0, "LIST",
         "UCX transports for the ring link, as UCX_TLS (default: UCX's choice)"},
        {"ucx-net-devices", STRIA_OPT_STRING, &c->ucx_net_devices, 0, 0, "LIST",
         "network devices for the ring link, as UCX_NET_DEVICES"},
        {"token-file", STRIA_OPT_STRING, &c->token_file, 0, 0, "FILE",
         "shared secret of the service (first line of FILE)"},
        {"metrics-listen", STRIA_OPT_STRING, &c->metrics_listen, 0, 0, "HOST:PORT",
         "Prometheus /metrics endpoint (default: none)"},
        {"log-level", STRIA_OPT_STRING, &c->log_level, 0, 0, "LEVEL",
         "error, warn, info (default) or debug"},
        {NULL, 0, NULL, 0, 0, NULL, NULL},
    };

    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            stria__usage(stdout, opts);
            free(m);
            return 0;
        }
    if (getenv("STRIA_LOG_LEVEL") == NULL)
        stria_log_set_level(STRIA_LOG_INFO);
    if ((st = stria__configure(m, opts, argc, argv)) != STRIA_OK) {
        /* usage and configuration errors: exit status 2, nothing left behind */
        fprintf(stderr, "stria-worker: %s\n(see stria-worker --help)\n", stria_error_msg());
        stria_device_close(m->dev);
        stria_pool_destroy(m->pool);
        stria_opts_free(opts);
        free(m->token);
        free(m);
        return 2;
    }
    memset(&sl, 0, sizeof(sl));
    pthread_mutex_init(&sl.lock, NULL);
    pthread_cond_init(&sl.cv, NULL);
    sl.m = m;
    if ((st = stria_metrics_create(&m->metrics)) != STRIA_OK ||
        (st = stria__svc_begin(&sl, &svc_th)) != STRIA_OK)
        goto fail;
    if ((st = stria__start_worker(m)) != STRIA_OK)
        goto fail;
    uv_async_send(&sl.watch);
    stria__print_listening(m, &sl);
    if (stria__serve_until_signal(m, &sl, svc_th) > 0)
        return 0;
    stria_worker_stop(m->worker);
    stria_device_close(m->dev);
    stria_pool_destroy(m->pool);
    stria_metrics_destroy(m->metrics);
    stria_opts_free(opts);
    free(m->token);
    free(m);
    return 0;

fail:
    fprintf(stderr, "stria-worker: %s\n",
            stria_error_msg()[0] ? stria_error_msg() : stria_status_str(st));
    return 1;
}
