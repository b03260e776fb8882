/* RMSNorm on the CPU: out = w * (x * rstd), rstd = 1/sqrt(mean(x²) + eps). The normalised value is
 * formed first and then weighted, in that order, as transformers does. */
#include "cpu/cpu_ops.h"
#include "common.h"

#include <math.h>

void cpu_rmsnorm_forward(float *out, float *rstd, const float *in, const float *w, int N, int C,
                         float eps)
{
    MT_CHECK(C > 0, "rmsnorm: row width C=%d must be positive", C);
    for (int n = 0; n < N; n++) {
        const float *x = in + (size_t)n * C;
        float *y = out + (size_t)n * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)x[c] * x[c];
        float var = (float)(ss / C);
        float r = 1.0f / sqrtf(var + eps);
        rstd[n] = r;
        for (int c = 0; c < C; c++) y[c] = w[c] * (x[c] * r);
    }
}

/* With n = x·r and g = dout ⊙ w: din = r·(g − n·mean(g ⊙ n)), dw += Σ_rows dout ⊙ n. Each row is
 * fully read before its din is written, so din may alias dout or in. */
void cpu_rmsnorm_backward(float *din, float *dw, const float *dout, const float *in, const float *w,
                          const float *rstd, int N, int C, bool accumulate)
{
    MT_CHECK(C > 0, "rmsnorm backward: row width C=%d must be positive", C);
    for (int n = 0; n < N; n++) {
        const float *x = in + (size_t)n * C;
        const float *dy = dout + (size_t)n * C;
        float r = rstd[n];
        double gn = 0.0;
        for (int c = 0; c < C; c++) {
            float nc = x[c] * r;
            gn += (double)(dy[c] * w[c]) * nc;
            if (dw) dw[c] += dy[c] * nc;
        }
        if (!din) continue;
        float proj = (float)(gn / C);
        float *dx = din + (size_t)n * C;
        for (int c = 0; c < C; c++) {
            float nc = x[c] * r;
            float v = r * (dy[c] * w[c] - nc * proj);
            dx[c] = accumulate ? dx[c] + v : v;
        }
    }
}
