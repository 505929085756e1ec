/* Fuzz target: configuration files (`name = value` lines read by --config,
 * common/opts.c) against a table with an option of every type, the way the
 * daemons read their configuration. The input is the file; a second part after
 * the first NUL byte (if any) is split at newlines into extra command-line
 * arguments, so flags and file meet as they do in the programs. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "stria_common.h"

static stria_status_t parse_even(const char *text, void *dst)
{
    char *end;
    long v = strtol(text, &end, 10);
    if (end == text || *end != '\0' || v % 2 != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "expected an even number");
    *(long *)dst = v;
    return STRIA_OK;
}

typedef struct {
    const char *s, *addr;
    int64_t i, bytes;
    double d, dur;
    bool b, flag, unflag;
    stria_int_list_t ints;
    stria_str_list_t strs;
    long even;
} fuzz_conf_t;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    stria_log_set_level(STRIA_LOG_ERROR);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_conf_t c;
    memset(&c, 0, sizeof(c));
    const stria_option_t opts[] = {
        {.name = "listen", .type = STRIA_OPT_ADDR, .dst = &c.addr, .dflt = "127.0.0.1:7400"},
        {.name = "name", .type = STRIA_OPT_STRING, .dst = &c.s},
        {.name = "count", .type = STRIA_OPT_INT, .dst = &c.i, .min = -5, .max = 1000},
        {.name = "memory", .type = STRIA_OPT_BYTES, .dst = &c.bytes, .min = 0, .max = 1e15},
        {.name = "ratio",
         .type = STRIA_OPT_DOUBLE,
         .dst = &c.d,
         .min = 0,
         .max = 1,
         .flags = STRIA_OPT_ABOVE_MIN},
        {.name = "period",
         .type = STRIA_OPT_DURATION,
         .dst = &c.dur,
         .dflt = "1",
         .min = 0.01,
         .max = 3600},
        {.name = "causal", .type = STRIA_OPT_BOOL, .dst = &c.b},
        {.name = "verbose", .type = STRIA_OPT_FLAG, .dst = &c.flag},
        {.name = "no-queue", .type = STRIA_OPT_UNFLAG, .dst = &c.unflag},
        {.name = "ranks",
         .type = STRIA_OPT_INTS,
         .dst = &c.ints,
         .min = 0,
         .max = 64,
         .max_items = 16},
        {.name = "peers", .type = STRIA_OPT_STRINGS, .dst = &c.strs},
        {.name = "even", .type = STRIA_OPT_CUSTOM, .dst = &c.even, .parse = parse_even},
        {.name = "secret", .type = STRIA_OPT_STRING, .dst = &c.s, .flags = STRIA_OPT_FLAG_ONLY},
        {0},
    };
    const stria_command_t root = {.name = "fuzz-config", .options = opts, .config = true};
    const uint8_t *nul = memchr(data, 0, size);
    size_t file_len = nul ? (size_t)(nul - data) : size;
    char path[64];
    int fd = fuzz_memfd(data, file_len, path);
    char *extra = nul ? fuzz_strndup(nul + 1, size - file_len - 1) : NULL;
    char *argv[40] = {"fuzz-config", "--config", path};
    int argc = 3;
    for (char *p = extra; p != NULL && argc < 39;) {
        char *nl = strchr(p, '\n');
        if (nl != NULL)
            *nl = '\0';
        argv[argc++] = p;
        p = nl ? nl + 1 : NULL;
    }
    argv[argc] = NULL;
    stria_cli_t cli;
    memset(&cli, 0, sizeof(cli));
    if (stria_cli_parse(&root, argc, argv, &cli) == STRIA_OK) {
        char host[256];
        uint16_t port;
        if (c.addr == NULL || stria_addr_parse(c.addr, host, sizeof(host), &port) != STRIA_OK)
            fuzz_fail("accepted a bad address");
        if (c.i < -5 || c.i > 1000 || c.ints.n > 16 || !(c.d >= 0 && c.d <= 1) ||
            !(c.dur >= 0.01 && c.dur <= 3600))
            fuzz_fail("accepted a value out of range");
        for (size_t k = 0; k < c.ints.n; k++)
            if (c.ints.v[k] < 0 || c.ints.v[k] > 64)
                fuzz_fail("accepted a list item out of range");
        for (size_t k = 0; k < c.strs.n; k++)
            if (c.strs.v[k][0] == '\0')
                fuzz_fail("accepted an empty list item");
        if (c.even % 2 != 0)
            fuzz_fail("custom parser bypassed");
    }
    stria_cli_free(&cli);
    free(extra);
    close(fd);
    return 0;
}
