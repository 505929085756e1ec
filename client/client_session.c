/* libstria: sessions. A session is a job with JobSpec.session set: the
 * coordinator admits it once for its bounds; each rank's worker is opened
 * once (OpenSession: buffers, pass thread, ring link) on the rank's
 * connection, which the session keeps; a call then sends one SessionCall
 * per rank (its shard of the inputs, real tokens only, as the payload) on
 * those connections, all requests first, then reads the replies (the
 * outputs, as their payload) and gathers them. See stria_client.h. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "client_int.h"
#include "stria_spec.h"

struct stria_session {
    stria_client_t *client;
    stria_session_t *next;
    pthread_mutex_t lock;      /* one call at a time */
    stria_session_spec_t spec; /* the caller's, without its strings and arrays */
    stria_job_t *job;          /* the session's job at the service (NULL: none now) */
    bool sharded;
    bool *opened; /* per rank: OpenSession answered on this handle */
    uint64_t next_call;
    uint64_t epoch; /* the ring links' generation: first call after the last failure */
    pid_t pid;      /* the process that opened it */
    stria_session_stats_t stats;
    /* per rank: the call's payload out and in (grown, kept) */
    void **up, **down;
    size_t *up_cap, *down_cap;
};

#define STRIA__SESSION_EXPORT_MAGIC "STRIASS1"

static stria_status_t stria__sess_reopen(stria_session_t *s, int *retries);
static int stria__sess_ended(stria_session_t *s, char *why, size_t len);

/* ---- opening ---------------------------------------------------------------- */

static stria_status_t stria__sess_read_spec(const stria_session_spec_t *in,
                                            stria_session_spec_t *out)
{
    if (in->struct_size < offsetof(stria_session_spec_t, placement_fallback) + sizeof(bool) ||
        in->struct_size > sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_spec_t: struct_size %zu is not this library's (%zu): "
                               "start from STRIA_SESSION_SPEC_INIT",
                               in->struct_size, sizeof(*out));
    memset(out, 0, sizeof(*out));
    memcpy(out, in, in->struct_size);
    out->struct_size = sizeof(*out);
    if (out->kv_heads == 0)
        out->kv_heads = out->heads;
    if (out->max_batch < 1 || out->max_seq_len < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: max_batch and max_seq_len (the bounds of a call) "
                               "are required (got %lld, %lld)",
                               (long long)out->max_batch, (long long)out->max_seq_len);
    if (!isfinite(out->idle_timeout_s) || out->idle_timeout_s < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: idle_timeout_s must be finite and >= 0 (got %g)",
                               out->idle_timeout_s);
    if (out->sharded && out->ring_size < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: a sharded session needs ring_size: the trainer's "
                               "world size");
    if (out->layout == STRIA_LAYOUT_AUTO) /* a call's window is not known at open */
        out->layout = STRIA_LAYOUT_STRIPED;
    return STRIA_OK;
}

/* The job spec of a session: the bounds as batch and seq_len. */
static stria_job_spec_t stria__sess_job_spec(const stria_session_spec_t *s)
{
    stria_job_spec_t js = STRIA_JOB_SPEC_INIT;
    js.batch = s->max_batch;
    js.seq_len = s->max_seq_len;
    js.heads = s->heads;
    js.kv_heads = s->kv_heads;
    js.head_dim = s->head_dim;
    js.dtype = s->dtype;
    js.causal = true;
    js.layout = s->layout;
    js.ring_size = s->ring_size;
    js.step_timeout_s = s->step_timeout_s;
    js.ttl_s = s->idle_timeout_s;
    js.no_queue = s->no_queue;
    js.label = s->label;
    js.arrival_timeout_s = s->arrival_timeout_s;
    js.placement_hosts = s->placement_hosts;
    js.placement_devices = s->placement_devices;
    js.placement_fallback = s->placement_fallback;
    return js;
}

static stria_status_t stria__sess_rank_ready(stria_session_t *s, int rank)
{
    stria_job_t *job = s->job;
    stria__rank_t *r = &job->ranks[rank];
    r->used = true;
    if (r->conn != NULL)
        return STRIA_OK;
    stria_rpc_client_params_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.address = r->rpc_address;
    rp.service = &stria__v1__worker__descriptor;
    rp.token = job->client->token;
    rp.client_name = job->client->client_name;
    rp.connect_timeout_s = job->client->params.connect_timeout_s;
    stria_status_t st = stria_rpc_client_connect(&rp, &r->conn);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "session %llu rank %d: worker %s", (unsigned long long)job->id,
                                rank, r->rpc_address);
    return STRIA_OK;
}

/* Per-rank outcome of a call or an open. */
typedef struct {
    stria_status_t st;
    bool lost, retryable;
    char error[768];
} stria__sess_out_t;

static void stria__sess_fail(stria__sess_out_t *o, const stria__rank_t *r, stria_status_t st)
{
    o->st = st;
    /* lost, or it says it leaves (a worker being drained closes the
     * session at a call boundary): a call on the session opened anew
     * without it may succeed */
    o->lost = stria__rank_lost(r, st) || st == STRIA_ERR_CLOSED;
    o->retryable = o->lost || stria_error_retryable();
    snprintf(o->error, sizeof(o->error), "%s", stria_error_msg());
}

/* The call's verdict over its ranks: the first failure that is not a
 * neighbour's echo (STRIA_ERR_PEER) names the cause; the call is retryable
 * when that is. Returns STRIA_OK when every rank succeeded. */
static stria_status_t stria__sess_verdict(stria_session_t *s, const stria__sess_out_t *o,
                                          const int *ranks, int n, const char *what,
                                          bool *retryable_out, bool *expired_out)
{
    int pick = -1;
    bool expired = false;
    for (int i = 0; i < n; i++) {
        if (o[i].st == STRIA_OK)
            continue;
        expired = expired || o[i].st == STRIA_ERR_NOT_FOUND;
        if (pick < 0 || (o[pick].st == STRIA_ERR_PEER && o[i].st != STRIA_ERR_PEER))
            pick = i;
    }
    *expired_out = expired;
    if (pick < 0)
        return STRIA_OK;
    bool retryable = false;
    for (int i = 0; i < n; i++)
        if (o[i].st != STRIA_OK && o[i].lost) {
            retryable = true;
            if (s->job->n_blamed < STRIA__MAX_BLAMED) /* not on the next open */
                s->job->blamed[s->job->n_blamed++] = s->job->ranks[ranks[i]].worker_id;
        }
    retryable = retryable || (o[pick].retryable && o[pick].st != STRIA_ERR_INVALID_ARG);
    *retryable_out = retryable;
    stria_error_set(o[pick].st, "session %llu %s: %s", (unsigned long long)s->job->id, what,
                    o[pick].error);
    stria_error_set_retryable(retryable);
    return o[pick].st;
}

