/* params_grad_sumsq_with (src/params.c): the gradient norm's sum of squares with some groups' sums
 * taken early (train.c takes those no reduction touches before fsdp_flush). On the CPU backend with
 * the small model and fresh random gradients: the early sums change no bit of the total, a given
 * sum is used as given, and the total matches a sum made here. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "model.h"
#include "ops.h"
#include "params.h"
#include "small_model.h"
#include "../test_util.h"

/* the small model on the CPU backend, its parameters of one rank (every group its working layout) */
static void small_cpu_model(struct model *m, struct params *p)
{
    struct model_config mc;
    small_model_config(&mc);
    model_init(m, backend_cpu(), &mc, 2, 8, NULL, false);
    params_init(p, m, NULL, NULL);
}

/* a uniform value in [-0.5, 0.5) */
static float centred(mt_rng *rng) { return (float)((double)(mt_rng_next(rng) >> 11) / 9007199254740992.0 - 0.5); }

Test(grad_norm, early_group_sums_give_the_same_bits)
{
    struct model m;
    struct params p;
    small_cpu_model(&m, &p);
    mt_rng rng;
    mt_rng_seed(&rng, 77);
    double here = 0;
    for (int g = 0; g < TG_COUNT; g++) {
        const int64_t n = p.g[g].numel;
        float *h = malloc((size_t)MT_MAX(n, 1) * sizeof(float));
        for (int64_t i = 0; i < n; i++) {
            h[i] = centred(&rng);
            here += (double)h[i] * h[i];
        }
        m.be->upload(p.g[g].grad, h, (size_t)n * sizeof(float));
        free(h);
    }
    cr_assert_gt(p.g[TG_DENSE].numel, 0);
    cr_assert_gt(p.g[TG_EXPERT].numel, 0);
    const double all = params_grad_sumsq(&p, NULL);
    cr_expect(fabs(all - here) <= 1e-6 * here, "sum of squares %.17g, made here %.17g", all, here);
    for (int g = 0; g < TG_COUNT; g++) {
        double known[TG_COUNT];
        for (int k = 0; k < TG_COUNT; k++) known[k] = NAN;
        known[g] = params_group_grad_sumsq(&p, (enum tensor_group)g);
        const double with = params_grad_sumsq_with(&p, known, NULL);
        cr_expect(with == all, "group %d early: %.17g against %.17g", g, with, all);
        known[g] += 1.0; /* a given sum is the one added */
        const double moved = params_grad_sumsq_with(&p, known, NULL);
        cr_expect(fabs(moved - (all + 1.0)) < 1e-9 * (all + 1.0), "group %d: %.17g against %.17g", g, moved, all + 1.0);
    }
    params_free(&p);
    model_free(&m);
}

/* params_group_grad_sumsq_known: the expert group's sum with some tensors' sums given (train.c's
 * gradient-norm fold). None given: the plain pass's bits. A layer's tensors all given: those are
 * added as given (a sum moved by 1 moves the total by 1) and the other units are read; every unit
 * given: the sums alone, whatever the gradients hold. A layer with only some of its tensors given
 * is read whole. */
Test(grad_norm, known_tensor_sums_replace_their_units_pass)
{
    struct model m;
    struct params p;
    small_cpu_model(&m, &p);
    params_bind_aliased(&p);
    mt_rng rng;
    mt_rng_seed(&rng, 78);
    const struct param_group_shard *ge = &p.g[TG_EXPERT];
    cr_assert(ge->aliased, "the expert group of one rank is its working layout");
    float *h = malloc((size_t)ge->numel * sizeof(float));
    for (int64_t i = 0; i < ge->numel; i++) h[i] = centred(&rng);
    m.be->upload(ge->grad, h, (size_t)ge->numel * sizeof(float));
    free(h);
    const double plain = params_group_grad_sumsq(&p, TG_EXPERT);
    double *known = malloc((size_t)m.tt.n * sizeof(double));
    for (int i = 0; i < m.tt.n; i++) known[i] = NAN;
    cr_expect(params_group_grad_sumsq_known(&p, TG_EXPERT, known) == plain, "no sums given: not the plain bits");
    cr_expect(params_group_grad_sumsq_known(&p, TG_EXPERT, NULL) == plain, "NULL: not the plain bits");
    /* each expert tensor's own sum, from its gradient */
    double *own = calloc((size_t)m.tt.n, sizeof(double));
    int n_exp_t = 0;
    for (int i = 0; i < m.tt.n; i++) {
        if (m.tt.t[i].kind != TK_EXPERT) continue;
        const float *g = model_grad(&m, i);
        for (int64_t j = 0; j < model_work_numel_of(&m, i); j++) own[i] += (double)g[j] * g[j];
        n_exp_t++;
    }
    cr_assert_geq(n_exp_t, 4, "the small model has two MoE layers of two expert tensors");
    for (int layer = 0; layer < 2; layer++) {
        for (int i = 0; i < m.tt.n; i++) known[i] = m.tt.t[i].kind == TK_EXPERT && m.tt.t[i].layer == layer ? own[i] : NAN;
        const double with = params_group_grad_sumsq_known(&p, TG_EXPERT, known);
        cr_expect(fabs(with - plain) <= 1e-12 * plain, "layer %d given: %.17g against %.17g", layer, with, plain);
        for (int i = 0; i < m.tt.n; i++)
            if (!isnan(known[i])) {
                known[i] += 1.0;
                break;
            }
        const double moved = params_group_grad_sumsq_known(&p, TG_EXPERT, known);
        cr_expect(fabs(moved - (with + 1.0)) <= 1e-12 * (with + 1.0), "layer %d: a given sum is not the one added", layer);
    }
    for (int i = 0; i < m.tt.n; i++) known[i] = m.tt.t[i].kind == TK_EXPERT ? 2.0 : NAN;
    cr_expect(params_group_grad_sumsq_known(&p, TG_EXPERT, known) == 2.0 * n_exp_t, "every unit given: not the sums alone");
    /* one tensor of layer 0 not given: layer 0 is read whole, its other tensor's sum not added */
    for (int i = 0; i < m.tt.n; i++) known[i] = m.tt.t[i].kind == TK_EXPERT ? own[i] : NAN;
    const int gu0 = tensor_lookup(&m.tt, TR_EXP_GATE_UP, 0), down0 = tensor_lookup(&m.tt, TR_EXP_DOWN, 0);
    cr_assert(gu0 >= 0 && down0 >= 0);
    known[gu0] = NAN;
    known[down0] = 1e6;
    const double part = params_group_grad_sumsq_known(&p, TG_EXPERT, known);
    cr_expect(fabs(part - plain) <= 1e-12 * plain, "layer 0 half given: %.17g against %.17g", part, plain);
    free(known), free(own);
    params_free(&p);
    model_free(&m);
}

