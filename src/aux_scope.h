/* train.aux_loss_scope: global_batch (docs/router.md). The load-balancing statistic of a step pooled
 * over every micro-step and every data-parallel rank of the optimizer step:
 *   aux = E Σ_e F_e P̄_e,  F_e = count_e / R,  P̄_e = psum_e / R,  R = n_moe × tokens of the step
 * Its gradient with respect to each row's probabilities, coef · E · count_e / R², needs the counts
 * of the whole step before the first micro-step's backward, so a forward-only pre-pass over the
 * step's micro-batches (the same sequences the micro-steps then train on) gathers them first.
 * On a pipeline the pre-pass is a forward-only pass through the stages; each stage counts its own
 * layers, the pipeline sums them, and every rank gets the same aux_dp for its layers' routers. */
#ifndef MT_AUX_SCOPE_H
#define MT_AUX_SCOPE_H

#include <stdint.h>

#include "comm.h"
#include "config.h"
#include "data.h"
#include "model.h"
#include "step_batch.h"

struct aux_prepass {
    const struct step_batch *batch;   /* the step's micro-batches, loaded (step_batch.h) */
    struct comm *stage_h;       /* host statistics all-reduce over the stage's ranks */
    int64_t tokens_micro_global;
    /* pp > 1: the backend's and a host comm of this rank's pipeline; the pre-pass is then a
     * pipelined forward (pipeline_forward.h). NULL otherwise. */
    struct comm *pp, *pp_h;
};

/* Runs the pre-pass of optimizer step `step` (1-based) and returns the step's aux statistic;
 * aux_dp[E] = d(coef · aux)/dP[row, e] for model_backward. */
double aux_global_prepass(struct model *m, const struct aux_prepass *a, int step, double coef,
                          float *aux_dp);

#endif
