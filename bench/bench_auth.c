/*
 * stria-bench auth: what the security costs, each side by side in one run.
 *
 *  ring     the set-up of a ring link over UCX between processes (rings of
 *           2 and 4 ranks, connect to READY on every rank): the first link
 *           on fresh contexts (it makes the pooled endpoints, with their
 *           handshake, then binds) against the later links (a bind on the
 *           pooled endpoints: one round trip), without keys and with a ring
 *           key and an endpoint key (what a worker with credentials does);
 *           configurations alternate round by round;
 *  service  a small job (submit, forward, backward, release, with a new
 *           client connection each time) through a service without
 *           credentials and through one with them (a two-frame hello on
 *           every connection), started side by side, alternately; job
 *           secrets are proven on every job-scoped call of both;
 *  crypto   one job proof made and checked (what every job-scoped call
 *           adds), and one hello's MACs and session key.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "bench_daemons.h"
#include "bench_util.h"
#include "stria_auth.h"
#include "stria_client.h"
#include "stria_transport.h"

typedef struct {
    int reps, ranks, later;
    int64_t seq;
    bool json;
} auth_cfg_t;

static const char auth_description[] =
    "Measures, side by side in one run: the set-up of a ring link between processes\n"
    "(rings of 2 and 4), the first link on fresh contexts (endpoints and bind) against\n"
    "the later ones (a bind on the pooled endpoints), without and with keys; a small\n"
    "job through a service without and with credentials (started side by side, a new\n"
    "client connection per job); and one job proof and one hello's cryptography.\n"
    "Medians of --reps alternated runs.";

/* ---- ring set-up ------------------------------------------------------------------ */

static int rw_all(int fd, void *buf, size_t n, bool wr)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = wr ? write(fd, p, n) : read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* One rank of a round, a process of its own: a fresh context, then `links`
 * links in a row (the first makes the pooled endpoints), each connected on
 * the parent's go, timed and destroyed; the times go to the parent. */
static int ring_rank(int rank, int size, bool keyed, int links, uint64_t ring0, int rfd, int wfd)
{
    static const uint8_t key[STRIA_AUTH_KEY_BYTES] = {1, 2, 3, 4, 5, 6, 7, 8};
    static const uint8_t ep_key[STRIA_AUTH_KEY_BYTES] = {9, 8, 7, 6, 5, 4, 3, 2};
    stria_ucx_ctx_params_t cp = {
        .listen_host = "127.0.0.1", .tls = "tcp", .endpoint_key = keyed ? ep_key : NULL};
    stria_ucx_ctx_t *ctx = NULL;
    if (stria_ucx_ctx_create(&cp, &ctx) != STRIA_OK)
        return -1;
    uint16_t mine = stria_ucx_ctx_port(ctx), next = 0;
    int rc = -1;
    if (rw_all(wfd, &mine, sizeof(mine), true) != 0 || rw_all(rfd, &next, sizeof(next), false) != 0)
        goto out;
    for (int i = 0; i < links; i++) {
        uint8_t go = 0;
        if (rw_all(rfd, &go, 1, false) != 0)
            goto out;
        stria_ucx_link_params_t lp = {.job_id = 7,
                                      .ring_id = ring0 + (uint64_t)i,
                                      .rank = rank,
                                      .size = size,
                                      .next_host = "127.0.0.1",
                                      .next_port = next,
                                      .connect_timeout_s = 20,
                                      .key = keyed ? key : NULL};
        stria_link_t *link = NULL;
        double t0 = stria_time_now();
        if (stria_link_ucx_connect(ctx, &lp, &link) != STRIA_OK) {
            fprintf(stderr, "stria-bench auth: rank %d: %s\n", rank, stria_error_msg());
            goto out;
        }
        double dt = stria_time_now() - t0;
        stria_link_destroy(link);
        if (rw_all(wfd, &dt, sizeof(dt), true) != 0)
            goto out;
    }
    uint8_t end = 0;
    rc = rw_all(rfd, &end, 1, false);
out:
    stria_ucx_ctx_destroy(ctx);
    return rc;
}

