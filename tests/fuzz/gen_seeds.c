/* Writes the seed corpora of the fuzz targets: corpus/<target>/seed-*.
 * Run it after a change of the protocol, the frame, a file format or the
 * order in which the coordinator draws random bytes, then commit the result
 * (regression inputs, corpus/<target>/crash-*, stay):
 *   tests/fuzz/run.sh --seeds
 * The seeds are valid and near-valid inputs of each parser, so that the
 * fuzzer starts past the first checks. It is built in the fuzz build only:
 * the rpc_stream seeds answer the servers' challenges and prove job secrets
 * with the nonces, job ids and secrets of that build's fixed random sequence
 * (common/auth.c, STRIA_FUZZ_UNSAFE_RANDOM), which it draws like the servers
 * do. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_rpc.h"
#include "fuzz_util.h"
#include "proto_types.h"
#include "stria_auth.h"
#include "stria_rpc.h"
#include "ucx_int.h"

#ifndef STRIA_FUZZ_UNSAFE_RANDOM
#error "the seed generator is built in the fuzz build only (tests/fuzz/run.sh --seeds)"
#endif

static const char *root;

typedef struct {
    uint8_t *b;
    size_t n, cap;
} buf_t;

static void put(buf_t *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 256;
        b->b = realloc(b->b, b->cap);
        if (b->b == NULL)
            abort();
    }
    memcpy(b->b + b->n, p, n);
    b->n += n;
}

static void save(const char *target, const char *name, const buf_t *b)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", root, target);
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/%s/seed-%s", root, target, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(b->b, 1, b->n, f) != b->n || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
        exit(1);
    }
}

static void save_text(const char *target, const char *name, const char *text)
{
    buf_t b = {0};
    put(&b, text, strlen(text));
    save(target, name, &b);
    free(b.b);
}

/* ---- RPC frames ----------------------------------------------------------- */

static void frame(buf_t *b, uint16_t flags, uint32_t method, uint64_t id, const ProtobufCMessage *m,
                  const void *payload, uint64_t payload_len)
{
    size_t pb = m ? protobuf_c_message_get_packed_size(m) : 0;
    stria_rpc_header_t h = {.magic = STRIA_RPC_MAGIC,
                            .version = STRIA_RPC_VERSION,
                            .flags = flags,
                            .method = method,
                            .request_id = id,
                            .pb_len = (uint32_t)pb,
                            .timeout_ms = 5000,
                            .payload_len = payload_len};
    uint8_t hdr[STRIA_RPC_HEADER_SIZE];
    stria_rpc_header_encode(&h, hdr);
    put(b, hdr, sizeof(hdr));
    if (pb > 0) {
        uint8_t *tmp = malloc(pb);
        protobuf_c_message_pack(m, tmp);
        put(b, tmp, pb);
        free(tmp);
    }
    if (payload_len > 0)
        put(b, payload, payload_len);
}

/* ---- RPC seeds: the hello and job proofs ---------------------------------- */

/* The session of the seed being written: the client nonce it sends, the
 * server nonce the server will draw (the first draw of its input). */
static stria_auth_session_t sess;
static uint64_t next_id; /* request ids */

static void seed_begin(buf_t *b, uint8_t server)
{
    b->n = 0;
    put(b, &server, 1);
    for (size_t i = 0; i < STRIA_AUTH_NONCE_BYTES; i++)
        sess.client_nonce[i] = (uint8_t)(0xc0 + i);
    stria_auth_fuzz_reset(); /* what the target does before each input */
    if (stria_auth_random(sess.server_nonce, STRIA_AUTH_NONCE_BYTES) != STRIA_OK)
        abort();
    next_id = 1;
}

typedef enum {
    HELLO_OPEN,     /* a server without credentials: one frame */
    HELLO_PROOF,    /* the challenge answered with `token` */
    HELLO_NO_PROOF, /* the second frame without a proof */
    HELLO_CLEAR,    /* the old hello: the token in clear text */
} hello_kind_t;

