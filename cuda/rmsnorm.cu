/* RMSNorm. In bf16 the normalised value is rounded to bf16 before the weight multiply (spec §3.2
 * step 5); in fp32 that rounding is a no-op.
 *
 * Vector path (C a multiple of 8, 16-byte aligned pointers, C up to 8192 in bf16 / 4096 in fp32):
 * a group of G lanes owns a row (G a power of two, 4 to 256; past 32 the group spans warps and
 * sums through shared memory), each lane holding MC chunks of 8 elements (chunk lane + m·G) in
 * registers, RPG rows at a time, so every row is read once. The mean square and the backward
 * projection sum in fp32 (per lane, then a fixed shuffle tree): a few ulp from the CPU's double
 * sums, far inside the tests' tolerances, and the same bits on every run.
 *
 * The weight gradient is a column sum over rows. The backward kernel adds dout ⊙ (x·rstd) into
 * per-lane fp32 registers while it computes din (dout and in are read once for both), the block
 * folds its lanes in a fixed order into one partial row, and a last kernel adds the partials in
 * ascending block order (in double) into dw: deterministic, no atomics. The block count depends
 * only on N and the device's SM count.
 *
 * Other shapes take the scalar path: one warp per row, double sums, and dw through per-chunk
 * double partials computed before din (din may alias dout or in).
 *
 * The vector kernels are in rmsnorm_vec.cuh, q_norm/k_norm with the RoPE inside in
 * rmsnorm_rope.cu. */
#include "rmsnorm.cuh"
#include "rmsnorm_vec.cuh"

#include <type_traits>

template <typename T>
__global__ void rmsnorm_fwd_kernel(T *out, float *rstd, const T *in, const T *w, int N, int C,
                                   float eps)
{
    pdl_wait(); /* first: launch.cuh */
    const int row = blockIdx.x * RN_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return; /* whole warps only: no block barrier below */
    const T *x = in + (size_t)row * C;
    T *y = out + (size_t)row * C;
    double ss = 0.0;
    for (int c = lane; c < C; c += 32) {
        const float v = to_f(x[c]);
        ss += (double)v * v;
    }
    ss = warp_sum(ss);
    const float var = (float)(ss / C);
    const float r = 1.0f / sqrtf(var + eps);
    if (lane == 0) rstd[row] = r;
    for (int c = lane; c < C; c += 32) y[c] = from_f<T>(to_f(w[c]) * round_x<T>(to_f(x[c]) * r));
}

/* din = r·(g − n·mean(g ⊙ n)) with n = x·r, g = dout ⊙ w. The warp reads its whole row (the
 * shuffle reduction is a warp barrier) before any lane writes, so din may alias dout or in. */
template <typename T>
__global__ void rmsnorm_bwd_kernel(T *din, const T *dout, const T *in, const T *w, const float *rstd,
                                   int N, int C, bool accumulate)
{
    pdl_wait(); /* first: launch.cuh */
    const int row = blockIdx.x * RN_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const T *x = in + (size_t)row * C, *dy = dout + (size_t)row * C;
    T *dx = din + (size_t)row * C;
    const float r = rstd[row];
    double gn = 0.0;
    for (int c = lane; c < C; c += 32) {
        const float nc = to_f(x[c]) * r;
        gn += (double)(to_f(dy[c]) * to_f(w[c])) * nc;
    }
    gn = warp_sum(gn);
    const float proj = (float)(gn / C);
    for (int c = lane; c < C; c += 32) {
        const float nc = to_f(x[c]) * r;
        const float v = r * (to_f(dy[c]) * to_f(w[c]) - nc * proj);
        dx[c] = from_f<T>(accumulate ? to_f(dx[c]) + v : v);
    }
}

/* partial[chunk, c] = Σ over the chunk's rows of dout ⊙ (x·rstd); block (32 columns × 8 rows) */
template <typename T>
__global__ void rmsnorm_dw_partial_kernel(double *partial, const T *dout, const T *in,
                                          const float *rstd, int N, int C, int rows_per_chunk)
{
    pdl_wait(); /* first: launch.cuh */
    __shared__ double sh[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const int r0 = blockIdx.y * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    double acc = 0.0;
    if (c < C)
        for (int n = r0 + threadIdx.y; n < r1; n += 8) {
            const size_t i = (size_t)n * C + c;
            acc += (double)(to_f(dout[i]) * (to_f(in[i]) * rstd[n]));
        }
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        double s = 0.0;
        for (int k = 0; k < 8; k++) s += sh[k][threadIdx.x];
        partial[(size_t)blockIdx.y * C + c] = s;
    }
}

