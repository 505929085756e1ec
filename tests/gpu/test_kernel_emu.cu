/* The tensor-core attention kernels (forward, dK/dV, dQ) run on the host by
 * the emulation of cu_emu.h, against the portable CPU kernels: causal and
 * not, striped positions without the diagonal, rows without visible keys,
 * GQA, batch 2, bf16 and fp16, head_dim 64 and 128, lengths that are not
 * multiples of any tile, and the accumulate path of the forward. Needs no
 * GPU; exit status 0 when every output is within the tolerance of the gpu
 * suite (P and dS rounded to the storage dtype: bf16 2^-6, fp16 2^-9 of the
 * largest value). The SIMT kernels (fp32 and other head dims) and the
 * row-wise kernels (partial init, merge, finalize, delta) are run the same
 * way, held to 2e-5 of the largest value (finalize: bit for bit). */
#include "cu_emu.h"

#include "cuda/attn_bwd.cu"
#include "cuda/attn_fwd.cu"
#include "cuda/attn_simt.cu"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "stria_kernels.h"

thread_local stria_emu_dim stria_emu_tid;
stria_emu_dim stria_emu_bid, stria_emu_gdim, stria_emu_bdim;
stria_emu_cta *stria_emu_cur;
alignas(128) unsigned char stria__smem[1 << 18];

void stria_emu_launch(dim3 grid, int threads, const std::function<void()> &kernel)
{
    stria_emu_gdim = {grid.x, grid.y, 1};
    stria_emu_bdim = {(unsigned)threads, 1, 1};
    for (unsigned y = 0; y < grid.y; y++)
        for (unsigned x = 0; x < grid.x; x++) {
            stria_emu_cta *cta = new stria_emu_cta();
            cta->all.n = threads;
            for (int w = 0; w < threads / 32; w++)
                cta->warp[w].n = 32;
            stria_emu_cur = cta;
            stria_emu_bid = {x, y, 0};
            memset(stria__smem, 0xff, sizeof(stria__smem)); /* NaN in bf16 and fp16 */
            std::vector<std::thread> ts;
            for (int t = 0; t < threads; t++)
                ts.emplace_back([&kernel, t] {
                    stria_emu_tid = {(unsigned)t, 0, 0};
                    kernel();
                });
            for (auto &th : ts)
                th.join();
            delete cta;
        }
}

struct ecase {
    const char *name;
    int64_t B, Tq, Tk, H, Hkv;
    int D;
    bool causal;
    stria_dtype_t dtype;
    stria_pos_run_t qrun, krun; /* count 0: default positions */
};

static int failures = 0;

static void compare(const ecase &c, const char *what, const float *got, const float *want, size_t n,
                    double rel)
{
    double maxabs = 0.0, err = 0.0;
    size_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        if (isinf(want[i]) || isinf(got[i])) {
            if (got[i] != want[i]) {
                err = INFINITY;
                worst = i;
            }
            continue;
        }
        double d = fabs((double)got[i] - (double)want[i]);
        if (!(d <= err)) {
            err = d;
            worst = i;
        }
        maxabs = fabs(want[i]) > maxabs ? fabs(want[i]) : maxabs;
    }
    double tol = 1e-5 + rel * maxabs;
    bool ok = err <= tol;
    printf("  %-28s %-4s max diff %.3g (tolerance %.3g, max |x| %.3g)%s\n", c.name, what, err, tol,
           maxabs, ok ? "" : "  FAILED");
    if (!ok) {
        printf("    worst element %zu: emulated %g, CPU %g\n", worst, got[worst], want[worst]);
        failures++;
    }
}

static void fill(float *x, size_t n, unsigned seed, stria_dtype_t dt, void *store)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        float v = (float)((seed >> 8) & 0xffff) / 32768.0f - 1.0f;
        stria_dtype_store(dt, store, i, v);
        x[i] = stria_dtype_load(dt, store, i);
    }
}

static std::vector<int64_t> positions(const stria_pos_run_t &r, int64_t n)
{
    std::vector<int64_t> p((size_t)n);
    for (int64_t i = 0; i < n; i++)
        p[(size_t)i] = r.count ? r.first + i * r.stride : i;
    return p;
}

static void grains(const std::vector<int64_t> &p, std::vector<int64_t> &mn,
                   std::vector<int64_t> &mx)
{
    int64_t n = (int64_t)p.size(), ng = (n + STRIA__CU_GRAIN - 1) / STRIA__CU_GRAIN;
    mn.assign((size_t)ng, INT64_MAX);
    mx.assign((size_t)ng, INT64_MIN);
    for (int64_t i = 0; i < n; i++) {
        size_t g = (size_t)(i / STRIA__CU_GRAIN);
        mn[g] = p[(size_t)i] < mn[g] ? p[(size_t)i] : mn[g];
        mx[g] = p[(size_t)i] > mx[g] ? p[(size_t)i] : mx[g];
    }
}

