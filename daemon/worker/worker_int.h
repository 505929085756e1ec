/* stria worker internals: the worker, its jobs, and what its rooms share:
 *   worker.c         start, accessors, graceful shutdown and stop
 *   worker_jobs.c    the job table, references, job creation
 *   worker_pool.c    the memory pools: admission, tensors, figures
 *   worker_data.c    PutInput, GetOutput, DropJob
 *   worker_pass.c    RunForward/RunBackward, pass threads, the job's ring pass object
 *   worker_session.c sessions: OpenSession, SessionCall, a session's pass thread and link
 *   worker_links.c   the link factories: UCX (the default) and in-process
 *   worker_coord.c   coordinator calls, reports, registration, heartbeats
 *   worker_timeline.c the step times of a pass as the report's PassTimeline
 *   worker_metrics.c the metrics
 *   worker_shm.c     the jobs' shared memory and the Unix socket of co-located clients
 *   main.c           stria-worker: flags, configuration file, service loop, signals */
#ifndef STRIA_WORKER_INT_H
#define STRIA_WORKER_INT_H

#include <pthread.h>

#include "stria.pb-c.h"
#include "stria_auth.h"
#include "stria_spec.h"
#include "stria_common.h"
#include "stria_device.h"
#include "stria_rpc.h"
#include "stria_ring.h"
#include "stria_shm.h"
#include "stria_transport.h"
#include "stria_worker.h"

/* A PutInput range that is not contiguous in the padded tensor (it crosses
 * a batch row) goes through a staging buffer of at most this size (clients
 * send 64 MiB chunks); one lives per connection at a time. */
#define STRIA__STAGING_MAX (64u << 20)
/* A GetOutput range that crosses batch rows is copied at most this much per
 * reply (the client asks again for the rest); ranges inside a row go out
 * from the tensor without a copy. With the RPC server's 64 replies in flight
 * per connection, a connection holds at most 64 MiB of copies. */
#define STRIA__COPY_MAX (1u << 20)
/* The longest step deadline a worker applies, whatever an assignment says
 * (the coordinator's --max-step-timeout bounds it further). */
#define STRIA__MAX_STEP_TIMEOUT_S 86400.0
/* Job entries of one heartbeat: the coordinator refuses more
 * (STRIA_COORD_MAX_HEARTBEAT_JOBS); a worker never holds that many. */
#define STRIA__HB_MAX_JOBS 16384
/* Seconds between trims of the host pool, so that its resident memory
 * follows the reach of the last minute or two, not the largest of the
 * process's life. Without it a soak's workers grew in 2 MiB steps that did
 * not stop: each step was the host pool's committed extent growing by a huge
 * page (10 -> 12 MiB in minute 11 of one run) while its most memory in use
 * at once stayed the same (9.6 MiB: fragmentation of the lowest-address-
 * first placement, not more jobs), the C heap flat at 4 MiB. A trim costs
 * the next allocation that reaches the range a page fault per huge page. */
#define STRIA__POOL_TRIM_S 60.0
/* Assignments fetched at once for PutInputs of jobs not held yet. */
#define STRIA__MAX_FETCHES 16

/* A job's tensors: the protocol's numbers (Stria__V1__Tensor) less one. */
typedef enum {
    STRIA__T_Q = 0,
    STRIA__T_K,
    STRIA__T_V,
    STRIA__T_DO,
    STRIA__T_O,
    STRIA__T_LSE,
    STRIA__T_DQ,
    STRIA__T_DK,
    STRIA__T_DV,
    STRIA__T_COUNT,
} stria__tensor_id_t;
_Static_assert(STRIA__T_Q == STRIA__V1__TENSOR__TENSOR_Q - 1 &&
                   STRIA__T_DO == STRIA__V1__TENSOR__TENSOR_DO - 1 &&
                   STRIA__T_O == STRIA__V1__TENSOR__TENSOR_O - 1 &&
                   STRIA__T_DV == STRIA__V1__TENSOR__TENSOR_DV - 1,
               "job tensors follow the protocol's numbering");

