/* Per-rank timelines of ring passes as one self-contained SVG (see
 * stria_timeline.h): the one place that draws them, for stria-bench and
 * striactl. */
#include "stria_timeline.h"
#include "stria_util.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double begin, end;
    int row;
    stria_timeline_kind_t kind;
} stria__tl_span_t;

typedef struct {
    char *name, *note;
    int n_rows;
    double end;
    bool end_set;
    stria__tl_span_t *spans;
    size_t n_spans, cap;
} stria__tl_panel_t;

struct stria_timeline {
    char *title, *subtitle;
    stria__tl_panel_t *panels;
    int n_panels;
};

/* Geometry, in pixels. */
enum {
    TL_W = 1100,   /* whole picture */
    TL_LEFT = 78,  /* row labels */
    TL_RIGHT = 24, /* margin */
    TL_PW = TL_W - TL_LEFT - TL_RIGHT,
    TL_HEAD = 84, /* title, subtitle, legend */
    TL_PANEL_GAP = 16,
    TL_PANEL_TITLE = 18,
    TL_AXIS = 46,
};

static char *stria__tl_dup(const char *s)
{
    return s != NULL ? strdup(s) : NULL;
}

/* What a panel owns (its fields zeroed or set by stria_timeline_panel). */
static void stria__tl_panel_free(stria__tl_panel_t *p)
{
    free(p->name);
    free(p->note);
    free(p->spans);
}

void stria_timeline_destroy(stria_timeline_t *tl)
{
    if (tl == NULL)
        return;
    for (int i = 0; i < tl->n_panels; i++)
        stria__tl_panel_free(&tl->panels[i]);
    free(tl->panels);
    free(tl->title);
    free(tl->subtitle);
    free(tl);
}

stria_status_t stria_timeline_create(const char *title, const char *subtitle,
                                     stria_timeline_t **out)
{
    if (out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_timeline_create: out is NULL");
    stria_timeline_t *tl = calloc(1, sizeof(*tl));
    if (tl == NULL || (title != NULL && (tl->title = strdup(title)) == NULL) ||
        (subtitle != NULL && (tl->subtitle = strdup(subtitle)) == NULL)) {
        stria_timeline_destroy(tl);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "timeline: out of memory");
    }
    *out = tl;
    return STRIA_OK;
}

stria_status_t stria_timeline_panel(stria_timeline_t *tl, const char *name, const char *note,
                                    int n_rows, int *panel)
{
    stria__tl_panel_t *grown;
    if (tl == NULL || panel == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_timeline_panel: NULL argument");
    if (n_rows < 1 || n_rows > 65536)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "timeline panel '%s': %d rows (must be 1..65536)",
                               name != NULL ? name : "", n_rows);
    grown = realloc(tl->panels, (size_t)(tl->n_panels + 1) * sizeof(*grown));
    if (grown == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "timeline: out of memory");
    tl->panels = grown;
    stria__tl_panel_t *p = &tl->panels[tl->n_panels];
    memset(p, 0, sizeof(*p));
    p->name = stria__tl_dup(name != NULL ? name : "");
    p->note = stria__tl_dup(note);
    p->n_rows = n_rows;
    if (p->name == NULL || (note != NULL && p->note == NULL)) {
        stria__tl_panel_free(p);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "timeline: out of memory");
    }
    *panel = tl->n_panels++;
    return STRIA_OK;
}

stria_status_t stria_timeline_span(stria_timeline_t *tl, int panel, int row,
                                   stria_timeline_kind_t kind, double begin, double end)
{
    if (tl == NULL || panel < 0 || panel >= tl->n_panels)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "timeline: no panel %d", panel);
    stria__tl_panel_t *p = &tl->panels[panel];
    if (row < 0 || row >= p->n_rows)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "timeline panel '%s': no row %d of %d",
                               p->name, row, p->n_rows);
    if (kind < STRIA_TIMELINE_COMPUTE || kind > STRIA_TIMELINE_SEND)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "timeline panel '%s': unknown kind %d",
                               p->name, (int)kind);
    if (!isfinite(begin) || !isfinite(end) || begin < 0 || end < begin)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "timeline panel '%s', row %d: span [%g, %g] is not a time range",
                               p->name, row, begin, end);
    stria__tl_span_t *grown = stria_grow(p->spans, &p->cap, p->n_spans + 1, sizeof(*grown), 256);
    if (grown == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "timeline: out of memory");
    p->spans = grown;
    p->spans[p->n_spans++] = (stria__tl_span_t){begin, end, row, kind};
    return STRIA_OK;
}

