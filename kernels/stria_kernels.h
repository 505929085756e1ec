/*
 * stria kernels: exact attention on one (Q block, K/V block) pair.
 *
 * The ring engine calls these once per ring step. A forward step produces a
 * *partial* result for the block pair: an fp32 output normalised by its own
 * softmax denominator and the fp32 log-sum-exp (LSE) of its scaled scores.
 * Partials from different K/V blocks are combined with stria_attn_merge()
 * (or by stria_attn_fwd() itself with `accumulate`), which cannot overflow,
 * and stria_attn_finalize() writes the output in the storage dtype.
 *
 * Tensors use the layout [batch, tokens, heads, head_dim] with explicit
 * element strides for batch, token and head; head_dim is contiguous.
 * Storage dtypes are fp32, bf16 and fp16; all arithmetic accumulates in fp32.
 * Grouped-query attention: query head h reads K/V head h / (heads / kv_heads);
 * K/V are never replicated in memory.
 *
 * Masks come from token positions. The rows of each block are described by
 * runs of (first, stride, count) global positions; causal attention lets a
 * query at position p see keys at positions <= p. Contiguous, striped and
 * zigzag shards are all described this way; the kernel has no notion of a
 * layout. Documents (cu_seqlens) and a sliding window narrow each query's
 * visible keys further (see stria_attn_params_t): a query row at position p
 * sees keys in [lo(p), hi(p)]. Tiles that are fully masked are skipped, tiles
 * that are fully visible run without a mask. A query row that sees no key of the block gets
 * LSE = -inf and a zero partial output; merging handles such rows exactly.
 *
 * Several CPU variants exist (portable C, AVX2+FMA, AVX-512, AMX); the best one
 * the CPU supports is chosen once, on first use. STRIA_KERNEL=portable|avx2|
 * avx512-nobf16|avx512|amx in the environment forces one (an unavailable choice
 * is an error reported by the first kernel call, naming the reason). With
 * bf16 inputs, avx512 on a CPU with AVX512-BF16 runs every product on the bf16
 * dot product, and amx (a CPU with AMX-BF16 whose kernel grants the process
 * the tile state) on the AMX tiles, as FlashAttention does on tensor cores: P
 * and dS are rounded to bf16 before their products, accumulation and the
 * softmax statistics stay fp32. Every other variant (avx512-nobf16 is avx512
 * without the bf16 dot product) computes bf16 inputs in fp32.
 *
 * A NaN or an infinity is never hidden: every output that depends on one
 * (through the positions the mask lets it see) is non-finite, as with
 * PyTorch's SDPA: a NaN or +inf score poisons its query's row (NaN output and
 * LSE), a -inf score is a zero weight. Outputs of other batch rows and kv
 * head groups are not affected.
 *
 * Threading: every call may run on a thread pool (params->pool); NULL runs on
 * the calling thread. Calls do not keep pointers after they return.
 *
 * Memory: stria_attn_fwd() and stria_attn_bwd() pack their operands into a
 * workspace about the size of their inputs (backward: at most 5x Q plus 2x K
 * in fp32, whatever the number of threads); K and V rows that are already
 * fp32 (or bf16 on a CPU with a bf16 dot product) with head_dim a multiple of
 * 16 are read in place where that is faster. What a call or a pass takes from
 * its workspace at once never passes stria_kernel_grant() (stria_layout.h) of
 * its shape. Without params->workspace, up to four workspace buffers, 1 GiB in
 * all, are kept between calls for reuse, so that repeated calls do not pay
 * page faults again; they are freed at exit. Each thread that runs tasks of a
 * call also keeps scratch of its own (a few hundred KiB, never from
 * params->workspace) until it exits.
 */
#ifndef STRIA_KERNELS_H
#define STRIA_KERNELS_H

#include "stria_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define STRIA_HEAD_DIM_MIN 16
#define STRIA_HEAD_DIM_MAX 256

/* Positions first, first + stride, ..., first + (count - 1) * stride. */
typedef struct {
    int64_t first;
    int64_t stride;
    int64_t count;
} stria_pos_run_t;

/* Global positions of a block's tokens, in the block's token order, as runs.
 * The counts of the runs must add up to the block's token count. runs == NULL
 * (n_runs == 0) means positions 0, 1, ..., tokens - 1. Positions must lie in
 * [0, 2^62). */