typedef struct stria__wsess stria__wsess_t;

/* One job held by this worker (one rank of its ring). Guarded by the worker's
 * lock, except the buffers, which stay allocated while `refs` > 0. */
typedef struct stria__wjob {
    struct stria__wjob *next;
    stria_worker_t *w;
    uint64_t id;
    int rank, n_ranks;
    stria_job_secret_t secret;              /* what its clients prove on every request */
    uint8_t ring_key[STRIA_AUTH_KEY_BYTES]; /* what its ring links prove */
    /* the spec */
    int64_t batch, seq_len, heads, kv_heads, head_dim; /* a session's: its bounds */
    stria_dtype_t dtype;
    /* the job's one call, an owning copy (its documents freed with the job);
     * a session's calls bring their own */
    stria_call_shape_t call;
    stria_layout_kind_t layout_kind;
    double step_timeout_s;
    char next_ucx[300]; /* successor's ring link address */
    /* The assignment's spec, packed: what a restarted coordinator rebuilds
     * the job from (HeldJob) */
    uint8_t *spec_pb;
    size_t spec_len;
    stria_layout_t layout;
    int64_t valid; /* real tokens of this shard; layout.shard_tokens with padding */
    /* sharded (stria_client_submit): a pass waits until every rank arrived */
    bool sharded;
    double arrival_timeout_s;
    /* tensors, padded to shard_tokens rows per batch: inputs and outputs in
     * the job dtype, LSE fp32 [batch, heads, L]: from the memory pool, or
     * (a co-located client's job, memfd >= 0) in one mapping of the job's
     * sealed memfd at mem_off */
    void *buf[STRIA__T_COUNT];
    void *mem;
    size_t mem_size;
    uint64_t mem_off[STRIA__T_COUNT];
    int memfd;
    /* On a device whose memory is not host memory (a GPU): the job's own
     * device object (a device is used by one thread at a time, and passes
     * of different jobs run at once) and device copies of buf, allocated by
     * the first pass and freed with the job. */
    stria_device_t *dev;
    void *dbuf[STRIA__T_COUNT];
    /* input bytes received, each counted once whatever the order and
     * repeats of the chunks */
    stria_ranges_t received[STRIA__T_COUNT];
    uint64_t bytes; /* memory admitted in the worker's pools */
    Stria__V1__JobState phase;
    uint32_t step, steps_total;
    uint32_t passes; /* passes started; part of the ring pass id */
    /* the job this one replaces and its generation (the assignment's
     * JobInfo.replaces, .generation), described to a restarted coordinator */
    uint64_t replaces;
    uint32_t generation;
    double last_activity;
    int refs;     /* transfers and passes using the buffers */
    bool running; /* a pass runs */
    /* the ring link of the running pass (NULL: none): dropping the job at the
     * coordinator's request aborts it, so a cancelled pass ends at its next
     * step instead of computing to the end */
    stria_link_t *link;
    /* set with the lock held (read without it by the link factory): a
     * dropped job, a shutdown that aborts passes; the running pass's link
     * connect gives up */
    bool connect_cancel;
    bool dropped; /* unlinked: the last reference frees it */
    /* The job's ring pass object, made by its first pass and destroyed with
     * the job: its working buffers (and on a GPU its device and pinned
     * buffers) serve every pass. Between passes it is bound to `parked`, a
     * link of the job's rank and ring size that fails every operation, so
     * it never points at a destroyed link. Used by the running pass only. */
    stria_ring_pass_t *pass;
    stria_link_t parked;
    char failure[512];
    /* a session (JobSpec.session; worker_session.c): batch and seq are its
     * bounds; its buffers, thread and link once opened (NULL before) */
    bool session;
    stria__wsess_t *sess;
} stria__wjob_t;

/* A job failure the heartbeat thread reports for the RPC loop (which must
 * not block on the coordinator). */
