#include "stria_status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define STRIA__ERRMSG_LEN 1024

static _Thread_local char stria__errmsg[STRIA__ERRMSG_LEN];
static _Thread_local bool stria__err_retryable;

const char *stria_status_str(stria_status_t status)
{
    switch (status) {
#define STRIA__STATUS_STR(name, value, desc)                                                       \
    case STRIA_##name:                                                                             \
        return desc;
        STRIA_STATUS_MAP(STRIA__STATUS_STR)
#undef STRIA__STATUS_STR
    }
    return "unknown status";
}

const char *stria_status_name(stria_status_t status)
{
    switch (status) {
#define STRIA__STATUS_NAME(name, value, desc)                                                      \
    case STRIA_##name:                                                                             \
        return "STRIA_" #name;
        STRIA_STATUS_MAP(STRIA__STATUS_NAME)
#undef STRIA__STATUS_NAME
    }
    return "STRIA_UNKNOWN";
}

stria_status_t stria_error_set(stria_status_t status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(stria__errmsg, sizeof(stria__errmsg), fmt, ap);
    va_end(ap);
    stria__err_retryable = false;
    return status;
}

stria_status_t stria_error_wrap(stria_status_t status, const char *fmt, ...)
{
    char prefix[STRIA__ERRMSG_LEN];
    char old[STRIA__ERRMSG_LEN];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(prefix, sizeof(prefix), fmt, ap);
    va_end(ap);
    memcpy(old, stria__errmsg, sizeof(old));
    /* Truncation is acceptable for an over-long message; compute into a
     * buffer the compiler can see is large enough. */
    char joined[2 * STRIA__ERRMSG_LEN + 4];
    snprintf(joined, sizeof(joined), "%s: %s", prefix,
             old[0] != '\0' ? old : stria_status_str(status));
    memcpy(stria__errmsg, joined, sizeof(stria__errmsg) - 1);
    stria__errmsg[sizeof(stria__errmsg) - 1] = '\0';
    return status;
}

const char *stria_error_msg(void)
{
    return stria__errmsg;
}

void stria_error_clear(void)
{
    stria__errmsg[0] = '\0';
    stria__err_retryable = false;
}

bool stria_error_retryable(void)
{
    return stria__err_retryable;
}

bool stria_error_set_retryable(bool retryable)
{
    stria__err_retryable = retryable;
    return retryable;
}

bool stria_status_retryable(stria_status_t st)
{
    return st == STRIA_ERR_PEER || st == STRIA_ERR_TRANSPORT || st == STRIA_ERR_CLOSED ||
           st == STRIA_ERR_TIMEOUT || st == STRIA_ERR_IO;
}
