#include "session_util.h"

#include <criterion/criterion.h>
#include <string.h>

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
