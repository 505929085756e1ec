/* A host emulation of the few CUDA features the tensor-core attention kernels
 * use, for tests/gpu/test_kernel_emu: every CUDA thread of a CTA is a host
 * thread; __syncthreads, __syncwarp and the warp collectives (shuffles,
 * ldmatrix, mma.sync m16n8k16) meet at barriers and exchange their operands,
 * with the fragment layouts of the PTX ISA; cp.async is a plain copy. It runs
 * the kernels' own code (kernels/cuda/attn_*.cu with STRIA_CU_EMU), slowly,
 * on small shapes, without a GPU. Not a model of timing, memory ordering or
 * asynchrony: it checks the kernels' arithmetic, indexing and control flow. */
#ifndef STRIA_CU_EMU_H
#define STRIA_CU_EMU_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#define STRIA_CU_EMU 1

/* the kernels become host functions */
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __shared__
#define __shared__
#undef __launch_bounds__
#define __launch_bounds__(...)

struct stria_emu_dim {
    unsigned x, y, z;
};
extern thread_local stria_emu_dim stria_emu_tid;
extern stria_emu_dim stria_emu_bid, stria_emu_gdim, stria_emu_bdim;
#define threadIdx stria_emu_tid
#define blockIdx  stria_emu_bid
#define gridDim   stria_emu_gdim
#define blockDim  stria_emu_bdim

struct stria_emu_barrier {
    std::mutex m;
    std::condition_variable cv;
    int n = 0, count = 0;
    unsigned gen = 0;
    void wait()
    {
        std::unique_lock<std::mutex> l(m);
        unsigned g = gen;
        if (++count == n) {
            count = 0;
            gen++;
            cv.notify_all();
        } else {
            cv.wait(l, [&] { return gen != g; });
        }
    }
};

struct stria_emu_cta {
    stria_emu_barrier all;
    stria_emu_barrier warp[32];
    const void *addr[32][32];
    uint32_t a[32][32][4], b[32][32][2];
    float f[32][32];
};
extern stria_emu_cta *stria_emu_cur;

inline int stria_emu_warp()
{
    return (int)(threadIdx.x / 32);
}
inline int stria_emu_lane()
{
    return (int)(threadIdx.x % 32);
}

#define __syncthreads() stria_emu_cur->all.wait()
inline void stria_emu_syncwarp()
{
    stria_emu_cur->warp[stria_emu_warp()].wait();
}
#define __syncwarp(...) stria_emu_syncwarp()

inline float stria_emu_shfl_xor(float v, int lane_mask)
{
    int w = stria_emu_warp(), l = stria_emu_lane();
    stria_emu_cur->f[w][l] = v;
    stria_emu_syncwarp();
    float r = stria_emu_cur->f[w][l ^ lane_mask];
    stria_emu_syncwarp();
    return r;
}
#define __shfl_xor_sync(mask, v, lane_mask) stria_emu_shfl_xor((v), (lane_mask))

/* cp.async: an immediate copy (zero-fill when !valid) */
inline void stria__cp16(void *smem, const void *gmem, bool valid)
{
    if (valid)
        memcpy(smem, gmem, 16);
    else
        memset(smem, 0, 16);
}
inline void stria__cp_commit() {}
template <int N> inline void stria__cp_wait() {}

/* ldmatrix.x4: lane l gives row l % 8 of matrix l / 8; register i of lane t
 * gets matrix i's elements (t/4, 2(t%4)+h), or with .trans (2(t%4)+h, t/4). */
inline void stria_emu_ldsm(uint32_t (&r)[4], const void *p, bool trans)
{
    int w = stria_emu_warp(), t = stria_emu_lane();
    stria_emu_cur->addr[w][t] = p;
    stria_emu_syncwarp();
    for (int i = 0; i < 4; i++) {
        uint16_t v[2];
        for (int h = 0; h < 2; h++) {
            int row = trans ? 2 * (t % 4) + h : t / 4;
            int col = trans ? t / 4 : 2 * (t % 4) + h;
            v[h] = ((const uint16_t *)stria_emu_cur->addr[w][8 * i + row])[col];
        }
        r[i] = (uint32_t)v[0] | ((uint32_t)v[1] << 16);
    }
    stria_emu_syncwarp();
}
inline void stria__ldsm_x4(uint32_t (&r)[4], const void *p)
{
    stria_emu_ldsm(r, p, false);
}
inline void stria__ldsm_x4_t(uint32_t (&r)[4], const void *p)
{
    stria_emu_ldsm(r, p, true);
}

template <typename T> inline float stria_emu_tof(uint16_t bits);
template <> inline float stria_emu_tof<__nv_bfloat16>(uint16_t bits)
{
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
template <> inline float stria_emu_tof<__half>(uint16_t bits)
{
    __half_raw r;
    r.x = bits;
    return __half2float(__half(r));
}

/* mma.m16n8k16, fp32 accumulation; g = t / 4, q = t % 4:
 * A r0 (g, 2q+h) r1 (g+8, 2q+h) r2 (g, 8+2q+h) r3 (g+8, 8+2q+h);
 * B r0 (k 2q+h, n g) r1 (k 8+2q+h, n g); C c[h] (g, 2q+h), c[2+h] (g+8, 2q+h) */
template <typename T>
inline void stria__mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    int w = stria_emu_warp(), t = stria_emu_lane();
    stria_emu_cta *x = stria_emu_cur;
    for (int i = 0; i < 4; i++)
        x->a[w][t][i] = a[i];
    x->b[w][t][0] = b0;
    x->b[w][t][1] = b1;
    stria_emu_syncwarp();
    float A[16][16], B[16][8];
    for (int u = 0; u < 32; u++) {
        int g = u / 4, q = u % 4;
        for (int h = 0; h < 2; h++) {
            int sh = 16 * h;
            A[g][2 * q + h] = stria_emu_tof<T>((uint16_t)(x->a[w][u][0] >> sh));
            A[g + 8][2 * q + h] = stria_emu_tof<T>((uint16_t)(x->a[w][u][1] >> sh));
            A[g][8 + 2 * q + h] = stria_emu_tof<T>((uint16_t)(x->a[w][u][2] >> sh));
            A[g + 8][8 + 2 * q + h] = stria_emu_tof<T>((uint16_t)(x->a[w][u][3] >> sh));
            B[2 * q + h][g] = stria_emu_tof<T>((uint16_t)(x->b[w][u][0] >> sh));
            B[8 + 2 * q + h][g] = stria_emu_tof<T>((uint16_t)(x->b[w][u][1] >> sh));
        }
    }
    stria_emu_syncwarp();
    int g = t / 4, q = t % 4;
    for (int h = 0; h < 4; h++) {
        int row = g + (h >= 2 ? 8 : 0), col = 2 * q + (h & 1);
        float acc = c[h];
        for (int k = 0; k < 16; k++)
            acc += A[row][k] * B[k][col];
        c[h] = acc;
    }
}

/* Runs kernel() as every thread of every CTA of grid, CTA after CTA. */
void stria_emu_launch(dim3 grid, int threads, const std::function<void()> &kernel);

#endif
