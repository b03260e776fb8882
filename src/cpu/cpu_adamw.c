/* AdamW on the CPU, in the order torch.optim.AdamW uses: decoupled decay p ← p·(1 − lr·wd) first,
 * then p ← p − lr·m̂/(√v̂ + eps). Element maths is float; the bias corrections are formed in
 * double (as Python forms beta ** step) and rounded once. */
#include "cpu/cpu_ops.h"
#include "common.h"

#include <math.h>

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
