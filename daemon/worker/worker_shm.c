/* Co-located clients: the jobs' memory as memfds, and the Unix socket in the
 * worker's runtime directory over which a client of this host attaches to a
 * job's rank (the job's secret), receives the memfd of its tensors, and says
 * which inputs it wrote (ShmRequest in proto/stria.proto). One thread
 * accepts; one thread serves each connection. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "worker_int.h"

#define STRIA__SHM_MAX_CONNS 256
#define STRIA__SHM_ALIGN     ((uint64_t)4096)

/* ---- job memory ------------------------------------------------------------ */

/* Bytes of tensor t in the job's memory (padded rows). */
static uint64_t stria__mem_bytes(const stria__wjob_t *j, int t)
{
    int64_t outer;
    size_t row;
    stria__wjob_geometry(j, t, &outer, &row);
    return (uint64_t)outer * (uint64_t)j->layout.shard_tokens * row;
}

stria_status_t stria__wjob_mem_alloc(stria__wjob_t *j)
{
    uint64_t size = 0;
    for (int t = 0; t < STRIA__T_COUNT; t++) {
        j->mem_off[t] = size;
        size +=
            (stria__mem_bytes(j, t) + STRIA__SHM_ALIGN - 1) / STRIA__SHM_ALIGN * STRIA__SHM_ALIGN;
    }
    j->memfd = memfd_create("stria-job", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (j->memfd < 0)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "job %llu: no memfd for shared memory: %s",
                               (unsigned long long)j->id, strerror(errno));
    /* Sealed against resizing: a client that shrank the file would fault
     * the worker's mapping; and against further seals. */
    if (ftruncate(j->memfd, (off_t)size) != 0 ||
        fcntl(j->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        j->mem = MAP_FAILED;
    else
        j->mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, j->memfd, 0);
    if (j->mem == MAP_FAILED) {
        int e = errno;
        j->mem = NULL;
        close(j->memfd);
        j->memfd = -1;
        return stria_error_set(STRIA_ERR_NO_MEMORY, "job %llu: cannot map %llu bytes: %s",
                               (unsigned long long)j->id, (unsigned long long)size, strerror(e));
    }
    j->mem_size = size;
    for (int t = 0; t < STRIA__T_COUNT; t++)
        j->buf[t] = (char *)j->mem + j->mem_off[t];
    return STRIA_OK;
}

/* Before a pass of a job in a memfd: its outputs' pages. The memfd starts
 * as a hole; the pass's stores would fault each 4 KiB page in on its own
 * (allocated and cleared by the kernel, one fault a page). Writing zeros
 * with pwritev() allocates them in one call, and a read of one byte a page
 * then maps them 16 at a time (fault-around): no fault in the pass.
 * Outputs already there (a pass run again) are left as they are. Both steps
 * are hints: where one fails, the pass faults the pages in. */
void stria__wjob_mem_prepare(stria__wjob_t *j, bool backward)
{
    static const int fwd[] = {STRIA__T_O, STRIA__T_LSE};
    static const int bwd[] = {STRIA__T_DQ, STRIA__T_DK, STRIA__T_DV};
    static char zeros[1 << 16];
    struct iovec iov[256];
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (j->memfd < 0 || j->mem == NULL)
        return;
    for (int i = 0; i < (backward ? 3 : 2); i++) {
        int t = backward ? bwd[i] : fwd[i];
        uint64_t off = j->mem_off[t], len = stria__mem_bytes(j, t);
        unsigned char in_core = 0;
        if (len == 0 ||
            (mincore((char *)j->mem + off / page * page, 1, &in_core) == 0 && (in_core & 1)))
            continue;
        for (uint64_t done = 0; done < len;) {
            int n = 0;
            for (uint64_t at = done; n < 256 && at < len; n++, at += sizeof(zeros))
                iov[n] = (struct iovec){zeros, len - at < sizeof(zeros) ? (size_t)(len - at)
                                                                        : sizeof(zeros)};
            ssize_t w = pwritev(j->memfd, iov, n, (off_t)(off + done));
            if (w <= 0)
                break;
            done += (uint64_t)w;
        }
        const volatile char *p = (const volatile char *)j->mem + off;
        for (uint64_t b = 0; b < len; b += page)
            (void)p[b];
    }
}

void stria__wjob_mem_free(stria__wjob_t *j)
{
    if (j->mem != NULL)
        munmap(j->mem, j->mem_size);
    if (j->memfd >= 0)
        close(j->memfd);
    j->mem = NULL;
    j->memfd = -1;
    for (int t = 0; t < STRIA__T_COUNT; t++)
        j->buf[t] = NULL;
}

/* ---- the socket ------------------------------------------------------------- */

typedef struct stria__shm_conn {
    struct stria__shm_conn *next;
    stria__shm_srv_t *srv;
    int fd;
    pthread_t th;
    bool done; /* the thread has ended: join it */
    pid_t pid;
    bool attached;
    uint64_t job_id;
    uint32_t rank;
    bool arena; /* a session's arena registered (job_id, rank): gone with the connection */
} stria__shm_conn_t;

struct stria__shm_srv {
    stria_worker_t *w;
    int lfd;
    int wake[2]; /* the stop signal of the accepting thread */
    pthread_t th;
    pthread_mutex_t lock; /* conns, n_conns, stopping */
    stria__shm_conn_t *conns;
    int n_conns;
    bool stopping;
};

static stria_status_t stria__shm_reply_error(stria__shm_conn_t *c, stria_status_t st)
{
    Stria__V1__ShmReply rep = STRIA__V1__SHM_REPLY__INIT;
    char msg[768];
    snprintf(msg, sizeof(msg), "%s", stria_error_msg()[0] ? stria_error_msg() : "refused");
    rep.status = st;
    rep.message = msg;
    return stria_shm_send(c->fd, &rep.base, -1);
}

/* The attach reply: the memory's size and where each tensor lies in it. */
static stria_status_t stria__shm_send_layout(stria__shm_conn_t *c, const stria__wjob_t *j)
{
    static const Stria__V1__Tensor ids[STRIA__T_COUNT] = {
        STRIA__V1__TENSOR__TENSOR_Q,  STRIA__V1__TENSOR__TENSOR_K,  STRIA__V1__TENSOR__TENSOR_V,
        STRIA__V1__TENSOR__TENSOR_DO, STRIA__V1__TENSOR__TENSOR_O,  STRIA__V1__TENSOR__TENSOR_LSE,
        STRIA__V1__TENSOR__TENSOR_DQ, STRIA__V1__TENSOR__TENSOR_DK, STRIA__V1__TENSOR__TENSOR_DV};
    Stria__V1__ShmReply rep = STRIA__V1__SHM_REPLY__INIT;
    Stria__V1__ShmTensor ts[STRIA__T_COUNT], *tp[STRIA__T_COUNT];
    for (int t = 0; t < STRIA__T_COUNT; t++) {
        int64_t outer;
        size_t row;
        stria__wjob_geometry(j, t, &outer, &row);
        stria__v1__shm_tensor__init(&ts[t]);
        ts[t].tensor = ids[t];
        ts[t].offset = j->mem_off[t];
        ts[t].outer = (uint64_t)outer;
        ts[t].outer_stride = (uint64_t)j->layout.shard_tokens * row;
        ts[t].row_bytes = row;
        tp[t] = &ts[t];
    }
    rep.size = j->mem_size;
    rep.tokens = (uint64_t)j->valid;
    rep.tensors = tp;
    rep.n_tensors = STRIA__T_COUNT;
    return stria_shm_send(c->fd, &rep.base, j->memfd);
}

static stria_status_t stria__wshm_attach(stria__shm_conn_t *c, const Stria__V1__ShmRequest *req)
{
    stria_worker_t *w = c->srv->w;
    stria__wjob_t *j;
    if (c->attached)
        return stria__shm_reply_error(
            c, stria_error_set(STRIA_ERR_INVALID_ARG,
                               "this connection serves job %llu rank %u already: open another",
                               (unsigned long long)c->job_id, c->rank));
    uint64_t me = stria_worker_id(w);
    if (req->worker_id != me)
        return stria__shm_reply_error(
            c, stria_error_set(STRIA_ERR_NOT_FOUND,
                               "this socket is worker %llu's, not worker %llu's (another worker "
                               "of this host, or the rank's worker is on another host)",
                               (unsigned long long)me, (unsigned long long)req->worker_id));
    if (req->secret.len != sizeof(stria_job_secret_t))
        return stria__shm_reply_error(
            c, stria_error_set(STRIA_ERR_AUTH,
                               "job %llu: attaching needs the job's secret (%zu bytes, got %zu)",
                               (unsigned long long)req->job_id, sizeof(stria_job_secret_t),
                               req->secret.len));
    stria_job_secret_t secret;
    memcpy(secret.bytes, req->secret.data, sizeof(secret.bytes));
    stria_status_t st = stria__wjob_get_shared(w, req->job_id, req->rank, &secret, &j);
    stria_auth_wipe(&secret, sizeof(secret));
    if (st != STRIA_OK)
        return stria__shm_reply_error(c, st);
    st = stria__shm_send_layout(c, j);
    if (st == STRIA_OK) {
        c->attached = true;
        c->job_id = j->id;
        c->rank = (uint32_t)j->rank;
        stria_log_info("job %llu rank %d: client pid %d attached its shared memory",
                       (unsigned long long)j->id, j->rank, (int)c->pid);
    }
    stria__wjob_unref(w, j);
    return st;
}

static stria_status_t stria__wshm_commit(stria__shm_conn_t *c, const Stria__V1__ShmRequest *req)
{
    stria_worker_t *w = c->srv->w;
    stria__wjob_t *j;
    int t = stria__job_tensor(req->tensor, false);
    if (!c->attached)
        return stria__shm_reply_error(
            c, stria_error_set(STRIA_ERR_INVALID_ARG, "commit before attach"));
    if (t < 0)
        return stria__shm_reply_error(c, stria_error_set(STRIA_ERR_INVALID_ARG,
                                                         "commit: tensor %d is not an input",
                                                         (int)req->tensor));
    stria_status_t st = stria__wjob_get(w, c->job_id, c->rank, false, &j);
    if (st != STRIA_OK)
        return stria__shm_reply_error(c, st);
    uint64_t total = stria__wjob_compact_bytes(j, t);
    pthread_mutex_lock(&w->lock);
    if (j->running) {
        pthread_mutex_unlock(&w->lock);
        stria__wjob_unref(w, j);
        return stria__shm_reply_error(c,
                                      stria_error_set(STRIA_ERR_BUSY, "job %llu: a pass is running",
                                                      (unsigned long long)c->job_id));
    }
    st = stria_ranges_add(&j->received[t], 0, total);
    j->last_activity = stria_time_now();
    uint64_t got = j->received[t].covered;
    pthread_mutex_unlock(&w->lock);
    stria_metric_add(w->m_in_bytes, (double)total);
    stria__wjob_unref(w, j);
    if (st != STRIA_OK)
        return stria__shm_reply_error(c, st);
    Stria__V1__ShmReply rep = STRIA__V1__SHM_REPLY__INIT;
    rep.received_bytes = got;
    return stria_shm_send(c->fd, &rep.base, -1);
}

/* A client that went away without releasing its job cannot complete it:
 * the job fails (every rank hears it) and its memory goes back now. */
static void stria__shm_lost(stria__shm_conn_t *c)
{
    stria_worker_t *w = c->srv->w;
    char msg[256];
    pthread_mutex_lock(&w->lock);
    stria__wjob_t *j = stria__wjob_find(w, c->job_id);
    if (j != NULL && (uint32_t)j->rank == c->rank && !w->stopping) {
        snprintf(msg, sizeof(msg),
                 "rank %u: its client (pid %d) closed its shared-memory connection without "
                 "releasing the job",
                 c->rank, (int)c->pid);
        stria__wjob_fail_locked(w, j, msg);
    }
    pthread_mutex_unlock(&w->lock);
}

/* OP_ARENA: a session's arena, the memfd passed along. */
static stria_status_t stria__wshm_arena(stria__shm_conn_t *c, const Stria__V1__ShmRequest *req,
                                        int fd)
{
    stria_worker_t *w = c->srv->w;
    stria_status_t st = STRIA_OK;
    uint64_t me = stria_worker_id(w);
    if (c->attached || c->arena)
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "this connection serves job %llu rank %u already: open another",
                             (unsigned long long)c->job_id, c->rank);
    else if (req->worker_id != me)
        st = stria_error_set(STRIA_ERR_NOT_FOUND, "this socket is worker %llu's, not worker %llu's",
                             (unsigned long long)me, (unsigned long long)req->worker_id);
    else if (req->secret.len != sizeof(stria_job_secret_t))
        st = stria_error_set(STRIA_ERR_AUTH, "session %llu: an arena needs the session's secret",
                             (unsigned long long)req->job_id);
    else if (fd < 0)
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "an arena request without its memfd");
    if (st == STRIA_OK) {
        stria_job_secret_t secret;
        memcpy(secret.bytes, req->secret.data, sizeof(secret.bytes));
        st = stria__wsess_arena(w, req->job_id, req->rank, &secret, fd, req->arena_size);
        stria_auth_wipe(&secret, sizeof(secret));
    }
    if (st != STRIA_OK)
        return stria__shm_reply_error(c, st);
    c->arena = true;
    c->job_id = req->job_id;
    c->rank = req->rank;
    Stria__V1__ShmReply rep = STRIA__V1__SHM_REPLY__INIT;
    rep.size = req->arena_size;
    return stria_shm_send(c->fd, &rep.base, -1);
}

