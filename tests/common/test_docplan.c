/* Document plans (common/docplan.c): every plan is a placement of all
 * N x shard_tokens positions with the parts in the order the header states,
 * its counted work is recounted from its positions, it is balanced or
 * striping, it is deterministic, no documents is striping, and the cache
 * shares plans by their inputs. */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "stria_docplan.h"

static stria_call_shape_t docs_call(const int64_t *cu, size_t n, bool causal)
{
    return (stria_call_shape_t){.batch = 1,
                                .seq_len = n > 0 ? cu[n - 1] : 0,
                                .causal = causal,
                                .cu_seqlens = cu,
                                .n_cu_seqlens = n};
}

/* The document holding position pos (the call's list; one document without). */
static size_t doc_of(const stria_call_shape_t *c, int64_t pos)
{
    size_t d = 0;
    while (c->n_cu_seqlens > 1 && d + 2 < c->n_cu_seqlens && c->cu_seqlens[d + 1] <= pos)
        d++;
    return d;
}

/* Every invariant of a plan, checked against its inputs from scratch. */
static void check_plan(const stria_call_shape_t *c, const stria_docplan_t *p)
{
    const int n = p->n_ranks;
    const int64_t L = p->shard_tokens, total = (int64_t)n * L;
    char *seen = calloc((size_t)total, 1);
    int64_t *pos = malloc((size_t)L * sizeof(*pos));
    cr_assert(seen != NULL && pos != NULL);
    uint64_t work_sum = 0, most = 0;
    int64_t travel_sum = 0;
    for (int r = 0; r < n; r++) {
        cr_assert_eq(stria_docplan_positions(p, r, pos), STRIA_OK);
        uint64_t work = 0;
        for (int64_t i = 0; i < L; i++) {
            cr_assert(pos[i] >= 0 && pos[i] < total, "rank %d row %lld: position %lld", r,
                      (long long)i, (long long)pos[i]);
            cr_assert_eq(seen[pos[i]], 0, "position %lld placed twice", (long long)pos[i]);
            seen[pos[i]] = 1;
            cr_assert_eq(stria_docplan_position(p, r, i), pos[i]);
            const bool real = pos[i] < c->seq_len;
            cr_assert_eq(real, i < p->valid[r],
                         "rank %d row %lld: padding only after the %lld "
                         "real rows",
                         r, (long long)i, (long long)p->valid[r]);
            if (!real)
                continue;
            size_t d = doc_of(c, pos[i]);
            int64_t start = c->n_cu_seqlens > 1 ? c->cu_seqlens[d] : 0;
            int64_t len = (c->n_cu_seqlens > 1 ? c->cu_seqlens[d + 1] : c->seq_len) - start;
            work += (uint64_t)stria_docplan_query_work(c, pos[i] - start, len);
            if (i < p->travel[r]) {
                cr_assert_eq(p->doc_rank[d], -1,
                             "rank %d row %lld travels but document %zu is "
                             "kept",
                             r, (long long)i, d);
                cr_assert(i == 0 || pos[i] > pos[i - 1], "spread rows increase");
            } else {
                cr_assert_eq(p->doc_rank[d], r, "rank %d row %lld: document %zu is kept on %d", r,
                             (long long)i, d, p->doc_rank[d]);
                cr_assert(i == p->travel[r] || pos[i] > pos[i - 1], "kept rows increase");
            }
        }
        cr_assert_eq(work, p->work[r], "rank %d: counted %llu, recounted %llu", r,
                     (unsigned long long)p->work[r], (unsigned long long)work);
        work_sum += work;
        most = work > most ? work : most;
        travel_sum += p->travel[r];
    }
    double max_mean = (double)most * n / (double)work_sum;
    cr_expect(max_mean - p->max_mean < 1e-9 && p->max_mean - max_mean < 1e-9);
    cr_expect(p->max_mean <= 1.0 + STRIA_DOCPLAN_TOLERANCE_PERMILLE / 1000.0 || p->n_kept == 0,
              "unbalanced (%.4f) with %zu documents kept", p->max_mean, p->n_kept);
    cr_expect(p->steps >= 1 && p->steps <= n);
    if (travel_sum == 0)
        cr_expect_eq(p->steps, 1, "nothing travels: one step");
    free(seen);
    free(pos);
}

