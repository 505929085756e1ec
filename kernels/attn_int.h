/* Internals of the attention driver shared by its rooms: attn.c (arguments,
 * positions, the per-call context, tiling and packing, merge, finalize,
 * delta), attn_fwd.c (the forward pass) and attn_bwd.c (the backward pass).
 * Never installed. */
#ifndef STRIA_ATTN_INT_H
#define STRIA_ATTN_INT_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_int.h"
#include "validate_int.h"

static inline char *stria__row_ptr(const stria_tensor_t *t, int64_t b, int64_t tok, int64_t h)
{
    return (char *)t->data +
           (size_t)(b * t->stride_batch + tok * t->stride_token + h * t->stride_head) *
               stria_dtype_size(t->dtype);
}

/* Rows of one head are a token stride apart: 4 KiB and more for typical
 * shapes, so every row starts in a new page, where the hardware prefetchers
 * stop. Loops over such rows touch row i + STRIA__PF_ROWS ahead of use, so
 * that its cache lines are on their way while rows i.. are processed. */
#define STRIA__PF_ROWS 6

static inline void stria__prefetch(const void *p, size_t bytes, int write)
{
    for (size_t o = 0; o < bytes; o += 64) {
        if (write)
            __builtin_prefetch((const char *)p + o, 1, 3);
        else
            __builtin_prefetch((const char *)p + o, 0, 3);
    }
}

/* In a loop over rows [t0, t0 + n) of head h of t, at row i: prefetches row
 * i + STRIA__PF_ROWS (rows 1 .. STRIA__PF_ROWS at i = 0), those that are < n,
 * when rows are a page or more apart (closer rows are left to the hardware,
 * which does better there). */
static inline void stria__prefetch_ahead(const stria_tensor_t *t, int64_t b, int64_t h, int64_t t0,
                                         int i, int n, int64_t D, int write)
{
    const size_t bytes = (size_t)D * stria_dtype_size(t->dtype);
    if ((size_t)t->stride_token * stria_dtype_size(t->dtype) < 4096)
        return;
    for (int r = i == 0 ? 1 : i + STRIA__PF_ROWS; r <= i + STRIA__PF_ROWS && r < n; r++)
        stria__prefetch(stria__row_ptr(t, b, t0 + r, h), bytes, write);
}

typedef struct {
    const stria_kern_ops_t *ops;
    const stria_attn_params_t *p;
    stria__attn_dims_t dims;
    int64_t D, Dp;
    float scale;
    bool causal;
    int64_t nqt, nkt;
    int64_t *qpos, *kpos;
    int64_t *qmin, *qmax, *kmin, *kmax; /* per tile */
    /* per sub-block of STRIA__SB tokens: straddling tiles are classified at
     * this finer grain (stria__plan) */
    int64_t *qmin_s, *qmax_s, *kmin_s, *kmax_s;
    /* documents or a window: query row i sees the keys with positions in
     * [qlo[i], qhi[i]], and tiles and sub-blocks are classified by the min
     * and max of those bounds (stria__class_bounds) instead of the causal
     * rule. false: exactly the plain causal (or unmasked) path. */
    bool bounds;
    int64_t *qlo, *qhi;                             /* per query row */
    int64_t *lomin, *lomax, *himin, *himax;         /* per query tile */
    int64_t *lomin_s, *lomax_s, *himin_s, *himax_s; /* per query sub-block */
    int n_threads;
    /* bf16 inputs on a CPU with a bf16 dot product: every product runs on
     * bf16 pairs (the score products K Q^T and V dO^T on the inputs, P V,
     * P^T dO, dS^T Q and dS K on P and dS rounded to bf16), accumulation and
     * the softmax in fp32 */
    bool bf16;
    /* bf16 products on matrix tiles (the variant's `tiles`): the tile path.
     * V (forward) and K (backward's dQ) are packed transposed once per key
     * tile, [Dp][BK] bf16 (stria__pack_t), the A operand of O^T += V^T P^T
     * and dQ^T += K^T dS^T, whose B operands (P^T, dS^T in pairs of key rows)
     * the softmax passes write anyway; O and dQ are accumulated transposed,
     * [Dp][BQ] per query tile (the online softmax's rescale a column scale),
     * and turned into rows once at the end; head_dim is padded to
     * STRIA__TILE_K. */
    bool tiles;
    /* the key-side A operands of the score products (K, V rows) are read
     * from the caller's tensors in place, not packed: their rows already
     * hold what a packed tile would (fp32, or bf16 for the bf16 products,
     * with head_dim a multiple of STRIA__DPAD) */
    bool kdirect;
    /* the forward pass's V rows are read in place: fp32 rows of one head
     * adjacent in memory (head-major blocks), which is what a packed V
     * tile holds */
    bool vdirect;
} stria__ctx_t;

