/* UCX ring link security, each test written as the attack: ranks of a ring
 * (ucx_ring_rank, with a ring key) as real processes on loopback, and an
 * attacker (ucx_ring_attacker) that reaches their ring port without the
 * key: injected data blocks are dropped and counted and the ring's results
 * stay right, a captured bind replayed (on another endpoint, or on its own)
 * is refused, forged binds are refused and counted while the ring serves
 * on, a wrong ring or endpoint key is refused on both sides, a peer of
 * another link protocol version is refused naming both versions, and
 * connections that never finish a handshake time out and are capped per
 * source. */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proc.h"
#include "stria_common.h"

#ifndef STRIA_UCX_RING_RANK
#error "STRIA_UCX_RING_RANK must name the ucx_ring_rank helper"
#endif
#ifndef STRIA_UCX_RING_ATTACKER
#error "STRIA_UCX_RING_ATTACKER must name the ucx_ring_attacker helper"
#endif

static char g_dir[64];

static void setup(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/stria-ucxauth-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        cr_log_warn("could not remove %s", g_dir);
}

static char *read_text(const char *name, int rank)
{
    static char text[2][2048];
    static int which;
    char path[256];
    char *out = text[which++ % 2];
    snprintf(path, sizeof(path), "%s/%s.%d", g_dir, name, rank);
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        size_t n = fread(out, 1, sizeof(text[0]) - 1, f);
        out[n] = '\0';
        fclose(f);
    }
    return out;
}

static bool wait_file(const char *name, int rank, double timeout_s)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%s.%d", g_dir, name, rank);
    double until = stria_time_now() + timeout_s;
    while (access(path, F_OK) != 0 && stria_time_now() < until)
        usleep(5000);
    return access(path, F_OK) == 0;
}

/* Starts rank `rank` of a ring of `size` with `extra` arguments (NULL
 * terminated). */
static test_proc_t *rank_start(int rank, int size, const char *const *extra)
{
    char s_rank[16], s_size[16], log[256];
    const char *argv[40];
    int n = 0;
    snprintf(s_rank, sizeof(s_rank), "%d", rank);
    snprintf(s_size, sizeof(s_size), "%d", size);
    snprintf(log, sizeof(log), "%s/stderr.%d", g_dir, rank);
    argv[n++] = STRIA_UCX_RING_RANK;
    argv[n++] = "--rank";
    argv[n++] = s_rank;
    argv[n++] = "--size";
    argv[n++] = s_size;
    argv[n++] = "--dir";
    argv[n++] = g_dir;
    argv[n++] = "--tls";
    argv[n++] = "tcp";
    for (; extra != NULL && *extra != NULL && n < 38; extra++)
        argv[n++] = *extra;
    argv[n] = NULL;
    test_proc_t *p = test_proc_start((char *const *)argv, log, NULL);
    cr_assert_not_null(p, "cannot start %s", STRIA_UCX_RING_RANK);
    return p;
}

/* Waits for a rank to exit and returns whether its result is "ok"; msg
 * receives the result text. */
static bool rank_finish(test_proc_t *p, int rank, char *msg, size_t len)
{
    int status = test_proc_wait(p, 60);
    snprintf(msg, len, "%s", read_text("result", rank));
    cr_expect(WIFEXITED(status), "rank %d did not exit by itself (status 0x%x); log:\n%s", rank,
              status, read_text("stderr", rank));
    return strncmp(msg, "ok", 2) == 0;
}

/* A counter of a rank's stats file ("dropped", "refused", "timed_out",
 * "rejected", "bind_refused", "replayed", "version", "endpoints", ...: see
 * ucx_ring_rank.c), -1 when missing. */
static long stat_of(int rank, const char *name)
{
    const char *t = read_text("stats", rank);
    char key[64];
    snprintf(key, sizeof(key), "%s ", name);
    const char *at = strstr(t, key);
    return at != NULL ? atol(at + strlen(key)) : -1;
}

