/* The memory estimate: parameter / gradient / optimizer / activation / buffer bytes against a hand
 * count, the gradient buffers of the reduce options, the shards covering the model, and the auto
 * settings (expert wgrad pairs and groups, weight_copy) that the estimate decides. The layout
 * table and the command line: test_plan_table.c. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention_parts.h"
#include "common.h"
#include "memory_estimate.h"
#include "mesh.h"
#include "plan.h"
#include "plan_test_util.h"
#include "tensors.h"

Test(plan, model_counts_by_hand)
{
    struct config c;
    hand_config(&c, 1, 1);
    struct tensor_table tt;
    tensor_table_build(&tt, &c.model);
    struct model_counts mc;
    estimate_model_counts(&tt, &c.model, &mc);
    /* per layer: norms 16 + 16, q 12x16 = 192, k 6x16 = 96, v 96, o 16x12 = 192, q/k norm 3 + 3,
     * router 4x16 = 64 -> 678 non-expert; experts gate_up 4x10x16 = 640, down 4x16x5 = 320 -> 960.
     * embedding and lm_head 101x16 = 1616 each, final norm 16. */
    cr_assert_eq(mc.expert, 3 * 960);
    cr_assert_eq(mc.non_expert, 3 * 678 + 1616 + 1616 + 16);
    cr_assert_eq(mc.total, mc.expert + mc.non_expert);
    cr_assert_eq(mc.total, 8162);
    /* a token uses top-2 of 4 experts: half the expert weights */
    cr_assert_eq(mc.active, mc.non_expert + 3 * 960 / 2);
    tensor_table_free(&tt);
}

/* world 8, pp 2, ep 2: S = 4 ranks per stage, ep_fsdp 2. Stage 0 layers {0, 1}, stage 1 layer {2}. */
static double scratch_of(const struct stage_estimate *e, double staging) { return e->buffer_bytes - staging; }

