/* What one pass object per job saves: repeated forward passes of N rank
 * threads, each pass over a fresh in-process link (as the worker connects a
 * fresh link per pass), either with a pass object created and destroyed per
 * pass (its arena, and staged its device and pinned buffers, allocated and
 * faulted in every time) or with one object per rank rebound to the new
 * link (stria_ring_pass_set_link()). The two ways alternate round by round;
 * the first pass of each round is a warm-up and is not counted. Prints the
 * mean wall time per pass of each round and the medians.
 *
 *   time_pass_reuse [--ranks N] [--seq S] [--heads H] [--head-dim D]
 *                   [--dtype fp32|bf16|fp16] [--passes P] [--rounds R]
 *                   [--device NAME] [--no-causal]
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stria_ring.h"

#define MAX_RANKS 16

typedef struct {
    stria_ring_shape_t shape;
    int n, passes, rounds;
    const char *device;
    stria_inproc_hub_t **hubs; /* [round][way][pass] */
    pthread_barrier_t barrier;
    double *t;  /* [round][way][pass + 1]: barrier times of rank 0 */
    int failed; /* atomic */
} bench_t;

typedef struct {
    bench_t *b;
    int rank;
} rank_arg_t;

static void fail(bench_t *b, int rank, const char *what)
{
    fprintf(stderr, "time_pass_reuse: rank %d: %s: %s\n", rank, what, stria_error_msg());
    __atomic_store_n(&b->failed, 1, __ATOMIC_RELAXED);
}

