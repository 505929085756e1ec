/* Ring engine suite: the ring against single-process attention on the global
 * sequence, for every ring size, layout, mask, padding case, GQA and dtype,
 * with the tolerance rule of the kernel suite; accuracy versus ring size;
 * determinism under a jittery link; stats; failures and deadlines. */
#include <criterion/criterion.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref.h"
#include "stria_ring.h"

static const stria_layout_kind_t all_layouts[] = {STRIA_LAYOUT_STRIPED, STRIA_LAYOUT_CONTIGUOUS,
                                                  STRIA_LAYOUT_ZIGZAG};

typedef struct {
    int n;
    stria_layout_kind_t layout;
    bool causal;
    int64_t B, S, H, Hkv, D;
    stria_dtype_t dtype;
} rcase_t;

/* Inputs (fp32 values exactly representable in the dtype, and the dtype
 * storage) and the ring's fp32 outputs. */
typedef struct {
    size_t nq, nk, nl;
    float *q, *k, *v, *g;
    void *qs, *ks, *vs, *gs;
    float *o, *lse, *dq, *dk, *dv;
} rdata_t;

static void data_init(const rcase_t *c, rdata_t *d, uint64_t seed)
{
    size_t es = stria_dtype_size(c->dtype);
    memset(d, 0, sizeof(*d));
    d->nq = (size_t)(c->B * c->S * c->H * c->D);
    d->nk = (size_t)(c->B * c->S * c->Hkv * c->D);
    d->nl = (size_t)(c->B * c->H * c->S);
    d->q = malloc(d->nq * 4), d->g = malloc(d->nq * 4);
    d->k = malloc(d->nk * 4), d->v = malloc(d->nk * 4);
    d->qs = malloc(d->nq * es), d->gs = malloc(d->nq * es);
    d->ks = malloc(d->nk * es), d->vs = malloc(d->nk * es);
    d->o = malloc(d->nq * 4), d->dq = malloc(d->nq * 4);
    d->dk = malloc(d->nk * 4), d->dv = malloc(d->nk * 4);
    d->lse = malloc(d->nl * 4);
    ref_fill(d->q, d->nq, seed * 4 + 1, 2.0f, c->dtype);
    ref_fill(d->k, d->nk, seed * 4 + 2, 2.0f, c->dtype);
    ref_fill(d->v, d->nk, seed * 4 + 3, 1.0f, c->dtype);
    ref_fill(d->g, d->nq, seed * 4 + 4, 1.0f, c->dtype);
    ref_to_dtype(d->q, d->nq, c->dtype, d->qs);
    ref_to_dtype(d->k, d->nk, c->dtype, d->ks);
    ref_to_dtype(d->v, d->nk, c->dtype, d->vs);
    ref_to_dtype(d->g, d->nq, c->dtype, d->gs);
}

static void data_free(rdata_t *d)
{
    void *all[] = {d->q,  d->k, d->v,   d->g,  d->qs, d->ks, d->vs,
                   d->gs, d->o, d->lse, d->dq, d->dk, d->dv};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        free(all[i]);
}

static stria_ring_shape_t shape_of(const rcase_t *c)
{
    stria_ring_shape_t s = {.batch = c->B,
                            .seq = c->S,
                            .heads = c->H,
                            .kv_heads = c->Hkv,
                            .head_dim = c->D,
                            .causal = c->causal,
                            .dtype = c->dtype};
    return s;
}

static stria_status_t ring_run(const rcase_t *c, rdata_t *d, stria_ring_local_stats_t *stats)
{
    stria_ring_shape_t shape = shape_of(c);
    stria_ring_local_opts_t opts = {.layout = c->layout,
                                    .n_ranks = c->n,
                                    .passes = STRIA_RING_PASS_FWD_BWD,
                                    .step_timeout_s = 60};
    stria_ring_local_io_t io = {.q = d->qs,
                                .k = d->ks,
                                .v = d->vs,
                                .o = d->o,
                                .o_dtype = STRIA_DTYPE_F32,
                                .lse = d->lse,
                                .d_o = d->gs,
                                .dq = d->dq,
                                .dk = d->dk,
                                .dv = d->dv,
                                .grad_dtype = STRIA_DTYPE_F32};
    return stria_ring_run_local(&shape, &opts, &io, stats);
}

