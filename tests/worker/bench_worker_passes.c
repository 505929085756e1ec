/* Times repeated forwards of one held job through worker processes:
 *   bench_worker_passes BINDIR [N_PASSES] [SEQ] [DEVICE]
 * starts BINDIR/stria-coordinator and two BINDIR/stria-worker on loopback,
 * submits one job (batch 1, SEQ tokens, 8 heads, 2 kv heads, head_dim 64,
 * fp32, causal), puts its inputs and times N_PASSES RunForward calls of
 * both ranks; prints each pass's wall time (client side) and the mean of
 * the passes after the first. Not a test: a measurement tool. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "worker_fixture.h"

static pid_t spawn(char *const argv[], char *line, size_t cap)
{
    int fds[2];
    if (pipe(fds) != 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        execv(argv[0], argv);
        _exit(127);
    }
    close(fds[1]);
    FILE *f = fdopen(fds[0], "r");
    line[0] = '\0';
    while (fgets(line, (int)cap, f) != NULL)
        if (strstr(line, "listening") != NULL)
            break;
    return pid;
}

static void *fwd_thread(void *arg)
{
    void **a = arg;
    *(stria_status_t *)a[3] = wf_pass_on(a[0], a[1], (int)(intptr_t)a[2], false);
    return NULL;
}

int main(int argc, char **argv)
{
    char bin[512], line[512], coord[64], port_arg[64], rpc[2][128];
    int n = argc > 2 ? atoi(argv[2]) : 10;
    char *dev = argc > 4 ? argv[4] : "cpu";
    int64_t seq = argc > 3 ? atoll(argv[3]) : 8192;
    if (argc < 2)
        return 2;
    snprintf(bin, sizeof(bin), "%s/stria-coordinator", argv[1]);
    char *cargv[] = {bin, "--listen", "127.0.0.1:0", "--heartbeat-period", "0.2", NULL};
    pid_t pids[3];
    pids[0] = spawn(cargv, line, sizeof(line));
    char *p = strstr(line, "127.0.0.1:");
    if (p == NULL) {
        fprintf(stderr, "coordinator: %s\n", line);
        return 1;
    }
    sscanf(p, "%63s", coord);
    snprintf(port_arg, sizeof(port_arg), "%s", coord);
    char wbin[512];
    snprintf(wbin, sizeof(wbin), "%s/stria-worker", argv[1]);
    for (int i = 0; i < 2; i++) {
        char host[16];
        snprintf(host, sizeof(host), "h%d", i);
        char *wargv[] = {wbin,         "--coordinator",
                         port_arg,     "--device",
                         dev,          "--host",
                         host,         "--threads",
                         "4",          "--memory",
                         "4000000000", "--log-level",
                         "error",      NULL};
        pids[1 + i] = spawn(wargv, line, sizeof(line));
        p = strstr(line, "rpc=");
        if (p == NULL) {
            fprintf(stderr, "worker: %s\n", line);
            return 1;
        }
        sscanf(p + 4, "%127s", rpc[i]);
    }
    sleep(1); /* registration */
    wf_t f;
    memset(&f, 0, sizeof(f));
    f.n = 2;
    stria_rpc_client_params_t cp = {.address = coord,
                                    .service = &stria__v1__coordinator__descriptor,
                                    .client_name = "bench",
                                    .connect_timeout_s = 5};
    if (stria_rpc_client_connect(&cp, &f.cc) != STRIA_OK)
        return 1;
    for (int i = 0; i < 2; i++) {
        cp.address = rpc[i];
        cp.service = &stria__v1__worker__descriptor;
        if (stria_rpc_client_connect(&cp, &f.wc[i]) != STRIA_OK)
            return 1;
    }
    /* the fixture's submit maps ranks to f.w[], which this program has
     * not: submit, then map by address */
    Stria__V1__JobSpec s = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    s.batch = 1, s.seq_len = (uint64_t)seq, s.heads = 8, s.kv_heads = 2, s.head_dim = 64;
    s.causal = true, s.ring_size = 2;
    req.spec = &s;
    if (wf_call(f.cc, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, NULL, 0, &rep) != STRIA_OK) {
        fprintf(stderr, "submit: %s\n", stria_error_msg());
        return 1;
    }
    const Stria__V1__Assignment *a = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    wf_job_t job;
    memset(&job, 0, sizeof(job));
    job.id = a->job_id;
    if (wf_open_secret(&rep, &job) != STRIA_OK) {
        fprintf(stderr, "submit: %s\n", stria_error_msg());
        return 1;
    }
    job.n = 2;
    job.shape = (stria_ring_shape_t){.call = {.batch = 1, .seq_len = seq, .causal = true},
                                     .heads = 8,
                                     .kv_heads = 2,
                                     .head_dim = 64};
    for (int r = 0; r < 2; r++)
        job.widx[r] = strcmp(a->ranks[r]->rpc_address, rpc[0]) == 0 ? 0 : 1;
    stria_rpc_reply_free(&rep);
    stria_layout_init(STRIA_LAYOUT_STRIPED, 2, seq, &job.layout);
    for (int r = 0; r < 2; r++)
        job.valid[r] = stria_layout_shard_valid(&job.layout, r);
    float *q = wf_tensor(&job, 8, 1), *k = wf_tensor(&job, 2, 2), *v = wf_tensor(&job, 2, 3);
    if (wf_put_all(&f, &job, q, k, v, NULL) != STRIA_OK) {
        fprintf(stderr, "put: %s\n", stria_error_msg());
        return 1;
    }
    double sum = 0;
    for (int i = 0; i < n; i++) {
        pthread_t th[2];
        stria_status_t st[2];
        void *args[2][4];
        double t0 = stria_time_now();
        for (int r = 0; r < 2; r++) {
            args[r][0] = f.wc[job.widx[r]], args[r][1] = &job, args[r][2] = (void *)(intptr_t)r;
            args[r][3] = &st[r];
            pthread_create(&th[r], NULL, fwd_thread, args[r]);
        }
        for (int r = 0; r < 2; r++)
            pthread_join(th[r], NULL);
        double dt = stria_time_now() - t0;
        if (st[0] != STRIA_OK || st[1] != STRIA_OK) {
            fprintf(stderr, "forward %d failed\n", i);
            return 1;
        }
        printf("pass %d: %.2f ms\n", i, dt * 1e3);
        if (i > 0)
            sum += dt;
    }
    printf("mean of passes 1..%d: %.2f ms\n", n - 1, sum / (n - 1) * 1e3);
    for (int i = 0; i < 3; i++) {
        kill(pids[i], SIGTERM);
        waitpid(pids[i], NULL, 0);
    }
    return 0;
}
