/* The backward pass of the attention driver: stria_attn_bwd() and the pass
 * API (stria_attn_bwd_begin/_block/_end), parallel over key tiles (each owns
 * its dK/dV) and query tiles for dQ. */
#include "attn_int.h"

#include <pthread.h>

/* ---- backward ---------------------------------------------------------- */

/* Most threads for which the backward pass runs one task per key-tile block
 * for everything (mode C, stria__bwd_begin). */
#define STRIA__BWD_KBLOCK_THREADS 8
/* Locks of the shared dQ in mode C: query tile i is guarded by lock
 * i % STRIA__BWD_DQ_LOCKS. */
#define STRIA__BWD_DQ_LOCKS 64
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
     * unless kin), or with c->bf16 bf16 in pairs of rows (stria__pack_pairs),
     * the B operands of the gradient products */
    float *q_packed, *do_packed, *k_packed;
    /* score operands, fp32 or bf16 (q_stile / k_stile floats per tile):
     * Q^T, dO^T [B][H][nqt][Dp][BQ]; K, V rows [B][Hkv][nkt][BK][Dp]
     * (ks_packed: bf16 K unless read in place, fp32 K uses its rows;
     * v_packed: unless read in place) */
    float *qt_packed, *dot_packed, *ks_packed, *v_packed;
    size_t q_stile, k_stile;
    float *dq_packed; /* [B][H][nqt][BQ][Dp] dQ accumulators */
    /* mode C: tasks add their dQ tiles into dq_packed under these locks
     * (STRIA__BWD_DQ_LOCKS); NULL: each task owns the dQ rows it writes */
    pthread_mutex_t *dq_locks;
    size_t scratch_floats; /* per task (stria__thread_scratch()) */
    int failed;            /* a task had no scratch */
    int kblock;            /* key tiles per task (stria__bwd_kblock) */
    int64_t nkb;           /* key-tile blocks per kv head */
    bool kin;              /* fp32 K rows read in place (k_packed unused) */
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

/* The dQ accumulator of query tile `task` (BQ * Dp floats). */
static float *stria__bwd_dq_tile(const stria__bwd_job_t *job, size_t task)
{
    return job->dq_packed + task * (size_t)STRIA__BQ * (size_t)job->c->Dp;
}

static void stria__bwd_pack_q_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__qtask_t t = stria__qtask(c, task);
    size_t tile = (size_t)STRIA__BQ * (size_t)c->Dp;
    float *qp = job->q_packed + task * tile, *dop = job->do_packed + task * tile;
    float *tmp = stria__bwd_dq_tile(job, task); /* zeroed below */

    (void)thread;
    stria__pack_qside(c, job->q, t.b, t.h, t.q0, t.n, c->bf16 ? NULL : qp, tmp,
                      job->qt_packed + task * job->q_stile);
    stria__pack_qside(c, job->d_o, t.b, t.h, t.q0, t.n, c->bf16 ? NULL : dop, tmp,
                      job->dot_packed + task * job->q_stile);
    if (c->bf16) {
        stria__pack_pairs(c, job->q, t.b, t.h, t.q0, t.n, STRIA__BQ, (uint16_t *)qp);
        stria__pack_pairs(c, job->d_o, t.b, t.h, t.q0, t.n, STRIA__BQ, (uint16_t *)dop);
    }
    memset(stria__bwd_dq_tile(job, task), 0, tile * sizeof(float));
}

/* Adds the dQ accumulators of one query tile to the caller's dq. On the tile
 * path they are dQ^T: turned into rows in the
 * tile's own packed Q (no longer needed), then added. */
