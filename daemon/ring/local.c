/*
 * stria_ring_run_local(): the whole ring in one process, one thread per rank
 * over the in-process link. Used by stria-run, the tests and the benchmark.
 */
#include "ring_int.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STRIA__LOCAL_MAX_RANKS 256

typedef struct {
    stria_status_t st;
    char msg[1024];
    double fwd_t0, fwd_t1, bwd_t0, bwd_t1;
} stria__rank_result_t;

/* A barrier whose party count can shrink (when a rank thread cannot be
 * started, the started ones must still get through). */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cv;
    int parties, waiting;
    uint64_t generation;
} stria__barrier_t;

static void stria__barrier_release_locked(stria__barrier_t *b)
{
    b->waiting = 0;
    b->generation++;
    pthread_cond_broadcast(&b->cv);
}

static void stria__barrier_wait(stria__barrier_t *b)
{
    pthread_mutex_lock(&b->lock);
    uint64_t gen = b->generation;
    if (++b->waiting >= b->parties) {
        stria__barrier_release_locked(b);
    } else {
        while (gen == b->generation)
            pthread_cond_wait(&b->cv, &b->lock);
    }
    pthread_mutex_unlock(&b->lock);
}

static void stria__barrier_shrink(stria__barrier_t *b, int parties)
{
    pthread_mutex_lock(&b->lock);
    b->parties = parties;
    if (b->waiting > 0 && b->waiting >= b->parties)
        stria__barrier_release_locked(b);
    pthread_mutex_unlock(&b->lock);
}

typedef struct {
    const stria_ring_shape_t *shape;
    const stria_ring_local_opts_t *opts;
    const stria_ring_local_io_t *io;
    stria_layout_t layout;
    stria_docplan_t *plan; /* packed: the layout's plan */
    stria_inproc_hub_t *hub;
    stria__barrier_t barrier;
    int failed; /* atomic: some rank failed, the others skip what follows */
    stria__rank_result_t *res;
    pthread_mutex_t work_lock; /* serialize_compute: held by the rank at work */
    stria_ring_local_stats_t *stats;
    bool staged; /* the ranks' device memory is not host memory */
} stria__local_t;

typedef struct {
    stria__local_t *run;
    int rank;
} stria__rank_arg_t;

/* One rank's shards (in host memory, or their copies in device memory). */
typedef struct {
    void *q, *k, *v, *o, *d_o, *dq, *dk, *dv;
    float *lse;
} stria__shards_t;

/* The tensors of a shard set in one order, with their sizes in bytes. */
enum { STRIA__N_SHARDS = 9 };

static void stria__shards_list(stria__shards_t *s, void ***out)
{
    void **all[STRIA__N_SHARDS] = {&s->q,  &s->k,  &s->v,  &s->o,           &s->d_o,
                                   &s->dq, &s->dk, &s->dv, (void **)&s->lse};
    memcpy(out, all, sizeof(all));
}

static void stria__shards_sizes(const stria__local_t *run, size_t *bytes)
{
    const stria_ring_shape_t *sh = run->shape;
    int64_t B = sh->call.batch, L = run->layout.shard_tokens;
    size_t qn = (size_t)(B * L * sh->heads * sh->head_dim);
    size_t kn = (size_t)(B * L * sh->kv_heads * sh->head_dim);
    size_t es = stria_dtype_size(sh->dtype), gs = stria_dtype_size(run->io->grad_dtype);
    size_t all[STRIA__N_SHARDS] = {
        qn * es, kn * es, kn * es, qn * stria_dtype_size(run->io->o_dtype),    qn * es,
        qn * gs, kn * gs, kn * gs, (size_t)(B * sh->heads * L) * sizeof(float)};
    memcpy(bytes, all, sizeof(all));
}

static void stria__shards_free(stria__shards_t *s)
{
    void *all[] = {s->q, s->k, s->v, s->o, s->d_o, s->dq, s->dk, s->dv, s->lse};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        stria_free(all[i]);
    memset(s, 0, sizeof(*s));
}

