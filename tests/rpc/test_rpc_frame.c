/* RPC suite, the frame format and pure helpers: the header's byte order,
 * addresses, tokens and token files, the message types, and the decoding
 * budget. */
#include <criterion/criterion.h>

#include "rpc_test_services.h"

/* ---- pure helpers ------------------------------------------------------ */

Test(rpc_frame, header_roundtrip_little_endian, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_header_t h = {.magic = STRIA_RPC_MAGIC,
                            .version = 1,
                            .flags = 3,
                            .method = 0x01020304,
                            .status = -13,
                            .request_id = 0x1122334455667788ull,
                            .pb_len = 0xa0b0c0d0,
                            .timeout_ms = 5000,
                            .payload_len = 0x0102030405060708ull};
    stria_rpc_header_t d;
    uint8_t b[STRIA_RPC_HEADER_SIZE];
    stria_rpc_header_encode(&h, b);
    cr_expect_eq(memcmp(b, "STRA", 4), 0, "magic bytes on the wire");
    cr_expect_eq(b[8], 0x04);
    cr_expect_eq(b[16], 0x88);
    cr_expect_eq(b[39], 0x01);
    stria_rpc_header_decode(b, &d);
    cr_expect_eq(memcmp(&h, &d, sizeof(h)), 0);
}

Test(rpc_frame, addr_parse, .timeout = TEST_TIMEOUT_S)
{
    char host[64];
    uint16_t port = 0;
    cr_expect_eq(stria_addr_parse("127.0.0.1:7000", host, sizeof(host), &port), STRIA_OK);
    cr_expect_str_eq(host, "127.0.0.1");
    cr_expect_eq(port, 7000);
    cr_expect_eq(stria_addr_parse("[::1]:0", host, sizeof(host), &port), STRIA_OK);
    cr_expect_str_eq(host, "::1");
    cr_expect_eq(port, 0);
    cr_expect_eq(stria_addr_parse("node-3:65535", host, sizeof(host), &port), STRIA_OK);
    const char *bad[] = {"",      "nohost", ":80",     "h:",      "h:65536",
                         "h:12a", "::1:80", "[::1]80", "h:123456"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_expect_eq(stria_addr_parse(bad[i], host, sizeof(host), &port), STRIA_ERR_INVALID_ARG,
                     "'%s' accepted", bad[i]);
        cr_expect(strstr(stria_error_msg(), "address") != NULL, "%s", stria_error_msg());
    }
    cr_expect_eq(stria_addr_parse("averyveryverylonghostname:1", host, 8, &port),
                 STRIA_ERR_INVALID_ARG);
}

Test(rpc_frame, token_compare, .timeout = TEST_TIMEOUT_S)
{
    cr_expect(stria_rpc_token_equal("secret", "secret"));
    cr_expect(!stria_rpc_token_equal("secret", "secreT"));
    cr_expect(!stria_rpc_token_equal("secret", "secret2"));
    cr_expect(!stria_rpc_token_equal("secret2", "secret"));
    cr_expect(!stria_rpc_token_equal("", "x"));
    cr_expect(stria_rpc_token_equal(NULL, ""));
}

Test(rpc_frame, token_file, .timeout = TEST_TIMEOUT_S)
{
    char path[] = "/tmp/stria-token-XXXXXX";
    int fd = mkstemp(path);
    char *tok = NULL;
    cr_assert_geq(fd, 0);
    cr_assert(write(fd, "  s3cr3t-token \nsecond line\n", 28) == 28);
    close(fd);
    cr_expect_eq(stria_rpc_token_read(path, &tok), STRIA_OK, "%s", stria_error_msg());
    cr_expect_str_eq(tok, "s3cr3t-token");
    free(tok);
    tok = NULL;
    fd = open(path, O_WRONLY | O_TRUNC);
    cr_assert(write(fd, "\n", 1) == 1);
    close(fd);
    cr_expect_eq(stria_rpc_token_read(path, &tok), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "empty") != NULL, "%s", stria_error_msg());
    fd = open(path, O_WRONLY | O_TRUNC);
    cr_assert(write(fd,
                    "ab\x01"
                    "cd",
                    5) == 5);
    close(fd);
    cr_expect_eq(stria_rpc_token_read(path, &tok), STRIA_ERR_INVALID_ARG);
    unlink(path);
    cr_expect_eq(stria_rpc_token_read(path, &tok), STRIA_ERR_IO);
    cr_expect(strstr(stria_error_msg(), path) != NULL, "%s", stria_error_msg());
    cr_expect_null(tok);
}

