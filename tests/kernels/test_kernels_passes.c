/* Kernel suite, views and passes: strided views against contiguous tensors,
 * and the forward and backward pass objects against per-block calls, with
 * their bad arguments. */
#include <criterion/criterion.h>

#include "kernels_test_util.h"

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
 * group; 3 threads: tasks per key-tile block adding into one dQ under
 * locks; 9 threads: separate dQ tasks),
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
