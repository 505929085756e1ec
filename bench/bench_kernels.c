/* stria-bench kernels: attention kernel throughput against this machine's own
 * peak for the dtype, measured in the same run.
 *
 * The peak (peak_kind) is that of the fastest product the core has for the
 * dtype: for fp32 (and fp16, converted to fp32) a loop of independent FMA
 * chains (512-bit for the avx512 and amx variants, 256-bit for avx2; the
 * portable variant is measured against the widest the CPU has, so its
 * fraction shows the distance to the machine's best); for bf16 the AMX tile
 * product (tdpbf16ps on four accumulator tiles) where the core has AMX,
 * else the bf16 dot product (vdpbf16ps chains) where it has AVX512-BF16,
 * else the FMA, whichever variant runs: a variant that leaves the tiles idle
 * is judged against them. The other peaks measured are printed beside it.
 * With T threads every thread runs the loop at once and the peak is their
 * sum. Each pass is also compared with the ceiling of the unit its products
 * run on (the variant's: tiles, dot product or FMA). Attention throughput
 * counts useful FLOPs only: forward 4 * Tq * Tk * D * H (half of it when
 * causal with equal blocks), backward 2.5 x forward; each figure is the
 * median of --reps timed runs after one warm-up run. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define STRIA__BENCH_X86 1
#endif

#include "bench.h"
#include "bench_util.h"
#ifdef STRIA_BENCH_CUDA
#include "bench_cuda.h"
#endif
#include "stria_common.h"
#include "stria_kernels.h"

/* Independent FMA chains of the peak loop: more than latency x pipes (4 x 2
 * on current cores), so the FMA units, not the dependencies, set the pace. */
#define STRIA__PEAK_CHAINS 12
#define STRIA__PEAK_TRIES  5
#define STRIA__STR2(x)     #x
#define STRIA__STR(x)      STRIA__STR2(x)

typedef struct {
    int64_t seq, head_dim, heads, kv_heads;
    int threads, reps;
    stria_dtype_t dtype;
    bool causal;
    bool json;
    const char *variant; /* NULL: the default choice; "all": every available one */
    const char *device;  /* "cpu" (default), "cuda" or "cuda:N" */
    bool dtype_set;
    int64_t gemm_n; /* --device cuda: side of the cuBLAS reference GEMM */
} stria__kb_opts_t;

static const char stria__kb_description[] =
    "Measures this machine's peak for the dtype's products (fp32 FMA; for bf16 the\n"
    "AMX tiles, the bf16 dot product or the FMA, the fastest the core has), then\n"
    "forward and backward attention throughput (one batch,\n"
    "Q/K/V of --seq tokens), and prints GFLOP/s and the fractions of the peak and\n"
    "of the ceiling the kernel's mix of products allows. Figures are medians of\n"
    "--reps runs.";

static const char stria__kb_epilog[] =
    "FLOPs counted: forward 4*S*S*D*H (2*S*S*D*H causal), backward 2.5x forward.\n"
    "The peak (peak_kind) is the fastest product the core has for the dtype (best\n"
    "of " STRIA__STR(STRIA__PEAK_TRIES) " tries, every thread busy): for bf16 the AMX tiles "
                                        "(tdpbf16ps), else\n"
                                        "the bf16 dot product (vdpbf16ps), else the fp32 FMA; "
                                        "for fp32 and fp16 the FMA.\n"
                                        "Beside the wall-clock figures, GFLOP/s per CPU-second "
                                        "(FLOPs over the CPU time\n"
                                        "all threads really ran, against the peak loop's own "
                                        "per-CPU-second rate) stay\n"
                                        "meaningful when other processes share the cores.";

static stria_status_t stria__kb_parse_device(const char *text, void *dst)
{
    if (strcmp(text, "cpu") != 0 && strcmp(text, "cuda") != 0 && strncmp(text, "cuda:", 5) != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "expected cpu, cuda or cuda:N");
    *(const char **)dst = text;
    return STRIA_OK;
}

