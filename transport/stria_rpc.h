/*
 * stria RPC: framed request/reply over TCP for the control plane (coordinator)
 * and the data plane (worker inputs and outputs).
 *
 * Wire format (the authoritative description is proto/stria.proto): a 40-byte
 * little-endian header (stria_rpc_header_t), a protobuf message of pb_len
 * bytes, then payload_len raw bytes. Tensors are payloads, never protobuf
 * `bytes` fields, so a server reads them straight into the buffer a method's
 * payload callback names, and a client reads reply payloads straight into a
 * buffer it names. The first frame of a connection is a hello (protocol
 * version, service name, token); nothing else is served before it.
 *
 * Server: stria_rpc_server_start() binds, listens and runs a libuv loop on a
 * thread of its own. Every callback (payload, handler, tick, posted function)
 * runs on that thread, one at a time, so a service keeps its state without
 * locks as long as only callbacks touch it. A handler replies at once or
 * later, from any thread, with stria_rpc_call_reply() or stria_rpc_call_fail().
 *
 * Client: plain blocking sockets with poll() for deadlines; no event loop.
 * A client is one connection, used by one call at a time (concurrent calls
 * from several threads are serialised by a mutex); open one client per thread
 * for parallel transfers. A call that fails with a transport error or a
 * timeout closes the connection; the next call reconnects (hello included).
 *
 * Authentication and roles: a server has up to three credentials (tokens),
 * one per role: client, worker, admin. Without any, every connection has
 * every role. With any, the hello is a challenge and response (see
 * proto/stria.proto, "Authentication"): the client proves its token with an
 * HMAC over both sides' nonces, the server tries each of its credentials in
 * constant time, and the one that matches is the connection's only role; a
 * connection that proves none is answered STRIA_ERR_AUTH and closed. The
 * server proves the same token back, and a client with a token refuses a
 * server that does not (or that checks no credential at all). Tokens never
 * travel. Methods name the roles that may call them (STRIA_RPC_METHOD_*).
 *
 * Sessions and job secrets: both ends keep the hello's nonces and a key
 * derived from them and the proven token (stria_auth_session_t). A
 * job-scoped request proves the job's secret in its field 60 (job_proof):
 * the client fills it when the request names a secret
 * (stria_rpc_request_t.job_secret), a handler checks it with
 * stria_rpc_call_check_job().
 */
#ifndef STRIA_RPC_H
#define STRIA_RPC_H

#include <protobuf-c/protobuf-c.h>
#include <sys/uio.h>

#include "stria_methods.h"

#include "stria_auth.h"
#include "stria_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- frames ------------------------------------------------------------ */

#define STRIA_RPC_MAGIC       0x41525453u /* "STRA" as little-endian bytes */
#define STRIA_RPC_VERSION     2
#define STRIA_RPC_HEADER_SIZE 40
#define STRIA_RPC_FLAG_REPLY  0x1u
#define STRIA_RPC_FLAG_HELLO  0x2u

/* Default limits of one frame. */
#define STRIA_RPC_DEFAULT_MAX_PB      (16u << 20)
#define STRIA_RPC_DEFAULT_MAX_PAYLOAD ((uint64_t)1 << 30)
/* A hello message is small; a larger one is refused. */
#define STRIA_RPC_MAX_HELLO_PB (64u << 10)

typedef struct {
    uint32_t magic;
    uint16_t version;
    uint16_t flags;
    uint32_t method;
    int32_t status;
    uint64_t request_id;
    uint32_t pb_len;
    uint32_t timeout_ms;
    uint64_t payload_len;
} stria_rpc_header_t;

/* Serialises a header into 40 little-endian bytes. */
void stria_rpc_header_encode(const stria_rpc_header_t *header, uint8_t out[STRIA_RPC_HEADER_SIZE]);
/* Parses 40 bytes; checks nothing (the receiver validates the fields). */
void stria_rpc_header_decode(const uint8_t in[STRIA_RPC_HEADER_SIZE], stria_rpc_header_t *header);

