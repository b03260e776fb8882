/* Dense matmuls through cuBLASLt (y = x Wᵀ and its backward), and the GEMM helpers that the
 * expert matmul shares. All GEMMs take compute-dtype A/B, accumulate in fp32 (CUBLAS_COMPUTE_32F,
 * never TF32) and write C in the compute dtype or fp32.
 *
 * Row-major to column-major: a row-major X[r, c] is the column-major matrix Xᵀ (c × r, ld c), so
 * every row-major product is issued as its transpose (see matmul.cu). */
#ifndef MT_CUDA_MATMUL_CUH
#define MT_CUDA_MATMUL_CUH

#include "cuda_common.cuh"

/* Column-major C[m,n] = op(A)[m,k] · op(B)[k,n] + beta·C, A and B of type ab, C of type c.
 * cuda_gemm_lt plans through cuBLASLt (plans cached by shape, type and pointer alignment) and
 * falls back to cuda_gemm_ex when cuBLASLt offers no algorithm; cuda_gemm_ex is cublasGemmEx.
 * k == 0 leaves beta·C (C zeroed when beta is 0); m == 0 or n == 0 does nothing. */
void cuda_gemm_lt(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A,
                  int lda, const void *B, int ldb, cudaDataType_t ab, void *C, int ldc,
                  cudaDataType_t c, float beta);
void cuda_gemm_ex(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A,
                  int lda, const void *B, int ldb, cudaDataType_t ab, void *C, int ldc,
                  cudaDataType_t c, float beta);
/* cuda_gemm_lt on (A[0], B[0], C[0]) then on (A[1], B[1], C[1]), bit for bit, as ONE strided-
 * batched cuBLASLt call running the algorithm cuda_gemm_lt's plan chose for the single GEMM, where
 * that plan's algorithm supports the batch and the pointer pairs allow it (equal alignments, batch
 * strides of one sign within 2^31 elements); otherwise the two calls. An operand may be shared
 * (X[0] == X[1]); the two C must differ. */
void cuda_gemm_lt_pair(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                       const void *const A[2], int lda, const void *const B[2], int ldb,
                       cudaDataType_t ab, void *const C[2], int ldc, cudaDataType_t c, float beta);

template <typename T>
void cu_matmul_forward(void *out, const void *in, const void *w, int N, int I, int O);
template <typename T>
void cu_matmul_forward_residual(void *out, const void *in, const void *w, const void *resid, int N,
                                int I, int O);
template <typename T>
void cu_matmul_backward(void *din, float *dw, const void *dout, const void *in, const void *w,
                        int N, int I, int O, bool accumulate);
/* two projections of one input (ops.h: matmul2_forward / matmul2_backward) */
template <typename T>
void cu_matmul2_forward(void *out_a, void *out_b, const void *in, const void *w_a, const void *w_b,
                        int N, int I, int O);
template <typename T>
void cu_matmul2_backward(void *din, float *dw_a, float *dw_b, const void *dout_a,
                         const void *dout_b, const void *in, const void *w_a, const void *w_b, int N,
                         int I, int O, bool accumulate);

/* fp32 logits from compute-dtype operands, and the backward in fp32 GEMMs (ops.h) */
template <typename T>
void cu_router_matmul_forward(float *logits, const void *in, const void *w, int N, int I, int O);
template <typename T>
void cu_router_matmul_backward(void *din, float *dw, const float *dlogits, const void *in,
                               const void *w, int N, int I, int O, bool accumulate);

#endif
