#include "kernels_int.h"

#include <pthread.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

static const stria_kern_ops_t *const stria__variants[] = {
    &stria__kern_portable,
#ifdef STRIA_HAVE_X86_VARIANTS
    &stria__kern_avx2,
    /* before avx512: the default is the last one the CPU runs */
    &stria__kern_avx512_nobf16,
    &stria__kern_avx512,
#endif
};
#define STRIA__N_VARIANTS (sizeof(stria__variants) / sizeof(stria__variants[0]))

static const char *const stria__variant_names[] = {
    "portable",
#ifdef STRIA_HAVE_X86_VARIANTS
    "avx2",     "avx512-nobf16", "avx512",
#endif
    NULL,
};

static const stria_kern_ops_t *stria__selected;
static stria_status_t stria__select_status = STRIA_OK;
static char stria__select_msg[256];
static pthread_once_t stria__select_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t stria__select_lock = PTHREAD_MUTEX_INITIALIZER;

static const stria_kern_ops_t *stria__variant_find(const char *name)
{
    for (size_t i = 0; i < STRIA__N_VARIANTS; i++)
        if (strcmp(stria__variants[i]->name, name) == 0)
            return stria__variants[i];
    return NULL;
}

static void stria__select_default(void)
{
    const char *env = getenv("STRIA_KERNEL");
    const stria_kern_ops_t *ops = NULL;

    pthread_mutex_lock(&stria__select_lock);
    if (stria__selected != NULL) { /* set explicitly before first use */
        pthread_mutex_unlock(&stria__select_lock);
        return;
    }
    if (env != NULL && env[0] != '\0') {
        ops = stria__variant_find(env);
        if (ops == NULL) {
            stria__select_status = STRIA_ERR_NOT_FOUND;
            snprintf(stria__select_msg, sizeof(stria__select_msg),
                     "STRIA_KERNEL=%s: unknown kernel variant (this build has portable%s)", env,
                     STRIA__N_VARIANTS > 1 ? ", avx2, avx512-nobf16, avx512" : "");
        } else if (!ops->cpu_ok()) {
            stria__select_status = STRIA_ERR_UNSUPPORTED;
            snprintf(stria__select_msg, sizeof(stria__select_msg),
                     "STRIA_KERNEL=%s: this CPU does not support that variant", env);
            ops = NULL;
        }
    } else {
        for (size_t i = STRIA__N_VARIANTS; i-- > 0;) {
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
                               "kernel variant '%s' is not supported by this CPU", name);
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