static int port_of(int rank)
{
    cr_assert(wait_file("port", rank, 20), "rank %d wrote no port file", rank);
    return atoi(read_text("port", rank));
}

/* Runs the attacker with `extra` arguments against `port`; returns its
 * stdout (first line with `prefix`). */
static void attack(int port, const char *const *extra, const char *prefix, char *out, size_t len)
{
    char s_port[16], log[256];
    const char *argv[32];
    int n = 0;
    snprintf(s_port, sizeof(s_port), "%d", port);
    snprintf(log, sizeof(log), "%s/attacker.log", g_dir);
    argv[n++] = STRIA_UCX_RING_ATTACKER;
    argv[n++] = "--port";
    argv[n++] = s_port;
    for (; extra != NULL && *extra != NULL && n < 30; extra++)
        argv[n++] = *extra;
    argv[n] = NULL;
    const char *env[] = {"UCX_TLS=tcp", NULL};
    test_proc_t *p = test_proc_start((char *const *)argv, log, (char *const *)env);
    cr_assert_not_null(p);
    out[0] = '\0';
    bool got = test_proc_wait_line(p, prefix, 30, out, len);
    int status = test_proc_wait(p, 30);
    cr_assert(got, "the attacker printed no '%s' line (status 0x%x)", prefix, status);
}

/* A keyed ring of two running small blocks (eager) in passes checked
 * block by block (every block must hold its origin's pattern), for a few
 * seconds (3000 passes of at least a millisecond), once both ranks are
 * under way. */
static void keyed_ring_start(test_proc_t **p0, test_proc_t **p1)
{
    const char *ring[] = {"--key-seed", "5",           "--bytes", "4096", "--passes",
                          "3000",       "--late-recv", "1",       NULL};
    *p0 = rank_start(0, 2, ring);
    *p1 = rank_start(1, 2, ring);
    cr_assert(wait_file("ready", 1, 30), "the ring did not start; log:\n%s",
              read_text("stderr", 1));
}

Test(ucx_auth, a_keyed_ring_runs_and_a_wrong_or_missing_key_is_refused, .init = setup,
     .fini = teardown, .timeout = 120)
{
    char msg[2048];
    const char *key5[] = {"--key-seed", "5", "--passes", "3", "--bytes", "200000", NULL};
    test_proc_t *p[3];
    for (int r = 0; r < 3; r++)
        p[r] = rank_start(r, 3, key5);
    for (int r = 0; r < 3; r++)
        cr_expect(rank_finish(p[r], r, msg, sizeof(msg)), "keyed ring, rank %d: %s", r, msg);
    teardown();
    setup();

    /* Each rank of a ring of 2 with its own key: neither proves the other's. */
    const char *key6[] = {"--key-seed", "6", "--connect-timeout", "5", NULL};
    const char *key7[] = {"--key-seed", "7", "--connect-timeout", "5", NULL};
    p[0] = rank_start(0, 2, key6);
    p[1] = rank_start(1, 2, key7);
    /* Whichever side checks first fails for the key; the other hears of it
     * as a refusal, or times out once the first is gone. */
    int for_key = 0;
    for (int r = 0; r < 2; r++) {
        cr_expect(!rank_finish(p[r], r, msg, sizeof(msg)), "rank %d joined a ring of another key",
                  r);
        for_key += strstr(msg, "STRIA_ERR_AUTH") != NULL && strstr(msg, "ring key") != NULL;
    }
    cr_expect_geq(for_key, 1, "no rank failed for the ring key: %s", msg);
    cr_expect_geq(stat_of(0, "bind_refused") + stat_of(1, "bind_refused"), 1, "%s / %s",
                  read_text("stats", 0), read_text("stats", 1));
    teardown();
    setup();

    /* A rank with the key and one without. */
    const char *nokey[] = {"--connect-timeout", "5", NULL};
    p[0] = rank_start(0, 2, key6);
    p[1] = rank_start(1, 2, nokey);
    for_key = 0;
    for (int r = 0; r < 2; r++) {
        cr_expect(!rank_finish(p[r], r, msg, sizeof(msg)), "rank %d: a ring half keyed ran", r);
        for_key += strstr(msg, "STRIA_ERR_AUTH") != NULL && strstr(msg, "ring key") != NULL;
    }
    cr_expect_geq(for_key, 1, "no rank failed for the ring key: %s", msg);
}

