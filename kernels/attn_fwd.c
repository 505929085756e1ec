/* The forward pass of the attention driver: per-call stria_attn_fwd() and
 * the pass API (stria_attn_fwd_begin/_block/_end) that packs the query side
 * once for all K/V blocks. */
#include "attn_int.h"

/* ---- forward ----------------------------------------------------------- */

typedef struct {
    stria__ctx_t *c;
    const stria_tensor_t *q, *k, *v, *o;
    float *lse;
    bool accumulate;
    float *k_packed; /* [B][Hkv][nkt][BK][Dp], fp32 or bf16 (k_tile floats each) */
    float *v_packed; /* [B][Hkv][nkt][BK][Dp] fp32, or bf16 in pairs of rows */
    size_t k_tile;
    size_t scratch_floats; /* per task (stria__thread_scratch()) */
    int failed;            /* a task had no scratch */
    /* a forward pass's query side ([B][H][nqt], q_tile floats each), packed
     * by stria__fwd_begin_task, or NULL: each task packs its Q tile */
    float *q_packed;
    size_t q_tile;
} stria__fwd_job_t;

static void stria__fwd_pack_task(void *arg, size_t task, int thread)
{
    stria__fwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__ktask_t t = stria__ktile(c, task);
    size_t tile = (size_t)c->Dp * STRIA__BK;

    (void)thread;
    if (!c->kdirect)
        stria__pack_kside(c, job->k, t.b, t.hk, t.k0, t.n, job->k_packed + task * job->k_tile);
    if (c->tiles)
        stria__pack_t(c, job->v, t.b, t.hk, t.k0, t.n, (uint16_t *)(job->v_packed + task * tile));
    else if (c->bf16)
        stria__pack_pairs(c, job->v, t.b, t.hk, t.k0, t.n, STRIA__BK,
                          (uint16_t *)(job->v_packed + task * tile));
    else if (!c->vdirect)
        stria__pack_rows(c, job->v, t.b, t.hk, t.k0, t.n, STRIA__BK, job->v_packed + task * tile);
}

/* The softmax step and O = diag(alpha) O + P V of rows [klo, klo + nk) of a
 * score tile, for m queries from column i0 (cols of the tile: a multiple of
 * 16); oacc: the tile's output accumulator, m, l, alpha: the statistics of
 * the queries. bf16: P rounded to bf16 in pairs of rows (pb) times V in
 * pairs of rows; on tiles O^T = O^T diag(alpha) + V^T P^T on the columns of
 * the queries (all cols of them: the ones past the block are padding). */
static void stria__fwd_pv(const stria__ctx_t *c, float *st, uint16_t *pb, int klo, int nk, int i0,
                          int cols, int m_rows, const float *vp, float *oacc, float *m, float *l,
                          float *alpha, bool first)
{
    const int64_t Dp = c->Dp;
    float *sc = st + (size_t)klo * STRIA__BQ + (size_t)i0;
    float *o = oacc + (size_t)i0 * (size_t)Dp;
    if (c->tiles) {
        uint16_t *pa = pb + stria__pair_off(klo, i0);
        float *ot = oacc + i0;
        c->ops->softmax_fwd_bf16(sc, nk, cols, STRIA__BQ, c->scale, m, l, alpha, pa, 2 * STRIA__BQ);
        if (!first)
            c->ops->scale_cols(ot, (int)Dp, cols, STRIA__BQ, alpha);
        c->ops->gemm_bf16((int)Dp, cols, stria__k2(nk), (const uint16_t *)vp + klo, STRIA__BK,
                          false, pa, 2 * STRIA__BQ, ot, STRIA__BQ, NULL, !first);
        return;
    }
    if (c->bf16) {
        uint16_t *pa = pb + stria__pair_off(klo, i0);
        c->ops->softmax_fwd_bf16(sc, nk, cols, STRIA__BQ, c->scale, m, l, alpha, pa, 2 * STRIA__BQ);
        c->ops->gemm_bf16(m_rows, (int)Dp, stria__k2(nk), pa, 2 * STRIA__BQ, true,
                          (const uint16_t *)vp + (size_t)klo * (size_t)Dp, 2 * Dp, o, Dp, alpha,
                          !first);
        return;
    }
    c->ops->softmax_fwd(sc, nk, cols, STRIA__BQ, c->scale, m, l, alpha);
    c->ops->gemm(m_rows, (int)Dp, nk, sc, STRIA__BQ, true, vp + (size_t)klo * (size_t)Dp, Dp, o, Dp,
                 alpha, !first);
}