Test(plan, shard_and_optimizer_bytes_by_hand)
{
    struct config c;
    hand_config(&c, 2, 2);
    struct mesh_dims d;
    dims(&c, 8, &d);
    struct tensor_table tt;
    tensor_table_build(&tt, &c.model);
    struct stage_estimate s0, s1;
    estimate_stage(&c, &tt, &d, 0, true, &s0);
    estimate_stage(&c, &tt, &d, 1, true, &s1);

    /* Non-expert elements per FSDP unit, each unit cut into 4 equal chunks (S = 4 ranks per stage):
     * embedding 101 x 16 = 1616 -> 404; a layer's 678 (model_counts_by_hand) -> ceil(678 / 4) =
     * 170; final norm 16 + lm_head 1616 = 1632 -> 408. */
    cr_assert_eq(s0.dense_numel, 404 + 2 * 170);
    cr_assert_eq(s1.dense_numel, 170 + 408);
    /* Experts: 2 per EP rank, dim 1 split over ep_fsdp 2: gate_up 2x5x16 = 160, down 2x8x5 = 80. */
    cr_assert_eq(s0.expert_numel, 2 * 240);
    cr_assert_eq(s1.expert_numel, 240);
    cr_assert(s0.layer0 == 0 && s0.layer1 == 2 && s1.layer0 == 2 && s1.layer1 == 3);
    cr_assert(s0.has_embed && !s0.has_head && !s1.has_embed && s1.has_head);

    /* The shard: fp32 master, gradient and 2 Adam moments per held element, and the kept bf16 copy. */
    const double h0 = 404 + 2 * 170 + 480, h1 = 578 + 240;
    cr_assert_float_eq(s0.master_bytes, 4 * h0, 1e-9);
    cr_assert_float_eq(s0.adam_bytes, 8 * h0, 1e-9);
    cr_assert_float_eq(s1.adam_bytes, 8 * h1, 1e-9);
    cr_assert_eq(s0.work_numel, 1616 + 2 * 1158);
    cr_assert_eq(s1.work_numel, 1158 + 16 + 1616);
    /* Working weights, bf16, of each sharded group: one buffer of the largest unit and one of the
     * largest layer (dense: the embedding gathered 4 x 404 = 1616 and a layer 4 x 170 = 680;
     * experts: 2 experts x (10x16 + 16x5) = 480 twice); one unit of fp32 working gradients per
     * group (the largest). */
    cr_assert_float_eq(s0.param_bytes, 2 * h0 + 2 * (1616 + 680 + 2 * 480), 1e-9);
    cr_assert_float_eq(s0.grad_bytes, 4 * h0 + 4 * (1616 + 480), 1e-9);
    cr_assert_float_eq(s1.param_bytes, 2 * h1 + 2 * (4 * 408 + 680 + 2 * 480), 1e-9);
    /* staging: the expert gather / reduce-scatter buffer, 2 x 240 fp32 (the collectives run in
     * place); the rest is backward scratch, the same for every stage */
    /* 1F1B: stage 0 keeps min(pp - 0, micro-steps = 16 / (4 x 2)) = 2 micro-batches in flight, the
     * last stage 1; each slot of a stage with a neighbour has a dL/dh transfer buffer of T x H bf16
     * (T = 2 x 8 tokens, H 16) towards it */
    cr_assert_eq(s0.slots, 2);
    cr_assert_eq(s1.slots, 1);
    const double st = 2 * 240 * 4, xfer = 16 * 16 * 2;
    cr_assert_float_eq(scratch_of(&s0, st + 2 * xfer), scratch_of(&s1, st + xfer), 1e-6);
    cr_assert_gt(scratch_of(&s0, st + 2 * xfer), 0);
    cr_assert_float_eq(s0.total_bytes, s0.param_bytes + s0.grad_bytes + s0.master_bytes + s0.adam_bytes +
                                           s0.act_bytes + s0.buffer_bytes, 1e-6);

    /* without the copy every gather casts from the master into its slot: no 2 bytes per held
     * element, nothing else */
    struct stage_estimate c0;
    estimate_stage(&c, &tt, &d, 0, false, &c0);
    cr_assert_float_eq(c0.param_bytes, s0.param_bytes - 2 * h0, 1e-9);
    cr_assert_float_eq(c0.buffer_bytes, s0.buffer_bytes, 1e-9);
    /* bf16 moments: half the Adam bytes */
    c.train.optimizer_state_dtype = MT_STATE_BF16;
    estimate_stage(&c, &tt, &d, 0, true, &c0);
    cr_assert_float_eq(c0.adam_bytes, 4 * h0, 1e-9);
    c.train.optimizer_state_dtype = MT_STATE_FP32;

    /* precision fp32: the master is the compute copy (no extra bytes), 4-byte working weights */
    c.model.precision = MT_PREC_FP32;
    estimate_stage(&c, &tt, &d, 0, true, &s0);
    cr_assert_float_eq(s0.param_bytes, 4 * (1616 + 680 + 2 * 480), 1e-9);
    cr_assert_float_eq(s0.master_bytes, 4 * h0, 1e-9);

    /* one rank: the shard is the working set itself (its copy computes in place, no staging) */
    struct mesh_dims d1;
    hand_config(&c, 1, 1);
    dims(&c, 1, &d1);
    estimate_stage(&c, &tt, &d1, 0, true, &s0);
    cr_assert_float_eq(s0.param_bytes, 2.0 * s0.work_numel, 1e-9);
    cr_assert_float_eq(s0.grad_bytes, 4.0 * s0.work_numel, 1e-9);
    cr_assert_float_eq(s0.master_bytes, 4.0 * s0.work_numel, 1e-9);
    tensor_table_free(&tt);
}

/* The gradient buffers of parallel.prefetch and parallel.reduce_grads, by hand on the hand model
 * (stage 0 of PP=2 x EP=2 x EP_FSDP=2: the embedding unit gathers 1616 non-expert elements, each
 * layer 680 and 480 of experts), and what reduce_grads: auto resolves to. */