/* A rank that refused its peer's key tears its context down while the peer
 * still retries the handshake: the teardown holds the peer's requests and
 * refuses them only as the listener goes, so no connection is half-way
 * through UCX's accept then (UCX 1.13 ran a freed listener's callback for
 * one: a crash at exit, about 1 run in 13 before). Ten rounds. */
Test(ucx_auth, a_peer_retrying_into_a_teardown_does_not_crash_it, .init = setup, .fini = teardown,
     .timeout = 240)
{
    char msg[2048];
    const char *key8[] = {"--key-seed", "8", "--connect-timeout", "1", NULL};
    const char *key9[] = {"--key-seed", "9", "--connect-timeout", "1", NULL};
    for (int round = 0; round < 10; round++) {
        test_proc_t *p[2] = {rank_start(0, 2, key8), rank_start(1, 2, key9)};
        for (int r = 0; r < 2; r++)
            cr_expect(!rank_finish(p[r], r, msg, sizeof(msg)), "round %d: rank %d joined", round,
                      r);
        teardown();
        setup();
    }
}

/* A peer whose handshake waits on a connection (it names a ring this rank
 * does not have) when this rank tears down: the connection closes only once
 * the listener is gone, so the peer's retry finds no listener; before, it
 * reached the listener in the teardown's quiet spell and was held and
 * refused, and in chaos runs such a retry crashed a worker at exit (as in
 * the test above). The peer redials at once each time; rank 1 is alone and
 * gives up waiting for its successor after 1 s. Three rounds. */
Test(ucx_auth, a_waiting_peer_retries_only_after_the_listener_is_gone, .init = setup,
     .fini = teardown, .timeout = 120)
{
    char msg[2048], out[256];
    const char *alone[] = {"--connect-timeout", "1", NULL};
    const char *redial[] = {"--mode", "redial", "--ring", "9", "--duration", "10", NULL};
    for (int round = 0; round < 3; round++) {
        test_proc_t *p1 = rank_start(1, 2, alone);
        attack(port_of(1), redial, "redials ", out, sizeof(out));
        int redials = -1, refused = -1;
        cr_expect_eq(sscanf(out, "redials %d refused %d", &redials, &refused), 2, "%s", out);
        cr_expect_geq(redials, 1, "round %d: the peer's connection was not closed: %s", round, out);
        cr_expect_eq(refused, 0, "round %d: a retry reached the listener in the teardown: %s",
                     round, out);
        cr_expect(!rank_finish(p1, 1, msg, sizeof(msg)), "round %d: rank 1 has no successor",
                  round);
        cr_expect(strstr(msg, "no port file") != NULL, "round %d: %s", round, msg);
        teardown();
        setup();
    }
}

Test(ucx_auth, injected_blocks_are_dropped_and_counted_and_the_results_stay_right, .init = setup,
     .fini = teardown, .timeout = 120)
{
    char msg[2048], out[256];
    test_proc_t *p0, *p1;
    keyed_ring_start(&p0, &p1);
    /* The attacker claims to be rank 0 of job 1, ring 1 and sprays blocks
     * of the right size at the ring's slot (the first) with the tag of
     * every pass; without the check, the rank would take one of them for
     * its predecessor's block at its next pass. */
    const char *inject[] = {"--mode",  "inject", "--slots",    "1", "--passes", "6000",
                            "--bytes", "4096",   "--duration", "2", NULL};
    attack(port_of(1), inject, "sent ", out, sizeof(out));
    cr_expect_gt(atol(out + 5), 100, "%s", out);
    cr_expect(rank_finish(p0, 0, msg, sizeof(msg)), "rank 0: %s", msg);
    cr_expect(rank_finish(p1, 1, msg, sizeof(msg)), "rank 1 took an injected block: %s", msg);
    cr_expect_gt(stat_of(1, "dropped"), 0, "no block was dropped and counted: %s",
                 read_text("stats", 1));
    cr_expect_eq(stat_of(0, "dropped"), 0, "%s", read_text("stats", 0));
}

