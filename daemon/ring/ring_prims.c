/* The ring engine's primitives: staging through a device whose memory is
 * not host memory, the pass's waits, posts, failure and agreement, and
 * compute time on a device. */
#include "ring_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* ---- staging (a device whose memory is not host memory) --------------------- */

/* Grows a kept buffer, device memory or pinned host memory, to `bytes`. */
static stria_status_t stria__grow(stria_device_t *dev, bool host, size_t bytes, void **buf,
                                  size_t *size)
{
    stria_status_t st;
    if (*buf != NULL && *size >= bytes)
        return STRIA_OK;
    if (host)
        stria_device_host_free(dev, *buf);
    else
        stria_device_free(dev, *buf);
    *buf = NULL;
    *size = 0;
    st = host ? stria_device_host_alloc(dev, bytes, buf) : stria_device_alloc(dev, bytes, buf);
    if (st == STRIA_OK)
        *size = bytes;
    return st;
}

/* The device and pinned host buffers of a staged call, kept for the next
 * call (device allocations are slow on a GPU). */
stria_status_t stria__staged_mem(stria_ring_pass_t *p, size_t dev_bytes, size_t host_bytes,
                                 char **dcur, char **hcur)
{
    stria_status_t st;
    if ((st = stria__grow(p->dev, false, dev_bytes, &p->dmem, &p->dmem_size)) != STRIA_OK ||
        (st = stria__grow(p->dev, true, host_bytes, &p->hmem, &p->hmem_size)) != STRIA_OK)
        return st;
    *dcur = p->dmem;
    *hcur = p->hmem;
    return STRIA_OK;
}

/* Whether the heads of a token, and the tokens of a batch, are adjacent in
 * a view: then a batch is one contiguous range. */
static bool stria__batch_contiguous(const stria_tensor_t *t, int64_t heads, int64_t D)
{
    return (heads == 1 || t->stride_head == D) && t->stride_token == heads * D;
}

/* Enqueues the copy of a [B, L, heads, D] device view into contiguous host
 * memory of the same dtype, in as few copies as the strides allow. */
static stria_status_t stria__download_view(stria_ring_pass_t *p, const stria_tensor_t *t, int64_t B,
                                           int64_t L, int64_t heads, int64_t D, char *dst)
{
    stria_status_t st = STRIA_OK;
    size_t es = stria_dtype_size(t->dtype), row = (size_t)D * es;
    if (stria__batch_contiguous(t, heads, D)) {
        size_t batch = (size_t)(L * heads) * row;
        if (B == 1 || t->stride_batch == L * heads * D)
            return stria_device_copy(p->dev, STRIA_STREAM_COPY, dst, t->data, (size_t)B * batch);
        for (int64_t b = 0; b < B && st == STRIA_OK; b++, dst += batch)
            st = stria_device_copy(p->dev, STRIA_STREAM_COPY, dst, stria__row(t, b, 0, 0), batch);
        return st;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < L; i++)
            for (int64_t h = 0; h < heads && st == STRIA_OK; h++, dst += row)
                st = stria_device_copy(p->dev, STRIA_STREAM_COPY, dst, stria__row(t, b, i, h), row);
    return st;
}

/* This rank's own K/V block, device views k and v, to the host as a
 * head-major message in dst: downloaded token-major into tmp (room for a
 * message), then relaid on the host, so the device needs no relayout op. */
