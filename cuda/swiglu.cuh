/* SwiGLU on fused [gate | up] rows: out = silu(g) * u. */
#ifndef MT_CUDA_SWIGLU_CUH
#define MT_CUDA_SWIGLU_CUH

#include "cuda_common.cuh"

template <typename T> void cu_swiglu_forward(void *out, const void *gu, int R, int I, const int64_t *rows);
template <typename T> void cu_swiglu_backward(void *dgu, const void *dout, const void *gu, int R, int I,
                                               const int64_t *rows);

#endif
