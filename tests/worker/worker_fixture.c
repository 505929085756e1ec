#include "worker_fixture.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *const wf_tensor_names[WF_N] = {"Q", "K", "V", "O", "LSE", "dO", "dQ", "dK", "dV"};

stria_status_t wf_call(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                       const void *payload, uint64_t len, stria_rpc_reply_t *rep)
{
    return wf_call_job(cl, method, req, payload, len, NULL, rep);
}

stria_status_t wf_open_secret(const stria_rpc_reply_t *rep, wf_job_t *job)
{
    const Stria__V1__SubmitJobReply *r = (const Stria__V1__SubmitJobReply *)rep->msg;
    return stria_auth_open(&rep->session, "job secret", r->assignment->job_id, r->job_secret.data,
                           r->job_secret.len, job->secret.bytes);
}

/* One request with the job's proof (extra bytes bound when given). */
static stria_status_t request(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                              const void *payload, uint64_t len, const wf_job_t *job,
                              const void *extra, size_t extra_len, stria_rpc_reply_t *rep)
{
    stria_rpc_request_t r = {.method = method, .request = req, .timeout_s = 30};
    stria_rpc_reply_t tmp;
    if (job != NULL) {
        r.job_secret = &job->secret;
        r.job_id = job->id;
    }
    r.payload = payload;
    r.payload_len = len;
    r.proof_extra = extra;
    r.proof_extra_len = extra_len;
    memset(&tmp, 0, sizeof(tmp));
    stria_status_t st = stria_rpc_client_call(cl, &r, rep != NULL ? rep : &tmp);
    if (rep == NULL)
        stria_rpc_reply_free(&tmp);
    return st;
}

stria_status_t wf_call_job(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                           const void *payload, uint64_t len, const wf_job_t *job,
                           stria_rpc_reply_t *rep)
{
    return request(cl, method, req, payload, len, job, NULL, 0, rep);
}

static stria_status_t wf_connect(const char *addr, const ProtobufCServiceDescriptor *svc,
                                 stria_rpc_client_t **out)
{
    stria_rpc_client_params_t p;
    memset(&p, 0, sizeof(p));
    p.address = addr;
    p.service = svc;
    p.client_name = "test_worker";
    p.connect_timeout_s = 5;
    return stria_rpc_client_connect(&p, out);
}

stria_status_t wf_start_with(wf_t *f, int n, const wf_opts_t *o)
{
    char link_addr[64];
    char addr[64];
    stria_status_t st;
    memset(f, 0, sizeof(*f));
    f->n = n;
    stria_coord_params_t cp = {0};
    cp.listen = "127.0.0.1:0";
    cp.heartbeat_period_s = 0.2; /* dead after 0.6 s: room for a loaded sanitizer build */
    if ((st = stria_coord_start(&cp, &f->co)) != STRIA_OK)
        return st;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", stria_coord_port(f->co));
    if ((st = wf_connect(addr, &stria__v1__coordinator__descriptor, &f->cc)) != STRIA_OK ||
        (st = stria_worker_inproc_links_create(&f->links)) != STRIA_OK)
        return st;
    stria_worker_link_factory_t links = stria_worker_inproc_links(f->links);
    for (int i = 0; i < n; i++) {
        if (o->ucx) {
            stria_ucx_ctx_params_t up = {.listen_host = "127.0.0.1", .tls = "tcp"};
            if ((st = stria_ucx_ctx_create(&up, &f->ucx[i])) != STRIA_OK)
                return st;
            snprintf(link_addr, sizeof(link_addr), "127.0.0.1:%u", stria_ucx_ctx_port(f->ucx[i]));
            links = stria_worker_ucx_links(f->ucx[i], link_addr);
        }
        stria_worker_params_t p;
        char host[16];
        memset(&p, 0, sizeof(p));
        snprintf(host, sizeof(host), "h%d", i);
        p.coordinator = addr;
        p.host = host;
        p.memory_bytes = 256 << 20;
        p.threads = 1;
        p.step_timeout_s = o->step_timeout_s;
        p.connect_timeout_s = o->connect_timeout_s > 0 ? o->connect_timeout_s : 2;
        p.links = &links;
        p.max_payload_bytes = o->max_payload_bytes;
        if ((st = stria_worker_start(&p, &f->w[i])) != STRIA_OK ||
            (st = wf_connect(stria_worker_address(f->w[i]), &stria__v1__worker__descriptor,
                             &f->wc[i])) != STRIA_OK)
            return st;
    }
    for (int tries = 0; tries < 500; tries++) { /* registered? */
        int ok = 0;
        for (int i = 0; i < n; i++)
            ok += stria_worker_id(f->w[i]) != 0;
        if (ok == n)
            return STRIA_OK;
        usleep(10000);
    }
    return stria_error_set(STRIA_ERR_TIMEOUT, "the workers did not register");
}