Test(plan, gradient_buffers_of_the_reduce_options)
{
    struct config c;
    hand_config(&c, 2, 2);
    struct mesh_dims d;
    dims(&c, 8, &d);
    struct tensor_table tt;
    tensor_table_build(&tt, &c.model);
    struct stage_estimate base, pf, step;
    estimate_stage(&c, &tt, &d, 0, true, &base);
    /* prefetch: one more non-expert buffer of the largest layer, for the overlapped reduce-scatter */
    c.parallel.prefetch = true;
    estimate_stage(&c, &tt, &d, 0, true, &pf);
    cr_assert_float_eq(pf.grad_bytes - base.grad_bytes, 4.0 * 680, 1e-9);
    /* step: every unit's own buffer instead of one of the largest unit per group (1616 + 480) */
    c.parallel.reduce_grads = MT_REDUCE_STEP;
    estimate_stage(&c, &tt, &d, 0, true, &step);
    cr_assert_float_eq(step.grad_bytes - base.grad_bytes, 4.0 * ((1616 + 2 * 680 + 2 * 480) - (1616 + 480)), 1e-9);
    cr_assert_float_eq(step.param_bytes, pf.param_bytes, 1e-9);

    /* auto: step exactly when the peak with it is at most MT_AUTO_MEM_SHARE of the device */
    const double with_step = estimate_peak_bytes(&c, &d, true);
    c.parallel.reduce_grads = MT_REDUCE_AUTO;
    cr_assert_gt(with_step, estimate_peak_bytes(&c, &d, true));
    cr_assert_eq(estimate_reduce_grads(&c, &d, true, with_step / MT_AUTO_MEM_SHARE * 1.001), MT_REDUCE_STEP);
    cr_assert_eq(estimate_reduce_grads(&c, &d, true, with_step / MT_AUTO_MEM_SHARE * 0.999), MT_REDUCE_MICRO_STEP);
    cr_assert_eq(estimate_reduce_grads(&c, &d, true, 0), MT_REDUCE_MICRO_STEP, "no device: per micro-step");
    c.parallel.reduce_grads = MT_REDUCE_MICRO_STEP;
    cr_assert_eq(estimate_reduce_grads(&c, &d, true, 1e15), MT_REDUCE_MICRO_STEP, "set by hand: kept");
    c.parallel.reduce_grads = MT_REDUCE_STEP;
    cr_assert_eq(estimate_reduce_grads(&c, &d, true, 1), MT_REDUCE_STEP, "set by hand: kept");

    /* reshard_after_forward: auto keeps every unit gathered exactly when the peak with that (and
     * the resolved reduce_grads) is at most MT_AUTO_MEM_SHARE of the device; the working weights
     * are then every unit's (stage 0: 1616 + 2 x 680 non-expert, 2 x 480 expert elements, bf16) */
    c.parallel.reshard_after_forward = MT_TRI_FALSE;
    struct stage_estimate kept;
    estimate_stage(&c, &tt, &d, 0, true, &kept);
    cr_assert_float_eq(kept.param_bytes - step.param_bytes,
                       2.0 * ((1616 + 2 * 680 + 2 * 480) - (1616 + 680 + 2 * 480)), 1e-9);
    const double with_kept = estimate_peak_bytes(&c, &d, true);
    c.parallel.reshard_after_forward = MT_TRI_AUTO;
    cr_assert_not(estimate_reshard(&c, &d, true, with_kept / MT_AUTO_MEM_SHARE * 1.001), "room: kept gathered");
    cr_assert(estimate_reshard(&c, &d, true, with_kept / MT_AUTO_MEM_SHARE * 0.999), "no room: resharded");
    cr_assert(estimate_reshard(&c, &d, true, 0), "no device: resharded");
    c.parallel.reshard_after_forward = MT_TRI_TRUE;
    cr_assert(estimate_reshard(&c, &d, true, 1e15), "set by hand: kept");
    tensor_table_free(&tt);
}

Test(plan, tied_embedding_copy_on_last_stage)
{
    struct config c;
    hand_config(&c, 2, 1);
    struct mesh_dims d;
    dims(&c, 2, &d);
    struct tensor_table tt;
    tensor_table_build(&tt, &c.model);
    struct stage_estimate untied, tied;
    estimate_stage(&c, &tt, &d, 1, true, &untied);
    tensor_table_free(&tt);
    c.model.tie_word_embeddings = true;
    tensor_table_build(&tt, &c.model);
    estimate_stage(&c, &tt, &d, 1, true, &tied);
    /* the head's copy of the embedding has lm_head's shape */
    cr_assert_eq(tied.dense_numel, untied.dense_numel);
    /* one stage: the tied embedding is held once */
    hand_config(&c, 1, 1);
    c.model.tie_word_embeddings = true;
    struct stage_estimate one;
    dims(&c, 1, &d);
    estimate_stage(&c, &tt, &d, 0, true, &one);
    cr_assert_eq(one.dense_numel, 3 * 678 + 1616 + 16);
    tensor_table_free(&tt);
}

/* Shards padded per rank cover the model: S x shard summed over stages >= total, equal when every
 * split is even. */
Test(plan, shards_cover_the_model)
{
    struct config c;
    qwen3_30b_config(&c, 4, 8);
    for (int pass = 0; pass < 2; pass++) {
        const int world = pass ? 1024 : 32;  /* S 8: every split even; S 256: vocab rows padded */
        struct mesh_dims d;
        dims(&c, world, &d);
        struct tensor_table tt;
        tensor_table_build(&tt, &c.model);
        struct model_counts mc;
        estimate_model_counts(&tt, &c.model, &mc);
        int64_t held = 0;
        for (int s = 0; s < d.pp; s++) {
            struct stage_estimate e;
            estimate_stage(&c, &tt, &d, s, true, &e);
            held += (int64_t)d.S * (e.dense_numel + e.expert_numel);
        }
        if (pass == 0) cr_assert_eq(held, mc.total);
        else cr_assert(held >= mc.total && held < mc.total + (int64_t)tt.n * 4096 * d.S, "held %lld",
                       (long long)held);
        tensor_table_free(&tt);
    }
}

