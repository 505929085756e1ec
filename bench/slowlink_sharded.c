/* stria-bench slowlink --sharded: a layout's session called as a
 * context-parallel trainer calls it. One client per trainer rank (TCP, so
 * its tensors travel over the control network as the whole rows' do); rank
 * 0 opens the sharded session and exports it, the others import it; each
 * holds its own tokens, cut from the whole rows' full tensors at its
 * positions. A round runs the forward on every rank at once, a thread
 * each (they meet on the ring), then the backward. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_daemons.h"
#include "slowlink.h"
#include "stria_client.h"
#include "stria_common.h"

/* One trainer rank: its client, its handle, its tokens and what its last
 * call did. */
typedef struct {
    int j;
    stria_client_t *cl;
    stria_session_t *s;
    int64_t tokens;
    void *q, *k, *v, *g, *o, *dq, *dk, *dv;
    float *lse;
    /* the call of a phase */
    const stria_call_t *call;
    bool backward;
    pthread_t th;
    bool started;
    stria_status_t st;
    char msg[512];
    double t0, t1; /* its call's start and end */
} sl_rank_t;

struct sl_ranks {
    int n;
    sl_rank_t *rank;
};

static void sl_shard_fail(sl_row_t *row, const char *what, const char *why)
{
    row->ok = false;
    snprintf(row->msg, sizeof(row->msg), "%.60s: %.440s", what, why);
    sl__sharded_close(row);
}

void sl__sharded_close(sl_row_t *row)
{
    sl_ranks_t *rk = row->ranks;
    if (rk == NULL)
        return;
    for (int j = rk->n - 1; j >= 0; j--) { /* the importers first, the opener last */
        sl_rank_t *k = &rk->rank[j];
        stria_session_close(k->s);
        stria_client_close(k->cl);
        free(k->q), free(k->k), free(k->v), free(k->g), free(k->o);
        free(k->dq), free(k->dk), free(k->dv), free(k->lse);
    }
    free(rk->rank);
    free(rk);
    row->ranks = NULL;
}

/* Rank k's tokens of `call` (at its positions in a ring of n ranks of the
 * row's layout) gathered from t's full tensors, and room for its outputs. */
static int sl_cut(const sl_row_t *row, sl_rank_t *k, int n, const stria_call_t *call,
                  const stria_bench_job_t *t)
{
    /* striped: the session's word (one trainer rank per worker holds a
     * stripe other than its number) */
    const bool own = row->kind == STRIA_LAYOUT_STRIPED;
    k->tokens = own ? stria_session_shard_tokens(k->s, call->seq_len, k->j)
                    : stria_call_shard_tokens(row->kind, n, call, k->j);
    if (k->tokens < 0)
        return -1;
    size_t m = (size_t)(k->tokens > 0 ? k->tokens : 1), es = stria_dtype_size(t->dtype);
    size_t qrow = (size_t)(t->heads * t->head_dim) * es;
    size_t krow = (size_t)(t->kv_heads * t->head_dim) * es;
    int64_t *pos = malloc(m * sizeof(*pos));
    size_t lse = m * (size_t)t->heads * sizeof(float);
    k->q = malloc(m * qrow), k->g = malloc(m * qrow), k->o = malloc(m * qrow);
    k->dq = malloc(m * qrow);
    k->k = malloc(m * krow), k->v = malloc(m * krow), k->dk = malloc(m * krow);
    k->dv = malloc(m * krow);
    k->lse = malloc(lse);
    if (pos == NULL || k->q == NULL || k->g == NULL || k->o == NULL || k->dq == NULL ||
        k->k == NULL || k->v == NULL || k->dk == NULL || k->dv == NULL || k->lse == NULL) {
        free(pos);
        stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for rank %d's tokens", k->j);
        return -1;
    }
    if ((own ? stria_session_positions(k->s, call->seq_len, k->j, pos)
             : stria_call_positions(row->kind, n, call, k->j, pos)) != STRIA_OK) {
        free(pos);
        return -1;
    }
    for (int64_t i = 0; i < k->tokens; i++) { /* batch 1 */
        size_t at = (size_t)pos[i];
        memcpy((char *)k->q + (size_t)i * qrow, (const char *)t->q + at * qrow, qrow);
        memcpy((char *)k->g + (size_t)i * qrow, (const char *)t->g + at * qrow, qrow);
        memcpy((char *)k->k + (size_t)i * krow, (const char *)t->k + at * krow, krow);
        memcpy((char *)k->v + (size_t)i * krow, (const char *)t->v + at * krow, krow);
    }
    /* the outputs' pages faulted in before timing, as the whole rows' */
    memset(k->o, 0, m * qrow), memset(k->dq, 0, m * qrow);
    memset(k->dk, 0, m * krow), memset(k->dv, 0, m * krow), memset(k->lse, 0, lse);
    free(pos);
    return 0;
}

