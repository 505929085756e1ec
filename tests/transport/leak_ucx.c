/* Leak check of the UCX link as a plain program (LeakSanitizer reports do
 * not fail Criterion tests, but they fail this process in the sanitizer
 * build). Two contexts in one process form a ring of two and go through the
 * paths that own memory: early arrivals (eager and rendezvous), a cancelled
 * receive, a length mismatch, a torn-down link with requests in flight, an
 * abort, and a graceful close with arrivals nobody took. Exit status 0 when
 * every step behaved; the sanitizer adds its own. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stria_transport.h"

typedef struct {
    stria_ucx_ctx_t *ctx;
    stria_ucx_link_params_t p;
    stria_link_t *link;
    stria_status_t st;
} conn_t;

static void *connect_main(void *arg)
{
    conn_t *c = arg;
    c->st = stria_link_ucx_connect(c->ctx, &c->p, &c->link);
    return NULL;
}

static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "leak_ucx: line %d: ", __LINE__);                                      \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, " (%s)\n", stria_error_msg());                                         \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

/* Connects a ring of two over ctx[0], ctx[1]; ring_id tells rings apart. */
static int ring(stria_ucx_ctx_t *ctx[2], uint64_t ring_id, stria_link_t *link[2])
{
    conn_t c[2];
    pthread_t th[2];
    for (int r = 0; r < 2; r++) {
        memset(&c[r], 0, sizeof(c[r]));
        c[r].ctx = ctx[r];
        c[r].p = (stria_ucx_link_params_t){.job_id = 1,
                                           .ring_id = ring_id,
                                           .rank = r,
                                           .size = 2,
                                           .next_host = "127.0.0.1",
                                           .next_port = stria_ucx_ctx_port(ctx[1 - r]),
                                           .connect_timeout_s = 10};
        pthread_create(&th[r], NULL, connect_main, &c[r]);
    }
    for (int r = 0; r < 2; r++)
        pthread_join(th[r], NULL);
    CHECK(c[0].st == STRIA_OK && c[1].st == STRIA_OK, "connect ring %llu",
          (unsigned long long)ring_id);
    if (c[0].st != STRIA_OK || c[1].st != STRIA_OK) {
        stria_link_destroy(c[0].link);
        stria_link_destroy(c[1].link);
        return -1;
    }
    link[0] = c[0].link;
    link[1] = c[1].link;
    return 0;
}

int main(int argc, char **argv)
{
    const char *tls = argc > 1 ? argv[1] : "tcp";
    stria_ucx_ctx_t *ctx[2] = {NULL, NULL};
    for (int r = 0; r < 2; r++) {
        stria_ucx_ctx_params_t p = {.listen_host = "127.0.0.1", .tls = tls};
        if (stria_ucx_ctx_create(&p, &ctx[r]) != STRIA_OK) {
            fprintf(stderr, "leak_ucx: %s\n", stria_error_msg());
            stria_ucx_ctx_destroy(ctx[0]);
            return 1;
        }
    }
    size_t big = 1 << 20;
    uint8_t *a = calloc(1, big), *b = calloc(1, big);
    stria_link_t *link[2];
    stria_link_req_t *sq, *rq, *sq2;

    /* Early arrivals, a cancelled receive, a graceful close with an
     * arrival nobody took. */
    if (ring(ctx, 1, link) == 0) {
        CHECK(stria_link_isend(link[0], 1, a, 100, &sq) == STRIA_OK, "isend");
        CHECK(stria_link_isend(link[0], 2, a, big, &sq2) == STRIA_OK, "isend");
        usleep(100000);
        CHECK(stria_link_irecv(link[1], 1, b, 100, &rq) == STRIA_OK, "irecv");
        CHECK(stria_link_wait(link[1], rq, 10) == STRIA_OK, "wait recv");
        CHECK(stria_link_wait(link[0], sq, 10) == STRIA_OK, "wait send");
        CHECK(stria_link_irecv(link[1], 2, b, big, &rq) == STRIA_OK, "irecv");
        CHECK(stria_link_wait(link[1], rq, 10) == STRIA_OK, "wait recv");
        CHECK(stria_link_wait(link[0], sq2, 10) == STRIA_OK, "wait send");
        CHECK(stria_link_irecv(link[0], 9, b, 64, &rq) == STRIA_OK, "irecv");
        stria_link_cancel(link[0], rq);
        CHECK(stria_link_isend(link[1], 3, a, 64, &sq) == STRIA_OK, "isend");
        CHECK(stria_link_wait(link[1], sq, 10) == STRIA_OK, "wait send");
        usleep(50000); /* arrives at rank 0, which never receives it */
        stria_link_destroy(link[0]);
        stria_link_destroy(link[1]);
    }
    /* A length mismatch. */
    if (ring(ctx, 2, link) == 0) {
        CHECK(stria_link_irecv(link[1], 1, b, 1000, &rq) == STRIA_OK, "irecv");
        CHECK(stria_link_isend(link[0], 1, a, 2000, &sq) == STRIA_OK, "isend");
        CHECK(stria_link_wait(link[1], rq, 10) == STRIA_ERR_PROTOCOL, "mismatch");
        stria_link_wait(link[0], sq, 10);
        stria_link_destroy(link[0]);
        stria_link_destroy(link[1]);
    }
    /* A rendezvous send cancelled in flight, an abort, requests left to
     * destroy. */
    if (ring(ctx, 3, link) == 0) {
        CHECK(stria_link_isend(link[0], 1, a, big, &sq) == STRIA_OK, "isend");
        CHECK(stria_link_irecv(link[1], 7, b, 64, &rq) == STRIA_OK, "irecv");
        usleep(50000);
        stria_link_cancel(link[0], sq);
        stria_link_abort(link[1], STRIA_ERR_INTERNAL, "leak check");
        stria_link_destroy(link[0]);
        stria_link_destroy(link[1]);
    }
    /* A link left open is destroyed with its context. */
    if (ring(ctx, 4, link) == 0)
        CHECK(stria_link_irecv(link[1], 1, b, 64, &rq) == STRIA_OK, "irecv");
    stria_ucx_ctx_destroy(ctx[0]);
    stria_ucx_ctx_destroy(ctx[1]);
    free(a);
    free(b);
    return failures == 0 ? 0 : 1;
}
