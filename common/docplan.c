/*
 * Document plans (stria_docplan.h): documents kept whole on the rank their
 * work fits, the rest dealt round-robin as striping deals them. The steps of
 * stria_docplan_make() are numbered as in the header.
 */
#include "stria_docplan.h"
#include "stria_util.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* The most tokens a plan takes, padding included: its counted work stays
 * below 2^62. */
#define MAX_PLAN_TOKENS ((int64_t)1 << 31)

typedef struct {
    int64_t start, len;
    uint64_t work;
} doc_t;

/* A document as step 2 sorts them: its effective load (see keep_docs). */
typedef struct {
    __int128 load;
    int64_t len;
    size_t doc;
} doc_key_t;

/* Runs of positions growing as positions are added in increasing order. */
typedef struct {
    stria_layout_run_t *runs;
    size_t n, cap;
} runs_t;

/* One plan being made: the inputs, the documents and one round's state. */
typedef struct {
    const stria_call_shape_t *call;
    int n;
    int64_t L, seq_len;
    doc_t *docs;
    size_t n_docs;
    doc_key_t *order; /* candidates for keeping, largest first */
    bool *forced;     /* documents spread by step 4 */
    int32_t *rank;    /* per document: kept on, or -1 */
    int64_t *kept_tok, *room, *pad;
    uint64_t *kept_work, *work;
    int *heap; /* ranks with room, by when their next token is due */
    long *got; /* per rank: filler tokens dealt so far */
    int n_heap;
    runs_t *spread, *padr; /* per rank */
} build_t;

int64_t stria_docplan_query_work(const stria_call_shape_t *call, int64_t i, int64_t len)
{
    int64_t lo = 0, hi = len - 1;
    if (call->has_window && call->window_left >= 0 && i - call->window_left > lo)
        lo = i - call->window_left;
    if (call->causal)
        hi = i;
    else if (call->has_window && call->window_right >= 0 && i + call->window_right < hi)
        hi = i + call->window_right;
    return hi - lo + 1;
}

uint64_t stria_docplan_digest(const stria_call_shape_t *call, int n_ranks, int64_t shard_tokens)
{
    uint64_t h = STRIA_FNV64_INIT;
    h = stria_fnv64(h, STRIA_DOCPLAN_VERSION);
    h = stria_fnv64(h, (uint64_t)n_ranks);
    h = stria_fnv64(h, (uint64_t)shard_tokens);
    h = stria_fnv64(h, (uint64_t)call->seq_len);
    h = stria_fnv64(h, call->causal);
    h = stria_fnv64(h, call->has_window);
    h = stria_fnv64(h, (uint64_t)call->window_left);
    h = stria_fnv64(h, (uint64_t)call->window_right);
    h = stria_fnv64(h, call->n_cu_seqlens);
    for (size_t i = 0; i < call->n_cu_seqlens; i++)
        h = stria_fnv64(h, (uint64_t)call->cu_seqlens[i]);
    return h;
}

/* ---- runs ------------------------------------------------------------------ */

static bool runs_room(runs_t *a)
{
    stria_layout_run_t *more = stria_grow(a->runs, &a->cap, a->n + 1, sizeof(*a->runs), 8);
    if (more == NULL)
        return false;
    a->runs = more;
    return true;
}

/* Adds position p, greater than every position added before. */
static bool runs_push(runs_t *a, int64_t p)
{
    if (a->n > 0) {
        stria_layout_run_t *last = &a->runs[a->n - 1];
        if (last->count == 1) {
            last->stride = p - last->first;
            last->count = 2;
            return true;
        }
        if (p == last->first + last->stride * last->count) {
            last->count++;
            return true;
        }
    }
    if (!runs_room(a))
        return false;
    a->runs[a->n++] = (stria_layout_run_t){p, 1, 1};
    return true;
}

/* Adds positions [start, start + len), after every position added before. */
static bool runs_push_range(runs_t *a, int64_t start, int64_t len)
{
    if (a->n > 0) {
        stria_layout_run_t *last = &a->runs[a->n - 1];
        if ((last->stride == 1 || last->count == 1) && last->first + last->count == start) {
            last->stride = 1;
            last->count += len;
            return true;
        }
    }
    if (!runs_room(a))
        return false;
    a->runs[a->n++] = (stria_layout_run_t){start, 1, len};
    return true;
}

