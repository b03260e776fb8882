/* parallel.expert_wgrad_pairs / expert_wgrad_group at the model level (src/moe.c, struct
 * expert_wgrad_stash), on the CPU backend with the small model: micro-batches accumulated with one
 * of its two MoE layers pairing (or grouping 3 or 4 micro-steps, the other pairing) give the same
 * gradients bit for bit as without (on the CPU the group's call is the adds in the same order), a
 * layer that does not group never stashes, the stash holds rows only while its group fills and
 * another backward may follow (model.more_backwards), and the flag is cleared by every backward.
 * The training-level runs (meshes, pipeline, recompute) are in test_fsdp.c. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "model_step.h"
#include "ops.h"
#include "memory_estimate.h"
#include "mesh.h"
#include "params.h"
#include "small_model.h"

#define WB 2
#define WS 8
#define N_MICRO 3
#define MAX_MICRO 10

struct run {
    struct model m;
    struct params p;
};

static void run_init_mixed(struct run *r, int pair_layers, int group_layers, int group, int n_big, int big_group)
{
    struct model_config mc;
    small_model_config(&mc);
    model_init(&r->m, backend_cpu(), &mc, WB, WS, NULL, false);
    params_init(&r->p, &r->m, NULL, NULL);
    params_init_random(&r->p, 11);
    params_gather_weights(&r->p);
    if (pair_layers > 0) model_enable_expert_wgrad_groups(&r->m, pair_layers, group_layers, group, n_big, big_group);
}

static void run_init_groups(struct run *r, int pair_layers, int group_layers, int group)
{
    run_init_mixed(r, pair_layers, group_layers, group, 0, 0);
}

static void run_init(struct run *r, int pair_layers)
{
    run_init_groups(r, pair_layers, 0, 2);
}

static void run_free(struct run *r)
{
    params_free(&r->p);
    model_free(&r->m);
}

/* micro-batch k's tokens (the same for every run) */
static void micro_ids(int k, int32_t *ids, int V)
{
    mt_rng rng;
    mt_rng_seed(&rng, 500 + (uint64_t)k);
    for (int t = 0; t < WB * WS; t++) ids[t] = (int32_t)(mt_rng_next(&rng) % (uint64_t)V);
}

/* n_micro forward/backward pairs onto zeroed gradients; each backward but the last may wait.
 * pending_after[k]: whether a stash held rows after backward k; parked[l][k]: layer l's parked
 * micro-steps then (NULL: not recorded). */
static void accumulate_n(struct run *r, int n_micro, bool *pending_after, int (*parked)[MAX_MICRO])
{
    struct model *m = &r->m;
    model_zero_grad(m);
    for (int k = 0; k < n_micro; k++) {
        int32_t ids[WB * WS];
        micro_ids(k, ids, m->V);
        struct model_step_out o;
        model_forward(m, ids, NULL, &o);
        m->more_backwards = k + 1 < n_micro;
        model_backward(m, 1.0f / (float)(n_micro * o.n_valid), NULL);
        cr_expect(!m->more_backwards, "backward %d left more_backwards set", k);
        pending_after[k] = model_expert_wgrad_pending(m);
        for (int l = 0; parked && l < 2; l++) parked[l][k] = m->wstash ? m->wstash[l].pending : 0;
    }
}

static void accumulate(struct run *r, bool pending_after[N_MICRO])
{
    accumulate_n(r, N_MICRO, pending_after, NULL);
}

/* every gradient of got bit for bit ref's */
static void expect_same_grads(struct run *ref, struct run *got, const char *how)
{
    for (int i = 0; i < ref->m.tt.n; i++)
        cr_expect(!memcmp(model_grad(&ref->m, i), model_grad(&got->m, i),
                          (size_t)model_work_numel_of(&ref->m, i) * sizeof(float)),
                  "%s: gradient differs %s", ref->m.tt.t[i].name, how);
}

