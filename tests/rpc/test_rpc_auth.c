/* RPC suite, authentication: tokens and roles, the handshake's challenge
 * and response (replays refused, a server that must prove the token), and
 * job secrets proven per request. */
#include <criterion/criterion.h>

#include "rpc_test_services.h"

/* ---- authentication ---------------------------------------------------- */

Test(rpc_auth, tokens, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord("user-token", "admin-token", 0);
    uint16_t port = stria_rpc_server_port(srv);
    stria_status_t st;
    stria_rpc_client_t *cl;
    uint64_t up = 0;

    cl = connect_to(port, &stria__v1__coordinator__descriptor, NULL, &st);
    cr_expect_eq(st, STRIA_ERR_AUTH, "no token: %s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "missing token") != NULL, "%s", stria_error_msg());
    cr_expect_null(cl);
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "user-tokeN", &st);
    cr_expect_eq(st, STRIA_ERR_AUTH, "wrong token: %s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "wrong token") != NULL, "%s", stria_error_msg());
    cr_expect_null(cl);
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "user-token-longer", &st);
    cr_expect_eq(st, STRIA_ERR_AUTH);

    /* The right user token: normal calls yes, admin calls no. */
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "user-token", &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect(!stria_rpc_client_admin(cl));
    cr_expect_eq(call_status(cl, &up), STRIA_OK);
    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    cj.job_id = 5;
    stria_rpc_request_t rc = {.method = M_CANCEL, .request = &cj.base, .timeout_s = 5};
    stria_rpc_reply_t rep = {0};
    cr_expect_eq(stria_rpc_client_call(cl, &rc, &rep), STRIA_ERR_AUTH);
    cr_expect(strstr(stria_error_msg(), "CancelJob needs the admin token") != NULL, "%s",
              stria_error_msg());
    cr_expect_eq(call_status(cl, &up), STRIA_OK, "refused admin call keeps the connection");
    stria_rpc_client_close(cl);

    /* The admin token: everything. */
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "admin-token", &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect(stria_rpc_client_admin(cl));
    cr_expect_eq(stria_rpc_client_call(cl, &rc, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(((Stria__V1__CancelJobReply *)rep.msg)->state,
                 STRIA__V1__JOB_STATE__JOB_STATE_CANCELLED);
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);

    /* A raw request before any hello is refused and the connection closed. */
    int fd = rt_connect(port);
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    rt_reply_t r;
    cr_assert(rt_send_frame(fd, rt_header(M_STATUS, 9), &gs.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH);
    cr_expect(strstr(r.err->message, "must be a hello") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);
    stria_rpc_server_stop(srv);
}

Test(rpc_auth, admin_token_only, .timeout = TEST_TIMEOUT_S)
{
    /* Any credential turns every hello into a challenge: with only an admin
     * one, a connection without it is refused (no role is open by
     * default), and the admin one gets the admin role only. */
    stria_rpc_server_t *srv = start_coord(NULL, "admin-token", 0);
    uint16_t port = stria_rpc_server_port(srv);
    stria_status_t st;
    stria_rpc_client_t *cl = connect_to(port, &stria__v1__coordinator__descriptor, NULL, &st);
    cr_expect_eq(st, STRIA_ERR_AUTH, "%s", stria_error_msg());
    cr_expect_null(cl);
    cl = connect_to(port, &stria__v1__coordinator__descriptor, "admin-token", &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect(stria_rpc_client_admin(cl));
    cr_expect_eq(stria_rpc_client_roles(cl), STRIA_RPC_ROLE_ADMIN);
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
}

/* Answers every call "served" (status not found): the call got through. */
static void served_handler(void *ctx, stria_rpc_call_t *call)
{
    (void)ctx;
    stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "served");
}

/* A server with the three credentials, methods restricted by role. */
static stria_rpc_server_t *start_roles(void)
{
    stria_rpc_server_params_t p = {0};
    stria_rpc_server_t *srv = NULL;
    memset(g_coord_methods, 0, sizeof(g_coord_methods));
    g_coord_methods[M_STATUS] = (stria_rpc_method_t){.handler = status_handler,
                                                     .name = STRIA_RPC_COORDINATOR_GET_STATUS_NAME};
    g_coord_methods[M_CANCEL] = (stria_rpc_method_t){.handler = served_handler,
                                                     .flags = STRIA_RPC_METHOD_ADMIN,
                                                     .name = STRIA_RPC_COORDINATOR_CANCEL_JOB_NAME};
    g_coord_methods[STRIA_RPC_COORDINATOR_REGISTER_WORKER] =
        (stria_rpc_method_t){.handler = served_handler,
                             .flags = STRIA_RPC_METHOD_WORKER,
                             .name = STRIA_RPC_COORDINATOR_REGISTER_WORKER_NAME};
    g_coord_methods[M_SUBMIT] = (stria_rpc_method_t){.handler = served_handler,
                                                     .flags = STRIA_RPC_METHOD_CLIENT,
                                                     .name = STRIA_RPC_COORDINATOR_SUBMIT_JOB_NAME};
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__coordinator__descriptor;
    p.methods = g_coord_methods;
    p.token = "client-token";
    p.worker_token = "worker-token";
    p.admin_token = "admin-token";
    p.name = "test-roles";
    cr_assert_eq(stria_rpc_server_start(&p, &srv), STRIA_OK, "%s", stria_error_msg());
    return srv;
}

/* The status of calling `method` (STRIA_ERR_NOT_FOUND "served" when the
 * handler ran). */
static stria_status_t call_method(stria_rpc_client_t *cl, uint32_t method)
{
    Stria__V1__RegisterWorkerRequest rw = STRIA__V1__REGISTER_WORKER_REQUEST__INIT;
    Stria__V1__SubmitJobRequest sj = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    const ProtobufCMessage *req = method == M_SUBMIT   ? &sj.base
                                  : method == M_CANCEL ? &cj.base
                                                       : &rw.base;
    stria_rpc_request_t r = {.method = method, .request = req, .timeout_s = 5};
    stria_rpc_reply_t rep = {0};
    stria_status_t st = stria_rpc_client_call(cl, &r, &rep);
    stria_rpc_reply_free(&rep);
    return st;
}

Test(rpc_auth, each_credential_is_one_role, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_roles();
    uint16_t port = stria_rpc_server_port(srv);
    const char *tokens[3] = {"client-token", "worker-token", "admin-token"};
    const unsigned roles[3] = {STRIA_RPC_ROLE_CLIENT, STRIA_RPC_ROLE_WORKER, STRIA_RPC_ROLE_ADMIN};
    /* register (worker only), submit (client or admin), cancel (admin only) */
    const bool allowed[3][3] = {{false, true, false}, {true, false, false}, {false, true, true}};
    const uint32_t methods[3] = {STRIA_RPC_COORDINATOR_REGISTER_WORKER, M_SUBMIT, M_CANCEL};
    for (int i = 0; i < 3; i++) {
        stria_status_t st;
        stria_rpc_client_t *cl =
            connect_to(port, &stria__v1__coordinator__descriptor, tokens[i], &st);
        cr_assert_eq(st, STRIA_OK, "%s: %s", tokens[i], stria_error_msg());
        cr_expect_eq(stria_rpc_client_roles(cl), roles[i], "%s", tokens[i]);
        for (int m = 0; m < 3; m++) {
            st = call_method(cl, methods[m]);
            if (allowed[i][m]) {
                cr_expect_eq(st, STRIA_ERR_NOT_FOUND, "%s method %u: %s", tokens[i], methods[m],
                             stria_error_msg());
                cr_expect(strstr(stria_error_msg(), "served") != NULL, "%s", stria_error_msg());
            } else {
                cr_expect_eq(st, STRIA_ERR_AUTH, "%s method %u refused", tokens[i], methods[m]);
                cr_expect(strstr(stria_error_msg(), "needs the") != NULL, "%s", stria_error_msg());
            }
        }
        stria_rpc_client_close(cl);
    }
    stria_rpc_server_stop(srv);

    /* Two roles with one credential would make the role ambiguous. */
    stria_rpc_server_params_t p = {0};
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__coordinator__descriptor;
    p.methods = g_coord_methods;
    p.token = "same";
    p.worker_token = "same";
    cr_expect_eq(stria_rpc_server_start(&p, &srv), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "client and worker credentials are the same") != NULL, "%s",
              stria_error_msg());
}

/* The first hello's reply on a raw connection: its server nonce. */
static void raw_challenge(int fd, uint8_t nonce[STRIA_AUTH_NONCE_BYTES], bool *challenge)
{
    rt_reply_t r;
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_assert_eq(r.h.status, 0);
    Stria__V1__HelloReply *rep = stria__v1__hello_reply__unpack(NULL, r.h.pb_len, r.pb);
    cr_assert_not_null(rep);
    cr_assert_eq(rep->server_nonce.len, STRIA_AUTH_NONCE_BYTES);
    memcpy(nonce, rep->server_nonce.data, STRIA_AUTH_NONCE_BYTES);
    *challenge = rep->challenge;
    stria__v1__hello_reply__free_unpacked(rep, NULL);
    rt_reply_free(&r);
}

/* Sends the second hello with a given proof. */
static void raw_send_proof(int fd, const uint8_t *proof, size_t len)
{
    Stria__V1__HelloRequest hello = STRIA__V1__HELLO_REQUEST__INIT;
    stria_rpc_header_t h = rt_header(0, 2);
    h.flags = STRIA_RPC_FLAG_HELLO;
    hello.protocol_version = STRIA_RPC_VERSION;
    hello.service = (char *)"stria.v1.Coordinator";
    hello.proof.data = (uint8_t *)proof;
    hello.proof.len = len;
    cr_assert(rt_send_frame(fd, h, &hello.base, NULL, 0));
}

Test(rpc_auth, a_captured_handshake_replayed_on_a_new_connection_is_refused,
     .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_roles();
    uint16_t port = stria_rpc_server_port(srv);
    uint8_t sn[STRIA_AUTH_NONCE_BYTES], cn[STRIA_AUTH_NONCE_BYTES], proof[STRIA_AUTH_MAC_BYTES];
    bool challenge = false;
    rt_reply_t r;

    /* An honest handshake, as an eavesdropper records it: both hellos. */
    int fd = rt_connect(port);
    cr_assert(rt_hello(fd, "stria.v1.Coordinator", STRIA_RPC_VERSION));
    memcpy(cn, rt_client_nonce, sizeof(cn));
    raw_challenge(fd, sn, &challenge);
    cr_assert(challenge);
    stria_auth_hello_mac("admin-token", "stria.v1.Coordinator", cn, sn, false, proof);
    raw_send_proof(fd, proof, sizeof(proof));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_assert_eq(r.h.status, 0, "the honest proof: %s", r.err ? r.err->message : "");
    rt_reply_free(&r);
    close(fd);

    /* The attacker replays the recorded client frames on a new connection:
     * the same client nonce, the same proof; the server's nonce is new. */
    fd = rt_connect(port);
    Stria__V1__HelloRequest hello = STRIA__V1__HELLO_REQUEST__INIT;
    stria_rpc_header_t h = rt_header(0, 1);
    h.flags = STRIA_RPC_FLAG_HELLO;
    hello.protocol_version = STRIA_RPC_VERSION;
    hello.service = (char *)"stria.v1.Coordinator";
    hello.client_nonce.data = cn;
    hello.client_nonce.len = sizeof(cn);
    cr_assert(rt_send_frame(fd, h, &hello.base, NULL, 0));
    uint8_t sn2[STRIA_AUTH_NONCE_BYTES];
    raw_challenge(fd, sn2, &challenge);
    cr_expect(memcmp(sn, sn2, sizeof(sn)) != 0, "every connection gets a fresh server nonce");
    raw_send_proof(fd, proof, sizeof(proof));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH, "a replayed proof must be refused");
    cr_expect(r.err && strstr(r.err->message, "wrong token") != NULL, "%s",
              r.err ? r.err->message : "");
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);

    /* A token sent in clear (as older clients did) is refused too. */
    fd = rt_connect(port);
    hello.token = (char *)"admin-token";
    cr_assert(rt_send_frame(fd, h, &hello.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH);
    cr_expect(r.err && strstr(r.err->message, "clear text") != NULL, "%s",
              r.err ? r.err->message : "");
    rt_reply_free(&r);
    close(fd);
    stria_rpc_server_stop(srv);
}