/* Returns -1 to continue, else an exit code. */
static int stria__kb_parse(int argc, char **argv, stria__kb_opts_t *o)
{
    int64_t threads = 0, reps = 0;
    const stria_option_t own[] = {
        STRIA_OPTION("seq", INT, &o->seq, "S", "tokens per sequence", .dflt = "4096", .min = 1,
                     .max = 1 << 20),
        STRIA_OPTION("threads", INT, &threads, "T", "threads of the kernel pool", .dflt = "1",
                     .min = 1, .max = 1024),
        STRIA_OPTION("causal", FLAG, &o->causal, NULL, "causal mask (the default)"),
        STRIA_OPTION("no-causal", UNFLAG, &o->causal, NULL, "no mask"),
        STRIA_OPTION("reps", INT, &reps, "N", "timed runs per pass, median reported", .dflt = "5",
                     .min = 1, .max = 1000),
        STRIA_OPTION(
            "variant", STRING, &o->variant, "V",
            "kernel variant: portable | avx2 | avx512-nobf16 | avx512 | amx | all (every one "
            "this CPU runs, side by side); default: the best available"),
        STRIA_OPTION("device", CUSTOM, &o->device, "X",
                     "cpu, or cuda / cuda:N: the GPU kernels, timed with CUDA events, against the "
                     "GPU's cuBLAS bf16 GEMM rate measured in the same run",
                     .dflt = "cpu", .parse = stria__kb_parse_device),
        STRIA_OPTION("gemm", INT, &o->gemm_n, "N", "side of that cuBLAS GEMM (0 skips it)",
                     .dflt = "8192", .min = 0, .max = 32768),
        STRIA_OPTION("json", FLAG, &o->json, NULL, "one JSON object per line instead of the table"),
    };
    stria_option_t opts[sizeof(own) / sizeof(own[0]) + STRIA_BENCH_SHAPE_OPTS + 1] = {{0}};
    stria_bench_shape_t shape = {0};
    memcpy(opts, own, sizeof(own));
    stria_bench_shape_options(opts + sizeof(own) / sizeof(own[0]), &shape, 1024);
    const stria_command_t cmd = {.name = "kernels",
                                 .description = stria__kb_description,
                                 .epilog = stria__kb_epilog,
                                 .options = opts};
    stria_cli_t cli;

    memset(o, 0, sizeof(*o));
    o->causal = true;
    int rc = stria_bench_parse(&cmd, argc, argv, &cli);
    o->dtype_set = stria_cli_given(&cli, "dtype");
    o->threads = (int)threads;
    o->reps = (int)reps;
    stria_cli_free(&cli);
    if (rc >= 0)
        return rc;
    if (stria_bench_shape_check("kernels", &shape) >= 0)
        return 2;
    o->heads = shape.heads;
    o->kv_heads = shape.kv_heads;
    o->head_dim = shape.head_dim;
    o->dtype = shape.dtype;
    if (strcmp(o->device, "cpu") != 0 && !o->dtype_set)
        o->dtype = STRIA_DTYPE_BF16;
    if (o->variant != NULL && strcmp(o->variant, "all") != 0) {
        const char *const *names = stria_kernels_variant_names();
        bool known = false;
        for (size_t i = 0; names[i] != NULL; i++)
            known = known || strcmp(names[i], o->variant) == 0;
        if (!known)
            return stria_bench_usage_error("kernels",
                                           "--variant '%s': unknown (expected portable, avx2, "
                                           "avx512-nobf16, avx512, amx or all)",
                                           o->variant);
        if (!stria_kernels_variant_available(o->variant)) {
            fprintf(stderr, "stria-bench kernels: variant %s is not supported by this CPU\n",
                    o->variant);
            return 2;
        }
    }
    return -1;
}

/* ---- FMA peak ---------------------------------------------------------- */

/* What a peak loop runs: the fp32 FMA (of a vector width), the 512-bit bf16
 * dot product (vdpbf16ps) or the AMX tile product (tdpbf16ps). */
enum { STRIA__UNIT_FMA = 0, STRIA__UNIT_DOT = 1, STRIA__UNIT_AMX = 2 };

typedef struct {
    int width; /* vector bits: 512, 256 */
    int unit;  /* STRIA__UNIT_* */
    double seconds;
    pthread_barrier_t *barrier;
    double flops, elapsed, cpu;
    float sink;
} stria__peak_arg_t;

/* A measured peak: all threads' GFLOP/s by the wall clock, and GFLOP/s per
 * CPU-second that each thread really got (robust to time-sharing). */
typedef struct {
    double wall;
    double per_cpu;
} stria__peak_t;

#ifdef STRIA__BENCH_X86
/* x <- x * 0.5 + 0.5 converges to 1 and stays normal: no denormal slowdowns
 * and nothing the compiler may fold. */
