/*
 * striactl: the admin CLI of a stria ring.
 *
 *   striactl [--coordinator HOST:PORT] [--token-file FILE] [--json] COMMAND ...
 *
 * Commands: status, workers, jobs [--all], job ID [--timeline FILE.svg], drain WORKER, undrain
 * WORKER, cancel JOB [--reason TEXT]. WORKER is a worker id or its RPC address.
 * `--json` prints one JSON document per command with the field names listed in
 * docs/DEPLOY.md. Exit status: 0 success, 1 the coordinator refused the
 * request (unknown name, bad state), 2 usage error, 3 coordinator unreachable,
 * 4 authentication or permission refused.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "stria.pb-c.h"
#include "stria_rpc.h"

enum { EXIT_OK = 0, EXIT_REFUSED = 1, EXIT_USAGE = 2, EXIT_UNREACHABLE = 3, EXIT_AUTH = 4 };

#define STRIACTL_DEFAULT_COORDINATOR "127.0.0.1:7400"

typedef struct {
    const char *coordinator;
    char *token;
    bool json;
    double timeout_s;
    stria_rpc_client_t *rpc;
    const char *timeline; /* job --timeline FILE.svg */
} ctl_t;

static const char ctl_description[] =
    "The admin CLI of a stria ring. WORKER is a worker id or its RPC address\n"
    "(HOST:PORT). The options of striactl come before or after the command.";

static const char ctl_epilog[] =
    "exit status: 0 success; 1 the coordinator refused the request (unknown worker or\n"
    "job, wrong state), or job --timeline had nothing to draw or could not write its\n"
    "file; 2 usage error; 3 coordinator unreachable; 4 authentication or permission\n"
    "refused.";

/* The coordinator's strings (hosts, addresses, labels, failures) come from
 * workers and clients: printed for a terminal, control characters and bytes
 * that are not UTF-8 are escaped (stria_text_escape); a few buffers turn, so
 * one printf may show several. */
static const char *esc(const char *s)
{
    static char bufs[8][4 * 1024 + 1];
    static unsigned next;
    char *out = bufs[next++ % 8];
    return stria_text_escape(s, out, sizeof(bufs[0]));
}

static int exit_code(stria_status_t st)
{
    switch (st) {
    case STRIA_OK:
        return EXIT_OK;
    case STRIA_ERR_AUTH:
        return EXIT_AUTH;
    case STRIA_ERR_IO:
    case STRIA_ERR_TIMEOUT:
    case STRIA_ERR_CLOSED:
    case STRIA_ERR_PROTOCOL:
        return EXIT_UNREACHABLE;
    default:
        return EXIT_REFUSED;
    }
}

static int fail(stria_status_t st)
{
    fprintf(stderr, "striactl: %s\n",
            esc(stria_error_msg()[0] ? stria_error_msg() : stria_status_str(st)));
    return exit_code(st);
}

static stria_status_t call(ctl_t *c, uint32_t method, const ProtobufCMessage *req,
                           stria_rpc_reply_t *reply)
{
    stria_rpc_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.method = method;
    rq.request = req;
    rq.timeout_s = c->timeout_s;
    memset(reply, 0, sizeof(*reply));
    stria_status_t st = stria_rpc_client_call(c->rpc, &rq, reply);
    if (st != STRIA_OK && (st == STRIA_ERR_IO || st == STRIA_ERR_TIMEOUT || st == STRIA_ERR_CLOSED))
        stria_error_wrap(st, "coordinator %s", c->coordinator);
    return st;
}

/* ---- formatting ------------------------------------------------------------- */

/* A JSON string: control characters (C0, DEL, C1) as \\u00XX and bytes
 * that are not UTF-8 as \\ufffd, so the document stays valid UTF-8. */
static void json_str(const char *s)
{
    const char *p = s ? s : "";
    size_t n = strlen(p);
    putchar('"');
    for (size_t i = 0; i < n;) {
        uint32_t cp = (unsigned char)p[i];
        size_t len = cp < 0x80 ? 1 : stria_utf8_char(p + i, n - i, &cp);
        if (len == 0)
            printf("\\ufffd");
        else if (cp == '"' || cp == '\\')
            printf("\\%c", (char)cp);
        else if (cp < 0x20 || (cp >= 0x7f && cp <= 0x9f))
            printf("\\u%04x", (unsigned)cp);
        else
            fwrite(p + i, 1, len, stdout);
        i += len ? len : 1;
    }
    putchar('"');
}

static const char *worker_state_name(Stria__V1__WorkerState s)
{
    switch (s) {
    case STRIA__V1__WORKER_STATE__WORKER_STATE_HEALTHY:
        return "healthy";
    case STRIA__V1__WORKER_STATE__WORKER_STATE_DRAINING:
        return "draining";
    case STRIA__V1__WORKER_STATE__WORKER_STATE_DEAD:
        return "dead";
    case STRIA__V1__WORKER_STATE__WORKER_STATE_LEFT:
        return "left";
    default:
        return "unknown";
    }
}

static const char *job_state_name(Stria__V1__JobState s)
{
    static const char *const names[] = {"unknown",      "pending",  "loading", "forward",
                                        "forward-done", "backward", "done",    "failed",
                                        "cancelled",    "released", "expired"};
    return (unsigned)s < sizeof(names) / sizeof(names[0]) ? names[s] : "unknown";
}

static const char *layout_name(Stria__V1__Layout l)
{
    return stria_layout_kind_name((stria_layout_kind_t)l);
}

static const char *dtype_name(Stria__V1__Dtype d)
{
    return d == STRIA__V1__DTYPE__DTYPE_BF16   ? "bf16"
           : d == STRIA__V1__DTYPE__DTYPE_FP16 ? "fp16"
                                               : "fp32";
}

static void fmt_bytes(char *out, size_t n, uint64_t b)
{
    if (b >= (1ull << 30))
        snprintf(out, n, "%.1f GiB", (double)b / (double)(1ull << 30));
    else if (b >= (1ull << 20))
        snprintf(out, n, "%.1f MiB", (double)b / (double)(1ull << 20));
    else if (b >= (1ull << 10))
        snprintf(out, n, "%.1f KiB", (double)b / (double)(1ull << 10));
    else
        snprintf(out, n, "%" PRIu64 " B", b);
}

