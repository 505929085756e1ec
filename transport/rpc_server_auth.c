/* The RPC server's authentication: its credentials, the two-frame hello
 * (challenge and response, see proto/stria.proto "Authentication"), the
 * roles of a connection and the job proofs of job-scoped requests. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc_server_int.h"
#include "stria.pb-c.h"

static const char *const stria__role_name[STRIA__RPC_N_ROLES] = {"client", "worker", "admin"};

const char *stria_rpc_role_names(unsigned roles)
{
    static const char *const names[8] = {
        "none",  "client",        "worker",        "client, worker",
        "admin", "client, admin", "worker, admin", "client, worker, admin"};
    return names[roles & STRIA_RPC_ROLE_ALL];
}

stria_status_t stria__rpc_server_tokens(stria_rpc_server_t *srv, const stria_rpc_server_params_t *p)
{
    const char *in[STRIA__RPC_N_ROLES] = {p->token, p->worker_token, p->admin_token};
    for (int i = 0; i < STRIA__RPC_N_ROLES; i++) {
        if (in[i] == NULL || in[i][0] == '\0')
            continue;
        for (int k = 0; k < i; k++)
            if (srv->tokens[k] != NULL && stria_rpc_token_equal(srv->tokens[k], in[i]))
                return stria_error_set(STRIA_ERR_INVALID_ARG,
                                       "%s: the %s and %s credentials are the same; each role "
                                       "needs its own",
                                       srv->name, stria__role_name[k], stria__role_name[i]);
        srv->tokens[i] = strdup(in[i]);
        if (srv->tokens[i] == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "rpc server: out of memory");
        srv->any_token = true;
    }
    return STRIA_OK;
}

void stria__rpc_server_tokens_free(stria_rpc_server_t *srv)
{
    for (int i = 0; i < STRIA__RPC_N_ROLES; i++) {
        if (srv->tokens[i] != NULL) {
            stria_auth_free_secret(srv->tokens[i]);
            srv->tokens[i] = NULL;
        }
    }
}

/* Sends a HelloReply; the connection reads requests (or the proof) next. */
static void stria__hello_reply(stria__rpc_conn_t *c, Stria__V1__HelloReply *rep)
{
    stria_rpc_server_t *srv = c->server;
    stria_rpc_header_t h = {.magic = STRIA_RPC_MAGIC,
                            .version = STRIA_RPC_VERSION,
                            .flags = STRIA_RPC_FLAG_REPLY | STRIA_RPC_FLAG_HELLO,
                            .request_id = c->h.request_id};
    size_t len = 0;
    rep->protocol_version = STRIA_RPC_VERSION;
    rep->software_version = (char *)STRIA_VERSION;
    rep->service = (char *)srv->service->name;
    rep->max_pb_bytes = srv->max_pb;
    rep->max_payload_bytes = srv->max_payload;
    rep->server_nonce.data = c->session.server_nonce;
    rep->server_nonce.len = STRIA_AUTH_NONCE_BYTES;
    uint8_t *frame = stria__rpc_frame_build(&h, &rep->base, &len);
    c->phase = STRIA__RD_HEADER;
    stria__conn_write(c, frame, len, NULL, 0, NULL, NULL, NULL);
}

/* The hello is done: the connection has `roles`. */
static void stria__hello_done(stria__rpc_conn_t *c, const Stria__V1__HelloRequest *req,
                              unsigned roles, const char *token)
{
    Stria__V1__HelloReply rep = STRIA__V1__HELLO_REPLY__INIT;
    uint8_t proof[STRIA_AUTH_MAC_BYTES];
    c->hello_done = true;
    c->roles = roles;
    stria_auth_session_derive(&c->session, token);
    if (token != NULL) {
        stria_auth_hello_mac(token, c->server->service->name, c->session.client_nonce,
                             c->session.server_nonce, true, proof);
        rep.proof.data = proof;
        rep.proof.len = sizeof(proof);
    }
    stria_log_info("%s: hello from %s (%.64s %.32s), role %s", c->server->name, c->peer,
                   req->client_name, req->software_version, stria_rpc_role_names(roles));
    rep.admin = (roles & STRIA_RPC_ROLE_ADMIN) != 0;
    rep.roles = roles;
    stria__hello_reply(c, &rep);
}

/* First hello frame: version, service, the client's nonce; then either the
 * challenge or, without credentials, every role. */
static void stria__hello_first(stria__rpc_conn_t *c, const Stria__V1__HelloRequest *req)
{
    stria_rpc_server_t *srv = c->server;
    if (req->protocol_version != STRIA_RPC_VERSION) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL,
                          "client speaks protocol version %u; this server speaks version %d",
                          req->protocol_version, STRIA_RPC_VERSION);
        return;
    }
    if (strcmp(req->service, srv->service->name) != 0) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL, "this server exposes %s, not '%.64s'",
                          srv->service->name, req->service);
        return;
    }
    if (req->token[0] != '\0') {
        /* An older client would hand its credential to anyone: say so. */
        stria__conn_fatal(c, STRIA_ERR_AUTH,
                          "the hello carries a token in clear text; this server takes proofs "
                          "only (upgrade the client)");
        return;
    }
    if (req->client_nonce.len != STRIA_AUTH_NONCE_BYTES) {
        stria__conn_fatal(c, STRIA_ERR_PROTOCOL,
                          "the hello has a %zu-byte client nonce, not %d (an older client?)",
                          req->client_nonce.len, STRIA_AUTH_NONCE_BYTES);
        return;
    }
    memcpy(c->session.client_nonce, req->client_nonce.data, STRIA_AUTH_NONCE_BYTES);
    if (stria_auth_random(c->session.server_nonce, STRIA_AUTH_NONCE_BYTES) != STRIA_OK) {
        stria__conn_fatal(c, STRIA_ERR_INTERNAL, "%s", stria_error_msg());
        return;
    }
    if (!srv->any_token) {
        stria__hello_done(c, req, STRIA_RPC_ROLE_ALL, NULL);
        return;
    }
    Stria__V1__HelloReply rep = STRIA__V1__HELLO_REPLY__INIT;
    rep.challenge = true;
    c->challenged = true;
    stria__hello_reply(c, &rep);
}

