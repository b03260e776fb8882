/* parallel.expert_wgrad_pairs at the model level (src/moe.c, struct expert_wgrad_stash), on the CPU
 * backend with the small model: three micro-batches accumulated with one of its two MoE layers
 * pairing give the same gradients bit for bit as without pairing (on the CPU the pair's call is the
 * two adds in the same order), the other layer never stashes, the stash holds rows only between a
 * backward that may wait (model.more_backwards) and the next one, and the flag is cleared by every
 * backward. The training-level runs (meshes, pipeline, recompute) are in test_fsdp.c. */
#include <criterion/criterion.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "model_step.h"
#include "ops.h"
#include "params.h"
#include "small_model.h"

#define WB 2
#define WS 8
#define N_MICRO 3

struct run {
    struct model m;
    struct params p;
};

static void run_init(struct run *r, int pair_layers)
{
    struct model_config mc;
    small_model_config(&mc);
    model_init(&r->m, backend_cpu(), &mc, WB, WS, NULL, false);
    params_init(&r->p, &r->m, NULL, NULL);
    params_init_random(&r->p, 11);
    params_gather_weights(&r->p);
    if (pair_layers > 0) model_enable_expert_wgrad_pairs(&r->m, pair_layers);
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

/* N_MICRO forward/backward pairs onto zeroed gradients; each backward but the last may wait.
 * pending_after[k]: whether a stash held rows after backward k. */
static void accumulate(struct run *r, bool pending_after[N_MICRO])
{
    struct model *m = &r->m;
    model_zero_grad(m);
    for (int k = 0; k < N_MICRO; k++) {
        int32_t ids[WB * WS];
        micro_ids(k, ids, m->V);
        struct model_step_out o;
        model_forward(m, ids, NULL, &o);
        m->more_backwards = k + 1 < N_MICRO;
        model_backward(m, 1.0f / (float)(N_MICRO * o.n_valid), NULL);
        cr_expect(!m->more_backwards, "backward %d left more_backwards set", k);
        pending_after[k] = model_expert_wgrad_pending(m);
    }
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
    cr_expect(got.m.wstash[0].off && got.m.wstash[0].x_exp && got.m.wstash[0].d_gu,
              "layer 0 pairs: its stash holds buffers");
    cr_expect(!got.m.wstash[1].off && !got.m.wstash[1].x_exp, "layer 1 does not pair, yet it has a stash");

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
    cr_expect(got.m.wstash[0].off && got.m.wstash[1].off, "both layers pair");
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
