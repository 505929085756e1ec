/* libstria: one rank of a session. Its worker from the assignment, the
 * connection to it (kept for the session's life), its open (OpenSession,
 * every rank's request sent before any reply is read: their workers bind
 * their ring links to each other), its data path (an arena of this
 * process's own memory registered with a worker of this host, else TCP),
 * and the drop of a rank at the end. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client_int.h"

/* ---- what sessions leave for the next ones ------------------------------------------ */

/* A kept connection to `address`, checked (NULL: none). */
static stria_rpc_client_t *conn_take(stria_client_t *c, const char *address)
{
    stria_rpc_client_t *conn = NULL;
    pthread_mutex_lock(&c->keep_lock);
    for (int i = c->n_kept_conns - 1; i >= 0 && conn == NULL; i--) {
        if (strcmp(c->kept_conns[i].address, address) != 0)
            continue;
        conn = c->kept_conns[i].conn;
        c->kept_conns[i] = c->kept_conns[--c->n_kept_conns];
    }
    pthread_mutex_unlock(&c->keep_lock);
    if (conn != NULL && !stria_rpc_client_check_idle(conn)) {
        stria_rpc_client_close(conn);
        conn = NULL;
    }
    return conn;
}

/* Keeps a sound connection for the next session (the oldest closed when
 * there are too many). */
static void conn_give(stria_client_t *c, const char *address, stria_rpc_client_t *conn)
{
    stria_rpc_client_t *gone = NULL;
    pthread_mutex_lock(&c->keep_lock);
    if (c->n_kept_conns == STRIA__KEPT_CONNS) {
        gone = c->kept_conns[0].conn;
        memmove(&c->kept_conns[0], &c->kept_conns[1],
                (size_t)(STRIA__KEPT_CONNS - 1) * sizeof(c->kept_conns[0]));
        c->n_kept_conns--;
    }
    stria__lconn_t *k = &c->kept_conns[c->n_kept_conns++];
    snprintf(k->address, sizeof(k->address), "%s", address);
    k->conn = conn;
    pthread_mutex_unlock(&c->keep_lock);
    stria_rpc_client_close(gone);
}

/* A kept arena of exactly `size` bytes into rank r (false: none): one the
 * rank's worker still has mapped first. */
static bool arena_take(stria_client_t *c, stria__lrank_t *r, size_t size)
{
    pthread_mutex_lock(&c->keep_lock);
    int pick = -1;
    for (int i = 0; i < c->n_kept_arenas; i++) {
        const stria__larena_t *a = &c->kept_arenas[i];
        if (a->size != size)
            continue;
        if (pick < 0 || strcmp(a->address, r->rpc_address) == 0)
            pick = i;
        if (strcmp(a->address, r->rpc_address) == 0)
            break;
    }
    if (pick >= 0) {
        stria__larena_t *a = &c->kept_arenas[pick];
        r->arena = a->base;
        r->arena_fd = a->fd;
        r->arena_size = a->size;
        c->kept_arena_bytes -= a->size;
        *a = c->kept_arenas[--c->n_kept_arenas];
    }
    pthread_mutex_unlock(&c->keep_lock);
    return pick >= 0;
}

/* Keeps rank r's arena for the next session, or unmaps it (too many, or
 * too many bytes kept); the rank has none afterwards. */
static void arena_give(stria_client_t *c, stria__lrank_t *r)
{
    if (r->arena == NULL)
        return;
    bool kept = false;
    pthread_mutex_lock(&c->keep_lock);
    if (c->n_kept_arenas < STRIA__KEPT_ARENAS &&
        c->kept_arena_bytes + r->arena_size <= STRIA__KEPT_ARENA_BYTES) {
        stria__larena_t *a = &c->kept_arenas[c->n_kept_arenas++];
        *a = (stria__larena_t){.fd = r->arena_fd, .base = r->arena, .size = r->arena_size};
        snprintf(a->address, sizeof(a->address), "%s", r->rpc_address);
        c->kept_arena_bytes += r->arena_size;
        kept = true;
    }
    pthread_mutex_unlock(&c->keep_lock);
    if (!kept) {
        munmap(r->arena, r->arena_size);
        close(r->arena_fd);
    }
    r->arena = NULL;
    r->arena_fd = -1;
    r->arena_size = 0;
}