stria_status_t stria__download_kv(stria_ring_pass_t *p, const stria_tensor_t *k,
                                  const stria_tensor_t *v, char *dst, char *tmp)
{
    const int64_t B = p->shape.call.batch, L = p->layout.shard_tokens, Hkv = p->shape.kv_heads;
    const int64_t D = p->shape.head_dim;
    const size_t kv_bytes = (size_t)(B * L * Hkv * D) * stria_dtype_size(p->shape.dtype);
    stria_status_t st;
    if ((st = stria__download_view(p, k, B, L, Hkv, D, tmp)) != STRIA_OK ||
        (st = stria__download_view(p, v, B, L, Hkv, D, tmp + kv_bytes)) != STRIA_OK ||
        (st = stria_device_sync(p->dev, STRIA_STREAM_COPY)) != STRIA_OK)
        return st;
    stria_tensor_t tk = stria_tensor_contiguous(tmp, p->shape.dtype, L, Hkv, D);
    stria_tensor_t tv = stria_tensor_contiguous(tmp + kv_bytes, p->shape.dtype, L, Hkv, D);
    stria__pack_view(&tk, B, L, Hkv, D, dst);
    stria__pack_view(&tv, B, L, Hkv, D, dst + kv_bytes);
    return STRIA_OK;
}

/* Zeros rows [from, L) of a [B, L, heads, D] device view, on the compute
 * stream. */
stria_status_t stria__device_zero_rows(stria_ring_pass_t *p, const stria_tensor_t *t, int64_t B,
                                       int64_t from, int64_t L, int64_t heads, int64_t D)
{
    stria_status_t st = STRIA_OK;
    size_t row = (size_t)D * stria_dtype_size(t->dtype);
    if (from >= L)
        return STRIA_OK;
    for (int64_t b = 0; b < B && st == STRIA_OK; b++) {
        if (stria__batch_contiguous(t, heads, D)) {
            st = stria_device_zero(p->dev, STRIA_STREAM_COMPUTE, stria__row(t, b, from, 0),
                                   (size_t)((L - from) * heads) * row);
            continue;
        }
        for (int64_t i = from; i < L; i++)
            for (int64_t h = 0; h < heads && st == STRIA_OK; h++)
                st = stria_device_zero(p->dev, STRIA_STREAM_COMPUTE, stria__row(t, b, i, h), row);
    }
    return st;
}

/* Waits for both streams: the errors of enqueued work surface here. */
stria_status_t stria__device_drain(stria_ring_pass_t *p)
{
    stria_status_t st = stria_device_sync(p->dev, STRIA_STREAM_COMPUTE);
    stria_status_t st2 = stria_device_sync(p->dev, STRIA_STREAM_COPY);
    return st != STRIA_OK ? st : st2;
}

/* Index i of the document holding position x: cu[i] <= x < cu[i + 1]
 * (the last of equal entries: empty documents hold nothing). x must lie in
 * [0, seq_len). Its start is cu[i], its end cu[i + 1]. */
static size_t stria__doc_of(const stria_call_shape_t *s, int64_t x)
{
    size_t lo = 0, hi = s->n_cu_seqlens - 1; /* cu[lo] <= x < cu[hi] */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->cu_seqlens[mid] <= x)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Rank r's real queries lie in [qa, qb] and rank j's real keys in [ka, kb]
 * (the lowest and highest positions of each shard). A pair (p, k) is
 * visible when k - p lies in [-left, right] (causal: right = 0) and both
 * are in one document. Over the two ranges k - p takes every value of
 * [ka - qb, kb - qa], so the window test is exact for ranges; a document
 * that starts after kb for the first query, or ends before ka for the last,
 * hides the block from every query between (the documents a query sees
 * only move forward with its position). Exact for contiguous shards,
 * conservative (never hides a visible key) for the others. */
static bool stria__sees_ranges(const stria_ring_pass_t *p, int64_t qa, int64_t qb, int64_t ka,
                               int64_t kb)
{
    const stria_call_shape_t *s = &p->shape.call;
    int64_t right = s->causal ? 0 : -1;
    if (s->has_window && s->window_right >= 0 && (right < 0 || s->window_right < right))
        right = s->window_right;
    if (right >= 0 && ka - qb > right)
        return false;
    if (s->has_window && s->window_left >= 0 && kb - qa < -s->window_left)
        return false;
    if (s->n_cu_seqlens > 0 &&
        (kb < s->cu_seqlens[stria__doc_of(s, qa)] || ka >= s->cu_seqlens[stria__doc_of(s, qb) + 1]))
        return false;
    return true;
}

