/* Internal interface between the attention driver (attn.c) and the per-ISA
 * CPU variants (cpu/<isa>.c). Not part of the public API. */
#ifndef STRIA_KERNELS_INT_H
#define STRIA_KERNELS_INT_H

#include "stria_kernels.h"
#include "stria_layout.h"

#include <stddef.h>

/* Tile sizes of the driver: queries per tile and keys per tile. Score tiles
 * are stored transposed, [keys][queries], so that every softmax statistic
 * (per query) is a column and the softmax passes need no horizontal
 * reductions. Packed fp32 rows are padded to STRIA__DPAD elements so vector
 * code needs no tails. STRIA__BQ must be a multiple of 16. Tiles that straddle
 * the causal mask are computed by sub-blocks of STRIA__SB x STRIA__SB (attn.c),
 * which divides both tile sizes and is a multiple of 16. The tile sizes and
 * the padding live in stria_layout.h, beside the admission rule that counts
 * the workspaces in whole tiles (stria_kernel_grant()). */
#define STRIA__BQ   STRIA_KERNEL_TILE_Q
#define STRIA__BK   STRIA_KERNEL_TILE_K
#define STRIA__SB   16
#define STRIA__DPAD STRIA_KERNEL_DPAD

static inline int64_t stria__round_up(int64_t x, int64_t m)
{
    return (x + m - 1) / m * m;
}

/* The operations a CPU variant provides. All buffers are fp32 unless stated.
 * "cols" arguments are multiples of 16; rows and k may be anything >= 0. */
