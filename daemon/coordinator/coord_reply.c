/* The coordinator's replies: worker and job records and assignments, built
 * on a scratch list (coord_scratch.c), and the sending of a reply so built.
 * Everything runs on the RPC loop thread. */
#include "coord_int.h"

/* Replies, or fails the call when building ran out of memory. */
void stria__reply_send(stria__scratch_t *b, stria_rpc_call_t *call, const ProtobufCMessage *msg)
{
    if (b->oom)
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "the coordinator ran out of memory");
    else
        stria_rpc_call_reply(call, msg, NULL, 0, NULL, NULL);
    stria__scratch_free(b);
}

void stria__reply_worker(stria__scratch_t *b, const stria_coord_t *co, stria__cworker_t *w,
                         int ring_index, Stria__V1__WorkerInfo *out)
{
    double now = stria_time_now();
    double age_ms = (now - w->last_seen) * 1000.0;
    uint32_t n = 0;

    stria__v1__worker_info__init(out);
    out->worker_id = w->id;
    out->state = stria__worker_state(w);
    out->host = w->host;
    out->device = w->device;
    out->rpc_address = w->rpc_address;
    out->ucx_address = w->ucx_address;
    out->memory_bytes = w->memory_bytes;
    out->memory_reserved_bytes = w->reserved;
    out->memory_in_use_bytes = w->in_use;
    out->pool_reserved_bytes = w->pool[0];
    out->pool_in_use_bytes = w->pool[1];
    out->pool_high_water_bytes = w->pool[2];
    out->pool_committed_bytes = w->pool[3];
    out->heartbeat_age_ms = age_ms > UINT32_MAX ? UINT32_MAX : (uint32_t)age_ms;
    out->software_version = w->version;
    out->kernel_variant = w->kernel_variant;
    out->current_job_id = w->current_job;
    out->step = w->step;
    out->steps_total = w->steps_total;
    out->ring_index = ring_index;
    out->draining = w->draining;
    out->registered_ms = w->registered_ms;
    out->shm_socket = w->shm_socket;
    out->has_device_index = w->has_device_index;
    out->device_index = w->device_index;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        const stria__cjob_t *j = co->jobs[i];
        if (j->reserved && stria__cjob_has_worker(j, w))
            n++;
    }
    if (n == 0)
        return;
    out->job_ids = stria__scratch_alloc(b, n * sizeof(uint64_t));
    if (out->job_ids == NULL)
        return;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        const stria__cjob_t *j = co->jobs[i];
        if (j->reserved && stria__cjob_has_worker(j, w))
            out->job_ids[out->n_job_ids++] = j->id;
    }
}

Stria__V1__Assignment *stria__reply_assignment(stria__scratch_t *b, const stria__cjob_t *j)
{
    Stria__V1__Assignment *a = stria__scratch_alloc(b, sizeof(*a));
    Stria__V1__JobSpec *spec = stria__scratch_alloc(b, sizeof(*spec));
    Stria__V1__RankAssignment **ranks = stria__scratch_alloc(b, j->n_ranks * sizeof(*ranks));

    if (a == NULL || spec == NULL || ranks == NULL)
        return NULL;
    stria__v1__assignment__init(a);
    *spec = j->spec;
    if (!stria__cjob_placement(b, j, spec))
        return NULL;
    a->job_id = j->id;
    a->spec = spec;
    a->max_tokens_per_rank = j->shard_tokens;
    a->memory_per_rank_bytes = j->mem_per_rank;
    a->ranks = ranks;
    for (uint32_t r = 0; r < j->n_ranks; r++) {
        const stria__crank_t *cr = &j->ranks[r];
        Stria__V1__RankAssignment *ra = stria__scratch_alloc(b, sizeof(*ra));
        Stria__V1__PositionRun **runs = stria__scratch_alloc(b, (cr->n_runs + 1) * sizeof(*runs));
        if (ra == NULL || runs == NULL)
            return NULL;
        stria__v1__rank_assignment__init(ra);
        ra->rank = r;
        ra->worker_id = cr->worker->id;
        ra->host = (char *)cr->worker->host;
        ra->device = (char *)cr->worker->device;
        ra->rpc_address = (char *)cr->worker->rpc_address;
        ra->ucx_address = (char *)cr->worker->ucx_address;
        ra->shm_socket = (char *)cr->worker->shm_socket;
        ra->placement_fallback = cr->fallback;
        ra->has_device_index = cr->worker->has_device_index;
        ra->device_index = cr->worker->device_index;
        ra->tokens = cr->tokens;
        ra->runs = runs;
        for (size_t k = 0; k < cr->n_runs; k++) {
            Stria__V1__PositionRun *pr = stria__scratch_alloc(b, sizeof(*pr));
            if (pr == NULL)
                return NULL;
            stria__v1__position_run__init(pr);
            pr->first = (uint64_t)cr->runs[k].first;
            pr->stride = (uint64_t)cr->runs[k].stride;
            pr->count = (uint64_t)cr->runs[k].count;
            runs[ra->n_runs++] = pr;
        }
        ranks[a->n_ranks++] = ra;
    }
    return a;
}

