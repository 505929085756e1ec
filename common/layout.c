/*
 * Layouts: which global token positions each rank of a ring holds. Every
 * layout puts padding (positions >= seq_len) at the end of a shard; the ring
 * engine relies on that to hand the kernels only the real prefix of every
 * block. The arithmetic ones keep positions increasing within a shard; a
 * packed one reads its plan's runs (stria_docplan.h).
 */
#include "stria_layout.h"
#include "stria_docplan.h"
#include "stria_dtype.h"

#include <string.h>

static const char *const stria__layout_names[] = {"striped", "contiguous", "zigzag", "auto",
                                                  "packed"};

const char *stria_layout_kind_name(stria_layout_kind_t kind)
{
    if ((unsigned)kind < sizeof(stria__layout_names) / sizeof(stria__layout_names[0]))
        return stria__layout_names[kind];
    return "unknown";
}

stria_status_t stria_layout_kind_parse(const char *name, stria_layout_kind_t *kind_out)
{
    if (name == NULL || kind_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_layout_kind_parse: NULL argument");
    for (size_t i = 0; i < sizeof(stria__layout_names) / sizeof(stria__layout_names[0]); i++) {
        if (strcmp(name, stria__layout_names[i]) == 0) {
            *kind_out = (stria_layout_kind_t)i;
            return STRIA_OK;
        }
    }
    return stria_error_set(
        STRIA_ERR_INVALID_ARG,
        "unknown layout '%s' (expected striped, contiguous, zigzag, packed or auto)", name);
}

stria_layout_kind_t stria_layout_kind_resolve(stria_layout_kind_t kind, bool has_window, bool packs)
{
    if (kind != STRIA_LAYOUT_AUTO)
        return kind;
    if (has_window)
        return STRIA_LAYOUT_CONTIGUOUS;
    return packs ? STRIA_LAYOUT_PACKED : STRIA_LAYOUT_STRIPED;
}

stria_status_t stria_layout_init(stria_layout_kind_t kind, int n_ranks, int64_t seq_len,
                                 stria_layout_t *layout_out)
{
    stria_layout_t l;
    int64_t unit;

    if (layout_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_layout_init: layout_out is NULL");
    if (kind == STRIA_LAYOUT_AUTO)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_layout_init: layout auto must be "
                                                      "resolved first (stria_layout_kind_resolve)");
    if (kind != STRIA_LAYOUT_PACKED && kind != STRIA_LAYOUT_STRIPED &&
        kind != STRIA_LAYOUT_CONTIGUOUS && kind != STRIA_LAYOUT_ZIGZAG)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_layout_init: unknown layout %d",
                               (int)kind);
    if (n_ranks < 1 || n_ranks > STRIA_LAYOUT_MAX_RANKS)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_layout_init: %d ranks (must be 1..%d)",
                               n_ranks, STRIA_LAYOUT_MAX_RANKS);
    if (seq_len < 1 || seq_len > STRIA_LAYOUT_MAX_SEQ)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_layout_init: sequence of %lld tokens (must be 1..2^48)",
                               (long long)seq_len);
    unit = kind == STRIA_LAYOUT_ZIGZAG ? 2 * (int64_t)n_ranks : (int64_t)n_ranks;
    l.kind = kind;
    l.n_ranks = n_ranks;
    l.seq_len = seq_len;
    l.seq_padded = (seq_len + unit - 1) / unit * unit;
    l.shard_tokens = l.seq_padded / n_ranks;
    *layout_out = l;
    return STRIA_OK;
}

