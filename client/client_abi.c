/* libstria's ABI: the public structs start with their struct_size, so that
 * later versions can add fields at the end; these read a caller's struct
 * into ours and write ours into the caller's, as far as each side knows. */
#include <stddef.h>
#include <string.h>

#include "client_int.h"

/* A struct_size beyond this is no size at all: the caller's header predates
 * struct_size (its first field is a pointer) or the struct is uninitialised. */
#define ABI_MAX_GROWTH 4096
#define STATS_V1_SIZE  STRIA__V1_END(stria_call_stats_t, bytes_down)

unsigned stria_client_abi_version(void)
{
    return STRIA_CLIENT_ABI_VERSION;
}

stria_status_t stria__labi_size_ok(size_t theirs, size_t v1, size_t ours, const char *what,
                                   const char *init)
{
    if (theirs >= v1 && theirs <= ours + ABI_MAX_GROWTH && theirs % sizeof(void *) == 0)
        return STRIA_OK;
    return stria_error_set(STRIA_ERR_INVALID_ARG,
                           "%s: struct_size is %zu, not a size of this struct: set it to "
                           "sizeof(%s) (start from %s); a program built against a libstria "
                           "header older than ABI %d must be rebuilt",
                           what, theirs, what, init, STRIA_CLIENT_ABI_VERSION);
}

stria_status_t stria__labi_read(void *dst, size_t size, size_t v1, const void *src,
                                const char *what, const char *init)
{
    size_t theirs;
    memcpy(&theirs, src, sizeof(theirs));
    stria_status_t st = stria__labi_size_ok(theirs, v1, size, what, init);
    if (st != STRIA_OK)
        return st;
    for (size_t i = size; i < theirs; i++)
        if (((const unsigned char *)src)[i] != 0)
            return stria_error_set(STRIA_ERR_UNSUPPORTED,
                                   "%s: a field at byte %zu is set, which this libstria (ABI %d, "
                                   "%zu-byte %s) does not know: use a newer library",
                                   what, i, STRIA_CLIENT_ABI_VERSION, size, what);
    memset(dst, 0, size);
    memcpy(dst, src, theirs < size ? theirs : size);
    memcpy(dst, &size, sizeof(size));
    return STRIA_OK;
}

stria_status_t stria__labi_check_stats(const stria_call_stats_t *stats)
{
    if (stats == NULL)
        return STRIA_OK;
    return stria__labi_size_ok(stats->struct_size, STATS_V1_SIZE, sizeof(*stats),
                               "stria_call_stats_t", "STRIA_CALL_STATS_INIT");
}

void stria__labi_write_stats(stria_call_stats_t *out, const stria_call_stats_t *ours)
{
    size_t theirs = out->struct_size;
    size_t n = theirs < sizeof(*ours) ? theirs : sizeof(*ours);
    memcpy((char *)out + sizeof(size_t), (const char *)ours + sizeof(size_t), n - sizeof(size_t));
    if (theirs > n)
        memset((char *)out + n, 0, theirs - n);
}

stria_status_t stria__labi_call(const stria_call_t *in, stria_call_shape_t *out)
{
    if (in == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "call record is NULL");
    if (in->struct_size < offsetof(stria_call_t, window_right) + sizeof(int64_t) ||
        in->struct_size > sizeof(stria_call_t))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_call_t: struct_size %zu is not this library's (%zu): start "
                               "from STRIA_CALL_INIT",
                               in->struct_size, sizeof(stria_call_t));
    *out = (stria_call_shape_t){.batch = in->batch,
                                .seq_len = in->seq_len,
                                .causal = in->causal,
                                .scale = in->scale,
                                .cu_seqlens = in->cu_seqlens,
                                .n_cu_seqlens = in->n_cu_seqlens,
                                .has_window = in->has_window,
                                .window_left = in->window_left,
                                .window_right = in->window_right};
    return STRIA_OK;
}

stria_call_shape_t stria__labi_job_call(const stria_job_spec_t *s)
{
    return (stria_call_shape_t){.batch = s->batch,
                                .seq_len = s->seq_len,
                                .causal = s->causal,
                                .scale = s->scale,
                                .cu_seqlens = s->cu_seqlens,
                                .n_cu_seqlens = s->n_cu_seqlens,
                                .has_window = s->has_window,
                                .window_left = s->window_left,
                                .window_right = s->window_right};
}
