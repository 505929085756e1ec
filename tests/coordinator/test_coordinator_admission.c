/* Coordinator suite, admission and queueing: spec validation, room on the
 * workers, the assignment of ranks, the queue in order on shared workers and
 * jobs side by side on disjoint ones, resent submissions, drained workers. */
#include <criterion/criterion.h>

#include "coord_test_util.h"

/* ---- admission ----------------------------------------------------------- */

typedef struct {
    const char *what;
    void (*mutate)(Stria__V1__JobSpec *s);
    const char *msg;
} bad_spec_t;

static void m_batch0(Stria__V1__JobSpec *s)
{
    s->batch = 0;
}
static void m_seq0(Stria__V1__JobSpec *s)
{
    s->seq_len = 0;
}
static void m_seq_huge(Stria__V1__JobSpec *s)
{
    s->seq_len = (uint64_t)1 << 62;
}
static void m_heads0(Stria__V1__JobSpec *s)
{
    s->heads = 0;
}
static void m_kv_not_div(Stria__V1__JobSpec *s)
{
    s->heads = 6, s->kv_heads = 4;
}
static void m_kv_more(Stria__V1__JobSpec *s)
{
    s->kv_heads = 8;
}
static void m_dim12(Stria__V1__JobSpec *s)
{
    s->head_dim = 12;
}
static void m_dim_odd(Stria__V1__JobSpec *s)
{
    s->head_dim = 68;
}
static void m_dim_big(Stria__V1__JobSpec *s)
{
    s->head_dim = 512;
}
static void m_dtype(Stria__V1__JobSpec *s)
{
    s->dtype = 7;
}
static void m_layout(Stria__V1__JobSpec *s)
{
    s->layout = 9;
}
static void m_scale_nan(Stria__V1__JobSpec *s)
{
    s->scale = NAN;
}
static void m_scale_neg(Stria__V1__JobSpec *s)
{
    s->scale = -1;
}
static void m_ttl(Stria__V1__JobSpec *s)
{
    s->ttl_s = 100000000;
}
static void m_short_seq(Stria__V1__JobSpec *s)
{
    s->seq_len = 1;
}

static int64_t cu_bad_start[] = {1, 1024}, cu_bad_end[] = {0, 17, 1000},
               cu_decreasing[] = {0, 300, 17, 1024}, cu_past_end[] = {0, 2048};
static int64_t cu_too_many[STRIA_COORD_MAX_CU_SEQLENS + 1];
static Stria__V1__JobSpec__Window
    win_left_bad = {PROTOBUF_C_MESSAGE_INIT(&stria__v1__job_spec__window__descriptor), -2, 0},
    win_right_bad = {PROTOBUF_C_MESSAGE_INIT(&stria__v1__job_spec__window__descriptor), 5, -7},
    win_causal_right = {PROTOBUF_C_MESSAGE_INIT(&stria__v1__job_spec__window__descriptor), 5, 1};

static void m_cu_start(Stria__V1__JobSpec *s)
{
    s->cu_seqlens = cu_bad_start, s->n_cu_seqlens = 2;
}

static void m_cu_end(Stria__V1__JobSpec *s)
{
    s->cu_seqlens = cu_bad_end, s->n_cu_seqlens = 3;
}

static void m_cu_dec(Stria__V1__JobSpec *s)
{
    s->cu_seqlens = cu_decreasing, s->n_cu_seqlens = 4;
}

static void m_cu_past(Stria__V1__JobSpec *s)
{
    s->cu_seqlens = cu_past_end, s->n_cu_seqlens = 2;
}

static void m_cu_many(Stria__V1__JobSpec *s)
{
    for (size_t i = 0; i <= STRIA_COORD_MAX_CU_SEQLENS; i++)
        cu_too_many[i] = (int64_t)(i * 1024 / STRIA_COORD_MAX_CU_SEQLENS);
    s->cu_seqlens = cu_too_many, s->n_cu_seqlens = STRIA_COORD_MAX_CU_SEQLENS + 1;
}

static void m_win_left(Stria__V1__JobSpec *s)
{
    s->window = &win_left_bad;
}

static void m_win_right(Stria__V1__JobSpec *s)
{
    s->window = &win_right_bad;
}

