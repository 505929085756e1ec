/* Forward attention on tensor cores (FlashAttention-2 style), bf16/fp16
 * storage, fp32 accumulation, head_dim 64 or 128.
 *
 * One CTA of 8 warps per (query tile of 128 rows, batch, head); warp w owns
 * query rows 16w..16w+15 and keeps their Q fragments in registers. The CTA
 * walks the key tiles (64 keys) that the mask does not skip, double-buffered
 * with cp.async: while tile j is consumed, tile j+1 (the next one not skipped)
 * is in flight. Per tile: S = Q K^T (mma), the mask (each row's key bounds
 * from its position, documents and window) on straddling and tail tiles
 * only, online softmax in registers on log2e-prescaled scores (exp2f),
 * O = diag(alpha) O + P V with P rounded to the storage dtype. At the end O is
 * normalised and written as the fp32 partial with its LSE, or merged into the
 * existing partial (accumulate) exactly as attn.c's merge does. */
#include "attn_cuda.cuh"
#include "mma.cuh"

#define STRIA__FWD_BQ 128
#define STRIA__FWD_BK 64
#define STRIA__FWD_NW 8
#define STRIA__FWD_NT (32 * STRIA__FWD_NW)

template <int D> __host__ __device__ constexpr int stria__fwd_smem()
{
    /* Q tile, then 2 stages of K and V, then the walk's tile classes */
    return (STRIA__FWD_BQ * D + 4 * STRIA__FWD_BK * D) * 2 + STRIA__CU_WALK;
}

