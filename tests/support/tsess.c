/* Test-only raw session calls (see tsess.h). */
#include "tsess.h"

#include <string.h>

static double timeout_of(const tsess_rank_t *r)
{
    return r->timeout_s > 0 ? r->timeout_s : 30.0;
}

stria_status_t tsess_open(const tsess_rank_t *r)
{
    Stria__V1__OpenSessionRequest req = STRIA__V1__OPEN_SESSION_REQUEST__INIT;
    req.job_id = r->id;
    req.rank = r->rank;
    stria_rpc_request_t rq = {.method = STRIA_RPC_WORKER_OPEN_SESSION,
                              .request = &req.base,
                              .timeout_s = timeout_of(r),
                              .job_secret = &r->secret,
                              .job_id = r->id};
    stria_rpc_reply_t reply;
    memset(&reply, 0, sizeof(reply));
    stria_status_t st = stria_rpc_client_call(r->c, &rq, &reply);
    stria_rpc_reply_free(&reply);
    return st;
}

stria_status_t tsess_call(const tsess_rank_t *r, const stria_call_shape_t *shape,
                          const stria_call_place_t *place, const void *in, uint64_t len, void *out,
                          uint64_t cap, uint64_t *out_len)
{
    Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    Stria__V1__CallShape pb;
    Stria__V1__JobSpec__Window win;
    uint8_t bound[STRIA_CALL_BINDING_BYTES];
    stria_call_shape_to_pb(shape, &pb, &win);
    req.job_id = r->id;
    req.rank = r->rank;
    req.shape = &pb;
    req.digest = stria_call_shape_digest(shape, r->layout, place->call, place->backward);
    stria_call_place_to_pb(place, &req);
    stria_call_binding(shape, r->layout, place, bound);
    stria_rpc_request_t rq = {.method = STRIA_RPC_WORKER_SESSION_CALL,
                              .request = &req.base,
                              .payload = in,
                              .payload_len = len,
                              .reply_buf = out,
                              .reply_buf_cap = cap,
                              .timeout_s = timeout_of(r),
                              .job_secret = &r->secret,
                              .job_id = r->id,
                              .proof_extra = bound,
                              .proof_extra_len = sizeof(bound)};
    stria_rpc_reply_t reply;
    memset(&reply, 0, sizeof(reply));
    stria_status_t st = stria_rpc_client_call(r->c, &rq, &reply);
    if (st == STRIA_OK && out_len != NULL)
        *out_len = reply.payload_len;
    stria_rpc_reply_free(&reply);
    return st;
}

stria_status_t tsess_drop(const tsess_rank_t *r, bool held, uint64_t held_call)
{
    Stria__V1__DropJobRequest req = STRIA__V1__DROP_JOB_REQUEST__INIT;
    req.job_id = r->id;
    req.rank = r->rank;
    req.release_held = held;
    req.held_call = held_call;
    stria_rpc_request_t rq = {.method = STRIA_RPC_WORKER_DROP_JOB,
                              .request = &req.base,
                              .timeout_s = timeout_of(r),
                              .job_secret = &r->secret,
                              .job_id = r->id};
    stria_rpc_reply_t reply;
    memset(&reply, 0, sizeof(reply));
    stria_status_t st = stria_rpc_client_call(r->c, &rq, &reply);
    stria_rpc_reply_free(&reply);
    return st;
}
