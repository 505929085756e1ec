/*
 * stria auth: the cryptography of the service, in one place, on OpenSSL's
 * libcrypto (no hand-written primitive): random bytes from the system's
 * generator, HMAC-SHA256, constant-time comparison, HKDF and AES-256-GCM.
 *
 * What is built on them:
 *   - credentials (tokens): proven in the RPC hello by challenge and response
 *     (stria_auth_hello_mac(), transport/rpc_*.c), never sent;
 *   - sessions: the nonces both ends of one RPC connection chose in its
 *     hello, and a key derived from them and the credential proven there;
 *   - job secrets (stria_job_secret_t): the per-job capability. The
 *     coordinator makes one per job and hands it, sealed under the session
 *     key, to the client that submitted the job and to the job's workers.
 *     Every job-scoped call proves it with an HMAC bound to the connection's
 *     session, the request id, the method and the job id
 *     (stria_job_secret_prove());
 *   - ring keys: a second per-job key the coordinator gives only the job's
 *     workers; the ring link handshake proves it (transport/ucx_*.c).
 * A sharded job's export secret is meant to be a stria_job_secret_t too.
 */
#ifndef STRIA_AUTH_H
#define STRIA_AUTH_H

#include "stria_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define STRIA_AUTH_KEY_BYTES   32 /* job secrets, ring keys, session keys */
#define STRIA_AUTH_NONCE_BYTES 32
#define STRIA_AUTH_MAC_BYTES   32 /* HMAC-SHA256 */
/* A sealed key: a 12-byte nonce, the 32 encrypted bytes, a 16-byte tag. */
#define STRIA_AUTH_SEALED_BYTES (12 + STRIA_AUTH_KEY_BYTES + 16)
/* A generated credential: 64 hexadecimal characters (256 random bits). */
#define STRIA_AUTH_TOKEN_CHARS 64

/* Fills buf with n bytes from the system's cryptographic generator.
 * Errors: STRIA_ERR_INTERNAL (the generator failed). */
stria_status_t stria_auth_random(void *buf, size_t n);

/* One piece of the message an HMAC covers. */
typedef struct {
    const void *data;
    size_t len;
} stria_auth_part_t;

/* HMAC-SHA256 under key (any length) of the concatenation of the parts.
 * Callers make the concatenation unambiguous: fixed-size fields, or a
 * length before a variable one. */
void stria_auth_hmac(const void *key, size_t key_len, const stria_auth_part_t *parts, size_t n,
                     uint8_t out[STRIA_AUTH_MAC_BYTES]);

/* Whether a and b (n bytes each) are equal, in time that does not depend on
 * where they differ. */
bool stria_auth_equal(const void *a, const void *b, size_t n);

/* Overwrites n bytes at p with zeros in a way the compiler keeps (secrets
 * on the stack). */
void stria_auth_wipe(void *p, size_t n);

/* Wipes a credential string (stria_auth_wipe over its length) and frees it;
 * NULL is fine. */
void stria_auth_free_secret(char *s);

/* A fresh credential: STRIA_AUTH_TOKEN_CHARS hexadecimal characters and a
 * NUL. */
stria_status_t stria_auth_token_generate(char out[STRIA_AUTH_TOKEN_CHARS + 1]);

/* ---- sessions ------------------------------------------------------------ */

/* What both ends of one connection agreed in its hello. */
typedef struct {
    uint8_t client_nonce[STRIA_AUTH_NONCE_BYTES];
    uint8_t server_nonce[STRIA_AUTH_NONCE_BYTES];
    /* Derived from the nonces and the credential the client proved (an
     * empty one when the server checks none: then it hides nothing). */
    uint8_t key[STRIA_AUTH_KEY_BYTES];
} stria_auth_session_t;

/* The hello's proof that one side knows `token` (NULL: ""): HMAC(token,
 * label, service, both nonces), the label telling the client's proof
 * (server_side false) from the server's answer. */
void stria_auth_hello_mac(const char *token, const char *service, const uint8_t *client_nonce,
                          const uint8_t *server_nonce, bool server_side,
                          uint8_t out[STRIA_AUTH_MAC_BYTES]);

/* Fills session->key from the nonces (set before) and the token. */
void stria_auth_session_derive(stria_auth_session_t *session, const char *token);

/* Seals a key for one reader of a session: AES-256-GCM under the session
 * key with a random nonce, the purpose and the job id bound as associated
 * data. Errors: STRIA_ERR_INTERNAL. */
stria_status_t stria_auth_seal(const stria_auth_session_t *session, const char *purpose,
                               uint64_t job_id, const uint8_t key[STRIA_AUTH_KEY_BYTES],
                               uint8_t out[STRIA_AUTH_SEALED_BYTES]);
/* Opens what stria_auth_seal() made for this session, purpose and job.
 * Errors: STRIA_ERR_AUTH (wrong length, or not sealed for this). */
stria_status_t stria_auth_open(const stria_auth_session_t *session, const char *purpose,
                               uint64_t job_id, const uint8_t *sealed, size_t sealed_len,
                               uint8_t key_out[STRIA_AUTH_KEY_BYTES]);

/* ---- job secrets --------------------------------------------------------- */

/* The capability of one job: whoever proves it owns the job. */
typedef struct {
    uint8_t bytes[STRIA_AUTH_KEY_BYTES];
} stria_job_secret_t;

stria_status_t stria_job_secret_generate(stria_job_secret_t *out);

/* The proof of a job-scoped request: HMAC(secret, label, both session
 * nonces, request id, method, job id). A proof is good for one request of
 * one connection. */
void stria_job_secret_prove(const stria_job_secret_t *secret, const stria_auth_session_t *session,
                            uint64_t request_id, uint32_t method, uint64_t job_id,
                            uint8_t out[STRIA_AUTH_MAC_BYTES]);

/* Checks a proof (proof_len bytes) in constant time. */
bool stria_job_secret_check(const stria_job_secret_t *secret, const stria_auth_session_t *session,
                            uint64_t request_id, uint32_t method, uint64_t job_id,
                            const uint8_t *proof, size_t proof_len);
/* The same, binding `extra` bytes of the request too (a session call's
 * number, link epoch, shape digest and arena places: what an on-path
 * attacker must not change); with extra_len 0 exactly the proof above. */
void stria_job_secret_prove_extra(const stria_job_secret_t *secret,
                                  const stria_auth_session_t *session, uint64_t request_id,
                                  uint32_t method, uint64_t job_id, const void *extra,
                                  size_t extra_len, uint8_t out[STRIA_AUTH_MAC_BYTES]);
bool stria_job_secret_check_extra(const stria_job_secret_t *secret,
                                  const stria_auth_session_t *session, uint64_t request_id,
                                  uint32_t method, uint64_t job_id, const void *extra,
                                  size_t extra_len, const uint8_t *proof, size_t proof_len);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_AUTH_H */
