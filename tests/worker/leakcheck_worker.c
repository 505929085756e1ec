/* Leak check of the worker library: a plain program (not a Criterion
 * suite, whose runner hides LeakSanitizer reports) that runs a job through
 * forward and backward, drops a job between two chunks, and stops workers
 * that hold a job and run a pass, then exits 0. In the sanitizer build,
 * LeakSanitizer turns any leak into a non-zero exit status. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker_fixture.h"
#include "tleak.h"

typedef struct {
    wf_t *f;
    wf_job_t *job;
    stria_status_t st;
} bg_t;

static void *bg_forward(void *arg)
{
    bg_t *bg = arg;
    stria_rpc_client_t *cl = wf_client(bg->f, bg->job->widx[0]);
    bg->st = cl != NULL ? wf_pass_on(cl, bg->job, 0, false) : STRIA_ERR_IO;
    stria_rpc_client_close(cl);
    return NULL;
}

int main(void)
{
    wf_t f;
    wf_job_t job;
    void *out;
    uint64_t len, sl;

    CHECK(wf_start(&f, 2, 0.5) == STRIA_OK, "start");
    CHECK(wf_submit(&f, 64, 0, &job) == STRIA_OK, "submit");
    float *q = wf_tensor(&job, 2, 1), *k = wf_tensor(&job, 1, 2), *v = wf_tensor(&job, 1, 3);
    CHECK(wf_put_all(&f, &job, q, k, v, q) == STRIA_OK, "put");
    CHECK(wf_pass_all(&f, &job, false) == STRIA_OK, "forward");
    CHECK(wf_pass_all(&f, &job, false) == STRIA_OK, "forward again");
    CHECK(wf_pass_all(&f, &job, true) == STRIA_OK, "backward");
    CHECK(wf_get(&f, &job, 1, STRIA__V1__TENSOR__TENSOR_DQ, &out, &len) == STRIA_OK, "get");
    free(out);

    /* dropped between two chunks of Q */
    void *s = wf_shard(&job, 0, q, 2, &sl);
    CHECK(wf_put(&f, &job, 0, STRIA__V1__TENSOR__TENSOR_Q, s, sl, 0, sl / 2) == STRIA_OK, "put");
    CHECK(wf_drop(&f, job.widx[0], &job) == STRIA_OK, "drop");
    CHECK(wf_wait_usage(&f, job.widx[0], 0, 0, 5), "dropped job still held");
    free(s);

    /* a held job on one worker, a pass running on the other: stop both */
    wf_job_t job2;
    CHECK(wf_submit(&f, 64, 200, &job2) == STRIA_OK, "submit");
    CHECK(wf_put_all(&f, &job2, q, k, v, NULL) == STRIA_OK, "put");
    bg_t bg = {&f, &job2, STRIA_OK};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, bg_forward, &bg) == 0, "thread");
    stria_worker_usage_t u;
    for (int i = 0; i < 1000; i++) {
        stria_worker_usage(f.w[job2.widx[0]], &u);
        if (u.running_passes == 1)
            break;
        usleep(2000);
    }
    CHECK(u.running_passes == 1, "the lone rank's pass did not start");
    wf_stop(&f);
    pthread_join(th, NULL);
    CHECK(bg.st != STRIA_OK, "a lone rank's forward succeeded");
    free(q), free(k), free(v);
    printf("leakcheck_worker: ok\n");
    return 0;
}