/* The tensor-core kernels for T in {bf16, fp16} and D in {64, 128}; with
 * SIMT, the SIMT kernels (any T, D). */
template <typename T, int D, bool SIMT> static void run(const ecase &c)
{
    const int64_t B = c.B, Tq = c.Tq, Tk = c.Tk, H = c.H, Hkv = c.Hkv;
    size_t nq = (size_t)(B * Tq * H * D), nk = (size_t)(B * Tk * Hkv * D),
           nl = (size_t)(B * H * Tq);
    std::vector<float> q(nq), k(nk), v(nk), g(nq);
    std::vector<T> qs(nq), ks(nk), vs(nk), gs(nq);
    fill(q.data(), nq, 1, c.dtype, qs.data());
    fill(k.data(), nk, 2, c.dtype, ks.data());
    fill(v.data(), nk, 3, c.dtype, vs.data());
    fill(g.data(), nq, 4, c.dtype, gs.data());

    /* the portable CPU kernels */
    stria_attn_params_t p = {};
    p.batch = B, p.q_tokens = Tq, p.kv_tokens = Tk, p.heads = H, p.kv_heads = Hkv;
    p.head_dim = D, p.causal = c.causal;
    p.q_pos.runs = c.qrun.count ? &c.qrun : NULL, p.q_pos.n_runs = c.qrun.count ? 1 : 0;
    p.kv_pos.runs = c.krun.count ? &c.krun : NULL, p.kv_pos.n_runs = c.krun.count ? 1 : 0;
    std::vector<float> o(nq), lse(nl), delta(nl), dq(nq), dk(nk), dv(nk);
    stria_tensor_t tq = stria_tensor_contiguous(qs.data(), c.dtype, Tq, H, D);
    stria_tensor_t tk = stria_tensor_contiguous(ks.data(), c.dtype, Tk, Hkv, D);
    stria_tensor_t tv = stria_tensor_contiguous(vs.data(), c.dtype, Tk, Hkv, D);
    stria_tensor_t tg = stria_tensor_contiguous(gs.data(), c.dtype, Tq, H, D);
    stria_tensor_t to = stria_tensor_contiguous(o.data(), STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t tdq = stria_tensor_contiguous(dq.data(), STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t tdk = stria_tensor_contiguous(dk.data(), STRIA_DTYPE_F32, Tk, Hkv, D);
    stria_tensor_t tdv = stria_tensor_contiguous(dv.data(), STRIA_DTYPE_F32, Tk, Hkv, D);
    if (stria_kernels_set_variant("portable") != STRIA_OK ||
        stria_attn_fwd(&p, &tq, &tk, &tv, &to, lse.data(), false) != STRIA_OK ||
        stria_attn_bwd_delta(&p, &to, &tg, delta.data()) != STRIA_OK ||
        stria_attn_bwd(&p, &tq, &tk, &tv, &tg, lse.data(), delta.data(), &tdq, &tdk, &tdv) !=
            STRIA_OK) {
        printf("%s: CPU kernels failed: %s\n", c.name, stria_error_msg());
        failures++;
        return;
    }

    /* the kernels, emulated */
    std::vector<int64_t> qpos = positions(c.qrun, Tq), kpos = positions(c.krun, Tk);
    std::vector<int64_t> qmin, qmax, kmin, kmax;
    grains(qpos, qmin, qmax);
    grains(kpos, kmin, kmax);
    stria_cu_attn_t a = {};
    a.B = B, a.Tq = Tq, a.Tk = Tk, a.H = H, a.Hkv = Hkv, a.G = H / Hkv, a.D = D;
    a.scale = 1.0f / sqrtf((float)D);
    a.causal = c.causal;
    a.dtype = c.dtype;
    if (c.causal) {
        a.qpos = qpos.data(), a.kpos = kpos.data();
        a.qmin = qmin.data(), a.qmax = qmax.data(), a.kmin = kmin.data(), a.kmax = kmax.data();
    }
    a.q = {qs.data(), Tq * H * D, H * D, D};
    a.k = {ks.data(), Tk * Hkv * D, Hkv * D, D};
    a.v = {vs.data(), Tk * Hkv * D, Hkv * D, D};
    a.d_o = {gs.data(), Tq * H * D, H * D, D};
    std::vector<float> eo(nq), else_v(nl), edq(nq, 0.0f), edk(nk, 0.0f), edv(nk, 0.0f);
    a.o = {eo.data(), Tq * H * D, H * D, D};
    a.lse = else_v.data();
    const double rel = SIMT ? 2e-5 : c.dtype == STRIA_DTYPE_BF16 ? 0x1p-6 : 0x1p-9;
    /* SIMT: two CTAs of 8 warps stride over the rows */
    auto fwd = [&a, Tq, B, H] {
        if constexpr (SIMT)
            stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS, [&a] { stria__fwd_simt_k<T>(a); });
        else
            stria_emu_launch(
                dim3((unsigned)((Tq + STRIA__FWD_BQ - 1) / STRIA__FWD_BQ), (unsigned)(B * H)),
                STRIA__FWD_NT, [&a] { stria__fwd_mma_k<T, D>(a); });
    };

    fwd();
    compare(c, "O", eo.data(), o.data(), nq, rel);
    compare(c, "LSE", else_v.data(), lse.data(), nl, 1e-5);

    /* accumulate: merging the same partial again keeps O and adds log 2 */
    a.accumulate = true;
    fwd();
    std::vector<float> lse2(lse);
    for (auto &x : lse2)
        x = x == -INFINITY ? x : x + logf(2.0f);
    compare(c, "O+=", eo.data(), o.data(), nq, rel);
    compare(c, "LSE+=", else_v.data(), lse2.data(), nl, 1e-5);
    a.accumulate = false;

    a.lse_in = lse.data();
    a.delta = delta.data();
    a.dq = {edq.data(), Tq * H * D, H * D, D};
    a.dk = {edk.data(), Tk * Hkv * D, Hkv * D, D};
    a.dv = {edv.data(), Tk * Hkv * D, Hkv * D, D};
    if constexpr (SIMT) {
        stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS, [&a] { stria__dq_simt_k<T>(a); });
        stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS, [&a] { stria__dkdv_simt_k<T>(a); });
    } else {
        stria_emu_launch(
            dim3((unsigned)((Tk + STRIA__KV_BK - 1) / STRIA__KV_BK), (unsigned)(B * Hkv)),
            STRIA__KV_NT, [&a] { stria__dkdv_mma_k<T, D>(a); });
        stria_emu_launch(
            dim3((unsigned)((Tq + STRIA__DQ_BQ - 1) / STRIA__DQ_BQ), (unsigned)(B * H)),
            STRIA__DQ_NT, [&a] { stria__dq_mma_k<T, D>(a); });
    }
    compare(c, "dQ", edq.data(), dq.data(), nq, rel);
    compare(c, "dK", edk.data(), dk.data(), nk, rel);
    compare(c, "dV", edv.data(), dv.data(), nk, rel);
}

