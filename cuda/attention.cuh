/* Causal GQA flash attention, forward and backward (ops.h); any head_dim up to 128
 * (kernels for 16, 32, 64 and 128; narrower heads are zero-padded to the next). */
#ifndef MT_CUDA_ATTENTION_CUH
#define MT_CUDA_ATTENTION_CUH

#include "cuda_common.cuh"

template <typename T>
void cu_attention_forward(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                          int S, int Hq, int Hkv, int D, const int32_t *seg /* [B,S] or nullptr */);
template <typename T>
void cu_attention_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                           const void *k, const void *v, const void *out, const float *lse, int B,
                           int S, int Hq, int Hkv, int D, const int32_t *seg /* [B,S] or nullptr */);

#endif
