/* What the service benchmarks share (stria-bench service, datapath): the
 * daemons on loopback, found beside this program, a client of them, the
 * tensors of a forward+backward job and its in-process reference run. */
#ifndef STRIA_BENCH_DAEMONS_H
#define STRIA_BENCH_DAEMONS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "stria_client.h"
#include "stria_common.h"

#define STRIA_BENCH_MAX_WORKERS 64
#define STRIA_BENCH_HEARTBEAT_S "2" /* the coordinator's heartbeat period, seconds */

/* Starts a coordinator (heartbeat STRIA_BENCH_HEARTBEAT_S) and n workers (--threads tpr) on
 * loopback, waits until the coordinator counts them healthy, and writes its
 * address. SIGINT/SIGTERM stop them. Returns 0, or 1 after printing why as
 * "stria-bench CMD: ...". */
int stria_bench_daemons_start(const char *cmd, int n, int tpr, char *coord, size_t coord_len);
/* Credentials of a service the benchmark starts (file paths). */
typedef struct {
    const char *client_token_file, *worker_token_file;
} stria_bench_creds_t;
/* The same with credentials (NULL: none): the coordinator and workers get
 * --client-token-file and --worker-token-file, and the wait for healthy
 * workers proves the client one. */
int stria_bench_daemons_start_creds(const char *cmd, int n, int tpr,
                                    const stria_bench_creds_t *creds, char *coord,
                                    size_t coord_len);
/* Before a start: the daemons' stderr appended to DIR/coordinator.log and
 * DIR/workerI.log (NULL: to /dev/null, the default) and their --log-level
 * (NULL: error, the default). */
void stria_bench_daemons_logs(const char *dir, const char *level);
/* Stops every daemon started (SIGTERM, then SIGKILL after 5 s). */
void stria_bench_daemons_stop(void);
/* The daemons started so far: 0 the coordinator, 1 + i worker i (of the
 * first service); a pid of 0 for a worker killed and not restarted. */
int stria_bench_daemons_count(void);
pid_t stria_bench_daemon_pid(int i);
/* SIGKILLs worker i and reaps it. Returns 0, or -1 when it is not running. */
int stria_bench_worker_kill(int i);
/* Starts worker i, killed before, anew with the same flags (a new process
 * and address, registering with the same coordinator); waits until it
 * listens. Returns 0 or -1. */
int stria_bench_worker_restart(int i);
/* Minor page faults of worker i so far (/proc), -1 when unknown. */
long long stria_bench_worker_minflt(int i);

/* The figures of the workers' memory pools, summed over the live workers
 * (not dead, not left), as their last heartbeats told the coordinator. */
typedef struct {
    uint64_t reserved, in_use, high_water, committed;
} stria_bench_pools_t;
stria_status_t stria_bench_pools(const char *coord, stria_bench_pools_t *out);

/* What the coordinator's status says of its workers and jobs. */
typedef struct {
    uint32_t workers_healthy, workers_dead, jobs_pending, jobs_active;
    uint64_t jobs_submitted, jobs_failed; /* since it started */
} stria_bench_coord_status_t;
stria_status_t stria_bench_coord_status(const char *coord, stria_bench_coord_status_t *out);

/* A client of the coordinator moving data by `path`. */
stria_status_t stria_bench_client(const char *coord, const char *name, stria_data_path_t path,
                                  stria_client_t **out);

/* Full tensors of a forward+backward job, [batch, seq, heads or kv_heads,
 * head_dim] and LSE [batch, heads, seq], inputs filled with fixed seeds. */
typedef struct {
    int64_t batch, seq, heads, kv_heads, head_dim;
    stria_dtype_t dtype;
    void *q, *k, *v, *g, *o, *dq, *dk, *dv;
    float *lse;
} stria_bench_job_t;
/* Returns 0, or 1 after printing why. backward: also dO, dQ, dK, dV. */
int stria_bench_job_alloc(stria_bench_job_t *t, bool backward);
void stria_bench_job_free(stria_bench_job_t *t);
/* A job spec for t through `ranks` workers. */
stria_job_spec_t stria_bench_job_spec(const stria_bench_job_t *t, bool causal, int ranks,
                                      const char *label);
/* Forward and backward through the service; the wall time of both calls
 * and their statistics. The job is released. */
stria_status_t stria_bench_service_fwd_bwd(stria_client_t *client, const stria_job_spec_t *spec,
                                           stria_bench_job_t *t, double *seconds,
                                           stria_call_stats_t *fwd, stria_call_stats_t *bwd);
/* The same job through the in-process ring engine (striped, one thread per
 * rank, tpr kernel threads each); its wall time. */
stria_status_t stria_bench_local_fwd_bwd(stria_bench_job_t *t, bool causal, int ranks, int tpr,
                                         double *seconds);

#endif