static void hello(buf_t *b, const char *service, hello_kind_t kind, const char *token)
{
    Stria__V1__HelloRequest h = STRIA__V1__HELLO_REQUEST__INIT;
    uint8_t proof[STRIA_AUTH_MAC_BYTES];
    h.protocol_version = STRIA_RPC_VERSION;
    h.software_version = "0.1.0";
    h.service = (char *)service;
    h.client_name = "fuzz-seed";
    if (kind == HELLO_CLEAR) {
        h.token = (char *)token;
    } else {
        h.client_nonce.data = sess.client_nonce;
        h.client_nonce.len = STRIA_AUTH_NONCE_BYTES;
    }
    frame(b, STRIA_RPC_FLAG_HELLO, 0, next_id++, &h.base, NULL, 0);
    if (kind == HELLO_OPEN || kind == HELLO_CLEAR)
        return;
    h.client_nonce.len = 0;
    if (kind == HELLO_PROOF) {
        stria_auth_hello_mac(token, service, sess.client_nonce, sess.server_nonce, false, proof);
        h.proof.data = proof;
        h.proof.len = sizeof(proof);
    }
    frame(b, STRIA_RPC_FLAG_HELLO, 0, next_id++, &h.base, NULL, 0);
}

/* The id and secret of the job a coordinator admits next (its draws, in the
 * order of coord_clients.c: id, secret, ring key), then the draw of the
 * sealed secret in the SubmitJob reply. */
static uint64_t next_job(stria_job_secret_t *secret)
{
    uint8_t raw[8], ring[STRIA_AUTH_KEY_BYTES], seal[12];
    uint64_t id;
    do {
        if (stria_auth_random(raw, sizeof(raw)) != STRIA_OK)
            abort();
        id = stria_get_le64(raw) >> 11;
    } while (id == 0);
    if (stria_auth_random(secret->bytes, sizeof(secret->bytes)) != STRIA_OK ||
        stria_auth_random(ring, sizeof(ring)) != STRIA_OK ||
        stria_auth_random(seal, sizeof(seal)) != STRIA_OK)
        abort();
    return id;
}

/* Sets *proof (job_proof, field 60) of the request about to be framed with
 * id next_id. */
static void prove(ProtobufCBinaryData *proof, uint8_t mac[STRIA_AUTH_MAC_BYTES],
                  const stria_job_secret_t *secret, uint32_t method, uint64_t job_id)
{
    stria_job_secret_prove(secret, &sess, next_id, method, job_id, mac);
    proof->data = mac;
    proof->len = STRIA_AUTH_MAC_BYTES;
}

/* A request frame with the next request id. */
static void req(buf_t *b, uint32_t method, const ProtobufCMessage *m, const void *payload,
                uint64_t payload_len)
{
    frame(b, 0, method, next_id++, m, payload, payload_len);
}

static Stria__V1__RegisterWorkerRequest reg_req(const char *rpc, uint64_t incarnation)
{
    Stria__V1__RegisterWorkerRequest r = STRIA__V1__REGISTER_WORKER_REQUEST__INIT;
    r.rpc_address = (char *)rpc;
    r.ucx_address = "127.0.0.1:9001";
    r.host = "node-a";
    r.device = "cpu";
    r.memory_bytes = (uint64_t)1 << 30;
    r.software_version = "0.1.0";
    r.kernel_variant = "portable";
    r.incarnation = incarnation;
    return r;
}

/* A small job on `ring` workers, with documents and a window. */
static Stria__V1__SubmitJobRequest submit_req(uint32_t ring)
{
    static Stria__V1__JobSpec spec = STRIA__V1__JOB_SPEC__INIT;
    static Stria__V1__JobSpec__Window win = STRIA__V1__JOB_SPEC__WINDOW__INIT;
    static int64_t cu[] = {0, 5, 64};
    Stria__V1__SubmitJobRequest sub = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    spec.batch = 1;
    spec.seq_len = 64;
    spec.heads = 2;
    spec.kv_heads = 1;
    spec.head_dim = 16;
    spec.causal = true;
    spec.ring_size = ring;
    spec.ttl_s = 60;
    spec.step_timeout_ms = 1000;
    spec.label = "seed";
    spec.n_cu_seqlens = 3;
    spec.cu_seqlens = cu;
    win.left = 16;
    win.right = 0;
    spec.window = &win;
    sub.spec = &spec;
    return sub;
}

