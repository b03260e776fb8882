/* Row gather, deterministic scatter-add, and the MoE combine.
 *
 * Scatter-add (gather_rows backward, embedding backward). In moetrain the index is either a
 * permutation (the EP regroup) or many-to-one with at most k sources per destination (token rows
 * from their k expert slots), and for the embedding any number of repeats of a token id. Atomics
 * would make the bf16 result depend on timing, so instead: a stable radix sort of the (destination,
 * source) pairs by destination (CUB), then one block per run of equal destinations that adds its
 * sources in ascending source order in fp32, starting from the destination's current value, and
 * rounds once. In fp32 this is the CPU's exact order, so the two agree bit for bit.
 *
 * Dispatch by slot (ops.h dispatch_rows): the same rows as the gather by the route plan's
 * exp_src, written from each source row's slots, so that a row is read once, not once per expert.
 *
 * Combine. out[t] = Σ_j w[t,j]·y[slot_row[t,j]] in fp32, j ascending, rounded once. In bf16 the
 * routing weight is first rounded to bf16 (spec §3.6 step 5), in the forward and the backward
 * alike. Negative indices (never produced by moetrain) are skipped rather than read.
 *
 * Rows whose length is a multiple of 8 elements, with 16-byte aligned pointers, move as chunks of
 * 8 (16-byte accesses), one warp per row (per tile of sorted positions in the scatter, per token
 * in the combine), each lane holding up to RW_UNROLL chunks of the row in flight; other shapes
 * take the scalar kernels, one block per row. The sums are the same either way: each element is
 * added by one thread in the order above. */
#include "moe_rows.cuh"

#include <cub/device/device_radix_sort.cuh>

#include "env_flag.h"

enum { ROW_BLOCK = 256, RW_UNROLL = 4, SC_TILE = 8 };

/* warps of ROW_BLOCK threads for n rows, capped; the kernels loop over rows by warp */
static unsigned rw_grid(int n)
{
    const int per_block = ROW_BLOCK / 32;
    return (unsigned)MT_MIN((n + per_block - 1) / per_block, 65536);
}

/* ---------------------------------------------------------------- gather */

/* Which rows a gather moves (ops.h gather_rows, gather_rows_part): all with an index >= 0, or only
 * those whose index lies inside [lo, hi) (read at idx - lo), or only those outside it. */
enum { GATHER_ALL, GATHER_INSIDE, GATHER_OUTSIDE };

/* row r's source row, or -1 when the gather leaves row r as it is */
__device__ __forceinline__ int32_t gather_src(int32_t src, int lo, int hi, int part)
{
    if (src < 0 || part == GATHER_ALL) return src;
    const bool inside = src >= lo && src < hi;
    if (part == GATHER_INSIDE) return inside ? src - lo : -1;
    return inside ? -1 : src;
}

template <typename T>
__global__ void gather_rows_kernel(T *out, const T *in, const int32_t *idx, int R, int H, int lo, int hi, int part)
{
    pdl_wait(); /* first: launch.cuh */
    for (int r = blockIdx.x; r < R; r += gridDim.x) {
        const int32_t src = gather_src(idx[r], lo, hi, part);
        T *o = out + (size_t)r * H;
        if (src < 0) continue;
        const T *i = in + (size_t)src * H;
        for (int h = threadIdx.x; h < H; h += blockDim.x) o[h] = i[h];
    }
}

/* rows of nv 16-byte words, a warp per row */
__global__ void gather_rows_vec_kernel(uint4 *__restrict__ out, const uint4 *__restrict__ in,
                                       const int32_t *idx, int R, int nv, int lo, int hi, int part)
{
    pdl_wait(); /* first: launch.cuh */
    enum { U = 2 * RW_UNROLL };
    const int lane = threadIdx.x & 31;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < R; r += (gridDim.x * blockDim.x) >> 5) {
        const int32_t src = gather_src(idx[r], lo, hi, part);
        if (src < 0) continue;
        const uint4 *i = in + (size_t)src * nv;
        uint4 *o = out + (size_t)r * nv;
        for (int v0 = lane; v0 < nv; v0 += 32 * U) {
            uint4 buf[U];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (v0 + 32 * u < nv) buf[u] = i[v0 + 32 * u];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (v0 + 32 * u < nv) o[v0 + 32 * u] = buf[u];
        }
    }
}

