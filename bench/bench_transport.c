/* stria-bench transport: UCX ring-link bandwidth between two processes, side
 * by side with ucx_perftest -t tag_bw on the same transports in the same run,
 * and the overlap of transfer and compute in a two-process ring attention
 * pass.
 *
 * Bandwidth: this process (rank 0) and a forked child (rank 1) form a ring
 * of two over UCX; rank 0 streams blocks to rank 1 with two sends in flight,
 * rank 1 keeps two receives posted and acknowledges the last block. A run is
 * timed from the first send to the acknowledgement. Every run is done twice:
 * with one buffer per side for every block (ucx_perftest's method, so the
 * ratio compares like with like: the buffer stays in cache between blocks)
 * and with alternating buffers (the ring engine's double buffering, the
 * figure a pass sees). ucx_perftest runs as a server/client pair of child
 * processes with the same UCX environment, block size and iteration count.
 * It runs without error handling (no -e): on this UCX, perftest with peer
 * error handling is slower over tcp, so the plain mode is the stricter
 * yardstick, although the link itself always runs in peer error mode. Runs
 * alternate link (one buffer), link (two buffers), perftest; the medians are
 * compared.
 *
 * Overlap: both ranks hold a striped shard (rank r has tokens r, r+2, ...) of
 * Q and K/V. A pass has two steps: at step 0 each rank sends its K/V block to
 * the other while computing attention against its own block, at step 1 it
 * computes against the block it received. Measured separately with both
 * ranks busy at once: the step-0 compute alone, the K/V exchange alone, and
 * the overlapped step; the figure is step / max(compute, transfer). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "bench_util.h"
#include "stria_common.h"
#include "stria_kernels.h"
#include "stria_transport.h"

extern char **environ;

#define STRIA__TB_MAX_SIZES  16
#define STRIA__TB_MAX_TOKENS 8
#define STRIA__TB_WINDOW     2
#define STRIA__TB_ACK_TAG    0xFFFFFFFF00000000ull
#define STRIA__TB_SYNC_TAG   0xFFFFFFFE00000000ull
#define STRIA__TB_TIMEOUT_S  60.0

typedef struct {
    size_t sizes[STRIA__TB_MAX_SIZES];
    int n_sizes;
    int64_t tokens[STRIA__TB_MAX_TOKENS];
    int n_tokens;
    int64_t heads, kv_heads, head_dim;
    stria_dtype_t dtype;
    int reps;
    size_t bytes_per_rep;
    const char *tls;
    int poll_us;
    bool json;
    bool perftest;
    bool bandwidth;
    bool overlap;
} stria__tb_opts_t;

/* What rank 0 asks rank 1 to do, over a pipe. */
typedef enum {
    STRIA__TB_QUIT = 0,
    STRIA__TB_BW = 1,
    STRIA__TB_OVERLAP = 2,
} stria__tb_op_t;

typedef struct {
    int32_t op;
    int32_t iters;
    uint64_t size;
    int64_t tokens;
    int32_t buffers; /* 1: every block in one buffer (perftest's way); 2: alternate */
} stria__tb_cmd_t;

static int stria__tb_write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int stria__tb_read_all(int fd, void *buf, size_t n)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* ---- one rank of the two-process ring -------------------------------------- */

typedef struct {
    stria_ucx_ctx_t *ctx;
    stria_link_t *link;
    uint8_t *bufs; /* STRIA__TB_WINDOW blocks of the largest size */
    size_t buf_size;
} stria__tb_rank_t;

/* Creates the context, swaps ports with the other rank over the pipes and
 * connects the ring of two. */
static stria_status_t stria__tb_connect(int rank, const stria__tb_opts_t *o, int rfd, int wfd,
                                        stria__tb_rank_t *r)
{
    stria_ucx_ctx_params_t cp = {.listen_host = "127.0.0.1", .tls = o->tls, .poll_us = o->poll_us};
    stria_status_t st = stria_ucx_ctx_create(&cp, &r->ctx);
    if (st != STRIA_OK)
        return st;
    uint16_t mine = stria_ucx_ctx_port(r->ctx), theirs = 0;
    if (stria__tb_write_all(wfd, &mine, sizeof(mine)) != 0 ||
        stria__tb_read_all(rfd, &theirs, sizeof(theirs)) != 0) {
        stria_ucx_ctx_destroy(r->ctx);
        return stria_error_set(STRIA_ERR_IO, "rank %d: the other rank went away", rank);
    }
    stria_ucx_link_params_t lp = {.job_id = 1,
                                  .ring_id = 1,
                                  .rank = rank,
                                  .size = 2,
                                  .next_host = "127.0.0.1",
                                  .next_port = theirs,
                                  .connect_timeout_s = 20};
    st = stria_link_ucx_connect(r->ctx, &lp, &r->link);
    if (st != STRIA_OK)
        stria_ucx_ctx_destroy(r->ctx);
    return st;
}

