/* Kernel suite: every CPU variant against an fp64 reference, with the
 * tolerance rule of the architecture: the error must stay within 2x the error
 * of a plain fp32 implementation on the same inputs, plus a small floor. A
 * variant that runs bf16 inputs on the bf16 dot product (P and dS rounded to
 * bf16, as FlashAttention does) is held to FlashAttention's bar instead for
 * O, dQ, dK and dV: 2x the error of the same computation done in bf16 by
 * PyTorch's math SDPA (ref_bf16_run_masks), plus the floor. */
#include <criterion/criterion.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_expect.h"
#include "ref.h"
#include "stria_kernels.h"

typedef struct {
    int64_t B, Tq, Tk, H, Hkv, D;
    bool causal;
    stria_dtype_t dtype;
    stria_pos_run_t qruns[4];
    size_t n_qruns;
    stria_pos_run_t kruns[4];
    size_t n_kruns;
    int threads;
    float scale; /* 0 = default */
    /* documents and window (stria_attn_params_t's fields; zero: none) */
    const int64_t *cu;
    size_t n_cu;
    bool has_window;
    int64_t left, right;
} kcase_t;

/* The case's masks on params p, and as the reference takes them. */
static void case_masks(const kcase_t *c, stria_attn_params_t *p, ref_masks_t *m)
{
    p->cu_seqlens = c->cu;
    p->n_cu_seqlens = c->n_cu;
    p->has_window = c->has_window;
    p->window_left = c->left;
    p->window_right = c->right;
    m->cu_seqlens = c->cu;
    m->n_cu = c->n_cu;
    m->has_window = c->has_window;
    m->left = c->left;
    m->right = c->right;
}

static int64_t *expand(const stria_pos_run_t *runs, size_t n_runs, int64_t tokens)
{
    int64_t *pos = malloc((size_t)tokens * sizeof(int64_t));
    int64_t n = 0;
    if (n_runs == 0)
        for (int64_t i = 0; i < tokens; i++)
            pos[i] = i;
    for (size_t r = 0; r < n_runs; r++)
        for (int64_t i = 0; i < runs[r].count; i++)
            pos[n++] = runs[r].first + i * runs[r].stride;
    return pos;
}

typedef struct {
    double o, lse, dq, dk, dv;
} errs_t;

/* Floor of the tolerance rule: relative to the size of the values compared. */
#define FLOOR_REL 2e-6

static void check_err(const char *what, double err, double naive_err, double maxabs,
                      const char *variant, const kcase_t *c)
{
    double tol = 2.0 * naive_err + FLOOR_REL * (1.0 + maxabs);
    if (ref_bf16_dot(variant) && c->dtype == STRIA_DTYPE_BF16 && strcmp(what, "LSE") != 0)
        cr_log_info("bf16 bar: %s D=%lld Tq=%lld Tk=%lld: error %.3g = %.2f x the bf16 math error "
                    "%.3g",
                    what, (long long)c->D, (long long)c->Tq, (long long)c->Tk, err,
                    naive_err > 0 ? err / naive_err : 0.0, naive_err);
    cr_expect(err <= tol,
              "%s: variant %s dtype %s D=%lld Tq=%lld Tk=%lld H=%lld/%lld causal=%d threads=%d "
              "docs=%zu window=%d(%lld,%lld) q_first=%lld stride=%lld k_first=%lld stride=%lld: "
              "error %.3g > tolerance %.3g (yardstick error %.3g, max |ref| %.3g)",
              what, variant, stria_dtype_name(c->dtype), (long long)c->D, (long long)c->Tq,
              (long long)c->Tk, (long long)c->H, (long long)c->Hkv, c->causal, c->threads, c->n_cu,
              c->has_window, (long long)c->left, (long long)c->right, (long long)c->qruns[0].first,
              (long long)c->qruns[0].stride, (long long)c->kruns[0].first,
              (long long)c->kruns[0].stride, err, tol, naive_err, maxabs);
}

static void run_case(const kcase_t *c, const char *variant)
{
    size_t nq = (size_t)(c->B * c->Tq * c->H * c->D);
    size_t nk = (size_t)(c->B * c->Tk * c->Hkv * c->D);
    size_t nl = (size_t)(c->B * c->H * c->Tq);
    size_t es = stria_dtype_size(c->dtype);
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *g = malloc(nq * 4);
    void *qs = malloc(nq * es), *ks = malloc(nk * es), *vs = malloc(nk * es), *gs = malloc(nq * es);
    float *o = malloc(nq * 4), *lse = malloc(nl * 4), *delta = malloc(nl * 4);
    float *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nk, 4);
    int64_t *qpos = expand(c->qruns, c->n_qruns, c->Tq);
    int64_t *kpos = expand(c->kruns, c->n_kruns, c->Tk);
    stria_pool_t *pool = NULL;

    cr_assert_eq(stria_kernels_set_variant(variant), STRIA_OK, "%s", stria_error_msg());
    if (c->threads > 1)
        cr_assert_eq(stria_pool_create(c->threads, &pool), STRIA_OK);
    ref_fill(q, nq, 1 + (uint64_t)c->D, 1.0f, c->dtype);
    ref_fill(k, nk, 2 + (uint64_t)c->Tk, 1.0f, c->dtype);
    ref_fill(v, nk, 3, 1.0f, c->dtype);
    ref_fill(g, nq, 4, 1.0f, c->dtype);
    ref_to_dtype(q, nq, c->dtype, qs);
    ref_to_dtype(k, nk, c->dtype, ks);
    ref_to_dtype(v, nk, c->dtype, vs);
    ref_to_dtype(g, nq, c->dtype, gs);

    stria_attn_params_t p = {0};
    p.batch = c->B;
    p.q_tokens = c->Tq;
    p.kv_tokens = c->Tk;
    p.heads = c->H;
    p.kv_heads = c->Hkv;
    p.head_dim = c->D;
    p.scale = c->scale;
    p.causal = c->causal;
    p.q_pos.runs = c->n_qruns ? c->qruns : NULL;
    p.q_pos.n_runs = c->n_qruns;
    p.kv_pos.runs = c->n_kruns ? c->kruns : NULL;
    p.kv_pos.n_runs = c->n_kruns;
    p.pool = pool;
    ref_masks_t masks;
    case_masks(c, &p, &masks);
    stria_tensor_t tq = stria_tensor_contiguous(qs, c->dtype, c->Tq, c->H, c->D);
    stria_tensor_t tk = stria_tensor_contiguous(ks, c->dtype, c->Tk, c->Hkv, c->D);
    stria_tensor_t tv = stria_tensor_contiguous(vs, c->dtype, c->Tk, c->Hkv, c->D);
    stria_tensor_t tg = stria_tensor_contiguous(gs, c->dtype, c->Tq, c->H, c->D);
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, c->Tq, c->H, c->D);
    stria_tensor_t tdq = stria_tensor_contiguous(dq, STRIA_DTYPE_F32, c->Tq, c->H, c->D);
    stria_tensor_t tdk = stria_tensor_contiguous(dk, STRIA_DTYPE_F32, c->Tk, c->Hkv, c->D);
    stria_tensor_t tdv = stria_tensor_contiguous(dv, STRIA_DTYPE_F32, c->Tk, c->Hkv, c->D);

    cr_assert_eq(stria_attn_fwd(&p, &tq, &tk, &tv, &to, lse, false), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_attn_bwd_delta(&p, &to, &tg, delta), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_bwd(&p, &tq, &tk, &tv, &tg, lse, delta, &tdq, &tdk, &tdv), STRIA_OK,
                 "%s", stria_error_msg());

    ref_shape_t rs = {c->B,
                      c->Tq,
                      c->Tk,
                      c->H,
                      c->Hkv,
                      c->D,
                      c->scale > 0 ? c->scale : 1.0 / sqrt((double)c->D),
                      c->causal,
                      qpos,
                      kpos};
    ref_out_t r64, r32, ry;
    ref_f64_run_masks(&rs, &masks, q, k, v, g, &r64);
    ref_f32_run_masks(&rs, &masks, q, k, v, g, &r32);
    /* the yardstick of O and the gradients: fp32, or bf16 math (see the top) */
    const bool bf16_dot = c->dtype == STRIA_DTYPE_BF16 && ref_bf16_dot(variant);
    if (bf16_dot)
        ref_bf16_run_masks(&rs, &masks, q, k, v, g, &ry);
    const ref_out_t *y = bf16_dot ? &ry : &r32;

    check_err("O", ref_max_err_f32(o, r64.o, nq), ref_max_err_f64(y->o, r64.o, nq),
              ref_max_abs(r64.o, nq), variant, c);
    check_err("LSE", ref_max_err_f32(lse, r64.lse, nl), ref_max_err_f64(r32.lse, r64.lse, nl),
              ref_max_abs(r64.lse, nl), variant, c);
    check_err("dQ", ref_max_err_f32(dq, r64.dq, nq), ref_max_err_f64(y->dq, r64.dq, nq),
              ref_max_abs(r64.dq, nq), variant, c);
    check_err("dK", ref_max_err_f32(dk, r64.dk, nk), ref_max_err_f64(y->dk, r64.dk, nk),
              ref_max_abs(r64.dk, nk), variant, c);
    check_err("dV", ref_max_err_f32(dv, r64.dv, nk), ref_max_err_f64(y->dv, r64.dv, nk),
              ref_max_abs(r64.dv, nk), variant, c);

    ref_out_free(&r64);
    ref_out_free(&r32);
    if (bf16_dot)
        ref_out_free(&ry);
    stria_pool_destroy(pool);
    free(q), free(k), free(v), free(g), free(qs), free(ks), free(vs), free(gs);
    free(o), free(lse), free(delta), free(dq), free(dk), free(dv), free(qpos), free(kpos);
}

/* Runs the case on every variant this CPU supports, and fails unless the
 * portable one and every SIMD variant the CPU has (cpu_expect.h) ran. */
static void for_each_variant(const kcase_t *c)
{
    const char *const *names = stria_kernels_variant_names();
    const char *expected[4];
    size_t n_expected = cpu_expected_simd(expected), simd_ran = 0;
    bool portable = false;
    for (size_t i = 0; names[i] != NULL; i++) {
        if (!stria_kernels_variant_available(names[i])) {
            cr_log_info("variant %s not supported by this CPU: skipped", names[i]);
            continue;
        }
        run_case(c, names[i]);
        portable |= strcmp(names[i], "portable") == 0;
        simd_ran += cpu_name_in(expected, names[i]);
    }
    cr_assert(portable, "the portable variant did not run");
    cr_assert_eq(simd_ran, n_expected, "%zu of the %zu SIMD variants this CPU supports ran",
                 simd_ran, n_expected);
}

static const stria_dtype_t all_dtypes[] = {STRIA_DTYPE_F32, STRIA_DTYPE_BF16, STRIA_DTYPE_F16};