static void fmt_duration(char *out, size_t n, uint64_t ms)
{
    uint64_t s = ms / 1000;
    if (s >= 86400)
        snprintf(out, n, "%" PRIu64 "d%02" PRIu64 "h", s / 86400, (s % 86400) / 3600);
    else if (s >= 3600)
        snprintf(out, n, "%" PRIu64 "h%02" PRIu64 "m", s / 3600, (s % 3600) / 60);
    else if (s >= 60)
        snprintf(out, n, "%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
    else
        snprintf(out, n, "%.1fs", (double)ms / 1000.0);
}

/* {"KEY":[item,...]} and a newline, each item printed by fn. */
#define JSON_ARRAY(key, items, n, fn)                                                              \
    do {                                                                                           \
        printf("{\"" key "\":[");                                                                  \
        for (size_t i_ = 0; i_ < (n); i_++) {                                                      \
            printf(i_ ? "," : "");                                                                 \
            fn((items)[i_]);                                                                       \
        }                                                                                          \
        printf("]}\n");                                                                            \
    } while (0)

static void json_worker(const Stria__V1__WorkerInfo *w)
{
    printf("{\"id\":%" PRIu64 ",\"state\":", w->worker_id);
    json_str(worker_state_name(w->state));
    printf(",\"host\":");
    json_str(w->host);
    printf(",\"device\":");
    json_str(w->device);
    printf(",\"rpc_address\":");
    json_str(w->rpc_address);
    printf(",\"ucx_address\":");
    json_str(w->ucx_address);
    printf(",\"heartbeat_age_ms\":%u,\"memory_bytes\":%" PRIu64
           ",\"memory_reserved_bytes\":%" PRIu64 ",\"memory_in_use_bytes\":%" PRIu64
           ",\"pool_reserved_bytes\":%" PRIu64 ",\"pool_in_use_bytes\":%" PRIu64
           ",\"pool_high_water_bytes\":%" PRIu64 ",\"pool_committed_bytes\":%" PRIu64
           ",\"current_job\":%" PRIu64 ",\"step\":%u,\"steps_total\":%u,\"ring_index\":%d,"
           "\"draining\":%s,\"version\":",
           w->heartbeat_age_ms, w->memory_bytes, w->memory_reserved_bytes, w->memory_in_use_bytes,
           w->pool_reserved_bytes, w->pool_in_use_bytes, w->pool_high_water_bytes,
           w->pool_committed_bytes, w->current_job_id, w->step, w->steps_total, w->ring_index,
           w->draining ? "true" : "false");
    json_str(w->software_version);
    printf(",\"kernel\":");
    json_str(w->kernel_variant);
    printf(",\"jobs\":[");
    for (size_t i = 0; i < w->n_job_ids; i++)
        printf("%s%" PRIu64, i ? "," : "", w->job_ids[i]);
    printf("]}");
}

/* Aligned table: rows of cells, printed with column widths. */
#define MAX_COLS 12
typedef struct {
    int ncols;
    size_t nrows, cap;
    char *(*cells)[MAX_COLS];
} table_t;

static void table_add(table_t *t, const char *const *cells)
{
    void *grown = stria_grow(t->cells, &t->cap, t->nrows + 1, sizeof(*t->cells), 16);
    if (grown == NULL) {
        fprintf(stderr, "striactl: out of memory for a table of %zu rows\n", t->nrows + 1);
        exit(1);
    }
    t->cells = grown;
    for (int c = 0; c < t->ncols; c++)
        if ((t->cells[t->nrows][c] = strdup(esc(cells[c]))) == NULL) {
            fprintf(stderr, "striactl: out of memory for a table cell\n");
            exit(1);
        }
    t->nrows++;
}

static void table_print(table_t *t)
{
    size_t w[MAX_COLS] = {0};
    for (size_t r = 0; r < t->nrows; r++)
        for (int c = 0; c < t->ncols; c++)
            if (strlen(t->cells[r][c]) > w[c])
                w[c] = strlen(t->cells[r][c]);
    for (size_t r = 0; r < t->nrows; r++) {
        for (int c = 0; c < t->ncols; c++)
            if (c + 1 < t->ncols)
                printf("%-*s  ", (int)w[c], t->cells[r][c]);
            else
                printf("%s", t->cells[r][c]);
        printf("\n");
        for (int c = 0; c < t->ncols; c++)
            free(t->cells[r][c]);
    }
    free(t->cells);
}

static void worker_row(table_t *t, int rank, const Stria__V1__WorkerInfo *w)
{
    char rk[16], id[24], age[32], job[24], step[32], held[16], mem[64], used[24], cap[24];
    char pool[96], pin[24], peak[24], kept[24];
    snprintf(rk, sizeof(rk), rank >= 0 ? "%d" : "-", rank);
    snprintf(id, sizeof(id), "%" PRIu64, w->worker_id);
    fmt_duration(age, sizeof(age), w->heartbeat_age_ms);
    snprintf(job, sizeof(job), w->current_job_id ? "%" PRIu64 : "-", w->current_job_id);
    if (w->steps_total > 0)
        snprintf(step, sizeof(step), "%u/%u", w->step, w->steps_total);
    else
        snprintf(step, sizeof(step), "-");
    snprintf(held, sizeof(held), "%zu", w->n_job_ids);
    fmt_bytes(used, sizeof(used), w->memory_in_use_bytes);
    fmt_bytes(cap, sizeof(cap), w->memory_bytes);
    snprintf(mem, sizeof(mem), "%s / %s", used, cap);
    fmt_bytes(pin, sizeof(pin), w->pool_in_use_bytes);
    fmt_bytes(peak, sizeof(peak), w->pool_high_water_bytes);
    fmt_bytes(kept, sizeof(kept), w->pool_committed_bytes);
    snprintf(pool, sizeof(pool), "%s / %s / %s", pin, peak, kept);
    const char *cells[] = {
        rk,   id,  w->host, w->device,     worker_state_name(w->state), age, job, step,
        held, mem, pool,    w->rpc_address};
    table_add(t, cells);
}

/* ---- commands ----------------------------------------------------------------- */

static int cmd_status(ctl_t *c)
{
    Stria__V1__GetStatusRequest sreq = STRIA__V1__GET_STATUS_REQUEST__INIT;
    Stria__V1__GetRingRequest rreq = STRIA__V1__GET_RING_REQUEST__INIT;
    stria_rpc_reply_t sr, rr;
    stria_status_t st = call(c, STRIA_RPC_COORDINATOR_GET_STATUS, &sreq.base, &sr);
    if (st != STRIA_OK)
        return fail(st);
    st = call(c, STRIA_RPC_COORDINATOR_GET_RING, &rreq.base, &rr);
    if (st != STRIA_OK) {
        stria_rpc_reply_free(&sr);
        return fail(st);
    }
    const Stria__V1__GetStatusReply *s = (const Stria__V1__GetStatusReply *)sr.msg;
    const Stria__V1__GetRingReply *r = (const Stria__V1__GetRingReply *)rr.msg;
    if (c->json) {
        printf("{\"coordinator\":");
        json_str(c->coordinator);
        printf(",\"version\":");
        json_str(s->software_version);
        printf(",\"protocol_version\":%u,\"uptime_ms\":%" PRIu64 ",\"heartbeat_period_ms\":%u,"
               "\"job_ttl_s\":%u,\"workers_healthy\":%u,\"workers_draining\":%u,"
               "\"workers_dead\":%u,\"workers_left\":%u,\"jobs_pending\":%u,\"jobs_active\":%u,"
               "\"jobs_submitted\":%" PRIu64 ",\"jobs_failed\":%" PRIu64 ",\"ring\":[",
               s->protocol_version, s->uptime_ms, s->heartbeat_period_ms, s->job_ttl_s,
               s->workers_healthy, s->workers_draining, s->workers_dead, s->workers_left,
               s->jobs_pending, s->jobs_active, s->jobs_submitted, s->jobs_failed);
        for (size_t i = 0; i < r->n_members; i++) {
            printf("%s{\"rank\":%d,\"worker\":", i ? "," : "", r->members[i]->rank);
            if (r->members[i]->worker)
                json_worker(r->members[i]->worker);
            else
                printf("null");
            printf("}");
        }
        printf("]}\n");
    } else {
        char up[32];
        fmt_duration(up, sizeof(up), s->uptime_ms);
        printf("coordinator %s  version %s  up %s  heartbeat %u ms  job ttl %u s\n",
               esc(c->coordinator), esc(s->software_version), up, s->heartbeat_period_ms,
               s->job_ttl_s);
        printf("workers: %u healthy, %u draining, %u dead, %u left    jobs: %u active, %u "
               "pending, %" PRIu64 " submitted, %" PRIu64 " failed\n\n",
               s->workers_healthy, s->workers_draining, s->workers_dead, s->workers_left,
               s->jobs_active, s->jobs_pending, s->jobs_submitted, s->jobs_failed);
        table_t t = {.ncols = 12};
        const char *head[] = {"RANK", "WORKER", "HOST", "DEVICE", "STATE", "HEARTBEAT",
                              "JOB",  "STEP",   "JOBS", "MEMORY", "POOL",  "ADDRESS"};
        table_add(&t, head);
        for (size_t i = 0; i < r->n_members; i++)
            if (r->members[i]->worker)
                worker_row(&t, r->members[i]->rank, r->members[i]->worker);
        if (r->n_members == 0)
            printf("(no workers registered)\n");
        else
            table_print(&t);
    }
    stria_rpc_reply_free(&sr);
    stria_rpc_reply_free(&rr);
    return EXIT_OK;
}

static int cmd_workers(ctl_t *c)
{
    Stria__V1__ListWorkersRequest req = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t reply;
    stria_status_t st = call(c, STRIA_RPC_COORDINATOR_LIST_WORKERS, &req.base, &reply);
    if (st != STRIA_OK)
        return fail(st);
    const Stria__V1__ListWorkersReply *r = (const Stria__V1__ListWorkersReply *)reply.msg;
    if (c->json) {
        JSON_ARRAY("workers", r->workers, r->n_workers, json_worker);
    } else {
        table_t t = {.ncols = 12};
        const char *head[] = {"RANK", "WORKER", "HOST", "DEVICE", "STATE", "HEARTBEAT",
                              "JOB",  "STEP",   "JOBS", "MEMORY", "POOL",  "ADDRESS"};
        table_add(&t, head);
        for (size_t i = 0; i < r->n_workers; i++)
            worker_row(&t, r->workers[i]->ring_index, r->workers[i]);
        if (r->n_workers == 0)
            printf("(no workers registered)\n");
        else
            table_print(&t);
    }
    stria_rpc_reply_free(&reply);
    return EXIT_OK;
}

static void json_job(const Stria__V1__JobInfo *j)
{
    const Stria__V1__Assignment *a = j->assignment;
    const Stria__V1__JobSpec *s = a ? a->spec : NULL;
    printf("{\"id\":%" PRIu64 ",\"state\":", j->job_id);
    json_str(job_state_name(j->state));
    printf(",\"failure\":");
    json_str(j->failure);
    printf(",\"failure_retryable\":%s,\"blamed_worker_ids\":[",
           j->failure_retryable ? "true" : "false");
    for (size_t i = 0; i < j->n_blamed_worker_ids; i++)
        printf("%s%" PRIu64, i ? "," : "", j->blamed_worker_ids[i]);
    printf("]");
    printf(",\"replaced_by\":%" PRIu64 ",\"replaces\":%" PRIu64
           ",\"generation\":%u,\"replacement_pending\":%s",
           j->replaced_by, j->replaces, j->generation, j->replacement_pending ? "true" : "false");
    printf(",\"queue_position\":%u,\"step\":%u,\"steps_total\":%u", j->queue_position, j->step,
           j->steps_total);
    if (s != NULL) {
        printf(",\"spec\":{\"batch\":%u,\"seq_len\":%" PRIu64 ",\"heads\":%u,\"kv_heads\":%u,"
               "\"head_dim\":%u,\"dtype\":\"%s\",\"causal\":%s,\"layout\":\"%s\","
               "\"ring_size\":%u,\"scale\":%g,\"label\":",
               s->batch, s->seq_len, s->heads, s->kv_heads, s->head_dim, dtype_name(s->dtype),
               s->causal ? "true" : "false", layout_name(s->layout), s->ring_size,
               (double)s->scale);
        json_str(s->label);
        printf(",\"sharded\":%s,\"arrival_timeout_s\":%g,\"session\":%s",
               s->sharded ? "true" : "false", s->arrival_timeout_s, s->session ? "true" : "false");
        if (s->head_groups > 0)
            printf(",\"head_group\":%u,\"head_groups\":%u,\"head_group_tag\":\"%016" PRIx64 "\"",
                   s->head_group, s->head_groups, s->head_group_tag);
        printf("}");
    }
    if (j->session != NULL)
        printf(",\"session\":{\"calls\":%" PRIu64 ",\"failed_calls\":%" PRIu64 ",\"bytes\":%" PRIu64
               ",\"call_p50_ms\":%.3f,\"call_p99_ms\":%.3f}",
               j->session->calls, j->session->failed_calls, j->session->bytes,
               (double)j->session->call_p50_ms, (double)j->session->call_p99_ms);
    if (a != NULL) {
        printf(",\"memory_per_rank_bytes\":%" PRIu64 ",\"ranks\":[", a->memory_per_rank_bytes);
        for (size_t i = 0; i < a->n_ranks; i++) {
            const Stria__V1__RankAssignment *r = a->ranks[i];
            printf("%s{\"rank\":%u,\"worker\":%" PRIu64 ",\"host\":", i ? "," : "", r->rank,
                   r->worker_id);
            json_str(r->host);
            printf(",\"rpc_address\":");
            json_str(r->rpc_address);
            printf(",\"device\":");
            json_str(r->device);
            if (r->has_device_index)
                printf(",\"device_index\":%u", r->device_index);
            if (s != NULL && i < s->n_placement) {
                printf(",\"placed_on\":");
                json_str(s->placement[i]->host);
                if (s->placement[i]->has_device_index)
                    printf(",\"placed_device_index\":%u", s->placement[i]->device_index);
                printf(",\"placement_fallback\":%s", r->placement_fallback ? "true" : "false");
            }
            printf(",\"tokens\":%" PRIu64 "}", r->tokens);
        }
        printf("]");
    }
    const Stria__V1__JobTimings *t = j->timings;
    if (t != NULL)
        printf(",\"timings_ms\":{\"submitted\":%" PRIu64 ",\"started\":%" PRIu64
               ",\"forward_started\":%" PRIu64 ",\"forward_done\":%" PRIu64
               ",\"backward_started\":%" PRIu64 ",\"backward_done\":%" PRIu64
               ",\"finished\":%" PRIu64 ",\"last_activity\":%" PRIu64 "}",
               t->submitted_ms, t->started_ms, t->forward_started_ms, t->forward_done_ms,
               t->backward_started_ms, t->backward_done_ms, t->finished_ms, t->last_activity_ms);
    printf("}");
}

/* Sessions: the jobs with JobSpec.session, with their calls. */
static int cmd_sessions(ctl_t *c, bool all)
{
    Stria__V1__ListJobsRequest req = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.include_finished = all;
    stria_status_t st = call(c, STRIA_RPC_COORDINATOR_LIST_JOBS, &req.base, &reply);
    if (st != STRIA_OK)
        return fail(st);
    const Stria__V1__ListJobsReply *r = (const Stria__V1__ListJobsReply *)reply.msg;
    const Stria__V1__JobInfo **list = calloc(r->n_jobs + 1, sizeof(*list));
    size_t n = 0;
    for (size_t i = 0; list != NULL && i < r->n_jobs; i++)
        if (r->jobs[i]->assignment && r->jobs[i]->assignment->spec &&
            r->jobs[i]->assignment->spec->session)
            list[n++] = r->jobs[i];
    if (c->json) {
        JSON_ARRAY("sessions", list, n, json_job);
    } else if (n == 0) {
        printf(all ? "(no sessions)\n" : "(no open sessions; --all lists closed ones)\n");
    } else {
        table_t t = {.ncols = 10};
        const char *head[] = {"SESSION", "STATE",  "RANKS",  "BOUNDS", "SHAPE",
                              "CALLS",   "FAILED", "P50 MS", "P99 MS", "LABEL / FAILURE"};
        table_add(&t, head);
        for (size_t i = 0; i < n; i++) {
            const Stria__V1__JobInfo *j = list[i];
            const Stria__V1__JobSpec *s = j->assignment->spec;
            const Stria__V1__SessionStats *ss = j->session;
            char id[24], ranks[16], bounds[48], shape[64], calls[24], failed[24], p50[24], p99[24];
            snprintf(id, sizeof(id), "%" PRIu64, j->job_id);
            snprintf(ranks, sizeof(ranks), "%zu", j->assignment->n_ranks);
            snprintf(bounds, sizeof(bounds), "%u x %" PRIu64, s->batch, s->seq_len);
            snprintf(shape, sizeof(shape), "h%u/%u d%u %s %s%s", s->heads, s->kv_heads, s->head_dim,
                     dtype_name(s->dtype), layout_name(s->layout), s->sharded ? " sharded" : "");
            snprintf(calls, sizeof(calls), "%" PRIu64, ss ? ss->calls : 0);
            snprintf(failed, sizeof(failed), "%" PRIu64, ss ? ss->failed_calls : 0);
            snprintf(p50, sizeof(p50), "%.2f", ss ? (double)ss->call_p50_ms : 0.0);
            snprintf(p99, sizeof(p99), "%.2f", ss ? (double)ss->call_p99_ms : 0.0);
            const char *extra = j->failure && j->failure[0] ? j->failure : s->label;
            const char *cells[] = {
                id, job_state_name(j->state), ranks, bounds, shape, calls, failed, p50, p99, extra};
            table_add(&t, cells);
        }
        table_print(&t);
    }
    free(list);
    stria_rpc_reply_free(&reply);
    return EXIT_OK;
}

static int cmd_jobs(ctl_t *c, bool all)
{
    Stria__V1__ListJobsRequest req = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.include_finished = all;
    stria_status_t st = call(c, STRIA_RPC_COORDINATOR_LIST_JOBS, &req.base, &reply);
    if (st != STRIA_OK)
        return fail(st);
    const Stria__V1__ListJobsReply *r = (const Stria__V1__ListJobsReply *)reply.msg;
    if (r->n_jobs == 0 && !c->json) {
        printf(all ? "(no jobs)\n" : "(no active or queued jobs; --all lists finished ones)\n");
    } else if (c->json) {
        JSON_ARRAY("jobs", r->jobs, r->n_jobs, json_job);
    } else {
        table_t t = {.ncols = 8};
        const char *head[] = {"JOB",   "STATE",  "RANKS", "SEQ",
                              "SHAPE", "LAYOUT", "STEP",  "LABEL / FAILURE"};
        table_add(&t, head);
        for (size_t i = 0; i < r->n_jobs; i++) {
            const Stria__V1__JobInfo *j = r->jobs[i];
            const Stria__V1__JobSpec *s = j->assignment ? j->assignment->spec : NULL;
            char id[24], ranks[16], seq[24], shape[64], step[32];
            snprintf(id, sizeof(id), "%" PRIu64, j->job_id);
            snprintf(ranks, sizeof(ranks), "%zu", j->assignment ? j->assignment->n_ranks : 0);
            snprintf(seq, sizeof(seq), "%" PRIu64, s ? s->seq_len : 0);
            if (s)
                snprintf(shape, sizeof(shape), "b%u h%u/%u d%u %s%s", s->batch, s->heads,
                         s->kv_heads, s->head_dim, dtype_name(s->dtype),
                         s->causal ? " causal" : "");
            else
                snprintf(shape, sizeof(shape), "-");
            if (j->steps_total)
                snprintf(step, sizeof(step), "%u/%u", j->step, j->steps_total);
            else
                snprintf(step, sizeof(step), "-");
            char failure[600];
            snprintf(failure, sizeof(failure), "%s%s", j->failure_retryable ? "(retryable) " : "",
                     j->failure ? j->failure : "");
            const char *extra = j->failure && j->failure[0] ? failure : s ? s->label : "";
            const char *cells[] = {id,    job_state_name(j->state),         ranks, seq,
                                   shape, s ? layout_name(s->layout) : "-", step,  extra};
            table_add(&t, cells);
        }
        table_print(&t);
    }
    stria_rpc_reply_free(&reply);
    return EXIT_OK;
}

static bool parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || s[0] == '-')
        return false;
    *out = v;
    return true;
}

