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
 * Combine. out[t] = Σ_j w[t,j]·y[slot_row[t,j]] in fp32, j ascending, rounded once. In bf16 the
 * routing weight is first rounded to bf16 (spec §3.6 step 5), in the forward and the backward
 * alike. Negative indices (never produced by moetrain) are skipped rather than read. */
#include "moe_rows.cuh"

#include <cub/device/device_radix_sort.cuh>

enum { ROW_BLOCK = 256 };

/* ---------------------------------------------------------------- gather */

template <typename T>
__global__ void gather_rows_kernel(T *out, const T *in, const int32_t *idx, int R, int H)
{
    for (int r = blockIdx.x; r < R; r += gridDim.x) {
        const int32_t src = idx[r];
        T *o = out + (size_t)r * H;
        if (src < 0) continue;
        const T *i = in + (size_t)src * H;
        for (int h = threadIdx.x; h < H; h += blockDim.x) o[h] = i[h];
    }
}

template <typename T> void cuda_gather_rows(T *out, const T *in, const int32_t *idx, int R, int H)
{
    MT_CHECK(R >= 0 && H >= 0, "gather_rows: bad shape R=%d H=%d", R, H);
    if (R == 0 || H == 0) return;
    gather_rows_kernel<T><<<MT_MIN(R, 65536), ROW_BLOCK, 0, g_cuda.stream>>>(out, in, idx, R, H);
    CUDA_LAUNCH_CHECK("gather_rows");
}

/* ---------------------------------------------------------------- scatter-add */

__global__ void iota_kernel(int32_t *v, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v[i] = i;
}

/* One block per sorted position p; only the first position of each run of equal destinations
 * works. */
template <typename Out, typename In>
__global__ void scatter_sorted_kernel(Out *dst, const In *src, const int32_t *keys,
                                      const int32_t *vals, int R, int H)
{
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

template <typename Out, typename In>
void cuda_scatter_add_rows(Out *dst, const In *src, const int32_t *idx, int R, int H)
{
    MT_CHECK(R >= 0 && H >= 0, "scatter-add rows: bad shape R=%d H=%d", R, H);
    if (R == 0 || H == 0) return;
    int32_t *keys = (int32_t *)cuda_scratch(SCRATCH_SORT_KEYS, (size_t)R * sizeof(int32_t));
    int32_t *vals = (int32_t *)cuda_scratch(SCRATCH_SORT_VALS, (size_t)2 * R * sizeof(int32_t));
    int32_t *vals_in = vals, *vals_out = vals + R;
    iota_kernel<<<cuda_grid(R, 256), 256, 0, g_cuda.stream>>>(vals_in, R);
    CUDA_LAUNCH_CHECK("scatter iota");
    size_t temp_bytes = 0;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, idx, keys, vals_in, vals_out, R,
                                               0, 32, g_cuda.stream));
    void *temp = cuda_scratch(SCRATCH_SORT_TEMP, temp_bytes);
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, idx, keys, vals_in, vals_out, R, 0,
                                               32, g_cuda.stream));
    scatter_sorted_kernel<Out, In><<<MT_MIN(R, 65536), ROW_BLOCK, 0, g_cuda.stream>>>(
        dst, src, keys, vals_out, R, H);
    CUDA_LAUNCH_CHECK("scatter rows");
}

/* ---------------------------------------------------------------- combine */

template <typename T>
__global__ void combine_fwd_kernel(T *out, const T *y, const int32_t *slot_row, const float *w,
                                   int T_, int k, int H)
{
    for (int t = blockIdx.x; t < T_; t += gridDim.x) {
        T *o = out + (size_t)t * H;
        for (int h = threadIdx.x; h < H; h += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < k; j++) {
                const int32_t r = slot_row[(size_t)t * k + j];
                if (r < 0) continue;
                acc += round_x<T>(w[(size_t)t * k + j]) * to_f(y[(size_t)r * H + h]);
            }
            o[h] = from_f<T>(acc);
        }
    }
}

/* dy[slot_row[t,j]] = w[t,j]·dout[t]; dw[t,j] = <dout[t], y[slot_row[t,j]]> (summed in double) */
template <typename T>
__global__ void combine_bwd_kernel(T *dy, float *dw, const T *dout, const T *y,
                                   const int32_t *slot_row, const float *w, int T_, int k, int H)
{
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

/* ---------------------------------------------------------------- the ops */

template <typename T> void cu_gather_rows(void *out, const void *in, const int32_t *idx, int R, int H)
{
    cuda_gather_rows<T>((T *)out, (const T *)in, idx, R, H);
}

template <typename T>
void cu_gather_rows_backward(void *din, const void *dout, const int32_t *idx, int R, int H)
{
    cuda_scatter_add_rows<T, T>((T *)din, (const T *)dout, idx, R, H);
}

template <typename T>
void cu_moe_combine_forward(void *out, const void *y, const int32_t *slot_row, const float *w,
                            int T_, int k, int H)
{
    MT_CHECK(T_ >= 0 && k > 0 && H >= 0, "moe_combine: bad shape T=%d k=%d H=%d", T_, k, H);
    if (T_ == 0 || H == 0) return;
    combine_fwd_kernel<T><<<MT_MIN(T_, 65536), ROW_BLOCK, 0, g_cuda.stream>>>(
        (T *)out, (const T *)y, slot_row, w, T_, k, H);
    CUDA_LAUNCH_CHECK("moe_combine forward");
}

template <typename T>
void cu_moe_combine_backward(void *dy, float *dw, const void *dout, const void *y,
                             const int32_t *slot_row, const float *w, int T_, int k, int H)
{
    MT_CHECK(T_ >= 0 && k > 0 && H >= 0, "moe_combine backward: bad shape T=%d k=%d H=%d", T_, k, H);
    if (T_ == 0) return;
    combine_bwd_kernel<T><<<MT_MIN(T_, 65536), ROW_BLOCK, 0, g_cuda.stream>>>(
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
template void cu_gather_rows_backward<float>(void *, const void *, const int32_t *, int, int);
template void cu_gather_rows_backward<bf16>(void *, const void *, const int32_t *, int, int);
template void cu_moe_combine_forward<float>(void *, const void *, const int32_t *, const float *,
                                            int, int, int);
template void cu_moe_combine_forward<bf16>(void *, const void *, const int32_t *, const float *, int,
                                           int, int);
template void cu_moe_combine_backward<float>(void *, float *, const void *, const void *,
                                             const int32_t *, const float *, int, int, int);
template void cu_moe_combine_backward<bf16>(void *, float *, const void *, const void *,
                                            const int32_t *, const float *, int, int, int);
