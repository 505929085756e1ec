/* The coordinator's hash indexes: jobs and workers by id, and which rank a
 * worker holds in a job, so that a request finds what it names in constant
 * time whatever the size of the tables (a heartbeat names up to
 * STRIA_COORD_MAX_HEARTBEAT_JOBS jobs). Open addressing with linear probing
 * and backward-shift deletion; keys are pairs of 64-bit numbers hashed with a
 * seed drawn at start, so that nobody can choose ids that collide. */
#include "coord_int.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

static uint64_t stria__mix(uint64_t x)
{
    /* splitmix64's finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static size_t stria__slot_of(const stria__index_t *x, uint64_t a, uint64_t b)
{
    return (size_t)(stria__mix(a ^ x->seed) ^ stria__mix(b + 0x9e3779b97f4a7c15ull + x->seed)) &
           (x->cap - 1);
}

void stria__index_init(stria__index_t *x)
{
    memset(x, 0, sizeof(*x));
    if (getrandom(&x->seed, sizeof(x->seed), GRND_NONBLOCK) != (ssize_t)sizeof(x->seed)) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        x->seed =
            stria__mix((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)(uintptr_t)x);
    }
}

void stria__index_free(stria__index_t *x)
{
    free(x->slots);
    x->slots = NULL;
    x->cap = x->n = 0;
}

static stria__slot_t *stria__cindex_find(const stria__index_t *x, uint64_t a, uint64_t b)
{
    if (x->cap == 0)
        return NULL;
    for (size_t i = stria__slot_of(x, a, b);; i = (i + 1) & (x->cap - 1)) {
        stria__slot_t *s = &x->slots[i];
        if (s->v == NULL)
            return NULL;
        if (s->a == a && s->b == b)
            return s;
    }
}

void *stria__index_get(const stria__index_t *x, uint64_t a, uint64_t b)
{
    stria__slot_t *s = stria__cindex_find(x, a, b);
    return s ? s->v : NULL;
}

static void stria__insert(stria__index_t *x, uint64_t a, uint64_t b, void *v)
{
    size_t i = stria__slot_of(x, a, b);
    while (x->slots[i].v != NULL)
        i = (i + 1) & (x->cap - 1);
    x->slots[i] = (stria__slot_t){.a = a, .b = b, .v = v};
    x->n++;
}

stria_status_t stria__index_put(stria__index_t *x, uint64_t a, uint64_t b, void *v)
{
    stria__slot_t *s = stria__cindex_find(x, a, b);
    if (s != NULL) {
        s->v = v;
        return STRIA_OK;
    }
    if (2 * (x->n + 1) > x->cap) { /* at most half full */
        size_t cap = x->cap ? 2 * x->cap : 64;
        stria__index_t grown = *x;
        grown.slots = calloc(cap, sizeof(*grown.slots));
        if (grown.slots == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "coordinator: out of memory");
        grown.cap = cap;
        grown.n = 0;
        for (size_t i = 0; i < x->cap; i++)
            if (x->slots[i].v != NULL)
                stria__insert(&grown, x->slots[i].a, x->slots[i].b, x->slots[i].v);
        free(x->slots);
        *x = grown;
    }
    stria__insert(x, a, b, v);
    return STRIA_OK;
}

void stria__index_del(stria__index_t *x, uint64_t a, uint64_t b)
{
    stria__slot_t *s = stria__cindex_find(x, a, b);
    size_t hole, i;
    if (s == NULL)
        return;
    hole = (size_t)(s - x->slots);
    x->slots[hole].v = NULL;
    x->n--;
    /* move back every entry of the run after the hole that may sit in it */
    for (i = (hole + 1) & (x->cap - 1); x->slots[i].v != NULL; i = (i + 1) & (x->cap - 1)) {
        size_t home = stria__slot_of(x, x->slots[i].a, x->slots[i].b);
        /* the entry stays when its home lies cyclically in (hole, i] */
        bool stays = hole <= i ? (home > hole && home <= i) : (home > hole || home <= i);
        if (stays)
            continue;
        x->slots[hole] = x->slots[i];
        x->slots[i].v = NULL;
        hole = i;
    }
}