static void print_ms_time(const char *label, uint64_t ms, uint64_t base)
{
    if (ms == 0)
        return;
    time_t sec = (time_t)(ms / 1000);
    struct tm tm;
    char buf[64];
    gmtime_r(&sec, &tm);
    strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
    if (base != 0 && ms >= base)
        printf("  %-18s %s.%03" PRIu64 "Z  (+%.3f s)\n", label, buf, ms % 1000,
               (double)(ms - base) / 1000.0);
    else
        printf("  %-18s %s.%03" PRIu64 "Z\n", label, buf, ms % 1000);
}

/* ---- job --timeline ----------------------------------------------------------- */

/* One rank's entry: its spans, or (a summarised group of steps) its compute
 * then its wait totals drawn in that order inside the group's time. */
static stria_status_t timeline_entry(stria_timeline_t *tl, int panel, int row,
                                     const Stria__V1__StepTimes *e)
{
    stria_status_t st = STRIA_OK;
    const struct {
        size_t n;
        const uint64_t *v;
        stria_timeline_kind_t kind;
    } lists[3] = {{e->n_compute_spans, e->compute_spans, STRIA_TIMELINE_COMPUTE},
                  {e->n_wait_spans, e->wait_spans, STRIA_TIMELINE_WAIT},
                  {e->n_send_spans, e->send_spans, STRIA_TIMELINE_SEND}};
    if (e->n_compute_spans + e->n_wait_spans + e->n_send_spans == 0) {
        double b = (double)e->begin_us * 1e-6, d = (double)(e->end_us - e->begin_us) * 1e-6;
        double cw = (double)(e->compute_us + e->wait_us) * 1e-6;
        double f = cw > d && cw > 0 ? d / cw : 1.0, cpt = (double)e->compute_us * 1e-6 * f;
        st = stria_timeline_span(tl, panel, row, STRIA_TIMELINE_COMPUTE, b, b + cpt);
        if (st == STRIA_OK)
            st = stria_timeline_span(tl, panel, row, STRIA_TIMELINE_WAIT, b + cpt,
                                     b + cpt + (double)e->wait_us * 1e-6 * f);
        return st;
    }
    for (int k = 0; k < 3 && st == STRIA_OK; k++)
        for (size_t i = 0; i + 1 < lists[k].n && st == STRIA_OK; i += 2)
            st = stria_timeline_span(tl, panel, row, lists[k].kind, (double)lists[k].v[i] * 1e-6,
                                     (double)lists[k].v[i + 1] * 1e-6);
    return st;
}

