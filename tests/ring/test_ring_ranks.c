/* Ring engine suite, the per-rank API over hand-made threads: determinism
 * under a jittery link, a failing rank failing every rank, the staged device
 * against the host path, deadlines, bad tensors, shapes and options. */
#include <criterion/criterion.h>

#include "ring_test_util.h"

/* ---- per-rank API over hand-made threads ---------------------------------- */

/* A link that forwards to another link after random short sleeps, so that
 * messages complete in a different order and at different times on every
 * run: the results must not change by a single bit. */
typedef struct {
    stria_link_t base;
    stria_link_t *inner;
    uint64_t rng;
} jitter_link_t;

static void jitter(jitter_link_t *j)
{
    j->rng ^= j->rng << 13;
    j->rng ^= j->rng >> 7;
    j->rng ^= j->rng << 17;
    struct timespec ts = {0, (long)(j->rng % 3000) * 1000};
    nanosleep(&ts, NULL);
}

static stria_status_t jit_isend(stria_link_t *l, uint64_t tag, const void *buf, size_t len,
                                stria_link_req_t **req)
{
    jitter((jitter_link_t *)l);
    return stria_link_isend(((jitter_link_t *)l)->inner, tag, buf, len, req);
}
static stria_status_t jit_irecv(stria_link_t *l, uint64_t tag, void *buf, size_t len,
                                stria_link_req_t **req)
{
    jitter((jitter_link_t *)l);
    return stria_link_irecv(((jitter_link_t *)l)->inner, tag, buf, len, req);
}
static stria_status_t jit_wait(stria_link_t *l, stria_link_req_t *req, double t)
{
    jitter((jitter_link_t *)l);
    return stria_link_wait(((jitter_link_t *)l)->inner, req, t);
}
static void jit_cancel(stria_link_t *l, stria_link_req_t *req)
{
    stria_link_cancel(((jitter_link_t *)l)->inner, req);
}
static void jit_abort(stria_link_t *l, stria_status_t reason, const char *msg)
{
    stria_link_abort(((jitter_link_t *)l)->inner, reason, msg);
}
static void jit_destroy(stria_link_t *l)
{
    stria_link_destroy(((jitter_link_t *)l)->inner);
    free(l);
}
static const stria_link_ops_t jitter_ops = {"jitter",   jit_isend, jit_irecv,  jit_wait,
                                            jit_cancel, jit_abort, jit_destroy};

typedef struct {
    /* shared */
    const rcase_t *c;
    const rdata_t *d;
    stria_inproc_hub_t *hub;
    bool jitter;
    bool backward;
    double timeout_s;
    const char *device; /* NULL: the pass's own cpu device, host pointers */
    /* this rank */
    int rank;
    stria_status_t st_fwd, st_bwd;
    char msg[1024];
    double elapsed_s;
    float *o, *lse, *dq, *dk, *dv; /* this rank's fp32 outputs, shard order */
} rank_ctx_t;

/* The ranks of run_ranks() work one at a time when set: each holds this lock
 * through its passes and lets it go around its link waits (the wait hooks),
 * as stria_ring_run_local() does with serialize_compute. */
static pthread_mutex_t *run_serial;
static int wait_calls, wait_active; /* atomics: wait hooks of run_serial */
static int wait_depth_max;          /* atomic: deepest nesting on one thread */
static _Thread_local int wait_depth;

