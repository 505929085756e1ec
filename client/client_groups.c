/* libstria's head groups (stria_session_spec_t.head_groups): a session of
 * G rings, each a session of its own over heads / G, and a call run on all
 * of them at once; the automatic choice of G from the coordinator's ring.
 * Above the sessions (client_session.c), below the public session API. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"
#include "stria_auth.h"

/* A head-grouped session (spec.head_groups G > 1) is G sessions, one per
 * head group: heads / G and kv_heads / G over R = ring_size / G ranks each,
 * opened one after the other, each without the workers of the groups
 * before it (the coordinator orders a ring's workers by host, so a group's
 * ring takes the next R of them: a host's neighbours before another
 * host's). A call runs on the G rings at once, each moving its heads' bytes
 * of every row between the caller's tensors and its shards (client_call.c,
 * full_row and full_off): routing the upload is the all-to-all of head
 * parallelism. Each ring retries on its own, as any session does.
 *
 * A sharded one is called by R trainer ranks: rank j holds ring rank j's
 * tokens with all their heads, and its call sends each group's heads' bytes
 * of them to worker j of that group's ring (each ring a sharded session of
 * R ranks, following its own replacement). Its export holds every ring's
 * id and secret, so that the trainer's other ranks import the same rings.
 * With trainer_ranks = ring_size (`parts`), N = G R trainer ranks call it:
 * rank h G + l holds stripe l R + h of a striping over N, and its call on
 * ring g is part l of ring rank h's (the worker puts the G parts together). */

#define STRIA__MAX_GROUPS 64

static stria_status_t group_spec_check(const stria_session_spec_t *sp)
{
    const uint32_t G = sp->head_groups;
    if (G > STRIA__MAX_GROUPS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: head_groups must be at most %d (got %u)",
                               STRIA__MAX_GROUPS, G);
    if (sp->kv_heads % G != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: head_groups %u must divide kv_heads %lld (a GQA "
                               "group of query heads stays whole)",
                               G, (long long)sp->kv_heads);
    if (sp->ring_size < 1 || sp->ring_size % (int)G != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: head_groups %u needs ring_size, a multiple of it "
                               "(head_groups x the ranks of each ring; got %d)",
                               G, sp->ring_size);
    if (sp->head_group_rings != STRIA_GROUP_RINGS_INSIDE &&
        sp->head_group_rings != STRIA_GROUP_RINGS_ACROSS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: head_group_rings %d is neither INSIDE (0) nor "
                               "ACROSS (1)",
                               sp->head_group_rings);
    const int R = sp->ring_size / (int)G;
    if (sp->trainer_ranks != 0 && sp->trainer_ranks != R && sp->trainer_ranks != sp->ring_size)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: trainer_ranks %d is neither 0, the ranks of a ring "
                               "(%d) nor ring_size (%d)",
                               sp->trainer_ranks, R, sp->ring_size);
    if (sp->trainer_ranks == sp->ring_size && sp->layout != STRIA_LAYOUT_STRIPED)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: trainer_ranks ring_size (one trainer rank per "
                               "worker, each holding one stripe) needs the striped layout");
    if (sp->head_group_rings == STRIA_GROUP_RINGS_ACROSS && sp->placement_hosts != NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: head_group_rings ACROSS places the rings itself; "
                               "with placement_hosts, ring g takes entries [g R, (g+1) R)");
    return STRIA_OK;
}

/* The hosts of the coordinator's ring in ring order (workers by host),
 * its first `limit` (0: all) workers', as runs: host run_of[k]'s name at
 * hosts[first[k]], run_len[k] workers. Returns the number of runs (the
 * arrays hold STRIA__MAX_RUNS), or -1 with the error set. */
#define STRIA__MAX_RUNS 1024
typedef struct {
    char (*hosts)[STRIA__HOST_LEN];
    size_t n, runs;
    size_t first[STRIA__MAX_RUNS], len[STRIA__MAX_RUNS];
} ring_hosts_t;

