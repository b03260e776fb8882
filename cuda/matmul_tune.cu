/* The bit-preserving choice among cuBLASLt's candidates (matmul_tune.cuh). A candidate's D is
 * compared with the first candidate's through a 64-bit hash of every element's bits and place:
 * a sum of mixed words, so the order in which threads add it does not matter, and two different
 * results collide with probability ~2^-64. */
#include "matmul_tune.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct gemm_tune_counts g_counts;

extern "C" void cuda_gemm_tune_counts(struct gemm_tune_counts *out) { *out = g_counts; }

static int g_level = -1; /* MT_GEMM_TUNE, read once; cuda_gemm_tune_set overrides it */

int lt_tune_level(void)
{
    if (g_level < 0) {
        const char *env = getenv("MT_GEMM_TUNE");
        g_level = !env || !*env || !strcmp(env, "0") ? 0 : strcmp(env, "2") ? 1 : 2;
    }
    return g_level;
}

extern "C" void cuda_gemm_tune_set(int level) { g_level = level; }

/* splitmix64's finaliser */
__device__ __forceinline__ unsigned long long mix64(unsigned long long z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* *h += Σ mix64(place · φ ^ bits) over D's m x n elements (column-major, leading dimension ldc) */
__global__ void tune_hash_kernel(const void *D, size_t elem, int m, int n, int ldc, unsigned long long *h)
{
    unsigned long long s = 0;
    const size_t total = (size_t)m * n;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        const size_t j = t / (size_t)m, at = j * (size_t)ldc + (t - j * (size_t)m);
        const unsigned long long bits = elem == 4 ? ((const uint32_t *)D)[at] : ((const uint16_t *)D)[at];
        s += mix64((unsigned long long)t * 0x9e3779b97f4a7c15ull ^ bits);
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(h, s);
}

static unsigned long long hash_of(const struct lt_tune_call *c)
{
    unsigned long long *d_h = (unsigned long long *)cuda_scratch(SCRATCH_REDUCE, sizeof *d_h), h = 0;
    CUDA_CHECK(cudaMemsetAsync(d_h, 0, sizeof *d_h, g_cuda.stream));
    tune_hash_kernel<<<4 * g_cuda.num_sms, 256, 0, g_cuda.stream>>>(c->D, c->d_elem, c->m, c->n, c->ldc, d_h);
    CUDA_LAUNCH_CHECK("gemm tune hash");
    CUDA_CHECK(cudaMemcpyAsync(&h, d_h, sizeof h, cudaMemcpyDeviceToHost, g_cuda.stream));
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    return h;
}

/* false where cuBLASLt refuses the candidate for this call (it is then not eligible) */
static bool run(const struct lt_tune_call *c, const cublasLtMatmulAlgo_t *algo)
{
    const float alpha = 1.0f;
    return cublasLtMatmul(g_cuda.lt, c->desc, &alpha, c->A, c->la, c->B, c->lb, &c->beta, c->C, c->lc, c->D,
                          c->lc, algo, g_cuda.workspace, g_cuda.workspace_bytes, g_cuda.stream) ==
           CUBLAS_STATUS_SUCCESS;
}

/* ms a run of algo, over three after the caller's first; 0 where a run failed */
static float time_of(const struct lt_tune_call *c, const cublasLtMatmulAlgo_t *algo)
{
    cudaEvent_t ev[2];
    for (int i = 0; i < 2; i++) CUDA_CHECK(cudaEventCreate(&ev[i]));
    CUDA_CHECK(cudaEventRecord(ev[0], g_cuda.stream));
    bool ok = true;
    for (int r = 0; r < 3 && ok; r++) ok = run(c, algo);
    CUDA_CHECK(cudaEventRecord(ev[1], g_cuda.stream));
    CUDA_CHECK(cudaEventSynchronize(ev[1]));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    for (int i = 0; i < 2; i++) CUDA_CHECK(cudaEventDestroy(ev[i]));
    return ok ? ms / 3 : 0;
}

int lt_tune_pick(const struct lt_tune_call *c, const cublasLtMatmulAlgo_t *cand, int n)
{
    MT_CHECK(c->beta == 0.0f || c->C != c->D, "gemm tune: a call that reads its own output cannot run twice");
    MT_CHECK(n >= 1 && run(c, &cand[0]), "gemm tune: the heuristic's first algorithm failed");
    const unsigned long long h0 = hash_of(c);
    const float t0 = time_of(c, &cand[0]);
    g_counts.plans++, g_counts.candidates += n;
    /* an algorithm whose sums depend on the order its CTAs finish (split-K by atomics) gives other
     * bits on another run: the first candidate being one, nothing is compared with it */
    if (t0 <= 0) MT_CHECK(run(c, &cand[0]), "gemm tune: the heuristic's first algorithm failed");
    if (t0 <= 0 || hash_of(c) != h0) return 0;
    int best = 0, same = 1, holds = 0; /* holds: the candidate whose run D holds, -1 another's */
    float best_t = t0;
    for (int i = 1; i < n; i++) {
        /* the first run's bits, then three timed runs, the last of which must have them too */
        holds = -1;
        if (!run(c, &cand[i]) || hash_of(c) != h0) continue;
        const float t = time_of(c, &cand[i]);
        if (t <= 0 || hash_of(c) != h0) continue;
        holds = i, same++;
        if (t < 0.98f * t0 && t < best_t) best = i, best_t = t;
    }
    if (holds != best) MT_CHECK(run(c, &cand[best]), "gemm tune: the chosen algorithm failed");
    g_counts.identical += same, g_counts.switched += best != 0;
    if (lt_tune_level() == 2)
        fprintf(stderr, "gemm tune: %dx%d: candidate %d of %d (%d with the first's bits), %.3f ms against %.3f\n",
                c->m, c->n, best, n, same, best_t, t0);
    return best;
}
