/* Test-only helpers of the sharded suites (test_sharded,
 * test_sharded_spares): a cluster of a coordinator and four workers (hosts
 * hA, hA, hB, hB; instances 0, 1, 0, 1; a fifth, a spare, on hB; each with
 * a runtime directory, so a Unix socket), cases (a job's inputs and the
 * in-process ring's outputs), and trainer ranks as processes of their own
 * (shard_rank). */
#ifndef STRIA_TEST_SHARDED_UTIL_H
#define STRIA_TEST_SHARDED_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proc.h"
#include "stria.pb-c.h"
#include "stria_client.h"
#include "stria_rpc.h"
#include "tcluster.h"
#include "tjob.h"

#define N_WORKERS   4 /* the ranks of the jobs; a cluster may have a spare */
#define MAX_WORKERS 5
#define HELPER_S    180 /* a helper's deadline (the sanitizer build is slow) */

/* The suite's cluster (one at a time). */
extern tcluster_t cl;
/* The daemons' and the ranks' environment. */
extern char *const sh_env[];

/* Worker i of the cluster (0 and 1 on host hA, the others on hB); with
 * `shm`, it offers its clients shared memory. */
void sh_start_worker(int i, bool shm);
/* n workers: 2 on host hA, then hB's (a fifth is a spare on hB); waits
 * until every one is healthy. */
void sh_start_cluster_n(int n);
void sh_start_cluster(void); /* N_WORKERS workers */
/* Waits until the coordinator counts every worker alive healthy. */
void sh_wait_healthy(void);
void sh_stop_cluster(void);

stria_rpc_client_t *sh_coord_rpc(void);
/* One call to the coordinator on a connection of its own. */
stria_status_t sh_coord_call(uint32_t method, const ProtobufCMessage *req, stria_rpc_reply_t *rep);
/* Waits until every worker is healthy and reports no memory in use. */
bool sh_workers_idle(double timeout_s);
/* Memory a worker reports in use (after two heartbeats, so it is current). */
uint64_t sh_worker_in_use(uint64_t worker_id);
/* A client of the cluster over `path`. */
stria_client_t *sh_client(stria_data_path_t path);

/* A case: its spec and inputs (head_dim 32, a ring of N_WORKERS), the
 * ranks' outputs gathered (j's outputs, got[] as an array) and the
 * in-process ring's (ref[]). */
typedef struct {
    tjob_t j;
    uint64_t seed;
    void *got[TJ_N_OUT]; /* gathered from the ranks: j's outputs */
    void *ref[TJ_N_OUT]; /* the in-process ring's */
    size_t bytes[TJ_N_OUT];
} case_t;

void sh_case_init(case_t *c, int64_t B, int64_t S, int64_t H, int64_t Hkv, stria_dtype_t dt,
                  bool causal, stria_layout_kind_t layout, uint64_t seed);
void sh_case_free(case_t *c);
/* The gathered outputs against the fp64 reference (tests/support/tcheck.h). */
void sh_case_check_reference(const case_t *c);
/* Reads the ranks' output files into full tensors (each rank's tokens at
 * their positions). */
void sh_case_gather(case_t *c, stria_job_t *job);

/* Starts rank r's process of the job (`path`: shm, tcp or auto; `mode` as
 * shard_rank takes it). */
test_proc_t *sh_start_rank(const case_t *c, stria_job_t *job, int r, const char *path,
                           const char *mode);
/* The rank's last line ("shard_rank: ok ..." or "...: error ..."); waits
 * for its exit. */
void sh_rank_result(test_proc_t *p, char *line, size_t len);

#endif
