#include "kernels_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static const stria_kern_ops_t *const stria__builtin[] = {
    &stria__kern_portable,
#ifdef STRIA_HAVE_X86_VARIANTS
    &stria__kern_avx2,
    /* before avx512: the default is the last one the CPU runs */
    &stria__kern_avx512_nobf16,
    &stria__kern_avx512,
#endif
#ifdef STRIA_HAVE_AMX
    &stria__kern_amx,
#endif
};
#define STRIA__N_BUILTIN (sizeof(stria__builtin) / sizeof(stria__builtin[0]))
#define STRIA__N_EXTRA   4

/* The built-in variants, then those registered (stria__kern_register). */
static const stria_kern_ops_t *stria__variants[STRIA__N_BUILTIN + STRIA__N_EXTRA];
static size_t stria__n_variants;
static const char *stria__variant_names[STRIA__N_BUILTIN + STRIA__N_EXTRA + 1];
static pthread_mutex_t stria__table_lock = PTHREAD_MUTEX_INITIALIZER;

/* Fills the table with the built-in variants once (registrations may come
 * before: from constructors). Call with stria__table_lock held. */
static void stria__table_init_locked(void)
{
    if (stria__n_variants > 0)
        return;
    for (size_t i = 0; i < STRIA__N_BUILTIN; i++) {
        stria__variants[i] = stria__builtin[i];
        stria__variant_names[i] = stria__builtin[i]->name;
    }
    stria__n_variants = STRIA__N_BUILTIN;
}

bool stria__kern_register(const stria_kern_ops_t *ops)
{
    bool ok;
    pthread_mutex_lock(&stria__table_lock);
    stria__table_init_locked();
    ok = stria__n_variants < STRIA__N_BUILTIN + STRIA__N_EXTRA;
    if (ok) {
        stria__variant_names[stria__n_variants] = ops->name;
        stria__variants[stria__n_variants++] = ops;
    }
    pthread_mutex_unlock(&stria__table_lock);
    return ok;
}

static size_t stria__table_size(void)
{
    pthread_mutex_lock(&stria__table_lock);
    stria__table_init_locked();
    size_t n = stria__n_variants;
    pthread_mutex_unlock(&stria__table_lock);
    return n;
}

/* ---- the amx variant's checks (any build: the tests call the verdict) ---- */

const char *stria__amx_verdict(bool avx512_bf16, bool amx_bf16, bool amx_tile, int perm_errno)
{
    static _Thread_local char why[160];
    if (!avx512_bf16)
        return "no AVX512-BF16 (CPUID), which its softmax passes use";
    if (!amx_bf16 || !amx_tile)
        return "no AMX-BF16 and AMX-TILE (CPUID)";
    if (perm_errno != 0) {
        snprintf(why, sizeof(why),
                 "the kernel refused this process the AMX tile state "
                 "(arch_prctl(ARCH_REQ_XCOMP_PERM): %s)",
                 strerror(perm_errno));
        return why;
    }
    return NULL;
}

static const char *stria__amx_found;
static pthread_once_t stria__amx_once = PTHREAD_ONCE_INIT;

static void stria__amx_probe(void)
{
    bool avx512_bf16 = false, amx_bf16 = false, amx_tile = false;
    int perm_errno = ENOSYS;
#if defined(__x86_64__)
    unsigned a, b, c, d;
    __builtin_cpu_init();
    avx512_bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        amx_bf16 = (d >> 22) & 1u;
        amx_tile = (d >> 24) & 1u;
    }
    if (avx512_bf16 && amx_bf16 && amx_tile) {
        /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (Linux 5.16): a VM may
         * show the CPUID bits and still refuse it */
        perm_errno = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : errno;
    }
#endif
    const char *why = stria__amx_verdict(avx512_bf16, amx_bf16, amx_tile, perm_errno);
    /* the verdict's buffer is this thread's: keep a copy */
    stria__amx_found = why != NULL ? strdup(why) : NULL;
    if (why != NULL && stria__amx_found == NULL)
        stria__amx_found = "no AMX (out of memory describing why)";
}

const char *stria__amx_why_not(void)
{
    pthread_once(&stria__amx_once, stria__amx_probe);
    return stria__amx_found;
}

static const stria_kern_ops_t *stria__selected;
static stria_status_t stria__select_status = STRIA_OK;
static char stria__select_msg[256];
static pthread_once_t stria__select_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t stria__select_lock = PTHREAD_MUTEX_INITIALIZER;

static const stria_kern_ops_t *stria__variant_find(const char *name)
{
    const size_t n = stria__table_size();
    for (size_t i = 0; i < n; i++)
        if (strcmp(stria__variants[i]->name, name) == 0)
            return stria__variants[i];
    return NULL;
}

