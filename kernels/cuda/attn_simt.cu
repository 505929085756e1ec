/* The SIMT kernels: plain fp32 FMA attention for every call the tensor-core
 * kernels do not take (fp32 storage, head_dim other than 64/128, unaligned
 * views), and the row-wise kernels (partial init, merge, finalize, delta,
 * add). Simple by design: one warp per output row, lanes over head_dim (up to
 * 8 values each), keys visited one by one with the mask (the causal rule,
 * documents, window: the row's key bounds) applied per key, fp32
 * throughout. The arithmetic follows attn.c's semantics exactly: online
 * softmax with max subtraction, LSE = max + log(sum), rows without a visible
 * key get LSE = -inf and zero output, merges with max-subtracted weights. */
#include "attn_cuda.cuh"

#define STRIA__SIMT_THREADS   256
#define STRIA__SIMT_NPL       (STRIA_HEAD_DIM_MAX_CU / 32) /* values per lane */
#define STRIA__SIMT_MAXGRID   (1 << 20)
#define STRIA_HEAD_DIM_MAX_CU 256

__device__ __forceinline__ float stria__warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* Element i of a buffer of a run-time dtype, as fp32. */
__device__ __forceinline__ float stria__ld_dyn(stria_dtype_t dt, const void *base, int64_t i)
{
    if (dt == STRIA_DTYPE_BF16)
        return __bfloat162float(((const __nv_bfloat16 *)base)[i]);
    if (dt == STRIA_DTYPE_F16)
        return __half2float(((const __half *)base)[i]);
    return ((const float *)base)[i];
}

#ifndef STRIA_CU_EMU /* host launcher */
static unsigned stria__grid_rows(int64_t rows)
{
    int64_t warps_per_block = STRIA__SIMT_THREADS / 32;
    int64_t blocks = (rows + warps_per_block - 1) / warps_per_block;
    return (unsigned)(blocks < STRIA__SIMT_MAXGRID ? blocks : STRIA__SIMT_MAXGRID);
}
#endif

/* Warp-per-row iteration: r runs over [0, rows). */
#define STRIA__FOR_WARP_ROWS(r, rows)                                                              \
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < (rows);            \
         r += ((int64_t)gridDim.x * blockDim.x) >> 5)

/* ---- forward ------------------------------------------------------------ */

/* One warp per (batch, head, query) row; r = (b * H + h) * Tq + i is also the
 * row's LSE index. */