/* partial init, merge (LSE gaps of +-1e4, -inf rows), finalize, delta */
static void run_rows()
{
    const ecase c = {"row-wise kernels", 2, 19, 1, 3, 1, 40, false, STRIA_DTYPE_F32, {}, {}};
    const int64_t B = c.B, T = c.Tq, H = c.H, D = c.D;
    size_t n = (size_t)(B * T * H * D), nl = (size_t)(B * H * T);
    std::vector<float> oa(n), ob(n), la(nl), lb(nl), ca, cl, g(n);
    std::vector<uint16_t> gs(n), fin_cpu(n), fin_emu(n);
    fill(oa.data(), n, 7, STRIA_DTYPE_F32, oa.data());
    fill(ob.data(), n, 8, STRIA_DTYPE_F32, ob.data());
    fill(g.data(), n, 9, STRIA_DTYPE_BF16, gs.data());
    for (size_t i = 0; i < nl; i++) {
        static const float pick[] = {1e4f, -1e4f, -INFINITY, 3.0f, 2.5f, -INFINITY, 0.5f};
        la[i] = pick[i % 7];
        lb[i] = pick[(i * 3 + 1) % 7];
    }
    for (size_t r = 0; r < nl; r++) { /* -inf rows hold zero partials */
        int64_t t = (int64_t)r % T, h = ((int64_t)r / T) % H, b = (int64_t)r / T / H;
        for (int64_t d = 0; d < D; d++) {
            size_t i = (size_t)(((b * T + t) * H + h) * D + d);
            if (la[r] == -INFINITY)
                oa[i] = 0.0f;
            if (lb[r] == -INFINITY)
                ob[i] = 0.0f;
        }
    }
    stria_attn_params_t p = {};
    p.batch = B, p.q_tokens = T, p.kv_tokens = 1, p.heads = H, p.kv_heads = 1, p.head_dim = D;
    stria_cu_attn_t a = {};
    a.B = B, a.Tq = T, a.Tk = 1, a.H = H, a.Hkv = 1, a.G = H, a.D = (int)D;
    a.dtype = STRIA_DTYPE_BF16;
    stria_cu_view_t vb = {ob.data(), T * H * D, H * D, D};
    std::vector<float> eo(oa), el(la);
    a.o = {eo.data(), T * H * D, H * D, D};
    a.lse = el.data();

    /* merge */
    ca = oa, cl = la;
    stria_tensor_t ta = stria_tensor_contiguous(ca.data(), STRIA_DTYPE_F32, T, H, D);
    stria_tensor_t tb = stria_tensor_contiguous(ob.data(), STRIA_DTYPE_F32, T, H, D);
    if (stria_attn_merge(&p, &ta, cl.data(), &tb, lb.data()) != STRIA_OK)
        failures++;
    stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS,
                     [&a, vb, &lb] { stria__merge_k(a, vb, lb.data()); });
    compare(c, "merge O", eo.data(), ca.data(), n, 2e-6);
    compare(c, "merge LSE", el.data(), cl.data(), nl, 2e-6);

    /* finalize to bf16: the CPU's rounding, bit for bit */
    stria_tensor_t tf = stria_tensor_contiguous(fin_cpu.data(), STRIA_DTYPE_BF16, T, H, D);
    if (stria_attn_finalize(&p, &ta, &tf) != STRIA_OK)
        failures++;
    stria_cu_view_t vf = {fin_emu.data(), T * H * D, H * D, D};
    a.o = {ca.data(), T * H * D, H * D, D};
    stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS,
                     [&a, vf] { stria__finalize_k(a, vf, STRIA_DTYPE_BF16); });
    bool same = fin_cpu == fin_emu;
    printf("  %-28s finalize bf16 %s\n", c.name, same ? "bit for bit" : "DIFFERS  FAILED");
    failures += same ? 0 : 1;

    /* delta: fp32 O, bf16 dO */
    std::vector<float> dl_cpu(nl), dl_emu(nl);
    stria_tensor_t tg = stria_tensor_contiguous(gs.data(), STRIA_DTYPE_BF16, T, H, D);
    if (stria_attn_bwd_delta(&p, &ta, &tg, dl_cpu.data()) != STRIA_OK)
        failures++;
    a.d_o = {gs.data(), T * H * D, H * D, D};
    float *dle = dl_emu.data();
    stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS,
                     [&a, dle] { stria__delta_k(a, STRIA_DTYPE_F32, dle); });
    compare(c, "delta", dl_emu.data(), dl_cpu.data(), nl, 2e-5);

    /* partial init */
    a.o = {eo.data(), T * H * D, H * D, D};
    stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS, [&a] { stria__init_k(a); });
    std::vector<float> zero(n, 0.0f), minf(nl, -INFINITY);
    compare(c, "init O", eo.data(), zero.data(), n, 0.0);
    compare(c, "init LSE", el.data(), minf.data(), nl, 0.0);
}

