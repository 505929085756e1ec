/* UCX link suite, in-process rings: several contexts in one process (one
 * thread per rank) check the link's semantics: tags, early arrivals, length
 * checks, cancel, abort, deadlines, the handshake and the connection. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include "ucx_test_util.h"

/* ---- in-process rings (one thread per rank) ---------------------------- */

#define MAX_RING 4

typedef struct {
    int n;
    stria_ucx_ctx_t *ctx[MAX_RING];
    stria_link_t *link[MAX_RING];
} ring_t;

/* Connects args[i] concurrently (every connect waits for its neighbours). */
static void connect_all(connect_arg_t *args, int n)
{
    pthread_t th[MAX_RING * 2];
    for (int i = 0; i < n; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, connect_main, &args[i]), 0);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
}

static void ring_open(ring_t *ring, int n, const char *tls, uint64_t ring_id)
{
    connect_arg_t args[MAX_RING];
    memset(ring, 0, sizeof(*ring));
    ring->n = n;
    for (int r = 0; r < n; r++)
        ring->ctx[r] = ctx_new(tls);
    for (int r = 0; r < n; r++)
        args[r] = (connect_arg_t){.ctx = ring->ctx[r],
                                  .p = {.job_id = 7,
                                        .ring_id = ring_id,
                                        .rank = r,
                                        .size = n,
                                        .next_host = "127.0.0.1",
                                        .next_port = stria_ucx_ctx_port(ring->ctx[(r + 1) % n]),
                                        .connect_timeout_s = 10}};
    connect_all(args, n);
    for (int r = 0; r < n; r++) {
        cr_assert_eq(args[r].st, STRIA_OK, "rank %d connect: %s", r, args[r].msg);
        ring->link[r] = args[r].link;
        cr_assert_eq(stria_link_rank(ring->link[r]), r);
        cr_assert_eq(stria_link_size(ring->link[r]), n);
    }
}

static void ring_close(ring_t *ring)
{
    for (int r = 0; r < ring->n; r++)
        stria_link_destroy(ring->link[r]);
    for (int r = 0; r < ring->n; r++)
        stria_ucx_ctx_destroy(ring->ctx[r]);
}

static void fill(uint8_t *b, size_t n, unsigned seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
        b[i] = (uint8_t)x;
    }
}

/* Sends are posted before the receives (early arrivals, eager and
 * rendezvous), tags use all 64 bits, receives are posted out of order. */
Test(ucx, tags_early_arrivals_and_order, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 2, "tcp", 1);
    const size_t sizes[4] = {1, 1000, 70000, 1 << 20};
    const uint64_t tags[4] = {0, 0xFFFFFFFFFFFFFFFFull, 0x8000000000000001ull, 42};
    uint8_t *src[4], *dst[4];
    stria_link_req_t *sq[4], *rq[4];
    for (int i = 0; i < 4; i++) {
        src[i] = malloc(sizes[i]);
        dst[i] = calloc(1, sizes[i]);
        fill(src[i], sizes[i], (unsigned)i + 1);
        cr_assert_eq(stria_link_isend(ring.link[0], tags[i], src[i], sizes[i], &sq[i]), STRIA_OK);
    }
    usleep(200000); /* let everything arrive unexpected */
    for (int i = 3; i >= 0; i--)
        cr_assert_eq(stria_link_irecv(ring.link[1], tags[i], dst[i], sizes[i], &rq[i]), STRIA_OK);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(stria_link_wait(ring.link[1], rq[i], 10), STRIA_OK, "recv %d: %s", i,
                     stria_error_msg());
        cr_assert_eq(stria_link_wait(ring.link[0], sq[i], 10), STRIA_OK, "send %d: %s", i,
                     stria_error_msg());
        cr_expect(memcmp(src[i], dst[i], sizes[i]) == 0, "block %d (%zu bytes) differs", i,
                  sizes[i]);
    }
    /* Same tag twice: matched in posting order. */
    uint32_t a = 1, b = 2, ra = 0, rb = 0;
    cr_assert_eq(stria_link_isend(ring.link[1], 5, &a, 4, &sq[0]), STRIA_OK);
    cr_assert_eq(stria_link_isend(ring.link[1], 5, &b, 4, &sq[1]), STRIA_OK);
    cr_assert_eq(stria_link_irecv(ring.link[0], 5, &ra, 4, &rq[0]), STRIA_OK);
    cr_assert_eq(stria_link_irecv(ring.link[0], 5, &rb, 4, &rq[1]), STRIA_OK);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(stria_link_wait(ring.link[1], sq[i], 10), STRIA_OK);
        cr_assert_eq(stria_link_wait(ring.link[0], rq[i], 10), STRIA_OK);
    }
    cr_expect(ra == 1 && rb == 2, "same-tag messages out of order: %u %u", ra, rb);
    ring_close(&ring);
    for (int i = 0; i < 4; i++) {
        free(src[i]);
        free(dst[i]);
    }
}

