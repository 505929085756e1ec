/*
 * One rank of a UCX ring, for the transport tests: connects to its
 * neighbours (ports exchanged through files in --dir) and runs ring passes
 * like the ring engine's: at every step it sends its current block to the
 * successor and receives the next one from the predecessor, and checks that
 * every block holds its origin's pattern.
 *
 *   ucx_ring_rank --rank R --size N --dir DIR [options]
 *
 * With --mode engine it runs the ring engine instead: forward then backward
 * passes of the problem given by --engine (see ucx_engine_case.h), writing
 * its output shards (fp32 O, LSE, dQ, dK, dV) to out.R after the first.
 * With --mode listen it only starts listening (restart tests). With --mode
 * idle it connects, writes ready.R, waits for a file go.R in DIR and then
 * waits --step-timeout for a message nobody sends (a deadline with every rank
 * alive).
 *
 * With --mode links it connects --links links in a row over its one
 * context (ring ids --ring, --ring + 1, ...), runs one pass on each and
 * destroys it, writing res.R: the process's descriptors, threads, ready
 * endpoints and RssAnon after the first tenth ("warm") and at the end
 * ("end"). With --mode rings it does the same for the ring ids of --rings
 * (a comma-separated list), waiting for a file go.ID.R before ring
 * --go-before, writing done.ID.R after each, and with --hold stays (idle)
 * afterwards until killed (restart tests).
 *
 * With --key-seed N the ring link proves the ring key N stands for (every
 * rank of a ring must give the same N); with --endpoint-key-seed N the
 * context's endpoints prove the endpoint key N stands for;
 * --handshake-timeout and --max-pending set the context's limits on
 * endpoints that do not complete a handshake.
 *
 * Files in DIR: port.R (written once listening), ready.R (after the first
 * pass), result.R (at the end: "ok" or "err", the status name, the message),
 * stats.R (at the end: what the context counted, "dropped D refused R
 * timed_out T rejected J bind_refused B replayed P version V endpoints E
 * made M replaced X eps_dropped Y binds N late L").
 * Exit status: 0 ok, 1 ring error (reported in result.R), 2 usage.
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stria_auth.h"
#include "stria_transport.h"
#include "tucx.h"
#include "ucx_engine_case.h"

typedef struct {
    int rank, size;
    const char *dir;
    const char *listen_host;
    const char *next_host;
    int listen_port;
    int next_port; /* 0: read port.(R+1) */
    const char *tls;
    const char *net_devices;
    uint64_t job_id, ring_id;
    size_t bytes;
    int passes;
    double duration_s; /* > 0: loop passes until then (or an error) */
    double step_timeout_s;
    double connect_timeout_s;
    double heartbeat_s, stall_s; /* 0: the context's defaults */
    int late_recv_ms;
    const char *mode;
    const char *engine;
    int key_seed;    /* -1: no ring key */
    int ep_key_seed; /* -1: no endpoint key */
    double handshake_timeout_s;
    int max_pending;
    int links;         /* --mode links */
    const char *rings; /* --mode rings */
    int go_before;     /* --mode rings: wait for go.ID.R before this ring id */
    bool hold;         /* --mode rings: stay afterwards */
} opts_t;

static int write_file(const char *dir, const char *name, int rank, const char *text);

/* stats.R: what the context refused. */
static void write_stats(const opts_t *o, stria_ucx_ctx_t *ctx)
{
    stria_ucx_ctx_stats_t s;
    char text[256];
    stria_ucx_ctx_stats(ctx, &s);
    snprintf(text, sizeof(text),
             "dropped %llu refused %llu timed_out %llu rejected %llu bind_refused %llu replayed "
             "%llu version %llu endpoints %llu made %llu replaced %llu eps_dropped %llu binds %llu "
             "late %llu\n",
             (unsigned long long)s.data_dropped, (unsigned long long)s.handshakes_refused,
             (unsigned long long)s.handshakes_timed_out, (unsigned long long)s.connections_rejected,
             (unsigned long long)s.binds_refused, (unsigned long long)s.binds_replayed,
             (unsigned long long)s.version_refused, (unsigned long long)s.endpoints_open,
             (unsigned long long)s.endpoints_made, (unsigned long long)s.endpoints_replaced,
             (unsigned long long)s.endpoints_dropped, (unsigned long long)s.binds_done,
             (unsigned long long)s.data_late);
    write_file(o->dir, "stats", o->rank, text);
}

