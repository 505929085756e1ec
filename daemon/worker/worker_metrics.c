/* The worker's metrics: every series made at start, and the gauges the
 * heartbeat thread sets (what the ring link refused, the C heap). */
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "worker_int.h"

/* ---- configuration --------------------------------------------------------------- */

static const char refused_help[] =
    "What the ring link refused, by reason: data_dropped (a data block from an endpoint not "
    "bound to its slot), handshake_refused (a wrong or missing endpoint or ring key proof), "
    "handshake_timeout (an accepted endpoint not trusted in time), connection_rejected (too "
    "many untrusted endpoints from one source), bind_refused (a bind with a wrong or missing "
    "ring key proof), bind_replayed (a bind whose counter was used before on its endpoint), "
    "version (a peer of another link protocol version).";
static const char *const refused_labels[7] = {"reason=\"data_dropped\"",
                                              "reason=\"handshake_refused\"",
                                              "reason=\"handshake_timeout\"",
                                              "reason=\"connection_rejected\"",
                                              "reason=\"bind_refused\"",
                                              "reason=\"bind_replayed\"",
                                              "reason=\"version\""};
static const char ev_help[] =
    "Pooled ring endpoints to peer workers, by event: made (its handshake done), replaced (a "
    "stale one replaced, or a restarted peer's), dropped (closed after it was made).";
static const char *const ev_labels[3] = {"event=\"made\"", "event=\"replaced\"",
                                         "event=\"dropped\""};
static const char binds_help[] =
    "Ring links bound on this worker's pooled endpoints (one per link, the predecessor's bind).";
static const char late_help[] = "Ring data blocks dropped because their link had failed or was "
                                "gone (a neighbour's last blocks; not an attack).";
static const char endpoints_help[] = "Pooled ring endpoints ready now (to and from peer workers).";

/* The two counters of a family whose label takes two values. */
static void counter_pair(stria_metrics_t *m, const char *name, const char *help, const char *label0,
                         const char *label1, stria_metric_t **out0, stria_metric_t **out1)
{
    *out0 = stria_metrics_get(m, STRIA_METRIC_COUNTER, name, help, label0, NULL, 0);
    *out1 = stria_metrics_get(m, STRIA_METRIC_COUNTER, name, help, label1, NULL, 0);
}

