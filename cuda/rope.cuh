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

#endif
