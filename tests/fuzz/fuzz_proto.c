/* Fuzz target: decoding protobuf messages of stria.proto with the RPC
 * layer's budgeted arena (stria__rpc_unpack), for every message type: those
 * of both services' methods, the hello and the error, and every message
 * they contain. The first byte picks the type, the rest is the message. A
 * message that decodes packs to bytes that decode again and pack the same;
 * the arena never grants more than its budget. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "proto_types.h"
#include "rpc_int.h"

static fuzz_types_t types;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    stria_log_set_level(STRIA_LOG_ERROR);
    if (fuzz_types_init(&types) != 0)
        fuzz_fail("more than %d message types", FUZZ_MAX_TYPES);
#ifdef STRIA_PROTO_N_MESSAGES
    /* every message declared in stria.proto is reached (none is left out) */
    if (types.n != STRIA_PROTO_N_MESSAGES)
        fuzz_fail("reached %zu message types, stria.proto declares %d", types.n,
                  STRIA_PROTO_N_MESSAGES);
#endif
    return 0;
}

/* Whether a message or one it contains kept unknown fields. protobuf-c
 * (1.4) accepts a tag of field number 0 written in two bytes as an unknown
 * field and packs it back as bytes it refuses: only messages without
 * unknown fields must round-trip (stria never sends a decoded message on). */
static bool has_unknown(const ProtobufCMessage *m)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    if (m->n_unknown_fields > 0)
        return true;
    for (unsigned f = 0; f < d->n_fields; f++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[f];
        const char *p = (const char *)m + fd->offset;
        if (fd->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)((const char *)m + fd->quantifier_offset);
            ProtobufCMessage *const *arr = *(ProtobufCMessage *const *const *)p;
            for (size_t i = 0; i < n; i++)
                if (has_unknown(arr[i]))
                    return true;
        } else if (*(ProtobufCMessage *const *)p != NULL &&
                   has_unknown(*(ProtobufCMessage *const *)p)) {
            return true;
        }
    }
    return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const ProtobufCMessageDescriptor *d = types.d[data[0] % types.n];
    data++;
    size--;
    stria__rpc_arena_t *arena = stria__rpc_arena_create(size);
    if (arena == NULL)
        fuzz_fail("out of memory");
    ProtobufCMessage *msg = stria__rpc_unpack(d, data, size, arena);
    if (arena->used > arena->budget)
        fuzz_fail("%s: arena used %zu of a %zu budget", d->name, arena->used, arena->budget);
    if (msg != NULL && (msg->descriptor != d || !protobuf_c_message_check(msg)))
        fuzz_fail("%s decoded into an invalid message", d->name);
    if (msg != NULL && !has_unknown(msg)) {
        size_t n = protobuf_c_message_get_packed_size(msg);
        uint8_t *a = malloc(n + 1), *b = NULL;
        if (a == NULL || protobuf_c_message_pack(msg, a) != n)
            fuzz_fail("%s: pack size differs from its packed size", d->name);
        stria__rpc_arena_t *arena2 = stria__rpc_arena_create(size); /* the same budget */
        ProtobufCMessage *again = stria__rpc_unpack(d, a, n, arena2);
        if (again == NULL)
            fuzz_fail("%s: its own packing (%zu bytes) does not decode", d->name, n);
        size_t n2 = protobuf_c_message_get_packed_size(again);
        b = malloc(n2 + 1);
        if (b == NULL || n2 != n || protobuf_c_message_pack(again, b) != n || memcmp(a, b, n) != 0)
            fuzz_fail("%s: packing is not stable", d->name);
        free(a);
        free(b);
        stria__rpc_arena_destroy(arena2);
    }
    stria__rpc_arena_destroy(arena);
    return 0;
}
