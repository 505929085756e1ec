/*
 * stria status: status codes and the calling thread's error message.
 *
 * Error convention: every fallible function returns stria_status_t (0 = OK,
 * negative = error). A function that fails also records a human-readable
 * message in a thread-local buffer, read with stria_error_msg(). The message is
 * valid until the next failing stria call on the same thread.
 *
 * Threads: the message and its retryable mark belong to the calling thread
 * (thread-local, a fixed buffer: a longer message is cut); every function may
 * be called from any thread. The string stria_error_msg() returns is that
 * buffer: copy it before the thread's next failing call if it must last.
 */
#ifndef STRIA_STATUS_H
#define STRIA_STATUS_H

#include <stdbool.h>

/* stria_status_t, stria_status_str(), stria_status_name(), stria_error_msg(),
 * stria_dtype_t and stria_layout_kind_t: the types of the client API, in its
 * installed header. */
#include "stria_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records a message for the calling thread and returns `status`, so that
 * callers can write `return stria_error_set(STRIA_ERR_INVALID_ARG, "...")`. */
stria_status_t stria_error_set(stria_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Prepends context to the current thread's message ("rank 2: <old message>")
 * and returns `status`. */
stria_status_t stria_error_wrap(stria_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Clears the calling thread's message. */
void stria_error_clear(void);

/* Whether a call that failed with `status` may succeed when it is tried
 * again: its cause lay outside the call (a ring link broke; a peer stalled,
 * vanished, left or was lost; a connection closed; an I/O error), not in
 * the call itself (bad input, no memory, cancelled, authentication). The
 * one rule every door applies to a status. */
bool stria_status_retryable(stria_status_t status);

/* Marks the calling thread's last error retryable or not (see
 * stria_error_retryable()); stria_error_set() clears the mark,
 * stria_error_wrap() keeps it. Returns `retryable`. */
bool stria_error_set_retryable(bool retryable);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_STATUS_H */
