/* Internals of the ring engine shared by its rooms: ring.c (creation, the
 * K/V steps, the two directions, entry points) and ring_prims.c (staging
 * through device memory, waits, posts, failures, the agreement, device
 * timing). Never installed. */
#ifndef STRIA_RING_INT_H
#define STRIA_RING_INT_H

#include <stdatomic.h>

#include "stria_docplan.h"
#include "stria_ring.h"

/* Message kinds, the low byte of a tag. */
enum { STRIA__MSG_KV = 1, STRIA__MSG_DKV = 2, STRIA__MSG_DONE = 3 };

struct stria_ring_pass {
    stria_link_t *link;
    stria_ring_shape_t shape;
    stria_layout_t layout;
    stria_pool_t *pool;
    stria_ring_opts_t hooks; /* only the compute_* and step hooks are used */
    double timeout_s;
    uint32_t pass_id;
    uint32_t calls; /* fwd/bwd calls on the current link so far */
    uint32_t call;  /* number of the running call on the link */
    /* the running call's id, the high 40 bits of every tag: the caller's
     * (next_call_id, when set for the call) or pass_id and call */
    uint64_t call_id, next_call_id;
    bool has_next_call_id;
    double t_start; /* start of the running call, for deadlines */
    int rank, n;
    /* Set while stria_ring_fwd()/bwd() runs: stria_ring_pass_set_link()
     * refuses to rebind then (from a hook, or from another thread). */
    atomic_bool running;
    /* Per rank of the ring: the runs of its real tokens, their number, and
     * the lowest and highest real position (for skipping masked blocks). */
    stria_pos_run_t **runs;
    size_t *n_runs;
    int64_t *valid;
    int64_t *pos_min, *pos_max;
    /* What of each rank's K/V block travels, at the steps after the first:
     * all of it (travel = valid, the same runs and bounds) or, under a packed
     * layout, its spread rows: a prefix of the shard, the first travel_runs
     * runs, with their own bounds. Messages then carry travel rows only (see
     * stria__msg_rows). */
    int64_t *travel, *tpos_min, *tpos_max;
    size_t *travel_runs;
    stria_docplan_t *plan; /* packed: the call's document plan, a reference */
    /* K/V steps a forward call runs: N, or fewer when no rank sees a block
     * more than fwd_steps - 1 hops away (a window under contiguous). Every
     * rank computes the same value from the shape. */
    int fwd_steps;
    int steps_run; /* K/V steps of the running or last call */
    stria_ring_step_stats_t *stats;
    void *arena; /* working buffers, kept between calls */
    size_t arena_size;
    stria_allocator_t mem; /* of the arena and the kernels' workspaces; alloc NULL: the system's */
    /* Where tensors live and kernels run. staged: device memory is not host
     * memory, so messages go through pinned host buffers (hmem) and the
     * working buffers are device memory (dmem), both kept between calls. */
    stria_device_t *dev;
    bool own_dev;
    bool staged;
    bool dev_timed; /* compute_s is device wall time (a GPU), not thread CPU */
    void *dmem, *hmem;
    size_t dmem_size, hmem_size;
    /* Sends posted and not yet waited for, for the step times: a wait on
     * one of these requests ends that send (ring_times.c). */
    struct {
        stria_link_req_t *req;
        stria_ring_step_stats_t *ss;
        bool sum; /* the dK/dV sum, else the K/V block */
    } sends[4];
};

static inline char *stria__row(const stria_tensor_t *t, int64_t b, int64_t tok, int64_t h)
{
    return (char *)t->data +
           (size_t)(b * t->stride_batch + tok * t->stride_token + h * t->stride_head) *
               stria_dtype_size(t->dtype);
}

/* Compute of a step: timed as thread CPU and wall time. */
typedef struct {
    double cpu, wall;
} stria__clock_t;

/* The requests a pass may have outstanding at once. */
typedef struct {
    stria_link_req_t *kv_send, *kv_recv, *dkv_recv, *dkv_send[2];
} stria__reqs_t;

/* ---- ring_prims.c and ring.c -------------------------------------------------- */

uint64_t stria__tag(const stria_ring_pass_t *p, int step, int kind);
stria_status_t stria__check_shape(const stria_ring_shape_t *s);
void stria__pack_view(const stria_tensor_t *t, int64_t B, int64_t L, int64_t heads, int64_t D,
                      char *dst);
