/* UCX link suite, rings of processes: real ranks (ucx_ring_rank) pass
 * around a ring on loopback over each transport choice, run the ring engine
 * over UCX against the in-process one, and run in two network namespaces
 * joined by a veth pair, whose cable is then cut. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include "ucx_test_util.h"

/* ---- ring passes between processes --------------------------------------- */

typedef struct {
    int size;
    int tls;
    size_t bytes;
    int late_recv_ms;
} ring_case_t;

ParameterizedTestParameters(ucx, process_ring)
{
    static ring_case_t cases[] = {
        {2, TLS_TCP, 300000, 0},     {3, TLS_TCP, 300000, 0},  {4, TLS_TCP, 300000, 0},
        {2, TLS_SHM, 300000, 0},     {3, TLS_SHM, 300000, 0},  {4, TLS_SHM, 300000, 0},
        {3, TLS_TCP, 1000, 0},       {2, TLS_TCP, 300000, 50}, {2, TLS_SHM, 1000, 50},
        {3, TLS_DEFAULT, 300000, 0},
    };
    return cr_make_param_array(ring_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(ring_case_t *c, ucx, process_ring, .init = setup, .fini = teardown, .timeout = 60)
{
    pid_t pids[8];
    rank_args_t a = {
        .tls = tls_names[c->tls], .bytes = c->bytes, .passes = 3, .late_recv_ms = c->late_recv_ms};
    for (int r = 0; r < c->size; r++)
        pids[r] = spawn_rank(r, c->size, &a);
    for (int r = 0; r < c->size; r++) {
        int status = reap(pids[r], 40);
        result_t res = read_result(r);
        cr_assert(res.present, "ring of %d over %s: rank %d wrote no result (status %d); log:\n%s",
                  c->size, tls_labels[c->tls], r, status, rank_log(r));
        cr_expect(res.ok, "ring of %d over %s, %zu bytes: rank %d: %s: %s", c->size,
                  tls_labels[c->tls], c->bytes, r, res.status, res.msg);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "rank %d exit status %d", r, status);
    }
}

/* ---- the ring engine over UCX -------------------------------------------- */

typedef struct {
    int size;
    int tls;
    int64_t seq, heads, kv_heads, head_dim;
    int causal;
    stria_dtype_t dtype;
    stria_layout_kind_t layout;
} engine_test_t;

ParameterizedTestParameters(ucx, engine_matches_inproc)
{
    static engine_test_t cases[] = {
        {2, TLS_TCP, 64, 2, 2, 32, 1, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED},
        {3, TLS_TCP, 100, 4, 2, 32, 1, STRIA_DTYPE_BF16, STRIA_LAYOUT_STRIPED},
        {4, TLS_TCP, 90, 2, 1, 16, 1, STRIA_DTYPE_F32, STRIA_LAYOUT_ZIGZAG},
        {2, TLS_SHM, 77, 2, 2, 32, 0, STRIA_DTYPE_F32, STRIA_LAYOUT_CONTIGUOUS},
        {3, TLS_SHM, 96, 4, 4, 16, 1, STRIA_DTYPE_F16, STRIA_LAYOUT_STRIPED},
        {4, TLS_SHM, 128, 2, 2, 32, 1, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED},
    };
    return cr_make_param_array(engine_test_t, cases, sizeof(cases) / sizeof(cases[0]));
}

static void *read_all(const char *path, size_t want)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    void *buf = malloc(want + 1);
    size_t got = fread(buf, 1, want + 1, f);
    fclose(f);
    cr_assert_eq(got, want, "%s has %zu bytes, expected %zu", path, got, want);
    return buf;
}

static void expect_same(const char *what, const float *ucx, const float *ref, size_t n,
                        const engine_test_t *t)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&ucx[i], &ref[i], sizeof(float)) != 0) {
            cr_expect(false,
                      "%s differs from the in-process ring at element %zu of %zu: %.9g vs %.9g "
                      "(ring of %d over %s, %s %s)",
                      what, i, n, (double)ucx[i], (double)ref[i], t->size, tls_labels[t->tls],
                      stria_layout_kind_name(t->layout), stria_dtype_name(t->dtype));
            return;
        }
}

/* Forward and backward passes of the ring engine between processes over
 * UCX give the same bits as the in-process link on the same inputs. */
