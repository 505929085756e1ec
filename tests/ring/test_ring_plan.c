/* The ring plan (stria_ring_plan_*) against what a pass records, and the
 * step times every pass records: sources, computed steps and bytes of every
 * (rank, step) equal to the pass's statistics for every layout, ring size,
 * padding and mask; times that are ordered, nested and account for the
 * compute and wait the statistics report. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "stria_ring.h"

typedef struct {
    int n;
    stria_layout_kind_t layout;
    int64_t S;
    bool causal;
    const int64_t *cu;
    size_t n_cu;
    bool has_window;
    int64_t left;
    bool no_times;
} pcase_t;

static stria_ring_shape_t shape_of(const pcase_t *c)
{
    stria_ring_shape_t s = {.call = {.batch = 1,
                                     .seq_len = c->S,
                                     .causal = c->causal,
                                     .cu_seqlens = c->cu,
                                     .n_cu_seqlens = c->n_cu,
                                     .has_window = c->has_window,
                                     .window_left = c->has_window ? c->left : 0,
                                     .window_right = 0},
                            .heads = 2,
                            .kv_heads = 1,
                            .head_dim = 32,
                            .dtype = STRIA_DTYPE_BF16};
    return s;
}

/* Runs a forward and a backward pass of the case; stats [rank][step]. */
static void run_case(const pcase_t *c, stria_ring_step_stats_t *fwd, stria_ring_step_stats_t *bwd)
{
    const int64_t nq = c->S * 2 * 32, nk = c->S * 32;
    float *buf = calloc((size_t)(5 * nq + 4 * nk + 2 * c->S), sizeof(float));
    float *q = buf, *g = q + nq, *o = g + nq, *dq = o + nq, *k = dq + nq, *v = k + nk;
    float *dk = v + nk, *dv = dk + nk, *lse = dv + nk;
    ref_fill(q, (size_t)nq, 1, 1.0f, STRIA_DTYPE_F32);
    ref_fill(k, (size_t)nk, 2, 1.0f, STRIA_DTYPE_F32);
    ref_fill(v, (size_t)nk, 3, 1.0f, STRIA_DTYPE_F32);
    ref_fill(g, (size_t)nq, 4, 1.0f, STRIA_DTYPE_F32);
    void *qs = malloc((size_t)nq * 2), *gs = malloc((size_t)nq * 2);
    void *ks = malloc((size_t)nk * 2), *vs = malloc((size_t)nk * 2);
    ref_to_dtype(q, (size_t)nq, STRIA_DTYPE_BF16, qs);
    ref_to_dtype(g, (size_t)nq, STRIA_DTYPE_BF16, gs);
    ref_to_dtype(k, (size_t)nk, STRIA_DTYPE_BF16, ks);
    ref_to_dtype(v, (size_t)nk, STRIA_DTYPE_BF16, vs);
    stria_ring_shape_t shape = shape_of(c);
    stria_ring_local_opts_t opts = {.layout = c->layout,
                                    .n_ranks = c->n,
                                    .passes = STRIA_RING_PASS_FWD_BWD,
                                    .step_timeout_s = 60,
                                    .no_step_times = c->no_times};
    stria_ring_local_io_t io = {.q = qs,
                                .k = ks,
                                .v = vs,
                                .o = o,
                                .o_dtype = STRIA_DTYPE_F32,
                                .lse = lse,
                                .d_o = gs,
                                .dq = dq,
                                .dk = dk,
                                .dv = dv,
                                .grad_dtype = STRIA_DTYPE_F32};
    stria_ring_local_stats_t stats = {.fwd_steps = fwd, .bwd_steps = bwd};
    cr_assert_eq(stria_ring_run_local(&shape, &opts, &io, &stats), STRIA_OK, "%s",
                 stria_error_msg());
    free(qs);
    free(gs);
    free(ks);
    free(vs);
    free(buf);
}

