/* The daemons' shared helpers: the /metrics endpoint and shutdown signals. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "stria_service.h"

typedef struct {
    uv_loop_t loop;
    uv_async_t stop;
    stria_metrics_t *reg;
    stria_http_metrics_t *srv;
    stria_service_t *svc;
    int port;
    int signals;
    pthread_mutex_t lock;
    pthread_cond_t ready_cv;
    bool ready;
} fixture_t;

static fixture_t fx;

static void on_stop(uv_async_t *a)
{
    stria_http_metrics_stop(fx.srv);
    stria_service_stop(fx.svc);
    uv_close((uv_handle_t *)a, NULL);
}

static void on_shutdown(void *arg, int signum)
{
    (void)arg;
    (void)signum;
    __atomic_add_fetch(&fx.signals, 1, __ATOMIC_RELAXED);
}

static void *loop_thread(void *arg)
{
    (void)arg;
    uv_loop_init(&fx.loop);
    uv_async_init(&fx.loop, &fx.stop, on_stop);
    cr_assert_eq(stria_http_metrics_start(&fx.loop, "127.0.0.1:0", fx.reg, &fx.srv), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_service_start(&fx.loop, on_shutdown, NULL, &fx.svc), STRIA_OK);
    pthread_mutex_lock(&fx.lock);
    fx.port = stria_http_metrics_port(fx.srv);
    fx.ready = true;
    pthread_cond_signal(&fx.ready_cv);
    pthread_mutex_unlock(&fx.lock);
    uv_run(&fx.loop, UV_RUN_DEFAULT);
    uv_loop_close(&fx.loop);
    return NULL;
}

static pthread_t th;

static void setup(void)
{
    memset(&fx, 0, sizeof(fx));
    pthread_mutex_init(&fx.lock, NULL);
    pthread_cond_init(&fx.ready_cv, NULL);
    cr_assert_eq(stria_metrics_create(&fx.reg), STRIA_OK);
    pthread_create(&th, NULL, loop_thread, NULL);
    pthread_mutex_lock(&fx.lock);
    while (!fx.ready)
        pthread_cond_wait(&fx.ready_cv, &fx.lock);
    pthread_mutex_unlock(&fx.lock);
}

static void teardown(void)
{
    uv_async_send(&fx.stop);
    pthread_join(th, NULL);
    stria_metrics_destroy(fx.reg);
}

/* Sends a raw request and returns the whole response. */
static char *http(const char *request, size_t len)
{
    static char resp[65536];
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)fx.port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    size_t off = 0;
    while (off < len) {
        ssize_t n = send(fd, request + off, len - off, MSG_NOSIGNAL);
        if (n <= 0)
            break;
        off += (size_t)n;
    }
    size_t got = 0;
    for (;;) {
        ssize_t n = recv(fd, resp + got, sizeof(resp) - 1 - got, 0);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    resp[got] = '\0';
    close(fd);
    return resp;
}

