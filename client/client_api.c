/* libstria's session API (stria_session_*, stria_call_shard_tokens,
 * stria_call_positions): the public functions over sessions
 * (client_session.c) and head groups (client_groups.c): specs read and
 * checked, calls dispatched, the client's list of its sessions. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"

static stria_status_t read_session_spec(const stria_session_spec_t *in, stria_session_spec_t *out)
{
    stria_status_t st =
        stria__labi_read(out, sizeof(*out), STRIA__V1_END(stria_session_spec_t, placement_fallback),
                         in, "stria_session_spec_t", "STRIA_SESSION_SPEC_INIT");
    if (st != STRIA_OK)
        return st;
    if (out->kv_heads == 0)
        out->kv_heads = out->heads;
    if (out->max_batch < 1 || out->max_seq_len < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: max_batch and max_seq_len (the bounds of a call) "
                               "are required (got %lld, %lld)",
                               (long long)out->max_batch, (long long)out->max_seq_len);
    if (!isfinite(out->idle_timeout_s) || out->idle_timeout_s < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: idle_timeout_s must be finite and >= 0 (got %g)",
                               out->idle_timeout_s);
    if (out->sharded && out->ring_size < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: a sharded session needs ring_size: the trainer's "
                               "world size");
    if (out->max_held > STRIA__MAX_HELD)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: max_held must be at most %d forwards (got %u)",
                               STRIA__MAX_HELD, out->max_held);
    if (out->trainer_ranks != 0 && !out->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: trainer_ranks %d is for a sharded session (a "
                               "whole-sequence one has one caller)",
                               out->trainer_ranks);
    if (out->trainer_ranks != 0 && out->head_groups <= 1 && out->trainer_ranks != out->ring_size)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: trainer_ranks %d: without head groups a sharded "
                               "session's trainer ranks are its ring_size (%d)",
                               out->trainer_ranks, out->ring_size);
    return STRIA_OK;
}

static void link_session(stria_session_t *s)
{
    s->next = s->client->sessions;
    s->client->sessions = s;
}

static void unlink_session(stria_session_t *s)
{
    stria_session_t **pp = &s->client->sessions;
    while (*pp != NULL && *pp != s)
        pp = &(*pp)->next;
    if (*pp == s)
        *pp = s->next;
}

stria_status_t stria_session_open(stria_client_t *client, const stria_session_spec_t *spec,
                                  stria_session_t **session_out)
{
    stria_session_spec_t sp;
    stria_status_t st;
    if (client == NULL || spec == NULL || session_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_open: NULL argument");
    if ((st = read_session_spec(spec, &sp)) != STRIA_OK)
        return st;
    if (sp.head_groups == STRIA_HEAD_GROUPS_AUTO && !sp.sharded &&
        (st = stria__lgroup_auto(client, &sp)) != STRIA_OK)
        return st;
    if (sp.head_groups == STRIA_HEAD_GROUPS_AUTO) /* sharded: one ring (its world size) */
        sp.head_groups = 1;
    /* the job spec of a session: its bounds as batch and seq_len */
    stria__lopen_t o = {
        .session = true, .sharded = sp.sharded, .max_held = sp.max_held, .retries = -1};
    o.js = (stria_job_spec_t)STRIA_JOB_SPEC_INIT;
    o.js.batch = sp.max_batch;
    o.js.seq_len = sp.max_seq_len;
    o.js.heads = sp.heads;
    o.js.kv_heads = sp.kv_heads;
    o.js.head_dim = sp.head_dim;
    o.js.dtype = sp.dtype;
    o.js.causal = true;
    o.js.layout = sp.layout;
    o.js.ring_size = sp.ring_size;
    o.js.step_timeout_s = sp.step_timeout_s;
    o.js.ttl_s = sp.idle_timeout_s;
    o.js.no_queue = sp.no_queue;
    o.js.label = sp.label;
    o.js.arrival_timeout_s = sp.arrival_timeout_s;
    o.js.placement_hosts = sp.placement_hosts;
    o.js.placement_devices = sp.placement_devices;
    o.js.placement_fallback = sp.placement_fallback;
    stria_session_t *s = NULL;
    if ((st = sp.head_groups > 1
                  ? stria__lgroup_open(client, &o, &sp, &s)
                  : stria__lsess_open(client, &o, &sp, NULL, NULL, &s)) != STRIA_OK) {
        char msg[1024];
        bool retryable = stria_error_retryable();
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria_error_set(st, "stria_session_open: %s", msg);
        stria_error_set_retryable(retryable);
        return st;
    }
    link_session(s);
    *session_out = s;
    return STRIA_OK;
}