static void stria__dev_shards_free(stria_device_t *dev, stria__shards_t *d)
{
    void **all[STRIA__N_SHARDS];
    stria__shards_list(d, all);
    for (size_t i = 0; i < STRIA__N_SHARDS; i++)
        stria_device_free(dev, *all[i]);
    memset(d, 0, sizeof(*d));
}

/* Device copies of a rank's host shards (those that exist): the inputs are
 * uploaded, the outputs are downloaded by stria__dev_shards_download(). */
static stria_status_t stria__dev_shards_upload(const stria__local_t *run, stria_device_t *dev,
                                               stria__shards_t *h, stria__shards_t *d)
{
    void **hs[STRIA__N_SHARDS], **ds[STRIA__N_SHARDS];
    size_t bytes[STRIA__N_SHARDS];
    stria_status_t st = STRIA_OK;
    memset(d, 0, sizeof(*d));
    stria__shards_list(h, hs);
    stria__shards_list(d, ds);
    stria__shards_sizes(run, bytes);
    for (size_t i = 0; i < STRIA__N_SHARDS && st == STRIA_OK; i++) {
        if (*hs[i] == NULL)
            continue;
        if ((st = stria_device_alloc(dev, bytes[i], ds[i])) == STRIA_OK)
            st = stria_device_copy(dev, STRIA_STREAM_COPY, *ds[i], *hs[i], bytes[i]);
    }
    if (st == STRIA_OK)
        st = stria_device_sync(dev, STRIA_STREAM_COPY);
    return st;
}

static stria_status_t stria__dev_shards_download(const stria__local_t *run, stria_device_t *dev,
                                                 const stria__shards_t *d, stria__shards_t *h,
                                                 bool fwd, bool bwd)
{
    stria_status_t st = STRIA_OK;
    void **hs[STRIA__N_SHARDS], **ds[STRIA__N_SHARDS];
    size_t bytes[STRIA__N_SHARDS];
    stria__shards_list(h, hs);
    stria__shards_list((stria__shards_t *)d, ds);
    stria__shards_sizes(run, bytes);
    for (size_t i = 0; i < STRIA__N_SHARDS && st == STRIA_OK; i++) {
        bool out = (fwd && (i == 3 || i == 8)) || (bwd && i >= 5 && i <= 7);
        if (out)
            st = stria_device_copy(dev, STRIA_STREAM_COPY, *hs[i], *ds[i], bytes[i]);
    }
    if (st == STRIA_OK)
        st = stria_device_sync(dev, STRIA_STREAM_COPY);
    return st;
}

static stria_status_t stria__shards_alloc(const stria__local_t *run, int rank, bool bwd,
                                          stria__shards_t *s)
{
    const stria_ring_shape_t *sh = run->shape;
    const stria_ring_local_io_t *io = run->io;
    const stria_layout_t *l = &run->layout;
    int64_t B = sh->call.batch, L = l->shard_tokens;
    size_t qn = (size_t)(B * L * sh->heads * sh->head_dim);
    size_t kn = (size_t)(B * L * sh->kv_heads * sh->head_dim);
    size_t es = stria_dtype_size(sh->dtype);
    size_t qrow = (size_t)(sh->heads * sh->head_dim) * es;
    size_t krow = (size_t)(sh->kv_heads * sh->head_dim) * es;
    size_t orow = (size_t)(sh->heads * sh->head_dim) * stria_dtype_size(io->o_dtype);
    size_t gs = stria_dtype_size(io->grad_dtype);
    bool run_fwd = (run->opts->passes & STRIA_RING_PASS_FWD) != 0;
    stria_status_t st;

    memset(s, 0, sizeof(*s));
    s->q = stria_malloc_aligned(qn * es);
    s->k = stria_malloc_aligned(kn * es);
    s->v = stria_malloc_aligned(kn * es);
    s->o = stria_malloc_aligned(qn * stria_dtype_size(io->o_dtype));
    s->lse = stria_malloc_aligned((size_t)(B * sh->heads * L) * sizeof(float));
    if (s->q == NULL || s->k == NULL || s->v == NULL || s->o == NULL || s->lse == NULL)
        goto nomem;
    if (bwd) {
        s->d_o = stria_malloc_aligned(qn * es);
        s->dq = stria_malloc_aligned(qn * gs);
        s->dk = stria_malloc_aligned(kn * gs);
        s->dv = stria_malloc_aligned(kn * gs);
        if (s->d_o == NULL || s->dq == NULL || s->dk == NULL || s->dv == NULL)
            goto nomem;
    }
    if ((st = stria_layout_scatter(l, rank, B, qrow, io->q, s->q)) != STRIA_OK ||
        (st = stria_layout_scatter(l, rank, B, krow, io->k, s->k)) != STRIA_OK ||
        (st = stria_layout_scatter(l, rank, B, krow, io->v, s->v)) != STRIA_OK)
        return st;
    if (bwd && (st = stria_layout_scatter(l, rank, B, qrow, io->d_o, s->d_o)) != STRIA_OK)
        return st;
    if (bwd && !run_fwd &&
        ((st = stria_layout_scatter(l, rank, B, orow, io->o, s->o)) != STRIA_OK ||
         (st = stria_layout_scatter(l, rank, B * sh->heads, sizeof(float), io->lse, s->lse)) !=
             STRIA_OK))
        return st;
    return STRIA_OK;
nomem:
    return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate the shards of rank %d", rank);
}

