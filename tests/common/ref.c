#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static int64_t ref__pos(const int64_t *pos, int64_t i)
{
    return pos ? pos[i] : i;
}

/* The document holding pos, by a plain scan (-1: none). */
static int64_t ref__doc(const ref_masks_t *m, int64_t pos)
{
    for (size_t d = 0; d + 1 < m->n_cu; d++)
        if (m->cu_seqlens[d] <= pos && pos < m->cu_seqlens[d + 1])
            return (int64_t)d;
    return -1;
}

bool ref_visible(const ref_shape_t *s, const ref_masks_t *m, int64_t qp, int64_t kp)
{
    if (s->causal && kp > qp)
        return false;
    if (m == NULL)
        return true;
    if (m->n_cu > 0 && ref__doc(m, qp) != ref__doc(m, kp))
        return false;
    if (m->has_window && m->left >= 0 && kp < qp - m->left)
        return false;
    if (m->has_window && m->right >= 0 && kp - qp > m->right)
        return false;
    return true;
}

#define REF_DEFINE(NAME, T, EXP, LOG)                                                              \
    void NAME(const ref_shape_t *s, const ref_masks_t *mk, const float *q, const float *k,         \
              const float *v, const float *d_o, ref_out_t *out)                                    \
    {                                                                                              \
        int64_t B = s->batch, Tq = s->q_tokens, Tk = s->kv_tokens, H = s->heads;                   \
        int64_t Hk = s->kv_heads, D = s->head_dim, G = H / Hk;                                     \
        T scale = (T)s->scale;                                                                     \
        T *p = malloc((size_t)Tk * sizeof(T));                                                     \
        T *acc = malloc((size_t)D * sizeof(T));                                                    \
        memset(out, 0, sizeof(*out));                                                              \
        out->o = calloc((size_t)(B * Tq * H * D), sizeof(double));                                 \
        out->lse = calloc((size_t)(B * H * Tq), sizeof(double));                                   \
        if (d_o) {                                                                                 \
            out->dq = calloc((size_t)(B * Tq * H * D), sizeof(double));                            \
            out->dk = calloc((size_t)(B * Tk * Hk * D), sizeof(double));                           \
            out->dv = calloc((size_t)(B * Tk * Hk * D), sizeof(double));                           \
        }                                                                                          \
        T *dk = d_o ? calloc((size_t)(B * Tk * Hk * D), sizeof(T)) : NULL;                         \
        T *dv = d_o ? calloc((size_t)(B * Tk * Hk * D), sizeof(T)) : NULL;                         \
        for (int64_t b = 0; b < B; b++)                                                            \
            for (int64_t h = 0; h < H; h++) {                                                      \
                int64_t hk = h / G;                                                                \
                for (int64_t i = 0; i < Tq; i++) {                                                 \
                    const float *qi = q + ((b * Tq + i) * H + h) * D;                              \
                    int64_t qp = ref__pos(s->q_pos, i);                                            \
                    T m = (T)-INFINITY, l = 0;                                                     \
                    for (int64_t j = 0; j < Tk; j++) {                                             \
                        if (!ref_visible(s, mk, qp, ref__pos(s->kv_pos, j))) {                     \
                            p[j] = (T)-INFINITY;                                                   \
                            continue;                                                              \
                        }                                                                          \
                        const float *kj = k + ((b * Tk + j) * Hk + hk) * D;                        \
                        T dot = 0;                                                                 \
                        for (int64_t d = 0; d < D; d++)                                            \
                            dot += (T)qi[d] * (T)kj[d];                                            \
                        p[j] = dot * scale;                                                        \
                        m = p[j] > m ? p[j] : m;                                                   \
                    }                                                                              \
                    double *oi = out->o + ((b * Tq + i) * H + h) * D;                              \
                    double *lse = out->lse + (b * H + h) * Tq + i;                                 \
                    if (m == (T)-INFINITY) {                                                       \
                        *lse = -INFINITY;                                                          \
                        continue;                                                                  \
                    }                                                                              \
                    for (int64_t j = 0; j < Tk; j++) {                                             \
                        p[j] = EXP(p[j] - m);                                                      \
                        l += p[j];                                                                 \
                    }                                                                              \
                    for (int64_t d = 0; d < D; d++)                                                \
                        acc[d] = 0;                                                                \
                    for (int64_t j = 0; j < Tk; j++) {                                             \
                        if (p[j] == 0)                                                             \
                            continue;                                                              \
                        const float *vj = v + ((b * Tk + j) * Hk + hk) * D;                        \
                        for (int64_t d = 0; d < D; d++)                                            \
                            acc[d] += p[j] * (T)vj[d];                                             \
                    }                                                                              \
                    for (int64_t d = 0; d < D; d++)                                                \
                        oi[d] = (double)(acc[d] / l);                                              \
                    T lse_t = m + LOG(l);                                                          \
                    *lse = (double)lse_t;                                                          \
                    if (!d_o)                                                                      \
                        continue;                                                                  \
                    const float *gi = d_o + ((b * Tq + i) * H + h) * D;                            \
                    T delta = 0;                                                                   \
                    for (int64_t d = 0; d < D; d++)                                                \
                        delta += (T)gi[d] * (acc[d] / l);                                          \
                    double *dqi = out->dq + ((b * Tq + i) * H + h) * D;                            \
                    for (int64_t d = 0; d < D; d++)                                                \
                        acc[d] = 0;                                                                \
                    for (int64_t j = 0; j < Tk; j++) {                                             \
                        if (p[j] == 0)                                                             \
                            continue;                                                              \
                        T pij = p[j] / l;                                                          \
                        const float *kj = k + ((b * Tk + j) * Hk + hk) * D;                        \
                        const float *vj = v + ((b * Tk + j) * Hk + hk) * D;                        \
                        T *dkj = dk + ((b * Tk + j) * Hk + hk) * D;                                \
                        T *dvj = dv + ((b * Tk + j) * Hk + hk) * D;                                \
                        T dp = 0;                                                                  \
                        for (int64_t d = 0; d < D; d++)                                            \
                            dp += (T)gi[d] * (T)vj[d];                                             \
                        T ds = pij * (dp - delta) * scale;                                         \
                        for (int64_t d = 0; d < D; d++) {                                          \
                            dvj[d] += pij * (T)gi[d];                                              \
                            dkj[d] += ds * (T)qi[d];                                               \
                            acc[d] += ds * (T)kj[d];                                               \
                        }                                                                          \
                    }                                                                              \
                    for (int64_t d = 0; d < D; d++)                                                \
                        dqi[d] = (double)acc[d];                                                   \
                }                                                                                  \
            }                                                                                      \
        if (d_o) {                                                                                 \
            for (int64_t x = 0; x < B * Tk * Hk * D; x++) {                                        \
                out->dk[x] = (double)dk[x];                                                        \
                out->dv[x] = (double)dv[x];                                                        \
            }                                                                                      \
        }                                                                                          \
        free(dk);                                                                                  \
        free(dv);                                                                                  \
        free(p);                                                                                   \
        free(acc);                                                                                 \
    }