typedef struct stria__wfail {
    struct stria__wfail *next;
    uint64_t job_id;
    int rank;
    char message[512];
} stria__wfail_t;

typedef struct stria__shm_srv stria__shm_srv_t;

struct stria_worker {
    char coordinator[300];
    char *token;        /* the clients' credential, checked by this worker's RPC */
    char *worker_token; /* the workers' credential, proven to the coordinator */
    int64_t memory_bytes;
    double step_timeout_s, connect_timeout_s;
    bool notify_status;
    char rpc_address[300];
    char ucx_address[300];
    char host[256];
    uint64_t incarnation;
    stria_rpc_server_t *server;
    stria_pool_t *pool;
    bool own_pool;
    stria_device_t *dev; /* the name, description and memory; jobs open their own on a GPU */
    bool own_dev;
    bool dev_staged;      /* device memory is not host memory: jobs stage through it */
    stria_ucx_ctx_t *ucx; /* the default link factory's context; NULL with another factory */
    stria_worker_link_factory_t factory;
    /* Memory pools (worker_pool.c), kept for the worker's life: host always;
     * device and pinned on a staged device. mem_jobs holds the job tensors
     * (host, or pinned when staged). Thread-safe on their own. */
    stria_mempool_t *mem_host, *mem_dev, *mem_pinned, *mem_jobs;
    stria_allocator_t alloc_host, alloc_dev, alloc_pinned;
    bool has_device_index; /* cuda:N's N, else the params' (stria-worker --instance) */
    uint32_t device_index;
    stria__shm_srv_t *shm; /* the co-located clients' socket; NULL: none */
    char shm_socket[STRIA_SHM_MAX_PATH];

    pthread_mutex_t coord_lock; /* one coordinator call at a time */
    stria_rpc_client_t *coord;
    /* The session of the last reply from the coordinator (under
     * coord_lock): what held jobs' keys are sealed under. */
    stria_auth_session_t coord_session;

    pthread_mutex_t lock; /* everything below */
    pthread_cond_t cv;
    stria__wjob_t *jobs;
    uint64_t worker_id;
    uint32_t heartbeat_ms;
    int running_passes;
    int session_threads; /* sessions' pass threads still running */
    int fetching;        /* threads fetching an assignment for a PutInput */
    bool stopping;       /* shutting down: no new jobs or passes */
    bool draining;       /* the coordinator drains this worker: sessions move off it */
    bool shut_down;      /* stria_worker_shutdown() ran */
    bool heartbeat_stop; /* running passes are over: the heartbeat thread ends */
    bool abort_passes;   /* shutdown: running passes must fail now */
    char abort_reason[96];
    stria__wfail_t *fails; /* failures to report, oldest last */
    stria_link_t **links;  /* ring links of the running passes */
    size_t n_links, cap_links;
    pthread_t hb_thread;
    bool hb_started;
    bool registered;
    /* The next heartbeat describes the held jobs in full (HeldJob): after a
     * registration, or when the coordinator asks. */
    bool describe;
    double last_heartbeat;

    /* metrics */
    stria_metrics_t *metrics;
    bool own_metrics;
    stria_metric_t *m_passes[2], *m_pass_fail[2], *m_pass_s[2], *m_call_s[2], *m_steps[2],
        *m_step_compute, *m_step_wait, *m_bytes_sent, *m_bytes_recv, *m_in_bytes, *m_out_bytes,
        *m_memory, *m_jobs, *m_hb_age, *m_err_timeout, *m_err_peer, *m_err_pass, *m_err_coord;
    /* per pool (host, device, pinned): reserved, in use, high water, committed */
    stria_metric_t *m_pool[3][4];
    /* what the ring link's listener refused (stria_ucx_ctx_stats_t), and
     * the counts already added to them */
    stria_metric_t *m_ring_refused[4];
    stria_ucx_ctx_stats_t ring_seen;
    double pool_trim_at; /* the next trim of the host pool (stria__wpool_trim()) */
    /* the C heap: in use, free in the arenas (glibc's mallinfo2()) */
    stria_metric_t *m_heap[2];
};

