/* The training step's arithmetic (step_maths.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "step_maths.h"

double train_lr_at(const struct train_config *t, int step)
{
    if (t->warmup_steps > 0 && step <= t->warmup_steps) return t->lr * step / t->warmup_steps;
    int decay_steps = t->steps - t->warmup_steps;
    if (decay_steps <= 0) return t->lr;
    double progress = (double)(step - t->warmup_steps) / decay_steps;
    if (progress > 1) progress = 1;
    return t->min_lr + 0.5 * (t->lr - t->min_lr) * (1 + cos(M_PI * progress));
}

void aux_from_stats(const float *stats, int n_layers_all, const struct model_config *mc,
                    int64_t tokens, double *aux, double *count_out /*[E] or NULL*/)
{
    const int E = mc->num_experts;
    double *cnt = mt_calloc((size_t)E, sizeof(double)), *ps = mt_calloc((size_t)E, sizeof(double));
    int n_moe = 0;
    for (int l = 0; l < n_layers_all; l++) {
        if (!config_layer_is_moe(mc, l)) continue;
        n_moe++;
        const float *st = stats + (size_t)l * 2 * E;
        for (int e = 0; e < E; e++) {
            ps[e] += st[e];
            cnt[e] += st[E + e];
        }
    }
    double rows = (double)n_moe * (double)tokens, a = 0;
    for (int e = 0; e < E; e++) a += (cnt[e] / rows) * (ps[e] / rows);
    *aux = n_moe > 0 ? E * a : 0;
    if (count_out) memcpy(count_out, cnt, (size_t)E * sizeof(double));
    free(cnt);
    free(ps);
}

void aux_grad_from_counts(const double *count, int E, int n_moe, int64_t tokens, double scale,
                          float *aux_dp)
{
    double rows = (double)n_moe * (double)tokens;
    for (int e = 0; e < E; e++) aux_dp[e] = (float)(scale * E * count[e] / (rows * rows));
}

void balance_bias_update(float *bias, const double *counts, const struct model_config *mc, double rate)
{
    const int E = mc->num_experts;
    for (int l = 0; l < mc->num_hidden_layers; l++) {
        if (!config_layer_is_moe(mc, l)) continue;
        double mean = 0;
        for (int e = 0; e < E; e++) mean += counts[(size_t)l * E + e] / E;
        for (int e = 0; e < E; e++) {
            double d = mean - counts[(size_t)l * E + e];
            bias[(size_t)l * E + e] += (float)(rate * ((d > 0) - (d < 0)));
        }
    }
}