Test(plan, activation_formula_properties)
{
    struct config c;
    hand_config(&c, 1, 1);
    const double one = estimate_activation_bytes(&c, 0, 3, false, false);
    c.train.micro_batch_size *= 3;
    cr_assert_float_eq(estimate_activation_bytes(&c, 0, 3, false, false), 3 * one, 1e-6);
    c.train.micro_batch_size /= 3;
    /* the last stage adds the final norm, labels, logits and per-row loss and lse:
     * T (2 H a + 16) + T V a */
    const double T = 2 * 8, a = 2;
    cr_assert_float_eq(estimate_activation_bytes(&c, 0, 3, false, true) - one,
                       T * (2 * 16 * a + 16) + T * 101 * a, 1e-6);
    /* checkpointing keeps each layer's input plus one layer recomputed */
    const double layer = estimate_activation_bytes(&c, 0, 1, false, false);
    cr_assert_float_eq(layer * 3, one, 1e-6);  /* all three layers are MoE and alike */
    c.train.activation_checkpointing = true;
    cr_assert_float_eq(estimate_activation_bytes(&c, 0, 3, false, false), 3 * T * 16 * a + layer, 1e-6);
    /* routed rows grow with top-k: more expert activations */
    c.train.activation_checkpointing = false;
    c.model.num_experts_per_tok = 4;
    cr_assert_gt(estimate_activation_bytes(&c, 0, 3, false, false), one);
    /* expert parallelism: the expert-side rows get 25% headroom */
    c.model.num_experts_per_tok = 2;
    const double k = 2, H = 16, I = c.model.moe_intermediate_size;
    c.parallel.expert_parallel_size = 2;
    cr_assert_float_eq(estimate_activation_bytes(&c, 0, 3, false, false) - one,
                       3 * T * 0.25 * k * (H + 2 * I + I + H) * a, 1e-6);
}
/* the hand model on one rank with one MoE chunk (the stash needs it), every layer pairing when on */
static void stash_setup(struct config *c, struct mesh_dims *d, struct tensor_table *tt)
{
    hand_config(c, 1, 1);
    c->parallel.moe_chunks = 1;
    c->parallel.wgrad_pair_layers = MT_MAX_LAYERS;
    dims(c, 1, d);
    tensor_table_build(tt, &c->model);
}

/* parallel.expert_wgrad_pairs: each pairing MoE layer parks one micro-step's expert rows, by hand
 * on the hand model (T = 16 tokens x top-2 = 32 rows of x_exp 16 + act 5 + d_gu 10 + d_y_exp 16
 * bf16 elements), and auto pairs as many of the stage's MoE layers as keep the peak within
 * MT_PAIRS_MEM_SHARE of the device, none where it cannot help. */
