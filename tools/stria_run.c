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
    double scale;    /* 0: 1/sqrt(head_dim) */
    int64_t threads; /* 0: all online CPUs */
    bool quiet;
    /* local ring / service */
    int64_t ranks;      /* 0: no ring (local), all workers (submit) */
    const char *device; /* local: the ranks' device; NULL: the host */
    stria_layout_kind_t layout;
    /* documents and window (--cu-seqlens, --window LEFT,RIGHT) */
    stria_int_list_t cu_seqlens, window;
    /* submit */
    bool submit;
    const char *coordinator;
    const char *token_file;
    double step_timeout_s;
    bool check;
    const char *label;
    stria_data_path_t path;
    int64_t retries;       /* of a forward that failed retryably */
    int64_t session_calls; /* the same calls again on a session, this many times */
    int64_t head_groups;   /* that session's head groups (0, 1: one ring) */
    int group_rings;       /* where their rings lie (stria_group_rings_t) */
    /* random */
    stria_int_list_t shape;
    int64_t seed;
    double amplitude;
    bool float16;
} stria__run_opts_t;

/* Inputs converted to the compute dtype, and outputs in fp32. */
typedef struct {
    int64_t B, T, H, Hkv, D;
    stria_dtype_t dtype;
    void *q, *k, *v, *d_o; /* storage dtype, contiguous */
    float *o, *lse, *dq, *dk, *dv;
} stria__run_data_t;

static stria_status_t stria__parse_dtype(const char *text, void *dst)
{
    return stria_dtype_parse(text, dst);
}

static stria_status_t stria__parse_layout(const char *text, void *dst)
{
    return stria_layout_kind_parse(text, dst);
}

/* --path: auto, tcp or shm. */
static stria_status_t stria__parse_path(const char *text, void *dst)
{
    static const char *const names[] = {"auto", "tcp", "shm"};
    for (int i = 0; i < 3; i++)
        if (strcmp(text, names[i]) == 0) {
            *(stria_data_path_t *)dst = (stria_data_path_t)i;
            return STRIA_OK;
        }
    return stria_error_set(STRIA_ERR_INVALID_ARG, "unknown path '%s' (expected auto, tcp or shm)",
                           text);
}

/* --head-group-rings: inside or across. */
static stria_status_t stria__parse_group_rings(const char *text, void *dst)
{
    if (strcmp(text, "inside") == 0 || strcmp(text, "across") == 0) {
        *(int *)dst =
            strcmp(text, "inside") == 0 ? STRIA_GROUP_RINGS_INSIDE : STRIA_GROUP_RINGS_ACROSS;
        return STRIA_OK;
    }
    return stria_error_set(STRIA_ERR_INVALID_ARG,
                           "unknown head group rings '%s' (expected inside or across)", text);
}

/* A device name that stria_device_open() accepts on this machine. */
static stria_status_t stria__parse_device(const char *text, void *dst)
{
    stria_device_t *dev = NULL;
    stria_status_t st = stria_device_open(text, NULL, &dev);
    stria_device_close(dev);
    if (st == STRIA_OK)
        *(const char **)dst = text;
    return st;
}

static const char stria__run_description[] =
    "Runs exact attention on .npy inputs: in this process (local), through the\n"
    "service (submit), or writes reproducible random inputs (random). Inputs are\n"
    "[batch, tokens, heads, head_dim] (K and V with kv_heads); outputs are float32 .npy.";

static const char stria__run_epilog[] =
    "Example:\n"
    "  stria-run random --shape 1,2048,8,64 --seed 1 --out q.npy   (and k, v)\n"
    "  stria-run local --q q.npy --k k.npy --v v.npy --dtype bf16 --out out\n"
    "  stria-run submit --coordinator 127.0.0.1:7400 --q q.npy --k k.npy --v v.npy --check \\\n"
    "      --out out\n"
    "Environment: STRIA_KERNEL=portable|avx2|avx512-nobf16|avx512 forces a CPU kernel variant;\n"
    "STRIA_LOG_LEVEL=error|warn|info|debug; STRIA_TOKEN_FILE is the default of\n"
    "submit's --token-file.\n"
    "Exit status: 0 success, 1 computation, service or file error, 2 usage error.";

/* The most --cu-seqlens entries (the coordinator's limit). */
#define STRIA__RUN_MAX_CU_SEQLENS 65536