stria_status_t wf_start(wf_t *f, int n, double step_timeout_s)
{
    wf_opts_t o = {.step_timeout_s = step_timeout_s};
    return wf_start_with(f, n, &o);
}

void wf_stop(wf_t *f)
{
    for (int i = 0; i < f->n; i++) {
        stria_rpc_client_close(f->wc[i]);
        stria_worker_stop(f->w[i]);
    }
    stria_rpc_client_close(f->cc);
    stria_coord_stop(f->co);
    stria_worker_inproc_links_destroy(f->links);
    for (int i = 0; i < f->n; i++)
        stria_ucx_ctx_destroy(f->ucx[i]);
    memset(f, 0, sizeof(*f));
}

stria_rpc_client_t *wf_client(wf_t *f, int widx)
{
    stria_rpc_client_t *cl = NULL;
    if (wf_connect(stria_worker_address(f->w[widx]), &stria__v1__worker__descriptor, &cl) !=
        STRIA_OK)
        return NULL;
    return cl;
}

/* ---- submission ---------------------------------------------------------------- */

static stria_status_t job_layout(wf_job_t *job)
{
    stria_status_t st =
        stria_layout_init(job->layout.kind, job->n, job->shape.call.seq_len, &job->layout);
    if (st != STRIA_OK)
        return st;
    for (int r = 0; r < job->n; r++)
        job->valid[r] = stria_layout_shard_valid(&job->layout, r);
    return STRIA_OK;
}

stria_status_t wf_job_of(const stria_rpc_reply_t *rep, const Stria__V1__JobSpec *spec,
                         const char *const rpc[], int n_workers, wf_job_t *job)
{
    const Stria__V1__Assignment *a = ((const Stria__V1__SubmitJobReply *)rep->msg)->assignment;
    memset(job, 0, sizeof(*job));
    if (a == NULL || a->spec == NULL || a->n_ranks == 0 || a->n_ranks > WF_MAX)
        return stria_error_set(STRIA_ERR_PROTOCOL, "SubmitJob: no usable assignment");
    job->id = a->job_id;
    stria_status_t st = wf_open_secret(rep, job);
    if (st != STRIA_OK)
        return st;
    job->n = (int)a->n_ranks;
    job->session = spec->session;
    job->max_held = a->spec->max_held;
    job->shape = (stria_ring_shape_t){.call = {.batch = (int64_t)spec->batch,
                                               .seq_len = (int64_t)spec->seq_len,
                                               .causal = spec->causal,
                                               .scale = a->spec->scale},
                                      .heads = spec->heads,
                                      .kv_heads = spec->kv_heads,
                                      .head_dim = spec->head_dim,
                                      .dtype = (stria_dtype_t)spec->dtype};
    for (size_t r = 0; r < a->n_ranks; r++) {
        job->widx[r] = -1;
        for (int i = 0; i < n_workers; i++)
            if (strcmp(a->ranks[r]->rpc_address, rpc[i]) == 0)
                job->widx[r] = i;
    }
    job->layout.kind = (stria_layout_kind_t)a->spec->layout;
    return job_layout(job);
}

stria_status_t wf_submit_spec(wf_t *f, const wf_spec_t *s, wf_job_t *job)
{
    Stria__V1__JobSpec sp = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    const char *rpc[WF_MAX];
    memset(job, 0, sizeof(*job));
    sp.batch = s->batch > 0 ? (uint32_t)s->batch : 1;
    sp.seq_len = (uint64_t)s->seq_len;
    sp.heads = 2;
    sp.kv_heads = 1;
    sp.head_dim = 16;
    sp.causal = !s->session; /* a session's calls bring their own */
    sp.ring_size = (uint32_t)f->n;
    sp.step_timeout_ms = s->step_timeout_ms;
    sp.session = s->session;
    sp.max_held = s->session ? s->max_held : 1;
    req.spec = &sp;
    stria_status_t st = wf_call(f->cc, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, NULL, 0, &rep);
    if (st != STRIA_OK)
        return st;
    for (int i = 0; i < f->n; i++)
        rpc[i] = stria_worker_address(f->w[i]);
    st = wf_job_of(&rep, &sp, rpc, f->n, job);
    stria_rpc_reply_free(&rep);
    return st;
}

