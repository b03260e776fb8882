/* The attention backward's two passes (dK/dV and dQ) on the Hopper warpgroup MMA (sm_90a); the
 * forward is in attention_tc_fwd.cu, the mma.sync backward and the launch choice in
 * attention_tc_bwd.cu, the entry points in attention_tc.cu. */
#include "attention_wgmma.cuh"

#include <type_traits>

namespace {

/* ---------------------------------------------------------------- backward on wgmma (sm_90a)
 * The same two passes as above on the warpgroup MMA, which reads its B operand (and in the
 * SS form its A operand too) straight from shared memory once per warpgroup instead of once per
 * warp through ldmatrix. In the mma.sync kernels above each 512-byte ldmatrix.x4 of Q/dO/K/V
 * feeds only two mma (16 keys or rows a warp: two sets of dK/dV accumulators of 32 rows would
 * not fit in registers), about 0.55 ldmatrix per mma, which by our count puts them at the
 * shared-memory bandwidth limit; a wgmma m64nNk16 shares each operand read among 4 warps.
 *
 * Tiles: bf16 rows of one head in the layout of wgmma's 128-byte-swizzle descriptors: D/64 boxes
 * of R rows × 64 columns (128 B a row; box after box, R·128 B apart), 16-byte chunk c of row r
 * stored at chunk c ^ (r & 7), everything 1024-aligned. One such [rows][D] tile is both a K-major
 * operand (k = D: Q·Kᵀ, K·Qᵀ, V·dOᵀ; 8-row groups SBO = 1024 B apart, a k step of 16 is +32 B
 * inside a box) and an MN-major one (k = rows: Pᵀ·dO, dSᵀ·Q, dS·K; boxes LBO = R·128 B apart
 * along D, a k step of 16 rows is +2048 B) — the conventions grouped_gemm.cu uses and tests.
 * Each warpgroup owns 64 rows of the output (keys for dK/dV, queries for dQ): the scores Sᵀ (or S)
 * and dPᵀ come from SS wgmma m64n64k16 into the accumulator layout of mma.sync (warp w of the
 * group: rows 16w + g, 16w + g + 8, columns 8j + 2t, 2t+1), which packed to bf16 is the register
 * A operand of the RS wgmma m64nDk16 that follows (Pᵀ·dO, dSᵀ·Q, dS·K), as with mma.sync.
 *
 * Per tile of one warpgroup: issue Sᵀ and dPᵀ (two commit groups), wait for Sᵀ, exponentiate
 * while dPᵀ runs, issue dV += Pᵀ·dO, wait for dPᵀ, form dSᵀ while dV runs, issue dK += dSᵀ·Q.
 * Operand tiles are cp.async'd STAGES deep: tile i+1 is loaded while tile i is used; with 3
 * stages the last products of tile i (which read its buffer) may still run when the block moves
 * on, since the buffer is refilled only at tile i+3 -- the wait for Sᵀ of tile i+1 retires them.
 * NWG warpgroups per block share the streamed Q/dO (dK/dV) or K/V (dQ) tiles. */

template <int D, int NWG, int STAGES> constexpr size_t dkdv_wg_smem_bytes()
{
    return 1024 /* alignment slack */ + (size_t)2 * 64 * NWG * D * 2 + (size_t)STAGES * 2 * 64 * D * 2 +
           (size_t)STAGES * 2 * 64 * sizeof(float);
}
template <int D, int NWG, int STAGES> constexpr size_t dq_wg_smem_bytes()
{
    return 1024 + (size_t)2 * 64 * NWG * D * 2 + (size_t)STAGES * 2 * 64 * D * 2;
}

/* dK, dV: grid (B·Hkv, key tiles of 64·NWG), warpgroup w owns keys 64w .. 64w+63 of the tile;
 * loops over the query heads of the kv group and their query tiles (64) at or after the key tile
 * (as tc_bwd_dkdv_kernel) */
template <int D, int NWG, int STAGES>
__global__ void __launch_bounds__(NWG * 128, 3 - NWG)
tc_bwd_dkdv_wg_kernel(bf16 *__restrict__ dk, bf16 *__restrict__ dv, const bf16 *__restrict__ dout,
                      const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                      const bf16 *__restrict__ v, const float *__restrict__ lse2,
                      const float *__restrict__ delta, int S, int Hq, int Hkv, float scale,
                      float scale_log2)
{
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    constexpr int NT = NWG * 128, BK = 64 * NWG, BQ = 64, NA = D / 2;
    constexpr uint32_t KV_BYTES = BK * D * 2, T_BYTES = BQ * D * 2;
    static_assert(STAGES == 2 || STAGES == 3, "buffer reuse is argued for 2 and 3 stages");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t Ks = (raw + 1023u) & ~1023u, Vs = Ks + KV_BYTES;
    const uint32_t Qs = Vs + KV_BYTES, dOs = Qs + STAGES * T_BYTES; /* [STAGES] tiles each */
    float *ls = reinterpret_cast<float *>(smem_raw + (dOs + STAGES * T_BYTES - raw)); /* [STAGES][BQ] */
    float *dls = ls + STAGES * BQ;

    const int kt = blockIdx.y, bhk = blockIdx.x;
    const int b = bhk / Hkv, hk = bhk - b * Hkv, group = Hq / Hkv;
    const int k0 = kt * BK;
    const int qt0 = k0 / BQ, nqt = (S + BQ - 1) / BQ, nper = nqt - qt0, n_it = group * nper;
    const size_t qstride = (size_t)Hq * D, kstride = (size_t)Hkv * D;
    const bf16 *kb = k + (size_t)b * S * kstride + (size_t)hk * D;
    const bf16 *vb = v + (size_t)b * S * kstride + (size_t)hk * D;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wk0 = k0 + 64 * wg;           /* the warpgroup's first key */
    const int key0 = wk0 + 16 * warp + g;   /* the thread's keys: key0, key0 + 8 */

    auto load_q_tile = [&](int it, int st) {
        const int gi = it / nper, qt = qt0 + it - gi * nper, h = hk * group + gi;
        const size_t hoff = (size_t)b * S * qstride + (size_t)h * D;
        const size_t loff = ((size_t)b * Hq + h) * S;
        load_rows_sw<BQ, D, NT>(Qs + st * T_BYTES, q + hoff, qstride, qt * BQ, S);
        load_rows_sw<BQ, D, NT>(dOs + st * T_BYTES, dout + hoff, qstride, qt * BQ, S);
        load_floats<NT>(ls + st * BQ, lse2 + loff, qt * BQ, BQ, S);
        load_floats<NT>(dls + st * BQ, delta + loff, qt * BQ, BQ, S);
    };

    load_rows_sw<BK, D, NT>(Ks, kb, kstride, k0, S);
    load_rows_sw<BK, D, NT>(Vs, vb, kstride, k0, S);
    load_q_tile(0, 0);
    cp_async_commit();

    /* The warpgroup's first active tile starts dK and dV (there is one for every key < S: the
     * query tile holding the key itself). */
    float dka[NA], dva[NA];
    undef_regs(dka);
    undef_regs(dva);
    int started = 0;

    for (int it = 0; it < n_it; it++) {
        const int st = it % STAGES;
        cp_async_wait<0>();
        fence_proxy_async(); /* this thread's cp.async bytes, visible to wgmma's reads */
        __syncthreads();     /* everyone's; and every warpgroup is past the products of tile
                              * it+1-STAGES, whose buffer the next line refills */
        if (it + 1 < n_it) load_q_tile(it + 1, (it + 1) % STAGES);
        cp_async_commit();

        const int gi = it / nper, q0 = (qt0 + it - gi * nper) * BQ;
        if (q0 + BQ - 1 >= wk0 && wk0 < S) { /* else no query of the tile sees a key of the group */
            const uint32_t Qt = Qs + st * T_BYTES, dOt = dOs + st * T_BYTES;
            const float *lt = ls + st * BQ, *dt = dls + st * BQ;
            float s[32], dp[32], pt[32];
            undef_regs(s);
            undef_regs(dp);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_ss_n64(s, desc_kmajor<BK>(Ks, 64 * wg, kk), desc_kmajor<BQ>(Qt, 0, kk), kk > 0);
            wgmma_commit(); /* Sᵀ = K·Qᵀ */
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_ss_n64(dp, desc_kmajor<BK>(Vs, 64 * wg, kk), desc_kmajor<BQ>(dOt, 0, kk), kk > 0);
            wgmma_commit(); /* dPᵀ = V·dOᵀ */
            wgmma_wait<1>();
            fence_regs(s);

            /* two straight-line copies: with one, the compiler if-converts the mask into every tile */
            auto probs = [&](auto masked) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const float2 l2 = *reinterpret_cast<const float2 *>(lt + 8 * j + 2 * t);
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float p = ex2(fmaf(s[4 * j + e], scale_log2, (e & 1) ? -l2.y : -l2.x));
                        if constexpr (decltype(masked)::value) {
                            const int key = key0 + ((e >> 1) << 3), qi = q0 + 8 * j + 2 * t + (e & 1);
                            if (qi < key || qi >= S) p = 0.0f;
                        }
                        pt[4 * j + e] = p;
                    }
                }
            };
            if (q0 < wk0 + 63 || q0 + BQ > S) probs(std::true_type{});
            else probs(std::false_type{});
            uint32_t pa[4][4];
            pack_a64(pa, pt);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                wgmma_rs_nd<D>(dva, pa[kk], desc_mnmajor<BQ>(dOt, kk), kk > 0 || started);
            wgmma_commit(); /* dV += Pᵀ·dO */
            wgmma_wait<1>();
            fence_regs(dp);

#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float2 d2 = *reinterpret_cast<const float2 *>(dt + 8 * j + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; e++) pt[4 * j + e] *= dp[4 * j + e] - ((e & 1) ? d2.y : d2.x);
            }
            uint32_t sa[4][4];
            pack_a64(sa, pt);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                wgmma_rs_nd<D>(dka, sa[kk], desc_mnmajor<BQ>(Qt, kk), kk > 0 || started);
            wgmma_commit(); /* dK += dSᵀ·Q */
            started = 1;
            if (STAGES == 2) wgmma_wait<0>();
        } else {
            wgmma_wait<0>();
        }
    }
    wgmma_wait<0>();
    fence_regs(dka);
    fence_regs(dva);

