/*
 * stria worker: one rank of any session's ring, per GPU (or CPU) of a host.
 *
 * It serves the stria.v1.Worker service (proto/stria.proto) over the RPC
 * layer. A client opens a session's rank on it once (OpenSession), then
 * each call brings its inputs (SessionCall: in its payload, or in the
 * client's own shared memory registered through the worker's Unix socket)
 * and takes its outputs with the reply; DropJob closes the session. A job
 * is a session with one forward and one backward call, whose outcomes the
 * worker reports to the coordinator. It registers with the coordinator and
 * heartbeats (with the state of every session it holds); the coordinator
 * names in its heartbeat replies the sessions to drop (cancelled, failed,
 * expired or released).
 *
 * Sessions. A session is created by its first open from the assignment the
 * coordinator gives for it (with its secret, which every request of its
 * clients must prove, and its ring key, which its ring link proves), with
 * its memory admitted: memory is bounded by `memory_bytes`, and a session
 * that does not fit is refused then, never mid-call. Its buffers, ring
 * buffers and kernel workspaces come from memory pools the worker reserves
 * at start (address space, committed on first use) and keeps, so that a
 * session reuses the pages of the sessions before it. A session's ring link
 * is bound once at its open, on the endpoint the worker keeps to the next
 * rank's worker, and again only after a failed call. A drop while a call
 * runs aborts it.
 *
 * Threads: the RPC server's loop thread runs every handler (never blocked by
 * a call); one pass thread per open session; the heartbeat thread. The
 * functions below are called from any single thread.
 */
#ifndef STRIA_WORKER_H
#define STRIA_WORKER_H

#include "stria_common.h"
#include "stria_device.h"
#include "stria_rpc.h"
#include "stria_transport.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct stria_worker stria_worker_t;

/* What a session asks of the link factory: rank `rank` of its ring number
 * `ring_id` (its link's generation), `size` ranks. Every rank of the
 * session asks for the same (job_id, ring_id), in any order, from its own
 * worker. */
typedef struct {
    uint64_t job_id;
    uint32_t ring_id; /* the session's link generation: a failed call's next call binds anew */
    int rank;
    int size;
    /* The ring link address the successor rank's worker registered. */
    const char *next_address;
    double connect_timeout_s;
    /* The job's ring key (STRIA_AUTH_KEY_BYTES), from the coordinator: the
     * ring link handshake proves it. */
    const uint8_t *key;
    /* Set (with __atomic_store_n) when the session is to end before its link
     * connected (it was dropped, the worker shuts down): a factory whose
     * connect waits for its neighbours gives up then (see
     * stria_ucx_link_params_t.cancel). */
    const bool *cancel;
} stria_worker_link_request_t;

/* Makes the ring links of the sessions. The default is a UCX link on the
 * worker's own UCX context (stria_worker_ucx_links()); an in-process
 * program with several workers, which may hold only one UCX context, passes
 * one shared context's factory or an in-process one
 * (stria_worker_inproc_links()). */
typedef struct {
    /* Connects the link of req->rank (see stria_link_ucx_connect() for what
     * connecting means) and returns it; the worker destroys it when the
     * session closes or binds anew. Called on the sessions' pass threads,
     * by several threads at once. */
    stria_status_t (*connect)(void *ctx, const stria_worker_link_request_t *req,
                              stria_link_t **link_out);
    void *ctx; /* borrowed: must outlive every worker using the factory */
    /* The ring link address ("HOST:PORT", port not 0) the worker registers,
     * which its predecessors' requests name as next_address. NULL: the
     * worker's advertised RPC address (for factories that ignore it). */
    const char *address;
} stria_worker_link_factory_t;

/* Zero-initialise and set the fields; zero or NULL means the default. */
typedef struct {
    const char *coordinator; /* "HOST:PORT" (required) */
    const char *listen;      /* RPC "HOST:PORT"; default 127.0.0.1:0 (port 0 picks one) */
    /* Host name or address others reach this worker at; default: the listen
     * host (which must not then be a wildcard address). */
    const char *advertise;
    const char *host; /* host name for ring grouping; default gethostname() */
    /* Credentials (contents, not paths): the clients' one, which this
     * worker's RPC checks (NULL: none, every connection is served), and the
     * workers' one, which it proves to the coordinator (NULL: none). */
    const char *token;
    const char *worker_token;
    int64_t memory_bytes;     /* offered to jobs; default half of physical memory */
    double step_timeout_s;    /* default deadline of one ring step; default 60 */
    double connect_timeout_s; /* ring link set-up; default 30 */
    /* Kernel threads, borrowed (must outlive the worker); NULL: a pool of
     * `threads` threads (0: online CPUs) owned by the worker. */
    stria_pool_t *pool;
    int threads;
    /* The device the sessions run on, borrowed (must outlive the worker); NULL:
     * "cpu" over the pool. A device whose memory is not host memory (a GPU,
     * "cpu:staged") gives each session a device object and device buffers of its
     * own. */
    stria_device_t *device;
    /* Optional registry that receives the worker's metrics (stria_worker_*);
     * must outlive the worker. NULL: a private one. */
    stria_metrics_t *metrics;
    /* Send READY=1 once registered, and STATUS= lines, to the service
     * manager through stria_notify(). */
    bool notify_status;
    /* Ring links: a factory (copied), or NULL for UCX links on a context
     * the worker creates on ucx_listen (default 127.0.0.1:0) with the UCX
     * transports ucx_tls and network devices ucx_net_devices (NULL: UCX's
     * choice), advertised at `advertise`. */
    const stria_worker_link_factory_t *links;
    const char *ucx_listen;
    const char *ucx_tls;
    const char *ucx_net_devices;
    /* A folder of this host (systemd's RuntimeDirectory=; a temporary one in
     * tests) where the worker listens on a Unix socket for clients of the
     * same host, which then move inputs and outputs through shared memory.
     * NULL: no socket (clients use TCP). */
    const char *runtime_dir;
    /* The device index placement matches (stria-worker: --instance); a
     * cuda:N device's own N takes precedence. */
    bool has_device_index;
    uint32_t device_index;
    /* The largest payload of one request (a call's inputs beyond it come in
     * pieces); 0: STRIA_RPC_DEFAULT_MAX_PAYLOAD. */
    uint64_t max_payload_bytes;
} stria_worker_params_t;

