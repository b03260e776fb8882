/* The router's knobs (docs/router.md): train_router vs freeze_router by their gradients on the
 * gate, the routing variants against tools/router_ref.py (numpy, the documented formula), the
 * no-decay table, the expert-collapse warnings and the global-batch aux loss. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "cpu/cpu_ops.h"
#include "expert_watch.h"
#include "model_step.h"
#include "params.h"
#include "router_opts.h"
#include "../test_util.h"
#include "small_model.h"
#include "step_maths.h"

/* ---- train_router / freeze_router ------------------------------------------------------------- */

#define GB 2
#define GS 8

/* All gradients (working layout, dense group then expert group) of L = CE/n_valid·ce_on + coef·aux
 * for one fixed batch and seed-7 weights. */
struct grads {
    float *g[TG_COUNT];
    int64_t n[TG_COUNT];
};

static void gradients_of(const struct model_config *mc, bool ce_on, bool aux_on, struct grads *out)
{
    struct model m;
    struct params p;
    model_init(&m, backend_cpu(), mc, GB, GS, NULL, false);
    params_init(&p, &m, NULL, NULL);
    params_init_random(&p, 7);
    params_gather_weights(&p);
    int32_t ids[GB * GS];
    mt_rng rng;
    mt_rng_seed(&rng, 5);
    for (int t = 0; t < GB * GS; t++) ids[t] = (int32_t)(mt_rng_next(&rng) % (uint64_t)m.V);
    struct model_step_out o;
    model_forward(&m, ids, ids, &o);
    double aux, *cnt = mt_calloc((size_t)m.E, sizeof(double));
    float *aux_dp = mt_calloc((size_t)m.E, sizeof(float));
    aux_from_stats(m.stats_h, m.L, mc, m.T, &aux, cnt);
    aux_grad_from_counts(cnt, m.E, m.n_moe_layers, m.T, mc->router_aux_loss_coef, aux_dp);
    model_zero_grad(&m);
    model_backward(&m, ce_on ? (float)(1.0 / o.n_valid) : 0.0f, aux_on ? aux_dp : NULL);
    /* one rank: the shard's gradient is every tensor's working gradient, unit after unit */
    for (int g = 0; g < TG_COUNT; g++) {
        out->n[g] = p.g[g].numel;
        out->g[g] = mt_malloc((size_t)MT_MAX(out->n[g], 1) * sizeof(float));
        if (out->n[g]) memcpy(out->g[g], p.g[g].grad, (size_t)out->n[g] * sizeof(float));
    }
    free(cnt);
    free(aux_dp);
    params_free(&p);
    model_free(&m);
}

/* Σ|a − b| and Σ|a| over the gate tensors (gate = true) or over every other tensor */
static void compare(const struct model_config *mc, const struct grads *a, const struct grads *b,
                    bool gate, double *diff, double *mag)
{
    struct tensor_table tt;
    tensor_table_build(&tt, mc);
    struct model m; /* only for the shard offsets */
    model_init(&m, backend_cpu(), mc, GB, GS, NULL, false);
    struct params p;
    params_init(&p, &m, NULL, NULL);
    *diff = *mag = 0;
    for (int i = 0; i < tt.n; i++) {
        if ((tt.t[i].role == TR_ROUTER) != gate) continue;
        const int g = tensor_group_of(&tt.t[i]);
        const int64_t off = p.g[g].u_off[tensor_unit(&tt.t[i], m.L)] + p.t_off[i];
        for (int64_t j = 0; j < model_work_numel_of(&m, i); j++) {
            const float x = a->g[g][off + j], y = b->g[g][off + j];
            *diff += fabs((double)x - y);
            *mag += fabs((double)x);
        }
    }
    params_free(&p);
    model_free(&m);
    tensor_table_free(&tt);
}

static void free_grads(struct grads *g)
{
    for (int i = 0; i < TG_COUNT; i++) free(g->g[i]);
}

