/* libstria internals: the client, its sessions and their calls.
 *
 * One data plane. Every job is a session at the service (opened with the
 * job's shape as its bounds, its forward a call whose inputs the workers
 * hold for its backward, its backward the next call, then closed): the
 * library has one way to move tensors and run a pass, a session's call.
 *
 * Rooms, from the ground up (a room calls only rooms listed above it; the
 * names it shares here carry its prefix):
 *
 *   client_abi.c     stria__labi_*    the ABI of the public structs: sizes read and written
 *   client_coord.c   stria__lcoord_*  calls to the coordinator: submit and the queue, the
 *                                     verdict on a session that failed, its replacement
 *   client_rank.c    stria__lrank_*   one rank of a session: its worker's connection, its
 *                                     open, its data path and arena (shared memory)
 *   client_call.c    stria__lcall_*   one try of a call on some ranks: their inputs placed
 *                                     (payload, pieces or arena), requests, replies, the
 *                                     outputs gathered, progress, the try's verdict
 *   client_session.c stria__lsess_*   sessions: open, import, calls with their retries
 *                                     (opened anew, or following a replacement), held
 *                                     forwards, buffers, a call's positions, close
 *   client_groups.c  stria__lgroup_*  head groups: a session of G rings (sessions of
 *                                     heads / G), calls run on all at once, auto G
 *   client_api.c                      the session API (stria_session_*, stria_call_*
 *                                     positions) over sessions and head groups
 *   client_job.c                      the job API (stria_client_forward, _submit, ...)
 *                                     over sessions
 *   client.c                          connect, close
 *
 * Threads: a session is used by one thread at a time (its lock serialises
 * calls from several); a call runs on its caller's thread, with one helper
 * thread only when the caller wants progress (the helper talks to the
 * workers; the caller polls and reports). A client's own list of sessions
 * and jobs belongs to the thread that opens and closes them.
 *
 * Ownership: a session owns its ranks, their connections, payload buffers
 * and arenas (mapped until the session closes, also across a reopening or
 * a replacement: pointers handed out stay valid); a job owns its session
 * and a copy of its documents. */
#ifndef STRIA_CLIENT_INT_H
#define STRIA_CLIENT_INT_H

#include <pthread.h>

#include "stria.pb-c.h"
#include "stria_client.h"
#include "stria_docplan.h"
#include "stria_rpc.h"
#include "stria_shm.h"
#include "stria_spec.h"

#define STRIA__COORD_TIMEOUT_S 10.0
#define STRIA__DEFAULT_STEP_S  60.0 /* the workers' default step deadline */
#define STRIA__POLL_S          0.2
/* Once a rank's reply says its call failed, how long the ranks still
 * silent get to answer (a healthy one hears of the failure from the ring
 * at once) before the try gives up on them (a stalled or cut-off worker
 * would keep it waiting for the whole call deadline). */
#define STRIA__ABANDON_S 2.0
/* A call still waiting for a worker after this long asks the coordinator
 * whether its session is still on, every second after: a worker cut off
 * from this client and its peers never answers, but the coordinator ends
 * the session (its heartbeats stop), and the call fails then. */
#define STRIA__WATCH_S         2.0
#define STRIA__MAX_BLAMED      64 /* workers one try blames */
#define STRIA__DEFAULT_RETRIES 2
/* How long a coordinator call keeps trying while the coordinator is out of
 * reach (a restart) or rebuilds its jobs (busy). */
#define STRIA__RECONNECT_S 60.0
/* How long a sharded rank waits at most for the coordinator's verdict on
 * replacing its session after a failure (the coordinator waits a few
 * heartbeat periods for a verdict on a worker). */
#define STRIA__REPLACE_WAIT_S 120.0
/* How long a rank whose worker was lost (refused, closed, silent) waits for
 * the coordinator to see it too (its verdict takes 3 heartbeat periods)
 * while the session is still on there. */
#define STRIA__VERDICT_WAIT_S 30.0
/* The inputs of one request at most, whatever the worker takes: a larger
 * call's inputs go in pieces of this size. */