typedef struct {
    const stria_pos_run_t *runs;
    size_t n_runs;
} stria_positions_t;

/* A strided view of a [batch, tokens, heads, head_dim] tensor. Strides are in
 * elements; head_dim is contiguous. The shape comes from stria_attn_params_t.
 * The caller owns `data`. */
typedef struct {
    void *data;
    stria_dtype_t dtype;
    int64_t stride_batch;
    int64_t stride_token;
    int64_t stride_head;
} stria_tensor_t;

/* Shapes and options shared by every call on a block pair. Zero-initialise and
 * set the fields; new fields keep zero as their default. */
typedef struct {
    int64_t batch;
    int64_t q_tokens;  /* tokens in the query block */
    int64_t kv_tokens; /* tokens in the key/value block */
    int64_t heads;     /* query heads */
    int64_t kv_heads;  /* key/value heads; heads must be a multiple */
    int64_t head_dim;  /* 16..256, a multiple of 8 */
    float scale;       /* softmax scale; 0 means 1/sqrt(head_dim) */
    bool causal;       /* key position <= query position */
    stria_positions_t q_pos;
    stria_positions_t kv_pos;
    stria_pool_t *pool; /* NULL: run on the calling thread */
    /* Documents (flash_attn varlen's cu_seqlens), one list for every batch
     * row: n_cu_seqlens entries, starting at 0, non-decreasing (the call
     * record's rules, stria_call.h), the last one past every query and key
     * position of the call. Document d holds
     * positions [cu_seqlens[d], cu_seqlens[d + 1]) (empty documents allowed);
     * a query sees only keys of its own document. n_cu_seqlens == 0: one
     * document holding everything (cu_seqlens is then ignored). */
    const int64_t *cu_seqlens;
    size_t n_cu_seqlens;
    /* Sliding window (flash_attn's window_size): with has_window, a query at
     * position p sees keys k with p - window_left <= k <= p + window_right;
     * -1 leaves that side unbounded, 0 is a valid bound. Causal attention
     * takes window_right 0 or -1 only. Without has_window both must be 0. */
    bool has_window;
    int64_t window_left, window_right;
    /* Where the call's packed operands and scratch (its workspace) come
     * from, e.g. a worker's memory pool; borrowed during the call, and until
     * the end of a forward or backward pass for begin. NULL: a small cache
     * of buffers kept between calls (kernels/workspace.c). */
    const stria_allocator_t *workspace;
} stria_attn_params_t;

/* A contiguous [batch, tokens, heads, head_dim] view of `data`. */
stria_tensor_t stria_tensor_contiguous(void *data, stria_dtype_t dtype, int64_t tokens,
                                       int64_t heads, int64_t head_dim);

/* A head-major view of `data` laid out [batch, heads, tokens, head_dim]: the
 * rows of one head are adjacent (the ring's K/V messages). */
stria_tensor_t stria_tensor_head_major(void *data, stria_dtype_t dtype, int64_t tokens,
                                       int64_t heads, int64_t head_dim);

/* Forward partial attention of a Q block against a K/V block.
 *
 * q: [batch, q_tokens, heads, head_dim]; k, v: [batch, kv_tokens, kv_heads,
 * head_dim], all of one storage dtype. o: fp32 [batch, q_tokens, heads,
 * head_dim]; lse: fp32, contiguous [batch, heads, q_tokens] (natural log of
 * the softmax denominator of the scaled scores).
 *
 * accumulate == false: (o, lse) receive this block's partial.
 * accumulate == true: this block's partial is merged into (o, lse), which must
 * hold a partial already (initialise with stria_attn_partial_init()).
 */
stria_status_t stria_attn_fwd(const stria_attn_params_t *params, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *o, float *lse, bool accumulate);

/* Sets (o, lse) to the empty partial: o = 0, lse = -inf. o must be fp32. */
stria_status_t stria_attn_partial_init(const stria_attn_params_t *params, const stria_tensor_t *o,
                                       float *lse);

/* Merges the partial (o_b, lse_b) into (o_a, lse_a), for q_tokens rows. Both
 * outputs are fp32. Uses max-subtracted weights, so LSE gaps of any size and
 * -inf rows are exact. */
stria_status_t stria_attn_merge(const stria_attn_params_t *params, const stria_tensor_t *o_a,
                                float *lse_a, const stria_tensor_t *o_b, const float *lse_b);

