/* Token embedding through the row gather / scatter-add of moe_rows.cu: repeated token ids add
 * their rows in token order, in fp32, as the CPU does (no atomics, so the result is
 * deterministic). */
#include "embedding.cuh"
#include "moe_rows.cuh"

template <typename T>
void cu_embedding_forward(void *out, const int32_t *ids, const void *wte, int T_, int H)
{
    cuda_gather_rows<T>((T *)out, (const T *)wte, ids, T_, H);
}

template <typename T>
void cu_embedding_backward(float *dwte, const void *dout, const int32_t *ids, int T_, int H)
{
    cuda_scatter_add_rows<float, T>(dwte, (const T *)dout, ids, T_, H);
}

template void cu_embedding_forward<float>(void *, const int32_t *, const void *, int, int);
template void cu_embedding_forward<bf16>(void *, const int32_t *, const void *, int, int);
template void cu_embedding_backward<float>(float *, const void *, const int32_t *, int, int);
template void cu_embedding_backward<bf16>(float *, const void *, const int32_t *, int, int);
