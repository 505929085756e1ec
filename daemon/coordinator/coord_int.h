/* Internals of the coordinator: its worker and job tables, and its rooms.
 * Everything here is touched only on the RPC loop thread.
 *
 * A room is a file; the names it shares here carry its prefix. From the
 * ground up (a room calls only rooms listed above it):
 *
 *   coord_index.c     stria__index_*     hash indexes of the tables
 *   coord_scratch.c   stria__scratch_*   the scratch list replies are built on
 *   coord_metrics.c   stria__cmet_*      metrics series and the STATUS= line
 *   coord_timeline.c  stria__timeline_*  the passes' step times kept with a job
 *   coord_jobs.c      stria__cjob_*      the job (and session) table: specs,
 *                                        state machine, queue, arrival rounds
 *   coord_place.c     stria__place_*     ring order; where a job runs
 *   coord_recover.c   stria__recover_*   jobs rebuilt after a restart; the ids
 *                                        and keys of new jobs
 *   coord_replace.c   stria__replace_*   a sharded job's lost worker replaced
 *   coord_reply.c     stria__reply_*     worker and job records, assignments
 *   coord_workers.c   stria__cworker_*   the worker table, the workers' handlers
 *   coord_clients.c   stria__cclient_*   the clients' and admins' handlers
 *   coord.c           stria__coord_*     the tick, start and stop
 */
#ifndef STRIA_COORD_INT_H
#define STRIA_COORD_INT_H

#include "stria.pb-c.h"
#include "stria_auth.h"
#include "stria_spec.h"
#include "stria_coordinator.h"
#include "stria_rpc.h"

#include <time.h>

#define STRIA__COORD_STR     256          /* longest host, device, address or version string */
#define STRIA__MAX_WORKER_ID (1ull << 48) /* a larger previous id is not taken back */
#define STRIA__DEAD_PERIODS  3
/* A session's idle deadline when its spec names none (JobSpec.ttl_s). */
#define STRIA__DEFAULT_SESSION_IDLE_S 60u
#define STRIA__DEFAULT_ARRIVAL_S      60.0 /* a sharded job's arrival timeout by default */
#define STRIA__SUBMIT_KEY_BYTES       16   /* SubmitJobRequest.submit_key */
/* The largest message of a request other than SubmitJob and Heartbeat. */
#define STRIA__COORD_SMALL_REQUEST (64u << 10)

/* ---- coord_index.c: hash indexes ---------------------------------------- */

/* A hash index from a pair of 64-bit keys to a pointer. */
typedef struct {
    uint64_t a, b;
    void *v; /* NULL: an empty slot */
} stria__slot_t;
typedef struct {
    stria__slot_t *slots;
    size_t cap, n;
    uint64_t seed;
} stria__index_t;

void stria__index_init(stria__index_t *x);
void stria__index_free(stria__index_t *x);
/* Adds or replaces; v must not be NULL. */
stria_status_t stria__index_put(stria__index_t *x, uint64_t a, uint64_t b, void *v);
void *stria__index_get(const stria__index_t *x, uint64_t a, uint64_t b);
void stria__index_del(stria__index_t *x, uint64_t a, uint64_t b);

/* ---- the tables ---------------------------------------------------------- */

/* A worker of the worker table (coord_workers.c). */
typedef struct {
    uint64_t id;
    char rpc_address[STRIA__COORD_STR];
    char ucx_address[STRIA__COORD_STR];
    char host[STRIA__COORD_STR];
    char device[STRIA__COORD_STR];
    char version[STRIA__COORD_STR];
    char kernel_variant[STRIA__COORD_STR];
    char shm_socket[STRIA__COORD_STR]; /* "" : none */
    bool has_device_index;
    uint32_t device_index;
    uint64_t memory_bytes; /* capacity */
    uint64_t reserved;     /* by active jobs */
    uint64_t in_use;       /* reported */
    /* the worker's memory pool, as last reported: reserved, in use, high
     * water, committed */
    uint64_t pool[4];
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
    /* Jobs of the job table (history included) that name this worker: a
     * forgotten worker is freed only when the last of them is. */
    uint32_t job_refs;
    bool forgotten; /* out of the worker table */
    /* registered holding jobs in a recovery window: no new job starts on it
     * until a heartbeat described them (coord_recover.c) */
    bool awaiting_jobs;
    bool died_now; /* scratch of the tick: marked dead in this one */
    /* its series of the per-worker gauges (NULL until the first update) */
    stria_metric_t *m_age, *m_in_use, *m_reserved;
} stria__cworker_t;