/* Writes the fp32 partial `o_part` to `o_out` in o_out->dtype (rounding to
 * nearest even). Rows with LSE = -inf are already zero. */
stria_status_t stria_attn_finalize(const stria_attn_params_t *params, const stria_tensor_t *o_part,
                                   const stria_tensor_t *o_out);

/* D = rowsum(dO * O) for every (batch, head, query): delta is fp32,
 * contiguous [batch, heads, q_tokens]. o and d_o may be of any dtype. Compute it
 * once per backward pass. */
stria_status_t stria_attn_bwd_delta(const stria_attn_params_t *params, const stria_tensor_t *o,
                                    const stria_tensor_t *d_o, float *delta);

/* Backward of one block pair: accumulates (+=) into dq (fp32, Q's shape) and
 * dk, dv (fp32, K's shape). lse is the final LSE of the forward pass over all
 * K/V blocks and delta the output of stria_attn_bwd_delta(), both
 * [batch, heads, q_tokens]. q, k, v, d_o share one storage dtype. dq must not
 * alias dk/dv. */
stria_status_t stria_attn_bwd(const stria_attn_params_t *params, const stria_tensor_t *q,
                              const stria_tensor_t *k, const stria_tensor_t *v,
                              const stria_tensor_t *d_o, const float *lse, const float *delta,
                              const stria_tensor_t *dq, const stria_tensor_t *dk,
                              const stria_tensor_t *dv);

/* A forward pass of one query block over several K/V blocks (a ring rank's
 * forward: the same Q against a new K/V block at every step, merged into one
 * partial). stria_attn_fwd_begin() packs the query side once (the
 * transposed Q tiles every score product reads: about 1x Q in fp32, half
 * that for bf16 products); stria_attn_fwd_block() is stria_attn_fwd() on one
 * K/V block that reads the packed tiles instead of packing Q again (the same
 * bits); stria_attn_fwd_end() frees the pass.
 *
 * begin: params as for stria_attn_fwd() except that kv_tokens and kv_pos are
 * not used; q is read during the call only. block: params must match
 * begin's in every query-side field (batch, q_tokens, heads, kv_heads,
 * head_dim, scale, causal, q_pos, pool, cu_seqlens, window); the K/V
 * fields describe this block;
 * k and v have q's dtype; o, lse and accumulate as for stria_attn_fwd().
 * end(NULL) does nothing. */
typedef struct stria_attn_fwd_pass stria_attn_fwd_pass_t;

stria_status_t stria_attn_fwd_begin(const stria_attn_params_t *params, const stria_tensor_t *q,
                                    stria_attn_fwd_pass_t **pass);
stria_status_t stria_attn_fwd_block(stria_attn_fwd_pass_t *pass, const stria_attn_params_t *params,
                                    const stria_tensor_t *k, const stria_tensor_t *v,
                                    const stria_tensor_t *o, float *lse, bool accumulate);
void stria_attn_fwd_end(stria_attn_fwd_pass_t *pass);

/* A backward pass of one query block over several K/V blocks (a ring rank's
 * backward: the same Q, dO, LSE and D against a new K/V block at every step).
 * stria_attn_bwd_begin() packs the query side once; stria_attn_bwd_block()
 * runs one K/V block, accumulating (+=) into that block's dk, dv and into
 * the pass's own fp32 dQ; stria_attn_bwd_end() adds that dQ into dq and
 * frees the pass. The result is that of stria_attn_bwd() on each block in
 * turn, except that dQ is summed over the blocks before it is added to dq
 * (rounding may differ in the last bits), and the query side is packed once
 * instead of once per block.
 *
 * begin: params as for stria_attn_bwd() except that kv_tokens and kv_pos are
 * not used; q and d_o are read during the call; lse and delta are read by
 * every block and must stay valid and unchanged until end. The pass keeps
 * at most 5x Q (fp32) of memory, whatever the number of threads.
 * block: params must match begin's in every query-side field (batch,
 * q_tokens, heads, kv_heads, head_dim, scale, causal, q_pos, pool,
 * cu_seqlens, window); the K/V fields describe this block. k and v have q's dtype.
 * end: dq == NULL discards the pass (after an error); the pass is freed
 * whatever the result. end(NULL, ...) does nothing. */
typedef struct stria_attn_bwd_pass stria_attn_bwd_pass_t;

