/* The bit-preserving choice among cuBLASLt's candidates (matmul_tune.cuh). A candidate's D is
 * compared with the first candidate's through a 64-bit hash of every element's bits and place:
 * a sum of mixed words, so the order in which threads add it does not matter, and two different
 * results collide with probability ~2^-64. */
#include "matmul_tune.cuh"

#include "env_flag.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct gemm_tune_counts g_counts;

extern "C" void cuda_gemm_tune_counts(struct gemm_tune_counts *out) { *out = g_counts; }

static int g_level = -1; /* MT_GEMM_TUNE, read once; cuda_gemm_tune_set overrides it */

int lt_tune_level(void)
{
    static const char *const levels[] = {"0", "1", "2"}; /* off, on, on with each choice printed */
    if (g_level < 0) g_level = mt_env_choice("MT_GEMM_TUNE", levels, 3, 1);
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
    pdl_wait(); /* first: launch.cuh */
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
enum { TRIAL_SLOTS = 64, TRIAL_HASHES = 2 * LT_TUNE_MAX, TRIAL_ROUNDS_MAX = 8, TRIAL_ROUNDS_DEFAULT = 5 };
static unsigned long long *g_hash_dev, *g_hash_host;
static bool g_slot_used[TRIAL_SLOTS];

/* MT_GEMM_TUNE_ROUNDS: how a trial times its candidates. 1..8 (default 5): that many rounds, each
 * running every candidate once, so that a clock falling under the power cap as the trial goes on
 * slows every candidate alike; "seq": three runs of each candidate back to back, the later
 * candidates on a hotter card (the trial before the thirty-third session). */
static int g_rounds = -1;
static bool g_sequential;

static int trial_rounds(void)
{
    static const char *const choices[TRIAL_ROUNDS_MAX + 1] = {"seq", "1", "2", "3", "4", "5", "6", "7", "8"};
    if (g_rounds < 0) {
        const int c = mt_env_choice("MT_GEMM_TUNE_ROUNDS", choices, TRIAL_ROUNDS_MAX + 1, TRIAL_ROUNDS_DEFAULT);
        g_sequential = c == 0, g_rounds = c == 0 ? 3 : c;
    }
    return g_rounds;
}

struct lt_tune_trial {
    int slot, n, m, cols, rounds;
    bool ok[LT_TUNE_MAX];                              /* cuBLASLt took every run of the candidate */
    cudaEvent_t ev[LT_TUNE_MAX][TRIAL_ROUNDS_MAX][2]; /* around each timed run */
    cudaEvent_t done;                                 /* the hashes are on the host */
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
    cuda_launch(tune_hash_kernel, 4 * g_cuda.num_sms, 256, 0, c->D, c->d_elem, c->m, c->n, c->ldc, h);
    CUDA_LAUNCH_CHECK("gemm tune hash");
}

/* candidate i's r-th timed run; its D hashed into *h after it when h is not NULL */
static void timed_run(struct lt_tune_trial *t, const struct lt_tune_call *c, const cublasLtMatmulAlgo_t *cand,
                      int i, int r, unsigned long long *h)
{
    CUDA_CHECK(cudaEventRecord(t->ev[i][r][0], g_cuda.stream));
    if (t->ok[i]) t->ok[i] = run(c, &cand[i]);
    CUDA_CHECK(cudaEventRecord(t->ev[i][r][1], g_cuda.stream));
    if (h && t->ok[i]) hash_into(c, h);
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
    const int R = trial_rounds();
    t->slot = slot, t->n = n, t->m = c->m, t->cols = c->n, t->rounds = R;
    unsigned long long *h = g_hash_dev + (size_t)slot * TRIAL_HASHES;
    CUDA_CHECK(cudaMemsetAsync(h, 0, sizeof *h * TRIAL_HASHES, g_cuda.stream));
    /* each candidate's first run, untimed (it warms the candidate up), gives its bits; its last
     * timed run must give them too */
    for (int i = 0; i < n; i++) {
        for (int r = 0; r < R; r++)
            for (int e = 0; e < 2; e++) CUDA_CHECK(cudaEventCreate(&t->ev[i][r][e]));
        t->ok[i] = run(c, &cand[i]);
        MT_CHECK(i > 0 || t->ok[0], "gemm tune: the heuristic's first algorithm failed");
        if (t->ok[i]) hash_into(c, &h[2 * i]);
        for (int r = 0; g_sequential && r < R; r++) timed_run(t, c, cand, i, r, r == R - 1 ? &h[2 * i + 1] : NULL);
    }
    for (int r = 0; !g_sequential && r < R; r++)
        for (int i = 0; i < n; i++) timed_run(t, c, cand, i, r, r == R - 1 ? &h[2 * i + 1] : NULL);
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
        for (int r = 0; r < t->rounds; r++)
            for (int e = 0; e < 2; e++) CUDA_CHECK(cudaEventDestroy(t->ev[i][r][e]));
    CUDA_CHECK(cudaEventDestroy(t->done));
    g_slot_used[t->slot] = false;
    free(t);
}

/* the median of candidate i's timed runs (ms): one slow run (a clock step, another process) does
 * not decide */
static float median_ms(const struct lt_tune_trial *t, int i)
{
    float ms[TRIAL_ROUNDS_MAX];
    for (int r = 0; r < t->rounds; r++) {
        CUDA_CHECK(cudaEventElapsedTime(&ms[r], t->ev[i][r][0], t->ev[i][r][1]));
        for (int j = r; j > 0 && ms[j] < ms[j - 1]; j--) {
            const float x = ms[j];
            ms[j] = ms[j - 1], ms[j - 1] = x;
        }
    }
    return t->rounds % 2 ? ms[t->rounds / 2] : 0.5f * (ms[t->rounds / 2 - 1] + ms[t->rounds / 2]);
}

int lt_tune_poll(struct lt_tune_trial *t)
{
    const cudaError_t q = cudaEventQuery(t->done);
    if (q == cudaErrorNotReady) return -1;
    CUDA_CHECK(q);
    const unsigned long long *h = g_hash_host + (size_t)t->slot * TRIAL_HASHES, h0 = h[0];
    const float t0 = median_ms(t, 0);
    float ms[LT_TUNE_MAX] = {t0};
    g_counts.plans++, g_counts.candidates += t->n;
    /* an algorithm whose sums depend on the order its CTAs finish (split-K by atomics) gives other
     * bits on another run: the first candidate being one, nothing is compared with it */
    int best = 0, same = 1;
    float best_t = t0;
    if (t->ok[0] && h[1] == h0) {
        for (int i = 1; i < t->n; i++) {
            ms[i] = -1.0f; /* not eligible */
            if (!t->ok[i] || h[2 * i] != h0 || h[2 * i + 1] != h0) continue;
            ms[i] = median_ms(t, i);
            same++;
            if (ms[i] < 0.98f * t0 && ms[i] < best_t) best = i, best_t = ms[i];
        }
        g_counts.identical += same, g_counts.switched += best != 0;
    } else {
        g_counts.identical += 1;
    }
    if (lt_tune_level() == 2) {
        char each[LT_TUNE_MAX * 12] = "", *w = each;
        for (int i = 0; i < t->n && (t->ok[0] && h[1] == h0); i++)
            w += ms[i] < 0 ? sprintf(w, " -") : sprintf(w, " %.3f", ms[i]);
        fprintf(stderr, "gemm tune: %dx%d: candidate %d of %d (%d with the first's bits), %.3f ms against %.3f "
                "(median of %d%s; each:%s)\n", t->m, t->cols, best, t->n, same, best_t, t0, t->rounds,
                g_sequential ? " back to back" : " rounds", each);
    }
    trial_free(t);
    return best;
}

void lt_tune_drop(struct lt_tune_trial *t)
{
    CUDA_CHECK(cudaEventSynchronize(t->done)); /* the copy into its slot has landed */
    trial_free(t);
}
