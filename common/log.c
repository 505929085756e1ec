#include "stria_log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

/* Whether stderr is the systemd journal's stream for this service: systemd
 * sets JOURNAL_STREAM=<device>:<inode> of that stream (systemd.exec(5)). Then
 * each line starts with its syslog priority ("<3>" error, "<4>" warning,
 * "<6>" info, "<7>" debug; sd-daemon(3)) and carries no timestamp, which the
 * journal records itself. Checked once. */
static int stria__log_journal = -1;

static bool stria__stderr_is_journal(void)
{
    int v = __atomic_load_n(&stria__log_journal, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *env = getenv("JOURNAL_STREAM");
        unsigned long long dev = 0, ino = 0;
        struct stat sb;
        char tail;
        v = env != NULL && sscanf(env, "%llu:%llu%c", &dev, &ino, &tail) == 2 &&
            fstat(2, &sb) == 0 && (unsigned long long)sb.st_dev == dev &&
            (unsigned long long)sb.st_ino == ino;
        __atomic_store_n(&stria__log_journal, v, __ATOMIC_RELAXED);
    }
    return v != 0;
}

size_t stria_utf8_char(const char *s, size_t n, uint32_t *cp)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t len = p[0] >= 0xf0 ? 4 : p[0] >= 0xe0 ? 3 : 2;
    uint32_t min = len == 4 ? 0x10000 : len == 3 ? 0x800 : 0x80;
    if (p[0] < 0xc2 || p[0] > 0xf4 || len > n)
        return 0;
    *cp = p[0] & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xc0) != 0x80)
            return 0;
        *cp = (*cp << 6) | (p[i] & 0x3f);
    }
    if (*cp < min || *cp > 0x10ffff || (*cp >= 0xd800 && *cp <= 0xdfff))
        return 0;
    return len;
}

char *stria_text_escape(const char *in, char *out, size_t cap)
{
    const unsigned char *p = (const unsigned char *)(in ? in : "");
    size_t n = strlen((const char *)p), o = 0;
    if (cap == 0)
        return out;
    for (size_t i = 0; i < n;) {
        uint32_t cp = 0;
        size_t len = p[i] < 0x80 ? 1 : stria_utf8_char((const char *)p + i, n - i, &cp);
        bool plain =
            len > 1 ? !(cp >= 0x80 && cp <= 0x9f) : (len == 1 && p[i] >= 0x20 && p[i] != 0x7f);
        size_t need = plain ? len : 4;
        if (o + need >= cap)
            break;
        if (plain) {
            memcpy(out + o, p + i, len);
        } else {
            snprintf(out + o, 5, "\\x%02x", p[i]);
            len = 1;
        }
        o += need;
        i += len;
    }
    out[o] = '\0';
    return out;
}

void stria_log_write(stria_log_level_t level, const char *file, int line, const char *fmt, ...)
{
    static const int priorities[] = {3, 4, 6, 7};
    char raw[2048], msg[4 * sizeof(raw)];
    struct timespec ts;
    struct tm tm;
    const char *base = strrchr(file, '/');
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(raw, sizeof(raw), fmt, ap);
    va_end(ap);
    /* messages carry peers' strings (addresses, reasons, labels): one line,
     * nothing a terminal would act on */
    stria_text_escape(raw, msg, sizeof(msg));
    base = base ? base + 1 : file;
    if (stria__stderr_is_journal()) {
        pthread_mutex_lock(&stria__log_lock);
        fprintf(stderr, "<%d>%-5s %s:%d %s\n", priorities[level], stria__level_names[level], base,
                line, msg);
        pthread_mutex_unlock(&stria__log_lock);
        return;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    pthread_mutex_lock(&stria__log_lock);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s:%d %s\n", tm.tm_year + 1900,
            tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
            stria__level_names[level], base, line, msg);
    pthread_mutex_unlock(&stria__log_lock);
}
