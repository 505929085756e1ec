/*
 * stria-run: run attention on .npy inputs.
 *
 *   stria-run local  --q Q.npy --k K.npy --v V.npy [--do DO.npy] --out DIR
 *   stria-run submit --coordinator HOST:PORT --q Q.npy ... --out DIR
 *   stria-run random --shape B,T,H,D --out FILE.npy
 *
 * `local` computes in this process (optionally over an in-process ring),
 * `submit` through the service, `random` writes test inputs (see --help). Inputs are [batch,
 * tokens, heads, head_dim] (K/V with kv_heads); outputs are float32 .npy files.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <unistd.h>

#include "stria_client.h"
#include "stria_common.h"
#include "stria_kernels.h"
#include "stria_ring.h"

typedef struct {
    const char *q_path, *k_path, *v_path, *do_path, *out_dir;
    bool causal;
    bool dtype_set;
    stria_dtype_t dtype;
    float scale;
    int threads;
    bool quiet;
    /* local ring / service */
    int ranks;          /* 0: no ring (local), all workers (submit) */
    const char *device; /* local: the ranks' device; NULL: the host */
    bool layout_set;
    stria_layout_kind_t layout;
    /* submit */
    bool submit;
    const char *coordinator;
    const char *token_file;
    double step_timeout_s;
    bool check;
    const char *label;
} stria__run_opts_t;

/* Inputs converted to the compute dtype, and outputs in fp32. */
typedef struct {
    int64_t B, T, H, Hkv, D;
    stria_dtype_t dtype;
    void *q, *k, *v, *d_o; /* storage dtype, contiguous */
    float *o, *lse, *dq, *dk, *dv;
} stria__run_data_t;

static void stria__run_usage(FILE *out)
{
    fprintf(
        out,
        "usage: stria-run local --q Q.npy --k K.npy --v V.npy [--do DO.npy] --out DIR\n"
        "                       [--causal | --no-causal] [--dtype fp32|bf16|fp16]\n"
        "                       [--scale X] [--threads T] [--quiet]\n"
        "\n"
        "Computes exact attention in this process.\n"
        "\n"
        "  --q PATH         queries, [batch, tokens, heads, head_dim], float32 or float16 .npy\n"
        "  --k PATH         keys, [batch, tokens, kv_heads, head_dim]; heads must be a\n"
        "                   multiple of kv_heads (grouped-query attention)\n"
        "  --v PATH         values, same shape as --k\n"
        "  --do PATH        output gradient, same shape as --q: also runs the backward pass\n"
        "  --out DIR        output folder (created if missing): o.npy (Q's shape),\n"
        "                   lse.npy ([batch, heads, tokens], natural log), and with --do\n"
        "                   dq.npy, dk.npy, dv.npy; all float32, holding the values in the\n"
        "                   computed precision (rounded to --dtype)\n"
        "  --causal         causal mask: token i sees tokens <= i (default)\n"
        "  --no-causal      no mask\n"
        "  --dtype D        storage dtype to compute in: fp32, bf16 or fp16 (inputs are\n"
        "                   converted on load; default: the dtype of the Q file; arithmetic\n"
        "                   accumulates in fp32 always)\n"
        "  --scale X        softmax scale (default 1/sqrt(head_dim))\n"
        "  --threads T      compute threads (default: all online CPUs)\n"
        "  --device NAME    where the ring's ranks compute: cpu (default), cuda:N\n"
        "                   (cuda = cuda:0), cpu:staged (host kernels through the GPU\n"
        "                   staging path) or auto; runs an in-process ring (--ranks,\n"
        "                   default 1)\n"
        "  --quiet          print nothing on success\n"
        "  -h, --help       this help\n"
        "\n"
        "Environment: STRIA_KERNEL=portable|avx2|avx512 forces a CPU kernel variant;\n"
        "STRIA_LOG_LEVEL=error|warn|info|debug.\n"
        "Exit status: 0 success, 1 computation or file error, 2 usage error.\n");
}

static int stria__usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "stria-run: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(see stria-run --help)\n");
    return 2;
}

