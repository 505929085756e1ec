/* stria-run as a user runs it: real .npy files, a real process, exit codes. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ref.h"

static char dir[256];

static void setup(void)
{
    snprintf(dir, sizeof(dir), "/tmp/stria_run_test_%d", (int)getpid());
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "rm -rf %s && mkdir -p %s", dir, dir);
    cr_assert_eq(system(cmd), 0);
}

static void teardown(void)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    (void)system(cmd);
}

/* Runs stria-run with the given arguments (stdout/stderr to files in dir);
 * returns the exit status. */
static int run(const char *args)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "%s %s >%s/stdout 2>%s/stderr", STRIA_RUN_BIN, args, dir, dir);
    int st = system(cmd);
    cr_assert(WIFEXITED(st), "stria-run did not exit normally");
    return WEXITSTATUS(st);
}

static char *slurp(const char *name)
{
    static char buf[8192];
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
    buf[n] = '\0';
    if (f)
        fclose(f);
    return buf;
}

static void write_arr(const char *name, int64_t B, int64_t T, int64_t H, int64_t D, float *data)
{
    char path[512];
    int64_t shape[4] = {B, T, H, D};
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    cr_assert_eq(stria_npy_write(path, STRIA_DTYPE_F32, 4, shape, data), STRIA_OK);
}

