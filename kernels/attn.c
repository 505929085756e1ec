/*
 * The attention driver: argument checks, position masks, the per-call
 * context, tiling and packing, merging, finalize and delta, on top of the
 * per-ISA operations of kernels_int.h. The forward pass is in attn_fwd.c,
 * the backward pass in attn_bwd.c. Layout-agnostic: every mask decision
 * comes from positions.
 */
#include "attn_int.h"

/* ---- tensors and validation ------------------------------------------- */

static stria_tensor_t stria__tensor(void *data, stria_dtype_t dtype, int64_t stride_token,
                                    int64_t stride_head, int64_t stride_batch)
{
    return (stria_tensor_t){.data = data,
                            .dtype = dtype,
                            .stride_batch = stride_batch,
                            .stride_token = stride_token,
                            .stride_head = stride_head};
}

stria_tensor_t stria_tensor_contiguous(void *data, stria_dtype_t dtype, int64_t tokens,
                                       int64_t heads, int64_t head_dim)
{
    return stria__tensor(data, dtype, heads * head_dim, head_dim, tokens * heads * head_dim);
}

stria_tensor_t stria_tensor_head_major(void *data, stria_dtype_t dtype, int64_t tokens,
                                       int64_t heads, int64_t head_dim)
{
    return stria__tensor(data, dtype, head_dim, tokens * head_dim, heads * tokens * head_dim);
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

void stria__ctx_free(stria__ctx_t *c)
{
    free(c->qpos);
    free(c->kpos);
    free(c->qmin); /* all the tile bounds (stria__alloc_parts) */
    free(c->qlo);  /* all the row bounds */
}

/* Keys visible to a query at position pos: [*lo, *hi] (see
 * stria_attn_params_t). Positions are in [0, 2^62), so 0 and 2^62 stand for
 * unbounded. */
static void stria__row_bounds(const stria_attn_params_t *p, int64_t pos, int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = p->causal ? pos : STRIA__POS_LIMIT_V;
    if (p->n_cu_seqlens > 0) { /* the document [cu[d], cu[d + 1]) holding pos */
        const int64_t *cu = p->cu_seqlens;
        size_t a = 0, b = p->n_cu_seqlens - 1; /* cu[a] <= pos < cu[b] */
        while (b - a > 1) {
            size_t m = a + (b - a) / 2;
            if (cu[m] <= pos)
                a = m;
            else
                b = m;
        }
        l = cu[a];
        h = h < cu[b] - 1 ? h : cu[b] - 1;
    }
    if (p->has_window) {
        if (p->window_left >= 0 && pos - p->window_left > l)
            l = pos - p->window_left;
        if (p->window_right >= 0 && p->window_right < STRIA__POS_LIMIT_V &&
            pos + p->window_right < h)
            h = pos + p->window_right;
    }
    *lo = l;
    *hi = h;
}

/* Min and max of lo and of hi over rows [t * grain, (t + 1) * grain) of n, for
 * each of n_groups groups (groups past the last row: empty, classified as
 * skipped). */
void stria__group_bounds(const int64_t *lo, const int64_t *hi, int64_t n, int64_t grain,
                         int64_t n_groups, int64_t *lomin, int64_t *lomax, int64_t *himin,
                         int64_t *himax)
{
    for (int64_t t = 0; t < n_groups; t++) {
        int64_t a = INT64_MAX, b = INT64_MIN, x = INT64_MAX, y = INT64_MIN;
        int64_t end = (t + 1) * grain < n ? (t + 1) * grain : n;
        for (int64_t i = t * grain; i < end; i++) {
            a = lo[i] < a ? lo[i] : a;
            b = lo[i] > b ? lo[i] : b;
            x = hi[i] < x ? hi[i] : x;
            y = hi[i] > y ? hi[i] : y;
        }
        lomin[t] = a;
        lomax[t] = b;
        himin[t] = x;
        himax[t] = y;
    }
}

/* The row bounds of a call with documents or a window, and their min and max
 * per query tile and sub-block. */
static stria_status_t stria__ctx_bounds(stria__ctx_t *c, const stria_attn_params_t *p,
                                        const char *fn)
{
    stria_status_t st;
    const int64_t nqs = c->nqt * STRIA__NQS;
    if ((st = stria__validate_doc_end(p, c->qpos, c->dims.Tq, fn, "query")) != STRIA_OK ||
        (st = stria__validate_doc_end(p, c->kpos, c->dims.Tk, fn, "key")) != STRIA_OK)
        return st;
    c->bounds = p->n_cu_seqlens > 0 || p->has_window;
    if (!c->bounds)
        return STRIA_OK;
    int64_t **const parts[] = {&c->qlo,   &c->qhi,     &c->lomin,   &c->lomax,   &c->himin,
                               &c->himax, &c->lomin_s, &c->lomax_s, &c->himin_s, &c->himax_s};
    const int64_t lens[] = {c->dims.Tq, c->dims.Tq, c->nqt, c->nqt, c->nqt,
                            c->nqt,     nqs,        nqs,    nqs,    nqs};
    if (!stria__alloc_parts(parts, lens, 10))
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate row bounds", fn);
    for (int64_t i = 0; i < c->dims.Tq; i++)
        stria__row_bounds(p, c->qpos[i], &c->qlo[i], &c->qhi[i]);
    stria__group_bounds(c->qlo, c->qhi, c->dims.Tq, STRIA__BQ, c->nqt, c->lomin, c->lomax, c->himin,
                        c->himax);
    stria__group_bounds(c->qlo, c->qhi, c->dims.Tq, STRIA__SB, nqs, c->lomin_s, c->lomax_s,
                        c->himin_s, c->himax_s);
    return STRIA_OK;
}

/* Min and max position of every tile of `tile` rows (tiles past the last row:
 * empty, INT64_MAX and INT64_MIN). */
void stria__tile_bounds(const int64_t *pos, int64_t n, int64_t tile, int64_t n_tiles, int64_t *mn,
                        int64_t *mx)
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

stria_status_t stria__ctx_init(stria__ctx_t *c, const stria_attn_params_t *p, const char *fn)
{
    stria_status_t st;

    memset(c, 0, sizeof(*c));
    c->ops = stria__kern_ops();
    if (c->ops == NULL)
        return stria__kern_ops_status(); /* message set by stria__kern_ops() */
    c->p = p;
    c->dims = stria__attn_dims(p);
    c->D = p->head_dim;
    c->Dp = stria__round_up(p->head_dim, STRIA__DPAD);
    c->scale = stria__attn_scale(p);
    c->causal = p->causal;
    c->nqt = (c->dims.Tq + STRIA__BQ - 1) / STRIA__BQ;
    c->nkt = (c->dims.Tk + STRIA__BK - 1) / STRIA__BK;
    c->n_threads = stria_pool_size(p->pool);

    st = stria__expand_positions(&p->q_pos, c->dims.Tq, fn, "query", &c->qpos);
    if (st != STRIA_OK)
        return st;
    st = stria__expand_positions(&p->kv_pos, c->dims.Tk, fn, "key", &c->kpos);
    if (st != STRIA_OK)
        goto err;
    const int64_t nqs = c->nqt * STRIA__BQ / STRIA__SB, nks = c->nkt * STRIA__BK / STRIA__SB;
    int64_t **const parts[] = {&c->qmin,   &c->qmax,   &c->kmin,   &c->kmax,
                               &c->qmin_s, &c->qmax_s, &c->kmin_s, &c->kmax_s};
    const int64_t lens[] = {c->nqt, c->nqt, c->nkt, c->nkt, nqs, nqs, nks, nks};
    if (!stria__alloc_parts(parts, lens, 8)) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate tile bounds", fn);
        goto err;
    }
    stria__tile_bounds(c->qpos, c->dims.Tq, STRIA__BQ, c->nqt, c->qmin, c->qmax);
    stria__tile_bounds(c->kpos, c->dims.Tk, STRIA__BK, c->nkt, c->kmin, c->kmax);
    /* sub-blocks past the last token get empty bounds (never used) */
    stria__tile_bounds(c->qpos, c->dims.Tq, STRIA__SB, nqs, c->qmin_s, c->qmax_s);
    stria__tile_bounds(c->kpos, c->dims.Tk, STRIA__SB, nks, c->kmin_s, c->kmax_s);
    if ((st = stria__ctx_bounds(c, p, fn)) != STRIA_OK)
        goto err;
    return STRIA_OK;
err:
    stria__ctx_free(c);
    return st;
}