/* A straddling tile pair of the forward pass, query chunk by query chunk
 * (stria__plan): S^T = K Q^T over the chunk's key rows, mask, online softmax,
 * O = diag(alpha) O + P V. Skipping the fully masked rows changes no result:
 * they would add exp(-inf) = 0 to the sums and products. first: O holds
 * nothing yet (it is written, not accumulated). */
static void stria__fwd_partial(const stria__ctx_t *c, int64_t qt, int64_t kt, stria__kop_t kp,
                               const float *vp, const float *qt_buf, float *st, uint16_t *pb,
                               float *oacc, float *m, float *l, float *alpha, bool first)
{
    const int64_t Dp = c->Dp;
    stria__plan_t pl;

    stria__plan(c, qt, kt, &pl);
    stria__score_gemm_plan(c, &pl, kp, qt_buf, st);
    for (int qc = 0; qc < pl.nqc; qc++) {
        const int i0 = qc * STRIA__SB, ni = stria__plan_chunk(&pl, qc);
        const int klo = pl.klo[qc], nk = pl.khi[qc] - pl.klo[qc];
        if (nk == 0) {             /* no key of this tile is visible to the chunk */
            if (first && c->tiles) /* its columns of O^T */
                for (int64_t d = 0; d < Dp; d++)
                    memset(oacc + d * STRIA__BQ + i0, 0, STRIA__SB * sizeof(float));
            else if (first)
                memset(oacc + (size_t)i0 * (size_t)Dp, 0, (size_t)ni * (size_t)Dp * sizeof(float));
            continue;
        }
        stria__mask_chunk(c, &pl, st, qc);
        stria__fwd_pv(c, st, pb, klo, nk, i0, STRIA__SB, ni, vp, oacc, m + i0, l + i0, alpha + i0,
                      first);
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
    int64_t h = ((int64_t)task / c->nqt) % c->dims.H;
    int64_t b = (int64_t)task / c->nqt / c->dims.H;
    int64_t hk = h / c->dims.G;
    int64_t q0 = qt * STRIA__BQ;
    int bq = stria__tile_len(c->dims.Tq, q0, STRIA__BQ);
    int64_t Dp = c->Dp;
    size_t tile = (size_t)Dp * STRIA__BK;
    float *qt_buf = stria__task_scratch(job->scratch_floats, &job->failed); /* [Dp][BQ] */
    (void)thread;
    if (qt_buf == NULL)
        return;
    float *oacc = qt_buf + STRIA__BQ * Dp; /* [BQ][Dp] */
    float *st = oacc + STRIA__BQ * Dp;     /* [BK][BQ] */
    float *m = st + STRIA__BQ * STRIA__BK;
    float *l = m + STRIA__BQ;
    float *alpha = l + STRIA__BQ;
    uint16_t *pb = (uint16_t *)(alpha + STRIA__BQ); /* [BK/2][BQ] bf16 pairs */
    bool first = true;

    const float *qtp = qt_buf; /* the tile's packed Q^T */
    if (job->q_packed != NULL)
        qtp = job->q_packed + (size_t)((b * c->dims.H + h) * c->nqt + qt) * job->q_tile;
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
        int bk = stria__tile_len(c->dims.Tk, k0, STRIA__BK);
        size_t tidx = (size_t)((b * c->dims.Hkv + hk) * c->nkt + kt);
        stria__kop_t kp = stria__kside(c, job->k, job->k_packed, job->k_tile, b, hk, kt);
        const float *vp = c->vdirect ? (const float *)stria__row_ptr(job->v, b, k0, hk)
                                     : job->v_packed + tidx * tile;

        if (cls == STRIA__TILE_PARTIAL) {
            stria__fwd_partial(c, qt, kt, kp, vp, qtp, st, pb, oacc, m, l, alpha, first);
        } else {
            stria__score_gemm(c, 0, bk, 0, STRIA__BQ, kp, qtp, st);
            stria__fwd_pv(c, st, pb, 0, bk, 0, STRIA__BQ, bq, vp, oacc, m, l, alpha, first);
        }
        first = false;
    }
    if (first) /* every key tile was masked */
        memset(oacc, 0, (size_t)STRIA__BQ * (size_t)Dp * sizeof(float));
    if (c->tiles) { /* O^T to rows, into qt_buf (the Q^T operand is done) */
        ops->transpose32(oacc, STRIA__BQ, qt_buf, Dp, (int)Dp, STRIA__BQ);
        oacc = qt_buf;
    }
    for (int i = 0; i < bq; i++) {
        const float *orow = oacc + (size_t)i * (size_t)Dp;
        float *out = (float *)stria__row_ptr(job->o, b, q0 + i, h);
        float *lse_out = job->lse + (size_t)((b * c->dims.H + h) * c->dims.Tq + q0 + i);
        /* the row is normalised by 1 / l on its way out. l == 0: no key
         * seen (LSE -inf, a zero row); l NaN: a NaN or +inf score reached
         * the row, and the NaN goes on into its output and LSE (never an
         * empty row: the numerics rule) */
        const bool seen = l[i] != 0.0f;
        float inv = seen ? 1.0f / l[i] : 0.0f;
        float lse_new = seen ? m[i] + logf(l[i]) : -INFINITY;
        if (job->accumulate) {
            stria__merge_row(ops, out, lse_out, orow, inv, lse_new, c->D);
        } else {
            if (seen)
                ops->row_merge(out, orow, inv, 0.0f, 0.0f, false, (int)c->D);
            else
                memset(out, 0, (size_t)c->D * sizeof(float));
            *lse_out = lse_new;
        }
    }
}

