/*
 * Heartbeats of the UCX ring link and the stalled-rank logic, as pure
 * functions over a link's view of its neighbours (stria__ucx_hb_link_t): no
 * UCX, no locks, no clock. The progress thread calls them under ctx->lock
 * with the current time and sends what they say (ucx_state.c); a missed
 * deadline asks them whom to blame (ucx.c).
 *
 * They never fail a link by themselves (a busy host may delay heartbeats);
 * they tell a missed deadline whether the peer is stalled or alive and
 * waiting on someone else, and which rank looks stalled.
 */
#include "ucx_int.h"

#include <string.h>

/* Heartbeat period and stall time by default (stria_ucx_ctx_params_t). */
#define STRIA__UCX_PING_S  0.1
#define STRIA__UCX_STALE_S 0.5
/* Bounds of the injectable heartbeat period and stall time: a stall time of
 * at least two periods, so that one late heartbeat never makes a neighbour
 * look stalled. */
#define STRIA__UCX_PING_MAX_S  10.0
#define STRIA__UCX_STALE_MAX_S 60.0

stria_status_t stria__ucx_hb_config(double heartbeat_s, double stall_s, double *ping_s_out,
                                    double *stale_s_out)
{
    double ping_s = heartbeat_s > 0 ? heartbeat_s : STRIA__UCX_PING_S;
    /* The default stall time grows with a longer period: a neighbour is
     * never called stalled before it missed several heartbeats. */
    double stale_s = stall_s > 0                       ? stall_s
                     : 5 * ping_s > STRIA__UCX_STALE_S ? 5 * ping_s
                                                       : STRIA__UCX_STALE_S;
    if (!(heartbeat_s >= 0 && ping_s <= STRIA__UCX_PING_MAX_S))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ucx context: heartbeat period %g s is not in (0, %g] s",
                               heartbeat_s, STRIA__UCX_PING_MAX_S);
    if (!(stall_s >= 0 && stale_s >= 2 * ping_s && stale_s <= STRIA__UCX_STALE_MAX_S))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "ucx context: stall time %g s is not in [%g, %g] s (at least two "
                               "heartbeat periods of %g s)",
                               stall_s, 2 * ping_s, STRIA__UCX_STALE_MAX_S, ping_s);
    *ping_s_out = ping_s;
    *stale_s_out = stale_s;
    return STRIA_OK;
}

void stria__ucx_hb_init(stria__ucx_hb_link_t *link, int rank, int size, double stale)
{
    memset(link, 0, sizeof(*link));
    link->rank = rank;
    link->size = size;
    link->stale = stale;
    link->heard[0].suspect = link->heard[1].suspect = -1;
    link->logged = -1;
}

void stria__ucx_hb_heard(stria__ucx_hb_link_t *link, int side, double now)
{
    link->nb[side].last = now;
}

bool stria__ucx_hb_report(stria__ucx_hb_link_t *link, int side, double now, int origin,
                          int reporter_in, int sender, int32_t silence_ms)
{
    /* A heartbeat's origin names the rank its sender (or someone before
     * it) found silent, its reporter the rank that saw it, its status the
     * silence in ms. Suspicion of ourselves is not ours to pass on, nor our
     * own report come round the ring. */
    int reporter = reporter_in >= 0 && reporter_in < link->size ? reporter_in : sender;
    if (origin < 0 || origin >= link->size || origin == link->rank || reporter == link->rank ||
        silence_ms < 0)
        return false;
    link->heard[side].suspect = origin;
    link->heard[side].reporter = reporter;
    link->heard[side].silence = silence_ms / 1000.0;
    link->heard[side].at = now;
    return true;
}

int stria__ucx_hb_suspect(const stria__ucx_hb_link_t *link, double now, int from, int *reporter,
                          double *silence)
{
    double qp = now - link->nb[STRIA__FROM_PREV].last, qn = now - link->nb[STRIA__FROM_NEXT].last;
    double stale = link->stale;
    *reporter = link->rank;
    if (link->nb[STRIA__FROM_PREV].up && qp >= stale && !link->nb[STRIA__FROM_PREV].bye) {
        *silence = qp;
        return (link->rank + link->size - 1) % link->size;
    }
    if (link->nb[STRIA__FROM_NEXT].up && qn >= stale && !link->nb[STRIA__FROM_NEXT].bye) {
        *silence = qn;
        return (link->rank + 1) % link->size;
    }
    int best = -1;
    for (int d = 0; d < 2; d++) {
        if ((from >= 0 && d != from) || link->heard[d].suspect < 0 ||
            now - link->heard[d].at >= 2 * stale)
            continue;
        if (best < 0 || link->heard[d].at > link->heard[best].at)
            best = d;
    }
    if (best >= 0) {
        *reporter = link->heard[best].reporter;
        *silence = link->heard[best].silence + (now - link->heard[best].at);
        return link->heard[best].suspect;
    }
    *silence = 0;
    return -1;
}

int stria__ucx_hb_ping(const stria__ucx_hb_link_t *link, double now, int from, int *reporter,
                       int32_t *silence_ms)
{
    double silence;
    int suspect = stria__ucx_hb_suspect(link, now, from, reporter, &silence);
    *silence_ms = suspect >= 0 ? (int32_t)(silence * 1000) : 0;
    return suspect;
}

bool stria__ucx_hb_log_due(stria__ucx_hb_link_t *link, double now, int *suspect, int *reporter,
                           double *silence, int *before)
{
    *suspect = stria__ucx_hb_suspect(link, now, -1, reporter, silence);
    if (*suspect == link->logged)
        return false;
    *before = link->logged;
    link->logged = *suspect;
    return true;
}
