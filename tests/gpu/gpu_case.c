/* The harness of the gpu suite (gpu_case.h). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_case.h"
#include "ref.h"

const stria_dtype_t all_dtypes[3] = {STRIA_DTYPE_F32, STRIA_DTYPE_BF16, STRIA_DTYPE_F16};

/* ---- device helpers -------------------------------------------------------- */

stria_device_t *gpu_open(void)
{
    stria_device_t *dev = NULL;
    cr_assert_eq(stria_device_open("cuda:0", NULL, &dev), STRIA_OK, "%s", stria_error_msg());
    return dev;
}

void *gpu_upload(stria_device_t *dev, const void *src, size_t bytes)
{
    void *p = NULL;
    cr_assert_eq(stria_device_alloc(dev, bytes, &p), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COMPUTE, p, src, bytes), STRIA_OK, "%s",
                 stria_error_msg());
    return p;
}

void gpu_download(stria_device_t *dev, void *dst, const void *src, size_t bytes)
{
    cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COMPUTE, dst, src, bytes), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_device_sync(dev, STRIA_STREAM_COMPUTE), STRIA_OK, "%s", stria_error_msg());
}

hview_t hview_make(const float *vals, stria_dtype_t dtype, int64_t B, int64_t T, int64_t H,
                   int64_t D, int64_t pad, float filler)
{
    hview_t h;
    size_t es = stria_dtype_size(dtype);
    int64_t sh = D + pad;
    size_t n = (size_t)(B * T * H * sh);
    h.bytes = n * es;
    h.host = malloc(h.bytes);
    cr_assert(h.host != NULL);
    for (size_t i = 0; i < n; i++)
        stria_dtype_store(dtype, h.host, i, filler);
    for (int64_t r = 0; r < B * T * H; r++)
        for (int64_t d = 0; d < D; d++)
            stria_dtype_store(dtype, h.host, (size_t)(r * sh + d),
                              vals != NULL ? vals[r * D + d] : 0.0f);
    h.view.data = h.host;
    h.view.dtype = dtype;
    h.view.stride_head = sh;
    h.view.stride_token = H * sh;
    h.view.stride_batch = T * H * sh;
    return h;
}

/* The same view over device memory holding a copy of h. */
stria_tensor_t dview(stria_device_t *dev, const hview_t *h)
{
    stria_tensor_t t = h->view;
    t.data = gpu_upload(dev, h->host, h->bytes);
    return t;
}

/* Values of a downloaded fp32 view as contiguous [B][T][H][D]; checks that
 * the padding still holds `filler`. */
void hview_read(const hview_t *h, int64_t B, int64_t T, int64_t H, int64_t D, int64_t pad,
                float filler, float *out, const char *what)
{
    int64_t sh = D + pad;
    const float *src = h->host;
    for (int64_t r = 0; r < B * T * H; r++) {
        memcpy(out + r * D, src + r * sh, (size_t)D * sizeof(float));
        for (int64_t d = D; d < sh; d++)
            cr_expect_eq(src[r * sh + d], filler, "%s: padding element of row %lld overwritten",
                         what, (long long)r);
    }
}

/* ---- the tolerance rule ---------------------------------------------------- */

#define FLOOR_REL 2e-6

bool uses_mma(const gcase_t *c)
{
    return c->dtype != STRIA_DTYPE_F32 && (c->D == 64 || c->D == 128) && c->pad % 8 == 0;
}

double dtype_term(const gcase_t *c)
{
    if (!uses_mma(c))
        return 0.0;
    return c->dtype == STRIA_DTYPE_BF16 ? 0x1p-6 : 0x1p-9;
}

static void describe(const gcase_t *c, char *buf, size_t n)
{
    snprintf(buf, n,
             "dtype %s D=%lld B=%lld Tq=%lld Tk=%lld H=%lld/%lld causal=%d pad=%lld runs=%zu/%zu "
             "q_first=%lld k_first=%lld docs=%zu window=%d(%lld,%lld) (%s kernels)",
             stria_dtype_name(c->dtype), (long long)c->D, (long long)c->B, (long long)c->Tq,
             (long long)c->Tk, (long long)c->H, (long long)c->Hkv, c->causal, (long long)c->pad,
             c->n_qruns, c->n_kruns, c->n_qruns ? (long long)c->qruns[0].first : 0LL,
             c->n_kruns ? (long long)c->kruns[0].first : 0LL, c->n_cu, c->has_window,
             (long long)c->left, (long long)c->right, uses_mma(c) ? "tensor-core" : "SIMT");
}

/* got: GPU; cpu: portable CPU kernel; ref64/ref32: fp64 and plain fp32
 * references. */
