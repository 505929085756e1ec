/* stria-bench slowlink's own header: its limits, configuration and network,
 * shared by bench_slowlink.c (options, the namespaces and links, the
 * daemons, the command) and slowlink_measure.c (the sessions and their
 * timings). Both run on the command's one thread. */
#ifndef STRIA_BENCH_SLOWLINK_H
#define STRIA_BENCH_SLOWLINK_H

#include <stdbool.h>
#include <stdint.h>

#include "stria_client.h"

#define SL_MAX_HOSTS   16
#define SL_MAX_WPH     8
#define SL_MAX_WORKERS 64
#define SL_MAX_LAYOUTS 4
#define SL_MAX_GROUPS  4 /* --head-groups entries */
#define SL_MAX_ROWS    (SL_MAX_LAYOUTS * SL_MAX_GROUPS)
#define SL_FABRIC      "10.201.0." /* the workers' `nic` addresses, .1 up */
#define SL_CONTROL     "10.202.0." /* their `mgmt` addresses, .1 up; the head .254 */

typedef struct {
    int hosts, wph, reps, tpr;
    int64_t seq, heads, kv_heads, head_dim, memory;
    stria_dtype_t dtype;
    double rate_bits; /* 0: no limit */
    char rate_text[32];
    int n_layouts;
    stria_layout_kind_t layouts[SL_MAX_LAYOUTS];
    const char *layout_names[SL_MAX_LAYOUTS];
    int n_groups;
    int groups[SL_MAX_GROUPS]; /* head groups of each layout's sessions (1: one ring) */
    int64_t doc_median;
    double doc_sigma;
    bool baseline, json;
    double step_timeout_s;
    const char *log_dir; /* NULL: a temporary one */
} sl_cfg_t;

typedef struct {
    const char *ip, *tc;
    char prefix[32]; /* stria-sl<PID> */
    char head[48];   /* the head namespace */
    char wns[SL_MAX_WORKERS][48];
    int hosts, wph, n; /* n = hosts * wph workers */
    char why[1024];    /* what failed */
} sl_net_t;

/* Lifts every interface's rate limit (net->why says what failed). */
bool sl__unshape(sl_net_t *net);
/* Bytes that crossed the fabric's ports so far (both ways). */
uint64_t sl__fabric_bytes(void);
/* Opens a session per layout and head groups on the coordinator at `coord`,
 * warms each up, times them alternately, prints; returns the exit code. */
int sl__measure(const sl_cfg_t *c, sl_net_t *net, const char *coord);

#endif
