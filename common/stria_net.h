/*
 * stria net: the little-endian fields of the wire formats, and "HOST:PORT"
 * network addresses: parsing, resolution, and whether a listener is
 * reachable from this machine only. Shared by the RPC layer, the ring link
 * and the programs' options.
 *
 * Ownership: buffers (the host, the socket address) belong to the caller.
 * Threads: no state; every function may be called from any thread.
 * stria_addr_resolve() and the loopback checks resolve names with
 * getaddrinfo(), so they may wait on DNS.
 */
#ifndef STRIA_NET_H
#define STRIA_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- little-endian fields of wire formats ------------------------------- */

/* The RPC frame header and the ring link's control messages are
 * little-endian whatever the host; these read and write their fields. */
static inline void stria_put_le16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline void stria_put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline void stria_put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint16_t stria_get_le16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline uint32_t stria_get_le32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static inline uint64_t stria_get_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* ---- network addresses ----------------------------------------------------- */

struct sockaddr_storage;

/* Splits "HOST:PORT" (an IPv6 host in brackets: "[::1]:7400") into host and
 * port. Errors (STRIA_ERR_INVALID_ARG) quote the address and say what is
 * wrong: no port, a port outside 0..65535, an empty host, an IPv6 host
 * without brackets, a host longer than host_cap - 1. */
stria_status_t stria_addr_parse(const char *addr, char *host, size_t host_cap, uint16_t *port_out);
/* Resolves a numeric address or a host name and a port to a socket address
 * (the first result). passive: for bind(), where a NULL-like "0.0.0.0" or
 * "::" means every interface. *len_out receives the address length.
 * Errors: STRIA_ERR_INVALID_ARG naming the host. */
stria_status_t stria_addr_resolve(const char *host, uint16_t port, bool passive,
                                  struct sockaddr_storage *out, size_t *len_out);
/* Whether every address `host` resolves to is a loopback one (127.0.0.0/8,
 * ::1): a listener there is reachable from this machine only. A wildcard
 * ("0.0.0.0", "::") or a name that does not resolve is not. */
bool stria_addr_is_loopback(const char *host);
/* The same for the host of a "HOST:PORT" address (false when malformed). */
bool stria_addr_listen_is_loopback(const char *addr);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_NET_H */