stria_status_t stria_layout_init_plan(const stria_docplan_t *plan, stria_layout_t *layout_out)
{
    if (plan == NULL || layout_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_layout_init_plan: NULL argument");
    *layout_out = (stria_layout_t){.kind = STRIA_LAYOUT_PACKED,
                                   .n_ranks = plan->n_ranks,
                                   .seq_len = plan->seq_len,
                                   .seq_padded = (int64_t)plan->n_ranks * plan->shard_tokens,
                                   .shard_tokens = plan->shard_tokens,
                                   .plan = plan};
    return STRIA_OK;
}

/* The arithmetic a layout follows: its kind's, striping for a packed layout
 * without a plan (a call without documents, a session's sizing). */
static stria_layout_kind_t stria__layout_rule(const stria_layout_t *l)
{
    return l->kind == STRIA_LAYOUT_PACKED && l->plan == NULL ? STRIA_LAYOUT_STRIPED : l->kind;
}

static bool stria__layout_ok(const stria_layout_t *l, int rank)
{
    return l != NULL && rank >= 0 && rank < l->n_ranks;
}

int64_t stria_layout_position(const stria_layout_t *layout, int rank, int64_t index)
{
    const stria_layout_t *l = layout;
    int64_t n = l != NULL ? l->n_ranks : 0, c;

    if (!stria__layout_ok(l, rank) || index < 0 || index >= l->shard_tokens)
        return -1;
    switch (stria__layout_rule(l)) {
    case STRIA_LAYOUT_STRIPED:
        return rank + index * n;
    case STRIA_LAYOUT_CONTIGUOUS:
        return rank * l->shard_tokens + index;
    case STRIA_LAYOUT_ZIGZAG:
        c = l->shard_tokens / 2;
        return index < c ? rank * c + index : (2 * n - 1 - rank) * c + (index - c);
    case STRIA_LAYOUT_PACKED:
        return stria_docplan_position(l->plan, rank, index);
    case STRIA_LAYOUT_AUTO: /* never in an initialised layout */
        break;
    }
    return -1;
}

/* A packed layout's inverse: a search of every rank's runs. */
static stria_status_t stria__locate_runs(const stria_layout_t *l, int64_t pos, int *rank_out,
                                         int64_t *index_out)
{
    for (int r = 0; r < l->n_ranks; r++) {
        size_t n;
        const stria_layout_run_t *runs = stria_layout_runs(l, r, true, &n, NULL);
        int64_t idx = 0;
        for (size_t k = 0; k < n; idx += runs[k].count, k++) {
            int64_t off = pos - runs[k].first;
            if (off < 0 || off % runs[k].stride != 0 || off / runs[k].stride >= runs[k].count)
                continue;
            *rank_out = r;
            *index_out = idx + off / runs[k].stride;
            return STRIA_OK;
        }
    }
    return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_layout_locate: position %lld not placed",
                           (long long)pos);
}

stria_status_t stria_layout_locate(const stria_layout_t *layout, int64_t pos, int *rank_out,
                                   int64_t *index_out)
{
    const stria_layout_t *l = layout;
    int64_t n, c, chunk;
    int rank;
    int64_t index;

    if (l == NULL || rank_out == NULL || index_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_layout_locate: NULL argument");
    if (pos < 0 || pos >= l->seq_padded)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_layout_locate: position %lld outside [0, %lld)",
                               (long long)pos, (long long)l->seq_padded);
    n = l->n_ranks;
    switch (stria__layout_rule(l)) {
    case STRIA_LAYOUT_STRIPED:
        rank = (int)(pos % n);
        index = pos / n;
        break;
    case STRIA_LAYOUT_CONTIGUOUS:
        rank = (int)(pos / l->shard_tokens);
        index = pos % l->shard_tokens;
        break;
    case STRIA_LAYOUT_ZIGZAG:
        c = l->shard_tokens / 2;
        chunk = pos / c;
        rank = (int)(chunk < n ? chunk : 2 * n - 1 - chunk);
        index = (chunk < n ? 0 : c) + pos % c;
        break;
    case STRIA_LAYOUT_PACKED:
        return stria__locate_runs(l, pos, rank_out, index_out);
    default:
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_layout_locate: unknown layout %d",
                               (int)l->kind);
    }
    *rank_out = rank;
    *index_out = index;
    return STRIA_OK;
}

static int64_t stria__clamp(int64_t x, int64_t hi)
{
    return x < 0 ? 0 : (x > hi ? hi : x);
}

