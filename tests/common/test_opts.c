/* The option parser of every program (common/opts.c): each value type, lists,
 * commands and positional arguments, configuration files, where values came
 * from, and the generated --help. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stria_common.h"

/* Every value type, in one command. */
static struct {
    const char *name, *addr;
    int64_t count, mem;
    double ratio, wait;
    bool verbose, fast, color;
    stria_int_list_t shape;
    stria_str_list_t tags;
    int parity;
    bool sub_all;
    const char *sub_reason;
} v;

static stria_status_t parse_parity(const char *text, void *dst)
{
    if (strcmp(text, "even") == 0 || strcmp(text, "odd") == 0) {
        *(int *)dst = text[0] == 'e' ? 0 : 1;
        return STRIA_OK;
    }
    return stria_error_set(STRIA_ERR_INVALID_ARG, "expected even or odd");
}

static const stria_option_t opts[] = {
    {.name = "name", .type = STRIA_OPT_STRING, .dst = &v.name, .metavar = "TEXT", .help = "a name"},
    {.name = "addr",
     .type = STRIA_OPT_ADDR,
     .dst = &v.addr,
     .dflt = "127.0.0.1:7400",
     .metavar = "HOST:PORT",
     .help = "an address"},
    {.name = "count",
     .type = STRIA_OPT_INT,
     .dst = &v.count,
     .dflt = "3",
     .min = 1,
     .max = 256,
     .metavar = "N",
     .help = "how many"},
    {.name = "mem", .type = STRIA_OPT_BYTES, .dst = &v.mem, .metavar = "BYTES", .help = "memory"},
    {.name = "ratio",
     .type = STRIA_OPT_DOUBLE,
     .dst = &v.ratio,
     .min = 0,
     .max = INFINITY,
     .flags = STRIA_OPT_ABOVE_MIN,
     .metavar = "X",
     .help = "a ratio"},
    {.name = "wait",
     .type = STRIA_OPT_DURATION,
     .dst = &v.wait,
     .dflt = "1.5",
     .min = 0.001,
     .max = 3600,
     .metavar = "TIME",
     .help = "a wait"},
    {.name = "verbose", .type = STRIA_OPT_BOOL, .dst = &v.verbose, .help = "chatty"},
    {.name = "fast", .type = STRIA_OPT_FLAG, .dst = &v.fast, .help = "hurry"},
    {.name = "no-color", .type = STRIA_OPT_UNFLAG, .dst = &v.color, .help = "plain"},
    {.name = "shape",
     .type = STRIA_OPT_INTS,
     .dst = &v.shape,
     .min = 1,
     .max = 1 << 20,
     .max_items = 4,
     .metavar = "B,T,H,D",
     .help = "a shape"},
    {.name = "tags", .type = STRIA_OPT_STRINGS, .dst = &v.tags, .metavar = "LIST", .help = "tags"},
    {.name = "parity",
     .type = STRIA_OPT_CUSTOM,
     .dst = &v.parity,
     .parse = parse_parity,
     .metavar = "even|odd",
     .help = "a choice"},
    {.name = NULL},
};

static const stria_command_t prog = {
    .name = "prog",
    .description = "A program of every option type.",
    .epilog = "Exit status: 0 or 2.",
    .options = opts,
    .config = true,
};

static stria_cli_t cli;

static void setup(void)
{
    memset(&v, 0, sizeof(v));
    v.color = true;
    memset(&cli, 0, sizeof(cli));
}

static void teardown(void)
{
    stria_cli_free(&cli);
}

/* Parses a NULL-terminated argument list (argv[0] = "prog"). */
static stria_status_t parse_cmd(const stria_command_t *root, const char *const *args)
{
    char *argv[32] = {"prog"};
    int argc = 1;
    while (args[argc - 1] != NULL)
        argv[argc] = (char *)args[argc - 1], argc++;
    stria_cli_free(&cli);
    return stria_cli_parse(root, argc, argv, &cli);
}
#define PARSE(...)       parse_cmd(&prog, (const char *const[]){__VA_ARGS__, NULL})
#define PARSE_NONE()     parse_cmd(&prog, (const char *const[]){NULL})
#define PARSE_IN(r, ...) parse_cmd((r), (const char *const[]){__VA_ARGS__, NULL})

