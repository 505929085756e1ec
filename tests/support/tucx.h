/* Test-only: what the UCX ring test programs (ucx_ring_rank, the ring's
 * members; ucx_ring_attacker, its attacker) set up alike: their options,
 * read from a table, and the ring key of a --key-seed. No Criterion here. */
#ifndef STRIA_TEST_TUCX_H
#define STRIA_TEST_TUCX_H

#include <stdbool.h>
#include <stdint.h>

#include "stria_auth.h"

typedef enum {
    TUCX_INT,    /* int, atoi() */
    TUCX_U64,    /* uint64_t, strtoull(.., 0) */
    TUCX_SIZE,   /* size_t, strtoull(.., 0) */
    TUCX_DOUBLE, /* double, atof() */
    TUCX_STR,    /* const char *, the argument itself */
    TUCX_FLAG,   /* bool, set by the option alone */
} tucx_kind_t;

typedef struct {
    const char *name; /* --name */
    tucx_kind_t kind;
    void *dst;
} tucx_opt_t;

/* Reads --name value (or --name=value; --name alone for a flag) for each
 * option of the table (ended by a NULL name) into its destination. Returns
 * false at an option not in the table or one without its value. */
bool tucx_parse(int argc, char **argv, const tucx_opt_t *opts);

/* The ring key --key-seed N stands for (every rank of a ring, and the
 * attacker that knows it, make the same). */
void tucx_key_of_seed(int seed, uint8_t key[STRIA_AUTH_KEY_BYTES]);

#endif
