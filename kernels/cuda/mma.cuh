/* Warp-level tensor-core building blocks of the attention kernels
 * (attn_fwd.cu, attn_bwd.cu): cp.async tile loads into swizzled shared
 * memory, ldmatrix fragment loads and mma.sync m16n8k16 with fp32
 * accumulation, for bf16 and fp16 storage.
 *
 * Shared-memory tiles hold R rows of D 16-bit values (D = 64 or 128), row r's
 * 16-byte chunk c stored at chunk position c ^ (r & 7): the 8 rows an
 * ldmatrix reads at one chunk fall into 8 different bank groups.
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16, lane = 4 * group + tig):
 *   A (16x16, row-major): a0 (row group, k 2tig..+1), a1 (row group+8, same
 *     k), a2 (row group, k 8+2tig..+1), a3 (row group+8, k 8+2tig..+1)
 *   B (16x8, "col"): b0 (k 2tig..+1, n group), b1 (k 8+2tig..+1, n group)
 *   C (16x8 fp32): c0, c1 (row group, n 2tig..+1), c2, c3 (row group+8)
 */
#ifndef STRIA_MMA_CUH
#define STRIA_MMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

/* Element offset of (row, col) in a swizzled tile of D columns. */
template <int D> __host__ __device__ __forceinline__ int stria__swz(int row, int col)
{
    return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

/* The (row, col) of the 8-element row segment whose address lane `lane`
 * gives to ldmatrix.x4 in each of the fragment loads below (host-callable so
 * that tests/gpu/test_mma_layout can check them against the PTX layouts). */
struct stria__rc {
    int row, col;
};
/* A of rows [row0, row0 + 16) x k [16 kk, 16 kk + 16) of a row-major tile.
 * Matrices: 0 rows 0-7 k lo, 1 rows 8-15 k lo, 2 rows 0-7 k hi, 3 rows 8-15
 * k hi = a0..a3. */
__host__ __device__ __forceinline__ stria__rc stria__lda_rc(int row0, int kk, int lane)
{
    return {row0 + ((lane >> 3) & 1) * 8 + (lane & 7), kk * 16 + (lane >> 4) * 8};
}
/* B of two n-blocks [n0, n0 + 16) x k [16 kk, 16 kk + 16) from a tile whose
 * rows are n. Matrices: 0 n lo k lo, 1 n lo k hi, 2 n hi k lo, 3 n hi k hi. */
__host__ __device__ __forceinline__ stria__rc stria__ldb_nrows_rc(int n0, int kk, int lane)
{
    return {n0 + (lane >> 4) * 8 + (lane & 7), kk * 16 + ((lane >> 3) & 1) * 8};
}
/* B of two n-blocks [n0, n0 + 16) x k [k0, k0 + 16) from a tile whose rows
 * are k (transposing load). Matrices: 0 k lo n lo, 1 k hi n lo, 2 k lo n hi,
 * 3 k hi n hi. */
__host__ __device__ __forceinline__ stria__rc stria__ldb_krows_rc(int k0, int n0, int lane)
{
    return {k0 + ((lane >> 3) & 1) * 8 + (lane & 7), n0 + (lane >> 4) * 8};
}

#ifndef STRIA_CU_EMU /* tests/gpu/cu_emu.h emulates these on the host */
__device__ __forceinline__ uint32_t stria__smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared, zero-filled when !valid (no bytes are read). */
__device__ __forceinline__ void stria__cp16(void *smem, const void *gmem, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stria__smem_addr(smem)),
                 "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void stria__cp_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> __device__ __forceinline__ void stria__cp_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#endif

/* Rows [t0, t0 + R) of one head of a strided [tokens][..] view (row pointer
 * base + t * stride_token elements) into a swizzled R x D tile, by NT
 * threads; rows at or past `tokens` are zero-filled. */
template <typename T, int D, int R, int NT>
__device__ __forceinline__ void stria__load_tile(T *tile, const T *base, int64_t stride_token,
                                                 int64_t t0, int64_t tokens)
{
    constexpr int CH = D / 8; /* 16-byte chunks per row */
#pragma unroll
    for (int i = threadIdx.x; i < R * CH; i += NT) {
        int r = i / CH, c = i % CH;
        bool valid = t0 + r < tokens;
        const T *src = valid ? base + (t0 + r) * stride_token + c * 8 : base;
        stria__cp16(tile + stria__swz<D>(r, c * 8), src, valid);
    }
}

#ifndef STRIA_CU_EMU /* tests/gpu/cu_emu.h emulates these on the host */
__device__ __forceinline__ void stria__ldsm_x4(uint32_t (&r)[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(stria__smem_addr(p)));
}
__device__ __forceinline__ void stria__ldsm_x4_t(uint32_t (&r)[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(stria__smem_addr(p)));
}
#endif

/* A fragment of rows [row0, row0 + 16) x k [16 kk, 16 kk + 16) of a row-major
 * (M rows) tile. Matrices: 0 rows 0-7 k lo, 1 rows 8-15 k lo, 2 rows 0-7 k
 * hi, 3 rows 8-15 k hi = a0..a3. */
template <typename T, int D>
__device__ __forceinline__ void stria__ld_a(uint32_t (&a)[4], const T *tile, int row0, int kk,
                                            int lane)
{
    const stria__rc rc = stria__lda_rc(row0, kk, lane);
    stria__ldsm_x4(a, tile + stria__swz<D>(rc.row, rc.col));
}

/* B fragments of two n-blocks [n0, n0 + 16) x k [16 kk, 16 kk + 16) from a
 * tile whose rows are n (B[k][n] = tile[n][k]): b[0], b[1] for n0..n0+7 and
 * b[2], b[3] for n0+8..n0+15. Matrices: 0 n lo k lo, 1 n lo k hi, 2 n hi k
 * lo, 3 n hi k hi. */
template <typename T, int D>
__device__ __forceinline__ void stria__ld_b_nrows(uint32_t (&b)[4], const T *tile, int n0, int kk,
                                                  int lane)
{
    const stria__rc rc = stria__ldb_nrows_rc(n0, kk, lane);
    stria__ldsm_x4(b, tile + stria__swz<D>(rc.row, rc.col));
}

/* B fragments of two n-blocks [n0, n0 + 16) x k [k0, k0 + 16) from a tile
 * whose rows are k (B[k][n] = tile[k][n]; transposing load): b[0], b[1] for
 * n0..n0+7 and b[2], b[3] for n0+8..n0+15. Matrices: 0 k lo n lo, 1 k hi n
 * lo, 2 k lo n hi, 3 k hi n hi. */
template <typename T, int D>
__device__ __forceinline__ void stria__ld_b_krows(uint32_t (&b)[4], const T *tile, int k0, int n0,
                                                  int lane)
{
    const stria__rc rc = stria__ldb_krows_rc(k0, n0, lane);
    stria__ldsm_x4_t(b, tile + stria__swz<D>(rc.row, rc.col));
}

#ifndef STRIA_CU_EMU
template <typename T>
__device__ __forceinline__ void stria__mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                           uint32_t b1);
template <>
__device__ __forceinline__ void stria__mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                          uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void stria__mma<__half>(float (&c)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two fp32 values as a packed pair of T (lo = x, hi = y), rounded to nearest. */
#endif

template <typename T> __device__ __forceinline__ uint32_t stria__pack(float x, float y);
template <> __device__ __forceinline__ uint32_t stria__pack<__nv_bfloat16>(float x, float y)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    uint32_t r;
    memcpy(&r, &v, sizeof(r)); /* no type punning through pointers */
    return r;
}
template <> __device__ __forceinline__ uint32_t stria__pack<__half>(float x, float y)
{
    __half2 v = __floats2half2_rn(x, y);
    uint32_t r;
    memcpy(&r, &v, sizeof(r)); /* no type punning through pointers */
    return r;
}

