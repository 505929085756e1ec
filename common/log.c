#include "stria_common.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int stria__log_level = -1;
static pthread_mutex_t stria__log_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const stria__level_names[] = {"error", "warn", "info", "debug"};

stria_status_t stria_log_parse_level(const char *name, stria_log_level_t *level_out)
{
    for (int i = 0; i < 4; i++) {
        if (name != NULL && strcmp(name, stria__level_names[i]) == 0) {
            *level_out = (stria_log_level_t)i;
            return STRIA_OK;
        }
    }
    return stria_error_set(STRIA_ERR_INVALID_ARG,
                           "unknown log level '%s' (expected error, warn, info or debug)",
                           name ? name : "(null)");
}

stria_log_level_t stria_log_level(void)
{
    int level = __atomic_load_n(&stria__log_level, __ATOMIC_RELAXED);
    if (level < 0) {
        stria_log_level_t parsed = STRIA_LOG_WARN;
        const char *env = getenv("STRIA_LOG_LEVEL");
        if (env != NULL && stria_log_parse_level(env, &parsed) != STRIA_OK) {
            parsed = STRIA_LOG_WARN;
        }
        level = (int)parsed;
        __atomic_store_n(&stria__log_level, level, __ATOMIC_RELAXED);
    }
    return (stria_log_level_t)level;
}

void stria_log_set_level(stria_log_level_t level)
{
    __atomic_store_n(&stria__log_level, (int)level, __ATOMIC_RELAXED);
}

void stria_log_write(stria_log_level_t level, const char *file, int line, const char *fmt, ...)
{
    char msg[2048];
    struct timespec ts;
    struct tm tm;
    const char *base = strrchr(file, '/');
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    pthread_mutex_lock(&stria__log_lock);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s:%d %s\n", tm.tm_year + 1900,
            tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
            stria__level_names[level], base ? base + 1 : file, line, msg);
    pthread_mutex_unlock(&stria__log_lock);
}
