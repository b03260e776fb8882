#include "aux_scope.h"

#include <stdlib.h>
#include <string.h>

#include "pipeline_forward.h"
#include "route_replay.h"
#include "step_maths.h"

double aux_global_prepass(struct model *m, const struct aux_prepass *a, int step, double coef,
                          float *aux_dp)
{
    const int L = m->L, E = m->E;
    const size_t nstat = (size_t)L * 2 * E;
    float *sum = mt_calloc(nstat, sizeof(float));
    const struct step_batch *b = a->batch;
    if (a->pp) {
        /* each stage sums its own layers' rows; the others' are 0 there, so the sum over the
         * pipeline is every layer's statistics exactly, on every rank */
        struct pipe_forward f = {.m = m, .pp = a->pp, .b = b, .replay = true, .step = step - 1,
                                 .stage_h = a->stage_h, .stats_sum = sum};
        pipe_forward_run(&f);
        comm_all_reduce_sum(a->pp_h, sum, nstat, COMM_F32);
    }
    for (int micro = 0; micro < b->n_micro && !a->pp; micro++) {
        route_replay_load(m, 0, data_first_seq(step - 1, micro, b->n_micro, b->dp_rank, b->dp_size, b->mb));
        struct model_step_out o;
        step_batch_forward(b, micro, m, &o);   /* the same documents and labels as the micro-steps */
        comm_all_reduce_sum(a->stage_h, m->stats_h, nstat, COMM_F32);
        for (size_t i = 0; i < nstat; i++) sum[i] += m->stats_h[i];
    }
    const int64_t tokens = a->tokens_micro_global * b->n_micro;
    double aux, *cnt = mt_calloc((size_t)E, sizeof(double));
    aux_from_stats(sum, L, &m->cfg, tokens, &aux, cnt);
    aux_grad_from_counts(cnt, E, m->n_moe_layers, tokens, coef, aux_dp);
    free(cnt);
    free(sum);
    return aux;
}
