/* RPC suite, server and client: calls with inline, threaded and delayed
 * replies, deadlines and reconnects, aborts, payloads landing in place or
 * in pieces, pipelined batches, and oversized payloads and replies. */
#include <criterion/criterion.h>

#include "rpc_test_services.h"

/* ---- server and client ------------------------------------------------- */

Test(rpc, call_and_async_replies, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    stria_status_t st;
    stria_rpc_client_t *cl =
        connect_to(stria_rpc_server_port(srv), &stria__v1__coordinator__descriptor, NULL, &st);
    uint64_t up = 0;
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect(stria_rpc_client_admin(cl), "no admin token configured: admin for all");
    cr_expect_eq(stria_rpc_client_max_payload(cl), STRIA_RPC_DEFAULT_MAX_PAYLOAD);
    for (int i = 0; i < 50; i++) {
        cr_assert_eq(call_status(cl, &up), STRIA_OK, "%s", stria_error_msg());
        cr_assert_eq(up, 42);
    }
    /* A reply written by another thread. */
    Stria__V1__GetJobRequest gj = STRIA__V1__GET_JOB_REQUEST__INIT;
    gj.job_id = 21;
    stria_rpc_request_t r = {.method = M_GETJOB, .request = &gj.base, .timeout_s = 5};
    stria_rpc_reply_t rep = {0};
    cr_assert_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(((Stria__V1__GetJobReply *)rep.msg)->job->job_id, 42);
    stria_rpc_reply_free(&rep);
    /* An error reply keeps the connection in step. */
    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    stria_rpc_request_t rc = {.method = M_CANCEL, .request = &cj.base, .timeout_s = 5};
    cr_expect_eq(stria_rpc_client_call(cl, &rc, &rep), STRIA_ERR_NOT_FOUND);
    cr_expect(strstr(stria_error_msg(), "CancelJob: job 0 does not exist") != NULL, "%s",
              stria_error_msg());
    cr_expect_eq(call_status(cl, &up), STRIA_OK);
    /* A method without a handler. */
    Stria__V1__ListJobsRequest lj = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    stria_rpc_request_t rl = {
        .method = STRIA_RPC_COORDINATOR_LIST_JOBS, .request = &lj.base, .timeout_s = 5};
    cr_expect_eq(stria_rpc_client_call(cl, &rl, &rep), STRIA_ERR_UNSUPPORTED);
    cr_expect(strstr(stria_error_msg(), "ListJobs is not served") != NULL, "%s", stria_error_msg());
    /* Wrong request type for the method: refused locally. */
    stria_rpc_request_t rw = {.method = M_STATUS, .request = &lj.base, .timeout_s = 5};
    cr_expect_eq(stria_rpc_client_call(cl, &rw, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(call_status(cl, &up), STRIA_OK);
    /* Posted functions run on the loop thread. */
    cr_expect_eq(stria_rpc_server_post(srv, posted, NULL), STRIA_OK);
    for (int i = 0; i < 200 && __atomic_load_n(&g_posted, __ATOMIC_SEQ_CST) == 0; i++)
        usleep(5000);
    cr_expect_eq(g_posted, 1);
    /* The loop-age probe: small while the loop runs, growing while a
     * callback blocks it, small again after. */
    cr_expect_lt(stria_rpc_server_loop_age(srv), 0.6);
    cr_expect_eq(stria_rpc_server_post(srv, posted_block, NULL), STRIA_OK);
    usleep(1200000);
    double blocked_age = stria_rpc_server_loop_age(srv);
    cr_expect_gt(blocked_age, 0.8, "loop age %.3f s while the loop is blocked", blocked_age);
    for (int i = 0; i < 400 && __atomic_load_n(&g_posted, __ATOMIC_SEQ_CST) < 2; i++)
        usleep(5000);
    usleep(400000);
    cr_expect_lt(stria_rpc_server_loop_age(srv), 0.6);
    stria_rpc_client_close(cl);
    join_later();
    stria_rpc_server_stop(srv);
}

Test(rpc, deadline_then_reconnect, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    stria_status_t st;
    stria_rpc_client_t *cl =
        connect_to(stria_rpc_server_port(srv), &stria__v1__coordinator__descriptor, NULL, &st);
    Stria__V1__SubmitJobRequest sj = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_request_t r = {.method = M_SUBMIT, .request = &sj.base, .timeout_s = 0.1};
    stria_rpc_reply_t rep = {0};
    uint64_t up = 0;
    double t0 = stria_time_now();
    cr_assert_eq(st, STRIA_OK);
    g_hold_s = 0.5;
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_ERR_TIMEOUT);
    cr_expect_lt(stria_time_now() - t0, 0.4, "the deadline was not kept");
    cr_expect(strstr(stria_error_msg(), "SubmitJob") != NULL, "%s", stria_error_msg());
    /* The next call reconnects. */
    cr_expect_eq(call_status(cl, &up), STRIA_OK, "%s", stria_error_msg());
    /* With time enough, the same slow method answers. */
    r.timeout_s = 5;
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(((Stria__V1__SubmitJobReply *)rep.msg)->state,
                 STRIA__V1__JOB_STATE__JOB_STATE_LOADING);
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);
    join_later(); /* the late reply to the closed connection is dropped */
    stria_rpc_server_stop(srv);
}