#define STRIA__PEAK_LOOP(VEC, SET1, FMA, ADD, STORE, LANES)                                        \
    VEC acc[STRIA__PEAK_CHAINS], half = SET1(0.5f);                                                \
    double t0, t;                                                                                  \
    long long iters = 0;                                                                           \
    for (int c = 0; c < STRIA__PEAK_CHAINS; c++)                                                   \
        acc[c] = SET1(1.0f + (float)c);                                                            \
    t0 = stria_time_now();                                                                         \
    do {                                                                                           \
        for (int it = 0; it < 4096; it++) {                                                        \
            _Pragma("GCC unroll 12") for (int c = 0; c < STRIA__PEAK_CHAINS; c++) acc[c] =         \
                FMA(acc[c], half, half);                                                           \
        }                                                                                          \
        iters += 4096;                                                                             \
        t = stria_time_now();                                                                      \
    } while (t - t0 < seconds);                                                                    \
    for (int c = 1; c < STRIA__PEAK_CHAINS; c++)                                                   \
        acc[0] = ADD(acc[0], acc[c]);                                                              \
    float out[LANES];                                                                              \
    STORE(out, acc[0]);                                                                            \
    *sink = out[0];                                                                                \
    *elapsed = t - t0;                                                                             \
    return (double)iters * STRIA__PEAK_CHAINS * (LANES)*2.0;

__attribute__((target("avx512f,fma"))) static double
stria__peak_avx512(double seconds, double *elapsed, float *sink)
{
    STRIA__PEAK_LOOP(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_storeu_ps, 16)
}

/* vdpbf16ps chains: acc += a . b over a pair per lane, 2 products (4 FLOPs)
 * per lane; a = 1 and b = 2^-30 keep acc normal and finite for hours. */
__attribute__((target("avx512f,avx512bf16"))) static double
stria__peak_bf16(double seconds, double *elapsed, float *sink)
{
    __m512 acc[STRIA__PEAK_CHAINS];
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f));
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-30f), _mm512_set1_ps(0x1p-30f));
    double t0, t;
    long long iters = 0;
    for (int c = 0; c < STRIA__PEAK_CHAINS; c++)
        acc[c] = _mm512_set1_ps(1.0f + (float)c);
    t0 = stria_time_now();
    do {
        for (int it = 0; it < 4096; it++) {
#pragma GCC unroll 12
            for (int c = 0; c < STRIA__PEAK_CHAINS; c++)
                acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
        }
        iters += 4096;
        t = stria_time_now();
    } while (t - t0 < seconds);
    for (int c = 1; c < STRIA__PEAK_CHAINS; c++)
        acc[0] = _mm512_add_ps(acc[0], acc[c]);
    float out[16];
    _mm512_storeu_ps(out, acc[0]);
    *sink = out[0];
    *elapsed = t - t0;
    return (double)iters * STRIA__PEAK_CHAINS * 16 * 4.0;
}

/* tdpbf16ps on four independent accumulator tiles (C0..C3 += A4/A5 . B6/B7),
 * 16 x 16 x 32 products each: 16384 FLOPs an instruction. a = 1 and b =
 * 2^-30 keep the sums normal and finite. Only run where the amx variant is
 * (its probe asked the kernel for the tile state). */
__attribute__((target("amx-tile,amx-bf16"))) static double
stria__peak_amx(double seconds, double *elapsed, float *sink)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg;
    uint16_t a[16 * 32] __attribute__((aligned(64))), b[16 * 32] __attribute__((aligned(64)));
    float out[16 * 16] __attribute__((aligned(64)));
    double t0, t;
    long long iters = 0;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    for (int i = 0; i < 16 * 32; i++) {
        a[i] = 0x3f80; /* 1.0 */
        b[i] = 0x3080; /* 2^-30 */
    }
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a, 64);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b, 64);
    t0 = stria_time_now();
    do {
        for (int it = 0; it < 1024; it++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        iters += 1024;
        t = stria_time_now();
    } while (t - t0 < seconds);
    _tile_stored(0, out, 64);
    _tile_release();
    *sink = out[0];
    *elapsed = t - t0;
    return (double)iters * 4 * 16.0 * 16.0 * 32.0 * 2.0;
}

__attribute__((target("avx2,fma"))) static double stria__peak_avx2(double seconds, double *elapsed,
                                                                   float *sink)
{
    STRIA__PEAK_LOOP(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_storeu_ps, 8)
}
#endif

/* Scalar FMA chains: the peak of a CPU without vector FMA. */
static double stria__peak_scalar(double seconds, double *elapsed, float *sink)
{
    float acc[STRIA__PEAK_CHAINS];
    double t0, t;
    long long iters = 0;
    for (int c = 0; c < STRIA__PEAK_CHAINS; c++)
        acc[c] = 1.0f + (float)c;
    t0 = stria_time_now();
    do {
        for (int it = 0; it < 4096; it++)
            for (int c = 0; c < STRIA__PEAK_CHAINS; c++)
                acc[c] = fmaf(acc[c], 0.5f, 0.5f);
        iters += 4096;
        t = stria_time_now();
    } while (t - t0 < seconds);
    for (int c = 1; c < STRIA__PEAK_CHAINS; c++)
        acc[0] += acc[c];
    *sink = acc[0];
    *elapsed = t - t0;
    return (double)iters * STRIA__PEAK_CHAINS * 2.0;
}