#define STRIA__PIECE_MAX ((uint64_t)64 << 20)
/* Forwards a session may hold (the coordinator's STRIA_COORD_MAX_HELD). */
#define STRIA__MAX_HELD 63

/* ---- records ----------------------------------------------------------------- */

/* What the sessions of a client leave for the next ones (client_rank.c):
 * connections to workers (a hello is a round trip and a key exchange) and
 * arenas (a memfd allocated, sealed and mapped, which the workers keep
 * mapped for a while too: a job on the same workers faults no page). */
#define STRIA__KEPT_CONNS       32
#define STRIA__KEPT_ARENAS      16
#define STRIA__KEPT_ARENA_BYTES ((size_t)4 << 30)

typedef struct {
    char address[300];
    stria_rpc_client_t *conn;
} stria__lconn_t;

typedef struct {
    int fd;
    char *base;
    size_t size;
    char address[300]; /* the worker it was last registered with (which keeps it mapped) */
} stria__larena_t;

struct stria_client {
    stria_client_params_t params;
    char *coordinator;
    char *token;
    char *client_name;
    stria_rpc_client_t *coord;
    stria_session_t *sessions; /* open sessions, closed by stria_client_close() */
    stria_job_t *jobs;         /* open jobs, released by stria_client_close() */
    /* kept for the next sessions (keep_lock; sessions of several threads) */
    pthread_mutex_t keep_lock;
    stria__lconn_t kept_conns[STRIA__KEPT_CONNS];
    int n_kept_conns;
    stria__larena_t kept_arenas[STRIA__KEPT_ARENAS];
    int n_kept_arenas;
    size_t kept_arena_bytes; /* arenas and payload buffers kept */
    struct {
        void *p;
        size_t size;
    } kept_bufs[STRIA__KEPT_ARENAS]; /* TCP ranks' payload buffers, their pages touched */
    int n_kept_bufs;
};

/* One rank of a session, as this handle reaches it. */
typedef struct {
    int rank;
    char rpc_address[300];
    char shm_socket[STRIA_SHM_MAX_PATH]; /* the worker's; "": none */
    uint64_t worker_id;
    stria_rpc_client_t *conn;
    bool opened;    /* OpenSession answered on this handle */
    bool used;      /* this handle runs the rank (sharded: its own) */
    bool path_done; /* its data path is decided */
    char tcp_why[300];
    /* The arena: a sealed memfd of this process, mapped here, registered
     * with the rank's worker while arena_sock is open. Kept when the
     * session is opened anew or replaced (registered again there). */
    int arena_fd, arena_sock;
    char *arena;
    size_t arena_size;
    /* a payload call's inputs and outputs (grown, kept) */
    void *up, *down;
    size_t up_cap, down_cap;
} stria__lrank_t;

/* The spec a session is submitted with: the job API's (a job's call and
 * its bounds alike), or a session's bounds. */
typedef struct {
    stria_job_spec_t js; /* strings and arrays borrowed until the submission */
    bool session;        /* JobSpec.session: its calls are not reported */
    bool sharded;
    uint32_t max_held;
    /* a head group's ring: its group of head_groups, the tag they share
     * (JobSpec.head_group*: what striactl draws as one grid) */
    uint32_t head_group, head_groups;
    uint64_t head_group_tag;
    /* workers the first submission excludes (earlier tries blamed them);
     * with `blame`, a failed open adds the workers it blames there (at most
     * STRIA__MAX_BLAMED in all) */
    uint64_t *exclude;
    size_t *n_exclude;
    bool blame;
    /* times a whole-sequence open that failed retryably is tried again (a
     * worker lost as it opened); < 0: the client's forward_retries */
    int retries;
} stria__lopen_t;