Test(router, train_router_false_leaves_the_gate_only_the_aux_gradient)
{
    struct model_config mc, det;
    small_model_config(&mc);
    det = mc;
    det.train_router = false;
    struct grads full, detached, detached_noaux, aux_only;
    gradients_of(&mc, true, true, &full);
    gradients_of(&det, true, true, &detached);
    gradients_of(&det, true, false, &detached_noaux);
    /* the aux-only gradient under the same detach: the aux terms of later layers reach earlier
     * layers' gates through the hidden states, but not through the routing weights */
    gradients_of(&det, false, true, &aux_only);
    double d, mag;
    /* aux off: the gate gets exactly nothing, while every other tensor still trains */
    compare(&det, &detached_noaux, &detached_noaux, true, &d, &mag);
    cr_expect(mag == 0, "gate gradient without aux: Σ|g| = %g", mag);
    compare(&det, &detached_noaux, &detached_noaux, false, &d, &mag);
    cr_expect(mag > 0, "the other tensors got no gradient");
    /* aux on: the gate gradient is exactly the aux-only gradient */
    compare(&det, &detached, &aux_only, true, &d, &mag);
    cr_expect(mag > 0 && d == 0, "gate: detached vs aux-only differ by %g of %g", d, mag);
    /* and it is not the full gradient (the test would pass vacuously if the CE part were 0) */
    compare(&mc, &full, &detached, true, &d, &mag);
    cr_expect(d > 1e-3 * mag, "gate: train_router true and false agree (%g of %g)", d, mag);
    /* detaching also cuts the routing-weight path into the hidden states: other gradients change */
    compare(&mc, &full, &detached, false, &d, &mag);
    cr_expect(d > 1e-6 * mag, "non-gate gradients did not change (%g of %g)", d, mag);
    free_grads(&full), free_grads(&detached), free_grads(&detached_noaux), free_grads(&aux_only);
}

Test(router, freeze_router_zeroes_the_gate_gradient_and_keeps_the_rest)
{
    struct model_config mc, fz;
    small_model_config(&mc);
    fz = mc;
    fz.freeze_router = true;
    struct grads full, frozen;
    gradients_of(&mc, true, true, &full);
    gradients_of(&fz, true, true, &frozen);
    double d, mag;
    compare(&fz, &frozen, &frozen, true, &d, &mag);
    cr_expect(mag == 0, "frozen gate got a gradient: Σ|g| = %g", mag);
    /* the routing weights still carry gradient to the hidden states: everything else is unchanged */
    compare(&mc, &full, &frozen, false, &d, &mag);
    cr_expect(mag > 0 && d == 0, "non-gate gradients changed by %g of %g", d, mag);
    free_grads(&full), free_grads(&frozen);
}

/* ---- routing variants vs tools/router_ref.py --------------------------------------------------- */

static bool have_numpy(void)
{
    return tu_run("python3 -c 'import numpy' 2>/dev/null", NULL) == 0;
}

static void variant_vs_numpy(int T, int E, int k, struct router_opts o, bool with_bias, uint64_t seed)
{
    mt_rng rng;
    mt_rng_seed(&rng, seed);
    float *z = mt_malloc((size_t)T * E * sizeof(float)), *bias = mt_malloc((size_t)E * sizeof(float));
    for (int i = 0; i < T * E; i++) z[i] = (float)(1.5 * mt_rng_normal(&rng));
    for (int e = 0; e < E; e++) bias[e] = (float)(0.05 * mt_rng_normal(&rng));
    char in[64], outp[64], cmd[256];
    snprintf(in, sizeof in, "/tmp/mt_router_ref_%d.in", (int)getpid());
    snprintf(outp, sizeof outp, "/tmp/mt_router_ref_%d.out", (int)getpid());
    FILE *f = fopen(in, "w");
    cr_assert(f);
    fprintf(f, "%d %d %d %d %d %.9g %d %d %d %d\n", T, E, k, o.sigmoid, o.norm_topk, o.route_scale,
            o.n_group, o.topk_group, o.force_balance, with_bias);
    for (int t = 0; t < T; t++, fputc('\n', f))
        for (int e = 0; e < E; e++) fprintf(f, "%.9g ", z[t * E + e]);
    if (with_bias)
        for (int e = 0; e < E; e++) fprintf(f, "%.9g ", bias[e]);
    fclose(f);
    snprintf(cmd, sizeof cmd, "python3 tools/router_ref.py < %s > %s", in, outp);
    char *out = NULL;
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    free(out);

    int32_t *idx = mt_malloc((size_t)T * k * sizeof(int32_t));
    float *w = mt_malloc((size_t)T * k * sizeof(float)), *probs = mt_malloc((size_t)T * E * sizeof(float));
    cpu_router_forward(idx, w, probs, z, with_bias ? bias : NULL, T, E, k, &o);
    f = fopen(outp, "r");
    cr_assert(f);
    for (int i = 0; i < T * k; i++) {
        int want;
        cr_assert_eq(fscanf(f, "%d", &want), 1);
        cr_expect_eq(idx[i], want, "token %d choice %d: expert %d, numpy %d", i / k, i % k, idx[i], want);
    }
    for (int i = 0; i < T * k; i++) {
        double want;
        cr_assert_eq(fscanf(f, "%lf", &want), 1);
        cr_expect(fabs(w[i] - want) <= 1e-6 * fabs(want) + 1e-7, "token %d weight %d: %.9g, numpy %.9g",
                  i / k, i % k, w[i], want);
    }
    fclose(f);
    unlink(in);
    unlink(outp);
    free(z), free(bias), free(idx), free(w), free(probs);
}

