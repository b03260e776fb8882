/* NeoX rotate-half RoPE on the CPU, with inv_freq, the angles, cos and sin all in fp32 as
 * transformers forms them (spec §3.5). */
#include "cpu/cpu_ops.h"
#include "common.h"

#include <math.h>
#include <stdlib.h>

void cpu_rope_inv_freq(float *inv_freq, int D, float theta)
{
    for (int i = 0; i < D / 2; i++) inv_freq[i] = 1.0f / powf(theta, (float)(2 * i) / (float)D);
}

/* sign = +1 rotates forward; sign = -1 applies the transpose (the backward). Each pair is read
 * before it is written, so out may equal in. */
static void rope_apply(float *out, const float *in, const int32_t *pos, int T, int nh, int D,
                       float theta, float sign)
{
    MT_CHECK(D > 0 && D % 2 == 0, "rope: head dim %d must be even and positive", D);
    int half = D / 2;
    float *inv_freq = mt_malloc((size_t)half * sizeof(float));
    float *cs = mt_malloc((size_t)D * sizeof(float)); /* [cos | sin] of one position */
    cpu_rope_inv_freq(inv_freq, D, theta);
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < half; i++) {
            float f = (float)pos[t] * inv_freq[i];
            cs[i] = cosf(f);
            cs[half + i] = sign * sinf(f);
        }
        for (int h = 0; h < nh; h++) {
            const float *x = in + ((size_t)t * nh + h) * D;
            float *y = out + ((size_t)t * nh + h) * D;
            for (int i = 0; i < half; i++) {
                float c = cs[i], s = cs[half + i];
                float x1 = x[i], x2 = x[half + i];
                y[i] = x1 * c - x2 * s;
                y[half + i] = x2 * c + x1 * s;
            }
        }
    }
    free(cs);
    free(inv_freq);
}

void cpu_rope_forward(float *out, const float *in, const int32_t *pos, int T, int nh, int D,
                      float theta)
{
    rope_apply(out, in, pos, T, nh, D, theta, 1.0f);
}

/* din = dout ⊙ c + Rᵀ(dout ⊙ s) with Rᵀ([u1 | u2]) = [u2 | −u1]: the rotation by −angle. */
void cpu_rope_backward(float *din, const float *dout, const int32_t *pos, int T, int nh, int D,
                       float theta)
{
    rope_apply(din, dout, pos, T, nh, D, theta, -1.0f);
}
