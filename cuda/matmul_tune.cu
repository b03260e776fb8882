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
        if (!env || !*env) g_level = 1;
        else if (env[1] == '\0' && env[0] >= '0' && env[0] <= '2') g_level = env[0] - '0';
        else mt_user_error("environment variable MT_GEMM_TUNE=%s: expected 0 (off), 1 (on, the default) or 2 (on, "
                           "each choice printed)", env);
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

/* Trials in flight: each holds two hashes a candidate (its first run's, its last timed run's) in a
 * row of a device array that one copy brings to pinned host memory at the trial's end. */
enum { TRIAL_SLOTS = 64, TRIAL_HASHES = 2 * LT_TUNE_MAX };
static unsigned long long *g_hash_dev, *g_hash_host;
static bool g_slot_used[TRIAL_SLOTS];

struct lt_tune_trial {
    int slot, n, m, cols;
    bool ok[LT_TUNE_MAX];           /* cuBLASLt took every run of the candidate */
    cudaEvent_t ev[LT_TUNE_MAX][2]; /* around the candidate's three timed runs */
    cudaEvent_t done;               /* the hashes are on the host */
};

/* false where cuBLASLt refuses the candidate for this call (it is then not eligible) */
static bool run(const struct lt_tune_call *c, const cublasLtMatmulAlgo_t *algo)
{
    const float alpha = 1.0f;
    return cublasLtMatmul(g_cuda.lt, c->desc, &alpha, c->A, c->la, c->B, c->lb, &c->beta, c->C, c->lc, c->D,
                          c->lc, algo, g_cuda.workspace, g_cuda.workspace_bytes, g_cuda.stream) ==
           CUBLAS_STATUS_SUCCESS;
}

/* D's hash, added into *h on the stream */
static void hash_into(const struct lt_tune_call *c, unsigned long long *h)
{
    tune_hash_kernel<<<4 * g_cuda.num_sms, 256, 0, g_cuda.stream>>>(c->D, c->d_elem, c->m, c->n, c->ldc, h);
    CUDA_LAUNCH_CHECK("gemm tune hash");
}

struct lt_tune_trial *lt_tune_start(const struct lt_tune_call *c, const cublasLtMatmulAlgo_t *cand, int n)
{
    MT_CHECK(c->beta == 0.0f || c->C != c->D, "gemm tune: a call that reads its own output cannot run twice");
    MT_CHECK(n >= 1 && n <= LT_TUNE_MAX, "gemm tune: %d candidates", n);
    int slot = 0;
    while (slot < TRIAL_SLOTS && g_slot_used[slot]) slot++;
    if (!g_hash_dev) {
        CUDA_CHECK(cudaMalloc(&g_hash_dev, sizeof(unsigned long long) * TRIAL_SLOTS * TRIAL_HASHES));
        CUDA_CHECK(cudaMallocHost(&g_hash_host, sizeof(unsigned long long) * TRIAL_SLOTS * TRIAL_HASHES));
    }
    if (slot == TRIAL_SLOTS) { /* as many trials in flight as slots: this call is not tuned */
        MT_CHECK(run(c, &cand[0]), "gemm tune: the heuristic's first algorithm failed");
        return NULL;
    }
    struct lt_tune_trial *t = (struct lt_tune_trial *)mt_calloc(1, sizeof *t);
    g_slot_used[slot] = true;
    t->slot = slot, t->n = n, t->m = c->m, t->cols = c->n;
    unsigned long long *h = g_hash_dev + (size_t)slot * TRIAL_HASHES;
    CUDA_CHECK(cudaMemsetAsync(h, 0, sizeof *h * TRIAL_HASHES, g_cuda.stream));
    for (int i = 0; i < n; i++) {
        /* the first run's bits, then three timed runs, the last of which must have them too */
        for (int e = 0; e < 2; e++) CUDA_CHECK(cudaEventCreate(&t->ev[i][e]));
        t->ok[i] = run(c, &cand[i]);
        MT_CHECK(i > 0 || t->ok[0], "gemm tune: the heuristic's first algorithm failed");
        if (t->ok[i]) hash_into(c, &h[2 * i]);
        CUDA_CHECK(cudaEventRecord(t->ev[i][0], g_cuda.stream));
        for (int r = 0; r < 3 && t->ok[i]; r++) t->ok[i] = run(c, &cand[i]);
        CUDA_CHECK(cudaEventRecord(t->ev[i][1], g_cuda.stream));
        if (t->ok[i]) hash_into(c, &h[2 * i + 1]);
    }
    /* D as the call would have left it: the first candidate's */
    if (n > 1) MT_CHECK(run(c, &cand[0]), "gemm tune: the heuristic's first algorithm failed");
    CUDA_CHECK(cudaMemcpyAsync(g_hash_host + (size_t)slot * TRIAL_HASHES, h, sizeof *h * TRIAL_HASHES,
                               cudaMemcpyDeviceToHost, g_cuda.stream));
    CUDA_CHECK(cudaEventCreateWithFlags(&t->done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(t->done, g_cuda.stream));
    return t;
}

static void trial_free(struct lt_tune_trial *t)
{
    for (int i = 0; i < t->n; i++)
        for (int e = 0; e < 2; e++) CUDA_CHECK(cudaEventDestroy(t->ev[i][e]));
    CUDA_CHECK(cudaEventDestroy(t->done));
    g_slot_used[t->slot] = false;
    free(t);
}

int lt_tune_poll(struct lt_tune_trial *t)
{
    const cudaError_t q = cudaEventQuery(t->done);
    if (q == cudaErrorNotReady) return -1;
    CUDA_CHECK(q);
    const unsigned long long *h = g_hash_host + (size_t)t->slot * TRIAL_HASHES, h0 = h[0];
    float t0 = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t0, t->ev[0][0], t->ev[0][1]));
    g_counts.plans++, g_counts.candidates += t->n;
    /* an algorithm whose sums depend on the order its CTAs finish (split-K by atomics) gives other
     * bits on another run: the first candidate being one, nothing is compared with it */
    int best = 0, same = 1;
    float best_t = t0;
    if (t->ok[0] && h[1] == h0) {
        for (int i = 1; i < t->n; i++) {
            float ms = 0;
            if (!t->ok[i] || h[2 * i] != h0 || h[2 * i + 1] != h0) continue;
            CUDA_CHECK(cudaEventElapsedTime(&ms, t->ev[i][0], t->ev[i][1]));
            same++;
            if (ms < 0.98f * t0 && ms < best_t) best = i, best_t = ms;
        }
        g_counts.identical += same, g_counts.switched += best != 0;
    } else {
        g_counts.identical += 1;
    }
    if (lt_tune_level() == 2)
        fprintf(stderr, "gemm tune: %dx%d: candidate %d of %d (%d with the first's bits), %.3f ms against %.3f\n",
                t->m, t->cols, best, t->n, same, best_t / 3, t0 / 3);
    trial_free(t);
    return best;
}

void lt_tune_drop(struct lt_tune_trial *t)
{
    CUDA_CHECK(cudaEventSynchronize(t->done)); /* the copy into its slot has landed */
    trial_free(t);
}
