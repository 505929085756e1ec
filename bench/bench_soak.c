/*
 * stria-bench soak: a steady stream of small forward+backward jobs of mixed
 * shapes, dtypes and layouts from several client threads through a
 * coordinator and workers started on loopback, for minutes or hours,
 * optionally SIGKILLing a worker every K seconds (and starting it again a
 * moment later). Reports jobs per second, failures by cause (retryable or
 * not, after a kill or not, and their message classes), libstria's
 * automatic forward retries, and each daemon's resident memory and open
 * descriptors at the start and the end with their least-squares slopes over
 * samples taken after a warm-up. Exits 1 when a failure is unexplained: not
 * retryable and not during a kill, a wrong output, or a daemon that died
 * without being killed.
 */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "bench_daemons.h"
#include "bench_util.h"
#include "stria_client.h"
#include "stria_common.h"

static const char soak_description[] =
    "Starts a coordinator and W workers on loopback and C client threads, each\n"
    "running small causal or full forward+backward jobs of mixed sizes, dtypes,\n"
    "layouts and ring sizes back to back (libstria's default automatic retries),\n"
    "about half of them as calls on sessions each client keeps per shape family,\n"
    "for --minutes or --seconds. With --kill-every K, a worker is SIGKILLed every K\n"
    "seconds (in turn among the upper half of the workers; the lower half is never\n"
    "killed, so that its memory is measured over the whole run) and started again\n"
    "after --restart-after. Every --sample-every seconds it reads each daemon's\n"
    "VmRSS (/proc/PID/status) and open descriptors (/proc/PID/fd); the slopes are\n"
    "least-squares fits over the samples after --warm-up (of each worker's\n"
    "current process), over all of them and over their last half.\n"
    "\n"
    "A failure is explained when it is retryable, or when a kill happened during\n"
    "its call or the grace period before it (3 heartbeats + 4 s); retryable failures\n"
    "with no kill near are counted apart (retryable_without_kill). Exit status 1\n"
    "when any failure is unexplained, an output is not finite, or a daemon died\n"
    "without being killed; 0 otherwise.";

#define SOAK_MAX_CLASSES 32
#define SOAK_MAX_KILLS   8192
#define SOAK_SLOW_S      10.0
#define SOAK_GRACE_S     (3 * atof(STRIA_BENCH_HEARTBEAT_S) + 4)

typedef struct {
    double seconds, minutes, kill_every, restart_after, sample_every, warmup, step_timeout;
    int workers, clients, tpr;
    int64_t seed;
    bool json;
    const char *samples_path;     /* --samples FILE: every sample as a CSV line */
    const char *logs, *log_level; /* --daemon-logs DIR, --daemon-log-level L */
    FILE *samples;
} soak_cfg_t;

/* One class of failure: status, retryability, phase, cause and the message
 * with its numbers blanked. */
typedef struct {
    char status[32], phase[10], text[128], example[256];
    bool retryable, after_kill;
    long count;
} soak_class_t;

typedef struct {
    const soak_cfg_t *cfg;
    const char *coord;
    double t0;
    atomic_bool stop;
    pthread_mutex_t mu;
    long jobs, ok, retries, retried_jobs, fail_retryable, fail_kill, fail_unexplained, bad_output;
    long session_ok; /* of the jobs ok, those run as calls on a session (no submission) */
    long fail_retryable_no_kill; /* retryable, yet no kill during the call or its grace */
    long slow_jobs;              /* jobs whose calls took longer than SOAK_SLOW_S */
    double longest_s;            /* the longest job's calls */
    char longest_how[160];
    soak_class_t classes[SOAK_MAX_CLASSES];
    int n_classes;
    long other_classes;
    double kills[SOAK_MAX_KILLS]; /* seconds since t0 */
    int n_kills;
} soak_state_t;

/* Samples of one daemon slot (0 coordinator, 1 + i worker i). */
typedef struct {
    double t, rss, fds; /* seconds since the start, KiB, descriptors */
    int pid;
} soak_point_t;
typedef struct {
    soak_point_t *p;
    size_t n, cap;
    int restarts;
    bool died; /* gone without a kill of ours */
} soak_series_t;

static int64_t soak_pick(uint64_t *s, const int64_t *v, int n)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return v[*s % (uint64_t)n];
}

/* "rank 2 (worker 127.0.0.1:4123)" -> "rank # (worker #.#.#.#:#)" into out. */
static void soak_blank_numbers(const char *msg, char *out, size_t len)
{
    size_t o = 0;
    for (const char *p = msg; *p != '\0' && o + 2 < len; p++) {
        if (*p >= '0' && *p <= '9') {
            while (p[1] >= '0' && p[1] <= '9')
                p++;
            out[o++] = '#';
        } else {
            out[o++] = *p;
        }
    }
    out[o] = '\0';
}