/* ---- worker_data.c ---- */
/* The job tensor of an input (Q, K, V, dO), or, with `output`, of an output
 * (O, LSE, dQ, dK, dV); -1 for any other. */
int stria__job_tensor(Stria__V1__Tensor t, bool output);

/* ---- worker_jobs.c ---- */
stria__wjob_t *stria__wjob_find(stria_worker_t *w, uint64_t id);
/* Finds (or, with `create`, creates from the coordinator's assignment, its
 * tensors from the memory pool) the job of a request for `rank` and takes a
 * reference. Lock not held. */
stria_status_t stria__wjob_get(stria_worker_t *w, uint64_t id, uint32_t rank, bool create,
                               stria__wjob_t **out);
/* As stria__wjob_get(), then checks the request's proof of the job's secret
 * (the job is released again when it fails). */
stria_status_t stria__wjob_get_checked(stria_worker_t *w, stria_rpc_call_t *call, uint64_t id,
                                       uint32_t rank, bool create, stria__wjob_t **out);
/* The job failed here (its client is gone): reported to the coordinator by
 * the heartbeat thread, dropped now. Lock held. */
/* A co-located client's attach: finds or creates the job with its tensors in
 * a sealed memfd (never pool memory: a client maps what it is given, and a
 * pool region would show it other jobs' bytes); `secret` must be the job's
 * (STRIA_ERR_AUTH, checked before a job is created). A job whose tensors
 * came over TCP (pool memory) is refused. */
stria_status_t stria__wjob_get_shared(stria_worker_t *w, uint64_t id, uint32_t rank,
                                      const stria_job_secret_t *secret, stria__wjob_t **out);
void stria__wjob_fail_locked(stria_worker_t *w, stria__wjob_t *j, const char *message);
void stria__wjob_unref(stria_worker_t *w, stria__wjob_t *j);
/* Unlinks a job and aborts its running pass; frees it, or marks it to be
 * freed by its last user. Lock held. */
void stria__wjob_drop_locked(stria_worker_t *w, stria__wjob_t *j);
/* Rows of a tensor (outer index) and bytes per token. */
void stria__wjob_geometry(const stria__wjob_t *j, int t, int64_t *outer_out, size_t *row_out);
/* Bytes of the compact (real tokens only) form of a tensor. */
uint64_t stria__wjob_compact_bytes(const stria__wjob_t *j, int t);
void stria__wjob_copy_range(const stria__wjob_t *j, int t, uint64_t off, uint64_t len,
                            void *compact, bool to_padded);
void *stria__wjob_direct_range(const stria__wjob_t *j, int t, uint64_t off, uint64_t len);

/* ---- worker_pool.c ---- */
stria_status_t stria__wpool_start(stria_worker_t *w);
void stria__wpool_stop(stria_worker_t *w);
/* Reserves a job's memory in the pools that hold it (j->bytes = need) or
 * refuses with STRIA_ERR_NO_MEMORY naming the job, the need and the offer. */
stria_status_t stria__wpool_admit(stria_worker_t *w, stria__wjob_t *j, uint64_t need);
void stria__wpool_retire(stria_worker_t *w, stria__wjob_t *j);
/* Memory admitted to the held jobs; the figures of the pool that bounds
 * them (device on a staged device, else host). */
uint64_t stria__wpool_admitted(stria_worker_t *w);
void stria__wpool_figures(stria_worker_t *w, stria_mempool_stats_t *out);
/* A job's tensors (padded input rows zeroed), and their release. */
stria_status_t stria__wpool_tensors(stria_worker_t *w, stria__wjob_t *j);
void stria__wpool_tensors_free(stria_worker_t *w, stria__wjob_t *j);
/* Points a job's device object at the device and pinned pools. */
stria_status_t stria__wpool_device(stria_worker_t *w, stria_device_t *dev);
/* Staging of a transfer (host pool); NULL when out of memory. */
void *stria__wpool_scratch(stria_worker_t *w, size_t bytes);
void stria__wpool_scratch_free(stria_worker_t *w, void *p);
/* Sets the pool gauges. */
void stria__wpool_publish(stria_worker_t *w);
/* Every STRIA__POOL_TRIM_S (the heartbeat thread calls it at each beat):
 * gives back the host pool's committed memory that no allocation reached
 * since the previous trim (stria_mempool_trim()). Lock held. */
