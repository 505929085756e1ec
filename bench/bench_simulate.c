/* stria-bench simulate: predicted pass times of rings of up to thousands of
 * ranks, per layout, from the engine's plan, the kernels' work counts, costs
 * per unit of work (--calibrate: measured here; --device-tflops: a device's
 * rate) and a model of the ring's links (sim.h). --measure runs the same
 * passes in process and prints the predictions beside what they measure. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_util.h"
#include "sim.h"
#include "sim_runs.h"
#include "stria_common.h"
#include "stria_kernels.h"

#define STRIA__SIM_MAX_LIST 16
/* Tables and rows are indexed by layout kind (STRIA_LAYOUT_AUTO's slot
 * unused); STRIA__SIM_NL layouts are simulated, in stria__sim_order. */
#define STRIA__SIM_KINDS (STRIA_LAYOUT_PACKED + 1)
#define STRIA__SIM_NL    4

typedef struct {
    stria_int_list_t ranks, seqs, cal_at;
    stria_int_list_t groups; /* --head-groups: G rings of N / G ranks beside the 1-D ring */
    bool layout_on[STRIA__SIM_KINDS];
    bool do_fwd, do_bwd;
    stria_ring_shape_t shape;
    stria_bench_masks_t masks;
    bool calibrate, cal_each, measure, json;
    int reps, cal_reps;
    double tflops, bwd_ratio, call_us, host_add_gbs;
    double compute_scale; /* every compute cost times this (ranks sharing cores) */
    int64_t tile_q, tile_k;
    int64_t exact_pairs; /* --count-pairs */
    int64_t per_rank;    /* --seq-per-rank: S = per_rank x N (0: --seq) */
    stria_sim_link_t link;
    const char *timeline;
    stria_sim_costs_t costs; /* --device-tflops */
    char source[200];        /* where the costs come from */
    /* --calibrate: costs fitted at each shard length of --calibrate-at; a
     * ring uses those of the length nearest its shards (the cost of a unit
     * of work grows with the block as it leaves the caches) */
    stria_sim_costs_t cal[4];
    double cal_err[4][2];
    /* end to end (--layers): a model of the rest of a training step */
    int64_t layers, tp;
    double params_b, matmul_tflops;
    bool remat;
} stria__sim_opts_t;

static const char stria__sim_description[] =
    "Predicts the time of ring passes per layout (contiguous, striped, zigzag, and with\n"
    "--documents packed: the call's document plan, its kept documents computed whole at\n"
    "step 0, only its spread rows travelling) for rings of up to 65536 ranks, without\n"
    "running them: the engine's own plan of every (rank, step) (which block, computed\n"
    "or skipped, bytes), the kernels' own classification of the tiles and 16 x 16\n"
    "sub-blocks each call computes, a cost per unit of that work, and an event model\n"
    "of the ring: double-buffered K/V transfers overlapping compute, the backward's\n"
    "dK/dV sum one step behind, the closing agreement, links inside and between hosts\n"
    "in the coordinator's ring order (the devices of a host are neighbours), and on a\n"
    "device that is not host memory the engine's staging copies and host-side dK/dV\n"
    "sums.\n"
    "Costs: --calibrate measures this machine's kernels on small rings (with\n"
    "--documents, also with documents) and fits them per unit of work;\n"
    "--device-tflops gives a device's attention rate instead.";

static const char stria__sim_epilog[] =
    "--measure also runs every pass in process (one rank computing at a time, as\n"
    "stria-bench ring) and prints the measured critical path beside the predicted\n"
    "one (pred/meas), and the same ratio for every rank's compute added up (total\n"
    "p/m), which no maximum over noisy ranks biases: the check of the model; a pass\n"
    "whose steps, bytes or (rank, step) sources differ from the prediction's is\n"
    "named.\n"
    "Predicted pass: first rank's start to last rank's end; critical: sum over steps\n"
    "of the slowest rank's compute (stria-bench ring's figure).\n"
    "--head-groups G[,G...] adds, per pass, the same ring of N ranks run as G head\n"
    "groups: G rings of R = N / G ranks, each over heads / G and kv_heads / G (the\n"
    "engine's plan of that shape), ring g on the ring-order ranks g x R .. g x R + R - 1\n"
    "(so on hosts by --devices-per-host), the G rings at once and sharing no link;\n"
    "beside the 1-D ring: its speedup, the bytes a rank sends, and their K/V and dK/dV\n"
    "parts against the 1-D ring's with the expected (R - 1) / (N - 1) and R / N.\n"
    "--measure, --timeline and --layers stay with the 1-D ring.";

/* --tile QxK */
static stria_status_t stria__sim_tile(const char *text, void *dst)
{
    int64_t *t = dst;
    char *end;
    errno = 0;
    t[0] = strtoll(text, &end, 10);
    if (errno != 0 || (*end != 'x' && *end != 'X') || t[0] < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "'%s': expected QxK (tile sizes >= 1)", text);
    t[1] = strtoll(end + 1, &end, 10);
    if (errno != 0 || *end != '\0' || t[1] < 1 || t[0] > (1 << 20) || t[1] > (1 << 20))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "'%s': expected QxK (tile sizes 1..2^20)",
                               text);
    return STRIA_OK;
}

/* Device-rate costs: every computed element at the rate, a fixed cost per
 * computed call, the host's dK/dV sums at its memory bandwidth. */
static void stria__sim_device_costs(stria__sim_opts_t *o)
{
    stria_sim_costs_t *c = &o->costs;
    memset(c, 0, sizeof(*c));
    c->fwd[STRIA_SIM_FULL] = c->fwd[STRIA_SIM_PART] = 4.0 / (o->tflops * 1e12);
    c->bwd[STRIA_SIM_FULL] = c->bwd[STRIA_SIM_PART] = 4.0 * o->bwd_ratio / (o->tflops * 1e12);
    c->fwd[STRIA_SIM_CALL] = c->bwd[STRIA_SIM_CALL] = o->call_us * 1e-6;
    c->bwd[STRIA_SIM_ADD] = 12.0 / (o->host_add_gbs * 1e9); /* read 2, write 1 fp32 */
    c->tile_q = o->tile_q;
    c->tile_k = o->tile_k;
    snprintf(o->source, sizeof(o->source),
             "device rate %.0f TFLOP/s forward (backward %.2fx), %lldx%lld tiles computed whole "
             "when partial, %.0f us per call",
             o->tflops, o->bwd_ratio, (long long)o->tile_q, (long long)o->tile_k, o->call_us);
}

