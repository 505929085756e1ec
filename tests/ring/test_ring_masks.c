/* Ring engine suite, documents and sliding windows: the masks in every
 * layout, hops a window skips, one document against none, and bad masks. */
#include <criterion/criterion.h>

#include "ring_test_util.h"
#include "stria_docplan.h"

/* ---- documents and sliding windows ----------------------------------- */

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

/* The layouts the mask tests run: the three of all_layouts and packed (the
 * call's documents placed by their work). */
static const stria_layout_kind_t mask_layouts[] = {STRIA_LAYOUT_STRIPED, STRIA_LAYOUT_CONTIGUOUS,
                                                   STRIA_LAYOUT_ZIGZAG, STRIA_LAYOUT_PACKED};

/* A packed run's forward sent its travelling rows only: over all ranks,
 * (steps - 1) x every rank's travelling K/V rows, and the agreement. */
static void check_packed_traffic(const rcase_t *c, const ref_masks_t *m,
                                 const stria_ring_step_stats_t *fwd)
{
    stria_ring_shape_t shape = shape_with_masks(c, m);
    stria_docplan_t *plan;
    stria_layout_t lay;
    cr_assert_eq(stria_docplan_layout(STRIA_LAYOUT_PACKED, &shape.call, c->n, &lay, &plan),
                 STRIA_OK);
    if (plan == NULL) { /* one document: striping, whose traffic the other layouts' tests count */
        cr_expect_leq(shape.call.n_cu_seqlens, 2);
        return;
    }
    uint64_t travel = 0, sent = 0;
    for (int r = 0; r < c->n; r++) {
        travel += (uint64_t)plan->travel[r];
        for (int s = 0; s < c->n; s++)
            sent += fwd[r * c->n + s].bytes_sent;
    }
    const uint64_t row = (uint64_t)(c->B * c->Hkv * c->D) * stria_dtype_size(c->dtype);
    const uint64_t want = (uint64_t)(plan->steps - 1) * travel * 2 * row +
                          (uint64_t)c->n * (uint64_t)(c->n - 1) * sizeof(uint64_t);
    cr_expect_eq(sent, want,
                 "N=%d: the forward sent %llu bytes, %d steps of %llu travelling rows make %llu",
                 c->n, (unsigned long long)sent, plan->steps, (unsigned long long)travel,
                 (unsigned long long)want);
    stria_docplan_unref(plan);
}

/* The ring with masks, in the given layouts, against the fp64 reference with
 * the same masks (computed once), within the tolerance rule; packed runs
 * also have their traffic checked. */
static void check_masks_layouts(rcase_t c, const ref_masks_t *m, const char *name,
                                const stria_layout_kind_t *layouts, size_t n_layouts)
{
    rdata_t d;
    ref_out_t r64, r32, ry;
    ref_shape_t rs = ref_shape(&c);
    const bool bf16_dot = c.dtype == STRIA_DTYPE_BF16 && ref_bf16_dot(stria_kernels_variant());
    stria_ring_step_stats_t *fwd = calloc((size_t)(c.n * c.n), sizeof(*fwd));
    stria_ring_step_stats_t *bwd = calloc((size_t)(c.n * c.n), sizeof(*bwd));
    stria_ring_local_stats_t stats = {.fwd_steps = fwd, .bwd_steps = bwd};
    data_init(&c, &d, (uint64_t)(c.S * 17 + c.n));
    ref_f64_run_masks(&rs, m, d.q, d.k, d.v, d.g, &r64);
    ref_f32_run_masks(&rs, m, d.q, d.k, d.v, d.g, &r32);
    if (bf16_dot)
        ref_bf16_run_masks(&rs, m, d.q, d.k, d.v, d.g, &ry);
    for (size_t k = 0; k < n_layouts; k++) {
        c.layout = layouts[k];
        cr_assert_eq(ring_run_masks(&c, m, &d, &stats), STRIA_OK, "%s, %s: %s", name,
                     stria_layout_kind_name(c.layout), stria_error_msg());
        check_vs_refs(&c, &d, &r64, &r32, bf16_dot ? &ry : NULL, name);
        if (c.layout == STRIA_LAYOUT_PACKED && m != NULL)
            check_packed_traffic(&c, m, fwd);
    }
    ref_out_free(&r64);
    ref_out_free(&r32);
    if (bf16_dot)
        ref_out_free(&ry);
    data_free(&d);
    free(fwd);
    free(bwd);
}

static void check_masks_every_layout(rcase_t c, const ref_masks_t *m, const char *name)
{
    check_masks_layouts(c, m, name, mask_layouts, 4);
}

/* Packed documents of 1 token to longer than a shard, a length divisible by
 * nothing, rings of 1 to 8, causal or not, every dtype, GQA and not, one and
 * two batch rows; then with a window. */