/* The fold in training (train.c, MT_GRAD_NORM_FOLD=1 on the CPU backend): the small config with
 * groups of all the step's micro-steps (8 on one rank; 4 a rank at EP=2, the group capped by the
 * micro-steps; or one micro-step a step, no group) says that the norm took all 4 expert tensors'
 * sums from their weight-gradient pass,
 * and trains as the plain pass does: gradient norms to the 8 digits written, losses to 1e-6. Bad
 * values of the two switches are refused in one line. */
Test(grad_norm, the_fold_in_training_matches_the_pass, .timeout = 300)
{
    const struct {
        int np;
        const char *tag, *opts;
    } runs[] = {{1, "one", ""},
                {2, "ep2", "--set parallel.expert_parallel_size=2"},
                {1, "lone", "--set train.global_batch_size=4"}}; /* one micro-step: no group */
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        char cmd[1024], *out = NULL, m[2][64];
        for (int v = 0; v < 2; v++) {
            snprintf(m[v], sizeof m[v], "/tmp/mt_fold_%s_%d.jsonl", runs[r].tag, v);
            snprintf(cmd, sizeof cmd,
                     "MT_GRAD_NORM_FOLD=%d timeout 120 %s -np %d %s/moetrain train configs/tiny.yaml --backend cpu "
                     "--set train.steps=3 --set parallel.expert_wgrad_pairs=true --set parallel.expert_wgrad_group=8 "
                     "--set log.metrics=%s %s",
                     v, tu_mpirun(), runs[r].np, tu_build(), m[v], runs[r].opts);
            cr_assert_eq(tu_run(cmd, &out), 0, "%s: %s", runs[r].tag, out);
            const bool said = strstr(out, "grad norm   4 of the stage's expert weight tensors summed") != NULL;
            cr_expect(said == (v == 1), "%s, MT_GRAD_NORM_FOLD=%d: the start-up line %s:\n%s", runs[r].tag, v,
                      said ? "says the sums were taken" : "is missing", out);
            free(out);
        }
        const char *fields[] = {"grad_norm", "loss"};
        const double tol[] = {1e-7, 1e-6};
        for (int f = 0; f < 2; f++) {
            double a[4], b[4];
            cr_assert_eq(tu_read_metric(m[1], fields[f], a, 4), 3);
            cr_assert_eq(tu_read_metric(m[0], fields[f], b, 4), 3);
            for (int i = 0; i < 3; i++)
                cr_expect(fabs(a[i] - b[i]) <= tol[f] * fabs(b[i]), "%s: %s step %d: %.17g with the fold, %.17g without",
                          runs[r].tag, fields[f], i + 1, a[i], b[i]);
        }
        unlink(m[0]), unlink(m[1]);
    }
    const char *bad[][2] = {{"MT_GRAD_NORM_FOLD=yes", "environment variable MT_GRAD_NORM_FOLD=yes: expected one of 0, 1, auto"},
                            {"MT_GROUP_MEM_SHARE=1.5", "MT_GROUP_MEM_SHARE=1.5: a share of the device's memory, under 1"}};
    for (int i = 0; i < 2; i++) {
        char cmd[1024], *out = NULL;
        snprintf(cmd, sizeof cmd, "%s timeout 60 %s -np 1 %s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=1",
                 bad[i][0], tu_mpirun(), tu_build());
        cr_expect_neq(tu_run(cmd, &out), 0, "%s: ran", bad[i][0]);
        cr_expect(out && strstr(out, bad[i][1]), "no '%s' in:\n%s", bad[i][1], out ? out : "");
        cr_expect(out && !strstr(out, "step 1/"), "the run went on:\n%s", out ? out : "");
        free(out);
    }
}
