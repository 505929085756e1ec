/* The worker library in one process: a coordinator and 2-3 workers
 * (stria_worker_start) on loopback with in-process ring links, driven over
 * raw RPC as libstria drives them (OpenSession, SessionCall, DropJob): a
 * job's calls against the in-process ring (a held forward's backward equal
 * to the default one bit for bit), calls of other shapes and held forwards,
 * refusals, a sharded session's ranks agreeing on each call (a missing rank
 * named, calls that differ refused), uploads above the payload cap in
 * pieces, drops during transfers and while a ring link binds, a job and a
 * session side by side, and stopping a worker that holds a job and runs a
 * call. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tref.h"
#include "worker_fixture.h"

#define TEST_TIMEOUT_S 60

static void start(wf_t *f, int n, double step_timeout_s)
{
    cr_assert_eq(wf_start(f, n, step_timeout_s), STRIA_OK, "%s", stria_error_msg());
}

static void submit(wf_t *f, const wf_spec_t *s, wf_job_t *job)
{
    cr_assert_eq(wf_submit_spec(f, s, job), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(job->n, f->n);
}

static void expect_msg(const char *what, const char *part)
{
    cr_expect(strstr(stria_error_msg(), part) != NULL, "%s: \"%s\" does not say \"%s\"", what,
              stria_error_msg(), part);
}

/* ---- the reference -------------------------------------------------------------- */

/* Full inputs of a job's (or a call view's) shape and the in-process ring's
 * outputs over them (forward and backward). */
typedef struct {
    float *q, *k, *v, *d_o;
    float *out[TJ_N_OUT]; /* O, LSE, dQ, dK, dV */
} ref_t;

static void ref_make(ref_t *r, const wf_job_t *job, unsigned seed)
{
    const stria_ring_shape_t *s = &job->shape;
    size_t nq = (size_t)(s->call.batch * s->call.seq_len * s->heads * s->head_dim);
    size_t nk = (size_t)(s->call.batch * s->call.seq_len * s->kv_heads * s->head_dim);
    size_t nl = (size_t)(s->call.batch * s->heads * s->call.seq_len);
    r->q = wf_tensor(job, s->heads, seed);
    r->k = wf_tensor(job, s->kv_heads, seed + 1);
    r->v = wf_tensor(job, s->kv_heads, seed + 2);
    r->d_o = wf_tensor(job, s->heads, seed + 3);
    const size_t n[TJ_N_OUT] = {nq, nl, nq, nk, nk};
    for (int i = 0; i < TJ_N_OUT; i++)
        r->out[i] = calloc(n[i] + 1, sizeof(float));
    stria_ring_local_opts_t lo = {
        .layout = job->layout.kind, .n_ranks = job->n, .passes = STRIA_RING_PASS_FWD_BWD};
    void *const out[TJ_N_OUT] = {r->out[0], r->out[1], r->out[2], r->out[3], r->out[4]};
    cr_assert_eq(tref_ring_run(s, &lo, r->q, r->k, r->v, r->d_o, out, NULL), STRIA_OK, "%s",
                 stria_error_msg());
}

static void ref_free(ref_t *r)
{
    free(r->q), free(r->k), free(r->v), free(r->d_o);
    for (int i = 0; i < TJ_N_OUT; i++)
        free(r->out[i]);
    memset(r, 0, sizeof(*r));
}

/* Compares rank `rank`'s compact shard of an output with the full
 * reference: [batch, seq, heads, dim], or LSE [batch, heads, seq]. */
static void expect_shard(const wf_job_t *job, int rank, const float *got, uint64_t len,
                         const float *ref, int64_t heads, bool lse, const char *what)
{
    int64_t v = job->valid[rank], d = job->shape.head_dim, seq = job->shape.call.seq_len;
    int64_t batch = job->shape.call.batch;
    uint64_t want = (uint64_t)(batch * v * heads * (lse ? 1 : d)) * sizeof(float);
    cr_assert_eq(len, want, "%s rank %d: %llu bytes, want %llu", what, rank,
                 (unsigned long long)len, (unsigned long long)want);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < (lse ? heads : 1); h++)
            for (int64_t i = 0; i < v; i++) {
                int64_t pos = stria_layout_position(&job->layout, rank, i);
                int64_t n = lse ? 1 : heads * d;
                const float *g = lse ? got + (b * heads + h) * v + i : got + (b * v + i) * n;
                const float *r =
                    lse ? ref + (b * heads + h) * seq + pos : ref + (b * seq + pos) * n;
                for (int64_t e = 0; e < n; e++)
                    if (!(fabsf(g[e] - r[e]) <= 1e-4f * (1.0f + fabsf(r[e]))))
                        cr_assert_fail("%s rank %d batch %lld token %lld: %g, want %g", what, rank,
                                       (long long)b, (long long)pos, (double)g[e], (double)r[e]);
            }
}

/* Every rank's outputs of a forward (O, LSE) or backward (dQ, dK, dV). */
static void expect_outputs(const wf_job_t *job, const wf_io_t io[], const ref_t *ref, bool backward,
                           const char *what)
{
    const int64_t h = job->shape.heads, kv = job->shape.kv_heads;
    static const int fwd[] = {WF_O, WF_LSE}, bwd[] = {WF_DQ, WF_DK, WF_DV};
    static const int fwd_ref[] = {TJ_O, TJ_LSE}, bwd_ref[] = {TJ_DQ, TJ_DK, TJ_DV};
    char name[128];
    for (int r = 0; r < job->n; r++)
        for (int i = 0; i < (backward ? 3 : 2); i++) {
            int t = backward ? bwd[i] : fwd[i];
            snprintf(name, sizeof(name), "%s %s", what, wf_tensor_names[t]);
            cr_assert_not_null(io[r].t[t], "%s: rank %d has none", name, r);
            expect_shard(job, r, io[r].t[t], io[r].len[t],
                         ref->out[backward ? bwd_ref[i] : fwd_ref[i]],
                         t == WF_DK || t == WF_DV ? kv : h, t == WF_LSE, name);
        }
}

/* Whether two calls' outputs are the same bytes on every rank. */
static void expect_same(const wf_job_t *job, const wf_io_t a[], const wf_io_t b[], bool backward,
                        const char *what)
{
    static const int fwd[] = {WF_O, WF_LSE}, bwd[] = {WF_DQ, WF_DK, WF_DV};
    for (int r = 0; r < job->n; r++)
        for (int i = 0; i < (backward ? 3 : 2); i++) {
            int t = backward ? bwd[i] : fwd[i];
            cr_expect(a[r].len[t] == b[r].len[t] && a[r].t[t] != NULL && b[r].t[t] != NULL &&
                          memcmp(a[r].t[t], b[r].t[t], a[r].len[t]) == 0,
                      "%s: rank %d's %s differ", what, r, wf_tensor_names[t]);
        }
}

/* The session still serves after a refusal (which aborts the rank's ring
 * link): a forward of every rank on a new link epoch, its outputs the
 * reference's. Returns the epoch. */