/* ---- helpers ----------------------------------------------------------- */

/* Reads a token from a file: the first line without its line end and
 * surrounding blanks; it must be 1..4096 printable characters. *token_out is
 * allocated with malloc(); the caller frees it. */
stria_status_t stria_rpc_token_read(const char *path, char **token_out);

/* Constant-time comparison of two NUL-terminated strings: the time depends on
 * the longer length only, never on where they differ. NULL equals "". */
bool stria_rpc_token_equal(const char *a, const char *b);

/* ---- server ------------------------------------------------------------ */

typedef struct stria_rpc_server stria_rpc_server_t;
typedef struct stria_rpc_call stria_rpc_call_t;

/* Called with the decoded request once the request (and its payload, if any)
 * has arrived. The handler must eventually reply exactly once, on any thread. */
typedef void (*stria_rpc_handler_cb)(void *ctx, stria_rpc_call_t *call);

/* Called when a request announces payload_len > 0 raw bytes, after its
 * protobuf message is decoded (stria_rpc_call_request() is valid) and before
 * any payload byte is read. Set *buf_out to a buffer of at least payload_len
 * bytes that stays valid until the call is destroyed (see
 * stria_rpc_call_set_cleanup()); the bytes are read straight into it. A
 * non-OK return (with stria_error_set()) makes the server skip the payload
 * and reply with that status and message; the handler is then not called. */
typedef stria_status_t (*stria_rpc_payload_cb)(void *ctx, stria_rpc_call_t *call,
                                               uint64_t payload_len, void **buf_out);

/* What a payload callback returns when it names the buffer later (it has to
 * ask somebody first): the server stops reading the connection until
 * stria_rpc_call_payload_ready() gives the buffer, or an error, for the
 * call. The loop goes on serving every other connection meanwhile. */
#define STRIA_RPC_PAYLOAD_LATER ((stria_status_t)1)

/* Names the buffer of a call whose payload callback returned
 * STRIA_RPC_PAYLOAD_LATER: `buf` (payload_len bytes, valid as the callback's
 * would be), or status < 0 with a message, which refuses the request (its
 * payload is skipped, the reply carries the message, the handler is not
 * called). Exactly once per such call, from any thread but not from inside
 * the payload callback; before stria_rpc_server_stop(). If the connection
 * closed meanwhile the call is destroyed (its cleanup runs). */
void stria_rpc_call_payload_ready(stria_rpc_call_t *call, stria_status_t status, void *buf,
                                  const char *message);

/* A function to run later with its argument. */
typedef void (*stria_rpc_done_cb)(void *arg);

/* Roles of a connection (a mask). */
#define STRIA_RPC_ROLE_CLIENT 0x1u
#define STRIA_RPC_ROLE_WORKER 0x2u
#define STRIA_RPC_ROLE_ADMIN  0x4u
#define STRIA_RPC_ROLE_ALL    0x7u
/* "client", "worker", "admin" or "client, worker, admin" for a mask. */
const char *stria_rpc_role_names(unsigned roles);

/* Who may call a method; without a flag, every role. */
#define STRIA_RPC_METHOD_ADMIN  0x1u /* the admin role only */
#define STRIA_RPC_METHOD_WORKER 0x2u /* the worker role only */
#define STRIA_RPC_METHOD_CLIENT 0x4u /* the client or admin role (not a worker's credential) */

/* How a server serves one method of its service. The table is indexed by
 * the method's index in the service descriptor (stria_methods.h, generated
 * from stria.proto, names them: STRIA_RPC_<SERVICE>_<METHOD>). */
typedef struct {
    stria_rpc_handler_cb handler; /* NULL: not served (STRIA_ERR_UNSUPPORTED) */
    stria_rpc_payload_cb payload; /* NULL: requests with a payload are refused */
    unsigned flags;               /* STRIA_RPC_METHOD_* */
    /* Largest protobuf message of a request; a larger one is refused before
     * it is read or decoded (the connection stays usable). 0: the server's
     * max_pb_bytes. */
    uint32_t max_pb_bytes;
    /* The method's name in the proto: required with a handler, and checked
     * against the descriptor when the server starts, so a table that is out
     * of step with the service is refused instead of serving the wrong
     * handler. */
    const char *name;
} stria_rpc_method_t;

