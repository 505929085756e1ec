/*
 * Options of every program: one table per command (stria_command_t) parses
 * the flags, the configuration file's `name = value` lines and generates the
 * --help text; each value remembers where it came from.
 */
#include "stria_opts.h"
#include "stria_log.h"
#include "stria_net.h"
#include "stria_util.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One option of the parsed command path and where its value came from. */
struct stria_cli_state {
    const stria_option_t *o;
    stria_opt_from_t from;
    const char *text; /* the value as given (argv, a copy of the file's, dflt) */
    const char *file;
    int line;
};

/* ---- values ------------------------------------------------------------------ */

stria_status_t stria_parse_bytes(const char *text, int64_t *out)
{
    static const char units[] = "KMGT";
    char *end;
    const char *u;
    int shift = 0;

    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno != 0 || end == text || v < 0 || !isdigit((unsigned char)text[0]))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "expected a size in bytes with an optional K, M, G or T suffix "
                               "(powers of 1024)");
    if (*end != '\0') {
        u = strchr(units, toupper((unsigned char)*end));
        if (u == NULL || *u == '\0')
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "unknown size suffix '%s' (K, M, G or T: powers of 1024)", end);
        shift = 10 * (int)(u - units + 1);
        if (strcmp(end + 1, "") != 0 && strcasecmp(end + 1, "iB") != 0 &&
            strcasecmp(end + 1, "B") != 0)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "unknown size suffix '%s' (K, M, G or T: powers of 1024)", end);
    }
    if (v > (INT64_MAX >> shift))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "too large (at most 2^63 - 1 bytes)");
    *out = (int64_t)v << shift;
    return STRIA_OK;
}

stria_status_t stria_parse_duration(const char *text, double *out)
{
    static const struct {
        const char *suffix;
        double seconds;
    } units[] = {{"", 1}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1}, {"m", 60}, {"h", 3600}};
    char *end;

    errno = 0;
    double v = strtod(text, &end);
    if (errno == 0 && end != text && isfinite(v) && !isspace((unsigned char)text[0]))
        for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++)
            if (strcmp(end, units[i].suffix) == 0 && isfinite(v * units[i].seconds)) {
                *out = v * units[i].seconds;
                return STRIA_OK;
            }
    return stria_error_set(STRIA_ERR_INVALID_ARG,
                           "expected a duration: a number with an optional unit ms, s, m or h "
                           "(500ms, 2s, 1.5m, 1h; no unit: seconds)");
}

static void *stria__cli_alloc(stria_cli_t *cli, size_t size)
{
    void *p;
    void **a = stria_grow(cli->allocs, &cli->cap_allocs, cli->n_allocs + 1, sizeof(*a), 16);
    if (a == NULL)
        return NULL;
    cli->allocs = a;
    p = calloc(1, size ? size : 1);
    if (p != NULL)
        cli->allocs[cli->n_allocs++] = p;
    return p;
}

static char *stria__cli_strdup(stria_cli_t *cli, const char *s)
{
    char *p = stria__cli_alloc(cli, strlen(s) + 1);
    if (p != NULL)
        strcpy(p, s);
    return p;
}

static stria_status_t stria__range(const stria_option_t *o, double v)
{
    bool above = (o->flags & STRIA_OPT_ABOVE_MIN) != 0;
    if (!(o->min < o->max) || ((above ? v > o->min : v >= o->min) && v <= o->max))
        return STRIA_OK;
    if (isinf(o->max))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "must be %s %.15g",
                               above ? ">" : ">=", o->min);
    if (above)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "must be > %.15g and <= %.15g", o->min,
                               o->max);
    return stria_error_set(STRIA_ERR_INVALID_ARG, "must be in %.15g..%.15g", o->min, o->max);
}

static stria_status_t stria__int(const stria_option_t *o, const char *text, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0')
        return stria_error_set(STRIA_ERR_INVALID_ARG, "expected an integer");
    *out = v;
    return stria__range(o, (double)v);
}

