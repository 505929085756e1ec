/* stria worker internals: the worker, its sessions and their calls.
 *
 * One data plane. Every job and session this worker holds a rank of is a
 * session here (a job is a session with one forward and one backward call,
 * whose outcomes are reported to the coordinator); every tensor comes in
 * and goes out with a call (SessionCall), in its payload or in the client's
 * own shared memory (an arena), and every pass runs on the session's pass
 * thread over a ring link bound on the endpoint the worker keeps to the
 * next rank's worker.
 *
 * Rooms, from the ground up (a room calls only rooms listed above it; the
 * names it shares here carry its prefix):
 *
 *   worker_threads.c  stria__wthr_*      threads kept for the next pass thread or fetch
 *   worker_metrics.c  stria__wmet_*      the metrics series and gauges
 *   worker_pool.c     stria__wpool_*     the memory pools: admission, buffers, figures
 *   worker_links.c    (public)           the link factories: UCX (the default), in-process
 *   worker_timeline.c stria__wtimeline_* a pass's step times as a PassTimeline
 *   worker_coord.c    stria__wcoord_*    calls to the coordinator and call reports
 *   worker_call.c     stria__wcall_*     one call on a session's engine: its geometry,
 *                                        tensors (slots, held forwards, padding, the
 *                                        device), pass objects and the run
 *   worker_sess.c     stria__wsess_*     the session table: creation from the assignment,
 *                                        references, drop, the pass thread, the arena
 *   worker_rpc.c      stria__wrpc_*      the Worker service: OpenSession, SessionCall
 *                                        (pieces and parts included), DropJob
 *   worker_shm.c      stria__wshm_*      the Unix socket of co-located clients (arenas)
 *   worker_beat.c     stria__wbeat_*     registration and the heartbeat thread
 *   worker.c          (public)           start, accessors, graceful shutdown and stop
 *   main.c                               stria-worker: flags, configuration, signals
 *
 * Threads:
 *   - the RPC loop thread runs every handler; it never waits for a pass or
 *     the coordinator;
 *   - one pass thread per open session: binds the ring link, runs the calls
 *     handed to it one at a time and replies;
 *   - one short thread per OpenSession of a session not held yet (at most
 *     STRIA__MAX_FETCHES at once): fetches the assignment from the
 *     coordinator; these and the pass threads are kept idle for the next
 *     (worker_threads.c, w->thr_lock: a leaf);
 *   - the heartbeat thread (worker_beat.c); the shared-memory socket's
 *     thread (worker_shm.c); the caller's thread (start, shutdown, stop).
 *
 * Ownership and locks (lock order: w->lock, then a session's lock):
 *   - w->lock guards the session table (w->sessions, each session's `next`,
 *     `refs` and `dropped`) and the worker-wide flags below it. A session is
 *     freed by the last reference once dropped: a handler, a fetch or the
 *     pass thread holds one while it uses the session.
 *   - s->lock guards what a session's handlers and its pass thread share
 *     (its `sh` part): the hand-off of a call, the open's answers, the link
 *     a drop aborts, progress and statistics.
 *   - What the pass thread alone uses (`eng`: link, pass objects, device,
 *     padded tensors) needs no lock; the slots and held forwards are read by
 *     the loop thread's checks and changed by the pass thread, under s->lock.
 *   - A call in parts: each part's RPC call waits in sh.part_calls (s->lock)
 *     with its own buffer (its accepted record's `stage`, freed with the
 *     record or, once it carries the part's reply, after the write); the
 *     pass thread takes them all when it runs the call and answers each.
 *   - Fixed at creation and read without a lock: ids, keys, dims, bounds,
 *     layout, the buffers' addresses.
 */
#ifndef STRIA_WORKER_INT_H
#define STRIA_WORKER_INT_H

#include <pthread.h>

#include "stria.pb-c.h"
#include "stria_auth.h"
#include "stria_common.h"
#include "stria_device.h"
#include "stria_docplan.h"
#include "stria_ring.h"
#include "stria_rpc.h"
#include "stria_shm.h"
#include "stria_spec.h"
#include "stria_transport.h"
#include "stria_worker.h"

/* The longest step deadline a worker applies, whatever an assignment says
 * (the coordinator's --max-step-timeout bounds it further). */
#define STRIA__MAX_STEP_TIMEOUT_S 86400.0
/* Session entries of one heartbeat: the coordinator refuses more
 * (STRIA_COORD_MAX_HEARTBEAT_JOBS); a worker never holds that many. */