/* Per-rank progress of a job. */
typedef struct {
    stria__cworker_t *worker;
    stria_layout_run_t runs[STRIA_LAYOUT_MAX_RUNS];
    size_t n_runs;
    uint64_t tokens; /* real tokens */
    bool loaded, fwd_done, bwd_done;
    uint32_t step, steps_total;
    uint32_t arrived; /* sharded: 1 + the last pass the rank arrived at; 0: none */
    bool released;    /* its trainer rank released the job */
    bool fallback;    /* placed off the host its placement named */
    /* a session's calls on the rank's worker (its last heartbeat) */
    uint64_t s_calls, s_failed, s_bytes;
    float s_p50_ms, s_p99_ms;
    /* the spec's placement of the rank ("" : none) */
    char *place_host;
    bool place_has_device;
    uint32_t place_device;
} stria__crank_t;

typedef struct stria__rjob stria__rjob_t; /* coord_recover.c */

/* A job of the job table (coord_jobs.c); a session is a job whose spec has
 * `session` set. */
typedef struct {
    uint64_t id; /* random, unique among the jobs kept */
    /* The job's capability: whoever proves it owns the job. Handed sealed
     * to the client that submitted it and to its workers. */
    stria_job_secret_t secret;
    /* What the job's ring links prove to each other; to the workers only. */
    uint8_t ring_key[STRIA_AUTH_KEY_BYTES];
    Stria__V1__JobState state;
    /* The spec as submitted, defaults filled in (layout resolved, ring_size
     * the ranks, scale, ttl_s, arrival_timeout_s): what assignments and
     * GetJob report. Its label, cu_seqlens and window point into the job;
     * it has no placement (the ranks hold theirs). */
    Stria__V1__JobSpec spec;
    Stria__V1__JobSpec__Window window;
    char label[STRIA_COORD_MAX_LABEL + 1];
    stria_call_shape_t call; /* the job's one call, an owning copy */
    char client[64];         /* the submitting client's host address */
    /* SubmitJobRequest.submit_key (keyed): a resend of the submission gets
     * this job back */
    uint8_t submit_key[STRIA__SUBMIT_KEY_BYTES];
    bool keyed;
    /* sharded jobs (stria_client_submit): a pass starts when every rank
     * arrived; a rank missing arrival_timeout_s after the first fails it */
    uint32_t arrival_pass;   /* 1 + the pass ranks arrive at now; 0: none yet */
    double arrival_deadline; /* stria_time_now(); 0: nobody waits */
    bool arrival_backward;
    bool placed;

    uint32_t n_ranks;
    stria__crank_t *ranks;
    uint64_t shard_tokens; /* padded, equal for every rank */
    uint64_t mem_per_rank;
    bool reserved; /* memory reserved on the members */

    /* The job's milestones as GetJob reports them (wall clock, ms; 0: not
     * reached); last_activity_ms is filled from last_activity on report. */
    Stria__V1__JobTimings times;
    double last_activity; /* stria_time_now() */
    char failure[512];
    /* The ranks' step times of the latest forward [0] and backward [1] pass
     * (coord_timeline.c): one packed PassTimeline per rank, NULL until it
     * reports. */
    struct {
        uint32_t pass;
        uint8_t **buf;
        size_t *len;
    } tl[2];
    stria_status_t failure_status; /* how workers report the failure; 0: as they see fit */
    /* FAILED: the failure is retryable (JobInfo.failure_retryable), and the
     * worker it is blamed on (0: none in particular). */
    bool failure_retryable;
    uint64_t blamed_worker;
    /* Sharded jobs that lose a worker (coord_replace.c): the job replacing
     * this one (0: none), the one it replaces, how many replacements came
     * before it, and until when (stria_time_now()) a failed one waits for a
     * member's death verdict to be replaced (0: it never did; -1: the wait
     * is over, or it was tried). */
    uint64_t replaced_by, replaces;
    uint32_t generation;
    Stria__V1__JobState failed_in; /* the state it was in when it failed */
    double replace_until;
} stria__cjob_t;

