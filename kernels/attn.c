/*
 * The attention driver: argument checks, position masks, tiling, online
 * softmax, merging and the backward pass, on top of the per-ISA operations of
 * kernels_int.h. Layout-agnostic: every mask decision comes from positions.
 */
#include "kernels_int.h"
#include "validate_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- tensors and validation ------------------------------------------- */

stria_tensor_t stria_tensor_contiguous(void *data, stria_dtype_t dtype, int64_t tokens,
                                       int64_t heads, int64_t head_dim)
{
    stria_tensor_t t;
    t.data = data;
    t.dtype = dtype;
    t.stride_head = head_dim;
    t.stride_token = heads * head_dim;
    t.stride_batch = tokens * heads * head_dim;
    return t;
}

stria_tensor_t stria_tensor_head_major(void *data, stria_dtype_t dtype, int64_t tokens,
                                       int64_t heads, int64_t head_dim)
{
    stria_tensor_t t;
    t.data = data;
    t.dtype = dtype;
    t.stride_token = head_dim;
    t.stride_head = tokens * head_dim;
    t.stride_batch = heads * tokens * head_dim;
    return t;
}

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

/* Expands runs into one position per token (allocated); checks counts and
 * ranges. */
static stria_status_t stria__expand_positions(const stria_positions_t *pos, int64_t tokens,
                                              const char *fn, const char *which, int64_t **out)
{
    int64_t *arr = malloc((size_t)tokens * sizeof(int64_t));
    stria_status_t st;

    if (arr == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate positions", fn);
    st = stria__validate_positions(pos, tokens, fn, which, arr);
    if (st != STRIA_OK) {
        free(arr);
        return st;
    }
    *out = arr;
    return STRIA_OK;
}

/* ---- per-call context ---------------------------------------------------- */

typedef struct {
    const stria_kern_ops_t *ops;
    const stria_attn_params_t *p;
    int64_t B, Tq, Tk, H, Hkv, G, D, Dp;
    float scale;
    bool causal;
    int64_t nqt, nkt;
    int64_t *qpos, *kpos;
    int64_t *qmin, *qmax, *kmin, *kmax; /* per tile */
    /* per sub-block of STRIA__SB tokens: straddling tiles are classified at
     * this finer grain (stria__plan) */
    int64_t *qmin_s, *qmax_s, *kmin_s, *kmax_s;
    int n_threads;
    /* bf16 inputs on a CPU with a bf16 dot product: the score products
     * (K Q^T, V dO^T) run on packed bf16 pairs, everything else in fp32 */
    bool bf16;
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

static void stria__ctx_free(stria__ctx_t *c)
{
    free(c->qpos);
    free(c->kpos);
    free(c->qmin);
    free(c->kmin);
    free(c->qmin_s);
    free(c->kmin_s);
}

static void stria__tile_bounds(const int64_t *pos, int64_t n, int64_t tile, int64_t n_tiles,
                               int64_t *mn, int64_t *mx)
{
    for (int64_t t = 0; t < n_tiles; t++) {
        int64_t lo = INT64_MAX, hi = INT64_MIN;
        int64_t end = (t + 1) * tile < n ? (t + 1) * tile : n;
        for (int64_t i = t * tile; i < end; i++) {
            lo = pos[i] < lo ? pos[i] : lo;
            hi = pos[i] > hi ? pos[i] : hi;
        }
        mn[t] = lo;
        mx[t] = hi;
    }
}

static stria_status_t stria__ctx_init(stria__ctx_t *c, const stria_attn_params_t *p, const char *fn)
{
    stria_status_t st;

    memset(c, 0, sizeof(*c));
    c->ops = stria__kern_ops();
    if (c->ops == NULL)
        return stria__kern_ops_status(); /* message set by stria__kern_ops() */
    c->p = p;
    c->B = p->batch;
    c->Tq = p->q_tokens;
    c->Tk = p->kv_tokens;
    c->H = p->heads;
    c->Hkv = p->kv_heads;
    c->G = p->heads / p->kv_heads;
    c->D = p->head_dim;
    c->Dp = stria__round_up(p->head_dim, STRIA__DPAD);
    c->scale = stria__attn_scale(p);
    c->causal = p->causal;
    c->nqt = (c->Tq + STRIA__BQ - 1) / STRIA__BQ;
    c->nkt = (c->Tk + STRIA__BK - 1) / STRIA__BK;
    c->n_threads = stria_pool_size(p->pool);

    st = stria__expand_positions(&p->q_pos, c->Tq, fn, "query", &c->qpos);
    if (st != STRIA_OK)
        return st;
    st = stria__expand_positions(&p->kv_pos, c->Tk, fn, "key", &c->kpos);
    if (st != STRIA_OK)
        goto err;
    c->qmin = malloc(2 * (size_t)c->nqt * sizeof(int64_t));
    c->kmin = malloc(2 * (size_t)c->nkt * sizeof(int64_t));
    c->qmin_s = malloc(2 * (size_t)c->nqt * STRIA__BQ / STRIA__SB * sizeof(int64_t));
    c->kmin_s = malloc(2 * (size_t)c->nkt * STRIA__BK / STRIA__SB * sizeof(int64_t));
    if (c->qmin == NULL || c->kmin == NULL || c->qmin_s == NULL || c->kmin_s == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate tile bounds", fn);
        goto err;
    }
    c->qmax = c->qmin + c->nqt;
    c->kmax = c->kmin + c->nkt;
    stria__tile_bounds(c->qpos, c->Tq, STRIA__BQ, c->nqt, c->qmin, c->qmax);
    stria__tile_bounds(c->kpos, c->Tk, STRIA__BK, c->nkt, c->kmin, c->kmax);
    c->qmax_s = c->qmin_s + c->nqt * STRIA__BQ / STRIA__SB;
    c->kmax_s = c->kmin_s + c->nkt * STRIA__BK / STRIA__SB;
    /* sub-blocks past the last token get empty bounds (never used) */
    stria__tile_bounds(c->qpos, c->Tq, STRIA__SB, c->nqt * STRIA__BQ / STRIA__SB, c->qmin_s,
                       c->qmax_s);
    stria__tile_bounds(c->kpos, c->Tk, STRIA__SB, c->nkt * STRIA__BK / STRIA__SB, c->kmin_s,
                       c->kmax_s);
    return STRIA_OK;
err:
    stria__ctx_free(c);
    return st;
}

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

static inline int stria__tile_class(const stria__ctx_t *c, int64_t qt, int64_t kt)
{
    if (!c->causal)
        return STRIA__TILE_FULL;
    return stria__class(c->kmin[kt], c->kmax[kt], c->qmin[qt], c->qmax[qt]);
}

static inline int stria__tile_len(int64_t total, int64_t t0, int64_t tile)
{
    return (int)(total - t0 < tile ? total - t0 : tile);
}

/* The (batch, head, query tile) of a task numbered [B][H][nqt]. */
typedef struct {
    int64_t b, h, qt;
} stria__qtask_t;

static inline stria__qtask_t stria__qtask(int64_t nqt, int64_t H, size_t task)
{
    stria__qtask_t t;
    t.qt = (int64_t)task % nqt;
    t.h = ((int64_t)task / nqt) % H;
    t.b = (int64_t)task / nqt / H;
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

static void stria__plan(const stria__ctx_t *c, int64_t qt, int64_t kt, stria__plan_t *pl)
{
    const int64_t qs0 = qt * STRIA__NQS, ks0 = kt * STRIA__NKS;
    const int bq = stria__tile_len(c->Tq, qt * STRIA__BQ, STRIA__BQ);
    const int bk = stria__tile_len(c->Tk, kt * STRIA__BK, STRIA__BK);

    pl->q0 = qt * STRIA__BQ;
    pl->k0 = kt * STRIA__BK;
    pl->bq = bq;
    pl->bk = bk;
    pl->nqc = (bq + STRIA__SB - 1) / STRIA__SB;
    pl->nkc = (bk + STRIA__SB - 1) / STRIA__SB;
    for (int qc = 0; qc < pl->nqc; qc++) {
        int lo = -1, hi = -1;
        for (int kb = 0; kb < pl->nkc; kb++) {
            int cls = stria__class(c->kmin_s[ks0 + kb], c->kmax_s[ks0 + kb], c->qmin_s[qs0 + qc],
                                   c->qmax_s[qs0 + qc]);
            pl->cls[kb][qc] = (unsigned char)cls;
            if (cls != STRIA__TILE_SKIP) {
                lo = lo < 0 ? kb : lo;
                hi = kb + 1;
            }
        }
        pl->klo[qc] = lo < 0 ? 0 : lo * STRIA__SB;
        pl->khi[qc] = lo < 0 ? 0 : (hi * STRIA__SB < bk ? hi * STRIA__SB : bk);
    }
}

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

/* Masks the computed key rows of query chunk qc of a straddling tile: sets
 * the masked scores to -inf. st is transposed: [keys][STRIA__BQ queries]. */
static void stria__mask_chunk(const stria__ctx_t *c, const stria__plan_t *pl, float *st, int qc)
{
    const int i0 = qc * STRIA__SB, ni = stria__plan_chunk(pl, qc);
    const int64_t *qp = c->qpos + pl->q0 + i0;

    for (int j0 = pl->klo[qc]; j0 < pl->khi[qc]; j0 += STRIA__SB) {
        int cls = pl->cls[j0 / STRIA__SB][qc];
        int j1 = j0 + STRIA__SB < pl->khi[qc] ? j0 + STRIA__SB : pl->khi[qc];
        float *blk = st + (size_t)j0 * STRIA__BQ + (size_t)i0;
        if (cls == STRIA__TILE_PARTIAL) {
            c->ops->mask_causal(blk, j1 - j0, ni, STRIA__BQ, c->kpos + pl->k0 + j0, qp);
        } else if (cls == STRIA__TILE_SKIP) { /* a hole of the chunk's key range */
            for (int j = 0; j < j1 - j0; j++)
                for (int i = 0; i < STRIA__SB; i++)
                    blk[(size_t)j * STRIA__BQ + (size_t)i] = -INFINITY;
        }
    }
}

/* ---- packing ------------------------------------------------------------- */

/* rows [t0, t0+n) of head h as fp32 [rows][Dp], zero padded */
static void stria__pack_rows(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
                             int64_t t0, int n, int rows, float *dst)
{
    for (int i = 0; i < rows; i++) {
        float *d = dst + (size_t)i * (size_t)c->Dp;
        stria__prefetch_ahead(t, b, h, t0, i, n, c->D, 0);
        if (i < n) {
            c->ops->row_load(t->dtype, stria__row_ptr(t, b, t0 + i, h), d, (int)c->D);
            for (int64_t j = c->D; j < c->Dp; j++)
                d[j] = 0.0f;
        } else {
            memset(d, 0, (size_t)c->Dp * sizeof(float));
        }
    }
}

/* dst[Dp][BQ] = transpose of the packed rows src[BQ][Dp]. */
static void stria__transpose_tile(const stria__ctx_t *c, const float *src, float *dst)
{
    c->ops->transpose32(src, c->Dp, dst, STRIA__BQ, STRIA__BQ, (int)c->Dp);
}

/* rows [t0, t0+n) of head h of a bf16 tensor, bit for bit, as [rows][Dp]
 * bf16, zero padded */
static void stria__pack_rows_bf16(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b,
                                  int64_t h, int64_t t0, int n, int rows, uint16_t *dst)
{
    for (int i = 0; i < rows; i++) {
        uint16_t *d = dst + (size_t)i * (size_t)c->Dp;
        size_t copied = i < n ? (size_t)c->D : 0;
        stria__prefetch_ahead(t, b, h, t0, i, n, c->D, 0);
        if (copied > 0)
            memcpy(d, stria__row_ptr(t, b, t0 + i, h), copied * sizeof(uint16_t));
        memset(d + copied, 0, ((size_t)c->Dp - copied) * sizeof(uint16_t));
    }
}

/* dst[Dp/2][BQ] pairs = transpose of src[BQ][Dp] bf16 taken as 32-bit pairs:
 * the B operand layout of the bf16 GEMM. */
static void stria__transpose_pairs(const stria__ctx_t *c, const uint16_t *src, uint16_t *dst)
{
    c->ops->transpose32(src, c->Dp / 2, dst, STRIA__BQ, STRIA__BQ, (int)(c->Dp / 2));
}

/* Packs the query-side B operand of a score product (Q^T or dO^T) of one
 * tile: fp32 transposed, or bf16 pairs (using tmp, BQ * Dp floats, for the
 * rows). rows_f32 receives the fp32 rows when not NULL. */
static void stria__pack_qside(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
                              int64_t q0, int n, float *rows_f32, float *tmp, float *dst)
{
    if (c->bf16) {
        stria__pack_rows_bf16(c, t, b, h, q0, n, STRIA__BQ, (uint16_t *)tmp);
        stria__transpose_pairs(c, (const uint16_t *)tmp, (uint16_t *)dst);
        if (rows_f32 != NULL)
            stria__pack_rows(c, t, b, h, q0, n, STRIA__BQ, rows_f32);
    } else {
        float *rows = rows_f32 != NULL ? rows_f32 : tmp;
        stria__pack_rows(c, t, b, h, q0, n, STRIA__BQ, rows);
        stria__transpose_tile(c, rows, dst);
    }
}

/* Packs a key-side A operand of a score product (K or V rows) of one tile. */
static void stria__pack_kside(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
                              int64_t k0, int n, float *dst)
{
    if (c->bf16)
        stria__pack_rows_bf16(c, t, b, h, k0, n, STRIA__BK, (uint16_t *)dst);
    else
        stria__pack_rows(c, t, b, h, k0, n, STRIA__BK, dst);
}

/* The key-side A operand of a score product for one key tile: its first
 * row (fp32, or bf16 pairs) and the distance between rows in elements. */
typedef struct {
    const float *p;
    ptrdiff_t ld;
} stria__kop_t;

/* Key tile kt of kv head hk of t: in place when c->kdirect, else its packed
 * tile (tile_floats floats each, [B][Hkv][nkt] order) in `packed`. */
static stria__kop_t stria__kside(const stria__ctx_t *c, const stria_tensor_t *t,
                                 const float *packed, size_t tile_floats, int64_t b, int64_t hk,
                                 int64_t kt)
{
    stria__kop_t op;
    if (c->kdirect) {
        op.p = (const float *)stria__row_ptr(t, b, kt * STRIA__BK, hk);
        op.ld = (ptrdiff_t)t->stride_token;
    } else {
        op.p = packed + (size_t)((b * c->Hkv + hk) * c->nkt + kt) * tile_floats;
        op.ld = (ptrdiff_t)c->Dp;
    }
    return op;
}

/* Rows [j0, j0 + rows) and columns [i0, i0 + cols) of st[BK][BQ] = A B: A the
 * key-side rows, B the packed query-side operand (see the functions above).
 * i0 and cols are multiples of 16. */
static void stria__score_gemm(const stria__ctx_t *c, int j0, int rows, int i0, int cols,
                              stria__kop_t a, const float *b, float *st)
{
    float *dst = st + (size_t)j0 * STRIA__BQ + (size_t)i0;
    if (c->bf16)
        c->ops->gemm_bf16(rows, cols, (int)c->Dp, (const uint16_t *)a.p + (ptrdiff_t)j0 * a.ld,
                          a.ld, (const uint16_t *)b + 2 * (size_t)i0, 2 * STRIA__BQ, dst,
                          STRIA__BQ);
    else
        c->ops->gemm(rows, cols, (int)c->D, a.p + (ptrdiff_t)j0 * a.ld, a.ld, false, b + i0,
                     STRIA__BQ, dst, STRIA__BQ, NULL, false);
}

/* The score products of a straddling tile pair (stria__plan): every computed
 * (key sub-block, query chunk) pair of st = A B, one product per key
 * sub-block and run of consecutive query chunks that compute it. Going along
 * key rows gives the products up to the tile's full width (a causal diagonal
 * tile: 64, 48, 32 and 16 columns) where going by query chunk gives 16
 * columns each, which a 16-lane vector unit runs at a fraction of its rate.
 * Each score is the same dot product either way. */
static void stria__score_gemm_plan(const stria__ctx_t *c, const stria__plan_t *pl, stria__kop_t a,
                                   const float *b, float *st)
{
    for (int kb = 0; kb < pl->nkc; kb++) {
        const int j0 = kb * STRIA__SB, nj = pl->bk - j0 < STRIA__SB ? pl->bk - j0 : STRIA__SB;
        int qc = 0;
        while (qc < pl->nqc) {
            if (!stria__plan_has(pl, kb, qc)) {
                qc++;
                continue;
            }
            int qa = qc;
            while (qc < pl->nqc && stria__plan_has(pl, kb, qc))
                qc++;
            stria__score_gemm(c, j0, nj, qa * STRIA__SB, (qc - qa) * STRIA__SB, a, b, st);
        }
    }
}

/* Floats per packed tile of a score operand: bf16 pairs take half. */
static size_t stria__score_tile_floats(const stria__ctx_t *c, size_t tile)
{
    return c->bf16 ? tile / 2 : tile;
}

static void stria__ctx_set_dtype(stria__ctx_t *c, stria_dtype_t dtype)
{
    c->bf16 = dtype == STRIA_DTYPE_BF16 && c->ops->gemm_bf16 != NULL && c->ops->gemm_bf16_ok();
    c->kdirect = c->D == c->Dp && (c->bf16 || dtype == STRIA_DTYPE_F32);
}

/* ---- merge ------------------------------------------------------------- */

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

/* ---- forward ----------------------------------------------------------- */

typedef struct {
    stria__ctx_t *c;
    const stria_tensor_t *q, *k, *v, *o;
    float *lse;
    bool accumulate;
    float *k_packed; /* [B][Hkv][nkt][BK][Dp], fp32 or bf16 (k_tile floats each) */
    float *v_packed; /* [B][Hkv][nkt][BK][Dp] */
    size_t k_tile;
    float *scratch; /* per thread */
    size_t scratch_floats;
    /* a forward pass's query side packed at begin ([B][H][nqt], q_tile
     * floats each), or NULL: each task packs its Q tile */
    const float *q_packed;
    size_t q_tile;
} stria__fwd_job_t;

static void stria__fwd_pack_task(void *arg, size_t task, int thread)
{
    stria__fwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    int64_t kt = (int64_t)task % c->nkt;
    int64_t hk = ((int64_t)task / c->nkt) % c->Hkv;
    int64_t b = (int64_t)task / c->nkt / c->Hkv;
    int64_t k0 = kt * STRIA__BK;
    int n = stria__tile_len(c->Tk, k0, STRIA__BK);
    size_t tile = (size_t)c->Dp * STRIA__BK;

    (void)thread;
    if (!c->kdirect)
        stria__pack_kside(c, job->k, b, hk, k0, n, job->k_packed + task * job->k_tile);
    if (!c->vdirect)
        stria__pack_rows(c, job->v, b, hk, k0, n, STRIA__BK, job->v_packed + task * tile);
}

/* A straddling tile pair of the forward pass, query chunk by query chunk
 * (stria__plan): S^T = K Q^T over the chunk's key rows, mask, online softmax,
 * O = diag(alpha) O + P V. Skipping the fully masked rows changes no result:
 * they would add exp(-inf) = 0 to the sums and products. first: O holds
 * nothing yet (it is written, not accumulated). */
static void stria__fwd_partial(const stria__ctx_t *c, int64_t qt, int64_t kt, stria__kop_t kp,
                               const float *vp, const float *qt_buf, float *st, float *oacc,
                               float *m, float *l, float *alpha, bool first)
{
    const int64_t Dp = c->Dp;
    stria__plan_t pl;

    stria__plan(c, qt, kt, &pl);
    stria__score_gemm_plan(c, &pl, kp, qt_buf, st);
    for (int qc = 0; qc < pl.nqc; qc++) {
        const int i0 = qc * STRIA__SB, ni = stria__plan_chunk(&pl, qc);
        const int klo = pl.klo[qc], nk = pl.khi[qc] - pl.klo[qc];
        float *o = oacc + (size_t)i0 * (size_t)Dp;
        float *sc = st + (size_t)klo * STRIA__BQ + (size_t)i0;
        if (nk == 0) { /* no key of this tile is visible to the chunk */
            if (first)
                memset(o, 0, (size_t)ni * (size_t)Dp * sizeof(float));
            continue;
        }
        stria__mask_chunk(c, &pl, st, qc);
        c->ops->softmax_fwd(sc, nk, STRIA__SB, STRIA__BQ, c->scale, m + i0, l + i0, alpha + i0);
        c->ops->gemm(ni, (int)Dp, nk, sc, STRIA__BQ, true, vp + (size_t)klo * (size_t)Dp, Dp, o, Dp,
                     alpha + i0, !first);
    }
}

/* One query tile of one head against every key tile: S^T = K Q^T, online
 * softmax down the columns, O = diag(alpha) O + P V. */
static void stria__fwd_task(void *arg, size_t task, int thread)
{
    stria__fwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    const stria_kern_ops_t *ops = c->ops;
    /* last query tiles first: under a causal mask they see the most keys, and
     * tasks are handed out in index order, so the small ones fill the end */
    int64_t qt = c->nqt - 1 - (int64_t)task % c->nqt;
    int64_t h = ((int64_t)task / c->nqt) % c->H;
    int64_t b = (int64_t)task / c->nqt / c->H;
    int64_t hk = h / c->G;
    int64_t q0 = qt * STRIA__BQ;
    int bq = stria__tile_len(c->Tq, q0, STRIA__BQ);
    int64_t Dp = c->Dp;
    size_t tile = (size_t)Dp * STRIA__BK;
    float *qt_buf = job->scratch + (size_t)thread * job->scratch_floats; /* [Dp][BQ] */
    float *oacc = qt_buf + STRIA__BQ * Dp;                               /* [BQ][Dp] */
    float *st = oacc + STRIA__BQ * Dp;                                   /* [BK][BQ] */
    float *m = st + STRIA__BQ * STRIA__BK;
    float *l = m + STRIA__BQ;
    float *alpha = l + STRIA__BQ;
    bool first = true;

    const float *qtp = qt_buf; /* the tile's packed Q^T */
    if (job->q_packed != NULL)
        qtp = job->q_packed + (size_t)((b * c->H + h) * c->nqt + qt) * job->q_tile;
    else
        stria__pack_qside(c, job->q, b, h, q0, bq, NULL, oacc, qt_buf);
    for (int i = 0; i < STRIA__BQ; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    for (int64_t kt = 0; kt < c->nkt; kt++) {
        int cls = stria__tile_class(c, qt, kt);
        if (cls == STRIA__TILE_SKIP)
            continue;
        int64_t k0 = kt * STRIA__BK;
        int bk = stria__tile_len(c->Tk, k0, STRIA__BK);
        size_t tidx = (size_t)((b * c->Hkv + hk) * c->nkt + kt);
        stria__kop_t kp = stria__kside(c, job->k, job->k_packed, job->k_tile, b, hk, kt);
        const float *vp = c->vdirect ? (const float *)stria__row_ptr(job->v, b, k0, hk)
                                     : job->v_packed + tidx * tile;

        if (cls == STRIA__TILE_PARTIAL) {
            stria__fwd_partial(c, qt, kt, kp, vp, qtp, st, oacc, m, l, alpha, first);
        } else {
            stria__score_gemm(c, 0, bk, 0, STRIA__BQ, kp, qtp, st);
            ops->softmax_fwd(st, bk, STRIA__BQ, STRIA__BQ, c->scale, m, l, alpha);
            ops->gemm(bq, (int)Dp, bk, st, STRIA__BQ, true, vp, Dp, oacc, Dp, alpha, !first);
        }
        first = false;
    }
    if (first) /* every key tile was masked */
        memset(oacc, 0, (size_t)bq * (size_t)Dp * sizeof(float));
    for (int i = 0; i < bq; i++) {
        const float *orow = oacc + (size_t)i * (size_t)Dp;
        float *out = (float *)stria__row_ptr(job->o, b, q0 + i, h);
        float *lse_out = job->lse + (size_t)((b * c->H + h) * c->Tq + q0 + i);
        /* the row is normalised by 1 / l on its way out */
        float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        float lse_new = l[i] > 0.0f ? m[i] + logf(l[i]) : -INFINITY;
        if (job->accumulate) {
            stria__merge_row(ops, out, lse_out, orow, inv, lse_new, c->D);
        } else {
            if (l[i] > 0.0f)
                ops->row_merge(out, orow, inv, 0.0f, 0.0f, false, (int)c->D);
            else
                memset(out, 0, (size_t)c->D * sizeof(float));
            *lse_out = lse_new;
        }
    }
}

/* Takes a workspace of `floats` floats from the cache; `bound` is the same
 * size computed in double (with any factor the caller multiplies it by), to
 * refuse sizes that overflow. */
static stria_status_t stria__ws_floats(double bound, size_t floats, stria__ws_t *ws, const char *fn)
{
    if (bound > 0x1p58 || !stria__ws_get(floats * sizeof(float), ws))
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate %zu MiB of workspace", fn,
                               (floats * sizeof(float)) >> 20);
    return STRIA_OK;
}

/* stria_attn_fwd() on validated arguments; q_packed: the query side packed
 * by a forward pass (q is then only its view), or NULL. */
static stria_status_t stria__fwd_run(const stria_attn_params_t *params, const stria_tensor_t *q,
                                     const float *q_packed, const stria_tensor_t *k,
                                     const stria_tensor_t *v, const stria_tensor_t *o, float *lse,
                                     bool accumulate, const char *fn)
{
    stria__fwd_job_t job;
    stria__ctx_t c;
    stria_status_t st;
    size_t tile, n_ktiles, total;
    stria__ws_t ws = {0};

    st = stria__ctx_init(&c, params, fn);
    if (st != STRIA_OK)
        return st;

    memset(&job, 0, sizeof(job));
    job.c = &c;
    job.q = q;
    job.q_packed = q_packed;
    job.k = k;
    job.v = v;
    job.o = o;
    job.lse = lse;
    job.accumulate = accumulate;
    stria__ctx_set_dtype(&c, q->dtype);
    c.vdirect = c.D == c.Dp && v->dtype == STRIA_DTYPE_F32 && v->stride_token == c.D;
    tile = (size_t)c.Dp * STRIA__BK;
    n_ktiles = (size_t)(c.B * c.Hkv * c.nkt);
    job.k_tile = stria__score_tile_floats(&c, tile);
    job.q_tile = stria__score_tile_floats(&c, (size_t)c.Dp * STRIA__BQ);
    job.scratch_floats = (size_t)(2 * STRIA__BQ * c.Dp + STRIA__BQ * STRIA__BK + 3 * STRIA__BQ);
    job.scratch_floats = (size_t)stria__round_up((int64_t)job.scratch_floats, 16);
    /* operands read in place need no packed tiles */
    size_t k_area = c.kdirect ? 0 : n_ktiles * job.k_tile, v_area = c.vdirect ? 0 : n_ktiles * tile;
    total = k_area + v_area + (size_t)c.n_threads * job.scratch_floats;
    if ((st = stria__ws_floats(2.0 * (double)n_ktiles * (double)tile, total, &ws, fn)) != STRIA_OK)
        goto out;
    job.k_packed = ws.ptr;
    job.v_packed = job.k_packed + k_area;
    job.scratch = job.v_packed + v_area;
    if (!c.kdirect || !c.vdirect)
        stria_pool_run(params->pool, n_ktiles, stria__fwd_pack_task, &job);
    stria_pool_run(params->pool, (size_t)(c.B * c.H * c.nqt), stria__fwd_task, &job);
    st = STRIA_OK;
out:
    stria__ws_put(&ws);
    stria__ctx_free(&c);
    return st;
}

stria_status_t stria_attn_fwd(const stria_attn_params_t *params, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *o, float *lse, bool accumulate)
{
    static const char fn[] = "stria_attn_fwd";
    stria_status_t st = stria__validate_fwd(params, q, k, v, o, lse, fn);
    if (st != STRIA_OK)
        return st;
    return stria__fwd_run(params, q, NULL, k, v, o, lse, accumulate, fn);
}

/* Whether a block's params p match, in every query-side field, those a pass
 * was begun with (b). */
static stria_status_t stria__same_query(const stria_attn_params_t *b, const stria_attn_params_t *p,
                                        const char *fn)
{
    const char *what = NULL;
    if (p->batch != b->batch)
        what = "batch";
    else if (p->q_tokens != b->q_tokens)
        what = "q_tokens";
    else if (p->heads != b->heads)
        what = "heads";
    else if (p->kv_heads != b->kv_heads)
        what = "kv_heads";
    else if (p->head_dim != b->head_dim)
        what = "head_dim";
    else if (stria__attn_scale(p) != stria__attn_scale(b))
        what = "scale";
    else if (p->causal != b->causal)
        what = "causal";
    else if (p->pool != b->pool)
        what = "pool";
    else if (p->q_pos.n_runs != b->q_pos.n_runs ||
             (b->q_pos.n_runs > 0 &&
              memcmp(p->q_pos.runs, b->q_pos.runs, b->q_pos.n_runs * sizeof(stria_pos_run_t)) != 0))
        what = "q_pos";
    if (what != NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: params.%s differs from the one the pass was begun with", fn,
                               what);
    return STRIA_OK;
}

/* ---- forward pass ---------------------------------------------------------- */

struct stria_attn_fwd_pass {
    stria_attn_params_t p;   /* the query side of begin's params (kv fields unused) */
    stria_pos_run_t *q_runs; /* copy of p.q_pos.runs */
    stria_tensor_t q;        /* view (its data is packed at begin) */
    stria__ws_t ws;
    float *q_packed; /* [B][H][nqt] tiles of q_tile floats */
    size_t q_tile;
};

typedef struct {
    stria__ctx_t *c;
    const stria_tensor_t *q;
    float *q_packed, *scratch; /* scratch: BQ * Dp floats per thread */
    size_t q_tile;
} stria__fwd_begin_job_t;

static void stria__fwd_begin_task(void *arg, size_t task, int thread)
{
    stria__fwd_begin_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__qtask_t tk = stria__qtask(c->nqt, c->H, task);
    int64_t qt = tk.qt, h = tk.h, b = tk.b;
    int64_t q0 = qt * STRIA__BQ;
    float *tmp = job->scratch + (size_t)thread * (size_t)(STRIA__BQ * c->Dp);
    stria__pack_qside(c, job->q, b, h, q0, stria__tile_len(c->Tq, q0, STRIA__BQ), NULL, tmp,
                      job->q_packed + task * job->q_tile);
}

/* The pass's params with a one-token K/V block, for a context that only
 * needs the query side. */
static stria_attn_params_t stria__query_side(const stria_attn_params_t *p)
{
    stria_attn_params_t a = *p;
    a.kv_tokens = 1;
    a.kv_pos.runs = NULL;
    a.kv_pos.n_runs = 0;
    return a;
}

/* Checks the arguments a pass's begin shares: params (the key side unused)
 * and q. */
static stria_status_t stria__pass_check(const stria_attn_params_t *params, const stria_tensor_t *q,
                                        const char *fn)
{
    stria_attn_params_t a;
    stria_status_t st;
    if (params == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: params is NULL", fn);
    a = stria__query_side(params);
    if ((st = stria__validate_shape(&a, fn)) != STRIA_OK)
        return st;
    return stria__validate_tensor(q, fn, "q", a.q_tokens, a.heads, a.head_dim, false);
}

/* The query side a pass keeps from begin's params: a copy whose q_pos runs
 * are the pass's own (*runs, freed by the pass). */
static stria_status_t stria__pass_query(const stria_attn_params_t *params, stria_attn_params_t *p,
                                        stria_pos_run_t **runs, const char *fn)
{
    *p = *params;
    *runs = NULL;
    if (params->q_pos.n_runs > 0) {
        *runs = malloc(params->q_pos.n_runs * sizeof(stria_pos_run_t));
        if (*runs == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
        memcpy(*runs, params->q_pos.runs, params->q_pos.n_runs * sizeof(stria_pos_run_t));
    }
    p->q_pos.runs = *runs;
    return STRIA_OK;
}

stria_status_t stria_attn_fwd_begin(const stria_attn_params_t *params, const stria_tensor_t *q,
                                    stria_attn_fwd_pass_t **out)
{
    static const char fn[] = "stria_attn_fwd_begin";
    stria_attn_fwd_pass_t *pass;
    stria__fwd_begin_job_t job;
    stria_attn_params_t a;
    stria__ctx_t c;
    stria_status_t st;
    size_t n_q, total;

    if (out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: pass is NULL", fn);
    *out = NULL;
    if ((st = stria__pass_check(params, q, fn)) != STRIA_OK)
        return st;
    a = stria__query_side(params);
    if ((pass = calloc(1, sizeof(*pass))) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
    pass->q = *q;
    if ((st = stria__pass_query(params, &pass->p, &pass->q_runs, fn)) != STRIA_OK ||
        (st = stria__ctx_init(&c, &a, fn)) != STRIA_OK) {
        free(pass->q_runs);
        free(pass);
        return st;
    }
    stria__ctx_set_dtype(&c, q->dtype);
    n_q = (size_t)(c.B * c.H * c.nqt);
    pass->q_tile = stria__score_tile_floats(&c, (size_t)c.Dp * STRIA__BQ);
    total = n_q * pass->q_tile + (size_t)c.n_threads * (size_t)(STRIA__BQ * c.Dp);
    if ((st = stria__ws_floats((double)n_q * (double)pass->q_tile, total, &pass->ws, fn)) !=
        STRIA_OK) {
        stria__ctx_free(&c);
        free(pass->q_runs);
        free(pass);
        return st;
    }
    pass->q_packed = pass->ws.ptr;
    job.c = &c;
    job.q = q;
    job.q_packed = pass->q_packed;
    job.q_tile = pass->q_tile;
    job.scratch = pass->q_packed + n_q * pass->q_tile;
    stria_pool_run(params->pool, n_q, stria__fwd_begin_task, &job);
    stria__ctx_free(&c);
    *out = pass;
    return STRIA_OK;
}

stria_status_t stria_attn_fwd_block(stria_attn_fwd_pass_t *pass, const stria_attn_params_t *params,
                                    const stria_tensor_t *k, const stria_tensor_t *v,
                                    const stria_tensor_t *o, float *lse, bool accumulate)
{
    static const char fn[] = "stria_attn_fwd_block";
    stria_status_t st;

    if (pass == NULL || params == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: %s is NULL", fn,
                               pass == NULL ? "pass" : "params");
    if ((st = stria__same_query(&pass->p, params, fn)) != STRIA_OK ||
        (st = stria__validate_fwd(params, &pass->q, k, v, o, lse, fn)) != STRIA_OK)
        return st;
    return stria__fwd_run(params, &pass->q, pass->q_packed, k, v, o, lse, accumulate, fn);
}

void stria_attn_fwd_end(stria_attn_fwd_pass_t *pass)
{
    if (pass == NULL)
        return;
    stria__ws_put(&pass->ws);
    free(pass->q_runs);
    free(pass);
}

/* ---- init, merge, finalize, delta --------------------------------------- */

stria_status_t stria_attn_partial_init(const stria_attn_params_t *params, const stria_tensor_t *o,
                                       float *lse)
{
    static const char fn[] = "stria_attn_partial_init";
    stria_status_t st = stria__validate_rows(params, fn);
    if (st != STRIA_OK)
        return st;
    st =
        stria__validate_tensor(o, fn, "o", params->q_tokens, params->heads, params->head_dim, true);
    if (st != STRIA_OK)
        return st;
    if (lse == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: lse is NULL", fn);
    for (int64_t b = 0; b < params->batch; b++)
        for (int64_t t = 0; t < params->q_tokens; t++)
            for (int64_t h = 0; h < params->heads; h++)
                memset(stria__row_ptr(o, b, t, h), 0, (size_t)params->head_dim * sizeof(float));
    for (int64_t i = 0; i < params->batch * params->heads * params->q_tokens; i++)
        lse[i] = -INFINITY;
    return STRIA_OK;
}

stria_status_t stria_attn_merge(const stria_attn_params_t *params, const stria_tensor_t *o_a,
                                float *lse_a, const stria_tensor_t *o_b, const float *lse_b)
{
    static const char fn[] = "stria_attn_merge";
    const stria_attn_params_t *p = params;
    stria_status_t st = stria__validate_rows(params, fn);
    if (st != STRIA_OK)
        return st;
    if ((st = stria__validate_tensor(o_a, fn, "o_a", p->q_tokens, p->heads, p->head_dim, true)) !=
            STRIA_OK ||
        (st = stria__validate_tensor(o_b, fn, "o_b", p->q_tokens, p->heads, p->head_dim, true)) !=
            STRIA_OK)
        return st;
    if (lse_a == NULL || lse_b == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: lse is NULL", fn);
    const stria_kern_ops_t *ops = stria__kern_ops();
    if (ops == NULL)
        return stria__kern_ops_status(); /* message set by stria__kern_ops() */
    for (int64_t b = 0; b < p->batch; b++)
        for (int64_t h = 0; h < p->heads; h++)
            for (int64_t t = 0; t < p->q_tokens; t++) {
                size_t li = (size_t)((b * p->heads + h) * p->q_tokens + t);
                stria__merge_row(ops, (float *)stria__row_ptr(o_a, b, t, h), &lse_a[li],
                                 (const float *)stria__row_ptr(o_b, b, t, h), 1.0f, lse_b[li],
                                 p->head_dim);
            }
    return STRIA_OK;
}

stria_status_t stria_attn_finalize(const stria_attn_params_t *params, const stria_tensor_t *o_part,
                                   const stria_tensor_t *o_out)
{
    static const char fn[] = "stria_attn_finalize";
    const stria_attn_params_t *p = params;
    stria_status_t st = stria__validate_rows(params, fn);
    if (st != STRIA_OK)
        return st;
    if ((st = stria__validate_tensor(o_part, fn, "o_part", p->q_tokens, p->heads, p->head_dim,
                                     true)) != STRIA_OK ||
        (st = stria__validate_tensor(o_out, fn, "o_out", p->q_tokens, p->heads, p->head_dim,
                                     false)) != STRIA_OK)
        return st;
    for (int64_t b = 0; b < p->batch; b++)
        for (int64_t t = 0; t < p->q_tokens; t++)
            for (int64_t h = 0; h < p->heads; h++)
                stria_dtype_convert(STRIA_DTYPE_F32, stria__row_ptr(o_part, b, t, h), o_out->dtype,
                                    stria__row_ptr(o_out, b, t, h), (size_t)p->head_dim);
    return STRIA_OK;
}

typedef struct {
    const stria_kern_ops_t *ops;
    const stria_attn_params_t *p;
    const stria_tensor_t *o, *d_o;
    float *delta;
} stria__delta_job_t;

/* D of one (batch, head) for all its tokens. */
static void stria__delta_task(void *arg, size_t task, int thread)
{
    stria__delta_job_t *job = arg;
    const stria_attn_params_t *p = job->p;
    int64_t h = (int64_t)task % p->heads, b = (int64_t)task / p->heads;
    int n = (int)p->head_dim;
    float orow[STRIA_HEAD_DIM_MAX], grow[STRIA_HEAD_DIM_MAX];

    (void)thread;
    for (int64_t t = 0; t < p->q_tokens; t++) {
        float acc[8] = {0};
        job->ops->row_load(job->o->dtype, stria__row_ptr(job->o, b, t, h), orow, n);
        job->ops->row_load(job->d_o->dtype, stria__row_ptr(job->d_o, b, t, h), grow, n);
        for (int d = 0; d < n; d += 8) /* head_dim is a multiple of 8 */
            for (int j = 0; j < 8; j++)
                acc[j] += orow[d + j] * grow[d + j];
        job->delta[(b * p->heads + h) * p->q_tokens + t] =
            ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
}

stria_status_t stria_attn_bwd_delta(const stria_attn_params_t *params, const stria_tensor_t *o,
                                    const stria_tensor_t *d_o, float *delta)
{
    static const char fn[] = "stria_attn_bwd_delta";
    const stria_attn_params_t *p = params;
    stria__delta_job_t job;
    stria_status_t st = stria__validate_rows(params, fn);
    if (st != STRIA_OK)
        return st;
    if ((st = stria__validate_tensor(o, fn, "o", p->q_tokens, p->heads, p->head_dim, false)) !=
            STRIA_OK ||
        (st = stria__validate_tensor(d_o, fn, "d_o", p->q_tokens, p->heads, p->head_dim, false)) !=
            STRIA_OK)
        return st;
    if (delta == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: delta is NULL", fn);
    job.ops = stria__kern_ops();
    if (job.ops == NULL)
        return stria__kern_ops_status(); /* message set by stria__kern_ops() */
    job.p = p;
    job.o = o;
    job.d_o = d_o;
    job.delta = delta;
    stria_pool_run(p->pool, (size_t)(p->batch * p->heads), stria__delta_task, &job);
    return STRIA_OK;
}

/* ---- backward ---------------------------------------------------------- */

/* Most threads for which the backward pass keeps one dQ copy per thread. */
#define STRIA__BWD_MAX_DQ_COPIES 8
/* Key tiles a backward task walks together: each query-side tile (Q, Q^T,
 * dO, dO^T, dQ) it loads serves this many key tiles while in cache, instead
 * of being streamed again for every key tile. Their K, V, dK and dV stay in
 * L2 (4 x 128 KiB at head_dim 128). */
#define STRIA__BWD_KBLOCK_MAX 4

static int stria__bwd_kblock(int64_t Dp)
{
    return Dp <= 128 ? STRIA__BWD_KBLOCK_MAX : STRIA__BWD_KBLOCK_MAX / 2;
}

typedef struct {
    stria__ctx_t *c;
    const stria_tensor_t *q, *k, *v, *d_o, *dq, *dk, *dv;
    const float *lse, *delta;
    /* fp32 rows, [B][H][nqt][BQ][Dp] and [B][Hkv][nkt][BK][Dp] (k_packed:
     * unless kin) */
    float *q_packed, *do_packed, *k_packed;
    /* score operands, fp32 or bf16 (q_stile / k_stile floats per tile):
     * Q^T, dO^T [B][H][nqt][Dp][BQ]; K, V rows [B][Hkv][nkt][BK][Dp]
     * (ks_packed: bf16 K unless read in place, fp32 K uses its rows;
     * v_packed: unless read in place) */
    float *qt_packed, *dot_packed, *ks_packed, *v_packed;
    size_t q_stile, k_stile;
    float *dq_packed; /* [n_dq][B][H][nqt][BQ][Dp] dQ accumulators */
    int n_dq;         /* copies of the dQ accumulators (one per thread in mode C) */
    size_t dq_floats; /* floats per copy */
    float *scratch;   /* per thread */
    size_t scratch_floats;
    int kblock;  /* key tiles per task (stria__bwd_kblock) */
    int64_t nkb; /* key-tile blocks per kv head */
    bool kin;    /* fp32 K rows read in place (k_packed unused) */
} stria__bwd_job_t;

static void stria__bwd_add_rows(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b,
                                int64_t h, int64_t t0, int n, const float *src)
{
    for (int i = 0; i < n; i++) {
        stria__prefetch_ahead(t, b, h, t0, i, n, c->D, 1);
        c->ops->row_acc((float *)stria__row_ptr(t, b, t0 + i, h), src + (size_t)i * (size_t)c->Dp,
                        (int)c->D);
    }
}

static void stria__bwd_pack_q_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__qtask_t tk = stria__qtask(c->nqt, c->H, task);
    int64_t qt = tk.qt, h = tk.h, b = tk.b;
    int64_t q0 = qt * STRIA__BQ;
    int n = stria__tile_len(c->Tq, q0, STRIA__BQ);
    size_t tile = (size_t)STRIA__BQ * (size_t)c->Dp;
    float *qp = job->q_packed + task * tile, *dop = job->do_packed + task * tile;
    float *tmp = job->dq_packed + task * tile; /* zeroed below */

    (void)thread;
    stria__pack_qside(c, job->q, b, h, q0, n, qp, tmp, job->qt_packed + task * job->q_stile);
    stria__pack_qside(c, job->d_o, b, h, q0, n, dop, tmp, job->dot_packed + task * job->q_stile);
    for (int i = 0; i < job->n_dq; i++)
        memset(job->dq_packed + (size_t)i * job->dq_floats + task * tile, 0, tile * sizeof(float));
}

/* Adds the dQ accumulators of one query tile to the caller's dq. */
static void stria__bwd_unpack_dq_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__qtask_t tk = stria__qtask(c->nqt, c->H, task);
    int64_t qt = tk.qt, h = tk.h, b = tk.b;
    int64_t q0 = qt * STRIA__BQ;
    size_t tile = (size_t)STRIA__BQ * (size_t)c->Dp;

    (void)thread;
    for (int i = 0; i < job->n_dq; i++)
        stria__bwd_add_rows(c, job->dq, b, h, q0, stria__tile_len(c->Tq, q0, STRIA__BQ),
                            job->dq_packed + (size_t)i * job->dq_floats + task * tile);
}

static void stria__bwd_pack_k_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    int64_t kt = (int64_t)task % c->nkt;
    int64_t hk = ((int64_t)task / c->nkt) % c->Hkv;
    int64_t b = (int64_t)task / c->nkt / c->Hkv;
    int64_t k0 = kt * STRIA__BK;
    int n = stria__tile_len(c->Tk, k0, STRIA__BK);
    size_t tile = (size_t)STRIA__BK * (size_t)c->Dp;

    (void)thread;
    if (!job->kin)
        stria__pack_rows(c, job->k, b, hk, k0, n, STRIA__BK, job->k_packed + task * tile);
    if (c->bf16 && !c->kdirect)
        stria__pack_kside(c, job->k, b, hk, k0, n, job->ks_packed + task * job->k_stile);
    if (!c->kdirect)
        stria__pack_kside(c, job->v, b, hk, k0, n, job->v_packed + task * job->k_stile);
}

/* Per-thread scratch of the backward pass. */
typedef struct {
    float *pt;    /* [BK][BQ] P^T */
    float *dst;   /* [BK][BQ] dP^T, then dS^T * scale */
    float *dk;    /* [kblock][BK][Dp] */
    float *dv;    /* [kblock][BK][Dp] */
    float *lse;   /* [BQ] LSE of the query tile, +inf for rows without keys */
    float *delta; /* [BQ] */
} stria__bwd_scratch_t;

static stria__bwd_scratch_t stria__bwd_scratch(stria__bwd_job_t *job, int thread)
{
    stria__bwd_scratch_t s;
    int64_t Dp = job->c->Dp;
    s.pt = job->scratch + (size_t)thread * job->scratch_floats;
    s.dst = s.pt + STRIA__BQ * STRIA__BK;
    s.dk = s.dst + STRIA__BQ * STRIA__BK;
    s.dv = s.dk + (size_t)job->kblock * STRIA__BK * (size_t)Dp;
    s.lse = s.dv + (size_t)job->kblock * STRIA__BK * (size_t)Dp;
    s.delta = s.lse + STRIA__BQ;
    return s;
}

/* LSE and D of query tile qt of head h into the scratch. A row that saw no key
 * gets LSE = +inf so that its probabilities come out as exp(-inf) = 0; padding
 * rows likewise. */
static void stria__bwd_load_stats(stria__bwd_job_t *job, stria__bwd_scratch_t *s, int64_t b,
                                  int64_t h, int64_t qt)
{
    stria__ctx_t *c = job->c;
    int64_t q0 = qt * STRIA__BQ;
    int bq = stria__tile_len(c->Tq, q0, STRIA__BQ);
    const float *lse = job->lse + (size_t)((b * c->H + h) * c->Tq + q0);
    const float *delta = job->delta + (size_t)((b * c->H + h) * c->Tq + q0);
    for (int i = 0; i < STRIA__BQ; i++) {
        s->lse[i] = i < bq && lse[i] != -INFINITY ? lse[i] : INFINITY;
        s->delta[i] = i < bq ? delta[i] : 0.0f;
    }
}

/* A straddling tile pair of the backward pass (see stria__bwd_tile), by
 * sub-blocks (stria__plan): P^T, dP^T, dS^T and dQ for the computed key rows
 * of each query chunk, then dV and dK of each key sub-block over the runs of
 * query chunks that computed it. Skipped sub-blocks hold P = dS = 0 and would
 * add nothing. dq: this query tile's dQ accumulator (NULL: no dQ). */
static void stria__bwd_partial(const stria__ctx_t *c, stria__bwd_scratch_t *s, int64_t qt,
                               int64_t kt, const float *qp, const float *qtp, const float *dop,
                               const float *dotp, stria__kop_t kp, stria__kop_t ksp,
                               stria__kop_t vp, float *dk, float *dv, float *dq)
{
    const stria_kern_ops_t *ops = c->ops;
    const int64_t Dp = c->Dp;
    stria__plan_t pl;

    stria__plan(c, qt, kt, &pl);
    stria__score_gemm_plan(c, &pl, ksp, qtp, s->pt);
    stria__score_gemm_plan(c, &pl, vp, dotp, s->dst);
    for (int qc = 0; qc < pl.nqc; qc++) {
        const int i0 = qc * STRIA__SB, ni = stria__plan_chunk(&pl, qc);
        const int klo = pl.klo[qc], nk = pl.khi[qc] - pl.klo[qc];
        const size_t off = (size_t)klo * STRIA__BQ + (size_t)i0;
        if (nk == 0)
            continue;
        stria__mask_chunk(c, &pl, s->pt, qc);
        ops->softmax_bwd_p(s->pt + off, nk, STRIA__SB, STRIA__BQ, c->scale, s->lse + i0);
        ops->softmax_bwd_ds(s->pt + off, s->dst + off, nk, STRIA__SB, STRIA__BQ, s->delta + i0,
                            c->scale);
        if (dq != NULL)
            ops->gemm(ni, (int)Dp, nk, s->dst + off, STRIA__BQ, true, kp.p + klo * kp.ld, kp.ld,
                      dq + (size_t)i0 * (size_t)Dp, Dp, NULL, true);
    }
    if (dk == NULL)
        return;
    for (int kb = 0; kb < pl.nkc; kb++) {
        const int j0 = kb * STRIA__SB, nj = pl.bk - j0 < STRIA__SB ? pl.bk - j0 : STRIA__SB;
        const size_t jo = (size_t)j0 * (size_t)Dp;
        int qc = 0;
        while (qc < pl.nqc) {
            if (!stria__plan_has(&pl, kb, qc)) {
                qc++;
                continue;
            }
            int qa = qc;
            while (qc < pl.nqc && stria__plan_has(&pl, kb, qc))
                qc++;
            /* queries [i0, i1) of the run of chunks [qa, qc) */
            int i0 = qa * STRIA__SB, i1 = qc * STRIA__SB < pl.bq ? qc * STRIA__SB : pl.bq;
            size_t off = (size_t)j0 * STRIA__BQ + (size_t)i0;
            ops->gemm(nj, (int)Dp, i1 - i0, s->pt + off, STRIA__BQ, false,
                      dop + (size_t)i0 * (size_t)Dp, Dp, dv + jo, Dp, NULL, true);
            ops->gemm(nj, (int)Dp, i1 - i0, s->dst + off, STRIA__BQ, false,
                      qp + (size_t)i0 * (size_t)Dp, Dp, dk + jo, Dp, NULL, true);
        }
    }
}

/* One (query tile, key tile) pair of head h, transposed: recomputes P^T, then
 * accumulates dV and dK of the key tile into dv, dk (NULL: not wanted) and dQ
 * of the query tile into its tile of the dQ accumulators dq_acc (one copy of
 * job->dq_packed; NULL: no dQ). The LSE and D of the query tile must be in s
 * (stria__bwd_load_stats). */
static void stria__bwd_tile(stria__bwd_job_t *job, stria__bwd_scratch_t *s, int64_t b, int64_t h,
                            int64_t qt, int64_t kt, int cls, float *dk, float *dv, float *dq_acc)
{
    stria__ctx_t *c = job->c;
    const stria_kern_ops_t *ops = c->ops;
    int64_t hk = h / c->G;
    int64_t Dp = c->Dp;
    int64_t q0 = qt * STRIA__BQ, k0 = kt * STRIA__BK;
    int bq = stria__tile_len(c->Tq, q0, STRIA__BQ);
    int bk = stria__tile_len(c->Tk, k0, STRIA__BK);
    size_t qtile = (size_t)STRIA__BQ * (size_t)Dp, ktile = (size_t)STRIA__BK * (size_t)Dp;
    size_t qidx = (size_t)((b * c->H + h) * c->nqt + qt);
    size_t kidx = (size_t)((b * c->Hkv + hk) * c->nkt + kt);
    const float *qp = job->q_packed + qidx * qtile;
    const float *qtp = job->qt_packed + qidx * job->q_stile;
    const float *dop = job->do_packed + qidx * qtile;
    const float *dotp = job->dot_packed + qidx * job->q_stile;
    /* fp32 K rows (for dQ), in place or packed; in fp32 they are the score
     * operand too */
    stria__kop_t kp = {job->k_packed + kidx * ktile, (ptrdiff_t)Dp};
    if (job->kin)
        kp = (stria__kop_t){(const float *)stria__row_ptr(job->k, b, k0, hk),
                            (ptrdiff_t)job->k->stride_token};
    stria__kop_t ksp =
        c->bf16 ? stria__kside(c, job->k, job->ks_packed, job->k_stile, b, hk, kt) : kp;
    stria__kop_t vp = stria__kside(c, job->v, job->v_packed, job->k_stile, b, hk, kt);

    if (cls == STRIA__TILE_PARTIAL) {
        stria__bwd_partial(c, s, qt, kt, qp, qtp, dop, dotp, kp, ksp, vp, dk, dv,
                           dq_acc != NULL ? dq_acc + qidx * qtile : NULL);
        return;
    }
    /* P^T = exp(scale K Q^T - lse) */
    stria__score_gemm(c, 0, bk, 0, STRIA__BQ, ksp, qtp, s->pt);
    ops->softmax_bwd_p(s->pt, bk, STRIA__BQ, STRIA__BQ, c->scale, s->lse);
    /* dP^T = V dO^T, then dS^T = P^T (dP^T - D) scale */
    stria__score_gemm(c, 0, bk, 0, STRIA__BQ, vp, dotp, s->dst);
    ops->softmax_bwd_ds(s->pt, s->dst, bk, STRIA__BQ, STRIA__BQ, s->delta, c->scale);
    if (dk != NULL) {
        /* dV += P^T dO, dK += dS^T Q */
        ops->gemm(bk, (int)Dp, bq, s->pt, STRIA__BQ, false, dop, Dp, dv, Dp, NULL, true);
        ops->gemm(bk, (int)Dp, bq, s->dst, STRIA__BQ, false, qp, Dp, dk, Dp, NULL, true);
    }
    if (dq_acc != NULL) /* dQ += dS K */
        ops->gemm(bq, (int)Dp, bk, s->dst, STRIA__BQ, true, kp.p, kp.ld, dq_acc + qidx * qtile, Dp,
                  NULL, true);
}

/* dK/dV of key-tile block kb (job->kblock tiles) of kv head hk, over every
 * query head of its group, and dQ contributions into dq_acc (NULL: none). No
 * two concurrent tasks may share a dq_acc unless they own disjoint query rows. */
static void stria__bwd_kblock_run(stria__bwd_job_t *job, stria__bwd_scratch_t *s, int64_t b,
                                  int64_t hk, int64_t kb, float *dq_acc)
{
    stria__ctx_t *c = job->c;
    size_t ktile = (size_t)STRIA__BK * (size_t)c->Dp;
    int64_t kt0 = kb * job->kblock;
    int64_t kt1 = kt0 + job->kblock < c->nkt ? kt0 + job->kblock : c->nkt;

    memset(s->dk, 0, (size_t)(kt1 - kt0) * ktile * sizeof(float));
    memset(s->dv, 0, (size_t)(kt1 - kt0) * ktile * sizeof(float));
    for (int64_t g = 0; g < c->G; g++) {
        int64_t h = hk * c->G + g;
        for (int64_t qt = 0; qt < c->nqt; qt++) {
            bool loaded = false;
            for (int64_t kt = kt0; kt < kt1; kt++) {
                int cls = stria__tile_class(c, qt, kt);
                if (cls == STRIA__TILE_SKIP)
                    continue;
                if (!loaded) {
                    stria__bwd_load_stats(job, s, b, h, qt);
                    loaded = true;
                }
                stria__bwd_tile(job, s, b, h, qt, kt, cls, s->dk + (size_t)(kt - kt0) * ktile,
                                s->dv + (size_t)(kt - kt0) * ktile, dq_acc);
            }
        }
    }
    for (int64_t kt = kt0; kt < kt1; kt++) {
        int64_t k0 = kt * STRIA__BK;
        int bk = stria__tile_len(c->Tk, k0, STRIA__BK);
        stria__bwd_add_rows(c, job->dk, b, hk, k0, bk, s->dk + (size_t)(kt - kt0) * ktile);
        stria__bwd_add_rows(c, job->dv, b, hk, k0, bk, s->dv + (size_t)(kt - kt0) * ktile);
    }
}

/* Mode A: one task per (batch, kv head) computes everything of its group. */
static void stria__bwd_group_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    int64_t hk = (int64_t)task % c->Hkv;
    int64_t b = (int64_t)task / c->Hkv;
    stria__bwd_scratch_t s = stria__bwd_scratch(job, thread);
    for (int64_t kb = 0; kb < job->nkb; kb++)
        stria__bwd_kblock_run(job, &s, b, hk, kb, job->dq_packed);
}

/* Mode C: one task per (batch, kv head, key-tile block) for everything; dQ
 * goes to the executing thread's own copy of the accumulators, summed at the
 * end. */
static void stria__bwd_kblock_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    int64_t kb = (int64_t)task % job->nkb;
    int64_t hk = ((int64_t)task / job->nkb) % c->Hkv;
    int64_t b = (int64_t)task / job->nkb / c->Hkv;
    stria__bwd_scratch_t s = stria__bwd_scratch(job, thread);
    stria__bwd_kblock_run(job, &s, b, hk, kb, job->dq_packed + (size_t)thread * job->dq_floats);
}

/* Mode B, pass 1: one task per (batch, kv head, key-tile block) for dK, dV. */
static void stria__bwd_dkdv_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    int64_t kb = (int64_t)task % job->nkb;
    int64_t hk = ((int64_t)task / job->nkb) % c->Hkv;
    int64_t b = (int64_t)task / job->nkb / c->Hkv;
    stria__bwd_scratch_t s = stria__bwd_scratch(job, thread);
    stria__bwd_kblock_run(job, &s, b, hk, kb, NULL);
}

/* Mode B, pass 2: one task per (batch, head, query tile) for dQ. */
static void stria__bwd_dq_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__qtask_t tk = stria__qtask(c->nqt, c->H, task);
    int64_t qt = tk.qt, h = tk.h, b = tk.b;
    stria__bwd_scratch_t s = stria__bwd_scratch(job, thread);

    stria__bwd_load_stats(job, &s, b, h, qt);
    for (int64_t kt = 0; kt < c->nkt; kt++) {
        int cls = stria__tile_class(c, qt, kt);
        if (cls != STRIA__TILE_SKIP)
            stria__bwd_tile(job, &s, b, h, qt, kt, cls, NULL, NULL, job->dq_packed);
    }
}

/* A backward pass over several K/V blocks: the query side, packed once. */
struct stria_attn_bwd_pass {
    stria_attn_params_t p;    /* the query side of begin's params (kv fields unused) */
    stria_pos_run_t *q_runs;  /* copy of p.q_pos.runs */
    stria_tensor_t q, d_o;    /* views (their data is packed at begin) */
    const float *lse, *delta; /* read by every block */
    stria_pool_t *pool;
    char mode; /* schedule (stria__bwd_blocks) */
    int n_dq;  /* copies of the dQ accumulators */
    stria__ws_t ws;
    float *q_packed, *do_packed, *qt_packed, *dot_packed, *dq_packed;
    size_t q_stile, dq_floats, n_q;
};

/* The pass's params with a one-token K/V block, for a context that only
 * needs the query side. */
static stria_attn_params_t stria__bwd_pass_params(const stria_attn_bwd_pass_t *pass)
{
    stria_attn_params_t a = stria__query_side(&pass->p);
    a.pool = pass->pool;
    return a;
}

/* Points the query-side fields of job at the pass. */
static void stria__bwd_job_from_pass(stria__bwd_job_t *job, stria__ctx_t *c,
                                     const stria_attn_bwd_pass_t *pass)
{
    memset(job, 0, sizeof(*job));
    job->c = c;
    job->q = &pass->q;
    job->d_o = &pass->d_o;
    job->lse = pass->lse;
    job->delta = pass->delta;
    job->q_packed = pass->q_packed;
    job->do_packed = pass->do_packed;
    job->qt_packed = pass->qt_packed;
    job->dot_packed = pass->dot_packed;
    job->dq_packed = pass->dq_packed;
    job->q_stile = pass->q_stile;
    job->n_dq = pass->n_dq;
    job->dq_floats = pass->dq_floats;
    job->kblock = stria__bwd_kblock(c->Dp);
}

static stria_status_t stria__bwd_begin(const stria_attn_params_t *params, const stria_tensor_t *q,
                                       const stria_tensor_t *d_o, const float *lse,
                                       const float *delta, const char *fn,
                                       stria_attn_bwd_pass_t **out)
{
    stria_attn_bwd_pass_t *pass = calloc(1, sizeof(*pass));
    stria_attn_params_t a;
    stria__bwd_job_t job;
    stria__ctx_t c;
    stria_status_t st;
    size_t qtile, n_groups;
    int n_threads;

    *out = NULL;
    if (pass == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
    pass->q = *q;
    pass->d_o = *d_o;
    pass->lse = lse;
    pass->delta = delta;
    pass->pool = params->pool;
    if ((st = stria__pass_query(params, &pass->p, &pass->q_runs, fn)) == STRIA_OK) {
        a = stria__bwd_pass_params(pass);
        st = stria__ctx_init(&c, &a, fn);
    }
    if (st != STRIA_OK) {
        free(pass->q_runs);
        free(pass);
        return st;
    }
    stria__ctx_set_dtype(&c, q->dtype);
    n_threads = c.n_threads;
    /* Schedules: mode A, one task per (batch, kv head), needs nothing extra
     * but balances only with enough groups per thread. Mode C, one task per
     * (batch, kv head, key tile) with a dQ copy per thread, balances at any
     * shape for the price of zeroing and summing the copies: used for a few
     * threads. Mode B splits key tiles for dK/dV and query tiles for dQ,
     * recomputing P once more: for many threads and few groups. */
    n_groups = (size_t)(c.B * c.Hkv);
    if (n_threads == 1)
        pass->mode = 'A';
    else if (n_threads <= STRIA__BWD_MAX_DQ_COPIES)
        pass->mode = 'C';
    else if (n_groups >= 4 * (size_t)n_threads ||
             (n_groups >= (size_t)n_threads && n_groups % (size_t)n_threads == 0))
        pass->mode = 'A';
    else
        pass->mode = 'B';
    pass->n_dq = pass->mode == 'C' ? n_threads : 1;
    qtile = (size_t)STRIA__BQ * (size_t)c.Dp;
    pass->n_q = (size_t)(c.B * c.H * c.nqt);
    pass->q_stile = stria__score_tile_floats(&c, qtile);
    pass->dq_floats = pass->n_q * qtile;
    size_t total = (2 + (size_t)pass->n_dq) * pass->n_q * qtile + 2 * pass->n_q * pass->q_stile;
    if ((st = stria__ws_floats((6.0 + pass->n_dq) * (double)pass->n_q * (double)qtile, total,
                               &pass->ws, fn)) != STRIA_OK) {
        stria__ctx_free(&c);
        free(pass->q_runs);
        free(pass);
        return st;
    }
    /* every part is a multiple of 16 floats: 64-byte aligned like the buffer */
    pass->q_packed = pass->ws.ptr;
    pass->do_packed = pass->q_packed + pass->n_q * qtile;
    pass->dq_packed = pass->do_packed + pass->n_q * qtile;
    pass->qt_packed = pass->dq_packed + (size_t)pass->n_dq * pass->dq_floats;
    pass->dot_packed = pass->qt_packed + pass->n_q * pass->q_stile;
    stria__bwd_job_from_pass(&job, &c, pass);
    stria_pool_run(pass->pool, pass->n_q, stria__bwd_pack_q_task, &job);
    stria__ctx_free(&c);
    *out = pass;
    return STRIA_OK;
}

static stria_status_t stria__bwd_block(stria_attn_bwd_pass_t *pass,
                                       const stria_attn_params_t *params, const stria_tensor_t *k,
                                       const stria_tensor_t *v, const stria_tensor_t *dk,
                                       const stria_tensor_t *dv, const char *fn)
{
    stria_attn_params_t a = *params;
    stria__bwd_job_t job;
    stria__ctx_t c;
    stria_status_t st;
    size_t ktile, n_k, total;
    stria__ws_t ws = {0};

    a.q_pos = pass->p.q_pos;
    a.pool = pass->pool;
    st = stria__ctx_init(&c, &a, fn);
    if (st != STRIA_OK)
        return st;
    stria__ctx_set_dtype(&c, pass->q.dtype);
    stria__bwd_job_from_pass(&job, &c, pass);
    job.k = k;
    job.v = v;
    job.dk = dk;
    job.dv = dv;
    ktile = (size_t)STRIA__BK * (size_t)c.Dp;
    n_k = (size_t)(c.B * c.Hkv * c.nkt);
    job.k_stile = stria__score_tile_floats(&c, ktile);
    job.nkb = (c.nkt + job.kblock - 1) / job.kblock;
    job.scratch_floats = (size_t)(2 * STRIA__BQ * STRIA__BK +
                                  2 * (int64_t)job.kblock * STRIA__BK * c.Dp + 2 * STRIA__BQ);
    job.scratch_floats = (size_t)stria__round_up((int64_t)job.scratch_floats, 16);
    /* operands read in place need no packed tiles; fp32 K rows only when a
     * head's rows are adjacent (a token stride apart, the dQ product runs
     * slower than on packed tiles) */
    job.kin = c.kdirect && !c.bf16 && k->stride_token == c.D;
    size_t k_area = job.kin ? 0 : n_k * ktile, v_area = c.kdirect ? 0 : n_k * job.k_stile;
    size_t ks_area = c.bf16 && !c.kdirect ? n_k * job.k_stile : 0;
    total = k_area + v_area + ks_area + (size_t)c.n_threads * job.scratch_floats;
    if ((st = stria__ws_floats(3.0 * (double)n_k * (double)ktile, total, &ws, fn)) != STRIA_OK)
        goto out;
    job.k_packed = ws.ptr;
    job.v_packed = job.k_packed + k_area;
    job.ks_packed = job.v_packed + v_area;
    job.scratch = job.ks_packed + ks_area;
    if (!job.kin || !c.kdirect)
        stria_pool_run(pass->pool, n_k, stria__bwd_pack_k_task, &job);
    if (pass->mode == 'A') {
        stria_pool_run(pass->pool, (size_t)(c.B * c.Hkv), stria__bwd_group_task, &job);
    } else if (pass->mode == 'C') {
        stria_pool_run(pass->pool, (size_t)(c.B * c.Hkv * job.nkb), stria__bwd_kblock_task, &job);
    } else {
        stria_pool_run(pass->pool, (size_t)(c.B * c.Hkv * job.nkb), stria__bwd_dkdv_task, &job);
        stria_pool_run(pass->pool, pass->n_q, stria__bwd_dq_task, &job);
    }
    st = STRIA_OK;
out:
    stria__ws_put(&ws);
    stria__ctx_free(&c);
    return st;
}

static void stria__bwd_free(stria_attn_bwd_pass_t *pass)
{
    stria__ws_put(&pass->ws);
    free(pass->q_runs);
    free(pass);
}

static stria_status_t stria__bwd_end(stria_attn_bwd_pass_t *pass, const stria_tensor_t *dq,
                                     const char *fn)
{
    stria_attn_params_t a = stria__bwd_pass_params(pass);
    stria__bwd_job_t job;
    stria__ctx_t c;
    stria_status_t st = stria__ctx_init(&c, &a, fn);
    if (st == STRIA_OK) {
        stria__ctx_set_dtype(&c, pass->q.dtype);
        stria__bwd_job_from_pass(&job, &c, pass);
        job.dq = dq;
        stria_pool_run(pass->pool, pass->n_q, stria__bwd_unpack_dq_task, &job);
        stria__ctx_free(&c);
    }
    stria__bwd_free(pass);
    return st;
}

/* Whether the query side of params is the one the pass was begun with. */

stria_status_t stria_attn_bwd_begin(const stria_attn_params_t *params, const stria_tensor_t *q,
                                    const stria_tensor_t *d_o, const float *lse, const float *delta,
                                    stria_attn_bwd_pass_t **pass)
{
    static const char fn[] = "stria_attn_bwd_begin";
    stria_attn_params_t a;
    stria_status_t st;

    if (pass == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: pass is NULL", fn);
    *pass = NULL;
    if ((st = stria__pass_check(params, q, fn)) != STRIA_OK)
        return st;
    a = stria__query_side(params);
    if ((st = stria__validate_tensor(d_o, fn, "d_o", a.q_tokens, a.heads, a.head_dim, false)) !=
        STRIA_OK)
        return st;
    if (d_o->dtype != q->dtype)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: q and d_o must share one dtype (q=%s d_o=%s)", fn,
                               stria_dtype_name(q->dtype), stria_dtype_name(d_o->dtype));
    if (lse == NULL || delta == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: %s is NULL", fn,
                               lse == NULL ? "lse" : "delta");
    return stria__bwd_begin(&a, q, d_o, lse, delta, fn, pass);
}

stria_status_t stria_attn_bwd_block(stria_attn_bwd_pass_t *pass, const stria_attn_params_t *params,
                                    const stria_tensor_t *k, const stria_tensor_t *v,
                                    const stria_tensor_t *dk, const stria_tensor_t *dv)
{
    static const char fn[] = "stria_attn_bwd_block";
    stria_status_t st;

    if (pass == NULL || params == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: %s is NULL", fn,
                               pass == NULL ? "pass" : "params");
    if ((st = stria__validate_shape(params, fn)) != STRIA_OK ||
        (st = stria__same_query(&pass->p, params, fn)) != STRIA_OK ||
        (st = stria__validate_tensor(k, fn, "k", params->kv_tokens, params->kv_heads,
                                     params->head_dim, false)) != STRIA_OK ||
        (st = stria__validate_tensor(v, fn, "v", params->kv_tokens, params->kv_heads,
                                     params->head_dim, false)) != STRIA_OK ||
        (st = stria__validate_tensor(dk, fn, "dk", params->kv_tokens, params->kv_heads,
                                     params->head_dim, true)) != STRIA_OK ||
        (st = stria__validate_tensor(dv, fn, "dv", params->kv_tokens, params->kv_heads,
                                     params->head_dim, true)) != STRIA_OK)
        return st;
    if (k->dtype != pass->q.dtype || v->dtype != pass->q.dtype)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: k and v must have the dtype of q (q=%s k=%s v=%s)", fn,
                               stria_dtype_name(pass->q.dtype), stria_dtype_name(k->dtype),
                               stria_dtype_name(v->dtype));
    if (dk->data == dv->data)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: dk and dv must not alias", fn);
    return stria__bwd_block(pass, params, k, v, dk, dv, fn);
}

stria_status_t stria_attn_bwd_end(stria_attn_bwd_pass_t *pass, const stria_tensor_t *dq)
{
    static const char fn[] = "stria_attn_bwd_end";
    stria_status_t st;

    if (pass == NULL)
        return STRIA_OK;
    if (dq == NULL) {
        stria__bwd_free(pass);
        return STRIA_OK;
    }
    st = stria__validate_tensor(dq, fn, "dq", pass->p.q_tokens, pass->p.heads, pass->p.head_dim,
                                true);
    if (st != STRIA_OK) {
        stria__bwd_free(pass);
        return st;
    }
    return stria__bwd_end(pass, dq, fn);
}

stria_status_t stria_attn_bwd(const stria_attn_params_t *params, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *d_o, const float *lse, const float *delta,
                              const stria_tensor_t *dq, const stria_tensor_t *dk,
                              const stria_tensor_t *dv)
{
    static const char fn[] = "stria_attn_bwd";
    stria_attn_bwd_pass_t *pass;
    stria_status_t st;

    st = stria__validate_bwd(params, q, k, v, d_o, lse, delta, dq, dk, dv, fn);
    if (st != STRIA_OK)
        return st;
    st = stria__bwd_begin(params, q, d_o, lse, delta, fn, &pass);
    if (st != STRIA_OK)
        return st;
    st = stria__bwd_block(pass, params, k, v, dk, dv, fn);
    if (st != STRIA_OK) {
        stria__bwd_free(pass);
        return st;
    }
    return stria__bwd_end(pass, dq, fn);
}
