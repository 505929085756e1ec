/* Sessions' co-located arenas, with real processes on loopback: a
 * coordinator and two workers with runtime directories (so Unix sockets).
 * Whole-sequence calls through the arena equal the in-process ring bit for
 * bit and fault no page on the workers; a sharded trainer that builds its
 * tensors in the arena (stria_session_buffer) gets the same bits; arenas
 * that are unsealed, holed, oversized, on hugetlbfs or offered without the
 * session's secret are refused, and the worker serves the session on. */
#include <criterion/criterion.h>

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "proc.h"
#include "stria.pb-c.h"
#include "stria_client.h"
#include "stria_methods.h"
#include "stria_ring.h"
#include "stria_rpc.h"
#include "stria_shm.h"
#include "tcluster.h"
#include "tref.h"

#define N 2

static tcluster_t cl;

static char *const env[] = {"UCX_HANDLE_ERRORS=none", "UCX_TLS=tcp,sm,self", NULL};

static void start_cluster(void)
{
    tcl_init(&cl, "arena", env);
    char *cargv[] = {STRIA_COORDINATOR_BIN, "--listen", "127.0.0.1:0",
                     "--heartbeat-period",  "0.5",      NULL};
    tcl_start_coordinator(&cl, cargv);
    for (int i = 0; i < N; i++) {
        char *argv[] = {STRIA_WORKER_BIN,
                        "--coordinator",
                        cl.coord_addr,
                        "--threads",
                        "1",
                        "--memory",
                        "1G",
                        "--step-timeout",
                        "10",
                        "--listen",
                        "127.0.0.1:0",
                        "--ucx-listen",
                        "127.0.0.1:0",
                        "--runtime-dir",
                        cl.dir,
                        NULL};
        tcl_start_worker(&cl, i, argv);
    }
    /* both registered: a session of 2 opens */
    for (int t = 0; t < 100; t++) {
        stria_client_params_t cp = STRIA_CLIENT_PARAMS_INIT;
        cp.coordinator = cl.coord_addr;
        stria_client_t *c = NULL;
        if (stria_client_connect(&cp, &c) == STRIA_OK) {
            stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
            sp.max_batch = 1, sp.max_seq_len = 64, sp.heads = 1, sp.head_dim = 16;
            sp.ring_size = N, sp.no_queue = true;
            stria_session_t *s = NULL;
            stria_status_t st = stria_session_open(c, &sp, &s);
            stria_session_close(s);
            stria_client_close(c);
            if (st == STRIA_OK)
                return;
        }
        usleep(100000);
    }
    cr_assert_fail("the workers did not register");
}

static void stop_cluster(void)
{
    tcl_stop(&cl);
}

static stria_client_t *client(stria_data_path_t path)
{
    stria_client_params_t cp = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *c = NULL;
    cp.coordinator = cl.coord_addr;
    cp.data_path = path;
    cr_assert_eq(stria_client_connect(&cp, &c), STRIA_OK, "%s", stria_error_msg());
    return c;
}

#define S   128
#define H   2
#define HKV 1
#define D   32

typedef struct {
    float q[S * H * D], k[S * HKV * D], v[S * HKV * D], d_o[S * H * D];
    float o[S * H * D], lse[H * S], dq[S * H * D], dk[S * HKV * D], dv[S * HKV * D];
} io_t;

static void fill(float *x, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
}

/* The in-process ring's results for x's inputs, causal, fp32. */
static void reference(io_t *x, int64_t seq)
{
    stria_ring_shape_t shape = {.call = {.batch = 1, .seq_len = seq, .causal = true},
                                .heads = H,
                                .kv_heads = HKV,
                                .head_dim = D,
                                .dtype = STRIA_DTYPE_F32};
    stria_ring_local_opts_t lo = {
        .layout = STRIA_LAYOUT_STRIPED, .n_ranks = N, .passes = STRIA_RING_PASS_FWD_BWD};
    void *const out[TJ_N_OUT] = {x->o, x->lse, x->dq, x->dk, x->dv};
    cr_assert_eq(tref_ring_run(&shape, &lo, x->q, x->k, x->v, x->d_o, out, NULL), STRIA_OK, "%s",
                 stria_error_msg());
}

static io_t *inputs(unsigned seed)
{
    io_t *x = calloc(1, sizeof(*x));
    fill(x->q, S * H * D, seed);
    fill(x->k, S * HKV * D, seed + 1);
    fill(x->v, S * HKV * D, seed + 2);
    fill(x->d_o, S * H * D, seed + 3);
    return x;
}

