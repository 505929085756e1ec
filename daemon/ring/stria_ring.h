/*
 * stria ring engine: exact attention over a ring of N ranks.
 *
 * Every rank holds one shard of the global sequence (a layout from
 * stria_layout.h: striped, contiguous, zigzag, or packed: the call's
 * documents placed by their work, stria_docplan.h) for Q, K, V and, in the
 * backward pass, O, LSE and dO. The engine runs one rank's side of a pass on
 * the calling thread and talks to its neighbours only through a ring link
 * (stria_transport.h), so the same code runs over the in-process link and
 * over UCX between processes.
 *
 * Forward, on rank r: N steps; at step s the K/V block that started on rank
 * (r - s) mod N is merged into an fp32 partial (O, LSE). The send of the
 * current block to r + 1 and the receive of the next one from r - 1 are posted
 * before the step's compute (double buffering). At the end O is rounded once
 * to its storage dtype; LSE stays fp32.
 *
 * Backward, on rank r: D = rowsum(dO * O) once; K/V travel N - 1 hops as in
 * the forward pass; every rank adds the block's dK/dV contribution (fp32) to
 * the running sum received from its predecessor and sends it on, so after N
 * hops each block's dK/dV is back on its owner. The sum is pipelined one step
 * behind its K/V: a rank computes its contribution into a fresh buffer while
 * the running sum is still on the way, then adds. dQ stays local.
 *
 * Devices: tensors live and kernels run on the pass's stria_device_t. On a
 * host-visible device ("cpu", the default) the link reads and writes the
 * buffers the kernels read: no staging copy. Otherwise ("cuda:N", and
 * "cpu:staged" for tests) the tensors given to stria_ring_fwd()/bwd() are
 * device pointers, messages live in pinned host memory, and at step s the
 * host enqueues the kernel on the compute stream, waits on the link for
 * block s + 1 and enqueues its host -> device copy on the copy stream, so
 * that the copy (and the transfer) of block s + 1 overlap the compute of
 * block s. The rank's own K/V go to the host once, for sending; in the
 * backward pass each step's dK/dV contribution is copied to the host and
 * added to the running sum there (one copy per step). Host buffers are
 * reused only after the copies that read them are known done; both streams
 * are idle when a call returns, also after an error.
 *
 * Results are deterministic: every sum and merge happens in an order fixed by
 * the rank and step numbers, never by message arrival, so any link gives
 * bit-identical results for the same inputs, and the staged path gives the
 * host path's results bit for bit on the same kernels.
 *
 * Packed: a pass makes its call's document plan at creation (every rank the
 * same). Step 0 computes the rank's whole shard against itself, which
 * covers its kept documents; after it only the spread rows travel (a prefix
 * of each shard, its `travel` rows): K/V messages and the backward's dK/dV
 * sums carry those rows only, a rank's own part of its block stays home and
 * the others' sum of its spread rows is added to it at the end. The forward
 * runs the plan's steps. Host memory only (a staged device is refused).
 *
 * Padding: the layout pads the sequence to a multiple of N (2N for zigzag);
 * padded tokens sit at the end of each shard and the engine gives the kernels
 * only the real prefix of every block, so padding never changes a real output
 * or gradient (causal or not). Padded rows of O, dQ, dK, dV are written as
 * zeros and padded LSE entries as -inf.
 *
 * Errors: a failing rank (kernel error, link error, missed deadline) aborts
 * the link, so the other ranks fail fast, and returns a status whose message
 * starts with "rank R, forward step S:"; an abort seen from another rank
 * returns the status the link gives it (stria_link_abort_status(): the
 * aborting rank's own status, e.g. STRIA_ERR_INVALID_ARG, or STRIA_ERR_PEER
 * when a link failed) with a message naming the rank that aborted and why.
 * A pass ends with an agreement (N - 1 rounds of 8-byte messages), so a rank
 * returns success only when every rank finished its part: a failure anywhere
 * in the pass fails it on every rank. Every pending request is cancelled and
 * every buffer freed (or kept by the pass object for the next call) before
 * returning; device errors (a failed copy or kernel) fail the step like any
 * other.
 */
#ifndef STRIA_RING_H
#define STRIA_RING_H

