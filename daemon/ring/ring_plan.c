/* What the engine does in a pass, without running it (stria_ring_plan_*):
 * the same position tables, block visibility and kernel parameters as a pass
 * object (stria__visible, stria__params), and the bytes each step posts. */
#include "ring_int.h"

#include <stdlib.h>
#include <string.h>

stria_attn_params_t stria_ring_shape_attn_params(const stria_ring_shape_t *shape)
{
    const stria_call_shape_t *c = &shape->call;
    stria_attn_params_t a;
    memset(&a, 0, sizeof(a));
    a.batch = c->batch;
    a.q_tokens = a.kv_tokens = c->seq_len;
    a.heads = shape->heads;
    a.kv_heads = shape->kv_heads;
    a.head_dim = shape->head_dim;
    a.scale = c->scale;
    a.causal = c->causal;
    a.cu_seqlens = c->cu_seqlens;
    a.n_cu_seqlens = c->n_cu_seqlens;
    a.has_window = c->has_window;
    a.window_left = c->window_left;
    a.window_right = c->window_right;
    return a;
}

struct stria_ring_plan {
    stria_ring_pass_t p; /* the fields the engine's rules read; rank set per query */
};

/* The lowest and highest position of n runs. */
static void stria__run_bounds(const stria_pos_run_t *runs, size_t n, int64_t *lo, int64_t *hi)
{
    *lo = INT64_MAX;
    *hi = INT64_MIN;
    for (size_t i = 0; i < n; i++) {
        int64_t last = runs[i].first + (runs[i].count - 1) * runs[i].stride;
        int64_t a = runs[i].stride > 0 ? runs[i].first : last;
        int64_t z = runs[i].stride > 0 ? last : runs[i].first;
        *lo = a < *lo ? a : *lo;
        *hi = z > *hi ? z : *hi;
    }
}

stria_status_t stria__pass_positions(stria_ring_pass_t *p)
{
    const size_t n = (size_t)p->n;
    size_t total = 0;
    for (int r = 0; r < p->n; r++) {
        stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS];
        size_t nr;
        (void)stria_layout_runs(&p->layout, r, false, &nr, tmp);
        total += nr;
    }
    p->runs = calloc(n, sizeof(*p->runs));
    p->n_runs = calloc(2 * n, sizeof(*p->n_runs)); /* n_runs, then travel_runs */
    p->valid = calloc(6 * n, sizeof(*p->valid));   /* valid, pos_*, travel, tpos_* */
    stria_pos_run_t *store = calloc(total > 0 ? total : 1, sizeof(*store));
    if (p->runs == NULL || p->n_runs == NULL || p->valid == NULL || store == NULL) {
        free(store);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "ring: out of memory for %d ranks", p->n);
    }
    p->travel_runs = p->n_runs + n;
    p->pos_min = p->valid + n;
    p->pos_max = p->pos_min + n;
    p->travel = p->pos_max + n;
    p->tpos_min = p->travel + n;
    p->tpos_max = p->tpos_min + n;
    for (int r = 0; r < p->n; r++) {
        stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS];
        size_t nr;
        const stria_layout_run_t *lr = stria_layout_runs(&p->layout, r, false, &nr, tmp);
        p->runs[r] = store;
        p->n_runs[r] = nr;
        for (size_t i = 0; i < nr; i++) {
            store[i] = (stria_pos_run_t){lr[i].first, lr[i].stride, lr[i].count};
            p->valid[r] += lr[i].count;
        }
        store += nr;
        stria__run_bounds(p->runs[r], nr, &p->pos_min[r], &p->pos_max[r]);
        if (p->plan == NULL) {
            p->travel[r] = p->valid[r];
            p->travel_runs[r] = nr;
            p->tpos_min[r] = p->pos_min[r];
            p->tpos_max[r] = p->pos_max[r];
            continue;
        }
        p->travel[r] = p->plan->travel[r];
        p->travel_runs[r] = p->plan->travel_runs[r];
        stria__run_bounds(p->runs[r], p->travel_runs[r], &p->tpos_min[r], &p->tpos_max[r]);
    }
    return STRIA_OK;
}

void stria__pass_positions_free(stria_ring_pass_t *p)
{
    if (p->runs != NULL)
        free(p->runs[0]); /* every rank's runs, one allocation */
    free(p->runs);
    free(p->n_runs); /* and travel_runs */
    free(p->valid);  /* and the bounds and travel */
    p->runs = NULL;
    p->n_runs = NULL;
    p->valid = NULL;
}

