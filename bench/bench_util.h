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

/* n pseudo-random values in [-1, 1) stored as `dtype`, the same for a seed. */
void stria_bench_fill(void *buf, stria_dtype_t dtype, size_t n, uint64_t seed);

/* The median of v[0..n) (sorted in place); 0 for n <= 0. */
double stria_bench_median(double *v, int n);

/* CPU time of the whole process (all threads), in seconds. */
double stria_bench_process_cpu(void);

/* ---- the daemons, beside this program ----------------------------------------- */

/* Credentials of a service the benchmark starts (file paths; NULL: none). */
typedef struct {
    const char *client_token_file, *worker_token_file;
} stria_bench_creds_t;

/* Starts stria-coordinator and `workers` stria-worker processes (found
 * beside this program) on loopback, each worker with `threads` kernel
 * threads, with `creds` (NULL: none); writes the coordinator's address.
 * Every process started is stopped by stria_bench_stop_daemons() (also on
 * SIGINT/SIGTERM). Errors name what did not start (printed). */
stria_status_t stria_bench_start_service(int workers, int threads, const stria_bench_creds_t *creds,
                                         char *coord, size_t coord_len);
void stria_bench_stop_daemons(void);

#ifdef __cplusplus
}
#endif

#endif
