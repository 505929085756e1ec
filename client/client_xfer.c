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
    int64_t tokens_per_outer; /* of base: layout->seq_len (full) or the shard's tokens */
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
    g->tokens_per_outer = full ? x->layout->seq_len : x->tokens;
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

/* A tensor being moved: where its compact bytes lie, and its chunks. */
typedef struct {
    stria__geom_t g;
    Stria__V1__Tensor tensor;
    uint64_t seg, total;
    bool cut;    /* chunks stop at batch rows (a padded shard) */
    bool staged; /* through the staging buffer */
    void *full;  /* staged: the caller's full tensor */
} stria__item_t;

/* A chunk of a batch: item i's bytes [at, at + n). */
typedef struct {
    size_t item;
    uint64_t at, n;
    Stria__V1__PutInputRequest put;
    Stria__V1__GetOutputRequest get;
} stria__chunk_t;

/* The next chunk at (*cur, *off), advancing them; false when none is left. */
static bool stria__next_chunk(const stria__item_t *it, size_t n_items, uint64_t chunk, size_t *cur,
                              uint64_t *off, stria__chunk_t *c)
{
    while (*cur < n_items && *off >= it[*cur].total) {
        (*cur)++;
        *off = 0;
    }
    if (*cur >= n_items)
        return false;
    const stria__item_t *t = &it[*cur];
    uint64_t n = t->total - *off < chunk ? t->total - *off : chunk;
    if (t->cut && n > t->seg - *off % t->seg)
        n = t->seg - *off % t->seg;
    c->item = *cur;
    c->at = *off;
    c->n = n;
    *off += n;
    return true;
}

/* Where a chunk stands, the same four fields in a PutInput and a GetOutput
 * request (`m`): the job, the rank, the tensor and the offset. */
#define STRIA__CHUNK_AT(m, x, t, c)                                                                \
    ((m)->job_id = (x)->job_id, (m)->rank = (uint32_t)(x)->rank, (m)->tensor = (t)->tensor,        \
     (m)->offset = (c)->at)

static void stria__chunk_request(const stria__xfer_t *x, const stria__item_t *t, stria__chunk_t *c,
                                 bool put, struct iovec *iov, size_t cnt, stria_rpc_request_t *rq)
{
    memset(rq, 0, sizeof(*rq));
    rq->timeout_s = x->timeout_s;
    rq->job_secret = x->secret;
    rq->job_id = x->job_id;
    rq->method = put ? STRIA_RPC_WORKER_PUT_INPUT : STRIA_RPC_WORKER_GET_OUTPUT;
    /* a put sends the chunk's bytes, a get reads them into it */
    *(put ? &rq->payload_iov : &rq->reply_iov) = iov;
    *(put ? &rq->payload_iovcnt : &rq->reply_iovcnt) = cnt;
    if (put) {
        c->put = (Stria__V1__PutInputRequest)STRIA__V1__PUT_INPUT_REQUEST__INIT;
        STRIA__CHUNK_AT(&c->put, x, t, c);
        c->put.total_bytes = t->total;
        rq->request = &c->put.base;
    } else {
        c->get = (Stria__V1__GetOutputRequest)STRIA__V1__GET_OUTPUT_REQUEST__INIT;
        STRIA__CHUNK_AT(&c->get, x, t, c);
        c->get.max_bytes = c->n;
        rq->request = &c->get.base;
    }
}

#define STRIA__XFER_BATCH 8 /* chunks in flight on a connection */

/* Moves every item, chunk by chunk, STRIA__XFER_BATCH chunks at a time
 * pipelined on the connection. A shorter reply than asked (a worker with a
 * smaller payload limit) resumes from where it stopped. */
