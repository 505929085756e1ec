/* UCX link suite, pooled endpoints: links bind on one endpoint per peer
 * and direction (contexts of one process, one thread per rank), drops close
 * them once idle, a thousand links in a row leave a process as they found
 * it, and a peer killed and restarted on the same port between two links
 * is met with a new endpoint (rank processes). */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include "ucx_test_util.h"

/* ---- two contexts in this process ----------------------------------------- */

/* Connects `n` rings of two over (c0, c1) at once, ring ids first..;
 * links[2 * g + r] is rank r of ring g. */
static void rings_open(stria_ucx_ctx_t *c0, stria_ucx_ctx_t *c1, uint64_t first, int n,
                       stria_link_t **links)
{
    connect_arg_t c[16];
    pthread_t th[16];
    cr_assert_leq(2 * n, 16);
    for (int g = 0; g < n; g++)
        for (int r = 0; r < 2; r++)
            c[2 * g + r] = (connect_arg_t){.ctx = r == 0 ? c0 : c1,
                                           .p = {.job_id = 9,
                                                 .ring_id = first + (uint64_t)g,
                                                 .rank = r,
                                                 .size = 2,
                                                 .next_host = "127.0.0.1",
                                                 .next_port = stria_ucx_ctx_port(r == 0 ? c1 : c0),
                                                 .connect_timeout_s = 20}};
    for (int i = 0; i < 2 * n; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, connect_main, &c[i]), 0);
    for (int i = 0; i < 2 * n; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2 * n; i++) {
        cr_assert_eq(c[i].st, STRIA_OK, "ring %llu rank %d: %s", (unsigned long long)c[i].p.ring_id,
                     i % 2, c[i].msg);
        links[i] = c[i].link;
    }
}

/* One message each way on a ring of two. */
static void exchange(stria_link_t *l0, stria_link_t *l1, uint64_t v)
{
    uint64_t in0 = 0, in1 = 0, out0 = v, out1 = ~v;
    stria_link_req_t *q[4];
    cr_assert_eq(stria_link_irecv(l1, 1, &in1, 8, &q[0]), STRIA_OK);
    cr_assert_eq(stria_link_irecv(l0, 1, &in0, 8, &q[1]), STRIA_OK);
    cr_assert_eq(stria_link_isend(l0, 1, &out0, 8, &q[2]), STRIA_OK);
    cr_assert_eq(stria_link_isend(l1, 1, &out1, 8, &q[3]), STRIA_OK);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(stria_link_wait(i % 2 ? l0 : l1, q[i], 10), STRIA_OK, "%s", stria_error_msg());
    cr_expect(in1 == v && in0 == ~v, "wrong blocks");
}

static stria_ucx_ctx_stats_t stats_of(stria_ucx_ctx_t *ctx)
{
    stria_ucx_ctx_stats_t s;
    stria_ucx_ctx_stats(ctx, &s);
    return s;
}

/* Waits (10 s at most) until the context has `n` ready endpoints. */
static void wait_endpoints(stria_ucx_ctx_t *ctx, uint64_t n)
{
    for (int i = 0; i < 1000 && stats_of(ctx).endpoints_open != n; i++)
        usleep(10000);
    cr_expect_eq(stats_of(ctx).endpoints_open, n, "endpoints ready");
}

/* Twenty links in a row, then four at once, over one pair of contexts: one
 * endpoint each way, made once, every link a bind on it. */