Test(plan, expert_wgrad_pairs_stash_and_auto_layers)
{
    struct config c;
    struct mesh_dims d;
    struct tensor_table tt;
    stash_setup(&c, &d, &tt);
    struct stage_estimate off, all, two;
    c.parallel.expert_wgrad_pairs = MT_TRI_FALSE;
    estimate_stage(&c, &tt, &d, 0, true, &off);
    c.parallel.expert_wgrad_pairs = MT_TRI_TRUE;
    estimate_stage(&c, &tt, &d, 0, true, &all);
    const double stash = 32.0 * (16 + 5 + 10 + 16) * 2;
    cr_assert_float_eq(all.act_bytes - off.act_bytes, 3 * stash, 1e-9);
    c.parallel.wgrad_pair_layers = 2;
    estimate_stage(&c, &tt, &d, 0, true, &two);
    cr_assert_float_eq(two.act_bytes - off.act_bytes, 2 * stash, 1e-9);
    tensor_table_free(&tt);

    c.parallel.expert_wgrad_pairs = MT_TRI_AUTO;
    c.parallel.wgrad_pair_layers = MT_MAX_LAYERS;
    const double base = estimate_peak_bytes(&c, &d, true); /* auto counts as off */
    cr_assert_float_eq(base, off.total_bytes, 1e-6);
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&c, &d, true, (base + 2.5 * stash) / MT_PAIRS_MEM_SHARE), 2);
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&c, &d, true, (base + 0.5 * stash) / MT_PAIRS_MEM_SHARE), 0);
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&c, &d, true, 1e15), MT_MAX_LAYERS, "every layer fits");
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&c, &d, true, 0), 0, "no device (CPU backend)");
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, (base + 1.5 * stash) / MT_PAIRS_MEM_SHARE);
    cr_assert(c.parallel.expert_wgrad_pairs == MT_TRI_TRUE && c.parallel.wgrad_pair_layers == 1);
    c.parallel.expert_wgrad_pairs = MT_TRI_AUTO;
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, (base + 0.5 * stash) / MT_PAIRS_MEM_SHARE);
    cr_assert(c.parallel.expert_wgrad_pairs == MT_TRI_FALSE);

    /* where it cannot help or cannot run: off whatever the memory */
    struct config t = c;
    t.parallel.expert_wgrad_pairs = MT_TRI_AUTO;
    t.model.precision = MT_PREC_FP32;
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&t, &d, true, 1e15), 0, "fp32");
    t = c, t.parallel.expert_wgrad_pairs = MT_TRI_AUTO, t.parallel.moe_chunks = 2;
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&t, &d, true, 1e15), 0, "moe_chunks 2");
    t = c, t.parallel.expert_wgrad_pairs = MT_TRI_AUTO, t.train.global_batch_size = 2;
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&t, &d, true, 1e15), 0, "one micro-step");
    t = c, t.parallel.expert_wgrad_pairs = MT_TRI_AUTO;
    struct mesh_dims d2;
    dims(&t, 2, &d2); /* ep 1 x ep_fsdp 2: the experts are reduce-scattered every micro-step */
    t.parallel.reduce_grads = MT_REDUCE_MICRO_STEP;
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&t, &d2, true, 1e15), 0, "ep_fsdp 2, micro_step");
    t.parallel.reduce_grads = MT_REDUCE_STEP;
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&t, &d2, true, 1e15), MT_MAX_LAYERS, "ep_fsdp 2, step");
    /* set by hand: as set */
    t.parallel.expert_wgrad_pairs = MT_TRI_FALSE;
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&t, &d2, true, 1e15), 0);
    t.parallel.expert_wgrad_pairs = MT_TRI_TRUE;
    cr_assert_eq(estimate_expert_wgrad_pair_layers(&t, &d2, true, 1), MT_MAX_LAYERS);
}

/* parallel.expert_wgrad_group: a layer grouping g micro-steps parks g - 1 (no more than the step
 * has, less one); auto groups 4 once every MoE layer pairs, in as many layers as keep the peak
 * within MT_GROUP_MEM_SHARE, and 8 once every layer groups 4 and 8 fits in every layer; set by hand it applies to every pairing layer and counts in auto's
 * choice of pairing layers. The hand model: 3 MoE layers, 8 micro-steps. */
