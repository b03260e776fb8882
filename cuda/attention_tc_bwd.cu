/* The tensor-core attention's backward: the prep kernel (delta, lse·log2 e), the mma.sync dK/dV and
 * dQ kernels, the choice between them and the wgmma passes of attention_tma_bwd.cu, tc_backward (what
 * attention_tc.cu's entry points call) and attention_tc_set_bwd_variant. How the kernels work:
 * attention_tc.cu's header comment. */
#include "attention_tc.cuh"
#include "attention_tc_launch.cuh"
#include "attention_parts.h"
#include "env_flag.h"

namespace {

/* delta[b,h,i] = Σ_d dO·O and lse2[b,h,i] = lse·log2(e) (both [B,Hq,S]); one warp per (b, i, h) */
__global__ void tc_bwd_prep_kernel(float *__restrict__ delta, float *__restrict__ lse2,
                                   const bf16 *__restrict__ dout, const bf16 *__restrict__ out,
                                   const float *__restrict__ lse, int B, int S, int Hq, int D)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (size_t)B * S * Hq) return;
    const __nv_bfloat162 *a = reinterpret_cast<const __nv_bfloat162 *>(dout + row * D);
    const __nv_bfloat162 *o = reinterpret_cast<const __nv_bfloat162 *>(out + row * D);
    float s = 0.0f;
    for (int d = lane; d < D / 2; d += 32) {
        const float2 x = __bfloat1622float2(a[d]), y = __bfloat1622float2(o[d]);
        s += x.x * y.x + x.y * y.y;
    }
    s = warp_sum(s);
    if (lane == 0) {
        const int h = (int)(row % Hq);
        const size_t bi = row / Hq;
        const int i = (int)(bi % S), b = (int)(bi / S);
        const size_t at = ((size_t)b * Hq + h) * S + i;
        delta[at] = s;
        lse2[at] = lse[at] * LOG2E;
    }
}

/* The same pass with 16-byte loads: D/8 lanes a row, each summing its 8 products before the
 * group's shuffle tree (another order than the kernel above: other low bits); a warp's rows are
 * consecutive queries of one (b, h), PREP_U of them a lane group, all loads issued first. The grid
 * (query blocks, B·Hq) gives each block its (b, h) without the per-row 64-bit divisions that made
 * the kernel above ALU-bound (Nsight Compute: 76% ALU, 34.5% of the DRAM peak), and delta and lse2 are stored
 * coalesced. */
