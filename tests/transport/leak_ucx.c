/* Leak check of the UCX link as a plain program (LeakSanitizer reports do
 * not fail Criterion tests, but they fail this process in the sanitizer
 * build). Two processes (this one, rank 0, and a forked child, rank 1), one
 * UCX context each as in the daemon, form a ring of two four times and go
 * through the paths that own memory: early arrivals (eager and rendezvous),
 * a cancelled receive, a length mismatch, a torn-down link with requests in
 * flight, an abort, and a graceful close with arrivals nobody took. The
 * ranks keep in step over two pipes. Exit status 0 when every step of both
 * ranks behaved; the sanitizer adds its own, the child's included.
 *
 * One context per process matters: UCX (1.13 and later) queues events its
 * async thread could not deliver by file descriptor number, and asserts when
 * a descriptor closed by one context's endpoint is reused by another
 * context's before the queue is drained. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "stria_transport.h"
#include "tleak.h"

/* The pipe ends this rank writes to and reads from. */
static int to_peer = -1, from_peer = -1;

/* Sends `v` to the other rank and returns the other rank's value; exits when
 * the other rank is gone (a crash there must not hang this one). */
static uint32_t exchange(uint32_t v)
{
    if (write(to_peer, &v, sizeof(v)) != (ssize_t)sizeof(v)) {
        fprintf(stderr, "leak_ucx: rank %d: the other rank is gone (write: %s)\n", tleak.rank,
                strerror(errno));
        exit(1);
    }
    uint32_t got;
    ssize_t n;
    do {
        n = read(from_peer, &got, sizeof(got));
    } while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof(got)) {
        fprintf(stderr, "leak_ucx: rank %d: the other rank is gone\n", tleak.rank);
        exit(1);
    }
    return got;
}

static void barrier(void)
{
    exchange(0);
}

/* Connects this rank's end of a ring of two; ring_id tells rings apart.
 * Both ranks learn whether both ends connected. */
static stria_link_t *ring(stria_ucx_ctx_t *ctx, uint16_t peer_port, uint64_t ring_id)
{
    stria_ucx_link_params_t p = {.job_id = 1,
                                 .ring_id = ring_id,
                                 .rank = tleak.rank,
                                 .size = 2,
                                 .next_host = "127.0.0.1",
                                 .next_port = peer_port,
                                 .connect_timeout_s = 10};
    stria_link_t *link = NULL;
    stria_status_t st = stria_link_ucx_connect(ctx, &p, &link);
    CHECK(st == STRIA_OK, "connect ring %llu", (unsigned long long)ring_id);
    uint32_t peer_ok = exchange(st == STRIA_OK);
    if (st != STRIA_OK || !peer_ok) {
        stria_link_destroy(link);
        return NULL;
    }
    return link;
}

/* Early arrivals, a cancelled receive, a graceful close with an arrival
 * nobody took. */
static void early_arrivals(stria_link_t *link, uint8_t *a, uint8_t *b, size_t big)
{
    stria_link_req_t *sq, *rq, *sq2;
    if (tleak.rank == 0) {
        CHECK(stria_link_isend(link, 1, a, 100, &sq) == STRIA_OK, "isend");
        CHECK(stria_link_isend(link, 2, a, big, &sq2) == STRIA_OK, "isend");
        barrier();
        CHECK(stria_link_wait(link, sq, 10) == STRIA_OK, "wait send");
        CHECK(stria_link_wait(link, sq2, 10) == STRIA_OK, "wait send");
        CHECK(stria_link_irecv(link, 9, b, 64, &rq) == STRIA_OK, "irecv");
        stria_link_cancel(link, rq);
        barrier();
        usleep(50000); /* rank 1's tag 3 arrives here; nobody receives it */
    } else {
        barrier();
        usleep(100000); /* both sends arrive before their receives */
        CHECK(stria_link_irecv(link, 1, b, 100, &rq) == STRIA_OK, "irecv");
        CHECK(stria_link_wait(link, rq, 10) == STRIA_OK, "wait recv");
        CHECK(stria_link_irecv(link, 2, b, big, &rq) == STRIA_OK, "irecv");
        CHECK(stria_link_wait(link, rq, 10) == STRIA_OK, "wait recv");
        CHECK(stria_link_isend(link, 3, a, 64, &sq) == STRIA_OK, "isend");
        CHECK(stria_link_wait(link, sq, 10) == STRIA_OK, "wait send");
        barrier();
    }
}