static void stria__bwd_unpack_dq_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__qtask_t t = stria__qtask(c, task);
    const size_t tile = (size_t)STRIA__BQ * (size_t)c->Dp;

    (void)thread;
    if (c->tiles) {
        float *sum = stria__bwd_dq_tile(job, task), *rows = job->q_packed + task * tile;
        c->ops->transpose32(sum, STRIA__BQ, rows, c->Dp, (int)c->Dp, STRIA__BQ);
        stria__bwd_add_rows(c, job->dq, t.b, t.h, t.q0, t.n, rows);
        return;
    }
    stria__bwd_add_rows(c, job->dq, t.b, t.h, t.q0, t.n, stria__bwd_dq_tile(job, task));
}

static void stria__bwd_pack_k_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__ktask_t t = stria__ktile(c, task);
    size_t tile = (size_t)STRIA__BK * (size_t)c->Dp;

    (void)thread;
    if (c->tiles) /* K^T, the A operand of dQ^T += K^T dS^T */
        stria__pack_t(c, job->k, t.b, t.hk, t.k0, t.n, (uint16_t *)(job->k_packed + task * tile));
    else if (c->bf16)
        stria__pack_pairs(c, job->k, t.b, t.hk, t.k0, t.n, STRIA__BK,
                          (uint16_t *)(job->k_packed + task * tile));
    else if (!job->kin)
        stria__pack_rows(c, job->k, t.b, t.hk, t.k0, t.n, STRIA__BK, job->k_packed + task * tile);
    if (c->bf16 && !c->kdirect)
        stria__pack_kside(c, job->k, t.b, t.hk, t.k0, t.n, job->ks_packed + task * job->k_stile);
    if (!c->kdirect)
        stria__pack_kside(c, job->v, t.b, t.hk, t.k0, t.n, job->v_packed + task * job->k_stile);
}

/* Per-thread scratch of the backward pass. */
typedef struct {
    float *pt;    /* [BK][BQ] P^T */
    float *dst;   /* [BK][BQ] dP^T, then dS^T * scale */
    float *dk;    /* [kblock][BK][Dp] */
    float *dv;    /* [kblock][BK][Dp] */
    float *lse;   /* [BQ] LSE of the query tile, +inf for rows without keys */
    float *delta; /* [BQ] */
    float *dq;    /* [BQ][Dp] a task's dQ of one query tile (mode C) */
    /* c->bf16: P^T and dS^T rounded to bf16, [BK][BQ], and dS^T in pairs of
     * rows, [BK/2][BQ][2] */
    uint16_t *ptb, *dsb, *ds2;
} stria__bwd_scratch_t;

/* The calling thread's scratch for a task of job; false when out of memory
 * (the task then does nothing, job->failed is set). */
static bool stria__bwd_scratch(stria__bwd_job_t *job, stria__bwd_scratch_t *s)
{
    int64_t Dp = job->c->Dp;
    if ((s->pt = stria__task_scratch(job->scratch_floats, &job->failed)) == NULL)
        return false;
    s->dst = s->pt + STRIA__BQ * STRIA__BK;
    s->dk = s->dst + STRIA__BQ * STRIA__BK;
    s->dv = s->dk + (size_t)job->kblock * STRIA__BK * (size_t)Dp;
    s->lse = s->dv + (size_t)job->kblock * STRIA__BK * (size_t)Dp;
    s->delta = s->lse + STRIA__BQ;
    s->dq = s->delta + STRIA__BQ;
    s->ptb = (uint16_t *)(s->dq + (job->dq_locks != NULL ? (size_t)STRIA__BQ * (size_t)Dp : 0));
    s->dsb = s->ptb + STRIA__BQ * STRIA__BK;
    s->ds2 = s->dsb + STRIA__BQ * STRIA__BK;
    return true;
}

/* LSE and D of query tile qt of head h into the scratch. A row that saw no key
 * gets LSE = +inf so that its probabilities come out as exp(-inf) = 0; padding
 * rows likewise. */