/* The options local and submit share, in the order --help lists them. */
#define STRIA__RUN_N_COMMON 15
static void stria__run_common_opts(stria__run_opts_t *o, stria_option_t *t)
{
    const stria_option_t common[STRIA__RUN_N_COMMON] = {
        STRIA_OPTION("q", STRING, &o->q_path, "PATH",
                     "queries, [batch, tokens, heads, head_dim], float32 or float16 .npy",
                     .flags = STRIA_OPT_REQUIRED),
        STRIA_OPTION("k", STRING, &o->k_path, "PATH",
                     "keys, [batch, tokens, kv_heads, head_dim]; heads must be a multiple of "
                     "kv_heads (grouped-query attention)",
                     .flags = STRIA_OPT_REQUIRED),
        STRIA_OPTION("v", STRING, &o->v_path, "PATH", "values, same shape as --k",
                     .flags = STRIA_OPT_REQUIRED),
        STRIA_OPTION("do", STRING, &o->do_path, "PATH",
                     "output gradient, same shape as --q: also runs the backward pass"),
        STRIA_OPTION(
            "out", STRING, &o->out_dir, "DIR",
            "output folder (required; created if missing): o.npy (Q's shape), lse.npy ([batch, "
            "heads, tokens], natural log), and with --do dq.npy, dk.npy, dv.npy; all float32, "
            "holding the values in the computed precision (rounded to --dtype)"),
        STRIA_OPTION("causal", FLAG, &o->causal, NULL,
                     "causal mask: token i sees tokens <= i (the default)"),
        STRIA_OPTION("no-causal", UNFLAG, &o->causal, NULL, "no mask"),
        STRIA_OPTION("dtype", CUSTOM, &o->dtype, "fp32|bf16|fp16",
                     "storage dtype to compute in (inputs are converted on load; default: the "
                     "dtype of the Q file; arithmetic accumulates in fp32 always)",
                     .parse = stria__parse_dtype),
        STRIA_OPTION("scale", DOUBLE, &o->scale, "X", "softmax scale (default 1/sqrt(head_dim))",
                     .min = 0, .max = 3.4e38, .flags = STRIA_OPT_ABOVE_MIN),
        STRIA_OPTION("threads", INT, &o->threads, "N", "compute threads (default: all online CPUs)",
                     .min = 1, .max = 1024),
        STRIA_OPTION("quiet", FLAG, &o->quiet, NULL, "print nothing on success"),
        STRIA_OPTION("ranks", INT, &o->ranks, "N",
                     "ranks of the ring: local runs an in-process ring of N ranks (default: no "
                     "ring, or 1 with --device); submit asks for N workers (default: all)",
                     .min = 1, .max = 256),
        STRIA_OPTION("layout", CUSTOM, &o->layout, "auto|striped|contiguous|zigzag|packed",
                     "how the tokens are spread over the ranks (default auto: contiguous with "
                     "--window; packed with --cu-seqlens on host memory, documents placed by "
                     "their work where that balances; striped otherwise)",
                     .parse = stria__parse_layout),
        STRIA_OPTION("cu-seqlens", INTS, &o->cu_seqlens, "0,N1,...,TOKENS",
                     "documents (flash_attn varlen's cu_seqlens) of every batch row: a token sees "
                     "only tokens of its own document; starts at 0, never decreases, ends at the "
                     "token count (default: one document)",
                     .min = 0, .max = (double)((int64_t)1 << 62),
                     .max_items = STRIA__RUN_MAX_CU_SEQLENS),
        STRIA_OPTION("window", INTS, &o->window, "LEFT,RIGHT",
                     "sliding window: token i sees tokens i - LEFT .. i + RIGHT; -1 leaves a side "
                     "unbounded; causal takes RIGHT 0 or -1 (default: no window)",
                     .min = -1, .max = (double)((int64_t)1 << 62), .max_items = 2),
    };
    memcpy(t, common, sizeof(common));
}

/* Checks --cu-seqlens and --window (and, with tokens >= 0, that the
 * documents end at the token count): -1 when fine, else 2 after a usage
 * error on stderr. */
static int stria__run_check_masks(const stria__run_opts_t *o, const char *cmd, int64_t tokens)
{
    const stria_int_list_t *cu = &o->cu_seqlens, *w = &o->window;
    char msg[200] = "";
    if (cu->n > 0 && cu->v[0] != 0)
        snprintf(msg, sizeof(msg), "--cu-seqlens must start at 0 (got %lld)", (long long)cu->v[0]);
    for (size_t i = 1; i < cu->n && msg[0] == '\0'; i++)
        if (cu->v[i] < cu->v[i - 1])
            snprintf(msg, sizeof(msg),
                     "--cu-seqlens must not decrease (item %zu is %lld after %lld)", i + 1,
                     (long long)cu->v[i], (long long)cu->v[i - 1]);
    if (msg[0] == '\0' && tokens >= 0 && cu->n > 0 && cu->v[cu->n - 1] != tokens)
        snprintf(msg, sizeof(msg),
                 "--cu-seqlens must end at the token count of the inputs (%lld) (got %lld)",
                 (long long)tokens, (long long)cu->v[cu->n - 1]);
    if (msg[0] == '\0' && w->n == 1)
        snprintf(msg, sizeof(msg), "--window takes two values, LEFT,RIGHT (got one)");
    if (msg[0] == '\0' && w->n == 2 && o->causal && w->v[1] > 0)
        snprintf(msg, sizeof(msg),
                 "--window: RIGHT must be 0 or -1 with causal attention (got %lld; see "
                 "--no-causal)",
                 (long long)w->v[1]);
    if (msg[0] == '\0')
        return -1;
    fprintf(stderr, "stria-run: %s\n(see stria-run %s --help)\n", msg, cmd);
    return 2;
}