REF_DEFINE(ref_f64_run_masks, double, exp, log)
REF_DEFINE(ref_f32_run_masks, float, expf, logf)

static double ref__bf(double x)
{
    return (double)stria_bf16_to_f32(stria_f32_to_bf16((float)x));
}

void ref_bf16_run_masks(const ref_shape_t *s, const ref_masks_t *mk, const float *q, const float *k,
                        const float *v, const float *d_o, ref_out_t *out)
{
    int64_t B = s->batch, Tq = s->q_tokens, Tk = s->kv_tokens, H = s->heads;
    int64_t Hk = s->kv_heads, D = s->head_dim, G = H / Hk;
    size_t nq = (size_t)(B * Tq * H * D), nk = (size_t)(B * Tk * Hk * D);
    double sc = sqrt(s->scale);
    double *qs = malloc(nq * sizeof(double)), *ks = malloc(nk * sizeof(double));
    double *p = malloc((size_t)Tk * sizeof(double)), *dp = malloc((size_t)Tk * sizeof(double));
    double *dks = d_o ? calloc(nk, sizeof(double)) : NULL;
    double *dvs = d_o ? calloc(nk, sizeof(double)) : NULL;

    memset(out, 0, sizeof(*out));
    out->o = calloc(nq, sizeof(double));
    out->lse = calloc((size_t)(B * H * Tq), sizeof(double));
    if (d_o) {
        out->dq = calloc(nq, sizeof(double));
        out->dk = calloc(nk, sizeof(double));
        out->dv = calloc(nk, sizeof(double));
    }
    for (size_t x = 0; x < nq; x++)
        qs[x] = ref__bf((double)q[x] * sc);
    for (size_t x = 0; x < nk; x++)
        ks[x] = ref__bf((double)k[x] * sc);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            int64_t hk = h / G;
            for (int64_t i = 0; i < Tq; i++) {
                size_t qi = (size_t)(((b * Tq + i) * H + h) * D);
                int64_t qp = ref__pos(s->q_pos, i);
                double m = -INFINITY, l = 0;
                for (int64_t j = 0; j < Tk; j++) {
                    size_t kj = (size_t)(((b * Tk + j) * Hk + hk) * D);
                    double dot = 0;
                    if (!ref_visible(s, mk, qp, ref__pos(s->kv_pos, j))) {
                        p[j] = -INFINITY;
                        continue;
                    }
                    for (int64_t d = 0; d < D; d++)
                        dot += qs[qi + (size_t)d] * ks[kj + (size_t)d];
                    p[j] = ref__bf(dot);
                    m = p[j] > m ? p[j] : m;
                }
                double *lse = out->lse + (b * H + h) * Tq + i;
                if (m == -INFINITY) {
                    *lse = -INFINITY;
                    continue;
                }
                for (int64_t j = 0; j < Tk; j++) {
                    p[j] = exp(p[j] - m);
                    l += p[j];
                }
                *lse = m + log(l);
                for (int64_t j = 0; j < Tk; j++)
                    p[j] = ref__bf(p[j] / l);
                for (int64_t d = 0; d < D; d++) {
                    double acc = 0;
                    for (int64_t j = 0; j < Tk; j++)
                        acc += p[j] * (double)v[((b * Tk + j) * Hk + hk) * D + d];
                    out->o[qi + (size_t)d] = ref__bf(acc);
                }
                if (!d_o)
                    continue;
                const float *gi = d_o + qi;
                double dsum = 0;
                for (int64_t j = 0; j < Tk; j++) {
                    double acc = 0;
                    if (p[j] == 0) {
                        dp[j] = 0;
                        continue;
                    }
                    for (int64_t d = 0; d < D; d++)
                        acc += (double)gi[d] * (double)v[((b * Tk + j) * Hk + hk) * D + d];
                    dp[j] = ref__bf(acc);
                    dsum += p[j] * dp[j];
                }
                for (int64_t j = 0; j < Tk; j++) /* dS, over dP */
                    dp[j] = ref__bf(p[j] * (dp[j] - dsum));
                for (int64_t d = 0; d < D; d++) {
                    double acc = 0;
                    for (int64_t j = 0; j < Tk; j++)
                        acc += dp[j] * ks[((b * Tk + j) * Hk + hk) * D + d];
                    out->dq[qi + (size_t)d] = ref__bf(ref__bf(acc) * sc);
                }
                for (int64_t j = 0; j < Tk; j++) {
                    size_t kj = (size_t)(((b * Tk + j) * Hk + hk) * D);
                    if (p[j] == 0 && dp[j] == 0)
                        continue;
                    for (int64_t d = 0; d < D; d++) {
                        dvs[kj + (size_t)d] += p[j] * (double)gi[d];
                        dks[kj + (size_t)d] += dp[j] * qs[qi + (size_t)d];
                    }
                }
            }
        }
    if (d_o)
        for (size_t x = 0; x < nk; x++) {
            out->dv[x] = ref__bf(dvs[x]);
            out->dk[x] = ref__bf(ref__bf(dks[x]) * sc);
        }
    free(qs);
    free(ks);
    free(p);
    free(dp);
    free(dks);
    free(dvs);
}

