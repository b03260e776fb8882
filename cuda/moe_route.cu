/* The MoE route and pair plans on the device (ops.h moe_route_plan, moe_pair_plan): the host does
 * not download, sort and re-upload the [T, k] routing. The route plan's expert offsets stay on the
 * device for the grouped GEMMs (no wait at all); the pair plan's per-rank counts come to the host,
 * which sizes the all-to-all with them (src/cpu/cpu_moe.c is the reference: integers only, so
 * both give identical plans).
 *
 * Route plan:
 * (1) one thread per token sorts its k choices by expert id (weights alongside) and counts them
 *     into a shared-memory histogram, added into the global counts with integer atomics (exact,
 *     so the order does not matter); MT_NO_EXPERT slots are skipped (slot_row -1), other ids
 *     outside [0, E) too, counted in counts[E] for the deferred error (memory.cuh) and given
 *     rows after every expert's with token 0 as their source, so that a layer run over T·k rows
 *     reads only real rows until the run stops.
 *     Each block also keeps its own histogram (chunk_hist: one row per ROUTE_THREADS tokens).
 * (2) one block per (expert, chunk of ROUTE_THREADS tokens): its chunk's tokens that chose expert e
 *     get rows off[e] + (the earlier chunks' count for e) + rank in the chunk, i.e. rows sorted by
 *     (expert, token); every block is independent, so a few experts (or EP ranks) still fill the
 *     GPU.
 * Pair plan: the same two passes with the EP rank (expert / n_local) in place of the expert and
 * each token counted once per rank it uses. */
#include "moe_route.cuh"

#include "memory.cuh"

enum { ROUTE_THREADS = 256, ROUTE_MAX_K = 32, ROUTE_MAX_E = 8192 };

/* token t's choices, sorted by expert id (weights alongside), written back; left in idx/w */
__device__ void sort_token(int32_t *topk_idx, float *topk_w, int t, int k, int32_t *idx, float *w)
{
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
    }
}

/* the block's histogram into counts and into its row of chunk_hist ([gridDim.x, n + 1]) */
__device__ void publish_hist(const int *hist, int n, int *counts, int *chunk_hist)
{
    for (int i = threadIdx.x; i <= n; i += blockDim.x) {
        chunk_hist[(size_t)blockIdx.x * (n + 1) + i] = hist[i];
        if (hist[i]) atomicAdd(&counts[i], hist[i]);
    }
}

__global__ void route_sort_count_kernel(int32_t *topk_idx, float *topk_w, int32_t *slot_row,
                                        int *counts, int *chunk_hist, int T, int E, int k)
{
    pdl_wait(); /* first: launch.cuh */
    extern __shared__ int hist[]; /* [E + 1] */
    for (int e = threadIdx.x; e <= E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) {
        int32_t idx[ROUTE_MAX_K];
        float w[ROUTE_MAX_K];
        sort_token(topk_idx, topk_w, t, k, idx, w);
        for (int j = 0; j < k; j++) {
            const bool bad = idx[j] < 0 || idx[j] >= E;
            if (bad) slot_row[(size_t)t * k + j] = -1;
            if (bad && idx[j] != MT_NO_EXPERT) atomicAdd(&hist[E], 1);
            if (!bad) atomicAdd(&hist[idx[j]], 1);
        }
    }
    __syncthreads();
    publish_hist(hist, E, counts, chunk_hist);
}

/* Σ a[i * stride] over i < n, for every thread of the block (warp_tot: the block's
 * ROUTE_THREADS/32 ints) */
__device__ int block_sum(const int *a, int n, int stride, int *warp_tot)
{
    __shared__ int sum_sh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int part = 0;
    for (int i = threadIdx.x; i < n; i += ROUTE_THREADS) part += a[(size_t)i * stride];
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0) warp_tot[warp] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int w = 0; w < ROUTE_THREADS / 32; w++) sum += warp_tot[w];
        sum_sh = sum;
    }
    __syncthreads();
    return sum_sh;
}

/* Over one chunk of ROUTE_THREADS items (one a thread, in thread order): the number of flagged
 * items before this thread's. Every thread calls it. */
__device__ int block_rank_in_chunk(bool flag, int *warp_tot)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    __syncthreads(); /* warp_tot's earlier use (block_sum) is over */
    if (lane == 0) warp_tot[warp] = __popc(ballot);
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; w++) before += warp_tot[w];
    return before + __popc(ballot & ((1u << lane) - 1u));
}

/* The first row of chunk blockIdx.y's items for bucket b (expert or rank) of n buckets:
 * off[b] plus the earlier chunks' count for b. */
