/* stria-bench slowlink's own header: its limits, configuration and network,
 * shared by bench_slowlink.c (options, the namespaces and links, the
 * daemons, the command), slowlink_measure.c (the sessions and their
 * timings) and slowlink_sharded.c (--sharded: a session's trainer ranks,
 * a thread each). All but the ranks' calls run on the command's one
 * thread. */
#ifndef STRIA_BENCH_SLOWLINK_H
#define STRIA_BENCH_SLOWLINK_H

#include <stdbool.h>
#include <stdint.h>

#include "bench_daemons.h"
#include "stria_client.h"

#define SL_MAX_HOSTS   16
#define SL_MAX_WPH     8
#define SL_MAX_WORKERS 64
#define SL_MAX_LAYOUTS 4
#define SL_MAX_GROUPS  4 /* --head-groups entries */
/* whole, sharded and sharded by one trainer rank per worker; G > 1 inside
 * and across hosts */
#define SL_MAX_ROWS (SL_MAX_LAYOUTS * SL_MAX_GROUPS * 6)
#define SL_MAX_REPS 100
#define SL_FABRIC   "10.201.0." /* the workers' `nic` addresses, .1 up */
#define SL_CONTROL  "10.202.0." /* their `mgmt` addresses, .1 up; the head .254 */

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
    bool sharded;    /* each layout and head groups also as a sharded session */
    bool per_worker; /* each sharded striped G > 1 also called by one trainer rank per worker */
    bool across;     /* each G > 1 also with its rings across the hosts */
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

/* A sharded session's trainer ranks (slowlink_sharded.c). */
typedef struct sl_ranks sl_ranks_t;

/* One row: a layout's session (of `groups` head groups), whole-sequence or
 * sharded, and what its calls measured. */
typedef struct {
    stria_layout_kind_t kind;
    int groups;
    bool sharded;
    bool across;     /* the head groups' rings across hosts (stria_group_rings_t) */
    bool per_worker; /* sharded, called by one trainer rank per worker (trainer_ranks) */
    const char *name;
    char name_buf[32];
    stria_session_t *s; /* whole-sequence */
    sl_ranks_t *ranks;  /* sharded */
    bool ok;
    bool refused;  /* not ok because the open was refused (a row, not an error) */
    char msg[512]; /* why not ok */
    double fwd[SL_MAX_REPS], fwd_bwd[SL_MAX_REPS], pass_f[SL_MAX_REPS], pass_b[SL_MAX_REPS];
    double mib_f[SL_MAX_REPS], mib_b[SL_MAX_REPS];   /* over the rate-limited interfaces */
    double ring_f[SL_MAX_REPS], ring_b[SL_MAX_REPS]; /* MiB all ranks sent on the ring */
} sl_row_t;

/* Lifts every interface's rate limit (net->why says what failed). */
bool sl__unshape(sl_net_t *net);
/* Bytes that crossed the fabric's ports so far (both ways). */
uint64_t sl__fabric_bytes(void);
/* Opens a session per layout and head groups on the coordinator at `coord`,
 * warms each up, times them alternately, prints; returns the exit code. */
int sl__measure(const sl_cfg_t *c, sl_net_t *net, const char *coord);

/* A sharded row's session, opened with `sp` (sharded set here) by rank 0,
 * exported to ranks 1..R-1 (R = stria_session_ranks()), each rank a client
 * of its own at `coord` and its tokens of `call` cut from t's full tensors.
 * Returns 0, or -1 with row->ok false and row->msg (row->refused when the
 * open was refused). */
int sl__sharded_open(sl_row_t *row, stria_session_spec_t *sp, const char *coord,
                     const stria_call_t *call, const stria_bench_job_t *t);
/* A round of a sharded row, rep r (r < 0: warm-up, not recorded): the
 * forward on every rank at once, then the backward. A failure closes the
 * ranks (row->ok false, row->msg). */
void sl__sharded_call(sl_row_t *row, const stria_call_t *call, int r);
/* Closes the ranks' session handles and clients, frees their tensors;
 * NULL ranks are ignored. */
void sl__sharded_close(sl_row_t *row);

#endif
