/* libstria's transfers (client_xfer.h): a rank's shard moves between the
 * caller's tensors and its worker in PutInput/GetOutput chunks, each read
 * from or written to the caller's rows in place with scattered I/O (one
 * piece per run of adjacent rows: a whole batch row of a contiguous shard, a
 * token of a striped one), so no byte is copied on the way but by the
 * kernel's socket copies. Rows shorter than STRIA__XFER_MIN_PIECE in a
 * striped layout (LSE entries) go through the rank's staging buffer
 * instead. Chunks never cross a batch row of a padded shard, so the worker
 * receives and sends every chunk in place too. */
#include "client_xfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STRIA__XFER_CHUNK     ((uint64_t)64 << 20)
#define STRIA__XFER_MIN_PIECE 512

/* Where the compact bytes of a shard lie: in a full tensor (positions from
 * the layout's runs) or in a compact buffer. */
typedef struct {
    const stria__xfer_t *x;
    char *base;
    int64_t outer;
    size_t row;
    int64_t tokens_per_outer; /* of base: layout->seq (full) or the shard's tokens */
    bool full;
    stria_layout_run_t runs[STRIA_LAYOUT_MAX_RUNS];
    int64_t run_start[STRIA_LAYOUT_MAX_RUNS]; /* shard index of each run's first token */
    size_t n_runs;
    bool single_rows; /* a run with stride > 1: every row is a piece */
} stria__geom_t;

static void stria__geom(stria__geom_t *g, const stria__xfer_t *x, void *base, int64_t outer,
                        size_t row, bool full)
{
    memset(g, 0, sizeof(*g));
    g->x = x;
    g->base = base;
    g->outer = outer;
    g->row = row;
    g->full = full;
    g->tokens_per_outer = full ? x->layout->seq : x->tokens;
    if (!full) {
        g->runs[0] = (stria_layout_run_t){0, 1, x->tokens};
        g->n_runs = 1;
        return;
    }
    g->n_runs = stria_layout_shard_runs(x->layout, x->rank, false, g->runs);
    int64_t at = 0;
    for (size_t k = 0; k < g->n_runs; k++) {
        g->run_start[k] = at;
        at += g->runs[k].count;
        if (g->runs[k].stride != 1 && g->runs[k].count > 1)
            g->single_rows = true;
    }
}

/* The most pieces bytes [off, off + len) can take. */
static size_t stria__max_pieces(const stria__geom_t *g, uint64_t len)
{
    if (g->single_rows)
        return (size_t)(len / g->row) + 2;
    uint64_t seg = (uint64_t)g->x->tokens * g->row;
    return (size_t)((len / seg + 2) * g->n_runs) + 2;
}

/* The pieces of compact bytes [off, off + len), merged where adjacent. */
static size_t stria__pieces(const stria__geom_t *g, uint64_t off, uint64_t len, struct iovec *iov)
{
    uint64_t seg = (uint64_t)g->x->tokens * g->row;
    size_t n = 0;
    while (len > 0) {
        uint64_t o = off / seg, in = off % seg;
        int64_t i = (int64_t)(in / g->row);
        size_t b = (size_t)(in % g->row);
        size_t k = 0;
        while (k + 1 < g->n_runs && i >= g->run_start[k + 1])
            k++;
        const stria_layout_run_t *r = &g->runs[k];
        int64_t j = i - g->run_start[k];
        uint64_t take = g->row - b;
        if (r->stride == 1)
            take += (uint64_t)(r->count - j - 1) * g->row; /* the rest of the run at once */
        if (take > len)
            take = len;
        int64_t pos = r->first + j * r->stride;
        char *p = g->base + ((size_t)o * (size_t)g->tokens_per_outer + (size_t)pos) * g->row + b;
        if (n > 0 && (char *)iov[n - 1].iov_base + iov[n - 1].iov_len == p) {
            iov[n - 1].iov_len += (size_t)take;
        } else {
            iov[n].iov_base = p;
            iov[n].iov_len = (size_t)take;
            n++;
        }
        off += take;
        len -= take;
    }
    return n;
}

