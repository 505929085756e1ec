/* Sharded jobs, placement and the co-located shared-memory path, with real
 * processes on loopback: a coordinator, four workers (hosts hA, hA, hB, hB;
 * instances 0, 1, 0, 1; each with a runtime directory, so a Unix socket),
 * and trainer ranks as processes of their own (shard_rank). Results must
 * equal the in-process ring bit for bit over either path; a missing rank,
 * a rank killed mid-upload and a wrong secret must fail clearly; placement
 * must follow the spec or refuse. (A lost worker's rank and its spare:
 * test_sharded_spares.) */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proc.h"
#include "sharded_util.h"
#include "stria.pb-c.h"
#include "stria_client.h"
#include "stria_ring.h"
#include "stria_rpc.h"
#include "stria_shm.h"

/* Four rank processes over `path` (mode run or inplace): every rank
 * succeeds on the path it should, and the gathered outputs are the
 * in-process ring's, bit for bit. */
static void run_sharded(stria_client_t *sub, case_t *c, const char *path, const char *mode,
                        const char *want_path)
{
    stria_job_t *job = NULL;
    test_proc_t *p[N_WORKERS];
    char line[1024];
    cr_assert_eq(stria_client_submit(sub, &c->j.spec, &job), STRIA_OK, "%s", stria_error_msg());
    for (int r = 0; r < N_WORKERS; r++)
        p[r] = sh_start_rank(c, job, r, path, mode);
    for (int r = 0; r < N_WORKERS; r++) {
        sh_rank_result(p[r], line, sizeof(line));
        cr_expect(strncmp(line, "shard_rank: ok", 14) == 0, "rank %d (%s, %s): %s", r, path, mode,
                  line);
        cr_expect(strstr(line, want_path) != NULL, "rank %d took the wrong path: %s", r, line);
    }
    memset(c->got[0], 0xff, c->bytes[0]);
    sh_case_gather(c, job);
    static const char *const names[5] = {"O", "LSE", "dQ", "dK", "dV"};
    for (int i = 0; i < 5; i++)
        cr_expect_eq(memcmp(c->got[i], c->ref[i], c->bytes[i]), 0,
                     "%s over %s (%s, %s layout, S=%lld) differs from the in-process ring",
                     names[i], path, mode, stria_layout_kind_name(c->j.spec.layout),
                     (long long)c->j.spec.seq_len);
    /* the ranks released their handles: the job is over */
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    gq.job_id = stria_job_id(job);
    cr_assert_eq(sh_coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
    cr_expect_eq(((Stria__V1__GetJobReply *)rep.msg)->job->state,
                 STRIA__V1__JOB_STATE__JOB_STATE_RELEASED,
                 "every rank released, the job should be released");
    stria_rpc_reply_free(&rep);
    stria_client_release(job); /* the submitter ran no rank: nothing more */
}

Test(sharded, four_rank_processes_equal_the_in_process_ring, .timeout = 900)
{
    sh_start_cluster();
    stria_client_t *sub = sh_client(STRIA_DATA_PATH_AUTO);
    case_t c;
    /* striped, S=101 (not a multiple of 2N: padded shards, so the shared
     * buffers have a batch stride), GQA, bf16: TCP, then shared memory
     * filled and read in place; the same bits */
    sh_case_init(&c, 2, 101, 4, 2, STRIA_DTYPE_BF16, true, STRIA_LAYOUT_STRIPED, 11);
    run_sharded(sub, &c, "tcp", "run", "path=tcp");
    void *tcp_o = malloc(c.bytes[0]);
    memcpy(tcp_o, c.got[0], c.bytes[0]);
    run_sharded(sub, &c, "shm", "inplace", "path=shm");
    cr_expect_eq(memcmp(tcp_o, c.got[0], c.bytes[0]), 0, "shm and tcp differ");
    sh_case_check_reference(&c);
    free(tcp_o);
    sh_case_free(&c);
    /* contiguous, fp32, non-causal, copied through the shared buffers */
    sh_case_init(&c, 1, 77, 2, 1, STRIA_DTYPE_F32, false, STRIA_LAYOUT_CONTIGUOUS, 21);
    run_sharded(sub, &c, "shm", "run", "path=shm");
    sh_case_free(&c);
    /* zigzag, S=90 (90 % 8 = 2), fp32: auto takes shared memory here */
    sh_case_init(&c, 1, 90, 4, 4, STRIA_DTYPE_F32, true, STRIA_LAYOUT_ZIGZAG, 31);
    run_sharded(sub, &c, "auto", "run", "path=shm");
    sh_case_check_reference(&c);
    sh_case_free(&c);
    stria_client_close(sub);
    cr_expect(sh_workers_idle(10), "memory still held after every job ended");
    sh_stop_cluster();
}

/* The whole-sequence calls over shared memory and over TCP: the same bits,
 * the in-process ring's. */
Test(sharded, whole_sequence_calls_over_shm_and_tcp, .timeout = 600)
{
    sh_start_cluster();
    case_t c;
    sh_case_init(&c, 2, 70, 4, 1, STRIA_DTYPE_BF16, true, STRIA_LAYOUT_ZIGZAG, 41);
    for (int path = STRIA_DATA_PATH_TCP; path <= STRIA_DATA_PATH_SHM; path++) {
        stria_client_t *cli = sh_client((stria_data_path_t)path);
        stria_job_t *job = NULL;
        cr_assert_eq(stria_client_forward(cli, &c.j.spec, c.j.q, c.j.k, c.j.v, c.got[0], c.got[1],
                                          NULL, NULL, NULL, &job),
                     STRIA_OK, "%s", stria_error_msg());
        for (int r = 0; r < N_WORKERS; r++)
            cr_expect_eq(stria_job_data_path(job, r), (stria_data_path_t)path, "rank %d", r);
        cr_assert_eq(
            stria_client_backward(job, c.j.g, c.got[2], c.got[3], c.got[4], NULL, NULL, NULL),
            STRIA_OK, "%s", stria_error_msg());
        for (int i = 0; i < 5; i++)
            cr_expect_eq(memcmp(c.got[i], c.ref[i], c.bytes[i]), 0, "path %d: output %d differs",
                         path, i);
        cr_expect_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
        stria_client_close(cli);
    }
    sh_case_free(&c);
    cr_expect(sh_workers_idle(10), "memory still held after the jobs");
    sh_stop_cluster();
}

/* The job's failure text at the coordinator. */
static void job_failure(uint64_t id, Stria__V1__JobState *state, char *out, size_t len)
{
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    gq.job_id = id;
    cr_assert_eq(sh_coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
    const Stria__V1__JobInfo *j = ((Stria__V1__GetJobReply *)rep.msg)->job;
    *state = j->state;
    snprintf(out, len, "%s", j->failure);
    stria_rpc_reply_free(&rep);
}

Test(sharded, a_missing_rank_fails_the_job_naming_it, .timeout = 600)
{
    sh_start_cluster();
    stria_client_t *sub = sh_client(STRIA_DATA_PATH_AUTO);
    case_t c;
    sh_case_init(&c, 1, 64, 2, 2, STRIA_DTYPE_F32, true, STRIA_LAYOUT_STRIPED, 51);
    c.j.spec.arrival_timeout_s = 1.5;
    stria_job_t *job = NULL;
    cr_assert_eq(stria_client_submit(sub, &c.j.spec, &job), STRIA_OK, "%s", stria_error_msg());
    test_proc_t *p[3];
    char line[1024], failure[600];
    double t0 = stria_time_now();
    for (int r = 0; r < 3; r++) /* rank 3 never comes */
        p[r] = sh_start_rank(&c, job, r, r == 1 ? "tcp" : "shm", "run");
    for (int r = 0; r < 3; r++) {
        sh_rank_result(p[r], line, sizeof(line));
        cr_expect(strstr(line, "error STRIA_ERR_TIMEOUT") != NULL &&
                      strstr(line, "rank 3 did not arrive for the forward pass") != NULL,
                  "rank %d: %s", r, line);
    }
    cr_expect_lt(stria_time_now() - t0, 60.0);
    Stria__V1__JobState state;
    job_failure(stria_job_id(job), &state, failure, sizeof(failure));
    cr_expect_eq(state, STRIA__V1__JOB_STATE__JOB_STATE_FAILED);
    cr_expect(strstr(failure, "rank 3 did not arrive") != NULL &&
                  strstr(failure, "ranks 0, 1, 2 had their inputs in") != NULL,
              "%s", failure);
    stria_client_release(job);
    cr_expect(sh_workers_idle(10), "the failed job's memory is still held");
    sh_case_free(&c);
    stria_client_close(sub);
    sh_stop_cluster();
}

Test(sharded, a_rank_killed_mid_upload_fails_the_job_and_frees_its_memory, .timeout = 600)
{
    static const char *const paths[2] = {"tcp", "shm"};
    sh_start_cluster();
    stria_client_t *sub = sh_client(STRIA_DATA_PATH_AUTO);
    for (int k = 0; k < 2; k++) {
        case_t c;
        sh_case_init(&c, 1, 512, 4, 2, STRIA_DTYPE_F32, true, STRIA_LAYOUT_ZIGZAG, 61 + k);
        cr_assert(sh_workers_idle(10), "workers busy before the job");
        stria_job_t *job = NULL;
        cr_assert_eq(stria_client_submit(sub, &c.j.spec, &job), STRIA_OK, "%s", stria_error_msg());
        test_proc_t *p[N_WORKERS];
        char line[1024], failure[600], dying[64];
        for (int r = 0; r < N_WORKERS; r++)
            p[r] =
                sh_start_rank(&c, job, r, paths[k], r == 2 ? (k ? "die-shm" : "die-tcp") : "run");
        for (int r = 0; r < N_WORKERS; r++) {
            sh_rank_result(p[r], r == 2 ? dying : line, r == 2 ? sizeof(dying) : sizeof(line));
            /* a rank hears that rank 2 failed the job, or (when its worker
             * dropped the failed job before this rank's first request) that
             * the job is gone */
            if (r != 2)
                cr_expect(strstr(line, "shard_rank: error") != NULL &&
                              (strstr(line, "rank 2") != NULL ||
                               strstr(line, "is not held by this worker") != NULL),
                          "%s: rank %d: %s", paths[k], r, line);
        }
        Stria__V1__JobState state;
        job_failure(stria_job_id(job), &state, failure, sizeof(failure));
        cr_expect_eq(state, STRIA__V1__JOB_STATE__JOB_STATE_FAILED, "%s: %s", paths[k], failure);
        cr_expect(strstr(failure, k ? "closed its shared-memory connection"
                                    : "connection was lost in the middle of an upload") != NULL,
                  "%s: %s", paths[k], failure);
        cr_expect(sh_workers_idle(10), "%s: the workers' memory did not return to its level",
                  paths[k]);
        stria_client_release(job);
        sh_case_free(&c);
    }
    stria_client_close(sub);
    sh_stop_cluster();
}

/* Releases a whole job (as its submitter would with ReleaseJob alone),
 * proving its secret (from the job's export). */
static void release_whole(const stria_job_t *job)
{
    uint8_t ex[STRIA_JOB_EXPORT_BYTES];
    size_t len;
    stria_job_secret_t secret;
    cr_assert_eq(stria_job_export(job, ex, sizeof(ex), &len), STRIA_OK, "%s", stria_error_msg());
    memcpy(secret.bytes, ex + 16, sizeof(secret.bytes));
    Stria__V1__ReleaseJobRequest req = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep = {0};
    req.job_id = stria_job_id(job);
    stria_rpc_client_t *c = sh_coord_rpc();
    stria_rpc_request_t rq = {.method = STRIA_RPC_COORDINATOR_RELEASE_JOB,
                              .request = &req.base,
                              .timeout_s = 10,
                              .job_secret = &secret,
                              .job_id = req.job_id};
    cr_assert_eq(stria_rpc_client_call(c, &rq, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(c);
}

static Stria__V1__JobState job_state(uint64_t id)
{
    char failure[600];
    Stria__V1__JobState state;
    job_failure(id, &state, failure, sizeof(failure));
    return state;
}

/* A raw arena registration with a worker's socket (ShmRequest OP_ARENA):
 * a fresh sealed memfd of `size` bytes (its pages allocated) for rank 0 of
 * `job_id` with `secret` (secret_len bytes); returns the status, and with
 * *sock_out (may be NULL) the open registration and *mem_out the arena
 * mapped here. */
static stria_status_t raw_arena(const char *sock_path, uint64_t worker_id, uint64_t job_id,
                                const uint8_t *secret, size_t secret_len, size_t size,
                                int *sock_out, unsigned char **mem_out, char *msg, size_t len)
{
    int s = -1, passed = -1;
    ProtobufCMessage *m = NULL;
    int fd = memfd_create("test-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_geq(fd, 0);
    cr_assert_eq(ftruncate(fd, (off_t)size), 0);
    cr_assert_eq(fallocate(fd, 0, 0, (off_t)size), 0);
    cr_assert_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    unsigned char *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    cr_assert_neq(mem, MAP_FAILED);
    cr_assert_eq(stria_shm_connect(sock_path, &s), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__ShmRequest req = STRIA__V1__SHM_REQUEST__INIT;
    req.op = STRIA__V1__SHM_REQUEST__OP__OP_ARENA;
    req.worker_id = worker_id;
    req.job_id = job_id;
    req.rank = 0;
    req.secret.data = (uint8_t *)secret;
    req.secret.len = secret_len;
    req.arena_size = size;
    cr_assert_eq(stria_shm_send(s, &req.base, fd), STRIA_OK);
    cr_assert_eq(stria_shm_recv(s, &stria__v1__shm_reply__descriptor, 10, &m, &passed), STRIA_OK,
                 "%s", stria_error_msg());
    cr_expect_lt(passed, 0, "the worker passed a descriptor back");
    const Stria__V1__ShmReply *r = (const Stria__V1__ShmReply *)m;
    stria_status_t st = (stria_status_t)r->status;
    snprintf(msg, len, "%s", r->message);
    protobuf_c_message_free_unpacked(m, NULL);
    close(fd);
    if (sock_out != NULL && st == STRIA_OK) {
        *sock_out = s;
        *mem_out = mem;
    } else {
        close(s);
        munmap(mem, size);
    }
    return st;
}

/* Rank 0 of a job opened early (admitted, no ring needed) over raw RPC with
 * its export's secret. */
static void open_rank0_early(const stria_job_t *job, const char *rpc_address)
{
    uint8_t ex[STRIA_JOB_EXPORT_BYTES];
    size_t len;
    cr_assert_eq(stria_job_export(job, ex, sizeof(ex), &len), STRIA_OK);
    stria_rpc_client_params_t p = {
        .address = rpc_address, .service = &stria__v1__worker__descriptor, .connect_timeout_s = 5};
    stria_rpc_client_t *c = NULL;
    cr_assert_eq(stria_rpc_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__OpenSessionRequest req = STRIA__V1__OPEN_SESSION_REQUEST__INIT;
    stria_job_secret_t secret;
    memcpy(secret.bytes, ex + 16, sizeof(secret.bytes));
    req.job_id = stria_job_id(job);
    req.early = true;
    stria_rpc_request_t rq = {.method = STRIA_RPC_WORKER_OPEN_SESSION,
                              .request = &req.base,
                              .timeout_s = 10,
                              .job_secret = &secret,
                              .job_id = req.job_id};
    stria_rpc_reply_t rep = {0};
    cr_assert_eq(stria_rpc_client_call(c, &rq, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(c);
}

/* Rank 0's worker of a job: its socket, id and RPC address. */
static void rank0_of(const stria_job_t *job, char *sock, char *rpc, uint64_t *wid)
{
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    gq.job_id = stria_job_id(job);
    cr_assert_eq(sh_coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
    const Stria__V1__RankAssignment *ra =
        ((Stria__V1__GetJobReply *)rep.msg)->job->assignment->ranks[0];
    snprintf(sock, STRIA_SHM_MAX_PATH, "%s", ra->shm_socket);
    snprintf(rpc, 300, "%s", ra->rpc_address);
    *wid = ra->worker_id;
    stria_rpc_reply_free(&rep);
    cr_assert(sock[0] != '\0', "the assignment advertises no socket");
}

/* The secret guards a job's ranks on the workers' sockets as on their RPC:
 * an arena is registered with a rank only with the job's secret, and the
 * worker never passes memory of its own to a client. */
Test(sharded, the_secret_guards_jobs_and_their_shared_memory, .timeout = 300)
{
    sh_start_cluster();
    stria_client_t *sub = sh_client(STRIA_DATA_PATH_AUTO);
    case_t c;
    sh_case_init(&c, 1, 64, 2, 2, STRIA_DTYPE_F32, true, STRIA_LAYOUT_STRIPED, 71);
    stria_job_t *a = NULL, *b = NULL;
    cr_assert_eq(stria_client_submit(sub, &c.j.spec, &a), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_client_submit(sub, &c.j.spec, &b), STRIA_OK, "%s", stria_error_msg());
    uint8_t ea[STRIA_JOB_EXPORT_BYTES], eb[STRIA_JOB_EXPORT_BYTES];
    size_t len;
    cr_assert_eq(stria_job_export(a, ea, sizeof(ea), &len), STRIA_OK);
    cr_assert_eq(stria_job_export(b, eb, sizeof(eb), &len), STRIA_OK);
    cr_expect_neq(memcmp(ea + 16, eb + 16, 32), 0, "two jobs with one secret");
    const uint8_t *sb = eb + 16;
    uint8_t made_up[32];
    char msg[600], sock[STRIA_SHM_MAX_PATH], rpc[300];
    uint64_t wid;
    for (int i = 0; i < 32; i++)
        made_up[i] = (uint8_t)(0x11 * i);
    rank0_of(a, sock, rpc, &wid);
    /* a rank that is not open takes no arena */
    cr_expect_neq(
        raw_arena(sock, wid, stria_job_id(a), ea + 16, 32, 4096, NULL, NULL, msg, sizeof(msg)),
        STRIA_OK, "an arena for a rank never opened");
    cr_expect_eq(sh_worker_in_use(wid), 0, "a refused arena made the worker allocate the job");
    /* a's rank 0 opened: another client of this host, with no secret, b's
     * secret or a made-up one, is refused */
    open_rank0_early(a, rpc);
    const uint8_t *bad[3] = {sb, sb, made_up};
    const size_t bad_len[3] = {0, 32, 32};
    for (int i = 0; i < 3; i++) {
        stria_status_t st = raw_arena(sock, wid, stria_job_id(a), bad[i], bad_len[i], 4096, NULL,
                                      NULL, msg, sizeof(msg));
        cr_expect_eq(st, STRIA_ERR_AUTH, "secret %d: %s (%s)", i, stria_status_name(st), msg);
    }
    /* with a's secret it is (and nothing comes back but the reply) */
    int reg = -1;
    unsigned char *mem = NULL;
    cr_expect_eq(
        raw_arena(sock, wid, stria_job_id(a), ea + 16, 32, 4096, &reg, &mem, msg, sizeof(msg)),
        STRIA_OK, "%s", msg);
    /* an export whose secret was altered does not import */
    stria_client_t *other = sh_client(STRIA_DATA_PATH_SHM);
    stria_job_t *x = NULL;
    eb[20] ^= 1;
    cr_expect_eq(stria_job_import(other, eb, sizeof(eb), &x), STRIA_ERR_AUTH, "%s",
                 stria_error_msg());
    eb[20] ^= 1;
    cr_expect_eq(stria_job_import(other, eb, 7, &x), STRIA_ERR_FORMAT);
    cr_assert_eq(stria_job_import(other, eb, sizeof(eb), &x), STRIA_OK, "%s", stria_error_msg());
    stria_shard_buffer_t buf = STRIA_SHARD_BUFFER_INIT;
    cr_expect_eq(stria_job_shard_buffer(x, 0, STRIA_TENSOR_Q, &buf), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(stria_client_backward_shard(x, 0, buf.data, buf.data, buf.data, buf.data),
                 STRIA_ERR_INVALID_ARG, "backward before forward");
    stria_client_release(x); /* rank 0 of b released: b goes on */
    stria_client_close(other);
    cr_expect_eq(job_state(stria_job_id(b)), STRIA__V1__JOB_STATE__JOB_STATE_LOADING);
    close(reg); /* a's rank 0 loses its arena's client: a fails */
    munmap(mem, 4096);
    release_whole(a);
    release_whole(b);
    stria_client_release(a);
    stria_client_release(b);
    cr_expect(sh_workers_idle(10), "memory still held");
    stria_client_close(sub);
    sh_case_free(&c);
    sh_stop_cluster();
}

/* A client's arena is its own memory: the worker writes it only with the
 * outputs of that client's calls while it is registered, so a client that
 * kept an arena of an ended job sees none of a later job's bytes; and a
 * later job's outputs hold none of an earlier job's bytes (from a client's
 * arena, or from the workers' pools after a job over TCP). */
Test(sharded, no_job_maps_another_jobs_bytes, .timeout = 300)
{
    sh_start_cluster();
    stria_client_t *sub = sh_client(STRIA_DATA_PATH_AUTO);
    case_t c;
    sh_case_init(&c, 1, 64, 2, 2, STRIA_DTYPE_F32, false, STRIA_LAYOUT_STRIPED, 81);
    /* job A: a client of this host registers an arena for rank 0, fills it,
     * and goes */
    stria_job_t *a = NULL;
    cr_assert_eq(stria_client_submit(sub, &c.j.spec, &a), STRIA_OK, "%s", stria_error_msg());
    char sock[STRIA_SHM_MAX_PATH], rpc[300], msg[600];
    uint64_t wid;
    uint8_t ea[STRIA_JOB_EXPORT_BYTES];
    /* the rank's bound, two regions of its shard: the size of the arenas
     * libstria makes for job C's ranks (a worker that took a kept mapping
     * for a registration of the same size alone would give C A's memory) */
    stria_layout_t lay;
    cr_assert_eq(stria_layout_init(c.j.spec.layout, N_WORKERS, c.j.spec.seq_len, &lay), STRIA_OK);
    size_t len, size_a = 2 * (size_t)stria_session_region_bytes(
                                 c.j.spec.batch, lay.shard_tokens, c.j.spec.heads,
                                 c.j.spec.kv_heads, c.j.spec.head_dim, c.j.spec.dtype, NULL);
    cr_assert_eq(stria_job_export(a, ea, sizeof(ea), &len), STRIA_OK);
    rank0_of(a, sock, rpc, &wid);
    open_rank0_early(a, rpc);
    int reg = -1;
    unsigned char *ma = NULL;
    cr_assert_eq(
        raw_arena(sock, wid, stria_job_id(a), ea + 16, 32, size_a, &reg, &ma, msg, sizeof(msg)),
        STRIA_OK, "%s", msg);
    memset(ma, 0xa5, size_a);
    close(reg); /* A fails: its client left without releasing it */
    cr_expect(sh_workers_idle(10), "job A's memory is still held");
    stria_client_release(a);
    /* job B over TCP: its bytes go into the workers' pools */
    stria_client_t *tcp = sh_client(STRIA_DATA_PATH_TCP);
    stria_job_t *b = NULL;
    cr_assert_eq(stria_client_forward(tcp, &c.j.spec, c.j.q, c.j.k, c.j.v, c.got[0], c.got[1], NULL,
                                      NULL, NULL, &b),
                 STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(memcmp(c.got[0], c.ref[0], c.bytes[0]), 0, "job B's output");
    stria_client_release(b);
    stria_client_close(tcp);
    /* job C through the arenas: its outputs are its own, bit for bit */
    memset(c.got[0], 0, c.bytes[0]);
    stria_job_t *cj = NULL;
    cr_assert_eq(stria_client_forward(sub, &c.j.spec, c.j.q, c.j.k, c.j.v, c.got[0], c.got[1], NULL,
                                      NULL, NULL, &cj),
                 STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(memcmp(c.got[0], c.ref[0], c.bytes[0]), 0, "job C's output");
    cr_expect_eq(stria_job_data_path(cj, 0), STRIA_DATA_PATH_SHM, "job C used no arena");
    stria_client_release(cj);
    /* ... and A's arena is A's bytes still */
    size_t changed = 0;
    for (size_t i = 0; i < size_a; i++)
        changed += ma[i] != 0xa5;
    cr_expect_eq(changed, 0, "%zu bytes of an ended job's arena changed under later jobs", changed);
    munmap(ma, size_a);
    cr_expect(sh_workers_idle(10), "memory still held");
    stria_client_close(sub);
    sh_case_free(&c);
    sh_stop_cluster();
}

/* striactl job ID, its stdout. */
static void striactl_job(uint64_t id, char *out, size_t len)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "%s --coordinator %s job %llu", STRIACTL_BIN, cl.coord_addr,
             (unsigned long long)id);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    size_t n = fread(out, 1, len - 1, f);
    out[n] = '\0';
    pclose(f);
}

Test(sharded, placement_by_host_and_device_index, .timeout = 300)
{
    sh_start_cluster();
    stria_client_t *sub = sh_client(STRIA_DATA_PATH_AUTO);
    stria_job_spec_t s = STRIA_JOB_SPEC_INIT;
    s.batch = 1;
    s.seq_len = 64;
    s.heads = s.kv_heads = 2;
    s.head_dim = 16;
    s.ring_size = 4;
    const char *hosts[4] = {"hB", "hA", "hB", "hA"};
    /* the device indexes one way, then the other: a placement blind to
     * them matches at most one of the two */
    const int orders[2][4] = {{1, 0, 0, 1}, {0, 1, 1, 0}};
    const int *devs = orders[0];
    stria_job_t *job = NULL;
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    s.placement_hosts = hosts;
    for (int o = 1; o >= 0; o--) {
        devs = orders[o];
        s.placement_devices = devs;
        cr_assert_eq(stria_client_submit(sub, &s, &job), STRIA_OK, "%s", stria_error_msg());
        gq.job_id = stria_job_id(job);
        cr_assert_eq(sh_coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
        const Stria__V1__Assignment *as = ((Stria__V1__GetJobReply *)rep.msg)->job->assignment;
        for (int r = 0; r < 4; r++) {
            cr_expect_str_eq(as->ranks[r]->host, hosts[r], "rank %d", r);
            cr_expect(as->ranks[r]->has_device_index &&
                          as->ranks[r]->device_index == (uint32_t)devs[r],
                      "order %d: rank %d on device %u, placed on %d", o, r,
                      as->ranks[r]->device_index, devs[r]);
            cr_expect(!as->ranks[r]->placement_fallback);
        }
        stria_rpc_reply_free(&rep);
        if (o == 1) { /* the first order's job goes; the second's is checked further */
            release_whole(job);
            stria_client_release(job);
        }
    }
    char out[8192];
    striactl_job(stria_job_id(job), out, sizeof(out));
    cr_expect(strstr(out, "PLACED ON") != NULL && strstr(out, "hB/1") != NULL &&
                  strstr(out, "hA/0") != NULL && strstr(out, "placed by the spec") != NULL,
              "striactl job does not show the placement:\n%s", out);
    release_whole(job);
    stria_client_release(job);

    /* a host without workers: refused naming the rank and the host */
    const char *nowhere[4] = {"hA", "hC", "hB", "hB"};
    s.placement_hosts = nowhere;
    s.placement_devices = NULL;
    cr_expect_eq(stria_client_submit(sub, &s, &job), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "rank 1 is placed on host 'hC'") != NULL, "%s",
              stria_error_msg());
    /* three ranks on a host of two workers */
    const char *crowded[4] = {"hA", "hA", "hA", "hB"};
    s.placement_hosts = crowded;
    cr_expect_eq(stria_client_submit(sub, &s, &job), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "rank 2 is placed on host 'hA', whose 2 worker(s)") != NULL,
              "%s", stria_error_msg());
    /* ... unless the spec allows a fallback: rank 1 goes elsewhere */
    s.placement_hosts = nowhere;
    s.placement_fallback = true;
    cr_assert_eq(stria_client_submit(sub, &s, &job), STRIA_OK, "%s", stria_error_msg());
    striactl_job(stria_job_id(job), out, sizeof(out));
    cr_expect(strstr(out, "hC (fallback)") != NULL, "no fallback shown:\n%s", out);
    release_whole(job);
    stria_client_release(job);
    stria_client_close(sub);
    cr_expect(sh_workers_idle(10));
    sh_stop_cluster();
}

Test(sharded, sharded_specs_are_checked, .timeout = 300)
{
    sh_start_cluster();
    stria_client_t *cli = sh_client(STRIA_DATA_PATH_AUTO);
    stria_job_spec_t s = STRIA_JOB_SPEC_INIT;
    stria_job_t *job = NULL;
    s.batch = 1;
    s.seq_len = 64;
    s.heads = s.kv_heads = 2;
    s.head_dim = 16;
    cr_expect_eq(stria_client_submit(cli, &s, &job), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "ring_size is required") != NULL, "%s", stria_error_msg());
    s.ring_size = 4;
    s.layout = STRIA_LAYOUT_AUTO;
    cr_expect_eq(stria_client_submit(cli, &s, &job), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "must name its layout") != NULL, "%s", stria_error_msg());
    /* the coordinator refuses it too (a client of another library) */
    Stria__V1__JobSpec spec = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    spec.batch = 1;
    spec.seq_len = 64;
    spec.heads = spec.kv_heads = 2;
    spec.head_dim = 16;
    spec.sharded = true;
    spec.ring_size = 4;
    spec.layout = STRIA__V1__LAYOUT__LAYOUT_AUTO;
    req.spec = &spec;
    cr_expect_eq(sh_coord_call(STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, &rep),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "must name its layout") != NULL, "%s", stria_error_msg());
    spec.layout = STRIA__V1__LAYOUT__LAYOUT_STRIPED;
    spec.ring_size = 0;
    cr_expect_eq(sh_coord_call(STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, &rep),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "needs ring_size") != NULL, "%s", stria_error_msg());
    /* more memory per rank than a worker offers: refused at submission,
     * naming the need and the offer (no rank ever uploads) */
    s.layout = STRIA_LAYOUT_STRIPED;
    s.batch = 64;
    s.seq_len = 16384;
    s.heads = s.kv_heads = 8;
    s.head_dim = 128;
    uint64_t need = 0;
    cr_assert_eq(stria_session_rank_memory(64, 16384 / 4, 8, 8, 128, STRIA_DTYPE_F32, 1, &need),
                 STRIA_OK);
    char want[96];
    snprintf(want, sizeof(want), "needs %llu MiB per rank", (unsigned long long)(need >> 20));
    cr_expect_eq(stria_client_submit(cli, &s, &job), STRIA_ERR_NO_MEMORY, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), want) != NULL &&
                  strstr(stria_error_msg(), "offer 1024 MiB") != NULL,
              "the refusal names the need ('%s') and the offer: %s", want, stria_error_msg());
    s.batch = 1;
    s.seq_len = 64;
    s.heads = s.kv_heads = 2;
    s.head_dim = 16;
    /* a whole-sequence job cannot be exported nor run by shard */
    float x[64 * 2 * 16] = {0}, lse[64 * 2];
    cr_assert_eq(stria_client_forward(cli, &s, x, x, x, x, lse, NULL, NULL, NULL, &job), STRIA_OK,
                 "%s", stria_error_msg());
    uint8_t e[STRIA_JOB_EXPORT_BYTES];
    size_t len;
    cr_expect_eq(stria_job_export(job, e, sizeof(e), &len), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_client_forward_shard(job, 0, x, x, x, x, lse), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "not sharded") != NULL, "%s", stria_error_msg());
    stria_client_release(job);
    stria_client_close(cli);
    sh_stop_cluster();
}