static stria_status_t stria__list(stria_cli_t *cli, const stria_option_t *o, const char *text)
{
    char *copy = stria__cli_strdup(cli, text);
    size_t n = 1;
    if (copy == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    for (const char *p = text; *p; p++)
        n += *p == ',';
    if (o->max_items > 0 && n > o->max_items)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "at most %zu comma-separated items",
                               o->max_items);
    bool ints = o->type == STRIA_OPT_INTS;
    void *arr = stria__cli_alloc(cli, n * (ints ? sizeof(int64_t) : sizeof(char *)));
    if (arr == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    char *item = copy;
    for (size_t i = 0; i < n; i++) {
        char *comma = strchr(item, ',');
        if (comma != NULL)
            *comma = '\0';
        if (*item == '\0')
            return stria_error_set(STRIA_ERR_INVALID_ARG, "item %zu of the list is empty", i + 1);
        if (ints) {
            stria_status_t st = stria__int(o, item, (int64_t *)arr + i);
            if (st != STRIA_OK)
                return stria_error_wrap(st, "item %zu '%s'", i + 1, item);
        } else {
            ((const char **)arr)[i] = item;
        }
        if (comma == NULL)
            break;
        item = comma + 1;
    }
    if (ints)
        *(stria_int_list_t *)o->dst = (stria_int_list_t){n, arr};
    else
        *(stria_str_list_t *)o->dst = (stria_str_list_t){n, arr};
    return STRIA_OK;
}

static stria_status_t stria__bool(const char *text, bool *out)
{
    static const char *const yes[] = {"true", "yes", "1"}, *const no[] = {"false", "no", "0"};
    for (int i = 0; i < 3; i++) {
        if (strcmp(text, yes[i]) == 0 || strcmp(text, no[i]) == 0) {
            *out = strcmp(text, yes[i]) == 0;
            return STRIA_OK;
        }
    }
    return stria_error_set(STRIA_ERR_INVALID_ARG, "expected true/false, yes/no or 1/0");
}

/* Parses `text` (NULL: a bare flag) into the option's destination. The
 * message says what is wrong with the value; the caller names the option. */
static stria_status_t stria__value(stria_cli_t *cli, const stria_option_t *o, const char *text)
{
    char host[256];
    uint16_t port;
    stria_status_t st;
    double d;

    switch (o->type) {
    case STRIA_OPT_FLAG:
    case STRIA_OPT_UNFLAG:
        *(bool *)o->dst = o->type == STRIA_OPT_FLAG;
        return STRIA_OK;
    case STRIA_OPT_BOOL:
        return text == NULL ? (*(bool *)o->dst = true, STRIA_OK) : stria__bool(text, o->dst);
    case STRIA_OPT_STRING:
        *(const char **)o->dst = text;
        return STRIA_OK;
    case STRIA_OPT_ADDR:
        st = stria_addr_parse(text, host, sizeof(host), &port);
        if (st == STRIA_OK)
            *(const char **)o->dst = text;
        return st;
    case STRIA_OPT_INT:
        return stria__int(o, text, o->dst);
    case STRIA_OPT_BYTES: {
        int64_t v;
        st = stria_parse_bytes(text, &v);
        if (st == STRIA_OK && (st = stria__range(o, (double)v)) == STRIA_OK)
            *(int64_t *)o->dst = v;
        return st;
    }
    case STRIA_OPT_DOUBLE:
    case STRIA_OPT_DURATION: {
        char *end;
        errno = 0;
        d = strtod(text, &end);
        if (o->type == STRIA_OPT_DURATION)
            st = stria_parse_duration(text, &d);
        else if (errno != 0 || end == text || *end != '\0' || !isfinite(d))
            st = stria_error_set(STRIA_ERR_INVALID_ARG, "expected a number");
        else
            st = STRIA_OK;
        if (st == STRIA_OK && (st = stria__range(o, d)) == STRIA_OK)
            *(double *)o->dst = d;
        return st;
    }
    case STRIA_OPT_INTS:
    case STRIA_OPT_STRINGS:
        return stria__list(cli, o, text);
    case STRIA_OPT_CUSTOM:
        return o->parse(text, o->dst);
    }
    return stria_error_set(STRIA_ERR_INTERNAL, "bad option type %d", (int)o->type);
}

static bool stria__takes_value(const stria_option_t *o)
{
    return o->type != STRIA_OPT_FLAG && o->type != STRIA_OPT_UNFLAG && o->type != STRIA_OPT_BOOL;
}

/* Sets state `s` from `text`; from FILE, `text` is copied. */
static stria_status_t stria__set(stria_cli_t *cli, struct stria_cli_state *s, const char *text,
                                 stria_opt_from_t from, const char *file, int line)
{
    const stria_option_t *o = s->o;
    if (text != NULL && !stria__takes_value(o) && o->type != STRIA_OPT_BOOL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s takes no value", o->name);
    if (text == NULL && stria__takes_value(o))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s needs a value (%s)", o->name,
                               o->metavar ? o->metavar : "VALUE");
    if (text != NULL && from == STRIA_OPT_FROM_FILE &&
        (text = stria__cli_strdup(cli, text)) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    stria_status_t st = stria__value(cli, o, text);
    if (st != STRIA_OK) {
        if (text != NULL)
            return stria_error_wrap(st, "--%s '%s'", o->name, text);
        return stria_error_wrap(st, "--%s", o->name);
    }
    s->from = from;
    s->text = text;
    s->file = file;
    s->line = line;
    return STRIA_OK;
}

/* ---- the command path and its options --------------------------------------- */

static struct stria_cli_state *stria__opt_find(const stria_cli_t *cli, const char *name, size_t len)
{
    /* the innermost command's options first: they may shadow the program's */
    for (size_t i = cli->n_state; i-- > 0;)
        if (strlen(cli->state[i].o->name) == len && strncmp(cli->state[i].o->name, name, len) == 0)
            return &cli->state[i];
    return NULL;
}

static bool stria__has_config(const stria_cli_t *cli)
{
    for (int d = 0; d < cli->depth; d++)
        if (cli->path[d]->config)
            return true;
    return false;
}

/* Enters command `c`: its options join the state, their defaults applied. */
static stria_status_t stria__enter(stria_cli_t *cli, const stria_command_t *c)
{
    size_t n = 0;
    if (cli->depth == STRIA_CLI_MAX_DEPTH)
        return stria_error_set(STRIA_ERR_INTERNAL, "commands nested too deep");
    cli->path[cli->depth++] = c;
    cli->cmd = c;
    while (c->options != NULL && c->options[n].name != NULL)
        n++;
    struct stria_cli_state *s = realloc(cli->state, (cli->n_state + n + 1) * sizeof(*s));
    if (s == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    cli->state = s;
    for (size_t i = 0; i < n; i++) {
        struct stria_cli_state *e = &cli->state[cli->n_state++];
        memset(e, 0, sizeof(*e));
        e->o = &c->options[i];
        if (e->o->dflt != NULL && stria__set(cli, e, e->o->dflt, STRIA_OPT_FROM_DEFAULT, NULL, 0))
            return stria_error_wrap(STRIA_ERR_INTERNAL, "default of %s", c->name);
    }
    return STRIA_OK;
}

static const stria_command_t *stria__subcommand(const stria_command_t *c, const char *name)
{
    for (const stria_command_t *s = c->commands; s != NULL && s->name != NULL; s++)
        if (strcmp(s->name, name) == 0)
            return s;
    return NULL;
}

static stria_status_t stria__unknown_command(const stria_cli_t *cli, const char *name)
{
    char list[512] = "";
    size_t len = 0;
    for (const stria_command_t *s = cli->cmd->commands; s->name != NULL; s++)
        len += (size_t)snprintf(list + len, len < sizeof(list) ? sizeof(list) - len : 0, "%s%s",
                                len ? ", " : "", s->name);
    return stria_error_set(STRIA_ERR_INVALID_ARG, "unknown command '%s' (expected: %s)", name,
                           list);
}

/* ---- configuration files ------------------------------------------------------ */

static char *stria__trim(char *s)
{
    char *end;
    while (isspace((unsigned char)*s))
        s++;
    end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        *--end = '\0';
    return s;
}

/* One line of a configuration file; `path` and `lineno` for messages. */
static stria_status_t stria__file_line(stria_cli_t *cli, char *line, const char *path, int lineno)
{
    char *comment = strchr(line, '#');
    if (comment != NULL)
        *comment = '\0';
    char *s = stria__trim(line);
    if (*s == '\0')
        return STRIA_OK;
    char *eq = strchr(s, '=');
    if (eq == NULL)
        return stria_error_set(STRIA_ERR_FORMAT, "%s:%d: expected 'name = value', got '%s'", path,
                               lineno, s);
    *eq = '\0';
    char *key = stria__trim(s);
    struct stria_cli_state *e = stria__opt_find(cli, key, strlen(key));
    if (e == NULL || (!stria__takes_value(e->o) && e->o->type != STRIA_OPT_BOOL) ||
        (e->o->flags & STRIA_OPT_FLAG_ONLY))
        return stria_error_set(STRIA_ERR_FORMAT, "%s:%d: unknown setting '%s'", path, lineno, key);
    stria_status_t st = stria__set(cli, e, stria__trim(eq + 1), STRIA_OPT_FROM_FILE, path, lineno);
    return st == STRIA_OK ? st : stria_error_wrap(st, "%s:%d", path, lineno);
}

static stria_status_t stria__load_file(stria_cli_t *cli, const char *path)
{
    FILE *f = fopen(path, "r");
    char line[4096];
    int lineno = 0;
    stria_status_t st = STRIA_OK;

    if (f == NULL)
        return stria_error_set(STRIA_ERR_IO, "%s: cannot open configuration file: %s", path,
                               strerror(errno));
    while (st == STRIA_OK && fgets(line, sizeof(line), f) != NULL) {
        lineno++;
        size_t n = strlen(line);
        if (n == sizeof(line) - 1 && line[n - 1] != '\n')
            st = stria_error_set(STRIA_ERR_FORMAT, "%s:%d: line longer than %zu bytes", path,
                                 lineno, sizeof(line) - 2);
        else
            st = stria__file_line(cli, line, path, lineno);
    }
    if (st == STRIA_OK && ferror(f))
        st = stria_error_set(STRIA_ERR_IO, "%s: read error", path);
    fclose(f);
    return st;
}

/* ---- argv ---------------------------------------------------------------------- */

/* One `--name[=value]` argument at argv[*i]; consumes the value's argument.
 * apply: set the value (the second pass), else only find the option and
 * --config / --help (the first pass). */
static stria_status_t stria__flag(stria_cli_t *cli, int argc, char **argv, int *i, bool apply)
{
    const char *name = argv[*i] + 2, *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    const char *value = eq ? eq + 1 : NULL;

    if (len == 4 && strncmp(name, "help", 4) == 0) {
        cli->help = true;
        return STRIA_OK;
    }
    if (len == 6 && strncmp(name, "config", 6) == 0 && stria__has_config(cli)) {
        if (value == NULL && ++*i >= argc)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "--config needs a value (FILE)");
        cli->config_path = value ? value : argv[*i];
        return STRIA_OK;
    }
    struct stria_cli_state *e = stria__opt_find(cli, name, len);
    if (e == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "unknown option '--%.*s'", (int)len, name);
    if (value == NULL && stria__takes_value(e->o)) {
        if (*i + 1 >= argc)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s needs a value (%s)", e->o->name,
                                   e->o->metavar ? e->o->metavar : "VALUE");
        value = argv[++*i];
    }
    return apply ? stria__set(cli, e, value, STRIA_OPT_FROM_FLAG, NULL, 0) : STRIA_OK;
}

/* A pass over argv[1..argc): the first enters the commands named and finds
 * --config and --help; the second sets the flags and collects positional
 * arguments. */
static stria_status_t stria__pass(stria_cli_t *cli, int argc, char **argv, bool apply)
{
    bool options = true;
    int depth = 1;
    stria_status_t st;

    for (int i = 1; i < argc && !cli->help; i++) {
        const char *a = argv[i];
        if (options && strcmp(a, "--") == 0) {
            options = false;
        } else if (options && strcmp(a, "-h") == 0) {
            cli->help = true;
        } else if (options && a[0] == '-' && a[1] == '-') {
            if ((st = stria__flag(cli, argc, argv, &i, apply)) != STRIA_OK)
                return st;
        } else if (options && a[0] == '-' && a[1] != '\0') {
            return stria_error_set(STRIA_ERR_INVALID_ARG, "unknown option '%s'", a);
        } else if (cli->path[depth - 1]->commands != NULL && cli->nargs == 0) {
            /* a command name: entered in the first pass */
            if (!apply) {
                const stria_command_t *c = stria__subcommand(cli->cmd, a);
                if (c == NULL)
                    return stria__unknown_command(cli, a);
                if ((st = stria__enter(cli, c)) != STRIA_OK)
                    return st;
            }
            depth++;
        } else if (apply) {
            cli->args[cli->nargs++] = argv[i];
        }
    }
    return STRIA_OK;
}

static stria_status_t stria__check(stria_cli_t *cli)
{
    const stria_command_t *c = cli->cmd;
    if (c->commands != NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "missing command");
    if (cli->nargs < c->min_args || (c->max_args >= 0 && cli->nargs > c->max_args)) {
        if (cli->nargs > c->max_args && c->max_args >= 0)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "unexpected argument '%s'",
                                   cli->args[c->max_args]);
        return stria_error_set(STRIA_ERR_INVALID_ARG, "missing argument%s: %s",
                               c->min_args > 1 ? "s" : "", c->args ? c->args : "");
    }
    /* every missing one in one message: "--q, --k and --v are required" */
    const stria_option_t *missing[8];
    size_t n = 0;
    for (size_t i = 0; i < cli->n_state && n < 8; i++)
        if ((cli->state[i].o->flags & STRIA_OPT_REQUIRED) &&
            cli->state[i].from < STRIA_OPT_FROM_FLAG)
            missing[n++] = cli->state[i].o;
    if (n == 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s %s is required", missing[0]->name,
                               missing[0]->metavar ? missing[0]->metavar : "VALUE");
    if (n > 1) {
        char list[512];
        size_t len = 0;
        for (size_t i = 0; i < n; i++)
            len +=
                (size_t)snprintf(list + len, len < sizeof(list) ? sizeof(list) - len : 0, "%s--%s",
                                 i == 0      ? ""
                                 : i + 1 < n ? ", "
                                             : " and ",
                                 missing[i]->name);
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s are required", list);
    }
    return STRIA_OK;
}

