#include "session_util.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stria_layout.h"
#include "stria_ring.h"
#include "tref.h"

stria_call_t se_call_of(int64_t batch, int64_t seq, bool causal)
{
    stria_call_t c = STRIA_CALL_INIT;
    c.batch = batch;
    c.seq_len = seq;
    c.causal = causal;
    return c;
}

stria_session_spec_t se_spec_of(int64_t max_batch, int64_t max_seq, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, stria_dtype_t dtype, stria_layout_kind_t layout,
                                int ring)
{
    stria_session_spec_t s = STRIA_SESSION_SPEC_INIT;
    s.max_batch = max_batch;
    s.max_seq_len = max_seq;
    s.heads = heads;
    s.kv_heads = kv_heads;
    s.head_dim = head_dim;
    s.dtype = dtype;
    s.layout = layout;
    s.ring_size = ring;
    s.label = "test_session";
    return s;
}

stria_session_t *se_open_session(stria_client_t *cl, const stria_session_spec_t *spec)
{
    stria_session_t *s = NULL;
    cr_assert_eq(stria_session_open(cl, spec, &s), STRIA_OK, "stria_session_open: %s",
                 stria_error_msg());
    cr_assert_not_null(s);
    return s;
}

void se_call_tensors(fu_job_t *j, const stria_session_spec_t *sp, const stria_call_t *c,
                     uint64_t seed)
{
    cr_assert(fu_job_init(j, c->batch, c->seq_len, sp->heads,
                          sp->kv_heads ? sp->kv_heads : sp->heads, sp->head_dim, sp->dtype,
                          c->causal, seed),
              "out of memory");
}

bool se_ref_equal(const fu_job_t *j, const stria_call_t *c, int n_ranks, stria_layout_kind_t layout,
                  bool backward, char *why, size_t len)
{
    /* the spec's dimensions and bounds, the call's masks */
    stria_ring_shape_t shape = tjob_ring_shape(j);
    shape.call.causal = c->causal;
    shape.call.scale = c->scale;
    shape.call.cu_seqlens = c->cu_seqlens;
    shape.call.n_cu_seqlens = c->n_cu_seqlens;
    shape.call.has_window = c->has_window;
    shape.call.window_left = c->has_window ? c->window_left : 0;
    shape.call.window_right = c->has_window ? c->window_right : 0;
    stria_ring_local_opts_t lo = {.layout = layout,
                                  .n_ranks = n_ranks,
                                  .passes =
                                      backward ? STRIA_RING_PASS_FWD_BWD : STRIA_RING_PASS_FWD,
                                  .step_timeout_s = 30};
    return tref_job_equal(j, &shape, &lo, why, len);
}

void se_check_call(stria_session_t *s, const stria_session_spec_t *sp, const stria_call_t *c,
                   bool backward, uint64_t seed, const char *what)
{
    fu_job_t j;
    se_call_tensors(&j, sp, c, seed);
    cr_assert_eq(stria_session_forward(s, c, j.q, j.k, j.v, j.o, j.lse), STRIA_OK,
                 "%s: forward: %s", what, stria_error_msg());
    if (backward)
        cr_assert_eq(stria_session_backward(s, c, j.q, j.k, j.v, j.o, j.lse, j.g, j.dq, j.dk, j.dv),
                     STRIA_OK, "%s: backward: %s", what, stria_error_msg());
    char why[256];
    cr_expect(se_ref_equal(&j, c, stria_session_ring_size(s), stria_session_layout(s), backward,
                           why, sizeof(why)),
              "%s (batch %lld, seq_len %lld, %scausal): %s", what, (long long)c->batch,
              (long long)c->seq_len, c->causal ? "" : "not ", why);
    fu_job_free(&j);
}

/* ---- head groups ---- */

void se_groups_equal(const fu_job_t *j, const stria_call_t *c, int G, int R,
                     stria_layout_kind_t layout, const char *what)
{
    for (int g = 0; g < G; g++) {
        fu_job_t gj;
        cr_assert(fu_group_job(j, g, G, &gj), "out of memory");
        char why[256];
        cr_expect(se_ref_equal(&gj, c, R, layout, true, why, sizeof(why)),
                  "%s, head group %d of %d (a ring of %d): %s", what, g, G, R, why);
        fu_job_free(&gj);
    }
}