/* Seeds of the coordinator without credentials: one connection has every
 * role, so one input registers workers, submits a job and proves it. */
static void coordinator_seeds(void)
{
    const char *svc = stria__v1__coordinator__descriptor.name;
    const uint8_t sel = FUZZ_SERVER_COORD;
    stria_job_secret_t secret;
    uint8_t mac[STRIA_AUTH_MAC_BYTES];
    buf_t b = {0};
    uint64_t job;

    /* a worker's life: register, a job, heartbeat with it, reports,
     * deregister */
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_OPEN, NULL);
    Stria__V1__RegisterWorkerRequest r = reg_req("127.0.0.1:9000", 42);
    req(&b, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &r.base, NULL, 0);
    Stria__V1__SubmitJobRequest sub = submit_req(1);
    job = next_job(&secret);
    req(&b, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &sub.base, NULL, 0);
    Stria__V1__WorkerJobStatus js = STRIA__V1__WORKER_JOB_STATUS__INIT, *jsp = &js;
    js.job_id = job;
    js.phase = STRIA__V1__JOB_STATE__JOB_STATE_LOADING;
    js.idle_ms = 10;
    Stria__V1__HeartbeatRequest hb = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    hb.worker_id = 1;
    hb.incarnation = 42;
    hb.n_jobs = 1;
    hb.jobs = &jsp;
    req(&b, STRIA_RPC_COORDINATOR_HEARTBEAT, &hb.base, NULL, 0);
    Stria__V1__ReportJobRequest rep = STRIA__V1__REPORT_JOB_REQUEST__INIT;
    rep.worker_id = 1;
    rep.job_id = job;
    rep.message = "";
    rep.event = STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_LOADED;
    req(&b, STRIA_RPC_COORDINATOR_REPORT_JOB, &rep.base, NULL, 0);
    rep.event = STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_STARTED;
    req(&b, STRIA_RPC_COORDINATOR_REPORT_JOB, &rep.base, NULL, 0);
    rep.event = STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_DONE;
    req(&b, STRIA_RPC_COORDINATOR_REPORT_JOB, &rep.base, NULL, 0);
    rep.event = STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED;
    rep.message = "seed: out of memory";
    req(&b, STRIA_RPC_COORDINATOR_REPORT_JOB, &rep.base, NULL, 0);
    Stria__V1__DeregisterWorkerRequest de = STRIA__V1__DEREGISTER_WORKER_REQUEST__INIT;
    de.worker_id = 1;
    de.incarnation = 42;
    de.reason = "shut down";
    req(&b, STRIA_RPC_COORDINATOR_DEREGISTER_WORKER, &de.base, NULL, 0);
    save("rpc_stream", "coordinator-worker", &b);

    /* a client's job: two workers register, submit, get (proven), list,
     * release (proven), then a wrong proof and a replayed request id */
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_OPEN, NULL);
    Stria__V1__RegisterWorkerRequest r1 = reg_req("127.0.0.1:9100", 7);
    Stria__V1__RegisterWorkerRequest r2 = reg_req("127.0.0.1:9101", 8);
    req(&b, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &r1.base, NULL, 0);
    req(&b, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &r2.base, NULL, 0);
    sub = submit_req(2);
    job = next_job(&secret);
    req(&b, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &sub.base, NULL, 0);
    Stria__V1__GetJobRequest gj = STRIA__V1__GET_JOB_REQUEST__INIT;
    gj.job_id = job;
    gj.include_timelines = true;
    prove(&gj.job_proof, mac, &secret, STRIA_RPC_COORDINATOR_GET_JOB, job);
    req(&b, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, NULL, 0);
    Stria__V1__ListJobsRequest lj = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    lj.include_finished = true;
    req(&b, STRIA_RPC_COORDINATOR_LIST_JOBS, &lj.base, NULL, 0);
    Stria__V1__ReleaseJobRequest rj = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    rj.job_id = job;
    prove(&rj.job_proof, mac, &secret, STRIA_RPC_COORDINATOR_RELEASE_JOB, job);
    req(&b, STRIA_RPC_COORDINATOR_RELEASE_JOB, &rj.base, NULL, 0);
    save("rpc_stream", "coordinator-client", &b);

    /* the same job, then a wrong proof, another job's proof and a replayed
     * request id */
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_OPEN, NULL);
    req(&b, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &r1.base, NULL, 0);
    sub = submit_req(1);
    job = next_job(&secret);
    req(&b, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &sub.base, NULL, 0);
    gj.job_id = rj.job_id = job;
    gj.job_proof.data = (uint8_t *)"a wrong proof of 32 bytes.......";
    req(&b, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, NULL, 0);
    prove(&rj.job_proof, mac, &secret, STRIA_RPC_COORDINATOR_RELEASE_JOB, job + 1);
    req(&b, STRIA_RPC_COORDINATOR_RELEASE_JOB, &rj.base, NULL, 0);
    next_id += 5;
    prove(&gj.job_proof, mac, &secret, STRIA_RPC_COORDINATOR_GET_JOB, job);
    req(&b, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, NULL, 0);
    next_id -= 3; /* a proven ReleaseJob under an id older than the one checked */
    prove(&rj.job_proof, mac, &secret, STRIA_RPC_COORDINATOR_RELEASE_JOB, job);
    req(&b, STRIA_RPC_COORDINATOR_RELEASE_JOB, &rj.base, NULL, 0);
    save("rpc_stream", "coordinator-bad-proof", &b);

    /* admin: status, ring, workers, a job, drain, cancel */
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_OPEN, NULL);
    req(&b, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &r1.base, NULL, 0);
    sub = submit_req(1);
    job = next_job(&secret);
    req(&b, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &sub.base, NULL, 0);
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    req(&b, STRIA_RPC_COORDINATOR_GET_STATUS, &gs.base, NULL, 0);
    Stria__V1__GetRingRequest gr = STRIA__V1__GET_RING_REQUEST__INIT;
    req(&b, STRIA_RPC_COORDINATOR_GET_RING, &gr.base, NULL, 0);
    Stria__V1__ListWorkersRequest lw = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    req(&b, STRIA_RPC_COORDINATOR_LIST_WORKERS, &lw.base, NULL, 0);
    Stria__V1__GetJobRequest view = STRIA__V1__GET_JOB_REQUEST__INIT; /* an admin's view */
    view.job_id = job;
    req(&b, STRIA_RPC_COORDINATOR_GET_JOB, &view.base, NULL, 0);
    Stria__V1__DrainWorkerRequest dr = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    dr.worker_id = 1;
    dr.drain = true;
    req(&b, STRIA_RPC_COORDINATOR_DRAIN_WORKER, &dr.base, NULL, 0);
    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    cj.job_id = job;
    cj.reason = "seed";
    req(&b, STRIA_RPC_COORDINATOR_CANCEL_JOB, &cj.base, NULL, 0);
    save("rpc_stream", "coordinator-admin", &b);

    /* framing faults: a request before the hello, a bad magic, a truncated
     * frame, the old hello (a token in clear text) */
    seed_begin(&b, sel);
    req(&b, STRIA_RPC_COORDINATOR_GET_STATUS, &gs.base, NULL, 0);
    save("rpc_stream", "no-hello", &b);
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_OPEN, NULL);
    put(&b, "GET / HTTP/1.1\r\n\r\n", 18);
    put(&b, "0123456789012345678901234567890123456789", 40);
    save("rpc_stream", "bad-magic", &b);
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_OPEN, NULL);
    req(&b, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &sub.base, NULL, 0);
    b.n -= 3;
    save("rpc_stream", "truncated", &b);
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_CLEAR, "a-token");
    req(&b, STRIA_RPC_COORDINATOR_GET_STATUS, &gs.base, NULL, 0);
    save("rpc_stream", "clear-token", &b);
    free(b.b);
}

