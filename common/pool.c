#include "stria_pool.h"
#include "stria_log.h"

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

struct stria_pool {
    int n_threads; /* including the calling thread */
    pthread_t *workers;
    pthread_mutex_t run_lock; /* serialises stria_pool_run() callers */
    pthread_mutex_t lock;
    pthread_cond_t start_cv;
    pthread_cond_t done_cv;
    uint64_t generation;
    int busy_workers;
    int stop;
    stria_pool_task_cb fn;
    void *ctx;
    size_t n_tasks;
    size_t next_task; /* atomic */
};

typedef struct {
    stria_pool_t *pool;
    int index;
} stria__worker_arg_t;

static void stria__pool_drain(stria_pool_t *pool, int thread)
{
    for (;;) {
        size_t task = __atomic_fetch_add(&pool->next_task, 1, __ATOMIC_RELAXED);
        if (task >= pool->n_tasks)
            break;
        pool->fn(pool->ctx, task, thread);
    }
}

static void *stria__pool_worker(void *arg)
{
    stria__worker_arg_t *wa = arg;
    stria_pool_t *pool = wa->pool;
    int index = wa->index;
    uint64_t seen = 0;

    free(wa);
    for (;;) {
        pthread_mutex_lock(&pool->lock);
        while (!pool->stop && pool->generation == seen)
            pthread_cond_wait(&pool->start_cv, &pool->lock);
        if (pool->stop) {
            pthread_mutex_unlock(&pool->lock);
            return NULL;
        }
        seen = pool->generation;
        pthread_mutex_unlock(&pool->lock);

        stria__pool_drain(pool, index);

        pthread_mutex_lock(&pool->lock);
        if (--pool->busy_workers == 0)
            pthread_cond_signal(&pool->done_cv);
        pthread_mutex_unlock(&pool->lock);
    }
}

static int stria__default_threads(void)
{
    const char *env = getenv("STRIA_THREADS");
    if (env != NULL) {
        char *end = NULL;
        long v = strtol(env, &end, 10);
        if (end != env && *end == '\0' && v > 0 && v <= 1024)
            return (int)v;
        stria_log_warn("ignoring STRIA_THREADS='%s' (expected an integer in 1..1024)", env);
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

stria_status_t stria_pool_create(int n_threads, stria_pool_t **pool_out)
{
    stria_pool_t *pool;
    int started = 0;

    if (pool_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_pool_create: pool_out is NULL");
    if (n_threads < 0 || n_threads > 1024)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "thread count %d out of range (0 = all CPUs, at most 1024)",
                               n_threads);
    if (n_threads == 0)
        n_threads = stria__default_threads();

    pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate thread pool");
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->start_cv, NULL);
    pthread_cond_init(&pool->done_cv, NULL);
    if (n_threads > 1) {
        pool->workers = calloc((size_t)n_threads - 1, sizeof(pthread_t));
        if (pool->workers == NULL)
            goto err_free_pool;
        for (; started < n_threads - 1; started++) {
            stria__worker_arg_t *wa = malloc(sizeof(*wa));
            if (wa == NULL)
                goto err_stop_workers;
            wa->pool = pool;
            wa->index = started + 1;
            if (pthread_create(&pool->workers[started], NULL, stria__pool_worker, wa) != 0) {
                free(wa);
                goto err_stop_workers;
            }
        }
    }
    *pool_out = pool;
    return STRIA_OK;

err_stop_workers:
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->start_cv);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < started; i++)
        pthread_join(pool->workers[i], NULL);
    free(pool->workers);
err_free_pool:
    free(pool);
    return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot start %d pool threads", n_threads - 1);
}

void stria_pool_destroy(stria_pool_t *pool)
{
    if (pool == NULL)
        return;
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->start_cv);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->n_threads - 1; i++)
        pthread_join(pool->workers[i], NULL);
    free(pool->workers);
    pthread_cond_destroy(&pool->start_cv);
    pthread_cond_destroy(&pool->done_cv);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool);
}

int stria_pool_size(const stria_pool_t *pool)
{
    return pool == NULL ? 1 : pool->n_threads;
}

void stria_pool_run(stria_pool_t *pool, size_t n_tasks, stria_pool_task_cb fn, void *ctx)
{
    if (n_tasks == 0)
        return;
    if (pool == NULL || pool->n_threads == 1 || n_tasks == 1) {
        for (size_t t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    pthread_mutex_lock(&pool->run_lock);
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_tasks = n_tasks;
    __atomic_store_n(&pool->next_task, 0, __ATOMIC_RELAXED);
    pool->busy_workers = pool->n_threads - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->start_cv);
    pthread_mutex_unlock(&pool->lock);

    stria__pool_drain(pool, 0);

    pthread_mutex_lock(&pool->lock);
    while (pool->busy_workers > 0)
        pthread_cond_wait(&pool->done_cv, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
    pthread_mutex_unlock(&pool->run_lock);
}