Test(router, variants_match_the_numpy_reference, .timeout = 120)
{
    if (!have_numpy()) cr_skip_test("python3 with numpy is not available");
    const struct router_opts qwen = {.norm_topk = true, .route_scale = 1, .n_group = 1, .topk_group = 1};
    struct router_opts o = qwen;
    variant_vs_numpy(16, 8, 2, o, false, 1);                /* Qwen3-MoE */
    o.sigmoid = true, o.route_scale = 2.5f;                 /* sigmoid + route_scale, renormalised */
    variant_vs_numpy(16, 8, 2, o, true, 2);
    o.norm_topk = false;                                    /* sigmoid, unnormalised */
    variant_vs_numpy(16, 8, 3, o, false, 3);
    o = qwen, o.sigmoid = true, o.n_group = 4, o.topk_group = 2, o.route_scale = 2.5f; /* DeepSeek-V3 */
    variant_vs_numpy(32, 16, 4, o, true, 4);
    o = qwen, o.n_group = 8, o.topk_group = 3;              /* groups of one */
    variant_vs_numpy(32, 8, 2, o, true, 5);
    o = qwen, o.force_balance = true;                       /* round-robin */
    variant_vs_numpy(16, 8, 3, o, true, 6);
}

/* The weights of a given selection are router_forward's weights for that selection, bit for bit. */
Test(router, gather_weights_reproduce_the_forward_weights)
{
    enum { T = 16, E = 8, K = 3 };
    mt_rng rng;
    mt_rng_seed(&rng, 8);
    float z[T * E], p[T * E], w[T * K], wg[T * K];
    int32_t idx[T * K];
    for (int i = 0; i < T * E; i++) z[i] = (float)mt_rng_normal(&rng);
    for (int pass = 0; pass < 3; pass++) {
        struct router_opts o = {.sigmoid = pass == 2, .norm_topk = pass != 1, .route_scale = pass ? 2.5f : 1,
                                .n_group = pass == 2 ? 4 : 1, .topk_group = pass == 2 ? 2 : 1};
        cpu_router_forward(idx, w, p, z, NULL, T, E, K, &o);
        cpu_router_gather_weights(wg, p, idx, T, E, K, &o);
        cr_expect(!memcmp(w, wg, sizeof w), "pass %d", pass);
    }
}

/* Every expert outside the chosen groups is unselectable, even one with the best score. */
Test(router, group_limit_masks_the_other_groups)
{
    enum { E = 8, K = 2 };
    const struct router_opts o = {.norm_topk = true, .route_scale = 1, .n_group = 4, .topk_group = 1};
    /* expert 0 is the single best, but group 3 (experts 6, 7) has the best top-2 sum */
    float z[E] = {3.0f, -4.0f, 0, 0, 0, 0, 2.5f, 2.5f};
    int32_t idx[K];
    float w[K], p[E];
    cpu_router_forward(idx, w, p, z, NULL, 1, E, K, &o);
    cr_expect(idx[0] == 6 && idx[1] == 7, "chose %d %d", idx[0], idx[1]);
    cr_expect(fabs(w[0] - 0.5) < 1e-6 && fabs(w[1] - 0.5) < 1e-6);
}