void se_check_groups_call(stria_session_t *s, const stria_session_spec_t *sp, const stria_call_t *c,
                          uint64_t seed, int G, int R, const char *what)
{
    fu_job_t j;
    se_call_tensors(&j, sp, c, seed);
    cr_assert_eq(stria_session_forward(s, c, j.q, j.k, j.v, j.o, j.lse), STRIA_OK,
                 "%s: forward: %s", what, stria_error_msg());
    cr_assert_eq(stria_session_backward(s, c, j.q, j.k, j.v, j.o, j.lse, j.g, j.dq, j.dk, j.dv),
                 STRIA_OK, "%s: backward: %s", what, stria_error_msg());
    se_groups_equal(&j, c, G, R, stria_session_layout(s), what);
    fu_job_free(&j);
}

/* ---- sharded calls ---------------------------------------------------------------- */

/* rows [b, pos[i]] of a full [B, S, row] tensor <-> [B, T, row] */
/* rows [b, pos[i]] of a full [B, S, row * G] tensor (bytes [g row,
 * (g+1) row) of each: a head group's) <-> [B, T, row] */
static void gather_rows(const char *full, char *shard, int64_t B, int64_t S, int64_t T,
                        const int64_t *pos, size_t row, int g, int G, bool to_shard)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < T; i++) {
            char *f = (char *)full + (size_t)(b * S + pos[i]) * row * (size_t)G + row * (size_t)g;
            char *x = shard + (size_t)(b * T + i) * row;
            memcpy(to_shard ? x : f, to_shard ? f : x, row);
        }
}

static void *rank_main(void *arg)
{
    se_rank_t *r = arg;
    fu_job_t *j = r->j;
    const stria_job_spec_t *sp = &j->spec;
    const int G = r->groups > 1 ? r->groups : 1, g = r->groups > 1 ? r->group : 0;
    const int64_t B = r->call.batch, S = r->call.seq_len, H = sp->heads / G, Hkv = sp->kv_heads / G;
    stria_session_t *s = G > 1 ? stria_session_head_group(r->s, g) : r->s;
    if (s == NULL) {
        r->st = STRIA_ERR_INVALID_ARG;
        snprintf(r->msg, sizeof(r->msg), "head group %d: %s", g, stria_error_msg());
        return NULL;
    }
    const stria_layout_kind_t layout = stria_session_layout(r->s);
    const int n = stria_session_ranks(r->s); /* the trainer's ranks (a head group's ring's) */
    /* striped: the session's own word (a rank of a session called by one
     * trainer rank per worker holds a stripe other than its number) */
    const bool own = layout == STRIA_LAYOUT_STRIPED && G == 1;
    int64_t T = own ? stria_session_shard_tokens(r->s, S, r->rank)
                    : stria_call_shard_tokens(layout, n, &r->call, r->rank);
    size_t rq = (size_t)(H * sp->head_dim) * j->es, rk = (size_t)(Hkv * sp->head_dim) * j->es;
    r->st = STRIA_ERR_INVALID_ARG;
    if (T < 0) {
        snprintf(r->msg, sizeof(r->msg), "stria_call_shard_tokens(%lld, %d) = %lld: %s",
                 (long long)S, r->rank, (long long)T, stria_error_msg());
        return NULL;
    }
    int64_t *pos = malloc((size_t)(T + 1) * sizeof(int64_t));
    /* q k v do | o dq dk dv (rows of bytes[i]) | lse */
    char *t[9];
    size_t bytes[8] = {rq, rk, rk, rq, rq, rq, rk, rk};
    for (int i = 0; i < 9; i++)
        t[i] = calloc(1, i < 8 ? (size_t)(B * T) * bytes[i] + 1 : (size_t)(B * H * T) * 4 + 1);
    if ((r->st = own ? stria_session_positions(r->s, S, r->rank, pos)
                     : stria_call_positions(layout, n, &r->call, r->rank, pos)) != STRIA_OK) {
        snprintf(r->msg, sizeof(r->msg), "positions: %s", stria_error_msg());
        goto out;
    }
    for (int64_t i = 0; i < T; i++)
        if (pos[i] < 0 || pos[i] >= S) {
            r->st = STRIA_ERR_INTERNAL;
            snprintf(r->msg, sizeof(r->msg), "position %lld of rank %d is %lld, not in [0, %lld)",
                     (long long)i, r->rank, (long long)pos[i], (long long)S);
            goto out;
        }
    const void *in[4] = {j->q, j->k, j->v, j->g};
    for (int i = 0; i < 4; i++)
        gather_rows(in[i], t[i], B, S, T, pos, bytes[i], g, G, true);
    uint64_t held = 0;
    r->st = r->held ? stria_session_forward_held(s, &r->call, r->rank, t[0], t[1], t[2], t[4],
                                                 (float *)t[8], &held)
                    : stria_session_forward_shard(s, &r->call, r->rank, t[0], t[1], t[2], t[4],
                                                  (float *)t[8]);
    if (r->st == STRIA_OK && r->backward)
        r->st = r->held ? stria_session_backward_held(s, &r->call, r->rank, held, t[3], t[5], t[6],
                                                      t[7])
                        : stria_session_backward_shard(s, &r->call, r->rank, t[0], t[1], t[2], t[4],
                                                       (float *)t[8], t[3], t[5], t[6], t[7]);
    if (r->st != STRIA_OK) {
        snprintf(r->msg, sizeof(r->msg), "%s", stria_error_msg());
        r->retryable = stria_error_retryable();
        goto out;
    }
    void *out[4] = {j->o, j->dq, j->dk, j->dv};
    for (int i = 0; i < 4; i++)
        gather_rows(out[i], t[4 + i], B, S, T, pos, bytes[4 + i], g, G, false);
    for (int64_t b = 0; b < B; b++) /* [B][H][T] of the group's heads among all G x H */
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < T; i++)
                j->lse[((b * G + g) * H + h) * S + pos[i]] = ((float *)t[8])[(b * H + h) * T + i];
