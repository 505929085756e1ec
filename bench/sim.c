/* The pass simulator (sim.h): the engine's plan, the kernels' work counts,
 * costs and an event model of the ring. */
#include "sim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "stria_docplan.h"
#include "stria_util.h"

/* ---- work of block pairs, classified once per equivalence class ------------ */

/* A block pair up to what the kernels' classes cannot see: the runs of both
 * blocks, shifted (or relabelled) as described in sim.h. */
#define STRIA__SIM_KEY 16

typedef struct {
    int64_t v[STRIA__SIM_KEY];
    bool used;
    stria_attn_work_t w;
} stria__sim_slot_t;

typedef struct {
    stria__sim_slot_t *slots;
    size_t cap, used;
} stria__sim_memo_t;

static uint64_t stria__sim_hash(const int64_t *v)
{
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < STRIA__SIM_KEY; i++) {
        h ^= (uint64_t)v[i];
        h *= 1099511628211ULL;
        h ^= h >> 29;
    }
    return h;
}

static stria__sim_slot_t *stria__sim_memo_find(stria__sim_memo_t *m, const int64_t *v)
{
    if (m->used * 2 >= m->cap) { /* grow */
        size_t cap = m->cap ? 2 * m->cap : 1024;
        stria__sim_slot_t *slots = calloc(cap, sizeof(*slots));
        if (slots == NULL)
            return NULL;
        for (size_t i = 0; i < m->cap; i++)
            if (m->slots[i].used) {
                size_t j = stria__sim_hash(m->slots[i].v) & (cap - 1);
                while (slots[j].used)
                    j = (j + 1) & (cap - 1);
                slots[j] = m->slots[i];
            }
        free(m->slots);
        m->slots = slots;
        m->cap = cap;
    }
    size_t j = stria__sim_hash(v) & (m->cap - 1);
    while (m->slots[j].used && memcmp(m->slots[j].v, v, sizeof(m->slots[j].v)) != 0)
        j = (j + 1) & (m->cap - 1);
    return &m->slots[j];
}

/* Shift key: every run's first position relative to the query block's. */
static void stria__sim_key_shift(const stria_attn_params_t *a, int64_t *v)
{
    const int64_t base = a->q_pos.runs[0].first;
    int at = 0;
    const stria_positions_t *sides[2] = {&a->q_pos, &a->kv_pos};
    for (int s = 0; s < 2; s++) {
        v[at++] = (int64_t)sides[s]->n_runs;
        for (size_t i = 0; i < sides[s]->n_runs && at + 3 <= STRIA__SIM_KEY; i++) {
            v[at++] = sides[s]->runs[i].first - base;
            v[at++] = sides[s]->runs[i].stride;
            v[at++] = sides[s]->runs[i].count;
        }
    }
}

/* Relabelling key, for runs of consecutive positions: every distinct
 * interval of positions keeps its length and order and loses the gaps
 * between them. Causal classes compare positions only, so they survive. */
static bool stria__sim_key_relabel(const stria_attn_params_t *a, int64_t *v)
{
    int64_t lo[8], hi[8];
    int n = 0;
    const stria_positions_t *sides[2] = {&a->q_pos, &a->kv_pos};
    for (int s = 0; s < 2; s++)
        for (size_t i = 0; i < sides[s]->n_runs; i++) {
            const stria_pos_run_t *r = &sides[s]->runs[i];
            if ((r->stride != 1 && r->count > 1) || n == 8)
                return false;
            lo[n] = r->first;
            hi[n++] = r->first + r->count - 1;
        }
    /* label(p) = p - start of its merged interval + sum of the lengths of
     * the merged intervals before it */
    int at = 0;
    for (int s = 0; s < 2; s++) {
        v[at++] = (int64_t)sides[s]->n_runs;
        for (size_t i = 0; i < sides[s]->n_runs; i++) {
            const stria_pos_run_t *r = &sides[s]->runs[i];
            int64_t label = 0;
            for (int k = 0; k < n; k++) { /* merged intervals wholly below r */
                bool dup = false, merged_below = hi[k] < r->first;
                for (int e = 0; e < k && merged_below; e++) /* count each interval once */
                    dup = dup || (lo[e] == lo[k] && hi[e] == hi[k]);
                if (merged_below && !dup)
                    label += hi[k] - lo[k] + 1;
            }
            v[at++] = label;
            v[at++] = 1;
            v[at++] = r->count;
        }
    }
    return true;
}

static stria_status_t stria__sim_pair(stria__sim_memo_t *memo, bool relabel,
                                      const stria_attn_params_t *a, int64_t tq, int64_t tk,
                                      stria_attn_work_t *w, int *keys)
{
    int64_t v[STRIA__SIM_KEY];
    memset(v, 0, sizeof(v));
    if (!relabel || !stria__sim_key_relabel(a, v)) {
        memset(v, 0, sizeof(v));
        stria__sim_key_shift(a, v);
    }
    stria__sim_slot_t *slot = stria__sim_memo_find(memo, v);
    if (slot == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "simulate: out of memory");
    if (!slot->used) {
        stria_status_t st = stria_attn_work(a, tq, tk, &slot->w);
        if (st != STRIA_OK)
            return st;
        memcpy(slot->v, v, sizeof(v));
        slot->used = true;
        memo->used++;
        (*keys)++;
    }
    *w = slot->w;
    return STRIA_OK;
}

