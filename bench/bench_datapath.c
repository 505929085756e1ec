/*
 * stria-bench datapath: how fast a trainer's tensors reach the workers and
 * come back, beside what the machine allows, in one run.
 *
 * For each number of workers and each data path (tcp; shm where the client
 * offers it) a coordinator and the workers are started on loopback and the
 * same causal forward job (at least 512 MiB of Q, K, V by default) runs R
 * times through libstria: its upload and download rates (bytes / phase
 * time, medians of the jobs after the first, whose pages the workers' pools
 * fault in), beside a raw TCP stream of the same bytes between this process
 * and a child (one connection per worker, each from its own thread) and a
 * memcpy of them (one thread per worker), measured between the jobs; ratio
 * is upload / raw TCP for tcp, upload / memcpy for shm. Beside them the
 * bound of the shm path, whose jobs each get fresh memory: the same bytes
 * pwrite()n into a new memfd (one thread per worker), and ratio_fresh =
 * upload / that. The workers' minor
 * page faults during the second job (from before its submission to after
 * its release) are set against the job's pages: the high water of the
 * workers' pools in 4 KiB pages.
 *
 * Then the data-heavy object: a non-causal forward+backward job of batch
 * 16 x 4096 tokens, 8 heads, head_dim 128, fp32 through 4 workers, against
 * the in-process ring engine with the same ranks, alternately; the ratio of
 * the median times.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "bench_daemons.h"
#include "bench_util.h"
#include "stria_kernels.h"

#define DP_MAX_STREAMS 64
#define DP_RAW_BUF     ((size_t)64 << 20)

typedef struct {
    stria_int_list_t workers;
    stria_str_list_t paths;
    int64_t batch, seq, heads, head_dim, reps, tpr;
    stria_dtype_t dtype;
    bool data_heavy;
    int64_t dh_batch, dh_seq, dh_reps;
    bool json;
} dp_cfg_t;

/* ---- the same bytes: slices of q | k | v ---------------------------------------- */

typedef struct {
    const char *part[3];
    size_t len[3];
    size_t total;
} dp_bytes_t;

/* Calls fn on the pieces of [off, off + n) of the concatenation. */
static int dp_each(const dp_bytes_t *b, size_t off, size_t n,
                   int (*fn)(void *ctx, const char *p, size_t len), void *ctx)
{
    for (int i = 0; i < 3 && n > 0; i++) {
        if (off >= b->len[i]) {
            off -= b->len[i];
            continue;
        }
        size_t take = b->len[i] - off < n ? b->len[i] - off : n;
        if (fn(ctx, b->part[i] + off, take) != 0)
            return -1;
        off = 0;
        n -= take;
    }
    return 0;
}

/* ---- raw TCP: one stream per worker between this process and a child ------------- */

typedef struct {
    int fd;
    size_t off, n; /* the stream's slice */
    const dp_bytes_t *b;
    int rc;
} dp_stream_t;

typedef struct {
    pid_t child;
    int fd[DP_MAX_STREAMS];
    int n;
} dp_raw_t;

static int dp_full_io(int fd, void *buf, size_t n, bool out)
{
    for (size_t done = 0; done < n;) {
        ssize_t r = out ? send(fd, (char *)buf + done, n - done, MSG_NOSIGNAL)
                        : recv(fd, (char *)buf + done, n - done, 0);
        if (r <= 0)
            return -1;
        done += (size_t)r;
    }
    return 0;
}

/* The child's side of a stream: rounds of (8-byte length, bytes) read into
 * a reused buffer, each acknowledged with one byte; length 0 ends it. */
static void *dp_sink(void *arg)
{
    int fd = (int)(intptr_t)arg;
    char *buf = malloc(DP_RAW_BUF);
    if (buf == NULL)
        return NULL;
    memset(buf, 0, DP_RAW_BUF); /* faulted in once, like a pool's pages */
    for (;;) {
        uint64_t len;
        if (dp_full_io(fd, &len, sizeof(len), false) != 0 || len == 0)
            break;
        for (uint64_t got = 0; got < len;) {
            size_t want = len - got < DP_RAW_BUF ? (size_t)(len - got) : DP_RAW_BUF;
            ssize_t r = recv(fd, buf, want, 0);
            if (r <= 0)
                goto out;
            got += (uint64_t)r;
        }
        char ack = 1;
        if (dp_full_io(fd, &ack, 1, true) != 0)
            break;
    }
out:
    free(buf);
    return NULL;
}