/* Two rings over the same pair of contexts, with the same tags: each link
 * gets only its own ring's messages. */
Test(ucx, rings_sharing_a_context_stay_apart, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp"), *c1 = ctx_new("tcp");
    connect_arg_t args[4];
    for (int g = 0; g < 2; g++)
        for (int r = 0; r < 2; r++)
            args[2 * g + r] =
                (connect_arg_t){.ctx = r == 0 ? c0 : c1,
                                .p = {.job_id = 3,
                                      .ring_id = (uint64_t)(10 + g),
                                      .rank = r,
                                      .size = 2,
                                      .next_host = "127.0.0.1",
                                      .next_port = stria_ucx_ctx_port(r == 0 ? c1 : c0),
                                      .connect_timeout_s = 10}};
    connect_all(args, 4);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(args[i].st, STRIA_OK, "link %d: %s", i, args[i].msg);
    uint64_t out[2] = {111, 222}, in[2] = {0, 0};
    stria_link_req_t *sq[2], *rq[2];
    for (int g = 0; g < 2; g++)
        cr_assert_eq(stria_link_isend(args[2 * g].link, 9, &out[g], 8, &sq[g]), STRIA_OK);
    usleep(100000);
    for (int g = 1; g >= 0; g--)
        cr_assert_eq(stria_link_irecv(args[2 * g + 1].link, 9, &in[g], 8, &rq[g]), STRIA_OK);
    for (int g = 0; g < 2; g++) {
        cr_assert_eq(stria_link_wait(args[2 * g + 1].link, rq[g], 10), STRIA_OK);
        cr_assert_eq(stria_link_wait(args[2 * g].link, sq[g], 10), STRIA_OK);
    }
    cr_expect(in[0] == 111 && in[1] == 222, "rings mixed up: %llu %llu", (unsigned long long)in[0],
              (unsigned long long)in[1]);
    for (int i = 0; i < 4; i++)
        stria_link_destroy(args[i].link);
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

Test(ucx, length_mismatch_fails_both_sides, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 2, "tcp", 1);
    static uint8_t src[100000], dst[90000];
    stria_link_req_t *sq, *rq;
    cr_assert_eq(stria_link_irecv(ring.link[1], 1, dst, sizeof(dst), &rq), STRIA_OK);
    cr_assert_eq(stria_link_isend(ring.link[0], 1, src, sizeof(src), &sq), STRIA_OK);
    cr_expect_eq(stria_link_wait(ring.link[1], rq, 10), STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "100000") != NULL, "%s", stria_error_msg());
    stria_status_t st = stria_link_wait(ring.link[0], sq, 10);
    if (st == STRIA_OK) {
        /* The send completed before the receiver's notice came back (a
         * loaded machine): the sender's link still fails, at its next wait. */
        uint8_t b;
        stria_link_req_t *rq2;
        st = stria_link_irecv(ring.link[0], 2, &b, 1, &rq2);
        if (st == STRIA_OK)
            st = stria_link_wait(ring.link[0], rq2, 10);
    }
    cr_expect(st != STRIA_OK, "the sender was not told");
    cr_expect(strstr(stria_error_msg(), "rank 1") != NULL, "the sender's error: %s",
              stria_error_msg());
    ring_close(&ring);
}

/* A receive no data has matched is cancelled cleanly; the link goes on. */
Test(ucx, cancel_unmatched_receive_is_clean, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 2, "tcp", 1);
    uint8_t *buf = malloc(1 << 20);
    stria_link_req_t *rq, *sq;
    cr_assert_eq(stria_link_irecv(ring.link[1], 77, buf, 1 << 20, &rq), STRIA_OK);
    usleep(50000);
    stria_link_cancel(ring.link[1], rq);
    free(buf); /* the buffer is ours again */
    uint64_t x = 5, y = 0;
    cr_assert_eq(stria_link_isend(ring.link[0], 78, &x, 8, &sq), STRIA_OK);
    cr_assert_eq(stria_link_irecv(ring.link[1], 78, &y, 8, &rq), STRIA_OK);
    cr_assert_eq(stria_link_wait(ring.link[0], sq, 10), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_link_wait(ring.link[1], rq, 10), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(y, 5);
    ring_close(&ring);
}

