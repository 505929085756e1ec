/* Internal interface of the CUDA attention kernels (attn_fwd.cu, attn_bwd.cu,
 * attn_simt.cu) and the device-side helpers they share. Used by
 * device_cuda.cu, which validates every argument before a launch. */
#ifndef STRIA_ATTN_CUDA_CUH
#define STRIA_ATTN_CUDA_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "stria_common.h"
#include "stria_device.h"
#include "validate_int.h"

/* Positions come as one int64 per token plus the min and max position of
 * every STRIA__CU_GRAIN consecutive tokens; a kernel's tile (a multiple of the
 * grain) combines its grains' bounds. */
#define STRIA__CU_GRAIN 16

/* A strided [batch, tokens, heads, head_dim] view; strides in elements. */
typedef struct {
    const void *p;
    int64_t sb, st, sh;
} stria_cu_view_t;

/* Everything a kernel launch needs, in device memory where it is a pointer;
 * the sizes (a.B, a.Tq, ...) from its stria__attn_dims_t. */
struct stria_cu_attn_t : stria__attn_dims_t {
    int D;
    float scale;
    bool causal;
    stria_dtype_t dtype; /* storage of q, k, v, d_o */
    /* Documents or a window (stria_attn_params_t): a query at position p
     * sees the keys in [lo(p), hi(p)] (stria__cu_row_bounds). false: the
     * plain causal rule, or no mask. */
    bool bounds;
    const int64_t *cu; /* device copy of cu_seqlens, n_cu entries; 0: one document */
    int64_t n_cu;
    bool has_window;
    int64_t wl, wr; /* window_left, window_right; -1 unbounded */
    /* causal or bounds (stria__cu_masked), else NULL: positions and
     * per-grain bounds */
    const int64_t *qpos, *kpos;
    const int64_t *qmin, *qmax, *kmin, *kmax;
    stria_cu_view_t q, k, v, d_o;
    /* forward: o (fp32) and lse [B][H][Tq]; backward: lse and delta inputs */
    stria_cu_view_t o;
    float *lse;
    bool accumulate;
    const float *lse_in, *delta;
    stria_cu_view_t dq, dk, dv; /* fp32, accumulated into */
};

/* The CUDA stream behind a stream of a "cuda" device (for timing with CUDA
 * events in stria-bench); NULL for any other device. */
cudaStream_t stria__cuda_stream(stria_device_t *dev, stria_stream_t s);

/* Sets the shared-memory limits of the tensor-core kernels on the current
 * device; call once per device. */
cudaError_t stria__cu_attn_init(void);

/* Whether the tensor-core kernels take this call (16-bit dtype, head_dim 64
 * or 128, 16-byte aligned rows); otherwise the SIMT kernels run. */
bool stria__cu_mma_ok(const stria_cu_attn_t *a, bool backward);

cudaError_t stria__cu_fwd_mma(const stria_cu_attn_t *a, cudaStream_t s);
cudaError_t stria__cu_bwd_mma(const stria_cu_attn_t *a, cudaStream_t s);
cudaError_t stria__cu_fwd_simt(const stria_cu_attn_t *a, cudaStream_t s);
cudaError_t stria__cu_bwd_simt(const stria_cu_attn_t *a, cudaStream_t s);

/* Row-wise kernels over B x Tq x H rows of D values (stria_kernels.h). */
cudaError_t stria__cu_partial_init(const stria_cu_attn_t *a, cudaStream_t s);
/* merge: a->o, a->lse receive; b_o, b_lse the partial merged in */
cudaError_t stria__cu_merge(const stria_cu_attn_t *a, stria_cu_view_t b_o, const float *b_lse,
                            cudaStream_t s);
/* finalize: a->o the fp32 partial, out (of out_dtype) the result */
cudaError_t stria__cu_finalize(const stria_cu_attn_t *a, stria_cu_view_t out,
                               stria_dtype_t out_dtype, cudaStream_t s);
/* delta: a->o (o_dtype) and a->d_o (a->dtype) into delta_out [B][H][Tq] */
cudaError_t stria__cu_delta(const stria_cu_attn_t *a, stria_dtype_t o_dtype, float *delta_out,
                            cudaStream_t s);