size_t stria_layout_shard_runs(const stria_layout_t *layout, int rank, bool with_padding,
                               stria_layout_run_t runs[STRIA_LAYOUT_MAX_RUNS])
{
    const stria_layout_t *l = layout;
    stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS];
    size_t n_tmp = 0, n_out = 0;
    int64_t n, c, L, S;

    if (!stria__layout_ok(l, rank) || runs == NULL)
        return 0;
    n = l->n_ranks;
    L = l->shard_tokens;
    /* Padded positions are the highest ones, so "real only" is a cut at seq_len. */
    S = with_padding ? l->seq_padded : l->seq_len;
    switch (stria__layout_rule(l)) {
    case STRIA_LAYOUT_STRIPED:
        tmp[n_tmp++] =
            (stria_layout_run_t){rank, n, rank >= S ? 0 : stria__clamp((S - rank + n - 1) / n, L)};
        break;
    case STRIA_LAYOUT_CONTIGUOUS:
        tmp[n_tmp++] = (stria_layout_run_t){rank * L, 1, stria__clamp(S - rank * L, L)};
        break;
    case STRIA_LAYOUT_ZIGZAG:
        c = L / 2;
        tmp[n_tmp++] = (stria_layout_run_t){rank * c, 1, stria__clamp(S - rank * c, c)};
        tmp[n_tmp++] = (stria_layout_run_t){(2 * n - 1 - rank) * c, 1,
                                            stria__clamp(S - (2 * n - 1 - rank) * c, c)};
        break;
    case STRIA_LAYOUT_PACKED: {
        size_t n_all;
        const stria_layout_run_t *all = stria_layout_runs(l, rank, with_padding, &n_all, NULL);
        if (n_all > STRIA_LAYOUT_MAX_RUNS)
            return 0;
        memcpy(tmp, all, n_all * sizeof(*all));
        n_tmp = n_all;
        break;
    }
    default:
        return 0;
    }
    for (size_t i = 0; i < n_tmp; i++)
        if (tmp[i].count > 0)
            runs[n_out++] = tmp[i];
    return n_out;
}

const stria_layout_run_t *stria_layout_runs(const stria_layout_t *layout, int rank,
                                            bool with_padding, size_t *n_out,
                                            stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS])
{
    *n_out = 0;
    if (!stria__layout_ok(layout, rank))
        return NULL;
    if (stria__layout_rule(layout) != STRIA_LAYOUT_PACKED) {
        *n_out = stria_layout_shard_runs(layout, rank, with_padding, tmp);
        return tmp;
    }
    const stria_docplan_t *p = layout->plan;
    size_t first = p->run_start[rank], end = p->run_start[rank + 1];
    /* padding runs hold positions >= seq_len only, and come last */
    while (!with_padding && end > first && p->runs[end - 1].first >= p->seq_len)
        end--;
    *n_out = end - first;
    return p->runs + first;
}

int64_t stria_layout_shard_valid(const stria_layout_t *layout, int rank)
{
    stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS];
    size_t n;
    const stria_layout_run_t *runs = stria_layout_runs(layout, rank, false, &n, tmp);
    int64_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += runs[i].count;
    return total;
}

static stria_status_t stria__layout_check_copy(const stria_layout_t *l, int rank, int64_t outer,
                                               size_t row_bytes, const void *a, const void *b,
                                               const char *fn)
{
    if (l == NULL || a == NULL || b == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: NULL argument", fn);
    if (rank < 0 || rank >= l->n_ranks)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: rank %d outside the ring of %d", fn,
                               rank, l->n_ranks);
    if (outer < 1 || row_bytes == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: outer (%lld) and row_bytes (%zu) must be >= 1", fn,
                               (long long)outer, row_bytes);
    return STRIA_OK;
}

/* Copies between full and shard rows along the real runs: to_shard selects
 * the direction. */
