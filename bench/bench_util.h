/* What the stria-bench subcommands share: their option handling, random
 * inputs, medians and CPU time. */
#ifndef STRIA_BENCH_UTIL_H
#define STRIA_BENCH_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "stria_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Parses a subcommand's arguments (argv[0] is its name) with its table under
 * the program "stria-bench". Returns -1 to run it, else the exit status
 * (0 after --help, 2 after a usage error, both printed). Free cli with
 * stria_cli_free(). */
int stria_bench_parse(const stria_command_t *cmd, int argc, char **argv, stria_cli_t *cli);

/* Prints "stria-bench CMD: <message>" and the --help hint; returns 2. */
int stria_bench_usage_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The attention shape options every subcommand has: --heads (1..max_heads,
 * default 8), --kv-heads (default: --heads), --head-dim (a multiple of 8,
 * default 128) and --dtype (default fp32), as STRIA_BENCH_SHAPE_OPTS entries
 * at t. */
#define STRIA_BENCH_SHAPE_OPTS 4
typedef struct {
    int64_t heads, kv_heads, head_dim;
    stria_dtype_t dtype;
} stria_bench_shape_t;
void stria_bench_shape_options(stria_option_t *t, stria_bench_shape_t *s, double max_heads);
/* After parsing: --kv-heads defaults to --heads and divides it, --head-dim
 * is a multiple of 8. Returns -1, or 2 after printing the error. */
int stria_bench_shape_check(const char *cmd, stria_bench_shape_t *s);

/* The masks of --documents lognormal:MEDIAN[:SIGMA] and --window
 * LEFT[,RIGHT] (docs NULL, win empty: none), checked for subcommand cmd.
 * Returns -1, or 2 after printing the error. */
typedef struct {
    int64_t doc_median; /* 0: no documents */
    double doc_sigma;
    bool has_window;
    int64_t window_left, window_right;
} stria_bench_masks_t;
int stria_bench_masks(const char *cmd, bool causal, const char *docs, const stria_int_list_t *win,
                      stria_bench_masks_t *m);

/* Document boundaries (cu_seqlens) with lengths drawn log-normal around
 * `median` tokens (sigma of the log; fixed seed), the last cut at seq. A
 * malloc'd array of *n entries, NULL when out of memory. */
int64_t *stria_bench_documents(int64_t median, double sigma, int64_t seq, size_t *n);

/* n pseudo-random values in [-1, 1) stored as `dtype`, the same for a seed. */
void stria_bench_fill(void *buf, stria_dtype_t dtype, size_t n, uint64_t seed);

/* The median of v[0..n) (sorted in place); 0 for n <= 0. */
double stria_bench_median(double *v, int n);

/* CPU time of the whole process (all threads), in seconds. */
double stria_bench_process_cpu(void);

/* Prints s as a JSON string (quoted, escaped) to out (a FILE *). */
void stria_bench_json_string(void *out, const char *s);

/* Resident memory (VmRSS, KiB) and open descriptors (entries of /proc/PID/fd)
 * of process pid. Returns 0, or -1 when it cannot be read (gone, not ours). */
int stria_bench_proc_usage(int pid, long long *rss_kib, int *fds);

/* The least-squares slope of y over x (n points) and its standard error
 * (NULL: not wanted; 0 when n < 3). 0 when n < 2 or every x is the same. */
double stria_bench_slope(const double *x, const double *y, int n, double *se);

#ifdef __cplusplus
}
#endif

#endif
