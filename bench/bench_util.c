/* What the stria-bench subcommands share (bench_util.h). */
#include "bench_util.h"

#include "stria_kernels.h"

#include <signal.h>
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
        {.name = "heads",
         .type = STRIA_OPT_INT,
         .dst = &s->heads,
         .dflt = "8",
         .min = 1,
         .max = max_heads,
         .metavar = "H",
         .help = "query heads"},
        {.name = "kv-heads",
         .type = STRIA_OPT_INT,
         .dst = &s->kv_heads,
         .min = 1,
         .max = max_heads,
         .metavar = "K",
         .help = "key/value heads, dividing H (default: H)"},
        {.name = "head-dim",
         .type = STRIA_OPT_INT,
         .dst = &s->head_dim,
         .dflt = "128",
         .min = STRIA_HEAD_DIM_MIN,
         .max = STRIA_HEAD_DIM_MAX,
         .metavar = "D",
         .help = "head dimension, a multiple of 8"},
        {.name = "dtype",
         .type = STRIA_OPT_CUSTOM,
         .dst = &s->dtype,
         .dflt = "fp32",
         .parse = stria__bench_dtype,
         .metavar = "fp32|bf16|fp16",
         .help = "storage of Q, K, V and dO"},
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

/* ---- the daemons, beside this program ----------------------------------------- */

#define STRIA__BENCH_MAX_PROCS 256

typedef struct {
    pid_t pid;
    FILE *out;
} stria__bench_proc_t;

static stria__bench_proc_t stria__procs[STRIA__BENCH_MAX_PROCS];
static int stria__n_procs;

void stria_bench_stop_daemons(void)
{
    for (int i = 0; i < stria__n_procs; i++)
        if (stria__procs[i].pid > 0)
            kill(stria__procs[i].pid, SIGTERM);
    for (int i = 0; i < stria__n_procs; i++) {
        stria__bench_proc_t *p = &stria__procs[i];
        if (p->pid <= 0)
            continue;
        int st;
        for (int t = 0; t < 100 && waitpid(p->pid, &st, WNOHANG) == 0; t++)
            usleep(50000);
        if (waitpid(p->pid, &st, WNOHANG) == 0) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &st, 0);
        }
        if (p->out)
            fclose(p->out);
        p->pid = 0;
    }
    stria__n_procs = 0;
}

static void stria__bench_on_signal(int sig)
{
    stria_bench_stop_daemons();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Starts argv with stdout on a pipe and stderr to /dev/null; reads lines until
 * one starts with `prefix` and copies it into line. */
static int stria__bench_spawn(char *const argv[], const char *prefix, char *line, size_t len)
{
    int fds[2];
    if (stria__n_procs >= STRIA__BENCH_MAX_PROCS || pipe(fds) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        FILE *null = freopen("/dev/null", "w", stderr);
        (void)null;
        execv(argv[0], argv);
        _exit(127);
    }
    close(fds[1]);
    stria__bench_proc_t *p = &stria__procs[stria__n_procs++];
    p->pid = pid;
    p->out = fdopen(fds[0], "r");
    while (fgets(line, (int)len, p->out) != NULL) {
        if (strncmp(line, prefix, strlen(prefix)) == 0) {
            line[strcspn(line, "\n")] = '\0';
            return 0;
        }
    }
    return -1;
}

stria_status_t stria_bench_start_service(int workers, int threads, const stria_bench_creds_t *creds,
                                         char *coord, size_t coord_len)
{
    char self[4096], dir[4096], coord_bin[4200], worker_bin[4200];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) {
        fprintf(stderr, "stria-bench: cannot find this program's folder\n");
        return STRIA_ERR_IO;
    }
    self[n] = '\0';
    snprintf(dir, sizeof(dir), "%s", self);
    *strrchr(dir, '/') = '\0';
    snprintf(coord_bin, sizeof(coord_bin), "%s/stria-coordinator", dir);
    snprintf(worker_bin, sizeof(worker_bin), "%s/stria-worker", dir);
    if (access(coord_bin, X_OK) != 0 || access(worker_bin, X_OK) != 0) {
        fprintf(stderr, "stria-bench: %s and %s are needed (build them)\n", coord_bin, worker_bin);
        return STRIA_ERR_IO;
    }
    signal(SIGINT, stria__bench_on_signal);
    signal(SIGTERM, stria__bench_on_signal);
    setenv("UCX_HANDLE_ERRORS", "none", 0);

    char line[512], th[16], ctok[4200] = "", wtok[4200] = "";
    if (creds != NULL) {
        snprintf(ctok, sizeof(ctok), "--client-token-file=%s", creds->client_token_file);
        snprintf(wtok, sizeof(wtok), "--worker-token-file=%s", creds->worker_token_file);
    }
    /* Heartbeats with slack: a loaded machine must not fail a measured job. */
    char *cargv[] = {coord_bin, "--listen",          "127.0.0.1:0", "--heartbeat-period",
                     "2",       creds ? ctok : NULL, wtok,          NULL};
    if (stria__bench_spawn(cargv, "stria-coordinator listening on ", line, sizeof(line)) != 0) {
        fprintf(stderr, "stria-bench: the coordinator did not start\n");
        stria_bench_stop_daemons();
        return STRIA_ERR_IO;
    }
    snprintf(coord, coord_len, "%s", line + strlen("stria-coordinator listening on "));
    snprintf(th, sizeof(th), "%d", threads);
    for (int i = 0; i < workers; i++) {
        char *wargv[] = {worker_bin, "--coordinator",     coord, "--threads", th, "--log-level",
                         "error",    creds ? ctok : NULL, wtok,  NULL};
        if (stria__bench_spawn(wargv, "stria-worker listening", line, sizeof(line)) != 0) {
            fprintf(stderr, "stria-bench: worker %d did not start\n", i);
            stria_bench_stop_daemons();
            return STRIA_ERR_IO;
        }
    }
    return STRIA_OK;
}