Test(kernels, head_dims_dtypes_causal_gqa_odd_tokens)
{
    /* 40 and 72 are not multiples of the packed row padding (16): their K/V
     * score operands are packed, the others' read in place */
    static const int64_t dims[] = {16, 32, 40, 64, 72, 80, 96, 128, 256};
    for (size_t d = 0; d < sizeof(dims) / sizeof(dims[0]); d++)
        for (size_t t = 0; t < 3; t++) {
            kcase_t c = {.B = 2,
                         .Tq = 37,
                         .Tk = 37,
                         .H = 4,
                         .Hkv = 2,
                         .D = dims[d],
                         .causal = true,
                         .dtype = all_dtypes[t],
                         .threads = 1};
            for_each_variant(&c);
        }
}

Test(kernels, multi_tile_causal_and_noncausal)
{
    for (int causal = 0; causal < 2; causal++)
        for (size_t t = 0; t < 3; t++) {
            kcase_t c = {.B = 1,
                         .Tq = 157,
                         .Tk = 203,
                         .H = 2,
                         .Hkv = 1,
                         .D = 64,
                         .causal = causal,
                         .dtype = all_dtypes[t],
                         .threads = 2};
            c.qruns[0] = (stria_pos_run_t){46, 1, 157}; /* queries are the last 157 keys */
            c.n_qruns = 1;
            for_each_variant(&c);
        }
}

/* Striped attention, ring of 4, rank 1: the K/V block of source rank j holds
 * positions j, j+4, ...; the diagonal is included iff j <= 1. */
Test(kernels, striped_steps_diagonal_included_and_excluded)
{
    for (int64_t j = 0; j < 4; j++) {
        kcase_t c = {.B = 1,
                     .Tq = 100,
                     .Tk = 100,
                     .H = 2,
                     .Hkv = 2,
                     .D = 32,
                     .causal = true,
                     .dtype = STRIA_DTYPE_F32,
                     .threads = 1};
        c.qruns[0] = (stria_pos_run_t){1, 4, 100};
        c.n_qruns = 1;
        c.kruns[0] = (stria_pos_run_t){j, 4, 100};
        c.n_kruns = 1;
        for_each_variant(&c);
    }
}

/* A key whose position equals the last query position of a tile (64
 * queries) or of a sub-block (16): the pair straddles the mask by exactly
 * that one diagonal key, which the query at that position sees and no other
 * does. Classifying the pair as fully masked loses it: rows 15, 31, 47 or 63
 * then see no key at all. Keys end a little past the queries, so the
 * opposite boundary (a key block ending at the first query) is hit too. */
Test(kernels, diagonal_key_on_tile_and_subblock_boundaries)
{
    static const int64_t firsts[] = {15, 31, 47, 63};
    for (size_t f = 0; f < sizeof(firsts) / sizeof(firsts[0]); f++)
        for (size_t t = 0; t < 3; t++) {
            kcase_t c = {.B = 1,
                         .Tq = 64,
                         .Tk = 40,
                         .H = 2,
                         .Hkv = 1,
                         .D = 32,
                         .causal = true,
                         .dtype = all_dtypes[t],
                         .threads = 1};
            c.kruns[0] = (stria_pos_run_t){firsts[f], 1, 40};
            c.n_kruns = 1;
            for_each_variant(&c);
        }
    /* Keys ending exactly at a query tile's first position, then the rest. */
    kcase_t c = {.B = 1,
                 .Tq = 64,
                 .Tk = 80,
                 .H = 1,
                 .Hkv = 1,
                 .D = 16,
                 .causal = true,
                 .dtype = STRIA_DTYPE_F32,
                 .threads = 1};
    c.qruns[0] = (stria_pos_run_t){64, 1, 64};
    c.n_qruns = 1;
    c.kruns[0] = (stria_pos_run_t){1, 1, 64}; /* 1 .. 64: kmax equals the first query */
    c.kruns[1] = (stria_pos_run_t){127, 1, 16};
    c.n_kruns = 2;
    for_each_variant(&c);
}

/* Zigzag: two runs per block, and offset positions far from zero. */
Test(kernels, zigzag_runs_and_offsets)
{
    kcase_t c = {.B = 1,
                 .Tq = 80,
                 .Tk = 80,
                 .H = 1,
                 .Hkv = 1,
                 .D = 48,
                 .causal = true,
                 .dtype = STRIA_DTYPE_BF16,
                 .threads = 2};
    c.qruns[0] = (stria_pos_run_t){1000040, 1, 40};
    c.qruns[1] = (stria_pos_run_t){1000280, 1, 40};
    c.n_qruns = 2;
    c.kruns[0] = (stria_pos_run_t){1000000, 1, 40};
    c.kruns[1] = (stria_pos_run_t){1000300, 1, 40};
    c.n_kruns = 2;
    for_each_variant(&c);
}

/* Tiles that straddle the mask are computed by 16 x 16 sub-blocks. Striped
 * blocks put the straddling sub-blocks on the diagonal of every diagonal tile:
 * rings of 3 and 8, source ranks before, at and after the query rank (the
 * diagonal included or excluded), token counts that are multiples of neither
 * 16 nor 64, grouped-query heads, every storage dtype. */
Test(kernels, striped_subtiles_odd_lengths_gqa_dtypes)
{
    static const int64_t rings[] = {3, 8};
    for (size_t n = 0; n < 2; n++)
        for (int64_t j = 0; j < 3; j++)
            for (size_t t = 0; t < 3; t++) {
                int64_t N = rings[n], r = 1, src = j == 0 ? 0 : j == 1 ? r : N - 1;
                kcase_t c = {.B = 1,
                             .Tq = 150,
                             .Tk = 147,
                             .H = 4,
                             .Hkv = 2,
                             .D = 32,
                             .causal = true,
                             .dtype = all_dtypes[t],
                             .threads = 1};
                c.qruns[0] = (stria_pos_run_t){r, N, 150};
                c.n_qruns = 1;
                c.kruns[0] = (stria_pos_run_t){src, N, 147};
                c.n_kruns = 1;
                for_each_variant(&c);
            }
}

/* Sub-block paths positions can reach beyond striped blocks: a fully masked
 * key sub-block between visible ones of the same query chunk (set to -inf
 * inside the computed rows), a key sub-block computed for query chunks 0 and
 * 2 but not 1 (two runs of chunks in the dK/dV products), a query chunk that
 * sees no key of a straddling tile, and short last sub-blocks; for each
 * backward schedule (1, 2 and 9 threads). */
Test(kernels, subtile_holes_and_split_runs)
{
    static const int threads[] = {1, 2, 9};
    for (int t = 0; t < 3; t++)
        for (size_t d = 0; d < 3; d++) {
            kcase_t c = {.B = 1,
                         .Tq = 93,
                         .Tk = 68,
                         .H = 2,
                         .Hkv = 1,
                         .D = 16,
                         .causal = true,
                         .dtype = all_dtypes[d],
                         .threads = threads[t]};
            /* query chunks: 500.., 40.., 520.., then 3..15 (sees keys 0..15
             * only) and 1000.. */
            c.qruns[0] = (stria_pos_run_t){500, 1, 16};
            c.qruns[1] = (stria_pos_run_t){40, 1, 16};
            c.qruns[2] = (stria_pos_run_t){520, 1, 16};
            c.qruns[3] = (stria_pos_run_t){3, 1, 45}; /* 3..18, then 19..47 */
            c.n_qruns = 4;
            /* key sub-blocks: 0.., 2000.. (masked for every query), 30..,
             * 510..; then 530..533 in a second, short tile */
            c.kruns[0] = (stria_pos_run_t){0, 1, 16};
            c.kruns[1] = (stria_pos_run_t){2000, 1, 16};
            c.kruns[2] = (stria_pos_run_t){30, 1, 16};
            c.kruns[3] = (stria_pos_run_t){510, 1, 20};
            c.n_kruns = 4;
            for_each_variant(&c);
        }
}

/* Rows that see no key get LSE = -inf and zero output and gradients. */
Test(kernels, rows_without_visible_keys)
{
    kcase_t c = {.B = 1,
                 .Tq = 70,
                 .Tk = 30,
                 .H = 2,
                 .Hkv = 1,
                 .D = 16,
                 .causal = true,
                 .dtype = STRIA_DTYPE_F32,
                 .threads = 1,
                 .scale = 0.3f};
    c.qruns[0] = (stria_pos_run_t){0, 1, 70};
    c.n_qruns = 1;
    c.kruns[0] = (stria_pos_run_t){50, 1, 30}; /* queries 0..49 see nothing */
    c.n_kruns = 1;
    for_each_variant(&c);
}

/* Every backward schedule: with 2..8 threads one task per key tile and a dQ
 * copy per thread (a, b); beyond 8 threads one task per kv-head group when
 * the groups divide among the threads (c), else key tiles for dK/dV and query
 * tiles for dQ in two passes (d). */
Test(kernels, threaded_backward_schedules)
{
    kcase_t a = {.B = 1,
                 .Tq = 190,
                 .Tk = 190,
                 .H = 3,
                 .Hkv = 1,
                 .D = 64,
                 .causal = true,
                 .dtype = STRIA_DTYPE_F32,
                 .threads = 2};
    kcase_t b = {.B = 2,
                 .Tq = 130,
                 .Tk = 130,
                 .H = 4,
                 .Hkv = 4,
                 .D = 64,
                 .causal = true,
                 .dtype = STRIA_DTYPE_F16,
                 .threads = 2};
    kcase_t c = {.B = 3,
                 .Tq = 70,
                 .Tk = 70,
                 .H = 6,
                 .Hkv = 3,
                 .D = 32,
                 .causal = true,
                 .dtype = STRIA_DTYPE_F32,
                 .threads = 9};
    kcase_t d = {.B = 1,
                 .Tq = 200,
                 .Tk = 140,
                 .H = 4,
                 .Hkv = 2,
                 .D = 48,
                 .causal = true,
                 .dtype = STRIA_DTYPE_BF16,
                 .threads = 9};
    d.qruns[0] = (stria_pos_run_t){60, 1, 200};
    d.n_qruns = 1;
    for_each_variant(&a);
    for_each_variant(&b);
    for_each_variant(&c);
    for_each_variant(&d);
}

/* The backward pass walks key tiles in blocks (4 tiles up to head_dim 128, 2
 * beyond): more key tiles than one block, a partial last block, causal masks
 * that skip part of a block, for each schedule (1, 2 and 9 threads). */
Test(kernels, backward_key_tile_blocks)
{
    for (int t = 0; t < 3; t++) {
        static const int threads[] = {1, 2, 9};
        kcase_t a = {.B = 1,
                     .Tq = 100,
                     .Tk = 330,
                     .H = 2,
                     .Hkv = 1,
                     .D = 32,
                     .causal = true,
                     .dtype = STRIA_DTYPE_F32,
                     .threads = threads[t]};
        a.qruns[0] = (stria_pos_run_t){230, 1, 100}; /* the last 100 of 330 keys */
        a.n_qruns = 1;
        kcase_t b = {.B = 1,
                     .Tq = 90,
                     .Tk = 200,
                     .H = 2,
                     .Hkv = 2,
                     .D = 256,
                     .causal = false,
                     .dtype = STRIA_DTYPE_BF16,
                     .threads = threads[t]};
        for_each_variant(&a);
        for_each_variant(&b);
    }
}