/* Keeps a payload buffer for the next session (within the kept bytes), or
 * frees it. */
static void buf_give(stria_client_t *c, void *p, size_t size)
{
    if (p == NULL)
        return;
    pthread_mutex_lock(&c->keep_lock);
    bool kept = c->n_kept_bufs < STRIA__KEPT_ARENAS &&
                c->kept_arena_bytes + size <= STRIA__KEPT_ARENA_BYTES;
    if (kept) {
        c->kept_bufs[c->n_kept_bufs].p = p;
        c->kept_bufs[c->n_kept_bufs++].size = size;
        c->kept_arena_bytes += size;
    }
    pthread_mutex_unlock(&c->keep_lock);
    if (!kept)
        stria_free(p);
}

stria_status_t stria__lrank_grow(stria_client_t *c, void **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return STRIA_OK;
    void *p = NULL;
    size_t size = 0;
    pthread_mutex_lock(&c->keep_lock); /* the smallest kept one that holds it */
    int pick = -1;
    for (int i = 0; i < c->n_kept_bufs; i++)
        if (c->kept_bufs[i].size >= need &&
            (pick < 0 || c->kept_bufs[i].size < c->kept_bufs[pick].size))
            pick = i;
    if (pick >= 0) {
        p = c->kept_bufs[pick].p;
        size = c->kept_bufs[pick].size;
        c->kept_arena_bytes -= size;
        c->kept_bufs[pick] = c->kept_bufs[--c->n_kept_bufs];
    }
    pthread_mutex_unlock(&c->keep_lock);
    if (p == NULL && (p = stria_malloc_aligned(need)) != NULL)
        size = need;
    if (p == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory for %zu bytes", need);
    buf_give(c, *buf, *cap);
    *buf = p;
    *cap = size;
    return STRIA_OK;
}

void stria__lrank_forget_kept(stria_client_t *c)
{
    pthread_mutex_lock(&c->keep_lock);
    for (int i = 0; i < c->n_kept_bufs; i++)
        stria_free(c->kept_bufs[i].p);
    c->n_kept_bufs = 0;
    for (int i = 0; i < c->n_kept_conns; i++)
        stria_rpc_client_close(c->kept_conns[i].conn);
    for (int i = 0; i < c->n_kept_arenas; i++) {
        munmap(c->kept_arenas[i].base, c->kept_arenas[i].size);
        close(c->kept_arenas[i].fd);
    }
    c->n_kept_conns = c->n_kept_arenas = 0;
    c->kept_arena_bytes = 0;
    pthread_mutex_unlock(&c->keep_lock);
}

/* ---- the ranks of an assignment ---------------------------------------------------- */

static void rank_init(stria__lrank_t *r, int rank)
{
    memset(r, 0, sizeof(*r));
    r->rank = rank;
    r->arena_fd = r->arena_sock = -1;
}

stria_status_t stria__lrank_assign(stria_session_t *s, const Stria__V1__Assignment *a)
{
    const Stria__V1__JobSpec *sp = a->spec;
    if (sp == NULL || a->n_ranks == 0 || a->n_ranks > STRIA_LAYOUT_MAX_RANKS)
        return stria_error_set(STRIA_ERR_PROTOCOL,
                               "coordinator sent an assignment without spec or ranks");
    /* The assignment names the layout the coordinator chose (auto resolved);
     * a layout the caller named must come back as it was. */
    stria_layout_kind_t asked = s->open.js.layout;
    if ((unsigned)sp->layout > STRIA__V1__LAYOUT__LAYOUT_PACKED ||
        sp->layout == STRIA__V1__LAYOUT__LAYOUT_AUTO ||
        (asked != STRIA_LAYOUT_AUTO && (stria_layout_kind_t)sp->layout != asked))
        return stria_error_set(STRIA_ERR_PROTOCOL,
                               "coordinator assigned layout %d to a job submitted as %s",
                               (int)sp->layout, stria_layout_kind_name(asked));
    stria_layout_t lay;
    stria_status_t st = stria_layout_init((stria_layout_kind_t)sp->layout, (int)a->n_ranks,
                                          (int64_t)sp->seq_len, &lay);
    if (st != STRIA_OK)
        return st;
    stria__lrank_t *ranks = calloc(a->n_ranks, sizeof(*ranks));
    if (ranks == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate ranks");
    for (size_t i = 0; i < a->n_ranks; i++) {
        const Stria__V1__RankAssignment *ra = a->ranks[i];
        stria__lrank_t *r = &ranks[i];
        rank_init(r, (int)i);
        if (ra->rank != i || ra->rpc_address == NULL ||
            strlen(ra->rpc_address) >= sizeof(r->rpc_address)) {
            free(ranks);
            return stria_error_set(STRIA_ERR_PROTOCOL, "assignment rank %zu is malformed", i);
        }
        snprintf(r->rpc_address, sizeof(r->rpc_address), "%s", ra->rpc_address);
        r->worker_id = ra->worker_id;
        if (strlen(ra->shm_socket) < sizeof(r->shm_socket)) /* else: TCP */
            snprintf(r->shm_socket, sizeof(r->shm_socket), "%s", ra->shm_socket);
        if ((int64_t)ra->tokens != stria_layout_shard_valid(&lay, (int)i)) {
            free(ranks);
            return stria_error_set(STRIA_ERR_PROTOCOL,
                                   "assignment gives rank %zu %llu tokens, the %s layout %lld", i,
                                   (unsigned long long)ra->tokens,
                                   stria_layout_kind_name((stria_layout_kind_t)sp->layout),
                                   (long long)stria_layout_shard_valid(&lay, (int)i));
        }
    }
    /* the arenas of the ranks it had stay (their mappings were handed out);
     * the rest of those ranks went with stria__lrank_drop_all() */
    for (int i = 0; s->ranks != NULL && i < s->n_ranks; i++) {
        stria__lrank_t *old = &s->ranks[i];
        if (i < (int)a->n_ranks) {
            ranks[i].arena = old->arena;
            ranks[i].arena_fd = old->arena_fd;
            ranks[i].arena_size = old->arena_size;
            ranks[i].used = old->used;
        } else {
            arena_give(s->client, old);
        }
    }
    free(s->ranks);
    s->ranks = ranks;
    s->n_ranks = (int)a->n_ranks;
    s->id = a->job_id;
    s->layout = (stria_layout_kind_t)sp->layout;
    double step = sp->step_timeout_ms > 0 ? sp->step_timeout_ms / 1000.0 : STRIA__DEFAULT_STEP_S;
    /* Workers enforce the per-step deadline; this only guards against a
     * worker that stops answering altogether. */
    s->call_timeout_s = step * (s->n_ranks + 2) + 30.0 +
                        (s->sharded ? (sp->arrival_timeout_s > 0 ? sp->arrival_timeout_s : 60) : 0);
    return STRIA_OK;
}

size_t stria__lrank_region(const stria_session_t *s, size_t *in_room_out)
{
    stria_layout_t lay;
    uint64_t in_room = 0;
    if (stria_layout_init(s->layout, s->n_ranks, s->spec.max_seq_len, &lay) != STRIA_OK)
        return 0;
    uint64_t region =
        stria_session_region_bytes(s->spec.max_batch, lay.shard_tokens, s->spec.heads,
                                   s->spec.kv_heads, s->spec.head_dim, s->spec.dtype, &in_room);
    if (in_room_out != NULL)
        *in_room_out = (size_t)in_room;
    return (size_t)region;
}

/* ---- failures --------------------------------------------------------------------- */

void stria__lrank_fail(const stria__lrank_t *r, stria_status_t st, stria__lout_t *o)
{
    o->st = st;
    /* no answer (refused, closed, silent past the deadline), not an error
     * the worker replied: the worker is lost; or it says it leaves (a worker
     * being drained closes the session at a call boundary) */
    bool silent = (st == STRIA_ERR_IO || st == STRIA_ERR_CLOSED || st == STRIA_ERR_TIMEOUT ||
                   st == STRIA_ERR_TRANSPORT) &&
                  (r->conn == NULL || !stria_rpc_client_server_error(r->conn));
    o->lost = silent || st == STRIA_ERR_CLOSED;
    o->retryable = o->lost || stria_error_retryable();
    snprintf(o->error, sizeof(o->error), "%s",
             stria_error_msg()[0] ? stria_error_msg() : stria_status_str(st));
}

int stria__lrank_explains(const stria__lout_t *o)
{
    return o->abandoned ? 0 : o->st == STRIA_ERR_PEER ? 1 : 2;
}

/* ---- the connection and the open --------------------------------------------------- */

static stria_status_t connect_rank(stria_session_t *s, stria__lrank_t *r)
{
    r->used = true;
    if (r->conn != NULL)
        return STRIA_OK;
    if ((r->conn = conn_take(s->client, r->rpc_address)) != NULL)
        return STRIA_OK;
    stria_rpc_client_params_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.address = r->rpc_address;
    rp.service = &stria__v1__worker__descriptor;
    rp.token = s->client->token;
    rp.client_name = s->client->client_name;
    rp.connect_timeout_s = s->client->params.connect_timeout_s;
    /* a call's outputs come straight into the caller's buffers: as large
     * as the session's bounds make them */
    rp.max_payload_bytes = UINT64_MAX / 2;
    stria_status_t st = stria_rpc_client_connect(&rp, &r->conn);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "session %llu rank %d: worker %s", (unsigned long long)s->id,
                                r->rank, r->rpc_address);
    return STRIA_OK;
}

/* A rank's arena: `size` bytes of a sealed memfd of this process, its pages
 * allocated (the worker refuses holes), mapped here; made once, kept. */
static stria_status_t arena_make(stria_session_t *s, stria__lrank_t *r, size_t size)
{
    if (r->arena != NULL)
        return r->arena_size >= size ? STRIA_OK
                                     : stria_error_set(STRIA_ERR_INVALID_ARG,
                                                       "the rank's arena is %zu bytes, %zu needed",
                                                       r->arena_size, size);
    if (arena_take(s->client, r, size))
        return STRIA_OK;
    int fd = memfd_create("stria-session-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return stria_error_set(STRIA_ERR_UNSUPPORTED, "memfd_create: %m");
    stria_status_t st = STRIA_OK;
    /* shmem counts pages allocated but never touched as holes: the
     * populating map below touches them; then sealed, so that no one can
     * shrink it under the worker's mapping */
    if (ftruncate(fd, (off_t)size) != 0 || fallocate(fd, 0, 0, (off_t)size) != 0)
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "the session's %zu-byte arena: %m", size);
    else if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        st = stria_error_set(STRIA_ERR_UNSUPPORTED, "sealing the session's arena: %m");
    void *base = MAP_FAILED;
    if (st == STRIA_OK && (base = mmap(NULL, size, PROT_READ | PROT_WRITE,
                                       MAP_SHARED | MAP_POPULATE, fd, 0)) == MAP_FAILED)
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "mapping the session's arena: %m");
    if (st != STRIA_OK) {
        close(fd);
        return st;
    }
    r->arena = base;
    r->arena_fd = fd;
    r->arena_size = size;
    return STRIA_OK;
}