/* After parsing: the choices, the masks, the compute source. */
static int stria__sim_check(stria__sim_opts_t *o, const stria_cli_t *cli, const char *layout,
                            const char *pass, const char *docs, const stria_int_list_t *win)
{
    stria_layout_kind_t k;
    const bool staged = o->link.staging_Bps > 0;
    if (strcmp(layout, "all") == 0) {
        o->layout_on[STRIA_LAYOUT_CONTIGUOUS] = o->layout_on[STRIA_LAYOUT_STRIPED] = true;
        o->layout_on[STRIA_LAYOUT_ZIGZAG] = true;
        /* packed with documents, on host memory (the engine stages no packed pass) */
        o->layout_on[STRIA_LAYOUT_PACKED] = docs != NULL && !staged;
    } else if (stria_layout_kind_parse(layout, &k) == STRIA_OK && k != STRIA_LAYOUT_AUTO &&
               k < STRIA__SIM_KINDS)
        o->layout_on[k] = true;
    else
        return stria_bench_usage_error(
            "simulate", "--layout '%s': expected striped, contiguous, zigzag, packed or all",
            layout);
    if (o->layout_on[STRIA_LAYOUT_PACKED] && staged)
        return stria_bench_usage_error("simulate", "--layout packed runs on host memory only "
                                                   "(the engine stages no packed pass): "
                                                   "--staging 0");
    o->do_fwd = strcmp(pass, "fwd") == 0 || strcmp(pass, "both") == 0;
    o->do_bwd = strcmp(pass, "bwd") == 0 || strcmp(pass, "both") == 0;
    if (!o->do_fwd && !o->do_bwd)
        return stria_bench_usage_error("simulate", "--pass '%s': expected fwd, bwd or both", pass);
    int rc = stria_bench_masks("simulate", o->shape.call.causal, docs, win, &o->masks);
    if (rc >= 0)
        return rc;
    if (o->calibrate == (o->tflops > 0))
        return stria_bench_usage_error("simulate",
                                       "give either --calibrate (measure this machine) or "
                                       "--device-tflops (a device's rate)");
    if (o->calibrate && stria_cli_given(cli, "tile"))
        return stria_bench_usage_error("simulate", "--tile is for --device-tflops (calibrated "
                                                   "costs are per unit of the kernels' own "
                                                   "tiles)");
    if (o->cal_each && !o->calibrate)
        return stria_bench_usage_error("simulate", "--calibrate-each needs --calibrate");
    if (o->measure && !o->calibrate)
        return stria_bench_usage_error("simulate", "--measure compares with this machine: it "
                                                   "needs --calibrate");
    for (size_t i = 0; o->measure && i < o->ranks.n; i++)
        if (o->ranks.v[i] > 64)
            return stria_bench_usage_error("simulate", "--measure runs the ring in process: "
                                                       "--ranks up to 64");
    if (stria_cli_given(cli, "seq-per-rank") && stria_cli_given(cli, "seq"))
        return stria_bench_usage_error("simulate", "give --seq or --seq-per-rank, not both");
    if (o->per_rank > 0)
        o->seqs.n = 1; /* one length per ring, made of the ring's size */
    if (o->timeline != NULL && (o->ranks.n != 1 || o->seqs.n != 1))
        return stria_bench_usage_error("simulate", "--timeline draws one ring: give one --ranks "
                                                   "and one --seq");
    if (!o->calibrate)
        stria__sim_device_costs(o);
    return -1;
}

/* What the options write before they are checked. */
typedef struct {
    const char *layout, *pass, *docs;
    stria_int_list_t win;
    int64_t batch, reps, cal_reps, dph, tile[2];
    double intra, inter, lat_us, staging;
} stria__sim_args_t;

#define STRIA__SIM_MAX_OPTS 48

/* The job's options (shape, layouts, what to print) at t; returns their
 * number. */
static size_t stria__sim_options_job(stria__sim_opts_t *o, stria__sim_args_t *a, stria_option_t *t)
{
    const stria_option_t own[] = {
        STRIA_OPTION("ranks", INTS, &o->ranks, "N[,N...]", "ring sizes", .dflt = "64,256,1024",
                     .min = 1, .max = 65536, .max_items = STRIA__SIM_MAX_LIST),
        STRIA_OPTION("seq", INTS, &o->seqs, "S[,S...]", "global sequence lengths",
                     .dflt = "1048576", .min = 1, .max = (double)((int64_t)1 << 36),
                     .max_items = STRIA__SIM_MAX_LIST),
        STRIA_OPTION("seq-per-rank", INT, &o->per_rank, "L",
                     "instead of --seq: L tokens per rank, a sequence of L x N for each ring "
                     "(weak scaling)",
                     .min = 1, .max = (double)((int64_t)1 << 30)),
        STRIA_OPTION("layout", STRING, &a->layout, "L",
                     "striped | contiguous | zigzag | packed | all (packed with --documents; "
                     "contiguous, the baseline, is always simulated)",
                     .dflt = "all"),
        STRIA_OPTION("pass", STRING, &a->pass, "P", "fwd | bwd | both", .dflt = "both"),
        STRIA_OPTION("batch", INT, &a->batch, "B", "batch size", .dflt = "1", .min = 1,
                     .max = 1024),
        STRIA_OPTION("causal", FLAG, &o->shape.call.causal, NULL, "causal mask (the default)"),
        STRIA_OPTION("no-causal", UNFLAG, &o->shape.call.causal, NULL, "no mask"),
        STRIA_OPTION("documents", STRING, &a->docs, "lognormal:MEDIAN[:SIGMA]",
                     "packed documents with log-normal lengths (as stria-bench ring)"),
        STRIA_OPTION("window", INTS, &a->win, "LEFT[,RIGHT]", "sliding window", .min = -1,
                     .max = (double)((int64_t)1 << 40), .max_items = 2),
        STRIA_OPTION("measure", FLAG, &o->measure, NULL,
                     "also run every pass in process and print the measured critical path"),
        STRIA_OPTION("reps", INT, &a->reps, "R",
                     "--measure: runs per pass (the fastest of every (rank, step))", .dflt = "3",
                     .min = 1, .max = 64),
        STRIA_OPTION("timeline", STRING, &o->timeline, "FILE.svg",
                     "draw the predicted passes (one --ranks, one --seq)"),
        STRIA_OPTION("json", FLAG, &o->json, NULL,
                     "one JSON object per (layout, ranks, seq, pass) per line"),
        STRIA_OPTION("head-groups", INTS, &o->groups, "G[,G...]",
                     "also the ring as G head groups (rings of N / G ranks over heads / G and "
                     "kv_heads / G); each G must divide --kv-heads (a G that does not divide N "
                     "is skipped for that N)",
                     .dflt = "1", .min = 1, .max = 65536, .max_items = STRIA__SIM_MAX_LIST),
        STRIA_OPTION("count-pairs", INT, &o->exact_pairs, "P",
                     "with documents: tile pairs classified per table at most; past it a stride "
                     "of steps is counted and the others take the nearest counted step's work",
                     .dflt = "536870912", .min = 1, .max = (double)((int64_t)1 << 50)),
    };
    memcpy(t, own, sizeof(own));
    return sizeof(own) / sizeof(own[0]);
}

