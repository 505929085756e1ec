/* Non-finite inputs are never hidden: helpers of the kernel and ring suites.
 *
 * One NaN or infinity is put at one spot of Q, K, V or dO. An fp64 reference
 * that follows the mask position by position, with PyTorch SDPA's meaning of
 * non-finite scores (a NaN or +inf score poisons its query's row; a -inf
 * score is a zero weight, and a row whose visible scores are all -inf sees
 * nothing, as a fully masked row does), says which outputs depend on the
 * spot: each of those must be non-finite in the kernels' output. Outputs of
 * the batch rows and kv head groups the spot is not in must stay finite and
 * equal (to summation order) to those of a run with a finite value at the
 * spot. Inside the spot's group a kernel may poison more than the
 * dependency (0 x NaN at a masked position, as SDPA's math path does).
 * Static inline, C and C++ (tests/gpu/test_kernel_emu.cu runs the CUDA
 * kernels against it), no test framework: failures go to a report
 * callback. */
#ifndef STRIA_TEST_NONFINITE_H
#define STRIA_TEST_NONFINITE_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

typedef enum { NF_Q = 0, NF_K, NF_V, NF_DO, NF_N_TENSORS } nf_tensor_t;

static const char *const nf_tensor_names[] = {"Q", "K", "V", "dO"};
static const float nf_values[] = {NAN, INFINITY, -INFINITY};
static const char *const nf_value_names[] = {"NaN", "+inf", "-inf"};

/* The sizes of a call (or of a whole sequence through the ring). */
typedef struct {
    int64_t B, Tq, Tk, H, Hkv, D;
} nf_dims_t;

/* Where the non-finite value goes: token `tok` (a query of Q and dO, a key
 * of K and V), head `head` (a query head or a kv head) and dimension `dim`
 * of batch row `b`. */
typedef struct {
    nf_tensor_t t;
    int64_t b, tok, head, dim;
    float value;
} nf_spot_t;

/* Outputs as the kernels give them: fp32, contiguous [B, T, H, D] (LSE
 * [B, H, Tq]). */
typedef struct {
    const float *o, *lse, *dq, *dk, *dv;
} nf_outs_t;

static inline size_t nf_index(const nf_dims_t *n, const nf_spot_t *s)
{
    bool qside = s->t == NF_Q || s->t == NF_DO;
    int64_t T = qside ? n->Tq : n->Tk, H = qside ? n->H : n->Hkv;
    return (size_t)(((s->b * T + s->tok) * H + s->head) * n->D + s->dim);
}

/* The kv head group of the spot. */
static inline int64_t nf_spot_group(const nf_dims_t *n, const nf_spot_t *s)
{
    bool qside = s->t == NF_Q || s->t == NF_DO;
    return s->b * n->Hkv + (qside ? s->head / (n->H / n->Hkv) : s->head);
}

static inline int64_t nf_pos(const int64_t *pos, int64_t i)
{
    return pos != NULL ? pos[i] : i;
}

/* A token of the spot's side (queries: qside) that some query sees
 * (visible) or that none does, searched from `from` on; -1 when there is
 * none. */
static inline int64_t nf_token(const ref_shape_t *rs, const ref_masks_t *m, bool qside,
                               bool visible, int64_t from)
{
    const int64_t n = qside ? rs->q_tokens : rs->kv_tokens;
    const int64_t other = qside ? rs->kv_tokens : rs->q_tokens;
    for (int64_t s = 0; s < n; s++) {
        const int64_t t = (from + s) % n;
        bool seen = false;
        for (int64_t o = 0; o < other && !seen; o++)
            seen = qside ? ref_visible(rs, m, nf_pos(rs->q_pos, t), nf_pos(rs->kv_pos, o))
                         : ref_visible(rs, m, nf_pos(rs->q_pos, o), nf_pos(rs->kv_pos, t));
        if (seen == visible)
            return t;
    }
    return -1;
}

/* The reference (see the top): fp64, d_o required, outputs allocated as by
 * ref_f64_run_masks(). */