#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = key0 + 8 * r;
        if (key >= S) continue;
        const size_t at = ((size_t)b * S + key) * kstride + (size_t)hk * D + 2 * t;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            *reinterpret_cast<__nv_bfloat162 *>(dk + at + j * 8) =
                __floats2bfloat162_rn(dka[4 * j + 2 * r] * scale, dka[4 * j + 2 * r + 1] * scale);
            *reinterpret_cast<__nv_bfloat162 *>(dv + at + j * 8) =
                __floats2bfloat162_rn(dva[4 * j + 2 * r], dva[4 * j + 2 * r + 1]);
        }
    }
#endif
}

/* dQ: grid (B·Hq, query tiles of 64·NWG), warpgroup w owns queries 64w .. 64w+63 of the tile;
 * loops over the key tiles (64) up to the diagonal (as tc_bwd_dq_kernel) */
template <int D, int NWG, int STAGES>
__global__ void __launch_bounds__(NWG * 128, 3 - NWG)
tc_bwd_dq_wg_kernel(bf16 *__restrict__ dq, const bf16 *__restrict__ dout, const bf16 *__restrict__ q,
                    const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                    const float *__restrict__ lse2, const float *__restrict__ delta, int S, int Hq,
                    int Hkv, float scale, float scale_log2)
{
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    constexpr int NT = NWG * 128, BQ = 64 * NWG, BC = 64, NA = D / 2;
    constexpr uint32_t QT_BYTES = BQ * D * 2, KV_BYTES = BC * D * 2;
    static_assert(STAGES == 2 || STAGES == 3, "buffer reuse is argued for 2 and 3 stages");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t Qs = (smem_u32(smem_raw) + 1023u) & ~1023u, dOs = Qs + QT_BYTES;
    const uint32_t Ks = dOs + QT_BYTES, Vs = Ks + STAGES * KV_BYTES; /* [STAGES] tiles each */

    const int nqt = (S + BQ - 1) / BQ;
    const int qt = nqt - 1 - (int)blockIdx.y;
    const int bh = blockIdx.x, b = bh / Hq, h = bh - b * Hq, hk = h / (Hq / Hkv);
    const int q0 = qt * BQ;
    const int nkt = (min(q0 + BQ, S) - 1) / BC + 1;
    const size_t qstride = (size_t)Hq * D, kstride = (size_t)Hkv * D;
    const size_t qoff = (size_t)b * S * qstride + (size_t)h * D;
    const bf16 *kb = k + (size_t)b * S * kstride + (size_t)hk * D;
    const bf16 *vb = v + (size_t)b * S * kstride + (size_t)hk * D;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wq0 = q0 + 64 * wg;          /* the warpgroup's first query */
    const int row0 = wq0 + 16 * warp + g;  /* the thread's rows: row0, row0 + 8 */

    load_rows_sw<BQ, D, NT>(Qs, q + qoff, qstride, q0, S);
    load_rows_sw<BQ, D, NT>(dOs, dout + qoff, qstride, q0, S);
    load_rows_sw<BC, D, NT>(Ks, kb, kstride, 0, S);
    load_rows_sw<BC, D, NT>(Vs, vb, kstride, 0, S);
    cp_async_commit();

    float lr[2], dr[2]; /* lse·log2(e) and delta of the thread's rows */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        const size_t at = ((size_t)b * Hq + h) * S + row;
        lr[r] = row < S ? lse2[at] : 0.0f;
        dr[r] = row < S ? delta[at] : 0.0f;
    }
    float acc[NA]; /* started by the first key tile, which every row < S sees */
    undef_regs(acc);

    for (int j = 0; j < nkt; j++) {
        const int st = j % STAGES;
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads(); /* as in the dK/dV kernel */
        if (j + 1 < nkt) {
            load_rows_sw<BC, D, NT>(Ks + ((j + 1) % STAGES) * KV_BYTES, kb, kstride, (j + 1) * BC, S);
            load_rows_sw<BC, D, NT>(Vs + ((j + 1) % STAGES) * KV_BYTES, vb, kstride, (j + 1) * BC, S);
        }
        cp_async_commit();

        const int k0 = j * BC;
        if (k0 <= wq0 + 63 && wq0 < S) { /* else every key of the tile is after every query */
            const uint32_t Kt = Ks + st * KV_BYTES, Vt = Vs + st * KV_BYTES;
            float s[32], dp[32], ds[32];
            undef_regs(s);
            undef_regs(dp);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_ss_n64(s, desc_kmajor<BQ>(Qs, 64 * wg, kk), desc_kmajor<BC>(Kt, 0, kk), kk > 0);
            wgmma_commit(); /* S = Q·Kᵀ */
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_ss_n64(dp, desc_kmajor<BQ>(dOs, 64 * wg, kk), desc_kmajor<BC>(Vt, 0, kk), kk > 0);
            wgmma_commit(); /* dP = dO·Vᵀ */
            wgmma_wait<1>();
            fence_regs(s);

            auto probs = [&](auto masked) { /* two copies, as in the dK/dV kernel */
#pragma unroll
                for (int jb = 0; jb < 8; jb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = e >> 1;
                        float p = ex2(fmaf(s[4 * jb + e], scale_log2, -lr[r]));
                        if constexpr (decltype(masked)::value) {
                            const int row = row0 + 8 * r, col = k0 + 8 * jb + 2 * t + (e & 1);
                            if (col > row || col >= S) p = 0.0f;
                        }
                        ds[4 * jb + e] = p;
                    }
            };
            if (k0 + BC - 1 > wq0 || k0 + BC > S) probs(std::true_type{});
            else probs(std::false_type{});
            wgmma_wait<0>();
            fence_regs(dp);
#pragma unroll
            for (int i = 0; i < 32; i++) ds[i] *= dp[i] - dr[(i >> 1) & 1];
            uint32_t sa[4][4];
            pack_a64(sa, ds);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                wgmma_rs_nd<D>(acc, sa[kk], desc_mnmajor<BC>(Kt, kk), kk > 0 || j > 0);
            wgmma_commit(); /* dQ += dS·K */
            if (STAGES == 2) wgmma_wait<0>();
        } else {
            wgmma_wait<0>();
        }
    }
    wgmma_wait<0>();
    fence_regs(acc);