/* ---- the steps ------------------------------------------------------------- */

/* Step 1. */
static stria_status_t count_docs(build_t *b)
{
    const stria_call_shape_t *c = b->call;
    b->n_docs = c->n_cu_seqlens > 1 ? c->n_cu_seqlens - 1 : 1;
    b->docs = calloc(b->n_docs, sizeof(*b->docs));
    if (b->docs == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "document plan: out of memory");
    for (size_t d = 0; d < b->n_docs; d++) {
        doc_t *doc = &b->docs[d];
        doc->start = c->n_cu_seqlens > 1 ? c->cu_seqlens[d] : 0;
        doc->len = (c->n_cu_seqlens > 1 ? c->cu_seqlens[d + 1] : c->seq_len) - doc->start;
        for (int64_t i = 0; i < doc->len; i++)
            doc->work += (uint64_t)stria_docplan_query_work(c, i, doc->len);
    }
    return STRIA_OK;
}

/* Larger effective load (in size) first, then longer, then earlier. */
static int by_load(const void *pa, const void *pb)
{
    const doc_key_t *x = pa, *y = pb;
    const __int128 ax = x->load < 0 ? -x->load : x->load, ay = y->load < 0 ? -y->load : y->load;
    if (ax != ay)
        return ax > ay ? -1 : 1;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;
    return x->doc < y->doc ? -1 : x->doc > y->doc;
}

typedef __int128 i128;

/* The spread work and the room it fills if every document that cannot be
 * kept (too long, too much work, or forced) is spread: their ratio is the
 * work a kept token displaces (step 2's effective load). */
static void spread_estimate(const build_t *b, uint64_t cap, uint64_t *work, int64_t *room)
{
    *work = 0;
    *room = (int64_t)b->n * b->L - b->seq_len; /* the padding */
    for (size_t d = 0; d < b->n_docs; d++) {
        const doc_t *x = &b->docs[d];
        if (x->len > b->L || x->work > cap || b->forced[d]) {
            *work += x->work;
            *room += x->len;
        }
    }
}

/* Step 2: the documents kept, and where. A rank's load is its kept work
 * less the spread work its kept tokens displace (all scaled by the room, to
 * stay in integers); documents go largest effective load (in size) first:
 * one that adds load to the rank of least load, one that lowers it (a short
 * document displaces more spread work than it brings) to the rank of most,
 * among the ranks with room for its tokens whose kept work stays within
 * cap. */
static void keep_docs(build_t *b, uint64_t cap)
{
    uint64_t sw;
    int64_t sr;
    size_t n_cand = 0;
    spread_estimate(b, cap, &sw, &sr);
    const i128 R = sr > 0 ? sr : 1;
    memset(b->kept_tok, 0, (size_t)b->n * sizeof(*b->kept_tok));
    memset(b->kept_work, 0, (size_t)b->n * sizeof(*b->kept_work));
    for (size_t d = 0; d < b->n_docs; d++) {
        const doc_t *x = &b->docs[d];
        b->rank[d] = -1;
        if (x->len > 0 && x->len <= b->L && x->work <= cap && !b->forced[d])
            b->order[n_cand++] = (doc_key_t){(i128)x->work * R - (i128)sw * x->len, x->len, d};
    }
    qsort(b->order, n_cand, sizeof(*b->order), by_load);
    for (size_t k = 0; k < n_cand; k++) {
        const doc_t *doc = &b->docs[b->order[k].doc];
        i128 best_load = 0;
        int best = -1;
        const bool lowers = b->order[k].load < 0;
        for (int r = 0; r < b->n; r++) {
            i128 load = (i128)b->kept_work[r] * R - (i128)sw * b->kept_tok[r];
            if (b->kept_tok[r] + doc->len <= b->L && b->kept_work[r] + doc->work <= cap &&
                (best < 0 || (lowers ? load > best_load : load < best_load)))
                best = r, best_load = load;
        }
        if (best < 0)
            continue;
        b->rank[b->order[k].doc] = best;
        b->kept_tok[best] += doc->len;
        b->kept_work[best] += doc->work;
    }
}