/* A bind captured on one endpoint and replayed on another meets other
 * endpoint nonces; replayed on its own endpoint, a counter used before.
 * Both are refused and counted; the proof was good where it was made. */
Test(ucx_auth, a_captured_bind_replayed_is_refused, .init = setup, .fini = teardown, .timeout = 120)
{
    char msg[2048], out[256];
    /* The victim is rank 1 of job 1, ring 1; its successor (rank 0) never
     * comes, so its link waits for the connect timeout. */
    const char *victim[] = {"--key-seed", "5", "--next-port", "1", "--connect-timeout", "6", NULL};
    test_proc_t *p1 = rank_start(1, 2, victim);
    const char *replay[] = {"--mode", "replay", "--key-seed", "5", NULL};
    int port = port_of(1);
    usleep(300000); /* the link exists: binds are checked at once */
    attack(port, replay, "elsewhere ", out, sizeof(out));
    cr_expect(strncmp(out, "elsewhere STRIA_ERR_AUTH ", 25) == 0,
              "the bind replayed on another endpoint was taken: %s", out);
    cr_expect(strstr(out, "honest STRIA_OK") != NULL, "the captured bind was not good: %s", out);
    cr_expect(strstr(out, "same STRIA_ERR_AUTH") != NULL,
              "the bind replayed on its own endpoint was taken: %s", out);
    rank_finish(p1, 1, msg, sizeof(msg));
    cr_expect_geq(stat_of(1, "bind_refused"), 1, "%s", read_text("stats", 1));
    cr_expect_geq(stat_of(1, "replayed"), 1, "%s", read_text("stats", 1));
}

/* Binds with a wrong ring key for a running ring's slot, and one with a
 * stale counter, over an endpoint the attacker made: refused and counted,
 * and the ring runs on with right results. */
Test(ucx_auth, forged_binds_are_refused_and_counted_and_the_ring_serves_on, .init = setup,
     .fini = teardown, .timeout = 120)
{
    char msg[2048], out[256];
    test_proc_t *p0, *p1;
    keyed_ring_start(&p0, &p1);
    const char *forge[] = {"--mode", "forge", "--key-seed", "5", "--binds", "20", NULL};
    attack(port_of(1), forge, "forged ", out, sizeof(out));
    cr_expect(strncmp(out, "forged STRIA_ERR_AUTH stale STRIA_ERR_AUTH", 42) == 0, "%s", out);
    cr_expect(rank_finish(p0, 0, msg, sizeof(msg)), "rank 0: %s", msg);
    cr_expect(rank_finish(p1, 1, msg, sizeof(msg)), "rank 1 under forged binds: %s", msg);
    cr_expect_geq(stat_of(1, "bind_refused"), 20, "%s", read_text("stats", 1));
    cr_expect_geq(stat_of(1, "replayed"), 1, "%s", read_text("stats", 1));
    /* the ring's own endpoints only: one out, one in (the attacker's is gone) */
    cr_expect_eq(stat_of(0, "endpoints"), 2, "%s", read_text("stats", 0));
}

/* A peer of another link protocol version is refused, the answer naming
 * both versions (version 2 in its own format, so that a worker of that
 * version fails its link with it), counted, and the ring serves on. And a
 * successor of another version fails the connect at once, naming both. */