static void *stria__peak_thread(void *p)
{
    stria__peak_arg_t *a = p;
    double c0;
    pthread_barrier_wait(a->barrier);
    c0 = stria_time_thread_cpu();
#ifdef STRIA__BENCH_X86
    if (a->unit == STRIA__UNIT_AMX)
        a->flops = stria__peak_amx(a->seconds, &a->elapsed, &a->sink);
    else if (a->unit == STRIA__UNIT_DOT)
        a->flops = stria__peak_bf16(a->seconds, &a->elapsed, &a->sink);
    else if (a->width == 512)
        a->flops = stria__peak_avx512(a->seconds, &a->elapsed, &a->sink);
    else if (a->width == 256)
        a->flops = stria__peak_avx2(a->seconds, &a->elapsed, &a->sink);
    else
#endif
        a->flops = stria__peak_scalar(a->seconds, &a->elapsed, &a->sink);
    a->cpu = stria_time_thread_cpu() - c0;
    return NULL;
}

/* Vector width whose FMA peak a variant is compared against. */
static int stria__peak_width(const char *variant)
{
#ifdef STRIA__BENCH_X86
    __builtin_cpu_init();
    bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    bool has256 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if ((strcmp(variant, "avx512") == 0 || strcmp(variant, "avx512-nobf16") == 0 ||
         strcmp(variant, "amx") == 0) &&
        has512)
        return 512;
    if (strcmp(variant, "avx2") == 0 && has256)
        return 256;
    if (strcmp(variant, "portable") == 0)
        return has512 ? 512 : has256 ? 256 : 32;
#else
    (void)variant;
#endif
    return 32;
}

/* Total GFLOP/s of `threads` threads running the loop at once, each thread
 * timing itself: the best of STRIA__PEAK_TRIES tries, since a peak is what the
 * cores can do when nothing else gets in the way (on a shared machine a
 * median would drift with the neighbours' load). */
static stria_status_t stria__peak_measure(int width, int unit, int threads, stria__peak_t *out)
{
    stria__peak_t best = {0.0, 0.0};
    pthread_barrier_t barrier;
    stria__peak_arg_t *args = calloc((size_t)threads, sizeof(*args));
    pthread_t *tids = calloc((size_t)threads, sizeof(*tids));
    stria_status_t st = STRIA_OK;

    if (args == NULL || tids == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate peak threads");
        goto out;
    }
    for (int r = 0; r < STRIA__PEAK_TRIES; r++) {
        int started = 0;
        double total = 0.0;
        pthread_barrier_init(&barrier, NULL, (unsigned)threads);
        for (int t = 0; t < threads; t++) {
            args[t].width = width;
            args[t].unit = unit;
            args[t].seconds = 0.1;
            args[t].barrier = &barrier;
        }
        for (int t = 1; t < threads; t++, started++)
            if (pthread_create(&tids[t], NULL, stria__peak_thread, &args[t]) != 0)
                break;
        if (started != threads - 1) {
            /* the started threads wait at the barrier forever: cannot recover */
            fprintf(stderr, "stria-bench kernels: cannot start %d peak threads\n", threads);
            exit(1);
        }
        stria__peak_thread(&args[0]);
        for (int t = 1; t < threads; t++)
            pthread_join(tids[t], NULL);
        pthread_barrier_destroy(&barrier);
        double per_cpu = 0.0;
        for (int t = 0; t < threads; t++) {
            total += args[t].flops / args[t].elapsed;
            per_cpu += args[t].flops / args[t].cpu / threads;
        }
        best.wall = total * 1e-9 > best.wall ? total * 1e-9 : best.wall;
        best.per_cpu = per_cpu * 1e-9 > best.per_cpu ? per_cpu * 1e-9 : best.per_cpu;
    }
    *out = best;
out:
    free(args);
    free(tids);
    return st;
}

/* ---- attention runs ----------------------------------------------------- */

typedef struct {
    stria_attn_params_t p;
    size_t nq, nk, nl;
    void *q, *k, *v, *d_o;  /* storage dtype */
    float *o, *lse, *delta; /* fp32 */
    float *dq, *dk, *dv;    /* fp32 */
    stria_tensor_t tq, tk, tv, tdo, to, tdq, tdk, tdv;
} stria__kb_data_t;

static void stria__kb_data_free(stria__kb_data_t *d)
{
    STRIA_FREE_ALL(d->q, d->k, d->v, d->d_o, d->o, d->lse, d->delta, d->dq, d->dk, d->dv);
    memset(d, 0, sizeof(*d));
}

