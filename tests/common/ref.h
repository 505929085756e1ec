/* Test-only reference attention: a naive implementation, in fp64 (the truth)
 * and in plain fp32 (the yardstick of the tolerance rule), over contiguous
 * [batch, tokens, heads, head_dim] fp32 inputs and explicit positions. */
#ifndef STRIA_TEST_REF_H
#define STRIA_TEST_REF_H

#include "stria_common.h"

typedef struct {
    int64_t batch, q_tokens, kv_tokens, heads, kv_heads, head_dim;
    double scale; /* must be set */
    bool causal;
    const int64_t *q_pos;  /* q_tokens positions; NULL = 0.. */
    const int64_t *kv_pos; /* kv_tokens positions; NULL = 0.. */
} ref_shape_t;

/* Outputs of a reference pass, allocated by ref_*_run(), freed by
 * ref_out_free(). o: [B,Tq,H,D]; lse: [B,H,Tq]; dq like q, dk/dv like k. Only
 * filled when d_o was given: dq, dk, dv. */
typedef struct {
    double *o, *lse, *dq, *dk, *dv;
} ref_out_t;

/* fp64 reference. q, k, v, d_o: fp32 contiguous (d_o may be NULL). */
/* Documents and a sliding window, as in stria_attn_params_t: a key is
 * visible iff it lies in the query's document (cu_seqlens, n_cu entries; 0:
 * one document), in its window [q - left, q + right] (-1: unbounded) when
 * has_window, and at or before it when causal: attention within each
 * document, concatenated (flash_attn varlen's meaning). */
typedef struct {
    const int64_t *cu_seqlens;
    size_t n_cu;
    bool has_window;
    int64_t left, right;
} ref_masks_t;

/* Whether a query at position qp sees a key at kp (s->causal and the masks m,
 * NULL: none). */
bool ref_visible(const ref_shape_t *s, const ref_masks_t *m, int64_t qp, int64_t kp);

/* As ref_f64_run() and ref_f32_run(), with masks (NULL: none). */
void ref_f64_run_masks(const ref_shape_t *s, const ref_masks_t *m, const float *q, const float *k,
                       const float *v, const float *d_o, ref_out_t *out);
void ref_f32_run_masks(const ref_shape_t *s, const ref_masks_t *m, const float *q, const float *k,
                       const float *v, const float *d_o, ref_out_t *out);

void ref_f64_run(const ref_shape_t *s, const float *q, const float *k, const float *v,
                 const float *d_o, ref_out_t *out);
/* The same algorithm computed entirely in fp32 (results widened to double). */
void ref_f32_run(const ref_shape_t *s, const float *q, const float *k, const float *v,
                 const float *d_o, ref_out_t *out);
void ref_out_free(ref_out_t *out);

/* The same computation done in bf16 the way PyTorch's math SDPA does it on
 * bf16 tensors (the yardstick of bf16 kernels that run every product on bf16,
 * as FlashAttention's tests judge theirs): q and k scaled by sqrt(scale),
 * scores, probabilities, O and every gradient product rounded to bf16 (to
 * nearest even), each product accumulated exactly (in fp64) before its one
 * rounding, the softmax and its backward in fp64 on the rounded operands.
 * Inputs are bf16 values stored as fp32. Rows without a visible key get a
 * zero O (PyTorch would give NaN); lse is the fp64 one of the rounded scores. */
void ref_bf16_run_masks(const ref_shape_t *s, const ref_masks_t *m, const float *q, const float *k,
                        const float *v, const float *d_o, ref_out_t *out);

/* Whether kernel variant `name` runs bf16 inputs on the bf16 dot product on
 * this CPU (decided from the CPU's flags, not by asking the kernels): avx512
 * with AVX512-BF16, amx with AMX as well (and the tile state granted), and
 * the test builds' amx-emu anywhere. */
bool ref_bf16_dot(const char *variant);
/* ref_bf16_dot() of the variant other processes (workers) choose by default:
 * STRIA_KERNEL when set, else the best one the CPU has. */
bool ref_bf16_dot_default(void);

/* max |a[i] - ref[i]| over n elements; -inf/-inf pairs count as 0, any other
 * non-finite mismatch as +inf. */
double ref_max_err_f32(const float *a, const double *ref, size_t n);
double ref_max_err_f64(const double *a, const double *ref, size_t n);
double ref_max_abs(const double *ref, size_t n);

/* Deterministic pseudo-random fill in [-amp, amp), rounded to dtype and stored
 * as fp32 in out (so every implementation sees the same values). */
void ref_fill(float *out, size_t n, uint64_t seed, float amp, stria_dtype_t dtype);
/* Converts fp32 values to dtype storage (dst has n elements of dtype). */
void ref_to_dtype(const float *src, size_t n, stria_dtype_t dtype, void *dst);

#endif