/* The process's open descriptors, threads and RssAnon (kB), and the
 * context's ready endpoints, as one line after `label`. */
static void resources(stria_ucx_ctx_t *ctx, const char *label, char *out, size_t len)
{
    int fds = 0, threads = 0;
    long rss = -1;
    DIR *d = opendir("/proc/self/fd");
    for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;)
        fds += e->d_name[0] != '.';
    if (d != NULL)
        closedir(d);
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, "Threads:", 8) == 0)
            threads = atoi(line + 8);
        else if (strncmp(line, "RssAnon:", 8) == 0)
            rss = atol(line + 8);
    }
    if (f != NULL)
        fclose(f);
    stria_ucx_ctx_stats_t s;
    stria_ucx_ctx_stats(ctx, &s);
    snprintf(out, len, "%s fds %d threads %d endpoints %llu rss %ld\n", label, fds - 1, threads,
             (unsigned long long)s.endpoints_open, rss);
}

static void usage(void)
{
    fprintf(stderr,
            "usage: ucx_ring_rank --rank R --size N --dir DIR [--listen-host H] [--port P]\n"
            "       [--next-host H] [--next-port P] [--tls T] [--net-devices D] [--job J]\n"
            "       [--ring G] [--bytes B] [--passes P] [--duration S] [--step-timeout S]\n"
            "       [--connect-timeout S] [--heartbeat S] [--stall S] [--late-recv MS]\n"
            "       [--mode ring|engine|listen|idle|links|rings] [--key-seed N]\n"
            "       [--endpoint-key-seed N] [--handshake-timeout S] [--max-pending N]\n"
            "       [--links N] [--rings ID,ID,...] [--go-before ID] [--hold]\n"
            "       [--engine B:S:H:HKV:D:CAUSAL:DTYPE:LAYOUT:SEED]\n");
}

static int write_file(const char *dir, const char *name, int rank, const char *text)
{
    char path[4096], tmp[4200];
    snprintf(path, sizeof(path), "%s/%s.%d", dir, name, rank);
    snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (f == NULL)
        return -1;
    fputs(text, f);
    if (fclose(f) != 0 || rename(tmp, path) != 0)
        return -1;
    return 0;
}

/* Polls DIR/port.RANK until it exists or the deadline passes. */
static int read_port(const char *dir, int rank, double deadline)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/port.%d", dir, rank);
    while (stria_time_now() < deadline) {
        FILE *f = fopen(path, "r");
        if (f != NULL) {
            int port = 0;
            int n = fscanf(f, "%d", &port);
            fclose(f);
            if (n == 1 && port > 0 && port < 65536)
                return port;
        }
        usleep(10000);
    }
    return -1;
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint8_t pattern(uint64_t seed, size_t i)
{
    return (uint8_t)(mix(seed + i / 8) >> (8 * (i % 8)));
}

static void fill(uint8_t *buf, size_t n, int origin, int pass)
{
    uint64_t seed = mix(((uint64_t)origin << 32) | (uint64_t)pass);
    for (size_t i = 0; i < n; i++)
        buf[i] = pattern(seed, i);
}

static int check(const uint8_t *buf, size_t n, int origin, int pass, size_t *bad_at)
{
    uint64_t seed = mix(((uint64_t)origin << 32) | (uint64_t)pass);
    for (size_t i = 0; i < n; i++)
        if (buf[i] != pattern(seed, i)) {
            *bad_at = i;
            return -1;
        }
    return 0;
}