/* ---- SIMD variants against the portable oracle ----------------------------- */

typedef struct {
    float *o, *lse, *dq, *dk, *dv;
} outs_t;

/* Forward and backward of one case with one variant; inputs in amp-scaled
 * pseudo-random values so that scores span a wide range. */
static void run_outputs(const kcase_t *c, const char *variant, float amp, outs_t *out)
{
    size_t nq = (size_t)(c->B * c->Tq * c->H * c->D);
    size_t nk = (size_t)(c->B * c->Tk * c->Hkv * c->D);
    size_t nl = (size_t)(c->B * c->H * c->Tq);
    size_t es = stria_dtype_size(c->dtype);
    float *f = malloc(nq * 4);
    void *qs = malloc(nq * es), *ks = malloc(nk * es), *vs = malloc(nk * es), *gs = malloc(nq * es);
    float *delta = malloc(nl * 4);
    stria_pool_t *pool = NULL;

    out->o = malloc(nq * 4);
    out->lse = malloc(nl * 4);
    out->dq = calloc(nq, 4);
    out->dk = calloc(nk, 4);
    out->dv = calloc(nk, 4);
    cr_assert_eq(stria_kernels_set_variant(variant), STRIA_OK, "%s", stria_error_msg());
    if (c->threads > 1)
        cr_assert_eq(stria_pool_create(c->threads, &pool), STRIA_OK);
    ref_fill(f, nq, 21, amp, c->dtype);
    ref_to_dtype(f, nq, c->dtype, qs);
    ref_fill(f, nq, 22, 1.0f, c->dtype);
    ref_to_dtype(f, nq, c->dtype, gs);
    ref_fill(f, nk, 23, amp, c->dtype);
    ref_to_dtype(f, nk, c->dtype, ks);
    ref_fill(f, nk, 24, 1.0f, c->dtype);
    ref_to_dtype(f, nk, c->dtype, vs);

    stria_attn_params_t p = {0};
    p.batch = c->B;
    p.q_tokens = c->Tq;
    p.kv_tokens = c->Tk;
    p.heads = c->H;
    p.kv_heads = c->Hkv;
    p.head_dim = c->D;
    p.scale = c->scale;
    p.causal = c->causal;
    p.q_pos.runs = c->n_qruns ? c->qruns : NULL;
    p.q_pos.n_runs = c->n_qruns;
    p.kv_pos.runs = c->n_kruns ? c->kruns : NULL;
    p.kv_pos.n_runs = c->n_kruns;
    p.pool = pool;
    ref_masks_t unused;
    case_masks(c, &p, &unused);
    stria_tensor_t tq = stria_tensor_contiguous(qs, c->dtype, c->Tq, c->H, c->D);
    stria_tensor_t tk = stria_tensor_contiguous(ks, c->dtype, c->Tk, c->Hkv, c->D);
    stria_tensor_t tv = stria_tensor_contiguous(vs, c->dtype, c->Tk, c->Hkv, c->D);
    stria_tensor_t tg = stria_tensor_contiguous(gs, c->dtype, c->Tq, c->H, c->D);
    stria_tensor_t to = stria_tensor_contiguous(out->o, STRIA_DTYPE_F32, c->Tq, c->H, c->D);
    stria_tensor_t tdq = stria_tensor_contiguous(out->dq, STRIA_DTYPE_F32, c->Tq, c->H, c->D);
    stria_tensor_t tdk = stria_tensor_contiguous(out->dk, STRIA_DTYPE_F32, c->Tk, c->Hkv, c->D);
    stria_tensor_t tdv = stria_tensor_contiguous(out->dv, STRIA_DTYPE_F32, c->Tk, c->Hkv, c->D);
    cr_assert_eq(stria_attn_fwd(&p, &tq, &tk, &tv, &to, out->lse, false), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_attn_bwd_delta(&p, &to, &tg, delta), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_bwd(&p, &tq, &tk, &tv, &tg, out->lse, delta, &tdq, &tdk, &tdv),
                 STRIA_OK, "%s", stria_error_msg());
    stria_pool_destroy(pool);
    free(f), free(qs), free(ks), free(vs), free(gs), free(delta);
}

static void outs_free(outs_t *o)
{
    free(o->o), free(o->lse), free(o->dq), free(o->dk), free(o->dv);
}

/* max |a - b| <= rel * max |b| (elementwise equality of -inf included). */
static void expect_close(const char *what, const char *variant, const float *a, const float *b,
                         size_t n, double rel)
{
    double maxabs = 0.0, err = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (isinf(b[i]) || isinf(a[i])) {
            cr_expect(a[i] == b[i], "%s: variant %s element %zu: %g vs portable %g", what, variant,
                      i, a[i], b[i]);
            continue;
        }
        double d = fabs((double)a[i] - (double)b[i]);
        cr_expect(d == d, "%s: variant %s element %zu is NaN", what, variant, i);
        err = d > err ? d : err;
        maxabs = fabs(b[i]) > maxabs ? fabs(b[i]) : maxabs;
    }
    cr_expect(err <= rel * maxabs,
              "%s: variant %s differs from portable by %.3g (max |x| %.3g, "
              "allowed %.3g)",
              what, variant, err, maxabs, rel * maxabs);
    cr_log_info("%s: variant %s vs portable: max diff %.3g of max |x| %.3g (%.3g)", what, variant,
                err, maxabs, maxabs > 0 ? err / maxabs : 0.0);
}

/* Every SIMD variant on the same inputs as the portable one: head_dims with
 * column tails (16, 80), GQA, offsets, every dtype, two threads. */
Test(kernels, simd_variants_match_portable)
{
    static const int64_t dims[] = {16, 80, 128, 256};
    const char *const *names = stria_kernels_variant_names();
    for (size_t d = 0; d < sizeof(dims) / sizeof(dims[0]); d++)
        for (size_t t = 0; t < 3; t++) {
            kcase_t c = {.B = 1,
                         .Tq = 130,
                         .Tk = 150,
                         .H = 4,
                         .Hkv = 2,
                         .D = dims[d],
                         .causal = d != 2,
                         .dtype = all_dtypes[t],
                         .threads = 1 + (int)(d % 2)};
            c.qruns[0] = (stria_pos_run_t){20, 1, 130};
            c.n_qruns = 1;
            size_t nq = (size_t)(c.B * c.Tq * c.H * c.D), nk = (size_t)(c.B * c.Tk * c.Hkv * c.D);
            outs_t ref;
            run_outputs(&c, "portable", 3.0f, &ref);
            for (size_t v = 0; names[v] != NULL; v++) {
                outs_t got;
                if (strcmp(names[v], "portable") == 0 || !stria_kernels_variant_available(names[v]))
                    continue;
                run_outputs(&c, names[v], 3.0f, &got);
                /* bf16 products on P and dS rounded to bf16: their rounding
                 * (2^-9 relative) instead of fp32 summation order */
                double r = c.dtype == STRIA_DTYPE_BF16 && ref_bf16_dot(names[v]) ? 500.0 : 1.0;
                expect_close("O", names[v], got.o, ref.o, nq, 1e-5 * r);
                expect_close("LSE", names[v], got.lse, ref.lse, (size_t)(c.B * c.H * c.Tq), 1e-6);
                expect_close("dQ", names[v], got.dq, ref.dq, nq, 2e-5 * r);
                expect_close("dK", names[v], got.dk, ref.dk, nk, 2e-5 * r);
                expect_close("dV", names[v], got.dv, ref.dv, nk, 2e-5 * r);
                outs_free(&got);
            }
            outs_free(&ref);
        }
}

/* ---- merge ----------------------------------------------------------------- */

static void block_params(stria_attn_params_t *p, int64_t Tq, int64_t Tk, int64_t H, int64_t D)
{
    memset(p, 0, sizeof(*p));
    p->batch = 1;
    p->q_tokens = Tq;
    p->kv_tokens = Tk;
    p->heads = H;
    p->kv_heads = H;
    p->head_dim = D;
    p->causal = true;
}