out:
    for (int i = 0; i < 9; i++)
        free(t[i]);
    free(pos);
    return NULL;
}

void se_open_sharded(stria_client_t **cl, int n, const stria_session_spec_t *sp,
                     stria_session_t **h, size_t *len_out)
{
    h[0] = se_open_session(cl[0], sp);
    uint8_t ex[STRIA_SESSION_EXPORT_MAX_BYTES];
    size_t len = 0;
    cr_assert_eq(stria_session_export(h[0], ex, sizeof(ex), &len), STRIA_OK, "export: %s",
                 stria_error_msg());
    cr_assert_gt(len, 0u);
    for (int i = 1; i < n; i++) {
        h[i] = NULL;
        cr_assert_eq(stria_session_import(cl[i], ex, len, &h[i]), STRIA_OK, "import on rank %d: %s",
                     i, stria_error_msg());
    }
    if (len_out != NULL)
        *len_out = len;
}

static void ranks_call(stria_session_t **h, int n, int G, fu_job_t *j, const stria_call_t *calls,
                       bool backward, bool held, se_rank_t *r);

void se_sharded_call(stria_session_t **h, int n, fu_job_t *j, const stria_call_t *calls,
                     bool backward, se_rank_t *r)
{
    ranks_call(h, n, 1, j, calls, backward, false, r);
}

void se_sharded_call_held(stria_session_t **h, int n, fu_job_t *j, const stria_call_t *calls,
                          se_rank_t *r)
{
    ranks_call(h, n, 1, j, calls, true, true, r);
}

void se_sharded_call_tp(stria_session_t **h, int n, int G, fu_job_t *j, const stria_call_t *calls,
                        bool backward, se_rank_t *r)
{
    ranks_call(h, n, G, j, calls, backward, false, r);
}

static void ranks_call(stria_session_t **h, int n, int G, fu_job_t *j, const stria_call_t *calls,
                       bool backward, bool held, se_rank_t *r)
{
    pthread_t th[16];
    cr_assert_leq(n * G, 16);
    for (int i = 0; i < n * G; i++) {
        r[i] = (se_rank_t){.s = h[i],
                           .rank = i % n,
                           .j = j,
                           .call = calls[i % n],
                           .backward = backward,
                           .held = held,
                           .group = i / n,
                           .groups = G};
        cr_assert_eq(pthread_create(&th[i], NULL, rank_main, &r[i]), 0);
    }
    for (int i = 0; i < n * G; i++)
        pthread_join(th[i], NULL);
}