static int dp_raw_start(dp_raw_t *raw, int n)
{
    struct sockaddr_in a;
    socklen_t alen = sizeof(a);
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(lfd, n) != 0 ||
        getsockname(lfd, (struct sockaddr *)&a, &alen) != 0)
        return -1;
    raw->n = n;
    raw->child = fork();
    if (raw->child < 0)
        return -1;
    if (raw->child == 0) {
        pthread_t th[DP_MAX_STREAMS];
        for (int i = 0; i < n; i++) {
            int fd = accept(lfd, NULL, NULL);
            if (fd < 0 || pthread_create(&th[i], NULL, dp_sink, (void *)(intptr_t)fd) != 0)
                _exit(1);
        }
        for (int i = 0; i < n; i++)
            pthread_join(th[i], NULL);
        _exit(0);
    }
    close(lfd);
    for (int i = 0; i < n; i++) {
        raw->fd[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (raw->fd[i] < 0 || connect(raw->fd[i], (struct sockaddr *)&a, sizeof(a)) != 0)
            return -1;
    }
    return 0;
}

static int dp_send_piece(void *ctx, const char *p, size_t len)
{
    return dp_full_io(*(int *)ctx, (void *)p, len, true);
}

static void *dp_source(void *arg)
{
    dp_stream_t *s = arg;
    uint64_t len = s->n;
    char ack;
    s->rc = dp_full_io(s->fd, &len, sizeof(len), true) != 0 ||
            dp_each(s->b, s->off, s->n, dp_send_piece, &s->fd) != 0 ||
            dp_full_io(s->fd, &ack, 1, false) != 0;
    return NULL;
}

/* One round: every stream sends its slice; GB/s of the whole, or -1. */
static double dp_raw_round(dp_raw_t *raw, const dp_bytes_t *b)
{
    dp_stream_t s[DP_MAX_STREAMS];
    pthread_t th[DP_MAX_STREAMS];
    double t0 = stria_time_now();
    for (int i = 0; i < raw->n; i++) {
        s[i] = (dp_stream_t){.fd = raw->fd[i], .b = b};
        s[i].off = b->total / (size_t)raw->n * (size_t)i;
        s[i].n =
            (i + 1 == raw->n ? b->total : b->total / (size_t)raw->n * (size_t)(i + 1)) - s[i].off;
        pthread_create(&th[i], NULL, dp_source, &s[i]);
    }
    int bad = 0;
    for (int i = 0; i < raw->n; i++) {
        pthread_join(th[i], NULL);
        bad |= s[i].rc;
    }
    double dt = stria_time_now() - t0;
    return bad ? -1.0 : (double)b->total / dt * 1e-9;
}

static void dp_raw_stop(dp_raw_t *raw)
{
    for (int i = 0; i < raw->n; i++) {
        uint64_t end = 0;
        if (raw->fd[i] >= 0) {
            (void)dp_full_io(raw->fd[i], &end, sizeof(end), true);
            close(raw->fd[i]);
        }
    }
    if (raw->child > 0)
        waitpid(raw->child, NULL, 0);
}

/* ---- memcpy: one thread per worker --------------------------------------------- */

typedef struct {
    const dp_bytes_t *b;
    char *dst;
    size_t off, n;
} dp_copy_t;

static int dp_copy_piece(void *ctx, const char *p, size_t len)
{
    char **dst = ctx;
    memcpy(*dst, p, len);
    *dst += len;
    return 0;
}

static void *dp_copier(void *arg)
{
    dp_copy_t *c = arg;
    char *dst = c->dst + c->off;
    (void)dp_each(c->b, c->off, c->n, dp_copy_piece, &dst);
    return NULL;
}

