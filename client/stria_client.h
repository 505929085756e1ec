/*
 * libstria: the client library of the stria attention service.
 *
 * A trainer connects to the coordinator (stria_client_connect()) and runs
 * attention through the service's workers. There is one data plane, the
 * session, and two ways in:
 *
 *   - sessions (stria_session_open() and the calls below): a trainer's ring
 *     opened once for the bounds of its calls, then any number of calls,
 *     each one request per rank straight to that rank's worker, no
 *     coordinator on the way;
 *   - jobs (stria_client_forward(), stria_client_backward(),
 *     stria_client_release()): a job is a session with one call each way.
 *     The library opens a session with the job's shape as its bounds
 *     (waiting in the queue when the workers are busy), runs the forward as
 *     a call whose Q, K, V, O and LSE the workers hold for the backward,
 *     runs the backward as the next call (it brings only dO), and closes the
 *     session at the release. The coordinator follows the job through its
 *     states from its workers' reports.
 *
 * Either way the library sends each rank its shard (striped by default),
 * the workers run the ring passes, and the library gathers and un-permutes
 * the results. The caller only sees plain contiguous tensors:
 *
 *   Q, O, dO, dQ: [batch, seq_len, heads, head_dim]     in spec->dtype
 *   K, V, dK, dV: [batch, seq_len, kv_heads, head_dim]  in spec->dtype
 *   LSE:          [batch, heads, seq_len]               fp32, natural log
 *
 * Sharded jobs and sessions (context parallelism): each trainer rank holds
 * only its own tokens. One rank submits the job without running anything
 * (stria_client_submit(), ring_size = the trainer's world size), exports it
 * (stria_job_export()) and hands the bytes to its peers over the trainer's
 * own channel; each imports them (stria_job_import()), asks which global
 * positions it holds (stria_job_positions()), and runs
 * stria_client_forward_shard() and later stria_client_backward_shard() with
 * only its tokens, in the job's layout order:
 *
 *   Q, O, dO, dQ: [batch, tokens, heads, head_dim]     tokens of the rank
 *   K, V, dK, dV: [batch, tokens, kv_heads, head_dim]
 *   LSE:          [batch, heads, tokens]
 *
 * A call runs on the ring when every rank's inputs are in; a rank that
 * does not arrive within the spec's arrival_timeout_s fails the call with
 * a message naming it. Each rank releases its handle (stria_client_release());
 * the job ends when every rank has, or at its TTL. Sharded sessions are
 * shared the same way (stria_session_export(), stria_session_import()).
 *
 * Data paths: with a worker on this host, a rank's tensors go through an
 * arena: memory of this process (a sealed memfd) that the rank's worker
 * maps, registered once over the worker's Unix socket. A call then names
 * places in it, and no tensor byte crosses a socket; stria_job_shard_buffer()
 * and stria_session_buffer() hand out those places, so a rank can build its
 * inputs and read its outputs in place and nothing is copied. Otherwise the
 * tensors travel over TCP in the calls' requests and replies. The client's
 * data_path chooses. Sound worker connections and arenas are kept for the
 * client's next sessions.
 *
 * Threads: a client and its jobs are used by one thread at a time; a
 * session's handle is thread-safe (calls from several threads are queued).
 * A call runs on the calling thread (with one helper thread while a
 * progress callback reports). Every failure returns a status whose message
 * says which rank and worker failed and why, and stria_error_retryable()
 * (stria_types.h) says whether the same call made again may succeed (a
 * worker died, left, was drained or cut off; a ring link broke) or would fail
 * again (bad input, no memory, cancelled, authentication). A forward that
 * failed retryably is tried again inside the call (forward_retries): a
 * whole-sequence one on a ring without the workers blamed, a sharded one on
 * the coordinator's replacement of a lost worker.
 *
 * ABI: the structs below start with `struct_size`, which the caller sets to
 * sizeof the struct as its header declares it (the *_INIT macros do), so
 * that later versions can add fields at the end: a library reads only the
 * fields the caller knows, and refuses a field it does not know that the
 * caller set. stria_client_abi_version() says which ABI a library speaks.
 */
#ifndef STRIA_CLIENT_H
#define STRIA_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI of this header; a library of another ABI cannot be used with it.
 * Bumped when a function or a field changes meaning or place (adding fields
 * at the end of a struct does not bump it). */
#define STRIA_CLIENT_ABI_VERSION 1

/* The ABI version of the library actually loaded. */
unsigned stria_client_abi_version(void);

typedef struct stria_client stria_client_t;
typedef struct stria_job stria_job_t;