Test(plan, expert_wgrad_group_stash_and_auto_layers)
{
    struct config c;
    struct mesh_dims d;
    struct tensor_table tt;
    stash_setup(&c, &d, &tt);
    const double stash = 32.0 * (16 + 5 + 10 + 16) * 2;
    struct stage_estimate off, e;
    c.parallel.expert_wgrad_pairs = MT_TRI_FALSE;
    estimate_stage(&c, &tt, &d, 0, true, &off);
    c.parallel.expert_wgrad_pairs = MT_TRI_TRUE;
    c.parallel.wgrad_group = 4;
    c.parallel.wgrad_group_layers = 1; /* 3 + 1 + 1 parked */
    estimate_stage(&c, &tt, &d, 0, true, &e);
    cr_assert_float_eq(e.act_bytes - off.act_bytes, 5 * stash, 1e-9);
    c.parallel.wgrad_group_layers = MT_MAX_LAYERS; /* 3 x 3 */
    estimate_stage(&c, &tt, &d, 0, true, &e);
    cr_assert_float_eq(e.act_bytes - off.act_bytes, 9 * stash, 1e-9);
    c.train.global_batch_size = 6; /* 3 micro-steps: a group of 4 parks 2 */
    estimate_stage(&c, &tt, &d, 0, true, &e);
    struct stage_estimate off3;
    c.parallel.expert_wgrad_pairs = MT_TRI_FALSE;
    estimate_stage(&c, &tt, &d, 0, true, &off3);
    cr_assert_float_eq(e.act_bytes - off3.act_bytes, 6 * stash, 1e-9);
    c.train.global_batch_size = 16;
    tensor_table_free(&tt);

    /* auto: pairs everywhere first (3 stashes, within MT_PAIRS_MEM_SHARE), then one layer at a
     * time to 3 stashes within MT_GROUP_MEM_SHARE. On this small model the 5% between the two
     * shares holds every group wherever the pairs fit, so these cases pair every layer by hand. */
    c.parallel.expert_wgrad_pairs = MT_TRI_AUTO;
    c.parallel.expert_wgrad_group = 0;
    c.parallel.wgrad_group_layers = 0;
    /* the rows in their own memory: the parked rows in lower layers' gradients have their own test
     * (wgrad_pairs/auto_eights_everywhere_with_rows_in_the_gradients) */
    setenv("MT_STASH_IN_GRADS", "0", 1);
    const double base = estimate_peak_bytes(&c, &d, true);
    c.parallel.expert_wgrad_pairs = MT_TRI_TRUE;
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, (base + 4.5 * stash) / MT_GROUP_MEM_SHARE);
    cr_assert(c.parallel.expert_wgrad_pairs == MT_TRI_TRUE && c.parallel.wgrad_pair_layers == MT_MAX_LAYERS);
    cr_assert_eq(c.parallel.wgrad_group_layers, 0, "no room for a group");
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, (base + 7.5 * stash) / MT_GROUP_MEM_SHARE);
    cr_assert_eq(c.parallel.wgrad_group, 4);
    cr_assert_eq(c.parallel.wgrad_group_layers, 2, "3 + 2 x 2 stashes fit, 3 + 3 x 2 do not");
    cr_assert_gt(base + 7 * stash, MT_PAIRS_MEM_SHARE * (base + 7.5 * stash) / MT_GROUP_MEM_SHARE,
                 "the pairs' share alone would not hold the two groups");
    /* groups of 4 in every layer (3 x 3 stashes): then groups of 8 where every layer's fit (3 x 7) */
    c.parallel.expert_wgrad_pairs = MT_TRI_TRUE, c.parallel.wgrad_pair_layers = MT_MAX_LAYERS;
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, (base + 20.5 * stash) / MT_GROUP_MEM_SHARE);
    cr_assert(c.parallel.wgrad_group == 4 && c.parallel.wgrad_group_layers == MT_MAX_LAYERS,
              "groups of 4 everywhere, no room for 8 (%d, %d)", c.parallel.wgrad_group, c.parallel.wgrad_group_layers);
    c.parallel.expert_wgrad_pairs = MT_TRI_TRUE, c.parallel.wgrad_pair_layers = MT_MAX_LAYERS;
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, (base + 21.5 * stash) / MT_GROUP_MEM_SHARE);
    cr_assert(c.parallel.wgrad_group == 8 && c.parallel.wgrad_group_layers == MT_MAX_LAYERS,
              "groups of 8 everywhere (%d, %d)", c.parallel.wgrad_group, c.parallel.wgrad_group_layers);
    c.parallel.expert_wgrad_pairs = MT_TRI_AUTO;
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, 1e15);
    cr_assert_eq(c.parallel.wgrad_group_layers, MT_MAX_LAYERS, "every layer fits");
    cr_assert_eq(c.parallel.wgrad_group, 8, "every layer fits groups of 8");
    c.parallel.expert_wgrad_pairs = MT_TRI_AUTO;
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, (base + 2.5 * stash) / MT_PAIRS_MEM_SHARE);
    cr_assert(c.parallel.wgrad_pair_layers == 2 && c.parallel.wgrad_group_layers == 0,
              "not every layer pairs: no groups (%d, %d)", c.parallel.wgrad_pair_layers, c.parallel.wgrad_group_layers);
    c.parallel.expert_wgrad_pairs = MT_TRI_TRUE, c.parallel.wgrad_pair_layers = MT_MAX_LAYERS;
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, 0);
    cr_assert_eq(c.parallel.wgrad_group_layers, 0, "no device: no auto groups");
    struct mesh_dims d_ep = d;
    d_ep.ep = 2;
    setenv("MT_WGRAD_GROUP_EP", "0", 1);
    estimate_resolve_expert_wgrad_pairs(&c, &d_ep, true, 1e15);
    unsetenv("MT_WGRAD_GROUP_EP");
    cr_assert_eq(c.parallel.wgrad_group_layers, 0, "MT_WGRAD_GROUP_EP=0, ep 2: no auto groups");
    /* by default auto groups with EP too, each micro-step parked beyond the pair planned at the
     * most rows a rank can receive (ep x the mean), the pair at the buffers' 1.25 x */
    c.parallel.expert_wgrad_pairs = MT_TRI_TRUE, c.parallel.wgrad_pair_layers = MT_MAX_LAYERS;
    estimate_resolve_expert_wgrad_pairs(&c, &d_ep, true, 1e15);
    cr_assert(c.parallel.wgrad_group == 8 && c.parallel.wgrad_group_layers == MT_MAX_LAYERS,
              "ep 2: groups of %d in %d layers", c.parallel.wgrad_group, c.parallel.wgrad_group_layers);
    {
        struct tensor_table t2;
        tensor_table_build(&t2, &c.model);
        struct stage_estimate ep_off, ep_g;
        struct config g4 = c;
        g4.parallel.expert_wgrad_pairs = MT_TRI_FALSE;
        estimate_stage(&g4, &t2, &d_ep, 0, true, &ep_off);
        g4.parallel.expert_wgrad_pairs = MT_TRI_TRUE;
        g4.parallel.wgrad_group = 4, g4.parallel.wgrad_group_layers = MT_MAX_LAYERS, g4.parallel.wgrad_big_layers = 0;
        estimate_stage(&g4, &t2, &d_ep, 0, true, &ep_g);
        cr_assert_float_eq(ep_g.act_bytes - ep_off.act_bytes, (3 * 1.25 + 3 * 2 * 2.0) * stash, 1e-9,
                           "ep 2, groups of 4 in 3 layers: %g stashes", (ep_g.act_bytes - ep_off.act_bytes) / stash);
        tensor_table_free(&t2);
    }

    /* by hand: every pairing layer, and auto pairs count the group's stashes */
    c.parallel.expert_wgrad_pairs = MT_TRI_AUTO;
    c.parallel.expert_wgrad_group = 3;
    estimate_resolve_expert_wgrad_pairs(&c, &d, true, (base + 4.5 * stash) / MT_PAIRS_MEM_SHARE);
    cr_assert(c.parallel.expert_wgrad_pairs == MT_TRI_TRUE && c.parallel.wgrad_pair_layers == 2 &&
                  c.parallel.wgrad_group == 3 && c.parallel.wgrad_group_layers == MT_MAX_LAYERS,
              "group 3 by hand: %d layers, group %d in %d", c.parallel.wgrad_pair_layers, c.parallel.wgrad_group,
              c.parallel.wgrad_group_layers);
    unsetenv("MT_STASH_IN_GRADS");
}

