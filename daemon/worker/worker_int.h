/* stria worker internals: the worker, its jobs, and what its rooms share:
 *   worker.c         start, accessors, graceful shutdown and stop
 *   worker_jobs.c    the job table, references, memory accounting, job creation
 *   worker_data.c    PutInput, GetOutput, DropJob
 *   worker_pass.c    RunForward/RunBackward, pass threads, the job's ring pass object
 *   worker_links.c   the link factories: UCX (the default) and in-process
 *   worker_coord.c   coordinator calls, reports, registration, heartbeats
 *   worker_metrics.c the metrics
 *   worker_shm.c     the jobs' shared memory and the Unix socket of co-located clients
 *   main.c           stria-worker: flags, configuration file, service loop, signals */
#ifndef STRIA_WORKER_INT_H
#define STRIA_WORKER_INT_H

#include <pthread.h>

#include "stria.pb-c.h"
#include "stria_spec.h"
#include "stria_common.h"
#include "stria_device.h"
#include "stria_rpc.h"
#include "stria_ring.h"
#include "stria_shm.h"
#include "stria_transport.h"
#include "stria_worker.h"

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

/* One job held by this worker (one rank of its ring). Guarded by the worker's
 * lock, except the buffers, which stay allocated while `refs` > 0. */
typedef struct stria__wjob {
    struct stria__wjob *next;
    stria_worker_t *w;
    uint64_t id;
    int rank, n_ranks;
    /* the spec */
    int64_t batch, seq, heads, kv_heads, head_dim;
    stria_dtype_t dtype;
    bool causal;
    stria_job_masks_t masks; /* documents and window, owned */
    stria_layout_kind_t layout_kind;
    float scale;
    double step_timeout_s;
    char next_ucx[300]; /* successor's ring link address */
    stria_layout_t layout;
    int64_t valid; /* real tokens of this shard; layout.shard_tokens with padding */
    /* sharded (stria_client_submit): a pass waits until every rank arrived */
    bool sharded;
    double arrival_timeout_s;
    char secret[64]; /* the job's secret, from the assignment */
    /* tensors, padded to shard_tokens rows per batch: inputs and outputs in
     * the job dtype, LSE fp32 [batch, heads, L]; all in one mapping of the
     * job's memfd (memfd -1: anonymous memory, not shareable) at mem_off */
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
    uint64_t bytes; /* memory held */
    Stria__V1__JobState phase;
    uint32_t step, steps_total;
    uint32_t passes; /* passes started; part of the ring pass id */
    double last_activity;
    int refs;     /* transfers and passes using the buffers */
    bool running; /* a pass runs */
    /* the ring link of the running pass (NULL: none): dropping the job at the
     * coordinator's request aborts it, so a cancelled pass ends at its next
     * step instead of computing to the end */
    stria_link_t *link;
    bool dropped; /* unlinked: the last reference frees it */
    /* The job's ring pass object, made by its first pass and destroyed with
     * the job: its working buffers (and on a GPU its device and pinned
     * buffers) serve every pass. Between passes it is bound to `parked`, a
     * link of the job's rank and ring size that fails every operation, so
     * it never points at a destroyed link. Used by the running pass only. */
    stria_ring_pass_t *pass;
    stria_link_t parked;
    char failure[512];
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
    char *token;
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
    bool has_device_index; /* cuda:N's N, else the params' (stria-worker --instance) */
    uint32_t device_index;
    stria__shm_srv_t *shm; /* the co-located clients' socket; NULL: none */
    char shm_socket[STRIA_SHM_MAX_PATH];

    pthread_mutex_t coord_lock; /* one coordinator call at a time */
    stria_rpc_client_t *coord;

    pthread_mutex_t lock; /* everything below */
    pthread_cond_t cv;
    stria__wjob_t *jobs;
    uint64_t worker_id;
    uint32_t heartbeat_ms;
    uint64_t memory_used;
    int running_passes;
    bool stopping;       /* shutting down: no new jobs or passes */
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
    double last_heartbeat;

    /* metrics */
    stria_metrics_t *metrics;
    bool own_metrics;
    stria_metric_t *m_passes[2], *m_pass_fail[2], *m_pass_s[2], *m_steps[2], *m_step_compute,
        *m_step_wait, *m_bytes_sent, *m_bytes_recv, *m_in_bytes, *m_out_bytes, *m_memory, *m_jobs,
        *m_hb_age, *m_err_timeout, *m_err_peer, *m_err_pass, *m_err_coord;
};