/* A fake server that records what a client sends in its hello: it answers
 * the first hello with a challenge and the second with an error. */
typedef struct {
    int listen_fd;
    uint8_t seen[8192];
    size_t n_seen;
} fake_srv_t;

static void *fake_server(void *arg)
{
    fake_srv_t *f = arg;
    int fd = accept(f->listen_fd, NULL, NULL);
    if (fd < 0)
        return NULL;
    for (int frame = 0; frame < 2; frame++) {
        uint8_t hb[STRIA_RPC_HEADER_SIZE];
        stria_rpc_header_t h;
        if (rt_recv(fd, hb, sizeof(hb), 5000) != (ssize_t)sizeof(hb))
            break;
        stria_rpc_header_decode(hb, &h);
        if (h.pb_len > sizeof(f->seen) - f->n_seen - sizeof(hb))
            break;
        memcpy(f->seen + f->n_seen, hb, sizeof(hb));
        f->n_seen += sizeof(hb);
        if (rt_recv(fd, f->seen + f->n_seen, h.pb_len, 5000) != (ssize_t)h.pb_len)
            break;
        f->n_seen += h.pb_len;
        Stria__V1__HelloReply rep = STRIA__V1__HELLO_REPLY__INIT;
        uint8_t nonce[STRIA_AUTH_NONCE_BYTES] = {1, 2, 3};
        stria_rpc_header_t rh = rt_header(0, h.request_id);
        rh.flags = STRIA_RPC_FLAG_REPLY | STRIA_RPC_FLAG_HELLO;
        rep.protocol_version = STRIA_RPC_VERSION;
        rep.service = (char *)"stria.v1.Coordinator";
        rep.server_nonce.data = nonce;
        rep.server_nonce.len = sizeof(nonce);
        rep.challenge = frame == 0;
        if (!rt_send_frame(fd, rh, &rep.base, NULL, 0))
            break;
    }
    close(fd);
    return NULL;
}