template <typename T, int D>
__global__ void __launch_bounds__(STRIA__FWD_NT, 1) stria__fwd_mma_k(stria_cu_attn_t a)
{
    constexpr int BQ = STRIA__FWD_BQ, BK = STRIA__FWD_BK, NT = STRIA__FWD_NT;
    constexpr int KD = D / 16; /* k-steps over head_dim */
    constexpr int NS = BK / 8; /* n-blocks of a score tile */
    constexpr int NO = D / 8;  /* n-blocks of the output */
    extern __shared__ __align__(128) unsigned char stria__smem[];
    T *sQ = reinterpret_cast<T *>(stria__smem);
    T *sK = sQ + BQ * D; /* [2][BK * D] */
    T *sV = sK + 2 * BK * D;
    stria__cu_walk_t walk = {reinterpret_cast<unsigned char *>(sV + 2 * BK * D), -1};

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t nqt = (a.Tq + BQ - 1) / BQ, nkt = (a.Tk + BK - 1) / BK;
    /* last query tiles first: under a causal mask they have the most work */
    const int64_t qt = nqt - 1 - blockIdx.x;
    const int64_t q0 = qt * BQ;
    const float sl2 = a.scale * STRIA__LOG2E;

    for (int64_t bh = blockIdx.y; bh < a.B * a.H; bh += gridDim.y) {
        const int64_t b = bh / a.H, h = bh % a.H, hk = h / a.G;
        const T *qbase = stria__cu_row<T>(a.q, b, 0, h);
        const T *kbase = stria__cu_row<T>(a.k, b, 0, hk);
        const T *vbase = stria__cu_row<T>(a.v, b, 0, hk);

        int64_t qmin = 0, qmax = 0;
        if (stria__cu_masked(a))
            stria__cu_tile_bounds(a.qmin, a.qmax, a.Tq, q0, BQ, &qmin, &qmax);
        walk.base = -1; /* the walk's classes depend on the fixed tile's bounds */
        stria__load_tile<T, D, BQ, NT>(sQ, qbase, a.q.st, q0, a.Tq);
        stria__cp_commit();
        int cls = STRIA__CU_SKIP, cls_next = STRIA__CU_SKIP;
        int64_t kt = stria__cu_walk_next<NT>(walk, a, true, 0, nkt, BK, qmin, qmax, &cls);
        if (kt < nkt) {
            stria__load_tile<T, D, BK, NT>(sK, kbase, a.k.st, kt * BK, a.Tk);
            stria__load_tile<T, D, BK, NT>(sV, vbase, a.v.st, kt * BK, a.Tk);
        }
        stria__cp_commit();
        stria__cp_wait<1>(); /* the Q group */
        __syncthreads();

        uint32_t qf[KD][4];
#pragma unroll
        for (int kk = 0; kk < KD; kk++)
            stria__ld_a<T, D>(qf[kk], sQ, warp * 16, kk, lane);

        /* this thread's rows: r0 = 16 warp + lane / 4 and r0 + 8 of the tile */
        const int64_t r0 = q0 + warp * 16 + (lane >> 2), r1 = r0 + 8;
        /* the keys each row sees; rows past Tq are never masked */
        int64_t lo0, hi0, lo1, hi1;
        stria__cu_query_row(a, r0, &lo0, &hi0);
        stria__cu_query_row(a, r1, &lo1, &hi1);
        float o[NO][4];
        stria__zero(o);
        float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

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
            stria__cp_wait<1>(); /* tile kt has landed */
            __syncthreads();
            const T *tK = sK + stage * BK * D, *tV = sV + stage * BK * D;
            const int64_t k0 = kt * BK;

            float s[NS][4];
            stria__zero(s);
#pragma unroll
            for (int kk = 0; kk < KD; kk++)
#pragma unroll
                for (int p = 0; p < NS / 2; p++) {
                    uint32_t bf[4];
                    stria__ld_b_nrows<T, D>(bf, tK, p * 16, kk, lane);
                    stria__mma<T>(s[2 * p], qf[kk], bf[0], bf[1]);
                    stria__mma<T>(s[2 * p + 1], qf[kk], bf[2], bf[3]);
                }

            /* mask: straddling tiles by position, the tail tile by index */
            if (cls == STRIA__CU_PARTIAL || k0 + BK > a.Tk) {
                const bool part = cls == STRIA__CU_PARTIAL;
#pragma unroll
                for (int n = 0; n < NS; n++)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        int64_t kc = k0 + n * 8 + 2 * (lane & 3) + j;
                        bool out = kc >= a.Tk;
                        int64_t kp = !out && part ? a.kpos[kc] : 0;
                        if (out || (part && stria__cu_hidden(kp, lo0, hi0)))
                            s[n][j] = -INFINITY;
                        if (out || (part && stria__cu_hidden(kp, lo1, hi1)))
                            s[n][2 + j] = -INFINITY;
                    }
            }

            /* online softmax; scores in log2 units are s * sl2 */
            float mx0 = m0, mx1 = m1;
#pragma unroll
            for (int n = 0; n < NS; n++) {
                mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]) * sl2);
                mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]) * sl2);
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            /* a row with nothing visible yet keeps max -inf: subtract 0 */
            const float mu0 = mx0 == -INFINITY ? 0.0f : mx0;
            const float mu1 = mx1 == -INFINITY ? 0.0f : mx1;
            const float al0 = exp2f(m0 - mu0), al1 = exp2f(m1 - mu1); /* m = -inf: 0 */
            m0 = mx0;
            m1 = mx1;
            float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
            for (int n = 0; n < NS; n++) {
                s[n][0] = exp2f(fmaf(s[n][0], sl2, -mu0));
                s[n][1] = exp2f(fmaf(s[n][1], sl2, -mu0));
                s[n][2] = exp2f(fmaf(s[n][2], sl2, -mu1));
                s[n][3] = exp2f(fmaf(s[n][3], sl2, -mu1));
                ps0 += s[n][0] + s[n][1];
                ps1 += s[n][2] + s[n][3];
            }
            l0 = l0 * al0 + ps0;
            l1 = l1 * al1 + ps1;