static void stria__local_rank_fail(stria__local_t *run, int rank, stria_status_t st)
{
    stria__rank_result_t *res = &run->res[rank];
    if (res->st == STRIA_OK) {
        res->st = st;
        snprintf(res->msg, sizeof(res->msg), "%s",
                 stria_error_msg()[0] != '\0' ? stria_error_msg() : stria_status_str(st));
    }
    __atomic_store_n(&run->failed, 1, __ATOMIC_RELEASE);
}

/* Every rank passes every barrier, failed or not, so that all ranks take the
 * same decision about the next phase. */
static bool stria__phase_ok(stria__local_t *run)
{
    stria__barrier_wait(&run->barrier);
    return __atomic_load_n(&run->failed, __ATOMIC_ACQUIRE) == 0;
}

static void stria__copy_stats(int rank, const stria_ring_pass_t *pass, stria_ring_step_stats_t *dst)
{
    size_t n = 0;
    const stria_ring_step_stats_t *src = stria_ring_pass_stats(pass, &n);
    if (dst != NULL && src != NULL)
        memcpy(dst + (size_t)rank * n, src, n * sizeof(*src));
}

static void stria__work_lock_cb(void *ctx)
{
    pthread_mutex_lock(&((stria__local_t *)ctx)->work_lock);
}

static void stria__work_unlock_cb(void *ctx)
{
    pthread_mutex_unlock(&((stria__local_t *)ctx)->work_lock);
}

/* serialize_compute: a rank works on a pass holding the run's lock (its
 * pass lets it go around link waits) */
static void stria__work_begin(stria__local_t *run)
{
    if (run->opts->serialize_compute)
        stria__work_lock_cb(run);
}

static void stria__work_end(stria__local_t *run)
{
    if (run->opts->serialize_compute)
        stria__work_unlock_cb(run);
}

