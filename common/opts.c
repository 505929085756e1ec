#include "stria_common.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Strings copied by stria_opt_set() are recorded here so that stria_opts_free()
 * can tell them from pointers into argv or defaults. */
typedef struct stria__opt_copy {
    const char **dst;
    char *copy;
    struct stria__opt_copy *next;
} stria__opt_copy_t;

static stria__opt_copy_t *stria__copies;

static const stria_opt_t *stria__opt_find(const stria_opt_t *opts, const char *name, size_t len)
{
    for (const stria_opt_t *o = opts; o->name != NULL; o++)
        if (strlen(o->name) == len && strncmp(o->name, name, len) == 0)
            return o;
    return NULL;
}

static stria_status_t stria__opt_range(const stria_opt_t *o, double v, const char *value)
{
    if ((o->min != 0.0 || o->max != 0.0) && (v < o->min || v > o->max))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s '%s': must be in %g..%g", o->name,
                               value, o->min, o->max);
    return STRIA_OK;
}

stria_status_t stria_opt_set(const stria_opt_t *opts, const char *name, const char *value)
{
    const stria_opt_t *o = stria__opt_find(opts, name, strlen(name));
    char *end;

    if (o == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "unknown option '%s'", name);
    switch (o->type) {
    case STRIA_OPT_FLAG:
        if (value != NULL)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s takes no value", o->name);
        *(bool *)o->dst = true;
        return STRIA_OK;
    case STRIA_OPT_BOOL:
        if (value == NULL || strcmp(value, "true") == 0 || strcmp(value, "yes") == 0 ||
            strcmp(value, "1") == 0)
            *(bool *)o->dst = true;
        else if (strcmp(value, "false") == 0 || strcmp(value, "no") == 0 || strcmp(value, "0") == 0)
            *(bool *)o->dst = false;
        else
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "--%s '%s': expected true/false, yes/no or 1/0", o->name, value);
        return STRIA_OK;
    default:
        break;
    }
    if (value == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s needs a value", o->name);
    switch (o->type) {
    case STRIA_OPT_STRING: {
        stria__opt_copy_t *c = malloc(sizeof(*c));
        char *copy = strdup(value);
        if (c == NULL || copy == NULL) {
            free(c);
            free(copy);
            return stria_error_set(STRIA_ERR_NO_MEMORY, "--%s: out of memory", o->name);
        }
        c->dst = (const char **)o->dst;
        c->copy = copy;
        c->next = stria__copies;
        stria__copies = c;
        *(const char **)o->dst = copy;
        return STRIA_OK;
    }
    case STRIA_OPT_INT: {
        errno = 0;
        long long v = strtoll(value, &end, 10);
        if (errno != 0 || end == value || *end != '\0')
            return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s '%s': expected an integer", o->name,
                                   value);
        stria_status_t st = stria__opt_range(o, (double)v, value);
        if (st == STRIA_OK)
            *(int64_t *)o->dst = v;
        return st;
    }
    case STRIA_OPT_DOUBLE: {
        errno = 0;
        double v = strtod(value, &end);
        if (errno != 0 || end == value || *end != '\0' || !isfinite(v))
            return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s '%s': expected a number", o->name,
                                   value);
        stria_status_t st = stria__opt_range(o, v, value);
        if (st == STRIA_OK)
            *(double *)o->dst = v;
        return st;
    }
    default:
        return stria_error_set(STRIA_ERR_INTERNAL, "--%s: bad option type", o->name);
    }
}

stria_status_t stria_opts_parse(const stria_opt_t *opts, int argc, char **argv, int first,
                                const char **config_path)
{
    stria_status_t st;

    /* The configuration file first, so that flags override it. */
    for (int i = first; i < argc; i++) {
        const char *cfg = NULL;
        if (strcmp(argv[i], "--config") == 0) {
            if (i + 1 >= argc)
                return stria_error_set(STRIA_ERR_INVALID_ARG, "--config needs a file");
            cfg = argv[i + 1];
        } else if (strncmp(argv[i], "--config=", 9) == 0) {
            cfg = argv[i] + 9;
        }
        if (cfg != NULL) {
            st = stria_opts_load_file(opts, cfg);
            if (st != STRIA_OK)
                return st;
            if (config_path != NULL)
                *config_path = cfg;
        }
    }
    for (int i = first; i < argc; i++) {
        const char *arg = argv[i];
        if (strncmp(arg, "--", 2) != 0 || arg[2] == '\0')
            return stria_error_set(STRIA_ERR_INVALID_ARG, "unexpected argument '%s'", arg);
        const char *name = arg + 2;
        const char *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        if (strncmp(name, "config", len) == 0 && len == 6) {
            i += eq ? 0 : 1;
            continue;
        }
        const stria_opt_t *o = stria__opt_find(opts, name, len);
        if (o == NULL)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "unknown option '--%.*s'", (int)len,
                                   name);
        char key[128];
        snprintf(key, sizeof(key), "%s", o->name);
        const char *value = eq ? eq + 1 : NULL;
        if (value == NULL && o->type != STRIA_OPT_FLAG && o->type != STRIA_OPT_BOOL) {
            if (i + 1 >= argc)
                return stria_error_set(STRIA_ERR_INVALID_ARG, "--%s needs a value", o->name);
            value = argv[++i];
        }
        st = stria_opt_set(opts, key, value);
        if (st != STRIA_OK)
            return st;
    }
    return STRIA_OK;
}

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

