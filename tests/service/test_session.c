/* Sessions (stria_session_open() and its calls) with real processes on
 * loopback: every call of a session gives the in-process ring's bits (same
 * layout, ring size and dtype) whatever its batch, length, causality, scale,
 * documents or window within the session's bounds, forward and backward
 * (which brings Q, K, V, O, LSE and dO), striped, zigzag and contiguous,
 * bf16 and fp32, GQA, on rings of 1, 3 and 4 workers, over TCP and through
 * a co-located client's arena; a call beyond the bounds or with bad input
 * is refused with a message naming what is wrong, and the session serves
 * on; hundreds of calls leave the workers' (and the client's) descriptors,
 * threads and mappings where the first calls put them; two sessions on the
 * same workers, called alternately or at once, never mix their calls, and
 * threads calling one session are served one at a time; a sharded
 * session's ranks (threads with clients of their own) get the reference's
 * bits, and a call on which the ranks disagree fails on every rank, not
 * retryably, naming a rank, and the next agreed call succeeds. (Failures
 * between calls and closing: test_session_failures.) */
#include <criterion/criterion.h>

#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy_util.h"
#include "fault_util.h"
#include "session_util.h"
#include "stria_common.h"
#include "stria_docplan.h"
#include "stria_ring.h"

/* A cluster of n workers and a client of it. With `arena` the workers have
 * a runtime directory (their Unix sockets) and the client requires the
 * shared-memory path: a session's ranks then use the client's arena. */
static stria_client_t *start(dcluster_t *c, int n, bool arena)
{
    char rundir[160];
    snprintf(rundir, sizeof(rundir), "--runtime-dir=/tmp/stria_deploy_%d", (int)getpid());
    char *wargs[] = {rundir, NULL};
    dc_opts_t o = {.worker_args = arena ? wargs : NULL};
    dc_start(c, n, &o); /* (its scratch folder is that runtime directory) */
    if (!arena)
        return dc_client(c, NULL, "test_session", 0);
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *cl = NULL;
    p.coordinator = c->coord_addr;
    p.client_name = "test_session (arena)";
    p.data_path = STRIA_DATA_PATH_SHM;
    cr_assert_eq(stria_client_connect(&p, &cl), STRIA_OK, "%s", stria_error_msg());
    return cl;
}

/* ---- every kind of call on one session ----------------------------------------- */

/* A packed forward of call c on session s ran only the steps its document
 * plan needs and sent only its spread rows: per step after the first, every
 * rank's travelling K and V rows, and the ring's closing agreement. */