__device__ int chunk_base(const int *counts, const int *chunk_hist, int b, int n, int *warp_tot)
{
    const int off = block_sum(counts, b, 1, warp_tot);
    return off + block_sum(chunk_hist + b, (int)blockIdx.y, n + 1, warp_tot);
}

/* grid (E, chunks): expert e's rows for the tokens of chunk blockIdx.y. The chunk-0 blocks also
 * publish the expert offsets (off[e], and off[E] from the last expert's) and add the ids outside
 * [0, E) (counts[E]) to the deferred error counter. */
__global__ void __launch_bounds__(ROUTE_THREADS)
route_rows_kernel(const int32_t *topk_idx, const int *counts, const int *chunk_hist, int32_t *src_row,
                  int32_t *slot_row, int64_t *off, int *bad, int T, int E, int k)
{
    pdl_wait(); /* first: launch.cuh */
    __shared__ int warp_tot[ROUTE_THREADS / 32];
    const int e = blockIdx.x;
    const int first = block_sum(counts, e, 1, warp_tot);
    const int base = first + block_sum(chunk_hist + e, (int)blockIdx.y, E + 1, warp_tot);
    if (blockIdx.y == 0 && threadIdx.x == 0) {
        off[e] = first;
        if (e == E - 1) off[E] = first + counts[E - 1];
        if (e == 0 && counts[E]) atomicAdd(bad, counts[E]);
    }
    if (blockIdx.y == 0 && e == E - 1) /* the bad ids' rows */
        for (int i = threadIdx.x; i < counts[E]; i += ROUTE_THREADS) src_row[first + counts[E - 1] + i] = 0;
    const int t = (int)blockIdx.y * ROUTE_THREADS + threadIdx.x;
    int jj = -1;
    if (t < T)
        for (int j = 0; j < k; j++) {
            const int32_t x = topk_idx[(size_t)t * k + j];
            if (x == e) jj = j;
            if (x >= e) break; /* sorted ascending */
        }
    const int rank = block_rank_in_chunk(jj >= 0, warp_tot);
    if (jj >= 0) {
        const int row = base + rank;
        src_row[row] = t;
        slot_row[(size_t)t * k + jj] = row;
    }
}

/* the grid of the rows kernels: n buckets x chunks of ROUTE_THREADS tokens */
static dim3 rows_grid(int n, int T)
{
    const int chunks = (T + ROUTE_THREADS - 1) / ROUTE_THREADS;
    MT_CHECK(chunks <= 65535, "moe route plan: %d tokens are more than %d chunks", T, 65535);
    return dim3((unsigned)n, (unsigned)chunks);
}

/* per-chunk histograms of n + 1 buckets for T tokens (scratch) */
static int *chunk_hist_for(int n, int T)
{
    const size_t chunks = (size_t)(T + ROUTE_THREADS - 1) / ROUTE_THREADS;
    return (int *)cuda_scratch(SCRATCH_CHUNK_HIST, MT_MAX(chunks, 1) * (size_t)(n + 1) * sizeof(int));
}

/* n zeroed device counters (scratch), in stream order */
static int *counts_zeroed(int n)
{
    int *counts = (int *)cuda_scratch(SCRATCH_HIST, (size_t)n * sizeof(int));
    cu_zero(counts, (size_t)n * sizeof(int));
    return counts;
}

/* Queues the copy of n counters into pinned host memory (asynchronous, so the rows kernel queued
 * after it runs while they travel); the result is valid after the stream synchronises. */
static const int *counts_to_host(const int *counts, int n)
{
    static int *h;
    if (!h) CUDA_CHECK(cudaMallocHost(&h, (2 * ROUTE_MAX_E + 1) * sizeof(int)));
    CUDA_CHECK(cudaMemcpyAsync(h, counts, (size_t)n * sizeof(int), cudaMemcpyDeviceToHost,
                               g_cuda.stream));
    return h;
}

