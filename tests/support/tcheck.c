#include "tcheck.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

#include "ref.h"
#include "tref.h"

void tcheck_reference(const tcheck_t *c)
{
    const stria_job_spec_t *s = c->spec;
    ref_shape_t rs = {s->batch,
                      s->seq_len,
                      s->seq_len,
                      s->heads,
                      s->kv_heads,
                      s->head_dim,
                      1.0 / sqrt((double)s->head_dim),
                      s->causal,
                      NULL,
                      NULL};
    ref_masks_t m = {.cu_seqlens = s->cu_seqlens,
                     .n_cu = s->n_cu_seqlens,
                     .has_window = s->has_window,
                     .left = s->window_left,
                     .right = s->window_right};
    const float *d_o = c->backward ? c->d_o : NULL;
    ref_out_t r64, r32, ry;
    ref_f64_run_masks(&rs, &m, c->q, c->k, c->v, d_o, &r64);
    ref_f32_run_masks(&rs, &m, c->q, c->k, c->v, d_o, &r32);
    const bool bf16_dot = c->bf16_dot && s->dtype == STRIA_DTYPE_BF16;
    if (bf16_dot)
        ref_bf16_run_masks(&rs, &m, c->q, c->k, c->v, d_o, &ry);
    const double round = s->dtype == STRIA_DTYPE_F32    ? 0
                         : s->dtype == STRIA_DTYPE_BF16 ? 1.0 / 256
                                                        : 1.0 / 2048;
    const double *r64s[TJ_N_OUT] = {r64.o, r64.lse, r64.dq, r64.dk, r64.dv};
    const double *r32s[TJ_N_OUT] = {r32.o, r32.lse, r32.dq, r32.dk, r32.dv};
    const double *rys[TJ_N_OUT] = {NULL};
    if (bf16_dot)
        rys[TJ_O] = ry.o, rys[TJ_DQ] = ry.dq, rys[TJ_DK] = ry.dk, rys[TJ_DV] = ry.dv;
    const size_t nq = (size_t)(s->batch * s->seq_len * s->heads * s->head_dim);
    const size_t nk = (size_t)(s->batch * s->seq_len * s->kv_heads * s->head_dim);
    const size_t n[TJ_N_OUT] = {nq, (size_t)(s->batch * s->heads * s->seq_len), nq, nk, nk};
    for (int i = 0; i < (c->backward ? TJ_N_OUT : TJ_DQ); i++) {
        const stria_dtype_t dt = i == TJ_LSE ? STRIA_DTYPE_F32 : s->dtype;
        float *f = malloc(n[i] * sizeof(float));
        cr_assert_not_null(f);
        stria_dtype_convert(dt, c->out[i], STRIA_DTYPE_F32, f, n[i]);
        double err = ref_max_err_f32(f, r64s[i], n[i]);
        double naive = ref_max_err_f64(r32s[i], r64s[i], n[i]);
        double mag = ref_max_abs(r64s[i], n[i]);
        double r = dt == STRIA_DTYPE_F32 ? 0 : round;
        double tol = 2 * naive + 2e-6 * (1 + mag) + r * mag;
        if (rys[i] != NULL)
            tol = fmax(tol, 2 * ref_max_err_f64(rys[i], r64s[i], n[i]) + 2e-6 * (1 + mag));
        cr_expect(err <= tol, "%s: %s: error %.3g > tolerance %.3g (ring of %d, S=%lld, %s)",
                  c->what, tjob_out_names[i], err, tol, s->ring_size, (long long)s->seq_len,
                  stria_dtype_name(s->dtype));
        free(f);
    }
    ref_out_free(&r64);
    ref_out_free(&r32);
    if (bf16_dot)
        ref_out_free(&ry);
}

void tcheck_job(const tjob_t *j, bool backward, bool bf16_dot, const char *what)
{
    tcheck_t c = {.spec = &j->spec,
                  .q = j->qf,
                  .k = j->kf,
                  .v = j->vf,
                  .d_o = j->gf,
                  .out = {j->o, j->lse, j->dq, j->dk, j->dv},
                  .backward = backward,
                  .bf16_dot = bf16_dot,
                  .what = what};
    tcheck_reference(&c);
}

void tcheck_in_process(const tjob_t *j, const stria_ring_local_opts_t *lo, const char *what)
{
    char why[256] = "";
    const stria_ring_shape_t shape = tjob_ring_shape(j);
    int diff = tref_job_diff(j, &shape, lo, why, sizeof(why));
    cr_assert_geq(diff, 0, "%s: %s", what, why);
    const int n = (lo->passes & STRIA_RING_PASS_BWD) ? TJ_N_OUT : TJ_DQ;
    for (int i = 0; i < n; i++)
        cr_expect_eq(diff & (1 << i), 0, "%s: %s differs from the in-process ring", what,
                     tjob_out_names[i]);
}
