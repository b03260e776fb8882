/* Dense matmuls through cuBLASLt.
 *
 * With row-major x[N,I], W[O,I], y[N,O] seen as column-major xᵀ (I×N), Wᵀ (I×O), yᵀ (O×N):
 *   forward  yᵀ[O,N]  = (Wᵀ)ᵀ · xᵀ        A = W  (I×O, ld I) transposed, B = x  (I×N, ld I)
 *   din      dinᵀ[I,N] = Wᵀ · dyᵀ          A = W  (I×O, ld I),            B = dy (O×N, ld O)
 *   dw       dwᵀ[I,O] += xᵀ · (dyᵀ)ᵀ       A = x  (I×N, ld I),            B = dy (O×N, ld O) transposed
 * dw is fp32 and accumulated by beta = 1 inside the GEMM (bf16 A/B with fp32 C/D). */
#include "matmul.cuh"
#include "matmul_tune.cuh"

#include "env_flag.h"

#include <string.h>

/* ---------------------------------------------------------------- cuBLASLt plans */

enum { LT_PLANS = 64 };

struct lt_plan {
    bool used;
    int m, n, k, lda, ldb, ldc;
    cublasOperation_t ta, tb;
    cudaDataType_t ab, c;
    uint32_t align_a, align_b, align_c;
    bool have_algo;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    /* MT_GEMM_TUNE (matmul_tune.cuh; part of the key): the heuristic's candidates, cand[0] its
     * first choice; tune_pending until a call that can run twice has queued a trial of them and a
     * later call has found it finished and taken its choice as algo */
    bool tune, tune_pending;
    struct lt_tune_trial *trial;
    int n_cand;
    cublasLtMatmulAlgo_t cand[LT_TUNE_MAX];
    /* cuda_gemm_lt_pair: this GEMM twice in one call, with algo. la2/lb2/lc2 (batch count 2,
     * strides set per call) exist unless pair is PAIR_UNCHECKED. */
    enum { PAIR_UNCHECKED, PAIR_OK, PAIR_UNSUPPORTED } pair;
    cublasLtMatrixLayout_t la2, lb2, lc2;
};

static struct lt_plan plans[LT_PLANS];
static int plan_victim;

/* The largest power of two (up to 256) dividing the address: cuBLASLt kernels may assume the
 * alignment their heuristic was told, and weights are views at arbitrary offsets of flat buffers. */
static uint32_t align_of(const void *p)
{
    uint32_t a = 256;
    while (a > 1 && ((uintptr_t)p % a)) a >>= 1;
    return a;
}

static void plan_destroy(struct lt_plan *p)
{
    if (!p->used) return;
    if (p->trial) lt_tune_drop(p->trial), p->trial = NULL;
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->la));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lb));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lc));
    if (p->pair != lt_plan::PAIR_UNCHECKED) {
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->la2));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lb2));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lc2));
    }
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(p->desc));
    p->used = false;
}

/* The plan's A, B and C layouts, as batch_count GEMMs (strides left 0 for the caller to set) */
static void layouts_create(const struct lt_plan *p, int32_t batch_count, cublasLtMatrixLayout_t *la,
                           cublasLtMatrixLayout_t *lb, cublasLtMatrixLayout_t *lc)
{
    const bool an = p->ta == CUBLAS_OP_N, bn = p->tb == CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(la, p->ab, an ? p->m : p->k, an ? p->k : p->m, p->lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(lb, p->ab, bn ? p->k : p->n, bn ? p->n : p->k, p->ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(lc, p->c, p->m, p->n, p->ldc));
    if (batch_count == 1) return;
    for (cublasLtMatrixLayout_t l : {*la, *lb, *lc})
        CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                      &batch_count, sizeof batch_count));
}

