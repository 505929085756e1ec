/* The kernels' workspace against the admission rule: a ring rank's forward
 * and backward passes, run as daemon/ring runs them (begin, one block per
 * rank, end) with a counting allocator as params.workspace, must never hold
 * more at once than stria_kernel_grant() of the shard (the kernels' part of
 * stria_rank_memory(), what the coordinator admits and the worker reserves),
 * for any shape and any number of kernel threads. And the grant must stay
 * near what large shapes take, so that an estimate that admits nothing (a
 * huge figure) fails here too. */
#include <criterion/criterion.h>

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "stria_kernels.h"
#include "stria_layout.h"

/* ---- a counting allocator ------------------------------------------------ */

typedef struct {
    pthread_mutex_t lock;
    uint64_t now, peak;
    long live;
} counter_t;

/* Each block carries its size in a 64-byte header (the kernels expect
 * 64-byte alignment). */
enum { HDR = 64 };

static void *count_alloc(void *ctx, size_t bytes)
{
    counter_t *c = ctx;
    /* a worker's pool refuses 0 bytes (stria_mempool_alloc) */
    cr_assert(bytes > 0, "a kernel asked its workspace allocator for 0 bytes");
    char *p = aligned_alloc(64, (bytes + HDR + 63) / 64 * 64);
    if (p == NULL)
        return NULL;
    memcpy(p, &bytes, sizeof(bytes));
    pthread_mutex_lock(&c->lock);
    c->now += bytes;
    c->peak = c->now > c->peak ? c->now : c->peak;
    c->live++;
    pthread_mutex_unlock(&c->lock);
    return p + HDR;
}

static void count_free(void *ctx, void *ptr)
{
    counter_t *c = ctx;
    size_t bytes;
    if (ptr == NULL)
        return;
    char *p = (char *)ptr - HDR;
    memcpy(&bytes, p, sizeof(bytes));
    pthread_mutex_lock(&c->lock);
    c->now -= bytes;
    c->live--;
    pthread_mutex_unlock(&c->lock);
    free(p);
}

/* ---- one rank's passes --------------------------------------------------- */

typedef struct {
    int64_t B, seq, H, Hkv, D;
    int n_ranks;
    bool causal;
    stria_dtype_t dtype;
    bool large; /* the grant must be within 3x of the peak */
} mcase_t;

typedef struct {
    uint64_t fwd, bwd; /* peaks of each pass */
    uint64_t grant;    /* stria_kernel_grant() of the shard */
} mresult_t;

/* Rank `rank` of the case on `threads` kernel threads: a forward pass then a
 * backward pass over every rank's block (striped layout; the blocks of the
 * real tokens only, as the ring hands them over). */