void stria_sim_table_free(stria_sim_table_t *t)
{
    if (t == NULL)
        return;
    free(t->cells);
    free(t->valid);
    free(t->kv_bytes);
    memset(t, 0, sizeof(*t));
}

/* Documents: no two block pairs are alike. One kernel plan per block side,
 * from the engine's own kernel parameters: every rank's whole shard (its
 * queries, and its keys at step 0) in kq, and in kk the keys of a block as
 * it travels after step 0 where that is not the whole shard (packed: its
 * spread rows; NULL otherwise, kq's then). */
static stria_status_t stria__sim_plans(stria_ring_plan_t *plan, const stria_sim_table_t *t,
                                       int64_t tq, int64_t tk, stria_attn_plan_t **kq,
                                       stria_attn_plan_t **kk)
{
    stria_status_t st = STRIA_OK;
    for (int r = 0; r < t->n && st == STRIA_OK; r++) {
        stria_attn_params_t a;
        if (stria_ring_plan_params(plan, r, r, &a))
            st = stria_attn_plan_create(&a, tq, tk, &kq[r]);
    }
    for (int j = 0; j < t->n && st == STRIA_OK; j++) {
        stria_attn_params_t a, own;
        bool found = false;
        /* block j as another rank computes it; no such rank: never computed */
        for (int hop = 1; hop < t->n && !found; hop++)
            found = stria_ring_plan_params(plan, (j + hop) % t->n, j, &a);
        if (!found || !stria_ring_plan_params(plan, j, j, &own) ||
            (a.kv_tokens == own.q_tokens && a.kv_pos.n_runs == own.q_pos.n_runs))
            continue;
        a.q_pos = a.kv_pos;
        a.q_tokens = a.kv_tokens;
        st = stria_attn_plan_create(&a, tq, tk, &kk[j]);
    }
    return st;
}

/* The kernels' sub-blocks (stria_kernels.h: 16 x 16 in their own tiles). */
#define STRIA__SIM_SUB 16

/* The work of one computed (rank, step) into its cell and the totals. */
static void stria__sim_count(stria_sim_table_t *t, stria_sim_cell_t *c,
                             const stria_attn_params_t *a, const stria_attn_work_t *w)
{
    c->full_elems = w->full_elems;
    c->partial_elems = w->partial_elems;
    c->hole_elems = w->sub_hole * STRIA__SIM_SUB * STRIA__SIM_SUB; /* edges: a little less */
    if (c->hole_elems > c->partial_elems)
        c->hole_elems = c->partial_elems;
    c->tokens = a->q_tokens + a->kv_tokens;
    t->full_tiles += w->full;
    t->partial_tiles += w->partial;
    t->subblocks += w->sub_full + w->sub_masked + w->sub_hole;
    t->full_elems += w->full_elems;
    t->partial_elems += w->partial_elems;
}

/* Documents: the tile pairs classifying every computed cell would take (the
 * kernels' own tiles are 64 x 64), and from them the stride of counted steps
 * (sim.h, STRIA_SIM_EXACT_PAIRS). */
static int stria__sim_stride(stria_ring_plan_t *plan, const stria_sim_table_t *t, int64_t tq,
                             int64_t tk, int64_t exact_pairs)
{
    const int64_t bq = tq > 0 ? tq : 64, bk = tk > 0 ? tk : 64;
    double pairs = 0;
    for (int r = 0; r < t->n; r++)
        for (int s = 0; s < t->n; s++) {
            const stria_sim_cell_t *c = &t->cells[r * t->n + s];
            stria_attn_params_t a;
            if (c->computed && stria_ring_plan_params(plan, r, c->src, &a))
                pairs +=
                    (double)((a.q_tokens + bq - 1) / bq) * (double)((a.kv_tokens + bk - 1) / bk);
        }
    const double k = ceil(pairs / (double)exact_pairs);
    return k < 1 ? 1 : k > t->n ? t->n : (int)k;
}

/* Whether step s of rank r is counted under a stride: step 0 (the rank's own
 * block), every stride-th step, and the last step whose block comes from a
 * rank before r and the first from a rank after it, so that both sides of
 * the causal diagonal have a counted step. */
static bool stria__sim_counted(int r, int s, int stride)
{
    return stride == 1 || s == 0 || s % stride == 0 || s == r || s == r + 1;
}

/* An uncounted computed step takes the work of the nearest counted computed
 * step of the same rank on the same side of the diagonal (its block from a
 * rank before r: steps 1..r; after it: r + 1..n - 1); -1 when there is
 * none. */
