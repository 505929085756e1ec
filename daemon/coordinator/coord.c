/* The coordinator: its periodic work (the tick: heartbeat and TTL timers,
 * arrival deadlines, the end of the recovery window, the history pruned),
 * start and stop. It stands above every other room: the job table is in
 * coord_jobs.c, the service's handlers in coord_workers.c and
 * coord_clients.c (the rooms are listed in coord_int.h). Everything runs on
 * the RPC loop thread. */
#include "coord_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- periodic work ------------------------------------------------------- */

/* The loop's own stall since the last tick, in seconds (0 when the tick came
 * within a tick period of its time). A stalled loop (a slow handler, a
 * stopped process, an overloaded host) has the heartbeats that arrived
 * meanwhile still unread when this tick runs, so worker and job deadlines
 * move by the stall. A stall of a heartbeat period or more is logged and
 * counted. */
/* The period of the coordinator's tick: a quarter heartbeat period. */
static double stria__tick_period(const stria_coord_t *co)
{
    return co->heartbeat_period_s / 4;
}

static double stria__tick_stall(stria_coord_t *co, double now)
{
    double tick = stria__tick_period(co), late = now - co->last_tick - tick;
    co->last_tick = now;
    if (late <= tick)
        return 0;
    if (late >= co->heartbeat_period_s) {
        stria_log_warn("the coordinator's loop stalled for %.3f s: worker and job deadlines "
                       "move by as much",
                       late);
        stria__cmet_count_stall(co, late);
    }
    return late;
}

/* Workers silent past their deadline are dead; dead and departed ones
 * silent past the retention are forgotten. */
static bool stria__tick_workers(stria_coord_t *co, double now, double stall)
{
    double dead_after = STRIA__DEAD_PERIODS * co->heartbeat_period_s;
    bool changed = false;

    /* Every death of this tick first, then their jobs: a replacement must
     * not take a worker that died in the same tick. A worker whose deadline
     * falls before the next tick dies with them: workers that went silent
     * together (a host going down) are replaced in one go, not one tick
     * apart. */
    bool any = false;
    for (int round = 0; round < 2; round++) {
        double after = round == 0 ? dead_after : dead_after - stria__tick_period(co);
        for (uint32_t i = 0; i < co->n_workers && (round == 0 || any); i++) {
            stria__cworker_t *w = co->workers[i];
            if (round == 0 && stall > 0 && !w->dead)
                w->last_seen = w->last_seen + stall < now ? w->last_seen + stall : now;
            if (w->dead || now - w->last_seen <= after)
                continue;
            w->dead = w->died_now = true;
            w->current_job = 0;
            w->in_use = 0;
            any = true;
        }
    }
    for (uint32_t i = 0; i < co->n_workers; i++) {
        stria__cworker_t *w = co->workers[i];
        char why[128];
        if (!w->died_now)
            continue;
        w->died_now = false;
        snprintf(why, sizeof(why), "missed %d heartbeats (silent for %.1f s)", STRIA__DEAD_PERIODS,
                 now - w->last_seen);
        stria_log_warn("worker %llu (%s, %s) is dead: %s", (unsigned long long)w->id, w->host,
                       w->rpc_address, why);
        stria__cmet_count_error(co, STRIA__E_WORKER_DEAD);
        stria__cjob_fail_worker(co, w, why);
        stria__replace_lost(co, w);
        stria__recover_worker_gone(co, w);
        changed = true;
    }
    for (uint32_t i = 0; i < co->n_workers;) {
        stria__cworker_t *w = co->workers[i];
        if (w->dead && now - w->last_seen > co->worker_retention_s) {
            char why[96];
            snprintf(why, sizeof(why), "%s %.0f s ago", w->left ? "left" : "last heard of",
                     now - w->last_seen);
            stria__cworker_forget(co, w, why); /* the next one moves to i */
            changed = true;
        } else {
            i++;
        }
    }
    return changed;
}

static void stria__coord_on_tick(void *arg)
{
    stria_coord_t *co = arg;
    double now = stria_time_now();
    double stall = stria__tick_stall(co, now);
    bool changed = stria__tick_workers(co, now, stall);
    changed = stria__recover_tick(co, now) || changed;
    changed = stria__replace_tick(co, now) || changed;

    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (stall > 0 && !stria__terminal(j->state)) {
            j->last_activity = j->last_activity + stall < now ? j->last_activity + stall : now;
            if (j->arrival_deadline > 0) /* the late tick's own stall is no rank's lateness */
                j->arrival_deadline += stall;
        }
        changed = stria__cjob_arrival_expired(co, j, now) || changed;
        if (stria__terminal(j->state) || now - j->last_activity <= j->spec.ttl_s)
            continue;
        stria__cjob_finish(co, j, S_EXPIRED, "abandoned: no client activity for %u s (its TTL)",
                           j->spec.ttl_s);
        changed = true;
    }
    if (changed)
        stria__cjob_schedule(co);
    /* Only here: handlers may hold pointers to finished jobs. */
    stria__cjob_prune(co);
    stria__cmet_update(co);
}