static inline void nf_ref_run(const ref_shape_t *s, const ref_masks_t *mk, const float *q,
                              const float *k, const float *v, const float *d_o, ref_out_t *out)
{
    const int64_t B = s->batch, Tq = s->q_tokens, Tk = s->kv_tokens, H = s->heads;
    const int64_t Hk = s->kv_heads, D = s->head_dim, G = H / Hk;
    double *p = (double *)malloc((size_t)Tk * sizeof(double));
    double *acc = (double *)malloc((size_t)D * sizeof(double));
    bool *vis = (bool *)malloc((size_t)Tk * sizeof(bool));
    out->o = (double *)calloc((size_t)(B * Tq * H * D), sizeof(double));
    out->lse = (double *)calloc((size_t)(B * H * Tq), sizeof(double));
    out->dq = (double *)calloc((size_t)(B * Tq * H * D), sizeof(double));
    out->dk = (double *)calloc((size_t)(B * Tk * Hk * D), sizeof(double));
    out->dv = (double *)calloc((size_t)(B * Tk * Hk * D), sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Tq; i++) {
                const int64_t hk = h / G;
                const float *qi = q + ((b * Tq + i) * H + h) * D;
                const float *gi = d_o + ((b * Tq + i) * H + h) * D;
                double m = -INFINITY, l = 0.0;
                bool nan = false;
                for (int64_t j = 0; j < Tk; j++) {
                    vis[j] = ref_visible(s, mk, nf_pos(s->q_pos, i), nf_pos(s->kv_pos, j));
                    if (!vis[j])
                        continue;
                    const float *kj = k + ((b * Tk + j) * Hk + hk) * D;
                    double dot = 0.0;
                    for (int64_t d = 0; d < D; d++)
                        dot += (double)qi[d] * (double)kj[d];
                    p[j] = dot * s->scale;
                    nan |= isnan(p[j]);
                    m = p[j] > m ? p[j] : m;
                }
                double *lse = out->lse + (b * H + h) * Tq + i;
                if (nan)
                    m = NAN;          /* the max of a row with a NaN score */
                if (m == -INFINITY) { /* nothing visible, or only -inf scores */
                    *lse = -INFINITY;
                    continue;
                }
                for (int64_t j = 0; j < Tk; j++)
                    if (vis[j]) {
                        p[j] = exp(p[j] - m); /* NaN for every score when m is NaN or +inf */
                        l += p[j];
                    }
                for (int64_t d = 0; d < D; d++)
                    acc[d] = 0.0;
                for (int64_t j = 0; j < Tk; j++) {
                    if (!vis[j] || p[j] == 0.0) /* a zero weight */
                        continue;
                    const float *vj = v + ((b * Tk + j) * Hk + hk) * D;
                    for (int64_t d = 0; d < D; d++)
                        acc[d] += p[j] * (double)vj[d];
                }
                double *oi = out->o + ((b * Tq + i) * H + h) * D, delta = 0.0;
                for (int64_t d = 0; d < D; d++) {
                    oi[d] = acc[d] / l;
                    delta += (double)gi[d] * oi[d];
                }
                *lse = m + log(l);
                double *dqi = out->dq + ((b * Tq + i) * H + h) * D;
                for (int64_t j = 0; j < Tk; j++) {
                    if (!vis[j] || p[j] == 0.0)
                        continue;
                    const double pij = p[j] / l;
                    const float *kj = k + ((b * Tk + j) * Hk + hk) * D;
                    const float *vj = v + ((b * Tk + j) * Hk + hk) * D;
                    double *dkj = out->dk + ((b * Tk + j) * Hk + hk) * D;
                    double *dvj = out->dv + ((b * Tk + j) * Hk + hk) * D;
                    double dp = 0.0;
                    for (int64_t d = 0; d < D; d++)
                        dp += (double)gi[d] * (double)vj[d];
                    const double ds = pij * (dp - delta) * s->scale;
                    for (int64_t d = 0; d < D; d++) {
                        dvj[d] += pij * (double)gi[d];
                        dkj[d] += ds * (double)qi[d];
                        dqi[d] += ds * (double)kj[d];
                    }
                }
            }
    free(p), free(acc), free(vis);
}

typedef struct {
    size_t must;    /* outputs the spot reaches, all non-finite as they must be */
    size_t outside; /* outputs of other groups checked finite and equal */
    size_t failed;  /* checks that failed (each reported) */
} nf_counts_t;

/* Where failures go: one line each. */
typedef void (*nf_report_fn)(void *ctx, const char *msg);

/* Checks one output tensor of rows of D values (LSE: D = 1) and `heads`
 * heads per token (LSE: [B][H][T], heads_first): every element the
 * reference makes non-finite is non-finite in got; every element outside
 * the spot's group is finite and equal to the clean run's to 1e-4 of the
 * clean tensor's largest value. An LSE of -inf (a row that sees no key) is
 * an ordinary value there, and never a poisoned one. */
