/*
 * stria-bench slowlink: the service across hosts joined by slow links.
 *
 * Builds a small cluster out of Linux network namespaces, runs the service on
 * it and times attention passes through it, per layout:
 *
 *   head namespace    the coordinator and this process (the client); two
 *                     switches: `fab`, the fabric between hosts, and `mgmt`
 *                     (10.202.0.254), the control network
 *   worker namespace  one per worker: `nic` (10.201.0.K), its own port on
 *                     the fabric, rate-limited both ways by tc (tbf on the
 *                     worker's side and on the switch port); `mgmt`
 *                     (10.202.0.K), not limited
 *
 * Workers of one host reach each other's `nic` address over `mgmt` (a /32
 * route each way): the link inside a host is fast, and only traffic between
 * hosts crosses a rate-limited interface. Each worker has a namespace of its
 * own rather than sharing its host's: UCX 1.13's TCP transport does not bind
 * its connections to the interface of UCX_NET_DEVICES (the kernel picks the
 * source by route), so two workers in one namespace could not each keep to
 * their own interface. The coordinator groups a host's workers in the ring
 * (--host), the ring link is UCX over TCP only (--ucx-tls tcp, --ucx-net-devices
 * nic: no shared memory, which would bypass the hosts' links), and the client
 * moves tensors over the control network, so the timed passes are bound by
 * the fabric alone.
 *
 * Every namespace is named stria-sl<PID>-*; a guard process deletes them
 * when this process ends, however it ends, the daemons have a parent-death
 * signal, and Ctrl-C stops everything before exiting. Needs root, `ip` and
 * `tc`: without them it exits with 77 (skipped) saying why.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "bench_daemons.h"
#include "bench_util.h"
#include "slowlink.h"
#include "stria_client.h"
#include "stria_common.h"

#define SL_SKIP 77 /* the usual "skipped" exit code (ctest SKIP_RETURN_CODE) */
static const char sl_description[] =
    "Runs the service across network namespaces acting as hosts: H hosts of W\n"
    "workers, each worker with its own interface on the fabric between hosts,\n"
    "rate-limited both ways with tc (tbf), the workers of a host joined by a fast\n"
    "link, the ring link forced to UCX over TCP, the workers computing on the CPU.\n"
    "Opens one session per --layouts entry on the H x W workers and times causal\n"
    "forward and forward+backward calls (libstria sessions, whole sequence), the\n"
    "layouts alternated in each of --reps rounds after one warm-up call each;\n"
    "reports per layout the medians of the call's wall time, the ring pass alone\n"
    "(the slowest rank's) and the bytes that crossed the rate-limited interfaces.\n"
    "With --sharded, each layout and head groups is also measured as a sharded\n"
    "session, called as a context-parallel trainer calls it: its workers / G\n"
    "trainer ranks, a thread and a client each, rank 0 opening and exporting it,\n"
    "the others importing it, each calling with its own tokens (cut from the same\n"
    "tensors), forward on every rank at once, then backward; its row (\"sh\")\n"
    "beside the whole-sequence one in the same rounds, its pass the slowest rank's.\n"
    "A layout the service refuses is a row that says so. Then, unless\n"
    "--no-baseline, the first layout again with the rate limit lifted: the ratio\n"
    "of the two times is how far its pass is bound by the links. Everything it\n"
    "makes (namespaces, interfaces, daemons) is removed when it ends, also on\n"
    "failure or Ctrl-C.";

static const char sl_epilog[] =
    "Needs root and the ip and tc commands (iproute2) with network namespace and\n"
    "tbf support; where they are missing it says why and exits with status 77.\n"
    "The daemons are found beside this program (stria-coordinator, stria-worker).";

/* ---- options ----------------------------------------------------------------- */

static stria_status_t sl_parse_dtype(const char *text, void *dst)
{
    return stria_dtype_parse(text, dst);
}

/* "200mbit", "1gbit", "500kbit", "1000000bit" (SI multiples, as tc reads
 * them) or "none"/"0": no limit. */