static void wait_begin(void *ctx)
{
    __atomic_add_fetch(&wait_calls, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&wait_active, 1, __ATOMIC_RELAXED);
    int depth = ++wait_depth, seen = __atomic_load_n(&wait_depth_max, __ATOMIC_RELAXED);
    while (depth > seen && !__atomic_compare_exchange_n(&wait_depth_max, &seen, depth, false,
                                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        ;
    pthread_mutex_unlock(ctx);
}

static void wait_end(void *ctx)
{
    pthread_mutex_lock(ctx);
    __atomic_sub_fetch(&wait_active, 1, __ATOMIC_RELAXED);
    wait_depth--;
}

static void *rank_main(void *arg)
{
    rank_ctx_t *x = arg;
    const rcase_t *c = x->c;
    stria_link_t *link = NULL;
    stria_ring_pass_t *pass = NULL;
    stria_ring_shape_t shape = shape_of(c);
    stria_ring_opts_t opts = {.step_timeout_s = x->timeout_s, .pass_id = 7};
    if (run_serial != NULL)
        opts.wait_begin_cb = wait_begin, opts.wait_end_cb = wait_end, opts.wait_cb_ctx = run_serial;
    size_t es = stria_dtype_size(c->dtype);
    double t0 = stria_time_now();
    stria_device_t *dev = NULL;

    if (x->device != NULL) {
        cr_assert_eq(stria_device_open(x->device, NULL, &dev), STRIA_OK, "%s", stria_error_msg());
        opts.device = dev;
    }

    cr_assert_eq(stria_inproc_link_create(x->hub, x->rank, &link), STRIA_OK);
    if (x->jitter) {
        jitter_link_t *j = calloc(1, sizeof(*j));
        j->base.ops = &jitter_ops;
        j->base.rank = link->rank;
        j->base.size = link->size;
        j->inner = link;
        j->rng = 0x9E3779B97F4A7C15ull * (uint64_t)(x->rank + 1) ^ (uint64_t)time(NULL);
        link = &j->base;
    }
    cr_assert_eq(stria_ring_pass_create(link, &shape, c->layout, &opts, &pass), STRIA_OK, "%s",
                 stria_error_msg());
    const stria_layout_t *l = stria_ring_pass_layout(pass);
    int64_t L = l->shard_tokens;
    size_t qn = (size_t)(c->B * L * c->H * c->D), kn = (size_t)(c->B * L * c->Hkv * c->D);
    void *q = malloc(qn * es), *k = malloc(kn * es), *v = malloc(kn * es), *g = malloc(qn * es);
    x->o = malloc(qn * 4), x->dq = malloc(qn * 4), x->dk = malloc(kn * 4), x->dv = malloc(kn * 4);
    x->lse = malloc((size_t)(c->B * c->H * L) * 4);
    stria_layout_scatter(l, x->rank, c->B, (size_t)(c->H * c->D) * es, x->d->qs, q);
    stria_layout_scatter(l, x->rank, c->B, (size_t)(c->Hkv * c->D) * es, x->d->ks, k);
    stria_layout_scatter(l, x->rank, c->B, (size_t)(c->Hkv * c->D) * es, x->d->vs, v);
    stria_layout_scatter(l, x->rank, c->B, (size_t)(c->H * c->D) * es, x->d->gs, g);
    stria_tensor_t tq = stria_tensor_contiguous(q, c->dtype, L, c->H, c->D);
    stria_tensor_t tk = stria_tensor_contiguous(k, c->dtype, L, c->Hkv, c->D);
    stria_tensor_t tv = stria_tensor_contiguous(v, c->dtype, L, c->Hkv, c->D);
    stria_tensor_t tg = stria_tensor_contiguous(g, c->dtype, L, c->H, c->D);
    stria_tensor_t to = stria_tensor_contiguous(x->o, STRIA_DTYPE_F32, L, c->H, c->D);
    stria_tensor_t tdq = stria_tensor_contiguous(x->dq, STRIA_DTYPE_F32, L, c->H, c->D);
    stria_tensor_t tdk = stria_tensor_contiguous(x->dk, STRIA_DTYPE_F32, L, c->Hkv, c->D);
    stria_tensor_t tdv = stria_tensor_contiguous(x->dv, STRIA_DTYPE_F32, L, c->Hkv, c->D);
    /* On a device: every tensor in device memory, outputs poisoned first */
    stria_tensor_t *all[] = {&tq, &tk, &tv, &tg, &to, &tdq, &tdk, &tdv};
    const size_t bytes[] = {qn * es, kn * es, kn * es, qn * es, qn * 4, qn * 4, kn * 4, kn * 4};
    void *host[8];
    float *lse = x->lse;
    size_t lse_bytes = (size_t)(c->B * c->H * L) * 4;
    for (int i = 0; i < 8 && dev != NULL; i++) {
        host[i] = all[i]->data;
        cr_assert_eq(stria_device_alloc(dev, bytes[i], &all[i]->data), STRIA_OK);
        if (i < 4)
            cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COPY, all[i]->data, host[i], bytes[i]),
                         STRIA_OK);
        else
            memset(all[i]->data, 0x7f, bytes[i]); /* the CPU device only: NaN-like junk */
    }
    if (dev != NULL) {
        cr_assert_eq(stria_device_alloc(dev, lse_bytes, (void **)&lse), STRIA_OK);
        memset(lse, 0x7f, lse_bytes);
        cr_assert_eq(stria_device_sync(dev, STRIA_STREAM_COPY), STRIA_OK);
    }

    if (run_serial != NULL)
        pthread_mutex_lock(run_serial);
    x->st_fwd = stria_ring_fwd(pass, &tq, &tk, &tv, &to, lse);
    if (x->st_fwd != STRIA_OK)
        snprintf(x->msg, sizeof(x->msg), "%s", stria_error_msg());
    if (x->st_fwd == STRIA_OK && x->backward) {
        x->st_bwd = stria_ring_bwd(pass, &tq, &tk, &tv, &to, lse, &tg, &tdq, &tdk, &tdv);
        if (x->st_bwd != STRIA_OK)
            snprintf(x->msg, sizeof(x->msg), "%s", stria_error_msg());
    }
    if (run_serial != NULL)
        pthread_mutex_unlock(run_serial);
    x->elapsed_s = stria_time_now() - t0;
    if (dev != NULL) {
        for (int i = 4; i < 8; i++)
            cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COPY, host[i], all[i]->data, bytes[i]),
                         STRIA_OK);
        cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COPY, x->lse, lse, lse_bytes), STRIA_OK);
        cr_assert_eq(stria_device_sync(dev, STRIA_STREAM_COPY), STRIA_OK);
        for (int i = 0; i < 8; i++)
            stria_device_free(dev, all[i]->data);
        stria_device_free(dev, lse);
    }
    stria_ring_pass_destroy(pass);
    stria_device_close(dev);
    stria_link_destroy(link);
    free(q), free(k), free(v), free(g);
    return NULL;
}