static stria_status_t ring_hosts(stria_client_t *c, size_t limit, ring_hosts_t *h)
{
    const size_t cap = 4096;
    memset(h, 0, sizeof(*h));
    if ((h->hosts = calloc(cap, sizeof(*h->hosts))) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    stria_status_t st = stria__lcoord_ring_hosts(c, h->hosts, cap, &h->n);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "the coordinator's ring");
    if (limit > 0 && limit < h->n)
        h->n = limit;
    for (size_t i = 0; i < h->n && h->runs < STRIA__MAX_RUNS; i++) {
        if (i == 0 || strcmp(h->hosts[i], h->hosts[i - 1]) != 0)
            h->first[h->runs++] = i;
        h->len[h->runs - 1]++;
    }
    return STRIA_OK;
}

/* STRIA_HEAD_GROUPS_AUTO over the ring's first ring_size workers (0:
 * all): where every host holds as many workers, one group per host (rings
 * inside hosts), or with ACROSS one per worker of a host (rings across
 * them), when that number divides kv_heads; else 1. Fills in sp's
 * head_groups and ring_size. */
stria_status_t stria__lgroup_auto(stria_client_t *c, stria_session_spec_t *sp)
{
    ring_hosts_t h;
    stria_status_t st = ring_hosts(c, sp->ring_size > 0 ? (size_t)sp->ring_size : 0, &h);
    free(h.hosts);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "session spec: head_groups auto");
    bool even = h.runs > 0;
    for (size_t k = 1; k < h.runs; k++)
        even = even && h.len[k] == h.len[0];
    const bool across = sp->head_group_rings == STRIA_GROUP_RINGS_ACROSS;
    size_t want = across ? (h.runs > 0 ? h.len[0] : 0) : h.runs;
    uint32_t G =
        even && h.runs > 1 && want > 1 && sp->kv_heads % (int64_t)want == 0 ? (uint32_t)want : 1;
    if (sp->ring_size == 0 && G > 1)
        sp->ring_size = (int)h.n;
    sp->head_groups = G;
    stria_log_info("session: head_groups auto: %u (%zu workers on %zu hosts%s)", G, h.n, h.runs,
                   G > 1                 ? (across ? ", rings across them" : ", a ring inside each")
                   : h.runs <= 1         ? ": one host"
                   : !even               ? ": hosts hold unequal shares"
                   : across && want <= 1 ? ": one worker per host"
                                         : ": that number does not divide kv_heads");
    return STRIA_OK;
}

/* ACROSS: the hosts of ring rank 0 .. R-1 (the first R hosts of the ring
 * with G workers free at least), into names[] (pointing into h). */
static stria_status_t across_hosts(stria_client_t *c, int G, int R, ring_hosts_t *h,
                                   const char **names)
{
    stria_status_t st = ring_hosts(c, 0, h);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "head groups across hosts");
    int found = 0;
    for (size_t k = 0; k < h->runs && found < R; k++)
        if (h->len[k] >= (size_t)G)
            names[found++] = h->hosts[h->first[k]];
    if (found < R)
        return stria_error_set(STRIA_ERR_BUSY,
                               "head groups across hosts: %d rings of %d need %d hosts with %d "
                               "workers each; the ring has %d such host(s) of %zu",
                               G, R, R, G, found, h->runs);
    return STRIA_OK;
}