struct stria_session {
    stria_client_t *client;
    stria_session_t *next;     /* client->sessions (not a job's) */
    pthread_mutex_t lock;      /* one call at a time */
    stria_session_spec_t spec; /* as opened or imported, without strings and arrays */
    stria__lopen_t open;       /* how to open it anew (its strings and arrays cleared) */
    bool sharded;
    bool job; /* a job's session (client_job.c) */
    /* at the service now (id 0: none) */
    uint64_t id;
    stria_job_secret_t secret;
    stria_layout_kind_t layout; /* as assigned */
    int n_ranks;
    stria__lrank_t *ranks;
    double call_timeout_s;
    /* calls */
    uint64_t next_call;
    uint64_t epoch;     /* the ring links' generation (see stria__lcall_epoch()) */
    uint64_t held_mask; /* regions held by forwards (index 0 .. max_held) */
    uint64_t held_call[STRIA__MAX_HELD + 1];
    pid_t pid;
    stria_session_stats_t stats;
    /* workers a retry must not use (the failed tries'); the next submission's */
    uint64_t blamed[STRIA__MAX_BLAMED];
    size_t n_blamed;
    bool release_once; /* its release tries the coordinator once (closing) */
    /* head groups (spec.head_groups > 1): a parent's rings, one session of
     * heads / n_groups per head group (the parent itself has no ranks); in
     * such a ring, its place (head group `group` of `group_of`; 0 of 0 in
     * a session that is not a head group's) */
    stria_session_t **groups;
    int n_groups, group, group_of;
    /* a parent called by one trainer rank per worker (trainer_ranks): each
     * ring rank's n_groups parts come from n_groups trainer ranks */
    bool parts;
    /* a parent's held forwards: slot i (held_mask, held_call: its first
     * ring's handle) is ring g's group_held[i * n_groups + g] */
    uint64_t *group_held;
};

/* ---- client_abi.c ---- */
/* The sizes of the structs as ABI 1 declared them: the smallest a caller may
 * pass. Later versions add fields at the end and keep these. */
#define STRIA__V1_END(type, last) (offsetof(type, last) + sizeof(((type *)0)->last))
/* Whether `theirs`, a caller's struct_size, can be the size of a version of
 * a struct whose ABI 1 size is v1 and whose current size is ours. */
stria_status_t stria__labi_size_ok(size_t theirs, size_t v1, size_t ours, const char *what,
                                   const char *init);
/* Reads a caller's struct that starts with its struct_size into ours
 * (`size` bytes, zeroed first): a smaller struct (an older header; at least
 * `v1`) leaves our later fields zero, a larger one is accepted only when the
 * bytes this library does not know are all zero. */
stria_status_t stria__labi_read(void *dst, size_t size, size_t v1, const void *src,
                                const char *what, const char *init);
/* A caller's stats struct: its size checked; ours written into it as far
 * as its struct_size reaches (fields this library does not fill zeroed). */
stria_status_t stria__labi_check_stats(const stria_call_stats_t *stats);
void stria__labi_write_stats(stria_call_stats_t *out, const stria_call_stats_t *ours);
/* The caller's call record into the one shape record (documents borrowed). */
stria_status_t stria__labi_call(const stria_call_t *in, stria_call_shape_t *out);
/* How many tokens rank `rank` of a ring of n_ranks holds in `call` under
 * `layout` (*count_out), and their global positions in the order the rank
 * holds them (positions_out, may be NULL): the call checked, its layout by
 * stria_docplan_layout(). fn names the caller in errors. */
stria_status_t stria__lcall_positions(const char *fn, stria_layout_kind_t layout, int n_ranks,
                                      const stria_call_shape_t *call, int rank, int64_t *count_out,
                                      int64_t *positions_out);
/* The call record of a job spec (its documents borrowed). */
stria_call_shape_t stria__labi_job_call(const stria_job_spec_t *s);

/* ---- client_coord.c ---- */
/* A call to the coordinator, about session `id` (its secret proven) unless
 * secret is NULL. With `patient`, a connection that broke or was refused (a
 * restarting coordinator) and a job-scoped call answered busy (a restarted
 * coordinator rebuilding its jobs) are tried again for up to
 * STRIA__RECONNECT_S. */
stria_status_t stria__lcoord_call(stria_client_t *c, uint32_t method, const ProtobufCMessage *req,
                                  const stria_job_secret_t *secret, uint64_t id,
                                  stria_rpc_reply_t *reply, bool patient);
/* The hosts of the ring's workers in the coordinator's ring order
 * (GetRing: healthy workers only), at most cap, into hosts. */
