/* RPC suite, bad peers: version and service mismatches, unknown methods
 * and malformed bodies, untrustworthy headers, truncated frames and silent
 * peers, handler tables that do not match the descriptor, listen errors. */
#include <criterion/criterion.h>

#include "rpc_test_services.h"

/* ---- bad peers --------------------------------------------------------- */

Test(rpc_bad, version_and_service_mismatch, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    uint16_t port = stria_rpc_server_port(srv);
    const unsigned wrong = STRIA_RPC_VERSION + 1; /* a version the server does not speak */
    char want[64];
    stria_status_t st;
    rt_reply_t r;
    int fd;

    /* A wrong version in the frame header. */
    fd = rt_connect(port);
    Stria__V1__HelloRequest hello = STRIA__V1__HELLO_REQUEST__INIT;
    hello.protocol_version = wrong;
    hello.service = (char *)"stria.v1.Coordinator";
    stria_rpc_header_t h = rt_header(0, 1);
    h.flags = STRIA_RPC_FLAG_HELLO;
    h.version = (uint16_t)wrong;
    cr_assert(rt_send_frame(fd, h, &hello.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_PROTOCOL);
    cr_expect_eq(r.h.version, STRIA_RPC_VERSION, "the error names the server's version");
    snprintf(want, sizeof(want), "version %u", wrong);
    cr_expect(strstr(r.err->message, want) != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);

    /* A wrong version in the hello message. */
    fd = rt_connect(port);
    cr_assert(rt_hello(fd, "stria.v1.Coordinator", wrong));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_PROTOCOL);
    snprintf(want, sizeof(want), "protocol version %u", wrong);
    cr_expect(strstr(r.err->message, want) != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);

    /* A worker client dialling the coordinator. */
    stria_rpc_client_t *cl = connect_to(port, &stria__v1__worker__descriptor, NULL, &st);
    cr_expect_eq(st, STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "exposes stria.v1.Coordinator, not 'stria.v1.Worker'") !=
                  NULL,
              "%s", stria_error_msg());
    cr_expect_null(cl);

    fd = raw_greeted(port);
    raw_status_ok(fd, 2);
    close(fd);
    stria_rpc_server_stop(srv);
}

Test(rpc_bad, unknown_method_and_malformed_body_keep_the_connection, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    int fd = raw_greeted(stria_rpc_server_port(srv));
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    rt_reply_t r;
    uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};

    /* Unknown method index, with a payload to skip. */
    cr_assert(rt_send_frame(fd, rt_header(999, 5), &gs.base, junk, sizeof(junk)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_UNSUPPORTED);
    cr_expect_eq(r.h.request_id, 5);
    cr_expect(strstr(r.err->message, "method index 999 does not exist") != NULL, "%s",
              r.err->message);
    rt_reply_free(&r);
    raw_status_ok(fd, 6);

    /* A body that is not a valid message. */
    stria_rpc_header_t h = rt_header(M_STATUS, 7);
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    h.pb_len = sizeof(junk);
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, junk, sizeof(junk)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_FORMAT);
    cr_expect(strstr(r.err->message, "malformed stria.v1.GetStatusRequest") != NULL, "%s",
              r.err->message);
    rt_reply_free(&r);
    raw_status_ok(fd, 8);

    /* A payload to a method that takes none. */
    cr_assert(rt_send_frame(fd, rt_header(M_STATUS, 9), &gs.base, junk, sizeof(junk)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_INVALID_ARG);
    rt_reply_free(&r);
    raw_status_ok(fd, 10);
    close(fd);
    stria_rpc_server_stop(srv);
}

/* Sends a bad header on a greeted connection; expects an error naming
 * `what`, the connection closed, and the server still serving. */
static void bad_header_case(stria_rpc_server_t *srv, stria_rpc_header_t h, stria_status_t want,
                            const char *what)
{
    uint16_t port = stria_rpc_server_port(srv);
    int fd = raw_greeted(port);
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    rt_reply_t r;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)));
    /* Extra bytes the server must drain rather than reset the connection. */
    char trailing[8192] = {0};
    rt_send(fd, trailing, sizeof(trailing));
    cr_assert(rt_read_reply(fd, &r, 5000), "%s: no error reply", what);
    cr_expect_eq(r.h.status, want, "%s: status %d", what, r.h.status);
    cr_expect(r.err != NULL && strstr(r.err->message, what) != NULL, "expected '%s', got '%s'",
              what, r.err ? r.err->message : "");
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000), "%s: connection not closed", what);
    close(fd);
    fd = raw_greeted(port);
    raw_status_ok(fd, 77);
    close(fd);
}

Test(rpc_bad, untrustworthy_headers_close_the_connection, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    stria_rpc_header_t h;

    h = rt_header(M_STATUS, 3);
    h.magic = 0x50545448; /* "HTTP" */
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "bad frame magic");
    h = rt_header(M_STATUS, 3);
    h.pb_len = STRIA_RPC_DEFAULT_MAX_PB + 1;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "exceeds the limit of 16777216 bytes");
    h = rt_header(M_STATUS, 3);
    h.payload_len = STRIA_RPC_DEFAULT_MAX_PAYLOAD + 1;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "payload of 1073741825 bytes exceeds the limit");
    h = rt_header(M_STATUS, 3);
    h.payload_len = UINT64_MAX;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "exceeds the limit");
    h = rt_header(M_STATUS, 3);
    h.flags = STRIA_RPC_FLAG_REPLY;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "unexpected flags");
    h = rt_header(M_STATUS, 3);
    h.flags = STRIA_RPC_FLAG_HELLO;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "hello sent twice");
    h = rt_header(M_STATUS, 3);
    h.status = -1;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "carries status");
    h = rt_header(M_STATUS, 3);
    h.version = 7;
    bad_header_case(srv, h, STRIA_ERR_PROTOCOL, "protocol version 7");
    stria_rpc_server_stop(srv);
}

