/* libstria internals: the client, its jobs and ranks, and what the rooms
 * share:
 *   client.c        ABI, connect, submit and the queue, whole-sequence calls
 *                   (phases of one thread per rank), release, accessors
 *   client_data.c   one rank's data: connect, its path (shared memory or
 *                   TCP), the pass call, the phases' rank functions
 *   client_xfer.c   the TCP path: PutInput and GetOutput pipelined in
 *                   chunks, straight from and into the caller's rows
 *   client_shard.c  sharded jobs: submit, export, import, positions, the
 *                   per-rank forward and backward
 *   client_shm.c    the shared-memory path: attach, commit, shard buffers
 *   client_session.c sessions: open, calls on the ranks' connections, close */
#ifndef STRIA_CLIENT_INT_H
#define STRIA_CLIENT_INT_H

#include <pthread.h>

#include "stria.pb-c.h"
#include "stria_client.h"
#include "stria_rpc.h"
#include "stria_shm.h"

#define STRIA__COORD_TIMEOUT_S 10.0
#define STRIA__DEFAULT_STEP_S  60.0 /* the workers' default step deadline */
#define STRIA__POLL_S          0.2
/* How long the ranks still running get once another rank failed the phase,
 * or the coordinator ended the job: an alive worker hears of it at once and
 * answers with its own account; one silent past this is cut off or stopped,
 * and given up on. */
#define STRIA__ABANDON_S 2.0
/* How often a phase asks the coordinator whether the job is still on (a
 * worker it declared lost may never answer the phase's call). */
#define STRIA__WATCH_S         1.0
#define STRIA__N_TENSORS       9  /* stria_tensor_id_t: 1 .. 9 */
#define STRIA__MAX_BLAMED      64 /* workers one try blames */
#define STRIA__DEFAULT_RETRIES 2
/* How long a coordinator call keeps trying while the coordinator is out of
 * reach (a restart) or rebuilds its jobs (busy). */
#define STRIA__RECONNECT_S 60.0
/* How long a sharded job's rank waits at most for the coordinator's verdict
 * on replacing the job after a failure (the coordinator says how long it
 * waits: a few heartbeat periods). */
#define STRIA__REPLACE_WAIT_S 120.0
/* How long a rank whose worker was lost (refused, closed, silent) waits for
 * the coordinator to see it too (its verdict takes 3 heartbeat periods)
 * while the job is still on there. */
#define STRIA__VERDICT_WAIT_S 30.0

struct stria_client {
    stria_client_params_t params;
    char *coordinator;
    char *token;
    char *client_name;
    stria_rpc_client_t *coord;
    stria_job_t *jobs;         /* open jobs, released by stria_client_close() */
    stria_session_t *sessions; /* open sessions, closed by stria_client_close() */
};

/* Where a tensor lies in a rank's shared memory (ShmTensor). */
typedef struct {
    uint64_t offset, outer, outer_stride, row_bytes;
} stria__shm_tensor_t;

/* A rank's shared memory with its worker: the socket (-1: none) and the
 * mapping of the job's memfd (fd: the memfd, open while base is mapped). */
typedef struct {
    int sock;
    int fd;
    void *base;
    size_t size;
    stria__shm_tensor_t t[STRIA__N_TENSORS + 1]; /* by stria_tensor_id_t */
} stria__shm_t;

typedef struct {
    int rank;
    char rpc_address[300];
    char shm_socket[STRIA_SHM_MAX_PATH]; /* the worker's; "" : none */
    uint64_t worker_id;
    int64_t tokens;
    stria_rpc_client_t *conn;
    stria__shm_t shm;
    bool shm_tried;    /* the path is decided */
    char shm_why[300]; /* why the rank uses TCP under STRIA_DATA_PATH_AUTO */
    bool used;         /* sharded: this handle reached the rank's worker (ran it) */
    bool fwd_done;     /* sharded: its forward pass succeeded */
    /* result of the rank's part of the current phase */
    stria_status_t status;
    char error[768];
    bool retryable; /* the failure is (see stria_error_retryable()) */
    bool conn_lost; /* its worker was lost: refused, closed, silent (blame it) */
    bool abandoned; /* its call was given up on (see stria__phase_t.abandoned) */
    bool done;      /* its part of the current phase ended (under the phase's lock) */
    double compute_s, wait_s;
    uint32_t steps;      /* of the last pass */
    uint64_t bytes_sent; /* over the ring in the last pass */
    uint64_t bytes;      /* moved in the current phase, read by the progress poller */
    void *stage;         /* staging of short rows (client_xfer.c), kept between calls */
    size_t stage_cap;
} stria__rank_t;