static void check_out(const char *what, const gcase_t *c, const float *got, const float *cpu,
                      const double *ref64, const double *ref32, size_t n)
{
    char desc[320];
    double maxabs = ref_max_abs(ref64, n);
    double naive = ref_max_err_f64(ref32, ref64, n);
    double tol = 2.0 * naive + FLOOR_REL * (1.0 + maxabs) + dtype_term(c) * maxabs;
    double err = ref_max_err_f32(got, ref64, n);
    double cpu_err = ref_max_err_f32(cpu, ref64, n);
    double diff = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (isinf(got[i]) || isinf(cpu[i])) {
            if (got[i] != cpu[i]) {
                diff = INFINITY;
                break;
            }
            continue;
        }
        double d = fabs((double)got[i] - (double)cpu[i]);
        diff = d > diff || d != d ? d : diff;
    }
    describe(c, desc, sizeof(desc));
    cr_expect(err <= tol,
              "%s: %s: error %.3g > tolerance %.3g (naive fp32 error %.3g, max |ref| %.3g)", what,
              desc, err, tol, naive, maxabs);
    cr_expect(diff <= tol + cpu_err,
              "%s: %s: differs from the portable CPU kernel by %.3g > %.3g (tolerance %.3g + CPU "
              "error %.3g)",
              what, desc, diff, tol + cpu_err, tol, cpu_err);
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

stria_attn_params_t case_params(const gcase_t *c)
{
    stria_attn_params_t p;
    memset(&p, 0, sizeof(p));
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
    p.cu_seqlens = c->cu;
    p.n_cu_seqlens = c->n_cu;
    p.has_window = c->has_window;
    p.window_left = c->left;
    p.window_right = c->right;
    return p;
}

/* ---- forward + delta + backward of one case ------------------------------- */

/* The checks of a case: O, LSE, dQ, dK, dV of the GPU (gpu[0..5]: o, lse,
 * delta, dq, dk, dv) against the fp64 reference and the CPU's (cpu[0..5]),
 * D against the CPU's D. q, k, v, g: the fp32 inputs. */
static void check_case(const gcase_t *c, const int64_t *qpos, const int64_t *kpos, const float *q,
                       const float *k, const float *v, const float *g, const float *const cpu[6],
                       const float *const gpu[6])
{
    const int64_t B = c->B, Tq = c->Tq, Tk = c->Tk, H = c->H, Hkv = c->Hkv, D = c->D;
    size_t nq = (size_t)(B * Tq * H * D), nk = (size_t)(B * Tk * Hkv * D);
    size_t nl = (size_t)(B * H * Tq);
    ref_shape_t rs = {
        B,         Tq,   Tk,  H, Hkv, D, c->scale > 0 ? c->scale : 1.0 / sqrt((double)D),
        c->causal, qpos, kpos};
    ref_masks_t rm = {c->cu, c->n_cu, c->has_window, c->left, c->right};
    ref_out_t r64, r32;
    ref_f64_run_masks(&rs, &rm, q, k, v, g, &r64);
    ref_f32_run_masks(&rs, &rm, q, k, v, g, &r32);
    check_out("O", c, gpu[0], cpu[0], r64.o, r32.o, nq);
    check_out("LSE", c, gpu[1], cpu[1], r64.lse, r32.lse, nl);
    check_out("dQ", c, gpu[3], cpu[3], r64.dq, r32.dq, nq);
    check_out("dK", c, gpu[4], cpu[4], r64.dk, r32.dk, nk);
    check_out("dV", c, gpu[5], cpu[5], r64.dv, r32.dv, nk);
    /* D from the GPU's own O: against the CPU's D, same rule as O */
    double maxabs = 0.0, diff = 0.0;
    for (size_t i = 0; i < nl; i++) {
        maxabs = fabs(cpu[2][i]) > maxabs ? fabs(cpu[2][i]) : maxabs;
        double d = fabs((double)gpu[2][i] - (double)cpu[2][i]);
        diff = d > diff || d != d ? d : diff;
    }
    char desc[320];
    describe(c, desc, sizeof(desc));
    cr_expect(diff <= 1e-4 + 4.0 * dtype_term(c) * (1.0 + maxabs),
              "delta: %s: GPU and CPU differ by %.3g (max |D| %.3g)", desc, diff, maxabs);
    ref_out_free(&r64);
    ref_out_free(&r32);
}

#define ACC_INIT 0.25f /* dq, dk, dv start here: the backward pass must add */