static void stria__bwd_load_stats(stria__bwd_job_t *job, stria__bwd_scratch_t *s, int64_t b,
                                  int64_t h, int64_t qt)
{
    stria__ctx_t *c = job->c;
    int64_t q0 = qt * STRIA__BQ;
    int bq = stria__tile_len(c->dims.Tq, q0, STRIA__BQ);
    const float *lse = job->lse + (size_t)((b * c->dims.H + h) * c->dims.Tq + q0);
    const float *delta = job->delta + (size_t)((b * c->dims.H + h) * c->dims.Tq + q0);
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
        if (c->bf16) {
            const uint16_t *ds2 = s->ds2 + stria__pair_off(klo, i0);
            ops->softmax_bwd_ds_bf16(s->pt + off, s->dst + off, nk, STRIA__SB, STRIA__BQ,
                                     s->delta + i0, c->scale, s->ptb + off, s->dsb + off,
                                     s->ds2 + stria__pair_off(klo, i0));
            if (dq != NULL && c->tiles) /* dQ^T += K^T dS^T on the chunk's columns */
                ops->gemm_bf16((int)Dp, STRIA__SB, stria__k2(nk), (const uint16_t *)kp.p + klo,
                               STRIA__BK, false, ds2, 2 * STRIA__BQ, dq + i0, STRIA__BQ, NULL,
                               true);
            else if (dq != NULL)
                ops->gemm_bf16(ni, (int)Dp, stria__k2(nk), ds2, 2 * STRIA__BQ, true,
                               (const uint16_t *)kp.p + (size_t)klo * (size_t)Dp, 2 * Dp,
                               dq + (size_t)i0 * (size_t)Dp, Dp, NULL, true);
            continue;
        }
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
            if (c->bf16) {
                const size_t po = (size_t)i0 * (size_t)Dp; /* pair row i0 / 2 */
                ops->gemm_bf16(nj, (int)Dp, stria__k2(i1 - i0), s->ptb + off, STRIA__BQ, false,
                               (const uint16_t *)dop + po, 2 * Dp, dv + jo, Dp, NULL, true);
                ops->gemm_bf16(nj, (int)Dp, stria__k2(i1 - i0), s->dsb + off, STRIA__BQ, false,
                               (const uint16_t *)qp + po, 2 * Dp, dk + jo, Dp, NULL, true);
                continue;
            }
            ops->gemm(nj, (int)Dp, i1 - i0, s->pt + off, STRIA__BQ, false,
                      dop + (size_t)i0 * (size_t)Dp, Dp, dv + jo, Dp, NULL, true);
            ops->gemm(nj, (int)Dp, i1 - i0, s->dst + off, STRIA__BQ, false,
                      qp + (size_t)i0 * (size_t)Dp, Dp, dk + jo, Dp, NULL, true);
        }
    }
}

/* One (query tile, key tile) pair of head h, transposed: recomputes P^T, then
 * accumulates dV and dK of the key tile into dv, dk (NULL: not wanted) and dQ
 * of the query tile into dq (BQ * Dp floats; NULL: no dQ). The LSE and D of
 * the query tile must be in s (stria__bwd_load_stats). */