stria_status_t stria__lgroup_open(stria_client_t *c, const stria__lopen_t *o,
                                  const stria_session_spec_t *sp, stria_session_t **out)
{
    stria_status_t st = group_spec_check(sp);
    if (st != STRIA_OK)
        return st;
    const int G = (int)sp->head_groups, R = sp->ring_size / G;
    stria_session_t *p = stria__lsess_new(c);
    /* the workers the open excludes (a job's earlier tries blamed them),
     * then those the earlier groups took, then those a failed group's open
     * blamed (at most STRIA__MAX_BLAMED in all, as that open adds them) */
    const size_t n_out = o->exclude != NULL ? *o->n_exclude : 0;
    const size_t cap = n_out + (size_t)sp->ring_size + STRIA__MAX_BLAMED;
    uint64_t *taken = calloc(cap, sizeof(*taken));
    if (p == NULL || taken == NULL || (p->groups = calloc((size_t)G, sizeof(*p->groups))) == NULL ||
        (sp->max_held > 0 &&
         (p->group_held = calloc((size_t)sp->max_held * (size_t)G, sizeof(uint64_t))) == NULL)) {
        free(taken);
        stria__lsess_close(p);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    }
    p->spec = *sp;
    p->sharded = sp->sharded;
    p->parts = sp->sharded && sp->trainer_ranks == sp->ring_size;
    p->spec.label = NULL;
    p->spec.placement_hosts = NULL;
    p->spec.placement_devices = NULL;
    ring_hosts_t h = {0};
    const char **across = NULL;
    if (sp->head_group_rings == STRIA_GROUP_RINGS_ACROSS) {
        if ((across = calloc((size_t)R, sizeof(*across))) == NULL)
            st = stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
        else
            st = across_hosts(c, G, R, &h, across);
    }
    uint64_t tag = 0; /* what the rings' specs share (striactl's grid) */
    while (st == STRIA_OK && tag == 0)
        st = stria_auth_random(&tag, sizeof(tag));
    size_t n_taken = n_out;
    if (taken != NULL && n_out > 0)
        memcpy(taken, o->exclude, n_out * sizeof(*taken));
    for (int g = 0; g < G && st == STRIA_OK; g++) {
        stria_session_spec_t gs = *sp;
        gs.heads /= G;
        gs.kv_heads /= G;
        gs.ring_size = R;
        gs.head_groups = 0;
        gs.trainer_ranks = 0;
        char label[256]; /* what striactl shows: the group and its session */
        snprintf(label, sizeof(label), "%s%shead group %d of %d", o->js.label ? o->js.label : "",
                 o->js.label ? ", " : "", g, G);
        stria__lopen_t go = *o;
        go.js.label = label;
        go.js.heads = gs.heads;
        go.js.kv_heads = gs.kv_heads;
        go.js.ring_size = R;
        go.exclude = taken;
        go.n_exclude = &n_taken;
        go.blame = o->blame;
        const size_t n_before = n_taken;
        go.head_group = (uint32_t)g;
        go.head_groups = (uint32_t)G;
        go.head_group_tag = tag;
        if (across != NULL) { /* ring rank j on host j, the groups' other workers excluded */
            go.js.placement_hosts = across;
            go.js.placement_devices = NULL;
            go.js.placement_fallback = false;
        } else if (o->js.placement_hosts != NULL) { /* the spec's own: this group's entries */
            go.js.placement_hosts = o->js.placement_hosts + (size_t)g * (size_t)R;
            go.js.placement_devices =
                o->js.placement_devices ? o->js.placement_devices + (size_t)g * (size_t)R : NULL;
        }
        stria_session_t *r = NULL;
        if ((st = stria__lsess_open(c, &go, &gs, NULL, NULL, &r)) != STRIA_OK) {
            char msg[1024];
            bool retryable = stria_error_retryable();
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
            /* the workers this open blamed: the caller's next try goes
             * without them (a job's) */
            for (size_t i = n_before; o->blame && i < n_taken; i++) {
                bool known = false;
                for (size_t k = 0; k < *o->n_exclude && !known; k++)
                    known = o->exclude[k] == taken[i];
                if (!known && *o->n_exclude < STRIA__MAX_BLAMED)
                    o->exclude[(*o->n_exclude)++] = taken[i];
            }
            stria_error_set(st, "head group %d of %d (its ring of %d): %s", g, G, R, msg);
            stria_error_set_retryable(retryable);
            break;
        }
        stria__lgroup_adopt(p, r, G);
        for (int i = 0; i < r->n_ranks && n_taken < cap; i++)
            taken[n_taken++] = r->ranks[i].worker_id;
    }
    free(taken);
    free(across);
    free(h.hosts);
    if (st != STRIA_OK) {
        stria__lsess_close(p);
        return st;
    }
    p->id = p->groups[0]->id;
    p->layout = p->groups[0]->layout;
    *out = p;
    return STRIA_OK;
}

