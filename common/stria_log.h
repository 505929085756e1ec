/*
 * stria log: log lines on stderr at four levels, and the escaping of text
 * that may come from a peer before it reaches a terminal or a log line.
 *
 * A line is "TIME LEVEL FILE:LINE MESSAGE" (TIME in UTC); when stderr is the
 * systemd journal's stream it starts with the syslog priority instead and
 * has no time. The stria_log_*() macros check the level before anything is
 * formatted.
 *
 * Threads: every function may be called from any thread; the level is one
 * atomic for the process, and each line is written whole, under one lock.
 * Ownership: stria_text_escape() writes the caller's buffer.
 */
#ifndef STRIA_LOG_H
#define STRIA_LOG_H

#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    STRIA_LOG_ERROR = 0,
    STRIA_LOG_WARN = 1,
    STRIA_LOG_INFO = 2,
    STRIA_LOG_DEBUG = 3,
} stria_log_level_t;

/* Current level; initialised from STRIA_LOG_LEVEL (error|warn|info|debug),
 * default warn. */
stria_log_level_t stria_log_level(void);
void stria_log_set_level(stria_log_level_t level);
/* Parses "error", "warn", "info", "debug"; returns STRIA_ERR_INVALID_ARG
 * otherwise. */
stria_status_t stria_log_parse_level(const char *name, stria_log_level_t *level_out);
void stria_log_write(stria_log_level_t level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Copies text for a terminal or a log line: control characters (C0, DEL,
 * and C1 written in UTF-8) and bytes that are not UTF-8 become \xNN, so a
 * peer-supplied string cannot move the cursor, fake a log line or reach the
 * terminal's escape sequences. Valid UTF-8 text is kept; out (cap > 0) is
 * always terminated, cut at a whole character. Every log line goes through
 * it. Returns out. */
char *stria_text_escape(const char *in, char *out, size_t cap);
/* Length of the UTF-8 character (of two to four bytes) at s, at most n bytes,
 * with its code point in *cp; 0 when the bytes are not one (overlong,
 * surrogate, beyond U+10FFFF, cut short, or s[0] < 0x80). */
size_t stria_utf8_char(const char *s, size_t n, uint32_t *cp);

#define stria_log(level, ...)                                                                      \
    do {                                                                                           \
        if ((level) <= stria_log_level())                                                          \
            stria_log_write((level), __FILE__, __LINE__, __VA_ARGS__);                             \
    } while (0)
#define stria_log_error(...) stria_log(STRIA_LOG_ERROR, __VA_ARGS__)
#define stria_log_warn(...)  stria_log(STRIA_LOG_WARN, __VA_ARGS__)
#define stria_log_info(...)  stria_log(STRIA_LOG_INFO, __VA_ARGS__)
#define stria_log_debug(...) stria_log(STRIA_LOG_DEBUG, __VA_ARGS__)

#ifdef __cplusplus
}
#endif

#endif /* STRIA_LOG_H */