template <typename T>
static void gather_rows_launch(T *out, const T *in, const int32_t *idx, int R, int H, int lo, int hi, int part)
{
    MT_CHECK(R >= 0 && H >= 0, "gather_rows: bad shape R=%d H=%d", R, H);
    if (R == 0 || H == 0) return;
    if ((size_t)H * sizeof(T) % 16 == 0 && aligned16(out) && aligned16(in)) {
        cuda_launch(gather_rows_vec_kernel, rw_grid(R), ROW_BLOCK, 0,
            (uint4 *)out, (const uint4 *)in, idx, R, (int)((size_t)H * sizeof(T) / 16), lo, hi, part);
        CUDA_LAUNCH_CHECK("gather_rows");
        return;
    }
    cuda_launch(gather_rows_kernel<T>, MT_MIN(R, 65536), ROW_BLOCK, 0, out, in, idx, R, H, lo, hi, part);
    CUDA_LAUNCH_CHECK("gather_rows");
}

template <typename T> void cuda_gather_rows(T *out, const T *in, const int32_t *idx, int R, int H)
{
    gather_rows_launch(out, in, idx, R, H, 0, 0, GATHER_ALL);
}

/* ---------------------------------------------------------------- dispatch by slot */

/* out[slot[i,j]] = in[i] (ops.h dispatch_rows), rows of nv 16-byte words: a warp per source row,
 * k <= 32, lane j holding slot j; a chunk of the row is read once and stored to each of its slots,
 * and a row with no slot is not read. EvictFirst: stores that skip keeping the rows in L2
 * (MT_DISPATCH_STORE=evict_first; the grouped GEMM reads x_exp next, 268 MB at the bench shape,
 * more than the L2 holds). */
template <bool EvictFirst>
__global__ void dispatch_rows_vec_kernel(uint4 *__restrict__ out, const uint4 *__restrict__ in,
                                         const int32_t *__restrict__ slot, int n, int k, int nv)
{
    pdl_wait(); /* first: launch.cuh */
    enum { U = 2 * RW_UNROLL };
    const int lane = threadIdx.x & 31;
    for (int i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < n; i += (gridDim.x * blockDim.x) >> 5) {
        const int32_t my = lane < k ? slot[(size_t)i * k + lane] : -1;
        const unsigned used = __ballot_sync(0xffffffffu, my >= 0);
        if (!used) continue;
        const uint4 *src = in + (size_t)i * nv;
        /* every lane runs every round (the shuffles below need the whole warp), its chunks
         * guarded */
        for (int base = 0; base < nv; base += 32 * U) {
            const int v0 = base + lane;
            uint4 buf[U];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (v0 + 32 * u < nv) buf[u] = src[v0 + 32 * u];
            for (unsigned left = used; left; left &= left - 1) {
                const int32_t row = __shfl_sync(0xffffffffu, my, __ffs(left) - 1);
                uint4 *o = out + (size_t)row * nv;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    if (v0 + 32 * u >= nv) continue;
                    if (EvictFirst) __stcs(o + v0 + 32 * u, buf[u]);
                    else o[v0 + 32 * u] = buf[u];
                }
            }
        }
    }
}

/* any shape: a block per source row */
template <typename T>
__global__ void dispatch_rows_kernel(T *out, const T *in, const int32_t *slot, int n, int k, int H)
{
    pdl_wait(); /* first: launch.cuh */
    for (int i = blockIdx.x; i < n; i += gridDim.x)
        for (int j = 0; j < k; j++) {
            const int32_t row = slot[(size_t)i * k + j];
            if (row < 0) continue;
            for (int h = threadIdx.x; h < H; h += blockDim.x) out[(size_t)row * H + h] = in[(size_t)i * H + h];
        }
}