/* Parses stria-run's command line into *o; returns -1 to go on with
 * cli->cmd, else the exit status (help printed, or a usage error). */
static int stria__run_parse(int argc, char **argv, stria__run_opts_t *o, stria_cli_t *cli)
{
    stria_option_t local[STRIA__RUN_N_COMMON + 2], submit[STRIA__RUN_N_COMMON + 11];
    const stria_option_t local_only[] = {
        STRIA_OPTION("device", CUSTOM, &o->device, "NAME",
                     "where the ring's ranks compute: cpu (default), cuda:N (cuda = cuda:0), "
                     "cpu:staged (host kernels through the GPU staging path) or auto; runs an "
                     "in-process ring (--ranks, default 1)",
                     .parse = stria__parse_device),
        {.name = NULL},
    };
    const stria_option_t submit_only[] = {
        STRIA_OPTION("coordinator", ADDR, &o->coordinator, "HOST:PORT", "the service's coordinator",
                     .flags = STRIA_OPT_REQUIRED),
        STRIA_OPTION("token-file", STRING, &o->token_file, "FILE",
                     "the service's client credential, first line of FILE (proven, never sent; "
                     "default $STRIA_TOKEN_FILE)"),
        STRIA_OPTION("step-timeout", DURATION, &o->step_timeout_s, "TIME",
                     "deadline of one ring step on the workers (default: theirs)", .min = 0,
                     .max = 86400, .flags = STRIA_OPT_ABOVE_MIN),
        STRIA_OPTION("check", FLAG, &o->check, NULL,
                     "also compute in this process and compare: exit status 1 when the service's "
                     "results differ beyond the dtype's tolerance"),
        STRIA_OPTION("label", STRING, &o->label, "TEXT",
                     "a label the admin tools show with the job"),
        STRIA_OPTION("retries", INT, &o->retries, "N",
                     "submit the forward again up to N times when it fails retryably (a worker "
                     "died, left or was cut off; a ring link broke), without the workers blamed",
                     .dflt = "2", .min = 0, .max = 16),
        STRIA_OPTION("session-calls", INT, &o->session_calls, "N",
                     "then run the same forward (and backward) N times on a session, the ring "
                     "opened once, and print the per-call times beside the job's and whether "
                     "the results have the job's bits",
                     .dflt = "0", .min = 0, .max = 1000000),
        STRIA_OPTION("head-groups", INT, &o->head_groups, "G",
                     "that session as G rings of ring/G workers, each over heads/G (head "
                     "parallelism: each call's upload sends a group's heads to its ring); its "
                     "results are then held to the dtype's tolerance, not the job's bits (each "
                     "ring is shorter)",
                     .dflt = "1", .min = 1, .max = 64),
        STRIA_OPTION("head-group-rings", CUSTOM, &o->group_rings, "inside|across",
                     "where those rings lie: inside hosts (ring g on the next ring/G workers of "
                     "the coordinator's host-ordered ring; the default) or across them (ring "
                     "rank j of every ring on host j)",
                     .dflt = "inside", .parse = stria__parse_group_rings),
        STRIA_OPTION("path", CUSTOM, &o->path, "auto|tcp|shm",
                     "how tensors reach the workers: shared memory with a worker of this host, TCP "
                     "otherwise (auto, the default), only TCP, or only shared memory",
                     .parse = stria__parse_path),
        {.name = NULL},
    };
    const stria_option_t random[] = {
        STRIA_OPTION("shape", INTS, &o->shape, "B,T,H,D",
                     "the array's shape: up to 8 comma-separated sizes", .min = 1,
                     .max = (double)((int64_t)1 << 32), .flags = STRIA_OPT_REQUIRED,
                     .max_items = STRIA_NPY_MAX_DIMS),
        STRIA_OPTION("out", STRING, &o->out_dir, "FILE.npy", "the file to write",
                     .flags = STRIA_OPT_REQUIRED),
        STRIA_OPTION("seed", INT, &o->seed, "N", "the same seed writes the same values",
                     .dflt = "1", .min = 0, .max = 9e18),
        STRIA_OPTION("amplitude", DOUBLE, &o->amplitude, "A", "values are uniform in [-A, A)",
                     .dflt = "1", .min = 0, .max = 3.4e38, .flags = STRIA_OPT_ABOVE_MIN),
        STRIA_OPTION("float16", FLAG, &o->float16, NULL, "write float16 (default float32)"),
        {.name = NULL},
    };
    const stria_command_t cmds[] = {
        {.name = "local",
         .summary = "exact attention in this process (or an in-process ring)",
         .description = "Computes exact attention in this process: over the whole sequence, or "
                        "over an\nin-process ring with --ranks or --device.",
         .options = local},
        {.name = "submit",
         .summary = "the same through the service: a coordinator and workers",
         .description = "Runs the job through the service: the coordinator assigns workers, "
                        "the inputs\ngo to them and the outputs come back. Prints the job's "
                        "timings; --check compares\nwith the in-process result.",
         .options = submit},
        {.name = "random",
         .summary = "writes reproducible random inputs",
         .description = "Writes uniform random values in [-A, A) as float32 (or float16) .npy, "
                        "the same\nfor the same seed.",
         .options = random},
        {.name = NULL},
    };
    const stria_command_t root = {.name = "stria-run",
                                  .description = stria__run_description,
                                  .epilog = stria__run_epilog,
                                  .commands = cmds};

    memset(o, 0, sizeof(*o));
    o->causal = true;
    o->layout = STRIA_LAYOUT_AUTO;
    o->token_file = getenv("STRIA_TOKEN_FILE");
    stria__run_common_opts(o, local);
    memcpy(local + STRIA__RUN_N_COMMON, local_only, sizeof(local_only));
    stria__run_common_opts(o, submit);
    memcpy(submit + STRIA__RUN_N_COMMON, submit_only, sizeof(submit_only));
    int rc = stria_cli_main(&root, argc, argv, cli);
    if (rc >= 0)
        return rc;
    o->submit = strcmp(cli->cmd->name, "submit") == 0;
    o->dtype_set = stria_cli_given(cli, "dtype");
    if (strcmp(cli->cmd->name, "random") != 0 && o->out_dir == NULL) {
        fprintf(stderr, "stria-run: --out DIR is required\n(see stria-run %s --help)\n",
                cli->cmd->name);
        return 2;
    }
    return stria__run_check_masks(o, cli->cmd->name, -1);
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

/* The whole problem of a local run: its data's dimensions, the options'
 * scale, causality, documents and window. */
static stria_ring_shape_t stria__run_shape(const stria__run_opts_t *o, const stria__run_data_t *d)
{
    bool win = o->window.n == 2;
    return (stria_ring_shape_t){.call = {.batch = d->B,
                                         .seq_len = d->T,
                                         .causal = o->causal,
                                         .scale = o->scale,
                                         .cu_seqlens = o->cu_seqlens.v,
                                         .n_cu_seqlens = o->cu_seqlens.n,
                                         .has_window = win,
                                         .window_left = win ? o->window.v[0] : 0,
                                         .window_right = win ? o->window.v[1] : 0},
                                .heads = d->H,
                                .kv_heads = d->Hkv,
                                .head_dim = d->D,
                                .dtype = d->dtype};
}

/* Single-process attention over the whole sequence. */
static stria_status_t stria__compute_local(const stria__run_opts_t *o, stria__run_data_t *d,
                                           stria_pool_t *pool)
{
    stria_ring_shape_t shape = stria__run_shape(o, d);
    stria_attn_params_t p = stria_ring_shape_attn_params(&shape);
    float *delta = NULL;
    stria_status_t st;

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
    stria_ring_shape_t shape = stria__run_shape(o, d);
    stria_ring_local_opts_t ro;
    stria_ring_local_io_t io;

    memset(&ro, 0, sizeof(ro));
    ro.layout = stria_layout_kind_resolve(o->layout, shape.call.has_window,
                                          shape.call.n_cu_seqlens > 2 && o->device == NULL);
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
    STRIA_FREE_ALL(d->q, d->k, d->v, d->d_o, d->o, d->lse, d->dq, d->dk, d->dv);
}

static int stria__cmd_local(const stria__run_opts_t *opts)
{
    const stria__run_opts_t o = *opts;
    stria__run_data_t d;
    stria_pool_t *pool = NULL;
    stria_status_t st;
    double t0, t1;

    memset(&d, 0, sizeof(d));
    st = stria__load_inputs(&o, &d);
    if (st == STRIA_OK && stria__run_check_masks(&o, "local", d.T) >= 0) {
        stria__free_data(&d);
        return 2;
    }
    if (st == STRIA_OK)
        st = stria__alloc_outputs(&d, o.do_path != NULL);
    if (st == STRIA_OK)
        st = stria_pool_create((int)o.threads, &pool);
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
    return stria_cli_exit("stria-run", st);
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

/* The outputs as the service returns them, in the job's dtype. */
typedef struct {
    size_t nq, nk;
    void *o, *dq, *dk, *dv;
} stria__submit_out_t;

static stria_status_t stria__submit_alloc(const stria__run_data_t *d, bool backward,
                                          stria__submit_out_t *s)
{
    size_t es = stria_dtype_size(d->dtype);
    s->nq = (size_t)(d->B * d->T * d->H * d->D);
    s->nk = (size_t)(d->B * d->T * d->Hkv * d->D);
    s->o = stria_malloc_aligned(s->nq * es);
    if (backward) {
        s->dq = stria_malloc_aligned(s->nq * es);
        s->dk = stria_malloc_aligned(s->nk * es);
        s->dv = stria_malloc_aligned(s->nk * es);
    }
    if (s->o == NULL || (backward && (s->dq == NULL || s->dk == NULL || s->dv == NULL)))
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate outputs");
    return STRIA_OK;
}

static void stria__submit_free(stria__submit_out_t *s)
{
    STRIA_FREE_ALL(s->o, s->dq, s->dk, s->dv);
}

static void stria__submit_spec(const stria__run_opts_t *o, const stria__run_data_t *d,
                               stria_job_spec_t *spec)
{
    bool window = o->window.n == 2;
    *spec = (stria_job_spec_t){.struct_size = sizeof(*spec),
                               .batch = d->B,
                               .seq_len = d->T,
                               .heads = d->H,
                               .kv_heads = d->Hkv,
                               .head_dim = d->D,
                               .dtype = d->dtype,
                               .causal = o->causal,
                               .layout = o->layout,
                               .ring_size = (int)o->ranks,
                               .scale = (float)o->scale,
                               .step_timeout_s = o->step_timeout_s,
                               .label = o->label,
                               .cu_seqlens = o->cu_seqlens.v,
                               .n_cu_seqlens = o->cu_seqlens.n,
                               .has_window = window,
                               .window_left = window ? o->window.v[0] : 0,
                               .window_right = window ? o->window.v[1] : 0};
}

/* What a submitted job did. */
typedef struct {
    uint64_t job_id;
    int ring;
    stria_layout_kind_t layout; /* as assigned (auto resolved) */
    double t_fwd, t_bwd;
    stria_call_stats_t fs, bs;
} stria__submit_stats_t;

static void stria__submit_report(const stria__run_opts_t *o, const stria__run_data_t *d,
                                 const stria__submit_stats_t *r)
{
    const stria_call_stats_t *fs = &r->fs, *bs = &r->bs;
    double flops = 4.0 * (double)d->B * (double)d->H * (double)d->T * (double)d->T * (double)d->D;
    if (o->causal)
        flops *= 0.5;
    printf("stria-run submit: job %llu on %d workers, batch=%lld tokens=%lld heads=%lld "
           "kv_heads=%lld head_dim=%lld dtype=%s %s %s\n",
           (unsigned long long)r->job_id, r->ring, (long long)d->B, (long long)d->T,
           (long long)d->H, (long long)d->Hkv, (long long)d->D, stria_dtype_name(d->dtype),
           o->causal ? "causal" : "non-causal", stria_layout_kind_name(r->layout));
    printf("  forward:  %.3f s (queue %.3f, upload %.3f, pass %.3f, download %.3f), "
           "%.1f GFLOP/s in the pass\n",
           r->t_fwd, fs->queued_s, fs->upload_s, fs->pass_s, fs->download_s,
           flops / fs->pass_s * 1e-9);
    if (fs->retries)
        printf("            after %u retr%s (a try failed retryably; see the coordinator's log)\n",
               fs->retries, fs->retries == 1 ? "y" : "ies");
    printf("            rank kernel time %.3f..%.3f s (balance %.2f), longest ring wait "
           "%.3f s, %u ring steps, %.1f MiB over the ring\n",
           fs->rank_compute_s_min, fs->rank_compute_s_max,
           fs->rank_compute_s_max > 0 ? fs->rank_compute_s_min / fs->rank_compute_s_max : 1.0,
           fs->rank_wait_s_max, fs->ring_steps, (double)fs->ring_bytes_sent / (1 << 20));
    if (o->do_path)
        printf("  backward: %.3f s (upload %.3f, pass %.3f, download %.3f), %.1f GFLOP/s in "
               "the pass; rank kernel time %.3f..%.3f s\n",
               r->t_bwd, bs->upload_s, bs->pass_s, bs->download_s, 2.5 * flops / bs->pass_s * 1e-9,
               bs->rank_compute_s_min, bs->rank_compute_s_max);
    printf("  outputs in %s/\n", o->out_dir);
}

/* --check: computes the same in this process and compares. */
static stria_status_t stria__submit_check(const stria__run_opts_t *o, const stria__run_data_t *d)
{
    size_t nq = (size_t)(d->B * d->T * d->H * d->D), nk = (size_t)(d->B * d->T * d->Hkv * d->D);
    stria__run_data_t l = *d;
    stria_pool_t *pool = NULL;
    l.o = l.lse = l.dq = l.dk = l.dv = NULL;
    stria_status_t st = stria__alloc_outputs(&l, o->do_path != NULL);
    if (st == STRIA_OK)
        st = stria_pool_create((int)o->threads, &pool);
    if (st == STRIA_OK)
        st = stria__compute_local(o, &l, pool);
    if (st == STRIA_OK) {
        bool ok = stria__compare("O", d->o, l.o, nq, d->dtype, o->quiet);
        ok &= stria__compare("LSE", d->lse, l.lse, (size_t)(d->B * d->H * d->T), STRIA_DTYPE_F32,
                             o->quiet);
        if (o->do_path) {
            ok &= stria__compare("dQ", d->dq, l.dq, nq, d->dtype, o->quiet);
            ok &= stria__compare("dK", d->dk, l.dk, nk, d->dtype, o->quiet);
            ok &= stria__compare("dV", d->dv, l.dv, nk, d->dtype, o->quiet);
        }
        if (!ok)
            st = stria_error_set(STRIA_ERR_INTERNAL, "--check: the service's results differ from "
                                                     "the in-process computation");
        else if (!o->quiet)
            printf("  check: the service's results match the in-process computation\n");
    }
    stria_pool_destroy(pool);
    stria_free(l.o);
    stria_free(l.lse);
    stria_free(l.dq);
    stria_free(l.dk);
    stria_free(l.dv);
    return st;
}

/* Forward (and backward) through the service; the outputs widened into d. */
static stria_status_t stria__submit_run(const stria__run_opts_t *o, stria_client_t *client,
                                        stria__run_data_t *d, stria__submit_stats_t *r)
{
    stria__submit_out_t s;
    stria__progress_t prog = {isatty(2) != 0, (stria_phase_t)-1, 0};
    stria_job_t *job = NULL;
    stria_job_spec_t spec;
    double t0;

    memset(&s, 0, sizeof(s));
    stria__submit_spec(o, d, &spec);
    stria_status_t st = stria__submit_alloc(d, o->do_path != NULL, &s);
    if (st == STRIA_OK) {
        t0 = stria_time_now();
        st = stria_client_forward(client, &spec, d->q, d->k, d->v, s.o, d->lse, stria__progress,
                                  &prog, &r->fs, &job);
        r->t_fwd = stria_time_now() - t0;
        stria__progress_end(&prog);
    }
    if (st == STRIA_OK && o->do_path) {
        t0 = stria_time_now();
        st = stria_client_backward(job, d->d_o, s.dq, s.dk, s.dv, stria__progress, &prog, &r->bs);
        r->t_bwd = stria_time_now() - t0;
        stria__progress_end(&prog);
    }
    r->job_id = stria_job_id(job);
    r->ring = stria_job_ring_size(job);
    r->layout = stria_job_layout(job);
    if (job != NULL) {
        stria_status_t rst = stria_client_release(job);
        if (st == STRIA_OK && rst != STRIA_OK)
            st = rst;
    }
    if (st == STRIA_OK) {
        stria__widen(d->dtype, s.o, d->o, s.nq);
        if (o->do_path) {
            stria__widen(d->dtype, s.dq, d->dq, s.nq);
            stria__widen(d->dtype, s.dk, d->dk, s.nk);
            stria__widen(d->dtype, s.dv, d->dv, s.nk);
        }
    }
    stria__submit_free(&s);
    return st;
}

static int stria__dcmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median and 99th percentile of n times, in ms (sorts them). */
static void stria__p50_p99(double *t, size_t n, double *p50, double *p99)
{
    qsort(t, n, sizeof(double), stria__dcmp);
    *p50 = 1e3 * t[n / 2];
    *p99 = 1e3 * t[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1];
}

/* --session-calls N: the job's calls again, N times, on a session; the last
 * call's outputs must have the job's bits (the same ring, layout and
 * kernels). */
static stria_status_t stria__submit_session(const stria__run_opts_t *o, stria_client_t *client,
                                            const stria__run_data_t *d,
                                            const stria__submit_stats_t *r)
{
    stria_job_spec_t js;
    stria__submit_out_t s;
    stria_session_t *sess = NULL;
    size_t n = (size_t)o->session_calls;
    bool bwd = o->do_path != NULL;
    double *tf = calloc(n, sizeof(double)), *tb = calloc(n, sizeof(double));
    float *lse = calloc((size_t)(d->B * d->H * d->T), sizeof(float)), *wide = NULL;
    stria__submit_spec(o, d, &js);
    memset(&s, 0, sizeof(s));
    stria_status_t st = stria__submit_alloc(d, bwd, &s);
    if (st == STRIA_OK && (tf == NULL || tb == NULL || lse == NULL ||
                           (wide = calloc(s.nq > s.nk ? s.nq : s.nk, sizeof(float))) == NULL))
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "--session-calls: out of memory");
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    sp.max_batch = js.batch;
    sp.max_seq_len = js.seq_len;
    sp.heads = js.heads;
    sp.kv_heads = js.kv_heads;
    sp.head_dim = js.head_dim;
    sp.dtype = js.dtype;
    sp.layout = r->layout; /* the job's, as assigned */
    sp.ring_size = r->ring;
    sp.head_groups = (uint32_t)o->head_groups;
    sp.head_group_rings = o->group_rings;
    sp.step_timeout_s = js.step_timeout_s;
    sp.label = js.label;
    double t0 = stria_time_now(), t_open = 0;
    if (st == STRIA_OK)
        st = stria_session_open(client, &sp, &sess);
    t_open = stria_time_now() - t0;
    stria_call_t call = STRIA_CALL_INIT;
    call.batch = js.batch;
    call.seq_len = js.seq_len;
    call.causal = js.causal;
    call.scale = js.scale;
    call.cu_seqlens = js.cu_seqlens;
    call.n_cu_seqlens = js.n_cu_seqlens;
    call.has_window = js.has_window;
    call.window_left = js.window_left;
    call.window_right = js.window_right;
    for (size_t i = 0; st == STRIA_OK && i < n; i++) {
        t0 = stria_time_now();
        st = stria_session_forward(sess, &call, d->q, d->k, d->v, s.o, lse);
        tf[i] = stria_time_now() - t0;
        if (st == STRIA_OK && bwd) {
            t0 = stria_time_now();
            st = stria_session_backward(sess, &call, d->q, d->k, d->v, s.o, lse, d->d_o, s.dq, s.dk,
                                        s.dv);
            tb[i] = stria_time_now() - t0;
        }
    }
    stria_session_stats_t ss = STRIA_SESSION_STATS_INIT;
    uint64_t sid = stria_session_id(sess);
    stria_session_stats(sess, &ss);
    stria_status_t cst = stria_session_close(sess);
    if (st == STRIA_OK)
        st = cst;
    const bool grouped = o->head_groups > 1; /* rings of another length: tolerance, not bits */
    if (st == STRIA_OK) {
        const size_t nl = (size_t)(d->B * d->H * d->T);
        bool same = grouped ? stria__compare("LSE", lse, d->lse, nl, STRIA_DTYPE_F32, o->quiet)
                            : memcmp(lse, d->lse, nl * sizeof(float)) == 0;
        const void *outs[4] = {s.o, s.dq, s.dk, s.dv};
        const float *jobs[4] = {d->o, d->dq, d->dk, d->dv};
        const size_t ns[4] = {s.nq, s.nq, s.nk, s.nk};
        static const char *const names[4] = {"O", "dQ", "dK", "dV"};
        for (int t = 0; t < (bwd ? 4 : 1); t++) {
            stria__widen(d->dtype, outs[t], wide, ns[t]);
            same = same &&
                   (grouped ? stria__compare(names[t], wide, jobs[t], ns[t], d->dtype, o->quiet)
                            : memcmp(wide, jobs[t], ns[t] * sizeof(float)) == 0);
        }
        double f50, f99, b50 = 0, b99 = 0;
        stria__p50_p99(tf, n, &f50, &f99);
        if (bwd)
            stria__p50_p99(tb, n, &b50, &b99);
        if (!o->quiet) {
            printf("  session %llu (opened in %.1f ms, %zu calls): forward %.3f ms (p99 %.3f) a "
                   "call against the job's %.3f ms",
                   (unsigned long long)sid, 1e3 * t_open, n, f50, f99, 1e3 * r->t_fwd);
            if (bwd)
                printf("; backward %.3f ms (p99 %.3f) against %.3f ms", b50, b99, 1e3 * r->t_bwd);
            if (grouped)
                printf("\n            %lld head groups x rings of %lld; %llu ring bytes in the "
                       "last call; the results %s\n",
                       (long long)o->head_groups, (long long)(r->ring / o->head_groups),
                       (unsigned long long)ss.last_ring_bytes,
                       same ? "agree with the job's" : "DIFFER from the job's");
            else
                printf("\n            %llu worker page faults in the last call; the results "
                       "%s\n",
                       (unsigned long long)ss.last_minflt,
                       same ? "have the job's bits" : "DIFFER from the job's");
        }
        if (!same)
            st = stria_error_set(STRIA_ERR_INTERNAL,
                                 "--session-calls: the session's results differ from the job's");
    }
    stria__submit_free(&s);
    free(tf);
    free(tb);
    free(lse);
    free(wide);
    return st;
}

static int stria__cmd_submit(const stria__run_opts_t *o)
{
    stria__run_data_t d;
    stria_client_t *client = NULL;
    stria__submit_stats_t r = {.fs = STRIA_CALL_STATS_INIT, .bs = STRIA_CALL_STATS_INIT};
    stria_client_params_t cp;
    memset(&d, 0, sizeof(d));
    stria_status_t st = stria__load_inputs(o, &d);
    if (st == STRIA_OK && stria__run_check_masks(o, "submit", d.T) >= 0) {
        stria__free_data(&d);
        return 2;
    }
    if (st == STRIA_OK)
        st = stria__alloc_outputs(&d, o->do_path != NULL);
    memset(&cp, 0, sizeof(cp));
    cp.struct_size = sizeof(cp);
    cp.coordinator = o->coordinator;
    /* read by the library, with the daemons' rules */
    cp.token_file = o->token_file != NULL && o->token_file[0] != '\0' ? o->token_file : NULL;
    cp.client_name = "stria-run";
    cp.data_path = o->path;
    cp.forward_retries = o->retries > 0 ? (int)o->retries : -1;
    if (st == STRIA_OK)
        st = stria_client_connect(&cp, &client);
    if (st == STRIA_OK)
        st = stria__submit_run(o, client, &d, &r);
    if (st == STRIA_OK)
        st = stria__write_outputs(o, &d);
    if (st == STRIA_OK && !o->quiet)
        stria__submit_report(o, &d, &r);
    if (st == STRIA_OK && o->check)
        st = stria__submit_check(o, &d);
    if (st == STRIA_OK && o->session_calls > 0)
        st = stria__submit_session(o, client, &d, &r);
    stria_client_close(client);
    stria__free_data(&d);
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-run: %s\n%s\n",
                stria_error_msg()[0] ? stria_error_msg() : stria_status_str(st),
                stria_error_retryable() ? "stria-run: the failure is retryable (a cause outside "
                                          "the job): running it again may succeed"
                                        : "stria-run: the failure is not retryable");
        return 1;
    }
    return 0;
}