void stria__lgroup_adopt(stria_session_t *p, stria_session_t *r, int G)
{
    r->group = p->n_groups;
    r->group_of = G;
    p->groups[p->n_groups++] = r;
}

/* ---- a sharded one shared: export and import ------------------------------------ */

/* "STRIASG1", G (le32), flags (le32: bit 0, one trainer rank per worker),
 * then per ring its id (le64) and secret. */
#define GROUP_EXPORT_MAGIC "STRIASG1"
#define GROUP_ENTRY_BYTES  (8 + (int)sizeof(((stria_job_secret_t *)0)->bytes))

stria_status_t stria__lgroup_export(const stria_session_t *p, void *out, size_t cap,
                                    size_t *len_out)
{
    uint8_t *b = out;
    const size_t need = 16 + (size_t)p->n_groups * GROUP_ENTRY_BYTES;
    if (!p->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_export: only a sharded session can be shared");
    if (cap < need)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_export: %zu bytes of room, %zu needed (a session "
                               "of %d head groups; STRIA_SESSION_EXPORT_MAX_BYTES always do)",
                               cap, need, p->n_groups);
    memcpy(b, GROUP_EXPORT_MAGIC, 8);
    stria_put_le32(b + 8, (uint32_t)p->n_groups);
    stria_put_le32(b + 12, p->parts ? 1u : 0u);
    for (int g = 0; g < p->n_groups; g++) {
        uint8_t *e = b + 16 + (size_t)g * GROUP_ENTRY_BYTES;
        stria_put_le64(e, p->groups[g]->id);
        memcpy(e + 8, p->groups[g]->secret.bytes, sizeof(p->groups[g]->secret.bytes));
    }
    *len_out = need;
    return STRIA_OK;
}

bool stria__lgroup_is_export(const void *bytes, size_t len)
{
    return len >= 16 && memcmp(bytes, GROUP_EXPORT_MAGIC, 8) == 0;
}

/* Whether ring r fits beside ring 0 of the same session (the export of a
 * head-grouped session names rings of one shape). */
static bool same_shape(const stria_session_t *a, const stria_session_t *r)
{
    const stria_session_spec_t *x = &a->spec, *y = &r->spec;
    return r->n_ranks == a->n_ranks && r->layout == a->layout && x->heads == y->heads &&
           x->kv_heads == y->kv_heads && x->head_dim == y->head_dim && x->dtype == y->dtype &&
           x->max_batch == y->max_batch && x->max_seq_len == y->max_seq_len;
}

stria_status_t stria__lgroup_import(stria_client_t *c, const void *bytes, size_t len,
                                    stria_session_t **out)
{
    const uint8_t *b = bytes;
    const uint32_t G = stria_get_le32(b + 8), flags = stria_get_le32(b + 12);
    if (G < 2 || G > STRIA__MAX_GROUPS || len != 16 + (size_t)G * GROUP_ENTRY_BYTES)
        return stria_error_set(STRIA_ERR_FORMAT,
                               "stria_session_import: a head-grouped export of %zu bytes that "
                               "names %u groups (2..%d, 16 + 40 bytes each)",
                               len, G, STRIA__MAX_GROUPS);
    if (flags > 1)
        return stria_error_set(STRIA_ERR_FORMAT,
                               "stria_session_import: a head-grouped export with flags %#x this "
                               "library does not know (a newer one made it)",
                               flags);
    stria_session_t *p = stria__lsess_new(c);
    if (p == NULL || (p->groups = calloc(G, sizeof(*p->groups))) == NULL) {
        stria__lsess_close(p);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_session_import: out of memory");
    }
    stria_status_t st = STRIA_OK;
    for (uint32_t g = 0; g < G && st == STRIA_OK; g++) {
        uint8_t one[STRIA_SESSION_EXPORT_BYTES];
        memcpy(one, STRIA__SESSION_EXPORT_MAGIC, 8);
        memcpy(one + 8, b + 16 + (size_t)g * GROUP_ENTRY_BYTES, GROUP_ENTRY_BYTES);
        stria_session_t *r = NULL;
        st = stria__lsess_import(c, one, sizeof(one), false, &r);
        stria_auth_wipe(one, sizeof(one));
        if (st != STRIA_OK) {
            char msg[1024];
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
            stria_error_set(st, "head group %u of %u: %s", g, G, msg);
            break;
        }
        stria__lgroup_adopt(p, r, (int)G);
        if (!same_shape(p->groups[0], r))
            st = stria_error_set(STRIA_ERR_FORMAT,
                                 "stria_session_import: head group %u's session (%llu) differs "
                                 "from group 0's in its ring, layout, heads, dtype or bounds",
                                 g, (unsigned long long)r->id);
    }
    if (st != STRIA_OK) {
        stria__lsess_close(p);
        return st;
    }
    const stria_session_t *r0 = p->groups[0];
    p->spec = r0->spec;
    p->spec.heads *= G;
    p->spec.kv_heads *= G;
    p->spec.ring_size = r0->n_ranks * (int)G;
    p->spec.head_groups = G;
    p->sharded = true;
    p->parts = flags & 1;
    p->spec.trainer_ranks = p->parts ? p->spec.ring_size : 0;
    if (p->spec.max_held > 0 &&
        (p->group_held = calloc((size_t)p->spec.max_held * G, sizeof(uint64_t))) == NULL) {
        stria__lsess_close(p);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "stria_session_import: out of memory");
    }
    p->id = r0->id;
    p->layout = r0->layout;
    *out = p;
    return STRIA_OK;
}

