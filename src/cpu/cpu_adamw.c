/* AdamW on the CPU, in the order torch.optim.AdamW uses: decoupled decay p ← p·(1 − lr·wd) first,
 * then p ← p − lr·m̂/(√v̂ + eps). Element maths is float; the bias corrections are formed in
 * double (as Python forms beta ** step) and rounded once. */
#include "cpu/cpu_ops.h"
#include "common.h"

#include <math.h>
#include <string.h>

static float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest, ties to even (the moments are finite and non-negative for v) */
static uint16_t f32_to_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

void cpu_adamw_update_m16(float *master, float *param, const float *grad, uint16_t *m, uint16_t *v,
                          size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                          int t, float grad_scale)
{
    MT_CHECK(t >= 1, "adamw: step %d must be >= 1 (bias correction divides by 1 - beta^t)", t);
    const float bc1 = (float)(1.0 - pow((double)beta1, t));
    const float bc2 = (float)(1.0 - pow((double)beta2, t));
    const float decay = 1.0f - lr * weight_decay;
    for (size_t i = 0; i < n; i++) {
        const float g = grad[i] * grad_scale;
        const float mi = beta1 * bf16_to_f32(m[i]) + (1.0f - beta1) * g;
        const float vi = beta2 * bf16_to_f32(v[i]) + (1.0f - beta2) * g * g;
        m[i] = f32_to_bf16(mi);
        v[i] = f32_to_bf16(vi);
        const float mhat = mi / bc1, vhat = vi / bc2;
        float p = master[i] * decay;
        p -= lr * (mhat / (sqrtf(vhat) + eps));
        master[i] = p;
        if (param) param[i] = p;
    }
}

void cpu_adamw_update(float *master, float *param, const float *grad, float *m, float *v, size_t n,
                      float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                      float grad_scale)
{
    MT_CHECK(t >= 1, "adamw: step %d must be >= 1 (bias correction divides by 1 - beta^t)", t);
    const float bc1 = (float)(1.0 - pow((double)beta1, t));
    const float bc2 = (float)(1.0 - pow((double)beta2, t));
    const float decay = 1.0f - lr * weight_decay;
    for (size_t i = 0; i < n; i++) {
        const float g = grad[i] * grad_scale;
        const float mi = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        const float mhat = mi / bc1, vhat = vi / bc2;
        float p = master[i] * decay;
        p -= lr * (mhat / (sqrtf(vhat) + eps));
        master[i] = p;
        if (param) param[i] = p; /* param may be master itself */
    }
}
