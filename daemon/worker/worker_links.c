/* The link factories of the worker: UCX links on a context (the default,
 * on the worker's own) and in-process links for workers of one process. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker_int.h"

/* ---- UCX --------------------------------------------------------------------- */

static stria_status_t ucx_connect(void *ctx, const stria_worker_link_request_t *req,
                                  stria_link_t **link_out)
{
    char next_host[256];
    uint16_t next_port;
    stria_status_t st =
        stria_addr_parse(req->next_address, next_host, sizeof(next_host), &next_port);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "ring link address of rank %d", (req->rank + 1) % req->size);
    const stria_ucx_link_params_t rp = {.job_id = req->job_id,
                                        .ring_id = req->ring_id,
                                        .rank = req->rank,
                                        .size = req->size,
                                        .next_host = next_host,
                                        .next_port = next_port,
                                        .connect_timeout_s = req->connect_timeout_s,
                                        .key = req->key,
                                        .cancel = req->cancel};
    return stria_link_ucx_connect(ctx, &rp, link_out);
}

stria_worker_link_factory_t stria_worker_ucx_links(stria_ucx_ctx_t *ctx, const char *address)
{
    stria_worker_link_factory_t f = {ucx_connect, ctx, address};
    return f;
}

/* ---- in-process ---------------------------------------------------------------- */

/* A ring some of whose ranks have not connected yet. */
typedef struct inproc_ring {
    struct inproc_ring *next;
    uint64_t job_id;
    uint32_t ring_id;
    int size, joined;
    stria_inproc_hub_t *hub;
} inproc_ring_t;

struct stria_worker_inproc_links {
    pthread_mutex_t lock;
    inproc_ring_t *rings;
};

stria_status_t stria_worker_inproc_links_create(stria_worker_inproc_links_t **out)
{
    stria_worker_inproc_links_t *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    pthread_mutex_init(&l->lock, NULL);
    *out = l;
    return STRIA_OK;
}

void stria_worker_inproc_links_destroy(stria_worker_inproc_links_t *l)
{
    if (l == NULL)
        return;
    while (l->rings != NULL) {
        inproc_ring_t *r = l->rings;
        l->rings = r->next;
        stria_inproc_hub_release(r->hub);
        free(r);
    }
    pthread_mutex_destroy(&l->lock);
    free(l);
}

static stria_status_t inproc_connect(void *ctx, const stria_worker_link_request_t *req,
                                     stria_link_t **link_out)
{
    stria_worker_inproc_links_t *l = ctx;
    inproc_ring_t **pp, *r;
    stria_status_t st = STRIA_OK;
    pthread_mutex_lock(&l->lock);
    for (pp = &l->rings; *pp != NULL; pp = &(*pp)->next)
        if ((*pp)->job_id == req->job_id && (*pp)->ring_id == req->ring_id)
            break;
    r = *pp;
    if (r == NULL) {
        r = calloc(1, sizeof(*r));
        if (r == NULL || (st = stria_inproc_hub_create(req->size, &r->hub)) != STRIA_OK) {
            pthread_mutex_unlock(&l->lock);
            free(r);
            return st != STRIA_OK ? st : stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
        }
        r->job_id = req->job_id;
        r->ring_id = req->ring_id;
        r->size = req->size;
        r->next = l->rings;
        l->rings = r;
        pp = &l->rings;
    }
    if (r->size != req->size)
        st = stria_error_set(STRIA_ERR_PROTOCOL, "job %llu ring %u: rank %d has %d ranks, not %d",
                             (unsigned long long)req->job_id, req->ring_id, req->rank, req->size,
                             r->size);
    else
        st = stria_inproc_link_create(r->hub, req->rank, link_out);
    if (st == STRIA_OK && ++r->joined == r->size) { /* every rank has its link */
        *pp = r->next;
        stria_inproc_hub_release(r->hub);
        free(r);
    }
    pthread_mutex_unlock(&l->lock);
    return st;
}

stria_worker_link_factory_t stria_worker_inproc_links(stria_worker_inproc_links_t *l)
{
    stria_worker_link_factory_t f = {inproc_connect, l, NULL};
    return f;
}