static void stria__bwd_tile(stria__bwd_job_t *job, stria__bwd_scratch_t *s, int64_t b, int64_t h,
                            int64_t qt, int64_t kt, int cls, float *dk, float *dv, float *dq)
{
    stria__ctx_t *c = job->c;
    const stria_kern_ops_t *ops = c->ops;
    int64_t hk = h / c->dims.G;
    int64_t Dp = c->Dp;
    int64_t q0 = qt * STRIA__BQ, k0 = kt * STRIA__BK;
    int bq = stria__tile_len(c->dims.Tq, q0, STRIA__BQ);
    int bk = stria__tile_len(c->dims.Tk, k0, STRIA__BK);
    size_t qtile = (size_t)STRIA__BQ * (size_t)Dp, ktile = (size_t)STRIA__BK * (size_t)Dp;
    size_t qidx = (size_t)((b * c->dims.H + h) * c->nqt + qt);
    size_t kidx = (size_t)((b * c->dims.Hkv + hk) * c->nkt + kt);
    const float *qp = job->q_packed + qidx * qtile;
    const float *qtp = job->qt_packed + qidx * job->q_stile;
    const float *dop = job->do_packed + qidx * qtile;
    const float *dotp = job->dot_packed + qidx * job->q_stile;
    /* fp32 K rows (for dQ), in place or packed; in fp32 they are the score
     * operand too */
    stria__kop_t kp = job->kin ? (stria__kop_t){(const float *)stria__row_ptr(job->k, b, k0, hk),
                                                (ptrdiff_t)job->k->stride_token}
                               : (stria__kop_t){job->k_packed + kidx * ktile, (ptrdiff_t)Dp};
    stria__kop_t ksp =
        c->bf16 ? stria__kside(c, job->k, job->ks_packed, job->k_stile, b, hk, kt) : kp;
    stria__kop_t vp = stria__kside(c, job->v, job->v_packed, job->k_stile, b, hk, kt);

    if (cls == STRIA__TILE_PARTIAL) {
        stria__bwd_partial(c, s, qt, kt, qp, qtp, dop, dotp, kp, ksp, vp, dk, dv, dq);
        return;
    }
    /* P^T = exp(scale K Q^T - lse) */
    stria__score_gemm(c, 0, bk, 0, STRIA__BQ, ksp, qtp, s->pt);
    ops->softmax_bwd_p(s->pt, bk, STRIA__BQ, STRIA__BQ, c->scale, s->lse);
    /* dP^T = V dO^T, then dS^T = P^T (dP^T - D) scale */
    stria__score_gemm(c, 0, bk, 0, STRIA__BQ, vp, dotp, s->dst);
    if (c->bf16) {
        /* the products on P^T and dS^T rounded to bf16 */
        ops->softmax_bwd_ds_bf16(s->pt, s->dst, bk, STRIA__BQ, STRIA__BQ, s->delta, c->scale,
                                 s->ptb, s->dsb, s->ds2);
        if (dk != NULL) {
            ops->gemm_bf16(bk, (int)Dp, stria__k2(bq), s->ptb, STRIA__BQ, false,
                           (const uint16_t *)dop, 2 * Dp, dv, Dp, NULL, true);
            ops->gemm_bf16(bk, (int)Dp, stria__k2(bq), s->dsb, STRIA__BQ, false,
                           (const uint16_t *)qp, 2 * Dp, dk, Dp, NULL, true);
        }
        if (dq != NULL && c->tiles) /* dQ^T += K^T dS^T */
            ops->gemm_bf16((int)Dp, STRIA__BQ, stria__k2(bk), (const uint16_t *)kp.p, STRIA__BK,
                           false, s->ds2, 2 * STRIA__BQ, dq, STRIA__BQ, NULL, true);
        else if (dq != NULL)
            ops->gemm_bf16(bq, (int)Dp, stria__k2(bk), s->ds2, 2 * STRIA__BQ, true,
                           (const uint16_t *)kp.p, 2 * Dp, dq, Dp, NULL, true);
        return;
    }
    ops->softmax_bwd_ds(s->pt, s->dst, bk, STRIA__BQ, STRIA__BQ, s->delta, c->scale);
    if (dk != NULL) {
        /* dV += P^T dO, dK += dS^T Q */
        ops->gemm(bk, (int)Dp, bq, s->pt, STRIA__BQ, false, dop, Dp, dv, Dp, NULL, true);
        ops->gemm(bk, (int)Dp, bq, s->dst, STRIA__BQ, false, qp, Dp, dk, Dp, NULL, true);
    }
    if (dq != NULL) /* dQ += dS K */
        ops->gemm(bq, (int)Dp, bk, s->dst, STRIA__BQ, true, kp.p, kp.ld, dq, Dp, NULL, true);
}