#pragma unroll
            for (int n = 0; n < NO; n++) {
                o[n][0] *= al0;
                o[n][1] *= al0;
                o[n][2] *= al1;
                o[n][3] *= al1;
            }

            /* O += P V */
            stria__gemm_c_krows<T, D, NS>(o, s, tV, lane);
            __syncthreads(); /* the stage is refilled by the next iteration */
            stage ^= 1;
            kt = nxt;
            cls = cls_next;
        }
        stria__cp_wait<0>();

        /* row sums: the four lanes of a quad hold a row's columns */
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        /* l == 0: no key seen; l NaN: a NaN or +inf score reached the row,
         * and the NaN goes on into O and the LSE (attn_fwd.c's rule) */
        const float inv0 = l0 != 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 != 0.0f ? 1.0f / l1 : 0.0f;
        const float lse0 = l0 != 0.0f ? (m0 + log2f(l0)) * STRIA__LN2 : -INFINITY;
        const float lse1 = l1 != 0.0f ? (m1 + log2f(l1)) * STRIA__LN2 : -INFINITY;
        const int64_t li = (b * a.H + h) * a.Tq;

        float la0 = 0.0f, la1 = 0.0f;
        if (a.accumulate) {
            if (r0 < a.Tq)
                la0 = a.lse[li + r0];
            if (r1 < a.Tq)
                la1 = a.lse[li + r1];
            __syncwarp(); /* the quad has read the LSE before its lane 0 writes it */
        }
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int64_t r = half ? r1 : r0;
            if (r >= a.Tq)
                continue;
            const float inv = half ? inv1 : inv0, lb = half ? lse1 : lse0;
            float *orow = stria__cu_row_f32(a.o, b, r, h);
            float wa = 0.0f, wb = 1.0f, ln = lb;
            int mode = 1;
            if (a.accumulate)
                mode = stria__cu_merge_weights(half ? la1 : la0, lb, &wa, &wb, &ln);
            if (mode != 0) {
#pragma unroll
                for (int n = 0; n < NO; n++)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        const int d = n * 8 + 2 * (lane & 3) + j;
                        const float x = o[n][2 * half + j] * inv;
                        orow[d] = mode == 1 ? x : wa * orow[d] + wb * x;
                    }
            }
            if ((lane & 3) == 0)
                a.lse[li + r] = ln;
        }
        __syncthreads(); /* shared memory is reused by the next (batch, head) */
    }
}

#ifndef STRIA_CU_EMU /* host launchers; tests/gpu/test_kernel_emu runs the kernels above */
template <typename T, int D>
static cudaError_t stria__fwd_launch(const stria_cu_attn_t *a, cudaStream_t s)
{
    int64_t nqt = (a->Tq + STRIA__FWD_BQ - 1) / STRIA__FWD_BQ;
    int64_t bh = a->B * a->H;
    dim3 grid((unsigned)nqt, (unsigned)(bh < 65535 ? bh : 65535));
    stria__fwd_mma_k<T, D><<<grid, STRIA__FWD_NT, stria__fwd_smem<D>(), s>>>(*a);
    return cudaGetLastError();
}

cudaError_t stria__cu_fwd_mma(const stria_cu_attn_t *a, cudaStream_t s)
{
    bool bf = a->dtype == STRIA_DTYPE_BF16;
    if (a->D == 64)
        return bf ? stria__fwd_launch<__nv_bfloat16, 64>(a, s)
                  : stria__fwd_launch<__half, 64>(a, s);
    return bf ? stria__fwd_launch<__nv_bfloat16, 128>(a, s) : stria__fwd_launch<__half, 128>(a, s);
}

template <typename T, int D> static cudaError_t stria__fwd_attr()
{
    return cudaFuncSetAttribute(stria__fwd_mma_k<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                stria__fwd_smem<D>());
}

cudaError_t stria__cu_fwd_init(void)
{
    cudaError_t e;
    if ((e = stria__fwd_attr<__nv_bfloat16, 64>()) != cudaSuccess ||
        (e = stria__fwd_attr<__half, 64>()) != cudaSuccess ||
        (e = stria__fwd_attr<__nv_bfloat16, 128>()) != cudaSuccess ||
        (e = stria__fwd_attr<__half, 128>()) != cudaSuccess)
        return e;
    return cudaSuccess;
}
#endif