static float *read_arr(const char *name, int64_t n)
{
    char path[512];
    stria_npy_t a;
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    cr_assert_eq(stria_npy_read(path, &a), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(a.dtype, STRIA_DTYPE_F32);
    cr_assert_eq(stria_npy_numel(&a), n);
    return a.data;
}

static void check(const char *name, const double *ref, int64_t n, double tol)
{
    float *x = read_arr(name, n);
    double err = ref_max_err_f32(x, ref, (size_t)n);
    cr_expect(err <= tol, "%s: max error %.3g > %.3g", name, err, tol);
    stria_free(x);
}

static void run_and_check_masks(bool causal, const char *dtype_flag, stria_dtype_t dt, double tol,
                                const char *extra, const ref_masks_t *m)
{
    const int64_t B = 2, T = 45, H = 4, Hk = 2, D = 32;
    size_t nq = (size_t)(B * T * H * D), nk = (size_t)(B * T * Hk * D);
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *g = malloc(nq * 4);
    ref_fill(q, nq, 1, 1.0f, dt);
    ref_fill(k, nk, 2, 1.0f, dt);
    ref_fill(v, nk, 3, 1.0f, dt);
    ref_fill(g, nq, 4, 1.0f, dt);
    write_arr("q.npy", B, T, H, D, q);
    write_arr("k.npy", B, T, Hk, D, k);
    write_arr("v.npy", B, T, Hk, D, v);
    write_arr("do.npy", B, T, H, D, g);
    char args[2048];
    snprintf(args, sizeof(args),
             "local --q %s/q.npy --k %s/k.npy --v %s/v.npy --do %s/do.npy --out %s/out %s %s %s",
             dir, dir, dir, dir, dir, causal ? "--causal" : "--no-causal", dtype_flag, extra);
    cr_assert_eq(run(args), 0, "stria-run failed: %s", slurp("stderr"));
    cr_expect(strstr(slurp("stdout"), "forward+backward") != NULL);

    ref_shape_t rs = {B, T, T, H, Hk, D, 1.0 / sqrt((double)D), causal, NULL, NULL};
    ref_out_t r;
    ref_f64_run_masks(&rs, m, q, k, v, g, &r);
    check("out/o.npy", r.o, (int64_t)nq, tol);
    check("out/lse.npy", r.lse, B * H * T, 1e-5);
    check("out/dq.npy", r.dq, (int64_t)nq, tol);
    check("out/dk.npy", r.dk, (int64_t)nk, tol);
    check("out/dv.npy", r.dv, (int64_t)nk, tol);
    ref_out_free(&r);
    free(q), free(k), free(v), free(g);
}

static void run_and_check(bool causal, const char *dtype_flag, stria_dtype_t dt, double tol)
{
    run_and_check_masks(causal, dtype_flag, dt, tol, "", NULL);
}

Test(stria_run, documents_and_window_match_reference, .init = setup, .fini = teardown)
{
    static const int64_t cu[] = {0, 1, 17, 30, 45};
    ref_masks_t docs = {.cu_seqlens = cu, .n_cu = 5};
    ref_masks_t both = {.cu_seqlens = cu, .n_cu = 5, .has_window = true, .left = 9, .right = 0};
    ref_masks_t two_sided = {.has_window = true, .left = 4, .right = 7};
    run_and_check_masks(true, "", STRIA_DTYPE_F32, 1e-5, "--cu-seqlens 0,1,17,30,45", &docs);
    run_and_check_masks(true, "", STRIA_DTYPE_F32, 1e-5,
                        "--cu-seqlens 0,1,17,30,45 --window 9,0 --ranks 3 --layout zigzag", &both);
    run_and_check_masks(false, "", STRIA_DTYPE_F32, 1e-5, "--window 4,7 --ranks 2", &two_sided);
}

Test(stria_run, bad_documents_and_windows_are_refused, .init = setup, .fini = teardown)
{
    static float x[2 * 8 * 2 * 16];
    static const struct {
        const char *flags, *want;
    } cases[] = {
        {"--cu-seqlens 1,5", "--cu-seqlens must start at 0 (got 1)"},
        {"--cu-seqlens 0,5,3,8", "--cu-seqlens must not decrease (item 3 is 3 after 5)"},
        {"--cu-seqlens 0,5", "--cu-seqlens must end at the token count of the inputs (8) (got 5)"},
        {"--cu-seqlens 0,-3,8", "--cu-seqlens"},
        {"--window 3", "--window takes two values"},
        {"--window 3,2", "--window: RIGHT must be 0 or -1 with causal attention (got 2"},
        {"--window -2,0", "--window"},
        {"--window 1,2,3", "--window"},
    };
    char args[2048];
    write_arr("q.npy", 2, 8, 2, 16, x);
    write_arr("k.npy", 2, 8, 2, 16, x);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(args, sizeof(args), "local --q %s/q.npy --k %s/k.npy --v %s/k.npy --out %s/o %s",
                 dir, dir, dir, dir, cases[i].flags);
        cr_expect_eq(run(args), 2, "%s", cases[i].flags);
        cr_expect(strstr(slurp("stderr"), cases[i].want) != NULL, "%s: %s", cases[i].flags,
                  slurp("stderr"));
    }
    snprintf(args, sizeof(args),
             "submit --coordinator 127.0.0.1:1 --q %s/q.npy --k %s/k.npy --v %s/k.npy --out %s/o "
             "--cu-seqlens 0,5",
             dir, dir, dir, dir);
    cr_expect_eq(run(args), 2);
    cr_expect(strstr(slurp("stderr"), "--cu-seqlens must end at the token count") != NULL, "%s",
              slurp("stderr"));
}

/* submit's --token-file is read with the daemons' rules (by the library,
 * before any connection): a missing, empty or blank file is named. */
Test(stria_run, a_bad_token_file_is_named_before_connecting, .init = setup, .fini = teardown)
{
    static float x[1 * 8 * 2 * 16];
    static const struct {
        const char *file, *content, *want;
    } cases[] = {
        {"missing", NULL, "No such file"},
        {"empty", "", "the token is empty"},
        {"blank", "  \t \nsecond-line\n", "the token is empty"},
        {"control",
         "abc\x01"
         "def\n",
         "non-printable character"},
    };
    char args[2048], path[512];
    write_arr("q.npy", 1, 8, 2, 16, x);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, cases[i].file);
        if (cases[i].content != NULL) {
            FILE *f = fopen(path, "w");
            cr_assert_not_null(f);
            fputs(cases[i].content, f);
            fclose(f);
        }
        snprintf(args, sizeof(args),
                 "submit --coordinator 127.0.0.1:1 --token-file %s --q %s/q.npy --k %s/q.npy "
                 "--v %s/q.npy --out %s/o",
                 path, dir, dir, dir, dir);
        cr_expect_neq(run(args), 0, "%s", cases[i].file);
        char want[600];
        snprintf(want, sizeof(want), "token file '%s'", path);
        const char *err = slurp("stderr");
        cr_expect(strstr(err, want) != NULL && strstr(err, cases[i].want) != NULL, "%s: %s",
                  cases[i].file, err);
        cr_expect(strstr(err, "127.0.0.1:1") == NULL, "%s: tried to connect: %s", cases[i].file,
                  err);
    }
}

