/* The tensor-core attention kernels (forward, dK/dV, dQ) run on the host by
 * the emulation of cu_emu.h, against the portable CPU kernels: causal and
 * not, striped positions without the diagonal, rows without visible keys,
 * GQA, batch 2, bf16 and fp16, head_dim 64 and 128, lengths that are not
 * multiples of any tile, and the accumulate path of the forward. Needs no
 * GPU; exit status 0 when every output is within the tolerance of the gpu
 * suite (P and dS rounded to the storage dtype: bf16 2^-6, fp16 2^-9 of the
 * largest value). The SIMT kernels (fp32 and other head dims) and the
 * row-wise kernels (partial init, merge, finalize, delta) are run the same
 * way, held to 2e-5 of the largest value (finalize: bit for bit).
 *
 * Documents and windows the same way: document boundaries on tile edges and
 * inside tiles, empty documents, documents shorter than a grain, striped and
 * zigzag positions; causal windows of left 0, 1, 63, 64, 65, S - 1 and S,
 * windows on a later query block, windows that are not causal, windows with
 * documents; rows without a visible key (O, dQ) and keys no query sees (dK,
 * dV) exactly zero; and documents [0, S] and window (-1, -1) bit for bit
 * equal to the call without them. */
#include "cu_emu.h"

#include "cuda/attn_bwd.cu"
#include "cuda/attn_fwd.cu"
#include "cuda/attn_simt.cu"

#include <chrono>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "stria_kernels.h"
extern "C" {
#include "ref.h"
}
#include "nonfinite.h"

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

/* Documents and a window as stria_attn_params_t takes them (zero: none). */
struct emask {
    const int64_t *cu;
    size_t n_cu;
    bool has_window;
    int64_t left, right;
};

struct ecase {
    const char *name;
    int64_t B, Tq, Tk, H, Hkv;
    int D;
    bool causal;
    stria_dtype_t dtype;
    stria_pos_run_t qrun, krun;             /* count 0: default positions */
    emask m = {};                           /* none */
    stria_pos_run_t qrun2 = {}, krun2 = {}; /* a second run of each block (zigzag), count 0: none */
    bool accumulate = true;                 /* also run the forward's accumulate path */
    /* a non-finite value at a spot of the inputs (nonfinite.h): the outputs
     * are not compared with the CPU's, but returned with the inputs */
    bool has_spot = false;
    nf_spot_t spot = {};
};

/* The outputs of one run of the kernels: O and LSE of the forward, dQ, dK, dV
 * of the backward. */
struct eouts {
    std::vector<float> o, lse, dq, dk, dv;
    std::vector<float> in[NF_N_TENSORS]; /* with a spot: Q, K, V, dO as fp32 */
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
    printf("  %-32s %-4s max diff %.3g (tolerance %.3g, max |x| %.3g)%s\n", c.name, what, err, tol,
           maxabs, ok ? "" : "  FAILED");
    if (!ok) {
        printf("    worst element %zu: emulated %g, CPU %g\n", worst, got[worst], want[worst]);
        failures++;
    }
}

/* The rows (of D values) marked in `zero` must be exactly zero in `got`: the
 * rows of queries without a visible key (O, dQ) and of keys no query sees
 * (dK, dV). */
static void expect_zero_rows(const ecase &c, const char *what, const std::vector<float> &got,
                             const std::vector<bool> &zero, int D)
{
    size_t rows = 0, bad = 0;
    for (size_t r = 0; r < zero.size(); r++) {
        if (!zero[r])
            continue;
        rows++;
        for (int d = 0; d < D; d++)
            if (got[r * (size_t)D + (size_t)d] != 0.0f) {
                bad++;
                break;
            }
    }
    if (rows > 0)
        printf("  %-32s %-4s %zu rows exactly zero%s\n", c.name, what, rows - bad,
               bad ? "; others NOT: FAILED" : "");
    failures += bad ? 1 : 0;
}

/* Query rows [B][Tq][H] with LSE = -inf ([B][H][Tq]) in the CPU's result. */
static std::vector<bool> rows_without_keys(const ecase &c, const std::vector<float> &lse)
{
    std::vector<bool> z((size_t)(c.B * c.Tq * c.H));
    for (int64_t b = 0; b < c.B; b++)
        for (int64_t t = 0; t < c.Tq; t++)
            for (int64_t h = 0; h < c.H; h++)
                z[(size_t)((b * c.Tq + t) * c.H + h)] =
                    lse[(size_t)((b * c.H + h) * c.Tq + t)] == -INFINITY;
    return z;
}