stria_status_t wf_submit(wf_t *f, int64_t seq, uint32_t step_timeout_ms, wf_job_t *job)
{
    const wf_spec_t s = {.seq_len = seq, .step_timeout_ms = step_timeout_ms};
    return wf_submit_spec(f, &s, job);
}

wf_job_t wf_job_resized(const wf_job_t *job, int64_t batch, int64_t seq)
{
    wf_job_t v = *job;
    v.shape.call = (stria_call_shape_t){.batch = batch,
                                        .seq_len = seq,
                                        .causal = job->shape.call.causal,
                                        .scale = job->shape.call.scale};
    if (job_layout(&v) != STRIA_OK)
        memset(v.valid, 0, sizeof(v.valid));
    return v;
}

stria_call_shape_t wf_shape(const wf_job_t *job)
{
    return job->shape.call;
}

/* ---- tensors ----------------------------------------------------------------- */

float *wf_tensor(const wf_job_t *job, int64_t heads, unsigned seed)
{
    size_t n =
        (size_t)(job->shape.call.batch * job->shape.call.seq_len * heads * job->shape.head_dim);
    float *t = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        t[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
    return t;
}

void *wf_shard(const wf_job_t *job, int rank, const float *full, int64_t heads, uint64_t *len)
{
    size_t row = (size_t)(heads * job->shape.head_dim);
    int64_t v = job->valid[rank];
    float *s = malloc((size_t)(job->shape.call.batch * v) * row * sizeof(float) + 1);
    for (int64_t b = 0; b < job->shape.call.batch; b++)
        for (int64_t i = 0; i < v; i++) {
            int64_t pos = stria_layout_position(&job->layout, rank, i);
            memcpy(s + (size_t)(b * v + i) * row,
                   full + (size_t)(b * job->shape.call.seq_len + pos) * row, row * sizeof(float));
        }
    *len = (uint64_t)(job->shape.call.batch * v) * row * sizeof(float);
    return s;
}

uint64_t wf_tensor_bytes(const wf_job_t *job, int rank, int t)
{
    const stria_ring_shape_t *s = &job->shape;
    uint64_t tokens = (uint64_t)s->call.batch * (uint64_t)job->valid[rank];
    if (t == WF_LSE)
        return tokens * (uint64_t)s->heads * 4u;
    bool kv = t == WF_K || t == WF_V || t == WF_DK || t == WF_DV;
    return tokens * (uint64_t)((kv ? s->kv_heads : s->heads) * s->head_dim) *
           stria_dtype_size(s->dtype);
}

void wf_io_set(wf_io_t *io, int t, const void *bytes, uint64_t len)
{
    free(io->t[t]);
    io->t[t] = malloc(len + 1);
    if (len > 0)
        memcpy(io->t[t], bytes, len);
    io->len[t] = len;
}

static void io_take(wf_io_t *io, int t, void *bytes, uint64_t len)
{
    free(io->t[t]);
    io->t[t] = bytes;
    io->len[t] = len;
}

void wf_io_inputs(const wf_job_t *job, wf_io_t io[WF_MAX], const float *q, const float *k,
                  const float *v, const float *d_o)
{
    const float *full[4] = {q, k, v, d_o};
    const int ts[4] = {WF_Q, WF_K, WF_V, WF_DO};
    const int64_t heads[4] = {job->shape.heads, job->shape.kv_heads, job->shape.kv_heads,
                              job->shape.heads};
    for (int r = 0; r < job->n; r++)
        for (int i = 0; i < 4; i++) {
            if (full[i] == NULL)
                continue;
            uint64_t len;
            void *s = wf_shard(job, r, full[i], heads[i], &len);
            io_take(&io[r], ts[i], s, len);
        }
}

void wf_io_free(wf_io_t io[], int n)
{
    for (int r = 0; r < n; r++) {
        for (int t = 0; t < WF_N; t++)
            free(io[r].t[t]);
        memset(&io[r], 0, sizeof(io[r]));
    }
}

/* ---- sessions and calls ------------------------------------------------------ */

stria_status_t wf_open_on(stria_rpc_client_t *cl, const wf_job_t *job, int rank,
                          Stria__V1__OpenSessionReply *out)
{
    Stria__V1__OpenSessionRequest req = STRIA__V1__OPEN_SESSION_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.job_id = job->id;
    req.rank = (uint32_t)rank;
    stria_status_t st =
        request(cl, STRIA_RPC_WORKER_OPEN_SESSION, &req.base, NULL, 0, job, NULL, 0, &rep);
    if (st != STRIA_OK)
        return st;
    if (out != NULL) {
        const Stria__V1__OpenSessionReply *r = (const Stria__V1__OpenSessionReply *)rep.msg;
        stria__v1__open_session_reply__init(out);
        out->buffer_bytes = r->buffer_bytes;
        out->connect_seconds = r->connect_seconds;
        out->arena_bound_bytes = r->arena_bound_bytes;
    }
    stria_rpc_reply_free(&rep);
    return STRIA_OK;
}

stria_status_t wf_open(wf_t *f, const wf_job_t *job, int rank)
{
    return wf_open_on(f->wc[job->widx[rank]], job, rank, NULL);
}

int wf_call_inputs(const wf_call_opts_t *o, int ids[6])
{
    if (!o->backward) {
        ids[0] = WF_Q, ids[1] = WF_K, ids[2] = WF_V;
        return 3;
    }
    if (o->use_held) {
        ids[0] = WF_DO;
        return 1;
    }
    for (int i = 0; i < 6; i++)
        ids[i] = WF_Q + i;
    return 6;
}

int wf_call_outputs(const wf_call_opts_t *o, int ids[3])
{
    if (!o->backward) {
        ids[0] = WF_O, ids[1] = WF_LSE;
        return 2;
    }
    ids[0] = WF_DQ, ids[1] = WF_DK, ids[2] = WF_DV;
    return 3;
}

void *wf_payload(const wf_call_opts_t *o, const wf_io_t *io, uint64_t *len)
{
    int in[6], n = wf_call_inputs(o, in);
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        if (io->t[in[i]] == NULL)
            return NULL;
        total += io->len[in[i]];
    }
    char *p = malloc(total + 1), *at = p;
    for (int i = 0; i < n && p != NULL; i++) {
        memcpy(at, io->t[in[i]], io->len[in[i]]);
        at += io->len[in[i]];
    }
    *len = total;
    return p;
}

