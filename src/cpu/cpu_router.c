/* The MoE router on the CPU: fp32 softmax, top-k selection, optional renormalisation, and the
 * backward through all three (spec §3.6 and §5). */
#include "cpu/cpu_ops.h"
#include "common.h"

#include <math.h>
#include <stdlib.h>

static void check_router(const char *what, int E, int k)
{
    MT_CHECK(E > 0 && k > 0 && k <= E, "%s: need 0 < k <= E, got k=%d E=%d", what, k, E);
}

void cpu_router_forward(int32_t *topk_idx, float *topk_w, float *probs, const float *logits,
                        const float *bias, int T, int E, int k, bool norm_topk)
{
    check_router("router", E, k);
    bool *taken = mt_malloc((size_t)E * sizeof(bool));
    for (int t = 0; t < T; t++) {
        const float *z = logits + (size_t)t * E;
        float *p = probs + (size_t)t * E;
        float mx = -INFINITY;
        for (int e = 0; e < E; e++) mx = z[e] > mx ? z[e] : mx;
        double sum = 0.0;
        for (int e = 0; e < E; e++) {
            p[e] = expf(z[e] - mx);
            sum += p[e];
        }
        const float denom = (float)sum;
        for (int e = 0; e < E; e++) p[e] /= denom;

        /* Selection sort by descending score; the strict '>' keeps the lower id on ties. */
        for (int e = 0; e < E; e++) taken[e] = false;
        int32_t *idx = topk_idx + (size_t)t * k;
        float *w = topk_w + (size_t)t * k;
        for (int j = 0; j < k; j++) {
            int best = -1;
            float best_score = 0.0f;
            for (int e = 0; e < E; e++) {
                if (taken[e]) continue;
                float s = bias ? p[e] + bias[e] : p[e];
                if (best < 0 || s > best_score) {
                    best = e;
                    best_score = s;
                }
            }
            taken[best] = true;
            idx[j] = best;
            w[j] = p[best];
        }
        if (norm_topk) {
            double wsum = 0.0;
            for (int j = 0; j < k; j++) wsum += w[j];
            const float ws = (float)wsum;
            for (int j = 0; j < k; j++) w[j] /= ws;
        }
    }
    free(taken);
}

void cpu_router_backward(float *dlogits, const float *dtopk_w, const float *probs,
                         const int32_t *topk_idx, const float *aux_dp, int T, int E, int k,
                         bool norm_topk)
{
    check_router("router backward", E, k);
    float *dp = mt_malloc((size_t)E * sizeof(float));
    for (int t = 0; t < T; t++) {
        const float *p = probs + (size_t)t * E;
        const int32_t *idx = topk_idx + (size_t)t * k;
        const float *dw = dtopk_w + (size_t)t * k;
        for (int e = 0; e < E; e++) dp[e] = aux_dp ? aux_dp[e] : 0.0f;
        if (norm_topk) {
            /* ŵ_j = p_j / S_k: dp_m = (dŵ_m − Σ_j dŵ_j ŵ_j) / S_k for the selected m */
            double sk = 0.0;
            for (int j = 0; j < k; j++) sk += p[idx[j]];
            const float s = (float)sk;
            double proj = 0.0;
            for (int j = 0; j < k; j++) proj += (double)dw[j] * (p[idx[j]] / s);
            const float pr = (float)proj;
            for (int j = 0; j < k; j++) dp[idx[j]] += (dw[j] - pr) / s;
        } else {
            for (int j = 0; j < k; j++) dp[idx[j]] += dw[j];
        }
        /* softmax backward: dz_i = p_i (dp_i − Σ_j p_j dp_j) */
        double pdp = 0.0;
        for (int e = 0; e < E; e++) pdp += (double)p[e] * dp[e];
        const float c = (float)pdp;
        float *dz = dlogits + (size_t)t * E;
        for (int e = 0; e < E; e++) dz[e] = p[e] * (dp[e] - c);
    }
    free(dp);
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