typedef struct {
    stria_rpc_client_t *cl;
    double delay_s;
} abort_arg_t;

static void *abort_later(void *arg)
{
    abort_arg_t *a = arg;
    usleep((useconds_t)(a->delay_s * 1e6));
    stria_rpc_client_abort(a->cl);
    return NULL;
}

/* A call another thread gives up on ends at once, long before its deadline;
 * so does every later call on that client. */
Test(rpc, abort_ends_a_waiting_call, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_coord(NULL, NULL, 0);
    stria_status_t st;
    stria_rpc_client_t *cl =
        connect_to(stria_rpc_server_port(srv), &stria__v1__coordinator__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK);
    Stria__V1__SubmitJobRequest sj = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_request_t r = {.method = M_SUBMIT, .request = &sj.base, .timeout_s = 10};
    stria_rpc_reply_t rep = {0};
    g_hold_s = 3; /* the server sits on the call */
    abort_arg_t a = {.cl = cl, .delay_s = 0.2};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, abort_later, &a), 0);
    double t0 = stria_time_now();
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_ERR_CANCELLED, "%s", stria_error_msg());
    double took = stria_time_now() - t0;
    cr_expect_lt(took, 1.5, "the abandoned call took %.2f s", took);
    cr_expect(strstr(stria_error_msg(), "abandoned") != NULL, "%s", stria_error_msg());
    pthread_join(th, NULL);
    uint64_t up = 0;
    cr_expect_eq(call_status(cl, &up), STRIA_ERR_CANCELLED, "later calls fail too");
    stria_rpc_client_close(cl);
    join_later();
    stria_rpc_server_stop(srv);
}