enum { PREP_U = 2 };
template <int D>
__global__ void __launch_bounds__(256) tc_bwd_prep_vec_kernel(float *__restrict__ delta, float *__restrict__ lse2,
                                                              const bf16 *__restrict__ dout,
                                                              const bf16 *__restrict__ out,
                                                              const float *__restrict__ lse, int S, int Hq)
{
    pdl_wait(); /* first: launch.cuh */
    constexpr int CH = D / 8, RPW = 32 / CH, ROWS = 8 * RPW * PREP_U; /* rows a block */
    static_assert(D % 8 == 0 && 32 % CH == 0, "prep: D/8 lanes must divide a warp");
    const int bh = blockIdx.y, b = bh / Hq, h = bh - b * Hq;
    const int lane = threadIdx.x & 31, c = lane % CH;
    const int i0 = blockIdx.x * ROWS + (threadIdx.x >> 5) * RPW * PREP_U + lane / CH;
    float x[PREP_U][8], y[PREP_U][8];
#pragma unroll
    for (int u = 0; u < PREP_U; u++) {
        const int i = i0 + u * RPW;
        if (i >= S) continue;
        const size_t off = (((size_t)b * S + i) * Hq + h) * D + c * 8;
        load8f(dout + off, x[u]);
        load8f(out + off, y[u]);
    }
#pragma unroll
    for (int u = 0; u < PREP_U; u++) {
        const int i = i0 + u * RPW;
        float s = 0.0f;
        if (i < S)
#pragma unroll
            for (int e = 0; e < 8; e++) s += x[u][e] * y[u][e];
#pragma unroll
        for (int m = CH / 2; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
        if (c == 0 && i < S) {
            const size_t at = (size_t)bh * S + i;
            delta[at] = s;
            lse2[at] = lse[at] * LOG2E;
        }
    }
}

template <int D, bool DOCS>
__global__ void __launch_bounds__(TC_THREADS, 2)
tc_bwd_dkdv_kernel(bf16 *__restrict__ dk, bf16 *__restrict__ dv, const bf16 *__restrict__ dout,
                   const bf16 *__restrict__ q, const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                   const float *__restrict__ lse2, const float *__restrict__ delta, int S, int Hq,
                   int Hkv, float scale, float scale_log2, const int32_t *__restrict__ seg)
{
    pdl_wait(); /* first: launch.cuh */
    constexpr int BK = BWD_BR, BQ = TC_BC, LDS = D + 8, DB = D / 8;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16 *Ks = reinterpret_cast<bf16 *>(smem_raw);
    bf16 *Vs = Ks + BK * LDS;
    bf16 *Qs = Vs + BK * LDS;      /* [2][BQ][LDS] */
    bf16 *dOs = Qs + 2 * BQ * LDS; /* [2][BQ][LDS] */
    float *ls = reinterpret_cast<float *>(dOs + 2 * BQ * LDS); /* [2][BQ] lse·log2(e) */
    float *dls = ls + 2 * BQ;                                  /* [2][BQ] delta */

    const int kt = blockIdx.y, bhk = blockIdx.x;
    const int b = bhk / Hkv, hk = bhk - b * Hkv, group = Hq / Hkv;
    const int k0 = kt * BK;
    const int qt0 = k0 / BQ, nqt = (S + BQ - 1) / BQ, nper = nqt - qt0, n_it = group * nper;
    const size_t qstride = (size_t)Hq * D, kstride = (size_t)Hkv * D;
    const bf16 *kb = k + (size_t)b * S * kstride + (size_t)hk * D;
    const bf16 *vb = v + (size_t)b * S * kstride + (size_t)hk * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wk0 = warp * 16;     /* the warp's first key in the tile */
    const int wkey = k0 + wk0;     /* ... as a sequence position */

    /* iteration it covers query head hk·group + it / nper, query tile qt0 + it % nper */
    auto load_q_tile = [&](int it, int buf) {
        const int gi = it / nper, qt = qt0 + it - gi * nper, h = hk * group + gi;
        const size_t hoff = (size_t)b * S * qstride + (size_t)h * D;
        const size_t loff = ((size_t)b * Hq + h) * S;
        load_rows<BQ, D, TC_THREADS>(Qs + buf * BQ * LDS, q + hoff, qstride, qt * BQ, S);
        load_rows<BQ, D, TC_THREADS>(dOs + buf * BQ * LDS, dout + hoff, qstride, qt * BQ, S);
        load_floats<TC_THREADS>(ls + buf * BQ, lse2 + loff, qt * BQ, BQ, S);
        load_floats<TC_THREADS>(dls + buf * BQ, delta + loff, qt * BQ, BQ, S);
    };

    load_rows<BK, D, TC_THREADS>(Ks, kb, kstride, k0, S);
    load_rows<BK, D, TC_THREADS>(Vs, vb, kstride, k0, S);
    load_q_tile(0, 0);
    cp_async_commit();

    float dka[1][DB][4], dva[1][DB][4];
#pragma unroll
    for (int db = 0; db < DB; db++)
#pragma unroll
        for (int e = 0; e < 4; e++) dka[0][db][e] = dva[0][db][e] = 0.0f;

    for (int it = 0; it < n_it; it++) {
        const int buf = it & 1;
        if (it + 1 < n_it) load_q_tile(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        const int gi = it / nper, q0 = (qt0 + it - gi * nper) * BQ;
        if (q0 + BQ - 1 >= wkey) { /* else every query of the tile is before every key of the warp */
            const bf16 *Qt = Qs + buf * BQ * LDS, *dOt = dOs + buf * BQ * LDS;
            const float *lt = ls + buf * BQ, *dt = dls + buf * BQ;
            float st[1][8][4];
#pragma unroll
            for (int nb = 0; nb < 8; nb++) st[0][nb][0] = st[0][nb][1] = st[0][nb][2] = st[0][nb][3] = 0.0f;
            mm_abt<D, 1>(st, Ks, wk0, Qt, lane); /* Sᵀ[key][query] */

            const int32_t *sb = DOCS ? seg + (size_t)b * S : nullptr;
            const bool mask = DOCS || q0 < wkey + 15 || q0 + BQ > S;
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = nb * 8 + 2 * t + (e & 1);
                    float p = ex2(fmaf(st[0][nb][e], scale_log2, -lt[c]));
                    if (mask) {
                        const int key = wkey + g + ((e >> 1) << 3), qi = q0 + c;
                        /* qi < S and key <= qi keep both seg reads in bounds */
                        if (qi < key || qi >= S || (sb && sb[qi] != sb[key])) p = 0.0f;
                    }
                    st[0][nb][e] = p;
                }
            {
                uint32_t pa[1][4][4];
                pack_a<1>(pa, st);
                mm_pb<D, 1>(dva, pa, dOt, lane); /* dV += Pᵀ·dO */
            }

            float dpt[1][8][4];
#pragma unroll
            for (int nb = 0; nb < 8; nb++) dpt[0][nb][0] = dpt[0][nb][1] = dpt[0][nb][2] = dpt[0][nb][3] = 0.0f;
            mm_abt<D, 1>(dpt, Vs, wk0, dOt, lane); /* dPᵀ = V·dOᵀ */
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = nb * 8 + 2 * t + (e & 1);
                    st[0][nb][e] *= dpt[0][nb][e] - dt[c]; /* dSᵀ */
                }
            uint32_t sa[1][4][4];
            pack_a<1>(sa, st);
            mm_pb<D, 1>(dka, sa, Qt, lane); /* dK += dSᵀ·Q */
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = wkey + g + 8 * r;
        if (key >= S) continue;
        const size_t at = ((size_t)b * S + key) * kstride + (size_t)hk * D + 2 * t;
#pragma unroll
        for (int db = 0; db < DB; db++) {
            *reinterpret_cast<__nv_bfloat162 *>(dk + at + db * 8) =
                __floats2bfloat162_rn(dka[0][db][2 * r] * scale, dka[0][db][2 * r + 1] * scale);
            *reinterpret_cast<__nv_bfloat162 *>(dv + at + db * 8) =
                __floats2bfloat162_rn(dva[0][db][2 * r], dva[0][db][2 * r + 1]);
        }
    }
}

template <int D, bool DOCS>
__global__ void __launch_bounds__(TC_THREADS, 2)
tc_bwd_dq_kernel(bf16 *__restrict__ dq, const bf16 *__restrict__ dout, const bf16 *__restrict__ q,
                 const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                 const float *__restrict__ lse2, const float *__restrict__ delta, int S, int Hq,
                 int Hkv, float scale, float scale_log2, const int32_t *__restrict__ seg)
{
    pdl_wait(); /* first: launch.cuh */
    constexpr int BR = BWD_BR, BC = TC_BC, LDS = D + 8, DB = D / 8;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16 *Qs = reinterpret_cast<bf16 *>(smem_raw);
    bf16 *dOs = Qs + BR * LDS;
    bf16 *Ks = dOs + BR * LDS; /* [2][BC][LDS] */
    bf16 *Vs = Ks + 2 * BC * LDS;

    const int nqt = (S + BR - 1) / BR;
    const int qt = nqt - 1 - (int)blockIdx.y;
    const int bh = blockIdx.x, b = bh / Hq, h = bh - b * Hq, hk = h / (Hq / Hkv);
    const int q0 = qt * BR;
    const int nkt = (min(q0 + BR, S) - 1) / BC + 1;
    const size_t qstride = (size_t)Hq * D, kstride = (size_t)Hkv * D;
    const size_t qoff = (size_t)b * S * qstride + (size_t)h * D;
    const bf16 *kb = k + (size_t)b * S * kstride + (size_t)hk * D;
    const bf16 *vb = v + (size_t)b * S * kstride + (size_t)hk * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wr0 = warp * 16;
    const int wlast = q0 + wr0 + 15;

    load_rows<BR, D, TC_THREADS>(Qs, q + qoff, qstride, q0, S);
    load_rows<BR, D, TC_THREADS>(dOs, dout + qoff, qstride, q0, S);
    load_rows<BC, D, TC_THREADS>(Ks, kb, kstride, 0, S);
    load_rows<BC, D, TC_THREADS>(Vs, vb, kstride, 0, S);
    cp_async_commit();

    float lr[2], dr[2]; /* lse·log2(e) and delta of rows g and g+8 */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = q0 + wr0 + g + 8 * r;
        const size_t at = ((size_t)b * Hq + h) * S + row;
        lr[r] = row < S ? lse2[at] : 0.0f;
        dr[r] = row < S ? delta[at] : 0.0f;
    }
    float acc[1][DB][4];
#pragma unroll
    for (int db = 0; db < DB; db++) acc[0][db][0] = acc[0][db][1] = acc[0][db][2] = acc[0][db][3] = 0.0f;

    for (int j = 0; j < nkt; j++) {
        const int buf = j & 1;
        if (j + 1 < nkt) {
            load_rows<BC, D, TC_THREADS>(Ks + (buf ^ 1) * BC * LDS, kb, kstride, (j + 1) * BC, S);
            load_rows<BC, D, TC_THREADS>(Vs + (buf ^ 1) * BC * LDS, vb, kstride, (j + 1) * BC, S);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        const int k0 = j * BC;
        if (k0 <= wlast) {
            const bf16 *Kt = Ks + buf * BC * LDS, *Vt = Vs + buf * BC * LDS;
            float s[1][8][4], dp[1][8][4];
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[0][nb][e] = dp[0][nb][e] = 0.0f;
            mm_abt<D, 1>(s, Qs, wr0, Kt, lane);
            mm_abt<D, 1>(dp, dOs, wr0, Vt, lane);
            const int32_t *sb = DOCS ? seg + (size_t)b * S : nullptr;
            const bool mask = DOCS || k0 + BC - 1 > q0 + wr0 || k0 + BC > S;
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = e >> 1;
                    float p = ex2(fmaf(s[0][nb][e], scale_log2, -lr[r]));
                    if (mask) {
                        const int row = q0 + wr0 + g + 8 * r, col = k0 + nb * 8 + 2 * t + (e & 1);
                        if (col > row || col >= S || (sb && row < S && sb[row] != sb[col])) p = 0.0f;
                    }
                    s[0][nb][e] = p * (dp[0][nb][e] - dr[r]); /* dS */
                }
            uint32_t sa[1][4][4];
            pack_a<1>(sa, s);
            mm_pb<D, 1>(acc, sa, Kt, lane); /* dQ += dS·K */
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = q0 + wr0 + g + 8 * r;
        if (row >= S) continue;
        bf16 *dst = dq + ((size_t)b * S + row) * qstride + (size_t)h * D + 2 * t;
#pragma unroll
        for (int db = 0; db < DB; db++)
            *reinterpret_cast<__nv_bfloat162 *>(dst + db * 8) =
                __floats2bfloat162_rn(acc[0][db][2 * r] * scale, acc[0][db][2 * r + 1] * scale);
    }
}

/* Backward kernels: 0 = mma.sync (tc_bwd_dkdv_kernel / tc_bwd_dq_kernel), 1 = warp-specialised
 * wgmma (attention_tma_bwd.cu); chosen separately for the dK/dV and the dQ pass
 * (attention_tc_set_bwd_variant). The wgmma kernels need compute capability 9.0 (g_cuda.hopper;
 * MT_FORCE_SM80=1 takes variant 0 on a Hopper GPU too). All give the same bits.
 * H100, B=2 S=4096 Hq=32 Hkv=4, whole backward in ms (tools/bench_attention, tenth session):
 *   D = 128: dkdv/dq mma.sync 3.40, warp-specialised 1.54 (the cp.async wgmma kernels they
 *            replaced: 1.84, with one warp-specialised pass 1.71 / 1.67)
 *   D = 64:  mma.sync 1.98, warp-specialised 1.04 (cp.async wgmma 1.31) */
int g_bwd_dkdv = 1, g_bwd_dq = 1;
/* ATTN_BWD_DS: the warp-specialised passes with dS stored between them (attn_tma_bwd_ds), 5
 * products instead of 7 for 1 GiB of scratch at B=2 S=4096 Hq=32 (the caller's work or
 * SCRATCH_ATTN_DS). The default on Hopper. */
bool g_bwd_ds = true;

/* the prep pass: tc_bwd_prep_vec_kernel, or a warp a row (tc_bwd_prep_kernel) under
 * MT_ATTN_PREP=warp, for measuring */
static bool prep_vec(void)
{
    static int vec = -1;
    static const char *const kinds[] = {"vec", "warp"};
    if (vec < 0) vec = mt_env_choice("MT_ATTN_PREP", kinds, 2, 0) == 0;
    return vec;
}

/* the dK/dV pass's parts: 0 = attention_parts.h's rule; n = the largest count <= n that divides
 * the kv group (MT_ATTN_DKDV_PARTS=n, a benchmarking switch, or attention_tc_set_dkdv_parts);
 * -1 = the environment not read yet */
int g_dkdv_parts = -1;

/* the dQ-from-dS pass's CTAs (attn_bwd_args::dq_ctas); -2 = the environment not read yet:
 * MT_ATTN_DQ_BLOCKS=1 (a benchmarking switch) is -1, a CTA a block */
static int g_dq_ctas = -2;

static int dq_ctas(void)
{
    if (g_dq_ctas == -2) g_dq_ctas = mt_env_flag("MT_ATTN_DQ_BLOCKS") ? -1 : 0;
    return g_dq_ctas;
}

int dkdv_parts(int B, int S, int Hq, int Hkv)
{
    if (g_dkdv_parts < 0) g_dkdv_parts = (int)mt_env_positive("MT_ATTN_DKDV_PARTS", 0);
    if (g_dkdv_parts == 0) return attn_dkdv_parts(B, S, Hq, Hkv);
    int parts = g_dkdv_parts < Hq / Hkv ? g_dkdv_parts : Hq / Hkv;
    while ((Hq / Hkv) % parts) parts--;
    return parts;
}

template <int D, bool DOCS> void dkdv_mma_launch(const attn_bwd_args &a)
{
    static bool opted;
    smem_opt_in(tc_bwd_dkdv_kernel<D, DOCS>, dkdv_smem_bytes<D>(), &opted);
    const unsigned ntiles = (unsigned)((a.S + TC_BC - 1) / TC_BC);
    cuda_launch(tc_bwd_dkdv_kernel<D, DOCS>, dim3((unsigned)(a.B * a.Hkv), ntiles), TC_THREADS,
        dkdv_smem_bytes<D>(), a.dk, a.dv, a.dout, a.q, a.k, a.v, a.lse2, a.delta, a.S, a.Hq, a.Hkv, a.scale,
        a.scale_log2, a.seg);
    CUDA_LAUNCH_CHECK("attention tc backward dk dv");
}

template <int D, bool DOCS> void dq_mma_launch(const attn_bwd_args &a)
{
    static bool opted;
    smem_opt_in(tc_bwd_dq_kernel<D, DOCS>, dq_smem_bytes<D>(), &opted);
    const unsigned ntiles = (unsigned)((a.S + TC_BC - 1) / TC_BC);
    cuda_launch(tc_bwd_dq_kernel<D, DOCS>, dim3((unsigned)(a.B * a.Hq), ntiles), TC_THREADS,
        dq_smem_bytes<D>(), a.dq, a.dout, a.q, a.k, a.v, a.lse2, a.delta, a.S, a.Hq, a.Hkv, a.scale,
        a.scale_log2, a.seg);
    CUDA_LAUNCH_CHECK("attention tc backward dq");
}

template <int D> void dkdv_launch(const attn_bwd_args &a, int variant)
{
    if (a.seg) dkdv_mma_launch<D, true>(a);
    else if (variant == 1) attn_tma_dkdv(a, D);
    else dkdv_mma_launch<D, false>(a);
}

template <int D> void dq_launch(const attn_bwd_args &a, int variant)
{
    if (a.seg) dq_mma_launch<D, true>(a);
    else if (variant == 1) attn_tma_dq(a, D);
    else dq_mma_launch<D, false>(a);
}

template <int D>
void tc_bwd_launch(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                   const void *v, const void *out, const float *lse, int B, int S, int Hq, int Hkv,
                   const int32_t *seg, void *work, size_t work_bytes)
{
    const float scale = tc_scale(D);
    const size_t rows = (size_t)B * S * Hq;
    float *delta = (float *)cuda_scratch(SCRATCH_ATTN, 2 * rows * sizeof(float));
    float *lse2 = delta + rows;
    constexpr int PREP_ROWS = 8 * (256 / D) * PREP_U; /* tc_bwd_prep_vec_kernel's rows a block */
    if (prep_vec() && (size_t)B * Hq <= 65535 && aligned16(dout) && aligned16(out))
        cuda_launch(tc_bwd_prep_vec_kernel<D>, dim3((unsigned)((S + PREP_ROWS - 1) / PREP_ROWS), (unsigned)(B * Hq)),
            256, 0, delta, lse2, (const bf16 *)dout, (const bf16 *)out, lse, S, Hq);
    else
        cuda_launch(tc_bwd_prep_kernel, (unsigned)((rows + 7) / 8), 256, 0,
            delta, lse2, (const bf16 *)dout, (const bf16 *)out, lse, B, S, Hq, D);
    CUDA_LAUNCH_CHECK("attention tc backward prep");
    const attn_bwd_args a = {(bf16 *)dq, (bf16 *)dk, (bf16 *)dv, (const bf16 *)dout, (const bf16 *)q,
                        (const bf16 *)k, (const bf16 *)v, lse2, delta, B, S, Hq, Hkv, scale,
                        scale * LOG2E, seg, nullptr};
    /* the sm_80 path takes mma.sync (variant 0); documents (a.seg) do too: the wgmma kernels know
     * only the causal mask */
    const bool wg = g_cuda.hopper;
    const bool tma_dkdv = wg && !seg && (g_bwd_ds || g_bwd_dkdv == 1);
    attn_bwd_args ad = a;
    size_t lent = 0; /* bytes of work taken */
    if (wg && g_bwd_ds && !seg) {
        const size_t need = attn_ds_bytes(B, S, Hq);
        if (work && work_bytes >= need) ad.ds = (bf16 *)work, lent = need;
        else ad.ds = (bf16 *)cuda_scratch(SCRATCH_ATTN_DS, need);
    }
    ad.dq_ctas = dq_ctas();
    if (tma_dkdv) {
        ad.dkdv_split = dkdv_parts(B, S, Hq, Hkv);
        const size_t need = (size_t)attn_dkdv_part_bytes(B, S, Hkv, D, ad.dkdv_split);
        if (need && work && work_bytes >= lent + need) ad.dkdv_part = (float *)((char *)work + lent);
        else if (need) ad.dkdv_part = (float *)cuda_scratch(SCRATCH_ATTN_DKDV, need);
    }
    if (ad.ds) {
        attn_tma_bwd_ds(ad, D);
        return;
    }
    dkdv_launch<D>(ad, wg ? g_bwd_dkdv : 0);
    dq_launch<D>(ad, wg ? g_bwd_dq : 0);
}

} /* namespace */

