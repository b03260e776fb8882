/* RMSNorm: one warp per row; the mean square and the backward projection sum in double and are
 * rounded to float once, as in src/cpu/cpu_rmsnorm.c. In bf16 the normalised value is rounded to
 * bf16 before the weight multiply (spec §3.2 step 5); in fp32 that rounding is a no-op.
 *
 * The weight gradient is a column sum over rows: fixed chunks of rows give per-chunk partials
 * (double), then one pass adds the chunks in order into dw, so the result is deterministic. */
#include "rmsnorm.cuh"

enum { RN_WARPS = 8, DW_MAX_CHUNKS = 4096 };

template <typename T>
__global__ void rmsnorm_fwd_kernel(T *out, float *rstd, const T *in, const T *w, int N, int C,
                                   float eps)
{
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
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
        double s = 0.0;
        for (int k = 0; k < nchunks; k++) s += partial[(size_t)k * C + c];
        dst[c] += (float)s;
    }
}

void cuda_add_column_partials(float *dst, const double *partial, int nchunks, int C)
{
    column_partials_add_kernel<<<(C + 255) / 256, 256, 0, g_cuda.stream>>>(dst, partial, nchunks, C);
    CUDA_LAUNCH_CHECK("column partials add");
}

template <typename T>
void cu_rmsnorm_forward(void *out, float *rstd, const void *in, const void *w, int N, int C,
                        float eps)
{
    MT_CHECK(C > 0 && N >= 0, "rmsnorm: bad shape N=%d C=%d", N, C);
    if (N == 0) return;
    rmsnorm_fwd_kernel<T><<<(N + RN_WARPS - 1) / RN_WARPS, 32 * RN_WARPS, 0, g_cuda.stream>>>(
        (T *)out, rstd, (const T *)in, (const T *)w, N, C, eps);
    CUDA_LAUNCH_CHECK("rmsnorm forward");
}

template <typename T>
void cu_rmsnorm_backward(void *din, float *dw, const void *dout, const void *in, const void *w,
                         const float *rstd, int N, int C, bool accumulate)
{
    MT_CHECK(C > 0 && N >= 0, "rmsnorm backward: bad shape N=%d C=%d", N, C);
    if (N == 0) return;
    if (dw) {
        /* before the din kernel: din may alias dout or in */
        const int rows_per_chunk = MT_MAX(256, (N + DW_MAX_CHUNKS - 1) / DW_MAX_CHUNKS);
        const int nchunks = (N + rows_per_chunk - 1) / rows_per_chunk;
        double *partial = (double *)cuda_scratch(SCRATCH_REDUCE, (size_t)nchunks * C * sizeof(double));
        rmsnorm_dw_partial_kernel<T><<<dim3((C + 31) / 32, nchunks), dim3(32, 8), 0, g_cuda.stream>>>(
            partial, (const T *)dout, (const T *)in, rstd, N, C, rows_per_chunk);
        CUDA_LAUNCH_CHECK("rmsnorm dw partial");
        cuda_add_column_partials(dw, partial, nchunks, C);
    }
    if (din) {
        rmsnorm_bwd_kernel<T><<<(N + RN_WARPS - 1) / RN_WARPS, 32 * RN_WARPS, 0, g_cuda.stream>>>(
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