/* The tensors of a job (the protocol's numbers). */
typedef enum {
    STRIA_TENSOR_Q = 1,
    STRIA_TENSOR_K = 2,
    STRIA_TENSOR_V = 3,
    STRIA_TENSOR_DO = 4,
    STRIA_TENSOR_O = 5,
    STRIA_TENSOR_LSE = 6,
    STRIA_TENSOR_DQ = 7,
    STRIA_TENSOR_DK = 8,
    STRIA_TENSOR_DV = 9,
} stria_tensor_id_t;

/* How tensors move between the library and the workers. */
typedef enum {
    /* shared memory with the workers of this host where they offer it (the
     * rank's worker socket is reachable and answers as that worker), TCP
     * otherwise (the default) */
    STRIA_DATA_PATH_AUTO = 0,
    /* TCP always: each rank's tensors go to and come from its worker over
     * its RPC connection, straight from and into the caller's rows */
    STRIA_DATA_PATH_TCP = 1,
    /* shared memory only: a rank whose worker cannot be reached that way
     * fails, saying why */
    STRIA_DATA_PATH_SHM = 2,
} stria_data_path_t;

/* Start from STRIA_CLIENT_PARAMS_INIT and set the fields; zero means the
 * default. */
typedef struct {
    size_t struct_size;      /* sizeof(stria_client_params_t) */
    const char *coordinator; /* "HOST:PORT" (required) */
    /* The service's client credential; NULL: none. Copied. Proven in the
     * hello (never sent); a server that does not prove it back is refused.
     * The secrets of the client's jobs stay in their handles. */
    const char *token;
    double connect_timeout_s; /* default 10 */
    double rpc_timeout_s;     /* one request to a worker or the coordinator other than a
                                 call (a call's deadline follows its steps'); default 120 */
    const char *client_name;  /* shown in the daemons' logs; default "libstria" */
    /* Added in ABI 1 after `client_name` (older callers' struct_size ends
     * there and it reads as NULL). A file holding the token on its first
     * line, read during the connection with the daemons' rules (blanks
     * around it trimmed, printable ASCII); NULL: none. Not with `token`. */
    const char *token_file;
    /* Added in ABI 1 after `token_file` (older callers' struct_size ends
     * there and it reads as STRIA_DATA_PATH_AUTO). */
    stria_data_path_t data_path;
    /* Added in ABI 1 after `data_path` (older callers' struct_size ends there
     * and it reads as 0). How many times stria_client_forward() submits a
     * job again, inside the same call, when a try failed retryably (see
     * stria_error_retryable()): 0 the default (2), negative none, at most
     * 16. Each retry runs on the ring as it is then, without the workers
     * earlier tries were blamed on (fewer workers only when the spec's
     * ring_size is 0; else a spare worker takes the place, or the retry
     * fails as busy, which stays retryable for the caller). Backward passes are never retried
     * (their forward's inputs were the caller's, read during that call): a backward that failed
     * retryably says so, and the caller runs forward and backward again. */
    int forward_retries;
} stria_client_params_t;

#define STRIA_CLIENT_PARAMS_INIT                                                                   \
    {                                                                                              \
        .struct_size = sizeof(stria_client_params_t)                                               \
    }

/* What to compute. Start from STRIA_JOB_SPEC_INIT; zero fields take the
 * service defaults. */
typedef struct {
    size_t struct_size; /* sizeof(stria_job_spec_t) */
    int64_t batch;
    int64_t seq_len;
    int64_t heads;
    int64_t kv_heads;
    int64_t head_dim;
    stria_dtype_t dtype;
    bool causal;
    stria_layout_kind_t layout; /* default striped; STRIA_LAYOUT_AUTO: the coordinator chooses */
    int ring_size;              /* 0: every healthy worker */
    float scale;                /* 0: 1/sqrt(head_dim) */
    double step_timeout_s;      /* deadline of one ring step; 0: the workers' default */
    double ttl_s;               /* idle time before the service drops the job; 0: default */
    bool no_queue;              /* fail with STRIA_ERR_BUSY instead of waiting in the queue */
    const char *label;          /* shown by the admin tools; may be NULL */
    /* Added in ABI 1 after `label` (older callers' struct_size ends there and
     * these read as zero). Documents (flash_attn varlen's cu_seqlens), one
     * list for every batch row: n_cu_seqlens entries, 0 first, never
     * decreasing, seq_len last, at most 65536; 0 entries: one document.
     * Read during the submission only. */
    const int64_t *cu_seqlens;
    size_t n_cu_seqlens;
    /* Sliding window: with has_window a query at position p sees keys in
     * [p - window_left, p + window_right] (-1: that side unbounded); causal
     * takes window_right 0 or -1 only. Without has_window both must be 0. */
    bool has_window;
    int64_t window_left, window_right;
    /* Sharded jobs (stria_client_submit): seconds a pass waits, after the
     * first rank arrived with its inputs, for the others; then the job fails
     * naming the missing ranks. 0: 60. */
    double arrival_timeout_s;
    /* Placement: on which host each trainer rank runs (ring_size entries, or
     * NULL), and optionally its device index there (a GPU index; NULL or -1:
     * any). Rank r then gets a worker on placement_hosts[r], the one with
     * that device index when the host has it; without such a worker the job
     * is refused naming the rank, unless placement_fallback lets the rank
     * take another worker. Read during the submission only. */
    const char *const *placement_hosts;
    const int *placement_devices;
    bool placement_fallback;
    /* Added after `placement_fallback` (older callers' struct_size ends
     * there and these read as 0). Head groups of a whole-sequence job, as
     * in stria_session_spec_t (G rings of ring_size / G workers, each over
     * heads / G; STRIA_HEAD_GROUPS_AUTO picks G from the coordinator's
     * ring); its forward is held on every ring for its backward. Sharded
     * jobs take 0 or 1 (their export is STRIA_JOB_EXPORT_BYTES: a sharded
     * session takes head groups). */
    uint32_t head_groups;
    int head_group_rings; /* stria_group_rings_t */
} stria_job_spec_t;

