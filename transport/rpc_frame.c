/* The RPC frame codec: headers, frames and error frames, the budgeted
 * protobuf arena for untrusted input, and tokens. Shared by the server
 * (rpc_server.c) and the client (rpc_client.c); no libuv here. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rpc_int.h"
#include "stria.pb-c.h"

/* ---- frames ------------------------------------------------------------ */

void stria_rpc_header_encode(const stria_rpc_header_t *h, uint8_t out[STRIA_RPC_HEADER_SIZE])
{
    stria_put_le32(out + 0, h->magic);
    stria_put_le16(out + 4, h->version);
    stria_put_le16(out + 6, h->flags);
    stria_put_le32(out + 8, h->method);
    stria_put_le32(out + 12, (uint32_t)h->status);
    stria_put_le64(out + 16, h->request_id);
    stria_put_le32(out + 24, h->pb_len);
    stria_put_le32(out + 28, h->timeout_ms);
    stria_put_le64(out + 32, h->payload_len);
}

void stria_rpc_header_decode(const uint8_t in[STRIA_RPC_HEADER_SIZE], stria_rpc_header_t *h)
{
    h->magic = stria_get_le32(in + 0);
    h->version = stria_get_le16(in + 4);
    h->flags = stria_get_le16(in + 6);
    h->method = stria_get_le32(in + 8);
    h->status = (int32_t)stria_get_le32(in + 12);
    h->request_id = stria_get_le64(in + 16);
    h->pb_len = stria_get_le32(in + 24);
    h->timeout_ms = stria_get_le32(in + 28);
    h->payload_len = stria_get_le64(in + 32);
}

uint8_t *stria__rpc_frame_build(const stria_rpc_header_t *header, const ProtobufCMessage *msg,
                                size_t *len_out)
{
    size_t pb = msg ? protobuf_c_message_get_packed_size(msg) : 0;
    stria_rpc_header_t h = *header;
    uint8_t *buf;

    if (pb > UINT32_MAX)
        return NULL;
    buf = malloc(STRIA_RPC_HEADER_SIZE + pb);
    if (buf == NULL)
        return NULL;
    h.pb_len = (uint32_t)pb;
    stria_rpc_header_encode(&h, buf);
    if (pb > 0)
        protobuf_c_message_pack(msg, buf + STRIA_RPC_HEADER_SIZE);
    *len_out = STRIA_RPC_HEADER_SIZE + pb;
    return buf;
}

uint8_t *stria__rpc_error_frame(uint64_t request_id, uint32_t method, uint16_t flags,
                                stria_status_t status, const char *message, size_t *len_out)
{
    return stria__rpc_error_frame_r(request_id, method, flags, status, message, false, len_out);
}

uint8_t *stria__rpc_error_frame_r(uint64_t request_id, uint32_t method, uint16_t flags,
                                  stria_status_t status, const char *message, bool retryable,
                                  size_t *len_out)
{
    Stria__V1__RpcError err = STRIA__V1__RPC_ERROR__INIT;
    stria_rpc_header_t h = {.magic = STRIA_RPC_MAGIC,
                            .version = STRIA_RPC_VERSION,
                            .flags = (uint16_t)(flags | STRIA_RPC_FLAG_REPLY),
                            .method = method,
                            .status = (int32_t)status,
                            .request_id = request_id};
    err.status = (int32_t)status;
    err.message = (char *)(message ? message : "");
    err.retryable = retryable;
    return stria__rpc_frame_build(&h, &err.base, len_out);
}

/* ---- helpers ----------------------------------------------------------- */

#define STRIA__TOKEN_MAX 4096

stria_status_t stria_rpc_token_read(const char *path, char **token_out)
{
    char buf[2 * STRIA__TOKEN_MAX + 2];
    size_t n, start = 0, end;
    FILE *f;
    char *tok;

    if (path == NULL || token_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "token file: NULL argument");
    f = fopen(path, "rb");
    if (f == NULL)
        return stria_error_set(STRIA_ERR_IO, "token file '%s': %s", path, strerror(errno));
    n = fread(buf, 1, sizeof(buf) - 1, f);
    if (ferror(f)) {
        fclose(f);
        return stria_error_set(STRIA_ERR_IO, "token file '%s': read failed", path);
    }
    fclose(f);
    buf[n] = '\0';
    for (end = 0; end < n && buf[end] != '\n' && buf[end] != '\r'; end++) {
    }
    if (end == n && n == sizeof(buf) - 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "token file '%s': first line too long", path);
    while (start < end && (buf[start] == ' ' || buf[start] == '\t'))
        start++;
    while (end > start && (buf[end - 1] == ' ' || buf[end - 1] == '\t'))
        end--;
    if (end == start)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "token file '%s': the token is empty", path);
    if (end - start > STRIA__TOKEN_MAX)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "token file '%s': the token is longer than %d characters", path,
                               STRIA__TOKEN_MAX);
    for (size_t i = start; i < end; i++) {
        unsigned char ch = (unsigned char)buf[i];
        if (ch < 0x20 || ch > 0x7e)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "token file '%s': the token has a non-printable character at "
                                   "offset %zu",
                                   path, i);
    }
    tok = malloc(end - start + 1);
    if (tok == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "token file '%s': out of memory", path);
    memcpy(tok, buf + start, end - start);
    tok[end - start] = '\0';
    *token_out = tok;
    return STRIA_OK;
}

