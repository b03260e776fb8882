/* Row movement: gather (MoE dispatch, embedding lookup), the deterministic scatter-add that is
 * their backward, and the weighted MoE combine. */
#ifndef MT_CUDA_MOE_ROWS_CUH
#define MT_CUDA_MOE_ROWS_CUH

#include "cuda_common.cuh"

/* out[r] = in[idx[r]] for r < R (rows of H elements of type T) */
template <typename T> void cuda_gather_rows(T *out, const T *in, const int32_t *idx, int R, int H);
/* dst[idx[r]] += src[r] for r < R, in ascending r per destination row, summed in fp32 and rounded
 * once into Out; deterministic (a stable sort by destination, then one pass per destination). */
template <typename Out, typename In>
void cuda_scatter_add_rows(Out *dst, const In *src, const int32_t *idx, int R, int H);

template <typename T> void cu_gather_rows(void *out, const void *in, const int32_t *idx, int R, int H);
template <typename T>
void cu_gather_rows_part(void *out, const void *in, const int32_t *idx, int R, int H, int lo, int hi, bool inside);
template <typename T>
void cu_dispatch_rows(void *out, const void *in, const int32_t *slot, int n, int k, int H);
template <typename T>
void cu_gather_rows_backward(void *din, const void *dout, const int32_t *idx, int R, int H);
template <typename T>
void cu_moe_combine_forward(void *out, const void *y, const int32_t *slot_row, const float *w,
                            const void *resid, int T_, int k, int H);
template <typename T>
void cu_moe_combine_backward(void *dy, float *dw, const void *dout, const void *y,
                             const int32_t *slot_row, const float *w, int T_, int k, int H);

#endif