static struct lt_plan *plan_get(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                int lda, int ldb, int ldc, cudaDataType_t ab, cudaDataType_t c,
                                uint32_t aa, uint32_t alb, uint32_t ac)
{
    const bool tune = lt_tune_level() > 0;
    for (int i = 0; i < LT_PLANS; i++) {
        struct lt_plan *p = &plans[i];
        if (p->used && p->tune == tune && p->m == m && p->n == n && p->k == k && p->lda == lda && p->ldb == ldb &&
            p->ldc == ldc && p->ta == ta && p->tb == tb && p->ab == ab && p->c == c &&
            p->align_a == aa && p->align_b == alb && p->align_c == ac)
            return p;
    }
    struct lt_plan *p = &plans[plan_victim];
    plan_victim = (plan_victim + 1) % LT_PLANS;
    plan_destroy(p);
    p->m = m, p->n = n, p->k = k, p->lda = lda, p->ldb = ldb, p->ldc = ldc;
    p->ta = ta, p->tb = tb, p->ab = ab, p->c = c;
    p->align_a = aa, p->align_b = alb, p->align_c = ac;
    p->tune = tune;

    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    layouts_create(p, 1, &p->la, &p->lb, &p->lc);
    p->pair = lt_plan::PAIR_UNCHECKED;
    p->used = true;

    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = g_cuda.workspace_bytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &ws, sizeof ws));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                      &aa, sizeof aa));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                      &alb, sizeof alb));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                      &ac, sizeof ac));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                      &ac, sizeof ac));
    cublasLtMatmulHeuristicResult_t res[LT_TUNE_MAX];
    memset(res, 0, sizeof res);
    int nres = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g_cuda.lt, p->desc, p->la, p->lb, p->lc,
                                                       p->lc, pref, tune ? LT_TUNE_MAX : 1, res, &nres);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    /* No algorithm for this combination (whatever the status says) is not fatal: the plan then
     * routes to cublasGemmEx, whose own errors are checked. */
    p->have_algo = st == CUBLAS_STATUS_SUCCESS && nres > 0;
    if (p->have_algo) p->algo = res[0].algo;
    p->n_cand = p->have_algo ? nres : 0;
    for (int i = 0; i < p->n_cand; i++) p->cand[i] = res[i].algo;
    p->tune_pending = tune && p->n_cand > 1;
    p->trial = NULL;
    return p;
}

/* The plan's trial, if the GPU has finished it: its choice becomes the plan's algorithm */
static void tune_take(struct lt_plan *p)
{
    const int pick = lt_tune_poll(p->trial);
    if (pick < 0) return;
    p->trial = NULL, p->tune_pending = false;
    p->algo = p->cand[pick];
    if (p->pair != lt_plan::PAIR_UNCHECKED) { /* checked for the algorithm it had */
        for (cublasLtMatrixLayout_t l : {p->la2, p->lb2, p->lc2}) CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(l));
        p->pair = lt_plan::PAIR_UNCHECKED;
    }
}

extern "C" void cuda_gemm_tune_settle(void)
{
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    for (int i = 0; i < LT_PLANS; i++)
        if (plans[i].used && plans[i].trial) tune_take(&plans[i]);
}

/* ---------------------------------------------------------------- GEMM entry points */

/* k == 0: C = beta·C, which for beta 0 means zeros (cuBLAS would leave C untouched). */
static bool gemm_trivial(int m, int n, int k, void *C, int ldc, cudaDataType_t c, float beta)
{
    MT_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm: negative size m=%d n=%d k=%d", m, n, k);
    if (m == 0 || n == 0) return true;
    if (k > 0) return false;
    if (beta == 0.0f) {
        const size_t es = c == CUDA_R_32F ? 4 : 2;
        CUDA_CHECK(cudaMemset2DAsync(C, (size_t)ldc * es, 0, (size_t)m * es, (size_t)n, g_cuda.stream));
    } else {
        MT_CHECK(beta == 1.0f, "gemm: k == 0 with beta %g is not supported", beta);
    }
    return true;
}

