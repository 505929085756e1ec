/* Argument checks of the attention entry points, shared by every device
 * implementation so that all of them accept and reject exactly the same calls
 * with the same messages, and the tile bounds of positions they all classify
 * masks with. Internal; not part of the public API.
 *
 * kernels/attn.c (the CPU kernels) uses them too. */
#ifndef STRIA_VALIDATE_INT_H
#define STRIA_VALIDATE_INT_H

#include "stria_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Positions must lie in [0, 2^62). */
#define STRIA__POS_LIMIT_V ((int64_t)1 << 62)

/* Sizes, head_dim and scale of a block-pair call, and its documents list and
 * window by the call record's rules (stria_call_docs_check(),
 * stria_call_window_check(); the message "<fn>: params: <rule>"), except
 * the end of the documents against the positions (stria__validate_doc_end). */
stria_status_t stria__validate_shape(const stria_attn_params_t *p, const char *fn);
/* The last cu_seqlens entry must be past every one of the n positions (when
 * there are documents). which: "query" or "key". */
stria_status_t stria__validate_doc_end(const stria_attn_params_t *p, const int64_t *pos, int64_t n,
                                       const char *fn, const char *which);
/* The same for the row-wise calls (init, merge, finalize, delta), which use
 * only batch, q_tokens, heads and head_dim. */
stria_status_t stria__validate_rows(const stria_attn_params_t *p, const char *fn);
/* A tensor view's data and dtype: not NULL, a known dtype (the checks every
 * view passes, whatever its shape). */
stria_status_t stria__validate_view(const stria_tensor_t *t, const char *fn, const char *name);
/* One tensor view: stria__validate_view(), fp32 when need_f32, sane strides. */
stria_status_t stria__validate_tensor(const stria_tensor_t *t, const char *fn, const char *name,
                                      int64_t tokens, int64_t heads, int64_t dim, bool need_f32);
/* Expands position runs into out[tokens] and checks their counts and ranges.
 * which: "query" or "key". */
stria_status_t stria__validate_positions(const stria_positions_t *pos, int64_t tokens,
                                         const char *fn, const char *which, int64_t *out);
/* The softmax scale a call uses: params->scale, or 1/sqrt(head_dim) for 0. */
float stria__attn_scale(const stria_attn_params_t *p);

/* The sizes of a call as the kernels of every device index them: batch, query
 * and key tokens, query heads, K/V heads, and the query heads per K/V head. */
typedef struct {
    int64_t B, Tq, Tk, H, Hkv, G;
} stria__attn_dims_t;

/* The sizes of p. G is 0 where kv_heads is (a row-wise call, which does not
 * check kv_heads, may leave it 0). */
stria__attn_dims_t stria__attn_dims(const stria_attn_params_t *p);

/* Every argument check of one entry point of stria_kernels.h except the
 * positions (checked when they are expanded, as attn.c does). */
stria_status_t stria__validate_fwd(const stria_attn_params_t *p, const stria_tensor_t *q,
                                   const stria_tensor_t *k, const stria_tensor_t *v,
                                   const stria_tensor_t *o, const float *lse, const char *fn);
stria_status_t stria__validate_partial_init(const stria_attn_params_t *p, const stria_tensor_t *o,
                                            const float *lse, const char *fn);
stria_status_t stria__validate_merge(const stria_attn_params_t *p, const stria_tensor_t *o_a,
                                     const float *lse_a, const stria_tensor_t *o_b,
                                     const float *lse_b, const char *fn);
stria_status_t stria__validate_finalize(const stria_attn_params_t *p, const stria_tensor_t *o_part,
                                        const stria_tensor_t *o_out, const char *fn);
stria_status_t stria__validate_delta(const stria_attn_params_t *p, const stria_tensor_t *o,
                                     const stria_tensor_t *d_o, const float *delta, const char *fn);
stria_status_t stria__validate_bwd(const stria_attn_params_t *p, const stria_tensor_t *q,
                                   const stria_tensor_t *k, const stria_tensor_t *v,
                                   const stria_tensor_t *d_o, const float *lse, const float *delta,
                                   const stria_tensor_t *dq, const stria_tensor_t *dk,
                                   const stria_tensor_t *dv, const char *fn);

/* Min and max position of every tile of `tile` rows (tiles past the last
 * row: INT64_MAX and INT64_MIN); the masks of every device are classified
 * from them. Defined in attn.c. */
void stria__tile_bounds(const int64_t *pos, int64_t n, int64_t tile, int64_t n_tiles, int64_t *mn,
                        int64_t *mx);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_VALIDATE_INT_H */