Test(wgrad_pairs, one_layer_pairing_gives_the_same_gradients)
{
    struct run ref, got;
    bool p_ref[N_MICRO], p_got[N_MICRO];
    run_init(&ref, 0);
    accumulate(&ref, p_ref);
    run_init(&got, 1); /* the first MoE layer (layer 0) pairs, layer 1 does not */
    accumulate(&got, p_got);

    cr_expect(!p_ref[0] && !p_ref[1] && !p_ref[2], "a stash without pairing");
    /* micro-step 0 waits, 1 takes both, 2 (the last) runs alone */
    cr_expect(p_got[0] && !p_got[1] && !p_got[2], "pending after each backward: %d %d %d", p_got[0], p_got[1],
              p_got[2]);
    cr_expect(got.m.wstash[0].n_slots == 1 && got.m.wstash[0].slot[0].off && got.m.wstash[0].slot[0].x_exp &&
                  got.m.wstash[0].slot[0].d_gu,
              "layer 0 pairs: its stash holds buffers");
    cr_expect(!got.m.wstash[1].n_slots && !got.m.wstash[1].slot[0].off && !got.m.wstash[1].slot[0].x_exp,
              "layer 1 does not pair, yet it has a stash");

    int differ = 0;
    for (int i = 0; i < ref.m.tt.n; i++) {
        const size_t bytes = (size_t)model_work_numel_of(&ref.m, i) * sizeof(float);
        if (memcmp(model_grad(&ref.m, i), model_grad(&got.m, i), bytes)) {
            cr_expect(0, "%s: gradient differs with pairing", ref.m.tt.t[i].name);
            differ++;
        }
    }
    cr_expect_eq(differ, 0);
    run_free(&ref);
    run_free(&got);
}

/* Pairing every layer, and a step of one micro-step (nothing may wait): the same again. */
Test(wgrad_pairs, all_layers_and_a_single_micro_step)
{
    struct run ref, got;
    bool p_ref[N_MICRO], p_got[N_MICRO];
    run_init(&ref, 0);
    accumulate(&ref, p_ref);
    run_init(&got, MT_MAX_LAYERS);
    accumulate(&got, p_got);
    cr_expect(got.m.wstash[0].slot[0].off && got.m.wstash[1].slot[0].off, "both layers pair");
    for (int i = 0; i < ref.m.tt.n; i++)
        cr_expect(!memcmp(model_grad(&ref.m, i), model_grad(&got.m, i),
                          (size_t)model_work_numel_of(&ref.m, i) * sizeof(float)),
                  "%s: gradient differs with every layer pairing", ref.m.tt.t[i].name);

    /* one micro-step: more_backwards stays false, nothing is stashed */
    struct model *m = &got.m;
    model_zero_grad(m);
    int32_t ids[WB * WS];
    micro_ids(0, ids, m->V);
    struct model_step_out o;
    model_forward(m, ids, NULL, &o);
    model_backward(m, 1.0f / (float)o.n_valid, NULL);
    cr_expect(!model_expert_wgrad_pending(m), "a lone backward left rows waiting");
    run_free(&ref);
    run_free(&got);
}

/* parallel.expert_wgrad_group: layer 0 groups 4 micro-steps (3 parked), layer 1 pairs, over 6
 * micro-steps (a group of 4, then one of 2: the step's end closes it); then 3 in layer 0 over 5
 * (3 + 2). Same bits as no grouping; the parked counts follow the groups. */
Test(wgrad_pairs, groups_of_four_and_three)
{
    struct run ref, got;
    bool p_ref[MAX_MICRO], p_got[MAX_MICRO];
    int parked[2][MAX_MICRO];
    run_init(&ref, 0);
    accumulate_n(&ref, 6, p_ref, NULL);
    run_init_groups(&got, MT_MAX_LAYERS, 1, 4);
    cr_expect(got.m.wstash[0].n_slots == 3 && got.m.wstash[1].n_slots == 1, "slots %d %d, expected 3 1",
              got.m.wstash[0].n_slots, got.m.wstash[1].n_slots);
    accumulate_n(&got, 6, p_got, parked);
    const int want4[2][6] = {{1, 2, 3, 0, 1, 0}, {1, 0, 1, 0, 1, 0}};
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 6; k++)
            cr_expect(parked[l][k] == want4[l][k], "group 4: layer %d parked %d after backward %d, expected %d", l,
                      parked[l][k], k, want4[l][k]);
    cr_expect(got.m.wstash[0].slot[2].x_exp && got.m.wstash[0].slot[2].off, "layer 0's third slot was never filled");
    expect_same_grads(&ref, &got, "with groups of 4");
    run_free(&got);

    run_free(&ref);
    run_init(&ref, 0);
    accumulate_n(&ref, 5, p_ref, NULL);
    run_init_groups(&got, MT_MAX_LAYERS, MT_MAX_LAYERS, 3);
    accumulate_n(&got, 5, p_got, parked);
    const int want3[5] = {1, 2, 0, 1, 0};
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 5; k++)
            cr_expect(parked[l][k] == want3[k], "group 3: layer %d parked %d after backward %d, expected %d", l,
                      parked[l][k], k, want3[k]);
    cr_expect(!got.m.wstash[0].slot[2].x_exp, "a group of 3 used a third slot");
    expect_same_grads(&ref, &got, "with groups of 3");
    run_free(&ref);
    run_free(&got);
}