#include "stria_common.h"
#include "stria_device.h"
#include "stria_kernels.h"
#include "stria_transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The global problem, identical on every rank: the call record (batch,
 * seq_len, causal, scale, documents and window; stria_call.h, where its
 * rules and the names of lengths are) and the dimensions a call of a session
 * or job keeps. The record's documents are borrowed: the array must stay
 * valid and unchanged for the pass object's (or plan's) life. The ring skips
 * the compute of blocks the masks hide from a whole shard (and, in the
 * forward, the hops no rank needs: stria_ring_pass_fwd_steps()); the kernels
 * skip the tiles the masks hide. */
typedef struct {
    stria_call_shape_t call;
    int64_t heads;
    int64_t kv_heads;    /* heads must be a multiple; only kv_heads travel */
    int64_t head_dim;    /* as the kernels accept: 16..256, a multiple of 8 */
    stria_dtype_t dtype; /* storage dtype of q, k, v and d_o */
} stria_ring_shape_t;

/* The kernels' parameters of the whole shape in one call: q_tokens and
 * kv_tokens the global seq_len, the record's scale, causality, documents and
 * window; no positions, pool or workspace. Every kernel call of the engine
 * starts from these. */
stria_attn_params_t stria_ring_shape_attn_params(const stria_ring_shape_t *shape);

/* Options of a pass object. Zero-initialise; zero is the default of every
 * field. */
typedef struct {
    /* Time budget of one ring step, in seconds: 0 means
     * STRIA_RING_DEFAULT_TIMEOUT_S, < 0 means no deadline. The budgets add
     * up: a wait in step s fails once the call has run (s + 1) budgets (but
     * waits at least a tenth of a budget), so that when ranks block on each
     * other in a chain, the one next to the failed rank gives up first and
     * the error names the right rank. The final exchanges count as further
     * steps. */
    double step_timeout_s;
    /* Kernel threads of this rank (NULL: the calling thread only). Borrowed:
     * must outlive the pass object. Used only without `device`. */
    stria_pool_t *pool;
    /* Where the tensors of stria_ring_fwd()/bwd() live and the kernels run.
     * Borrowed: must outlive the pass object, and is used by the pass's
     * thread during calls. NULL: an internal "cpu" device over `pool`. */
    stria_device_t *device;
    /* Tells passes that share one link apart: messages carry it in their tag.
     * Every rank of a ring must use the same id. */
    uint32_t pass_id;
    /* Optional hooks, called on the rank's thread right before and right
     * after each blocking wait of a pass on its link (the part timed in
     * wait_s); everything else a pass does lies outside them. The local ring
     * uses them to let one rank work at a time (serialize_compute). */
    void (*wait_begin_cb)(void *ctx);
    void (*wait_end_cb)(void *ctx);
    void *wait_cb_ctx;
    /* Optional, called on the rank's thread as each of the n_steps ring steps
     * of a pass starts (step 0..n_steps-1): progress for status views. */
    void (*step_cb)(void *ctx, int step, int n_steps);
    void *step_cb_ctx;
    /* Benchmarks: the forward runs all N steps even where the masks let it
     * stop early (the full ring, to compare with). Every rank must agree. */
    bool all_hops;
    /* Skip the step times (stria_ring_step_stats_t.times stays zero): only
     * for measuring what recording them costs. */
    bool no_step_times;
    /* Optional: where the object's host working memory (its buffers on a
     * host-visible device) and the kernels' workspaces come from, e.g. a
     * worker's memory pool (stria_mempool_allocator()). The struct is copied;
     * its context is borrowed for the object's life. NULL: the system's
     * allocator and the kernels' own workspace cache. On a device that is
     * not host-visible the buffers come from the device (which may have
     * allocators of its own, stria_device_set_memory()). */
    const stria_allocator_t *host_memory;
} stria_ring_opts_t;

#define STRIA_RING_DEFAULT_TIMEOUT_S 300.0

/* When one rank did what in one step of a pass. Every pass records it (a few
 * clock reads per step; docs/BENCHMARKS.md measures the cost). Times are in
 * seconds since the rank's pass began (stria_ring_fwd()/bwd() entered), on
 * the rank's own clock: ranks of one process share it (`origin`, the pass's
 * start on the CLOCK_MONOTONIC clock of stria_time_now(), lines them up),
 * ranks on different hosts do not. */