static void m_win_causal(Stria__V1__JobSpec *s)
{
    s->window = &win_causal_right;
}
static void m_group_past(Stria__V1__JobSpec *s)
{
    s->head_group = 2, s->head_groups = 2, s->head_group_tag = 9;
}
static void m_groups_many(Stria__V1__JobSpec *s)
{
    s->head_group = 0, s->head_groups = 65, s->head_group_tag = 9;
}
static void m_group_untagged(Stria__V1__JobSpec *s)
{
    s->head_group = 0, s->head_groups = 2, s->head_group_tag = 0;
}

Test(coord, nonsense_specs_are_refused, .timeout = TEST_TIMEOUT_S)
{
    static const bad_spec_t cases[] = {
        {"batch 0", m_batch0, "batch must be"},
        {"seq_len 0", m_seq0, "seq_len must be"},
        {"huge seq_len", m_seq_huge, "seq_len must be 1..1099511627776"},
        {"heads 0", m_heads0, "heads must be"},
        {"heads % kv_heads", m_kv_not_div, "heads (6) must be a multiple of kv_heads (4)"},
        {"kv_heads > heads", m_kv_more, "kv_heads must be 1..heads"},
        {"head_dim 12", m_dim12, "head_dim must be"},
        {"head_dim 68", m_dim_odd, "head_dim must be"},
        {"head_dim 512", m_dim_big, "head_dim must be"},
        {"dtype 7", m_dtype, "dtype 7"},
        {"layout 9", m_layout, "layout 9"},
        {"scale NaN", m_scale_nan, "scale must be finite"},
        {"scale < 0", m_scale_neg, "scale must be finite"},
        {"ttl", m_ttl, "ttl_s"},
        {"seq shorter than ring", m_short_seq, "without tokens"},
        {"cu_seqlens from 1", m_cu_start, "cu_seqlens must start at 0 (got 1)"},
        {"cu_seqlens short", m_cu_end, "cu_seqlens must end at seq_len (1024) (got 1000)"},
        {"cu_seqlens decreasing", m_cu_dec,
         "cu_seqlens must not decrease (entry 2 is 17 after 300)"},
        {"cu_seqlens long", m_cu_past, "cu_seqlens must end at seq_len (1024) (got 2048)"},
        {"cu_seqlens too many", m_cu_many,
         "cu_seqlens has 65537 entries, more than the limit of 65536"},
        {"window left -2", m_win_left, "window.left must be >= -1"},
        {"window right -7", m_win_right, "window.right must be >= -1 (-1: unbounded) (got -7)"},
        {"causal window right 1", m_win_causal, "window.right must be 0 or -1 with causal"},
        {"head group 2 of 2", m_group_past, "head_group 2 of head_groups 2 (tag 9)"},
        {"head groups 65", m_groups_many, "head_groups 65 (tag 9): the groups are at most 64"},
        {"head groups untagged", m_group_untagged, "the tag nonzero"},
    };
    fx_t fx;
    stria_rpc_reply_t rep;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    reg_worker(&fx, "h", 7000, 1ull << 34);
    reg_worker(&fx, "h", 7001, 1ull << 34);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        Stria__V1__JobSpec s = spec_default();
        cases[i].mutate(&s);
        cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_INVALID_ARG, "%s accepted", cases[i].what);
        cr_expect(strstr(stria_error_msg(), cases[i].msg) != NULL, "%s: '%s'", cases[i].what,
                  stria_error_msg());
    }
    Stria__V1__SubmitJobRequest empty = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    cr_expect_eq(fx_call(fx.cl, M_SUBMIT, &empty.base, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "spec is missing") != NULL, "%s", stria_error_msg());
    /* Still serving. */
    Stria__V1__JobSpec s = spec_default();
    submit_ok(&fx, &s, JS(LOADING));
    fx_stop(&fx);
}

