/* libstria: the shared-memory path. A rank whose worker is on this host
 * attaches to the job's rank through the worker's Unix socket (the job's
 * secret), maps the memfd of the rank's tensors, writes inputs and reads
 * outputs there, and commits each input it wrote. */
#include "client_int.h"

#include <fcntl.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14; older kernels refuse it (EINVAL) */
#endif

/* What the rank's tensor must look like (rows and bytes per token). */
static void stria__expected(const stria_job_t *job, stria_tensor_id_t t, uint64_t *outer,
                            uint64_t *row)
{
    bool kv =
        t == STRIA_TENSOR_K || t == STRIA_TENSOR_V || t == STRIA_TENSOR_DK || t == STRIA_TENSOR_DV;
    *outer = (uint64_t)job->spec.batch * (t == STRIA_TENSOR_LSE ? (uint64_t)job->spec.heads : 1);
    *row = t == STRIA_TENSOR_LSE
               ? 4
               : (uint64_t)stria__row_bytes(job, kv ? job->spec.kv_heads : job->spec.heads);
}

/* Checks the worker's layout against the job and the mapping's size. */
static stria_status_t stria__check_layout(const stria_job_t *job, const stria__rank_t *r,
                                          const Stria__V1__ShmReply *rep, stria__shm_t *shm)
{
    bool seen[STRIA__N_TENSORS + 1] = {false};
    if (rep->tokens != (uint64_t)r->tokens)
        return stria_error_set(STRIA_ERR_PROTOCOL, "the worker's rank holds %llu tokens, not %lld",
                               (unsigned long long)rep->tokens, (long long)r->tokens);
    for (size_t i = 0; i < rep->n_tensors; i++) {
        const Stria__V1__ShmTensor *x = rep->tensors[i];
        uint64_t outer, row;
        if (x->tensor < 1 || x->tensor > STRIA__N_TENSORS)
            return stria_error_set(STRIA_ERR_PROTOCOL, "the worker names tensor %d",
                                   (int)x->tensor);
        stria__expected(job, (stria_tensor_id_t)x->tensor, &outer, &row);
        uint64_t used = (uint64_t)r->tokens * row; /* > 0 */
        uint64_t room = x->offset <= rep->size ? rep->size - x->offset : 0;
        if (x->outer != outer || x->row_bytes != row || x->outer_stride < used || used > room ||
            (outer > 1 && outer - 1 > (room - used) / x->outer_stride))
            return stria_error_set(STRIA_ERR_PROTOCOL,
                                   "the worker's tensor %d (%llu rows of %llu bytes, %llu apart, "
                                   "at %llu) does not fit the job or its %llu-byte memory",
                                   (int)x->tensor, (unsigned long long)x->outer,
                                   (unsigned long long)x->row_bytes,
                                   (unsigned long long)x->outer_stride,
                                   (unsigned long long)x->offset, (unsigned long long)rep->size);
        seen[x->tensor] = true;
        shm->t[x->tensor] = (stria__shm_tensor_t){x->offset, x->outer, x->outer_stride, row};
    }
    for (int t = 1; t <= STRIA__N_TENSORS; t++)
        if (!seen[t])
            return stria_error_set(STRIA_ERR_PROTOCOL, "the worker did not place tensor %d", t);
    return STRIA_OK;
}

/* One request and its reply; a reply with an error status becomes ours. */
static stria_status_t stria__shm_call(stria_job_t *job, int sock, const Stria__V1__ShmRequest *req,
                                      Stria__V1__ShmReply **rep_out, int *fd_out)
{
    ProtobufCMessage *msg = NULL;
    int fd = -1;
    stria_status_t st = stria_shm_send(sock, &req->base, -1);
    if (st == STRIA_OK)
        st = stria_shm_recv(sock, &stria__v1__shm_reply__descriptor,
                            job->client->params.rpc_timeout_s, &msg, &fd);
    if (st != STRIA_OK)
        return st;
    Stria__V1__ShmReply *rep = (Stria__V1__ShmReply *)msg;
    if (rep->status < 0) {
        st = stria_error_set((stria_status_t)rep->status, "%s", rep->message);
        protobuf_c_message_free_unpacked(msg, NULL);
        if (fd >= 0)
            close(fd);
        return st;
    }
    *rep_out = rep;
    if (fd_out != NULL)
        *fd_out = fd;
    else if (fd >= 0)
        close(fd);
    return STRIA_OK;
}

/* A new mapping of a rank whose job was replaced takes the place of the old
 * one (same size and layout: same spec and rank): the old bytes (the
 * inputs the caller wrote in place) are copied in, and the new memory is
 * mapped at the old address, so the pointers the caller holds
 * (stria_job_shard_buffer()) are the new job's buffers. */