cudaError_t stria__cu_add_f32(float *dst, const float *src, size_t n, cudaStream_t s);

/* ---- device helpers shared by the kernels ----------------------------- */

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define STRIA__LOG2E 1.4426950408889634f
#define STRIA__LN2   0.6931471805599453f

enum { STRIA__CU_SKIP = 0, STRIA__CU_FULL = 1, STRIA__CU_PARTIAL = 2 };

template <typename T> __device__ __forceinline__ float stria__cu_ld(const T *p);
template <> __device__ __forceinline__ float stria__cu_ld<float>(const float *p)
{
    return *p;
}
template <> __device__ __forceinline__ float stria__cu_ld<__nv_bfloat16>(const __nv_bfloat16 *p)
{
    return __bfloat162float(*p);
}
template <> __device__ __forceinline__ float stria__cu_ld<__half>(const __half *p)
{
    return __half2float(*p);
}

/* Element pointer of row (b, t, h) of a view of element type T. */
template <typename T>
__device__ __forceinline__ const T *stria__cu_row(const stria_cu_view_t &v, int64_t b, int64_t t,
                                                  int64_t h)
{
    return (const T *)v.p + b * v.sb + t * v.st + h * v.sh;
}
__device__ __forceinline__ float *stria__cu_row_f32(const stria_cu_view_t &v, int64_t b, int64_t t,
                                                    int64_t h)
{
    return (float *)v.p + b * v.sb + t * v.st + h * v.sh;
}

/* Min and max position of tokens [t0, t0 + n) from the per-grain bounds; n a
 * multiple of the grain. Tokens past the end are ignored. */
__device__ __forceinline__ void stria__cu_tile_bounds(const int64_t *mn, const int64_t *mx,
                                                      int64_t tokens, int64_t t0, int n,
                                                      int64_t *lo, int64_t *hi)
{
    int64_t g0 = t0 / STRIA__CU_GRAIN;
    int64_t g1 = (t0 + n + STRIA__CU_GRAIN - 1) / STRIA__CU_GRAIN;
    int64_t ng = (tokens + STRIA__CU_GRAIN - 1) / STRIA__CU_GRAIN;
    int64_t a = INT64_MAX, b = INT64_MIN;
    g1 = g1 < ng ? g1 : ng;
    for (int64_t g = g0; g < g1; g++) {
        int64_t x = mn[g], y = mx[g];
        a = x < a ? x : a;
        b = y > b ? y : b;
    }
    *lo = a;
    *hi = b;
}

/* ---- masks: documents, windows, the causal rule ----------------------- */

/* Positions lie in [0, 2^62) (validate_int.h's STRIA__POS_LIMIT_V). */
#define STRIA__CU_POS_LIMIT ((int64_t)1 << 62)

/* Whether the call masks by position at all: then its positions and grain
 * bounds are on the device. */
__device__ __forceinline__ bool stria__cu_masked(const stria_cu_attn_t &a)
{
    return a.causal || a.bounds;
}

/* The document [*s, *e) holding position pos: a binary search of cu_seqlens
 * (cu[first] <= pos < cu[last], which the host checked), as attn.c's
 * stria__row_bounds; empty documents are never found. Without documents, one
 * document holding every position. */
__device__ __forceinline__ void stria__cu_doc(const stria_cu_attn_t &a, int64_t pos, int64_t *s,
                                              int64_t *e)
{
    if (a.n_cu == 0) {
        *s = 0;
        *e = STRIA__CU_POS_LIMIT;
        return;
    }
    int64_t lo = 0, hi = a.n_cu - 1;
    while (hi - lo > 1) {
        const int64_t m = lo + (hi - lo) / 2;
        if (a.cu[m] <= pos)
            lo = m;
        else
            hi = m;
    }
    *s = a.cu[lo];
    *e = a.cu[hi];
}

/* Keys visible to a query at position p: [*lo, *hi] (stria_attn_params_t):
 * its document [s, e) gives [s, e - 1], the causal rule caps that at p, the
 * window narrows it to [p - left, p + right] (-1: that side unbounded). Without
 * documents and window, the plain rule: [INT64_MIN, p] when causal, else
 * everything. lo and hi never decrease as p grows, so the bounds of a set of
 * rows with positions in [pmin, pmax] range over [lo(pmin), lo(pmax)] and
 * [hi(pmin), hi(pmax)]. */