/* Where one document's tokens lie, rank by rank (stria_docplan_count). */
typedef struct {
    int n, max_hop;
    int64_t *kmin, *kmax; /* per rank: the document's positions there */
    uint32_t *seen;       /* per rank: 1 + the document they belong to */
    int *touched, n_touched;
} hops_t;

/* The farthest hop between the ranks that hold one document's tokens:
 * rank r's queries may see rank j's keys (from the bounds: conservative). */
static void doc_hops(const stria_call_shape_t *c, hops_t *h)
{
    for (int x = 0; x < h->n_touched && h->max_hop < h->n - 1; x++) {
        for (int y = 0; y < h->n_touched; y++) {
            int r = h->touched[x], j = h->touched[y];
            int hop = (r - j + h->n) % h->n;
            if (hop <= h->max_hop)
                continue;
            if (c->causal && h->kmin[j] > h->kmax[r])
                continue;
            if (c->has_window && c->window_left >= 0 && h->kmax[j] < h->kmin[r] - c->window_left)
                continue;
            if (!c->causal && c->has_window && c->window_right >= 0 &&
                h->kmin[j] > h->kmax[r] + c->window_right)
                continue;
            h->max_hop = hop;
        }
    }
}

stria_status_t stria_docplan_count(const stria_call_shape_t *call, int n_ranks,
                                   const int32_t *rank_of, uint64_t *work_out, int *steps_out)
{
    stria_status_t st;
    if (call == NULL || rank_of == NULL || work_out == NULL || steps_out == NULL || n_ranks < 1 ||
        n_ranks > STRIA_LAYOUT_MAX_RANKS)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_docplan_count: bad argument");
    if ((st = stria_call_masks_check(call)) != STRIA_OK)
        return st;
    hops_t h = {.n = n_ranks};
    h.kmin = calloc((size_t)n_ranks, sizeof(int64_t));
    h.kmax = calloc((size_t)n_ranks, sizeof(int64_t));
    h.seen = calloc((size_t)n_ranks, sizeof(uint32_t));
    h.touched = calloc((size_t)n_ranks, sizeof(int));
    if (h.kmin == NULL || h.kmax == NULL || h.seen == NULL || h.touched == NULL) {
        free(h.kmin), free(h.kmax), free(h.seen), free(h.touched);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "document plan: out of memory");
    }
    memset(work_out, 0, (size_t)n_ranks * sizeof(*work_out));
    const size_t n_docs = call->n_cu_seqlens > 1 ? call->n_cu_seqlens - 1 : 1;
    for (size_t d = 0; d < n_docs && st == STRIA_OK; d++) {
        int64_t start = call->n_cu_seqlens > 1 ? call->cu_seqlens[d] : 0;
        int64_t len = (call->n_cu_seqlens > 1 ? call->cu_seqlens[d + 1] : call->seq_len) - start;
        h.n_touched = 0;
        for (int64_t i = 0; i < len; i++) {
            int r = rank_of[start + i];
            if (r < 0 || r >= n_ranks) {
                st = stria_error_set(STRIA_ERR_INVALID_ARG,
                                     "stria_docplan_count: position %lld on rank %d of %d",
                                     (long long)(start + i), r, n_ranks);
                break;
            }
            work_out[r] += (uint64_t)stria_docplan_query_work(call, i, len);
            if (h.seen[r] != (uint32_t)d + 1) {
                h.seen[r] = (uint32_t)d + 1;
                h.kmin[r] = start + i;
                h.touched[h.n_touched++] = r;
            }
            h.kmax[r] = start + i;
        }
        doc_hops(call, &h);
    }
    *steps_out = h.max_hop + 1;
    free(h.kmin), free(h.kmax), free(h.seen), free(h.touched);
    return st;
}