/* One panel per direction of the job's latest passes (a session's latest
 * sampled calls), a row per rank. */
static stria_status_t timeline_panels(stria_timeline_t *tl, const Stria__V1__JobInfo *j,
                                      int n_ranks, bool session)
{
    stria_status_t st = STRIA_OK;
    for (int d = 0; d < 2 && st == STRIA_OK; d++) {
        double end = 0;
        uint32_t pass = 0;
        size_t seen = 0;
        for (size_t i = 0; i < j->n_timelines; i++) {
            const Stria__V1__PassTimeline *t = j->timelines[i];
            if (t->backward != (d == 1) || (int)t->rank >= n_ranks)
                continue;
            seen++;
            pass = t->pass;
            end = (double)t->seconds_us * 1e-6 > end ? (double)t->seconds_us * 1e-6 : end;
        }
        if (seen == 0)
            continue;
        char name[64], note[128];
        int panel;
        snprintf(name, sizeof(name), "%s %s %u", d ? "backward" : "forward",
                 session ? "call" : "pass", pass);
        snprintf(note, sizeof(note), "%zu of %d ranks reported; the slowest took %.4f s", seen,
                 n_ranks, end);
        if ((st = stria_timeline_panel(tl, name, note, n_ranks, &panel)) != STRIA_OK)
            break;
        stria_timeline_panel_end(tl, panel, end);
        for (size_t i = 0; i < j->n_timelines && st == STRIA_OK; i++) {
            const Stria__V1__PassTimeline *t = j->timelines[i];
            if (t->backward != (d == 1) || (int)t->rank >= n_ranks)
                continue;
            for (size_t e = 0; e < t->n_entries && st == STRIA_OK; e++)
                st = timeline_entry(tl, panel, (int)t->rank, t->entries[e]);
        }
    }
    return st;
}

