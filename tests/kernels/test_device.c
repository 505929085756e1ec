/* The device front end (stria_device.h): device names, argument checks, and
 * the CPU device in both flavours ("cpu", "cpu:staged"), whose kernels must
 * give exactly what the direct stria_attn_* calls give. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "stria_device.h"

static stria_device_t *open_ok(const char *name, stria_pool_t *pool)
{
    stria_device_t *dev = NULL;
    stria_status_t st = stria_device_open(name, pool, &dev);
    cr_assert_eq(st, STRIA_OK, "open %s: %s", name, stria_error_msg());
    cr_assert_not_null(dev);
    return dev;
}

/* ---- names ----------------------------------------------------------------- */

Test(device, cpu_names)
{
    stria_device_t *cpu = open_ok("cpu", NULL);
    stria_device_t *staged = open_ok("cpu:staged", NULL);
    cr_expect_str_eq(stria_device_name(cpu), "cpu");
    cr_expect_str_eq(stria_device_name(staged), "cpu:staged");
    cr_expect_eq(stria_device_kind(cpu), STRIA_DEVICE_CPU);
    cr_expect_eq(stria_device_kind(staged), STRIA_DEVICE_CPU);
    cr_expect(stria_device_host_visible(cpu));
    cr_expect_not(stria_device_host_visible(staged));
    /* the description names the kernel variant in use */
    cr_expect_not_null(strstr(stria_device_description(cpu), stria_kernels_variant()),
                       "description '%s'", stria_device_description(cpu));
    cr_expect_not_null(strstr(stria_device_description(staged), "staged"));
    stria_device_close(cpu);
    stria_device_close(staged);
    stria_device_close(NULL);
}

Test(device, auto_without_gpu_is_cpu)
{
    stria_device_t *dev = open_ok("auto", NULL);
    if (stria_cuda_device_count() == 0) {
        cr_expect_str_eq(stria_device_name(dev), "cpu");
        cr_expect(stria_device_host_visible(dev));
    } else {
        cr_expect_str_eq(stria_device_name(dev), "cuda:0");
    }
    stria_device_close(dev);
}

Test(device, bad_names)
{
    static const char *const bad[] = {"",        "CPU",     "cpu:",    "cpu:fast",
                                      "gpu",     "cuda:",   "cuda:-1", "cuda:+1",
                                      "cuda:01", "cuda:1x", "cuda0",   "cuda:99999999999999",
                                      " cpu",    "cpu ",    "auto:0"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        stria_device_t *dev = (stria_device_t *)0x1;
        stria_status_t st = stria_device_open(bad[i], NULL, &dev);
        cr_expect_eq(st, STRIA_ERR_INVALID_ARG, "'%s' gave %s", bad[i], stria_status_name(st));
        cr_expect_eq(dev, (stria_device_t *)0x1, "'%s': output set on failure", bad[i]);
        /* the message names the bad name */
        char quoted[64];
        snprintf(quoted, sizeof(quoted), "'%s'", bad[i]);
        if (strlen(bad[i]) < 20)
            cr_expect_not_null(strstr(stria_error_msg(), quoted), "'%s': message '%s'", bad[i],
                               stria_error_msg());
    }
    stria_device_t *dev = NULL;
    cr_expect_eq(stria_device_open(NULL, NULL, &dev), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_device_open("cpu", NULL, NULL), STRIA_ERR_INVALID_ARG);
}