static void check_packed_ring(stria_session_t *s, const stria_session_spec_t *sp,
                              const stria_call_t *c)
{
    const int n = stria_session_ring_size(s);
    const stria_call_shape_t shape = {.batch = c->batch,
                                      .seq_len = c->seq_len,
                                      .causal = c->causal,
                                      .scale = c->scale,
                                      .cu_seqlens = c->cu_seqlens,
                                      .n_cu_seqlens = c->n_cu_seqlens,
                                      .has_window = c->has_window,
                                      .window_left = c->window_left,
                                      .window_right = c->window_right};
    stria_layout_t lay;
    stria_docplan_t *plan;
    cr_assert_eq(stria_docplan_layout(STRIA_LAYOUT_PACKED, &shape, n, &lay, &plan), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_not_null(plan, "a call with documents has a plan");
    fu_job_t j;
    se_call_tensors(&j, sp, c, 4242);
    cr_assert_eq(stria_session_forward(s, c, j.q, j.k, j.v, j.o, j.lse), STRIA_OK, "%s",
                 stria_error_msg());
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    uint64_t travel = 0;
    for (int r = 0; r < n; r++)
        travel += (uint64_t)plan->travel[r];
    const uint64_t row = (uint64_t)(c->batch * sp->kv_heads * sp->head_dim) * j.es;
    const uint64_t want = (uint64_t)(plan->steps - 1) * travel * 2 * row +
                          (uint64_t)n * (uint64_t)(n > 1 ? n - 1 : 0) * sizeof(uint64_t);
    cr_expect_eq(st.last_steps, (uint32_t)plan->steps, "the plan needs %d steps; the call ran %u",
                 plan->steps, st.last_steps);
    cr_expect_eq(st.last_ring_bytes, want,
                 "%d steps of %llu travelling rows (of %lld tokens) make %llu bytes; the ring sent "
                 "%llu",
                 plan->steps, (unsigned long long)travel, (long long)c->seq_len,
                 (unsigned long long)want, (unsigned long long)st.last_ring_bytes);
    fu_job_free(&j);
    stria_docplan_unref(plan);
}

/* Calls of every kind within bounds of batch 2 x 160 tokens. */
static void every_kind_of_call(stria_layout_kind_t layout, stria_dtype_t dtype, int workers,
                               int ring, bool arena)
{
    dcluster_t c;
    stria_client_t *cl = start(&c, workers, arena);
    stria_session_spec_t sp = se_spec_of(2, 160, 4, 2, 32, dtype, layout, ring);
    stria_session_t *s = se_open_session(cl, &sp);
    int want_ring = ring > 0 ? ring : workers;
    cr_expect_eq(stria_session_ring_size(s), want_ring);
    cr_expect_eq(stria_session_layout(s), layout);
    cr_expect_neq(stria_session_id(s), 0u);

    static const int64_t docs[] = {0, 17, 60, 96};
    /* lengths 1 to longer than a shard, not divisible by anything */
    static const int64_t many[] = {0, 1, 3, 6, 11, 19, 32, 53, 87, 120, 150};
    stria_call_t calls[10];
    calls[0] = se_call_of(1, 160, true); /* the bounds' length */
    calls[1] = se_call_of(2, 72, true);
    calls[2] = se_call_of(1, 101, false);
    calls[3] = se_call_of(2, 96, true); /* documents */
    calls[3].cu_seqlens = docs;
    calls[3].n_cu_seqlens = 4;
    calls[4] = se_call_of(1, 128, true); /* a causal window */
    calls[4].has_window = true;
    calls[4].window_left = 24;
    calls[5] = se_call_of(1, 90, false); /* a two-sided window and a scale */
    calls[5].has_window = true;
    calls[5].window_left = 10;
    calls[5].window_right = 20;
    calls[5].scale = 0.1f;
    calls[6] = se_call_of(2, 160, false); /* the whole bounds */
    calls[7] = se_call_of(1, 40, true);   /* forward only, then the first shape again */
    calls[8] = se_call_of(2, 150, true);  /* many documents */
    calls[8].cu_seqlens = many;
    calls[8].n_cu_seqlens = 11;
    calls[9] = calls[8]; /* documents and a window, not causal */
    calls[9].causal = false;
    calls[9].has_window = true;
    calls[9].window_left = 6;
    calls[9].window_right = 9;
    const char *what[10] = {"160 tokens",          "batch 2",       "not causal",
                            "documents",           "causal window", "window and scale",
                            "whole bounds",        "forward only",  "many documents",
                            "documents and window"};
    for (int i = 0; i < 10; i++)
        se_check_call(s, &sp, &calls[i], i != 7, 100 + (uint64_t)i, what[i]);
    se_check_call(s, &sp, &calls[0], true, 200, "160 tokens again");
    if (layout == STRIA_LAYOUT_PACKED)
        check_packed_ring(s, &sp, &calls[8]);

    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    const uint64_t calls_made = layout == STRIA_LAYOUT_PACKED ? 22u : 21u;
    cr_expect_eq(st.calls, calls_made,
                 "10 forward and backward calls, 1 forward (packed: 2): %llu "
                 "calls",
                 (unsigned long long)st.calls);
    cr_expect_eq(st.failed, 0u);
    cr_expect_eq(st.generation, 1u, "opened %u times", st.generation);
    cr_expect_eq(st.reopened, 0u);
    if (!arena) { /* (through the arena no byte travels) */
        cr_expect_gt(st.bytes_up, 0u);
        cr_expect_gt(st.bytes_down, 0u);
    }
    cr_expect_gt(st.last_call_s, 0.0);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, striped_bf16_gqa_ring_of_4_equals_the_in_process_ring, .timeout = T_TIMEOUT)
{
    every_kind_of_call(STRIA_LAYOUT_STRIPED, STRIA_DTYPE_BF16, 4, 0, false);
}

Test(session, zigzag_fp32_ring_of_3_equals_the_in_process_ring, .timeout = T_TIMEOUT)
{
    every_kind_of_call(STRIA_LAYOUT_ZIGZAG, STRIA_DTYPE_F32, 3, 3, false);
}

Test(session, contiguous_bf16_ring_of_1_equals_the_in_process_ring, .timeout = T_TIMEOUT)
{
    every_kind_of_call(STRIA_LAYOUT_CONTIGUOUS, STRIA_DTYPE_BF16, 2, 1, false);
}

Test(session, zigzag_bf16_ring_of_3_through_the_arena_equals_the_in_process_ring,
     .timeout = T_TIMEOUT)
{
    every_kind_of_call(STRIA_LAYOUT_ZIGZAG, STRIA_DTYPE_BF16, 3, 3, true);
}

/* Packed: the calls with documents placed by their plan (the in-process ring
 * runs the same plan; tests/ring holds both to the fp64 reference), the
 * others striped. */
Test(session, packed_fp32_gqa_ring_of_4_equals_the_in_process_ring, .timeout = T_TIMEOUT)
{
    every_kind_of_call(STRIA_LAYOUT_PACKED, STRIA_DTYPE_F32, 4, 0, false);
}

Test(session, packed_fp16_ring_of_3_through_the_arena_equals_the_in_process_ring,
     .timeout = T_TIMEOUT)
{
    every_kind_of_call(STRIA_LAYOUT_PACKED, STRIA_DTYPE_F16, 3, 3, true);
}

/* ---- refusals ---------------------------------------------------------------------- */

/* A refused call: `want` status, a message holding one of the needles, and
 * the session serving the next good call. */
static void expect_refused(stria_session_t *s, const stria_session_spec_t *sp,
                           const stria_call_t *bad, stria_status_t want, const char *const *needles,
                           const char *what, uint64_t seed)
{
    fu_job_t j;
    stria_call_t shape = *bad; /* tensors of a size the call names, at least one row */
    if (shape.batch < 1)
        shape.batch = 1;
    if (shape.seq_len < 1)
        shape.seq_len = 1;
    se_call_tensors(&j, sp, &shape, seed);
    stria_status_t st = stria_session_forward(s, bad, j.q, j.k, j.v, j.o, j.lse);
    char msg[1024];
    snprintf(msg, sizeof(msg), "%s", stria_error_msg());
    cr_expect_eq(st, want, "%s: %s, expected %s: %s", what, stria_status_name(st),
                 stria_status_name(want), msg);
    bool named = needles == NULL;
    for (size_t i = 0; needles != NULL && needles[i] != NULL; i++)
        named |= strstr(msg, needles[i]) != NULL;
    cr_expect(named, "%s: the message does not name %s ('%s')", what, needles ? needles[0] : "",
              msg);
    cr_log_info("refused, %s: %s", what, msg);
    fu_job_free(&j);
    stria_call_t good = se_call_of(1, 64, true);
    char after[128];
    snprintf(after, sizeof(after), "the good call after '%s'", what);
    se_check_call(s, sp, &good, true, seed + 1, after);
}

Test(session, call_beyond_the_bounds_is_refused_naming_the_bound, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t sp = se_spec_of(3, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_AUTO, 2);
    stria_session_t *s = se_open_session(cl, &sp);
    cr_expect_eq(stria_session_layout(s), STRIA_LAYOUT_PACKED,
                 "a session's AUTO on workers of host memory is packed");

    stria_call_t bad = se_call_of(4, 32, true);
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG,
                   (const char *const[]){"max_batch", "batch 4", "at most 3", NULL},
                   "batch 4 of at most 3", 10);
    bad = se_call_of(1, 289, true); /* 289 > 3 x 96 */
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG,
                   (const char *const[]){"288", "max_seq_len", "96", NULL},
                   "1 x 289 tokens of at most 288", 20);
    bad = se_call_of(3, 97, true);
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG,
                   (const char *const[]){"288", "max_seq_len", "96", NULL},
                   "3 x 97 tokens of at most 288", 30);
    bad = se_call_of(0, 32, true);
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG, (const char *const[]){"batch", NULL},
                   "batch 0", 40);
    bad = se_call_of(1, 0, true);
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG, (const char *const[]){"seq_len", NULL},
                   "seq_len 0", 50);

    /* within the bounds: batch x seq_len at most 3 x 96, in any split */
    stria_call_t ok = se_call_of(1, 288, true);
    se_check_call(s, &sp, &ok, true, 60, "1 x 288 tokens");
    ok = se_call_of(3, 96, false);
    se_check_call(s, &sp, &ok, true, 70, "3 x 96 tokens");

    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(st.generation, 1u, "a refused call reopened the session (generation %u)",
                 st.generation);
    cr_expect_eq(st.retries, 0u, "a refused call was retried %llu times",
                 (unsigned long long)st.retries);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, bad_input_gets_a_clear_error_and_the_session_serves_on, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);

    /* a session without bounds, or sharded without a ring size, never opens */
    stria_session_spec_t sp = se_spec_of(0, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    stria_session_t *s = NULL;
    cr_expect_eq(stria_session_open(cl, &sp, &s), STRIA_ERR_INVALID_ARG, "max_batch 0: %s",
                 stria_error_msg());
    cr_expect_null(s);
    sp = se_spec_of(2, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 0);
    sp.sharded = true;
    cr_expect_eq(stria_session_open(cl, &sp, &s), STRIA_ERR_INVALID_ARG, "sharded, ring_size 0: %s",
                 stria_error_msg());
    cr_expect_null(s);
    sp = se_spec_of(2, 96, 3, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    cr_expect_eq(stria_session_open(cl, &sp, &s), STRIA_ERR_INVALID_ARG,
                 "3 heads over 2 kv_heads: %s", stria_error_msg());
    cr_expect_null(s);

    sp = se_spec_of(2, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    s = se_open_session(cl, &sp);
    static const int64_t short_docs[] = {0, 10, 30};
    static const int64_t late_docs[] = {5, 20, 40};
    static const int64_t back_docs[] = {0, 30, 20, 40};
    stria_call_t bad = se_call_of(1, 40, true);
    bad.cu_seqlens = short_docs;
    bad.n_cu_seqlens = 3;
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG, (const char *const[]){"cu_seqlens", NULL},
                   "cu_seqlens ending at 30 of 40", 100);
    bad.cu_seqlens = late_docs;
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG, (const char *const[]){"cu_seqlens", NULL},
                   "cu_seqlens starting at 5", 110);
    bad.cu_seqlens = back_docs;
    bad.n_cu_seqlens = 4;
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG, (const char *const[]){"cu_seqlens", NULL},
                   "cu_seqlens decreasing", 120);
    bad = se_call_of(1, 40, true);
    bad.has_window = true;
    bad.window_left = 8;
    bad.window_right = 5;
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG, (const char *const[]){"window", NULL},
                   "a causal window reaching 5 tokens ahead", 130);
    bad = se_call_of(1, 40, false);
    bad.window_left = 8;
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG, (const char *const[]){"window", NULL},
                   "window_left without has_window", 140);
    bad = se_call_of(1, 40, true);
    bad.struct_size = 0;
    expect_refused(s, &sp, &bad, STRIA_ERR_INVALID_ARG, (const char *const[]){"struct_size", NULL},
                   "struct_size 0", 150);

    /* missing tensors */
    fu_job_t j;
    stria_call_t good = se_call_of(1, 40, true);
    se_call_tensors(&j, &sp, &good, 160);
    cr_expect_eq(stria_session_forward(s, &good, NULL, j.k, j.v, j.o, j.lse), STRIA_ERR_INVALID_ARG,
                 "q NULL: %s", stria_error_msg());
    cr_expect_eq(stria_session_forward(s, &good, j.q, j.k, j.v, j.o, NULL), STRIA_ERR_INVALID_ARG,
                 "lse NULL: %s", stria_error_msg());
    cr_expect_eq(
        stria_session_backward(s, &good, j.q, j.k, j.v, j.o, j.lse, NULL, j.dq, j.dk, j.dv),
        STRIA_ERR_INVALID_ARG, "d_o NULL: %s", stria_error_msg());
    cr_expect_eq(stria_session_forward(s, NULL, j.q, j.k, j.v, j.o, j.lse), STRIA_ERR_INVALID_ARG,
                 "call NULL: %s", stria_error_msg());
    /* a shard call on a whole-sequence session */
    cr_expect_neq(stria_session_forward_shard(s, &good, 0, j.q, j.k, j.v, j.o, j.lse), STRIA_OK,
                  "forward_shard on a whole-sequence session succeeded");
    fu_job_free(&j);
    se_check_call(s, &sp, &good, true, 170, "the good call after missing tensors");

    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(st.generation, 1u, "bad input reopened the session (generation %u)",
                 st.generation);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

