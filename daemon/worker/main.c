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

/* Settings of a worker (flags and configuration file). The ones the worker
 * library takes as they are live in p: coordinator, listen (RPC), advertise,
 * host (ring grouping), memory_bytes (0: half of physical memory),
 * step_timeout_s, connect_timeout_s, ucx_listen, ucx_tls, ucx_net_devices,
 * runtime_dir. */
typedef struct {
    stria_worker_params_t p;
    const char *device;     /* --device: "auto", "cpu", "cuda:0", ... */
    const char *token_file; /* the clients' credential (the older name) */
    const char *client_token_file;
    const char *worker_token_file;
    bool insecure;
    const char *metrics_listen;
    const char *log_level;
    int64_t instance; /* GPU index: derives ports and device; -1 = none */
    int64_t threads;  /* kernel threads; 0 = online CPUs */
} stria_worker_config_t;

/* What the program owns around the worker. */
typedef struct {
    stria_worker_config_t cfg;
    char *token;        /* the clients' credential, checked by this worker's RPC */
    char *worker_token; /* the workers' credential, proven to the coordinator */
    stria_pool_t *pool;
    stria_device_t *dev;
    stria_metrics_t *metrics;
    stria_worker_t *worker;
    /* The option table and the parse: the parse refers to the table and
     * holds the strings read from the file, so both live as long as cfg. */
    stria_option_t opts[24];
    stria_command_t cmd;
    stria_cli_t cli;
    bool memory_by_rule; /* --memory unset or 0: half of physical memory, or a GPU's free */
    char listen_buf[300], ucx_buf[300], metrics_buf[300];
} main_t;

/* ---- service loop: metrics endpoint, watchdog, signals ------------------------- */

typedef struct {
    main_t *m;
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
} svc_loop_t;

static void wmain_on_signal(void *arg, int signum)
{
    svc_loop_t *sl = arg;
    pthread_mutex_lock(&sl->lock);
    sl->signum = signum;
    pthread_cond_broadcast(&sl->cv);
    pthread_mutex_unlock(&sl->lock);
}

static void svc_stop(uv_async_t *a)
{
    svc_loop_t *sl = a->data;
    stria_http_metrics_stop(sl->http);
    stria_service_stop(sl->svc);
    uv_close((uv_handle_t *)&sl->watch, NULL);
    uv_close((uv_handle_t *)a, NULL);
}

/* Once the worker serves: the watchdog pings only while its RPC loop runs. */
static void svc_watch(uv_async_t *a)
{
    svc_loop_t *sl = a->data;
    stria_service_watch_rpc(sl->svc, stria_worker_server(sl->m->worker));
}

static void *svc_thread(void *arg)
{
    svc_loop_t *sl = arg;
    const stria_worker_config_t *c = &sl->m->cfg;
    stria_status_t st;
    uv_loop_init(&sl->loop);
    uv_async_init(&sl->loop, &sl->stop, svc_stop);
    uv_async_init(&sl->loop, &sl->watch, svc_watch);
    sl->stop.data = sl->watch.data = sl;
    st = stria_service_start(&sl->loop, wmain_on_signal, sl, &sl->svc);
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
        svc_stop(&sl->stop);
    uv_run(&sl->loop, UV_RUN_DEFAULT);
    uv_loop_close(&sl->loop);
    return NULL;
}

/* Starts the service loop's thread and waits until it serves (or failed). */
static stria_status_t svc_begin(svc_loop_t *sl, pthread_t *th)
{
    if (pthread_create(th, NULL, svc_thread, sl) != 0)
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

static const char worker_description[] =
    "One worker of the stria attention service: it registers with the coordinator,\n"
    "runs the calls of clients' sessions and jobs as ring passes with the other\n"
    "workers of each over UCX. Every option is also a 'name = value' setting of\n"
    "the --config file.";

static const char worker_epilog[] =
    "With --instance N (the GPU index, as in the systemd unit stria-worker@N), the\n"
    "ports of --listen, --ucx-listen and --metrics-listen are bases and N is added\n"
    "to each (port 0 stays a free port); their defaults become 127.0.0.1:7500,\n"
    "127.0.0.1:7600 and 127.0.0.1:9500, so instance N listens on 7500+N, 7600+N\n"
    "and 9500+N.\n"
    "Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 on a start-up\n"
    "failure, 2 on a usage or configuration error.";

/* The address of `instance`: the port of `given` (else of `dflt`) plus the
 * instance number; port 0 stays 0 (a free port). */
static stria_status_t instance_addr(const char *what, const char *given, const char *dflt,
                                    int64_t instance, char *out, size_t len)
{
    char host[256];
    uint16_t base;
    stria_status_t st = stria_addr_parse(given ? given : dflt, host, sizeof(host), &base);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "%s", what);
    int port = base;
    if (port != 0)
        port += (int)instance;
    if (port > 65535)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s %s: with --instance %lld the port would be %d, above 65535",
                               what, given ? given : dflt, (long long)instance, port);
    snprintf(out, len, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
    return STRIA_OK;
}