Test(ucx_auth, a_peer_of_another_link_version_is_refused_naming_both, .init = setup,
     .fini = teardown, .timeout = 120)
{
    char msg[2048], out[512];
    const char *ring[] = {"--bytes", "4096", "--passes", "3000", "--late-recv", "1", NULL};
    test_proc_t *p0 = rank_start(0, 2, ring);
    test_proc_t *p1 = rank_start(1, 2, ring);
    cr_assert(wait_file("ready", 1, 30), "the ring did not start");
    const char *v2[] = {"--mode", "version", "--version", "2", NULL};
    attack(port_of(1), v2, "answer ", out, sizeof(out));
    cr_expect(strstr(out, "answer STRIA_ERR_PROTOCOL") != NULL && strstr(out, "version 3") &&
                  strstr(out, "version 2"),
              "a version 2 worker's hello: %s", out);
    const char *v4[] = {"--mode", "version", "--version", "4", NULL};
    attack(port_of(1), v4, "answer ", out, sizeof(out));
    cr_expect(strstr(out, "answer STRIA_ERR_PROTOCOL") != NULL && strstr(out, "version 3") &&
                  strstr(out, "version 4"),
              "a version 4 worker's hello: %s", out);
    cr_expect(rank_finish(p0, 0, msg, sizeof(msg)), "rank 0: %s", msg);
    cr_expect(rank_finish(p1, 1, msg, sizeof(msg)), "rank 1: %s", msg);
    cr_expect_eq(stat_of(1, "version"), 2, "%s", read_text("stats", 1));
    teardown();
    setup();

    /* A successor that answers in version 4. */
    char log[256];
    snprintf(log, sizeof(log), "%s/attacker.log", g_dir);
    const char *argv[] = {STRIA_UCX_RING_ATTACKER,
                          "--mode",
                          "listen-version",
                          "--version",
                          "4",
                          "--duration",
                          "20",
                          NULL};
    const char *env[] = {"UCX_TLS=tcp", NULL};
    test_proc_t *atk = test_proc_start((char *const *)argv, log, (char *const *)env);
    cr_assert_not_null(atk);
    cr_assert(test_proc_wait_line(atk, "port ", 20, out, sizeof(out)),
              "the listener did not start");
    char next_port[16];
    snprintf(next_port, sizeof(next_port), "%d", atoi(out + 5));
    const char *conn[] = {"--next-port", next_port, "--connect-timeout", "15", NULL};
    double t0 = stria_time_now();
    test_proc_t *p = rank_start(1, 2, conn);
    cr_expect(!rank_finish(p, 1, msg, sizeof(msg)), "a successor of version 4 was taken");
    cr_expect_lt(stria_time_now() - t0, 10.0, "the refusal waited for the connect timeout");
    cr_expect(strstr(msg, "STRIA_ERR_PROTOCOL") != NULL && strstr(msg, "version 4") != NULL &&
                  strstr(msg, "version 3") != NULL,
              "%s", msg);
    cr_expect_eq(stat_of(1, "version"), 1, "%s", read_text("stats", 1));
    test_proc_stop(atk, SIGKILL, 5);
}

/* With an endpoint key, a ring whose ranks share it runs (its endpoints
 * proven both ways), a rank with another endpoint key or none is refused
 * for it and counted, and blocks an attacker without it injects are
 * dropped. */
