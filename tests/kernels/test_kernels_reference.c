/* Kernel suite, against the reference: every CPU variant against an fp64
 * reference (kernels_test_util.h has the tolerance rule) over head dims,
 * dtypes, GQA, tiles, striped and zigzag positions, sub-tiles, rows without
 * keys and threaded backward schedules; the SIMD variants against the
 * portable one. */
#include <criterion/criterion.h>

#include "kernels_test_util.h"

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

/* Every backward schedule: with 2..8 threads one task per key tile, adding
 * its dQ tiles into the shared dQ under locks (a, b); beyond 8 threads one
 * task per kv-head group when the groups divide among the threads (c), else
 * key tiles for dK/dV and query tiles for dQ in two passes (d). */
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
