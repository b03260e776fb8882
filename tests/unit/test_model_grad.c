/* Whole-model finite-difference gradient checks on the CPU backend (one rank, no EP), for config
 * variants transformers accepts but the reference fixture does not cover: the default MoE model with
 * the aux loss, dense layers mixed in, norm_topk_prob false, tied embeddings, top-1 routing and
 * Hq = Hkv.
 *
 * The loss is the one verify.c and the train loop differentiate:
 *   L = Σ token CE / n_valid + coef · aux,   aux from aux_from_stats over the forward's stats,
 * with the gradient from model_backward(1 / n_valid, aux_dp = aux_grad_from_counts(...)). For a
 * few elements of every tensor (the largest |grad| and some random ones) the working weight is
 * moved by ±h and L recomputed by forward only; the central difference must match the analytic
 * gradient. Routing is piecewise constant in the weights: an element whose perturbed forward picks
 * a different top-k in any MoE layer is skipped (and counted; only a small fraction may be).
 *
 * Step and tolerance. The forward runs in fp32, so L (about 4) carries rounding noise; observed
 * differences put it near 1e-7, bounded here by LOSS_NOISE = 2e-7, which gives an absolute error
 * of LOSS_NOISE / h in the central difference. The truncation error is ~ h² |L'''| / 6 relative.
 * h = 5e-3 (2.5% of the weight scale 0.2) balances the two (h = 1e-2 left 0.7% truncation error
 * on some embedding entries). When a routing decision lies within ±h the step is cut to h/4, then
 * h/16 (the derivative exists; only the step was too wide); only then is the element skipped.
 *   |num − ana| ≤ 1e-2 · |ana| + LOSS_NOISE / h + 1e-4 · max|grad of the tensor|
 * Correct code stays below a quarter of that on every element checked; code with a dropped or
 * wrong term (aux gradient missing or 20% off, router input or weight gradient missing, the
 * top-k renormalisation projection missing, embedding backward missing with tied weights, a dense
 * MLP weight gradient missing, one routing weight's gradient 10% off) fails by 2x to 1000x. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "model_step.h"
#include "ops.h"
#include "params.h"
#include "step_maths.h"
#include "small_model.h"

#define GB 2
#define GS 8
#define STEP 5e-3          /* first step; /4 and /16 when routing flips within it */
#define RTOL 1e-2
#define LOSS_NOISE 2e-7    /* bound on the fp32 rounding noise of L; its share of the error is this / h */
#define GTOL 1e-4          /* × max |grad| of the tensor */
#define N_RANDOM 3         /* random elements per tensor besides the largest-|grad| one */

struct grad_ctx {
    struct model m;
    struct params p;
    int32_t ids[GB * GS], labels[GB * GS];
    int32_t *route0;        /* [n_moe][T*k] top-k of the unperturbed forward */
};

/* L = CE mean + coef · aux of a fresh forward, in double. */
static double loss_of(struct grad_ctx *g)
{
    struct model *m = &g->m;
    struct model_step_out o;
    model_forward(m, g->ids, g->labels, &o);
    double aux = 0;
    if (m->E > 0) aux_from_stats(m->stats_h, m->L, &m->cfg, m->T, &aux, NULL);
    return o.ce_sum / (double)o.n_valid + m->cfg.router_aux_loss_coef * aux;
}

/* Copies (save) or compares with (!save) the routing of the last forward; true if unchanged. */
static bool same_routing(struct grad_ctx *g, bool save)
{
    const struct model *m = &g->m;
    const size_t tk = (size_t)m->T * m->K;
    int n = 0;
    bool same = true;
    for (int l = 0; l < m->L; l++) {
        if (!config_layer_is_moe(&m->cfg, l)) continue;
        int32_t *mine = g->route0 + (size_t)n++ * tk;
        const int32_t *now = m->layers[l].topk_idx /* CPU backend: host memory */;
        if (save) memcpy(mine, now, tk * sizeof(int32_t));
        else same = same && !memcmp(mine, now, tk * sizeof(int32_t));
    }
    return same;
}

struct grad_report {
    int checked, skipped, failed;
    double worst;           /* largest |num − ana| / allowed */
    char worst_what[256];
};

