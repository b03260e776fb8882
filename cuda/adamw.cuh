/* AdamW on fp32 master weights and fp32 or bf16 moments; writes the compute-dtype parameter copy. */
#ifndef MT_CUDA_ADAMW_CUH
#define MT_CUDA_ADAMW_CUH

#include "cuda_common.cuh"

template <typename T>
void cu_adamw_update(float *master, void *param, const float *grad, float *m, float *v, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                     float grad_scale);

template <typename T>
void cu_adamw_update_m16(float *master, void *param, const float *grad, void *m, void *v, size_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                         float grad_scale);

template <typename T>
void cu_adamw_update_multi(const struct adamw_segment *segs, int n_seg, size_t mom_bytes, float lr,
                           float beta1, float beta2, float eps, int t, float grad_scale);

#endif