template <typename T>
__global__ void __launch_bounds__(STRIA__SIMT_THREADS) stria__fwd_simt_k(stria_cu_attn_t a)
{
    const int lane = threadIdx.x & 31;
    STRIA__FOR_WARP_ROWS(r, a.B * a.H * a.Tq)
    {
        int64_t i = r % a.Tq, h = (r / a.Tq) % a.H, b = r / a.Tq / a.H, hk = h / a.G;
        const T *qr = stria__cu_row<T>(a.q, b, i, h);
        float q[STRIA__SIMT_NPL], o[STRIA__SIMT_NPL];
#pragma unroll
        for (int j = 0; j < STRIA__SIMT_NPL; j++) {
            int d = lane + 32 * j;
            q[j] = d < a.D ? stria__cu_ld<T>(qr + d) : 0.0f;
            o[j] = 0.0f;
        }
        const bool masked = stria__cu_masked(a);
        int64_t lo, hi; /* the keys the row sees */
        stria__cu_query_row(a, i, &lo, &hi);
        float m = -INFINITY, l = 0.0f;
        for (int64_t t = 0; t < a.Tk; t++) {
            if (masked && stria__cu_hidden(a.kpos[t], lo, hi))
                continue; /* warp-uniform */
            const T *kr = stria__cu_row<T>(a.k, b, t, hk);
            const T *vr = stria__cu_row<T>(a.v, b, t, hk);
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < STRIA__SIMT_NPL; j++) {
                int d = lane + 32 * j;
                if (d < a.D)
                    s += q[j] * stria__cu_ld<T>(kr + d);
            }
            s = stria__warp_sum(s) * a.scale;
            float mn = fmaxf(m, s);
            /* nothing but -inf scores yet (an input's -inf: a zero weight):
             * subtract 0, not -inf, which would make NaN of -inf - -inf */
            float mu = mn == -INFINITY ? 0.0f : mn;
            float al = expf(m - mu); /* m = -inf: 0 */
            float p = expf(s - mu);
            l = l * al + p;
#pragma unroll
            for (int j = 0; j < STRIA__SIMT_NPL; j++) {
                int d = lane + 32 * j;
                if (d < a.D)
                    o[j] = o[j] * al + p * stria__cu_ld<T>(vr + d);
            }
            m = mn;
        }
        /* l == 0: no key seen; l NaN: poisoned (see attn_fwd.cu) */
        float lse = l != 0.0f ? m + logf(l) : -INFINITY;
        float inv = l != 0.0f ? 1.0f / l : 0.0f;
        float *orow = stria__cu_row_f32(a.o, b, i, h);
        if (!a.accumulate) {
#pragma unroll
            for (int j = 0; j < STRIA__SIMT_NPL; j++) {
                int d = lane + 32 * j;
                if (d < a.D)
                    orow[d] = o[j] * inv;
            }
            if (lane == 0)
                a.lse[r] = lse;
        } else {
            float la = a.lse[r], wa, wb, ln;
            __syncwarp(); /* every lane has read the LSE before lane 0 writes it */
            int mode = stria__cu_merge_weights(la, lse, &wa, &wb, &ln);
            if (mode != 0) {
#pragma unroll
                for (int j = 0; j < STRIA__SIMT_NPL; j++) {
                    int d = lane + 32 * j;
                    if (d < a.D)
                        orow[d] = stria__cu_merge_value(mode, orow[d], o[j] * inv, wa, wb);
                }
            }
            if (lane == 0)
                a.lse[r] = ln;
        }
    }
}

#ifndef STRIA_CU_EMU /* host launcher */
template <typename T>
static cudaError_t stria__fwd_simt_launch(const stria_cu_attn_t *a, cudaStream_t s)
{
    stria__fwd_simt_k<T><<<stria__grid_rows(a->B * a->H * a->Tq), STRIA__SIMT_THREADS, 0, s>>>(*a);
    return cudaGetLastError();
}

cudaError_t stria__cu_fwd_simt(const stria_cu_attn_t *a, cudaStream_t s)
{
    switch (a->dtype) {
    case STRIA_DTYPE_BF16:
        return stria__fwd_simt_launch<__nv_bfloat16>(a, s);
    case STRIA_DTYPE_F16:
        return stria__fwd_simt_launch<__half>(a, s);
    default:
        return stria__fwd_simt_launch<float>(a, s);
    }
}
#endif

/* ---- backward ------------------------------------------------------------ */

/* dQ: one warp per (batch, head, query) row. A row with LSE = -inf saw no key
 * in the whole pass: its probabilities are all 0 (attn.c's +inf LSE). */
