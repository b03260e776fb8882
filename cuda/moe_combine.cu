/* The MoE combine: out[t] = Σ_j w[t,j]·y[slot_row[t,j]] in fp32, j ascending, rounded once (with
 * the residual added after, as add_inplace would), and its backward: dy[slot_row[t,j]] =
 * w[t,j]·dout[t] and dw[t,j] = <dout[t], y[slot_row[t,j]]>. In bf16 the routing weight is first
 * rounded to bf16 (spec §3.6 step 5), in the forward and the backward alike. Negative indices
 * (never produced by moetrain) are skipped rather than read.
 *
 * Rows whose length is a multiple of 8 elements, with 16-byte aligned pointers, take the kernels
 * with a warp per token (row_moves.cuh); other shapes the scalar ones, a block per token. Each
 * element is summed by one thread in the same order either way. */
#include "moe_rows.cuh"

#include "env_flag.h"
#include "row_moves.cuh"

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

/* ---------------------------------------------------------------- the ops */

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

template void cu_moe_combine_forward<float>(void *, const void *, const int32_t *, const float *,
                                            const void *, int, int, int);
template void cu_moe_combine_forward<bf16>(void *, const void *, const int32_t *, const float *,
                                           const void *, int, int, int);
template void cu_moe_combine_backward<float>(void *, float *, const void *, const void *,
                                             const int32_t *, const float *, int, int, int);
template void cu_moe_combine_backward<bf16>(void *, float *, const void *, const void *,
                                            const int32_t *, const float *, int, int, int);