static void ctx_free(rank_ctx_t *x, int n)
{
    for (int r = 0; r < n; r++)
        free(x[r].o), free(x[r].lse), free(x[r].dq), free(x[r].dk), free(x[r].dv);
}

/* Runs one thread per rank; faults are set on the hub by the caller. */
static const char *run_device; /* device of the ranks of run_ranks() */

static void run_ranks(const rcase_t *c, const rdata_t *d, stria_inproc_hub_t *hub, bool jit,
                      bool backward, double timeout_s, rank_ctx_t *x)
{
    pthread_t th[16];
    for (int r = 0; r < c->n; r++) {
        memset(&x[r], 0, sizeof(x[r]));
        x[r] = (rank_ctx_t){.c = c,
                            .d = d,
                            .hub = hub,
                            .jitter = jit,
                            .backward = backward,
                            .timeout_s = timeout_s,
                            .device = run_device,
                            .rank = r};
        cr_assert_eq(pthread_create(&th[r], NULL, rank_main, &x[r]), 0);
    }
    for (int r = 0; r < c->n; r++)
        pthread_join(th[r], NULL);
}

Test(ring, bit_identical_over_a_jittery_link)
{
    for (size_t k = 0; k < 3; k++) {
        rcase_t c = {.n = 4,
                     .layout = all_layouts[k],
                     .causal = true,
                     .B = 1,
                     .S = 77,
                     .H = 4,
                     .Hkv = 2,
                     .D = 32,
                     .dtype = STRIA_DTYPE_BF16};
        rdata_t d;
        rank_ctx_t a[4], b[4];
        data_init(&c, &d, 5);
        for (int pass = 0; pass < 2; pass++) {
            stria_inproc_hub_t *hub;
            cr_assert_eq(stria_inproc_hub_create(c.n, &hub), STRIA_OK);
            run_ranks(&c, &d, hub, pass == 1, true, 30, pass == 0 ? a : b);
            stria_inproc_hub_release(hub);
        }
        for (int r = 0; r < c.n; r++) {
            cr_assert_eq(a[r].st_fwd, STRIA_OK, "%s", a[r].msg);
            cr_assert_eq(b[r].st_bwd, STRIA_OK, "%s", b[r].msg);
            stria_layout_t l;
            stria_layout_init(c.layout, c.n, c.S, &l);
            size_t qn = (size_t)(c.B * l.shard_tokens * c.H * c.D);
            size_t kn = (size_t)(c.B * l.shard_tokens * c.Hkv * c.D);
            size_t ln = (size_t)(c.B * c.H * l.shard_tokens);
            cr_expect_eq(memcmp(a[r].o, b[r].o, qn * 4), 0, "O differs on rank %d", r);
            cr_expect_eq(memcmp(a[r].lse, b[r].lse, ln * 4), 0, "LSE differs on rank %d", r);
            cr_expect_eq(memcmp(a[r].dq, b[r].dq, qn * 4), 0, "dQ differs on rank %d", r);
            cr_expect_eq(memcmp(a[r].dk, b[r].dk, kn * 4), 0, "dK differs on rank %d", r);
            cr_expect_eq(memcmp(a[r].dv, b[r].dv, kn * 4), 0, "dV differs on rank %d", r);
        }
        ctx_free(a, c.n);
        ctx_free(b, c.n);
        data_free(&d);
    }
}

