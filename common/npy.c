#include "stria_npy.h"
#include "stria_dtype.h"
#include "stria_util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define STRIA__NPY_MAX_HEADER (1u << 20)
#define STRIA__NPY_MAX_ELEMS  ((int64_t)1 << 40)

void stria_npy_free(stria_npy_t *arr)
{
    if (arr == NULL)
        return;
    stria_free(arr->data);
    memset(arr, 0, sizeof(*arr));
}

int64_t stria_npy_numel(const stria_npy_t *arr)
{
    int64_t n = 1;
    for (int i = 0; i < arr->ndim; i++)
        n *= arr->shape[i];
    return n;
}

/* Finds `'key':` in a numpy header dict and returns a pointer past the colon. */
static const char *stria__npy_find_key(const char *hdr, const char *key)
{
    char pat[32];
    const char *p;
    snprintf(pat, sizeof(pat), "'%s'", key);
    p = strstr(hdr, pat);
    if (p == NULL) {
        snprintf(pat, sizeof(pat), "\"%s\"", key);
        p = strstr(hdr, pat);
    }
    if (p == NULL)
        return NULL;
    p += strlen(pat);
    while (*p == ' ')
        p++;
    if (*p != ':')
        return NULL;
    p++;
    while (*p == ' ')
        p++;
    return p;
}

static stria_status_t stria__npy_parse_header(const char *path, const char *hdr, int *elem_kind,
                                              int *ndim_out, int64_t *shape)
{
    const char *p;
    int ndim = 0;

    /* elem_kind: 4 = <f4, 2 = <f2, 8 = <f8 */
    p = stria__npy_find_key(hdr, "descr");
    if (p == NULL)
        return stria_error_set(STRIA_ERR_FORMAT, "%s: .npy header has no 'descr'", path);
    if (strncmp(p, "'<f4'", 5) == 0 || strncmp(p, "'=f4'", 5) == 0)
        *elem_kind = 4;
    else if (strncmp(p, "'<f2'", 5) == 0 || strncmp(p, "'=f2'", 5) == 0)
        *elem_kind = 2;
    else if (strncmp(p, "'<f8'", 5) == 0 || strncmp(p, "'=f8'", 5) == 0)
        *elem_kind = 8;
    else {
        char descr[32] = {0};
        sscanf(p, "%31[^,}]", descr);
        return stria_error_set(STRIA_ERR_FORMAT,
                               "%s: unsupported dtype %s (expected little-endian float32 '<f4', "
                               "float16 '<f2' or float64 '<f8')",
                               path, descr);
    }

    p = stria__npy_find_key(hdr, "fortran_order");
    if (p == NULL)
        return stria_error_set(STRIA_ERR_FORMAT, "%s: .npy header has no 'fortran_order'", path);
    if (strncmp(p, "False", 5) != 0)
        return stria_error_set(STRIA_ERR_FORMAT,
                               "%s: Fortran-ordered arrays are not supported (save with C order, "
                               "e.g. numpy.ascontiguousarray)",
                               path);

    p = stria__npy_find_key(hdr, "shape");
    if (p == NULL || *p != '(')
        return stria_error_set(STRIA_ERR_FORMAT, "%s: .npy header has no 'shape' tuple", path);
    p++;
    for (;;) {
        while (*p == ' ')
            p++;
        if (*p == ')')
            break;
        if (ndim == STRIA_NPY_MAX_DIMS)
            return stria_error_set(STRIA_ERR_FORMAT, "%s: more than %d dimensions", path,
                                   STRIA_NPY_MAX_DIMS);
        char *end = NULL;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno != 0 || v < 0)
            return stria_error_set(STRIA_ERR_FORMAT, "%s: bad shape entry in .npy header", path);
        shape[ndim++] = v;
        p = end;
        while (*p == ' ')
            p++;
        if (*p == ',')
            p++;
        else if (*p != ')')
            return stria_error_set(STRIA_ERR_FORMAT, "%s: bad shape tuple in .npy header", path);
    }
    *ndim_out = ndim;
    return STRIA_OK;
}