static bool dispatch_evict_first(void)
{
    static int choice = -1;
    static const char *const stores[] = {"cached", "evict_first"};
    if (choice < 0) choice = mt_env_choice("MT_DISPATCH_STORE", stores, 2, 0);
    return choice == 1;
}

template <typename T>
static void dispatch_rows_launch(T *out, const T *in, const int32_t *slot, int n, int k, int H)
{
    MT_CHECK(n >= 0 && k > 0 && H >= 0, "dispatch_rows: bad shape n=%d k=%d H=%d", n, k, H);
    if (n == 0 || H == 0) return;
    if (k <= 32 && (size_t)H * sizeof(T) % 16 == 0 && aligned16(out) && aligned16(in)) {
        const int nv = (int)((size_t)H * sizeof(T) / 16);
        if (dispatch_evict_first())
            cuda_launch(dispatch_rows_vec_kernel<true>, rw_grid(n), ROW_BLOCK, 0, (uint4 *)out, (const uint4 *)in, slot, n, k, nv);
        else
            cuda_launch(dispatch_rows_vec_kernel<false>, rw_grid(n), ROW_BLOCK, 0, (uint4 *)out, (const uint4 *)in, slot, n, k, nv);
        CUDA_LAUNCH_CHECK("dispatch_rows");
        return;
    }
    cuda_launch(dispatch_rows_kernel<T>, MT_MIN(n, 65536), ROW_BLOCK, 0, out, in, slot, n, k, H);
    CUDA_LAUNCH_CHECK("dispatch_rows");
}

/* ---------------------------------------------------------------- scatter-add */

__global__ void iota_kernel(int32_t *v, int n)
{
    pdl_wait(); /* first: launch.cuh */
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v[i] = i;
}

/* One block per sorted position p; only the first position of each run of equal destinations
 * works. */
template <typename Out, typename In>
__global__ void scatter_sorted_kernel(Out *dst, const In *src, const int32_t *keys,
                                      const int32_t *vals, int R, int H)
{
    pdl_wait(); /* first: launch.cuh */
    for (int p = blockIdx.x; p < R; p += gridDim.x) {
        const int32_t key = keys[p];
        if (key < 0 || (p > 0 && keys[p - 1] == key)) continue;
        int end = p + 1;
        while (end < R && keys[end] == key) end++;
        Out *d = dst + (size_t)key * H;
        for (int h = threadIdx.x; h < H; h += blockDim.x) {
            float acc = to_f(d[h]);
            for (int q = p; q < end; q++) acc += to_f(src[(size_t)vals[q] * H + h]);
            d[h] = from_f<Out>(acc);
        }
    }
}

/* As scatter_sorted_kernel, rows in chunks of 8. A warp takes a tile of SC_TILE sorted positions
 * and adds the run of every destination that starts in the tile (runs may reach past it), so
 * every warp of a block has work; two source rows are loaded before either is added. */
