/* Where a job runs: the ring order of the workers, a window of consecutive
 * ring workers, the workers a spec's placement names rank by rank, or a
 * spare for a replacement's lost rank. Everything runs on the RPC loop
 * thread. */
#include "coord_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- ring order ---------------------------------------------------------- */

static int stria__ring_cmp(const void *a, const void *b)
{
    const stria__cworker_t *x = *(stria__cworker_t *const *)a;
    const stria__cworker_t *y = *(stria__cworker_t *const *)b;
    int c = strcmp(x->host, y->host);
    return c != 0 ? c : strcmp(x->rpc_address, y->rpc_address);
}

/* The ring: healthy, non-draining workers by (host, RPC address). `out` has
 * room for every worker. */
uint32_t stria__place_ring(const stria_coord_t *co, stria__cworker_t **out)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < co->n_workers; i++)
        if (!co->workers[i]->dead && !co->workers[i]->draining)
            out[n++] = co->workers[i];
    qsort(out, n, sizeof(*out), stria__ring_cmp);
    return n;
}

/* Workers in ring order, then draining, then dead ones (each by host and
 * address); *n_ring_out of them form the ring. NULL when out of memory. */
stria__cworker_t **stria__place_ordered(const stria_coord_t *co, uint32_t *n_ring_out)
{
    stria__cworker_t **all = malloc((co->n_workers + 1) * sizeof(*all));
    uint32_t n, k;
    if (all == NULL)
        return NULL;
    n = stria__place_ring(co, all);
    *n_ring_out = n;
    k = n;
    for (int pass = 0; pass < 2; pass++) {
        uint32_t first = k;
        for (uint32_t i = 0; i < co->n_workers; i++) {
            stria__cworker_t *w = co->workers[i];
            if ((pass == 0 && !w->dead && w->draining) || (pass == 1 && w->dead))
                all[k++] = w;
        }
        qsort(all + first, k - first, sizeof(*all), stria__ring_cmp);
    }
    return all;
}

/* ---- windows and placement ----------------------------------------------- */

/* Free memory is what is not reserved and not promised to queued jobs:
 * marks every worker's queued demand, and blocks the workers of queued jobs
 * (a job that must wait blocks its workers for every later job). */
static void stria__mark_queued(stria_coord_t *co)
{
    for (uint32_t i = 0; i < co->n_workers; i++) {
        co->workers[i]->queued_demand = 0;
        co->workers[i]->blocked = false;
    }
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (j->state != S_PENDING)
            continue;
        for (uint32_t r = 0; r < j->n_ranks; r++) {
            j->ranks[r].worker->queued_demand += j->mem_per_rank;
            j->ranks[r].worker->blocked = true;
        }
    }
}

/* Whether a job needing `need` bytes could start on w now. */
static bool stria__fits_worker(const stria__cworker_t *w, uint64_t need)
{
    return !w->blocked && w->memory_bytes >= w->reserved && w->memory_bytes - w->reserved >= need;
}

int64_t stria__place_window(stria_coord_t *co, stria__cworker_t **ring, uint32_t count, uint32_t n,
                            uint64_t need, bool *now_out, uint64_t *best_cap_out)
{
    int64_t best = -1;
    uint64_t best_load = UINT64_MAX, best_cap = 0;

    stria__mark_queued(co);
    for (uint32_t s = 0; s + n <= count; s++) {
        uint64_t cap = UINT64_MAX, load = 0;
        bool fits = true;
        for (uint32_t k = s; k < s + n; k++) {
            stria__cworker_t *w = ring[k];
            if (w->memory_bytes < cap)
                cap = w->memory_bytes;
            load += w->reserved + w->queued_demand;
            if (!stria__fits_worker(w, need))
                fits = false;
        }
        if (cap > best_cap)
            best_cap = cap;
        if (cap < need)
            continue;
        if (fits) {
            *now_out = true;
            return s;
        }
        if (load < best_load) {
            best_load = load;
            best = s;
        }
    }
    *now_out = false;
    *best_cap_out = best_cap;
    return best;
}

