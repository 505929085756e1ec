#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "stria_common.h"

Test(common, status_strings_and_errors)
{
    cr_expect_str_eq(stria_status_str(STRIA_OK), "success");
    cr_expect_str_eq(stria_status_name(STRIA_ERR_TIMEOUT), "STRIA_ERR_TIMEOUT");
    cr_expect_str_eq(stria_status_str((stria_status_t)-999), "unknown status");
    cr_expect_eq(stria_error_set(STRIA_ERR_IO, "disk %d", 3), STRIA_ERR_IO);
    cr_expect_str_eq(stria_error_msg(), "disk 3");
    stria_error_wrap(STRIA_ERR_IO, "rank %d", 2);
    cr_expect_str_eq(stria_error_msg(), "rank 2: disk 3");
    stria_error_clear();
    cr_expect_str_eq(stria_error_msg(), "");
}

Test(common, bf16_and_fp16_conversions)
{
    cr_expect_eq(stria_f32_to_bf16(1.0f), 0x3f80);
    cr_expect_eq(stria_bf16_to_f32(0x3f80), 1.0f);
    /* 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: rounds to even (1.0) */
    cr_expect_eq(stria_f32_to_bf16(1.00390625f), 0x3f80);
    cr_expect_eq(stria_f32_to_bf16(1.01171875f), 0x3f82);
    cr_expect(isnan(stria_bf16_to_f32(stria_f32_to_bf16(NAN))));
    cr_expect_eq(stria_f32_to_f16(1.0f), 0x3c00);
    cr_expect_eq(stria_f32_to_f16(65504.0f), 0x7bff);
    cr_expect_eq(stria_f32_to_f16(1e6f), 0x7c00);
    cr_expect_eq(stria_f32_to_f16(-2.0f), 0xc000);
    cr_expect_eq(stria_f32_to_f16(5.9604644775390625e-8f), 0x0001); /* smallest subnormal */
    cr_expect(isnan(stria_f16_to_f32(stria_f32_to_f16(NAN))));
    /* every finite fp16 value round-trips */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00)
            continue;
        float f = stria_f16_to_f32((uint16_t)h);
        cr_assert_eq(stria_f32_to_f16(f), (uint16_t)h, "fp16 %#x -> %g", h, f);
    }
    for (uint32_t h = 0; h < 0x10000; h += 7) {
        if ((h & 0x7f80) == 0x7f80)
            continue;
        float f = stria_bf16_to_f32((uint16_t)h);
        cr_assert_eq(stria_f32_to_bf16(f), (uint16_t)h);
    }
    stria_dtype_t dt;
    cr_expect_eq(stria_dtype_parse("bfloat16", &dt), STRIA_OK);
    cr_expect_eq(dt, STRIA_DTYPE_BF16);
    cr_expect_eq(stria_dtype_parse("int8", &dt), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "int8") != NULL);
}

static void count_task(void *ctx, size_t task, int thread)
{
    int *hits = ctx;
    (void)thread;
    __atomic_fetch_add(&hits[task], 1, __ATOMIC_RELAXED);
}

Test(common, pool_runs_every_task_once)
{
    stria_pool_t *pool;
    int hits[1000];
    cr_assert_eq(stria_pool_create(3, &pool), STRIA_OK);
    cr_expect_eq(stria_pool_size(pool), 3);
    for (int round = 0; round < 50; round++) {
        memset(hits, 0, sizeof(hits));
        stria_pool_run(pool, 1000, count_task, hits);
        for (int i = 0; i < 1000; i++)
            cr_assert_eq(hits[i], 1, "round %d task %d ran %d times", round, i, hits[i]);
    }
    stria_pool_destroy(pool);
    memset(hits, 0, sizeof(hits));
    stria_pool_run(NULL, 10, count_task, hits);
    cr_expect_eq(hits[9], 1);
    cr_expect_eq(stria_pool_create(-1, &pool), STRIA_ERR_INVALID_ARG);
}

static char tmp_path[256];

static void write_bytes(const void *data, size_t n)
{
    FILE *f = fopen(tmp_path, "wb");
    cr_assert_not_null(f);
    fwrite(data, 1, n, f);
    fclose(f);
}

static void make_tmp(void)
{
    snprintf(tmp_path, sizeof(tmp_path), "/tmp/stria_test_%d.npy", (int)getpid());
}