template <typename Out, typename In>
__global__ void scatter_sorted_vec_kernel(Out *dst, const In *__restrict__ src, const int32_t *keys,
                                          const int32_t *vals, int R, int H)
{
    pdl_wait(); /* first: launch.cuh */
    const int lane = threadIdx.x & 31, nch = H >> 3, nwarps = (gridDim.x * blockDim.x) >> 5;
    for (int p0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * SC_TILE; p0 < R;
         p0 += nwarps * SC_TILE) {
        int32_t key = -1;
        bool head = false;
        if (lane < SC_TILE && p0 + lane < R) {
            key = keys[p0 + lane];
            head = key >= 0 && (p0 + lane == 0 || keys[p0 + lane - 1] != key);
        }
        for (unsigned heads = __ballot_sync(0xffffffffu, head); heads; heads &= heads - 1) {
            const int hl = __ffs(heads) - 1, start = p0 + hl;
            const int32_t k = __shfl_sync(0xffffffffu, key, hl);
            int end = start + 1; /* the first later position with another key, 32 at a time */
            for (;;) {
                const bool other = end + lane >= R || keys[end + lane] != k;
                const unsigned m = __ballot_sync(0xffffffffu, other);
                if (m) {
                    end += __ffs(m) - 1;
                    break;
                }
                end += 32;
            }
            Out *d = dst + (size_t)k * H;
            for (int c0 = lane; c0 < nch; c0 += 32 * RW_UNROLL) {
                float acc[RW_UNROLL][8];
#pragma unroll
                for (int u = 0; u < RW_UNROLL; u++)
                    if (c0 + 32 * u < nch) load8f(d + (c0 + 32 * u) * 8, acc[u]);
                int q = start;
                for (; q + 1 < end; q += 2) {
                    const In *s0 = src + (size_t)vals[q] * H, *s1 = src + (size_t)vals[q + 1] * H;
                    pack8<In> v0[RW_UNROLL], v1[RW_UNROLL];
#pragma unroll
                    for (int u = 0; u < RW_UNROLL; u++)
                        if (c0 + 32 * u < nch) {
                            v0[u] = ld8(s0 + (c0 + 32 * u) * 8);
                            v1[u] = ld8(s1 + (c0 + 32 * u) * 8);
                        }
#pragma unroll
                    for (int u = 0; u < RW_UNROLL; u++)
                        if (c0 + 32 * u < nch) {
                            float f0[8], f1[8];
                            unpack8(v0[u], f0);
                            unpack8(v1[u], f1);
#pragma unroll
                            for (int e = 0; e < 8; e++) acc[u][e] = (acc[u][e] + f0[e]) + f1[e];
                        }
                }
                if (q < end) {
                    const In *s0 = src + (size_t)vals[q] * H;
#pragma unroll
                    for (int u = 0; u < RW_UNROLL; u++)
                        if (c0 + 32 * u < nch) {
                            float f0[8];
                            load8f(s0 + (c0 + 32 * u) * 8, f0);
#pragma unroll
                            for (int e = 0; e < 8; e++) acc[u][e] += f0[e];
                        }
                }
#pragma unroll
                for (int u = 0; u < RW_UNROLL; u++)
                    if (c0 + 32 * u < nch) store8f(d + (c0 + 32 * u) * 8, acc[u]);
            }
        }
    }
}

template <typename Out, typename In>
void cuda_scatter_add_rows(Out *dst, const In *src, const int32_t *idx, int R, int H)
{
    MT_CHECK(R >= 0 && H >= 0, "scatter-add rows: bad shape R=%d H=%d", R, H);
    if (R == 0 || H == 0) return;
    int32_t *keys = (int32_t *)cuda_scratch(SCRATCH_SORT_KEYS, (size_t)R * sizeof(int32_t));
    int32_t *vals = (int32_t *)cuda_scratch(SCRATCH_SORT_VALS, (size_t)2 * R * sizeof(int32_t));
    int32_t *vals_in = vals, *vals_out = vals + R;
    cuda_launch(iota_kernel, cuda_grid(R, 256), 256, 0, vals_in, R);
    CUDA_LAUNCH_CHECK("scatter iota");
    size_t temp_bytes = 0;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, idx, keys, vals_in, vals_out, R,
                                               0, 32, g_cuda.stream));
    void *temp = cuda_scratch(SCRATCH_SORT_TEMP, temp_bytes);
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, idx, keys, vals_in, vals_out, R, 0,
                                               32, g_cuda.stream));
    if (H % 8 == 0 && aligned16(dst) && aligned16(src))
        cuda_launch(scatter_sorted_vec_kernel<Out, In>, rw_grid((R + SC_TILE - 1) / SC_TILE), ROW_BLOCK, 0,
            dst, src, keys, vals_out, R, H);
    else
        cuda_launch(scatter_sorted_kernel<Out, In>, MT_MIN(R, 65536), ROW_BLOCK, 0,
            dst, src, keys, vals_out, R, H);
    CUDA_LAUNCH_CHECK("scatter rows");
}

/* ---------------------------------------------------------------- combine */