/* stria-run random: writes a reproducible random .npy array. */
static int stria__cmd_random(const stria__run_opts_t *o)
{
    int64_t shape[STRIA_NPY_MAX_DIMS];
    int ndim = (int)o->shape.n;
    float amp = (float)o->amplitude;
    size_t n = 1;

    for (int i = 0; i < ndim; i++) {
        shape[i] = o->shape.v[i];
        if (__builtin_mul_overflow(n, (size_t)shape[i], &n) || n > ((size_t)1 << 34)) {
            fprintf(stderr, "stria-run: --shape: more than 2^34 elements\n"
                            "(see stria-run random --help)\n");
            return 2;
        }
    }
    float *data = stria_malloc_aligned(n * sizeof(float));
    if (data == NULL) {
        fprintf(stderr, "stria-run: cannot allocate %zu elements\n", n);
        return 1;
    }
    uint64_t x = (uint64_t)o->seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data[i] = ((float)(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * amp;
    }
    stria_status_t st;
    if (o->float16) {
        uint16_t *h = stria_malloc_aligned(n * sizeof(uint16_t));
        if (h == NULL) {
            stria_free(data);
            fprintf(stderr, "stria-run: cannot allocate %zu elements\n", n);
            return 1;
        }
        stria_dtype_convert(STRIA_DTYPE_F32, data, STRIA_DTYPE_F16, h, n);
        st = stria_npy_write(o->out_dir, STRIA_DTYPE_F16, ndim, shape, h);
        stria_free(h);
    } else {
        st = stria_npy_write(o->out_dir, STRIA_DTYPE_F32, ndim, shape, data);
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
    stria__run_opts_t o;
    stria_cli_t cli;
    int rc = stria__run_parse(argc, argv, &o, &cli);

    if (rc < 0 && strcmp(cli.cmd->name, "local") == 0)
        rc = stria__cmd_local(&o);
    else if (rc < 0 && strcmp(cli.cmd->name, "submit") == 0)
        rc = stria__cmd_submit(&o);
    else if (rc < 0)
        rc = stria__cmd_random(&o);
    stria_cli_free(&cli);
    return rc;
}