#define STRIA__HB_MAX_JOBS 16384
/* Threads a worker keeps idle for the next pass thread or fetch, and for
 * how long each waits. */
#define STRIA__THREADS_IDLE  16
#define STRIA__THREAD_IDLE_S 60
/* Arena mappings a worker keeps after their sessions, and for how long:
 * libstria keeps a client's arenas for its next sessions, whose
 * registrations then map nothing anew (a job's pages fault once). */
#define STRIA__MAPS_KEPT  8
#define STRIA__MAP_KEEP_S 10.0
/* Seconds between trims of the host pool, so that its resident memory
 * follows the reach of the last minute or two, not the largest of the
 * process's life (a soak's workers otherwise grew by a huge page at a time
 * through fragmentation). A trim costs the next allocation that reaches
 * the range a page fault per huge page. */
#define STRIA__POOL_TRIM_S 60.0
/* Assignments fetched at once for opens of sessions not held yet. */
#define STRIA__MAX_FETCHES 16
/* Held forwards a session may ask for. */
#define STRIA__MAX_HELD 63
/* Pass objects a session keeps, one per call shape, the least recently
 * used replaced first (a model's layers alternate a few shapes). */
#define STRIA__PASSES_KEPT 4
/* Latencies kept for a session's percentiles (a ring). */
#define STRIA__LAT_KEPT 256
/* Calls whose number is a multiple of this keep their step times for the
 * next heartbeat (striactl session ID --timeline): every rank samples the
 * same calls. */
#define STRIA__TL_EVERY 64
/* OpenSession requests of one session answered together. */
#define STRIA__MAX_OPENS 4

/* A session's tensors, in the order of a call's region: the inputs (Q, K,
 * V, O, LSE, dO), then the backward's outputs (dQ, dK, dV). */
typedef enum {
    STRIA__T_Q = 0,
    STRIA__T_K,
    STRIA__T_V,
    STRIA__T_O,
    STRIA__T_LSE,
    STRIA__T_DO,
    STRIA__T_DQ,
    STRIA__T_DK,
    STRIA__T_DV,
    STRIA__T_COUNT,
} stria__tensor_t;

/* ---- records of worker_pool.c ----------------------------------------------- */

/* A client's arena mapped here, with the identity of its memfd (a mapping
 * kept after its session serves the next registration of the same one). */
typedef struct {
    char *base; /* NULL: none */
    size_t size;
    uint64_t dev, ino;
    double kept_at;
} stria__wmap_t;

/* ---- worker_timeline.c ------------------------------------------------------ */

/* The step times of a pass object's last pass as a PassTimeline (msg),
 * with the memory behind it. */
typedef struct {
    Stria__V1__PassTimeline msg;
    Stria__V1__StepTimes *entries, **ptrs;
    uint64_t *spans;
} stria__wtimeline_t;

/* ---- a call (worker_call.c) ---------------------------------------------- */

/* The geometry of one call on one rank: its shape, the layout of its
 * seq_len, the rank's real tokens (`valid`) of its shard (`shard`, padding
 * included), the bytes of each compact tensor, and where in a region the
 * call's inputs and outputs lie. */
typedef struct {
    stria_call_shape_t shape; /* documents borrowed from the request */
    bool backward, use_held;
    stria_layout_t layout; /* its sizes; a packed call's plan is not kept (plan NULL) */
    int64_t valid, shard;
    size_t qrow, kvrow, lrow;       /* bytes per token */
    uint64_t bytes[STRIA__T_COUNT]; /* compact, batch x valid rows */
    uint64_t at[STRIA__T_COUNT];    /* offset in the region */
    uint64_t in_off, in_bytes;      /* what the request brings */
    uint64_t out_off, out_bytes;    /* what the reply takes */
} stria__wgeom_t;

/* An accepted SessionCall until it is answered (the RPC call's cleanup
 * argument): its session (a reference), geometry and region, and whether it
 * was handed to the pass thread or answered by its handler (a piece with
 * more to come, or inputs found incomplete). */