#define STRIA__HOST_LEN 256
stria_status_t stria__lcoord_ring_hosts(stria_client_t *c, char (*hosts)[STRIA__HOST_LEN],
                                        size_t cap, size_t *n_out);
/* What the coordinator says of a session (GetJob). */
typedef struct {
    Stria__V1__JobState state;
    uint32_t queue_position;
    uint32_t step, steps_total; /* the slowest rank's, as the heartbeats tell */
    uint64_t replaced_by;
    bool replacement_pending;
    bool failure_retryable;
    stria_status_t failure_status; /* FAILED: the status to report it with (0: none) */
    char failure[512];
    uint64_t blamed[STRIA__MAX_BLAMED];
    size_t n_blamed;
} stria__linfo_t;
/* A submission's outcome: the session's id and secret, and the reply whose
 * assignment names its ranks (free it with stria_rpc_reply_free()); on a
 * failure the workers it blames. */
typedef struct {
    uint64_t id;
    stria_job_secret_t secret;
    stria_rpc_reply_t reply;
    const Stria__V1__Assignment *assignment;
    bool retryable;
    uint64_t blamed[STRIA__MAX_BLAMED];
    size_t n_blamed;
} stria__lsubmit_t;
/* Submits `o` (on a ring without the workers exclude[0 .. n)) and waits
 * while it is queued (progress QUEUED). A queued session the coordinator
 * forgot (a restart: nothing of it ran) is submitted again, a few times. An
 * error with out->id set: admitted, then failed (the caller releases it). */
stria_status_t stria__lcoord_submit(stria_client_t *c, const stria__lopen_t *o,
                                    const uint64_t *exclude, size_t n_exclude,
                                    stria_progress_cb progress, void *arg, stria__lsubmit_t *out);
/* The coordinator's record of session `id` (GetJob, its secret proven);
 * `patient` as in stria__lcoord_call(); with `reply` (may be NULL) the
 * reply is kept there (its assignment), else freed. STRIA_ERR_NOT_FOUND:
 * the coordinator does not know it (any more). */
stria_status_t stria__lcoord_info(stria_client_t *c, uint64_t id, const stria_job_secret_t *secret,
                                  bool patient, stria__linfo_t *out, stria_rpc_reply_t *reply);
/* The session that replaces session `id`, at the end of its chain, waiting
 * while the coordinator waits for a verdict (and, with `lost`: this rank's
 * worker was lost, while the session is still on, for the coordinator to
 * see it); 0 when none. */
uint64_t stria__lcoord_replacement(stria_client_t *c, uint64_t id, const stria_job_secret_t *secret,
                                   bool lost);
/* Tells the coordinator that ranks[0 .. n) of session `id` are done with it
 * (all of them: n 0), trying once unless `patient`. */
stria_status_t stria__lcoord_release(stria_client_t *c, uint64_t id,
                                     const stria_job_secret_t *secret, const uint32_t *ranks,
                                     size_t n, bool patient);

/* ---- client_rank.c ---- */
/* The ranks of an assignment into the session (its layout checked); the
 * arenas of the ranks it had are kept, by rank. */
stria_status_t stria__lrank_assign(stria_session_t *s, const Stria__V1__Assignment *a);
/* Opens the given ranks on their workers (OpenSession: every request first,
 * then the replies; `early`: without waiting for their ring links, which
 * their first call waits for) and decides their data paths; the outcome of
 * each in out[i] (see stria__lout_t). */
typedef struct {
    stria_status_t st;
    bool lost; /* its worker was lost (refused, closed, silent) or leaves */
    bool retryable;
    bool abandoned; /* given up on for another rank's failure: explains nothing */
    char error[768];
} stria__lout_t;
void stria__lrank_open(stria_session_t *s, const int *ranks, int n, bool early, stria__lout_t *out);
/* Records rank r's failure `st` (the thread's message) into *o. */
void stria__lrank_fail(const stria__lrank_t *r, stria_status_t st, stria__lout_t *o);
/* How well a rank's failure explains a try's (the one rule of the verdicts):
 * its own failure best, then a peer's abort (an echo of another rank's),
 * last a rank given up on. */
