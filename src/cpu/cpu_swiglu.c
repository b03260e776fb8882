/* SwiGLU on fused [gate | up] rows on the CPU: out = silu(g) * u with silu(g) = g / (1 + e^-g). */
#include "cpu/cpu_ops.h"

#include <math.h>

void cpu_swiglu_forward(float *out, const float *gu, int R, int I)
{
    for (int r = 0; r < R; r++) {
        const float *g = gu + (size_t)r * 2 * I, *u = g + I;
        float *o = out + (size_t)r * I;
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* du = dout·silu(g); dg = dout·u·σ(g)·(1 + g·(1 − σ(g))). Both inputs of a pair are read before
 * either gradient is written, so dgu may alias gu. */
void cpu_swiglu_backward(float *dgu, const float *dout, const float *gu, int R, int I)
{
    for (int r = 0; r < R; r++) {
        const float *g = gu + (size_t)r * 2 * I, *u = g + I;
        float *dg = dgu + (size_t)r * 2 * I, *du = dg + I;
        const float *d = dout + (size_t)r * I;
        for (int i = 0; i < I; i++) {
            const float gi = g[i], ui = u[i];
            const float den = 1.0f + expf(-gi);
            const float sig = 1.0f / den;
            dg[i] = d[i] * ui * sig * (1.0f + gi * (1.0f - sig));
            du[i] = d[i] * (gi / den); /* silu(g) formed as in the forward */
        }
    }
}