/* "this CPU does not support that variant" and why, when the variant says. */
static const char *stria__why_not(const stria_kern_ops_t *ops)
{
    const char *why = ops->why_not != NULL ? ops->why_not() : NULL;
    return why != NULL ? why : "not in this CPU's features";
}

static void stria__select_default(void)
{
    const char *env = getenv("STRIA_KERNEL");
    const stria_kern_ops_t *ops = NULL;

    stria__table_size();
    pthread_mutex_lock(&stria__select_lock);
    if (stria__selected != NULL) { /* set explicitly before first use */
        pthread_mutex_unlock(&stria__select_lock);
        return;
    }
    if (env != NULL && env[0] != '\0') {
        ops = stria__variant_find(env);
        if (ops == NULL) {
            char have[128] = "";
            for (size_t i = 0; i < STRIA__N_BUILTIN; i++)
                snprintf(have + strlen(have), sizeof(have) - strlen(have), "%s%s", i ? ", " : "",
                         stria__builtin[i]->name);
            stria__select_status = STRIA_ERR_NOT_FOUND;
            snprintf(stria__select_msg, sizeof(stria__select_msg),
                     "STRIA_KERNEL=%s: unknown kernel variant (this build has %s)", env, have);
        } else if (!ops->cpu_ok()) {
            stria__select_status = STRIA_ERR_UNSUPPORTED;
            snprintf(stria__select_msg, sizeof(stria__select_msg),
                     "STRIA_KERNEL=%s: this CPU does not support that variant: %s", env,
                     stria__why_not(ops));
            ops = NULL;
        }
    } else {
        /* the built-in ones only: a registered variant is chosen explicitly */
        for (size_t i = STRIA__N_BUILTIN; i-- > 0;) {
            if (stria__variants[i]->cpu_ok()) {
                ops = stria__variants[i];
                break;
            }
        }
    }
    stria__selected = ops;
    pthread_mutex_unlock(&stria__select_lock);
}

const stria_kern_ops_t *stria__kern_ops(void)
{
    pthread_once(&stria__select_once, stria__select_default);
    if (stria__selected == NULL) {
        stria_error_set(stria__select_status, "%s", stria__select_msg);
        return NULL;
    }
    return stria__selected;
}

stria_status_t stria__kern_ops_status(void)
{
    pthread_once(&stria__select_once, stria__select_default);
    return stria__selected != NULL ? STRIA_OK : stria__select_status;
}

const char *stria_kernels_variant(void)
{
    const stria_kern_ops_t *ops = stria__kern_ops();
    return ops ? ops->name : "none";
}

stria_status_t stria_kernels_set_variant(const char *name)
{
    const stria_kern_ops_t *ops = name ? stria__variant_find(name) : NULL;
    if (ops == NULL)
        return stria_error_set(STRIA_ERR_NOT_FOUND, "unknown kernel variant '%s'",
                               name ? name : "(null)");
    if (!ops->cpu_ok())
        return stria_error_set(STRIA_ERR_UNSUPPORTED,
                               "kernel variant '%s' is not supported by this CPU: %s", name,
                               stria__why_not(ops));
    pthread_mutex_lock(&stria__select_lock);
    stria__selected = ops;
    pthread_mutex_unlock(&stria__select_lock);
    pthread_once(&stria__select_once, stria__select_default);
    return STRIA_OK;
}

bool stria_kernels_variant_available(const char *name)
{
    const stria_kern_ops_t *ops = name ? stria__variant_find(name) : NULL;
    return ops != NULL && ops->cpu_ok();
}

bool stria_kernels_variant_bf16_dot(const char *name)
{
    const stria_kern_ops_t *ops = name ? stria__variant_find(name) : NULL;
    return ops != NULL && ops->cpu_ok() && ops->gemm_bf16 != NULL && ops->gemm_bf16_ok();
}

const char *const *stria_kernels_variant_names(void)
{
    stria__table_size();
    return stria__variant_names;
}

void stria_f32_add(float *dst, const float *src, size_t n)
{
    const stria_kern_ops_t *ops = stria__kern_ops();
    size_t done = 0;
    if (ops != NULL) {
        size_t body = n & ~(size_t)7; /* row_acc takes multiples of 8 */
        while (done < body) {
            size_t chunk = body - done < ((size_t)1 << 20) ? body - done : (size_t)1 << 20;
            ops->row_acc(dst + done, src + done, (int)chunk);
            done += chunk;
        }
    }
    for (; done < n; done++)
        dst[done] += src[done];
}
