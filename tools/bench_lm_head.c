/* Micro-benchmark of the LM head's three GEMMs with each candidate cuBLASLt's heuristic offers (up
 * to 8, as cuda/matmul.cu asks for them under MT_GEMM_TUNE), at the bench shape (8,192 tokens a
 * micro-step, hidden 2048) and a Qwen3-235B-A22B one (4,096 tokens, hidden 4096), vocabulary
 * 151,936, bf16 operands, fp32 accumulation, in matmul.cu's column-major mapping:
 *
 *   forward  logits[N,V] = x Wᵀ           bf16 out, beta 0 (MT_GEMM_TUNE tries these)
 *   dgrad    dx[N,H] = dlogits W           bf16 out, beta 0 (and these)
 *   wgrad    dW[V,H] += dlogitsᵀ x         fp32, beta 1, in place: a trial cannot run it twice, so
 *                                          the tuning leaves it at the heuristic's first choice
 *   wgrad x2 the same over two micro-steps' rows at once (K = 2N): what a stash of one micro-step's
 *            dlogits (N·V bf16: 2.5 GB at the bench shape) would buy
 *
 *   bench_lm_head [reps]      (default 10 timed runs after 2 warm-ups; median reported)
 *
 * "bits": whether the candidate's output is cand[0]'s, byte for byte, from the same inputs and the
 * same starting dW (the only candidates MT_GEMM_TUNE may take). Without CUDA (or a GPU) it says so
 * and exits 0. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "common.h"

#ifdef MT_HAVE_CUDA
#include <cublasLt.h>

enum { V = 151936, CANDS = 8, WARM = 2, LT_WORKSPACE = 32 << 20 /* the backend's */ };

static cublasLtHandle_t lt;
static void *ws;
static cudaStream_t stream;

/* column-major D[m,n] = op(A) op(B) + beta C, C and D the same buffer */
struct gemm {
    const char *name;
    cublasOperation_t ta, tb;
    int m, n, k, lda, ldb, ldc;
    cudaDataType_t d_type;
    float beta;
    const void *A, *B;
    void *D;
    const void *D0; /* D's starting value (beta 1), NULL for beta 0 */
};

static void fill_random_bf16(void *p, size_t n, uint64_t seed)
{
    uint16_t *h = mt_malloc(n * sizeof *h);
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const float f = (float)((s >> 40) & 0xffffff) / (float)(1 << 24) * 2.0f - 1.0f;
        uint32_t b;
        memcpy(&b, &f, 4);
        h[i] = (uint16_t)(b >> 16);
    }
    CUDA_CALL(cudaMemcpy(p, h, n * sizeof *h, cudaMemcpyHostToDevice));
    free(h);
}

static void *dev(size_t bytes)
{
    void *p;
    CUDA_CALL(cudaMalloc(&p, bytes));
    return p;
}

static void bench_one(const struct gemm *g, int reps)
{
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &g->ta, sizeof g->ta));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &g->tb, sizeof g->tb));
    const bool an = g->ta == CUBLAS_OP_N, bn = g->tb == CUBLAS_OP_N;
    LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, an ? g->m : g->k, an ? g->k : g->m, g->lda));
    LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, bn ? g->k : g->n, bn ? g->n : g->k, g->ldb));
    LT(cublasLtMatrixLayoutCreate(&lc, g->d_type, g->m, g->n, g->ldc));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t wsb = LT_WORKSPACE;
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t res[CANDS];
    memset(res, 0, sizeof res);
    int nres = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, CANDS, res, &nres));
    LT(cublasLtMatmulPreferenceDestroy(pref));

    const size_t d_bytes = (size_t)g->m * g->n * (g->d_type == CUDA_R_32F ? 4 : 2);
    unsigned char *ref = mt_malloc(d_bytes), *got = mt_malloc(d_bytes);
    const double flop = 2.0 * g->m * g->n * (double)g->k;
    cudaEvent_t t0, t1;
    CUDA_CALL(cudaEventCreate(&t0));
    CUDA_CALL(cudaEventCreate(&t1));
    float *t = mt_malloc((size_t)reps * sizeof *t);
    float first_ms = 0;
    printf("\n%s: m %d n %d k %d, %d candidates\n", g->name, g->m, g->n, g->k, nres);
    printf("  cand     ms    TFLOPS  vs cand0  bits\n");
    for (int c = 0; c < nres; c++) {
        const float alpha = 1.0f;
        cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
        /* the bits: one run from the starting D */
        if (g->D0) CUDA_CALL(cudaMemcpyAsync(g->D, g->D0, d_bytes, cudaMemcpyDeviceToDevice, stream));
        st = cublasLtMatmul(lt, desc, &alpha, g->A, la, g->B, lb, &g->beta, g->D, lc, g->D, lc, &res[c].algo, ws,
                            LT_WORKSPACE, stream);
        if (st != CUBLAS_STATUS_SUCCESS) {
            printf("  %4d  refused (status %d)\n", c, (int)st);
            continue;
        }
        CUDA_CALL(cudaStreamSynchronize(stream));
        CUDA_CALL(cudaMemcpy(c == 0 ? ref : got, g->D, d_bytes, cudaMemcpyDeviceToHost));
        const bool same = c == 0 || memcmp(ref, got, d_bytes) == 0;
        /* the time: back-to-back in-place runs (beta 1 keeps adding onto D, as the training does) */
        for (int r = 0; r < WARM + reps; r++) {
            CUDA_CALL(cudaEventRecord(t0, stream));
            LT(cublasLtMatmul(lt, desc, &alpha, g->A, la, g->B, lb, &g->beta, g->D, lc, g->D, lc, &res[c].algo, ws,
                              LT_WORKSPACE, stream));
            CUDA_CALL(cudaEventRecord(t1, stream));
            CUDA_CALL(cudaEventSynchronize(t1));
            if (r >= WARM) CUDA_CALL(cudaEventElapsedTime(&t[r - WARM], t0, t1));
        }
        bench_sort_floats(t, reps);
        const float ms = t[reps / 2];
        if (c == 0) first_ms = ms;
        printf("  %4d %7.3f %8.0f %8.3f  %s\n", c, ms, flop / ms / 1e9, ms / first_ms, same ? "same" : "DIFFER");
    }
    free(t);
    free(ref);
    free(got);
    CUDA_CALL(cudaEventDestroy(t0));
    CUDA_CALL(cudaEventDestroy(t1));
    LT(cublasLtMatrixLayoutDestroy(la));
    LT(cublasLtMatrixLayoutDestroy(lb));
    LT(cublasLtMatrixLayoutDestroy(lc));
    LT(cublasLtMatmulDescDestroy(desc));
}