Test(docplan, no_documents_is_striping)
{
    for (int n = 1; n <= 8; n++) {
        for (int64_t seq = 1; seq <= 70; seq += 23) {
            stria_call_shape_t c = {.batch = 1, .seq_len = seq, .causal = true};
            stria_layout_t lay;
            stria_docplan_t *p;
            cr_assert_eq(stria_layout_init(STRIA_LAYOUT_STRIPED, n, seq, &lay), STRIA_OK);
            cr_assert_eq(stria_docplan_make(&c, n, lay.shard_tokens, &p), STRIA_OK, "%s",
                         stria_error_msg());
            check_plan(&c, p);
            for (int r = 0; r < n; r++)
                for (int64_t i = 0; i < lay.shard_tokens; i++)
                    cr_assert_eq(stria_docplan_position(p, r, i), stria_layout_position(&lay, r, i),
                                 "n %d seq %lld rank %d row %lld", n, (long long)seq, r,
                                 (long long)i);
            stria_docplan_unref(p);
        }
    }
}

Test(docplan, short_documents_stay_home)
{
    /* one document per token: every query sees itself only */
    int64_t cu[257];
    for (int i = 0; i <= 256; i++)
        cu[i] = i;
    stria_call_shape_t c = docs_call(cu, 257, true);
    stria_docplan_t *p;
    cr_assert_eq(stria_docplan_make(&c, 4, 64, &p), STRIA_OK, "%s", stria_error_msg());
    check_plan(&c, p);
    cr_expect_eq(p->n_kept, 256);
    cr_expect_eq(p->steps, 1, "kept documents need no traffic");
    for (int r = 0; r < 4; r++)
        cr_expect_eq(p->travel[r], 0);
    cr_expect_eq(p->max_mean, 1.0);
    stria_docplan_unref(p);
}

Test(docplan, one_long_document_is_spread)
{
    static const int64_t cu[] = {0, 100};
    stria_call_shape_t c = docs_call(cu, 2, true);
    stria_docplan_t *p;
    cr_assert_eq(stria_docplan_make(&c, 4, 25, &p), STRIA_OK);
    check_plan(&c, p);
    cr_expect_eq(p->n_spread, 1);
    cr_expect_eq(p->doc_rank[0], -1);
    cr_expect_eq(p->steps, 4);
    stria_docplan_unref(p);
    /* on one rank everything is kept */
    cr_assert_eq(stria_docplan_make(&c, 1, 100, &p), STRIA_OK);
    check_plan(&c, p);
    cr_expect_eq(p->doc_rank[0], 0);
    cr_expect_eq(p->steps, 1);
    stria_docplan_unref(p);
}

/* Log-normal-ish documents from a fixed generator: lengths 1 .. 4 * median. */
static size_t random_docs(uint64_t *state, int64_t seq, int64_t median, int64_t *cu, size_t cap)
{
    size_t n = 0;
    cu[n++] = 0;
    while (cu[n - 1] < seq && n < cap) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        int64_t len = 1 + (int64_t)((*state >> 33) % (uint64_t)(4 * median));
        if ((*state >> 20) % 5 == 0)
            len = 1 + len / 16; /* many short ones */
        cu[n] = cu[n - 1] + len > seq || n + 1 == cap ? seq : cu[n - 1] + len;
        n++;
    }
    return n;
}

