/* Coordinator suite, the daemon: stria-coordinator as a real process
 * against bad peers, workers that die and rejoin across processes, and bad
 * flags. */
#include <criterion/criterion.h>

#include "coord_test_util.h"

/* ---- the daemon as a process --------------------------------------------- */

static char g_dir[64];

static void write_file(const char *name, const char *text)
{
    char path[128];
    FILE *f;
    snprintf(path, sizeof(path), "%s/%s", g_dir, name);
    f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

/* Runs stria-coordinator with extra arguments; reads its port from the line
 * it prints and checks the --port-file agrees. */
static void fx_spawn(fx_t *fx, const char *const *extra, const char *client_token)
{
    char port_file[128], log_path[128], line[256], buf[32] = {0};
    const char *argv[32];
    const char *colon;
    int n = 0;
    stria_status_t st;
    FILE *f;
    memset(fx, 0, sizeof(*fx));
    snprintf(port_file, sizeof(port_file), "%s/port", g_dir);
    snprintf(log_path, sizeof(log_path), "%s/coordinator.log", g_dir);
    unlink(port_file);
    argv[n++] = STRIA_COORDINATOR_BIN;
    argv[n++] = "--listen";
    argv[n++] = "127.0.0.1:0";
    argv[n++] = "--port-file";
    argv[n++] = port_file;
    argv[n++] = "--log-level";
    argv[n++] = "error";
    for (; extra != NULL && *extra != NULL; extra++)
        argv[n++] = *extra;
    argv[n] = NULL;
    fx->proc = test_proc_start((char *const *)argv, log_path, NULL);
    cr_assert_not_null(fx->proc, "cannot start %s", STRIA_COORDINATOR_BIN);
    cr_assert(
        test_proc_wait_line(fx->proc, "stria-coordinator listening on ", 10.0, line, sizeof(line)),
        "stria-coordinator did not report its address (log in %s)", log_path);
    colon = strrchr(line, ':');
    cr_assert_not_null(colon, "%s", line);
    fx->port = (uint16_t)atoi(colon + 1);
    cr_assert_gt(fx->port, 0, "%s", line);
    f = fopen(port_file, "r");
    cr_assert_not_null(f, "no --port-file written");
    cr_expect_not_null(fgets(buf, sizeof(buf), f));
    fclose(f);
    cr_expect_eq(atoi(buf), fx->port, "--port-file says %s", buf);
    fx->cl = fx_connect(fx, client_token, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    fx->wk = fx->user = fx->cl;
}

static void setup_dir(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/stria-coord-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
}

static void teardown_dir(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        cr_log_warn("could not remove %s", g_dir);
}

/* A raw connection to the daemon, greeted with `token`. */
static int raw_greeted(const fx_t *fx, const char *token)
{
    rt_reply_t r;
    int fd = rt_connect(fx->port);
    cr_assert_geq(fd, 0);
    cr_assert(rt_hello(fd, "stria.v1.Coordinator", STRIA_RPC_VERSION));
    cr_assert(token == NULL || rt_prove(fd, "stria.v1.Coordinator", token));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_assert_eq(r.h.status, 0, "hello refused: %s", r.err ? r.err->message : "");
    rt_reply_free(&r);
    return fd;
}

/* The daemon still answers a valid request on a fresh connection. */
static void still_serving(const fx_t *fx)
{
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    stria_status_t st;
    stria_rpc_client_t *cl = fx_connect(fx, "tok", &st);
    cr_assert_eq(st, STRIA_OK, "daemon stopped serving: %s", stria_error_msg());
    cr_expect_eq(fx_call(cl, M_STATUS, &gs.base, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);
}

Test(daemon, bad_peers_get_errors_and_the_daemon_keeps_serving, .timeout = TEST_TIMEOUT_S,
     .init = setup_dir, .fini = teardown_dir)
{
    fx_t fx;
    rt_reply_t r;
    uint8_t hb[STRIA_RPC_HEADER_SIZE];
    stria_rpc_header_t h;
    int fd;
    char tok_arg[128];
    char wtok_arg[128];
    write_file("token", "tok\n");
    write_file("worker-token", "wtok\n");
    snprintf(tok_arg, sizeof(tok_arg), "%s/token", g_dir);
    snprintf(wtok_arg, sizeof(wtok_arg), "%s/worker-token", g_dir);
    const char *extra[] = {"--token-file", tok_arg, "--worker-token-file", wtok_arg, NULL};
    fx_spawn(&fx, extra, "tok");

    /* Wrong version in the header: error naming both versions, closed. */
    fd = rt_connect(fx.port);
    h = rt_header(0, 1);
    h.flags = STRIA_RPC_FLAG_HELLO;
    h.version = 9;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_PROTOCOL);
    cr_expect(strstr(r.err->message, "version 9") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);
    still_serving(&fx);

    /* No token, wrong token. */
    const char *toks[] = {NULL, "tok2"};
    for (int i = 0; i < 2; i++) {
        fd = rt_connect(fx.port);
        cr_assert(rt_hello(fd, "stria.v1.Coordinator", STRIA_RPC_VERSION));
        cr_assert(rt_prove(fd, "stria.v1.Coordinator", toks[i]));
        cr_assert(rt_read_reply(fd, &r, 5000));
        cr_expect_eq(r.h.status, STRIA_ERR_AUTH);
        rt_reply_free(&r);
        cr_expect(rt_wait_closed(fd, 5000));
        close(fd);
    }
    still_serving(&fx);

    /* Oversized message length: error, closed. */
    fd = raw_greeted(&fx, "tok");
    h = rt_header(M_STATUS, 2);
    h.pb_len = 0xffffffffu;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_PROTOCOL);
    cr_expect(strstr(r.err->message, "exceeds the limit") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_expect(rt_wait_closed(fd, 5000));
    close(fd);
    still_serving(&fx);

    /* Truncated: a header promising 100 bytes, 10 sent, then gone. */
    fd = raw_greeted(&fx, "tok");
    h = rt_header(M_SUBMIT, 3);
    h.pb_len = 100;
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, "0123456789", 10));
    close(fd);
    still_serving(&fx);

    /* Malformed body and unknown method: errors, the connection lives on. */
    fd = raw_greeted(&fx, "tok");
    uint8_t junk[16];
    memset(junk, 0xff, sizeof(junk));
    h = rt_header(M_SUBMIT, 4);
    h.pb_len = sizeof(junk);
    stria_rpc_header_encode(&h, hb);
    cr_assert(rt_send(fd, hb, sizeof(hb)) && rt_send(fd, junk, sizeof(junk)));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_FORMAT);
    cr_expect(strstr(r.err->message, "SubmitJobRequest") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    Stria__V1__GetStatusRequest gs = STRIA__V1__GET_STATUS_REQUEST__INIT;
    cr_assert(rt_send_frame(fd, rt_header(13, 5), &gs.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_UNSUPPORTED);
    cr_expect(strstr(r.err->message, "method index 13 does not exist") != NULL, "%s",
              r.err->message);
    rt_reply_free(&r);
    /* A nonsense spec, on the same connection. */
    Stria__V1__SubmitJobRequest sj = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    Stria__V1__JobSpec s = spec_default();
    s.heads = 5;
    s.kv_heads = 2;
    sj.spec = &s;
    cr_assert(rt_send_frame(fd, rt_header(M_SUBMIT, 6), &sj.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(r.err->message, "multiple of kv_heads") != NULL, "%s", r.err->message);
    rt_reply_free(&r);
    cr_assert(rt_send_frame(fd, rt_header(M_STATUS, 7), &gs.base, NULL, 0));
    cr_assert(rt_read_reply(fd, &r, 5000));
    cr_expect_eq(r.h.status, 0, "valid request after errors");
    rt_reply_free(&r);
    close(fd);
    still_serving(&fx);
    fx_stop(&fx);
}

Test(daemon, workers_die_and_rejoin_across_processes, .timeout = TEST_TIMEOUT_S, .init = setup_dir,
     .fini = teardown_dir)
{
    fx_t fx;
    uint64_t ids[8];
    size_t want = 1;
    bool rejoined = false;
    const char *extra[] = {"--heartbeat-period", "0.2", NULL};
    fx_spawn(&fx, extra, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    cr_assert_eq(ring_ids(&fx, ids, 8, NULL), 2);
    cr_assert(wait_until(&fx, &a, 1, pred_ring_len, &want, 10), "b never marked dead");
    cr_assert_eq(heartbeat(&fx, b, NULL, 0, 0, NULL, NULL, &rejoined), STRIA_OK);
    cr_expect(rejoined);
    cr_expect_eq(ring_ids(&fx, ids, 8, NULL), 2);
    fx_stop(&fx);
}

Test(daemon, bad_flags_exit_2, .timeout = TEST_TIMEOUT_S, .init = setup_dir, .fini = teardown_dir)
{
    const char *cases[][4] = {
        {"--bogus", NULL, NULL, "unknown option"},
        {"--heartbeat-period", "0", NULL, "--heartbeat-period"},
        {"--job-ttl", "abc", NULL, "--job-ttl"},
        {"--listen", "nohost", NULL, "--listen"},
        {"--token-file", "/nonexistent/token", NULL, "--token-file"},
        {"--log-level", "loud", NULL, "--log-level"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char err_path[128], cmd[512], msg[1024] = {0};
        FILE *f;
        int status;
        snprintf(err_path, sizeof(err_path), "%s/err", g_dir);
        snprintf(cmd, sizeof(cmd), "'%s' %s %s >/dev/null 2>'%s'", STRIA_COORDINATOR_BIN,
                 cases[i][0], cases[i][1] ? cases[i][1] : "", err_path);
        status = system(cmd);
        cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 2, "%s: status 0x%x", cmd, status);
        f = fopen(err_path, "r");
        cr_assert_not_null(f);
        if (fread(msg, 1, sizeof(msg) - 1, f) == 0)
            msg[0] = '\0';
        fclose(f);
        cr_expect(strstr(msg, cases[i][3]) != NULL, "%s: stderr '%s'", cmd, msg);
    }
    /* A busy port: start-up failure, status 1. */
    fx_t fx;
    char listen[64], cmd[256];
    fx_spawn(&fx, NULL, NULL);
    snprintf(listen, sizeof(listen), "127.0.0.1:%u", fx.port);
    snprintf(cmd, sizeof(cmd), "'%s' --listen %s >/dev/null 2>&1", STRIA_COORDINATOR_BIN, listen);
    int status = system(cmd);
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 1, "busy port: status 0x%x", status);
    fx_stop(&fx);
}
