/* Casts between fp32 and the compute dtype, and the elementwise ops of ops.h. */
#ifndef MT_CUDA_ELEMENTWISE_CUH
#define MT_CUDA_ELEMENTWISE_CUH

#include "cuda_common.cuh"

template <typename T> void cu_cast_f32_to_x(void *out, const float *in, size_t n);
template <typename T> void cu_cast_x_to_f32(float *out, const void *in, size_t n);
template <typename T> void cu_add_inplace(void *y, const void *x, size_t n);
void cu_scale_f32(float *x, size_t n, float s);
void cu_add_f32(float *y, const float *x, size_t n);
double cu_sumsq_f32(const float *x, size_t n);
/* The same left on the device: *out = Σ x², in double in an order fixed by n (no host wait) */
void cu_sumsq_f32_to(const float *x, size_t n, double *out /*device [1]*/);
/* *out = Σ x in a fixed order (one block) */
void cu_sum_f64_to(const double *x, size_t n, double *out /*device [1]*/);

#endif