static int stria__sim_nearest(const stria_sim_table_t *t, int r, int s, int stride)
{
    const int lo = s <= r ? 1 : r + 1, hi = s <= r ? r : t->n - 1;
    for (int d = 1; d <= hi - lo; d++)
        for (int sign = -1; sign <= 1; sign += 2) {
            const int u = s + sign * d;
            if (u >= lo && u <= hi && stria__sim_counted(r, u, stride) &&
                t->cells[r * t->n + u].computed)
                return u;
        }
    return -1;
}

static stria_status_t stria__sim_cells(stria_ring_plan_t *plan, stria_sim_table_t *t, int64_t tq,
                                       int64_t tk, int64_t exact_pairs)
{
    const int n = t->n;
    const bool docs = t->shape.call.n_cu_seqlens > 0, relabel = !docs && !t->shape.call.has_window;
    stria__sim_memo_t memo = {0};
    stria_attn_plan_t **kq = docs ? calloc(2 * (size_t)n, sizeof(*kq)) : NULL, **kk = kq + n;
    stria_status_t st = docs && kq == NULL
                            ? stria_error_set(STRIA_ERR_NO_MEMORY, "simulate: out of memory")
                            : STRIA_OK;
    for (int r = 0; r < n && st == STRIA_OK; r++)
        for (int s = 0; s < n && st == STRIA_OK; s++) {
            stria_ring_plan_step_t ps;
            if ((st = stria_ring_plan_step(plan, r, s, true, &ps)) != STRIA_OK)
                break;
            t->cells[r * n + s].src = ps.src_rank;
            t->cells[r * n + s].computed = ps.computed;
        }
    t->count_stride = st == STRIA_OK && docs ? stria__sim_stride(plan, t, tq, tk, exact_pairs) : 1;
    if (st == STRIA_OK && docs)
        st = stria__sim_plans(plan, t, tq, tk, kq, kk);
    /* counted steps first, then the others from them */
    for (int pass = 0; pass < 2 && st == STRIA_OK; pass++)
        for (int r = 0; r < n && st == STRIA_OK; r++)
            for (int s = 0; s < n && st == STRIA_OK; s++) {
                stria_sim_cell_t *c = &t->cells[r * n + s];
                stria_attn_params_t a;
                stria_attn_work_t w;
                const bool counted = stria__sim_counted(r, s, t->count_stride);
                if ((pass == 0) != counted || !c->computed ||
                    !stria_ring_plan_params(plan, r, c->src, &a))
                    continue;
                const int u = counted ? -1 : stria__sim_nearest(t, r, s, t->count_stride);
                if (u >= 0) {
                    const stria_sim_cell_t *from = &t->cells[r * n + u];
                    c->full_elems = from->full_elems;
                    c->partial_elems = from->partial_elems;
                    c->hole_elems = from->hole_elems;
                    c->tokens = a.q_tokens + a.kv_tokens;
                    continue;
                }
                if (docs) /* step 0: the whole own block; after it, as the block travels */
                    st = stria_attn_plan_work(
                        kq[r], c->src != r && kk[c->src] != NULL ? kk[c->src] : kq[c->src], &w);
                else
                    st = stria__sim_pair(&memo, relabel, &a, tq, tk, &w, &t->memo_keys);
                if (st == STRIA_OK) {
                    stria__sim_count(t, c, &a, &w);
                    t->cells_counted++;
                }
            }
    for (int i = 0; kq != NULL && i < 2 * n; i++)
        stria_attn_plan_destroy(kq[i]);
    free(kq);
    free(memo.slots);
    return st;
}

/* The bytes a step of `rank` sends besides its dK/dV sum, the K/V message of
 * block `src` to the next rank (but at the last step) and the agreement (at
 * the last step), as the table has them. */
static uint64_t stria__sim_kv_sent(const stria_sim_table_t *t, int src, int step, int steps)
{
    return (step + 1 < steps ? t->kv_bytes[src] : 0) + (step == steps - 1 ? t->agree_bytes : 0);
}

/* The engine's bytes (stria_ring_plan_step()) taken apart: a block's K/V
 * message is what its rank sends at its forward's step 0 (a forward of one
 * step sends none: then a plan of all hops tells), the agreement is all a
 * forward's last step sends, and a backward step's dK/dV sum is what it
 * sends beyond those two. Every step's total is checked against the
 * engine's. */
