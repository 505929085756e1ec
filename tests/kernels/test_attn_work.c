/* Work counts of a call (stria_attn_work, plans): against a brute-force
 * count of visible (query, key) pairs per tile and per 16 x 16 sub-block,
 * from the reference's visibility rule. Causal masks are classified exactly
 * by position bounds (shards' positions increase), so their counts must equal
 * the brute force; documents and windows may classify a pair partial whose
 * rows each see none of its keys, so there the brute force bounds them. */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "stria_kernels.h"

typedef struct {
    int64_t Tq, Tk;
    bool causal;
    stria_pos_run_t q[2], k[2];
    size_t nq, nk;
    const int64_t *cu;
    size_t n_cu;
    bool has_window;
    int64_t left, right;
} wcase_t;

static int64_t *expand(const stria_pos_run_t *runs, size_t n, int64_t tokens)
{
    int64_t *pos = malloc((size_t)tokens * sizeof(int64_t)), at = 0;
    for (size_t r = 0; r < n; r++)
        for (int64_t i = 0; i < runs[r].count; i++)
            pos[at++] = runs[r].first + i * runs[r].stride;
    cr_assert_eq(at, tokens);
    return pos;
}

static stria_attn_params_t params_of(const wcase_t *c)
{
    stria_attn_params_t p;
    memset(&p, 0, sizeof(p));
    p.batch = 1;
    p.q_tokens = c->Tq;
    p.kv_tokens = c->Tk;
    p.heads = p.kv_heads = 2;
    p.head_dim = 32;
    p.causal = c->causal;
    p.q_pos = (stria_positions_t){c->q, c->nq};
    p.kv_pos = (stria_positions_t){c->k, c->nk};
    p.cu_seqlens = c->cu;
    p.n_cu_seqlens = c->n_cu;
    p.has_window = c->has_window;
    p.window_left = c->left;
    p.window_right = c->right;
    return p;
}