static double dp_memcpy_round(const dp_bytes_t *b, char *dst, int n)
{
    dp_copy_t c[DP_MAX_STREAMS];
    pthread_t th[DP_MAX_STREAMS];
    double t0 = stria_time_now();
    for (int i = 0; i < n; i++) {
        c[i] = (dp_copy_t){.b = b, .dst = dst};
        c[i].off = b->total / (size_t)n * (size_t)i;
        c[i].n = (i + 1 == n ? b->total : b->total / (size_t)n * (size_t)(i + 1)) - c[i].off;
        pthread_create(&th[i], NULL, dp_copier, &c[i]);
    }
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    return (double)b->total / (stria_time_now() - t0) * 1e-9;
}

/* ---- fresh memory: what the shm path's upload cannot beat ------------------------- */

/* The shm path gives every job a fresh memfd (a client maps no other job's
 * bytes), so its upload writes into pages the kernel allocates for it: one
 * thread per worker pwrite()s its slice of the same bytes into a new memfd,
 * as the client does; the memfds are closed after the clock stops. */
typedef struct {
    const dp_bytes_t *b;
    size_t off, n;
    int fd;
    uint64_t at;
} dp_fresh_t;

static int dp_fresh_piece(void *ctx, const char *p, size_t len)
{
    dp_fresh_t *f = ctx;
    for (size_t done = 0; done < len;) {
        ssize_t w = pwrite(f->fd, p + done, len - done, (off_t)f->at);
        if (w <= 0)
            return -1;
        done += (size_t)w;
        f->at += (uint64_t)w;
    }
    return 0;
}

static void *dp_fresh_writer(void *arg)
{
    dp_fresh_t *f = arg;
    f->fd = memfd_create("stria-bench", MFD_CLOEXEC);
    if (f->fd < 0 || ftruncate(f->fd, (off_t)f->n) != 0 ||
        dp_each(f->b, f->off, f->n, dp_fresh_piece, f) != 0)
        f->at = 0;
    return NULL;
}

/* GB/s, or -1. */
static double dp_fresh_round(const dp_bytes_t *b, int n)
{
    dp_fresh_t f[DP_MAX_STREAMS];
    pthread_t th[DP_MAX_STREAMS];
    double t0 = stria_time_now();
    for (int i = 0; i < n; i++) {
        f[i] = (dp_fresh_t){.b = b, .fd = -1};
        f[i].off = b->total / (size_t)n * (size_t)i;
        f[i].n = (i + 1 == n ? b->total : b->total / (size_t)n * (size_t)(i + 1)) - f[i].off;
        pthread_create(&th[i], NULL, dp_fresh_writer, &f[i]);
    }
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    double dt = stria_time_now() - t0;
    bool bad = false;
    for (int i = 0; i < n; i++) {
        bad |= f[i].at != f[i].n;
        if (f[i].fd >= 0)
            close(f[i].fd);
    }
    return bad ? -1.0 : (double)b->total / dt * 1e-9;
}

/* ---- one row: a path and a number of workers -------------------------------------- */

static long long dp_minflt(int workers)
{
    long long sum = 0;
    for (int i = 0; i < workers; i++) {
        long long f = stria_bench_worker_minflt(i);
        if (f < 0)
            return -1;
        sum += f;
    }
    return sum;
}

/* What a row measured, per rep. */
typedef struct {
    double *up, *down, *raw, *mem, *fresh;
    long long minflt[2]; /* the first and second job */
    stria_bench_pools_t pools;
} dp_meas_t;