static uint64_t tag_of(int pass, int step)
{
    /* High bits set on purpose: the link must carry full 64-bit tags. */
    return 0xA5A5000000000000ull | ((uint64_t)(uint32_t)pass << 16) | (uint64_t)step;
}

/* One ring pass; on error *req_left holds requests still to release. */
static stria_status_t ring_pass(stria_link_t *link, const opts_t *o, int pass, uint8_t *bufs[2],
                                stria_link_req_t **reqs)
{
    int r = o->rank, n = o->size;
    int cur = 0;
    stria_status_t st;
    fill(bufs[cur], o->bytes, r, pass);
    for (int s = 0; s < n - 1; s++) {
        uint64_t tag = tag_of(pass, s);
        if (o->late_recv_ms > 0) {
            if ((st = stria_link_isend(link, tag, bufs[cur], o->bytes, &reqs[0])) != STRIA_OK)
                return st;
            usleep((useconds_t)o->late_recv_ms * 1000);
            if ((st = stria_link_irecv(link, tag, bufs[1 - cur], o->bytes, &reqs[1])) != STRIA_OK)
                return st;
        } else {
            if ((st = stria_link_irecv(link, tag, bufs[1 - cur], o->bytes, &reqs[1])) != STRIA_OK)
                return st;
            if ((st = stria_link_isend(link, tag, bufs[cur], o->bytes, &reqs[0])) != STRIA_OK)
                return st;
        }
        stria_link_req_t *send = reqs[0];
        reqs[0] = NULL;
        if ((st = stria_link_wait(link, send, o->step_timeout_s)) != STRIA_OK)
            return st;
        stria_link_req_t *recv = reqs[1];
        reqs[1] = NULL;
        if ((st = stria_link_wait(link, recv, o->step_timeout_s)) != STRIA_OK)
            return st;
        int origin = (r - s - 1 + n) % n;
        size_t bad;
        if (check(bufs[1 - cur], o->bytes, origin, pass, &bad) != 0)
            return stria_error_set(STRIA_ERR_INTERNAL,
                                   "pass %d step %d: block from rank %d differs at byte %zu", pass,
                                   s, origin, bad);
        cur = 1 - cur;
    }
    return STRIA_OK;
}

typedef struct {
    void *q, *k, *v, *d_o;         /* shards in the storage dtype */
    float *o, *lse, *dq, *dk, *dv; /* fp32 output shards */
    size_t nq, nk, nl;
} shards_t;

static void shards_free(shards_t *s)
{
    void *all[] = {s->q, s->k, s->v, s->d_o, s->o, s->lse, s->dq, s->dk, s->dv};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        free(all[i]);
}

static stria_status_t write_outputs(const opts_t *o, const shards_t *s)
{
    char path[4096], tmp[4200];
    snprintf(path, sizeof(path), "%s/out.%d", o->dir, o->rank);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (f == NULL)
        return stria_error_set(STRIA_ERR_IO, "%s: %s", tmp, strerror(errno));
    bool ok = fwrite(s->o, 4, s->nq, f) == s->nq && fwrite(s->lse, 4, s->nl, f) == s->nl &&
              fwrite(s->dq, 4, s->nq, f) == s->nq && fwrite(s->dk, 4, s->nk, f) == s->nk &&
              fwrite(s->dv, 4, s->nk, f) == s->nk;
    if (fclose(f) != 0 || !ok || rename(tmp, path) != 0)
        return stria_error_set(STRIA_ERR_IO, "cannot write %s", path);
    return STRIA_OK;
}