/* ---- the workers' resources over many calls ----------------------------------------- */

static int count_dir(pid_t pid, const char *what)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, what);
    DIR *d = opendir(path);
    cr_assert_not_null(d, "%s", path);
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static int count_lines(pid_t pid, const char *what)
{
    char path[64], line[4096];
    snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, what);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    int n = 0;
    while (fgets(line, sizeof(line), f) != NULL)
        n += strchr(line, '\n') != NULL;
    fclose(f);
    return n;
}

/* A number of /proc/PID/status ("Threads: %d", "RssAnon: %d"). */
static int status_field(pid_t pid, const char *format)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    int n = -1;
    while (fgets(line, sizeof(line), f) != NULL)
        if (sscanf(line, format, &n) == 1)
            break;
    fclose(f);
    return n;
}

static int status_threads(pid_t pid)
{
    return status_field(pid, "Threads: %d");
}

/* Under AddressSanitizer freed memory sits in its quarantine (and is not
 * reused): resident memory grows there by design, so only the Release
 * build holds it. */
#if defined(__SANITIZE_ADDRESS__)
#define RSS_CHECKED 0
#else
#define RSS_CHECKED 1
#endif
#define N_ITER    700 /* 1050 calls: a forward each, a backward every other */
#define N_EVERY   70
#define N_SAMPLES 10 /* of every run below */

/* The workers' and this process's resources, sampled N_SAMPLES times:
 * [worker 0, worker 1, this process][fds, threads, maps, RssAnon KiB]. */
typedef struct {
    pid_t pids[3];
    int v[3][4][N_SAMPLES];
    int n;
} usage_t;

/* Each figure the least of five reads 20 ms apart: what a session leaves
 * for a moment after it closes (its thread exiting, a connection's thread
 * answering) is not what stays. */
static void usage_sample(usage_t *u)
{
    cr_assert_lt(u->n, N_SAMPLES);
    for (int r = 0; r < 5; r++) {
        if (r > 0)
            usleep(20000);
        for (int w = 0; w < 3; w++) {
            const int now[4] = {count_dir(u->pids[w], "fd"), status_threads(u->pids[w]),
                                count_lines(u->pids[w], "maps"),
                                status_field(u->pids[w], "RssAnon: %d")};
            for (int m = 0; m < 4; m++)
                if (r == 0 || now[m] < u->v[w][m][u->n])
                    u->v[w][m][u->n] = now[m];
        }
    }
    u->n++;
}

/* Neither the last sample past the first (by more than slack[m]) nor the
 * second half's highest past the first half's (by more than trend[m]),
 * unless the samples rose in at most two steps: what appears once, when the
 * load first calls for it (a thread kept idle, its stack and malloc arena),
 * is a step, where a leak rises sample after sample. */
static void usage_judge(const usage_t *u, const char *over, const int slack[4], const int trend[4])
{
    static const char *const names[4] = {"descriptors", "threads", "mappings", "RssAnon (KiB)"};
    for (int w = 0; w < 3; w++)
        for (int m = 0; m < (w < 2 && RSS_CHECKED ? 4 : 3); m++) { /* the client's: the test's */
            char seq[256] = "";
            int first_max = 0, second_max = 0, rises = 0;
            for (int k = 0; k < u->n; k++) {
                size_t n = strlen(seq);
                snprintf(seq + n, sizeof(seq) - n, "%s%d", k ? " " : "", u->v[w][m][k]);
                rises += k > 0 && u->v[w][m][k] > u->v[w][m][k - 1];
                if (k < u->n / 2)
                    first_max = u->v[w][m][k] > first_max ? u->v[w][m][k] : first_max;
                else
                    second_max = u->v[w][m][k] > second_max ? u->v[w][m][k] : second_max;
            }
            const char *who = w < 2 ? (w ? "worker 1" : "worker 0") : "the client";
            cr_expect_leq(u->v[w][m][u->n - 1], u->v[w][m][0] + slack[m],
                          "%s's %s grew over the %s: %s", who, names[m], over, seq);
            cr_expect(second_max <= first_max + trend[m] || rises <= 2,
                      "%s's %s grow over the %s (%d rises): %s", who, names[m], over, rises, seq);
        }
}

static void many_calls(bool arena)
{
    dcluster_t c;
    stria_client_t *cl = start(&c, 2, arena);
    stria_session_spec_t sp = se_spec_of(1, 64, 2, 1, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    stria_session_t *s = se_open_session(cl, &sp);
    usage_t u = {.pids = {test_proc_pid(c.workers[0]), test_proc_pid(c.workers[1]), getpid()}};
    fu_job_t j;
    stria_call_t call = se_call_of(1, 48, true);
    se_call_tensors(&j, &sp, &call, 300);
    int calls = 0, fault_calls = 0;
    uint64_t faults = 0;
    for (int i = 1; i <= N_ITER; i++) {
        stria_status_t st = stria_session_forward(s, &call, j.q, j.k, j.v, j.o, j.lse);
        cr_assert_eq(st, STRIA_OK, "call %d: %s", i, stria_error_msg());
        calls++;
        if (i % 2 == 0) {
            st = stria_session_backward(s, &call, j.q, j.k, j.v, j.o, j.lse, j.g, j.dq, j.dk, j.dv);
            cr_assert_eq(st, STRIA_OK, "call %d (backward): %s", i, stria_error_msg());
            calls++;
        }
        /* (from call 10 on: the in-process ring's threads get this
         * process's malloc arenas before the first sample) */
        if (i % 40 == 0 || i == 10) {
            char why[256];
            cr_expect(se_ref_equal(&j, &call, 2, STRIA_LAYOUT_STRIPED, true, why, sizeof(why)),
                      "call %d: %s", i, why);
        }
        stria_session_stats_t cs = STRIA_SESSION_STATS_INIT;
        if (i > 20 && stria_session_stats(s, &cs) == STRIA_OK) {
            faults += cs.last_minflt; /* the last call's (the backward on even i) */
            fault_calls++;
        }
        if (i % N_EVERY == 0)
            usage_sample(&u);
    }
    static const int slack[4] = {1, 1, 2, 2048}, trend[4] = {0, 0, 1, 1024};
    usage_judge(&u, "calls", slack, trend);
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(st.calls, (uint64_t)calls, "%llu calls counted of %d",
                 (unsigned long long)st.calls, calls);
    cr_expect_eq(st.generation, 1u);
    cr_log_info("%d calls%s: last call %.3f ms (pass %.3f ms); the workers' minor faults in "
                "the last call of each of iterations 21..%d: %.2f on average, %llu in all",
                calls, arena ? " through the arena" : "", st.last_call_s * 1e3,
                st.last_pass_s * 1e3, N_ITER, (double)faults / fault_calls,
                (unsigned long long)faults);
    fu_job_free(&j);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

/* 1,000 jobs in a row on a ring of two (each a session opened, a forward,
 * its backward, closed): the workers' descriptors, threads, mappings,
 * anonymous memory and ring endpoints do not grow with them. */
#define N_JOBS 1000
Test(session, a_thousand_jobs_leave_the_workers_resources_alone, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    stria_client_t *cl = start(&c, 2, true);
    usage_t u = {.pids = {test_proc_pid(c.workers[0]), test_proc_pid(c.workers[1]), getpid()}};
    fu_job_t j;
    cr_assert(fu_job_init(&j, 1, 64, 2, 1, 16, STRIA_DTYPE_F32, true, 41));
    j.spec.ring_size = 2;
    j.spec.layout = STRIA_LAYOUT_STRIPED;
    double t0 = stria_time_now();
    for (int i = 1; i <= N_JOBS; i++) {
        stria_job_t *job = NULL;
        stria_status_t st =
            stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job);
        cr_assert_eq(st, STRIA_OK, "job %d: %s", i, stria_error_msg());
        st = stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, NULL);
        cr_assert_eq(st, STRIA_OK, "job %d (backward): %s", i, stria_error_msg());
        cr_assert_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
        if (i == 10 || i % 200 == 0) {
            char why[256];
            cr_expect(fu_ring_equal(&j, 2, STRIA_LAYOUT_STRIPED, true, why, sizeof(why)),
                      "job %d: %s", i, why);
        }
        if (i % (N_JOBS / N_SAMPLES) == 0)
            usage_sample(&u);
    }
    /* what appears once, whenever the load first calls for it, is no
     * growth: a thread the worker keeps idle for the next session (a job's
     * pass thread still ending as the next one opens), the stacks glibc
     * keeps (2 mappings each, 40 MiB of them at most), a thread's malloc
     * arena (2), one more arena mapping the worker keeps (8 at most), each
     * a step; a leak of one mapping every 100 jobs fails the second check
     * (5 over 500 jobs, rising at every sample), one every 70 the first, a
     * thread every 200 jobs the first */
    static const int slack[4] = {1, 3, 12, 2048}, trend[4] = {0, 1, 4, 1024};
    usage_judge(&u, "jobs", slack, trend);
    /* the ring's endpoints were made once (one each way between the two
     * workers), not per job */
    for (int w = 0; w < 2; w++) {
        char *body = NULL;
        cr_assert_eq(dc_http_get(c.worker_metrics[w], "/metrics", &body), 200);
        const char *made = strstr(body, "stria_worker_ring_endpoint_events_total{event=\"made\"} ");
        const char *open = strstr(body, "\nstria_worker_ring_endpoints ");
        cr_assert(made != NULL && open != NULL, "worker %d's /metrics lacks the endpoints", w);
        double n_made = atof(strchr(made, '}') + 2), n_open = atof(open + 29);
        cr_expect_leq(n_made, 2.0, "worker %d made %.0f ring endpoints for %d jobs", w, n_made,
                      N_JOBS);
        cr_expect_leq(n_open, 2.0, "worker %d holds %.0f ring endpoints", w, n_open);
        free(body);
    }
    cr_log_info("%d jobs in %.1f s", N_JOBS, stria_time_now() - t0);
    fu_job_free(&j);
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, many_calls_leave_the_workers_resources_alone, .timeout = T_TIMEOUT)
{
    many_calls(false);
}

