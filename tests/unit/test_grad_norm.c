/* params_grad_sumsq_with (src/params.c): the gradient norm's sum of squares with some groups' sums
 * taken early (train.c takes those no reduction touches before fsdp_flush). On the CPU backend with
 * the small model and fresh random gradients: the early sums change no bit of the total, a given
 * sum is used as given, and the total matches a sum made here. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "config.h"
#include "model.h"
#include "ops.h"
#include "params.h"
#include "small_model.h"

Test(grad_norm, early_group_sums_give_the_same_bits)
{
    struct model_config mc;
    small_model_config(&mc);
    struct model m;
    struct params p;
    model_init(&m, backend_cpu(), &mc, 2, 8, NULL, false);
    params_init(&p, &m, NULL, NULL);
    mt_rng rng;
    mt_rng_seed(&rng, 77);
    double here = 0;
    for (int g = 0; g < TG_COUNT; g++) {
        const int64_t n = p.g[g].numel;
        float *h = malloc((size_t)MT_MAX(n, 1) * sizeof(float));
        for (int64_t i = 0; i < n; i++) {
            h[i] = (float)((double)(mt_rng_next(&rng) >> 11) / 9007199254740992.0 - 0.5);
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