/* groups of 8 (the kernel's MT_WGRAD_MAX_SETS row sets) in both layers over 10 micro-steps: a group
 * of 8, then one of 2 that the step's end closes. Same bits as no grouping on the CPU backend. */
Test(wgrad_pairs, groups_of_eight)
{
    struct run ref, got;
    bool p_ref[MAX_MICRO], p_got[MAX_MICRO];
    int parked[2][MAX_MICRO];
    run_init(&ref, 0);
    accumulate_n(&ref, 10, p_ref, NULL);
    run_init_groups(&got, MT_MAX_LAYERS, MT_MAX_LAYERS, 8);
    cr_expect(got.m.wstash[0].n_slots == 7 && got.m.wstash[1].n_slots == 7, "slots %d %d, expected 7 7",
              got.m.wstash[0].n_slots, got.m.wstash[1].n_slots);
    accumulate_n(&got, 10, p_got, parked);
    const int want8[10] = {1, 2, 3, 4, 5, 6, 7, 0, 1, 0};
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 10; k++)
            cr_expect(parked[l][k] == want8[k], "group 8: layer %d parked %d after backward %d, expected %d", l,
                      parked[l][k], k, want8[k]);
    cr_expect(got.m.wstash[1].slot[6].x_exp && got.m.wstash[1].slot[6].off, "layer 1's seventh slot was never filled");
    expect_same_grads(&ref, &got, "with groups of 8");
    run_free(&ref);
    run_free(&got);
}

/* mixed groups (MT_WGRAD_GROUP_MIX's layout): layer 0 groups 8, layer 1 groups 4, over 10
 * micro-steps. Same bits as no grouping on the CPU backend; the parked counts follow each layer's
 * group. */
Test(wgrad_pairs, eight_in_the_first_layer_four_in_the_next)
{
    struct run ref, got;
    bool p_ref[MAX_MICRO], p_got[MAX_MICRO];
    int parked[2][MAX_MICRO];
    run_init(&ref, 0);
    accumulate_n(&ref, 10, p_ref, NULL);
    run_init_mixed(&got, MT_MAX_LAYERS, MT_MAX_LAYERS, 4, 1, 8);
    cr_expect(got.m.wstash[0].n_slots == 7 && got.m.wstash[1].n_slots == 3, "slots %d %d, expected 7 3",
              got.m.wstash[0].n_slots, got.m.wstash[1].n_slots);
    accumulate_n(&got, 10, p_got, parked);
    const int want[2][10] = {{1, 2, 3, 4, 5, 6, 7, 0, 1, 0}, {1, 2, 3, 0, 1, 2, 3, 0, 1, 0}};
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 10; k++)
            cr_expect(parked[l][k] == want[l][k], "mixed: layer %d parked %d after backward %d, expected %d", l,
                      parked[l][k], k, want[l][k]);
    expect_same_grads(&ref, &got, "with groups of 8 and 4");
    run_free(&ref);
    run_free(&got);
}

/* The bench config on one H200's memory (split master, kept copy, one rank) */
static void bench_h200(struct config *c, struct mesh_dims *d)
{
    char err[512];
    cr_assert(config_load_checked(c, "configs/bench-qwen3-30b-8l.yaml", 0, NULL, err, sizeof err), "%s", err);
    c->train.master_weights = MT_MASTER_SPLIT;
    c->train.weight_copy = MT_COPY_KEEP;
    cr_assert(mesh_dims_of(c, 1, d, err, sizeof err), "%s", err);
}