Test(session, many_calls_through_the_arena_leave_the_workers_resources_alone, .timeout = T_TIMEOUT)
{
    many_calls(true);
}

/* ---- sessions side by side, threads on one session ------------------------------------ */

Test(session, two_sessions_on_the_same_workers_never_mix, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t spa =
        se_spec_of(1, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    stria_session_spec_t spb =
        se_spec_of(2, 64, 4, 2, 32, STRIA_DTYPE_BF16, STRIA_LAYOUT_ZIGZAG, 2);
    stria_session_t *a = se_open_session(cl, &spa);
    stria_session_t *b = se_open_session(cl, &spb);
    cr_expect_neq(stria_session_id(a), stria_session_id(b));
    for (int i = 0; i < 4; i++) {
        stria_call_t ca = se_call_of(1, 96 - 8 * i, true),
                     cb = se_call_of(2, 64 - 5 * i, i % 2 == 0);
        se_check_call(a, &spa, &ca, true, 400 + (uint64_t)i, "session A");
        se_check_call(b, &spb, &cb, true, 500 + (uint64_t)i, "session B");
    }
    /* forward of A, forward of B, then both backwards: nothing is held
     * between calls, so the interleaving changes nothing */
    fu_job_t ja, jb;
    stria_call_t ca = se_call_of(1, 80, true), cb = se_call_of(2, 50, true);
    se_call_tensors(&ja, &spa, &ca, 600);
    se_call_tensors(&jb, &spb, &cb, 700);
    cr_assert_eq(stria_session_forward(a, &ca, ja.q, ja.k, ja.v, ja.o, ja.lse), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_session_forward(b, &cb, jb.q, jb.k, jb.v, jb.o, jb.lse), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(
        stria_session_backward(a, &ca, ja.q, ja.k, ja.v, ja.o, ja.lse, ja.g, ja.dq, ja.dk, ja.dv),
        STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(
        stria_session_backward(b, &cb, jb.q, jb.k, jb.v, jb.o, jb.lse, jb.g, jb.dq, jb.dk, jb.dv),
        STRIA_OK, "%s", stria_error_msg());
    char why[256];
    cr_expect(se_ref_equal(&ja, &ca, 2, STRIA_LAYOUT_STRIPED, true, why, sizeof(why)),
              "A, interleaved: %s", why);
    cr_expect(se_ref_equal(&jb, &cb, 2, STRIA_LAYOUT_ZIGZAG, true, why, sizeof(why)),
              "B, interleaved: %s", why);
    fu_job_free(&ja);
    fu_job_free(&jb);
    cr_expect_eq(stria_session_close(a), STRIA_OK, "%s", stria_error_msg());
    /* B outlives A */
    stria_call_t cb2 = se_call_of(1, 128, true);
    se_check_call(b, &spb, &cb2, true, 800, "session B after A closed");
    cr_expect_eq(stria_session_close(b), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

typedef struct {
    stria_session_t *s;
    fu_job_t j;
    stria_call_t call;
    int calls;
    stria_status_t st;
    char msg[512];
    int failed_call;
} caller_t;

static void *caller_main(void *arg)
{
    caller_t *t = arg;
    t->st = STRIA_OK;
    for (int i = 0; i < t->calls && t->st == STRIA_OK; i++) {
        t->st = stria_session_forward(t->s, &t->call, t->j.q, t->j.k, t->j.v, t->j.o, t->j.lse);
        if (t->st == STRIA_OK)
            t->st = stria_session_backward(t->s, &t->call, t->j.q, t->j.k, t->j.v, t->j.o, t->j.lse,
                                           t->j.g, t->j.dq, t->j.dk, t->j.dv);
        if (t->st != STRIA_OK) {
            snprintf(t->msg, sizeof(t->msg), "%s", stria_error_msg());
            t->failed_call = i;
        }
    }
    return NULL;
}

Test(session, threads_calling_one_session_are_served_one_at_a_time, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t sp =
        se_spec_of(2, 96, 4, 2, 16, STRIA_DTYPE_BF16, STRIA_LAYOUT_STRIPED, 2);
    stria_session_t *s = se_open_session(cl, &sp);
    caller_t t[3];
    pthread_t th[3];
    for (int i = 0; i < 3; i++) {
        memset(&t[i], 0, sizeof(t[i]));
        t[i].s = s;
        t[i].calls = 12;
        t[i].call = se_call_of(i == 1 ? 2 : 1, 96 - 16 * i, i != 2);
        se_call_tensors(&t[i].j, &sp, &t[i].call, 900 + 10 * (uint64_t)i);
    }
    for (int i = 0; i < 3; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, caller_main, &t[i]), 0);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++) {
        cr_expect_eq(t[i].st, STRIA_OK, "thread %d, call %d: %s: %s", i, t[i].failed_call,
                     stria_status_name(t[i].st), t[i].msg);
        char why[256];
        if (t[i].st == STRIA_OK)
            cr_expect(
                se_ref_equal(&t[i].j, &t[i].call, 2, STRIA_LAYOUT_STRIPED, true, why, sizeof(why)),
                "thread %d: %s", i, why);
        fu_job_free(&t[i].j);
    }
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(st.calls, 72u, "3 threads x 12 forward and backward calls: %llu",
                 (unsigned long long)st.calls);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, two_sessions_called_at_once_from_two_clients_never_mix, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    stria_client_t *cl[2] = {dc_client(&c, NULL, "test_session A", 0),
                             dc_client(&c, NULL, "test_session B", 0)};
    stria_session_spec_t sp[2] = {
        se_spec_of(1, 128, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2),
        se_spec_of(2, 64, 4, 2, 32, STRIA_DTYPE_BF16, STRIA_LAYOUT_ZIGZAG, 2)};
    caller_t t[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        memset(&t[i], 0, sizeof(t[i]));
        t[i].s = se_open_session(cl[i], &sp[i]);
        t[i].calls = 15;
        t[i].call = i == 0 ? se_call_of(1, 128, true) : se_call_of(2, 60, false);
        se_call_tensors(&t[i].j, &sp[i], &t[i].call, 950 + 10 * (uint64_t)i);
    }
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, caller_main, &t[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(t[i].st, STRIA_OK, "session %c, call %d: %s: %s", 'A' + i, t[i].failed_call,
                     stria_status_name(t[i].st), t[i].msg);
        char why[256];
        if (t[i].st == STRIA_OK)
            cr_expect(se_ref_equal(&t[i].j, &t[i].call, 2, sp[i].layout, true, why, sizeof(why)),
                      "session %c: %s", 'A' + i, why);
        fu_job_free(&t[i].j);
        cr_expect_eq(stria_session_close(t[i].s), STRIA_OK, "%s", stria_error_msg());
        stria_client_close(cl[i]);
    }
    dc_stop(&c);
}

/* ---- sharded sessions ---------------------------------------------------------------- */

static void sharded_case(int n, stria_layout_kind_t layout, stria_dtype_t dtype)
{
    dcluster_t c;
    dc_start(&c, n, NULL);
    stria_client_t *cl[8];
    stria_session_t *h[8];
    for (int i = 0; i < n; i++)
        cl[i] = dc_client(&c, NULL, "test_session rank", 0);
    stria_session_spec_t sp = se_spec_of(2, 128, 4, 2, 16, dtype, layout, n);
    sp.sharded = true;
    sp.arrival_timeout_s = 15;
    size_t len = 0;
    se_open_sharded(cl, n, &sp, h, &len);
    cr_expect_eq(len, (size_t)STRIA_SESSION_EXPORT_BYTES);
    for (int i = 1; i < n; i++) {
        cr_expect_eq(stria_session_ring_size(h[i]), n);
        cr_expect_eq(stria_session_layout(h[i]), layout);
        cr_expect_eq(stria_session_id(h[i]), stria_session_id(h[0]));
    }
    static const int64_t docs[] = {0, 40, 41, 100};
    static const int64_t many[] = {0, 5, 9, 30, 31, 44, 60, 61, 90, 100};
    stria_call_t calls[5] = {se_call_of(1, 128, true), se_call_of(2, 100, true),
                             se_call_of(1, 77, false), se_call_of(2, 100, true),
                             se_call_of(2, 100, true)};
    calls[3].cu_seqlens = docs;
    calls[3].n_cu_seqlens = 4;
    calls[4].cu_seqlens = many;
    calls[4].n_cu_seqlens = 10;
    se_rank_t r[8];
    for (int k = 0; k < 5; k++) {
        stria_call_t per[8];
        for (int i = 0; i < n; i++)
            per[i] = calls[k];
        fu_job_t j;
        se_call_tensors(&j, &sp, &calls[k], 1000 + (uint64_t)k);
        se_sharded_call(h, n, &j, per, true, r);
        bool all = true;
        for (int i = 0; i < n; i++) {
            cr_expect_eq(r[i].st, STRIA_OK, "call %d, rank %d: %s: %s", k, i,
                         stria_status_name(r[i].st), r[i].msg);
            all &= r[i].st == STRIA_OK;
        }
        char why[256];
        if (all)
            cr_expect(se_ref_equal(&j, &calls[k], n, layout, true, why, sizeof(why)), "call %d: %s",
                      k, why);
        fu_job_free(&j);
    }

    /* the last rank disagrees on causality, then on the length, then on the
     * documents: every rank fails, the message naming a rank; then all agree
     * again */
    static const int64_t mine[] = {0, 10, 50, 96}, theirs[] = {0, 10, 51, 96};
    static const char *const what[] = {"causal flag", "seq_len", "documents"};
    for (int k = 0; k < 3; k++) {
        stria_call_t per[8];
        for (int i = 0; i < n; i++) {
            per[i] = se_call_of(1, 96, true);
            if (k == 2) {
                per[i].cu_seqlens = i == n - 1 ? theirs : mine;
                per[i].n_cu_seqlens = 4;
            }
        }
        if (k == 0)
            per[n - 1].causal = false;
        else if (k == 1)
            per[n - 1].seq_len = 88;
        fu_job_t j;
        se_call_tensors(&j, &sp, &per[0], 1100 + (uint64_t)k);
        double t0 = stria_time_now();
        se_sharded_call(h, n, &j, per, false, r);
        double took = stria_time_now() - t0;
        /* a rank that compared the differing calls fails as for bad input,
         * not retryable, naming both ranks; the others fail with the abort
         * (or a neighbour's link closing first: then retryable) */
        int found = 0;
        for (int i = 0; i < n; i++) {
            cr_expect_neq(r[i].st, STRIA_OK, "rank %d's call succeeded though rank %d's %s differs",
                          i, n - 1, what[k]);
            cr_expect(strstr(r[i].msg, "rank") != NULL,
                      "rank %d: the failure does not name a rank: %s", i, r[i].msg);
            if (r[i].st == STRIA_ERR_INVALID_ARG && strstr(r[i].msg, "differs") != NULL) {
                found++;
                cr_expect(!r[i].retryable, "rank %d: a disagreement is not retryable, yet: %s", i,
                          r[i].msg);
            }
            cr_log_info("disagreement on %s, rank %d: %s: %s", what[k], i,
                        stria_status_name(r[i].st), r[i].msg);
        }
        cr_expect_geq(found, 1, "no rank named the disagreement");
        char ranks[2048] = "";
        size_t at = 0;
        for (int i = 0; i < n && at < sizeof(ranks) - 1; i++) /* what each rank saw */
            at += (size_t)snprintf(ranks + at, sizeof(ranks) - at, "; rank %d: %s%s: %.200s", i,
                                   stria_status_name(r[i].st), r[i].retryable ? " (retryable)" : "",
                                   r[i].msg);
        cr_expect_lt(took, 10.0, "the disagreeing call (%s) took %.1f s to fail%s", what[k], took,
                     ranks);
        fu_job_free(&j);
    }
    stria_call_t per[8];
    for (int i = 0; i < n; i++)
        per[i] = se_call_of(2, 64, true);
    fu_job_t j;
    se_call_tensors(&j, &sp, &per[0], 1200);
    se_sharded_call(h, n, &j, per, true, r);
    bool all = true;
    for (int i = 0; i < n; i++) {
        cr_expect_eq(r[i].st, STRIA_OK, "after the disagreements, rank %d: %s: %s", i,
                     stria_status_name(r[i].st), r[i].msg);
        all &= r[i].st == STRIA_OK;
    }
    char why[256];
    if (all)
        cr_expect(se_ref_equal(&j, &per[0], n, layout, true, why, sizeof(why)),
                  "after the disagreements: %s", why);
    fu_job_free(&j);

    for (int i = n - 1; i >= 0; i--) {
        cr_expect_eq(stria_session_close(h[i]), STRIA_OK, "close on rank %d: %s", i,
                     stria_error_msg());
        stria_client_close(cl[i]);
    }
    dc_stop(&c);
}

Test(session, sharded_two_ranks_zigzag_bf16_equal_the_in_process_ring, .timeout = T_TIMEOUT)
{
    sharded_case(2, STRIA_LAYOUT_ZIGZAG, STRIA_DTYPE_BF16);
}

Test(session, sharded_four_ranks_striped_fp32_equal_the_in_process_ring, .timeout = T_TIMEOUT)
{
    sharded_case(4, STRIA_LAYOUT_STRIPED, STRIA_DTYPE_F32);
}

Test(session, sharded_three_ranks_packed_bf16_equal_the_in_process_ring, .timeout = T_TIMEOUT)
{
    sharded_case(3, STRIA_LAYOUT_PACKED, STRIA_DTYPE_BF16);
}

/* ---- head groups ------------------------------------------------------------------ */

/* The calls the head-group cases make (bounds 2 x 160): causal, with
 * documents, a two-sided window, a causal window. */
static void group_calls(stria_call_t calls[4], const char *what[4])
{
    static const int64_t docs[] = {0, 3, 17, 60, 61, 96};
    calls[0] = se_call_of(2, 160, true);
    calls[1] = se_call_of(1, 96, true);
    calls[2] = se_call_of(1, 101, false);
    calls[3] = se_call_of(2, 128, true);
    calls[1].cu_seqlens = docs;
    calls[1].n_cu_seqlens = 6;
    calls[2].has_window = true;
    calls[2].window_left = 9;
    calls[2].window_right = 4;
    calls[3].has_window = true;
    calls[3].window_left = 30;
    what[0] = "causal", what[1] = "documents", what[2] = "two-sided window";
    what[3] = "causal window";
}

/* A session of G head groups over `workers` workers: every call's every
 * output, head group by head group, equals that group's heads on an
 * in-process ring of workers / G ranks, bit for bit. */
static void head_groups_case(int workers, int G, stria_layout_kind_t layout, stria_dtype_t dtype,
                             int64_t H, int64_t Hkv)
{
    dcluster_t c;
    stria_client_t *cl = start(&c, workers, false);
    stria_session_spec_t sp = se_spec_of(2, 160, H, Hkv, 32, dtype, layout, workers);
    sp.head_groups = (uint32_t)G;
    stria_session_t *s = se_open_session(cl, &sp);
    cr_expect_eq(stria_session_ring_size(s), workers);
    const int R = workers / G;
    stria_call_t calls[4];
    const char *what[4];
    group_calls(calls, what);
    for (int k = 0; k < 4; k++)
        se_check_groups_call(s, &sp, &calls[k], 300 + (uint64_t)k, G, R, what[k]);
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(st.calls, 8u, "4 forward and backward calls: %llu", (unsigned long long)st.calls);
    cr_expect_eq(st.failed, 0u);
    uint64_t held = 0; /* no max_held: refused as for a session without head groups */
    fu_job_t hj;
    se_call_tensors(&hj, &sp, &calls[0], 399);
    cr_expect_eq(
        stria_session_forward_held(s, &calls[0], -1, hj.q, hj.k, hj.v, hj.o, hj.lse, &held),
        STRIA_ERR_INVALID_ARG, "a held forward on a session without max_held");
    cr_expect(strstr(stria_error_msg(), "max_held is 0") != NULL, "%s", stria_error_msg());
    fu_job_free(&hj);
    cr_expect_leq(st.last_steps, (uint32_t)R, "a ring of %d ran %u steps", R, st.last_steps);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, head_groups_2x2_striped_fp32_gqa_equal_each_group_s_ring, .timeout = T_TIMEOUT)
{
    head_groups_case(4, 2, STRIA_LAYOUT_STRIPED, STRIA_DTYPE_F32, 4, 2);
}

Test(session, head_groups_2x2_packed_bf16_equal_each_group_s_ring, .timeout = T_TIMEOUT)
{
    head_groups_case(4, 2, STRIA_LAYOUT_PACKED, STRIA_DTYPE_BF16, 4, 4);
}

Test(session, head_groups_4x1_zigzag_fp16_equal_each_group_s_ring, .timeout = T_TIMEOUT)
{
    head_groups_case(4, 4, STRIA_LAYOUT_ZIGZAG, STRIA_DTYPE_F16, 8, 4);
}

/* A sharded session of G head groups over `workers` workers, called by
 * R = workers / G trainer ranks (rank 0 opens and exports it, the others
 * import it), each passing its own tokens with all their heads: every
 * output, head group by head group, equals that group's heads on an
 * in-process ring of R ranks, bit for bit. With `per_worker`, `workers`
 * trainer ranks call it (trainer_ranks): rank h G + l holds stripe l R + h
 * and its call is part l of ring rank h's shard on every ring. */
static void sharded_groups_case_of(int workers, int G, stria_layout_kind_t layout,
                                   stria_dtype_t dtype, int64_t H, int64_t Hkv, bool per_worker)
{
    dcluster_t c;
    dc_start(&c, workers, NULL);
    const int R = per_worker ? workers : workers / G;
    stria_client_t *cl[8];
    stria_session_t *h[8];
    for (int i = 0; i < R; i++)
        cl[i] = dc_client(&c, NULL, "test_session rank", 0);
    stria_session_spec_t sp = se_spec_of(2, 160, H, Hkv, 32, dtype, layout, workers);
    sp.sharded = true;
    sp.head_groups = (uint32_t)G;
    sp.arrival_timeout_s = 15;
    sp.trainer_ranks = per_worker ? workers : 0;
    sp.max_held = 1;
    size_t len = 0;
    se_open_sharded(cl, R, &sp, h, &len);
    cr_expect_eq(len, 16u + 40u * (size_t)G);
    uint8_t small[STRIA_SESSION_EXPORT_BYTES];
    cr_expect_eq(stria_session_export(h[0], small, sizeof(small), &len), STRIA_ERR_INVALID_ARG,
                 "a head-grouped export fit %zu bytes", sizeof(small));
    cr_expect(strstr(stria_error_msg(), "needed") != NULL, "%s", stria_error_msg());
    for (int i = 0; i < R; i++) {
        stria_session_spec_t got = STRIA_SESSION_SPEC_INIT;
        cr_assert_eq(stria_session_spec_get(h[i], &got), STRIA_OK, "%s", stria_error_msg());
        cr_expect_eq(got.head_groups, (uint32_t)G, "rank %d: head groups %u", i, got.head_groups);
        cr_expect_eq(got.heads, H, "rank %d: heads %lld", i, (long long)got.heads);
        cr_expect_eq(stria_session_ring_size(h[i]), workers);
        cr_expect_eq(stria_session_ranks(h[i]), R);
        cr_expect_eq(got.trainer_ranks, per_worker ? workers : 0, "rank %d: trainer_ranks %d", i,
                     got.trainer_ranks);
        cr_expect_eq(stria_session_layout(h[i]), layout);
        cr_expect_eq(stria_session_id(h[i]), stria_session_id(h[0]));
    }
    stria_shard_buffer_t buf = STRIA_SHARD_BUFFER_INIT;
    stria_call_t one = se_call_of(1, 64, true);
    cr_expect_eq(stria_session_buffer(h[0], &one, 0, STRIA_TENSOR_Q, &buf), STRIA_ERR_UNSUPPORTED,
                 "a head-grouped session lent a buffer");
    stria_call_t calls[4];
    const char *what[4];
    group_calls(calls, what);
    se_rank_t r[8];
    for (int k = 0; k < 4; k++) {
        stria_call_t per[8];
        for (int i = 0; i < R; i++)
            per[i] = calls[k];
        fu_job_t j;
        se_call_tensors(&j, &sp, &calls[k], 500 + (uint64_t)k);
        se_sharded_call(h, R, &j, per, true, r);
        bool all = true;
        for (int i = 0; i < R; i++) {
            cr_expect_eq(r[i].st, STRIA_OK, "%s, rank %d: %s: %s", what[k], i,
                         stria_status_name(r[i].st), r[i].msg);
            all &= r[i].st == STRIA_OK;
        }
        if (all)
            se_groups_equal(&j, &calls[k], G, workers / G, layout, what[k]);
        fu_job_free(&j);
    }
    /* a forward held for its backward, on every ring (the parts of the
     * held forward's backward bring dO alone) */
    {
        stria_call_t per[8];
        for (int i = 0; i < R; i++)
            per[i] = calls[0];
        fu_job_t j;
        se_call_tensors(&j, &sp, &calls[0], 590);
        se_sharded_call_held(h, R, &j, per, r);
        bool all = true;
        for (int i = 0; i < R; i++) {
            cr_expect_eq(r[i].st, STRIA_OK, "held, rank %d: %s: %s", i, stria_status_name(r[i].st),
                         r[i].msg);
            all &= r[i].st == STRIA_OK;
        }
        if (all)
            se_groups_equal(&j, &calls[0], G, workers / G, layout, "held");
        fu_job_free(&j);
    }
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(h[0], &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(st.calls, 10u, "5 forward and backward calls: %llu", (unsigned long long)st.calls);
    cr_expect_leq(st.last_steps, (uint32_t)(workers / G), "a ring of %d ran %u steps", workers / G,
                  st.last_steps);
    for (int i = R - 1; i >= 0; i--) {
        cr_expect_eq(stria_session_close(h[i]), STRIA_OK, "close on rank %d: %s", i,
                     stria_error_msg());
        stria_client_close(cl[i]);
    }
    dc_stop(&c);
}

static void sharded_groups_case(int workers, int G, stria_layout_kind_t layout, stria_dtype_t dtype,
                                int64_t H, int64_t Hkv)
{
    sharded_groups_case_of(workers, G, layout, dtype, H, Hkv, false);
}

Test(session, one_trainer_rank_per_worker_2x2_fp32_gqa_equals_each_group_s_ring,
     .timeout = T_TIMEOUT)
{
    sharded_groups_case_of(4, 2, STRIA_LAYOUT_STRIPED, STRIA_DTYPE_F32, 4, 2, true);
}

Test(session, one_trainer_rank_per_worker_3x2_bf16_equals_each_group_s_ring, .timeout = T_TIMEOUT)
{
    sharded_groups_case_of(6, 3, STRIA_LAYOUT_STRIPED, STRIA_DTYPE_BF16, 6, 3, true);
}

Test(session, sharded_head_groups_2x2_striped_fp32_gqa_equal_each_group_s_ring,
     .timeout = T_TIMEOUT)
{
    sharded_groups_case(4, 2, STRIA_LAYOUT_STRIPED, STRIA_DTYPE_F32, 4, 2);
}

Test(session, sharded_head_groups_2x3_zigzag_bf16_equal_each_group_s_ring, .timeout = T_TIMEOUT)
{
    sharded_groups_case(6, 2, STRIA_LAYOUT_ZIGZAG, STRIA_DTYPE_BF16, 4, 4);
}

Test(session, sharded_head_groups_2x2_packed_fp16_equal_each_group_s_ring, .timeout = T_TIMEOUT)
{
    sharded_groups_case(4, 2, STRIA_LAYOUT_PACKED, STRIA_DTYPE_F16, 2, 2);
}

/* A tensor-parallel x context-parallel trainer (2 x 2 ranks) on a sharded
 * session of 2 head groups x rings of 2: rank (j, g) holds ring rank j's
 * tokens of head group g and calls ring g (stria_session_head_group) as
 * rank j, every rank with its own import of the session; every output
 * equals each group's in-process ring bit for bit. The ring handle is
 * borrowed: closing it is refused. */
Test(session, tensor_parallel_ranks_call_their_head_group_s_ring, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 4, NULL);
    const int R = 2, G = 2;
    stria_client_t *cl[4];
    stria_session_t *h[4];
    for (int i = 0; i < R * G; i++)
        cl[i] = dc_client(&c, NULL, "test_session rank", 0);
    stria_session_spec_t sp =
        se_spec_of(2, 160, 4, 2, 32, STRIA_DTYPE_BF16, STRIA_LAYOUT_STRIPED, R * G);
    sp.sharded = true;
    sp.head_groups = (uint32_t)G;
    sp.arrival_timeout_s = 15;
    se_open_sharded(cl, R * G, &sp, h, NULL);
    stria_session_t *ring = stria_session_head_group(h[0], 1);
    cr_assert_not_null(ring, "%s", stria_error_msg());
    cr_expect_eq(stria_session_ring_size(ring), R);
    cr_expect_eq(stria_session_close(ring), STRIA_ERR_INVALID_ARG, "a borrowed ring closed");
    cr_expect_null(stria_session_head_group(h[0], 2));
    stria_call_t calls[4];
    const char *what[4];
    group_calls(calls, what);
    se_rank_t r[16];
    for (int k = 0; k < 4; k++) {
        stria_call_t per[8];
        for (int i = 0; i < R; i++)
            per[i] = calls[k];
        fu_job_t j;
        se_call_tensors(&j, &sp, &calls[k], 600 + (uint64_t)k);
        se_sharded_call_tp(h, R, G, &j, per, true, r);
        bool all = true;
        for (int i = 0; i < R * G; i++) {
            cr_expect_eq(r[i].st, STRIA_OK, "%s, ring %d rank %d: %s: %s", what[k], i / R, i % R,
                         stria_status_name(r[i].st), r[i].msg);
            all &= r[i].st == STRIA_OK;
        }
        if (all)
            se_groups_equal(&j, &calls[k], G, R, STRIA_LAYOUT_STRIPED, what[k]);
        fu_job_free(&j);
    }
    for (int i = R * G - 1; i >= 0; i--) {
        cr_expect_eq(stria_session_close(h[i]), STRIA_OK, "close on rank %d: %s", i,
                     stria_error_msg());
        stria_client_close(cl[i]);
    }
    dc_stop(&c);
}

/* Held forwards on a head-grouped session (2 x 2, max_held 2): two
 * forwards held, their backwards run in the other order bringing only dO,
 * and every output equals each group's in-process ring bit for bit; a
 * third held forward is refused (max_held), a released one's backward is
 * refused as not held. */
Test(session, head_groups_hold_forwards_for_their_backward, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    stria_client_t *cl = start(&c, 4, false);
    stria_session_spec_t sp =
        se_spec_of(1, 128, 4, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 4);
    sp.head_groups = 2;
    sp.max_held = 2;
    stria_session_t *s = se_open_session(cl, &sp);
    stria_call_t call = se_call_of(1, 128, true);
    fu_job_t j[3];
    uint64_t held[3] = {0};
    for (int k = 0; k < 3; k++) {
        se_call_tensors(&j[k], &sp, &call, 1700 + (uint64_t)k);
        stria_status_t st = stria_session_forward_held(s, &call, -1, j[k].q, j[k].k, j[k].v, j[k].o,
                                                       j[k].lse, &held[k]);
        cr_expect_eq(st, k < 2 ? STRIA_OK : STRIA_ERR_BUSY, "held forward %d: %s: %s", k,
                     stria_status_name(st), stria_error_msg());
    }
    cr_expect_neq(held[0], held[1]);
    for (int k = 1; k >= 0; k--) {
        cr_assert_eq(
            stria_session_backward_held(s, &call, -1, held[k], j[k].g, j[k].dq, j[k].dk, j[k].dv),
            STRIA_OK, "backward of held forward %d: %s", k, stria_error_msg());
        se_groups_equal(&j[k], &call, 2, 2, STRIA_LAYOUT_STRIPED, k ? "held 1" : "held 0");
    }
    cr_expect_eq(
        stria_session_backward_held(s, &call, -1, held[0], j[0].g, j[0].dq, j[0].dk, j[0].dv),
        STRIA_ERR_NOT_FOUND, "a held forward's second backward ran");
    cr_assert_eq(stria_session_forward_held(s, &call, -1, j[2].q, j[2].k, j[2].v, j[2].o, j[2].lse,
                                            &held[2]),
                 STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(stria_session_release_held(s, -1, held[2]), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(
        stria_session_backward_held(s, &call, -1, held[2], j[2].g, j[2].dq, j[2].dk, j[2].dv),
        STRIA_ERR_NOT_FOUND, "a released forward's backward ran");
    cr_expect(strstr(stria_error_msg(), "not held") != NULL, "%s", stria_error_msg());
    for (int k = 0; k < 3; k++)
        fu_job_free(&j[k]);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

/* A whole-sequence job of 2 head groups x rings of 2 (its forward held on
 * both rings for its backward): its outputs equal each group's in-process
 * ring bit for bit; a sharded job with head groups is refused, naming the
 * sharded session that takes them. */
Test(session, a_job_with_head_groups_equals_each_group_s_ring, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    stria_client_t *cl = start(&c, 4, false);
    stria_session_spec_t sp =
        se_spec_of(1, 128, 4, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 4);
    stria_call_t call = se_call_of(1, 128, true);
    fu_job_t j;
    se_call_tensors(&j, &sp, &call, 1800);
    stria_job_spec_t js = STRIA_JOB_SPEC_INIT;
    js.batch = 1;
    js.seq_len = 128;
    js.heads = 4;
    js.kv_heads = 2;
    js.head_dim = 16;
    js.dtype = STRIA_DTYPE_F32;
    js.causal = true;
    js.layout = STRIA_LAYOUT_STRIPED;
    js.ring_size = 4;
    js.head_groups = 2;
    stria_job_t *job = NULL;
    cr_assert_eq(stria_client_forward(cl, &js, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job),
                 STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(stria_job_ring_size(job), 4);
    cr_assert_eq(stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, NULL), STRIA_OK,
                 "%s", stria_error_msg());
    se_groups_equal(&j, &call, 2, 2, STRIA_LAYOUT_STRIPED, "a head-grouped job");
    cr_expect_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
    job = NULL;
    cr_expect_eq(stria_client_submit(cl, &js, &job), STRIA_ERR_UNSUPPORTED);
    cr_expect(strstr(stria_error_msg(), "sharded session with head groups") != NULL, "%s",
              stria_error_msg());
    fu_job_free(&j);
    stria_client_close(cl);
    dc_stop(&c);
}

/* A spec whose head groups do not divide kv_heads or the ring, or that
 * asks what head groups do not do yet, is refused naming it. */
Test(session, head_groups_that_do_not_fit_are_refused_naming_why, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    stria_client_t *cl = start(&c, 2, false);
    struct {
        uint32_t G;
        int64_t Hkv;
        int ring;
        bool sharded;
        uint32_t max_held;
        int trainers;
        stria_layout_kind_t layout;
        stria_status_t want;
        const char *needle;
    } cases[] = {
        {2, 3, 2, false, 0, 0, STRIA_LAYOUT_STRIPED, STRIA_ERR_INVALID_ARG,
         "must divide kv_heads 3"},
        {2, 2, 3, false, 0, 0, STRIA_LAYOUT_STRIPED, STRIA_ERR_INVALID_ARG,
         "needs ring_size, a multiple of it"},
        {2, 2, 0, false, 0, 0, STRIA_LAYOUT_STRIPED, STRIA_ERR_INVALID_ARG, "needs ring_size"},
        {65, 2, 2, false, 0, 0, STRIA_LAYOUT_STRIPED, STRIA_ERR_INVALID_ARG, "at most 64"},
        /* one trainer rank per worker: striped, sharded, and 0, R or N of them */
        {2, 2, 2, true, 0, 2, STRIA_LAYOUT_ZIGZAG, STRIA_ERR_INVALID_ARG,
         "needs the striped layout"},
        {2, 2, 2, true, 0, 3, STRIA_LAYOUT_STRIPED, STRIA_ERR_INVALID_ARG,
         "trainer_ranks 3 is neither 0, the ranks of a ring (1) nor ring_size (2)"},
        {2, 2, 2, false, 0, 2, STRIA_LAYOUT_STRIPED, STRIA_ERR_INVALID_ARG,
         "trainer_ranks 2 is for a sharded session"},
        {1, 2, 2, true, 0, 1, STRIA_LAYOUT_STRIPED, STRIA_ERR_INVALID_ARG,
         "without head groups a sharded session's trainer ranks are its ring_size (2)"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        stria_session_spec_t sp =
            se_spec_of(1, 64, 6, cases[i].Hkv, 16, STRIA_DTYPE_F32, cases[i].layout, cases[i].ring);
        sp.head_groups = cases[i].G;
        sp.sharded = cases[i].sharded;
        sp.max_held = cases[i].max_held;
        sp.trainer_ranks = cases[i].trainers;
        stria_session_t *s = NULL;
        stria_status_t st = stria_session_open(cl, &sp, &s);
        cr_expect_eq(st, cases[i].want, "case %zu: %s: %s", i, stria_status_name(st),
                     stria_error_msg());
        cr_expect(strstr(stria_error_msg(), cases[i].needle) != NULL, "case %zu: %s", i,
                  stria_error_msg());
        if (st == STRIA_OK)
            stria_session_close(s);
    }
    stria_client_close(cl);
    dc_stop(&c);
}

/* head_groups auto: one group per host of the ring where the hosts hold
 * equal shares (workers on hosts "ha" and "hb", two each: 2 groups whose
 * rings lie each inside one host), one ring otherwise (1 and 2 workers). */
static void auto_case(const char *const *hosts, int n, uint32_t want_groups)
{
    dcluster_t c;
    dc_init(&c);
    dc_start_coordinator(&c, NULL);
    char flags[8][64];
    char *args[8][2];
    for (int i = 0; i < n; i++) {
        snprintf(flags[i], sizeof(flags[i]), "--host=%s", hosts[i]);
        args[i][0] = flags[i];
        args[i][1] = NULL;
        dc_opts_t o = {.worker_args = args[i]};
        dc_start_worker(&c, i, &o);
    }
    dc_wait_healthy(&c, n, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t sp =
        se_spec_of(1, 128, 4, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 0);
    sp.head_groups = STRIA_HEAD_GROUPS_AUTO;
    stria_session_t *s = se_open_session(cl, &sp);
    stria_session_spec_t got = STRIA_SESSION_SPEC_INIT;
    cr_assert_eq(stria_session_spec_get(s, &got), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(got.head_groups, want_groups, "%d workers: head groups %u, want %u", n,
                 got.head_groups, want_groups);
    cr_expect_eq(stria_session_ring_size(s), n);
    stria_call_t call = se_call_of(1, 128, true);
    se_check_groups_call(s, &sp, &call, 1500, (int)want_groups, n / (int)want_groups,
                         "head_groups auto");
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, head_groups_auto_takes_one_group_per_host, .timeout = T_TIMEOUT)
{
    static const char *const two_hosts[] = {"ha", "hb", "ha", "hb"};
    auto_case(two_hosts, 4, 2);
    static const char *const uneven[] = {"ha", "hb", "hb"};
    auto_case(uneven, 3, 1);
}

/* The hosts of head group g's ring in `striactl --json sessions` output
 * (its spec's head_group, then its ranks' hosts in rank order): R of them
 * into hosts[][16]; false when not found. */
static bool group_hosts(const char *json, int g, int R, char hosts[][16])
{
    char key[48];
    snprintf(key, sizeof(key), "\"head_group\":%d,", g);
    const char *at = strstr(json, key);
    at = at != NULL ? strstr(at, "\"ranks\":[") : NULL;
    for (int j = 0; j < R && at != NULL; j++) {
        at = strstr(at + 1, "\"host\":\"");
        if (at == NULL)
            return false;
        at += strlen("\"host\":\"");
        size_t n = strcspn(at, "\"");
        snprintf(hosts[j], 16, "%.*s", (int)(n < 15 ? n : 15), at);
    }
    return at != NULL;
}

/* head_group_rings ACROSS (hosts ha, hb, hc with two workers each): auto
 * takes one group per worker of a host (2 rings of 3), ring rank j of
 * both rings on the same host, the three ranks on three hosts; the calls
 * equal each group's in-process ring bit for bit; striactl draws the
 * grid. INSIDE on the same workers: one group per host (3 rings of 2). */
Test(session, head_groups_across_hosts_put_ring_rank_j_on_host_j, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_init(&c);
    dc_start_coordinator(&c, NULL);
    static const char *const hosts[6] = {"ha", "hb", "hc", "ha", "hb", "hc"};
    char flags[6][64];
    char *args[6][2];
    for (int i = 0; i < 6; i++) {
        snprintf(flags[i], sizeof(flags[i]), "--host=%s", hosts[i]);
        args[i][0] = flags[i];
        args[i][1] = NULL;
        dc_opts_t o = {.worker_args = args[i]};
        dc_start_worker(&c, i, &o);
    }
    dc_wait_healthy(&c, 6, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    for (int across = 1; across >= 0; across--) {
        const int G = across ? 2 : 3, R = 6 / G;
        stria_session_spec_t sp =
            se_spec_of(1, 128, 6, 6, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 0);
        sp.head_groups = STRIA_HEAD_GROUPS_AUTO;
        sp.head_group_rings = across ? STRIA_GROUP_RINGS_ACROSS : STRIA_GROUP_RINGS_INSIDE;
        stria_session_t *s = se_open_session(cl, &sp);
        stria_session_spec_t got = STRIA_SESSION_SPEC_INIT;
        cr_assert_eq(stria_session_spec_get(s, &got), STRIA_OK, "%s", stria_error_msg());
        cr_expect_eq(got.head_groups, (uint32_t)G, "across %d: head groups %u, want %d", across,
                     got.head_groups, G);
        cr_expect_eq(stria_session_ring_size(s), 6);
        stria_call_t call = se_call_of(1, 128, true);
        se_check_groups_call(s, &sp, &call, 1600 + (uint64_t)across, G, R,
                             across ? "rings across hosts" : "rings inside hosts");
        char *out = NULL;
        cr_assert_eq(dc_striactl(&c, NULL, &out, NULL, "--json", "sessions", NULL), 0);
        char h[3][3][16];
        for (int g = 0; g < G; g++) {
            cr_assert(group_hosts(out, g, R, h[g]), "group %d's ring not in %s", g, out);
            for (int j = 0; j < R; j++) {
                if (across) { /* rank j on the same host in every ring, the ranks apart */
                    cr_expect_str_eq(h[g][j], h[0][j], "ring %d's rank %d on %s, ring 0's on %s", g,
                                     j, h[g][j], h[0][j]);
                    cr_expect(j == 0 || strcmp(h[g][j], h[g][j - 1]) != 0,
                              "ring %d's ranks %d and %d share host %s", g, j - 1, j, h[g][j]);
                } else { /* each ring inside one host */
                    cr_expect_str_eq(h[g][j], h[g][0], "ring %d spans %s and %s", g, h[g][0],
                                     h[g][j]);
                }
            }
        }
        free(out);
        out = NULL;
        char id[24];
        snprintf(id, sizeof(id), "%llu", (unsigned long long)stria_session_id(s));
        cr_assert_eq(dc_striactl(&c, NULL, &out, NULL, "session", id, NULL), 0);
        char want[64];
        snprintf(want, sizeof(want), "head groups: %d rings of %d ranks", G, R);
        cr_expect(strstr(out, want) != NULL, "no grid in %s", out);
        cr_expect(strstr(out, across ? "3-5" : "4-5") != NULL, "the last group's heads: %s", out);
        free(out);
        cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    }
    stria_client_close(cl);
    dc_stop(&c);
}