Test(device, cuda_names)
{
    static const char *const names[] = {"cuda", "cuda:0", "cuda:7", "cuda:4095"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        stria_device_t *dev = NULL;
        stria_status_t st = stria_device_open(names[i], NULL, &dev);
        if (!stria_cuda_built()) {
            cr_expect_eq(stria_cuda_device_count(), 0);
            cr_expect_eq(st, STRIA_ERR_UNSUPPORTED, "%s gave %s", names[i], stria_status_name(st));
            cr_expect_not_null(strstr(stria_error_msg(), "this build has no CUDA support"), "%s",
                               stria_error_msg());
            cr_expect_not_null(strstr(stria_error_msg(), names[i]), "%s", stria_error_msg());
        } else if (st == STRIA_OK) {
            cr_expect_eq(stria_device_kind(dev), STRIA_DEVICE_CUDA);
            stria_device_close(dev);
        } else {
            /* no such GPU here, or no driver: an error that names the device */
            cr_expect_not_null(strstr(stria_error_msg(), names[i]), "%s", stria_error_msg());
        }
    }
}

/* ---- memory, copies, add ------------------------------------------------------- */

static void copies_case(const char *name)
{
    stria_device_t *dev = open_ok(name, NULL);
    size_t free_b = 0, total_b = 0;
    cr_assert_eq(stria_device_memory(dev, &free_b, &total_b), STRIA_OK, "%s", stria_error_msg());
    cr_expect_gt(total_b, (size_t)1 << 24);
    cr_expect_leq(free_b, total_b);
    cr_expect_gt(free_b, 0u);

    const size_t n = 1000003; /* odd: no vector width divides it */
    float *h = NULL, *back = NULL;
    float *d1 = NULL, *d2 = NULL;
    cr_assert_eq(stria_device_host_alloc(dev, n * 4, (void **)&h), STRIA_OK);
    cr_assert_eq(stria_device_host_alloc(dev, n * 4, (void **)&back), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, n * 4, (void **)&d1), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, n * 4, (void **)&d2), STRIA_OK);
    cr_expect_eq((uintptr_t)d1 % 256, 0u);
    cr_expect_eq((uintptr_t)h % 64, 0u);
    cr_expect(d1 != h && d2 != d1);
    ref_fill(h, n, 11, 3.0f, STRIA_DTYPE_F32);

    /* host -> device -> device -> host */
    cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COPY, d1, h, n * 4), STRIA_OK);
    cr_assert_eq(stria_device_order(dev, STRIA_STREAM_COMPUTE, STRIA_STREAM_COPY), STRIA_OK);
    cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COMPUTE, d2, d1, n * 4), STRIA_OK);
    cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COMPUTE, back, d2, n * 4), STRIA_OK);
    cr_assert_eq(stria_device_sync(dev, STRIA_STREAM_COMPUTE), STRIA_OK);
    cr_expect_eq(memcmp(back, h, n * 4), 0, "%s: copies changed the data", name);

    /* add_f32: d2 += d1 gives 2h exactly */
    cr_assert_eq(stria_device_add_f32(dev, STRIA_STREAM_COMPUTE, d2, d1, n), STRIA_OK);
    cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COMPUTE, back, d2, n * 4), STRIA_OK);
    cr_assert_eq(stria_device_sync(dev, STRIA_STREAM_COMPUTE), STRIA_OK);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += back[i] != h[i] + h[i];
    cr_expect_eq(bad, 0u, "%s: %zu wrong sums", name, bad);

    /* zero, partly: the rest stays */
    cr_assert_eq(stria_device_zero(dev, STRIA_STREAM_COMPUTE, d2 + 5, (n - 10) * 4), STRIA_OK);
    cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COPY, back, d2, n * 4), STRIA_OK);
    cr_assert_eq(stria_device_sync(dev, STRIA_STREAM_COPY), STRIA_OK);
    cr_expect_eq(back[4], 2 * h[4]);
    cr_expect_eq(back[5], 0.0f);
    cr_expect_eq(back[n - 6], 0.0f);
    cr_expect_eq(back[n - 5], 2 * h[n - 5]);

    /* zero sizes */
    void *z = (void *)0x1;
    cr_expect_eq(stria_device_alloc(dev, 0, &z), STRIA_OK);
    cr_expect_null(z);
    cr_expect_eq(stria_device_copy(dev, STRIA_STREAM_COPY, NULL, NULL, 0), STRIA_OK);

    stria_device_free(dev, d1);
    stria_device_free(dev, d2);
    stria_device_free(dev, NULL);
    stria_device_host_free(dev, h);
    stria_device_host_free(dev, back);
    stria_device_close(dev);
}