/* ---- no_decay_modules ------------------------------------------------------------------------- */

Test(router, no_decay_modules_select_tensors_by_module)
{
    struct model_config mc;
    small_model_config(&mc);
    mc.decoder_sparse_step = 2; /* layer 0 dense, layer 1 MoE */
    struct tensor_table tt;
    tensor_table_build(&tt, &mc);
    char line[256];
    no_decay_describe(&tt, line, sizeof line);
    cr_expect_str_eq(line, "gate, norm (10 tensors)"); /* the defaults: 2×4 layer norms + final + gate */
    no_decay_apply(&tt, "[embed, lm_head, experts]");
    for (int i = 0; i < tt.n; i++) {
        const enum tensor_role r = tt.t[i].role;
        const bool off = r == TR_EMBED || r == TR_LM_HEAD || r == TR_EXP_GATE_UP || r == TR_EXP_DOWN;
        cr_expect_eq(tt.t[i].decay, !off, "%s", tt.t[i].name);
    }
    no_decay_describe(&tt, line, sizeof line);
    cr_expect_str_eq(line, "embed, lm_head, experts (4 tensors)");
    no_decay_apply(&tt, "gate, norm, attn, mlp");
    no_decay_describe(&tt, line, sizeof line);
    cr_expect_str_eq(line, "gate, norm, attn, mlp (20 tensors)");
    tensor_table_free(&tt);
}

/* ---- expert-collapse warnings ----------------------------------------------------------------- */

Test(router, collapse_and_overload_warnings_name_layer_and_expert)
{
    struct model_config mc;
    small_model_config(&mc);
    mc.num_hidden_layers = 3;
    mc.decoder_sparse_step = 1;
    mc.n_mlp_only_layers = 1;
    mc.mlp_only_layers[0] = 0; /* MoE layers 1 and 2 */
    struct log_config lc = {.collapse_steps = 3, .load_warn = 2.5};
    struct expert_watch w;
    expert_watch_init(&w, &mc, &lc);
    double tok[2 * 4] = {4, 4, 4, 4, 5, 5, 6, 0}; /* layer 2 expert 3 idle */
    cr_expect_str_eq(expert_watch_step(&w, tok), "");
    cr_expect_str_eq(expert_watch_step(&w, tok), "");
    cr_expect_str_eq(expert_watch_step(&w, tok), "layer 2 expert 3 got no tokens for 3 steps");
    cr_expect_str_eq(expert_watch_step(&w, tok), "");
    double busy[2 * 4] = {13, 1, 1, 1, 5, 5, 6, 0}; /* layer 1: max/mean = 13 / 4 */
    cr_expect_str_eq(expert_watch_step(&w, busy), "layer 1 max/mean load 3.25 > 2.5");
    cr_expect_str_eq(expert_watch_step(&w, busy), "layer 2 expert 3 got no tokens for 6 steps");
    expert_watch_free(&w);
}

/* The busiest EP rank's routed tokens over the mean rank's, from per-expert counts: experts
 * [r E/ep, (r+1) E/ep) belong to rank r. */
Test(router, ep_rank_load_is_the_busiest_ranks_share)
{
    const double tok[8] = {4, 4, 2, 6, 1, 1, 3, 3}; /* ep 2: ranks 16 and 8, mean 12; ep 4: 8 8 2 6 */
    cr_expect_float_eq(expert_watch_rank_load_max(tok, 8, 2), 16.0 / 12.0, 1e-15);
    cr_expect_float_eq(expert_watch_rank_load_max(tok, 8, 4), 8.0 / 6.0, 1e-15);
    cr_expect_float_eq(expert_watch_rank_load_max(tok, 8, 1), 1.0, 1e-15);
    cr_expect_float_eq(expert_watch_rank_load_max(tok, 8, 8), 6.0 / 3.0, 1e-15);
    const double idle[4] = {0, 0, 0, 0};
    cr_expect_float_eq(expert_watch_rank_load_max(idle, 4, 2), 1.0, 0);
}

