/* An in-process service for the worker's tests: a coordinator and n workers
 * (stria_worker_start) on loopback port 0 with in-process ring links (or
 * UCX links, a context per worker), and helpers that speak the Worker
 * service as libstria does: open a session's ranks (all at once: an open
 * answers once its ring link is bound), run a call on every rank at once
 * (its inputs in one request or in pieces, its proof binding the call),
 * split the replies into the compact outputs, drop and release. */
#ifndef STRIA_TEST_WORKER_FIXTURE_H
#define STRIA_TEST_WORKER_FIXTURE_H

#include <pthread.h>

#include "stria.pb-c.h"
#include "stria_coordinator.h"
#include "stria_ring.h"
#include "stria_spec.h"
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

/* A job or session of the tests, or one call's view of it (wf_job_resized):
 * its shape (a job's own, a session's bounds, or a call's), the layout of
 * that shape's seq, and per rank the worker index and the real tokens of
 * its shard. */
typedef struct {
    uint64_t id;
    stria_job_secret_t secret; /* from the submission; every job-scoped call proves it */
    stria_ring_shape_t shape;  /* documents and window borrowed (a call's view may set them) */
    stria_layout_t layout;
    int n;
    int widx[WF_MAX];
    int64_t valid[WF_MAX];
    bool session;      /* JobSpec.session */
    uint32_t max_held; /* JobSpec.max_held */
} wf_job_t;

/* How the workers start; zero-initialise. */
typedef struct {
    double step_timeout_s;
    double connect_timeout_s;   /* the ring links'; default 2 s */
    bool ucx;                   /* UCX ring links, a context per worker, not in-process ones */
    uint64_t max_payload_bytes; /* each worker's cap on one request's payload; 0: the default */
} wf_opts_t;

stria_status_t wf_start_with(wf_t *f, int n, const wf_opts_t *o);
/* wf_start_with() with in-process links. */
stria_status_t wf_start(wf_t *f, int n, double step_timeout_s);
void wf_stop(wf_t *f);
/* A new connection to worker widx (a connection carries one call at a time). */
stria_rpc_client_t *wf_client(wf_t *f, int widx);
stria_status_t wf_call(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                       const void *payload, uint64_t len, stria_rpc_reply_t *rep);
/* A call about `job` (NULL: none), proving its secret. */
stria_status_t wf_call_job(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                           const void *payload, uint64_t len, const wf_job_t *job,
                           stria_rpc_reply_t *rep);
/* Opens the job secret of a SubmitJob reply into job->secret. */
stria_status_t wf_open_secret(const stria_rpc_reply_t *rep, wf_job_t *job);

/* ---- submission ---------------------------------------------------------------- */

/* What a test submits (2 heads, 1 kv head, head_dim 16, fp32, striped, over
 * every worker); zero-initialise. */
typedef struct {
    int64_t seq_len;          /* a job's tokens; a session's bound */
    int64_t batch;            /* 0: 1 (a session's bound) */
    uint32_t step_timeout_ms; /* 0: the workers' */
    bool session;             /* a session; else a job (causal, max_held 1, calls reported) */
    uint32_t max_held;        /* a session's held forwards */
} wf_spec_t;

stria_status_t wf_submit_spec(wf_t *f, const wf_spec_t *s, wf_job_t *job);
/* A causal job of `seq` tokens (wf_submit_spec() with session false). */
stria_status_t wf_submit(wf_t *f, int64_t seq, uint32_t step_timeout_ms, wf_job_t *job);
/* The job of a SubmitJob reply for `spec`, its ranks mapped to the workers
 * whose RPC addresses are rpc[0 .. n_workers) (-1: none of them). */
stria_status_t wf_job_of(const stria_rpc_reply_t *rep, const Stria__V1__JobSpec *spec,
                         const char *const rpc[], int n_workers, wf_job_t *job);
/* The view of a call of another batch and seq_len (causality and scale
 * kept, no documents or window: set them in its shape). */
wf_job_t wf_job_resized(const wf_job_t *job, int64_t batch, int64_t seq);
/* The call shape of a job's (or a view's) shape; documents borrowed. */
stria_call_shape_t wf_shape(const wf_job_t *job);

/* ---- tensors ----------------------------------------------------------------- */

/* Deterministic full tensor [batch, seq, heads, head_dim] (fp32). */
float *wf_tensor(const wf_job_t *job, int64_t heads, unsigned seed);
/* The compact shard of a full tensor for `rank` (malloc'd; bytes in *len). */
void *wf_shard(const wf_job_t *job, int rank, const float *full, int64_t heads, uint64_t *len);

/* A rank's compact tensors of its calls, in the order of a call's region. */
enum { WF_Q, WF_K, WF_V, WF_O, WF_LSE, WF_DO, WF_DQ, WF_DK, WF_DV, WF_N };
extern const char *const wf_tensor_names[WF_N];
typedef struct {
    void *t[WF_N]; /* malloc'd, owned; NULL: none */
    uint64_t len[WF_N];
} wf_io_t;

/* The compact bytes of tensor t on `rank` in a call of the job's (view's) shape. */
uint64_t wf_tensor_bytes(const wf_job_t *job, int rank, int t);
/* Every rank's Q, K, V (and dO when given) from full tensors, in place of
 * what io[] had. */