static void *stria__rank_main(void *arg)
{
    stria__rank_arg_t *ra = arg;
    stria__local_t *run = ra->run;
    const int rank = ra->rank;
    const stria_ring_shape_t *sh = run->shape;
    const stria_ring_local_io_t *io = run->io;
    const stria_layout_t *l = &run->layout;
    const bool do_fwd = (run->opts->passes & STRIA_RING_PASS_FWD) != 0;
    const bool do_bwd = (run->opts->passes & STRIA_RING_PASS_BWD) != 0;
    const int64_t B = sh->call.batch, L = l->shard_tokens, H = sh->heads, Hkv = sh->kv_heads;
    const int64_t D = sh->head_dim;
    stria_link_t *link = NULL;
    stria_pool_t *pool = NULL;
    stria_device_t *dev = NULL;
    stria_ring_pass_t *pass = NULL;
    stria__shards_t s, ds, *t = &s; /* t: the shards the passes use */
    stria_status_t st;

    memset(&s, 0, sizeof(s));
    memset(&ds, 0, sizeof(ds));
    st = stria_inproc_link_create(run->hub, rank, &link);
    if (st == STRIA_OK && run->opts->threads_per_rank > 1)
        st = stria_pool_create(run->opts->threads_per_rank, &pool);
    if (st == STRIA_OK)
        st = stria_device_open(run->opts->device != NULL ? run->opts->device : "cpu", pool, &dev);
    if (st == STRIA_OK) {
        stria_ring_opts_t po;
        memset(&po, 0, sizeof(po));
        po.step_timeout_s = run->opts->step_timeout_s;
        po.no_step_times = run->opts->no_step_times;
        po.pool = pool;
        po.device = dev;
        po.all_hops = run->opts->all_hops;
        if (run->opts->serialize_compute) { /* released while waiting */
            po.wait_begin_cb = stria__work_unlock_cb;
            po.wait_end_cb = stria__work_lock_cb;
            po.wait_cb_ctx = run;
        }
        st = stria_ring_pass_create(link, sh, l->kind, &po, &pass);
    }
    if (st == STRIA_OK)
        st = stria__shards_alloc(run, rank, do_bwd, &s);
    /* staged is the run's, not the rank's: every rank passes the same
     * barriers */
    if (run->staged)
        t = &ds;
    if (st == STRIA_OK && run->staged)
        st = stria__dev_shards_upload(run, dev, &s, &ds);
    if (st != STRIA_OK)
        stria__local_rank_fail(run, rank, stria_error_wrap(st, "rank %d", rank));

    stria_tensor_t tq = stria_tensor_contiguous(t->q, sh->dtype, L, H, D);
    stria_tensor_t tk = stria_tensor_contiguous(t->k, sh->dtype, L, Hkv, D);
    stria_tensor_t tv = stria_tensor_contiguous(t->v, sh->dtype, L, Hkv, D);
    stria_tensor_t to = stria_tensor_contiguous(t->o, io->o_dtype, L, H, D);

    if (stria__phase_ok(run) && do_fwd) {
        run->res[rank].fwd_t0 = stria_time_now();
        stria__work_begin(run);
        st = stria_ring_fwd(pass, &tq, &tk, &tv, &to, t->lse);
        stria__work_end(run);
        run->res[rank].fwd_t1 = stria_time_now();
        stria__copy_stats(rank, pass, run->stats ? run->stats->fwd_steps : NULL);
        if (st != STRIA_OK)
            stria__local_rank_fail(run, rank, st);
    }
    if (stria__phase_ok(run) && do_bwd) {
        stria_tensor_t tg = stria_tensor_contiguous(t->d_o, sh->dtype, L, H, D);
        stria_tensor_t tdq = stria_tensor_contiguous(t->dq, io->grad_dtype, L, H, D);
        stria_tensor_t tdk = stria_tensor_contiguous(t->dk, io->grad_dtype, L, Hkv, D);
        stria_tensor_t tdv = stria_tensor_contiguous(t->dv, io->grad_dtype, L, Hkv, D);
        run->res[rank].bwd_t0 = stria_time_now();
        stria__work_begin(run);
        st = stria_ring_bwd(pass, &tq, &tk, &tv, &to, t->lse, &tg, &tdq, &tdk, &tdv);
        stria__work_end(run);
        run->res[rank].bwd_t1 = stria_time_now();
        stria__copy_stats(rank, pass, run->stats ? run->stats->bwd_steps : NULL);
        if (st != STRIA_OK)
            stria__local_rank_fail(run, rank, st);
    }
    if (run->staged && stria__phase_ok(run) &&
        (st = stria__dev_shards_download(run, dev, &ds, &s, do_fwd, do_bwd)) != STRIA_OK)
        stria__local_rank_fail(run, rank, stria_error_wrap(st, "rank %d", rank));
    if (stria__phase_ok(run)) {
        size_t orow = (size_t)(H * D) * stria_dtype_size(io->o_dtype);
        size_t gq = (size_t)(H * D) * stria_dtype_size(io->grad_dtype);
        size_t gk = (size_t)(Hkv * D) * stria_dtype_size(io->grad_dtype);
        /* Ranks gather disjoint rows of the full outputs. */
        if (do_fwd) {
            stria_layout_gather(l, rank, B, orow, s.o, io->o);
            stria_layout_gather(l, rank, B * H, sizeof(float), s.lse, io->lse);
        }
        if (do_bwd) {
            stria_layout_gather(l, rank, B, gq, s.dq, io->dq);
            stria_layout_gather(l, rank, B, gk, s.dk, io->dk);
            stria_layout_gather(l, rank, B, gk, s.dv, io->dv);
        }
    }
    stria__dev_shards_free(dev, &ds);
    stria__shards_free(&s);
    stria_ring_pass_destroy(pass);
    stria_device_close(dev);
    stria_pool_destroy(pool);
    stria_link_destroy(link);
    return NULL;
}