/* ---- aux_loss_scope: global_batch ------------------------------------------------------------- */

static void train_run(const char *tag, int np, int ep, int mb, const char *extra)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "rm -rf /tmp/mt_aux_%s && timeout 240 %s -np %d %s/moetrain train "
             "configs/tiny.yaml --backend cpu --set train.steps=4 --set train.global_batch_size=8 "
             "--set train.micro_batch_size=%d --set parallel.expert_parallel_size=%d "
             "--set model.router_aux_loss_coef=0.5 --set log.metrics=/tmp/mt_aux_%s.jsonl "
             "--set checkpoint.export_hf=/tmp/mt_aux_%s %s",
             tag, tu_mpirun(), np, tu_build(), mb, ep, tag, tag, extra);
    cr_assert_eq(tu_run(cmd, &out), 0, "run %s failed:\n%s", tag, out);
    free(out);
}

static void read_run(const char *tag, double *loss, double *aux)
{
    char path[128];
    snprintf(path, sizeof path, "/tmp/mt_aux_%s.jsonl", tag);
    cr_assert_eq(tu_read_losses(path, loss, 8), 4);
    cr_assert_eq(tu_read_metric(path, "aux_loss", aux, 8), 4);
}

/* The global-batch statistic of 4 micro-steps of 2 sequences (on 1 and on 2 ranks; 2 of 1 on 4
 * ranks, ep 2 × ep_fsdp 2) is the
 * micro-batch statistic of one micro-step holding all 8 (transformers' formula, which the verify
 * fixtures check): same aux, losses and trained weights. Micro-batch scope on 4 micro-steps is
 * not (the check can fail). */
Test(router, global_batch_aux_is_the_whole_batch_statistic_on_any_mesh, .timeout = 600)
{
    double lref[8], aref[8], l[8], a[8];
    train_run("one", 1, 1, 8, "");
    read_run("one", lref, aref);
    const char *tags[] = {"g1", "g2ep2", "g4ep2fsdp2"};
    const int np[] = {1, 2, 4}, eps[] = {1, 2, 2}, mbs[] = {2, 2, 1};
    for (int r = 0; r < 3; r++) {
        train_run(tags[r], np[r], eps[r], mbs[r], "--set train.aux_loss_scope=global_batch");
        read_run(tags[r], l, a);
        for (int s = 0; s < 4; s++) {
            cr_expect(fabs(a[s] - aref[s]) <= 1e-5 * aref[s], "%s step %d: aux %.8f vs %.8f", tags[r],
                      s + 1, a[s], aref[s]);
            cr_expect(fabs(l[s] - lref[s]) <= 1e-5 * lref[s], "%s step %d: loss %.8f vs %.8f", tags[r],
                      s + 1, l[s], lref[s]);
        }
    }
    train_run("micro", 1, 1, 2, "");
    read_run("micro", l, a);
    cr_expect(fabs(a[0] - aref[0]) > 1e-4 * aref[0], "micro-batch scope matched the global one: %.8f",
              a[0]);
    tu_run("rm -rf /tmp/mt_aux_one* /tmp/mt_aux_g1* /tmp/mt_aux_g2ep2* /tmp/mt_aux_g4ep2fsdp2* /tmp/mt_aux_micro*",
           NULL);
}

/* ---- routing replay --------------------------------------------------------------------------- */

#include "route_replay.h"

