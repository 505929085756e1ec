#include "fuzz_util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int fuzz_memfd(const void *data, size_t size, char path[64])
{
    int fd = memfd_create("stria-fuzz", MFD_CLOEXEC);
    size_t done = 0;
    if (fd < 0)
        fuzz_fail("memfd_create failed");
    while (done < size) {
        ssize_t n = write(fd, (const char *)data + done, size - done);
        if (n <= 0)
            fuzz_fail("memfd write failed");
        done += (size_t)n;
    }
    snprintf(path, 64, "/proc/self/fd/%d", fd);
    return fd;
}

char *fuzz_strndup(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1);
    if (s == NULL)
        fuzz_fail("out of memory");
    if (size > 0)
        memcpy(s, data, size);
    s[size] = '\0';
    return s;
}

void fuzz_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz property violated: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}