/* The auto rule with the parked rows in their own memory (MT_STASH_IN_GRADS=0): on the bench shape
 * at one H200's memory, groups of four fit every layer and eights do not fit all of them; with the
 * master split (2 bytes a parameter less) some layers take eights, each counted in plan's
 * activations, unless MT_WGRAD_GROUP_MIX=0; unset is the same as 1. */
Test(wgrad_pairs, mixed_groups_fill_the_memory_a_split_master_frees)
{
    struct config c;
    struct mesh_dims d;
    bench_h200(&c, &d);
    const double h200 = 139.8 * 1024 * 1024 * 1024;
    setenv("MT_STASH_IN_GRADS", "0", 1);
    int big[3];
    for (int mix = 0; mix < 3; mix++) { /* MT_WGRAD_GROUP_MIX=0, =1, unset */
        struct config t = c;
        if (mix < 2) setenv("MT_WGRAD_GROUP_MIX", mix ? "1" : "0", 1);
        else unsetenv("MT_WGRAD_GROUP_MIX");
        estimate_resolve_expert_wgrad_pairs(&t, &d, true, h200);
        big[mix] = t.parallel.wgrad_big_layers;
        cr_expect(t.parallel.wgrad_group == 4 && t.parallel.wgrad_group_layers == MT_MAX_LAYERS,
                  "groups of %d in %d layers", t.parallel.wgrad_group, t.parallel.wgrad_group_layers);
        cr_expect(estimate_peak_bytes(&t, &d, true) <= MT_GROUP_MEM_SHARE * h200, "the mix passes the share");
        if (mix) {
            t.parallel.wgrad_big_layers++;
            cr_expect(estimate_peak_bytes(&t, &d, true) > MT_GROUP_MEM_SHARE * h200, "one more layer of eights fits");
        }
    }
    cr_expect(big[0] == 0, "with MT_WGRAD_GROUP_MIX=0 %d layers group eight", big[0]);
    cr_expect(big[1] >= 1 && big[1] < 8, "with it %d layers group eight", big[1]);
    cr_expect(big[2] == big[1], "unset (auto) %d layers group eight, =1 %d", big[2], big[1]);
    fprintf(stderr, "wgrad groups: split master on 139.8 GiB: eights in %d of 8 layers\n", big[1]);
    unsetenv("MT_STASH_IN_GRADS");
}

/* With the parked rows in lower layers' expert gradients (MT_STASH_IN_GRADS, auto on a GPU: the
 * default) the same config takes eights in every layer within the share, the plan leaving
 * 7 hosts' worth of rows out of its activations; one rank's experts only (not at EP=2). */