static stria_status_t stria__sim_bytes(stria_ring_plan_t *plan, stria_sim_table_t *t)
{
    const int n = t->n, F = t->fwd_steps;
    stria_ring_plan_t *hops = NULL;
    stria_ring_plan_step_t ps;
    stria_status_t st = STRIA_OK;
    if (n > 1 && F < 2 &&
        (st = stria_ring_plan_create(&t->shape, t->layout, n, true, &hops)) != STRIA_OK)
        return st;
    for (int j = 0; n > 1 && j < n && st == STRIA_OK; j++)
        if ((st = stria_ring_plan_step(hops != NULL ? hops : plan, j, 0, false, &ps)) == STRIA_OK) {
            t->kv_bytes[j] = ps.bytes_sent;
            t->msg_bytes = ps.bytes_sent > t->msg_bytes ? ps.bytes_sent : t->msg_bytes;
        }
    stria_ring_plan_destroy(hops);
    if (st == STRIA_OK && (st = stria_ring_plan_step(plan, 0, F - 1, false, &ps)) == STRIA_OK)
        t->agree_bytes = ps.bytes_sent;
    for (int b = 0; b < 2 && st == STRIA_OK; b++)
        for (int r = 0; r < n && st == STRIA_OK; r++)
            for (int s = 0; s < (b ? n : F) && st == STRIA_OK; s++) {
                stria_sim_cell_t *c = &t->cells[r * n + s];
                if ((st = stria_ring_plan_step(plan, r, s, b == 1, &ps)) != STRIA_OK)
                    break;
                const uint64_t rest = stria__sim_kv_sent(t, ps.src_rank, s, b ? n : F);
                if (ps.bytes_sent < rest || (b == 0 && ps.bytes_sent != rest))
                    return stria_error_set(STRIA_ERR_INTERNAL,
                                           "simulate: the engine's %s step %d of rank %d sends "
                                           "%llu bytes, not the %llu of its K/V block and the "
                                           "agreement",
                                           b ? "backward" : "forward", s, r,
                                           (unsigned long long)ps.bytes_sent,
                                           (unsigned long long)rest);
                if (b == 1)
                    c->dkv_bytes = ps.bytes_sent - rest;
                t->dkv_bytes = c->dkv_bytes > t->dkv_bytes ? c->dkv_bytes : t->dkv_bytes;
            }
    return st;
}

stria_status_t stria_sim_table(const stria_ring_shape_t *shape, stria_layout_kind_t layout, int n,
                               int64_t tile_q, int64_t tile_k, stria_sim_table_t *t)
{
    return stria_sim_table_bounded(shape, layout, n, tile_q, tile_k, STRIA_SIM_EXACT_PAIRS, t);
}

stria_status_t stria_sim_table_bounded(const stria_ring_shape_t *shape, stria_layout_kind_t layout,
                                       int n, int64_t tile_q, int64_t tile_k, int64_t exact_pairs,
                                       stria_sim_table_t *t)
{
    stria_ring_plan_t *plan = NULL;
    stria_status_t st;
    memset(t, 0, sizeof(*t));
    if (exact_pairs < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "simulate: bound of %lld tile pairs",
                               (long long)exact_pairs);
    const double t0 = stria_time_now();
    if ((st = stria_ring_plan_create(shape, layout, n, false, &plan)) != STRIA_OK)
        return st;
    t->plan_s = stria_time_now() - t0;
    const stria_docplan_t *dp = stria_ring_plan_layout(plan)->plan;
    t->docs_kept = dp != NULL ? dp->n_kept : 0;
    t->docs_spread = dp != NULL ? dp->n_spread : 0;
    t->shape = *shape;
    t->layout = layout;
    t->n = n;
    t->fwd_steps = stria_ring_plan_steps(plan, false);
    t->cells = calloc((size_t)n * (size_t)n, sizeof(*t->cells));
    t->valid = calloc((size_t)n, sizeof(*t->valid));
    t->kv_bytes = calloc((size_t)n, sizeof(*t->kv_bytes));
    if (t->cells == NULL || t->valid == NULL || t->kv_bytes == NULL)
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "simulate: out of memory for %d ranks", n);
    for (int r = 0; st == STRIA_OK && r < n; r++)
        t->valid[r] = stria_layout_shard_valid(stria_ring_plan_layout(plan), r);
    if (st == STRIA_OK)
        st = stria__sim_bytes(plan, t);
    if (st == STRIA_OK)
        st = stria__sim_cells(plan, t, tile_q, tile_k, exact_pairs);
    stria_ring_plan_destroy(plan);
    if (st != STRIA_OK)
        stria_sim_table_free(t);
    return st;
}

void stria_sim_features(const stria_sim_table_t *t, int r, int s, bool bwd, double *x)
{
    const int n = t->n;
    const stria_sim_cell_t *c = &t->cells[r * n + s];
    const double bhd = (double)(t->shape.call.batch * t->shape.heads * t->shape.head_dim);
    memset(x, 0, STRIA_SIM_NCOEF * sizeof(double));
    if (c->computed) {
        x[STRIA_SIM_FULL] = (double)c->full_elems * bhd;
        x[STRIA_SIM_PART] = (double)(c->partial_elems - c->hole_elems) * bhd;
        x[STRIA_SIM_HOLE] = (double)c->hole_elems * bhd;
        x[STRIA_SIM_TOK] = (double)c->tokens * bhd;
        x[STRIA_SIM_CALL] = 1;
    }
    if (s == 0)
        x[STRIA_SIM_OPEN] = (double)t->valid[r] * bhd;
    if (bwd && s > 0 && n > 1) /* the running sum received from r - 1, added */
        x[STRIA_SIM_ADD] =
            (double)(t->cells[((r - 1 + n) % n) * n + s - 1].dkv_bytes / sizeof(float));
    if (bwd && s == n - 1 && t->valid[r] > 0)
        x[STRIA_SIM_LAST] = (double)t->valid[r] * bhd;
}