/* Forward and backward passes of the ring engine over the link. */
static stria_status_t run_engine(stria_link_t *link, const opts_t *o)
{
    engine_case_t c;
    if (o->engine == NULL || engine_case_parse(o->engine, &c) != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "--mode engine needs a valid --engine");
    stria_ring_shape_t shape = engine_case_shape(&c);
    stria_ring_opts_t ro = {.step_timeout_s = o->step_timeout_s};
    stria_ring_pass_t *pass = NULL;
    stria_status_t st = stria_ring_pass_create(link, &shape, c.layout, &ro, &pass);
    if (st != STRIA_OK)
        return st;
    const stria_layout_t *lay = stria_ring_pass_layout(pass);
    int64_t L = lay->shard_tokens;
    size_t es = stria_dtype_size(c.dtype);
    size_t qrow = (size_t)(c.heads * c.head_dim), krow = (size_t)(c.kv_heads * c.head_dim);
    shards_t s = {.nq = (size_t)(c.batch * L) * qrow,
                  .nk = (size_t)(c.batch * L) * krow,
                  .nl = (size_t)(c.batch * c.heads * L)};
    engine_inputs_t in;
    engine_inputs_make(&c, &in);
    s.q = malloc(s.nq * es), s.k = malloc(s.nk * es), s.v = malloc(s.nk * es);
    s.d_o = malloc(s.nq * es);
    s.o = malloc(s.nq * 4), s.lse = malloc(s.nl * 4), s.dq = malloc(s.nq * 4);
    s.dk = malloc(s.nk * 4), s.dv = malloc(s.nk * 4);
    if (in.q == NULL || in.k == NULL || in.v == NULL || in.d_o == NULL || s.q == NULL ||
        s.k == NULL || s.v == NULL || s.d_o == NULL || s.o == NULL || s.lse == NULL ||
        s.dq == NULL || s.dk == NULL || s.dv == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    if ((st = stria_layout_scatter(lay, o->rank, c.batch, qrow * es, in.q, s.q)) != STRIA_OK ||
        (st = stria_layout_scatter(lay, o->rank, c.batch, krow * es, in.k, s.k)) != STRIA_OK ||
        (st = stria_layout_scatter(lay, o->rank, c.batch, krow * es, in.v, s.v)) != STRIA_OK ||
        (st = stria_layout_scatter(lay, o->rank, c.batch, qrow * es, in.d_o, s.d_o)) != STRIA_OK)
        goto out;
    stria_tensor_t tq = stria_tensor_contiguous(s.q, c.dtype, L, c.heads, c.head_dim);
    stria_tensor_t tk = stria_tensor_contiguous(s.k, c.dtype, L, c.kv_heads, c.head_dim);
    stria_tensor_t tv = stria_tensor_contiguous(s.v, c.dtype, L, c.kv_heads, c.head_dim);
    stria_tensor_t tdo = stria_tensor_contiguous(s.d_o, c.dtype, L, c.heads, c.head_dim);
    stria_tensor_t to = stria_tensor_contiguous(s.o, STRIA_DTYPE_F32, L, c.heads, c.head_dim);
    stria_tensor_t tdq = stria_tensor_contiguous(s.dq, STRIA_DTYPE_F32, L, c.heads, c.head_dim);
    stria_tensor_t tdk = stria_tensor_contiguous(s.dk, STRIA_DTYPE_F32, L, c.kv_heads, c.head_dim);
    stria_tensor_t tdv = stria_tensor_contiguous(s.dv, STRIA_DTYPE_F32, L, c.kv_heads, c.head_dim);
    double end = stria_time_now() + o->duration_s;
    for (int p = 0; o->duration_s > 0 ? stria_time_now() < end : p < o->passes; p++) {
        if ((st = stria_ring_fwd(pass, &tq, &tk, &tv, &to, s.lse)) != STRIA_OK ||
            (st = stria_ring_bwd(pass, &tq, &tk, &tv, &to, s.lse, &tdo, &tdq, &tdk, &tdv)) !=
                STRIA_OK)
            break;
        if (p == 0) {
            if ((st = write_outputs(o, &s)) != STRIA_OK)
                break;
            write_file(o->dir, "ready", o->rank, "1\n");
        }
    }
out:
    engine_inputs_free(&in);
    shards_free(&s);
    stria_ring_pass_destroy(pass);
    return st;
}

/* One link of a sequence: connect, one pass, destroy. */
static stria_status_t one_link(stria_ucx_ctx_t *ctx, const opts_t *o, stria_ucx_link_params_t *lp,
                               int pass, uint8_t *bufs[2])
{
    stria_link_t *link = NULL;
    stria_link_req_t *reqs[2] = {NULL, NULL};
    stria_status_t st = stria_link_ucx_connect(ctx, lp, &link);
    if (st != STRIA_OK)
        return st;
    st = ring_pass(link, o, pass, bufs, reqs);
    if (st != STRIA_OK) {
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria_link_abort(link, st, msg);
        stria_link_cancel(link, reqs[0]);
        stria_link_cancel(link, reqs[1]);
        stria_link_destroy(link);
        return stria_error_set(st, "%s", msg);
    }
    stria_link_destroy(link);
    return STRIA_OK;
}

/* Waits (up to two minutes) for DIR/NAME.ID.RANK. */
static void wait_go(const opts_t *o, const char *name, long id)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s.%ld.%d", o->dir, name, id, o->rank);
    double until = stria_time_now() + 120;
    while (access(path, F_OK) != 0 && stria_time_now() < until)
        usleep(5000);
}