Test(ring, packed_documents_every_ring_size, .timeout = 600)
{
    static const int64_t cu[] = {0, 1, 2, 40, 41, 250, 251, 263, 500, 501, 777};
    static const stria_layout_kind_t packed[] = {STRIA_LAYOUT_PACKED};
    static const stria_dtype_t dtypes[] = {STRIA_DTYPE_F32, STRIA_DTYPE_BF16, STRIA_DTYPE_F16};
    for (int n = 1; n <= 8; n++) {
        rcase_t c = {.n = n,
                     .causal = n % 3 != 0,
                     .B = 1 + n % 2,
                     .S = 777,
                     .H = 4,
                     .Hkv = n % 2 ? 2 : 4,
                     .D = 32,
                     .dtype = dtypes[n % 3]};
        ref_masks_t m = {.cu_seqlens = cu, .n_cu = 11};
        check_masks_layouts(c, &m, "packed documents", packed, 1);
        if (n % 4 == 2) {
            m.has_window = true;
            m.left = 60;
            m.right = c.causal ? 0 : 9;
            check_masks_layouts(c, &m, "packed documents, a window", packed, 1);
        }
    }
}

/* One document per token: every document stays home, nothing travels, one
 * step; one document over everything: striping's traffic. */
Test(ring, packed_extremes, .timeout = 600)
{
    static const stria_layout_kind_t packed[] = {STRIA_LAYOUT_PACKED};
    int64_t cu[130];
    for (int i = 0; i < 130; i++)
        cu[i] = i;
    rcase_t c = {.n = 4,
                 .causal = true,
                 .B = 1,
                 .S = 129,
                 .H = 2,
                 .Hkv = 2,
                 .D = 16,
                 .dtype = STRIA_DTYPE_F32};
    ref_masks_t m = {.cu_seqlens = cu, .n_cu = 130};
    check_masks_layouts(c, &m, "one document per token", packed, 1);
    int64_t one[] = {0, 129};
    m = (ref_masks_t){.cu_seqlens = one, .n_cu = 2};
    check_masks_layouts(c, &m, "one document", packed, 1);
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
    for (size_t k = 0; k < 4; k++)
        for (int causal = 0; causal < 2; causal++) {
            rcase_t c = {.n = 4,
                         .layout = mask_layouts[k],
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

/* Bad masks are refused by the ring with the call record's rule, in its
 * words (common/call.c): the same message as the record's own check at the
 * service's doors, and as the kernels' check of the lists they share (all but
 * the end, which they check against their positions). */
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
        bool end; /* the end against seq_len: not a kernel rule */
    } bad[] = {
        {{.cu_seqlens = starts1, .n_cu = 2},
         "ring shape: cu_seqlens must start at 0 (got 1)",
         false},
        {{.cu_seqlens = short_end, .n_cu = 3},
         "cu_seqlens must end at seq_len (64) (got 63)",
         true},
        {{.cu_seqlens = dec, .n_cu = 4},
         "cu_seqlens must not decrease (entry 2 is 20 after 30)",
         false},
        {{.cu_seqlens = NULL, .n_cu = 3}, "cu_seqlens is NULL with 3 entries", false},
        {{.has_window = true, .left = -2},
         "window.left must be >= -1 (-1: unbounded) (got -2)",
         false},
        {{.has_window = true, .left = 3, .right = 1},
         "window.right must be 0 or -1 with causal attention (got 1)",
         false},
        {{.has_window = false, .left = 3}, "has_window is false", false},
    };
    rdata_t d;
    data_init(&c, &d, 3);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char ring_msg[1024];
        cr_expect_eq(ring_run_masks(&c, &bad[i].m, &d, NULL), STRIA_ERR_INVALID_ARG, "case %zu", i);
        snprintf(ring_msg, sizeof(ring_msg), "%s", stria_error_msg());
        cr_expect(strstr(ring_msg, bad[i].needle) != NULL, "case %zu: '%s' lacks '%s'", i, ring_msg,
                  bad[i].needle);

        stria_ring_shape_t shape = shape_of(&c);
        shape.call.cu_seqlens = bad[i].m.cu_seqlens;
        shape.call.n_cu_seqlens = bad[i].m.n_cu;
        shape.call.has_window = bad[i].m.has_window;
        shape.call.window_left = bad[i].m.left;
        shape.call.window_right = bad[i].m.right;
        cr_expect_eq(stria_call_masks_check(&shape.call), STRIA_ERR_INVALID_ARG, "case %zu", i);
        cr_expect(strstr(ring_msg, stria_error_msg()) != NULL, "case %zu: '%s' is not '%s'", i,
                  ring_msg, stria_error_msg());
        if (bad[i].end)
            continue;
        char rule[512];
        snprintf(rule, sizeof(rule), "stria_attn_fwd: params: %s", stria_error_msg());
        const stria_attn_params_t p = stria_ring_shape_attn_params(&shape);
        cr_expect_eq(stria_attn_fwd(&p, NULL, NULL, NULL, NULL, NULL, false), STRIA_ERR_INVALID_ARG,
                     "case %zu", i);
        cr_expect_str_eq(stria_error_msg(), rule, "case %zu", i);
    }
    data_free(&d);
}
