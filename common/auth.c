/* The service's cryptography on OpenSSL's libcrypto: random bytes, HMAC,
 * constant-time comparison, sealing keys for one session, job secrets. See
 * stria_auth.h. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include "stria_auth.h"

#ifndef STRIA_FUZZ_UNSAFE_RANDOM
stria_status_t stria_auth_random(void *buf, size_t n)
{
    if (n > 0 && RAND_bytes(buf, (int)n) != 1)
        return stria_error_set(STRIA_ERR_INTERNAL, "the system's random generator failed");
    return STRIA_OK;
}
#else
/* UNSAFE, FOR THE FUZZ BUILD ONLY (STRIA_FUZZ=ON, tests/fuzz): "random"
 * bytes that are a fixed function of how many were drawn since the fuzz
 * target last called stria_auth_fuzz_reset(), so that a fuzz input can
 * carry the proofs of a server's challenge and of a job's secret (the
 * nonces and the secrets are known in advance). Every nonce, job id, job
 * secret, ring key and credential of such a build is public. The top
 * CMakeLists.txt defines STRIA_FUZZ_UNSAFE_RANDOM only in a STRIA_FUZZ
 * build; the checks below refuse it in a build without libFuzzer's
 * instrumentation and ASan, and a program that never armed the generator
 * (a daemon of that build) aborts at its first draw. */
#if !defined(__clang__) || !defined(__has_feature)
#error "STRIA_FUZZ_UNSAFE_RANDOM is for the fuzz build only (STRIA_FUZZ=ON, clang)"
#elif !__has_feature(coverage_sanitizer) || !__has_feature(address_sanitizer)
#error "STRIA_FUZZ_UNSAFE_RANDOM needs the fuzz build's instrumentation (STRIA_FUZZ=ON)"
#endif
#include <stdatomic.h>
#include <stdlib.h>

static atomic_bool stria__fuzz_armed;
static atomic_uint_fast64_t stria__fuzz_draws;

void stria_auth_fuzz_reset(void)
{
    atomic_store(&stria__fuzz_draws, 0);
    atomic_store(&stria__fuzz_armed, true);
}

/* Draw k fills 8 bytes at a time with splitmix64 of (k, block). */
stria_status_t stria_auth_random(void *buf, size_t n)
{
    uint8_t *p = buf;
    if (!atomic_load(&stria__fuzz_armed)) {
        fprintf(stderr, "stria: this is a fuzz build (STRIA_FUZZ_UNSAFE_RANDOM): it has no "
                        "random generator; never run its programs as a service\n");
        abort();
    }
    uint64_t k = atomic_fetch_add(&stria__fuzz_draws, 1);
    for (size_t i = 0; i < n; i += 8) {
        uint64_t z = (k << 32 | i / 8) * 0x9E3779B97F4A7C15ull + 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        for (size_t b = 0; b < 8 && i + b < n; b++)
            p[i + b] = (uint8_t)(z >> (8 * b));
    }
    return STRIA_OK;
}
#endif

/* A context of HMAC-SHA256 without a key, made once: each MAC starts from a
 * copy of it (fetching the implementation and the digest by name costs
 * more than the MAC of a short message). */
static EVP_MAC_CTX *stria__hmac_base;
static pthread_once_t stria__hmac_once = PTHREAD_ONCE_INIT;

static void stria__hmac_setup(void)
{
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {
        OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
        OSSL_PARAM_construct_end(),
    };
    EVP_MAC *mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    EVP_MAC_CTX *ctx = mac != NULL ? EVP_MAC_CTX_new(mac) : NULL;
    EVP_MAC_free(mac); /* the context holds its own reference */
    if (ctx != NULL && EVP_MAC_CTX_set_params(ctx, params) != 1) {
        EVP_MAC_CTX_free(ctx);
        ctx = NULL;
    }
    stria__hmac_base = ctx;
}

void stria_auth_hmac(const void *key, size_t key_len, const stria_auth_part_t *parts, size_t n,
                     uint8_t out[STRIA_AUTH_MAC_BYTES])
{
    static const uint8_t empty_key[1] = {0};
    size_t out_len = 0;
    bool ok = false;

    pthread_once(&stria__hmac_once, stria__hmac_setup);
    EVP_MAC_CTX *ctx = stria__hmac_base ? EVP_MAC_CTX_dup(stria__hmac_base) : NULL;
    /* An empty key is valid HMAC (zero-padded); OpenSSL wants a pointer. */
    if (ctx != NULL && EVP_MAC_init(ctx, key_len ? key : empty_key, key_len, NULL) == 1) {
        ok = true;
        for (size_t i = 0; i < n && ok; i++)
            ok = parts[i].len == 0 || EVP_MAC_update(ctx, parts[i].data, parts[i].len) == 1;
        ok = ok && EVP_MAC_final(ctx, out, &out_len, STRIA_AUTH_MAC_BYTES) == 1 &&
             out_len == STRIA_AUTH_MAC_BYTES;
    }
    EVP_MAC_CTX_free(ctx);
    if (!ok) {
        /* Never a usable MAC: a random one matches nothing. */
        stria_log_error("HMAC-SHA256 failed in libcrypto");
        if (RAND_bytes(out, STRIA_AUTH_MAC_BYTES) != 1)
            memset(out, 0xA5, STRIA_AUTH_MAC_BYTES);
    }
}