/* Seeds of the coordinator with a credential per role: each role's
 * methods, and the methods of the others refused. */
static void coordinator_role_seeds(void)
{
    const char *svc = stria__v1__coordinator__descriptor.name;
    const uint8_t sel = FUZZ_SERVER_COORD_ROLES;
    buf_t b = {0};

    seed_begin(&b, sel);
    hello(&b, svc, HELLO_PROOF, FUZZ_WORKER_TOKEN);
    Stria__V1__RegisterWorkerRequest r = reg_req("127.0.0.1:9200", 9);
    req(&b, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &r.base, NULL, 0);
    Stria__V1__HeartbeatRequest hb = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    hb.worker_id = 1;
    hb.incarnation = 9;
    req(&b, STRIA_RPC_COORDINATOR_HEARTBEAT, &hb.base, NULL, 0);
    Stria__V1__GetJobRequest gj = STRIA__V1__GET_JOB_REQUEST__INIT;
    gj.job_id = 12345;
    req(&b, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, NULL, 0);
    Stria__V1__SubmitJobRequest sub = submit_req(1);
    req(&b, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &sub.base, NULL, 0); /* a client's */
    Stria__V1__ListJobsRequest lj = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    req(&b, STRIA_RPC_COORDINATOR_LIST_JOBS, &lj.base, NULL, 0); /* an admin's */
    Stria__V1__DeregisterWorkerRequest de = STRIA__V1__DEREGISTER_WORKER_REQUEST__INIT;
    de.worker_id = 1;
    de.incarnation = 9;
    de.reason = "shut down";
    req(&b, STRIA_RPC_COORDINATOR_DEREGISTER_WORKER, &de.base, NULL, 0);
    save("rpc_stream", "roles-worker", &b);

    seed_begin(&b, sel);
    hello(&b, svc, HELLO_PROOF, FUZZ_TOKEN);
    req(&b, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &sub.base, NULL, 0); /* no workers: busy */
    req(&b, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, NULL, 0);
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    req(&b, STRIA_RPC_COORDINATOR_GET_STATUS, &gs.base, NULL, 0);
    req(&b, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &r.base, NULL, 0); /* a worker's */
    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    cj.job_id = 12345;
    cj.reason = "seed";
    req(&b, STRIA_RPC_COORDINATOR_CANCEL_JOB, &cj.base, NULL, 0); /* an admin's */
    save("rpc_stream", "roles-client", &b);

    seed_begin(&b, sel);
    hello(&b, svc, HELLO_PROOF, FUZZ_ADMIN_TOKEN);
    req(&b, STRIA_RPC_COORDINATOR_GET_STATUS, &gs.base, NULL, 0);
    Stria__V1__ListWorkersRequest lw = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    req(&b, STRIA_RPC_COORDINATOR_LIST_WORKERS, &lw.base, NULL, 0);
    lj.include_finished = true;
    req(&b, STRIA_RPC_COORDINATOR_LIST_JOBS, &lj.base, NULL, 0);
    req(&b, STRIA_RPC_COORDINATOR_GET_JOB, &gj.base, NULL, 0);
    Stria__V1__DrainWorkerRequest dr = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    dr.worker_id = 1;
    dr.drain = true;
    req(&b, STRIA_RPC_COORDINATOR_DRAIN_WORKER, &dr.base, NULL, 0);
    req(&b, STRIA_RPC_COORDINATOR_CANCEL_JOB, &cj.base, NULL, 0);
    save("rpc_stream", "roles-admin", &b);

    seed_begin(&b, sel);
    hello(&b, svc, HELLO_PROOF, "wrong-token");
    req(&b, STRIA_RPC_COORDINATOR_GET_STATUS, &gs.base, NULL, 0);
    save("rpc_stream", "roles-wrong-token", &b);
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_NO_PROOF, NULL);
    req(&b, STRIA_RPC_COORDINATOR_GET_STATUS, &gs.base, NULL, 0);
    save("rpc_stream", "roles-no-proof", &b);
    free(b.b);
}