/* ---- worker_jobs.c ---- */
stria__wjob_t *stria__wjob_find(stria_worker_t *w, uint64_t id);
/* Finds (or, with `create`, creates from the coordinator's assignment) the
 * job of a request for `rank` and takes a reference. With `secret` (not
 * NULL), it must be the job's (STRIA_ERR_AUTH), checked before a job is
 * created. Lock not held. */
stria_status_t stria__wjob_get(stria_worker_t *w, uint64_t id, uint32_t rank, bool create,
                               const char *secret, stria__wjob_t **out);
/* The job failed here (its client is gone): reported to the coordinator by
 * the heartbeat thread, dropped now. Lock held. */
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

/* ---- worker_data.c, worker_pass.c: the Worker service's handlers ---- */
stria_status_t stria__w_on_put_payload(void *ctx, stria_rpc_call_t *call, uint64_t payload_len,
                                       void **buf_out);
void stria__w_on_put(void *ctx, stria_rpc_call_t *call);
void stria__w_on_get(void *ctx, stria_rpc_call_t *call);
void stria__w_on_drop(void *ctx, stria_rpc_call_t *call);
void stria__w_on_forward(void *ctx, stria_rpc_call_t *call);
void stria__w_on_backward(void *ctx, stria_rpc_call_t *call);
/* Destroys a job's pass object (with the job). */
void stria__wpass_free(stria__wjob_t *j);

/* ---- worker_coord.c ---- */
stria_status_t stria__wcoord_call(stria_worker_t *w, uint32_t method, const ProtobufCMessage *req,
                                  stria_rpc_reply_t *reply);
/* Reports an event of job j; returns the job's state at the coordinator
 * after the report (a terminal one: the job is over there), or
 * JOB_STATE_UNSPECIFIED when the coordinator could not be told. */
Stria__V1__JobState stria__wcoord_report(stria_worker_t *w, const stria__wjob_t *j,
                                         Stria__V1__ReportJobRequest__Event ev,
                                         const char *message);
/* The heartbeat thread: registers, heartbeats, drops what the coordinator
 * names; ends at heartbeat_stop. */
void *stria__wcoord_thread(void *arg);
/* Deregisters (or reports every unfinished job failed) with `reason`. */
void stria__wcoord_leave(stria_worker_t *w, const char *reason);

/* Fills the state of a STARTED report: every rank arrived; the job's failure
 * text and the status to fail a pass with. */
typedef struct {
    bool all_arrived;
    stria_status_t failure_status;
    char failure[512];
} stria__warrival_t;
Stria__V1__JobState stria__wcoord_report_pass(stria_worker_t *w, const stria__wjob_t *j,
                                              Stria__V1__ReportJobRequest__Event ev, uint32_t pass,
                                              stria__warrival_t *out);
/* Reports the failures queued by stria__wjob_fail_locked(). */
void stria__wcoord_report_fails(stria_worker_t *w);

/* ---- worker_shm.c ---- */
/* The job's tensors in one shared mapping (a sealed memfd; anonymous memory
 * where memfds are not available), zero-filled; and its release. */
stria_status_t stria__wjob_mem_alloc(stria__wjob_t *j);
void stria__wjob_mem_free(stria__wjob_t *j);
/* The Unix socket of co-located clients in `dir` (its path in
 * w->shm_socket); stop closes it and its connections. */
stria_status_t stria__shm_start(stria_worker_t *w, const char *dir);
void stria__shm_stop(stria_worker_t *w);

/* ---- worker_metrics.c ---- */
void stria__wmetrics_init(stria_worker_t *w);

#endif