Test(docplan, random_sweep_holds_every_rule)
{
    uint64_t state = 42;
    int64_t cu[512];
    for (int trial = 0; trial < 120; trial++) {
        int n = 1 + trial % 8;
        int64_t seq = 1 + (int64_t)(state >> 40) % 3000;
        int64_t median = 1 + trial % 300;
        size_t n_cu = random_docs(&state, seq, median, cu, 512);
        stria_call_shape_t c = docs_call(cu, n_cu, trial % 3 != 0);
        if (trial % 4 == 1) {
            c.has_window = true;
            c.window_left = 1 + trial;
            c.window_right = c.causal ? 0 : trial % 7;
        }
        int64_t L = (seq + n - 1) / n + (trial % 5 == 0 ? 3 : 0);
        stria_docplan_t *p, *q;
        cr_assert_eq(stria_docplan_make(&c, n, L, &p), STRIA_OK, "trial %d: %s", trial,
                     stria_error_msg());
        check_plan(&c, p);
        /* deterministic: made again, the same plan */
        cr_assert_eq(stria_docplan_make(&c, n, L, &q), STRIA_OK);
        cr_assert_eq(q->digest, p->digest);
        cr_assert_eq(q->run_start[n], p->run_start[n]);
        cr_assert_eq(memcmp(q->runs, p->runs, p->run_start[n] * sizeof(*p->runs)), 0);
        cr_assert_eq(memcmp(q->doc_rank, p->doc_rank, p->n_docs * sizeof(*p->doc_rank)), 0);
        stria_docplan_unref(q);
        stria_docplan_unref(p);
    }
}

/* The workload: S = 65536 on 8 ranks, documents around 1,024 tokens
 * (lengths up to 4,096, a fifth of them short): balanced, and a small part
 * of the tokens travels. */
Test(docplan, packed_documents_travel_little)
{
    uint64_t state = 7;
    int64_t *cu = malloc(4096 * sizeof(*cu));
    size_t n_cu = random_docs(&state, 65536, 1024, cu, 4096);
    stria_call_shape_t c = docs_call(cu, n_cu, true);
    stria_docplan_t *p;
    cr_assert_eq(stria_docplan_make(&c, 8, 8192, &p), STRIA_OK);
    check_plan(&c, p);
    int64_t travel = 0;
    for (int r = 0; r < 8; r++)
        travel += p->travel[r];
    cr_expect(p->max_mean <= 1.0 + STRIA_DOCPLAN_TOLERANCE_PERMILLE / 1000.0, "max/mean %.4f",
              p->max_mean);
    cr_expect(travel * 4 <= 65536, "%lld of 65536 tokens travel", (long long)travel);
    stria_docplan_unref(p);
    free(cu);
}

Test(docplan, windows_count_what_they_let_through)
{
    stria_call_shape_t c = {.batch = 1, .seq_len = 10, .causal = true};
    cr_expect_eq(stria_docplan_query_work(&c, 0, 10), 1);
    cr_expect_eq(stria_docplan_query_work(&c, 9, 10), 10);
    c.has_window = true;
    c.window_left = 3;
    cr_expect_eq(stria_docplan_query_work(&c, 9, 10), 4);
    cr_expect_eq(stria_docplan_query_work(&c, 1, 10), 2);
    c.causal = false;
    c.window_right = 2;
    cr_expect_eq(stria_docplan_query_work(&c, 9, 10), 4, "the document ends at 9");
    cr_expect_eq(stria_docplan_query_work(&c, 4, 10), 6);
    c.window_right = -1;
    cr_expect_eq(stria_docplan_query_work(&c, 4, 10), 9);
    c.has_window = false;
    c.window_left = c.window_right = 0;
    cr_expect_eq(stria_docplan_query_work(&c, 4, 10), 10);
}