/* ---- the event model of a pass ---------------------------------------------- */

typedef struct {
    const stria_sim_table_t *t;
    const double *coef;
    const stria_sim_link_t *link;
    stria_sim_span_cb span;
    void *span_ctx;
    double waited;
    int first; /* ring-order position of the ring's rank 0 (stria_sim_pass_at()) */
} stria__sim_run_t;

static void stria__sim_emit(stria__sim_run_t *x, int r, int kind, double b, double e)
{
    if (kind == 2 && e > b)
        x->waited += e - b;
    if (x->span != NULL && e > b)
        x->span(x->span_ctx, r, kind, b, e);
}

/* t = max(t, until), the difference drawn as a wait. */
static double stria__sim_wait(stria__sim_run_t *x, int r, double t, double until)
{
    if (until > t) {
        stria__sim_emit(x, r, 2, t, until);
        return until;
    }
    return t;
}

/* The link into ring rank `to` from `to` - 1: inside a host or between two,
 * the ring's ranks sitting at ring-order positions first + rank. */
static double stria__sim_bw(const stria__sim_run_t *x, int to)
{
    const stria_sim_link_t *l = x->link;
    const int n = x->t->n, from = (to - 1 + n) % n, dph = l->devices_per_host;
    const bool same_host = dph <= 0 || (x->first + from) / dph == (x->first + to) / dph;
    return same_host ? l->intra_Bps : l->inter_Bps;
}

/* A transfer on the link into rank `to`, ready at `ready`: first come, first
 * served; returns its arrival. */
static double stria__sim_xfer(const stria__sim_run_t *x, int to, double *link_free, double ready,
                              uint64_t bytes)
{
    const stria_sim_link_t *l = x->link;
    double bw = stria__sim_bw(x, to), begin = ready > link_free[to] ? ready : link_free[to];
    double busy = bw > 0 ? (double)bytes / bw : 0.0;
    link_free[to] = begin + busy;
    return begin + busy + l->latency_s;
}

/* Per-rank state of a simulated pass. */
typedef struct {
    double *T, *start, *kv_dev, *kv_arr, *kv_done, *dkv_arr, *dkv_post, *dkv_post_next,
        *dkv_done[2], *link_free, *copy_free, *agree;
} stria__sim_state_t;

static double stria__sim_cost(const stria__sim_run_t *x, int r, int s, bool bwd, int from, int to)
{
    double f[STRIA_SIM_NCOEF], c = 0;
    stria_sim_features(x->t, r, s, bwd, f);
    for (int i = from; i < to; i++)
        c += x->coef[i] * f[i];
    return c;
}

/* The dK/dV sum rank r sends on in step s (0: none). */
static uint64_t stria__sim_dkv(const stria_sim_table_t *t, int r, int s)
{
    return t->cells[r * t->n + s].dkv_bytes;
}

/* The transfers of step s on every link: block s + 1 (both ends posted at
 * their step's start; its own size: a packed block's travelling rows) and,
 * backward, the dK/dV sum sent in step s - 1, if one was (a packed rank
 * keeps its own block's part at step 0: nothing to receive at step 1). */
static void stria__sim_links(const stria__sim_run_t *x, stria__sim_state_t *z, int s, int steps,
                             bool bwd)
{
    const stria_sim_table_t *t = x->t;
    const int n = t->n;
    for (int r = 0; r < n; r++) {
        const int p = (r - 1 + n) % n, blk = ((r - s - 1) % n + n) % n;
        const uint64_t sum = bwd && s > 0 && n > 1 ? stria__sim_dkv(t, p, s - 1) : 0;
        const bool kv = s + 1 < steps, dkv = sum > 0;
        double rk = z->start[p] > z->start[r] ? z->start[p] : z->start[r];
        double rd = dkv ? (z->dkv_post[p] > z->start[r] ? z->dkv_post[p] : z->start[r]) : 0;
        if (kv && (!dkv || rk <= rd)) {
            z->kv_arr[r] = stria__sim_xfer(x, r, z->link_free, rk, t->kv_bytes[blk]);
            z->kv_done[p] = z->kv_arr[r];
        }
        if (bwd && s > 0) { /* no sum: nothing to wait for, the buffer free */
            z->dkv_arr[r] = dkv ? stria__sim_xfer(x, r, z->link_free, rd, sum) : 0;
            z->dkv_done[(s - 1) % 2][p] = z->dkv_arr[r];
        }
        if (kv && dkv && rk > rd) {
            z->kv_arr[r] = stria__sim_xfer(x, r, z->link_free, rk, t->kv_bytes[blk]);
            z->kv_done[p] = z->kv_arr[r];
        }
    }
}