/* one shape's GEMMs: N tokens a micro-step, hidden H */
static void bench_shape(int N, int H, int reps)
{
    printf("\n== LM head, %d tokens a micro-step, hidden %d, vocabulary %d\n", N, H, V);
    void *x = dev((size_t)2 * N * H * 2), *w = dev((size_t)V * H * 2), *dlogits = dev((size_t)2 * N * V * 2);
    void *logits = dev((size_t)N * V * 2), *dx = dev((size_t)N * H * 2);
    float *dw = dev((size_t)V * H * 4), *dw0 = dev((size_t)V * H * 4);
    fill_random_bf16(x, (size_t)2 * N * H, 1);
    fill_random_bf16(w, (size_t)V * H, 2);
    fill_random_bf16(dlogits, (size_t)2 * N * V, 3);
    /* dW starts as a small random fp32 value: random bf16 bits read in pairs */
    fill_random_bf16(dw0, (size_t)V * H * 2, 4);
    const struct gemm gs[] = {
        {"forward  logits = x W^T", CUBLAS_OP_T, CUBLAS_OP_N, V, N, H, H, H, V, CUDA_R_16BF, 0.0f, w, x, logits, NULL},
        {"dgrad    dx = dlogits W", CUBLAS_OP_N, CUBLAS_OP_N, H, N, V, H, V, H, CUDA_R_16BF, 0.0f, w, dlogits, dx,
         NULL},
        {"wgrad    dW += dlogits^T x (in place)", CUBLAS_OP_N, CUBLAS_OP_T, H, V, N, H, V, H, CUDA_R_32F, 1.0f, x,
         dlogits, dw, dw0},
        {"wgrad x2 dW += over two micro-steps' rows (K = 2N)", CUBLAS_OP_N, CUBLAS_OP_T, H, V, 2 * N, H, V, H,
         CUDA_R_32F, 1.0f, x, dlogits, dw, dw0},
    };
    for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++) bench_one(&gs[i], reps);
    void *bufs[] = {x, w, dlogits, logits, dx, dw, dw0};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CUDA_CALL(cudaFree(bufs[i]));
}
#endif

int main(int argc, char **argv)
{
    int reps = 10;
    if (argc > 1) {
        char *end;
        const long r = strtol(argv[1], &end, 10);
        if (*end || r < 1 || r > 1000) {
            fprintf(stderr, "bench_lm_head: repeats must be an integer in 1..1000, got '%s'\n", argv[1]);
            return 2;
        }
        reps = (int)r;
    }
#ifdef MT_HAVE_CUDA
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("bench_lm_head: no CUDA device; nothing to measure\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CUDA_CALL(cudaGetDeviceProperties(&prop, 0));
    printf("bench_lm_head: %s, %d SMs; median of %d runs after %d warm-ups\n", prop.name,
           prop.multiProcessorCount, reps, WARM);
    LT(cublasLtCreate(&lt));
    CUDA_CALL(cudaStreamCreate(&stream));
    ws = dev(LT_WORKSPACE);
    bench_shape(8192, 2048, reps);
    bench_shape(4096, 4096, reps);
    CUDA_CALL(cudaFree(ws));
    LT(cublasLtDestroy(lt));
    return 0;
#else
    (void)reps;
    printf("bench_lm_head: built without CUDA; nothing to measure\n");
    return 0;
#endif
}