/* Tile pair classes under the mask. */
enum { STRIA__TILE_SKIP = 0, STRIA__TILE_FULL = 1, STRIA__TILE_PARTIAL = 2 };

/* Class of the keys with positions in [kmin, kmax] against the queries in
 * [qmin, qmax] under the causal mask. */
static inline int stria__class(int64_t kmin, int64_t kmax, int64_t qmin, int64_t qmax)
{
    if (kmin > qmax)
        return STRIA__TILE_SKIP;
    if (kmax <= qmin)
        return STRIA__TILE_FULL;
    return STRIA__TILE_PARTIAL;
}

/* Class of the keys with positions in [kmin, kmax] against query rows whose
 * visible keys are [lo, hi] each, lo in [lomin, lomax] and hi in [himin,
 * himax]: skipped when every key is outside every row's bounds, full when
 * every key is inside every row's bounds. */
static inline int stria__class_bounds(int64_t kmin, int64_t kmax, int64_t lomin, int64_t lomax,
                                      int64_t himin, int64_t himax)
{
    if (kmin > himax || kmax < lomin)
        return STRIA__TILE_SKIP;
    if (lomax <= kmin && kmax <= himin)
        return STRIA__TILE_FULL;
    return STRIA__TILE_PARTIAL;
}

static inline int stria__tile_class(const stria__ctx_t *c, int64_t qt, int64_t kt)
{
    if (c->bounds)
        return stria__class_bounds(c->kmin[kt], c->kmax[kt], c->lomin[qt], c->lomax[qt],
                                   c->himin[qt], c->himax[qt]);
    if (!c->causal)
        return STRIA__TILE_FULL;
    return stria__class(c->kmin[kt], c->kmax[kt], c->qmin[qt], c->qmax[qt]);
}

static inline int stria__tile_len(int64_t total, int64_t t0, int64_t tile)
{
    return (int)(total - t0 < tile ? total - t0 : tile);
}

/* One allocation for n arrays of int64_t: *parts[i] gets lens[i] entries,
 * one after the other (*parts[0] is the block to free). false: out of
 * memory, nothing set. */
static inline bool stria__alloc_parts(int64_t **const parts[], const int64_t lens[], int n)
{
    int64_t total = 0;
    for (int i = 0; i < n; i++)
        total += lens[i];
    int64_t *p = malloc((size_t)total * sizeof(int64_t));
    if (p == NULL)
        return false;
    for (int i = 0; i < n; i++) {
        *parts[i] = p;
        p += lens[i];
    }
    return true;
}

/* Splits a task number [outer][mid][inner] (n_mid, n_inner entries). */
static inline void stria__task_split(size_t task, int64_t n_mid, int64_t n_inner, int64_t *outer,
                                     int64_t *mid, int64_t *inner)
{
    *inner = (int64_t)task % n_inner;
    *mid = ((int64_t)task / n_inner) % n_mid;
    *outer = (int64_t)task / n_inner / n_mid;
}

/* The (batch, head, query tile) of a task numbered [B][H][nqt], with the
 * tile's first query q0 and its n queries. */
typedef struct {
    int64_t b, h, qt, q0;
    int n;
} stria__qtask_t;

static inline stria__qtask_t stria__qtask(const stria__ctx_t *c, size_t task)
{
    stria__qtask_t t;
    stria__task_split(task, c->dims.H, c->nqt, &t.b, &t.h, &t.qt);
    t.q0 = t.qt * STRIA__BQ;
    t.n = stria__tile_len(c->dims.Tq, t.q0, STRIA__BQ);
    return t;
}