static void *rank_main(void *arg)
{
    rank_arg_t *ra = arg;
    bench_t *b = ra->b;
    const int rank = ra->rank;
    const stria_ring_shape_t *s = &b->shape;
    stria_device_t *dev = NULL;
    stria_layout_t l;
    void *buf[5] = {NULL};
    float *lse = NULL;

    if (stria_layout_init(STRIA_LAYOUT_STRIPED, b->n, s->call.seq_len, &l) != STRIA_OK ||
        stria_device_open(b->device, NULL, &dev) != STRIA_OK)
        fail(b, rank, "setup");
    const int64_t L = l.shard_tokens;
    const size_t es = stria_dtype_size(s->dtype);
    const size_t qn = (size_t)(s->call.batch * L * s->heads * s->head_dim);
    const size_t kn = (size_t)(s->call.batch * L * s->kv_heads * s->head_dim);
    const size_t bytes[5] = {qn * es, kn * es, kn * es, qn * es,
                             (size_t)(s->call.batch * s->heads * L) * 4};
    float *host = malloc(qn * sizeof(float));
    void *conv = malloc(qn * es);
    for (size_t i = 0; i < qn; i++)
        host[i] = (float)((i * 2654435761u + (size_t)rank) % 1000) / 1000.0f - 0.5f;
    stria_dtype_convert(STRIA_DTYPE_F32, host, s->dtype, conv, qn);
    for (int i = 0; i < 5 && dev != NULL; i++) {
        if (stria_device_alloc(dev, bytes[i], &buf[i]) != STRIA_OK) {
            fail(b, rank, "device buffers");
            break;
        }
        if (i < 3)
            (void)stria_device_copy(dev, STRIA_STREAM_COPY, buf[i], conv, bytes[i]);
    }
    if (dev != NULL)
        (void)stria_device_sync(dev, STRIA_STREAM_COPY);
    lse = buf[4];
    stria_tensor_t tq = stria_tensor_contiguous(buf[0], s->dtype, L, s->heads, s->head_dim);
    stria_tensor_t tk = stria_tensor_contiguous(buf[1], s->dtype, L, s->kv_heads, s->head_dim);
    stria_tensor_t tv = stria_tensor_contiguous(buf[2], s->dtype, L, s->kv_heads, s->head_dim);
    stria_tensor_t to = stria_tensor_contiguous(buf[3], s->dtype, L, s->heads, s->head_dim);
    stria_ring_opts_t opts = {.step_timeout_s = 120, .device = dev};

    for (int round = 0; round < b->rounds; round++)
        for (int k = 0; k < 2; k++) {
            /* alternate which way goes first from round to round */
            const int way = (round + k) % 2; /* 0: fresh object per pass, 1: rebound */
            stria_ring_pass_t *pass = NULL;
            stria_link_t *bound = NULL;
            for (int i = 0; i < b->passes; i++) {
                stria_inproc_hub_t *hub = b->hubs[(round * 2 + way) * b->passes + i];
                stria_link_t *link = NULL;
                stria_status_t st = STRIA_OK;
                pthread_barrier_wait(&b->barrier);
                if (rank == 0)
                    b->t[(round * 2 + way) * (b->passes + 1) + i] = stria_time_now();
                if (__atomic_load_n(&b->failed, __ATOMIC_RELAXED))
                    continue;
                if (stria_inproc_link_create(hub, rank, &link) != STRIA_OK)
                    fail(b, rank, "link");
                else if (pass == NULL)
                    st = stria_ring_pass_create(link, s, STRIA_LAYOUT_STRIPED, &opts, &pass);
                else
                    st = stria_ring_pass_set_link(pass, link);
                if (st == STRIA_OK && link != NULL)
                    st = stria_ring_fwd(pass, &tq, &tk, &tv, &to, lse);
                if (st != STRIA_OK)
                    fail(b, rank, "pass");
                stria_link_destroy(bound);
                bound = link;
                if (way == 0) {
                    stria_ring_pass_destroy(pass);
                    pass = NULL;
                }
            }
            pthread_barrier_wait(&b->barrier);
            if (rank == 0)
                b->t[(round * 2 + way) * (b->passes + 1) + b->passes] = stria_time_now();
            stria_ring_pass_destroy(pass);
            stria_link_destroy(bound);
        }
    for (int i = 0; i < 5 && dev != NULL; i++)
        stria_device_free(dev, buf[i]);
    stria_device_close(dev);
    free(host);
    free(conv);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
    bench_t b = {.shape = {.call = {.batch = 1, .seq_len = 4096, .causal = true},
                           .heads = 8,
                           .kv_heads = 8,
                           .head_dim = 128,
                           .dtype = STRIA_DTYPE_BF16},
                 .n = 4,
                 .passes = 10,
                 .rounds = 3,
                 .device = "cpu"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--no-causal") == 0) {
            b.shape.call.causal = false;
            continue;
        }
        if (v == NULL) {
            fprintf(stderr, "usage: see the comment at the top of time_pass_reuse.c\n");
            return 2;
        }
        i++;
        if (strcmp(a, "--ranks") == 0)
            b.n = atoi(v);
        else if (strcmp(a, "--seq") == 0)
            b.shape.call.seq_len = atoll(v);
        else if (strcmp(a, "--heads") == 0)
            b.shape.heads = b.shape.kv_heads = atoll(v);
        else if (strcmp(a, "--head-dim") == 0)
            b.shape.head_dim = atoll(v);
        else if (strcmp(a, "--passes") == 0)
            b.passes = atoi(v);
        else if (strcmp(a, "--rounds") == 0)
            b.rounds = atoi(v);
        else if (strcmp(a, "--device") == 0)
            b.device = v;
        else if (strcmp(a, "--dtype") == 0 && stria_dtype_parse(v, &b.shape.dtype) == STRIA_OK)
            ;
        else {
            fprintf(stderr, "time_pass_reuse: bad option %s %s\n", a, v);
            return 2;
        }
    }
    if (b.n < 1 || b.n > MAX_RANKS || b.passes < 2 || b.rounds < 1) {
        fprintf(stderr, "time_pass_reuse: --ranks 1..%d, --passes >= 2, --rounds >= 1\n",
                MAX_RANKS);
        return 2;
    }
    const int nh = b.rounds * 2 * b.passes;
    b.hubs = calloc((size_t)nh, sizeof(*b.hubs));
    b.t = calloc((size_t)(b.rounds * 2 * (b.passes + 1)), sizeof(*b.t));
    for (int i = 0; i < nh; i++)
        if (stria_inproc_hub_create(b.n, &b.hubs[i]) != STRIA_OK) {
            fprintf(stderr, "time_pass_reuse: %s\n", stria_error_msg());
            return 1;
        }
    pthread_barrier_init(&b.barrier, NULL, (unsigned)b.n);
    pthread_t th[MAX_RANKS];
    rank_arg_t ra[MAX_RANKS];
    for (int r = 0; r < b.n; r++) {
        ra[r] = (rank_arg_t){&b, r};
        pthread_create(&th[r], NULL, rank_main, &ra[r]);
    }
    for (int r = 0; r < b.n; r++)
        pthread_join(th[r], NULL);
    pthread_barrier_destroy(&b.barrier);
    for (int i = 0; i < nh; i++)
        stria_inproc_hub_release(b.hubs[i]);
    if (b.failed) {
        free(b.hubs);
        free(b.t);
        return 1;
    }

    printf("forward, N=%d, seq %lld, heads %lld, head_dim %lld, %s, %s, device %s: %d passes "
           "per round (first not counted), %d rounds\n",
           b.n, (long long)b.shape.call.seq_len, (long long)b.shape.heads,
           (long long)b.shape.head_dim, stria_dtype_name(b.shape.dtype),
           b.shape.call.causal ? "causal" : "non-causal", b.device, b.passes, b.rounds);
    double per[2][64];
    for (int round = 0; round < b.rounds && round < 64; round++) {
        for (int way = 0; way < 2; way++) {
            const double *t = &b.t[(round * 2 + way) * (b.passes + 1)];
            per[way][round] = (t[b.passes] - t[1]) / (b.passes - 1) * 1e3;
        }
        printf("round %d: create+destroy per pass %.3f ms/pass, one object rebound %.3f ms/pass\n",
               round, per[0][round], per[1][round]);
    }
    int nr = b.rounds < 64 ? b.rounds : 64;
    double m0 = median(per[0], nr), m1 = median(per[1], nr);
    printf("median: create+destroy %.3f ms/pass, rebound %.3f ms/pass, saving %.3f ms/pass "
           "(%.1f%%)\n",
           m0, m1, m0 - m1, 100.0 * (m0 - m1) / m0);
    free(b.hubs);
    free(b.t);
    return 0;
}