static void *stria__shm_conn_main(void *arg)
{
    stria__shm_conn_t *c = arg;
    for (;;) {
        ProtobufCMessage *msg = NULL;
        int fd = -1;
        stria_status_t st =
            stria_shm_recv(c->fd, &stria__v1__shm_request__descriptor, 0, &msg, &fd);
        if (st != STRIA_OK) {
            if (fd >= 0)
                close(fd);
            break;
        }
        const Stria__V1__ShmRequest *req = (const Stria__V1__ShmRequest *)msg;
        switch (req->op) {
        case STRIA__V1__SHM_REQUEST__OP__OP_ARENA: /* mapped or refused: the descriptor goes */
            st = stria__wshm_arena(c, req, fd);
            break;
        case STRIA__V1__SHM_REQUEST__OP__OP_ATTACH:
            st = stria__wshm_attach(c, req);
            break;
        case STRIA__V1__SHM_REQUEST__OP__OP_COMMIT:
            st = stria__wshm_commit(c, req);
            break;
        default:
            st = stria__shm_reply_error(
                c, stria_error_set(STRIA_ERR_INVALID_ARG, "unknown request %d", (int)req->op));
        }
        if (fd >= 0) /* only an arena's is kept, mapped */
            close(fd);
        protobuf_c_message_free_unpacked(msg, NULL);
        if (st != STRIA_OK)
            break;
    }
    if (c->attached)
        stria__shm_lost(c);
    if (c->arena)
        stria__wsess_arena_closed(c->srv->w, c->job_id, c->rank);
    pthread_mutex_lock(&c->srv->lock);
    c->done = true;
    pthread_mutex_unlock(&c->srv->lock);
    return NULL;
}