/* A rank's arena at the session's bounds: its inputs (Q, K, V, O, LSE, dO)
 * then its outputs (the larger of O + LSE and dQ + dK + dV), as the worker
 * bounds it. */
static size_t stria__sess_arena_bytes(const stria_session_t *s, size_t *in_cap_out)
{
    stria_layout_t lay;
    const stria_job_t *job = s->job;
    if (stria_layout_init(job->spec.layout, job->n_ranks, job->spec.seq_len, &lay) != STRIA_OK)
        return 0;
    size_t es = stria_dtype_size(job->spec.dtype);
    size_t qrow = (size_t)(job->spec.heads * job->spec.head_dim) * es;
    size_t kvrow = (size_t)(job->spec.kv_heads * job->spec.head_dim) * es;
    size_t lrow = (size_t)job->spec.heads * 4u;
    size_t rows = (size_t)job->spec.batch * (size_t)lay.shard_tokens;
    size_t fo = qrow + lrow, bo = qrow + 2 * kvrow;
    *in_cap_out = rows * (3 * qrow + 2 * kvrow + lrow);
    return *in_cap_out + rows * (fo > bo ? fo : bo);
}

/* After a rank opened: its arena with a worker of this host, as the
 * client's data path says (auto: when the worker offers a socket and takes
 * the arena, else TCP, the reason kept; shm: or the rank fails). */
static stria_status_t stria__sess_rank_path(stria_session_t *s, stria__rank_t *r)
{
    stria_data_path_t path = s->client->params.data_path;
    if (r->shm_tried)
        return STRIA_OK;
    r->shm_tried = true;
    if (path == STRIA_DATA_PATH_TCP) {
        snprintf(r->shm_why, sizeof(r->shm_why), "the client's path is tcp");
        return STRIA_OK;
    }
    size_t in_cap = 0, bytes = stria__sess_arena_bytes(s, &in_cap);
    stria_status_t st = STRIA_ERR_UNSUPPORTED;
    if (r->shm_socket[0] == '\0')
        stria_error_set(st, "its worker %s has no shared-memory socket (no runtime directory)",
                        r->rpc_address);
    else
        st = stria__shm_arena(s->job, r, bytes);
    if (st == STRIA_OK)
        return STRIA_OK;
    snprintf(r->shm_why, sizeof(r->shm_why), "%s", stria_error_msg());
    if (path == STRIA_DATA_PATH_SHM)
        return stria_error_set(st, "rank %d: no arena with its worker (path shm): %s", r->rank,
                               r->shm_why);
    return STRIA_OK;
}

/* OpenSession on the given ranks: every request first (their workers
 * connect their links to each other), then the replies. */
static stria_status_t stria__sess_open_ranks(stria_session_t *s, const int *ranks, int n)
{
    stria_job_t *job = s->job;
    Stria__V1__OpenSessionRequest *req = calloc((size_t)n, sizeof(*req));
    stria_rpc_request_t *rq = calloc((size_t)n, sizeof(*rq));
    stria_rpc_pending_t *pend = calloc((size_t)n, sizeof(*pend));
    stria__sess_out_t *o = calloc((size_t)n, sizeof(*o));
    bool *sent = calloc((size_t)n, sizeof(*sent));
    stria_status_t st = STRIA_OK;
    if (req == NULL || rq == NULL || pend == NULL || o == NULL || sent == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
        goto out;
    }
    double timeout =
        job->client->params.connect_timeout_s > 0 ? job->client->params.connect_timeout_s : 10.0;
    for (int i = 0; i < n; i++) {
        stria__rank_t *r = &job->ranks[ranks[i]];
        stria__v1__open_session_request__init(&req[i]);
        req[i].job_id = job->id;
        req[i].rank = (uint32_t)ranks[i];
        rq[i].method = STRIA_RPC_WORKER_OPEN_SESSION;
        rq[i].request = &req[i].base;
        /* the workers fetch the assignment and connect the ring: their
         * connect timeout (30 s by default) and some */
        rq[i].timeout_s = timeout + 60.0;
        rq[i].job_secret = &job->secret;
        rq[i].job_id = job->id;
        if ((o[i].st = stria__sess_rank_ready(s, ranks[i])) == STRIA_OK &&
            (o[i].st = stria_rpc_client_send(r->conn, &rq[i], &pend[i])) == STRIA_OK)
            sent[i] = true;
        if (o[i].st != STRIA_OK)
            stria__sess_fail(&o[i], r, o[i].st);
    }
    for (int i = 0; i < n; i++) {
        stria_rpc_reply_t reply;
        if (!sent[i])
            continue;
        stria__rank_t *r = &job->ranks[ranks[i]];
        if ((o[i].st = stria_rpc_client_recv(r->conn, &rq[i], &pend[i], &reply)) != STRIA_OK) {
            stria__sess_fail(&o[i], r, o[i].st);
            continue;
        }
        stria_rpc_reply_free(&reply);
        s->opened[ranks[i]] = true;
        if ((o[i].st = stria__sess_rank_path(s, r)) != STRIA_OK)
            stria__sess_fail(&o[i], r, o[i].st);
    }
    bool retryable, expired;
    st = stria__sess_verdict(s, o, ranks, n, "open", &retryable, &expired);
out:
    free(req);
    free(rq);
    free(pend);
    free(o);
    free(sent);
    return st;
}

/* Submits the session's job (waiting in the queue unless no_queue) and, for
 * a whole-sequence session, opens every rank. */