#define STRIA_JOB_SPEC_INIT                                                                        \
    {                                                                                              \
        .struct_size = sizeof(stria_job_spec_t)                                                    \
    }

typedef enum {
    STRIA_PHASE_QUEUED = 0,   /* waiting for workers (done = queue position) */
    STRIA_PHASE_UPLOAD = 1,   /* done/total in bytes */
    STRIA_PHASE_FORWARD = 2,  /* done/total in ring steps of the slowest rank */
    STRIA_PHASE_BACKWARD = 3, /* done/total in ring steps */
    STRIA_PHASE_DOWNLOAD = 4, /* done/total in bytes */
} stria_phase_t;

/* Progress of a call; runs on the calling thread, between other work. */
typedef void (*stria_progress_cb)(void *arg, stria_phase_t phase, double done, double total);

/* Where the time of a call went, per phase, in seconds of wall time. The
 * caller sets struct_size (STRIA_CALL_STATS_INIT); the library fills the
 * fields that fit in it. */
typedef struct {
    size_t struct_size; /* sizeof(stria_call_stats_t) */
    double queued_s, upload_s, pass_s, download_s;
    /* (upload: from the call until every rank's inputs are sent or in its
     * arena; download: from the first reply until the outputs are in the
     * caller's buffers) */
    double rank_compute_s_max;     /* slowest rank's kernel time */
    double rank_compute_s_min;     /* fastest rank's kernel time */
    double rank_wait_s_max;        /* longest time a rank waited on the ring */
    uint64_t bytes_up, bytes_down; /* tensor bytes to and from the workers (arenas too) */
    /* Since ABI 1's first release (zero from an older library): */
    uint32_t ring_steps;      /* K/V steps of the pass (most over the ranks): N, or fewer
                               * when a window let the forward stop early */
    uint64_t ring_bytes_sent; /* over the ring links, all ranks */
    /* Added after `ring_bytes_sent` (zero from an older library): tries of
     * a forward beyond the first (automatic retries, see forward_retries),
     * also when the call failed. The phase times and bytes are the last
     * try's; queued_s counts every try's submission and queue. */
    uint32_t retries;
} stria_call_stats_t;

#define STRIA_CALL_STATS_INIT                                                                      \
    {                                                                                              \
        .struct_size = sizeof(stria_call_stats_t)                                                  \
    }

/* Connects to the coordinator (and checks it answers). Free with
 * stria_client_close(). Errors: STRIA_ERR_INVALID_ARG (bad params, a
 * struct_size this library cannot read), STRIA_ERR_UNSUPPORTED (a field of a
 * newer header set), STRIA_ERR_IO (cannot connect), STRIA_ERR_AUTH. */
stria_status_t stria_client_connect(const stria_client_params_t *params,
                                    stria_client_t **client_out);
/* Closes the client; jobs still open are released first. NULL is ignored.
 * What a client's ended jobs and sessions leave for its next ones goes
 * with it: its connections to workers (32 at most) and its arenas (16 and
 * 4 GiB at most: the shared memory of co-located ranks, reused by the next
 * job of the same shape, whose worker then maps nothing anew). */
void stria_client_close(stria_client_t *client);

/* Submits a job and runs its forward pass. q, k, v are read during the call
 * only; o (spec->dtype) and lse are written before it returns. On success
 * *job_out is a handle for stria_client_backward() and stria_client_release();
 * on failure no job remains. `progress` may be NULL; `stats` may be NULL. */