/* ---- calls ---------------------------------------------------------------------- */

int stria__lgroup_stripe(const stria_session_t *p, int rank)
{
    if (!p->parts || p->n_groups < 2) /* its ring rank's own shard */
        return rank;
    const int G = p->n_groups, R = p->groups[0]->n_ranks;
    return rank % G * R + rank / G;
}

/* The ring rank whose worker of each ring trainer rank `rank` calls. */
static int ring_rank(const stria_session_t *p, int rank)
{
    return p->parts ? rank / p->n_groups : rank;
}

/* One head group's part of a call, on a thread of its own. */
typedef struct {
    stria_session_t *s;
    const char *fn;
    stria__lreq_t r;
    uint64_t held; /* its ring's handle of a forward it held */
    stria_status_t st;
    bool retryable;
    char msg[1024];
} group_call_t;

static void *group_call_main(void *arg)
{
    group_call_t *gc = arg;
    gc->st = stria__lsess_call(gc->s, gc->fn, &gc->r, gc->r.hold ? &gc->held : NULL);
    if (gc->st != STRIA_OK) {
        gc->retryable = stria_error_retryable();
        snprintf(gc->msg, sizeof(gc->msg), "%s", stria_error_msg());
    }
    return NULL;
}

/* Held forwards: a head-grouped session's handle of one is its first
 * ring's; slot i of p->held_call holds it, and p->group_held[i G + g] ring
 * g's. The slot of `held`, or -1. */
static int held_slot(const stria_session_t *p, uint64_t held)
{
    for (uint32_t i = 0; i < p->spec.max_held && i < 64; i++)
        if ((p->held_mask >> i & 1) && p->held_call[i] == held)
            return (int)i;
    return -1;
}