stria_status_t wf_request(stria_rpc_client_t *cl, const wf_job_t *job, int rank, uint64_t call,
                          const wf_call_opts_t *o, uint64_t piece_offset, bool more,
                          const void *payload, uint64_t len, stria_rpc_reply_t *rep)
{
    Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    Stria__V1__CallShape pb;
    Stria__V1__JobSpec__Window win;
    uint8_t bound[STRIA_CALL_BINDING_BYTES];
    const stria_call_shape_t own = wf_shape(job);
    const stria_call_shape_t *shape = o->shape != NULL ? o->shape : &own;
    const stria_call_place_t place = {.call = call,
                                      .link_epoch = o->epoch,
                                      .backward = o->backward,
                                      .more = more,
                                      .piece_offset = piece_offset,
                                      .hold = o->hold,
                                      .use_held = o->use_held,
                                      .held_call = o->held_call,
                                      .part = o->part,
                                      .parts = o->parts};
    stria_call_shape_to_pb(shape, &pb, &win);
    stria_call_place_to_pb(&place, &req);
    stria_call_place_t bound_place = place;
    if (o->forge)
        bound_place.call++;
    stria_call_binding(shape, (int)job->layout.kind, &bound_place, bound);
    req.job_id = job->id;
    req.rank = (uint32_t)rank;
    req.shape = &pb;
    req.digest = stria_call_shape_digest(shape, (int)job->layout.kind, call, o->backward);
    return request(cl, STRIA_RPC_WORKER_SESSION_CALL, &req.base, payload, len, job, bound,
                   sizeof(bound), rep);
}

