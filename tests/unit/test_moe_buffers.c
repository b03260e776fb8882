/* The MoE layer's expert-side buffers (src/moe_buffers.c) on the CPU backend with the small model
 * and the loopback (MT_MOE_LOOPBACK=1: the pair path and an exchange with itself at ep = 1). The
 * fixed exchange's capacity (rows_cap) is the headroom already: each layer's expert rows and the
 * backward's scratch hold exactly that many rows, not another 25% on top; a grown capacity grows
 * them to exactly the new one. The counted exchange keeps 25% over what a forward needed. */
#include <criterion/criterion.h>
#include <stdlib.h>

#include "common.h"
#include "config.h"
#include "model.h"
#include "model_step.h"
#include "moe_buffers.h"
#include "ops.h"
#include "params.h"
#include "small_model.h"

enum { B = 2, S = 8 };

static void forward_once(struct model *m, unsigned seed)
{
    int32_t ids[B * S];
    mt_rng rng;
    mt_rng_seed(&rng, seed);
    for (int t = 0; t < B * S; t++) ids[t] = (int32_t)(mt_rng_next(&rng) % (uint64_t)m->V);
    struct model_step_out o;
    model_forward(m, ids, NULL, &o);
}

Test(moe_buffers, fixed_exchange_rows_are_the_capacity_exactly)
{
    setenv("MT_MOE_LOOPBACK", "1", 1);
    struct model_config mc;
    small_model_config(&mc);
    struct model m;
    struct params p;
    model_init(&m, backend_cpu(), &mc, B, S, NULL, false);
    params_init(&p, &m, NULL, NULL);
    params_init_random(&p, 5);
    params_gather_weights(&p);
    cr_assert(m.pairs, "MT_MOE_LOOPBACK=1 did not turn the pair path on");
    /* half the mean rows: the first forward's plans are cut, and the growth has room (at ep = 1 no
     * plan makes more than T·k rows, the most a capacity grows to) */
    model_enable_fixed_exchange(&m, 0.5);
    const int64_t mean = (int64_t)m.T * m.K;
    cr_assert_eq(m.rows_cap[0], mean / 2);
    for (int round = 0; round < 2; round++) {
        m.rows_by_capacity = true;
        forward_once(&m, 3 + (unsigned)round);
        m.rows_by_capacity = false;
        for (int l = 0; l < m.L; l++) {
            cr_expect_eq(m.layers[l].cap_rows, m.rows_cap[l], "round %d layer %d: expert rows %lld, capacity %lld",
                         round, l, (long long)m.layers[l].cap_rows, (long long)m.rows_cap[l]);
            cr_expect_eq(m.layers[l].route.R_exp, m.rows_cap[l]);
        }
        cr_expect_eq(m.d_cap_rows, MT_MAX(m.rows_cap[0], (int64_t)m.T * m.ep), "round %d: scratch rows %lld",
                     round, (long long)m.d_cap_rows);
        /* a grown capacity (as after a cut step): the buffers follow it exactly */
        int64_t need[MT_MAX_LAYERS] = {0};
        need[0] = mean;
        model_fixed_exchange_grow(&m, need);
        if (round == 0) cr_assert_gt(m.rows_cap[0], m.layers[0].cap_rows, "the capacity did not grow");
    }
    /* the counted exchange: 25% over the forward's own rows */
    params_free(&p);
    model_free(&m);
    model_init(&m, backend_cpu(), &mc, B, S, NULL, false);
    params_init(&p, &m, NULL, NULL);
    params_init_random(&p, 5);
    params_gather_weights(&p);
    forward_once(&m, 3);
    for (int l = 0; l < m.L; l++)
        cr_expect_eq(m.layers[l].cap_rows, moe_capacity(m.layers[l].route.R_exp, mean),
                     "counted, layer %d: %lld rows for %lld", l, (long long)m.layers[l].cap_rows,
                     (long long)m.layers[l].route.R_exp);
    params_free(&p);
    model_free(&m);
    unsetenv("MT_MOE_LOOPBACK");
}