/* One round on fresh processes: times[0] is the first link's set-up (of the
 * slowest rank), times[1..links-1] the later links'. The parent touches no
 * UCX (the ranks are forked from it). */
static int ring_round(int size, bool keyed, int links, uint64_t ring0, double *times)
{
    int to[4][2], from[4][2];
    pid_t pid[4];
    int started = 0, rc = -1;
    fflush(NULL);
    for (; started < size; started++) {
        if (pipe(to[started]) != 0 || pipe(from[started]) != 0)
            goto out;
        pid[started] = fork();
        if (pid[started] < 0)
            goto out;
        if (pid[started] == 0) {
            for (int k = 0; k <= started; k++) {
                close(to[k][1]);
                close(from[k][0]);
            }
            _exit(ring_rank(started, size, keyed, links, ring0, to[started][0], from[started][1]) ==
                          0
                      ? 0
                      : 1);
        }
        close(to[started][0]);
        close(from[started][1]);
    }
    uint16_t ports[4];
    for (int r = 0; r < size; r++)
        if (rw_all(from[r][0], &ports[r], sizeof(ports[r]), false) != 0)
            goto out;
    for (int r = 0; r < size; r++)
        if (rw_all(to[r][1], &ports[(r + 1) % size], sizeof(ports[0]), true) != 0)
            goto out;
    for (int i = 0; i < links; i++) {
        uint8_t go = 1;
        for (int r = 0; r < size; r++)
            if (rw_all(to[r][1], &go, 1, true) != 0)
                goto out;
        times[i] = 0;
        for (int r = 0; r < size; r++) {
            double dt;
            if (rw_all(from[r][0], &dt, sizeof(dt), false) != 0)
                goto out;
            times[i] = dt > times[i] ? dt : times[i];
        }
    }
    uint8_t end = 1;
    for (int r = 0; r < size; r++)
        rw_all(to[r][1], &end, 1, true);
    rc = 0;
out:
    for (int r = 0; r < started; r++) {
        int st = 0;
        close(to[r][1]);
        close(from[r][0]);
        waitpid(pid[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            rc = -1;
    }
    return rc;
}

/* The ring set-ups measured: rings of 2 and 4, without and with keys. */
#define RING_CFGS 4
static const int ring_sizes[RING_CFGS] = {2, 2, 4, 4};
static const bool ring_keyed[RING_CFGS] = {false, true, false, true};

/* Medians of the first and of the later links' set-up, per configuration;
 * rounds alternate the configurations. 0 on success. */
static int measure_ring(int reps, int later, double first[RING_CFGS], double pooled[RING_CFGS])
{
    int links = 1 + later, rc = 0;
    double *f[RING_CFGS], *p[RING_CFGS], *times = calloc((size_t)links, sizeof(double));
    for (int k = 0; k < RING_CFGS; k++) {
        f[k] = calloc((size_t)reps, sizeof(double));
        p[k] = calloc((size_t)(reps * later), sizeof(double));
    }
    uint64_t ring0 = 1;
    for (int r = 0; r < reps && rc == 0; r++)
        for (int j = 0; j < RING_CFGS && rc == 0; j++) {
            int k = (r % 2) ? RING_CFGS - 1 - j : j; /* alternate who goes first */
            rc = ring_round(ring_sizes[k], ring_keyed[k], links, ring0, times);
            ring0 += (uint64_t)links;
            f[k][r] = times[0];
            for (int i = 1; i < links; i++)
                p[k][r * later + i - 1] = times[i];
        }
    for (int k = 0; k < RING_CFGS && rc == 0; k++) {
        first[k] = stria_bench_median(f[k], reps);
        pooled[k] = later > 0 ? stria_bench_median(p[k], reps * later) : 0;
    }
    for (int k = 0; k < RING_CFGS; k++)
        free(f[k]), free(p[k]);
    free(times);
    return rc;
}

/* ---- a small job through two services ------------------------------------------------ */

typedef struct {
    char coord[512];
    const char *token;
} svc_t;

typedef struct {
    stria_job_spec_t spec;
    void *q, *k, *v, *g, *o, *dq, *dk, *dv;
    float *lse;
} small_job_t;

static void small_job_init(small_job_t *j, int64_t seq, int ranks)
{
    const int64_t h = 4, d = 64;
    size_t n = (size_t)(seq * h * d);
    memset(j, 0, sizeof(*j));
    j->spec.struct_size = sizeof(j->spec);
    j->spec.batch = 1;
    j->spec.seq_len = seq;
    j->spec.heads = j->spec.kv_heads = h;
    j->spec.head_dim = d;
    j->spec.dtype = STRIA_DTYPE_F32;
    j->spec.causal = true;
    j->spec.ring_size = ranks;
    void **bufs[8] = {&j->q, &j->k, &j->v, &j->g, &j->o, &j->dq, &j->dk, &j->dv};
    for (int i = 0; i < 8; i++) {
        *bufs[i] = malloc(n * 4);
        stria_bench_fill(*bufs[i], STRIA_DTYPE_F32, n, (uint64_t)i + 1);
    }
    j->lse = malloc((size_t)(seq * h) * 4);
}

static void small_job_free(small_job_t *j)
{
    free(j->q), free(j->k), free(j->v), free(j->g), free(j->o), free(j->dq), free(j->dk);
    free(j->dv), free(j->lse);
}

/* One job with a new client: the connection's time and the job's. */
static stria_status_t run_small(const svc_t *s, small_job_t *j, double *connect_s, double *job_s)
{
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *c = NULL;
    stria_job_t *job = NULL;
    p.coordinator = s->coord;
    p.token = s->token;
    p.client_name = "stria-bench auth";
    double t0 = stria_time_now();
    stria_status_t st = stria_client_connect(&p, &c);
    double t1 = stria_time_now();
    if (st == STRIA_OK)
        st = stria_client_forward(c, &j->spec, j->q, j->k, j->v, j->o, j->lse, NULL, NULL, NULL,
                                  &job);
    if (st == STRIA_OK)
        st = stria_client_backward(job, j->g, j->dq, j->dk, j->dv, NULL, NULL, NULL);
    if (st == STRIA_OK)
        st = stria_client_release(job);
    else
        stria_client_release(job);
    double t2 = stria_time_now();
    stria_client_close(c);
    *connect_s = t1 - t0;
    *job_s = t2 - t1;
    return st;
}

/* Credential files (0600) in a fresh folder, for the secure service. */
static int write_creds(char *dir, size_t len, char paths[2][300], char tokens[2][80])
{
    snprintf(dir, len, "/tmp/stria-bench-auth-XXXXXX");
    if (mkdtemp(dir) == NULL)
        return -1;
    const char *names[2] = {"client-token", "worker-token"};
    for (int i = 0; i < 2; i++) {
        if (stria_auth_token_generate(tokens[i]) != STRIA_OK)
            return -1;
        snprintf(paths[i], sizeof(paths[i]), "%s/%s", dir, names[i]);
        FILE *f = fopen(paths[i], "w");
        if (f == NULL)
            return -1;
        fprintf(f, "%s\n", tokens[i]);
        fclose(f);
        chmod(paths[i], 0600);
    }
    return 0;
}

/* Medians [open, secure] of connect and job times; 0 on success. */
static int measure_service(const auth_cfg_t *c, double conn[2], double job[2])
{
    char dir[64], paths[2][300], tokens[2][80];
    svc_t s[2];
    memset(s, 0, sizeof(s));
    if (write_creds(dir, sizeof(dir), paths, tokens) != 0)
        return -1;
    stria_bench_creds_t cr = {paths[0], paths[1]};
    int rc = -1;
    if (stria_bench_daemons_start("auth", c->ranks, 1, s[0].coord, sizeof(s[0].coord)) != 0 ||
        stria_bench_daemons_start_creds("auth", c->ranks, 1, &cr, s[1].coord, sizeof(s[1].coord)) !=
            0)
        goto out;
    s[1].token = tokens[0];
    small_job_t j;
    small_job_init(&j, c->seq, c->ranks);
    double *t[2][2];
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < 2; m++)
            t[k][m] = calloc((size_t)c->reps, sizeof(double));
    stria_status_t st = STRIA_OK;
    double warm_c, warm_j;
    for (int k = 0; k < 2 && st == STRIA_OK; k++)
        st = run_small(&s[k], &j, &warm_c, &warm_j); /* first jobs: caches, the JIT of UCX */
    for (int r = 0; r < c->reps && st == STRIA_OK; r++)
        for (int k = 0; k < 2 && st == STRIA_OK; k++) {
            int which = (r % 2) ? 1 - k : k; /* alternate who goes first */
            st = run_small(&s[which], &j, &t[which][0][r], &t[which][1][r]);
        }
    if (st == STRIA_OK) {
        for (int k = 0; k < 2; k++) {
            conn[k] = stria_bench_median(t[k][0], c->reps);
            job[k] = stria_bench_median(t[k][1], c->reps);
        }
        rc = 0;
    } else {
        fprintf(stderr, "stria-bench auth: %s\n", stria_error_msg());
    }
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < 2; m++)
            free(t[k][m]);
    small_job_free(&j);
out:
    stria_bench_daemons_stop();
    unlink(paths[0]);
    unlink(paths[1]);
    rmdir(dir);
    return rc;
}