/* Whether a kill happened in [start - grace, end] (seconds since t0). */
static bool soak_near_kill(const soak_state_t *st, double start, double end)
{
    for (int i = 0; i < st->n_kills; i++)
        if (st->kills[i] >= start - SOAK_GRACE_S && st->kills[i] <= end)
            return true;
    return false;
}

static void soak_record_failure(soak_state_t *st, stria_status_t rc, bool retryable,
                                const char *phase, const char *msg, double start, double end)
{
    char text[128];
    soak_blank_numbers(msg, text, sizeof(text));
    pthread_mutex_lock(&st->mu);
    bool after_kill = soak_near_kill(st, start, end);
    st->fail_retryable_no_kill += retryable && !after_kill;
    if (retryable)
        st->fail_retryable++;
    else if (after_kill)
        st->fail_kill++;
    else
        st->fail_unexplained++;
    soak_class_t *c = NULL;
    for (int i = 0; i < st->n_classes && c == NULL; i++)
        if (strcmp(st->classes[i].status, stria_status_name(rc)) == 0 &&
            st->classes[i].retryable == retryable && st->classes[i].after_kill == after_kill &&
            strcmp(st->classes[i].phase, phase) == 0 && strcmp(st->classes[i].text, text) == 0)
            c = &st->classes[i];
    if (c == NULL && st->n_classes < SOAK_MAX_CLASSES) {
        c = &st->classes[st->n_classes++];
        snprintf(c->status, sizeof(c->status), "%s", stria_status_name(rc));
        snprintf(c->phase, sizeof(c->phase), "%s", phase);
        snprintf(c->text, sizeof(c->text), "%s", text);
        snprintf(c->example, sizeof(c->example), "%s", msg);
        c->retryable = retryable;
        c->after_kill = after_kill;
    }
    if (c != NULL)
        c->count++;
    else
        st->other_classes++;
    pthread_mutex_unlock(&st->mu);
    if (!retryable && !after_kill && !st->cfg->json)
        fprintf(stderr, "stria-bench soak: unexplained failure (%s, %s): %s\n",
                stria_status_name(rc), phase, msg);
}

/* Whether the first n values of buf are finite and not all zero. */
static bool soak_finite(stria_dtype_t dtype, const void *buf, size_t n)
{
    bool nonzero = false;
    for (size_t i = 0; i < n; i++) {
        float x = stria_dtype_load(dtype, buf, i);
        if (!isfinite(x))
            return false;
        nonzero = nonzero || x != 0.0f;
    }
    return nonzero;
}

/* A client thread's sessions, one per shape family its calls take (at
 * most SOAK_SESSIONS; beyond, the call runs as a job). */
#define SOAK_SESSIONS 8
typedef struct {
    stria_session_spec_t spec[SOAK_SESSIONS];
    stria_session_t *s[SOAK_SESSIONS];
    int n;
    uint64_t calls; /* jobs run as session calls */
} soak_sessions_t;

static stria_session_t *soak_session(soak_sessions_t *ss, stria_client_t *cl,
                                     const stria_job_spec_t *js, stria_status_t *st)
{
    *st = STRIA_OK;
    for (int i = 0; i < ss->n; i++)
        if (ss->spec[i].heads == js->heads && ss->spec[i].kv_heads == js->kv_heads &&
            ss->spec[i].head_dim == js->head_dim && ss->spec[i].dtype == js->dtype &&
            ss->spec[i].layout == js->layout && ss->spec[i].ring_size == js->ring_size)
            return ss->s[i];
    if (ss->n == SOAK_SESSIONS)
        return NULL;
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    sp.max_batch = 2, sp.max_seq_len = 512;
    sp.heads = js->heads, sp.kv_heads = js->kv_heads, sp.head_dim = js->head_dim;
    sp.dtype = js->dtype, sp.layout = js->layout, sp.ring_size = js->ring_size;
    sp.step_timeout_s = js->step_timeout_s;
    sp.label = "stria-bench soak";
    stria_session_t *s = NULL;
    if ((*st = stria_session_open(cl, &sp, &s)) != STRIA_OK)
        return NULL;
    sp.label = NULL;
    ss->spec[ss->n] = sp;
    ss->s[ss->n++] = s;
    return s;
}

static void soak_sessions_close(soak_sessions_t *ss)
{
    for (int i = 0; i < ss->n; i++)
        stria_session_close(ss->s[i]);
    ss->n = 0;
}

/* One forward+backward job of a shape drawn from s (every other one as a
 * call on one of the client's sessions); returns the status of the
 * client's connection (STRIA_ERR_IO or _CLOSED: connect anew). */