Test(device, copies_cpu)
{
    copies_case("cpu");
}

Test(device, copies_staged)
{
    copies_case("cpu:staged");
}

Test(device, argument_errors)
{
    stria_device_t *dev = open_ok("cpu:staged", NULL);
    float x[4] = {0};
    void *p = NULL;
    stria_attn_params_t a;
    memset(&a, 0, sizeof(a));

    cr_expect_eq(stria_device_copy(dev, STRIA_STREAM_COPY, NULL, x, 4), STRIA_ERR_INVALID_ARG);
    cr_expect_not_null(strstr(stria_error_msg(), "cpu:staged"), "%s", stria_error_msg());
    cr_expect_eq(stria_device_copy(dev, STRIA_STREAM_COPY, x, NULL, 4), STRIA_ERR_INVALID_ARG);
    cr_expect_not_null(strstr(stria_error_msg(), "stria_device_copy on cpu:staged: NULL source "
                                                 "for 4 bytes"),
                       "%s", stria_error_msg());
    cr_expect_eq(stria_device_copy(dev, (stria_stream_t)7, x, x + 1, 4), STRIA_ERR_INVALID_ARG);
    cr_expect_not_null(strstr(stria_error_msg(), "stream 7"), "%s", stria_error_msg());
    cr_expect_eq(stria_device_zero(dev, STRIA_STREAM_COPY, NULL, 4), STRIA_ERR_INVALID_ARG);
    cr_expect_not_null(strstr(stria_error_msg(), "stria_device_zero on cpu:staged: NULL "
                                                 "destination for 4 bytes"),
                       "%s", stria_error_msg());
    cr_expect_eq(stria_device_add_f32(dev, STRIA_STREAM_COMPUTE, NULL, x, 1),
                 STRIA_ERR_INVALID_ARG);
    cr_expect_not_null(strstr(stria_error_msg(), "stria_device_add_f32 on cpu:staged: NULL "
                                                 "destination for 1 values"),
                       "%s", stria_error_msg());
    cr_expect_eq(stria_device_add_f32(NULL, STRIA_STREAM_COMPUTE, x, x, 1), STRIA_ERR_INVALID_ARG);
    cr_expect_not_null(strstr(stria_error_msg(), "stria_device_add_f32: device is NULL"), "%s",
                       stria_error_msg());
    cr_expect_eq(stria_device_zero(dev, STRIA_STREAM_COPY, NULL, 0), STRIA_OK);
    cr_expect_eq(stria_device_order(dev, STRIA_STREAM_COPY, (stria_stream_t)-1),
                 STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_device_sync(dev, (stria_stream_t)2), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_device_alloc(dev, 16, NULL), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_device_alloc(dev, SIZE_MAX - 8, &p), STRIA_ERR_NO_MEMORY);
    cr_expect_null(p);
    cr_expect_eq(stria_device_host_alloc(dev, SIZE_MAX - 8, &p), STRIA_ERR_NO_MEMORY);
    cr_expect_eq(stria_device_attn_fwd(dev, NULL, NULL, NULL, NULL, NULL, NULL, false),
                 STRIA_ERR_INVALID_ARG);
    /* the kernels' own checks come through */
    cr_expect_eq(stria_device_attn_partial_init(dev, &a, NULL, NULL), STRIA_ERR_INVALID_ARG);
    stria_device_close(dev);

    /* a NULL device is an error, never a crash */
    cr_expect_eq(stria_device_sync(NULL, STRIA_STREAM_COPY), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_device_memory(NULL, NULL, NULL), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_device_alloc(NULL, 4, &p), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(
        stria_device_attn_bwd(NULL, &a, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
        STRIA_ERR_INVALID_ARG);
}

/* ---- kernels: bit-identical to the direct calls ----------------------------------- */

typedef struct {
    stria_dtype_t dtype;
    bool causal;
    int64_t tq, tk, heads, kv_heads;
    bool masks; /* documents and a window */
} kcase_t;

static void *to_dtype(const float *src, size_t n, stria_dtype_t dtype)
{
    void *out = malloc(n * stria_dtype_size(dtype));
    stria_dtype_convert(STRIA_DTYPE_F32, src, dtype, out, n);
    return out;
}

/* A host buffer's copy in device memory. */
static void *up(stria_device_t *dev, const void *src, size_t bytes)
{
    void *d = NULL;
    cr_assert_eq(stria_device_alloc(dev, bytes, &d), STRIA_OK);
    cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COPY, d, src, bytes), STRIA_OK);
    return d;
}

