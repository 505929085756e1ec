/*
 * stria pool: a thread pool for parallel loops (the CPU kernels).
 *
 * Ownership: a pool owns its worker threads, started by stria_pool_create()
 * and joined by stria_pool_destroy(), which must not overlap a
 * stria_pool_run() on the same pool; ctx belongs to the caller.
 * Threads: stria_pool_run() may be called from any thread. It runs tasks on
 * the workers and on the caller (thread 0) at once, so fn must be safe to
 * run concurrently for different tasks.
 */
#ifndef STRIA_POOL_H
#define STRIA_POOL_H

#include <stddef.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct stria_pool stria_pool_t;

/* A task of a parallel loop: `task` in [0, n_tasks), `thread` in
 * [0, stria_pool_size(pool)) identifies the executing thread (for per-thread
 * scratch). */
typedef void (*stria_pool_task_cb)(void *ctx, size_t task, int thread);

/* Creates a pool of `n_threads` threads including the caller (so n_threads - 1
 * workers are started); 0 means the number of online CPUs. STRIA_THREADS in
 * the environment overrides 0. Free with stria_pool_destroy(). */
stria_status_t stria_pool_create(int n_threads, stria_pool_t **pool_out);
void stria_pool_destroy(stria_pool_t *pool);
/* Threads of the pool (including the caller); 1 for a NULL pool. */
int stria_pool_size(const stria_pool_t *pool);
/* Runs fn for every task and returns when all are done. Tasks are handed out
 * dynamically in increasing index order. A NULL pool runs them on the caller.
 * Concurrent calls on one pool are serialised. */
void stria_pool_run(stria_pool_t *pool, size_t n_tasks, stria_pool_task_cb fn, void *ctx);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_POOL_H */
