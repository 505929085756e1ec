/* The scratch list replies are built from: the nested messages of a reply
 * (coord_reply.c) live here until it is serialised, then go in one free.
 * Everything runs on the RPC loop thread. */
#include "coord_int.h"

#include <stdlib.h>

void *stria__scratch_alloc(stria__scratch_t *b, size_t n)
{
    stria__scratch_chunk_t *c = calloc(1, sizeof(*c) + n);
    if (c == NULL) {
        b->oom = true;
        return NULL;
    }
    c->h.next = b->chunks;
    b->chunks = c;
    return c + 1;
}

void stria__scratch_free(stria__scratch_t *b)
{
    while (b->chunks != NULL) {
        stria__scratch_chunk_t *next = b->chunks->h.next;
        free(b->chunks);
        b->chunks = next;
    }
}