/* Draws the job's latest forward and backward passes (a session's latest
 * sampled forward and backward calls) into path. */
static stria_status_t job_timeline(const Stria__V1__JobInfo *j, const char *path)
{
    const Stria__V1__Assignment *a = j->assignment;
    const Stria__V1__JobSpec *s = a != NULL ? a->spec : NULL;
    char title[512], sub[384];
    bool summarised = false;
    stria_timeline_t *tl = NULL;
    if (s == NULL || a->n_ranks == 0)
        return stria_error_set(STRIA_ERR_PROTOCOL, "the coordinator sent no assignment");
    const bool session = s->session;
    if (j->n_timelines == 0 && session)
        return stria_error_set(STRIA_ERR_NOT_FOUND,
                               "session %" PRIu64 " has no call timelines yet (the workers keep "
                               "those of calls 0, 64, 128, ... and report them in their next "
                               "heartbeat; or the coordinator dropped them for newer jobs)",
                               j->job_id);
    if (j->n_timelines == 0)
        return stria_error_set(STRIA_ERR_NOT_FOUND,
                               "job %" PRIu64 " has no pass timelines (no pass finished yet, or "
                               "the coordinator dropped them for newer jobs)",
                               j->job_id);
    snprintf(title, sizeof(title),
             "%s %" PRIu64 ": %zu ranks, seq %" PRIu64 ", batch %u, heads %u/%u, dim %u, %s, "
             "%s, %s layout%s%s",
             session ? "session" : "job", j->job_id, a->n_ranks, s->seq_len, s->batch, s->heads,
             s->kv_heads, s->head_dim, dtype_name(s->dtype), s->causal ? "causal" : "non-causal",
             layout_name(s->layout), s->label != NULL && s->label[0] ? ", " : "",
             s->label != NULL ? s->label : "");
    for (size_t i = 0; i < j->n_timelines; i++)
        summarised = summarised || j->timelines[i]->summarised;
    snprintf(sub, sizeof(sub),
             "step times reported by the workers%s; each rank's row starts at its own pass start "
             "(the hosts' clocks are not compared)%s",
             session ? " for the latest sampled calls (every 64th); seq and batch are the bounds"
                     : "",
             summarised ? "; groups of steps drawn as their compute, then their wait" : "");
    stria_status_t st = stria_timeline_create(title, sub, &tl);
    if (st == STRIA_OK && (st = timeline_panels(tl, j, (int)a->n_ranks, session)) == STRIA_OK)
        st = stria_timeline_write_svg(tl, path);
    stria_timeline_destroy(tl);
    return st;
}

