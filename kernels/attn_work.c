/*
 * What a call computes under its mask, counted by the driver's own
 * classification (attn_int.h: stria__tile_class, stria__plan), without
 * computing anything: for planning and for simulating passes
 * (stria-bench simulate). A plan keeps one block's per-tile bounds, so that
 * the work of many (query block, key block) pairs costs a loop over tile
 * pairs each, not a context per pair.
 */
#include "attn_int.h"

struct stria_attn_plan {
    stria_attn_params_t p; /* the block's side: its positions point into runs */
    stria_pos_run_t *runs;
    stria__ctx_t c; /* the driver's context of the block against itself */
    /* tiles other than the driver's (tq, tk > 0): bounds at that grain,
     * classified whole by the same functions */
    int64_t tq, tk, nqt, nkt;
    int64_t *qmin, *qmax, *kmin, *kmax, *lomin, *lomax, *himin, *himax;
};

void stria_attn_plan_destroy(stria_attn_plan_t *plan)
{
    if (plan == NULL)
        return;
    stria__ctx_free(&plan->c);
    free(plan->runs);
    free(plan->qmin);
    free(plan);
}

/* Per-tile bounds of the block at the plan's own grain. */
static stria_status_t stria__plan_grain(stria_attn_plan_t *pl)
{
    const stria__ctx_t *c = &pl->c;
    const int64_t T = c->dims.Tq;
    pl->nqt = (T + pl->tq - 1) / pl->tq;
    pl->nkt = (T + pl->tk - 1) / pl->tk;
    int64_t **const parts[] = {&pl->qmin,  &pl->qmax,  &pl->lomin, &pl->lomax,
                               &pl->himin, &pl->himax, &pl->kmin,  &pl->kmax};
    const int64_t lens[] = {pl->nqt, pl->nqt, pl->nqt, pl->nqt, pl->nqt, pl->nqt, pl->nkt, pl->nkt};
    if (!stria__alloc_parts(parts, lens, 8))
        return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_attn_plan_create: out of memory");
    stria__tile_bounds(c->qpos, T, pl->tq, pl->nqt, pl->qmin, pl->qmax);
    stria__tile_bounds(c->qpos, T, pl->tk, pl->nkt, pl->kmin, pl->kmax);
    if (c->bounds)
        stria__group_bounds(c->qlo, c->qhi, T, pl->tq, pl->nqt, pl->lomin, pl->lomax, pl->himin,
                            pl->himax);
    return STRIA_OK;
}