static void expect_error(stria_status_t st, const char *needle)
{
    cr_expect_neq(st, STRIA_OK, "accepted; expected an error with '%s'", needle);
    cr_expect(strstr(stria_error_msg(), needle) != NULL, "'%s' lacks '%s'", stria_error_msg(),
              needle);
}

static char cfg_path[256];

static const char *write_cfg(const char *text)
{
    snprintf(cfg_path, sizeof(cfg_path), "/tmp/stria_opts_%d.conf", (int)getpid());
    FILE *f = fopen(cfg_path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    return cfg_path;
}

TestSuite(opts, .init = setup, .fini = teardown);

Test(opts, defaults_apply_when_nothing_is_given)
{
    cr_assert_eq(PARSE_NONE(), STRIA_OK, "%s", stria_error_msg());
    cr_expect_str_eq(v.addr, "127.0.0.1:7400");
    cr_expect_eq(v.count, 3);
    cr_expect_float_eq(v.wait, 1.5, 1e-12);
    cr_expect_null(v.name);
    cr_expect_eq(stria_cli_from(&cli, "count"), STRIA_OPT_FROM_DEFAULT);
    cr_expect_eq(stria_cli_from(&cli, "name"), STRIA_OPT_FROM_UNSET);
    cr_expect(!stria_cli_given(&cli, "count"));
}

Test(opts, every_type_from_flags)
{
    cr_assert_eq(PARSE("--name", "x", "--addr=[::1]:0", "--count", "256", "--mem", "64M", "--ratio",
                       "0.5", "--wait=500ms", "--verbose", "--fast", "--no-color", "--shape",
                       "1,2048,8,64", "--tags=a,b", "--parity", "odd"),
                 STRIA_OK, "%s", stria_error_msg());
    cr_expect_str_eq(v.name, "x");
    cr_expect_str_eq(v.addr, "[::1]:0");
    cr_expect_eq(v.count, 256);
    cr_expect_eq(v.mem, 64 << 20);
    cr_expect_float_eq(v.ratio, 0.5, 1e-12);
    cr_expect_float_eq(v.wait, 0.5, 1e-12);
    cr_expect(v.verbose && v.fast && !v.color);
    cr_assert_eq(v.shape.n, 4);
    cr_expect(v.shape.v[0] == 1 && v.shape.v[1] == 2048 && v.shape.v[2] == 8 && v.shape.v[3] == 64);
    cr_assert_eq(v.tags.n, 2);
    cr_expect(strcmp(v.tags.v[0], "a") == 0 && strcmp(v.tags.v[1], "b") == 0);
    cr_expect_eq(v.parity, 1);
    cr_expect_eq(stria_cli_from(&cli, "count"), STRIA_OPT_FROM_FLAG);
    cr_expect(stria_cli_given(&cli, "no-color"));
}

Test(opts, booleans_take_words)
{
    cr_assert_eq(PARSE("--verbose=yes"), STRIA_OK);
    cr_expect(v.verbose);
    cr_assert_eq(PARSE("--verbose=0"), STRIA_OK);
    cr_expect(!v.verbose);
    expect_error(PARSE("--verbose=maybe"), "--verbose 'maybe': expected true/false");
    expect_error(PARSE("--fast=1"), "--fast takes no value");
}

Test(opts, byte_sizes_take_powers_of_1024)
{
    static const struct {
        const char *text;
        int64_t want;
    } ok[] = {{"0", 0},
              {"17", 17},
              {"1K", 1024},
              {"2k", 2048},
              {"3M", 3 << 20},
              {"2G", (int64_t)2 << 30},
              {"1T", (int64_t)1 << 40},
              {"8GiB", (int64_t)8 << 30},
              {"4MB", 4 << 20}};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        int64_t got = -1;
        cr_expect_eq(stria_parse_bytes(ok[i].text, &got), STRIA_OK, "%s: %s", ok[i].text,
                     stria_error_msg());
        cr_expect_eq(got, ok[i].want, "%s: %lld", ok[i].text, (long long)got);
    }
    const char *bad[] = {"", "2X", "K", "-1", "1.5G", " 3", "2GG", "8191P", "1Mi"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int64_t got = 0;
        cr_expect_neq(stria_parse_bytes(bad[i], &got), STRIA_OK, "'%s' accepted", bad[i]);
    }
}

