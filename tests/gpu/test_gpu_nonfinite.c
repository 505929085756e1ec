/* GPU suite, non-finite inputs: a NaN, +inf or -inf in Q, K, V or dO, where
 * queries see it and where the mask hides it, through the CUDA device (the
 * tensor-core kernels and the SIMT ones, masks and staging included): every
 * output that depends on the value is non-finite, outputs of the other
 * batch row and kv head group unchanged (tests/kernels/nonfinite.h). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>

#include "gpu_case.h"

static void gpu_nf_report(void *ctx, const char *msg)
{
    (void)ctx;
    cr_expect(false, "%s", msg);
}

static const int64_t gpu_nf_cu[] = {0, 37, 37, 130, 200};

static void gpu_nf_cases(const gcase_t *base, const char *what)
{
    int64_t *qpos = malloc((size_t)base->Tq * sizeof(int64_t));
    int64_t *kpos = malloc((size_t)base->Tk * sizeof(int64_t));
    for (int64_t i = 0; i < base->Tq; i++)
        qpos[i] = base->n_qruns ? base->qruns[0].first + i * base->qruns[0].stride : i;
    for (int64_t i = 0; i < base->Tk; i++)
        kpos[i] = base->n_kruns ? base->kruns[0].first + i * base->kruns[0].stride : i;
    ref_shape_t rs = {
        base->B,      base->Tq, base->Tk, base->H, base->Hkv, base->D, 1.0 / sqrt((double)base->D),
        base->causal, qpos,     kpos};
    ref_masks_t rm = {base->cu, base->n_cu, base->has_window, base->left, base->right};
    const nf_dims_t dims = {base->B, base->Tq, base->Tk, base->H, base->Hkv, base->D};
    gpu_outs_t clean;
    run_case_out(base, &clean); /* checked against the CPU and the reference */
    const nf_outs_t cl = {clean.o, clean.lse, clean.dq, clean.dk, clean.dv};
    for (int t = 0; t < NF_N_TENSORS; t++)
        for (int visible = 1; visible >= 0; visible--) {
            const bool qside = t == NF_Q || t == NF_DO;
            int64_t tok = nf_token(&rs, &rm, qside, visible, qside ? 70 : 20);
            if (tok < 0)
                continue;
            for (size_t vi = 0; vi < 3; vi++) {
                nf_spot_t s = {(nf_tensor_t)t, 1, tok, 1, 5, nf_values[vi]};
                gcase_t c = *base;
                char label[256];
                gpu_outs_t got;
                ref_out_t ref;
                c.spot = &s;
                snprintf(label, sizeof(label), "cuda %s %s: %s %s at %s token %lld", what,
                         stria_dtype_name(c.dtype), nf_tensor_names[t], nf_value_names[vi],
                         visible ? "visible" : "hidden", (long long)tok);
                run_case_out(&c, &got);
                nf_ref_run(&rs, &rm, got.in[NF_Q], got.in[NF_K], got.in[NF_V], got.in[NF_DO], &ref);
                const nf_outs_t g = {got.o, got.lse, got.dq, got.dk, got.dv};
                nf_check(&dims, &s, visible, &g, &cl, &ref, label, gpu_nf_report, NULL);
                ref_out_free(&ref);
                gpu_outs_free(&got);
            }
        }
    gpu_outs_free(&clean);
    free(qpos), free(kpos);
}

Test(gpu, nonfinite_inputs_are_never_hidden)
{
    /* the tensor-core kernels (bf16, fp16 at head_dim 64) and the SIMT ones
     * (fp32; bf16 at head_dim 48), causal GQA over two batch rows */
    static const struct {
        stria_dtype_t dtype;
        int64_t D;
    } kinds[] = {{STRIA_DTYPE_BF16, 64},
                 {STRIA_DTYPE_F16, 64},
                 {STRIA_DTYPE_F32, 64},
                 {STRIA_DTYPE_BF16, 48}};
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        gcase_t c = {.B = 2,
                     .Tq = 100,
                     .Tk = 100,
                     .H = 4,
                     .Hkv = 2,
                     .D = kinds[k].D,
                     .causal = true,
                     .dtype = kinds[k].dtype};
        gpu_nf_cases(&c, "causal");
        /* striped without the diagonal, with documents: query 0 sees nothing,
         * the last key is seen by none */
        c.qruns[0] = (stria_pos_run_t){0, 2, 100};
        c.kruns[0] = (stria_pos_run_t){1, 2, 100};
        c.n_qruns = c.n_kruns = 1;
        c.cu = gpu_nf_cu;
        c.n_cu = 5;
        gpu_nf_cases(&c, "striped without diagonal, documents");
    }
}