/* Lets slot i's forwards go on every ring that still holds one (rank:
 * a sharded rank's own), and frees the slot. */
static stria_status_t held_drop(stria_session_t *p, const char *fn, int rank, int i,
                                const bool *keep_gone)
{
    stria_status_t st = STRIA_OK;
    for (int g = 0; g < p->n_groups; g++) {
        if (keep_gone != NULL && keep_gone[g])
            continue;
        stria_status_t gs = stria__lsess_release_held(p->groups[g], fn, rank,
                                                      p->group_held[(size_t)i * p->n_groups + g]);
        if (gs != STRIA_OK && gs != STRIA_ERR_NOT_FOUND && st == STRIA_OK)
            st = stria_error_wrap(gs, "head group %d of %d", g, p->n_groups);
    }
    p->held_mask &= ~(UINT64_C(1) << i);
    return st;
}

stria_status_t stria__lgroup_release_held(stria_session_t *p, const char *fn, int rank,
                                          uint64_t held)
{
    rank = rank >= 0 ? ring_rank(p, rank) : rank;
    pthread_mutex_lock(&p->lock);
    int i = held_slot(p, held);
    stria_status_t st =
        i < 0 ? stria_error_set(STRIA_ERR_NOT_FOUND,
                                "%s: held forward %llu is not held (its backward ran, or it was "
                                "released)",
                                fn, (unsigned long long)held)
              : held_drop(p, fn, rank, i, NULL);
    pthread_mutex_unlock(&p->lock);
    return st;
}