__global__ void column_partials_add_kernel(float *dst, const double *partial, int nchunks, int C)
{
    pdl_wait(); /* first: launch.cuh */
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
        double s = 0.0;
        for (int k = 0; k < nchunks; k++) s += partial[(size_t)k * C + c];
        dst[c] += (float)s;
    }
}

void cuda_add_column_partials(float *dst, const double *partial, int nchunks, int C)
{
    cuda_launch(column_partials_add_kernel, (C + 255) / 256, 256, 0, dst, partial, nchunks, C);
    CUDA_LAUNCH_CHECK("column partials add");
}

/* dst[c] += Σ_b partial[b, c]: 32 fixed strided runs of b summed in double, then the 32 in order */
__global__ void column_sum_f32_kernel(float *dst, const float *partial, int nparts, int C)
{
    pdl_wait(); /* first: launch.cuh */
    __shared__ double sh[32][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    double s = 0.0;
    if (c < C)
        for (int b = threadIdx.y; b < nparts; b += 32) s += partial[(size_t)b * C + c];
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        double t = 0.0;
        for (int k = 0; k < 32; k++) t += sh[k][threadIdx.x];
        dst[c] += (float)t;
    }
}

/* The vector path's layout for rows of C elements: MC chunks per lane, at most 64 bytes of a row
 * tensor per lane (4 chunks in bf16, 2 in fp32), over the fewest lanes G. false: scalar path. */
template <typename T> static bool rn_vec_shape(int C, int *G, int *MC)
{
    if (C % 8) return false;
    const int nch = C / 8, maxc = sizeof(T) == 2 ? 4 : 2;
    int g = 4;
    if (nch <= 32) {
        while (g < nch) g <<= 1;
        *G = g, *MC = 1;
        return true;
    }
    if (nch <= 32 * maxc) {
        *G = 32, *MC = nch <= 64 ? 2 : maxc;
        return true;
    }
    for (g = 64; g * maxc < nch; g <<= 1) {}
    if (g > RN_THREADS) return false;
    *G = g, *MC = maxc;
    return true;
}

/* Calls f(integral_constant G, integral_constant MC) for the shapes rn_vec_shape can return */
template <typename F> static void rn_dispatch(int G, int MC, F &&f)
{
    using std::integral_constant;
#define RN_CASE(g, mc)                                                                              \
    if (G == g && MC == mc) return f(integral_constant<int, g>{}, integral_constant<int, mc>{});
    RN_CASE(4, 1) RN_CASE(8, 1) RN_CASE(16, 1) RN_CASE(32, 1)
    RN_CASE(32, 2) RN_CASE(64, 2) RN_CASE(128, 2) RN_CASE(256, 2)
    RN_CASE(32, 4) RN_CASE(64, 4) RN_CASE(128, 4) RN_CASE(256, 4)
#undef RN_CASE
    mt_fatal("rmsnorm: no kernel for G=%d MC=%d", G, MC);
}

/* dw += the backward blocks' partials */
void rn_dw_sum(float *dw, const float *partial, int nblocks, int C)
{
    const dim3 grid((C + 31) / 32), block(32, 32);
    cuda_launch(column_sum_f32_kernel, grid, block, 0, dw, partial, nblocks, C);
    CUDA_LAUNCH_CHECK("rmsnorm dw sum");
}