void cuda_gemm_ex(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A,
                  int lda, const void *B, int ldb, cudaDataType_t ab, void *C, int ldc,
                  cudaDataType_t c, float beta)
{
    if (gemm_trivial(m, n, k, C, ldc, c, beta)) return;
    const float alpha = 1.0f;
    CUBLAS_CHECK(cublasGemmEx(g_cuda.blas, ta, tb, m, n, k, &alpha, A, ab, lda, B, ab, ldb, &beta, C,
                              c, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* D[m,n] = C[m,n] (same layout), for the paths that only work in place */
static void copy_c_to_d(void *D, const void *C, int m, int n, int ldc, cudaDataType_t c)
{
    const size_t es = c == CUDA_R_32F ? 4 : 2;
    CUDA_CHECK(cudaMemcpy2DAsync(D, (size_t)ldc * es, C, (size_t)ldc * es, (size_t)m * es, (size_t)n,
                                 cudaMemcpyDeviceToDevice, g_cuda.stream));
}

/* The trial of an in-place call (D = C, beta != 0: the fp32 dw +=, whose heuristic's first choice
 * is 15% slower than its fastest same-bits candidate on the Qwen3-235B-A22B LM head, H200,
 * docs/benchmarks.md): its candidates write D = A·B + beta·C into a stream-ordered scratch of D's
 * size instead, so C is read unchanged by every run, and the scratch goes back to the pool once
 * the trial is done. NULL (the plan stays at the first choice, for good) where the scratch does not
 * fit: a job near its memory's end is not pushed over it for a faster GEMM. */
static struct lt_tune_trial *tune_in_place(struct lt_plan *p, const void *A, const void *B, const void *C, int m,
                                           int n, int ldc, size_t es, float beta)
{
    static int on = -1; /* MT_GEMM_TUNE_IN_PLACE=0: in-place calls keep the first choice, as before */
    static const char *const off_on[] = {"0", "1"};
    if (on < 0) on = mt_env_choice("MT_GEMM_TUNE_IN_PLACE", off_on, 2, 1);
    if (!on) return NULL;
    void *scratch = NULL;
    const cudaError_t e = cudaMallocAsync(&scratch, (size_t)ldc * n * es, g_cuda.stream);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); /* not sticky: clears it */
        return NULL;
    }
    CUDA_CHECK(e);
    const struct lt_tune_call call = {p->desc, A, B, C, scratch, p->la, p->lb, p->lc, beta, m, n, ldc, es};
    struct lt_tune_trial *t = lt_tune_start(&call, p->cand, p->n_cand);
    CUDA_CHECK(cudaFreeAsync(scratch, g_cuda.stream));
    return t;
}

/* D = op(A)·op(B) + beta·C, C and D distinct or the same (one layout); the plan is keyed on the
 * lesser alignment of the two. cuBLASLt reads C in its epilogue, so an out-of-place residual costs
 * no pass of its own. */
static void gemm_lt_cd(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A,
                       int lda, const void *B, int ldb, cudaDataType_t ab, const void *C, void *D,
                       int ldc, cudaDataType_t c, float beta)
{
    const bool out_of_place = C != D && beta != 0.0f;
    if (out_of_place && k == 0 && m > 0 && n > 0) copy_c_to_d(D, C, m, n, ldc, c);
    if (gemm_trivial(m, n, k, D, ldc, c, beta)) return;
    const uint32_t ac = MT_MIN(align_of(C), align_of(D));
    struct lt_plan *p = plan_get(ta, tb, m, n, k, lda, ldb, ldc, ab, c, align_of(A), align_of(B), ac);
    if (!p->have_algo) { /* cublasGemmEx works in place */
        if (out_of_place) copy_c_to_d(D, C, m, n, ldc, c);
        cuda_gemm_ex(ta, tb, m, n, k, A, lda, B, ldb, ab, D, ldc, c, beta);
        return;
    }
    if (p->trial) tune_take(p);
    const size_t es = c == CUDA_R_32F ? 4 : 2;
    if (p->tune_pending && !p->trial && (beta == 0.0f || C != D)) { /* the trial leaves cand[0]'s D */
        const struct lt_tune_call call = {p->desc, A, B, C, D, p->la, p->lb, p->lc, beta, m, n, ldc, es};
        p->trial = lt_tune_start(&call, p->cand, p->n_cand);
        p->tune_pending = p->trial != NULL;
        return;
    }
    if (p->tune_pending && !p->trial) { /* dw += in place: tune_in_place, then the call itself */
        p->trial = tune_in_place(p, A, B, C, m, n, ldc, es, beta);
        p->tune_pending = p->trial != NULL;
    }
    const float alpha = 1.0f;
    CUBLAS_CHECK(cublasLtMatmul(g_cuda.lt, p->desc, &alpha, A, p->la, B, p->lb, &beta, C, p->lc, D,
                                p->lc, &p->algo, g_cuda.workspace, g_cuda.workspace_bytes,
                                g_cuda.stream));
}

void cuda_gemm_lt(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A,
                  int lda, const void *B, int ldb, cudaDataType_t ab, void *C, int ldc,
                  cudaDataType_t c, float beta)
{
    gemm_lt_cd(ta, tb, m, n, k, A, lda, B, ldb, ab, C, C, ldc, c, beta);
}

/* The element stride from x0 to x1, false unless it is a whole number of elements within
 * ±(2^31 - 1): cuBLASLt takes int64 batch strides, but no document promises that every kernel
 * forms batch offsets in 64 bits. */
static bool elem_stride(const void *x0, const void *x1, size_t es, int64_t *s)
{
    const int64_t d = (int64_t)((uintptr_t)x1 - (uintptr_t)x0);
    if (d % (int64_t)es) return false;
    *s = d / (int64_t)es;
    return *s >= -INT32_MAX && *s <= INT32_MAX;
}

/* Whether p->algo runs p's GEMM as a strided batch of 2 (within our workspace), checked once per
 * plan with the strides of its first pair; the strides of later pairs are as aligned (the plan
 * key holds every pointer's alignment). */
static bool pair_supported(struct lt_plan *p, const int64_t stride[3])
{
    if (p->pair == lt_plan::PAIR_UNCHECKED) {
        layouts_create(p, 2, &p->la2, &p->lb2, &p->lc2);
        const cublasLtMatrixLayout_t l[3] = {p->la2, p->lb2, p->lc2};
        for (int i = 0; i < 3; i++)
            CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
                l[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride[i], sizeof stride[i]));
        cublasLtMatmulHeuristicResult_t res;
        memset(&res, 0, sizeof res);
        const cublasStatus_t st = cublasLtMatmulAlgoCheck(g_cuda.lt, p->desc, p->la2, p->lb2, p->lc2,
                                                          p->lc2, &p->algo, &res);
        p->pair = st == CUBLAS_STATUS_SUCCESS && res.workspaceSize <= g_cuda.workspace_bytes
                      ? lt_plan::PAIR_OK
                      : lt_plan::PAIR_UNSUPPORTED;
    }
    return p->pair == lt_plan::PAIR_OK;
}

