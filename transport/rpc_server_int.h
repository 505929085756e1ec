/* Internals of the RPC server: its connection and call objects. */
#ifndef STRIA_RPC_SERVER_INT_H
#define STRIA_RPC_SERVER_INT_H

#include <pthread.h>
#include <uv.h>

#include "rpc_int.h"

/* ---- server objects ---------------------------------------------------- */

#define STRIA__RPC_N_ROLES 3 /* client, worker, admin: bit i is role 1 << i */

typedef enum {
    STRIA__RD_HEADER,
    STRIA__RD_PB,
    STRIA__RD_PAYLOAD,
    STRIA__RD_DISCARD, /* skipping a refused request's payload */
    STRIA__RD_LINGER,  /* fatal error sent; draining input until the peer closes */
    STRIA__RD_WAIT,    /* not reading: the payload callback names its buffer later */
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
    /* the payload callback answered STRIA_RPC_PAYLOAD_LATER and
     * stria_rpc_call_payload_ready() has not been handled yet */
    bool payload_wait;
    bool orphan; /* its connection closed meanwhile: destroyed when ready */
};

struct stria__rpc_conn {
    uv_tcp_t tcp; /* tcp.data = this */
    stria_rpc_server_t *server;
    stria__rpc_conn_t *prev, *next;
    char peer[64];
    int refs; /* the handle, plus one per live call */
    bool hello_done;
    bool challenged; /* first hello answered with a challenge; the proof is due */
    unsigned roles;  /* STRIA_RPC_ROLE_* once the hello is done */
    stria_auth_session_t session;
    uint64_t last_job_request; /* id of the last request whose job proof was checked */
    bool closing;              /* uv_close() called */
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
 * thread, a payload buffer named later, or a posted function. */
typedef struct stria__rpc_job {
    struct stria__rpc_job *next;
    stria_rpc_call_t *call; /* NULL for a posted function */
    bool payload_ready;     /* stria_rpc_call_payload_ready(): status, buffer, message */
    stria_status_t status;
    void *buf;
    char message[512];
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
    bool no_thread; /* the loop runs in stria_rpc_server_run() calls */

    pthread_mutex_t lock; /* guards the job queue and `stopping` */
    stria__rpc_job_t *jobs_head, *jobs_tail;
    bool stopping;

    const ProtobufCServiceDescriptor *service;
    stria_rpc_method_t *methods;
    void *ctx;
    /* Credentials by role: client, worker, admin (NULL: none); any: the
     * hello is a challenge. */
    char *tokens[STRIA__RPC_N_ROLES];
    bool any_token;
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

/* ---- shared by the rooms (rpc_server.c: connections, calls, the loop;
 * rpc_server_read.c: the byte stream of a connection) ---- */

/* Drops a reference; the last one frees the connection. */
void stria__conn_unref(stria__rpc_conn_t *c);
void stria__conn_close(stria__rpc_conn_t *c);
void stria__conn_read_start(stria__rpc_conn_t *c);
void stria__conn_read_stop(stria__rpc_conn_t *c);
/* Writes a frame and an optional payload; afterwards runs done(done_arg) and
 * destroys `call`. Takes ownership of `frame`. */
void stria__conn_write(stria__rpc_conn_t *c, uint8_t *frame, size_t frame_len, const void *payload,
                       uint64_t payload_len, stria_rpc_done_cb done, void *done_arg,
                       stria_rpc_call_t *call);
void stria__call_destroy(stria_rpc_call_t *call);
/* libuv's read callbacks of a connection. */
void stria__on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf);
void stria__on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf);
/* A payload buffer named by stria_rpc_call_payload_ready(), on the loop. */
void stria__on_payload_ready(stria__rpc_job_t *job);
/* Sends an error, half closes and drains what the peer still sends. */
void stria__conn_fatal(stria__rpc_conn_t *c, stria_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- rpc_server_auth.c: the hello, roles and job proofs ------------------- */

/* Copies the credentials of the params; refuses two equal ones. */
stria_status_t stria__rpc_server_tokens(stria_rpc_server_t *srv,
                                        const stria_rpc_server_params_t *p);
void stria__rpc_server_tokens_free(stria_rpc_server_t *srv);
/* Handles a hello frame (either of the two). */
void stria__rpc_on_hello(stria__rpc_conn_t *c);
/* Whether the connection's roles may call a method of these flags; if not,
 * writes why into msg. */
bool stria__rpc_method_allowed(const stria__rpc_conn_t *c, unsigned flags, const char *method,
                               char *msg, size_t msg_len);

#endif /* STRIA_RPC_SERVER_INT_H */