/* Visible pairs of rows [q0, q0 + nq) x keys [k0, k0 + nk). */
static int64_t visible(const wcase_t *c, const int64_t *qp, const int64_t *kp, int64_t q0,
                       int64_t nq, int64_t k0, int64_t nk)
{
    ref_shape_t s = {.causal = c->causal};
    ref_masks_t m = {c->cu, c->n_cu, c->has_window, c->left, c->right};
    int64_t n = 0;
    for (int64_t i = q0; i < q0 + nq; i++)
        for (int64_t j = k0; j < k0 + nk; j++)
            n += ref_visible(&s, &m, qp[i], kp[j]);
    return n;
}

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* Tiles of tq x tk (0: the kernels' 64 x 64 with 16 x 16 sub-blocks). */
static void check_case(const wcase_t *c, int64_t tq, int64_t tk)
{
    const bool exact = c->n_cu == 0 && !c->has_window, kern = tq == 0;
    const int64_t TQ = kern ? 64 : tq, TK = kern ? 64 : tk;
    int64_t *qp = expand(c->q, c->nq, c->Tq), *kp = expand(c->k, c->nk, c->Tk);
    int64_t all = 0, some = 0, none = 0, all_elems = 0, tiles = 0;
    int64_t sb_any = 0, sb_all = 0;
    stria_attn_params_t p = params_of(c);
    stria_attn_work_t w;

    cr_assert_eq(stria_attn_work(&p, tq, tk, &w), STRIA_OK, "%s", stria_error_msg());
    for (int64_t q0 = 0; q0 < c->Tq; q0 += TQ)
        for (int64_t k0 = 0; k0 < c->Tk; k0 += TK) {
            int64_t nq = min64(TQ, c->Tq - q0), nk = min64(TK, c->Tk - k0);
            int64_t v = visible(c, qp, kp, q0, nq, k0, nk);
            tiles++;
            if (v == nq * nk) {
                all++;
                all_elems += v;
                continue;
            }
            if (v == 0) {
                none++;
                continue;
            }
            some++;
            for (int64_t a = q0; kern && a < q0 + nq; a += 16)
                for (int64_t b = k0; b < k0 + nk; b += 16) {
                    int64_t sq = min64(16, q0 + nq - a), sk = min64(16, k0 + nk - b);
                    int64_t sv = visible(c, qp, kp, a, sq, b, sk);
                    sb_any += sv > 0;
                    sb_all += sv == sq * sk;
                }
        }
    cr_assert_eq(w.tiles, tiles);
    cr_assert_eq(w.full, all, "full %lld, brute force %lld", (long long)w.full, (long long)all);
    cr_assert_eq(w.full_elems, all_elems);
    if (exact) {
        cr_assert_eq(w.partial, some, "partial %lld, brute force %lld", (long long)w.partial,
                     (long long)some);
        if (kern) {
            /* causal: a chunk's visible key sub-blocks are a prefix, no holes */
            cr_assert_eq(w.sub_full + w.sub_masked, sb_any);
            cr_assert_eq(w.sub_full, sb_all);
            cr_assert_eq(w.sub_hole, 0);
        }
    } else {
        cr_assert_geq(w.partial, some);
        cr_assert_leq(w.partial, some + none);
        if (kern)
            cr_assert_geq(w.sub_full + w.sub_masked, sb_any);
    }
    if (!kern)
        cr_assert_eq(w.sub_full + w.sub_masked + w.sub_hole, 0);
    else
        cr_assert_leq(w.partial_elems, w.partial * 64 * 64);
    free(qp);
    free(kp);
}

static void check_all_tiles(const wcase_t *c)
{
    check_case(c, 0, 0);
    check_case(c, 100, 48);
    check_case(c, 128, 128);
}

Test(attn_work, contiguous_blocks)
{
    wcase_t diag = {.Tq = 300,
                    .Tk = 300,
                    .causal = true,
                    .q = {{0, 1, 300}},
                    .nq = 1,
                    .k = {{0, 1, 300}},
                    .nk = 1};
    wcase_t full = {.Tq = 300,
                    .Tk = 300,
                    .causal = true,
                    .q = {{300, 1, 300}},
                    .nq = 1,
                    .k = {{0, 1, 300}},
                    .nk = 1};
    wcase_t hidden = {.Tq = 300,
                      .Tk = 300,
                      .causal = true,
                      .q = {{0, 1, 300}},
                      .nq = 1,
                      .k = {{300, 1, 300}},
                      .nk = 1};
    check_all_tiles(&diag);
    check_all_tiles(&full);
    check_all_tiles(&hidden);
}

Test(attn_work, striped_and_zigzag_blocks)
{
    /* ring of 4, 1200 tokens: striped rank 2 against ranks 1 and 3 */
    wcase_t incl = {.Tq = 300,
                    .Tk = 300,
                    .causal = true,
                    .q = {{2, 4, 300}},
                    .nq = 1,
                    .k = {{1, 4, 300}},
                    .nk = 1};
    wcase_t excl = {.Tq = 300,
                    .Tk = 300,
                    .causal = true,
                    .q = {{2, 4, 300}},
                    .nq = 1,
                    .k = {{3, 4, 300}},
                    .nk = 1};
    /* zigzag, 8 chunks of 150: rank 1 holds chunks 1 and 6, rank 2 chunks 2 and 5 */
    wcase_t zz = {.Tq = 300,
                  .Tk = 300,
                  .causal = true,
                  .q = {{150, 1, 150}, {900, 1, 150}},
                  .nq = 2,
                  .k = {{300, 1, 150}, {750, 1, 150}},
                  .nk = 2};
    check_all_tiles(&incl);
    check_all_tiles(&excl);
    check_all_tiles(&zz);
}

Test(attn_work, non_causal_is_all_full)
{
    wcase_t c = {.Tq = 200,
                 .Tk = 130,
                 .causal = false,
                 .q = {{5, 3, 200}},
                 .nq = 1,
                 .k = {{0, 1, 130}},
                 .nk = 1};
    stria_attn_params_t p = params_of(&c);
    stria_attn_work_t w;
    check_all_tiles(&c);
    cr_assert_eq(stria_attn_work(&p, 0, 0, &w), STRIA_OK);
    cr_assert_eq(w.full_elems, 200 * 130);
    cr_assert_eq(w.partial, 0);
}

Test(attn_work, documents_and_windows_are_bounded_by_brute_force)
{
    static const int64_t cu[] = {0, 1, 17, 300, 301, 1200};
    wcase_t docs = {.Tq = 300,
                    .Tk = 300,
                    .causal = true,
                    .q = {{2, 4, 300}},
                    .nq = 1,
                    .k = {{1, 4, 300}},
                    .nk = 1,
                    .cu = cu,
                    .n_cu = 6};
    wcase_t win = {.Tq = 300,
                   .Tk = 300,
                   .causal = true,
                   .q = {{300, 1, 300}},
                   .nq = 1,
                   .k = {{0, 1, 300}},
                   .nk = 1,
                   .has_window = true,
                   .left = 100,
                   .right = 0};
    wcase_t both = {.Tq = 300,
                    .Tk = 300,
                    .causal = false,
                    .q = {{0, 4, 300}},
                    .nq = 1,
                    .k = {{3, 4, 300}},
                    .nk = 1,
                    .cu = cu,
                    .n_cu = 6,
                    .has_window = true,
                    .left = 40,
                    .right = 9};
    check_all_tiles(&docs);
    check_all_tiles(&win);
    check_all_tiles(&both);
}

Test(attn_work, plans_reused_across_pairs_match_single_calls)
{
    /* every (q rank, k rank) pair of a striped ring of 3 over 500 tokens */
    stria_attn_plan_t *plan[3];
    stria_pos_run_t runs[3];
    for (int r = 0; r < 3; r++) {
        wcase_t c = {.Tq = 0, .causal = true};
        runs[r] = (stria_pos_run_t){r, 3, (500 - r + 2) / 3};
        c.Tq = c.Tk = runs[r].count;
        c.q[0] = c.k[0] = runs[r];
        c.nq = c.nk = 1;
        stria_attn_params_t p = params_of(&c);
        cr_assert_eq(stria_attn_plan_create(&p, 0, 0, &plan[r]), STRIA_OK, "%s", stria_error_msg());
    }
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) {
            wcase_t c = {.Tq = runs[i].count,
                         .Tk = runs[j].count,
                         .causal = true,
                         .q = {runs[i]},
                         .nq = 1,
                         .k = {runs[j]},
                         .nk = 1};
            stria_attn_params_t p = params_of(&c);
            stria_attn_work_t a, b;
            cr_assert_eq(stria_attn_plan_work(plan[i], plan[j], &a), STRIA_OK);
            cr_assert_eq(stria_attn_work(&p, 0, 0, &b), STRIA_OK);
            cr_assert_eq(memcmp(&a, &b, sizeof(a)), 0, "pair (%d, %d)", i, j);
            check_case(&c, 0, 0);
        }
    for (int r = 0; r < 3; r++)
        stria_attn_plan_destroy(plan[r]);
}

Test(attn_work, refusals_name_the_problem)
{
    wcase_t c = {
        .Tq = 64, .Tk = 64, .causal = true, .q = {{0, 1, 64}}, .nq = 1, .k = {{0, 1, 64}}, .nk = 1};
    stria_attn_params_t p = params_of(&c), pw = p;
    stria_attn_plan_t *a = NULL, *b = NULL;
    stria_attn_work_t w;
    cr_assert_eq(stria_attn_work(&p, 64, 0, &w), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "tiles") != NULL, "%s", stria_error_msg());
    pw.has_window = true;
    pw.window_left = 8;
    cr_assert_eq(stria_attn_plan_create(&p, 0, 0, &a), STRIA_OK);
    cr_assert_eq(stria_attn_plan_create(&pw, 0, 0, &b), STRIA_OK);
    cr_assert_eq(stria_attn_plan_work(a, b, &w), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "masks") != NULL, "%s", stria_error_msg());
    stria_attn_plan_destroy(a);
    stria_attn_plan_destroy(b);
}