/* --mode links and --mode rings: links one after the other on one context. */
static stria_status_t run_sequence(stria_ucx_ctx_t *ctx, const opts_t *o,
                                   stria_ucx_link_params_t *lp)
{
    uint8_t *bufs[2] = {malloc(o->bytes), malloc(o->bytes)};
    stria_status_t st = STRIA_OK;
    char res[512] = "";
    if (bufs[0] == NULL || bufs[1] == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    } else if (strcmp(o->mode, "links") == 0) {
        int warm = o->links / 10 > 0 ? o->links / 10 : 1;
        for (int i = 0; i < o->links && st == STRIA_OK; i++) {
            lp->ring_id = o->ring_id + (uint64_t)i;
            if ((st = one_link(ctx, o, lp, i, bufs)) != STRIA_OK)
                st = stria_error_wrap(st, "link %d of %d", i + 1, o->links);
            else if (i + 1 == warm)
                resources(ctx, "warm", res, sizeof(res));
        }
        size_t n = strlen(res);
        resources(ctx, "end", res + n, sizeof(res) - n);
        write_file(o->dir, "res", o->rank, res);
    } else {
        char list[256];
        snprintf(list, sizeof(list), "%s", o->rings != NULL ? o->rings : "1");
        char *save = NULL;
        for (char *t = strtok_r(list, ",", &save); t != NULL && st == STRIA_OK;
             t = strtok_r(NULL, ",", &save)) {
            long id = atol(t);
            if (id == o->go_before)
                wait_go(o, "go", id);
            lp->ring_id = (uint64_t)id;
            if ((st = one_link(ctx, o, lp, (int)id, bufs)) != STRIA_OK)
                st = stria_error_wrap(st, "ring %ld", id);
            else {
                char name[32];
                snprintf(name, sizeof(name), "done.%ld", id);
                write_file(o->dir, name, o->rank, "1\n");
            }
        }
        write_stats(o, ctx);
        if (o->hold && st == STRIA_OK)
            wait_go(o, "never", 0);
    }
    free(bufs[0]);
    free(bufs[1]);
    return st;
}

static int finish(const opts_t *o, stria_status_t st, const char *msg)
{
    char text[2048];
    if (st == STRIA_OK)
        snprintf(text, sizeof(text), "ok\nSTRIA_OK\n\n");
    else
        snprintf(text, sizeof(text), "err\n%s\n%s\n", stria_status_name(st), msg);
    if (o->dir != NULL)
        write_file(o->dir, "result", o->rank, text);
    if (st != STRIA_OK)
        fprintf(stderr, "ucx_ring_rank %d: %s: %s\n", o->rank, stria_status_name(st), msg);
    return st == STRIA_OK ? 0 : 1;
}