struct stria_coord {
    stria_rpc_server_t *server;
    double heartbeat_period_s;
    double job_ttl_s;
    uint32_t max_workers, max_jobs, history, max_jobs_per_client;
    uint32_t max_sessions_per_client;
    uint64_t max_session_bytes_per_client; /* 0: no limit */
    uint32_t max_step_timeout_ms;
    double worker_retention_s;
    bool auth_required;
    double last_tick; /* stria_time_now() of the last tick */
    double started_at;
    uint64_t started_ms;

    stria__cworker_t **workers; /* registration order; never freed before stop */
    uint32_t n_workers;
    uint64_t next_worker_id;

    stria__index_t worker_ids; /* (id, 0) -> worker of the table */
    stria__index_t job_ids;    /* (id, 0) -> job of the table */
    stria__index_t members;    /* (job id, worker id) -> rank + 1, unfinished jobs */

    stria__cjob_t **jobs; /* submission order: finished ones kept as history */
    uint32_t n_jobs;
    size_t cap_jobs;
    uint64_t jobs_submitted, jobs_failed;

    size_t timeline_bytes; /* held by every job's tl, at most STRIA__TIMELINE_BUDGET */

    /* Restart recovery (coord_recover.c): jobs the workers describe within
     * recovery_window_s of start are rebuilt. */
    double recovery_window_s; /* 0: none */
    double recover_until;     /* stria_time_now(); 0: the window is over */
    stria__rjob_t **rjobs;    /* jobs some but not all ranks were described of */
    uint32_t n_rjobs;
    size_t cap_rjobs;
    uint64_t jobs_recovered, jobs_unrecovered;
    /* The worker of the ranks nobody described (a job failed at the end of
     * the window); never in the worker table. */
    stria__cworker_t missing;

    stria_metrics_t *metrics;
    bool notify_status;
    char last_status[256]; /* last STATUS= sent to the service manager */
};

/* ---- shared by the coordinator's rooms ------------------------------------ */

#define S_PENDING          STRIA__V1__JOB_STATE__JOB_STATE_PENDING
#define S_LOADING          STRIA__V1__JOB_STATE__JOB_STATE_LOADING
#define S_RUNNING_FORWARD  STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_FORWARD
#define S_FORWARD_DONE     STRIA__V1__JOB_STATE__JOB_STATE_FORWARD_DONE
#define S_RUNNING_BACKWARD STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_BACKWARD
#define S_DONE             STRIA__V1__JOB_STATE__JOB_STATE_DONE
#define S_FAILED           STRIA__V1__JOB_STATE__JOB_STATE_FAILED
#define S_CANCELLED        STRIA__V1__JOB_STATE__JOB_STATE_CANCELLED
#define S_RELEASED         STRIA__V1__JOB_STATE__JOB_STATE_RELEASED
#define S_EXPIRED          STRIA__V1__JOB_STATE__JOB_STATE_EXPIRED

#define STRIA__REQ(type, call) ((const type *)stria_rpc_call_request(call))

static inline bool stria__terminal(Stria__V1__JobState s)
{
    return s >= S_FAILED;
}

static inline const char *stria__state_name(Stria__V1__JobState s)
{
    static const char *const names[] = {
        "unspecified",  "pending",          "loading", "running forward",
        "forward done", "running backward", "done",    "failed",
        "cancelled",    "released",         "expired"};
    return (unsigned)s < sizeof(names) / sizeof(names[0]) ? names[s] : "unknown";
}