static void stria__layout_copy(const stria_layout_t *l, int rank, int64_t outer, size_t row_bytes,
                               char *full, char *shard, bool to_shard)
{
    stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS];
    size_t n_runs;
    const stria_layout_run_t *runs = stria_layout_runs(l, rank, false, &n_runs, tmp);
    int64_t L = l->shard_tokens, S = l->seq_len;

    for (int64_t o = 0; o < outer; o++) {
        char *f = full + (size_t)(o * S) * row_bytes;
        char *sh = shard + (size_t)(o * L) * row_bytes;
        int64_t idx = 0;
        for (size_t r = 0; r < n_runs; r++) {
            const stria_layout_run_t *run = &runs[r];
            if (run->stride == 1) {
                char *fp = f + (size_t)run->first * row_bytes;
                char *sp = sh + (size_t)idx * row_bytes;
                size_t bytes = (size_t)run->count * row_bytes;
                memcpy(to_shard ? sp : fp, to_shard ? fp : sp, bytes);
            } else {
                for (int64_t i = 0; i < run->count; i++) {
                    char *fp = f + (size_t)(run->first + i * run->stride) * row_bytes;
                    char *sp = sh + (size_t)(idx + i) * row_bytes;
                    memcpy(to_shard ? sp : fp, to_shard ? fp : sp, row_bytes);
                }
            }
            idx += run->count;
        }
        if (to_shard && idx < L)
            memset(sh + (size_t)idx * row_bytes, 0, (size_t)(L - idx) * row_bytes);
    }
}

/* Checks the arguments (src and dst as the caller names them) and copies
 * src into dst: the full array into the shard, or back. */
static stria_status_t stria__layout_move(const stria_layout_t *layout, int rank, int64_t outer,
                                         size_t row_bytes, const void *src, void *dst,
                                         bool to_shard, const char *fn)
{
    stria_status_t st = stria__layout_check_copy(layout, rank, outer, row_bytes, src, dst, fn);
    char *from = (char *)src, *to = dst;
    if (st == STRIA_OK)
        stria__layout_copy(layout, rank, outer, row_bytes, to_shard ? from : to,
                           to_shard ? to : from, to_shard);
    return st;
}

stria_status_t stria_layout_scatter(const stria_layout_t *layout, int rank, int64_t outer,
                                    size_t row_bytes, const void *full, void *shard)
{
    return stria__layout_move(layout, rank, outer, row_bytes, full, shard, true,
                              "stria_layout_scatter");
}

stria_status_t stria_layout_gather(const stria_layout_t *layout, int rank, int64_t outer,
                                   size_t row_bytes, const void *shard, void *full)
{
    return stria__layout_move(layout, rank, outer, row_bytes, shard, full, false,
                              "stria_layout_gather");
}

/* The product of n factors, false when it passes 2^63. */
static bool stria__grant_mul(const uint64_t *f, int n, uint64_t *out)
{
    uint64_t x = 1;
    for (int i = 0; i < n; i++)
        if (__builtin_mul_overflow(x, f[i], &x))
            return false;
    *out = x;
    return x >> 63 == 0;
}

stria_status_t stria_kernel_grant(int64_t batch, int64_t q_tokens, int64_t kv_tokens, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim,
                                  stria_kernel_grant_t *grant_out)
{
    const uint64_t TQ = STRIA_KERNEL_TILE_Q, TK = STRIA_KERNEL_TILE_K, DP = STRIA_KERNEL_DPAD;
    uint64_t Dp, query, kv;

    if (batch <= 0 || q_tokens <= 0 || kv_tokens <= 0 || heads <= 0 || kv_heads <= 0 ||
        head_dim <= 0 || grant_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "kernel workspace: sizes must be positive");
    Dp = ((uint64_t)head_dim + DP - 1) / DP * DP;
    const uint64_t fq[] = {5 * sizeof(float), (uint64_t)batch, (uint64_t)heads,
                           ((uint64_t)q_tokens + TQ - 1) / TQ * TQ, Dp};
    const uint64_t fk[] = {2 * sizeof(float), (uint64_t)batch, (uint64_t)kv_heads,
                           ((uint64_t)kv_tokens + TK - 1) / TK * TK, Dp};
    if (!stria__grant_mul(fq, 5, &query) || !stria__grant_mul(fk, 5, &kv) || (query | kv) >> 62)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "kernel workspace: 2^62 bytes or more");
    grant_out->query = query;
    grant_out->kv = kv;
    grant_out->total = query + kv;
    return STRIA_OK;
}

/* x rounded up to 64 bytes: what a worker's pool hands out for x bytes, and
 * how the ring engine carves its arena. */
static unsigned __int128 stria__rank_round64(unsigned __int128 x)
{
    return (x + 63) / 64 * 64;
}