void stria__wmet_init(stria_worker_t *w)
{
    static const double step_buckets[] = {0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30};
    static const double call_buckets[] = {0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005,
                                          0.01,   0.05,   0.1,    0.5,   1,     5};
    static const double pass_buckets[] = {0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 120, 600};
    static const char *const pass_labels[2] = {"pass=\"forward\"", "pass=\"backward\""};
    stria_metrics_t *m = w->metrics;
    for (int b = 0; b < 2; b++) {
        w->m_passes[b] =
            stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_passes_total",
                              "Calls (ring passes) run by this worker.", pass_labels[b], NULL, 0);
        w->m_pass_fail[b] =
            stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_pass_failures_total",
                              "Calls (ring passes) that failed.", pass_labels[b], NULL, 0);
        w->m_pass_s[b] = stria_metrics_get(
            m, STRIA_METRIC_HISTOGRAM, "stria_worker_pass_seconds",
            "Wall time of a call on this worker, from its inputs in to its reply.", pass_labels[b],
            pass_buckets, sizeof(pass_buckets) / sizeof(double));
        w->m_call_s[b] = stria_metrics_get(
            m, STRIA_METRIC_HISTOGRAM, "stria_worker_session_call_seconds",
            "Wall time of a session call on this worker, from its inputs in to its reply.",
            pass_labels[b], call_buckets, sizeof(call_buckets) / sizeof(double));
    }
    w->m_step_compute = stria_metrics_get(m, STRIA_METRIC_HISTOGRAM, "stria_worker_step_seconds",
                                          "Time of one ring step, by kind.", "kind=\"compute\"",
                                          step_buckets, sizeof(step_buckets) / sizeof(double));
    w->m_step_wait = stria_metrics_get(m, STRIA_METRIC_HISTOGRAM, "stria_worker_step_seconds",
                                       "Time of one ring step, by kind.", "kind=\"communication\"",
                                       step_buckets, sizeof(step_buckets) / sizeof(double));
    counter_pair(m, "stria_worker_ring_bytes_total", "Bytes moved over the ring link.",
                 "direction=\"sent\"", "direction=\"received\"", &w->m_bytes_sent,
                 &w->m_bytes_recv);
    counter_pair(m, "stria_worker_rpc_bytes_total", "Tensor bytes moved to and from clients.",
                 "direction=\"in\"", "direction=\"out\"", &w->m_in_bytes, &w->m_out_bytes);
    w->m_memory = stria_metrics_get(
        m, STRIA_METRIC_GAUGE, "stria_worker_memory_in_use_bytes",
        "Memory reserved by the sessions (jobs included) this worker holds.", NULL, NULL, 0);
    static const char *const pool_labels[3] = {"pool=\"host\"", "pool=\"device\"",
                                               "pool=\"pinned\""};
    stria_mempool_t *pools[3] = {w->mem_host, w->mem_dev, w->mem_pinned};
    for (int i = 0; i < 3; i++) {
        if (pools[i] == NULL)
            continue;
        w->m_pool[i][0] =
            stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_pool_reserved_bytes",
                              "Memory a pool may hold (what the worker offers to jobs), by pool.",
                              pool_labels[i], NULL, 0);
        w->m_pool[i][1] =
            stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_pool_in_use_bytes",
                              "Memory of a pool allocated now, by pool.", pool_labels[i], NULL, 0);
        w->m_pool[i][2] = stria_metrics_get(
            m, STRIA_METRIC_GAUGE, "stria_worker_pool_high_water_bytes",
            "Most memory of a pool allocated at once, by pool.", pool_labels[i], NULL, 0);
        w->m_pool[i][3] = stria_metrics_get(
            m, STRIA_METRIC_GAUGE, "stria_worker_pool_committed_bytes",
            "Memory a pool has made usable and keeps for reuse (host: committed address space; "
            "device and pinned: segments), by pool.",
            pool_labels[i], NULL, 0);
    }
#ifdef STRIA__HAVE_MALLINFO2
    w->m_heap[0] = stria_metrics_get(
        m, STRIA_METRIC_GAUGE, "stria_worker_heap_in_use_bytes",
        "Bytes of the process's C heap (malloc) allocated now, from glibc's mallinfo2() (pool "
        "memory not included).",
        NULL, NULL, 0);
    w->m_heap[1] = stria_metrics_get(
        m, STRIA_METRIC_GAUGE, "stria_worker_heap_free_bytes",
        "Bytes the C heap's arenas hold free (not returned to the system), from glibc's "
        "mallinfo2().",
        NULL, NULL, 0);
