/* The layer passes the step runs (model_step.c): attention_block.c and moe.c (the MLP: MoE or
 * dense by layer). They read and write the model's state (model.h), never the step. */
#ifndef MT_LAYER_H
#define MT_LAYER_H

#include "model.h"

/* attention: h_mid = h_in + Attn(norm(h_in)). Backward: m->d_h holds dL/dh_mid on entry and
 * dL/dh_in on return. */
void attention_forward(struct model *m, int l);
void attention_backward(struct model *m, int l);
/* MLP (MoE or dense by layer): out = h_mid + MLP(norm(h_mid)). Backward: m->d_h holds dL/dout on
 * entry and dL/dh_mid on return. */
void mlp_forward(struct model *m, int l, void *out);
void mlp_backward(struct model *m, int l);

#endif