template <typename T>
__global__ void __launch_bounds__(STRIA__SIMT_THREADS) stria__dq_simt_k(stria_cu_attn_t a)
{
    const int lane = threadIdx.x & 31;
    STRIA__FOR_WARP_ROWS(r, a.B * a.H * a.Tq)
    {
        int64_t i = r % a.Tq, h = (r / a.Tq) % a.H, b = r / a.Tq / a.H, hk = h / a.G;
        float la = a.lse_in[r], dl = a.delta[r];
        if (la == -INFINITY)
            continue;
        const T *qr = stria__cu_row<T>(a.q, b, i, h);
        const T *gr = stria__cu_row<T>(a.d_o, b, i, h);
        float q[STRIA__SIMT_NPL], g[STRIA__SIMT_NPL], acc[STRIA__SIMT_NPL];
#pragma unroll
        for (int j = 0; j < STRIA__SIMT_NPL; j++) {
            int d = lane + 32 * j;
            q[j] = d < a.D ? stria__cu_ld<T>(qr + d) : 0.0f;
            g[j] = d < a.D ? stria__cu_ld<T>(gr + d) : 0.0f;
            acc[j] = 0.0f;
        }
        const bool masked = stria__cu_masked(a);
        int64_t lo, hi;
        stria__cu_query_row(a, i, &lo, &hi);
        for (int64_t t = 0; t < a.Tk; t++) {
            if (masked && stria__cu_hidden(a.kpos[t], lo, hi))
                continue;
            const T *kr = stria__cu_row<T>(a.k, b, t, hk);
            const T *vr = stria__cu_row<T>(a.v, b, t, hk);
            float s = 0.0f, dp = 0.0f, k[STRIA__SIMT_NPL];
#pragma unroll
            for (int j = 0; j < STRIA__SIMT_NPL; j++) {
                int d = lane + 32 * j;
                k[j] = d < a.D ? stria__cu_ld<T>(kr + d) : 0.0f;
                if (d < a.D) {
                    s += q[j] * k[j];
                    dp += g[j] * stria__cu_ld<T>(vr + d);
                }
            }
            s = stria__warp_sum(s) * a.scale;
            dp = stria__warp_sum(dp);
            float ds = expf(s - la) * (dp - dl);
#pragma unroll
            for (int j = 0; j < STRIA__SIMT_NPL; j++)
                acc[j] += ds * k[j];
        }
        float *dq = stria__cu_row_f32(a.dq, b, i, h);
#pragma unroll
        for (int j = 0; j < STRIA__SIMT_NPL; j++) {
            int d = lane + 32 * j;
            if (d < a.D)
                dq[d] += acc[j] * a.scale;
        }
    }
}

/* dK, dV: one warp per (batch, kv head, key) row, over every query head of the
 * group and every query. Each row is owned by one warp: deterministic. */
template <typename T>
__global__ void __launch_bounds__(STRIA__SIMT_THREADS) stria__dkdv_simt_k(stria_cu_attn_t a)
{
    const int lane = threadIdx.x & 31;
    STRIA__FOR_WARP_ROWS(r, a.B * a.Hkv * a.Tk)
    {
        int64_t t = r % a.Tk, hk = (r / a.Tk) % a.Hkv, b = r / a.Tk / a.Hkv;
        const T *kr = stria__cu_row<T>(a.k, b, t, hk);
        const T *vr = stria__cu_row<T>(a.v, b, t, hk);
        float k[STRIA__SIMT_NPL], v[STRIA__SIMT_NPL], ak[STRIA__SIMT_NPL], av[STRIA__SIMT_NPL];
#pragma unroll
        for (int j = 0; j < STRIA__SIMT_NPL; j++) {
            int d = lane + 32 * j;
            k[j] = d < a.D ? stria__cu_ld<T>(kr + d) : 0.0f;
            v[j] = d < a.D ? stria__cu_ld<T>(vr + d) : 0.0f;
            ak[j] = av[j] = 0.0f;
        }
        const bool masked = stria__cu_masked(a);
        int64_t lo, hi; /* the query positions that see this key */
        stria__cu_key_row(a, t, &lo, &hi);
        for (int64_t g = 0; g < a.G; g++) {
            int64_t h = hk * a.G + g;
            for (int64_t i = 0; i < a.Tq; i++) {
                if (masked && stria__cu_hidden(a.qpos[i], lo, hi))
                    continue;
                int64_t li = (b * a.H + h) * a.Tq + i;
                float la = a.lse_in[li];
                if (la == -INFINITY)
                    continue;
                const T *qr = stria__cu_row<T>(a.q, b, i, h);
                const T *gr = stria__cu_row<T>(a.d_o, b, i, h);
                float s = 0.0f, dp = 0.0f, q[STRIA__SIMT_NPL], gg[STRIA__SIMT_NPL];
#pragma unroll
                for (int j = 0; j < STRIA__SIMT_NPL; j++) {
                    int d = lane + 32 * j;
                    q[j] = d < a.D ? stria__cu_ld<T>(qr + d) : 0.0f;
                    gg[j] = d < a.D ? stria__cu_ld<T>(gr + d) : 0.0f;
                    s += q[j] * k[j];
                    dp += gg[j] * v[j];
                }
                s = stria__warp_sum(s) * a.scale;
                dp = stria__warp_sum(dp);
                float p = expf(s - la);
                float ds = p * (dp - a.delta[li]);
#pragma unroll
                for (int j = 0; j < STRIA__SIMT_NPL; j++) {
                    av[j] += p * gg[j];
                    ak[j] += ds * q[j];
                }
            }
        }
        float *dk = stria__cu_row_f32(a.dk, b, t, hk);
        float *dv = stria__cu_row_f32(a.dv, b, t, hk);
#pragma unroll
        for (int j = 0; j < STRIA__SIMT_NPL; j++) {
            int d = lane + 32 * j;
            if (d < a.D) {
                dk[d] += ak[j] * a.scale;
                dv[d] += av[j];
            }
        }
    }
}