#endif
    w->m_plans[0] = stria_metrics_get(
        m, STRIA_METRIC_GAUGE, "stria_worker_doc_plans",
        "Document plans (packed layout) the worker keeps for calls with the same documents.", NULL,
        NULL, 0);
    w->m_plans[1] = stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_doc_plan_bytes",
                                      "Memory the kept document plans hold.", NULL, NULL, 0);
    counter_pair(m, "stria_worker_doc_plan_lookups_total",
                 "Calls' document plans looked up, by result: hit (kept from an earlier call "
                 "with the same documents) or made.",
                 "result=\"hit\"", "result=\"made\"", &w->m_plans[2], &w->m_plans[3]);
    w->m_jobs = stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_jobs",
                                  "Sessions (jobs included) held by this worker.", NULL, NULL, 0);
    w->m_hb_age = stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_heartbeat_age_seconds",
                                    "Seconds since the last heartbeat the coordinator answered "
                                    "(-1: not registered).",
                                    NULL, NULL, 0);
    static const char *const err_help = "Errors, by kind: step_timeout (a ring step missed its "
                                        "deadline), peer (a ring peer failed or left), pass "
                                        "(another pass failure), coordinator (a call to the "
                                        "coordinator failed).";
    w->m_err_timeout = stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_errors_total",
                                         err_help, "kind=\"step_timeout\"", NULL, 0);
    w->m_err_peer = stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_errors_total",
                                      err_help, "kind=\"peer\"", NULL, 0);
    w->m_err_pass = stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_errors_total",
                                      err_help, "kind=\"pass\"", NULL, 0);
    w->m_err_coord = stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_errors_total",
                                       err_help, "kind=\"coordinator\"", NULL, 0);
    for (int i = 0; i < 4; i++)
        w->m_ring_refused[i] =
            stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_ring_refused_total",
                              refused_help, refused_labels[i], NULL, 0);
    /* the ring link's pooled endpoints (stria__wmet_ring() looks them up) */
    for (int i = 4; i < 7; i++)
        stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_ring_refused_total", refused_help,
                          refused_labels[i], NULL, 0);
    for (int i = 0; i < 3; i++)
        stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_ring_endpoint_events_total",
                          ev_help, ev_labels[i], NULL, 0);
    stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_ring_binds_total", binds_help, NULL,
                      NULL, 0);
    stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_ring_data_late_total", late_help, NULL,
                      NULL, 0);
    stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_ring_endpoints", endpoints_help, NULL,
                      NULL, 0);
    for (int b = 0; b < 2; b++)
        w->m_steps[b] =
            stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_ring_steps_total",
                              "Ring steps run by this worker.", pass_labels[b], NULL, 0);
    char info[512], dev[128], kern[64];
    stria_metrics_escape(stria_device_name(w->dev), dev, sizeof(dev));
    stria_metrics_escape(stria_kernels_variant(), kern, sizeof(kern));
    snprintf(info, sizeof(info), "version=\"%s\",device=\"%s\",kernel=\"%s\"", STRIA_VERSION, dev,
             kern);
    stria_metric_set(stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_info",
                                       "Constant 1, labelled with the software version, the "
                                       "device and the kernel variant.",
                                       info, NULL, 0),
                     1);
    stria__wpool_publish(w);
}

/* The ring link's pooled endpoints, one series each (replaced every time:
 * endpoints come and go). */
static void ring_endpoints(stria_worker_t *w)
{
    stria_ucx_endpoint_info_t eps[64];
    size_t n = stria_ucx_ctx_endpoints(w->ucx, eps, 64);
    stria_metrics_forget(w->metrics, "ring_endpoint=\"");
    for (size_t i = 0; i < n && i < 64; i++) {
        char peer[400], labels[600];
        stria_metrics_escape(eps[i].peer, peer, sizeof(peer));
        snprintf(labels, sizeof(labels),
                 "ring_endpoint=\"%s\",direction=\"%s\",incarnation=\"%016llx\"", peer,
                 eps[i].outgoing ? "out" : "in", (unsigned long long)eps[i].incarnation);
        stria_metric_set(stria_metrics_get(w->metrics, STRIA_METRIC_GAUGE,
                                           "stria_worker_ring_endpoint_links",
                                           "Ring links bound now on each pooled endpoint to a "
                                           "peer worker (out: to a successor's listener; in: "
                                           "accepted from a predecessor).",
                                           labels, NULL, 0),
                         eps[i].links);
        stria_metric_set(stria_metrics_get(w->metrics, STRIA_METRIC_GAUGE,
                                           "stria_worker_ring_endpoint_age_seconds",
                                           "Seconds since each pooled ring endpoint was made.",
                                           labels, NULL, 0),
                         eps[i].age_s);
    }
}

/* Adds what a counter of the ring link's stats grew by since it was seen. */
static void grew(stria_worker_t *w, const char *name, const char *help, const char *labels,
                 uint64_t now, uint64_t seen)
{
    if (now > seen)
        stria_metric_add(
            stria_metrics_get(w->metrics, STRIA_METRIC_COUNTER, name, help, labels, NULL, 0),
            (double)(now - seen));
}

