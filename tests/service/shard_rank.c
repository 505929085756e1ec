/* One trainer rank of a sharded job, as a process of its own (test helper of
 * test_sharded): imports the job, builds its shard of deterministic full
 * tensors from the positions the job gives it, runs its forward and
 * backward passes and writes its outputs to OUTDIR/rankR.{o,lse,dq,dk,dv}.
 *
 *   shard_rank COORD EXPORT_HEX RANK PATH MODE OUTDIR B S H HKV D DTYPE SEED
 *
 * PATH: auto, tcp or shm. MODE: run (the rank's own buffers), inplace (the
 * rank's arena, filled and read in place), die-tcp (opens its rank over a
 * raw connection to its worker and sends half of its forward's inputs,
 * then SIGKILLs itself),
 * die-shm (writes half of its Q into the shared buffer, then SIGKILLs
 * itself); run-again and inplace-again: as run and inplace, and a pass that
 * failed retryably (its job replaced after a lost worker) runs forward and
 * backward again, as a trainer would, at most twice; with -pause (run-again-pause),
 * after its first forward the rank prints "rank R: forward done" and waits
 * for the file OUTDIR/go before its backward; with -hold (run-again-hold,
 * run-again-pause-hold), once its passes succeeded the rank prints "rank R:
 * holding the job" and waits for the file OUTDIR/release before it says ok
 * and releases the job. Prints "shard_rank: ok path=P" or "shard_rank:
 * error NAME: message" on stdout. */
#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "ref.h"
#include "stria.pb-c.h"
#include "stria_client.h"
#include "stria_rpc.h"
#include "tsess.h"

typedef struct {
    int64_t B, S, H, Hkv, D;
    stria_dtype_t dt;
    size_t es;
    int rank;
    int64_t T; /* the rank's tokens */
    int64_t *pos;
} shape_t;

static int fail(stria_status_t st, const char *what)
{
    printf("shard_rank: error %s: %s: %s\n", stria_status_name(st), what, stria_error_msg());
    fflush(stdout);
    return 1;
}

/* The rank's shard of a deterministic full tensor [B, S, heads, D]. */
static void *make_shard(const shape_t *s, int64_t heads, uint64_t seed)
{
    size_t n = (size_t)(s->B * s->S * heads * s->D), row = (size_t)(heads * s->D) * s->es;
    float *f = malloc(n * 4);
    char *full = malloc(n * s->es), *shard = malloc((size_t)(s->B * s->T) * row);
    ref_fill(f, n, seed, 1.0f, s->dt);
    ref_to_dtype(f, n, s->dt, full);
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t i = 0; i < s->T; i++)
            memcpy(shard + (size_t)(b * s->T + i) * row,
                   full + (size_t)(b * s->S + s->pos[i]) * row, row);
    free(f);
    free(full);
    return shard;
}

static void write_file(const char *dir, int rank, const char *name, const void *p, size_t n)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/rank%d.%s", dir, rank, name);
    FILE *f = fopen(path, "wb");
    if (f != NULL) {
        fwrite(p, 1, n, f);
        fclose(f);
    }
}

/* Between a compact shard and a shared buffer (outer rows apart). */
static void copy_strided(const stria_shard_buffer_t *b, void *compact, bool to_buffer)
{
    size_t used = (size_t)(b->tokens * b->row_bytes);
    for (int64_t o = 0; o < b->outer; o++) {
        char *x = (char *)b->data + o * b->outer_stride, *c = (char *)compact + o * used;
        memcpy(to_buffer ? x : c, to_buffer ? c : x, used);
    }
}

/* The rank's worker's RPC address, from the coordinator. */
static int worker_address(const char *coord, uint64_t job_id, int rank, char *out, size_t len)
{
    stria_rpc_client_params_t p = {
        .address = coord, .service = &stria__v1__coordinator__descriptor, .connect_timeout_s = 5};
    stria_rpc_client_t *c = NULL;
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep = {0};
    req.job_id = job_id;
    stria_rpc_request_t rq = {
        .method = STRIA_RPC_COORDINATOR_GET_JOB, .request = &req.base, .timeout_s = 5};
    if (stria_rpc_client_connect(&p, &c) != STRIA_OK || stria_rpc_client_call(c, &rq, &rep))
        return -1;
    const Stria__V1__JobInfo *j = ((Stria__V1__GetJobReply *)rep.msg)->job;
    snprintf(out, len, "%s", j->assignment->ranks[rank]->rpc_address);
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(c);
    return 0;
}

/* A client killed in the middle of a call's inputs: the rank opened on its
 * worker over a raw connection (its job's secret proven), then a forward
 * call announcing all of Q, K and V whose payload becomes unreadable after
 * half of Q, so the connection stops there; then SIGKILL. */