/* An entry of a method table, in its slot and with its name, for a method
 * of stria_methods.h: STRIA_RPC_SERVE(WORKER_SESSION_CALL, .handler = fn). */
#define STRIA_RPC_SERVE(id, ...) [STRIA_RPC_##id] = {.name = STRIA_RPC_##id##_NAME, __VA_ARGS__}

/* Zero-initialise and set the fields; zero means the default. */
typedef struct {
    const char *listen;                        /* "HOST:PORT"; port 0 picks a free port */
    const ProtobufCServiceDescriptor *service; /* the service exposed */
    const stria_rpc_method_t *methods;         /* service->n_methods entries, copied */
    void *ctx;                                 /* first argument of every callback */
    /* Credentials of the roles (NULL or "": that role has none); copied.
     * Without any, every connection has every role. They must differ. */
    const char *token; /* the client role's */
    const char *worker_token;
    const char *admin_token;
    uint32_t max_pb_bytes;      /* default STRIA_RPC_DEFAULT_MAX_PB */
    uint64_t max_payload_bytes; /* default STRIA_RPC_DEFAULT_MAX_PAYLOAD */
    uint32_t max_connections;   /* default 1024; extra connections are closed */
    uint32_t max_inflight;      /* unanswered requests per connection before the
                                   server stops reading it; default 64 */
    double hello_timeout_s;     /* a connection silent this long after accept is
                                   closed; default 10 */
    stria_rpc_done_cb tick;     /* NULL or run every tick_period_s on the loop */
    double tick_period_s;
    const char *name; /* for logs ("coordinator"); copied */
    /* No loop thread: the loop runs only inside stria_rpc_server_run() on the
     * caller's thread, which is then the loop thread (tests and fuzzers drive
     * a server without a thread switch per request). */
    bool no_thread;
} stria_rpc_server_params_t;

/* Binds, listens and starts the loop thread. Errors: STRIA_ERR_INVALID_ARG
 * (bad params or address), STRIA_ERR_IO (bind/listen failed, e.g. address in
 * use), STRIA_ERR_NO_MEMORY. Free with stria_rpc_server_stop(). */
stria_status_t stria_rpc_server_start(const stria_rpc_server_params_t *params,
                                      stria_rpc_server_t **server_out);

/* A server started with no_thread: runs what is ready on its loop (wait
 * false), or waits for at least one event first (wait true). Returns whether
 * the loop still has active handles. */
bool stria_rpc_server_run(stria_rpc_server_t *server, bool wait);

/* Serves a connected stream socket (one end of a socketpair(), say) as if it
 * had been accepted; the server owns fd from now on, also on failure. Call
 * it on the loop thread. `peer` names the other end in logs. */
stria_status_t stria_rpc_server_adopt(stria_rpc_server_t *server, int fd, const char *peer);

/* The bound port (useful after listening on port 0). */
uint16_t stria_rpc_server_port(const stria_rpc_server_t *server);

/* Seconds since the server's loop thread last ran its 250 ms housekeeping
 * timer: a few tenths while the loop is responsive, growing while a callback
 * blocks it. Callable from any thread; a liveness probe for watchdogs. */
double stria_rpc_server_loop_age(const stria_rpc_server_t *server);

/* Runs fn(arg) on the loop thread soon; callable from any thread, including
 * the loop thread itself (then it runs after the current callback). */
stria_status_t stria_rpc_server_post(stria_rpc_server_t *server, stria_rpc_done_cb fn, void *arg);

/* Closes the listener and every connection, stops and joins the loop thread
 * and frees the server. Call it from a thread other than the loop thread,
 * after every call has been replied to (a reply after stop is undefined).
 * NULL is ignored. */