void stria__wmet_ring(stria_worker_t *w)
{
    stria_ucx_ctx_stats_t s;
    const stria_ucx_ctx_stats_t *o = &w->ring_seen;
    if (w->ucx == NULL)
        return;
    stria_ucx_ctx_stats(w->ucx, &s);
    const uint64_t now[7] = {s.data_dropped,         s.handshakes_refused, s.handshakes_timed_out,
                             s.connections_rejected, s.binds_refused,      s.binds_replayed,
                             s.version_refused};
    const uint64_t seen[7] = {
        o->data_dropped,  o->handshakes_refused, o->handshakes_timed_out, o->connections_rejected,
        o->binds_refused, o->binds_replayed,     o->version_refused};
    for (int i = 0; i < 4; i++)
        if (now[i] > seen[i])
            stria_metric_add(w->m_ring_refused[i], (double)(now[i] - seen[i]));
    for (int i = 4; i < 7; i++)
        grew(w, "stria_worker_ring_refused_total", refused_help, refused_labels[i], now[i],
             seen[i]);
    const uint64_t ev_now[3] = {s.endpoints_made, s.endpoints_replaced, s.endpoints_dropped};
    const uint64_t ev_seen[3] = {o->endpoints_made, o->endpoints_replaced, o->endpoints_dropped};
    for (int i = 0; i < 3; i++)
        grew(w, "stria_worker_ring_endpoint_events_total", ev_help, ev_labels[i], ev_now[i],
             ev_seen[i]);
    grew(w, "stria_worker_ring_binds_total", binds_help, NULL, s.binds_done, o->binds_done);
    grew(w, "stria_worker_ring_data_late_total", late_help, NULL, s.data_late, o->data_late);
    stria_metric_set(stria_metrics_get(w->metrics, STRIA_METRIC_GAUGE,
                                       "stria_worker_ring_endpoints", endpoints_help, NULL, NULL,
                                       0),
                     (double)s.endpoints_open);
    ring_endpoints(w);
    w->ring_seen = s;
}

#ifdef STRIA__HAVE_MALLINFO2
/* One mallinfo2() at a time in the process: where another allocator serves
 * malloc (the sanitizers', a preloaded jemalloc), glibc's heap is set up by
 * the first mallinfo2() itself, and that set-up assumes one thread; two
 * workers of one process heartbeating at once corrupted it (a crash in
 * int_mallinfo, or glibc's "a->attached_threads > 0" at a thread's exit). */
static pthread_mutex_t mallinfo_lock = PTHREAD_MUTEX_INITIALIZER;
#endif

void stria__wmet_plans(stria_worker_t *w)
{
    stria_docplan_cache_t *cache = stria_docplan_shared();
    if (cache == NULL)
        return;
    stria_docplan_cache_stats_t s;
    stria_docplan_cache_stats(cache, &s);
    stria_metric_set(w->m_plans[0], (double)s.entries);
    stria_metric_set(w->m_plans[1], (double)s.bytes);
    stria_metric_add(w->m_plans[2], (double)(s.hits - w->plans_seen.hits));
    stria_metric_add(w->m_plans[3], (double)(s.misses - w->plans_seen.misses));
    w->plans_seen = s;
}

void stria__wmet_heap(stria_worker_t *w)
{
#ifdef STRIA__HAVE_MALLINFO2
    /* walks every arena's bins under its lock: cheap at a heartbeat's pace */
    pthread_mutex_lock(&mallinfo_lock);
    struct mallinfo2 mi = mallinfo2();
    pthread_mutex_unlock(&mallinfo_lock);
    stria_metric_set(w->m_heap[0], (double)(mi.uordblks + mi.hblkhd));
    stria_metric_set(w->m_heap[1], (double)mi.fordblks);
#else
    (void)w;
#endif
}
