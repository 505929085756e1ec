#include "stria_metrics.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct stria_metric {
    struct stria_metric *next;
    struct stria__family *family;
    char *labels; /* "" or key="value",... */
    double value; /* counter/gauge value; histogram sum */
    uint64_t count;
    uint64_t *bucket_counts; /* histograms: per bucket, not cumulative */
};

typedef struct stria__family {
    struct stria__family *next;
    char *name;
    char *help;
    stria_metric_kind_t kind;
    double *buckets;
    size_t n_buckets;
    stria_metric_t *series;
} stria__family_t;

struct stria_metrics {
    pthread_mutex_t lock;
    stria__family_t *families;
    stria__family_t **tail;
};

stria_status_t stria_metrics_create(stria_metrics_t **reg_out)
{
    stria_metrics_t *reg = calloc(1, sizeof(*reg));
    if (reg == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate metrics registry");
    pthread_mutex_init(&reg->lock, NULL);
    reg->tail = &reg->families;
    *reg_out = reg;
    return STRIA_OK;
}

static void stria__series_free(stria_metric_t *m)
{
    free(m->labels);
    free(m->bucket_counts);
    free(m);
}

void stria_metrics_destroy(stria_metrics_t *reg)
{
    if (reg == NULL)
        return;
    for (stria__family_t *f = reg->families, *fn; f != NULL; f = fn) {
        fn = f->next;
        for (stria_metric_t *m = f->series, *mn; m != NULL; m = mn) {
            mn = m->next;
            stria__series_free(m);
        }
        free(f->name);
        free(f->help);
        free(f->buckets);
        free(f);
    }
    pthread_mutex_destroy(&reg->lock);
    free(reg);
}

static bool stria__valid_name(const char *name)
{
    if (name == NULL || !(isalpha((unsigned char)name[0]) || name[0] == '_' || name[0] == ':'))
        return false;
    for (const char *p = name; *p; p++)
        if (!(isalnum((unsigned char)*p) || *p == '_' || *p == ':'))
            return false;
    return true;
}

stria_metric_t *stria_metrics_get(stria_metrics_t *reg, stria_metric_kind_t kind, const char *name,
                                  const char *help, const char *labels, const double *buckets,
                                  size_t n_buckets)
{
    stria__family_t *f;
    stria_metric_t *m = NULL;

    if (reg == NULL || !stria__valid_name(name)) {
        stria_error_set(STRIA_ERR_INVALID_ARG, "invalid metric name '%s'", name ? name : "");
        return NULL;
    }
    if (labels == NULL)
        labels = "";
    pthread_mutex_lock(&reg->lock);
    for (f = reg->families; f != NULL; f = f->next)
        if (strcmp(f->name, name) == 0)
            break;
    if (f != NULL && f->kind != kind) {
        stria_error_set(STRIA_ERR_INVALID_ARG, "metric '%s' exists with another type", name);
        goto out;
    }
    if (f == NULL) {
        if (kind == STRIA_METRIC_HISTOGRAM && (buckets == NULL || n_buckets == 0)) {
            stria_error_set(STRIA_ERR_INVALID_ARG, "histogram '%s' needs buckets", name);
            goto out;
        }
        f = calloc(1, sizeof(*f));
        if (f == NULL)
            goto out_nomem;
        f->name = strdup(name);
        f->help = strdup(help ? help : "");
        f->kind = kind;
        if (kind == STRIA_METRIC_HISTOGRAM) {
            f->buckets = malloc(n_buckets * sizeof(double));
            if (f->buckets != NULL)
                memcpy(f->buckets, buckets, n_buckets * sizeof(double));
            f->n_buckets = n_buckets;
        }
        if (f->name == NULL || f->help == NULL ||
            (kind == STRIA_METRIC_HISTOGRAM && f->buckets == NULL)) {
            free(f->name);
            free(f->help);
            free(f->buckets);
            free(f);
            goto out_nomem;
        }
        *reg->tail = f;
        reg->tail = &f->next;
    }
    for (m = f->series; m != NULL; m = m->next)
        if (strcmp(m->labels, labels) == 0)
            goto out;
    m = calloc(1, sizeof(*m));
    if (m == NULL)
        goto out_nomem;
    m->family = f;
    m->labels = strdup(labels);
    if (kind == STRIA_METRIC_HISTOGRAM)
        m->bucket_counts = calloc(f->n_buckets, sizeof(uint64_t));
    if (m->labels == NULL || (kind == STRIA_METRIC_HISTOGRAM && m->bucket_counts == NULL)) {
        stria__series_free(m);
        m = NULL;
        goto out_nomem;
    }
    m->next = f->series;
    f->series = m;
    goto out;
out_nomem:
    stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for metric '%s'", name);
out:
    pthread_mutex_unlock(&reg->lock);
    return m;
}

/* Series are updated with atomics on doubles through a CAS loop, so hot paths
 * (ring steps) take no lock. */
static void stria__atomic_add(double *p, double v)
{
    double old, nv;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do {
        nv = old + v;
    } while (!__atomic_compare_exchange(p, &old, &nv, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}

void stria_metric_add(stria_metric_t *m, double v)
{
    if (m != NULL)
        stria__atomic_add(&m->value, v);
}

void stria_metric_set(stria_metric_t *m, double v)
{
    if (m != NULL)
        __atomic_store(&m->value, &v, __ATOMIC_RELAXED);
}

void stria_metric_observe(stria_metric_t *m, double v)
{
    if (m == NULL || m->bucket_counts == NULL)
        return;
    stria__family_t *f = m->family;
    for (size_t i = 0; i < f->n_buckets; i++) {
        if (v <= f->buckets[i]) {
            __atomic_fetch_add(&m->bucket_counts[i], 1, __ATOMIC_RELAXED);
            break;
        }
    }
    __atomic_fetch_add(&m->count, 1, __ATOMIC_RELAXED);
    stria__atomic_add(&m->value, v);
}

void stria_metrics_forget(stria_metrics_t *reg, const char *label_match)
{
    if (reg == NULL || label_match == NULL || label_match[0] == '\0')
        return;
    pthread_mutex_lock(&reg->lock);
    for (stria__family_t *f = reg->families; f != NULL; f = f->next) {
        stria_metric_t **pp = &f->series;
        while (*pp != NULL) {
            stria_metric_t *m = *pp;
            if (strstr(m->labels, label_match) != NULL) {
                *pp = m->next;
                stria__series_free(m);
            } else {
                pp = &m->next;
            }
        }
    }
    pthread_mutex_unlock(&reg->lock);
}

void stria_metrics_escape(const char *value, char *out, size_t out_len)
{
    size_t n = 0;
    if (out_len == 0)
        return;
    for (const char *p = value; *p && n + 2 < out_len; p++) {
        if (*p == '\\' || *p == '"') {
            out[n++] = '\\';
            out[n++] = *p;
        } else if (*p == '\n') {
            out[n++] = '\\';
            out[n++] = 'n';
        } else {
            out[n++] = *p;
        }
    }
    out[n] = '\0';
}

typedef struct {
    char *buf;
    size_t len, cap;
    bool failed;
} stria__sb_t;

static void stria__sb_printf(stria__sb_t *sb, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void stria__sb_printf(stria__sb_t *sb, const char *fmt, ...)
{
    va_list ap;
    if (sb->failed)
        return;
    for (;;) {
        va_start(ap, fmt);
        int n = vsnprintf(sb->buf + sb->len, sb->cap - sb->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            sb->failed = true;
            return;
        }
        if ((size_t)n < sb->cap - sb->len) {
            sb->len += (size_t)n;
            return;
        }
        size_t cap = sb->cap * 2 + (size_t)n + 1;
        char *nb = realloc(sb->buf, cap);
        if (nb == NULL) {
            sb->failed = true;
            return;
        }
        sb->buf = nb;
        sb->cap = cap;
    }
}

static void stria__fmt_value(char *out, size_t n, double v)
{
    if (isnan(v))
        snprintf(out, n, "NaN");
    else if (isinf(v))
        snprintf(out, n, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 1e15)
        snprintf(out, n, "%.0f", v); /* counts and bytes as integers */
    else {
        /* The shortest form that reads back as the same double ("0.1", not
         * "0.10000000000000001"): bucket bounds are label values, which
         * dashboards and alert rules match as text. */
        for (int digits = 1; digits <= 17; digits++) {
            snprintf(out, n, "%.*g", digits, v);
            if (strtod(out, NULL) == v)
                break;
        }
    }
}

static void stria__help_escape(stria__sb_t *sb, const char *help)
{
    for (const char *p = help; *p; p++) {
        if (*p == '\\')
            stria__sb_printf(sb, "\\\\");
        else if (*p == '\n')
            stria__sb_printf(sb, "\\n");
        else
            stria__sb_printf(sb, "%c", *p);
    }
}

stria_status_t stria_metrics_render(stria_metrics_t *reg, char **text_out, size_t *len_out)
{
    static const char *const types[] = {"counter", "gauge", "histogram"};
    stria__sb_t sb = {malloc(4096), 0, 4096, false};
    char val[64];

    if (sb.buf == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot render metrics");
    sb.buf[0] = '\0';
    pthread_mutex_lock(&reg->lock);
    for (stria__family_t *f = reg->families; f != NULL; f = f->next) {
        if (f->series == NULL)
            continue;
        stria__sb_printf(&sb, "# HELP %s ", f->name);
        stria__help_escape(&sb, f->help);
        stria__sb_printf(&sb, "\n# TYPE %s %s\n", f->name, types[f->kind]);
        for (stria_metric_t *m = f->series; m != NULL; m = m->next) {
            double v;
            __atomic_load(&m->value, &v, __ATOMIC_RELAXED);
            const char *sep = m->labels[0] ? "," : "";
            if (f->kind != STRIA_METRIC_HISTOGRAM) {
                stria__fmt_value(val, sizeof(val), v);
                if (m->labels[0])
                    stria__sb_printf(&sb, "%s{%s} %s\n", f->name, m->labels, val);
                else
                    stria__sb_printf(&sb, "%s %s\n", f->name, val);
                continue;
            }
            uint64_t cum = 0;
            for (size_t i = 0; i < f->n_buckets; i++) {
                cum += __atomic_load_n(&m->bucket_counts[i], __ATOMIC_RELAXED);
                stria__fmt_value(val, sizeof(val), f->buckets[i]);
                stria__sb_printf(&sb, "%s_bucket{%s%sle=\"%s\"} %llu\n", f->name, m->labels, sep,
                                 val, (unsigned long long)cum);
            }
            uint64_t count = __atomic_load_n(&m->count, __ATOMIC_RELAXED);
            stria__sb_printf(&sb, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", f->name, m->labels, sep,
                             (unsigned long long)count);
            stria__fmt_value(val, sizeof(val), v);
            if (m->labels[0]) {
                stria__sb_printf(&sb, "%s_sum{%s} %s\n", f->name, m->labels, val);
                stria__sb_printf(&sb, "%s_count{%s} %llu\n", f->name, m->labels,
                                 (unsigned long long)count);
            } else {
                stria__sb_printf(&sb, "%s_sum %s\n", f->name, val);
                stria__sb_printf(&sb, "%s_count %llu\n", f->name, (unsigned long long)count);
            }
        }
    }
    pthread_mutex_unlock(&reg->lock);
    if (sb.failed) {
        free(sb.buf);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot render metrics");
    }
    *text_out = sb.buf;
    *len_out = sb.len;
    return STRIA_OK;
}
