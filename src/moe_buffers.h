/* The MoE layer's buffers and the expert weight-gradient stash (moe_buffers.c). */
#ifndef MT_MOE_BUFFERS_H
#define MT_MOE_BUFFERS_H

#include <stdint.h>

struct model;
struct layer_acts;
struct expert_wgrad_stash;

/* Expert-side rows: layer buffers for R rows (and the shared backward scratch too). */
void moe_ensure_rows(struct model *m, struct layer_acts *a, int64_t R);
/* Receiver-side pair arrays for P pairs (m->pairs), and unit weights for P·k slots. */
void moe_ensure_pairs(struct model *m, struct layer_acts *a, int64_t P);
/* Parks layer a's expert rows of this micro-step (inputs from the layer's activations, output
 * gradients from the backward scratch: x_exp, act, d_gu, d_y_exp and the expert offsets) in the
 * stash's next slot, by swapping buffers: the layer and the scratch get the slot's, grown first to
 * at least their capacities. */
void moe_stash_expert_rows(struct model *m, struct layer_acts *a, struct expert_wgrad_stash *s);

#endif
