/* A forward-only pass of one step's micro-batches through a pipeline (pp > 1): every micro-batch
 * goes through the stages in order (pipe_schedule_forward_only), its activations sent stage to
 * stage, no backward. The global-batch aux pre-pass (aux_scope.h) uses it for the whole step's
 * expert counts, the validation pass (validation.h) for the held-out loss. It borrows the 1F1B
 * slots, so it runs when no micro-batch of a training step is in flight. */
#ifndef MT_PIPELINE_FORWARD_H
#define MT_PIPELINE_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "comm.h"
#include "model.h"
#include "step_batch.h"

struct pipe_forward {
    struct model *m;            /* one stage (model_init_stage) */
    struct comm *pp;            /* the backend's comm of this rank's pipeline: rank = stage */
    const struct step_batch *b; /* this rank's micro-batches, loaded */
    bool replay;                /* load each micro-batch's recorded routing (data.routing_replay)... */
    int64_t step;               /* ...of this 0-based step (data_first_seq) */
    struct comm *stage_h;       /* with stats_sum: host, the stage's ranks */
    float *stats_sum;           /* [L, 2, E] or NULL: += each micro-batch's router statistics of the
                                 * stage's layers summed over stage_h (other layers' rows stay) */
    /* results on this rank: the last stage's CE sum and labelled positions, 0 on the others */
    double ce_sum;
    int64_t n_valid;
};

/* Runs the pass; every rank of the pipeline calls it together. */
void pipe_forward_run(struct pipe_forward *f);

#endif
