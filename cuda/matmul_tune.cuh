/* A cuBLASLt algorithm chosen by timing among those that give the default's bits (on unless
 * MT_GEMM_TUNE=0; used by matmul.cu's plans). The heuristic's first choice is not always the
 * fastest (H200, thirteenth session: the q projection's forward 13% faster with its seventh
 * candidate), but a choice by timing can differ between runs, and with it the result's last bits,
 * which resume promises to keep. Only candidates whose result is bit for bit the first candidate's,
 * on the call's own operands and on every run of the candidate, are timed and may be chosen:
 * whatever the timing picks, the bits are the heuristic's. The trial is queued on the stream at a
 * plan's first call that can run twice and read back at a later call once the GPU has done it: the
 * host never waits for it (a pipeline stage or an EP rank would otherwise stall its peers). */
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
/* waits for the stream and gives every plan whose trial is in flight its choice (for the tests) */
void cuda_gemm_tune_settle(void);
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

/* Which MT_GEMM_TUNE asks for: 0 off, 1 on (the default), 2 on with one line per choice on stderr */
int lt_tune_level(void);

/* A trial of cand[0 .. n) on this call's operands, queued on the stream: each candidate's D hashed
 * after its first run and after its last timed run (MT_GEMM_TUNE_ROUNDS rounds of one run of every
 * candidate, matmul_tune.cu), then cand[0] once more so that D holds the bits the call owes
 * (cand[0]'s). NULL where too many trials are in flight (the call then ran cand[0]). */
struct lt_tune_trial;
struct lt_tune_trial *lt_tune_start(const struct lt_tune_call *call, const cublasLtMatmulAlgo_t *cand, int n);
/* -1 while the GPU has not finished the trial (never waits); else the index of the candidate with
 * the least median time whose D was cand[0]'s bits on both hashes (cand[0] unless another is 2%
 * faster), and the trial is freed. */
int lt_tune_poll(struct lt_tune_trial *trial);
/* frees a trial whose plan goes away (waits for its last copy) */
void lt_tune_drop(struct lt_tune_trial *trial);

#endif /* __cplusplus */
#endif