/* Whether rank a's next token is due before rank b's: rank r's k-th
 * filler token (k from 0) is due at (2k + 1) / (2 room_r) of the deal, so
 * every rank gets its share of every part of the sequence, and equal rooms
 * deal round-robin from rank 0 (striping). */
static bool due_before(const build_t *b, int x, int y)
{
    uint64_t dx = (uint64_t)(2 * b->got[x] + 1) * (uint64_t)b->room[y];
    uint64_t dy = (uint64_t)(2 * b->got[y] + 1) * (uint64_t)b->room[x];
    return dx != dy ? dx < dy : x < y;
}

static void heap_down(build_t *b, int i)
{
    for (;;) {
        int l = 2 * i + 1, m = i;
        if (l < b->n_heap && due_before(b, b->heap[l], b->heap[m]))
            m = l;
        if (l + 1 < b->n_heap && due_before(b, b->heap[l + 1], b->heap[m]))
            m = l + 1;
        if (m == i)
            return;
        int t = b->heap[i];
        b->heap[i] = b->heap[m];
        b->heap[m] = t;
        i = m;
    }
}

/* The rank the next filler token goes to. */
static int deal_one(build_t *b)
{
    int r = b->heap[0];
    if (++b->got[r] == b->room[r])
        b->heap[0] = b->heap[--b->n_heap];
    heap_down(b, 0);
    return r;
}

/* Step 3 (and the work of step 4): spread tokens, then the padding, dealt
 * over the ranks in proportion to their room. The final deal also records
 * the runs. */
static stria_status_t deal(build_t *b, bool final)
{
    b->n_heap = 0;
    for (int r = 0; r < b->n; r++) {
        b->room[r] = b->L - b->kept_tok[r];
        b->got[r] = 0;
        b->work[r] = b->kept_work[r];
        b->spread[r].n = b->padr[r].n = 0;
        b->pad[r] = 0;
        if (b->room[r] > 0)
            b->heap[b->n_heap++] = r;
    }
    for (int i = b->n_heap / 2 - 1; i >= 0; i--)
        heap_down(b, i);
    for (size_t d = 0; d < b->n_docs; d++) {
        const doc_t *doc = &b->docs[d];
        if (b->rank[d] >= 0 || doc->len == 0)
            continue;
        for (int64_t i = 0; i < doc->len; i++) {
            int r = deal_one(b);
            int64_t pos = doc->start + i;
            b->work[r] += (uint64_t)stria_docplan_query_work(b->call, i, doc->len);
            if (!final)
                continue;
            if (!runs_push(&b->spread[r], pos))
                return stria_error_set(STRIA_ERR_NO_MEMORY, "document plan: out of memory");
        }
    }
    for (int64_t pos = b->seq_len; pos < (int64_t)b->n * b->L; pos++) {
        int r = deal_one(b);
        b->pad[r]++;
        if (final && !runs_push(&b->padr[r], pos))
            return stria_error_set(STRIA_ERR_NO_MEMORY, "document plan: out of memory");
    }
    return STRIA_OK;
}

/* Whether rank work `work` is over the tolerance of the mean (in integers:
 * the decision must not depend on a host's floating point). */
static bool over(uint64_t work, int n, uint64_t total)
{
    return (i128)work * n * 1000 > (i128)total * (1000 + STRIA_DOCPLAN_TOLERANCE_PERMILLE);
}

/* Step 4: spreads the largest kept document (by work, then length) of every
 * rank over the tolerance, or, where those keep none, the longest kept
 * document (it frees the most room). The number spread: 0 when nothing is
 * kept, or when the ranks balance (*max_mean: the busiest over the mean). */
