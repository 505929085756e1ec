/* Argument checks shared by the attention entry points of every device (see
 * validate_int.h). The messages are those of kernels/attn.c. */
#include "validate_int.h"

#include <math.h>

/* Returns the status of a failed check. */
#define STRIA__V(call)                                                                             \
    do {                                                                                           \
        stria_status_t st_ = (call);                                                               \
        if (st_ != STRIA_OK)                                                                       \
            return st_;                                                                            \
    } while (0)

/* The documents list and window: the call record's rules (stria_call.h);
 * where the list must end is checked against the positions
 * (stria__validate_doc_end()). */
static stria_status_t stria__validate_masks(const stria_attn_params_t *p, const char *fn)
{
    stria_status_t st = stria_call_docs_check(p->cu_seqlens, p->n_cu_seqlens);
    if (st == STRIA_OK)
        st = stria_call_window_check(p->has_window, p->window_left, p->window_right, p->causal);
    return st == STRIA_OK ? st : stria_error_wrap(st, "%s: params", fn);
}

stria_status_t stria__validate_shape(const stria_attn_params_t *p, const char *fn)
{
    if (p == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: params is NULL", fn);
    if (p->batch < 1 || p->q_tokens < 1 || p->kv_tokens < 1 || p->heads < 1 || p->kv_heads < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: sizes must be >= 1 (batch=%lld q_tokens=%lld kv_tokens=%lld "
                               "heads=%lld kv_heads=%lld)",
                               fn, (long long)p->batch, (long long)p->q_tokens,
                               (long long)p->kv_tokens, (long long)p->heads,
                               (long long)p->kv_heads);
    if (p->batch > INT32_MAX || p->q_tokens > INT32_MAX || p->kv_tokens > INT32_MAX ||
        p->heads > 65536 || p->kv_heads > 65536)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: sizes too large", fn);
    if (p->heads % p->kv_heads != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: heads (%lld) must be a multiple of kv_heads (%lld)", fn,
                               (long long)p->heads, (long long)p->kv_heads);
    if (p->head_dim < STRIA_HEAD_DIM_MIN || p->head_dim > STRIA_HEAD_DIM_MAX ||
        p->head_dim % 8 != 0)
        return stria_error_set(STRIA_ERR_UNSUPPORTED,
                               "%s: head_dim %lld unsupported (must be a multiple of 8 in %d..%d)",
                               fn, (long long)p->head_dim, STRIA_HEAD_DIM_MIN, STRIA_HEAD_DIM_MAX);
    if (!(p->scale >= 0.0f) || isinf(p->scale))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: scale must be a finite number > 0 (or 0 for the default)", fn);
    return stria__validate_masks(p, fn);
}

stria_status_t stria__validate_doc_end(const stria_attn_params_t *p, const int64_t *pos, int64_t n,
                                       const char *fn, const char *which)
{
    int64_t mx = -1;
    if (p->n_cu_seqlens == 0)
        return STRIA_OK;
    for (int64_t i = 0; i < n; i++)
        mx = pos[i] > mx ? pos[i] : mx;
    if (p->cu_seqlens[p->n_cu_seqlens - 1] <= mx)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: params.cu_seqlens ends at %lld but the %s positions reach "
                               "%lld; the last entry must be past every position",
                               fn, (long long)p->cu_seqlens[p->n_cu_seqlens - 1], which,
                               (long long)mx);
    return STRIA_OK;
}

stria_status_t stria__validate_rows(const stria_attn_params_t *p, const char *fn)
{
    stria_attn_params_t tmp;
    if (p == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: params is NULL", fn);
    tmp = *p;
    tmp.kv_tokens = 1;
    tmp.kv_heads = 1;
    return stria__validate_shape(&tmp, fn);
}

stria_status_t stria__validate_view(const stria_tensor_t *t, const char *fn, const char *name)
{
    if (t == NULL || t->data == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: tensor %s is NULL", fn, name);
    if (stria_dtype_size(t->dtype) == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: tensor %s has unknown dtype %d", fn,
                               name, (int)t->dtype);
    return STRIA_OK;
}

stria_status_t stria__validate_tensor(const stria_tensor_t *t, const char *fn, const char *name,
                                      int64_t tokens, int64_t heads, int64_t dim, bool need_f32)
{
    STRIA__V(stria__validate_view(t, fn, name));
    if (need_f32 && t->dtype != STRIA_DTYPE_F32)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: tensor %s must be fp32, not %s", fn,
                               name, stria_dtype_name(t->dtype));
    if (t->stride_batch < 0 || t->stride_token < 0 || t->stride_head < 0 ||
        (tokens > 1 && t->stride_token == 0) || (heads > 1 && t->stride_head == 0) ||
        (heads > 1 && t->stride_head < dim && t->stride_token >= dim * heads))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: tensor %s has invalid strides (batch=%lld token=%lld "
                               "head=%lld, head_dim=%lld)",
                               fn, name, (long long)t->stride_batch, (long long)t->stride_token,
                               (long long)t->stride_head, (long long)dim);
    return STRIA_OK;
}

stria_status_t stria__validate_positions(const stria_positions_t *pos, int64_t tokens,
                                         const char *fn, const char *which, int64_t *out)
{
    int64_t n = 0;

    if (pos->runs == NULL || pos->n_runs == 0) {
        for (int64_t i = 0; i < tokens; i++)
            out[i] = i;
        return STRIA_OK;
    }
    for (size_t r = 0; r < pos->n_runs; r++) {
        const stria_pos_run_t *run = &pos->runs[r];
        int64_t last;
        if (run->count < 0 || run->count > tokens - n)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "%s: %s position runs hold more than the block's %lld tokens",
                                   fn, which, (long long)tokens);
        if (run->count == 0)
            continue;
        if (__builtin_mul_overflow(run->count - 1, run->stride, &last) ||
            __builtin_add_overflow(last, run->first, &last) || run->first < 0 ||
            run->first >= STRIA__POS_LIMIT_V || last < 0 || last >= STRIA__POS_LIMIT_V)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "%s: %s position run %zu (first=%lld stride=%lld count=%lld) "
                                   "leaves [0, 2^62)",
                                   fn, which, r, (long long)run->first, (long long)run->stride,
                                   (long long)run->count);
        for (int64_t i = 0; i < run->count; i++)
            out[n++] = run->first + i * run->stride;
    }
    if (n != tokens)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: %s position runs cover %lld tokens, the block has %lld", fn,
                               which, (long long)n, (long long)tokens);
    return STRIA_OK;
}

