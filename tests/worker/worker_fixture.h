/* An in-process service for the worker's tests: a coordinator and n workers
 * (stria_worker_start) on loopback port 0 with in-process ring links (or
 * UCX links, a context per worker), and raw RPC helpers for the Worker and
 * Coordinator services. */
#ifndef STRIA_TEST_WORKER_FIXTURE_H
#define STRIA_TEST_WORKER_FIXTURE_H

#include "stria.pb-c.h"
#include "stria_coordinator.h"
#include "stria_ring.h"
#include "stria_worker.h"

#define WF_MAX 4

typedef struct {
    stria_coord_t *co;
    stria_worker_inproc_links_t *links;
    stria_ucx_ctx_t *ucx[WF_MAX]; /* each worker's UCX context (wf_opts_t.ucx) */
    stria_worker_t *w[WF_MAX];
    stria_rpc_client_t *cc;         /* to the coordinator */
    stria_rpc_client_t *wc[WF_MAX]; /* to each worker */
    int n;
} wf_t;

/* A job of the tests: its spec and assignment, and per rank the worker
 * index and the global positions of its shard. */
typedef struct {
    uint64_t id;
    stria_job_secret_t secret; /* from the submission; every job-scoped call proves it */
    stria_ring_shape_t shape;
    stria_layout_t layout;
    int n;
    int widx[WF_MAX];
    int64_t valid[WF_MAX];
} wf_job_t;

/* How the workers start; zero-initialise. */
typedef struct {
    double step_timeout_s;
    double connect_timeout_s; /* the ring links'; default 2 s */
    bool ucx;                 /* UCX ring links, a context per worker, not in-process ones */
} wf_opts_t;

stria_status_t wf_start_with(wf_t *f, int n, const wf_opts_t *o);
/* wf_start_with() with in-process links. */
stria_status_t wf_start(wf_t *f, int n, double step_timeout_s);
void wf_stop(wf_t *f);
stria_status_t wf_call(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                       const void *payload, uint64_t len, stria_rpc_reply_t *rep);
/* A call about `job` (NULL: none), proving its secret. */
stria_status_t wf_call_job(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                           const void *payload, uint64_t len, const wf_job_t *job,
                           stria_rpc_reply_t *rep);
/* Opens the job secret of a SubmitJob reply into job->secret. */
stria_status_t wf_open_secret(const stria_rpc_reply_t *rep, wf_job_t *job);
/* Submits a causal striped fp32 job over every worker (seq tokens). */
stria_status_t wf_submit(wf_t *f, int64_t seq, uint32_t step_timeout_ms, wf_job_t *job);
/* Deterministic full tensor [batch, seq, heads, head_dim] (fp32). */
float *wf_tensor(const wf_job_t *job, int64_t heads, unsigned seed);
/* The compact shard of a full tensor for `rank` (malloc'd; bytes in *len). */
void *wf_shard(const wf_job_t *job, int rank, const float *full, int64_t heads, uint64_t *len);
/* PutInput of bytes [off, off + len) of a compact shard. */
stria_status_t wf_put(wf_t *f, const wf_job_t *job, int rank, Stria__V1__Tensor t,
                      const void *shard, uint64_t total, uint64_t off, uint64_t len);
/* Puts Q, K, V (and dO when given) of every rank. */
stria_status_t wf_put_all(wf_t *f, const wf_job_t *job, const float *q, const float *k,
                          const float *v, const float *d_o);
/* Runs the forward (or backward) on every rank at once, one thread each. */
stria_status_t wf_pass_all(wf_t *f, const wf_job_t *job, bool backward);
/* A new connection to worker widx (a client runs one call at a time). */
stria_rpc_client_t *wf_client(wf_t *f, int widx);
stria_status_t wf_pass_on(stria_rpc_client_t *cl, const wf_job_t *job, int rank, bool backward);
stria_status_t wf_pass(wf_t *f, const wf_job_t *job, int rank, bool backward);
/* GetOutput of a rank's whole tensor (malloc'd). */
stria_status_t wf_get(wf_t *f, const wf_job_t *job, int rank, Stria__V1__Tensor t, void **out,
                      uint64_t *len);
stria_status_t wf_drop(wf_t *f, int widx, const wf_job_t *job);
stria_status_t wf_release(wf_t *f, const wf_job_t *job);
/* Waits up to timeout_s for worker i to hold `jobs` jobs and `memory` bytes. */
bool wf_wait_usage(wf_t *f, int i, uint32_t jobs, uint64_t memory, double timeout_s);

#endif