#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= S) continue;
        bf16 *dst = dq + ((size_t)b * S + row) * qstride + (size_t)h * D + 2 * t;
#pragma unroll
        for (int jb = 0; jb < D / 8; jb++)
            *reinterpret_cast<__nv_bfloat162 *>(dst + jb * 8) =
                __floats2bfloat162_rn(acc[4 * jb + 2 * r] * scale, acc[4 * jb + 2 * r + 1] * scale);
    }
#endif
}

template <int D, int NWG, int STAGES> void dkdv_wg_launch(const attn_bwd_args &a)
{
    constexpr size_t smem = dkdv_wg_smem_bytes<D, NWG, STAGES>();
    static bool opted;
    smem_opt_in(tc_bwd_dkdv_wg_kernel<D, NWG, STAGES>, smem, &opted);
    const dim3 grid((unsigned)(a.B * a.Hkv), (unsigned)((a.S + 64 * NWG - 1) / (64 * NWG)));
    tc_bwd_dkdv_wg_kernel<D, NWG, STAGES><<<grid, NWG * 128, smem, g_cuda.stream>>>(
        a.dk, a.dv, a.dout, a.q, a.k, a.v, a.lse2, a.delta, a.S, a.Hq, a.Hkv, a.scale, a.scale_log2);
    CUDA_LAUNCH_CHECK("attention tc backward dk dv (wgmma)");
}