Test(rpc, payloads_land_in_place, .timeout = TEST_TIMEOUT_S)
{
    size_t n = 3u << 20;
    stria_rpc_server_t *srv;
    stria_rpc_client_t *cl;
    stria_status_t st;
    uint8_t *src = malloc(n);
    uint64_t sum = 0;
    g_dest = calloc(1, n);
    g_dest_cap = n;
    for (size_t i = 0; i < n; i++) {
        src[i] = (uint8_t)(i * 7 + (i >> 13));
        sum += src[i];
    }
    srv = start_worker(0);
    cl = connect_to(stria_rpc_server_port(srv), &stria__v1__worker__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());

    /* Two frames, each straight into its half of the destination. */
    Stria__V1__SessionCallRequest put = put_req(0);
    stria_rpc_reply_t rep = {0};
    uint64_t got = 0;
    for (size_t off = 0; off < n; off += n / 2) {
        stria_rpc_request_t r = {.method = M_CALL,
                                 .request = &put.base,
                                 .payload = src + off,
                                 .payload_len = n / 2,
                                 .timeout_s = 10};
        put.piece_offset = off;
        cr_assert_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_OK, "%s", stria_error_msg());
        got += put_sum(&rep);
        cr_expect(put_in_place(&rep));
        stria_rpc_reply_free(&rep);
    }
    cr_expect_eq(got, sum);
    cr_expect_eq(memcmp(g_dest, src, n), 0, "payload bytes differ at the destination");

    /* Refused by the payload callback: skipped, error, connection in step. */
    stria_rpc_request_t bad = {.method = M_CALL,
                               .request = &put.base,
                               .payload = src,
                               .payload_len = 4096,
                               .timeout_s = 10};
    put.piece_offset = n - 100;
    cr_expect_eq(stria_rpc_client_call(cl, &bad, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "outside the tensor") != NULL, "%s", stria_error_msg());
    put.piece_offset = 0;
    put.rank = 1;
    cr_expect_eq(stria_rpc_client_call(cl, &bad, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "only rank 0") != NULL, "%s", stria_error_msg());

    /* A payload to a method that takes none. */
    Stria__V1__OpenSessionRequest os = STRIA__V1__OPEN_SESSION_REQUEST__INIT;
    stria_rpc_request_t op = {
        .method = M_OPEN, .request = &os.base, .payload = src, .payload_len = 10, .timeout_s = 10};
    cr_expect_eq(stria_rpc_client_call(cl, &op, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "OpenSession takes no payload") != NULL, "%s",
              stria_error_msg());
    op.payload_len = 0; /* served without one */
    cr_expect_eq(stria_rpc_client_call(cl, &op, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);

    /* Reply payload into the caller's buffer, sent from the handler's. */
    g_out = src;
    g_out_len = n;
    uint8_t *dst = calloc(1, n);
    Stria__V1__SessionCallRequest go = get_req(0, 0);
    stria_rpc_request_t gr = {.method = M_CALL,
                              .request = &go.base,
                              .reply_buf = dst,
                              .reply_buf_cap = n,
                              .timeout_s = 10};
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload, dst);
    cr_expect_eq(rep.payload_len, n);
    cr_expect_eq(memcmp(dst, src, n), 0);
    stria_rpc_reply_free(&rep);
    /* Too small a buffer: clear error, connection still usable. */
    gr.reply_buf_cap = n / 2;
    cr_expect_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_ERR_NO_MEMORY);
    cr_expect(strstr(stria_error_msg(), "does not fit") != NULL, "%s", stria_error_msg());
    /* An allocated reply payload, part of the tensor. */
    go = get_req(5, 1000);
    gr.reply_buf = NULL;
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload_len, 1000);
    cr_expect_eq(memcmp(rep.payload, src + 5, 1000), 0);
    stria_rpc_reply_free(&rep);
    /* Not served. */
    Stria__V1__DropJobRequest dj = STRIA__V1__DROP_JOB_REQUEST__INIT;
    stria_rpc_request_t dr = {.method = M_DROP, .request = &dj.base, .timeout_s = 10};
    cr_expect_eq(stria_rpc_client_call(cl, &dr, &rep), STRIA_ERR_UNSUPPORTED);
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
    cr_expect_eq(g_out_done, 3, "payload_done must run once per payload reply");
    cr_expect_eq(g_cleanups, 2, "cleanup must run once per accepted payload");
    free(dst);
    free(src);
    free(g_dest);
}

/* Cuts [0, n) into `count` pieces of pseudo-random sizes (some empty), in
 * an order that is not the address order: piece i covers the bytes after
 * piece i - 1 of a permutation of the buffer's blocks. */
static struct iovec *pieces(uint8_t *buf, size_t n, size_t count, size_t **order_out)
{
    struct iovec *iov = calloc(count, sizeof(*iov));
    size_t *cut = calloc(count + 1, sizeof(*cut)), *order = calloc(count, sizeof(*order));
    uint64_t s = 12345;
    for (size_t i = 1; i < count; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        cut[i] = (size_t)(s >> 33) % n;
    }
    cut[count] = n;
    for (size_t i = 1; i < count; i++) /* sorted cuts: pieces of the buffer */
        for (size_t j = i; j > 1 && cut[j - 1] > cut[j]; j--) {
            size_t t = cut[j];
            cut[j] = cut[j - 1];
            cut[j - 1] = t;
        }
    for (size_t i = 0; i < count; i++) /* sent in the order 0, 2, 4, ..., then 1, 3, ... */
        order[i] = i < (count + 1) / 2 ? 2 * i : 2 * (i - (count + 1) / 2) + 1;
    for (size_t i = 0; i < count; i++) {
        iov[i].iov_base = buf + cut[order[i]];
        iov[i].iov_len = cut[order[i] + 1] - cut[order[i]];
    }
    free(cut);
    *order_out = order;
    return iov;
}

