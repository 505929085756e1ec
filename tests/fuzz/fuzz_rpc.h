/* What the rpc_stream fuzz target (fuzz_rpc_stream.c) and its seeds
 * (gen_seeds.c) share: the servers' credentials and the stub worker's job
 * secret. Test values, public. */
#ifndef STRIA_FUZZ_RPC_H
#define STRIA_FUZZ_RPC_H

/* The first input byte, modulo FUZZ_N_SERVERS, picks the server. */
#define FUZZ_SERVER_COORD       0 /* coordinator, no credentials */
#define FUZZ_SERVER_WORKER      1 /* stub worker: client and admin credentials */
#define FUZZ_SERVER_COORD_ROLES 2 /* coordinator: client, worker, admin credentials */
#define FUZZ_N_SERVERS          3

#define FUZZ_TOKEN        "fuzz-client-token"
#define FUZZ_WORKER_TOKEN "fuzz-worker-token"
#define FUZZ_ADMIN_TOKEN  "fuzz-admin-token"

/* The stub worker checks the job proof of jobs with an id from this on (the
 * lower ones it takes unproven, so that mutated ids and request ids still
 * reach the transport's payload paths); their secret is
 * FUZZ_JOB_SECRET_BYTE repeated. */
#define FUZZ_PROVEN_JOBS     1000
#define FUZZ_JOB_SECRET_BYTE 0x5a

#endif
