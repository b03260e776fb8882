/* NeoX rotate-half RoPE. inv_freq comes from the CPU reference's own function (cpu_rope_inv_freq,
 * fp32 powf on the host), so both backends rotate by bit-identical frequencies; the table is
 * uploaded once per (D, theta). One block per token computes that position's cos and sin once
 * (rounded to the compute dtype, spec §3.5) and rotates every head. */
#include "rope.cuh"

extern "C" {
#include "cpu/cpu_ops.h"
}

enum { ROPE_MAX_D = 1024, ROPE_CACHE = 4, ROPE_BLOCK = 128 };

struct rope_entry {
    int D;
    float theta;
};
static struct rope_entry rope_cache[ROPE_CACHE];
static float *rope_table; /* [ROPE_CACHE][ROPE_MAX_D / 2] on the device */
static int rope_victim;

static const float *rope_inv_freq(int D, float theta)
{
    if (!rope_table) {
        CUDA_CHECK(cudaMalloc(&rope_table, ROPE_CACHE * (ROPE_MAX_D / 2) * sizeof(float)));
    }
    for (int i = 0; i < ROPE_CACHE; i++)
        if (rope_cache[i].D == D && rope_cache[i].theta == theta)
            return rope_table + (size_t)i * (ROPE_MAX_D / 2);
    const int slot = rope_victim;
    rope_victim = (rope_victim + 1) % ROPE_CACHE;
    float host[ROPE_MAX_D / 2];
    cpu_rope_inv_freq(host, D, theta);
    float *dst = rope_table + (size_t)slot * (ROPE_MAX_D / 2);
    /* ordered after every earlier kernel on the stream that may still read this slot */
    CUDA_CHECK(cudaMemcpyAsync(dst, host, (size_t)(D / 2) * sizeof(float), cudaMemcpyHostToDevice,
                               g_cuda.stream));
    rope_cache[slot].D = D;
    rope_cache[slot].theta = theta;
    return dst;
}

/* sign = +1 rotates by the angle, −1 by its negative (the transpose: the backward). Each pair is
 * read and written by one thread, so out may equal in. */
template <typename T>
__global__ void rope_kernel(T *out, const T *in, const int32_t *pos, const float *inv_freq, int nh,
                            int D, float sign)
{
    extern __shared__ float cs[]; /* [cos | sin] of this token's position, D floats */
    const int t = blockIdx.x, half = D / 2;
    const float p = (float)pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float f = p * inv_freq[i];
        cs[i] = round_x<T>(cosf(f));
        cs[half + i] = sign * round_x<T>(sinf(f));
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nh * half; idx += blockDim.x) {
        const int h = idx / half, i = idx - h * half;
        const size_t base = ((size_t)t * nh + h) * D;
        const float x1 = to_f(in[base + i]), x2 = to_f(in[base + half + i]);
        const float c = cs[i], s = cs[half + i];
        out[base + i] = from_f<T>(x1 * c - x2 * s);
        out[base + half + i] = from_f<T>(x2 * c + x1 * s);
    }
}

template <typename T>
static void rope_apply(void *out, const void *in, const int32_t *pos, int T_, int nh, int D,
                       float theta, float sign)
{
    MT_CHECK(D > 0 && D % 2 == 0 && D <= ROPE_MAX_D, "rope: head dim %d must be even, in (0, %d]", D,
             ROPE_MAX_D);
    MT_CHECK(T_ >= 0 && nh > 0, "rope: bad shape T=%d nh=%d", T_, nh);
    if (T_ == 0) return;
    const float *inv_freq = rope_inv_freq(D, theta);
    rope_kernel<T><<<T_, ROPE_BLOCK, (size_t)D * sizeof(float), g_cuda.stream>>>(
        (T *)out, (const T *)in, pos, inv_freq, nh, D, sign);
    CUDA_LAUNCH_CHECK("rope");
}

template <typename T>
void cu_rope_forward(void *out, const void *in, const int32_t *pos, int T_, int nh, int D,
                     float theta)
{
    rope_apply<T>(out, in, pos, T_, nh, D, theta, 1.0f);
}

template <typename T>
void cu_rope_backward(void *din, const void *dout, const int32_t *pos, int T_, int nh, int D,
                      float theta)
{
    rope_apply<T>(din, dout, pos, T_, nh, D, theta, -1.0f);
}

template void cu_rope_forward<float>(void *, const void *, const int32_t *, int, int, int, float);
template void cu_rope_forward<bf16>(void *, const void *, const int32_t *, int, int, int, float);
template void cu_rope_backward<float>(void *, const void *, const int32_t *, int, int, int, float);
template void cu_rope_backward<bf16>(void *, const void *, const int32_t *, int, int, int, float);