static stria_status_t soak_job(soak_state_t *st, stria_client_t *cl, soak_sessions_t *ss,
                               uint64_t *s)
{
    static const int64_t seqs[] = {64, 100, 128, 256, 384, 512}, two[] = {0, 1};
    static const int64_t dtypes[] = {STRIA_DTYPE_F32, STRIA_DTYPE_BF16, STRIA_DTYPE_F16};
    static const int64_t layouts[] = {STRIA_LAYOUT_STRIPED, STRIA_LAYOUT_CONTIGUOUS,
                                      STRIA_LAYOUT_ZIGZAG, STRIA_LAYOUT_AUTO};
    static const int64_t rings[] = {0, 2, 3};
    stria_bench_job_t t = {.batch = 1 + soak_pick(s, two, 2), .seq = soak_pick(s, seqs, 6)};
    t.heads = soak_pick(s, two, 2) ? 4 : 2;
    t.kv_heads = soak_pick(s, two, 2) ? t.heads : 1;
    t.head_dim = soak_pick(s, two, 2) ? 64 : 32;
    t.dtype = (stria_dtype_t)soak_pick(s, dtypes, 3);
    bool causal = soak_pick(s, two, 2);
    int ring = (int)soak_pick(s, rings, 3);
    if (ring > st->cfg->workers)
        ring = 0;
    if (stria_bench_job_alloc(&t, true) != 0)
        return STRIA_OK; /* said why; tried again with the next shape */
    stria_job_spec_t spec = stria_bench_job_spec(&t, causal, ring, "stria-bench soak");
    spec.layout = (stria_layout_kind_t)soak_pick(s, layouts, 4);
    spec.step_timeout_s = st->cfg->step_timeout;
    stria_call_stats_t fs = STRIA_CALL_STATS_INIT;
    stria_job_t *job = NULL;
    double start = stria_time_now() - st->t0;
    stria_status_t rc = STRIA_OK;
    const char *phase = "forward";
    if (spec.layout == STRIA_LAYOUT_AUTO && soak_pick(s, two, 2))
        spec.layout = STRIA_LAYOUT_STRIPED; /* a session's auto */
    stria_session_t *sess =
        spec.layout != STRIA_LAYOUT_AUTO ? soak_session(ss, cl, &spec, &rc) : NULL;
    if (sess != NULL) {
        stria_session_stats_t a = STRIA_SESSION_STATS_INIT, b = STRIA_SESSION_STATS_INIT;
        stria_call_t call = STRIA_CALL_INIT;
        call.batch = t.batch, call.seq_len = t.seq, call.causal = causal;
        stria_session_stats(sess, &a);
        rc = stria_session_forward(sess, &call, t.q, t.k, t.v, t.o, t.lse);
        if (rc == STRIA_OK) {
            phase = "backward";
            rc = stria_session_backward(sess, &call, t.q, t.k, t.v, t.o, t.lse, t.g, t.dq, t.dk,
                                        t.dv);
        }
        stria_session_stats(sess, &b);
        fs.retries = (uint32_t)(b.retries - a.retries);
        ss->calls++;
    } else if (rc == STRIA_OK) {
        rc = stria_client_forward(cl, &spec, t.q, t.k, t.v, t.o, t.lse, NULL, NULL, &fs, &job);
        if (rc == STRIA_OK) {
            phase = "backward";
            rc = stria_client_backward(job, t.g, t.dq, t.dk, t.dv, NULL, NULL, NULL);
        }
    } else {
        phase = "session open";
    }
    double end = stria_time_now() - st->t0;
    bool retryable = rc != STRIA_OK && stria_error_retryable();
    if (rc != STRIA_OK)
        soak_record_failure(st, rc, retryable, phase, stria_error_msg(), start, end);
    stria_client_release(job);
    size_t nq = (size_t)(t.batch * t.seq * t.heads * t.head_dim);
    bool good = rc != STRIA_OK || (soak_finite(t.dtype, t.o, nq) && soak_finite(t.dtype, t.dq, nq));
    pthread_mutex_lock(&st->mu);
    st->jobs++;
    st->ok += rc == STRIA_OK && good;
    st->session_ok += sess != NULL && rc == STRIA_OK && good;
    st->bad_output += !good;
    st->retries += fs.retries;
    st->retried_jobs += fs.retries > 0;
    st->slow_jobs += end - start > SOAK_SLOW_S;
    if (end - start > st->longest_s) {
        st->longest_s = end - start;
        snprintf(st->longest_how, sizeof(st->longest_how), "%s %s (%u retries)",
                 rc == STRIA_OK ? "ok" : stria_status_name(rc), rc == STRIA_OK ? "" : phase,
                 fs.retries);
    }
    pthread_mutex_unlock(&st->mu);
    if (!good && !st->cfg->json)
        fprintf(stderr, "stria-bench soak: a job's outputs are not finite (or all zero)\n");
    stria_bench_job_free(&t);
    return rc == STRIA_ERR_IO || rc == STRIA_ERR_CLOSED ? rc : STRIA_OK;
}

typedef struct {
    soak_state_t *st;
    int index;
} soak_client_arg_t;

