#include "step_stats.h"

#include <stdlib.h>

#include "common.h"
#include "env_flag.h"

bool step_stats_applies(int pp)
{
    return pp == 1 && !mt_env_flag("MT_STEP_SYNC");
}

void step_stats_init(struct step_stats *s, const struct model *m, int n_micro)
{
    s->be = m->be;
    s->n_micro = n_micro, s->T = m->T, s->L = m->L, s->E = m->E;
    const size_t nl = (size_t)n_micro * s->T, ns = (size_t)n_micro * s->L * 2 * MT_MAX(s->E, 1);
    s->losses = s->be->alloc(nl * sizeof(float));
    s->losses_h = mt_calloc(nl, sizeof(float));
    s->stats = s->E > 0 ? s->be->alloc(ns * sizeof(float)) : NULL;
    s->stats_h = s->E > 0 ? mt_calloc(ns, sizeof(float)) : NULL;
}

void step_stats_free(struct step_stats *s)
{
    if (s->losses) s->be->free(s->losses);
    if (s->stats) s->be->free(s->stats);
    free(s->losses_h);
    free(s->stats_h);
    s->losses = s->stats = s->losses_h = s->stats_h = NULL;
}

void step_stats_arm(struct step_stats *s, struct model *m, int micro)
{
    MT_CHECK(micro >= 0 && micro < s->n_micro, "step_stats: micro-step %d of %d", micro, s->n_micro);
    m->defer_losses = s->losses + (size_t)micro * s->T;
    m->defer_stats = s->stats ? s->stats + (size_t)micro * s->L * 2 * s->E : NULL;
}

void step_stats_disarm(struct model *m)
{
    m->defer_losses = m->defer_stats = NULL;
}

float *step_stats_router_device(struct step_stats *s, int micro)
{
    return s->stats ? s->stats + (size_t)micro * s->L * 2 * s->E : NULL;
}

void step_stats_fetch(struct step_stats *s, int n_micro)
{
    s->be->download(s->losses_h, s->losses, (size_t)n_micro * s->T * sizeof(float));
    if (s->stats) s->be->download(s->stats_h, s->stats, (size_t)n_micro * s->L * 2 * s->E * sizeof(float));
}

double step_stats_ce_sum(const struct step_stats *s, int micro)
{
    const float *l = s->losses_h + (size_t)micro * s->T;
    double sum = 0;
    for (int t = 0; t < s->T; t++) sum += l[t];
    return sum;
}

const float *step_stats_router(const struct step_stats *s, int micro)
{
    return s->stats_h ? s->stats_h + (size_t)micro * s->L * 2 * s->E : NULL;
}