/* A job's ranks: worker, host, device, address, tokens, and where the spec
 * placed the rank (host/device index; "fallback" when it is elsewhere). */
static void job_ranks(const Stria__V1__Assignment *a, const Stria__V1__JobSpec *s)
{
    char mem[32];
    bool placed = s != NULL && s->n_placement == a->n_ranks;
    fmt_bytes(mem, sizeof(mem), a->memory_per_rank_bytes);
    printf("assignment: %zu ranks, %s per rank%s\n", a->n_ranks, mem,
           placed ? ", placed by the spec" : "");
    table_t t = {.ncols = placed ? 7 : 6};
    const char *head[] = {"RANK", "WORKER", "HOST", "DEVICE", "ADDRESS", "TOKENS", "PLACED ON"};
    table_add(&t, head);
    for (size_t i = 0; i < a->n_ranks; i++) {
        const Stria__V1__RankAssignment *r = a->ranks[i];
        char rk[16], wid[24], tok[24], dev[300], place[300] = "";
        snprintf(rk, sizeof(rk), "%u", r->rank);
        snprintf(wid, sizeof(wid), "%" PRIu64, r->worker_id);
        snprintf(tok, sizeof(tok), "%" PRIu64, r->tokens);
        if (r->has_device_index && strncmp(r->device, "cuda:", 5) != 0)
            snprintf(dev, sizeof(dev), "%.200s #%u", r->device, r->device_index);
        else
            snprintf(dev, sizeof(dev), "%.200s", r->device);
        if (placed && s->placement[i]->has_device_index)
            snprintf(place, sizeof(place), "%.200s/%u%s", s->placement[i]->host,
                     s->placement[i]->device_index, r->placement_fallback ? " (fallback)" : "");
        else if (placed)
            snprintf(place, sizeof(place), "%.200s%s", s->placement[i]->host,
                     r->placement_fallback ? " (fallback)" : "");
        const char *cells[] = {rk, wid, r->host, dev, r->rpc_address, tok, place};
        table_add(&t, cells);
    }
    table_print(&t);
}

/* The G x R grid of a head-grouped session (libstria's G sessions, one
 * per group of heads, sharing s's head_group_tag): a row per group, its
 * latest session (open or over: replaced rings and closed sessions are
 * drawn too), its state, heads and ring (each rank's host and worker). */
static void head_group_grid(ctl_t *c, const Stria__V1__JobSpec *s)
{
    Stria__V1__ListJobsRequest req = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.include_finished = true;
    if (call(c, STRIA_RPC_COORDINATOR_LIST_JOBS, &req.base, &reply) != STRIA_OK) {
        printf("head groups: %u (the grid: %s)\n", s->head_groups, stria_error_msg());
        return;
    }
    const Stria__V1__ListJobsReply *r = (const Stria__V1__ListJobsReply *)reply.msg;
    const uint32_t G = s->head_groups;
    printf("head groups: %u rings of %u ranks, ring g computing query heads [g*%u, (g+1)*%u) "
           "and kv heads [g*%u, (g+1)*%u)\n",
           G, s->ring_size, s->heads, s->heads, s->kv_heads, s->kv_heads);
    table_t t = {.ncols = 5};
    const char *head[] = {"GROUP", "SESSION", "STATE", "HEADS", "RING (rank: host/worker)"};
    table_add(&t, head);
    for (uint32_t g = 0; g < G; g++) {
        const Stria__V1__JobInfo *found = NULL;
        for (size_t i = 0; i < r->n_jobs; i++) {
            const Stria__V1__Assignment *a = r->jobs[i]->assignment;
            if (a != NULL && a->spec != NULL && a->spec->head_group_tag == s->head_group_tag &&
                a->spec->head_groups == G && a->spec->head_group == g &&
                (found == NULL || r->jobs[i]->job_id > found->job_id))
                found = r->jobs[i];
        }
        char grp[16], id[24], heads[48], ring[1024] = "";
        snprintf(grp, sizeof(grp), "%u", g);
        snprintf(heads, sizeof(heads), "%u-%u", g * s->heads, (g + 1) * s->heads - 1);
        snprintf(id, sizeof(id), found ? "%" PRIu64 : "-", found ? found->job_id : 0);
        size_t used = 0;
        for (size_t k = 0; found != NULL && k < found->assignment->n_ranks; k++) {
            const Stria__V1__RankAssignment *ra = found->assignment->ranks[k];
            int n = snprintf(ring + used, sizeof(ring) - used, "%s%u: %.64s/%" PRIu64,
                             k ? "  " : "", ra->rank, ra->host, ra->worker_id);
            if (n < 0 || (size_t)n >= sizeof(ring) - used)
                break;
            used += (size_t)n;
        }
        const char *cells[] = {grp, id, found ? job_state_name(found->state) : "-", heads,
                               found ? ring : "(unknown to the coordinator)"};
        table_add(&t, cells);
    }
    table_print(&t);
    stria_rpc_reply_free(&reply);
}

