/* A training step's losses and router statistics without a host wait per micro-step.
 *
 * Without a pipeline, train.c arms this before each micro-step's forward: the forward copies its
 * per-token losses and router statistics to device buffers of the step (model.defer_losses /
 * defer_stats); train.c sums the statistics over the stage's ranks (data-parallel and EP peers)
 * with the backend's collective, queued on the device, and the aux loss's gradient is computed
 * there (ops.h aux_grad_from_stats); the host fetches everything once, after the step's last
 * backward, for the metrics. The host sums in the same order as the per-micro-step path, so on the
 * CPU backend (MPI either way) the step's loss, aux loss and expert loads are the same bits; on
 * GPUs the statistics' sum over ranks is NCCL's instead of MPI's (the routing-probability sums may
 * differ in the last bits; the expert counts are exact). MT_STEP_SYNC=1 keeps the per-micro-step
 * path, which a pipeline always takes (its stages sum their layers' statistics as they go). */
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

/* Whether the deferred path applies to a run: one stage (pp 1) and MT_STEP_SYNC not set. */
bool step_stats_applies(int pp);
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
/* Micro-step `micro`'s statistics on the device [L, 2, E] (NULL without experts), for the sum over
 * the stage and the aux gradient before its backward. */
float *step_stats_router_device(struct step_stats *s, int micro);

#endif
