#include "stria_spec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

bool stria_job_masks_copy(const Stria__V1__JobSpec *s, stria_job_masks_t *m)
{
    memset(m, 0, sizeof(*m));
    if (s->n_cu_seqlens > 0) {
        m->cu_seqlens = malloc(s->n_cu_seqlens * sizeof(int64_t));
        if (m->cu_seqlens == NULL)
            return false;
        memcpy(m->cu_seqlens, s->cu_seqlens, s->n_cu_seqlens * sizeof(int64_t));
        m->n_cu_seqlens = s->n_cu_seqlens;
    }
    m->has_window = s->window != NULL;
    m->window_left = s->window != NULL ? s->window->left : 0;
    m->window_right = s->window != NULL ? s->window->right : 0;
    return true;
}

void stria_job_masks_free(stria_job_masks_t *m)
{
    free(m->cu_seqlens);
    memset(m, 0, sizeof(*m));
}

/* ---- a session call's shape --------------------------------------------- */

stria_status_t stria_call_masks_check(const stria_call_shape_t *c)
{
    const int64_t *cu = c->cu_seqlens;
    size_t n = c->n_cu_seqlens;
    if (n > STRIA_CALL_MAX_CU_SEQLENS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "cu_seqlens has %zu entries, more than the limit of %d", n,
                               STRIA_CALL_MAX_CU_SEQLENS);
    if (n > 0 && cu == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "cu_seqlens is NULL with %zu entries", n);
    if (n > 0 && cu[0] != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "cu_seqlens must start at 0 (got %lld)",
                               (long long)cu[0]);
    for (size_t i = 1; i < n; i++)
        if (cu[i] < cu[i - 1])
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "cu_seqlens must not decrease (entry %zu is %lld after %lld)", i,
                                   (long long)cu[i], (long long)cu[i - 1]);
    if (n > 0 && cu[n - 1] != c->seq_len)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "cu_seqlens must end at seq_len (%lld) (got %lld)",
                               (long long)c->seq_len, (long long)cu[n - 1]);
    if (!c->has_window && (c->window_left != 0 || c->window_right != 0))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "window_left/window_right are set (%lld, %lld) but has_window is "
                               "false",
                               (long long)c->window_left, (long long)c->window_right);
    if (c->has_window && (c->window_left < -1 || c->window_right < -1))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "window.%s must be >= -1 (-1: unbounded) (got %lld)",
                               c->window_left < -1 ? "left" : "right",
                               (long long)(c->window_left < -1 ? c->window_left : c->window_right));
    if (c->has_window && c->causal && c->window_right > 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "window.right must be 0 or -1 with causal attention (got %lld)",
                               (long long)c->window_right);
    return STRIA_OK;
}

stria_status_t stria_call_shape_check(const stria_call_shape_t *c, const stria_call_bounds_t *b)
{
    if (c->batch < 1 || c->batch > b->max_batch)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "call batch must be 1..%lld, the session's max_batch (got %lld)",
                               (long long)b->max_batch, (long long)c->batch);
    /* shorter than the ring is fine: ranks past the end hold padding only */
    if (c->seq_len < 1 || c->seq_len > STRIA_LAYOUT_MAX_SEQ)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "call seq_len must be at least 1 (got %lld)",
                               (long long)c->seq_len);
    if (c->seq_len > b->max_batch * b->max_seq_len / c->batch)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "call batch x seq_len (%lld x %lld) exceeds the session's bound "
                               "max_batch x max_seq_len (%lld x %lld)",
                               (long long)c->batch, (long long)c->seq_len, (long long)b->max_batch,
                               (long long)b->max_seq_len);
    if (!isfinite(c->scale) || c->scale < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "call scale must be finite and >= 0 (0: 1/sqrt(head_dim)) (got %g)",
                               (double)c->scale);
    stria_status_t st = stria_call_masks_check(c);
    return st == STRIA_OK ? st : stria_error_wrap(st, "call");
}

void stria_call_shape_to_pb(const stria_call_shape_t *c, Stria__V1__CallShape *pb,
                            Stria__V1__JobSpec__Window *win)
{
    stria__v1__call_shape__init(pb);
    stria__v1__job_spec__window__init(win);
    pb->batch = (uint32_t)c->batch;
    pb->seq_len = (uint64_t)c->seq_len;
    pb->causal = c->causal;
    pb->scale = c->scale;
    pb->n_cu_seqlens = c->n_cu_seqlens;
    pb->cu_seqlens = (int64_t *)c->cu_seqlens;
    if (c->has_window) {
        win->left = c->window_left;
        win->right = c->window_right;
        pb->window = win;
    }
}