typedef struct {
    const char *name;
    /* Whether this CPU can run the variant. */
    bool (*cpu_ok)(void);
    /* C[i][j] = beta_i * C[i][j] + sum_{p<k} A(i, p) * B[p][j] for i < m,
     * j < n (n a multiple of 16). A(i, p) = a[i * lda + p] when !trans_a and
     * a[p * lda + i] when trans_a. B rows are ldb apart, C rows ldc apart.
     * beta_i = 0 when !accumulate (C is only written), else c_scale[i], or 1
     * when c_scale is NULL. */
    void (*gemm)(int m, int n, int k, const float *a, ptrdiff_t lda, bool trans_a, const float *b,
                 ptrdiff_t ldb, float *c, ptrdiff_t ldc, const float *c_scale, bool accumulate);
    /* Online softmax step over a transposed score tile st[rows][cols] (keys x
     * queries, rows ld >= cols floats apart). For every column i, with running
     * max m[i] (of scaled scores) and running sum l[i]:
     *   m' = max(m[i], scale * max_j st[j][i]); alpha[i] = exp(m[i] - m');
     *   st[j][i] = exp(scale * st[j][i] - m'); l[i] = alpha[i] * l[i] + sum_j st[j][i].
     * -inf scores give 0; a column that has seen no finite score keeps
     * m = -inf, l = 0 and gets zero probabilities. */
    void (*softmax_fwd)(float *st, int rows, int cols, ptrdiff_t ld, float scale, float *m,
                        float *l, float *alpha);
    /* st[j][i] = exp(scale * st[j][i] - lse[i]) in place (rows ld apart);
     * lse[i] = +inf gives 0 (the driver maps rows without keys to +inf). */
    void (*softmax_bwd_p)(float *st, int rows, int cols, ptrdiff_t ld, float scale,
                          const float *lse);
    /* dpt[j][i] = pt[j][i] * (dpt[j][i] - delta[i]) * scale (both ld apart). */
    void (*softmax_bwd_ds)(const float *pt, float *dpt, int rows, int cols, ptrdiff_t ld,
                           const float *delta, float scale);
    /* The causal mask of a straddling block of a transposed score tile:
     * st[j][i] = -inf where kpos[j] > qpos[i], for j < rows and i < cols
     * (1 <= cols <= 16; rows ld apart); every other element keeps its bits.
     * Whole rows are written back with full-width stores, so that the
     * softmax's loads that follow are forwarded from them. */
    void (*mask_causal)(float *st, int rows, int cols, ptrdiff_t ld, const int64_t *kpos,
                        const int64_t *qpos);
    /* The mask of a straddling block under documents or a window: st[j][i] =
     * -inf where kpos[j] < qlo[i] or kpos[j] > qhi[i], for j < rows and
     * i < cols (1 <= cols <= 16; rows ld apart); every other element keeps its
     * bits. Whole rows are written back like mask_causal's. */
    void (*mask_bounds)(float *st, int rows, int cols, ptrdiff_t ld, const int64_t *kpos,
                        const int64_t *qlo, const int64_t *qhi);
    /* dst[0..n) = fp32 of the n elements of `dtype` at src; n a multiple of 8. */
    void (*row_load)(stria_dtype_t dtype, const void *src, float *dst, int n);
    /* dst[0..n) = the n fp32 values of src in `dtype` (to nearest even; a NaN
     * stays a NaN, quiet: stria_dtype_store()'s bits); n a multiple of 8. */
    void (*row_store)(stria_dtype_t dtype, const float *src, void *dst, int n);
    /* c[r][j] *= scale[j] for r < rows, j < cols (a multiple of 16), rows ld
     * apart: the online softmax's rescale of a transposed output (columns
     * are queries), on the tile path. */
    void (*scale_cols)(float *c, int rows, int cols, ptrdiff_t ld, const float *scale);
    /* dst[0..n) += src[0..n); n a multiple of 8; the rows do not overlap. */
    void (*row_acc)(float *dst, const float *src, int n);
    /* dst[0..n) = src[0..n) * inv when !accumulate (dst is only written), else
     * wa * dst[i] + wb * (src[i] * inv): a row of a partial output normalised
     * by its softmax sum and merged into the running one. n a multiple of 8. */
    void (*row_merge)(float *dst, const float *src, float inv, float wa, float wb, bool accumulate,
                      int n);
    /* dst[j][i] = src[i][j] for i < rows, j < cols (both multiples of 8) on
     * 32-bit elements, bit for bit: src rows lds elements apart, dst rows ldd
     * apart; the two do not overlap. Packs Q^T and dO^T (fp32, or bf16 taken
     * as pairs). */
    void (*transpose32)(const void *src, ptrdiff_t lds, void *dst, ptrdiff_t ldd, int rows,
                        int cols);
    /* Optional (NULL when absent; usable only when gemm_bf16_ok() says so):
     * the bf16 operations, which every product of bf16 inputs runs on.
     * gemm_bf16: C[i][j] = beta_i * C[i][j] + sum_{p<k} A(i, p) * B(p, j)
     * with bf16 inputs and fp32 accumulation, beta_i as in gemm. A(i, p) =
     * a[i * lda + p] when !trans_a, else A is stored in pairs along k:
     * a[(p / 2) * lda + 2 * i + p % 2]. B is stored in pairs along k:
     * B(p, j) = b[(p / 2) * ldb + 2 * j + p % 2]. k even, n a multiple of 16.
     * Denormal inputs count as zero. */
    void (*gemm_bf16)(int m, int n, int k, const uint16_t *a, ptrdiff_t lda, bool trans_a,
                      const uint16_t *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                      const float *c_scale, bool accumulate);
    bool (*gemm_bf16_ok)(void);
    /* softmax_fwd, but P is written (rounded to bf16, to nearest even) in
     * pairs of rows instead of over st: P^T[j][i] goes to pb[(j / 2) * ldp +
     * 2 * i + j % 2], the A operand of the P V product (trans_a); st is left
     * undefined. With odd rows the last pair's second half is 0. m, l and
     * alpha are computed from the fp32 probabilities. */
    void (*softmax_fwd_bf16)(float *st, int rows, int cols, ptrdiff_t ld, float scale, float *m,
                             float *l, float *alpha, uint16_t *pb, ptrdiff_t ldp);
    /* softmax_bwd_ds, its outputs rounded to bf16 (nearest even) for the
     * three gradient products instead of written over dpt: P^T into p_rows
     * and dS^T into ds_rows (both [rows][cols], ld apart), and dS^T in pairs
     * of rows into ds_pairs (element (j, i) at (j / 2) * 2 * ld + 2 * i +
     * j % 2; with odd rows the last pair's second half is 0). */
    void (*softmax_bwd_ds_bf16)(const float *pt, const float *dpt, int rows, int cols, ptrdiff_t ld,
                                const float *delta, float scale, uint16_t *p_rows,
                                uint16_t *ds_rows, uint16_t *ds_pairs);
    /* Whether gemm_bf16 runs on matrix tiles (AMX): a product is then
     * cheapest with its A operand as rows along k and B in pairs along k,
     * so the driver's tile path (attn_int.h) lays V and K out transposed once
     * per key tile, keeps O and dQ transposed (their per-query rescale a
     * column scale) and pads head_dim to STRIA__TILE_K. gemm_bf16 keeps its
     * whole contract (trans_a included) either way. */
    bool tiles;
    /* Optional: why this CPU cannot run the variant (NULL: it can, or no
     * reason beyond cpu_ok()); named by the error of an explicit choice. */
    const char *(*why_not)(void);
} stria_kern_ops_t;

