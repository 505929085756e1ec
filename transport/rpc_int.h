/* Internals of the RPC layer shared by its server and client: the frame
 * codec and the budgeted unpack arena. */
#ifndef STRIA_RPC_INT_H
#define STRIA_RPC_INT_H

#include "stria_rpc.h"

/* Unpacking untrusted protobuf: every allocation comes from this arena and
 * counts against a byte budget, so a small message that expands (many empty
 * repeated sub-messages) cannot exhaust memory. Nothing is freed piecemeal;
 * stria__rpc_arena_destroy() frees the lot. */
typedef struct stria__rpc_arena {
    ProtobufCAllocator allocator; /* handed to protobuf-c; allocator_data = arena */
    size_t budget;
    size_t used;
    bool refused; /* an allocation was refused for the budget */
    struct stria__rpc_chunk *chunks;
} stria__rpc_arena_t;

/* Unpacked bytes may grow by this factor (plus a floor) before the budget
 * refuses: enough for any legitimate message of stria.proto. */
#define STRIA__RPC_ARENA_FACTOR 96
#define STRIA__RPC_ARENA_FLOOR  (256u << 10)
#define STRIA__RPC_ARENA_MAX    ((size_t)256 << 20)

stria__rpc_arena_t *stria__rpc_arena_create(size_t pb_len);
void stria__rpc_arena_destroy(stria__rpc_arena_t *arena);

/* Unpacks `len` bytes as `desc` into an arena. Returns NULL (with
 * stria_error_set(STRIA_ERR_FORMAT, ...)) when the bytes are not a valid
 * message or exceed the budget. */
ProtobufCMessage *stria__rpc_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                                    size_t len, stria__rpc_arena_t *arena);

/* Builds a frame: header then the packed message (payload not included).
 * Returns a malloc'd buffer of *len_out bytes, or NULL when out of memory. */
uint8_t *stria__rpc_frame_build(const stria_rpc_header_t *header, const ProtobufCMessage *msg,
                                size_t *len_out);

/* Packs an RpcError frame. */
/* An error frame whose RpcError says whether the failure is retryable. */
uint8_t *stria__rpc_error_frame_r(uint64_t request_id, uint32_t method, uint16_t flags,
                                  stria_status_t status, const char *message, bool retryable,
                                  size_t *len_out);
uint8_t *stria__rpc_error_frame(uint64_t request_id, uint32_t method, uint16_t flags,
                                stria_status_t status, const char *message, size_t *len_out);

/* A copy of s, or NULL when s is NULL or empty (no credential). */
char *stria__rpc_strdup_or_null(const char *s);

/* The checks a client and a server make of their ends (`who` names the end
 * in the message): `service` a service descriptor, `address` a host:port,
 * split into host[host_len] and *port (host NULL: only checked). */
stria_status_t stria__rpc_endpoint(const ProtobufCServiceDescriptor *service, const char *address,
                                   const char *who, char *host, size_t host_len, uint16_t *port);

#endif /* STRIA_RPC_INT_H */
