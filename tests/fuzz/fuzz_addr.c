/* Fuzz target: the parsers of addresses, tokens, sizes and durations that
 * read flags, configuration files and peers' registrations:
 * stria_addr_parse (HOST:PORT, [v6]:PORT), stria_rpc_token_read (a token
 * file), stria_rpc_token_equal, stria_parse_bytes and stria_parse_duration.
 * The first byte picks the parser. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "stria_rpc.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    stria_log_set_level(STRIA_LOG_ERROR);
    return 0;
}

static void fuzz_address(const char *s)
{
    char host[64];
    uint16_t port = 0;
    if (stria_addr_parse(s, host, sizeof(host), &port) != STRIA_OK)
        return;
    size_t hl = strlen(host);
    if (hl == 0 || hl >= sizeof(host) || strstr(s, host) == NULL)
        fuzz_fail("accepted host '%s' of '%s'", host, s);
    if (s[0] != '[' && strchr(host, ':') != NULL)
        fuzz_fail("accepted an unbracketed IPv6 host in '%s'", s);
}

static void fuzz_token(const uint8_t *data, size_t size)
{
    char path[64];
    int fd = fuzz_memfd(data, size, path);
    char *tok = NULL;
    if (stria_rpc_token_read(path, &tok) == STRIA_OK) {
        size_t n = strlen(tok);
        if (n == 0 || n > 4096)
            fuzz_fail("accepted a token of %zu characters", n);
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)tok[i] < 0x20 || (unsigned char)tok[i] > 0x7e)
                fuzz_fail("accepted a non-printable token byte");
        if (tok[0] == ' ' || tok[n - 1] == ' ' || !stria_rpc_token_equal(tok, tok))
            fuzz_fail("token kept its blanks or differs from itself");
        free(tok);
    }
    close(fd);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    uint8_t which = data[0] % 5;
    char *s = fuzz_strndup(data + 1, size - 1);
    switch (which) {
    case 0:
        fuzz_address(s);
        break;
    case 1:
        fuzz_token(data + 1, size - 1);
        break;
    case 2: {
        /* two strings: equal exactly when the bytes are */
        size_t half = strlen(s) / 2;
        char *b = strdup(s + half);
        s[half] = '\0';
        if (stria_rpc_token_equal(s, b) != (strcmp(s, b) == 0))
            fuzz_fail("token comparison disagrees with strcmp");
        free(b);
        break;
    }
    case 3: {
        int64_t v;
        if (stria_parse_bytes(s, &v) == STRIA_OK && v < 0)
            fuzz_fail("negative size %lld from '%s'", (long long)v, s);
        break;
    }
    case 4: {
        double d;
        if (stria_parse_duration(s, &d) == STRIA_OK && !isfinite(d))
            fuzz_fail("duration %g from '%s'", d, s);
        break;
    }
    }
    free(s);
    return 0;
}