void stria_timeline_panel_end(stria_timeline_t *tl, int panel, double end)
{
    if (tl == NULL || panel < 0 || panel >= tl->n_panels || !isfinite(end) || end < 0)
        return;
    tl->panels[panel].end = end;
    tl->panels[panel].end_set = true;
}

/* ---- drawing -------------------------------------------------------------- */

typedef struct {
    FILE *f;
    double t_max; /* the shared axis: 0 .. t_max seconds */
    double px_s;  /* pixels per second */
    double unit;  /* seconds per axis unit */
    const char *unit_name;
} stria__tl_draw_t;

static void stria__tl_text(FILE *f, const char *s)
{
    static const char special[] = "&<>\"";
    static const char *const entity[] = {"&amp;", "&lt;", "&gt;", "&quot;"};
    for (; s != NULL && *s; s++) {
        const char *sp = strchr(special, *s);
        if (sp != NULL)
            fputs(entity[sp - special], f);
        else if ((unsigned char)*s >= 0x20 || *s == '\t')
            fputc(*s, f);
    }
}

static double stria__tl_panel_end(const stria__tl_panel_t *p)
{
    double end = 0;
    if (p->end_set)
        return p->end;
    for (size_t i = 0; i < p->n_spans; i++)
        end = p->spans[i].end > end ? p->spans[i].end : end;
    return end;
}

/* Rows drawn and their height. */
static int stria__tl_drawn(const stria__tl_panel_t *p)
{
    return p->n_rows < STRIA_TIMELINE_MAX_ROWS ? p->n_rows : STRIA_TIMELINE_MAX_ROWS;
}

static int stria__tl_row_h(int drawn)
{
    return drawn <= 16 ? 16 : drawn <= 64 ? 8 : 4;
}

/* The rank drawn as row i of `drawn`. */
static int stria__tl_row_rank(const stria__tl_panel_t *p, int i, int drawn)
{
    if (drawn == p->n_rows)
        return i;
    return (int)llround((double)i * (p->n_rows - 1) / (double)(drawn - 1));
}

static int stria__tl_panel_h(const stria__tl_panel_t *p)
{
    int drawn = stria__tl_drawn(p);
    return TL_PANEL_TITLE + drawn * stria__tl_row_h(drawn);
}

/* Adds the part of [b, e] that falls in each pixel to cov[pixel]. */
static void stria__tl_cover(double *cov, double px_s, double b, double e)
{
    double x0 = b * px_s, x1 = e * px_s;
    if (x1 > TL_PW)
        x1 = TL_PW;
    for (int x = (int)x0; x < TL_PW && x < x1; x++) {
        double lo = x0 > x ? x0 : x, hi = x1 < x + 1 ? x1 : x + 1;
        if (hi > lo)
            cov[x] += hi - lo;
    }
}

/* The kind of pixel x: 1 + the index of its largest cover above half a
 * pixel, or 0. */
static int stria__tl_kind(const double *cov[3], int x)
{
    int k = 0;
    double best = 0.5;
    for (int c = 0; c < 3; c++)
        if (cov[c] != NULL && cov[c][x] > best) {
            best = cov[c][x];
            k = c + 1;
        }
    return k;
}

/* Emits runs of pixels whose kind is `want`, as rects of class cls. */
static void stria__tl_runs(FILE *f, const double *cov[3], int want, const char *cls, int y, int h)
{
    for (int x = 0; x < TL_PW;) {
        if (stria__tl_kind(cov, x) != want) {
            x++;
            continue;
        }
        int x_end = x + 1;
        while (x_end < TL_PW && stria__tl_kind(cov, x_end) == want)
            x_end++;
        fprintf(f, "<rect class=\"%s\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\"/>", cls,
                TL_LEFT + x, y, x_end - x, h);
        x = x_end;
    }
}