static inline Stria__V1__WorkerState stria__worker_state(const stria__cworker_t *w)
{
    if (w->left)
        return STRIA__V1__WORKER_STATE__WORKER_STATE_LEFT;
    if (w->dead)
        return STRIA__V1__WORKER_STATE__WORKER_STATE_DEAD;
    return w->draining ? STRIA__V1__WORKER_STATE__WORKER_STATE_DRAINING
                       : STRIA__V1__WORKER_STATE__WORKER_STATE_HEALTHY;
}

/* Wall clock in milliseconds since the Unix epoch. */
static inline uint64_t stria__coord_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- coord_scratch.c: the scratch list replies are built on -------------- */

/* Nested reply messages live in this scratch list until the reply is
 * serialised. */
typedef struct stria__scratch_chunk {
    union {
        struct stria__scratch_chunk *next;
        max_align_t align;
    } h;
} stria__scratch_chunk_t;

typedef struct {
    stria__scratch_chunk_t *chunks;
    bool oom;
} stria__scratch_t;

/* n zeroed bytes on the list; NULL (and oom set) when out of memory. */
void *stria__scratch_alloc(stria__scratch_t *b, size_t n);
/* Frees what was built (stria__reply_send() does it too). */
void stria__scratch_free(stria__scratch_t *b);

/* ---- coord_metrics.c: metrics series, the STATUS= line ------------------- */

/* Errors the coordinator counts, by kind (stria_coordinator_errors_total). */
typedef enum {
    STRIA__E_SUBMIT_INVALID = 0, /* a spec outside the limits */
    STRIA__E_SUBMIT_NO_WORKERS,  /* fewer ring workers than the job asks for */
    STRIA__E_SUBMIT_NO_MEMORY,   /* no window of workers can ever hold the job */
    STRIA__E_SUBMIT_BUSY,        /* job limit reached, or no_queue and no room now */
    STRIA__E_PASS_FAILED,        /* a worker reported a failed pass */
    STRIA__E_WORKER_DEAD,        /* a worker missed its heartbeats */
    STRIA__E_WORKER_RESTARTED,   /* a worker came back as a new process */
    STRIA__E_BAD_REQUEST,        /* a malformed worker request */
    STRIA__E_COUNT,
} stria__error_kind_t;

/* Series that exist from the start, so that rates and alerts see zeros. */
void stria__cmet_init(stria_coord_t *co);
/* At a tick: the gauges (workers and jobs by state, each worker's), the
 * uptime, and the STATUS= line when it changed. */
void stria__cmet_update(stria_coord_t *co);
void stria__cmet_count_error(stria_coord_t *co, stria__error_kind_t kind);
void stria__cmet_count_finished(stria_coord_t *co, Stria__V1__JobState state);
/* A job admitted (SubmitJob). */
void stria__cmet_count_submitted(stria_coord_t *co);
/* A pass completed on every rank; times in Unix milliseconds. */
void stria__cmet_count_pass(stria_coord_t *co, bool backward, uint64_t started_ms,
                            uint64_t done_ms);
/* The loop was stalled for `seconds` (0: only makes the series). */
void stria__cmet_count_stall(stria_coord_t *co, double seconds);
/* Drops a worker's per-worker metric series (they are made again when
 * needed). */
void stria__cmet_worker_forget(stria_coord_t *co, stria__cworker_t *w);

/* ---- coord_timeline.c: the passes' step times the workers report --------- */

#define STRIA__TIMELINE_BUDGET ((size_t)256 << 20)
/* Keeps rank `rank`'s timeline t (a ReportJob's, or a session call's from a
 * heartbeat) if well-formed, else ignores it with a warning; drops the
 * oldest jobs' timelines beyond the budget. */
void stria__timeline_store(stria_coord_t *co, stria__cjob_t *j, uint32_t rank,
                           const Stria__V1__PassTimeline *t);
/* Frees a job's timelines. */
void stria__timeline_drop(stria_coord_t *co, stria__cjob_t *j);
/* The job's timelines into info->timelines, unpacked into *held (an array
 * of n_held messages to free with stria__timeline_release() once the reply
 * is built). False when out of memory. */
bool stria__timeline_fill(stria__scratch_t *b, const stria__cjob_t *j, Stria__V1__JobInfo *info,
                          Stria__V1__PassTimeline ***held, size_t *n_held);
