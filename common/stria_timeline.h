/*
 * stria timeline: pictures of where a ring's time went, for stria-bench and
 * striactl.
 *
 * Per-rank timelines of ring passes drawn as one self-contained SVG file:
 * one panel per pass on a shared time axis, one row per rank, compute and
 * waits coloured, sends as a thin lane under each row, a legend, axis labels
 * and a title. Rows beyond STRIA_TIMELINE_MAX_ROWS are sampled evenly, and
 * every row is drawn at pixel resolution (each pixel takes the kind that
 * covers most of it), so the file stays small for rings of 1024 ranks.
 *
 * Ownership: a timeline owns copies of its title, subtitle, panel names and
 * notes, and its spans (stria_timeline_destroy()). Threads: a timeline is
 * used by one thread at a time.
 */
#ifndef STRIA_TIMELINE_H
#define STRIA_TIMELINE_H

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

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

#endif /* STRIA_TIMELINE_H */