typedef struct {
    struct stria__wsess *s;
    stria__wgeom_t g;
    char *region; /* a region of the session's own; NULL for an arena call */
    int slot;     /* its index (-1: arena) */
    bool handed;
    bool answered;
    /* part `part` of `parts` (SessionCallRequest.parts; 0: none): its
     * trainer rank's `rows` tokens, compact in `stage` (its inputs as they
     * came, then its outputs for its reply; freed with the record) */
    stria_rpc_call_t *call;
    uint32_t part, parts;
    int64_t rows;
    char *stage;
    uint64_t stage_in, stage_out;
} stria__waccept_t;

/* ---- the session (worker_sess.c; its engine in worker_call.c) -------------- */

typedef struct stria__wsess stria__wsess_t;

/* What a session's handlers and its pass thread share (s->lock). */
typedef struct {
    pthread_cond_t cv;
    bool started; /* the pass thread runs */
    bool stop;    /* dropped, or the worker stops: the thread ends */
    bool link_up; /* the first bind is done */
    char link_error[512];
    stria_rpc_call_t *opens[STRIA__MAX_OPENS]; /* OpenSession calls to answer */
    int n_opens;
    stria_rpc_call_t *call; /* the call handed to the thread */
    bool busy;              /* a call (or its pieces) was accepted and is not answered */
    /* pieces of a call's inputs (SessionCallRequest.more) */
    bool assembling;
    uint64_t asm_call;
    uint8_t asm_binding[STRIA_CALL_BINDING_BYTES]; /* every piece names the same call */
    int asm_slot;
    stria_ranges_t asm_got;
    /* parts of a call (SessionCallRequest.parts): asm_parts of them, those
     * accepted (their calls waiting here) and those whose inputs are in */
    uint32_t asm_parts;
    uint64_t asm_epoch; /* the try they belong to (a later try's parts replace them) */
    uint64_t parts_accepted, parts_in;
    stria_rpc_call_t *part_calls[STRIA_CALL_MAX_PARTS];
    stria_link_t *link; /* the bound link, for an abort from a drop or a shutdown */
    bool connect_cancel;
    /* A co-located client's arena: its memfd mapped here; `arena_closed`
     * (its connection closed) makes the thread unmap it between calls. */
    char *arena;
    size_t arena_size;
    stria__wmap_t arena_map; /* (stria__wpool_map()) */
    bool arena_closed;
    /* held forwards: slot -> call number (held[slot] valid when the bit is set) */
    uint64_t held_mask;
    uint64_t held_call[STRIA__MAX_HELD + 1];
    uint64_t held_digest[STRIA__MAX_HELD + 1];
    /* progress and statistics */
    Stria__V1__JobState phase;
    uint32_t step, steps_total;
    double last_activity;
    bool running;
    uint64_t calls, failed, bytes;
    float lat[STRIA__LAT_KEPT];
    unsigned n_lat;
    stria__wtimeline_t tl; /* the latest sampled call's, until a heartbeat takes it */
    bool tl_new;
} stria__wshared_t;

/* What only the pass thread uses. */
typedef struct {
    stria_link_t *link;
    uint64_t epoch;
    struct {
        stria_ring_pass_t *pass;
        stria_call_shape_t shape; /* owns its documents */
        uint64_t used;
    } passes[STRIA__PASSES_KEPT];
    uint64_t uses;
    stria_link_t parked; /* what kept pass objects are bound to between links */
    /* padded tensors (a call whose shard has padding), made at first need */
    void *pad[STRIA__T_COUNT];
    /* a device whose memory is not host memory: the session's device object
     * and its device tensors, made at the first call */
    stria_device_t *dev;
    void *dbuf[STRIA__T_COUNT];
} stria__wengine_t;

struct stria__wsess {
    stria__wsess_t *next; /* w->sessions (w->lock) */
    stria_worker_t *w;
    int refs;     /* w->lock */
    bool dropped; /* w->lock: unlinked; the last reference frees it */
    pthread_mutex_t lock;
    /* fixed at creation */
    uint64_t id;
    int rank, n_ranks;
    stria_job_secret_t secret;              /* what its clients prove on every request */
    uint8_t ring_key[STRIA_AUTH_KEY_BYTES]; /* what its ring links prove */
    int64_t max_batch, max_seq_len, heads, kv_heads, head_dim;
    stria_dtype_t dtype;
    stria_layout_kind_t layout_kind;
    stria_layout_t layout; /* at the bounds */
    bool sharded;
    bool report_calls; /* a job: its calls' outcomes go to the coordinator */
    uint32_t max_held;
    double step_timeout_s, arrival_timeout_s;
    char next_ucx[300];
    uint64_t replaces;
    uint32_t generation;
    uint8_t *spec_pb; /* the assignment's spec, packed: a restarted coordinator's HeldJob */
    size_t spec_len;
    uint64_t bytes; /* admitted in the pools */
    /* The rank's own regions (1 + max_held), each room for one call at the
     * bounds: a region's inputs, then a backward's outputs. */
    char *slots;
    uint64_t region, in_room; /* bytes of a region; of its inputs */
    stria__wshared_t sh;
    stria__wengine_t eng;
};

