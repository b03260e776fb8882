/* Token embedding: a row gather forward, a deterministic scatter-add into fp32 dwte backward. */
#ifndef MT_CUDA_EMBEDDING_CUH
#define MT_CUDA_EMBEDDING_CUH

#include "cuda_common.cuh"

template <typename T>
void cu_embedding_forward(void *out, const int32_t *ids, const void *wte, int T_, int H);
template <typename T>
void cu_embedding_backward(float *dwte, const void *dout, const int32_t *ids, int T_, int H);

#endif
