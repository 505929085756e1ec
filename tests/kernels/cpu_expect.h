/* Which SIMD variants of the kernels this CPU must run, decided by the tests
 * themselves from the CPU's feature flags, not by asking the kernels: a
 * variant that wrongly calls itself unavailable (or drops out of the table)
 * must fail the suites instead of being skipped in silence. */
#ifndef STRIA_TEST_CPU_EXPECT_H
#define STRIA_TEST_CPU_EXPECT_H

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

/* Fills names (at least 4 entries) with the variants this CPU supports, NULL
 * terminated; returns how many. */
static inline size_t cpu_expected_simd(const char **names)
{
    size_t n = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        names[n++] = "avx2";
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma")) {
        names[n++] = "avx512-nobf16";
        names[n++] = "avx512";
    }
#endif
    names[n] = NULL;
    return n;
}

/* Whether `name` is in the NULL-terminated list. */
static inline bool cpu_name_in(const char *const *names, const char *name)
{
    for (size_t i = 0; names[i] != NULL; i++)
        if (strcmp(names[i], name) == 0)
            return true;
    return false;
}

#endif