/* Runs the jobs, the raw streams and the copies alternately. */
static stria_status_t dp_measure(const dp_cfg_t *c, int workers, stria_client_t *client,
                                 stria_bench_job_t *t, const char *coord, dp_meas_t *m)
{
    const stria_job_spec_t spec = stria_bench_job_spec(t, true, workers, "stria-bench datapath");
    size_t es = stria_dtype_size(t->dtype);
    size_t nq = (size_t)(t->batch * t->seq * t->heads * t->head_dim) * es;
    size_t nk = (size_t)(t->batch * t->seq * t->kv_heads * t->head_dim) * es;
    dp_bytes_t b = {{t->q, t->k, t->v}, {nq, nk, nk}, nq + 2 * nk};
    dp_raw_t raw;
    memset(&raw, 0, sizeof(raw));
    char *dst = malloc(b.total);
    stria_status_t st = STRIA_OK;
    if (dst == NULL || dp_raw_start(&raw, workers) != 0) {
        st = stria_error_set(STRIA_ERR_IO, "cannot set up the raw TCP streams or the copy");
        goto out;
    }
    memset(dst, 0, b.total);
    for (int r = 0; r < c->reps && st == STRIA_OK; r++) {
        long long f0 = dp_minflt(workers);
        stria_job_t *job = NULL;
        stria_call_stats_t fs = STRIA_CALL_STATS_INIT;
        st = stria_client_forward(client, &spec, t->q, t->k, t->v, t->o, t->lse, NULL, NULL, &fs,
                                  &job);
        stria_client_release(job);
        long long f1 = dp_minflt(workers);
        if (r < 2)
            m->minflt[r] = f0 < 0 || f1 < 0 ? -1 : f1 - f0;
        if (st != STRIA_OK)
            break;
        m->up[r] = (double)fs.bytes_up / fs.upload_s * 1e-9;
        m->down[r] = (double)fs.bytes_down / fs.download_s * 1e-9;
        m->raw[r] = dp_raw_round(&raw, &b);
        m->mem[r] = dp_memcpy_round(&b, dst, workers);
        m->fresh[r] = dp_fresh_round(&b, workers);
        if (m->raw[r] < 0)
            st = stria_error_set(STRIA_ERR_IO, "the raw TCP stream failed");
        if (m->fresh[r] < 0)
            st = stria_error_set(STRIA_ERR_IO, "cannot write a fresh memfd");
        fprintf(stderr,
                "  %d worker(s), rep %d: upload %.3f GB/s, download %.3f GB/s, raw TCP %.3f GB/s, "
                "memcpy %.3f GB/s, fresh memfd %.3f GB/s, worker minor faults %lld\n",
                workers, r, m->up[r], m->down[r], m->raw[r], m->mem[r], m->fresh[r], f1 - f0);
    }
    /* the pools' figures arrive with the next heartbeats */
    usleep((useconds_t)(atof(STRIA_BENCH_HEARTBEAT_S) * 2.2e6));
    if (st == STRIA_OK)
        st = stria_bench_pools(coord, &m->pools);
out:
    dp_raw_stop(&raw);
    free(dst);
    return st;
}

/* Medians of reps [from, n). */
static double dp_median(double *v, int n, int from)
{
    return n > from ? stria_bench_median(v + from, n - from) : stria_bench_median(v, n);
}

static void dp_report(const dp_cfg_t *c, const char *path, int workers, const stria_bench_job_t *t,
                      dp_meas_t *m)
{
    int R = (int)c->reps;
    double up = dp_median(m->up, R, 1), down = dp_median(m->down, R, 1);
    double raw = stria_bench_median(m->raw, R), mem = stria_bench_median(m->mem, R);
    double fresh = stria_bench_median(m->fresh, R);
    double first = m->up[0];
    bool shm = strcmp(path, "shm") == 0;
    double ratio = shm ? up / mem : up / raw;
    uint64_t pages = m->pools.high_water / 4096;
    double in_bytes = (double)(t->batch * t->seq * (t->heads + 2 * t->kv_heads) * t->head_dim) *
                      (double)stria_dtype_size(t->dtype);
    if (c->json) {
        printf("{\"path\":\"%s\",\"workers\":%d,\"batch\":%lld,\"seq\":%lld,\"heads\":%lld,"
               "\"head_dim\":%lld,\"dtype\":\"%s\",\"input_bytes\":%.0f,\"reps\":%d,"
               "\"upload_gbps\":%.4f,\"download_gbps\":%.4f,\"first_upload_gbps\":%.4f,"
               "\"raw_tcp_gbps\":%.4f,\"memcpy_gbps\":%.4f,\"fresh_memfd_gbps\":%.4f,"
               "\"ratio\":%.4f,\"ratio_fresh\":%.4f,"
               "\"first_job_minflt\":%lld,\"second_job_minflt\":%lld,\"job_pages\":%llu,"
               "\"minflt_per_page\":%.6f}\n",
               path, workers, (long long)t->batch, (long long)t->seq, (long long)t->heads,
               (long long)t->head_dim, stria_dtype_name(t->dtype), in_bytes, R, up, down, first,
               raw, mem, fresh, ratio, up / fresh, m->minflt[0], m->minflt[1],
               (unsigned long long)pages, pages ? (double)m->minflt[1] / (double)pages : 0.0);
        fflush(stdout);
        return;
    }
    printf("%s, %d worker(s), %.0f MiB of Q/K/V, median of jobs 2..%d:\n"
           "  upload    %.3f GB/s (first job %.3f)   raw TCP %.3f GB/s   memcpy %.3f GB/s   "
           "fresh memfd %.3f GB/s\n"
           "  download  %.3f GB/s\n"
           "  ratio     %.3f (upload / %s), %.3f (upload / fresh memfd)\n"
           "  worker minor faults: first job %lld, second job %lld = %.4f%% of the job's %llu "
           "pages\n",
           path, workers, in_bytes / 1048576.0, R, up, first, raw, mem, fresh, down, ratio,
           shm ? "memcpy" : "raw TCP", up / fresh, m->minflt[0], m->minflt[1],
           pages ? 100.0 * (double)m->minflt[1] / (double)pages : 0.0, (unsigned long long)pages);
}