stria_status_t stria_session_export(const stria_session_t *s, void *out, size_t cap,
                                    size_t *len_out)
{
    uint8_t *b = out;
    if (s == NULL || out == NULL || len_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_export: NULL argument");
    if (s->n_groups > 0)
        return stria__lgroup_export(s, out, cap, len_out);
    if (!s->sharded || s->id == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_export: only a sharded session can be shared");
    if (cap < STRIA_SESSION_EXPORT_BYTES)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_export: %zu bytes of room, %d needed", cap,
                               STRIA_SESSION_EXPORT_BYTES);
    memcpy(b, s->job ? STRIA__JOB_EXPORT_MAGIC : STRIA__SESSION_EXPORT_MAGIC, 8);
    stria_put_le64(b + 8, s->id);
    memcpy(b + 16, s->secret.bytes, sizeof(s->secret.bytes));
    *len_out = STRIA_SESSION_EXPORT_BYTES;
    return STRIA_OK;
}

stria_status_t stria_session_import(stria_client_t *client, const void *bytes, size_t len,
                                    stria_session_t **session_out)
{
    stria_session_t *s = NULL;
    if (client == NULL || bytes == NULL || session_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_import: NULL argument");
    stria_status_t st = stria__lgroup_is_export(bytes, len)
                            ? stria__lgroup_import(client, bytes, len, &s)
                            : stria__lsess_import(client, bytes, len, false, &s);
    if (st != STRIA_OK)
        return st;
    link_session(s);
    *session_out = s;
    return STRIA_OK;
}

/* A call of the public API: its record read, then tried. */
static stria_status_t public_call(stria_session_t *s, const char *fn, const stria_call_t *call,
                                  stria__lreq_t *r, uint64_t *held_out)
{
    stria_call_shape_t c;
    stria_status_t st = stria__labi_call(call, &c);
    if (st != STRIA_OK)
        return st;
    r->shape = &c;
    r->retries = -1;
    if (s != NULL && s->n_groups > 0)
        return stria__lgroup_call(s, fn, r, held_out);
    return stria__lsess_call(s, fn, r, held_out);
}

stria_status_t stria_session_forward(stria_session_t *session, const stria_call_t *call,
                                     const void *q, const void *k, const void *v, void *o,
                                     float *lse)
{
    const stria__lio_t io = {.in = {q, k, v}, .out = {o, lse}};
    stria__lreq_t r = {.rank = -1, .io = &io};
    return public_call(session, "stria_session_forward", call, &r, NULL);
}

stria_status_t stria_session_backward(stria_session_t *session, const stria_call_t *call,
                                      const void *q, const void *k, const void *v, const void *o,
                                      const float *lse, const void *d_o, void *dq, void *dk,
                                      void *dv)
{
    const stria__lio_t io = {.in = {q, k, v, o, lse, d_o}, .out = {dq, dk, dv}};
    stria__lreq_t r = {.rank = -1, .backward = true, .io = &io};
    return public_call(session, "stria_session_backward", call, &r, NULL);
}

static stria_status_t must_be_sharded(const stria_session_t *s, const char *fn)
{
    if (s != NULL && !s->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: the session is not sharded", fn);
    return STRIA_OK;
}

stria_status_t stria_session_forward_shard(stria_session_t *session, const stria_call_t *call,
                                           int rank, const void *q, const void *k, const void *v,
                                           void *o, float *lse)
{
    static const char fn[] = "stria_session_forward_shard";
    const stria__lio_t io = {.in = {q, k, v}, .out = {o, lse}};
    stria__lreq_t r = {.rank = rank < 0 ? INT32_MAX : rank, .io = &io};
    stria_status_t st = must_be_sharded(session, fn);
    return st != STRIA_OK ? st : public_call(session, fn, call, &r, NULL);
}

stria_status_t stria_session_backward_shard(stria_session_t *session, const stria_call_t *call,
                                            int rank, const void *q, const void *k, const void *v,
                                            const void *o, const float *lse, const void *d_o,
                                            void *dq, void *dk, void *dv)
{
    static const char fn[] = "stria_session_backward_shard";
    const stria__lio_t io = {.in = {q, k, v, o, lse, d_o}, .out = {dq, dk, dv}};
    stria__lreq_t r = {.rank = rank < 0 ? INT32_MAX : rank, .backward = true, .io = &io};
    stria_status_t st = must_be_sharded(session, fn);
    return st != STRIA_OK ? st : public_call(session, fn, call, &r, NULL);
}

stria_status_t stria_session_forward_held(stria_session_t *session, const stria_call_t *call,
                                          int rank, const void *q, const void *k, const void *v,
                                          void *o, float *lse, uint64_t *held_out)
{
    const stria__lio_t io = {.in = {q, k, v}, .out = {o, lse}};
    stria__lreq_t r = {.rank = rank, .hold = true, .io = &io};
    if (held_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_forward_held: NULL held_out");
    return public_call(session, "stria_session_forward_held", call, &r, held_out);
}

stria_status_t stria_session_backward_held(stria_session_t *session, const stria_call_t *call,
                                           int rank, uint64_t held, const void *d_o, void *dq,
                                           void *dk, void *dv)
{
    const stria__lio_t io = {.in = {NULL, NULL, NULL, NULL, NULL, d_o}, .out = {dq, dk, dv}};
    stria__lreq_t r = {.rank = rank, .backward = true, .use_held = true, .held = held, .io = &io};
    return public_call(session, "stria_session_backward_held", call, &r, NULL);
}

stria_status_t stria_session_release_held(stria_session_t *s, int rank, uint64_t held)
{
    if (s != NULL && s->n_groups > 0)
        return stria__lgroup_release_held(s, "stria_session_release_held", rank, held);
    return stria__lsess_release_held(s, "stria_session_release_held", rank, held);
}

stria_status_t stria_session_buffer(stria_session_t *s, const stria_call_t *call, int rank,
                                    stria_tensor_id_t tensor, stria_shard_buffer_t *out)
{
    stria_call_shape_t c;
    stria_status_t st = stria__labi_call(call, &c);
    if (st != STRIA_OK)
        return st;
    if (s != NULL && s->n_groups > 0)
        return stria_error_set(STRIA_ERR_UNSUPPORTED,
                               "stria_session_buffer: a head-grouped session's rank sends each "
                               "ring its heads' bytes of its tensors (no one buffer holds a "
                               "rank's tensor): pass buffers of your own");
    return stria__lsess_buffer(s, "stria_session_buffer", &c, rank, tensor, out);
}

stria_session_t *stria_session_head_group(stria_session_t *s, int g)
{
    if (s == NULL || g < 0 || g >= s->n_groups) {
        stria_error_set(STRIA_ERR_INVALID_ARG,
                        "stria_session_head_group: group %d of a session of %d head groups", g,
                        s != NULL ? s->n_groups : 0);
        return NULL;
    }
    return s->groups[g];
}

int stria_session_ranks(const stria_session_t *s)
{
    if (s != NULL && s->n_groups > 0) /* a ring's ranks, or with parts every worker */
        return s->groups[0]->n_ranks * (s->parts ? s->n_groups : 1);
    return s != NULL && s->id != 0 ? s->n_ranks : 0;
}

int64_t stria_session_shard_tokens(const stria_session_t *s, int64_t seq_len, int rank)
{
    if (s == NULL || s->id == 0)
        return -1;
    stria_call_t call = STRIA_CALL_INIT;
    call.seq_len = seq_len;
    if (rank < 0 || rank >= stria_session_ranks(s))
        return -1;
    return stria_call_shard_tokens(s->layout, stria_session_ranks(s), &call,
                                   stria__lgroup_stripe(s, rank));
}

stria_status_t stria_session_positions(const stria_session_t *s, int64_t seq_len, int rank,
                                       int64_t *positions_out)
{
    if (s == NULL || s->id == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_positions: NULL or unopened session");
    stria_call_t call = STRIA_CALL_INIT;
    call.seq_len = seq_len;
    if (rank < 0 || rank >= stria_session_ranks(s))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_positions: rank %d of a session of %d ranks", rank,
                               stria_session_ranks(s));
    return stria_call_positions(s->layout, stria_session_ranks(s), &call,
                                stria__lgroup_stripe(s, rank), positions_out);
}

int64_t stria_call_shard_tokens(stria_layout_kind_t layout, int n_ranks, const stria_call_t *call,
                                int rank)
{
    stria_call_shape_t shape;
    int64_t n;
    if (stria__labi_call(call, &shape) != STRIA_OK ||
        stria__lcall_positions("stria_call_shard_tokens", layout, n_ranks, &shape, rank, &n,
                               NULL) != STRIA_OK)
        return -1;
    return n;
}

stria_status_t stria_call_positions(stria_layout_kind_t layout, int n_ranks,
                                    const stria_call_t *call, int rank, int64_t *positions_out)
{
    stria_call_shape_t shape;
    if (positions_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_call_positions: positions_out is NULL");
    stria_status_t st = stria__labi_call(call, &shape);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "stria_call_positions");
    return stria__lcall_positions("stria_call_positions", layout, n_ranks, &shape, rank, NULL,
                                  positions_out);
}

int stria_session_ring_size(const stria_session_t *s)
{
    if (s != NULL && s->n_groups > 0) /* head groups x the ranks of each ring */
        return s->n_groups * s->groups[0]->n_ranks;
    return s != NULL && s->id != 0 ? s->n_ranks : 0;
}

stria_layout_kind_t stria_session_layout(const stria_session_t *s)
{
    if (s == NULL)
        return STRIA_LAYOUT_STRIPED;
    return s->id != 0 ? s->layout : s->spec.layout; /* auto: as the coordinator chose */
}

stria_status_t stria_session_spec_get(const stria_session_t *s, stria_session_spec_t *out)
{
    if (s == NULL || out == NULL || out->struct_size != sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_spec_get: NULL argument or a struct_size this "
                               "library cannot fill (start from STRIA_SESSION_SPEC_INIT)");
    *out = s->spec; /* its strings and arrays were not kept */
    if (s->id != 0) {
        out->ring_size = stria_session_ring_size(s);
        out->layout = s->layout;
    }
    return STRIA_OK;
}

uint64_t stria_session_id(const stria_session_t *s)
{
    if (s != NULL && s->n_groups > 0) /* head groups: its first ring's (replaced or not) */
        return s->groups[0]->id;
    return s != NULL ? s->id : 0;
}

stria_status_t stria_session_stats(const stria_session_t *s, stria_session_stats_t *out)
{
    if (s == NULL || out == NULL || out->struct_size == 0 || out->struct_size > sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_stats: NULL argument or a struct_size this library "
                               "cannot fill (start from STRIA_SESSION_STATS_INIT)");
    size_t size = out->struct_size;
    pthread_mutex_lock((pthread_mutex_t *)&s->lock);
    stria_session_stats_t ours = s->stats;
    pthread_mutex_unlock((pthread_mutex_t *)&s->lock);
    stria__lgroup_stats(s, &ours);
    ours.struct_size = size;
    memcpy(out, &ours, size);
    return STRIA_OK;
}

stria_status_t stria_session_close(stria_session_t *s)
{
    if (s == NULL)
        return STRIA_OK;
    if (s->group_of > 1) /* a ring of a head-grouped session (stria_session_head_group) */
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_close: head group %d's ring is borrowed from its "
                               "session: close that one",
                               s->group);
    unlink_session(s);
    return stria__lsess_close(s);
}