typedef struct {
    double o, lse, dq, dk, dv;
} errs_t;

static errs_t errs_vs(const rdata_t *d, const ref_out_t *r)
{
    errs_t e = {ref_max_err_f32(d->o, r->o, d->nq), ref_max_err_f32(d->lse, r->lse, d->nl),
                ref_max_err_f32(d->dq, r->dq, d->nq), ref_max_err_f32(d->dk, r->dk, d->nk),
                ref_max_err_f32(d->dv, r->dv, d->nk)};
    return e;
}

static ref_shape_t ref_shape(const rcase_t *c)
{
    ref_shape_t rs = {c->B,      c->S, c->S, c->H, c->Hkv, c->D, 1.0 / sqrt((double)c->D),
                      c->causal, NULL, NULL};
    return rs;
}

#define FLOOR_REL 2e-6

static void check_err(const char *what, double err, double naive_err, double maxabs,
                      const rcase_t *c)
{
    double tol = 2.0 * naive_err + FLOOR_REL * (1.0 + maxabs);
    cr_expect(err <= tol,
              "%s: N=%d %s %s S=%lld B=%lld H=%lld/%lld D=%lld %s: error %.3g > tolerance %.3g "
              "(yardstick error %.3g, max |ref| %.3g)",
              what, c->n, stria_layout_kind_name(c->layout), c->causal ? "causal" : "non-causal",
              (long long)c->S, (long long)c->B, (long long)c->H, (long long)c->Hkv, (long long)c->D,
              stria_dtype_name(c->dtype), err, tol, naive_err, maxabs);
}

/* The ring against the fp64 reference of the global sequence, within the
 * kernel tolerance rule (2x the naive fp32 error plus a small floor; for O
 * and the gradients of bf16 inputs on the bf16 dot product, 2x the error of
 * the same computation done in bf16 by PyTorch's math SDPA, as in the
 * kernel suite). */
static void check_case(const rcase_t *c)
{
    rdata_t d;
    ref_out_t r64, r32, ry;
    ref_shape_t rs = ref_shape(c);
    const bool bf16_dot = c->dtype == STRIA_DTYPE_BF16 && ref_bf16_dot(stria_kernels_variant());

    data_init(c, &d, (uint64_t)(c->S * 31 + c->n));
    cr_assert_eq(ring_run(c, &d, NULL), STRIA_OK, "N=%d %s S=%lld: %s", c->n,
                 stria_layout_kind_name(c->layout), (long long)c->S, stria_error_msg());
    ref_f64_run(&rs, d.q, d.k, d.v, d.g, &r64);
    ref_f32_run(&rs, d.q, d.k, d.v, d.g, &r32);
    if (bf16_dot)
        ref_bf16_run_masks(&rs, NULL, d.q, d.k, d.v, d.g, &ry);
    const ref_out_t *y = bf16_dot ? &ry : &r32;
    errs_t e = errs_vs(&d, &r64);
    check_err("O", e.o, ref_max_err_f64(y->o, r64.o, d.nq), ref_max_abs(r64.o, d.nq), c);
    check_err("LSE", e.lse, ref_max_err_f64(r32.lse, r64.lse, d.nl), ref_max_abs(r64.lse, d.nl), c);
    check_err("dQ", e.dq, ref_max_err_f64(y->dq, r64.dq, d.nq), ref_max_abs(r64.dq, d.nq), c);
    check_err("dK", e.dk, ref_max_err_f64(y->dk, r64.dk, d.nk), ref_max_abs(r64.dk, d.nk), c);
    check_err("dV", e.dv, ref_max_err_f64(y->dv, r64.dv, d.nk), ref_max_abs(r64.dv, d.nk), c);
    if (bf16_dot) {
        cr_log_info("bf16 bar: N=%d S=%lld: O %.2f dQ %.2f dK %.2f dV %.2f x the bf16 math error",
                    c->n, (long long)c->S, e.o / ref_max_err_f64(ry.o, r64.o, d.nq),
                    e.dq / ref_max_err_f64(ry.dq, r64.dq, d.nq),
                    e.dk / ref_max_err_f64(ry.dk, r64.dk, d.nk),
                    e.dv / ref_max_err_f64(ry.dv, r64.dv, d.nk));
        ref_out_free(&ry);
    }
    ref_out_free(&r64);
    ref_out_free(&r32);
    data_free(&d);
}