__device__ __forceinline__ void stria__cu_row_bounds(const stria_cu_attn_t &a, int64_t p,
                                                     int64_t *lo, int64_t *hi)
{
    if (!a.bounds) {
        *lo = INT64_MIN;
        *hi = a.causal ? p : INT64_MAX;
        return;
    }
    int64_t l, h;
    stria__cu_doc(a, p, &l, &h);
    h -= 1;
    if (a.causal && p < h)
        h = p;
    if (a.has_window) {
        if (a.wl >= 0 && p - a.wl > l)
            l = p - a.wl;
        if (a.wr >= 0 && a.wr < STRIA__CU_POS_LIMIT && p + a.wr < h)
            h = p + a.wr;
    }
    *lo = l;
    *hi = h;
}

/* Queries that see a key at position k: those with positions in [*lo, *hi],
 * the transpose of stria__cu_row_bounds (lo(p) <= k <= hi(p) exactly when
 * *lo <= p <= *hi): k's document [s, e), the causal rule p >= k, the window
 * k - right <= p <= k + left. Used where the keys are fixed and the queries
 * stream by (the dK/dV kernels). */
__device__ __forceinline__ void stria__cu_key_bounds(const stria_cu_attn_t &a, int64_t k,
                                                     int64_t *lo, int64_t *hi)
{
    if (!a.bounds) {
        *lo = a.causal ? k : INT64_MIN;
        *hi = INT64_MAX;
        return;
    }
    int64_t l, h;
    stria__cu_doc(a, k, &l, &h);
    h -= 1;
    if (a.causal && k > l)
        l = k;
    if (a.has_window) {
        if (a.wr >= 0 && k - a.wr > l)
            l = k - a.wr;
        if (a.wl >= 0 && a.wl < STRIA__CU_POS_LIMIT && k + a.wl < h)
            h = k + a.wl;
    }
    *lo = l;
    *hi = h;
}

/* Whether x lies outside [lo, hi]: a masked (query, key) pair. */
__device__ __forceinline__ bool stria__cu_hidden(int64_t x, int64_t lo, int64_t hi)
{
    return x < lo || x > hi;
}

/* Bounds of query row i of the block (stria__cu_row_bounds of its position);
 * rows past the block, and every row of a call without a mask, are never
 * masked. */
__device__ __forceinline__ void stria__cu_query_row(const stria_cu_attn_t &a, int64_t i,
                                                    int64_t *lo, int64_t *hi)
{
    if (!stria__cu_masked(a) || i >= a.Tq) {
        *lo = INT64_MIN;
        *hi = INT64_MAX;
        return;
    }
    stria__cu_row_bounds(a, a.qpos[i], lo, hi);
}

/* Query positions that see key row j of the block (stria__cu_key_bounds);
 * keys past the block are seen by no query, every key of a call without a
 * mask by all. */
__device__ __forceinline__ void stria__cu_key_row(const stria_cu_attn_t &a, int64_t j, int64_t *lo,
                                                  int64_t *hi)
{
    if (j >= a.Tk) {
        *lo = INT64_MAX;
        *hi = INT64_MIN;
        return;
    }
    if (!stria__cu_masked(a)) {
        *lo = INT64_MIN;
        *hi = INT64_MAX;
        return;
    }
    stria__cu_key_bounds(a, a.kpos[j], lo, hi);
}

/* Class of a (query tile, key tile) pair of a masked call from the tiles'
 * position bounds, attn.c's rule: skipped when every key is outside every
 * row's bounds, full when every key is inside every row's bounds, partial
 * otherwise. Under the plain causal rule that is: skipped when kmin > qmax,
 * full when kmax <= qmin. */
__device__ __forceinline__ int stria__cu_tile_class(const stria_cu_attn_t &a, int64_t qmin,
                                                    int64_t qmax, int64_t kmin, int64_t kmax)
{
    int64_t lomin, himin, lomax, himax;
    stria__cu_row_bounds(a, qmin, &lomin, &himin);
    stria__cu_row_bounds(a, qmax, &lomax, &himax);
    if (kmin > himax || kmax < lomin)
        return STRIA__CU_SKIP;
    if (lomax <= kmin && kmax <= himin)
        return STRIA__CU_FULL;
    return STRIA__CU_PARTIAL;
}