static void check_plan(const pcase_t *c, const stria_ring_step_stats_t *st, bool backward)
{
    stria_ring_shape_t shape = shape_of(c);
    stria_ring_plan_t *plan = NULL;
    cr_assert_eq(stria_ring_plan_create(&shape, c->layout, c->n, false, &plan), STRIA_OK, "%s",
                 stria_error_msg());
    const int steps = stria_ring_plan_steps(plan, backward);
    cr_assert(steps >= 1 && steps <= c->n);
    if (backward || (!c->has_window && c->n_cu == 0))
        cr_assert_eq(steps, c->n);
    for (int r = 0; r < c->n; r++)
        for (int s = 0; s < c->n; s++) {
            const stria_ring_step_stats_t *ss = &st[r * c->n + s];
            stria_ring_plan_step_t ps;
            if (s >= steps) { /* steps the pass did not run: nothing recorded */
                cr_assert_eq(ss->bytes_sent + ss->bytes_recv, 0);
                cr_assert_eq(ss->times.n_spans, 0);
                cr_assert_eq(stria_ring_plan_step(plan, r, s, backward, &ps),
                             STRIA_ERR_INVALID_ARG);
                continue;
            }
            cr_assert_eq(stria_ring_plan_step(plan, r, s, backward, &ps), STRIA_OK);
            cr_assert_eq(ps.src_rank, ss->src_rank, "rank %d step %d", r, s);
            cr_assert_eq(ps.computed, ss->computed, "%s N=%d rank %d step %d: plan %d, pass %d",
                         stria_layout_kind_name(c->layout), c->n, r, s, ps.computed, ss->computed);
            cr_assert_eq(ps.bytes_sent, ss->bytes_sent, "%s rank %d step %d: sent %llu vs %llu",
                         backward ? "bwd" : "fwd", r, s, (unsigned long long)ps.bytes_sent,
                         (unsigned long long)ss->bytes_sent);
            cr_assert_eq(ps.bytes_recv, ss->bytes_recv, "%s rank %d step %d: recv %llu vs %llu",
                         backward ? "bwd" : "fwd", r, s, (unsigned long long)ps.bytes_recv,
                         (unsigned long long)ss->bytes_recv);
            stria_attn_params_t a;
            if (stria_ring_plan_params(plan, r, ps.src_rank, &a)) {
                stria_attn_work_t w;
                cr_assert_eq(stria_attn_work(&a, 0, 0, &w), STRIA_OK, "%s", stria_error_msg());
                /* a computed block has work unless documents or a window hide it all */
                if (ss->computed && c->n_cu == 0 && !c->has_window)
                    cr_assert_gt(w.full + w.partial, 0, "rank %d step %d", r, s);
                if (!c->causal)
                    cr_assert_eq(w.partial, 0);
            }
        }
    stria_ring_plan_destroy(plan);
}

static double span_sum(const stria_ring_step_times_t *t, stria_ring_span_kind_t kind)
{
    double sum = 0;
    for (int i = 0; i < t->n_spans; i++)
        if (t->spans[i].kind == kind)
            sum += t->spans[i].end - t->spans[i].begin;
    return sum;
}