/* Registers the rank's arena with its worker (ShmRequest OP_ARENA, the
 * memfd passed along); the socket stays open while it is registered. */
static stria_status_t arena_register(stria_session_t *s, stria__lrank_t *r)
{
    Stria__V1__ShmRequest req = STRIA__V1__SHM_REQUEST__INIT;
    ProtobufCMessage *msg = NULL;
    int sock = -1, passed = -1;
    stria_status_t st = stria_shm_connect(r->shm_socket, &sock);
    req.op = STRIA__V1__SHM_REQUEST__OP__OP_ARENA;
    req.worker_id = r->worker_id;
    req.job_id = s->id;
    req.rank = (uint32_t)r->rank;
    req.secret.data = (uint8_t *)s->secret.bytes;
    req.secret.len = sizeof(s->secret.bytes);
    req.arena_size = r->arena_size;
    if (st == STRIA_OK)
        st = stria_shm_send(sock, &req.base, r->arena_fd);
    if (st == STRIA_OK)
        st = stria_shm_recv(sock, &stria__v1__shm_reply__descriptor,
                            s->client->params.rpc_timeout_s, &msg, &passed);
    if (passed >= 0) /* the worker passes none back */
        close(passed);
    if (st == STRIA_OK) {
        const Stria__V1__ShmReply *rep = (const Stria__V1__ShmReply *)msg;
        if (rep->status < 0)
            st = stria_error_set((stria_status_t)rep->status, "%s", rep->message);
        protobuf_c_message_free_unpacked(msg, NULL);
    }
    if (st != STRIA_OK) {
        if (sock >= 0)
            close(sock);
        return stria_error_wrap(st, "%s", r->shm_socket);
    }
    r->arena_sock = sock;
    return STRIA_OK;
}