void stria_ring_plan_destroy(stria_ring_plan_t *plan)
{
    if (plan == NULL)
        return;
    stria__pass_positions_free(&plan->p);
    stria_docplan_unref(plan->p.plan);
    free(plan);
}

stria_status_t stria_ring_plan_create(const stria_ring_shape_t *shape, stria_layout_kind_t layout,
                                      int n_ranks, bool all_hops, stria_ring_plan_t **plan)
{
    stria_ring_plan_t *pl;
    stria_status_t st;
    if (shape == NULL || plan == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_ring_plan_create: NULL argument");
    if (n_ranks < 1 || n_ranks > 65536)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_ring_plan_create: %d ranks (must be 1..65536)", n_ranks);
    if ((st = stria__check_shape(shape)) != STRIA_OK)
        return st;
    if ((pl = calloc(1, sizeof(*pl))) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_ring_plan_create: out of memory");
    pl->p.shape = *shape;
    pl->p.n = n_ranks;
    if ((st = stria_docplan_layout(layout, &shape->call, n_ranks, &pl->p.layout, &pl->p.plan)) !=
            STRIA_OK ||
        (st = stria__pass_positions(&pl->p)) != STRIA_OK) {
        stria_ring_plan_destroy(pl);
        return st;
    }
    pl->p.fwd_steps = all_hops ? n_ranks : stria__fwd_steps(&pl->p);
    *plan = pl;
    return STRIA_OK;
}

const stria_layout_t *stria_ring_plan_layout(const stria_ring_plan_t *plan)
{
    return plan != NULL ? &plan->p.layout : NULL;
}

int stria_ring_plan_steps(const stria_ring_plan_t *plan, bool backward)
{
    return plan == NULL ? 0 : backward ? plan->p.n : plan->p.fwd_steps;
}

/* Bytes of rank j's K/V message (dkv: its fp32 dK/dV sum). */
static uint64_t stria__plan_bytes(const stria_ring_pass_t *p, int j, bool dkv)
{
    const uint64_t kv = (uint64_t)(p->shape.call.batch * stria__msg_rows(p, j) * p->shape.kv_heads *
                                   p->shape.head_dim);
    return 2 * kv * (dkv ? sizeof(float) : stria_dtype_size(p->shape.dtype));
}

stria_status_t stria_ring_plan_step(stria_ring_plan_t *plan, int rank, int step, bool backward,
                                    stria_ring_plan_step_t *out)
{
    if (plan == NULL || out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_ring_plan_step: NULL argument");
    stria_ring_pass_t *p = &plan->p;
    const int N = stria_ring_plan_steps(plan, backward); /* the call's K/V steps */
    if (rank < 0 || rank >= p->n || step < 0 || step >= N)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_ring_plan_step: rank %d, step %d of a %s pass of %d steps "
                               "in a ring of %d",
                               rank, step, backward ? "backward" : "forward", N, p->n);
    const int src = (rank - step + p->n) % p->n, next = (rank - step - 1 + p->n) % p->n;
    const bool packed = p->plan != NULL;
    p->rank = rank;
    out->src_rank = src;
    out->computed = stria__visible(p, src, step);
    out->bytes_sent = out->bytes_recv = 0;
    if (step + 1 < N) { /* block step + 1 arrives, block step leaves */
        out->bytes_sent += stria__plan_bytes(p, src, false);
        out->bytes_recv += stria__plan_bytes(p, next, false);
    }
    /* the running dK/dV sum of the block from rank - 1 (packed: the sum of a
     * block starts one rank after its owner, whose own part stays home) */
    if (backward && step > (packed ? 1 : 0))
        out->bytes_recv += stria__plan_bytes(p, src, true);
    if (backward && N > 1 && (!packed || step > 0)) /* this rank's sum sent on */
        out->bytes_sent += stria__plan_bytes(p, src, true);
    if (step == N - 1) {
        if (backward && N > 1) /* the sum of this rank's own block comes home */
            out->bytes_recv += stria__plan_bytes(p, rank, true);
        out->bytes_sent += 8 * (uint64_t)(p->n - 1); /* the agreement */
        out->bytes_recv += 8 * (uint64_t)(p->n - 1);
    }
    return STRIA_OK;
}

bool stria_ring_plan_params(stria_ring_plan_t *plan, int rank, int src, stria_attn_params_t *out)
{
    stria_ring_pass_t *p = &plan->p;
    if (rank < 0 || rank >= p->n || src < 0 || src >= p->n || p->valid[rank] == 0 ||
        p->valid[src] == 0 || (src != rank && p->travel[src] == 0))
        return false;
    p->rank = rank;
    *out = stria__params(p, src, src != rank);
    return true;
}