static void rm_tmp(void)
{
    unlink(tmp_path);
}

/* The header of the file at tmp_path holds `text` exactly (what numpy and
 * other readers parse, beyond stria's own reader). */
static void expect_npy_header(const char *text)
{
    char hdr[256] = {0};
    FILE *f = fopen(tmp_path, "rb");
    cr_assert_not_null(f);
    size_t n = fread(hdr, 1, sizeof(hdr) - 1, f);
    fclose(f);
    cr_assert_gt(n, 10);
    cr_expect(strstr(hdr + 10, text) != NULL, "header '%s' lacks '%s'", hdr + 10, text);
}

Test(common, npy_round_trip, .init = make_tmp, .fini = rm_tmp)
{
    float data[2 * 3 * 4];
    int64_t shape[3] = {2, 3, 4};
    stria_npy_t arr;
    for (int i = 0; i < 24; i++)
        data[i] = (float)i * 0.5f - 3.0f;
    cr_assert_eq(stria_npy_write(tmp_path, STRIA_DTYPE_F32, 3, shape, data), STRIA_OK);
    cr_assert_eq(stria_npy_read(tmp_path, &arr), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(arr.ndim, 3);
    cr_expect_eq(arr.shape[2], 4);
    cr_expect_eq(stria_npy_numel(&arr), 24);
    cr_expect_eq(memcmp(arr.data, data, sizeof(data)), 0);
    stria_npy_free(&arr);
    expect_npy_header("'shape': (2, 3, 4), }");

    uint16_t h[5] = {0x3c00, 0x4000, 0, 0xbc00, 0x7bff};
    int64_t s1[1] = {5};
    cr_assert_eq(stria_npy_write(tmp_path, STRIA_DTYPE_F16, 1, s1, h), STRIA_OK);
    cr_assert_eq(stria_npy_read(tmp_path, &arr), STRIA_OK);
    cr_expect_eq(arr.dtype, STRIA_DTYPE_F16);
    cr_expect_eq(arr.ndim, 1);
    cr_expect_eq(memcmp(arr.data, h, sizeof(h)), 0);
    stria_npy_free(&arr);
    /* numpy reads the shape as a Python tuple: a 1-tuple needs its comma */
    expect_npy_header("'shape': (5,), }");
}

static void expect_npy_error(const char *needle)
{
    stria_npy_t arr;
    cr_expect_eq(stria_npy_read(tmp_path, &arr), STRIA_ERR_FORMAT);
    cr_expect(strstr(stria_error_msg(), needle) != NULL, "message '%s' lacks '%s'",
              stria_error_msg(), needle);
}

Test(common, npy_bad_files, .init = make_tmp, .fini = rm_tmp)
{
    stria_npy_t arr;
    write_bytes("hello world, not numpy", 22);
    expect_npy_error("bad magic");

    const char hdr_i4[] = "\x93NUMPY\x01\x00\x36\x00{'descr': '<i4', 'fortran_order': False, "
                          "'shape': (2,), }\n";
    write_bytes(hdr_i4, sizeof(hdr_i4) - 1);
    expect_npy_error("unsupported dtype");

    const char hdr_f[] = "\x93NUMPY\x01\x00\x36\x00{'descr': '<f4', 'fortran_order': True, "
                         "'shape': (2,), }\n";
    write_bytes(hdr_f, sizeof(hdr_f) - 1);
    expect_npy_error("Fortran");

    float data[8] = {0};
    int64_t shape[1] = {8};
    cr_assert_eq(stria_npy_write(tmp_path, STRIA_DTYPE_F32, 1, shape, data), STRIA_OK);
    cr_assert_eq(truncate(tmp_path, 128 + 10), 0); /* header block is 128 bytes */
    expect_npy_error("truncated data");

    cr_expect_eq(stria_npy_read("/nonexistent/x.npy", &arr), STRIA_ERR_IO);
    cr_expect(strstr(stria_error_msg(), "/nonexistent/x.npy") != NULL);
}

/* Runs stria_log_error/info in a child whose stderr is a file; journal
 * selects whether JOURNAL_STREAM names that file (as systemd does for a
 * service's stream) or some other stream. Returns what the child wrote. */
static void log_in_child(bool journal, char *out, size_t cap)
{
    char path[64];
    snprintf(path, sizeof(path), "/tmp/stria_test_log_%d.txt", (int)getpid());
    FILE *f = fopen(path, "w+");
    cr_assert_not_null(f);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        struct stat sb;
        char env[64];
        dup2(fileno(f), 2);
        fstat(2, &sb);
        snprintf(env, sizeof(env), "%llu:%llu", (unsigned long long)sb.st_dev,
                 (unsigned long long)sb.st_ino + (journal ? 0 : 1));
        setenv("JOURNAL_STREAM", env, 1);
        stria_log_set_level(STRIA_LOG_INFO);
        stria_log_error("disk %d failed", 3);
        stria_log_info("ready");
        stria_log_debug("hidden");
        _exit(0);
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    rewind(f);
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    fclose(f);
    unlink(path);
}

Test(common, log_lines_carry_journal_priorities_under_systemd)
{
    char text[1024];
    log_in_child(true, text, sizeof(text));
    cr_expect(strncmp(text, "<3>error test_common.c:", 23) == 0, "got '%s'", text);
    cr_expect(strstr(text, "disk 3 failed\n<6>info  test_common.c:") != NULL, "got '%s'", text);
    cr_expect(strstr(text, "hidden") == NULL, "got '%s'", text);
    cr_expect(strchr(text, 'Z') == NULL, "journal lines carry no timestamp: '%s'", text);

    log_in_child(false, text, sizeof(text));
    cr_expect(text[0] == '2' && strstr(text, "Z error test_common.c:") != NULL, "got '%s'", text);
    cr_expect(strstr(text, "<3>") == NULL, "got '%s'", text);
}

Test(common, aligned_alloc_refuses_sizes_that_overflow)
{
    cr_expect_null(stria_malloc_aligned(SIZE_MAX));
    cr_expect_null(stria_malloc_aligned(SIZE_MAX - 10));
    cr_expect_null(stria_calloc_aligned(SIZE_MAX - 62));
    void *p = stria_malloc_aligned(100);
    cr_assert_not_null(p);
    cr_expect_eq((uintptr_t)p % 64, 0);
    stria_free(p);
}

/* Chunks in random order, with repeats and overlaps, against a byte map. */
Test(common, ranges_count_each_byte_once)
{
    enum { TOTAL = 5000 };
    static uint8_t seen[TOTAL];
    unsigned seed = 7;
    for (int round = 0; round < 50; round++) {
        stria_ranges_t set = {0};
        uint64_t want = 0;
        memset(seen, 0, sizeof(seen));
        for (int k = 0; k < 200; k++) {
            uint64_t start = (uint64_t)(rand_r(&seed) % TOTAL);
            uint64_t len = (uint64_t)(rand_r(&seed) % 97);
            if (start + len > TOTAL)
                len = TOTAL - start;
            cr_assert_eq(stria_ranges_add(&set, start, len), STRIA_OK, "%s", stria_error_msg());
            for (uint64_t b = start; b < start + len; b++)
                if (!seen[b]) {
                    seen[b] = 1;
                    want++;
                }
            cr_assert_eq(set.covered, want, "round %d chunk %d: %llu covered, %llu expected", round,
                         k, (unsigned long long)set.covered, (unsigned long long)want);
            uint64_t gap = 0;
            while (gap < TOTAL && seen[gap])
                gap++;
            cr_assert_eq(stria_ranges_first_gap(&set, TOTAL), gap);
            for (size_t i = 0; i < set.n; i++) { /* sorted, disjoint, never touching */
                cr_assert_lt(set.r[i][0], set.r[i][1]);
                if (i > 0)
                    cr_assert_gt(set.r[i][0], set.r[i - 1][1]);
            }
        }
        stria_ranges_free(&set);
        cr_assert_eq(set.n, 0);
    }
}

Test(common, ranges_in_order_stay_one_and_scatter_is_bounded)
{
    stria_ranges_t set = {0};
    /* In order, backwards, re-sent: one range, counted once. */
    for (uint64_t off = 0; off < 1000; off += 100)
        cr_assert_eq(stria_ranges_add(&set, off, 100), STRIA_OK);
    cr_assert_eq(stria_ranges_add(&set, 300, 100), STRIA_OK);
    cr_expect_eq(set.n, 1);
    cr_expect_eq(set.covered, 1000);
    cr_expect_eq(stria_ranges_first_gap(&set, 1000), 1000);
    cr_expect_eq(stria_ranges_first_gap(&set, 1500), 1000);
    stria_ranges_free(&set);
    for (uint64_t off = 1000; off > 0; off -= 100)
        cr_assert_eq(stria_ranges_add(&set, off - 100, 100), STRIA_OK);
    cr_expect_eq(set.n, 1);
    cr_expect_eq(set.covered, 1000);
    /* A range that wraps is refused. */
    cr_expect_eq(stria_ranges_add(&set, UINT64_MAX - 5, 10), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(set.covered, 1000);
    stria_ranges_free(&set);
    /* Every other byte: refused past the bound, nothing counted for it. */
    for (uint64_t k = 0; k < STRIA_RANGES_MAX; k++)
        cr_assert_eq(stria_ranges_add(&set, 2 * k, 1), STRIA_OK);
    cr_expect_eq(stria_ranges_add(&set, 2 * STRIA_RANGES_MAX, 1), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "in order") != NULL, "%s", stria_error_msg());
    cr_expect_eq(set.covered, STRIA_RANGES_MAX);
    /* Filling a gap still works at the bound: it merges. */
    cr_expect_eq(stria_ranges_add(&set, 1, 1), STRIA_OK);
    cr_expect_eq(set.n, STRIA_RANGES_MAX - 1);
    cr_expect_eq(stria_ranges_first_gap(&set, 1u << 20), 3);
    stria_ranges_free(&set);
}

Test(common, text_escape_keeps_utf8_and_escapes_controls)
{
    char out[256];
    /* C0, DEL, C1 in UTF-8 (U+009B, CSI), a lone continuation byte, an
     * overlong encoding, a surrogate and a cut sequence become \xNN */
    cr_assert_str_eq(stria_text_escape("a\x1b[31mb\r\nc\x7f", out, sizeof(out)),
                     "a\\x1b[31mb\\x0d\\x0ac\\x7f");
    cr_assert_str_eq(stria_text_escape("\xc2\x9b"
                                       "2J",
                                       out, sizeof(out)),
                     "\\xc2\\x9b2J");
    cr_assert_str_eq(stria_text_escape("x\x80y\xc0\xafz\xed\xa0\x80\xe2\x82", out, sizeof(out)),
                     "x\\x80y\\xc0\\xafz\\xed\\xa0\\x80\\xe2\\x82");
    /* valid UTF-8 stays, up to four bytes */
    cr_assert_str_eq(
        stria_text_escape("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x99\x82", out, sizeof(out)),
        "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x99\x82");
    cr_assert_str_eq(stria_text_escape(NULL, out, sizeof(out)), "");
    /* cut at a whole character or escape, always terminated */
    cr_assert_str_eq(stria_text_escape("ab\x01", out, 5), "ab");
    cr_assert_str_eq(stria_text_escape("a\xc3\xa9", out, 3), "a");
    cr_assert_str_eq(stria_text_escape("abc", out, 1), "");
}

Test(common, grow_keeps_elements_and_doubles)
{
    int *a = NULL;
    size_t cap = 0;
    for (size_t n = 0; n < 100; n++) {
        int *g = stria_grow(a, &cap, n + 1, sizeof(*a), 4);
        cr_assert_not_null(g);
        cr_assert_geq(cap, n + 1);
        a = g;
        a[n] = (int)n * 3;
    }
    cr_expect_eq(cap, 128); /* 4, 8, ..., 128 */
    for (size_t n = 0; n < 100; n++)
        cr_expect_eq(a[n], (int)n * 3);
    /* room enough: the same array, capacity unchanged */
    cr_expect_eq(stria_grow(a, &cap, 50, sizeof(*a), 4), a);
    cr_expect_eq(cap, 128);
    /* a jump past double: grows to the first doubling that holds it */
    int *g = stria_grow(a, &cap, 1000, sizeof(*a), 4);
    cr_assert_not_null(g);
    cr_expect_eq(cap, 1024);
    cr_expect_eq(g[99], 297);
    /* out of memory: NULL, array and capacity unchanged */
    size_t big = cap;
    cr_expect_null(stria_grow(g, &big, SIZE_MAX / 8, 8, 4));
    cr_expect_eq(big, cap);
    STRIA_FREE_ALL(g, NULL);
}
