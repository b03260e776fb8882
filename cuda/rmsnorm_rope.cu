/* RMSNorm with the RoPE around it: ops.h's rmsnorm_rope_forward / _backward (q_norm/k_norm) are
 * rmsnorm_vec.cuh's vector kernels with the rotation inside (template flag ROPE), for heads of
 * D = 8·G elements, G = 4 .. 32: a row's lanes hold one chunk each, and a chunk's RoPE partner
 * (D/2 away) is one shuffle away (rope.cuh, rope_rows_*). The forward rotates each normalised
 * row, rounded to the compute dtype, before its one store; the backward rotates each loaded dout
 * row back, rounded, before the norm's backward reads it. A block (a backward pass) keeps the
 * angles of its rows' tokens in shared memory. The results are the two ops' bits: the sums, trees,
 * block split and dw partials are the vector kernels', the angles and the rotation rope.cu's
 * (rope_fill_angles, rope_rotate), and the products the compiler could contract either way are
 * spelled out with __fmul_rn / __fmaf_rn. Other head sizes, or unaligned pointers, call the two
 * ops. */
#include "rmsnorm.cuh"
#include "rmsnorm_vec.cuh"

#include <type_traits>

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
