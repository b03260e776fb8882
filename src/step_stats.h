/* A training step's losses and router statistics without a host wait per micro-step.
 *
 * Where one rank holds a whole stage (no data-parallel or EP peers to sum the router statistics
 * with, no pipeline), train.c arms this before each micro-step's forward: the forward copies its
 * per-token losses and router statistics to device buffers of the step (model.defer_losses /
 * defer_stats), the aux loss's gradient is computed on the device (ops.h aux_grad_from_stats), and
 * the host fetches everything once, after the step's last backward, for the metrics. The sums are
 * made on the host in the same order as the per-micro-step path, so the step's loss, aux loss and
 * expert loads are the same bits either way. MT_STEP_SYNC=1 keeps the per-micro-step path. */
#ifndef MT_STEP_STATS_H
#define MT_STEP_STATS_H

#include <stdbool.h>

#include "model.h"

struct step_stats {
    const struct backend *be;
    int n_micro, T, L, E;
    float *losses;     /* dev [n_micro, T] per-token losses (the last stage's) */
    float *stats;      /* dev [n_micro, L, 2, E] router statistics; NULL without experts */
    float *losses_h;   /* host copies, after step_stats_fetch */
    float *stats_h;
};

/* Whether the deferred path applies to a run: one stage (pp 1) whose group is this rank alone, and
 * MT_STEP_SYNC not set. */
bool step_stats_applies(int pp, int stage_group_size);
void step_stats_init(struct step_stats *s, const struct model *m, int n_micro);
void step_stats_free(struct step_stats *s);
/* Points m's forward at micro-step `micro`'s slots (arm) or back at the host path (disarm). */
void step_stats_arm(struct step_stats *s, struct model *m, int micro);
void step_stats_disarm(struct model *m);
/* Waits for the step's work and brings the first n_micro micro-steps' buffers to the host. */
void step_stats_fetch(struct step_stats *s, int n_micro);
/* Micro-step `micro`'s loss sum over its tokens (fp64, token order) and its statistics [L, 2, E]. */
double step_stats_ce_sum(const struct step_stats *s, int micro);
const float *step_stats_router(const struct step_stats *s, int micro);

#endif