static stria_status_t config_finish(main_t *m, size_t len)
{
    stria_worker_config_t *c = &m->cfg;
    char *listen_buf = m->listen_buf, *ucx_buf = m->ucx_buf, *metrics_buf = m->metrics_buf;
    stria_status_t st;
    if (c->instance >= 0) {
        /* One configuration file serves every instance of a host: its ports
         * are bases, and instance N listens N ports above them. */
        if ((st = instance_addr("--listen", c->p.listen, "127.0.0.1:7500", c->instance, listen_buf,
                                len)) != STRIA_OK ||
            (st = instance_addr("--ucx-listen", c->p.ucx_listen, "127.0.0.1:7600", c->instance,
                                ucx_buf, len)) != STRIA_OK ||
            (st = instance_addr("--metrics-listen", c->metrics_listen, "127.0.0.1:9500",
                                c->instance, metrics_buf, len)) != STRIA_OK)
            return st;
        c->p.listen = listen_buf;
        c->p.ucx_listen = ucx_buf;
        c->metrics_listen = metrics_buf;
    }
    if (c->p.listen == NULL)
        c->p.listen = "127.0.0.1:0";
    if (c->p.ucx_listen == NULL)
        c->p.ucx_listen = "127.0.0.1:0";
    m->memory_by_rule = c->p.memory_bytes == 0;
    if (c->p.memory_bytes == 0) {
        long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
        c->p.memory_bytes = pages > 0 && psize > 0 ? (int64_t)pages * psize / 2 : (int64_t)1 << 30;
    }
    return stria_service_log_level(&m->cli, c->log_level);
}

/* Opens the device of --device (auto: cuda:N of --instance N, or cuda:0,
 * when a GPU is visible; else cpu) over the program's pool; a GPU's memory
 * bounds what is offered to jobs unless --memory says otherwise. */
static stria_status_t device_start(main_t *m)
{
    stria_worker_config_t *c = &m->cfg;
    char name[32];
    size_t dev_free = 0, dev_total = 0;
    stria_status_t st;
    snprintf(name, sizeof(name), "%s", c->device);
    if (strcmp(c->device, "auto") == 0 && c->instance >= 0 && stria_cuda_device_count() > 0)
        snprintf(name, sizeof(name), "cuda:%lld", (long long)c->instance);
    if ((st = stria_device_open(strlen(c->device) < sizeof(name) ? name : c->device, m->pool,
                                &m->dev)) != STRIA_OK)
        return stria_cli_wrap(&m->cli, "device", st);
    if (stria_device_kind(m->dev) != STRIA_DEVICE_CPU && m->memory_by_rule) {
        if ((st = stria_device_memory(m->dev, &dev_free, &dev_total)) != STRIA_OK)
            return stria_error_wrap(st, "%s", stria_device_name(m->dev));
        if ((int64_t)dev_free < c->p.memory_bytes)
            c->p.memory_bytes = (int64_t)dev_free;
    }
    return STRIA_OK;
}

/* Parses the flags and the configuration file into m->cfg, with help and
 * usage errors handled; returns -1 to go on, else the exit status. */
