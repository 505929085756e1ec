/*
 * stria common: every topic header of common/ in one include, for code that
 * uses much of it. Each topic has a header of its own, implemented by the
 * .c file of the same name (stria_log.h by log.c); code that needs one or
 * two topics includes just those:
 *
 *   stria_status.h    status codes (stria_types.h) and error messages
 *   stria_log.h       log lines and the escaping of text from peers
 *   stria_util.h      clocks, aligned allocation, growing arrays, random bytes
 *   stria_net.h       little-endian wire fields, "HOST:PORT" addresses
 *   stria_ranges.h    byte ranges a chunked transfer has covered
 *   stria_pool.h      the thread pool of parallel loops
 *   stria_mempool.h   allocators and memory pools
 *   stria_dtype.h     storage dtypes and their conversions
 *   stria_npy.h       .npy file I/O
 *   stria_opts.h      options: flags, configuration files, --help
 *   stria_notify.h    systemd notification
 *   stria_metrics.h   Prometheus metrics
 *   stria_layout.h    layouts: which tokens each rank of a ring holds
 *   stria_call.h      the call record (a call's shape) and its mask rules
 *   stria_timeline.h  per-rank timelines of ring passes as SVG
 *
 * Not included: stria_auth.h, the service's cryptography, in a library of
 * its own (stria_auth) so that only what authenticates needs libcrypto. None
 * of these headers is installed; libstria installs stria_client.h and
 * stria_types.h.
 */
#ifndef STRIA_COMMON_H
#define STRIA_COMMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"
#include "stria_log.h"
#include "stria_util.h"
#include "stria_net.h"
#include "stria_ranges.h"
#include "stria_pool.h"
#include "stria_mempool.h"
#include "stria_dtype.h"
#include "stria_npy.h"
#include "stria_opts.h"
#include "stria_notify.h"
#include "stria_metrics.h"
#include "stria_layout.h"
#include "stria_call.h"
#include "stria_timeline.h"

#endif /* STRIA_COMMON_H */