Test(stria_run, fp32_causal_gqa_matches_reference, .init = setup, .fini = teardown)
{
    run_and_check(true, "", STRIA_DTYPE_F32, 1e-5);
}

Test(stria_run, bf16_noncausal_matches_reference, .init = setup, .fini = teardown)
{
    /* outputs are rounded to bf16: half an ulp of values below 4 is 2^-7 */
    run_and_check(false, "--dtype bf16", STRIA_DTYPE_BF16, 1.0 / 128);
}

Test(stria_run, random_writes_reproducible_arrays, .init = setup, .fini = teardown)
{
    char args[1024];
    snprintf(args, sizeof(args), "random --shape 1,4,2,16 --seed 7 --out %s/a.npy", dir);
    cr_assert_eq(run(args), 0, "%s", slurp("stderr"));
    snprintf(args, sizeof(args), "random --shape 1,4,2,16 --seed 7 --out %s/b.npy", dir);
    cr_assert_eq(run(args), 0);
    float *a = read_arr("a.npy", 128), *b = read_arr("b.npy", 128);
    cr_expect_eq(memcmp(a, b, 128 * 4), 0);
    stria_free(a);
    stria_free(b);
    snprintf(args, sizeof(args), "random --shape 1,0 --out %s/c.npy", dir);
    cr_expect_eq(run(args), 2);
}

/* Whether `text` has a line starting with "  " + `start` (an option or a
 * command of a generated --help). */
static bool has_line(const char *text, const char *start)
{
    char needle[128];
    snprintf(needle, sizeof(needle), "\n  %s", start);
    return strstr(text, needle) != NULL;
}

Test(stria_run, help_documents_every_command_and_option, .init = setup, .fini = teardown)
{
    static const char *const cmds[] = {"local ", "submit ", "random "};
    static const char *const submit[] = {
        "--coordinator HOST:PORT", "--ranks N", "--layout ", "--check ",  "--token-file FILE",
        "--step-timeout ",         "--label ",  "--q PATH",  "--out DIR", "--dtype "};
    static const char *const random[] = {"--shape B,T,H,D", "--out FILE.npy", "--seed N",
                                         "--amplitude A", "--float16 "};
    cr_assert_eq(run("--help"), 0);
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
        cr_expect(has_line(slurp("stdout"), cmds[i]), "stria-run --help lacks %s:\n%s", cmds[i],
                  slurp("stdout"));
    /* -h and --help of a command: that command's text, every option of it */
    for (int h = 0; h < 2; h++) {
        cr_assert_eq(run(h ? "submit --help" : "submit -h"), 0);
        cr_expect(strstr(slurp("stdout"), "usage: stria-run submit ") != NULL, "%s",
                  slurp("stdout"));
        for (size_t i = 0; i < sizeof(submit) / sizeof(submit[0]); i++)
            cr_expect(has_line(slurp("stdout"), submit[i]), "submit --help lacks %s:\n%s",
                      submit[i], slurp("stdout"));
        cr_expect(!has_line(slurp("stdout"), "--device"), "%s", slurp("stdout"));
    }
    cr_assert_eq(run("local --help"), 0);
    cr_expect(has_line(slurp("stdout"), "--device NAME"), "%s", slurp("stdout"));
    cr_expect(has_line(slurp("stdout"), "--ranks N"), "%s", slurp("stdout"));
    cr_expect(!has_line(slurp("stdout"), "--coordinator"), "%s", slurp("stdout"));
    cr_assert_eq(run("random --help"), 0);
    for (size_t i = 0; i < sizeof(random) / sizeof(random[0]); i++)
        cr_expect(has_line(slurp("stdout"), random[i]), "random --help lacks %s:\n%s", random[i],
                  slurp("stdout"));
    /* the options of one command are not those of another */
    cr_expect_eq(run("local --coordinator 127.0.0.1:1 --q a --k b --v c --out d"), 2);
    cr_expect(strstr(slurp("stderr"), "unknown option '--coordinator'") != NULL, "%s",
              slurp("stderr"));
    cr_expect_eq(run("submit --q a --k b --v c --out d --coordinator nohost"), 2);
    cr_expect(strstr(slurp("stderr"), "--coordinator 'nohost'") != NULL, "%s", slurp("stderr"));
    cr_expect_eq(run("submit --q a --k b --v c --out d --coordinator h:1 --step-timeout 0"), 2);
    cr_expect(strstr(slurp("stderr"), "--step-timeout '0'") != NULL, "%s", slurp("stderr"));
}