static void *soak_client(void *p)
{
    soak_client_arg_t *a = p;
    soak_state_t *st = a->st;
    uint64_t s = (uint64_t)st->cfg->seed * 2654435761u + (uint64_t)a->index * 7919u + 1;
    char name[32];
    snprintf(name, sizeof(name), "stria-bench soak %d", a->index);
    stria_client_t *cl = NULL;
    soak_sessions_t ss = {.n = 0};
    while (!atomic_load(&st->stop)) {
        if (cl == NULL &&
            stria_bench_client(st->coord, name, STRIA_DATA_PATH_AUTO, &cl) != STRIA_OK) {
            double now = stria_time_now() - st->t0;
            soak_record_failure(st, STRIA_ERR_IO, false, "connect", stria_error_msg(), now, now);
            cl = NULL;
            sleep(1);
            continue;
        }
        if (soak_job(st, cl, &ss, &s) != STRIA_OK) {
            soak_sessions_close(&ss);
            stria_client_close(cl);
            cl = NULL;
        }
    }
    soak_sessions_close(&ss);
    stria_client_close(cl);
    return NULL;
}

/* Appends a sample of daemon slot i to ser (nothing for a worker killed and
 * not yet restarted; `died` for one gone by itself). */
static void soak_sample(const soak_cfg_t *c, soak_series_t *ser, int i, double t)
{
    int pid = (int)stria_bench_daemon_pid(i);
    long long rss;
    int fds;
    if (pid <= 0)
        return;
    if (stria_bench_proc_usage(pid, &rss, &fds) != 0) {
        ser->died = true;
        return;
    }
    soak_point_t *p = stria_grow(ser->p, &ser->cap, ser->n + 1, sizeof(*p), 256);
    if (p == NULL)
        return; /* out of memory: this sample is lost */
    ser->p = p;
    if (c->samples != NULL)
        fprintf(c->samples, "%.1f,%d,%d,%lld,%d\n", t, i, pid, rss, fds);
    ser->p[ser->n++] = (soak_point_t){.t = t, .rss = (double)rss, .fds = fds, .pid = pid};
}

/* What the samples of one daemon's current process say. */
typedef struct {
    int pid, samples, fit_samples;
    double rss_start, rss_warm, rss_end, rss_max, fd_start, fd_warm, fd_end;
    double rss_slope, rss_slope_se, rss_slope_last_half, fd_slope; /* per minute */
    bool rss_steady;
} soak_fit_t;

static void soak_fit(const soak_series_t *ser, double warmup, soak_fit_t *f)
{
    memset(f, 0, sizeof(*f));
    if (ser->n == 0)
        return;
    const soak_point_t *p = ser->p;
    int total = (int)ser->n, last = p[total - 1].pid, first = total - 1;
    while (first > 0 && p[first - 1].pid == last)
        first--;
    int warm = first;
    while (warm < total - 1 && p[warm].t < p[first].t + warmup)
        warm++;
    int n = total - warm, half = n / 2;
    f->pid = last;
    f->samples = total - first;
    f->fit_samples = n;
    f->rss_start = p[first].rss, f->fd_start = p[first].fds;
    f->rss_warm = p[warm].rss, f->fd_warm = p[warm].fds;
    f->rss_end = p[total - 1].rss, f->fd_end = p[total - 1].fds;
    for (int i = first; i < total; i++)
        f->rss_max = fmax(p[i].rss, f->rss_max);
    double *mins = malloc(3 * (size_t)n * sizeof(double)), *rss = mins + n, *fds = rss + n;
    if (mins == NULL)
        return;
    for (int i = 0; i < n; i++)
        mins[i] = p[warm + i].t / 60.0, rss[i] = p[warm + i].rss, fds[i] = p[warm + i].fds;
    f->rss_slope = stria_bench_slope(mins, rss, n, &f->rss_slope_se);
    f->fd_slope = stria_bench_slope(mins, fds, n, NULL);
    double se_half = 0;
    f->rss_slope_last_half = stria_bench_slope(mins + half, rss + half, n - half, &se_half);
    /* Steady: the last half's trend, carried over the fitted span, adds less
     * than 1% of the RSS (or 256 KiB), or is not told apart from the noise. */
    double span = n > 1 ? mins[n - 1] - mins[0] : 0, growth = f->rss_slope_last_half * span;
    f->rss_steady =
        growth < fmax(256.0, 0.01 * f->rss_warm) || f->rss_slope_last_half < 3 * se_half;
    free(mins);
}

static double soak_loadavg(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f != NULL) {
        if (fscanf(f, "%lf", &l) != 1)
            l = -1;
        fclose(f);
    }
    return l;
}