static stria_status_t stria__check_local(const stria_ring_shape_t *shape,
                                         const stria_ring_local_opts_t *opts,
                                         const stria_ring_local_io_t *io)
{
    static const char fn[] = "stria_ring_run_local";
    if (shape == NULL || opts == NULL || io == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: NULL argument", fn);
    if (opts->n_ranks < 1 || opts->n_ranks > STRIA__LOCAL_MAX_RANKS)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: %d ranks (must be 1..%d)", fn,
                               opts->n_ranks, STRIA__LOCAL_MAX_RANKS);
    if (opts->passes != STRIA_RING_PASS_FWD && opts->passes != STRIA_RING_PASS_BWD &&
        opts->passes != STRIA_RING_PASS_FWD_BWD)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: unknown passes %d", fn,
                               (int)opts->passes);
    if (opts->threads_per_rank < 0 || opts->threads_per_rank > 1024)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: threads_per_rank %d (0..1024)", fn,
                               opts->threads_per_rank);
    if (io->q == NULL || io->k == NULL || io->v == NULL || io->o == NULL || io->lse == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: q, k, v, o and lse are required", fn);
    if (stria_dtype_size(io->o_dtype) == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: unknown o_dtype %d", fn,
                               (int)io->o_dtype);
    if ((opts->passes & STRIA_RING_PASS_BWD) != 0) {
        if (io->d_o == NULL || io->dq == NULL || io->dk == NULL || io->dv == NULL)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "%s: the backward pass needs d_o, dq, dk and dv", fn);
        if (stria_dtype_size(io->grad_dtype) == 0)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: unknown grad_dtype %d", fn,
                                   (int)io->grad_dtype);
    }
    return STRIA_OK;
}