/* The costs' options (calibration, device rate) at t; returns their number. */
static size_t stria__sim_options_model(stria__sim_opts_t *o, stria__sim_args_t *a,
                                       stria_option_t *t)
{
    const stria_option_t own[] = {
        STRIA_OPTION("calibrate", FLAG, &o->calibrate, NULL,
                     "costs measured on this machine: rings of 3 ranks of every layout, shards of "
                     "--calibrate-at tokens, the kernels' costs fitted per unit of work"),
        STRIA_OPTION(
            "calibrate-at", INTS, &o->cal_at, "L[,L...]",
            "shard lengths of the calibration rings: costs are fitted at each (with rings of half "
            "that length beside), and a ring uses those of the length nearest its shards",
            .dflt = "2048", .min = 64, .max = 1 << 20, .max_items = 4),
        STRIA_OPTION(
            "calibrate-each", FLAG, &o->cal_each, NULL,
            "calibrate again for every ring, right before it, at its own shard length only "
            "(with --calibrate; on a shared machine whose speed drifts, the calibration "
            "and the check then see the same machine)"),
        STRIA_OPTION("calibrate-reps", INT, &a->cal_reps, "R",
                     "runs per calibration ring (the fastest of every (rank, step))", .dflt = "3",
                     .min = 1, .max = 64),
        STRIA_OPTION("device-tflops", DOUBLE, &o->tflops, "F",
                     "costs from a device's forward attention rate (TFLOP/s achieved on full "
                     "tiles) instead of --calibrate",
                     .min = 0, .max = 1e6, .flags = STRIA_OPT_ABOVE_MIN),
        STRIA_OPTION("compute-scale", DOUBLE, &o->compute_scale, "X",
                     "every compute cost times X, e.g. the ranks per core where the workers "
                     "share a machine's cores (4 workers on 2 cores: 2)",
                     .dflt = "1", .min = 0, .max = 1e6, .flags = STRIA_OPT_ABOVE_MIN),
        STRIA_OPTION("bwd-ratio", DOUBLE, &o->bwd_ratio, "X",
                     "device: backward time over forward time for the same tiles", .dflt = "2.5",
                     .min = 0.1, .max = 100),
        STRIA_OPTION("tile", CUSTOM, a->tile, "QxK",
                     "device: tile sizes of its kernels (partial tiles computed whole)",
                     .dflt = "128x64", .parse = stria__sim_tile),
        STRIA_OPTION("call-us", DOUBLE, &o->call_us, "US", "device: fixed cost of a computed step",
                     .dflt = "10", .min = 0, .max = 1e6),
        STRIA_OPTION("host-add", DOUBLE, &o->host_add_gbs, "GB/s",
                     "device: the host's memory bandwidth for the backward's dK/dV sums",
                     .dflt = "10", .min = 0, .max = 1e6, .flags = STRIA_OPT_ABOVE_MIN),
    };
    memcpy(t, own, sizeof(own));
    return sizeof(own) / sizeof(own[0]);
}

/* The ring's links and the end-to-end model's options at t; returns their
 * number. */
static size_t stria__sim_options_links(stria__sim_opts_t *o, stria__sim_args_t *a,
                                       stria_option_t *t)
{
    const stria_option_t own[] = {
        STRIA_OPTION("devices-per-host", INT, &a->dph, "D",
                     "ranks per host (the ring goes host by host)", .dflt = "8", .min = 1,
                     .max = 65536),
        STRIA_OPTION("intra-bw", DOUBLE, &a->intra, "GB/s",
                     "bandwidth of a ring link inside a host", .dflt = "100", .min = 0, .max = 1e6,
                     .flags = STRIA_OPT_ABOVE_MIN),
        STRIA_OPTION("inter-bw", DOUBLE, &a->inter, "GB/s",
                     "bandwidth of a ring link between hosts", .dflt = "25", .min = 0, .max = 1e6,
                     .flags = STRIA_OPT_ABOVE_MIN),
        STRIA_OPTION("latency-us", DOUBLE, &a->lat_us, "US", "latency of a message", .dflt = "10",
                     .min = 0, .max = 1e6),
        STRIA_OPTION("staging", DOUBLE, &a->staging, "GB/s",
                     "device <-> host copy bandwidth of a staged device (a GPU); 0: host memory",
                     .dflt = "0", .min = 0, .max = 1e6),
        STRIA_OPTION(
            "layers", INT, &o->layers, "L",
            "end to end: a training step of a model of L attention layers (forward, backward, and "
            "with --remat the forward again) plus its other work, 6 x --params x tokens FLOPs (8 x "
            "with --remat) over every device at --matmul-tflops; 0: attention only",
            .dflt = "0", .min = 0, .max = 4096),
        STRIA_OPTION("params", DOUBLE, &o->params_b, "B",
                     "end to end: the model's parameters, billions", .dflt = "1", .min = 0,
                     .max = 1e6),
        STRIA_OPTION("matmul-tflops", DOUBLE, &o->matmul_tflops, "F",
                     "end to end: the device's achieved rate on the model's other matrix products",
                     .dflt = "150", .min = 0, .max = 1e6, .flags = STRIA_OPT_ABOVE_MIN),
        STRIA_OPTION("tp", INT, &o->tp, "T",
                     "end to end: tensor parallelism beside the ring: each rank holds heads / T "
                     "heads, and the step runs on ranks x T devices",
                     .dflt = "1", .min = 1, .max = 1024),
        STRIA_OPTION("remat", FLAG, &o->remat, NULL,
                     "end to end: the backward recomputes the forward (activation checkpointing)"),
    };
    memcpy(t, own, sizeof(own));
    return sizeof(own) / sizeof(own[0]);
}