static stria_status_t stria__kb_data_init(stria__kb_data_t *d, const stria__kb_opts_t *o,
                                          stria_pool_t *pool)
{
    size_t es = stria_dtype_size(o->dtype);
    memset(d, 0, sizeof(*d));
    d->p.batch = 1;
    d->p.q_tokens = o->seq;
    d->p.kv_tokens = o->seq;
    d->p.heads = o->heads;
    d->p.kv_heads = o->kv_heads;
    d->p.head_dim = o->head_dim;
    d->p.causal = o->causal;
    d->p.pool = pool;
    d->nq = (size_t)(o->seq * o->heads * o->head_dim);
    d->nk = (size_t)(o->seq * o->kv_heads * o->head_dim);
    d->nl = (size_t)(o->seq * o->heads);
    d->q = stria_malloc_aligned(d->nq * es);
    d->d_o = stria_malloc_aligned(d->nq * es);
    d->k = stria_malloc_aligned(d->nk * es);
    d->v = stria_malloc_aligned(d->nk * es);
    d->o = stria_malloc_aligned(d->nq * sizeof(float));
    d->dq = stria_malloc_aligned(d->nq * sizeof(float));
    d->dk = stria_malloc_aligned(d->nk * sizeof(float));
    d->dv = stria_malloc_aligned(d->nk * sizeof(float));
    d->lse = stria_malloc_aligned(d->nl * sizeof(float));
    d->delta = stria_malloc_aligned(d->nl * sizeof(float));
    if (!d->q || !d->d_o || !d->k || !d->v || !d->o || !d->dq || !d->dk || !d->dv || !d->lse ||
        !d->delta) {
        stria__kb_data_free(d);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate the benchmark tensors");
    }
    stria_bench_fill(d->q, o->dtype, d->nq, 1);
    stria_bench_fill(d->k, o->dtype, d->nk, 2);
    stria_bench_fill(d->v, o->dtype, d->nk, 3);
    stria_bench_fill(d->d_o, o->dtype, d->nq, 4);
    d->tq = stria_tensor_contiguous(d->q, o->dtype, o->seq, o->heads, o->head_dim);
    d->tdo = stria_tensor_contiguous(d->d_o, o->dtype, o->seq, o->heads, o->head_dim);
    d->tk = stria_tensor_contiguous(d->k, o->dtype, o->seq, o->kv_heads, o->head_dim);
    d->tv = stria_tensor_contiguous(d->v, o->dtype, o->seq, o->kv_heads, o->head_dim);
    d->to = stria_tensor_contiguous(d->o, STRIA_DTYPE_F32, o->seq, o->heads, o->head_dim);
    d->tdq = stria_tensor_contiguous(d->dq, STRIA_DTYPE_F32, o->seq, o->heads, o->head_dim);
    d->tdk = stria_tensor_contiguous(d->dk, STRIA_DTYPE_F32, o->seq, o->kv_heads, o->head_dim);
    d->tdv = stria_tensor_contiguous(d->dv, STRIA_DTYPE_F32, o->seq, o->kv_heads, o->head_dim);
    return STRIA_OK;
}

/* One timed run: wall-clock seconds and CPU seconds of all threads. */
typedef struct {
    double wall, cpu;
} stria__kb_time_t;

static stria_status_t stria__kb_fwd(stria__kb_data_t *d, stria__kb_time_t *t)
{
    double c0 = stria_bench_process_cpu(), t0 = stria_time_now();
    stria_status_t st = stria_attn_fwd(&d->p, &d->tq, &d->tk, &d->tv, &d->to, d->lse, false);
    t->wall = stria_time_now() - t0;
    t->cpu = stria_bench_process_cpu() - c0;
    return st;
}

/* The backward pass proper: D = rowsum(dO * O), then dQ, dK, dV. */
static stria_status_t stria__kb_bwd(stria__kb_data_t *d, stria__kb_time_t *t)
{
    stria_status_t st;
    double t0, c0;
    memset(d->dq, 0, d->nq * sizeof(float));
    memset(d->dk, 0, d->nk * sizeof(float));
    memset(d->dv, 0, d->nk * sizeof(float));
    c0 = stria_bench_process_cpu();
    t0 = stria_time_now();
    st = stria_attn_bwd_delta(&d->p, &d->to, &d->tdo, d->delta);
    if (st == STRIA_OK)
        st = stria_attn_bwd(&d->p, &d->tq, &d->tk, &d->tv, &d->tdo, d->lse, d->delta, &d->tdq,
                            &d->tdk, &d->tdv);
    t->wall = stria_time_now() - t0;
    t->cpu = stria_bench_process_cpu() - c0;
    return st;
}