/* A rank's call with its payload built: `sending` (NULL: none) is set just
 * before the first request goes. */
static stria_status_t call_with(stria_rpc_client_t *cl, const wf_job_t *job, int rank,
                                uint64_t call, const wf_call_opts_t *o, const char *payload,
                                uint64_t len, wf_io_t *io, bool *sending)
{
    uint64_t off = 0;
    stria_rpc_reply_t rep;
    stria_status_t st = STRIA_OK;
    if (sending != NULL)
        __atomic_store_n(sending, true, __ATOMIC_RELEASE);
    while (o->piece > 0 && len - off > o->piece) { /* pieces with more to come */
        if ((st = wf_request(cl, job, rank, call, o, off, true, payload + off, o->piece, NULL)) !=
            STRIA_OK)
            return st;
        off += o->piece;
    }
    if ((st = wf_request(cl, job, rank, call, o, off, false, payload + off, len - off, &rep)) !=
        STRIA_OK)
        return st;
    int out[3], n = wf_call_outputs(o, out);
    uint64_t want = 0;
    for (int i = 0; i < n; i++)
        want += wf_tensor_bytes(job, rank, out[i]);
    if (rep.payload_len != want) {
        stria_rpc_reply_free(&rep);
        return stria_error_set(STRIA_ERR_PROTOCOL,
                               "rank %d: the reply carries %llu bytes of outputs, not %llu", rank,
                               (unsigned long long)rep.payload_len, (unsigned long long)want);
    }
    const char *at = rep.payload;
    for (int i = 0; i < n; i++) {
        uint64_t b = wf_tensor_bytes(job, rank, out[i]);
        wf_io_set(io, out[i], at, b);
        at += b;
    }
    stria_rpc_reply_free(&rep);
    return STRIA_OK;
}

/* wf_call_on() with `sending` set just before the first request goes. */
static stria_status_t call_on(stria_rpc_client_t *cl, const wf_job_t *job, int rank, uint64_t call,
                              const wf_call_opts_t *o, wf_io_t *io, bool *sending)
{
    uint64_t len = 0;
    char *payload = wf_payload(o, io, &len);
    if (payload == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rank %d: an input of the call is missing",
                               rank);
    stria_status_t st = call_with(cl, job, rank, call, o, payload, len, io, sending);
    free(payload);
    return st;
}

stria_status_t wf_call_on(stria_rpc_client_t *cl, const wf_job_t *job, int rank, uint64_t call,
                          const wf_call_opts_t *o, wf_io_t *io)
{
    return call_on(cl, job, rank, call, o, io, NULL);
}

stria_status_t wf_call_rank(wf_t *f, const wf_job_t *job, int rank, uint64_t call,
                            const wf_call_opts_t *o, wf_io_t *io)
{
    return wf_call_on(f->wc[job->widx[rank]], job, rank, call, o, io);
}

/* One rank's open or call: on a connection of its own (wf_bg_start()) or
 * on the fixture's (every rank at once). */
static void *bg_main(void *arg)
{
    wf_bg_t *bg = arg;
    int widx = bg->job->widx[bg->rank];
    stria_rpc_client_t *cl = bg->own ? wf_client(bg->f, widx) : bg->f->wc[widx];
    if (cl == NULL) {
        bg->st = STRIA_ERR_IO;
        snprintf(bg->msg, sizeof(bg->msg), "cannot connect to worker %d", widx);
        return NULL;
    }
    if (bg->open)
        __atomic_store_n(&bg->sending, true, __ATOMIC_RELEASE);
    bg->st = bg->open ? wf_open_on(cl, bg->job, bg->rank, NULL)
                      : call_on(cl, bg->job, bg->rank, bg->call, &bg->o, bg->io, &bg->sending);
    snprintf(bg->msg, sizeof(bg->msg), "%s", bg->st != STRIA_OK ? stria_error_msg() : "");
    if (bg->own)
        stria_rpc_client_close(cl);
    return NULL;
}

static int bg_launch(wf_bg_t *bg, wf_t *f, const wf_job_t *job, int rank, bool open, uint64_t call,
                     const wf_call_opts_t *o, wf_io_t *io, bool own)
{
    memset(bg, 0, sizeof(*bg));
    bg->f = f;
    bg->job = job;
    bg->rank = rank;
    bg->open = open;
    bg->call = call;
    if (o != NULL)
        bg->o = *o;
    bg->io = io;
    bg->own = own;
    return pthread_create(&bg->th, NULL, bg_main, bg);
}