/* Adds a task's dQ of query tile qidx (s->dq) into the shared accumulators
 * (mode C). The lock is held for one tile's add, against the many products
 * that made the tile, so that threads seldom wait. */
static void stria__bwd_dq_add(const stria__bwd_job_t *job, size_t qidx, const float *dq)
{
    pthread_mutex_t *lock = &job->dq_locks[qidx % STRIA__BWD_DQ_LOCKS];
    pthread_mutex_lock(lock);
    job->c->ops->row_acc(stria__bwd_dq_tile(job, qidx), dq, STRIA__BQ * (int)job->c->Dp);
    pthread_mutex_unlock(lock);
}

/* dK/dV of key-tile block kb (job->kblock tiles) of kv head hk, over every
 * query head of its group, and with dq the dQ contributions: into the shared
 * accumulators through the scratch and the locks when job->dq_locks (mode
 * C), else straight into them (the task owns the query rows). */
static void stria__bwd_kblock_run(stria__bwd_job_t *job, stria__bwd_scratch_t *s, int64_t b,
                                  int64_t hk, int64_t kb, bool dq)
{
    stria__ctx_t *c = job->c;
    size_t ktile = (size_t)STRIA__BK * (size_t)c->Dp, qtile = (size_t)STRIA__BQ * (size_t)c->Dp;
    int64_t kt0 = kb * job->kblock;
    int64_t kt1 = kt0 + job->kblock < c->nkt ? kt0 + job->kblock : c->nkt;

    memset(s->dk, 0, (size_t)(kt1 - kt0) * ktile * sizeof(float));
    memset(s->dv, 0, (size_t)(kt1 - kt0) * ktile * sizeof(float));
    for (int64_t g = 0; g < c->dims.G; g++) {
        int64_t h = hk * c->dims.G + g;
        for (int64_t qt = 0; qt < c->nqt; qt++) {
            size_t qidx = (size_t)((b * c->dims.H + h) * c->nqt + qt);
            float *dqt = !dq ? NULL : job->dq_locks != NULL ? s->dq : stria__bwd_dq_tile(job, qidx);
            bool loaded = false;
            for (int64_t kt = kt0; kt < kt1; kt++) {
                int cls = stria__tile_class(c, qt, kt);
                if (cls == STRIA__TILE_SKIP)
                    continue;
                if (!loaded) {
                    stria__bwd_load_stats(job, s, b, h, qt);
                    if (dqt == s->dq)
                        memset(s->dq, 0, qtile * sizeof(float));
                    loaded = true;
                }
                stria__bwd_tile(job, s, b, h, qt, kt, cls, s->dk + (size_t)(kt - kt0) * ktile,
                                s->dv + (size_t)(kt - kt0) * ktile, dqt);
            }
            if (loaded && dqt == s->dq)
                stria__bwd_dq_add(job, qidx, s->dq);
        }
    }
    for (int64_t kt = kt0; kt < kt1; kt++) {
        int64_t k0 = kt * STRIA__BK;
        int bk = stria__tile_len(c->dims.Tk, k0, STRIA__BK);
        stria__bwd_add_rows(c, job->dk, b, hk, k0, bk, s->dk + (size_t)(kt - kt0) * ktile);
        stria__bwd_add_rows(c, job->dv, b, hk, k0, bk, s->dv + (size_t)(kt - kt0) * ktile);
    }
}

/* Mode A: one task per (batch, kv head) computes everything of its group. */
static void stria__bwd_group_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    int64_t hk = (int64_t)task % c->dims.Hkv;
    int64_t b = (int64_t)task / c->dims.Hkv;
    stria__bwd_scratch_t s;
    (void)thread;
    if (!stria__bwd_scratch(job, &s))
        return;
    for (int64_t kb = 0; kb < job->nkb; kb++)
        stria__bwd_kblock_run(job, &s, b, hk, kb, true);
}

/* Mode C: one task per (batch, kv head, key-tile block) for everything; dQ
 * goes to the shared accumulators a query tile at a time, under a lock. */