Test(service, metrics_endpoint, .init = setup, .fini = teardown, .timeout = 30)
{
    stria_metric_t *m = stria_metrics_get(fx.reg, STRIA_METRIC_COUNTER, "stria_passes_total",
                                          "Passes run.", "pass=\"fwd\"", NULL, 0);
    stria_metric_add(m, 3);
    const char get[] = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    char *r = http(get, sizeof(get) - 1);
    cr_expect(strncmp(r, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", r);
    cr_expect(strstr(r, "text/plain; version=0.0.4") != NULL);
    cr_expect(strstr(r, "stria_passes_total{pass=\"fwd\"} 3\n") != NULL, "%s", r);

    const char nf[] = "GET /other HTTP/1.1\r\n\r\n";
    cr_expect(strncmp(http(nf, sizeof(nf) - 1), "HTTP/1.1 404", 12) == 0);
    const char post[] = "POST /metrics HTTP/1.1\r\n\r\n";
    cr_expect(strncmp(http(post, sizeof(post) - 1), "HTTP/1.1 405", 12) == 0);
    const char junk[] = "\x01\x02garbage\r\n\r\n";
    cr_expect(strncmp(http(junk, sizeof(junk) - 1), "HTTP/1.1 400", 12) == 0);
    static char big[20000];
    memset(big, 'A', sizeof(big));
    cr_expect(strncmp(http(big, sizeof(big)), "HTTP/1.1 400", 12) == 0);
    /* still serving */
    cr_expect(strncmp(http(get, sizeof(get) - 1), "HTTP/1.1 200", 12) == 0);
}

Test(service, sigterm_reaches_callback, .init = setup, .fini = teardown, .timeout = 30)
{
    kill(getpid(), SIGTERM);
    for (int i = 0; i < 200 && __atomic_load_n(&fx.signals, __ATOMIC_RELAXED) == 0; i++)
        usleep(10000);
    cr_expect_eq(__atomic_load_n(&fx.signals, __ATOMIC_RELAXED), 1);
}

/* ---- watchdog liveness -------------------------------------------------- */

static int wd_alive = 1;
static uv_loop_t wd_loop;
static uv_async_t wd_stop;
static stria_service_t *wd_svc;

static bool wd_probe(void *arg, char *why, size_t cap)
{
    (void)arg;
    if (__atomic_load_n(&wd_alive, __ATOMIC_RELAXED))
        return true;
    snprintf(why, cap, "test says so");
    return false;
}

static void wd_on_stop(uv_async_t *a)
{
    stria_service_stop(wd_svc);
    uv_close((uv_handle_t *)a, NULL);
}

static void *wd_thread(void *arg)
{
    (void)arg;
    uv_run(&wd_loop, UV_RUN_DEFAULT);
    uv_loop_close(&wd_loop);
    return NULL;
}

/* WATCHDOG=1 datagrams on fd within `seconds`. */
static int wd_count(int fd, double seconds)
{
    int n = 0;
    double end = stria_time_now() + seconds;
    char buf[64];
    for (double left; (left = end - stria_time_now()) > 0;) {
        struct timeval tv = {(time_t)left, (suseconds_t)((left - (double)(time_t)left) * 1e6)};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        ssize_t r = recv(fd, buf, sizeof(buf) - 1, 0);
        if (r <= 0)
            continue;
        buf[r] = '\0';
        n += strcmp(buf, "WATCHDOG=1") == 0;
    }
    return n;
}

Test(service, watchdog_pings_only_while_alive, .timeout = 30)
{
    char sock_path[108];
    snprintf(sock_path, sizeof(sock_path), "/tmp/stria_wd_%d.sock", (int)getpid());
    unlink(sock_path);
    int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strcpy(addr.sun_path, sock_path);
    cr_assert_eq(bind(fd, (struct sockaddr *)&addr, sizeof(addr)), 0);
    setenv("NOTIFY_SOCKET", sock_path, 1);
    setenv("WATCHDOG_USEC", "200000", 1); /* a ping every 0.1 s */
    unsetenv("WATCHDOG_PID");

    uv_loop_init(&wd_loop);
    uv_async_init(&wd_loop, &wd_stop, wd_on_stop);
    cr_assert_eq(stria_service_start(&wd_loop, on_shutdown, NULL, &wd_svc), STRIA_OK);
    stria_service_set_liveness(wd_svc, wd_probe, NULL);
    pthread_t t;
    pthread_create(&t, NULL, wd_thread, NULL);

    int alive1 = wd_count(fd, 0.6);
    __atomic_store_n(&wd_alive, 0, __ATOMIC_RELAXED);
    wd_count(fd, 0.15); /* a ping already on its way */
    int dead = wd_count(fd, 0.6);
    __atomic_store_n(&wd_alive, 1, __ATOMIC_RELAXED);
    int alive2 = wd_count(fd, 0.6);

    uv_async_send(&wd_stop);
    pthread_join(t, NULL);
    close(fd);
    unlink(sock_path);
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    cr_expect_geq(alive1, 3, "%d pings in 0.6 s while alive", alive1);
    cr_expect_eq(dead, 0, "%d pings in 0.6 s while the probe failed", dead);
    cr_expect_geq(alive2, 3, "%d pings in 0.6 s after recovery", alive2);
}
