#include "stria_spec.h"

#include <string.h>

void stria_call_shape_to_pb(const stria_call_shape_t *c, Stria__V1__CallShape *pb,
                            Stria__V1__JobSpec__Window *win)
{
    stria__v1__call_shape__init(pb);
    stria__v1__job_spec__window__init(win);
    pb->batch = (uint32_t)c->batch;
    pb->seq_len = (uint64_t)c->seq_len;
    pb->causal = c->causal;
    pb->scale = c->scale;
    pb->n_cu_seqlens = c->n_cu_seqlens;
    pb->cu_seqlens = (int64_t *)c->cu_seqlens;
    if (c->has_window) {
        win->left = c->window_left;
        win->right = c->window_right;
        pb->window = win;
    }
}

void stria_call_shape_from_spec(const Stria__V1__JobSpec *s, stria_call_shape_t *c)
{
    memset(c, 0, sizeof(*c));
    c->batch = s->batch;
    c->seq_len = s->seq_len > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)s->seq_len;
    c->causal = s->causal;
    c->scale = s->scale;
    c->cu_seqlens = s->cu_seqlens;
    c->n_cu_seqlens = s->n_cu_seqlens;
    c->has_window = s->window != NULL;
    c->window_left = s->window != NULL ? s->window->left : 0;
    c->window_right = s->window != NULL ? s->window->right : 0;
}

void stria_call_shape_to_spec(const stria_call_shape_t *c, Stria__V1__JobSpec *s,
                              Stria__V1__JobSpec__Window *win)
{
    stria__v1__job_spec__window__init(win);
    s->batch = (uint32_t)c->batch;
    s->seq_len = (uint64_t)c->seq_len;
    s->causal = c->causal;
    s->scale = c->scale;
    s->cu_seqlens = (int64_t *)c->cu_seqlens;
    s->n_cu_seqlens = c->n_cu_seqlens;
    s->window = NULL;
    if (c->has_window) {
        win->left = c->window_left;
        win->right = c->window_right;
        s->window = win;
    }
}

void stria_call_shape_from_pb(const Stria__V1__CallShape *pb, stria_call_shape_t *c)
{
    memset(c, 0, sizeof(*c));
    c->batch = pb->batch;
    c->seq_len = pb->seq_len > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)pb->seq_len;
    c->causal = pb->causal;
    c->scale = pb->scale;
    c->cu_seqlens = pb->cu_seqlens;
    c->n_cu_seqlens = pb->n_cu_seqlens;
    c->has_window = pb->window != NULL;
    c->window_left = pb->window != NULL ? pb->window->left : 0;
    c->window_right = pb->window != NULL ? pb->window->right : 0;
}

void stria_call_place_from_pb(const Stria__V1__SessionCallRequest *req, stria_call_place_t *p)
{
    *p = (stria_call_place_t){.call = req->call,
                              .link_epoch = req->link_epoch,
                              .backward = req->backward,
                              .arena = req->arena,
                              .arena_in = req->arena_in,
                              .arena_out = req->arena_out,
                              .more = req->more,
                              .piece_offset = req->piece_offset,
                              .hold = req->hold,
                              .use_held = req->use_held,
                              .held_call = req->held_call,
                              .part = req->part,
                              .parts = req->parts};
}

void stria_call_place_to_pb(const stria_call_place_t *p, Stria__V1__SessionCallRequest *req)
{
    req->call = p->call;
    req->link_epoch = p->link_epoch;
    req->backward = p->backward;
    req->arena = p->arena;
    req->arena_in = p->arena ? p->arena_in : 0;
    req->arena_out = p->arena ? p->arena_out : 0;
    req->more = p->more;
    req->piece_offset = p->piece_offset;
    req->hold = p->hold;
    req->use_held = p->use_held;
    req->held_call = p->use_held ? p->held_call : 0;
    req->part = p->part;
    req->parts = p->parts;
}
