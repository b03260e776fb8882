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
/* ops.h's rmsnorm_rope_forward / rmsnorm_rope_backward */
template <typename T>
void cu_rmsnorm_rope_forward(void *out, float *rstd, const void *in, const void *w,
                             const int32_t *pos, int T_, int nh, int D, float eps, float theta);
template <typename T>
void cu_rmsnorm_rope_backward(void *din, float *dw, const void *dout, const void *in, const void *w,
                              const float *rstd, const int32_t *pos, int T_, int nh, int D,
                              float theta);

/* dst[c] += Σ_k partial[k, c] (summed in double in ascending k, rounded once): the last step of
 * the deterministic column sums of the rmsnorm dw (the router stats do the same sum in their own
 * kernel, cuda/router.cu) */
void cuda_add_column_partials(float *dst, const double *partial, int nchunks, int C);

#endif