void cu_moe_route_plan(int32_t *topk_idx, float *topk_w, int32_t *src_row, int32_t *slot_row,
                       int64_t *off, int T, int E, int k)
{
    MT_CHECK(T >= 0 && E > 0 && E <= ROUTE_MAX_E && k > 0 && k <= ROUTE_MAX_K && k <= E,
             "moe_route_plan: unsupported shape T=%d E=%d k=%d (E <= %d, k <= %d)", T, E, k,
             ROUTE_MAX_E, ROUTE_MAX_K);
    MT_CHECK((int64_t)T * k <= INT32_MAX, "moe_route_plan: %lld rows overflow int32",
             (long long)T * k);
    int *counts = counts_zeroed(E + 1);
    int *chunk_hist = chunk_hist_for(E, T);
    if (T > 0) {
        cuda_launch(route_sort_count_kernel, (T + ROUTE_THREADS - 1) / ROUTE_THREADS, ROUTE_THREADS,
            (size_t)(E + 1) * sizeof(int), topk_idx, topk_w, slot_row, counts, chunk_hist, T, E, k);
        CUDA_LAUNCH_CHECK("moe route sort/count");
    }
    if (T == 0) {
        cu_zero(off, ((size_t)E + 1) * sizeof(int64_t));
        return;
    }
    cuda_launch(route_rows_kernel, rows_grid(E, T), ROUTE_THREADS, 0,
        topk_idx, counts, chunk_hist, src_row, slot_row, off, cu_deferred_error_counter(), T, E, k);
    CUDA_LAUNCH_CHECK("moe route rows");
    /* no wait here: the offsets stay on the device for the expert GEMMs; a bad id stops the run
     * at the next download (the micro-step's losses at the latest), before any update */
    cu_deferred_error_fetch("moe_route_plan: the router chose expert ids outside [0, num_experts)");
}

/* ---------------------------------------------------------------- pair plan */

/* counts [ep + 1]: pairs per rank, then the bad ids; choices [ep]: choices per rank (the expert rows
 * the rank will hold) */
__global__ void pair_sort_count_kernel(int32_t *topk_idx, float *topk_w, int *counts, int *chunk_hist,
                                       int *choices, int T, int ep, int n_local, int k)
{
    pdl_wait(); /* first: launch.cuh */
    extern __shared__ int hist[]; /* [ep + 1] pairs and bad ids, then [ep] choices */
    int *chist = hist + ep + 1;
    for (int d = threadIdx.x; d <= 2 * ep; d += blockDim.x) hist[d] = 0;
    __syncthreads();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) {
        int32_t idx[ROUTE_MAX_K];
        float w[ROUTE_MAX_K];
        sort_token(topk_idx, topk_w, t, k, idx, w);
        const int E = ep * n_local;
        for (int j = 0; j < k; j++) {
            if (idx[j] < 0 || idx[j] >= E) {
                atomicAdd(&hist[ep], 1);
                continue;
            }
            if (j == 0 || idx[j] / n_local != idx[j - 1] / n_local) atomicAdd(&hist[idx[j] / n_local], 1);
            atomicAdd(&chist[idx[j] / n_local], 1);
        }
    }
    __syncthreads();
    publish_hist(hist, ep, counts, chunk_hist);
    for (int d = threadIdx.x; d < ep; d += blockDim.x)
        if (chist[d]) atomicAdd(&choices[d], chist[d]);
}

/* grid (ep, chunks): the tokens of chunk blockIdx.y using rank d, in order, get pairs
 * base[d] + (the earlier chunks' count) + rank; in blocks (block > 0) token t's pair is
 * d * block + t, padding when t has no choice on rank d */
__global__ void __launch_bounds__(ROUTE_THREADS)
pair_rows_kernel(const int32_t *topk_idx, const float *topk_w, const int *counts, const int *chunk_hist,
                 int32_t *pair_tok, int32_t *tok_pair, int32_t *meta_idx, float *meta_w, int32_t *w_map,
                 int T, int ep, int n_local, int k, int block)
{
    pdl_wait(); /* first: launch.cuh */
    __shared__ int warp_tot[ROUTE_THREADS / 32];
    const int d = blockIdx.x;
    const int base = block ? d * block : chunk_base(counts, chunk_hist, d, ep, warp_tot);
    const int t = (int)blockIdx.y * ROUTE_THREADS + threadIdx.x;
    int j0 = k, j1 = k;
    if (t < T) {
        const int32_t *idx = topk_idx + (size_t)t * k;
        for (int j = 0; j < k; j++) {
            const int r = idx[j] / n_local;
            if (r == d && j0 == k) j0 = j;
            if (r > d) { j1 = j; break; }
        }
        if (j0 == k) j1 = k;
    }
    const bool has = j0 < k;
    if (block && t < T && !has) { /* padding at the token's own slot */
        const size_t p = (size_t)base + t;
        pair_tok[p] = t;
        for (int s = 0; s < k; s++) meta_idx[p * k + s] = MT_NO_EXPERT, meta_w[p * k + s] = 0.0f;
    }
    const int rank = block ? t : block_rank_in_chunk(has, warp_tot); /* block: uniform over the launch */
    if (has) {
        const int p = base + rank;
        pair_tok[p] = t;
        for (int s = 0; s < k; s++) {
            const bool used = s < j1 - j0;
            meta_idx[(size_t)p * k + s] = used ? topk_idx[(size_t)t * k + j0 + s] - d * n_local
                                               : MT_NO_EXPERT;
            meta_w[(size_t)p * k + s] = used ? topk_w[(size_t)t * k + j0 + s] : 0.0f;
        }
        for (int j = j0; j < j1; j++) {
            tok_pair[(size_t)t * k + j] = j == j0 ? p : -1;
            w_map[(size_t)t * k + j] = p * k + (j - j0);
        }
    }
}