/* The backward with optional document ids (seg [B,S] or nullptr: then the mma.sync kernels). */
bool tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                 const void *v, const void *out, const float *lse, int B, int S, int Hq, int Hkv,
                 int D, const int32_t *seg, void *work, size_t work_bytes)
{
    const void *ptrs[] = {dq, dk, dv, dout, q, k, v, out};
    if (!tc_handles(B, S, Hq, Hkv, D, ptrs, 8)) return false;
    if (B == 0 || S == 0) return true;
    if (D == 128) tc_bwd_launch<128>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, seg, work, work_bytes);
    else tc_bwd_launch<64>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, seg, work, work_bytes);
    return true;
}

extern "C" int attention_tc_set_bwd_variant(int variant)
{
    const int old = g_bwd_ds ? ATTN_BWD_DS : g_bwd_dkdv + ATTN_BWD_KINDS * g_bwd_dq;
    if (variant == ATTN_BWD_DS) {
        g_bwd_ds = true;
    } else if (variant >= 0 && variant < ATTN_BWD_KINDS * ATTN_BWD_KINDS) {
        g_bwd_ds = false;
        g_bwd_dkdv = variant % ATTN_BWD_KINDS, g_bwd_dq = variant / ATTN_BWD_KINDS;
    }
    return old;
}

extern "C" int attention_tc_set_dq_ctas(int ctas)
{
    const int old = dq_ctas();
    g_dq_ctas = ctas < -1 ? -1 : ctas;
    return old;
}

extern "C" int attention_tc_set_dkdv_parts(int parts)
{
    const int old = g_dkdv_parts;
    g_dkdv_parts = parts;
    return old;
}

extern "C" size_t attention_tc_ds_bytes(int B, int S, int Hq) { return attn_ds_bytes(B, S, Hq); }