/* Medians of the wall and the CPU times (each sorted on its own). */
static stria__kb_time_t stria__kb_median(const stria__kb_time_t *v, int n, double *scratch)
{
    stria__kb_time_t m;
    for (int i = 0; i < n; i++)
        scratch[i] = v[i].wall;
    m.wall = stria_bench_median(scratch, n);
    for (int i = 0; i < n; i++)
        scratch[i] = v[i].cpu;
    m.cpu = stria_bench_median(scratch, n);
    return m;
}

/* The peaks of one variant and dtype: the fp32 FMA one; for bf16, also the
 * bf16 dot product's and the AMX tiles' where the core has them (has_dot,
 * has_amx); the unit the variant's bf16 products run on (dot, amx). */
typedef struct {
    stria__peak_t fma, dot_peak, amx_peak;
    bool dot, amx, has_dot, has_amx, bf16;
    int width;
} stria__kb_peaks_t;

/* What a pass is judged against: for bf16 the fastest bf16 product the core
 * has (AMX tiles, else the dot product, else the FMA), whatever the variant
 * runs on; else the FMA of the variant's width. Its peak and name. */
static stria__peak_t stria__kb_own_peak(const stria__kb_peaks_t *pk, const char **kind)
{
    static char name[32];
    if (pk->bf16 && pk->has_amx) {
        *kind = "bf16-amx-tile";
        return pk->amx_peak;
    }
    if (pk->bf16 && pk->has_dot) {
        *kind = "bf16-dot-512";
        return pk->dot_peak;
    }
    if (pk->width == 32)
        snprintf(name, sizeof(name), "fp32-fma-scalar");
    else
        snprintf(name, sizeof(name), "fp32-fma-%d", pk->width);
    *kind = name;
    return pk->fma;
}

/* The ceiling of a pass of equal products all run on one unit: that unit's
 * rate (the variant's: AMX tiles, the dot product or the FMA). */
static double stria__kb_ceiling(const stria__kb_peaks_t *pk, bool per_cpu)
{
    const stria__peak_t *p = pk->amx ? &pk->amx_peak : pk->dot ? &pk->dot_peak : &pk->fma;
    return per_cpu ? p->per_cpu : p->wall;
}

/* Wall-clock figures are what a caller gets; the CPU-time figures divide the
 * FLOPs by the CPU-seconds the threads really ran, against the per-CPU-second
 * peak, so neighbours that take the cores away do not distort them. Each
 * pass is a fraction of its dtype's peak (peak_kind) and of the ceiling of
 * the unit its products run on; the peaks measured are beside them. */
static void stria__kb_report(const stria__kb_opts_t *o, const char *variant, const char *pass,
                             stria__kb_time_t t, double flops, const stria__kb_peaks_t *pk)
{
    const char *kind;
    const stria__peak_t peak = stria__kb_own_peak(pk, &kind);
    double ceil = stria__kb_ceiling(pk, false), ceil_cpu = stria__kb_ceiling(pk, true);
    double gflops = t.wall > 0.0 ? flops / t.wall * 1e-9 : 0.0;
    double per_cpu = t.cpu > 0.0 ? flops / t.cpu * 1e-9 : 0.0;
    double frac = peak.wall > 0 ? gflops / peak.wall : 0.0;
    double frac_ceil = ceil > 0 ? gflops / ceil : 0.0;
    double frac_cpu = peak.per_cpu > 0 ? per_cpu / peak.per_cpu : 0.0;
    double frac_ceil_cpu = ceil_cpu > 0 ? per_cpu / ceil_cpu : 0.0;
    if (o->json) {
        printf("{\"name\":\"attention\",\"pass\":\"%s\",\"seq\":%lld,\"head_dim\":%lld,"
               "\"heads\":%lld,\"kv_heads\":%lld,\"threads\":%d,\"dtype\":\"%s\","
               "\"causal\":%s,\"variant\":\"%s\",\"reps\":%d,\"seconds\":%.6f,"
               "\"gflops\":%.3f,\"peak_gflops\":%.3f,\"peak_kind\":\"%s\","
               "\"fraction_of_peak\":%.4f,\"ceiling_gflops\":%.3f,\"fraction_of_ceiling\":%.4f,"
               "\"fma_peak_gflops\":%.3f,\"dot_peak_gflops\":%.3f,\"amx_peak_gflops\":%.3f,"
               "\"cpu_seconds\":%.6f,\"gflops_per_cpu\":%.3f,"
               "\"peak_gflops_per_cpu\":%.3f,\"fraction_of_peak_cpu\":%.4f,"
               "\"fraction_of_ceiling_cpu\":%.4f}\n",
               pass, (long long)o->seq, (long long)o->head_dim, (long long)o->heads,
               (long long)o->kv_heads, o->threads, stria_dtype_name(o->dtype),
               o->causal ? "true" : "false", variant, o->reps, t.wall, gflops, peak.wall, kind,
               frac, ceil, frac_ceil, pk->fma.wall, pk->has_dot ? pk->dot_peak.wall : 0.0,
               pk->has_amx ? pk->amx_peak.wall : 0.0, t.cpu, per_cpu, peak.per_cpu, frac_cpu,
               frac_ceil_cpu);
    } else {
        printf("  %-13s %-4s %9.4f s %8.1f GFLOP/s %6.1f%% of %s peak, %5.1f%% of ceiling "
               "(CPU time: %6.1f GFLOP/s per CPU-s, %5.1f%%)\n",
               variant, pass, t.wall, gflops, 100.0 * frac, kind, 100.0 * frac_ceil, per_cpu,
               100.0 * frac_cpu);
    }
    fflush(stdout);
}

