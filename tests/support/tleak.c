#include "tleak.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "stria_common.h"

tleak_t tleak = {.prog = "leakcheck", .rank = -1, .fatal = true, .error_msg = true};

void tleak_fail(int line, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", tleak.prog);
    if (tleak.rank >= 0)
        fprintf(stderr, "rank %d: ", tleak.rank);
    fprintf(stderr, "line %d: ", line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (tleak.error_msg)
        fprintf(stderr, " (%s)", stria_error_msg());
    fprintf(stderr, "\n");
    tleak.failures++;
    if (tleak.fatal)
        exit(1);
}