Test(rpc, scattered_payloads_in_pieces, .timeout = TEST_TIMEOUT_S)
{
    const size_t n = 1u << 20, count = 3000; /* more pieces than one sendmsg takes */
    stria_rpc_server_t *srv;
    stria_rpc_client_t *cl;
    stria_status_t st;
    uint8_t *src = malloc(n), *dst = calloc(1, n);
    size_t *order;
    for (size_t i = 0; i < n; i++)
        src[i] = (uint8_t)(i * 13 + (i >> 11));
    g_dest = calloc(1, n);
    g_dest_cap = n;
    srv = start_worker(0);
    cl = connect_to(stria_rpc_server_port(srv), &stria__v1__worker__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());

    /* A request payload gathered from the pieces lands as their concatenation. */
    struct iovec *iov = pieces(src, n, count, &order);
    Stria__V1__SessionCallRequest put = put_req(0);
    stria_rpc_request_t r = {.method = M_CALL,
                             .request = &put.base,
                             .payload_iov = iov,
                             .payload_iovcnt = count,
                             .timeout_s = 10};
    stria_rpc_reply_t rep = {0};
    cr_assert_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    size_t at = 0;
    for (size_t i = 0; i < count; at += iov[i].iov_len, i++)
        cr_assert_eq(memcmp(g_dest + at, iov[i].iov_base, iov[i].iov_len), 0,
                     "piece %zu (of %zu bytes) landed wrong", i, iov[i].iov_len);
    cr_assert_eq(at, n);
    free(iov);
    free(order);

    /* A reply payload scattered into pieces of the caller's buffer. */
    g_out = src;
    g_out_len = n;
    iov = pieces(dst, n, count, &order);
    Stria__V1__SessionCallRequest go = get_req(0, 0);
    stria_rpc_request_t gr = {.method = M_CALL,
                              .request = &go.base,
                              .reply_iov = iov,
                              .reply_iovcnt = count,
                              .timeout_s = 10};
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload_len, n);
    stria_rpc_reply_free(&rep);
    at = 0;
    for (size_t i = 0; i < count; at += iov[i].iov_len, i++)
        cr_assert_eq(memcmp(iov[i].iov_base, src + at, iov[i].iov_len), 0,
                     "reply piece %zu (of %zu bytes) wrong", i, iov[i].iov_len);
    /* a shorter reply fills the first pieces only */
    memset(dst, 0, n);
    go.call = 1000; /* at most 1000 bytes (get_req) */
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload_len, 1000);
    stria_rpc_reply_free(&rep);
    at = 0;
    for (size_t i = 0; i < count && at < 1000; at += iov[i].iov_len, i++) {
        size_t len = iov[i].iov_len < 1000 - at ? iov[i].iov_len : 1000 - at;
        cr_assert_eq(memcmp(iov[i].iov_base, src + at, len), 0);
    }
    /* pieces too small for the reply: a clear error, the connection in step */
    go.call = 0;
    gr.reply_iovcnt = 1;
    cr_expect_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_ERR_NO_MEMORY);
    cr_expect(strstr(stria_error_msg(), "does not fit") != NULL, "%s", stria_error_msg());
    /* a payload and pieces at once: refused */
    r.payload = src;
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_ERR_INVALID_ARG);
    r.payload = NULL;
    go.call = 10;
    gr.reply_iovcnt = count;
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
    free(iov);
    free(order);
    free(src);
    free(dst);
    free(g_dest);
}

/* Calls pipelined on one connection: every payload lands, a refused one in
 * the middle reports its error while the others still land and the
 * connection stays in step, and replies come back to their own requests. */
Test(rpc, pipelined_batch, .timeout = TEST_TIMEOUT_S)
{
    const size_t n = 6u << 20, k = 6, part = n / k;
    stria_rpc_server_t *srv;
    stria_rpc_client_t *cl;
    stria_status_t st;
    uint8_t *src = malloc(n), *dst = calloc(1, n);
    for (size_t i = 0; i < n; i++)
        src[i] = (uint8_t)(i * 31 + (i >> 9));
    g_dest = calloc(1, n);
    g_dest_cap = n;
    srv = start_worker(0);
    cl = connect_to(stria_rpc_server_port(srv), &stria__v1__worker__descriptor, NULL, &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());

    Stria__V1__SessionCallRequest put[6];
    stria_rpc_request_t rq[6];
    stria_rpc_reply_t rep[6];
    for (size_t i = 0; i < k; i++) {
        put[i] = put_req(i * part);
        rq[i] = (stria_rpc_request_t){.method = M_CALL,
                                      .request = &put[i].base,
                                      .payload = src + i * part,
                                      .payload_len = part,
                                      .timeout_s = 10};
    }
    cr_assert_eq(stria_rpc_client_call_batch(cl, rq, k, rep), STRIA_OK, "%s", stria_error_msg());
    for (size_t i = 0; i < k; i++) {
        uint64_t sum = 0;
        for (size_t b = 0; b < part; b++)
            sum += src[i * part + b];
        cr_expect_eq(put_sum(&rep[i]), sum, "reply %zu is not its own request's", i);
        stria_rpc_reply_free(&rep[i]);
    }
    cr_expect_eq(memcmp(g_dest, src, n), 0);

    /* the third is refused (outside the tensor): its error, the rest lands */
    memset(g_dest, 0, n);
    put[2].piece_offset = n;
    cr_expect_eq(stria_rpc_client_call_batch(cl, rq, k, rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "outside the tensor") != NULL, "%s", stria_error_msg());
    for (size_t i = 0; i < k; i++) {
        cr_expect_null(rep[i].msg, "replies are freed after a failure");
        if (i != 2)
            cr_expect_eq(memcmp(g_dest + i * part, src + i * part, part), 0, "part %zu", i);
    }
    put[2].piece_offset = 2 * part;

    /* pipelined replies into their own buffers */
    g_out = src;
    g_out_len = n;
    Stria__V1__SessionCallRequest go[6];
    for (size_t i = 0; i < k; i++) {
        go[i] = get_req(i * part, part);
        rq[i] = (stria_rpc_request_t){.method = M_CALL,
                                      .request = &go[i].base,
                                      .reply_buf = dst + (k - 1 - i) * part,
                                      .reply_buf_cap = part,
                                      .timeout_s = 10};
    }
    cr_assert_eq(stria_rpc_client_call_batch(cl, rq, k, rep), STRIA_OK, "%s", stria_error_msg());
    for (size_t i = 0; i < k; i++) {
        cr_expect_eq(rep[i].payload_len, part);
        cr_expect_eq(memcmp(dst + (k - 1 - i) * part, src + i * part, part), 0, "reply %zu", i);
        stria_rpc_reply_free(&rep[i]);
    }
    cr_expect_eq(stria_rpc_client_call_batch(cl, rq, 0, rep), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_rpc_client_call_batch(cl, rq, STRIA_RPC_MAX_BATCH + 1, rep),
                 STRIA_ERR_INVALID_ARG);
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
    free(src);
    free(dst);
    free(g_dest);
}

