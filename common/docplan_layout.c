/*
 * A call's layout (stria_docplan.h, "a call's layout"): the one rule by
 * which libstria, the workers, the ring engine and the Python package place
 * a call's tokens, and the process's plan cache it takes packed plans from.
 * Above both the layouts (layout.c) and the plans (docplan.c).
 */
#include "stria_docplan.h"

#include <pthread.h>

static stria_docplan_cache_t *shared_cache;
static pthread_once_t shared_once = PTHREAD_ONCE_INIT;

static void shared_make(void)
{
    shared_cache = stria_docplan_cache_new(STRIA_DOCPLAN_SHARED_PLANS);
}

stria_docplan_cache_t *stria_docplan_shared(void)
{
    pthread_once(&shared_once, shared_make);
    return shared_cache;
}

stria_status_t stria_docplan_layout(stria_layout_kind_t kind, const stria_call_shape_t *call,
                                    int n_ranks, stria_layout_t *layout_out,
                                    stria_docplan_t **plan_out)
{
    stria_status_t st;
    if (call == NULL || layout_out == NULL || plan_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_docplan_layout: NULL argument");
    *plan_out = NULL;
    if (kind != STRIA_LAYOUT_PACKED || call->n_cu_seqlens <= 2)
        return stria_layout_init(kind, n_ranks, call->seq_len, layout_out);
    if (n_ranks < 1 || n_ranks > STRIA_LAYOUT_MAX_RANKS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_docplan_layout: %d ranks (must be 1..%d)", n_ranks,
                               STRIA_LAYOUT_MAX_RANKS);
    stria_docplan_cache_t *cache = stria_docplan_shared();
    if (cache == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "document plans: out of memory");
    const int64_t shard = call->seq_len > 0 ? (call->seq_len + n_ranks - 1) / n_ranks : 1;
    if ((st = stria_docplan_cache_get(cache, call, n_ranks, shard, plan_out)) != STRIA_OK)
        return st;
    if ((st = stria_layout_init_plan(*plan_out, layout_out)) != STRIA_OK) {
        stria_docplan_unref(*plan_out);
        *plan_out = NULL;
    }
    return st;
}