template <typename T>
__global__ void combine_fwd_kernel(T *out, const T *y, const int32_t *slot_row, const float *w,
                                   const T *resid, int T_, int k, int H)
{
    pdl_wait(); /* first: launch.cuh */
    for (int t = blockIdx.x; t < T_; t += gridDim.x) {
        T *o = out + (size_t)t * H;
        for (int h = threadIdx.x; h < H; h += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < k; j++) {
                const int32_t r = slot_row[(size_t)t * k + j];
                if (r < 0) continue;
                acc += round_x<T>(w[(size_t)t * k + j]) * to_f(y[(size_t)r * H + h]);
            }
            if (resid) acc = round_x<T>(acc) + to_f(resid[(size_t)t * H + h]); /* = add_inplace */
            o[h] = from_f<T>(acc);
        }
    }
}

/* dy[slot_row[t,j]] = w[t,j]·dout[t]; dw[t,j] = <dout[t], y[slot_row[t,j]]> (summed in double) */
template <typename T>
__global__ void combine_bwd_kernel(T *dy, float *dw, const T *dout, const T *y,
                                   const int32_t *slot_row, const float *w, int T_, int k, int H)
{
    pdl_wait(); /* first: launch.cuh */
    __shared__ double sh[32];
    for (int t = blockIdx.x; t < T_; t += gridDim.x) {
        const T *g = dout + (size_t)t * H;
        for (int j = 0; j < k; j++) {
            const int32_t r = slot_row[(size_t)t * k + j];
            if (r < 0) continue; /* uniform across the block */
            const float wj = round_x<T>(w[(size_t)t * k + j]);
            T *dyr = dy + (size_t)r * H;
            const T *yr = y + (size_t)r * H;
            double dot = 0.0;
            for (int h = threadIdx.x; h < H; h += blockDim.x) {
                const float gh = to_f(g[h]);
                dot += (double)(gh * to_f(yr[h]));
                dyr[h] = from_f<T>(wj * gh);
            }
            dot = block_sum(dot, sh);
            if (threadIdx.x == 0) dw[(size_t)t * k + j] = (float)dot;
        }
    }
}

/* A token's k slots for the warp-per-token combine backward: with k <= 32 lane j loads slot j's row and
 * rounded weight once and the others take them by shuffle, so a slot's row loads never wait for
 * an index load (and the segments after the first read no index again); else from memory. */
template <typename T> struct token_slots {
    const int32_t *slot_row;
    const float *w;
    size_t base;
    int k;
    int32_t lane_r;
    float lane_w;
    __device__ token_slots(const int32_t *sr, const float *w_, int t, int k_, int lane)
        : slot_row(sr), w(w_), base((size_t)t * k_), k(k_), lane_r(-1), lane_w(0.0f)
    {
        if (k <= 32 && lane < k) {
            lane_r = slot_row[base + lane];
            if (lane_r >= 0) lane_w = round_x<T>(w[base + lane]);
        }
    }
    /* slot j's row (-1: none) and its weight rounded to the compute dtype; -1 past the last slot.
     * Uniform across the warp. */
    __device__ __forceinline__ int32_t get(int j, float &wj) const
    {
        if (j >= k) return -1;
        if (k <= 32) {
            wj = __shfl_sync(0xffffffffu, lane_w, j);
            return __shfl_sync(0xffffffffu, lane_r, j);
        }
        const int32_t r = slot_row[base + j];
        wj = r >= 0 ? round_x<T>(w[base + j]) : 0.0f;
        return r;
    }
};

/* the lane's chunks c0 + 32u of row r of y (nothing when r < 0) */
template <typename T>
__device__ __forceinline__ void load_row_chunks(pack8<T> (&v)[RW_UNROLL], const T *__restrict__ y, int32_t r,
                                                int H, int c0, int nch)
{
    if (r < 0) return;
    const T *yr = y + (size_t)r * H;
#pragma unroll
    for (int u = 0; u < RW_UNROLL; u++)
        if (c0 + 32 * u < nch) v[u] = ld8(yr + (c0 + 32 * u) * 8);
}

