/* The simulator of stria-bench simulate (bench/sim.c), on deterministic
 * quantities at small sizes: its table of every (rank, step) against what
 * real in-process passes record (sources, computed steps, bytes), its
 * classification shortcut (block pairs alike up to a shift or a relabelling
 * classified once) against classifying every pair, and its event model
 * against closed forms where the answer is known. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "sim.h"
#include "tref.h"

static const stria_layout_kind_t layouts[] = {STRIA_LAYOUT_CONTIGUOUS, STRIA_LAYOUT_STRIPED,
                                              STRIA_LAYOUT_ZIGZAG};

static stria_ring_shape_t shape_of(int64_t seq, bool causal)
{
    stria_ring_shape_t s = {.call = {.batch = 1, .seq_len = seq, .causal = causal},
                            .heads = 2,
                            .kv_heads = 1,
                            .head_dim = 32,
                            .dtype = STRIA_DTYPE_F32};
    return s;
}

/* Every computed (rank, step) of the table classified directly. */
static void check_memo(const stria_ring_shape_t *shape, stria_layout_kind_t layout, int n,
                       int64_t tq, int64_t tk)
{
    stria_sim_table_t t;
    stria_ring_plan_t *plan;
    cr_assert_eq(stria_sim_table(shape, layout, n, tq, tk, &t), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_ring_plan_create(shape, layout, n, false, &plan), STRIA_OK);
    for (int r = 0; r < n; r++)
        for (int s = 0; s < n; s++) {
            const stria_sim_cell_t *c = &t.cells[r * n + s];
            stria_attn_params_t a;
            stria_attn_work_t w;
            if (!c->computed || !stria_ring_plan_params(plan, r, c->src, &a))
                continue;
            cr_assert_eq(stria_attn_work(&a, tq, tk, &w), STRIA_OK);
            cr_assert_eq(c->full_elems, w.full_elems, "%s N=%d S=%lld rank %d step %d",
                         stria_layout_kind_name(layout), n, (long long)shape->call.seq_len, r, s);
            cr_assert_eq(c->partial_elems, w.partial_elems, "%s N=%d S=%lld rank %d step %d",
                         stria_layout_kind_name(layout), n, (long long)shape->call.seq_len, r, s);
        }
    stria_ring_plan_destroy(plan);
    stria_sim_table_free(&t);
}

Test(sim, classifying_once_per_class_equals_classifying_every_pair)
{
    static const int64_t seqs[] = {1000, 1003, 4096};
    for (size_t l = 0; l < 3; l++)
        for (int n = 1; n <= 9; n += 2)
            for (size_t i = 0; i < 3; i++) {
                stria_ring_shape_t s = shape_of(seqs[i], true);
                check_memo(&s, layouts[l], n, 0, 0);
                check_memo(&s, layouts[l], n, 96, 80);
                s.call.has_window = true; /* windows: shifts only */
                s.call.window_left = 150;
                check_memo(&s, layouts[l], n, 0, 0);
                s = shape_of(seqs[i], false);
                check_memo(&s, layouts[l], n, 0, 0);
            }
}

/* The table's sources and computed steps, and the simulated bytes, against a
 * real pass's statistics. */