/* Seeds of the stub worker (client and admin credentials, see
 * fuzz_rpc_stream.c): each way its SessionCall takes a payload (a forward
 * call) and replies with one (a backward call), unproven (job ids under
 * FUZZ_PROVEN_JOBS) and proven; its admin's OpenSession replying later. */
static void worker_seeds(void)
{
    const char *svc = stria__v1__worker__descriptor.name;
    const uint8_t sel = FUZZ_SERVER_WORKER;
    static uint8_t bytes[256];
    stria_job_secret_t secret;
    uint8_t mac[STRIA_AUTH_MAC_BYTES];
    buf_t b = {0};

    memset(secret.bytes, FUZZ_JOB_SECRET_BYTE, sizeof(secret.bytes));
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_PROOF, FUZZ_TOKEN);
    Stria__V1__SessionCallRequest put = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    put.piece_offset = 0;
    for (uint64_t job = 0; job < 5; job++) { /* each way the stub takes a payload */
        put.job_id = job + 5;
        req(&b, STRIA_RPC_WORKER_SESSION_CALL, &put.base, bytes, sizeof(bytes));
    }
    for (uint64_t job = 0; job < 5; job++) { /* the same, proven */
        put.job_id = job + FUZZ_PROVEN_JOBS;
        prove(&put.job_proof, mac, &secret, STRIA_RPC_WORKER_SESSION_CALL, put.job_id);
        req(&b, STRIA_RPC_WORKER_SESSION_CALL, &put.base, bytes, sizeof(bytes));
    }
    Stria__V1__SessionCallRequest get = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    get.backward = true;
    get.job_id = 5;
    get.piece_offset = 1; /* sent in place */
    get.call = 100;       /* at most 100 bytes */
    req(&b, STRIA_RPC_WORKER_SESSION_CALL, &get.base, NULL, 0);
    get.piece_offset = 0;
    get.job_id = FUZZ_PROVEN_JOBS;
    prove(&get.job_proof, mac, &secret, STRIA_RPC_WORKER_SESSION_CALL, get.job_id);
    req(&b, STRIA_RPC_WORKER_SESSION_CALL, &get.base, NULL, 0);
    Stria__V1__DropJobRequest dj = STRIA__V1__DROP_JOB_REQUEST__INIT;
    dj.job_id = FUZZ_PROVEN_JOBS + 1;
    prove(&dj.job_proof, mac, &secret, STRIA_RPC_WORKER_DROP_JOB, dj.job_id);
    req(&b, STRIA_RPC_WORKER_DROP_JOB, &dj.base, NULL, 0);
    Stria__V1__OpenSessionRequest os = STRIA__V1__OPEN_SESSION_REQUEST__INIT;
    os.job_id = 5;
    req(&b, STRIA_RPC_WORKER_OPEN_SESSION, &os.base, NULL, 0); /* an admin's */
    save("rpc_stream", "worker-client", &b);

    /* wrong proofs: another job's, a replayed request id, none */
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_PROOF, FUZZ_TOKEN);
    put.job_id = FUZZ_PROVEN_JOBS + 1;
    prove(&put.job_proof, mac, &secret, STRIA_RPC_WORKER_SESSION_CALL, FUZZ_PROVEN_JOBS + 6);
    req(&b, STRIA_RPC_WORKER_SESSION_CALL, &put.base, bytes, sizeof(bytes));
    dj.job_id = FUZZ_PROVEN_JOBS + 2;
    next_id += 5;
    prove(&dj.job_proof, mac, &secret, STRIA_RPC_WORKER_DROP_JOB, dj.job_id);
    req(&b, STRIA_RPC_WORKER_DROP_JOB, &dj.base, NULL, 0);
    next_id -= 3;
    prove(&dj.job_proof, mac, &secret, STRIA_RPC_WORKER_DROP_JOB, dj.job_id);
    req(&b, STRIA_RPC_WORKER_DROP_JOB, &dj.base, NULL, 0);
    get.job_proof.len = 0;
    req(&b, STRIA_RPC_WORKER_SESSION_CALL, &get.base, NULL, 0);
    save("rpc_stream", "worker-bad-proof", &b);

    /* the admin's OpenSession: replied from the helper thread, at once
     * (busy), and from the loop, more than the server's in-flight limit */
    seed_begin(&b, sel);
    hello(&b, svc, HELLO_PROOF, FUZZ_ADMIN_TOKEN);
    req(&b, STRIA_RPC_WORKER_OPEN_SESSION, &os.base, NULL, 0);
    os.job_id = 6;
    req(&b, STRIA_RPC_WORKER_OPEN_SESSION, &os.base, NULL, 0);
    os.job_id = 7;
    for (int i = 0; i < 12; i++)
        req(&b, STRIA_RPC_WORKER_OPEN_SESSION, &os.base, NULL, 0);
    save("rpc_stream", "worker-admin", &b);

    seed_begin(&b, sel);
    hello(&b, svc, HELLO_PROOF, "wrong-token");
    save("rpc_stream", "worker-wrong-token", &b);
    free(b.b);
}