/* ---- failures ---------------------------------------------------------------- */

static void expect_all_failed(const rank_ctx_t *x, int n, int culprit, bool in_bwd,
                              double max_elapsed_s)
{
    char needle[32];
    snprintf(needle, sizeof(needle), "rank %d", culprit);
    for (int r = 0; r < n; r++) {
        stria_status_t st = in_bwd ? x[r].st_bwd : x[r].st_fwd;
        cr_expect_neq(st, STRIA_OK, "rank %d succeeded although rank %d failed", r, culprit);
        cr_expect(strstr(x[r].msg, needle) != NULL, "rank %d: message '%s' does not name %s", r,
                  x[r].msg, needle);
        cr_expect(x[r].elapsed_s < max_elapsed_s, "rank %d took %.2f s", r, x[r].elapsed_s);
        if (in_bwd)
            cr_expect_eq(x[r].st_fwd, STRIA_OK, "rank %d: forward failed: %s", r, x[r].msg);
    }
}

/* A rank dies mid-pass (its link fails after a few operations): every rank
 * returns an error naming it, long before the deadline. */
static void failing_rank_case(void)
{
    rcase_t c = {.n = 4,
                 .layout = STRIA_LAYOUT_STRIPED,
                 .causal = true,
                 .B = 1,
                 .S = 64,
                 .H = 2,
                 .Hkv = 2,
                 .D = 16,
                 .dtype = STRIA_DTYPE_F32};
    rdata_t d;
    data_init(&c, &d, 3);
    for (int bwd = 0; bwd < 2; bwd++) {
        rank_ctx_t x[4];
        stria_inproc_hub_t *hub;
        cr_assert_eq(stria_inproc_hub_create(c.n, &hub), STRIA_OK);
        /* The forward pass posts 2 operations in each of steps 0..2 and 2 in
         * each of the 3 rounds of the final agreement; the backward pass 3 in
         * step 0, then 4. Fail at forward step 2, or at backward step 1. */
        cr_assert_eq(stria_inproc_fault_inject(hub, 2, STRIA_INPROC_FAULT_FAIL, bwd ? 17 : 4),
                     STRIA_OK);
        run_ranks(&c, &d, hub, false, bwd, 30, x);
        stria_inproc_hub_release(hub);
        expect_all_failed(x, c.n, 2, bwd, 10.0);
        for (int r = 0; r < c.n; r++) {
            stria_status_t st = bwd ? x[r].st_bwd : x[r].st_fwd;
            if (r == 2)
                cr_expect_eq(st, STRIA_ERR_TRANSPORT, "%s", stria_status_name(st));
            else
                cr_expect_eq(st, STRIA_ERR_PEER, "rank %d: %s", r, stria_status_name(st));
        }
        ctx_free(x, c.n);
    }
    data_free(&d);
}

Test(ring, failing_rank_fails_every_rank)
{
    failing_rank_case();
}

/* The same with the ranks working one at a time (the benchmark's
 * serialisation through the wait hooks): a rank never blocks holding the
 * lock, so the failure still reaches every rank, and the hooks pair up. */
Test(ring, failing_rank_fails_every_rank_serialized)
{
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    run_serial = &m;
    failing_rank_case();
    run_serial = NULL;
    cr_expect_gt(wait_calls, 0, "the wait hooks were never called");
    cr_expect_eq(wait_active, 0, "%d wait hooks without their end", wait_active);
    cr_expect_eq(wait_depth_max, 1, "wait hooks nested %d deep on one thread", wait_depth_max);
}