/* ---- lifecycle ----------------------------------------------------------- */

stria_status_t stria__coord_start(const stria_coord_params_t *p, bool no_thread,
                                  stria_coord_t **coord_out)
{
    /* Every request but a job spec (documents: up to about 600 KiB) and a
     * heartbeat (STRIA_COORD_MAX_HEARTBEAT_BYTES) is small: larger ones are
     * refused before they are read. */
#define STRIA__SMALL .max_pb_bytes = STRIA__COORD_SMALL_REQUEST
    static const stria_rpc_method_t methods[STRIA_RPC_COORDINATOR_N_METHODS] = {
        STRIA_RPC_SERVE(COORDINATOR_REGISTER_WORKER, .handler = stria__cworker_on_register,
                        .flags = STRIA_RPC_METHOD_WORKER, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_HEARTBEAT, .handler = stria__cworker_on_heartbeat,
                        .flags = STRIA_RPC_METHOD_WORKER,
                        .max_pb_bytes = STRIA_COORD_MAX_HEARTBEAT_BYTES),
        STRIA_RPC_SERVE(COORDINATOR_REPORT_JOB, .handler = stria__cworker_on_report,
                        .flags = STRIA_RPC_METHOD_WORKER, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_SUBMIT_JOB, .handler = stria__cclient_on_submit,
                        .flags = STRIA_RPC_METHOD_CLIENT),
        /* Any role: the handler tells owners, admins and workers apart. */
        STRIA_RPC_SERVE(COORDINATOR_GET_JOB, .handler = stria__cclient_on_get_job, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_RELEASE_JOB, .handler = stria__cclient_on_release,
                        .flags = STRIA_RPC_METHOD_CLIENT, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_CANCEL_JOB, .handler = stria__cclient_on_cancel,
                        .flags = STRIA_RPC_METHOD_ADMIN, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_GET_STATUS, .handler = stria__cclient_on_status, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_GET_RING, .handler = stria__cclient_on_ring, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_LIST_WORKERS, .handler = stria__cclient_on_list_workers,
                        STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_LIST_JOBS, .handler = stria__cclient_on_list_jobs,
                        .flags = STRIA_RPC_METHOD_ADMIN, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_DRAIN_WORKER, .handler = stria__cclient_on_drain,
                        .flags = STRIA_RPC_METHOD_ADMIN, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_DEREGISTER_WORKER, .handler = stria__cworker_on_deregister,
                        .flags = STRIA_RPC_METHOD_WORKER, STRIA__SMALL),
    };
#undef STRIA__SMALL
    stria_rpc_server_params_t sp;
    stria_coord_t *co;
    stria_status_t st;

    if (p == NULL || coord_out == NULL || p->listen == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "coordinator: a listen address is required");
    if (p->heartbeat_period_s < 0 || p->heartbeat_period_s > 3600 ||
        !isfinite(p->heartbeat_period_s))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: heartbeat period must be in (0, 3600] seconds");
    if (p->job_ttl_s < 0 || p->job_ttl_s > STRIA_COORD_MAX_TTL_S || !isfinite(p->job_ttl_s))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: job TTL must be in (0, %u] seconds",
                               STRIA_COORD_MAX_TTL_S);
    if (!(p->max_step_timeout_s >= 0 && p->max_step_timeout_s <= STRIA_COORD_MAX_STEP_TIMEOUT_S))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: the largest step timeout must be in (0, %u] seconds",
                               STRIA_COORD_MAX_STEP_TIMEOUT_S);
    if (!(p->worker_retention_s >= 0 && p->worker_retention_s <= 365 * 86400.0))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: worker retention must be in (0, 1 year]");
    if (!(p->recovery_window_s <= 3600.0) || isnan(p->recovery_window_s))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: the recovery window must be at most 3600 s (got %g)",
                               p->recovery_window_s);
    if (stria__v1__coordinator__descriptor.n_methods != STRIA_RPC_COORDINATOR_N_METHODS)
        return stria_error_set(STRIA_ERR_INTERNAL, "coordinator: service has %u methods, not %d",
                               stria__v1__coordinator__descriptor.n_methods,
                               STRIA_RPC_COORDINATOR_N_METHODS);
    bool has_client = p->token != NULL && p->token[0] != '\0';
    bool has_worker = p->worker_token != NULL && p->worker_token[0] != '\0';
    bool has_admin = p->admin_token != NULL && p->admin_token[0] != '\0';
    if ((has_client || has_worker || has_admin) && !(has_client && has_worker)) {
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: with credentials, both the client and the worker "
                               "credential are needed (missing: %s)",
                               !has_client && !has_worker ? "client, worker"
                               : !has_client              ? "client"
                                                          : "worker");
    }
    co = calloc(1, sizeof(*co));
    if (co == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "coordinator: out of memory");
    co->heartbeat_period_s = p->heartbeat_period_s > 0 ? p->heartbeat_period_s : 1.0;
    co->job_ttl_s = p->job_ttl_s > 0 ? p->job_ttl_s : 600.0;
    co->max_workers = p->max_workers ? p->max_workers : 4096;
    co->max_jobs = p->max_jobs ? p->max_jobs : 4096;
    co->history = p->history ? p->history : 1024;
    co->max_jobs_per_client = p->max_jobs_per_client ? p->max_jobs_per_client : 256;
    co->max_sessions_per_client = p->max_sessions_per_client ? p->max_sessions_per_client : 256;
    co->max_session_bytes_per_client = p->max_session_bytes_per_client;
    co->max_step_timeout_ms =
        (uint32_t)ceil(1000.0 * (p->max_step_timeout_s > 0 ? p->max_step_timeout_s : 600.0));
    co->worker_retention_s = p->worker_retention_s > 0 ? p->worker_retention_s : 3600.0;
    co->recovery_window_s = p->recovery_window_s > 0    ? p->recovery_window_s
                            : p->recovery_window_s == 0 ? 3 * co->heartbeat_period_s
                                                        : 0;
    stria__index_init(&co->worker_ids);
    stria__index_init(&co->job_ids);
    stria__index_init(&co->members);
    co->auth_required = has_client;
    co->metrics = p->metrics;
    co->notify_status = p->notify_status;
    stria__cmet_init(co);
    co->started_at = stria_time_now();
    co->last_tick = co->started_at;
    co->started_ms = stria__coord_wall_ms();
    co->recover_until = co->recovery_window_s > 0 ? co->started_at + co->recovery_window_s : 0;
    co->missing.dead = true;
    snprintf(co->missing.rpc_address, sizeof(co->missing.rpc_address), "(not reported)");
    snprintf(co->missing.host, sizeof(co->missing.host), "(not reported)");
    co->next_worker_id = 1;
    co->workers = calloc(co->max_workers, sizeof(*co->workers));
    if (co->workers == NULL) {
        free(co);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "coordinator: out of memory");
    }

    memset(&sp, 0, sizeof(sp));
    sp.listen = p->listen;
    sp.service = &stria__v1__coordinator__descriptor;
    sp.methods = methods;
    sp.ctx = co;
    sp.token = p->token;
    sp.worker_token = p->worker_token;
    sp.admin_token = p->admin_token;
    sp.tick = stria__coord_on_tick;
    /* Dead workers are noticed within a quarter period of the deadline. */
    sp.tick_period_s = stria__tick_period(co);
    sp.name = "coordinator";
    sp.no_thread = no_thread;
    st = stria_rpc_server_start(&sp, &co->server);
    if (st != STRIA_OK) {
        free(co->workers);
        free(co);
        return st;
    }
    if (co->auth_required && !has_admin)
        stria_log_warn("coordinator: no admin credential: nobody may drain, cancel or list jobs");
    else if (!co->auth_required)
        stria_log_warn("coordinator: no credentials: every connection is client, worker and "
                       "admin");
    *coord_out = co;
    return STRIA_OK;
}