Test(ucx_pool, links_bind_on_one_endpoint_per_peer, .init = setup, .fini = teardown, .timeout = 120)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp"), *c1 = ctx_new("tcp");
    stria_link_t *links[16];
    for (int i = 0; i < 20; i++) {
        rings_open(c0, c1, 100 + (uint64_t)i, 1, links);
        exchange(links[0], links[1], (uint64_t)i);
        stria_link_destroy(links[0]);
        stria_link_destroy(links[1]);
    }
    rings_open(c0, c1, 200, 4, links);
    for (int g = 0; g < 4; g++)
        exchange(links[2 * g], links[2 * g + 1], 77 + (uint64_t)g);
    stria_ucx_ctx_t *ctx[2] = {c0, c1};
    for (int k = 0; k < 2; k++) {
        stria_ucx_ctx_stats_t s = stats_of(ctx[k]);
        cr_expect_eq(s.endpoints_open, 2, "context %d: %llu endpoints", k,
                     (unsigned long long)s.endpoints_open);
        cr_expect_eq(s.endpoints_made, 2, "context %d made %llu endpoints", k,
                     (unsigned long long)s.endpoints_made);
        cr_expect_eq(s.binds_done, 24, "context %d took %llu binds", k,
                     (unsigned long long)s.binds_done);
        cr_expect_eq(s.endpoints_dropped + s.endpoints_replaced + s.binds_refused, 0);
        stria_ucx_endpoint_info_t eps[4];
        size_t n = stria_ucx_ctx_endpoints(ctx[k], eps, 4);
        cr_assert_eq(n, 2);
        for (size_t e = 0; e < n; e++) {
            cr_expect_eq(eps[e].links, 4, "context %d endpoint %s: %d links", k, eps[e].peer,
                         eps[e].links);
            cr_expect_eq(eps[e].binds, 24, "context %d endpoint %s: %llu binds", k, eps[e].peer,
                         (unsigned long long)eps[e].binds);
            cr_expect(!eps[e].authenticated);
        }
        cr_expect(eps[0].outgoing != eps[1].outgoing, "one endpoint each way");
    }
    for (int i = 0; i < 8; i++)
        stria_link_destroy(links[i]);
    for (int k = 0; k < 2; k++) {
        stria_ucx_endpoint_info_t eps[4];
        cr_assert_eq(stria_ucx_ctx_endpoints(ctx[k], eps, 4), 2, "the endpoints stay");
        cr_expect(eps[0].links == 0 && eps[1].links == 0);
    }
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

/* A dropped endpoint takes no new bind of this context (an accepted one
 * still takes its peer's) and closes once no link is bound on it (the
 * peer's side closes with it); new links make new ones. */
Test(ucx_pool, dropped_endpoints_close_once_idle, .init = setup, .fini = teardown, .timeout = 120)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp"), *c1 = ctx_new("tcp");
    stria_link_t *links[4];
    rings_open(c0, c1, 1, 1, links);
    cr_expect_eq(stria_ucx_ctx_drop_endpoints(c0, NULL), 2);
    stria_ucx_endpoint_info_t eps[4];
    cr_assert_eq(stria_ucx_ctx_endpoints(c0, eps, 4), 2, "bound endpoints stay");
    cr_expect(eps[0].dropping && eps[1].dropping);
    exchange(links[0], links[1], 5);
    /* a second ring meanwhile: c0 makes a new endpoint to c1, c1 binds on
     * its endpoint of before */
    rings_open(c0, c1, 2, 1, links + 2);
    exchange(links[2], links[3], 6);
    cr_expect_eq(stats_of(c0).endpoints_open, 3);
    cr_expect_eq(stats_of(c0).endpoints_made, 3);
    for (int i = 0; i < 4; i++)
        stria_link_destroy(links[i]);
    wait_endpoints(c0, 1);
    wait_endpoints(c1, 1);
    cr_expect_eq(stats_of(c0).endpoints_dropped, 2, "%llu",
                 (unsigned long long)stats_of(c0).endpoints_dropped);
    /* one peer's endpoint only: the one left, by its name */
    cr_assert_eq(stria_ucx_ctx_endpoints(c0, eps, 4), 1);
    cr_expect(eps[0].outgoing);
    cr_expect_eq(stria_ucx_ctx_drop_endpoints(c0, "no such peer"), 0);
    cr_expect_eq(stria_ucx_ctx_drop_endpoints(c0, eps[0].peer), 1);
    wait_endpoints(c0, 0);
    wait_endpoints(c1, 0);
    rings_open(c0, c1, 3, 1, links);
    exchange(links[0], links[1], 7);
    stria_link_destroy(links[0]);
    stria_link_destroy(links[1]);
    cr_expect_eq(stats_of(c0).endpoints_made, 5);
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