/* The same with every rank on the staged device: the failure surfaces from
 * the link between device copies and still aborts every rank. */
Test(ring, failing_rank_fails_every_rank_staged)
{
    run_device = "cpu:staged";
    failing_rank_case();
}

/* ---- devices ----------------------------------------------------------------- */

/* The staged device (separate device buffers, every staging copy and
 * stream order of a GPU) gives the host path's results bit for bit. */
static void staged_equals_cpu(int n)
{
    static const stria_dtype_t dtypes[] = {STRIA_DTYPE_F32, STRIA_DTYPE_BF16};
    for (size_t di = 0; di < 2; di++)
        for (size_t k = 0; k < 3; k++)
            for (int causal = 0; causal < 2; causal++) {
                rcase_t c = {.n = n,
                             .layout = all_layouts[k],
                             .causal = causal,
                             .B = 2,
                             .S = 16 * n + 3, /* odd: padding in every layout */
                             .H = 4,
                             .Hkv = di == 0 ? 2 : 1,
                             .D = 32,
                             .dtype = dtypes[di]};
                rdata_t d;
                rank_ctx_t a[4], b[4];
                data_init(&c, &d, (uint64_t)(n * 7 + k));
                for (int pass = 0; pass < 2; pass++) {
                    stria_inproc_hub_t *hub;
                    cr_assert_eq(stria_inproc_hub_create(c.n, &hub), STRIA_OK);
                    run_device = pass == 0 ? NULL : "cpu:staged";
                    run_ranks(&c, &d, hub, false, true, 30, pass == 0 ? a : b);
                    stria_inproc_hub_release(hub);
                }
                run_device = NULL;
                stria_layout_t l;
                stria_layout_init(c.layout, c.n, c.S, &l);
                size_t qn = (size_t)(c.B * l.shard_tokens * c.H * c.D);
                size_t kn = (size_t)(c.B * l.shard_tokens * c.Hkv * c.D);
                size_t ln = (size_t)(c.B * c.H * l.shard_tokens);
                for (int r = 0; r < c.n; r++) {
                    cr_assert_eq(a[r].st_bwd, STRIA_OK, "%s", a[r].msg);
                    cr_assert_eq(b[r].st_fwd, STRIA_OK, "staged: %s", b[r].msg);
                    cr_assert_eq(b[r].st_bwd, STRIA_OK, "staged: %s", b[r].msg);
                    same_bits(a[r].o, b[r].o, qn * 4, "O", r, &c);
                    same_bits(a[r].lse, b[r].lse, ln * 4, "LSE", r, &c);
                    same_bits(a[r].dq, b[r].dq, qn * 4, "dQ", r, &c);
                    same_bits(a[r].dk, b[r].dk, kn * 4, "dK", r, &c);
                    same_bits(a[r].dv, b[r].dv, kn * 4, "dV", r, &c);
                }
                ctx_free(a, c.n);
                ctx_free(b, c.n);
                data_free(&d);
            }
}

Test(ring, staged_equals_cpu_n1)
{
    staged_equals_cpu(1);
}

Test(ring, staged_equals_cpu_n2)
{
    staged_equals_cpu(2);
}

Test(ring, staged_equals_cpu_n3)
{
    staged_equals_cpu(3);
}

Test(ring, staged_equals_cpu_n4)
{
    staged_equals_cpu(4);
}

/* stria_ring_run_local() with a device: the same outputs as without, in the
 * output dtypes asked for; a bad device name is an error naming it. */