/* Kills and restarts workers and samples the daemons until the run's end. */
static void soak_drive(soak_state_t *st, soak_series_t *ser)
{
    const soak_cfg_t *c = st->cfg;
    double next_sample = c->sample_every, restart_at = 0;
    double next_kill = c->kill_every > 0 ? c->kill_every : INFINITY;
    int victim = -1, turn = 0, first_victim = c->workers / 2;
    for (;;) {
        double t = stria_time_now() - st->t0;
        if (t >= c->seconds)
            break;
        if (t >= next_sample) {
            for (int i = 0; i <= c->workers; i++)
                soak_sample(c, &ser[i], i, t);
            next_sample += c->sample_every;
        }
        if (victim >= 0 && t >= restart_at) {
            if (stria_bench_worker_restart(victim) == 0)
                ser[1 + victim].restarts++;
            else /* counted as a death: the run goes on with one worker less */
                ser[1 + victim].died = true;
            victim = -1;
        }
        if (victim < 0 && t >= next_kill && st->n_kills < SOAK_MAX_KILLS) {
            victim = first_victim + turn++ % (c->workers - first_victim);
            pthread_mutex_lock(&st->mu);
            st->kills[st->n_kills++] = t; /* before the kill: a failure it causes ends after */
            pthread_mutex_unlock(&st->mu);
            stria_bench_worker_kill(victim);
            restart_at = t + c->restart_after;
            next_kill += c->kill_every;
        }
        usleep(100000);
    }
    if (victim >= 0 && stria_bench_worker_restart(victim) == 0)
        ser[1 + victim].restarts++;
}

/* The figures of a run, for the report. */
typedef struct {
    double seconds, drain_s, load_start, load_end;
    int unexplained, died;
    uint64_t pool_start, pool_end;
    stria_bench_coord_status_t coord_end;
    soak_fit_t fit[STRIA_BENCH_MAX_WORKERS + 1];
} soak_result_t;

static void soak_daemon_name(int i, char *buf, size_t len)
{
    if (i == 0)
        snprintf(buf, len, "coordinator");
    else
        snprintf(buf, len, "worker%d", i - 1);
}

static void soak_report_json(const soak_state_t *st, const soak_series_t *ser,
                             const soak_result_t *r)
{
    const soak_cfg_t *c = st->cfg;
    printf("{\"name\":\"soak\",\"seconds\":%.1f,\"drain_s\":%.1f,\"workers\":%d,\"clients\":%d,"
           "\"kill_every_s\":%g,\"kills\":%d,\"load_start\":%.2f,\"load_end\":%.2f,"
           "\"jobs\":%ld,\"jobs_ok\":%ld,\"session_calls_ok\":%ld,\"jobs_per_s\":%.3f,"
           "\"forward_retries\":%ld,"
           "\"jobs_retried\":%ld,\"slow_jobs\":%ld,\"longest_job_s\":%.1f,"
           "\"failures\":{\"total\":%ld,\"retryable\":%ld,"
           "\"not_retryable_after_kill\":%ld,\"unexplained\":%ld,\"bad_output\":%ld,"
           "\"retryable_without_kill\":%ld,"
           "\"other_classes\":%ld},\"failure_classes\":[",
           r->seconds, r->drain_s, c->workers, c->clients, c->kill_every, st->n_kills,
           r->load_start, r->load_end, st->jobs, st->ok, st->session_ok,
           (double)st->jobs / r->seconds, st->retries, st->retried_jobs, st->slow_jobs,
           st->longest_s, st->fail_retryable + st->fail_kill + st->fail_unexplained,
           st->fail_retryable, st->fail_kill, st->fail_unexplained, st->bad_output,
           st->fail_retryable_no_kill, st->other_classes);
    for (int i = 0; i < st->n_classes; i++) {
        const soak_class_t *k = &st->classes[i];
        printf("%s{\"status\":\"%s\",\"phase\":\"%s\",\"retryable\":%s,\"after_kill\":%s,"
               "\"count\":%ld,\"class\":",
               i ? "," : "", k->status, k->phase, k->retryable ? "true" : "false",
               k->after_kill ? "true" : "false", k->count);
        stria_bench_json_string(stdout, k->text);
        printf(",\"example\":");
        stria_bench_json_string(stdout, k->example);
        printf("}");
    }
    printf("],\"pool_in_use_bytes_start\":%llu,\"pool_in_use_bytes_end\":%llu,"
           "\"coordinator_end\":{\"jobs_submitted\":%llu,\"jobs_failed\":%llu,"
           "\"jobs_active\":%u,\"jobs_pending\":%u,\"workers_healthy\":%u,"
           "\"workers_dead\":%u},\"daemons\":[",
           (unsigned long long)r->pool_start, (unsigned long long)r->pool_end,
           (unsigned long long)r->coord_end.jobs_submitted,
           (unsigned long long)r->coord_end.jobs_failed, r->coord_end.jobs_active,
           r->coord_end.jobs_pending, r->coord_end.workers_healthy, r->coord_end.workers_dead);
    for (int i = 0; i <= c->workers; i++) {
        const soak_fit_t *f = &r->fit[i];
        char name[32];
        soak_daemon_name(i, name, sizeof(name));
        printf("%s{\"name\":\"%s\",\"pid\":%d,\"restarts\":%d,\"died\":%s,\"samples\":%d,"
               "\"fit_samples\":%d,\"rss_kib_start\":%.0f,\"rss_kib_after_warmup\":%.0f,"
               "\"rss_kib_end\":%.0f,\"rss_kib_max\":%.0f,\"rss_slope_kib_per_min\":%.2f,"
               "\"rss_slope_se\":%.2f,\"rss_slope_last_half_kib_per_min\":%.2f,"
               "\"rss_steady\":%s,\"fds_start\":%.0f,\"fds_after_warmup\":%.0f,\"fds_end\":%.0f,"
               "\"fds_slope_per_min\":%.3f}",
               i ? "," : "", name, f->pid, ser[i].restarts, ser[i].died ? "true" : "false",
               f->samples, f->fit_samples, f->rss_start, f->rss_warm, f->rss_end, f->rss_max,
               f->rss_slope, f->rss_slope_se, f->rss_slope_last_half,
               f->rss_steady ? "true" : "false", f->fd_start, f->fd_warm, f->fd_end, f->fd_slope);
    }
    printf("],\"unexplained\":%d}\n", r->unexplained);
}