/* Every layout, mask and padding case for one ring size: lengths divisible
 * by 2N, divisible by N only, divisible by neither, and shorter than the
 * ring; fp32 with GQA 4/2 and bf16 with GQA 4/1. */
static void check_ring_size(int n, stria_dtype_t dtype)
{
    int64_t m = n >= 48 ? 1 : 48 / n;
    int64_t lens[] = {2 * n * m, n * (2 * m + 1), 2 * n * m + 1, n > 2 ? n - 1 : 1};
    size_t n_lens = n > 1 ? 4 : 3;
    for (size_t li = 0; li < n_lens; li++)
        for (size_t k = 0; k < 3; k++)
            for (int causal = 0; causal < 2; causal++) {
                rcase_t c = {.n = n,
                             .layout = all_layouts[k],
                             .causal = causal,
                             .B = 2,
                             .S = lens[li],
                             .H = 4,
                             .Hkv = dtype == STRIA_DTYPE_F32 ? 2 : 1,
                             .D = dtype == STRIA_DTYPE_F32 ? 32 : 64,
                             .dtype = dtype};
                check_case(&c);
            }
}

Test(ring, n1_fp32)
{
    check_ring_size(1, STRIA_DTYPE_F32);
}
Test(ring, n1_bf16)
{
    check_ring_size(1, STRIA_DTYPE_BF16);
}
Test(ring, n2_fp32)
{
    check_ring_size(2, STRIA_DTYPE_F32);
}
Test(ring, n2_bf16)
{
    check_ring_size(2, STRIA_DTYPE_BF16);
}
Test(ring, n3_fp32)
{
    check_ring_size(3, STRIA_DTYPE_F32);
}
Test(ring, n3_bf16)
{
    check_ring_size(3, STRIA_DTYPE_BF16);
}
Test(ring, n4_fp32)
{
    check_ring_size(4, STRIA_DTYPE_F32);
}
Test(ring, n4_bf16)
{
    check_ring_size(4, STRIA_DTYPE_BF16);
}
Test(ring, n8_fp32)
{
    check_ring_size(8, STRIA_DTYPE_F32);
}
Test(ring, n8_bf16)
{
    check_ring_size(8, STRIA_DTYPE_BF16);
}

/* fp16 storage and a non-default scale go through the same path. */
Test(ring, fp16_and_custom_scale)
{
    rcase_t c = {.n = 3,
                 .layout = STRIA_LAYOUT_ZIGZAG,
                 .causal = true,
                 .B = 1,
                 .S = 50,
                 .H = 2,
                 .Hkv = 2,
                 .D = 16,
                 .dtype = STRIA_DTYPE_F16};
    check_case(&c);
}

/* ---- documents and sliding windows ----------------------------------- */

static stria_status_t ring_run_masks(const rcase_t *c, const ref_masks_t *m, rdata_t *d,
                                     stria_ring_local_stats_t *stats)
{
    stria_ring_shape_t shape = shape_of(c);
    if (m != NULL) {
        shape.cu_seqlens = m->cu_seqlens;
        shape.n_cu_seqlens = m->n_cu;
        shape.has_window = m->has_window;
        shape.window_left = m->left;
        shape.window_right = m->right;
    }
    stria_ring_local_opts_t opts = {.layout = c->layout,
                                    .n_ranks = c->n,
                                    .passes = STRIA_RING_PASS_FWD_BWD,
                                    .step_timeout_s = 60};
    stria_ring_local_io_t io = {.q = d->qs,
                                .k = d->ks,
                                .v = d->vs,
                                .o = d->o,
                                .o_dtype = STRIA_DTYPE_F32,
                                .lse = d->lse,
                                .d_o = d->gs,
                                .dq = d->dq,
                                .dk = d->dk,
                                .dv = d->dv,
                                .grad_dtype = STRIA_DTYPE_F32};
    return stria_ring_run_local(&shape, &opts, &io, stats);
}