Test(rpc_auth, the_token_never_travels_and_the_server_must_prove_it, .timeout = TEST_TIMEOUT_S)
{
    fake_srv_t f = {0};
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t al = sizeof(a);
    pthread_t th;
    stria_status_t st;
    const char *token = "a-token-that-must-not-travel-0123456789";
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    f.listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(bind(f.listen_fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
              listen(f.listen_fd, 1) == 0 &&
              getsockname(f.listen_fd, (struct sockaddr *)&a, &al) == 0);
    pthread_create(&th, NULL, fake_server, &f);
    stria_rpc_client_t *cl =
        connect_to(ntohs(a.sin_port), &stria__v1__coordinator__descriptor, token, &st);
    pthread_join(th, NULL);
    close(f.listen_fd);
    /* The fake server knows no token: its final reply proves nothing. */
    cr_expect_null(cl);
    cr_expect_eq(st, STRIA_ERR_AUTH, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "did not prove") != NULL, "%s", stria_error_msg());
    cr_assert_gt(f.n_seen, 2 * STRIA_RPC_HEADER_SIZE, "both hellos were sent");
    cr_expect_null(memmem(f.seen, f.n_seen, token, strlen(token)),
                   "the token appears in the bytes the client sent");
    cr_expect_null(memmem(f.seen, f.n_seen, token + 8, 8), "a piece of the token was sent");

    /* A client with a token refuses a server that checks none. */
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    cl = connect_to(stria_rpc_server_port(srv), &stria__v1__coordinator__descriptor, token, &st);
    cr_expect_null(cl);
    cr_expect_eq(st, STRIA_ERR_AUTH);
    cr_expect(strstr(stria_error_msg(), "checks no credential") != NULL, "%s", stria_error_msg());
    stria_rpc_server_stop(srv);
}

