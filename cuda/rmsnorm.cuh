/* RMSNorm over the last dim, fp32 inside (ops.h / spec §3.2). */
#ifndef MT_CUDA_RMSNORM_CUH
#define MT_CUDA_RMSNORM_CUH

#include "cuda_common.cuh"

template <typename T>
void cu_rmsnorm_forward(void *out, float *rstd, const void *in, const void *w, int N, int C,
                        float eps);
template <typename T>
void cu_rmsnorm_backward(void *din, float *dw, const void *dout, const void *in, const void *w,
                         const float *rstd, int N, int C, bool accumulate);

/* dst[c] += Σ_k partial[k, c] (summed in double in ascending k, rounded once): the last step of
 * every deterministic column sum (rmsnorm dw, router psum) */
void cuda_add_column_partials(float *dst, const double *partial, int nchunks, int C);

#endif