stria_status_t stria_client_forward(stria_client_t *client, const stria_job_spec_t *spec,
                                    const void *q, const void *k, const void *v, void *o,
                                    float *lse, stria_progress_cb progress, void *progress_arg,
                                    stria_call_stats_t *stats, stria_job_t **job_out);

/* Runs the backward pass of a job whose forward pass succeeded: sends dO and
 * writes dq, dk, dv (spec->dtype). The job stays open (release it). */
stria_status_t stria_client_backward(stria_job_t *job, const void *d_o, void *dq, void *dk,
                                     void *dv, stria_progress_cb progress, void *progress_arg,
                                     stria_call_stats_t *stats);

/* Tells the service the job is done (its workers free its memory) and frees
 * the handle. For a sharded job: the ranks this handle ran are done (the
 * job ends when every rank has released). NULL is ignored. Returns the
 * release status (the handle is freed in every case). */
stria_status_t stria_client_release(stria_job_t *job);

/* ---- sharded jobs ------------------------------------------------------ */

/* Submits a sharded job and returns once its workers are reserved (it waits
 * in the queue like stria_client_forward()); runs nothing. spec->ring_size
 * is required (the trainer's world size) and the layout must be named
 * (striped, contiguous or zigzag: not STRIA_LAYOUT_AUTO). Export the handle
 * for the other ranks. */
stria_status_t stria_client_submit(stria_client_t *client, const stria_job_spec_t *spec,
                                   stria_job_t **job_out);

/* Bytes of an export. */
#define STRIA_JOB_EXPORT_BYTES 48

/* Writes a sharded job's handle (its id and its unguessable secret, which
 * gives whoever holds the bytes the job's ranks) into out[0 ..
 * STRIA_JOB_EXPORT_BYTES); *len_out is set to that. */
stria_status_t stria_job_export(const stria_job_t *job, void *out, size_t cap, size_t *len_out);

/* Opens a job exported by another process, through this client's
 * coordinator (which checks the secret). Release it as any handle. */
stria_status_t stria_job_import(stria_client_t *client, const void *bytes, size_t len,
                                stria_job_t **job_out);

/* The number of tokens rank `rank` holds (-1 for a rank out of range). */
int64_t stria_job_shard_tokens(const stria_job_t *job, int rank);

/* The global positions of rank `rank`'s tokens, in the order the rank holds
 * them (the job's layout): stria_job_shard_tokens() entries. */
stria_status_t stria_job_positions(const stria_job_t *job, int rank, int64_t *positions_out);

/* Runs rank `rank`'s part of the forward pass: sends its q, k, v (only its
 * tokens, in the layout's order), waits until the pass of every rank is
 * done, and writes its o (spec dtype) and lse. A pointer that is the `data`
 * of stria_job_shard_buffer() for that tensor is used in place (it must
 * then be laid out as that buffer says): nothing is copied for it. */
stria_status_t stria_client_forward_shard(stria_job_t *job, int rank, const void *q, const void *k,
                                          const void *v, void *o, float *lse);

/* A worker lost while a sharded job runs (it died, left or restarted) has
 * the coordinator replace the job: the same ranks and secret, the lost
 * worker's rank on a spare worker, a new job id (stria_job_id() says it
 * once the handle followed). A forward_shard that failed so follows the
 * replacement and sends the rank's stripe again inside the call (up to
 * forward_retries times); in-place buffers stay valid (they become the new
 * job's). Without a spare the call fails, retryable, saying so. */

/* Rank `rank`'s part of the backward pass, after its forward pass: sends
 * its dO and writes its dq, dk, dv (in-place buffers as above). A backward
 * whose job was replaced fails, retryable: run the forward again, then the
 * backward, on the same handle. */
stria_status_t stria_client_backward_shard(stria_job_t *job, int rank, const void *d_o, void *dq,
                                           void *dk, void *dv);

/* Where a rank's tensor lies in the rank's arena (this process's memory,
 * shared with the rank's worker on this host): `outer` rows (batch; batch *
 * heads for LSE) of `tokens` tokens of `row_bytes` each, `outer_stride`
 * bytes from one outer row to the next (tokens * row_bytes: the rows are
 * compact). */
typedef struct {
    size_t struct_size; /* sizeof(stria_shard_buffer_t) */
    void *data;
    int64_t outer;
    int64_t tokens;
    int64_t row_bytes;
    int64_t outer_stride;
} stria_shard_buffer_t;

#define STRIA_SHARD_BUFFER_INIT                                                                    \
    {                                                                                              \
        .struct_size = sizeof(stria_shard_buffer_t)                                                \
    }