struct stria_job {
    stria_client_t *client;
    stria_job_t *next;
    uint64_t id;
    stria_job_spec_t spec; /* as assigned: defaults filled in */
    stria_layout_t layout;
    int n_ranks;
    stria__rank_t *ranks;
    double pass_timeout_s;
    bool forward_done;
    bool sharded;
    bool session; /* JobSpec.session: a session's job (client_session.c) */
    /* the release tries the coordinator once (a session closed while the
     * coordinator is out of reach: its workers dropped it already, and its
     * idle deadline ends it there) */
    bool release_once;
    /* The job's capability, from the coordinator at submission (or the
     * export bytes): every request about the job proves it (never sends it
     * over the network); the shared-memory attach hands it to the worker
     * over the host's Unix socket. */
    stria_job_secret_t secret;
    /* Retries (client.c): workers the submission excludes (the blamed ones
     * of earlier tries; not owned), and what a failed try found: whether it
     * is retryable and the workers it is blamed on. */
    const uint64_t *exclude;
    size_t n_exclude;
    bool retryable;
    uint64_t blamed[STRIA__MAX_BLAMED];
    size_t n_blamed;
    /* Sharded: the shared memory of the ranks of the jobs this one replaced
     * (client_shard.c), kept mapped until the handle is released: a caller
     * may still read and write the buffers it was handed. */
    struct stria__retired *retired;
    size_t n_retired;
};
/* A replaced job's rank's shared memory, still mapped (see retired). */
typedef struct stria__retired {
    int rank;
    stria__shm_t shm;
} stria__retired_t;

/* ---- the phases of a whole-sequence call (client.c) ---- */
typedef struct stria__phase stria__phase_t;
typedef void (*stria__rank_fn)(stria__phase_t *ph, stria__rank_t *r);

struct stria__phase {
    stria_job_t *job;
    stria__rank_fn fn;
    /* inputs and outputs of the phase, full tensors */
    const void *in[3];
    int n_in;
    void *out[3];
    float *lse_out;
    int n_out;
    bool backward;
    /* completion */
    pthread_mutex_t lock;
    pthread_cond_t cv;
    int remaining;
    /* Giving up on ranks that do not answer once the phase has failed:
     * another rank failed it at first_fail, or the coordinator ended the job
     * (abandon_why says which; abandon_retryable is its verdict). */
    double first_fail;
    double ended_at; /* when the coordinator was seen to have ended the job (0: not) */
    bool ended_retryable;
    char ended_why[512];
    bool abandoned;
    bool abandon_retryable;
    char abandon_why[512];
};

/* ---- client.c ---- */
size_t stria__row_bytes(const stria_job_t *job, int64_t heads);
/* A call to the coordinator; about `job` (its secret proven) unless NULL.
 * A connection that broke or was refused (a restarting coordinator), and a
 * job-scoped call answered busy (a restarted coordinator rebuilding its
 * jobs), are tried again for up to STRIA__RECONNECT_S. */
stria_status_t stria__coord_call(stria_client_t *c, uint32_t method, const ProtobufCMessage *req,
                                 const stria_job_t *job, stria_rpc_reply_t *reply);
/* The same; `patient` false: one try only (the progress poller, the phase's
 * watch). */
stria_status_t stria__coord_call_ex(stria_client_t *c, uint32_t method, const ProtobufCMessage *req,
                                    const stria_job_t *job, stria_rpc_reply_t *reply, bool patient);
/* How many times a forward that failed retryably is tried again. */
int stria__retries(const stria_client_t *c);
/* A caller's spec read into ours (ABI) and checked. */
stria_status_t stria__read_spec(const stria_job_spec_t *in, stria_job_spec_t *out);
/* Submits job->spec (sharded or not) and waits while the job is queued;
 * job->id is set once the coordinator admitted it. */
stria_status_t stria__submit(stria_client_t *c, stria_job_t *job, bool sharded,
                             stria_progress_cb progress, void *arg);
/* Waits while the job is PENDING (state and position as last seen). */
stria_status_t stria__wait_queued(stria_client_t *c, stria_job_t *job, Stria__V1__JobState state,
                                  uint32_t qpos, stria_progress_cb progress, void *arg);
/* The job's ranks from the coordinator's assignment, checked against the
 * layout this library scatters with. */