static int stria__parse_opts(int argc, char **argv, bool submit, stria__run_opts_t *o)
{
    enum {
        OPT_Q = 256,
        OPT_K,
        OPT_V,
        OPT_DO,
        OPT_OUT,
        OPT_CAUSAL,
        OPT_NOCAUSAL,
        OPT_DTYPE,
        OPT_SCALE,
        OPT_THREADS,
        OPT_QUIET,
        OPT_RANKS,
        OPT_LAYOUT,
        OPT_COORD,
        OPT_TOKEN,
        OPT_STEP,
        OPT_CHECK,
        OPT_LABEL,
        OPT_DEVICE
    };
    static const struct option longopts[] = {
        {"q", required_argument, NULL, OPT_Q},
        {"k", required_argument, NULL, OPT_K},
        {"v", required_argument, NULL, OPT_V},
        {"do", required_argument, NULL, OPT_DO},
        {"out", required_argument, NULL, OPT_OUT},
        {"causal", no_argument, NULL, OPT_CAUSAL},
        {"no-causal", no_argument, NULL, OPT_NOCAUSAL},
        {"dtype", required_argument, NULL, OPT_DTYPE},
        {"scale", required_argument, NULL, OPT_SCALE},
        {"threads", required_argument, NULL, OPT_THREADS},
        {"quiet", no_argument, NULL, OPT_QUIET},
        {"ranks", required_argument, NULL, OPT_RANKS},
        {"layout", required_argument, NULL, OPT_LAYOUT},
        {"coordinator", required_argument, NULL, OPT_COORD},
        {"token-file", required_argument, NULL, OPT_TOKEN},
        {"step-timeout", required_argument, NULL, OPT_STEP},
        {"check", no_argument, NULL, OPT_CHECK},
        {"label", required_argument, NULL, OPT_LABEL},
        {"device", required_argument, NULL, OPT_DEVICE},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;
    char *end;

    memset(o, 0, sizeof(*o));
    o->causal = true;
    o->submit = submit;
    o->token_file = getenv("STRIA_TOKEN_FILE");
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, ":h", longopts, NULL)) != -1) {
        switch (c) {
        case OPT_Q:
            o->q_path = optarg;
            break;
        case OPT_K:
            o->k_path = optarg;
            break;
        case OPT_V:
            o->v_path = optarg;
            break;
        case OPT_DO:
            o->do_path = optarg;
            break;
        case OPT_OUT:
            o->out_dir = optarg;
            break;
        case OPT_CAUSAL:
            o->causal = true;
            break;
        case OPT_NOCAUSAL:
            o->causal = false;
            break;
        case OPT_DTYPE:
            if (stria_dtype_parse(optarg, &o->dtype) != STRIA_OK)
                return stria__usage_error("--dtype: %s", stria_error_msg());
            o->dtype_set = true;
            break;
        case OPT_SCALE:
            errno = 0;
            o->scale = strtof(optarg, &end);
            if (errno != 0 || end == optarg || *end != '\0' || !(o->scale > 0.0f) ||
                isinf(o->scale))
                return stria__usage_error("--scale '%s': expected a finite number > 0", optarg);
            break;
        case OPT_THREADS: {
            errno = 0;
            long t = strtol(optarg, &end, 10);
            if (errno != 0 || end == optarg || *end != '\0' || t < 1 || t > 1024)
                return stria__usage_error("--threads '%s': expected an integer in 1..1024", optarg);
            o->threads = (int)t;
            break;
        }
        case OPT_QUIET:
            o->quiet = true;
            break;
        case OPT_RANKS: {
            errno = 0;
            long r = strtol(optarg, &end, 10);
            if (errno != 0 || end == optarg || *end != '\0' || r < 1 || r > 256)
                return stria__usage_error("--ranks '%s': expected an integer in 1..256", optarg);
            o->ranks = (int)r;
            break;
        }
        case OPT_DEVICE: {
            stria_device_t *dev = NULL;
            if (submit)
                return stria__usage_error("%s", "--device is for stria-run local (workers choose "
                                                "their own device)");
            if (stria_device_open(optarg, NULL, &dev) != STRIA_OK)
                return stria__usage_error("--device: %s", stria_error_msg());
            stria_device_close(dev);
            o->device = optarg;
            break;
        }
        case OPT_LAYOUT:
            if (stria_layout_kind_parse(optarg, &o->layout) != STRIA_OK)
                return stria__usage_error("--layout: %s", stria_error_msg());
            o->layout_set = true;
            break;
        case OPT_COORD:
        case OPT_TOKEN:
        case OPT_STEP:
        case OPT_CHECK:
        case OPT_LABEL:
            if (!submit)
                return stria__usage_error("option %s is for stria-run submit", argv[optind - 1]);
            if (c == OPT_COORD)
                o->coordinator = optarg;
            else if (c == OPT_TOKEN)
                o->token_file = optarg;
            else if (c == OPT_CHECK)
                o->check = true;
            else if (c == OPT_LABEL)
                o->label = optarg;
            else {
                o->step_timeout_s = strtod(optarg, &end);
                if (end == optarg || *end != '\0' || !(o->step_timeout_s > 0) ||
                    isinf(o->step_timeout_s))
                    return stria__usage_error("--step-timeout '%s': expected seconds > 0", optarg);
            }
            break;
        case 'h':
            stria__run_usage(stdout);
            exit(0);
        case ':':
            return stria__usage_error("option %s needs a value", argv[optind - 1]);
        default:
            return stria__usage_error("unknown option '%s'", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return stria__usage_error("unexpected argument '%s'", argv[optind]);
    if (o->q_path == NULL || o->k_path == NULL || o->v_path == NULL)
        return stria__usage_error("%s", "--q, --k and --v are required");
    if (o->out_dir == NULL)
        return stria__usage_error("%s", "--out DIR is required");
    if (submit && o->coordinator == NULL)
        return stria__usage_error("%s", "--coordinator HOST:PORT is required");
    return 0;
}

/* Checks a 4-D array and returns its shape. */
static stria_status_t stria__check_4d(const stria_npy_t *a, const char *path, int64_t shape[4])
{
    if (a->ndim != 4)
        return stria_error_set(STRIA_ERR_FORMAT,
                               "%s: expected 4 dimensions [batch, tokens, heads, head_dim], "
                               "got %d",
                               path, a->ndim);
    for (int i = 0; i < 4; i++) {
        if (a->shape[i] < 1)
            return stria_error_set(STRIA_ERR_FORMAT, "%s: dimension %d is %lld (must be >= 1)",
                                   path, i, (long long)a->shape[i]);
        shape[i] = a->shape[i];
    }
    return STRIA_OK;
}

/* Converts an array to `dtype` storage; takes ownership of arr->data. */
static stria_status_t stria__to_dtype(stria_npy_t *arr, stria_dtype_t dtype, void **out)
{
    size_t n = (size_t)stria_npy_numel(arr);
    if (arr->dtype == dtype) {
        *out = arr->data;
        arr->data = NULL;
        return STRIA_OK;
    }
    void *dst = stria_malloc_aligned(n * stria_dtype_size(dtype));
    if (dst == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate %zu elements", n);
    stria_dtype_convert(arr->dtype, arr->data, dtype, dst, n);
    stria_npy_free(arr);
    *out = dst;
    return STRIA_OK;
}

static stria_status_t stria__load_inputs(const stria__run_opts_t *o, stria__run_data_t *d)
{
    stria_npy_t a[4];
    const char *paths[4] = {o->q_path, o->k_path, o->v_path, o->do_path};
    int64_t shapes[4][4];
    void **dst[4] = {&d->q, &d->k, &d->v, &d->d_o};
    int n = o->do_path ? 4 : 3;
    stria_status_t st = STRIA_OK;

    memset(a, 0, sizeof(a));
    for (int i = 0; i < n; i++) {
        st = stria_npy_read(paths[i], &a[i]);
        if (st != STRIA_OK)
            goto out;
        st = stria__check_4d(&a[i], paths[i], shapes[i]);
        if (st != STRIA_OK)
            goto out;
    }
    if (memcmp(shapes[1], shapes[2], sizeof(shapes[1])) != 0) {
        st = stria_error_set(STRIA_ERR_FORMAT, "%s and %s: K and V shapes differ", o->k_path,
                             o->v_path);
        goto out;
    }
    if (shapes[0][0] != shapes[1][0] || shapes[0][1] != shapes[1][1] ||
        shapes[0][3] != shapes[1][3]) {
        st = stria_error_set(STRIA_ERR_FORMAT,
                             "Q [%lld, %lld, %lld, %lld] and K [%lld, %lld, %lld, %lld] must "
                             "agree in batch, tokens and head_dim",
                             (long long)shapes[0][0], (long long)shapes[0][1],
                             (long long)shapes[0][2], (long long)shapes[0][3],
                             (long long)shapes[1][0], (long long)shapes[1][1],
                             (long long)shapes[1][2], (long long)shapes[1][3]);
        goto out;
    }
    if (shapes[0][2] % shapes[1][2] != 0) {
        st = stria_error_set(STRIA_ERR_FORMAT,
                             "Q has %lld heads, K/V %lld: heads must be a multiple of kv_heads",
                             (long long)shapes[0][2], (long long)shapes[1][2]);
        goto out;
    }
    if (n == 4 && memcmp(shapes[0], shapes[3], sizeof(shapes[0])) != 0) {
        st = stria_error_set(STRIA_ERR_FORMAT, "%s: dO must have Q's shape", o->do_path);
        goto out;
    }
    d->B = shapes[0][0];
    d->T = shapes[0][1];
    d->H = shapes[0][2];
    d->Hkv = shapes[1][2];
    d->D = shapes[0][3];
    d->dtype = o->dtype_set ? o->dtype : a[0].dtype;
    for (int i = 0; i < n; i++) {
        st = stria__to_dtype(&a[i], d->dtype, dst[i]);
        if (st != STRIA_OK)
            goto out;
    }
out:
    for (int i = 0; i < 4; i++)
        stria_npy_free(&a[i]);
    return st;
}

static stria_status_t stria__alloc_outputs(stria__run_data_t *d, bool backward)
{
    size_t nq = (size_t)(d->B * d->T * d->H * d->D);
    size_t nk = (size_t)(d->B * d->T * d->Hkv * d->D);
    d->o = stria_malloc_aligned(nq * sizeof(float));
    d->lse = stria_malloc_aligned((size_t)(d->B * d->H * d->T) * sizeof(float));
    if (d->o == NULL || d->lse == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate outputs");
    if (backward) {
        d->dq = stria_calloc_aligned(nq * sizeof(float));
        d->dk = stria_calloc_aligned(nk * sizeof(float));
        d->dv = stria_calloc_aligned(nk * sizeof(float));
        if (d->dq == NULL || d->dk == NULL || d->dv == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate gradients");
    }
    return STRIA_OK;
}

/* Single-process attention over the whole sequence. */
static stria_status_t stria__compute_local(const stria__run_opts_t *o, stria__run_data_t *d,
                                           stria_pool_t *pool)
{
    stria_attn_params_t p;
    float *delta = NULL;
    stria_status_t st;

    memset(&p, 0, sizeof(p));
    p.batch = d->B;
    p.q_tokens = d->T;
    p.kv_tokens = d->T;
    p.heads = d->H;
    p.kv_heads = d->Hkv;
    p.head_dim = d->D;
    p.scale = o->scale;
    p.causal = o->causal;
    p.pool = pool;
    stria_tensor_t tq = stria_tensor_contiguous(d->q, d->dtype, d->T, d->H, d->D);
    stria_tensor_t tk = stria_tensor_contiguous(d->k, d->dtype, d->T, d->Hkv, d->D);
    stria_tensor_t tv = stria_tensor_contiguous(d->v, d->dtype, d->T, d->Hkv, d->D);
    stria_tensor_t to = stria_tensor_contiguous(d->o, STRIA_DTYPE_F32, d->T, d->H, d->D);

    st = stria_attn_fwd(&p, &tq, &tk, &tv, &to, d->lse, false);
    if (st != STRIA_OK || d->d_o == NULL)
        return st;
    delta = stria_malloc_aligned((size_t)(d->B * d->H * d->T) * sizeof(float));
    if (delta == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate delta");
    stria_tensor_t tg = stria_tensor_contiguous(d->d_o, d->dtype, d->T, d->H, d->D);
    stria_tensor_t tdq = stria_tensor_contiguous(d->dq, STRIA_DTYPE_F32, d->T, d->H, d->D);
    stria_tensor_t tdk = stria_tensor_contiguous(d->dk, STRIA_DTYPE_F32, d->T, d->Hkv, d->D);
    stria_tensor_t tdv = stria_tensor_contiguous(d->dv, STRIA_DTYPE_F32, d->T, d->Hkv, d->D);
    st = stria_attn_bwd_delta(&p, &to, &tg, delta);
    if (st == STRIA_OK)
        st = stria_attn_bwd(&p, &tq, &tk, &tv, &tg, d->lse, delta, &tdq, &tdk, &tdv);
    stria_free(delta);
    return st;
}

/* The whole sequence over an in-process ring of o->ranks threads. */
static stria_status_t stria__compute_ring(const stria__run_opts_t *o, stria__run_data_t *d)
{
    stria_ring_shape_t shape;
    stria_ring_local_opts_t ro;
    stria_ring_local_io_t io;

    memset(&shape, 0, sizeof(shape));
    shape.batch = d->B;
    shape.seq = d->T;
    shape.heads = d->H;
    shape.kv_heads = d->Hkv;
    shape.head_dim = d->D;
    shape.scale = o->scale;
    shape.causal = o->causal;
    shape.dtype = d->dtype;
    memset(&ro, 0, sizeof(ro));
    ro.layout = o->layout_set ? o->layout : STRIA_LAYOUT_STRIPED;
    ro.n_ranks = o->ranks > 0 ? o->ranks : 1;
    ro.device = o->device;
    ro.passes = d->d_o ? STRIA_RING_PASS_FWD_BWD : STRIA_RING_PASS_FWD;
    int threads = o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    ro.threads_per_rank = threads / ro.n_ranks > 1 ? threads / ro.n_ranks : 1;
    memset(&io, 0, sizeof(io));
    io.q = d->q;
    io.k = d->k;
    io.v = d->v;
    io.o = d->o;
    io.o_dtype = STRIA_DTYPE_F32;
    io.lse = d->lse;
    io.d_o = d->d_o;
    io.dq = d->dq;
    io.dk = d->dk;
    io.dv = d->dv;
    io.grad_dtype = STRIA_DTYPE_F32;
    return stria_ring_run_local(&shape, &ro, &io, NULL);
}

/* Rounds fp32 values to the compute dtype in place (they stay fp32). */
static void stria__round_to(float *x, size_t n, stria_dtype_t dtype)
{
    if (dtype == STRIA_DTYPE_F32)
        return;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        stria_dtype_store(dtype, &h, 0, x[i]);
        x[i] = stria_dtype_load(dtype, &h, 0);
    }
}

static stria_status_t stria__write(const char *dir, const char *name, int ndim,
                                   const int64_t *shape, const float *data)
{
    char path[4096];
    if ((size_t)snprintf(path, sizeof(path), "%s/%s", dir, name) >= sizeof(path))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "output path too long");
    return stria_npy_write(path, STRIA_DTYPE_F32, ndim, shape, data);
}

static stria_status_t stria__write_outputs(const stria__run_opts_t *o, stria__run_data_t *d)
{
    int64_t qshape[4] = {d->B, d->T, d->H, d->D};
    int64_t kshape[4] = {d->B, d->T, d->Hkv, d->D};
    int64_t lshape[3] = {d->B, d->H, d->T};
    size_t nq = (size_t)(d->B * d->T * d->H * d->D);
    size_t nk = (size_t)(d->B * d->T * d->Hkv * d->D);
    stria_status_t st;

    if (mkdir(o->out_dir, 0777) != 0 && errno != EEXIST)
        return stria_error_set(STRIA_ERR_IO, "%s: cannot create output folder: %s", o->out_dir,
                               strerror(errno));
    stria__round_to(d->o, nq, d->dtype);
    st = stria__write(o->out_dir, "o.npy", 4, qshape, d->o);
    if (st == STRIA_OK)
        st = stria__write(o->out_dir, "lse.npy", 3, lshape, d->lse);
    if (st != STRIA_OK || d->dq == NULL)
        return st;
    stria__round_to(d->dq, nq, d->dtype);
    stria__round_to(d->dk, nk, d->dtype);
    stria__round_to(d->dv, nk, d->dtype);
    st = stria__write(o->out_dir, "dq.npy", 4, qshape, d->dq);
    if (st == STRIA_OK)
        st = stria__write(o->out_dir, "dk.npy", 4, kshape, d->dk);
    if (st == STRIA_OK)
        st = stria__write(o->out_dir, "dv.npy", 4, kshape, d->dv);
    return st;
}

static void stria__free_data(stria__run_data_t *d)
{
    stria_free(d->q);
    stria_free(d->k);
    stria_free(d->v);
    stria_free(d->d_o);
    stria_free(d->o);
    stria_free(d->lse);
    stria_free(d->dq);
    stria_free(d->dk);
    stria_free(d->dv);
}

static int stria__cmd_local(int argc, char **argv)
{
    stria__run_opts_t o;
    stria__run_data_t d;
    stria_pool_t *pool = NULL;
    stria_status_t st;
    double t0, t1;
    int rc = stria__parse_opts(argc, argv, false, &o);

    if (rc != 0)
        return rc;
    memset(&d, 0, sizeof(d));
    st = stria__load_inputs(&o, &d);
    if (st == STRIA_OK)
        st = stria__alloc_outputs(&d, o.do_path != NULL);
    if (st == STRIA_OK)
        st = stria_pool_create(o.threads, &pool);
    t0 = stria_time_now();
    if (st == STRIA_OK)
        st = o.ranks > 0 || o.device != NULL ? stria__compute_ring(&o, &d)
                                             : stria__compute_local(&o, &d, pool);
    t1 = stria_time_now();
    if (st == STRIA_OK)
        st = stria__write_outputs(&o, &d);
    if (st == STRIA_OK && !o.quiet) {
        double flops = 4.0 * (double)d.B * (double)d.H * (double)d.T * (double)d.T * (double)d.D;
        if (o.causal)
            flops *= 0.5;
        if (o.do_path)
            flops *= 3.5; /* forward + backward (2.5x forward) */
        printf("stria-run local: batch=%lld tokens=%lld heads=%lld kv_heads=%lld head_dim=%lld "
               "dtype=%s %s%s\n",
               (long long)d.B, (long long)d.T, (long long)d.H, (long long)d.Hkv, (long long)d.D,
               stria_dtype_name(d.dtype), o.causal ? "causal" : "non-causal",
               o.do_path ? " forward+backward" : " forward");
        printf("  kernel %s, %d threads: %.3f s, %.1f GFLOP/s; outputs in %s/\n",
               stria_kernels_variant(), stria_pool_size(pool), t1 - t0, flops / (t1 - t0) * 1e-9,
               o.out_dir);
    }
    stria_pool_destroy(pool);
    stria__free_data(&d);
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-run: %s\n",
                stria_error_msg()[0] ? stria_error_msg() : stria_status_str(st));
        return 1;
    }
    return 0;
}

/* ---- stria-run submit ----------------------------------------------------- */

typedef struct {
    bool tty;
    stria_phase_t last_phase;
    double last_draw;
} stria__progress_t;

static void stria__progress(void *arg, stria_phase_t phase, double done, double total)
{
    static const char *const names[] = {"queued", "upload", "forward", "backward", "download"};
    stria__progress_t *p = arg;
    double now = stria_time_now();
    if (!p->tty || (phase == p->last_phase && now - p->last_draw < 0.1))
        return;
    p->last_phase = phase;
    p->last_draw = now;
    if (phase == STRIA_PHASE_QUEUED) {
        fprintf(stderr, "\r\033[K  queued: position %.0f", done);
        return;
    }
    double frac = total > 0 ? done / total : 0.0;
    frac = frac < 0 ? 0 : frac > 1 ? 1 : frac;
    char bar[33];
    int filled = (int)(frac * 32);
    for (int i = 0; i < 32; i++)
        bar[i] = i < filled ? '#' : '.';
    bar[32] = '\0';
    if (phase == STRIA_PHASE_FORWARD || phase == STRIA_PHASE_BACKWARD)
        fprintf(stderr, "\r\033[K  %-8s [%s] step %.0f/%.0f", names[phase], bar, done, total);
    else
        fprintf(stderr, "\r\033[K  %-8s [%s] %.1f/%.1f MiB", names[phase], bar, done / 1048576.0,
                total / 1048576.0);
}

static void stria__progress_end(stria__progress_t *p)
{
    if (p->tty)
        fprintf(stderr, "\r\033[K");
}

/* Converts a buffer of the compute dtype to fp32. */
static void stria__widen(stria_dtype_t dtype, const void *src, float *dst, size_t n)
{
    stria_dtype_convert(dtype, src, STRIA_DTYPE_F32, dst, n);
}

/* Max |a - b| after rounding both to dtype; the tolerance scales with the
 * dtype's precision and the values' size. */
static bool stria__compare(const char *name, const float *a, const float *b, size_t n,
                           stria_dtype_t dtype, bool quiet)
{
    double err = 0, mag = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        float x = a[i], y = b[i];
        if (dtype != STRIA_DTYPE_F32) {
            stria_dtype_store(dtype, &h, 0, y);
            y = stria_dtype_load(dtype, &h, 0);
        }
        if (isinf(x) && isinf(y) && x == y)
            continue;
        double e = fabs((double)x - (double)y);
        if (!(e <= err))
            err = isnan(e) ? INFINITY : e > err ? e : err;
        if (isfinite(y) && fabs((double)y) > mag)
            mag = fabs((double)y);
    }
    double eps = dtype == STRIA_DTYPE_F32 ? 1e-5 : dtype == STRIA_DTYPE_BF16 ? 1.6e-2 : 2e-3;
    double tol = eps * (1.0 + mag);
    bool ok = err <= tol;
    if (!quiet || !ok)
        printf("  check %-4s max |service - local| = %.3g (tolerance %.3g) %s\n", name, err, tol,
               ok ? "ok" : "FAILED");
    return ok;
}

static int stria__cmd_submit(int argc, char **argv)
{
    stria__run_opts_t o;
    stria__run_data_t d;
    stria_client_t *client = NULL;
    stria_job_t *job = NULL;
    stria_call_stats_t fs = STRIA_CALL_STATS_INIT, bs = STRIA_CALL_STATS_INIT;
    char *token = NULL;
    stria_status_t st;
    int rc = stria__parse_opts(argc, argv, true, &o);
    stria__progress_t prog = {isatty(2) != 0, (stria_phase_t)-1, 0};
    double t_fwd = 0, t_bwd = 0;

    if (rc != 0)
        return rc;
    memset(&d, 0, sizeof(d));
    memset(&bs, 0, sizeof(bs));
    st = stria__load_inputs(&o, &d);
    if (st == STRIA_OK)
        st = stria__alloc_outputs(&d, o.do_path != NULL);
    if (st == STRIA_OK && o.token_file != NULL && o.token_file[0] != '\0') {
        FILE *f = fopen(o.token_file, "r");
        char line[4200];
        if (f == NULL || fgets(line, sizeof(line), f) == NULL) {
            st = stria_error_set(STRIA_ERR_IO, "%s: cannot read the token: %s", o.token_file,
                                 f ? "empty file" : strerror(errno));
        } else {
            line[strcspn(line, "\r\n")] = '\0';
            token = strdup(line);
        }
        if (f)
            fclose(f);
    }
    stria_client_params_t cp;
    memset(&cp, 0, sizeof(cp));
    cp.struct_size = sizeof(cp);
    cp.coordinator = o.coordinator;
    cp.token = token;
    cp.client_name = "stria-run";
    if (st == STRIA_OK)
        st = stria_client_connect(&cp, &client);

    size_t nq = (size_t)(d.B * d.T * d.H * d.D), nk = (size_t)(d.B * d.T * d.Hkv * d.D);
    size_t es = stria_dtype_size(d.dtype);
    void *o_s = NULL, *dq_s = NULL, *dk_s = NULL, *dv_s = NULL;
    if (st == STRIA_OK) {
        o_s = stria_malloc_aligned(nq * es);
        if (o.do_path) {
            dq_s = stria_malloc_aligned(nq * es);
            dk_s = stria_malloc_aligned(nk * es);
            dv_s = stria_malloc_aligned(nk * es);
        }
        if (o_s == NULL || (o.do_path && (dq_s == NULL || dk_s == NULL || dv_s == NULL)))
            st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate outputs");
    }
    stria_job_spec_t spec;
    memset(&spec, 0, sizeof(spec));
    spec.struct_size = sizeof(spec);
    spec.batch = d.B;
    spec.seq_len = d.T;
    spec.heads = d.H;
    spec.kv_heads = d.Hkv;
    spec.head_dim = d.D;
    spec.dtype = d.dtype;
    spec.causal = o.causal;
    spec.layout = o.layout_set ? o.layout : STRIA_LAYOUT_STRIPED;
    spec.ring_size = o.ranks;
    spec.scale = o.scale;
    spec.step_timeout_s = o.step_timeout_s;
    spec.label = o.label;
    if (st == STRIA_OK) {
        double t0 = stria_time_now();
        st = stria_client_forward(client, &spec, d.q, d.k, d.v, o_s, d.lse, stria__progress, &prog,
                                  &fs, &job);
        t_fwd = stria_time_now() - t0;
        stria__progress_end(&prog);
    }
    if (st == STRIA_OK && o.do_path) {
        double t0 = stria_time_now();
        st = stria_client_backward(job, d.d_o, dq_s, dk_s, dv_s, stria__progress, &prog, &bs);
        t_bwd = stria_time_now() - t0;
        stria__progress_end(&prog);
    }
    uint64_t job_id = stria_job_id(job);
    int ring = stria_job_ring_size(job);
    if (job != NULL) {
        stria_status_t rst = stria_client_release(job);
        if (st == STRIA_OK && rst != STRIA_OK)
            st = rst;
    }
    if (st == STRIA_OK) {
        stria__widen(d.dtype, o_s, d.o, nq);
        if (o.do_path) {
            stria__widen(d.dtype, dq_s, d.dq, nq);
            stria__widen(d.dtype, dk_s, d.dk, nk);
            stria__widen(d.dtype, dv_s, d.dv, nk);
        }
        st = stria__write_outputs(&o, &d);
    }
    if (st == STRIA_OK && !o.quiet) {
        double flops = 4.0 * (double)d.B * (double)d.H * (double)d.T * (double)d.T * (double)d.D;
        if (o.causal)
            flops *= 0.5;
        printf("stria-run submit: job %llu on %d workers, batch=%lld tokens=%lld heads=%lld "
               "kv_heads=%lld head_dim=%lld dtype=%s %s %s\n",
               (unsigned long long)job_id, ring, (long long)d.B, (long long)d.T, (long long)d.H,
               (long long)d.Hkv, (long long)d.D, stria_dtype_name(d.dtype),
               o.causal ? "causal" : "non-causal",
               stria_layout_kind_name(o.layout_set ? o.layout : STRIA_LAYOUT_STRIPED));
        printf("  forward:  %.3f s (queue %.3f, upload %.3f, pass %.3f, download %.3f), "
               "%.1f GFLOP/s in the pass\n",
               t_fwd, fs.queued_s, fs.upload_s, fs.pass_s, fs.download_s, flops / fs.pass_s * 1e-9);
        printf("            rank kernel time %.3f..%.3f s (balance %.2f), longest ring wait "
               "%.3f s\n",
               fs.rank_compute_s_min, fs.rank_compute_s_max,
               fs.rank_compute_s_max > 0 ? fs.rank_compute_s_min / fs.rank_compute_s_max : 1.0,
               fs.rank_wait_s_max);
        if (o.do_path)
            printf("  backward: %.3f s (upload %.3f, pass %.3f, download %.3f), %.1f GFLOP/s in "
                   "the pass; rank kernel time %.3f..%.3f s\n",
                   t_bwd, bs.upload_s, bs.pass_s, bs.download_s, 2.5 * flops / bs.pass_s * 1e-9,
                   bs.rank_compute_s_min, bs.rank_compute_s_max);
        printf("  outputs in %s/\n", o.out_dir);
    }
    if (st == STRIA_OK && o.check) {
        stria__run_data_t l = d;
        stria_pool_t *pool = NULL;
        l.o = l.lse = l.dq = l.dk = l.dv = NULL;
        st = stria__alloc_outputs(&l, o.do_path != NULL);
        if (st == STRIA_OK)
            st = stria_pool_create(o.threads, &pool);
        if (st == STRIA_OK)
            st = stria__compute_local(&o, &l, pool);
        if (st == STRIA_OK) {
            bool ok = stria__compare("O", d.o, l.o, nq, d.dtype, o.quiet);
            ok &= stria__compare("LSE", d.lse, l.lse, (size_t)(d.B * d.H * d.T), STRIA_DTYPE_F32,
                                 o.quiet);
            if (o.do_path) {
                ok &= stria__compare("dQ", d.dq, l.dq, nq, d.dtype, o.quiet);
                ok &= stria__compare("dK", d.dk, l.dk, nk, d.dtype, o.quiet);
                ok &= stria__compare("dV", d.dv, l.dv, nk, d.dtype, o.quiet);
            }
            if (!ok)
                st = stria_error_set(STRIA_ERR_INTERNAL,
                                     "--check: the service's results differ from the "
                                     "in-process computation");
            else if (!o.quiet)
                printf("  check: the service's results match the in-process computation\n");
        }
        stria_pool_destroy(pool);
        stria_free(l.o);
        stria_free(l.lse);
        stria_free(l.dq);
        stria_free(l.dk);
        stria_free(l.dv);
    }
    stria_free(o_s);
    stria_free(dq_s);
    stria_free(dk_s);
    stria_free(dv_s);
    stria_client_close(client);
    free(token);
    stria__free_data(&d);
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-run: %s\n",
                stria_error_msg()[0] ? stria_error_msg() : stria_status_str(st));
        return 1;
    }
    return 0;
}