/* ---- protobuf messages, one per type --------------------------------------- */

static void proto_seeds(void)
{
    fuzz_types_t t;
    if (fuzz_types_init(&t) != 0)
        abort();
    for (size_t i = 0; i < t.n; i++) {
        /* every field set to a small value, nested messages once */
        const ProtobufCMessageDescriptor *d = t.d[i];
        ProtobufCMessage *m = calloc(1, d->sizeof_message);
        uint8_t sel = (uint8_t)i;
        buf_t b = {0};
        d->message_init(m);
        for (unsigned f = 0; f < d->n_fields; f++) {
            const ProtobufCFieldDescriptor *fd = &d->fields[f];
            void *p = (char *)m + fd->offset;
            if (fd->label == PROTOBUF_C_LABEL_REPEATED)
                continue;
            switch (fd->type) {
            case PROTOBUF_C_TYPE_UINT32:
            case PROTOBUF_C_TYPE_INT32:
            case PROTOBUF_C_TYPE_SINT32:
            case PROTOBUF_C_TYPE_ENUM:
                *(uint32_t *)p = 1;
                break;
            case PROTOBUF_C_TYPE_UINT64:
            case PROTOBUF_C_TYPE_INT64:
            case PROTOBUF_C_TYPE_SINT64:
                *(uint64_t *)p = 1000;
                break;
            case PROTOBUF_C_TYPE_BOOL:
                *(protobuf_c_boolean *)p = 1;
                break;
            case PROTOBUF_C_TYPE_FLOAT:
                *(float *)p = 0.5f;
                break;
            case PROTOBUF_C_TYPE_STRING:
                *(const char **)p = "seed";
                break;
            default:
                break;
            }
        }
        put(&b, &sel, 1);
        size_t n = protobuf_c_message_get_packed_size(m);
        uint8_t *tmp = malloc(n + 1);
        protobuf_c_message_pack(m, tmp);
        put(&b, tmp, n);
        char name[128];
        snprintf(name, sizeof(name), "%02zu-%s", i, d->short_name);
        save("proto", name, &b);
        free(tmp);
        free(b.b);
        free(m);
    }
}