static uint64_t expect_serves(wf_t *f, const wf_job_t *job, wf_io_t io[], const ref_t *ref,
                              uint64_t *call, const char *after)
{
    const wf_call_opts_t o = {.epoch = *call};
    stria_status_t st = wf_call_all(f, job, *call, &o, io);
    cr_expect_eq(st, STRIA_OK, "the forward after %s: %s", after, stria_error_msg());
    if (st == STRIA_OK)
        expect_outputs(job, io, ref, false, after);
    return (*call)++;
}

/* ---- a job's calls ------------------------------------------------------------------ */

Test(worker, job_lifecycle_matches_the_local_ring, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job;
    ref_t ref;
    wf_io_t io[WF_MAX] = {0}, held[WF_MAX] = {0};
    start(&f, 3, 5.0);
    cr_assert_eq(wf_submit(&f, 96, 0, &job), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(job.n, 3);
    cr_assert_eq(job.max_held, 1);
    ref_make(&ref, &job, 1);

    cr_assert_eq(wf_open_all(&f, &job), STRIA_OK, "%s", stria_error_msg());
    stria_worker_usage_t u;
    stria_worker_usage(f.w[0], &u);
    cr_expect_eq(u.jobs, 1);
    cr_expect_gt(u.memory_in_use_bytes, 0);
    wf_io_inputs(&job, io, ref.q, ref.k, ref.v, ref.d_o);
    wf_io_inputs(&job, held, ref.q, ref.k, ref.v, ref.d_o);

    /* a forward, then a held one (on the session's kept pass object) */
    const wf_call_opts_t fwd = {0}, hold = {.hold = true};
    cr_assert_eq(wf_call_all(&f, &job, 0, &fwd, io), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&job, io, &ref, false, "forward");
    cr_assert_eq(wf_call_all(&f, &job, 1, &hold, held), STRIA_OK, "%s", stria_error_msg());
    expect_same(&job, io, held, false, "the held forward against the first");

    /* the default backward brings all six inputs (O and LSE of call 0) */
    const wf_call_opts_t bwd = {.backward = true};
    cr_assert_eq(wf_call_all(&f, &job, 2, &bwd, io), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&job, io, &ref, true, "backward");
    /* the held forward's backward brings dO alone: the same bits */
    const wf_call_opts_t held_bwd = {.backward = true, .use_held = true, .held_call = 1};
    cr_assert_eq(wf_call_all(&f, &job, 3, &held_bwd, held), STRIA_OK, "%s", stria_error_msg());
    expect_same(&job, io, held, true, "the held-forward backward against the default one");

    cr_assert_eq(wf_release(&f, &job), STRIA_OK, "%s", stria_error_msg());
    for (int i = 0; i < f.n; i++)
        cr_expect(wf_wait_usage(&f, i, 0, 0, 5.0), "worker %d keeps the released job", i);
    wf_io_free(io, WF_MAX);
    wf_io_free(held, WF_MAX);
    ref_free(&ref);
    wf_stop(&f);
}

/* ---- a session's calls of other shapes, held forwards ------------------------------- */

Test(worker, session_calls_of_other_shapes_and_held_forwards, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job;
    ref_t ra, rb, rc;
    wf_io_t a[WF_MAX] = {0}, b[WF_MAX] = {0}, c[WF_MAX] = {0}, again[WF_MAX] = {0};
    start(&f, 2, 5.0);
    const wf_spec_t sp = {.seq_len = 128, .batch = 2, .session = true, .max_held = 2};
    submit(&f, &sp, &job);
    cr_assert_eq(wf_open_all(&f, &job), STRIA_OK, "%s", stria_error_msg());
    int w0 = job.widx[0];

    /* A: one causal row of 101 tokens (rank 1's shard padded); B: two rows
     * of 64 with documents and a window; C: one token (rank 1 holds
     * padding only) */
    wf_job_t va = wf_job_resized(&job, 1, 101), vb = wf_job_resized(&job, 2, 64);
    wf_job_t vc = wf_job_resized(&job, 1, 1);
    va.shape.call.causal = true;
    static const int64_t docs[] = {0, 20, 64};
    vb.shape.call.cu_seqlens = docs;
    vb.shape.call.n_cu_seqlens = 3;
    vb.shape.call.has_window = true;
    vb.shape.call.window_left = 16;
    vb.shape.call.window_right = 8;
    cr_assert_neq(va.valid[0], va.valid[1]);
    cr_assert_eq(vc.valid[1], 0);
    ref_make(&ra, &va, 11);
    ref_make(&rb, &vb, 21);
    ref_make(&rc, &vc, 31);
    wf_io_inputs(&va, a, ra.q, ra.k, ra.v, ra.d_o);
    wf_io_inputs(&vb, b, rb.q, rb.k, rb.v, rb.d_o);
    wf_io_inputs(&vc, c, rc.q, rc.k, rc.v, rc.d_o);
    wf_io_inputs(&va, again, ra.q, ra.k, ra.v, ra.d_o);

    const wf_call_opts_t hold = {.hold = true}, fwd = {0};
    cr_assert_eq(wf_call_all(&f, &vc, 0, &fwd, c), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&vc, c, &rc, false, "C forward");
    cr_assert_eq(wf_call_all(&f, &va, 1, &hold, a), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&va, a, &ra, false, "A forward");
    cr_assert_eq(wf_call_all(&f, &vb, 2, &hold, b), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&vb, b, &rb, false, "B forward");
    /* two held: a third is refused (BUSY: the link stays) */
    cr_expect_eq(wf_call_rank(&f, &va, 0, 3, &hold, &again[0]), STRIA_ERR_BUSY);
    expect_msg("a third held forward", "2 forward(s) held already");

    /* a held forward's backward of another shape: refused */
    wf_call_opts_t hb = {.backward = true, .use_held = true, .held_call = 1};
    cr_expect_eq(wf_call_rank(&f, &vb, 0, 4, &hb, &b[0]), STRIA_ERR_INVALID_ARG);
    expect_msg("B's backward of A's held forward", "shape is not the held forward's (call 1)");

    /* the backwards in the other order, on a new link (the refusal aborted it) */
    hb.epoch = 5;
    hb.held_call = 2;
    cr_assert_eq(wf_call_all(&f, &vb, 5, &hb, b), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&vb, b, &rb, true, "B held backward");
    hb.held_call = 1;
    cr_assert_eq(wf_call_all(&f, &va, 6, &hb, a), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&va, a, &ra, true, "A held backward");
    /* run, its held forward is gone */
    cr_expect_eq(wf_call_rank(&f, &va, 0, 7, &hb, &a[0]), STRIA_ERR_INVALID_ARG);
    expect_msg("a second backward of held call 1", "call 1 holds no forward here");

    /* A's default backward (O and LSE of call 1): the held one's bits */
    const wf_call_opts_t bwd = {.backward = true, .epoch = 8};
    for (int r = 0; r < job.n; r++) {
        wf_io_set(&again[r], WF_O, a[r].t[WF_O], a[r].len[WF_O]);
        wf_io_set(&again[r], WF_LSE, a[r].t[WF_LSE], a[r].len[WF_LSE]);
    }
    cr_assert_eq(wf_call_all(&f, &va, 8, &bwd, again), STRIA_OK, "%s", stria_error_msg());
    expect_same(&va, a, again, true, "A's default backward against its held one");

    /* a held forward let go (DropJob release_held) is no forward to run */
    const wf_call_opts_t hold8 = {.hold = true, .epoch = 8};
    cr_assert_eq(wf_call_all(&f, &va, 9, &hold8, a), STRIA_OK, "%s", stria_error_msg());
    for (int r = 0; r < job.n; r++)
        cr_expect_eq(wf_release_held(&f, &job, r, 9), STRIA_OK, "rank %d: %s", r,
                     stria_error_msg());
    cr_expect_eq(wf_release_held(&f, &job, 0, 9), STRIA_ERR_NOT_FOUND);
    expect_msg("a second release", "call 9 holds no forward here");
    hb.held_call = 9;
    hb.epoch = 8;
    cr_expect_eq(wf_call_rank(&f, &va, 0, 10, &hb, &a[0]), STRIA_ERR_INVALID_ARG);
    expect_msg("the backward of a released forward", "call 9 holds no forward here");
    /* the session is still held, its refusals notwithstanding */
    stria_worker_usage_t u;
    stria_worker_usage(f.w[w0], &u);
    cr_expect_eq(u.jobs, 1);

    wf_io_free(a, WF_MAX), wf_io_free(b, WF_MAX), wf_io_free(c, WF_MAX);
    wf_io_free(again, WF_MAX);
    ref_free(&ra), ref_free(&rb), ref_free(&rc);
    wf_stop(&f);
}

/* ---- refusals -------------------------------------------------------------------- */

Test(worker, refusals_name_the_problem, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job, ghost, wrong;
    ref_t ref;
    wf_io_t io[WF_MAX] = {0}, other[WF_MAX] = {0};
    char want[256];
    start(&f, 2, 5.0);
    const wf_spec_t sp = {.seq_len = 64, .session = true, .max_held = 1};
    submit(&f, &sp, &job);
    ref_make(&ref, &job, 1);
    wf_io_inputs(&job, io, ref.q, ref.k, ref.v, ref.d_o);
    wf_io_inputs(&job, other, ref.q, ref.k, ref.v, ref.d_o);
    cr_assert_eq(wf_open_all(&f, &job), STRIA_OK, "%s", stria_error_msg());
    const int w0 = job.widx[0];
    uint64_t call = 0, epoch = 0;
    const wf_call_opts_t fwd = {0};

    /* a session this worker does not hold */
    ghost = job;
    ghost.id = job.id + 1000;
    cr_expect_eq(wf_call_rank(&f, &ghost, 0, call, &fwd, &io[0]), STRIA_ERR_NOT_FOUND);
    expect_msg("a ghost's call", "not held by this worker");
    cr_expect_eq(wf_release_held(&f, &ghost, 0, 0), STRIA_ERR_NOT_FOUND);
    expect_msg("a ghost's release", "not held by this worker");

    cr_expect_eq(wf_open(&f, &ghost, 0), STRIA_ERR_NOT_FOUND, "%s", stria_error_msg());

    /* an open again (another client of the session): answered at once */
    cr_expect_eq(wf_open(&f, &job, 0), STRIA_OK, "%s", stria_error_msg());

    /* a rank opened on a worker the coordinator did not give it */
    wf_job_t unopened;
    submit(&f, &sp, &unopened);
    unopened.widx[1] = unopened.widx[0];
    cr_expect_eq(wf_open(&f, &unopened, 1), STRIA_ERR_INVALID_ARG);
    expect_msg("rank 1's first open on rank 0's worker", "not to this worker");

    /* rank 1's open and call sent to rank 0's worker */
    wrong = job;
    wrong.widx[1] = w0;
    cr_expect_eq(wf_open(&f, &wrong, 1), STRIA_ERR_INVALID_ARG);
    expect_msg("rank 1's open on rank 0's worker", "holds rank 0, not 1");
    cr_expect_eq(wf_call_rank(&f, &wrong, 1, call, &fwd, &io[1]), STRIA_ERR_INVALID_ARG);
    expect_msg("rank 1's call on rank 0's worker", "holds rank 0, not 1");
    epoch = expect_serves(&f, &job, io, &ref, &call, "calls for another rank");

    /* a request whose proof binds another call (changed on the way) */
    const wf_call_opts_t forged = {.epoch = epoch, .forge = true};
    cr_expect_eq(wf_call_rank(&f, &job, 0, call, &forged, &io[0]), STRIA_ERR_AUTH, "%s",
                 stria_error_msg());
    epoch = expect_serves(&f, &job, io, &ref, &call, "a forged call");

    /* a payload of the wrong size */
    uint64_t len = 0;
    void *payload = wf_payload(&fwd, &io[0], &len);
    const wf_call_opts_t at = {.epoch = epoch};
    cr_expect_eq(wf_request(f.wc[w0], &job, 0, call, &at, 0, false, payload, len - 64, NULL),
                 STRIA_ERR_INVALID_ARG);
    snprintf(want, sizeof(want), "the payload is %llu bytes; the call's forward inputs are %llu",
             (unsigned long long)(len - 64), (unsigned long long)len);
    expect_msg("a short payload", want);
    free(payload);
    call++;
    epoch = expect_serves(&f, &job, io, &ref, &call, "a short payload");

    /* a call while one runs on that rank: rank 0 alone waits for rank 1 */
    wf_bg_t bg;
    const wf_call_opts_t now = {.epoch = epoch};
    cr_assert_eq(wf_bg_start(&bg, &f, &job, 0, false, call, &now, &other[0]), 0);
    cr_assert(wf_wait_running(&f, w0, 1, 5.0), "rank 0's call did not start");
    cr_expect_eq(wf_call_rank(&f, &job, 0, call, &now, &io[0]), STRIA_ERR_BUSY);
    expect_msg("a second call of rank 0", "a call is running");
    cr_expect_eq(wf_call_rank(&f, &job, 0, call + 1, &now, &io[0]), STRIA_ERR_BUSY);
    /* rank 1 joins: both complete */
    cr_expect_eq(wf_call_rank(&f, &job, 1, call, &now, &other[1]), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(wf_bg_join(&bg), STRIA_OK, "%s", bg.msg);
    expect_outputs(&job, other, &ref, false, "the call that ran");
    call++;

    /* held forwards: a backward that uses none, a backward that holds, a
     * forward that uses one */
    wf_call_opts_t o = {.backward = true, .use_held = true, .held_call = 77, .epoch = epoch};
    cr_expect_eq(wf_call_rank(&f, &job, 0, call++, &o, &io[0]), STRIA_ERR_INVALID_ARG);
    expect_msg("the backward of call 77", "call 77 holds no forward here");
    o = (wf_call_opts_t){.backward = true, .hold = true, .epoch = epoch};
    cr_expect_eq(wf_call_rank(&f, &job, 0, call++, &o, &io[0]), STRIA_ERR_INVALID_ARG);
    expect_msg("a backward that holds", "a backward call holds nothing");
    o = (wf_call_opts_t){.use_held = true, .held_call = 1, .epoch = epoch};
    cr_expect_eq(wf_call_rank(&f, &job, 0, call++, &o, &io[0]), STRIA_ERR_INVALID_ARG);
    expect_msg("a forward that uses a held one", "only a backward call uses a held forward");
    epoch = expect_serves(&f, &job, io, &ref, &call, "held-forward refusals");

    /* a hold at the session's max_held (1): BUSY until it is let go */
    o = (wf_call_opts_t){.hold = true, .epoch = epoch};
    uint64_t held = call++;
    cr_assert_eq(wf_call_all(&f, &job, held, &o, other), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(wf_call_rank(&f, &job, 0, call, &o, &io[0]), STRIA_ERR_BUSY);
    expect_msg("a second held forward", "1 forward(s) held already");
    for (int r = 0; r < job.n; r++)
        cr_expect_eq(wf_release_held(&f, &job, r, held), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(wf_call_all(&f, &job, call++, &o, other), STRIA_OK, "%s", stria_error_msg());

    /* shapes beyond the session's bounds, or masks that do not hold */
    static const int64_t short_docs[] = {0, 10, 60};
    static const struct {
        int64_t batch, seq_len;
        bool causal, window;
        int64_t left, right;
        const int64_t *docs;
        const char *says;
    } bad[] = {
        {1, 129, false, false, 0, 0, NULL, "exceeds the session's bound"},
        {2, 32, false, false, 0, 0, NULL, "call batch must be 1..1"},
        {1, 0, false, false, 0, 0, NULL, "seq_len must be at least 1"},
        {1, 64, false, false, 0, 0, short_docs, "cu_seqlens must end at seq_len (64)"},
        {1, 64, true, true, 8, 4, NULL, "window.right must be 0 or -1 with causal"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        stria_call_shape_t s = wf_shape(&job);
        s.batch = bad[i].batch;
        s.seq_len = bad[i].seq_len;
        s.causal = bad[i].causal;
        s.has_window = bad[i].window;
        s.window_left = bad[i].left;
        s.window_right = bad[i].right;
        s.cu_seqlens = bad[i].docs;
        s.n_cu_seqlens = bad[i].docs != NULL ? 3 : 0;
        o = (wf_call_opts_t){.shape = &s, .epoch = epoch};
        cr_expect_eq(wf_call_rank(&f, &job, 0, call++, &o, &io[0]), STRIA_ERR_INVALID_ARG,
                     "bad shape %zu: %s", i, stria_error_msg());
        expect_msg("a bad shape", bad[i].says);
    }
    epoch = expect_serves(&f, &job, io, &ref, &call, "bad shapes");
    (void)epoch;
    wf_io_free(io, WF_MAX);
    wf_io_free(other, WF_MAX);
    ref_free(&ref);
    wf_stop(&f);
}

/* ---- a sharded session's agreement --------------------------------------------- */

/* A sharded session of 2 ranks on 2 workers (batch 1, seq_len tokens, 2
 * heads over 1 kv head of 16), opened on both, with its reference and each
 * rank's inputs from `seed`. */
static void sharded_session(wf_t *f, wf_job_t *job, ref_t *ref, wf_io_t io[WF_MAX], int64_t seq_len,
                            double arrival_timeout_s, unsigned seed)
{
    start(f, 2, 5.0);
    Stria__V1__JobSpec sp = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    const char *rpc[WF_MAX];
    sp.batch = 1, sp.seq_len = seq_len, sp.heads = 2, sp.kv_heads = 1, sp.head_dim = 16;
    sp.ring_size = 2, sp.session = true, sp.sharded = true;
    sp.arrival_timeout_s = arrival_timeout_s;
    req.spec = &sp;
    cr_assert_eq(wf_call(f->cc, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, NULL, 0, &rep),
                 STRIA_OK, "%s", stria_error_msg());
    for (int i = 0; i < f->n; i++)
        rpc[i] = stria_worker_address(f->w[i]);
    cr_assert_eq(wf_job_of(&rep, &sp, rpc, f->n, job), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    ref_make(ref, job, seed);
    wf_io_inputs(job, io, ref->q, ref->k, ref->v, NULL);
    cr_assert_eq(wf_open_all(f, job), STRIA_OK, "%s", stria_error_msg());
}

/* A sharded session's ranks compare their calls before step 0 (the
 * coordinator judges a job's arrivals; a session's are the workers' alone):
 * a rank whose trainer rank does not call is named after the arrival
 * timeout, ranks whose calls differ are refused, and the session serves on. */
Test(worker, a_sharded_sessions_ranks_agree_on_each_call, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job;
    ref_t ref;
    wf_io_t io[WF_MAX] = {0};
    sharded_session(&f, &job, &ref, io, 64, 0.5, 41);

    /* rank 0 calls alone: rank 1 is named once the arrival timeout passes */
    const wf_call_opts_t fwd = {0};
    double t0 = stria_time_now();
    cr_expect_eq(wf_call_rank(&f, &job, 0, 0, &fwd, &io[0]), STRIA_ERR_TIMEOUT);
    expect_msg("a call of rank 0 alone", "rank 1 did not arrive for the forward pass (call 0)");
    cr_expect_lt(stria_time_now() - t0, 4.0, "named only at a step's deadline");

    /* the ranks' calls differ (rank 1's is causal): refused on both */
    stria_call_shape_t causal = wf_shape(&job);
    causal.causal = true;
    const wf_call_opts_t e1 = {.epoch = 1}, e1c = {.epoch = 1, .shape = &causal};
    wf_bg_t bg;
    cr_assert_eq(wf_bg_start(&bg, &f, &job, 0, false, 1, &e1, &io[0]), 0);
    stria_status_t st = wf_call_rank(&f, &job, 1, 1, &e1c, &io[1]);
    char msg[512];
    snprintf(msg, sizeof(msg), "%s", stria_error_msg());
    cr_expect_eq(wf_bg_join(&bg), STRIA_ERR_INVALID_ARG, "rank 0: %s", bg.msg);
    cr_expect(strstr(bg.msg, "call 1 differs between rank") != NULL, "rank 0: %s", bg.msg);
    cr_expect_eq(st, STRIA_ERR_INVALID_ARG, "rank 1: %s", msg);
    cr_expect(strstr(msg, "call 1 differs between rank") != NULL, "rank 1: %s", msg);

    /* the same call on both: served */
    const wf_call_opts_t e2 = {.epoch = 2};
    cr_expect_eq(wf_call_all(&f, &job, 2, &e2, io), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&job, io, &ref, false, "the call both ranks made");
    wf_io_free(io, WF_MAX);
    ref_free(&ref);
    wf_stop(&f);
}

/* ---- a rank's inputs in parts ---------------------------------------------------- */

/* One part of a rank's forward on a thread and a connection of its own:
 * rows part, part + parts, ... of the rank's Q, K, V (ring rows of the
 * trainer rank's stripe); its O and LSE rows in `out`. */
typedef struct {
    wf_t *f;
    const wf_job_t *job;
    int rank;
    uint64_t call;
    wf_call_opts_t o;
    const wf_io_t *io;
    char *payload;
    uint64_t len;
    stria_rpc_reply_t rep;
    pthread_t th;
    stria_status_t st;
    char msg[512];
} part_t;

/* Rows part, part + parts, ... of tensor t of io (its outer rows: batch,
 * or batch x heads for LSE), appended at dst (or, back, from src into io). */
static uint64_t part_rows(const wf_job_t *job, int rank, const wf_io_t *io, int t, uint32_t part,
                          uint32_t parts, char *buf, bool back)
{
    const int64_t v = job->valid[rank];
    const int64_t outer = job->shape.call.batch * (t == WF_LSE ? job->shape.heads : 1);
    const uint64_t row = wf_tensor_bytes(job, rank, t) / (uint64_t)(outer * v);
    uint64_t n = 0;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t k = part; k < v; k += parts, n += row) {
            char *x = (char *)io->t[t] + (uint64_t)(o * v + k) * row;
            memcpy(back ? x : buf + n, back ? buf + n : x, row);
        }
    return n;
}

static void *part_main(void *arg)
{
    part_t *p = arg;
    stria_rpc_client_t *cl = wf_client(p->f, p->job->widx[p->rank]);
    memset(&p->rep, 0, sizeof(p->rep));
    p->st = cl == NULL ? STRIA_ERR_IO
                       : wf_request(cl, p->job, p->rank, p->call, &p->o, 0, false, p->payload,
                                    p->len, &p->rep);
    snprintf(p->msg, sizeof(p->msg), "%s", p->st != STRIA_OK ? stria_error_msg() : "");
    if (cl != NULL)
        stria_rpc_client_close(cl);
    return NULL;
}

/* Part `part` of rank's forward inputs from io (len_add: bytes more or
 * fewer than it should carry). */
static void part_prepare(part_t *p, wf_t *f, const wf_job_t *job, int rank, uint64_t call,
                         const wf_call_opts_t *o, const wf_io_t *io, int64_t len_add)
{
    *p = (part_t){.f = f, .job = job, .rank = rank, .call = call, .o = *o, .io = io};
    uint64_t all = 0;
    for (int t = WF_Q; t <= WF_V; t++)
        all += wf_tensor_bytes(job, rank, t);
    p->payload = calloc(1, all + 64);
    for (int t = WF_Q; t <= WF_V; t++)
        p->len += part_rows(job, rank, io, t, o->part, o->parts, p->payload + p->len, false);
    p->len = (uint64_t)((int64_t)p->len + len_add);
}

/* A sharded session's rank takes its forward's inputs in parts, one per
 * trainer rank (SessionCallRequest.parts): each part's rows go to ring
 * rows part, part + parts, ... and each reply carries the part's rows of
 * O and LSE, equal to the in-process ring; a part out of range, of the
 * wrong size, or that comes twice is refused naming it, one whose sibling
 * never comes fails at the arrival timeout, and the session serves on. */
Test(worker, a_ranks_inputs_come_in_parts_one_per_trainer_rank, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job;
    ref_t ref;
    wf_io_t io[WF_MAX] = {0};
    sharded_session(&f, &job, &ref, io, 61, 2, 43);

    /* refused on rank 0 alone, each naming what is wrong */
    struct {
        uint32_t part, parts;
        int64_t len_add;
        const char *needle;
    } bad[] = {
        {0, 1, 0, "part 0 of 1 (parts: 2..64"},
        {2, 2, 0, "part 2 of 2 (parts: 2..64"},
        {0, 65, 0, "part 0 of 65 (parts: 2..64"},
        {1, 2, -4, "part 1 of 2 brings"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const wf_call_opts_t o = {.epoch = 10 + i, .part = bad[i].part, .parts = bad[i].parts};
        part_t p;
        part_prepare(&p, &f, &job, 0, 10 + i, &o, &io[0], bad[i].len_add);
        part_main(&p);
        cr_expect_eq(p.st, STRIA_ERR_INVALID_ARG, "case %zu: %s", i, p.msg);
        cr_expect(strstr(p.msg, bad[i].needle) != NULL, "case %zu: %s", i, p.msg);
        free(p.payload);
        stria_rpc_reply_free(&p.rep);
    }

    /* parts 0 and 1 of both ranks at once, call after call (the second
     * with the parts sent in the other order) */
    for (uint64_t call = 20; call < 22; call++) {
        part_t p[4];
        for (int i = 0; i < 4; i++) {
            int rank = i / 2;
            uint32_t part = (uint32_t)(call == 20 ? i % 2 : 1 - i % 2);
            const wf_call_opts_t o = {.epoch = 20, .part = part, .parts = 2};
            part_prepare(&p[i], &f, &job, rank, call, &o, &io[rank], 0);
            cr_assert_eq(pthread_create(&p[i].th, NULL, part_main, &p[i]), 0);
        }
        wf_io_t got[WF_MAX] = {0};
        for (int i = 0; i < 4; i++) {
            pthread_join(p[i].th, NULL);
            cr_expect_eq(p[i].st, STRIA_OK, "call %llu, rank %d part %u: %s",
                         (unsigned long long)call, i / 2, p[i].o.part, p[i].msg);
            int rank = i / 2;
            for (int t = WF_O; t <= WF_LSE; t++)
                if (got[rank].t[t] == NULL) {
                    got[rank].t[t] = calloc(1, wf_tensor_bytes(&job, rank, t) + 1);
                    got[rank].len[t] = wf_tensor_bytes(&job, rank, t);
                }
            uint64_t o_part = 0, want = 0;
            for (int t = WF_O; t <= WF_LSE; t++)
                want += wf_tensor_bytes(&job, rank, t) *
                        (uint64_t)((job.valid[rank] + 1 - p[i].o.part) / 2) /
                        (uint64_t)job.valid[rank];
            cr_expect_eq(p[i].rep.payload_len, want, "call %llu, rank %d part %u: %llu bytes back",
                         (unsigned long long)call, rank, p[i].o.part,
                         (unsigned long long)p[i].rep.payload_len);
            if (p[i].st == STRIA_OK && p[i].rep.payload_len == want)
                for (int t = WF_O; t <= WF_LSE; t++)
                    o_part += part_rows(&job, rank, &got[rank], t, p[i].o.part, 2,
                                        (char *)p[i].rep.payload + o_part, true);
            free(p[i].payload);
            stria_rpc_reply_free(&p[i].rep);
        }
        expect_outputs(&job, got, &ref, false, call == 20 ? "parts in order" : "parts reversed");
        wf_io_free(got, WF_MAX);
    }

    /* a part that comes twice */
    {
        const wf_call_opts_t o = {.epoch = 30, .part = 0, .parts = 2};
        part_t p0, p1;
        part_prepare(&p0, &f, &job, 0, 30, &o, &io[0], 0);
        part_prepare(&p1, &f, &job, 0, 30, &o, &io[0], 0);
        cr_assert_eq(pthread_create(&p0.th, NULL, part_main, &p0), 0);
        usleep(200000);
        part_main(&p1);
        cr_expect_eq(p1.st, STRIA_ERR_INVALID_ARG, "%s", p1.msg);
        cr_expect(strstr(p1.msg, "part 0 of 2 came twice") != NULL, "%s", p1.msg);
        pthread_join(p0.th, NULL); /* the call cannot run: the waiting part fails at once */
        cr_expect_eq(p0.st, STRIA_ERR_INVALID_ARG, "the first of a doubled part: %s", p0.msg);
        cr_expect(strstr(p0.msg, "came twice") != NULL, "%s", p0.msg);
        free(p0.payload), free(p1.payload);
        stria_rpc_reply_free(&p0.rep), stria_rpc_reply_free(&p1.rep);
    }

    /* a part whose sibling never comes fails once the session's arrival
     * timeout (2 s) passed, naming the part that did not come */
    {
        const wf_call_opts_t o = {.epoch = 35, .part = 1, .parts = 2};
        part_t p1;
        part_prepare(&p1, &f, &job, 0, 35, &o, &io[0], 0);
        double t0 = stria_time_now();
        part_main(&p1);
        double took = stria_time_now() - t0;
        cr_expect_eq(p1.st, STRIA_ERR_TIMEOUT, "%s", p1.msg);
        cr_expect(strstr(p1.msg, "part(s) 0 of 2 did not come within the arrival timeout") != NULL,
                  "%s", p1.msg);
        cr_expect(took >= 1.9 && took < 6.0, "the lone part failed after %.2f s", took);
        free(p1.payload);
        stria_rpc_reply_free(&p1.rep);
    }

    /* and the session serves on: a whole call of both ranks */
    const wf_call_opts_t e = {.epoch = 40};
    cr_expect_eq(wf_call_all(&f, &job, 40, &e, io), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&job, io, &ref, false, "a whole call after the parts");
    wf_io_free(io, WF_MAX);
    ref_free(&ref);
    wf_stop(&f);
}

/* ---- uploads above the payload cap --------------------------------------------- */

#define CAP (64u << 10)

Test(worker, an_upload_above_the_payload_cap_comes_in_pieces, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job;
    ref_t ref;
    wf_io_t io[WF_MAX] = {0}, held[WF_MAX] = {0};
    char want[256];
    const wf_opts_t wo = {.step_timeout_s = 5, .max_payload_bytes = CAP};
    cr_assert_eq(wf_start_with(&f, 2, &wo), STRIA_OK, "%s", stria_error_msg());
    const wf_spec_t sp = {.seq_len = 4096, .session = true, .max_held = 1};
    submit(&f, &sp, &job);
    ref_make(&ref, &job, 3);
    wf_io_inputs(&job, io, ref.q, ref.k, ref.v, ref.d_o);
    wf_io_inputs(&job, held, ref.q, ref.k, ref.v, ref.d_o);
    cr_assert_eq(wf_open_all(&f, &job), STRIA_OK, "%s", stria_error_msg());
    const int w0 = job.widx[0];
    uint64_t len = 0;
    const wf_call_opts_t fwd = {0};
    void *payload = wf_payload(&fwd, &io[0], &len);
    cr_assert_geq(len, 4 * CAP, "the inputs (%llu bytes) are not several pieces",
                  (unsigned long long)len);

    /* in one request: refused before it goes */
    cr_expect_eq(wf_request(f.wc[w0], &job, 0, 0, &fwd, 0, false, payload, len, NULL),
                 STRIA_ERR_INVALID_ARG);
    expect_msg("inputs in one request", "exceeds the server's limit");

    /* in pieces: forward, held forward, its backward (dO alone), the
     * default backward (pieces not aligned to anything) */
    wf_call_opts_t o = {.piece = CAP};
    cr_assert_eq(wf_call_all(&f, &job, 1, &o, io), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&job, io, &ref, false, "forward in pieces");
    o = (wf_call_opts_t){.piece = CAP, .hold = true};
    cr_assert_eq(wf_call_all(&f, &job, 2, &o, held), STRIA_OK, "%s", stria_error_msg());
    expect_same(&job, io, held, false, "the held forward in pieces");
    o = (wf_call_opts_t){.piece = 40000, .backward = true, .use_held = true, .held_call = 2};
    cr_assert_eq(wf_call_all(&f, &job, 3, &o, held), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&job, held, &ref, true, "held backward in pieces");
    o = (wf_call_opts_t){.piece = 40000, .backward = true};
    cr_assert_eq(wf_call_all(&f, &job, 4, &o, io), STRIA_OK, "%s", stria_error_msg());
    expect_same(&job, io, held, true, "the default backward in pieces");

    /* a set of pieces with one missing: refused naming its first byte */
    const uint64_t n_pieces = len / CAP;
    cr_assert_eq(len % CAP, 0);
    for (uint64_t i = 0; i < n_pieces; i++) {
        if (i == 1)
            continue;
        bool last = i + 1 == n_pieces;
        stria_status_t st = wf_request(f.wc[w0], &job, 0, 5, &fwd, i * CAP, !last,
                                       (char *)payload + i * CAP, CAP, NULL);
        if (!last) {
            cr_assert_eq(st, STRIA_OK, "piece %llu: %s", (unsigned long long)i, stria_error_msg());
            continue;
        }
        cr_expect_eq(st, STRIA_ERR_INVALID_ARG);
        snprintf(want, sizeof(want), "%llu of %llu bytes; the first missing byte is at %u",
                 (unsigned long long)(len - CAP), (unsigned long long)len, CAP);
        expect_msg("pieces with a gap", want);
    }
    /* a piece beyond the inputs, and a piece unlike the call's first */
    const wf_call_opts_t e6 = {.epoch = 6};
    cr_expect_eq(wf_request(f.wc[w0], &job, 0, 6, &e6, len - 100, true, payload, CAP, NULL),
                 STRIA_ERR_INVALID_ARG);
    expect_msg("a piece beyond the inputs", "lies outside the call's");
    const wf_call_opts_t e7 = {.epoch = 7}, e7h = {.epoch = 7, .hold = true};
    cr_expect_eq(wf_request(f.wc[w0], &job, 0, 7, &e7, 0, true, payload, CAP, NULL), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(
        wf_request(f.wc[w0], &job, 0, 7, &e7h, CAP, true, (char *)payload + CAP, CAP, NULL),
        STRIA_ERR_INVALID_ARG);
    expect_msg("a piece unlike the first", "a piece that differs from the call's first");
    free(payload);

    /* the session serves on */
    o = (wf_call_opts_t){.piece = CAP, .epoch = 8};
    cr_expect_eq(wf_call_all(&f, &job, 8, &o, io), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&job, io, &ref, false, "forward after refused pieces");
    wf_io_free(io, WF_MAX);
    wf_io_free(held, WF_MAX);
    ref_free(&ref);
    wf_stop(&f);
}

/* ---- drops ------------------------------------------------------------------------ */

Test(worker, drop_during_a_transfer_frees_the_job_after_it, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job, big, again;
    wf_io_t io[WF_MAX] = {0};
    start(&f, 2, 5.0);

    /* between two pieces of a call's inputs: freed at once; the next piece
     * is refused, never lands in freed memory */
    const wf_spec_t sp = {.seq_len = 64, .session = true};
    submit(&f, &sp, &job);
    const int w0 = job.widx[0], w1 = job.widx[1];
    float *q = wf_tensor(&job, 2, 1), *k = wf_tensor(&job, 1, 2), *v = wf_tensor(&job, 1, 3);
    wf_io_inputs(&job, io, q, k, v, NULL);
    cr_assert_eq(wf_open_all(&f, &job), STRIA_OK, "%s", stria_error_msg());
    const wf_call_opts_t fwd = {0};
    uint64_t len = 0;
    char *payload = wf_payload(&fwd, &io[0], &len);
    cr_assert_eq(wf_request(f.wc[w0], &job, 0, 0, &fwd, 0, true, payload, len / 2, NULL), STRIA_OK,
                 "%s", stria_error_msg());
    cr_assert_eq(wf_drop(&f, w0, &job), STRIA_OK, "%s", stria_error_msg());
    cr_expect(wf_wait_usage(&f, w0, 0, 0, 2.0), "the dropped session's memory is still held");
    cr_expect_eq(wf_request(f.wc[w0], &job, 0, 0, &fwd, len / 2, false, payload + len / 2,
                            len - len / 2, NULL),
                 STRIA_ERR_NOT_FOUND);
    expect_msg("the piece after the drop", "not held by this worker");
    cr_expect_eq(wf_drop(&f, w1, &job), STRIA_OK, "%s", stria_error_msg());
    free(payload);
    wf_io_free(io, WF_MAX);
    free(q), free(k), free(v);

    /* during a large payload: the session goes once the transfer ends. The
     * drop is timed after the request starts, later after a refusal (the
     * drop came first: not held) and earlier after a call that ran (it came
     * after the payload), until one lands during the transfer: the call is
     * then refused as closed when its payload is in */
    const wf_spec_t bs = {.seq_len = 65536, .session = true};
    double delay = 0;
    bool during = false;
    for (int attempt = 0; attempt < 16 && !during; attempt++) {
        submit(&f, &bs, &big);
        q = wf_tensor(&big, 2, 5), k = wf_tensor(&big, 1, 6), v = wf_tensor(&big, 1, 7);
        wf_io_inputs(&big, io, q, k, v, NULL);
        free(q), free(k), free(v);
        cr_assert_eq(wf_open_all(&f, &big), STRIA_OK, "%s", stria_error_msg());
        wf_bg_t bg;
        cr_assert_eq(wf_bg_start(&bg, &f, &big, 0, false, 0, &fwd, &io[0]), 0);
        while (!__atomic_load_n(&bg.sending, __ATOMIC_ACQUIRE))
            usleep(50);
        for (double until = stria_time_now() + delay; stria_time_now() < until;)
            ;
        cr_expect_eq(wf_drop(&f, w0, &big), STRIA_OK, "%s", stria_error_msg());
        stria_status_t st = wf_bg_join(&bg);
        cr_expect_neq(st, STRIA_OK, "a call of a dropped session ran");
        cr_expect(wf_wait_usage(&f, w0, 0, 0, 5.0), "the dropped session's memory is still held");
        cr_expect_eq(wf_drop(&f, w1, &big), STRIA_OK, "%s", stria_error_msg());
        cr_expect(wf_wait_usage(&f, w1, 0, 0, 5.0), "the dropped session's memory is still held");
        wf_io_free(io, WF_MAX);
        during = st == STRIA_ERR_CANCELLED && strstr(bg.msg, "is closed") != NULL;
        if (st == STRIA_ERR_NOT_FOUND)
            delay += 0.0005;
        else if (!during)
            delay /= 2;
    }
    cr_expect(during, "no drop landed during the transfer (last delay %.1f ms)", delay * 1e3);

    /* the workers keep serving: a fresh job runs */
    cr_assert_eq(wf_submit(&f, 64, 0, &again), STRIA_OK, "%s", stria_error_msg());
    ref_t ref;
    ref_make(&ref, &again, 6);
    wf_io_inputs(&again, io, ref.q, ref.k, ref.v, NULL);
    cr_assert_eq(wf_open_all(&f, &again), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(wf_call_all(&f, &again, 0, &fwd, io), STRIA_OK, "%s", stria_error_msg());
    expect_outputs(&again, io, &ref, false, "a fresh job's forward");
    wf_io_free(io, WF_MAX);
    ref_free(&ref);
    wf_stop(&f);
}

/* A session dropped while its open still binds its ring link: the open
 * ends at once (the link's connect is cancelled) instead of at the connect
 * timeout (20 s here; a chaos run saw such a pass keep dialling a worker
 * that was shutting down), and so does a call that waits for the bind.
 * UCX links; rank 1 never opens, so rank 0's bind waits. */
Test(worker, a_drop_cancels_a_pass_still_connecting, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job;
    wf_opts_t o = {.step_timeout_s = 5, .connect_timeout_s = 20, .ucx = true};
    cr_assert_eq(wf_start_with(&f, 2, &o), STRIA_OK, "%s", stria_error_msg());
    const wf_spec_t sp = {.seq_len = 64, .session = true};
    submit(&f, &sp, &job);
    wf_bg_t bg;
    cr_assert_eq(wf_bg_start(&bg, &f, &job, 0, true, 0, NULL, NULL), 0);
    cr_assert(wf_wait_running(&f, job.widx[0], 1, 5.0), "rank 0's bind did not start");
    usleep(300000); /* binding */
    /* a call sent before the open is answered waits for the bind */
    wf_io_t io[WF_MAX] = {0};
    float *q = wf_tensor(&job, 2, 1), *k = wf_tensor(&job, 1, 2), *v = wf_tensor(&job, 1, 3);
    wf_io_inputs(&job, io, q, k, v, NULL);
    const wf_call_opts_t fwd = {0};
    wf_bg_t call;
    cr_assert_eq(wf_bg_start(&call, &f, &job, 0, false, 0, &fwd, &io[0]), 0);
    cr_assert(wf_wait_running(&f, job.widx[0], 2, 5.0), "rank 0's call was not taken");
    double t0 = stria_time_now();
    cr_assert_eq(wf_drop(&f, job.widx[0], &job), STRIA_OK, "%s", stria_error_msg());
    stria_status_t st = wf_bg_join(&bg);
    double took = stria_time_now() - t0;
    cr_expect_eq(st, STRIA_ERR_CANCELLED, "%s", bg.msg);
    cr_expect(strstr(bg.msg, "cancelled") != NULL, "%s", bg.msg);
    cr_expect_lt(took, 2.0, "the open ended %.2f s after the drop", took);
    st = wf_bg_join(&call);
    took = stria_time_now() - t0;
    cr_expect_eq(st, STRIA_ERR_CANCELLED, "%s", call.msg);
    cr_expect_lt(took, 2.0, "the waiting call ended %.2f s after the drop", took);
    wf_io_free(io, WF_MAX);
    free(q), free(k), free(v);
    cr_expect(wf_wait_usage(&f, job.widx[0], 0, 0, 5), "rank 0's worker still holds the session");
    wf_stop(&f);
}

/* ---- a job and a session side by side ------------------------------------------- */

Test(worker, a_job_and_a_session_on_the_same_workers_never_mix, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job, sess;
    ref_t rj, rs;
    wf_io_t ij[WF_MAX] = {0}, is[WF_MAX] = {0};
    start(&f, 2, 5.0);
    cr_assert_eq(wf_submit(&f, 96, 0, &job), STRIA_OK, "%s", stria_error_msg());
    const wf_spec_t sp = {.seq_len = 96, .session = true, .max_held = 1};
    submit(&f, &sp, &sess);
    sess.shape.call.causal = true; /* the same shape as the job's; other inputs */
    ref_make(&rj, &job, 1);
    ref_make(&rs, &sess, 101);
    wf_io_inputs(&job, ij, rj.q, rj.k, rj.v, rj.d_o);
    wf_io_inputs(&sess, is, rs.q, rs.k, rs.v, rs.d_o);
    cr_assert_eq(wf_open_all(&f, &job), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(wf_open_all(&f, &sess), STRIA_OK, "%s", stria_error_msg());
    /* both calls of both on every rank at once, each on a connection of its own */
    for (int pass = 0; pass < 2; pass++) {
        const wf_call_opts_t fo = {.hold = true}, bo = {.backward = true, .use_held = true};
        const wf_call_opts_t *o = pass == 0 ? &fo : &bo;
        wf_bg_t bg[2][WF_MAX];
        for (int r = 0; r < job.n; r++) {
            cr_assert_eq(wf_bg_start(&bg[0][r], &f, &job, r, false, (uint64_t)pass, o, &ij[r]), 0);
            cr_assert_eq(wf_bg_start(&bg[1][r], &f, &sess, r, false, (uint64_t)pass, o, &is[r]), 0);
        }
        for (int r = 0; r < job.n; r++) {
            cr_expect_eq(wf_bg_join(&bg[0][r]), STRIA_OK, "job rank %d: %s", r, bg[0][r].msg);
            cr_expect_eq(wf_bg_join(&bg[1][r]), STRIA_OK, "session rank %d: %s", r, bg[1][r].msg);
        }
        expect_outputs(&job, ij, &rj, pass == 1, "the job's");
        expect_outputs(&sess, is, &rs, pass == 1, "the session's");
    }
    wf_io_free(ij, WF_MAX);
    wf_io_free(is, WF_MAX);
    ref_free(&rj), ref_free(&rs);
    wf_stop(&f);
}

/* ---- stopping ----------------------------------------------------------------------- */

Test(worker, stop_with_a_job_held_and_a_pass_running, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t held, lone, later;
    wf_io_t io[WF_MAX] = {0}, lio[WF_MAX] = {0};
    start(&f, 2, 0.3);
    cr_assert_eq(wf_submit(&f, 64, 0, &held), STRIA_OK, "%s", stria_error_msg());
    float *q = wf_tensor(&held, 2, 1), *k = wf_tensor(&held, 1, 2), *v = wf_tensor(&held, 1, 3);
    wf_io_inputs(&held, io, q, k, v, q);
    wf_io_inputs(&held, lio, q, k, v, NULL);
    cr_assert_eq(wf_open_all(&f, &held), STRIA_OK, "%s", stria_error_msg());
    const wf_call_opts_t hold = {.hold = true};
    cr_assert_eq(wf_call_all(&f, &held, 0, &hold, io), STRIA_OK, "%s", stria_error_msg());
    /* a second job whose rank 0 calls alone: the shutdown gives it one step
     * deadline (1 s), by which it failed or is aborted */
    cr_assert_eq(wf_submit(&f, 64, 1000, &lone), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(wf_submit(&f, 64, 0, &later), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(wf_open_all(&f, &lone), STRIA_OK, "%s", stria_error_msg());
    int w0 = lone.widx[0];
    wf_bg_t bg;
    const wf_call_opts_t fwd = {0};
    cr_assert_eq(wf_bg_start(&bg, &f, &lone, 0, false, 0, &fwd, &lio[0]), 0);
    cr_assert(wf_wait_running(&f, w0, 1, 2.0), "rank 0's call did not start");
    stria_worker_usage_t u;
    stria_worker_usage(f.w[w0], &u);
    cr_expect_eq(u.jobs, 2);
    double t0 = stria_time_now();
    int still = stria_worker_shutdown(f.w[w0], "shut down (test)");
    cr_expect_eq(still, 0, "a call survived the abort");
    cr_expect_lt(stria_time_now() - t0, 10.0);
    cr_expect_neq(wf_bg_join(&bg), STRIA_OK, "a lone rank's call succeeded");
    /* new work is refused while the server still answers */
    const wf_call_opts_t bwd = {.backward = true, .use_held = true};
    int r0 = held.widx[0] == w0 ? 0 : 1;
    cr_expect_eq(wf_call_rank(&f, &held, r0, 1, &bwd, &io[r0]), STRIA_ERR_BUSY);
    expect_msg("a call during the shutdown", "shutting down");
    r0 = later.widx[0] == w0 ? 0 : 1;
    cr_expect_eq(wf_open(&f, &later, r0), STRIA_ERR_BUSY);
    expect_msg("an open during the shutdown", "shutting down");
    stria_worker_stop(f.w[w0]);
    f.w[w0] = NULL;
    stria_rpc_client_close(f.wc[w0]);
    f.wc[w0] = NULL;
    wf_io_free(io, WF_MAX);
    wf_io_free(lio, WF_MAX);
    free(q), free(k), free(v);
    wf_stop(&f); /* the other worker, with its rank of the held job */
}

/* A session failed for a cause outside it (one of its workers shut down
 * before the other rank opened): the open on the other worker is refused
 * as over, and marked retryable (libstria then opens the session anew);
 * a session cancelled for good is refused without the mark. */
Test(worker, an_open_of_a_session_lost_to_a_leaving_worker_is_retryable, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t lost, gone;
    start(&f, 2, 0.3);
    const wf_spec_t sp = {.seq_len = 64, .session = true};
    cr_assert_eq(wf_submit_spec(&f, &sp, &gone), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(wf_release(&f, &gone), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(wf_open(&f, &gone, 0), STRIA_ERR_CANCELLED, "%s", stria_error_msg());
    cr_expect(!stria_error_retryable(), "a released session's open is retryable: %s",
              stria_error_msg());

    cr_assert_eq(wf_submit_spec(&f, &sp, &lost), STRIA_OK, "%s", stria_error_msg());
    int w1 = lost.widx[1];
    cr_expect_eq(stria_worker_shutdown(f.w[w1], "shut down (test)"), 0);
    stria_worker_stop(f.w[w1]);
    f.w[w1] = NULL;
    stria_rpc_client_close(f.wc[w1]);
    f.wc[w1] = NULL;
    cr_expect_eq(wf_open(&f, &lost, 0), STRIA_ERR_CANCELLED, "%s", stria_error_msg());
    expect_msg("the open of a session whose worker left", "is over");
    cr_expect(stria_error_retryable(), "not retryable: %s", stria_error_msg());
    wf_stop(&f);
}