static int stria__sim_parse(int argc, char **argv, stria__sim_opts_t *o)
{
    stria__sim_args_t a = {.batch = 1,
                           .reps = 3,
                           .cal_reps = 3,
                           .dph = 8,
                           .tile = {128, 64},
                           .intra = 100,
                           .inter = 25,
                           .lat_us = 10};
    stria_option_t opts[STRIA__SIM_MAX_OPTS + STRIA_BENCH_SHAPE_OPTS + 1] = {{0}};
    size_t n = stria__sim_options_job(o, &a, opts);
    n += stria__sim_options_model(o, &a, opts + n);
    n += stria__sim_options_links(o, &a, opts + n);
    stria_bench_shape_t shape = {0};
    stria_bench_shape_options(opts + n, &shape, 4096);
    const stria_command_t cmd = {.name = "simulate",
                                 .description = stria__sim_description,
                                 .epilog = stria__sim_epilog,
                                 .options = opts};
    stria_cli_t cli;

    o->shape.call.causal = true;
    int rc = stria_bench_parse(&cmd, argc, argv, &cli);
    if (rc < 0 && stria_bench_shape_check("simulate", &shape) >= 0)
        rc = 2;
    if (rc < 0) {
        o->shape.call.batch = a.batch;
        o->shape.heads = shape.heads;
        o->shape.kv_heads = shape.kv_heads;
        o->shape.head_dim = shape.head_dim;
        o->shape.dtype = shape.dtype;
        o->reps = (int)a.reps;
        o->cal_reps = (int)a.cal_reps;
        o->tile_q = a.tile[0];
        o->tile_k = a.tile[1];
        o->link = (stria_sim_link_t){(int)a.dph, a.intra * 1e9, a.inter * 1e9, a.lat_us * 1e-6,
                                     a.staging * 1e9};
        rc = stria__sim_check(o, &cli, a.layout, a.pass, a.docs, &a.win);
        if (rc < 0 && (o->shape.heads % o->tp != 0 || o->shape.kv_heads % o->tp != 0))
            rc = stria_bench_usage_error("simulate", "--tp %lld must divide --heads and --kv-heads",
                                         (long long)o->tp);
        if (rc < 0 && o->layers > 0 && !(o->do_fwd && o->do_bwd))
            rc = stria_bench_usage_error("simulate", "--layers needs --pass both");
        o->shape.heads /= o->tp; /* what one rank of the ring holds */
        o->shape.kv_heads /= o->tp;
        for (size_t i = 0; rc < 0 && i < o->groups.n; i++)
            if (o->shape.kv_heads % o->groups.v[i] != 0)
                rc = stria_bench_usage_error("simulate",
                                             "--head-groups %lld must divide the K/V heads a "
                                             "ring holds (%lld)",
                                             (long long)o->groups.v[i],
                                             (long long)o->shape.kv_heads);
    }
    /* the lists live in cli: copied out before it is freed */
    stria_int_list_t *all[] = {&o->ranks, &o->seqs, &o->cal_at, &o->groups};
    size_t n_all = 0;
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        n_all += all[i]->n;
    int64_t *lists = rc < 0 ? malloc(n_all * sizeof(int64_t)) : NULL;
    if (rc < 0 && lists == NULL)
        rc = 1;
    for (size_t i = 0, at = 0; rc < 0 && i < sizeof(all) / sizeof(all[0]); i++) {
        memcpy(lists + at, all[i]->v, all[i]->n * sizeof(int64_t));
        all[i]->v = lists + at; /* ranks first: freed with it */
        at += all[i]->n;
    }
    stria_cli_free(&cli);
    return rc;
}

/* ---- simulation and reports ------------------------------------------------ */

static const stria_layout_kind_t stria__sim_order[STRIA__SIM_NL] = {
    STRIA_LAYOUT_CONTIGUOUS, STRIA_LAYOUT_STRIPED, STRIA_LAYOUT_ZIGZAG, STRIA_LAYOUT_PACKED};

static bool stria__sim_on(const stria__sim_opts_t *o, stria_layout_kind_t k)
{
    return o->layout_on[k] || k == STRIA_LAYOUT_CONTIGUOUS;
}

/* One (N, S): its shape, tables and measured inputs. */
typedef struct {
    stria_ring_shape_t shape;
    int n;
    const stria_sim_costs_t *costs;
    stria_sim_costs_t own;    /* --calibrate-each */
    stria_sim_costs_t scaled; /* --compute-scale */
    char source[240];
    stria_sim_table_t t[STRIA__SIM_KINDS];
    bool have[STRIA__SIM_KINDS];
    double table_s, table_cpu_s;
    stria_sim_inputs_t in;
    bool have_in;
} stria__sim_case_t;

typedef struct {
    stria_sim_result_t r;
    double measured_s;           /* critical path measured in process (< 0: none) */
    double measured_total_s;     /* all ranks' compute, measured */
    stria_sim_counted_t counted; /* the measured pass's steps and bytes */
} stria__sim_row_t;

static void stria__sim_case_free(stria__sim_case_t *c)
{
    for (int k = 0; k < STRIA__SIM_KINDS; k++)
        if (c->have[k])
            stria_sim_table_free(&c->t[k]);
    if (c->have_in)
        stria_sim_inputs_free(&c->in);
    free((void *)c->shape.call.cu_seqlens);
    memset(c, 0, sizeof(*c));
}