int stria__lrank_explains(const stria__lout_t *o);
/* The bytes of one call's region at the session's bounds; of its inputs. */
size_t stria__lrank_region(const stria_session_t *s, size_t *in_room_out);
/* Lets the session's ranks go at its workers (DropJob on the ranks this
 * handle used) and forgets them, their connections kept for the client's
 * next sessions when they are sound; arenas stay with the session unless
 * `arenas` (the session closes: they are kept for the next sessions). */
void stria__lrank_drop_all(stria_session_t *s, bool arenas);
/* Closes and unmaps what the client's sessions left (stria_client_close()). */
void stria__lrank_forget_kept(stria_client_t *c);
/* Makes *buf (of *cap bytes) hold `need`: a payload buffer a session left
 * (its pages faulted in once) or a new one. */
stria_status_t stria__lrank_grow(stria_client_t *c, void **buf, size_t *cap, size_t need);
/* Tells rank r's worker that held forward `call` will not be used. */
stria_status_t stria__lrank_release_held(stria_session_t *s, stria__lrank_t *r, uint64_t call);

/* ---- client_call.c ---- */
/* A call's tensors as the caller gives them: full tensors of the call's
 * batch and seq_len (whole-sequence sessions) or the rank's own tokens
 * (sharded). Inputs in payload order (forward Q, K, V; backward Q, K, V, O,
 * LSE, dO), outputs (forward O, LSE; backward dQ, dK, dV). A held forward's
 * backward reads only in[5] (dO). */
typedef struct {
    const void *in[6];
    void *out[3];
} stria__lio_t;
/* What a try of a call does. */
typedef struct {
    const stria_call_shape_t *shape;
    bool backward;
    bool hold;     /* keep the forward for its backward (held forwards) */
    bool use_held; /* the backward of the held forward `held_call` */
    uint64_t held_call;
    int region;    /* the arena region the call uses */
    uint64_t call; /* its number */
    /* a head group's part of its parent's call: the caller's tensors hold
     * every group's heads, this ring's taken out of them */
    bool all_heads;
    /* the caller is trainer rank `part` of the `parts` that call this
     * ring rank (stria_session_spec_t.trainer_ranks; 0: its only one) */
    uint32_t part, parts;
    const stria__lio_t *io;
    stria_progress_cb progress;
    void *progress_arg;
} stria__lcall_t;
/* What the try found: per rank, and over the ranks. */
typedef struct {
    stria__lout_t *out; /* per rank of the try */
    bool retryable, expired;
    double pass_max_s, compute_max_s, compute_min_s, wait_max_s, upload_s, download_s;
    uint32_t steps;
    uint64_t ring_bytes, minflt;
    uint64_t up_bytes, down_bytes;         /* tensor bytes that reached the workers and came back */
    uint64_t tcp_up_bytes, tcp_down_bytes; /* of them, over TCP */
} stria__lresult_t;
/* One try of call c on ranks[0 .. n) (all of a whole-sequence session; the
 * caller's own of a sharded one); STRIA_OK when every rank succeeded. The
 * failure's status and message name the rank whose failure explains the
 * others; res->retryable is the try's verdict; the workers lost are added
 * to the session's blamed. */
stria_status_t stria__lcall_try(stria_session_t *s, const stria__lcall_t *c, const int *ranks,
                                int n, stria__lresult_t *res);
/* The ring links' generation of the calls after call `call` failed on its
 * try `attempt` (every rank computes the same). */
uint64_t stria__lcall_epoch(uint64_t call, int attempt);

/* ---- client_session.c ---- */
/* Opens a session (submits it, waits in the queue with `progress`, opens
 * every rank of a whole-sequence one) into *out, not yet linked into the
 * client. The open's strings and arrays are read during the call only. */
stria_status_t stria__lsess_open(stria_client_t *c, const stria__lopen_t *o,
                                 const stria_session_spec_t *spec, stria_progress_cb progress,
                                 void *arg, stria_session_t **out);
/* The session of an export (session or job). */
stria_status_t stria__lsess_import(stria_client_t *c, const void *bytes, size_t len, bool job,
                                   stria_session_t **out);