/* Decoding depth is bounded only if no message type contains itself. */
static bool reaches(const ProtobufCMessageDescriptor *from, const ProtobufCMessageDescriptor *to,
                    int depth)
{
    if (depth > 32)
        return true;
    for (unsigned i = 0; i < from->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &from->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (f->descriptor == to || reaches(f->descriptor, to, depth + 1))
            return true;
    }
    return false;
}

Test(rpc_frame, no_recursive_message_types, .timeout = TEST_TIMEOUT_S)
{
    const ProtobufCServiceDescriptor *svcs[] = {&stria__v1__coordinator__descriptor,
                                                &stria__v1__worker__descriptor};
    int checked = 0;
    for (int s = 0; s < 2; s++) {
        for (unsigned m = 0; m < svcs[s]->n_methods; m++) {
            const ProtobufCMessageDescriptor *io[] = {svcs[s]->methods[m].input,
                                                      svcs[s]->methods[m].output};
            for (int k = 0; k < 2; k++) {
                cr_expect(!reaches(io[k], io[k], 0), "%s is recursive", io[k]->name);
                checked++;
            }
        }
    }
    cr_expect_eq(checked, 2 * (13 + 3));
    cr_expect_eq(stria__v1__coordinator__descriptor.n_methods, 13);
    cr_expect_eq(stria__v1__worker__descriptor.n_methods, 3);
    cr_expect_str_eq(stria__v1__coordinator__descriptor.methods[M_CANCEL].name, "CancelJob");
    cr_expect_str_eq(stria__v1__worker__descriptor.methods[M_CALL].name, "SessionCall");
}

Test(rpc_frame, decoding_budget_refuses_expansion, .timeout = TEST_TIMEOUT_S)
{
    /* 20000 empty job entries: 2 bytes each on the wire, far more unpacked. */
    Stria__V1__HeartbeatRequest hb = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    Stria__V1__WorkerJobStatus js = STRIA__V1__WORKER_JOB_STATUS__INIT;
    size_t n = 20000;
    Stria__V1__WorkerJobStatus **jobs = malloc(n * sizeof(*jobs));
    for (size_t i = 0; i < n; i++)
        jobs[i] = &js;
    hb.n_jobs = n;
    hb.jobs = jobs;
    size_t len = protobuf_c_message_get_packed_size(&hb.base);
    uint8_t *buf = malloc(len);
    protobuf_c_message_pack(&hb.base, buf);
    cr_expect_lt(len, 50000u);

    stria__rpc_arena_t *arena = stria__rpc_arena_create(len);
    cr_assert_not_null(
        stria__rpc_unpack(&stria__v1__heartbeat_request__descriptor, buf, len, arena),
        "a legitimate message fits the default budget: %s", stria_error_msg());
    stria__rpc_arena_destroy(arena);

    arena = stria__rpc_arena_create(len);
    arena->budget = 100000; /* less than 20000 unpacked entries need */
    cr_expect_null(stria__rpc_unpack(&stria__v1__heartbeat_request__descriptor, buf, len, arena));
    cr_expect(strstr(stria_error_msg(), "budget") != NULL, "%s", stria_error_msg());
    stria__rpc_arena_destroy(arena);
    free(buf);
    free(jobs);
}
