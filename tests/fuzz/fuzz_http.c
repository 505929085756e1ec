/* Fuzz target: the request parser of the /metrics HTTP endpoint
 * (stria_http_metrics_route), fed the way the endpoint reads a connection:
 * chunk by chunk into its fixed buffer until a request is complete or the
 * buffer is full. The first byte sets the chunk size. */
#include <string.h>

#include "fuzz_util.h"
#include "stria_service.h"

#define REQ_CAP 8192 /* the endpoint's buffer */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    stria_log_set_level(STRIA_LOG_ERROR);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char req[REQ_CAP];
    size_t len = 0, chunk;
    int code = 0;
    bool head = false;

    if (size < 1)
        return 0;
    chunk = (size_t)(data[0] % 64) + 1;
    data++;
    size--;
    while (code == 0 && size > 0) {
        size_t n = size < chunk ? size : chunk;
        if (n > REQ_CAP - 1 - len)
            n = REQ_CAP - 1 - len;
        memcpy(req + len, data, n);
        len += n;
        req[len] = '\0';
        data += n;
        size -= n;
        code = stria_http_metrics_route(req, len, REQ_CAP - 1, &head);
        if (code == 0 && len >= REQ_CAP - 1)
            fuzz_fail("a full buffer is still an incomplete request");
    }
    if (code != 0 && code != 200 && code != 400 && code != 404 && code != 405)
        fuzz_fail("status %d", code);
    if (head && code != 200)
        fuzz_fail("HEAD flagged on status %d", code);
    if (code == 200 && strncmp(req, "GET", 3) != 0 && strncmp(req, "HEAD", 4) != 0 &&
        strstr(req, "GET") == NULL && strstr(req, "HEAD") == NULL)
        fuzz_fail("200 for a request without GET or HEAD");
    return 0;
}
