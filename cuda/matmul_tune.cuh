/* A cuBLASLt algorithm chosen by timing among those that give the default's bits (MT_GEMM_TUNE=1;
 * used by matmul.cu's plans). The heuristic's first choice is not always the fastest (H200,
 * thirteenth session: the q projection's forward 13% faster with its seventh candidate, ~3.7 ms a
 * bench step in all), but a choice by timing can differ between runs, and with it the result's last
 * bits, which resume promises to keep. Only candidates whose result is bit for bit the first
 * candidate's, on the call's own operands and on every run of the candidate, are timed and may be
 * chosen: whatever the timing picks, the bits are the heuristic's. */
#ifndef MT_CUDA_MATMUL_TUNE_CUH
#define MT_CUDA_MATMUL_TUNE_CUH

/* What the choices of this process came to (plain C, for the tests): plans tuned, the candidates
 * they had, how many of those gave the first one's bits (the first included), and the plans whose
 * choice is not the first candidate. */
struct gemm_tune_counts {
    int plans, candidates, identical, switched;
};
#ifdef __cplusplus
extern "C" {
#endif
void cuda_gemm_tune_counts(struct gemm_tune_counts *out);
/* MT_GEMM_TUNE's level from here on, whatever the environment said (for the tests): plans made
 * under another level are other plans */
void cuda_gemm_tune_set(int level);
#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
#include "cuda_common.cuh"

enum { LT_TUNE_MAX = 8 }; /* heuristic candidates asked for */

/* One cuBLASLt matmul D = A·B + beta·C as matmul.cu issues it (one layout lc for C and D). Running
 * it again must give the same D: beta == 0, or C and D distinct. */
struct lt_tune_call {
    cublasLtMatmulDesc_t desc;
    const void *A, *B, *C;
    void *D;
    cublasLtMatrixLayout_t la, lb, lc;
    float beta;
    int m, n, ldc;  /* D's column-major extent and leading dimension */
    size_t d_elem;  /* bytes per element of D: 2 or 4 */
};

/* Which MT_GEMM_TUNE asks for: 0 off (the default), 1 on, 2 on with one line per choice on stderr */
int lt_tune_level(void);

/* The index of the fastest of cand[0 .. n) whose D is bit for bit cand[0]'s (the heuristic's first
 * choice, always eligible), timed on the call's operands; a candidate must be 2% faster than cand[0]
 * to be taken. Leaves D as that candidate computes it (the bits of cand[0]). Synchronises the
 * stream: for the first call of a plan only. */
int lt_tune_pick(const struct lt_tune_call *call, const cublasLtMatmulAlgo_t *cand, int n);

#endif /* __cplusplus */
#endif