/* Key rows whose dV row is all zero in the CPU's result: keys no query sees
 * (dV = P^T dO is zero only then, for random dO). */
static std::vector<bool> keys_unseen(const std::vector<float> &dv, int D)
{
    std::vector<bool> z(dv.size() / (size_t)D);
    for (size_t r = 0; r < z.size(); r++) {
        bool zero = true;
        for (int d = 0; d < D; d++)
            zero = zero && dv[r * (size_t)D + (size_t)d] == 0.0f;
        z[r] = zero;
    }
    return z;
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

/* The runs of a block: r, then r2 when it has tokens (count 0 for r: 0..n-1). */
static std::vector<stria_pos_run_t> runs_of(const stria_pos_run_t &r, const stria_pos_run_t &r2)
{
    std::vector<stria_pos_run_t> v;
    if (r.count)
        v.push_back(r);
    if (r2.count)
        v.push_back(r2);
    return v;
}

static std::vector<int64_t> positions(const std::vector<stria_pos_run_t> &runs, int64_t n)
{
    std::vector<int64_t> p;
    for (const stria_pos_run_t &r : runs)
        for (int64_t i = 0; i < r.count; i++)
            p.push_back(r.first + i * r.stride);
    for (int64_t i = (int64_t)p.size(); i < n; i++)
        p.push_back(i);
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

/* The backward kernels of a case (the SIMT ones, or the tensor cores' dK/dV
 * and dQ), emulated, on a (its LSE, D and gradient views set). */
template <typename T, int D, bool SIMT> static void launch_bwd(const ecase &c, stria_cu_attn_t &a)
{
    if constexpr (SIMT) {
        stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS, [&a] { stria__dq_simt_k<T>(a); });
        stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS, [&a] { stria__dkdv_simt_k<T>(a); });
    } else {
        stria_emu_launch(
            dim3((unsigned)((c.Tk + STRIA__KV_BK - 1) / STRIA__KV_BK), (unsigned)(c.B * c.Hkv)),
            STRIA__KV_NT, [&a] { stria__dkdv_mma_k<T, D>(a); });
        stria_emu_launch(
            dim3((unsigned)((c.Tq + STRIA__DQ_BQ - 1) / STRIA__DQ_BQ), (unsigned)(c.B * c.H)),
            STRIA__DQ_NT, [&a] { stria__dq_mma_k<T, D>(a); });
    }
}

/* The rest of a case with a non-finite spot, after its forward: merging
 * the partial into itself (accumulate) keeps every non-finite output
 * non-finite; then the backward on the emulated forward's LSE and its D
 * (the delta kernel). Outputs to *out. */
template <typename T, int D, bool SIMT, typename F>
static void run_spot_bwd(const ecase &c, stria_cu_attn_t &a, const F &fwd, std::vector<float> &eo,
                         std::vector<float> &el, eouts *out)
{
    const size_t nq = eo.size(), nl = el.size(), nk = (size_t)(c.B * c.Tk * c.Hkv * D);
    if (c.accumulate) {
        const std::vector<float> o1 = eo, l1 = el;
        a.accumulate = true;
        fwd();
        a.accumulate = false;
        size_t hidden = 0;
        for (size_t i = 0; i < nq; i++)
            hidden += !isfinite(o1[i]) && isfinite(eo[i]);
        for (size_t i = 0; i < nl; i++)
            hidden += isnan(l1[i]) && !isnan(el[i]);
        printf("  %-32s O+=  %s\n", c.name,
               hidden ? "a merge hid non-finite values: FAILED" : "non-finite values kept");
        failures += hidden ? 1 : 0;
        eo = o1, el = l1;
    }
    std::vector<float> delta(nl), edq(nq, 0.0f), edk(nk, 0.0f), edv(nk, 0.0f);
    float *dl = delta.data();
    stria_emu_launch(dim3(2, 1), STRIA__SIMT_THREADS,
                     [&a, dl] { stria__delta_k(a, STRIA_DTYPE_F32, dl); });
    a.lse_in = el.data();
    a.delta = delta.data();
    a.dq = {edq.data(), c.Tq * c.H * D, c.H * D, D};
    a.dk = {edk.data(), c.Tk * c.Hkv * D, c.Hkv * D, D};
    a.dv = {edv.data(), c.Tk * c.Hkv * D, c.Hkv * D, D};
    launch_bwd<T, D, SIMT>(c, a);
    if (out != nullptr)
        out->o = eo, out->lse = el, out->dq = edq, out->dk = edk, out->dv = edv;
}

