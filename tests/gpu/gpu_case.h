/* The harness of the gpu suite (test_gpu.c, test_gpu_masks.c): one case of
 * the CUDA device against the portable CPU kernels and the fp64 reference,
 * and the helpers to move data to and from the GPU. See test_gpu.c for the
 * tolerance rule. */
#ifndef STRIA_TEST_GPU_CASE_H
#define STRIA_TEST_GPU_CASE_H

#include "nonfinite.h"
#include "stria_device.h"
#include "stria_kernels.h"

typedef struct {
    int64_t B, Tq, Tk, H, Hkv, D;
    bool causal;
    stria_dtype_t dtype;
    stria_pos_run_t qruns[2];
    size_t n_qruns;
    stria_pos_run_t kruns[2];
    size_t n_kruns;
    float scale; /* 0 = default */
    int64_t pad; /* extra elements after every head row of q, k, v, d_o and outputs */
    /* documents and window as stria_attn_params_t takes them (zero: none) */
    const int64_t *cu;
    size_t n_cu;
    bool has_window;
    int64_t left, right;
    /* a non-finite value put into the inputs (NULL: none): the outputs are
     * not checked against the CPU's but kept, with the inputs, for the
     * caller (nonfinite.h) */
    const nf_spot_t *spot;
} gcase_t;

/* The GPU's outputs of a case, contiguous: O [B][Tq][H][D], LSE [B][H][Tq],
 * dQ like O, dK and dV [B][Tk][Hkv][D] (what the backward added). */
typedef struct {
    float *o, *lse, *dq, *dk, *dv;
    size_t nq, nk, nl;
    float *in[NF_N_TENSORS]; /* with a spot: Q, K, V, dO as fp32 */
} gpu_outs_t;

extern const stria_dtype_t all_dtypes[3]; /* fp32, bf16, fp16 */

#define FILLER -7.5f /* padding of the views */

/* A host copy of contiguous fp32 values [B][T][H][D] as `dtype` with every
 * head row followed by `pad` filler elements; the view describes it. */
typedef struct {
    void *host;
    size_t bytes;
    stria_tensor_t view;
} hview_t;

hview_t hview_make(const float *vals, stria_dtype_t dtype, int64_t B, int64_t T, int64_t H,
                   int64_t D, int64_t pad, float filler);
/* The same view over device memory holding a copy of h. */
stria_tensor_t dview(stria_device_t *dev, const hview_t *h);
/* Values of a downloaded fp32 view as contiguous [B][T][H][D]; checks that
 * the padding still holds `filler`. */
void hview_read(const hview_t *h, int64_t B, int64_t T, int64_t H, int64_t D, int64_t pad,
                float filler, float *out, const char *what);

stria_device_t *gpu_open(void);
void *gpu_upload(stria_device_t *dev, const void *src, size_t bytes);
void gpu_download(stria_device_t *dev, void *dst, const void *src, size_t bytes);
/* Whether the case runs on the tensor-core kernels; their extra tolerance
 * term (0 for the SIMT kernels). */
bool uses_mma(const gcase_t *c);
double dtype_term(const gcase_t *c);
stria_attn_params_t case_params(const gcase_t *c);

/* Forward, delta and backward of a case on the GPU and on the portable CPU
 * kernels, every output checked against the fp64 reference and the CPU (as
 * Criterion expectations). With out, the GPU's outputs are kept there
 * (gpu_outs_free). */
void run_case_out(const gcase_t *c, gpu_outs_t *out);
void run_case(const gcase_t *c);
void gpu_outs_free(gpu_outs_t *out);

#endif