static void stria__bwd_kblock_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__ktask_t tk = stria__ktask(c, job->nkb, task);
    stria__bwd_scratch_t s;
    (void)thread;
    if (!stria__bwd_scratch(job, &s))
        return;
    stria__bwd_kblock_run(job, &s, tk.b, tk.hk, tk.k, true);
}

/* Mode B, pass 1: one task per (batch, kv head, key-tile block) for dK, dV. */
static void stria__bwd_dkdv_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__ktask_t tk = stria__ktask(c, job->nkb, task);
    stria__bwd_scratch_t s;
    (void)thread;
    if (!stria__bwd_scratch(job, &s))
        return;
    stria__bwd_kblock_run(job, &s, tk.b, tk.hk, tk.k, false);
}

/* Mode B, pass 2: one task per (batch, head, query tile) for dQ. */
static void stria__bwd_dq_task(void *arg, size_t task, int thread)
{
    stria__bwd_job_t *job = arg;
    stria__ctx_t *c = job->c;
    stria__qtask_t tk = stria__qtask(c, task);
    int64_t qt = tk.qt, h = tk.h, b = tk.b;
    stria__bwd_scratch_t s;
    (void)thread;
    if (!stria__bwd_scratch(job, &s))
        return;

    stria__bwd_load_stats(job, &s, b, h, qt);
    for (int64_t kt = 0; kt < c->nkt; kt++) {
        int cls = stria__tile_class(c, qt, kt);
        if (cls != STRIA__TILE_SKIP)
            stria__bwd_tile(job, &s, b, h, qt, kt, cls, NULL, NULL,
                            stria__bwd_dq_tile(job, (size_t)task));
    }
}

