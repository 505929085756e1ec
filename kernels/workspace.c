/* Workspace buffers kept between kernel calls.
 *
 * A forward or backward call packs its operands into a workspace that is as
 * large as its inputs. Allocating that afresh on every call costs a page fault
 * and a page clear per 4 KiB (measured at 10-15% of a backward pass), so
 * released buffers go back into a small cache and the next call of a similar
 * size reuses them. The cache is bounded (entries and bytes) and freed at
 * exit. */
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

__attribute__((destructor)) static void stria__ws_release_all(void)
{
    pthread_mutex_lock(&stria__ws_lock);
    for (int i = 0; i < STRIA__WS_SLOTS; i++) {
        free(stria__ws_cache[i].ptr);
        memset(&stria__ws_cache[i], 0, sizeof(stria__ws_cache[i]));
    }
    pthread_mutex_unlock(&stria__ws_lock);
}