/* train.weight_copy: auto keeps the bf16 copy within 80% of the device, and beyond it when the copy
 * needs no more memory than casting: a one-rank group computes from the copy in place, while casting
 * builds working buffers of the largest unit and the largest layer, which for a one-layer model
 * are both the whole layer (the bench sweep's one-layer 235B-A22B shape: 66.3 GiB kept, 69.6 cast). */
Test(plan, weight_copy_auto_keeps_the_copy_when_it_is_the_smaller)
{
    for (int layers = 1; layers <= 3; layers += 2) {
        struct config c;
        hand_config(&c, 1, 1);
        c.model.num_hidden_layers = layers;
        c.model.num_experts = 16; /* expert weights outweigh the embedding and the head */
        c.model.moe_intermediate_size = 64;
        c.train.weight_copy = MT_COPY_AUTO;
        struct mesh_dims d;
        dims(&c, 1, &d);
        const double keep = estimate_peak_bytes(&c, &d, true), cast = estimate_peak_bytes(&c, &d, false);
        /* the premise of each case */
        if (layers == 1) cr_assert_leq(keep, cast, "1 layer: kept %.0f, cast %.0f bytes", keep, cast);
        else cr_assert_gt(keep, cast, "3 layers: kept %.0f, cast %.0f bytes", keep, cast);
        cr_expect(estimate_keep_copy(&c, &d, keep / MT_AUTO_MEM_SHARE * 1.001), "%d layers: fits in 80%%: kept", layers);
        cr_expect_eq(estimate_keep_copy(&c, &d, keep / MT_AUTO_MEM_SHARE * 0.999), layers == 1,
                     "%d layers over 80%%: kept only when no larger than casting", layers);
        c.train.weight_copy = MT_COPY_CAST;
        cr_expect(!estimate_keep_copy(&c, &d, 1e15), "set by hand: cast");
    }
}

/* The attention backward's dK/dV pass in parts (src/attention_parts.h) at micro-batch 1: 1 x 4 kv
 * heads x 32 key tiles = 128 blocks, under 256, so 2 parts whose fp32 sums (2 x 2 x 4096 x 4 x 128
 * x 4 bytes = 32 MiB) follow the dS tiles (1 x 32 x 2080 x 8 KiB = 520 MiB): on a stage without
 * the head both are scratch; on the last stage the logits (4096 x 151936 bf16) hold both; with a
 * vocabulary of 68,000 (531 MiB of logits) they hold the tiles but not the sums. */