/* Weights of merging the partial of LSE lb into the one of LSE la, as in
 * attn.c's stria__merge_row: 0 = keep a (lb = -inf), 1 = take b exactly
 * (la = -inf), 2 = a * wa + b * wb with the new LSE *lse. */
__device__ __forceinline__ int stria__cu_merge_weights(float la, float lb, float *wa, float *wb,
                                                       float *lse)
{
    if (lb == -INFINITY) {
        *wa = 1.0f;
        *wb = 0.0f;
        *lse = la;
        return 0;
    }
    if (la == -INFINITY) {
        *wa = 0.0f;
        *wb = 1.0f;
        *lse = lb;
        return 1;
    }
    float mx = la > lb ? la : lb;
    float l = mx + log1pf(expf(-fabsf(la - lb)));
    *wa = expf(la - l);
    *wb = expf(lb - l);
    *lse = l;
    return 2;
}

/* One merged value under a mode of stria__cu_merge_weights. */
__device__ __forceinline__ float stria__cu_merge_value(int mode, float a, float b, float wa,
                                                       float wb)
{
    return mode == 0 ? a : mode == 1 ? b : wa * a + wb * b;
}
/* Tile classes computed per refill of a walk (bytes of shared memory). */
#define STRIA__CU_WALK 256

/* A CTA's walk over the tiles of one side (key tiles against its fixed query
 * tile, or query tiles against its fixed key tile). Under a mask the
 * classes of STRIA__CU_WALK tiles at a time are computed by the whole CTA at
 * once, one tile per thread, into shared memory, so that finding the next
 * tile costs a shared-memory read instead of dependent global loads at every
 * step. */
typedef struct {
    unsigned char *cls; /* shared, STRIA__CU_WALK entries */
    int64_t base;       /* first tile held; -1: none */
} stria__cu_walk_t;

/* First tile at or after t (tiles of n tokens of the moving side, n_tiles of
 * them) that the mask does not skip against the fixed tile's bounds [fmin,
 * fmax]; its class in *cls; n_tiles when none. moving_keys: the moving tiles
 * are key tiles (else query tiles). Every thread of the CTA must call it with
 * the same arguments (it may synchronise the CTA). */
template <int NT>
__device__ __forceinline__ int64_t stria__cu_walk_next(stria__cu_walk_t &w,
                                                       const stria_cu_attn_t &a, bool moving_keys,
                                                       int64_t t, int64_t n_tiles, int n,
                                                       int64_t fmin, int64_t fmax, int *cls)
{
    if (!stria__cu_masked(a)) {
        *cls = STRIA__CU_FULL;
        return t < n_tiles ? t : n_tiles;
    }
    for (; t < n_tiles; t++) {
        if (w.base < 0 || t < w.base || t >= w.base + STRIA__CU_WALK) {
            __syncthreads(); /* every thread is done with the classes held */
            for (int i = threadIdx.x; i < STRIA__CU_WALK; i += NT) {
                const int64_t u = t + i;
                int c = STRIA__CU_SKIP;
                if (u < n_tiles) {
                    int64_t lo, hi;
                    if (moving_keys) {
                        stria__cu_tile_bounds(a.kmin, a.kmax, a.Tk, u * n, n, &lo, &hi);
                        c = stria__cu_tile_class(a, fmin, fmax, lo, hi);
                    } else {
                        stria__cu_tile_bounds(a.qmin, a.qmax, a.Tq, u * n, n, &lo, &hi);
                        c = stria__cu_tile_class(a, lo, hi, fmin, fmax);
                    }
                }
                w.cls[i] = (unsigned char)c;
            }
            __syncthreads();
            w.base = t;
        }
        const int c = w.cls[t - w.base];
        if (c != STRIA__CU_SKIP) {
            *cls = c;
            return t;
        }
    }
    return n_tiles;
}

#endif /* __CUDACC__ */

#endif /* STRIA_ATTN_CUDA_CUH */