static mresult_t run_rank(const mcase_t *mc, int rank, int threads)
{
    stria_layout_t lay;
    stria_layout_run_t lr[STRIA_LAYOUT_MAX_RUNS];
    counter_t cnt = {.lock = PTHREAD_MUTEX_INITIALIZER};
    stria_allocator_t mem = {count_alloc, count_free, &cnt};
    stria_pool_t *pool = NULL;
    stria_kernel_grant_t g;
    mresult_t res = {0};

    cr_assert_eq(stria_layout_init(STRIA_LAYOUT_STRIPED, mc->n_ranks, mc->seq, &lay), STRIA_OK);
    const int64_t L = lay.shard_tokens, B = mc->B, H = mc->H, Hkv = mc->Hkv, D = mc->D;
    cr_assert_eq(stria_kernel_grant(B, L, L, H, Hkv, D, &g), STRIA_OK, "%s", stria_error_msg());
    res.grant = g.total;
    if (threads > 1)
        cr_assert_eq(stria_pool_create(threads, &pool), STRIA_OK);

    const size_t es = stria_dtype_size(mc->dtype);
    const size_t nq = (size_t)(B * L * H * D), nk = (size_t)(B * L * Hkv * D);
    const size_t nl = (size_t)(B * H * L);
    float *f = malloc((2 * nq + 2 * nk) * sizeof(float));
    char *in = malloc((2 * nq + 2 * nk) * es);
    float *o = calloc(nq, 4), *lse = malloc(nl * 4), *delta = malloc(nl * 4);
    float *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nk, 4);
    ref_fill(f, 2 * nq + 2 * nk, 7 + (uint64_t)rank, 0.5f, mc->dtype);
    ref_to_dtype(f, 2 * nq + 2 * nk, mc->dtype, in);

    /* the rank's query side; one K/V buffer stands for every rank's block
     * (the ring receives each into the same buffers) */
    const int64_t tq = stria_layout_shard_valid(&lay, rank);
    size_t n_qr = stria_layout_shard_runs(&lay, rank, false, lr);
    cr_assert(tq > 0 && n_qr == 1);
    stria_pos_run_t qr = {lr[0].first, lr[0].stride, lr[0].count};
    stria_tensor_t q = stria_tensor_contiguous(in, mc->dtype, tq, H, D);
    stria_tensor_t d_o = stria_tensor_contiguous(in + nq * es, mc->dtype, tq, H, D);
    stria_tensor_t to = stria_tensor_head_major(o, STRIA_DTYPE_F32, tq, H, D);
    stria_tensor_t tdq = stria_tensor_contiguous(dq, STRIA_DTYPE_F32, tq, H, D);

    stria_attn_params_t p = {0};
    p.batch = B;
    p.q_tokens = tq;
    p.heads = H;
    p.kv_heads = Hkv;
    p.head_dim = D;
    p.causal = mc->causal;
    p.q_pos = (stria_positions_t){&qr, 1};
    p.pool = pool;
    p.workspace = &mem;

    for (int pass = 0; pass < 2; pass++) {
        stria_attn_fwd_pass_t *fp = NULL;
        stria_attn_bwd_pass_t *bp = NULL;
        cnt.peak = 0;
        p.kv_tokens = 1;
        p.kv_pos = (stria_positions_t){NULL, 0};
        if (pass == 0) {
            cr_assert_eq(stria_attn_partial_init(&p, &to, lse), STRIA_OK);
            cr_assert_eq(stria_attn_fwd_begin(&p, &q, &fp), STRIA_OK, "%s", stria_error_msg());
        } else {
            cr_assert_eq(stria_attn_bwd_delta(&p, &to, &d_o, delta), STRIA_OK);
            cr_assert_eq(stria_attn_bwd_begin(&p, &q, &d_o, lse, delta, &bp), STRIA_OK, "%s",
                         stria_error_msg());
        }
        for (int j = 0; j < mc->n_ranks; j++) {
            const int64_t tk = stria_layout_shard_valid(&lay, j);
            if (tk == 0 || stria_layout_shard_runs(&lay, j, false, lr) != 1)
                continue;
            stria_pos_run_t kr = {lr[0].first, lr[0].stride, lr[0].count};
            char *kv = in + 2 * nq * es;
            stria_tensor_t k = stria_tensor_head_major(kv, mc->dtype, tk, Hkv, D);
            stria_tensor_t v = stria_tensor_head_major(kv + nk * es, mc->dtype, tk, Hkv, D);
            p.kv_tokens = tk;
            p.kv_pos = (stria_positions_t){&kr, 1};
            stria_status_t st;
            if (pass == 0) {
                st = stria_attn_fwd_block(fp, &p, &k, &v, &to, lse, true);
            } else {
                stria_tensor_t tdk = stria_tensor_contiguous(dk, STRIA_DTYPE_F32, tk, Hkv, D);
                stria_tensor_t tdv = stria_tensor_contiguous(dv, STRIA_DTYPE_F32, tk, Hkv, D);
                st = stria_attn_bwd_block(bp, &p, &k, &v, &tdk, &tdv);
            }
            cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
        }
        if (pass == 0) {
            stria_attn_fwd_end(fp);
            res.fwd = cnt.peak;
        } else {
            cr_assert_eq(stria_attn_bwd_end(bp, &tdq), STRIA_OK, "%s", stria_error_msg());
            res.bwd = cnt.peak;
        }
        cr_assert_eq(cnt.live, 0, "a workspace outlived its pass");
    }
    for (size_t i = 0; i < nq; i += 97)
        cr_assert(isfinite(dq[i]), "dQ is not finite");

    stria_pool_destroy(pool);
    free(f), free(in), free(o), free(lse), free(delta), free(dq), free(dk), free(dv);
    return res;
}

/* Shapes: odd shard lengths (1 token, a partial tile, just over a tile),
 * MHA and GQA, head_dim a multiple of 16 (read in place), not one (40, 72:
 * packed and padded) and beyond 128 (fewer key tiles per backward task), the
 * three dtypes, causal or not. */
