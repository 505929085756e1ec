/*
 * stria layout: which global token positions each rank of a ring holds (the
 * core of striped attention), the scatter and gather of tensors between a
 * whole sequence and a rank's shard, and the memory one rank of a ring job
 * needs.
 *
 * How the tokens of one global sequence are spread over the N ranks of a ring.
 * Every rank holds a shard of the same length (shard_tokens); the sequence is
 * padded internally up to seq_padded = N * shard_tokens, and padded tokens get
 * the global positions seq_len, seq_len + 1, ... Within every shard the positions
 * increase, so a shard's real tokens are a prefix of it
 * (stria_layout_shard_valid() of them) and its padding is the rest.
 *
 *   striped:    rank r holds positions r, r + N, r + 2N, ... (the default)
 *   contiguous: rank r holds [r * L, (r + 1) * L), L = shard_tokens
 *   zigzag:     2N chunks of C = L / 2 tokens; rank r holds chunks r and
 *               2N - 1 - r
 *   packed:     a document plan's placement (stria_docplan.h): documents
 *               kept whole on one rank, the rest dealt as striping deals
 *               them; a shard's rows are its spread tokens, its kept tokens,
 *               then padding (positions increase within each part only)
 *
 * Ownership: a stria_layout_t is a plain value (nothing allocated; a packed
 * one borrows its plan, which must outlive it); the buffers of scatter and
 * gather belong to the caller. Threads: no state;
 * every function may be called from any thread.
 */
#ifndef STRIA_LAYOUT_H
#define STRIA_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define STRIA_LAYOUT_MAX_RANKS 65535
#define STRIA_LAYOUT_MAX_SEQ   ((int64_t)1 << 48)
/* Most runs a shard needs (zigzag: two). */
#define STRIA_LAYOUT_MAX_RUNS 2

struct stria_docplan; /* stria_docplan.h */

typedef struct {
    stria_layout_kind_t kind;
    int n_ranks;
    int64_t seq_len;                  /* real tokens of the global sequence (stria_call.h) */
    int64_t seq_padded;               /* n_ranks * shard_tokens */
    int64_t shard_tokens;             /* tokens per rank, padding included */
    const struct stria_docplan *plan; /* packed only: the placement (borrowed) */
} stria_layout_t;

/* Global positions first, first + stride, ..., first + (count - 1) * stride:
 * the same shape as the kernels' stria_pos_run_t. */
typedef struct {
    int64_t first;
    int64_t stride;
    int64_t count;
} stria_layout_run_t;

/* "striped", "contiguous", "zigzag", "auto", "packed"; "unknown" otherwise. */
const char *stria_layout_kind_name(stria_layout_kind_t kind);
/* Parses the names above; STRIA_ERR_INVALID_ARG otherwise. */
stria_status_t stria_layout_kind_parse(const char *name, stria_layout_kind_t *kind_out);
/* The layout STRIA_LAYOUT_AUTO stands for: contiguous for a job with a
 * window (windows balance under contiguous and need fewer hops); packed
 * where `packs` says documents may be placed by their work (a job with
 * documents, or a session, whose calls bring their own, on a ring whose
 * devices run packed passes: host memory), each call's plan then keeping
 * documents where its counts show a balanced placement and striping where
 * they do not; striped otherwise. Any other kind is returned as it is. */
stria_layout_kind_t stria_layout_kind_resolve(stria_layout_kind_t kind, bool has_window,
                                              bool packs);

/* Describes `seq_len` tokens (1..STRIA_LAYOUT_MAX_SEQ) over n_ranks ranks
 * (1..STRIA_LAYOUT_MAX_RANKS). Pads to a multiple of n_ranks (striped,
 * contiguous, packed) or 2 * n_ranks (zigzag). A packed layout made here has
 * no plan and places its tokens as striping does: what a packed call without
 * documents does, and the shard_tokens that sizes a packed session (a packed
 * call's shard_tokens never depend on its documents; its valid tokens per
 * rank do: a call's layout comes from stria_docplan_layout()). */
stria_status_t stria_layout_init(stria_layout_kind_t kind, int n_ranks, int64_t seq_len,
                                 stria_layout_t *layout_out);

/* The packed layout of a document plan (borrowed: it must outlive the
 * layout). stria_docplan_layout() makes a call's plan and layout. */
stria_status_t stria_layout_init_plan(const struct stria_docplan *plan, stria_layout_t *layout_out);

/* Global position of token `index` (0..shard_tokens-1) of `rank`'s shard;
 * positions >= layout->seq_len are padding. -1 for an index or rank out of range. */
int64_t stria_layout_position(const stria_layout_t *layout, int rank, int64_t index);

/* Inverse of stria_layout_position() for pos in [0, seq_padded). */
stria_status_t stria_layout_locate(const stria_layout_t *layout, int64_t pos, int *rank_out,
                                   int64_t *index_out);

/* The tiles of the CPU kernels (kernels/ reads them from here, because the
 * admission rule below counts whole tiles): queries and keys per tile, and
 * the multiple that head_dim rows are padded to. */
#define STRIA_KERNEL_TILE_Q 64
#define STRIA_KERNEL_TILE_K 64
#define STRIA_KERNEL_DPAD   16