/* Central difference of L along element j of tensor i with step h; false if either perturbed
 * forward routed differently from the unperturbed one. */
static bool central_difference(struct grad_ctx *g, int i, int64_t j, double h, double *num)
{
    float *w = model_weight(&g->m, i);
    const float w0 = w[j];
    w[j] = (float)(w0 + h);
    const double wp = w[j];     /* the steps actually taken, after rounding to fp32 */
    const double lp = loss_of(g);
    bool same = same_routing(g, false);
    w[j] = (float)(w0 - h);
    const double wm = w[j];
    const double lm = loss_of(g);
    same = same && same_routing(g, false);
    w[j] = w0;
    *num = (lp - lm) / (wp - wm);
    return same;
}

static void check_element(struct grad_ctx *g, int i, int64_t j, double ana, double gmax,
                          struct grad_report *r)
{
    /* a smaller step when a routing decision lies within ±h (the derivative is still defined) */
    double h = STEP, num = 0;
    bool same = false;
    for (int tries = 0; tries < 3 && !(same = central_difference(g, i, j, h, &num)); tries++) h /= 4;
    if (!same) {
        r->skipped++;
        return;
    }
    const double allowed = RTOL * fabs(ana) + LOSS_NOISE / h + GTOL * gmax;
    const double ratio = fabs(num - ana) / allowed;
    r->checked++;
    if (!(ratio <= 1)) r->failed++;
    if (!(ratio <= r->worst)) {
        r->worst = ratio;
        snprintf(r->worst_what, sizeof r->worst_what, "%s[%lld]: analytic %.6g, numeric %.6g (h %.2g)",
                 g->m.tt.t[i].name, (long long)j, ana, num, h);
    }
    if (getenv("MT_GRADCHECK_VERBOSE"))
        printf("  %-46s [%5lld] h %.1e ana %+.6e num %+.6e ratio %.3f\n", g->m.tt.t[i].name,
               (long long)j, h, ana, num, ratio);
}

/* Builds the model for `mc`, takes the analytic gradient, then checks a few elements per tensor. */
static void grad_check(const struct model_config *mc, struct grad_report *r)
{
    struct grad_ctx *g = mt_calloc(1, sizeof *g);
    struct model *m = &g->m;
    memset(r, 0, sizeof *r);
    model_init(m, backend_cpu(), mc, GB, GS, NULL, false);
    params_init(&g->p, m, NULL, NULL);
    params_init_random(&g->p, 7);
    params_gather_weights(&g->p);

    mt_rng rng;
    mt_rng_seed(&rng, 99);
    /* norm weights away from 1, so no symmetry of the init hides a wrong norm gradient */
    for (int i = 0; i < m->tt.n; i++) {
        if (m->tt.t[i].kind != TK_NORM) continue;
        float *w = model_weight(m, i);
        for (int64_t j = 0; j < model_work_numel_of(m, i); j++) w[j] *= (float)(1 + 0.2 * mt_rng_normal(&rng));
    }
    for (int t = 0; t < GB * GS; t++) {
        g->ids[t] = (int32_t)(mt_rng_next(&rng) % (uint64_t)m->V);
        g->labels[t] = g->ids[t];
    }
    g->labels[3] = MT_IGNORE_INDEX;      /* ignored labels count for nothing, as in transformers */
    g->labels[GS + 5] = MT_IGNORE_INDEX;

    /* analytic gradient, exactly as verify.c forms it */
    struct model_step_out o;
    model_forward(m, g->ids, g->labels, &o);
    cr_assert_gt(o.n_valid, 0);
    g->route0 = mt_malloc((size_t)MT_MAX(m->n_moe_layers, 1) * m->T * MT_MAX(m->K, 1) * sizeof(int32_t));
    same_routing(g, true);
    float *aux_dp = NULL;
    if (m->E > 0) {
        double aux, *cnt = mt_calloc((size_t)m->E, sizeof(double));
        aux_from_stats(m->stats_h, m->L, mc, m->T, &aux, cnt);
        aux_dp = mt_calloc((size_t)m->E, sizeof(float));
        aux_grad_from_counts(cnt, m->E, m->n_moe_layers, m->T, mc->router_aux_loss_coef, aux_dp);
        free(cnt);
    }
    model_zero_grad(m);
    model_backward(m, (float)(1.0 / (double)o.n_valid), aux_dp);
    free(aux_dp);

    for (int i = 0; i < m->tt.n; i++) {
        const int64_t n = model_work_numel_of(m, i);
        float *grad = mt_malloc((size_t)n * sizeof(float));
        memcpy(grad, model_grad(m, i), (size_t)n * sizeof(float));
        int64_t jmax = 0;
        double gmax = 0;
        for (int64_t j = 0; j < n; j++)
            if (fabs(grad[j]) > gmax) {
                gmax = fabs(grad[j]);
                jmax = j;
            }
        cr_expect(isfinite(gmax), "%s: gradient not finite", m->tt.t[i].name);
        check_element(g, i, jmax, grad[jmax], gmax, r);
        for (int k = 0; k < N_RANDOM; k++) {
            int64_t j = (int64_t)(mt_rng_next(&rng) % (uint64_t)n);
            check_element(g, i, j, grad[j], gmax, r);
        }
        free(grad);
    }
    free(g->route0);
    params_free(&g->p);
    model_free(m);
    free(g);
}