/* After a rank opened: its arena with a worker of this host, as the
 * client's data path says (auto: when the worker offers a socket and takes
 * the arena, else TCP, the reason kept; shm: or the rank fails). */
static stria_status_t decide_path(stria_session_t *s, stria__lrank_t *r)
{
    stria_data_path_t path = s->client->params.data_path;
    if (r->path_done)
        return STRIA_OK;
    r->path_done = true;
    if (path == STRIA_DATA_PATH_TCP) {
        snprintf(r->tcp_why, sizeof(r->tcp_why), "the client's path is tcp");
        return STRIA_OK;
    }
    stria_status_t st = STRIA_ERR_UNSUPPORTED;
    size_t region = stria__lrank_region(s, NULL);
    if (r->shm_socket[0] == '\0')
        stria_error_set(st, "its worker %s has no shared-memory socket (no runtime directory)",
                        r->rpc_address);
    else if ((st = arena_make(s, r, region * (1u + s->open.max_held))) == STRIA_OK)
        st = arena_register(s, r);
    if (st == STRIA_OK)
        return STRIA_OK;
    snprintf(r->tcp_why, sizeof(r->tcp_why), "%s", stria_error_msg());
    if (path == STRIA_DATA_PATH_SHM)
        return stria_error_set(st, "rank %d: no arena with its worker (path shm): %s", r->rank,
                               r->tcp_why);
    return STRIA_OK;
}