void stria__timeline_release(Stria__V1__PassTimeline **held, size_t n_held);

/* ---- coord_jobs.c: the job (and session) table ---------------------------- */

/* Checks a submitted spec; the message names the field. */
stria_status_t stria__cjob_spec_check(const Stria__V1__JobSpec *s);

stria__cjob_t *stria__cjob_find(stria_coord_t *co, uint64_t id);
/* The rank of worker w in unfinished job j, or -1. */
int stria__cjob_rank_of(const stria_coord_t *co, const stria__cjob_t *j, const stria__cworker_t *w);
/* Whether w is a worker of one of j's ranks. */
bool stria__cjob_has_worker(const stria__cjob_t *j, const stria__cworker_t *w);
/* Appends a job (state PENDING) on the workers ring[0 .. n) (fallback[r]:
 * rank r placed off its host) to the job table, its id, secret and ring key
 * those of `keys` (new ones from stria__recover_new_keys(), or a rebuilt
 * job's). NULL when out of memory. */
stria__cjob_t *stria__cjob_add(stria_coord_t *co, const Stria__V1__JobSpec *s,
                               const stria_layout_t *layout, stria__cworker_t **ring,
                               const bool *fallback, uint32_t n, uint64_t need, const char *client,
                               const stria__cjob_t *keys);
/* Frees a job (stria_coord_stop(); the tick prunes the others). */
void stria__cjob_free(stria_coord_t *co, stria__cjob_t *j);
/* Drops the oldest finished jobs beyond the history size (at a tick only:
 * handlers may hold pointers to finished jobs). */
void stria__cjob_prune(stria_coord_t *co);

/* Pending and active jobs, of one client (its host address) or of all
 * (NULL). */
uint32_t stria__cjob_count_unfinished(const stria_coord_t *co, const char *client);
/* A client's open sessions and the memory they hold on the workers. */
uint32_t stria__cjob_count_sessions(const stria_coord_t *co, const char *client,
                                    uint64_t *bytes_out);
/* The unfinished job an earlier copy of a submission made (the same client
 * host and submit_key), or NULL. */
stria__cjob_t *stria__cjob_submitted_before(const stria_coord_t *co, const char *client,
                                            const ProtobufCBinaryData *key);
/* A pending job's place in the queue (1: next); 0 for any other. */
uint32_t stria__cjob_queue_position(const stria_coord_t *co, const stria__cjob_t *j);
/* The spec's placement (the ranks hold it) into s, one entry per rank, on
 * the scratch list; false when out of memory. */
bool stria__cjob_placement(stria__scratch_t *b, const stria__cjob_t *j, Stria__V1__JobSpec *s);

/* A job's memory on its members: reserved while it runs (and while a failed
 * job waits for its replacement); unreserve does nothing when none is. */
void stria__cjob_reserve(stria__cjob_t *j);
void stria__cjob_unreserve(stria__cjob_t *j);
/* Moves a job to a terminal state (false: it was in one already: the first
 * verdict stands). */