/* The (batch, kv head, key tile or block of key tiles) of a task numbered
 * [B][Hkv][n]. */
typedef struct {
    int64_t b, hk, k;
    int64_t k0; /* stria__ktile(): the tile's first key, and n keys */
    int n;
} stria__ktask_t;

static inline stria__ktask_t stria__ktask(const stria__ctx_t *c, int64_t n, size_t task)
{
    stria__ktask_t t = {0};
    stria__task_split(task, c->dims.Hkv, n, &t.b, &t.hk, &t.k);
    return t;
}

/* The key tile of a task numbered [B][Hkv][nkt]. */
static inline stria__ktask_t stria__ktile(const stria__ctx_t *c, size_t task)
{
    stria__ktask_t t = stria__ktask(c, c->nkt, task);
    t.k0 = t.k * STRIA__BK;
    t.n = stria__tile_len(c->dims.Tk, t.k0, STRIA__BK);
    return t;
}

/* Sub-blocks of a tile: query chunks of STRIA__SB columns, key sub-blocks of
 * STRIA__SB rows. */
#define STRIA__NQS (STRIA__BQ / STRIA__SB)
#define STRIA__NKS (STRIA__BK / STRIA__SB)

/* How a straddling tile pair is computed, from the classes of its STRIA__SB x
 * STRIA__SB sub-blocks. For every query chunk qc, key rows [klo, khi) are
 * computed: the hull of the key sub-blocks that are not fully masked for it
 * (klo == khi: none). Within that range, fully visible sub-blocks run without
 * a mask, straddling ones are masked element by element and fully masked ones
 * (holes of the hull) are set to -inf. Fully masked sub-blocks outside the
 * range cost nothing: no score products, no exp, no P V or gradient
 * products. */
typedef struct {
    int64_t q0, k0; /* first query and key of the tiles */
    int bq, bk;     /* queries and keys in the tiles */
    int nqc, nkc;   /* query chunks and key sub-blocks holding tokens */
    int klo[STRIA__NQS], khi[STRIA__NQS];
    unsigned char cls[STRIA__NKS][STRIA__NQS];
} stria__plan_t;

/* Queries in query chunk qc. */
static inline int stria__plan_chunk(const stria__plan_t *pl, int qc)
{
    return pl->bq - qc * STRIA__SB < STRIA__SB ? pl->bq - qc * STRIA__SB : STRIA__SB;
}

/* Whether key sub-block kb is computed for query chunk qc. */
static inline bool stria__plan_has(const stria__plan_t *pl, int kb, int qc)
{
    return pl->klo[qc] <= kb * STRIA__SB && kb * STRIA__SB < pl->khi[qc];
}

/* The key-side A operand of a score product for one key tile: its first
 * row (fp32, or bf16 pairs) and the distance between rows in elements. */
typedef struct {
    const float *p;
    ptrdiff_t ld;
} stria__kop_t;

/* (oa, *lsea) <- merge of (oa, *lsea) and (ob * inv, lseb): ob scaled by inv
 * is the partial (the forward pass hands in its unnormalised row and 1 / its
 * softmax sum). Max-subtracted weights: both are <= 1, so nothing overflows
 * whatever the LSE gap. */
static inline void stria__merge_row(const stria_kern_ops_t *ops, float *oa, float *lsea,
                                    const float *ob, float inv, float lseb, int64_t D)
{
    float a = *lsea;
    if (lseb == -INFINITY)
        return;
    if (a == -INFINITY) {
        ops->row_merge(oa, ob, inv, 0.0f, 0.0f, false, (int)D);
        *lsea = lseb;
        return;
    }
    float mx = a > lseb ? a : lseb;
    float lse = mx + log1pf(expf(-fabsf(a - lseb)));
    ops->row_merge(oa, ob, inv, expf(a - lse), expf(lseb - lse), true, (int)D);
    *lsea = lse;
}

/* Offset, in bf16 elements, of element (j, i) (j even) of a [BK][BQ] tile
 * stored in pairs of rows (the trans_a operand of gemm_bf16). */