int wf_bg_start(wf_bg_t *bg, wf_t *f, const wf_job_t *job, int rank, bool open, uint64_t call,
                const wf_call_opts_t *o, wf_io_t *io)
{
    return bg_launch(bg, f, job, rank, open, call, o, io, true);
}

stria_status_t wf_bg_join(wf_bg_t *bg)
{
    pthread_join(bg->th, NULL);
    return bg->st;
}

/* An open or call on every rank at once: the first failure by rank. */
static stria_status_t all_ranks(wf_t *f, const wf_job_t *job, bool open, uint64_t call,
                                const wf_call_opts_t *o, wf_io_t io[WF_MAX])
{
    wf_bg_t bg[WF_MAX];
    bool started[WF_MAX] = {false};
    stria_status_t st = STRIA_OK;
    char msg[512] = "";
    for (int r = 0; r < job->n; r++) {
        started[r] =
            bg_launch(&bg[r], f, job, r, open, call, o, io != NULL ? &io[r] : NULL, false) == 0;
        if (!started[r] && st == STRIA_OK) {
            st = STRIA_ERR_NO_MEMORY;
            snprintf(msg, sizeof(msg), "rank %d: cannot start a thread", r);
        }
    }
    for (int r = 0; r < job->n; r++) {
        if (!started[r])
            continue;
        if (wf_bg_join(&bg[r]) != STRIA_OK && st == STRIA_OK) {
            st = bg[r].st;
            snprintf(msg, sizeof(msg), "rank %d: %s", r, bg[r].msg);
        }
    }
    if (st != STRIA_OK)
        stria_error_set(st, "%s", msg);
    return st;
}

stria_status_t wf_open_all(wf_t *f, const wf_job_t *job)
{
    return all_ranks(f, job, true, 0, NULL, NULL);
}

stria_status_t wf_call_all(wf_t *f, const wf_job_t *job, uint64_t call, const wf_call_opts_t *o,
                           wf_io_t io[WF_MAX])
{
    return all_ranks(f, job, false, call, o, io);
}

/* ---- drops and waits --------------------------------------------------------- */

stria_status_t wf_drop(wf_t *f, int widx, const wf_job_t *job)
{
    Stria__V1__DropJobRequest req = STRIA__V1__DROP_JOB_REQUEST__INIT;
    req.job_id = job->id;
    return wf_call_job(f->wc[widx], STRIA_RPC_WORKER_DROP_JOB, &req.base, NULL, 0, job, NULL);
}

stria_status_t wf_release_held(wf_t *f, const wf_job_t *job, int rank, uint64_t call)
{
    Stria__V1__DropJobRequest req = STRIA__V1__DROP_JOB_REQUEST__INIT;
    req.job_id = job->id;
    req.rank = (uint32_t)rank;
    req.release_held = true;
    req.held_call = call;
    return wf_call_job(f->wc[job->widx[rank]], STRIA_RPC_WORKER_DROP_JOB, &req.base, NULL, 0, job,
                       NULL);
}

stria_status_t wf_release(wf_t *f, const wf_job_t *job)
{
    Stria__V1__ReleaseJobRequest req = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    req.job_id = job->id;
    return wf_call_job(f->cc, STRIA_RPC_COORDINATOR_RELEASE_JOB, &req.base, NULL, 0, job, NULL);
}

bool wf_wait_usage(wf_t *f, int i, uint32_t jobs, uint64_t memory, double timeout_s)
{
    double until = stria_time_now() + timeout_s;
    stria_worker_usage_t u;
    do {
        stria_worker_usage(f->w[i], &u);
        if (u.jobs == jobs && u.memory_in_use_bytes == memory)
            return true;
        usleep(5000);
    } while (stria_time_now() < until);
    return false;
}

bool wf_wait_running(wf_t *f, int i, uint32_t n, double timeout_s)
{
    double until = stria_time_now() + timeout_s;
    stria_worker_usage_t u;
    do {
        stria_worker_usage(f->w[i], &u);
        if (u.running_passes == n)
            return true;
        usleep(2000);
    } while (stria_time_now() < until);
    return false;
}
