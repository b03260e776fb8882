/* Causal GQA attention on the CPU, one query row at a time: a row of scores lives in an S-sized
 * scratch, and the backward recomputes it from q, k and the saved log-sum-exp. With a segment array
 * (document masking) a key is visible only inside the query's own document; masked keys get
 * probability 0, and the diagonal keeps every row non-empty. */
#include "cpu/cpu_ops.h"
#include "cpu/cpu_dot.h"
#include "common.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* The scale as transformers applies it: head_dim ** -0.5 in double, used as an fp32 scalar. */
static float attn_scale(int D) { return (float)(1.0 / sqrt((double)D)); }

static void check_shape(const char *what, int S, int Hq, int Hkv, int D)
{
    MT_CHECK(S > 0 && Hq > 0 && Hkv > 0 && D > 0 && Hq % Hkv == 0,
             "%s: bad shape S=%d Hq=%d Hkv=%d D=%d (Hq must be a multiple of Hkv)", what, S, Hq,
             Hkv, D);
}

/* Whether key j is visible to query i of sequence row sg (NULL = plain causal, checked by callers). */
static inline bool seg_visible(const int32_t *sg, int i, int j) { return !sg || sg[j] == sg[i]; }

void cpu_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                           int B, int S, int Hq, int Hkv, int D, const int32_t *seg)
{
    check_shape("attention", S, Hq, Hkv, D);
    const int group = Hq / Hkv;
    const float scale = attn_scale(D);
    float *p = mt_malloc((size_t)S * sizeof(float));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++) {
            const int hk = h / group;
            const int32_t *sg = seg ? seg + (size_t)b * S : NULL;
            for (int i = 0; i < S; i++) {
                const float *qi = q + (((size_t)b * S + i) * Hq + h) * D;
                float mx = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    const float *kj = k + (((size_t)b * S + j) * Hkv + hk) * D;
                    p[j] = seg_visible(sg, i, j) ? cpu_dot(qi, kj, D) * scale : -INFINITY;
                    if (p[j] > mx) mx = p[j];
                }
                double sum = 0.0;
                for (int j = 0; j <= i; j++) {
                    p[j] = expf(p[j] - mx);   /* exp(-inf) = 0 for masked keys */
                    sum += p[j];
                }
                lse[((size_t)b * Hq + h) * S + i] = mx + (float)log(sum);
                const float denom = (float)sum;
                float *o = out + (((size_t)b * S + i) * Hq + h) * D;
                memset(o, 0, (size_t)D * sizeof(float));
                for (int j = 0; j <= i; j++) {
                    const float pj = p[j] / denom;
                    const float *vj = v + (((size_t)b * S + j) * Hkv + hk) * D;
                    for (int d = 0; d < D; d++) o[d] += pj * vj[d];
                }
            }
        }
    free(p);
}

/* With P recomputed as exp(s − lse): dP = dO·Vᵀ, dS = P ⊙ (dP − Σ P ⊙ dP), dQ = scale·dS·K,
 * dK = scale·dSᵀ·Q, dV = Pᵀ·dO. dK and dV of a kv head sum over the query heads sharing it. */
void cpu_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                            const float *k, const float *v, const float *out, const float *lse,
                            int B, int S, int Hq, int Hkv, int D, const int32_t *seg)
{
    check_shape("attention backward", S, Hq, Hkv, D);
    const int group = Hq / Hkv;
    const float scale = attn_scale(D);
    const size_t kv_elems = (size_t)B * S * Hkv * D;
    memset(dk, 0, kv_elems * sizeof(float));
    memset(dv, 0, kv_elems * sizeof(float));
    float *p = mt_malloc((size_t)S * sizeof(float));
    float *dp = mt_malloc((size_t)S * sizeof(float));
    float *acc = mt_malloc((size_t)D * sizeof(float));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++) {
            const int hk = h / group;
            const int32_t *sg = seg ? seg + (size_t)b * S : NULL;
            for (int i = 0; i < S; i++) {
                const size_t qrow = (((size_t)b * S + i) * Hq + h) * D;
                const float *qi = q + qrow, *doi = dout + qrow;
                const float l = lse[((size_t)b * Hq + h) * S + i];
                double rowdot = 0.0;
                for (int j = 0; j <= i; j++) {
                    const size_t kvrow = (((size_t)b * S + j) * Hkv + hk) * D;
                    p[j] = seg_visible(sg, i, j) ? expf(cpu_dot(qi, k + kvrow, D) * scale - l) : 0.0f;
                    dp[j] = cpu_dot(doi, v + kvrow, D);
                    rowdot += (double)p[j] * dp[j];
                }
                const float di = (float)rowdot;
                memset(acc, 0, (size_t)D * sizeof(float));
                for (int j = 0; j <= i; j++) {
                    const size_t kvrow = (((size_t)b * S + j) * Hkv + hk) * D;
                    const float ds = p[j] * (dp[j] - di);
                    const float dss = ds * scale;
                    const float *kj = k + kvrow;
                    float *dkj = dk + kvrow, *dvj = dv + kvrow;
                    for (int d = 0; d < D; d++) {
                        acc[d] += ds * kj[d];
                        dkj[d] += dss * qi[d];
                        dvj[d] += p[j] * doi[d];
                    }
                }
                float *dqi = dq + qrow;
                for (int d = 0; d < D; d++) dqi[d] = acc[d] * scale;
            }
        }
    free(acc);
    free(dp);
    free(p);
}
