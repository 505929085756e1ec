/* The local channel: protobuf messages over Unix SOCK_SEQPACKET sockets,
 * with a descriptor passed along (see stria_shm.h). */
#include "stria_shm.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

stria_status_t stria_shm_send(int sock, const ProtobufCMessage *msg, int fd)
{
    uint8_t buf[STRIA_SHM_MAX_MSG];
    size_t len = protobuf_c_message_get_packed_size(msg);
    if (len > sizeof(buf))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "local channel: a %zu-byte message is over the %u-byte limit", len,
                               STRIA_SHM_MAX_MSG);
    protobuf_c_message_pack(msg, buf);
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&ctl, 0, sizeof(ctl));
        mh.msg_control = ctl.space;
        mh.msg_controllen = sizeof(ctl.space);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    for (;;) {
        ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL);
        if (n >= 0)
            return STRIA_OK;
        if (errno == EINTR)
            continue;
        if (errno == EPIPE || errno == ECONNRESET)
            return stria_error_set(STRIA_ERR_CLOSED, "local channel: the peer closed");
        return stria_error_set(STRIA_ERR_IO, "local channel: sendmsg: %s", strerror(errno));
    }
}

/* Closes every descriptor of a received control block but the first, which
 * it returns (-1: none). */
static int stria__shm_take_fd(struct msghdr *mh)
{
    int keep = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c != NULL; c = CMSG_NXTHDR(mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (keep < 0)
                keep = fd;
            else
                close(fd);
        }
    }
    return keep;
}

stria_status_t stria_shm_recv(int sock, const ProtobufCMessageDescriptor *desc, double timeout_s,
                              ProtobufCMessage **msg_out, int *fd_out)
{
    uint8_t *buf = malloc(STRIA_SHM_MAX_MSG);
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(4 * sizeof(int))];
    } ctl;
    stria_status_t st = STRIA_OK;
    ssize_t n;

    *msg_out = NULL;
    *fd_out = -1;
    if (buf == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "local channel: out of memory");
    double until = timeout_s > 0 ? stria_time_now() + timeout_s : 0;
    for (;;) {
        if (until > 0) {
            struct pollfd p = {.fd = sock, .events = POLLIN};
            double left = until - stria_time_now();
            int rc = left > 0 ? poll(&p, 1, (int)(left * 1000) + 1) : 0;
            if (rc < 0 && errno == EINTR)
                continue;
            if (rc == 0) {
                st = stria_error_set(STRIA_ERR_TIMEOUT, "local channel: no reply within %.3g s",
                                     timeout_s);
                goto out;
            }
        }
        struct iovec iov = {.iov_base = buf, .iov_len = STRIA_SHM_MAX_MSG};
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
                            .msg_control = ctl.space,
                            .msg_controllen = sizeof(ctl.space)};
        n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == ECONNRESET || errno == EPIPE)) {
            st = stria_error_set(STRIA_ERR_CLOSED, "local channel: the peer closed");
            goto out;
        }
        if (n < 0) {
            st = stria_error_set(STRIA_ERR_IO, "local channel: recvmsg: %s", strerror(errno));
            goto out;
        }
        int fd = stria__shm_take_fd(&mh);
        if (n == 0) {
            if (fd >= 0)
                close(fd);
            st = stria_error_set(STRIA_ERR_CLOSED, "local channel: the peer closed");
            goto out;
        }
        if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
            if (fd >= 0)
                close(fd);
            st = stria_error_set(STRIA_ERR_PROTOCOL,
                                 "local channel: a message over the %u-byte limit",
                                 STRIA_SHM_MAX_MSG);
            goto out;
        }
        *msg_out = protobuf_c_message_unpack(desc, NULL, (size_t)n, buf);
        if (*msg_out == NULL) {
            if (fd >= 0)
                close(fd);
            st = stria_error_set(STRIA_ERR_PROTOCOL,
                                 "local channel: a %zd-byte message that is "
                                 "no %s",
                                 n, desc->name);
            goto out;
        }
        *fd_out = fd;
        break;
    }
out:
    free(buf);
    return st;
}

stria_status_t stria_shm_connect(const char *path, int *sock_out)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(a.sun_path))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "local socket path '%s' is longer than %zu bytes", path,
                               sizeof(a.sun_path) - 1);
    memcpy(a.sun_path, path, strlen(path) + 1);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0)
        return stria_error_set(STRIA_ERR_IO, "socket(AF_UNIX): %s", strerror(errno));
    if (connect(s, (struct sockaddr *)&a, sizeof(a)) != 0) {
        int e = errno;
        close(s);
        return stria_error_set(STRIA_ERR_IO, "cannot connect to %s: %s", path, strerror(e));
    }
    *sock_out = s;
    return STRIA_OK;
}