/* The k of a tile product, to which the tile path pads head_dim. */
#define STRIA__TILE_K 32

/* The table of a variant whose functions are named PREFIX_gemm,
 * PREFIX_softmax_fwd, ...: {STRIA_KERN_OPS(stria__avx2), .name = "avx2"}. */
#define STRIA_KERN_OPS(prefix) .cpu_ok = prefix##_ok, STRIA_KERN_OPS_BODY(prefix)
/* The table's operations without cpu_ok: a variant that shares another's
 * operations with a check of its own. */
#define STRIA_KERN_OPS_BODY(prefix)                                                                \
    .gemm = prefix##_gemm, .softmax_fwd = prefix##_softmax_fwd,                                    \
    .softmax_bwd_p = prefix##_softmax_bwd_p, .softmax_bwd_ds = prefix##_softmax_bwd_ds,            \
    .mask_causal = prefix##_mask_causal, .mask_bounds = prefix##_mask_bounds,                      \
    .row_load = prefix##_row_load, .row_store = prefix##_row_store, .row_acc = prefix##_row_acc,   \
    .row_merge = prefix##_row_merge, .transpose32 = prefix##_transpose32,                          \
    .scale_cols = prefix##_scale_cols

extern const stria_kern_ops_t stria__kern_portable;
#ifdef STRIA_HAVE_X86_VARIANTS
extern const stria_kern_ops_t stria__kern_avx2;
extern const stria_kern_ops_t stria__kern_avx512;
/* avx512 without the bf16 operations: bf16 inputs take the fp32 path there,
 * as on a CPU without AVX512-BF16 (STRIA_KERNEL=avx512-nobf16) */
extern const stria_kern_ops_t stria__kern_avx512_nobf16;
#endif
#ifdef STRIA_HAVE_AMX
/* avx512 with every bf16 product on AMX tiles (cpu/amx_gemm.h) */
extern const stria_kern_ops_t stria__kern_amx;
#endif

/* Why the amx variant cannot run here, NULL when it can: the CPU's
 * features (AVX512-BF16, AMX-BF16 and AMX-TILE by CPUID) and the kernel's
 * grant of the tile state to this process (arch_prctl(ARCH_REQ_XCOMP_PERM),
 * asked once). Defined on every build (dispatch.c). */
const char *stria__amx_why_not(void);
/* The verdict itself, from what was found: avx512_bf16, the CPUID bits,
 * and the errno of the permission request (0: granted; ignored unless the
 * rest is there). */
const char *stria__amx_verdict(bool avx512_bf16, bool amx_bf16, bool amx_tile, int perm_errno);

/* Adds a variant that only an explicit choice selects (STRIA_KERNEL or
 * stria_kernels_set_variant), never the default: the test builds' emulated
 * ones (tests/kernels/amx_emu.c). Call before the first kernel call (a
 * constructor); ops must stay valid for the process's life. false: no
 * room (a few slots). */
bool stria__kern_register(const stria_kern_ops_t *ops);

/* A workspace buffer (64-byte aligned, `size` usable bytes). Released buffers
 * are cached for the next call (workspace.c); contents are undefined. */
typedef struct {
    void *ptr;
    size_t size;
    stria_allocator_t mem; /* alloc NULL: from and to the cache */
} stria__ws_t;

/* Takes a buffer of at least `size` bytes, from `mem` when given (NULL: the
 * cache); false when out of memory. */
bool stria__ws_get(const stria_allocator_t *mem, size_t size, stria__ws_t *ws);
/* Gives a buffer back (to the cache or to the system); resets *ws. */
void stria__ws_put(stria__ws_t *ws);

/* The calling thread's scratch (64-byte aligned, at least `floats` floats,
 * contents undefined): the per-thread memory of a task of a parallel loop.
 * It is the thread's, like its stack, never a call's workspace: each thread
 * keeps its largest until it exits (the main thread's: until the process
 * exits), so that a pool's threads pay for it once. NULL when out of
 * memory. */
float *stria__thread_scratch(size_t floats);

/* The variant in use (selected on first call). Returns NULL and sets the error
 * message when STRIA_KERNEL names an unusable variant. */
const stria_kern_ops_t *stria__kern_ops(void);
/* Why stria__kern_ops() returned NULL: STRIA_ERR_NOT_FOUND (unknown name) or
 * STRIA_ERR_UNSUPPORTED (the CPU lacks it). */
stria_status_t stria__kern_ops_status(void);

#endif