/* A report the heartbeat thread makes for the RPC loop (which must not
 * block on the coordinator): a failure, or a sharded job's rank whose
 * inputs are in (the coordinator judges who did not arrive). */
typedef struct stria__wlater {
    struct stria__wlater *next;
    uint64_t job_id;
    int rank;
    Stria__V1__ReportJobRequest__Event event;
    uint64_t pass; /* the call, for an arrival */
    bool retryable;
    char message[512];
} stria__wlater_t;

typedef struct stria__wshm_srv stria__wshm_srv_t;

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
    stria_device_t *dev; /* the name, description and memory; sessions open their own on a GPU */
    bool own_dev;
    bool dev_staged;      /* device memory is not host memory: sessions stage through it */
    stria_ucx_ctx_t *ucx; /* the default link factory's context; NULL with another factory */
    stria_worker_link_factory_t factory;
    /* Memory pools (worker_pool.c), kept for the worker's life: host always;
     * device and pinned on a staged device. mem_jobs holds the sessions'
     * regions (host, or pinned when staged). Thread-safe on their own. */
    stria_mempool_t *mem_host, *mem_dev, *mem_pinned, *mem_jobs;
    stria_allocator_t alloc_host, alloc_dev, alloc_pinned;
    bool has_device_index; /* cuda:N's N, else the params' (stria-worker --instance) */
    uint32_t device_index;
    stria__wshm_srv_t *shm; /* the co-located clients' socket; NULL: none */
    char shm_socket[STRIA_SHM_MAX_PATH];

    pthread_mutex_t coord_lock; /* one coordinator call at a time */
    stria_rpc_client_t *coord;
    /* The session of the last reply from the coordinator (under
     * coord_lock): what held sessions' keys are sealed under. */
    stria_auth_session_t coord_session;

    pthread_mutex_t lock; /* everything below */
    pthread_cond_t cv;
    stria__wsess_t *sessions;
    uint64_t worker_id;
    uint32_t heartbeat_ms;
    int running_calls;   /* calls (and link binds) under way */
    int session_threads; /* sessions' pass threads still running */
    int fetching;        /* threads fetching an assignment */
    bool stopping;       /* shutting down: no new sessions or calls */
    bool draining;       /* the coordinator drains this worker: sessions move off it */
    bool shut_down;      /* stria_worker_shutdown() ran */
    bool heartbeat_stop; /* running calls are over: the heartbeat thread ends */
    bool abort_calls;    /* shutdown: running calls must fail now */
    char abort_reason[96];
    stria__wlater_t *later; /* reports to make, newest first */
    pthread_t hb_thread;
    bool hb_started;
    bool registered;
    /* The next heartbeat describes the held sessions in full (HeldJob):
     * after a registration, or when the coordinator asks. */
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
    /* threads kept for the next work (worker_threads.c; thr_lock, a leaf) */
    pthread_mutex_t thr_lock;
    pthread_cond_t thr_cv; /* a thread ended */
    struct stria__wthr *idle;
    int n_idle, n_threads;
    bool thr_stop;
    /* arena mappings kept after their sessions (stria__wpool_map()) */
    pthread_mutex_t maps_lock; /* a leaf: taken under any other lock, none under it */
    stria__wmap_t maps[STRIA__MAPS_KEPT];
    int n_maps;
    /* the C heap: in use, free in the arenas (glibc's mallinfo2()) */
    stria_metric_t *m_heap[2];
    /* the process's document plans (stria_docplan_shared()): plans and
     * bytes held, hits, misses; the cache's figures at the last report */
    stria_metric_t *m_plans[4];
    stria_docplan_cache_stats_t plans_seen;
};