void stria__wpool_trim(stria_worker_t *w);

/* ---- worker_data.c, worker_pass.c: the Worker service's handlers ---- */
stria_status_t stria__w_on_put_payload(void *ctx, stria_rpc_call_t *call, uint64_t payload_len,
                                       void **buf_out);
void stria__w_on_put(void *ctx, stria_rpc_call_t *call);
void stria__w_on_get(void *ctx, stria_rpc_call_t *call);
void stria__w_on_drop(void *ctx, stria_rpc_call_t *call);
void stria__w_on_forward(void *ctx, stria_rpc_call_t *call);
void stria__w_on_backward(void *ctx, stria_rpc_call_t *call);
/* The job's parked link (what its pass objects are bound to between
 * passes, and a session's while its link is replaced): fails every
 * operation. */
void stria__wpass_park_init(stria__wjob_t *j);
/* Destroys a job's pass object (with the job). */
void stria__wpass_free(stria__wjob_t *j);
/* Connects the job's ring link (to its next rank) through the link factory,
 * for ring number ring_id; the caller publishes the link. */
stria_status_t stria__wjob_connect(stria_worker_t *w, stria__wjob_t *j, uint32_t ring_id,
                                   stria_link_t **link_out);
/* The ring engine's shape of call c on this job's heads, dims and dtype (a
 * job's pass and a session's call alike; documents borrowed from c). */
stria_ring_shape_t stria__wjob_ring_shape(const stria__wjob_t *j, const stria_call_shape_t *c);

/* ---- worker_session.c ---- */
void stria__w_on_open_session(void *ctx, stria_rpc_call_t *call);
stria_status_t stria__w_on_call_payload(void *ctx, stria_rpc_call_t *call, uint64_t payload_len,
                                        void **buf_out);
void stria__w_on_call(void *ctx, stria_rpc_call_t *call);
/* A dropped session's thread ends (lock held); its memory goes with the
 * job (stria__wsess_free(), after the thread's reference). */
void stria__wsess_stop_locked(stria__wjob_t *j);
void stria__wsess_free(stria_worker_t *w, stria__wjob_t *j);
/* The session's calls for a heartbeat (lock held). */
void stria__wsess_stats_locked(const stria__wjob_t *j, Stria__V1__SessionStats *out);
/* A co-located client's arena for its session's rank (ShmRequest
 * OP_ARENA): the secret checked, the memfd checked (sealed, not hugetlbfs,
 * of `size` bytes within the rank's bound, no holes) and mapped; fd stays
 * the caller's. Closed: its connection went, it is unmapped between calls. */
stria_status_t stria__wsess_arena(stria_worker_t *w, uint64_t job_id, uint32_t rank,
                                  const stria_job_secret_t *secret, int fd, uint64_t size);
void stria__wsess_arena_closed(stria_worker_t *w, uint64_t job_id, uint32_t rank);

/* ---- worker_coord.c ---- */
stria_status_t stria__wcoord_call(stria_worker_t *w, uint32_t method, const ProtobufCMessage *req,
                                  stria_rpc_reply_t *reply);
/* Reports an event of job j; returns the job's state at the coordinator
 * after the report (a terminal one: the job is over there), or
 * JOB_STATE_UNSPECIFIED when the coordinator could not be told. */
Stria__V1__JobState stria__wcoord_report(stria_worker_t *w, const stria__wjob_t *j,
                                         Stria__V1__ReportJobRequest__Event ev,
                                         const char *message);