static stria_session_spec_t spec(bool sharded)
{
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    sp.max_batch = 1, sp.max_seq_len = S, sp.heads = H, sp.kv_heads = HKV, sp.head_dim = D;
    sp.dtype = STRIA_DTYPE_F32, sp.ring_size = N, sp.sharded = sharded;
    sp.layout = STRIA_LAYOUT_STRIPED;
    return sp;
}

Test(arena, whole_calls_have_the_rings_bits_and_fault_nothing, .timeout = 120)
{
    start_cluster();
    stria_client_t *c = client(STRIA_DATA_PATH_SHM); /* the arena or nothing */
    stria_session_spec_t sp = spec(false);
    stria_session_t *s = NULL;
    cr_assert_eq(stria_session_open(c, &sp, &s), STRIA_OK, "%s", stria_error_msg());
    io_t *x = inputs(7), *r = inputs(7);
    /* three lengths in turn, a padded shard among them; the workers' pools
     * and heaps settle within the first hundred or so calls (then no call
     * faults a page: measured over 3000) */
    const int64_t lens[3] = {S, 100, 64};
    int warm = 0, faulting = 0; /* of the last 60 calls */
    for (int i = 0; i < 300; i++) {
        int64_t seq = lens[i % 3];
        stria_call_t call = STRIA_CALL_INIT;
        call.batch = 1, call.seq_len = seq, call.causal = true;
        cr_assert_eq(stria_session_forward(s, &call, x->q, x->k, x->v, x->o, x->lse), STRIA_OK,
                     "%s", stria_error_msg());
        cr_assert_eq(stria_session_backward(s, &call, x->q, x->k, x->v, x->o, x->lse, x->d_o, x->dq,
                                            x->dk, x->dv),
                     STRIA_OK, "%s", stria_error_msg());
        if (i >= 240) {
            stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
            cr_assert_eq(stria_session_stats(s, &st), STRIA_OK);
            warm++;
            faulting += st.last_minflt > 0;
            cr_expect_eq(st.bytes_up, 0, "%llu input bytes went over TCP",
                         (unsigned long long)st.bytes_up);
        }
        if (i >= 297) { /* every length, once warm */
            reference(r, seq);
            cr_expect_eq(memcmp(x->o, r->o, (size_t)(seq * H * D) * 4), 0, "O, seq %lld",
                         (long long)seq);
            cr_expect_eq(memcmp(x->lse, r->lse, (size_t)(seq * H) * 4), 0, "LSE");
            cr_expect_eq(memcmp(x->dq, r->dq, (size_t)(seq * H * D) * 4), 0, "dQ");
            cr_expect_eq(memcmp(x->dk, r->dk, (size_t)(seq * HKV * D) * 4), 0, "dK");
            cr_expect_eq(memcmp(x->dv, r->dv, (size_t)(seq * HKV * D) * 4), 0, "dV");
        }
    }
#if !defined(__SANITIZE_ADDRESS__) /* its allocator does not reuse freed memory at once */
    /* a call that took fresh memory would fault on every call; a loaded
     * machine reclaiming a page now and then faults on a few */
    cr_expect_leq(faulting, 3, "the workers faulted pages in %d of %d warm calls", faulting, warm);
#else
    (void)warm, (void)faulting;
#endif
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    free(x);
    free(r);
    stria_client_close(c);
    stop_cluster();
}

/* ---- a sharded trainer that builds its tensors in the arena ------------------- */

typedef struct {
    stria_session_t *s;
    int rank;
    const io_t *full; /* the whole inputs and the reference outputs */
    stria_status_t st;
    char msg[512];
    int mismatches;
} rank_t;