/* A length mismatch. */
static void length_mismatch(stria_link_t *link, uint8_t *a, uint8_t *b)
{
    stria_link_req_t *rq, *sq;
    if (tleak.rank == 1) {
        CHECK(stria_link_irecv(link, 1, b, 1000, &rq) == STRIA_OK, "irecv");
        barrier();
        CHECK(stria_link_wait(link, rq, 10) == STRIA_ERR_PROTOCOL, "mismatch");
    } else {
        barrier();
        CHECK(stria_link_isend(link, 1, a, 2000, &sq) == STRIA_OK, "isend");
        stria_link_wait(link, sq, 10);
    }
}

/* A rendezvous send cancelled in flight and an abort, requests left to
 * destroy. */
static void torn_down(stria_link_t *link, uint8_t *a, uint8_t *b, size_t big)
{
    stria_link_req_t *q;
    if (tleak.rank == 0)
        CHECK(stria_link_isend(link, 1, a, big, &q) == STRIA_OK, "isend");
    else
        CHECK(stria_link_irecv(link, 7, b, 64, &q) == STRIA_OK, "irecv");
    usleep(50000);
    if (tleak.rank == 0)
        stria_link_cancel(link, q);
    else
        stria_link_abort(link, STRIA_ERR_INTERNAL, "leak check");
}

static int run_rank(void)
{
    stria_ucx_ctx_params_t cp = {.listen_host = "127.0.0.1", .tls = getenv("LEAK_UCX_TLS")};
    stria_ucx_ctx_t *ctx = NULL;
    stria_status_t st = stria_ucx_ctx_create(&cp, &ctx);
    CHECK(st == STRIA_OK, "context");
    uint32_t peer_port = exchange(st == STRIA_OK ? stria_ucx_ctx_port(ctx) : 0);
    if (st != STRIA_OK || peer_port == 0) {
        stria_ucx_ctx_destroy(ctx);
        return 1;
    }
    size_t big = 1 << 20;
    uint8_t *a = calloc(1, big), *b = calloc(1, big);
    stria_link_t *link;

    if ((link = ring(ctx, (uint16_t)peer_port, 1)) != NULL) {
        early_arrivals(link, a, b, big);
        stria_link_destroy(link);
    }
    barrier();
    if ((link = ring(ctx, (uint16_t)peer_port, 2)) != NULL) {
        length_mismatch(link, a, b);
        stria_link_destroy(link);
    }
    barrier();
    if ((link = ring(ctx, (uint16_t)peer_port, 3)) != NULL) {
        torn_down(link, a, b, big);
        stria_link_destroy(link);
    }
    barrier();
    /* A link left open is destroyed with its context. */
    stria_link_req_t *rq;
    if ((link = ring(ctx, (uint16_t)peer_port, 4)) != NULL && tleak.rank == 1)
        CHECK(stria_link_irecv(link, 1, b, 64, &rq) == STRIA_OK, "irecv");
    barrier();
    stria_ucx_ctx_destroy(ctx);
    free(a);
    free(b);
    return tleak.failures == 0 ? 0 : 1;
}

/* Runs this process as `rank`, writing to pipe `to` and reading from pipe
 * `from` (the other ends belong to the other rank). */
static int run_as(int rank, int to[2], int from[2])
{
    tleak.rank = rank;
    to_peer = to[1];
    from_peer = from[0];
    close(to[0]);
    close(from[1]);
    int rc = run_rank();
    close(to_peer);
    close(from_peer);
    return rc;
}

int main(int argc, char **argv)
{
    tleak.prog = "leak_ucx";
    tleak.fatal = false;
    /* Each rank reads the transports from the environment, where a forked
     * child sees them too. */
    if (setenv("LEAK_UCX_TLS", argc > 1 ? argv[1] : "tcp", 1) != 0) {
        perror("leak_ucx: setenv");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    int down[2], up[2]; /* rank 0 -> rank 1, rank 1 -> rank 0 */
    if (pipe(down) != 0 || pipe(up) != 0) {
        perror("leak_ucx: pipe");
        return 1;
    }
    /* Forked before either process touches UCX. */
    pid_t child = fork();
    if (child < 0) {
        perror("leak_ucx: fork");
        return 1;
    }
    if (child == 0)
        exit(run_as(1, up, down)); /* exit(), not _exit(): the leak check runs at exit */
    int rc = run_as(0, down, up);
    int status = 0;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR)
        ;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        if (WIFSIGNALED(status))
            fprintf(stderr, "leak_ucx: rank 1 died of signal %d\n", WTERMSIG(status));
        else
            fprintf(stderr, "leak_ucx: rank 1 exited with status %d\n", WEXITSTATUS(status));
        rc = 1;
    }
    return rc;
}
