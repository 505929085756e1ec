/* Layouts: shard maps, padding, runs, scatter and gather. */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "stria_common.h"
#include "stria_docplan.h"

static const stria_layout_kind_t all_kinds[] = {STRIA_LAYOUT_STRIPED, STRIA_LAYOUT_CONTIGUOUS,
                                                STRIA_LAYOUT_ZIGZAG};

/* Every property of one layout, checked exhaustively over its positions. */
static void check_layout(stria_layout_kind_t kind, int n, int64_t seq)
{
    stria_layout_t l;
    const char *name = stria_layout_kind_name(kind);
    int64_t unit = kind == STRIA_LAYOUT_ZIGZAG ? 2 * n : n;

    cr_assert_eq(stria_layout_init(kind, n, seq, &l), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(l.seq_len, seq);
    cr_assert_eq(l.seq_padded % unit, 0, "%s N=%d S=%lld: padded %lld", name, n, (long long)seq,
                 (long long)l.seq_padded);
    cr_assert(l.seq_padded >= seq && l.seq_padded < seq + unit);
    cr_assert_eq(l.shard_tokens * n, l.seq_padded);

    char *seen = calloc((size_t)l.seq_padded, 1);
    int64_t total_valid = 0;
    for (int r = 0; r < n; r++) {
        int64_t valid = stria_layout_shard_valid(&l, r);
        int64_t prev = -1;
        total_valid += valid;
        for (int64_t i = 0; i < l.shard_tokens; i++) {
            int64_t pos = stria_layout_position(&l, r, i);
            int rr;
            int64_t ii;
            cr_assert(pos >= 0 && pos < l.seq_padded);
            cr_assert(pos > prev, "%s N=%d: positions of rank %d do not increase", name, n, r);
            prev = pos;
            cr_assert_eq(seen[pos], 0, "%s N=%d: position %lld held twice", name, n,
                         (long long)pos);
            seen[pos] = 1;
            /* real tokens are exactly the prefix of the shard */
            cr_assert_eq(pos < seq, i < valid, "%s N=%d S=%lld rank %d index %lld pos %lld", name,
                         n, (long long)seq, r, (long long)i, (long long)pos);
            cr_assert_eq(stria_layout_locate(&l, pos, &rr, &ii), STRIA_OK);
            cr_assert(rr == r && ii == i, "%s: locate(%lld) = (%d, %lld), want (%d, %lld)", name,
                      (long long)pos, rr, (long long)ii, r, (long long)i);
        }
        /* runs expand to the positions, with and without padding */
        for (int pad = 0; pad < 2; pad++) {
            stria_layout_run_t runs[STRIA_LAYOUT_MAX_RUNS];
            size_t nr = stria_layout_shard_runs(&l, r, pad, runs);
            int64_t idx = 0;
            for (size_t k = 0; k < nr; k++) {
                cr_assert(runs[k].count > 0);
                for (int64_t c = 0; c < runs[k].count; c++, idx++)
                    cr_assert_eq(runs[k].first + c * runs[k].stride,
                                 stria_layout_position(&l, r, idx));
            }
            cr_assert_eq(idx, pad ? l.shard_tokens : valid, "%s N=%d rank %d pad=%d: %lld tokens",
                         name, n, r, pad, (long long)idx);
        }
    }
    cr_assert_eq(total_valid, seq);
    free(seen);
}

Test(layout, bijection_padding_prefix_and_runs)
{
    for (size_t k = 0; k < 3; k++)
        for (int n = 1; n <= 9; n++)
            for (int64_t seq = 1; seq <= 5 * n + 3; seq++)
                check_layout(all_kinds[k], n, seq);
    check_layout(STRIA_LAYOUT_ZIGZAG, 8, 16384 + 5);
    check_layout(STRIA_LAYOUT_STRIPED, 16, 1000);
}

static void expect_shard(stria_layout_kind_t kind, int n, int64_t seq, int rank,
                         const int64_t *want, int64_t count, int64_t valid)
{
    stria_layout_t l;
    cr_assert_eq(stria_layout_init(kind, n, seq, &l), STRIA_OK);
    cr_assert_eq(l.shard_tokens, count);
    cr_assert_eq(stria_layout_shard_valid(&l, rank), valid);
    for (int64_t i = 0; i < count; i++)
        cr_expect_eq(stria_layout_position(&l, rank, i), want[i], "%s rank %d index %lld",
                     stria_layout_kind_name(kind), rank, (long long)i);
}

Test(layout, known_shards)
{
    /* striped, 4 ranks, 10 tokens (padded to 12): rank 1 holds 1, 5, 9 */
    expect_shard(STRIA_LAYOUT_STRIPED, 4, 10, 1, (int64_t[]){1, 5, 9}, 3, 3);
    expect_shard(STRIA_LAYOUT_STRIPED, 4, 10, 2, (int64_t[]){2, 6, 10}, 3, 2);
    /* contiguous: rank 2 of 3 over 7 tokens (padded to 9) holds 6, 7, 8 */
    expect_shard(STRIA_LAYOUT_CONTIGUOUS, 3, 7, 2, (int64_t[]){6, 7, 8}, 3, 1);
    /* zigzag, 2 ranks, 8 tokens: chunks of 2; rank 0 holds chunks 0 and 3 */
    expect_shard(STRIA_LAYOUT_ZIGZAG, 2, 8, 0, (int64_t[]){0, 1, 6, 7}, 4, 4);
    expect_shard(STRIA_LAYOUT_ZIGZAG, 2, 8, 1, (int64_t[]){2, 3, 4, 5}, 4, 4);
    /* zigzag, 2 ranks, 5 tokens (padded to 8): rank 0 keeps only 0, 1 */
    expect_shard(STRIA_LAYOUT_ZIGZAG, 2, 5, 0, (int64_t[]){0, 1, 6, 7}, 4, 2);
    expect_shard(STRIA_LAYOUT_ZIGZAG, 2, 5, 1, (int64_t[]){2, 3, 4, 5}, 4, 3);
    /* fewer tokens than ranks: some shards hold only padding */
    expect_shard(STRIA_LAYOUT_CONTIGUOUS, 8, 3, 5, (int64_t[]){5}, 1, 0);
}

Test(layout, scatter_gather_round_trip)
{
    for (size_t k = 0; k < 3; k++)
        for (int n = 1; n <= 5; n++) {
            const int64_t seq = 23, B = 2, row = 3;
            stria_layout_t l;
            cr_assert_eq(stria_layout_init(all_kinds[k], n, seq, &l), STRIA_OK);
            float *full = malloc((size_t)(B * seq * row) * sizeof(float));
            float *back = calloc((size_t)(B * seq * row), sizeof(float));
            float *shard = malloc((size_t)(B * l.shard_tokens * row) * sizeof(float));
            for (int64_t i = 0; i < B * seq * row; i++)
                full[i] = (float)i + 1.0f;
            for (int r = 0; r < n; r++) {
                memset(shard, 0xff, (size_t)(B * l.shard_tokens * row) * sizeof(float));
                cr_assert_eq(stria_layout_scatter(&l, r, B, row * sizeof(float), full, shard),
                             STRIA_OK);
                for (int64_t b = 0; b < B; b++)
                    for (int64_t i = 0; i < l.shard_tokens; i++) {
                        int64_t pos = stria_layout_position(&l, r, i);
                        for (int64_t c = 0; c < row; c++) {
                            float got = shard[(b * l.shard_tokens + i) * row + c];
                            float want = pos < seq ? full[(b * seq + pos) * row + c] : 0.0f;
                            cr_assert_eq(got, want, "%s N=%d rank %d b=%lld i=%lld",
                                         stria_layout_kind_name(all_kinds[k]), n, r, (long long)b,
                                         (long long)i);
                        }
                    }
                cr_assert_eq(stria_layout_gather(&l, r, B, row * sizeof(float), shard, back),
                             STRIA_OK);
            }
            cr_assert_eq(memcmp(full, back, (size_t)(B * seq * row) * sizeof(float)), 0);
            free(full), free(back), free(shard);
        }
}

Test(layout, names_and_errors)
{
    stria_layout_t l;
    stria_layout_kind_t kind;
    int r;
    int64_t i;
    float buf[4];

    for (size_t k = 0; k < 3; k++) {
        cr_assert_eq(stria_layout_kind_parse(stria_layout_kind_name(all_kinds[k]), &kind),
                     STRIA_OK);
        cr_assert_eq(kind, all_kinds[k]);
    }
    /* auto parses, names itself, and stands for contiguous with a window and
     * striped otherwise; it cannot describe shards until resolved. */
    cr_assert_eq(stria_layout_kind_parse("auto", &kind), STRIA_OK);
    cr_assert_eq(kind, STRIA_LAYOUT_AUTO);
    cr_expect_str_eq(stria_layout_kind_name(STRIA_LAYOUT_AUTO), "auto");
    cr_expect_eq(stria_layout_kind_resolve(STRIA_LAYOUT_AUTO, true, false),
                 STRIA_LAYOUT_CONTIGUOUS);
    cr_expect_eq(stria_layout_kind_resolve(STRIA_LAYOUT_AUTO, true, true), STRIA_LAYOUT_CONTIGUOUS,
                 "a window: contiguous, documents or not");
    cr_expect_eq(stria_layout_kind_resolve(STRIA_LAYOUT_AUTO, false, false), STRIA_LAYOUT_STRIPED);
    cr_expect_eq(stria_layout_kind_resolve(STRIA_LAYOUT_AUTO, false, true), STRIA_LAYOUT_PACKED);
    for (size_t k = 0; k < 3; k++) {
        cr_expect_eq(stria_layout_kind_resolve(all_kinds[k], true, true), all_kinds[k]);
        cr_expect_eq(stria_layout_kind_resolve(all_kinds[k], false, false), all_kinds[k]);
    }
    cr_expect_eq(stria_layout_init(STRIA_LAYOUT_AUTO, 2, 4, &l), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "resolved") != NULL, "%s", stria_error_msg());
    cr_expect_eq(stria_layout_kind_parse("ring", &kind), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "'ring'") != NULL, "%s", stria_error_msg());
    cr_expect_str_eq(stria_layout_kind_name((stria_layout_kind_t)7), "unknown");
    cr_expect_eq(stria_layout_init(STRIA_LAYOUT_STRIPED, 0, 10, &l), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "0 ranks") != NULL, "%s", stria_error_msg());
    cr_expect_eq(stria_layout_init(STRIA_LAYOUT_STRIPED, 2, 0, &l), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "0 tokens") != NULL, "%s", stria_error_msg());
    cr_expect_eq(stria_layout_init((stria_layout_kind_t)9, 2, 4, &l), STRIA_ERR_INVALID_ARG);
    cr_assert_eq(stria_layout_init(STRIA_LAYOUT_ZIGZAG, 2, 4, &l), STRIA_OK);
    cr_expect_eq(stria_layout_position(&l, 2, 0), -1);
    cr_expect_eq(stria_layout_position(&l, 0, 2), -1);
    cr_expect_eq(stria_layout_locate(&l, 4, &r, &i), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_layout_scatter(&l, 3, 1, 4, buf, buf + 2), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "rank 3") != NULL, "%s", stria_error_msg());
    cr_expect_eq(stria_layout_gather(&l, 0, 0, 4, buf, buf + 2), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_layout_gather(&l, 0, 1, 4, NULL, buf), STRIA_ERR_INVALID_ARG);
}

