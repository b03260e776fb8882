/* NeoX rotate-half RoPE. inv_freq comes from the CPU reference's own function (cpu_rope_inv_freq,
 * fp32 powf on the host), so both backends rotate by bit-identical frequencies; the table is
 * uploaded once per (D, theta). Each position's cos and sin are computed once per launch (rounded
 * to the compute dtype, spec §3.5) into shared memory, then every head of the token is rotated:
 * when D/2 is a multiple of 8 and the pointers are 16-byte aligned, a block takes several tokens
 * and a thread 8 pairs (i, i + D/2) at a time with 16-byte accesses; otherwise a block per token,
 * a pair per thread. */
#include "rope.cuh"

extern "C" {
#include "cpu/cpu_ops.h"
}

enum { ROPE_MAX_D = 1024, ROPE_CACHE = 4, ROPE_BLOCK = 128, ROPE_VEC_BLOCK = 256,
       ROPE_VEC_UNROLL = 4, ROPE_VEC_SMEM = 32768 };

struct rope_entry {
    int D;
    float theta;
};
static struct rope_entry rope_cache[ROPE_CACHE];
static float *rope_table; /* [ROPE_CACHE][ROPE_MAX_D / 2] on the device */
static int rope_victim;

const float *cu_rope_inv_freq(int D, float theta)
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
    pdl_wait(); /* first: launch.cuh */
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

/* rope_kernel for tpb tokens per block, chunks of 8 pairs; cs holds [cos | sin] per token. A
 * thread takes items (token, head, chunk) ROPE_VEC_UNROLL at a time, ROPE_VEC_BLOCK apart; the
 * first round's loads are issued before the angles are computed, so they overlap. */
template <typename T>
__global__ void __launch_bounds__(ROPE_VEC_BLOCK)
rope_vec_kernel(T *out, const T *in, const int32_t *pos, const float *inv_freq, int T_, int nh,
                int D, float sign, int tpb)
{
    pdl_wait(); /* first: launch.cuh */
    extern __shared__ float cs[]; /* [tpb][D] */
    const int half = D / 2, hc = half / 8, t0 = blockIdx.x * tpb, ntok = min(tpb, T_ - t0);
    const int per_tok = nh * hc, nitems = ntok * per_tok;
    pack8<T> x1[ROPE_VEC_UNROLL], x2[ROPE_VEC_UNROLL];
    size_t at[ROPE_VEC_UNROLL];
    int cso[ROPE_VEC_UNROLL]; /* the item's cos chunk in cs */
    for (int base = 0; base < nitems; base += ROPE_VEC_UNROLL * ROPE_VEC_BLOCK) {
#pragma unroll
        for (int u = 0; u < ROPE_VEC_UNROLL; u++) {
            const int it = base + u * ROPE_VEC_BLOCK + threadIdx.x;
            if (it >= nitems) continue;
            const int tt = it / per_tok, rem = it - tt * per_tok, h = rem / hc;
            const int c = (rem - h * hc) * 8;
            at[u] = ((size_t)(t0 + tt) * nh + h) * D + c;
            cso[u] = tt * D + c;
            x1[u] = ld8(in + at[u]);
            x2[u] = ld8(in + at[u] + half);
        }
        if (base == 0) {
            rope_fill_angles<T>(cs, pos, inv_freq, t0, ntok, D, sign, ROPE_VEC_BLOCK);
            __syncthreads();
        }
#pragma unroll
        for (int u = 0; u < ROPE_VEC_UNROLL; u++) {
            if (base + u * ROPE_VEC_BLOCK + (int)threadIdx.x >= nitems) continue;
            const float4 *cp = reinterpret_cast<const float4 *>(cs + cso[u]);
            const float4 *sp = reinterpret_cast<const float4 *>(cs + cso[u] + half);
            const float4 c0 = cp[0], c1 = cp[1], s0 = sp[0], s1 = sp[1];
            const float co[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
            const float si[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
            float a[8], b[8], y1[8], y2[8];
            unpack8(x1[u], a);
            unpack8(x2[u], b);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                y1[e] = rope_rotate(a[e], b[e], co[e], si[e], true);
                y2[e] = rope_rotate(b[e], a[e], co[e], si[e], false);
            }
            store8f(out + at[u], y1);
            store8f(out + at[u] + half, y2);
        }
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
    const float *inv_freq = cu_rope_inv_freq(D, theta);
    if (D % 16 == 0 && aligned16(out) && aligned16(in)) {
        const int per_tok = nh * (D / 16);
        int tpb = MT_MAX(1, ROPE_VEC_UNROLL * ROPE_VEC_BLOCK / per_tok);
        tpb = MT_MIN(tpb, MT_MIN(T_, ROPE_VEC_SMEM / (int)(D * sizeof(float))));
        tpb = MT_MAX(tpb, 1);
        cuda_launch(rope_vec_kernel<T>, (T_ + tpb - 1) / tpb, ROPE_VEC_BLOCK, (size_t)tpb * D * sizeof(float),
            (T *)out, (const T *)in, pos, inv_freq, T_, nh, D, sign, tpb);
        CUDA_LAUNCH_CHECK("rope");
        return;
    }
    cuda_launch(rope_kernel<T>, T_, ROPE_BLOCK, (size_t)D * sizeof(float),
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