/* The ring's results against the fp64 and fp32 references, within the
 * tolerance rule; ry (NULL: none) the bf16 math yardstick of O and the
 * gradients (see check_case). */
static void check_vs_refs(const rcase_t *c, const rdata_t *d, const ref_out_t *r64,
                          const ref_out_t *r32, const ref_out_t *ry, const char *name)
{
    const ref_out_t *y = ry != NULL ? ry : r32;
    errs_t e = errs_vs(d, r64);
    char w[5][96];
    const char *what[5] = {"O", "LSE", "dQ", "dK", "dV"};
    for (int i = 0; i < 5; i++)
        snprintf(w[i], sizeof(w[i]), "%s (%s)", what[i], name);
    check_err(w[0], e.o, ref_max_err_f64(y->o, r64->o, d->nq), ref_max_abs(r64->o, d->nq), c);
    check_err(w[1], e.lse, ref_max_err_f64(r32->lse, r64->lse, d->nl), ref_max_abs(r64->lse, d->nl),
              c);
    check_err(w[2], e.dq, ref_max_err_f64(y->dq, r64->dq, d->nq), ref_max_abs(r64->dq, d->nq), c);
    check_err(w[3], e.dk, ref_max_err_f64(y->dk, r64->dk, d->nk), ref_max_abs(r64->dk, d->nk), c);
    check_err(w[4], e.dv, ref_max_err_f64(y->dv, r64->dv, d->nk), ref_max_abs(r64->dv, d->nk), c);
}

/* The ring with masks, in every layout, against the fp64 reference with the
 * same masks (computed once), within the tolerance rule. */
static void check_masks_every_layout(rcase_t c, const ref_masks_t *m, const char *name)
{
    rdata_t d;
    ref_out_t r64, r32, ry;
    ref_shape_t rs = ref_shape(&c);
    const bool bf16_dot = c.dtype == STRIA_DTYPE_BF16 && ref_bf16_dot(stria_kernels_variant());
    data_init(&c, &d, (uint64_t)(c.S * 17 + c.n));
    ref_f64_run_masks(&rs, m, d.q, d.k, d.v, d.g, &r64);
    ref_f32_run_masks(&rs, m, d.q, d.k, d.v, d.g, &r32);
    if (bf16_dot)
        ref_bf16_run_masks(&rs, m, d.q, d.k, d.v, d.g, &ry);
    for (size_t k = 0; k < 3; k++) {
        c.layout = all_layouts[k];
        cr_assert_eq(ring_run_masks(&c, m, &d, NULL), STRIA_OK, "%s, %s: %s", name,
                     stria_layout_kind_name(c.layout), stria_error_msg());
        check_vs_refs(&c, &d, &r64, &r32, bf16_dot ? &ry : NULL, name);
    }
    ref_out_free(&r64);
    ref_out_free(&r32);
    if (bf16_dot)
        ref_out_free(&ry);
    data_free(&d);
}

static const int64_t docs_1024[] = {0, 1, 17, 300, 301, 1024};

Test(ring, documents_every_layout_causal, .timeout = 600)
{
    rcase_t c = {.n = 4,
                 .causal = true,
                 .B = 1,
                 .S = 1024,
                 .H = 4,
                 .Hkv = 2,
                 .D = 64,
                 .dtype = STRIA_DTYPE_F32};
    ref_masks_t m = {.cu_seqlens = docs_1024, .n_cu = 6};
    check_masks_every_layout(c, &m, "documents, causal");
}

Test(ring, documents_every_layout_non_causal, .timeout = 600)
{
    rcase_t c = {.n = 4,
                 .causal = false,
                 .B = 1,
                 .S = 1024,
                 .H = 4,
                 .Hkv = 2,
                 .D = 64,
                 .dtype = STRIA_DTYPE_F32};
    ref_masks_t m = {.cu_seqlens = docs_1024, .n_cu = 6};
    check_masks_every_layout(c, &m, "documents, non-causal");
}

Test(ring, causal_window_every_layout, .timeout = 600)
{
    rcase_t c = {.n = 4,
                 .causal = true,
                 .B = 1,
                 .S = 512,
                 .H = 4,
                 .Hkv = 2,
                 .D = 64,
                 .dtype = STRIA_DTYPE_F32};
    ref_masks_t m = {.has_window = true, .left = 255, .right = 0};
    check_masks_every_layout(c, &m, "window 255,0, causal");
}