/* (a) the recompute gets the forward's routing back, whatever its own router says */
Test(router, recompute_reuses_the_forward_routing)
{
    struct model_config mc;
    small_model_config(&mc);
    struct model m;
    model_init(&m, backend_cpu(), &mc, GB, GS, NULL, true);
    const size_t tk = (size_t)m.T * m.K;
    int32_t *idx = mt_malloc(tk * sizeof(int32_t)), *saved = mt_malloc(tk * sizeof(int32_t));
    float *w = mt_malloc(tk * sizeof(float)), *wsaved = mt_malloc(tk * sizeof(float));
    for (size_t i = 0; i < tk; i++) idx[i] = (int32_t)(i % 2 ? 1 : 3), w[i] = 0.25f + (float)i;
    memcpy(saved, idx, tk * sizeof(int32_t));
    memcpy(wsaved, w, tk * sizeof(float));
    route_replay_apply(&m, 1, idx, w, NULL); /* forward: saves */
    for (size_t i = 0; i < tk; i++) idx[i] = 0, w[i] = -1;
    m.recomputing = true;
    route_replay_apply(&m, 1, idx, w, NULL); /* recompute: restores */
    m.recomputing = false;
    cr_expect(!memcmp(idx, saved, tk * sizeof(int32_t)) && !memcmp(w, wsaved, tk * sizeof(float)));
    cr_expect_eq(route_replay_bytes(&m), (size_t)2 * tk * 8);
    free(idx), free(saved), free(w), free(wsaved);
    model_free(&m);
}

/* (b) on a pipeline stage: each micro-batch slot keeps its own sequences' routing (1F1B forwards
 * micro-batch 1 before micro-batch 0's backward, whose recompute reads slot 0 again), and a stage
 * loads and keeps only its own MoE layers. */
Test(router, routing_file_keeps_each_slot_on_the_stage_layers)
{
    struct model_config mc;
    small_model_config(&mc);
    const int K = mc.num_experts_per_tok, E = mc.num_experts, n_seq = 2 * GB, tk = GB * GS * K;
    const char *path = "/tmp/mt_rr_slots.bin";
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    struct route_file_header h = {.version = ROUTE_FILE_VERSION, .layers = 2, .top_k = (uint32_t)K,
                                  .seq_len = GS, .sequences = (uint64_t)n_seq, .index_width = 2,
                                  .flags = ROUTE_FILE_HAS_WEIGHTS, .num_experts = (uint32_t)E};
    cr_assert(route_file_write_header(f, &h));
    /* sequence q, MoE layer k, token t: experts (q + 2k + t) mod E and the next; weights q + k / 10 */
    for (int q = 0; q < n_seq; q++) {
        for (int k = 0; k < 2; k++)
            for (int t = 0; t < GS; t++)
                for (int j = 0; j < K; j++) {
                    int16_t e = (int16_t)((q + 2 * k + t + j) % E);
                    cr_assert_eq(fwrite(&e, 2, 1, f), 1);
                }
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < GS * K; i++) {
                float w = (float)q + 0.1f * (float)k;
                cr_assert_eq(fwrite(&w, 4, 1, f), 1);
            }
    }
    cr_assert_eq(fclose(f), 0);
    struct model m;
    const struct model_stage st = {.layer0 = 1, .layer1 = 2, .first = false, .last = true, .n_slots = 2};
    model_init_stage(&m, backend_cpu(), &mc, GB, GS, NULL, true, &st);
    char err[512];
    cr_assert(route_replay_open(&m, path, n_seq, err, sizeof err), "%s", err);
    cr_expect_eq(route_replay_bytes(&m), (size_t)2 * tk * 8, "one MoE layer x two slots");
    route_replay_load(&m, 0, 0);        /* micro-batch 0: sequences 0, 1 */
    route_replay_load(&m, 1, GB);       /* micro-batch 1: sequences 2, 3 */
    int32_t *idx = mt_malloc((size_t)tk * sizeof(int32_t));
    float *w = mt_malloc((size_t)tk * sizeof(float));
    for (int slot = 0; slot < 2; slot++) {
        model_use_slot(&m, slot);
        m.recomputing = slot == 0;   /* slot 0: the recompute of micro-batch 0 after 1's forward */
        route_replay_apply(&m, 1, idx, w, NULL);
        m.recomputing = false;
        for (int b = 0; b < GB; b++)
            for (int t = 0; t < GS; t++)
                for (int j = 0; j < K; j++) {
                    const int q = slot * GB + b, i = (b * GS + t) * K + j;
                    cr_assert_eq(idx[i], (q + 2 + t + j) % E, "slot %d sequence %d token %d", slot, q, t);
                    cr_assert_float_eq(w[i], (float)q + 0.1f, 1e-6, "slot %d sequence %d", slot, q);
                }
    }
    free(idx), free(w);
    model_free(&m);
    unlink(path);
}