/* A backward pass over several K/V blocks: the query side, packed once. */
struct stria_attn_bwd_pass {
    stria_attn_params_t p;    /* the query side of begin's params (kv fields unused) */
    stria_pos_run_t *q_runs;  /* copy of p.q_pos.runs */
    stria_tensor_t q, d_o;    /* views (their data is packed at begin) */
    const float *lse, *delta; /* read by every block */
    stria_pool_t *pool;
    char mode; /* schedule (stria__bwd_begin) */
    stria__ws_t ws;
    float *q_packed, *do_packed, *qt_packed, *dot_packed, *dq_packed;
    size_t q_stile, n_q;
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
    if (st != STRIA_OK)
        return stria__begin_fail(NULL, pass->q_runs, pass, st);
    stria__ctx_set_dtype(&c, q->dtype);
    n_threads = c.n_threads;
    /* Schedules: mode A, one task per (batch, kv head), needs nothing extra
     * but balances only with enough groups per thread. Mode C, one task per
     * (batch, kv head, key-tile block), balances at any shape for the price
     * of adding each task's dQ tiles into the shared dQ under a lock: used
     * for a few threads. Mode B splits key tiles for dK/dV and query tiles
     * for dQ, recomputing P once more: for many threads and few groups. */
    n_groups = (size_t)(c.dims.B * c.dims.Hkv);
    if (n_threads == 1)
        pass->mode = 'A';
    else if (n_threads <= STRIA__BWD_KBLOCK_THREADS)
        pass->mode = 'C';
    else if (n_groups >= 4 * (size_t)n_threads ||
             (n_groups >= (size_t)n_threads && n_groups % (size_t)n_threads == 0))
        pass->mode = 'A';
    else
        pass->mode = 'B';
    qtile = (size_t)STRIA__BQ * (size_t)c.Dp;
    pass->n_q = (size_t)(c.dims.B * c.dims.H * c.nqt);
    pass->q_stile = stria__score_tile_floats(&c, qtile);
    /* every area is a multiple of 16 floats: 64-byte aligned like the buffer;
     * at most 5 x the padded query rows, the query part of the grant */
    const size_t sizes[] = {pass->n_q * qtile, pass->n_q * qtile, pass->n_q * qtile,
                            pass->n_q * pass->q_stile, pass->n_q * pass->q_stile};
    float **const at[] = {&pass->q_packed, &pass->do_packed, &pass->dq_packed, &pass->qt_packed,
                          &pass->dot_packed};
    if ((st = stria__ws_areas(params->workspace, 5.0 * (double)pass->n_q * (double)qtile, 5, sizes,
                              at, &pass->ws, fn)) != STRIA_OK)
        return stria__begin_fail(&c, pass->q_runs, pass, st);
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
    size_t ktile, n_k, n_kb;
    stria__ws_t ws = {0};
    pthread_mutex_t dq_locks[STRIA__BWD_DQ_LOCKS];

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
    n_k = (size_t)(c.dims.B * c.dims.Hkv * c.nkt);
    job.k_stile = stria__score_tile_floats(&c, ktile);
    if (job.kblock > c.nkt) /* dK/dV scratch for the tiles there are */
        job.kblock = (int)c.nkt;
    job.nkb = (c.nkt + job.kblock - 1) / job.kblock;
    if (pass->mode == 'C')
        job.dq_locks = dq_locks;
    job.scratch_floats =
        (size_t)(2 * STRIA__BQ * STRIA__BK + 2 * (int64_t)job.kblock * STRIA__BK * c.Dp +
                 2 * STRIA__BQ + (job.dq_locks != NULL ? STRIA__BQ * c.Dp : 0) +
                 (c.bf16 ? 3 * STRIA__BQ * STRIA__BK / 2 : 0));
    job.scratch_floats = (size_t)stria__round_up((int64_t)job.scratch_floats, 16);
    /* operands read in place need no packed tiles; fp32 K rows only when a
     * head's rows are adjacent (a token stride apart, the dQ product runs
     * slower than on packed tiles) */
    job.kin = c.kdirect && !c.bf16 && k->stride_token == c.D;
    size_t k_area = job.kin ? 0 : n_k * ktile, v_area = c.kdirect ? 0 : n_k * job.k_stile;
    size_t ks_area = c.bf16 && !c.kdirect ? n_k * job.k_stile : 0;
    /* at most 2 x the padded K/V rows, the K/V part of the grant */
    const size_t sizes[] = {k_area, v_area, ks_area};
    float **const at[] = {&job.k_packed, &job.v_packed, &job.ks_packed};
    if ((st = stria__ws_areas(params->workspace, 3.0 * (double)n_k * (double)ktile, 3, sizes, at,
                              &ws, fn)) != STRIA_OK)
        goto out;
    if (!job.kin || !c.kdirect)
        stria_pool_run(pass->pool, n_k, stria__bwd_pack_k_task, &job);
    n_kb = (size_t)(c.dims.B * c.dims.Hkv * job.nkb);
    if (pass->mode == 'A') {
        stria_pool_run(pass->pool, (size_t)(c.dims.B * c.dims.Hkv), stria__bwd_group_task, &job);
    } else if (pass->mode == 'C') {
        for (int i = 0; i < STRIA__BWD_DQ_LOCKS; i++)
            pthread_mutex_init(&dq_locks[i], NULL);
        stria_pool_run(pass->pool, n_kb, stria__bwd_kblock_task, &job);
        for (int i = 0; i < STRIA__BWD_DQ_LOCKS; i++)
            pthread_mutex_destroy(&dq_locks[i]);
    } else {
        stria_pool_run(pass->pool, n_kb, stria__bwd_dkdv_task, &job);
        stria_pool_run(pass->pool, pass->n_q, stria__bwd_dq_task, &job);
    }
    st = stria__scratch_status(job.failed, job.scratch_floats, fn);
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

    if (pass != NULL)
        *pass = NULL;
    if ((st = stria__pass_check(pass, params, q, &a, fn)) != STRIA_OK)
        return st;
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