static void stria__shm_adopt(stria_job_t *job, const stria__rank_t *r, stria__shm_t *shm)
{
    for (size_t i = 0; i < job->n_retired; i++) {
        stria__shm_t *o = &job->retired[i].shm;
        if (job->retired[i].rank != r->rank || o->size != shm->size ||
            memcmp(o->t, shm->t, sizeof(o->t)) != 0)
            continue;
        memcpy(shm->base, o->base, shm->size);
        /* mremap moves the new mapping over the old one in one step; when it
         * fails, the old one stays (the caller's pointers with it) */
        void *at = mremap(shm->base, shm->size, shm->size, MREMAP_MAYMOVE | MREMAP_FIXED, o->base);
        if (at != o->base)
            return;
        close(o->fd);
        shm->base = at;
        job->retired[i] = job->retired[--job->n_retired];
        return;
    }
}

stria_status_t stria__shm_attach(stria_job_t *job, stria__rank_t *r)
{
    Stria__V1__ShmRequest req = STRIA__V1__SHM_REQUEST__INIT;
    Stria__V1__ShmReply *rep = NULL;
    stria__shm_t shm = {.sock = -1, .fd = -1};
    int fd = -1;
    stria_status_t st = stria_shm_connect(r->shm_socket, &shm.sock);
    if (st != STRIA_OK)
        return st;
    req.op = STRIA__V1__SHM_REQUEST__OP__OP_ATTACH;
    req.worker_id = r->worker_id;
    req.job_id = job->id;
    req.rank = (uint32_t)r->rank;
    req.secret.data = (uint8_t *)job->secret.bytes;
    req.secret.len = sizeof(job->secret.bytes);
    st = stria__shm_call(job, shm.sock, &req, &rep, &fd);
    if (st == STRIA_OK && fd < 0)
        st = stria_error_set(STRIA_ERR_PROTOCOL, "the worker passed no memory");
    if (st == STRIA_OK)
        st = stria__check_layout(job, r, rep, &shm);
    if (st == STRIA_OK) {
        shm.size = (size_t)rep->size;
        shm.base = mmap(NULL, shm.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (shm.base == MAP_FAILED) {
            shm.base = NULL;
            st = stria_error_set(STRIA_ERR_IO, "cannot map the worker's %zu bytes: %m", shm.size);
        }
    }
    if (st == STRIA_OK)
        shm.fd = fd; /* kept: inputs are written through it (stria__shm_write) */
    else if (fd >= 0)
        close(fd);
    if (rep != NULL)
        protobuf_c_message_free_unpacked(&rep->base, NULL);
    if (st != STRIA_OK) {
        stria__shm_detach(&shm);
        return stria_error_wrap(st, "%s", r->shm_socket);
    }
    stria__shm_adopt(job, r, &shm);
    r->shm = shm;
    return STRIA_OK;
}

stria_status_t stria__retired_check(const stria_job_t *job, const stria__rank_t *r, const void *p)
{
    for (size_t i = 0; i < job->n_retired; i++) {
        const stria__shm_t *o = &job->retired[i].shm;
        if (job->retired[i].rank == r->rank && (const char *)p >= (const char *)o->base &&
            (const char *)p < (const char *)o->base + o->size)
            return stria_error_set(STRIA_ERR_UNSUPPORTED,
                                   "job %llu rank %d: a buffer lies in the shared memory of the "
                                   "job this one replaced, which the new job's memory could not "
                                   "take over (the rank's new worker %s is reached over TCP, or "
                                   "the mapping failed): pass buffers of your own",
                                   (unsigned long long)job->id, r->rank, r->rpc_address);
    }
    return STRIA_OK;
}

stria_status_t stria__shm_commit(stria_job_t *job, stria__rank_t *r, stria_tensor_id_t t)
{
    Stria__V1__ShmRequest req = STRIA__V1__SHM_REQUEST__INIT;
    Stria__V1__ShmReply *rep = NULL;
    req.op = STRIA__V1__SHM_REQUEST__OP__OP_COMMIT;
    req.tensor = (Stria__V1__Tensor)t;
    stria_status_t st = stria__shm_call(job, r->shm.sock, &req, &rep, NULL);
    if (st != STRIA_OK)
        return st;
    protobuf_c_message_free_unpacked(&rep->base, NULL);
    return STRIA_OK;
}

void stria__shm_detach(stria__shm_t *shm)
{
    if (shm->base != NULL) { /* fd is valid with the mapping only */
        munmap(shm->base, shm->size);
        close(shm->fd);
    }
    if (shm->sock >= 0)
        close(shm->sock);
    shm->base = NULL;
    shm->fd = -1;
    shm->sock = -1;
}

/* Writing an input.
 *
 * The worker hands over a fresh memfd per job (a client maps only its own
 * job's bytes), with nothing allocated. Stores through the mapping would
 * fault each 4 KiB page in on its own, and the kernel would clear it before
 * the copy overwrites it: several times the cost of the copy. pwritev()
 * allocates each page and fills it with the caller's bytes in one step (a
 * page written whole needs no clearing) and maps nothing; the worker's
 * reads later map the pages 16 at a time (fault-around). Each row of the
 * shard is one iovec, adjacent rows merged; what pwritev() does not take
 * (an error) is copied through the mapping. */

#define STRIA__SHM_IOV 1024 /* IOV_MAX on Linux */

typedef struct {
    int fd;
    char *map;    /* the mapping of fd */
    uint64_t off; /* file offset of iov[0] */
    size_t len;   /* bytes of iov[0 .. n) */
    struct iovec iov[STRIA__SHM_IOV];
    int n;
} stria__shm_w_t;

static void stria__shm_flush(stria__shm_w_t *w)
{
    struct iovec *iov = w->iov;
    int n = w->n;
    uint64_t off = w->off;
    while (n > 0) {
        ssize_t got = pwritev(w->fd, iov, n, (off_t)off);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        off += (uint64_t)got;
        for (; n > 0 && (size_t)got >= iov->iov_len; iov++, n--)
            got -= (ssize_t)iov->iov_len;
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + got;
            iov->iov_len -= (size_t)got;
        }
    }
    for (; n > 0; iov++, n--) { /* what pwritev refused: through the mapping */
        memcpy(w->map + off, iov->iov_base, iov->iov_len);
        off += iov->iov_len;
    }
    w->off += w->len;
    w->len = 0;
    w->n = 0;
}