void wf_io_inputs(const wf_job_t *job, wf_io_t io[WF_MAX], const float *q, const float *k,
                  const float *v, const float *d_o);
/* Replaces tensor t of io with a copy of len bytes. */
void wf_io_set(wf_io_t *io, int t, const void *bytes, uint64_t len);
void wf_io_free(wf_io_t io[], int n);

/* ---- sessions and calls ------------------------------------------------------ */

/* A rank's open on a connection (the reply's fields in *out when given). */
stria_status_t wf_open_on(stria_rpc_client_t *cl, const wf_job_t *job, int rank,
                          Stria__V1__OpenSessionReply *out);
stria_status_t wf_open(wf_t *f, const wf_job_t *job, int rank);
/* Every rank's open at once, one thread each (each answers once its ring
 * link is bound, which needs its neighbours). */
stria_status_t wf_open_all(wf_t *f, const wf_job_t *job);

/* What a call asks beyond its number; zero-initialise: a forward of the
 * job's shape in one request, link epoch 0. */
typedef struct {
    bool backward;
    bool hold;     /* a forward kept for its backward */
    bool use_held; /* a backward of held forward held_call: dO alone */
    uint64_t held_call;
    uint64_t epoch;                  /* link_epoch */
    uint64_t piece;                  /* bytes of inputs per request; 0: one request */
    const stria_call_shape_t *shape; /* NULL: wf_shape(job) */
    bool forge;                      /* the proof binds call + 1 (a request changed on the way) */
    uint32_t part, parts;            /* part `part` of `parts` (SessionCallRequest.parts) */
} wf_call_opts_t;

/* The tensors of a call's payload (inputs, in order) and reply (outputs). */
int wf_call_inputs(const wf_call_opts_t *o, int ids[6]);
int wf_call_outputs(const wf_call_opts_t *o, int ids[3]);
/* The payload of a rank's call: its inputs in io concatenated (malloc'd);
 * NULL when one is missing. */
void *wf_payload(const wf_call_opts_t *o, const wf_io_t *io, uint64_t *len);
/* One SessionCall request of `rank` carrying payload[0 .. len) as bytes
 * [piece_offset, piece_offset + len) of the call's inputs, `more` set when
 * pieces follow; its proof binds the call (stria_call_binding()). The reply
 * in *rep (NULL: freed). */
stria_status_t wf_request(stria_rpc_client_t *cl, const wf_job_t *job, int rank, uint64_t call,
                          const wf_call_opts_t *o, uint64_t piece_offset, bool more,
                          const void *payload, uint64_t len, stria_rpc_reply_t *rep);
/* A rank's whole call on a connection: its inputs from io (in pieces of
 * o->piece bytes when set), its outputs split into io (replacing them). */
stria_status_t wf_call_on(stria_rpc_client_t *cl, const wf_job_t *job, int rank, uint64_t call,
                          const wf_call_opts_t *o, wf_io_t *io);
/* wf_call_on() on the fixture's connection to the rank's worker. */
stria_status_t wf_call_rank(wf_t *f, const wf_job_t *job, int rank, uint64_t call,
                            const wf_call_opts_t *o, wf_io_t *io);
/* The call on every rank at once, one thread each (on the fixture's
 * connections): the first failure by rank, with its message. */
stria_status_t wf_call_all(wf_t *f, const wf_job_t *job, uint64_t call, const wf_call_opts_t *o,
                           wf_io_t io[WF_MAX]);

/* One rank's open or call on a thread and a connection of its own. */
typedef struct {
    wf_t *f;
    const wf_job_t *job;
    int rank;
    bool open; /* an open, else a call */
    uint64_t call;
    wf_call_opts_t o;
    wf_io_t *io;
    bool own;     /* on a connection of its own (else the fixture's) */
    bool sending; /* set (__atomic) just before the request goes */
    pthread_t th;
    stria_status_t st;
    char msg[512];
} wf_bg_t;
/* Starts it (io borrowed: a call's outputs land there); 0 or an errno. */
int wf_bg_start(wf_bg_t *bg, wf_t *f, const wf_job_t *job, int rank, bool open, uint64_t call,
                const wf_call_opts_t *o, wf_io_t *io);
/* Waits for it: its status (its message in bg->msg). */
stria_status_t wf_bg_join(wf_bg_t *bg);

/* DropJob of the job on worker widx. */
stria_status_t wf_drop(wf_t *f, int widx, const wf_job_t *job);
/* DropJob with release_held: rank's held forward of call `call` goes. */
stria_status_t wf_release_held(wf_t *f, const wf_job_t *job, int rank, uint64_t call);
/* ReleaseJob at the coordinator (its workers are told to drop it). */
stria_status_t wf_release(wf_t *f, const wf_job_t *job);
/* Waits up to timeout_s for worker i to hold `jobs` jobs and `memory` bytes. */
bool wf_wait_usage(wf_t *f, int i, uint32_t jobs, uint64_t memory, double timeout_s);
/* Waits up to timeout_s for worker i to run `n` calls (binds included). */
bool wf_wait_running(wf_t *f, int i, uint32_t n, double timeout_s);

#endif