template <int D, int NWG, int STAGES> void dq_wg_launch(const attn_bwd_args &a)
{
    constexpr size_t smem = dq_wg_smem_bytes<D, NWG, STAGES>();
    static bool opted;
    smem_opt_in(tc_bwd_dq_wg_kernel<D, NWG, STAGES>, smem, &opted);
    const dim3 grid((unsigned)(a.B * a.Hq), (unsigned)((a.S + 64 * NWG - 1) / (64 * NWG)));
    tc_bwd_dq_wg_kernel<D, NWG, STAGES><<<grid, NWG * 128, smem, g_cuda.stream>>>(
        a.dq, a.dout, a.q, a.k, a.v, a.lse2, a.delta, a.S, a.Hq, a.Hkv, a.scale, a.scale_log2);
    CUDA_LAUNCH_CHECK("attention tc backward dq (wgmma)");
}

} /* namespace */

void attn_wgmma_dkdv(const attn_bwd_args &a, int D, int variant)
{
    if (D == 128) {
        if (variant == 2) dkdv_wg_launch<128, 1, 2>(a);
        else if (variant == 3) dkdv_wg_launch<128, 2, 2>(a);
        else dkdv_wg_launch<128, 2, 3>(a);
    } else {
        if (variant == 2) dkdv_wg_launch<64, 1, 2>(a);
        else if (variant == 3) dkdv_wg_launch<64, 2, 2>(a);
        else dkdv_wg_launch<64, 2, 3>(a);
    }
}

void attn_wgmma_dq(const attn_bwd_args &a, int D, int variant)
{
    if (D == 128) {
        if (variant == 2) dq_wg_launch<128, 1, 2>(a);
        else if (variant == 3) dq_wg_launch<128, 2, 2>(a);
        else dq_wg_launch<128, 2, 3>(a);
    } else {
        if (variant == 2) dq_wg_launch<64, 1, 2>(a);
        else if (variant == 3) dq_wg_launch<64, 2, 2>(a);
        else dq_wg_launch<64, 2, 3>(a);
    }
}