static stria_status_t stria__tl_draw_panel(const stria__tl_draw_t *d, const stria__tl_panel_t *p,
                                           int y0)
{
    FILE *f = d->f;
    const int drawn = stria__tl_drawn(p), rh = stria__tl_row_h(drawn);
    const int lane = rh >= 8 ? rh - 4 : rh - 1, label_every = rh >= 8 ? 1 : 16;
    double *all = calloc((size_t)(3 * TL_PW) * (size_t)drawn, sizeof(double));
    int *row_of = malloc((size_t)p->n_rows * sizeof(int));

    if (all == NULL || row_of == NULL) {
        free(all);
        free(row_of);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "timeline: out of memory");
    }
    for (int r = 0; r < p->n_rows; r++)
        row_of[r] = -1;
    for (int i = 0; i < drawn; i++)
        row_of[stria__tl_row_rank(p, i, drawn)] = i;
    for (size_t s = 0; s < p->n_spans; s++) { /* each drawn row's cover, per kind */
        const stria__tl_span_t *sp = &p->spans[s];
        if (row_of[sp->row] >= 0)
            stria__tl_cover(all + ((size_t)row_of[sp->row] * 3 + (sp->kind - 1)) * TL_PW, d->px_s,
                            sp->begin, sp->end);
    }
    fprintf(f, "<g class=\"panel\" data-rows=\"%d\" data-drawn=\"%d\" data-name=\"", p->n_rows,
            drawn);
    stria__tl_text(f, p->name);
    fprintf(f, "\">\n<text class=\"panel-title\" x=\"%d\" y=\"%d\">", TL_LEFT, y0 + 13);
    stria__tl_text(f, p->name);
    if (p->note != NULL) {
        fputs("<tspan class=\"note\" dx=\"6\">\xe2\x80\x94 ", f);
        stria__tl_text(f, p->note);
        fputs("</tspan>", f);
    }
    fputs("</text>\n", f);
    for (int i = 0; i < drawn; i++) {
        const int rank = stria__tl_row_rank(p, i, drawn), y = y0 + TL_PANEL_TITLE + i * rh;
        const double *cov = all + (size_t)i * 3 * TL_PW;
        fprintf(f, "<g class=\"row\" data-rank=\"%d\">", rank);
        if (i % label_every == 0)
            fprintf(f, "<text class=\"row-label\" x=\"%d\" y=\"%d\">rank %d</text>", TL_LEFT - 6,
                    y + lane - (rh >= 8 ? 1 : -2), rank);
        fprintf(f, "<rect class=\"bg\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\"/>", TL_LEFT, y,
                (int)ceil(stria__tl_panel_end(p) * d->px_s), lane);
        const double *main_lane[3] = {cov, cov + TL_PW, NULL};
        const double *send_lane[3] = {NULL, NULL, cov + 2 * TL_PW};
        stria__tl_runs(f, main_lane, STRIA_TIMELINE_COMPUTE, "compute", y, lane);
        stria__tl_runs(f, main_lane, STRIA_TIMELINE_WAIT, "wait", y, lane);
        if (rh >= 8)
            stria__tl_runs(f, send_lane, STRIA_TIMELINE_SEND, "send", y + lane, 2);
        fputs("</g>\n", f);
    }
    fputs("</g>\n", f);
    free(all);
    free(row_of);
    return STRIA_OK;
}

/* A tick step of 1, 2 or 5 times a power of ten giving about 8 ticks. */
static double stria__tl_tick(double span)
{
    double raw = span / 8, p10 = pow(10, floor(log10(raw)));
    double m = raw / p10;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p10;
}

static void stria__tl_axis(const stria__tl_draw_t *d, int y_top, int y_axis)
{
    FILE *f = d->f;
    double step = stria__tl_tick(d->t_max);
    fputs("<g class=\"axis\">\n", f);
    for (int i = 0; i * step <= d->t_max * 1.0001; i++) {
        double x = TL_LEFT + i * step * d->px_s;
        fprintf(f, "<line class=\"grid\" x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\"/>", x, y_top,
                x, y_axis);
        fprintf(f, "<line class=\"tick\" x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\"/>", x, y_axis,
                x, y_axis + 5);
        fprintf(f, "<text class=\"tick-label\" x=\"%.1f\" y=\"%d\">%g</text>\n", x, y_axis + 17,
                i * step / d->unit);
    }
    fprintf(f, "<line class=\"tick\" x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/>\n", TL_LEFT, y_axis,
            TL_LEFT + TL_PW, y_axis);
    fprintf(f,
            "<text class=\"axis-label\" x=\"%d\" y=\"%d\">time since the pass began (%s)</text>\n",
            TL_LEFT + TL_PW / 2, y_axis + 36, d->unit_name);
    fputs("</g>\n", f);
}