static void down_cmp(stria_device_t *dev, const void *d, const void *want, size_t bytes,
                     const char *what, const kcase_t *c)
{
    void *h = malloc(bytes);
    cr_assert_eq(stria_device_copy(dev, STRIA_STREAM_COPY, h, d, bytes), STRIA_OK);
    cr_assert_eq(stria_device_sync(dev, STRIA_STREAM_COPY), STRIA_OK);
    cr_expect_eq(memcmp(h, want, bytes), 0,
                 "%s: %s differs (dtype %s, causal %d, masks %d, %lldx%lld)",
                 stria_device_name(dev), what, stria_dtype_name(c->dtype), c->causal, c->masks,
                 (long long)c->tq, (long long)c->tk);
    free(h);
}

static void kernels_case(const char *name, const kcase_t *c, stria_pool_t *pool)
{
    const int64_t B = 2, D = 64;
    const size_t qn = (size_t)(B * c->tq * c->heads * D),
                 kn = (size_t)(B * c->tk * c->kv_heads * D);
    const size_t rows = (size_t)(B * c->heads * c->tq);
    const size_t es = stria_dtype_size(c->dtype);
    stria_pos_run_t qr = {c->tk - c->tq / 2, 1, c->tq}, kr = {0, 1, c->tk};
    stria_attn_params_t a;
    memset(&a, 0, sizeof(a));
    a.batch = B;
    a.q_tokens = c->tq;
    a.kv_tokens = c->tk;
    a.heads = c->heads;
    a.kv_heads = c->kv_heads;
    a.head_dim = D;
    a.causal = c->causal;
    a.q_pos = (stria_positions_t){&qr, 1};
    a.kv_pos = (stria_positions_t){&kr, 1};
    a.pool = pool;
    static const int64_t cu[] = {0, 7, 7, 30, 45, 200};
    if (c->masks) {
        a.cu_seqlens = cu;
        a.n_cu_seqlens = sizeof(cu) / sizeof(cu[0]);
        a.has_window = true;
        a.window_left = 9;
        a.window_right = c->causal ? 0 : 3;
    }

    float *fq = malloc(qn * 4), *fk = malloc(kn * 4), *fv = malloc(kn * 4), *fg = malloc(qn * 4);
    ref_fill(fq, qn, 1, 1.0f, c->dtype);
    ref_fill(fk, kn, 2, 1.0f, c->dtype);
    ref_fill(fv, kn, 3, 1.0f, c->dtype);
    ref_fill(fg, qn, 4, 1.0f, c->dtype);
    void *hq = to_dtype(fq, qn, c->dtype), *hk = to_dtype(fk, kn, c->dtype);
    void *hv = to_dtype(fv, kn, c->dtype), *hg = to_dtype(fg, qn, c->dtype);

    /* direct calls: two forward blocks merged, finalize, delta, backward */
    float *o1 = malloc(qn * 4), *l1 = malloc(rows * 4), *o2 = malloc(qn * 4),
          *l2 = malloc(rows * 4), *delta = malloc(rows * 4);
    float *dq = calloc(qn, 4), *dk = calloc(kn, 4), *dv = calloc(kn, 4);
    void *of = malloc(qn * es);
    stria_tensor_t tq = stria_tensor_contiguous(hq, c->dtype, c->tq, c->heads, D);
    stria_tensor_t tk = stria_tensor_contiguous(hk, c->dtype, c->tk, c->kv_heads, D);
    stria_tensor_t tv = stria_tensor_contiguous(hv, c->dtype, c->tk, c->kv_heads, D);
    stria_tensor_t tg = stria_tensor_contiguous(hg, c->dtype, c->tq, c->heads, D);
    stria_tensor_t to1 = stria_tensor_contiguous(o1, STRIA_DTYPE_F32, c->tq, c->heads, D);
    stria_tensor_t to2 = stria_tensor_contiguous(o2, STRIA_DTYPE_F32, c->tq, c->heads, D);
    stria_tensor_t tof = stria_tensor_contiguous(of, c->dtype, c->tq, c->heads, D);
    stria_tensor_t tdq = stria_tensor_contiguous(dq, STRIA_DTYPE_F32, c->tq, c->heads, D);
    stria_tensor_t tdk = stria_tensor_contiguous(dk, STRIA_DTYPE_F32, c->tk, c->kv_heads, D);
    stria_tensor_t tdv = stria_tensor_contiguous(dv, STRIA_DTYPE_F32, c->tk, c->kv_heads, D);
    cr_assert_eq(stria_attn_partial_init(&a, &to1, l1), STRIA_OK);
    cr_assert_eq(stria_attn_fwd(&a, &tq, &tk, &tv, &to1, l1, true), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_attn_fwd(&a, &tq, &tv, &tk, &to2, l2, false), STRIA_OK);
    cr_assert_eq(stria_attn_merge(&a, &to1, l1, &to2, l2), STRIA_OK);
    cr_assert_eq(stria_attn_finalize(&a, &to1, &tof), STRIA_OK);
    cr_assert_eq(stria_attn_bwd_delta(&a, &tof, &tg, delta), STRIA_OK);
    cr_assert_eq(stria_attn_bwd(&a, &tq, &tk, &tv, &tg, l1, delta, &tdq, &tdk, &tdv), STRIA_OK,
                 "%s", stria_error_msg());

    /* the same through the device, every tensor in device memory; params
     * carry no pool: the device's own is used */
    stria_device_t *dev = open_ok(name, pool);
    a.pool = NULL;
    void *dq_ = up(dev, hq, qn * es), *dk_ = up(dev, hk, kn * es), *dv_ = up(dev, hv, kn * es);
    void *dg_ = up(dev, hg, qn * es);
    float *do1 = NULL, *dl1 = NULL, *do2 = NULL, *dl2 = NULL, *ddelta = NULL, *ddq = NULL,
          *ddk = NULL, *ddv = NULL;
    void *dof = NULL;
    cr_assert_eq(stria_device_alloc(dev, qn * 4, (void **)&do1), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, qn * 4, (void **)&do2), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, rows * 4, (void **)&dl1), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, rows * 4, (void **)&dl2), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, rows * 4, (void **)&ddelta), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, qn * es, &dof), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, qn * 4, (void **)&ddq), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, kn * 4, (void **)&ddk), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, kn * 4, (void **)&ddv), STRIA_OK);
    cr_assert_eq(stria_device_zero(dev, STRIA_STREAM_COMPUTE, ddq, qn * 4), STRIA_OK);
    cr_assert_eq(stria_device_zero(dev, STRIA_STREAM_COMPUTE, ddk, kn * 4), STRIA_OK);
    cr_assert_eq(stria_device_zero(dev, STRIA_STREAM_COMPUTE, ddv, kn * 4), STRIA_OK);
    cr_assert_eq(stria_device_order(dev, STRIA_STREAM_COMPUTE, STRIA_STREAM_COPY), STRIA_OK);
    tq.data = dq_;
    tk.data = dk_;
    tv.data = dv_;
    tg.data = dg_;
    to1.data = do1;
    to2.data = do2;
    tof.data = dof;
    tdq.data = ddq;
    tdk.data = ddk;
    tdv.data = ddv;
    cr_assert_eq(stria_device_attn_partial_init(dev, &a, &to1, dl1), STRIA_OK);
    cr_assert_eq(stria_device_attn_fwd(dev, &a, &tq, &tk, &tv, &to1, dl1, true), STRIA_OK);
    cr_assert_eq(stria_device_attn_fwd(dev, &a, &tq, &tv, &tk, &to2, dl2, false), STRIA_OK);
    cr_assert_eq(stria_device_attn_merge(dev, &a, &to1, dl1, &to2, dl2), STRIA_OK);
    cr_assert_eq(stria_device_attn_finalize(dev, &a, &to1, &tof), STRIA_OK);
    cr_assert_eq(stria_device_attn_bwd_delta(dev, &a, &tof, &tg, ddelta), STRIA_OK);
    cr_assert_eq(stria_device_attn_bwd(dev, &a, &tq, &tk, &tv, &tg, dl1, ddelta, &tdq, &tdk, &tdv),
                 STRIA_OK);
    cr_assert_eq(stria_device_sync(dev, STRIA_STREAM_COMPUTE), STRIA_OK);

    down_cmp(dev, do1, o1, qn * 4, "merged O", c);
    down_cmp(dev, dl1, l1, rows * 4, "merged LSE", c);
    down_cmp(dev, do2, o2, qn * 4, "O", c);
    down_cmp(dev, dl2, l2, rows * 4, "LSE", c);
    down_cmp(dev, dof, of, qn * es, "final O", c);
    down_cmp(dev, ddelta, delta, rows * 4, "delta", c);
    down_cmp(dev, ddq, dq, qn * 4, "dQ", c);
    down_cmp(dev, ddk, dk, kn * 4, "dK", c);
    down_cmp(dev, ddv, dv, kn * 4, "dV", c);

    void *dptrs[] = {dq_, dk_, dv_, dg_, do1, do2, dl1, dl2, ddelta, dof, ddq, ddk, ddv};
    for (size_t i = 0; i < sizeof(dptrs) / sizeof(dptrs[0]); i++)
        stria_device_free(dev, dptrs[i]);
    stria_device_close(dev);
    void *hptrs[] = {fq, fk, fv, fg, hq, hk, hv, hg, o1, l1, o2, l2, delta, dq, dk, dv, of};
    for (size_t i = 0; i < sizeof(hptrs) / sizeof(hptrs[0]); i++)
        free(hptrs[i]);
}

static void kernels_all(const char *name, stria_pool_t *pool)
{
    static const kcase_t cases[] = {
        {STRIA_DTYPE_F32, true, 37, 53, 4, 2, false},
        {STRIA_DTYPE_F32, false, 64, 64, 2, 2, false},
        {STRIA_DTYPE_BF16, true, 70, 41, 4, 1, false},
        {STRIA_DTYPE_BF16, false, 29, 96, 2, 2, false},
        {STRIA_DTYPE_F16, true, 48, 48, 3, 3, false},
        {STRIA_DTYPE_F32, true, 70, 90, 4, 2, true},
        {STRIA_DTYPE_BF16, false, 64, 80, 2, 1, true},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        kernels_case(name, &cases[i], pool);
}

Test(device, kernels_cpu)
{
    kernels_all("cpu", NULL);
}

Test(device, kernels_staged)
{
    kernels_all("cpu:staged", NULL);
}

Test(device, kernels_staged_pool)
{
    stria_pool_t *pool = NULL;
    cr_assert_eq(stria_pool_create(2, &pool), STRIA_OK);
    kernels_all("cpu:staged", pool);
    stria_pool_destroy(pool);
}