/* The buffer of a rank's tensor in its arena (opening the rank on its
 * worker if needed): valid until the handle is released (the memory is then
 * kept for the client's next jobs: do not use the pointer after).
 * STRIA_ERR_UNSUPPORTED when the rank's tensors go over TCP (the message
 * says why). */
stria_status_t stria_job_shard_buffer(stria_job_t *job, int rank, stria_tensor_id_t tensor,
                                      stria_shard_buffer_t *out);

/* The path rank `rank`'s tensors take: STRIA_DATA_PATH_SHM or STRIA_DATA_PATH_TCP
 * once connected, STRIA_DATA_PATH_AUTO before. */
stria_data_path_t stria_job_data_path(const stria_job_t *job, int rank);

/* The service's job id (as shown by the admin tools). */
uint64_t stria_job_id(const stria_job_t *job);
/* Ranks of the job's ring. */
int stria_job_ring_size(const stria_job_t *job);
/* The job's layout as the coordinator assigned it (never STRIA_LAYOUT_AUTO:
 * an auto job reports the layout chosen for it). */
stria_layout_kind_t stria_job_layout(const stria_job_t *job);

/* ---- sessions -----------------------------------------------------------
 *
 * A session is a trainer's ring opened once: the coordinator admits it
 * against the workers' memory for the bounds of a call, assigns its workers
 * and makes its secret and ring key once; each rank's worker allocates the
 * rank's buffers, starts one pass thread and connects and proves its ring
 * link once; libstria keeps one connection to each rank's worker. After
 * that a call costs one request per rank on those connections: no
 * coordinator call, no new connection, link, thread or mapping.
 *
 * A call names its own shape and masks (stria_call_t): any batch and
 * sequence length within the session's bounds, causal or not, scale,
 * documents and window, so one session serves every layer of a model and
 * every length up to its bounds. The default backward call brings
 * everything it needs (Q, K, V, O, LSE, dO, what autograd keeps anyway):
 * nothing is held on the workers between calls, and the forward never runs
 * twice. A session opened with max_held > 0 may instead keep a forward's
 * inputs and outputs on the workers for its backward, which then brings dO
 * alone (stria_session_forward_held() below).
 *
 * Calls on one session run one at a time, in order; the handle is
 * thread-safe (calls from several threads are queued). A call is all or
 * nothing: every rank succeeds or the call fails. A call that failed
 * retryably (a worker lost, a link broken) is tried again inside the call
 * on a session opened anew without the blamed workers (up to the client's
 * forward_retries), whole-sequence sessions only; a session that expired
 * (idle_timeout_s without a call) is opened again by the next call.
 *
 * Sharded sessions are not opened again by libstria (a sharded call that
 * finds its session expired fails with STRIA_ERR_NOT_FOUND on every rank:
 * the group opens a new one together, as it opened the first).
 *
 * Sharded sessions: one trainer rank opens the session with sharded set
 * and ring_size its world size, exports it (stria_session_export()) and its
 * peers import it; each rank then issues the same calls in the same order
 * with its own tokens (stria_session_forward_shard()). Before a call's
 * first step every rank compares a digest of the call with its neighbour's:
 * ranks that disagree fail the call on every rank, the message naming them.
 */
typedef struct stria_session stria_session_t;

