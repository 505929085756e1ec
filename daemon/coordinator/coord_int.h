/* Internals of the coordinator: its worker and job tables. Everything here is
 * touched only on the RPC loop thread. */
#ifndef STRIA_COORD_INT_H
#define STRIA_COORD_INT_H

#include "stria.pb-c.h"
#include "stria_coordinator.h"
#include "stria_rpc.h"

#define STRIA__COORD_STR    256 /* longest host, device, address or version string */
#define STRIA__DEAD_PERIODS 3

typedef struct {
    uint64_t id;
    char rpc_address[STRIA__COORD_STR];
    char ucx_address[STRIA__COORD_STR];
    char host[STRIA__COORD_STR];
    char device[STRIA__COORD_STR];
    char version[STRIA__COORD_STR];
    char kernel_variant[STRIA__COORD_STR];
    uint64_t memory_bytes; /* capacity */
    uint64_t reserved;     /* by active jobs */
    uint64_t in_use;       /* reported */
    uint64_t incarnation;
    bool dead;
    bool left; /* deregistered at shutdown (dead is set too) */
    bool draining;
    double last_seen; /* stria_time_now() */
    uint64_t registered_ms;
    uint64_t current_job; /* pass running now (0: idle) */
    uint32_t step, steps_total;
    bool blocked;           /* scratch of the scheduler */
    uint64_t queued_demand; /* scratch of admission: memory of queued jobs */
} stria__cworker_t;

/* Per-rank progress of a job. */
typedef struct {
    stria__cworker_t *worker;
    stria_layout_run_t runs[STRIA_LAYOUT_MAX_RUNS];
    size_t n_runs;
    uint64_t tokens; /* real tokens */
    bool loaded, fwd_done, bwd_done;
    uint32_t step, steps_total;
} stria__crank_t;

typedef struct {
    uint64_t id;
    Stria__V1__JobState state;
    /* the spec, defaults filled in */
    uint32_t batch, heads, kv_heads, head_dim, ttl_s, step_timeout_ms;
    uint64_t seq_len;
    Stria__V1__Dtype dtype;
    Stria__V1__Layout layout;
    bool causal, no_queue;
    float scale;
    char label[STRIA_COORD_MAX_LABEL + 1];

    uint32_t n_ranks;
    stria__crank_t *ranks;
    uint64_t shard_tokens; /* padded, equal for every rank */
    uint64_t mem_per_rank;
    bool reserved; /* memory reserved on the members */

    uint64_t submitted_ms, started_ms, forward_started_ms, forward_done_ms;
    uint64_t backward_started_ms, backward_done_ms, finished_ms;
    double last_activity; /* stria_time_now() */
    char failure[512];
} stria__cjob_t;

struct stria_coord {
    stria_rpc_server_t *server;
    double heartbeat_period_s;
    double job_ttl_s;
    uint32_t max_workers, max_jobs, history;
    bool auth_required;
    double started_at;
    uint64_t started_ms;

    stria__cworker_t **workers; /* registration order; never freed before stop */
    uint32_t n_workers;
    uint64_t next_worker_id;

    stria__cjob_t **jobs; /* submission order: finished ones kept as history */
    uint32_t n_jobs, cap_jobs;
    uint64_t next_job_id;
    uint64_t jobs_submitted, jobs_failed;

    stria_metrics_t *metrics;
    bool notify_status;
    char last_status[256]; /* last STATUS= sent to the service manager */
};

/* Wall clock in milliseconds since the Unix epoch. */
uint64_t stria__coord_wall_ms(void);

#endif /* STRIA_COORD_INT_H */