static int sl_parse_rate(const char *text, sl_cfg_t *c)
{
    static const struct {
        const char *unit;
        double mult;
    } units[] = {{"bit", 1}, {"kbit", 1e3}, {"mbit", 1e6}, {"gbit", 1e9}};
    if (strcmp(text, "none") == 0 || strcmp(text, "0") == 0) {
        c->rate_bits = 0;
        snprintf(c->rate_text, sizeof(c->rate_text), "none");
        return -1;
    }
    char *end = NULL;
    errno = 0;
    double v = strtod(text, &end);
    for (size_t i = 0; errno == 0 && end != text && v > 0 && i < sizeof(units) / sizeof(units[0]);
         i++) {
        if (strcmp(end, units[i].unit) != 0)
            continue;
        c->rate_bits = v * units[i].mult;
        if (c->rate_bits < 1e6 || c->rate_bits > 40e9)
            return stria_bench_usage_error("slowlink", "--rate '%s': from 1mbit to 40gbit", text);
        snprintf(c->rate_text, sizeof(c->rate_text), "%s", text);
        return -1;
    }
    return stria_bench_usage_error("slowlink",
                                   "--rate '%s': expected a number with bit, kbit, mbit or gbit "
                                   "(200mbit), or none",
                                   text);
}

static int sl_parse_layouts(const stria_str_list_t *l, sl_cfg_t *c)
{
    for (size_t i = 0; i < l->n; i++) {
        stria_layout_kind_t k;
        if (stria_layout_kind_parse(l->v[i], &k) != STRIA_OK || k == STRIA_LAYOUT_AUTO)
            return stria_bench_usage_error("slowlink",
                                           "--layouts: '%s' is not striped, contiguous, zigzag "
                                           "or packed",
                                           l->v[i]);
        for (int j = 0; j < c->n_layouts; j++)
            if (c->layouts[j] == k)
                return stria_bench_usage_error("slowlink", "--layouts: '%s' twice", l->v[i]);
        c->layouts[c->n_layouts] = k;
        c->layout_names[c->n_layouts++] = stria_layout_kind_name(k);
    }
    return -1;
}