/* Appends len bytes at src, to be written at file offset `off`. */
static void stria__shm_add(stria__shm_w_t *w, uint64_t off, const char *src, size_t len)
{
    bool next = w->n > 0 && w->off + w->len == off; /* right after the last */
    if (next && (const char *)w->iov[w->n - 1].iov_base + w->iov[w->n - 1].iov_len == src) {
        w->iov[w->n - 1].iov_len += len;
        w->len += len;
        return;
    }
    if (w->n == STRIA__SHM_IOV || (w->n > 0 && !next))
        stria__shm_flush(w);
    if (w->n == 0)
        w->off = off;
    w->iov[w->n++] = (struct iovec){.iov_base = (void *)src, .iov_len = len};
    w->len += len;
}

void stria__shm_write(const stria_job_t *job, const stria__rank_t *r, stria_tensor_id_t t,
                      const void *src, bool full)
{
    const stria__shm_tensor_t *s = &r->shm.t[t];
    size_t row = (size_t)s->row_bytes;
    stria__shm_w_t w; /* 16 KiB of iovecs */
    w.fd = r->shm.fd;
    w.map = r->shm.base;
    w.n = 0;
    w.off = 0;
    w.len = 0;
    for (uint64_t o = 0; o < s->outer; o++) {
        uint64_t dst = s->offset + o * s->outer_stride;
        if (!full) { /* a compact shard: the rows of one outer index are adjacent */
            stria__shm_add(&w, dst, (const char *)src + o * (size_t)r->tokens * row,
                           (size_t)r->tokens * row);
            continue;
        }
        for (int64_t i = 0; i < r->tokens; i++) {
            int64_t pos = stria_layout_position(&job->layout, r->rank, i);
            stria__shm_add(&w, dst + (uint64_t)i * row,
                           (const char *)src + (size_t)((int64_t)o * job->spec.seq_len + pos) * row,
                           row);
        }
    }
    stria__shm_flush(&w);
}

void stria__shm_copy(const stria__rank_t *r, stria_tensor_id_t t, void *compact, bool to_shared)
{
    const stria__shm_tensor_t *s = &r->shm.t[t];
    char *shared = (char *)r->shm.base + s->offset;
    size_t used = (size_t)r->tokens * s->row_bytes;
    if (compact == shared)
        return; /* the caller wrote (or reads) it in place */
    if (to_shared) {
        stria__shm_write(NULL, r, t, compact, false);
        return;
    }
    for (uint64_t o = 0; o < s->outer; o++)
        memcpy((char *)compact + o * used, shared + o * s->outer_stride, used);
}