void stria_rpc_server_stop(stria_rpc_server_t *server);

/* The decoded request, of the method's input type. Valid until the call is
 * replied to. */
const ProtobufCMessage *stria_rpc_call_request(const stria_rpc_call_t *call);
/* The request payload (the buffer from the payload callback) and its length;
 * NULL and 0 without a payload. */
void *stria_rpc_call_payload(const stria_rpc_call_t *call, uint64_t *len_out);
/* The method index. */
uint32_t stria_rpc_call_method(const stria_rpc_call_t *call);
/* Whether the connection has the admin role. */
bool stria_rpc_call_admin(const stria_rpc_call_t *call);
/* The connection's roles (STRIA_RPC_ROLE_*). */
unsigned stria_rpc_call_roles(const stria_rpc_call_t *call);
/* The connection's session (the hello's nonces and the session key). */
const stria_auth_session_t *stria_rpc_call_session(const stria_rpc_call_t *call);
/* The request id the client chose. */
uint64_t stria_rpc_call_request_id(const stria_rpc_call_t *call);
/* Checks the job_proof (field 60) of a job-scoped request against the job's
 * secret: bound to this connection's session, this request's id and method,
 * and job_id; the ids of a connection's checked requests must not go back.
 * Errors: STRIA_ERR_AUTH, with a message naming the method and the job
 * ("missing job secret proof", "wrong job secret"). Loop thread only. */
stria_status_t stria_rpc_call_check_job(stria_rpc_call_t *call, const stria_job_secret_t *secret,
                                        uint64_t job_id);
/* The same, the proof binding `extra` bytes of the request too (see
 * stria_rpc_request_t.proof_extra): a request whose bytes an attacker on
 * the path changed is refused as a wrong proof. */
stria_status_t stria_rpc_call_check_job_extra(stria_rpc_call_t *call,
                                              const stria_job_secret_t *secret, uint64_t job_id,
                                              const void *extra, size_t extra_len);
/* When the client gives up waiting, on the stria_time_now() clock; 0 when the
 * client set no deadline. */
double stria_rpc_call_deadline(const stria_rpc_call_t *call);
/* "ADDRESS:PORT" of the client, for logs. Valid while the call lives. */
const char *stria_rpc_call_peer(const stria_rpc_call_t *call);
/* Runs fn(arg) on the loop thread when the call is destroyed: after its reply
 * is written, or when the connection is lost (even before the handler ran,
 * e.g. in the middle of its payload). Use it to release the payload buffer.
 * One cleanup per call; a second call replaces the first. Loop thread only. */
void stria_rpc_call_set_cleanup(stria_rpc_call_t *call, stria_rpc_done_cb fn, void *arg);
/* The argument of the call's cleanup (NULL without one): what the payload
 * callback kept for the handler. */
void *stria_rpc_call_cleanup_arg(const stria_rpc_call_t *call);

/* Replies to a call and releases it (the call and its request are invalid
 * afterwards). `reply` must be of the method's output type; it is serialised
 * before this returns, so the caller may free it at once. `payload` (may be
 * NULL with payload_len 0) is sent after it: when payload_done is NULL it is
 * copied now; otherwise it is sent from the caller's buffer, which must stay
 * valid until payload_done(payload_done_arg) runs on the loop thread (after
 * the write, or when the connection is gone). Callable from any thread.
 * Returns STRIA_ERR_INVALID_ARG for a reply of the wrong type (the client
 * then gets STRIA_ERR_INTERNAL) and STRIA_ERR_NO_MEMORY; the call is released
 * in every case. */
stria_status_t stria_rpc_call_reply(stria_rpc_call_t *call, const ProtobufCMessage *reply,
                                    const void *payload, uint64_t payload_len,
                                    stria_rpc_done_cb payload_done, void *payload_done_arg);

/* Replies with an error status (< 0) and a message, and releases the call.
 * Callable from any thread. */