/* The tensor-core kernels for T in {bf16, fp16} and D in {64, 128}; with
 * SIMT, the SIMT kernels (any T, D). Compared with the portable CPU kernels
 * on the same call; the emulated outputs of the first forward and the
 * backward go to *out when not NULL. */
template <typename T, int D, bool SIMT> static void run(const ecase &c, eouts *out = nullptr)
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
    if (c.has_spot) {
        const nf_dims_t dims = {B, Tq, Tk, H, Hkv, D};
        const size_t at = c.spot.t < NF_N_TENSORS ? nf_index(&dims, &c.spot) : 0;
        std::vector<float> *f[] = {&q, &k, &v, &g};
        void *st[] = {qs.data(), ks.data(), vs.data(), gs.data()};
        if (c.spot.t < NF_N_TENSORS) { /* NF_N_TENSORS: none (a clean run) */
            (*f[c.spot.t])[at] = c.spot.value;
            stria_dtype_store(c.dtype, st[c.spot.t], at, c.spot.value);
        }
        if (out != nullptr)
            out->in[NF_Q] = q, out->in[NF_K] = k, out->in[NF_V] = v, out->in[NF_DO] = g;
    }

    /* the portable CPU kernels */
    const std::vector<stria_pos_run_t> qruns = runs_of(c.qrun, c.qrun2),
                                       kruns = runs_of(c.krun, c.krun2);
    stria_attn_params_t p = {};
    p.batch = B, p.q_tokens = Tq, p.kv_tokens = Tk, p.heads = H, p.kv_heads = Hkv;
    p.head_dim = D, p.causal = c.causal;
    p.q_pos.runs = qruns.empty() ? NULL : qruns.data(), p.q_pos.n_runs = qruns.size();
    p.kv_pos.runs = kruns.empty() ? NULL : kruns.data(), p.kv_pos.n_runs = kruns.size();
    p.cu_seqlens = c.m.cu, p.n_cu_seqlens = c.m.n_cu;
    p.has_window = c.m.has_window, p.window_left = c.m.left, p.window_right = c.m.right;
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

    /* the kernels, emulated, given what device_cuda.cu uploads: positions
     * and grain bounds (and cu_seqlens) for a call with a mask */
    std::vector<int64_t> qpos = positions(qruns, Tq), kpos = positions(kruns, Tk);
    std::vector<int64_t> qmin, qmax, kmin, kmax;
    grains(qpos, qmin, qmax);
    grains(kpos, kmin, kmax);
    stria_cu_attn_t a = {};
    a.B = B, a.Tq = Tq, a.Tk = Tk, a.H = H, a.Hkv = Hkv, a.G = H / Hkv, a.D = D;
    a.scale = 1.0f / sqrtf((float)D);
    a.causal = c.causal;
    a.dtype = c.dtype;
    a.bounds = c.m.n_cu > 0 || c.m.has_window;
    a.cu = c.m.cu, a.n_cu = (int64_t)c.m.n_cu;
    a.has_window = c.m.has_window, a.wl = c.m.left, a.wr = c.m.right;
    if (c.causal || a.bounds) {
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
    if (c.has_spot) { /* checked by the caller; the backward on this forward */
        run_spot_bwd<T, D, SIMT>(c, a, fwd, eo, else_v, out);
        return;
    }
    compare(c, "O", eo.data(), o.data(), nq, rel);
    compare(c, "LSE", else_v.data(), lse.data(), nl, 1e-5);
    const std::vector<bool> no_keys = rows_without_keys(c, lse);
    expect_zero_rows(c, "O", eo, no_keys, D);
    if (out != nullptr)
        out->o = eo, out->lse = else_v;

    /* accumulate: merging the same partial again keeps O and adds log 2 */
    if (c.accumulate) {
        a.accumulate = true;
        fwd();
        std::vector<float> lse2(lse);
        for (auto &x : lse2)
            x = x == -INFINITY ? x : x + logf(2.0f);
        compare(c, "O+=", eo.data(), o.data(), nq, rel);
        compare(c, "LSE+=", else_v.data(), lse2.data(), nl, 1e-5);
        a.accumulate = false;
    }

    a.lse_in = lse.data();
    a.delta = delta.data();
    a.dq = {edq.data(), Tq * H * D, H * D, D};
    a.dk = {edk.data(), Tk * Hkv * D, Hkv * D, D};
    a.dv = {edv.data(), Tk * Hkv * D, Hkv * D, D};
    launch_bwd<T, D, SIMT>(c, a);
    compare(c, "dQ", edq.data(), dq.data(), nq, rel);
    compare(c, "dK", edk.data(), dk.data(), nk, rel);
    compare(c, "dV", edv.data(), dv.data(), nk, rel);
    const std::vector<bool> unseen = keys_unseen(dv, D);
    expect_zero_rows(c, "dQ", edq, no_keys, D);
    expect_zero_rows(c, "dK", edk, unseen, D);
    expect_zero_rows(c, "dV", edv, unseen, D);
    if (out != nullptr)
        out->dq = edq, out->dk = edk, out->dv = edv;
}