/* A SessionCall handler that serves job 7 only to who proves g_job_secret. */
static stria_job_secret_t g_job_secret = {{7, 7, 7}};

static void proof_handler(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__SessionCallRequest *req =
        (const Stria__V1__SessionCallRequest *)stria_rpc_call_request(call);
    Stria__V1__SessionCallReply rep = STRIA__V1__SESSION_CALL_REPLY__INIT;
    (void)ctx;
    if (stria_rpc_call_check_job(call, &g_job_secret, req->job_id) != STRIA_OK) {
        stria_rpc_call_fail(call, STRIA_ERR_AUTH, "%s", stria_error_msg());
        return;
    }
    rep.worker_minflt = req->job_id;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static stria_status_t session_call(stria_rpc_client_t *cl, uint64_t job,
                                   const stria_job_secret_t *secret, uint64_t proven_job)
{
    Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    req.job_id = job;
    stria_rpc_request_t r = {.method = M_CALL,
                             .request = &req.base,
                             .timeout_s = 5,
                             .job_secret = secret,
                             .job_id = proven_job};
    stria_rpc_reply_t rep = {0};
    stria_status_t st = stria_rpc_client_call(cl, &r, &rep);
    stria_rpc_reply_free(&rep);
    return st;
}

/* A SessionCall frame of job 7 with a proof for the session (cn, sn). */
static void raw_call_proven(int fd, uint64_t id, const uint8_t *cn, const uint8_t *sn)
{
    stria_auth_session_t session;
    uint8_t proof[STRIA_AUTH_MAC_BYTES];
    Stria__V1__SessionCallRequest req = STRIA__V1__SESSION_CALL_REQUEST__INIT;
    memcpy(session.client_nonce, cn, STRIA_AUTH_NONCE_BYTES);
    memcpy(session.server_nonce, sn, STRIA_AUTH_NONCE_BYTES);
    stria_job_secret_prove(&g_job_secret, &session, id, M_CALL, 7, proof);
    req.job_id = 7;
    req.job_proof.data = proof;
    req.job_proof.len = sizeof(proof);
    cr_assert(rt_send_frame(fd, rt_header(M_CALL, id), &req.base, NULL, 0));
}

Test(rpc_auth, job_secrets_are_proven_per_request_never_sent, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_params_t p = {0};
    stria_rpc_server_t *srv = NULL;
    stria_job_secret_t wrong = {{8}};
    stria_status_t st;
    memset(g_worker_methods, 0, sizeof(g_worker_methods));
    g_worker_methods[M_CALL] =
        (stria_rpc_method_t){.handler = proof_handler, .name = STRIA_RPC_WORKER_SESSION_CALL_NAME};
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__worker__descriptor;
    p.methods = g_worker_methods;
    cr_assert_eq(stria_rpc_server_start(&p, &srv), STRIA_OK, "%s", stria_error_msg());
    uint16_t port = stria_rpc_server_port(srv);

    stria_rpc_client_t *cl = connect_to(port, &stria__v1__worker__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(session_call(cl, 7, &g_job_secret, 7), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(session_call(cl, 7, NULL, 0), STRIA_ERR_AUTH);
    cr_expect(strstr(stria_error_msg(), "missing job secret proof") != NULL, "%s",
              stria_error_msg());
    cr_expect_eq(session_call(cl, 7, &wrong, 7), STRIA_ERR_AUTH);
    cr_expect(strstr(stria_error_msg(), "wrong job secret") != NULL, "%s", stria_error_msg());
    cr_expect_eq(session_call(cl, 8, &g_job_secret, 7), STRIA_ERR_AUTH,
                 "a proof for job 7 does not open job 8");
    cr_expect_eq(session_call(cl, 7, &g_job_secret, 7), STRIA_OK, "refusals keep the connection");
    stria_rpc_client_close(cl);

    /* A proven request captured on one connection and replayed on another,
     * or again on the same one after a newer request: refused. */
    uint8_t cn[STRIA_AUTH_NONCE_BYTES], sn[STRIA_AUTH_NONCE_BYTES];
    bool challenge = true;
    rt_reply_t r;
    int fd = rt_connect(port);
    cr_assert(rt_hello(fd, "stria.v1.Worker", STRIA_RPC_VERSION));
    memcpy(cn, rt_client_nonce, sizeof(cn));
    raw_challenge(fd, sn, &challenge);
    cr_assert(!challenge, "no credentials: the hello is done at once");
    raw_call_proven(fd, 5, cn, sn);
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, 0, "%s", r.err ? r.err->message : "");
    rt_reply_free(&r);
    raw_call_proven(fd, 6, cn, sn);
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, 0, "%s", r.err ? r.err->message : "");
    rt_reply_free(&r);
    raw_call_proven(fd, 5, cn, sn);
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH, "an older request id replayed in the connection");
    rt_reply_free(&r);
    int fd2 = rt_connect(port);
    cr_assert(rt_hello(fd2, "stria.v1.Worker", STRIA_RPC_VERSION));
    uint8_t sn2[STRIA_AUTH_NONCE_BYTES];
    raw_challenge(fd2, sn2, &challenge);
    raw_call_proven(fd2, 7, cn, sn); /* the first connection's proof */
    cr_assert(rt_read_reply(fd2, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_AUTH, "a proof of another connection");
    cr_expect(r.err && strstr(r.err->message, "wrong job secret") != NULL, "%s",
              r.err ? r.err->message : "");
    rt_reply_free(&r);
    close(fd2);
    close(fd);
    stria_rpc_server_stop(srv);
}