Test(wgrad_pairs, auto_eights_everywhere_with_rows_in_the_gradients)
{
    struct config c;
    struct mesh_dims d;
    bench_h200(&c, &d);
    const double h200 = 139.8 * 1024 * 1024 * 1024;
    unsetenv("MT_STASH_IN_GRADS");
    struct config t = c;
    estimate_resolve_expert_wgrad_pairs(&t, &d, true, h200);
    cr_expect(t.parallel.stash_in_grads, "auto on a GPU of one rank's experts");
    cr_expect(t.parallel.wgrad_group == 8 && t.parallel.wgrad_group_layers == MT_MAX_LAYERS,
              "groups of %d in %d layers", t.parallel.wgrad_group, t.parallel.wgrad_group_layers);
    cr_expect(estimate_peak_bytes(&t, &d, true) <= MT_GROUP_MEM_SHARE * h200, "within the share");
    struct tensor_table tt;
    tensor_table_build(&tt, &t.model);
    struct stage_estimate e;
    estimate_stage(&t, &tt, &d, 0, true, &e);
    /* each of layers 1..7 parks 7 micro-steps of 0.78 GiB; layers 0..6's 2.25 GiB gradients hold
     * what fits of them, whole buffers only */
    const double gib = 1024.0 * 1024 * 1024;
    cr_expect(e.stash_in_grads_bytes > 7 * 2.0 * gib && e.stash_in_grads_bytes <= 7 * 2.25 * gib,
              "%.2f GiB of rows in the gradients", e.stash_in_grads_bytes / gib);
    tensor_table_free(&tt);
    struct mesh_dims d2;
    char err[512];
    t = c;
    t.parallel.expert_parallel_size = 2;
    t.train.global_batch_size = 32;
    cr_assert(mesh_dims_of(&t, 2, &d2, err, sizeof err), "%s", err);
    /* at EP=2 the fixed exchange's capacity sizes the rows: auto on, with more layers of eights
     * than the rows in their own memory */
    estimate_resolve_expert_wgrad_pairs(&t, &d2, true, h200);
    cr_expect(t.parallel.stash_in_grads, "EP=2, auto: on");
    const int big_ep2 = t.parallel.wgrad_big_layers;
    setenv("MT_STASH_IN_GRADS", "0", 1);
    t = c;
    t.parallel.expert_parallel_size = 2;
    t.train.global_batch_size = 32;
    estimate_resolve_expert_wgrad_pairs(&t, &d2, true, h200);
    cr_expect(!t.parallel.stash_in_grads, "EP=2, MT_STASH_IN_GRADS=0: off");
    cr_expect_gt(big_ep2, t.parallel.wgrad_big_layers, "EP=2: eights in %d layers with it, %d without", big_ep2,
                 t.parallel.wgrad_big_layers);
    unsetenv("MT_STASH_IN_GRADS");
    t = c;
    t.parallel.expert_parallel_size = 2;
    t.train.global_batch_size = 32;
    estimate_resolve_expert_wgrad_pairs(&t, &d2, true, h200);
    cr_expect(estimate_peak_bytes(&t, &d2, true) <= MT_GROUP_MEM_SHARE * h200, "EP=2: within the share");
    struct stage_estimate e2;
    tensor_table_build(&tt, &t.model);
    estimate_stage(&t, &tt, &d2, 0, true, &e2);
    tensor_table_free(&tt);
    cr_expect_gt(e2.stash_in_grads_bytes, 0, "EP=2: nothing placed");
    /* not with the expert wgrad jobs, which run past the step's last backward */
    t = c;
    t.parallel.expert_parallel_size = 2;
    t.train.global_batch_size = 32;
    t.parallel.expert_wgrad_jobs = true;
    estimate_resolve_expert_wgrad_pairs(&t, &d2, true, h200);
    cr_expect(!t.parallel.stash_in_grads, "EP=2 with expert_wgrad_jobs: on");
    /* nor with the counted exchange, whose rows a rank receives have no bound known at start-up */
    t = c;
    t.parallel.expert_parallel_size = 2;
    t.train.global_batch_size = 32;
    t.parallel.moe_fixed_exchange = MT_TRI_FALSE;
    estimate_resolve_expert_wgrad_pairs(&t, &d2, true, h200);
    cr_expect(!t.parallel.stash_in_grads, "EP=2 with the counted exchange: on");
    setenv("MT_STASH_IN_GRADS", "0", 1);
    t = c;
    estimate_resolve_expert_wgrad_pairs(&t, &d, true, h200);
    cr_expect(!t.parallel.stash_in_grads && t.parallel.wgrad_group == 4, "MT_STASH_IN_GRADS=0: off");
    unsetenv("MT_STASH_IN_GRADS");
}

/* The gradient norm's sums from the weight-gradient pass (model.h model_grad_sumsq_slot): groups
 * of 8 in layer 0 and 4 in layer 1 over 8 micro-steps, onto gradients params_zero_grad leaves for
 * the first pass to overwrite. Layer 0's one pass overwrites: both its expert tensors get Σ dw² of
 * the gradient they end the step with (the CPU op sums in index order, as here: the same bits).
 * Layer 1's last pass adds onto its first and no other tensor has a pass that could: no sums. The
 * expert group's sum from them and a pass over layer 1's is the plain pass's to 1e-12; with none
 * taken (reset) it is the plain pass's bits. */