static void soak_report_text(const soak_state_t *st, const soak_series_t *ser,
                             const soak_result_t *r)
{
    const soak_cfg_t *c = st->cfg;
    printf("soak: %.1f min, %d workers, %d client threads, ", r->seconds / 60, c->workers,
           c->clients);
    if (c->kill_every > 0)
        printf("a worker SIGKILLed every %g s (%d kills)", c->kill_every, st->n_kills);
    else
        printf("no kills");
    printf(", load average %.2f -> %.2f; the jobs under way at the end took %.1f s more\n",
           r->load_start, r->load_end, r->drain_s);
    printf("  jobs        %ld (%.2f/s), ok %ld (%ld as session calls); forward retries %ld (in %ld "
           "jobs)\n",
           st->jobs, (double)st->jobs / r->seconds, st->ok, st->session_ok, st->retries,
           st->retried_jobs);
    printf("  longest job %.1f s (%s); %ld jobs took over %g s\n", st->longest_s, st->longest_how,
           st->slow_jobs, SOAK_SLOW_S);
    printf("  failures    %ld: retryable %ld (%ld with no kill near), not retryable during a kill "
           "%ld, unexplained %ld, bad outputs %ld\n",
           st->fail_retryable + st->fail_kill + st->fail_unexplained, st->fail_retryable,
           st->fail_retryable_no_kill, st->fail_kill, st->fail_unexplained, st->bad_output);
    for (int i = 0; i < st->n_classes; i++) {
        const soak_class_t *k = &st->classes[i];
        printf("    %6ld  %s %s%s %s: %s\n", k->count, k->status,
               k->retryable ? "retryable" : "not retryable",
               k->after_kill ? " (kill)" : " (no kill)", k->phase, k->text);
    }
    if (st->other_classes > 0)
        printf("    %6ld  of other classes\n", st->other_classes);
    printf("  pools in use: %llu bytes at the start, %llu at the end; the coordinator: %llu jobs "
           "submitted, %llu failed, %u active and %u pending at the end, %u workers healthy, "
           "%u dead\n",
           (unsigned long long)r->pool_start, (unsigned long long)r->pool_end,
           (unsigned long long)r->coord_end.jobs_submitted,
           (unsigned long long)r->coord_end.jobs_failed, r->coord_end.jobs_active,
           r->coord_end.jobs_pending, r->coord_end.workers_healthy, r->coord_end.workers_dead);
    printf("  %-12s %8s %3s  %-30s  %-26s %-16s %s\n", "daemon", "pid", "rs",
           "RSS KiB start/warm/end", "slope KiB/min (last half)", "fds start/end", "fds/min");
    for (int i = 0; i <= c->workers; i++) {
        const soak_fit_t *f = &r->fit[i];
        char name[32], rss[64], slope[64], fds[32];
        soak_daemon_name(i, name, sizeof(name));
        snprintf(rss, sizeof(rss), "%.0f/%.0f/%.0f", f->rss_start, f->rss_warm, f->rss_end);
        snprintf(slope, sizeof(slope), "%+.1f±%.1f (%+.1f)%s", f->rss_slope, f->rss_slope_se,
                 f->rss_slope_last_half, f->rss_steady ? "" : " GROWS");
        snprintf(fds, sizeof(fds), "%.0f/%.0f", f->fd_start, f->fd_end);
        printf("  %-12s %8d %3d  %-30s  %-26s %-16s %+.2f%s\n", name, f->pid, ser[i].restarts, rss,
               slope, fds, f->fd_slope, ser[i].died ? "  DIED" : "");
    }
    printf("  (rs: restarts; slopes fitted over %s of samples every %g s after a %g s warm-up)\n",
           "each daemon's current process", c->sample_every, c->warmup);
}

