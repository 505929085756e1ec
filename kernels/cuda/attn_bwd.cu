/* Backward attention on tensor cores, bf16/fp16 storage, fp32 accumulation,
 * head_dim 64 or 128. Deterministic: two kernels, each output row owned by
 * one CTA, no atomics.
 *
 * dK/dV kernel: one CTA of 8 warps per (key tile of 128 keys, batch, kv
 * head); warp w owns keys 16w..16w+15 and their dK, dV accumulators. K and V
 * stay in shared memory; the CTA walks every query head of the GQA group and
 * every query tile (32 rows at head_dim 128, 64 at 64) the mask does not skip, double-buffering Q,
 * dO, LSE and D with cp.async. Per tile, all products transposed so that keys are the mma rows: S^T
 * = K Q^T, dP^T = V dO^T, P^T = exp2(S^T scale log2e - LSE log2e) (masked on straddling tiles),
 * dS^T = P^T (dP^T - D), dV += P^T dO, dK += dS^T Q.
 *
 * dQ kernel: one CTA of 4 warps per (query tile of 64 rows, batch, head);
 * warp w owns rows 16w..16w+15. It walks the key tiles (64 keys) the mask does
 * not skip, double-buffered: S = Q K^T, dP = dO V^T, dS = P (dP - D),
 * dQ += dS K. P and dS are rounded to the storage dtype for the mma; every
 * accumulation is fp32. Results are added (+=) to the caller's fp32 dq, dk,
 * dv, scaled by the softmax scale where the chain rule puts it. */
#include "attn_cuda.cuh"
#include "mma.cuh"

#define STRIA__KV_BK 128 /* keys per dK/dV CTA: 16 per warp */
#define STRIA__KV_NW 8
#define STRIA__KV_NT (32 * STRIA__KV_NW)
#define STRIA__DQ_BQ 64 /* queries per dQ CTA: 16 per warp */
#define STRIA__DQ_NW 4
#define STRIA__DQ_NT (32 * STRIA__DQ_NW)
#define STRIA__DQ_BK 64 /* keys per step of the dQ CTA */

/* Queries per step of the dK/dV CTA: 32 at head_dim 128 keeps the dK, dV, S^T
 * and dP^T fragments within 255 registers without spills. */
template <int D> __host__ __device__ constexpr int stria__kv_bq()
{
    return D > 64 ? 32 : 64;
}
#define STRIA__KV_BQ stria__kv_bq<D>()

template <int D> __host__ __device__ constexpr int stria__kv_smem()
{
    /* K, V; 2 stages of Q and dO; 2 stages of LSE and D; the walk's classes */
    return (2 * STRIA__KV_BK * D + 4 * STRIA__KV_BQ * D) * 2 + 4 * STRIA__KV_BQ * 4 +
           STRIA__CU_WALK;
}
template <int D> __host__ __device__ constexpr int stria__dq_smem()
{
    /* Q, dO; 2 stages of K and V; the walk's classes */
    return (2 * STRIA__DQ_BQ * D + 4 * STRIA__DQ_BK * D) * 2 + STRIA__CU_WALK;
}

/* LSE of a query row in log2 units for recomputing P: rows past the block or
 * without any visible key get +inf, so that their P is exp2(-inf) = 0. */
__device__ __forceinline__ float stria__lse_log2(const float *lse, int64_t i, int64_t n)
{
    if (i >= n)
        return INFINITY;
    float l = lse[i];
    return l == -INFINITY ? INFINITY : l * STRIA__LOG2E;
}