static size_t force_more(build_t *b, uint64_t total, double *max_mean)
{
    uint64_t most = 0;
    size_t forced = 0;
    long longest = -1;
    for (int r = 0; r < b->n; r++)
        most = b->work[r] > most ? b->work[r] : most;
    *max_mean = total > 0 ? (double)most * b->n / (double)total : 1.0;
    if (!over(most, b->n, total))
        return 0;
    /* per rank over: its largest kept document, found in one pass */
    long *largest = b->got; /* the deal is over: its counts are free */
    for (int r = 0; r < b->n; r++)
        largest[r] = -1;
    for (size_t d = 0; d < b->n_docs; d++) {
        int r = b->rank[d];
        if (r < 0)
            continue;
        const doc_t *x = &b->docs[d];
        if (largest[r] < 0 || x->work > b->docs[largest[r]].work ||
            (x->work == b->docs[largest[r]].work && x->len > b->docs[largest[r]].len))
            largest[r] = (long)d;
        if (longest < 0 || x->len > b->docs[longest].len ||
            (x->len == b->docs[longest].len && x->work > b->docs[longest].work))
            longest = (long)d;
    }
    for (int r = 0; r < b->n; r++)
        if (over(b->work[r], b->n, total) && largest[r] >= 0)
            b->forced[largest[r]] = true, forced++;
    if (forced == 0 && longest >= 0)
        b->forced[longest] = true, forced++;
    return forced;
}

/* ---- the plan -------------------------------------------------------------- */

static void plan_free(stria_docplan_t *p)
{
    stria_call_shape_free(&p->call);
    free(p->doc_rank);
    free(p->run_start);
    free(p->travel_runs);
    free(p->runs);
    free(p->travel);
    free(p->valid);
    free(p->work);
    free(p);
}

static stria_status_t plan_fill(const build_t *b, stria_docplan_t *p)
{
    const size_t n = (size_t)b->n;
    size_t total = 0;
    p->doc_rank = malloc(b->n_docs * sizeof(*p->doc_rank));
    p->run_start = malloc((n + 1) * sizeof(*p->run_start));
    p->travel_runs = malloc(n * sizeof(*p->travel_runs));
    p->travel = malloc(n * sizeof(*p->travel));
    p->valid = malloc(n * sizeof(*p->valid));
    p->work = malloc(n * sizeof(*p->work));
    for (size_t r = 0; r < n; r++)
        total += b->spread[r].n + b->padr[r].n;
    for (size_t d = 0; d < b->n_docs; d++)
        total += b->rank[d] >= 0;
    p->runs = malloc((total > 0 ? total : 1) * sizeof(*p->runs));
    if (p->doc_rank == NULL || p->run_start == NULL || p->travel_runs == NULL ||
        p->travel == NULL || p->valid == NULL || p->work == NULL || p->runs == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "document plan: out of memory");
    memcpy(p->doc_rank, b->rank, b->n_docs * sizeof(*p->doc_rank));
    memcpy(p->work, b->work, n * sizeof(*p->work));
    size_t at = 0;
    for (size_t r = 0; r < n; r++) {
        /* room for every kept document was counted in total: no growth */
        runs_t kept = {p->runs + at + b->spread[r].n, 0, SIZE_MAX};
        p->run_start[r] = at;
        p->travel_runs[r] = b->spread[r].n;
        if (b->spread[r].n > 0) /* runs is NULL when none was pushed */
            memcpy(p->runs + at, b->spread[r].runs, b->spread[r].n * sizeof(*p->runs));
        for (size_t d = 0; d < b->n_docs; d++)
            if (b->rank[d] == (int32_t)r)
                runs_push_range(&kept, b->docs[d].start, b->docs[d].len);
        at += b->spread[r].n + kept.n;
        if (b->padr[r].n > 0)
            memcpy(p->runs + at, b->padr[r].runs, b->padr[r].n * sizeof(*p->runs));
        at += b->padr[r].n;
        p->valid[r] = b->L - b->pad[r];
        p->travel[r] = p->valid[r] - b->kept_tok[r];
    }
    p->run_start[n] = at;
    for (size_t d = 0; d < b->n_docs; d++) {
        p->n_kept += b->rank[d] >= 0;
        p->n_spread += b->rank[d] < 0 && b->docs[d].len > 0;
    }
    p->bytes = sizeof(*p) + b->n_docs * sizeof(*p->doc_rank) + (n + 1) * sizeof(size_t) +
               n * (sizeof(size_t) + 2 * sizeof(int64_t) + sizeof(uint64_t)) +
               at * sizeof(*p->runs) + p->call.n_cu_seqlens * sizeof(int64_t);
    return STRIA_OK;
}