static inline void nf_check_tensor(const char *what, const float *got, const float *clean,
                                   const double *ref, const nf_dims_t *n, int64_t T, int64_t heads,
                                   int64_t G, int64_t D, bool heads_first, int64_t group,
                                   const char *label, nf_counts_t *cnt, nf_report_fn report,
                                   void *ctx)
{
    const size_t total = (size_t)(n->B * T * heads * D);
    double big = 0.0;
    for (size_t x = 0; x < total; x++)
        big = isfinite(clean[x]) && fabs((double)clean[x]) > big ? fabs((double)clean[x]) : big;
    size_t bad_must = 0, bad_out = 0, first_must = 0, first_out = 0;
    for (size_t x = 0; x < total; x++) {
        const int64_t row = (int64_t)(x / (size_t)D); /* [B][T][heads] or [B][heads][T] */
        const int64_t b = row / (T * heads);
        const int64_t h = heads_first ? row / T % heads : row % heads;
        const bool in_group = b * n->Hkv + h / G == group;
        /* an LSE of -inf is a row that sees no key, not a poisoned one */
        const bool empty_row = heads_first && ref[x] == -INFINITY;
        if (!isfinite(ref[x]) && !empty_row) {
            /* poisoned: an LSE of -inf would say "no key seen" instead */
            const bool poisoned =
                heads_first ? isnan(got[x]) || got[x] == INFINITY : !isfinite(got[x]);
            cnt->must++;
            if (!poisoned && bad_must++ == 0)
                first_must = x;
        } else if (!in_group) {
            const bool same =
                heads_first && got[x] == -INFINITY
                    ? clean[x] == -INFINITY
                    : isfinite(got[x]) && fabs((double)got[x] - (double)clean[x]) <= 1e-4 * big;
            cnt->outside++;
            if (!same && bad_out++ == 0)
                first_out = x;
        }
    }
    char msg[512];
    if (bad_must > 0) {
        snprintf(msg, sizeof(msg),
                 "%s: %s: %zu outputs that depend on the non-finite value are finite (first at "
                 "%zu: %g, reference %g)",
                 label, what, bad_must, first_must, (double)got[first_must], ref[first_must]);
        report(ctx, msg);
        cnt->failed++;
    }
    if (bad_out > 0) {
        snprintf(msg, sizeof(msg),
                 "%s: %s: %zu outputs outside the value's group changed (first at %zu: %g, "
                 "without the value %g)",
                 label, what, bad_out, first_out, (double)got[first_out], (double)clean[first_out]);
        report(ctx, msg);
        cnt->failed++;
    }
}

/* Every output of a run with the spot against the reference of the same
 * inputs (ref) and the run without it (clean); also that a spot the mask
 * lets some query see reaches some output (visible) and a hidden one none,
 * and that some output outside the spot's group was checked. */
static inline nf_counts_t nf_check(const nf_dims_t *n, const nf_spot_t *s, bool visible,
                                   const nf_outs_t *got, const nf_outs_t *clean,
                                   const ref_out_t *ref, const char *label, nf_report_fn report,
                                   void *ctx)
{
    nf_counts_t cnt = {0, 0, 0};
    const int64_t G = n->H / n->Hkv, grp = nf_spot_group(n, s);
    nf_check_tensor("O", got->o, clean->o, ref->o, n, n->Tq, n->H, G, n->D, false, grp, label, &cnt,
                    report, ctx);
    nf_check_tensor("LSE", got->lse, clean->lse, ref->lse, n, n->Tq, n->H, G, 1, true, grp, label,
                    &cnt, report, ctx);
    nf_check_tensor("dQ", got->dq, clean->dq, ref->dq, n, n->Tq, n->H, G, n->D, false, grp, label,
                    &cnt, report, ctx);
    nf_check_tensor("dK", got->dk, clean->dk, ref->dk, n, n->Tk, n->Hkv, 1, n->D, false, grp, label,
                    &cnt, report, ctx);
    nf_check_tensor("dV", got->dv, clean->dv, ref->dv, n, n->Tk, n->Hkv, 1, n->D, false, grp, label,
                    &cnt, report, ctx);
    char msg[512];
    if (visible != (cnt.must > 0)) {
        snprintf(msg, sizeof(msg), "%s: a %s value reaches %zu outputs", label,
                 visible ? "visible" : "hidden", cnt.must);
        report(ctx, msg);
        cnt.failed++;
    }
    if (cnt.outside == 0) {
        snprintf(msg, sizeof(msg), "%s: no output outside the value's group", label);
        report(ctx, msg);
        cnt.failed++;
    }
    return cnt;
}

/* Four Criterion tests of one suite, one per tensor the value goes in:
 * fn(NF_Q), ... (for the suites that include Criterion before this). */
#define NF_TESTS_PER_TENSOR(suite, fn)                                                             \
    Test(suite, in_q, .timeout = 600)                                                              \
    {                                                                                              \
        fn(NF_Q);                                                                                  \
    }                                                                                              \
    Test(suite, in_k, .timeout = 600)                                                              \
    {                                                                                              \
        fn(NF_K);                                                                                  \
    }                                                                                              \
    Test(suite, in_v, .timeout = 600)                                                              \
    {                                                                                              \
        fn(NF_V);                                                                                  \
    }                                                                                              \
    Test(suite, in_do, .timeout = 600)                                                             \
    {                                                                                              \
        fn(NF_DO);                                                                                 \
    }

#endif