/* The same with the pass's step times (NULL: none). */
Stria__V1__JobState stria__wcoord_report_pass(stria_worker_t *w, const stria__wjob_t *j,
                                              Stria__V1__ReportJobRequest__Event ev,
                                              const char *message,
                                              Stria__V1__PassTimeline *timeline);
/* The heartbeat thread: registers, heartbeats, drops what the coordinator
 * names; ends at heartbeat_stop. */
void *stria__wcoord_thread(void *arg);
/* Deregisters (or reports every unfinished job failed) with `reason`. */
void stria__wcoord_leave(stria_worker_t *w, const char *reason);

/* ---- worker_timeline.c ---- */
/* The step times of a pass object's last pass (a job's, or a session's
 * call) as a PassTimeline (msg), with the memory behind it. */
typedef struct {
    Stria__V1__PassTimeline msg;
    Stria__V1__StepTimes *entries, **ptrs;
    uint64_t *spans;
} stria__wtimeline_t;
/* STRIA_ERR_NOT_FOUND: nothing recorded; STRIA_ERR_NO_MEMORY. No message is
 * set: a pass goes on without its timeline. */
stria_status_t stria__wtimeline_build(const stria__wjob_t *j, const stria_ring_pass_t *rp,
                                      uint32_t pass, bool backward, stria__wtimeline_t *tl);
void stria__wtimeline_free(stria__wtimeline_t *tl);
/* The step times of a session's latest sampled call (worker_session.c), if
 * no heartbeat took them yet: moved to *out, which the caller frees (lock
 * held). */
bool stria__wsess_timeline_take_locked(stria__wjob_t *j, stria__wtimeline_t *out);
/* Fills the state of a STARTED report: every rank arrived; the job's failure
 * text and the status to fail a pass with. */
typedef struct {
    bool all_arrived;
    stria_status_t failure_status;
    bool failure_retryable; /* the coordinator's verdict on the job's failure */
    char failure[512];
} stria__warrival_t;
Stria__V1__JobState stria__wcoord_report_started(stria_worker_t *w, const stria__wjob_t *j,
                                                 Stria__V1__ReportJobRequest__Event ev,
                                                 uint32_t pass, stria__warrival_t *out);
/* Reports a failed pass (with its step times, NULL: none) and whether the
 * worker judges it retryable; returns the verdict that stands: the
 * coordinator's when the job is over there (the first failure it recorded,
 * or not retryable when cancelled or expired), else the worker's. */
bool stria__wcoord_report_failed(stria_worker_t *w, const stria__wjob_t *j, const char *message,
                                 Stria__V1__PassTimeline *timeline, bool retryable);
/* Reports the failures queued by stria__wjob_fail_locked(). */
void stria__wcoord_report_fails(stria_worker_t *w);

/* ---- worker_shm.c ---- */
/* The job's tensors in one shared mapping (a sealed memfd; anonymous memory
 * where memfds are not available), zero-filled; and its release. */
stria_status_t stria__wjob_mem_alloc(stria__wjob_t *j);
/* Before a pass of a job in a memfd: allocates and maps the pass's outputs
 * in bulk (no page faults in the pass). */
void stria__wjob_mem_prepare(stria__wjob_t *j, bool backward);
void stria__wjob_mem_free(stria__wjob_t *j);
/* The Unix socket of co-located clients in `dir` (its path in
 * w->shm_socket); stop closes it and its connections. */
stria_status_t stria__shm_start(stria_worker_t *w, const char *dir);
void stria__shm_stop(stria_worker_t *w);

/* ---- worker_metrics.c ---- */
void stria__wmetrics_init(stria_worker_t *w);
/* Adds what the worker's UCX context refused since the last call to the
 * metrics (heartbeat thread). */
void stria__wmetrics_ring(stria_worker_t *w);
/* Sets the C heap gauges (glibc 2.33 and later; nothing elsewhere). */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
#define STRIA__HAVE_MALLINFO2 1
#endif
void stria__wmetrics_heap(stria_worker_t *w);

#endif
