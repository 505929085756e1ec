/* The call record and its rules (see stria_call.h). The messages are the ones
 * every door has shown since the record existed: users and tests read them. */
#include "stria_call.h"

#include "stria_docplan.h"
#include "stria_layout.h"
#include "stria_net.h"
#include "stria_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the rule book ------------------------------------------------------- */

stria_status_t stria_call_docs_check(const int64_t *cu, size_t n)
{
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
    return STRIA_OK;
}

stria_status_t stria_call_window_check(bool has_window, int64_t left, int64_t right, bool causal)
{
    if (!has_window && (left != 0 || right != 0))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "window_left/window_right are set (%lld, %lld) but has_window is "
                               "false",
                               (long long)left, (long long)right);
    if (has_window && (left < -1 || right < -1))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "window.%s must be >= -1 (-1: unbounded) (got %lld)",
                               left < -1 ? "left" : "right", (long long)(left < -1 ? left : right));
    if (has_window && causal && right > 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "window.right must be 0 or -1 with causal attention (got %lld)",
                               (long long)right);
    return STRIA_OK;
}

stria_status_t stria_call_masks_check(const stria_call_shape_t *c)
{
    size_t n = c->n_cu_seqlens;
    if (n > STRIA_CALL_MAX_CU_SEQLENS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "cu_seqlens has %zu entries, more than the limit of %d", n,
                               STRIA_CALL_MAX_CU_SEQLENS);
    stria_status_t st = stria_call_docs_check(c->cu_seqlens, n);
    if (st != STRIA_OK)
        return st;
    if (n > 0 && c->cu_seqlens[n - 1] != c->seq_len)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "cu_seqlens must end at seq_len (%lld) (got %lld)",
                               (long long)c->seq_len, (long long)c->cu_seqlens[n - 1]);
    return stria_call_window_check(c->has_window, c->window_left, c->window_right, c->causal);
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

/* ---- the record ----------------------------------------------------------- */

bool stria_call_shape_equal(const stria_call_shape_t *a, const stria_call_shape_t *b)
{
    return a->batch == b->batch && a->seq_len == b->seq_len && a->causal == b->causal &&
           a->scale == b->scale && a->has_window == b->has_window &&
           a->window_left == b->window_left && a->window_right == b->window_right &&
           a->n_cu_seqlens == b->n_cu_seqlens &&
           (a->n_cu_seqlens == 0 ||
            memcmp(a->cu_seqlens, b->cu_seqlens, a->n_cu_seqlens * sizeof(int64_t)) == 0);
}

stria_status_t stria_call_shape_copy(const stria_call_shape_t *src, stria_call_shape_t *dst)
{
    stria_call_shape_t c = *src;
    c.cu_seqlens = NULL;
    if (src->n_cu_seqlens > 0) {
        int64_t *cu = malloc(src->n_cu_seqlens * sizeof(int64_t));
        if (cu == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for %zu cu_seqlens entries",
                                   src->n_cu_seqlens);
        memcpy(cu, src->cu_seqlens, src->n_cu_seqlens * sizeof(int64_t));
        c.cu_seqlens = cu;
    }
    *dst = c;
    return STRIA_OK;
}

void stria_call_shape_free(stria_call_shape_t *c)
{
    free((void *)c->cu_seqlens); /* the copy's own: const only to its readers */
    memset(c, 0, sizeof(*c));
}

float stria_call_scale(float scale, int64_t head_dim)
{
    return scale > 0 ? scale : (float)(1.0 / sqrt((double)head_dim));
}

uint64_t stria_call_shape_digest(const stria_call_shape_t *c, int layout, uint64_t call,
                                 bool backward)
{
    uint32_t scale_bits;
    memcpy(&scale_bits, &c->scale, sizeof(scale_bits));
    uint64_t h = STRIA_FNV64_INIT;
    h = stria_fnv64(h, call);
    h = stria_fnv64(h, backward);
    h = stria_fnv64(h, (uint64_t)layout);
    if (layout == STRIA_LAYOUT_PACKED)
        h = stria_fnv64(h, STRIA_DOCPLAN_VERSION);
    h = stria_fnv64(h, (uint64_t)c->batch);
    h = stria_fnv64(h, (uint64_t)c->seq_len);
    h = stria_fnv64(h, c->causal);
    h = stria_fnv64(h, scale_bits);
    h = stria_fnv64(h, c->n_cu_seqlens);
    for (size_t i = 0; i < c->n_cu_seqlens; i++)
        h = stria_fnv64(h, (uint64_t)c->cu_seqlens[i]);
    h = stria_fnv64(h, c->has_window);
    h = stria_fnv64(h, (uint64_t)c->window_left);
    return stria_fnv64(h, (uint64_t)c->window_right);
}

void stria_call_binding(const stria_call_shape_t *c, int layout, const stria_call_place_t *p,
                        uint8_t out[STRIA_CALL_BINDING_BYTES])
{
    stria_put_le64(out, p->call);
    stria_put_le64(out + 8, p->link_epoch);
    stria_put_le64(out + 16, stria_call_shape_digest(c, layout, p->call, p->backward));
    out[24] = (uint8_t)((p->arena ? 1 : 0) | (p->more ? 2 : 0) | (p->hold ? 4 : 0) |
                        (p->use_held ? 8 : 0));
    stria_put_le64(out + 25, p->arena ? p->arena_in : 0);
    stria_put_le64(out + 33, p->arena ? p->arena_out : 0);
    stria_put_le64(out + 41, p->piece_offset);
    stria_put_le64(out + 49, p->use_held ? p->held_call : 0);
    stria_put_le16(out + 57, (uint16_t)p->part);
    stria_put_le16(out + 59, (uint16_t)p->parts);
}