void stria_rpc_call_fail(stria_rpc_call_t *call, stria_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The same, saying whether the failure is retryable (RpcError.retryable);
 * the client's stria_error_retryable() reads it. */
void stria_rpc_call_fail_r(stria_rpc_call_t *call, stria_status_t status, bool retryable,
                           const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* ---- client ------------------------------------------------------------ */

typedef struct stria_rpc_client stria_rpc_client_t;

/* Zero-initialise and set the fields; zero means the default. */
typedef struct {
    const char *address;                       /* "HOST:PORT" of the server */
    const ProtobufCServiceDescriptor *service; /* the service expected there */
    /* The credential to prove (NULL: none; copied). With one, a server that
     * does not prove it back is refused. */
    const char *token;
    const char *client_name;    /* for the server's logs; copied */
    double connect_timeout_s;   /* connect + hello; default 10 */
    uint32_t max_pb_bytes;      /* largest reply message accepted; default 16 MiB */
    uint64_t max_payload_bytes; /* largest reply payload accepted; default 1 GiB */
} stria_rpc_client_params_t;

/* Connects and exchanges the hello. Errors: STRIA_ERR_IO (cannot connect),
 * STRIA_ERR_TIMEOUT, STRIA_ERR_AUTH (token refused), STRIA_ERR_PROTOCOL
 * (version or service mismatch, not a stria server). Free with
 * stria_rpc_client_close(). */
stria_status_t stria_rpc_client_connect(const stria_rpc_client_params_t *params,
                                        stria_rpc_client_t **client_out);

/* Closes the connection and frees the client; NULL is ignored. */
void stria_rpc_client_close(stria_rpc_client_t *client);

/* Abandons the call another thread has in progress on this client, and
 * every later one: each fails at once with STRIA_ERR_CANCELLED ("abandoned").
 * For a caller that stops waiting on a server (its job failed elsewhere);
 * the client is good only for stria_rpc_client_close() afterwards. Safe from
 * any thread while the client is open. */
void stria_rpc_client_abort(stria_rpc_client_t *client);

/* For a client kept idle between uses: if the server closed its
 * connection (or sent anything unasked), the connection is dropped, and the
 * next call connects and says hello anew. False for a client that is good
 * only for closing (stria_rpc_client_abort()). Never waits. */
bool stria_rpc_client_check_idle(stria_rpc_client_t *client);

/* The connection's descriptor, for a caller that waits on several
 * connections with poll(2) for the first reply to read (-1: not
 * connected). Only for readiness: all reading goes through the client. */
int stria_rpc_client_fd(stria_rpc_client_t *client);

/* Whether the server granted the admin role at the last hello. */
bool stria_rpc_client_admin(const stria_rpc_client_t *client);
/* The roles the server granted at the last hello (STRIA_RPC_ROLE_*). */
unsigned stria_rpc_client_roles(const stria_rpc_client_t *client);

/* The server's frame limits from the last hello. */
uint64_t stria_rpc_client_max_payload(const stria_rpc_client_t *client);
/* Whether the client's last failed call ended in the server's error reply
 * (its status and message; the connection stays), rather than in a lost,
 * refused or silent connection. */
bool stria_rpc_client_server_error(const stria_rpc_client_t *client);

/* One call. */
typedef struct {
    uint32_t method;                 /* index in the service */
    const ProtobufCMessage *request; /* of the method's input type */
    const void *payload;             /* raw bytes sent after the request; */
    uint64_t payload_len;            /* read during the call only */
    void *reply_buf;                 /* where a reply payload goes; NULL: */
    uint64_t reply_buf_cap;          /* allocated (see stria_rpc_reply_t) */
    double timeout_s;                /* whole call; <= 0: no deadline */
    /* Scattered I/O (instead of payload and reply_buf): the request payload
     * is the concatenation of payload_iov[0..payload_iovcnt) (read during
     * the call; payload_len is then their total), and a reply payload is
     * read into reply_iov[0..reply_iovcnt) in order, their total being the
     * capacity (reply.payload then points at the first). Any number of
     * pieces. */
    const struct iovec *payload_iov;
    size_t payload_iovcnt;
    const struct iovec *reply_iov;
    size_t reply_iovcnt;
    /* A job-scoped request: the secret to prove in the request's field 60
     * (job_proof, which must be a `bytes` field of the request type), for
     * job job_id, on whatever connection the call goes out on. NULL: none. */
    const stria_job_secret_t *job_secret;
    uint64_t job_id;
    /* Bytes of the request the proof binds too (stria_job_secret_prove_extra();
     * the server checks them with stria_rpc_call_check_job_extra()); NULL: none. */
    const void *proof_extra;
    size_t proof_extra_len;
} stria_rpc_request_t;

/* A reply. Free with stria_rpc_reply_free(). */
typedef struct {
    ProtobufCMessage *msg; /* of the method's output type */
    void *payload;         /* reply_buf when one was given, else allocated */
    uint64_t payload_len;  /* 0 when the reply had no payload */
    /* The session of the connection the reply came on: what the server
     * sealed in it opens with this (stria_auth_open()). */
    stria_auth_session_t session;
    void *stria__arena;
    bool stria__payload_owned;
} stria_rpc_reply_t;

/* Sends a request and waits for its reply until the deadline. On success
 * *reply_out holds the reply. Errors: the server's status with its message
 * (e.g. STRIA_ERR_INVALID_ARG for a bad job spec); STRIA_ERR_TIMEOUT (the
 * connection is closed); STRIA_ERR_CLOSED / STRIA_ERR_IO (the connection is
 * closed); STRIA_ERR_PROTOCOL (an invalid reply; closed); STRIA_ERR_NO_MEMORY
 * (the reply payload is larger than reply_buf_cap; the connection stays
 * usable). */
stria_status_t stria_rpc_client_call(stria_rpc_client_t *client, const stria_rpc_request_t *req,
                                     stria_rpc_reply_t *reply_out);

/* Calls pipelined on one connection: every request (and its payload) is
 * sent before the first reply is read, so the connection never waits a round
 * trip between them (payload after payload at link speed); then the replies
 * are read in order, replies[i] that of reqs[i]. n is 1..STRIA_RPC_MAX_BATCH
 * (the server reads up to 64 unanswered requests of a connection). Returns
 * the first failure, with its message, all replies freed; an error reply
 * leaves the connection usable (the other replies are still read), anything
 * else closes it as in stria_rpc_client_call(), which is a batch of one. */
#define STRIA_RPC_MAX_BATCH 32
stria_status_t stria_rpc_client_call_batch(stria_rpc_client_t *client,
                                           const stria_rpc_request_t *reqs, size_t n,
                                           stria_rpc_reply_t *replies);

/* A call in two halves, for a caller that keeps several connections busy
 * from one thread (a session's call goes to every rank's worker before any
 * reply is read): stria_rpc_client_send() sends the request (and its
 * payload) and returns; stria_rpc_client_recv() reads its reply, with the
 * same request (its method and reply buffers) and what the send returned.
 * Between the two, no other call may run on the client (the caller
 * serialises); the deadline is the request's, counted from the send. A send
 * that failed needs no receive. Errors as stria_rpc_client_call(). */
typedef struct {
    uint64_t request_id;
    double deadline; /* stria_time_now(); 0: none */
} stria_rpc_pending_t;
stria_status_t stria_rpc_client_send(stria_rpc_client_t *client, const stria_rpc_request_t *req,
                                     stria_rpc_pending_t *pending_out);
stria_status_t stria_rpc_client_recv(stria_rpc_client_t *client, const stria_rpc_request_t *req,
                                     const stria_rpc_pending_t *pending,
                                     stria_rpc_reply_t *reply_out);

/* Frees the reply message and an allocated payload; safe on a zeroed reply. */
void stria_rpc_reply_free(stria_rpc_reply_t *reply);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_RPC_H */
