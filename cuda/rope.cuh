/* NeoX rotate-half RoPE (spec §3.5). */
#ifndef MT_CUDA_ROPE_CUH
#define MT_CUDA_ROPE_CUH

#include "cuda_common.cuh"

template <typename T>
void cu_rope_forward(void *out, const void *in, const int32_t *pos, int T_, int nh, int D,
                     float theta);
template <typename T>
void cu_rope_backward(void *din, const void *dout, const int32_t *pos, int T_, int nh, int D,
                      float theta);

/* The device table of inv_freq[D/2] for (D, theta): the CPU reference's own fp32 values, uploaded
 * once (a few (D, theta) pairs are kept) */
const float *cu_rope_inv_freq(int D, float theta);

/* The angles of the ntok tokens t0.. into cs, D floats a token: [cos | sign·sin] of
 * pos[t]·inv_freq[f], each rounded to the compute dtype (spec §3.5), filled by the block's nthreads
 * threads. rope.cu's vector kernel and rmsnorm.cu's fused ones take their angles from here and
 * rotate with rope_rotate, so they agree to the bit. */
template <typename T>
__device__ __forceinline__ void rope_fill_angles(float *cs, const int32_t *pos,
                                                 const float *inv_freq, int t0, int ntok, int D,
                                                 float sign, int nthreads)
{
    const int half = D / 2;
    for (int i = threadIdx.x; i < ntok * half; i += nthreads) {
        const int tt = i / half, f = i - tt * half;
        const float a = (float)pos[t0 + tt] * inv_freq[f];
        cs[tt * D + f] = round_x<T>(cosf(a));
        cs[tt * D + half + f] = sign * round_x<T>(sinf(a));
    }
}

/* One rotated element: x1·c − x2·s in the first half (own = x1, other = x2), x2·c + x1·s in the
 * second (own = x2, other = x1). The product with s is rounded and the one with c fused into the
 * add, spelled out so that no kernel depends on how the compiler contracts a·b − c·d. */
__device__ __forceinline__ float rope_rotate(float own, float other, float c, float s, bool first)
{
    const float p = __fmul_rn(other, s);
    return __fmaf_rn(own, c, first ? -p : p);
}

/* ---------------------------------------------------------------- RoPE inside other kernels
 * Rows are the heads [T, nh] of D elements (row r of token r / nh), a row held by G = D/8 lanes of
 * a warp, chunk `lane` (8 elements) each, so that a chunk's partner D/2 away sits G/2 lanes away:
 * rmsnorm.cu's fused q_norm/k_norm + RoPE kernels. */
struct rope_rows {
    const int32_t *pos;    /* [T] */
    const float *inv_freq; /* [D/2], cu_rope_inv_freq */
    int nh;
    float sign; /* +1: rope_forward's rotation, -1: rope_backward's */
};

/* The angles (rope_fill_angles) of the tokens of rows [r0, r1), r0 < r1, into cs; returns the first
 * token. Every thread of the block calls it: the leading barrier keeps it from overwriting angles
 * still being read. */
template <typename T>
__device__ __forceinline__ int rope_rows_angles(float *cs, const rope_rows &rr, int r0, int r1,
                                                int D, int nthreads)
{
    const int t0 = r0 / rr.nh, ntok = (r1 - 1) / rr.nh - t0 + 1;
    __syncthreads();
    rope_fill_angles<T>(cs, rr.pos, rr.inv_freq, t0, ntok, D, rr.sign, nthreads);
    __syncthreads();
    return t0;
}

/* y = this lane's chunk of its row rotated, from pk, the chunk in the compute dtype (as the rope
 * op would load it), and cs, the angles of the row's token. The G lanes of the row call it
 * together; other rows' lanes of the warp need not. */
template <typename T, int G>
__device__ __forceinline__ void rope_rows_chunk(float (&y)[8], const pack8<T> &pk, const float *cs,
                                                int lane)
{
    const unsigned row_lanes = (unsigned)(((1ull << G) - 1) << ((threadIdx.x & 31) & ~(G - 1)));
    const pack8<T> partner = shfl_xor8(row_lanes, pk, G / 2);
    float own[8], other[8];
    unpack8(pk, own);
    unpack8(partner, other);
    const bool first = lane < G / 2;
    const int f = (lane & (G / 2 - 1)) * 8; /* the chunk's frequencies f .. f + 7 */
    const float4 *cp = reinterpret_cast<const float4 *>(cs + f);
    const float4 *sp = reinterpret_cast<const float4 *>(cs + G * 4 + f); /* G·4 = D/2 */
    const float4 c0 = cp[0], c1 = cp[1], s0 = sp[0], s1 = sp[1];
    const float co[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    const float si[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
    for (int e = 0; e < 8; e++) y[e] = rope_rotate(own[e], other[e], co[e], si[e], first);
}

#endif
