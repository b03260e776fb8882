/* Row gather and deterministic scatter-add (the MoE combine: moe_combine.cu).
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
 * Rows whose length is a multiple of 8 elements, with 16-byte aligned pointers, move as chunks of
 * 8 (16-byte accesses), one warp per row (per tile of sorted positions in the scatter), each lane holding up to RW_UNROLL chunks of the row in flight; other shapes
 * take the scalar kernels, one block per row. The sums are the same either way: each element is
 * added by one thread in the order above. */
#include "moe_rows.cuh"

#include <cub/device/device_radix_sort.cuh>

#include "env_flag.h"
#include "row_moves.cuh"

enum { SC_TILE = 8 };

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