static void stria__tb_disconnect(stria__tb_rank_t *r)
{
    stria_link_destroy(r->link);
    stria_ucx_ctx_destroy(r->ctx);
    stria_free(r->bufs);
}

static stria_status_t stria__tb_bufs(stria__tb_rank_t *r, size_t size)
{
    if (r->buf_size >= size)
        return STRIA_OK;
    stria_free(r->bufs);
    r->bufs = stria_malloc_aligned(size * STRIA__TB_WINDOW);
    if (r->bufs == NULL) {
        r->buf_size = 0;
        return stria_error_set(STRIA_ERR_NO_MEMORY, "no memory for %zu-byte blocks", size);
    }
    /* Touch every page now, not during a timed run. */
    memset(r->bufs, 0x5a, size * STRIA__TB_WINDOW);
    r->buf_size = size;
    return STRIA_OK;
}

static stria_status_t stria__tb_sendrecv_small(stria_link_t *link, uint64_t tag)
{
    uint64_t out = tag, in = 0;
    stria_link_req_t *rq, *sq;
    stria_status_t st = stria_link_irecv(link, tag, &in, sizeof(in), &rq);
    if (st != STRIA_OK)
        return st;
    st = stria_link_isend(link, tag, &out, sizeof(out), &sq);
    if (st != STRIA_OK) {
        stria_link_cancel(link, rq);
        return st;
    }
    stria_status_t s1 = stria_link_wait(link, sq, STRIA__TB_TIMEOUT_S);
    stria_status_t s2 = stria_link_wait(link, rq, STRIA__TB_TIMEOUT_S);
    return s1 != STRIA_OK ? s1 : s2;
}

/* Streams iters blocks from rank 0 to rank 1. Rank 0 returns the seconds from
 * the first send to the acknowledgement. */
static stria_status_t stria__tb_stream(stria__tb_rank_t *r, int rank, size_t size, int iters,
                                       int buffers, double *secs)
{
    stria_link_req_t *reqs[STRIA__TB_WINDOW] = {NULL};
    stria_status_t st = stria__tb_bufs(r, size);
    uint64_t ack = 0;
    if (st != STRIA_OK)
        return st;
    double t0 = stria_time_now();
    for (int i = 0; i < iters + STRIA__TB_WINDOW && st == STRIA_OK; i++) {
        int slot = i % STRIA__TB_WINDOW;
        if (i >= STRIA__TB_WINDOW) {
            st = stria_link_wait(r->link, reqs[slot], STRIA__TB_TIMEOUT_S);
            reqs[slot] = NULL;
        }
        if (st == STRIA_OK && i < iters) {
            /* One buffer for every block, as ucx_perftest does (receives
             * into it may overlap: the bytes are not looked at), or one per
             * block in flight, as the ring engine's double buffering. */
            uint8_t *b = r->bufs + (size_t)(buffers == 1 ? 0 : slot) * size;
            st = rank == 0 ? stria_link_isend(r->link, (uint64_t)i, b, size, &reqs[slot])
                           : stria_link_irecv(r->link, (uint64_t)i, b, size, &reqs[slot]);
        }
    }
    for (int s = 0; s < STRIA__TB_WINDOW; s++)
        stria_link_cancel(r->link, reqs[s]);
    if (st != STRIA_OK)
        return st;
    stria_link_req_t *aq;
    if (rank == 1) {
        ack = 1;
        st = stria_link_isend(r->link, STRIA__TB_ACK_TAG, &ack, sizeof(ack), &aq);
    } else {
        st = stria_link_irecv(r->link, STRIA__TB_ACK_TAG, &ack, sizeof(ack), &aq);
    }
    if (st == STRIA_OK)
        st = stria_link_wait(r->link, aq, STRIA__TB_TIMEOUT_S);
    if (secs != NULL)
        *secs = stria_time_now() - t0;
    return st;
}

/* ---- overlap ------------------------------------------------------------- */

typedef struct {
    double compute0, compute1, transfer, step0, step1;
} stria__tb_overlap_t;

