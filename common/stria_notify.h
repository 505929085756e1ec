/*
 * stria notify: the systemd service notification protocol (sd_notify(3))
 * without libsystemd: readiness, status lines, watchdog keep-alives and
 * stopping, for the daemons run as services.
 *
 * Threads: no state; each call reads the environment and sends on a socket
 * of its own, so any thread may call.
 */
#ifndef STRIA_NOTIFY_H
#define STRIA_NOTIFY_H

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sends `state` ("READY=1", "STATUS=...", "WATCHDOG=1", "STOPPING=1") to the
 * service manager through $NOTIFY_SOCKET. Without NOTIFY_SOCKET it does
 * nothing and returns STRIA_OK. */
stria_status_t stria_notify(const char *state);
/* Watchdog interval in seconds from $WATCHDOG_USEC (and $WATCHDOG_PID, if set,
 * must be this process); 0 when no watchdog is configured. */
double stria_notify_watchdog_interval(void);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_NOTIFY_H */