stria_status_t stria_attn_bwd_begin(const stria_attn_params_t *params, const stria_tensor_t *q,
                                    const stria_tensor_t *d_o, const float *lse, const float *delta,
                                    stria_attn_bwd_pass_t **pass);
stria_status_t stria_attn_bwd_block(stria_attn_bwd_pass_t *pass, const stria_attn_params_t *params,
                                    const stria_tensor_t *k, const stria_tensor_t *v,
                                    const stria_tensor_t *dk, const stria_tensor_t *dv);
stria_status_t stria_attn_bwd_end(stria_attn_bwd_pass_t *pass, const stria_tensor_t *dq);

/* dst[i] += src[i] for n fp32 values in host memory, vectorised with the CPU
 * variant in use (plain C where none is usable). dst and src do not
 * overlap. */
void stria_f32_add(float *dst, const float *src, size_t n);

/* ---- work under a mask (planning, simulation) ------------------------- */

/* What one call computes under its mask, per (batch row, query head), as the
 * driver classifies it: (query tile, key tile) pairs are skipped, full (no
 * mask) or partial (straddling the mask). With the kernels' own tiles
 * (64 x 64), a partial pair is computed by 16 x 16 sub-blocks: for each
 * 16-query chunk the hull of the key sub-blocks not fully masked for it, the
 * straddling ones masked element by element, fully masked ones inside the
 * hull set to -inf (holes). With other tile sizes (a GPU's, a paper's), a
 * partial pair is computed whole under the mask. Nothing is computed. */
typedef struct {
    int64_t tiles;         /* (query tile, key tile) pairs of the call */
    int64_t full, partial; /* pairs computed without a mask / under it */
    /* kernels' tiles only: the sub-blocks computed in partial pairs */
    int64_t sub_full, sub_masked, sub_hole;
    int64_t full_elems;       /* (query, key) score elements computed in full pairs */
    int64_t partial_elems;    /* ... in partial pairs (their computed sub-blocks, or whole) */
    int64_t q_tiles, k_tiles; /* tiles in at least one computed pair */
} stria_attn_work_t;

/* One block's positions classified once, for the work of many calls: its
 * query side (q_tokens, q_pos) and masks (causal, cu_seqlens, window); the
 * K/V fields, sizes and dtype of params are not used beyond the argument
 * checks. tile_q = tile_k = 0: the kernels' own tiles and sub-blocks; both
 * >= 1: tiles of that size, computed whole when partial. cu_seqlens is
 * borrowed for the plan's life. */
typedef struct stria_attn_plan stria_attn_plan_t;

stria_status_t stria_attn_plan_create(const stria_attn_params_t *params, int64_t tile_q,
                                      int64_t tile_k, stria_attn_plan_t **plan);
void stria_attn_plan_destroy(stria_attn_plan_t *plan);

/* The work of a call with q's block as queries and k's block as keys. The
 * plans must have the same tiles and masks (the same cu_seqlens array). */
stria_status_t stria_attn_plan_work(const stria_attn_plan_t *q, const stria_attn_plan_t *k,
                                    stria_attn_work_t *work);

/* The work of one call (params as for stria_attn_fwd()). */
stria_status_t stria_attn_work(const stria_attn_params_t *params, int64_t tile_q, int64_t tile_k,
                               stria_attn_work_t *work);

/* ---- CPU variants ------------------------------------------------------ */

/* Name of the variant in use ("portable", "avx2", "avx512-nobf16", "avx512", "amx"),
 * selecting it on first use. */
const char *stria_kernels_variant(void);

/* Forces a variant by name for the whole process. Errors:
 * STRIA_ERR_NOT_FOUND (unknown name), STRIA_ERR_UNSUPPORTED (CPU lacks it). */
stria_status_t stria_kernels_set_variant(const char *name);

/* Whether the named variant exists in this build and runs on this CPU. */
bool stria_kernels_variant_available(const char *name);

/* Whether the named variant runs the products of bf16 inputs on a bf16 dot
 * product on this CPU (avx512 with AVX512-BF16, amx on its tiles); false:
 * bf16 inputs are computed in fp32 there, and for unknown or unavailable
 * variants. */
bool stria_kernels_variant_bf16_dot(const char *name);

/* Names of all variants compiled in, NULL-terminated, best last. */
const char *const *stria_kernels_variant_names(void);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_KERNELS_H */
