/* The loss gradient computed in the head's forward (model_arm_loss_gradient, ops.h
 * cross_entropy_fused) against the forward and backward ops apart, on the CPU backend with the small
 * model: the same CE sums and gradients bit for bit over accumulated micro-steps (on the CPU the
 * fused op is the two ops in turn, so any difference is the model's plumbing: the scale, the
 * buffer, the backward skipping its loss op), and the logits buffer of an armed forward holding
 * exactly the gradient the backward op makes from a disarmed forward's logits. The CUDA kernel is
 * checked against the CPU in gpu/cross_entropy_fused. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "model_step.h"
#include "ops.h"
#include "params.h"
#include "small_model.h"

#define LB 2
#define LS 8
#define N_MICRO 3

struct run {
    struct model m;
    struct params p;
};

static void run_init(struct run *r)
{
    struct model_config mc;
    small_model_config(&mc);
    model_init(&r->m, backend_cpu(), &mc, LB, LS, NULL, false);
    params_init(&r->p, &r->m, NULL, NULL);
    params_init_random(&r->p, 17);
    params_gather_weights(&r->p);
}

static void run_free(struct run *r)
{
    params_free(&r->p);
    model_free(&r->m);
}

static void micro_ids(int k, int32_t *ids, int V)
{
    mt_rng rng;
    mt_rng_seed(&rng, 900 + (uint64_t)k);
    for (int t = 0; t < LB * LS; t++) ids[t] = (int32_t)(mt_rng_next(&rng) % (uint64_t)V);
}

/* N_MICRO micro-steps onto zeroed gradients, the loss scale fixed before the forwards as the
 * training loop has it; returns the summed CE */
static double accumulate(struct run *r, bool armed)
{
    struct model *m = &r->m;
    const float scale = 1.0f / (float)(N_MICRO * LB * (LS - 1));
    double ce = 0;
    model_zero_grad(m);
    for (int k = 0; k < N_MICRO; k++) {
        int32_t ids[LB * LS];
        micro_ids(k, ids, m->V);
        struct model_step_out o;
        if (armed) model_arm_loss_gradient(m, scale);
        model_forward(m, ids, NULL, &o);
        model_disarm_loss_gradient(m);
        cr_expect_eq(m->dlogits_scale, armed ? scale : 0.0f, "micro-step %d: dlogits_scale %g after the forward",
                     k, (double)m->dlogits_scale);
        cr_expect_eq(o.n_valid, LB * (LS - 1));
        ce += o.ce_sum;
        m->more_backwards = k + 1 < N_MICRO;
        model_backward(m, scale, NULL);
        cr_expect(m->dlogits_scale == 0, "the backward leaves dlogits_scale set");
    }
    return ce;
}

Test(loss_fused, the_same_losses_and_gradients_bit_for_bit)
{
    struct run ref, got;
    run_init(&ref);
    run_init(&got);
    const double ce_ref = accumulate(&ref, false), ce_got = accumulate(&got, true);
    cr_expect(ce_ref == ce_got, "CE sum %.17g armed, %.17g apart", ce_got, ce_ref);
    int differ = 0;
    for (int i = 0; i < ref.m.tt.n; i++) {
        const size_t bytes = (size_t)model_work_numel_of(&ref.m, i) * sizeof(float);
        if (memcmp(model_grad(&ref.m, i), model_grad(&got.m, i), bytes)) {
            cr_expect(0, "%s: gradient differs with the loss gradient in the forward", ref.m.tt.t[i].name);
            differ++;
        }
    }
    cr_expect_eq(differ, 0);
    run_free(&ref);
    run_free(&got);
}

Test(loss_fused, an_armed_forward_leaves_the_scaled_gradient_in_the_logits)
{
    struct run a, b;
    run_init(&a);
    run_init(&b);
    const float scale = 0.125f;
    int32_t ids[LB * LS];
    micro_ids(0, ids, a.m.V);
    struct model_step_out o;
    model_forward(&a.m, ids, NULL, &o); /* disarmed: logits */
    cr_expect(a.m.dlogits_scale == 0);
    model_arm_loss_gradient(&b.m, scale);
    model_forward(&b.m, ids, NULL, &o);
    model_disarm_loss_gradient(&b.m);
    cr_expect(b.m.dlogits_scale == scale);
    const size_t n = (size_t)a.m.T * a.m.V;
    cr_expect(memcmp(a.m.logits, b.m.logits, n * sizeof(float)), "the armed forward left the logits");
    a.m.be->cross_entropy_backward(a.m.logits, a.m.logits, a.m.lse_f, a.m.targets, a.m.T, a.m.V, scale);
    cr_expect(!memcmp(a.m.logits, b.m.logits, n * sizeof(float)),
              "the armed forward's buffer is not the backward op's gradient at its scale");
    cr_expect(!memcmp(a.m.losses, b.m.losses, (size_t)a.m.T * sizeof(float)), "the losses differ");
    run_free(&a);
    run_free(&b);
}