bool stria__sees(const stria_ring_pass_t *p, int r, int j)
{
    if (p->valid[r] == 0 || p->valid[j] == 0)
        return false;
    return stria__sees_ranges(p, p->pos_min[r], p->pos_max[r], p->pos_min[j], p->pos_max[j]);
}

/* Whether some real key of block j is visible to some real query of this
 * rank's shard. Skipping the others is Ring Attention's causal block
 * skipping (and that of windows and documents); the kernel would skip their
 * tiles anyway, this also saves the packing. After step 0 a packed block is
 * its travelling rows, which only this rank's travelling queries may see
 * (its kept documents lie on it whole). */
bool stria__visible(const stria_ring_pass_t *p, int j, int step)
{
    const int r = p->rank;
    if (step == 0 || p->plan == NULL)
        return stria__sees(p, r, j);
    if (p->travel[r] == 0 || p->travel[j] == 0)
        return false;
    return stria__sees_ranges(p, p->tpos_min[r], p->tpos_max[r], p->tpos_min[j], p->tpos_max[j]);
}

int64_t stria__msg_rows(const stria_ring_pass_t *p, int j)
{
    return p->plan != NULL ? p->travel[j] : p->layout.shard_tokens;
}

/* Rings up to this size get the forward's hop count worked out (N^2 tests
 * of two ranges); larger ones always run N steps. */
#define STRIA__MAX_HOP_SCAN 4096

/* The K/V block of rank j reaches rank r after (r - j) mod N hops; a
 * forward needs as many steps as the farthest hop any rank sees a block
 * over, plus one. Steps past it would carry only blocks that no rank uses:
 * under contiguous with a causal window of W tokens and shards of L, that
 * is 1 + ceil(W / L) steps instead of N. */
int stria__fwd_steps(const stria_ring_pass_t *p)
{
    int far = 0;
    if (p->plan != NULL) /* counted by the plan, alike on every rank */
        return p->plan->steps;
    if (p->n > STRIA__MAX_HOP_SCAN ||
        (!p->shape.call.has_window && p->shape.call.n_cu_seqlens == 0))
        return p->n;
    for (int r = 0; r < p->n && far < p->n - 1; r++)
        for (int hop = p->n - 1; hop > far; hop--)
            if (stria__sees(p, r, (r - hop + p->n) % p->n)) {
                far = hop;
                break;
            }
    return far + 1;
}

stria_attn_params_t stria__params(const stria_ring_pass_t *p, int j, bool travel)
{
    stria_attn_params_t a = stria_ring_shape_attn_params(&p->shape);
    const int64_t kv = travel ? p->travel[j] : p->valid[j];
    a.q_tokens = p->valid[p->rank];
    a.kv_tokens = kv > 0 ? kv : 1;
    a.q_pos.runs = p->runs[p->rank];
    a.q_pos.n_runs = p->n_runs[p->rank];
    a.kv_pos.runs = p->runs[j];
    a.kv_pos.n_runs = travel ? p->travel_runs[j] : p->n_runs[j];
    a.pool = p->pool;
    a.workspace = p->mem.alloc != NULL ? &p->mem : NULL;
    return a;
}

void stria__step_begin(stria_ring_pass_t *p, int step)
{
    stria__times_step(p, step, stria_time_now());
    if (p->hooks.step_cb != NULL)
        p->hooks.step_cb(p->hooks.step_cb_ctx, step, p->steps_run);
}

void stria__compute_begin(stria__clock_t *clk)
{
    clk->cpu = stria_time_thread_cpu();
    clk->wall = stria_time_now();
}

void stria__compute_end(const stria_ring_pass_t *p, const stria__clock_t *clk,
                        stria_ring_step_stats_t *ss)
{
    double now = stria_time_now();
    ss->compute_s += stria_time_thread_cpu() - clk->cpu;
    ss->compute_wall_s += now - clk->wall;
    stria__times_span(p, ss, STRIA_RING_SPAN_COMPUTE, clk->wall, now);
}

