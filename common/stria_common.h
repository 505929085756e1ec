/*
 * stria common: status codes and error messages, logging, clocks, the thread
 * pool, storage dtypes and their conversions, and .npy file I/O.
 *
 * Error convention: every fallible function returns stria_status_t (0 = OK,
 * negative = error). A function that fails also records a human-readable
 * message in a thread-local buffer, read with stria_error_msg(). The message is
 * valid until the next failing stria call on the same thread.
 */
#ifndef STRIA_COMMON_H
#define STRIA_COMMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes ------------------------------------------------------ */

/* stria_status_t, stria_status_str(), stria_status_name(), stria_error_msg(),
 * stria_dtype_t and stria_layout_kind_t: the types of the client API, in its
 * installed header. */
#include "stria_types.h"

/* Records a message for the calling thread and returns `status`, so that
 * callers can write `return stria_error_set(STRIA_ERR_INVALID_ARG, "...")`. */
stria_status_t stria_error_set(stria_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Prepends context to the current thread's message ("rank 2: <old message>")
 * and returns `status`. */
stria_status_t stria_error_wrap(stria_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Clears the calling thread's message. */
void stria_error_clear(void);

/* Marks the calling thread's last error retryable or not (see
 * stria_error_retryable()); stria_error_set() clears the mark,
 * stria_error_wrap() keeps it. Returns `retryable`. */
bool stria_error_set_retryable(bool retryable);

/* ---- logging ----------------------------------------------------------- */

typedef enum {
    STRIA_LOG_ERROR = 0,
    STRIA_LOG_WARN = 1,
    STRIA_LOG_INFO = 2,
    STRIA_LOG_DEBUG = 3,
} stria_log_level_t;

/* Current level; initialised from STRIA_LOG_LEVEL (error|warn|info|debug),
 * default warn. */
stria_log_level_t stria_log_level(void);
void stria_log_set_level(stria_log_level_t level);
/* Parses "error", "warn", "info", "debug"; returns STRIA_ERR_INVALID_ARG
 * otherwise. */
stria_status_t stria_log_parse_level(const char *name, stria_log_level_t *level_out);
void stria_log_write(stria_log_level_t level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Copies text for a terminal or a log line: control characters (C0, DEL,
 * and C1 written in UTF-8) and bytes that are not UTF-8 become \xNN, so a
 * peer-supplied string cannot move the cursor, fake a log line or reach the
 * terminal's escape sequences. Valid UTF-8 text is kept; out (cap > 0) is
 * always terminated, cut at a whole character. Every log line goes through
 * it. Returns out. */
char *stria_text_escape(const char *in, char *out, size_t cap);
/* Length of the UTF-8 character (of two to four bytes) at s, at most n bytes,
 * with its code point in *cp; 0 when the bytes are not one (overlong,
 * surrogate, beyond U+10FFFF, cut short, or s[0] < 0x80). */
size_t stria_utf8_char(const char *s, size_t n, uint32_t *cp);

#define stria_log(level, ...)                                                                      \
    do {                                                                                           \
        if ((level) <= stria_log_level())                                                          \
            stria_log_write((level), __FILE__, __LINE__, __VA_ARGS__);                             \
    } while (0)
#define stria_log_error(...) stria_log(STRIA_LOG_ERROR, __VA_ARGS__)
#define stria_log_warn(...)  stria_log(STRIA_LOG_WARN, __VA_ARGS__)
#define stria_log_info(...)  stria_log(STRIA_LOG_INFO, __VA_ARGS__)
#define stria_log_debug(...) stria_log(STRIA_LOG_DEBUG, __VA_ARGS__)

/* ---- clocks ------------------------------------------------------------ */

/* Monotonic wall clock in seconds. */
double stria_time_now(void);
/* CPU time consumed by the calling thread, in seconds. */
double stria_time_thread_cpu(void);

/* ---- allocation -------------------------------------------------------- */

/* 64-byte aligned allocation; size 0 returns NULL. Free with stria_free(). */
void *stria_malloc_aligned(size_t size);
/* As stria_malloc_aligned() but zero-filled. */
void *stria_calloc_aligned(size_t size);
void stria_free(void *ptr);
/* Room for `need` elements of `elem` bytes in the array `arr` of capacity
 * *cap (first growth to `first` elements, then doubling, realloc()ed):
 * returns arr when it has room, the grown array (*cap updated), or NULL when
 * out of memory (arr and *cap unchanged). */
void *stria_grow(void *arr, size_t *cap, size_t need, size_t elem, size_t first);
/* stria_free() of each of n pointers; STRIA_FREE_ALL(d->q, d->k, d->v) for a
 * list of them. */
void stria_free_n(void *const *ptrs, size_t n);
#define STRIA_FREE_ALL(...)                                                                        \
    stria_free_n((void *const[]){__VA_ARGS__},                                                     \
                 sizeof((void *const[]){__VA_ARGS__}) / sizeof(void *))

/* Fills buf with n bytes from the kernel's random source (getrandom()):
 * unguessable values such as a job's secret. STRIA_ERR_IO when the source
 * fails. */
stria_status_t stria_random_bytes(void *buf, size_t n);

/* ---- little-endian fields of wire formats ------------------------------- */

/* The RPC frame header and the ring link's control messages are
 * little-endian whatever the host; these read and write their fields. */
static inline void stria_put_le16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline void stria_put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline void stria_put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint16_t stria_get_le16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline uint32_t stria_get_le32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static inline uint64_t stria_get_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* ---- network addresses ----------------------------------------------------- */

struct sockaddr_storage;

/* Splits "HOST:PORT" (an IPv6 host in brackets: "[::1]:7400") into host and
 * port. Errors (STRIA_ERR_INVALID_ARG) quote the address and say what is
 * wrong: no port, a port outside 0..65535, an empty host, an IPv6 host
 * without brackets, a host longer than host_cap - 1. */
stria_status_t stria_addr_parse(const char *addr, char *host, size_t host_cap, uint16_t *port_out);
/* Resolves a numeric address or a host name and a port to a socket address
 * (the first result). passive: for bind(), where a NULL-like "0.0.0.0" or
 * "::" means every interface. *len_out receives the address length.
 * Errors: STRIA_ERR_INVALID_ARG naming the host. */
stria_status_t stria_addr_resolve(const char *host, uint16_t port, bool passive,
                                  struct sockaddr_storage *out, size_t *len_out);
/* Whether every address `host` resolves to is a loopback one (127.0.0.0/8,
 * ::1): a listener there is reachable from this machine only. A wildcard
 * ("0.0.0.0", "::") or a name that does not resolve is not. */
bool stria_addr_is_loopback(const char *host);
/* The same for the host of a "HOST:PORT" address (false when malformed). */
bool stria_addr_listen_is_loopback(const char *addr);

/* ---- byte ranges -------------------------------------------------------- */

/* The bytes of a buffer that a transfer in chunks has covered so far, as
 * disjoint merged ranges [start, end). Chunks may arrive in any order and may
 * repeat: a byte is counted once however often it comes. Zero-initialise;
 * free with stria_ranges_free(). Not thread-safe. */
typedef struct {
    uint64_t (*r)[2]; /* sorted, disjoint, non-adjacent [start, end) */
    size_t n, cap;
    uint64_t covered; /* bytes in all ranges */
} stria_ranges_t;

/* Most ranges a set holds: a sender that scatters more disjoint pieces than
 * this is refused rather than allowed to grow the bookkeeping without bound
 * (senders of stria send in order, leaving one range). */
#define STRIA_RANGES_MAX 4096

/* Adds [start, start + len); len 0 adds nothing. Errors: STRIA_ERR_INVALID_ARG
 * (the range wraps around), STRIA_ERR_NO_MEMORY, STRIA_ERR_BUSY (more than
 * STRIA_RANGES_MAX disjoint ranges); the set is unchanged on error. */
stria_status_t stria_ranges_add(stria_ranges_t *set, uint64_t start, uint64_t len);
/* The first byte in [0, total) no range covers, or total if there is none. */
uint64_t stria_ranges_first_gap(const stria_ranges_t *set, uint64_t total);
void stria_ranges_free(stria_ranges_t *set);

/* ---- thread pool ------------------------------------------------------- */

typedef struct stria_pool stria_pool_t;

/* A task of a parallel loop: `task` in [0, n_tasks), `thread` in
 * [0, stria_pool_size(pool)) identifies the executing thread (for per-thread
 * scratch). */
typedef void (*stria_pool_task_cb)(void *ctx, size_t task, int thread);

/* Creates a pool of `n_threads` threads including the caller (so n_threads - 1
 * workers are started); 0 means the number of online CPUs. STRIA_THREADS in
 * the environment overrides 0. Free with stria_pool_destroy(). */
stria_status_t stria_pool_create(int n_threads, stria_pool_t **pool_out);
void stria_pool_destroy(stria_pool_t *pool);
/* Threads of the pool (including the caller); 1 for a NULL pool. */
int stria_pool_size(const stria_pool_t *pool);
/* Runs fn for every task and returns when all are done. Tasks are handed out
 * dynamically in increasing index order. A NULL pool runs them on the caller.
 * Concurrent calls on one pool are serialised. */
void stria_pool_run(stria_pool_t *pool, size_t n_tasks, stria_pool_task_cb fn, void *ctx);

/* ---- allocators and memory pools (mempool.c) ----------------------------
 *
 * An allocator hands out memory for a component that does not own where its
 * memory comes from (the ring engine's buffers, the kernels' workspaces, a
 * device's buffers): alloc returns NULL with the thread's error message set
 * when it cannot; free(NULL) does nothing. */
typedef struct {
    void *(*alloc)(void *ctx, size_t bytes);
    void (*free)(void *ctx, void *ptr);
    void *ctx;
} stria_allocator_t;

/* A memory pool: memory a process reserves once, up to a capacity, and
 * keeps (a host pool: until stria_mempool_trim() gives back what recent
 * allocations did not reach), so that the buffers of one job are the pages
 * of the previous one (no page fault, no kernel page clearing) instead of
 * fresh mappings.
 *
 * Host pools reserve address space (twice the capacity, PROT_NONE, not
 * committed) and commit it as allocations first reach it; the pages are
 * faulted in by their first use, never at creation, and asked to be
 * transparent huge pages. A pool over a source (device memory, pinned host
 * memory) takes segments of at least source->segment_bytes from it when
 * nothing free fits, up to the capacity, and keeps them; it gives back only
 * segments with nothing in them, when a new one would pass the capacity.
 * Allocations are 64-byte aligned, those of 2 MiB and more 2 MiB aligned, and
 * are placed lowest address first, so the same sequence of allocations after
 * the same frees lands on the same memory. Memory handed out again is not
 * cleared.
 *
 * Two figures bound a pool: admissions (stria_mempool_admit(), what jobs
 * reserve in advance, at most the capacity) and allocations (at most the
 * capacity in use at once). Thread-safe. */
typedef struct stria_mempool stria_mempool_t;

typedef struct {
    /* A segment of `bytes`, suitably aligned for the memory's users. */
    stria_status_t (*map)(void *ctx, size_t bytes, void **out);
    void (*unmap)(void *ctx, void *ptr, size_t bytes);
    void *ctx;            /* borrowed: must outlive the pool */
    size_t segment_bytes; /* smallest segment; 0: 64 MiB */
} stria_mempool_source_t;

typedef struct {
    uint64_t capacity;   /* what the pool may hold */
    uint64_t admitted;   /* reserved by admissions */
    uint64_t in_use;     /* allocated now */
    uint64_t high_water; /* most allocated at once */
    uint64_t committed;  /* host: address space made usable; source: segments held */
} stria_mempool_stats_t;

/* name: for messages ("host", "device", "pinned"; copied). source NULL: host
 * memory of this process. Errors: STRIA_ERR_INVALID_ARG (capacity 0 or over
 * 2^46), STRIA_ERR_NO_MEMORY (no address space). */
stria_status_t stria_mempool_create(const char *name, uint64_t capacity,
                                    const stria_mempool_source_t *source,
                                    stria_mempool_t **pool_out);
/* Gives everything back; NULL is ignored. Allocations still out are lost. */
void stria_mempool_destroy(stria_mempool_t *pool);
const char *stria_mempool_name(const stria_mempool_t *pool);

/* Reserves `bytes` of the capacity for `what` (a job) or refuses with
 * STRIA_ERR_NO_MEMORY naming what, the need and the offer:
 * "<what> needs N MiB of the <name> pool, M MiB of C MiB are free". */
stria_status_t stria_mempool_admit(stria_mempool_t *pool, uint64_t bytes, const char *what);
/* Gives back an admission. */
void stria_mempool_retire(stria_mempool_t *pool, uint64_t bytes);

/* `bytes` (> 0) of the pool's memory. STRIA_ERR_NO_MEMORY when the capacity
 * is in use or no free range (address space, segment) fits. */
stria_status_t stria_mempool_alloc(stria_mempool_t *pool, size_t bytes, void **out);
/* Returns memory of stria_mempool_alloc(); NULL is ignored; a pointer the
 * pool did not hand out is logged and ignored. */
void stria_mempool_free(stria_mempool_t *pool, void *ptr);
/* Host pools: gives back to the system the committed memory above the
 * highest address allocations reached since the previous trim (or the pool's
 * creation), in whole huge pages; what is in use is never touched. Called
 * now and then (a worker: every minute), it bounds what a host pool keeps
 * resident by its recent peak instead of its peak over the process's life
 * (a rare burst of concurrent jobs, or jobs that left holes low in the pool,
 * would otherwise keep pages resident for good). The memory is committed
 * again (fresh pages) when allocations reach it. Returns the bytes given
 * back; 0 for a pool over a source and NULL. */
size_t stria_mempool_trim(stria_mempool_t *pool);
/* The pool as an allocator (valid while the pool lives). */
stria_allocator_t stria_mempool_allocator(stria_mempool_t *pool);
void stria_mempool_stats(stria_mempool_t *pool, stria_mempool_stats_t *out);

/* ---- dtypes ------------------------------------------------------------ */

/* "fp32", "bf16", "fp16". */
const char *stria_dtype_name(stria_dtype_t dtype);
/* Accepts fp32|f32|float32, bf16|bfloat16, fp16|f16|float16. */
stria_status_t stria_dtype_parse(const char *name, stria_dtype_t *dtype_out);
/* Bytes per element (4 or 2); 0 for an unknown dtype. */
size_t stria_dtype_size(stria_dtype_t dtype);

/* Round-to-nearest-even conversions; NaN stays NaN, overflow gives inf. */
uint16_t stria_f32_to_bf16(float x);
float stria_bf16_to_f32(uint16_t x);
uint16_t stria_f32_to_f16(float x);
float stria_f16_to_f32(uint16_t x);
/* Element i of a buffer of `dtype`, as fp32. */
float stria_dtype_load(stria_dtype_t dtype, const void *base, size_t i);
/* Stores x (rounded) as element i of a buffer of `dtype`. */
void stria_dtype_store(stria_dtype_t dtype, void *base, size_t i, float x);
/* Converts n elements; src and dst must not overlap. */
void stria_dtype_convert(stria_dtype_t src_dtype, const void *src, stria_dtype_t dst_dtype,
                         void *dst, size_t n);

/* ---- .npy files -------------------------------------------------------- */

#define STRIA_NPY_MAX_DIMS 8

/* An array read from or written to a .npy file (format 1.0/2.0/3.0, C order,
 * little-endian). Supported element types: float32 ("<f4"), float16 ("<f2"),
 * float64 ("<f8", read only, converted to float32). */
typedef struct {
    stria_dtype_t dtype; /* STRIA_DTYPE_F32 or STRIA_DTYPE_F16 */
    int ndim;
    int64_t shape[STRIA_NPY_MAX_DIMS];
    void *data; /* owned; free with stria_npy_free() */
} stria_npy_t;

/* Reads `path` into *arr (arr->data allocated here). Errors name the file and
 * what is wrong (magic, header, dtype, order, shape, truncation). */
stria_status_t stria_npy_read(const char *path, stria_npy_t *arr);
/* Writes `n_elems` elements of `dtype` (F32 or F16) with the given shape. */
stria_status_t stria_npy_write(const char *path, stria_dtype_t dtype, int ndim,
                               const int64_t *shape, const void *data);
/* Frees arr->data and resets *arr; safe on a zeroed or freed array. */
void stria_npy_free(stria_npy_t *arr);
/* Number of elements (product of the shape). */
int64_t stria_npy_numel(const stria_npy_t *arr);

/* ---- options: command-line flags and configuration files ---------------- */

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

/* ---- systemd notification ------------------------------------------------ */

/* Sends `state` ("READY=1", "STATUS=...", "WATCHDOG=1", "STOPPING=1") to the
 * service manager through $NOTIFY_SOCKET. Without NOTIFY_SOCKET it does
 * nothing and returns STRIA_OK. */
stria_status_t stria_notify(const char *state);
/* Watchdog interval in seconds from $WATCHDOG_USEC (and $WATCHDOG_PID, if set,
 * must be this process); 0 when no watchdog is configured. */
double stria_notify_watchdog_interval(void);

/* ---- metrics (Prometheus text exposition format 0.0.4) ------------------- */

typedef struct stria_metrics stria_metrics_t;
typedef struct stria_metric stria_metric_t;

typedef enum {
    STRIA_METRIC_COUNTER,
    STRIA_METRIC_GAUGE,
    STRIA_METRIC_HISTOGRAM,
} stria_metric_kind_t;

/* A registry; thread-safe. Free with stria_metrics_destroy(). */
stria_status_t stria_metrics_create(stria_metrics_t **reg_out);
void stria_metrics_destroy(stria_metrics_t *reg);

/* Returns the series `name{labels}` of a family, creating family and series
 * on first use. `labels` is NULL or "key=\"value\",..." (values escaped with
 * stria_metrics_escape()). Histograms need `buckets` (n_buckets ascending upper
 * bounds; +Inf is implicit) on first use. The handle lives as long as the
 * registry. Returns NULL on bad names or kind mismatch (message set). */
stria_metric_t *stria_metrics_get(stria_metrics_t *reg, stria_metric_kind_t kind, const char *name,
                                  const char *help, const char *labels, const double *buckets,
                                  size_t n_buckets);
void stria_metric_add(stria_metric_t *m, double v);     /* counters and gauges */
void stria_metric_set(stria_metric_t *m, double v);     /* gauges */
void stria_metric_observe(stria_metric_t *m, double v); /* histograms */
/* Removes every series of a family whose labels contain `label_match` (e.g.
 * "job=\"7\""), for metrics of things that are gone. */
void stria_metrics_forget(stria_metrics_t *reg, const char *label_match);

/* Renders the registry; *text_out is malloc'ed (caller frees). */
stria_status_t stria_metrics_render(stria_metrics_t *reg, char **text_out, size_t *len_out);
/* Escapes a label value (backslash, quote, newline) into out (out_len bytes). */
void stria_metrics_escape(const char *value, char *out, size_t out_len);

/* ---- layouts ------------------------------------------------------------
 *
 * How the tokens of one global sequence are spread over the N ranks of a ring.
 * Every rank holds a shard of the same length (shard_tokens); the sequence is
 * padded internally up to seq_padded = N * shard_tokens, and padded tokens get
 * the global positions seq, seq + 1, ... Within every shard the positions
 * increase, so a shard's real tokens are a prefix of it
 * (stria_layout_shard_valid() of them) and its padding is the rest.
 *
 *   striped:    rank r holds positions r, r + N, r + 2N, ... (the default)
 *   contiguous: rank r holds [r * L, (r + 1) * L), L = shard_tokens
 *   zigzag:     2N chunks of C = L / 2 tokens; rank r holds chunks r and
 *               2N - 1 - r
 */

#define STRIA_LAYOUT_MAX_RANKS 65535
#define STRIA_LAYOUT_MAX_SEQ   ((int64_t)1 << 48)
/* Most runs a shard needs (zigzag: two). */
#define STRIA_LAYOUT_MAX_RUNS 2

typedef struct {
    stria_layout_kind_t kind;
    int n_ranks;
    int64_t seq;          /* real tokens */
    int64_t seq_padded;   /* n_ranks * shard_tokens */
    int64_t shard_tokens; /* tokens per rank, padding included */
} stria_layout_t;

/* Global positions first, first + stride, ..., first + (count - 1) * stride:
 * the same shape as the kernels' stria_pos_run_t. */
typedef struct {
    int64_t first;
    int64_t stride;
    int64_t count;
} stria_layout_run_t;

/* "striped", "contiguous", "zigzag", "auto"; "unknown" otherwise. */
const char *stria_layout_kind_name(stria_layout_kind_t kind);
/* Parses the names above; STRIA_ERR_INVALID_ARG otherwise. */
stria_status_t stria_layout_kind_parse(const char *name, stria_layout_kind_t *kind_out);
/* The layout STRIA_LAYOUT_AUTO stands for: contiguous for a job with a
 * window, striped otherwise. Any other kind is returned as it is. */
stria_layout_kind_t stria_layout_kind_resolve(stria_layout_kind_t kind, bool has_window);

/* Describes `seq` tokens (1..STRIA_LAYOUT_MAX_SEQ) over n_ranks ranks
 * (1..STRIA_LAYOUT_MAX_RANKS). Pads to a multiple of n_ranks (striped,
 * contiguous) or 2 * n_ranks (zigzag). */
stria_status_t stria_layout_init(stria_layout_kind_t kind, int n_ranks, int64_t seq,
                                 stria_layout_t *layout_out);

/* Global position of token `index` (0..shard_tokens-1) of `rank`'s shard;
 * positions >= layout->seq are padding. -1 for an index or rank out of range. */
int64_t stria_layout_position(const stria_layout_t *layout, int rank, int64_t index);

/* Inverse of stria_layout_position() for pos in [0, seq_padded). */
stria_status_t stria_layout_locate(const stria_layout_t *layout, int64_t pos, int *rank_out,
                                   int64_t *index_out);

/* Memory of one rank of a ring job, in bytes, for admission (the coordinator)
 * and reservation (the worker): its Q, K, V, dO, O, dQ, dK, dV shards in the
 * job dtype and its fp32 LSE, the ring buffers (K/V double-buffered in the
 * job dtype, dK/dV double-buffered in fp32, the fp32 output accumulators) and
 * the kernels' fp32 workspaces, all for shard_tokens (padded) tokens.
 * STRIA_ERR_INVALID_ARG for sizes <= 0 or an unknown dtype;
 * STRIA_ERR_NO_MEMORY when the result does not fit in 63 bits. */
stria_status_t stria_rank_memory(int64_t batch, int64_t shard_tokens, int64_t heads,
                                 int64_t kv_heads, int64_t head_dim, stria_dtype_t dtype,
                                 uint64_t *bytes_out);

/* Real (unpadded) tokens of `rank`'s shard: its first ones. 0 for a bad rank. */
int64_t stria_layout_shard_valid(const stria_layout_t *layout, int rank);

/* Position runs of `rank`'s shard in shard order: of its real tokens only, or
 * with_padding of all shard_tokens. Writes at most STRIA_LAYOUT_MAX_RUNS runs
 * with count > 0 and returns how many (0 for a shard without real tokens, or a
 * bad rank). */
size_t stria_layout_shard_runs(const stria_layout_t *layout, int rank, bool with_padding,
                               stria_layout_run_t runs[STRIA_LAYOUT_MAX_RUNS]);

/* Scatter and gather between a full tensor and one rank's shard. Both are
 * contiguous [outer][tokens][row_bytes] arrays: full has layout->seq tokens,
 * shard has layout->shard_tokens. A [batch, tokens, heads, head_dim] tensor is
 * outer = batch, row_bytes = heads * head_dim * element size; an LSE
 * [batch, heads, tokens] is outer = batch * heads, row_bytes = 4.
 * Scatter zero-fills the padded rows of the shard; gather writes only the real
 * rows of this rank into full and reads nothing else of the shard. Buffers
 * belong to the caller and must not overlap. */
stria_status_t stria_layout_scatter(const stria_layout_t *layout, int rank, int64_t outer,
                                    size_t row_bytes, const void *full, void *shard);
stria_status_t stria_layout_gather(const stria_layout_t *layout, int rank, int64_t outer,
                                   size_t row_bytes, const void *shard, void *full);

/* ---- end of layouts ----------------------------------------------------- */

/* ---- timelines (timeline.c) ----------------------------------------------
 * Per-rank timelines of ring passes drawn as one self-contained SVG file:
 * one panel per pass on a shared time axis, one row per rank, compute and
 * waits coloured, sends as a thin lane under each row, a legend, axis labels
 * and a title. Rows beyond STRIA_TIMELINE_MAX_ROWS are sampled evenly, and
 * every row is drawn at pixel resolution (each pixel takes the kind that
 * covers most of it), so the file stays small for rings of 1024 ranks. */
#define STRIA_TIMELINE_MAX_ROWS 128

typedef enum {
    STRIA_TIMELINE_COMPUTE = 1,
    STRIA_TIMELINE_WAIT = 2,
    STRIA_TIMELINE_SEND = 3, /* a transfer in flight (the lane under the row) */
} stria_timeline_kind_t;

typedef struct stria_timeline stria_timeline_t;

/* title: the job's shape; subtitle: how the clocks were aligned (either may
 * be NULL). Both are copied. */
stria_status_t stria_timeline_create(const char *title, const char *subtitle,
                                     stria_timeline_t **out);
void stria_timeline_destroy(stria_timeline_t *tl);
/* Adds a panel of n_rows rows (1..65536) named `name` with a note drawn
 * beside it (NULL: none); returns its index in *panel. */
stria_status_t stria_timeline_panel(stria_timeline_t *tl, const char *name, const char *note,
                                    int n_rows, int *panel);
/* A span of a row, in seconds (begin <= end, both finite and >= 0). */
stria_status_t stria_timeline_span(stria_timeline_t *tl, int panel, int row,
                                   stria_timeline_kind_t kind, double begin, double end);
/* The panel's end (its pass's time); default: its latest span's end. */
void stria_timeline_panel_end(stria_timeline_t *tl, int panel, double end);
/* Writes the SVG; the error names the file. */
stria_status_t stria_timeline_write_svg(const stria_timeline_t *tl, const char *path);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_COMMON_H */
