/* Leak check of the worker library: a plain program (not a Criterion
 * suite, whose runner hides LeakSanitizer reports) that runs a job's calls
 * (a forward, a held forward, the held one's backward, the default
 * backward, inputs in pieces), refuses a few calls, drops a session between
 * two pieces of a call's inputs, lets a held forward go, and stops workers
 * that hold a job and run a call, then exits 0. In the sanitizer build,
 * LeakSanitizer turns any leak into a non-zero exit status. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tleak.h"
#include "worker_fixture.h"

int main(void)
{
    wf_t f;
    wf_job_t job, sess, lone;
    wf_io_t io[WF_MAX] = {0}, held[WF_MAX] = {0};

    CHECK(wf_start(&f, 2, 0.5) == STRIA_OK, "start");
    CHECK(wf_submit(&f, 64, 0, &job) == STRIA_OK, "submit");
    float *q = wf_tensor(&job, 2, 1), *k = wf_tensor(&job, 1, 2), *v = wf_tensor(&job, 1, 3);
    wf_io_inputs(&job, io, q, k, v, q);
    wf_io_inputs(&job, held, q, k, v, q);
    CHECK(wf_open_all(&f, &job) == STRIA_OK, "open");
    const wf_call_opts_t fwd = {0}, hold = {.hold = true, .piece = 1000};
    const wf_call_opts_t bwd = {.backward = true};
    const wf_call_opts_t held_bwd = {.backward = true, .use_held = true, .held_call = 1};
    CHECK(wf_call_all(&f, &job, 0, &fwd, io) == STRIA_OK, "forward");
    CHECK(wf_call_all(&f, &job, 1, &hold, held) == STRIA_OK, "held forward in pieces");
    CHECK(wf_call_all(&f, &job, 2, &held_bwd, held) == STRIA_OK, "held backward");
    CHECK(wf_call_all(&f, &job, 3, &bwd, io) == STRIA_OK, "backward");
    /* refused: a ghost, a short payload, a backward of nothing held */
    wf_job_t ghost = job;
    ghost.id++;
    CHECK(wf_call_rank(&f, &ghost, 0, 4, &fwd, &io[0]) == STRIA_ERR_NOT_FOUND, "a ghost's call");
    CHECK(wf_request(f.wc[job.widx[0]], &job, 0, 4, &fwd, 0, false, io[0].t[WF_Q], 8, NULL) ==
              STRIA_ERR_INVALID_ARG,
          "a short payload");
    CHECK(wf_call_rank(&f, &job, 0, 5, &held_bwd, &held[0]) == STRIA_ERR_INVALID_ARG,
          "the backward of a forward used already");

    /* a session dropped between two pieces of a call's inputs; a held
     * forward let go */
    const wf_spec_t sp = {.seq_len = 64, .session = true, .max_held = 1};
    CHECK(wf_submit_spec(&f, &sp, &sess) == STRIA_OK, "submit");
    CHECK(wf_open_all(&f, &sess) == STRIA_OK, "open");
    const wf_call_opts_t shold = {.hold = true};
    CHECK(wf_call_all(&f, &sess, 0, &shold, io) == STRIA_OK, "held forward");
    for (int r = 0; r < sess.n; r++)
        CHECK(wf_release_held(&f, &sess, r, 0) == STRIA_OK, "release held");
    uint64_t len = 0;
    char *payload = wf_payload(&fwd, &io[0], &len);
    CHECK(wf_request(f.wc[sess.widx[0]], &sess, 0, 1, &fwd, 0, true, payload, len / 2, NULL) ==
              STRIA_OK,
          "a piece");
    CHECK(wf_drop(&f, sess.widx[0], &sess) == STRIA_OK, "drop");
    CHECK(wf_request(f.wc[sess.widx[0]], &sess, 0, 1, &fwd, len / 2, false, payload + len / 2,
                     len - len / 2, NULL) == STRIA_ERR_NOT_FOUND,
          "the piece after the drop");
    free(payload);

    /* a held job on both workers, a call running alone on one: stop both */
    CHECK(wf_submit(&f, 64, 200, &lone) == STRIA_OK, "submit");
    CHECK(wf_open_all(&f, &lone) == STRIA_OK, "open");
    wf_bg_t bg;
    CHECK(wf_bg_start(&bg, &f, &lone, 0, false, 0, &fwd, &held[0]) == 0, "thread");
    CHECK(wf_wait_running(&f, lone.widx[0], 1, 2.0), "the lone rank's call did not start");
    wf_stop(&f);
    CHECK(wf_bg_join(&bg) != STRIA_OK, "a lone rank's call succeeded");
    wf_io_free(io, WF_MAX);
    wf_io_free(held, WF_MAX);
    free(q), free(k), free(v);
    printf("leakcheck_worker: ok\n");
    return 0;
}