typedef struct {
    stria_attn_params_t p[2]; /* per step: K/V from rank r, then from rank 1 - r */
    stria_pos_run_t qrun, krun[2];
    void *q, *kv[2];
    float *o, *lse;
    size_t kv_bytes;
    stria_tensor_t tq, tk[2], tv[2], to;
} stria__tb_attn_t;

static void stria__tb_attn_free(stria__tb_attn_t *a)
{
    stria_free(a->q);
    stria_free(a->kv[0]);
    stria_free(a->kv[1]);
    stria_free(a->o);
    stria_free(a->lse);
}

static stria_status_t stria__tb_attn_init(const stria__tb_opts_t *o, int rank, int64_t tokens,
                                          stria__tb_attn_t *a)
{
    memset(a, 0, sizeof(*a));
    size_t es = stria_dtype_size(o->dtype);
    size_t nq = (size_t)(tokens * o->heads * o->head_dim);
    size_t nk = (size_t)(tokens * o->kv_heads * o->head_dim);
    a->kv_bytes = 2 * nk * es;
    a->q = stria_malloc_aligned(nq * es);
    a->kv[0] = stria_malloc_aligned(a->kv_bytes);
    a->kv[1] = stria_malloc_aligned(a->kv_bytes);
    a->o = stria_malloc_aligned(nq * sizeof(float));
    a->lse = stria_malloc_aligned((size_t)(tokens * o->heads) * sizeof(float));
    if (a->q == NULL || a->kv[0] == NULL || a->kv[1] == NULL || a->o == NULL || a->lse == NULL) {
        stria__tb_attn_free(a);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "no memory for %lld tokens", (long long)tokens);
    }
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(rank + 1);
    for (size_t i = 0; i < nq; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        stria_dtype_store(o->dtype, a->q, i, (float)((double)(x >> 40) / (1 << 24) - 0.5));
    }
    for (size_t i = 0; i < 2 * nk; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        stria_dtype_store(o->dtype, a->kv[0], i, (float)((double)(x >> 40) / (1 << 24) - 0.5));
    }
    memcpy(a->kv[1], a->kv[0], a->kv_bytes);
    a->qrun = (stria_pos_run_t){.first = rank, .stride = 2, .count = tokens};
    for (int s = 0; s < 2; s++) {
        int src = s == 0 ? rank : 1 - rank;
        a->krun[s] = (stria_pos_run_t){.first = src, .stride = 2, .count = tokens};
        stria_attn_params_t *p = &a->p[s];
        memset(p, 0, sizeof(*p));
        p->batch = 1;
        p->q_tokens = tokens;
        p->kv_tokens = tokens;
        p->heads = o->heads;
        p->kv_heads = o->kv_heads;
        p->head_dim = o->head_dim;
        p->causal = true;
        p->q_pos = (stria_positions_t){.runs = &a->qrun, .n_runs = 1};
        p->kv_pos = (stria_positions_t){.runs = &a->krun[s], .n_runs = 1};
        a->tk[s] = stria_tensor_contiguous(a->kv[s], o->dtype, tokens, o->kv_heads, o->head_dim);
        a->tv[s] = stria_tensor_contiguous((char *)a->kv[s] + nk * es, o->dtype, tokens,
                                           o->kv_heads, o->head_dim);
    }
    a->tq = stria_tensor_contiguous(a->q, o->dtype, tokens, o->heads, o->head_dim);
    a->to = stria_tensor_contiguous(a->o, STRIA_DTYPE_F32, tokens, o->heads, o->head_dim);
    return STRIA_OK;
}

static stria_status_t stria__tb_compute(stria__tb_attn_t *a, int step)
{
    return stria_attn_fwd(&a->p[step], &a->tq, &a->tk[step], &a->tv[step], &a->to, a->lse,
                          step > 0);
}

/* Posts the K/V exchange of step 0: own block out, the other's into kv[1]. */
static stria_status_t stria__tb_xfer_post(stria_link_t *link, stria__tb_attn_t *a, uint64_t tag,
                                          stria_link_req_t **rq, stria_link_req_t **sq)
{
    stria_status_t st = stria_link_irecv(link, tag, a->kv[1], a->kv_bytes, rq);
    if (st != STRIA_OK)
        return st;
    st = stria_link_isend(link, tag, a->kv[0], a->kv_bytes, sq);
    if (st != STRIA_OK) {
        stria_link_cancel(link, *rq);
        *rq = NULL;
    }
    return st;
}