Test(rpc, oversized_payload_refused_before_sending, .timeout = TEST_TIMEOUT_S)
{
    stria_rpc_server_t *srv = start_worker(1000);
    stria_status_t st;
    stria_rpc_client_t *cl =
        connect_to(stria_rpc_server_port(srv), &stria__v1__worker__descriptor, NULL, &st);
    uint8_t buf[2000] = {0};
    Stria__V1__SessionCallRequest put = put_req(0);
    stria_rpc_request_t r = {.method = M_CALL,
                             .request = &put.base,
                             .payload = buf,
                             .payload_len = sizeof(buf),
                             .timeout_s = 5};
    stria_rpc_reply_t rep = {0};
    cr_assert_eq(st, STRIA_OK);
    cr_expect_eq(stria_rpc_client_max_payload(cl), 1000);
    cr_expect_eq(stria_rpc_client_call(cl, &r, &rep), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "exceeds the server's limit") != NULL, "%s",
              stria_error_msg());
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
}

Test(rpc, oversized_reply_refused_by_the_client, .timeout = TEST_TIMEOUT_S)
{
    /* The server may send any reply; the client's own cap protects it from a
     * server that announces more than the caller is willing to receive. */
    enum { CAP = 1000 };
    size_t n = 5000;
    char addr[64];
    stria_rpc_client_params_t p = {0};
    stria_rpc_client_t *cl = NULL;
    stria_rpc_server_t *srv = start_worker(0);
    uint8_t *src = malloc(n);
    for (size_t i = 0; i < n; i++)
        src[i] = (uint8_t)i;
    g_out = src;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", stria_rpc_server_port(srv));
    p.address = addr;
    p.service = &stria__v1__worker__descriptor;
    p.client_name = "test";
    p.connect_timeout_s = 5;
    p.max_payload_bytes = CAP;
    cr_assert_eq(stria_rpc_client_connect(&p, &cl), STRIA_OK, "%s", stria_error_msg());

    Stria__V1__SessionCallRequest go = get_req(0, 0);
    stria_rpc_request_t gr = {.method = M_CALL, .request = &go.base, .timeout_s = 10};
    stria_rpc_reply_t rep = {0};
    /* At the cap: accepted. */
    g_out_len = CAP;
    cr_assert_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(rep.payload_len, CAP);
    stria_rpc_reply_free(&rep);
    /* One byte over: refused before it is read, naming the limit. */
    g_out_len = CAP + 1;
    cr_expect_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "reply payload of 1001 bytes") != NULL, "%s",
              stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "limit of 1000") != NULL, "%s", stria_error_msg());
    cr_expect_null(rep.payload);
    /* Far over: the same, without trying to allocate it. */
    g_out_len = n;
    cr_expect_eq(stria_rpc_client_call(cl, &gr, &rep), STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "exceeds the limit") != NULL, "%s", stria_error_msg());
    stria_rpc_client_close(cl);
    stria_rpc_server_stop(srv);
    free(src);
}