stria_status_t stria_cli_parse(const stria_command_t *root, int argc, char **argv, stria_cli_t *cli)
{
    stria_status_t st;

    memset(cli, 0, sizeof(*cli));
    cli->args = stria__cli_alloc(cli, (size_t)(argc > 0 ? argc : 1) * sizeof(char *));
    if (cli->args == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    if ((st = stria__enter(cli, root)) != STRIA_OK ||
        (st = stria__pass(cli, argc, argv, false)) != STRIA_OK || cli->help)
        return st;
    if (cli->config_path != NULL && (st = stria__load_file(cli, cli->config_path)) != STRIA_OK)
        return st;
    if ((st = stria__pass(cli, argc, argv, true)) != STRIA_OK)
        return st;
    return stria__check(cli);
}

/* ---- help ------------------------------------------------------------------------ */

#define STRIA__HELP_COL   30
#define STRIA__HELP_WIDTH 100

/* Prints `text` from column `col` (the cursor is there), wrapping at words
 * to STRIA__HELP_WIDTH with continuation lines indented to `col`. */
static void stria__wrap(FILE *out, const char *text, int col)
{
    int x = col;
    while (*text != '\0') {
        size_t word = strcspn(text, " \n");
        if (x > col && x + 1 + (int)word > STRIA__HELP_WIDTH) {
            fprintf(out, "\n%*s", col, "");
            x = col;
        } else if (x > col) {
            fputc(' ', out);
            x++;
        }
        fprintf(out, "%.*s", (int)word, text);
        x += (int)word;
        text += word;
        while (*text == ' ' || *text == '\n')
            text++;
    }
    fputc('\n', out);
}

static void stria__help_option(FILE *out, const stria_option_t *o)
{
    char left[128], right[1024];
    snprintf(left, sizeof(left), "--%s%s%s", o->name, o->metavar ? " " : "",
             o->metavar ? o->metavar : "");
    snprintf(right, sizeof(right), "%s%s%s%s%s", o->help ? o->help : "",
             (o->flags & STRIA_OPT_REQUIRED) ? " (required)" : "", o->dflt ? " (default " : "",
             o->dflt ? o->dflt : "", o->dflt ? ")" : "");
    fprintf(out, "  %-*s", STRIA__HELP_COL - 3, left);
    if ((int)strlen(left) > STRIA__HELP_COL - 3)
        fprintf(out, "\n%*s", STRIA__HELP_COL - 1, "");
    fputc(' ', out);
    stria__wrap(out, right, STRIA__HELP_COL);
}

/* The options of path[d]; returns which value kinds they used (bit 0 bytes,
 * bit 1 durations). */
static unsigned stria__help_options(FILE *out, const stria_cli_t *cli, int d)
{
    unsigned kinds = 0;
    const stria_command_t *c = cli->path[d];
    for (const stria_option_t *o = c->options; o != NULL && o->name != NULL; o++) {
        stria__help_option(out, o);
        kinds |= (o->type == STRIA_OPT_BYTES ? 1u : 0u) | (o->type == STRIA_OPT_DURATION ? 2u : 0u);
    }
    if (c->config) {
        stria_option_t cfg = {.name = "config",
                              .metavar = "FILE",
                              .help = "read 'name = value' settings from FILE first (flags "
                                      "override them)"};
        stria__help_option(out, &cfg);
    }
    return kinds;
}

static void stria__help_usage(FILE *out, const stria_cli_t *cli)
{
    const stria_command_t *c = cli->cmd;
    fprintf(out, "usage:");
    for (int d = 0; d < cli->depth; d++)
        fprintf(out, " %s", cli->path[d]->name);
    if (c->commands != NULL)
        fprintf(out, " COMMAND");
    for (const stria_option_t *o = c->options; o != NULL && o->name != NULL; o++)
        if (o->flags & STRIA_OPT_REQUIRED)
            fprintf(out, " --%s %s", o->name, o->metavar ? o->metavar : "VALUE");
    fprintf(out, " [options]%s%s\n", c->args ? " " : "", c->args ? c->args : "");
}

void stria_cli_help(const stria_cli_t *cli, void *file)
{
    FILE *out = file;
    const stria_command_t *c = cli->cmd;
    unsigned kinds = 0;

    stria__help_usage(out, cli);
    if (c->description != NULL)
        fprintf(out, "\n%s\n", c->description);
    if (c->commands != NULL) {
        fprintf(out, "\ncommands:\n");
        for (const stria_command_t *s = c->commands; s->name != NULL; s++) {
            fprintf(out, "  %-*s ", STRIA__HELP_COL - 3, s->name);
            stria__wrap(out, s->summary ? s->summary : "", STRIA__HELP_COL);
        }
        fprintf(out, "\n'%s COMMAND --help' documents a command and its options.\n", c->name);
    }
    fprintf(out, "\noptions:\n");
    kinds |= stria__help_options(out, cli, cli->depth - 1);
    fprintf(out, "  %-*s this help\n", STRIA__HELP_COL - 3, "-h, --help");
    for (int d = cli->depth - 2; d >= 0; d--) {
        if (cli->path[d]->options == NULL && !cli->path[d]->config)
            continue;
        fprintf(out, "\noptions of %s (before or after the command):\n", cli->path[d]->name);
        kinds |= stria__help_options(out, cli, d);
    }
    if (kinds & 1u)
        fprintf(out, "\nSizes in bytes take a K, M, G or T suffix, powers of 1024 "
                     "(2G = 2147483648).\n");
    if (kinds & 2u)
        fprintf(out,
                "%sDurations take a unit ms, s, m or h (500ms, 2s, 1.5m, 1h); a plain number "
                "is seconds.\n",
                kinds & 1u ? "" : "\n");
    if (c->epilog != NULL)
        fprintf(out, "\n%s\n", c->epilog);
}

int stria_cli_exit(const char *prog, stria_status_t st)
{
    if (st == STRIA_OK)
        return 0;
    fprintf(stderr, "%s: %s\n", prog,
            stria_error_msg()[0] ? stria_error_msg() : stria_status_str(st));
    return 1;
}

int stria_cli_main(const stria_command_t *root, int argc, char **argv, stria_cli_t *cli)
{
    stria_status_t st = stria_cli_parse(root, argc, argv, cli);
    if (st == STRIA_OK && cli->help) {
        stria_cli_help(cli, stdout);
        return 0;
    }
    if (st == STRIA_OK)
        return -1;
    if (cli->depth > 0 && cli->cmd->commands != NULL && cli->nargs == 0 && argc < 2) {
        stria_cli_help(cli, stderr); /* no command at all */
        return 2;
    }
    fprintf(stderr, "%s: %s\n(see", root->name, stria_error_msg());
    for (int d = 0; d < cli->depth; d++)
        fprintf(stderr, " %s", cli->path[d]->name);
    fprintf(stderr, " --help)\n");
    return 2;
}

/* ---- where values came from ----------------------------------------------------- */

static const struct stria_cli_state *stria__state(const stria_cli_t *cli, const char *name)
{
    return stria__opt_find(cli, name, strlen(name));
}

stria_opt_from_t stria_cli_from(const stria_cli_t *cli, const char *name)
{
    const struct stria_cli_state *s = stria__state(cli, name);
    return s != NULL ? s->from : STRIA_OPT_FROM_UNSET;
}

bool stria_cli_given(const stria_cli_t *cli, const char *name)
{
    return stria_cli_from(cli, name) >= STRIA_OPT_FROM_FLAG;
}

const char *stria_cli_origin(const stria_cli_t *cli, const char *name, char *buf, size_t len)
{
    const struct stria_cli_state *s = stria__state(cli, name);
    if (s != NULL && s->from == STRIA_OPT_FROM_FILE)
        snprintf(buf, len, "%s:%d: --%s", s->file, s->line, name);
    else if (s != NULL && s->from == STRIA_OPT_FROM_DEFAULT)
        snprintf(buf, len, "--%s (default)", name);
    else
        snprintf(buf, len, "--%s", name);
    return buf;
}

stria_status_t stria_cli_wrap(const stria_cli_t *cli, const char *name, stria_status_t status)
{
    char buf[512];
    return stria_error_wrap(status, "%s", stria_cli_origin(cli, name, buf, sizeof(buf)));
}

void stria_cli_log(const stria_cli_t *cli)
{
    static const char *const from[] = {"unset", "default", "flag", "file"};
    for (size_t i = 0; i < cli->n_state; i++) {
        const struct stria_cli_state *s = &cli->state[i];
        if (s->from == STRIA_OPT_FROM_UNSET)
            continue;
        const char *v = s->text ? s->text : *(const bool *)s->o->dst ? "true" : "false";
        if (s->from == STRIA_OPT_FROM_FILE)
            stria_log_info("setting %s = %s (%s:%d)", s->o->name, v, s->file, s->line);
        else
            stria_log_info("setting %s = %s (%s)", s->o->name, v, from[s->from]);
    }
}

void stria_cli_free(stria_cli_t *cli)
{
    for (size_t i = 0; i < cli->n_allocs; i++)
        free(cli->allocs[i]);
    free(cli->allocs);
    free(cli->state);
    memset(cli, 0, sizeof(*cli));
}