bool ref_bf16_dot(const char *variant)
{
    if (strcmp(variant, "amx-emu") == 0) /* the test builds' emulated tiles: any CPU */
        return true;
#if defined(__x86_64__)
    __builtin_cpu_init();
    bool avx512_bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                       __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx512bf16");
    if (strcmp(variant, "amx") == 0) { /* AMX-BF16, AMX-TILE, and the tile state granted */
        unsigned a, b, c, d;
        return avx512_bf16 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1u) &&
               (d >> 24 & 1u) && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return strcmp(variant, "avx512") == 0 && avx512_bf16;
#else
    (void)variant;
    return false;
#endif
}

bool ref_bf16_dot_default(void)
{
    const char *env = getenv("STRIA_KERNEL");
    return ref_bf16_dot(env != NULL && env[0] != '\0' ? env : "avx512");
}

void ref_f64_run(const ref_shape_t *s, const float *q, const float *k, const float *v,
                 const float *d_o, ref_out_t *out)
{
    ref_f64_run_masks(s, NULL, q, k, v, d_o, out);
}

void ref_f32_run(const ref_shape_t *s, const float *q, const float *k, const float *v,
                 const float *d_o, ref_out_t *out)
{
    ref_f32_run_masks(s, NULL, q, k, v, d_o, out);
}