static int cmd_job(ctl_t *c, uint64_t id)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.job_id = id;
    req.include_timelines = c->timeline != NULL;
    stria_status_t st = call(c, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, &reply);
    if (st != STRIA_OK)
        return fail(st);
    const Stria__V1__JobInfo *j = ((const Stria__V1__GetJobReply *)reply.msg)->job;
    if (j == NULL) {
        stria_rpc_reply_free(&reply);
        stria_error_set(STRIA_ERR_PROTOCOL, "the coordinator sent no job");
        return fail(STRIA_ERR_PROTOCOL);
    }
    if (c->timeline != NULL) {
        const bool session =
            j->assignment != NULL && j->assignment->spec != NULL && j->assignment->spec->session;
        st = job_timeline(j, c->timeline);
        stria_rpc_reply_free(&reply);
        if (st != STRIA_OK) { /* nothing to draw, or the file: not the coordinator's doing */
            fail(st);
            return EXIT_REFUSED;
        }
        if (!c->json)
            printf("%s %" PRIu64 ": timeline written to %s\n", session ? "session" : "job", id,
                   c->timeline);
        else {
            printf("{\"job_id\":%" PRIu64 ",\"timeline\":", id);
            json_str(c->timeline);
            printf("}\n");
        }
        return EXIT_OK;
    }
    if (c->json) {
        json_job(j);
        printf("\n");
    } else {
        const Stria__V1__Assignment *a = j->assignment;
        const Stria__V1__JobSpec *s = a ? a->spec : NULL;
        printf("job %" PRIu64 "  %s", j->job_id, job_state_name(j->state));
        if (j->steps_total)
            printf("  step %u/%u", j->step, j->steps_total);
        if (j->queue_position)
            printf("  queue position %u", j->queue_position);
        printf("\n");
        if (j->failure && j->failure[0]) {
            printf("failure: %s\n", esc(j->failure));
            if (j->state == STRIA__V1__JOB_STATE__JOB_STATE_FAILED)
                printf("retryable: %s\n", j->failure_retryable
                                              ? "yes (a cause outside the job: submit it again)"
                                              : "no (it would fail again)");
            for (size_t i = 0; i < j->n_blamed_worker_ids; i++)
                printf("blamed: worker %" PRIu64 "\n", j->blamed_worker_ids[i]);
        }
        if (j->replaced_by != 0)
            printf("replaced by: job %" PRIu64 " (a worker was lost; its ranks moved there)\n",
                   j->replaced_by);
        else if (j->replacement_pending)
            printf("replacement: pending (the coordinator waits for the verdict on a worker)\n");
        if (j->replaces != 0)
            printf("replaces: job %" PRIu64 " (replacement %u)\n", j->replaces, j->generation);
        if (s) {
            printf("spec: batch %u, seq_len %" PRIu64 ", heads %u, kv_heads %u, head_dim %u, "
                   "%s, %s, %s layout, scale %g%s%s\n",
                   s->batch, s->seq_len, s->heads, s->kv_heads, s->head_dim, dtype_name(s->dtype),
                   s->causal ? "causal" : "non-causal", layout_name(s->layout), (double)s->scale,
                   s->label && s->label[0] ? ", " : "", esc(s->label));
        }
        if (s && s->sharded)
            printf("sharded: each trainer rank brings its own tokens; arrival timeout %g s\n",
                   s->arrival_timeout_s);
        if (s && s->session)
            printf("session: bounds batch %u x seq_len %" PRIu64 "; idle deadline %u s\n", s->batch,
                   s->seq_len, s->ttl_s);
        if (j->session != NULL)
            printf("calls: %" PRIu64 " (%" PRIu64 " failed), %.1f MiB moved, worker time per "
                   "call p50 %.3f ms, p99 %.3f ms (last 256 calls)\n",
                   j->session->calls, j->session->failed_calls,
                   (double)j->session->bytes / 1048576.0, (double)j->session->call_p50_ms,
                   (double)j->session->call_p99_ms);
        if (a && a->n_ranks)
            job_ranks(a, s);
        if (s && s->head_groups > 1)
            head_group_grid(c, s);
        const Stria__V1__JobTimings *t = j->timings;
        if (t) {
            printf("timings (UTC):\n");
            print_ms_time("submitted", t->submitted_ms, 0);
            print_ms_time("started", t->started_ms, t->submitted_ms);
            print_ms_time("forward started", t->forward_started_ms, t->submitted_ms);
            print_ms_time("forward done", t->forward_done_ms, t->submitted_ms);
            print_ms_time("backward started", t->backward_started_ms, t->submitted_ms);
            print_ms_time("backward done", t->backward_done_ms, t->submitted_ms);
            print_ms_time("finished", t->finished_ms, t->submitted_ms);
            print_ms_time("last activity", t->last_activity_ms, t->submitted_ms);
        }
    }
    stria_rpc_reply_free(&reply);
    return EXIT_OK;
}

/* A worker named by id or RPC address. */
static stria_status_t resolve_worker(ctl_t *c, const char *name, uint64_t *id_out)
{
    Stria__V1__ListWorkersRequest req = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t reply;
    uint64_t id = 0;
    bool numeric = parse_u64(name, &id);
    stria_status_t st = call(c, STRIA_RPC_COORDINATOR_LIST_WORKERS, &req.base, &reply);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__ListWorkersReply *r = (const Stria__V1__ListWorkersReply *)reply.msg;
    st = stria_error_set(STRIA_ERR_NOT_FOUND,
                         "no worker '%s' (give a worker id or RPC address; see striactl "
                         "workers)",
                         name);
    for (size_t i = 0; i < r->n_workers; i++) {
        const Stria__V1__WorkerInfo *w = r->workers[i];
        if ((numeric && w->worker_id == id) ||
            (w->rpc_address && strcmp(w->rpc_address, name) == 0)) {
            *id_out = w->worker_id;
            st = STRIA_OK;
            break;
        }
    }
    stria_rpc_reply_free(&reply);
    return st;
}

static int cmd_drain(ctl_t *c, const char *name, bool drain)
{
    uint64_t id = 0;
    stria_status_t st = resolve_worker(c, name, &id);
    if (st != STRIA_OK)
        return fail(st);
    Stria__V1__DrainWorkerRequest req = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.worker_id = id;
    req.drain = drain;
    st = call(c, STRIA_RPC_COORDINATOR_DRAIN_WORKER, &req.base, &reply);
    if (st != STRIA_OK)
        return fail(st);
    const Stria__V1__WorkerInfo *w = ((const Stria__V1__DrainWorkerReply *)reply.msg)->worker;
    if (c->json) {
        printf("{\"worker\":");
        if (w)
            json_worker(w);
        else
            printf("null");
        printf("}\n");
    } else {
        printf("worker %" PRIu64 " (%s): %s%s\n", id, esc(w ? w->rpc_address : "?"),
               drain ? "draining" : "undrained",
               drain && w && w->n_job_ids ? " (finishing its jobs)" : "");
    }
    stria_rpc_reply_free(&reply);
    return EXIT_OK;
}

static int cmd_cancel(ctl_t *c, uint64_t id, const char *reason)
{
    Stria__V1__CancelJobRequest req = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.job_id = id;
    req.reason = (char *)(reason ? reason : "cancelled by an administrator (striactl)");
    stria_status_t st = call(c, STRIA_RPC_COORDINATOR_CANCEL_JOB, &req.base, &reply);
    if (st != STRIA_OK)
        return fail(st);
    const Stria__V1__CancelJobReply *r = (const Stria__V1__CancelJobReply *)reply.msg;
    if (c->json)
        printf("{\"id\":%" PRIu64 ",\"state\":\"%s\"}\n", id, job_state_name(r->state));
    else
        printf("job %" PRIu64 ": %s\n", id, job_state_name(r->state));
    stria_rpc_reply_free(&reply);
    return EXIT_OK;
}