/* combine_fwd_kernel with a warp per token, rows in chunks of 8 */
template <typename T>
__global__ void combine_fwd_vec_kernel(T *out, const T *__restrict__ y, const int32_t *slot_row,
                                       const float *w, const T *resid, int T_, int k, int H)
{
    pdl_wait(); /* first: launch.cuh */
    const int lane = threadIdx.x & 31, nch = H >> 3;
    for (int t = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; t < T_; t += (gridDim.x * blockDim.x) >> 5) {
        T *o = out + (size_t)t * H;
        for (int c0 = lane; c0 < nch; c0 += 32 * RW_UNROLL) {
            float acc[RW_UNROLL][8];
#pragma unroll
            for (int u = 0; u < RW_UNROLL; u++)
#pragma unroll
                for (int e = 0; e < 8; e++) acc[u][e] = 0.0f;
            for (int j = 0; j < k; j++) {
                const int32_t r = slot_row[(size_t)t * k + j];
                if (r < 0) continue;
                const float wj = round_x<T>(w[(size_t)t * k + j]);
                const T *yr = y + (size_t)r * H;
                pack8<T> v[RW_UNROLL];
#pragma unroll
                for (int u = 0; u < RW_UNROLL; u++)
                    if (c0 + 32 * u < nch) v[u] = ld8(yr + (c0 + 32 * u) * 8);
#pragma unroll
                for (int u = 0; u < RW_UNROLL; u++)
                    if (c0 + 32 * u < nch) {
                        float f[8];
                        unpack8(v[u], f);
#pragma unroll
                        for (int e = 0; e < 8; e++) acc[u][e] += wj * f[e];
                    }
            }
#pragma unroll
            for (int u = 0; u < RW_UNROLL; u++)
                if (c0 + 32 * u < nch) {
                    if (resid) { /* the rounded sum plus the residual, as add_inplace would */
                        float f[8];
                        load8f(resid + (size_t)t * H + (c0 + 32 * u) * 8, f);
#pragma unroll
                        for (int e = 0; e < 8; e++) acc[u][e] = round_x<T>(acc[u][e]) + f[e];
                    }
                    store8f(o + (c0 + 32 * u) * 8, acc[u]);
                }
        }
    }
}

/* combine_bwd_kernel with a warp per token. The row is taken in segments of 32·RW_UNROLL chunks;
 * the dot product of each segment is summed in fp32 over the lane's chunks and the warp's fixed
 * shuffle tree, and the segments' sums are added in order into dw. KMAX > 0 (k <= KMAX): the
 * sums of the token's k slots stay in registers over the segments and are stored at the end
 * (the same additions in the same order); KMAX = 0: lane 0 adds each segment's sum into dw in
 * memory, which waits for the load of dw a slot and a segment (any k). Two slots' rows
 * alternate in two register sets: the next slot's loads are in flight while this one's products
 * and its dy are formed. With the launch bound (256 threads, 1 block: ptxas then takes 114
 * registers, two blocks an SM as before at 64) bench_ops gives 150.6 against 161.8 us a call at
 * the bench shape; without it 159.7 (96 registers). The same treatment slowed the forward's sums
 * (81 against 76 us: they are at 83% of the DRAM peak already; docs/benchmarks.md). */