Test(ring, run_local_staged)
{
    rcase_t c = {.n = 3,
                 .layout = STRIA_LAYOUT_ZIGZAG,
                 .causal = true,
                 .B = 1,
                 .S = 101,
                 .H = 4,
                 .Hkv = 2,
                 .D = 32,
                 .dtype = STRIA_DTYPE_BF16};
    rdata_t d;
    data_init(&c, &d, 9);
    stria_ring_shape_t shape = shape_of(&c);
    size_t es = stria_dtype_size(c.dtype);
    void *out[2][5];
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < 5; i++)
            out[pass][i] = calloc(d.nq > d.nl ? d.nq : d.nl, 4);
        stria_ring_local_opts_t lo = {.layout = c.layout,
                                      .n_ranks = c.n,
                                      .passes = STRIA_RING_PASS_FWD_BWD,
                                      .step_timeout_s = 30,
                                      .threads_per_rank = 2,
                                      .device = pass == 0 ? NULL : "cpu:staged"};
        stria_ring_local_io_t io = {.q = d.qs,
                                    .k = d.ks,
                                    .v = d.vs,
                                    .o = out[pass][0],
                                    .o_dtype = STRIA_DTYPE_BF16,
                                    .lse = out[pass][1],
                                    .d_o = d.gs,
                                    .dq = out[pass][2],
                                    .dk = out[pass][3],
                                    .dv = out[pass][4],
                                    .grad_dtype = STRIA_DTYPE_F16};
        cr_assert_eq(stria_ring_run_local(&shape, &lo, &io, NULL), STRIA_OK, "%s",
                     stria_error_msg());
    }
    cr_expect_eq(memcmp(out[0][0], out[1][0], d.nq * es), 0, "O differs");
    cr_expect_eq(memcmp(out[0][1], out[1][1], d.nl * 4), 0, "LSE differs");
    cr_expect_eq(memcmp(out[0][2], out[1][2], d.nq * 2), 0, "dQ differs");
    cr_expect_eq(memcmp(out[0][3], out[1][3], d.nk * 2), 0, "dK differs");
    cr_expect_eq(memcmp(out[0][4], out[1][4], d.nk * 2), 0, "dV differs");

    stria_ring_local_opts_t bad = {
        .layout = c.layout, .n_ranks = c.n, .passes = STRIA_RING_PASS_FWD, .device = "tpu:0"};
    stria_ring_local_io_t io = {
        .q = d.qs, .k = d.ks, .v = d.vs, .o = out[0][0], .o_dtype = c.dtype, .lse = out[0][1]};
    cr_expect_eq(stria_ring_run_local(&shape, &bad, &io, NULL), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "tpu:0") != NULL, "%s", stria_error_msg());
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < 5; i++)
            free(out[pass][i]);
    data_free(&d);
}

/* A rank hangs (sends nothing): the step deadline ends the pass on every rank
 * with an error that names it; nobody waits much longer than the deadline. */
Test(ring, stalled_rank_hits_the_deadline_everywhere)
{
    rcase_t c = {.n = 4,
                 .layout = STRIA_LAYOUT_ZIGZAG,
                 .causal = false,
                 .B = 1,
                 .S = 40,
                 .H = 2,
                 .Hkv = 1,
                 .D = 16,
                 .dtype = STRIA_DTYPE_BF16};
    rdata_t d;
    data_init(&c, &d, 4);
    for (int bwd = 0; bwd < 2; bwd++) {
        rank_ctx_t x[4];
        stria_inproc_hub_t *hub;
        cr_assert_eq(stria_inproc_hub_create(c.n, &hub), STRIA_OK);
        /* from the K/V send of step 1 on (see the counts above) */
        cr_assert_eq(stria_inproc_fault_inject(hub, 1, STRIA_INPROC_FAULT_STALL, bwd ? 16 : 2),
                     STRIA_OK);
        run_ranks(&c, &d, hub, false, bwd, 0.3, x);
        stria_inproc_hub_release(hub);
        expect_all_failed(x, c.n, 1, bwd, 5.0);
        int timeouts = 0;
        for (int r = 0; r < c.n; r++)
            timeouts += (bwd ? x[r].st_bwd : x[r].st_fwd) == STRIA_ERR_TIMEOUT;
        cr_expect(timeouts >= 1, "no rank reported the deadline");
        ctx_free(x, c.n);
    }
    data_free(&d);
}