#ifndef STRIA_CU_EMU /* host launcher */
template <typename T>
static cudaError_t stria__bwd_simt_launch(const stria_cu_attn_t *a, cudaStream_t s)
{
    stria__dq_simt_k<T><<<stria__grid_rows(a->B * a->H * a->Tq), STRIA__SIMT_THREADS, 0, s>>>(*a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return e;
    stria__dkdv_simt_k<T>
        <<<stria__grid_rows(a->B * a->Hkv * a->Tk), STRIA__SIMT_THREADS, 0, s>>>(*a);
    return cudaGetLastError();
}

cudaError_t stria__cu_bwd_simt(const stria_cu_attn_t *a, cudaStream_t s)
{
    switch (a->dtype) {
    case STRIA_DTYPE_BF16:
        return stria__bwd_simt_launch<__nv_bfloat16>(a, s);
    case STRIA_DTYPE_F16:
        return stria__bwd_simt_launch<__half>(a, s);
    default:
        return stria__bwd_simt_launch<float>(a, s);
    }
}
#endif

/* ---- row-wise kernels ------------------------------------------------------ */

/* Rows r = (b * H + h) * Tq + t: the LSE index. */
#define STRIA__ROW_BHT(r, a)                                                                       \
    int64_t t = (r) % (a).Tq, h = ((r) / (a).Tq) % (a).H, b = (r) / (a).Tq / (a).H

__global__ void __launch_bounds__(STRIA__SIMT_THREADS) stria__init_k(stria_cu_attn_t a)
{
    const int lane = threadIdx.x & 31;
    STRIA__FOR_WARP_ROWS(r, a.B * a.H * a.Tq)
    {
        STRIA__ROW_BHT(r, a);
        float *o = stria__cu_row_f32(a.o, b, t, h);
        for (int d = lane; d < a.D; d += 32)
            o[d] = 0.0f;
        if (lane == 0)
            a.lse[r] = -INFINITY;
    }
}

#ifndef STRIA_CU_EMU /* host launcher */
cudaError_t stria__cu_partial_init(const stria_cu_attn_t *a, cudaStream_t s)
{
    stria__init_k<<<stria__grid_rows(a->B * a->H * a->Tq), STRIA__SIMT_THREADS, 0, s>>>(*a);
    return cudaGetLastError();
}
#endif

__global__ void __launch_bounds__(STRIA__SIMT_THREADS)
    stria__merge_k(stria_cu_attn_t a, stria_cu_view_t bo, const float *bl)
{
    const int lane = threadIdx.x & 31;
    STRIA__FOR_WARP_ROWS(r, a.B * a.H * a.Tq)
    {
        STRIA__ROW_BHT(r, a);
        float la = a.lse[r], lb = bl[r], wa, wb, ln;
        __syncwarp(); /* every lane has read lse_a before lane 0 writes it */
        int mode = stria__cu_merge_weights(la, lb, &wa, &wb, &ln);
        if (mode == 0)
            continue;
        float *oa = stria__cu_row_f32(a.o, b, t, h);
        const float *ob = stria__cu_row<float>(bo, b, t, h);
        for (int d = lane; d < a.D; d += 32)
            oa[d] = stria__cu_merge_value(mode, oa[d], ob[d], wa, wb);
        if (lane == 0)
            a.lse[r] = ln;
    }
}

#ifndef STRIA_CU_EMU /* host launcher */
cudaError_t stria__cu_merge(const stria_cu_attn_t *a, stria_cu_view_t b_o, const float *b_lse,
                            cudaStream_t s)
{
    stria__merge_k<<<stria__grid_rows(a->B * a->H * a->Tq), STRIA__SIMT_THREADS, 0, s>>>(*a, b_o,
                                                                                         b_lse);
    return cudaGetLastError();
}
#endif

__global__ void __launch_bounds__(STRIA__SIMT_THREADS)
    stria__finalize_k(stria_cu_attn_t a, stria_cu_view_t out, stria_dtype_t dt)
{
    const int lane = threadIdx.x & 31;
    STRIA__FOR_WARP_ROWS(r, a.B * a.H * a.Tq)
    {
        STRIA__ROW_BHT(r, a);
        const float *src = stria__cu_row<float>(a.o, b, t, h);
        int64_t off = b * out.sb + t * out.st + h * out.sh;
        for (int d = lane; d < a.D; d += 32) {
            float x = src[d];
            if (dt == STRIA_DTYPE_BF16)
                ((__nv_bfloat16 *)out.p)[off + d] = __float2bfloat16_rn(x);
            else if (dt == STRIA_DTYPE_F16)
                ((__half *)out.p)[off + d] = __float2half_rn(x);
            else
                ((float *)out.p)[off + d] = x;
        }
    }
}

#ifndef STRIA_CU_EMU /* host launcher */
cudaError_t stria__cu_finalize(const stria_cu_attn_t *a, stria_cu_view_t out,
                               stria_dtype_t out_dtype, cudaStream_t s)
{
    stria__finalize_k<<<stria__grid_rows(a->B * a->H * a->Tq), STRIA__SIMT_THREADS, 0, s>>>(
        *a, out, out_dtype);
    return cudaGetLastError();
}
#endif

__global__ void __launch_bounds__(STRIA__SIMT_THREADS)
    stria__delta_k(stria_cu_attn_t a, stria_dtype_t odt, float *delta)
{
    const int lane = threadIdx.x & 31;
    STRIA__FOR_WARP_ROWS(r, a.B * a.H * a.Tq)
    {
        STRIA__ROW_BHT(r, a);
        int64_t oo = b * a.o.sb + t * a.o.st + h * a.o.sh;
        int64_t go = b * a.d_o.sb + t * a.d_o.st + h * a.d_o.sh;
        float acc = 0.0f;
        for (int d = lane; d < a.D; d += 32)
            acc += stria__ld_dyn(odt, a.o.p, oo + d) * stria__ld_dyn(a.dtype, a.d_o.p, go + d);
        acc = stria__warp_sum(acc);
        if (lane == 0)
            delta[r] = acc;
    }
}

#ifndef STRIA_CU_EMU /* host launcher */
cudaError_t stria__cu_delta(const stria_cu_attn_t *a, stria_dtype_t o_dtype, float *delta_out,
                            cudaStream_t s)
{
    stria__delta_k<<<stria__grid_rows(a->B * a->H * a->Tq), STRIA__SIMT_THREADS, 0, s>>>(
        *a, o_dtype, delta_out);
    return cudaGetLastError();
}
#endif

__global__ void stria__add_k(float *dst, const float *src, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] += src[i];
}

#ifndef STRIA_CU_EMU /* host launcher */
cudaError_t stria__cu_add_f32(float *dst, const float *src, size_t n, cudaStream_t s)
{
    size_t blocks = (n + STRIA__SIMT_THREADS - 1) / STRIA__SIMT_THREADS;
    if (n == 0)
        return cudaSuccess;
    if (blocks > STRIA__SIMT_MAXGRID)
        blocks = STRIA__SIMT_MAXGRID;
    stria__add_k<<<(unsigned)blocks, STRIA__SIMT_THREADS, 0, s>>>(dst, src, n);
    return cudaGetLastError();
}
#endif