/* One case: with simt, the SIMT kernels (fp32 d48 or bf16 d64), else the
 * tensor-core kernels its dtype and head_dim select. */
static void run_case(const ecase &c, bool simt, eouts *out = nullptr)
{
    const bool bf = c.dtype == STRIA_DTYPE_BF16;
    const auto t0 = std::chrono::steady_clock::now();
    printf("%s (%s):\n", c.name, simt ? "SIMT" : "tensor cores");
    if (simt && c.dtype == STRIA_DTYPE_F32 && c.D == 48)
        run<float, 48, true>(c, out);
    else if (simt && bf && c.D == 64)
        run<__nv_bfloat16, 64, true>(c, out);
    else if (!simt && c.D == 64 && c.dtype != STRIA_DTYPE_F32)
        bf ? run<__nv_bfloat16, 64, false>(c, out) : run<__half, 64, false>(c, out);
    else if (!simt && c.D == 128 && c.dtype != STRIA_DTYPE_F32)
        bf ? run<__nv_bfloat16, 128, false>(c, out) : run<__half, 128, false>(c, out);
    else {
        printf("  no kernel instance for this case: FAILED\n");
        failures++;
    }
    printf("  (%.1f s)\n",
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
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

/* ---- the unmasked and causal matrix --------------------------------------- */

static void run_base()
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
    for (const ecase &c : cases)
        run_case(c, false);
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
    run_case(simt_f32, true);
    run_case(simt_bf16, true);
    printf("row-wise kernels:\n");
    run_rows();
}

/* ---- documents and windows -------------------------------------------------- */

/* Documents over [0, S): lengths cycling through short ones (under the 16
 * tokens of a grain), empty ones and ones near the tile sizes, from a seed,
 * so that boundaries fall at every phase of a grain and a tile. Ends with an
 * empty document. */
static std::vector<int64_t> docs(int64_t S, uint32_t seed)
{
    static const int64_t lens[] = {0,  1,  3,  5,  7,   16, 17, 0, 31, 33,
                                   47, 63, 64, 65, 100, 2,  9,  0, 21};
    const size_t nl = sizeof(lens) / sizeof(lens[0]);
    std::vector<int64_t> cu{0};
    while (cu.back() < S) {
        seed = seed * 1664525u + 1013904223u;
        int64_t len = lens[(seed >> 16) % nl];
        cu.push_back(cu.back() + len < S ? cu.back() + len : S);
    }
    cu.push_back(S);
    return cu;
}

/* Boundaries on tile edges (64, 128, 192), inside tiles (100, 131, 150),
 * empty documents (at 64, 128 and the end), documents of 1 and 3 tokens:
 * positions below 200. */
static const int64_t fixed_docs[] = {0, 64, 64, 100, 101, 104, 128, 128, 131, 150, 192, 200, 200};

static emask doc_mask(const std::vector<int64_t> &cu)
{
    return {cu.data(), cu.size(), false, 0, 0};
}

static emask win_mask(int64_t left, int64_t right, const std::vector<int64_t> *cu = nullptr)
{
    return {cu ? cu->data() : nullptr, cu ? cu->size() : 0, true, left, right};
}

/* A case of batch 1, one K/V head, without the accumulate path (the base
 * matrix runs it), on positions q (Tq of them from qr; count 0: 0..) and k. */
static ecase mcase(const char *name, int64_t Tq, int64_t Tk, int64_t H, int D, bool causal,
                   stria_dtype_t dt, emask m, stria_pos_run_t qr = {}, stria_pos_run_t kr = {})
{
    ecase c = {name, 1, Tq, Tk, H, 1, D, causal, dt, qr, kr, m};
    c.accumulate = false;
    return c;
}

static void run_documents()
{
    const std::vector<int64_t> cu_fixed(std::begin(fixed_docs), std::end(fixed_docs));
    const std::vector<int64_t> cu300 = docs(300, 7), cu400 = docs(400, 11);
    /* the queries of [100, 200) against the keys of [0, 100): those of
     * [120, 200) see none of them, the keys of [0, 50) are seen by none */
    const std::vector<int64_t> cu_part{0, 50, 120, 200};
    const auto bf = STRIA_DTYPE_BF16, hf = STRIA_DTYPE_F16;
    run_case(mcase("docs causal gqa bf16 d64", 200, 200, 2, 64, true, bf, doc_mask(cu_fixed)),
             false);
    run_case(mcase("docs noncausal fp16 d128", 200, 200, 1, 128, false, hf, doc_mask(cu_fixed)),
             false);
    run_case(mcase("docs striped causal bf16 d128", 150, 150, 1, 128, true, bf, doc_mask(cu300),
                   {1, 2, 150}, {0, 2, 150}),
             false);
    ecase zz = mcase("docs zigzag causal fp16 d64", 200, 200, 1, 64, true, hf, doc_mask(cu400),
                     {100, 1, 100}, {0, 1, 100});
    zz.qrun2 = {300, 1, 100}, zz.krun2 = {200, 1, 100};
    run_case(zz, false);
    ecase none = mcase("docs rows without keys fp16 d64", 100, 100, 2, 64, false, hf,
                       doc_mask(cu_part), {100, 1, 100});
    none.accumulate = true; /* merging partials of -inf rows */
    run_case(none, false);
}

static void run_windows()
{
    enum { S = 192 };
    const auto bf = STRIA_DTYPE_BF16, hf = STRIA_DTYPE_F16;
    /* causal, over the whole block (S tokens), right 0 or -1 */
    static const int64_t lefts[] = {0, 1, 63, 64, 65, S - 1, S};
    for (size_t w = 0; w < sizeof(lefts) / sizeof(lefts[0]); w++) {
        const int64_t right = w % 3 == 0 ? -1 : 0;
        const int D = w % 4 < 2 ? 64 : 128;
        char name[64];
        snprintf(name, sizeof(name), "causal window (%lld, %lld) %s d%d", (long long)lefts[w],
                 (long long)right, w % 2 ? "fp16" : "bf16", D);
        run_case(mcase(name, S, S, 1, D, true, w % 2 ? hf : bf, win_mask(lefts[w], right)), false);
    }
    /* the queries of a later block see a band of the keys */
    run_case(mcase("causal window (65, 0) later block gqa", S, S, 2, 64, true, bf, win_mask(65, 0),
                   {128, 1, S}),
             false);
    /* not causal */
    run_case(mcase("noncausal window (17, 5) bf16 d64", S, S, 1, 64, false, bf, win_mask(17, 5)),
             false);
    run_case(
        mcase("noncausal window (0, -1) fp16 d128", S, 150, 1, 128, false, hf, win_mask(0, -1)),
        false);
    run_case(mcase("noncausal window (65, 65) striped", S, S, 1, 128, false, bf, win_mask(65, 65),
                   {1, 2, S}, {0, 2, S}),
             false);
    run_case(mcase("noncausal window (0, 0) fp16 d64", S, S, 1, 64, false, hf, win_mask(0, 0)),
             false);
}

static void run_windows_with_documents()
{
    const std::vector<int64_t> cu_fixed(std::begin(fixed_docs), std::end(fixed_docs));
    const std::vector<int64_t> cu300 = docs(300, 5);
    const auto bf = STRIA_DTYPE_BF16, hf = STRIA_DTYPE_F16;
    run_case(mcase("docs + causal window (5, 0) gqa", 200, 200, 2, 64, true, bf,
                   win_mask(5, 0, &cu_fixed)),
             false);
    run_case(mcase("docs + causal window (64, -1) fp16", 200, 200, 1, 128, true, hf,
                   win_mask(64, -1, &cu_fixed)),
             false);
    run_case(mcase("docs + noncausal window (17, 5)", 150, 150, 1, 128, false, bf,
                   win_mask(17, 5, &cu300), {0, 2, 150}, {1, 2, 150}),
             false);
    /* the SIMT kernels (fp32, and bf16 with GQA of 2 heads over 1) */
    ecase f32 = mcase("simt docs + causal window (9, 0)", 64, 64, 2, 48, true, STRIA_DTYPE_F32,
                      win_mask(9, 0, &cu300), {100, 1, 64}, {60, 1, 64});
    f32.accumulate = true;
    run_case(f32, true);
    ecase b16 = mcase("simt docs + noncausal window (3, 20)", 80, 80, 2, 64, false, bf,
                      win_mask(3, 20, &cu300), {1, 2, 80}, {0, 2, 80});
    b16.accumulate = true;
    run_case(b16, true);
}

static void expect_same_bits(const char *name, const char *what, const std::vector<float> &got,
                             const std::vector<float> &want)
{
    bool same = got.size() == want.size() &&
                memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0;
    printf("  %-32s %-4s %s\n", name, what, same ? "bit for bit" : "DIFFERS  FAILED");
    failures += same ? 0 : 1;
}

/* Documents [0, S) and window (-1, -1) mask nothing: every output keeps the
 * bits of the call without them. */
static void run_masks_that_mask_nothing()
{
    enum { S = 300 };
    static const int64_t whole[] = {0, S}, longer[] = {0, S + 50};
    static const struct {
        const char *name;
        emask m;
    } masks[] = {
        {"cu_seqlens [0, S]", {whole, 2, false, 0, 0}},
        {"window (-1, -1)", {nullptr, 0, true, -1, -1}},
        {"both", {whole, 2, true, -1, -1}},
        {"cu_seqlens [0, S + 50]", {longer, 2, false, 0, 0}},
    };
    const emask none = {};
    const struct {
        ecase c;
        bool simt;
        unsigned which; /* bit m: mask m of the list above */
    } plain[] = {
        {mcase("causal striped gqa bf16 d64", 150, 150, 2, 64, true, STRIA_DTYPE_BF16, none,
               {1, 2, 150}, {0, 2, 150}),
         false, 0xf},
        {mcase("noncausal fp16 d64", 100, 130, 1, 64, false, STRIA_DTYPE_F16, none, {20, 1, 100}),
         false, 1u << 2},
        {mcase("simt causal fp32 d48", 32, 40, 1, 48, true, STRIA_DTYPE_F32, none, {10, 1, 32}),
         true, 0x3},
    };
    for (const auto &pc : plain) {
        eouts want;
        run_case(pc.c, pc.simt, &want);
        for (size_t m = 0; m < sizeof(masks) / sizeof(masks[0]); m++) {
            if (!(pc.which >> m & 1))
                continue;
            ecase c = pc.c;
            char name[96];
            snprintf(name, sizeof(name), "%s, %s", pc.c.name, masks[m].name);
            c.name = name;
            c.m = masks[m].m;
            eouts got;
            run_case(c, pc.simt, &got);
            expect_same_bits(name, "O", got.o, want.o);
            expect_same_bits(name, "LSE", got.lse, want.lse);
            expect_same_bits(name, "dQ", got.dq, want.dq);
            expect_same_bits(name, "dK", got.dk, want.dk);
            expect_same_bits(name, "dV", got.dv, want.dv);
        }
    }
}

/* ---- non-finite inputs ------------------------------------------------------ */

static void nf_print_report(void *ctx, const char *msg)
{
    (void)ctx;
    printf("    %s  FAILED\n", msg);
}

/* A NaN or an infinity in Q, K, V or dO of a causal call over two batch
 * rows, where queries see it: every output that depends on it is non-finite
 * (after the forward, after merging the partial into itself, and through
 * the backward) and the other batch row and kv head group keep their
 * outputs (nonfinite.h); the tensor-core kernels and the SIMT ones. */
static void run_nonfinite()
{
    static const struct {
        nf_tensor_t t;
        int64_t tok;
        float value;
    } spots[] = {{NF_Q, 12, NAN}, {NF_K, 3, INFINITY}, {NF_V, 5, NAN}, {NF_DO, 9, INFINITY}};
    /* two batch rows of one head: small, the emulation runs a host thread
     * per CUDA thread */
    const struct {
        ecase c;
        bool simt;
    } kinds[] = {
        {{"nonfinite causal bf16 d64", 2, 70, 70, 1, 1, 64, true, STRIA_DTYPE_BF16, {}, {}}, false},
        {{"nonfinite simt causal fp32 d48", 2, 16, 16, 1, 1, 48, true, STRIA_DTYPE_F32, {}, {}},
         true},
    };
    for (const auto &k : kinds) {
        eouts clean;
        ecase c0 = k.c;
        c0.has_spot = true; /* no value put anywhere: the clean run */
        c0.spot = {NF_N_TENSORS, 0, 0, 0, 0, 0.0f};
        run_case(c0, k.simt, &clean);
        size_t bad = 0;
        for (const std::vector<float> *x : {&clean.o, &clean.lse, &clean.dq, &clean.dk, &clean.dv})
            for (float e : *x)
                bad += isnan(e) || e == INFINITY;
        printf("  %-32s %zu non-finite outputs without a non-finite input%s\n", k.c.name, bad,
               bad ? ": FAILED" : "");
        failures += bad ? 1 : 0;
        for (const auto &sp : spots) {
            ecase c = k.c;
            char name[128];
            snprintf(name, sizeof(name), "%s, %s %g", k.c.name, nf_tensor_names[sp.t],
                     (double)sp.value);
            c.name = name;
            c.has_spot = true;
            c.spot = {sp.t, 1, sp.tok, 0, 5, sp.value};
            eouts got;
            run_case(c, k.simt, &got);
            const nf_dims_t dims = {c.B, c.Tq, c.Tk, c.H, c.Hkv, c.D};
            ref_shape_t rs = {c.B,      c.Tq,    c.Tk,   c.H, c.Hkv, c.D, 1.0 / sqrt((double)c.D),
                              c.causal, nullptr, nullptr};
            ref_out_t ref;
            nf_ref_run(&rs, nullptr, got.in[NF_Q].data(), got.in[NF_K].data(), got.in[NF_V].data(),
                       got.in[NF_DO].data(), &ref);
            const nf_outs_t g = {got.o.data(), got.lse.data(), got.dq.data(), got.dk.data(),
                                 got.dv.data()};
            const nf_outs_t cl = {clean.o.data(), clean.lse.data(), clean.dq.data(),
                                  clean.dk.data(), clean.dv.data()};
            nf_counts_t n =
                nf_check(&dims, &c.spot, true, &g, &cl, &ref, name, nf_print_report, nullptr);
            printf("  %-32s %zu outputs reached, all non-finite; %zu outside kept%s\n", name,
                   n.must, n.outside, n.failed ? ": FAILED" : "");
            failures += n.failed ? 1 : 0;
            ref_out_free(&ref);
        }
    }
}

/* No argument: every group. "base": the unmasked and causal matrix and the
 * row-wise kernels; "docs": documents, windows with documents and the masks
 * that mask nothing; "windows": windows alone; "nonfinite": non-finite
 * inputs (ctest runs the four as separate tests). */
int main(int argc, char **argv)
{
    static const char *const groups[] = {"all", "base", "docs", "windows", "nonfinite"};
    const char *group = argc > 1 ? argv[1] : "all";
    size_t gi = 0;
    while (gi < 5 && strcmp(group, groups[gi]) != 0)
        gi++;
    if (gi == 5) {
        fprintf(stderr, "usage: %s [base|docs|windows|nonfinite]\n", argv[0]);
        return 2;
    }
    if (gi == 0 || gi == 1)
        run_base();
    if (gi == 0 || gi == 2) {
        run_documents();
        run_windows_with_documents();
        run_masks_that_mask_nothing();
    }
    if (gi == 0 || gi == 3)
        run_windows();
    if (gi == 0 || gi == 4)
        run_nonfinite();
    if (failures) {
        printf("test_kernel_emu: %d outputs out of tolerance\n", failures);
        return 1;
    }
    printf("test_kernel_emu: the emulated CUDA kernels match the portable CPU kernels\n");
    return 0;
}