Test(plan, attention_dkdv_part_sums_by_hand)
{
    struct config c;
    qwen3_30b_config(&c, 2, 1);
    c.train.micro_batch_size = 1;
    struct mesh_dims d;
    dims(&c, 2, &d);
    cr_assert_eq(attn_dkdv_parts(1, 4096, 32, 4), 2);
    const double ds = 1.0 * 32 * 2080 * 8192, sums = 2.0 * 2 * 4096 * 4 * 128 * 4;
    cr_assert_float_eq(sums, 32.0 * 1024 * 1024, 1e-3);
    const double xfer = 1.0 * 4096 * 2048 * 2; /* one dL/dh transfer buffer a slot (T x H bf16) */
    const int vocab[2] = {151936, 68000};
    const double want[2] = {ds + sums, ds};
    for (int v = 0; v < 2; v++) {
        c.model.vocab_size = vocab[v];
        struct tensor_table tt;
        tensor_table_build(&tt, &c.model);
        struct stage_estimate s0, s1;
        estimate_stage(&c, &tt, &d, 0, true, &s0);
        estimate_stage(&c, &tt, &d, 1, true, &s1);
        cr_expect_float_eq(s0.buffer_bytes - s0.slots * xfer - (s1.buffer_bytes - s1.slots * xfer), want[v], 1.0,
                           "vocabulary %d: stage 0 %.0f, stage 1 %.0f (slots %d, %d)", vocab[v], s0.buffer_bytes,
                           s1.buffer_bytes, s0.slots, s1.slots);
        tensor_table_free(&tt);
    }
}

/* The attention backward's dS tiles (bf16, 64 x 64, the causal lower triangle of every sequence
 * and query head): counted as scratch on a stage without the head, and on the last stage only
 * when the logits cannot hold them; never with fp32 or a head_dim the tensor-core kernels skip. */
Test(plan, attention_ds_scratch_by_hand)
{
    struct config c;
    qwen3_30b_config(&c, 2, 1);
    c.train.micro_batch_size = 2;
    struct mesh_dims d;
    dims(&c, 2, &d);
    struct tensor_table tt;
    tensor_table_build(&tt, &c.model);
    struct stage_estimate s0, s1;
    /* S 4096: 64 tiles a side, 64 x 65 / 2 = 2080 below the diagonal, x 2 sequences x 32 heads x
     * 8 KiB = 1040 MiB; the logits (2 x 4096 x 151936 bf16 = 2374 MiB) hold them */
    const double ds = 2.0 * 32 * 2080 * 8192;
    cr_assert_float_eq(ds, 1040.0 * 1024 * 1024, 1e-3);
    estimate_stage(&c, &tt, &d, 0, true, &s0);
    estimate_stage(&c, &tt, &d, 1, true, &s1);
    const double xfer = 2.0 * 4096 * 2048 * 2; /* one dL/dh transfer buffer a slot (T x H bf16) */
    cr_assert_float_eq(s0.buffer_bytes - s0.slots * xfer - (s1.buffer_bytes - s1.slots * xfer), ds, 1.0,
                       "stage 0 %.0f, stage 1 %.0f (slots %d, %d)", s0.buffer_bytes, s1.buffer_bytes,
                       s0.slots, s1.slots);
    /* a vocabulary of 1000: the logits (16 MiB) are too small, both stages count the tiles */
    struct stage_estimate v0, v1;
    c.model.vocab_size = 1000;
    tensor_table_free(&tt);
    tensor_table_build(&tt, &c.model);
    estimate_stage(&c, &tt, &d, 0, true, &v0);
    estimate_stage(&c, &tt, &d, 1, true, &v1);
    cr_assert_float_eq(v0.buffer_bytes - v0.slots * xfer - (v1.buffer_bytes - v1.slots * xfer), 0.0, 1.0);
    /* fp32: no tensor-core backward, no tiles on either stage (the transfer buffers in fp32) */
    struct stage_estimate f0, f1;
    c.model.precision = MT_PREC_FP32;
    estimate_stage(&c, &tt, &d, 0, true, &f0);
    estimate_stage(&c, &tt, &d, 1, true, &f1);
    cr_assert_float_eq(f0.buffer_bytes - f0.slots * 2 * xfer - (f1.buffer_bytes - f1.slots * 2 * xfer), 0.0, 1.0);
    tensor_table_free(&tt);
}
