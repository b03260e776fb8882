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
 * rmsnorm_rope_forward/_backward (q_norm/k_norm with the RoPE around them) are these vector kernels
 * with the rotation inside (template flag ROPE), for heads of D = 8·G elements, G = 4 .. 32: a
 * row's lanes hold one chunk each, and a chunk's RoPE partner (D/2 away) is one shuffle away
 * (rope.cuh, rope_rows_*). The forward rotates each normalised row, rounded to the compute dtype,
 * before its one store; the backward rotates each loaded dout row back, rounded, before the norm's
 * backward reads it. A block (a backward pass) keeps the angles of its rows' tokens in shared
 * memory. The results are the two ops' bits: the sums, trees, block split and dw partials are this
 * code, the angles and the rotation rope.cu's (rope_fill_angles, rope_rotate), and the products the
 * compiler could contract either way are spelled out with __fmul_rn / __fmaf_rn. Other head sizes,
 * or unaligned pointers, call the two ops. */
#include "rmsnorm.cuh"
#include "rope.cuh"

#include <type_traits>

enum { RN_WARPS = 8, DW_MAX_CHUNKS = 4096, RN_THREADS = 256 };

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

/* ---------------------------------------------------------------- vector path */

/* v[i] summed over the row group of G lanes, returned to each of them; every thread of the block
 * must call it, the same number of times. Past 32 lanes the warps of a group meet in shared memory
 * at their own named barrier (1 + group; 0 is __syncthreads), so groups do not wait for each
 * other. `red` is [2][RN_THREADS / 32][RPG]: successive calls alternate halves (`phase`), so a
 * warp can write the next sums while its partner still reads these (it cannot get two calls
 * ahead: the next barrier waits for the partner). */
template <int G, int RPG>
__device__ __forceinline__ void rn_group_sums(float (&v)[RPG], float *red, int &phase)
{
    if constexpr (G <= 32) {
#pragma unroll
        for (int i = 0; i < RPG; i++) v[i] = group_sum<G>(v[i]);
    } else {
        constexpr int WPG = G / 32;
        const int warp = threadIdx.x >> 5, first = warp / WPG * WPG;
        float *buf = red + phase * (RN_THREADS / 32 * RPG);
        phase ^= 1;
#pragma unroll
        for (int i = 0; i < RPG; i++) v[i] = warp_sum(v[i]);
        if ((threadIdx.x & 31) == 0)
#pragma unroll
            for (int i = 0; i < RPG; i++) buf[warp * RPG + i] = v[i];
        if constexpr (G == RN_THREADS)
            __syncthreads();
        else
            asm volatile("bar.sync %0, %1;" ::"r"(1 + (int)threadIdx.x / G), "r"(G) : "memory");
#pragma unroll
        for (int i = 0; i < RPG; i++) {
            float s = 0.0f;
#pragma unroll
            for (int q = 0; q < WPG; q++) s += buf[(first + q) * RPG + i];
            v[i] = s;
        }
    }
}

/* s / C. For C a power of two (Qwen3's hidden and head sizes) the product with 1/C (exact) is the
 * same correctly rounded quotient, without an IEEE division's ~10 instructions and branch a row:
 * these passes are issue-bound at the step's power-capped clock. */
__device__ __forceinline__ float rn_over_c(float s, int C)
{
    if ((C & (C - 1)) == 0) return __fmul_rn(s, __int_as_float((127 - (__ffs(C) - 1)) << 23));
    return s / (float)C;
}

/* ROPE: the token of row row0 + i from the one before (rows are [T, nh] heads), instead of a
 * division a row */
__device__ __forceinline__ void rn_next_row(int &tok, int &head, int nh)
{
    if (++head == nh) head = 0, tok++;
}

/* ROPE: each normalised row, rounded to the compute dtype, is rotated (rope.sign +1) before its
 * one store; a row's lanes then hold one chunk each (MC 1, G <= 32) */