static int options(main_t *m, int argc, char **argv)
{
    stria_worker_config_t *c = &m->cfg;
    const stria_option_t opts[] = {
        STRIA_OPTION("coordinator", ADDR, &c->p.coordinator, "HOST:PORT", "the coordinator",
                     .flags = STRIA_OPT_REQUIRED),
        STRIA_OPTION("listen", ADDR, &c->p.listen, "HOST:PORT",
                     "RPC address for clients (default 127.0.0.1:0, a free port)"),
        STRIA_OPTION("ucx-listen", ADDR, &c->p.ucx_listen, "HOST:PORT",
                     "ring link listener (default 127.0.0.1:0)"),
        STRIA_OPTION(
            "advertise", STRING, &c->p.advertise, "HOST",
            "host that clients and peers use to reach this worker (default: the listen host)"),
        STRIA_OPTION("instance", INT, &c->instance, "N",
                     "GPU index of this worker: its ports are the bases plus N (see below)",
                     .dflt = "-1", .min = -1, .max = 1023),
        STRIA_OPTION("device", STRING, &c->device, "NAME",
                     "cpu, cuda:N (cuda = cuda:0), cpu:staged (tests) or auto: cuda:0, or cuda:N "
                     "with --instance N, when a GPU is visible, else cpu",
                     .dflt = "auto"),
        STRIA_OPTION("host", STRING, &c->p.host, "NAME",
                     "host name for ring grouping (default: this machine's)"),
        STRIA_OPTION("memory", BYTES, &c->p.memory_bytes, "BYTES",
                     "memory offered to jobs, e.g. 64G (default half of physical memory; on a GPU "
                     "at most its free memory)",
                     .min = 0, .max = 1e18),
        STRIA_OPTION("threads", INT, &c->threads, "N", "kernel threads (default: online CPUs)",
                     .min = 0, .max = 1024),
        STRIA_OPTION("step-timeout", DURATION, &c->p.step_timeout_s, "TIME",
                     "default deadline of one ring step", .dflt = "60", .min = 0.01, .max = 86400),
        STRIA_OPTION("connect-timeout", DURATION, &c->p.connect_timeout_s, "TIME",
                     "deadline of ring link set-up", .dflt = "30", .min = 0.1, .max = 3600),
        STRIA_OPTION("ucx-tls", STRING, &c->p.ucx_tls, "LIST",
                     "UCX transports for the ring link, as UCX_TLS (default: UCX's choice)"),
        STRIA_OPTION("ucx-net-devices", STRING, &c->p.ucx_net_devices, "LIST",
                     "network devices for the ring link, as UCX_NET_DEVICES"),
        STRIA_OPTION("runtime-dir", STRING, &c->p.runtime_dir, "DIR",
                     "folder of the Unix socket through which clients of this host move tensors in "
                     "shared memory (default: $RUNTIME_DIRECTORY, set by systemd's "
                     "RuntimeDirectory=; none: clients use TCP)"),
        STRIA_SERVICE_OPTIONS(
            c, "credential of the clients, which this worker's RPC checks",
            "credential of the workers, proven to the coordinator (the same on every worker)"),
        {.name = NULL},
    };
    _Static_assert(sizeof(opts) <= sizeof(m->opts), "main_t.opts is too small");
    memcpy(m->opts, opts, sizeof(opts));
    m->cmd = (stria_command_t){.name = "stria-worker",
                               .description = worker_description,
                               .epilog = worker_epilog,
                               .options = m->opts,
                               .config = true};
    return stria_cli_main(&m->cmd, argc, argv, &m->cli);
}

/* Reads the credentials (both or neither) and applies the exposure rule to
 * the three listeners. */
static stria_status_t credentials(main_t *m)
{
    stria_worker_config_t *c = &m->cfg;
    char what[512];
    stria_status_t st = STRIA_OK;
    const char *client_file, *client_opt;
    st = stria_service_client_credential(&m->cli, c->client_token_file, c->token_file, &client_file,
                                         &client_opt);
    if (st == STRIA_OK && client_file != NULL)
        st = stria_service_read_credential(
            stria_cli_origin(&m->cli, client_opt, what, sizeof(what)), client_file, &m->token);
    if (st == STRIA_OK && c->worker_token_file != NULL)
        st = stria_service_read_credential(
            stria_cli_origin(&m->cli, "worker-token-file", what, sizeof(what)),
            c->worker_token_file, &m->worker_token);
    if (st != STRIA_OK)
        return st;
    if ((m->token == NULL) != (m->worker_token == NULL))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "a worker needs both --client-token-file (or --token-file), which "
                               "its clients prove, and --worker-token-file, which it proves to "
                               "the coordinator; or neither");
    const char *names[] = {"listen", "ucx-listen", "metrics-listen"};
    const char *addrs[] = {c->p.listen, c->p.ucx_listen, c->metrics_listen};
    for (int i = 0; i < 3 && st == STRIA_OK; i++)
        st = stria_service_check_exposure(stria_cli_origin(&m->cli, names[i], what, sizeof(what)),
                                          addrs[i] && addrs[i][0] ? addrs[i] : NULL,
                                          m->token != NULL, c->insecure);
    return st;
}