Test(docplan, bad_inputs_are_named)
{
    static const int64_t cu[] = {0, 5, 3, 10}, short_cu[] = {0, 9};
    stria_call_shape_t c = docs_call(cu, 4, true);
    stria_docplan_t *p = NULL;
    cr_expect_eq(stria_docplan_make(&c, 2, 5, &p), STRIA_ERR_INVALID_ARG);
    cr_expect_str_eq(stria_error_msg(), "cu_seqlens must not decrease (entry 2 is 3 after 5)");
    c = docs_call(short_cu, 2, true);
    c.seq_len = 10;
    cr_expect_eq(stria_docplan_make(&c, 2, 5, &p), STRIA_ERR_INVALID_ARG);
    cr_expect_str_eq(stria_error_msg(), "cu_seqlens must end at seq_len (10) (got 9)");
    c.seq_len = 9;
    cr_expect_eq(stria_docplan_make(&c, 2, 4, &p), STRIA_ERR_INVALID_ARG);
    cr_expect_str_eq(stria_error_msg(),
                     "document plan: shard_tokens 4 cannot hold 9 tokens on 2 ranks");
    cr_expect_eq(stria_docplan_make(&c, 0, 9, &p), STRIA_ERR_INVALID_ARG);
    cr_expect_str_eq(stria_error_msg(), "document plan: 0 ranks (must be 1..65535)");
    cr_expect_eq(stria_docplan_make(&c, 2, (int64_t)1 << 31, &p), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(p, NULL, "nothing made on a refusal");
}

Test(docplan, cache_shares_plans_by_inputs)
{
    static const int64_t a[] = {0, 10, 40, 64}, b[] = {0, 30, 64};
    stria_call_shape_t ca = docs_call(a, 4, true), cb = docs_call(b, 3, true);
    stria_docplan_cache_t *cache = stria_docplan_cache_new(1);
    stria_docplan_t *p1, *p2, *p3;
    stria_docplan_cache_stats_t st;
    cr_assert(cache != NULL);
    cr_assert_eq(stria_docplan_cache_get(cache, &ca, 2, 32, &p1), STRIA_OK);
    ca.batch = 4;
    ca.scale = 0.5f; /* batch and scale do not change a plan */
    cr_assert_eq(stria_docplan_cache_get(cache, &ca, 2, 32, &p2), STRIA_OK);
    cr_expect_eq(p1, p2, "the same inputs share one plan");
    stria_docplan_cache_stats(cache, &st);
    cr_expect_eq(st.hits, 1);
    cr_expect_eq(st.misses, 1);
    cr_expect_eq(st.entries, 1);
    cr_expect_eq(st.bytes, p1->bytes);
    cr_assert_eq(stria_docplan_cache_get(cache, &cb, 2, 32, &p3), STRIA_OK);
    cr_expect_neq(p3, p1);
    stria_docplan_cache_stats(cache, &st);
    cr_expect_eq(st.entries, 1, "the least recently used plan left");
    cr_expect_eq(st.bytes, p3->bytes);
    /* a plan dropped by the cache lives while it is referenced */
    check_plan(&ca, p1);
    cr_assert_eq(stria_docplan_cache_get(cache, &ca, 4, 16, &p2), STRIA_OK);
    cr_expect_neq(p2, p1, "another ring is another plan");
    stria_docplan_unref(p1);
    stria_docplan_unref(p1);
    stria_docplan_unref(p2);
    stria_docplan_unref(p3);
    stria_docplan_cache_free(cache);
}

Test(docplan, count_any_placement)
{
    /* contiguous, 4 ranks of 16: a window of 10 reaches one shard back */
    int32_t rank_of[64];
    uint64_t work[4];
    int steps;
    for (int p = 0; p < 64; p++)
        rank_of[p] = p / 16;
    stria_call_shape_t c = {
        .batch = 1, .seq_len = 64, .causal = true, .has_window = true, .window_left = 10};
    cr_assert_eq(stria_docplan_count(&c, 4, rank_of, work, &steps), STRIA_OK);
    cr_expect_eq(steps, 2);
    cr_expect_eq(work[0], 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9 + 10 + 11 * 6);
    cr_expect_eq(work[1], 11 * 16);
    c.has_window = false;
    c.window_left = 0;
    cr_assert_eq(stria_docplan_count(&c, 4, rank_of, work, &steps), STRIA_OK);
    cr_expect_eq(steps, 4, "causal, no window: the last rank sees the first");
    /* striped with two documents of 32: both cover every rank */
    static const int64_t cu[] = {0, 32, 64};
    c.cu_seqlens = cu;
    c.n_cu_seqlens = 3;
    for (int p = 0; p < 64; p++)
        rank_of[p] = p % 4;
    cr_assert_eq(stria_docplan_count(&c, 4, rank_of, work, &steps), STRIA_OK);
    cr_expect_eq(steps, 4);
    rank_of[5] = 4;
    cr_expect_eq(stria_docplan_count(&c, 4, rank_of, work, &steps), STRIA_ERR_INVALID_ARG);
    cr_expect_str_eq(stria_error_msg(), "stria_docplan_count: position 5 on rank 4 of 4");
}
