/* The message types of stria.proto, in the order the proto fuzz target
 * numbers them (its first input byte): hello, reply, error, then each
 * method's input and output of both services, each followed depth-first by
 * the messages it contains, then the shared-memory socket's packets. Shared by fuzz_proto.c and the
 * seed generator. */
#ifndef STRIA_FUZZ_PROTO_TYPES_H
#define STRIA_FUZZ_PROTO_TYPES_H

#include <stddef.h>

#include "stria.pb-c.h"

#define FUZZ_MAX_TYPES 128

typedef struct {
    const ProtobufCMessageDescriptor *d[FUZZ_MAX_TYPES];
    size_t n;
} fuzz_types_t;

static inline int fuzz_types_add(fuzz_types_t *t, const ProtobufCMessageDescriptor *d)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->d[i] == d)
            return 0;
    if (t->n == FUZZ_MAX_TYPES)
        return -1;
    t->d[t->n++] = d;
    for (unsigned f = 0; f < d->n_fields; f++)
        if (d->fields[f].type == PROTOBUF_C_TYPE_MESSAGE &&
            fuzz_types_add(t, d->fields[f].descriptor) != 0)
            return -1;
    return 0;
}

static inline int fuzz_types_init(fuzz_types_t *t)
{
    static const ProtobufCServiceDescriptor *const services[] = {
        &stria__v1__coordinator__descriptor, &stria__v1__worker__descriptor};
    t->n = 0;
    if (fuzz_types_add(t, &stria__v1__hello_request__descriptor) != 0 ||
        fuzz_types_add(t, &stria__v1__hello_reply__descriptor) != 0 ||
        fuzz_types_add(t, &stria__v1__rpc_error__descriptor) != 0)
        return -1;
    for (size_t s = 0; s < sizeof(services) / sizeof(services[0]); s++)
        for (unsigned m = 0; m < services[s]->n_methods; m++)
            if (fuzz_types_add(t, services[s]->methods[m].input) != 0 ||
                fuzz_types_add(t, services[s]->methods[m].output) != 0)
                return -1;
    /* the shared-memory socket's packets (no RPC method) */
    if (fuzz_types_add(t, &stria__v1__shm_request__descriptor) != 0 ||
        fuzz_types_add(t, &stria__v1__shm_reply__descriptor) != 0)
        return -1;
    return 0;
}

/* The index of a type, or -1. */
static inline int fuzz_types_index(const fuzz_types_t *t, const ProtobufCMessageDescriptor *d)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->d[i] == d)
            return (int)i;
    return -1;
}

#endif