Test(opts, byte_sizes_overflow_is_refused)
{
    int64_t got = 0;
    cr_expect_eq(stria_parse_bytes("8388607T", &got), STRIA_OK); /* 2^63 - 2^40 */
    cr_expect_eq(got, (int64_t)8388607 << 40);
    expect_error(stria_parse_bytes("8388608T", &got), "too large");
    expect_error(stria_parse_bytes("8589934592G", &got), "too large");
    expect_error(stria_parse_bytes("9223372036854775808", &got), "expected a size");
    cr_expect_eq(stria_parse_bytes("9223372036854775807", &got), STRIA_OK);
    expect_error(PARSE("--mem", "2X"), "--mem '2X': unknown size suffix");
}

Test(opts, durations_take_units)
{
    static const struct {
        const char *text;
        double want;
    } ok[] = {{"2", 2},     {"2s", 2},         {"500ms", 0.5}, {"1.5m", 90},
              {"1h", 3600}, {"250us", 250e-6}, {"0.25", 0.25}};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        double got = -1;
        cr_expect_eq(stria_parse_duration(ok[i].text, &got), STRIA_OK, "%s", ok[i].text);
        cr_expect_float_eq(got, ok[i].want, 1e-12, "%s: %g", ok[i].text, got);
    }
    const char *bad[] = {"", "fast", "2 s", "2x", "1d", "inf", "nan", "s"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        double got = 0;
        cr_expect_neq(stria_parse_duration(bad[i], &got), STRIA_OK, "'%s' accepted", bad[i]);
    }
    expect_error(PARSE("--wait", "2h"), "--wait '2h': must be in 0.001..3600");
}

Test(opts, numbers_are_checked_against_their_range)
{
    expect_error(PARSE("--count", "0"), "--count '0': must be in 1..256");
    expect_error(PARSE("--count", "257"), "must be in 1..256");
    expect_error(PARSE("--count", "12abc"), "--count '12abc': expected an integer");
    expect_error(PARSE("--count", "99999999999999999999"), "expected an integer");
    expect_error(PARSE("--ratio", "0"), "--ratio '0': must be > 0");
    expect_error(PARSE("--ratio", "inf"), "expected a number");
    cr_expect_eq(PARSE("--ratio", "1e-9"), STRIA_OK);
    cr_expect_eq(PARSE("--count", "1"), STRIA_OK);
}

Test(opts, lists_are_checked_item_by_item)
{
    expect_error(PARSE("--shape", "1,0,2"), "--shape '1,0,2': item 2 '0': must be in");
    expect_error(PARSE("--shape", "1,,2"), "item 2 of the list is empty");
    expect_error(PARSE("--shape", "1,2,3,4,5"), "at most 4");
    expect_error(PARSE("--shape", "1,x"), "item 2 'x': expected an integer");
    expect_error(PARSE("--tags", "a,"), "empty");
    cr_assert_eq(PARSE("--shape", "7"), STRIA_OK);
    cr_expect_eq(v.shape.n, 1);
    cr_expect_eq(v.shape.v[0], 7);
}

Test(opts, addresses_are_validated)
{
    expect_error(PARSE("--addr", "nohost"),
                 "--addr 'nohost': address 'nohost': expected HOST:PORT");
    expect_error(PARSE("--addr", "::1:80"), "brackets");
    expect_error(PARSE("--addr", "h:70000"), "0..65535");
    cr_expect_eq(PARSE("--addr", "example.org:80"), STRIA_OK);
}

Test(opts, custom_values_name_the_option)
{
    expect_error(PARSE("--parity", "3"), "--parity '3': expected even or odd");
}

Test(opts, unknown_options_and_missing_values)
{
    expect_error(PARSE("--bogus"), "unknown option '--bogus'");
    expect_error(PARSE("--bogus=1"), "unknown option '--bogus'");
    expect_error(PARSE("-x"), "unknown option '-x'");
    expect_error(PARSE("--count"), "--count needs a value (N)");
    expect_error(PARSE("stray"), "unexpected argument 'stray'");
    /* a value that looks like an option is still the value */
    expect_error(PARSE("--count", "-4"), "--count '-4': must be in 1..256");
    expect_error(PARSE("--config"), "--config needs a value");
}