/* How well w suits a rank placed on (host, device index): -1 not at all
 * (taken by an earlier rank, too small, or on another host when `on_host`),
 * else higher is better: the device index, then room now, then the lighter
 * load (*load_out). */
static int stria__place_score(const stria__cworker_t *w, const Stria__V1__JobSpec__Placement *p,
                              bool on_host, uint64_t need, stria__cworker_t **taken,
                              uint32_t n_taken, uint64_t *load_out)
{
    for (uint32_t i = 0; i < n_taken; i++)
        if (taken[i] == w)
            return -1;
    if (w->memory_bytes < need || (on_host && strcmp(w->host, p->host) != 0))
        return -1;
    *load_out = w->reserved + w->queued_demand;
    bool same_device =
        on_host && p->has_device_index && w->has_device_index && w->device_index == p->device_index;
    return (same_device ? 2 : 0) + (stria__fits_worker(w, need) ? 1 : 0);
}

/* The best worker of the ring for rank r's placement, or NULL. */
static stria__cworker_t *stria__place_best(stria__cworker_t **ring, uint32_t count,
                                           const Stria__V1__JobSpec__Placement *p, bool on_host,
                                           uint64_t need, stria__cworker_t **taken, uint32_t r)
{
    stria__cworker_t *best = NULL;
    int best_score = -1;
    uint64_t best_load = UINT64_MAX;
    for (uint32_t i = 0; i < count; i++) {
        uint64_t load = 0;
        int score = stria__place_score(ring[i], p, on_host, need, taken, r, &load);
        if (score > best_score || (score == best_score && score >= 0 && load < best_load)) {
            best = ring[i];
            best_score = score;
            best_load = load;
        }
    }
    return best_score >= 0 ? best : NULL;
}

/* Why no worker of host `h` can take rank r: none there, all taken, or all
 * too small. */
static stria_status_t stria__place_refusal(stria__cworker_t **ring, uint32_t count, uint32_t r,
                                           const char *h, uint64_t need, stria__cworker_t **taken)
{
    uint32_t on_host = 0, free_ones = 0;
    uint64_t cap = 0;
    char hosts[512] = "";
    size_t used = 0;
    for (uint32_t i = 0; i < count; i++) {
        const stria__cworker_t *w = ring[i];
        bool listed = false;
        for (uint32_t k = 0; k < i && !listed; k++)
            listed = strcmp(ring[k]->host, w->host) == 0;
        if (!listed && used + strlen(w->host) + 3 < sizeof(hosts))
            used += (size_t)snprintf(hosts + used, sizeof(hosts) - used, "%s'%s'", used ? ", " : "",
                                     w->host);
        if (strcmp(w->host, h) != 0)
            continue;
        on_host++;
        bool is_taken = false;
        for (uint32_t k = 0; k < r; k++)
            is_taken = is_taken || taken[k] == w;
        if (!is_taken) {
            free_ones++;
            if (w->memory_bytes > cap)
                cap = w->memory_bytes;
        }
    }
    if (on_host == 0)
        return stria_error_set(STRIA_ERR_BUSY,
                               "rank %u is placed on host '%s', which has no worker in the ring "
                               "(hosts with workers: %s); set placement_fallback to take another "
                               "worker",
                               r, h, used ? hosts : "none");
    if (free_ones == 0)
        return stria_error_set(STRIA_ERR_BUSY,
                               "rank %u is placed on host '%s', whose %u worker(s) in the ring "
                               "are taken by earlier ranks of the job",
                               r, h, on_host);
    return stria_error_set(STRIA_ERR_NO_MEMORY,
                           "rank %u is placed on host '%s', whose workers offer at most %llu MiB; "
                           "the job needs %llu MiB per rank",
                           r, h, (unsigned long long)(cap >> 20), (unsigned long long)(need >> 20));
}