/* A bad argument on one rank aborts the others at once. */
Test(ring, bad_tensor_on_one_rank_fails_all)
{
    rcase_t c = {.n = 3,
                 .layout = STRIA_LAYOUT_STRIPED,
                 .causal = true,
                 .B = 1,
                 .S = 30,
                 .H = 2,
                 .Hkv = 2,
                 .D = 16,
                 .dtype = STRIA_DTYPE_F32};
    stria_inproc_hub_t *hub;
    stria_link_t *links[3];
    stria_ring_pass_t *pass;
    stria_ring_shape_t shape = shape_of(&c);
    float buf[16 * 2 * 16 * 2], lse[64];

    cr_assert_eq(stria_inproc_hub_create(3, &hub), STRIA_OK);
    for (int r = 0; r < 3; r++)
        cr_assert_eq(stria_inproc_link_create(hub, r, &links[r]), STRIA_OK);
    cr_assert_eq(stria_ring_pass_create(links[1], &shape, c.layout, NULL, &pass), STRIA_OK);
    stria_tensor_t t = stria_tensor_contiguous(buf, STRIA_DTYPE_BF16, 10, 2, 16);
    stria_tensor_t o = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 10, 2, 16);
    cr_expect_eq(stria_ring_fwd(pass, &t, &t, &t, &o, lse), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "rank 1") != NULL && strstr(stria_error_msg(), "bf16"),
              "%s", stria_error_msg());
    /* rank 0 now fails at once instead of waiting, with the kind of rank
     * 1's failure (a bad input), not a peer's */
    stria_link_req_t *req;
    stria_status_t st = stria_link_irecv(links[0], 1, buf, 4, &req);
    if (st == STRIA_OK)
        st = stria_link_wait(links[0], req, 10);
    cr_assert_eq(st, STRIA_ERR_INVALID_ARG, "%s", stria_status_name(st));
    cr_expect(strstr(stria_error_msg(), "rank 1 aborted") != NULL, "%s", stria_error_msg());
    stria_ring_pass_destroy(pass);
    for (int r = 0; r < 3; r++)
        stria_link_destroy(links[r]);
    stria_inproc_hub_release(hub);
}

Test(ring, bad_shapes_and_options)
{
    stria_inproc_hub_t *hub;
    stria_link_t *link;
    stria_ring_pass_t *pass = NULL;
    stria_ring_shape_t s = {.call = {.batch = 1, .seq_len = 10},
                            .heads = 4,
                            .kv_heads = 3,
                            .head_dim = 32,
                            .dtype = STRIA_DTYPE_F32};

    cr_assert_eq(stria_inproc_hub_create(1, &hub), STRIA_OK);
    cr_assert_eq(stria_inproc_link_create(hub, 0, &link), STRIA_OK);
    cr_expect_eq(stria_ring_pass_create(link, &s, STRIA_LAYOUT_STRIPED, NULL, &pass),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "multiple of kv_heads"), "%s", stria_error_msg());
    s.kv_heads = 2;
    s.head_dim = 20;
    cr_expect_eq(stria_ring_pass_create(link, &s, STRIA_LAYOUT_STRIPED, NULL, &pass),
                 STRIA_ERR_UNSUPPORTED);
    cr_expect(strstr(stria_error_msg(), "head_dim 20"), "%s", stria_error_msg());
    s.head_dim = 32;
    s.call.seq_len = 0;
    cr_expect_eq(stria_ring_pass_create(link, &s, STRIA_LAYOUT_STRIPED, NULL, &pass),
                 STRIA_ERR_INVALID_ARG);
    s.call.seq_len = 10;
    cr_expect_eq(stria_ring_pass_create(link, &s, (stria_layout_kind_t)5, NULL, &pass),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "layout"), "%s", stria_error_msg());
    cr_expect_eq(stria_ring_pass_create(NULL, &s, STRIA_LAYOUT_STRIPED, NULL, &pass),
                 STRIA_ERR_INVALID_ARG);
    cr_expect_null(pass);
    stria_link_destroy(link);
    stria_inproc_hub_release(hub);

    float buf[4];
    stria_ring_local_opts_t lo = {
        .layout = STRIA_LAYOUT_STRIPED, .n_ranks = 0, .passes = STRIA_RING_PASS_FWD};
    stria_ring_local_io_t io = {.q = buf, .k = buf, .v = buf, .o = buf, .lse = buf};
    cr_expect_eq(stria_ring_run_local(&s, &lo, &io, NULL), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "0 ranks"), "%s", stria_error_msg());
    lo.n_ranks = 2;
    lo.passes = STRIA_RING_PASS_FWD_BWD;
    cr_expect_eq(stria_ring_run_local(&s, &lo, &io, NULL), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "d_o"), "%s", stria_error_msg());
    s.heads = 3;
    lo.passes = STRIA_RING_PASS_FWD;
    cr_expect_eq(stria_ring_run_local(&s, &lo, &io, NULL), STRIA_ERR_INVALID_ARG);
}
