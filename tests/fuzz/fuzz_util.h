/* Shared by the fuzz targets of tests/fuzz: the libFuzzer entry points and
 * small helpers. A target defines LLVMFuzzerTestOneInput (and may define
 * LLVMFuzzerInitialize); built with clang's -fsanitize=fuzzer it is a
 * fuzzer, built with replay_main.c it replays files (ctest, every build). */
#ifndef STRIA_FUZZ_UTIL_H
#define STRIA_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* The bytes as an anonymous in-memory file: returns its descriptor (close it)
 * and writes a path that opens it ("/proc/self/fd/N") into path[64].
 * Aborts when the kernel refuses (not a finding of the target). */
int fuzz_memfd(const void *data, size_t size, char path[64]);

/* A NUL-terminated copy of the bytes (malloc'ed; free it). */
char *fuzz_strndup(const uint8_t *data, size_t size);

/* The fuzz build's random generator (common/auth.c, STRIA_FUZZ_UNSAFE_RANDOM)
 * is a fixed sequence of draws; this starts it over. A target that draws
 * (through the code it tests) calls it before each input, so that each
 * input meets the same server nonces, job ids and job secrets, which the
 * seeds (gen_seeds.c) answer. No-op in the other builds (real random bytes:
 * the replayed seeds stop at the first proof there). */
#ifdef STRIA_FUZZ_UNSAFE_RANDOM
void stria_auth_fuzz_reset(void);
#define fuzz_random_reset() stria_auth_fuzz_reset()
#else
#define fuzz_random_reset() ((void)0)
#endif

/* Aborts with a message: a property of the target does not hold. */
void fuzz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#endif
