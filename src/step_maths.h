/* The training step's arithmetic that the loop, the pipeline schedule, verify and the tests share:
 * the learning-rate schedule, transformers' load-balancing loss from the router statistics and
 * its gradient, and the aux-loss-free bias update. */
#ifndef MT_STEP_MATHS_H
#define MT_STEP_MATHS_H

#include <stdint.h>

#include "config.h"

/* Linear warmup to train.lr over warmup_steps, then cosine decay to min_lr at `steps`. step >= 1. */
double train_lr_at(const struct train_config *t, int step);

/* transformers' load-balancing statistic from per-layer router statistics stats[L][2][E] (psum then
 * count, summed over `tokens` tokens of every MoE layer): aux = E Σ_e F_e P̄_e with
 * F_e = count_e / rows, P̄_e = psum_e / rows, rows = (MoE layers) × tokens. */
void aux_from_stats(const float *stats, int n_layers_all, const struct model_config *mc,
                    int64_t tokens, double *aux, double *count_out);
/* d(scale · aux)/dP[row, e] = scale · E · count_e / rows², the same for every row. */
void aux_grad_from_counts(const double *count, int E, int n_moe, int64_t tokens, double scale,
                          float *aux_dp);

/* Aux-loss-free balancing: per MoE layer, bias[l, e] += rate · sign(mean load − load[l, e]) from
 * the step's global token counts counts[l, e]; the bias shifts expert selection only. */
void balance_bias_update(float *bias /*[L, E]*/, const double *counts /*[L, E]*/,
                         const struct model_config *mc, double rate);

#endif