static void route_cmd(const char *what, const char *cmd_fmt, const char *arg, int want_rc, const char *want_msg)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, cmd_fmt, tu_build(), arg);
    int rc = tu_run(cmd, &out);
    if (want_rc == 0) cr_assert_eq(rc, 0, "%s failed:\n%s", what, out);
    else cr_expect_neq(rc, 0, "%s should fail:\n%s", what, out);
    if (want_msg) cr_expect(strstr(out, want_msg), "%s: no '%s' in:\n%s", what, want_msg, out);
    free(out);
}

#define TINY "%s/moetrain %s configs/tiny.yaml --backend cpu --set train.steps=1 "

/* (b) record, replay: step 1 of the replay is the recording run's step 1 (same experts, same
 * weights); without file weights the gradient is too, with them the router's CE part is cut. */
Test(router, routing_file_round_trip, .timeout = 300)
{
    route_cmd("record", TINY "--record /tmp/mt_rr_now.bin", "route", 0, "recorded the routing of 32");
    route_cmd("record with weights", TINY "--record /tmp/mt_rr_w.bin --with-weights", "route", 0, NULL);
    route_cmd("plain", TINY "--set log.metrics=/tmp/mt_rr_plain.jsonl", "train", 0, NULL);
    route_cmd("replay", TINY "--set log.metrics=/tmp/mt_rr_replay.jsonl "
              "--set data.routing_replay=/tmp/mt_rr_now.bin", "train", 0, NULL);
    route_cmd("replay with weights", TINY "--set log.metrics=/tmp/mt_rr_w.jsonl "
              "--set data.routing_replay=/tmp/mt_rr_w.bin --set train.activation_checkpointing=true",
              "train", 0, NULL);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s -np 2 " TINY "--set parallel.expert_parallel_size=2 --set train.micro_batch_size=2 "
             "--set log.metrics=/tmp/mt_rr_ep2.jsonl --set data.routing_replay=/tmp/mt_rr_now.bin", tu_mpirun(),
             tu_build(), "train");
    char *out = NULL;
    cr_assert_eq(tu_run(cmd, &out), 0, "replay on ep 2:\n%s", out);
    free(out);
    double l0, l1, l2, l3, g0, g1, g2;
    cr_assert_eq(tu_read_losses("/tmp/mt_rr_ep2.jsonl", &l3, 1), 1);
    cr_assert_eq(tu_read_losses("/tmp/mt_rr_plain.jsonl", &l0, 1), 1);
    cr_assert_eq(tu_read_losses("/tmp/mt_rr_replay.jsonl", &l1, 1), 1);
    cr_assert_eq(tu_read_losses("/tmp/mt_rr_w.jsonl", &l2, 1), 1);
    cr_assert_eq(tu_read_metric("/tmp/mt_rr_plain.jsonl", "grad_norm", &g0, 1), 1);
    cr_assert_eq(tu_read_metric("/tmp/mt_rr_replay.jsonl", "grad_norm", &g1, 1), 1);
    cr_assert_eq(tu_read_metric("/tmp/mt_rr_w.jsonl", "grad_norm", &g2, 1), 1);
    cr_expect(fabs(l1 - l0) <= 1e-6 * l0, "replay loss %.9f vs %.9f", l1, l0);
    cr_expect(fabs(l2 - l0) <= 1e-6 * l0, "replay-with-weights loss %.9f vs %.9f", l2, l0);
    cr_expect(fabs(g1 - g0) <= 1e-6 * g0, "replay grad norm %.9f vs %.9f", g1, g0);
    cr_expect(fabs(g2 - g0) > 1e-6 * g0, "fixed weights left the grad norm at %.9f", g2);
    cr_expect(fabs(l3 - l0) <= 1e-5 * l0, "replay on ep 2: loss %.9f vs %.9f", l3, l0);
    tu_run("rm -f /tmp/mt_rr_ep2.jsonl /tmp/mt_rr_plain.jsonl /tmp/mt_rr_replay.jsonl /tmp/mt_rr_w.jsonl "
           "/tmp/mt_rr_w.bin /tmp/mt_rr_now.bin", NULL);
}