/* Parses the options into c; returns -1 to go on, else the exit code. */
static int soak_parse(int argc, char **argv, soak_cfg_t *c)
{
    int64_t workers, clients, tpr;
    memset(c, 0, sizeof(*c));
    const stria_option_t opts[] = {
        {.name = "minutes",
         .type = STRIA_OPT_DOUBLE,
         .dst = &c->minutes,
         .dflt = "1",
         .min = 0,
         .max = 100000,
         .flags = STRIA_OPT_ABOVE_MIN,
         .metavar = "M",
         .help = "how long to run"},
        {.name = "seconds",
         .type = STRIA_OPT_DOUBLE,
         .dst = &c->seconds,
         .min = 0,
         .max = 1e7,
         .flags = STRIA_OPT_ABOVE_MIN,
         .metavar = "S",
         .help = "how long to run (not with --minutes)"},
        {.name = "workers",
         .type = STRIA_OPT_INT,
         .dst = &workers,
         .dflt = "4",
         .min = 1,
         .max = STRIA_BENCH_MAX_WORKERS,
         .metavar = "W",
         .help = "worker daemons"},
        {.name = "clients",
         .type = STRIA_OPT_INT,
         .dst = &clients,
         .dflt = "3",
         .min = 1,
         .max = 64,
         .metavar = "C",
         .help = "client threads, one client each"},
        {.name = "kill-every",
         .type = STRIA_OPT_DOUBLE,
         .dst = &c->kill_every,
         .dflt = "0",
         .min = 0,
         .max = 1e7,
         .metavar = "K",
         .help = "SIGKILL a worker every K seconds (0: never; needs W >= 2)"},
        {.name = "restart-after",
         .type = STRIA_OPT_DOUBLE,
         .dst = &c->restart_after,
         .dflt = "3",
         .min = 0,
         .max = 3600,
         .metavar = "S",
         .help = "seconds before a killed worker is started again"},
        {.name = "sample-every",
         .type = STRIA_OPT_DOUBLE,
         .dst = &c->sample_every,
         .min = 0.1,
         .max = 3600,
         .metavar = "S",
         .help = "seconds between RSS/descriptor samples (default: 5, at most a tenth of the run)"},
        {.name = "warm-up",
         .type = STRIA_OPT_DOUBLE,
         .dst = &c->warmup,
         .min = 0,
         .max = 1e7,
         .metavar = "S",
         .help = "seconds of samples left out of the slopes (default: 60, at most a quarter of "
                 "the run)"},
        {.name = "step-timeout",
         .type = STRIA_OPT_DOUBLE,
         .dst = &c->step_timeout,
         .dflt = "10",
         .min = 0,
         .max = 3600,
         .flags = STRIA_OPT_ABOVE_MIN,
         .metavar = "S",
         .help = "deadline of one ring step of a job"},
        {.name = "threads-per-rank",
         .type = STRIA_OPT_INT,
         .dst = &tpr,
         .dflt = "1",
         .min = 1,
         .max = 256,
         .metavar = "T",
         .help = "kernel threads of each worker"},
        {.name = "seed",
         .type = STRIA_OPT_INT,
         .dst = &c->seed,
         .dflt = "1",
         .min = 0,
         .max = 1e15,
         .metavar = "N",
         .help = "seed of the job shapes"},
        {.name = "samples",
         .type = STRIA_OPT_STRING,
         .dst = &c->samples_path,
         .metavar = "FILE",
         .help = "write every sample to FILE as CSV: seconds,daemon,pid,rss_kib,fds (daemon 0 "
                 "the coordinator, 1 + i worker i)"},
        {.name = "daemon-logs",
         .type = STRIA_OPT_STRING,
         .dst = &c->logs,
         .metavar = "DIR",
         .help = "append the daemons' stderr to DIR/coordinator.log and DIR/workerI.log "
                 "(default: discarded)"},
        {.name = "daemon-log-level",
         .type = STRIA_OPT_STRING,
         .dst = &c->log_level,
         .dflt = "error",
         .metavar = "LEVEL",
         .help = "the daemons' --log-level (error, warn, info, debug)"},
        {.name = "json", .type = STRIA_OPT_FLAG, .dst = &c->json, .help = "one JSON object"},
        {.name = NULL},
    };
    const stria_command_t cmd = {.name = "soak", .description = soak_description, .options = opts};
    stria_cli_t cli;
    int prc = stria_bench_parse(&cmd, argc, argv, &cli);
    bool both = prc < 0 && stria_cli_given(&cli, "seconds") && stria_cli_given(&cli, "minutes");
    bool has_sample = prc < 0 && stria_cli_given(&cli, "sample-every");
    bool has_warmup = prc < 0 && stria_cli_given(&cli, "warm-up");
    stria_cli_free(&cli);
    if (prc >= 0)
        return prc;
    c->workers = (int)workers, c->clients = (int)clients, c->tpr = (int)tpr;
    if (both)
        return stria_bench_usage_error("soak", "--seconds and --minutes: give one of them");
    if (c->seconds == 0)
        c->seconds = 60 * c->minutes;
    if (c->kill_every > 0 && c->workers < 2)
        return stria_bench_usage_error("soak", "--kill-every needs --workers 2 or more");
    if (!has_sample)
        c->sample_every = fmin(5.0, fmax(0.5, c->seconds / 10));
    if (!has_warmup)
        c->warmup = fmin(60.0, c->seconds / 4);
    return -1;
}