static stria_status_t dp_path_parse(const char *name, stria_data_path_t *out)
{
    if (strcmp(name, "tcp") == 0)
        *out = STRIA_DATA_PATH_TCP;
    else if (strcmp(name, "shm") == 0)
        *out = STRIA_DATA_PATH_SHM;
    else if (strcmp(name, "auto") == 0)
        *out = STRIA_DATA_PATH_AUTO;
    else
        return stria_error_set(STRIA_ERR_INVALID_ARG, "'%s' is not a path (tcp, shm, auto)", name);
    return STRIA_OK;
}

/* One row: daemons of its own, so its first job finds fresh pools. A path
 * the client refuses is reported as skipped. Returns the exit code. */
static int dp_row(const dp_cfg_t *c, const char *path, int workers, stria_bench_job_t *t)
{
    char coord[512];
    stria_data_path_t dp = STRIA_DATA_PATH_AUTO;
    (void)dp_path_parse(path, &dp);
    if (stria_bench_daemons_start("datapath", workers, (int)c->tpr, coord, sizeof(coord)) != 0)
        return 1;
    stria_client_t *client = NULL;
    stria_status_t st = stria_bench_client(coord, "stria-bench datapath", dp, &client);
    if (st == STRIA_ERR_UNSUPPORTED) {
        if (c->json)
            printf("{\"path\":\"%s\",\"workers\":%d,\"skipped\":\"the client does not offer "
                   "it\"}\n",
                   path, workers);
        else
            printf("%s, %d worker(s): skipped: %s\n", path, workers, stria_error_msg());
        stria_bench_daemons_stop();
        return 0;
    }
    dp_meas_t m;
    memset(&m, 0, sizeof(m));
    size_t R = (size_t)c->reps;
    m.up = calloc(R, sizeof(double)), m.down = calloc(R, sizeof(double));
    m.raw = calloc(R, sizeof(double)), m.mem = calloc(R, sizeof(double));
    m.fresh = calloc(R, sizeof(double));
    if (st == STRIA_OK)
        st = dp_measure(c, workers, client, t, coord, &m);
    stria_client_close(client);
    stria_bench_daemons_stop();
    int rc = 0;
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-bench datapath: %s, %d worker(s): %s\n", path, workers,
                stria_error_msg());
        rc = 1;
    } else {
        dp_report(c, path, workers, t, &m);
    }
    free(m.up), free(m.down), free(m.raw), free(m.mem), free(m.fresh);
    return rc;
}

/* ---- the data-heavy job --------------------------------------------------------- */