template <typename T, int D>
__global__ void __launch_bounds__(STRIA__KV_NT, 1) stria__dkdv_mma_k(stria_cu_attn_t a)
{
    constexpr int BK = STRIA__KV_BK, BQ = STRIA__KV_BQ, NT = STRIA__KV_NT;
    constexpr int NS = BQ / 8; /* n-blocks of a transposed score tile */
    constexpr int NO = D / 8;  /* n-blocks of dK, dV */
    extern __shared__ __align__(128) unsigned char stria__smem[];
    T *sK = reinterpret_cast<T *>(stria__smem);
    T *sV = sK + BK * D;
    T *sQ = sV + BK * D;                                    /* [2][BQ * D] */
    T *sG = sQ + 2 * BQ * D;                                /* [2][BQ * D] */
    float *sL = reinterpret_cast<float *>(sG + 2 * BQ * D); /* [2][BQ] */
    float *sDl = sL + 2 * BQ;                               /* [2][BQ] */
    stria__cu_walk_t walk = {reinterpret_cast<unsigned char *>(sDl + 2 * BQ), -1};

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t nqt = (a.Tq + BQ - 1) / BQ, n_it = a.G * nqt;
    const int64_t k0 = (int64_t)blockIdx.x * BK;
    const float sl2 = a.scale * STRIA__LOG2E;

    for (int64_t bhk = blockIdx.y; bhk < a.B * a.Hkv; bhk += gridDim.y) {
        const int64_t b = bhk / a.Hkv, hk = bhk % a.Hkv;
        int64_t kmin = 0, kmax = 0;
        if (stria__cu_masked(a))
            stria__cu_tile_bounds(a.kmin, a.kmax, a.Tk, k0, BK, &kmin, &kmax);
        /* steps it = g * nqt + qt over (query head of the group, query tile);
         * the first at or after `it` that the mask does not skip */
        auto next_step = [&](int64_t it, int *cls) -> int64_t {
            while (it < n_it) { /* the class depends on the query tile only */
                const int64_t g = it / nqt;
                const int64_t qt =
                    stria__cu_walk_next<NT>(walk, a, false, it % nqt, nqt, BQ, kmin, kmax, cls);
                if (qt < nqt)
                    return g * nqt + qt;
                it = (g + 1) * nqt;
            }
            return n_it;
        };
        auto load_step = [&](int st, int64_t it) {
            const int64_t h = hk * a.G + it / nqt, q0 = (it % nqt) * BQ;
            stria__load_tile<T, D, BQ, NT>(sQ + st * BQ * D, stria__cu_row<T>(a.q, b, 0, h), a.q.st,
                                           q0, a.Tq);
            stria__load_tile<T, D, BQ, NT>(sG + st * BQ * D, stria__cu_row<T>(a.d_o, b, 0, h),
                                           a.d_o.st, q0, a.Tq);
            if (threadIdx.x < BQ) {
                const int64_t li = (b * a.H + h) * a.Tq, i = q0 + threadIdx.x;
                sL[st * BQ + threadIdx.x] = stria__lse_log2(a.lse_in + li, i, a.Tq);
                sDl[st * BQ + threadIdx.x] = i < a.Tq ? a.delta[li + i] : 0.0f;
            }
        };

        walk.base = -1; /* the walk's classes depend on the fixed tile's bounds */
        stria__load_tile<T, D, BK, NT>(sK, stria__cu_row<T>(a.k, b, 0, hk), a.k.st, k0, a.Tk);
        stria__load_tile<T, D, BK, NT>(sV, stria__cu_row<T>(a.v, b, 0, hk), a.v.st, k0, a.Tk);
        stria__cp_commit();
        int cls = STRIA__CU_SKIP, cls_next = STRIA__CU_SKIP;
        int64_t it = next_step(0, &cls);
        if (it < n_it)
            load_step(0, it);
        stria__cp_commit();

        /* this thread's keys: k0 + 16 warp + lane / 4 and 8 more, and the
         * query positions that see each; keys past the block are never
         * written, mask them all */
        const int64_t kr0 = k0 + warp * 16 + (lane >> 2), kr1 = kr0 + 8;
        int64_t lo0, hi0, lo1, hi1;
        stria__cu_key_row(a, kr0, &lo0, &hi0);
        stria__cu_key_row(a, kr1, &lo1, &hi1);
        float dk[NO][4], dv[NO][4];
        stria__zero(dk);
        stria__zero(dv);

        int stage = 0;
        while (it < n_it) {
            const int64_t nit = next_step(it + 1, &cls_next);
            if (nit < n_it)
                load_step(stage ^ 1, nit);
            stria__cp_commit();
            stria__cp_wait<1>(); /* K, V and step `it` have landed */
            __syncthreads();
            const T *tQ = sQ + stage * BQ * D, *tG = sG + stage * BQ * D;
            const float *tL = sL + stage * BQ, *tDl = sDl + stage * BQ;
            const int64_t q0 = (it % nqt) * BQ;

            float s[NS][4], dp[NS][4];
            stria__zero(s);
            stria__zero(dp);
            /* S^T = K Q^T, dP^T = V dO^T */
            stria__gemm2_nrows<T, D, NS>(s, dp, sK, sV, warp * 16, tQ, tG, lane);

            /* P^T into s, dS^T into dp; columns are queries */
#pragma unroll
            for (int n = 0; n < NS; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int qc = n * 8 + 2 * (lane & 3) + j;
                    const float L = tL[qc], Dl = tDl[qc];
                    bool m0 = false, m1 = false;
                    if (cls == STRIA__CU_PARTIAL && q0 + qc < a.Tq) {
                        const int64_t qp = a.qpos[q0 + qc];
                        m0 = stria__cu_hidden(qp, lo0, hi0);
                        m1 = stria__cu_hidden(qp, lo1, hi1);
                    }
                    const float p0 = m0 ? 0.0f : exp2f(fmaf(s[n][j], sl2, -L));
                    const float p1 = m1 ? 0.0f : exp2f(fmaf(s[n][2 + j], sl2, -L));
                    s[n][j] = p0;
                    s[n][2 + j] = p1;
                    dp[n][j] = p0 * (dp[n][j] - Dl);
                    dp[n][2 + j] = p1 * (dp[n][2 + j] - Dl);
                }

            /* dV += P^T dO, dK += dS^T Q */
            stria__gemm_c_krows<T, D, NS>(dv, s, tG, lane);
            stria__gemm_c_krows<T, D, NS>(dk, dp, tQ, lane);
            __syncthreads(); /* the stage is refilled by the next iteration */
            stage ^= 1;
            it = nit;
            cls = cls_next;
        }
        stria__cp_wait<0>();

#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int64_t r = half ? kr1 : kr0;
            if (r >= a.Tk)
                continue;
            float *dkr = stria__cu_row_f32(a.dk, b, r, hk);
            float *dvr = stria__cu_row_f32(a.dv, b, r, hk);
#pragma unroll
            for (int n = 0; n < NO; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int d = n * 8 + 2 * (lane & 3) + j;
                    dkr[d] += dk[n][2 * half + j] * a.scale;
                    dvr[d] += dv[n][2 * half + j];
                }
        }
        __syncthreads(); /* shared memory is reused by the next (batch, kv head) */
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(STRIA__DQ_NT, 2) stria__dq_mma_k(stria_cu_attn_t a)
{
    constexpr int BQ = STRIA__DQ_BQ, BK = STRIA__DQ_BK, NT = STRIA__DQ_NT;
    constexpr int NS = BK / 8, NO = D / 8;
    extern __shared__ __align__(128) unsigned char stria__smem[];
    T *sQ = reinterpret_cast<T *>(stria__smem);
    T *sG = sQ + BQ * D;
    T *sK = sG + BQ * D;     /* [2][BK * D] */
    T *sV = sK + 2 * BK * D; /* [2][BK * D] */
    stria__cu_walk_t walk = {reinterpret_cast<unsigned char *>(sV + 2 * BK * D), -1};

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t nqt = (a.Tq + BQ - 1) / BQ, nkt = (a.Tk + BK - 1) / BK;
    const int64_t qt = nqt - 1 - blockIdx.x; /* most work first under a causal mask */
    const int64_t q0 = qt * BQ;
    const float sl2 = a.scale * STRIA__LOG2E;

    for (int64_t bh = blockIdx.y; bh < a.B * a.H; bh += gridDim.y) {
        const int64_t b = bh / a.H, h = bh % a.H, hk = h / a.G;
        const T *kbase = stria__cu_row<T>(a.k, b, 0, hk);
        const T *vbase = stria__cu_row<T>(a.v, b, 0, hk);
        int64_t qmin = 0, qmax = 0;
        if (stria__cu_masked(a))
            stria__cu_tile_bounds(a.qmin, a.qmax, a.Tq, q0, BQ, &qmin, &qmax);
        walk.base = -1; /* the walk's classes depend on the fixed tile's bounds */
        stria__load_tile<T, D, BQ, NT>(sQ, stria__cu_row<T>(a.q, b, 0, h), a.q.st, q0, a.Tq);
        stria__load_tile<T, D, BQ, NT>(sG, stria__cu_row<T>(a.d_o, b, 0, h), a.d_o.st, q0, a.Tq);
        stria__cp_commit();
        int cls = STRIA__CU_SKIP, cls_next = STRIA__CU_SKIP;
        int64_t kt = stria__cu_walk_next<NT>(walk, a, true, 0, nkt, BK, qmin, qmax, &cls);
        if (kt < nkt) {
            stria__load_tile<T, D, BK, NT>(sK, kbase, a.k.st, kt * BK, a.Tk);
            stria__load_tile<T, D, BK, NT>(sV, vbase, a.v.st, kt * BK, a.Tk);
        }
        stria__cp_commit();

        const int64_t r0 = q0 + warp * 16 + (lane >> 2), r1 = r0 + 8;
        const int64_t li = (b * a.H + h) * a.Tq;
        const float L0 = stria__lse_log2(a.lse_in + li, r0, a.Tq);
        const float L1 = stria__lse_log2(a.lse_in + li, r1, a.Tq);
        const float D0 = r0 < a.Tq ? a.delta[li + r0] : 0.0f;
        const float D1 = r1 < a.Tq ? a.delta[li + r1] : 0.0f;
        int64_t lo0, hi0, lo1, hi1; /* the keys each row sees */
        stria__cu_query_row(a, r0, &lo0, &hi0);
        stria__cu_query_row(a, r1, &lo1, &hi1);
        float acc[NO][4];
        stria__zero(acc);

        int stage = 0;
        while (kt < nkt) {
            const int64_t nxt =
                stria__cu_walk_next<NT>(walk, a, true, kt + 1, nkt, BK, qmin, qmax, &cls_next);
            if (nxt < nkt) {
                stria__load_tile<T, D, BK, NT>(sK + (stage ^ 1) * BK * D, kbase, a.k.st, nxt * BK,
                                               a.Tk);
                stria__load_tile<T, D, BK, NT>(sV + (stage ^ 1) * BK * D, vbase, a.v.st, nxt * BK,
                                               a.Tk);
            }
            stria__cp_commit();
            stria__cp_wait<1>(); /* Q, dO and tile kt have landed */
            __syncthreads();
            const T *tK = sK + stage * BK * D, *tV = sV + stage * BK * D;
            const int64_t k0 = kt * BK;

            float s[NS][4], dp[NS][4];
            stria__zero(s);
            stria__zero(dp);
            /* S = Q K^T, dP = dO V^T */
            stria__gemm2_nrows<T, D, NS>(s, dp, sQ, sG, warp * 16, tK, tV, lane);

            /* dS into dp; masked: straddling tiles by position, the tail by index */
            const bool part = cls == STRIA__CU_PARTIAL, need_mask = part || k0 + BK > a.Tk;
#pragma unroll
            for (int n = 0; n < NS; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    bool m0 = false, m1 = false;
                    if (need_mask) {
                        const int64_t kc = k0 + n * 8 + 2 * (lane & 3) + j;
                        const bool out = kc >= a.Tk;
                        const int64_t kp = !out && part ? a.kpos[kc] : 0;
                        m0 = out || (part && stria__cu_hidden(kp, lo0, hi0));
                        m1 = out || (part && stria__cu_hidden(kp, lo1, hi1));
                    }
                    const float p0 = m0 ? 0.0f : exp2f(fmaf(s[n][j], sl2, -L0));
                    const float p1 = m1 ? 0.0f : exp2f(fmaf(s[n][2 + j], sl2, -L1));
                    dp[n][j] = p0 * (dp[n][j] - D0);
                    dp[n][2 + j] = p1 * (dp[n][2 + j] - D1);
                }

            /* dQ += dS K */
            stria__gemm_c_krows<T, D, NS>(acc, dp, tK, lane);
            __syncthreads();
            stage ^= 1;
            kt = nxt;
            cls = cls_next;
        }
        stria__cp_wait<0>();

#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int64_t r = half ? r1 : r0;
            if (r >= a.Tq)
                continue;
            float *dqr = stria__cu_row_f32(a.dq, b, r, h);
#pragma unroll
            for (int n = 0; n < NO; n++)
#pragma unroll
                for (int j = 0; j < 2; j++)
                    dqr[n * 8 + 2 * (lane & 3) + j] += acc[n][2 * half + j] * a.scale;
        }
        __syncthreads();
    }
}