/* A causal window of 255 tokens at S = 2048 over 4 ranks, contiguous
 * (shards of 512): rank r sees only its own block and rank r - 1's, so the
 * forward runs 2 steps and each rank sends one K/V block (and the 3 tokens
 * of the closing agreement), not 3. The backward keeps its N steps (its
 * dK/dV sums travel home). Results within the tolerance of the fp64
 * reference. */
Test(ring, causal_window_skips_hops_under_contiguous, .timeout = 600)
{
    enum { N = 4 };
    rcase_t c = {.n = N,
                 .layout = STRIA_LAYOUT_CONTIGUOUS,
                 .causal = true,
                 .B = 1,
                 .S = 2048,
                 .H = 4,
                 .Hkv = 2,
                 .D = 64,
                 .dtype = STRIA_DTYPE_F32};
    ref_masks_t m = {.has_window = true, .left = 255, .right = 0};
    stria_ring_step_stats_t fwd[N * N], bwd[N * N];
    stria_ring_local_stats_t stats = {.fwd_steps = fwd, .bwd_steps = bwd};
    const uint64_t msg = 2u * 512 * 2 * 64 * 4, agree = (N - 1) * sizeof(uint64_t);
    rdata_t d;
    ref_out_t r64, r32;
    ref_shape_t rs = ref_shape(&c);
    data_init(&c, &d, 2048);
    cr_assert_eq(ring_run_masks(&c, &m, &d, &stats), STRIA_OK, "%s", stria_error_msg());
    for (int r = 0; r < N; r++) {
        const stria_ring_step_stats_t *f = fwd + r * N, *b = bwd + r * N;
        uint64_t sent = 0;
        for (int s = 0; s < N; s++)
            sent += f[s].bytes_sent;
        cr_expect_eq(f[0].bytes_sent, msg, "rank %d step 0 sent %llu bytes, one K/V block is %llu",
                     r, (unsigned long long)f[0].bytes_sent, (unsigned long long)msg);
        cr_expect_eq(f[1].bytes_sent, agree, "rank %d: the last step carries only the agreement",
                     r);
        cr_expect_eq(f[2].bytes_sent + f[3].bytes_sent + f[2].bytes_recv + f[3].bytes_recv, 0,
                     "rank %d ran steps 2 and 3", r);
        cr_expect(!f[2].computed && !f[3].computed, "rank %d computed past step 1", r);
        cr_expect_eq(sent, msg + agree, "rank %d forward sent %llu bytes", r,
                     (unsigned long long)sent);
        cr_expect_eq(f[1].computed, r > 0, "rank %d step 1 (block of rank %d)", r, f[1].src_rank);
        cr_expect_gt(b[N - 1].bytes_sent, 0, "rank %d: the backward lost its last step", r);
    }
    ref_f64_run_masks(&rs, &m, d.q, d.k, d.v, d.g, &r64);
    ref_f32_run_masks(&rs, &m, d.q, d.k, d.v, d.g, &r32);
    check_vs_refs(&c, &d, &r64, &r32, NULL, "window 255,0 over 2048 tokens, contiguous");
    /* Striped spreads every window over every rank: all N steps. */
    c.layout = STRIA_LAYOUT_STRIPED;
    cr_assert_eq(ring_run_masks(&c, &m, &d, &stats), STRIA_OK, "%s", stria_error_msg());
    for (int r = 0; r < N; r++)
        cr_expect_eq(fwd[r * N + N - 2].bytes_sent, msg, "striped rank %d skipped a hop", r);
    check_vs_refs(&c, &d, &r64, &r32, NULL, "window 255,0 over 2048 tokens, striped");
    ref_out_free(&r64);
    ref_out_free(&r32);
    data_free(&d);
}