/* The most the CPU kernels take from their workspace allocator
 * (stria_attn_params_t.workspace) at once during a forward or a backward
 * pass (its begin and every block) whose query block has at most q_tokens
 * tokens and whose K/V blocks have at most kv_tokens, whatever the number of
 * kernel threads: the kernels' part of stria_rank_memory(), in bytes. The
 * kernels keep to it; the rule lives here because admission (common) must
 * not depend on kernels/. Rows are counted as the kernels pack them: fp32,
 * tokens padded to whole tiles, head_dim padded to STRIA_KERNEL_DPAD.
 *   query: what a pass holds from its begin to its end, 5 x the query rows
 *          (the backward pass's Q, dO, their transposes and one dQ, shared
 *          by its threads; the forward pass holds Q^T);
 *   kv:    what one block packs, 2 x the K/V rows (K and V; with the bf16
 *          products K in pairs and K and V as bf16 rows, half each);
 *   total: their sum.
 * Per-thread scratch (a few hundred KiB a thread) is not counted: it is the
 * kernel threads' own memory, like their stacks, and never comes from the
 * workspace allocator (stria_kernels.h, Memory).
 * STRIA_ERR_INVALID_ARG for sizes <= 0; STRIA_ERR_NO_MEMORY when a part
 * reaches 2^62 bytes. */
typedef struct {
    uint64_t query;
    uint64_t kv;
    uint64_t total;
} stria_kernel_grant_t;

stria_status_t stria_kernel_grant(int64_t batch, int64_t q_tokens, int64_t kv_tokens, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim,
                                  stria_kernel_grant_t *grant_out);

/* Memory of one rank of a ring job, in bytes, for admission (the coordinator)
 * and reservation (the worker): its Q, K, V, dO, O, dQ, dK, dV shards in the
 * job dtype and its fp32 LSE, the ring engine's buffers of its backward pass
 * (the larger: K/V messages double-buffered in the job dtype, three fp32
 * dK/dV buffers, the fp32 dQ accumulator, LSE and D rows) and the kernels'
 * workspaces (stria_kernel_grant() of shard_tokens query and K/V tokens), all
 * for shard_tokens (padded) tokens, each allocation in 64-byte units.
 * STRIA_ERR_INVALID_ARG for sizes <= 0 or an unknown dtype;
 * STRIA_ERR_NO_MEMORY when the result does not fit in 63 bits. */
stria_status_t stria_rank_memory(int64_t batch, int64_t shard_tokens, int64_t heads,
                                 int64_t kv_heads, int64_t head_dim, stria_dtype_t dtype,
                                 uint64_t *bytes_out);

/* The bytes of one call's region of a session rank (see stria.proto,
 * SessionCallRequest): the inputs Q, K, V, O, LSE, dO, then a backward's
 * outputs dQ, dK, dV, each of batch x shard_tokens rows; *in_room_out
 * (may be NULL) the inputs' part. 0 for sizes <= 0, an unknown dtype or a
 * result beyond 2^62. */
uint64_t stria_session_region_bytes(int64_t batch, int64_t shard_tokens, int64_t heads,
                                    int64_t kv_heads, int64_t head_dim, stria_dtype_t dtype,
                                    uint64_t *in_room_out);

/* Memory of one rank of a session (a job is one), for admission (the
 * coordinator) and reservation (the worker): stria_rank_memory() for its
 * bounds and 1 + max_held regions (stria_session_region_bytes()): the call
 * running and the forwards held for their backward. Errors as
 * stria_rank_memory(). */
stria_status_t stria_session_rank_memory(int64_t batch, int64_t shard_tokens, int64_t heads,
                                         int64_t kv_heads, int64_t head_dim, stria_dtype_t dtype,
                                         uint32_t max_held, uint64_t *bytes_out);

/* Real (unpadded) tokens of `rank`'s shard: its first ones. 0 for a bad rank. */
int64_t stria_layout_shard_valid(const stria_layout_t *layout, int rank);

/* Position runs of `rank`'s shard in shard order: of its real tokens only, or
 * with_padding of all shard_tokens. Writes at most STRIA_LAYOUT_MAX_RUNS runs
 * with count > 0 and returns how many (0 for a shard without real tokens, or a
 * bad rank; 0 for a packed layout whose shard has more runs: see
 * stria_layout_runs()). */
size_t stria_layout_shard_runs(const stria_layout_t *layout, int rank, bool with_padding,
                               stria_layout_run_t runs[STRIA_LAYOUT_MAX_RUNS]);

/* The same runs, as many as the shard has (every layout, packed included):
 * a pointer to them (into tmp, or into a packed layout's plan, valid while
 * it lives) and their number in *n_out; NULL and 0 for a bad rank. */
const stria_layout_run_t *stria_layout_runs(const stria_layout_t *layout, int rank,
                                            bool with_padding, size_t *n_out,
                                            stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS]);

/* Scatter and gather between a full tensor and one rank's shard. Both are
 * contiguous [outer][tokens][row_bytes] arrays: full has layout->seq_len tokens,
 * shard has layout->shard_tokens. A [batch, tokens, heads, head_dim] tensor is
 * outer = batch, row_bytes = heads * head_dim * element size; an LSE
 * [batch, heads, tokens] is outer = batch * heads, row_bytes = 4.
 * Scatter zero-fills the padded rows of the shard; gather writes only the real
 * rows of this rank into full and reads nothing else of the shard. Buffers
 * belong to the caller and must not overlap. */
stria_status_t stria_layout_scatter(const stria_layout_t *layout, int rank, int64_t outer,
                                    size_t row_bytes, const void *full, void *shard);
stria_status_t stria_layout_gather(const stria_layout_t *layout, int rank, int64_t outer,
                                   size_t row_bytes, const void *shard, void *full);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_LAYOUT_H */
