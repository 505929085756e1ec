/* The coordinator's metrics: its Prometheus series (errors by kind, jobs
 * finished by state, passes, loop stalls, worker and job gauges) and the
 * STATUS= line for the service manager. Everything runs on the RPC loop
 * thread. */
#include "coord_int.h"

#include <stdio.h>
#include <string.h>

static const char *const stria__error_kinds[STRIA__E_COUNT] = {
    "submit_invalid", "submit_no_workers", "submit_no_memory", "submit_busy",
    "pass_failed",    "worker_dead",       "worker_restarted", "bad_request"};

/* Prometheus-friendly state names ("running_forward"). */
static void stria__state_label(Stria__V1__JobState s, char *out, size_t len)
{
    size_t n = 0;
    for (const char *p = stria__state_name(s); *p && n + 1 < len; p++)
        out[n++] = *p == ' ' ? '_' : *p;
    out[n] = '\0';
}

static stria_metric_t *stria__cmet_labeled(stria_coord_t *co, stria_metric_kind_t kind,
                                           const char *name, const char *help, const char *key,
                                           const char *value)
{
    char labels[96];
    snprintf(labels, sizeof(labels), "%s=\"%s\"", key, value);
    return stria_metrics_get(co->metrics, kind, name, help, labels, NULL, 0);
}

void stria__cmet_count_error(stria_coord_t *co, stria__error_kind_t kind)
{
    if (co->metrics == NULL)
        return;
    stria_metric_add(stria__cmet_labeled(co, STRIA_METRIC_COUNTER, "stria_coordinator_errors_total",
                                         "Errors seen by the coordinator, by kind.", "kind",
                                         stria__error_kinds[kind]),
                     1);
}

void stria__cmet_count_finished(stria_coord_t *co, Stria__V1__JobState state)
{
    char name[32];
    if (co->metrics == NULL)
        return;
    stria__state_label(state, name, sizeof(name));
    stria_metric_add(
        stria__cmet_labeled(co, STRIA_METRIC_COUNTER, "stria_coordinator_jobs_finished_total",
                            "Jobs that reached a terminal state, by that state.", "state", name),
        1);
}

static stria_metric_t *stria__cmet_submitted(stria_coord_t *co)
{
    return stria_metrics_get(co->metrics, STRIA_METRIC_COUNTER,
                             "stria_coordinator_jobs_submitted_total", "Jobs admitted since start.",
                             NULL, NULL, 0);
}

void stria__cmet_count_submitted(stria_coord_t *co)
{
    if (co->metrics == NULL)
        return;
    stria_metric_add(stria__cmet_submitted(co), 1);
}

static stria_metric_t *stria__cmet_passes(stria_coord_t *co, bool backward)
{
    return stria_metrics_get(co->metrics, STRIA_METRIC_COUNTER, "stria_coordinator_passes_total",
                             "Ring passes completed by every rank of a job.",
                             backward ? "pass=\"backward\"" : "pass=\"forward\"", NULL, 0);
}

static stria_metric_t *stria__cmet_pass_seconds(stria_coord_t *co, bool backward)
{
    static const double buckets[] = {0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 120, 600};
    return stria_metrics_get(co->metrics, STRIA_METRIC_HISTOGRAM, "stria_coordinator_pass_seconds",
                             "Wall time of a job's ring pass, from its first rank starting to its "
                             "last rank done.",
                             backward ? "pass=\"backward\"" : "pass=\"forward\"", buckets,
                             sizeof(buckets) / sizeof(buckets[0]));
}

/* A pass completed on every rank; times in Unix milliseconds. */
void stria__cmet_count_pass(stria_coord_t *co, bool backward, uint64_t started_ms, uint64_t done_ms)
{
    if (co->metrics == NULL)
        return;
    stria_metric_add(stria__cmet_passes(co, backward), 1);
    if (started_ms != 0 && done_ms >= started_ms)
        stria_metric_observe(stria__cmet_pass_seconds(co, backward),
                             (double)(done_ms - started_ms) / 1000.0);
}

/* Series that exist from the start, so that rates and alerts see zeros. */
void stria__cmet_init(stria_coord_t *co)
{
    static const Stria__V1__JobState finished[] = {S_FAILED, S_CANCELLED, S_RELEASED, S_EXPIRED};
    if (co->metrics == NULL)
        return;
    for (int k = 0; k < STRIA__E_COUNT; k++)
        stria__cmet_labeled(co, STRIA_METRIC_COUNTER, "stria_coordinator_errors_total",
                            "Errors seen by the coordinator, by kind.", "kind",
                            stria__error_kinds[k]);
    for (size_t k = 0; k < sizeof(finished) / sizeof(finished[0]); k++) {
        char name[32];
        stria__state_label(finished[k], name, sizeof(name));
        stria__cmet_labeled(co, STRIA_METRIC_COUNTER, "stria_coordinator_jobs_finished_total",
                            "Jobs that reached a terminal state, by that state.", "state", name);
    }
    stria__cmet_submitted(co);
    stria__cmet_count_stall(co, 0); /* the series exist from the start */
    for (int b = 0; b < 2; b++) {
        stria__cmet_passes(co, b == 1);
        stria__cmet_pass_seconds(co, b == 1);
    }
}

