/* Test-only: the assertion of the leak checks, plain programs (LeakSanitizer
 * does not fail a Criterion test; in the sanitizer build a leak makes the
 * program exit non-zero). No Criterion here. */
#ifndef STRIA_TEST_TLEAK_H
#define STRIA_TEST_TLEAK_H

#include <stdbool.h>

typedef struct {
    const char *prog; /* first in every message */
    int rank;         /* >= 0: "rank N: " after it (a program of several processes) */
    bool fatal;       /* exit(1) at the first failure; else count it in failures */
    bool error_msg;   /* append stria_error_msg() */
    int failures;
} tleak_t;

/* The program's settings (main() sets them; default: "leakcheck", fatal,
 * with the error message). */
extern tleak_t tleak;

/* Reports a failed check at `line` (then exits or counts, as set). */
void tleak_fail(int line, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            tleak_fail(__LINE__, __VA_ARGS__);                                                     \
    } while (0)

#endif
