/* Token cross-entropy on the CPU via a double log-sum-exp per row. */
#include "cpu/cpu_ops.h"
#include "common.h"
#include "ops.h"

#include <math.h>

/* log Σ exp(z) of one row, accumulated in double around the row max */
static double row_lse(const float *z, int V)
{
    float mx = -INFINITY;
    for (int i = 0; i < V; i++) mx = z[i] > mx ? z[i] : mx;
    double s = 0.0;
    for (int i = 0; i < V; i++) s += exp((double)z[i] - mx);
    return mx + log(s);
}

static void check_target(const char *what, int32_t tgt, int n, int V)
{
    MT_CHECK(tgt == MT_IGNORE_INDEX || (tgt >= 0 && tgt < V),
             "%s: target %d at row %d is outside the vocabulary [0, %d) and not %d", what, (int)tgt,
             n, V, MT_IGNORE_INDEX);
}

void cpu_cross_entropy_forward(float *losses, float *lse, const float *logits,
                               const int32_t *targets, int N, int V)
{
    MT_CHECK(V > 0, "cross_entropy: vocabulary size %d must be positive", V);
    for (int n = 0; n < N; n++) {
        const int32_t tgt = targets[n];
        check_target("cross_entropy", tgt, n, V);
        if (tgt == MT_IGNORE_INDEX) {
            losses[n] = lse[n] = 0.0f;
            continue;
        }
        const float *z = logits + (size_t)n * V;
        const double l = row_lse(z, V);
        lse[n] = (float)l;
        losses[n] = (float)(l - z[tgt]);
    }
}

/* dlogits = scale·(exp(z − lse) − onehot) with the forward's lse (fp32, as the GPU keeps it);
 * each element is read before it is written, so dlogits may alias logits. */
void cpu_cross_entropy_backward(float *dlogits, const float *logits, const float *lse,
                                const int32_t *targets, int N, int V, float scale)
{
    MT_CHECK(V > 0, "cross_entropy backward: vocabulary size %d must be positive", V);
    for (int n = 0; n < N; n++) {
        const int32_t tgt = targets[n];
        check_target("cross_entropy backward", tgt, n, V);
        const float *z = logits + (size_t)n * V;
        float *dz = dlogits + (size_t)n * V;
        if (tgt == MT_IGNORE_INDEX) {
            for (int i = 0; i < V; i++) dz[i] = 0.0f;
            continue;
        }
        const double l = lse[n];
        for (int i = 0; i < V; i++) {
            const float p = (float)exp((double)z[i] - l);
            dz[i] = scale * (i == tgt ? p - 1.0f : p);
        }
    }
}