/* Cancelling a send in flight releases it at once, tears the link down and
 * tells the peer, whose pending receive fails naming this rank. */
Test(ucx, cancel_send_in_flight_tears_down, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 2, tls_names[TLS_SHM], 1);
    size_t n = 4 << 20;
    uint8_t *src = malloc(n), *dst = malloc(n);
    stria_link_req_t *sq, *rq;
    cr_assert_eq(stria_link_isend(ring.link[0], 1, src, n, &sq), STRIA_OK);
    cr_assert_eq(stria_link_irecv(ring.link[1], 2, dst, n, &rq), STRIA_OK);
    /* In flight: the progress thread has taken the send from the queue (a
     * send cancelled while still queued is withdrawn quietly, and the peer
     * rightly hears nothing; on a loaded machine that takes more than a
     * moment). */
    for (int i = 0; i < 1000 && __atomic_load_n(&sq->state, __ATOMIC_ACQUIRE) == STRIA__REQ_QUEUED;
         i++)
        usleep(10000);
    cr_assert_neq(__atomic_load_n(&sq->state, __ATOMIC_ACQUIRE), STRIA__REQ_QUEUED,
                  "the send was not posted within 10 s");
    usleep(50000);
    double t0 = stria_time_now();
    stria_link_cancel(ring.link[0], sq);
    cr_expect_lt(stria_time_now() - t0, 2.0);
    free(src);
    stria_status_t st = stria_link_wait(ring.link[1], rq, 5);
    cr_expect_eq(st, STRIA_ERR_PEER, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "rank 0") != NULL, "%s", stria_error_msg());
    free(dst);
    uint8_t x = 0;
    cr_expect_eq(stria_link_isend(ring.link[0], 3, &x, 1, &sq), STRIA_ERR_CANCELLED,
                 "a torn-down link accepted a send");
    ring_close(&ring);
}

/* An abort reaches every rank of the ring, not only the neighbours, each
 * reporting the aborting rank's own status (the kind of the failure) with a
 * message naming it. An abort for a link's reason (a deadline) is a peer's
 * failure to the others. */
typedef struct {
    stria_status_t reason; /* what rank 0 aborts with */
    stria_status_t others; /* what the other ranks report */
} abort_case_t;

ParameterizedTestParameters(ucx, abort_reaches_every_rank)
{
    static abort_case_t cases[] = {
        {STRIA_ERR_INTERNAL, STRIA_ERR_INTERNAL},   {STRIA_ERR_INVALID_ARG, STRIA_ERR_INVALID_ARG},
        {STRIA_ERR_CANCELLED, STRIA_ERR_CANCELLED}, {STRIA_ERR_NO_MEMORY, STRIA_ERR_NO_MEMORY},
        {STRIA_ERR_TIMEOUT, STRIA_ERR_PEER},        {STRIA_ERR_PEER, STRIA_ERR_PEER}};
    return cr_make_param_array(abort_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(abort_case_t *c, ucx, abort_reaches_every_rank, .init = setup, .fini = teardown,
                  .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 4, "tcp", 1);
    uint64_t in[4];
    stria_link_req_t *rq[4];
    for (int r = 1; r < 4; r++)
        cr_assert_eq(stria_link_irecv(ring.link[r], 1, &in[r], 8, &rq[r]), STRIA_OK);
    double t0 = stria_time_now();
    stria_link_abort(ring.link[0], c->reason, "kernel failed");
    for (int r = 1; r < 4; r++) {
        stria_status_t st = stria_link_wait(ring.link[r], rq[r], 10);
        cr_expect_eq(st, c->others, "rank %d: %s: %s", r, stria_status_name(st), stria_error_msg());
        cr_expect(strstr(stria_error_msg(), "rank 0 aborted") != NULL &&
                      strstr(stria_error_msg(), "kernel failed") != NULL,
                  "rank %d: %s", r, stria_error_msg());
    }
    cr_expect_lt(stria_time_now() - t0, 2.0);
    /* the aborting rank's own operations fail with its reason */
    stria_link_req_t *q;
    uint64_t x = 0;
    cr_expect_eq(stria_link_isend(ring.link[0], 2, &x, 8, &q), c->reason);
    /* later operations of the others give the same kind */
    cr_expect_eq(stria_link_irecv(ring.link[2], 3, &x, 8, &q), c->others);
    ring_close(&ring);
}

Test(ucx, deadline_names_the_silent_rank, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 3, "tcp", 1);
    uint64_t x;
    stria_link_req_t *rq;
    cr_assert_eq(stria_link_irecv(ring.link[1], 1, &x, 8, &rq), STRIA_OK);
    double t0 = stria_time_now();
    stria_status_t st = stria_link_wait(ring.link[1], rq, 0.3);
    double dt = stria_time_now() - t0;
    cr_expect_eq(st, STRIA_ERR_TIMEOUT);
    cr_expect(dt >= 0.29 && dt < 2.0, "waited %.2f s", dt);
    cr_expect(strstr(stria_error_msg(), "rank 0") != NULL, "%s", stria_error_msg());
    /* The other ranks hear of it. */
    usleep(200000);
    st = stria_link_irecv(ring.link[2], 1, &x, 8, &rq);
    if (st == STRIA_OK)
        st = stria_link_wait(ring.link[2], rq, 5);
    cr_expect_eq(st, STRIA_ERR_PEER, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "deadline") != NULL, "%s", stria_error_msg());
    ring_close(&ring);
}