float stria__attn_scale(const stria_attn_params_t *p)
{
    return p->scale > 0.0f ? p->scale : 1.0f / sqrtf((float)p->head_dim);
}

stria__attn_dims_t stria__attn_dims(const stria_attn_params_t *p)
{
    stria__attn_dims_t d;
    d.B = p->batch;
    d.Tq = p->q_tokens;
    d.Tk = p->kv_tokens;
    d.H = p->heads;
    d.Hkv = p->kv_heads;
    d.G = p->kv_heads > 0 ? p->heads / p->kv_heads : 0;
    return d;
}

stria_status_t stria__validate_fwd(const stria_attn_params_t *p, const stria_tensor_t *q,
                                   const stria_tensor_t *k, const stria_tensor_t *v,
                                   const stria_tensor_t *o, const float *lse, const char *fn)
{
    STRIA__V(stria__validate_shape(p, fn));
    STRIA__V(stria__validate_tensor(q, fn, "q", p->q_tokens, p->heads, p->head_dim, false));
    STRIA__V(stria__validate_tensor(k, fn, "k", p->kv_tokens, p->kv_heads, p->head_dim, false));
    STRIA__V(stria__validate_tensor(v, fn, "v", p->kv_tokens, p->kv_heads, p->head_dim, false));
    STRIA__V(stria__validate_tensor(o, fn, "o", p->q_tokens, p->heads, p->head_dim, true));
    if (k->dtype != q->dtype || v->dtype != q->dtype)
        return stria_error_set(
            STRIA_ERR_INVALID_ARG, "%s: q, k and v must share one dtype (q=%s k=%s v=%s)", fn,
            stria_dtype_name(q->dtype), stria_dtype_name(k->dtype), stria_dtype_name(v->dtype));
    if (lse == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: lse is NULL", fn);
    return STRIA_OK;
}

/* One [q_tokens][heads][head_dim] view of a row-wise call. */
typedef struct {
    const stria_tensor_t *t;
    const char *name;
    bool need_f32;
} stria__row_view_t;

/* A row-wise call (init, merge, finalize, delta): params, its views in order,
 * then its per-row vector (vec_ok false: "<vec_name> is NULL"). */
static stria_status_t stria__validate_row_call(const stria_attn_params_t *p,
                                               const stria__row_view_t *views, int n_views,
                                               bool vec_ok, const char *vec_name, const char *fn)
{
    STRIA__V(stria__validate_rows(p, fn));
    for (int i = 0; i < n_views; i++)
        STRIA__V(stria__validate_tensor(views[i].t, fn, views[i].name, p->q_tokens, p->heads,
                                        p->head_dim, views[i].need_f32));
    if (!vec_ok)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: %s is NULL", fn, vec_name);
    return STRIA_OK;
}

stria_status_t stria__validate_partial_init(const stria_attn_params_t *p, const stria_tensor_t *o,
                                            const float *lse, const char *fn)
{
    const stria__row_view_t views[] = {{o, "o", true}};
    return stria__validate_row_call(p, views, 1, lse != NULL, "lse", fn);
}

stria_status_t stria__validate_merge(const stria_attn_params_t *p, const stria_tensor_t *o_a,
                                     const float *lse_a, const stria_tensor_t *o_b,
                                     const float *lse_b, const char *fn)
{
    const stria__row_view_t views[] = {{o_a, "o_a", true}, {o_b, "o_b", true}};
    return stria__validate_row_call(p, views, 2, lse_a != NULL && lse_b != NULL, "lse", fn);
}

stria_status_t stria__validate_finalize(const stria_attn_params_t *p, const stria_tensor_t *o_part,
                                        const stria_tensor_t *o_out, const char *fn)
{
    const stria__row_view_t views[] = {{o_part, "o_part", true}, {o_out, "o_out", false}};
    return stria__validate_row_call(p, views, 2, true, NULL, fn);
}

stria_status_t stria__validate_delta(const stria_attn_params_t *p, const stria_tensor_t *o,
                                     const stria_tensor_t *d_o, const float *delta, const char *fn)
{
    const stria__row_view_t views[] = {{o, "o", false}, {d_o, "d_o", false}};
    return stria__validate_row_call(p, views, 2, delta != NULL, "delta", fn);
}

stria_status_t stria__validate_bwd(const stria_attn_params_t *p, const stria_tensor_t *q,
                                   const stria_tensor_t *k, const stria_tensor_t *v,
                                   const stria_tensor_t *d_o, const float *lse, const float *delta,
                                   const stria_tensor_t *dq, const stria_tensor_t *dk,
                                   const stria_tensor_t *dv, const char *fn)
{
    STRIA__V(stria__validate_shape(p, fn));
    STRIA__V(stria__validate_tensor(q, fn, "q", p->q_tokens, p->heads, p->head_dim, false));
    STRIA__V(stria__validate_tensor(k, fn, "k", p->kv_tokens, p->kv_heads, p->head_dim, false));
    STRIA__V(stria__validate_tensor(v, fn, "v", p->kv_tokens, p->kv_heads, p->head_dim, false));
    STRIA__V(stria__validate_tensor(d_o, fn, "d_o", p->q_tokens, p->heads, p->head_dim, false));
    STRIA__V(stria__validate_tensor(dq, fn, "dq", p->q_tokens, p->heads, p->head_dim, true));
    STRIA__V(stria__validate_tensor(dk, fn, "dk", p->kv_tokens, p->kv_heads, p->head_dim, true));
    STRIA__V(stria__validate_tensor(dv, fn, "dv", p->kv_tokens, p->kv_heads, p->head_dim, true));
    if (k->dtype != q->dtype || v->dtype != q->dtype || d_o->dtype != q->dtype)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: q, k, v and d_o must share one dtype (q=%s k=%s v=%s d_o=%s)",
                               fn, stria_dtype_name(q->dtype), stria_dtype_name(k->dtype),
                               stria_dtype_name(v->dtype), stria_dtype_name(d_o->dtype));
    if (lse == NULL || delta == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: %s is NULL", fn,
                               lse == NULL ? "lse" : "delta");
    if (dq->data == dk->data || dq->data == dv->data || dk->data == dv->data)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: dq, dk and dv must not alias", fn);
    return STRIA_OK;
}
