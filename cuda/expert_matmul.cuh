/* Grouped expert matmul: rows [off[e], off[e+1]) go through expert e's weight W[e] ([O,I]); off is
 * device memory (ops.h), R the rows the row matrices hold. */
#ifndef MT_CUDA_EXPERT_MATMUL_CUH
#define MT_CUDA_EXPERT_MATMUL_CUH

#include "cuda_common.cuh"

template <typename T>
void cu_expert_matmul_forward(void *out, const void *in, const void *w, const int64_t *off,
                              int64_t R, int n_exp, int I, int O);
template <typename T>
void cu_expert_matmul_backward(void *din, float *dw, const void *dout, const void *in,
                               const void *w, const int64_t *off, int64_t R, int n_exp, int I,
                               int O, bool dw_overwrite);
template <typename T>
void cu_expert_matmul_wgrad2(float *dw, const void *dout_a, const void *in_a, const int64_t *off_a,
                             int64_t Ra, const void *dout_b, const void *in_b,
                             const int64_t *off_b, int64_t Rb, int n_exp, int I, int O,
                             bool dw_overwrite);

#endif
