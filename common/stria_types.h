/*
 * stria types: what the client API (stria_client.h) and the rest of stria
 * share. Installed with libstria; stria_common.h (not installed) includes it.
 *
 * Error convention: every fallible function returns stria_status_t (0 = OK,
 * negative = error) and records a human-readable message in a thread-local
 * buffer, read with stria_error_msg().
 */
#ifndef STRIA_TYPES_H
#define STRIA_TYPES_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, value, description): the single list behind stria_status_t and
 * stria_status_str(). */
#define STRIA_STATUS_MAP(X)                                                                        \
    X(OK, 0, "success")                                                                            \
    X(ERR_INVALID_ARG, -1, "invalid argument")                                                     \
    X(ERR_NO_MEMORY, -2, "out of memory")                                                          \
    X(ERR_IO, -3, "I/O error")                                                                     \
    X(ERR_FORMAT, -4, "malformed input")                                                           \
    X(ERR_UNSUPPORTED, -5, "unsupported")                                                          \
    X(ERR_TIMEOUT, -6, "deadline exceeded")                                                        \
    X(ERR_CANCELLED, -7, "cancelled")                                                              \
    X(ERR_PEER, -8, "peer failure")                                                                \
    X(ERR_TRANSPORT, -9, "transport error")                                                        \
    X(ERR_PROTOCOL, -10, "protocol error")                                                         \
    X(ERR_NOT_FOUND, -11, "not found")                                                             \
    X(ERR_BUSY, -12, "resource busy")                                                              \
    X(ERR_AUTH, -13, "authentication failed")                                                      \
    X(ERR_CLOSED, -14, "connection closed")                                                        \
    X(ERR_INTERNAL, -15, "internal error")

typedef enum {
#define STRIA__STATUS_ENUM(name, value, desc) STRIA_##name = value,
    STRIA_STATUS_MAP(STRIA__STATUS_ENUM)
#undef STRIA__STATUS_ENUM
} stria_status_t;

/* Static description of a status code ("invalid argument"); never NULL. */
const char *stria_status_str(stria_status_t status);

/* Symbolic name of a status code ("STRIA_ERR_INVALID_ARG"); never NULL. */
const char *stria_status_name(stria_status_t status);

/* The calling thread's last error message ("" if none). Valid until the next
 * stria_error_set() on this thread. */
const char *stria_error_msg(void);

/* Whether the calling thread's last error is retryable: the job failed for
 * a cause outside it (a worker died, left, was drained or cut off; a ring
 * link broke), so the same job submitted again may succeed; false for a
 * cause that would fail again (bad input, no memory, cancelled,
 * authentication, a client gone) and when there is no error. Set with the
 * error; kept when an error is wrapped. */
bool stria_error_retryable(void);

/* Storage dtypes of tensors (LSE is always fp32). */
typedef enum {
    STRIA_DTYPE_F32 = 0,
    STRIA_DTYPE_BF16 = 1,
    STRIA_DTYPE_F16 = 2,
} stria_dtype_t;

/* How a sequence's tokens are dealt to the ranks of a ring. */
typedef enum {
    STRIA_LAYOUT_STRIPED = 0,
    STRIA_LAYOUT_CONTIGUOUS = 1,
    STRIA_LAYOUT_ZIGZAG = 2,
    /* Chosen per job by whoever runs it (the coordinator, or an in-process
     * ring): contiguous when a window is set (windows are balanced under
     * contiguous and need fewer hops), striped otherwise. Never reaches a
     * worker; sharded jobs must name their layout. */
    STRIA_LAYOUT_AUTO = 3,
    /* Documents placed by their work (stria_docplan.h): made per call from
     * its documents (stria_layout_init_plan()). Runs in the in-process ring;
     * the service does not take it yet. */
    STRIA_LAYOUT_PACKED = 4,
} stria_layout_kind_t;

#ifdef __cplusplus
}
#endif

#endif /* STRIA_TYPES_H */