/* Waits up to three heartbeats for the coordinator to hold no job and the
 * live workers' pools to be back to r->pool_start bytes in use (as their
 * last heartbeats tell); records what it sees then. */
static void soak_end_state(const char *coord, soak_result_t *r)
{
    stria_bench_pools_t p;
    double until = stria_time_now() + 3 * atof(STRIA_BENCH_HEARTBEAT_S) + 1;
    for (;;) {
        bool ok = stria_bench_pools(coord, &p) == STRIA_OK &&
                  stria_bench_coord_status(coord, &r->coord_end) == STRIA_OK;
        r->pool_end = ok ? p.in_use : 0;
        if (!ok || stria_time_now() > until ||
            (p.in_use <= r->pool_start && r->coord_end.jobs_active == 0 &&
             r->coord_end.jobs_pending == 0))
            break;
        usleep(200000);
    }
}

/* Runs the clients and the driver; fills r. Returns 0, or 1 when the client
 * threads could not start. */
static int soak_run(soak_state_t *st, soak_series_t *ser, soak_result_t *r)
{
    const soak_cfg_t *c = st->cfg;
    pthread_t th[64];
    soak_client_arg_t args[64];
    stria_bench_pools_t pools;
    r->load_start = soak_loadavg();
    r->pool_start = stria_bench_pools(st->coord, &pools) == STRIA_OK ? pools.in_use : 0;
    st->t0 = stria_time_now();
    for (int i = 0; i <= c->workers; i++)
        soak_sample(c, &ser[i], i, 0);
    int started = 0;
    for (; started < c->clients; started++) {
        args[started] = (soak_client_arg_t){.st = st, .index = started};
        if (pthread_create(&th[started], NULL, soak_client, &args[started]) != 0)
            break;
    }
    if (started == c->clients)
        soak_drive(st, ser);
    atomic_store(&st->stop, true);
    double stop = stria_time_now();
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    r->drain_s = stria_time_now() - stop;
    r->seconds = stria_time_now() - st->t0;
    for (int i = 0; i <= c->workers; i++)
        soak_sample(c, &ser[i], i, r->seconds);
    soak_end_state(st->coord, r);
    r->load_end = soak_loadavg();
    if (started < c->clients) {
        fprintf(stderr, "stria-bench soak: cannot start client thread %d\n", started);
        return 1;
    }
    for (int i = 0; i <= c->workers; i++) {
        soak_fit(&ser[i], c->warmup, &r->fit[i]);
        r->died += ser[i].died;
    }
    r->unexplained = (int)(st->fail_unexplained + st->bad_output) + r->died;
    return 0;
}

int stria_bench_soak(int argc, char **argv)
{
    soak_cfg_t c;
    char coord[512];
    int prc = soak_parse(argc, argv, &c);
    if (prc >= 0)
        return prc;
    if (c.samples_path != NULL) {
        c.samples = fopen(c.samples_path, "we"); /* close-on-exec */
        if (c.samples == NULL) {
            fprintf(stderr, "stria-bench soak: cannot write --samples %s\n", c.samples_path);
            return 1;
        }
        setvbuf(c.samples, NULL, _IOLBF, 0);
        fprintf(c.samples, "seconds,daemon,pid,rss_kib,fds\n");
    }
    stria_bench_daemons_logs(c.logs, c.log_level);
    if (stria_bench_daemons_start("soak", c.workers, c.tpr, coord, sizeof(coord)) != 0) {
        if (c.samples != NULL)
            fclose(c.samples);
        return 1;
    }
    soak_state_t *st = calloc(1, sizeof(*st));
    soak_series_t *ser = calloc((size_t)c.workers + 1, sizeof(*ser));
    soak_result_t *r = calloc(1, sizeof(*r));
    int rc = 1;
    if (st == NULL || ser == NULL || r == NULL) {
        fprintf(stderr, "stria-bench soak: out of memory\n");
    } else {
        st->cfg = &c;
        st->coord = coord;
        pthread_mutex_init(&st->mu, NULL);
        if (!c.json)
            fprintf(stderr, "stria-bench soak: %.0f s, %d workers, %d clients (coordinator %s)\n",
                    c.seconds, c.workers, c.clients, coord);
        rc = soak_run(st, ser, r);
        if (rc == 0) {
            if (c.json)
                soak_report_json(st, ser, r);
            else
                soak_report_text(st, ser, r);
            rc = r->unexplained > 0;
        }
        pthread_mutex_destroy(&st->mu);
    }
    stria_bench_daemons_stop();
    for (int i = 0; ser != NULL && i <= c.workers; i++)
        free(ser[i].p);
    free(st), free(ser), free(r);
    if (c.samples != NULL)
        fclose(c.samples);
    return rc;
}