template <typename T, int G, int MC, int RPG, bool ROPE>
__global__ void __launch_bounds__(RN_THREADS)
rmsnorm_fwd_vec_kernel(T *out, float *rstd, const T *in, const T *w, int N, int C, float eps,
                       rope_rows rope)
{
    pdl_wait(); /* first: launch.cuh */
    static_assert(!ROPE || (MC == 1 && G <= 32), "RoPE needs the row's chunks in one warp");
    __shared__ float red[2 * RN_THREADS / 32 * RPG];
    extern __shared__ float cs[]; /* ROPE: the angles of the block's tokens */
    int phase = 0;
    const int nch = C >> 3, lane = threadIdx.x & (G - 1);
    const int row0 = (blockIdx.x * (RN_THREADS / G) + threadIdx.x / G) * RPG;
    pack8<T> xv[RPG][MC];
#pragma unroll
    for (int i = 0; i < RPG; i++)
#pragma unroll
        for (int m = 0; m < MC; m++)
            if (row0 + i < N && lane + m * G < nch)
                xv[i][m] = ld8(in + (size_t)(row0 + i) * C + (lane + m * G) * 8);
    int t0 = 0; /* ROPE: cs's first token; the angles are computed while the loads fly */
    if constexpr (ROPE) {
        constexpr int rows = RN_THREADS / G * RPG;
        const int r0 = blockIdx.x * rows;
        t0 = rope_rows_angles<T>(cs, rope, r0, min(N, r0 + rows), C, RN_THREADS);
    }
    float ss[RPG];
#pragma unroll
    for (int i = 0; i < RPG; i++) {
        ss[i] = 0.0f;
#pragma unroll
        for (int m = 0; m < MC; m++)
            if (row0 + i < N && lane + m * G < nch) {
                float f[8];
                unpack8(xv[i][m], f);
#pragma unroll
                for (int e = 0; e < 8; e++) ss[i] += f[e] * f[e];
            }
    }
    rn_group_sums<G, RPG>(ss, red, phase);
    pack8<T> wv[MC];
#pragma unroll
    for (int m = 0; m < MC; m++)
        if (lane + m * G < nch) wv[m] = ld8(w + (lane + m * G) * 8);
    int tok = 0, head = 0; /* ROPE: row row0 + i's token and head */
    if constexpr (ROPE) tok = row0 / rope.nh, head = row0 - tok * rope.nh;
#pragma unroll
    for (int i = 0; i < RPG; i++) {
        if (ROPE && i > 0) rn_next_row(tok, head, rope.nh);
        if (row0 + i >= N) continue;
        const float r = 1.0f / sqrtf(rn_over_c(ss[i], C) + eps);
        if (lane == 0) rstd[row0 + i] = r;
#pragma unroll
        for (int m = 0; m < MC; m++) {
            const int c = lane + m * G;
            if (c >= nch) continue;
            float x[8], wf[8], y[8];
            unpack8(xv[i][m], x);
            unpack8(wv[m], wf);
#pragma unroll
            for (int e = 0; e < 8; e++) y[e] = wf[e] * round_x<T>(x[e] * r);
            if constexpr (ROPE) {
                const float *angles = cs + (tok - t0) * C;
                rope_rows_chunk<T, G>(y, pack8_of<T>(y), angles, lane);
            }
            store8f(out + (size_t)(row0 + i) * C + c * 8, y);
        }
    }
}

/* din = r·(g − n·mean(g ⊙ n)) with n = x·r, g = dout ⊙ w, over the block's rows [rows_per_block
 * from blockIdx.x·rows_per_block); partial[blockIdx.x] = Σ those rows' dout ⊙ n (when partial is
 * not NULL). Each lane reads its chunks of a row into registers before it writes any of them, so
 * din may alias dout or in. `din` NULL skips din. ROPE: dout is first rotated back (rope.sign −1)
 * and rounded to the compute dtype; a row's lanes hold one chunk each (MC 1, G <= 32), the partner
 * chunk comes from its lane's registers, so din may still alias dout. */