bool stria_auth_equal(const void *a, const void *b, size_t n)
{
    return CRYPTO_memcmp(a, b, n) == 0;
}

stria_status_t stria_auth_token_generate(char out[STRIA_AUTH_TOKEN_CHARS + 1])
{
    uint8_t raw[STRIA_AUTH_TOKEN_CHARS / 2];
    stria_status_t st = stria_auth_random(raw, sizeof(raw));
    if (st != STRIA_OK)
        return st;
    for (size_t i = 0; i < sizeof(raw); i++)
        snprintf(out + 2 * i, 3, "%02x", raw[i]);
    OPENSSL_cleanse(raw, sizeof(raw));
    return STRIA_OK;
}

/* ---- sessions ------------------------------------------------------------ */

void stria_auth_hello_mac(const char *token, const char *service, const uint8_t *client_nonce,
                          const uint8_t *server_nonce, bool server_side,
                          uint8_t out[STRIA_AUTH_MAC_BYTES])
{
    const char *label = server_side ? "stria hello v1 server" : "stria hello v1 client";
    uint8_t svc_len[4];
    token = token ? token : "";
    service = service ? service : "";
    stria_put_le32(svc_len, (uint32_t)strlen(service));
    stria_auth_part_t parts[] = {
        {label, strlen(label) + 1},
        {svc_len, sizeof(svc_len)},
        {service, strlen(service)},
        {client_nonce, STRIA_AUTH_NONCE_BYTES},
        {server_nonce, STRIA_AUTH_NONCE_BYTES},
    };
    stria_auth_hmac(token, strlen(token), parts, sizeof(parts) / sizeof(parts[0]), out);
}

void stria_auth_session_derive(stria_auth_session_t *s, const char *token)
{
    static const char label[] = "stria session key v1";
    token = token ? token : "";
    stria_auth_part_t parts[] = {
        {label, sizeof(label)},
        {s->client_nonce, STRIA_AUTH_NONCE_BYTES},
        {s->server_nonce, STRIA_AUTH_NONCE_BYTES},
    };
    stria_auth_hmac(token, strlen(token), parts, 3, s->key);
}

/* Associated data of a sealed key: purpose (with its length) and job id. */
static size_t stria__seal_ad(const char *purpose, uint64_t job_id, uint8_t *ad, size_t cap)
{
    size_t pl = strlen(purpose);
    if (pl + 12 > cap)
        pl = cap - 12;
    stria_put_le32(ad, (uint32_t)pl);
    memcpy(ad + 4, purpose, pl);
    stria_put_le64(ad + 4 + pl, job_id);
    return pl + 12;
}

stria_status_t stria_auth_seal(const stria_auth_session_t *s, const char *purpose, uint64_t job_id,
                               const uint8_t key[STRIA_AUTH_KEY_BYTES],
                               uint8_t out[STRIA_AUTH_SEALED_BYTES])
{
    uint8_t ad[80];
    size_t ad_len = stria__seal_ad(purpose, job_id, ad, sizeof(ad));
    int len = 0;
    stria_status_t st = stria_auth_random(out, 12);
    if (st != STRIA_OK)
        return st;
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    bool ok =
        ctx != NULL && EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), NULL, s->key, out) == 1 &&
        EVP_EncryptUpdate(ctx, NULL, &len, ad, (int)ad_len) == 1 &&
        EVP_EncryptUpdate(ctx, out + 12, &len, key, STRIA_AUTH_KEY_BYTES) == 1 &&
        len == STRIA_AUTH_KEY_BYTES && EVP_EncryptFinal_ex(ctx, out + 12 + len, &len) == 1 &&
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, 16, out + 12 + STRIA_AUTH_KEY_BYTES) == 1;
    EVP_CIPHER_CTX_free(ctx);
    if (!ok)
        return stria_error_set(STRIA_ERR_INTERNAL, "sealing a key failed in libcrypto");
    return STRIA_OK;
}

