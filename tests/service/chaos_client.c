/* A client process of the chaos test (a helper, not a test): runs small
 * jobs of mixed sizes, layouts and dtypes through the service, each with
 * libstria's default retries, at least N of them and for at least SECONDS,
 * every other one as a call on a session (kept per shape, reopened by
 * libstria when a worker is lost; a ring of 4 with an even number of kv
 * heads as 2 head groups x rings of 2), and writes one line per job to OUT:
 *
 *   job I ok id=ID ring=N layout=L retries=R backward=0|1 [session]
 *   job I error status=S retryable=0|1 retries=R: MESSAGE
 *   job I MISMATCH ring=N layout=L: WHAT
 *
 * An ok job's outputs are checked bit for bit against the in-process ring of
 * the size and layout that finally ran it (a head-grouped session's, group
 * by group against each group's ring). Exit status 0 when every job was
 * ok or failed with a message after its retries (or for a cause that is not
 * retryable, or refused busy on a retry: libstria stops retrying when the
 * workers it excluded leave too few for the ring, "too few workers left for
 * now"), 1 otherwise, 2 on a usage error.
 *
 * usage: chaos_client COORDINATOR SEED N SECONDS OUT */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fault_util.h"
#include "stria_common.h"

static uint64_t next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static int pick(uint64_t *s, int n)
{
    return (int)(next(s) % (uint64_t)n);
}

/* The client's sessions, one per shape of the calls that take one. */
#define MAX_SESSIONS 12 /* 4 clients of one host: under the coordinator's 64 */
static struct {
    stria_session_spec_t spec;
    stria_session_t *s;
} sessions[MAX_SESSIONS];
static int n_sessions;

/* The session of the job's shape (NULL: none: *st is the open's failure,
 * or STRIA_OK when the client keeps as many as it may). */
static stria_session_t *session_for(stria_client_t *cl, const stria_job_spec_t *js,
                                    stria_status_t *st)
{
    *st = STRIA_OK;
    for (int i = 0; i < n_sessions; i++) {
        const stria_session_spec_t *sp = &sessions[i].spec;
        if (sp->heads == js->heads && sp->kv_heads == js->kv_heads &&
            sp->head_dim == js->head_dim && sp->dtype == js->dtype && sp->layout == js->layout &&
            sp->ring_size == js->ring_size)
            return sessions[i].s;
    }
    if (n_sessions == MAX_SESSIONS)
        return NULL;
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    sp.max_batch = 2, sp.max_seq_len = 256;
    sp.heads = js->heads, sp.kv_heads = js->kv_heads, sp.head_dim = js->head_dim;
    sp.dtype = js->dtype, sp.layout = js->layout, sp.ring_size = js->ring_size;
    sp.head_groups = js->ring_size == 4 && js->kv_heads % 2 == 0 ? 2 : 0;
    sp.step_timeout_s = js->step_timeout_s;
    sp.label = "chaos";
    stria_session_t *s = NULL;
    if ((*st = stria_session_open(cl, &sp, &s)) != STRIA_OK)
        return NULL;
    sp.label = NULL;
    sessions[n_sessions].spec = sp;
    sessions[n_sessions++].s = s;
    return s;
}

/* The job as a session call; returns the status (the error recorded).
 * *moved: the backward ran on the session opened anew (a worker lost after
 * the forward), on another ring than the forward: *ring is the forward's,
 * and only the forward's outputs can be held to a ring's bits. */
