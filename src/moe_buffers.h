/* The MoE layer's buffers and the expert weight-gradient stash (moe_buffers.c). */
#ifndef MT_MOE_BUFFERS_H
#define MT_MOE_BUFFERS_H

#include <stdint.h>

struct model;
struct layer_acts;
struct expert_wgrad_stash;

/* Expert-side rows: layer buffers for R rows (and the shared backward scratch too). */
void moe_ensure_rows(struct model *m, struct layer_acts *a, int64_t R);
/* The shared backward scratch alone (d_x_exp ...) for R rows. */
void moe_ensure_scratch_rows(struct model *m, int64_t R);
/* The capacity a buffer that needs `need` rows (or pairs) is grown to, with ep > 1: 25% over the
 * larger of the need and the mean a rank receives (T·k rows, T·min(k, ep) pairs), which is what
 * the memory plan counts. Sized from the mean at the first use, the buffers are not grown again
 * (a synchronising free and allocation, ~ms each, in the middle of a step) until a rank's rows
 * pass 1.25x the mean; sized from the first micro-step's need, they grew each time the routing set
 * a new maximum (EP=2 bench step 4: 82.5 -> 83 GB and idle gaps of 8-12 ms on both GPUs). */
int64_t moe_capacity(int64_t need, int64_t mean);
/* Receiver-side pair arrays for P pairs (m->pairs), and unit weights for P·k slots. */
void moe_ensure_pairs(struct model *m, struct layer_acts *a, int64_t P);
/* Parks layer a's expert rows of this micro-step (inputs from the layer's activations, output
 * gradients from the backward scratch: x_exp, act, d_gu, d_y_exp and the expert offsets) in the
 * stash's next slot, by swapping buffers: the layer and the scratch get the slot's, grown first to
 * at least their capacities. */
void moe_stash_expert_rows(struct model *m, struct layer_acts *a, struct expert_wgrad_stash *s);
/* A stash that parks in place (expert_wgrad_stash.direct) does not swap: the layer's x_exp/act
 * point at the slot its next forward fills, or at its own buffers for a group's last micro-step;
 * moe_stash_expert_rows then only records the slot. No-op for a swapping stash. */
void moe_stash_point_rows(struct layer_acts *a, const struct expert_wgrad_stash *s);

#endif