bool stria__cjob_finish(stria_coord_t *co, stria__cjob_t *j, Stria__V1__JobState state,
                        const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* A job that just failed (stria__cjob_finish() returned true) failed for a
 * cause outside it: retryable, blamed on worker w (NULL: none). */
void stria__cjob_retryable(stria__cjob_t *j, const stria__cworker_t *w);
/* A job rebuilt after a restart (coord_recover.c) is active again in
 * `state`: its memory reserved on its workers. */
void stria__cjob_adopt(stria_coord_t *co, stria__cjob_t *j, Stria__V1__JobState state);
/* Starts the queued jobs that fit, in submission order; fails the queued
 * jobs of dead or draining workers. */
void stria__cjob_schedule(stria_coord_t *co);
/* Fails every unfinished job that uses worker w (retryable, blamed on w). */
void stria__cjob_fail_worker(stria_coord_t *co, stria__cworker_t *w, const char *why);

/* A sharded job's arrival at pass `pass` of rank r (a worker's STARTED
 * report); whether every rank has arrived. */
bool stria__cjob_arrive(stria__cjob_t *j, uint32_t r, uint32_t pass, bool backward);
/* Adds rank r to a list "0, 3, 7" in out[0 .. len) (used: its length, n:
 * ranks listed so far), ending in ", ..." when it runs out of room. */
void stria__cjob_rank_list_add(char *out, size_t len, size_t *used, uint32_t *n, uint32_t r);
/* At a tick: a sharded job whose ranks did not all arrive in time fails,
 * naming them; true when it did. */
bool stria__cjob_arrival_expired(stria_coord_t *co, stria__cjob_t *j, double now);

/* ---- coord_place.c: ring order; where a job runs -------------------------- */

/* The ring: healthy, non-draining workers by (host, RPC address). `out` has
 * room for every worker. */
uint32_t stria__place_ring(const stria_coord_t *co, stria__cworker_t **out);
/* Workers in ring order, then draining, then dead ones (each by host and
 * address); *n_ring_out of them form the ring. NULL when out of memory. */
stria__cworker_t **stria__place_ordered(const stria_coord_t *co, uint32_t *n_ring_out);
/* A window of n consecutive ring workers for a job needing `need` bytes
 * each: the first that can start now, else the least loaded with the
 * capacity; -1 when none has it (*best_cap_out: the largest per-rank
 * capacity of any window). */
int64_t stria__place_window(stria_coord_t *co, stria__cworker_t **ring, uint32_t count, uint32_t n,
                            uint64_t need, bool *now_out, uint64_t *best_cap_out);
/* The workers a spec's placement names, rank by rank into out[0 .. n)
 * (fallback[r]: off its host); a refusal names the rank and host. */
stria_status_t stria__place_named(stria_coord_t *co, const Stria__V1__JobSpec *s,
                                  stria__cworker_t **ring, uint32_t count, uint32_t n,
                                  uint64_t need, stria__cworker_t **out, bool *fallback,
                                  bool *now_out);
/* A worker of the ring for rank r of job j in place of its lost worker: on
 * the rank's placed host (device preferred; another host only when the spec
 * allows fallback), else any, preferring the lost worker's host; not a
 * member of j nor in taken[0 .. n_taken); with room now, idle ones first,
 * then the lightest load. NULL when none (*why says why). */
stria__cworker_t *stria__place_spare(stria_coord_t *co, const stria__cjob_t *j, uint32_t r,
                                     stria__cworker_t **taken, uint32_t n_taken, bool *fallback,
                                     char *why, size_t why_len);

/* ---- coord_recover.c: jobs rebuilt after a restart; new jobs' keys -------- */

/* Whether the recovery window is open. */
bool stria__recover_active(const stria_coord_t *co);
/* Seconds left of the recovery window (0: over). */
double stria__recover_left(const stria_coord_t *co);
/* A job of which some ranks were described and not all yet. */
bool stria__recover_pending(const stria_coord_t *co, uint64_t id);
/* A new job id and ring key into j (the secret: a new one unless
 * keep_secret): the id unused by the jobs kept and the jobs being rebuilt. */
stria_status_t stria__recover_new_keys(stria_coord_t *co, stria__cjob_t *j, bool keep_secret);
/* One description of a worker's heartbeat; false: the worker must drop the
 * job (refused, or over); *describe: ask the worker to describe again. */
bool stria__recover_held(stria_coord_t *co, stria_rpc_call_t *call, stria__cworker_t *w,
                         const Stria__V1__HeldJob *h, bool *describe);
/* A worker died or is forgotten: its descriptions no longer count. */
void stria__recover_worker_gone(stria_coord_t *co, const stria__cworker_t *w);
/* At the end of the window: fails the jobs with ranks nobody described;
 * true when it did anything. */
bool stria__recover_tick(stria_coord_t *co, double now);
void stria__recover_free(stria_coord_t *co);

/* ---- coord_replace.c: a sharded job's lost worker replaced ---------------- */

/* A sharded job that lost a worker is replaced by a job of the same secret
 * and ranks, the lost worker's rank on a spare (the ring size of a sharded
 * job must stay). A failed sharded job's first report (a peer's: its link
 * broke) comes before the verdict on the worker, so it waits for it a few
 * heartbeat periods. */
#define STRIA__MAX_GENERATIONS 8 /* replacements of one job at most */
/* A sharded job j just failed retryably without a verdict on a worker yet:
 * it waits for one, keeping its members' memory reserved meanwhile (so no
 * job queued after it takes the room its replacement needs). */
void stria__replace_wait(stria_coord_t *co, stria__cjob_t *j);
/* Whether j waits for a verdict now (JobInfo.replacement_pending). */
bool stria__replace_pending(const stria__cjob_t *j);
/* Worker w was lost (died, left, restarted): every sharded job of it that
 * failed for it (or waits for a verdict) is replaced when a spare worker
 * fits; true when any was. Called after its unfinished jobs were failed. */
bool stria__replace_lost(stria_coord_t *co, stria__cworker_t *w);
/* At a tick: closes the waits past their end (no worker was lost) and
 * frees what a job no longer waiting holds; true when memory came free. */
bool stria__replace_tick(stria_coord_t *co, double now);

/* ---- coord_reply.c: worker and job records, assignments ------------------ */

/* Replies, or fails the call when building ran out of memory; frees the
 * scratch list. */
void stria__reply_send(stria__scratch_t *b, stria_rpc_call_t *call, const ProtobufCMessage *msg);
void stria__reply_worker(stria__scratch_t *b, const stria_coord_t *co, stria__cworker_t *w,
                         int ring_index, Stria__V1__WorkerInfo *out);
Stria__V1__Assignment *stria__reply_assignment(stria__scratch_t *b, const stria__cjob_t *j);
Stria__V1__JobInfo *stria__reply_job(stria__scratch_t *b, const stria_coord_t *co,
                                     const stria__cjob_t *j);

/* ---- coord_workers.c: the worker table and the workers' handlers ---------- */

stria__cworker_t *stria__cworker_find(stria_coord_t *co, uint64_t id);
/* Takes a worker out of the table, its metric series too; frees it unless
 * jobs still name it (then the last of them does). */
void stria__cworker_forget(stria_coord_t *co, stria__cworker_t *w, const char *why);
/* The registered worker a call names by id and incarnation, or NULL after
 * failing the call (not found); with `heartbeat`, a worker that left counts
 * as not registered and the message says to register again. */
stria__cworker_t *stria__cworker_of_call(stria_coord_t *co, stria_rpc_call_t *call,
                                         const char *method, uint64_t id, uint64_t incarnation,
                                         bool heartbeat);
void stria__cworker_on_register(void *ctx, stria_rpc_call_t *call);
void stria__cworker_on_heartbeat(void *ctx, stria_rpc_call_t *call);
void stria__cworker_on_report(void *ctx, stria_rpc_call_t *call);
void stria__cworker_on_deregister(void *ctx, stria_rpc_call_t *call);

/* ---- coord_clients.c: the clients' and admins' handlers ------------------- */

void stria__cclient_on_submit(void *ctx, stria_rpc_call_t *call);
void stria__cclient_on_get_job(void *ctx, stria_rpc_call_t *call);
void stria__cclient_on_release(void *ctx, stria_rpc_call_t *call);
void stria__cclient_on_cancel(void *ctx, stria_rpc_call_t *call);
void stria__cclient_on_status(void *ctx, stria_rpc_call_t *call);
void stria__cclient_on_ring(void *ctx, stria_rpc_call_t *call);
void stria__cclient_on_list_workers(void *ctx, stria_rpc_call_t *call);
void stria__cclient_on_list_jobs(void *ctx, stria_rpc_call_t *call);
void stria__cclient_on_drain(void *ctx, stria_rpc_call_t *call);

/* ---- coord.c: the tick, start and stop ------------------------------------ */

/* stria_coord_start(); with no_thread the RPC server has no thread of its
 * own and runs in stria_rpc_server_run(co->server) (tests, fuzzing). */
stria_status_t stria__coord_start(const stria_coord_params_t *p, bool no_thread,
                                  stria_coord_t **coord_out);

#endif /* STRIA_COORD_INT_H */