Test(wgrad_pairs, grad_norm_sums_from_the_overwriting_pass)
{
    struct run r;
    run_init_mixed(&r, MT_MAX_LAYERS, MT_MAX_LAYERS, 4, 1, 8);
    struct model *m = &r.m;
    model_enable_grad_sumsq(m);
    params_zero_grad(&r.p);
    model_grad_sumsq_reset(m);
    cr_expect(m->exp_dw_fresh[0] && m->exp_dw_fresh[1], "params_zero_grad left the expert gradients to the pass");
    for (int k = 0; k < 8; k++) {
        int32_t ids[WB * WS];
        micro_ids(k, ids, m->V);
        struct model_step_out o;
        model_forward(m, ids, NULL, &o);
        m->more_backwards = k + 1 < 8;
        model_backward(m, 1.0f / (float)(8 * o.n_valid), NULL);
    }
    double *known = calloc((size_t)m->tt.n, sizeof(double));
    const int n = model_grad_sumsq_taken(m, known);
    cr_expect_eq(n, 2, "%d tensors' sums taken, expected layer 0's two", n);
    for (int i = 0; i < m->tt.n; i++) {
        const struct tensor_spec *t = &m->tt.t[i];
        const bool want = t->kind == TK_EXPERT && t->layer == 0;
        if (!want) {
            cr_expect(isnan(known[i]), "%s: a sum was taken (%g)", t->name, known[i]);
            continue;
        }
        const float *g = model_grad(m, i);
        double here = 0;
        for (int64_t j = 0; j < model_work_numel_of(m, i); j++) here += (double)g[j] * g[j];
        cr_expect(here > 0 && known[i] == here, "%s: sum %.17g, its gradient's %.17g", t->name, known[i], here);
    }
    const double plain = params_group_grad_sumsq(&r.p, TG_EXPERT);
    const double folded = params_group_grad_sumsq_known(&r.p, TG_EXPERT, known);
    cr_expect(fabs(folded - plain) <= 1e-12 * plain, "expert group: %.17g with the sums, %.17g without", folded, plain);
    model_grad_sumsq_reset(m);
    cr_expect_eq(model_grad_sumsq_taken(m, known), 0, "sums taken after a reset");
    free(known);
    run_free(&r);
}

/* A step of one micro-step without pairs: each layer's expert weight gradients overwrite dw in the
 * one backward, through the grouped call of one set when the norm's sums are on (src/moe.c), so
 * every expert tensor leaves its Σ dw² (the gradient's own, bit for bit on the CPU) and the
 * gradients are bit for bit those of the backward's own weight-gradient pass. */
Test(wgrad_pairs, grad_norm_sums_from_a_lone_micro_step)
{
    struct run ref, got;
    run_init(&ref, 0);
    run_init(&got, 0);
    model_enable_grad_sumsq(&got.m);
    struct run *runs[2] = {&ref, &got};
    for (int k = 0; k < 2; k++) {
        struct model *m = &runs[k]->m;
        for (int i = 0; i < m->tt.n; i++) { /* what a pass that added instead of overwriting would show */
            const int64_t n = model_work_numel_of(m, i);
            float *nan = malloc((size_t)n * sizeof(float));
            for (int64_t j = 0; j < n; j++) nan[j] = NAN;
            m->be->upload(model_grad(m, i), nan, (size_t)n * sizeof(float));
            free(nan);
        }
        params_zero_grad(&runs[k]->p);
        model_grad_sumsq_reset(m);
        int32_t ids[WB * WS];
        micro_ids(0, ids, m->V);
        struct model_step_out o;
        model_forward(m, ids, NULL, &o);
        m->more_backwards = false;
        model_backward(m, 1.0f / (float)o.n_valid, NULL);
    }
    expect_same_grads(&ref, &got, "with the norm's sums taken");
    double *known = calloc((size_t)got.m.tt.n, sizeof(double));
    cr_expect_eq(model_grad_sumsq_taken(&got.m, known), 4, "expected both layers' two expert tensors");
    for (int i = 0; i < got.m.tt.n; i++) {
        if (got.m.tt.t[i].kind != TK_EXPERT) {
            cr_expect(isnan(known[i]), "%s: a sum was taken", got.m.tt.t[i].name);
            continue;
        }
        const float *g = model_grad(&got.m, i);
        double here = 0;
        for (int64_t j = 0; j < model_work_numel_of(&got.m, i); j++) here += (double)g[j] * g[j];
        cr_expect(here > 0 && known[i] == here, "%s: sum %.17g, its gradient's %.17g", got.m.tt.t[i].name, known[i], here);
    }
    cr_expect(ref.m.exp_dw_fresh != NULL, "the expert gradients were left to the backward to overwrite");
    free(known);
    run_free(&ref);
    run_free(&got);
}