/* ---- UCX control messages ------------------------------------------------------ */

static void ucx_seeds(void)
{
    static const char *const names[] = {"",     "ep-hello", "ep-welcome", "ep-proof", "ep-ready",
                                        "bind", "bound",    "abort",      "bye",      "ping"};
    for (uint16_t type = STRIA__CTRL_EP_HELLO; type <= STRIA__CTRL_LAST; type++) {
        stria__ctrl_t c;
        uint8_t out[STRIA__UCX_CTRL_MAX];
        bool link = type >= STRIA__CTRL_BIND;
        memset(&c, 0, sizeof(c));
        c.type = type;
        c.flags =
            type == STRIA__CTRL_BIND || type == STRIA__CTRL_EP_HELLO ? STRIA__CTRL_FLAG_KEYED : 0;
        c.job_id = link ? 7 : 0;
        c.ring_id = link ? 3 : 0;
        c.rank = link ? 1 : 0;
        c.size = link ? 4 : 0;
        c.slot = type == STRIA__CTRL_EP_HELLO ? 7600 : 0x10002;
        c.dst = link ? 0x30001 : 0;
        c.origin = type == STRIA__CTRL_ABORT ? 2 : -1;
        c.reporter = type == STRIA__CTRL_ABORT ? 3 : -1;
        c.status = type == STRIA__CTRL_ABORT ? STRIA_ERR_INVALID_ARG : 0;
        c.counter = type == STRIA__CTRL_BIND || type == STRIA__CTRL_BOUND ? 5 : 0;
        c.incarnation = type <= STRIA__CTRL_EP_WELCOME ? 0x1234567890abcdefull : 0;
        snprintf(c.text, sizeof(c.text), "%s", type == STRIA__CTRL_ABORT ? "rank 2: stalled" : "");
        for (size_t i = 0; i < sizeof(c.nonce); i++) { /* read by the types that carry them */
            c.nonce[i] = (uint8_t)(0x10 + i);
            c.mac[i % sizeof(c.mac)] = (uint8_t)(0x80 + i);
        }
        buf_t b = {0};
        put(&b, out, stria__ucx_ctrl_encode(&c, out));
        save("ucx_ctrl", names[type], &b);
        free(b.b);
    }
    /* A version 2 worker's HELLO (the version refusal answers it in its
     * own format). */
    uint8_t v2[110];
    memset(v2, 0, sizeof(v2));
    stria_put_le32(v2, STRIA__UCX_MAGIC);
    stria_put_le16(v2 + 4, 2);
    stria_put_le16(v2 + 6, 1);
    stria_put_le64(v2 + 8, 7);
    stria_put_le64(v2 + 16, 3);
    stria_put_le32(v2 + 24, 1);
    stria_put_le32(v2 + 28, 4);
    buf_t b = {0};
    put(&b, v2, sizeof(v2));
    save("ucx_ctrl", "v2-hello", &b);
    free(b.b);
}