int main(void)
{
    const ecase cases[] = {
        {"causal gqa bf16 d64", 1, 150, 203, 2, 1, 64, true, STRIA_DTYPE_BF16, {53, 1, 150}, {}},
        {"noncausal batch2 fp16 d128", 2, 70, 90, 2, 2, 128, false, STRIA_DTYPE_F16, {}, {}},
        {"striped no-diagonal bf16 d128",
         1,
         140,
         140,
         1,
         1,
         128,
         true,
         STRIA_DTYPE_BF16,
         {1, 4, 140},
         {2, 4, 140}},
        {"rows without keys fp16 d64", 1, 40, 30, 2, 1, 64, true, STRIA_DTYPE_F16, {}, {20, 1, 30}},
    };
    for (const ecase &c : cases) {
        printf("%s (tensor cores):\n", c.name);
        bool bf = c.dtype == STRIA_DTYPE_BF16;
        if (c.D == 64)
            bf ? run<__nv_bfloat16, 64, false>(c) : run<__half, 64, false>(c);
        else
            bf ? run<__nv_bfloat16, 128, false>(c) : run<__half, 128, false>(c);
    }
    const ecase simt_f32 = {
        "simt causal gqa fp32 d48", 2, 37, 45, 2, 1, 48, true, STRIA_DTYPE_F32, {8, 1, 37}, {}};
    const ecase simt_bf16 = {"simt rows without keys bf16",
                             1,
                             20,
                             16,
                             2,
                             2,
                             64,
                             true,
                             STRIA_DTYPE_BF16,
                             {},
                             {10, 1, 16}};
    printf("%s:\n", simt_f32.name);
    run<float, 48, true>(simt_f32);
    printf("%s:\n", simt_bf16.name);
    run<__nv_bfloat16, 64, true>(simt_bf16);
    printf("row-wise kernels:\n");
    run_rows();
    if (failures) {
        printf("test_kernel_emu: %d outputs out of tolerance\n", failures);
        return 1;
    }
    printf("test_kernel_emu: the emulated CUDA kernels match the portable CPU kernels\n");
    return 0;
}