/* The dK/dV sum of step s on rank r: the running sum from r - 1 in, this
 * rank's contribution added on the host, sent on. */
static double stria__sim_sum(stria__sim_run_t *x, stria__sim_state_t *z, int r, int s, double t,
                             double add)
{
    if (s > 0)
        t = stria__sim_wait(x, r, t, z->dkv_arr[r]);
    stria__sim_emit(x, r, 1, t, t + add);
    z->dkv_post_next[r] = t + add;
    return t + add;
}

/* Rank r's step s, the transfers known: as stria__kv_step(). On the host the
 * kernel runs on the rank's thread, then the dK/dV sum, then the K/V waits;
 * staged, the kernel runs on the device while the host waits for the next
 * block and copies it up, then (backward) the contribution comes down and
 * the host adds it. Returns the step's compute. */
static double stria__sim_step(stria__sim_run_t *x, stria__sim_state_t *z, int r, int s, int steps,
                              bool bwd)
{
    const stria_sim_link_t *l = x->link;
    const bool staged = l->staging_Bps > 0, kv = s + 1 < steps;
    const double c = stria__sim_cost(x, r, s, bwd, STRIA_SIM_FULL, STRIA_SIM_OPEN) +
                     stria__sim_cost(x, r, s, bwd, STRIA_SIM_HOLE, STRIA_SIM_HOLE + 1);
    const double add = stria__sim_cost(x, r, s, bwd, STRIA_SIM_ADD, STRIA_SIM_ADD + 1);
    double t = z->start[r], kv_next = 0;
    if (bwd && s >= 2) /* the contribution buffer of step s - 2 is free */
        t = stria__sim_wait(x, r, t, z->dkv_done[s % 2][r]);
    const double k0 = t > z->kv_dev[r] ? t : z->kv_dev[r], k1 = k0 + c;
    stria__sim_emit(x, r, 1, k0, k1);
    if (!staged) {
        t = k1;
        if (bwd)
            t = stria__sim_sum(x, z, r, s, t, add);
    }
    if (kv) {
        t = stria__sim_wait(x, r, t, z->kv_arr[r]);
        t = stria__sim_wait(x, r, t, z->kv_done[r]);
        kv_next = z->kv_arr[r];
        if (staged) { /* block s + 1 up, on the copy stream */
            double c0 = t > z->copy_free[r] ? t : z->copy_free[r];
            const int blk = ((r - s - 1) % x->t->n + x->t->n) % x->t->n;
            z->copy_free[r] = kv_next = c0 + (double)x->t->kv_bytes[blk] / l->staging_Bps;
        }
        if (x->span != NULL)
            x->span(x->span_ctx, r, 3, z->start[r], z->kv_done[r]);
    }
    if (staged) { /* the kernel (and backward its contribution coming down) */
        const double down = bwd ? (double)stria__sim_dkv(x->t, r, s) / l->staging_Bps : 0;
        t = stria__sim_wait(x, r, t, k1 + down);
        if (bwd)
            t = stria__sim_sum(x, z, r, s, t, add);
    }
    z->kv_dev[r] = kv_next;
    z->T[r] = t;
    return c + add;
}

static stria_status_t stria__sim_alloc(stria__sim_state_t *z, int n)
{
    double **all[] = {&z->T,           &z->start,       &z->kv_dev,    &z->kv_arr,
                      &z->kv_done,     &z->dkv_arr,     &z->dkv_post,  &z->dkv_post_next,
                      &z->dkv_done[0], &z->dkv_done[1], &z->link_free, &z->copy_free,
                      &z->agree};
    const size_t k = sizeof(all) / sizeof(all[0]);
    double *mem = calloc(k * (size_t)n, sizeof(double));
    if (mem == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "simulate: out of memory");
    for (size_t i = 0; i < k; i++)
        *all[i] = mem + i * (size_t)n;
    return STRIA_OK;
}