/* ---- files ---------------------------------------------------------------------- */

static void npy(const char *name, int version, const char *descr, const char *shape, size_t bytes)
{
    char hdr[256];
    int n = snprintf(hdr, sizeof(hdr), "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
                     descr, shape);
    buf_t b = {0};
    size_t pre = version == 1 ? 10 : 12;
    while ((pre + (size_t)n + 1) % 64 != 0)
        hdr[n++] = ' ';
    hdr[n++] = '\n';
    put(&b, "\x93NUMPY", 6);
    uint8_t v[2] = {(uint8_t)version, 0};
    put(&b, v, 2);
    uint8_t len[4] = {(uint8_t)n, (uint8_t)(n >> 8), 0, 0};
    put(&b, len, version == 1 ? 2 : 4);
    put(&b, hdr, (size_t)n);
    for (size_t i = 0; i < bytes; i++) {
        uint8_t x = (uint8_t)(i * 37);
        put(&b, &x, 1);
    }
    save("npy", name, &b);
    free(b.b);
}

static void file_seeds(void)
{
    npy("f4-2x3", 1, "<f4", "(2, 3)", 24);
    npy("f2-4", 1, "<f2", "(4,)", 8);
    npy("f8-scalar", 2, "<f8", "()", 8);
    npy("f4-empty", 3, "<f4", "(0, 5)", 0);
    npy("f4-truncated", 1, "<f4", "(1000,)", 40);

    save_text("config", "daemon",
              "# a daemon's file\nlisten = 0.0.0.0:7400\nname = coordinator one\n"
              "count = 12\nmemory = 64G\nratio = 0.25\nperiod = 500ms\ncausal = yes\n"
              "ranks = 0,1,2,3\npeers = a,b\neven = 4\n");
    buf_t b = {0};
    put(&b, "period = 2s\n", 12);
    put(&b, "\0--count=3\n--verbose\n--no-queue\n--listen=[::1]:80", 49);
    save("config", "flags", &b);
    free(b.b);
    save_text("config", "bad", "listen 1.2.3.4\nunknown = 3\nsecret = x\n");

    save_text("http", "get", "\x07GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    save_text("http", "head", "\x3fHEAD /metrics?x=1 HTTP/1.0\n\n");
    save_text("http", "post", "\x01POST /metrics HTTP/1.1\r\n\r\n");
    save_text("http", "other", "\x10GET /other HTTP/1.1\r\n\r\n");

    b = (buf_t){0};
    put(&b,
        "\0"
        "127.0.0.1:7400",
        15);
    save("addr", "v4", &b);
    b.n = 0;
    put(&b, "\0[::1]:65535", 12);
    save("addr", "v6", &b);
    free(b.b);
    save_text("addr", "token", "\x01  s3cret-token \r\nsecond line\n");
    save_text("addr", "equal",
              "\x02"
              "abcdabcd");
    save_text("addr", "bytes",
              "\x03"
              "64GiB");
    save_text("addr", "duration",
              "\x04"
              "1.5m");
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
        return 2;
    }
    root = argv[1];
    mkdir(root, 0755);
    coordinator_seeds();
    coordinator_role_seeds();
    worker_seeds();
    proto_seeds();
    ucx_seeds();
    file_seeds();
    return 0;
}
