/*
 * stria coordinator: the control plane of the service.
 *
 * It serves the stria.v1.Coordinator service (proto/stria.proto) over the RPC
 * layer: workers register and heartbeat; clients submit jobs and get an
 * assignment (ring members in order, each rank's token shard and addresses);
 * workers report the phases of each job; admins list, drain and cancel.
 *
 * Workers. A worker is identified by its RPC address. One that misses three
 * heartbeat periods is marked dead and leaves the ring; every job it takes
 * part in fails with a reason naming it. When it heartbeats or registers
 * again it rejoins (a new incarnation, i.e. a restarted process, also fails
 * the jobs it held). A worker that shuts down gracefully deregisters: it
 * leaves the ring at once and its unfinished jobs fail with a reason naming
 * it. The ring is the healthy, non-draining workers sorted by
 * (host, RPC address), so the workers of one host sit together and the order
 * is stable across restarts.
 *
 * Jobs. A job of ring size n takes n consecutive workers of the ring. It is
 * admitted when every member has the capacity for its per-rank memory
 * estimate (stria_session_rank_memory() in stria_layout.h: the pass and
 * its call regions, one more per held forward); otherwise it is refused with a clear
 * error (too few workers: STRIA_ERR_BUSY; too little memory:
 * STRIA_ERR_NO_MEMORY). It starts (LOADING) once its members have that memory
 * free and no earlier queued job waits for one of them; until then it is
 * PENDING, in submission order. Jobs on disjoint workers, or that fit side by
 * side, are active together. One client (host address) holds at most
 * max_jobs_per_client pending and active jobs. A job without client or worker activity for its
 * TTL expires and its workers drop it. The coordinator keeps the most recent
 * finished jobs for the admin tools.
 *
 * Restart: a restarted coordinator rebuilds the jobs the workers hold from
 * their reports within recovery_window_s of start (coord_recover.c); a job
 * whose ranks are not all reported by then fails with a reason naming them.
 *
 * Security: a job's id is random; its secret (made at submission, handed
 * sealed to the submitting client) is proven on every job-scoped call, to
 * the coordinator (GetJob, ReleaseJob) and to the workers. Worker methods
 * need the worker credential; admin methods the admin one. See
 * docs/SECURITY.md.
 *
 * Threads: everything runs on the RPC server's loop thread; the functions
 * below are called from any other single thread.
 */
#ifndef STRIA_COORDINATOR_H
#define STRIA_COORDINATOR_H

#include "stria_common.h"
#include "stria_rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Limits of a job spec; a spec outside them is refused naming the field. */
#define STRIA_COORD_MAX_BATCH 65536
#define STRIA_COORD_MAX_HEADS 65536
#define STRIA_COORD_MAX_SEQ   ((uint64_t)1 << 40)
#define STRIA_COORD_MAX_TTL_S (7u * 86400u)
#define STRIA_COORD_MAX_LABEL 256
/* Held forwards a session may ask for (JobSpec.max_held). */
#define STRIA_COORD_MAX_HELD 63
/* Head groups of a session (JobSpec.head_groups), as libstria allows. */
#define STRIA_COORD_MAX_HEAD_GROUPS 64
#define STRIA_COORD_MAX_RING        4096
/* Entries of a spec's cu_seqlens. */
#define STRIA_COORD_MAX_CU_SEQLENS 65536
/* The largest step deadline a coordinator may allow (max_step_timeout_s). */
#define STRIA_COORD_MAX_STEP_TIMEOUT_S (86400u)
/* Job entries of one heartbeat, and the size of its message: a worker holds
 * far fewer jobs; a larger heartbeat is refused before it is decoded. */
#define STRIA_COORD_MAX_HEARTBEAT_JOBS  16384
#define STRIA_COORD_MAX_HEARTBEAT_BYTES (1u << 20)

typedef struct stria_coord stria_coord_t;

/* Zero-initialise and set the fields; zero means the default. */
typedef struct {
    const char *listen;        /* "HOST:PORT" (required); port 0 picks one */
    double heartbeat_period_s; /* period told to workers; dead after 3; default 1 */
    double job_ttl_s;          /* default TTL of a job; default 600 */
    /* Credentials (contents, not paths) of the three roles. Without any,
     * every connection has every role (for loopback only: the programs
     * refuse it elsewhere). With any, the client and worker ones are
     * required, and without an admin one nobody is admin. */
    const char *token;        /* clients: submit and own jobs */
    const char *worker_token; /* workers: register, heartbeat, report, fetch job keys */
    const char *admin_token;  /* operators: drain, cancel, list and view any job */
    uint32_t max_workers;     /* registered workers kept; default 4096 */
    uint32_t max_jobs;        /* pending and active jobs; default 4096 */
    uint32_t history;         /* finished jobs kept for the admin tools; default 1024 */
    /* Longest step deadline a spec may ask for (step_timeout_ms); larger ones
     * are refused. Default 600 s, at most STRIA_COORD_MAX_STEP_TIMEOUT_S. */
    double max_step_timeout_s;
    /* Pending and active jobs one client (its host address) may hold; more
     * are refused with STRIA_ERR_BUSY. Default 256. */
    uint32_t max_jobs_per_client;
    /* Open sessions and jobs (a job is a session of two calls) one client
     * (host address) may hold (default 256), and the worker memory they may
     * hold in all (0: no limit beyond the pools): one account of both; more
     * are refused with STRIA_ERR_BUSY. */
    uint32_t max_sessions_per_client;
    uint64_t max_session_bytes_per_client;
    /* A dead or departed worker is forgotten (its entry, its metric series)
     * this long after it was last heard of; default 3600 s. When the table
     * is full, a registration forgets the longest-silent of them at once. */
    double worker_retention_s;
    /* After a start, jobs the workers report holding (a restart) are
     * rebuilt for this long; then a job with ranks nobody reported fails.
     * Default (0) 3 heartbeat periods; negative: none (workers drop every
     * job they hold). */
    double recovery_window_s;
    /* Optional registry that receives the coordinator's gauges and counters
     * (stria_coordinator_*); must outlive the coordinator. */
    stria_metrics_t *metrics;
    /* Send STATUS= lines (ring size, jobs) to the service manager through
     * stria_notify() whenever they change. */
    bool notify_status;
} stria_coord_params_t;

/* Starts serving. Errors: STRIA_ERR_INVALID_ARG (a parameter, named),
 * STRIA_ERR_IO (cannot listen). Stop with stria_coord_stop(). */
stria_status_t stria_coord_start(const stria_coord_params_t *params, stria_coord_t **coord_out);

/* The bound port. */
uint16_t stria_coord_port(const stria_coord_t *coord);
/* The RPC server (for liveness probes such as stria_service_watch_rpc). */
const stria_rpc_server_t *stria_coord_server(const stria_coord_t *coord);

/* Stops serving and frees everything; NULL is ignored. The workers keep
 * their jobs: a coordinator started again on the same address rebuilds them
 * from the workers' reports (recovery_window_s). Unfinished jobs are logged,
 * one line per job. */
void stria_coord_stop(stria_coord_t *coord);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_COORDINATOR_H */
