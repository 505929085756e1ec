/* Ring engine suite, passes: per-step stats, threads per rank, serialized
 * compute and its hooks, and one pass object per job rebound to a new link
 * per pass. */
#include <criterion/criterion.h>

#include "ring_test_util.h"

/* ---- stats ------------------------------------------------------------------- */

/* Per-step stats: the block schedule, the bytes on the wire (only kv_heads
 * travel), and causal block skipping of the contiguous layout. */
Test(ring, step_stats)
{
    const int n = 4;
    rcase_t c = {.n = n,
                 .layout = STRIA_LAYOUT_CONTIGUOUS,
                 .causal = true,
                 .B = 2,
                 .S = 256,
                 .H = 4,
                 .Hkv = 1,
                 .D = 32,
                 .dtype = STRIA_DTYPE_BF16};
    stria_ring_step_stats_t fwd[16], bwd[16];
    stria_ring_local_stats_t stats = {.fwd_steps = fwd, .bwd_steps = bwd};
    rdata_t d;

    for (size_t k = 0; k < 3; k++) {
        c.layout = all_layouts[k];
        data_init(&c, &d, 8);
        cr_assert_eq(ring_run(&c, &d, &stats), STRIA_OK, "%s", stria_error_msg());
        cr_expect(stats.fwd_wall_s > 0 && stats.bwd_wall_s > 0);
        uint64_t kv = (uint64_t)(2 * c.B * (c.S / n) * c.Hkv * c.D * 2); /* K and V in bf16 */
        for (int r = 0; r < n; r++)
            for (int s = 0; s < n; s++) {
                const stria_ring_step_stats_t *f = &fwd[r * n + s], *b = &bwd[r * n + s];
                int j = (r - s + n) % n;
                cr_expect_eq(f->src_rank, j);
                cr_expect_eq(b->src_rank, j);
                /* the last step also carries the 8-byte agreement tokens */
                uint64_t done = s == n - 1 ? 8 * (uint64_t)(n - 1) : 0;
                cr_expect_eq(f->bytes_sent, (s < n - 1 ? kv : 0) + done, "rank %d step %d", r, s);
                cr_expect_eq(f->bytes_recv, (s < n - 1 ? kv : 0) + done);
                /* backward adds the fp32 dK/dV sum: 2x the bf16 K/V bytes */
                cr_expect_eq(b->bytes_sent, (s < n - 1 ? kv : 0) + 2 * kv + done);
                cr_expect_eq(b->bytes_recv, (s < n - 1 ? kv : 0) + (s > 0 ? 2 * kv : 0) +
                                                (s == n - 1 ? 2 * kv : 0) + done);
                bool visible = c.layout != STRIA_LAYOUT_CONTIGUOUS || j <= r;
                cr_expect_eq(f->computed, visible, "%s rank %d step %d",
                             stria_layout_kind_name(c.layout), r, s);
                cr_expect_eq(b->computed, visible);
                cr_expect_eq(f->compute_s > 0, visible);
            }
        data_free(&d);
    }
}

/* Ring sizes beyond the main matrix and batch > 1 with several kernel threads
 * per rank. */
Test(ring, threads_per_rank_and_other_sizes)
{
    int sizes[] = {5, 6, 7};
    for (int i = 0; i < 3; i++) {
        rcase_t c = {.n = sizes[i],
                     .layout = all_layouts[i],
                     .causal = i != 1,
                     .B = 3,
                     .S = 41 + i,
                     .H = 2,
                     .Hkv = 2,
                     .D = 16,
                     .dtype = STRIA_DTYPE_F32};
        check_case(&c);
    }
    rcase_t c = {.n = 2,
                 .layout = STRIA_LAYOUT_STRIPED,
                 .causal = true,
                 .B = 2,
                 .S = 150,
                 .H = 4,
                 .Hkv = 2,
                 .D = 32,
                 .dtype = STRIA_DTYPE_F32};
    rdata_t d, e;
    stria_ring_shape_t shape = shape_of(&c);
    stria_ring_local_opts_t opts = {
        .layout = c.layout, .n_ranks = 2, .passes = STRIA_RING_PASS_FWD, .threads_per_rank = 2};
    data_init(&c, &d, 1);
    data_init(&c, &e, 1);
    stria_ring_local_io_t io = {
        .q = d.qs, .k = d.ks, .v = d.vs, .o = d.o, .o_dtype = STRIA_DTYPE_F32, .lse = d.lse};
    cr_assert_eq(stria_ring_run_local(&shape, &opts, &io, NULL), STRIA_OK, "%s", stria_error_msg());
    opts.threads_per_rank = 1;
    io.o = e.o;
    io.lse = e.lse;
    cr_assert_eq(stria_ring_run_local(&shape, &opts, &io, NULL), STRIA_OK);
    /* the forward kernel splits work by query tile: threads change nothing */
    cr_expect_eq(memcmp(d.o, e.o, d.nq * 4), 0);
    cr_expect_eq(memcmp(d.lse, e.lse, d.nl * 4), 0);
    data_free(&d);
    data_free(&e);
}