/* Where A register r (0..3) of k-step kk of a 16 x N accumulator tile (C
 * layout) comes from: n-block `row` of the tile, values col and col + 1
 * (n-blocks 2kk and 2kk+1 become k lo and k hi; c0,c1 are row g, c2,c3 row
 * g+8). */
__host__ __device__ __forceinline__ stria__rc stria__c_to_a_src(int kk, int r)
{
    return {2 * kk + (r >> 1), (r & 1) * 2};
}

/* The A fragment of k-step kk of a 16 x N accumulator tile c[N/8][4],
 * rounded to T. */
template <typename T, int NB>
__device__ __forceinline__ void stria__c_to_a(uint32_t (&a)[4], const float (&c)[NB][4], int kk)
{
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const stria__rc src = stria__c_to_a_src(kk, r);
        a[r] = stria__pack<T>(c[src.row][src.col], c[src.row][src.col + 1]);
    }
}

template <int NB> __device__ __forceinline__ void stria__zero(float (&c)[NB][4])
{
#pragma unroll
    for (int n = 0; n < NB; n++)
        c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
}

/* c1 += A1 B1 and c2 += A2 B2 over the D columns of the tiles: A1, A2 rows
 * [row0, row0 + 16) of row-major tiles a1, a2; B1, B2 the NB n-blocks of
 * tiles b1, b2 whose rows are n (S = Q K^T and dP = dO V^T, or their
 * transposes). The k-steps are not unrolled: their fragments are loaded per
 * step anyway, and unrolling keeps every ldmatrix address live. */