/* grid (ep, blocks): the padding past the tokens in rank d's block of the fixed layout; the
 * first thread adds the bad ids to the deferred error counter */
__global__ void pair_pad_kernel(const int *counts, int32_t *pair_tok, int32_t *meta_idx, float *meta_w,
                                int *bad, int ep, int k, int block, int T)
{
    pdl_wait(); /* first: launch.cuh */
    const int d = blockIdx.x;
    if (d == 0 && blockIdx.y == 0 && threadIdx.x == 0 && counts[ep]) atomicAdd(bad, counts[ep]);
    for (int i = T + (int)(blockIdx.y * blockDim.x + threadIdx.x); i < block;
         i += (int)(gridDim.y * blockDim.x)) {
        const size_t p = (size_t)d * block + i;
        pair_tok[p] = 0;
        for (int s = 0; s < k; s++) meta_idx[p * k + s] = MT_NO_EXPERT, meta_w[p * k + s] = 0.0f;
    }
}

void cu_moe_pair_plan(int32_t *topk_idx, float *topk_w, int32_t *pair_tok, int32_t *tok_pair,
                      int32_t *meta_idx, float *meta_w, int32_t *w_map, int64_t *count_host,
                      int64_t *rows_host, int T, int ep, int n_local, int k, int block)
{
    MT_CHECK(block == 0 || (block >= T && (int64_t)block * ep * k <= INT32_MAX),
             "moe_pair_plan: blocks of %d pairs for %d tokens on %d ranks", block, T, ep);
    MT_CHECK(block > 0 || (count_host && rows_host), "moe_pair_plan: the packed layout returns its counts");
    /* ep <= ROUTE_MAX_E / 2: the count kernel's two histograms fit the default 48 KB of shared memory */
    MT_CHECK(T >= 0 && ep > 0 && ep <= ROUTE_MAX_E / 2 && n_local > 0 && k > 0 && k <= ROUTE_MAX_K,
             "moe_pair_plan: unsupported shape T=%d ep=%d n_local=%d k=%d", T, ep, n_local, k);
    MT_CHECK((int64_t)T * k * k <= INT32_MAX, "moe_pair_plan: %lld slots overflow int32",
             (long long)T * k * k);
    int *counts = counts_zeroed(2 * ep + 1); /* pairs, bad ids, then choices per rank */
    int *chunk_hist = chunk_hist_for(ep, T);
    if (T > 0) {
        cuda_launch(pair_sort_count_kernel, (T + ROUTE_THREADS - 1) / ROUTE_THREADS, ROUTE_THREADS,
            (size_t)(2 * ep + 1) * sizeof(int), topk_idx, topk_w, counts, chunk_hist, counts + ep + 1, T, ep,
            n_local, k);
        CUDA_LAUNCH_CHECK("moe pair sort/count");
    }
    const int *h = count_host ? counts_to_host(counts, 2 * ep + 1) : NULL;
    if (T > 0) {
        cuda_launch(pair_rows_kernel, rows_grid(ep, T), ROUTE_THREADS, 0,
            topk_idx, topk_w, counts, chunk_hist, pair_tok, tok_pair, meta_idx, meta_w, w_map, T, ep,
            n_local, k, block);
        CUDA_LAUNCH_CHECK("moe pair rows");
    }
    if (block) {
        cuda_launch(pair_pad_kernel, dim3((unsigned)ep, (unsigned)MT_MAX(1, MT_MIN(64, block / 1024))), 256, 0,
            counts, pair_tok, meta_idx, meta_w, cu_deferred_error_counter(), ep, k, block, T);
        CUDA_LAUNCH_CHECK("moe pair padding");
    }
    if (!h) { /* the fixed layout: nothing to wait for; a bad id stops the run at the next download */
        cu_deferred_error_fetch("moe_pair_plan: the router chose expert ids outside [0, num_experts)");
        return;
    }
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    MT_CHECK(h[ep] == 0, "router chose %d expert ids outside [0, %d)", h[ep], ep * n_local);
    for (int d = 0; d < ep; d++) count_host[d] = h[d], rows_host[d] = h[ep + 1 + d];
}