Test(ucx_auth, endpoints_prove_the_endpoint_key, .init = setup, .fini = teardown, .timeout = 120)
{
    char msg[2048], out[256];
    const char *ring[] = {"--endpoint-key-seed", "11", "--key-seed", "5", "--passes", "3000",
                          "--late-recv",         "1",  NULL};
    test_proc_t *p0 = rank_start(0, 2, ring);
    test_proc_t *p1 = rank_start(1, 2, ring);
    cr_assert(wait_file("ready", 1, 30), "the ring did not start; log:\n%s",
              read_text("stderr", 1));
    const char *inject[] = {"--mode", "inject",     "--slots", "1", "--passes",
                            "200",    "--duration", "1",       NULL};
    attack(port_of(1), inject, "sent ", out, sizeof(out));
    /* a proof made with another endpoint key */
    const char *wrong[] = {"--mode", "replay", "--key-seed", "5", "--endpoint-key-seed",
                           "12",     NULL};
    attack(port_of(1), wrong, "handshake ", out, sizeof(out));
    cr_expect(strstr(out, "STRIA_ERR_AUTH") != NULL, "a wrong endpoint key was taken: %s", out);
    cr_expect(rank_finish(p0, 0, msg, sizeof(msg)), "rank 0: %s", msg);
    cr_expect(rank_finish(p1, 1, msg, sizeof(msg)), "rank 1: %s", msg);
    cr_expect_geq(stat_of(1, "refused"), 3, "the keyless hello and the wrong proofs: %s",
                  read_text("stats", 1));
    cr_expect_gt(stat_of(1, "dropped"), 0, "%s", read_text("stats", 1));
    teardown();
    setup();

    const char *k11[] = {"--endpoint-key-seed", "11", "--connect-timeout", "5", NULL};
    const char *k12[] = {"--endpoint-key-seed", "12", "--connect-timeout", "5", NULL};
    const char *none[] = {"--connect-timeout", "5", NULL};
    const char *const *other[2] = {k12, none};
    for (int c = 0; c < 2; c++) {
        p0 = rank_start(0, 2, k11);
        p1 = rank_start(1, 2, other[c]);
        int for_key = 0;
        for (int r = 0; r < 2; r++) {
            cr_expect(!rank_finish(r == 0 ? p0 : p1, r, msg, sizeof(msg)),
                      "case %d: rank %d joined", c, r);
            for_key += strstr(msg, "STRIA_ERR_AUTH") != NULL && strstr(msg, "endpoint key") != NULL;
        }
        cr_expect_geq(for_key, 1, "case %d: no rank failed for the endpoint key: %s", c, msg);
        cr_expect_geq(stat_of(0, "refused") + stat_of(1, "refused"), 1, "case %d: %s / %s", c,
                      read_text("stats", 0), read_text("stats", 1));
        teardown();
        setup();
    }
}

Test(ucx_auth, silent_connections_time_out_and_are_capped_per_source, .init = setup,
     .fini = teardown, .timeout = 120)
{
    char msg[2048], out[256];
    /* 3000 passes of at least a millisecond each: the ring outlives the
     * flood (3 s) and the 1 s deadline of its connections. */
    const char *ring[] = {
        "--key-seed",          "5", "--bytes",       "4096", "--passes", "3000", "--late-recv", "1",
        "--handshake-timeout", "1", "--max-pending", "4",    NULL};
    test_proc_t *p0 = rank_start(0, 2, ring);
    test_proc_t *p1 = rank_start(1, 2, ring);
    cr_assert(wait_file("ready", 1, 30), "the ring did not start");
    const char *flood[] = {"--mode", "flood", "--conns", "10", "--duration", "3", NULL};
    attack(port_of(1), flood, "rejected ", out, sizeof(out));
    cr_expect(rank_finish(p0, 0, msg, sizeof(msg)), "rank 0: %s", msg);
    cr_expect(rank_finish(p1, 1, msg, sizeof(msg)), "rank 1 under the flood: %s", msg);
    cr_expect_geq(stat_of(1, "rejected"), 6, "10 silent connections, 4 may wait: %s",
                  read_text("stats", 1));
    cr_expect_geq(stat_of(1, "timed_out"), 4, "the 4 that waited are closed after 1 s: %s",
                  read_text("stats", 1));
    cr_expect(strstr(out, "rejected 0 ") == NULL, "the attacker saw no rejection: %s", out);
}
