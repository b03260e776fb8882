/* Grouped expert matmul: rows [off[e], off[e+1]) go through expert e's weight W[e] ([O,I]); off is
 * device memory (ops.h), R the rows the row matrices hold. */
#ifndef MT_CUDA_EXPERT_MATMUL_CUH
#define MT_CUDA_EXPERT_MATMUL_CUH

#include "cuda_common.cuh"

template <typename T>
void cu_expert_matmul_forward(void *out, const void *in, const void *w, const int64_t *off,
                              const int64_t *end, int64_t R, int n_exp, int I, int O);
template <typename T>
void cu_expert_matmul_backward(void *din, float *dw, const void *dout, const void *in,
                               const void *w, const int64_t *off, int64_t R, int n_exp, int I,
                               int O, bool dw_overwrite);
template <typename T>
void cu_expert_matmul_wgrad_sets(float *dw, const struct expert_rows *sets, int n_sets, int n_exp,
                                 int I, int O, bool dw_overwrite, double *dw_sumsq);
template <typename T>
void cu_expert_matmul_wgrad_part(float *dw, const struct expert_rows *sets, int n_sets, int n_exp, int I,
                                 int O, bool dw_overwrite, int32_t *cursor, const struct exchange_arrival *until);

#endif