template <typename T>
void cu_rmsnorm_forward(void *out, float *rstd, const void *in, const void *w, int N, int C,
                        float eps)
{
    MT_CHECK(C > 0 && N >= 0, "rmsnorm: bad shape N=%d C=%d", N, C);
    if (N == 0) return;
    int G, MC;
    if (rn_vec_shape<T>(C, &G, &MC) && aligned16(out) && aligned16(in) && aligned16(w)) {
        rn_dispatch(G, MC, [&](auto g, auto mc) {
            constexpr int G_ = decltype(g)::value, MC_ = decltype(mc)::value, RPG = 4 / MC_;
            constexpr int rows_per_block = RN_THREADS / G_ * RPG;
            cuda_launch(rmsnorm_fwd_vec_kernel<T, G_, MC_, RPG, false>,
                (N + rows_per_block - 1) / rows_per_block, RN_THREADS, 0, (T *)out, rstd, (const T *)in,
                (const T *)w, N, C, eps, rope_rows{});
        });
        CUDA_LAUNCH_CHECK("rmsnorm forward");
        return;
    }
    cuda_launch(rmsnorm_fwd_kernel<T>, (N + RN_WARPS - 1) / RN_WARPS, 32 * RN_WARPS, 0,
        (T *)out, rstd, (const T *)in, (const T *)w, N, C, eps);
    CUDA_LAUNCH_CHECK("rmsnorm forward");
}

template <typename T>
void cu_rmsnorm_backward(void *din, float *dw, const void *dout, const void *in, const void *w,
                         const float *rstd, int N, int C, bool accumulate)
{
    MT_CHECK(C > 0 && N >= 0, "rmsnorm backward: bad shape N=%d C=%d", N, C);
    if (N == 0 || (!din && !dw)) return;
    int G, MC;
    if (rn_vec_shape<T>(C, &G, &MC) && (!din || aligned16(din)) && aligned16(dout) &&
        aligned16(in) && aligned16(w)) {
        rn_dispatch(G, MC, [&](auto g, auto mc) {
            constexpr int G_ = decltype(g)::value, MC_ = decltype(mc)::value, RPG = 4 / MC_;
            int nblocks, rows_per_block;
            rn_bwd_grid(N, RN_THREADS / G_ * RPG, &nblocks, &rows_per_block);
            float *partial =
                dw ? (float *)cuda_scratch(SCRATCH_REDUCE, (size_t)nblocks * C * sizeof(float)) : NULL;
            cuda_launch(rmsnorm_bwd_vec_kernel<T, G_, MC_, RPG, false>, nblocks, RN_THREADS,
                dw ? (size_t)C * sizeof(float) : 0, (T *)din, partial, (const T *)dout, (const T *)in,
                (const T *)w, rstd, N, C, rows_per_block, accumulate, rope_rows{});
            CUDA_LAUNCH_CHECK("rmsnorm backward");
            if (dw) rn_dw_sum(dw, partial, nblocks, C);
        });
        return;
    }
    if (dw) {
        /* before the din kernel: din may alias dout or in */
        const int rows_per_chunk = MT_MAX(256, (N + DW_MAX_CHUNKS - 1) / DW_MAX_CHUNKS);
        const int nchunks = (N + rows_per_chunk - 1) / rows_per_chunk;
        double *partial = (double *)cuda_scratch(SCRATCH_REDUCE, (size_t)nchunks * C * sizeof(double));
        cuda_launch(rmsnorm_dw_partial_kernel<T>, dim3((C + 31) / 32, nchunks), dim3(32, 8), 0,
            partial, (const T *)dout, (const T *)in, rstd, N, C, rows_per_chunk);
        CUDA_LAUNCH_CHECK("rmsnorm dw partial");
        cuda_add_column_partials(dw, partial, nchunks, C);
    }
    if (din) {
        cuda_launch(rmsnorm_bwd_kernel<T>, (N + RN_WARPS - 1) / RN_WARPS, 32 * RN_WARPS, 0,
            (T *)din, (const T *)dout, (const T *)in, (const T *)w, rstd, N, C, accumulate);
        CUDA_LAUNCH_CHECK("rmsnorm backward");
    }
}

template void cu_rmsnorm_forward<float>(void *, float *, const void *, const void *, int, int, float);
template void cu_rmsnorm_forward<bf16>(void *, float *, const void *, const void *, int, int, float);
template void cu_rmsnorm_backward<float>(void *, float *, const void *, const void *, const void *,
                                         const float *, int, int, bool);
template void cu_rmsnorm_backward<bf16>(void *, float *, const void *, const void *, const void *,
                                        const float *, int, int, bool);