static void stria__tl_legend(FILE *f, int y)
{
    static const struct {
        const char *cls, *label;
    } items[] = {{"compute", "compute"},
                 {"wait", "waiting on the ring link"},
                 {"send", "K/V (and dK/dV) send in flight"},
                 {"bg", "other host work / done"}};
    int x = TL_LEFT;
    fputs("<g class=\"legend\">\n", f);
    for (size_t i = 0; i < sizeof(items) / sizeof(items[0]); i++) {
        fprintf(f, "<rect class=\"%s\" x=\"%d\" y=\"%d\" width=\"14\" height=\"10\"/>",
                items[i].cls, x, y - 9);
        fprintf(f, "<text class=\"legend-label\" x=\"%d\" y=\"%d\">%s</text>\n", x + 19, y,
                items[i].label);
        x += 40 + 7 * (int)strlen(items[i].label);
    }
    fputs("</g>\n", f);
}

static const char stria__tl_style[] =
    "<style>\n"
    "text{font-family:sans-serif;font-size:11px;fill:#222}\n"
    ".title{font-size:16px;font-weight:bold}.subtitle{fill:#555}\n"
    ".panel-title{font-size:12px;font-weight:bold}.note{font-weight:normal;fill:#444}\n"
    ".row-label{text-anchor:end;font-size:9px;fill:#555}\n"
    ".tick-label{text-anchor:middle}.axis-label{text-anchor:middle;font-size:12px}\n"
    ".compute{fill:#2f6fb0}.wait{fill:#f0a030}.send{fill:#3a9a4a}.bg{fill:#e6e6e6}\n"
    ".grid{stroke:#ccc;stroke-width:0.5}.tick{stroke:#333;stroke-width:1}\n"
    "</style>\n";

stria_status_t stria_timeline_write_svg(const stria_timeline_t *tl, const char *path)
{
    stria__tl_draw_t d = {0};
    stria_status_t st = STRIA_OK;
    int height = TL_HEAD + TL_AXIS, y;

    if (tl == NULL || path == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_timeline_write_svg: NULL argument");
    if (tl->n_panels == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "timeline %s: no panel to draw", path);
    for (int i = 0; i < tl->n_panels; i++) {
        double e = stria__tl_panel_end(&tl->panels[i]);
        d.t_max = e > d.t_max ? e : d.t_max;
        height += stria__tl_panel_h(&tl->panels[i]) + TL_PANEL_GAP;
    }
    if (d.t_max <= 0)
        d.t_max = 1e-3;
    d.px_s = TL_PW / d.t_max;
    d.unit = d.t_max >= 2 ? 1 : d.t_max >= 2e-3 ? 1e-3 : 1e-6;
    d.unit_name = d.unit == 1 ? "s" : d.unit == 1e-3 ? "ms" : "us";
    if ((d.f = fopen(path, "w")) == NULL)
        return stria_error_set(STRIA_ERR_IO, "cannot write the timeline %s: %s", path,
                               strerror(errno));
    fprintf(d.f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\">\n",
            TL_W, height, TL_W, height);
    fputs(stria__tl_style, d.f);
    fprintf(d.f, "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"#fff\"/>\n", TL_W,
            height);
    fputs("<text class=\"title\" x=\"12\" y=\"24\">", d.f);
    stria__tl_text(d.f, tl->title);
    fputs("</text>\n<text class=\"subtitle\" x=\"12\" y=\"44\">", d.f);
    stria__tl_text(d.f, tl->subtitle);
    fputs("</text>\n", d.f);
    stria__tl_legend(d.f, 68);
    y = TL_HEAD;
    for (int i = 0; i < tl->n_panels && st == STRIA_OK; i++) {
        st = stria__tl_draw_panel(&d, &tl->panels[i], y);
        y += stria__tl_panel_h(&tl->panels[i]) + TL_PANEL_GAP;
    }
    stria__tl_axis(&d, TL_HEAD, y - TL_PANEL_GAP + 4);
    fputs("</svg>\n", d.f);
    if (fclose(d.f) != 0 && st == STRIA_OK)
        st = stria_error_set(STRIA_ERR_IO, "cannot write the timeline %s: %s", path,
                             strerror(errno));
    return st;
}