template <typename T, int KMAX>
__global__ void __launch_bounds__(ROW_BLOCK, 1) combine_bwd_vec_kernel(T *__restrict__ dy, float *dw, const T *__restrict__ dout,
                                       const T *__restrict__ y, const int32_t *slot_row,
                                       const float *w, int T_, int k, int H)
{
    pdl_wait(); /* first: launch.cuh */
    const int lane = threadIdx.x & 31, nch = H >> 3;
    for (int t = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; t < T_; t += (gridDim.x * blockDim.x) >> 5) {
        const T *g = dout + (size_t)t * H;
        const token_slots<T> slots(slot_row, w, t, k, lane);
        float sums[KMAX > 0 ? KMAX : 1];
        for (int c0 = lane, first = 1; c0 - lane < nch; c0 += 32 * RW_UNROLL, first = 0) {
            pack8<T> gp[RW_UNROLL]; /* dout's chunks as loaded: half the registers of fp32 */
#pragma unroll
            for (int u = 0; u < RW_UNROLL; u++)
                if (c0 + 32 * u < nch) gp[u] = ld8(g + (c0 + 32 * u) * 8);
            /* slot j (row r, weight wj, its chunks v): its part of dy from this segment, and the
             * segment's dot product, added to the slot's sum */
            auto slot_segment = [&](int j, int32_t r, float wj, const pack8<T> (&v)[RW_UNROLL]) {
                T *dyr = dy + (size_t)r * H;
                float dot = 0.0f;
#pragma unroll
                for (int u = 0; u < RW_UNROLL; u++)
                    if (c0 + 32 * u < nch) {
                        float f[8], gf[8], d[8];
                        unpack8(v[u], f);
                        unpack8(gp[u], gf);
#pragma unroll
                        for (int e = 0; e < 8; e++) {
                            dot += gf[e] * f[e];
                            d[e] = wj * gf[e];
                        }
                        store8f(dyr + (c0 + 32 * u) * 8, d);
                    }
                dot = warp_sum(dot);
                if constexpr (KMAX > 0) {
#pragma unroll
                    for (int i = 0; i < KMAX; i++) /* a constant index: sums stays in registers */
                        if (i == j) sums[i] = first ? dot : sums[i] + dot;
                } else if (lane == 0) {
                    float *dst = dw + (size_t)t * k + j;
                    *dst = first ? dot : *dst + dot;
                }
            };
            pack8<T> va[RW_UNROLL], vb[RW_UNROLL];
            float wa = 0.0f, wb = 0.0f;
            int32_t ra = slots.get(0, wa);
            load_row_chunks(va, y, ra, H, c0, nch);
            const int kk = KMAX > 0 ? KMAX : k; /* KMAX: a loop the compiler unrolls */
            for (int j = 0; j < kk; j += 2) {
                const int32_t rb = slots.get(j + 1, wb);
                load_row_chunks(vb, y, rb, H, c0, nch);
                if (ra >= 0) slot_segment(j, ra, wa, va);
                ra = slots.get(j + 2, wa);
                load_row_chunks(va, y, ra, H, c0, nch);
                if (rb >= 0) slot_segment(j + 1, rb, wb, vb);
            }
        }
        if constexpr (KMAX > 0) /* a slot with no row keeps its dw, as above */
#pragma unroll
            for (int j = 0; j < KMAX; j++)
                if (lane == j && j < k && slot_row[(size_t)t * k + j] >= 0) dw[(size_t)t * k + j] = sums[j];
    }
}

/* MT_COMBINE_BWD_SUMS=memory: every k takes the kernel that adds into dw in memory (measuring) */
static int combine_bwd_regs(void)
{
    static const char *const where[] = {"registers", "memory"};
    return mt_env_choice("MT_COMBINE_BWD_SUMS", where, 2, 0) == 0;
}

static bool rw_vec_ok(int H, const void *a, const void *b, const void *c)
{
    return H % 8 == 0 && aligned16(a) && aligned16(b) && (!c || aligned16(c));
}

/* ---------------------------------------------------------------- the ops */

template <typename T> void cu_gather_rows(void *out, const void *in, const int32_t *idx, int R, int H)
{
    cuda_gather_rows<T>((T *)out, (const T *)in, idx, R, H);
}

template <typename T>
void cu_gather_rows_part(void *out, const void *in, const int32_t *idx, int R, int H, int lo, int hi, bool inside)
{
    MT_CHECK(lo <= hi, "gather_rows_part: empty range [%d, %d)", lo, hi);
    gather_rows_launch<T>((T *)out, (const T *)in, idx, R, H, lo, hi, inside ? GATHER_INSIDE : GATHER_OUTSIDE);
}

template <typename T>
void cu_dispatch_rows(void *out, const void *in, const int32_t *slot, int n, int k, int H)
{
    dispatch_rows_launch<T>((T *)out, (const T *)in, slot, n, k, H);
}

template <typename T>
void cu_gather_rows_backward(void *din, const void *dout, const int32_t *idx, int R, int H)
{
    cuda_scatter_add_rows<T, T>((T *)din, (const T *)dout, idx, R, H);
}