/* The plan's steps, counted by stria_docplan_count() from its positions (the
 * one rule of hops, shared with the other layouts' counts); its work must
 * agree with the deal's. */
static stria_status_t plan_steps(stria_docplan_t *p)
{
    int32_t *rank_of = malloc((size_t)p->seq_len * sizeof(*rank_of));
    uint64_t *work = malloc((size_t)p->n_ranks * sizeof(*work));
    stria_status_t st = STRIA_OK;
    if (rank_of == NULL || work == NULL)
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "document plan: out of memory");
    for (int r = 0; r < p->n_ranks && st == STRIA_OK; r++)
        for (size_t k = p->run_start[r]; k < p->run_start[r + 1]; k++)
            for (int64_t i = 0; i < p->runs[k].count; i++) {
                int64_t pos = p->runs[k].first + i * p->runs[k].stride;
                if (pos < p->seq_len)
                    rank_of[pos] = r;
            }
    if (st == STRIA_OK)
        st = stria_docplan_count(&p->call, p->n_ranks, rank_of, work, &p->steps);
    if (st == STRIA_OK && memcmp(work, p->work, (size_t)p->n_ranks * sizeof(*work)) != 0)
        st = stria_error_set(STRIA_ERR_INTERNAL, "document plan: work counted two ways differs");
    free(rank_of);
    free(work);
    return st;
}

static stria_status_t check_inputs(const stria_call_shape_t *call, int n_ranks,
                                   int64_t shard_tokens, stria_docplan_t **plan_out)
{
    stria_status_t st;
    if (call == NULL || plan_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_docplan_make: NULL argument");
    if (n_ranks < 1 || n_ranks > STRIA_LAYOUT_MAX_RANKS)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "document plan: %d ranks (must be 1..%d)",
                               n_ranks, STRIA_LAYOUT_MAX_RANKS);
    if (call->seq_len < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "document plan: seq_len %lld (must be at least 1)",
                               (long long)call->seq_len);
    if ((st = stria_call_masks_check(call)) != STRIA_OK)
        return st;
    if (shard_tokens < (call->seq_len + n_ranks - 1) / n_ranks || shard_tokens < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "document plan: shard_tokens %lld cannot hold %lld tokens on %d "
                               "ranks",
                               (long long)shard_tokens, (long long)call->seq_len, n_ranks);
    if (shard_tokens > MAX_PLAN_TOKENS / n_ranks)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "document plan: %d ranks of %lld tokens exceed the %lld a plan "
                               "takes",
                               n_ranks, (long long)shard_tokens, (long long)MAX_PLAN_TOKENS);
    return STRIA_OK;
}

static void build_free(build_t *b)
{
    for (int r = 0; b->spread != NULL && r < b->n; r++)
        free(b->spread[r].runs);
    for (int r = 0; b->padr != NULL && r < b->n; r++)
        free(b->padr[r].runs);
    free(b->spread);
    free(b->padr);
    free(b->docs);
    free(b->order);
    free(b->forced);
    free(b->rank);
    free(b->kept_tok);
    free(b->room);
    free(b->pad);
    free(b->kept_work);
    free(b->work);
    free(b->heap);
    free(b->got);
}

static stria_status_t build_alloc(build_t *b)
{
    const size_t n = (size_t)b->n, nd = b->n_docs;
    b->order = malloc(nd * sizeof(*b->order));
    b->forced = calloc(nd, sizeof(*b->forced));
    b->rank = malloc(nd * sizeof(*b->rank));
    b->kept_tok = calloc(n, sizeof(int64_t));
    b->room = calloc(n, sizeof(int64_t));
    b->pad = calloc(n, sizeof(int64_t));
    b->kept_work = calloc(n, sizeof(uint64_t));
    b->work = calloc(n, sizeof(uint64_t));
    b->heap = calloc(n, sizeof(int));
    b->got = calloc(n, sizeof(long));
    b->spread = calloc(n, sizeof(runs_t));
    b->padr = calloc(n, sizeof(runs_t));
    if (b->order == NULL || b->forced == NULL || b->rank == NULL || b->kept_tok == NULL ||
        b->room == NULL || b->pad == NULL || b->kept_work == NULL || b->work == NULL ||
        b->heap == NULL || b->got == NULL || b->spread == NULL || b->padr == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "document plan: out of memory");
    return STRIA_OK;
}