/* The series of a worker's gauges, found once and kept with the worker (a
 * lookup walks every series of the family). */
static void stria__cmet_worker_get(stria_coord_t *co, stria__cworker_t *w)
{
    char addr[2 * STRIA__COORD_STR], host[2 * STRIA__COORD_STR], labels[5 * STRIA__COORD_STR];
    stria_metrics_escape(w->rpc_address, addr, sizeof(addr));
    stria_metrics_escape(w->host, host, sizeof(host));
    snprintf(labels, sizeof(labels), "worker=\"%llu\",address=\"%s\",host=\"%s\"",
             (unsigned long long)w->id, addr, host);
    w->m_age = stria_metrics_get(co->metrics, STRIA_METRIC_GAUGE,
                                 "stria_coordinator_worker_heartbeat_age_seconds",
                                 "Seconds since each worker's last heartbeat.", labels, NULL, 0);
    w->m_in_use = stria_metrics_get(
        co->metrics, STRIA_METRIC_GAUGE, "stria_coordinator_worker_memory_in_use_bytes",
        "Memory each worker reports in use by its jobs.", labels, NULL, 0);
    w->m_reserved = stria_metrics_get(co->metrics, STRIA_METRIC_GAUGE,
                                      "stria_coordinator_worker_memory_reserved_bytes",
                                      "Memory the coordinator reserved on each worker for "
                                      "active jobs.",
                                      labels, NULL, 0);
}

void stria__cmet_worker_forget(stria_coord_t *co, stria__cworker_t *w)
{
    char match[48];
    w->m_age = w->m_in_use = w->m_reserved = NULL;
    if (co->metrics == NULL)
        return;
    snprintf(match, sizeof(match), "worker=\"%llu\"", (unsigned long long)w->id);
    stria_metrics_forget(co->metrics, match);
}

void stria__cmet_count_stall(stria_coord_t *co, double seconds)
{
    if (co->metrics == NULL)
        return;
    stria_metric_add(stria_metrics_get(co->metrics, STRIA_METRIC_COUNTER,
                                       "stria_coordinator_loop_stalls_total",
                                       "Stalls of the coordinator's loop of a heartbeat "
                                       "period or more (worker and job deadlines moved).",
                                       NULL, NULL, 0),
                     seconds > 0 ? 1 : 0);
    stria_metric_add(stria_metrics_get(co->metrics, STRIA_METRIC_COUNTER,
                                       "stria_coordinator_loop_stall_seconds_total",
                                       "Seconds the coordinator's loop was stalled.", NULL, NULL,
                                       0),
                     seconds);
}

/* A short summary for `systemctl status` (STATUS=). */
static void stria__notify_status(stria_coord_t *co, const uint32_t nw[4], uint32_t active,
                                 uint32_t pending)
{
    char status[sizeof(co->last_status)];
    if (!co->notify_status)
        return;
    snprintf(status, sizeof(status),
             "STATUS=workers: %u in the ring, %u draining, %u dead, %u left; jobs: %u active, "
             "%u pending",
             nw[0], nw[1], nw[2], nw[3], active, pending);
    if (strcmp(status, co->last_status) == 0)
        return;
    snprintf(co->last_status, sizeof(co->last_status), "%s", status);
    stria_notify(status);
}

void stria__cmet_update(stria_coord_t *co)
{
    static const char *const wstates[] = {"healthy", "draining", "dead", "left"};
    uint32_t nw[4] = {0, 0, 0, 0};
    uint32_t nj[S_EXPIRED + 1] = {0};
    uint32_t active = 0;
    double now = stria_time_now();

    for (uint32_t i = 0; i < co->n_workers; i++)
        nw[stria__worker_state(co->workers[i]) - 1]++;
    for (uint32_t i = 0; i < co->n_jobs; i++)
        nj[co->jobs[i]->state]++;
    for (int s = S_LOADING; s <= S_DONE; s++)
        active += nj[s];
    stria__notify_status(co, nw, active, nj[S_PENDING]);
    if (co->metrics == NULL)
        return;
    for (int k = 0; k < 4; k++)
        stria_metric_set(stria__cmet_labeled(co, STRIA_METRIC_GAUGE, "stria_coordinator_workers",
                                             "Registered workers by state.", "state", wstates[k]),
                         nw[k]);
    for (int s = S_PENDING; s <= S_DONE; s++) {
        char name[32];
        stria__state_label((Stria__V1__JobState)s, name, sizeof(name));
        stria_metric_set(stria__cmet_labeled(co, STRIA_METRIC_GAUGE, "stria_coordinator_jobs",
                                             "Pending and active jobs by state.", "state", name),
                         nj[s]);
    }
    for (uint32_t i = 0; i < co->n_workers; i++) {
        stria__cworker_t *w = co->workers[i];
        if (w->m_age == NULL)
            stria__cmet_worker_get(co, w);
        stria_metric_set(w->m_age, now - w->last_seen);
        stria_metric_set(w->m_in_use, (double)w->in_use);
        stria_metric_set(w->m_reserved, (double)w->reserved);
    }
    stria_metric_set(stria_metrics_get(co->metrics, STRIA_METRIC_GAUGE,
                                       "stria_coordinator_uptime_seconds",
                                       "Seconds since the coordinator started.", NULL, NULL, 0),
                     now - co->started_at);
}