/* ---- worker_threads.c ---- */
typedef struct stria__wthr stria__wthr_t;
void stria__wthr_init(stria_worker_t *w);
/* Runs fn(arg) on a kept idle thread, or a new one (detached either way). */
stria_status_t stria__wthr_run(stria_worker_t *w, void *(*fn)(void *), void *arg);
/* Ends the idle threads and waits for the busy ones to end (the worker's
 * stop, once no session or fetch is left). */
void stria__wthr_stop(stria_worker_t *w);

/* ---- worker_metrics.c ---- */
void stria__wmet_init(stria_worker_t *w);
/* Adds what the worker's UCX context refused since the last call to the
 * metrics (heartbeat thread). */
void stria__wmet_ring(stria_worker_t *w);
/* Sets the C heap gauges (glibc 2.33 and later; nothing elsewhere). */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
#define STRIA__HAVE_MALLINFO2 1
#endif
void stria__wmet_heap(stria_worker_t *w);
/* The document plan cache's figures into the metrics (heartbeat thread). */
void stria__wmet_plans(stria_worker_t *w);

/* ---- worker_pool.c ---- */
stria_status_t stria__wpool_start(stria_worker_t *w);
void stria__wpool_stop(stria_worker_t *w);
/* Reserves `need` bytes for session `id` in the pools that hold it, or
 * refuses with STRIA_ERR_NO_MEMORY naming the session, the need and the
 * offer. */
stria_status_t stria__wpool_admit(stria_worker_t *w, uint64_t id, uint64_t need);
void stria__wpool_retire(stria_worker_t *w, uint64_t bytes);
/* The figures of the pool that bounds the sessions (device on a staged
 * device, else host). */
void stria__wpool_figures(stria_worker_t *w, stria_mempool_stats_t *out);
/* Session memory from the pool of the sessions' tensors (host, or pinned on
 * a staged device), and its release (NULL is ignored). */
stria_status_t stria__wpool_alloc(stria_worker_t *w, size_t bytes, void **out);
void stria__wpool_free(stria_worker_t *w, void *p);
/* Points a session's device object at the device and pinned pools. */
stria_status_t stria__wpool_device(stria_worker_t *w, stria_device_t *dev);
/* Sets the pool gauges. */
void stria__wpool_publish(stria_worker_t *w);
/* Every STRIA__POOL_TRIM_S (the heartbeat thread calls it at each beat):
 * gives back the host pool's committed memory that no allocation reached
 * since the previous trim (stria_mempool_trim()), and unmaps the arena
 * mappings kept longer than STRIA__MAP_KEEP_S. */
void stria__wpool_trim(stria_worker_t *w);
/* Maps a client's arena (memfd `fd`, `size` bytes, checked by the caller):
 * the mapping kept from an earlier session of the same memfd if there is
 * one (no page faults again), else a new one. */
stria_status_t stria__wpool_map(stria_worker_t *w, int fd, size_t size, stria__wmap_t *out);
/* An arena's session is done with it: its mapping is kept for the client's
 * next session (the oldest of STRIA__MAPS_KEPT unmapped), or unmapped when
 * the worker stops. */
void stria__wpool_unmap(stria_worker_t *w, stria__wmap_t *map);

/* ---- worker_timeline.c ---- */
/* STRIA_ERR_NOT_FOUND: nothing recorded; STRIA_ERR_NO_MEMORY. No message is
 * set: a call goes on without its timeline. `rank` of `n_ranks`. */
stria_status_t stria__wtimeline_build(int rank, int n_ranks, const stria_ring_pass_t *rp,
                                      uint32_t pass, bool backward, stria__wtimeline_t *tl);
void stria__wtimeline_free(stria__wtimeline_t *tl);

/* ---- worker_coord.c ---- */
stria_status_t stria__wcoord_call(stria_worker_t *w, uint32_t method, const ProtobufCMessage *req,
                                  stria_rpc_reply_t *reply);
/* What a call report says. */
typedef struct {
    uint64_t job_id;
    int rank;
    Stria__V1__ReportJobRequest__Event event;
    const char *message;
    uint32_t step, steps_total, pass;
    uint64_t started_ms;
    Stria__V1__PassTimeline *timeline; /* NULL: none */
    bool retryable;
} stria__wreport_t;
/* What the coordinator answers a report: the job's state after it (a
 * terminal one: the job is over there; UNSPECIFIED: the coordinator could
 * not be told), the verdict that stands on its failure (the coordinator's
 * when it had one, else the report's) and its failure's text. */