static stria_status_t session_job(stria_client_t *cl, fu_job_t *j, bool backward, int *ring,
                                  stria_layout_kind_t *layout, uint64_t *id, uint32_t *retries,
                                  bool *moved, int *groups)
{
    stria_status_t st;
    stria_session_t *s = session_for(cl, &j->spec, &st);
    if (s == NULL) {
        *retries = 2; /* an open that failed after its retries, or none */
        return st;
    }
    stria_call_t call = STRIA_CALL_INIT;
    call.batch = j->spec.batch, call.seq_len = j->spec.seq_len, call.causal = j->spec.causal;
    stria_session_stats_t a = STRIA_SESSION_STATS_INIT, b = STRIA_SESSION_STATS_INIT;
    stria_session_stats(s, &a);
    st = stria_session_forward(s, &call, j->q, j->k, j->v, j->o, j->lse);
    stria_session_stats_t f = STRIA_SESSION_STATS_INIT;
    stria_session_stats(s, &f);
    int ring_fwd = stria_session_ring_size(s);
    if (st == STRIA_OK && backward)
        st = stria_session_backward(s, &call, j->q, j->k, j->v, j->o, j->lse, j->g, j->dq, j->dk,
                                    j->dv);
    stria_session_stats(s, &b);
    *retries = (uint32_t)(b.retries - a.retries);
    *moved = b.generation != f.generation;
    *ring = *moved ? ring_fwd : stria_session_ring_size(s);
    *layout = stria_session_layout(s);
    *id = stria_session_id(s);
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    *groups =
        stria_session_spec_get(s, &sp) == STRIA_OK && sp.head_groups > 1 ? (int)sp.head_groups : 1;
    return st;
}

