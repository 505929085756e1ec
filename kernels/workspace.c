/* Workspace buffers kept between kernel calls, and the threads' scratch.
 *
 * A forward or backward call packs its operands into a workspace that is as
 * large as its inputs. Allocating that afresh on every call costs a page fault
 * and a page clear per 4 KiB (measured at 10-15% of a backward pass), so
 * released buffers go back into a small cache and the next call of a similar
 * size reuses them. The cache is bounded (entries and bytes) and freed at
 * exit.
 *
 * The tasks of a call's parallel loops also need scratch of their own (score
 * tiles, a task's dK/dV): a few hundred KiB a thread, whatever the shape.
 * That is the thread's: it would make a call's workspace grow with the pool
 * (and the admission of every job with the largest pool a worker may run),
 * so each thread keeps one buffer, grown to the largest asked for, and frees
 * it when it exits. */
#include "kernels_int.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define STRIA__WS_SLOTS     4
#define STRIA__WS_MAX_BYTES ((size_t)1 << 30) /* bytes kept while idle */
#define STRIA__WS_HUGE      ((size_t)2 << 20) /* huge page size and alignment */

static pthread_mutex_t stria__ws_lock = PTHREAD_MUTEX_INITIALIZER;
static stria__ws_t stria__ws_cache[STRIA__WS_SLOTS];

static size_t stria__ws_cached_bytes(void)
{
    size_t total = 0;
    for (int i = 0; i < STRIA__WS_SLOTS; i++)
        total += stria__ws_cache[i].size;
    return total;
}

bool stria__ws_get(const stria_allocator_t *mem, size_t size, stria__ws_t *ws)
{
    int best = -1;
    void *ptr = NULL;

    memset(ws, 0, sizeof(*ws));
    if (mem != NULL && mem->alloc != NULL) { /* the caller's memory: no cache */
        if ((ws->ptr = mem->alloc(mem->ctx, size)) == NULL)
            return false;
        ws->size = size;
        ws->mem = *mem;
        return true;
    }

    pthread_mutex_lock(&stria__ws_lock);
    for (int i = 0; i < STRIA__WS_SLOTS; i++)
        if (stria__ws_cache[i].ptr != NULL && stria__ws_cache[i].size >= size &&
            (best < 0 || stria__ws_cache[i].size < stria__ws_cache[best].size))
            best = i;
    if (best >= 0) {
        *ws = stria__ws_cache[best];
        memset(&stria__ws_cache[best], 0, sizeof(stria__ws_cache[best]));
        pthread_mutex_unlock(&stria__ws_lock);
        return true;
    }
    pthread_mutex_unlock(&stria__ws_lock);

    /* Large buffers: 2 MiB aligned and marked for transparent huge pages,
     * which cuts TLB misses of the packed tiles and the number of faults. */
    if (size >= STRIA__WS_HUGE) {
        size = (size + STRIA__WS_HUGE - 1) & ~(STRIA__WS_HUGE - 1);
        if (posix_memalign(&ptr, STRIA__WS_HUGE, size) != 0)
            return false;
        (void)madvise(ptr, size, MADV_HUGEPAGE); /* advisory: ignore failure */
    } else {
        size = (size + 63) & ~(size_t)63;
        if (posix_memalign(&ptr, 64, size) != 0)
            return false;
    }
    ws->ptr = ptr;
    ws->size = size;
    return true;
}

void stria__ws_put(stria__ws_t *ws)
{
    int slot = -1;

    if (ws->ptr == NULL)
        return;
    if (ws->mem.alloc != NULL) {
        ws->mem.free(ws->mem.ctx, ws->ptr);
        memset(ws, 0, sizeof(*ws));
        return;
    }
    pthread_mutex_lock(&stria__ws_lock);
    for (int i = 0; i < STRIA__WS_SLOTS && slot < 0; i++)
        if (stria__ws_cache[i].ptr == NULL)
            slot = i;
    if (slot < 0) { /* full: evict the smallest if this one is larger */
        slot = 0;
        for (int i = 1; i < STRIA__WS_SLOTS; i++)
            if (stria__ws_cache[i].size < stria__ws_cache[slot].size)
                slot = i;
        if (stria__ws_cache[slot].size >= ws->size) {
            slot = -1;
        } else {
            free(stria__ws_cache[slot].ptr);
            memset(&stria__ws_cache[slot], 0, sizeof(stria__ws_cache[slot]));
        }
    }
    if (slot >= 0 && stria__ws_cached_bytes() + ws->size <= STRIA__WS_MAX_BYTES) {
        stria__ws_cache[slot] = *ws;
        ws->ptr = NULL;
    }
    pthread_mutex_unlock(&stria__ws_lock);
    free(ws->ptr);
    ws->ptr = NULL;
    ws->size = 0;
}

/* The calling thread's scratch; the key frees it when the thread exits. */
static _Thread_local void *stria__scratch_ptr;
static _Thread_local size_t stria__scratch_size;
static pthread_key_t stria__scratch_key;
static pthread_once_t stria__scratch_once = PTHREAD_ONCE_INIT;
static bool stria__scratch_key_ok;

static void stria__scratch_key_make(void)
{
    stria__scratch_key_ok = pthread_key_create(&stria__scratch_key, free) == 0;
}

float *stria__thread_scratch(size_t floats)
{
    size_t bytes = (floats * sizeof(float) + 63) & ~(size_t)63;
    void *ptr = NULL;

    if (stria__scratch_size >= bytes && stria__scratch_ptr != NULL)
        return stria__scratch_ptr;
    pthread_once(&stria__scratch_once, stria__scratch_key_make);
    if (!stria__scratch_key_ok || posix_memalign(&ptr, 64, bytes > 0 ? bytes : 64) != 0)
        return NULL;
    if (pthread_setspecific(stria__scratch_key, ptr) != 0) {
        free(ptr);
        return NULL;
    }
    free(stria__scratch_ptr);
    stria__scratch_ptr = ptr;
    stria__scratch_size = bytes;
    return ptr;
}

/* At exit: the exiting thread's scratch (thread exits free the others'). */
static void stria__scratch_release(void)
{
    if (stria__scratch_key_ok)
        (void)pthread_setspecific(stria__scratch_key, NULL);
    free(stria__scratch_ptr);
    stria__scratch_ptr = NULL;
    stria__scratch_size = 0;
}

__attribute__((destructor)) static void stria__ws_release_all(void)
{
    stria__scratch_release();
    pthread_mutex_lock(&stria__ws_lock);
    for (int i = 0; i < STRIA__WS_SLOTS; i++) {
        free(stria__ws_cache[i].ptr);
        memset(&stria__ws_cache[i], 0, sizeof(stria__ws_cache[i]));
    }
    pthread_mutex_unlock(&stria__ws_lock);
}
