/* Fuzz target: reading a .npy file (stria_npy_read: preamble, header dict,
 * shape, data). A file the reader accepts must describe exactly the bytes it
 * holds; nothing it refuses may allocate more than the file could fill. */
#include <stdlib.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "stria_common.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    stria_log_set_level(STRIA_LOG_ERROR);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    int fd = fuzz_memfd(data, size, path);
    stria_npy_t arr;
    if (stria_npy_read(path, &arr) == STRIA_OK) {
        int64_t numel = stria_npy_numel(&arr);
        size_t es = arr.dtype == STRIA_DTYPE_F16 ? 2 : 4;
        if (arr.ndim < 0 || arr.ndim > STRIA_NPY_MAX_DIMS || numel < 0)
            fuzz_fail("accepted a bad shape (ndim %d)", arr.ndim);
        /* f8 input becomes f4: the data took at least numel * es bytes */
        if ((uint64_t)numel * es > size)
            fuzz_fail("accepted %lld elements from a %zu-byte file", (long long)numel, size);
        volatile uint8_t sink = 0;
        for (size_t i = 0; i < (size_t)numel * es; i++)
            sink ^= ((const uint8_t *)arr.data)[i];
        (void)sink;
        stria_npy_free(&arr);
    }
    close(fd);
    return 0;
}