/* What a session fixes. Start from STRIA_SESSION_SPEC_INIT. */
typedef struct {
    size_t struct_size; /* sizeof(stria_session_spec_t) */
    /* The bounds of a call: its batch at most max_batch, and batch *
     * seq_len at most max_batch * max_seq_len. Required. */
    int64_t max_batch;
    int64_t max_seq_len;
    int64_t heads;
    int64_t kv_heads; /* 0: heads */
    int64_t head_dim;
    stria_dtype_t dtype;
    stria_layout_kind_t
        layout;    /* default striped; AUTO: the coordinator's choice (packed on workers of host
                    * memory, striped otherwise; stria_session_layout() says which) */
    int ring_size; /* 0: every healthy worker (whole-sequence sessions) */
    bool sharded;  /* calls come from ring_size processes (ring_size / head_groups with head
                    * groups), one rank each */
    double idle_timeout_s; /* the service closes a session idle this long; 0: 60 */
    double step_timeout_s; /* deadline of one ring step; 0: the workers' default */
    /* Sharded: how long a call's first step waits for the ranks still to
     * come; 0: 60. */
    double arrival_timeout_s;
    bool no_queue; /* fail with STRIA_ERR_BUSY instead of waiting for memory */
    const char *label;
    /* Placement, as in stria_job_spec_t (ring_size entries, or NULL). */
    const char *const *placement_hosts;
    const int *placement_devices;
    bool placement_fallback;
    /* Added after `placement_fallback` (older callers' struct_size ends
     * there and it reads as 0). Forwards the workers may hold at once for
     * their backward (stria_session_forward_held()), 0..63: admitted as that
     * much more memory per rank (one call's region at the bounds each). */
    uint32_t max_held;
    /* Added after `max_held`. Head groups G (0 or 1: none): the session is
     * G rings of ring_size / G ranks, ring g computing query heads
     * [g H/G, (g+1) H/G) and their kv heads, so a call's upload sends each
     * head group's bytes to its own ring (the all-to-all of head
     * parallelism, done by routing) and each ring passes 1/G of the K/V of
     * a 1-D ring of ring_size. G must divide kv_heads (a GQA group stays
     * whole) and ring_size (required; with STRIA_HEAD_GROUPS_AUTO, 0 takes
     * every worker of the ring). Sharded: ring_size / G trainer ranks call
     * it (stria_session_ranks()), rank j holding ring rank j's tokens (the
     * layout's shard over ring_size / G ranks) with all their heads; its
     * call sends each head group's bytes of them to worker j of that
     * group's ring. Held forwards are held on every ring (one handle; a
     * ring that fails one lets it go on all). */
    uint32_t head_groups;
    /* Added after `head_groups`. Where the head groups' rings lie (see
     * stria_group_rings_t; 0: inside hosts). */
    int head_group_rings;
    /* Added after `head_group_rings`. A sharded head-grouped striped
     * session: how many trainer ranks call it. 0 (or ring_size / G): one
     * per ring rank, as above. ring_size (N = G x R): one per worker, the
     * layout of Transformer Engine's a2a+p2p: trainer rank t = h G + l (the
     * l-th of the G ranks on host h) holds global stripe l R + h of a
     * striping over N (stria_session_positions() gives its tokens), and its
     * call sends each head group's bytes of them to worker h of that
     * group's ring, part l of that worker's shard: with the rings ACROSS
     * hosts and rank t on host t / G, every upload stays on its host. Each
     * worker runs the call once its G parts have come (over TCP; each part
     * within the worker's payload limit) and answers each part with its
     * rows. */
    int trainer_ranks;
} stria_session_spec_t;
/* Where a head-grouped session's G rings of R workers lie.
 *   INSIDE (the default): ring g takes the next R workers of the
 *     coordinator's ring, which orders workers by host: with G hosts of R
 *     workers each ring lies inside one host and no ring byte crosses
 *     hosts (a client elsewhere sends each host its group's heads).
 *   ACROSS: ring rank j of every ring on host j (R hosts with G workers
 *     each, the first of the coordinator's ring): each ring spans the
 *     hosts and a host's workers hold the G head groups of the same ring
 *     rank (Transformer Engine's a2a+p2p hierarchy); a sharded trainer
 *     whose rank j runs on host j then uploads to its own host only.
 * With the spec's own placement_hosts, group g's ring takes entries
 * [g R, (g + 1) R) of them instead (ACROSS is then refused). */
typedef enum {
    STRIA_GROUP_RINGS_INSIDE = 0,
    STRIA_GROUP_RINGS_ACROSS = 1,
} stria_group_rings_t;
/* head_groups: one group per host of the ring (stria_session_open() asks
 * the coordinator's ring, and stria_session_spec_get() says what it chose):
 * with H hosts each holding ring_size / H of the ring's workers and H
 * dividing kv_heads, H groups whose rings each lie inside one host (no ring
 * byte between hosts); otherwise 1. With head_group_rings ACROSS: one
 * group per worker of a host (W workers on each of the H hosts, W dividing
 * kv_heads: W rings of H), otherwise 1. */
#define STRIA_HEAD_GROUPS_AUTO UINT32_MAX
#define STRIA_SESSION_SPEC_INIT                                                                    \
    {                                                                                              \
        .struct_size = sizeof(stria_session_spec_t)                                                \
    }

/* One call's shape and masks. Start from STRIA_CALL_INIT. */
typedef struct {
    size_t struct_size; /* sizeof(stria_call_t) */
    int64_t batch;      /* 1..max_batch */
    int64_t seq_len;    /* global tokens; batch * seq_len <= max_batch * max_seq_len */
    bool causal;
    float scale; /* 0: 1/sqrt(head_dim) */
    /* Documents and window as in stria_job_spec_t (over seq_len); read
     * during the call only. */
    const int64_t *cu_seqlens;
    size_t n_cu_seqlens;
    bool has_window;
    int64_t window_left, window_right;
} stria_call_t;
#define STRIA_CALL_INIT                                                                            \
    {                                                                                              \
        .struct_size = sizeof(stria_call_t)                                                        \
    }