/* Every mismatch is a one-line error on every rank. */
Test(router, routing_file_mismatches_are_one_line_errors, .timeout = 300)
{
    route_cmd("record", TINY "--record /tmp/mt_rr_bad.bin", "route", 0, NULL);
    route_cmd("layers", TINY "--set model.num_hidden_layers=3 --set data.routing_replay=/tmp/mt_rr_bad.bin",
              "train", 1, "routing of 2 MoE layers");
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s -np 2 %s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=1 "
             "--set model.num_hidden_layers=3 --set data.routing_replay=/tmp/mt_rr_bad.bin", tu_mpirun(), tu_build());
    cr_expect_neq(tu_run(cmd, &out), 0);
    cr_expect(strstr(out, "moetrain: error: data.routing_replay: /tmp/mt_rr_bad.bin: routing of 2 MoE layers, "
                     "top-2, 64 tokens per sequence, 8 experts; the model and train.seq_len need 3, 2, 64, 8"),
              "%s", out);
    free(out);
    route_cmd("sequences", TINY "--set train.steps=2 --set data.routing_replay=/tmp/mt_rr_bad.bin", "train", 1,
              "holds the routing of 32 sequences, the run trains on 64");
    route_cmd("seq_len", TINY "--set train.seq_len=32 --set data.routing_replay=/tmp/mt_rr_bad.bin", "train", 1,
              "the model and train.seq_len need 2, 2, 32, 8");
    /* expert id 9 of 8 at sequence 0, layer 0, token 1 (int16 ids right after the header) */
    tu_run("printf '\\011\\000' | dd of=/tmp/mt_rr_bad.bin bs=1 seek=68 conv=notrunc 2>/dev/null", NULL);
    route_cmd("bad id", TINY "--set data.routing_replay=/tmp/mt_rr_bad.bin", "train", 1,
              "sequence 0, MoE layer 0, token 1: expert id 9 is outside [0, num_experts)");
    tu_run("truncate -s 1000 /tmp/mt_rr_bad.bin", NULL);
    route_cmd("truncated", TINY "--set data.routing_replay=/tmp/mt_rr_bad.bin", "train", 1,
              "1000 bytes, but its header describes");
    route_cmd("not a file", TINY "--set data.routing_replay=configs/tiny.yaml", "train", 1,
              "not a routing file (no MTROUTE1 header)");
    route_cmd("missing", TINY "--set data.routing_replay=/tmp/mt_rr_none.bin", "train", 1,
              "cannot open the routing file");
    tu_run("rm -f /tmp/mt_rr_bad.bin", NULL);
}

/* The warnings reach the step line and the metrics file; round-robin routing loads every expert
 * equally (load 1.00-1.00 on the step line), and so every EP rank (ep load 1.00, shown with EP only). */
Test(router, warnings_and_forced_balance_in_a_run, .timeout = 120)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=2 "
             "--set log.interval=10 --set log.load_warn=1.01 --set log.metrics=/tmp/mt_warn.jsonl", tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "step 1/2") && strstr(out, "| WARNING layer "), "%s", out);
    free(out);
    cr_expect_eq(tu_run("grep -q '\"warning\": \"layer ' /tmp/mt_warn.jsonl", NULL), 0);
    snprintf(cmd, sizeof cmd, "%s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=1 "
             "--set model.debug_force_balance=true", tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "load 1.00-1.00"), "%s", out);
    cr_expect(!strstr(out, "WARNING"), "%s", out);
    cr_expect(!strstr(out, "ep load"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "timeout 100 %s -np 2 %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.steps=1 --set parallel.expert_parallel_size=2 --set model.debug_force_balance=true",
             tu_mpirun(), tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "load 1.00-1.00 | ep load 1.00 |"), "%s", out);
    free(out);
    tu_run("rm -f /tmp/mt_warn.jsonl", NULL);
}