stria_status_t stria__place_named(stria_coord_t *co, const Stria__V1__JobSpec *s,
                                  stria__cworker_t **ring, uint32_t count, uint32_t n,
                                  uint64_t need, stria__cworker_t **out, bool *fallback,
                                  bool *now_out)
{
    stria__mark_queued(co);
    *now_out = true;
    for (uint32_t r = 0; r < n; r++) {
        const Stria__V1__JobSpec__Placement *p = s->placement[r];
        stria__cworker_t *w = stria__place_best(ring, count, p, true, need, out, r);
        fallback[r] = false;
        if (w == NULL && s->placement_fallback) {
            w = stria__place_best(ring, count, p, false, need, out, r);
            fallback[r] = w != NULL;
        }
        if (w == NULL && !s->placement_fallback)
            return stria__place_refusal(ring, count, r, p->host, need, out);
        if (w == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY,
                                   "rank %u: no worker of the ring is free for it (the job needs "
                                   "%llu MiB per rank, on %u distinct workers)",
                                   r, (unsigned long long)(need >> 20), n);
        out[r] = w;
        if (!stria__fits_worker(w, need))
            *now_out = false;
    }
    return STRIA_OK;
}

/* How well w suits rank r of job j in place of `lost`: -1 not at all, else
 * higher is better (on the rank's device, idle, on the lost worker's host). */
static int stria__spare_score(const stria_coord_t *co, const stria__cjob_t *j, uint32_t r,
                              const stria__cworker_t *w, const stria__cworker_t *lost, bool on_host,
                              stria__cworker_t **taken, uint32_t n_taken)
{
    const stria__crank_t *cr = &j->ranks[r];
    if (stria__cjob_has_worker(j, w) || w->awaiting_jobs || !stria__fits_worker(w, j->mem_per_rank))
        return -1;
    /* silent for two periods: maybe the next to die */
    if (stria_time_now() - w->last_seen > 2 * co->heartbeat_period_s)
        return -1;
    for (uint32_t i = 0; i < n_taken; i++)
        if (taken[i] == w)
            return -1;
    if (on_host && cr->place_host != NULL && strcmp(w->host, cr->place_host) != 0)
        return -1;
    bool device = cr->place_host != NULL && cr->place_has_device && w->has_device_index &&
                  w->device_index == cr->place_device && strcmp(w->host, cr->place_host) == 0;
    return (device ? 4 : 0) + (w->reserved == 0 ? 2 : 0) + (strcmp(w->host, lost->host) == 0);
}

stria__cworker_t *stria__place_spare(stria_coord_t *co, const stria__cjob_t *j, uint32_t r,
                                     stria__cworker_t **taken, uint32_t n_taken, bool *fallback,
                                     char *why, size_t why_len)
{
    stria__cworker_t **ring = malloc((co->n_workers + 1) * sizeof(*ring));
    stria__cworker_t *best = NULL;
    const stria__crank_t *cr = &j->ranks[r];
    if (ring == NULL) {
        snprintf(why, why_len, "out of memory");
        return NULL;
    }
    uint32_t count = stria__place_ring(co, ring);
    stria__mark_queued(co);
    *fallback = false;
    for (int pass = 0; pass < 2 && best == NULL; pass++) {
        bool on_host = pass == 0;
        int best_score = -1;
        uint64_t best_load = UINT64_MAX;
        if (!on_host && (cr->place_host == NULL || !j->spec.placement_fallback))
            break;
        for (uint32_t i = 0; i < count; i++) {
            int score = stria__spare_score(co, j, r, ring[i], cr->worker, on_host, taken, n_taken);
            uint64_t load = ring[i]->reserved + ring[i]->queued_demand;
            if (score > best_score || (score == best_score && score >= 0 && load < best_load)) {
                best = ring[i];
                best_score = score;
                best_load = load;
            }
        }
        if (best_score < 0)
            best = NULL;
        *fallback = best != NULL && !on_host;
    }
    free(ring);
    if (best == NULL && cr->place_host != NULL && !j->spec.placement_fallback)
        snprintf(why, why_len,
                 "no healthy worker on host '%s' (rank %u's placement) outside the job has %llu "
                 "MiB free now",
                 cr->place_host, r, (unsigned long long)(j->mem_per_rank >> 20));
    else if (best == NULL)
        snprintf(why, why_len, "no healthy worker outside the job has %llu MiB free now",
                 (unsigned long long)(j->mem_per_rank >> 20));
    return best;
}