static void check_against_run(stria_layout_kind_t layout, int n, int64_t seq, bool window)
{
    stria_ring_shape_t shape = shape_of(seq, true);
    if (window) {
        shape.call.has_window = true;
        shape.call.window_left = 100;
    }
    const size_t nq = (size_t)(seq * 2 * 32), nk = (size_t)(seq * 32), nn = (size_t)(n * n);
    float *buf = calloc(5 * nq + 4 * nk + 2 * (size_t)seq, sizeof(float));
    stria_ring_step_stats_t *fwd = calloc(nn, sizeof(*fwd)), *bwd = calloc(nn, sizeof(*bwd));
    float *q = buf, *g = q + nq, *o = g + nq, *dq = o + nq, *k = dq + nq, *v = k + nk;
    float *dk = v + nk, *dv = dk + nk, *lse = dv + nk;
    ref_fill(q, nq, 1, 1, STRIA_DTYPE_F32);
    ref_fill(k, nk, 2, 1, STRIA_DTYPE_F32);
    ref_fill(v, nk, 3, 1, STRIA_DTYPE_F32);
    ref_fill(g, nq, 4, 1, STRIA_DTYPE_F32);
    stria_ring_local_opts_t lo = {
        .layout = layout, .n_ranks = n, .passes = STRIA_RING_PASS_FWD_BWD, .step_timeout_s = 60};
    stria_ring_local_stats_t stats = {.fwd_steps = fwd, .bwd_steps = bwd};
    void *const out[TJ_N_OUT] = {o, lse, dq, dk, dv};
    cr_assert_eq(tref_ring_run(&shape, &lo, q, k, v, g, out, &stats), STRIA_OK, "%s",
                 stria_error_msg());
    stria_sim_table_t t;
    cr_assert_eq(stria_sim_table(&shape, layout, n, 0, 0, &t), STRIA_OK);
    stria_sim_costs_t costs;
    memset(&costs, 0, sizeof(costs));
    costs.fwd[STRIA_SIM_FULL] = costs.bwd[STRIA_SIM_FULL] = 1e-9;
    costs.fwd[STRIA_SIM_PART] = costs.bwd[STRIA_SIM_PART] = 2e-9;
    stria_sim_link_t link = {1, 1e9, 1e9, 1e-6, 0};
    for (int b = 0; b < 2; b++) {
        const stria_ring_step_stats_t *st = b ? bwd : fwd;
        stria_sim_result_t res;
        cr_assert_eq(stria_sim_pass(&t, &costs, &link, b == 1, &res, NULL, NULL), STRIA_OK);
        uint64_t most = 0;
        for (int r = 0; r < n; r++) {
            uint64_t sent = 0;
            for (int s = 0; s < n; s++) {
                sent += st[r * n + s].bytes_sent;
                if (s >= res.steps)
                    continue;
                cr_assert_eq(t.cells[r * n + s].src, st[r * n + s].src_rank);
                cr_assert_eq(t.cells[r * n + s].computed, st[r * n + s].computed,
                             "%s N=%d rank %d step %d", stria_layout_kind_name(layout), n, r, s);
            }
            most = sent > most ? sent : most;
        }
        cr_assert_eq(res.bytes_sent, most, "%s %s: simulated %llu bytes, the pass sent %llu",
                     stria_layout_kind_name(layout), b ? "bwd" : "fwd",
                     (unsigned long long)res.bytes_sent, (unsigned long long)most);
        cr_assert_eq(res.steps, b ? n : t.fwd_steps);
        cr_assert_gt(res.pass_s, 0.0, "%s N=%d S=%lld %s", stria_layout_kind_name(layout), n,
                     (long long)seq, b ? "bwd" : "fwd");
        /* a rank computes one step after the other: the pass is at least the
         * mean rank's compute (the lockstep critical path is no bound: ranks
         * a step apart overlap their heavy steps) */
        cr_assert_geq(res.pass_s, res.compute_s / n * (1 - 1e-12));
    }
    stria_sim_table_free(&t);
    free(fwd);
    free(bwd);
    free(buf);
}

Test(sim, table_and_bytes_match_real_passes)
{
    for (size_t l = 0; l < 3; l++)
        for (int n = 1; n <= 4; n++) {
            check_against_run(layouts[l], n, 301, false);
            check_against_run(layouts[l], n, 512, true);
        }
}

/* With no compute, every step of a forward pass is one transfer (bytes over
 * bandwidth plus latency) and the agreement N - 1 latencies: the model's
 * closed form. Links inside a host are faster; the slowest link paces the
 * ring. */