/* ---- the cryptography alone ---------------------------------------------------------- */

/* Seconds per job proof made and checked, and per hello (both MACs of both
 * sides and the session key of both). */
static void measure_crypto(double *proof_s, double *hello_s)
{
    stria_job_secret_t secret;
    stria_auth_session_t s;
    uint8_t mac[STRIA_AUTH_MAC_BYTES];
    int ok = 0;
    stria_job_secret_generate(&secret);
    stria_auth_random(&s, sizeof(s));
    const int n = 20000;
    double t0 = stria_time_now();
    for (int i = 0; i < n; i++) {
        stria_job_secret_prove(&secret, &s, (uint64_t)i, 1, 42, mac);
        ok += stria_job_secret_check(&secret, &s, (uint64_t)i, 1, 42, mac, sizeof(mac));
    }
    *proof_s = (stria_time_now() - t0) / n;
    t0 = stria_time_now();
    for (int i = 0; i < n; i++) {
        for (int side = 0; side < 2; side++) {
            stria_auth_hello_mac("0123456789abcdef0123456789abcdef", "stria.v1.Worker",
                                 s.client_nonce, s.server_nonce, side == 0, mac);
            stria_auth_hello_mac("0123456789abcdef0123456789abcdef", "stria.v1.Worker",
                                 s.client_nonce, s.server_nonce, side == 1, mac);
            stria_auth_session_derive(&s, "0123456789abcdef0123456789abcdef");
        }
    }
    *hello_s = (stria_time_now() - t0) / n;
    if (ok != n)
        fprintf(stderr, "stria-bench auth: %d of %d proofs did not check\n", n - ok, n);
}