/* stria-run random: writes a reproducible random .npy array. */
static int stria__cmd_random(int argc, char **argv)
{
    int64_t shape[STRIA_NPY_MAX_DIMS];
    int ndim = 0;
    const char *out = NULL, *shape_arg = NULL;
    uint64_t seed = 1;
    float amp = 1.0f;
    bool f16 = false;
    char *end;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            printf("usage: stria-run random --shape B,T,H,D --out FILE.npy [--seed N] "
                   "[--amplitude A] [--float16]\n"
                   "Writes uniform random values in [-A, A) (default A = 1) as float32 (or\n"
                   "float16) .npy, reproducible for a given seed (default 1).\n");
            return 0;
        }
        if (val == NULL)
            return stria__usage_error("option %s needs a value (or is unknown)", a);
        if (strcmp(a, "--shape") == 0) {
            shape_arg = val;
        } else if (strcmp(a, "--out") == 0) {
            out = val;
        } else if (strcmp(a, "--seed") == 0) {
            errno = 0;
            seed = strtoull(val, &end, 10);
            if (errno != 0 || end == val || *end != '\0')
                return stria__usage_error("--seed '%s': expected a non-negative integer", val);
        } else if (strcmp(a, "--amplitude") == 0) {
            amp = strtof(val, &end);
            if (end == val || *end != '\0' || !(amp > 0.0f) || isinf(amp))
                return stria__usage_error("--amplitude '%s': expected a finite number > 0", val);
        } else if (strcmp(a, "--float16") == 0) {
            f16 = true;
            continue;
        } else {
            return stria__usage_error("unknown option '%s'", a);
        }
        i++;
    }
    if (shape_arg == NULL || out == NULL)
        return stria__usage_error("%s", "--shape and --out are required");
    for (const char *p = shape_arg; *p != '\0';) {
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno != 0 || v < 1 || v > ((int64_t)1 << 32) ||
            ndim == STRIA_NPY_MAX_DIMS || (*end != ',' && *end != '\0'))
            return stria__usage_error("--shape '%s': expected up to 8 comma-separated sizes >= 1",
                                      shape_arg);
        shape[ndim++] = v;
        p = *end == ',' ? end + 1 : end;
    }
    size_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (__builtin_mul_overflow(n, (size_t)shape[i], &n) || n > ((size_t)1 << 34))
            return stria__usage_error("--shape '%s': too many elements", shape_arg);
    }
    float *data = stria_malloc_aligned(n * sizeof(float));
    if (data == NULL) {
        fprintf(stderr, "stria-run: cannot allocate %zu elements\n", n);
        return 1;
    }
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data[i] = ((float)(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * amp;
    }
    stria_status_t st;
    if (f16) {
        uint16_t *h = stria_malloc_aligned(n * sizeof(uint16_t));
        if (h == NULL) {
            stria_free(data);
            fprintf(stderr, "stria-run: cannot allocate %zu elements\n", n);
            return 1;
        }
        stria_dtype_convert(STRIA_DTYPE_F32, data, STRIA_DTYPE_F16, h, n);
        st = stria_npy_write(out, STRIA_DTYPE_F16, ndim, shape, h);
        stria_free(h);
    } else {
        st = stria_npy_write(out, STRIA_DTYPE_F32, ndim, shape, data);
    }
    stria_free(data);
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-run: %s\n", stria_error_msg());
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        stria__run_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "local") == 0)
        return stria__cmd_local(argc - 1, argv + 1);
    if (strcmp(argv[1], "random") == 0)
        return stria__cmd_random(argc - 1, argv + 1);
    if (strcmp(argv[1], "submit") == 0)
        return stria__cmd_submit(argc - 1, argv + 1);
    fprintf(stderr, "stria-run: unknown command '%s' (expected: local, submit, random)\n", argv[1]);
    return 2;
}