/* Steps 2 to 4, rounds until the ranks balance; the last round again with
 * the hops. */
static stria_status_t plan_rounds(build_t *b, stria_docplan_t *p)
{
    uint64_t total = 0;
    stria_status_t st;
    for (size_t d = 0; d < b->n_docs; d++)
        total += b->docs[d].work;
    const uint64_t cap =
        (uint64_t)((i128)total * (1000 + STRIA_DOCPLAN_TOLERANCE_PERMILLE) / (1000 * b->n));
    for (p->rounds = 1;; p->rounds++) {
        keep_docs(b, cap);
        if ((st = deal(b, false)) != STRIA_OK)
            return st;
        if (force_more(b, total, &p->max_mean) == 0)
            break;
        if (p->rounds >= STRIA_DOCPLAN_MAX_ROUNDS)
            memset(b->forced, 1, b->n_docs * sizeof(*b->forced));
    }
    return deal(b, true);
}

stria_status_t stria_docplan_make(const stria_call_shape_t *call, int n_ranks, int64_t shard_tokens,
                                  stria_docplan_t **plan_out)
{
    const double t0 = stria_time_now();
    stria_status_t st = check_inputs(call, n_ranks, shard_tokens, plan_out);
    if (st != STRIA_OK)
        return st;
    stria_docplan_t *p = calloc(1, sizeof(*p));
    build_t b = {.call = call, .n = n_ranks, .L = shard_tokens, .seq_len = call->seq_len};
    if (p == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "document plan: out of memory");
    p->version = STRIA_DOCPLAN_VERSION;
    p->digest = stria_docplan_digest(call, n_ranks, shard_tokens);
    p->n_ranks = n_ranks;
    p->seq_len = call->seq_len;
    p->shard_tokens = shard_tokens;
    p->refs_ = 1;
    if ((st = stria_call_shape_copy(call, &p->call)) == STRIA_OK &&
        (st = count_docs(&b)) == STRIA_OK && (st = build_alloc(&b)) == STRIA_OK &&
        (st = plan_rounds(&b, p)) == STRIA_OK && (st = plan_fill(&b, p)) == STRIA_OK)
        st = plan_steps(p);
    p->n_docs = b.n_docs;
    build_free(&b);
    if (st != STRIA_OK) {
        plan_free(p);
        return st;
    }
    p->make_s = stria_time_now() - t0;
    *plan_out = p;
    return STRIA_OK;
}

stria_docplan_t *stria_docplan_ref(stria_docplan_t *plan)
{
    if (plan != NULL)
        __atomic_fetch_add(&plan->refs_, 1, __ATOMIC_RELAXED);
    return plan;
}

void stria_docplan_unref(stria_docplan_t *plan)
{
    if (plan != NULL && __atomic_fetch_sub(&plan->refs_, 1, __ATOMIC_ACQ_REL) == 1)
        plan_free(plan);
}

int64_t stria_docplan_position(const stria_docplan_t *plan, int rank, int64_t index)
{
    if (plan == NULL || rank < 0 || rank >= plan->n_ranks || index < 0 ||
        index >= plan->shard_tokens)
        return -1;
    for (size_t k = plan->run_start[rank]; k < plan->run_start[rank + 1]; k++) {
        const stria_layout_run_t *run = &plan->runs[k];
        if (index < run->count)
            return run->first + index * run->stride;
        index -= run->count;
    }
    return -1;
}

stria_status_t stria_docplan_positions(const stria_docplan_t *plan, int rank, int64_t *out)
{
    if (plan == NULL || out == NULL || rank < 0 || rank >= plan->n_ranks)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_docplan_positions: bad plan, rank or buffer");
    for (size_t k = plan->run_start[rank]; k < plan->run_start[rank + 1]; k++)
        for (int64_t i = 0; i < plan->runs[k].count; i++)
            *out++ = plan->runs[k].first + i * plan->runs[k].stride;
    return STRIA_OK;
}