Test(ucx, handshake_rejects_wrong_ring_size, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp"), *c1 = ctx_new("tcp");
    connect_arg_t args[2] = {
        {.ctx = c0,
         .p = {.job_id = 1,
               .ring_id = 1,
               .rank = 0,
               .size = 2,
               .next_host = "127.0.0.1",
               .next_port = stria_ucx_ctx_port(c1),
               .connect_timeout_s = 5}},
        {.ctx = c1,
         .p = {.job_id = 1,
               .ring_id = 1,
               .rank = 1,
               .size = 3,
               .next_host = "127.0.0.1",
               .next_port = stria_ucx_ctx_port(c0),
               .connect_timeout_s = 5}},
    };
    double t0 = stria_time_now();
    connect_all(args, 2);
    cr_expect_lt(stria_time_now() - t0, 4.0, "a mismatch must not wait for the timeout");
    for (int r = 0; r < 2; r++) {
        cr_expect_eq(args[r].st, STRIA_ERR_PROTOCOL, "rank %d: %s", r, args[r].msg);
        cr_expect(strstr(args[r].msg, "of 3") != NULL, "rank %d: %s", r, args[r].msg);
    }
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

Test(ucx, handshake_wrong_job_times_out_clearly, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp"), *c1 = ctx_new("tcp");
    connect_arg_t args[2] = {
        {.ctx = c0,
         .p = {.job_id = 1,
               .ring_id = 1,
               .rank = 0,
               .size = 2,
               .next_host = "127.0.0.1",
               .next_port = stria_ucx_ctx_port(c1),
               .connect_timeout_s = 1}},
        {.ctx = c1,
         .p = {.job_id = 2,
               .ring_id = 1,
               .rank = 1,
               .size = 2,
               .next_host = "127.0.0.1",
               .next_port = stria_ucx_ctx_port(c0),
               .connect_timeout_s = 1}},
    };
    connect_all(args, 2);
    for (int r = 0; r < 2; r++) {
        cr_expect_eq(args[r].st, STRIA_ERR_TIMEOUT, "rank %d: %s", r, args[r].msg);
        cr_expect(strstr(args[r].msg, "did not accept the handshake") != NULL, "rank %d: %s", r,
                  args[r].msg);
    }
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

/* The successor starts listening only after its predecessor began
 * connecting: the connect is retried until the timeout. */
Test(ucx, connect_waits_for_a_late_successor, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp");
    int port = free_port();
    connect_arg_t args[2] = {
        {.ctx = c0,
         .p = {.job_id = 1,
               .ring_id = 1,
               .rank = 0,
               .size = 2,
               .next_host = "127.0.0.1",
               .next_port = (uint16_t)port,
               .connect_timeout_s = 10}},
    };
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, connect_main, &args[0]), 0);
    usleep(700000);
    stria_ucx_ctx_params_t p1 = {
        .listen_host = "127.0.0.1", .listen_port = (uint16_t)port, .tls = "tcp"};
    stria_ucx_ctx_t *c1 = NULL;
    cr_assert_eq(stria_ucx_ctx_create(&p1, &c1), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_ucx_ctx_port(c1), port);
    args[1] = (connect_arg_t){.ctx = c1,
                              .p = {.job_id = 1,
                                    .ring_id = 1,
                                    .rank = 1,
                                    .size = 2,
                                    .next_host = "127.0.0.1",
                                    .next_port = stria_ucx_ctx_port(c0),
                                    .connect_timeout_s = 10}};
    connect_main(&args[1]);
    pthread_join(th, NULL);
    cr_assert_eq(args[0].st, STRIA_OK, "%s", args[0].msg);
    cr_assert_eq(args[1].st, STRIA_OK, "%s", args[1].msg);
    stria_link_destroy(args[0].link);
    stria_link_destroy(args[1].link);
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

/* A connect whose cancel flag is set gives up at once, not at its timeout
 * (the worker sets it when it drops the job of a pass still connecting). */
Test(ucx, a_cancelled_connect_ends_before_its_timeout, .init = setup, .fini = teardown,
     .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp");
    bool cancel = false;
    connect_arg_t arg = {.ctx = c0,
                         .p = {.job_id = 1,
                               .ring_id = 1,
                               .rank = 0,
                               .size = 2,
                               .next_host = "127.0.0.1",
                               .next_port = (uint16_t)free_port(),
                               .connect_timeout_s = 20,
                               .cancel = &cancel}};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, connect_main, &arg), 0);
    usleep(300000);
    double t0 = stria_time_now();
    __atomic_store_n(&cancel, true, __ATOMIC_RELEASE);
    pthread_join(th, NULL);
    double took = stria_time_now() - t0;
    cr_expect_eq(arg.st, STRIA_ERR_CANCELLED, "%s", arg.msg);
    cr_expect(strstr(arg.msg, "connect cancelled") != NULL, "%s", arg.msg);
    cr_expect_lt(took, 1.0, "the connect ended %.2f s after the cancel", took);
    stria_ucx_ctx_destroy(c0);
}