stria_status_t stria_opts_load_file(const stria_opt_t *opts, const char *path)
{
    FILE *f = fopen(path, "r");
    char line[4096];
    int lineno = 0;
    stria_status_t st = STRIA_OK;

    if (f == NULL)
        return stria_error_set(STRIA_ERR_IO, "%s: cannot open configuration file: %s", path,
                               strerror(errno));
    while (fgets(line, sizeof(line), f) != NULL) {
        lineno++;
        size_t n = strlen(line);
        if (n == sizeof(line) - 1 && line[n - 1] != '\n') {
            st = stria_error_set(STRIA_ERR_FORMAT, "%s:%d: line longer than %zu bytes", path,
                                 lineno, sizeof(line) - 2);
            break;
        }
        char *hash = strchr(line, '#');
        if (hash != NULL)
            *hash = '\0';
        char *s = stria__trim(line);
        if (*s == '\0')
            continue;
        char *eq = strchr(s, '=');
        if (eq == NULL) {
            st = stria_error_set(STRIA_ERR_FORMAT, "%s:%d: expected 'name = value', got '%s'", path,
                                 lineno, s);
            break;
        }
        *eq = '\0';
        char *key = stria__trim(s);
        char *value = stria__trim(eq + 1);
        const stria_opt_t *o = stria__opt_find(opts, key, strlen(key));
        if (o == NULL || o->type == STRIA_OPT_FLAG) {
            st =
                stria_error_set(STRIA_ERR_FORMAT, "%s:%d: unknown setting '%s'", path, lineno, key);
            break;
        }
        st = stria_opt_set(opts, key, value);
        if (st != STRIA_OK) {
            stria_error_wrap(st, "%s:%d", path, lineno);
            break;
        }
    }
    if (st == STRIA_OK && ferror(f))
        st = stria_error_set(STRIA_ERR_IO, "%s: read error", path);
    fclose(f);
    return st;
}

void stria_opts_print_help(const stria_opt_t *opts, void *file)
{
    FILE *out = file;
    for (const stria_opt_t *o = opts; o->name != NULL; o++) {
        char left[64];
        snprintf(left, sizeof(left), "--%s%s%s", o->name, o->metavar ? " " : "",
                 o->metavar ? o->metavar : "");
        fprintf(out, "  %-28s %s\n", left, o->help ? o->help : "");
    }
    fprintf(out, "  %-28s %s\n", "--config FILE",
            "read 'name = value' settings from FILE first (flags override them)");
}

void stria_opts_free(const stria_opt_t *opts)
{
    stria__opt_copy_t **pp = &stria__copies;
    while (*pp != NULL) {
        stria__opt_copy_t *c = *pp;
        bool mine = false;
        for (const stria_opt_t *o = opts; o->name != NULL; o++)
            if (o->type == STRIA_OPT_STRING && (const char **)o->dst == c->dst)
                mine = true;
        if (!mine) {
            pp = &c->next;
            continue;
        }
        if (*c->dst == c->copy)
            *c->dst = NULL;
        free(c->copy);
        *pp = c->next;
        free(c);
    }
}

stria_status_t stria_parse_host_port(const char *text, char *host, size_t host_len, int *port_out)
{
    const char *colon, *hstart = text;
    size_t hlen;
    char *end;

    if (text == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "missing address");
    if (text[0] == '[') {
        const char *close = strchr(text, ']');
        if (close == NULL || close[1] != ':')
            return stria_error_set(STRIA_ERR_INVALID_ARG, "'%s': expected [IPv6]:PORT", text);
        hstart = text + 1;
        hlen = (size_t)(close - hstart);
        colon = close + 1;
    } else {
        colon = strrchr(text, ':');
        if (colon == NULL)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "'%s': expected HOST:PORT", text);
        hlen = (size_t)(colon - text);
    }
    if (hlen == 0 || hlen >= host_len)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "'%s': bad host", text);
    errno = 0;
    long port = strtol(colon + 1, &end, 10);
    if (errno != 0 || end == colon + 1 || *end != '\0' || port < 0 || port > 65535)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "'%s': port must be in 0..65535", text);
    memcpy(host, hstart, hlen);
    host[hlen] = '\0';
    *port_out = (int)port;
    return STRIA_OK;
}