void cuda_gemm_lt_pair(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                       const void *const A[2], int lda, const void *const B[2], int ldb,
                       cudaDataType_t ab, void *const C[2], int ldc, cudaDataType_t c, float beta)
{
    MT_CHECK(C[0] != C[1], "gemm pair: both GEMMs write the same C");
    const uint32_t aa = align_of(A[0]), alb = align_of(B[0]), ac = align_of(C[0]);
    /* one batched call only where it runs the algorithm each GEMM alone would run (the same plan,
     * hence the same alignments) on batch strides of one sign; else the two GEMMs in turn */
    bool batched = m > 0 && n > 0 && k > 0 && align_of(A[1]) == aa && align_of(B[1]) == alb &&
                   align_of(C[1]) == ac;
    const size_t es_ab = ab == CUDA_R_32F ? 4 : 2, es_c = c == CUDA_R_32F ? 4 : 2;
    int64_t stride[3];
    batched = batched && elem_stride(A[0], A[1], es_ab, &stride[0]) &&
              elem_stride(B[0], B[1], es_ab, &stride[1]) && elem_stride(C[0], C[1], es_c, &stride[2]);
    /* Negative strides are not documented as supported: with every stride <= 0 the batch runs
     * the other way round (batch 0 = the GEMM at the lower addresses). */
    int first = 0;
    if (batched && stride[0] <= 0 && stride[1] <= 0 && stride[2] <= 0) {
        first = 1;
        for (int i = 0; i < 3; i++) stride[i] = -stride[i];
    }
    batched = batched && stride[0] >= 0 && stride[1] >= 0 && stride[2] >= 0;
    struct lt_plan *p = batched ? plan_get(ta, tb, m, n, k, lda, ldb, ldc, ab, c, aa, alb, ac) : NULL;
    /* an untuned plan is tuned by the single call first, so that the batch runs the chosen one */
    if (!batched || !p->have_algo || (p->tune_pending && beta == 0.0f) || !pair_supported(p, stride)) {
        for (int i = 0; i < 2; i++) cuda_gemm_lt(ta, tb, m, n, k, A[i], lda, B[i], ldb, ab, C[i], ldc, c, beta);
        return;
    }
    const cublasLtMatrixLayout_t l[3] = {p->la2, p->lb2, p->lc2};
    for (int i = 0; i < 3; i++)
        CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                      &stride[i], sizeof stride[i]));
    const float alpha = 1.0f;
    CUBLAS_CHECK(cublasLtMatmul(g_cuda.lt, p->desc, &alpha, A[first], p->la2, B[first], p->lb2, &beta,
                                C[first], p->lc2, C[first], p->lc2, &p->algo, g_cuda.workspace,
                                g_cuda.workspace_bytes, g_cuda.stream));
}

