/* rpc_perf: what the RPC layer costs on this machine, measured side by side
 * in one run: small-call round trips, tensor uploads (payload read straight
 * into the destination) and downloads, against plain TCP loopback streaming
 * of the same bytes and memcpy.
 *
 * usage: rpc_perf [MiB per frame (default 16)] [frames (default 32)] */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "stria.pb-c.h"
#include "stria_rpc.h"

static uint8_t *g_dst;
static uint8_t *g_src;
static size_t g_len;

static stria_status_t put_payload(void *ctx, stria_rpc_call_t *call, uint64_t len, void **buf)
{
    (void)ctx;
    (void)call;
    if (len > g_len)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "too large");
    *buf = g_dst;
    return STRIA_OK;
}

static void nothing(void *arg)
{
    (void)arg;
}

/* SessionCall: a forward call uploads (its payload lands in g_dst, the
 * reply counts the bytes), a backward call downloads (g_src as the reply
 * payload, sent in place). */
static void call_handler(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
    (void)ctx;
    if (req->backward) {
        stria_rpc_call_reply(call, &rep.base, g_src, g_len, nothing, NULL);
        return;
    }
    stria_rpc_call_payload(call, &rep.worker_minflt);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static void drop_handler(void *ctx, stria_rpc_call_t *call)
{
    Stria__V1__DropJobReply rep = STRIA__V1__DROP_JOB_REPLY__INIT;
    (void)ctx;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

typedef struct {
    int lfd;
    size_t total;
} sink_t;

/* Raw TCP baseline: accept one connection and read `total` bytes into a
 * buffer of the frame size. */
static void *sink_main(void *arg)
{
    sink_t *s = arg;
    int fd = accept(s->lfd, NULL, NULL);
    size_t got = 0;
    while (fd >= 0 && got < s->total) {
        ssize_t r = recv(fd, g_dst + (got % g_len), g_len - (got % g_len), 0);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    if (fd >= 0)
        close(fd);
    return NULL;
}

static double raw_tcp_gbps(int frames)
{
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t al = sizeof(a);
    sink_t s = {.total = g_len * (size_t)frames};
    pthread_t th;
    int fd, one = 1;
    double t0, t1;

    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    s.lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (bind(s.lfd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(s.lfd, 1) != 0 ||
        getsockname(s.lfd, (struct sockaddr *)&a, &al) != 0)
        return 0;
    pthread_create(&th, NULL, sink_main, &s);
    fd = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0)
        return 0;
    t0 = stria_time_now();
    for (int f = 0; f < frames; f++) {
        size_t off = 0;
        while (off < g_len) {
            ssize_t w = send(fd, g_src + off, g_len - off, MSG_NOSIGNAL);
            if (w <= 0)
                return 0;
            off += (size_t)w;
        }
    }
    close(fd);
    pthread_join(th, NULL);
    t1 = stria_time_now();
    close(s.lfd);
    return (double)s.total / (t1 - t0) / 1e9;
}

int main(int argc, char **argv)
{
    int mib = argc > 1 ? atoi(argv[1]) : 16;
    int frames = argc > 2 ? atoi(argv[2]) : 32;
    stria_rpc_method_t methods[STRIA_RPC_WORKER_N_METHODS] = {{0}};
    stria_rpc_server_params_t sp = {0};
    stria_rpc_client_params_t cp = {0};
    stria_rpc_server_t *srv = NULL;
    stria_rpc_client_t *cl = NULL;
    stria_rpc_reply_t rep;
    char addr[64];
    double t0, dt;
    int calls = 5000;

    if (mib < 1 || mib > 1024 || frames < 1) {
        fprintf(stderr, "usage: rpc_perf [MiB per frame 1..1024] [frames >= 1]\n");
        return 2;
    }
    g_len = (size_t)mib << 20;
    g_src = malloc(g_len);
    g_dst = malloc(g_len);
    memset(g_src, 0x5a, g_len);
    memset(g_dst, 0, g_len);
    methods[STRIA_RPC_WORKER_SESSION_CALL] =
        (stria_rpc_method_t){.handler = call_handler,
                             .payload = put_payload,
                             .name = STRIA_RPC_WORKER_SESSION_CALL_NAME};
    methods[STRIA_RPC_WORKER_DROP_JOB] =
        (stria_rpc_method_t){.handler = drop_handler, .name = STRIA_RPC_WORKER_DROP_JOB_NAME};
    sp.listen = "127.0.0.1:0";
    sp.service = &stria__v1__worker__descriptor;
    sp.methods = methods;
    if (stria_rpc_server_start(&sp, &srv) != STRIA_OK) {
        fprintf(stderr, "rpc_perf: %s\n", stria_error_msg());
        return 1;
    }
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", stria_rpc_server_port(srv));
    cp.address = addr;
    cp.service = &stria__v1__worker__descriptor;
    if (stria_rpc_client_connect(&cp, &cl) != STRIA_OK) {
        fprintf(stderr, "rpc_perf: %s\n", stria_error_msg());
        return 1;
    }

    Stria__V1__DropJobRequest dj = STRIA__V1__DROP_JOB_REQUEST__INIT;
    stria_rpc_request_t small = {
        .method = STRIA_RPC_WORKER_DROP_JOB, .request = &dj.base, .timeout_s = 10};
    t0 = stria_time_now();
    for (int i = 0; i < calls; i++) {
        if (stria_rpc_client_call(cl, &small, &rep) != STRIA_OK)
            return 1;
        stria_rpc_reply_free(&rep);
    }
    dt = stria_time_now() - t0;
    printf("small call round trip:    %8.1f us  (%d calls)\n", dt / calls * 1e6, calls);

    Stria__V1__SessionCallRequest put = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    stria_rpc_request_t up = {.method = STRIA_RPC_WORKER_SESSION_CALL,
                              .request = &put.base,
                              .payload = g_src,
                              .payload_len = g_len,
                              .timeout_s = 60};
    t0 = stria_time_now();
    for (int i = 0; i < frames; i++) {
        if (stria_rpc_client_call(cl, &up, &rep) != STRIA_OK)
            return 1;
        stria_rpc_reply_free(&rep);
    }
    dt = stria_time_now() - t0;
    printf("upload (SessionCall):     %8.2f GB/s  (%d x %d MiB)\n",
           (double)g_len * frames / dt / 1e9, frames, mib);
    if (memcmp(g_dst, g_src, g_len) != 0)
        return 1;

    Stria__V1__SessionCallRequest go = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    go.backward = true;
    stria_rpc_request_t down = {.method = STRIA_RPC_WORKER_SESSION_CALL,
                                .request = &go.base,
                                .reply_buf = g_dst,
                                .reply_buf_cap = g_len,
                                .timeout_s = 60};
    t0 = stria_time_now();
    for (int i = 0; i < frames; i++) {
        if (stria_rpc_client_call(cl, &down, &rep) != STRIA_OK)
            return 1;
        stria_rpc_reply_free(&rep);
    }
    dt = stria_time_now() - t0;
    printf("download (SessionCall):   %8.2f GB/s  (%d x %d MiB)\n",
           (double)g_len * frames / dt / 1e9, frames, mib);

    printf("raw TCP loopback stream:  %8.2f GB/s  (same bytes, no framing)\n",
           raw_tcp_gbps(frames));
    t0 = stria_time_now();
    for (int i = 0; i < frames; i++) {
        memcpy(g_dst, g_src, g_len);
        __asm__ volatile("" ::: "memory");
    }
    dt = stria_time_now() - t0;
    printf("memcpy:                   %8.2f GB/s\n", (double)g_len * frames / dt / 1e9);

    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
    free(g_src);
    free(g_dst);
    return 0;
}