stria_status_t stria_auth_open(const stria_auth_session_t *s, const char *purpose, uint64_t job_id,
                               const uint8_t *sealed, size_t sealed_len,
                               uint8_t key_out[STRIA_AUTH_KEY_BYTES])
{
    uint8_t ad[80], plain[STRIA_AUTH_KEY_BYTES], tag[16];
    size_t ad_len = stria__seal_ad(purpose, job_id, ad, sizeof(ad));
    int len = 0, fin = 0;

    if (sealed == NULL || sealed_len != STRIA_AUTH_SEALED_BYTES)
        return stria_error_set(STRIA_ERR_AUTH, "the %s is missing or has %zu bytes, not %d",
                               purpose, sealed_len, STRIA_AUTH_SEALED_BYTES);
    memcpy(tag, sealed + 12 + STRIA_AUTH_KEY_BYTES, sizeof(tag));
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    bool ok = ctx != NULL &&
              EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), NULL, s->key, sealed) == 1 &&
              EVP_DecryptUpdate(ctx, NULL, &len, ad, (int)ad_len) == 1 &&
              EVP_DecryptUpdate(ctx, plain, &len, sealed + 12, STRIA_AUTH_KEY_BYTES) == 1 &&
              len == STRIA_AUTH_KEY_BYTES &&
              EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, 16, tag) == 1 &&
              EVP_DecryptFinal_ex(ctx, plain + len, &fin) == 1;
    EVP_CIPHER_CTX_free(ctx);
    if (!ok) {
        OPENSSL_cleanse(plain, sizeof(plain));
        return stria_error_set(STRIA_ERR_AUTH, "the %s was not sealed for this connection",
                               purpose);
    }
    memcpy(key_out, plain, STRIA_AUTH_KEY_BYTES);
    OPENSSL_cleanse(plain, sizeof(plain));
    return STRIA_OK;
}

/* ---- job secrets --------------------------------------------------------- */

stria_status_t stria_job_secret_generate(stria_job_secret_t *out)
{
    return stria_auth_random(out->bytes, sizeof(out->bytes));
}

void stria_job_secret_prove_extra(const stria_job_secret_t *secret, const stria_auth_session_t *s,
                                  uint64_t request_id, uint32_t method, uint64_t job_id,
                                  const void *extra, size_t extra_len,
                                  uint8_t out[STRIA_AUTH_MAC_BYTES])
{
    static const char label[] = "stria job request v1";
    uint8_t fields[20];
    stria_put_le64(fields, request_id);
    stria_put_le32(fields + 8, method);
    stria_put_le64(fields + 12, job_id);
    stria_auth_part_t parts[] = {
        {label, sizeof(label)},
        {s->client_nonce, STRIA_AUTH_NONCE_BYTES},
        {s->server_nonce, STRIA_AUTH_NONCE_BYTES},
        {fields, sizeof(fields)},
        {extra, extra_len},
    };
    stria_auth_hmac(secret->bytes, sizeof(secret->bytes), parts, extra_len > 0 ? 5 : 4, out);
}

void stria_job_secret_prove(const stria_job_secret_t *secret, const stria_auth_session_t *s,
                            uint64_t request_id, uint32_t method, uint64_t job_id,
                            uint8_t out[STRIA_AUTH_MAC_BYTES])
{
    stria_job_secret_prove_extra(secret, s, request_id, method, job_id, NULL, 0, out);
}

bool stria_job_secret_check_extra(const stria_job_secret_t *secret, const stria_auth_session_t *s,
                                  uint64_t request_id, uint32_t method, uint64_t job_id,
                                  const void *extra, size_t extra_len, const uint8_t *proof,
                                  size_t proof_len)
{
    uint8_t want[STRIA_AUTH_MAC_BYTES];
    stria_job_secret_prove_extra(secret, s, request_id, method, job_id, extra, extra_len, want);
    return proof != NULL && proof_len == STRIA_AUTH_MAC_BYTES &&
           stria_auth_equal(want, proof, STRIA_AUTH_MAC_BYTES);
}

bool stria_job_secret_check(const stria_job_secret_t *secret, const stria_auth_session_t *s,
                            uint64_t request_id, uint32_t method, uint64_t job_id,
                            const uint8_t *proof, size_t proof_len)
{
    return stria_job_secret_check_extra(secret, s, request_id, method, job_id, NULL, 0, proof,
                                        proof_len);
}

void stria_auth_wipe(void *p, size_t n)
{
    OPENSSL_cleanse(p, n);
}

void stria_auth_free_secret(char *s)
{
    if (s == NULL)
        return;
    stria_auth_wipe(s, strlen(s));
    free(s);
}
