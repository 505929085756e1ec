/* Threads kept for the next work: a session's pass thread and an
 * assignment's fetch run on a thread that earlier work left idle, if one
 * waits. A new thread costs a clone and faults its stack's pages again
 * (glibc gives a cached stack's pages back when a thread ends), a few
 * pages every job; a kept one costs neither. At most STRIA__THREADS_IDLE
 * wait, each STRIA__THREAD_IDLE_S at most. */
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "worker_int.h"

struct stria__wthr {
    struct stria__wthr *next; /* the idle list */
    stria_worker_t *w;
    void *(*fn)(void *);
    void *arg;
    pthread_cond_t cv; /* work for this idle thread, or the stop */
};

/* Waits for the next work as an idle thread (w->thr_lock held); false
 * when there is none to wait for (too many idle, the stop, or idle too
 * long): the thread ends. */
static bool next_work(stria_worker_t *w, stria__wthr_t *t)
{
    if (w->thr_stop || w->n_idle >= STRIA__THREADS_IDLE)
        return false;
    t->next = w->idle;
    w->idle = t;
    w->n_idle++;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)STRIA__THREAD_IDLE_S;
    int rc = 0;
    while (t->fn == NULL && !w->thr_stop && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&t->cv, &w->thr_lock, &until);
    if (t->fn != NULL) /* taken off the idle list by stria__wthr_run() */
        return true;
    stria__wthr_t **pp = &w->idle;
    while (*pp != t)
        pp = &(*pp)->next;
    *pp = t->next;
    w->n_idle--;
    return false;
}

static void *thread_main(void *arg)
{
    stria__wthr_t *t = arg;
    stria_worker_t *w = t->w;
    for (;;) {
        t->fn(t->arg);
        pthread_mutex_lock(&w->thr_lock);
        t->fn = NULL;
        t->arg = NULL;
        if (!next_work(w, t))
            break;
        pthread_mutex_unlock(&w->thr_lock);
    }
    w->n_threads--; /* the last this thread touches of the worker */
    pthread_cond_broadcast(&w->thr_cv);
    pthread_mutex_unlock(&w->thr_lock);
    pthread_cond_destroy(&t->cv);
    free(t);
    return NULL;
}

stria_status_t stria__wthr_run(stria_worker_t *w, void *(*fn)(void *), void *arg)
{
    pthread_mutex_lock(&w->thr_lock);
    if (w->thr_stop) {
        pthread_mutex_unlock(&w->thr_lock);
        return stria_error_set(STRIA_ERR_CANCELLED, "the worker stops");
    }
    stria__wthr_t *t = w->idle;
    if (t != NULL) {
        w->idle = t->next;
        w->n_idle--;
        t->fn = fn;
        t->arg = arg;
        pthread_cond_signal(&t->cv);
        pthread_mutex_unlock(&w->thr_lock);
        return STRIA_OK;
    }
    w->n_threads++;
    pthread_mutex_unlock(&w->thr_lock);
    t = calloc(1, sizeof(*t));
    int rc = -1;
    if (t != NULL) {
        *t = (stria__wthr_t){.w = w, .fn = fn, .arg = arg};
        pthread_cond_init(&t->cv, NULL);
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        rc = pthread_create(&th, &attr, thread_main, t);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            pthread_cond_destroy(&t->cv);
    }
    if (rc == 0)
        return STRIA_OK;
    free(t);
    pthread_mutex_lock(&w->thr_lock);
    w->n_threads--;
    pthread_cond_broadcast(&w->thr_cv);
    pthread_mutex_unlock(&w->thr_lock);
    return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot start a thread");
}

void stria__wthr_init(stria_worker_t *w)
{
    pthread_mutex_init(&w->thr_lock, NULL);
    pthread_cond_init(&w->thr_cv, NULL);
}

void stria__wthr_stop(stria_worker_t *w)
{
    pthread_mutex_lock(&w->thr_lock);
    w->thr_stop = true;
    for (stria__wthr_t *t = w->idle; t != NULL; t = t->next)
        pthread_cond_signal(&t->cv);
    while (w->n_threads > 0)
        pthread_cond_wait(&w->thr_cv, &w->thr_lock);
    pthread_mutex_unlock(&w->thr_lock);
    pthread_cond_destroy(&w->thr_cv);
    pthread_mutex_destroy(&w->thr_lock);
}