/* The configuration file's checks beyond the table, the credentials, the
 * pool and the device: a failure here is a configuration error (exit status
 * 2). */
static stria_status_t configure(main_t *m)
{
    stria_worker_config_t *c = &m->cfg;
    stria_status_t st = config_finish(m, sizeof(m->listen_buf));
    if (st == STRIA_OK)
        st = credentials(m);
    if (st == STRIA_OK && (st = stria_pool_create((int)c->threads, &m->pool)) == STRIA_OK)
        st = device_start(m);
    if (st == STRIA_OK)
        stria_cli_log(&m->cli);
    return st;
}

static stria_status_t wmain_start(main_t *m)
{
    const stria_worker_config_t *c = &m->cfg;
    stria_worker_params_t p = c->p;
    p.notify_status = true;
    p.has_device_index = c->instance >= 0;
    p.device_index = c->instance >= 0 ? (uint32_t)c->instance : 0;
    if (p.runtime_dir == NULL && getenv("RUNTIME_DIRECTORY") != NULL &&
        getenv("RUNTIME_DIRECTORY")[0] != '\0')
        p.runtime_dir = getenv("RUNTIME_DIRECTORY");
    /* what main created, for the worker to use (not own) */
    p.token = m->token;
    p.worker_token = m->worker_token;
    p.pool = m->pool;
    p.device = m->dev;
    p.metrics = m->metrics;
    return stria_worker_start(&p, &m->worker);
}

/* Machine-readable lines for scripts and tests that start workers on port 0. */
static void print_listening(const main_t *m, const svc_loop_t *sl)
{
    char metrics_addr[300] = "";
    if (sl->http) {
        char mhost[256];
        uint16_t ignored;
        stria_addr_parse(m->cfg.metrics_listen, mhost, sizeof(mhost), &ignored);
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
static int serve_until_signal(main_t *m, svc_loop_t *sl, pthread_t svc_th)
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

/* Frees what the program owns; returns rc. */
static int main_free(main_t *m, int rc)
{
    stria_device_close(m->dev);
    stria_pool_destroy(m->pool);
    stria_metrics_destroy(m->metrics);
    stria_cli_free(&m->cli);
    stria_auth_free_secret(m->token);
    stria_auth_free_secret(m->worker_token);
    free(m);
    return rc;
}

int main(int argc, char **argv)
{
    main_t *m = calloc(1, sizeof(*m));
    svc_loop_t sl;
    pthread_t svc_th;
    stria_status_t st;

    if (m == NULL)
        return 1;
    if (getenv("STRIA_LOG_LEVEL") == NULL)
        stria_log_set_level(STRIA_LOG_INFO);
    int rc = options(m, argc, argv);
    if (rc < 0 && (st = configure(m)) != STRIA_OK) {
        /* configuration errors: exit status 2, nothing left behind */
        fprintf(stderr, "stria-worker: %s\n(see stria-worker --help)\n", stria_error_msg());
        rc = 2;
    }
    if (rc >= 0)
        return main_free(m, rc);
    memset(&sl, 0, sizeof(sl));
    pthread_mutex_init(&sl.lock, NULL);
    pthread_cond_init(&sl.cv, NULL);
    sl.m = m;
    if ((st = stria_metrics_create(&m->metrics)) != STRIA_OK ||
        (st = svc_begin(&sl, &svc_th)) != STRIA_OK)
        goto fail;
    if ((st = wmain_start(m)) != STRIA_OK)
        goto fail;
    uv_async_send(&sl.watch);
    print_listening(m, &sl);
    if (serve_until_signal(m, &sl, svc_th) > 0)
        return 0;
    stria_worker_stop(m->worker);
    return main_free(m, 0);

fail:
    return stria_cli_exit("stria-worker", st);
}