static void check_times(const pcase_t *c, const stria_ring_step_stats_t *st, bool backward)
{
    const int N = c->n;
    stria_ring_shape_t shape = shape_of(c);
    stria_ring_plan_t *plan = NULL;
    cr_assert_eq(stria_ring_plan_create(&shape, c->layout, c->n, false, &plan), STRIA_OK);
    const int steps = stria_ring_plan_steps(plan, backward);
    stria_ring_plan_destroy(plan);
    for (int r = 0; r < N; r++) {
        double origin = st[r * N].times.origin;
        cr_assert_gt(origin, 0.0);
        for (int s = 0; s < steps; s++) {
            const stria_ring_step_stats_t *ss = &st[r * N + s];
            const stria_ring_step_times_t *t = &ss->times;
            cr_assert_eq(t->origin, origin);
            cr_assert(t->begin >= 0 && t->end >= t->begin, "rank %d step %d: [%g, %g]", r, s,
                      t->begin, t->end);
            if (s > 0)
                cr_assert_eq(t->begin, st[r * N + s - 1].times.end);
            else
                cr_assert_eq(t->begin, 0.0);
            double prev = t->begin;
            for (int i = 0; i < t->n_spans; i++) { /* CPU: in order, inside the step */
                const stria_ring_span_t *sp = &t->spans[i];
                if (!(sp->begin >= prev - 1e-9))
                    for (int x = 0; x < t->n_spans; x++)
                        fprintf(stderr, "%s span %d kind %d [%.7f %.7f]\n",
                                backward ? "bwd" : "fwd", x, t->spans[x].kind, t->spans[x].begin,
                                t->spans[x].end);
                cr_assert(sp->begin >= prev - 1e-9 && sp->end >= sp->begin &&
                              sp->end <= t->end + 1e-9,
                          "rank %d step %d span %d [%g, %g] in [%g, %g]", r, s, i, sp->begin,
                          sp->end, t->begin, t->end);
                prev = sp->end;
            }
            /* spans cover what the statistics count (joined spans may cover more) */
            cr_assert_geq(span_sum(t, STRIA_RING_SPAN_COMPUTE), ss->compute_wall_s * 0.999 - 1e-6);
            cr_assert_geq(span_sum(t, STRIA_RING_SPAN_WAIT), ss->wait_s * 0.999 - 1e-6);
            if (ss->computed)
                cr_assert_gt(span_sum(t, STRIA_RING_SPAN_COMPUTE), 0.0);
            cr_assert_eq(t->merged, 0, "rank %d step %d: %d spans merged", r, s, t->merged);
            /* the K/V block goes on in every step but the last */
            if (s + 1 < steps)
                cr_assert(t->send_begin >= 0 && t->send_end >= t->send_begin &&
                              t->send_end <= t->end + 1e-9,
                          "rank %d step %d: send [%g, %g]", r, s, t->send_begin, t->send_end);
            else
                cr_assert_lt(t->send_begin, 0.0);
            if (backward && N > 1) /* the dK/dV sum goes on in every step */
                cr_assert(t->sum_send_begin >= t->begin && t->sum_send_end >= t->sum_send_begin,
                          "rank %d step %d: sum send [%g, %g]", r, s, t->sum_send_begin,
                          t->sum_send_end);
            else
                cr_assert_lt(t->sum_send_begin, 0.0);
        }
    }
}

static void check_both(const pcase_t *c)
{
    size_t nn = (size_t)(c->n * c->n);
    stria_ring_step_stats_t *fwd = calloc(nn, sizeof(*fwd)), *bwd = calloc(nn, sizeof(*bwd));
    run_case(c, fwd, bwd);
    check_plan(c, fwd, false);
    check_plan(c, bwd, true);
    if (c->no_times) {
        stria_ring_step_times_t zero;
        memset(&zero, 0, sizeof(zero));
        for (size_t i = 0; i < nn; i++) {
            cr_assert_eq(memcmp(&fwd[i].times, &zero, sizeof(zero)), 0);
            cr_assert_eq(memcmp(&bwd[i].times, &zero, sizeof(zero)), 0);
        }
    } else {
        check_times(c, fwd, false);
        check_times(c, bwd, true);
    }
    free(fwd);
    free(bwd);
}

Test(ring_plan, every_layout_size_and_padding)
{
    static const stria_layout_kind_t layouts[] = {STRIA_LAYOUT_CONTIGUOUS, STRIA_LAYOUT_STRIPED,
                                                  STRIA_LAYOUT_ZIGZAG};
    static const int sizes[] = {1, 2, 3, 4, 5};
    for (size_t l = 0; l < 3; l++)
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
            /* 301 tokens: padded shards for every size but 1 */
            pcase_t c = {.n = sizes[i], .layout = layouts[l], .S = 301, .causal = true};
            check_both(&c);
            c.causal = false;
            c.S = 160;
            check_both(&c);
        }
}

