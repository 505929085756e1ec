/* Network addresses: "HOST:PORT" strings and their resolution, shared by the
 * RPC layer, the ring link and the programs' options. */
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "stria_net.h"

stria_status_t stria_addr_parse(const char *addr, char *host, size_t host_cap, uint16_t *port_out)
{
    const char *hs, *he, *ps;
    unsigned long port = 0;
    size_t hl, nd = 0;

    if (addr == NULL || host == NULL || host_cap == 0 || port_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "address: NULL argument");
    if (addr[0] == '[') {
        hs = addr + 1;
        he = strchr(hs, ']');
        if (he == NULL || he[1] != ':')
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "address '%s': expected [HOST]:PORT for an IPv6 host", addr);
        ps = he + 2;
    } else {
        hs = addr;
        he = strrchr(addr, ':');
        if (he == NULL)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "address '%s': expected HOST:PORT", addr);
        if (memchr(addr, ':', (size_t)(he - addr)) != NULL)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "address '%s': write an IPv6 host in brackets, [HOST]:PORT",
                                   addr);
        ps = he + 1;
    }
    hl = (size_t)(he - hs);
    if (hl == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "address '%s': empty host", addr);
    if (hl >= host_cap)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "address '%s': host longer than %zu bytes",
                               addr, host_cap - 1);
    for (; ps[nd] != '\0'; nd++) {
        if (ps[nd] < '0' || ps[nd] > '9' || nd >= 5)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "address '%s': port must be a number 0..65535", addr);
        port = port * 10 + (unsigned long)(ps[nd] - '0');
    }
    if (nd == 0 || port > 65535)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "address '%s': port must be a number 0..65535", addr);
    memcpy(host, hs, hl);
    host[hl] = '\0';
    *port_out = (uint16_t)port;
    return STRIA_OK;
}

stria_status_t stria_addr_resolve(const char *host, uint16_t port, bool passive,
                                  struct sockaddr_storage *out, size_t *len_out)
{
    struct addrinfo hints, *res = NULL;
    char port_s[8];
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    snprintf(port_s, sizeof(port_s), "%u", (unsigned)port);
    int rc = getaddrinfo(host, port_s, &hints, &res);
    if (rc != 0 || res == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "cannot resolve address '%s': %s", host,
                               rc != 0 ? gai_strerror(rc) : "no result");
    if (res->ai_addrlen > sizeof(*out)) {
        freeaddrinfo(res);
        return stria_error_set(STRIA_ERR_INVALID_ARG, "address '%s' is too long", host);
    }
    memset(out, 0, sizeof(*out));
    memcpy(out, res->ai_addr, res->ai_addrlen);
    *len_out = (size_t)res->ai_addrlen;
    freeaddrinfo(res);
    return STRIA_OK;
}

static bool stria__sockaddr_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)(const void *)sa;
        return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
    }
    if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)(const void *)sa;
        if (IN6_IS_ADDR_LOOPBACK(&a->sin6_addr))
            return true;
        return IN6_IS_ADDR_V4MAPPED(&a->sin6_addr) && a->sin6_addr.s6_addr[12] == 127;
    }
    return false;
}

bool stria_addr_is_loopback(const char *host)
{
    struct addrinfo hints, *res = NULL;
    bool all = true;
    if (host == NULL || host[0] == '\0')
        return false;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, "1", &hints, &res) != 0 || res == NULL)
        return false;
    for (struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next)
        all = all && stria__sockaddr_loopback(ai->ai_addr);
    freeaddrinfo(res);
    return all;
}

bool stria_addr_listen_is_loopback(const char *addr)
{
    char host[256];
    uint16_t port;
    if (addr == NULL || stria_addr_parse(addr, host, sizeof(host), &port) != STRIA_OK) {
        stria_error_clear();
        return false;
    }
    return stria_addr_is_loopback(host);
}
