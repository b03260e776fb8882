/* Token cross-entropy on fp32-upcast logits, with MT_IGNORE_INDEX (ops.h, spec §3.9). */
#ifndef MT_CUDA_LOSS_CUH
#define MT_CUDA_LOSS_CUH

#include "cuda_common.cuh"

template <typename T>
void cu_cross_entropy_forward(float *losses, float *lse, const void *logits, const int32_t *targets,
                              int N, int V);
template <typename T>
void cu_cross_entropy_backward(void *dlogits, const void *logits, const float *lse,
                               const int32_t *targets, int N, int V, float scale);
/* forward then backward in place (ops.h cross_entropy_fused): one pass over the logits on Hopper */
template <typename T>
void cu_cross_entropy_fused(float *losses, float *lse, void *logits, const int32_t *targets, int N,
                            int V, float scale);

#endif