/* Splitting K/V into k blocks and merging equals one big block, k = 1..8. */
Test(kernels, merge_associativity)
{
    const int64_t Tq = 96, Tk = 160, H = 2, D = 32;
    size_t nq = (size_t)(Tq * H * D), nk = (size_t)(Tk * H * D), nl = (size_t)(H * Tq);
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4);
    float *o1 = malloc(nq * 4), *l1 = malloc(nl * 4), *o2 = malloc(nq * 4), *l2 = malloc(nl * 4);
    float *ob = malloc(nq * 4), *lb = malloc(nl * 4);
    stria_pos_run_t qrun = {64, 1, Tq}; /* queries at 64..159, keys at 0..159 */
    stria_attn_params_t p;

    ref_fill(q, nq, 11, 2.0f, STRIA_DTYPE_F32);
    ref_fill(k, nk, 12, 2.0f, STRIA_DTYPE_F32);
    ref_fill(v, nk, 13, 1.0f, STRIA_DTYPE_F32);
    block_params(&p, Tq, Tk, H, D);
    p.q_pos.runs = &qrun;
    p.q_pos.n_runs = 1;
    stria_tensor_t tq = stria_tensor_contiguous(q, STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t to1 = stria_tensor_contiguous(o1, STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t to2 = stria_tensor_contiguous(o2, STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t tob = stria_tensor_contiguous(ob, STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t tk = stria_tensor_contiguous(k, STRIA_DTYPE_F32, Tk, H, D);
    stria_tensor_t tv = stria_tensor_contiguous(v, STRIA_DTYPE_F32, Tk, H, D);
    cr_assert_eq(stria_attn_fwd(&p, &tq, &tk, &tv, &to1, l1, false), STRIA_OK, "%s",
                 stria_error_msg());

    for (int nb = 1; nb <= 8; nb++) {
        /* via accumulate, and via explicit merge, in reverse block order */
        cr_assert_eq(stria_attn_partial_init(&p, &to2, l2), STRIA_OK);
        for (int blk = nb - 1; blk >= 0; blk--) {
            int64_t k0 = Tk * blk / nb, k1 = Tk * (blk + 1) / nb;
            stria_pos_run_t krun = {k0, 1, k1 - k0};
            stria_attn_params_t pb = p;
            pb.kv_tokens = k1 - k0;
            pb.kv_pos.runs = &krun;
            pb.kv_pos.n_runs = 1;
            stria_tensor_t tkb = tk, tvb = tv;
            tkb.data = k + k0 * H * D;
            tvb.data = v + k0 * H * D;
            if (blk % 2 == 0) {
                cr_assert_eq(stria_attn_fwd(&pb, &tq, &tkb, &tvb, &to2, l2, true), STRIA_OK, "%s",
                             stria_error_msg());
            } else {
                cr_assert_eq(stria_attn_fwd(&pb, &tq, &tkb, &tvb, &tob, lb, false), STRIA_OK);
                cr_assert_eq(stria_attn_merge(&p, &to2, l2, &tob, lb), STRIA_OK);
            }
        }
        for (size_t i = 0; i < nq; i++)
            cr_assert_float_eq(o2[i], o1[i], 2e-5, "k=%d: O[%zu] %g vs %g", nb, i, o2[i], o1[i]);
        for (size_t i = 0; i < nl; i++)
            cr_assert_float_eq(l2[i], l1[i], 2e-5, "k=%d: LSE[%zu] %g vs %g", nb, i, l2[i], l1[i]);
    }
    free(q), free(k), free(v), free(o1), free(l1), free(o2), free(l2), free(ob), free(lb);
}

/* LSE gaps of +-1e4 and -inf rows merge without overflow or NaN. */
Test(kernels, merge_extreme_lse_and_empty_rows)
{
    const int64_t T = 4, D = 16;
    float oa[4 * 16], ob[4 * 16];
    float la[4] = {1e4f, -1e4f, -INFINITY, -INFINITY};
    float lb[4] = {-1e4f, 1e4f, 3.0f, -INFINITY};
    stria_attn_params_t p;
    block_params(&p, T, 1, 1, D);
    for (int i = 0; i < T * D; i++) {
        oa[i] = 1.0f;
        ob[i] = 2.0f;
    }
    for (int d = 0; d < D; d++) /* -inf rows hold zero partials */
        oa[2 * D + d] = oa[3 * D + d] = ob[3 * D + d] = 0.0f;
    stria_tensor_t ta = stria_tensor_contiguous(oa, STRIA_DTYPE_F32, T, 1, D);
    stria_tensor_t tb = stria_tensor_contiguous(ob, STRIA_DTYPE_F32, T, 1, D);
    cr_assert_eq(stria_attn_merge(&p, &ta, la, &tb, lb), STRIA_OK, "%s", stria_error_msg());
    for (int d = 0; d < D; d++) {
        cr_expect_float_eq(oa[0 * D + d], 1.0f, 1e-6);
        cr_expect_float_eq(oa[1 * D + d], 2.0f, 1e-6);
        cr_expect_float_eq(oa[2 * D + d], 2.0f, 1e-6);
        cr_expect_eq(oa[3 * D + d], 0.0f);
    }
    cr_expect_float_eq(la[0], 1e4f, 1e-2);
    cr_expect_float_eq(la[1], 1e4f, 1e-2);
    cr_expect_float_eq(la[2], 3.0f, 1e-6);
    cr_expect(isinf(la[3]) && la[3] < 0);
    /* equal LSEs: weights 1/2 each, lse + log 2 */
    float oc[16], od[16], lc = 5.0f, ld = 5.0f;
    for (int d = 0; d < D; d++) {
        oc[d] = 1.0f;
        od[d] = 3.0f;
    }
    block_params(&p, 1, 1, 1, D);
    stria_tensor_t tc = stria_tensor_contiguous(oc, STRIA_DTYPE_F32, 1, 1, D);
    stria_tensor_t td = stria_tensor_contiguous(od, STRIA_DTYPE_F32, 1, 1, D);
    cr_assert_eq(stria_attn_merge(&p, &tc, &lc, &td, &ld), STRIA_OK);
    cr_expect_float_eq(oc[0], 2.0f, 1e-6);
    cr_expect_float_eq(lc, 5.0f + logf(2.0f), 1e-6);
}

/* Merges of partials whose LSEs sit at and beyond the point where expf
 * overflows in fp32 (88.72), against the merge computed in fp64: a form that
 * exponentiates an LSE itself instead of a difference gives inf or NaN. And
 * K/V blocks whose scores reach a few hundred, split and merged as ring
 * steps do, against one block and the fp64 reference. */
Test(kernels, merge_near_overflow)
{
    enum { D = 16, R = 7 };
    static const float la0[R] = {88.0f, 88.72f, 89.0f, 300.0f, 1e4f, -87.0f, -200.0f};
    static const float lb0[R] = {88.7f, 88.72f, -89.0f, 299.5f, 1e4f - 1.0f, -88.5f, -200.25f};
    float oa[R * D], ob[R * D], la[R], lb[R];
    stria_attn_params_t p;
    block_params(&p, R, 1, 1, D);
    for (int i = 0; i < R; i++) {
        la[i] = la0[i];
        lb[i] = lb0[i];
        for (int d = 0; d < D; d++) {
            oa[i * D + d] = 0.25f * (float)(d + 1);
            ob[i * D + d] = -0.5f * (float)(d % 5) + (float)i;
        }
    }
    stria_tensor_t ta = stria_tensor_contiguous(oa, STRIA_DTYPE_F32, R, 1, D);
    stria_tensor_t tb = stria_tensor_contiguous(ob, STRIA_DTYPE_F32, R, 1, D);
    cr_assert_eq(stria_attn_merge(&p, &ta, la, &tb, lb), STRIA_OK, "%s", stria_error_msg());
    for (int i = 0; i < R; i++) {
        double a = la0[i], b = lb0[i], mx = a > b ? a : b;
        double lse = mx + log(exp(a - mx) + exp(b - mx));
        double wa = exp(a - lse), wb = exp(b - lse);
        /* An fp32 LSE is known to half an ulp of its size: the weights
         * derived from it carry that absolute error. */
        double rel = 1e-6 + 4 * FLT_EPSILON * fabs(mx);
        cr_expect(isfinite(la[i]), "row %d: LSE %g from %g and %g", i, la[i], a, b);
        cr_expect(fabs(la[i] - lse) <= 4e-7 * fabs(lse) + 1e-6, "row %d: LSE %.9g, want %.9g", i,
                  la[i], lse);
        for (int d = 0; d < D; d++) {
            double want = wa * (0.25 * (d + 1)) + wb * (-0.5 * (d % 5) + i);
            cr_expect(fabs(oa[i * D + d] - want) <= rel * (1.0 + fabs(want)),
                      "row %d col %d: O %.9g, want %.9g (LSEs %g, %g)", i, d, oa[i * D + d], want,
                      a, b);
        }
    }
    /* Scores beyond 88.72 through the kernels: three key tiles merged
     * online inside a pass, against the fp64 reference. */
    for (size_t t = 0; t < 3; t++) {
        kcase_t c = {.B = 1,
                     .Tq = 150,
                     .Tk = 150,
                     .H = 2,
                     .Hkv = 2,
                     .D = 64,
                     .causal = true,
                     .dtype = all_dtypes[t],
                     .threads = 1,
                     .scale = 12.0f};
        for_each_variant(&c);
    }
}

Test(kernels, finalize_rounds_to_storage_dtype)
{
    float part[2 * 16];
    uint16_t out[2 * 16];
    stria_attn_params_t p;
    block_params(&p, 2, 1, 1, 16);
    for (int i = 0; i < 32; i++)
        part[i] = 1.0f + (float)i / 7.0f;
    stria_tensor_t tp = stria_tensor_contiguous(part, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tb = stria_tensor_contiguous(out, STRIA_DTYPE_BF16, 2, 1, 16);
    cr_assert_eq(stria_attn_finalize(&p, &tp, &tb), STRIA_OK);
    for (int i = 0; i < 32; i++)
        cr_expect_eq(out[i], stria_f32_to_bf16(part[i]));
    stria_tensor_t th = stria_tensor_contiguous(out, STRIA_DTYPE_F16, 2, 1, 16);
    cr_assert_eq(stria_attn_finalize(&p, &tp, &th), STRIA_OK);
    for (int i = 0; i < 32; i++)
        cr_expect_eq(out[i], stria_f32_to_f16(part[i]));
}

/* ---- bad arguments --------------------------------------------------------- */

static void expect_error(stria_status_t st, stria_status_t want, const char *needle)
{
    cr_expect_eq(st, want, "status %s, wanted %s (%s)", stria_status_name(st),
                 stria_status_name(want), stria_error_msg());
    cr_expect(strstr(stria_error_msg(), needle) != NULL, "message '%s' lacks '%s'",
              stria_error_msg(), needle);
}

Test(kernels, bad_arguments_get_clear_errors)
{
    float buf[4 * 2 * 32] = {0}, lse[8];
    stria_attn_params_t p;
    block_params(&p, 4, 4, 2, 32);
    stria_tensor_t t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 2, 32);
    stria_tensor_t o = t;
    float obuf[4 * 2 * 32];
    o.data = obuf;

    expect_error(stria_attn_fwd(NULL, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG, "params");
    expect_error(stria_attn_fwd(&p, NULL, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "tensor q is NULL");
    expect_error(stria_attn_fwd(&p, &t, &t, &t, &o, NULL, false), STRIA_ERR_INVALID_ARG, "lse");

    stria_attn_params_t bad = p;
    bad.q_tokens = 0;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "q_tokens=0");
    bad = p;
    bad.heads = 3;
    bad.kv_heads = 2;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "multiple of kv_heads");
    bad = p;
    bad.head_dim = 20;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_UNSUPPORTED,
                 "head_dim 20");
    bad.head_dim = 264;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_UNSUPPORTED,
                 "head_dim 264");
    bad = p;
    bad.scale = -1.0f;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG, "scale");
    bad = p;
    stria_pos_run_t run = {0, 1, 3}; /* 3 positions for 4 tokens */
    bad.q_pos.runs = &run;
    bad.q_pos.n_runs = 1;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "cover 3 tokens");
    stria_pos_run_t neg = {-5, 1, 4};
    bad.q_pos.runs = &neg;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG, "leaves");

    stria_tensor_t tb = t;
    tb.dtype = STRIA_DTYPE_BF16;
    expect_error(stria_attn_fwd(&p, &t, &tb, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "share one dtype");
    stria_tensor_t o16 = o;
    o16.dtype = STRIA_DTYPE_F16;
    expect_error(stria_attn_fwd(&p, &t, &t, &t, &o16, lse, false), STRIA_ERR_INVALID_ARG,
                 "must be fp32");
    expect_error(stria_attn_bwd(&p, &t, &t, &t, &t, lse, lse, &o, &o, &o), STRIA_ERR_INVALID_ARG,
                 "alias");
    expect_error(stria_attn_merge(&p, &o, lse, NULL, lse), STRIA_ERR_INVALID_ARG, "o_b");
    expect_error(stria_kernels_set_variant("sse9"), STRIA_ERR_NOT_FOUND, "sse9");
}

Test(kernels, variant_selection)
{
    const char *const *names = stria_kernels_variant_names();
    cr_assert_str_eq(names[0], "portable");
    cr_assert(stria_kernels_variant_available("portable"));
    cr_assert_eq(stria_kernels_set_variant("portable"), STRIA_OK);
    cr_assert_str_eq(stria_kernels_variant(), "portable");
    /* the bf16 dot product: where the CPU has it, in avx512 only */
    for (size_t i = 0; names[i] != NULL; i++)
        cr_expect_eq(stria_kernels_variant_bf16_dot(names[i]), ref_bf16_dot(names[i]),
                     "variant %s: bf16 dot product %d, the CPU's flags say %d", names[i],
                     stria_kernels_variant_bf16_dot(names[i]), ref_bf16_dot(names[i]));
    cr_expect(!stria_kernels_variant_bf16_dot("sse9"));
}

