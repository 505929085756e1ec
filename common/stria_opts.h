/*
 * stria opts: the options of every program from one table per command:
 * command-line flags, `name = value` lines of a configuration file, and the
 * --help text generated from the same table.
 *
 * Ownership: tables belong to the program and are only read. A parse writes
 * values through the table's dst pointers into the caller's structures; a
 * string value points into argv, the table's default text, or the
 * stria_cli_t (values read from a file, list arrays): count on it until
 * stria_cli_free() only. Threads: a stria_cli_t is used by one thread at a
 * time; errors are the calling thread's message.
 */
#ifndef STRIA_OPTS_H
#define STRIA_OPTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every program describes each command as a stria_command_t: a usage line, a
 * description, a NULL-name-terminated table of options, subcommands and the
 * positional arguments it takes. stria_cli_parse() parses argv with it, the
 * same table reads `name = value` lines of a configuration file (--config),
 * and stria_cli_help() prints the --help text generated from it. */
typedef enum {
    STRIA_OPT_STRING = 0,   /* dst: const char ** */
    STRIA_OPT_INT = 1,      /* dst: int64_t *, in [min, max] */
    STRIA_OPT_DOUBLE = 2,   /* dst: double *, in [min, max] */
    STRIA_OPT_BOOL = 3,     /* dst: bool *; bare flag = true; true/false/yes/no/1/0 */
    STRIA_OPT_FLAG = 4,     /* dst: bool *, set true; a flag only, never takes a value */
    STRIA_OPT_UNFLAG = 5,   /* dst: bool *, set false (--no-causal); a flag only */
    STRIA_OPT_BYTES = 6,    /* dst: int64_t *; an integer with an optional K, M, G or T
                               suffix, powers of 1024 ("64M" = 67108864), in [min, max] */
    STRIA_OPT_DURATION = 7, /* dst: double *, seconds; "500ms", "2s", "1.5m", "1h"; a plain
                               number is seconds; in [min, max] */
    STRIA_OPT_ADDR = 8,     /* dst: const char **; HOST:PORT ([v6]:PORT), see stria_addr_parse() */
    STRIA_OPT_INTS = 9,     /* dst: stria_int_list_t *; comma-separated integers in [min, max] */
    STRIA_OPT_STRINGS = 10, /* dst: stria_str_list_t *; comma-separated non-empty strings */
    STRIA_OPT_CUSTOM = 11,  /* dst: whatever `parse` writes */
} stria_opt_type_t;

/* Flags of an option. */
enum {
    STRIA_OPT_REQUIRED = 1u << 0,  /* a flag or a file must set it */
    STRIA_OPT_ABOVE_MIN = 1u << 1, /* the value must be > min (not >= min) */
    STRIA_OPT_FLAG_ONLY = 1u << 2, /* no configuration file setting */
};

/* Values of list options; the arrays belong to the stria_cli_t that parsed
 * them (freed by stria_cli_free()). */
typedef struct {
    size_t n;
    int64_t *v;
} stria_int_list_t;
typedef struct {
    size_t n;
    const char **v;
} stria_str_list_t;

typedef struct {
    const char *name; /* without the leading dashes; NULL ends a table */
    stria_opt_type_t type;
    void *dst;
    const char *dflt;    /* text parsed into dst before anything else, shown by --help;
                            NULL: dst keeps what the program put there */
    const char *metavar; /* the value's name in --help ("HOST:PORT"); NULL for flags */
    const char *help;
    double min, max;  /* numbers and list items: checked when min < max */
    unsigned flags;   /* STRIA_OPT_REQUIRED, ... */
    size_t max_items; /* lists: at most this many items (0: no limit) */
    /* STRIA_OPT_CUSTOM: parses text into dst; its message is prefixed with
     * the option's name and origin. */
    stria_status_t (*parse)(const char *text, void *dst);
} stria_option_t;

/* One table entry on one line: name, type without its prefix (INT for
 * STRIA_OPT_INT), dst, metavar (NULL for flags), help, then any other fields
 * as designated initializers:
 *   STRIA_OPTION("threads", INT, &o->threads, "N", "compute threads", .min = 1, .max = 1024)
 * A table ends with {.name = NULL}. */
#define STRIA_OPTION(name_, type_, dst_, metavar_, ...)                                            \
    {                                                                                              \
        .name = (name_), .type = STRIA_OPT_##type_, .dst = (dst_), .metavar = (metavar_),          \
        .help = __VA_ARGS__                                                                        \
    }