static int die_tcp(const char *coord, const stria_job_t *job, const shape_t *s)
{
    char addr[300];
    uint8_t ex[STRIA_JOB_EXPORT_BYTES];
    size_t len;
    uint64_t job_id = stria_job_id(job);
    uint64_t q_bytes = (uint64_t)(s->B * s->T * s->H * s->D) * s->es;
    uint64_t kv_bytes = (uint64_t)(s->B * s->T * s->Hkv * s->D) * s->es;
    if (worker_address(coord, job_id, s->rank, addr, sizeof(addr)) != 0)
        return fail(STRIA_ERR_IO, "the worker's address");
    if (stria_job_export(job, ex, sizeof(ex), &len) != STRIA_OK)
        return fail(STRIA_ERR_INTERNAL, "export");
    tsess_rank_t r = {.id = job_id, .rank = (uint32_t)s->rank, .timeout_s = 30};
    memcpy(r.secret.bytes, ex + 16, sizeof(r.secret.bytes));
    stria_rpc_client_params_t p;
    memset(&p, 0, sizeof(p));
    p.address = addr;
    p.service = &stria__v1__worker__descriptor;
    p.client_name = "shard_rank (dies)";
    p.connect_timeout_s = 10;
    stria_status_t st = stria_rpc_client_connect(&p, &r.c);
    if (st != STRIA_OK)
        return fail(st, "connect to the worker");
    if ((st = tsess_open(&r)) != STRIA_OK)
        return fail(st, "open the rank");
    char *half = calloc(1, q_bytes / 2);
    char *bad = mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    struct iovec iov[2] = {{half, q_bytes / 2}, {bad, q_bytes - q_bytes / 2 + 2 * kv_bytes}};
    const stria_call_shape_t shape = {.batch = s->B, .seq_len = s->S, .causal = true};
    const stria_call_place_t place = {.call = 0};
    Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    Stria__V1__CallShape pb;
    Stria__V1__JobSpec__Window win;
    uint8_t bound[STRIA_CALL_BINDING_BYTES];
    stria_call_shape_to_pb(&shape, &pb, &win);
    req.job_id = job_id;
    req.rank = (uint32_t)s->rank;
    req.shape = &pb;
    stria_call_place_to_pb(&place, &req);
    stria_call_binding(&shape, (int)stria_job_layout(job), &place, bound);
    stria_rpc_request_t rq = {.method = STRIA_RPC_WORKER_SESSION_CALL,
                              .request = &req.base,
                              .payload_iov = iov,
                              .payload_iovcnt = 2,
                              .timeout_s = 10,
                              .job_secret = &r.secret,
                              .job_id = job_id,
                              .proof_extra = bound,
                              .proof_extra_len = sizeof(bound)};
    stria_rpc_reply_t rep = {0};
    (void)stria_rpc_client_call(r.c, &rq, &rep); /* fails at the unreadable half */
    printf("shard_rank: dying mid-upload\n");
    fflush(stdout);
    usleep(500000);
    raise(SIGKILL);
    return 1;
}

static int die_shm(stria_job_t *job, int rank)
{
    stria_shard_buffer_t q = STRIA_SHARD_BUFFER_INIT;
    stria_status_t st = stria_job_shard_buffer(job, rank, STRIA_TENSOR_Q, &q);
    if (st != STRIA_OK)
        return fail(st, "shard buffer");
    memset(q.data, 0x3c, (size_t)(q.outer_stride * q.outer / 2));
    printf("shard_rank: dying mid-upload\n");
    fflush(stdout);
    usleep(500000);
    raise(SIGKILL);
    return 1;
}

/* Says "rank R: SAY" and waits (5 minutes at most) for the file DIR/NAME. */
static void wait_file(int rank, const char *dir, const char *name, const char *say)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    printf("rank %d: %s\n", rank, say);
    fflush(stdout);
    for (int i = 0; i < 6000 && access(path, F_OK) != 0; i++)
        usleep(50000);
}

/* The rank's forward and backward passes, its tensors in its own buffers
 * (inplace: in the worker's shared buffers); outputs to files. */