#define STRIA_RING_STEP_SPANS 8

typedef enum {
    STRIA_RING_SPAN_COMPUTE = 1, /* kernel calls, the query side, host sums */
    STRIA_RING_SPAN_WAIT = 2,    /* blocked on the link */
} stria_ring_span_kind_t;

typedef struct {
    double begin, end;
    stria_ring_span_kind_t kind;
} stria_ring_span_t;

typedef struct {
    double origin;     /* the pass's start, stria_time_now() */
    double begin, end; /* the step (step 0 from 0; the last one to the pass's end) */
    /* The K/V block sent on in this step, and in the backward pass the dK/dV
     * sum: posted, and seen complete by this rank's wait (< 0: none). */
    double send_begin, send_end;
    double sum_send_begin, sum_send_end;
    /* Compute and wait spans in time order; consecutive spans of one kind
     * less than 20 us apart are one span, and so are all consecutive spans of
     * one kind once six are recorded (the agreement's N - 1 waits). A span
     * that finds no room is dropped (counted in `merged`). On a GPU a
     * compute span runs from the step's first enqueue to the compute stream
     * seen idle, so it may overlap the step's waits. */
    int n_spans, merged;
    stria_ring_span_t spans[STRIA_RING_STEP_SPANS];
} stria_ring_step_times_t;

/* What one rank did in one step of its last pass. */
typedef struct {
    int src_rank;  /* owner of the K/V block of this step */
    bool computed; /* false: the block had no visible key for this shard */
    /* Thread CPU time of the step's kernel calls; on a GPU the wall time
     * from the step's first enqueue until the compute stream is seen idle
     * after the step's link waits (exact when compute-bound, else an upper
     * bound), plus the host's dK/dV sum in the backward pass. In the backward
     * pass step 0 also carries D and the packing of the query side, and the
     * last step the final dQ sum, whether or not those steps' blocks are
     * visible. */
    double compute_s;
    double compute_wall_s; /* wall time of the same calls */
    double wait_s;         /* wall time blocked on the link */
    uint64_t bytes_sent;
    uint64_t bytes_recv;
    stria_ring_step_times_t times; /* when (absent with no_step_times) */
} stria_ring_step_stats_t;

typedef struct stria_ring_pass stria_ring_pass_t;

/* Creates rank stria_link_rank(link)'s pass object for a ring of
 * stria_link_size(link) ranks. Meant to live as long as a job: one object
 * runs all of the job's passes, also when every pass has its own link
 * (stria_ring_pass_set_link()). The link is borrowed: it must stay valid
 * while the object is bound to it, i.e. until the object is destroyed or
 * rebound to another link; the object never destroys or aborts a link
 * outside a call. Everything in opts (pool, device, hook contexts) is
 * borrowed for the object's whole life. The object is used by one thread
 * at a time. It keeps its working buffers between calls (two K/V shards in
 * the storage dtype and fp32 accumulators: an O shard, and in the backward
 * pass a dQ shard and three fp32 dK/dV shard pairs; on a device that is not
 * host-visible, device buffers and pinned host buffers of about that size
 * each) so that repeated passes do not fault in fresh memory, also across
 * links. Free with stria_ring_pass_destroy(). */
stria_status_t stria_ring_pass_create(stria_link_t *link, const stria_ring_shape_t *shape,
                                      stria_layout_kind_t layout, const stria_ring_opts_t *opts,
                                      stria_ring_pass_t **pass_out);
void stria_ring_pass_destroy(stria_ring_pass_t *pass);

/* Rebinds the pass object to another link of the same rank and ring size,
 * between passes (e.g. the worker's fresh link per pass), keeping the
 * object's buffers, device, options and pass_id. From then on the object
 * uses only `link` (borrowed as in stria_ring_pass_create()); the old link
 * is no longer touched and may be destroyed by its owner. On a new link the
 * call numbers in the tags restart at 0, as for a fresh object, so every
 * rank must rebind before its first call on the new link; rebinding to the
 * link already bound changes nothing. Errors, the object unchanged:
 * STRIA_ERR_INVALID_ARG for a NULL argument or a link of another rank or
 * ring size (the message names both), STRIA_ERR_BUSY while a
 * stria_ring_fwd()/bwd() call runs on the object (from one of its hooks or
 * another thread). */
