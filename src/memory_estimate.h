/* Per-rank memory estimate of a training run, derived from the tensor spec table and the grid.
 *
 * Every rank of a stage reserves equally sized (padded) shards (tensor_shard_of pads uneven splits to
 * the same row count on every rank of a group), so the estimate is per stage. Precision rules follow
 * design.md "Precision" for model.precision bf16; for precision fp32 weights and activations are fp32
 * and the fp32 weights double as the master copy. */
#ifndef MT_MEMORY_ESTIMATE_H
#define MT_MEMORY_ESTIMATE_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "mesh.h"
#include "tensors.h"

/* Whole-model parameter counts (unsharded). */
struct model_counts {
    int64_t total;
    int64_t expert;        /* TK_EXPERT tensors */
    int64_t non_expert;    /* everything else, the embedding and lm_head included */
    int64_t active;        /* per token: non_expert + expert * top_k / num_experts */
};

struct stage_estimate {
    int stage;
    int layer0, layer1;           /* layers [layer0, layer1) */
    int n_moe_layers;             /* layers of the stage with routed experts */
    bool has_embed, has_head;     /* embedding / final norm + lm_head live here */
    int64_t dense_numel;          /* non-expert shard of one rank, padded elements */
    int64_t expert_numel;         /* expert shard of one rank, padded elements */
    int64_t work_numel;           /* the stage's tensors, gathered (the model's working layout) */
    double param_bytes;           /* working weights + the shard's copy (compute dtype) */
    double grad_bytes;            /* fp32 working gradients + the shard's reduced gradient */
    double master_bytes;          /* fp32 master weights of the shard */
    double adam_bytes;            /* Adam first and second moments, fp32 */
    double act_bytes;             /* activations saved for backward, one micro-batch */
    double stash_in_grads_bytes;  /* of the parked expert rows, what lies in lower layers' expert
                                   * gradients (MT_STASH_IN_GRADS), not counted in act_bytes */
    double buffer_bytes;          /* collective staging and backward scratch */
    bool keep_copy;               /* a compute-dtype copy of the shard is kept (train.weight_copy) */
    int slots;                    /* micro-batches in flight (1F1B: min(pp - stage, micro-steps)) */
    double total_bytes;
};

void estimate_model_counts(const struct tensor_table *tt, const struct model_config *m,
                           struct model_counts *out);

/* Estimate for any rank of `stage` (tt built from c->model, d from mesh_dims_of) with or without
 * the shard's compute copy. */
void estimate_stage(const struct config *c, const struct tensor_table *tt, const struct mesh_dims *d,
                    int stage, bool keep_copy, struct stage_estimate *out);
/* The share of a device's memory the auto settings plan up to. The estimate comes within ~1% of
 * the allocator's measured peak on one GPU and 3.6% under it at EP=2 (expert rows past their 25%
 * headroom; docs/benchmarks.md); the rest is for the CUDA context (~2 GiB), NCCL and cuBLAS
 * workspaces and fragmentation. The wgrad pairs, granted last and only for speed, plan up to a
 * little more: on one H200 at the bench shape 80% left 2 of 8 layers unpaired (4 ms a step) at
 * 81% of the card in use. */
#define MT_AUTO_MEM_SHARE 0.80
#define MT_PAIRS_MEM_SHARE 0.85
/* Auto groups plan up to a little more again (with EP their parked rows at a bound): at 85% an
 * H200 grouped 3 of the bench's 8 layers (-0.4% a step against pairs) where all 8 (-0.9%) needed
 * 89% of the card (sixteenth session); at 94% instead of 90% eights in 5 of 8 layers instead of
 * 3, the step 0.6-0.8% shorter with the gradient norm's fold, 132.4 of 139.8 GiB in use with the
 * CUDA context (plan 130.7, measured peak 130.4: docs/benchmarks.md, fifty-seventh session). */
#define MT_GROUP_MEM_SHARE 0.94
/* parallel.expert_wgrad_group auto: the group tried after pairs in every layer, and the one tried
 * after that in every layer */
#define MT_WGRAD_AUTO_GROUP 4
#define MT_WGRAD_AUTO_GROUP_MAX 8
/* The largest stage's total. */
double estimate_peak_bytes(const struct config *c, const struct mesh_dims *d, bool keep_copy);
/* train.weight_copy resolved: keep / cast as set; auto keeps the copy when the plan with it fits in
 * MT_AUTO_MEM_SHARE of device_bytes (<= 0: unknown,
 * keep), or when it needs no more memory than casting. */
bool estimate_keep_copy(const struct config *c, const struct mesh_dims *d, double device_bytes);
/* parallel.reduce_grads resolved: step or micro_step as set; auto is step when the peak with it
 * (and keep_copy) is at most MT_AUTO_MEM_SHARE of device_bytes, micro_step off a device (device_bytes 0). */
enum mt_reduce_grads estimate_reduce_grads(const struct config *c, const struct mesh_dims *d, bool keep_copy,
                                           double device_bytes);
/* parallel.reshard_after_forward resolved: as set, or (auto) false when the peak with every layer
 * kept gathered (given keep_copy and c's resolved reduce_grads) is at most MT_AUTO_MEM_SHARE of device_bytes;
 * true off a device. */
bool estimate_reshard(const struct config *c, const struct mesh_dims *d, bool keep_copy, double device_bytes);

/* parallel.expert_wgrad_pairs resolved to the number of each stage's MoE layers that pair (0: off;
 * MT_MAX_LAYERS: all): as set (true: c's wgrad_pair_layers), or (auto) where it helps (a GPU, bf16,
 * more than one micro-step, moe_chunks 1, expert gradients kept over the step) as many layers as
 * keep the peak with their stashes (given c's other resolved settings) at most MT_PAIRS_MEM_SHARE
 * of device_bytes. resolve writes it into c (expert_wgrad_pairs true or false, wgrad_pair_layers). */
int estimate_expert_wgrad_pair_layers(const struct config *c, const struct mesh_dims *d, bool keep_copy,
                                      double device_bytes);
void estimate_resolve_expert_wgrad_pairs(struct config *c, const struct mesh_dims *d, bool keep_copy,
                                         double device_bytes);
/* The same call also resolves parallel.expert_wgrad_group into wgrad_group (2 .. 8) and
 * wgrad_group_layers (how many of the pairing layers, their first ones, group; MT_MAX_LAYERS: all):
 * as set, or (0, auto) groups of MT_WGRAD_AUTO_GROUP where every layer pairs and the peak stays
 * within MT_GROUP_MEM_SHARE with them, and groups of MT_WGRAD_AUTO_GROUP_MAX where every layer
 * takes those and the peak still stays within it; where it does not (unless MT_WGRAD_GROUP_MIX=0),
 * groups of MT_WGRAD_AUTO_GROUP_MAX in as many of each stage's first layers as keep it there
 * (wgrad_big_layers). */
/* Whether a layer's expert gradients stay where its backward wrote them until the step's end (no
 * expert reduce-scatter between micro-steps): EP_FSDP 1, or parallel.reduce_grads step. */
bool estimate_expert_grads_kept(const struct config *c, const struct mesh_dims *d);

/* Activation bytes saved for backward by layers [layer0, layer1) for one micro-batch of
 * micro_batch_size x seq_len tokens, plus the embedding input on the first stage and the final norm
 * and logits on the last stage. Formula in the .c file. */
double estimate_activation_bytes(const struct config *c, int layer0, int layer1, bool first, bool last);

#endif
