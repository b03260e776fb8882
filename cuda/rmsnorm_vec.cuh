/* The vector path of the RMSNorm kernels (rmsnorm.cu says how it works): the row-group sums and
 * the forward and backward kernels, shared by rmsnorm.cu's plain launches and rmsnorm_rope.cu's
 * q_norm/k_norm with the RoPE inside (template flag ROPE). */
#ifndef MT_CUDA_RMSNORM_VEC_CUH
#define MT_CUDA_RMSNORM_VEC_CUH

#include "cuda_common.cuh"
#include "rope.cuh"

enum { RN_WARPS = 8, DW_MAX_CHUNKS = 4096, RN_THREADS = 256 };

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

/* The backward's blocks, each whole passes of rows_per_pass rows: about two blocks per SM, so few
 * partials to add and each block many rows */
static inline void rn_bwd_grid(int N, int rows_per_pass, int *nblocks, int *rows_per_block)
{
    const int nb = MT_MIN((N + rows_per_pass - 1) / rows_per_pass, 2 * g_cuda.num_sms);
    const int per = (N + nb - 1) / nb;
    *rows_per_block = (per + rows_per_pass - 1) / rows_per_pass * rows_per_pass;
    *nblocks = (N + *rows_per_block - 1) / *rows_per_block;
}

/* dw += the backward blocks' partials (column_sum_f32_kernel, rmsnorm.cu) */
void rn_dw_sum(float *dw, const float *partial, int nblocks, int C);

#endif