int main(int argc, char **argv)
{
    opts_t o = {.rank = -1,
                .size = 0,
                .next_host = "127.0.0.1",
                .job_id = 1,
                .ring_id = 1,
                .bytes = 4096,
                .passes = 1,
                .step_timeout_s = 10,
                .connect_timeout_s = 10,
                .mode = "ring",
                .key_seed = -1,
                .ep_key_seed = -1,
                .links = 100,
                .go_before = -1};
    const tucx_opt_t opts[] = {{"rank", TUCX_INT, &o.rank},
                               {"size", TUCX_INT, &o.size},
                               {"dir", TUCX_STR, &o.dir},
                               {"listen-host", TUCX_STR, &o.listen_host},
                               {"port", TUCX_INT, &o.listen_port},
                               {"next-host", TUCX_STR, &o.next_host},
                               {"next-port", TUCX_INT, &o.next_port},
                               {"tls", TUCX_STR, &o.tls},
                               {"net-devices", TUCX_STR, &o.net_devices},
                               {"job", TUCX_U64, &o.job_id},
                               {"ring", TUCX_U64, &o.ring_id},
                               {"bytes", TUCX_SIZE, &o.bytes},
                               {"passes", TUCX_INT, &o.passes},
                               {"duration", TUCX_DOUBLE, &o.duration_s},
                               {"step-timeout", TUCX_DOUBLE, &o.step_timeout_s},
                               {"connect-timeout", TUCX_DOUBLE, &o.connect_timeout_s},
                               {"late-recv", TUCX_INT, &o.late_recv_ms},
                               {"mode", TUCX_STR, &o.mode},
                               {"engine", TUCX_STR, &o.engine},
                               {"heartbeat", TUCX_DOUBLE, &o.heartbeat_s},
                               {"stall", TUCX_DOUBLE, &o.stall_s},
                               {"key-seed", TUCX_INT, &o.key_seed},
                               {"endpoint-key-seed", TUCX_INT, &o.ep_key_seed},
                               {"handshake-timeout", TUCX_DOUBLE, &o.handshake_timeout_s},
                               {"max-pending", TUCX_INT, &o.max_pending},
                               {"links", TUCX_INT, &o.links},
                               {"rings", TUCX_STR, &o.rings},
                               {"go-before", TUCX_INT, &o.go_before},
                               {"hold", TUCX_FLAG, &o.hold},
                               {NULL, 0, NULL}};
    if (!tucx_parse(argc, argv, opts)) {
        usage();
        return 2;
    }
    if (o.rank < 0 || o.size < 1 || o.rank >= o.size || o.dir == NULL || o.bytes == 0 ||
        o.listen_port < 0 || o.listen_port > 65535 || o.next_port < 0 || o.next_port > 65535) {
        usage();
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);

    stria_ucx_ctx_params_t cp = {.listen_host = o.listen_host,
                                 .listen_port = (uint16_t)o.listen_port,
                                 .tls = o.tls,
                                 .net_devices = o.net_devices,
                                 .heartbeat_s = o.heartbeat_s,
                                 .stall_s = o.stall_s,
                                 .handshake_timeout_s = o.handshake_timeout_s,
                                 .max_pending_per_source = o.max_pending};
    uint8_t ep_key[STRIA_AUTH_KEY_BYTES];
    if (o.ep_key_seed >= 0) {
        tucx_key_of_seed(o.ep_key_seed, ep_key);
        cp.endpoint_key = ep_key;
    }
    stria_ucx_ctx_t *ctx = NULL;
    stria_status_t st = stria_ucx_ctx_create(&cp, &ctx);
    if (st != STRIA_OK)
        return finish(&o, st, stria_error_msg());
    char port_s[16];
    snprintf(port_s, sizeof(port_s), "%u\n", (unsigned)stria_ucx_ctx_port(ctx));
    if (write_file(o.dir, "port", o.rank, port_s) != 0) {
        stria_ucx_ctx_destroy(ctx);
        return finish(&o, STRIA_ERR_IO, strerror(errno));
    }
    if (strcmp(o.mode, "listen") == 0) {
        stria_ucx_ctx_destroy(ctx);
        return finish(&o, STRIA_OK, "");
    }

    double t0 = stria_time_now();
    int next = (o.rank + 1) % o.size;
    int next_port =
        o.next_port > 0 ? o.next_port : read_port(o.dir, next, t0 + o.connect_timeout_s);
    if (next_port < 0) {
        stria_ucx_ctx_destroy(ctx);
        return finish(&o, STRIA_ERR_TIMEOUT, "no port file from the successor");
    }
    stria_ucx_link_params_t lp = {.job_id = o.job_id,
                                  .ring_id = o.ring_id,
                                  .rank = o.rank,
                                  .size = o.size,
                                  .next_host = o.next_host,
                                  .next_port = (uint16_t)next_port,
                                  .connect_timeout_s = o.connect_timeout_s};
    uint8_t key[STRIA_AUTH_KEY_BYTES];
    if (o.key_seed >= 0) {
        tucx_key_of_seed(o.key_seed, key);
        lp.key = key;
    }
    if (strcmp(o.mode, "links") == 0 || strcmp(o.mode, "rings") == 0) {
        char msg[1024] = "";
        if ((st = run_sequence(ctx, &o, &lp)) != STRIA_OK)
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        write_stats(&o, ctx);
        stria_ucx_ctx_destroy(ctx);
        return finish(&o, st, msg);
    }
    stria_link_t *link = NULL;
    st = stria_link_ucx_connect(ctx, &lp, &link);
    if (st != STRIA_OK) {
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        write_stats(&o, ctx);
        stria_ucx_ctx_destroy(ctx);
        return finish(&o, st, msg);
    }

    uint8_t *bufs[2] = {NULL, NULL};
    stria_link_req_t *reqs[2] = {NULL, NULL};
    char msg[1024] = "";
    if (strcmp(o.mode, "engine") == 0) {
        /* The engine aborts the link and releases its requests itself. */
        st = run_engine(link, &o);
        if (st != STRIA_OK)
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria_link_destroy(link);
        write_stats(&o, ctx);
        stria_ucx_ctx_destroy(ctx);
        return finish(&o, st, msg);
    }
    bufs[0] = malloc(o.bytes);
    bufs[1] = malloc(o.bytes);
    if (bufs[0] == NULL || bufs[1] == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    } else if (strcmp(o.mode, "idle") == 0) {
        write_file(o.dir, "ready", o.rank, "1\n");
        char go[4096];
        snprintf(go, sizeof(go), "%s/go.%d", o.dir, o.rank);
        double until = stria_time_now() + 120;
        while (access(go, F_OK) != 0 && stria_time_now() < until)
            usleep(10000);
        st = stria_link_irecv(link, 1, bufs[1], 8, &reqs[1]);
        if (st == STRIA_OK) {
            stria_link_req_t *recv = reqs[1];
            reqs[1] = NULL;
            st = stria_link_wait(link, recv, o.step_timeout_s);
        }
        if (st == STRIA_OK)
            st = stria_error_set(STRIA_ERR_INTERNAL, "a message nobody sent arrived");
    } else {
        double end = stria_time_now() + o.duration_s;
        for (int p = 0; o.duration_s > 0 ? stria_time_now() < end : p < o.passes; p++) {
            st = ring_pass(link, &o, p, bufs, reqs);
            if (st != STRIA_OK)
                break;
            if (p == 0)
                write_file(o.dir, "ready", o.rank, "1\n");
        }
    }
    if (st != STRIA_OK) {
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        /* As the ring engine does: tell the others, then release everything. */
        stria_link_abort(link, st, msg);
        stria_link_cancel(link, reqs[0]);
        stria_link_cancel(link, reqs[1]);
    }
    stria_link_destroy(link);
    write_stats(&o, ctx);
    stria_ucx_ctx_destroy(ctx);
    free(bufs[0]);
    free(bufs[1]);
    return finish(&o, st, msg);
}
