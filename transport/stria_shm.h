/*
 * stria local channel: protobuf messages over a Unix SOCK_SEQPACKET socket,
 * one message a packet, with an optional file descriptor passed along
 * (SCM_RIGHTS). The worker serves co-located clients on it: a client
 * registers its own memory with a session's rank, an arena (a sealed memfd
 * passed along), where that rank's calls then find their inputs and leave
 * their outputs (ShmRequest and ShmReply in proto/stria.proto).
 */
#ifndef STRIA_SHM_H
#define STRIA_SHM_H

#include <protobuf-c/protobuf-c.h>

#include "stria_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest message of the channel (its packets are no larger). */
#define STRIA_SHM_MAX_MSG (64u << 10)

/* Longest socket path (sockaddr_un.sun_path, with its NUL). */
#define STRIA_SHM_MAX_PATH 108

/* Sends `msg` as one packet, with `fd` attached when fd >= 0. Errors:
 * STRIA_ERR_INVALID_ARG (message larger than STRIA_SHM_MAX_MSG),
 * STRIA_ERR_CLOSED (the peer is gone), STRIA_ERR_IO. */
stria_status_t stria_shm_send(int sock, const ProtobufCMessage *msg, int fd);

/* Receives one packet and decodes it as a `desc` message; *msg_out is freed
 * with protobuf_c_message_free_unpacked(*msg_out, NULL). *fd_out is the
 * descriptor passed along (close-on-exec), or -1; extra descriptors are
 * closed. timeout_s <= 0 waits for ever. Errors: STRIA_ERR_CLOSED (the peer
 * closed), STRIA_ERR_TIMEOUT, STRIA_ERR_PROTOCOL (truncated or undecodable),
 * STRIA_ERR_IO. */
stria_status_t stria_shm_recv(int sock, const ProtobufCMessageDescriptor *desc, double timeout_s,
                              ProtobufCMessage **msg_out, int *fd_out);

/* Connects a SOCK_SEQPACKET socket to `path` (close-on-exec). Errors:
 * STRIA_ERR_INVALID_ARG (path too long), STRIA_ERR_IO (naming the path and
 * the reason). */
stria_status_t stria_shm_connect(const char *path, int *sock_out);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_SHM_H */
