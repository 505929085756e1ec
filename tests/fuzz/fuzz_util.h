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

/* Aborts with a message: a property of the target does not hold. */
void fuzz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#endif