template <typename T, int G, int MC, int RPG, bool ROPE>
__global__ void __launch_bounds__(RN_THREADS)
rmsnorm_bwd_vec_kernel(T *din, float *partial, const T *dout, const T *in, const T *w,
                       const float *rstd, int N, int C, int rows_per_block, bool accumulate,
                       rope_rows rope)
{
    pdl_wait(); /* first: launch.cuh */
    static_assert(!ROPE || (MC == 1 && G <= 32), "RoPE needs the row's chunks in one warp");
    /* [C]: the block's partial; ROPE: then the angles of the tokens of a pass's rows */
    extern __shared__ float sh_dw[];
    __shared__ float red[2 * RN_THREADS / 32 * RPG];
    int phase = 0;
    constexpr int GROUPS = RN_THREADS / G;
    const int nch = C >> 3, lane = threadIdx.x & (G - 1), grp = threadIdx.x / G;
    const int r_begin = blockIdx.x * rows_per_block, r_end = min(N, r_begin + rows_per_block);
    pack8<T> wv[MC];
#pragma unroll
    for (int m = 0; m < MC; m++)
        if (lane + m * G < nch) wv[m] = ld8(w + (lane + m * G) * 8);
    float dwa[MC][8];
#pragma unroll
    for (int m = 0; m < MC; m++)
#pragma unroll
        for (int e = 0; e < 8; e++) dwa[m][e] = 0.0f;

    /* the trip count is the same for every thread: group sums may synchronise the block */
    for (int base = r_begin; base < r_end; base += GROUPS * RPG) {
        const int row0 = base + grp * RPG;
        pack8<T> dyv[RPG][MC], xv[RPG][MC];
        float r[RPG], gn[RPG];
#pragma unroll
        for (int i = 0; i < RPG; i++) {
            const bool ok = row0 + i < r_end;
            r[i] = ok ? rstd[row0 + i] : 0.0f;
#pragma unroll
            for (int m = 0; m < MC; m++)
                if (ok && lane + m * G < nch) {
                    const size_t at = (size_t)(row0 + i) * C + (lane + m * G) * 8;
                    dyv[i][m] = ld8(dout + at);
                    xv[i][m] = ld8(in + at);
                }
        }
        if constexpr (ROPE) {
            float *cs = sh_dw + C;
            const int t0 = rope_rows_angles<T>(cs, rope, base, min(r_end, base + GROUPS * RPG), C,
                                               RN_THREADS);
            int tok = row0 / rope.nh, head = row0 - tok * rope.nh;
#pragma unroll
            for (int i = 0; i < RPG; i++) {
                if (i > 0) rn_next_row(tok, head, rope.nh);
                if (row0 + i < r_end) {
                    float d[8];
                    rope_rows_chunk<T, G>(d, dyv[i][0], cs + (tok - t0) * C, lane);
                    dyv[i][0] = pack8_of<T>(d);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < RPG; i++) {
            gn[i] = 0.0f;
#pragma unroll
            for (int m = 0; m < MC; m++)
                if (row0 + i < r_end && lane + m * G < nch) {
                    float dy[8], x[8], wf[8];
                    unpack8(dyv[i][m], dy);
                    unpack8(xv[i][m], x);
                    unpack8(wv[m], wf);
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        gn[i] = __fmaf_rn(__fmul_rn(dy[e], wf[e]), __fmul_rn(x[e], r[i]), gn[i]);
                }
        }
        rn_group_sums<G, RPG>(gn, red, phase);
#pragma unroll
        for (int i = 0; i < RPG; i++) {
            if (row0 + i >= r_end) continue;
            const float proj = rn_over_c(gn[i], C);
#pragma unroll
            for (int m = 0; m < MC; m++) {
                const int c = lane + m * G;
                if (c >= nch) continue;
                float dy[8], x[8], wf[8], v[8];
                unpack8(dyv[i][m], dy);
                unpack8(xv[i][m], x);
                unpack8(wv[m], wf);
                if (din) {
                    T *dx = din + (size_t)(row0 + i) * C + c * 8;
                    float old[8];
                    if (accumulate) load8f(dx, old);
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        const float nc = __fmul_rn(x[e], r[i]);
                        v[e] = r[i] * __fmaf_rn(dy[e], wf[e], -__fmul_rn(nc, proj));
                        if (accumulate) v[e] = old[e] + v[e];
                    }
                    store8f(dx, v);
                }
                if (partial)
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        dwa[m][e] = __fmaf_rn(dy[e], __fmul_rn(x[e], r[i]), dwa[m][e]);
            }
        }
    }
    if (!partial) return;

    /* Fold the lanes that hold the same columns, in a fixed order: below 32 lanes per group first
     * across the groups of each warp (shuffles), then warp by warp (or group by group) into
     * shared memory. */
    if constexpr (G < 32) {
#pragma unroll
        for (int m = 0; m < MC; m++)
#pragma unroll
            for (int e = 0; e < 8; e++)
#pragma unroll
                for (int o = G; o < 32; o <<= 1)
                    dwa[m][e] += __shfl_xor_sync(0xffffffffu, dwa[m][e], o);
    }
    constexpr int UNITS = G < 32 ? RN_THREADS / 32 : GROUPS;
    const int unit = G < 32 ? (int)(threadIdx.x >> 5) : grp;
    const bool holder = G < 32 ? (int)(threadIdx.x & 31) < G : true;
    for (int u = 0; u < UNITS; u++) {
        if (unit == u && holder)
#pragma unroll
            for (int m = 0; m < MC; m++) {
                const int c = lane + m * G;
                if (c >= nch) continue;
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    float *s = sh_dw + c * 8 + e;
                    *s = (u == 0 ? 0.0f : *s) + dwa[m][e];
                }
            }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < C; c += RN_THREADS) partial[(size_t)blockIdx.x * C + c] = sh_dw[c];
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

/* The backward's blocks, each whole passes of rows_per_pass rows: about two blocks per SM, so few
 * partials to add and each block many rows */
static void rn_bwd_grid(int N, int rows_per_pass, int *nblocks, int *rows_per_block)
{
    const int nb = MT_MIN((N + rows_per_pass - 1) / rows_per_pass, 2 * g_cuda.num_sms);
    const int per = (N + nb - 1) / nb;
    *rows_per_block = (per + rows_per_pass - 1) / rows_per_pass * rows_per_pass;
    *nblocks = (N + *rows_per_block - 1) / *rows_per_block;
}

/* dw += the backward blocks' partials */
static void rn_dw_sum(float *dw, const float *partial, int nblocks, int C)
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

/* ---------------------------------------------------------------- with RoPE */

/* The head sizes of the fused kernels: D = 8·G with G = 4 .. 32 lanes (rn_vec_shape's layout for
 * them in both dtypes: one chunk a lane, no idle lanes) */
static bool rn_rope_shape(int D) { return D >= 32 && D <= 256 && (D & (D - 1)) == 0; }

/* the most tokens that `rows` consecutive rows of nh heads touch: the angle tables to hold */
static int rn_rope_tokens(int rows, int nh) { return MT_MIN(rows, (rows - 1) / nh + 2); }

/* Calls f(integral_constant G) for G = D / 8 of an rn_rope_shape head */
template <typename F> static void rn_rope_dispatch(int D, F &&f)
{
    using std::integral_constant;
    switch (D / 8) {
    case 4: return f(integral_constant<int, 4>{});
    case 8: return f(integral_constant<int, 8>{});
    case 16: return f(integral_constant<int, 16>{});
    case 32: return f(integral_constant<int, 32>{});
    }
    mt_fatal("rmsnorm rope: no kernel for head dim %d", D);
}

template <typename T>
void cu_rmsnorm_rope_forward(void *out, float *rstd, const void *in, const void *w,
                             const int32_t *pos, int T_, int nh, int D, float eps, float theta)
{
    MT_CHECK(T_ >= 0 && nh > 0 && D > 0, "rmsnorm rope: bad shape T=%d nh=%d D=%d", T_, nh, D);
    const int N = T_ * nh;
    if (!rn_rope_shape(D) || !aligned16(out) || !aligned16(in) || !aligned16(w)) {
        cu_rmsnorm_forward<T>(out, rstd, in, w, N, D, eps);
        cu_rope_forward<T>(out, out, pos, T_, nh, D, theta);
        return;
    }
    if (N == 0) return;
    const rope_rows rope = {pos, cu_rope_inv_freq(D, theta), nh, 1.0f};
    rn_rope_dispatch(D, [&](auto g) {
        constexpr int G_ = decltype(g)::value, RPG = 4, rows_per_block = RN_THREADS / G_ * RPG;
        const size_t smem = (size_t)rn_rope_tokens(rows_per_block, nh) * D * sizeof(float);
        cuda_launch(rmsnorm_fwd_vec_kernel<T, G_, 1, RPG, true>, (N + rows_per_block - 1) / rows_per_block,
            RN_THREADS, smem, (T *)out, rstd, (const T *)in, (const T *)w, N, D, eps, rope);
    });
    CUDA_LAUNCH_CHECK("rmsnorm rope forward");
}

template <typename T>
void cu_rmsnorm_rope_backward(void *din, float *dw, const void *dout, const void *in, const void *w,
                              const float *rstd, const int32_t *pos, int T_, int nh, int D,
                              float theta)
{
    MT_CHECK(T_ >= 0 && nh > 0 && D > 0, "rmsnorm rope backward: bad shape T=%d nh=%d D=%d", T_,
             nh, D);
    MT_CHECK(din && dw, "rmsnorm rope backward: din and dw are required");
    const int N = T_ * nh;
    if (!rn_rope_shape(D) || !aligned16(din) || !aligned16(dout) || !aligned16(in) ||
        !aligned16(w)) {
        cu_rope_backward<T>(din, dout, pos, T_, nh, D, theta);
        cu_rmsnorm_backward<T>(din, dw, din, in, w, rstd, N, D, false);
        return;
    }
    if (N == 0) return;
    const rope_rows rope = {pos, cu_rope_inv_freq(D, theta), nh, -1.0f};
    rn_rope_dispatch(D, [&](auto g) {
        constexpr int G_ = decltype(g)::value, RPG = 4, rows_per_pass = RN_THREADS / G_ * RPG;
        int nblocks, rows_per_block;
        rn_bwd_grid(N, rows_per_pass, &nblocks, &rows_per_block);
        float *partial = (float *)cuda_scratch(SCRATCH_REDUCE, (size_t)nblocks * D * sizeof(float));
        const size_t smem = (size_t)(1 + rn_rope_tokens(rows_per_pass, nh)) * D * sizeof(float);
        cuda_launch(rmsnorm_bwd_vec_kernel<T, G_, 1, RPG, true>, nblocks, RN_THREADS, smem,
            (T *)din, partial, (const T *)dout, (const T *)in, (const T *)w, rstd, N, D,
            rows_per_block, false, rope);
        CUDA_LAUNCH_CHECK("rmsnorm rope backward");
        rn_dw_sum(dw, partial, nblocks, D);
    });
}

template void cu_rmsnorm_forward<float>(void *, float *, const void *, const void *, int, int, float);
template void cu_rmsnorm_forward<bf16>(void *, float *, const void *, const void *, int, int, float);
template void cu_rmsnorm_backward<float>(void *, float *, const void *, const void *, const void *,
                                         const float *, int, int, bool);
template void cu_rmsnorm_backward<bf16>(void *, float *, const void *, const void *, const void *,
                                        const float *, int, int, bool);
template void cu_rmsnorm_rope_forward<float>(void *, float *, const void *, const void *,
                                              const int32_t *, int, int, int, float, float);
template void cu_rmsnorm_rope_forward<bf16>(void *, float *, const void *, const void *,
                                             const int32_t *, int, int, int, float, float);
template void cu_rmsnorm_rope_backward<float>(void *, float *, const void *, const void *,
                                               const void *, const float *, const int32_t *, int,
                                               int, int, float);
template void cu_rmsnorm_rope_backward<bf16>(void *, float *, const void *, const void *,
                                              const void *, const float *, const int32_t *, int,
                                              int, int, float);