/* What a session did so far. */
typedef struct {
    size_t struct_size;            /* sizeof(stria_session_stats_t) */
    uint64_t calls;                /* calls that succeeded */
    uint64_t failed;               /* calls that failed (after their retries) */
    uint64_t retries;              /* tries beyond the first */
    uint64_t reopened;             /* times the session was opened anew (expired, or a retry) */
    uint64_t bytes_up, bytes_down; /* tensor bytes over TCP (a rank with an arena moves none) */
    double last_call_s;            /* wall time of the last call */
    double last_pass_s;            /* the slowest rank's pass in it */
    uint64_t last_minflt;          /* minor page faults of the workers during it, all ranks */
    uint32_t generation;           /* the session's opens: 1, then one more per reopening */
    /* Added after `generation` (older callers' struct_size ends there). The
     * last call's ring: bytes all ranks sent each other, and the steps its
     * ranks ran (a packed call with documents runs only the steps its plan
     * needs; 1: none of its tokens travelled). A sharded rank's handle
     * counts its own ranks' (a head-grouped one's: its ring rank on every
     * ring; with trainer_ranks ring_size each of a worker's G trainer ranks
     * counts that worker's pass). */
    uint64_t last_ring_bytes;
    uint32_t last_steps;
} stria_session_stats_t;
#define STRIA_SESSION_STATS_INIT                                                                   \
    {                                                                                              \
        .struct_size = sizeof(stria_session_stats_t)                                               \
    }

/* Opens a session (waiting in the queue unless no_queue): the coordinator
 * admits it and every rank's worker connects its ring link before this
 * returns. A sharded session is opened by one trainer rank; the others
 * import its export. Close with stria_session_close(). */
stria_status_t stria_session_open(stria_client_t *client, const stria_session_spec_t *spec,
                                  stria_session_t **session_out);
/* A call of a whole-sequence session. q, k, v full tensors as in
 * stria_client_forward() of the call's batch and seq_len, read during the
 * call; o (session dtype) and lse written before it returns. */
stria_status_t stria_session_forward(stria_session_t *session, const stria_call_t *call,
                                     const void *q, const void *k, const void *v, void *o,
                                     float *lse);
/* The backward of a forward call with the same shape: q, k, v, o, lse and
 * d_o in, dq, dk, dv out. */
stria_status_t stria_session_backward(stria_session_t *session, const stria_call_t *call,
                                      const void *q, const void *k, const void *v, const void *o,
                                      const float *lse, const void *d_o, void *dq, void *dk,
                                      void *dv);
/* Rank `rank`'s part of a call of a sharded session: its tokens only
 * (stria_session_shard_tokens() of them, in the layout's order), as in
 * stria_client_forward_shard(). Every rank must make the same calls in the
 * same order. */
stria_status_t stria_session_forward_shard(stria_session_t *session, const stria_call_t *call,
                                           int rank, const void *q, const void *k, const void *v,
                                           void *o, float *lse);
stria_status_t stria_session_backward_shard(stria_session_t *session, const stria_call_t *call,
                                            int rank, const void *q, const void *k, const void *v,
                                            const void *o, const float *lse, const void *d_o,
                                            void *dq, void *dk, void *dv);
/* Held forwards (a session with max_held > 0). A forward that holds keeps
 * its Q, K, V, O and LSE on the workers (in this process's arena where the
 * rank has one), so that its backward brings only dO and its inputs travel
 * once; it returns the forward's handle in *held_out. Its backward, with
 * the same call record, uses and then lets go of it; a held forward whose
 * backward will not run is let go with stria_session_release_held(). `rank`
 * is -1 for a whole-sequence session, the caller's rank for a sharded one
 * (whose tensors are then its own tokens). A held forward lives on the
 * session as it is: a call that fails over to a session opened anew or a
 * replacement loses it (its backward then fails, retryable: run the
 * forward again); a head-grouped session's, on any of its rings. */
stria_status_t stria_session_forward_held(stria_session_t *session, const stria_call_t *call,
                                          int rank, const void *q, const void *k, const void *v,
                                          void *o, float *lse, uint64_t *held_out);
stria_status_t stria_session_backward_held(stria_session_t *session, const stria_call_t *call,
                                           int rank, uint64_t held, const void *d_o, void *dq,
                                           void *dk, void *dv);
stria_status_t stria_session_release_held(stria_session_t *session, int rank, uint64_t held);
/* Bytes of a session's export, and the export and import (as for jobs: the
 * bytes are the session's capability). A head-grouped session's export
 * holds each ring's: 16 + 40 x head_groups bytes, at most
 * STRIA_SESSION_EXPORT_MAX_BYTES (stria_session_export() says how many in
 * *len_out, and refuses a smaller cap naming the size). */