stria_status_t stria_npy_read(const char *path, stria_npy_t *arr)
{
    stria_status_t st;
    FILE *f;
    unsigned char pre[12];
    uint32_t hlen;
    size_t pre_len;
    char *hdr = NULL;
    int elem_kind = 0;
    int ndim = 0;
    int64_t shape[STRIA_NPY_MAX_DIMS] = {0};
    int64_t numel = 1;
    void *raw = NULL;
    void *data = NULL;

    if (path == NULL || arr == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_npy_read: NULL argument");
    f = fopen(path, "rb");
    if (f == NULL)
        return stria_error_set(STRIA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));

    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0) {
        st = stria_error_set(STRIA_ERR_FORMAT, "%s: not a .npy file (bad magic)", path);
        goto out_close;
    }
    if (pre[6] == 1) {
        hlen = (uint32_t)pre[8] | ((uint32_t)pre[9] << 8);
        pre_len = 10;
    } else if (pre[6] == 2 || pre[6] == 3) {
        if (fread(pre + 10, 1, 2, f) != 2) {
            st = stria_error_set(STRIA_ERR_FORMAT, "%s: truncated .npy preamble", path);
            goto out_close;
        }
        hlen = (uint32_t)pre[8] | ((uint32_t)pre[9] << 8) | ((uint32_t)pre[10] << 16) |
               ((uint32_t)pre[11] << 24);
        pre_len = 12;
    } else {
        st = stria_error_set(STRIA_ERR_FORMAT, "%s: unsupported .npy version %u.%u", path, pre[6],
                             pre[7]);
        goto out_close;
    }
    (void)pre_len;
    if (hlen == 0 || hlen > STRIA__NPY_MAX_HEADER) {
        st =
            stria_error_set(STRIA_ERR_FORMAT, "%s: .npy header length %u out of range", path, hlen);
        goto out_close;
    }
    hdr = malloc((size_t)hlen + 1);
    if (hdr == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate header", path);
        goto out_close;
    }
    if (fread(hdr, 1, hlen, f) != hlen) {
        st = stria_error_set(STRIA_ERR_FORMAT, "%s: truncated .npy header", path);
        goto out_free_hdr;
    }
    hdr[hlen] = '\0';
    st = stria__npy_parse_header(path, hdr, &elem_kind, &ndim, shape);
    if (st != STRIA_OK)
        goto out_free_hdr;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] != 0 && numel > STRIA__NPY_MAX_ELEMS / shape[i]) {
            st = stria_error_set(STRIA_ERR_FORMAT, "%s: array too large", path);
            goto out_free_hdr;
        }
        numel *= shape[i];
    }
    if (numel > 0) {
        size_t nbytes = (size_t)numel * (size_t)elem_kind;
        struct stat sb;
        long at = ftell(f);
        /* what the header promises must be in the file before it is allocated */
        if (fstat(fileno(f), &sb) == 0 && S_ISREG(sb.st_mode) && at >= 0 &&
            (uint64_t)sb.st_size - (uint64_t)at < nbytes) {
            st = stria_error_set(STRIA_ERR_FORMAT,
                                 "%s: truncated data (header promises %lld elements, %zu bytes; "
                                 "the file holds %llu)",
                                 path, (long long)numel, nbytes,
                                 (unsigned long long)((uint64_t)sb.st_size - (uint64_t)at));
            goto out_free_hdr;
        }
        raw = stria_malloc_aligned(nbytes);
        if (raw == NULL) {
            st =
                stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate %zu bytes", path, nbytes);
            goto out_free_hdr;
        }
        if (fread(raw, 1, nbytes, f) != nbytes) {
            st = stria_error_set(STRIA_ERR_FORMAT,
                                 "%s: truncated data (header promises %lld elements)", path,
                                 (long long)numel);
            goto out_free_raw;
        }
        if (fgetc(f) != EOF) {
            st = stria_error_set(STRIA_ERR_FORMAT, "%s: trailing bytes after the array data", path);
            goto out_free_raw;
        }
    }
    if (elem_kind == 8) {
        data = stria_malloc_aligned((size_t)numel * 4);
        if (numel > 0 && data == NULL) {
            st = stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate", path);
            goto out_free_raw;
        }
        for (int64_t i = 0; i < numel; i++)
            ((float *)data)[i] = (float)((const double *)raw)[i];
        stria_free(raw);
        raw = NULL;
    } else {
        data = raw;
        raw = NULL;
    }
    memset(arr, 0, sizeof(*arr));
    arr->dtype = elem_kind == 2 ? STRIA_DTYPE_F16 : STRIA_DTYPE_F32;
    arr->ndim = ndim;
    memcpy(arr->shape, shape, sizeof(shape));
    arr->data = data;
    st = STRIA_OK;

out_free_raw:
    stria_free(raw);
out_free_hdr:
    free(hdr);
out_close:
    fclose(f);
    return st;
}

stria_status_t stria_npy_write(const char *path, stria_dtype_t dtype, int ndim,
                               const int64_t *shape, const void *data)
{
    char hdr[512];
    int n;
    size_t total;
    int64_t numel = 1;
    FILE *f;

    if (path == NULL || (shape == NULL && ndim > 0) || ndim < 0 || ndim > STRIA_NPY_MAX_DIMS)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_npy_write: bad arguments");
    if (dtype != STRIA_DTYPE_F32 && dtype != STRIA_DTYPE_F16)
        return stria_error_set(STRIA_ERR_UNSUPPORTED, "%s: .npy has no %s type", path,
                               stria_dtype_name(dtype));
    n = snprintf(hdr, sizeof(hdr), "{'descr': '%s', 'fortran_order': False, 'shape': (",
                 dtype == STRIA_DTYPE_F32 ? "<f4" : "<f2");
    for (int i = 0; i < ndim; i++) {
        n += snprintf(hdr + n, sizeof(hdr) - (size_t)n, "%lld,%s", (long long)shape[i],
                      (i + 1 < ndim) ? " " : "");
        numel *= shape[i];
    }
    if (ndim > 1) /* numpy writes (a, b), a trailing comma only for 1-tuples */
        n--;
    n += snprintf(hdr + n, sizeof(hdr) - (size_t)n, "), }");
    /* pad with spaces so that magic + len + header + '\n' is a multiple of 64 */
    total = 10 + (size_t)n + 1;
    while (total % 64 != 0) {
        hdr[n++] = ' ';
        total++;
    }
    hdr[n++] = '\n';
    f = fopen(path, "wb");
    if (f == NULL)
        return stria_error_set(STRIA_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    unsigned char pre[10] = {0x93,
                             'N',
                             'U',
                             'M',
                             'P',
                             'Y',
                             1,
                             0,
                             (unsigned char)(n & 0xff),
                             (unsigned char)((n >> 8) & 0xff)};
    size_t nbytes = (size_t)numel * stria_dtype_size(dtype);
    if (fwrite(pre, 1, 10, f) != 10 || fwrite(hdr, 1, (size_t)n, f) != (size_t)n ||
        (nbytes > 0 && fwrite(data, 1, nbytes, f) != nbytes)) {
        fclose(f);
        return stria_error_set(STRIA_ERR_IO, "%s: write failed: %s", path, strerror(errno));
    }
    if (fclose(f) != 0)
        return stria_error_set(STRIA_ERR_IO, "%s: close failed: %s", path, strerror(errno));
    return STRIA_OK;
}