Test(ring, window_and_documents_every_layout, .timeout = 600)
{
    /* S not a multiple of 2N (padding), bf16, a two-sided window. */
    static const int64_t cu[] = {0, 40, 40, 170, 301};
    rcase_t c = {.n = 3,
                 .causal = false,
                 .B = 2,
                 .S = 301,
                 .H = 4,
                 .Hkv = 1,
                 .D = 32,
                 .dtype = STRIA_DTYPE_BF16};
    ref_masks_t m = {.cu_seqlens = cu, .n_cu = 5, .has_window = true, .left = 33, .right = 70};
    check_masks_every_layout(c, &m, "documents and window 33,70");
    c.causal = true;
    m.right = -1;
    m.left = 20;
    check_masks_every_layout(c, &m, "documents and window 20,-1, causal");
}

/* One document over the whole sequence changes no bit. */
Test(ring, one_document_is_bit_identical_to_none)
{
    int64_t cu[] = {0, 200};
    ref_masks_t m = {.cu_seqlens = cu, .n_cu = 2};
    for (size_t k = 0; k < 3; k++)
        for (int causal = 0; causal < 2; causal++) {
            rcase_t c = {.n = 4,
                         .layout = all_layouts[k],
                         .causal = causal,
                         .B = 1,
                         .S = 200,
                         .H = 4,
                         .Hkv = 2,
                         .D = 64,
                         .dtype = STRIA_DTYPE_F32};
            rdata_t a, b;
            data_init(&c, &a, 7);
            data_init(&c, &b, 7);
            cr_assert_eq(ring_run_masks(&c, NULL, &a, NULL), STRIA_OK, "%s", stria_error_msg());
            cr_assert_eq(ring_run_masks(&c, &m, &b, NULL), STRIA_OK, "%s", stria_error_msg());
            cr_expect(memcmp(a.o, b.o, a.nq * 4) == 0, "O differs (%s)",
                      stria_layout_kind_name(c.layout));
            cr_expect(memcmp(a.lse, b.lse, a.nl * 4) == 0, "LSE differs");
            cr_expect(memcmp(a.dq, b.dq, a.nq * 4) == 0, "dQ differs");
            cr_expect(memcmp(a.dk, b.dk, a.nk * 4) == 0, "dK differs");
            cr_expect(memcmp(a.dv, b.dv, a.nk * 4) == 0, "dV differs");
            data_free(&a);
            data_free(&b);
        }
}

Test(ring, bad_masks_refused)
{
    rcase_t c = {.n = 2,
                 .layout = STRIA_LAYOUT_STRIPED,
                 .causal = true,
                 .B = 1,
                 .S = 64,
                 .H = 2,
                 .Hkv = 2,
                 .D = 16,
                 .dtype = STRIA_DTYPE_F32};
    static const int64_t starts1[] = {1, 64}, short_end[] = {0, 10, 63}, dec[] = {0, 30, 20, 64};
    struct {
        ref_masks_t m;
        const char *needle;
    } bad[] = {
        {{.cu_seqlens = starts1, .n_cu = 2}, "start at 0 and end at seq"},
        {{.cu_seqlens = short_end, .n_cu = 3}, "end at seq (64)"},
        {{.cu_seqlens = dec, .n_cu = 4}, "decreases at entry 2"},
        {{.cu_seqlens = NULL, .n_cu = 3}, "cu_seqlens is NULL"},
        {{.has_window = true, .left = -2}, "window_left (-2)"},
        {{.has_window = true, .left = 3, .right = 1}, "window_right is 1 with causal"},
        {{.has_window = false, .left = 3}, "has_window is false"},
    };
    rdata_t d;
    data_init(&c, &d, 3);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_expect_eq(ring_run_masks(&c, &bad[i].m, &d, NULL), STRIA_ERR_INVALID_ARG, "case %zu", i);
        cr_expect(strstr(stria_error_msg(), bad[i].needle) != NULL, "case %zu: '%s' lacks '%s'", i,
                  stria_error_msg(), bad[i].needle);
    }
    data_free(&d);
}

/* Rounds fp32 values to bf16 and back, in place. */
static void round_bf16(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = stria_bf16_to_f32(stria_f32_to_bf16(x[i]));
}

/* Accuracy must not drift with ring size (the ring-flash-attention failure:
 * partial outputs rounded to bf16 between steps). bf16 inputs; O, dQ, dK, dV
 * as a bf16 trainer receives them (rounded once to bf16), LSE in fp32: the
 * error against fp64 at N = 8 must stay within 1.5x the error at N = 1. The
 * fp32 LSE is compared above a floor of 4 fp32 ulps of its largest value:
 * each merge rounds once, so LSE errors move by single ulps with N. */