#define STRIA_SESSION_EXPORT_BYTES     STRIA_JOB_EXPORT_BYTES
#define STRIA_SESSION_EXPORT_MAX_BYTES (16 + 40 * 64)
stria_status_t stria_session_export(const stria_session_t *session, void *out, size_t cap,
                                    size_t *len_out);
stria_status_t stria_session_import(stria_client_t *client, const void *bytes, size_t len,
                                    stria_session_t **session_out);
/* Tokens rank `rank` holds in a call of seq_len tokens without documents
 * (-1 for a bad rank or length), and their global positions. A packed
 * session's calls with documents place their tokens by their plan: ask
 * stria_call_shard_tokens() and stria_call_positions(). */
int64_t stria_session_shard_tokens(const stria_session_t *session, int64_t seq_len, int rank);
stria_status_t stria_session_positions(const stria_session_t *session, int64_t seq_len, int rank,
                                       int64_t *positions_out);
/* Tokens rank `rank` of a ring of n_ranks ranks holds in `call` under
 * `layout` (-1, the error set, for bad arguments), and their global
 * positions in the order the rank holds them (the rows of its shard; the
 * positions for its rotary embeddings). Striped, contiguous and zigzag
 * follow from seq_len; packed from the call's documents, window and
 * causality (its document plan: computed once per distinct documents in
 * this process and cached, the same plan every worker computes). No
 * session is needed: a trainer rank asks before it cuts its tokens. */
int64_t stria_call_shard_tokens(stria_layout_kind_t layout, int n_ranks, const stria_call_t *call,
                                int rank);
stria_status_t stria_call_positions(stria_layout_kind_t layout, int n_ranks,
                                    const stria_call_t *call, int rank, int64_t *positions_out);
/* Sharded sessions, with a worker on this host: where rank `rank`'s tensor
 * lies in the rank's arena for calls of `call`'s shape (its tokens only,
 * compact: outer_stride = tokens * row_bytes), so that the trainer builds
 * its inputs there and reads its outputs there, and a call given these
 * pointers moves none of their bytes. A forward writes O and LSE where a
 * backward of the same shape reads them. Opens the rank on its worker if
 * no call did yet (every rank must). Valid until the session is closed or
 * opened anew (stria_session_stats().generation changes);
 * STRIA_ERR_UNSUPPORTED when the rank's tensors go over TCP (the message
 * says why) or the session is whole-sequence. */
stria_status_t stria_session_buffer(stria_session_t *session, const stria_call_t *call, int rank,
                                    stria_tensor_id_t tensor, stria_shard_buffer_t *out);
/* Ring g (0 <= g < head_groups) of a head-grouped session: a session of
 * heads / G and kv_heads / G over ring_size / G ranks, borrowed (valid
 * while `session` is; stria_session_close() refuses it). A sharded trainer
 * that splits heads itself (tensor parallelism inside a host, context
 * parallelism across hosts: its rank (j, g) holding ring rank j's tokens
 * of head group g) calls ring g as rank j with its own heads: each caller
 * brings exactly one worker's bytes and nothing is routed. NULL for a
 * session without head groups or g out of range. */
stria_session_t *stria_session_head_group(stria_session_t *session, int g);
/* Workers of the session: head groups x the ranks of each ring. */
int stria_session_ring_size(const stria_session_t *session);
/* The ranks that call a sharded session (its trainer's world size:
 * ring_size / head_groups, the ranks of each of its rings, or ring_size
 * with trainer_ranks ring_size), and the n_ranks of
 * stria_call_shard_tokens() and stria_call_positions() for its calls
 * (with trainer_ranks ring_size, rank t's are stripe t % G x R + t / G's:
 * ask stria_session_positions()). 0 for NULL or a session not open. */
int stria_session_ranks(const stria_session_t *session);
/* What the session fixes, as opened or imported (an import learns it from
 * the coordinator): bounds, heads, kv_heads, head_dim, dtype, layout, ring
 * size (the current one), sharded. The label and placement are not kept
 * (NULL). `out` starts from STRIA_SESSION_SPEC_INIT. */
stria_status_t stria_session_spec_get(const stria_session_t *session, stria_session_spec_t *out);
stria_layout_kind_t stria_session_layout(const stria_session_t *session);
/* The session's id at the service (its job id; a reopened session has a
 * new one). */
uint64_t stria_session_id(const stria_session_t *session);
stria_status_t stria_session_stats(const stria_session_t *session, stria_session_stats_t *out);
/* Closes the session: its workers free its memory, its links and its
 * thread. The handle is freed in every case; NULL is ignored. */
stria_status_t stria_session_close(stria_session_t *session);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_CLIENT_H */