/* The dK/dV sums coming home and the agreement's N - 1 rounds. */
static void stria__sim_close(stria__sim_run_t *x, stria__sim_state_t *z, bool bwd)
{
    const int n = x->t->n;
    const double lat = x->link->latency_s;
    if (bwd && n > 1) {
        for (int r = 0; r < n; r++) { /* the sum sent in the last step: tag N */
            int p = (r - 1 + n) % n;
            double ready = z->dkv_post[p] > z->T[r] ? z->dkv_post[p] : z->T[r];
            z->dkv_arr[r] =
                stria__sim_xfer(x, r, z->link_free, ready, stria__sim_dkv(x->t, p, n - 1));
            z->dkv_done[(n - 1) % 2][p] = z->dkv_arr[r];
        }
        for (int r = 0; r < n; r++) {
            double t = stria__sim_wait(x, r, z->T[r], z->dkv_arr[r]);
            t = stria__sim_wait(x, r, t, z->dkv_done[0][r]);
            z->T[r] = stria__sim_wait(x, r, t, z->dkv_done[1][r]);
        }
    }
    memcpy(z->agree, z->T, (size_t)n * sizeof(double));
    for (int round = 1; round < n; round++) {
        double first = z->agree[0], prev = z->agree[n - 1];
        for (int r = 0; r < n; r++) { /* recv from r - 1, send to r + 1 */
            double cur = z->agree[r], next = r + 1 < n ? z->agree[r + 1] : first;
            double m = cur > prev ? cur : prev;
            z->agree[r] = (m > next ? m : next) + lat;
            prev = cur;
        }
    }
    for (int r = 0; r < n; r++) {
        z->T[r] = stria__sim_wait(x, r, z->T[r], z->agree[r]);
        if (bwd) {
            double c = stria__sim_cost(x, r, n - 1, true, STRIA_SIM_LAST, STRIA_SIM_LAST + 1);
            stria__sim_emit(x, r, 1, z->T[r], z->T[r] + c);
            z->T[r] += c;
        }
    }
}

/* The busiest rank's bytes, as the engine counts them, taken apart. */
static void stria__sim_sent(const stria_sim_table_t *t, bool bwd, stria_sim_result_t *res)
{
    const int n = t->n, steps = bwd ? n : t->fwd_steps;
    for (int r = 0; r < n; r++) {
        uint64_t kv = 0, dkv = 0;
        for (int s = 0; s < steps; s++) {
            kv += stria__sim_kv_sent(t, t->cells[r * n + s].src, s, steps);
            dkv += bwd ? stria__sim_dkv(t, r, s) : 0;
        }
        if (kv + dkv > res->bytes_sent || r == 0) {
            res->bytes_sent = kv + dkv;
            res->agree_sent = t->agree_bytes;
            res->kv_sent = kv - t->agree_bytes;
            res->dkv_sent = dkv;
        }
    }
}

stria_status_t stria_sim_pass(const stria_sim_table_t *t, const stria_sim_costs_t *costs,
                              const stria_sim_link_t *link, bool bwd, stria_sim_result_t *res,
                              stria_sim_span_cb span, void *span_ctx)
{
    return stria_sim_pass_at(t, costs, link, 0, bwd, res, span, span_ctx);
}

stria_status_t stria_sim_pass_at(const stria_sim_table_t *t, const stria_sim_costs_t *costs,
                                 const stria_sim_link_t *link, int first, bool bwd,
                                 stria_sim_result_t *res, stria_sim_span_cb span, void *span_ctx)
{
    const int n = t->n, steps = bwd ? n : t->fwd_steps;
    stria__sim_run_t x = {t, bwd ? costs->bwd : costs->fwd, link, span, span_ctx, 0, first};
    stria__sim_state_t z;
    stria_status_t st = stria__sim_alloc(&z, n);
    if (st != STRIA_OK)
        return st;
    memset(res, 0, sizeof(*res));
    res->steps = steps;
    for (int r = 0; r < n; r++) {
        const double down = link->staging_Bps > 0 && steps > 1
                                ? (double)t->kv_bytes[r] / link->staging_Bps
                                : 0.0; /* own K/V to the host, for sending */
        double open = stria__sim_cost(&x, r, 0, bwd, STRIA_SIM_OPEN, STRIA_SIM_OPEN + 1);
        stria__sim_emit(&x, r, 1, down, down + open);
        z.T[r] = z.kv_dev[r] = down + open;
        z.dkv_post[r] = -1;
    }
    for (int s = 0; s < steps; s++) {
        double mx = 0;
        memcpy(z.start, z.T, (size_t)n * sizeof(double));
        stria__sim_links(&x, &z, s, steps, bwd);
        for (int r = 0; r < n; r++) {
            double c = stria__sim_step(&x, &z, r, s, steps, bwd);
            if (s == 0)
                c += stria__sim_cost(&x, r, 0, bwd, STRIA_SIM_OPEN, STRIA_SIM_OPEN + 1);
            if (bwd && s == n - 1)
                c += stria__sim_cost(&x, r, s, true, STRIA_SIM_LAST, STRIA_SIM_LAST + 1);
            res->compute_s += c;
            mx = c > mx ? c : mx;
        }
        res->critical_s += mx;
        memcpy(z.dkv_post, z.dkv_post_next, (size_t)n * sizeof(double));
    }
    stria__sim_close(&x, &z, bwd);
    for (int r = 0; r < n; r++)
        res->pass_s = z.T[r] > res->pass_s ? z.T[r] : res->pass_s;
    res->waited_s = x.waited;
    stria__sim_sent(t, bwd, res);
    free(z.T);
    return STRIA_OK;
}