template <typename T, int D, int NB>
__device__ __forceinline__ void stria__gemm2_nrows(float (&c1)[NB][4], float (&c2)[NB][4],
                                                   const T *a1, const T *a2, int row0, const T *b1,
                                                   const T *b2, int lane)
{
#pragma unroll 1
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t x1[4], x2[4];
        stria__ld_a<T, D>(x1, a1, row0, kk, lane);
        stria__ld_a<T, D>(x2, a2, row0, kk, lane);
#pragma unroll
        for (int p = 0; p < NB / 2; p++) {
            uint32_t bf[4];
            stria__ld_b_nrows<T, D>(bf, b1, p * 16, kk, lane);
            stria__mma<T>(c1[2 * p], x1, bf[0], bf[1]);
            stria__mma<T>(c1[2 * p + 1], x1, bf[2], bf[3]);
            stria__ld_b_nrows<T, D>(bf, b2, p * 16, kk, lane);
            stria__mma<T>(c2[2 * p], x2, bf[0], bf[1]);
            stria__mma<T>(c2[2 * p + 1], x2, bf[2], bf[3]);
        }
    }
}

/* acc += C B: C the 16 x (8 NB) fp32 accumulator tile c, rounded to T as the
 * A operand (P or dS); B the tile b whose rows are k (8 NB rows of D
 * columns), giving the D / 8 n-blocks of acc (O += P V, dQ += dS K,
 * dV += P^T dO, dK += dS^T Q). */
template <typename T, int D, int NB>
__device__ __forceinline__ void stria__gemm_c_krows(float (&acc)[D / 8][4], const float (&c)[NB][4],
                                                    const T *b, int lane)
{
#pragma unroll
    for (int kk = 0; kk < NB / 2; kk++) {
        uint32_t a[4];
        stria__c_to_a<T, NB>(a, c, kk);
#pragma unroll
        for (int p = 0; p < D / 16; p++) {
            uint32_t bf[4];
            stria__ld_b_krows<T, D>(bf, b, kk * 16, p * 16, lane);
            stria__mma<T>(acc[2 * p], a, bf[0], bf[1]);
            stria__mma<T>(acc[2 * p + 1], a, bf[2], bf[3]);
        }
    }
}

#endif /* STRIA_MMA_CUH */