bool stria_rpc_token_equal(const char *a, const char *b)
{
    size_t la, lb, n;
    volatile unsigned char acc = 0;

    a = a ? a : "";
    b = b ? b : "";
    la = strlen(a);
    lb = strlen(b);
    n = la > lb ? la : lb;
    /* Walk the longer length whatever the content; pad the shorter with 0
     * (never equal to a token byte, as strings end at the first 0). */
    for (size_t i = 0; i < n; i++) {
        unsigned char ca = i < la ? (unsigned char)a[i] : 0;
        unsigned char cb = i < lb ? (unsigned char)b[i] : 0;
        acc |= (unsigned char)(ca ^ cb);
    }
    return acc == 0 && la == lb;
}

char *stria__rpc_strdup_or_null(const char *s)
{
    return (s != NULL && s[0] != '\0') ? strdup(s) : NULL;
}

stria_status_t stria__rpc_endpoint(const ProtobufCServiceDescriptor *service, const char *address,
                                   const char *who, char *host, size_t host_len, uint16_t *port)
{
    if (service->magic != PROTOBUF_C__SERVICE_DESCRIPTOR_MAGIC)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: not a service descriptor", who);
    char h[256];
    uint16_t pt;
    if (host == NULL) /* only checked */
        return stria_addr_parse(address, h, sizeof(h), &pt);
    return stria_addr_parse(address, host, host_len, port);
}

/* ---- arena ------------------------------------------------------------- */

typedef struct stria__rpc_chunk {
    union {
        struct stria__rpc_chunk *next;
        max_align_t align;
    } h;
} stria__rpc_chunk_t;

static void *stria__arena_alloc(void *data, size_t size)
{
    stria__rpc_arena_t *arena = data;
    stria__rpc_chunk_t *chunk;
    size_t cost = size + sizeof(stria__rpc_chunk_t);

    if (size > arena->budget || cost > arena->budget - arena->used) {
        arena->refused = true;
        return NULL;
    }
    chunk = malloc(cost);
    if (chunk == NULL)
        return NULL;
    chunk->h.next = arena->chunks;
    arena->chunks = chunk;
    arena->used += cost;
    return chunk + 1;
}

static void stria__rpc_arena_free(void *data, void *ptr)
{
    /* Freed with the whole arena. */
    (void)data;
    (void)ptr;
}

stria__rpc_arena_t *stria__rpc_arena_create(size_t pb_len)
{
    stria__rpc_arena_t *arena = calloc(1, sizeof(*arena));
    size_t budget = STRIA__RPC_ARENA_FLOOR;

    if (arena == NULL)
        return NULL;
    if (pb_len > (STRIA__RPC_ARENA_MAX - budget) / STRIA__RPC_ARENA_FACTOR)
        budget = STRIA__RPC_ARENA_MAX;
    else
        budget += pb_len * STRIA__RPC_ARENA_FACTOR;
    arena->allocator.alloc = stria__arena_alloc;
    arena->allocator.free = stria__rpc_arena_free;
    arena->allocator.allocator_data = arena;
    arena->budget = budget;
    return arena;
}

void stria__rpc_arena_destroy(stria__rpc_arena_t *arena)
{
    if (arena == NULL)
        return;
    while (arena->chunks != NULL) {
        stria__rpc_chunk_t *next = arena->chunks->h.next;
        free(arena->chunks);
        arena->chunks = next;
    }
    free(arena);
}

ProtobufCMessage *stria__rpc_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                                    size_t len, stria__rpc_arena_t *arena)
{
    ProtobufCMessage *msg = protobuf_c_message_unpack(desc, &arena->allocator, len, data);
    if (msg == NULL) {
        if (arena->refused)
            stria_error_set(STRIA_ERR_FORMAT,
                            "%s of %zu bytes expands past the decoding budget of %zu bytes",
                            desc->name, len, arena->budget);
        else
            stria_error_set(STRIA_ERR_FORMAT, "malformed %s (%zu bytes)", desc->name, len);
    }
    return msg;
}