/* Joins and frees the connections whose threads ended (all, with `all`,
 * after their sockets were shut down). */
static void stria__shm_reap(stria__shm_srv_t *srv, bool all)
{
    for (;;) {
        stria__shm_conn_t *c = NULL, **pp;
        pthread_mutex_lock(&srv->lock);
        for (pp = &srv->conns; *pp != NULL; pp = &(*pp)->next)
            if ((*pp)->done || all) {
                c = *pp;
                *pp = c->next;
                srv->n_conns--;
                break;
            }
        pthread_mutex_unlock(&srv->lock);
        if (c == NULL)
            return;
        pthread_join(c->th, NULL);
        close(c->fd);
        free(c);
    }
}

static void stria__shm_accept(stria__shm_srv_t *srv)
{
    int fd = accept4(srv->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0)
        return;
    struct ucred cred = {0};
    socklen_t cl = sizeof(cred);
    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl);
    stria__shm_conn_t *c = calloc(1, sizeof(*c));
    pthread_mutex_lock(&srv->lock);
    bool full = srv->n_conns >= STRIA__SHM_MAX_CONNS;
    pthread_mutex_unlock(&srv->lock);
    if (c == NULL || full) {
        stria_log_warn("shared-memory socket: refusing client pid %d: %s", (int)cred.pid,
                       full ? "too many connections" : "out of memory");
        free(c);
        close(fd);
        return;
    }
    c->srv = srv;
    c->fd = fd;
    c->pid = cred.pid;
    pthread_mutex_lock(&srv->lock);
    if (pthread_create(&c->th, NULL, stria__shm_conn_main, c) != 0) {
        pthread_mutex_unlock(&srv->lock);
        close(fd);
        free(c);
        return;
    }
    c->next = srv->conns;
    srv->conns = c;
    srv->n_conns++;
    pthread_mutex_unlock(&srv->lock);
}