Test(coord, too_few_workers_or_too_little_memory, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    Stria__V1__JobSpec s = spec_default();
    fx_start(&fx, 1.0, 60, NULL, NULL);
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "0 are available") != NULL, "%s", stria_error_msg());
    reg_worker(&fx, "h", 7000, mem_default(2));
    reg_worker(&fx, "h", 7001, mem_default(2));
    s.ring_size = 3;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "needs 3 workers but 2 are available (2 healthy") != NULL,
              "%s", stria_error_msg());
    /* Fits on two ranks, not on one. */
    s.ring_size = 1;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_NO_MEMORY);
    cr_expect(strstr(stria_error_msg(), "MiB per rank") != NULL, "%s", stria_error_msg());
    s.ring_size = 0;
    s.batch = 64;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_NO_MEMORY);
    cr_expect(strstr(stria_error_msg(), "use a larger ring") != NULL, "%s", stria_error_msg());
    /* Astronomical: the estimate itself overflows. */
    s.batch = 65536;
    s.heads = s.kv_heads = 65536;
    s.head_dim = 256;
    s.seq_len = (uint64_t)1 << 40;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_NO_MEMORY, "%s", stria_error_msg());
    /* Exactly the workers' memory: admitted at once, even when it may not
     * queue; then nothing is free, and a job that may not queue is refused. */
    s = spec_default();
    s.no_queue = true;
    submit_ok(&fx, &s, JS(LOADING));
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "no_queue is set") != NULL, "%s", stria_error_msg());
    fx_stop(&fx);
}