stria_status_t stria_ring_pass_set_link(stria_ring_pass_t *pass, stria_link_t *link);

/* Sets the id of the object's next stria_ring_fwd()/bwd() call: the high 40
 * bits of every tag of its messages (STRIA_RING_CALL_ID_MASK of call_id), in
 * place of the pass id and the call's number on the link. For callers that
 * run many calls on one link with several pass objects (a session's calls
 * of different shapes): every rank must give a call the same id, and two
 * calls on one link must not share one. Only for the next call; later calls
 * go back to the default unless set again. STRIA_ERR_BUSY while a call
 * runs. */
#define STRIA_RING_CALL_ID_MASK ((UINT64_C(1) << 40) - 1)
stria_status_t stria_ring_pass_set_call(stria_ring_pass_t *pass, uint64_t call_id);

/* The layout of the pass: shard_tokens (L below) and the padding. */
const stria_layout_t *stria_ring_pass_layout(const stria_ring_pass_t *pass);

/* Forward pass of this rank. Every rank of the ring must call it (the same
 * number of times, in the same order with stria_ring_bwd()).
 *
 * q: [batch, L, heads, head_dim], k, v: [batch, L, kv_heads, head_dim], this
 * rank's shards in shape->dtype (padded rows are never read).
 * o: [batch, L, heads, head_dim] in any dtype; lse: fp32, contiguous
 * [batch, heads, L]. All buffers belong to the caller and are only used
 * during the call. */
stria_status_t stria_ring_fwd(stria_ring_pass_t *pass, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *o, float *lse);

/* Backward pass of this rank. q, k, v as in stria_ring_fwd(); o and lse are
 * that pass's outputs (o in any dtype); d_o: [batch, L, heads, head_dim] in
 * shape->dtype. Writes dq ([batch, L, heads, head_dim]), dk and dv
 * ([batch, L, kv_heads, head_dim]) in their own dtypes (fp32 keeps the full
 * accumulated precision). */
stria_status_t stria_ring_bwd(stria_ring_pass_t *pass, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *o, const float *lse, const stria_tensor_t *d_o,
                              const stria_tensor_t *dq, const stria_tensor_t *dk,
                              const stria_tensor_t *dv);

/* K/V steps of the last stria_ring_fwd()/stria_ring_bwd() call (0 before
 * the first). A backward runs N; a forward stria_ring_pass_fwd_steps(),
 * which is N unless a window or documents hide every block more than some
 * number of hops away from every rank (a causal window under contiguous):
 * then the K/V blocks travel only the hops they are needed. */
int stria_ring_pass_steps(const stria_ring_pass_t *pass);
int stria_ring_pass_fwd_steps(const stria_ring_pass_t *pass);

/* Per-step statistics of the last stria_ring_fwd()/stria_ring_bwd() call
 * (N entries, step order; steps past stria_ring_pass_steps() and all before
 * the first call are zeros). Valid until the next call or
 * stria_ring_pass_destroy(). */
const stria_ring_step_stats_t *stria_ring_pass_stats(const stria_ring_pass_t *pass,
                                                     size_t *n_steps_out);

/* ---- planning: what the engine does, without running it ------------------ */

/* What one rank does in one step of a pass, as the engine decides it: the
 * owner of the step's K/V block, whether the block is computed (some real
 * key of it visible to some real query of the rank by causality; the kernels
 * then skip what documents and windows hide), and the bytes the step posts
 * on the link: the same figures as the pass's stria_ring_step_stats_t (the
 * last step also carries the backward pass's dK/dV sum coming home and the
 * agreement). */
typedef struct {
    int src_rank;
    bool computed;
    uint64_t bytes_sent, bytes_recv;
} stria_ring_plan_step_t;

typedef struct stria_ring_plan stria_ring_plan_t;

/* A plan of the passes of a ring of n_ranks ranks (1..65536) for a shape
 * and layout, checked as stria_ring_pass_create() checks them; all_hops as
 * in stria_ring_opts_t. The shape's cu_seqlens is borrowed for the plan's
 * life. */
stria_status_t stria_ring_plan_create(const stria_ring_shape_t *shape, stria_layout_kind_t layout,
                                      int n_ranks, bool all_hops, stria_ring_plan_t **plan);