static stria_status_t stria__move(const stria__xfer_t *x, stria__item_t *it, size_t n_items,
                                  bool put)
{
    uint64_t chunk = STRIA__XFER_CHUNK, max = stria_rpc_client_max_payload(x->conn);
    if (put && max > 0 && max < chunk)
        chunk = max;
    size_t cap = 0;
    for (size_t i = 0; i < n_items; i++) {
        size_t m = stria__max_pieces(&it[i].g, chunk);
        cap = m > cap ? m : cap;
    }
    struct iovec *iov = malloc(STRIA__XFER_BATCH * cap * sizeof(*iov));
    if (iov == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for %zu transfer pieces", cap);
    stria__chunk_t c[STRIA__XFER_BATCH];
    stria_rpc_request_t rq[STRIA__XFER_BATCH];
    stria_rpc_reply_t rep[STRIA__XFER_BATCH];
    stria_status_t st = STRIA_OK;
    size_t cur = 0;
    uint64_t off = 0;
    for (;;) {
        size_t k = 0;
        while (k < STRIA__XFER_BATCH && stria__next_chunk(it, n_items, chunk, &cur, &off, &c[k])) {
            const stria__item_t *t = &it[c[k].item];
            size_t cnt = stria__pieces(&t->g, c[k].at, c[k].n, iov + k * cap);
            stria__chunk_request(x, t, &c[k], put, iov + k * cap, cnt, &rq[k]);
            k++;
        }
        if (k == 0 || (st = stria_rpc_client_call_batch(x->conn, rq, k, rep)) != STRIA_OK)
            break;
        bool resumed = false;
        for (size_t i = 0; i < k; i++) {
            uint64_t moved = c[i].n, total = it[c[i].item].total;
            if (!put && st == STRIA_OK && !resumed) {
                const Stria__V1__GetOutputReply *r = (const Stria__V1__GetOutputReply *)rep[i].msg;
                moved = rep[i].payload_len;
                if (r->total_bytes != total || r->offset != c[i].at || moved == 0 || moved > c[i].n)
                    st = stria_error_set(STRIA_ERR_PROTOCOL,
                                         "output %d: worker sent %llu bytes at %llu of %llu, "
                                         "expected %llu at %llu of %llu",
                                         (int)it[c[i].item].tensor, (unsigned long long)moved,
                                         (unsigned long long)r->offset,
                                         (unsigned long long)r->total_bytes,
                                         (unsigned long long)c[i].n, (unsigned long long)c[i].at,
                                         (unsigned long long)total);
            }
            if (st == STRIA_OK && !resumed) {
                __atomic_fetch_add(x->progress, moved, __ATOMIC_RELAXED);
                if (moved < c[i].n) { /* resume there; the later chunks again */
                    cur = c[i].item;
                    off = c[i].at + moved;
                    resumed = true;
                }
            }
            stria_rpc_reply_free(&rep[i]);
        }
        if (st != STRIA_OK)
            break;
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

/* The items' geometries; staged ones point at their part of the rank's
 * staging buffer (put: packed there first). */
static stria_status_t stria__items(const stria__xfer_t *x, const stria__xfer_item_t *in, size_t n,
                                   bool put, stria__item_t *it)
{
    size_t stage = 0;
    for (size_t i = 0; i < n; i++) {
        stria__item_t *t = &it[i];
        memset(t, 0, sizeof(*t));
        stria__geom(&t->g, x, in[i].data, in[i].outer, in[i].row, !in[i].compact);
        t->tensor = in[i].tensor;
        t->seg = (uint64_t)x->tokens * in[i].row;
        t->total = (uint64_t)in[i].outer * t->seg;
        t->cut = x->layout->shard_tokens > x->tokens && in[i].outer > 1;
        t->staged = !in[i].compact && stria__staged(&t->g);
        if (t->staged)
            stage += (size_t)t->total;
    }
    char *buf = stage > 0 ? stria__stage(x, stage) : NULL;
    if (stage > 0 && buf == NULL)
        return STRIA_ERR_NO_MEMORY;
    for (size_t i = 0; i < n; i++) {
        stria__item_t *t = &it[i];
        if (!t->staged)
            continue;
        t->full = in[i].data;
        if (put)
            stria__pack(&t->g, buf, true);
        stria__geom(&t->g, x, buf, in[i].outer, in[i].row, false);
        buf += t->total;
    }
    return STRIA_OK;
}

#define STRIA__XFER_MAX_ITEMS 8

static stria_status_t stria__xfer(const stria__xfer_t *x, const stria__xfer_item_t *items, size_t n,
                                  bool put)
{
    stria__item_t it[STRIA__XFER_MAX_ITEMS];
    if (n == 0 || n > STRIA__XFER_MAX_ITEMS)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "transfer of %zu tensors (1..%d)", n,
                               STRIA__XFER_MAX_ITEMS);
    stria_status_t st = stria__items(x, items, n, put, it);
    if (st == STRIA_OK)
        st = stria__move(x, it, n, put);
    for (size_t i = 0; st == STRIA_OK && !put && i < n; i++)
        if (it[i].staged) { /* into the caller's tensor */
            stria__geom_t full;
            stria__geom(&full, x, it[i].full, items[i].outer, items[i].row, true);
            stria__pack(&full, it[i].g.base, false);
        }
    return st;
}

stria_status_t stria__xfer_put(const stria__xfer_t *x, const stria__xfer_item_t *items, size_t n)
{
    return stria__xfer(x, items, n, true);
}

stria_status_t stria__xfer_get(const stria__xfer_t *x, const stria__xfer_item_t *items, size_t n)
{
    return stria__xfer(x, items, n, false);
}