stria_status_t stria_coord_start(const stria_coord_params_t *p, stria_coord_t **coord_out)
{
    return stria__coord_start(p, false, coord_out);
}

uint16_t stria_coord_port(const stria_coord_t *co)
{
    return stria_rpc_server_port(co->server);
}

const stria_rpc_server_t *stria_coord_server(const stria_coord_t *co)
{
    return co->server;
}

void stria_coord_stop(stria_coord_t *co)
{
    if (co == NULL)
        return;
    stria_rpc_server_stop(co->server);
    /* The loop thread is gone: the tables are ours. The workers keep their
     * jobs for a coordinator started again (it rebuilds them); say in the
     * log which jobs this one leaves. */
    for (uint32_t i = 0; i < co->n_jobs; i++)
        if (stria__cjob_finish(co, co->jobs[i], S_FAILED,
                               "the coordinator shut down (its workers keep the job for a "
                               "restarted coordinator)"))
            stria__cjob_retryable(co->jobs[i], NULL);
    stria__recover_free(co);
    for (uint32_t i = 0; i < co->n_workers; i++) { /* the others go with their last job */
        co->workers[i]->forgotten = true;
        if (co->workers[i]->job_refs == 0)
            free(co->workers[i]);
    }
    for (uint32_t i = 0; i < co->n_jobs; i++)
        stria__cjob_free(co, co->jobs[i]);
    free(co->jobs);
    free(co->workers);
    stria__index_free(&co->worker_ids);
    stria__index_free(&co->job_ids);
    stria__index_free(&co->members);
    free(co);
}