static int dp_data_heavy(const dp_cfg_t *c)
{
    const int ranks = 4;
    char coord[512];
    stria_bench_job_t t = {.batch = c->dh_batch,
                           .seq = c->dh_seq,
                           .heads = 8,
                           .kv_heads = 8,
                           .head_dim = 128,
                           .dtype = STRIA_DTYPE_F32};
    if (stria_bench_job_alloc(&t, true) != 0)
        return 1;
    if (stria_bench_daemons_start("datapath", ranks, (int)c->tpr, coord, sizeof(coord)) != 0) {
        stria_bench_job_free(&t);
        return 1;
    }
    stria_client_t *client = NULL;
    stria_status_t st =
        stria_bench_client(coord, "stria-bench datapath", STRIA_DATA_PATH_AUTO, &client);
    stria_job_spec_t spec = stria_bench_job_spec(&t, false, ranks, "stria-bench data-heavy");
    int R = (int)c->dh_reps;
    double svc[64], loc[64], up[64], down[64], pass[64];
    for (int r = 0; r < R && st == STRIA_OK; r++) {
        stria_call_stats_t fs = STRIA_CALL_STATS_INIT, bs = STRIA_CALL_STATS_INIT;
        st = stria_bench_service_fwd_bwd(client, &spec, &t, &svc[r], &fs, &bs);
        if (st != STRIA_OK)
            break;
        up[r] = fs.upload_s + bs.upload_s;
        down[r] = fs.download_s + bs.download_s;
        pass[r] = fs.pass_s + bs.pass_s;
        st = stria_bench_local_fwd_bwd(&t, false, ranks, (int)c->tpr, &loc[r]);
        fprintf(stderr,
                "  data-heavy rep %d: service %.3f s (upload %.3f, passes %.3f, "
                "download %.3f), in-process %.3f s\n",
                r, svc[r], up[r], pass[r], down[r], loc[r]);
    }
    stria_client_close(client);
    stria_bench_daemons_stop();
    int rc = 0;
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-bench datapath: data-heavy job: %s\n", stria_error_msg());
        rc = 1;
    } else {
        double s = stria_bench_median(svc, R), l = stria_bench_median(loc, R);
        double u = stria_bench_median(up, R), d = stria_bench_median(down, R);
        double p = stria_bench_median(pass, R);
        if (c->json)
            printf("{\"kind\":\"data_heavy\",\"path\":\"auto\",\"workers\":%d,\"batch\":%lld,"
                   "\"seq\":%lld,\"heads\":8,\"head_dim\":128,\"dtype\":\"fp32\","
                   "\"causal\":false,\"reps\":%d,\"threads_per_worker\":%lld,"
                   "\"service_s\":%.4f,\"inprocess_s\":%.4f,\"ratio\":%.4f,\"upload_s\":%.4f,"
                   "\"pass_s\":%.4f,\"download_s\":%.4f}\n",
                   ranks, (long long)t.batch, (long long)t.seq, R, (long long)c->tpr, s, l, s / l,
                   u, p, d);
        else
            printf("data-heavy: fwd+bwd, %lld x %lld tokens, 8 heads, head_dim 128, fp32, "
                   "non-causal, %d workers, median of %d:\n"
                   "  service     %.3f s (upload %.3f, passes %.3f, download %.3f)\n"
                   "  in-process  %.3f s\n"
                   "  ratio       %.3f\n",
                   (long long)t.batch, (long long)t.seq, ranks, R, s, u, p, d, l, s / l);
    }
    stria_bench_job_free(&t);
    return rc;
}

/* ---- options ----------------------------------------------------------------- */

static const char dp_description[] =
    "Times the upload and download of a causal forward job (default 24 x 1024 tokens, 16\n"
    "heads, head_dim 128, fp32: 576 MiB of Q/K/V) through libstria for each data path and\n"
    "number of workers (a coordinator and the workers started on loopback beside this\n"
    "program, fresh for each row), beside a raw TCP stream of the same bytes between two\n"
    "processes, a memcpy of them and a write of them into fresh memory (a new memfd,\n"
    "what the shm path's jobs get); counts the workers' minor page faults during the\n"
    "second identical job against the job's pages (the high water of their memory pools).\n"
    "Then a data-heavy forward+backward job (16 x 4096 tokens, 8 heads, head_dim 128, fp32,\n"
    "non-causal, 4 workers) through the service and in process, alternately: the ratio of\n"
    "the median times. One JSON object per row with --json.";

static stria_status_t dp_parse_dtype(const char *text, void *dst)
{
    return stria_dtype_parse(text, dst);
}