static void *stria__shm_main(void *arg)
{
    stria__shm_srv_t *srv = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = srv->lfd, .events = POLLIN},
                              {.fd = srv->wake[0], .events = POLLIN}};
        int rc = poll(p, 2, 1000);
        if (rc < 0 && errno != EINTR)
            break;
        if (p[1].revents != 0)
            break;
        if (rc > 0 && (p[0].revents & POLLIN))
            stria__shm_accept(srv);
        stria__shm_reap(srv, false);
    }
    return NULL;
}

stria_status_t stria__shm_start(stria_worker_t *w, const char *dir)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int n = snprintf(a.sun_path, sizeof(a.sun_path), "%s/stria-worker-%u.sock", dir,
                     (unsigned)stria_rpc_server_port(w->server));
    if (n < 0 || (size_t)n >= sizeof(a.sun_path))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "runtime directory '%s': the socket path in it would be longer "
                               "than %zu bytes",
                               dir, sizeof(a.sun_path) - 1);
    stria__shm_srv_t *srv = calloc(1, sizeof(*srv));
    if (srv == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    srv->w = w;
    srv->wake[0] = srv->wake[1] = -1;
    pthread_mutex_init(&srv->lock, NULL);
    struct stat sb;
    if (lstat(a.sun_path, &sb) == 0 && S_ISSOCK(sb.st_mode))
        unlink(a.sun_path); /* left by an earlier worker on this port */
    srv->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    stria_status_t st = STRIA_OK;
    if (srv->lfd < 0 || bind(srv->lfd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        chmod(a.sun_path, 0666) != 0 || listen(srv->lfd, 64) != 0 ||
        pipe2(srv->wake, O_CLOEXEC) != 0)
        st = stria_error_set(STRIA_ERR_IO, "runtime directory: cannot listen on %s: %s", a.sun_path,
                             strerror(errno));
    if (st == STRIA_OK && pthread_create(&srv->th, NULL, stria__shm_main, srv) != 0)
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot start the shared-memory thread");
    if (st != STRIA_OK) {
        if (srv->lfd >= 0) {
            close(srv->lfd);
            unlink(a.sun_path);
        }
        if (srv->wake[0] >= 0) {
            close(srv->wake[0]);
            close(srv->wake[1]);
        }
        pthread_mutex_destroy(&srv->lock);
        free(srv);
        return st;
    }
    snprintf(w->shm_socket, sizeof(w->shm_socket), "%s", a.sun_path);
    w->shm = srv;
    return STRIA_OK;
}

void stria__shm_stop(stria_worker_t *w)
{
    stria__shm_srv_t *srv = w->shm;
    if (srv == NULL)
        return;
    (void)!write(srv->wake[1], "x", 1);
    pthread_join(srv->th, NULL);
    close(srv->lfd);
    unlink(w->shm_socket);
    pthread_mutex_lock(&srv->lock);
    srv->stopping = true;
    for (stria__shm_conn_t *c = srv->conns; c != NULL; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    pthread_mutex_unlock(&srv->lock);
    stria__shm_reap(srv, true);
    close(srv->wake[0]);
    close(srv->wake[1]);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
    w->shm = NULL;
}