#ifndef STRIA_CU_EMU /* host launchers; tests/gpu/test_kernel_emu runs the kernels above */
template <typename T, int D>
static cudaError_t stria__bwd_launch(const stria_cu_attn_t *a, cudaStream_t s)
{
    int64_t nkt = (a->Tk + STRIA__KV_BK - 1) / STRIA__KV_BK;
    int64_t nqt = (a->Tq + STRIA__DQ_BQ - 1) / STRIA__DQ_BQ;
    int64_t bhk = a->B * a->Hkv, bh = a->B * a->H;
    dim3 g1((unsigned)nkt, (unsigned)(bhk < 65535 ? bhk : 65535));
    stria__dkdv_mma_k<T, D><<<g1, STRIA__KV_NT, stria__kv_smem<D>(), s>>>(*a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return e;
    dim3 g2((unsigned)nqt, (unsigned)(bh < 65535 ? bh : 65535));
    stria__dq_mma_k<T, D><<<g2, STRIA__DQ_NT, stria__dq_smem<D>(), s>>>(*a);
    return cudaGetLastError();
}

cudaError_t stria__cu_bwd_mma(const stria_cu_attn_t *a, cudaStream_t s)
{
    bool bf = a->dtype == STRIA_DTYPE_BF16;
    if (a->D == 64)
        return bf ? stria__bwd_launch<__nv_bfloat16, 64>(a, s)
                  : stria__bwd_launch<__half, 64>(a, s);
    return bf ? stria__bwd_launch<__nv_bfloat16, 128>(a, s) : stria__bwd_launch<__half, 128>(a, s);
}

template <typename T, int D> static cudaError_t stria__bwd_attr()
{
    cudaError_t e = cudaFuncSetAttribute(
        stria__dkdv_mma_k<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, stria__kv_smem<D>());
    if (e != cudaSuccess)
        return e;
    return cudaFuncSetAttribute(stria__dq_mma_k<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                stria__dq_smem<D>());
}

cudaError_t stria__cu_bwd_init(void)
{
    cudaError_t e;
    if ((e = stria__bwd_attr<__nv_bfloat16, 64>()) != cudaSuccess ||
        (e = stria__bwd_attr<__half, 64>()) != cudaSuccess ||
        (e = stria__bwd_attr<__nv_bfloat16, 128>()) != cudaSuccess ||
        (e = stria__bwd_attr<__half, 128>()) != cudaSuccess)
        return e;
    return cudaSuccess;
}
#endif