void stria_ring_plan_destroy(stria_ring_plan_t *plan);
const stria_layout_t *stria_ring_plan_layout(const stria_ring_plan_t *plan);

/* K/V steps of a pass: N backward, stria_ring_pass_fwd_steps() forward. */
int stria_ring_plan_steps(const stria_ring_plan_t *plan, bool backward);

/* Step `step` (0..stria_ring_plan_steps() - 1) of `rank`'s forward or
 * backward pass. */
stria_status_t stria_ring_plan_step(stria_ring_plan_t *plan, int rank, int step, bool backward,
                                    stria_ring_plan_step_t *out);

/* The kernel call of `rank` on the K/V block of `src` (stria_attn_params_t of
 * the engine; pool NULL; positions and documents borrowed from the plan).
 * Returns false when rank or src holds no real token (nothing is called). */
bool stria_ring_plan_params(stria_ring_plan_t *plan, int rank, int src, stria_attn_params_t *out);

/* ---- single-process convenience ---------------------------------------- */

/* Full (unsharded) tensors of stria_ring_run_local(), all contiguous and
 * owned by the caller. Tokens are the shape's call.seq_len (seq below). */
typedef struct {
    const void *q;     /* [batch, seq, heads, head_dim], shape->dtype */
    const void *k, *v; /* [batch, seq, kv_heads, head_dim], shape->dtype */
    void *o;           /* [batch, seq, heads, head_dim] in o_dtype: forward
                        * output, backward input */
    stria_dtype_t o_dtype;
    float *lse;         /* [batch, heads, seq]: forward output, backward input */
    const void *d_o;    /* [batch, seq, heads, head_dim], shape->dtype */
    void *dq, *dk, *dv; /* backward outputs in grad_dtype (dk, dv: kv_heads) */
    stria_dtype_t grad_dtype;
} stria_ring_local_io_t;

typedef enum {
    STRIA_RING_PASS_FWD = 1,     /* q, k, v -> o, lse */
    STRIA_RING_PASS_BWD = 2,     /* q, k, v, o, lse, d_o -> dq, dk, dv */
    STRIA_RING_PASS_FWD_BWD = 3, /* both, o and lse of the forward feed the backward */
} stria_ring_passes_t;

typedef struct {
    stria_layout_kind_t layout;
    int n_ranks; /* 1..256 threads */
    stria_ring_passes_t passes;
    double step_timeout_s; /* as in stria_ring_opts_t */
    int threads_per_rank;  /* kernel threads of each rank; 0 or 1: none extra */
    /* Let one rank work at a time: a rank holds the run's lock through a
     * pass and lets it go only while it waits on its link (the wait hooks),
     * so neither another rank's kernels nor its memory work (message copies,
     * packing, clearing, the final conversions) run beside a rank's compute.
     * Per-rank compute times free of contention between the rank threads,
     * for benchmarks; the wall time then no longer shows parallel speed. */
    bool serialize_compute;
    bool all_hops; /* as in stria_ring_opts_t */
    /* Device of every rank (stria_device_open() names): NULL or "cpu" runs
     * on the host as before; "cpu:staged" and "cuda:N" give each rank its
     * own device object (for CUDA all on GPU N), upload its shards, run and
     * download the outputs. */
    const char *device;
    bool no_step_times; /* as in stria_ring_opts_t */
} stria_ring_local_opts_t;

/* Filled by stria_ring_run_local() when given. */
typedef struct {
    /* Wall time from the first rank's start to the last rank's end of each
     * pass (0 for a pass not run). */
    double fwd_wall_s, bwd_wall_s;
    /* Optional, caller-allocated n_ranks * n_ranks entries, [rank][step]. */
    stria_ring_step_stats_t *fwd_steps, *bwd_steps;
} stria_ring_local_stats_t;

/* Scatters the full tensors with the layout, runs n_ranks threads over an
 * in-process ring and gathers the results: the same values as single-process
 * attention over the whole sequence. On error the message names the rank
 * where the failure started; outputs may be partly written. */
stria_status_t stria_ring_run_local(const stria_ring_shape_t *shape,
                                    const stria_ring_local_opts_t *opts,
                                    const stria_ring_local_io_t *io,
                                    stria_ring_local_stats_t *stats);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_RING_H */
