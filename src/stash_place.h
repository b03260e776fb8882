/* Where a layer's parked expert rows (parallel.expert_wgrad_group, model.h struct
 * expert_wgrad_stash) can lie in other layers' expert weight gradients (MT_STASH_IN_GRADS).
 *
 * Why it is safe: a layer whose group holds all of a step's micro-steps writes its expert
 * gradients first in the step's last backward (the one overwriting pass, nothing zeroes them before
 * it), and they are read by the gradient norm and AdamW after that backward; until then their
 * memory holds nothing. A higher layer's parked rows are read by its own grouped weight gradient in
 * that same last backward, which reaches the higher layer first. So rows parked by layer l may lie
 * in the gradients of a host layer below l, never of l itself or above.
 *
 * One placement serves the plan (memory_estimate.c) and the model (moe_buffers.c), so that the
 * memory planned is the memory used. */
#ifndef MT_STASH_PLACE_H
#define MT_STASH_PLACE_H

#include <stdint.h>

#define MT_STASH_PLACE_ALIGN 256 /* bytes: every buffer starts on it (TMA wants 16) */

struct stash_host {
    int layer;      /* the layer whose expert gradients these are */
    int64_t bytes;  /* what can be used from their first aligned byte: stash_host_bytes */
};

/* A host of `bytes` starting anywhere: what is left from its first MT_STASH_PLACE_ALIGN boundary
 * on, at the least (the plan does not know the address, so the model counts as little) */
static inline int64_t stash_host_bytes(int64_t bytes)
{
    return bytes > MT_STASH_PLACE_ALIGN ? bytes - (MT_STASH_PLACE_ALIGN - 1) : 0;
}

struct stash_buf {
    int layer;      /* the layer that parks rows in it */
    int64_t bytes;
    int host;       /* out: index into the hosts, -1 where it did not fit */
    int64_t off;    /* out: byte offset in that host */
};

/* Places the buffers in the hosts: buffers of the lowest layer first (they have the fewest hosts
 * to choose from), each in the lowest host below its layer with room. Returns the bytes placed. */
int64_t stash_place(const struct stash_host *hosts, int n_hosts, struct stash_buf *bufs, int n_bufs);

/* The slots of the n-th grouping-capable MoE layer of a stage (counted from 0) when the first
 * n_layers pair, the first n_group of them group `group` micro-steps and the first n_big of those
 * big_group (model_enable_expert_wgrad_groups): the micro-steps it parks, 0 where it does not */
int stash_layer_slots(int n, int n_layers, int n_group, int group, int n_big, int big_group);

/* The rows a parked micro-step's buffers hold: one rank's T k without expert parallelism; with it
 * (the fixed exchange, model.h rows_cap) the exchange's first capacity, 25% over the mean rows a
 * rank receives, at most every rank's (moe_buffers.c moe_capacity). A step that needs more runs
 * again with more, and the model places its buffers again then (model_place_expert_stash). */
static inline int64_t stash_slot_rows(int64_t T, int64_t k, int ep)
{
    const int64_t mean = T * k, cap = mean + mean / 4 + 16;
    return ep > 1 ? (cap < mean * ep ? cap : mean * ep) : mean;
}

/* The four buffers of one parked micro-step of a layer, in the order of struct expert_rows_parked:
 * x_exp [R, H], act [max(R I, T Id)], d_gu [max(2 R I, 2 T Id)], d_y_exp [R, H], elements of
 * x_size bytes, R the rows they hold (stash_slot_rows), T the tokens of a micro-step. */
void stash_slot_bytes(int64_t R, int64_t T, int64_t H, int64_t I, int64_t Id, int64_t x_size, int64_t out[4]);

#endif
