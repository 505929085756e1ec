/* stria-worker internals: the job table and the pieces of the daemon. */
#ifndef STRIA_WORKER_INT_H
#define STRIA_WORKER_INT_H

#include <pthread.h>

#include "stria.pb-c.h"
#include "stria_common.h"
#include "stria_device.h"
#include "stria_rpc.h"
#include "stria_transport.h"

/* Settings of a worker (flags and configuration file). */
typedef struct {
    const char *coordinator; /* HOST:PORT */
    const char *listen;      /* RPC HOST:PORT */
    const char *ucx_listen;  /* ring link HOST:PORT */
    const char *advertise;   /* host name/address others use to reach us */
    const char *device;      /* --device: "auto", "cpu", "cuda:0", ... */
    const char *host;        /* host name for ring grouping; default gethostname() */
    const char *token_file;
    const char *metrics_listen;
    const char *log_level;
    const char *ucx_tls; /* UCX_TLS for the ring link; NULL: UCX default */
    const char *ucx_net_devices;
    int64_t instance;         /* GPU index: derives ports and device; -1 = none */
    int64_t memory_bytes;     /* offered to jobs; 0 = half of physical memory */
    int64_t threads;          /* kernel threads; 0 = online CPUs */
    double step_timeout_s;    /* default deadline of one ring step */
    double connect_timeout_s; /* ring link set-up */
} stria_worker_config_t;

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
    uint64_t id;
    int rank, n_ranks;
    /* the spec */
    int64_t batch, seq, heads, kv_heads, head_dim;
    stria_dtype_t dtype;
    bool causal;
    stria_layout_kind_t layout_kind;
    float scale;
    double step_timeout_s;
    char next_ucx[300]; /* successor's ring link address */
    stria_layout_t layout;
    int64_t valid; /* real tokens of this shard; layout.shard_tokens with padding */
    /* tensors, padded to shard_tokens rows per batch: inputs and outputs in
     * the job dtype, LSE fp32 [batch, heads, L] */
    void *buf[STRIA__T_COUNT];
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
    char failure[512];
} stria__wjob_t;

typedef struct stria_worker stria_worker_t;

struct stria_worker {
    stria_worker_config_t cfg;
    char *token;
    char rpc_address[300];
    char ucx_address[300];
    char host[256];
    uint64_t incarnation;
    stria_rpc_server_t *server;
    stria_pool_t *pool;
    stria_device_t *dev; /* opened at start: the name, description and memory */
    bool dev_staged;     /* device memory is not host memory: jobs stage through it */
    stria_ucx_ctx_t *ucx;

    pthread_mutex_t coord_lock; /* one coordinator call at a time */
    stria_rpc_client_t *coord;

    pthread_mutex_t lock; /* everything below */
    pthread_cond_t cv;
    stria__wjob_t *jobs;
    uint64_t worker_id;
    uint32_t heartbeat_ms;
    uint64_t memory_used;
    int running_passes;
    bool stopping;       /* SIGTERM: no new jobs or passes */
    bool heartbeat_stop; /* running passes are over: the heartbeat thread ends */
    bool abort_passes;   /* shutdown: running passes must fail now */
    char abort_reason[96];
    stria_link_t **links; /* ring links of the running passes */
    size_t n_links, cap_links;
    pthread_t hb_thread;
    bool registered;
    double last_heartbeat;

    /* metrics */
    stria_metrics_t *metrics;
    stria_metric_t *m_passes[2], *m_pass_fail[2], *m_pass_s[2], *m_steps[2], *m_step_compute,
        *m_step_wait, *m_bytes_sent, *m_bytes_recv, *m_in_bytes, *m_out_bytes, *m_memory, *m_jobs,
        *m_hb_age, *m_err_timeout, *m_err_peer, *m_err_pass, *m_err_coord;
};

/* worker.c: the job table, the Worker service's handlers, the heartbeat
 * thread, the graceful shutdown and the metrics. */
void stria__job_drop_locked(stria_worker_t *w, stria__wjob_t *j);
stria_status_t stria__put_payload(void *ctx, stria_rpc_call_t *call, uint64_t payload_len,
                                  void **buf_out);
void stria__put_handler(void *ctx, stria_rpc_call_t *call);
void stria__fwd_handler(void *ctx, stria_rpc_call_t *call);
void stria__bwd_handler(void *ctx, stria_rpc_call_t *call);
void stria__get_handler(void *ctx, stria_rpc_call_t *call);
void stria__drop_handler(void *ctx, stria_rpc_call_t *call);
void *stria__heartbeat_thread(void *arg);
int stria__shutdown(stria_worker_t *w, int signum);
void stria__metrics_init(stria_worker_t *w);

#endif