/* A call with its retries (a whole-sequence session opened anew without the
 * blamed workers; a sharded one following its replacement, or on a fresh
 * link), its stats into `stats` (may be NULL); held is the held forward's
 * handle (hold: out; use_held: in). rank -1: whole-sequence. */
typedef struct {
    const stria_call_shape_t *shape;
    int rank;
    bool backward, hold, use_held;
    uint64_t held;
    const stria__lio_t *io;
    int retries;          /* of a forward that failed retryably; < 0: the client's */
    bool all_heads;       /* a parent's call on one of its rings (see stria__lcall_t) */
    uint32_t part, parts; /* (see stria__lcall_t) */
    stria_progress_cb progress;
    void *progress_arg;
    stria_call_stats_t *stats;
} stria__lreq_t;
stria_status_t stria__lsess_call(stria_session_t *s, const char *fn, const stria__lreq_t *r,
                                 uint64_t *held_out);
/* Where tensor t of a call of shape c lies in rank `rank`'s arena (region
 * 0), opening the rank if no call did yet. */
stria_status_t stria__lsess_buffer(stria_session_t *s, const char *fn, const stria_call_shape_t *c,
                                   int rank, stria_tensor_id_t t, stria_shard_buffer_t *out);
/* Closes the session at the service and frees the handle (a head-grouped
 * one's rings with it). */
stria_status_t stria__lsess_close(stria_session_t *s);
/* A handle of no session yet (a head-grouped session's parent). */
stria_session_t *stria__lsess_new(stria_client_t *client);
/* Lets held forward `held` go on rank `rank`'s workers (every rank's for a
 * whole-sequence session). STRIA_ERR_NOT_FOUND when it is not held. */
stria_status_t stria__lsess_release_held(stria_session_t *s, const char *fn, int rank,
                                         uint64_t held);
/* The first bytes of an export: a session's, a job's. */
#define STRIA__SESSION_EXPORT_MAGIC "STRIASS1"
#define STRIA__JOB_EXPORT_MAGIC     "STRIAJB2"

/* ---- client_groups.c ---- */
/* STRIA_HEAD_GROUPS_AUTO: one group per host of the coordinator's ring
 * where the hosts hold equal shares and divide kv_heads, else 1 (sets sp's
 * head_groups, and ring_size when it was 0 and groups were chosen). */
stria_status_t stria__lgroup_auto(stria_client_t *c, stria_session_spec_t *sp);
/* Opens a session of sp->head_groups > 1 rings (its spec checked, naming
 * what does not fit) into *out, not linked into the client. */
stria_status_t stria__lgroup_open(stria_client_t *c, const stria__lopen_t *o,
                                  const stria_session_spec_t *sp, stria_session_t **out);
/* Makes session r (a ring of heads / G) p's next head group. */
void stria__lgroup_adopt(stria_session_t *p, stria_session_t *r, int G);
/* A sharded head-grouped session's export (every ring's id and secret),
 * and its import; stria__lgroup_is_export() tells such an export. */
stria_status_t stria__lgroup_export(const stria_session_t *p, void *out, size_t cap,
                                    size_t *len_out);
bool stria__lgroup_is_export(const void *bytes, size_t len);
stria_status_t stria__lgroup_import(stria_client_t *c, const void *bytes, size_t len,
                                    stria_session_t **out);
/* A call on every ring of head-grouped session p at once; a held forward's
 * handle (its first ring's) into *held_out. */
stria_status_t stria__lgroup_call(stria_session_t *p, const char *fn, const stria__lreq_t *r,
                                  uint64_t *held_out);
/* Lets held forward `held` go on every ring of p. */
stria_status_t stria__lgroup_release_held(stria_session_t *p, const char *fn, int rank,
                                          uint64_t held);
/* The stripe of a striping over all p's workers that trainer rank `rank`
 * holds (a parent with parts), or `rank`. */
int stria__lgroup_stripe(const stria_session_t *p, int rank);
/* Adds p's rings' traffic, retries and reopenings to *out. */
void stria__lgroup_stats(const stria_session_t *p, stria_session_stats_t *out);
/* How many times a call that failed retryably is tried again. */
int stria__lsess_retries(const stria_client_t *c);

#endif /* STRIA_CLIENT_INT_H */