void stria_call_shape_from_spec(const Stria__V1__JobSpec *s, stria_call_shape_t *c)
{
    memset(c, 0, sizeof(*c));
    c->batch = s->batch;
    c->seq_len = s->seq_len > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)s->seq_len;
    c->causal = s->causal;
    c->scale = s->scale;
    c->cu_seqlens = s->cu_seqlens;
    c->n_cu_seqlens = s->n_cu_seqlens;
    c->has_window = s->window != NULL;
    c->window_left = s->window != NULL ? s->window->left : 0;
    c->window_right = s->window != NULL ? s->window->right : 0;
}

void stria_call_shape_to_spec(const stria_call_shape_t *c, Stria__V1__JobSpec *s,
                              Stria__V1__JobSpec__Window *win)
{
    stria__v1__job_spec__window__init(win);
    s->batch = (uint32_t)c->batch;
    s->seq_len = (uint64_t)c->seq_len;
    s->causal = c->causal;
    s->scale = c->scale;
    s->cu_seqlens = (int64_t *)c->cu_seqlens;
    s->n_cu_seqlens = c->n_cu_seqlens;
    s->window = NULL;
    if (c->has_window) {
        win->left = c->window_left;
        win->right = c->window_right;
        s->window = win;
    }
}

void stria_call_shape_from_pb(const Stria__V1__CallShape *pb, stria_call_shape_t *c)
{
    memset(c, 0, sizeof(*c));
    c->batch = pb->batch;
    c->seq_len = pb->seq_len > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)pb->seq_len;
    c->causal = pb->causal;
    c->scale = pb->scale;
    c->cu_seqlens = pb->cu_seqlens;
    c->n_cu_seqlens = pb->n_cu_seqlens;
    c->has_window = pb->window != NULL;
    c->window_left = pb->window != NULL ? pb->window->left : 0;
    c->window_right = pb->window != NULL ? pb->window->right : 0;
}

/* FNV-1a over the fields, in a fixed order and width. */
static uint64_t stria__fnv(uint64_t h, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        h ^= (v >> (8 * i)) & 0xffu;
        h *= 1099511628211ull;
    }
    return h;
}

uint64_t stria_call_shape_digest(const stria_call_shape_t *c, uint64_t call, bool backward)
{
    uint32_t scale_bits;
    memcpy(&scale_bits, &c->scale, sizeof(scale_bits));
    uint64_t h = 14695981039346656037ull;
    h = stria__fnv(h, call);
    h = stria__fnv(h, backward);
    h = stria__fnv(h, (uint64_t)c->batch);
    h = stria__fnv(h, (uint64_t)c->seq_len);
    h = stria__fnv(h, c->causal);
    h = stria__fnv(h, scale_bits);
    h = stria__fnv(h, c->n_cu_seqlens);
    for (size_t i = 0; i < c->n_cu_seqlens; i++)
        h = stria__fnv(h, (uint64_t)c->cu_seqlens[i]);
    h = stria__fnv(h, c->has_window);
    h = stria__fnv(h, (uint64_t)c->window_left);
    return stria__fnv(h, (uint64_t)c->window_right);
}

void stria_call_place_from_pb(const Stria__V1__SessionCallRequest *req, stria_call_place_t *p)
{
    *p = (stria_call_place_t){.call = req->call,
                              .link_epoch = req->link_epoch,
                              .backward = req->backward,
                              .arena = req->arena,
                              .arena_in = req->arena_in,
                              .arena_out = req->arena_out,
                              .more = req->more,
                              .piece_offset = req->piece_offset,
                              .hold = req->hold,
                              .use_held = req->use_held,
                              .held_call = req->held_call};
}

void stria_call_place_to_pb(const stria_call_place_t *p, Stria__V1__SessionCallRequest *req)
{
    req->call = p->call;
    req->link_epoch = p->link_epoch;
    req->backward = p->backward;
    req->arena = p->arena;
    req->arena_in = p->arena ? p->arena_in : 0;
    req->arena_out = p->arena ? p->arena_out : 0;
    req->more = p->more;
    req->piece_offset = p->piece_offset;
    req->hold = p->hold;
    req->use_held = p->use_held;
    req->held_call = p->use_held ? p->held_call : 0;
}

void stria_call_binding(const stria_call_shape_t *c, const stria_call_place_t *p,
                        uint8_t out[STRIA_CALL_BINDING_BYTES])
{
    stria_put_le64(out, p->call);
    stria_put_le64(out + 8, p->link_epoch);
    stria_put_le64(out + 16, stria_call_shape_digest(c, p->call, p->backward));
    out[24] = (uint8_t)((p->arena ? 1 : 0) | (p->more ? 2 : 0) | (p->hold ? 4 : 0) |
                        (p->use_held ? 8 : 0));
    stria_put_le64(out + 25, p->arena ? p->arena_in : 0);
    stria_put_le64(out + 33, p->arena ? p->arena_out : 0);
    stria_put_le64(out + 41, p->piece_offset);
    stria_put_le64(out + 49, p->use_held ? p->held_call : 0);
}