typedef struct stria_command {
    const char *name;        /* "stria-run" for the program, "submit" for a command */
    const char *summary;     /* one line: the parent's list of commands */
    const char *args;        /* positional arguments for the usage line ("JOB [--reason TEXT]") */
    int min_args, max_args;  /* how many positional arguments; max_args < 0: no limit */
    const char *description; /* paragraphs under the usage line */
    const char *epilog;      /* paragraphs after the options (environment, exit status) */
    const stria_option_t *options;        /* NULL or NULL-name-terminated */
    const struct stria_command *commands; /* subcommands: NULL or NULL-name-terminated */
    bool config;                          /* takes --config FILE (name = value lines) */
} stria_command_t;

/* Where an option's value came from. */
typedef enum {
    STRIA_OPT_FROM_UNSET = 0,   /* not given and no default */
    STRIA_OPT_FROM_DEFAULT = 1, /* the table's dflt */
    STRIA_OPT_FROM_FLAG = 2,    /* --name on the command line */
    STRIA_OPT_FROM_FILE = 3,    /* a line of the configuration file */
} stria_opt_from_t;

#define STRIA_CLI_MAX_DEPTH 4

/* What stria_cli_parse() found. Zero it or let stria_cli_parse() do so; free
 * with stria_cli_free() (string values read from a file and list arrays live
 * in it). */
typedef struct {
    const stria_command_t *path[STRIA_CLI_MAX_DEPTH]; /* the program, then its command */
    int depth;                                        /* entries of path */
    const stria_command_t *cmd;                       /* path[depth - 1] */
    int nargs;
    char **args;                   /* positional arguments (pointers into argv) */
    bool help;                     /* -h or --help was given for cmd */
    const char *config_path;       /* --config FILE, or NULL */
    struct stria_cli_state *state; /* private: one entry per option of path */
    size_t n_state;
    void **allocs; /* private */
    size_t n_allocs, cap_allocs;
} stria_cli_t;

/* Parses argv[1..argc) against `root` and its commands: defaults first, then
 * the --config file, then the flags (later ones win). Options may be given as
 * `--name VALUE` or `--name=VALUE`; the options of the program stay valid
 * after its command name. `--` ends the options. Errors:
 * STRIA_ERR_INVALID_ARG (usage: unknown option, missing or bad value, wrong
 * number of arguments, missing required option), STRIA_ERR_IO /
 * STRIA_ERR_FORMAT (the configuration file); a bad value's message names the
 * flag ("--memory '2X': ...") or the file and line ("w.conf:3: --memory
 * '2X': ..."). With -h/--help, stops and sets cli->help. */
stria_status_t stria_cli_parse(const stria_command_t *root, int argc, char **argv,
                               stria_cli_t *cli);

/* stria_cli_parse() plus what every program does with it: prints the help of
 * the command to stdout and returns 0 for --help; prints "PROG: message" and
 * "(see PROG [COMMAND] --help)" to stderr and returns 2 on an error, or the
 * usage of a program whose command is missing; returns -1 to go on. */
int stria_cli_main(const stria_command_t *root, int argc, char **argv, stria_cli_t *cli);

/* The end of a command: 0 when st is STRIA_OK, else "PROG: message" (the
 * thread's message, or st's text) on stderr and 1. */
int stria_cli_exit(const char *prog, stria_status_t st);

/* The generated help of cli->cmd: usage line, description, commands,
 * options with their value names, defaults and help, epilog. */
void stria_cli_help(const stria_cli_t *cli, void *file /* FILE * */);

/* Where option `name` of the parsed command got its value, and whether a
 * flag or the file gave it. */
stria_opt_from_t stria_cli_from(const stria_cli_t *cli, const char *name);
bool stria_cli_given(const stria_cli_t *cli, const char *name);
/* The origin as text: "--name", "FILE:LINE: name" or "default"; for
 * messages about values checked after parsing. */
const char *stria_cli_origin(const stria_cli_t *cli, const char *name, char *buf, size_t len);
/* Prefixes the thread's message with the origin of option `name` and
 * returns `status`: "w.conf:4: --log-level: unknown log level 'loud'". */
stria_status_t stria_cli_wrap(const stria_cli_t *cli, const char *name, stria_status_t status);
/* Logs (info) every setting of the parsed command that is set, with its
 * value and where it came from. */
void stria_cli_log(const stria_cli_t *cli);
void stria_cli_free(stria_cli_t *cli);

/* The parsers behind STRIA_OPT_BYTES and STRIA_OPT_DURATION. */
stria_status_t stria_parse_bytes(const char *text, int64_t *out);
stria_status_t stria_parse_duration(const char *text, double *out);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_OPTS_H */