static const mcase_t cases[] = {
    /* the service test that used more pool memory than its admission */
    {3, 203, 4, 2, 64, 2, true, STRIA_DTYPE_BF16, false},
    {1, 2, 2, 1, 16, 2, true, STRIA_DTYPE_F32, false},
    {2, 75, 4, 4, 40, 1, false, STRIA_DTYPE_F32, false},
    {1, 389, 6, 2, 72, 3, true, STRIA_DTYPE_F16, false},
    {2, 130, 2, 1, 136, 2, false, STRIA_DTYPE_BF16, false},
    {1, 257, 8, 1, 256, 4, true, STRIA_DTYPE_F32, false},
    /* large: the grant must be close to what the passes take */
    {2, 1021, 8, 2, 64, 2, true, STRIA_DTYPE_BF16, true},
    {1, 1533, 4, 4, 128, 3, false, STRIA_DTYPE_F32, true},
};

static const int thread_counts[] = {1, 2, 3, 8, 16};

/* Every case (bf16 ones only with bf16_only) on every thread count, on the
 * variant in use; returns the highest peak / grant. */
static double run_grid(bool bf16_only)
{
    double worst = 0.0;
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
        const mcase_t *mc = &cases[ci];
        if (bf16_only && mc->dtype != STRIA_DTYPE_BF16)
            continue;
        for (size_t ti = 0; ti < sizeof(thread_counts) / sizeof(thread_counts[0]); ti++) {
            const int threads = thread_counts[ti];
            /* the first rank holds the most real tokens, the last the fewest */
            for (int rank = 0; rank < mc->n_ranks; rank += mc->n_ranks - 1) {
                mresult_t r = run_rank(mc, rank, threads);
                uint64_t peak = r.fwd > r.bwd ? r.fwd : r.bwd;
                cr_log_info("%s: B=%lld seq=%lld/%d H=%lld/%lld D=%lld %s%s rank %d, %d threads: "
                            "forward %llu, backward %llu, grant %llu (%.2fx)",
                            stria_kernels_variant(), (long long)mc->B, (long long)mc->seq,
                            mc->n_ranks, (long long)mc->H, (long long)mc->Hkv, (long long)mc->D,
                            stria_dtype_name(mc->dtype), mc->causal ? " causal" : "", rank, threads,
                            (unsigned long long)r.fwd, (unsigned long long)r.bwd,
                            (unsigned long long)r.grant, (double)peak / (double)r.grant);
                cr_assert(r.fwd > 0 && r.bwd > 0, "the passes took no workspace");
                cr_expect(peak <= r.grant,
                          "%s: B=%lld seq=%lld on %d ranks, H=%lld/%lld D=%lld %s, rank %d, %d "
                          "threads: the passes held %llu bytes (forward %llu, backward %llu), "
                          "the admission grants %llu",
                          stria_kernels_variant(), (long long)mc->B, (long long)mc->seq,
                          mc->n_ranks, (long long)mc->H, (long long)mc->Hkv, (long long)mc->D,
                          stria_dtype_name(mc->dtype), rank, threads, (unsigned long long)peak,
                          (unsigned long long)r.fwd, (unsigned long long)r.bwd,
                          (unsigned long long)r.grant);
                if (mc->large)
                    cr_expect(r.grant <= 3 * peak,
                              "the grant (%llu) is over 3x what a large shape takes (%llu)",
                              (unsigned long long)r.grant, (unsigned long long)peak);
                double ratio = (double)peak / (double)r.grant;
                worst = ratio > worst ? ratio : worst;
                if (mc->n_ranks == 1)
                    break;
            }
        }
    }
    return worst;
}

/* On the variant a worker runs (the best this CPU has, or STRIA_KERNEL). */
Test(kernels_memory, passes_stay_within_the_admission_grant, .timeout = 600)
{
    cr_log_info("highest peak / grant: %.3f", run_grid(false));
}

/* bf16 inputs on the bf16 dot product pack other operands (pairs of rows,
 * score operands of half the size): the bf16 cases on every variant that
 * runs them so, when the CPU has one (the portable variant, slow, packs as
 * the others without a bf16 dot product and is left out). */
Test(kernels_memory, bf16_products_stay_within_the_admission_grant, .timeout = 600)
{
    const char *const *names = stria_kernels_variant_names();
    bool ran = false;
    for (size_t i = 0; names[i] != NULL; i++) {
        if (!stria_kernels_variant_available(names[i]) || !ref_bf16_dot(names[i]))
            continue;
        cr_assert_eq(stria_kernels_set_variant(names[i]), STRIA_OK, "%s", stria_error_msg());
        cr_log_info("%s: highest peak / grant: %.3f", names[i], run_grid(true));
        ran = true;
    }
    if (!ran)
        cr_log_info("no variant runs bf16 products on a bf16 dot product here: skipped");
}