void ref_out_free(ref_out_t *out)
{
    free(out->o);
    free(out->lse);
    free(out->dq);
    free(out->dk);
    free(out->dv);
    memset(out, 0, sizeof(*out));
}

static double ref__err(double a, double r)
{
    if (isinf(r) || isinf(a)) {
        if (a == r)
            return 0.0;
        return INFINITY;
    }
    if (isnan(a) || isnan(r))
        return INFINITY;
    return fabs(a - r);
}

double ref_max_err_f32(const float *a, const double *ref, size_t n)
{
    double e = 0.0;
    for (size_t i = 0; i < n; i++) {
        double x = ref__err((double)a[i], ref[i]);
        e = x > e ? x : e;
    }
    return e;
}

double ref_max_err_f64(const double *a, const double *ref, size_t n)
{
    double e = 0.0;
    for (size_t i = 0; i < n; i++) {
        double x = ref__err(a[i], ref[i]);
        e = x > e ? x : e;
    }
    return e;
}

double ref_max_abs(const double *ref, size_t n)
{
    double m = 0.0;
    for (size_t i = 0; i < n; i++)
        if (isfinite(ref[i]) && fabs(ref[i]) > m)
            m = fabs(ref[i]);
    return m;
}

void ref_fill(float *out, size_t n, uint64_t seed, float amp, stria_dtype_t dtype)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        float u = (float)((x >> 40) * (1.0 / 16777216.0)); /* [0, 1) */
        float val = (2.0f * u - 1.0f) * amp;
        uint16_t h;
        switch (dtype) {
        case STRIA_DTYPE_BF16:
            h = stria_f32_to_bf16(val);
            val = stria_bf16_to_f32(h);
            break;
        case STRIA_DTYPE_F16:
            h = stria_f32_to_f16(val);
            val = stria_f16_to_f32(h);
            break;
        default:
            break;
        }
        out[i] = val;
    }
}

void ref_to_dtype(const float *src, size_t n, stria_dtype_t dtype, void *dst)
{
    stria_dtype_convert(STRIA_DTYPE_F32, src, dtype, dst, n);
}