static void expect_gradients_match(const struct model_config *mc, const char *what)
{
    struct grad_report r;
    grad_check(mc, &r);
    const int total = r.checked + r.skipped;
    if (getenv("MT_GRADCHECK_VERBOSE"))
        printf("%s: %d checked, %d skipped (routing changed), worst %.3f of the tolerance: %s\n", what,
               r.checked, r.skipped, r.worst, r.worst_what);
    cr_expect_eq(r.failed, 0, "%s: %d of %d elements outside the tolerance; worst (%.2fx): %s", what,
                 r.failed, r.checked, r.worst, r.worst_what);
    /* routing changes must stay rare, or the check would test little */
    cr_expect_leq(r.skipped * 10, total, "%s: %d of %d elements skipped for routing changes", what,
                  r.skipped, total);
}

Test(model_grad, default_moe_with_aux_loss)
{
    struct model_config mc;
    small_model_config(&mc);
    expect_gradients_match(&mc, "default MoE + aux");
}

Test(model_grad, dense_layer_in_the_middle)
{
    struct model_config mc;
    small_model_config(&mc);
    mc.num_hidden_layers = 3;
    mc.n_mlp_only_layers = 1;
    mc.mlp_only_layers[0] = 1;
    expect_gradients_match(&mc, "mlp_only_layers = [1]");
}

Test(model_grad, decoder_sparse_step_2)
{
    struct model_config mc;
    small_model_config(&mc);
    mc.decoder_sparse_step = 2;   /* layer 0 dense, layer 1 MoE */
    expect_gradients_match(&mc, "decoder_sparse_step = 2");
}

Test(model_grad, norm_topk_prob_false)
{
    struct model_config mc;
    small_model_config(&mc);
    mc.norm_topk_prob = false;
    expect_gradients_match(&mc, "norm_topk_prob = false");
}

Test(model_grad, tied_word_embeddings)
{
    struct model_config mc;
    small_model_config(&mc);
    mc.tie_word_embeddings = true;
    expect_gradients_match(&mc, "tie_word_embeddings = true");
}

Test(model_grad, top1_routing)
{
    struct model_config mc;
    small_model_config(&mc);
    mc.num_experts_per_tok = 1;
    expect_gradients_match(&mc, "num_experts_per_tok = 1");
}

Test(model_grad, heads_equal_kv_heads)
{
    struct model_config mc;
    small_model_config(&mc);
    mc.num_key_value_heads = mc.num_attention_heads;
    expect_gradients_match(&mc, "Hq = Hkv");
}

/* DeepSeek-V3-style router (docs/router.md): sigmoid scores, 2 groups of 2 with 1 usable,
 * route_scale; the whole model's gradient through the router variant. */
Test(model_grad, sigmoid_group_limited_router)
{
    struct model_config mc;
    small_model_config(&mc);
    mc.scoring = MT_SCORE_SIGMOID;
    mc.n_group = 2;
    mc.topk_group = 1;
    mc.route_scale = 2.5;
    expect_gradients_match(&mc, "sigmoid, groups 1/2, route_scale 2.5");
}