typedef struct {
    Stria__V1__JobState state;
    bool retryable;
    stria_status_t failure_status; /* 0: none in particular */
    char failure[512];
} stria__wverdict_t;
/* Reports a call's outcome; *out (may be NULL) what the coordinator says. */
void stria__wcoord_report(stria_worker_t *w, const stria__wreport_t *r, stria__wverdict_t *out);
/* Queues a failure for the heartbeat thread to report (any thread). */
void stria__wcoord_fail_later(stria_worker_t *w, uint64_t job_id, int rank, bool retryable,
                              const char *message);
/* Queues a sharded job's arrival: rank's inputs of call `pass` are in
 * (FORWARD_STARTED or BACKWARD_STARTED; any thread). */
void stria__wcoord_arrived_later(stria_worker_t *w, uint64_t job_id, int rank, uint64_t pass,
                                 bool backward);
/* Makes the queued reports, oldest first (the heartbeat thread). */
void stria__wcoord_report_later(stria_worker_t *w);

/* ---- worker_call.c ---- */
/* The geometry of a call of session s with this shape, checked against the
 * session's bounds by the one rule libstria and the coordinator use. */
stria_status_t stria__wcall_geom(const stria__wsess_t *s, const stria_call_shape_t *shape,
                                 bool backward, bool use_held, stria__wgeom_t *g);
/* Tokens of trainer rank (part, parts) of this rank in a call of geometry
 * g: global stripe part x n_ranks + rank of a striping over n_ranks x parts
 * (which are ring rows part, part + parts, ... of the rank's shard); and
 * the bytes of its compact tensors [t0, t1) (payload order). */
int64_t stria__wcall_part_rows(const stria__wsess_t *s, const stria__wgeom_t *g, uint32_t part,
                               uint32_t parts);
uint64_t stria__wcall_part_bytes(const stria__wgeom_t *g, int64_t rows, int t0, int t1);
/* Moves a part's rows of tensors [t0, t1) between its compact buffer and
 * the region (to_region: its inputs; else its outputs, for its reply). */
void stria__wcall_part_move(const stria__wgeom_t *g, uint32_t part, uint32_t parts, int64_t rows,
                            int t0, int t1, char *region, char *buf, bool to_region);
/* The tensors [t0, t1) a call of geometry g takes in, and gives back. */
void stria__wcall_inputs(const stria__wgeom_t *g, int *t0, int *t1);
void stria__wcall_outputs(const stria__wgeom_t *g, int *t0, int *t1);
/* A session's regions and their bytes, for its bounds and held forwards;
 * the memory it is admitted with. */
uint64_t stria__wcall_region_bytes(const stria__wsess_t *s, uint64_t *in_room_out);
stria_status_t stria__wcall_memory(const stria__wsess_t *s, uint64_t *bytes_out);
/* The slot of a held forward (-1: none; s->lock held); a slot no forward
 * holds for the next call (s->lock held). */
int stria__wcall_held_slot(const stria__wsess_t *s, uint64_t call);
int stria__wcall_free_slot(const stria__wsess_t *s);
/* What a call ran, for its reply and the session's records. */
typedef struct {
    Stria__V1__PassStats stats;
    bool have_tl;
    stria__wtimeline_t tl;
    double started; /* stria_time_now() at its start */
    uint64_t started_ms;
} stria__wrun_t;
/* Destroys the session's link (its kept pass objects parked first, so
 * that a drop no longer aborts it); nothing without one (pass thread). */
void stria__wcall_unbind(stria__wsess_t *s);
/* Binds the session's ring link of `epoch` (its ring id: every rank of a
 * call asks for the same) through the link factory, in place of the one it
 * had, and publishes it for a drop or a shutdown to abort. Pass thread. */
stria_status_t stria__wcall_bind(stria__wsess_t *s, uint64_t epoch);
/* Runs a call on the pass thread: the link bound for its epoch, the
 * digests compared (sharded), its tensors in `region` (a region of the
 * session's own) or in the arena, padded or staged as needed, the pass,
 * the records. The link is aborted on a failure of this rank's own, so the
 * other ranks fail at once. */
stria_status_t stria__wcall_run(stria__wsess_t *s, const Stria__V1__SessionCallRequest *req,
                                const stria__wgeom_t *g, char *region, stria__wrun_t *run);
/* The parked link of a session (what its pass objects are bound to between
 * links): fails every operation. */
