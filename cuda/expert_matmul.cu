/* Grouped expert matmul as a loop of cublasGemmEx calls, one per expert that has rows (the same
 * column-major mapping as matmul.cu). cublasGemmEx rather than cuBLASLt because the row count of
 * each expert changes every step, which would defeat a plan cache keyed by shape. Experts with
 * no rows are skipped: their dw is not touched. In bf16 the grouped Hopper kernel of
 * grouped_gemm.cu does the work instead wherever it supports the shapes; fp32 stays on cuBLAS. */
#include "expert_matmul.cuh"
#include "grouped_gemm.cuh"
#include "matmul.cuh"

#include <type_traits>

static void check_offsets(const char *what, const int64_t *off, int n_exp)
{
    MT_CHECK(n_exp >= 0 && (n_exp == 0 || off[0] >= 0), "%s: bad expert count or first offset",
             what);
    for (int e = 0; e < n_exp; e++) {
        MT_CHECK(off[e + 1] >= off[e], "%s: offsets decrease at expert %d (%lld > %lld)", what, e,
                 (long long)off[e], (long long)off[e + 1]);
        MT_CHECK(off[e + 1] - off[e] <= INT32_MAX, "%s: expert %d has too many rows", what, e);
    }
}

template <typename T>
void cu_expert_matmul_forward(void *out, const void *in, const void *w, const int64_t *off,
                              int n_exp, int I, int O)
{
    check_offsets("expert_matmul", off, n_exp);
    /* bf16: the grouped Hopper kernel, unless the shapes are outside what it handles */
    if (std::is_same<T, bf16>::value && grouped_gemm_forward(out, in, w, off, n_exp, I, O)) return;
    const cudaDataType_t dt = xtype<T>::cuda;
    for (int e = 0; e < n_exp; e++) {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) continue;
        cuda_gemm_ex(CUBLAS_OP_T, CUBLAS_OP_N, O, (int)n, I, (const T *)w + (size_t)e * O * I, I,
                     (const T *)in + r0 * I, I, dt, (T *)out + r0 * O, O, dt, 0.0f);
    }
}

template <typename T>
void cu_expert_matmul_backward(void *din, float *dw, const void *dout, const void *in,
                               const void *w, const int64_t *off, int n_exp, int I, int O)
{
    check_offsets("expert_matmul backward", off, n_exp);
    if (std::is_same<T, bf16>::value) { /* what the grouped kernel did, the loop below skips */
        if (din && grouped_gemm_dgrad(din, dout, w, off, n_exp, I, O)) din = NULL;
        if (dw && grouped_gemm_wgrad(dw, dout, in, off, n_exp, I, O)) dw = NULL;
    }
    const cudaDataType_t dt = xtype<T>::cuda;
    for (int e = 0; e < n_exp; e++) {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) continue;
        const T *we = (const T *)w + (size_t)e * O * I;
        const T *dy = (const T *)dout + r0 * O;
        if (din)
            cuda_gemm_ex(CUBLAS_OP_N, CUBLAS_OP_N, I, (int)n, O, we, I, dy, O, dt,
                         (T *)din + r0 * I, I, dt, 0.0f);
        if (dw)
            cuda_gemm_ex(CUBLAS_OP_N, CUBLAS_OP_T, I, O, (int)n, (const T *)in + r0 * I, I, dy, O, dt,
                         dw + (size_t)e * O * I, I, CUDA_R_32F, 1.0f);
    }
}

template void cu_expert_matmul_forward<float>(void *, const void *, const void *, const int64_t *,
                                              int, int, int);
template void cu_expert_matmul_forward<bf16>(void *, const void *, const void *, const int64_t *,
                                             int, int, int);
template void cu_expert_matmul_backward<float>(void *, float *, const void *, const void *,
                                               const void *, const int64_t *, int, int, int);
template void cu_expert_matmul_backward<bf16>(void *, float *, const void *, const void *,
                                              const void *, const int64_t *, int, int, int);
