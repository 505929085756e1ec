/* What the stria-bench subcommands share (bench_util.h). */
#include "bench_util.h"

#include "stria_kernels.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int stria_bench_parse(const stria_command_t *cmd, int argc, char **argv, stria_cli_t *cli)
{
    const stria_command_t cmds[2] = {*cmd, {.name = NULL}};
    const stria_command_t root = {.name = "stria-bench", .commands = cmds};
    char **args = calloc((size_t)argc + 2, sizeof(*args));
    if (args == NULL) {
        fprintf(stderr, "stria-bench: out of memory\n");
        memset(cli, 0, sizeof(*cli));
        return 1;
    }
    args[0] = "stria-bench";
    for (int i = 0; i < argc; i++)
        args[i + 1] = argv[i];
    int rc = stria_cli_main(&root, argc + 1, args, cli);
    free(args);
    return rc;
}

int stria_bench_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "stria-bench %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(see stria-bench %s --help)\n", cmd);
    return 2;
}

static stria_status_t stria__bench_dtype(const char *text, void *dst)
{
    return stria_dtype_parse(text, dst);
}

void stria_bench_shape_options(stria_option_t *t, stria_bench_shape_t *s, double max_heads)
{
    const stria_option_t shape[STRIA_BENCH_SHAPE_OPTS] = {
        STRIA_OPTION("heads", INT, &s->heads, "H", "query heads", .dflt = "8", .min = 1,
                     .max = max_heads),
        STRIA_OPTION("kv-heads", INT, &s->kv_heads, "K", "key/value heads, dividing H (default: H)",
                     .min = 1, .max = max_heads),
        STRIA_OPTION("head-dim", INT, &s->head_dim, "D", "head dimension, a multiple of 8",
                     .dflt = "128", .min = STRIA_HEAD_DIM_MIN, .max = STRIA_HEAD_DIM_MAX),
        STRIA_OPTION("dtype", CUSTOM, &s->dtype, "fp32|bf16|fp16", "storage of Q, K, V and dO",
                     .dflt = "fp32", .parse = stria__bench_dtype),
    };
    memcpy(t, shape, sizeof(shape));
}

int stria_bench_shape_check(const char *cmd, stria_bench_shape_t *s)
{
    if (s->kv_heads == 0)
        s->kv_heads = s->heads;
    if (s->heads % s->kv_heads != 0)
        return stria_bench_usage_error(cmd, "--heads %lld is not a multiple of --kv-heads %lld",
                                       (long long)s->heads, (long long)s->kv_heads);
    if (s->head_dim % 8 != 0)
        return stria_bench_usage_error(cmd, "--head-dim %lld: not a multiple of 8",
                                       (long long)s->head_dim);
    return -1;
}

void stria_bench_fill(void *buf, stria_dtype_t dtype, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        float x = (float)((double)(s >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
        stria_dtype_store(dtype, buf, i, x);
    }
}

static int stria__bench_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double stria_bench_median(double *v, int n)
{
    if (n <= 0)
        return 0;
    qsort(v, (size_t)n, sizeof(double), stria__bench_cmp);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double stria_bench_process_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int stria_bench_masks(const char *cmd, bool causal, const char *docs, const stria_int_list_t *win,
                      stria_bench_masks_t *m)
{
    char *end = NULL;
    memset(m, 0, sizeof(*m));
    if (docs != NULL) {
        if (strncmp(docs, "lognormal:", 10) != 0)
            return stria_bench_usage_error(cmd,
                                           "--documents '%s': expected lognormal:MEDIAN"
                                           "[:SIGMA]",
                                           docs);
        errno = 0;
        m->doc_median = strtoll(docs + 10, &end, 10);
        m->doc_sigma = 1.0;
        if (errno == 0 && *end == ':')
            m->doc_sigma = strtod(end + 1, &end);
        if (errno != 0 || *end != '\0' || m->doc_median < 1 || !(m->doc_sigma >= 0.0) ||
            m->doc_sigma > 4.0)
            return stria_bench_usage_error(cmd,
                                           "--documents '%s': MEDIAN must be >= 1 tokens "
                                           "and SIGMA in 0..4",
                                           docs);
    }
    if (win != NULL && win->n > 0) {
        m->has_window = true;
        m->window_left = win->v[0];
        m->window_right = win->n > 1 ? win->v[1] : 0;
        if (win->n > 2 || (causal && m->window_right > 0))
            return stria_bench_usage_error(cmd, "--window takes LEFT[,RIGHT] (RIGHT 0 or -1 "
                                                "with causal attention)");
    }
    return -1;
}

int64_t *stria_bench_documents(int64_t median, double sigma, int64_t seq, size_t *n)
{
    uint64_t state = 0x5eed5eedULL;
    size_t cap = 64;
    int64_t *cu = malloc(cap * sizeof(*cu));
    *n = 0;
    if (cu == NULL)
        return NULL;
    cu[(*n)++] = 0;
    while (cu[*n - 1] < seq) {
        double u[2];
        for (int i = 0; i < 2; i++) { /* splitmix64 -> (0, 1) */
            uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
            u[i] = ((double)((z ^ (z >> 31)) >> 11) + 0.5) / 9007199254740992.0;
        }
        double g = sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]);
        int64_t len = llround((double)median * exp(sigma * g));
        if (*n == cap) {
            int64_t *more = realloc(cu, 2 * cap * sizeof(*cu));
            if (more == NULL) {
                free(cu);
                return NULL;
            }
            cu = more;
            cap *= 2;
        }
        cu[*n] = cu[*n - 1] + (len < 1 ? 1 : len);
        if (cu[*n] > seq)
            cu[*n] = seq;
        (*n)++;
    }
    return cu;
}

int stria_bench_proc_usage(int pid, long long *rss_kib, int *fds)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    *rss_kib = -1;
    while (fgets(line, sizeof(line), f) != NULL)
        if (sscanf(line, "VmRSS: %lld kB", rss_kib) == 1)
            break;
    fclose(f);
    snprintf(path, sizeof(path), "/proc/%d/fd", pid);
    DIR *d = opendir(path);
    if (d == NULL || *rss_kib < 0) {
        if (d != NULL)
            closedir(d);
        return -1;
    }
    *fds = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        *fds += e->d_name[0] != '.';
    closedir(d);
    return 0;
}

double stria_bench_slope(const double *x, const double *y, int n, double *se)
{
    if (se != NULL)
        *se = 0;
    if (n < 2)
        return 0;
    double mx = 0, my = 0;
    for (int i = 0; i < n; i++)
        mx += x[i], my += y[i];
    mx /= n, my /= n;
    double sxx = 0, sxy = 0;
    for (int i = 0; i < n; i++)
        sxx += (x[i] - mx) * (x[i] - mx), sxy += (x[i] - mx) * (y[i] - my);
    if (sxx <= 0)
        return 0;
    double b = sxy / sxx;
    if (se != NULL && n > 2) {
        double rss = 0;
        for (int i = 0; i < n; i++) {
            double r = y[i] - my - b * (x[i] - mx);
            rss += r * r;
        }
        *se = sqrt(rss / (n - 2) / sxx);
    }
    return b;
}

void stria_bench_json_string(void *out, const char *s)
{
    FILE *f = out;
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p != '\0'; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}