void stria__cancel_all(stria_ring_pass_t *p, stria__reqs_t *r)
{
    stria_link_req_t **all[] = {&r->kv_send, &r->kv_recv, &r->dkv_recv, &r->dkv_send[0],
                                &r->dkv_send[1]};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        stria_link_cancel(p->link, *all[i]);
        *all[i] = NULL;
    }
}

/* Waits for *req (if any) within the step deadline and clears it; the link
 * releases the request whatever the outcome. */
stria_status_t stria__wait(stria_ring_pass_t *p, stria_link_req_t **req, int step,
                           stria_ring_step_stats_t *stats)
{
    stria_status_t st;
    double t0, timeout = -1.0;
    if (*req == NULL)
        return STRIA_OK;
    t0 = stria_time_now();
    /* Cumulative deadlines: when ranks block on each other in a chain, the
     * one blocked since the earliest step (next to the failed rank) reaches
     * its deadline first, so the abort names the right rank. The floor keeps
     * a rank that was itself slow from failing a transfer that is about to
     * complete. */
    if (p->timeout_s >= 0) {
        timeout = p->t_start + (double)(step + 1) * p->timeout_s - t0;
        if (timeout < 0.1 * p->timeout_s)
            timeout = 0.1 * p->timeout_s;
    }
    if (p->hooks.wait_begin_cb != NULL)
        p->hooks.wait_begin_cb(p->hooks.wait_cb_ctx);
    st = stria_link_wait(p->link, *req, timeout);
    if (p->hooks.wait_end_cb != NULL)
        p->hooks.wait_end_cb(p->hooks.wait_cb_ctx);
    double t1 = stria_time_now();
    stria__times_waited(p, *req, t1);
    *req = NULL;
    stats->wait_s += t1 - t0;
    stria__times_span(p, stats, STRIA_RING_SPAN_WAIT, t0, t1);
    return st;
}

stria_status_t stria__post(stria_ring_pass_t *p, bool send, int step, int kind, void *buf,
                           size_t len, stria_link_req_t **req, stria_ring_step_stats_t *stats)
{
    uint64_t tag = stria__tag(p, step, kind);
    stria_status_t st = send ? stria_link_isend(p->link, tag, buf, len, req)
                             : stria_link_irecv(p->link, tag, buf, len, req);
    if (st == STRIA_OK) {
        if (send)
            stats->bytes_sent += len;
        else
            stats->bytes_recv += len;
        if (send && kind != STRIA__MSG_DONE)
            stria__times_send(p, *req, stats, kind == STRIA__MSG_DKV, stria_time_now());
    }
    return st;
}

/* Ends a failed pass: names this rank and step, tells the other ranks, and
 * releases every request. */
stria_status_t stria__fail(stria_ring_pass_t *p, stria__reqs_t *reqs, stria_status_t st,
                           const char *what, int step)
{
    stria_error_wrap(st, "rank %d, %s step %d", p->rank, what, step);
    /* Abort even when a peer's abort caused this error: a link that only
     * detects failures of its neighbours relies on every rank passing it on
     * (the first abort's origin is what the other ranks report). */
    stria_link_abort(p->link, st, stria_error_msg());
    stria__cancel_all(p, reqs);
    return st;
}

/* Agreement at the end of a pass: no rank returns success unless every rank
 * finished. Every rank sends one token per round and sends round t only after
 * it received round t - 1, so a token of round t from r - 1 proves that ranks
 * r - t .. r - 1 finished; after N - 1 rounds each rank has heard from all.
 * A rank that failed never sends, and its abort wakes the ranks waiting for
 * it. (A rank that fails during the agreement itself may leave others
 * reporting success: their outputs are complete by then.) */