static void *rank_main(void *arg)
{
    rank_t *rk = arg;
    stria_call_t call = STRIA_CALL_INIT;
    call.batch = 1, call.seq_len = S, call.causal = true;
    int64_t n = stria_session_shard_tokens(rk->s, S, rk->rank), pos[S];
    stria_shard_buffer_t b[10];
    rk->st = stria_session_positions(rk->s, S, rk->rank, pos);
    for (int t = STRIA_TENSOR_Q; rk->st == STRIA_OK && t <= STRIA_TENSOR_DV; t++) {
        b[t] = (stria_shard_buffer_t)STRIA_SHARD_BUFFER_INIT;
        rk->st = stria_session_buffer(rk->s, &call, rk->rank, (stria_tensor_id_t)t, &b[t]);
    }
    if (rk->st != STRIA_OK) {
        snprintf(rk->msg, sizeof(rk->msg), "%s", stria_error_msg());
        return NULL;
    }
    /* the rank's tokens, built in place */
    for (int64_t i = 0; i < n; i++) {
        memcpy((float *)b[STRIA_TENSOR_Q].data + i * H * D, rk->full->q + pos[i] * H * D,
               H * D * 4);
        memcpy((float *)b[STRIA_TENSOR_K].data + i * HKV * D, rk->full->k + pos[i] * HKV * D,
               HKV * D * 4);
        memcpy((float *)b[STRIA_TENSOR_V].data + i * HKV * D, rk->full->v + pos[i] * HKV * D,
               HKV * D * 4);
        memcpy((float *)b[STRIA_TENSOR_DO].data + i * H * D, rk->full->d_o + pos[i] * H * D,
               H * D * 4);
    }
    float *o = b[STRIA_TENSOR_O].data, *lse = b[STRIA_TENSOR_LSE].data;
    rk->st = stria_session_forward_shard(rk->s, &call, rk->rank, b[STRIA_TENSOR_Q].data,
                                         b[STRIA_TENSOR_K].data, b[STRIA_TENSOR_V].data, o, lse);
    if (rk->st == STRIA_OK)
        rk->st = stria_session_backward_shard(rk->s, &call, rk->rank, b[STRIA_TENSOR_Q].data,
                                              b[STRIA_TENSOR_K].data, b[STRIA_TENSOR_V].data, o,
                                              lse, b[STRIA_TENSOR_DO].data, b[STRIA_TENSOR_DQ].data,
                                              b[STRIA_TENSOR_DK].data, b[STRIA_TENSOR_DV].data);
    if (rk->st != STRIA_OK) {
        snprintf(rk->msg, sizeof(rk->msg), "%s", stria_error_msg());
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        rk->mismatches += memcmp(o + i * H * D, rk->full->o + pos[i] * H * D, H * D * 4) != 0;
        rk->mismatches += memcmp((float *)b[STRIA_TENSOR_DQ].data + i * H * D,
                                 rk->full->dq + pos[i] * H * D, H * D * 4) != 0;
        rk->mismatches += memcmp((float *)b[STRIA_TENSOR_DK].data + i * HKV * D,
                                 rk->full->dk + pos[i] * HKV * D, HKV * D * 4) != 0;
        for (int h = 0; h < H; h++)
            rk->mismatches += lse[h * n + i] != rk->full->lse[h * S + pos[i]];
    }
    return NULL;
}

Test(arena, a_sharded_trainer_builds_its_tensors_in_place, .timeout = 120)
{
    start_cluster();
    stria_client_t *c0 = client(STRIA_DATA_PATH_SHM), *c1 = client(STRIA_DATA_PATH_SHM);
    stria_session_spec_t sp = spec(true);
    stria_session_t *s0 = NULL, *s1 = NULL;
    cr_assert_eq(stria_session_open(c0, &sp, &s0), STRIA_OK, "%s", stria_error_msg());
    uint8_t ex[STRIA_SESSION_EXPORT_BYTES];
    size_t len;
    cr_assert_eq(stria_session_export(s0, ex, sizeof(ex), &len), STRIA_OK);
    cr_assert_eq(stria_session_import(c1, ex, len, &s1), STRIA_OK, "%s", stria_error_msg());
    io_t *full = inputs(11);
    reference(full, S);
    rank_t rk[N] = {{.s = s0, .rank = 0, .full = full}, {.s = s1, .rank = 1, .full = full}};
    pthread_t th[N];
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, rank_main, &rk[i]);
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(rk[i].st, STRIA_OK, "rank %d: %s", i, rk[i].msg);
        cr_expect_eq(rk[i].mismatches, 0, "rank %d: %d rows differ from the ring's", i,
                     rk[i].mismatches);
    }
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    stria_session_stats(s0, &st);
    cr_expect_eq(st.bytes_up, 0, "inputs went over TCP");
    stria_session_close(s1);
    stria_session_close(s0);
    stria_client_close(c1);
    stria_client_close(c0);
    free(full);
    stop_cluster();
}

/* ---- arenas a worker must refuse ----------------------------------------------- */

/* A memfd of `size` bytes: sealed or not, its pages allocated or not (a
 * hole), on hugetlbfs or not (-1 when this host has no huge pages). */
static int make_arena(size_t size, bool seal, bool allocate, bool huge)
{
    int fd = memfd_create("test-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING | (huge ? MFD_HUGETLB : 0));
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)size) != 0 || (allocate && fallocate(fd, 0, 0, (off_t)size) != 0)) {
        close(fd);
        return -1;
    }
    /* shmem counts allocated pages never written as holes: write them */
    static const char zeros[4096];
    for (size_t off = 0; allocate && off < size; off += sizeof(zeros))
        cr_assert_eq(pwrite(fd, zeros, sizeof(zeros), (off_t)off), (ssize_t)sizeof(zeros));
    if (seal)
        cr_assert_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    return fd;
}