static inline size_t stria__pair_off(int j, int i)
{
    return (size_t)j * STRIA__BQ + 2 * (size_t)i;
}

/* k of a bf16 product over n rows: rounded up to a pair (the partner of an
 * odd last row is 0 in both operands). */
static inline int stria__k2(int n)
{
    return (n + 1) & ~1;
}

/* ---- shared by the rooms (defined in attn.c and attn_fwd.c) ------------------- */

void stria__ctx_free(stria__ctx_t *c);
void stria__group_bounds(const int64_t *lo, const int64_t *hi, int64_t n, int64_t grain,
                         int64_t n_groups, int64_t *lomin, int64_t *lomax, int64_t *himin,
                         int64_t *himax);
stria_status_t stria__ctx_init(stria__ctx_t *c, const stria_attn_params_t *p, const char *fn);
void stria__plan(const stria__ctx_t *c, int64_t qt, int64_t kt, stria__plan_t *pl);
void stria__mask_chunk(const stria__ctx_t *c, const stria__plan_t *pl, float *st, int qc);
void stria__pack_rows(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
                      int64_t t0, int n, int rows, float *dst);
void stria__pack_pairs(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
                       int64_t t0, int n, int rows, uint16_t *dst);
void stria__pack_t(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h, int64_t t0,
                   int n, uint16_t *dst);
void stria__pack_qside(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
                       int64_t q0, int n, float *rows_f32, float *tmp, float *dst);
void stria__pack_kside(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
                       int64_t k0, int n, float *dst);
stria__kop_t stria__kside(const stria__ctx_t *c, const stria_tensor_t *t, const float *packed,
                          size_t tile_floats, int64_t b, int64_t hk, int64_t kt);
void stria__score_gemm(const stria__ctx_t *c, int j0, int rows, int i0, int cols, stria__kop_t a,
                       const float *b, float *st);
void stria__score_gemm_plan(const stria__ctx_t *c, const stria__plan_t *pl, stria__kop_t a,
                            const float *b, float *st);
size_t stria__score_tile_floats(const stria__ctx_t *c, size_t tile);
void stria__ctx_set_dtype(stria__ctx_t *c, stria_dtype_t dtype);
stria_status_t stria__ws_floats(const stria_allocator_t *mem, double bound, size_t floats,
                                stria__ws_t *ws, const char *fn);
stria_status_t stria__ws_areas(const stria_allocator_t *mem, double bound, int n,
                               const size_t *sizes, float **const *at, stria__ws_t *ws,
                               const char *fn);
/* The calling thread's scratch of `floats` floats for a task of a parallel
 * loop (stria__thread_scratch()); NULL when out of memory, with *failed set:
 * the task then does nothing and its call reports STRIA_ERR_NO_MEMORY
 * (stria__scratch_status(), once the loop is over). */
static inline float *stria__task_scratch(size_t floats, int *failed)
{
    float *p = stria__thread_scratch(floats);
    if (p == NULL)
        __atomic_store_n(failed, 1, __ATOMIC_RELAXED);
    return p;
}
stria_status_t stria__scratch_status(int failed, size_t floats, const char *fn);
stria_status_t stria__same_query(const stria_attn_params_t *b, const stria_attn_params_t *p,
                                 const char *fn);
stria_attn_params_t stria__query_side(const stria_attn_params_t *p);
stria_status_t stria__pass_check(const void *out, const stria_attn_params_t *params,
                                 const stria_tensor_t *q, stria_attn_params_t *a, const char *fn);
stria_status_t stria__pass_query(const stria_attn_params_t *params, stria_attn_params_t *p,
                                 stria_pos_run_t **runs, const char *fn);

/* The way out of a pass's begin that failed: frees its context (when made:
 * c not NULL), its copy of the query runs and the pass; returns st. */
static inline stria_status_t stria__begin_fail(stria__ctx_t *c, stria_pos_run_t *q_runs, void *pass,
                                               stria_status_t st)
{
    if (c != NULL)
        stria__ctx_free(c);
    free(q_runs);
    free(pass);
    return st;
}

#endif /* STRIA_ATTN_INT_H */