stria_status_t stria_job_shard_buffer(stria_job_t *job, int rank, stria_tensor_id_t tensor,
                                      stria_shard_buffer_t *out)
{
    if (job == NULL || out == NULL || rank < 0 || rank >= job->n_ranks || tensor < 1 ||
        tensor > STRIA__N_TENSORS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_job_shard_buffer: a NULL argument, rank %d or tensor %d out "
                               "of range",
                               rank, (int)tensor);
    if (out->struct_size < sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_shard_buffer_t: struct_size is %zu, not a size of this "
                               "struct: start from STRIA_SHARD_BUFFER_INIT",
                               out->struct_size);
    stria__rank_t *r = &job->ranks[rank];
    stria_status_t st = stria__rank_connect(job, r);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "job %llu rank %d (worker %s)", (unsigned long long)job->id,
                                rank, r->rpc_address);
    if (r->shm.sock < 0)
        return stria_error_set(STRIA_ERR_UNSUPPORTED,
                               "job %llu rank %d moves its tensors over TCP, without a shared "
                               "buffer: %s",
                               (unsigned long long)job->id, rank, r->shm_why);
    const stria__shm_tensor_t *s = &r->shm.t[tensor];
    out->data = (char *)r->shm.base + s->offset;
    out->outer = (int64_t)s->outer;
    out->tokens = r->tokens;
    out->row_bytes = (int64_t)s->row_bytes;
    out->outer_stride = (int64_t)s->outer_stride;
    return STRIA_OK;
}

stria_data_path_t stria_job_data_path(const stria_job_t *job, int rank)
{
    if (job == NULL || rank < 0 || rank >= job->n_ranks || !job->ranks[rank].shm_tried)
        return STRIA_DATA_PATH_AUTO;
    return job->ranks[rank].shm.sock >= 0 ? STRIA_DATA_PATH_SHM : STRIA_DATA_PATH_TCP;
}

/* ---- a session's arena ------------------------------------------------------- */

stria_status_t stria__shm_arena(stria_job_t *job, stria__rank_t *r, size_t size)
{
    Stria__V1__ShmRequest req = STRIA__V1__SHM_REQUEST__INIT;
    ProtobufCMessage *msg = NULL;
    stria__shm_t shm = {.sock = -1, .fd = -1};
    stria_status_t st = STRIA_OK;
    int passed = -1;
    int fd = memfd_create("stria-session-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return stria_error_set(STRIA_ERR_UNSUPPORTED, "memfd_create: %m");
    /* its pages allocated now (the worker refuses holes; shmem counts
     * pages allocated but never touched as holes, so the populating map
     * below touches them), then sealed: no one can shrink it under the
     * worker's mapping */
    if (ftruncate(fd, (off_t)size) != 0 || fallocate(fd, 0, 0, (off_t)size) != 0)
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "the session's %zu-byte arena: %m", size);
    else if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        st = stria_error_set(STRIA_ERR_UNSUPPORTED, "sealing the session's arena: %m");
    if (st == STRIA_OK) {
        shm.base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (shm.base == MAP_FAILED) {
            shm.base = NULL;
            st = stria_error_set(STRIA_ERR_NO_MEMORY, "mapping the session's arena: %m");
        }
    }
    if (st == STRIA_OK)
        st = stria_shm_connect(r->shm_socket, &shm.sock);
    req.op = STRIA__V1__SHM_REQUEST__OP__OP_ARENA;
    req.worker_id = r->worker_id;
    req.job_id = job->id;
    req.rank = (uint32_t)r->rank;
    req.secret.data = (uint8_t *)job->secret.bytes;
    req.secret.len = sizeof(job->secret.bytes);
    req.arena_size = size;
    if (st == STRIA_OK)
        st = stria_shm_send(shm.sock, &req.base, fd);
    if (st == STRIA_OK)
        st = stria_shm_recv(shm.sock, &stria__v1__shm_reply__descriptor,
                            job->client->params.rpc_timeout_s, &msg, &passed);
    if (passed >= 0) /* the worker passes none back */
        close(passed);
    if (st == STRIA_OK) {
        const Stria__V1__ShmReply *rep = (const Stria__V1__ShmReply *)msg;
        if (rep->status < 0)
            st = stria_error_set((stria_status_t)rep->status, "%s", rep->message);
        protobuf_c_message_free_unpacked(msg, NULL);
    }
    if (st != STRIA_OK) {
        if (shm.base != NULL)
            munmap(shm.base, size);
        if (shm.sock >= 0)
            close(shm.sock);
        close(fd);
        return stria_error_wrap(st, "%s", r->shm_socket);
    }
    shm.fd = fd;
    shm.size = size;
    r->shm = shm;
    return STRIA_OK;
}