Test(sim, transfers_alone_follow_the_closed_form)
{
    for (size_t l = 0; l < 3; l++)
        for (int n = 2; n <= 8; n += 3) {
            stria_ring_shape_t shape = shape_of(64 * n, true);
            stria_sim_table_t t;
            stria_sim_costs_t zero;
            stria_sim_result_t res;
            memset(&zero, 0, sizeof(zero));
            cr_assert_eq(stria_sim_table(&shape, layouts[l], n, 0, 0, &t), STRIA_OK);
            stria_sim_link_t link = {2, 4e9, 1e9, 5e-6, 0};
            cr_assert_eq(stria_sim_pass(&t, &zero, &link, false, &res, NULL, NULL), STRIA_OK);
            /* two devices per host: the ring of 2 stays inside one */
            const double bw = n > 2 ? 1e9 : 4e9;
            double want = (n - 1) * ((double)t.msg_bytes / bw + 5e-6) + (n - 1) * 5e-6;
            cr_assert(fabs(res.pass_s - want) < 1e-9 * want + 1e-12, "%s N=%d: %.9g s, want %.9g s",
                      stria_layout_kind_name(layouts[l]), n, res.pass_s, want);
            cr_assert_eq(res.critical_s, 0.0);
            /* the backward moves the dK/dV sums as well: never faster */
            cr_assert_eq(stria_sim_pass(&t, &zero, &link, true, &res, NULL, NULL), STRIA_OK);
            cr_assert_gt(res.pass_s, want);
            stria_sim_table_free(&t);
        }
}

/* Without masks every rank computes every block: the pass is N blocks, in
 * every layout, and every rank is busy. */
Test(sim, unmasked_rings_are_balanced)
{
    for (size_t l = 0; l < 3; l++) {
        stria_ring_shape_t shape = shape_of(1024, false);
        stria_sim_table_t t;
        stria_sim_costs_t c;
        stria_sim_result_t res;
        memset(&c, 0, sizeof(c));
        c.fwd[STRIA_SIM_FULL] = 1e-9;
        cr_assert_eq(stria_sim_table(&shape, layouts[l], 4, 0, 0, &t), STRIA_OK);
        stria_sim_link_t free_link = {0, INFINITY, INFINITY, 0, 0};
        cr_assert_eq(stria_sim_pass(&t, &c, &free_link, false, &res, NULL, NULL), STRIA_OK);
        const double block = 256.0 * 256 * 2 * 32 * 1e-9;
        cr_assert(fabs(res.pass_s - 4 * block) < 1e-9, "%s: %g s",
                  stria_layout_kind_name(layouts[l]), res.pass_s);
        cr_assert(fabs(res.compute_s - 16 * block) < 1e-9);
        stria_sim_table_free(&t);
    }
}

Test(sim, fit_recovers_known_costs)
{
    double x[40 * STRIA_SIM_NCOEF], y[40], coef[STRIA_SIM_NCOEF];
    const double truth[STRIA_SIM_NCOEF] = {2e-11, 5e-11, 3e-10, 1e-5, 4e-9, 0, 0};
    memset(x, 0, sizeof(x));
    for (int i = 0; i < 40; i++) {
        x[i * STRIA_SIM_NCOEF + STRIA_SIM_FULL] = 1e8 * (i % 5);
        x[i * STRIA_SIM_NCOEF + STRIA_SIM_PART] = 3e7 * (i % 7);
        x[i * STRIA_SIM_NCOEF + STRIA_SIM_TOK] = 1e6 * (1 + i % 3);
        x[i * STRIA_SIM_NCOEF + STRIA_SIM_CALL] = 1;
        x[i * STRIA_SIM_NCOEF + STRIA_SIM_OPEN] = i % 4 == 0 ? 2e5 : 0;
        y[i] = 0;
        for (int j = 0; j < STRIA_SIM_NCOEF; j++)
            y[i] += truth[j] * x[i * STRIA_SIM_NCOEF + j];
    }
    double err = stria_sim_fit(x, y, 40, coef);
    cr_assert_lt(err, 1e-6);
    for (int j = 0; j < STRIA_SIM_NCOEF; j++)
        cr_assert(fabs(coef[j] - truth[j]) <= 1e-4 * truth[j] + 1e-20, "coef %d: %g, want %g", j,
                  coef[j], truth[j]);
}
