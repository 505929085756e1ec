/* Co-located clients: the Unix socket in the worker's runtime directory
 * over which a client of this host registers its own memory (an arena,
 * its sealed memfd passed along) with a session's rank, proving the
 * session's secret (ShmRequest in proto/stria.proto). The arena stays
 * mapped while the connection lasts. One thread accepts and serves every
 * connection (a request is one small message: served as it comes). */
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

#define SHM_MAX_CONNS 256

/* ---- the socket ------------------------------------------------------------- */

typedef struct conn {
    stria__wshm_srv_t *srv;
    int fd;
    pid_t pid;
    uint64_t job_id;
    uint32_t rank;
    bool arena; /* a session's arena registered (job_id, rank): gone with the connection */
} conn_t;

struct stria__wshm_srv {
    stria_worker_t *w;
    int lfd;
    int wake[2]; /* the stop signal of the thread */
    pthread_t th;
    conn_t *conns[SHM_MAX_CONNS]; /* the thread's own */
    int n_conns;
};

static stria_status_t reply_error(conn_t *c, stria_status_t st)
{
    Stria__V1__ShmReply rep = STRIA__V1__SHM_REPLY__INIT;
    char msg[768];
    snprintf(msg, sizeof(msg), "%s", stria_error_msg()[0] ? stria_error_msg() : "refused");
    rep.status = st;
    rep.message = msg;
    return stria_shm_send(c->fd, &rep.base, -1);
}

/* OP_ARENA: a session's arena, the memfd passed along. */
static stria_status_t register_arena(conn_t *c, const Stria__V1__ShmRequest *req, int fd)
{
    stria_worker_t *w = c->srv->w;
    stria_status_t st = STRIA_OK;
    pthread_mutex_lock(&w->lock); /* this worker's id once registered (0 before) */
    uint64_t me = w->registered ? w->worker_id : 0;
    pthread_mutex_unlock(&w->lock);
    if (c->arena)
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
        return reply_error(c, st);
    c->arena = true;
    c->job_id = req->job_id;
    c->rank = req->rank;
    Stria__V1__ShmReply rep = STRIA__V1__SHM_REPLY__INIT;
    rep.size = req->arena_size;
    return stria_shm_send(c->fd, &rep.base, -1);
}

/* Serves one request of connection c (readable); false once the
 * connection is over (closed by the client, or a request it got wrong). */
static bool serve_one(conn_t *c)
{
    ProtobufCMessage *msg = NULL;
    int fd = -1;
    stria_status_t st = stria_shm_recv(c->fd, &stria__v1__shm_request__descriptor, 0, &msg, &fd);
    if (st != STRIA_OK) {
        if (fd >= 0)
            close(fd);
        return false;
    }
    const Stria__V1__ShmRequest *req = (const Stria__V1__ShmRequest *)msg;
    switch (req->op) {
    case STRIA__V1__SHM_REQUEST__OP__OP_ARENA: /* mapped or refused: the descriptor goes */
        st = register_arena(c, req, fd);
        break;
    default:
        st = reply_error(
            c, stria_error_set(STRIA_ERR_INVALID_ARG, "unknown request %d", (int)req->op));
    }
    if (fd >= 0) /* only an arena's is kept, mapped */
        close(fd);
    protobuf_c_message_free_unpacked(msg, NULL);
    return st == STRIA_OK;
}

/* Closes connection i: its arena, if any, goes from its session. */
static void conn_close(stria__wshm_srv_t *srv, int i)
{
    conn_t *c = srv->conns[i];
    if (c->arena)
        stria__wsess_arena_closed(srv->w, c->job_id, c->rank, (int)c->pid);
    close(c->fd);
    free(c);
    srv->conns[i] = srv->conns[--srv->n_conns];
}

static void accept_one(stria__wshm_srv_t *srv)
{
    int fd = accept4(srv->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0)
        return;
    struct ucred cred = {0};
    socklen_t cl = sizeof(cred);
    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl);
    bool full = srv->n_conns >= SHM_MAX_CONNS;
    conn_t *c = full ? NULL : calloc(1, sizeof(*c));
    if (c == NULL) {
        stria_log_warn("shared-memory socket: refusing client pid %d: %s", (int)cred.pid,
                       full ? "too many connections" : "out of memory");
        close(fd);
        return;
    }
    c->srv = srv;
    c->fd = fd;
    c->pid = cred.pid;
    srv->conns[srv->n_conns++] = c;
}

static void *serve_main(void *arg)
{
    stria__wshm_srv_t *srv = arg;
    struct pollfd p[SHM_MAX_CONNS + 2];
    for (;;) {
        int n = srv->n_conns;
        p[0] = (struct pollfd){.fd = srv->wake[0], .events = POLLIN};
        p[1] = (struct pollfd){.fd = srv->lfd, .events = POLLIN};
        for (int i = 0; i < n; i++)
            p[i + 2] = (struct pollfd){.fd = srv->conns[i]->fd, .events = POLLIN};
        int rc = poll(p, (nfds_t)(n + 2), -1);
        if (rc < 0 && errno != EINTR)
            break;
        if (rc <= 0)
            continue;
        if (p[0].revents != 0)
            break;
        for (int i = n - 1; i >= 0; i--) /* from the end: a closed one takes the last's place */
            if (p[i + 2].revents != 0 && !serve_one(srv->conns[i]))
                conn_close(srv, i);
        if (p[1].revents & POLLIN)
            accept_one(srv);
    }
    return NULL;
}

stria_status_t stria__wshm_start(stria_worker_t *w, const char *dir)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int n = snprintf(a.sun_path, sizeof(a.sun_path), "%s/stria-worker-%u.sock", dir,
                     (unsigned)stria_rpc_server_port(w->server));
    if (n < 0 || (size_t)n >= sizeof(a.sun_path))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "runtime directory '%s': the socket path in it would be longer "
                               "than %zu bytes",
                               dir, sizeof(a.sun_path) - 1);
    stria__wshm_srv_t *srv = calloc(1, sizeof(*srv));
    if (srv == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    srv->w = w;
    srv->wake[0] = srv->wake[1] = -1;
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
    if (st == STRIA_OK && pthread_create(&srv->th, NULL, serve_main, srv) != 0)
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
        free(srv);
        return st;
    }
    snprintf(w->shm_socket, sizeof(w->shm_socket), "%s", a.sun_path);
    w->shm = srv;
    return STRIA_OK;
}

void stria__wshm_stop(stria_worker_t *w)
{
    stria__wshm_srv_t *srv = w->shm;
    if (srv == NULL)
        return;
    (void)!write(srv->wake[1], "x", 1);
    pthread_join(srv->th, NULL);
    close(srv->lfd);
    unlink(w->shm_socket);
    while (srv->n_conns > 0)
        conn_close(srv, srv->n_conns - 1);
    close(srv->wake[0]);
    close(srv->wake[1]);
    free(srv);
    w->shm = NULL;
}