void stria__lrank_open(stria_session_t *s, const int *ranks, int n, bool early, stria__lout_t *out)
{
    Stria__V1__OpenSessionRequest req[n > 0 ? n : 1];
    stria_rpc_request_t rq[n > 0 ? n : 1];
    stria_rpc_pending_t pend[n > 0 ? n : 1];
    bool sent[n > 0 ? n : 1];
    double timeout =
        s->client->params.connect_timeout_s > 0 ? s->client->params.connect_timeout_s : 10.0;
    for (int i = 0; i < n; i++) {
        stria__lrank_t *r = &s->ranks[ranks[i]];
        memset(&out[i], 0, sizeof(out[i]));
        sent[i] = false;
        stria__v1__open_session_request__init(&req[i]);
        req[i].job_id = s->id;
        req[i].rank = (uint32_t)ranks[i];
        req[i].early = early;
        memset(&rq[i], 0, sizeof(rq[i]));
        rq[i].method = STRIA_RPC_WORKER_OPEN_SESSION;
        rq[i].request = &req[i].base;
        /* the workers fetch the assignment and bind the ring: their connect
         * timeout (30 s by default) and some */
        rq[i].timeout_s = timeout + 60.0;
        rq[i].job_secret = &s->secret;
        rq[i].job_id = s->id;
        stria_status_t st = connect_rank(s, r);
        if (st == STRIA_OK && (st = stria_rpc_client_send(r->conn, &rq[i], &pend[i])) == STRIA_OK)
            sent[i] = true;
        if (st != STRIA_OK)
            stria__lrank_fail(r, st, &out[i]);
    }
    /* A worker found lost at once (refused, closed): the others' opens wait
     * for their ring links to bind to it, which never happens; they are
     * given up on (their connections closed), and the open fails now. */
    bool lost = false;
    for (int i = 0; i < n; i++)
        lost = lost || (!sent[i] && out[i].lost);
    for (int i = 0; i < n; i++) {
        stria_rpc_reply_t reply;
        stria__lrank_t *r = &s->ranks[ranks[i]];
        if (!sent[i])
            continue;
        if (lost) {
            stria_rpc_client_close(r->conn);
            r->conn = NULL;
            out[i] =
                (stria__lout_t){.st = STRIA_ERR_CANCELLED, .retryable = true, .abandoned = true};
            snprintf(out[i].error, sizeof(out[i].error),
                     "given up on: another rank's worker was lost as the session opened");
            continue;
        }
        stria_status_t st = stria_rpc_client_recv(r->conn, &rq[i], &pend[i], &reply);
        if (st == STRIA_OK) {
            stria_rpc_reply_free(&reply);
            r->opened = true;
            st = decide_path(s, r);
        }
        if (st != STRIA_OK)
            stria__lrank_fail(r, st, &out[i]);
    }
}