Test(ring_plan, documents_and_windows)
{
    static const int64_t cu[] = {0, 1, 17, 300, 301, 512};
    static const stria_layout_kind_t layouts[] = {STRIA_LAYOUT_CONTIGUOUS, STRIA_LAYOUT_STRIPED,
                                                  STRIA_LAYOUT_ZIGZAG};
    for (size_t l = 0; l < 3; l++) {
        pcase_t docs = {
            .n = 4, .layout = layouts[l], .S = 512, .causal = true, .cu = cu, .n_cu = 6};
        pcase_t win = {.n = 4,
                       .layout = layouts[l],
                       .S = 512,
                       .causal = true,
                       .has_window = true,
                       .left = 100};
        check_both(&docs);
        check_both(&win);
    }
}

Test(ring_plan, no_step_times_records_nothing)
{
    pcase_t c = {
        .n = 3, .layout = STRIA_LAYOUT_STRIPED, .S = 300, .causal = true, .no_times = true};
    check_both(&c);
}

Test(ring_plan, refusals)
{
    pcase_t c = {.n = 2, .layout = STRIA_LAYOUT_STRIPED, .S = 100, .causal = true};
    stria_ring_shape_t shape = shape_of(&c);
    stria_ring_plan_t *plan = NULL;
    stria_ring_plan_step_t ps;
    cr_assert_eq(stria_ring_plan_create(&shape, STRIA_LAYOUT_STRIPED, 0, false, &plan),
                 STRIA_ERR_INVALID_ARG);
    shape.kv_heads = 3;
    cr_assert_eq(stria_ring_plan_create(&shape, STRIA_LAYOUT_STRIPED, 2, false, &plan),
                 STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "kv_heads") != NULL, "%s", stria_error_msg());
    shape.kv_heads = 1;
    cr_assert_eq(stria_ring_plan_create(&shape, STRIA_LAYOUT_STRIPED, 2, false, &plan), STRIA_OK);
    cr_assert_eq(stria_ring_plan_step(plan, 2, 0, false, &ps), STRIA_ERR_INVALID_ARG);
    cr_assert(strstr(stria_error_msg(), "rank 2") != NULL, "%s", stria_error_msg());
    stria_ring_plan_destroy(plan);
}

/* The whole-sequence kernel parameters: the dimensions and the call record's
 * length, scale, causality, documents and window, nothing of a block. */
Test(ring_plan, shape_attn_params_carry_the_call_record)
{
    static const int64_t cu[] = {0, 40, 96};
    const stria_ring_shape_t s = {.call = {.batch = 2,
                                           .seq_len = 96,
                                           .causal = true,
                                           .scale = 0.25f,
                                           .cu_seqlens = cu,
                                           .n_cu_seqlens = 3,
                                           .has_window = true,
                                           .window_left = 7,
                                           .window_right = -1},
                                  .heads = 8,
                                  .kv_heads = 2,
                                  .head_dim = 64,
                                  .dtype = STRIA_DTYPE_BF16};
    stria_attn_params_t a = stria_ring_shape_attn_params(&s);
    cr_assert(a.batch == 2 && a.q_tokens == 96 && a.kv_tokens == 96 && a.heads == 8);
    cr_assert(a.kv_heads == 2 && a.head_dim == 64 && a.scale == 0.25f && a.causal);
    cr_assert(a.cu_seqlens == cu && a.n_cu_seqlens == 3 && a.has_window);
    cr_assert(a.window_left == 7 && a.window_right == -1);
    cr_assert(a.pool == NULL && a.workspace == NULL && a.q_pos.n_runs == 0);
}
