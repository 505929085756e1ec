/* Leak check of the ring engine and the in-process link, as a plain program:
 * LeakSanitizer reports do not fail Criterion tests, but they make this
 * process exit non-zero in the sanitizer build. Runs successful passes,
 * failed ones (dead rank, stalled rank, bad argument) and the error paths of
 * stria_ring_run_local(). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stria_ring.h"
#include "tleak.h"

static const stria_ring_shape_t shape = {.call = {.batch = 2, .seq_len = 45, .causal = true},
                                         .heads = 2,
                                         .kv_heads = 1,
                                         .head_dim = 16,
                                         .dtype = STRIA_DTYPE_F32};

typedef struct {
    stria_inproc_hub_t *hub;
    int rank;
    bool backward;
    stria_status_t st;
} rank_t;

/* Device of the ranks: NULL, or "cpu:staged", whose device memory is host
 * memory in fact, so the host buffers below serve as device buffers. */
static const char *rank_device;

static void *rank_main(void *arg)
{
    rank_t *x = arg;
    stria_link_t *link = NULL;
    stria_ring_pass_t *pass = NULL;
    stria_device_t *dev = NULL;
    stria_ring_opts_t opts = {.step_timeout_s = 0.2};
    float *buf = NULL;

    if (rank_device != NULL && stria_device_open(rank_device, NULL, &dev) != STRIA_OK) {
        x->st = STRIA_ERR_INTERNAL;
        return NULL;
    }
    opts.device = dev;
    x->st = stria_inproc_link_create(x->hub, x->rank, &link);
    if (x->st == STRIA_OK)
        x->st = stria_ring_pass_create(link, &shape, STRIA_LAYOUT_ZIGZAG, &opts, &pass);
    if (x->st == STRIA_OK) {
        int64_t L = stria_ring_pass_layout(pass)->shard_tokens;
        size_t qn = (size_t)(shape.call.batch * L * shape.heads * shape.head_dim);
        buf = calloc(9 * qn + (size_t)(shape.call.batch * shape.heads * L), sizeof(float));
        stria_tensor_t t[9];
        for (int i = 0; i < 9; i++)
            t[i] = stria_tensor_contiguous(buf + (size_t)i * qn, STRIA_DTYPE_F32, L,
                                           i == 1 || i == 2 || i == 7 || i == 8 ? shape.kv_heads
                                                                                : shape.heads,
                                           shape.head_dim);
        float *lse = buf + 9 * qn;
        for (size_t i = 0; i < 3 * qn; i++)
            buf[i] = (float)((i * 7919) % 13) * 0.1f;
        x->st = stria_ring_fwd(pass, &t[0], &t[1], &t[2], &t[3], lse);
        if (x->st == STRIA_OK && x->backward)
            x->st =
                stria_ring_bwd(pass, &t[0], &t[1], &t[2], &t[3], lse, &t[4], &t[6], &t[7], &t[8]);
    }
    free(buf);
    stria_ring_pass_destroy(pass);
    stria_device_close(dev);
    stria_link_destroy(link);
    return NULL;
}

/* n ranks on threads; fault on rank 1 if given; returns how many failed. */
static int run_ranks(int n, stria_inproc_fault_t fault, uint64_t after, bool backward)
{
    stria_inproc_hub_t *hub;
    pthread_t th[8];
    rank_t x[8];
    int failed = 0;

    if (stria_inproc_hub_create(n, &hub) != STRIA_OK)
        return -1;
    if (fault != STRIA_INPROC_FAULT_NONE)
        stria_inproc_fault_inject(hub, 1, fault, after);
    for (int r = 0; r < n; r++) {
        x[r] = (rank_t){.hub = hub, .rank = r, .backward = backward};
        pthread_create(&th[r], NULL, rank_main, &x[r]);
    }
    for (int r = 0; r < n; r++) {
        pthread_join(th[r], NULL);
        failed += x[r].st != STRIA_OK;
    }
    stria_inproc_hub_release(hub);
    return failed;
}

int main(void)
{
    tleak.prog = "leak_ring";
    tleak.fatal = false;
    tleak.error_msg = false;
    static const char *const devices[] = {NULL, "cpu:staged"};
    for (int di = 0; di < 2; di++) {
        rank_device = devices[di];
        CHECK(run_ranks(4, STRIA_INPROC_FAULT_NONE, 0, true) == 0, "clean pass failed");
        /* A pass of 4 ranks posts 32 operations per rank (forward and
         * backward), one of 3 ranks 22; the last few belong to the final
         * agreement, where a fault can no longer reach every rank. */
        for (uint64_t after = 0; after < 27; after += 3)
            CHECK(run_ranks(4, STRIA_INPROC_FAULT_FAIL, after, true) == 4,
                  "dead rank after %llu ops: not every rank failed", (unsigned long long)after);
        for (uint64_t after = 0; after < 18; after += 3)
            CHECK(run_ranks(3, STRIA_INPROC_FAULT_STALL, after, true) == 3,
                  "stalled rank after %llu ops: not every rank failed", (unsigned long long)after);
    }

    /* stria_ring_run_local: success, and a bad shape */
    size_t qn = (size_t)(shape.call.batch * shape.call.seq_len * shape.heads * shape.head_dim);
    float *m = calloc(10 * qn, sizeof(float));
    for (size_t i = 0; i < 3 * qn; i++)
        m[i] = (float)(i % 11) * 0.05f;
    stria_ring_local_io_t io = {.q = m,
                                .k = m + qn,
                                .v = m + 2 * qn,
                                .o = m + 3 * qn,
                                .o_dtype = STRIA_DTYPE_BF16,
                                .lse = m + 4 * qn,
                                .d_o = m + 5 * qn,
                                .dq = m + 6 * qn,
                                .dk = m + 7 * qn,
                                .dv = m + 8 * qn,
                                .grad_dtype = STRIA_DTYPE_F32};
    stria_ring_local_opts_t lo = {.layout = STRIA_LAYOUT_STRIPED,
                                  .n_ranks = 3,
                                  .passes = STRIA_RING_PASS_FWD_BWD,
                                  .threads_per_rank = 2};
    stria_ring_step_stats_t steps[9];
    stria_ring_local_stats_t stats = {.fwd_steps = steps};
    stria_status_t st = stria_ring_run_local(&shape, &lo, &io, &stats);
    CHECK(st == STRIA_OK, "run_local: %s", stria_error_msg());
    lo.passes = STRIA_RING_PASS_BWD;
    st = stria_ring_run_local(&shape, &lo, &io, NULL);
    CHECK(st == STRIA_OK, "run_local backward only: %s", stria_error_msg());
    lo.device = "cpu:staged";
    st = stria_ring_run_local(&shape, &lo, &io, NULL);
    CHECK(st == STRIA_OK, "run_local staged: %s", stria_error_msg());
    lo.device = "cuda:x";
    CHECK(stria_ring_run_local(&shape, &lo, &io, NULL) == STRIA_ERR_INVALID_ARG, "bad device");
    lo.device = NULL;
    stria_ring_shape_t bad = shape;
    bad.head_dim = 12;
    CHECK(stria_ring_run_local(&bad, &lo, &io, NULL) == STRIA_ERR_UNSUPPORTED, "bad head_dim");
    free(m);

    if (tleak.failures != 0) {
        fprintf(stderr, "leak_ring: %d checks failed\n", tleak.failures);
        return 1;
    }
    printf("leak_ring: ok\n");
    return 0;
}