Test(ucx, ring_of_one, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c = ctx_new("tcp");
    stria_ucx_link_params_t p = {.job_id = 1,
                                 .ring_id = 1,
                                 .rank = 0,
                                 .size = 1,
                                 .next_host = "127.0.0.1",
                                 .next_port = stria_ucx_ctx_port(c),
                                 .connect_timeout_s = 10};
    stria_link_t *link = NULL;
    cr_assert_eq(stria_link_ucx_connect(c, &p, &link), STRIA_OK, "%s", stria_error_msg());
    stria_link_t *dup = NULL;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &dup), STRIA_ERR_BUSY);
    uint8_t out[200000], in[200000];
    fill(out, sizeof(out), 9);
    stria_link_req_t *sq, *rq;
    cr_assert_eq(stria_link_isend(link, 1, out, sizeof(out), &sq), STRIA_OK);
    cr_assert_eq(stria_link_irecv(link, 1, in, sizeof(in), &rq), STRIA_OK);
    cr_assert_eq(stria_link_wait(link, rq, 10), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_link_wait(link, sq, 10), STRIA_OK, "%s", stria_error_msg());
    cr_expect(memcmp(in, out, sizeof(in)) == 0);
    stria_link_destroy(link);
    stria_ucx_ctx_destroy(c);
}

Test(ucx, invalid_arguments, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c = NULL;
    stria_ucx_ctx_params_t bad_host = {.listen_host = "no.such.host.invalid"};
    cr_expect_eq(stria_ucx_ctx_create(&bad_host, &c), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "no.such.host.invalid") != NULL, "%s", stria_error_msg());
    stria_ucx_ctx_params_t empty_tls = {.tls = ""};
    cr_expect_eq(stria_ucx_ctx_create(&empty_tls, &c), STRIA_ERR_INVALID_ARG);
    stria_ucx_ctx_params_t long_poll = {.poll_us = 1000000};
    cr_expect_eq(stria_ucx_ctx_create(&long_poll, &c), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_ucx_ctx_create(NULL, &c), STRIA_ERR_INVALID_ARG);

    c = ctx_new("tcp");
    stria_ucx_ctx_params_t same = {
        .listen_host = "127.0.0.1", .listen_port = stria_ucx_ctx_port(c), .tls = "tcp"};
    stria_ucx_ctx_t *c2 = NULL;
    cr_expect_eq(stria_ucx_ctx_create(&same, &c2), STRIA_ERR_BUSY, "%s", stria_error_msg());

    stria_link_t *link = NULL;
    stria_ucx_link_params_t p = {.rank = 2, .size = 2, .next_host = "127.0.0.1", .next_port = 1};
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    p.rank = 0;
    p.size = 0;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    p.size = 2;
    p.next_port = 0;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    p.next_port = 1;
    p.next_host = NULL;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    p.next_host = "127.0.0.1";
    p.connect_timeout_s = -1;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    cr_expect_null(link);
    stria_ucx_ctx_destroy(c);
}