Test(opts, later_flags_win_and_flags_override_the_file)
{
    const char *p = write_cfg("# a comment\n\ncount = 9   # trailing\nmem=1G\nverbose = yes\n"
                              "name = from-file\n");
    cr_assert_eq(PARSE("--count", "5", "--config", p, "--count=6", "--verbose=no"), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(v.count, 6);
    cr_expect_eq(v.mem, (int64_t)1 << 30);
    cr_expect(!v.verbose);
    cr_expect_str_eq(v.name, "from-file");
    cr_expect_str_eq(cli.config_path, p);
    unlink(p);
}

Test(opts, origins_name_the_flag_the_file_line_or_the_default)
{
    const char *p = write_cfg("count = 9\n\nmem = 2G\n");
    char buf[512], want[300];
    cr_assert_eq(PARSE("--config=", "--name", "n"), STRIA_ERR_IO); /* empty path */
    cr_assert_eq(PARSE("--config", p, "--name", "n"), STRIA_OK, "%s", stria_error_msg());
    snprintf(want, sizeof(want), "%s:1: --count", p);
    cr_expect_str_eq(stria_cli_origin(&cli, "count", buf, sizeof(buf)), want);
    snprintf(want, sizeof(want), "%s:3: --mem", p);
    cr_expect_str_eq(stria_cli_origin(&cli, "mem", buf, sizeof(buf)), want);
    cr_expect_str_eq(stria_cli_origin(&cli, "name", buf, sizeof(buf)), "--name");
    cr_expect_str_eq(stria_cli_origin(&cli, "wait", buf, sizeof(buf)), "--wait (default)");
    cr_expect_eq(stria_cli_from(&cli, "count"), STRIA_OPT_FROM_FILE);
    cr_expect_eq(stria_cli_from(&cli, "name"), STRIA_OPT_FROM_FLAG);
    cr_expect_eq(stria_cli_from(&cli, "wait"), STRIA_OPT_FROM_DEFAULT);
    cr_expect_eq(stria_cli_from(&cli, "ratio"), STRIA_OPT_FROM_UNSET);
    stria_error_set(STRIA_ERR_INVALID_ARG, "too big");
    cr_expect_eq(stria_cli_wrap(&cli, "mem", STRIA_ERR_INVALID_ARG), STRIA_ERR_INVALID_ARG);
    snprintf(want, sizeof(want), "%s:3: --mem: too big", p);
    cr_expect_str_eq(stria_error_msg(), want);
    stria_log_set_level(STRIA_LOG_INFO);
    stria_cli_log(&cli); /* exercised under ASan: every kind of value */
    stria_log_set_level(STRIA_LOG_ERROR);
    unlink(p);
}

Test(opts, a_bad_file_names_the_file_and_line)
{
    char want[300];
    const char *p = write_cfg("count = 2\nmem = 2X\n");
    snprintf(want, sizeof(want), "%s:2: --mem '2X': unknown size suffix", p);
    expect_error(PARSE("--config", p), want);
    write_cfg("count = 2\n\ncolour = blue\n");
    snprintf(want, sizeof(want), "%s:3: unknown setting 'colour'", p);
    expect_error(PARSE("--config", p), want);
    write_cfg("this is not a setting\n");
    snprintf(want, sizeof(want), "%s:1: expected 'name = value'", p);
    expect_error(PARSE("--config", p), want);
    write_cfg("fast = true\n"); /* flags are not settings */
    expect_error(PARSE("--config", p), "unknown setting 'fast'");
    write_cfg("wait = 2h\n");
    snprintf(want, sizeof(want), "%s:1: --wait '2h': must be in", p);
    expect_error(PARSE("--config", p), want);
    unlink(p);
    cr_expect_eq(PARSE("--config", "/nonexistent/x.conf"), STRIA_ERR_IO);
    cr_expect(strstr(stria_error_msg(), "cannot open configuration file") != NULL);
}

Test(opts, comments_start_with_a_hash)
{
    const char *p = write_cfg("# count = 100\ncount = 4 # = 5\n");
    cr_assert_eq(PARSE("--config", p), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(v.count, 4);
    unlink(p);
}

Test(opts, config_strings_outlive_the_file)
{
    const char *p = write_cfg("name = long-name-from-the-file\ntags = x,yy\n");
    cr_assert_eq(PARSE("--config", p), STRIA_OK);
    unlink(p);
    cr_expect_str_eq(v.name, "long-name-from-the-file");
    cr_assert_eq(v.tags.n, 2);
    cr_expect_str_eq(v.tags.v[1], "yy");
}

/* ---- commands ----------------------------------------------------------------------- */

static bool g_json;
static const char *g_coord;
static int64_t g_sub_count;

static const stria_option_t root_opts[] = {
    {.name = "json", .type = STRIA_OPT_FLAG, .dst = &g_json, .help = "machine output"},
    {.name = "coordinator",
     .type = STRIA_OPT_ADDR,
     .dst = &g_coord,
     .metavar = "HOST:PORT",
     .help = "where"},
    {.name = NULL},
};
static const stria_option_t cancel_opts[] = {
    {.name = "reason",
     .type = STRIA_OPT_STRING,
     .dst = &v.sub_reason,
     .metavar = "TEXT",
     .help = "why it is cancelled"},
    {.name = NULL},
};
static const char *g_in, *g_out;
static const stria_option_t run_opts[] = {
    {.name = "count",
     .type = STRIA_OPT_INT,
     .dst = &g_sub_count,
     .min = 1,
     .max = 9,
     .flags = STRIA_OPT_REQUIRED,
     .metavar = "N",
     .help = "runs"},
    {.name = "in", .type = STRIA_OPT_STRING, .dst = &g_in, .flags = STRIA_OPT_REQUIRED},
    {.name = "out", .type = STRIA_OPT_STRING, .dst = &g_out, .flags = STRIA_OPT_REQUIRED},
    {.name = NULL},
};
static const stria_command_t cmds[] = {
    {.name = "cancel",
     .summary = "stop a job",
     .args = "JOB",
     .min_args = 1,
     .max_args = 1,
     .options = cancel_opts},
    {.name = "list", .summary = "every job", .args = "[NAME...]", .max_args = -1},
    {.name = "run", .summary = "run something", .options = run_opts},
    {.name = NULL},
};
static const stria_command_t ctl = {.name = "ctl",
                                    .description = "A program with commands.",
                                    .options = root_opts,
                                    .commands = cmds};

Test(opts, commands_take_their_options_and_the_programs)
{
    g_json = false;
    cr_assert_eq(PARSE_IN(&ctl, "cancel", "7", "--reason", "maintenance", "--json"), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_str_eq(cli.cmd->name, "cancel");
    cr_expect_eq(cli.depth, 2);
    cr_assert_eq(cli.nargs, 1);
    cr_expect_str_eq(cli.args[0], "7");
    cr_expect_str_eq(v.sub_reason, "maintenance");
    cr_expect(g_json);
    cr_assert_eq(PARSE_IN(&ctl, "--coordinator", "h:1", "--reason=x", "cancel", "8"),
                 STRIA_ERR_INVALID_ARG); /* a command's option before the command */
    cr_assert_eq(PARSE_IN(&ctl, "--coordinator", "h:1", "cancel", "--reason=x", "8"), STRIA_OK);
    cr_expect_str_eq(g_coord, "h:1");
    cr_expect_str_eq(cli.args[0], "8");
}

Test(opts, positional_arguments_are_counted)
{
    expect_error(PARSE_IN(&ctl, "cancel"), "missing argument: JOB");
    expect_error(PARSE_IN(&ctl, "cancel", "1", "2"), "unexpected argument '2'");
    cr_assert_eq(PARSE_IN(&ctl, "list", "a", "b", "c"), STRIA_OK);
    cr_expect_eq(cli.nargs, 3);
    cr_assert_eq(PARSE_IN(&ctl, "list", "--", "--not-an-option"), STRIA_OK);
    cr_expect_str_eq(cli.args[0], "--not-an-option");
    expect_error(PARSE_IN(&ctl, "frobnicate"), "unknown command 'frobnicate' (expected: cancel, "
                                               "list, run)");
    expect_error(PARSE_IN(&ctl, "--json"), "missing command");
}

Test(opts, required_options_must_be_given)
{
    expect_error(PARSE_IN(&ctl, "run"), "--count, --in and --out are required");
    expect_error(PARSE_IN(&ctl, "run", "--in", "x"), "--count and --out are required");
    expect_error(PARSE_IN(&ctl, "run", "--in", "x", "--out", "y"), "--count N is required");
    cr_expect_eq(PARSE_IN(&ctl, "run", "--count", "2", "--in=a", "--out=b"), STRIA_OK);
    cr_expect_eq(g_sub_count, 2);
}

Test(opts, help_stops_at_the_command_it_follows)
{
    cr_assert_eq(PARSE_IN(&ctl, "run", "--help"), STRIA_OK); /* --count not required for help */
    cr_expect(cli.help);
    cr_expect_str_eq(cli.cmd->name, "run");
    cr_assert_eq(PARSE_IN(&ctl, "-h"), STRIA_OK);
    cr_expect(cli.help);
    cr_expect_eq(cli.depth, 1);
}

/* The help text of `args` (parsed with --help appended). */
static char *help_of(const stria_command_t *root, const char *const *args)
{
    char *text = NULL;
    size_t len = 0;
    cr_assert_eq(parse_cmd(root, args), STRIA_OK, "%s", stria_error_msg());
    cr_assert(cli.help);
    FILE *f = open_memstream(&text, &len);
    stria_cli_help(&cli, f);
    fclose(f);
    return text;
}

Test(opts, help_lists_every_option_with_its_value_name_and_default)
{
    char *h = help_of(&prog, (const char *const[]){"--help", NULL});
    for (const stria_option_t *o = opts; o->name != NULL; o++) {
        char line[128];
        snprintf(line, sizeof(line), "\n  --%s%s%s", o->name, o->metavar ? " " : "",
                 o->metavar ? o->metavar : "");
        cr_expect(strstr(h, line) != NULL, "help lacks '%s':\n%s", line + 1, h);
    }
    cr_expect(strstr(h, "usage: prog [options]\n") != NULL, "%s", h);
    cr_expect(strstr(h, "A program of every option type.") != NULL);
    cr_expect(strstr(h, "how many (default 3)") != NULL, "%s", h);
    cr_expect(strstr(h, "  --config FILE") != NULL);
    cr_expect(strstr(h, "-h, --help") != NULL);
    cr_expect(strstr(h, "powers of 1024") != NULL, "%s", h);
    cr_expect(strstr(h, "500ms, 2s, 1.5m, 1h") != NULL, "%s", h);
    cr_expect(strstr(h, "Exit status: 0 or 2.") != NULL);
    free(h);
}

Test(opts, help_of_a_program_lists_its_commands)
{
    char *h = help_of(&ctl, (const char *const[]){"--help", NULL});
    cr_expect(strstr(h, "usage: ctl COMMAND [options]") != NULL, "%s", h);
    for (const stria_command_t *c = cmds; c->name != NULL; c++) {
        char line[128];
        snprintf(line, sizeof(line), "\n  %s ", c->name);
        cr_expect(strstr(h, line) != NULL && strstr(h, c->summary) != NULL, "%s lacks %s", h,
                  c->name);
    }
    free(h);
    h = help_of(&ctl, (const char *const[]){"cancel", "-h", NULL});
    cr_expect(strstr(h, "usage: ctl cancel [options] JOB") != NULL, "%s", h);
    cr_expect(strstr(h, "  --reason TEXT") != NULL, "%s", h);
    cr_expect(strstr(h, "options of ctl") != NULL && strstr(h, "  --json") != NULL, "%s", h);
    free(h);
    h = help_of(&ctl, (const char *const[]){"run", "--help", NULL});
    cr_expect(strstr(h, "usage: ctl run --count N --in VALUE --out VALUE [options]") != NULL, "%s",
              h);
    cr_expect(strstr(h, "runs (required)") != NULL, "%s", h);
    free(h);
}

Test(opts, main_returns_2_on_usage_errors_and_0_for_help)
{
    char *argv1[] = {"ctl", "--bogus", "list", NULL};
    cr_expect_eq(stria_cli_main(&ctl, 3, argv1, &cli), 2);
    stria_cli_free(&cli);
    char *argv2[] = {"ctl", "list", NULL};
    cr_expect_eq(stria_cli_main(&ctl, 2, argv2, &cli), -1);
    stria_cli_free(&cli);
    char *argv3[] = {"ctl", NULL};
    cr_expect_eq(stria_cli_main(&ctl, 1, argv3, &cli), 2);
}