stria_status_t stria__staged_mem(stria_ring_pass_t *p, size_t dev_bytes, size_t host_bytes,
                                 char **dcur, char **hcur);
stria_status_t stria__download_kv(stria_ring_pass_t *p, const stria_tensor_t *k,
                                  const stria_tensor_t *v, char *dst, char *tmp);
stria_status_t stria__device_zero_rows(stria_ring_pass_t *p, const stria_tensor_t *t, int64_t B,
                                       int64_t from, int64_t L, int64_t heads, int64_t D);
stria_status_t stria__device_drain(stria_ring_pass_t *p);
/* Whether block j, as it is at `step` (whole at step 0, its travelling rows
 * after), holds a key some real query of this rank may see. */
bool stria__visible(const stria_ring_pass_t *p, int j, int step);
/* Whether some real query of rank r may see some real key of rank j. */
bool stria__sees(const stria_ring_pass_t *p, int r, int j);
/* Rows per batch of rank j's K/V message: the shard (shard_tokens) or,
 * packed, its travelling rows. */
int64_t stria__msg_rows(const stria_ring_pass_t *p, int j);
/* K/V steps a forward pass needs (see fwd_steps). */
int stria__fwd_steps(const stria_ring_pass_t *p);
/* Kernel parameters of this rank's queries against block j, whole (step 0)
 * or its travelling rows (travel). */
stria_attn_params_t stria__params(const stria_ring_pass_t *p, int j, bool travel);
void stria__step_begin(stria_ring_pass_t *p, int step);
void stria__compute_begin(stria__clock_t *clk);
void stria__compute_end(const stria_ring_pass_t *p, const stria__clock_t *clk,
                        stria_ring_step_stats_t *ss);
void stria__cancel_all(stria_ring_pass_t *p, stria__reqs_t *r);
stria_status_t stria__wait(stria_ring_pass_t *p, stria_link_req_t **req, int step,
                           stria_ring_step_stats_t *stats);
stria_status_t stria__post(stria_ring_pass_t *p, bool send, int step, int kind, void *buf,
                           size_t len, stria_link_req_t **req, stria_ring_step_stats_t *stats);
stria_status_t stria__fail(stria_ring_pass_t *p, stria__reqs_t *reqs, stria_status_t st,
                           const char *what, int step);
stria_status_t stria__agree(stria_ring_pass_t *p, stria__reqs_t *reqs, int first_step,
                            stria_ring_step_stats_t *ss);
void stria__drain_on_error(stria_ring_pass_t *p, stria_status_t st);
stria_status_t stria__device_step_time(stria_ring_pass_t *p, double t0,
                                       stria_ring_step_stats_t *ss);
void stria__compute_end_dev(stria_ring_pass_t *p, const stria__clock_t *clk,
                            stria_ring_step_stats_t *ss, double *t_dev0);
stria_status_t stria__store_lse(stria_ring_pass_t *p, const float *lse_acc, float *lse,
                                float *host_tmp, int64_t BH, int64_t L, int64_t qv);

/* ---- ring_plan.c: the ranks' positions (pass objects and plans) ----------- */

/* Fills runs, n_runs, valid, pos_min and pos_max and the travel fields
 * (allocated) for the p->n ranks of p->layout. */
stria_status_t stria__pass_positions(stria_ring_pass_t *p);
/* Frees what stria__pass_positions() allocated. */
void stria__pass_positions_free(stria_ring_pass_t *p);

/* ---- ring_times.c: the step times (stria_ring_step_times_t) -------------- */

/* Records, in absolute stria_time_now() seconds until stria__times_finish()
 * makes them relative to the pass's start: a span of the step of ss; a send
 * posted (req) in the step of ss; the end of a wait on req (ends the send
 * posted with req, if any); the start of step `step`. */
void stria__times_span(const stria_ring_pass_t *p, stria_ring_step_stats_t *ss,
                       stria_ring_span_kind_t kind, double t0, double t1);
void stria__times_send(stria_ring_pass_t *p, stria_link_req_t *req, stria_ring_step_stats_t *ss,
                       bool sum, double t);
void stria__times_waited(stria_ring_pass_t *p, const stria_link_req_t *req, double t);
void stria__times_step(stria_ring_pass_t *p, int step, double t);
/* At the end of a call (failed or not): times relative to its start, the
 * last step ending now. */
void stria__times_finish(stria_ring_pass_t *p);

#endif /* STRIA_RING_INT_H */