Test(stria_run, bad_inputs_get_clear_errors, .init = setup, .fini = teardown)
{
    static float x[2 * 8 * 3 * 16]; /* large enough for every array written below */
    char args[2048];
    write_arr("q.npy", 2, 8, 2, 16, x);
    write_arr("k.npy", 2, 8, 2, 16, x);
    write_arr("k3.npy", 2, 8, 3, 16, x); /* 2 heads are not a multiple of 3 */
    write_arr("short.npy", 2, 7, 2, 16, x);

    cr_expect_eq(run("local --q only.npy"), 2);
    cr_expect(strstr(slurp("stderr"), "--k and --v are required") != NULL);
    cr_expect_eq(run("local --bogus"), 2);
    cr_expect(strstr(slurp("stderr"), "unknown option") != NULL);
    cr_expect_eq(run("frobnicate"), 2);
    cr_expect_eq(run("--help"), 0);
    cr_expect(strstr(slurp("stdout"), "--dtype") != NULL);

    snprintf(args, sizeof(args), "local --q %s/q.npy --k %s/k.npy --v %s/v.npy --out %s/o", dir,
             dir, dir, dir);
    cr_expect_eq(run(args), 1);
    cr_expect(strstr(slurp("stderr"), "v.npy: cannot open") != NULL, "%s", slurp("stderr"));

    snprintf(args, sizeof(args), "local --q %s/q.npy --k %s/k3.npy --v %s/k3.npy --out %s/o", dir,
             dir, dir, dir);
    cr_expect_eq(run(args), 1);
    cr_expect(strstr(slurp("stderr"), "multiple of kv_heads") != NULL, "%s", slurp("stderr"));

    snprintf(args, sizeof(args), "local --q %s/q.npy --k %s/short.npy --v %s/short.npy --out %s/o",
             dir, dir, dir, dir);
    cr_expect_eq(run(args), 1);
    cr_expect(strstr(slurp("stderr"), "must agree") != NULL, "%s", slurp("stderr"));

    snprintf(args, sizeof(args),
             "local --q %s/q.npy --k %s/k.npy --v %s/k.npy --dtype int4 --out %s/o", dir, dir, dir,
             dir);
    cr_expect_eq(run(args), 2);
    cr_expect(strstr(slurp("stderr"), "int4") != NULL);

    /* truncated file */
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "head -c 200 %s/q.npy > %s/trunc.npy", dir, dir);
    cr_assert_eq(system(cmd), 0);
    snprintf(args, sizeof(args), "local --q %s/trunc.npy --k %s/k.npy --v %s/k.npy --out %s/o", dir,
             dir, dir, dir);
    cr_expect_eq(run(args), 1);
    cr_expect(strstr(slurp("stderr"), "truncated") != NULL, "%s", slurp("stderr"));

    /* not a .npy file at all */
    snprintf(cmd, sizeof(cmd), "echo hello > %s/text.npy", dir);
    cr_assert_eq(system(cmd), 0);
    snprintf(args, sizeof(args), "local --q %s/text.npy --k %s/k.npy --v %s/k.npy --out %s/o", dir,
             dir, dir, dir);
    cr_expect_eq(run(args), 1);
    cr_expect(strstr(slurp("stderr"), "bad magic") != NULL, "%s", slurp("stderr"));
}