/* Offers an arena to a worker's socket as a client would; the worker's
 * answer (its message in msg). */
static stria_status_t offer(const char *sock, uint64_t worker, uint64_t job, uint32_t rank,
                            const uint8_t *secret, int fd, size_t size, char *msg, size_t cap)
{
    Stria__V1__ShmRequest req = STRIA__V1__SHM_REQUEST__INIT;
    req.op = STRIA__V1__SHM_REQUEST__OP__OP_ARENA;
    req.worker_id = worker;
    req.job_id = job;
    req.rank = rank;
    req.secret.data = (uint8_t *)secret;
    req.secret.len = 32;
    req.arena_size = size;
    int s = -1, passed = -1;
    ProtobufCMessage *m = NULL;
    cr_assert_eq(stria_shm_connect(sock, &s), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_shm_send(s, &req.base, fd), STRIA_OK);
    stria_status_t st = stria_shm_recv(s, &stria__v1__shm_reply__descriptor, 10, &m, &passed);
    close(s);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__ShmReply *r = (const Stria__V1__ShmReply *)m;
    snprintf(msg, cap, "%s", r->message ? r->message : "");
    st = (stria_status_t)r->status;
    protobuf_c_message_free_unpacked(m, NULL);
    return st;
}

typedef struct {
    stria_session_t *s;
    int rank;
    stria_status_t st;
    char msg[512];
} call_arg_t;

static void *one_call(void *arg)
{
    call_arg_t *a = arg;
    static float q[N][S * H * D], k[N][S * HKV * D], v[N][S * HKV * D], o[N][S * H * D],
        lse[N][S * H];
    stria_call_t call = STRIA_CALL_INIT;
    call.batch = 1, call.seq_len = S, call.causal = true;
    a->st = stria_session_forward_shard(a->s, &call, a->rank, q[a->rank], k[a->rank], v[a->rank],
                                        o[a->rank], lse[a->rank]);
    snprintf(a->msg, sizeof(a->msg), "%s", stria_error_msg());
    return NULL;
}

/* One call of both ranks, each on its own handle. */
static void call_both(stria_session_t *s0, stria_session_t *s1)
{
    call_arg_t a[N] = {{.s = s0, .rank = 0}, {.s = s1, .rank = 1}};
    pthread_t th[N];
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, one_call, &a[i]);
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(a[i].st, STRIA_OK, "rank %d: %s", i, a[i].msg);
    }
}