/* ---------------------------------------------------------------- rows held to a capacity */

/* every thread: slots past the capacity become empty, and rows past the used ones lose their
 * source; block 0 also records the need and cuts the offsets (the slot pass reads no offset, and
 * min(off[n_exp], cap) is the same before and after the cut, so nothing races) */
__global__ void rows_cap_kernel(int64_t *off, int32_t *src_row, int32_t *slot_row, int64_t *need_out,
                                int n_slots, int n_exp, int64_t cap)
{
    pdl_wait(); /* first: launch.cuh */
    const int64_t used = off[n_exp] < cap ? off[n_exp] : cap;
    for (int64_t r = used + blockIdx.x * blockDim.x + threadIdx.x; r < cap; r += (int64_t)gridDim.x * blockDim.x)
        src_row[r] = -1;
    if (blockIdx.x == 0) {
        const int64_t need = off[n_exp];
        __syncthreads(); /* every thread of block 0 has read off[n_exp] before one is cut */
        if (threadIdx.x == 0 && need > 0)
            atomicMax((unsigned long long *)need_out, (unsigned long long)need);
        if (threadIdx.x == 0 && need > cap) atomicAdd((unsigned long long *)need_out + 1, 1ull);
        if (need > cap)
            for (int e = threadIdx.x; e <= n_exp; e += blockDim.x) off[e] = off[e] < cap ? off[e] : cap;
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_slots; i += gridDim.x * blockDim.x)
        if (slot_row[i] >= cap) slot_row[i] = -1;
}

void cu_moe_rows_cap(int64_t *off, int32_t *src_row, int32_t *slot_row, int64_t *need, int n_slots, int n_exp,
                     int64_t cap)
{
    MT_CHECK(n_slots >= 0 && n_exp > 0 && cap >= 0, "moe_rows_cap: %d slots, %d experts, capacity %lld",
             n_slots, n_exp, (long long)cap);
    const int blocks = MT_MAX(1, MT_MIN((n_slots + 255) / 256, 1024));
    cuda_launch(rows_cap_kernel, blocks, 256, 0, off, src_row, slot_row, need, n_slots, n_exp, cap);
    CUDA_LAUNCH_CHECK("moe_rows_cap");
}

/* ---------------------------------------------------------------- one source's rows of each expert */

/* the first row of [r0, r1) whose source is >= src (r1 if none): the sources ascend there */
static __device__ int64_t first_from(const int32_t *src_row, int64_t r0, int64_t r1, int64_t src)
{
    while (r0 < r1) {
        const int64_t mid = r0 + (r1 - r0) / 2;
        if (src_row[mid] < src) r0 = mid + 1;
        else r1 = mid;
    }
    return r0;
}

/* a thread an expert: two binary searches over its rows; thread n_exp the end */
__global__ void rows_split_kernel(int64_t *lo, int64_t *hi, const int64_t *off, const int32_t *src_row,
                                  int n_exp, int64_t src_lo, int64_t src_hi)
{
    pdl_wait(); /* first: launch.cuh */
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e == n_exp) lo[e] = hi[e] = off[e];
    if (e >= n_exp) return;
    const int64_t r1 = off[e + 1], l = first_from(src_row, off[e], r1, src_lo);
    lo[e] = l;
    hi[e] = first_from(src_row, l, r1, src_hi);
}

void cu_moe_rows_split(int64_t *lo, int64_t *hi, const int64_t *off, const int32_t *src_row, int n_exp,
                       int64_t src_lo, int64_t src_hi)
{
    MT_CHECK(n_exp > 0 && src_lo <= src_hi, "moe_rows_split: %d experts, pairs [%lld, %lld)", n_exp,
             (long long)src_lo, (long long)src_hi);
    cuda_launch(rows_split_kernel, (n_exp + 1 + 127) / 128, 128, 0, lo, hi, off, src_row, n_exp, src_lo, src_hi);
    CUDA_LAUNCH_CHECK("moe_rows_split");
}

/* ---------------------------------------------------------------- fp32 gather */

__global__ void gather_f32_kernel(float *out, const float *in, const int32_t *idx, int n)
{
    pdl_wait(); /* first: launch.cuh */
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = in[idx[i]];
}

void cu_gather_f32(float *out, const float *in, const int32_t *idx, int n)
{
    MT_CHECK(n >= 0, "gather_f32: negative count %d", n);
    if (n == 0) return;
    cuda_launch(gather_f32_kernel, MT_MIN((n + 255) / 256, 65536), 256, 0, out, in, idx, n);
    CUDA_LAUNCH_CHECK("gather_f32");
}