static stria_status_t stria__tb_xfer_wait(stria_link_t *link, stria_link_req_t *rq,
                                          stria_link_req_t *sq)
{
    stria_status_t s1 = stria_link_wait(link, sq, STRIA__TB_TIMEOUT_S);
    stria_status_t s2 = stria_link_wait(link, rq, STRIA__TB_TIMEOUT_S);
    return s1 != STRIA_OK ? s1 : s2;
}

/* Both ranks run this together; rank 0's figures are returned. */
static stria_status_t stria__tb_overlap_run(const stria__tb_opts_t *o, stria__tb_rank_t *r,
                                            int rank, int64_t tokens, stria__tb_overlap_t *out)
{
    stria__tb_attn_t a;
    stria_status_t st = stria__tb_attn_init(o, rank, tokens, &a);
    if (st != STRIA_OK)
        return st;
    int reps = o->reps < 3 ? 3 : o->reps;
    double *v = calloc((size_t)reps * 5, sizeof(double));
    if (v == NULL) {
        stria__tb_attn_free(&a);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    }
    uint64_t tag = 0;
    /* One warm-up round of everything, then reps timed rounds. */
    for (int rep = -1; rep < reps && st == STRIA_OK; rep++) {
        double c0 = 0, c1 = 0, tx = 0, s0 = 0, s1 = 0, t;
        stria_link_req_t *rq = NULL, *sq = NULL;

        if ((st = stria__tb_sendrecv_small(r->link, STRIA__TB_SYNC_TAG | tag++)) != STRIA_OK)
            break;
        t = stria_time_now();
        st = stria__tb_compute(&a, 0);
        c0 = stria_time_now() - t;
        t = stria_time_now();
        if (st == STRIA_OK)
            st = stria__tb_compute(&a, 1);
        c1 = stria_time_now() - t;

        if (st != STRIA_OK ||
            (st = stria__tb_sendrecv_small(r->link, STRIA__TB_SYNC_TAG | tag++)) != STRIA_OK)
            break;
        t = stria_time_now();
        if ((st = stria__tb_xfer_post(r->link, &a, tag++, &rq, &sq)) == STRIA_OK)
            st = stria__tb_xfer_wait(r->link, rq, sq);
        tx = stria_time_now() - t;

        if (st != STRIA_OK ||
            (st = stria__tb_sendrecv_small(r->link, STRIA__TB_SYNC_TAG | tag++)) != STRIA_OK)
            break;
        t = stria_time_now();
        if ((st = stria__tb_xfer_post(r->link, &a, tag++, &rq, &sq)) != STRIA_OK)
            break;
        st = stria__tb_compute(&a, 0);
        stria_status_t sw = stria__tb_xfer_wait(r->link, rq, sq);
        if (st == STRIA_OK)
            st = sw;
        s0 = stria_time_now() - t;
        t = stria_time_now();
        if (st == STRIA_OK)
            st = stria__tb_compute(&a, 1);
        s1 = stria_time_now() - t;
        if (rep >= 0) {
            v[0 * reps + rep] = c0;
            v[1 * reps + rep] = c1;
            v[2 * reps + rep] = tx;
            v[3 * reps + rep] = s0;
            v[4 * reps + rep] = s1;
        }
    }
    if (st == STRIA_OK) {
        out->compute0 = stria_bench_median(v + 0 * reps, reps);
        out->compute1 = stria_bench_median(v + 1 * reps, reps);
        out->transfer = stria_bench_median(v + 2 * reps, reps);
        out->step0 = stria_bench_median(v + 3 * reps, reps);
        out->step1 = stria_bench_median(v + 4 * reps, reps);
    }
    free(v);
    stria__tb_attn_free(&a);
    return st;
}

/* ---- rank 1: a forked child serving rank 0's commands ----------------------- */

static int stria__tb_child(const stria__tb_opts_t *o, int rfd, int wfd)
{
    stria__tb_rank_t r = {0};
    stria_status_t st = stria__tb_connect(1, o, rfd, wfd, &r);
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-bench transport: rank 1: %s\n", stria_error_msg());
        return 1;
    }
    stria__tb_cmd_t cmd;
    while (st == STRIA_OK && stria__tb_read_all(rfd, &cmd, sizeof(cmd)) == 0 &&
           cmd.op != STRIA__TB_QUIT) {
        if (cmd.op == STRIA__TB_BW) {
            st = stria__tb_stream(&r, 1, cmd.size, cmd.iters, cmd.buffers, NULL);
        } else {
            stria__tb_overlap_t ov;
            st = stria__tb_overlap_run(o, &r, 1, cmd.tokens, &ov);
        }
    }
    if (st != STRIA_OK)
        fprintf(stderr, "stria-bench transport: rank 1: %s\n", stria_error_msg());
    stria__tb_disconnect(&r);
    return st == STRIA_OK ? 0 : 1;
}