/* STRIA_KERNEL=avx512-nobf16 forces avx512 without the bf16 dot product. */
Test(kernels, env_forces_avx512_without_bf16_dot)
{
    if (!stria_kernels_variant_available("avx512")) {
        cr_log_info("no avx512 on this CPU: nothing to check");
        return;
    }
    setenv("STRIA_KERNEL", "avx512-nobf16", 1);
    cr_assert_str_eq(stria_kernels_variant(), "avx512-nobf16");
    cr_expect(!stria_kernels_variant_bf16_dot(stria_kernels_variant()));
}

/* STRIA_KERNEL forces a variant on first use (each Criterion test runs in a
 * fresh process, so the choice has not been made yet). */
Test(kernels, env_forces_variant)
{
    const char *const *names = stria_kernels_variant_names();
    const char *last = NULL;
    for (size_t i = 0; names[i] != NULL; i++)
        if (stria_kernels_variant_available(names[i]) && strcmp(names[i], "portable") != 0)
            last = names[i];
    /* force the portable one even where a SIMD variant would be the default */
    cr_assert_eq(setenv("STRIA_KERNEL", "portable", 1), 0);
    cr_assert_str_eq(stria_kernels_variant(), "portable");
    if (last != NULL)
        cr_log_info("default would have been %s", last);
}

Test(kernels, env_unknown_variant_is_a_clear_error)
{
    float buf[4 * 32] = {0}, o[4 * 32], lse[4];
    stria_attn_params_t p;
    cr_assert_eq(setenv("STRIA_KERNEL", "sse9", 1), 0);
    block_params(&p, 4, 4, 1, 32);
    stria_tensor_t t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 1, 32);
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, 4, 1, 32);
    expect_error(stria_attn_fwd(&p, &t, &t, &t, &to, lse, false), STRIA_ERR_NOT_FOUND,
                 "STRIA_KERNEL=sse9");
    cr_expect_str_eq(stria_kernels_variant(), "none");
}

/* Causal params of a block pair whose queries are the one run *qr (keys:
 * set kv_pos per block). */
static stria_attn_params_t causal_params(int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv,
                                         int64_t D, const stria_pos_run_t *qr)
{
    stria_attn_params_t p = {0};
    p.batch = B;
    p.q_tokens = Tq;
    p.kv_tokens = Tk;
    p.heads = H;
    p.kv_heads = Hkv;
    p.head_dim = D;
    p.causal = true;
    p.q_pos = (stria_positions_t){qr, 1};
    return p;
}

/* Q, K, V, dO and the outputs as strided views into one fused buffer per
 * side ([B][T][3][H][D] and [B][T][2][Hkv][D], a layout trainers hand over
 * often), and K/V head-major ([B][Hkv][T][D], the ring's messages: fp32 V
 * rows in the forward and fp32 K rows in the backward's dQ product are read
 * in place, the last key tile partial), give the same bits as
 * contiguous tensors: operands read in place follow the strides (head_dim 64
 * and 128 are read in place, 40 packed). */
static void strided_case(int64_t D, stria_dtype_t dtype, const char *variant)
{
    const int64_t B = 2, Tq = 80, Tk = 144, H = 4, Hkv = 2;
    const stria_pos_run_t qr = {5, 3, Tq}, kr = {0, 2, Tk}; /* striped-like, straddling */
    size_t es = stria_dtype_size(dtype);
    size_t nq = (size_t)(B * Tq * H * D), nk = (size_t)(B * Tk * Hkv * D);
    size_t nl = (size_t)(B * H * Tq);
    float *f = malloc(2 * (nq + nk) * 4);
    char *dense = malloc(2 * (nq + nk) * es);                  /* q, g, k, v */
    char *fq = malloc(3 * nq * es), *fk = malloc(2 * nk * es); /* fused q|g|pad, k|v */
    char *hk = malloc(2 * nk * es);                            /* head-major k, v */
    float *out[3][5], *lse[3], *delta[3];
    stria_tensor_t t[3][4];

    cr_assert_eq(stria_kernels_set_variant(variant), STRIA_OK, "%s", stria_error_msg());
    ref_fill(f, 2 * (nq + nk), 77 + (uint64_t)D, 1.0f, dtype);
    ref_to_dtype(f, 2 * (nq + nk), dtype, dense);
    memset(fq, 0x7f, 3 * nq * es); /* the third slot is never read */
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < Tq; i++)
            for (int s = 0; s < 2; s++)
                memcpy(fq + (size_t)(((b * Tq + i) * 3 + s) * H * D) * es,
                       dense + ((size_t)s * nq + (size_t)((b * Tq + i) * H * D)) * es,
                       (size_t)(H * D) * es);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < Tk; i++)
            for (int s = 0; s < 2; s++)
                memcpy(fk + (size_t)(((b * Tk + i) * 2 + s) * Hkv * D) * es,
                       dense + (2 * nq + (size_t)s * nk + (size_t)((b * Tk + i) * Hkv * D)) * es,
                       (size_t)(Hkv * D) * es);
    for (int s = 0; s < 2; s++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t i = 0; i < Tk; i++)
                    memcpy(hk + ((size_t)s * nk + (size_t)(((b * Hkv + h) * Tk + i) * D)) * es,
                           dense +
                               (2 * nq + (size_t)s * nk + (size_t)(((b * Tk + i) * Hkv + h) * D)) *
                                   es,
                           (size_t)D * es);
    for (int v = 0; v < 3; v++) {
        if (v == 2) {
            t[2][0] = stria_tensor_contiguous(dense, dtype, Tq, H, D);
            t[2][1] = stria_tensor_contiguous(dense + nq * es, dtype, Tq, H, D);
            t[2][2] = stria_tensor_head_major(hk, dtype, Tk, Hkv, D);
            t[2][3] = stria_tensor_head_major(hk + nk * es, dtype, Tk, Hkv, D);
        } else if (v == 0) {
            t[0][0] = stria_tensor_contiguous(dense, dtype, Tq, H, D);
            t[0][1] = stria_tensor_contiguous(dense + nq * es, dtype, Tq, H, D);
            t[0][2] = stria_tensor_contiguous(dense + 2 * nq * es, dtype, Tk, Hkv, D);
            t[0][3] = stria_tensor_contiguous(dense + (2 * nq + nk) * es, dtype, Tk, Hkv, D);
        } else {
            for (int s = 0; s < 4; s++) {
                bool qside = s < 2;
                int64_t T = qside ? Tq : Tk, Hs = qside ? H : Hkv, slots = qside ? 3 : 2;
                char *base = qside ? fq : fk;
                t[1][s] = (stria_tensor_t){base + (size_t)((s % 2) * Hs * D) * es, dtype,
                                           T * slots * Hs * D, slots * Hs * D, D};
            }
        }
        for (int o = 0; o < 5; o++)
            out[v][o] = calloc(o == 0 || o == 2 ? nq : nk, 4);
        lse[v] = malloc(nl * 4);
        delta[v] = malloc(nl * 4);
        stria_attn_params_t p = causal_params(B, Tq, Tk, H, Hkv, D, &qr);
        p.kv_pos = (stria_positions_t){&kr, 1};
        stria_tensor_t to = stria_tensor_contiguous(out[v][0], STRIA_DTYPE_F32, Tq, H, D);
        stria_tensor_t tdq = stria_tensor_contiguous(out[v][2], STRIA_DTYPE_F32, Tq, H, D);
        stria_tensor_t tdk = stria_tensor_contiguous(out[v][3], STRIA_DTYPE_F32, Tk, Hkv, D);
        stria_tensor_t tdv = stria_tensor_contiguous(out[v][4], STRIA_DTYPE_F32, Tk, Hkv, D);
        cr_assert_eq(stria_attn_fwd(&p, &t[v][0], &t[v][2], &t[v][3], &to, lse[v], false), STRIA_OK,
                     "%s", stria_error_msg());
        cr_assert_eq(stria_attn_bwd_delta(&p, &to, &t[v][1], delta[v]), STRIA_OK, "%s",
                     stria_error_msg());
        cr_assert_eq(stria_attn_bwd(&p, &t[v][0], &t[v][2], &t[v][3], &t[v][1], lse[v], delta[v],
                                    &tdq, &tdk, &tdv),
                     STRIA_OK, "%s", stria_error_msg());
    }
    static const char *const names[5] = {"O", "-", "dQ", "dK", "dV"};
    for (int o = 0; o < 5; o++) {
        if (o == 1)
            continue;
        size_t n = o == 0 || o == 2 ? nq : nk;
        for (int v = 1; v < 3; v++)
            cr_assert(memcmp(out[0][o], out[v][o], n * 4) == 0,
                      "%s: %s views differ from contiguous tensors (variant %s, %s, D=%lld)",
                      names[o], v == 1 ? "fused" : "head-major K/V", variant,
                      stria_dtype_name(dtype), (long long)D);
    }
    for (int v = 1; v < 3; v++)
        cr_assert(memcmp(lse[0], lse[v], nl * 4) == 0, "LSE: %s views differ (variant %s)",
                  v == 1 ? "fused" : "head-major K/V", variant);
    for (int v = 0; v < 3; v++) {
        for (int o = 0; o < 5; o++)
            free(out[v][o]);
        free(lse[v]);
        free(delta[v]);
    }
    free(f), free(dense), free(fq), free(fk), free(hk);
}

Test(kernels, strided_views_match_contiguous)
{
    static const int64_t dims[] = {40, 64, 128};
    const char *const *names = stria_kernels_variant_names();
    for (size_t i = 0; names[i] != NULL; i++) {
        if (!stria_kernels_variant_available(names[i]))
            continue;
        for (size_t d = 0; d < 3; d++)
            for (size_t t = 0; t < 3; t++)
                strided_case(dims[d], all_dtypes[t], names[i]);
    }
}

/* A forward pass over several K/V blocks (a ring rank's forward: striped
 * positions, one block per rank, merged into one partial) gives the bits of
 * one stria_attn_fwd(accumulate) call per block, including the first call
 * without accumulate, for fp32 and bf16, head_dim read in place (64) and
 * packed (40), on 1 and 3 threads, K/V token-major and head-major. The query
 * buffer is overwritten after begin: blocks must not read it. */
/* Documents and a window for the pass cases (positions below 240), or
 * nothing when !masked. */
static void pass_masks(stria_attn_params_t *p, bool masked)
{
    static const int64_t cu[] = {0, 5, 5, 21, 90, 91, 150, 171, 240, 240};
    if (!masked)
        return;
    p->cu_seqlens = cu;
    p->n_cu_seqlens = sizeof(cu) / sizeof(cu[0]);
    p->has_window = true;
    p->window_left = 40;
    p->window_right = 0;
}