static int run(stria_job_t *job, const shape_t *s, uint64_t seed, bool inplace, bool again,
               bool pause, const char *dir)
{
    static const stria_tensor_id_t ids[9] = {STRIA_TENSOR_Q,  STRIA_TENSOR_K,  STRIA_TENSOR_V,
                                             STRIA_TENSOR_DO, STRIA_TENSOR_O,  STRIA_TENSOR_LSE,
                                             STRIA_TENSOR_DQ, STRIA_TENSOR_DK, STRIA_TENSOR_DV};
    static const char *const names[9] = {"q", "k", "v", "do", "o", "lse", "dq", "dk", "dv"};
    size_t rq = (size_t)(s->B * s->T * s->H * s->D) * s->es;
    size_t rk = (size_t)(s->B * s->T * s->Hkv * s->D) * s->es;
    size_t bytes[9] = {rq, rk, rk, rq, rq, (size_t)(s->B * s->H * s->T) * 4, rq, rk, rk};
    void *own[9] = {make_shard(s, s->H, seed), make_shard(s, s->Hkv, seed + 1),
                    make_shard(s, s->Hkv, seed + 2), make_shard(s, s->H, seed + 3)};
    void *use[9];
    stria_shard_buffer_t buf[9];
    stria_status_t st = STRIA_OK;
    for (int t = 4; t < 9; t++)
        own[t] = calloc(1, bytes[t]);
    for (int t = 0; t < 9; t++) {
        use[t] = own[t];
        buf[t] = (stria_shard_buffer_t)STRIA_SHARD_BUFFER_INIT;
        if (inplace && (st = stria_job_shard_buffer(job, s->rank, ids[t], &buf[t])) != STRIA_OK)
            return fail(st, "shard buffer");
        if (inplace)
            use[t] = buf[t].data;
        if (inplace && t < 4) /* the trainer fills its inputs where the worker reads them */
            copy_strided(&buf[t], own[t], true);
    }
    for (int tries = 1;; tries++) {
        st = stria_client_forward_shard(job, s->rank, use[0], use[1], use[2], use[4], use[5]);
        if (st == STRIA_OK && pause && tries == 1) /* until OUTDIR/go exists */
            wait_file(s->rank, dir, "go", "forward done");
        if (st == STRIA_OK)
            st = stria_client_backward_shard(job, s->rank, use[3], use[6], use[7], use[8]);
        if (st == STRIA_OK || !again || tries > 2 || !stria_error_retryable())
            break;
        fprintf(stderr, "rank %d: trying again (job %llu now): %s\n", s->rank,
                (unsigned long long)stria_job_id(job), stria_error_msg());
    }
    if (st != STRIA_OK)
        return fail(st, "pass");
    for (int t = 4; t < 9; t++) {
        if (inplace)
            copy_strided(&buf[t], own[t], false);
        write_file(dir, s->rank, names[t], own[t], bytes[t]);
    }
    for (int t = 0; t < 9; t++)
        free(own[t]);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 14) {
        fprintf(stderr, "usage: shard_rank COORD EXPORT_HEX RANK PATH MODE OUTDIR B S H HKV D "
                        "DTYPE SEED\n");
        return 2;
    }
    shape_t s = {.B = atoll(argv[7]),
                 .S = atoll(argv[8]),
                 .H = atoll(argv[9]),
                 .Hkv = atoll(argv[10]),
                 .D = atoll(argv[11]),
                 .dt = (stria_dtype_t)atoi(argv[12]),
                 .rank = atoi(argv[3])};
    s.es = stria_dtype_size(s.dt);
    uint64_t seed = strtoull(argv[13], NULL, 10);
    const char *mode = argv[5];
    uint8_t exp[STRIA_JOB_EXPORT_BYTES];
    for (int i = 0; i < STRIA_JOB_EXPORT_BYTES; i++) {
        unsigned v = 0;
        sscanf(argv[2] + 2 * i, "%2x", &v);
        exp[i] = (uint8_t)v;
    }
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    p.coordinator = argv[1];
    p.client_name = "shard_rank";
    p.data_path = strcmp(argv[4], "tcp") == 0   ? STRIA_DATA_PATH_TCP
                  : strcmp(argv[4], "shm") == 0 ? STRIA_DATA_PATH_SHM
                                                : STRIA_DATA_PATH_AUTO;
    stria_client_t *c = NULL;
    stria_job_t *job = NULL;
    stria_status_t st = stria_client_connect(&p, &c);
    if (st != STRIA_OK)
        return fail(st, "connect");
    if ((st = stria_job_import(c, exp, sizeof(exp), &job)) != STRIA_OK)
        return fail(st, "import");
    s.T = stria_job_shard_tokens(job, s.rank);
    s.pos = malloc((size_t)(s.T + 1) * sizeof(int64_t));
    if (s.T < 1 || (st = stria_job_positions(job, s.rank, s.pos)) != STRIA_OK)
        return fail(st, "positions");
    if (strcmp(mode, "die-tcp") == 0)
        return die_tcp(argv[1], job, &s);
    if (strcmp(mode, "die-shm") == 0)
        return die_shm(job, s.rank);
    int rc = run(job, &s, seed, strncmp(mode, "inplace", 7) == 0, strstr(mode, "-again") != NULL,
                 strstr(mode, "-pause") != NULL, argv[6]);
    if (rc == 0 && strstr(mode, "-hold") != NULL)
        wait_file(s.rank, argv[6], "release", "holding the job");
    if (rc == 0) {
        printf("shard_rank: ok path=%s\n",
               stria_job_data_path(job, s.rank) == STRIA_DATA_PATH_SHM ? "shm" : "tcp");
        fflush(stdout);
    }
    free(s.pos);
    stria_client_release(job);
    stria_client_close(c);
    return rc;
}