void stria__plan(const stria__ctx_t *c, int64_t qt, int64_t kt, stria__plan_t *pl)
{
    const int64_t qs0 = qt * STRIA__NQS, ks0 = kt * STRIA__NKS;
    const int bq = stria__tile_len(c->dims.Tq, qt * STRIA__BQ, STRIA__BQ);
    const int bk = stria__tile_len(c->dims.Tk, kt * STRIA__BK, STRIA__BK);

    pl->q0 = qt * STRIA__BQ;
    pl->k0 = kt * STRIA__BK;
    pl->bq = bq;
    pl->bk = bk;
    pl->nqc = (bq + STRIA__SB - 1) / STRIA__SB;
    pl->nkc = (bk + STRIA__SB - 1) / STRIA__SB;
    for (int qc = 0; qc < pl->nqc; qc++) {
        int lo = -1, hi = -1;
        for (int kb = 0; kb < pl->nkc; kb++) {
            int cls = c->bounds ? stria__class_bounds(c->kmin_s[ks0 + kb], c->kmax_s[ks0 + kb],
                                                      c->lomin_s[qs0 + qc], c->lomax_s[qs0 + qc],
                                                      c->himin_s[qs0 + qc], c->himax_s[qs0 + qc])
                                : stria__class(c->kmin_s[ks0 + kb], c->kmax_s[ks0 + kb],
                                               c->qmin_s[qs0 + qc], c->qmax_s[qs0 + qc]);
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

/* Masks the computed key rows of query chunk qc of a straddling tile: sets
 * the masked scores to -inf. st is transposed: [keys][STRIA__BQ queries]. */
void stria__mask_chunk(const stria__ctx_t *c, const stria__plan_t *pl, float *st, int qc)
{
    const int i0 = qc * STRIA__SB, ni = stria__plan_chunk(pl, qc);
    const int64_t *qp = c->qpos + pl->q0 + i0;

    for (int j0 = pl->klo[qc]; j0 < pl->khi[qc]; j0 += STRIA__SB) {
        int cls = pl->cls[j0 / STRIA__SB][qc];
        int j1 = j0 + STRIA__SB < pl->khi[qc] ? j0 + STRIA__SB : pl->khi[qc];
        float *blk = st + (size_t)j0 * STRIA__BQ + (size_t)i0;
        if (cls == STRIA__TILE_PARTIAL && c->bounds) {
            c->ops->mask_bounds(blk, j1 - j0, ni, STRIA__BQ, c->kpos + pl->k0 + j0,
                                c->qlo + pl->q0 + i0, c->qhi + pl->q0 + i0);
        } else if (cls == STRIA__TILE_PARTIAL) {
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
void stria__pack_rows(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
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

/* rows [t0, t0+n) of head h of a bf16 tensor, bit for bit, in pairs of rows:
 * element (i, d) at dst[(i / 2) * 2 * Dp + 2 * d + i % 2], zero padded to
 * `rows` rows (even) and Dp columns. The B operand of a product that sums
 * over these rows (P V, dS K, P^T dO, dS^T Q). */
void stria__pack_pairs(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
                       int64_t t0, int n, int rows, uint16_t *dst)
{
    const int64_t D = c->D, Dp = c->Dp;
    for (int i = 0; i < rows; i += 2) {
        uint16_t *d = dst + (size_t)i * (size_t)Dp;
        const uint16_t *r0 = NULL, *r1 = NULL;
        stria__prefetch_ahead(t, b, h, t0, i, n, D, 0);
        stria__prefetch_ahead(t, b, h, t0, i + 1, n, D, 0);
        if (i < n)
            r0 = (const uint16_t *)stria__row_ptr(t, b, t0 + i, h);
        if (i + 1 < n)
            r1 = (const uint16_t *)stria__row_ptr(t, b, t0 + i + 1, h);
        if (r0 == NULL) {
            memset(d, 0, 2 * (size_t)Dp * sizeof(uint16_t));
            continue;
        }
        for (int64_t x = 0; x < D; x++) {
            d[2 * x] = r0[x];
            d[2 * x + 1] = r1 != NULL ? r1[x] : 0;
        }
        memset(d + 2 * D, 0, 2 * (size_t)(Dp - D) * sizeof(uint16_t));
    }
}

/* rows [t0, t0+n) of head h of a bf16 tensor transposed: dst[d][i] = element
 * d of row i, [Dp][BK] bf16, zero padded (the tile path's A operand of a
 * product that sums over these rows: V^T, K^T). Pairs of rows taken as
 * 32-bit words, transposed: a word of row pair i / 2 at column d becomes
 * elements i and i + 1 of row d. */
void stria__pack_t(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h, int64_t t0,
                   int n, uint16_t *dst)
{
    uint16_t pairs[STRIA__BK * STRIA_HEAD_DIM_MAX];
    stria__pack_pairs(c, t, b, h, t0, n, STRIA__BK, pairs);
    c->ops->transpose32(pairs, c->Dp, dst, STRIA__BK / 2, STRIA__BK / 2, (int)c->Dp);
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
void stria__pack_qside(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
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
void stria__pack_kside(const stria__ctx_t *c, const stria_tensor_t *t, int64_t b, int64_t h,
                       int64_t k0, int n, float *dst)
{
    if (c->bf16)
        stria__pack_rows_bf16(c, t, b, h, k0, n, STRIA__BK, (uint16_t *)dst);
    else
        stria__pack_rows(c, t, b, h, k0, n, STRIA__BK, dst);
}

/* Key tile kt of kv head hk of t: in place when c->kdirect, else its packed
 * tile (tile_floats floats each, [B][Hkv][nkt] order) in `packed`. */
stria__kop_t stria__kside(const stria__ctx_t *c, const stria_tensor_t *t, const float *packed,
                          size_t tile_floats, int64_t b, int64_t hk, int64_t kt)
{
    stria__kop_t op;
    if (c->kdirect) {
        op.p = (const float *)stria__row_ptr(t, b, kt * STRIA__BK, hk);
        op.ld = (ptrdiff_t)t->stride_token;
    } else {
        op.p = packed + (size_t)((b * c->dims.Hkv + hk) * c->nkt + kt) * tile_floats;
        op.ld = (ptrdiff_t)c->Dp;
    }
    return op;
}

/* Rows [j0, j0 + rows) and columns [i0, i0 + cols) of st[BK][BQ] = A B: A the
 * key-side rows, B the packed query-side operand (see the functions above).
 * i0 and cols are multiples of 16. */
void stria__score_gemm(const stria__ctx_t *c, int j0, int rows, int i0, int cols, stria__kop_t a,
                       const float *b, float *st)
{
    float *dst = st + (size_t)j0 * STRIA__BQ + (size_t)i0;
    if (c->bf16)
        c->ops->gemm_bf16(rows, cols, (int)c->Dp, (const uint16_t *)a.p + (ptrdiff_t)j0 * a.ld,
                          a.ld, false, (const uint16_t *)b + 2 * (size_t)i0, 2 * STRIA__BQ, dst,
                          STRIA__BQ, NULL, false);
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
void stria__score_gemm_plan(const stria__ctx_t *c, const stria__plan_t *pl, stria__kop_t a,
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
size_t stria__score_tile_floats(const stria__ctx_t *c, size_t tile)
{
    return c->bf16 ? tile / 2 : tile;
}

void stria__ctx_set_dtype(stria__ctx_t *c, stria_dtype_t dtype)
{
    c->bf16 = dtype == STRIA_DTYPE_BF16 && c->ops->gemm_bf16 != NULL && c->ops->gemm_bf16_ok();
    c->tiles = c->bf16 && c->ops->tiles;
    c->Dp = stria__round_up(c->D, c->tiles ? STRIA__TILE_K : STRIA__DPAD);
    c->kdirect = c->D == c->Dp && (c->bf16 || dtype == STRIA_DTYPE_F32);
}

/* ---- merge ------------------------------------------------------------- */

/* Takes a workspace of `floats` floats from `mem` (the params' workspace
 * allocator) or the cache; `bound` is the same size computed in double (with
 * any factor the caller multiplies it by), to refuse sizes that overflow.
 * None for 0 floats (every operand read in place): ws stays empty. */
stria_status_t stria__ws_floats(const stria_allocator_t *mem, double bound, size_t floats,
                                stria__ws_t *ws, const char *fn)
{
    memset(ws, 0, sizeof(*ws));
    if (floats == 0)
        return STRIA_OK;
    if (bound > 0x1p58)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate %zu MiB of workspace", fn,
                               (floats * sizeof(float)) >> 20);
    if (!stria__ws_get(mem, floats * sizeof(float), ws))
        return mem != NULL && mem->alloc != NULL
                   ? stria_error_wrap(STRIA_ERR_NO_MEMORY, "%s: %zu MiB of workspace", fn,
                                      (floats * sizeof(float)) >> 20)
                   : stria_error_set(STRIA_ERR_NO_MEMORY,
                                     "%s: cannot allocate %zu MiB of workspace", fn,
                                     (floats * sizeof(float)) >> 20);
    return STRIA_OK;
}

stria_status_t stria__scratch_status(int failed, size_t floats, const char *fn)
{
    if (!failed)
        return STRIA_OK;
    return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate %zu KiB of per-thread scratch",
                           fn, (floats * sizeof(float)) >> 10);
}

/* One workspace (stria__ws_floats(), bound as there) for n areas of sizes[i]
 * floats laid end to end: *at[i] points at area i. */
stria_status_t stria__ws_areas(const stria_allocator_t *mem, double bound, int n,
                               const size_t *sizes, float **const *at, stria__ws_t *ws,
                               const char *fn)
{
    size_t total = 0;
    stria_status_t st;
    for (int i = 0; i < n; i++)
        total += sizes[i];
    if ((st = stria__ws_floats(mem, bound, total, ws, fn)) != STRIA_OK)
        return st;
    float *next = ws->ptr;
    for (int i = 0; i < n; i++) {
        *at[i] = next;
        next += sizes[i];
    }
    return STRIA_OK;
}

/* ---- init, merge, finalize, delta --------------------------------------- */

/* Writes every [batch][q_tokens][heads] row of dst: src's fp32 row converted
 * to dst's dtype (vectorised by the variant, ops not NULL), or zeros when src
 * is NULL. */
static void stria__rows_write(const stria_kern_ops_t *ops, const stria_attn_params_t *p,
                              const stria_tensor_t *src, const stria_tensor_t *dst)
{
    const size_t n = (size_t)p->head_dim;
    for (int64_t b = 0; b < p->batch; b++)
        for (int64_t t = 0; t < p->q_tokens; t++)
            for (int64_t h = 0; h < p->heads; h++) {
                void *row = stria__row_ptr(dst, b, t, h);
                if (src == NULL)
                    memset(row, 0, n * stria_dtype_size(dst->dtype));
                else
                    ops->row_store(dst->dtype, (const float *)stria__row_ptr(src, b, t, h), row,
                                   (int)n);
            }
}

stria_status_t stria_attn_partial_init(const stria_attn_params_t *params, const stria_tensor_t *o,
                                       float *lse)
{
    static const char fn[] = "stria_attn_partial_init";
    stria_status_t st = stria__validate_partial_init(params, o, lse, fn);
    if (st != STRIA_OK)
        return st;
    stria__rows_write(NULL, params, NULL, o);
    for (int64_t i = 0; i < params->batch * params->heads * params->q_tokens; i++)
        lse[i] = -INFINITY;
    return STRIA_OK;
}

stria_status_t stria_attn_merge(const stria_attn_params_t *params, const stria_tensor_t *o_a,
                                float *lse_a, const stria_tensor_t *o_b, const float *lse_b)
{
    static const char fn[] = "stria_attn_merge";
    const stria_attn_params_t *p = params;
    stria_status_t st = stria__validate_merge(params, o_a, lse_a, o_b, lse_b, fn);
    if (st != STRIA_OK)
        return st;
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
    stria_status_t st = stria__validate_finalize(params, o_part, o_out, fn);
    if (st != STRIA_OK)
        return st;
    const stria_kern_ops_t *ops = stria__kern_ops();
    if (ops == NULL)
        return stria__kern_ops_status(); /* message set by stria__kern_ops() */
    stria__rows_write(ops, p, o_part, o_out);
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
    stria_status_t st = stria__validate_delta(params, o, d_o, delta, fn);
    if (st != STRIA_OK)
        return st;
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