Test(rpc_bad, truncated_frames_and_silent_peers, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0.3);
    uint16_t port = stria_rpc_server_port(srv);
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    stria_rpc_header_t h = rt_header(M_STATUS, 4);
    int fd;

    /* Half a header, then gone. */
    fd = raw_greeted(port);
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, 17));
    close(fd);
    /* A header promising a body that never comes, then gone. */
    fd = raw_greeted(port);
    h.pb_len = 1000;
    h.payload_len = 5000;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, "abc", 3));
    close(fd);
    /* Garbage shorter than a header, before any hello. */
    fd = rt_connect(port);
    cr_assert(rt_send(fd, "GET / HTTP/1.0\r\n", 16));
    close(fd);
    /* Connected and silent: closed after the hello timeout. */
    fd = rt_connect(port);
    double t0 = stria_time_now();
    cr_expect(rt_wait_closed(fd, 5000), "a silent connection must be closed");
    cr_expect_lt(stria_time_now() - t0, 2.0);
    close(fd);
    /* Still serving. */
    fd = raw_greeted(port);
    raw_status_ok(fd, 11);
    close(fd);
    stria_rpc_server_stop(srv);
}

/* A handler table out of step with the service (a slot naming another
 * method, a handler without a name, a payload callback without a handler)
 * is refused at start, naming the slot and both methods. */
Test(rpc_bad, handler_tables_must_match_the_descriptor, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_method_t m[STRIA_RPC_WORKER_N_METHODS];
    stria_rpc_server_params_t p = {0};
    stria_rpc_server_t *srv = NULL;
    p.listen = "127.0.0.1:0";
    p.service = &stria__v1__worker__descriptor;
    p.methods = m;
    memset(m, 0, sizeof(m));
    /* SessionCall's handler in OpenSession's slot */
    m[STRIA_RPC_WORKER_OPEN_SESSION] =
        (stria_rpc_method_t){.handler = call_handler, .name = STRIA_RPC_WORKER_SESSION_CALL_NAME};
    cr_expect_eq(stria_rpc_server_start(&p, &srv), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "slot 1 is for 'SessionCall'") != NULL &&
                  strstr(stria_error_msg(), "method 1 is 'OpenSession'") != NULL,
              "%s", stria_error_msg());
    memset(m, 0, sizeof(m));
    m[STRIA_RPC_WORKER_SESSION_CALL].handler = call_handler;
    cr_expect_eq(stria_rpc_server_start(&p, &srv), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "(no name)") != NULL, "%s", stria_error_msg());
    memset(m, 0, sizeof(m));
    m[STRIA_RPC_WORKER_SESSION_CALL].payload = put_payload;
    cr_expect_eq(stria_rpc_server_start(&p, &srv), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "payload callback but no handler") != NULL, "%s",
              stria_error_msg());
    cr_expect_null(srv);
    /* The generated indices are the descriptor's, name for name. */
    static const struct {
        const ProtobufCServiceDescriptor *svc;
        unsigned index;
        const char *name;
    } known[] = {
        {&stria__v1__coordinator__descriptor, STRIA_RPC_COORDINATOR_SUBMIT_JOB, "SubmitJob"},
        {&stria__v1__coordinator__descriptor, STRIA_RPC_COORDINATOR_DEREGISTER_WORKER,
         "DeregisterWorker"},
        {&stria__v1__worker__descriptor, STRIA_RPC_WORKER_DROP_JOB, "DropJob"},
    };
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        cr_expect_str_eq(known[i].svc->methods[known[i].index].name, known[i].name);
    cr_expect_eq(stria__v1__coordinator__descriptor.n_methods, STRIA_RPC_COORDINATOR_N_METHODS);
    cr_expect_eq(stria__v1__worker__descriptor.n_methods, STRIA_RPC_WORKER_N_METHODS);
}

Test(rpc_bad, listen_errors, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0), *srv2 = NULL;
    stria_rpc_server_params_t p = {0};
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", stria_rpc_server_port(srv));
    p.listen = addr;
    p.service = &stria__v1__coordinator__descriptor;
    p.methods = g_coord_methods;
    cr_expect_eq(stria_rpc_server_start(&p, &srv2), STRIA_ERR_IO);
    cr_expect(strstr(stria_error_msg(), "cannot listen on") != NULL, "%s", stria_error_msg());
    p.listen = "127.0.0.1";
    cr_expect_eq(stria_rpc_server_start(&p, &srv2), STRIA_ERR_INVALID_ARG);
    p.listen = "no-such-host.invalid:0";
    cr_expect_eq(stria_rpc_server_start(&p, &srv2), STRIA_ERR_INVALID_ARG);
    cr_expect_null(srv2);
    /* Nobody listening. */
    stria_status_t st;
    stria_rpc_server_stop(srv);
    cr_expect_null(connect_to(1, &stria__v1__coordinator__descriptor, NULL, &st));
    cr_expect_eq(st, STRIA_ERR_IO, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "cannot connect") != NULL, "%s", stria_error_msg());
}