static stria_status_t stria__sim_case(const stria__sim_opts_t *o, int n, int64_t seq,
                                      stria__sim_case_t *c)
{
    stria_status_t st = STRIA_OK;
    memset(c, 0, sizeof(*c));
    c->n = n;
    c->shape = o->shape;
    c->shape.call.seq_len = seq;
    c->shape.call.has_window = o->masks.has_window;
    c->shape.call.window_left = o->masks.window_left;
    c->shape.call.window_right = o->masks.window_right;
    c->costs = &o->costs;
    snprintf(c->source, sizeof(c->source), "%s", o->source);
    if (o->cal_each) { /* calibrated now, at the ring's own shard length */
        const int64_t L = (seq + n - 1) / n;
        double ef = 0, eb = 0;
        stria_ring_shape_t cal = o->shape;
        cal.heads = o->shape.heads / o->shape.kv_heads;
        cal.kv_heads = 1;
        double t0 = stria_time_now();
        stria_status_t cst =
            stria_sim_calibrate(&cal, L, false, o->masks.doc_median, o->masks.doc_sigma,
                                o->cal_reps, &c->own, &ef, &eb);
        if (cst != STRIA_OK)
            return cst;
        c->costs = &c->own;
        snprintf(c->source, sizeof(c->source),
                 "calibrated just before, on shards of %lld tokens (%s kernels, %.0f s; "
                 "fit error per step %.1f%% fwd, %.1f%% bwd)",
                 (long long)L, stria_kernels_variant(), stria_time_now() - t0, 100 * ef, 100 * eb);
    } else if (o->calibrate) { /* the calibration nearest the shards, in log terms */
        const double L = (double)((seq + n - 1) / n);
        size_t best = 0;
        for (size_t i = 1; i < o->cal_at.n; i++)
            if (fabs(log(L / (double)o->cal_at.v[i])) < fabs(log(L / (double)o->cal_at.v[best])))
                best = i;
        c->costs = &o->cal[best];
        snprintf(c->source, sizeof(c->source),
                 "calibrated here on shards of %lld tokens (%s kernels; fit error per step %.1f%% "
                 "fwd, %.1f%% bwd)",
                 (long long)o->cal_at.v[best], stria_kernels_variant(), 100 * o->cal_err[best][0],
                 100 * o->cal_err[best][1]);
    }
    if (o->compute_scale != 1.0) {
        c->scaled = *c->costs;
        for (int i = 0; i < STRIA_SIM_NCOEF; i++) {
            c->scaled.fwd[i] *= o->compute_scale;
            c->scaled.bwd[i] *= o->compute_scale;
        }
        c->costs = &c->scaled;
        const size_t at = strlen(c->source);
        snprintf(c->source + at, sizeof(c->source) - at, "; compute x %.3g", o->compute_scale);
    }
    if (o->masks.doc_median > 0 &&
        (c->shape.call.cu_seqlens = stria_bench_documents(
             o->masks.doc_median, o->masks.doc_sigma, seq, &c->shape.call.n_cu_seqlens)) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate the documents");
    double t0 = stria_time_now(), c0 = stria_bench_process_cpu();
    for (int i = 0; i < STRIA__SIM_NL && st == STRIA_OK; i++) {
        stria_layout_kind_t k = stria__sim_order[i];
        if (!stria__sim_on(o, k))
            continue;
        st = stria_sim_table_bounded(&c->shape, k, n, c->costs->tile_q, c->costs->tile_k,
                                     o->exact_pairs, &c->t[k]);
        c->have[k] = st == STRIA_OK;
    }
    c->table_s = stria_time_now() - t0;
    c->table_cpu_s = stria_bench_process_cpu() - c0;
    if (st == STRIA_OK && o->measure && (st = stria_sim_inputs(&c->shape, &c->in)) == STRIA_OK)
        c->have_in = true;
    return st;
}

static void stria__sim_shape_text(const stria__sim_case_t *c, char *out, size_t cap)
{
    const stria_ring_shape_t *s = &c->shape;
    int at = snprintf(out, cap, "N=%d S=%lld B=%lld H=%lld/%lld D=%lld %s %s", c->n,
                      (long long)s->call.seq_len, (long long)s->call.batch, (long long)s->heads,
                      (long long)s->kv_heads, (long long)s->head_dim, stria_dtype_name(s->dtype),
                      s->call.causal ? "causal" : "non-causal");
    if (s->call.n_cu_seqlens > 0 && at > 0 && (size_t)at < cap)
        at += snprintf(out + at, cap - (size_t)at, ", %zu documents", s->call.n_cu_seqlens - 1);
    if (s->call.has_window && at > 0 && (size_t)at < cap)
        snprintf(out + at, cap - (size_t)at, ", window (%lld, %lld)",
                 (long long)s->call.window_left, (long long)s->call.window_right);
}

/* The table's plan and how much of its work was counted, as JSON fields. */
static void stria__sim_json_counts(const stria__sim_case_t *c, stria_layout_kind_t k)
{
    const stria_sim_table_t *t = &c->t[k];
    int64_t elems = 0; /* every computed cell's, counted or taken from the nearest counted */
    for (int64_t i = 0; i < (int64_t)t->n * t->n; i++)
        elems += t->cells[i].full_elems + t->cells[i].partial_elems;
    printf(",\"computed_elems\":%lld,\"plan_s\":%.4f,\"count_stride\":%d,\"cells_counted\":%lld",
           (long long)elems, t->plan_s, t->count_stride, (long long)t->cells_counted);
    if (k == STRIA_LAYOUT_PACKED)
        printf(",\"documents\":%zu,\"documents_kept\":%zu,\"documents_spread\":%zu",
               c->shape.call.n_cu_seqlens > 0 ? c->shape.call.n_cu_seqlens - 1 : 0, t->docs_kept,
               t->docs_spread);
}

/* The same in words, under the table: the document plan, and the work
 * counts where they were not all classified. */
static void stria__sim_text_counts(const stria__sim_case_t *c)
{
    for (int i = 0; i < STRIA__SIM_NL; i++) {
        const stria_layout_kind_t k = stria__sim_order[i];
        const stria_sim_table_t *t = &c->t[k];
        if (!c->have[k])
            continue;
        if (k == STRIA_LAYOUT_PACKED)
            printf("  packed: %zu documents kept whole, %zu spread; the engine's plan made in "
                   "%.3f s\n",
                   t->docs_kept, t->docs_spread, t->plan_s);
        if (t->count_stride > 1)
            printf("  %s: work classified for %lld (rank, step)s, every %d-th step (the others "
                   "from the nearest counted step)\n",
                   stria_layout_kind_name(k), (long long)t->cells_counted, t->count_stride);
    }
}

static void stria__sim_print(const stria__sim_opts_t *o, const stria__sim_case_t *c, bool bwd,
                             const stria__sim_row_t *rows, double sim_s, double sim_cpu_s)
{
    const stria__sim_row_t *base = &rows[STRIA_LAYOUT_CONTIGUOUS];
    const char *pass = bwd ? "bwd" : "fwd";
    char shape[256];
    stria__sim_shape_text(c, shape, sizeof(shape));
    if (!o->json) {
        printf("stria-bench simulate: %s, %s pass\n  costs: %s\n", shape, pass, c->source);
        printf("  links: %d devices per host, %.4g GB/s inside, %.4g GB/s between hosts, %.1f us"
               "; staging %s\n",
               o->link.devices_per_host, o->link.intra_Bps / 1e9, o->link.inter_Bps / 1e9,
               o->link.latency_s * 1e6, o->link.staging_Bps > 0 ? "yes" : "none (host memory)");
        printf("  %-11s %12s %12s %8s %6s %6s %12s%s\n", "layout", "pass (s)", "critical (s)",
               "speedup", "busy", "steps", "MB sent/rank",
               o->measure ? "  measured crit (s)  pred/meas  meas x  total p/m" : "");
    }
    for (int i = 0; i < STRIA__SIM_NL; i++) {
        stria_layout_kind_t k = stria__sim_order[i];
        const stria__sim_row_t *r = &rows[k];
        if (!c->have[k])
            continue;
        const double x = base->r.pass_s / r->r.pass_s;
        const double busy = r->r.compute_s / (c->n * r->r.pass_s);
        const double mb = (double)r->r.bytes_sent / 1e6;
        if (o->json) {
            printf("{\"layout\":\"%s\",\"ranks\":%d,\"seq\":%lld,\"pass\":\"%s\",\"heads\":%lld,"
                   "\"kv_heads\":%lld,\"head_dim\":%lld,\"dtype\":\"%s\",\"causal\":%s,"
                   "\"predicted_pass_s\":%.6g,\"predicted_critical_s\":%.6g,"
                   "\"speedup_vs_contiguous\":%.4f,\"busy\":%.4f,\"steps\":%d,"
                   "\"bytes_sent_per_rank\":%llu,\"full_tiles\":%lld,\"partial_tiles\":%lld,"
                   "\"subblocks\":%lld,\"block_pair_classes\":%d,\"simulate_s\":%.3f,"
                   "\"simulate_cpu_s\":%.3f",
                   stria_layout_kind_name(k), c->n, (long long)c->shape.call.seq_len, pass,
                   (long long)c->shape.heads, (long long)c->shape.kv_heads,
                   (long long)c->shape.head_dim, stria_dtype_name(c->shape.dtype),
                   c->shape.call.causal ? "true" : "false", r->r.pass_s, r->r.critical_s, x, busy,
                   r->r.steps, (unsigned long long)r->r.bytes_sent, (long long)c->t[k].full_tiles,
                   (long long)c->t[k].partial_tiles, (long long)c->t[k].subblocks,
                   c->t[k].memo_keys, sim_s, sim_cpu_s);
            stria__sim_json_counts(c, k);
            if (r->measured_s >= 0)
                printf(",\"measured_critical_s\":%.6g,\"predicted_over_measured\":%.4f,"
                       "\"measured_speedup_vs_contiguous\":%.4f,\"predicted_total_s\":%.6g,"
                       "\"measured_total_s\":%.6g,\"total_predicted_over_measured\":%.4f,"
                       "\"measured_steps\":%d,\"measured_bytes_sent_per_rank\":%llu,"
                       "\"cells_differing_from_the_pass\":%d",
                       r->measured_s, r->r.critical_s / r->measured_s,
                       base->measured_s / r->measured_s, r->r.compute_s, r->measured_total_s,
                       r->r.compute_s / r->measured_total_s, r->counted.steps,
                       (unsigned long long)r->counted.bytes_sent, r->counted.cells_differ);
            printf("}\n");
            continue;
        }
        printf("  %-11s %12.6g %12.6g %8.3f %5.0f%% %6d %12.2f", stria_layout_kind_name(k),
               r->r.pass_s, r->r.critical_s, x, 100.0 * busy, r->r.steps, mb);
        if (r->measured_s >= 0)
            printf("  %17.4f  %9.3f  %6.3f  %9.3f", r->measured_s, r->r.critical_s / r->measured_s,
                   base->measured_s / r->measured_s, r->r.compute_s / r->measured_total_s);
        if (r->measured_s >= 0 &&
            (r->counted.steps != r->r.steps || r->counted.bytes_sent != r->r.bytes_sent ||
             r->counted.cells_differ != 0))
            printf("  the pass ran %d steps, sent %.2f MB, %d (rank, step)s differ",
                   r->counted.steps, (double)r->counted.bytes_sent / 1e6, r->counted.cells_differ);
        printf("\n");
    }
    if (!o->json) {
        printf("  simulated in %.2f s, %.2f s of CPU (block-pair classes classified:", sim_s,
               sim_cpu_s);
        for (int i = 0; i < STRIA__SIM_NL; i++)
            if (c->have[stria__sim_order[i]])
                printf(" %s %d", stria_layout_kind_name(stria__sim_order[i]),
                       c->t[stria__sim_order[i]].memo_keys);
        printf(")\n");
        stria__sim_text_counts(c);
    }
    fflush(stdout);
}

/* ---- timeline ---------------------------------------------------------------- */

typedef struct {
    stria_timeline_t *tl;
    int panel;
    stria_status_t st;
} stria__sim_tl_t;

static void stria__sim_span(void *ctx, int rank, int kind, double begin, double end)
{
    stria__sim_tl_t *x = ctx;
    if (x->st == STRIA_OK)
        x->st = stria_timeline_span(x->tl, x->panel, rank, (stria_timeline_kind_t)kind, begin, end);
}

static stria_status_t stria__sim_timeline(const stria__sim_opts_t *o, const stria__sim_case_t *c)
{
    char title[300], sub[400], name[64], note[96];
    stria__sim_tl_t x = {0};
    stria__sim_shape_text(c, title, sizeof(title));
    snprintf(sub, sizeof(sub), "predicted by stria-bench simulate: %s; links %.0f/%.0f GB/s",
             c->source, o->link.intra_Bps / 1e9, o->link.inter_Bps / 1e9);
    x.st = stria_timeline_create(title, sub, &x.tl);
    for (int b = 0; b < 2 && x.st == STRIA_OK; b++) {
        if ((b == 0 && !o->do_fwd) || (b == 1 && !o->do_bwd))
            continue;
        for (int i = 0; i < STRIA__SIM_NL && x.st == STRIA_OK; i++) {
            stria_layout_kind_t k = stria__sim_order[i];
            stria_sim_result_t r;
            if (!c->have[k])
                continue;
            /* the pass once for its time (the note), once for its spans */
            if ((x.st = stria_sim_pass(&c->t[k], c->costs, &o->link, b == 1, &r, NULL, NULL)) !=
                STRIA_OK)
                break;
            snprintf(name, sizeof(name), "%s, %s", stria_layout_kind_name(k),
                     b ? "backward" : "forward");
            snprintf(note, sizeof(note), "%.4g s predicted, ranks busy %.0f%% of it", r.pass_s,
                     100.0 * r.compute_s / (c->n * r.pass_s));
            if ((x.st = stria_timeline_panel(x.tl, name, note, c->n, &x.panel)) != STRIA_OK)
                break;
            stria_timeline_panel_end(x.tl, x.panel, r.pass_s);
            stria_status_t st =
                stria_sim_pass(&c->t[k], c->costs, &o->link, b == 1, &r, stria__sim_span, &x);
            if (x.st == STRIA_OK)
                x.st = st;
        }
    }
    if (x.st == STRIA_OK)
        x.st = stria_timeline_write_svg(x.tl, o->timeline);
    if (x.st == STRIA_OK && !o->json)
        printf("timeline: %s\n", o->timeline);
    stria_timeline_destroy(x.tl);
    return x.st;
}

/* ---- the command -------------------------------------------------------------- */

/* End to end: per layout, a training step of the model of --layers and
 * --params, its attention from the simulated passes and the rest as dense
 * matrix products spread over every device. */
static void stria__sim_e2e(const stria__sim_opts_t *o, const stria__sim_case_t *c,
                           const stria__sim_row_t f[STRIA__SIM_KINDS],
                           const stria__sim_row_t b[STRIA__SIM_KINDS])
{
    const double devices = (double)c->n * (double)o->tp, tokens = (double)c->shape.call.seq_len;
    const double other = (o->remat ? 8.0 : 6.0) * o->params_b * 1e9 * tokens * c->shape.call.batch /
                         (devices * o->matmul_tflops * 1e12);
    const double base =
        other + (double)o->layers * ((o->remat ? 2 : 1) * f[STRIA_LAYOUT_CONTIGUOUS].r.pass_s +
                                     b[STRIA_LAYOUT_CONTIGUOUS].r.pass_s);
    if (!o->json)
        printf("  end to end (%lld layers, %.3g B params, %s, other work %.4g s per step on %.0f "
               "devices at %.0f TFLOP/s):\n",
               (long long)o->layers, o->params_b, o->remat ? "forward recomputed" : "no remat",
               other, devices, o->matmul_tflops);
    for (int i = 0; i < STRIA__SIM_NL; i++) {
        stria_layout_kind_t k = stria__sim_order[i];
        if (!c->have[k])
            continue;
        double attn = (double)o->layers * ((o->remat ? 2 : 1) * f[k].r.pass_s + b[k].r.pass_s);
        double step = other + attn;
        if (o->json)
            printf("{\"layout\":\"%s\",\"ranks\":%d,\"seq\":%lld,\"end_to_end\":true,"
                   "\"step_s\":%.6g,\"attention_s\":%.6g,\"other_s\":%.6g,"
                   "\"speedup_vs_contiguous\":%.4f}\n",
                   stria_layout_kind_name(k), c->n, (long long)c->shape.call.seq_len, step, attn,
                   other, base / step);
        else
            printf("  %-11s step %10.4g s, attention %5.1f%%, speedup %6.3f\n",
                   stria_layout_kind_name(k), step, 100 * attn / step, base / step);
    }
}

/* ---- head groups --------------------------------------------------------------- */

/* One head-group count's passes per layout: [pass][layout]. */
typedef struct {
    int groups;
    stria_sim_result_t r[2][STRIA__SIM_KINDS];
} stria__sim_grouped_t;

static bool stria__sim_groups_on(const stria__sim_opts_t *o)
{
    return o->groups.n > 1 || (o->groups.n == 1 && o->groups.v[0] != 1);
}

/* The passes of N ranks as G head groups: for G = 1 the 1-D table itself
 * through the groups' model; else a case of G rings of R = N / G ranks over
 * heads / G and kv_heads / G (the engine's plan of that shape; calibrated
 * costs of its own shard length). */
static stria_status_t stria__sim_grouped(const stria__sim_opts_t *o, const stria__sim_case_t *c,
                                         int G, stria__sim_grouped_t *out)
{
    stria__sim_opts_t og = *o;
    stria__sim_case_t cg;
    const stria__sim_case_t *use = c;
    stria_status_t st = STRIA_OK;
    memset(out, 0, sizeof(*out));
    out->groups = G;
    if (G > 1) {
        og.shape.heads /= G;
        og.shape.kv_heads /= G;
        og.measure = false;
        if ((st = stria__sim_case(&og, c->n / G, c->shape.call.seq_len, &cg)) != STRIA_OK) {
            stria__sim_case_free(&cg);
            return st;
        }
        use = &cg;
    }
    for (int b = 0; b < 2 && st == STRIA_OK; b++)
        for (int k = 0; k < STRIA__SIM_KINDS && st == STRIA_OK; k++)
            if (use->have[k] && ((b == 0 && o->do_fwd) || (b == 1 && o->do_bwd)))
                st = stria_sim_groups(&use->t[k], use->costs, &o->link, G, b == 1, &out->r[b][k]);
    if (G > 1)
        stria__sim_case_free(&cg);
    return st;
}

/* A part of a grouped rank's bytes over the 1-D rank's (0 where it has none). */
static double stria__sim_ratio(uint64_t grouped, uint64_t one_d)
{
    return one_d > 0 ? (double)grouped / (double)one_d : 0.0;
}

static void stria__sim_groups_json(const stria__sim_case_t *c, bool bwd, stria_layout_kind_t k,
                                   const stria_sim_result_t *one_d, const stria__sim_grouped_t *g)
{
    const stria_sim_result_t *r = &g->r[bwd][k];
    const int R = c->n / g->groups;
    printf("{\"layout\":\"%s\",\"ranks\":%d,\"head_groups\":%d,\"ring_ranks\":%d,\"seq\":%lld,"
           "\"pass\":\"%s\",\"heads\":%lld,\"kv_heads\":%lld,\"head_dim\":%lld,"
           "\"dtype\":\"%s\",\"predicted_pass_s\":%.6g,\"predicted_critical_s\":%.6g,"
           "\"busy\":%.4f,\"speedup_vs_1d\":%.4f,\"steps\":%d,\"bytes_sent_per_rank\":%llu,"
           "\"kv_bytes_per_rank\":%llu,\"dkv_bytes_per_rank\":%llu,\"agree_bytes_per_rank\":%llu,"
           "\"kv_vs_1d\":%.6f,\"dkv_vs_1d\":%.6f,\"kv_expected\":%.6f,\"dkv_expected\":%.6f}\n",
           stria_layout_kind_name(k), c->n, g->groups, R, (long long)c->shape.call.seq_len,
           bwd ? "bwd" : "fwd", (long long)c->shape.heads, (long long)c->shape.kv_heads,
           (long long)c->shape.head_dim, stria_dtype_name(c->shape.dtype), r->pass_s, r->critical_s,
           r->compute_s / (c->n * r->pass_s), one_d->pass_s / r->pass_s, r->steps,
           (unsigned long long)r->bytes_sent, (unsigned long long)r->kv_sent,
           (unsigned long long)r->dkv_sent, (unsigned long long)r->agree_sent,
           stria__sim_ratio(r->kv_sent, one_d->kv_sent),
           stria__sim_ratio(r->dkv_sent, one_d->dkv_sent),
           c->n > 1 ? (double)(R - 1) / (c->n - 1) : 1.0, bwd ? (double)R / c->n : 0.0);
}

/* One pass's head-group block: per layout, per G. */
static void stria__sim_groups_print(const stria__sim_opts_t *o, const stria__sim_case_t *c,
                                    bool bwd, const stria__sim_row_t *one_d,
                                    const stria__sim_grouped_t *g, int n_g)
{
    if (!o->json) {
        printf("  head groups, %s: G rings of R = N/G ranks at once, each over heads/G and "
               "kv_heads/G, ring g on ring-order ranks g*R..g*R+R-1 (no link shared)\n",
               bwd ? "bwd" : "fwd");
        printf("  %-11s %5s %6s %12s %12s %8s %6s %12s %8s %11s %8s %6s\n", "layout", "G", "R",
               "pass (s)", "critical (s)", "x 1-D", "busy", "MB sent/rank", "K/V x", "(R-1)/(N-1)",
               "dK/dV x", "R/N");
    }
    for (int i = 0; i < STRIA__SIM_NL; i++) {
        const stria_layout_kind_t k = stria__sim_order[i];
        if (!c->have[k])
            continue;
        for (int j = 0; j < n_g; j++) {
            const stria_sim_result_t *r = &g[j].r[bwd][k], *b = &one_d[k].r;
            const int R = c->n / g[j].groups;
            if (o->json) {
                stria__sim_groups_json(c, bwd, k, b, &g[j]);
                continue;
            }
            printf("  %-11s %5d %6d %12.6g %12.6g %8.3f %5.0f%% %12.2f %8.4f %11.4f",
                   stria_layout_kind_name(k), g[j].groups, R, r->pass_s, r->critical_s,
                   b->pass_s / r->pass_s, 100.0 * r->compute_s / (c->n * r->pass_s),
                   (double)r->bytes_sent / 1e6, stria__sim_ratio(r->kv_sent, b->kv_sent),
                   c->n > 1 ? (double)(R - 1) / (c->n - 1) : 1.0);
            if (bwd)
                printf(" %8.4f %6.4f\n", stria__sim_ratio(r->dkv_sent, b->dkv_sent),
                       (double)R / c->n);
            else
                printf(" %8s %6s\n", "-", "-");
        }
    }
    fflush(stdout);
}

/* Every G of --head-groups that divides N, beside the 1-D ring's rows. */
static stria_status_t stria__sim_groups(const stria__sim_opts_t *o, const stria__sim_case_t *c,
                                        const stria__sim_row_t one_d[2][STRIA__SIM_KINDS])
{
    stria__sim_grouped_t g[STRIA__SIM_MAX_LIST];
    int n_g = 0;
    stria_status_t st = STRIA_OK;
    for (size_t i = 0; i < o->groups.n && st == STRIA_OK; i++) {
        const int G = (int)o->groups.v[i];
        if (c->n % G != 0) {
            if (!o->json)
                printf("  head groups: G = %d does not divide N = %d, skipped\n", G, c->n);
            continue;
        }
        st = stria__sim_grouped(o, c, G, &g[n_g++]);
    }
    for (int b = 0; b < 2 && st == STRIA_OK && n_g > 0; b++)
        if ((b == 0 && o->do_fwd) || (b == 1 && o->do_bwd))
            stria__sim_groups_print(o, c, b == 1, one_d[b], g, n_g);
    return st;
}

static stria_status_t stria__sim_one(const stria__sim_opts_t *o, int n, int64_t seq)
{
    stria__sim_case_t c;
    stria_status_t st = stria__sim_case(o, n, seq, &c);
    double *med = st == STRIA_OK && o->measure ? calloc((size_t)(n * n), sizeof(double)) : NULL;
    if (st == STRIA_OK && o->measure && med == NULL)
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    stria__sim_row_t all[2][STRIA__SIM_KINDS];
    memset(all, 0, sizeof(all));
    for (int b = 0; b < 2 && st == STRIA_OK; b++) {
        stria__sim_row_t *rows = all[b];
        if ((b == 0 && !o->do_fwd) || (b == 1 && !o->do_bwd))
            continue;
        double t0 = stria_time_now(), c0 = stria_bench_process_cpu();
        for (int k = 0; k < STRIA__SIM_KINDS && st == STRIA_OK; k++) {
            rows[k].measured_s = -1;
            if (c.have[k])
                st = stria_sim_pass(&c.t[k], c.costs, &o->link, b == 1, &rows[k].r, NULL, NULL);
        }
        double sim_s = stria_time_now() - t0 + c.table_s;
        double sim_cpu_s = stria_bench_process_cpu() - c0 + c.table_cpu_s;
        for (int k = 0; k < STRIA__SIM_KINDS && st == STRIA_OK && o->measure; k++) {
            if (!c.have[k])
                continue;
            st = stria_sim_measure(&c.shape, (stria_layout_kind_t)k, n, b == 1, o->reps, &c.in, med,
                                   &c.t[k], &rows[k].counted);
            if (st == STRIA_OK)
                rows[k].measured_s = stria_sim_critical(med, n, rows[k].r.steps);
            rows[k].measured_total_s = 0;
            for (int i = 0; st == STRIA_OK && i < n * n; i++)
                rows[k].measured_total_s += med[i];
        }
        if (st == STRIA_OK)
            stria__sim_print(o, &c, b == 1, rows, sim_s, sim_cpu_s);
    }
    if (st == STRIA_OK && stria__sim_groups_on(o))
        st = stria__sim_groups(o, &c, (const stria__sim_row_t(*)[STRIA__SIM_KINDS])all);
    if (st == STRIA_OK && o->layers > 0)
        stria__sim_e2e(o, &c, all[0], all[1]);
    if (st == STRIA_OK && o->timeline != NULL)
        st = stria__sim_timeline(o, &c);
    free(med);
    stria__sim_case_free(&c);
    return st;
}

static stria_status_t stria__sim_calibrate(stria__sim_opts_t *o)
{
    static const char *const names[STRIA_SIM_NCOEF] = {"full elem", "partial elem", "token",
                                                       "call",      "open token",   "dkv add",
                                                       "dq end",    "hole elem"};
    stria_ring_shape_t cal = o->shape;
    /* one K/V head and the query heads of one GQA group: costs are per head */
    cal.heads = o->shape.heads / o->shape.kv_heads;
    cal.kv_heads = 1;
    for (size_t i = 0; i < o->cal_at.n; i++) {
        double t0 = stria_time_now();
        stria_status_t st =
            stria_sim_calibrate(&cal, o->cal_at.v[i], true, o->masks.doc_median, o->masks.doc_sigma,
                                o->cal_reps, &o->cal[i], &o->cal_err[i][0], &o->cal_err[i][1]);
        if (st != STRIA_OK)
            return st;
        if (o->json)
            continue;
        printf("calibration on shards of %lld tokens (%.1f s; %s kernels; fit error per step "
               "%.1f%% fwd, %.1f%% bwd), seconds per unit:\n",
               (long long)o->cal_at.v[i], stria_time_now() - t0, stria_kernels_variant(),
               100 * o->cal_err[i][0], 100 * o->cal_err[i][1]);
        for (int k = 0; k < STRIA_SIM_NCOEF; k++)
            printf("  %-13s fwd %.4g  bwd %.4g\n", names[k], o->cal[i].fwd[k], o->cal[i].bwd[k]);
        fflush(stdout);
    }
    return STRIA_OK;
}

int stria_bench_simulate(int argc, char **argv)
{
    stria__sim_opts_t o;
    memset(&o, 0, sizeof(o));
    int rc = stria__sim_parse(argc, argv, &o);
    stria_status_t st = STRIA_OK;
    if (rc >= 0)
        return rc;
    if (o.calibrate && !o.cal_each)
        st = stria__sim_calibrate(&o);
    for (size_t si = 0; si < o.seqs.n && st == STRIA_OK; si++)
        for (size_t ni = 0; ni < o.ranks.n && st == STRIA_OK; ni++)
            st = stria__sim_one(&o, (int)o.ranks.v[ni],
                                o.per_rank > 0 ? o.per_rank * o.ranks.v[ni] : o.seqs.v[si]);
    free(o.ranks.v);
    return stria_cli_exit("stria-bench simulate", st);
}