ParameterizedTest(engine_test_t *t, ucx, engine_matches_inproc, .init = setup, .fini = teardown,
                  .timeout = 120)
{
    engine_case_t c = {.batch = 1,
                       .seq = t->seq,
                       .heads = t->heads,
                       .kv_heads = t->kv_heads,
                       .head_dim = t->head_dim,
                       .causal = t->causal,
                       .dtype = t->dtype,
                       .layout = t->layout,
                       .seed = 11};
    char spec[200];
    engine_case_format(&c, spec, sizeof(spec));
    rank_args_t a = {.tls = tls_names[t->tls], .mode = "engine", .engine = spec, .passes = 1};
    pid_t pids[8];
    for (int r = 0; r < t->size; r++)
        pids[r] = spawn_rank(r, t->size, &a);

    /* The same problem on the in-process link, meanwhile. */
    stria_ring_shape_t shape = engine_case_shape(&c);
    engine_inputs_t in;
    engine_inputs_make(&c, &in);
    size_t nq = (size_t)(c.seq * c.heads * c.head_dim),
           nk = (size_t)(c.seq * c.kv_heads * c.head_dim);
    size_t nl = (size_t)(c.heads * c.seq);
    float *ref[5] = {malloc(nq * 4), malloc(nl * 4), malloc(nq * 4), malloc(nk * 4),
                     malloc(nk * 4)};
    stria_ring_local_opts_t lo = {
        .layout = c.layout, .n_ranks = t->size, .passes = STRIA_RING_PASS_FWD_BWD};
    stria_ring_local_io_t io = {.q = in.q,
                                .k = in.k,
                                .v = in.v,
                                .o = ref[0],
                                .o_dtype = STRIA_DTYPE_F32,
                                .lse = ref[1],
                                .d_o = in.d_o,
                                .dq = ref[2],
                                .dk = ref[3],
                                .dv = ref[4],
                                .grad_dtype = STRIA_DTYPE_F32};
    cr_assert_eq(stria_ring_run_local(&shape, &lo, &io, NULL), STRIA_OK, "%s", stria_error_msg());

    for (int r = 0; r < t->size; r++) {
        int status = reap(pids[r], 90);
        result_t res = read_result(r);
        cr_assert(res.present, "rank %d wrote no result (status %d); log:\n%s", r, status,
                  rank_log(r));
        cr_assert(res.ok, "rank %d: %s: %s", r, res.status, res.msg);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "rank %d exit status %d; log:\n%s", r, status, rank_log(r));
    }
    stria_layout_t lay;
    cr_assert_eq(stria_layout_init(c.layout, t->size, c.seq, &lay), STRIA_OK);
    size_t L = (size_t)lay.shard_tokens;
    size_t sq = L * (size_t)(c.heads * c.head_dim), sk = L * (size_t)(c.kv_heads * c.head_dim);
    size_t sl = L * (size_t)c.heads;
    float *full[5] = {malloc(nq * 4), malloc(nl * 4), malloc(nq * 4), malloc(nk * 4),
                      malloc(nk * 4)};
    for (int r = 0; r < t->size; r++) {
        char path[400];
        snprintf(path, sizeof(path), "%s/out.%d", workdir, r);
        float *shard = read_all(path, (2 * sq + sl + 2 * sk) * 4);
        const float *part[5] = {shard, shard + sq, shard + sq + sl, shard + 2 * sq + sl,
                                shard + 2 * sq + sl + sk};
        const size_t row[5] = {
            (size_t)(c.heads * c.head_dim) * 4, 4, (size_t)(c.heads * c.head_dim) * 4,
            (size_t)(c.kv_heads * c.head_dim) * 4, (size_t)(c.kv_heads * c.head_dim) * 4};
        const int64_t outer[5] = {1, c.heads, 1, 1, 1};
        for (int i = 0; i < 5; i++)
            cr_assert_eq(stria_layout_gather(&lay, r, outer[i], row[i], part[i], full[i]),
                         STRIA_OK);
        free(shard);
    }
    const char *names[5] = {"O", "LSE", "dQ", "dK", "dV"};
    const size_t counts[5] = {nq, nl, nq, nk, nk};
    for (int i = 0; i < 5; i++) {
        expect_same(names[i], full[i], ref[i], counts[i], t);
        free(full[i]);
        free(ref[i]);
    }
    engine_inputs_free(&in);
}

/* ---- two hosts: network namespaces (tests/common/netns.h) ----------------- */

static test_hosts_t net;

static void netns_teardown(void)
{
    kill_children();
    test_hosts_destroy(&net);
    teardown();
}

/* Called first in the test body (a skip from a fixture is not reported). */
static void netns_setup(void)
{
    const char *why = test_hosts_create(&net, 2);
    if (why != NULL) {
        netns_teardown();
        cr_skip_test("two-host tests skipped: network namespaces cannot be made here (%s)", why);
    }
}

static void spawn_netns_ring(double duration_s, double step_timeout_s, pid_t pids[2])
{
    for (int r = 0; r < 2; r++) {
        rank_args_t a = {.netns = net.ns[r],
                         .tls = "tcp",
                         .net_devices = net.dev[r],
                         .listen_host = net.addr[r],
                         .next_host = net.addr[1 - r],
                         .bytes = 300000,
                         .passes = 3,
                         .duration_s = duration_s,
                         .step_timeout_s = step_timeout_s};
        pids[r] = spawn_rank(r, 2, &a);
    }
}

/* Ranks in two namespaces, each listening on its own veth address. */
Test(ucx, two_hosts_ring, .init = setup, .fini = netns_teardown, .timeout = 60)
{
    netns_setup();
    pid_t pids[2];
    spawn_netns_ring(0, 10, pids);
    for (int r = 0; r < 2; r++) {
        int status = reap(pids[r], 40);
        result_t res = read_result(r);
        cr_assert(res.present, "rank %d wrote no result (status %d); log:\n%s", r, status,
                  rank_log(r));
        cr_expect(res.ok, "rank %d: %s: %s", r, res.status, res.msg);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "rank %d exit status %d", r, status);
    }
}

/* The cable is cut (veth down) mid-pass: a clear error on both sides, no
 * hang. */
Test(ucx, two_hosts_cut_link, .init = setup, .fini = netns_teardown, .timeout = 60)
{
    netns_setup();
    pid_t pids[2];
    spawn_netns_ring(30, 1.0, pids);
    wait_file("ready", 0, 30);
    wait_file("ready", 1, 30);
    double t0 = stria_time_now();
    cr_assert_eq(test_hosts_link(&net, 1, false), 0);
    for (int r = 0; r < 2; r++) {
        result_t res = wait_result(r, 15);
        double dt = stria_time_now() - t0;
        cr_assert(res.present, "rank %d did not report the cut link", r);
        cr_expect(!res.ok);
        cr_expect(dt < 5.0, "rank %d took %.2f s", r, dt);
        cr_expect(strstr(res.msg, "rank ") != NULL, "rank %d: unclear error: %s: %s", r, res.status,
                  res.msg);
        int status = reap(pids[r], 5);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1,
                  "rank %d did not exit cleanly (status %d)", r, status);
    }
}