/* stria_attn_fwd() on validated arguments; q_packed: the query side packed
 * by a forward pass (q is then only its view), or NULL. */
static stria_status_t stria__fwd_run(const stria_attn_params_t *params, const stria_tensor_t *q,
                                     float *q_packed, const stria_tensor_t *k,
                                     const stria_tensor_t *v, const stria_tensor_t *o, float *lse,
                                     bool accumulate, const char *fn)
{
    stria__fwd_job_t job;
    stria__ctx_t c;
    stria_status_t st;
    size_t tile, n_ktiles;
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
    n_ktiles = (size_t)(c.dims.B * c.dims.Hkv * c.nkt);
    job.k_tile = stria__score_tile_floats(&c, tile);
    job.q_tile = stria__score_tile_floats(&c, (size_t)c.Dp * STRIA__BQ);
    job.scratch_floats = (size_t)(2 * STRIA__BQ * c.Dp + STRIA__BQ * STRIA__BK + 3 * STRIA__BQ +
                                  (c.bf16 ? STRIA__BQ * STRIA__BK / 2 : 0));
    job.scratch_floats = (size_t)stria__round_up((int64_t)job.scratch_floats, 16);
    /* operands read in place need no packed tiles */
    size_t k_area = c.kdirect ? 0 : n_ktiles * job.k_tile, v_area = c.vdirect ? 0 : n_ktiles * tile;
    const size_t sizes[] = {k_area, v_area};
    float **const at[] = {&job.k_packed, &job.v_packed};
    if ((st = stria__ws_areas(params->workspace, 2.0 * (double)n_ktiles * (double)tile, 2, sizes,
                              at, &ws, fn)) != STRIA_OK)
        goto out;
    if (!c.kdirect || !c.vdirect)
        stria_pool_run(params->pool, n_ktiles, stria__fwd_pack_task, &job);
    stria_pool_run(params->pool, (size_t)(c.dims.B * c.dims.H * c.nqt), stria__fwd_task, &job);
    st = stria__scratch_status(job.failed, job.scratch_floats, fn);
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
stria_status_t stria__same_query(const stria_attn_params_t *b, const stria_attn_params_t *p,
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
    else if (p->n_cu_seqlens != b->n_cu_seqlens ||
             (b->n_cu_seqlens > 0 &&
              memcmp(p->cu_seqlens, b->cu_seqlens, b->n_cu_seqlens * sizeof(int64_t)) != 0))
        what = "cu_seqlens";
    else if (p->has_window != b->has_window || p->window_left != b->window_left ||
             p->window_right != b->window_right)
        what = "window";
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

/* A forward pass's begin: packs the query side of one query tile into
 * job->q_packed (job: c, q, q_packed, q_tile and BQ * Dp scratch floats). */
static void stria__fwd_begin_task(void *arg, size_t task, int thread)
{
    stria__fwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__qtask_t t = stria__qtask(c, task);
    float *tmp = stria__task_scratch(job->scratch_floats, &job->failed);
    (void)thread;
    if (tmp != NULL)
        stria__pack_qside(c, job->q, t.b, t.h, t.q0, t.n, NULL, tmp,
                          job->q_packed + task * job->q_tile);
}

/* The pass's params with a one-token K/V block, for a context that only
 * needs the query side. */
stria_attn_params_t stria__query_side(const stria_attn_params_t *p)
{
    stria_attn_params_t a = *p;
    a.kv_tokens = 1;
    a.kv_pos.runs = NULL;
    a.kv_pos.n_runs = 0;
    return a;
}

/* Checks the arguments a pass's begin shares: out (the caller's pass
 * out-pointer, not NULL), params (the key side unused) and q; *a: the query
 * side of params (stria__query_side). */
stria_status_t stria__pass_check(const void *out, const stria_attn_params_t *params,
                                 const stria_tensor_t *q, stria_attn_params_t *a, const char *fn)
{
    stria_status_t st;
    if (out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: pass is NULL", fn);
    if (params == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: params is NULL", fn);
    *a = stria__query_side(params);
    if ((st = stria__validate_shape(a, fn)) != STRIA_OK)
        return st;
    return stria__validate_tensor(q, fn, "q", a->q_tokens, a->heads, a->head_dim, false);
}

/* The query side a pass keeps from begin's params: a copy whose q_pos runs
 * and cu_seqlens are the pass's own (one allocation, *runs, freed by the
 * pass). */
stria_status_t stria__pass_query(const stria_attn_params_t *params, stria_attn_params_t *p,
                                 stria_pos_run_t **runs, const char *fn)
{
    const size_t rb = params->q_pos.n_runs * sizeof(stria_pos_run_t);
    const size_t db = params->n_cu_seqlens * sizeof(int64_t);
    *p = *params;
    *runs = NULL;
    if (rb + db > 0) {
        *runs = malloc(rb + db);
        if (*runs == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
        if (rb > 0)
            memcpy(*runs, params->q_pos.runs, rb);
        if (db > 0)
            memcpy((char *)*runs + rb, params->cu_seqlens, db);
    }
    p->q_pos.runs = rb > 0 ? *runs : NULL;
    p->cu_seqlens = db > 0 ? (const int64_t *)(const void *)((char *)*runs + rb) : NULL;
    return STRIA_OK;
}

stria_status_t stria_attn_fwd_begin(const stria_attn_params_t *params, const stria_tensor_t *q,
                                    stria_attn_fwd_pass_t **out)
{
    static const char fn[] = "stria_attn_fwd_begin";
    stria_attn_fwd_pass_t *pass;
    stria__fwd_job_t job = {0};
    stria_attn_params_t a;
    stria__ctx_t c;
    stria_status_t st;
    size_t n_q;

    if (out != NULL)
        *out = NULL;
    if ((st = stria__pass_check(out, params, q, &a, fn)) != STRIA_OK)
        return st;
    if ((pass = calloc(1, sizeof(*pass))) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
    pass->q = *q;
    if ((st = stria__pass_query(params, &pass->p, &pass->q_runs, fn)) != STRIA_OK ||
        (st = stria__ctx_init(&c, &a, fn)) != STRIA_OK)
        return stria__begin_fail(NULL, pass->q_runs, pass, st);
    stria__ctx_set_dtype(&c, q->dtype);
    n_q = (size_t)(c.dims.B * c.dims.H * c.nqt);
    pass->q_tile = stria__score_tile_floats(&c, (size_t)c.Dp * STRIA__BQ);
    job.scratch_floats = (size_t)(STRIA__BQ * c.Dp);
    if ((st = stria__ws_floats(params->workspace, (double)n_q * (double)pass->q_tile,
                               n_q * pass->q_tile, &pass->ws, fn)) != STRIA_OK)
        return stria__begin_fail(&c, pass->q_runs, pass, st);
    pass->q_packed = pass->ws.ptr;
    job.c = &c;
    job.q = q;
    job.q_packed = pass->q_packed;
    job.q_tile = pass->q_tile;
    stria_pool_run(params->pool, n_q, stria__fwd_begin_task, &job);
    stria__ctx_free(&c);
    if ((st = stria__scratch_status(job.failed, job.scratch_floats, fn)) != STRIA_OK) {
        stria__ws_put(&pass->ws);
        return stria__begin_fail(NULL, pass->q_runs, pass, st);
    }
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