/* Runs the parsed command; its arguments are checked before connecting. */
static int run_command(ctl_t *c, const char *token_file, const stria_cli_t *cli, bool all,
                       const char *reason)
{
    const char *cmd = cli->cmd->name, *arg = cli->nargs > 0 ? cli->args[0] : NULL;
    uint64_t id = 0; /* job and cancel */
    if (arg != NULL && arg[0] == '\0') {
        fprintf(stderr, "striactl %s: empty argument (see striactl %s --help)\n", cmd, cmd);
        return EXIT_USAGE;
    }
    if ((strcmp(cmd, "job") == 0 || strcmp(cmd, "session") == 0 || strcmp(cmd, "cancel") == 0) &&
        !parse_u64(arg, &id)) {
        fprintf(stderr, "striactl %s: job id '%s' is not a number\n", cmd, arg);
        return EXIT_USAGE;
    }
    if (token_file != NULL && token_file[0] != '\0' &&
        stria_rpc_token_read(token_file, &c->token) != STRIA_OK) {
        fprintf(stderr, "striactl: %s\n", stria_error_msg());
        return EXIT_USAGE;
    }
    const stria_rpc_client_params_t p = {.address = c->coordinator,
                                         .service = &stria__v1__coordinator__descriptor,
                                         .token = c->token,
                                         .client_name = "striactl",
                                         .connect_timeout_s = c->timeout_s};
    stria_status_t st = stria_rpc_client_connect(&p, &c->rpc);
    if (st != STRIA_OK) {
        if (st != STRIA_ERR_AUTH)
            stria_error_wrap(st, "cannot reach the coordinator at %s", c->coordinator);
        stria_auth_free_secret(c->token);
        return fail(st == STRIA_ERR_AUTH ? st : STRIA_ERR_IO);
    }
    int rc;
    if (strcmp(cmd, "status") == 0)
        rc = cmd_status(c);
    else if (strcmp(cmd, "workers") == 0)
        rc = cmd_workers(c);
    else if (strcmp(cmd, "jobs") == 0)
        rc = cmd_jobs(c, all);
    else if (strcmp(cmd, "sessions") == 0)
        rc = cmd_sessions(c, all);
    else if (strcmp(cmd, "job") == 0 || strcmp(cmd, "session") == 0)
        rc = cmd_job(c, id);
    else if (strcmp(cmd, "drain") == 0 || strcmp(cmd, "undrain") == 0)
        rc = cmd_drain(c, arg, cmd[0] == 'd');
    else
        rc = cmd_cancel(c, id, reason);
    stria_rpc_client_close(c->rpc);
    stria_auth_free_secret(c->token);
    return rc;
}

int main(int argc, char **argv)
{
    ctl_t c;
    const char *token_file = getenv("STRIA_TOKEN_FILE"), *env = getenv("STRIA_COORDINATOR");
    const char *reason = NULL;
    bool all = false;
    stria_cli_t cli;

    memset(&c, 0, sizeof(c));
    const stria_option_t options[] = {
        STRIA_OPTION("coordinator", ADDR, &c.coordinator, "HOST:PORT",
                     "the coordinator; $STRIA_COORDINATOR, if set, is the default",
                     .dflt = env != NULL && env[0] != '\0' ? env : STRIACTL_DEFAULT_COORDINATOR),
        STRIA_OPTION("token-file", STRING, &token_file, "FILE",
                     "a credential: the client one for status and workers, the admin one for "
                     "everything; proven, never sent; default $STRIA_TOKEN_FILE"),
        STRIA_OPTION("json", FLAG, &c.json, NULL,
                     "machine-readable output with stable field names (docs/DEPLOY.md)"),
        STRIA_OPTION("timeout", DURATION, &c.timeout_s, "TIME",
                     "deadline of connecting and of each request", .dflt = "10", .min = 0,
                     .max = INFINITY, .flags = STRIA_OPT_ABOVE_MIN),
        {.name = NULL},
    };
    const stria_option_t jobs_options[] = {
        STRIA_OPTION("all", FLAG, &all, NULL, "finished jobs too"),
        {.name = NULL},
    };
    const stria_option_t job_options[] = {
        STRIA_OPTION("timeline", STRING, &c.timeline, "FILE.svg",
                     "draw the job's latest forward and backward passes from the step times its "
                     "workers reported: a row per rank, each from its own pass start"),
        {.name = NULL},
    };
    const stria_option_t cancel_options[] = {
        STRIA_OPTION("reason", STRING, &reason, "TEXT",
                     "why, shown with the job (default: cancelled by an administrator)"),
        {.name = NULL},
    };
    const stria_command_t cmds[] = {
        {.name = "status",
         .summary = "the ring: one line per worker, and coordinator "
                    "uptime/version"},
        {.name = "workers", .summary = "every known worker"},
        {.name = "jobs",
         .summary = "active and queued jobs (--all: finished ones too) (admin)",
         .options = jobs_options},
        {.name = "job",
         .summary = "one job: spec, assignment, state, timings, failure reason (admin; "
                    "--timeline: its passes drawn as an SVG)",
         .args = "ID",
         .min_args = 1,
         .max_args = 1,
         .options = job_options},
        {.name = "sessions",
         .summary = "open sessions with their calls and call latencies (--all: closed ones "
                    "too) (admin)",
         .options = jobs_options},
        {.name = "session",
         .summary = "one session: bounds, members, calls, call latency p50/p99, state (admin; "
                    "--timeline as for a job)",
         .args = "ID",
         .min_args = 1,
         .max_args = 1,
         .options = job_options},
        {.name = "drain",
         .args = "WORKER",
         .min_args = 1,
         .max_args = 1,
         .summary = "the worker finishes its running jobs and takes no new ones; jobs queued "
                    "on it fail (admin)"},
        {.name = "undrain",
         .summary = "the worker takes jobs again (admin)",
         .args = "WORKER",
         .min_args = 1,
         .max_args = 1},
        {.name = "cancel",
         .args = "JOB",
         .min_args = 1,
         .max_args = 1,
         .options = cancel_options,
         .summary = "stop a job; a running pass ends at its next ring step (admin)"},
        {.name = NULL},
    };
    const stria_command_t root = {.name = "striactl",
                                  .description = ctl_description,
                                  .epilog = ctl_epilog,
                                  .options = options,
                                  .commands = cmds};
    int rc = stria_cli_main(&root, argc, argv, &cli);
    if (rc < 0)
        rc = run_command(&c, token_file, &cli, all, reason);
    stria_cli_free(&cli);
    return rc;
}