static void fwd_pass_case(stria_dtype_t dtype, int threads, int64_t D, bool head_major, bool masked)
{
    enum { NB = 3 };
    const int64_t B = 2, Tq = 75, Tk = 75, H = 4, Hkv = 2;
    size_t es = stria_dtype_size(dtype);
    size_t nq = (size_t)(B * Tq * H * D), nk = (size_t)(B * Tk * Hkv * D),
           nl = (size_t)(B * H * Tq);
    float *f = malloc((nq + 2 * NB * nk) * 4);
    char *buf = malloc((nq + 2 * NB * nk) * es), *qcopy = malloc(nq * es);
    float *o[2] = {malloc(nq * 4), malloc(nq * 4)}, *lse[2] = {malloc(nl * 4), malloc(nl * 4)};
    stria_pool_t *pool = NULL;
    stria_pos_run_t qr = {1, NB, Tq}, kr[NB];

    if (threads > 1)
        cr_assert_eq(stria_pool_create(threads, &pool), STRIA_OK);
    ref_fill(f, nq + 2 * NB * nk, 57 + (uint64_t)threads, 1.0f, dtype);
    ref_to_dtype(f, nq + 2 * NB * nk, dtype, buf);
    memcpy(qcopy, buf, nq * es);
    stria_tensor_t tq = stria_tensor_contiguous(buf, dtype, Tq, H, D);
    stria_tensor_t tq_ref = stria_tensor_contiguous(qcopy, dtype, Tq, H, D);
    stria_tensor_t tk[NB], tv[NB];
    for (int j = 0; j < NB; j++) {
        char *kd = buf + (nq + 2 * (size_t)j * nk) * es, *vd = kd + nk * es;
        kr[j] = (stria_pos_run_t){j, NB, Tk};
        tk[j] = head_major ? stria_tensor_head_major(kd, dtype, Tk, Hkv, D)
                           : stria_tensor_contiguous(kd, dtype, Tk, Hkv, D);
        tv[j] = head_major ? stria_tensor_head_major(vd, dtype, Tk, Hkv, D)
                           : stria_tensor_contiguous(vd, dtype, Tk, Hkv, D);
    }
    stria_attn_params_t p = causal_params(B, Tq, Tk, H, Hkv, D, &qr);
    p.pool = pool;
    pass_masks(&p, masked);
    stria_tensor_t to[2] = {stria_tensor_contiguous(o[0], STRIA_DTYPE_F32, Tq, H, D),
                            stria_tensor_contiguous(o[1], STRIA_DTYPE_F32, Tq, H, D)};
    stria_attn_fwd_pass_t *pass = NULL;
    cr_assert_eq(stria_attn_fwd_begin(&p, &tq, &pass), STRIA_OK, "%s", stria_error_msg());
    memset(buf, 0x7f, nq * es); /* the pass must have its own copy of Q */
    for (int j = 0; j < NB; j++) {
        p.kv_pos = (stria_positions_t){&kr[j], 1};
        cr_assert_eq(stria_attn_fwd(&p, &tq_ref, &tk[j], &tv[j], &to[0], lse[0], j > 0), STRIA_OK,
                     "%s", stria_error_msg());
        cr_assert_eq(stria_attn_fwd_block(pass, &p, &tk[j], &tv[j], &to[1], lse[1], j > 0),
                     STRIA_OK, "%s", stria_error_msg());
    }
    stria_attn_fwd_end(pass);
    cr_assert(memcmp(o[0], o[1], nq * 4) == 0 && memcmp(lse[0], lse[1], nl * 4) == 0,
              "forward pass differs from per-block calls (%s, %d threads, D=%lld, %s K/V)",
              stria_dtype_name(dtype), threads, (long long)D,
              head_major ? "head-major" : "token-major");
    stria_pool_destroy(pool);
    free(f), free(buf), free(qcopy), free(o[0]), free(o[1]), free(lse[0]), free(lse[1]);
}

Test(kernels, fwd_pass_matches_per_block_calls)
{
    static const stria_dtype_t dtypes[] = {STRIA_DTYPE_F32, STRIA_DTYPE_BF16};
    for (int threads = 1; threads <= 3; threads += 2)
        for (size_t d = 0; d < 2; d++)
            for (int hm = 0; hm < 2; hm++) {
                fwd_pass_case(dtypes[d], threads, 64, hm, false);
                fwd_pass_case(dtypes[d], threads, 40, hm, false);
                fwd_pass_case(dtypes[d], threads, 64, hm, true);
            }
}

/* One head of 16 dims, two query and two key tokens, no mask. */
static stria_attn_params_t tiny_params(void)
{
    stria_attn_params_t p = {0};
    p.batch = 1;
    p.q_tokens = 2;
    p.kv_tokens = 2;
    p.heads = 1;
    p.kv_heads = 1;
    p.head_dim = 16;
    return p;
}

Test(kernels, fwd_pass_bad_arguments_get_clear_errors)
{
    float q[2 * 16], k[2 * 16], o[2 * 16], lse[2];
    memset(q, 0, sizeof(q));
    memset(k, 0, sizeof(k));
    stria_attn_params_t p = tiny_params();
    stria_tensor_t tq = stria_tensor_contiguous(q, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tk = stria_tensor_contiguous(k, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tkb = stria_tensor_contiguous(k, STRIA_DTYPE_BF16, 2, 1, 16);
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, 2, 1, 16);
    stria_attn_fwd_pass_t *pass = NULL;

    cr_assert_eq(stria_attn_fwd_begin(&p, NULL, &pass), STRIA_ERR_INVALID_ARG);
    cr_assert_null(pass);
    stria_attn_params_t bad = p;
    bad.head_dim = 20;
    cr_assert_eq(stria_attn_fwd_begin(&bad, &tq, &pass), STRIA_ERR_UNSUPPORTED);
    cr_assert(strstr(stria_error_msg(), "head_dim 20 unsupported") != NULL, "%s",
              stria_error_msg());
    cr_assert_eq(stria_attn_fwd_begin(&p, &tq, &pass), STRIA_OK, "%s", stria_error_msg());
    bad = p;
    bad.q_tokens = 1;
    cr_assert_eq(stria_attn_fwd_block(pass, &bad, &tk, &tk, &to, lse, false),
                 STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "params.q_tokens differs") != NULL, "%s",
              stria_error_msg());
    bad = p;
    bad.scale = 0.5f;
    cr_assert_eq(stria_attn_fwd_block(pass, &bad, &tk, &tk, &to, lse, false),
                 STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "params.scale differs") != NULL, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_fwd_block(pass, &p, &tkb, &tkb, &to, lse, false),
                 STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "share one dtype") != NULL, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_fwd_block(pass, &p, &tk, &tk, &to, NULL, false), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "lse is NULL") != NULL, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_fwd_block(NULL, &p, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG);
    /* the pass still works after rejected calls */
    cr_assert_eq(stria_attn_fwd_block(pass, &p, &tk, &tk, &to, lse, false), STRIA_OK, "%s",
                 stria_error_msg());
    stria_attn_fwd_end(pass);
    stria_attn_fwd_end(NULL);
}

/* A backward pass over several K/V blocks (a ring rank's backward: striped
 * positions, one block per rank) against one stria_attn_bwd() call per block
 * on one thread: the same sums in another order (dQ summed in the pass, then
 * added once). For the three schedules of the pass (1 thread: one task per
 * group; 3 threads: a dQ copy per thread; 9 threads: separate dQ tasks),
 * fp32 and bf16, head_dim read in place (64) and packed (40). */
static void bwd_pass_case(stria_dtype_t dtype, int threads, int64_t D, bool masked)
{
    enum { NB = 3 };
    const int64_t B = 1, Tq = 75, Tk = 75, H = 4, Hkv = 2;
    size_t es = stria_dtype_size(dtype);
    size_t nq = (size_t)(B * Tq * H * D), nk = (size_t)(B * Tk * Hkv * D),
           nl = (size_t)(B * H * Tq);
    float *f = malloc((2 * nq + 2 * NB * nk) * 4);
    char *buf = malloc((2 * nq + 2 * NB * nk) * es);
    float *dq[2], *dkv[2], *lse = malloc(nl * 4), *delta = malloc(nl * 4);
    float *o = malloc(nq * 4), *ob = malloc(nq * 4), *lb = malloc(nl * 4);
    stria_pool_t *pool = NULL;
    stria_pos_run_t qr = {1, NB, Tq}, kr[NB];

    if (threads > 1)
        cr_assert_eq(stria_pool_create(threads, &pool), STRIA_OK);
    ref_fill(f, 2 * nq + 2 * NB * nk, 91 + (uint64_t)threads, 1.0f, dtype);
    ref_to_dtype(f, 2 * nq + 2 * NB * nk, dtype, buf);
    stria_tensor_t tq = stria_tensor_contiguous(buf, dtype, Tq, H, D);
    stria_tensor_t tg = stria_tensor_contiguous(buf + nq * es, dtype, Tq, H, D);
    stria_tensor_t tk[NB], tv[NB];
    for (int j = 0; j < NB; j++) {
        kr[j] = (stria_pos_run_t){j, NB, Tk};
        tk[j] =
            stria_tensor_contiguous(buf + (2 * nq + 2 * (size_t)j * nk) * es, dtype, Tk, Hkv, D);
        tv[j] = stria_tensor_contiguous(buf + (2 * nq + (2 * (size_t)j + 1) * nk) * es, dtype, Tk,
                                        Hkv, D);
    }
    stria_attn_params_t p = causal_params(B, Tq, Tk, H, Hkv, D, &qr);
    p.pool = pool;
    pass_masks(&p, masked);
    /* the forward over all blocks gives the final LSE and O for D */
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t tob = stria_tensor_contiguous(ob, STRIA_DTYPE_F32, Tq, H, D);
    cr_assert_eq(stria_attn_partial_init(&p, &to, lse), STRIA_OK);
    for (int j = 0; j < NB; j++) {
        p.kv_pos = (stria_positions_t){&kr[j], 1};
        cr_assert_eq(stria_attn_fwd(&p, &tq, &tk[j], &tv[j], &tob, lb, false), STRIA_OK, "%s",
                     stria_error_msg());
        cr_assert_eq(stria_attn_merge(&p, &to, lse, &tob, lb), STRIA_OK);
    }
    cr_assert_eq(stria_attn_bwd_delta(&p, &to, &tg, delta), STRIA_OK);

    for (int w = 0; w < 2; w++) {
        dq[w] = calloc(nq, 4);
        dkv[w] = calloc(2 * NB * nk, 4);
    }
    stria_tensor_t tdq[2] = {stria_tensor_contiguous(dq[0], STRIA_DTYPE_F32, Tq, H, D),
                             stria_tensor_contiguous(dq[1], STRIA_DTYPE_F32, Tq, H, D)};
    stria_attn_bwd_pass_t *pass = NULL;
    cr_assert_eq(stria_attn_bwd_begin(&p, &tq, &tg, lse, delta, &pass), STRIA_OK, "%s",
                 stria_error_msg());
    for (int j = 0; j < NB; j++) {
        p.kv_pos = (stria_positions_t){&kr[j], 1};
        for (int w = 0; w < 2; w++) {
            stria_tensor_t tdk =
                stria_tensor_contiguous(dkv[w] + 2 * (size_t)j * nk, STRIA_DTYPE_F32, Tk, Hkv, D);
            stria_tensor_t tdv = stria_tensor_contiguous(dkv[w] + (2 * (size_t)j + 1) * nk,
                                                         STRIA_DTYPE_F32, Tk, Hkv, D);
            if (w == 0) { /* on one thread: the reference is a different schedule */
                stria_attn_params_t p1 = p;
                p1.pool = NULL;
                cr_assert_eq(
                    stria_attn_bwd(&p1, &tq, &tk[j], &tv[j], &tg, lse, delta, &tdq[0], &tdk, &tdv),
                    STRIA_OK, "%s", stria_error_msg());
            } else {
                cr_assert_eq(stria_attn_bwd_block(pass, &p, &tk[j], &tv[j], &tdk, &tdv), STRIA_OK,
                             "%s", stria_error_msg());
            }
        }
    }
    cr_assert_eq(stria_attn_bwd_end(pass, &tdq[1]), STRIA_OK, "%s", stria_error_msg());
    for (int which = 0; which < 2; which++) {
        const float *a = which == 0 ? dq[0] : dkv[0], *b = which == 0 ? dq[1] : dkv[1];
        size_t n = which == 0 ? nq : 2 * NB * nk;
        double mx = 0, err = 0;
        for (size_t i = 0; i < n; i++) {
            mx = fmax(mx, fabs(a[i]));
            err = fmax(err, fabs((double)a[i] - b[i]));
        }
        cr_assert(mx > 0 && err <= 1e-5 * mx,
                  "pass %s differs from per-block calls by %g (max %g; %s, %d threads, D=%lld)",
                  which == 0 ? "dQ" : "dK/dV", err, mx, stria_dtype_name(dtype), threads,
                  (long long)D);
    }
    for (int w = 0; w < 2; w++) {
        free(dq[w]);
        free(dkv[w]);
    }
    stria_pool_destroy(pool);
    free(f), free(buf), free(lse), free(delta), free(o), free(ob), free(lb);
}