/* ---- the command ---------------------------------------------------------------------- */

int stria_bench_auth(int argc, char **argv)
{
    auth_cfg_t c = {.json = false};
    int64_t reps = 0, ranks = 0, later = 0;
    const stria_option_t opts[] = {
        STRIA_OPTION("reps", INT, &reps, "R", "alternated runs of each, medians reported",
                     .dflt = "20", .min = 1, .max = 1000),
        STRIA_OPTION("ranks", INT, &ranks, "N",
                     "workers of each service (and ranks of the small job)", .dflt = "2", .min = 1,
                     .max = 16),
        STRIA_OPTION("later", INT, &later, "L",
                     "links after the first in each ring set-up round (binds on the pooled "
                     "endpoints)",
                     .dflt = "10", .min = 1, .max = 1000),
        STRIA_OPTION("seq", INT, &c.seq, "S",
                     "tokens of the small job (4 heads of 64, fp32, causal)", .dflt = "1024",
                     .min = 16, .max = 1 << 20),
        STRIA_OPTION("json", FLAG, &c.json, NULL, "one JSON object"),
        {.name = NULL},
    };
    const stria_command_t cmd = {.name = "auth", .description = auth_description, .options = opts};
    stria_cli_t cli;
    int prc = stria_bench_parse(&cmd, argc, argv, &cli);
    stria_cli_free(&cli);
    if (prc >= 0)
        return prc;
    c.reps = (int)reps;
    c.ranks = (int)ranks;
    c.later = (int)later;

    double first[RING_CFGS] = {0}, pooled[RING_CFGS] = {0}, conn[2] = {0}, job[2] = {0};
    double proof = 0, hello = 0;
    measure_crypto(&proof, &hello);
    if (measure_ring(c.reps, c.later, first, pooled) != 0) {
        fprintf(stderr, "stria-bench auth: the ring set-up failed\n");
        return 1;
    }
    if (measure_service(&c, conn, job) != 0)
        return 1;
    if (c.json) {
        printf("{\"name\":\"auth\",\"reps\":%d,\"ranks\":%d,\"seq\":%lld,\"later\":%d,"
               "\"ring\":[",
               c.reps, c.ranks, (long long)c.seq, c.later);
        for (int k = 0; k < RING_CFGS; k++)
            printf("%s{\"ranks\":%d,\"keys\":%s,\"first_link_s\":%.6f,\"later_link_s\":%.6f}",
                   k ? "," : "", ring_sizes[k], ring_keyed[k] ? "true" : "false", first[k],
                   pooled[k]);
        printf("],\"connect_open_s\":%.6f,\"connect_secure_s\":%.6f,"
               "\"job_open_s\":%.6f,\"job_secure_s\":%.6f,\"job_ratio\":%.4f,"
               "\"proof_s\":%.9f,\"hello_crypto_s\":%.9f}\n",
               conn[0], conn[1], job[0], job[1], job[1] / job[0], proof, hello);
        return 0;
    }
    printf("security costs, medians of %d alternated runs:\n"
           "  ring link set-up over UCX/tcp, ranks as processes on loopback (connect to READY,\n"
           "  the slowest rank; first: fresh contexts, endpoints made then a bind; later: %d\n"
           "  more links per round, a bind each on the pooled endpoints)\n"
           "    ranks  keys                 first link   later links\n",
           c.reps, c.later);
    for (int k = 0; k < RING_CFGS; k++)
        printf("    %5d  %-19s  %7.3f ms   %8.3f ms\n", ring_sizes[k],
               ring_keyed[k] ? "ring + endpoint key" : "none", first[k] * 1e3, pooled[k] * 1e3);
    printf("  small job (S=%lld, 4 heads x 64, fp32, causal, %d ranks: submit, forward,\n"
           "  backward, release; job secrets proven on every call of both)\n"
           "    no credentials       connect %7.3f ms   job %8.3f ms\n"
           "    credentials          connect %7.3f ms   job %8.3f ms   job ratio %.3f\n"
           "  cryptography on this CPU\n"
           "    a job proof made and checked        %6.2f us (every job-scoped call)\n"
           "    a hello's MACs and session keys     %6.2f us (every connection)\n",
           (long long)c.seq, c.ranks, conn[0] * 1e3, job[0] * 1e3, conn[1] * 1e3, job[1] * 1e3,
           job[1] / job[0], proof * 1e6, hello * 1e6);
    return 0;
}