stria_status_t stria_ring_run_local(const stria_ring_shape_t *shape,
                                    const stria_ring_local_opts_t *opts,
                                    const stria_ring_local_io_t *io,
                                    stria_ring_local_stats_t *stats)
{
    stria__local_t run = {.shape = shape, .opts = opts, .io = io, .stats = stats};
    stria__rank_arg_t *args = NULL;
    pthread_t *threads = NULL;
    stria_status_t st;
    int n, started = 0;

    if ((st = stria__check_local(shape, opts, io)) != STRIA_OK)
        return st;
    n = opts->n_ranks;
    if ((st = stria_docplan_layout(opts->layout, &shape->call, n, &run.layout, &run.plan)) !=
        STRIA_OK)
        return st;
    /* Shape errors are reported once here rather than by every rank. */
    {
        stria_inproc_hub_t *probe_hub = NULL;
        stria_link_t *probe = NULL;
        stria_ring_pass_t *pass = NULL;
        stria_device_t *dev = NULL;
        if ((st = stria_inproc_hub_create(1, &probe_hub)) == STRIA_OK &&
            (st = stria_inproc_link_create(probe_hub, 0, &probe)) == STRIA_OK)
            st = stria_ring_pass_create(probe, shape, opts->layout, NULL, &pass);
        /* and a bad device name once, before any rank opens it */
        if (st == STRIA_OK)
            st = stria_device_open(opts->device != NULL ? opts->device : "cpu", NULL, &dev);
        if (st == STRIA_OK)
            run.staged = !stria_device_host_visible(dev);
        stria_device_close(dev);
        stria_ring_pass_destroy(pass);
        stria_link_destroy(probe);
        stria_inproc_hub_release(probe_hub);
        if (st != STRIA_OK) {
            stria_docplan_unref(run.plan);
            return st;
        }
    }
    if ((st = stria_inproc_hub_create(n, &run.hub)) != STRIA_OK) {
        stria_docplan_unref(run.plan);
        return st;
    }
    run.res = calloc((size_t)n, sizeof(*run.res));
    args = calloc((size_t)n, sizeof(*args));
    threads = calloc((size_t)n, sizeof(*threads));
    if (run.res == NULL || args == NULL || threads == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "stria_ring_run_local: out of memory");
        goto out_free;
    }
    pthread_mutex_init(&run.work_lock, NULL);
    pthread_mutex_init(&run.barrier.lock, NULL);
    pthread_cond_init(&run.barrier.cv, NULL);
    run.barrier.parties = n;
    for (; started < n; started++) {
        args[started].run = &run;
        args[started].rank = started;
        if (pthread_create(&threads[started], NULL, stria__rank_main, &args[started]) != 0)
            break;
    }
    if (started < n) {
        /* The started ranks fail at their first link operation once the hub
         * is aborted; the barrier lets them through without the others. */
        run.res[started].st = STRIA_ERR_NO_MEMORY;
        snprintf(run.res[started].msg, sizeof(run.res[started].msg),
                 "rank %d: cannot start its thread", started);
        __atomic_store_n(&run.failed, 1, __ATOMIC_RELEASE);
        stria__barrier_shrink(&run.barrier, started);
    }
    for (int i = 0; i < started; i++)
        pthread_join(threads[i], NULL);
    pthread_cond_destroy(&run.barrier.cv);
    pthread_mutex_destroy(&run.barrier.lock);
    pthread_mutex_destroy(&run.work_lock);

    /* Report where the failure started: the rank whose abort ended the pass
     * (the others report its status too, see stria_link_abort()), else the
     * first rank whose error is its own rather than a peer's. */
    st = STRIA_OK;
    int culprit = stria_inproc_hub_aborted_by(run.hub);
    if (culprit >= 0 && (culprit >= n || run.res[culprit].st == STRIA_OK))
        culprit = -1;
    for (int i = 0; i < n && culprit < 0; i++)
        if (run.res[i].st != STRIA_OK && run.res[i].st != STRIA_ERR_PEER)
            culprit = i;
    for (int i = 0; i < n && culprit < 0; i++)
        if (run.res[i].st != STRIA_OK)
            culprit = i;
    if (culprit >= 0) {
        st = stria_error_set(run.res[culprit].st, "%s", run.res[culprit].msg);
    } else if (stats != NULL) {
        double f0 = 0, f1 = 0, b0 = 0, b1 = 0;
        for (int i = 0; i < n; i++) {
            const stria__rank_result_t *r = &run.res[i];
            f0 = i == 0 || r->fwd_t0 < f0 ? r->fwd_t0 : f0;
            f1 = r->fwd_t1 > f1 ? r->fwd_t1 : f1;
            b0 = i == 0 || r->bwd_t0 < b0 ? r->bwd_t0 : b0;
            b1 = r->bwd_t1 > b1 ? r->bwd_t1 : b1;
        }
        stats->fwd_wall_s = (opts->passes & STRIA_RING_PASS_FWD) ? f1 - f0 : 0.0;
        stats->bwd_wall_s = (opts->passes & STRIA_RING_PASS_BWD) ? b1 - b0 : 0.0;
    }
out_free:
    free(threads);
    free(args);
    free(run.res);
    stria_inproc_hub_release(run.hub);
    stria_docplan_unref(run.plan);
    return st;
}