/* One job; returns false when it broke the rules (see the header). */
static bool one_job(stria_client_t *cl, int i, uint64_t seed, FILE *out)
{
    static const int64_t seqs[] = {48, 64, 100, 160, 256};
    static const stria_dtype_t dtypes[] = {STRIA_DTYPE_F32, STRIA_DTYPE_BF16, STRIA_DTYPE_F16};
    static const stria_layout_kind_t layouts[] = {STRIA_LAYOUT_STRIPED, STRIA_LAYOUT_CONTIGUOUS,
                                                  STRIA_LAYOUT_ZIGZAG, STRIA_LAYOUT_AUTO};
    static const int rings[] = {0, 2, 3, 4};
    uint64_t s = seed * 1000003u + (uint64_t)i * 7919u + 1;
    for (int k = 0; k < 4; k++)
        next(&s);
    int64_t heads = pick(&s, 2) ? 4 : 2;
    fu_job_t j;
    if (!fu_job_init(&j, 1 + pick(&s, 2), seqs[pick(&s, 5)], heads, pick(&s, 2) ? heads : 1,
                     pick(&s, 2) ? 32 : 16, dtypes[pick(&s, 3)], pick(&s, 2), s)) {
        fprintf(out,
                "job %d error status=STRIA_ERR_NO_MEMORY retryable=0 retries=0: "
                "out of memory in the client\n",
                i);
        return true;
    }
    j.spec.layout = layouts[pick(&s, 4)];
    j.spec.ring_size = rings[pick(&s, 4)];
    j.spec.step_timeout_s = 2.0;
    j.spec.label = "chaos";
    bool backward = pick(&s, 2), ok = true;
    stria_status_t sst = STRIA_OK;
    if (i % 2 == 1 && j.spec.layout == STRIA_LAYOUT_AUTO)
        j.spec.layout = STRIA_LAYOUT_STRIPED; /* a session's auto */
    if (i % 2 == 1 && (session_for(cl, &j.spec, &sst) != NULL || sst != STRIA_OK)) {
        /* a session's call (a job when the client keeps as many as it may) */
        int ring = 0;
        stria_layout_kind_t layout = STRIA_LAYOUT_STRIPED;
        uint64_t id = 0;
        uint32_t retries = 0;
        bool moved = false;
        int groups = 1;
        stria_status_t st =
            session_job(cl, &j, backward, &ring, &layout, &id, &retries, &moved, &groups);
        char why[256];
        if (st != STRIA_OK) {
            bool retryable = stria_error_retryable();
            /* after its retries, or refused busy (too few workers left) */
            ok = stria_error_msg()[0] != '\0' &&
                 (!retryable || retries == 2 || st == STRIA_ERR_BUSY);
            fprintf(out, "job %d error status=%s retryable=%d retries=%u (session): %s\n", i,
                    stria_status_name(st), retryable, retries, stria_error_msg());
        } else if ((ok = groups > 1 ? fu_groups_equal(&j, groups, ring / groups, layout,
                                                      backward && !moved, why, sizeof(why))
                                    : fu_ring_equal(&j, ring, layout, backward && !moved, why,
                                                    sizeof(why)))) {
            fprintf(out,
                    "job %d ok id=%" PRIu64 " ring=%d layout=%s retries=%u backward=%d session%s\n",
                    i, id, ring, stria_layout_kind_name(layout), retries, backward,
                    groups > 1 ? " head-groups=2" : "");
        } else {
            fprintf(out, "job %d MISMATCH ring=%d layout=%s (session): %s\n", i, ring,
                    stria_layout_kind_name(layout), why);
        }
        fu_job_free(&j);
        return ok;
    }
    stria_call_stats_t fs = STRIA_CALL_STATS_INIT;
    stria_job_t *job = NULL;
    stria_status_t st =
        stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, &fs, &job);
    if (st == STRIA_OK && backward)
        st = stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, NULL);
    if (st != STRIA_OK) {
        bool retryable = stria_error_retryable();
        /* a forward gives up retryable only after every retry, or on a
         * retry refused busy (too few workers left once the blamed ones are
         * excluded: retrying at once would be refused again) */
        ok = stria_error_msg()[0] != '\0' && (!retryable || job != NULL || fs.retries == 2 ||
                                              (st == STRIA_ERR_BUSY && fs.retries >= 1));
        fprintf(out, "job %d error status=%s retryable=%d retries=%u%s: %s\n", i,
                stria_status_name(st), retryable, fs.retries, job != NULL ? " (backward)" : "",
                stria_error_msg());
        stria_client_release(job);
        fu_job_free(&j);
        return ok;
    }
    int ring = stria_job_ring_size(job);
    stria_layout_kind_t layout = stria_job_layout(job);
    uint64_t id = stria_job_id(job);
    stria_client_release(job);
    char why[256];
    ok = fu_ring_equal(&j, ring, layout, backward, why, sizeof(why));
    if (ok)
        fprintf(out, "job %d ok id=%" PRIu64 " ring=%d layout=%s retries=%u backward=%d\n", i, id,
                ring, stria_layout_kind_name(layout), fs.retries, backward);
    else
        fprintf(out, "job %d MISMATCH ring=%d layout=%s: %s\n", i, ring,
                stria_layout_kind_name(layout), why);
    fu_job_free(&j);
    return ok;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: chaos_client COORDINATOR SEED N SECONDS OUT\n");
        return 2;
    }
    uint64_t seed = strtoull(argv[2], NULL, 10);
    int n = atoi(argv[3]);
    double seconds = atof(argv[4]);
    FILE *out = fopen(argv[5], "w");
    if (out == NULL || n < 1) {
        fprintf(stderr, "chaos_client: cannot write %s or bad N\n", argv[5]);
        return 2;
    }
    setvbuf(out, NULL, _IOLBF, 0);
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    p.coordinator = argv[1];
    p.client_name = "chaos_client";
    p.rpc_timeout_s = 30;
    stria_client_t *cl = NULL;
    if (stria_client_connect(&p, &cl) != STRIA_OK) {
        fprintf(stderr, "chaos_client: %s\n", stria_error_msg());
        return 1;
    }
    bool all = true;
    double end = stria_time_now() + seconds;
    for (int i = 0; i < n || stria_time_now() < end; i++)
        all = one_job(cl, i, seed, out) && all;
    for (int i = 0; i < n_sessions; i++)
        stria_session_close(sessions[i].s);
    stria_client_close(cl);
    fclose(out);
    return all ? 0 : 1;
}
