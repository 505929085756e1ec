/* Which SIMD variants of the kernels this CPU must run, decided by the tests
 * themselves from the CPU's feature flags, not by asking the kernels: a
 * variant that wrongly calls itself unavailable (or drops out of the table)
 * must fail the suites instead of being skipped in silence. */
#ifndef STRIA_TEST_CPU_EXPECT_H
#define STRIA_TEST_CPU_EXPECT_H

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* Room for cpu_expected_simd()'s names. */
#define CPU_EXPECT_MAX 8

/* Fills names (CPU_EXPECT_MAX entries) with the variants this CPU supports,
 * NULL terminated; returns how many. amx: AVX512-BF16, AMX-BF16 and AMX-TILE
 * by CPUID, and the kernel grants this process the tile state. */
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
        unsigned a, b, c, d;
        if (__builtin_cpu_supports("avx512bf16") && __get_cpuid_count(7, 0, &a, &b, &c, &d) &&
            (d >> 22 & 1u) && (d >> 24 & 1u) && syscall(SYS_arch_prctl, 0x1023, 18) == 0)
            names[n++] = "amx";
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