/* Moves the whole shard described by g, chunk by chunk. */
static stria_status_t stria__chunks(const stria__xfer_t *x, const stria__geom_t *g,
                                    Stria__V1__Tensor tensor, bool put)
{
    uint64_t seg = (uint64_t)x->tokens * g->row, total = (uint64_t)g->outer * seg;
    bool cut = x->layout->shard_tokens > x->tokens && g->outer > 1;
    uint64_t chunk = STRIA__XFER_CHUNK, max = stria_rpc_client_max_payload(x->conn);
    if (put && max > 0 && max < chunk)
        chunk = max;
    size_t cap = stria__max_pieces(g, chunk);
    struct iovec *iov = malloc(cap * sizeof(*iov));
    if (iov == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for %zu transfer pieces", cap);
    stria_status_t st = STRIA_OK;
    for (uint64_t off = 0; off < total && st == STRIA_OK;) {
        uint64_t n = total - off < chunk ? total - off : chunk;
        if (cut && n > seg - off % seg)
            n = seg - off % seg;
        size_t cnt = stria__pieces(g, off, n, iov);
        stria_rpc_request_t rq;
        stria_rpc_reply_t reply;
        memset(&rq, 0, sizeof(rq));
        memset(&reply, 0, sizeof(reply));
        rq.timeout_s = x->timeout_s;
        Stria__V1__PutInputRequest pr = STRIA__V1__PUT_INPUT_REQUEST__INIT;
        Stria__V1__GetOutputRequest gr = STRIA__V1__GET_OUTPUT_REQUEST__INIT;
        if (put) {
            pr.job_id = x->job_id;
            pr.rank = (uint32_t)x->rank;
            pr.tensor = tensor;
            pr.offset = off;
            pr.total_bytes = total;
            rq.method = STRIA_RPC_WORKER_PUT_INPUT;
            rq.request = &pr.base;
            rq.payload_iov = iov;
            rq.payload_iovcnt = cnt;
        } else {
            gr.job_id = x->job_id;
            gr.rank = (uint32_t)x->rank;
            gr.tensor = tensor;
            gr.offset = off;
            gr.max_bytes = n;
            rq.method = STRIA_RPC_WORKER_GET_OUTPUT;
            rq.request = &gr.base;
            rq.reply_iov = iov;
            rq.reply_iovcnt = cnt;
        }
        if ((st = stria_rpc_client_call(x->conn, &rq, &reply)) != STRIA_OK)
            break;
        uint64_t moved = n;
        if (!put) {
            const Stria__V1__GetOutputReply *rep = (const Stria__V1__GetOutputReply *)reply.msg;
            moved = reply.payload_len;
            if (rep->total_bytes != total || rep->offset != off || moved == 0 || moved > n)
                st = stria_error_set(
                    STRIA_ERR_PROTOCOL,
                    "output %d: worker sent %llu bytes at %llu of %llu, expected "
                    "%llu in all",
                    (int)tensor, (unsigned long long)moved, (unsigned long long)rep->offset,
                    (unsigned long long)rep->total_bytes, (unsigned long long)total);
        }
        stria_rpc_reply_free(&reply);
        off += moved;
        __atomic_fetch_add(x->progress, moved, __ATOMIC_RELAXED);
    }
    free(iov);
    return st;
}

/* The rank's staging buffer, at least `bytes`. */
static void *stria__stage(const stria__xfer_t *x, size_t bytes)
{
    if (*x->stage_cap >= bytes)
        return *x->stage;
    stria_free(*x->stage);
    *x->stage_cap = 0;
    if ((*x->stage = stria_malloc_aligned(bytes)) == NULL) {
        stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for %zu bytes of staging", bytes);
        return NULL;
    }
    *x->stage_cap = bytes;
    return *x->stage;
}

/* Between a full tensor and its compact shard, through the geometry's runs. */
static void stria__pack(const stria__geom_t *g, void *shard, bool to_shard)
{
    uint64_t seg = (uint64_t)g->x->tokens * g->row, total = (uint64_t)g->outer * seg;
    struct iovec iov[64];
    for (uint64_t off = 0; off < total;) {
        uint64_t n = total - off < seg ? total - off : seg;
        if (stria__max_pieces(g, n) > 64) /* striped: a row at a time */
            n = g->row * 32 < n ? g->row * 32 : n;
        size_t cnt = stria__pieces(g, off, n, iov);
        char *s = (char *)shard + off;
        for (size_t i = 0; i < cnt; s += iov[i].iov_len, i++)
            if (to_shard)
                memcpy(s, iov[i].iov_base, iov[i].iov_len);
            else
                memcpy(iov[i].iov_base, s, iov[i].iov_len);
        off += n;
    }
}

static bool stria__staged(const stria__geom_t *g)
{
    return g->single_rows && g->row < STRIA__XFER_MIN_PIECE;
}

stria_status_t stria__xfer_put(const stria__xfer_t *x, Stria__V1__Tensor tensor, const void *full,
                               int64_t outer, size_t row)
{
    stria__geom_t g;
    stria__geom(&g, x, (void *)full, outer, row, true);
    if (!stria__staged(&g))
        return stria__chunks(x, &g, tensor, true);
    void *shard = stria__stage(x, (size_t)outer * (size_t)x->tokens * row);
    if (shard == NULL)
        return STRIA_ERR_NO_MEMORY;
    stria__pack(&g, shard, true);
    return stria__xfer_put_compact(x, tensor, shard, outer, row);
}

stria_status_t stria__xfer_get(const stria__xfer_t *x, Stria__V1__Tensor tensor, void *full,
                               int64_t outer, size_t row)
{
    stria__geom_t g;
    stria__geom(&g, x, full, outer, row, true);
    if (!stria__staged(&g))
        return stria__chunks(x, &g, tensor, false);
    void *shard = stria__stage(x, (size_t)outer * (size_t)x->tokens * row);
    if (shard == NULL)
        return STRIA_ERR_NO_MEMORY;
    stria_status_t st = stria__xfer_get_compact(x, tensor, shard, outer, row);
    if (st == STRIA_OK)
        stria__pack(&g, shard, false);
    return st;
}

stria_status_t stria__xfer_put_compact(const stria__xfer_t *x, Stria__V1__Tensor tensor,
                                       const void *shard, int64_t outer, size_t row)
{
    stria__geom_t g;
    stria__geom(&g, x, (void *)shard, outer, row, false);
    return stria__chunks(x, &g, tensor, true);
}

stria_status_t stria__xfer_get_compact(const stria__xfer_t *x, Stria__V1__Tensor tensor,
                                       void *shard, int64_t outer, size_t row)
{
    stria__geom_t g;
    stria__geom(&g, x, shard, outer, row, false);
    return stria__chunks(x, &g, tensor, false);
}