/* ---- the end ---------------------------------------------------------------------- */

stria_status_t stria__lrank_release_held(stria_session_t *s, stria__lrank_t *r, uint64_t call)
{
    Stria__V1__DropJobRequest req = STRIA__V1__DROP_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    if (r->conn == NULL)
        return STRIA_OK; /* the rank's worker holds nothing of this handle's */
    req.job_id = s->id;
    req.rank = (uint32_t)r->rank;
    req.release_held = true;
    req.held_call = call;
    stria_rpc_request_t rq = {.method = STRIA_RPC_WORKER_DROP_JOB,
                              .request = &req.base,
                              .timeout_s = s->client->params.rpc_timeout_s,
                              .job_secret = &s->secret,
                              .job_id = s->id};
    stria_status_t st = stria_rpc_client_call(r->conn, &rq, &reply);
    stria_rpc_reply_free(&reply);
    return st;
}

void stria__lrank_drop_all(stria_session_t *s, bool arenas)
{
    Stria__V1__DropJobRequest req = STRIA__V1__DROP_JOB_REQUEST__INIT;
    int n = s->n_ranks;
    stria_rpc_request_t rq[n > 0 ? n : 1];
    stria_rpc_pending_t pend[n > 0 ? n : 1];
    bool sent[n > 0 ? n : 1];
    req.job_id = s->id;
    /* every rank's request first: their workers free their memory now (the
     * coordinator also tells them) */
    for (int i = 0; i < n; i++) {
        stria__lrank_t *r = &s->ranks[i];
        sent[i] = false;
        if (r->conn == NULL || s->id == 0)
            continue;
        rq[i] = (stria_rpc_request_t){.method = STRIA_RPC_WORKER_DROP_JOB,
                                      .request = &req.base,
                                      .timeout_s = 5.0,
                                      .job_secret = &s->secret,
                                      .job_id = s->id};
        sent[i] = stria_rpc_client_send(r->conn, &rq[i], &pend[i]) == STRIA_OK;
    }
    for (int i = 0; i < n; i++) {
        stria__lrank_t *r = &s->ranks[i];
        stria_rpc_reply_t reply;
        stria_status_t st = STRIA_ERR_CLOSED;
        if (sent[i] && (st = stria_rpc_client_recv(r->conn, &rq[i], &pend[i], &reply)) == STRIA_OK)
            stria_rpc_reply_free(&reply);
        /* answered (an error reply leaves the stream in step): sound */
        if (sent[i] && (st == STRIA_OK || stria_rpc_client_server_error(r->conn)))
            conn_give(s->client, r->rpc_address, r->conn);
        else
            stria_rpc_client_close(r->conn);
        r->conn = NULL;
        r->opened = false;
        r->path_done = false;
        if (r->arena_sock >= 0)
            close(r->arena_sock);
        r->arena_sock = -1;
        buf_give(s->client, r->up, r->up_cap);
        buf_give(s->client, r->down, r->down_cap);
        r->up = r->down = NULL;
        r->up_cap = r->down_cap = 0;
        if (arenas)
            arena_give(s->client, r);
    }
}