/* ---- rank processes ----------------------------------------------------------- */

/* A counter of a rank's stats file (ucx_ring_rank.c), -1 when missing. */
static long stat_of(int rank, const char *name)
{
    char path[400], text[1024] = " ", key[64];
    snprintf(path, sizeof(path), "%s/stats.%d", workdir, rank);
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        size_t n = fread(text + 1, 1, sizeof(text) - 2, f);
        text[n + 1] = '\0';
        fclose(f);
    }
    snprintf(key, sizeof(key), " %s ", name);
    const char *at = strstr(text, key);
    return at != NULL ? atol(at + strlen(key)) : -1;
}

static void spawn_sequence(int rank, int port, int next_port, const char *rings, int go_before,
                           bool hold)
{
    char s_rank[8], s_port[16], s_next[16], s_go[16];
    snprintf(s_rank, sizeof(s_rank), "%d", rank);
    snprintf(s_port, sizeof(s_port), "%d", port);
    snprintf(s_next, sizeof(s_next), "%d", next_port);
    snprintf(s_go, sizeof(s_go), "%d", go_before);
    char *argv[] = {STRIA_UCX_RING_RANK,
                    "--rank",
                    s_rank,
                    "--size",
                    "2",
                    "--dir",
                    workdir,
                    "--tls",
                    "tcp",
                    "--port",
                    s_port,
                    "--next-port",
                    s_next,
                    "--mode",
                    "rings",
                    "--rings",
                    (char *)rings,
                    "--go-before",
                    s_go,
                    "--connect-timeout",
                    "20",
                    hold ? "--hold" : NULL,
                    NULL};
    char tag[16];
    snprintf(tag, sizeof(tag), "%d", rank);
    pid_t pid = spawn(argv, tag);
    (void)pid;
}

/* Removes DIR/NAME.RANK. */
static void remove_file(const char *name, int rank)
{
    char path[400];
    snprintf(path, sizeof(path), "%s/%s.%d", workdir, name, rank);
    remove(path);
}

/* Writes DIR/NAME (an empty file a rank waits for). */
static void touch(const char *name)
{
    char path[400];
    snprintf(path, sizeof(path), "%s/%s", workdir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    fclose(f);
}

static void expect_ring_done(void)
{
    for (int r = 0; r < 2; r++) {
        result_t res = wait_result(r, 40);
        cr_assert(res.present, "rank %d wrote no result; log:\n%s", r, rank_log(r));
        cr_expect(res.ok, "rank %d: %s: %s; log:\n%s", r, res.status, res.msg, rank_log(r));
    }
    cr_expect_eq(stat_of(0, "endpoints"), 2, "one endpoint each way: %ld", stat_of(0, "endpoints"));
    cr_expect_eq(stat_of(0, "made"), 4, "two before, two after: %ld", stat_of(0, "made"));
}

/* kill -9 of a peer between two links, and a new process on its port: the
 * next connect meets it on new endpoints (the old ones dropped when UCX
 * reported them failed) and works; the survivor keeps one endpoint each
 * way. */
Test(ucx_pool, a_peer_restarted_between_links_is_met_on_new_endpoints, .init = setup,
     .fini = teardown, .timeout = 120)
{
    int port0 = free_port(), port1 = free_port();
    while (port1 == port0)
        port1 = free_port();
    spawn_sequence(0, port0, port1, "1,2", 2, false);
    spawn_sequence(1, port1, port0, "1", -1, true);
    wait_file("done.1", 0, 30);
    wait_file("done.1", 1, 30);
    cr_assert_eq(kill(children[1], SIGKILL), 0);
    reap(children[1], 10);
    remove_file("port", 1);
    spawn_sequence(1, port1, port0, "2", -1, false);
    wait_file("port", 1, 30); /* the new process listens */
    touch("go.2.0");
    expect_ring_done();
    cr_expect_geq(stat_of(0, "eps_dropped"), 2, "the stale endpoints stayed: %ld dropped",
                  stat_of(0, "eps_dropped"));
}

/* The peer dies while this rank's next connect waits for it (its bind sent
 * on the pooled endpoint, which looked ready): the stale endpoint is
 * replaced inside the connect, which then meets the new process. */
Test(ucx_pool, a_stale_endpoint_is_replaced_inside_the_connect, .init = setup, .fini = teardown,
     .timeout = 120)
{
    int port0 = free_port(), port1 = free_port();
    while (port1 == port0)
        port1 = free_port();
    spawn_sequence(0, port0, port1, "1,2", -1, false);
    spawn_sequence(1, port1, port0, "1", -1, true);
    wait_file("done.1", 0, 30);
    wait_file("done.1", 1, 30);
    usleep(300000); /* rank 0's bind of ring 2 waits at rank 1, which has no ring 2 */
    cr_assert_eq(kill(children[1], SIGKILL), 0);
    reap(children[1], 10);
    remove_file("port", 1);
    spawn_sequence(1, port1, port0, "2", -1, false);
    expect_ring_done();
    cr_expect_eq(stat_of(0, "replaced"), 1, "the stale endpoint was not replaced: %ld",
                 stat_of(0, "replaced"));
}

/* Reads one line of res.R ("warm ..." or "end ...") into its numbers. */
static void read_res(int rank, const char *label, long v[4])
{
    char path[400], line[256], fmt[128];
    snprintf(path, sizeof(path), "%s/res.%d", workdir, rank);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "rank %d wrote no res file", rank);
    snprintf(fmt, sizeof(fmt), "%s fds %%ld threads %%ld endpoints %%ld rss %%ld", label);
    bool found = false;
    while (!found && fgets(line, sizeof(line), f) != NULL)
        found = sscanf(line, fmt, &v[0], &v[1], &v[2], &v[3]) == 4;
    fclose(f);
    cr_assert(found, "rank %d: no '%s' line", rank, label);
}

