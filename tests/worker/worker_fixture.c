#include "worker_fixture.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

stria_status_t wf_call_job(stria_rpc_client_t *cl, uint32_t method, const ProtobufCMessage *req,
                           const void *payload, uint64_t len, const wf_job_t *job,
                           stria_rpc_reply_t *rep)
{
    stria_rpc_request_t r = {.method = method, .request = req, .timeout_s = 30};
    stria_rpc_reply_t tmp;
    if (job != NULL) {
        r.job_secret = &job->secret;
        r.job_id = job->id;
    }
    r.payload = payload;
    r.payload_len = len;
    memset(&tmp, 0, sizeof(tmp));
    stria_status_t st = stria_rpc_client_call(cl, &r, rep != NULL ? rep : &tmp);
    if (rep == NULL)
        stria_rpc_reply_free(&tmp);
    return st;
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
    cp.heartbeat_period_s = 0.05;
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

stria_status_t wf_submit(wf_t *f, int64_t seq, uint32_t step_timeout_ms, wf_job_t *job)
{
    Stria__V1__JobSpec s = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    memset(job, 0, sizeof(*job));
    s.batch = 1;
    s.seq_len = (uint64_t)seq;
    s.heads = 2;
    s.kv_heads = 1;
    s.head_dim = 16;
    s.causal = true;
    s.ring_size = (uint32_t)f->n;
    s.step_timeout_ms = step_timeout_ms;
    req.spec = &s;
    stria_status_t st = wf_call(f->cc, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, NULL, 0, &rep);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__Assignment *a = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    job->id = a->job_id;
    if ((st = wf_open_secret(&rep, job)) != STRIA_OK) {
        stria_rpc_reply_free(&rep);
        return st;
    }
    job->n = (int)a->n_ranks;
    job->shape = (stria_ring_shape_t){.call = {.batch = 1, .seq_len = seq, .causal = true},
                                      .heads = 2,
                                      .kv_heads = 1,
                                      .head_dim = 16,
                                      .dtype = STRIA_DTYPE_F32};
    job->shape.call.scale = a->spec->scale;
    for (size_t r = 0; r < a->n_ranks; r++) {
        job->widx[r] = -1;
        for (int i = 0; i < f->n; i++)
            if (strcmp(a->ranks[r]->rpc_address, stria_worker_address(f->w[i])) == 0)
                job->widx[r] = i;
    }
    stria_rpc_reply_free(&rep);
    if ((st = stria_layout_init(STRIA_LAYOUT_STRIPED, job->n, seq, &job->layout)) != STRIA_OK)
        return st;
    for (int r = 0; r < job->n; r++)
        job->valid[r] = stria_layout_shard_valid(&job->layout, r);
    return STRIA_OK;
}

float *wf_tensor(const wf_job_t *job, int64_t heads, unsigned seed)
{
    size_t n =
        (size_t)(job->shape.call.batch * job->shape.call.seq_len * heads * job->shape.head_dim);
    float *t = malloc(n * sizeof(float));
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

stria_status_t wf_put(wf_t *f, const wf_job_t *job, int rank, Stria__V1__Tensor t,
                      const void *shard, uint64_t total, uint64_t off, uint64_t len)
{
    Stria__V1__PutInputRequest req = STRIA__V1__PUT_INPUT_REQUEST__INIT;
    req.job_id = job->id;
    req.rank = (uint32_t)rank;
    req.tensor = t;
    req.offset = off;
    req.total_bytes = total;
    return wf_call_job(f->wc[job->widx[rank]], STRIA_RPC_WORKER_PUT_INPUT, &req.base,
                       (const char *)shard + off, len, job, NULL);
}

stria_status_t wf_put_all(wf_t *f, const wf_job_t *job, const float *q, const float *k,
                          const float *v, const float *d_o)
{
    const float *full[4] = {q, k, v, d_o};
    const Stria__V1__Tensor ts[4] = {STRIA__V1__TENSOR__TENSOR_Q, STRIA__V1__TENSOR__TENSOR_K,
                                     STRIA__V1__TENSOR__TENSOR_V, STRIA__V1__TENSOR__TENSOR_DO};
    const int64_t heads[4] = {job->shape.heads, job->shape.kv_heads, job->shape.kv_heads,
                              job->shape.heads};
    for (int r = 0; r < job->n; r++)
        for (int i = 0; i < 4; i++) {
            if (full[i] == NULL)
                continue;
            uint64_t len;
            void *s = wf_shard(job, r, full[i], heads[i], &len);
            stria_status_t st = wf_put(f, job, r, ts[i], s, len, 0, len);
            free(s);
            if (st != STRIA_OK)
                return st;
        }
    return STRIA_OK;
}

stria_rpc_client_t *wf_client(wf_t *f, int widx)
{
    stria_rpc_client_t *cl = NULL;
    if (wf_connect(stria_worker_address(f->w[widx]), &stria__v1__worker__descriptor, &cl) !=
        STRIA_OK)
        return NULL;
    return cl;
}

stria_status_t wf_pass_on(stria_rpc_client_t *cl, const wf_job_t *job, int rank, bool backward)
{
    Stria__V1__RunForwardRequest fr = STRIA__V1__RUN_FORWARD_REQUEST__INIT;
    Stria__V1__RunBackwardRequest br = STRIA__V1__RUN_BACKWARD_REQUEST__INIT;
    fr.job_id = br.job_id = job->id;
    fr.rank = br.rank = (uint32_t)rank;
    return wf_call_job(cl, backward ? STRIA_RPC_WORKER_RUN_BACKWARD : STRIA_RPC_WORKER_RUN_FORWARD,
                       backward ? &br.base : &fr.base, NULL, 0, job, NULL);
}

stria_status_t wf_pass(wf_t *f, const wf_job_t *job, int rank, bool backward)
{
    return wf_pass_on(f->wc[job->widx[rank]], job, rank, backward);
}

typedef struct {
    wf_t *f;
    const wf_job_t *job;
    int rank;
    bool backward;
    stria_status_t st;
    char msg[256];
} wf_pass_arg_t;

static void *wf_pass_thread(void *arg)
{
    wf_pass_arg_t *a = arg;
    a->st = wf_pass(a->f, a->job, a->rank, a->backward);
    snprintf(a->msg, sizeof(a->msg), "%s", stria_error_msg());
    return NULL;
}

stria_status_t wf_pass_all(wf_t *f, const wf_job_t *job, bool backward)
{
    wf_pass_arg_t a[WF_MAX];
    pthread_t th[WF_MAX];
    stria_status_t st = STRIA_OK;
    for (int r = 0; r < job->n; r++) {
        a[r] = (wf_pass_arg_t){f, job, r, backward, STRIA_OK, ""};
        pthread_create(&th[r], NULL, wf_pass_thread, &a[r]);
    }
    for (int r = 0; r < job->n; r++) {
        pthread_join(th[r], NULL);
        if (a[r].st != STRIA_OK && st == STRIA_OK) {
            st = a[r].st;
            stria_error_set(st, "%s", a[r].msg);
        }
    }
    return st;
}

stria_status_t wf_get(wf_t *f, const wf_job_t *job, int rank, Stria__V1__Tensor t, void **out,
                      uint64_t *len)
{
    Stria__V1__GetOutputRequest req = STRIA__V1__GET_OUTPUT_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.job_id = job->id;
    req.rank = (uint32_t)rank;
    req.tensor = t;
    stria_status_t st = wf_call_job(f->wc[job->widx[rank]], STRIA_RPC_WORKER_GET_OUTPUT, &req.base,
                                    NULL, 0, job, &rep);
    if (st != STRIA_OK)
        return st;
    *len = rep.payload_len;
    *out = malloc(rep.payload_len + 1);
    memcpy(*out, rep.payload, rep.payload_len);
    stria_rpc_reply_free(&rep);
    return STRIA_OK;
}

stria_status_t wf_drop(wf_t *f, int widx, const wf_job_t *job)
{
    Stria__V1__DropJobRequest req = STRIA__V1__DROP_JOB_REQUEST__INIT;
    req.job_id = job->id;
    return wf_call_job(f->wc[widx], STRIA_RPC_WORKER_DROP_JOB, &req.base, NULL, 0, job, NULL);
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