/* Starts serving and registering with the coordinator (in the background:
 * a coordinator that is not up yet is retried every second). Errors:
 * STRIA_ERR_INVALID_ARG (a parameter, named), STRIA_ERR_BUSY or STRIA_ERR_IO
 * (cannot listen), STRIA_ERR_TRANSPORT (UCX), STRIA_ERR_NO_MEMORY. Stop with
 * stria_worker_stop(). */
stria_status_t stria_worker_start(const stria_worker_params_t *params, stria_worker_t **worker_out);

/* The bound RPC port; the advertised RPC address ("HOST:PORT") and ring
 * link address, as registered; the Unix socket of co-located clients ("":
 * none). */
uint16_t stria_worker_port(const stria_worker_t *worker);
const char *stria_worker_address(const stria_worker_t *worker);
const char *stria_worker_link_address(const stria_worker_t *worker);
const char *stria_worker_shm_socket(const stria_worker_t *worker);
/* The RPC server (for liveness probes such as stria_service_watch_rpc). */
const stria_rpc_server_t *stria_worker_server(const stria_worker_t *worker);
/* The id the coordinator gave at registration; 0 until registered. */
uint64_t stria_worker_id(const stria_worker_t *worker);

/* The sessions (jobs included) held and the memory they reserve (a dropped
 * session still in use by a call counts until that ends), and the figures of the
 * memory pool that bounds them (the device's on a staged device, else the
 * host's): its capacity (the memory offered), what is allocated now, the
 * most ever allocated at once, and what it has made usable and keeps (host:
 * committed address space; device: segments). */
typedef struct {
    uint32_t jobs;
    uint32_t running_passes;
    uint64_t memory_in_use_bytes;
    uint64_t pool_reserved_bytes;
    uint64_t pool_in_use_bytes;
    uint64_t pool_high_water_bytes;
    uint64_t pool_committed_bytes;
} stria_worker_usage_t;
void stria_worker_usage(stria_worker_t *worker, stria_worker_usage_t *out);

/* Graceful shutdown, the first half of stria_worker_stop(): no new sessions
 * or calls; a running call gets one step deadline (the longest of any
 * session's and step_timeout_s) to end on its own, then its ring link is aborted;
 * heartbeats go on meanwhile; then the worker deregisters (`reason`, e.g.
 * "shut down (SIGTERM)", is what the coordinator fails its unfinished jobs
 * with). The RPC server keeps answering (refusals). Returns the calls
 * still running after the aborts had connect_timeout_s + 25 s to end them.
 * Once only; later calls return at once. */
int stria_worker_shutdown(stria_worker_t *worker, const char *reason);

/* Shuts down as above (reason "shut down") unless done, waits for every
 * call to end, stops serving and frees everything, the sessions included; NULL
 * is ignored. */
void stria_worker_stop(stria_worker_t *worker);

/* The UCX link factory on a context (borrowed) whose listener others reach
 * at `address` (borrowed: must outlive the workers): the default's, on the
 * worker's own context. */
stria_worker_link_factory_t stria_worker_ucx_links(stria_ucx_ctx_t *ctx, const char *address);

/* In-process ring links (stria_inproc_link_create()) for workers of one
 * process: the ranks of a (job, ring) share one hub, made by the first rank
 * that connects and let go by the last. */
typedef struct stria_worker_inproc_links stria_worker_inproc_links_t;
stria_status_t stria_worker_inproc_links_create(stria_worker_inproc_links_t **out);
/* Frees the hubs of rings some ranks never joined; after the workers. */
void stria_worker_inproc_links_destroy(stria_worker_inproc_links_t *links);
stria_worker_link_factory_t stria_worker_inproc_links(stria_worker_inproc_links_t *links);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_WORKER_H */