/* Prints one measured peak (kind: "fp32-fma-512", "bf16-dot-512", ...). */
static void stria__kb_print_peak(const stria__kb_opts_t *o, const char *variant, const char *name,
                                 const char *kind, const char *dtype, int width,
                                 const stria__peak_t *peak)
{
    if (o->json) {
        printf("{\"name\":\"%s\",\"pass\":\"peak\",\"seq\":%lld,\"head_dim\":%lld,"
               "\"heads\":%lld,\"kv_heads\":%lld,\"threads\":%d,\"dtype\":\"%s\","
               "\"causal\":%s,\"variant\":\"%s\",\"reps\":%d,\"vector_bits\":%d,\"chains\":%d,"
               "\"peak_kind\":\"%s\",\"seconds\":0.1,\"gflops\":%.3f,\"peak_gflops\":%.3f,"
               "\"fraction_of_peak\":1,\"peak_gflops_per_cpu\":%.3f}\n",
               name, (long long)o->seq, (long long)o->head_dim, (long long)o->heads,
               (long long)o->kv_heads, o->threads, dtype, o->causal ? "true" : "false", variant,
               STRIA__PEAK_TRIES, width, STRIA__PEAK_CHAINS, kind, peak->wall, peak->wall,
               peak->per_cpu);
    } else {
        if (strcmp(name, "bf16_amx_peak") == 0)
            printf("  %-13s peak tdpbf16ps on 4 accumulator tiles, %d thread(s) busy: %.1f "
                   "GFLOP/s (%.1f per core; %.1f per CPU-second)\n",
                   variant, o->threads, peak->wall, peak->wall / o->threads, peak->per_cpu);
        else
            printf("  %-13s peak %d x %d-bit %s chains, %d thread(s) busy: %.1f GFLOP/s "
                   "(%.1f per core; %.1f per CPU-second)\n",
                   variant, STRIA__PEAK_CHAINS, width,
                   strcmp(name, "bf16_dot_peak") == 0 ? "vdpbf16ps" : "FMA", o->threads, peak->wall,
                   peak->wall / o->threads, peak->per_cpu);
    }
}