stria_status_t stria_sim_groups(const stria_sim_table_t *t, const stria_sim_costs_t *costs,
                                const stria_sim_link_t *link, int groups, bool bwd,
                                stria_sim_result_t *res)
{
    if (groups < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "simulate: %d head groups", groups);
    memset(res, 0, sizeof(*res));
    for (int g = 0; g < groups; g++) {
        stria_sim_result_t one;
        stria_status_t st = stria_sim_pass_at(t, costs, link, g * t->n, bwd, &one, NULL, NULL);
        if (st != STRIA_OK)
            return st;
        if (g == 0 || one.pass_s > res->pass_s) { /* the slowest ring's pass, bytes and steps */
            const double compute = res->compute_s, waited = res->waited_s;
            *res = one;
            res->compute_s = compute, res->waited_s = waited;
        }
        res->compute_s += one.compute_s;
        res->waited_s += one.waited_s;
    }
    return STRIA_OK;
}

/* ---- fitting --------------------------------------------------------------- */

/* Solves the k x k system a x = b in place (Gauss with partial pivoting);
 * false when singular. */
static bool stria__sim_solve(double *a, double *b, int k)
{
    for (int i = 0; i < k; i++) {
        int piv = i;
        for (int j = i + 1; j < k; j++)
            if (fabs(a[j * k + i]) > fabs(a[piv * k + i]))
                piv = j;
        if (fabs(a[piv * k + i]) < 1e-300)
            return false;
        for (int j = 0; j < k; j++) {
            double tmp = a[i * k + j];
            a[i * k + j] = a[piv * k + j];
            a[piv * k + j] = tmp;
        }
        double tb = b[i];
        b[i] = b[piv];
        b[piv] = tb;
        for (int j = i + 1; j < k; j++) {
            double f = a[j * k + i] / a[i * k + i];
            for (int m = i; m < k; m++)
                a[j * k + m] -= f * a[i * k + m];
            b[j] -= f * b[i];
        }
    }
    for (int i = k - 1; i >= 0; i--) {
        for (int j = i + 1; j < k; j++)
            b[i] -= a[i * k + j] * b[j];
        b[i] /= a[i * k + i];
    }
    return true;
}

double stria_sim_fit(const double *x, const double *y, int n_rows, double *coef)
{
    enum { K = STRIA_SIM_NCOEF };
    bool on[K];
    double scale[K];
    memset(coef, 0, K * sizeof(double));
    for (int j = 0; j < K; j++) { /* columns scaled to unit size for conditioning */
        scale[j] = 0;
        for (int i = 0; i < n_rows; i++)
            scale[j] = fabs(x[i * K + j]) > scale[j] ? fabs(x[i * K + j]) : scale[j];
        on[j] = scale[j] > 0;
    }
    for (int round = 0; round < K; round++) { /* drop the most negative until none */
        int idx[K], k = 0;
        double a[K * K], b[K];
        for (int j = 0; j < K; j++)
            if (on[j])
                idx[k++] = j;
        if (k == 0)
            break;
        memset(a, 0, sizeof(a));
        memset(b, 0, sizeof(b));
        for (int i = 0; i < n_rows; i++) {
            if (!(y[i] > 0))
                continue;
            double w = 1.0 / (y[i] * y[i]);
            for (int p = 0; p < k; p++) {
                double xp = x[i * K + idx[p]] / scale[idx[p]];
                b[p] += w * xp * y[i];
                for (int q = 0; q < k; q++)
                    a[p * k + q] += w * xp * x[i * K + idx[q]] / scale[idx[q]];
            }
        }
        /* a little ridge: collinear columns (one block size, where tokens
         * and calls go together) share their weight instead of making the
         * system singular; the columns are scaled to 1, so 1e-9 of the mean
         * diagonal changes a well-posed fit by nothing that matters */
        double tr = 0;
        for (int p = 0; p < k; p++)
            tr += a[p * k + p];
        for (int p = 0; p < k; p++)
            a[p * k + p] += 1e-9 * tr / k;
        if (!stria__sim_solve(a, b, k))
            break;
        int worst = -1;
        for (int p = 0; p < k; p++)
            if (b[p] < 0 && (worst < 0 || b[p] < b[worst]))
                worst = p;
        if (worst < 0) {
            for (int p = 0; p < k; p++)
                coef[idx[p]] = b[p] / scale[idx[p]];
            break;
        }
        on[idx[worst]] = false;
    }
    double err = 0;
    int used = 0;
    for (int i = 0; i < n_rows; i++) {
        if (!(y[i] > 0))
            continue;
        double pred = 0;
        for (int j = 0; j < K; j++)
            pred += coef[j] * x[i * K + j];
        err += (pred - y[i]) * (pred - y[i]) / (y[i] * y[i]);
        used++;
    }
    return used > 0 ? sqrt(err / used) : 0.0;
}