Test(arena, bad_arenas_are_refused_and_the_worker_serves_on, .timeout = 120)
{
    start_cluster();
    /* the session's ranks over TCP: no arena registered by them */
    stria_client_t *c0 = client(STRIA_DATA_PATH_TCP), *c1 = client(STRIA_DATA_PATH_TCP);
    stria_session_spec_t sp = spec(true);
    stria_session_t *s0 = NULL, *s1 = NULL;
    cr_assert_eq(stria_session_open(c0, &sp, &s0), STRIA_OK, "%s", stria_error_msg());
    uint8_t ex[STRIA_SESSION_EXPORT_BYTES];
    size_t len;
    cr_assert_eq(stria_session_export(s0, ex, sizeof(ex), &len), STRIA_OK);
    cr_assert_eq(stria_session_import(c1, ex, len, &s1), STRIA_OK, "%s", stria_error_msg());
    call_both(s0, s1); /* both ranks open on their workers */
    uint64_t id = stria_get_le64(ex + 8);
    /* rank 0's worker and socket, from the coordinator (the secret proven) */
    stria_rpc_client_params_t rp = {.address = cl.coord_addr,
                                    .service = &stria__v1__coordinator__descriptor};
    stria_rpc_client_t *co = NULL;
    cr_assert_eq(stria_rpc_client_connect(&rp, &co), STRIA_OK);
    stria_job_secret_t secret;
    memcpy(secret.bytes, ex + 16, 32);
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    gq.job_id = id;
    stria_rpc_request_t rq = {.method = STRIA_RPC_COORDINATOR_GET_JOB,
                              .request = &gq.base,
                              .timeout_s = 10,
                              .job_secret = &secret,
                              .job_id = id};
    stria_rpc_reply_t rep;
    cr_assert_eq(stria_rpc_client_call(co, &rq, &rep), STRIA_OK, "%s", stria_error_msg());
    const Stria__V1__RankAssignment *ra =
        ((Stria__V1__GetJobReply *)rep.msg)->job->assignment->ranks[0];
    char sock[STRIA_SHM_MAX_PATH];
    snprintf(sock, sizeof(sock), "%s", ra->shm_socket);
    uint64_t wid = ra->worker_id;
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(co);
    cr_assert(sock[0] != '\0', "no socket advertised");

    char msg[600];
    size_t sz = 1 << 16;
    struct {
        const char *what, *says;
        int fd;
        size_t size;
        const uint8_t *secret;
        stria_status_t want;
    } bad[] = {
        {"unsealed", "not sealed", make_arena(sz, false, true, false), sz, ex + 16,
         STRIA_ERR_INVALID_ARG},
        {"holed", "hole", make_arena(sz, true, false, false), sz, ex + 16, STRIA_ERR_INVALID_ARG},
        {"oversized", "exceed", make_arena(1ull << 30, true, false, false), 1ull << 30, ex + 16,
         STRIA_ERR_INVALID_ARG},
        {"a size other than said", "not the", make_arena(sz, true, true, false), sz * 2, ex + 16,
         STRIA_ERR_INVALID_ARG},
        {"without the secret", "secret", make_arena(sz, true, true, false), sz,
         (const uint8_t *)"0123456789abcdef0123456789abcdef", STRIA_ERR_AUTH},
        {"on hugetlbfs", "hugetlbfs", make_arena(2u << 20, true, false, true), 2u << 20, ex + 16,
         STRIA_ERR_INVALID_ARG},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        if (bad[i].fd < 0) {
            cr_log_info("no %s arena can be made on this host: not tried", bad[i].what);
            continue;
        }
        stria_status_t st =
            offer(sock, wid, id, 0, bad[i].secret, bad[i].fd, bad[i].size, msg, sizeof(msg));
        cr_expect_eq(st, bad[i].want, "%s arena: %s (%s)", bad[i].what, stria_status_name(st), msg);
        cr_expect(strstr(msg, bad[i].says) != NULL, "%s arena: \"%s\"", bad[i].what, msg);
        close(bad[i].fd);
        call_both(s0, s1); /* the worker lives and serves the session */
    }
    /* a good one is taken; its connection closing lets it go */
    int fd = make_arena(sz, true, true, false);
    cr_expect_eq(offer(sock, wid, id, 0, ex + 16, fd, sz, msg, sizeof(msg)), STRIA_OK, "%s", msg);
    close(fd);
    call_both(s0, s1);
    stria_session_close(s1);
    stria_session_close(s0);
    stria_client_close(c1);
    stria_client_close(c0);
    stop_cluster();
}

/* ---- a whole job over the job path's shared memory ----------------------------- */

Test(arena, a_whole_job_over_shared_memory_unpacks_every_row, .timeout = 120)
{
    start_cluster();
    stria_client_t *c = client(STRIA_DATA_PATH_SHM);
    io_t *x = inputs(21), *r = inputs(21);
    reference(r, S);
    stria_job_spec_t js = STRIA_JOB_SPEC_INIT;
    js.batch = 1, js.seq_len = S, js.heads = H, js.kv_heads = HKV, js.head_dim = D;
    js.dtype = STRIA_DTYPE_F32, js.causal = true, js.layout = STRIA_LAYOUT_STRIPED;
    js.ring_size = N;
    stria_job_t *job = NULL;
    cr_assert_eq(
        stria_client_forward(c, &js, x->q, x->k, x->v, x->o, x->lse, NULL, NULL, NULL, &job),
        STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_job_data_path(job, 0), STRIA_DATA_PATH_SHM);
    cr_assert_eq(stria_client_backward(job, x->d_o, x->dq, x->dk, x->dv, NULL, NULL, NULL),
                 STRIA_OK, "%s", stria_error_msg());
    stria_client_release(job);
    /* every head's LSE row and every token's output row where it belongs */
    cr_expect_eq(memcmp(x->o, r->o, sizeof(x->o)), 0, "O");
    cr_expect_eq(memcmp(x->lse, r->lse, sizeof(x->lse)), 0, "LSE");
    cr_expect_eq(memcmp(x->dq, r->dq, sizeof(x->dq)), 0, "dQ");
    cr_expect_eq(memcmp(x->dk, r->dk, sizeof(x->dk)), 0, "dK");
    cr_expect_eq(memcmp(x->dv, r->dv, sizeof(x->dv)), 0, "dV");
    free(x);
    free(r);
    stria_client_close(c);
    stop_cluster();
}