Test(ring, accuracy_does_not_drift_with_ring_size)
{
    for (size_t k = 0; k < 3; k++) {
        double e[2][5], fp32_err[2][5], lse_max = 0;
        int sizes[2] = {1, 8};
        for (int i = 0; i < 2; i++) {
            rcase_t c = {.n = sizes[i],
                         .layout = all_layouts[k],
                         .causal = true,
                         .B = 1,
                         .S = 512,
                         .H = 2,
                         .Hkv = 1,
                         .D = 64,
                         .dtype = STRIA_DTYPE_BF16};
            rdata_t d;
            ref_out_t r64;
            ref_shape_t rs = ref_shape(&c);
            data_init(&c, &d, 99);
            cr_assert_eq(ring_run(&c, &d, NULL), STRIA_OK, "%s", stria_error_msg());
            ref_f64_run(&rs, d.q, d.k, d.v, d.g, &r64);
            errs_t f = errs_vs(&d, &r64);
            double f32[5] = {f.o, f.lse, f.dq, f.dk, f.dv};
            memcpy(fp32_err[i], f32, sizeof(f32));
            round_bf16(d.o, d.nq);
            round_bf16(d.dq, d.nq);
            round_bf16(d.dk, d.nk);
            round_bf16(d.dv, d.nk);
            errs_t b = errs_vs(&d, &r64);
            double bf[5] = {b.o, b.lse, b.dq, b.dk, b.dv};
            memcpy(e[i], bf, sizeof(bf));
            lse_max = ref_max_abs(r64.lse, d.nl);
            ref_out_free(&r64);
            data_free(&d);
        }
        const char *names[] = {"O", "LSE", "dQ", "dK", "dV"};
        for (int m = 0; m < 5; m++) {
            double floor = m == 1 ? 4.0 * lse_max * 0x1p-23 : 0.0;
            cr_log_info("%s %s: error N=1 %.3g, N=8 %.3g (fp32 outputs: %.3g, %.3g)",
                        stria_layout_kind_name(all_layouts[k]), names[m], e[0][m], e[1][m],
                        fp32_err[0][m], fp32_err[1][m]);
            cr_expect(e[1][m] <= 1.5 * e[0][m] + floor,
                      "%s %s: error at N=8 %.3g > 1.5 x error at N=1 %.3g (+ %.3g)",
                      stria_layout_kind_name(all_layouts[k]), names[m], e[1][m], e[0][m], floor);
        }
    }
}

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

static bool same_bits(const void *a, const void *b, size_t n, const char *what, int rank,
                      const rcase_t *c)
{
    bool same = memcmp(a, b, n) == 0;
    cr_expect(same, "%s differs on rank %d: N=%d %s %s S=%lld H=%lld/%lld %s", what, rank, c->n,
              stria_layout_kind_name(c->layout), c->causal ? "causal" : "non-causal",
              (long long)c->S, (long long)c->H, (long long)c->Hkv, stria_dtype_name(c->dtype));
    return same;
}

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
    /* rank 0 now fails at once instead of waiting */
    stria_link_req_t *req;
    cr_assert_eq(stria_link_irecv(links[0], 1, buf, 4, &req) == STRIA_OK
                     ? stria_link_wait(links[0], req, 10)
                     : STRIA_ERR_PEER,
                 STRIA_ERR_PEER);
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
    stria_ring_shape_t s = {
        .batch = 1, .seq = 10, .heads = 4, .kv_heads = 3, .head_dim = 32, .dtype = STRIA_DTYPE_F32};

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
    s.seq = 0;
    cr_expect_eq(stria_ring_pass_create(link, &s, STRIA_LAYOUT_STRIPED, NULL, &pass),
                 STRIA_ERR_INVALID_ARG);
    s.seq = 10;
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
    stria_ring_shape_t s = {
        .batch = 1, .seq = 40, .heads = 2, .kv_heads = 1, .head_dim = 16, .dtype = STRIA_DTYPE_F32};

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
