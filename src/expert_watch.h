/* Expert-collapse warnings for the step line (log.collapse_steps, log.load_warn; docs/router.md):
 * an expert of an MoE layer that got no tokens for collapse_steps steps in a row, or a layer whose
 * busiest expert took more than load_warn × the mean load. Every rank sees the same global counts,
 * so every rank computes the same warning; rank 0 prints it. */
#ifndef MT_EXPERT_WATCH_H
#define MT_EXPERT_WATCH_H

#include <stdbool.h>

#include "config.h"

struct expert_watch {
    int n_moe, E;
    int layer_id[MT_MAX_LAYERS];  /* model layer of MoE layer k */
    int collapse_steps;           /* 0 = off */
    double load_warn;             /* 0 = off */
    int *zero_streak;             /* [n_moe, E] steps in a row with no tokens */
    bool *over;                   /* [n_moe] the layer was over load_warn at the last step */
    char line[256];
};

void expert_watch_init(struct expert_watch *w, const struct model_config *mc, const struct log_config *lc);
void expert_watch_free(struct expert_watch *w);

/* Feeds one step's global routed-token counts tok[n_moe, E]; returns the warning text for this step
 * ("" = none). A collapse is reported when the streak reaches collapse_steps and again every
 * collapse_steps steps while it lasts; an overload when a layer crosses load_warn (not again until
 * it has come back under). One line names the first layer and expert and counts the others. */
const char *expert_watch_step(struct expert_watch *w, const double *tok);

/* With expert parallelism each EP rank holds experts [r E/ep, (r+1) E/ep) and waits at every
 * exchange for the busiest: the routed tokens of the busiest rank's experts over the mean rank's,
 * from one layer's counts tok[E] (1 = balanced; 1 when nothing was routed). ep must divide E. */
double expert_watch_rank_load_max(const double *tok, int E, int ep);

#endif
