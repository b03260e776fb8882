/* Document masking in the model (CPU backend): a packed sequence of two documents, with positions
 * restarting at the second document and attention kept inside each document, must give the
 * per-token losses and the weight gradients of the two documents run as sequences of their own. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "data.h"
#include "model_step.h"
#include "ops.h"
#include "params.h"
#include "small_model.h"

enum { EOS = 1, LA = 3, LB = 5, LP = LA + LB };

struct run {
    struct model m;
    struct params p;
};

static void open_model(struct run *r, const struct model_config *mc, int S)
{
    model_init(&r->m, backend_cpu(), mc, 1, S, NULL, false);
    params_init(&r->p, &r->m, NULL, NULL);
    params_init_random(&r->p, 11);
    params_gather_weights(&r->p);
    model_zero_grad(&r->m);
}

static void close_model(struct run *r)
{
    params_free(&r->p);
    model_free(&r->m);
}

/* Forward (+ backward with ce_scale 1, no aux) of one sequence; losses [S] copied out. */
static void run_seq(struct run *r, const int32_t *ids, const int32_t *labels, const int32_t *pos,
                    const int32_t *seg, float *losses)
{
    struct model_step_out o;
    model_set_documents(&r->m, 0, pos, seg);
    model_forward(&r->m, ids, labels, &o);
    memcpy(losses, r->m.losses, (size_t)r->m.T * sizeof(float));   /* CPU: host memory */
    model_backward(&r->m, 1.0f, NULL);
}

Test(documents, packed_documents_equal_separate_runs)
{
    struct model_config mc;
    small_model_config(&mc);
    /* document A ends with EOS; document B follows it in the packed row */
    const int32_t a[LA] = {7, 23, EOS}, b[LB] = {5, 31, 12, 9, 38};
    int32_t packed[LP], labels[LP], pos[LP], seg[LP];
    memcpy(packed, a, sizeof a);
    memcpy(packed + LA, b, sizeof b);
    /* EOS does not predict B's first token (the separate run of A has nothing to predict there) */
    cr_assert_eq(data_labels(EOS, false, packed, 1, LP, labels), LP - 2);
    data_documents(EOS, packed, 1, LP, pos, seg);
    const int32_t want_pos[LP] = {0, 1, 2, 0, 1, 2, 3, 4}, want_seg[LP] = {0, 0, 0, 1, 1, 1, 1, 1};
    cr_assert(memcmp(pos, want_pos, sizeof pos) == 0 && memcmp(seg, want_seg, sizeof seg) == 0);

    struct run rp, ra, rb, rc;
    open_model(&rp, &mc, LP);
    open_model(&ra, &mc, LA);
    open_model(&rb, &mc, LB);
    open_model(&rc, &mc, LP);
    float lp[LP], la[LA], lb[LB], lc[LP];
    run_seq(&rp, packed, labels, pos, seg, lp);
    run_seq(&ra, a, NULL, NULL, NULL, la);
    run_seq(&rb, b, NULL, NULL, NULL, lb);
    run_seq(&rc, packed, labels, NULL, NULL, lc);   /* the same row without masking */

    for (int t = 0; t < LA; t++)
        cr_expect(fabsf(lp[t] - la[t]) <= 1e-5f * fmaxf(1, fabsf(la[t])), "A token %d: packed %g, alone %g",
                  t, lp[t], la[t]);
    for (int t = 0; t < LB; t++)
        cr_expect(fabsf(lp[LA + t] - lb[t]) <= 1e-5f * fmaxf(1, fabsf(lb[t])),
                  "B token %d: packed %g, alone %g", t, lp[LA + t], lb[t]);
    /* without masking, B's tokens see A: the losses must differ, or this test proves nothing */
    double diff = 0;
    for (int t = LA; t < LP - 1; t++) diff += fabsf(lc[t] - lp[t]);
    cr_expect(diff > 1e-3, "masking changed nothing (sum |diff| %g)", diff);

    /* gradients: packed = A alone + B alone */
    for (int i = 0; i < rp.m.tt.n; i++) {
        const int64_t n = model_work_numel_of(&rp.m, i);
        const float *gp = model_grad(&rp.m, i), *ga = model_grad(&ra.m, i), *gb = model_grad(&rb.m, i);
        double worst = 0, scale = 0;
        for (int64_t j = 0; j < n; j++) {
            worst = fmax(worst, fabs((double)gp[j] - ga[j] - gb[j]));
            scale = fmax(scale, fabs((double)gp[j]));
        }
        cr_expect(worst <= 1e-4 * fmax(scale, 1e-3), "%s: packed gradient differs from the sum of "
                  "the separate ones by %g (max |grad| %g)", rp.m.tt.t[i].name, worst, scale);
    }
    /* and back to plain causal attention over the whole row */
    float lc2[LP];
    model_zero_grad(&rp.m);
    run_seq(&rp, packed, labels, NULL, NULL, lc2);
    cr_expect(memcmp(lc, lc2, sizeof lc) == 0, "clearing the documents did not restore t mod S");
    close_model(&rp), close_model(&ra), close_model(&rb), close_model(&rc);
}