Test(kernels, bwd_pass_matches_per_block_calls)
{
    static const int threads[] = {1, 3, 9};
    static const stria_dtype_t dtypes[] = {STRIA_DTYPE_F32, STRIA_DTYPE_BF16};
    for (size_t t = 0; t < 3; t++)
        for (size_t d = 0; d < 2; d++) {
            bwd_pass_case(dtypes[d], threads[t], 64, false);
            bwd_pass_case(dtypes[d], threads[t], 40, false);
            bwd_pass_case(dtypes[d], threads[t], 64, true);
        }
}

Test(kernels, bwd_pass_bad_arguments_get_clear_errors)
{
    float q[2 * 16], g[2 * 16], k[2 * 16], lse[2], delta[2], dk[2 * 16], dv[2 * 16], dq[2 * 16];
    memset(q, 0, sizeof(q));
    memset(g, 0, sizeof(g));
    memset(k, 0, sizeof(k));
    memset(lse, 0, sizeof(lse));
    memset(delta, 0, sizeof(delta));
    stria_attn_params_t p = tiny_params();
    stria_tensor_t tq = stria_tensor_contiguous(q, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tg = stria_tensor_contiguous(g, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tk = stria_tensor_contiguous(k, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tkb = stria_tensor_contiguous(k, STRIA_DTYPE_BF16, 2, 1, 16);
    stria_tensor_t tdk = stria_tensor_contiguous(dk, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tdv = stria_tensor_contiguous(dv, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tdq = stria_tensor_contiguous(dq, STRIA_DTYPE_F32, 2, 1, 16);
    stria_attn_bwd_pass_t *pass = NULL;

    cr_assert_eq(stria_attn_bwd_begin(&p, &tq, &tg, NULL, delta, &pass), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "lse is NULL") != NULL, "%s", stria_error_msg());
    cr_assert_null(pass);
    cr_assert_eq(stria_attn_bwd_begin(&p, &tq, &tg, lse, delta, &pass), STRIA_OK, "%s",
                 stria_error_msg());
    stria_attn_params_t bad = p;
    bad.q_tokens = 1;
    cr_assert_eq(stria_attn_bwd_block(pass, &bad, &tk, &tk, &tdk, &tdv), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "params.q_tokens differs") != NULL, "%s",
              stria_error_msg());
    bad = p;
    bad.causal = true;
    cr_assert_eq(stria_attn_bwd_block(pass, &bad, &tk, &tk, &tdk, &tdv), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "params.causal differs") != NULL, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_bwd_block(pass, &p, &tkb, &tkb, &tdk, &tdv), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "dtype of q") != NULL, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_bwd_block(pass, &p, &tk, &tk, &tdk, &tdk), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "must not alias") != NULL, "%s", stria_error_msg());
    /* the pass still works after rejected calls */
    cr_assert_eq(stria_attn_bwd_block(pass, &p, &tk, &tk, &tdk, &tdv), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_attn_bwd_end(pass, &tdq), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_bwd_end(NULL, &tdq), STRIA_OK);
    /* discarding: no dq */
    cr_assert_eq(stria_attn_bwd_begin(&p, &tq, &tg, lse, delta, &pass), STRIA_OK);
    cr_assert_eq(stria_attn_bwd_end(pass, NULL), STRIA_OK);
}

/* ---- documents and windows ------------------------------------------------- */

/* Random documents covering [0, S): lengths drawn from short ones (under 16
 * and 64), empty ones, and ones near the tile and sub-block sizes, so that
 * boundaries fall at every phase of a 16-token sub-block. Returns the entry
 * count (at most cap). */
static size_t random_docs(int64_t S, uint32_t seed, int64_t *cu, size_t cap)
{
    static const int64_t lens[] = {0,  1,  3,  5,   7, 9, 11, 13, 15, 16, 17, 0, 31, 33, 47,
                                   63, 64, 65, 100, 2, 4, 6,  8,  10, 12, 14, 0, 21, 29};
    const size_t nl = sizeof(lens) / sizeof(lens[0]);
    size_t n = 1;
    cu[0] = 0;
    while (cu[n - 1] < S && n + 2 < cap) {
        seed = seed * 1664525u + 1013904223u;
        int64_t len = lens[(seed >> 16) % nl];
        cu[n] = cu[n - 1] + len < S ? cu[n - 1] + len : S;
        n++;
    }
    cu[n - 1] = S;
    cu[n++] = S; /* an empty document at the end */
    return n;
}

enum { LAYOUT_CONTIGUOUS, LAYOUT_STRIPED, LAYOUT_ZIGZAG, N_LAYOUTS };
static const char *const layout_names[] = {"contiguous", "striped", "zigzag"};

/* Positions of rank r's block of a sequence of S tokens over N ranks. */
static size_t layout_runs(int layout, int64_t S, int64_t N, int64_t r, stria_pos_run_t *runs)
{
    const int64_t T = S / N, C = S / (2 * N);
    switch (layout) {
    case LAYOUT_STRIPED:
        runs[0] = (stria_pos_run_t){r, N, T};
        return 1;
    case LAYOUT_ZIGZAG:
        runs[0] = (stria_pos_run_t){r * C, 1, C};
        runs[1] = (stria_pos_run_t){(2 * N - 1 - r) * C, 1, C};
        return 2;
    default:
        runs[0] = (stria_pos_run_t){r * T, 1, T};
        return 1;
    }
}

/* A case of the query block of rank r against the key block of rank j. */
static kcase_t layout_case(int layout, int64_t S, int64_t N, int64_t r, int64_t j, bool causal,
                           stria_dtype_t dtype)
{
    kcase_t c = {.B = 1,
                 .Tq = S / N,
                 .Tk = S / N,
                 .H = 2,
                 .Hkv = 1,
                 .D = 32,
                 .causal = causal,
                 .dtype = dtype,
                 .threads = 1};
    c.n_qruns = layout_runs(layout, S, N, r, c.qruns);
    c.n_kruns = layout_runs(layout, S, N, j, c.kruns);
    return c;
}

Test(kernels, documents_in_every_layout)
{
    enum { S = 384, N = 2 };
    int64_t cu[S + 4];
    static const int64_t pairs[][2] = {{1, 0}, {1, 1}, {0, 1}, {0, 0}};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t pr = 0; pr < 4; pr++)
            for (int causal = 0; causal < 2; causal++)
                for (size_t t = 0; t < 3; t++) {
                    kcase_t c = layout_case(layout, S, N, pairs[pr][0], pairs[pr][1], causal,
                                            all_dtypes[t]);
                    c.n_cu = random_docs(S, (uint32_t)(7 * layout + 3 * pr + causal + 1), cu,
                                         sizeof(cu) / sizeof(cu[0]));
                    c.cu = cu;
                    c.threads = 1 + (int)(pr % 2);
                    cr_log_info("documents: %s r=%lld j=%lld causal=%d %zu entries",
                                layout_names[layout], (long long)pairs[pr][0],
                                (long long)pairs[pr][1], causal, c.n_cu);
                    for_each_variant(&c);
                }
}

Test(kernels, documents_shorter_than_a_subblock_and_empty)
{
    /* every document 0..15 tokens long: every sub-block straddles several */
    enum { S = 200 };
    int64_t cu[S + 2];
    size_t n = 1;
    cu[0] = 0;
    for (int64_t len = 0; cu[n - 1] < S; len = (len + 7) % 16) {
        cu[n] = cu[n - 1] + len < S ? cu[n - 1] + len : S;
        n++;
    }
    for (int causal = 0; causal < 2; causal++)
        for (size_t t = 0; t < 3; t++) {
            kcase_t c = layout_case(LAYOUT_CONTIGUOUS, S, 1, 0, 0, causal, all_dtypes[t]);
            c.cu = cu;
            c.n_cu = n;
            for_each_variant(&c);
        }
}

Test(kernels, causal_windows)
{
    enum { S = 256, N = 2 };
    static const int64_t lefts[] = {0, 1, 63, 64, 65, S - 1, S, S + 7, -1};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t w = 0; w < sizeof(lefts) / sizeof(lefts[0]); w++)
            for (size_t t = 0; t < 3; t++) {
                kcase_t c = layout_case(layout, S, N, 1, w % 2, true, all_dtypes[t]);
                c.has_window = true;
                c.left = lefts[w];
                c.right = w % 3 == 0 ? -1 : 0;
                for_each_variant(&c);
            }
}

Test(kernels, noncausal_windows)
{
    enum { S = 256, N = 2 };
    static const int64_t rights[] = {0, 5, S, S + 3, -1};
    static const int64_t lefts[] = {-1, 0, 1, 64, S + 1};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t w = 0; w < sizeof(rights) / sizeof(rights[0]); w++)
            for (size_t lw = 0; lw < sizeof(lefts) / sizeof(lefts[0]); lw++) {
                kcase_t c = layout_case(layout, S, N, (int64_t)(lw % 2), (int64_t)(w % 2), false,
                                        all_dtypes[(w + lw) % 3]);
                c.has_window = true;
                c.left = lefts[lw];
                c.right = rights[w];
                for_each_variant(&c);
            }
}

