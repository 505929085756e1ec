#include "stria_notify.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

stria_status_t stria_notify(const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    struct sockaddr_un addr;
    socklen_t addr_len;
    size_t plen;
    int fd;

    if (path == NULL || path[0] == '\0')
        return STRIA_OK;
    plen = strlen(path);
    if ((path[0] != '/' && path[0] != '@') || plen >= sizeof(addr.sun_path))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "NOTIFY_SOCKET '%s' is not a socket path",
                               path);
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, plen);
    if (path[0] == '@') /* abstract namespace */
        addr.sun_path[0] = '\0';
    addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + plen);

    fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return stria_error_set(STRIA_ERR_IO, "notify: socket: %s", strerror(errno));
    ssize_t n = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&addr, addr_len);
    int err = errno;
    close(fd);
    if (n < 0)
        return stria_error_set(STRIA_ERR_IO, "notify: sendto %s: %s", path, strerror(err));
    return STRIA_OK;
}

double stria_notify_watchdog_interval(void)
{
    const char *usec = getenv("WATCHDOG_USEC");
    const char *pid = getenv("WATCHDOG_PID");
    char *end;

    if (usec == NULL)
        return 0.0;
    if (pid != NULL && strtol(pid, NULL, 10) != (long)getpid())
        return 0.0;
    unsigned long long v = strtoull(usec, &end, 10);
    if (end == usec || *end != '\0' || v == 0)
        return 0.0;
    return (double)v * 1e-6;
}
