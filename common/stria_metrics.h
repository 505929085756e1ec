/*
 * stria metrics: a registry of counters, gauges and histograms rendered in
 * the Prometheus text exposition format 0.0.4, for the daemons' /metrics.
 *
 * Ownership: a registry owns its families and series; a handle of
 * stria_metrics_get() is valid until stria_metrics_destroy(), or until
 * stria_metrics_forget() removes its series. Rendered text is the caller's
 * (free()). Threads: thread-safe. stria_metrics_get(), stria_metrics_forget()
 * and stria_metrics_render() take the registry's lock; stria_metric_add(),
 * stria_metric_set() and stria_metric_observe() take none (atomics), so hot
 * paths update a handle looked up once.
 */
#ifndef STRIA_METRICS_H
#define STRIA_METRICS_H

#include <stddef.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

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

#ifdef __cplusplus
}
#endif

#endif /* STRIA_METRICS_H */