void stria__wcall_park_init(stria__wsess_t *s);
/* Binds kept pass objects to the parked link (before their link goes). */
void stria__wcall_park(stria__wsess_t *s);
/* Frees what the pass thread made: pass objects, padded and device tensors. */
void stria__wcall_engine_free(stria__wsess_t *s);

/* ---- worker_sess.c ---- */
/* Finds a session held here (w->lock held); NULL: none. */
stria__wsess_t *stria__wsess_find(stria_worker_t *w, uint64_t id);
/* Finds (or, with `create`, creates from the coordinator's assignment) the
 * session of a request for `rank` and takes a reference. w->lock not held. */
stria_status_t stria__wsess_get(stria_worker_t *w, uint64_t id, uint32_t rank, bool create,
                                stria__wsess_t **out);
void stria__wsess_unref(stria__wsess_t *s);
/* Unlinks a session, ends its thread and aborts its running call with
 * `why`; freed by its last reference. w->lock held. */
void stria__wsess_drop_locked(stria__wsess_t *s, stria_status_t why, const char *reason);
/* The session failed here (its client is gone mid-call): its call aborted
 * on every rank; a job's failure reported (by the heartbeat thread) and the
 * job dropped. Any thread; w->lock not held. */
void stria__wsess_fail(stria__wsess_t *s, const char *message);
/* Starts the session's pass thread (the first open) or queues the open for
 * it; answers the call once the link is bound (an early open: at once).
 * Consumes the reference. */
void stria__wsess_open(stria__wsess_t *s, stria_rpc_call_t *call, bool early);
/* Takes the parts of a call waiting on session s (s->lock held): the
 * calls of those whose inputs are in, marked answered, into out (their
 * count returned; the caller fails them once it let go of the lock); one
 * still reading its payload is refused once that is in. The session then
 * waits for no part. */
int stria__wsess_take_parts(stria__wsess_t *s, stria_rpc_call_t *out[STRIA_CALL_MAX_PARTS]);
/* Hands an accepted call to the pass thread (refused if the session
 * closes). */
void stria__wsess_hand(stria__wsess_t *s, stria_rpc_call_t *call);
/* A co-located client's arena (ShmRequest OP_ARENA): the secret checked,
 * the memfd checked (sealed, not hugetlbfs, of `size` bytes within the
 * rank's bound, no holes) and mapped; fd stays the caller's. */
stria_status_t stria__wsess_arena(stria_worker_t *w, uint64_t id, uint32_t rank,
                                  const stria_job_secret_t *secret, int fd, uint64_t size);
/* Its connection closed: unmapped between calls; a job fails (its client
 * is gone). */
void stria__wsess_arena_closed(stria_worker_t *w, uint64_t id, uint32_t rank, int pid);
/* Lets a held forward go (DropJob release_held). */
stria_status_t stria__wsess_release_held(stria__wsess_t *s, uint64_t call);
/* Statistics and the sampled timeline for a heartbeat (s->lock taken). */
void stria__wsess_status(stria__wsess_t *s, double now, Stria__V1__WorkerJobStatus *st,
                         Stria__V1__SessionStats *ss, stria__wtimeline_t *tl);

/* ---- worker_rpc.c ---- */
void stria__wrpc_on_drop(void *ctx, stria_rpc_call_t *call);
void stria__wrpc_on_open(void *ctx, stria_rpc_call_t *call);
stria_status_t stria__wrpc_on_call_payload(void *ctx, stria_rpc_call_t *call, uint64_t payload_len,
                                           void **buf_out);
void stria__wrpc_on_call(void *ctx, stria_rpc_call_t *call);
/* The loop's tick: parts that waited past their session's arrival timeout
 * fail. */
#define STRIA__TICK_S 0.25
void stria__wrpc_on_tick(void *ctx);

/* ---- worker_shm.c ---- */
/* The Unix socket of co-located clients in `dir` (its path in
 * w->shm_socket); stop closes it and its connections. */
stria_status_t stria__wshm_start(stria_worker_t *w, const char *dir);
void stria__wshm_stop(stria_worker_t *w);

/* ---- worker_beat.c ---- */
/* The heartbeat thread: registers, heartbeats, drops what the coordinator
 * names; ends at heartbeat_stop. */
void *stria__wbeat_thread(void *arg);
/* Deregisters (or reports every unfinished session failed) with `reason`. */
void stria__wbeat_leave(stria_worker_t *w, const char *reason);

#endif