void run_case_out(const gcase_t *c, gpu_outs_t *out)
{
    const int64_t B = c->B, Tq = c->Tq, Tk = c->Tk, H = c->H, Hkv = c->Hkv, D = c->D;
    size_t nq = (size_t)(B * Tq * H * D), nk = (size_t)(B * Tk * Hkv * D);
    size_t nl = (size_t)(B * H * Tq);
    size_t es = stria_dtype_size(c->dtype);
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *g = malloc(nq * 4);
    void *qs = malloc(nq * es), *ks = malloc(nk * es), *vs = malloc(nk * es), *gs = malloc(nq * es);
    float *o = malloc(nq * 4), *lse = malloc(nl * 4), *delta = malloc(nl * 4);
    float *dq = malloc(nq * 4), *dk = malloc(nk * 4), *dv = malloc(nk * 4);
    float *go = malloc(nq * 4), *glse = malloc(nl * 4), *gdelta = malloc(nl * 4);
    float *gdq = malloc(nq * 4), *gdk = malloc(nk * 4), *gdv = malloc(nk * 4);
    int64_t *qpos = expand(c->qruns, c->n_qruns, Tq), *kpos = expand(c->kruns, c->n_kruns, Tk);
    stria_attn_params_t p = case_params(c);
    stria_device_t *dev = gpu_open();

    /* inputs, rounded to the dtype so every implementation sees the same values */
    ref_fill(q, nq, 1 + (uint64_t)D, 1.0f, c->dtype);
    ref_fill(k, nk, 2 + (uint64_t)Tk, 1.0f, c->dtype);
    ref_fill(v, nk, 3, 1.0f, c->dtype);
    ref_fill(g, nq, 4, 1.0f, c->dtype);
    if (c->spot != NULL) {
        const nf_dims_t dims = {B, Tq, Tk, H, Hkv, D};
        float *const in[NF_N_TENSORS] = {q, k, v, g};
        in[c->spot->t][nf_index(&dims, c->spot)] = c->spot->value;
    }
    ref_to_dtype(q, nq, c->dtype, qs);
    ref_to_dtype(k, nk, c->dtype, ks);
    ref_to_dtype(v, nk, c->dtype, vs);
    ref_to_dtype(g, nq, c->dtype, gs);

    /* the portable CPU kernels */
    cr_assert_eq(stria_kernels_set_variant("portable"), STRIA_OK, "%s", stria_error_msg());
    for (size_t i = 0; i < nq; i++)
        dq[i] = ACC_INIT;
    for (size_t i = 0; i < nk; i++)
        dk[i] = dv[i] = ACC_INIT;
    {
        stria_tensor_t tq = stria_tensor_contiguous(qs, c->dtype, Tq, H, D);
        stria_tensor_t tk = stria_tensor_contiguous(ks, c->dtype, Tk, Hkv, D);
        stria_tensor_t tv = stria_tensor_contiguous(vs, c->dtype, Tk, Hkv, D);
        stria_tensor_t tg = stria_tensor_contiguous(gs, c->dtype, Tq, H, D);
        stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, Tq, H, D);
        stria_tensor_t tdq = stria_tensor_contiguous(dq, STRIA_DTYPE_F32, Tq, H, D);
        stria_tensor_t tdk = stria_tensor_contiguous(dk, STRIA_DTYPE_F32, Tk, Hkv, D);
        stria_tensor_t tdv = stria_tensor_contiguous(dv, STRIA_DTYPE_F32, Tk, Hkv, D);
        cr_assert_eq(stria_attn_fwd(&p, &tq, &tk, &tv, &to, lse, false), STRIA_OK, "%s",
                     stria_error_msg());
        cr_assert_eq(stria_attn_bwd_delta(&p, &to, &tg, delta), STRIA_OK, "%s", stria_error_msg());
        cr_assert_eq(stria_attn_bwd(&p, &tq, &tk, &tv, &tg, lse, delta, &tdq, &tdk, &tdv), STRIA_OK,
                     "%s", stria_error_msg());
    }

    /* the GPU, on (possibly padded) strided views */
    hview_t hq = hview_make(q, c->dtype, B, Tq, H, D, c->pad, FILLER);
    hview_t hk = hview_make(k, c->dtype, B, Tk, Hkv, D, c->pad, FILLER);
    hview_t hv = hview_make(v, c->dtype, B, Tk, Hkv, D, c->pad, FILLER);
    hview_t hg = hview_make(g, c->dtype, B, Tq, H, D, c->pad, FILLER);
    hview_t ho = hview_make(NULL, STRIA_DTYPE_F32, B, Tq, H, D, c->pad, FILLER);
    hview_t hdq = hview_make(NULL, STRIA_DTYPE_F32, B, Tq, H, D, c->pad, FILLER);
    hview_t hdk = hview_make(NULL, STRIA_DTYPE_F32, B, Tk, Hkv, D, c->pad, FILLER);
    hview_t hdv = hview_make(NULL, STRIA_DTYPE_F32, B, Tk, Hkv, D, c->pad, FILLER);
    for (int64_t r = 0; r < B * Tq * H; r++)
        for (int64_t d = 0; d < D; d++)
            ((float *)hdq.host)[r * (D + c->pad) + d] = ACC_INIT;
    for (int64_t r = 0; r < B * Tk * Hkv; r++)
        for (int64_t d = 0; d < D; d++)
            ((float *)hdk.host)[r * (D + c->pad) + d] = ((float *)hdv.host)[r * (D + c->pad) + d] =
                ACC_INIT;
    stria_tensor_t dq_ = dview(dev, &hq), dk_ = dview(dev, &hk), dv_ = dview(dev, &hv);
    stria_tensor_t dg_ = dview(dev, &hg), do_ = dview(dev, &ho);
    stria_tensor_t ddq = dview(dev, &hdq), ddk = dview(dev, &hdk), ddv = dview(dev, &hdv);
    float *dlse = NULL, *ddelta = NULL;
    cr_assert_eq(stria_device_alloc(dev, nl * 4, (void **)&dlse), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, nl * 4, (void **)&ddelta), STRIA_OK);
    cr_assert_eq(stria_device_attn_fwd(dev, &p, &dq_, &dk_, &dv_, &do_, dlse, false), STRIA_OK,
                 "%s", stria_error_msg());
    cr_assert_eq(stria_device_attn_bwd_delta(dev, &p, &do_, &dg_, ddelta), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(
        stria_device_attn_bwd(dev, &p, &dq_, &dk_, &dv_, &dg_, dlse, ddelta, &ddq, &ddk, &ddv),
        STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_device_sync(dev, STRIA_STREAM_COMPUTE), STRIA_OK, "%s", stria_error_msg());
    gpu_download(dev, ho.host, do_.data, ho.bytes);
    gpu_download(dev, hdq.host, ddq.data, hdq.bytes);
    gpu_download(dev, hdk.host, ddk.data, hdk.bytes);
    gpu_download(dev, hdv.host, ddv.data, hdv.bytes);
    gpu_download(dev, glse, dlse, nl * 4);
    gpu_download(dev, gdelta, ddelta, nl * 4);
    hview_read(&ho, B, Tq, H, D, c->pad, FILLER, go, "O");
    hview_read(&hdq, B, Tq, H, D, c->pad, FILLER, gdq, "dQ");
    hview_read(&hdk, B, Tk, Hkv, D, c->pad, FILLER, gdk, "dK");
    hview_read(&hdv, B, Tk, Hkv, D, c->pad, FILLER, gdv, "dV");
    for (size_t i = 0; i < nq; i++) {
        dq[i] -= ACC_INIT;
        gdq[i] -= ACC_INIT;
    }
    for (size_t i = 0; i < nk; i++) {
        dk[i] -= ACC_INIT;
        dv[i] -= ACC_INIT;
        gdk[i] -= ACC_INIT;
        gdv[i] -= ACC_INIT;
    }

    if (c->spot == NULL)
        check_case(c, qpos, kpos, q, k, v, g, (const float *const[]){o, lse, delta, dq, dk, dv},
                   (const float *const[]){go, glse, gdelta, gdq, gdk, gdv});
    if (out != NULL) {
        memset(out, 0, sizeof(*out));
        out->nq = nq, out->nk = nk, out->nl = nl;
        out->o = go, out->lse = glse, out->dq = gdq, out->dk = gdk, out->dv = gdv;
        go = glse = gdq = gdk = gdv = NULL; /* kept */
        if (c->spot != NULL) {
            out->in[NF_Q] = q, out->in[NF_K] = k, out->in[NF_V] = v, out->in[NF_DO] = g;
            q = k = v = g = NULL;
        }
    }

    stria_device_free(dev, dq_.data), stria_device_free(dev, dk_.data);
    stria_device_free(dev, dv_.data), stria_device_free(dev, dg_.data);
    stria_device_free(dev, do_.data), stria_device_free(dev, ddq.data);
    stria_device_free(dev, ddk.data), stria_device_free(dev, ddv.data);
    stria_device_free(dev, dlse), stria_device_free(dev, ddelta);
    stria_device_close(dev);
    free(hq.host), free(hk.host), free(hv.host), free(hg.host), free(ho.host);
    free(hdq.host), free(hdk.host), free(hdv.host);
    free(q), free(k), free(v), free(g), free(qs), free(ks), free(vs), free(gs);
    free(o), free(lse), free(delta), free(dq), free(dk), free(dv);
    free(go), free(glse), free(gdelta), free(gdq), free(gdk), free(gdv), free(qpos), free(kpos);
}

void run_case(const gcase_t *c)
{
    run_case_out(c, NULL);
}

void gpu_outs_free(gpu_outs_t *out)
{
    free(out->o), free(out->lse), free(out->dq), free(out->dk), free(out->dv);
    for (int t = 0; t < NF_N_TENSORS; t++)
        free(out->in[t]);
    memset(out, 0, sizeof(*out));
}