Stria__V1__JobInfo *stria__reply_job(stria__scratch_t *b, const stria_coord_t *co,
                                     const stria__cjob_t *j)
{
    Stria__V1__JobInfo *info = stria__scratch_alloc(b, sizeof(*info));
    Stria__V1__JobTimings *t = stria__scratch_alloc(b, sizeof(*t));
    uint64_t idle_ms;

    if (info == NULL || t == NULL)
        return NULL;
    stria__v1__job_info__init(info);
    info->job_id = j->id;
    info->state = j->state;
    info->assignment = stria__reply_assignment(b, j);
    info->timings = t;
    info->failure = (char *)j->failure;
    info->failure_retryable = j->failure_retryable;
    info->failure_status = j->state == S_FAILED ? j->failure_status : 0;
    if (j->blamed_worker != 0) {
        info->blamed_worker_ids = (uint64_t *)&j->blamed_worker;
        info->n_blamed_worker_ids = 1;
    }
    info->queue_position = stria__cjob_queue_position(co, j);
    info->replaced_by = j->replaced_by;
    info->replaces = j->replaces;
    info->generation = j->generation;
    info->replacement_pending = stria__replace_pending(j);
    if (j->spec.session &&
        (info->session = stria__scratch_alloc(b, sizeof(*info->session))) != NULL) {
        Stria__V1__SessionStats *ss = info->session;
        stria__v1__session_stats__init(ss);
        for (uint32_t r = 0; r < j->n_ranks; r++) {
            const stria__crank_t *cr = &j->ranks[r];
            ss->calls = r == 0 || cr->s_calls < ss->calls ? cr->s_calls : ss->calls;
            ss->failed_calls = cr->s_failed > ss->failed_calls ? cr->s_failed : ss->failed_calls;
            ss->bytes += cr->s_bytes;
            ss->call_p50_ms = cr->s_p50_ms > ss->call_p50_ms ? cr->s_p50_ms : ss->call_p50_ms;
            ss->call_p99_ms = cr->s_p99_ms > ss->call_p99_ms ? cr->s_p99_ms : ss->call_p99_ms;
        }
    }
    *t = j->times;
    idle_ms = (uint64_t)((stria_time_now() - j->last_activity) * 1000.0);
    t->last_activity_ms = stria__coord_wall_ms() - idle_ms;
    if (j->state == S_RUNNING_FORWARD || j->state == S_RUNNING_BACKWARD) {
        info->step = UINT32_MAX;
        for (uint32_t r = 0; r < j->n_ranks; r++) {
            if (j->ranks[r].step < info->step)
                info->step = j->ranks[r].step;
            if (j->ranks[r].steps_total > info->steps_total)
                info->steps_total = j->ranks[r].steps_total;
        }
    }
    return info->assignment != NULL ? info : NULL;
}