/* ---- ucx_perftest ------------------------------------------------------------ */

static int stria__tb_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

/* Waits for a child up to `secs`, then kills it. Returns its exit status or -1. */
static int stria__tb_reap(pid_t pid, double secs)
{
    double until = stria_time_now() + secs;
    int status;
    for (;;) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        if (w < 0)
            return -1;
        if (stria_time_now() >= until) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        usleep(2000);
    }
}

/* One ucx_perftest tag_bw run; returns GB/s or a negative value. */
static double stria__tb_perftest(size_t size, int iters, char *err, size_t err_len)
{
    char port_s[16], size_s[32], iters_s[16];
    int port = stria__tb_free_port();
    if (port <= 0) {
        snprintf(err, err_len, "no free port");
        return -1;
    }
    snprintf(port_s, sizeof(port_s), "%d", port);
    snprintf(size_s, sizeof(size_s), "%zu", size);
    snprintf(iters_s, sizeof(iters_s), "%d", iters);
    char *server_argv[] = {"ucx_perftest", "-p", port_s, NULL};
    char *client_argv[] = {"ucx_perftest", "127.0.0.1", "-p",    port_s, "-t", "tag_bw", "-s",
                           size_s,         "-n",        iters_s, "-w",   "2",  "-f",     NULL};
    pid_t server, client;
    posix_spawn_file_actions_t quiet;
    posix_spawn_file_actions_init(&quiet);
    posix_spawn_file_actions_addopen(&quiet, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&quiet, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
    if (posix_spawnp(&server, "ucx_perftest", &quiet, NULL, server_argv, environ) != 0) {
        posix_spawn_file_actions_destroy(&quiet);
        snprintf(err, err_len, "ucx_perftest not found");
        return -1;
    }
    posix_spawn_file_actions_destroy(&quiet);

    double gbps = -1;
    snprintf(err, err_len, "ucx_perftest gave no result");
    /* The server needs a moment to listen; the client is retried. */
    for (int attempt = 0; attempt < 20 && gbps < 0; attempt++) {
        usleep(50000);
        int pfd[2];
        if (pipe(pfd) != 0)
            break;
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_adddup2(&fa, pfd[1], STDOUT_FILENO);
        posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
        posix_spawn_file_actions_addclose(&fa, pfd[0]);
        int rc = posix_spawnp(&client, "ucx_perftest", &fa, NULL, client_argv, environ);
        posix_spawn_file_actions_destroy(&fa);
        close(pfd[1]);
        if (rc != 0) {
            close(pfd[0]);
            break;
        }
        char out[8192];
        size_t n = 0;
        ssize_t got;
        while (n < sizeof(out) - 1 && (got = read(pfd[0], out + n, sizeof(out) - 1 - n)) != 0) {
            if (got < 0 && errno == EINTR)
                continue;
            if (got < 0)
                break;
            n += (size_t)got;
        }
        out[n] = '\0';
        close(pfd[0]);
        int code = stria__tb_reap(client, STRIA__TB_TIMEOUT_S);
        if (code != 0)
            continue; /* server not listening yet */
        /* -f prints one line of figures: iterations, latency (typical,
         * average, overall), bandwidth in MiB/s (average, overall),
         * message rate (average, overall). */
        char *line = NULL, *save = NULL;
        for (char *l = strtok_r(out, "\n", &save); l != NULL; l = strtok_r(NULL, "\n", &save))
            if (strspn(l, " 0123456789.") == strlen(l) && strlen(l) > 0)
                line = l;
        double f[8];
        if (line != NULL && sscanf(line, "%lf %lf %lf %lf %lf %lf %lf %lf", &f[0], &f[1], &f[2],
                                   &f[3], &f[4], &f[5], &f[6], &f[7]) == 8)
            gbps = f[5] * 1048576.0 / 1e9;
        else
            snprintf(err, err_len, "cannot parse ucx_perftest output");
    }
    kill(server, SIGTERM);
    stria__tb_reap(server, 5.0);
    return gbps;
}

/* ---- rank 0: the driver ---------------------------------------------------------- */

static void stria__tb_print_size(char *out, size_t n, size_t size)
{
    if (size % (1u << 20) == 0)
        snprintf(out, n, "%zu MiB", size >> 20);
    else if (size % 1024 == 0)
        snprintf(out, n, "%zu KiB", size >> 10);
    else
        snprintf(out, n, "%zu B", size);
}

static stria_status_t stria__tb_bandwidth(const stria__tb_opts_t *o, stria__tb_rank_t *r, int wfd,
                                          const char *tls_name)
{
    stria_status_t st = STRIA_OK;
    if (!o->json) {
        printf("ring-link bandwidth, 2 processes, UCX_TLS=%s, 2 blocks in flight, %d runs per "
               "size (medians)\n"
               "  link 1 buf: every block sent from one buffer and received into one, as "
               "ucx_perftest does\n"
               "  link 2 bufs: alternating buffers, as the ring engine's double buffering\n",
               tls_name, o->reps);
        printf("%10s %8s %12s %12s %14s %8s %8s\n", "size", "iters", "link 1 buf", "link 2 bufs",
               "perftest GB/s", "ratio", "ratio 2");
    }
    for (int si = 0; si < o->n_sizes && st == STRIA_OK; si++) {
        size_t size = o->sizes[si];
        int iters = (int)(o->bytes_per_rep / size);
        if (iters < 8)
            iters = 8;
        double link_v[2][100], perf_v[100];
        int n_perf = 0;
        char perr[200] = "";
        /* One warm-up round, then rounds of: link (1 buffer), link (2
         * buffers), perftest, so the three see the same machine. */
        for (int rep = -1; rep < o->reps && st == STRIA_OK; rep++) {
            for (int b = 0; b < 2 && st == STRIA_OK; b++) {
                stria__tb_cmd_t cmd = {
                    .op = STRIA__TB_BW, .iters = iters, .size = size, .buffers = b + 1};
                double secs = 0;
                if (stria__tb_write_all(wfd, &cmd, sizeof(cmd)) != 0) {
                    st = stria_error_set(STRIA_ERR_IO, "rank 1 went away");
                    break;
                }
                st = stria__tb_stream(r, 0, size, iters, b + 1, &secs);
                if (st == STRIA_OK && rep >= 0)
                    link_v[b][rep] = (double)size * iters / secs / 1e9;
            }
            if (st != STRIA_OK || rep < 0 || !o->perftest)
                continue;
            double g = stria__tb_perftest(size, iters, perr, sizeof(perr));
            if (g > 0)
                perf_v[n_perf++] = g;
        }
        if (st != STRIA_OK)
            break;
        double one = stria_bench_median(link_v[0], o->reps);
        double two = stria_bench_median(link_v[1], o->reps);
        double perf = stria_bench_median(perf_v, n_perf);
        char sz[32];
        stria__tb_print_size(sz, sizeof(sz), size);
        if (o->json) {
            printf("{\"kind\":\"bandwidth\",\"size\":%zu,\"tls\":\"%s\",\"iters\":%d,\"reps\":%d,"
                   "\"in_flight\":%d,\"gbps\":%.4f,\"gbps_double_buffered\":%.4f,",
                   size, tls_name, iters, o->reps, STRIA__TB_WINDOW, one, two);
            if (n_perf > 0)
                printf("\"perftest_gbps\":%.4f,\"ratio\":%.4f,\"ratio_double_buffered\":%.4f}\n",
                       perf, one / perf, two / perf);
            else
                printf("\"perftest_gbps\":null,\"ratio\":null,\"ratio_double_buffered\":null}\n");
        } else if (n_perf > 0) {
            printf("%10s %8d %12.3f %12.3f %14.3f %8.3f %8.3f\n", sz, iters, one, two, perf,
                   one / perf, two / perf);
        } else {
            printf("%10s %8d %12.3f %12.3f %14s %8s %8s%s%s\n", sz, iters, one, two, "-", "-", "-",
                   o->perftest ? "   " : "", o->perftest ? perr : "");
        }
        fflush(stdout);
    }
    return st;
}

static stria_status_t stria__tb_overlap(const stria__tb_opts_t *o, stria__tb_rank_t *r, int wfd,
                                        const char *tls_name)
{
    stria_status_t st = STRIA_OK;
    if (!o->json) {
        printf("\noverlap, 2-process striped causal ring pass, UCX_TLS=%s, %s, heads %lld/%lld, "
               "head_dim %lld, kernel %s, 1 thread per rank (medians of %d)\n",
               tls_name, stria_dtype_name(o->dtype), (long long)o->heads, (long long)o->kv_heads,
               (long long)o->head_dim, stria_kernels_variant(), o->reps < 3 ? 3 : o->reps);
        printf("%7s %10s %11s %11s %11s %11s %7s %11s %11s\n", "tokens", "K/V bytes", "compute ms",
               "transfer ms", "step0 ms", "max ms", "ratio", "compute1 ms", "step1 ms");
    }
    for (int ti = 0; ti < o->n_tokens && st == STRIA_OK; ti++) {
        stria__tb_cmd_t cmd = {.op = STRIA__TB_OVERLAP, .tokens = o->tokens[ti]};
        stria__tb_overlap_t ov;
        if (stria__tb_write_all(wfd, &cmd, sizeof(cmd)) != 0)
            return stria_error_set(STRIA_ERR_IO, "rank 1 went away");
        st = stria__tb_overlap_run(o, r, 0, o->tokens[ti], &ov);
        if (st != STRIA_OK)
            break;
        size_t kv =
            2 * (size_t)(o->tokens[ti] * o->kv_heads * o->head_dim) * stria_dtype_size(o->dtype);
        double mx = ov.compute0 > ov.transfer ? ov.compute0 : ov.transfer;
        if (o->json)
            printf("{\"kind\":\"overlap\",\"tls\":\"%s\",\"tokens\":%lld,\"heads\":%lld,"
                   "\"kv_heads\":%lld,\"head_dim\":%lld,\"dtype\":\"%s\",\"kv_bytes\":%zu,"
                   "\"compute_s\":%.6f,\"transfer_s\":%.6f,\"step_s\":%.6f,\"max_s\":%.6f,"
                   "\"ratio\":%.4f,\"compute1_s\":%.6f,\"step1_s\":%.6f}\n",
                   tls_name, (long long)o->tokens[ti], (long long)o->heads, (long long)o->kv_heads,
                   (long long)o->head_dim, stria_dtype_name(o->dtype), kv, ov.compute0, ov.transfer,
                   ov.step0, mx, ov.step0 / mx, ov.compute1, ov.step1);
        else
            printf("%7lld %10zu %11.3f %11.3f %11.3f %11.3f %7.3f %11.3f %11.3f\n",
                   (long long)o->tokens[ti], kv, ov.compute0 * 1e3, ov.transfer * 1e3,
                   ov.step0 * 1e3, mx * 1e3, ov.step0 / mx, ov.compute1 * 1e3, ov.step1 * 1e3);
        fflush(stdout);
    }
    return st;
}

static const char stria__tb_description[] =
    "Ring-link bandwidth between two processes over UCX, beside ucx_perftest -t tag_bw\n"
    "on the same UCX_TLS in the same run, and the overlap of K/V transfer with\n"
    "attention compute in a two-process ring pass. Figures are medians of --reps\n"
    "runs; GB/s means 10^9 bytes per second.";

static int stria__tb_parse(int argc, char **argv, stria__tb_opts_t *o)
{
    int64_t size = 0, bytes_per_rep = 0, reps = 0, poll_us = 0;
    stria_int_list_t tokens = {0};
    bool bandwidth_only = false, overlap_only = false;
    const stria_option_t own[] = {
        STRIA_OPTION("size", BYTES, &size, "BYTES", "one block size (default: 1M, 4M, 16M and 64M)",
                     .min = 1, .max = (double)((int64_t)1 << 34)),
        STRIA_OPTION("tls", STRING, &o->tls, "LIST",
                     "UCX transports for both (default: $UCX_TLS, else UCX's own default)"),
        STRIA_OPTION("reps", INT, &reps, "N", "runs per size and per tool", .dflt = "5", .min = 1,
                     .max = 100),
        STRIA_OPTION("poll-us", INT, &poll_us, "U",
                     "progress-thread polling window of the link, microseconds (0: the link's "
                     "default; -1: never poll)",
                     .dflt = "0", .min = -1, .max = 100000),
        STRIA_OPTION("bytes-per-rep", BYTES, &bytes_per_rep, "BYTES",
                     "bytes streamed per run (at least 8 blocks)", .dflt = "512M", .min = 1,
                     .max = (double)((int64_t)1 << 34)),
        STRIA_OPTION("no-perftest", UNFLAG, &o->perftest, NULL,
                     "skip ucx_perftest (ratio not printed)"),
        STRIA_OPTION("tokens", INTS, &tokens, "LIST", "overlap: tokens per rank",
                     .dflt = "128,512,2048", .min = 1, .max = 1 << 20,
                     .max_items = STRIA__TB_MAX_TOKENS),
        STRIA_OPTION("bandwidth-only", FLAG, &bandwidth_only, NULL, "run the bandwidth part only"),
        STRIA_OPTION("overlap-only", FLAG, &overlap_only, NULL, "run the overlap part only"),
        STRIA_OPTION("json", FLAG, &o->json, NULL,
                     "one JSON object per line instead of the tables"),
    };
    stria_option_t opts[sizeof(own) / sizeof(own[0]) + STRIA_BENCH_SHAPE_OPTS + 1] = {{0}};
    stria_bench_shape_t shape = {0};
    memcpy(opts, own, sizeof(own));
    stria_bench_shape_options(opts + sizeof(own) / sizeof(own[0]), &shape, 256);
    const stria_command_t cmd = {
        .name = "transport", .description = stria__tb_description, .options = opts};
    stria_cli_t cli;

    memset(o, 0, sizeof(*o));
    o->tls = getenv("UCX_TLS");
    o->perftest = true;
    int rc = stria_bench_parse(&cmd, argc, argv, &cli);
    if (rc < 0) {
        o->n_sizes = size > 0 ? 1 : 4;
        for (int k = 0; k < 4; k++)
            o->sizes[k] = size > 0 ? (size_t)size : (size_t)1 << (20 + 2 * k);
        o->bytes_per_rep = (size_t)bytes_per_rep;
        o->reps = (int)reps;
        o->poll_us = (int)poll_us;
        o->n_tokens = tokens.n;
        memcpy(o->tokens, tokens.v, tokens.n * sizeof(int64_t));
        o->bandwidth = !overlap_only;
        o->overlap = !bandwidth_only;
    }
    stria_cli_free(&cli);
    if (rc >= 0)
        return rc;
    if (stria_bench_shape_check("transport", &shape) >= 0)
        return 2;
    o->heads = shape.heads;
    o->kv_heads = shape.kv_heads;
    o->head_dim = shape.head_dim;
    o->dtype = shape.dtype;
    if (o->tls != NULL && o->tls[0] == '\0')
        return stria_bench_usage_error("transport", "--tls: empty");
    return -1;
}

int stria_bench_transport(int argc, char **argv)
{
    stria__tb_opts_t o;
    int rc = stria__tb_parse(argc, argv, &o);
    if (rc >= 0)
        return rc;
    const char *tls_name = o.tls != NULL ? o.tls : "(UCX default)";
    if (o.tls != NULL)
        setenv("UCX_TLS", o.tls, 1); /* for ucx_perftest too */
    signal(SIGPIPE, SIG_IGN);

    /* Rank 1 is forked before either process touches UCX. */
    int to_child[2], to_parent[2];
    if (pipe(to_child) != 0 || pipe(to_parent) != 0) {
        fprintf(stderr, "stria-bench transport: pipe: %s\n", strerror(errno));
        return 1;
    }
    fflush(stdout);
    pid_t child = fork();
    if (child < 0) {
        fprintf(stderr, "stria-bench transport: fork: %s\n", strerror(errno));
        return 1;
    }
    if (child == 0) {
        close(to_child[1]);
        close(to_parent[0]);
        _exit(stria__tb_child(&o, to_child[0], to_parent[1]));
    }
    close(to_child[0]);
    close(to_parent[1]);

    stria__tb_rank_t r = {0};
    stria_status_t st = stria__tb_connect(0, &o, to_parent[0], to_child[1], &r);
    if (st == STRIA_OK) {
        if (o.bandwidth)
            st = stria__tb_bandwidth(&o, &r, to_child[1], tls_name);
        if (st == STRIA_OK && o.overlap)
            st = stria__tb_overlap(&o, &r, to_child[1], tls_name);
        if (st != STRIA_OK)
            fprintf(stderr, "stria-bench transport: %s\n", stria_error_msg());
        stria__tb_cmd_t quit = {.op = STRIA__TB_QUIT};
        stria__tb_write_all(to_child[1], &quit, sizeof(quit));
        stria__tb_disconnect(&r);
    } else {
        fprintf(stderr, "stria-bench transport: %s\n", stria_error_msg());
    }
    close(to_child[1]);
    close(to_parent[0]);
    int child_rc = stria__tb_reap(child, 10.0);
    if (st == STRIA_OK && child_rc != 0) {
        fprintf(stderr, "stria-bench transport: rank 1 exited with status %d\n", child_rc);
        return 1;
    }
    return st == STRIA_OK ? 0 : 1;
}
