/* SwiGLU on fused [gate | up] rows: out = silu(g) * u. */
#ifndef MT_CUDA_SWIGLU_CUH
#define MT_CUDA_SWIGLU_CUH

#include "cuda_common.cuh"

/* One (g, u) pair with the formulas of src/cpu/cpu_swiglu.c, shared by the kernels of swiglu.cu and
 * the fused epilogues of grouped_gemm.cu so that both compute the same bits: silu(g)·u with the
 * SiLU rounded to T first; the gradients of that for d = dL/d(out). */
template <typename T> __device__ __forceinline__ float swiglu_pair(float g, float u)
{
    return round_x<T>(g / (1.0f + expf(-g))) * u;
}
template <typename T>
__device__ __forceinline__ void swiglu_pair_grad(float g, float u, float d, float &dg, float &du)
{
    const float den = 1.0f + expf(-g);
    const float sig = 1.0f / den;
    dg = d * u * sig * (1.0f + g * (1.0f - sig));
    du = d * round_x<T>(g / den);
}

template <typename T> void cu_swiglu_forward(void *out, const void *gu, int R, int I);
template <typename T> void cu_swiglu_backward(void *dgu, const void *dout, const void *gu, int R, int I);

#endif
