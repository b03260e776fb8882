/* AdamW on the CPU, in the order torch.optim.AdamW uses: decoupled decay p ← p·(1 − lr·wd) first,
 * then p ← p − lr·m̂/(√v̂ + eps). Element maths is float; the bias corrections are formed in
 * double (as Python forms beta ** step) and rounded once. */
#include "cpu/cpu_ops.h"
#include "common.h"
#include "master_split.h"
#include "ops.h"

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

/* The step's constants: bias corrections formed in double and rounded once, the decay factor. */
struct adam_step {
    float lr, beta1, beta2, eps, decay, bc1, bc2, grad_scale;
};

static struct adam_step adam_step_of(float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                                     float grad_scale)
{
    MT_CHECK(t >= 1, "adamw: step %d must be >= 1 (bias correction divides by 1 - beta^t)", t);
    return (struct adam_step){lr, beta1, beta2, eps, 1.0f - lr * weight_decay,
                              (float)(1.0 - pow((double)beta1, t)), (float)(1.0 - pow((double)beta2, t)),
                              grad_scale};
}

/* One element: the moments *m, *v (read, then updated in fp32), the master and its compute copy. */
static inline void adam_elem(const struct adam_step *k, float grad, float *m, float *v, float *master, float *param)
{
    const float g = grad * k->grad_scale;
    *m = k->beta1 * *m + (1.0f - k->beta1) * g;
    *v = k->beta2 * *v + (1.0f - k->beta2) * g * g;
    const float mhat = *m / k->bc1, vhat = *v / k->bc2;
    float p = *master * k->decay;
    p -= k->lr * (mhat / (sqrtf(vhat) + k->eps));
    *master = p;
    if (param) *param = p; /* param may be master itself */
}

void cpu_adamw_update_m16(float *master, float *param, const float *grad, uint16_t *m, uint16_t *v,
                          size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                          int t, float grad_scale)
{
    const struct adam_step k = adam_step_of(lr, beta1, beta2, eps, weight_decay, t, grad_scale);
    for (size_t i = 0; i < n; i++) {
        float mi = bf16_to_f32(m[i]), vi = bf16_to_f32(v[i]);
        adam_elem(&k, grad[i], &mi, &vi, &master[i], param ? &param[i] : NULL);
        m[i] = f32_to_bf16(mi);
        v[i] = f32_to_bf16(vi);
    }
}

void cpu_adamw_update(float *master, float *param, const float *grad, float *m, float *v, size_t n,
                      float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                      float grad_scale)
{
    const struct adam_step k = adam_step_of(lr, beta1, beta2, eps, weight_decay, t, grad_scale);
    for (size_t i = 0; i < n; i++) adam_elem(&k, grad[i], &m[i], &v[i], &master[i], param ? &param[i] : NULL);
}

/* A segment whose master is held split (ops.h adamw_segment.master_lo; param its bf16 high half):
 * the same element maths on the joined master, split again after */
static void split_segment(const struct adamw_segment *s, size_t mom_bytes, struct adam_step k)
{
    uint16_t *hi = s->param, *lo = s->master_lo;
    MT_CHECK(hi && !s->master, "adamw_multi: a split master needs its high half as param, and no fp32 master");
    for (size_t i = 0; i < s->n; i++) {
        float master = mt_master_join(hi[i], lo[i]), mi, vi;
        if (mom_bytes == 2) mi = bf16_to_f32(((uint16_t *)s->m)[i]), vi = bf16_to_f32(((uint16_t *)s->v)[i]);
        else mi = ((float *)s->m)[i], vi = ((float *)s->v)[i];
        adam_elem(&k, s->grad[i], &mi, &vi, &master, NULL);
        if (mom_bytes == 2) ((uint16_t *)s->m)[i] = f32_to_bf16(mi), ((uint16_t *)s->v)[i] = f32_to_bf16(vi);
        else ((float *)s->m)[i] = mi, ((float *)s->v)[i] = vi;
        mt_master_split(master, &hi[i], &lo[i]);
    }
}

void cpu_adamw_update_multi(const struct adamw_segment *segs, int n_seg, size_t mom_bytes, float lr,
                            float beta1, float beta2, float eps, int t, float grad_scale)
{
    MT_CHECK(n_seg >= 0 && (n_seg == 0 || segs), "adamw_multi: bad segment list (%d)", n_seg);
    MT_CHECK(mom_bytes == 4 || mom_bytes == 2, "adamw_multi: moments of %zu bytes", mom_bytes);
    for (int i = 0; i < n_seg; i++) {
        const struct adamw_segment *s = &segs[i];
        if (s->master_lo) {
            split_segment(s, mom_bytes, adam_step_of(lr, beta1, beta2, eps, s->weight_decay, t, grad_scale));
            continue;
        }
        if (mom_bytes == 2)
            cpu_adamw_update_m16(s->master, s->param, s->grad, s->m, s->v, s->n, lr, beta1, beta2,
                                 eps, s->weight_decay, t, grad_scale);
        else
            cpu_adamw_update(s->master, s->param, s->grad, s->m, s->v, s->n, lr, beta1, beta2, eps,
                             s->weight_decay, t, grad_scale);
    }
}