/* ---- the cache --------------------------------------------------------------- */

struct stria_docplan_cache {
    pthread_mutex_t lock;
    size_t cap;
    stria_docplan_t **plans; /* most recently used first */
    size_t n;
    stria_docplan_cache_stats_t stats;
};

stria_docplan_cache_t *stria_docplan_cache_new(size_t capacity)
{
    stria_docplan_cache_t *c = calloc(1, sizeof(*c));
    if (c == NULL || capacity == 0 || (c->plans = calloc(capacity, sizeof(*c->plans))) == NULL) {
        free(c);
        return NULL;
    }
    c->cap = capacity;
    pthread_mutex_init(&c->lock, NULL);
    return c;
}

void stria_docplan_cache_free(stria_docplan_cache_t *cache)
{
    if (cache == NULL)
        return;
    for (size_t i = 0; i < cache->n; i++)
        stria_docplan_unref(cache->plans[i]);
    pthread_mutex_destroy(&cache->lock);
    free(cache->plans);
    free(cache);
}

static bool same_inputs(const stria_docplan_t *p, const stria_call_shape_t *call, int n_ranks,
                        int64_t shard_tokens)
{
    stria_call_shape_t a = p->call, b = *call;
    /* batch and scale do not change a plan */
    a.batch = b.batch = 0;
    a.scale = b.scale = 0;
    return p->n_ranks == n_ranks && p->shard_tokens == shard_tokens &&
           stria_call_shape_equal(&a, &b);
}

/* Moves plans[i] to the front (most recently used). */
static void to_front(stria_docplan_cache_t *c, size_t i)
{
    stria_docplan_t *p = c->plans[i];
    memmove(c->plans + 1, c->plans, i * sizeof(*c->plans));
    c->plans[0] = p;
}

stria_status_t stria_docplan_cache_get(stria_docplan_cache_t *cache, const stria_call_shape_t *call,
                                       int n_ranks, int64_t shard_tokens,
                                       stria_docplan_t **plan_out)
{
    stria_docplan_t *made;
    stria_status_t st;
    if (cache == NULL || call == NULL || plan_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_docplan_cache_get: NULL argument");
    const uint64_t digest = stria_docplan_digest(call, n_ranks, shard_tokens);
    pthread_mutex_lock(&cache->lock);
    for (size_t i = 0; i < cache->n; i++) {
        stria_docplan_t *p = cache->plans[i];
        if (p->digest == digest && same_inputs(p, call, n_ranks, shard_tokens)) {
            cache->stats.hits++;
            to_front(cache, i);
            *plan_out = stria_docplan_ref(p);
            pthread_mutex_unlock(&cache->lock);
            return STRIA_OK;
        }
    }
    pthread_mutex_unlock(&cache->lock);
    /* made outside the lock: another thread may make the same plan at once;
     * both are equal and the later one is cached */
    if ((st = stria_docplan_make(call, n_ranks, shard_tokens, &made)) != STRIA_OK)
        return st;
    pthread_mutex_lock(&cache->lock);
    cache->stats.misses++;
    cache->stats.make_s += made->make_s;
    if (cache->n == cache->cap) {
        stria_docplan_t *old = cache->plans[--cache->n];
        cache->stats.bytes -= old->bytes;
        stria_docplan_unref(old);
    }
    cache->plans[cache->n++] = stria_docplan_ref(made);
    cache->stats.bytes += made->bytes;
    to_front(cache, cache->n - 1);
    pthread_mutex_unlock(&cache->lock);
    *plan_out = made;
    return STRIA_OK;
}

void stria_docplan_cache_stats(stria_docplan_cache_t *cache, stria_docplan_cache_stats_t *out)
{
    pthread_mutex_lock(&cache->lock);
    *out = cache->stats;
    out->entries = cache->n;
    pthread_mutex_unlock(&cache->lock);
}