stria_status_t stria_attn_plan_create(const stria_attn_params_t *params, int64_t tile_q,
                                      int64_t tile_k, stria_attn_plan_t **plan)
{
    static const char fn[] = "stria_attn_plan_create";
    stria_attn_plan_t *pl;
    stria_status_t st;
    size_t n = params != NULL ? params->q_pos.n_runs : 0;

    if (params == NULL || plan == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: NULL argument", fn);
    if (tile_q < 0 || tile_k < 0 || (tile_q == 0) != (tile_k == 0))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: tiles %lld x %lld (both 0 for the kernels' own, or both >= 1)",
                               fn, (long long)tile_q, (long long)tile_k);
    pl = calloc(1, sizeof(*pl));
    if (pl == NULL || (n > 0 && (pl->runs = malloc(n * sizeof(*pl->runs))) == NULL)) {
        free(pl);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    /* the block against itself: the context then holds its bounds both as
     * queries and as keys */
    pl->p = *params;
    pl->p.pool = NULL;
    if (n > 0)
        memcpy(pl->runs, params->q_pos.runs, n * sizeof(*pl->runs));
    pl->p.q_pos.runs = pl->runs;
    pl->p.kv_pos = pl->p.q_pos;
    pl->p.kv_tokens = pl->p.q_tokens;
    pl->tq = tile_q;
    pl->tk = tile_k;
    if ((st = stria__validate_shape(&pl->p, fn)) != STRIA_OK ||
        (st = stria__ctx_init(&pl->c, &pl->p, fn)) != STRIA_OK) {
        free(pl->runs);
        free(pl);
        return st;
    }
    pl->c.p = &pl->p;
    if (tile_q > 0 && (st = stria__plan_grain(pl)) != STRIA_OK) {
        stria_attn_plan_destroy(pl);
        return st;
    }
    *plan = pl;
    return STRIA_OK;
}

/* The query side of q against the key side of k, as one driver context. */
static void stria__plan_pair(const stria_attn_plan_t *q, const stria_attn_plan_t *k,
                             stria__ctx_t *x)
{
    *x = q->c;
    x->dims.Tk = k->c.dims.Tq;
    x->kpos = k->c.qpos;
    if (q->tq == 0) {
        x->nkt = k->c.nkt;
        x->kmin = k->c.kmin;
        x->kmax = k->c.kmax;
        x->kmin_s = k->c.kmin_s;
        x->kmax_s = k->c.kmax_s;
        return;
    }
    x->nqt = q->nqt;
    x->qmin = q->qmin;
    x->qmax = q->qmax;
    x->lomin = q->lomin;
    x->lomax = q->lomax;
    x->himin = q->himin;
    x->himax = q->himax;
    x->nkt = k->nkt;
    x->kmin = k->kmin;
    x->kmax = k->kmax;
}

/* Sub-blocks of a straddling pair under the driver's plan. */
static void stria__count_plan(const stria__ctx_t *x, int64_t qt, int64_t kt, stria_attn_work_t *w)
{
    stria__plan_t pl;
    stria__plan(x, qt, kt, &pl);
    for (int qc = 0; qc < pl.nqc; qc++) {
        int nq = stria__plan_chunk(&pl, qc);
        for (int kb = 0; kb < pl.nkc; kb++) {
            if (!stria__plan_has(&pl, kb, qc))
                continue;
            int nk = stria__tile_len(pl.bk, (int64_t)kb * STRIA__SB, STRIA__SB);
            int cls = pl.cls[kb][qc];
            w->sub_full += cls == STRIA__TILE_FULL;
            w->sub_masked += cls == STRIA__TILE_PARTIAL;
            w->sub_hole += cls == STRIA__TILE_SKIP;
            w->partial_elems += (int64_t)nq * nk;
        }
    }
}

static bool stria__same_masks(const stria_attn_params_t *a, const stria_attn_params_t *b)
{
    return a->causal == b->causal && a->n_cu_seqlens == b->n_cu_seqlens &&
           (a->n_cu_seqlens == 0 || a->cu_seqlens == b->cu_seqlens) &&
           a->has_window == b->has_window && a->window_left == b->window_left &&
           a->window_right == b->window_right;
}

stria_status_t stria_attn_plan_work(const stria_attn_plan_t *q, const stria_attn_plan_t *k,
                                    stria_attn_work_t *work)
{
    static const char fn[] = "stria_attn_plan_work";
    char seen_k[4096], *kseen = seen_k;
    stria_attn_work_t w;
    stria__ctx_t x;

    if (q == NULL || k == NULL || work == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: NULL argument", fn);
    if (q->tq != k->tq || q->tk != k->tk || !stria__same_masks(&q->p, &k->p))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: the plans differ in tiles or masks (causal, documents, window)",
                               fn);
    stria__plan_pair(q, k, &x);
    if (x.nkt > (int64_t)sizeof(seen_k) && (kseen = calloc((size_t)x.nkt, 1)) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (kseen == seen_k)
        memset(seen_k, 0, (size_t)x.nkt);
    memset(&w, 0, sizeof(w));
    const int64_t tq = q->tq > 0 ? q->tq : STRIA__BQ, tk = q->tk > 0 ? q->tk : STRIA__BK;
    for (int64_t qt = 0; qt < x.nqt; qt++) {
        const int64_t bq = stria__tile_len(x.dims.Tq, qt * tq, (int)tq);
        bool active = false;
        for (int64_t kt = 0; kt < x.nkt; kt++) {
            int cls = stria__tile_class(&x, qt, kt);
            const int64_t bk = stria__tile_len(x.dims.Tk, kt * tk, (int)tk);
            w.tiles++;
            if (cls == STRIA__TILE_SKIP)
                continue;
            active = true;
            kseen[kt] = 1;
            if (cls == STRIA__TILE_FULL) {
                w.full++;
                w.full_elems += bq * bk;
            } else {
                w.partial++;
                if (q->tq == 0)
                    stria__count_plan(&x, qt, kt, &w);
                else
                    w.partial_elems += bq * bk;
            }
        }
        w.q_tiles += active;
    }
    for (int64_t kt = 0; kt < x.nkt; kt++)
        w.k_tiles += kseen[kt];
    if (kseen != seen_k)
        free(kseen);
    *work = w;
    return STRIA_OK;
}

stria_status_t stria_attn_work(const stria_attn_params_t *params, int64_t tile_q, int64_t tile_k,
                               stria_attn_work_t *work)
{
    stria_attn_plan_t *q = NULL, *k = NULL;
    stria_attn_params_t kp;
    stria_status_t st;
    if (params == NULL || work == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_attn_work: NULL argument");
    kp = *params;
    kp.q_tokens = params->kv_tokens;
    kp.q_pos = params->kv_pos;
    if ((st = stria_attn_plan_create(params, tile_q, tile_k, &q)) == STRIA_OK &&
        (st = stria_attn_plan_create(&kp, tile_q, tile_k, &k)) == STRIA_OK)
        st = stria_attn_plan_work(q, k, work);
    stria_attn_plan_destroy(q);
    stria_attn_plan_destroy(k);
    return st;
}