/* Returns -1 to go on, else the exit code. */
static int sl_parse(int argc, char **argv, sl_cfg_t *c)
{
    int64_t hosts, wph, reps, tpr;
    const char *rate = NULL, *docs = NULL;
    stria_str_list_t layouts = {0};
    stria_int_list_t groups = {0};
    memset(c, 0, sizeof(*c));
    c->baseline = true;
    const stria_option_t opts[] = {
        STRIA_OPTION("hosts", INT, &hosts, "H", "hosts (network namespaces joined by the fabric)",
                     .dflt = "2", .min = 2, .max = SL_MAX_HOSTS),
        STRIA_OPTION("workers-per-host", INT, &wph, "W", "workers on each host", .dflt = "2",
                     .min = 1, .max = SL_MAX_WPH),
        STRIA_OPTION("rate", STRING, &rate, "RATE",
                     "each worker's interface, both ways: 200mbit, 1gbit, ... or none",
                     .dflt = "25mbit"),
        STRIA_OPTION("layouts", STRINGS, &layouts, "L[,L...]",
                     "striped, contiguous, zigzag, packed: one session each",
                     .dflt = "striped,contiguous,zigzag,packed", .max_items = SL_MAX_LAYOUTS),
        STRIA_OPTION("head-groups", INTS, &groups, "G[,G...]",
                     "head groups of each layout's sessions: G rings of workers / G ranks, each "
                     "over heads / G (1: one ring of every worker)",
                     .dflt = "1", .min = 1, .max = 64, .max_items = SL_MAX_GROUPS),
        STRIA_OPTION("across", FLAG, &c->across, NULL,
                     "also each G > 1 with its rings across the hosts (ring rank j of every "
                     "ring on host j: head_group_rings ACROSS; rows \"G=2 x\"), beside the "
                     "default rings inside hosts"),
        STRIA_OPTION(
            "sharded", FLAG, &c->sharded, NULL,
            "also a sharded session of each layout and head groups: workers / G trainer "
            "ranks (threads, a client each) calling with their own tokens, measured beside "
            "the whole-sequence one"),
        STRIA_OPTION("per-worker", FLAG, &c->per_worker, NULL,
                     "with --sharded: also each striped G > 1 called by one trainer rank per "
                     "worker (trainer_ranks; rows \"sh/w\"), whose G uploads per worker the "
                     "worker puts together"),
        STRIA_OPTION("seq", INT, &c->seq, "S", "tokens of a call", .dflt = "4096", .min = 1,
                     .max = 1 << 24),
        STRIA_OPTION("heads", INT, &c->heads, "H", "query heads", .dflt = "4", .min = 1,
                     .max = 1024),
        STRIA_OPTION("kv-heads", INT, &c->kv_heads, "K", "key/value heads, dividing H (default: H)",
                     .min = 1, .max = 1024),
        STRIA_OPTION("head-dim", INT, &c->head_dim, "D", "head dimension, a multiple of 8",
                     .dflt = "64", .min = 8, .max = 1024),
        STRIA_OPTION("dtype", CUSTOM, &c->dtype, "fp32|bf16|fp16", "storage of Q, K, V and dO",
                     .dflt = "fp32", .parse = sl_parse_dtype),
        STRIA_OPTION("documents", STRING, &docs, "lognormal:MEDIAN[:SIGMA]",
                     "documents (cu_seqlens) in every call, lengths drawn log-normal around MEDIAN "
                     "tokens (SIGMA of the log, default 1), fixed seed, as stria-bench ring "
                     "--documents"),
        STRIA_OPTION("reps", INT, &reps, "R", "timed rounds (medians reported)", .dflt = "3",
                     .min = 1, .max = 100),
        STRIA_OPTION("no-baseline", UNFLAG, &c->baseline, NULL,
                     "skip the run of the first layout without the rate limit"),
        STRIA_OPTION("threads-per-worker", INT, &tpr, "T", "kernel threads of each worker",
                     .dflt = "1", .min = 1, .max = 256),
        STRIA_OPTION("memory", BYTES, &c->memory, "BYTES",
                     "memory each worker offers (default: what the sessions need, doubled)",
                     .min = 0, .max = 1e15),
        STRIA_OPTION("step-timeout", DURATION, &c->step_timeout_s, "TIME",
                     "deadline of one ring step", .dflt = "120", .min = 1, .max = 3600),
        STRIA_OPTION("log-dir", STRING, &c->log_dir, "DIR",
                     "keep the daemons' logs there (default: a temporary folder, removed after a "
                     "run that succeeded)"),
        STRIA_OPTION("json", FLAG, &c->json, NULL, "one JSON object per row, then a summary"),
        {.name = NULL},
    };
    const stria_command_t cmd = {
        .name = "slowlink", .description = sl_description, .epilog = sl_epilog, .options = opts};
    stria_cli_t cli;
    int rc = stria_bench_parse(&cmd, argc, argv, &cli);
    if (rc < 0) {
        c->hosts = (int)hosts, c->wph = (int)wph, c->reps = (int)reps, c->tpr = (int)tpr;
        rc = sl_parse_rate(rate, c);
        if (rc < 0)
            rc = sl_parse_layouts(&layouts, c);
        c->n_groups = 0;
        for (size_t i = 0; rc < 0 && i < groups.n; i++)
            c->groups[c->n_groups++] = (int)groups.v[i];
        stria_bench_masks_t m;
        if (rc < 0)
            rc = stria_bench_masks("slowlink", true, docs, NULL, &m);
        c->doc_median = m.doc_median;
        c->doc_sigma = m.doc_sigma;
    }
    stria_cli_free(&cli);
    if (rc >= 0)
        return rc;
    stria_bench_shape_t s = {c->heads, c->kv_heads, c->head_dim, c->dtype};
    if (stria_bench_shape_check("slowlink", &s) >= 0)
        return 2;
    c->kv_heads = s.kv_heads;
    if (c->hosts * c->wph > SL_MAX_WORKERS)
        return stria_bench_usage_error("slowlink", "%d x %d workers: at most %d", c->hosts, c->wph,
                                       SL_MAX_WORKERS);
    for (int i = 0; i < c->n_groups; i++)
        if ((c->hosts * c->wph) % c->groups[i] != 0 || c->kv_heads % c->groups[i] != 0)
            return stria_bench_usage_error("slowlink",
                                           "--head-groups %d must divide the workers (%d) and "
                                           "--kv-heads (%lld)",
                                           c->groups[i], c->hosts * c->wph, (long long)c->kv_heads);
    return -1;
}

/* ---- processes and commands ---------------------------------------------------- */

/* What the signal handler must reach: the daemons (killed) and the guard
 * (its pipe closed, then waited for while it deletes the namespaces). */
static volatile pid_t sl_pids[SL_MAX_WORKERS + 1];
static int sl_out[SL_MAX_WORKERS + 1] = {[0 ... SL_MAX_WORKERS] = -1};
static volatile int sl_n_pids;
static volatile pid_t sl_guard;
static volatile int sl_guard_fd = -1;