/* The kernels' workspace rule (stria_kernel_grant()) and the rank memory
 * built on it: whole tiles, head_dim padded, 5 x the query rows and 2 x the
 * K/V rows in fp32; the kernel suite (test_kernels_memory) holds the kernels
 * to it. */
Test(layout, kernel_grant_and_rank_memory)
{
    stria_kernel_grant_t g, h;
    uint64_t m;

    /* the service job that outgrew its admission: B=3, 102 tokens a shard,
     * 4 heads over 2 K/V heads of 64: 128 tokens in tiles */
    cr_assert_eq(stria_kernel_grant(3, 102, 102, 4, 2, 64, &g), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(g.query, 5ull * 3 * 4 * 128 * 64 * 4);
    cr_expect_eq(g.kv, 2ull * 3 * 2 * 128 * 64 * 4);
    cr_expect_eq(g.total, g.query + g.kv);
    cr_expect_eq(g.total, 2359296);
    /* its rank memory: the tensors (4 x 156672 + 4 x 78336 + LSE 4896 in
     * 64-byte units), the ring's backward arena (2 messages of 156672, 3
     * fp32 dK/dV of 313344, fp32 dQ of 313344, LSE and D rows) and the grant:
     * what a worker's pool held at most for it (tests/service/test_datapath) */
    cr_assert_eq(stria_rank_memory(3, 102, 4, 2, 64, STRIA_DTYPE_BF16, &m), STRIA_OK);
    cr_expect_eq(m, 944960 + 1576576 + g.total);
    cr_expect_eq(m, 4880832);

    /* tokens count in whole tiles, head_dim in multiples of 16 */
    cr_assert_eq(stria_kernel_grant(1, 1, 1, 2, 1, 40, &g), STRIA_OK);
    cr_assert_eq(stria_kernel_grant(1, 64, 64, 2, 1, 48, &h), STRIA_OK);
    cr_expect_eq(g.total, h.total);
    cr_assert_eq(stria_kernel_grant(1, 65, 64, 2, 1, 48, &h), STRIA_OK);
    cr_expect_eq(h.query, 2 * g.query);
    cr_expect_eq(h.kv, g.kv);
    /* 3 key tiles, head_dim 49 padded to 64 */
    cr_assert_eq(stria_kernel_grant(1, 64, 129, 2, 1, 49, &h), STRIA_OK);
    cr_expect_eq(h.kv, g.kv * 3 * 64 / 48);
    cr_expect_eq(h.query, g.query * 64 / 48);

    cr_expect_eq(stria_kernel_grant(0, 1, 1, 1, 1, 16, &g), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_kernel_grant(1, 1, 0, 1, 1, 16, &g), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_kernel_grant(1, 1, 1, 1, 1, 16, NULL), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_kernel_grant(INT64_MAX, 1, 1, 1, 1, 16, &g), STRIA_ERR_NO_MEMORY);
    cr_expect_eq(stria_kernel_grant(1, INT64_MAX, 1, 1, 1, 16, &g), STRIA_ERR_NO_MEMORY);
    cr_expect_eq(stria_kernel_grant(1, 1, (int64_t)1 << 40, 1 << 20, 1 << 20, 256, &g),
                 STRIA_ERR_NO_MEMORY);
    cr_expect_eq(stria_rank_memory(1, (int64_t)1 << 50, 1 << 10, 1 << 10, 256, STRIA_DTYPE_F32, &m),
                 STRIA_ERR_NO_MEMORY);
}

/* A packed layout reads its plan: positions and locate are inverse, the
 * runs of every shard (more than two) cover its rows in order, padding
 * comes last, and scatter then gather gives the full array back. */
Test(layout, packed_follows_its_plan)
{
    /* documents of 5 tokens and one of 113: the short ones kept, a few to a
     * rank (a run each), the long one spread */
    int64_t cu[20];
    size_t n_cu = 0;
    for (int64_t p = 0; p <= 90; p += 5)
        cu[n_cu++] = p;
    cu[n_cu++] = 203;
    stria_call_shape_t call = {
        .batch = 1, .seq_len = 203, .causal = true, .cu_seqlens = cu, .n_cu_seqlens = n_cu};
    stria_docplan_t *plan;
    stria_layout_t l;
    const int n = 3;
    cr_assert_eq(stria_docplan_make(&call, n, 68, &plan), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_layout_init_plan(plan, &l), STRIA_OK);
    cr_expect_eq(l.kind, STRIA_LAYOUT_PACKED);
    cr_expect_eq(l.seq_padded, 204);
    cr_expect_str_eq(stria_layout_kind_name(l.kind), "packed");
    stria_layout_kind_t k;
    cr_expect_eq(stria_layout_kind_parse("packed", &k), STRIA_OK);
    cr_expect_eq(k, STRIA_LAYOUT_PACKED);
    /* without a plan (a call without documents, a session's sizing): striping */
    stria_layout_t bare, striped;
    cr_assert_eq(stria_layout_init(STRIA_LAYOUT_PACKED, n, 203, &bare), STRIA_OK);
    cr_assert_eq(stria_layout_init(STRIA_LAYOUT_STRIPED, n, 203, &striped), STRIA_OK);
    cr_expect_eq(bare.kind, STRIA_LAYOUT_PACKED);
    cr_expect_null(bare.plan);
    cr_expect_eq(bare.shard_tokens, striped.shard_tokens);
    for (int r = 0; r < n; r++) {
        cr_expect_eq(stria_layout_shard_valid(&bare, r), stria_layout_shard_valid(&striped, r));
        for (int64_t i = 0; i < bare.shard_tokens; i++)
            cr_expect_eq(stria_layout_position(&bare, r, i), stria_layout_position(&striped, r, i));
    }
    /* a call's layout: its plan with documents, striping with one */
    stria_layout_t lc;
    stria_docplan_t *pc;
    cr_assert_eq(stria_docplan_layout(STRIA_LAYOUT_PACKED, &call, n, &lc, &pc), STRIA_OK);
    cr_assert_not_null(pc);
    cr_expect_eq(pc->digest, plan->digest, "the shared cache's plan is the plan");
    cr_expect_eq(lc.plan, pc);
    stria_docplan_unref(pc);
    stria_call_shape_t one = call;
    one.cu_seqlens = NULL;
    one.n_cu_seqlens = 0;
    cr_assert_eq(stria_docplan_layout(STRIA_LAYOUT_PACKED, &one, n, &lc, &pc), STRIA_OK);
    cr_expect_null(pc);
    cr_expect_eq(lc.kind, STRIA_LAYOUT_PACKED);
    cr_expect_eq(stria_layout_position(&lc, 1, 2), 1 + 2 * n);
    cr_assert_eq(stria_layout_init_plan(plan, &l), STRIA_OK);

    const size_t row = 2;
    uint16_t full[203], shard[68], back[203];
    for (int i = 0; i < 203; i++)
        full[i] = (uint16_t)(i * 7 + 1);
    memset(back, 0, sizeof(back));
    size_t most_runs = 0;
    for (int r = 0; r < n; r++) {
        size_t nr;
        stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS];
        const stria_layout_run_t *runs = stria_layout_runs(&l, r, true, &nr, tmp);
        int64_t idx = 0;
        for (size_t j = 0; j < nr; j++)
            for (int64_t i = 0; i < runs[j].count; i++, idx++) {
                int64_t pos = runs[j].first + i * runs[j].stride;
                int rr;
                int64_t ii;
                cr_assert_eq(stria_layout_position(&l, r, idx), pos);
                cr_assert_eq(stria_layout_locate(&l, pos, &rr, &ii), STRIA_OK);
                cr_assert(rr == r && ii == idx, "position %lld: rank %d row %lld, not %d %lld",
                          (long long)pos, rr, (long long)ii, r, (long long)idx);
                cr_assert_eq(pos < 203, idx < stria_layout_shard_valid(&l, r), "padding last");
            }
        cr_assert_eq(idx, 68);
        most_runs = nr > most_runs ? nr : most_runs;
        cr_assert_eq(stria_layout_scatter(&l, r, 1, row, full, shard), STRIA_OK);
        for (int64_t i = 0; i < 68; i++) {
            int64_t pos = stria_layout_position(&l, r, i);
            cr_assert_eq(shard[i], pos < 203 ? full[pos] : 0, "rank %d row %lld", r, (long long)i);
        }
        cr_assert_eq(stria_layout_gather(&l, r, 1, row, shard, back), STRIA_OK);
    }
    cr_expect(most_runs > STRIA_LAYOUT_MAX_RUNS, "a shard of more runs than the arithmetic kinds");
    cr_expect_eq(memcmp(full, back, sizeof(full)), 0);
    stria_docplan_unref(plan);
}