/* ---------------------------------------------------------------- the ops */

template <typename T>
void cu_matmul_forward(void *out, const void *in, const void *w, int N, int I, int O)
{
    cuda_gemm_lt(CUBLAS_OP_T, CUBLAS_OP_N, O, N, I, w, I, in, I, xtype<T>::cuda, out, O,
                 xtype<T>::cuda, 0.0f);
}

/* out = resid + in Wᵀ, rounded once: the residual is C of the GEMM's epilogue (beta 1) */
template <typename T>
void cu_matmul_forward_residual(void *out, const void *in, const void *w, const void *resid, int N,
                                int I, int O)
{
    MT_CHECK(out != resid, "matmul_forward_residual: out and resid are the same buffer");
    gemm_lt_cd(CUBLAS_OP_T, CUBLAS_OP_N, O, N, I, w, I, in, I, xtype<T>::cuda, resid, out, O,
               xtype<T>::cuda, 1.0f);
}

template <typename T>
void cu_matmul_backward(void *din, float *dw, const void *dout, const void *in, const void *w,
                        int N, int I, int O, bool accumulate)
{
    MT_CHECK(N >= 0 && I >= 0 && O >= 0, "matmul backward: negative size N=%d I=%d O=%d", N, I, O);
    if (N == 0) return; /* no rows: din has none, and dw must stay exactly as it is */
    if (din)
        cuda_gemm_lt(CUBLAS_OP_N, CUBLAS_OP_N, I, N, O, w, I, dout, O, xtype<T>::cuda, din, I,
                     xtype<T>::cuda, accumulate ? 1.0f : 0.0f);
    if (dw)
        cuda_gemm_lt(CUBLAS_OP_N, CUBLAS_OP_T, I, O, N, in, I, dout, O, xtype<T>::cuda, dw, I,
                     CUDA_R_32F, 1.0f);
}

/* k and v of attention: one batched GEMM each for the forward and the weight gradient (at the
 * bench shape a lone N = 512 GEMM has fewer output tiles than the GPU has SMs) */
template <typename T>
void cu_matmul2_forward(void *out_a, void *out_b, const void *in, const void *w_a, const void *w_b,
                        int N, int I, int O)
{
    const void *const w[2] = {w_a, w_b}, *const x[2] = {in, in};
    void *const out[2] = {out_a, out_b};
    cuda_gemm_lt_pair(CUBLAS_OP_T, CUBLAS_OP_N, O, N, I, w, I, x, I, xtype<T>::cuda, out, O,
                      xtype<T>::cuda, 0.0f);
}