Test(kernels, windows_with_documents)
{
    enum { S = 384, N = 2 };
    int64_t cu[S + 4];
    static const int64_t wins[][3] = {/* causal, left, right */
                                      {1, 5, 0},  {1, 64, -1}, {1, 0, 0},  {0, 17, 5},
                                      {0, -1, 0}, {0, 0, -1},  {0, 65, 65}};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t w = 0; w < sizeof(wins) / sizeof(wins[0]); w++)
            for (size_t t = 0; t < 3; t++) {
                kcase_t c =
                    layout_case(layout, S, N, 1, (int64_t)(w % 2), wins[w][0] != 0, all_dtypes[t]);
                c.n_cu =
                    random_docs(S, (uint32_t)(11 * layout + w + 5), cu, sizeof(cu) / sizeof(cu[0]));
                c.cu = cu;
                c.has_window = true;
                c.left = wins[w][1];
                c.right = wins[w][2];
                for_each_variant(&c);
            }
}

static void expect_same_bits(const char *what, const char *variant, const char *mask,
                             const float *a, const float *b, size_t n)
{
    cr_expect(memcmp(a, b, n * sizeof(float)) == 0,
              "%s: variant %s: %s differs from no mask in its bits", what, variant, mask);
}

/* Documents [0, S) and window (-1, -1) mask nothing: every output keeps the
 * bits of the call without them, forward and backward, in every variant. */
Test(kernels, masks_that_mask_nothing_are_bit_identical)
{
    enum { S = 320, N = 2 };
    static const int64_t whole[] = {0, S};
    static const int64_t whole_longer[] = {0, S + 50};
    const char *const *names = stria_kernels_variant_names();
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (int causal = 0; causal < 2; causal++)
            for (size_t t = 0; t < 3; t++)
                for (size_t v = 0; names[v] != NULL; v++) {
                    if (!stria_kernels_variant_available(names[v]))
                        continue;
                    kcase_t c = layout_case(layout, S, N, 1, causal, causal, all_dtypes[t]);
                    c.threads = 1 + causal;
                    size_t nq = (size_t)(c.B * c.Tq * c.H * c.D);
                    size_t nk = (size_t)(c.B * c.Tk * c.Hkv * c.D);
                    size_t nl = (size_t)(c.B * c.H * c.Tq);
                    outs_t plain;
                    run_outputs(&c, names[v], 3.0f, &plain);
                    for (int m = 0; m < 4; m++) {
                        kcase_t cm = c;
                        static const char *const what[] = {"cu_seqlens [0, S]", "window (-1, -1)",
                                                           "both", "cu_seqlens [0, S + 50]"};
                        if (m == 0 || m == 2) {
                            cm.cu = whole;
                            cm.n_cu = 2;
                        }
                        if (m == 3) {
                            cm.cu = whole_longer;
                            cm.n_cu = 2;
                        }
                        if (m == 1 || m == 2) {
                            cm.has_window = true;
                            cm.left = -1;
                            cm.right = -1;
                        }
                        outs_t got;
                        run_outputs(&cm, names[v], 3.0f, &got);
                        expect_same_bits("O", names[v], what[m], got.o, plain.o, nq);
                        expect_same_bits("LSE", names[v], what[m], got.lse, plain.lse, nl);
                        expect_same_bits("dQ", names[v], what[m], got.dq, plain.dq, nq);
                        expect_same_bits("dK", names[v], what[m], got.dk, plain.dk, nk);
                        expect_same_bits("dV", names[v], what[m], got.dv, plain.dv, nk);
                        outs_free(&got);
                    }
                    outs_free(&plain);
                }
}

/* A real mask must change the result: guards the checks above against a
 * kernel that ignores the new fields. */
Test(kernels, masks_change_results)
{
    enum { S = 128 };
    static const int64_t cu[] = {0, 40, 128};
    kcase_t c = layout_case(LAYOUT_CONTIGUOUS, S, 1, 0, 0, true, STRIA_DTYPE_F32);
    size_t nq = (size_t)(c.B * c.Tq * c.H * c.D);
    outs_t plain, docs, win;
    run_outputs(&c, "portable", 1.0f, &plain);
    c.cu = cu;
    c.n_cu = 3;
    run_outputs(&c, "portable", 1.0f, &docs);
    c.cu = NULL;
    c.n_cu = 0;
    c.has_window = true;
    c.left = 3;
    run_outputs(&c, "portable", 1.0f, &win);
    cr_expect(memcmp(plain.o, docs.o, nq * 4) != 0, "documents changed nothing");
    cr_expect(memcmp(plain.o, win.o, nq * 4) != 0, "the window changed nothing");
    /* rows before the document boundary see the same keys */
    cr_expect(memcmp(plain.o, docs.o, 40 * (size_t)(c.H * c.D) * 4) == 0,
              "rows of the first document changed");
    outs_free(&plain), outs_free(&docs), outs_free(&win);
}

Test(kernels, masks_bad_arguments_get_clear_errors)
{
    float buf[4 * 2 * 32] = {0}, g1[4 * 2 * 32] = {0}, g2[4 * 2 * 32] = {0}, lse[8];
    stria_attn_params_t p;
    stria_tensor_t t;
    int64_t cu_bad0[] = {1, 4}, cu_dec[] = {0, 3, 2, 4}, cu_short[] = {0, 2, 3}, cu_ok[] = {0, 4};
    struct {
        const int64_t *cu;
        size_t n;
        bool causal, has_window;
        int64_t left, right;
        const char *needle;
    } bad[] = {
        {NULL, 2, true, false, 0, 0, "params.cu_seqlens is NULL"},
        {cu_bad0, 2, true, false, 0, 0, "params.cu_seqlens[0] is 1"},
        {cu_dec, 4, true, false, 0, 0, "params.cu_seqlens decreases at entry 2"},
        {cu_short, 3, true, false, 0, 0, "params.cu_seqlens ends at 3"},
        {NULL, 0, true, true, -2, 0, "params.window_left is -2"},
        {NULL, 0, false, true, 0, -5, "params.window_right is -5"},
        {NULL, 0, true, true, 4, 1, "params.window_right is 1 with causal"},
        {NULL, 0, true, false, 3, 0, "params.has_window is false"},
        {cu_ok, 2, false, false, 0, 7, "params.has_window is false"},
    };
    cr_assert_eq(stria_kernels_set_variant("portable"), STRIA_OK);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        block_params(&p, 4, 4, 2, 32);
        t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 2, 32);
        stria_tensor_t o = t;
        p.causal = bad[i].causal;
        p.cu_seqlens = bad[i].cu;
        p.n_cu_seqlens = bad[i].n;
        p.has_window = bad[i].has_window;
        p.window_left = bad[i].left;
        p.window_right = bad[i].right;
        expect_error(stria_attn_fwd(&p, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                     bad[i].needle);
        stria_tensor_t dk = stria_tensor_contiguous(g1, STRIA_DTYPE_F32, 4, 2, 32);
        stria_tensor_t dv = stria_tensor_contiguous(g2, STRIA_DTYPE_F32, 4, 2, 32);
        expect_error(stria_attn_bwd(&p, &t, &t, &t, &t, lse, lse, &o, &dk, &dv),
                     STRIA_ERR_INVALID_ARG, bad[i].needle);
        expect_error(stria_attn_bwd(&p, &t, &t, &t, &t, lse, lse, &o, &dk, &dv),
                     STRIA_ERR_INVALID_ARG, "stria_attn_bwd: ");
    }
    /* the end must be past the key positions too */
    block_params(&p, 4, 4, 2, 32);
    stria_pos_run_t kr = {10, 1, 4};
    int64_t cu_q[] = {0, 8};
    p.kv_pos = (stria_positions_t){&kr, 1};
    p.cu_seqlens = cu_q;
    p.n_cu_seqlens = 2;
    t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 2, 32);
    expect_error(stria_attn_fwd(&p, &t, &t, &t, &t, lse, false), STRIA_ERR_INVALID_ARG,
                 "the key positions reach 13");
    /* a valid window is accepted */
    block_params(&p, 4, 4, 2, 32);
    p.has_window = true;
    p.window_left = 0;
    p.window_right = 0;
    cr_expect_eq(stria_attn_fwd(&p, &t, &t, &t, &t, lse, false), STRIA_OK, "%s", stria_error_msg());
}

/* A pass keeps its own copy of the documents, and its blocks must have the
 * same documents and window as its begin. */
Test(kernels, pass_blocks_must_match_masks)
{
    float q[2 * 16] = {0}, k[2 * 16] = {0}, o[2 * 16], lse[2], delta[2] = {0};
    float dk[2 * 16] = {0}, dv[2 * 16] = {0}, dq[2 * 16] = {0};
    int64_t cu[] = {0, 1, 2}, other[] = {0, 2, 2};
    stria_attn_params_t p = tiny_params();
    p.cu_seqlens = cu;
    p.n_cu_seqlens = 3;
    p.has_window = true;
    p.window_left = 1;
    p.window_right = 3;
    stria_tensor_t tq = stria_tensor_contiguous(q, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tk = stria_tensor_contiguous(k, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tdk = stria_tensor_contiguous(dk, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tdv = stria_tensor_contiguous(dv, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tdq = stria_tensor_contiguous(dq, STRIA_DTYPE_F32, 2, 1, 16);
    stria_attn_fwd_pass_t *fp = NULL;
    stria_attn_bwd_pass_t *bp = NULL;

    cr_assert_eq(stria_attn_fwd_begin(&p, &tq, &fp), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_bwd_begin(&p, &tq, &tq, lse, delta, &bp), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_attn_fwd_block(fp, &p, &tk, &tk, &to, lse, false), STRIA_OK, "%s",
                 stria_error_msg());
    /* each row sees only its own key (documents of one token): LSE = its
     * score, 0 for zero inputs */
    cr_expect(lse[0] == 0.0f && lse[1] == 0.0f, "LSE %g %g, want 0 0", lse[0], lse[1]);
    stria_attn_params_t bad = p;
    bad.cu_seqlens = other;
    expect_error(stria_attn_fwd_block(fp, &bad, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.cu_seqlens differs");
    expect_error(stria_attn_bwd_block(bp, &bad, &tk, &tk, &tdk, &tdv), STRIA_ERR_INVALID_ARG,
                 "params.cu_seqlens differs");
    bad = p;
    bad.n_cu_seqlens = 0;
    expect_error(stria_attn_fwd_block(fp, &bad, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.cu_seqlens differs");
    bad = p;
    bad.window_left = 2;
    expect_error(stria_attn_fwd_block(fp, &bad, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.window differs");
    expect_error(stria_attn_bwd_block(bp, &bad, &tk, &tk, &tdk, &tdv), STRIA_ERR_INVALID_ARG,
                 "params.window differs");
    bad = p;
    bad.has_window = false;
    bad.window_left = 0;
    bad.window_right = 0;
    expect_error(stria_attn_fwd_block(fp, &bad, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.window differs");
    /* the pass compares against its own copy: changing the caller's array
     * after begin is a mismatch, not a silent change of the pass */
    cu[1] = 2;
    expect_error(stria_attn_fwd_block(fp, &p, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.cu_seqlens differs");
    cu[1] = 1;
    cr_assert_eq(stria_attn_bwd_block(bp, &p, &tk, &tk, &tdk, &tdv), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_attn_bwd_end(bp, &tdq), STRIA_OK, "%s", stria_error_msg());
    stria_attn_fwd_end(fp);
}
