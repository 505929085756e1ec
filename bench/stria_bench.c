/* stria-bench: benchmarks that print ratios measured side by side in one run. */
#include <stdio.h>
#include <string.h>

#include "bench.h"

typedef struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} stria__bench_cmd_t;

static const stria__bench_cmd_t stria__cmds[] = {
#ifdef STRIA_BENCH_KERNELS
    {"kernels", stria_bench_kernels, "attention kernel throughput vs this machine's FMA peak"},
#endif
#ifdef STRIA_BENCH_RING
    {"ring", stria_bench_ring, "ring balance: striped and zigzag vs contiguous layouts"},
#endif
#ifdef STRIA_BENCH_TRANSPORT
    {"transport", stria_bench_transport, "ring-link bandwidth vs ucx_perftest"},
#endif
#ifdef STRIA_BENCH_SIMULATE
    {"simulate", stria_bench_simulate, "predicted pass times of rings up to 65536 ranks"},
#endif
#ifdef STRIA_BENCH_SERVICE
    {"service", stria_bench_service, "the same job through the daemons vs the in-process ring"},
#endif
#ifdef STRIA_BENCH_DATAPATH
    {"datapath", stria_bench_datapath, "tensors to the workers and back vs raw TCP and memcpy"},
#endif
#ifdef STRIA_BENCH_AUTH
    {"auth", stria_bench_auth, "what the security costs: ring key, credentials, job secrets"},
#endif
#ifdef STRIA_BENCH_SOAK
    {"soak", stria_bench_soak, "jobs for minutes or hours, workers killed: failures, memory"},
#endif
#ifdef STRIA_BENCH_CALLS
    {"calls", stria_bench_calls, "one call's cost: job path, session, in-process ring"},
#endif
#ifdef STRIA_BENCH_DOCPLAN
    {"docplan", stria_bench_docplan, "packed documents placed by their work, counted"},
#endif
#ifdef STRIA_BENCH_SLOWLINK
    {"slowlink", stria_bench_slowlink, "the service across hosts joined by rate-limited links"},
#endif
    {NULL, NULL, NULL},
};

static void stria__usage(FILE *out)
{
    fprintf(out, "usage: stria-bench COMMAND [OPTIONS]   (stria-bench COMMAND --help)\n\n"
                 "commands:\n");
    for (size_t i = 0; stria__cmds[i].name != NULL; i++)
        fprintf(out, "  %-10s %s\n", stria__cmds[i].name, stria__cmds[i].help);
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        stria__usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; stria__cmds[i].name != NULL; i++)
        if (strcmp(argv[1], stria__cmds[i].name) == 0)
            return stria__cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "stria-bench: unknown command '%s'\n", argv[1]);
    stria__usage(stderr);
    return 2;
}