stria_status_t stria_rank_memory(int64_t batch, int64_t shard_tokens, int64_t heads,
                                 int64_t kv_heads, int64_t head_dim, stria_dtype_t dtype,
                                 uint64_t *bytes_out)
{
    unsigned __int128 B, L, es, qrows, kvrows, lse, tensors, ring, total;
    stria_kernel_grant_t kern; /* also bounds the sizes for the products below */
    stria_status_t st;

    if (batch <= 0 || shard_tokens <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 ||
        bytes_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rank memory: sizes must be positive");
    es = stria_dtype_size(dtype);
    if (es == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rank memory: unknown dtype %d", (int)dtype);
    if ((st = stria_kernel_grant(batch, shard_tokens, shard_tokens, heads, kv_heads, head_dim,
                                 &kern)) != STRIA_OK)
        return st;
    B = (uint64_t)batch;
    L = (uint64_t)shard_tokens;
    qrows = B * L * (uint64_t)heads * (uint64_t)head_dim; /* elements of Q */
    kvrows = B * L * (uint64_t)kv_heads * (uint64_t)head_dim;
    lse = stria__rank_round64(B * (uint64_t)heads * L * 4);
    /* Q, O, dO, dQ and K, V, dK, dV in the job dtype, LSE in fp32: one
     * allocation each. */
    tensors = 4 * stria__rank_round64(qrows * es) + 4 * stria__rank_round64(kvrows * es) + lse;
    /* The ring engine's arena for its larger pass, the backward
     * (daemon/ring/ring.c): two K/V messages in the job dtype, three fp32
     * dK/dV buffers (this rank's contribution, double-buffered, and the
     * running sum received), the fp32 dQ accumulator and the LSE and D rows.
     * The forward's (two messages, the fp32 O accumulator and LSE rows) is
     * smaller; staged, the device's and the pinned part are each smaller. */
    ring = 2 * stria__rank_round64(2 * kvrows * es) + 3 * stria__rank_round64(2 * kvrows * 4) +
           stria__rank_round64(qrows * 4) + 2 * lse;
    total = tensors + ring + kern.total;
    if (total >> 63)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "rank memory: more than 2^63 bytes");
    *bytes_out = (uint64_t)total;
    return STRIA_OK;
}

uint64_t stria_session_region_bytes(int64_t batch, int64_t shard_tokens, int64_t heads,
                                    int64_t kv_heads, int64_t head_dim, stria_dtype_t dtype,
                                    uint64_t *in_room_out)
{
    size_t es = stria_dtype_size(dtype);
    if (batch <= 0 || shard_tokens <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 || es == 0)
        return 0;
    unsigned __int128 rows = (unsigned __int128)(uint64_t)batch * (uint64_t)shard_tokens;
    unsigned __int128 q = (unsigned __int128)(uint64_t)heads * (uint64_t)head_dim * es;
    unsigned __int128 kv = (unsigned __int128)(uint64_t)kv_heads * (uint64_t)head_dim * es;
    unsigned __int128 l = (unsigned __int128)(uint64_t)heads * 4;
    unsigned __int128 in = rows * (3 * q + 2 * kv + l), all = in + rows * (q + 2 * kv);
    if (all >> 62)
        return 0;
    if (in_room_out != NULL)
        *in_room_out = (uint64_t)in;
    return (uint64_t)all;
}

stria_status_t stria_session_rank_memory(int64_t batch, int64_t shard_tokens, int64_t heads,
                                         int64_t kv_heads, int64_t head_dim, stria_dtype_t dtype,
                                         uint32_t max_held, uint64_t *bytes_out)
{
    uint64_t base;
    stria_status_t st =
        stria_rank_memory(batch, shard_tokens, heads, kv_heads, head_dim, dtype, &base);
    if (st != STRIA_OK)
        return st;
    uint64_t region =
        stria_session_region_bytes(batch, shard_tokens, heads, kv_heads, head_dim, dtype, NULL);
    unsigned __int128 total = (unsigned __int128)base + (unsigned __int128)region * (1u + max_held);
    if (region == 0 || (total >> 63))
        return stria_error_set(STRIA_ERR_NO_MEMORY, "rank memory: more than 2^63 bytes");
    *bytes_out = (uint64_t)total;
    return STRIA_OK;
}
