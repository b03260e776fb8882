/* Training FLOPs per token, the convention of spec §9: 6 × matmul parameters touched per token
 * (attention projections, router, the k active experts or the dense MLP, lm_head; the embedding
 * lookup is free) plus causal attention 6 · L · Hq · D · (S + 1). */
#ifndef MT_FLOPS_H
#define MT_FLOPS_H

#include "config.h"

double flops_matmul_params_per_token(const struct model_config *m);
double flops_train_per_token(const struct model_config *m, int seq_len);

#endif