/* din stays two GEMMs: both add into the same din, which a batch would write concurrently */
template <typename T>
void cu_matmul2_backward(void *din, float *dw_a, float *dw_b, const void *dout_a,
                         const void *dout_b, const void *in, const void *w_a, const void *w_b, int N,
                         int I, int O, bool accumulate)
{
    MT_CHECK(N >= 0 && I >= 0 && O >= 0, "matmul2 backward: negative size N=%d I=%d O=%d", N, I, O);
    if (N == 0) return; /* no rows: din has none, and dw must stay exactly as it is */
    const bool pair = dw_a && dw_b;
    cu_matmul_backward<T>(din, pair ? NULL : dw_a, dout_a, in, w_a, N, I, O, accumulate);
    cu_matmul_backward<T>(din, pair ? NULL : dw_b, dout_b, in, w_b, N, I, O, true);
    if (!pair) return;
    const void *const x[2] = {in, in}, *const dy[2] = {dout_a, dout_b};
    void *const dw[2] = {dw_a, dw_b};
    cuda_gemm_lt_pair(CUBLAS_OP_N, CUBLAS_OP_T, I, O, N, x, I, dy, O, xtype<T>::cuda, dw, I,
                      CUDA_R_32F, 1.0f);
}

template <typename T>
void cu_router_matmul_forward(float *logits, const void *in, const void *w, int N, int I, int O)
{
    cuda_gemm_lt(CUBLAS_OP_T, CUBLAS_OP_N, O, N, I, w, I, in, I, xtype<T>::cuda, logits, O,
                 CUDA_R_32F, 0.0f);
}

/* dlogits split into three bf16 parts, hi + mid + lo == d exactly (8 + 8 + 8 significant bits
 * cover fp32's 24; a part that underflows bf16's range is lost only below 2^-126), stored side by
 * side: parts[t, p·O + o]. A bf16 GEMM over the parts with fp32 accumulation gives the fp32 GEMM's
 * result (each bf16 x bf16 product is exact in fp32) at tensor-core speed. */
__global__ void split3_kernel(bf16 *parts, const float *d, int O, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float v = d[i];
        const bf16 hi = __float2bfloat16_rn(v);
        const float r1 = v - __bfloat162float(hi);
        const bf16 mid = __float2bfloat16_rn(r1);
        const bf16 lo = __float2bfloat16_rn(r1 - __bfloat162float(mid));
        const size_t t = i / (size_t)O, o = i % (size_t)O;
        bf16 *row = parts + t * 3 * (size_t)O;
        row[o] = hi;
        row[O + o] = mid;
        row[2 * (size_t)O + o] = lo;
    }
}

/* dw += lo + mid + hi, in that order (the parts' products from one GEMM: dw3[p] for part p) */
__global__ void add3_kernel(float *dw, const float *dw3, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dw[i] = ((dw[i] + dw3[2 * n + i]) + dw3[n + i]) + dw3[i];
}

/* w3 = [w; w; w] (n elements each), w read once: one kernel of ours, not three driver copies
 * (memory.cu says why) */
__global__ void stack3_kernel(bf16 *w3, const bf16 *w, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const bf16 v = w[i];
        w3[i] = v;
        w3[n + i] = v;
        w3[2 * n + i] = v;
    }
}

/* bf16: din = dlogits W as ONE GEMM over K = 3·O ([hi | mid | lo] against W stacked three times),
 * rounded to bf16 once (added to an existing din inside the GEMM's epilogue when accumulating);
 * dw += dlogitsᵀ x as one GEMM over the parts side by side (3·O output rows: x, 33 MB at the
 * bench shape, is read once instead of by three GEMMs), whose three products are then added to
 * dw smallest first. Both are the fp32 products up to accumulation order. */
