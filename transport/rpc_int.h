/* Internals of the RPC layer: the budgeted unpack arena and the server's
 * connection and call objects. */
#ifndef STRIA_RPC_INT_H
#define STRIA_RPC_INT_H

#include <pthread.h>
#include <uv.h>

#include "stria_rpc.h"

/* Unpacking untrusted protobuf: every allocation comes from this arena and
 * counts against a byte budget, so a small message that expands (many empty
 * repeated sub-messages) cannot exhaust memory. Nothing is freed piecemeal;
 * stria__rpc_arena_destroy() frees the lot. */
typedef struct stria__rpc_arena {
    ProtobufCAllocator allocator; /* handed to protobuf-c; allocator_data = arena */
    size_t budget;
    size_t used;
    bool refused; /* an allocation was refused for the budget */
    struct stria__rpc_chunk *chunks;
} stria__rpc_arena_t;

/* Unpacked bytes may grow by this factor (plus a floor) before the budget
 * refuses: enough for any legitimate message of stria.proto. */
#define STRIA__RPC_ARENA_FACTOR 64
#define STRIA__RPC_ARENA_FLOOR  (256u << 10)
#define STRIA__RPC_ARENA_MAX    ((size_t)256 << 20)

stria__rpc_arena_t *stria__rpc_arena_create(size_t pb_len);
void stria__rpc_arena_destroy(stria__rpc_arena_t *arena);

/* Unpacks `len` bytes as `desc` into an arena. Returns NULL (with
 * stria_error_set(STRIA_ERR_FORMAT, ...)) when the bytes are not a valid
 * message or exceed the budget. */
ProtobufCMessage *stria__rpc_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                                    size_t len, stria__rpc_arena_t *arena);

/* Builds a frame: header then the packed message (payload not included).
 * Returns a malloc'd buffer of *len_out bytes, or NULL when out of memory. */
uint8_t *stria__rpc_frame_build(const stria_rpc_header_t *header, const ProtobufCMessage *msg,
                                size_t *len_out);

/* Packs an RpcError frame. */
uint8_t *stria__rpc_error_frame(uint64_t request_id, uint32_t method, uint16_t flags,
                                stria_status_t status, const char *message, size_t *len_out);

/* ---- server objects ---------------------------------------------------- */

typedef enum {
    STRIA__RD_HEADER,
    STRIA__RD_PB,
    STRIA__RD_PAYLOAD,
    STRIA__RD_DISCARD, /* skipping a refused request's payload */
    STRIA__RD_LINGER,  /* fatal error sent; draining input until the peer closes */
} stria__rpc_read_phase_t;

typedef struct stria__rpc_conn stria__rpc_conn_t;

struct stria_rpc_call {
    stria__rpc_conn_t *conn;
    uint64_t request_id;
    uint32_t method;
    double deadline;
    ProtobufCMessage *request;
    stria__rpc_arena_t *arena;
    void *payload;
    uint64_t payload_len;
    stria_rpc_done_cb cleanup;
    void *cleanup_arg;
};

struct stria__rpc_conn {
    uv_tcp_t tcp; /* tcp.data = this */
    stria_rpc_server_t *server;
    stria__rpc_conn_t *prev, *next;
    char peer[64];
    int refs; /* the handle, plus one per live call */
    bool hello_done;
    bool admin;
    bool closing; /* uv_close() called */
    bool reading;
    bool paused; /* too many calls in flight */
    double accepted_at;
    double linger_until;
    uint32_t inflight;

    stria__rpc_read_phase_t phase;
    uint8_t hdr[STRIA_RPC_HEADER_SIZE];
    size_t hdr_got;
    stria_rpc_header_t h;
    uint8_t *pb;
    size_t pb_got;
    stria_rpc_call_t *cur; /* request whose payload is being read */
    uint64_t payload_got;
    uint64_t discard_left;
    /* Error to send once the refused request's payload is skipped. */
    stria_status_t pending_status;
    char pending_msg[512];
    uint8_t scratch[16384];
};

/* A unit of work handed to the loop thread: a reply written from another
 * thread, or a posted function. */
typedef struct stria__rpc_job {
    struct stria__rpc_job *next;
    stria_rpc_call_t *call; /* NULL for a posted function */
    uint8_t *frame;
    size_t frame_len;
    const void *payload;
    uint64_t payload_len;
    stria_rpc_done_cb done;
    void *done_arg;
} stria__rpc_job_t;

struct stria_rpc_server {
    uv_loop_t loop;
    uv_tcp_t listener;
    uv_async_t async;
    uv_timer_t sweep;
    int64_t loop_alive_us; /* stria_time_now() of the last sweep in us, atomic */
    uv_timer_t tick;
    pthread_t thread;
    bool thread_started;

    pthread_mutex_t lock; /* guards the job queue and `stopping` */
    stria__rpc_job_t *jobs_head, *jobs_tail;
    bool stopping;

    const ProtobufCServiceDescriptor *service;
    stria_rpc_method_t *methods;
    void *ctx;
    char *token;
    char *admin_token;
    char *name;
    uint32_t max_pb;
    uint64_t max_payload;
    uint32_t max_connections;
    uint32_t max_inflight;
    double hello_timeout_s;
    stria_rpc_done_cb tick_cb;
    double tick_period_s;
    uint16_t port;

    stria__rpc_conn_t *conns;
    uint32_t n_conns;
};

#endif /* STRIA_RPC_INT_H */