/* Second hello frame: the proof, tried against every credential. */
static void stria__hello_proof(stria__rpc_conn_t *c, const Stria__V1__HelloRequest *req)
{
    stria_rpc_server_t *srv = c->server;
    uint8_t want[STRIA_AUTH_MAC_BYTES];
    int match = -1;
    if (req->proof.len == 0) {
        stria__conn_fatal(c, STRIA_ERR_AUTH, "missing token (this server checks credentials)");
        return;
    }
    /* Every credential is tried, whatever matches, so the time does not say
     * which role a proof was close to. */
    for (int i = 0; i < STRIA__RPC_N_ROLES; i++) {
        if (srv->tokens[i] == NULL)
            continue;
        stria_auth_hello_mac(srv->tokens[i], srv->service->name, c->session.client_nonce,
                             c->session.server_nonce, false, want);
        bool ok = req->proof.len == STRIA_AUTH_MAC_BYTES &&
                  stria_auth_equal(want, req->proof.data, STRIA_AUTH_MAC_BYTES);
        if (ok && match < 0)
            match = i;
    }
    if (match < 0) {
        stria__conn_fatal(c, STRIA_ERR_AUTH, "wrong token");
        return;
    }
    stria__hello_done(c, req, 1u << match, srv->tokens[match]);
}

void stria__rpc_on_hello(stria__rpc_conn_t *c)
{
    stria__rpc_arena_t *arena = stria__rpc_arena_create(c->h.pb_len);
    Stria__V1__HelloRequest *req;

    if (arena == NULL) {
        stria__conn_fatal(c, STRIA_ERR_NO_MEMORY, "out of memory");
        return;
    }
    req = (Stria__V1__HelloRequest *)stria__rpc_unpack(&stria__v1__hello_request__descriptor, c->pb,
                                                       c->h.pb_len, arena);
    if (req == NULL)
        stria__conn_fatal(c, STRIA_ERR_FORMAT, "hello: %s", stria_error_msg());
    else if (c->challenged)
        stria__hello_proof(c, req);
    else
        stria__hello_first(c, req);
    stria__rpc_arena_destroy(arena);
}

bool stria__rpc_method_allowed(const stria__rpc_conn_t *c, unsigned flags, const char *method,
                               char *msg, size_t msg_len)
{
    if ((flags & STRIA_RPC_METHOD_ADMIN) && !(c->roles & STRIA_RPC_ROLE_ADMIN)) {
        snprintf(msg, msg_len, "%s needs the admin token (this connection is %s)", method,
                 stria_rpc_role_names(c->roles));
        return false;
    }
    if ((flags & STRIA_RPC_METHOD_WORKER) && !(c->roles & STRIA_RPC_ROLE_WORKER)) {
        snprintf(msg, msg_len, "%s needs the worker token (this connection is %s)", method,
                 stria_rpc_role_names(c->roles));
        return false;
    }
    if ((flags & STRIA_RPC_METHOD_CLIENT) &&
        !(c->roles & (STRIA_RPC_ROLE_CLIENT | STRIA_RPC_ROLE_ADMIN))) {
        snprintf(msg, msg_len, "%s needs the client or admin token (this connection is %s)", method,
                 stria_rpc_role_names(c->roles));
        return false;
    }
    return true;
}

stria_status_t stria_rpc_call_check_job(stria_rpc_call_t *call, const stria_job_secret_t *secret,
                                        uint64_t job_id)
{
    return stria_rpc_call_check_job_extra(call, secret, job_id, NULL, 0);
}

stria_status_t stria_rpc_call_check_job_extra(stria_rpc_call_t *call,
                                              const stria_job_secret_t *secret, uint64_t job_id,
                                              const void *extra, size_t extra_len)
{
    stria__rpc_conn_t *c = call->conn;
    const ProtobufCMethodDescriptor *md = &c->server->service->methods[call->method];
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field(call->request->descriptor, 60);
    if (f == NULL || f->type != PROTOBUF_C_TYPE_BYTES || f->label == PROTOBUF_C_LABEL_REPEATED)
        return stria_error_set(STRIA_ERR_INTERNAL, "%s has no job_proof field", md->name);
    const ProtobufCBinaryData *proof =
        (const ProtobufCBinaryData *)(const void *)((const char *)call->request + f->offset);
    if (proof->len == 0)
        return stria_error_set(STRIA_ERR_AUTH, "%s: missing job secret proof for job %llu",
                               md->name, (unsigned long long)job_id);
    if (!stria_job_secret_check_extra(secret, &c->session, call->request_id, call->method, job_id,
                                      extra, extra_len, proof->data, proof->len))
        return stria_error_set(STRIA_ERR_AUTH, "%s: wrong job secret for job %llu", md->name,
                               (unsigned long long)job_id);
    /* A request may be checked twice (its payload, then its handler); an
     * older id is a replay within the connection. */
    if (call->request_id < c->last_job_request)
        return stria_error_set(STRIA_ERR_AUTH,
                               "%s: request id %llu of job %llu is older than one already "
                               "checked on this connection",
                               md->name, (unsigned long long)call->request_id,
                               (unsigned long long)job_id);
    c->last_job_request = call->request_id;
    return STRIA_OK;
}