/* A thousand links in a row between two processes, each with a pass: the
 * descriptors, threads and endpoints after the last are those after the
 * hundredth, and RssAnon does not grow (beyond allocator noise). */
Test(ucx_pool, a_thousand_links_do_not_grow_the_process, .init = setup, .fini = teardown,
     .timeout = 300)
{
    rank_args_t a = {.tls = "tcp", .bytes = 256, .mode = "links", .links = 1000};
    pid_t pids[2];
    for (int r = 0; r < 2; r++)
        pids[r] = spawn_rank(r, 2, &a);
    for (int r = 0; r < 2; r++) {
        int status = reap(pids[r], 240);
        result_t res = read_result(r);
        cr_assert(res.present && res.ok, "rank %d (status %d): %s: %s; log:\n%s", r, status,
                  res.status, res.msg, rank_log(r));
    }
    for (int r = 0; r < 2; r++) {
        long warm[4], end[4];
        read_res(r, "warm", warm);
        read_res(r, "end", end);
        cr_expect_eq(end[0], warm[0], "rank %d: %ld descriptors after 100 links, %ld after 1000", r,
                     warm[0], end[0]);
        cr_expect_eq(end[1], warm[1], "rank %d: %ld threads after 100 links, %ld after 1000", r,
                     warm[1], end[1]);
        cr_expect_eq(end[2], 2, "rank %d: %ld endpoints", r, end[2]);
        cr_expect_eq(end[2], warm[2]);
        /* The sanitizers keep freed memory in quarantine: RssAnon grows with
         * every allocation there. */
        long slack = STRIA_TEST_SANITIZE ? 256 * 1024 : 2048;
        cr_expect_leq(end[3] - warm[3], slack,
                      "rank %d: RssAnon grew from %ld kB to %ld kB over 900 links", r, warm[3],
                      end[3]);
        cr_expect_eq(stat_of(r, "binds"), 1000, "rank %d: %ld binds", r, stat_of(r, "binds"));
        cr_expect_eq(stat_of(r, "made"), 2, "rank %d made %ld endpoints", r, stat_of(r, "made"));
    }
}
