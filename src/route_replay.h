/* Routing replay (R3; docs/router.md).
 *
 * (a) Activation checkpointing: the forward keeps each MoE layer's routing ([T, k] expert ids and
 *     [T, k] fp32 gate weights per layer and micro-batch slot) and the backward's recompute
 *     uses it instead of its own top-k, so the recomputed route plan and all-to-all shapes are the
 *     forward's by construction. The dispatch itself is repeated.
 * (b) data.routing_replay: FILE: the experts every MoE layer chose at inference, per training
 *     sequence; training routes exactly there. Weights: the file's fp32 weights when it carries
 *     them (constants: the router then learns from the aux loss only), else the current router's
 *     probabilities gathered at the recorded experts, renormalised if norm_topk_prob, × route_scale
 *     (the router_gather_weights op; differentiable, as a normal routing).
 *
 * File format "MTROUTE1" (little-endian):
 *   header, 64 bytes: char magic[8] = "MTROUTE1"; u32 version = 1; u32 layers (MoE layers, in layer
 *   order); u32 top_k; u32 seq_len (tokens per sequence); u64 sequences; u32 index_width (2 = int16,
 *   4 = int32); u32 flags (bit 0: fp32 weights follow); u32 num_experts; 20 zero bytes.
 *   then for each sequence q = 0 .. sequences-1: ids [layers][seq_len][top_k] (index_width bytes
 *   each), then, with flag bit 0, weights [layers][seq_len][top_k] fp32.
 * Sequence q is the global sequence index of src/data.h: step s trains on q in [s GB, (s+1) GB). */
#ifndef MT_ROUTE_REPLAY_H
#define MT_ROUTE_REPLAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "model.h"

#define ROUTE_FILE_MAGIC "MTROUTE1"
#define ROUTE_FILE_VERSION 1u
#define ROUTE_FILE_HEADER 64
#define ROUTE_FILE_HAS_WEIGHTS 1u

struct route_file_header {
    uint32_t version, layers, top_k, seq_len;
    uint64_t sequences;
    uint32_t index_width, flags, num_experts;
};

/* Reads and checks the header of a routing file (magic, version, width, flags, size); false with
 * a one-line reason naming the file. */
bool route_file_read_header(const char *path, struct route_file_header *h, char *err, size_t cap);
/* Writes the 64-byte header. */
bool route_file_write_header(FILE *f, const struct route_file_header *h);

/* Opens data.routing_replay for model m: the file's layers, top-k, tokens per sequence and experts
 * must be the model's and the training's, it must hold the `needed` sequences the run trains on,
 * and every id must be a distinct expert of its token; false with a one-line reason. */
bool route_replay_open(struct model *m, const char *path, int64_t needed, char *err, size_t cap);

/* Loads the routing of sequences first .. first + B - 1 (the next forward's micro-batch) into
 * micro-batch slot `slot`, for the stage's MoE layers: a 1F1B stage runs other micro-batches'
 * forwards before this one's backward, whose recompute reads the slot again. */
void route_replay_load(struct model *m, int slot, int64_t first);

/* Paused, the forwards route on the model's own router (validation: held-out sequences have no
 * recorded routing); the recompute's saved routing (a) still works. */
void route_replay_pause(struct model *m, bool paused);

/* moe.c, after the router: replaces layer l's top-k (ids and weights) by the file's, or by the
 * forward's saved routing during a recompute, or saves it in a forward with checkpointing. */
void route_replay_apply(struct model *m, int l, int32_t *topk_idx, float *topk_w, const float *probs);

/* The file fixes the routing weights: the router gets no gradient through them. */
bool route_replay_weights_fixed(const struct model *m);

/* Bytes of device memory the saved routing of (a) takes: 8 × T × k per MoE layer of the stage
 * and micro-batch slot. */
size_t route_replay_bytes(const struct model *m);

void route_replay_free(struct model *m);

#endif
