/* One micro-batch through a stage of the model, forward and backward (model_step.c). The model's
 * state, buffers and bindings are model.h's; the layer passes it calls are layer.h's. */
#ifndef MT_MODEL_STEP_H
#define MT_MODEL_STEP_H

#include "model.h"

struct model_step_out {
    double ce_sum;       /* Σ over this rank's labelled tokens of the token cross-entropy */
    int64_t n_valid;     /* this rank's labelled tokens */
};

/* ids, labels: HOST [B, S] of this rank's micro-batch (labels NULL = the ids). As in transformers,
 * position t is trained to predict labels[t + 1] of the same sequence; the last position and labels
 * equal to MT_IGNORE_INDEX count for nothing.
 * model_stage_forward runs the stage on micro-batch `slot`: the first stage embeds ids, another
 * stage reads its input from model_stage_input (received before the call); the last stage runs the
 * head and the loss (out: CE sum and labelled tokens; zeros elsewhere), another leaves its output in
 * model_stage_output. Router statistics of the stage's layers: m->stats_h after return (per layer
 * psum[E] then count[E]; other stages' rows are zero). */
void model_stage_forward(struct model *m, int slot, const int32_t *ids_host, const int32_t *labels_host,
                         struct model_step_out *out);
/* Backward of ce_scale · Σ CE + Σ_e aux_dp[e] · Σ_rows P[row, e] (aux_dp: HOST [E], NULL = none)
 * for micro-batch `slot`. A non-last stage reads dL/d(output) from m->d_h; a non-first stage leaves
 * dL/d(input) in m->d_h. Gradients accumulate. */
void model_stage_backward(struct model *m, int slot, float ce_scale, const float *aux_dp_host);
/* Training: the next head forwards compute the loss gradient with ce_scale (the backward's) in the
 * same pass over the logits (ops.h cross_entropy_fused), unless MT_UNFUSED_LOSS=1 (a benchmarking
 * switch: the forward and backward kernels apart). Disarmed, a forward leaves the logits. */
void model_arm_loss_gradient(struct model *m, float ce_scale);
void model_disarm_loss_gradient(struct model *m);
/* The whole model (a single stage, slot 0). */
void model_forward(struct model *m, const int32_t *ids_host, const int32_t *labels_host,
                   struct model_step_out *out);
void model_backward(struct model *m, float ce_scale, const float *aux_dp_host);

#endif