stria_status_t stria__agree(stria_ring_pass_t *p, stria__reqs_t *reqs, int first_step,
                            stria_ring_step_stats_t *ss)
{
    uint64_t token = 0, in = 0;
    stria_status_t st = STRIA_OK;
    for (int t = 1; t < p->n && st == STRIA_OK; t++) {
        st = stria__post(p, false, t, STRIA__MSG_DONE, &in, sizeof(in), &reqs->kv_recv, ss);
        if (st == STRIA_OK)
            st =
                stria__post(p, true, t, STRIA__MSG_DONE, &token, sizeof(token), &reqs->kv_send, ss);
        if (st == STRIA_OK)
            st = stria__wait(p, &reqs->kv_recv, first_step + t - 1, ss);
        if (st == STRIA_OK)
            st = stria__wait(p, &reqs->kv_send, first_step + t - 1, ss);
    }
    return st;
}

/* After a failed staged call: nothing enqueued may outlive the call (it may
 * read the caller's buffers), and the message of the failure is kept. */
void stria__drain_on_error(stria_ring_pass_t *p, stria_status_t st)
{
    char msg[1024];
    if (st == STRIA_OK || !p->staged)
        return;
    snprintf(msg, sizeof(msg), "%s", stria_error_msg());
    (void)stria__device_drain(p);
    (void)stria_error_set(st, "%s", msg);
}

/* ---- compute time on a device ---------------------------------------- */

/* On a GPU the kernels only enqueue work: the step's compute time is the
 * wall time from its first enqueue until the compute stream is seen idle,
 * measured after the step's link waits (so it is exact when the step is
 * compute-bound and an upper bound including the wait otherwise); the sync
 * costs the GPU only the host's latency to enqueue the next step. */
stria_status_t stria__device_step_time(stria_ring_pass_t *p, double t0, stria_ring_step_stats_t *ss)
{
    stria_status_t st;
    if (!p->dev_timed || t0 == 0.0)
        return STRIA_OK;
    st = stria_device_sync(p->dev, STRIA_STREAM_COMPUTE);
    double t1 = stria_time_now();
    ss->compute_s += t1 - t0;
    ss->compute_wall_s = ss->compute_s;
    stria__times_span(p, ss, STRIA_RING_SPAN_COMPUTE, t0, t1);
    return st;
}

void stria__compute_end_dev(stria_ring_pass_t *p, const stria__clock_t *clk,
                            stria_ring_step_stats_t *ss, double *t_dev0)
{
    if (!p->dev_timed) {
        stria__compute_end(p, clk, ss);
        return;
    }
    if (*t_dev0 == 0.0)
        *t_dev0 = clk->wall;
}

/* The LSE of the real rows, [B*H, qv], to the caller's [B*H, L] with -inf
 * in the padded rows. Staged: through pinned host memory (a few bytes per
 * row, so simpler than B*H device copies). */
stria_status_t stria__store_lse(stria_ring_pass_t *p, const float *lse_acc, float *lse,
                                float *host_tmp, int64_t BH, int64_t L, int64_t qv)
{
    stria_status_t st;
    const float *src = lse_acc;
    float *dst = p->staged ? host_tmp : lse;
    if (p->staged && qv > 0) {
        if ((st = stria_device_copy(p->dev, STRIA_STREAM_COMPUTE, host_tmp + BH * L, lse_acc,
                                    (size_t)(BH * qv) * sizeof(float))) != STRIA_OK ||
            (st = stria_device_sync(p->dev, STRIA_STREAM_COMPUTE)) != STRIA_OK)
            return st;
        src = host_tmp + BH * L;
    }
    for (int64_t bh = 0; bh < BH; bh++)
        for (int64_t i = 0; i < L; i++)
            dst[bh * L + i] = i < qv ? src[bh * qv + i] : -INFINITY;
    if (!p->staged)
        return STRIA_OK;
    return stria_device_copy(p->dev, STRIA_STREAM_COMPUTE, lse, host_tmp,
                             (size_t)(BH * L) * sizeof(float));
}