int sl__sharded_open(sl_row_t *row, stria_session_spec_t *sp, const char *coord,
                     const stria_call_t *call, const stria_bench_job_t *t)
{
    sl_ranks_t *rk = calloc(1, sizeof(*rk));
    stria_client_t *cl = NULL;
    stria_session_t *s = NULL;
    row->ranks = rk;
    row->ok = true;
    if (rk == NULL) {
        sl_shard_fail(row, "open", "out of memory");
        return -1;
    }
    sp->sharded = true;
    sp->arrival_timeout_s = 60;
    if (stria_bench_client(coord, "stria-bench slowlink rank", STRIA_DATA_PATH_TCP, &cl) !=
        STRIA_OK) {
        sl_shard_fail(row, "rank 0's client", stria_error_msg());
        return -1;
    }
    if (stria_session_open(cl, sp, &s) != STRIA_OK) {
        stria_client_close(cl);
        sl_shard_fail(row, "refused at open", stria_error_msg());
        row->refused = true;
        return -1;
    }
    const int n = stria_session_ranks(s);
    uint8_t ex[STRIA_SESSION_EXPORT_MAX_BYTES];
    size_t len = 0;
    rk->rank = calloc((size_t)(n > 0 ? n : 1), sizeof(*rk->rank));
    if (rk->rank == NULL || n <= 0) {
        stria_session_close(s);
        stria_client_close(cl);
        sl_shard_fail(row, "open", rk->rank == NULL ? "out of memory" : "no ranks");
        return -1;
    }
    rk->n = n;
    rk->rank[0] = (sl_rank_t){.j = 0, .cl = cl, .s = s};
    if (stria_session_export(s, ex, sizeof(ex), &len) != STRIA_OK) {
        sl_shard_fail(row, "export", stria_error_msg());
        return -1;
    }
    for (int j = 1; j < n; j++) {
        sl_rank_t *k = &rk->rank[j];
        k->j = j;
        if (stria_bench_client(coord, "stria-bench slowlink rank", STRIA_DATA_PATH_TCP, &k->cl) !=
                STRIA_OK ||
            stria_session_import(k->cl, ex, len, &k->s) != STRIA_OK) {
            char what[48];
            snprintf(what, sizeof(what), "rank %d's import", j);
            sl_shard_fail(row, what, stria_error_msg());
            return -1;
        }
    }
    for (int j = 0; j < n; j++)
        if (sl_cut(row, &rk->rank[j], n, call, t) != 0) {
            char what[48];
            snprintf(what, sizeof(what), "rank %d's tokens", j);
            sl_shard_fail(row, what, stria_error_msg());
            return -1;
        }
    return 0;
}

static void *sl_rank_main(void *arg)
{
    sl_rank_t *k = arg;
    k->t0 = stria_time_now();
    if (!k->backward)
        k->st = stria_session_forward_shard(k->s, k->call, k->j, k->q, k->k, k->v, k->o, k->lse);
    else
        k->st = stria_session_backward_shard(k->s, k->call, k->j, k->q, k->k, k->v, k->o, k->lse,
                                             k->g, k->dq, k->dk, k->dv);
    k->t1 = stria_time_now();
    if (k->st != STRIA_OK)
        snprintf(k->msg, sizeof(k->msg), "%s", stria_error_msg());
    return NULL;
}

/* The forward (or backward) on every rank at once: *t0 the first rank's
 * start, *t1 the last one's end, *pass the slowest rank's pass, *ring the
 * bytes all ring ranks sent on the ring (with one trainer rank per worker,
 * each worker's counted once). Returns false with row->msg (the ranks
 * closed). */
static bool sl_phase(sl_row_t *row, bool backward, const stria_call_t *call, double *t0, double *t1,
                     double *pass, double *ring)
{
    sl_ranks_t *rk = row->ranks;
    const char *what = backward ? "backward" : "forward";
    for (int j = 0; j < rk->n; j++) {
        sl_rank_t *k = &rk->rank[j];
        k->call = call, k->backward = backward, k->st = STRIA_OK, k->msg[0] = '\0';
        k->started = pthread_create(&k->th, NULL, sl_rank_main, k) == 0;
        if (!k->started) { /* the others fail when it does not arrive */
            k->st = STRIA_ERR_NO_MEMORY;
            snprintf(k->msg, sizeof(k->msg), "cannot start its thread");
        }
    }
    *t0 = 1e300, *t1 = 0, *pass = 0, *ring = 0;
    int bad = -1;
    for (int j = 0; j < rk->n; j++) {
        sl_rank_t *k = &rk->rank[j];
        if (k->started)
            pthread_join(k->th, NULL);
        if (k->st != STRIA_OK && bad < 0)
            bad = j;
        *t0 = k->t0 < *t0 ? k->t0 : *t0;
        *t1 = k->t1 > *t1 ? k->t1 : *t1;
        stria_session_stats_t ss = STRIA_SESSION_STATS_INIT;
        if (k->st == STRIA_OK && stria_session_stats(k->s, &ss) == STRIA_OK) {
            *pass = ss.last_pass_s > *pass ? ss.last_pass_s : *pass;
            *ring += (double)ss.last_ring_bytes;
        }
    }
    if (row->per_worker) /* each worker's pass, reported by its G trainer ranks */
        *ring /= row->groups;
    if (bad >= 0) {
        char head[64], why[512];
        snprintf(head, sizeof(head), "%s, rank %d", what, bad);
        snprintf(why, sizeof(why), "%s", rk->rank[bad].msg);
        sl_shard_fail(row, head, why);
        return false;
    }
    return true;
}

void sl__sharded_call(sl_row_t *row, const stria_call_t *call, int r)
{
    double f0, f1, b0, b1, pf, pb, rf, rb;
    uint64_t n0 = sl__fabric_bytes();
    if (!sl_phase(row, false, call, &f0, &f1, &pf, &rf))
        return;
    uint64_t n1 = sl__fabric_bytes();
    if (!sl_phase(row, true, call, &b0, &b1, &pb, &rb))
        return;
    uint64_t n2 = sl__fabric_bytes();
    if (r < 0)
        return;
    row->fwd[r] = f1 - f0;
    row->fwd_bwd[r] = b1 - f0;
    row->pass_f[r] = pf;
    row->pass_b[r] = pb;
    row->mib_f[r] = (double)(n1 - n0) / 1048576.0;
    row->mib_b[r] = (double)(n2 - n1) / 1048576.0;
    row->ring_f[r] = rf / 1048576.0;
    row->ring_b[r] = rb / 1048576.0;
}
