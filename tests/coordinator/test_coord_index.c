/* The coordinator's hash index (coord_index.c) against a plain table: random
 * puts, replacements, gets and deletions (the backward shift of deletion is
 * where such tables go wrong), growth, and keys that differ in one half only. */
#include <criterion/criterion.h>

#include <stdint.h>
#include <stdlib.h>

#include "coord_int.h"

#define N_KEYS 5000

Test(coord_index, matches_a_plain_table, .timeout = 60)
{
    static uint64_t ka[N_KEYS], kb[N_KEYS];
    static uintptr_t val[N_KEYS]; /* 0: absent */
    stria__index_t x;
    uint64_t s = 88172645463325252ull;
    size_t present = 0;

    stria__index_init(&x);
    for (size_t i = 0; i < N_KEYS; i++) {
        /* few distinct halves: many keys share a or b */
        ka[i] = i % 97;
        kb[i] = i / 97 + (i % 3 == 0 ? (1ull << 63) : 0);
    }
    for (int round = 0; round < 200000; round++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        size_t i = (size_t)(s % N_KEYS);
        switch ((s >> 32) % 4) {
        case 0:
        case 1: {
            uintptr_t v = (uintptr_t)round + 1;
            cr_assert_eq(stria__index_put(&x, ka[i], kb[i], (void *)v), STRIA_OK);
            present += val[i] == 0;
            val[i] = v;
            break;
        }
        case 2:
            stria__index_del(&x, ka[i], kb[i]);
            present -= val[i] != 0;
            val[i] = 0;
            break;
        default:
            cr_assert_eq((uintptr_t)stria__index_get(&x, ka[i], kb[i]), val[i], "key %zu", i);
        }
        cr_assert_eq(x.n, present);
        cr_assert_leq(2 * x.n, x.cap);
    }
    for (size_t i = 0; i < N_KEYS; i++)
        cr_assert_eq((uintptr_t)stria__index_get(&x, ka[i], kb[i]), val[i], "key %zu", i);
    cr_assert_null(stria__index_get(&x, 1000, 1000));
    stria__index_free(&x);
    cr_assert_null(stria__index_get(&x, 0, 0));
}

Test(coord_index, seeds_differ, .timeout = 10)
{
    stria__index_t a, b;
    stria__index_init(&a);
    stria__index_init(&b);
    cr_assert_neq(a.seed, b.seed, "two indexes drew the same seed");
}