Test(coord, assignment_stripes_and_defaults, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    Stria__V1__JobSpec s = spec_default();
    fx_start(&fx, 1.0, 77, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    s.seq_len = 11;
    s.label = (char *)"layer 3";
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__Assignment *as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    cr_assert_eq(as->n_ranks, 2);
    cr_expect_eq(as->spec->ring_size, 2);
    cr_expect_eq(as->spec->ttl_s, 77);
    cr_expect_float_eq(as->spec->scale, 0.125f, 1e-7);
    cr_expect_str_eq(as->spec->label, "layer 3");
    cr_expect_eq(as->spec->layout, STRIA__V1__LAYOUT__LAYOUT_STRIPED);
    cr_expect_eq(as->max_tokens_per_rank, 6, "11 tokens on 2 ranks pad to 6 each");
    cr_expect_gt(as->memory_per_rank_bytes, 0);
    /* Rank r holds r, r + 2, ...: 6 real tokens on rank 0, 5 on rank 1. */
    const uint64_t want_tokens[2] = {6, 5};
    const uint64_t want_worker[2] = {a.id, b.id};
    for (uint32_t r = 0; r < 2; r++) {
        Stria__V1__RankAssignment *ra = as->ranks[r];
        uint64_t sum = 0;
        cr_expect_eq(ra->rank, r);
        cr_expect_eq(ra->worker_id, want_worker[r]);
        cr_expect_eq(ra->tokens, want_tokens[r]);
        cr_expect_str_eq(ra->rpc_address, r == 0 ? "127.0.0.1:7000" : "127.0.0.1:7001");
        cr_expect_str_eq(ra->ucx_address, r == 0 ? "127.0.0.1:7100" : "127.0.0.1:7101");
        cr_assert_geq(ra->n_runs, 1);
        cr_expect_eq(ra->runs[0]->first, r);
        cr_expect_eq(ra->runs[0]->stride, 2);
        for (size_t k = 0; k < ra->n_runs; k++)
            sum += ra->runs[k]->count;
        cr_expect_eq(sum, ra->tokens);
    }
    cr_expect_eq(as->spec->n_cu_seqlens, 0);
    cr_expect_null(as->spec->window);
    stria_rpc_reply_free(&rep);
    /* Documents and a window travel in the assignment (and GetJob), not in
     * ListJobs. */
    static int64_t cu[] = {0, 1, 5, 5, 11};
    Stria__V1__JobSpec__Window win = STRIA__V1__JOB_SPEC__WINDOW__INIT;
    win.left = 3;
    win.right = -1;
    s.cu_seqlens = cu;
    s.n_cu_seqlens = 5;
    s.window = &win;
    s.causal = false;
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    uint64_t masked_id = as->job_id;
    cr_assert_eq(as->spec->n_cu_seqlens, 5);
    for (size_t i = 0; i < 5; i++)
        cr_expect_eq(as->spec->cu_seqlens[i], cu[i]);
    cr_assert_not_null(as->spec->window);
    cr_expect_eq(as->spec->window->left, 3);
    cr_expect_eq(as->spec->window->right, -1);
    stria_rpc_reply_free(&rep);
    /* auto: contiguous with a window; packed with documents on workers of
     * host memory (these say "cpu"); striped without either; the assignment
     * (what workers and the client see) names the layout chosen. */
    s.layout = STRIA__V1__LAYOUT__LAYOUT_AUTO;
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    cr_expect_eq(as->spec->layout, STRIA__V1__LAYOUT__LAYOUT_CONTIGUOUS);
    cr_expect_eq(as->ranks[1]->runs[0]->first, 6, "contiguous: rank 1 starts at token 6");
    stria_rpc_reply_free(&rep);
    s.window = NULL;
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    cr_expect_eq(as->spec->layout, STRIA__V1__LAYOUT__LAYOUT_PACKED);
    cr_expect_eq(as->ranks[1]->runs[0]->first, 1, "packed shards are sized as striped ones");
    cr_expect_eq(as->ranks[1]->tokens, 5);
    stria_rpc_reply_free(&rep);
    s.cu_seqlens = NULL;
    s.n_cu_seqlens = 0;
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    cr_expect_eq(as->spec->layout, STRIA__V1__LAYOUT__LAYOUT_STRIPED);
    stria_rpc_reply_free(&rep);
    s.cu_seqlens = cu;
    s.n_cu_seqlens = 5;
    s.window = &win;
    s.layout = STRIA__V1__LAYOUT__LAYOUT_STRIPED;
    Stria__V1__JobInfo *info = get_job(&fx, masked_id, &rep);
    cr_assert_not_null(info);
    cr_expect_eq(info->assignment->spec->n_cu_seqlens, 5);
    cr_expect_eq(info->assignment->spec->cu_seqlens[3], 5);
    cr_expect_eq(info->assignment->spec->window->left, 3);
    stria_rpc_reply_free(&rep);
    Stria__V1__ListJobsRequest lreq = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    cr_assert_eq(fx_call(fx.cl, M_LIST_JOBS, &lreq.base, &rep), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__ListJobsReply *lr = (Stria__V1__ListJobsReply *)rep.msg;
    bool listed = false;
    for (size_t i = 0; i < lr->n_jobs; i++)
        if (lr->jobs[i]->job_id == masked_id) {
            listed = true;
            cr_expect_eq(lr->jobs[i]->assignment->spec->n_cu_seqlens, 0, "ListJobs sent documents");
            cr_expect_not_null(lr->jobs[i]->assignment->spec->window);
        }
    cr_expect(listed, "job %llu not listed", (unsigned long long)masked_id);
    stria_rpc_reply_free(&rep);
    s.cu_seqlens = NULL;
    s.n_cu_seqlens = 0;
    s.window = NULL;
    s.causal = true;
    /* Zigzag: two runs per rank. */
    s.layout = STRIA__V1__LAYOUT__LAYOUT_ZIGZAG;
    s.seq_len = 16;
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK, "%s", stria_error_msg());
    as = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    cr_expect_eq(as->ranks[0]->n_runs, 2);
    cr_expect_eq(as->ranks[0]->runs[0]->first, 0);
    cr_expect_eq(as->ranks[0]->runs[1]->first, 12);
    cr_expect_eq(as->ranks[1]->runs[0]->first, 4);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

/* ---- queueing ------------------------------------------------------------ */

Test(coord, jobs_queue_in_order_on_shared_workers, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    uint64_t m = mem_default(2);
    fx_start(&fx, 1.0, 60, NULL, NULL);
    /* Room for one default job and a bit: 1.7x its need. */
    reg_worker(&fx, "h", 7000, m + m * 7 / 10);
    reg_worker(&fx, "h", 7001, m + m * 7 / 10);
    Stria__V1__JobSpec s = spec_default();
    uint64_t ja = submit_ok(&fx, &s, JS(LOADING));
    cr_assert_eq(submit(&fx, &s, &rep), STRIA_OK);
    Stria__V1__SubmitJobReply *r = (Stria__V1__SubmitJobReply *)rep.msg;
    uint64_t jb = r->assignment->job_id;
    cr_expect_eq(r->state, JS(PENDING));
    cr_expect_eq(r->queue_position, 1);
    stria_rpc_reply_free(&rep);
    /* A smaller job would fit now, but must not overtake the queued one. */
    Stria__V1__JobSpec small = spec_default();
    small.seq_len = 512;
    uint64_t jc = submit_ok(&fx, &small, JS(PENDING));
    Stria__V1__JobInfo *info = get_job(&fx, jc, &rep);
    cr_expect_eq(info->queue_position, 2);
    stria_rpc_reply_free(&rep);
    /* no_queue refuses instead of waiting. */
    s.no_queue = true;
    cr_expect_eq(submit(&fx, &s, &rep), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "no_queue") != NULL, "%s", stria_error_msg());
    /* Releasing the first starts the queued ones that now fit, in order. */
    cr_expect_eq(release(&fx, ja), STRIA_OK);
    cr_expect_eq(job_state(&fx, ja), JS(RELEASED));
    cr_expect_eq(job_state(&fx, jb), JS(LOADING));
    cr_expect_eq(job_state(&fx, jc), JS(LOADING), "b (1.0) and c (0.5) fit in 1.7 together");
    cr_expect_eq(release(&fx, ja), STRIA_OK, "release is idempotent");
    cr_expect_eq(release(&fx, 999), STRIA_ERR_NOT_FOUND);
    fx_stop(&fx);
}

/* A coordinator with four workers on two hosts, each with room for one
 * two-rank job of the default spec (which *s becomes, with ring size 2). */
static void fx_start_two_hosts(fx_t *fx, wk_t w[4], Stria__V1__JobSpec *s)
{
    uint64_t m = mem_default(2);
    fx_start(fx, 1.0, 60, NULL, NULL);
    for (int i = 0; i < 4; i++)
        w[i] = reg_worker(fx, i < 2 ? "host-0" : "host-1", 7000 + i, m + m / 2);
    *s = spec_default();
    s->ring_size = 2;
}

/* A submission sent again with its key (its reply was lost with the
 * connection) gets the job its first copy made, its secret sealed again; a
 * new key makes a new job; a key of another size is refused. */
Test(coord, a_resent_submission_gets_its_first_job, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    uint8_t key[16];
    uint64_t ids[3];
    stria_job_secret_t secrets[3];
    fx_start(&fx, 1.0, 60, NULL, NULL);
    reg_worker(&fx, "h", 7000, 1ull << 30);
    reg_worker(&fx, "h", 7001, 1ull << 30);
    Stria__V1__JobSpec s = spec_default();
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    req.spec = &s;
    memset(key, 7, sizeof(key));
    req.submit_key.data = key;
    req.submit_key.len = sizeof(key);
    for (int i = 0; i < 3; i++) {
        if (i == 2)
            key[0] ^= 1; /* another submission */
        cr_assert_eq(fx_call(fx.user, M_SUBMIT, &req.base, &rep), STRIA_OK, "%s",
                     stria_error_msg());
        const Stria__V1__SubmitJobReply *r = (const Stria__V1__SubmitJobReply *)rep.msg;
        ids[i] = r->assignment->job_id;
        cr_expect_eq(stria_auth_open(&rep.session, "job secret", ids[i], r->job_secret.data,
                                     r->job_secret.len, secrets[i].bytes),
                     STRIA_OK, "submission %d: the secret does not open", i);
        stria_rpc_reply_free(&rep);
    }
    cr_expect_eq(ids[1], ids[0], "the resend made job %llu beside job %llu",
                 (unsigned long long)ids[1], (unsigned long long)ids[0]);
    cr_expect_eq(memcmp(secrets[1].bytes, secrets[0].bytes, sizeof(secrets[0].bytes)), 0);
    cr_expect_neq(ids[2], ids[0], "a new key made no new job");
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    cr_assert_eq(fx_call(fx.cl, M_STATUS, &gs.base, &rep), STRIA_OK);
    cr_expect_eq(((const Stria__V1__GetStatusReply *)rep.msg)->jobs_submitted, 2u);
    stria_rpc_reply_free(&rep);
    req.submit_key.len = 5;
    cr_expect_eq(fx_call(fx.user, M_SUBMIT, &req.base, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "submit_key has 5 bytes") != NULL, "%s", stria_error_msg());
    fx_stop(&fx);
}

Test(coord, jobs_on_disjoint_workers_run_together, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[4];
    Stria__V1__JobSpec s;
    fx_start_two_hosts(&fx, w, &s);
    uint64_t ja = submit_ok(&fx, &s, JS(LOADING));
    uint64_t jb = submit_ok(&fx, &s, JS(LOADING));
    uint64_t jc = submit_ok(&fx, &s, JS(PENDING));
    Stria__V1__JobInfo *ia = get_job(&fx, ja, &rep);
    cr_expect_eq(ia->assignment->ranks[0]->worker_id, w[0].id);
    cr_expect_eq(ia->assignment->ranks[1]->worker_id, w[1].id);
    stria_rpc_reply_free(&rep);
    Stria__V1__JobInfo *ib = get_job(&fx, jb, &rep);
    cr_expect_eq(ib->assignment->ranks[0]->worker_id, w[2].id, "one host's workers together");
    cr_expect_eq(ib->assignment->ranks[1]->worker_id, w[3].id);
    stria_rpc_reply_free(&rep);

    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    cr_assert_eq(fx_call(fx.cl, M_STATUS, &gs.base, &rep), STRIA_OK);
    Stria__V1__GetStatusReply *st = (Stria__V1__GetStatusReply *)rep.msg;
    cr_expect_eq(st->jobs_active, 2);
    cr_expect_eq(st->jobs_pending, 1);
    cr_expect_eq(st->workers_healthy, 4);
    cr_expect_eq(st->jobs_submitted, 3);
    cr_expect_str_eq(st->software_version, STRIA_VERSION);
    cr_expect_eq(st->protocol_version, STRIA_RPC_VERSION);
    stria_rpc_reply_free(&rep);

    /* c waits for the workers of a (the least loaded window when it came). */
    cr_expect_eq(release(&fx, jb), STRIA_OK);
    cr_expect_eq(job_state(&fx, jc), JS(PENDING));
    cr_expect_eq(release(&fx, ja), STRIA_OK);
    cr_expect_eq(job_state(&fx, jc), JS(LOADING));
    fx_stop(&fx);
}

/* Draining a worker fails the jobs queued on it (their workers were bound at
 * submission; a drained worker must run down), with a reason that says to
 * submit again; its running job and the queued jobs on other workers stay. */
Test(coord, drain_fails_the_jobs_queued_on_the_worker, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[4];
    Stria__V1__JobSpec s;
    fx_start_two_hosts(&fx, w, &s);
    uint64_t ja = submit_ok(&fx, &s, JS(LOADING));
    uint64_t jb = submit_ok(&fx, &s, JS(LOADING));
    uint64_t jc = submit_ok(&fx, &s, JS(PENDING)); /* waits for a's workers */
    uint64_t jd = submit_ok(&fx, &s, JS(PENDING)); /* b's */
    Stria__V1__JobInfo *ic = get_job(&fx, jc, &rep);
    uint64_t c0 = ic->assignment->ranks[0]->worker_id, c1 = ic->assignment->ranks[1]->worker_id;
    stria_rpc_reply_free(&rep);
    cr_assert(c0 == w[0].id || c1 == w[0].id || c0 == w[2].id || c1 == w[2].id);
    uint64_t drained = c0; /* a worker of c, busy with a or b */

    Stria__V1__DrainWorkerRequest dw = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    dw.worker_id = drained;
    dw.drain = true;
    cr_assert_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    ic = get_job(&fx, jc, &rep);
    cr_expect_eq(ic->state, JS(FAILED));
    cr_expect(strstr(ic->failure, "was drained while the job was queued: submit it again") != NULL,
              "%s", ic->failure);
    cr_expect(ic->failure_retryable);
    cr_expect(ic->n_blamed_worker_ids == 1 && ic->blamed_worker_ids[0] == drained);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(job_state(&fx, ja), JS(LOADING), "a running job keeps its drained worker");
    cr_expect_eq(job_state(&fx, jb), JS(LOADING));
    cr_expect_eq(job_state(&fx, jd), JS(PENDING), "a job queued on other workers stays queued");
    fx_stop(&fx);
}