static int dp_parse(int argc, char **argv, dp_cfg_t *c, stria_cli_t *cli)
{
    c->data_heavy = true;
    const stria_option_t opts[] = {
        STRIA_OPTION("workers", INTS, &c->workers, "N,...", "numbers of workers", .dflt = "1,4",
                     .min = 1, .max = DP_MAX_STREAMS),
        STRIA_OPTION("paths", STRINGS, &c->paths, "tcp|shm,...",
                     "data paths (a path the client lacks is skipped)", .dflt = "tcp,shm"),
        STRIA_OPTION("batch", INT, &c->batch, "B", "batch of the job", .dflt = "24", .min = 1,
                     .max = 1e6),
        STRIA_OPTION("seq", INT, &c->seq, "S", "tokens of the job", .dflt = "1024", .min = 1,
                     .max = 1e9),
        STRIA_OPTION("heads", INT, &c->heads, "H", "heads (and K/V heads) of the job", .dflt = "16",
                     .min = 1, .max = 1024),
        STRIA_OPTION("head-dim", INT, &c->head_dim, "D", "head dimension, a multiple of 8",
                     .dflt = "128", .min = STRIA_HEAD_DIM_MIN, .max = STRIA_HEAD_DIM_MAX),
        STRIA_OPTION("dtype", CUSTOM, &c->dtype, "fp32|bf16|fp16", "storage dtype", .dflt = "fp32",
                     .parse = dp_parse_dtype),
        STRIA_OPTION("reps", INT, &c->reps, "R", "jobs per row (medians of jobs 2..R)", .dflt = "3",
                     .min = 2, .max = 64),
        STRIA_OPTION("threads-per-worker", INT, &c->tpr, "T",
                     "kernel threads of each worker (and in-process rank)", .dflt = "1", .min = 1,
                     .max = 256),
        STRIA_OPTION("no-data-heavy", UNFLAG, &c->data_heavy, NULL, "skip the data-heavy job"),
        STRIA_OPTION("data-heavy-batch", INT, &c->dh_batch, "B", "batch of the data-heavy job",
                     .dflt = "16", .min = 1, .max = 1e6),
        STRIA_OPTION("data-heavy-seq", INT, &c->dh_seq, "S", "tokens of the data-heavy job",
                     .dflt = "4096", .min = 4, .max = 1e9),
        STRIA_OPTION("data-heavy-reps", INT, &c->dh_reps, "R",
                     "runs of the data-heavy job, medians", .dflt = "3", .min = 1, .max = 64),
        STRIA_OPTION("json", FLAG, &c->json, NULL, "one JSON object per line"),
        {.name = NULL},
    };
    const stria_command_t cmd = {
        .name = "datapath", .description = dp_description, .options = opts};
    int prc = stria_bench_parse(&cmd, argc, argv, cli);
    if (prc >= 0)
        return prc;
    if (c->head_dim % 8 != 0)
        return stria_bench_usage_error("datapath", "--head-dim %lld: not a multiple of 8",
                                       (long long)c->head_dim);
    for (size_t i = 0; i < c->paths.n; i++) {
        stria_data_path_t p;
        if (dp_path_parse(c->paths.v[i], &p) != STRIA_OK)
            return stria_bench_usage_error("datapath", "--paths: %s", stria_error_msg());
    }
    return -1;
}

int stria_bench_datapath(int argc, char **argv)
{
    dp_cfg_t c;
    stria_cli_t cli;
    memset(&c, 0, sizeof(c));
    int prc = dp_parse(argc, argv, &c, &cli);
    if (prc >= 0) {
        stria_cli_free(&cli);
        return prc;
    }
    stria_bench_job_t t = {.batch = c.batch,
                           .seq = c.seq,
                           .heads = c.heads,
                           .kv_heads = c.heads,
                           .head_dim = c.head_dim,
                           .dtype = c.dtype};
    int rc = stria_bench_job_alloc(&t, false);
    for (size_t w = 0; w < c.workers.n && rc == 0; w++)
        for (size_t p = 0; p < c.paths.n && rc == 0; p++)
            rc = dp_row(&c, c.paths.v[p], (int)c.workers.v[w], &t);
    stria_bench_job_free(&t);
    if (rc == 0 && c.data_heavy)
        rc = dp_data_heavy(&c);
    stria_cli_free(&cli);
    return rc;
}