static void sl_on_signal(int sig)
{
    static const char msg[] = "stria-bench slowlink: interrupted; removing what it made\n";
    for (int i = 0; i < sl_n_pids; i++)
        if (sl_pids[i] > 0)
            kill(sl_pids[i], SIGKILL);
    for (int i = 0; i < sl_n_pids; i++)
        if (sl_pids[i] > 0)
            waitpid(sl_pids[i], NULL, 0);
    ssize_t w = write(2, msg, sizeof(msg) - 1);
    (void)w;
    if (sl_guard_fd >= 0) {
        close(sl_guard_fd);
        waitpid(sl_guard, NULL, 0);
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

/* The first of `paths` that can be run, or NULL. */
static const char *sl_find(const char *const *paths)
{
    for (; *paths != NULL; paths++)
        if (access(*paths, X_OK) == 0)
            return *paths;
    return NULL;
}

static const char *const sl_ip_paths[] = {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip",
                                          NULL};
static const char *const sl_tc_paths[] = {"/usr/sbin/tc", "/sbin/tc", "/usr/bin/tc", "/bin/tc",
                                          NULL};

/* Runs a shell command, its output (both streams, the last `cap` - 1 bytes)
 * in out; returns its exit status (-1 when it did not exit). */
static int sl_sh(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int sl_sh(char *out, size_t cap, const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    memcpy(cmd, "{ ", 2);
    int n = vsnprintf(cmd + 2, sizeof(cmd) - 16, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof(cmd) - 16)
        return -1;
    strcat(cmd, "; } 2>&1"); /* every command's messages, not only the last one's */
    FILE *p = popen(cmd, "r");
    if (p == NULL)
        return -1;
    size_t len = 0;
    char buf[512];
    out[0] = '\0';
    while (fgets(buf, sizeof(buf), p) != NULL) {
        size_t b = strlen(buf);
        if (len + b >= cap) { /* keep the end: the error is last */
            size_t drop = len + b - cap + 1 < len ? len + b - cap + 1 : len;
            memmove(out, out + drop, len - drop + 1);
            len -= drop;
        }
        if (b < cap) {
            memcpy(out + len, buf, b + 1);
            len += b;
        }
    }
    int st = pclose(p);
    if (len > 0 && out[len - 1] == '\n')
        out[len - 1] = '\0';
    return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* ---- the network ----------------------------------------------------------------- */

/* Deletes the namespaces of runs whose process is gone (a run killed with
 * its guard): stria-sl<PID>-* with no process PID. */
static void sl_reap_stale(const sl_net_t *net)
{
    char out[8192];
    if (sl_sh(out, sizeof(out), "%s netns list", net->ip) != 0)
        return;
    for (char *line = strtok(out, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        long pid;
        int at = 0;
        char name[64];
        if (sscanf(line, "%63s", name) != 1 || sscanf(name, "stria-sl%ld-%n", &pid, &at) != 1 ||
            at == 0 || pid <= 0)
            continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue;
        char ignored[256];
        sl_sh(ignored, sizeof(ignored), "%s netns delete %s", net->ip, name);
    }
}

/* Deletes every namespace of this run (names from the prefix). */
static void sl_delete_all(const char *ip, const char *prefix)
{
    char out[256];
    sl_sh(out, sizeof(out),
          "for n in $(%s netns list | awk '{print $1}' | grep '^%s-'); do %s netns delete $n; "
          "done",
          ip, prefix, ip);
}

/* A child that outlives this process on purpose and deletes the namespaces
 * once the pipe closes (this process ended, however it ended), and the
 * temporary log folder `logs` (NULL: none) unless told to keep it (a byte
 * written before the close: an ending that was not an interruption). In a
 * process group of its own, so that Ctrl-C does not end it before it did
 * so. */
static int sl_guard_start(const sl_net_t *net, const char *logs)
{
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(pfd[0]), close(pfd[1]);
        return -1;
    }
    if (pid == 0) {
        setpgid(0, 0);
        signal(SIGINT, SIG_IGN);
        signal(SIGHUP, SIG_IGN);
        signal(SIGTERM, SIG_IGN);
        close(pfd[1]);
        char c;
        ssize_t got;
        while ((got = read(pfd[0], &c, 1)) < 0 && errno == EINTR)
            ;
        sl_delete_all(net->ip, net->prefix);
        char out[256];
        if (got != 1 && logs != NULL)
            sl_sh(out, sizeof(out), "rm -rf '%s'", logs);
        _exit(0);
    }
    close(pfd[0]);
    sl_guard = pid;
    sl_guard_fd = pfd[1];
    return 0;
}

/* Ends the guard, which deletes the namespaces, and waits for it. */
static void sl_guard_stop(void)
{
    if (sl_guard_fd < 0)
        return;
    int fd = sl_guard_fd;
    sl_guard_fd = -1;
    ssize_t w = write(fd, "k", 1); /* not interrupted: the logs are this process's to remove */
    (void)w;
    close(fd);
    waitpid(sl_guard, NULL, 0);
    sl_guard = 0;
}

/* Runs one step of the set-up; on failure writes why into net->why. */
static bool sl_step(sl_net_t *net, const char *what, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool sl_step(sl_net_t *net, const char *what, const char *fmt, ...)
{
    char cmd[2048], out[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    va_end(ap);
    if (sl_sh(out, sizeof(out), "%s", cmd) == 0)
        return true;
    snprintf(net->why, sizeof(net->why), "cannot %s (%.400s): %.500s", what, cmd,
             out[0] ? out : "no output");
    return false;
}

/* The tbf of one interface: `rate` bits/s, a burst of 5 ms (at least 128 KiB:
 * above a veth's GSO packets), up to 100 ms queued. */
static bool sl_shape(sl_net_t *net, const char *ns, const char *dev, double rate)
{
    double burst = rate / 8 * 0.005;
    if (burst < 131072)
        burst = 131072;
    return sl_step(net, "rate-limit an interface with tc tbf",
                   "%s -n %s qdisc replace dev %s root tbf rate %.0fbit burst %.0f latency 100ms",
                   net->tc, ns, dev, rate, burst);
}

bool sl__unshape(sl_net_t *net)
{
    char dev[16];
    for (int k = 0; k < net->n; k++) {
        snprintf(dev, sizeof(dev), "f%d", k);
        if (!sl_step(net, "lift a rate limit", "%s -n %s qdisc del dev nic root", net->tc,
                     net->wns[k]) ||
            !sl_step(net, "lift a rate limit", "%s -n %s qdisc del dev %s root", net->tc, net->head,
                     dev))
            return false;
    }
    return true;
}

/* Worker k: its namespace, `nic` on the fabric and `mgmt` on the control
 * network, both ports in the head. */
static bool sl_add_worker(sl_net_t *net, int k)
{
    const char *ip = net->ip, *h = net->head, *w = net->wns[k];
    return sl_step(net, "create a network namespace (no permission or no namespace support)",
                   "%s netns add %s", ip, w) &&
           sl_step(net, "create a veth pair",
                   "%s link add nic netns %s type veth peer name f%d netns %s && "
                   "%s link add mgmt netns %s type veth peer name m%d netns %s",
                   ip, w, k, h, ip, w, k, h) &&
           sl_step(net, "configure a worker's interfaces",
                   "%s -n %s link set f%d master fab up && %s -n %s link set m%d master mgmt up && "
                   "%s -n %s addr add " SL_FABRIC "%d/24 dev nic && %s -n %s link set nic up && "
                   "%s -n %s addr add " SL_CONTROL "%d/24 dev mgmt && %s -n %s link set mgmt up && "
                   "%s -n %s link set lo up",
                   ip, h, k, ip, h, k, ip, w, k + 1, ip, w, ip, w, k + 1, ip, w, ip, w);
}

/* The fast link inside a host: worker k reaches its host's other workers'
 * fabric addresses over `mgmt`, from its own fabric address. */
static bool sl_host_routes(sl_net_t *net, int k)
{
    int host = k / net->wph;
    for (int j = host * net->wph; j < (host + 1) * net->wph; j++)
        if (j != k && !sl_step(net, "route inside a host",
                               "%s -n %s route add " SL_FABRIC "%d/32 dev mgmt src " SL_FABRIC "%d",
                               net->ip, net->wns[k], j + 1, k + 1))
            return false;
    return true;
}

/* Waits up to 10 s until every worker's `nic` is up (UCX uses running
 * interfaces only). */
static bool sl_wait_up(sl_net_t *net)
{
    char out[256];
    for (int k = 0; k < net->n; k++) {
        double until = stria_time_now() + 10;
        while (sl_sh(out, sizeof(out), "%s -n %s link show dev nic | grep -q 'state UP'", net->ip,
                     net->wns[k]) != 0) {
            if (stria_time_now() > until) {
                snprintf(net->why, sizeof(net->why), "the interface of worker %d does not come up",
                         k);
                return false;
            }
            usleep(20000);
        }
    }
    return true;
}

/* Makes the namespaces, interfaces, routes and rate limits. Returns false
 * with net->why; what was made is deleted by the guard. */
static bool sl_net_create(sl_net_t *net, double rate)
{
    if (!sl_step(net, "create a network namespace (no permission or no namespace support)",
                 "%s netns add %s", net->ip, net->head) ||
        !sl_step(net, "create the head's switches",
                 "%s -n %s link set lo up && %s -n %s link add fab type bridge && "
                 "%s -n %s link set fab up && %s -n %s link add mgmt type bridge && "
                 "%s -n %s addr add " SL_CONTROL "254/24 dev mgmt && %s -n %s link set mgmt up",
                 net->ip, net->head, net->ip, net->head, net->ip, net->head, net->ip, net->head,
                 net->ip, net->head, net->ip, net->head))
        return false;
    for (int k = 0; k < net->n; k++)
        if (!sl_add_worker(net, k) || !sl_host_routes(net, k))
            return false;
    if (rate > 0) {
        char dev[16];
        for (int k = 0; k < net->n; k++) {
            snprintf(dev, sizeof(dev), "f%d", k);
            if (!sl_shape(net, net->wns[k], "nic", rate) || !sl_shape(net, net->head, dev, rate))
                return false;
        }
    }
    return sl_wait_up(net);
}

/* Moves this process (still one thread) into the head's network. */
static int sl_enter(const sl_net_t *net)
{
    char path[128];
    snprintf(path, sizeof(path), "/var/run/netns/%s", net->head);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = setns(fd, CLONE_NEWNET);
    close(fd);
    return rc;
}

/* Bytes received by the head's fabric ports, which is what the workers sent
 * over their rate-limited interfaces (/proc/net/dev of this process's
 * network: the head's). */
uint64_t sl__fabric_bytes(void)
{
    FILE *f = fopen("/proc/net/dev", "r");
    if (f == NULL)
        return 0;
    char line[512];
    uint64_t sum = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        int k, at = 0;
        unsigned long long rx;
        if (sscanf(line, " f%d:%n", &k, &at) == 1 && at > 0 && sscanf(line + at, "%llu", &rx) == 1)
            sum += rx;
    }
    fclose(f);
    return sum;
}

/* ---- the daemons --------------------------------------------------------------------- */

/* Starts `ip netns exec NS argv...` (in a process group of its own, killed
 * with this process), its stderr appended to `log`; waits up to 20 s for a
 * stdout line starting with `prefix` and copies it into line. */
static int sl_spawn(const sl_net_t *net, const char *ns, char *const argv[], const char *log,
                    const char *prefix, char *line, size_t len)
{
    char *full[48];
    int n = 0;
    full[n++] = (char *)net->ip;
    full[n++] = "netns";
    full[n++] = "exec";
    full[n++] = (char *)ns;
    for (int i = 0; argv[i] != NULL && n < 47; i++)
        full[n++] = argv[i];
    full[n] = NULL;
    int fds[2];
    if (sl_n_pids > SL_MAX_WORKERS || pipe2(fds, O_CLOEXEC) != 0)
        return -1;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]), close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(126);
        dup2(fds[1], 1);
        int lf = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (lf >= 0)
            dup2(lf, 2);
        signal(SIGPIPE, SIG_DFL);
        execv(full[0], full);
        _exit(127);
    }
    close(fds[1]);
    int slot = sl_n_pids;
    sl_out[slot] = fds[0];
    sl_pids[slot] = pid;
    sl_n_pids = slot + 1;
    size_t at = 0;
    double until = stria_time_now() + 20;
    while (stria_time_now() < until) {
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        if (poll(&p, 1, 100) <= 0)
            continue;
        char ch;
        if (read(fds[0], &ch, 1) != 1)
            return -1; /* it exited */
        if (ch != '\n') {
            if (at + 1 < len)
                line[at++] = ch;
            continue;
        }
        line[at] = '\0';
        if (strncmp(line, prefix, strlen(prefix)) == 0)
            return 0;
        at = 0;
    }
    return -1;
}

/* Daemons [from, to): SIGTERM to each, SIGKILL to those still there after
 * 5 s. */
static void sl_daemons_stop_range(int from, int to)
{
    for (int i = from; i < to; i++)
        if (sl_pids[i] > 0)
            kill(sl_pids[i], SIGTERM);
    double until = stria_time_now() + 5;
    for (int i = from; i < to; i++) {
        if (sl_pids[i] <= 0)
            continue;
        while (waitpid(sl_pids[i], NULL, WNOHANG) == 0) {
            if (stria_time_now() > until) {
                kill(sl_pids[i], SIGKILL);
                waitpid(sl_pids[i], NULL, 0);
                break;
            }
            usleep(20000);
        }
        sl_pids[i] = 0;
        if (sl_out[i] >= 0)
            close(sl_out[i]);
        sl_out[i] = -1;
    }
}

/* The workers first (they leave the coordinator), then the coordinator. */
static void sl_daemons_stop(void)
{
    sl_daemons_stop_range(1, sl_n_pids);
    sl_daemons_stop_range(0, sl_n_pids > 0 ? 1 : 0);
    sl_n_pids = 0;
}

/* Where the daemons are and what they were given. */
typedef struct {
    char bin_dir[4096];
    char log_dir[512];
    bool log_tmp; /* made here: removed after a run that succeeded */
    char coord[64];
} sl_run_t;

static int sl_start_coordinator(const sl_net_t *net, sl_run_t *r)
{
    char bin[4200], log[600], line[512];
    snprintf(bin, sizeof(bin), "%s/stria-coordinator", r->bin_dir);
    snprintf(log, sizeof(log), "%s/coordinator.log", r->log_dir);
    char *argv[] = {bin, "--listen",   SL_CONTROL "254:0", "--heartbeat-period",
                    "1", "--insecure", "--log-level=warn", NULL};
    static const char prefix[] = "stria-coordinator listening on ";
    if (sl_spawn(net, net->head, argv, log, prefix, line, sizeof(line)) != 0) {
        fprintf(stderr, "stria-bench slowlink: the coordinator did not start (see %s)\n", log);
        return -1;
    }
    snprintf(r->coord, sizeof(r->coord), "%.63s", line + strlen(prefix));
    return 0;
}

static int sl_start_worker(const sl_net_t *net, const sl_cfg_t *c, sl_run_t *r, int k,
                           int64_t memory)
{
    char bin[4200], log[600], line[512], listen[64], ucx[64], host[32], thr[16], mem[32], st[32];
    snprintf(bin, sizeof(bin), "%s/stria-worker", r->bin_dir);
    snprintf(log, sizeof(log), "%s/worker%d.log", r->log_dir, k);
    snprintf(listen, sizeof(listen), "--listen=" SL_CONTROL "%d:0", k + 1);
    snprintf(ucx, sizeof(ucx), "--ucx-listen=" SL_FABRIC "%d:0", k + 1);
    snprintf(host, sizeof(host), "--host=slowlink-host%d", k / net->wph);
    snprintf(thr, sizeof(thr), "--threads=%d", c->tpr);
    snprintf(mem, sizeof(mem), "--memory=%lld", (long long)memory);
    snprintf(st, sizeof(st), "--step-timeout=%g", c->step_timeout_s);
    char *argv[] = {bin,
                    "--coordinator",
                    r->coord,
                    listen,
                    ucx,
                    "--ucx-tls=tcp",
                    "--ucx-net-devices=nic",
                    host,
                    thr,
                    mem,
                    st,
                    "--device=cpu",
                    "--insecure",
                    "--log-level=warn",
                    NULL};
    if (sl_spawn(net, net->wns[k], argv, log, "stria-worker listening", line, sizeof(line)) != 0) {
        fprintf(stderr, "stria-bench slowlink: worker %d did not start (see %s)\n", k, log);
        return -1;
    }
    return 0;
}

/* Waits up to 20 s for n healthy workers. */
static bool sl_wait_healthy(const char *coord, int n)
{
    double until = stria_time_now() + 20;
    while (stria_time_now() < until) {
        stria_bench_coord_status_t s;
        if (stria_bench_coord_status(coord, &s) == STRIA_OK && s.workers_healthy >= (uint32_t)n)
            return true;
        usleep(50000);
    }
    return false;
}

/* ---- the command ------------------------------------------------------------------------ */

/* Why this machine cannot run it (NULL: it can). */
static const char *sl_unavailable(sl_net_t *net)
{
    if (geteuid() != 0)
        return "needs root (network namespaces, veth interfaces and tc)";
    if ((net->ip = sl_find(sl_ip_paths)) == NULL)
        return "the ip command (iproute2) is not installed";
    if ((net->tc = sl_find(sl_tc_paths)) == NULL)
        return "the tc command (iproute2) is not installed";
    return NULL;
}

/* The daemons' folder (this program's) and the log folder. */
static int sl_dirs(const sl_cfg_t *c, sl_run_t *r)
{
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (len <= 0) {
        fprintf(stderr, "stria-bench slowlink: cannot find this program's folder\n");
        return -1;
    }
    self[len] = '\0';
    *strrchr(self, '/') = '\0';
    snprintf(r->bin_dir, sizeof(r->bin_dir), "%s", self);
    char a[4200], b[4200];
    snprintf(a, sizeof(a), "%s/stria-coordinator", r->bin_dir);
    snprintf(b, sizeof(b), "%s/stria-worker", r->bin_dir);
    if (access(a, X_OK) != 0 || access(b, X_OK) != 0) {
        fprintf(stderr, "stria-bench slowlink: %s and %s are needed (build them)\n", a, b);
        return -1;
    }
    if (c->log_dir != NULL) {
        snprintf(r->log_dir, sizeof(r->log_dir), "%s", c->log_dir);
        if (mkdir(r->log_dir, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "stria-bench slowlink: --log-dir %s: %s\n", r->log_dir,
                    strerror(errno));
            return -1;
        }
        return 0;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(r->log_dir, sizeof(r->log_dir), "%s/stria-slowlink-XXXXXX",
             tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
    if (mkdtemp(r->log_dir) == NULL) {
        fprintf(stderr, "stria-bench slowlink: cannot make a log folder: %s\n", strerror(errno));
        return -1;
    }
    r->log_tmp = true;
    return 0;
}

/* What each worker offers: the sessions' admission at these bounds (whole
 * and, with --sharded, sharded), doubled (--memory otherwise). */
static int64_t sl_memory(const sl_cfg_t *c, int n)
{
    if (c->memory > 0)
        return c->memory;
    uint64_t all = 0;
    for (int g = 0; g < c->n_groups; g++) { /* a head group's ring: n / G ranks, heads / G */
        const int G = c->groups[g], R = n / G;
        uint64_t per = 0;
        int64_t shard = (c->seq + 2 * R - 1) / (2 * R) * 2;
        if (stria_session_rank_memory(1, shard, c->heads / G, c->kv_heads / G, c->head_dim,
                                      c->dtype, 0, &per) != STRIA_OK)
            per = (uint64_t)1 << 30;
        all += per;
    }
    /* whole and sharded; inside and across */
    uint64_t sessions =
        (uint64_t)c->n_layouts * (c->sharded ? (c->per_worker ? 3 : 2) : 1) * (c->across ? 2 : 1);
    int64_t m = (int64_t)(2 * all * sessions) + ((int64_t)256 << 20);
    return m;
}

/* The service on the made network: start, measure, stop. */
static int sl_run(const sl_cfg_t *c, sl_net_t *net, sl_run_t *r)
{
    if (sl_start_coordinator(net, r) != 0)
        return 1;
    int64_t memory = sl_memory(c, net->n);
    for (int k = 0; k < net->n; k++)
        if (sl_start_worker(net, c, r, k, memory) != 0)
            return 1;
    if (!sl_wait_healthy(r->coord, net->n)) {
        fprintf(stderr,
                "stria-bench slowlink: the %d workers did not register within 20 s (see %s)\n",
                net->n, r->log_dir);
        return 1;
    }
    return sl__measure(c, net, r->coord);
}

int stria_bench_slowlink(int argc, char **argv)
{
    sl_cfg_t c;
    int rc = sl_parse(argc, argv, &c);
    if (rc >= 0)
        return rc;
    sl_net_t *net = calloc(1, sizeof(*net));
    sl_run_t run;
    memset(&run, 0, sizeof(run));
    if (net == NULL)
        return 1;
    const char *why = sl_unavailable(net);
    if (why != NULL) {
        fprintf(stderr, "stria-bench slowlink: cannot run here: %s\n", why);
        free(net);
        return SL_SKIP;
    }
    if (sl_dirs(&c, &run) != 0) {
        free(net);
        return 1;
    }
    net->hosts = c.hosts;
    net->wph = c.wph;
    net->n = c.hosts * c.wph;
    snprintf(net->prefix, sizeof(net->prefix), "stria-sl%d", (int)getpid());
    snprintf(net->head, sizeof(net->head), "%s-head", net->prefix);
    for (int k = 0; k < net->n; k++)
        snprintf(net->wns[k], sizeof(net->wns[k]), "%s-w%d", net->prefix, k);
    sl_reap_stale(net);
    signal(SIGINT, sl_on_signal);
    signal(SIGTERM, sl_on_signal);
    signal(SIGHUP, sl_on_signal);
    setenv("UCX_HANDLE_ERRORS", "none", 0);
    if (sl_guard_start(net, run.log_tmp ? run.log_dir : NULL) != 0) {
        fprintf(stderr, "stria-bench slowlink: cannot start the clean-up guard\n");
        free(net);
        return 1;
    }
    if (!sl_net_create(net, c.rate_bits)) {
        fprintf(stderr, "stria-bench slowlink: cannot run here: %s\n", net->why);
        rc = SL_SKIP;
    } else if (sl_enter(net) != 0) {
        fprintf(stderr, "stria-bench slowlink: cannot enter namespace %s: %s\n", net->head,
                strerror(errno));
        rc = SL_SKIP;
    } else {
        rc = sl_run(&c, net, &run);
    }
    sl_daemons_stop();
    sl_guard_stop();
    if ((rc == 0 || rc == SL_SKIP) && run.log_tmp) {
        char out[256];
        sl_sh(out, sizeof(out), "rm -rf '%s'", run.log_dir);
    } else if (rc != 0) {
        fprintf(stderr, "stria-bench slowlink: the daemons' logs are in %s\n", run.log_dir);
    }
    free(net);
    return rc;
}
