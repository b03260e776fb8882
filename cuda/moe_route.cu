/* The MoE route plan on the device (ops.h moe_route_plan), so the only thing the host waits for
 * per MoE layer is E counts instead of downloading, sorting and re-uploading the whole [T, k]
 * routing (src/cpu/cpu_moe.c is the reference: integers only, so both give identical plans).
 *
 * (1) one thread per token sorts its k choices by expert id (weights alongside) and counts them
 *     into a shared-memory histogram, added into the global counts with integer atomics (exact,
 *     so the order does not matter); ids outside [0, E) are counted in counts[E] for the host.
 * (2) one block per expert walks the tokens in order; a block-wide prefix count of the tokens that
 *     chose expert e gives each its row, off[e] + rank, i.e. rows sorted by (expert, token). */
#include "moe_route.cuh"

enum { ROUTE_THREADS = 256, ROUTE_MAX_K = 32, ROUTE_MAX_E = 8192 };

__global__ void route_sort_count_kernel(int32_t *topk_idx, float *topk_w, int *counts, int T,
                                        int E, int k)
{
    extern __shared__ int hist[]; /* [E + 1] */
    for (int e = threadIdx.x; e <= E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) {
        int32_t idx[ROUTE_MAX_K];
        float w[ROUTE_MAX_K];
        for (int j = 0; j < k; j++) {
            idx[j] = topk_idx[(size_t)t * k + j];
            w[j] = topk_w[(size_t)t * k + j];
        }
        for (int j = 1; j < k; j++)
            for (int i = j; i > 0 && idx[i - 1] > idx[i]; i--) {
                const int32_t ti = idx[i]; idx[i] = idx[i - 1]; idx[i - 1] = ti;
                const float tw = w[i]; w[i] = w[i - 1]; w[i - 1] = tw;
            }
        for (int j = 0; j < k; j++) {
            topk_idx[(size_t)t * k + j] = idx[j];
            topk_w[(size_t)t * k + j] = w[j];
            atomicAdd(&hist[idx[j] >= 0 && idx[j] < E ? idx[j] : E], 1);
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x)
        if (hist[e]) atomicAdd(&counts[e], hist[e]);
}

__global__ void __launch_bounds__(ROUTE_THREADS)
route_rows_kernel(const int32_t *topk_idx, const int *counts, int32_t *src_row, int32_t *slot_row,
                  int T, int k)
{
    __shared__ int warp_tot[ROUTE_THREADS / 32];
    __shared__ int base_sh;
    const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    /* off[e] = Σ counts[e' < e] */
    int part = 0;
    for (int i = threadIdx.x; i < e; i += ROUTE_THREADS) part += counts[i];
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0) warp_tot[warp] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int w = 0; w < ROUTE_THREADS / 32; w++) s += warp_tot[w];
        base_sh = s;
    }
    __syncthreads();
    int base = base_sh;
    for (int t0 = 0; t0 < T; t0 += ROUTE_THREADS) {
        const int t = t0 + threadIdx.x;
        int jj = -1;
        if (t < T)
            for (int j = 0; j < k; j++) {
                const int32_t x = topk_idx[(size_t)t * k + j];
                if (x == e) jj = j;
                if (x >= e) break; /* sorted ascending */
            }
        const unsigned ballot = __ballot_sync(0xffffffffu, jj >= 0);
        __syncthreads(); /* warp_tot of the previous chunk is consumed */
        if (lane == 0) warp_tot[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < ROUTE_THREADS / 32; w++) {
            before += w < warp ? warp_tot[w] : 0;
            total += warp_tot[w];
        }
        if (jj >= 0) {
            const int row = base + before + __popc(ballot & ((1u << lane) - 1u));
            src_row[row] = t;
            slot_row[(size_t)t * k + jj] = row;
        }
        base += total;
    }
}

void cu_moe_route_plan(int32_t *topk_idx, float *topk_w, int32_t *src_row, int32_t *slot_row,
                       int64_t *count_host, int T, int E, int k)
{
    MT_CHECK(T >= 0 && E > 0 && E <= ROUTE_MAX_E && k > 0 && k <= ROUTE_MAX_K && k <= E,
             "moe_route_plan: unsupported shape T=%d E=%d k=%d (E <= %d, k <= %d)", T, E, k,
             ROUTE_MAX_E, ROUTE_MAX_K);
    MT_CHECK((int64_t)T * k <= INT32_MAX, "moe_route_plan: %lld rows overflow int32",
             (long long)T * k);
    int *counts = (int *)cuda_scratch(SCRATCH_HIST, (size_t)(E + 1) * sizeof(int));
    CUDA_CHECK(cudaMemsetAsync(counts, 0, (size_t)(E + 1) * sizeof(int), g_cuda.stream));
    if (T > 0) {
        route_sort_count_kernel<<<(T + ROUTE_THREADS - 1) / ROUTE_THREADS, ROUTE_THREADS,
                                  (size_t)(E + 1) * sizeof(int), g_cuda.stream>>>(topk_idx, topk_w,
                                                                                  counts, T, E, k);
        CUDA_LAUNCH_CHECK("moe route sort/count");
    }
    static int *h; /* pinned, so the copy below is asynchronous */
    if (!h) CUDA_CHECK(cudaMallocHost(&h, (ROUTE_MAX_E + 1) * sizeof(int)));
    CUDA_CHECK(cudaMemcpyAsync(h, counts, (size_t)(E + 1) * sizeof(int), cudaMemcpyDeviceToHost,
                               g_cuda.stream));
    /* the rows kernel is queued before the wait, so it runs while the counts travel */
    if (T > 0) {
        route_rows_kernel<<<E, ROUTE_THREADS, 0, g_cuda.stream>>>(topk_idx, counts, src_row,
                                                                  slot_row, T, k);
        CUDA_LAUNCH_CHECK("moe route rows");
    }
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    MT_CHECK(h[E] == 0, "router chose %d expert ids outside [0, %d)", h[E], E);
    for (int e = 0; e < E; e++) count_host[e] = h[e];
}