stria_status_t stria__lgroup_call(stria_session_t *p, const char *fn, const stria__lreq_t *r,
                                  uint64_t *held_out)
{
    if (r->hold && p->spec.max_held == 0) /* as a session without head groups says it */
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: the session holds no forwards (its spec's max_held is 0)", fn);
    const int ranks = p->groups[0]->n_ranks * (p->parts ? p->n_groups : 1);
    if (p->parts && (r->rank < 0 || r->rank >= ranks))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: rank %d of a session called by %d trainer ranks (one per "
                               "worker)",
                               fn, r->rank == INT32_MAX ? -1 : r->rank, ranks);
    pthread_mutex_lock(&p->lock);
    const int G = p->n_groups;
    int slot = -1;
    if (r->use_held && (slot = held_slot(p, r->held)) < 0) {
        pthread_mutex_unlock(&p->lock);
        return stria_error_set(STRIA_ERR_NOT_FOUND,
                               "%s: held forward %llu is not held (its backward ran, or it was "
                               "released)",
                               fn, (unsigned long long)r->held);
    }
    for (uint32_t i = 0; r->hold && slot < 0 && i < p->spec.max_held && i < 64; i++)
        if (!(p->held_mask >> i & 1))
            slot = (int)i;
    if (r->hold && slot < 0) {
        pthread_mutex_unlock(&p->lock);
        return stria_error_set(STRIA_ERR_BUSY,
                               "%s: the session holds %u forwards already (max_held): run or "
                               "release one's backward first",
                               fn, p->spec.max_held);
    }
    group_call_t *gc = calloc((size_t)G, sizeof(*gc));
    pthread_t *th = calloc((size_t)G, sizeof(*th));
    bool *started = calloc((size_t)G, sizeof(*started));
    if (gc == NULL || th == NULL || started == NULL) {
        free(gc), free(th), free(started);
        pthread_mutex_unlock(&p->lock);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    const double t0 = stria_time_now();
    for (int g = 0; g < G; g++) {
        gc[g] = (group_call_t){.s = p->groups[g], .fn = fn, .r = *r};
        gc[g].r.progress = NULL;  /* (one ring's progress is not the call's) */
        gc[g].r.all_heads = true; /* the caller's tensors: every group's heads */
        if (p->parts) {           /* trainer rank h G + l: part l of ring rank h's shard */
            gc[g].r.rank = ring_rank(p, r->rank);
            gc[g].r.part = (uint32_t)(r->rank % G);
            gc[g].r.parts = (uint32_t)G;
        }
        if (r->use_held)
            gc[g].r.held = p->group_held[(size_t)slot * G + g];
        if (g > 0)
            started[g] = pthread_create(&th[g], NULL, group_call_main, &gc[g]) == 0;
    }
    group_call_main(&gc[0]);
    for (int g = 1; g < G; g++) {
        if (started[g])
            pthread_join(th[g], NULL);
        else /* no thread: this one runs it */
            group_call_main(&gc[g]);
    }
    stria_status_t st = STRIA_OK;
    stria_session_stats_t *ps = &p->stats;
    ps->last_pass_s = 0;
    ps->last_ring_bytes = ps->last_minflt = 0;
    ps->last_steps = 0;
    bool *gone = started; /* reused: per ring, whether it holds nothing of the call */
    for (int g = 0; g < G; g++) {
        if (gc[g].st != STRIA_OK && st == STRIA_OK) {
            st = stria_error_set(gc[g].st, "head group %d of %d: %s", g, G, gc[g].msg);
            stria_error_set_retryable(gc[g].retryable);
        }
        gone[g] = r->use_held ? gc[g].st == STRIA_OK : gc[g].st != STRIA_OK;
        if (r->hold)
            p->group_held[(size_t)slot * G + g] = gc[g].held;
        const stria_session_stats_t *gs = &p->groups[g]->stats;
        ps->last_pass_s = fmax(ps->last_pass_s, gs->last_pass_s);
        ps->last_ring_bytes += gs->last_ring_bytes;
        ps->last_minflt += gs->last_minflt;
        ps->last_steps = gs->last_steps > ps->last_steps ? gs->last_steps : ps->last_steps;
    }
    /* a held forward is the rings' together: one that failed on a ring is
     * let go on the others (the caller runs the forward again), and so is
     * what a backward left behind where it failed */
    if (r->hold && st == STRIA_OK) {
        p->held_mask |= UINT64_C(1) << slot;
        p->held_call[slot] = gc[0].held;
        if (held_out != NULL)
            *held_out = gc[0].held;
    } else if (r->hold || r->use_held) {
        char msg[1024];
        bool retryable = stria_error_retryable();
        snprintf(msg, sizeof(msg), "%s", st != STRIA_OK ? stria_error_msg() : "");
        p->held_mask |= UINT64_C(1) << slot; /* held_drop frees it */
        held_drop(p, fn, r->rank >= 0 && r->rank != INT32_MAX ? ring_rank(p, r->rank) : r->rank,
                  slot, gone);
        if (st != STRIA_OK) {
            stria_error_set(st, "%s%s", msg,
                            r->hold ? "" : "; the held forward is let go: run the forward again");
            stria_error_set_retryable(retryable);
        }
    }
    ps->last_call_s = stria_time_now() - t0;
    if (st == STRIA_OK)
        ps->calls++;
    else
        ps->failed++;
    free(gc), free(th), free(started);
    pthread_mutex_unlock(&p->lock);
    return st;
}

/* A head-grouped session's figures: its own calls, its rings' traffic and
 * openings. */
void stria__lgroup_stats(const stria_session_t *p, stria_session_stats_t *out)
{
    for (int g = 0; g < p->n_groups; g++) {
        stria_session_t *r = p->groups[g];
        pthread_mutex_lock(&r->lock);
        out->retries += r->stats.retries;
        out->reopened += r->stats.reopened;
        out->bytes_up += r->stats.bytes_up;
        out->bytes_down += r->stats.bytes_down;
        out->generation =
            r->stats.generation > out->generation ? r->stats.generation : out->generation;
        pthread_mutex_unlock(&r->lock);
    }
}
