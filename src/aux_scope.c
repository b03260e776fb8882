#include "aux_scope.h"

#include <stdlib.h>
#include <string.h>

#include "route_replay.h"
#include "train.h"

double aux_global_prepass(struct model *m, const struct aux_prepass *a, int step, double coef,
                          float *aux_dp)
{
    const int L = m->L, E = m->E;
    const size_t nstat = (size_t)L * 2 * E;
    float *sum = mt_calloc(nstat, sizeof(float));
    for (int micro = 0; micro < a->n_micro; micro++) {
        int64_t first = data_first_seq(step - 1, micro, a->n_micro, a->dp_rank, a->dp, a->micro_batch);
        data_get_sequences(a->data, first, a->micro_batch, a->ids);
        route_replay_load(m, first);
        struct model_step_out o;
        model_forward(m, a->ids, NULL, &o);
        comm_all_reduce_sum(a->stage_h, m->stats_h, nstat, COMM_F32);
        for (size_t i = 0; i < nstat; i++) sum[i] += m->stats_h[i];
    }
    const int64_t tokens = a->tokens_micro_global * a->n_micro;
    double aux, *cnt = mt_calloc((size_t)E, sizeof(double));
    aux_from_stats(sum, L, &m->cfg, tokens, &aux, cnt);
    aux_grad_from_counts(cnt, E, m->n_moe_layers, tokens, coef, aux_dp);
    free(cnt);
    free(sum);
    return aux;
}