stria_status_t stria__job_from_assignment(stria_job_t *job, const Stria__V1__Assignment *a);
void stria__job_free(stria_job_t *job);
/* Whether the coordinator ended the job (failed, cancelled or expired it);
 * its reason into why[0 .. len) and its verdict into *retryable. */
bool stria__job_ended(stria_job_t *job, char *why, size_t len, bool *retryable);
/* The calling thread's error message about a failed call of the job, into
 * msg[0 .. len), with the coordinator's verdict taken (retryable, blamed
 * workers) and its reason added: the ranks may only have heard that the job
 * is over, while the coordinator's reason names the rank that caused it. */
void stria__failure_msg(stria_job_t *job, char *msg, size_t len);
/* Links an open job into its client (released by stria_client_close()). */
void stria__job_link(stria_job_t *job);

/* ---- client_data.c ---- */
/* The rank's connection to its worker and, as the client's path says,
 * its shared memory. */
stria_status_t stria__rank_connect(stria_job_t *job, stria__rank_t *r);
/* Bytes of the compact form of a rank's tensor. */
uint64_t stria__rank_bytes(const stria_job_t *job, const stria__rank_t *r, stria_tensor_id_t t);
/* A rank's input from its compact form (or in place), by its path. */
stria_status_t stria__rank_put(stria_job_t *job, stria__rank_t *r, stria_tensor_id_t t,
                               const void *compact);
/* A rank's output into its compact form (or in place), by its path. */
stria_status_t stria__rank_get(stria_job_t *job, stria__rank_t *r, stria_tensor_id_t t,
                               void *compact);
/* RunForward / RunBackward of the rank, with `extra_s` more patience (a
 * sharded pass waits for the other ranks). */
stria_status_t stria__rank_run(stria_job_t *job, stria__rank_t *r, bool backward, double extra_s);
/* Whether a failure `st` of a rank's call means its worker is lost: no
 * answer (refused, closed, silent past the deadline), not an error it
 * replied (a retryable failure, that worker to blame). */
bool stria__rank_lost(const stria__rank_t *r, stria_status_t st);
/* Records a rank's failure of the current phase (status, message, whether
 * it is retryable and whether its worker was lost). */
void stria__rank_fail(stria__rank_t *r, stria_status_t st, const char *what);
/* DropJob on the rank's worker (its memory goes back now). */
void stria__rank_drop(stria_job_t *job, stria__rank_t *r);
/* The phases' rank functions. */
void stria__rank_upload(stria__phase_t *ph, stria__rank_t *r);
void stria__rank_pass(stria__phase_t *ph, stria__rank_t *r);
void stria__rank_download(stria__phase_t *ph, stria__rank_t *r);

/* ---- client_shm.c ---- */
/* Attaches the rank's shared memory through its worker's socket. */
stria_status_t stria__shm_attach(stria_job_t *job, stria__rank_t *r);
/* A rank's memory from before its job was replaced: adopted by the rank's
 * new mapping (stria__shm_attach() maps the new job's memory at the same
 * address, with its bytes), so the caller's pointers into it stay good. Over
 * TCP it cannot be: a call with such a pointer fails (an error, never other
 * bytes), and this says so. */
stria_status_t stria__retired_check(const stria_job_t *job, const stria__rank_t *r, const void *p);
/* Tells the worker an input is written in full. */
stria_status_t stria__shm_commit(stria_job_t *job, stria__rank_t *r, stria_tensor_id_t t);
void stria__shm_detach(stria__shm_t *shm);
/* A session rank's arena (client_session.c): `size` bytes of a sealed memfd
 * of this process, its pages allocated, mapped here (r->shm) and registered
 * with the rank's worker through its socket (ShmRequest OP_ARENA), which
 * maps it too. */
stria_status_t stria__shm_arena(stria_job_t *job, stria__rank_t *r, size_t size);
/* Writes rank r's shard of input t into its shared memory (with pwritev:
 * see client_shm.c): from a full [outer, seq_len, row] tensor, the rank's
 * tokens at their positions (full), or from a compact shard (job may then
 * be NULL). */
void stria__shm_write(const stria_job_t *job, const stria__rank_t *r, stria_tensor_id_t t,
                      const void *src, bool full);
/* Copies between a compact tensor and the rank's shared one (unless they
 * are the same memory). */
void stria__shm_copy(const stria__rank_t *r, stria_tensor_id_t t, void *compact, bool to_shared);

#endif /* STRIA_CLIENT_INT_H */