static int stria__kb_run_variant(const stria__kb_opts_t *o, const char *variant,
                                 stria__kb_data_t *d)
{
    stria__kb_peaks_t pk = {.width = stria__peak_width(variant)};
    stria__kb_time_t *times = NULL, warm;
    double fwd_flops, *scratch = NULL;
    const char *kind;
    stria_status_t st;

    if (stria_kernels_set_variant(variant) != STRIA_OK) {
        fprintf(stderr, "stria-bench kernels: %s\n", stria_error_msg());
        return 1;
    }
    pk.bf16 = o->dtype == STRIA_DTYPE_BF16;
#ifdef STRIA__BENCH_X86
    __builtin_cpu_init();
    pk.has_dot =
        pk.bf16 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
    /* the amx variant is there only where the CPU has AMX and the kernel
     * granted the tile state (asked by its probe), which the loop needs */
    pk.has_amx = pk.bf16 && stria_kernels_variant_available("amx");
    pk.amx = pk.bf16 && strcmp(variant, "amx") == 0 && pk.has_amx;
    pk.dot = pk.bf16 && !pk.amx && stria_kernels_variant_bf16_dot(variant);
#endif
    if (stria__peak_measure(pk.width, STRIA__UNIT_FMA, o->threads, &pk.fma) != STRIA_OK ||
        (pk.has_dot &&
         stria__peak_measure(512, STRIA__UNIT_DOT, o->threads, &pk.dot_peak) != STRIA_OK) ||
        (pk.has_amx &&
         stria__peak_measure(512, STRIA__UNIT_AMX, o->threads, &pk.amx_peak) != STRIA_OK)) {
        fprintf(stderr, "stria-bench kernels: %s\n", stria_error_msg());
        return 1;
    }
    pk.has_dot = pk.has_dot && pk.dot_peak.wall > 0.0;
    pk.has_amx = pk.has_amx && pk.amx_peak.wall > 0.0;
    pk.dot = pk.dot && pk.has_dot;
    pk.amx = pk.amx && pk.has_amx;
    stria__kb_own_peak(&(stria__kb_peaks_t){.width = pk.width}, &kind);
    stria__kb_print_peak(o, variant, "fma_peak", kind, "fp32", pk.width, &pk.fma);
    if (pk.has_dot)
        stria__kb_print_peak(o, variant, "bf16_dot_peak", "bf16-dot-512", "bf16", 512,
                             &pk.dot_peak);
    if (pk.has_amx)
        stria__kb_print_peak(o, variant, "bf16_amx_peak", "bf16-amx-tile", "bf16", 512,
                             &pk.amx_peak);
    fwd_flops = 4.0 * (double)o->seq * (double)o->seq * (double)o->head_dim * (double)o->heads;
    if (o->causal)
        fwd_flops *= 0.5;
    times = malloc((size_t)o->reps * sizeof(*times));
    scratch = malloc((size_t)o->reps * sizeof(double));
    if (times == NULL || scratch == NULL) {
        fprintf(stderr, "stria-bench kernels: out of memory\n");
        free(times);
        free(scratch);
        return 1;
    }
    /* warm-up: first-touch of the workspaces, thread start-up */
    if ((st = stria__kb_fwd(d, &warm)) != STRIA_OK || (st = stria__kb_bwd(d, &warm)) != STRIA_OK)
        goto fail;
    for (int r = 0; r < o->reps; r++)
        if ((st = stria__kb_fwd(d, &times[r])) != STRIA_OK)
            goto fail;
    /* forward: K Q^T and P V; backward: K Q^T, V dO^T, P^T dO, dS^T Q, dS K */
    stria__kb_report(o, variant, "fwd", stria__kb_median(times, o->reps, scratch), fwd_flops, &pk);
    for (int r = 0; r < o->reps; r++)
        if ((st = stria__kb_bwd(d, &times[r])) != STRIA_OK)
            goto fail;
    stria__kb_report(o, variant, "bwd", stria__kb_median(times, o->reps, scratch), 2.5 * fwd_flops,
                     &pk);
    free(times);
    free(scratch);
    return 0;
fail:
    fprintf(stderr, "stria-bench kernels: %s: %s\n", stria_status_name(st), stria_error_msg());
    free(times);
    free(scratch);
    return 1;
}

int stria_bench_kernels(int argc, char **argv)
{
    stria__kb_opts_t o;
    stria__kb_data_t d;
    stria_pool_t *pool = NULL;
    const char *single[2] = {NULL, NULL};
    const char *const *variants = single;
    int rc = stria__kb_parse(argc, argv, &o);

    if (rc >= 0)
        return rc;
    if (strcmp(o.device, "cpu") != 0) {
#ifdef STRIA_BENCH_CUDA
        stria_bench_cuda_opts_t co = {o.device, o.seq,   o.head_dim, o.heads, o.kv_heads,
                                      o.reps,   o.dtype, o.causal,   o.json,  o.gemm_n};
        return stria_bench_kernels_cuda(&co);
#else
        fprintf(stderr, "stria-bench kernels: --device %s: this build has no CUDA support\n",
                o.device);
        return 2;
#endif
    }
    if (o.variant != NULL && strcmp(o.variant, "all") == 0)
        variants = stria_kernels_variant_names();
    else
        single[0] = o.variant != NULL ? o.variant : stria_kernels_variant();
    if (strcmp(variants[0], "none") == 0) {
        fprintf(stderr, "stria-bench kernels: %s\n", stria_error_msg());
        return 1;
    }
    if (stria_pool_create(o.threads, &pool) != STRIA_OK) {
        fprintf(stderr, "stria-bench kernels: %s\n", stria_error_msg());
        return 1;
    }
    if (stria__kb_data_init(&d, &o, pool) != STRIA_OK) {
        fprintf(stderr, "stria-bench kernels: %s\n", stria_error_msg());
        stria_pool_destroy(pool);
        return 1;
    }
    if (!o.json)
        printf("stria-bench kernels: S=%lld H=%lld/%lld D=%lld %s %s, %d thread(s), median of %d\n",
               (long long)o.seq, (long long)o.heads, (long long)o.kv_heads, (long long)o.head_dim,
               o.causal ? "causal" : "non-causal", stria_dtype_name(o.dtype), o.threads, o.reps);
    rc = 0;
    for (size_t i = 0; variants[i] != NULL && rc == 0; i++) {
        if (!stria_kernels_variant_available(variants[i]))
            continue;
        rc = stria__kb_run_variant(&o, variants[i], &d);
    }
    stria__kb_data_free(&d);
    stria_pool_destroy(pool);
    return rc;
}
