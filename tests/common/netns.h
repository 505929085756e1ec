/* Test-only: a few "hosts" on one machine, each a network namespace, joined
 * by a switch (a bridge in host 0, a veth pair to each other host), with
 * addresses 10.79.0.1, .2, ... A guard process deletes the namespaces when
 * the test process goes away, however it goes. Needs root and the `ip`
 * command; where they are missing, test_hosts_create() says why and the
 * test skips itself. */
#ifndef STRIA_TEST_NETNS_H
#define STRIA_TEST_NETNS_H

#include <stdbool.h>
#include <sys/types.h>

#define TEST_HOSTS_MAX 4

typedef struct {
    int n;
    char ns[TEST_HOSTS_MAX][32];   /* namespace names */
    char dev[TEST_HOSTS_MAX][16];  /* each host's interface (host 0: the bridge) */
    char addr[TEST_HOSTS_MAX][16]; /* each host's address */
    int guard_fd;
    pid_t guard;
} test_hosts_t;

/* Creates n (2 .. TEST_HOSTS_MAX) hosts; NULL when done, else the reason
 * they cannot be made here (what was made is deleted). */
const char *test_hosts_create(test_hosts_t *h, int n);
/* Deletes the namespaces (safe to call twice). */
void test_hosts_destroy(test_hosts_t *h);
/* Moves the calling process into host i's network; 0 or -1. */
int test_hosts_enter(const test_hosts_t *h, int i);
/* Takes host i's link (i >= 1) down (`up` false: the cable cut) or up. */
int test_hosts_link(const test_hosts_t *h, int i, bool up);
/* Runs a shell command quietly; its exit code (-1 when it did not exit). */
int test_run_quiet(const char *cmd);

#endif