template <typename T>
void cu_router_matmul_backward(void *din, float *dw, const float *dlogits, const void *in,
                               const void *w, int N, int I, int O, bool accumulate)
{
    if constexpr (sizeof(T) == 4) {
        cu_matmul_backward<T>(din, dw, dlogits, in, w, N, I, O, accumulate);
    } else {
        MT_CHECK(N >= 0 && I >= 0 && O >= 0, "router matmul backward: negative size N=%d I=%d O=%d",
                 N, I, O);
        if (N == 0) return;
        const size_t no = (size_t)N * O, oi = (size_t)O * I;
        bf16 *parts = (bf16 *)cuda_scratch(SCRATCH_ROUTER_PARTS, 3 * no * sizeof(bf16));
        const int blocks = (int)MT_MIN((no + 255) / 256, (size_t)4 * g_cuda.num_sms);
        cuda_launch(split3_kernel, blocks, 256, 0, parts, dlogits, O, no);
        CUDA_LAUNCH_CHECK("router dlogits split");
        if (dw) {
            float *dw3 = (float *)cuda_scratch(SCRATCH_ROUTER_DW3, 3 * oi * sizeof(float));
            cuda_gemm_lt(CUBLAS_OP_N, CUBLAS_OP_T, I, 3 * O, N, in, I, parts, 3 * O, CUDA_R_16BF, dw3, I,
                         CUDA_R_32F, 0.0f);
            cuda_launch(add3_kernel, (int)MT_MIN((oi + 255) / 256, (size_t)4 * g_cuda.num_sms), 256, 0,
                dw, dw3, oi);
            CUDA_LAUNCH_CHECK("router dw parts sum");
        }
        if (din) {
            bf16 *w3 = (bf16 *)cuda_scratch(SCRATCH_ROUTER_W3, 3 * oi * sizeof(bf16));
            cuda_launch(stack3_kernel, (int)MT_MIN((oi + 255) / 256, (size_t)4 * g_cuda.num_sms), 256, 0, w3,
                        (const bf16 *)w, oi);
            CUDA_LAUNCH_CHECK("router weight stacked");
            cuda_gemm_lt(CUBLAS_OP_N, CUBLAS_OP_N, I, N, 3 * O, w3, I, parts, 3 * O, CUDA_R_16BF,
                         din, I, CUDA_R_16BF, accumulate ? 1.0f : 0.0f);
        }
    }
}

template void cu_router_matmul_forward<float>(float *, const void *, const void *, int, int, int);
template void cu_router_matmul_forward<bf16>(float *, const void *, const void *, int, int, int);
template void cu_router_matmul_backward<float>(void *, float *, const float *, const void *,
                                               const void *, int, int, int, bool);
template void cu_router_matmul_backward<bf16>(void *, float *, const float *, const void *,
                                              const void *, int, int, int, bool);
template void cu_matmul_forward<float>(void *, const void *, const void *, int, int, int);
template void cu_matmul_forward<bf16>(void *, const void *, const void *, int, int, int);
template void cu_matmul_forward_residual<float>(void *, const void *, const void *, const void *, int,
                                                int, int);
template void cu_matmul_forward_residual<bf16>(void *, const void *, const void *, const void *, int,
                                               int, int);
template void cu_matmul_backward<float>(void *, float *, const void *, const void *, const void *,
                                        int, int, int, bool);
template void cu_matmul_backward<bf16>(void *, float *, const void *, const void *, const void *,
                                       int, int, int, bool);
template void cu_matmul2_forward<float>(void *, void *, const void *, const void *, const void *, int,
                                        int, int);
template void cu_matmul2_forward<bf16>(void *, void *, const void *, const void *, const void *, int,
                                       int, int);
template void cu_matmul2_backward<float>(void *, float *, float *, const void *, const void *,
                                         const void *, const void *, const void *, int, int, int, bool);
template void cu_matmul2_backward<bf16>(void *, float *, float *, const void *, const void *,
                                        const void *, const void *, const void *, int, int, int, bool);