static stria_status_t stria__sess_submit(stria_session_t *s, const stria_session_spec_t *spec)
{
    stria_job_t *job = calloc(1, sizeof(*job));
    if (job == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    job->client = s->client;
    job->session = true;
    job->spec = stria__sess_job_spec(spec);
    if (s->job != NULL) { /* reopening: not on the workers the last one was blamed on */
        job->exclude = s->job->blamed;
        job->n_exclude = s->job->n_blamed;
    }
    stria_status_t st = stria__submit(s->client, job, s->sharded, NULL, NULL);
    job->exclude = NULL;
    job->n_exclude = 0;
    job->spec.label = NULL;
    job->spec.placement_hosts = NULL;
    job->spec.placement_devices = NULL;
    if (st != STRIA_OK && job->id == 0) {
        stria__job_free(job);
        return st;
    }
    stria__job_link(job);
    if (st != STRIA_OK) {
        char msg[1024];
        bool retryable = stria_error_retryable();
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria_client_release(job);
        stria_error_set(st, "%s", msg);
        stria_error_set_retryable(retryable);
        return st;
    }
    free(s->opened);
    s->opened = calloc((size_t)job->n_ranks, sizeof(bool));
    void **up = calloc((size_t)job->n_ranks, sizeof(void *));
    void **down = calloc((size_t)job->n_ranks, sizeof(void *));
    size_t *upc = calloc((size_t)job->n_ranks, sizeof(size_t));
    size_t *downc = calloc((size_t)job->n_ranks, sizeof(size_t));
    if (s->opened == NULL || up == NULL || down == NULL || upc == NULL || downc == NULL) {
        free(up);
        free(down);
        free(upc);
        free(downc);
        stria_client_release(job);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    }
    if (s->job != NULL) { /* the old job's buffers go */
        for (int i = 0; i < s->job->n_ranks; i++) {
            stria_free(s->up[i]);
            stria_free(s->down[i]);
        }
        stria_client_release(s->job);
    }
    free(s->up);
    free(s->down);
    free(s->up_cap);
    free(s->down_cap);
    s->up = up;
    s->down = down;
    s->up_cap = upc;
    s->down_cap = downc;
    s->job = job;
    s->epoch = 0; /* the workers' links of a new job are of epoch 0 */
    s->stats.generation++;
    if (s->sharded) /* each trainer rank opens its own at its first call */
        return STRIA_OK;
    int *ranks = malloc((size_t)job->n_ranks * sizeof(int));
    if (ranks == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    for (int i = 0; i < job->n_ranks; i++)
        ranks[i] = i;
    st = stria__sess_open_ranks(s, ranks, job->n_ranks);
    free(ranks);
    return st;
}

static void stria__sess_link(stria_session_t *s)
{
    s->next = s->client->sessions;
    s->client->sessions = s;
}

static void stria__sess_unlink(stria_session_t *s)
{
    stria_session_t **pp = &s->client->sessions;
    while (*pp != NULL && *pp != s)
        pp = &(*pp)->next;
    if (*pp == s)
        *pp = s->next;
}

static void stria__sess_free(stria_session_t *s)
{
    for (int i = 0; s->job != NULL && i < s->job->n_ranks; i++) {
        stria_free(s->up[i]);
        stria_free(s->down[i]);
    }
    free(s->up);
    free(s->down);
    free(s->up_cap);
    free(s->down_cap);
    free(s->opened);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

static stria_session_t *stria__sess_new(stria_client_t *client)
{
    stria_session_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->client = client;
    s->pid = getpid();
    s->stats.struct_size = sizeof(s->stats);
    pthread_mutex_init(&s->lock, NULL);
    return s;
}

stria_status_t stria_session_open(stria_client_t *client, const stria_session_spec_t *spec,
                                  stria_session_t **session_out)
{
    stria_session_spec_t sp;
    stria_status_t st;
    if (client == NULL || spec == NULL || session_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_open: NULL argument");
    if ((st = stria__sess_read_spec(spec, &sp)) != STRIA_OK)
        return st;
    stria_session_t *s = stria__sess_new(client);
    if (s == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_session_open: out of memory");
    s->sharded = sp.sharded;
    s->spec = sp; /* its strings and arrays are read during the open only */
    int retries = stria__retries(client);
    st = stria__sess_submit(s, &sp);
    if (st != STRIA_OK && stria_error_retryable() && retries > 0 && s->job != NULL)
        st = stria__sess_reopen(s, &retries); /* a worker lost while it opened */
    if (st != STRIA_OK) {
        char msg[1024];
        bool retryable = stria_error_retryable();
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        if (s->job != NULL)
            stria_client_release(s->job);
        s->job = NULL;
        stria__sess_free(s);
        stria_error_set(st, "stria_session_open: %s", msg);
        stria_error_set_retryable(retryable);
        return st;
    }
    s->spec.label = NULL;
    s->spec.placement_hosts = NULL;
    s->spec.placement_devices = NULL;
    stria__sess_link(s);
    *session_out = s;
    return STRIA_OK;
}

stria_status_t stria_session_export(const stria_session_t *s, void *out, size_t cap,
                                    size_t *len_out)
{
    uint8_t *b = out;
    if (s == NULL || out == NULL || len_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_export: NULL argument");
    if (!s->sharded || s->job == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_export: only a sharded session can be shared");
    if (cap < STRIA_SESSION_EXPORT_BYTES)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_export: %zu bytes of room, %d needed", cap,
                               STRIA_SESSION_EXPORT_BYTES);
    memcpy(b, STRIA__SESSION_EXPORT_MAGIC, 8);
    stria_put_le64(b + 8, s->job->id);
    memcpy(b + 16, s->job->secret.bytes, sizeof(s->job->secret.bytes));
    *len_out = STRIA_SESSION_EXPORT_BYTES;
    return STRIA_OK;
}

stria_status_t stria_session_import(stria_client_t *client, const void *bytes, size_t len,
                                    stria_session_t **session_out)
{
    uint8_t job_bytes[STRIA_JOB_EXPORT_BYTES];
    stria_job_t *job = NULL;
    if (client == NULL || bytes == NULL || session_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_import: NULL argument");
    if (len != STRIA_SESSION_EXPORT_BYTES || memcmp(bytes, STRIA__SESSION_EXPORT_MAGIC, 8) != 0)
        return stria_error_set(STRIA_ERR_FORMAT,
                               "stria_session_import: %zu bytes that are no session export (one "
                               "is %d bytes from stria_session_export)",
                               len, STRIA_SESSION_EXPORT_BYTES);
    /* the job's export, whose import checks the secret at the coordinator */
    memcpy(job_bytes, bytes, sizeof(job_bytes));
    memcpy(job_bytes, "STRIAJB2", 8);
    stria_status_t st = stria_job_import(client, job_bytes, sizeof(job_bytes), &job);
    stria_auth_wipe(job_bytes, sizeof(job_bytes));
    if (st != STRIA_OK)
        return stria_error_wrap(st, "stria_session_import");
    if (!job->session) {
        stria_client_release(job);
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_import: job %llu is not a session",
                               (unsigned long long)stria_get_le64((const uint8_t *)bytes + 8));
    }
    stria_session_t *s = stria__sess_new(client);
    int n = job->n_ranks;
    if (s != NULL) {
        s->opened = calloc((size_t)n, sizeof(bool));
        s->up = calloc((size_t)n, sizeof(void *));
        s->down = calloc((size_t)n, sizeof(void *));
        s->up_cap = calloc((size_t)n, sizeof(size_t));
        s->down_cap = calloc((size_t)n, sizeof(size_t));
    }
    if (s == NULL || s->opened == NULL || s->up == NULL || s->down == NULL || s->up_cap == NULL ||
        s->down_cap == NULL) {
        stria_client_release(job);
        if (s != NULL)
            stria__sess_free(s);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_session_import: out of memory");
    }
    s->job = job;
    s->sharded = true;
    s->stats.generation = 1;
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    sp.max_batch = job->spec.batch;
    sp.max_seq_len = job->spec.seq_len;
    sp.heads = job->spec.heads;
    sp.kv_heads = job->spec.kv_heads;
    sp.head_dim = job->spec.head_dim;
    sp.dtype = job->spec.dtype;
    sp.layout = job->spec.layout;
    sp.ring_size = job->n_ranks;
    sp.sharded = true;
    sp.idle_timeout_s = job->spec.ttl_s;
    sp.step_timeout_s = job->spec.step_timeout_s;
    sp.arrival_timeout_s = job->spec.arrival_timeout_s;
    s->spec = sp;
    stria__sess_link(s);
    *session_out = s;
    return STRIA_OK;
}

/* ---- calls -------------------------------------------------------------------- */

/* A call's shape from the caller's record (ABI: struct_size). */
static stria_status_t stria__call_read(const stria_call_t *in, stria_call_shape_t *out)
{
    if (in == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "call record is NULL");
    if (in->struct_size < offsetof(stria_call_t, window_right) + sizeof(int64_t) ||
        in->struct_size > sizeof(stria_call_t))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_call_t: struct_size %zu is not this library's (%zu): start "
                               "from STRIA_CALL_INIT",
                               in->struct_size, sizeof(stria_call_t));
    *out = (stria_call_shape_t){.batch = in->batch,
                                .seq_len = in->seq_len,
                                .causal = in->causal,
                                .scale = in->scale,
                                .cu_seqlens = in->cu_seqlens,
                                .n_cu_seqlens = in->n_cu_seqlens,
                                .has_window = in->has_window,
                                .window_left = in->window_left,
                                .window_right = in->window_right};
    return STRIA_OK;
}

/* Rows of one tensor of a call on a rank: outer index count and bytes per
 * token (LSE: batch * heads rows of 4 bytes). */
typedef struct {
    const void *full; /* whole-sequence: the caller's full tensor; sharded: the rank's */
    void *full_out;
    int64_t outer;
    size_t row;
} stria__sess_tensor_t;

/* The call's tensors in payload order: inputs (3 forward, 6 backward) and
 * outputs (2 forward, 3 backward). */
typedef struct {
    stria__sess_tensor_t in[6], out[3];
    int n_in, n_out;
} stria__sess_io_t;

static void stria__sess_io(const stria_session_t *s, const stria_call_shape_t *c, bool backward,
                           const void *const in[6], void *const out[3], stria__sess_io_t *io)
{
    size_t es = stria_dtype_size(s->spec.dtype);
    size_t qrow = (size_t)(s->spec.heads * s->spec.head_dim) * es;
    size_t kvrow = (size_t)(s->spec.kv_heads * s->spec.head_dim) * es;
    const size_t rows_in[6] = {qrow, kvrow, kvrow, qrow, 4, qrow};
    memset(io, 0, sizeof(*io));
    io->n_in = backward ? 6 : 3;
    for (int i = 0; i < io->n_in; i++)
        io->in[i] = (stria__sess_tensor_t){.full = in[i],
                                           .outer = i == 4 ? c->batch * s->spec.heads : c->batch,
                                           .row = rows_in[i]};
    io->n_out = backward ? 3 : 2;
    const size_t rows_fwd[2] = {qrow, 4}, rows_bwd[3] = {qrow, kvrow, kvrow};
    for (int i = 0; i < io->n_out; i++)
        io->out[i] = (stria__sess_tensor_t){.full_out = out[i],
                                            .outer = !backward && i == 1 ? c->batch * s->spec.heads
                                                                         : c->batch,
                                            .row = backward ? rows_bwd[i] : rows_fwd[i]};
}

/* Moves a rank's real tokens between a full [outer][seq][row] tensor and
 * its compact [outer][valid][row] shard. */
static void stria__sess_move(const stria_layout_t *lay, int rank, const stria__sess_tensor_t *t,
                             char *compact, void *full, bool to_full)
{
    stria_layout_run_t runs[STRIA_LAYOUT_MAX_RUNS];
    size_t nr = stria_layout_shard_runs(lay, rank, false, runs);
    int64_t valid = stria_layout_shard_valid(lay, rank);
    for (int64_t o = 0; o < t->outer; o++) {
        char *f = (char *)full + (size_t)(o * lay->seq_len) * t->row;
        char *c = compact + (size_t)(o * valid) * t->row;
        for (size_t k = 0; k < nr; k++) {
            if (runs[k].stride == 1) {
                size_t n = (size_t)runs[k].count * t->row;
                if (to_full)
                    memcpy(f + (size_t)runs[k].first * t->row, c, n);
                else
                    memcpy(c, f + (size_t)runs[k].first * t->row, n);
                c += n;
                continue;
            }
            for (int64_t i = 0; i < runs[k].count; i++, c += t->row) {
                char *p = f + (size_t)(runs[k].first + i * runs[k].stride) * t->row;
                if (to_full)
                    memcpy(p, c, t->row);
                else
                    memcpy(c, p, t->row);
            }
        }
    }
}

static stria_status_t stria__sess_grow(void **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return STRIA_OK;
    void *p = stria_malloc_aligned(need);
    if (p == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory for %zu bytes", need);
    stria_free(*buf);
    *buf = p;
    *cap = need;
    return STRIA_OK;
}

/* One try of a call on `ranks` (all of them for a whole-sequence session;
 * the caller's rank for a sharded one, whose tensors are then its own). */
static stria_status_t stria__sess_try(stria_session_t *s, const stria_call_shape_t *c,
                                      bool backward, const int *ranks, int n,
                                      const stria__sess_io_t *io, bool *retryable_out,
                                      bool *expired_out)
{
    stria_job_t *job = s->job;
    stria_layout_t lay;
    stria_status_t st = stria_layout_init(job->spec.layout, job->n_ranks, c->seq_len, &lay);
    if (st != STRIA_OK)
        return st;
    Stria__V1__SessionCallRequest req[n > 0 ? n : 1];
    Stria__V1__CallShape shape;
    Stria__V1__JobSpec__Window win;
    stria_rpc_request_t rq[n > 0 ? n : 1];
    stria_rpc_pending_t pend[n > 0 ? n : 1];
    stria__sess_out_t o[n > 0 ? n : 1];
    bool sent[n > 0 ? n : 1];
    size_t out_off[n > 0 ? n : 1], arena_in_cap = 0;
    uint8_t bound[n > 0 ? n : 1][STRIA_CALL_BINDING_BYTES];
    stria__sess_arena_bytes(s, &arena_in_cap);
    uint64_t call = s->next_call++;
    uint64_t digest = stria_call_shape_digest(c, call, backward);
    double t0 = stria_time_now(), pass_max = 0;
    uint64_t minflt = 0, up_bytes = 0, down_bytes = 0;
    stria_call_shape_to_pb(c, &shape, &win);
    memset(o, 0, sizeof(o));
    for (int i = 0; i < n; i++) {
        int rank = ranks[i];
        stria__rank_t *r = &job->ranks[rank];
        int64_t valid = stria_layout_shard_valid(&lay, rank);
        size_t in_bytes = 0, out_bytes = 0;
        sent[i] = false;
        if (!s->opened[rank]) { /* sharded: this rank's first call */
            o[i].st = stria__sess_open_ranks(s, &rank, 1);
            if (o[i].st != STRIA_OK) {
                stria__sess_fail(&o[i], r, o[i].st);
                continue;
            }
        }
        for (int t = 0; t < io->n_in; t++)
            in_bytes += (size_t)(io->in[t].outer * valid) * io->in[t].row;
        for (int t = 0; t < io->n_out; t++)
            out_bytes += (size_t)(io->out[t].outer * valid) * io->out[t].row;
        /* with an arena: inputs at 0, a forward's outputs where a backward
         * reads O and LSE, a backward's after the inputs' room */
        bool arena = r->shm.base != NULL;
        out_off[i] = backward ? arena_in_cap : in_bytes;
        if (!arena &&
            ((o[i].st = stria__sess_grow(&s->up[rank], &s->up_cap[rank], in_bytes)) != STRIA_OK ||
             (o[i].st = stria__sess_grow(&s->down[rank], &s->down_cap[rank], out_bytes)) !=
                 STRIA_OK)) {
            stria__sess_fail(&o[i], r, o[i].st);
            continue;
        }
        char *p = arena ? (char *)r->shm.base : (char *)s->up[rank];
        for (int t = 0; t < io->n_in; t++) {
            size_t bytes = (size_t)(io->in[t].outer * valid) * io->in[t].row;
            if (s->sharded && io->in[t].full != p) /* else built in the arena: not moved */
                memcpy(p, io->in[t].full, bytes);
            else if (!s->sharded)
                stria__sess_move(&lay, rank, &io->in[t], p, (void *)io->in[t].full, false);
            p += bytes;
        }
        stria__v1__session_call_request__init(&req[i]);
        req[i].job_id = job->id;
        req[i].rank = (uint32_t)rank;
        req[i].call = call;
        req[i].link_epoch = s->epoch;
        req[i].backward = backward;
        req[i].shape = &shape;
        req[i].digest = digest;
        memset(&rq[i], 0, sizeof(rq[i]));
        rq[i].method = STRIA_RPC_WORKER_SESSION_CALL;
        rq[i].request = &req[i].base;
        stria_call_binding(c, call, s->epoch, backward, arena, 0, arena ? out_off[i] : 0, bound[i]);
        rq[i].proof_extra = bound[i];
        rq[i].proof_extra_len = STRIA_CALL_BINDING_BYTES;
        if (arena) {
            req[i].arena = true;
            req[i].arena_in = 0;
            req[i].arena_out = out_off[i];
        } else {
            rq[i].payload = s->up[rank];
            rq[i].payload_len = in_bytes;
            rq[i].reply_buf = s->down[rank];
            rq[i].reply_buf_cap = out_bytes;
        }
        rq[i].timeout_s = job->pass_timeout_s + (s->sharded ? s->spec.arrival_timeout_s + 60 : 0);
        rq[i].job_secret = &job->secret;
        rq[i].job_id = job->id;
        if ((o[i].st = stria__sess_rank_ready(s, rank)) == STRIA_OK &&
            (o[i].st = stria_rpc_client_send(r->conn, &rq[i], &pend[i])) == STRIA_OK) {
            sent[i] = true;
            up_bytes += arena ? 0 : in_bytes;
        }
        if (o[i].st != STRIA_OK)
            stria__sess_fail(&o[i], r, o[i].st);
    }
    for (int i = 0; i < n; i++) {
        stria_rpc_reply_t reply;
        int rank = ranks[i];
        stria__rank_t *r = &job->ranks[rank];
        if (!sent[i])
            continue;
        if ((o[i].st = stria_rpc_client_recv(r->conn, &rq[i], &pend[i], &reply)) != STRIA_OK) {
            stria__sess_fail(&o[i], r, o[i].st);
            continue;
        }
        const Stria__V1__SessionCallReply *rep = (const Stria__V1__SessionCallReply *)reply.msg;
        if (reply.payload_len != rq[i].reply_buf_cap) {
            o[i].st = stria_error_set(STRIA_ERR_PROTOCOL,
                                      "rank %d: the reply carries %llu bytes of outputs, not %llu",
                                      rank, (unsigned long long)reply.payload_len,
                                      (unsigned long long)rq[i].reply_buf_cap);
            stria__sess_fail(&o[i], r, o[i].st);
            stria_rpc_reply_free(&reply);
            continue;
        }
        if (rep->stats != NULL && rep->stats->seconds > pass_max)
            pass_max = rep->stats->seconds;
        minflt += rep->worker_minflt;
        down_bytes += reply.payload_len; /* 0 with an arena */
        stria_rpc_reply_free(&reply);
        int64_t valid = stria_layout_shard_valid(&lay, rank);
        char *p = r->shm.base != NULL ? (char *)r->shm.base + out_off[i] : s->down[rank];
        for (int t = 0; t < io->n_out; t++) {
            size_t bytes = (size_t)(io->out[t].outer * valid) * io->out[t].row;
            if (s->sharded && io->out[t].full_out != p) /* else read in the arena */
                memcpy(io->out[t].full_out, p, bytes);
            else if (!s->sharded)
                stria__sess_move(&lay, rank, &io->out[t], p, io->out[t].full_out, true);
            p += bytes;
        }
    }
    st = stria__sess_verdict(s, o, ranks, n, backward ? "backward call" : "forward call",
                             retryable_out, expired_out);
    s->stats.bytes_up += up_bytes;
    s->stats.bytes_down += down_bytes;
    if (st != STRIA_OK) { /* the next call connects new links */
        s->epoch = s->next_call;
        return st;
    }
    s->stats.last_call_s = stria_time_now() - t0;
    s->stats.last_pass_s = pass_max;
    s->stats.last_minflt = minflt;
    return STRIA_OK;
}

/* What the coordinator says of a session whose workers no longer hold it
 * or dropped it: over for good (cancelled, or failed for a cause that is
 * its own: why says so), expired (idle past its deadline, or unknown: a
 * restarted coordinator that could not rebuild it), lost (failed for a
 * cause outside it: a worker died or left), or still on. */
enum { STRIA__ENDED_ON, STRIA__ENDED_FINAL, STRIA__ENDED_EXPIRED, STRIA__ENDED_LOST };

static int stria__sess_ended(stria_session_t *s, char *why, size_t len)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.job_id = s->job->id;
    memset(&reply, 0, sizeof(reply));
    stria_status_t st = stria__coord_call_ex(s->client, STRIA_RPC_COORDINATOR_GET_JOB, &req.base,
                                             s->job, &reply, false);
    if (st == STRIA_ERR_NOT_FOUND)
        return STRIA__ENDED_EXPIRED;
    if (st != STRIA_OK)
        return STRIA__ENDED_ON;
    const Stria__V1__JobInfo *info = ((Stria__V1__GetJobReply *)reply.msg)->job;
    int v = STRIA__ENDED_ON;
    if (info != NULL) {
        snprintf(why, len, "session %llu %s: %s", (unsigned long long)s->job->id,
                 info->state == STRIA__V1__JOB_STATE__JOB_STATE_CANCELLED ? "was cancelled"
                                                                          : "ended",
                 info->failure && info->failure[0] ? info->failure : "no reason given");
        switch (info->state) {
        case STRIA__V1__JOB_STATE__JOB_STATE_EXPIRED:
        case STRIA__V1__JOB_STATE__JOB_STATE_RELEASED:
            v = STRIA__ENDED_EXPIRED;
            break;
        case STRIA__V1__JOB_STATE__JOB_STATE_CANCELLED:
            v = STRIA__ENDED_FINAL;
            break;
        case STRIA__V1__JOB_STATE__JOB_STATE_FAILED:
            v = info->failure_retryable ? STRIA__ENDED_LOST : STRIA__ENDED_FINAL;
            break;
        default:
            break;
        }
    }
    stria_rpc_reply_free(&reply);
    return v;
}

/* Opens the session anew (without the workers the last try blamed): tried
 * again while it fails retryably and the call has retries left. */
static stria_status_t stria__sess_reopen(stria_session_t *s, int *retries)
{
    for (;;) {
        stria_status_t st = stria__sess_submit(s, &s->spec);
        s->stats.reopened++;
        bool retryable = stria_error_retryable();
        if ((st == STRIA_ERR_CANCELLED || st == STRIA_ERR_NOT_FOUND) && s->job != NULL) {
            /* a worker refused to open it: the coordinator ended it as it
             * opened (a member lost), or cancelled it */
            char msg[1024], why[600];
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
            int v = stria__sess_ended(s, why, sizeof(why));
            retryable = v == STRIA__ENDED_LOST || v == STRIA__ENDED_EXPIRED;
            stria_error_set(st, "%s", msg);
        }
        if (st == STRIA_OK || !retryable || *retries <= 0)
            return st;
        (*retries)--;
        s->stats.retries++;
    }
}

/* A call: checked, then tried; a whole-sequence session's call that failed
 * retryably (or found the session expired) is tried again on the session
 * opened anew. */
static stria_status_t stria__sess_call(stria_session_t *s, const stria_call_t *call, int rank,
                                       bool backward, const void *const in[6], void *const out[3])
{
    const char *fn = backward ? "stria_session_backward" : "stria_session_forward";
    stria_call_shape_t c;
    stria_status_t st;
    if (s == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: NULL session", fn);
    for (int i = 0; i < (backward ? 6 : 3); i++)
        if (in[i] == NULL)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: input %d is NULL", fn, i);
    for (int i = 0; i < (backward ? 3 : 2); i++)
        if (out[i] == NULL)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: output %d is NULL", fn, i);
    if ((st = stria__call_read(call, &c)) != STRIA_OK)
        return st;
    pthread_mutex_lock(&s->lock);
    if (getpid() != s->pid) {
        pthread_mutex_unlock(&s->lock);
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: the session was opened by process %d; this is process %d (a "
                               "forked child): open a session of its own there",
                               fn, (int)s->pid, (int)getpid());
    }
    if (s->job == NULL && !s->sharded)
        st = stria__sess_submit(s, &s->spec);
    else if (s->job == NULL)
        st = stria_error_set(STRIA_ERR_CANCELLED, "%s: the sharded session is closed", fn);
    int n_ranks = s->job != NULL ? s->job->n_ranks : 0;
    if (st == STRIA_OK && s->sharded && (rank < 0 || rank >= n_ranks))
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "%s: rank %d is not a rank of the session (0..%d)", fn, rank,
                             n_ranks - 1);
    if (st == STRIA_OK && !s->sharded && rank >= 0)
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "%s: the session is whole-sequence: call it without a rank", fn);
    const stria_call_bounds_t b = {.max_batch = s->spec.max_batch,
                                   .max_seq_len = s->spec.max_seq_len,
                                   .n_ranks = n_ranks,
                                   .layout = (int)s->spec.layout};
    if (st == STRIA_OK && (st = stria_call_shape_check(&c, &b)) != STRIA_OK)
        stria_error_wrap(st, "%s", fn);
    if (st != STRIA_OK) {
        s->stats.failed++;
        pthread_mutex_unlock(&s->lock);
        return st;
    }
    stria__sess_io_t io;
    stria__sess_io(s, &c, backward, in, out, &io);
    int retries = stria__retries(s->client), reopen = 1;
    for (;;) {
        int *ranks = malloc((size_t)s->job->n_ranks * sizeof(int));
        if (ranks == NULL) {
            st = stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
            break;
        }
        int n = 0;
        if (s->sharded)
            ranks[n++] = rank;
        else
            for (int i = 0; i < s->job->n_ranks; i++)
                ranks[n++] = i;
        bool retryable = false, expired = false;
        st = stria__sess_try(s, &c, backward, ranks, n, &io, &retryable, &expired);
        free(ranks);
        if (st == STRIA_OK || s->sharded)
            break;
        /* workers that no longer hold the session, or dropped it: what the
         * coordinator says decides (expired or lost: open it again;
         * cancelled: the call fails with its reason) */
        if (expired || st == STRIA_ERR_CANCELLED) {
            char why[600];
            int v = stria__sess_ended(s, why, sizeof(why));
            if (v == STRIA__ENDED_FINAL) {
                st = stria_error_set(STRIA_ERR_CANCELLED, "%s: %s", fn, why);
                break;
            }
            expired = v == STRIA__ENDED_EXPIRED;
            retryable = retryable || v == STRIA__ENDED_LOST;
        }
        /* an expired session is opened again once; a retryable failure as
         * often as the client's retries allow */
        if (expired && reopen > 0)
            reopen--;
        else if (retryable && retries > 0)
            retries--, s->stats.retries++;
        else
            break;
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria_log_info("session %llu: %s; opening it again", (unsigned long long)s->job->id, msg);
        if ((st = stria__sess_reopen(s, &retries)) != STRIA_OK) {
            stria_error_wrap(st, "%s: opening the session again after \"%s\"", fn, msg);
            break;
        }
    }
    if (st == STRIA_OK)
        s->stats.calls++;
    else
        s->stats.failed++;
    pthread_mutex_unlock(&s->lock);
    return st;
}

stria_status_t stria_session_forward(stria_session_t *session, const stria_call_t *call,
                                     const void *q, const void *k, const void *v, void *o,
                                     float *lse)
{
    const void *in[6] = {q, k, v};
    void *out[3] = {o, lse};
    return stria__sess_call(session, call, -1, false, in, out);
}

stria_status_t stria_session_backward(stria_session_t *session, const stria_call_t *call,
                                      const void *q, const void *k, const void *v, const void *o,
                                      const float *lse, const void *d_o, void *dq, void *dk,
                                      void *dv)
{
    const void *in[6] = {q, k, v, o, lse, d_o};
    void *out[3] = {dq, dk, dv};
    return stria__sess_call(session, call, -1, true, in, out);
}

stria_status_t stria_session_forward_shard(stria_session_t *session, const stria_call_t *call,
                                           int rank, const void *q, const void *k, const void *v,
                                           void *o, float *lse)
{
    const void *in[6] = {q, k, v};
    void *out[3] = {o, lse};
    if (session != NULL && !session->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_forward_shard: the session is not sharded");
    return stria__sess_call(session, call, rank < 0 ? INT32_MAX : rank, false, in, out);
}

stria_status_t stria_session_backward_shard(stria_session_t *session, const stria_call_t *call,
                                            int rank, const void *q, const void *k, const void *v,
                                            const void *o, const float *lse, const void *d_o,
                                            void *dq, void *dk, void *dv)
{
    const void *in[6] = {q, k, v, o, lse, d_o};
    void *out[3] = {dq, dk, dv};
    if (session != NULL && !session->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_backward_shard: the session is not sharded");
    return stria__sess_call(session, call, rank < 0 ? INT32_MAX : rank, true, in, out);
}

/* ---- arena buffers -------------------------------------------------------------- */

stria_status_t stria_session_buffer(stria_session_t *s, const stria_call_t *call, int rank,
                                    stria_tensor_id_t tensor, stria_shard_buffer_t *out)
{
    static const char fn[] = "stria_session_buffer";
    stria_call_shape_t c;
    stria_layout_t lay;
    stria_status_t st;
    if (s == NULL || out == NULL || out->struct_size < sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: NULL argument (or a stria_shard_buffer_t without its "
                               "struct_size: STRIA_SHARD_BUFFER_INIT)",
                               fn);
    if ((st = stria__call_read(call, &c)) != STRIA_OK)
        return st;
    if (tensor < STRIA_TENSOR_Q || tensor > STRIA_TENSOR_DV)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: tensor %d is none of the 9", fn,
                               (int)tensor);
    pthread_mutex_lock(&s->lock);
    if (!s->sharded || s->job == NULL)
        st = stria_error_set(STRIA_ERR_UNSUPPORTED,
                             "%s: only a sharded session's ranks take their tensors as they are "
                             "(a whole-sequence call's tensors are the full ones)",
                             fn);
    else if (rank < 0 || rank >= s->job->n_ranks)
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "%s: rank %d is not a rank of the session", fn,
                             rank);
    const stria_call_bounds_t b = {.max_batch = s->spec.max_batch,
                                   .max_seq_len = s->spec.max_seq_len,
                                   .n_ranks = s->job != NULL ? s->job->n_ranks : 0,
                                   .layout = (int)s->spec.layout};
    if (st == STRIA_OK && (st = stria_call_shape_check(&c, &b)) != STRIA_OK)
        stria_error_wrap(st, "%s", fn);
    if (st == STRIA_OK && !s->opened[rank]) /* the rank opens on its worker now */
        st = stria__sess_open_ranks(s, &rank, 1);
    stria__rank_t *r = st == STRIA_OK ? &s->job->ranks[rank] : NULL;
    if (st == STRIA_OK && r->shm.base == NULL)
        st = stria_error_set(STRIA_ERR_UNSUPPORTED,
                             "%s: rank %d's tensors go over TCP (%s): pass buffers of your own", fn,
                             rank, r->shm_why[0] ? r->shm_why : "no arena");
    if (st == STRIA_OK)
        st = stria_layout_init(s->job->spec.layout, s->job->n_ranks, c.seq_len, &lay);
    if (st != STRIA_OK) {
        pthread_mutex_unlock(&s->lock);
        return st;
    }
    /* the arena's layout of a call: inputs Q, K, V, O, LSE, dO from 0 (a
     * forward writes O and LSE where the backward reads them), dQ, dK, dV
     * after the inputs' room */
    size_t in_cap = 0;
    stria__sess_arena_bytes(s, &in_cap);
    int64_t valid = stria_layout_shard_valid(&lay, rank);
    size_t es = stria_dtype_size(s->spec.dtype);
    size_t qrow = (size_t)(s->spec.heads * s->spec.head_dim) * es;
    size_t kvrow = (size_t)(s->spec.kv_heads * s->spec.head_dim) * es;
    size_t qb = (size_t)(c.batch * valid) * qrow, kvb = (size_t)(c.batch * valid) * kvrow;
    size_t lb = (size_t)(c.batch * s->spec.heads * valid) * 4u;
    const size_t offs[10] = {0,
                             0,
                             qb,
                             qb + kvb,
                             qb + 2 * kvb + qb + lb,
                             qb + 2 * kvb,
                             qb + 2 * kvb + qb,
                             in_cap,
                             in_cap + qb,
                             in_cap + qb + kvb};
    const size_t rows[10] = {0, qrow, kvrow, kvrow, qrow, qrow, 4, qrow, kvrow, kvrow};
    stria_shard_buffer_t b2 = STRIA_SHARD_BUFFER_INIT;
    b2.data = (char *)r->shm.base + offs[tensor];
    b2.outer = tensor == STRIA_TENSOR_LSE ? c.batch * s->spec.heads : c.batch;
    b2.tokens = valid;
    b2.row_bytes = (int64_t)rows[tensor];
    b2.outer_stride = valid * b2.row_bytes;
    pthread_mutex_unlock(&s->lock);
    *out = b2;
    return STRIA_OK;
}

/* ---- accessors and closing ---------------------------------------------------- */

int64_t stria_session_shard_tokens(const stria_session_t *s, int64_t seq_len, int rank)
{
    stria_layout_t lay;
    if (s == NULL || s->job == NULL || rank < 0 || rank >= s->job->n_ranks ||
        stria_layout_init(s->job->spec.layout, s->job->n_ranks, seq_len, &lay) != STRIA_OK)
        return -1;
    return stria_layout_shard_valid(&lay, rank);
}

stria_status_t stria_session_positions(const stria_session_t *s, int64_t seq_len, int rank,
                                       int64_t *positions_out)
{
    stria_layout_t lay;
    if (s == NULL || s->job == NULL || positions_out == NULL || rank < 0 || rank >= s->job->n_ranks)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_positions: NULL argument or rank %d out of range",
                               rank);
    stria_status_t st = stria_layout_init(s->job->spec.layout, s->job->n_ranks, seq_len, &lay);
    if (st != STRIA_OK)
        return st;
    int64_t n = stria_layout_shard_valid(&lay, rank);
    for (int64_t i = 0; i < n; i++)
        positions_out[i] = stria_layout_position(&lay, rank, i);
    return STRIA_OK;
}

int stria_session_ring_size(const stria_session_t *s)
{
    return s != NULL && s->job != NULL ? s->job->n_ranks : 0;
}

stria_layout_kind_t stria_session_layout(const stria_session_t *s)
{
    return s != NULL ? s->spec.layout : STRIA_LAYOUT_STRIPED;
}

stria_status_t stria_session_spec_get(const stria_session_t *s, stria_session_spec_t *out)
{
    if (s == NULL || out == NULL || out->struct_size != sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_spec_get: NULL argument or a struct_size this "
                               "library cannot fill (start from STRIA_SESSION_SPEC_INIT)");
    *out = s->spec; /* its strings and arrays were not kept */
    if (s->job != NULL)
        out->ring_size = s->job->n_ranks;
    return STRIA_OK;
}

uint64_t stria_session_id(const stria_session_t *s)
{
    return s != NULL && s->job != NULL ? s->job->id : 0;
}

stria_status_t stria_session_stats(const stria_session_t *s, stria_session_stats_t *out)
{
    if (s == NULL || out == NULL || out->struct_size == 0 || out->struct_size > sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_stats: NULL argument or a struct_size this library "
                               "cannot fill (start from STRIA_SESSION_STATS_INIT)");
    size_t size = out->struct_size;
    pthread_mutex_lock((pthread_mutex_t *)&s->lock);
    stria_session_stats_t ours = s->stats;
    pthread_mutex_unlock((pthread_mutex_t *)&s->lock);
    ours.struct_size = size;
    memcpy(out, &ours, size);
    return STRIA_OK;
}

stria_status_t stria_session_close(stria_session_t *s)
{
    if (s == NULL)
        return STRIA_OK;
    pthread_mutex_lock(&s->lock); /* a call still running ends first */
    stria_status_t st = STRIA_OK;
    int n = s->job != NULL ? s->job->n_ranks : 0;
    for (int i = 0; i < n; i++) {
        stria_free(s->up[i]);
        stria_free(s->down[i]);
        s->up[i] = s->down[i] = NULL;
    }
    if (s->job != NULL) {
        s->job->release_once = true;
        st = stria_client_release(s->job); /* frees it */
    }
    s->job = NULL;
    pthread_mutex_unlock(&s->lock);
    stria__sess_unlink(s);
    stria__sess_free(s);
    return st;
}
