/* The MoE router on the CPU: fp32 softmax or sigmoid scores, (group-limited) top-k selection,
 * optional renormalisation and route scale, and the backward through them (spec §3.6 and §5,
 * docs/router.md). */
#include "cpu/cpu_ops.h"
#include "common.h"

#include <math.h>
#include <stdlib.h>

static void check_router(const char *what, int E, int k)
{
    MT_CHECK(E > 0 && k > 0 && k <= E, "%s: need 0 < k <= E, got k=%d E=%d", what, k, E);
}

/* The experts outside the best o->topk_group groups are marked taken, so the top-k never sees
 * them. A group scores the sum of its two best choice scores (its only one for groups of one);
 * ties go to the lower group id. */
static void mask_groups(bool *taken, const float *score, int E, const struct router_opts *o)
{
    const int G = o->n_group, per = E / G;
    float gs[G];
    bool keep[G];
    for (int g = 0; g < G; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int e = g * per; e < (g + 1) * per; e++) {
            if (score[e] > b1) b2 = b1, b1 = score[e];
            else if (score[e] > b2) b2 = score[e];
        }
        gs[g] = per > 1 ? b1 + b2 : b1;
        keep[g] = false;
    }
    for (int j = 0; j < o->topk_group; j++) {
        int best = -1;
        for (int g = 0; g < G; g++)
            if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
        keep[best] = true;
    }
    for (int e = 0; e < E; e++) taken[e] = !keep[e / per];
}

void cpu_router_forward(int32_t *topk_idx, float *topk_w, float *probs, const float *logits,
                        const float *bias, int T, int E, int k, const struct router_opts *o)
{
    check_router("router", E, k);
    bool *taken = mt_malloc((size_t)E * sizeof(bool));
    float *score = mt_malloc((size_t)E * sizeof(float));
    for (int t = 0; t < T; t++) {
        const float *z = logits + (size_t)t * E;
        float *p = probs + (size_t)t * E;
        if (o->sigmoid) {
            for (int e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-z[e]));
        } else {
            float mx = -INFINITY;
            for (int e = 0; e < E; e++) mx = z[e] > mx ? z[e] : mx;
            double sum = 0.0;
            for (int e = 0; e < E; e++) {
                p[e] = expf(z[e] - mx);
                sum += p[e];
            }
            const float denom = (float)sum;
            for (int e = 0; e < E; e++) p[e] /= denom;
        }
        for (int e = 0; e < E; e++) score[e] = bias ? p[e] + bias[e] : p[e];

        int32_t *idx = topk_idx + (size_t)t * k;
        float *w = topk_w + (size_t)t * k;
        if (o->force_balance) {
            for (int j = 0; j < k; j++) idx[j] = (int32_t)(((int64_t)t * k + j) % E);
        } else {
            if (o->n_group > 1) mask_groups(taken, score, E, o);
            else
                for (int e = 0; e < E; e++) taken[e] = false;
            /* Selection sort by descending score; the strict '>' keeps the lower id on ties. */
            for (int j = 0; j < k; j++) {
                int best = -1;
                for (int e = 0; e < E; e++) {
                    if (taken[e]) continue;
                    if (best < 0 || score[e] > score[best]) best = e;
                }
                taken[best] = true;
                idx[j] = best;
            }
        }
        for (int j = 0; j < k; j++) w[j] = p[idx[j]];
        if (o->norm_topk) {
            double wsum = 0.0;
            for (int j = 0; j < k; j++) wsum += w[j];
            const float ws = (float)wsum;
            for (int j = 0; j < k; j++) w[j] /= ws;
        }
        if (o->route_scale != 1.0f)
            for (int j = 0; j < k; j++) w[j] *= o->route_scale;
    }
    free(score);
    free(taken);
}

void cpu_router_gather_weights(float *topk_w, const float *probs, const int32_t *topk_idx, int T,
                               int E, int k, const struct router_opts *o)
{
    check_router("router_gather_weights", E, k);
    for (int t = 0; t < T; t++) {
        const float *p = probs + (size_t)t * E;
        const int32_t *idx = topk_idx + (size_t)t * k;
        float *w = topk_w + (size_t)t * k;
        for (int j = 0; j < k; j++) {
            MT_CHECK(idx[j] >= 0 && idx[j] < E, "router_gather_weights: expert %d out of [0, %d)", (int)idx[j], E);
            w[j] = p[idx[j]];
        }
        if (o->norm_topk) {
            double wsum = 0.0;
            for (int j = 0; j < k; j++) wsum += w[j];
            const float ws = (float)wsum;
            for (int j = 0; j < k; j++) w[j] /= ws;
        }
        if (o->route_scale != 1.0f)
            for (int j = 0; j < k; j++) w[j] *= o->route_scale;
    }
}

void cpu_router_backward(float *dlogits, const float *dtopk_w, const float *probs,
                         const int32_t *topk_idx, const float *aux_dp, int T, int E, int k,
                         const struct router_opts *o)
{
    check_router("router backward", E, k);
    float *dp = mt_malloc((size_t)E * sizeof(float));
    const float rs = o->route_scale;
    for (int t = 0; t < T; t++) {
        const float *p = probs + (size_t)t * E;
        const int32_t *idx = topk_idx + (size_t)t * k;
        const float *dw = dtopk_w + (size_t)t * k;
        for (int e = 0; e < E; e++) dp[e] = aux_dp ? aux_dp[e] : 0.0f;
        if (o->norm_topk) {
            /* w_j = rs p_j / S_k: dp_m = rs (dw_m − Σ_j dw_j ŵ_j) / S_k for the selected m,
             * ŵ_j = p_j / S_k */
            double sk = 0.0;
            for (int j = 0; j < k; j++) sk += p[idx[j]];
            const float s = (float)sk;
            double proj = 0.0;
            for (int j = 0; j < k; j++) proj += (double)dw[j] * (p[idx[j]] / s);
            const float pr = (float)proj;
            for (int j = 0; j < k; j++) dp[idx[j]] += rs * (dw[j] - pr) / s;
        } else {
            for (int j = 0; j < k; j++) dp[idx[j]] += rs * dw[j];
        }
        float *dz = dlogits + (size_t)t * E;
        if (o->sigmoid) {
            for (int e = 0; e < E; e++) dz[e] = dp[e] * p[e] * (1.0f - p[e]);
            continue;
        }
        /* softmax backward: dz_i = p_i (dp_i − Σ_j p_j dp_j) */
        double pdp = 0.0;
        for (int e = 0; e < E; e++) pdp += (double)p[e] * dp[e];
        const float c = (float)pdp;
        for (int e = 0; e < E; e++) dz[e] = p[e] * (dp[e] - c);
    }
    free(dp);
}

void cpu_aux_grad_from_stats(float *aux_dp, const float *stats, int L, int E, double scale, double rows)
{
    for (int e = 0; e < E; e++) {
        double cnt = 0;
        for (int l = 0; l < L; l++) cnt += stats[(size_t)l * 2 * E + E + e];
        aux_dp[e] = (float)(scale * E * cnt / (rows * rows));
    }
}

void cpu_router_stats(float *psum, float *count, const float *probs, const int32_t *topk_idx,
                      int T, int E, int k)
{
    for (int t = 0; t < T; t++) {
        const float *p = probs + (size_t)t * E;
        for (int e = 0; e < E; e++) psum[e] += p[e];
        for (int j = 0; j < k; j++) {
            int32_t e = topk_idx[(size_t)t * k + j];
            MT_CHECK(e >= 0 && e < E, "router_stats: expert index %d out of [0, %d)", (int)e, E);
            count[e] += 1.0f;
        }
    }
}