template <typename T>
void cu_moe_combine_forward(void *out, const void *y, const int32_t *slot_row, const float *w,
                            const void *resid, int T_, int k, int H)
{
    MT_CHECK(T_ >= 0 && k > 0 && H >= 0, "moe_combine: bad shape T=%d k=%d H=%d", T_, k, H);
    if (T_ == 0 || H == 0) return;
    if (rw_vec_ok(H, out, y, resid)) {
        cuda_launch(combine_fwd_vec_kernel<T>, rw_grid(T_), ROW_BLOCK, 0,
            (T *)out, (const T *)y, slot_row, w, (const T *)resid, T_, k, H);
        CUDA_LAUNCH_CHECK("moe_combine forward");
        return;
    }
    cuda_launch(combine_fwd_kernel<T>, MT_MIN(T_, 65536), ROW_BLOCK, 0,
        (T *)out, (const T *)y, slot_row, w, (const T *)resid, T_, k, H);
    CUDA_LAUNCH_CHECK("moe_combine forward");
}

template <typename T>
void cu_moe_combine_backward(void *dy, float *dw, const void *dout, const void *y,
                             const int32_t *slot_row, const float *w, int T_, int k, int H)
{
    MT_CHECK(T_ >= 0 && k > 0 && H >= 0, "moe_combine backward: bad shape T=%d k=%d H=%d", T_, k, H);
    if (T_ == 0) return;
    if (H > 0 && rw_vec_ok(H, dy, dout, y)) {
        static const int regs = combine_bwd_regs();
        if (k <= 8 && regs)
            cuda_launch(combine_bwd_vec_kernel<T, 8>, rw_grid(T_), ROW_BLOCK, 0,
                (T *)dy, dw, (const T *)dout, (const T *)y, slot_row, w, T_, k, H);
        else
            cuda_launch(combine_bwd_vec_kernel<T, 0>, rw_grid(T_), ROW_BLOCK, 0,
                (T *)dy, dw, (const T *)dout, (const T *)y, slot_row, w, T_, k, H);
        CUDA_LAUNCH_CHECK("moe_combine backward");
        return;
    }
    cuda_launch(combine_bwd_kernel<T>, MT_MIN(T_, 65536), ROW_BLOCK, 0,
        (T *)dy, dw, (const T *)dout, (const T *)y, slot_row, w, T_, k, H);
    CUDA_LAUNCH_CHECK("moe_combine backward");
}

template void cuda_gather_rows<float>(float *, const float *, const int32_t *, int, int);
template void cuda_gather_rows<bf16>(bf16 *, const bf16 *, const int32_t *, int, int);
template void cuda_scatter_add_rows<float, float>(float *, const float *, const int32_t *, int, int);
template void cuda_scatter_add_rows<bf16, bf16>(bf16 *, const bf16 *, const int32_t *, int, int);
template void cuda_scatter_add_rows<float, bf16>(float *, const bf16 *, const int32_t *, int, int);
template void cu_gather_rows<float>(void *, const void *, const int32_t *, int, int);
template void cu_gather_rows<bf16>(void *, const void *, const int32_t *, int, int);
template void cu_gather_rows_part<float>(void *, const void *, const int32_t *, int, int, int, int, bool);
template void cu_gather_rows_part<bf16>(void *, const void *, const int32_t *, int, int, int, int, bool);
template void cu_dispatch_rows<float>(void *, const void *, const int32_t *, int, int, int);
template void cu_dispatch_rows<bf16>(void *, const void *, const int32_t *, int, int, int);
template void cu_gather_rows_backward<float>(void *, const void *, const int32_t *, int, int);
template void cu_gather_rows_backward<bf16>(void *, const void *, const int32_t *, int, int);
template void cu_moe_combine_forward<float>(void *, const void *, const int32_t *, const float *,
                                            const void *, int, int, int);
template void cu_moe_combine_forward<bf16>(void *, const void *, const int32_t *, const float *,
                                           const void *, int, int, int);
template void cu_moe_combine_backward<float>(void *, float *, const void *, const void *,
                                             const int32_t *, const float *, int, int, int);
template void cu_moe_combine_backward<bf16>(void *, float *, const void *, const void *,
                                            const int32_t *, const float *, int, int, int);
