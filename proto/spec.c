#include "stria_spec.h"

#include <stdlib.h>
#include <string.h>

bool stria_job_masks_copy(const Stria__V1__JobSpec *s, stria_job_masks_t *m)
{
    memset(m, 0, sizeof(*m));
    if (s->n_cu_seqlens > 0) {
        m->cu_seqlens = malloc(s->n_cu_seqlens * sizeof(int64_t));
        if (m->cu_seqlens == NULL)
            return false;
        memcpy(m->cu_seqlens, s->cu_seqlens, s->n_cu_seqlens * sizeof(int64_t));
        m->n_cu_seqlens = s->n_cu_seqlens;
    }
    m->has_window = s->window != NULL;
    m->window_left = s->window != NULL ? s->window->left : 0;
    m->window_right = s->window != NULL ? s->window->right : 0;
    return true;
}

void stria_job_masks_free(stria_job_masks_t *m)
{
    free(m->cu_seqlens);
    memset(m, 0, sizeof(*m));
}