/* Serialised work (serialize_compute: one rank at a time, through the wait
 * hooks) changes no bit of the results; the step hook sees every step
 * start. */
static int step_calls, step_last = -1, step_total;

static void hook_step(void *ctx, int step, int n_steps)
{
    (void)ctx;
    step_calls++;
    step_last = step;
    step_total = n_steps;
}

Test(ring, serialized_compute_and_hooks)
{
    rcase_t c = {.n = 4,
                 .layout = STRIA_LAYOUT_STRIPED,
                 .causal = true,
                 .B = 1,
                 .S = 200,
                 .H = 2,
                 .Hkv = 1,
                 .D = 32,
                 .dtype = STRIA_DTYPE_F32};
    rdata_t a, b;
    stria_ring_shape_t shape = shape_of(&c);
    stria_ring_local_opts_t opts = {
        .layout = c.layout, .n_ranks = c.n, .passes = STRIA_RING_PASS_FWD_BWD};
    data_init(&c, &a, 2);
    data_init(&c, &b, 2);
    stria_ring_local_io_t io = {.q = a.qs,
                                .k = a.ks,
                                .v = a.vs,
                                .o = a.o,
                                .o_dtype = STRIA_DTYPE_F32,
                                .lse = a.lse,
                                .d_o = a.gs,
                                .dq = a.dq,
                                .dk = a.dk,
                                .dv = a.dv,
                                .grad_dtype = STRIA_DTYPE_F32};
    cr_assert_eq(stria_ring_run_local(&shape, &opts, &io, NULL), STRIA_OK, "%s", stria_error_msg());
    opts.serialize_compute = true;
    io.o = b.o, io.lse = b.lse, io.dq = b.dq, io.dk = b.dk, io.dv = b.dv;
    cr_assert_eq(stria_ring_run_local(&shape, &opts, &io, NULL), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(memcmp(a.o, b.o, a.nq * 4), 0);
    cr_expect_eq(memcmp(a.dq, b.dq, a.nq * 4), 0);
    cr_expect_eq(memcmp(a.dk, b.dk, a.nk * 4), 0);
    data_free(&a);
    data_free(&b);

    /* the step hook sees every step start */
    stria_inproc_hub_t *hub;
    stria_link_t *link;
    stria_ring_pass_t *pass;
    stria_ring_opts_t po = {.step_cb = hook_step};
    c.n = 1;
    cr_assert_eq(stria_inproc_hub_create(1, &hub), STRIA_OK);
    cr_assert_eq(stria_inproc_link_create(hub, 0, &link), STRIA_OK);
    cr_assert_eq(stria_ring_pass_create(link, &shape, c.layout, &po, &pass), STRIA_OK);
    /* a ring of one: one forward step */
    int64_t L = stria_ring_pass_layout(pass)->shard_tokens;
    float *buf = calloc((size_t)(5 * L * c.H * c.D + c.H * L), sizeof(float));
    stria_tensor_t tq = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, L, c.H, c.D);
    stria_tensor_t tk =
        stria_tensor_contiguous(buf + L * c.H * c.D, STRIA_DTYPE_F32, L, c.Hkv, c.D);
    stria_tensor_t to =
        stria_tensor_contiguous(buf + 2 * L * c.H * c.D, STRIA_DTYPE_F32, L, c.H, c.D);
    cr_assert_eq(stria_ring_fwd(pass, &tq, &tk, &tk, &to, buf + 5 * L * c.H * c.D), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect(step_calls == 1 && step_last == 0 && step_total == 1,
              "step hook: %d calls, last %d/%d", step_calls, step_last, step_total);
    free(buf);
    stria_ring_pass_destroy(pass);
    stria_link_destroy(link);
    stria_inproc_hub_release(hub);
}

/* ---- one pass object per job, rebound to a link per pass -------------------- */

/* A rank of reuse_case(): two passes (forward and backward), each over its own
 * in-process hub and link, with other inputs each time; either one pass
 * object rebound to the second link or a fresh object per pass. */
typedef struct {
    const rcase_t *c;
    const rdata_t *d[2];
    stria_inproc_hub_t *hub[2];
    bool reuse;
    const char *device; /* NULL: host tensors; "cpu:staged": device tensors */
    int rank;
    float *out[2][5]; /* o, lse, dq, dk, dv of each pass (fp32, shard order) */
} reuse_ctx_t;

static void *reuse_rank_main(void *arg)
{
    reuse_ctx_t *x = arg;
    const rcase_t *c = x->c;
    stria_ring_shape_t shape = shape_of(c);
    stria_ring_opts_t opts = {.step_timeout_s = 30, .pass_id = 3};
    stria_device_t *dev = NULL;
    stria_ring_pass_t *pass = NULL;
    stria_link_t *bound = NULL;
    stria_layout_t l;
    size_t es = stria_dtype_size(c->dtype);

    cr_assert_eq(stria_layout_init(c->layout, c->n, c->S, &l), STRIA_OK);
    if (x->device != NULL) {
        cr_assert_eq(stria_device_open(x->device, NULL, &dev), STRIA_OK, "%s", stria_error_msg());
        opts.device = dev;
    }
    const int64_t L = l.shard_tokens;
    const size_t qn = (size_t)(c->B * L * c->H * c->D), kn = (size_t)(c->B * L * c->Hkv * c->D);
    const size_t ln = (size_t)(c->B * c->H * L);
    /* q, k, v, d_o in the dtype; o, lse, dq, dk, dv in fp32 */
    const size_t bytes[9] = {qn * es, kn * es, kn * es, qn * es, qn * 4,
                             ln * 4,  qn * 4,  kn * 4,  kn * 4};
    void *buf[9];
    for (int i = 0; i < 9; i++) {
        if (dev != NULL) /* the CPU devices only: device memory is host-addressable */
            cr_assert_eq(stria_device_alloc(dev, bytes[i], &buf[i]), STRIA_OK);
        else
            cr_assert_not_null(buf[i] = malloc(bytes[i]));
    }
    stria_tensor_t tq = stria_tensor_contiguous(buf[0], c->dtype, L, c->H, c->D);
    stria_tensor_t tk = stria_tensor_contiguous(buf[1], c->dtype, L, c->Hkv, c->D);
    stria_tensor_t tv = stria_tensor_contiguous(buf[2], c->dtype, L, c->Hkv, c->D);
    stria_tensor_t tg = stria_tensor_contiguous(buf[3], c->dtype, L, c->H, c->D);
    stria_tensor_t to = stria_tensor_contiguous(buf[4], STRIA_DTYPE_F32, L, c->H, c->D);
    stria_tensor_t tdq = stria_tensor_contiguous(buf[6], STRIA_DTYPE_F32, L, c->H, c->D);
    stria_tensor_t tdk = stria_tensor_contiguous(buf[7], STRIA_DTYPE_F32, L, c->Hkv, c->D);
    stria_tensor_t tdv = stria_tensor_contiguous(buf[8], STRIA_DTYPE_F32, L, c->Hkv, c->D);

    for (int i = 0; i < 2; i++) {
        const rdata_t *d = x->d[i];
        stria_link_t *link;
        cr_assert_eq(stria_inproc_link_create(x->hub[i], x->rank, &link), STRIA_OK);
        if (pass == NULL)
            cr_assert_eq(stria_ring_pass_create(link, &shape, c->layout, &opts, &pass), STRIA_OK,
                         "%s", stria_error_msg());
        else
            cr_assert_eq(stria_ring_pass_set_link(pass, link), STRIA_OK, "%s", stria_error_msg());
        stria_link_destroy(bound); /* no longer touched by the pass object */
        bound = link;
        stria_layout_scatter(&l, x->rank, c->B, (size_t)(c->H * c->D) * es, d->qs, buf[0]);
        stria_layout_scatter(&l, x->rank, c->B, (size_t)(c->Hkv * c->D) * es, d->ks, buf[1]);
        stria_layout_scatter(&l, x->rank, c->B, (size_t)(c->Hkv * c->D) * es, d->vs, buf[2]);
        stria_layout_scatter(&l, x->rank, c->B, (size_t)(c->H * c->D) * es, d->gs, buf[3]);
        for (int b = 4; b < 9; b++)
            memset(buf[b], 0x7f, bytes[b]); /* junk: the pass must write every output */
        cr_assert_eq(stria_ring_fwd(pass, &tq, &tk, &tv, &to, buf[5]), STRIA_OK, "rank %d: %s",
                     x->rank, stria_error_msg());
        cr_assert_eq(stria_ring_bwd(pass, &tq, &tk, &tv, &to, buf[5], &tg, &tdq, &tdk, &tdv),
                     STRIA_OK, "rank %d: %s", x->rank, stria_error_msg());
        for (int b = 4; b < 9; b++) {
            x->out[i][b - 4] = malloc(bytes[b]);
            memcpy(x->out[i][b - 4], buf[b], bytes[b]);
        }
        if (!x->reuse) {
            stria_ring_pass_destroy(pass);
            pass = NULL;
            stria_link_destroy(bound);
            bound = NULL;
        }
    }
    stria_ring_pass_destroy(pass);
    stria_link_destroy(bound);
    for (int i = 0; i < 9; i++) {
        if (dev != NULL)
            stria_device_free(dev, buf[i]);
        else
            free(buf[i]);
    }
    stria_device_close(dev);
    return NULL;
}

static void reuse_run(const rcase_t *c, const rdata_t *d0, const rdata_t *d1, bool reuse,
                      const char *device, reuse_ctx_t *x)
{
    pthread_t th[8];
    stria_inproc_hub_t *hub[2];
    for (int i = 0; i < 2; i++)
        cr_assert_eq(stria_inproc_hub_create(c->n, &hub[i]), STRIA_OK);
    for (int r = 0; r < c->n; r++) {
        x[r] = (reuse_ctx_t){.c = c,
                             .d = {d0, d1},
                             .hub = {hub[0], hub[1]},
                             .reuse = reuse,
                             .device = device,
                             .rank = r};
        cr_assert_eq(pthread_create(&th[r], NULL, reuse_rank_main, &x[r]), 0);
    }
    for (int r = 0; r < c->n; r++)
        pthread_join(th[r], NULL);
    for (int i = 0; i < 2; i++)
        stria_inproc_hub_release(hub[i]);
}

/* One pass object rebound to a second link gives the bits of two fresh
 * objects, on the host and on the staged device (whose device and pinned
 * buffers it keeps). */
Test(ring, pass_object_rebound_to_a_new_link)
{
    static const char *devices[] = {NULL, "cpu:staged"};
    for (size_t k = 0; k < 3; k++)
        for (size_t di = 0; di < 2; di++) {
            rcase_t c = {.n = 4,
                         .layout = all_layouts[k],
                         .causal = k != 1,
                         .B = 2,
                         .S = 61,
                         .H = 4,
                         .Hkv = 2,
                         .D = 32,
                         .dtype = STRIA_DTYPE_BF16};
            rdata_t d0, d1;
            reuse_ctx_t fresh[4], reused[4];
            data_init(&c, &d0, 11 + k);
            data_init(&c, &d1, 21 + k);
            reuse_run(&c, &d0, &d1, false, devices[di], fresh);
            reuse_run(&c, &d0, &d1, true, devices[di], reused);
            stria_layout_t l;
            stria_layout_init(c.layout, c.n, c.S, &l);
            size_t qn = (size_t)(c.B * l.shard_tokens * c.H * c.D);
            size_t kn = (size_t)(c.B * l.shard_tokens * c.Hkv * c.D);
            size_t ln = (size_t)(c.B * c.H * l.shard_tokens);
            const size_t n4[5] = {qn * 4, ln * 4, qn * 4, kn * 4, kn * 4};
            static const char *names[5] = {"O", "LSE", "dQ", "dK", "dV"};
            /* the two passes had other inputs: the second did not repeat the first */
            cr_expect_neq(memcmp(fresh[0].out[0][0], fresh[0].out[1][0], qn * 4), 0);
            for (int r = 0; r < c.n; r++)
                for (int i = 0; i < 2; i++)
                    for (int t = 0; t < 5; t++) {
                        char what[64];
                        snprintf(what, sizeof(what), "%s of pass %d (%s)", names[t], i,
                                 devices[di] ? devices[di] : "cpu");
                        same_bits(fresh[r].out[i][t], reused[r].out[i][t], n4[t], what, r, &c);
                        free(fresh[r].out[i][t]);
                        free(reused[r].out[i][t]);
                    }
            data_free(&d0);
            data_free(&d1);
        }
}

/* Rebinding is refused for a link of another rank or ring size (naming
 * both), a NULL link, and while a pass runs on the object; a refused
 * rebinding leaves the object working on its link. */
typedef struct {
    stria_ring_pass_t *pass;
    stria_link_t *link;
    stria_status_t st;
    char msg[512];
} rebind_hook_t;

static void rebind_in_step(void *ctx, int step, int n_steps)
{
    rebind_hook_t *h = ctx;
    (void)n_steps;
    if (step != 0)
        return;
    h->st = stria_ring_pass_set_link(h->pass, h->link);
    snprintf(h->msg, sizeof(h->msg), "%s", stria_error_msg());
}

Test(ring, set_link_refusals)
{
    stria_inproc_hub_t *hub4, *hub3, *hub1;
    stria_link_t *l4[4], *l3, *l1;
    stria_ring_pass_t *pass;
    stria_ring_shape_t s = {.call = {.batch = 1, .seq_len = 40},
                            .heads = 2,
                            .kv_heads = 1,
                            .head_dim = 16,
                            .dtype = STRIA_DTYPE_F32};

    cr_assert_eq(stria_inproc_hub_create(4, &hub4), STRIA_OK);
    cr_assert_eq(stria_inproc_hub_create(3, &hub3), STRIA_OK);
    for (int r = 0; r < 4; r++)
        cr_assert_eq(stria_inproc_link_create(hub4, r, &l4[r]), STRIA_OK);
    cr_assert_eq(stria_inproc_link_create(hub3, 1, &l3), STRIA_OK);
    cr_assert_eq(stria_ring_pass_create(l4[1], &s, STRIA_LAYOUT_STRIPED, NULL, &pass), STRIA_OK);

    cr_expect_eq(stria_ring_pass_set_link(pass, l4[2]), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "rank 1 of a ring of 4") &&
                  strstr(stria_error_msg(), "rank 2 of a ring of 4"),
              "%s", stria_error_msg());
    cr_expect_eq(stria_ring_pass_set_link(pass, l3), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "rank 1 of a ring of 4") &&
                  strstr(stria_error_msg(), "rank 1 of a ring of 3"),
              "%s", stria_error_msg());
    cr_expect_eq(stria_ring_pass_set_link(pass, NULL), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_ring_pass_set_link(NULL, l4[1]), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_ring_pass_set_link(pass, l4[1]), STRIA_OK, "%s", stria_error_msg());
    stria_ring_pass_destroy(pass);
    for (int r = 0; r < 4; r++)
        stria_link_destroy(l4[r]);
    stria_link_destroy(l3);
    stria_inproc_hub_release(hub4);
    stria_inproc_hub_release(hub3);

    /* during a pass (from its step hook): refused, and the pass completes */
    rebind_hook_t h = {.st = STRIA_OK};
    stria_ring_opts_t po = {.step_cb = rebind_in_step, .step_cb_ctx = &h};
    cr_assert_eq(stria_inproc_hub_create(1, &hub1), STRIA_OK);
    cr_assert_eq(stria_inproc_link_create(hub1, 0, &l1), STRIA_OK);
    cr_assert_eq(stria_ring_pass_create(l1, &s, STRIA_LAYOUT_STRIPED, &po, &pass), STRIA_OK);
    h.pass = pass;
    h.link = l1;
    int64_t L = stria_ring_pass_layout(pass)->shard_tokens;
    float *buf = calloc((size_t)(3 * L * s.heads * s.head_dim + s.heads * L), sizeof(float));
    stria_tensor_t tq = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, L, s.heads, s.head_dim);
    stria_tensor_t tk = stria_tensor_contiguous(buf + L * s.heads * s.head_dim, STRIA_DTYPE_F32, L,
                                                s.kv_heads, s.head_dim);
    stria_tensor_t to = stria_tensor_contiguous(buf + 2 * L * s.heads * s.head_dim, STRIA_DTYPE_F32,
                                                L, s.heads, s.head_dim);
    float *lse = buf + 3 * L * s.heads * s.head_dim;
    cr_expect_eq(stria_ring_fwd(pass, &tq, &tk, &tk, &to, lse), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(h.st, STRIA_ERR_BUSY, "rebinding during a pass: %s", stria_status_name(h.st));
    cr_expect(strstr(h.msg, "running"), "%s", h.msg);
    /* between passes it is allowed again */
    cr_expect_eq(stria_ring_pass_set_link(pass, l1), STRIA_OK, "%s", stria_error_msg());
    free(buf);
    stria_ring_pass_destroy(pass);
    stria_link_destroy(l1);
    stria_inproc_hub_release(hub1);
}
