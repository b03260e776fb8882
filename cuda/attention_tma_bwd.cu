/* The attention backward's dK/dV pass on Hopper (attention_tma_bwd.cuh says how both passes
 * work), and both passes with dS stored between them. */
#include "attention_tma_bwd.cuh"

namespace {

template <int D, int STAGES, bool STORE_DS> constexpr size_t dkdv_tma_smem_bytes()
{
    return 1024 + (size_t)2 * DKDV_BK * D * 2 + (size_t)STAGES * 2 * DKDV_BQ * D * 2 +
           (STORE_DS ? 2 * DS_TILE_BYTES : 0) + (size_t)STAGES * 2 * DKDV_BQ * sizeof(float) +
           (2 * STAGES + 1) * 8;
}

/* named barrier of one consumer warpgroup (ids 1, 2; 0 is __syncthreads) */
__device__ __forceinline__ void wg_bar_sync(int wg)
{
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
}

template <int D, int STAGES, bool STORE_DS>
__global__ void __launch_bounds__(TMA_BWD_THREADS, 1)
tc_bwd_dkdv_tma_kernel(const __grid_constant__ bwd_tma_params p)
{
    pdl_wait(); /* first: launch.cuh */
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    constexpr int BK = DKDV_BK, BQ = DKDV_BQ, NA = D / 2;
    constexpr uint32_t KV_BYTES = BK * D * 2, T_BYTES = BQ * D * 2;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t Ks = (raw + 1023u) & ~1023u, Vs = Ks + KV_BYTES;
    const uint32_t ring = Vs + KV_BYTES; /* stage s: Q at ring + 2s·T_BYTES, dO after it */
    const uint32_t ds_stage = ring + STAGES * 2 * T_BYTES; /* STORE_DS: warpgroup w's dSᵀ tile */
    float *ls = reinterpret_cast<float *>(smem_raw + (ds_stage + (STORE_DS ? 2 * DS_TILE_BYTES : 0) - raw)); /* [STAGES][BQ] */
    float *dls = ls + STAGES * BQ;
    const uint32_t bars = smem_u32(dls + STAGES * BQ);
    auto full_bar = [&](int s) { return bars + 8u * s; };
    auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };
    const uint32_t kv_bar = bars + 16u * STAGES;

    const int S = p.S, Hq = p.Hq, Hkv = p.Hkv;
    const int kt = blockIdx.y, bhk = blockIdx.x;
    const int b = bhk / Hkv, hk = bhk - b * Hkv, group = Hq / Hkv;
    /* part blockIdx.z of gridDim.z takes query heads g0 .. g0 + gn - 1 of the kv group */
    const int gn = group / (int)gridDim.z, g0 = (int)blockIdx.z * gn;
    const int k0 = kt * BK;
    const int qt0 = k0 / BQ, nqt = (S + BQ - 1) / BQ, nper = nqt - qt0, n_it = gn * nper;

    if (threadIdx.x == 0) init_ring(bars, STAGES, 1 + 32);
    __syncthreads();

    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0); /* warp-uniform for setmaxnreg */
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    if (wg == 2) {
        /* ------------------------------------------------ producer */
        setmaxnreg_dec<24>();
        if (warp == 0 && lane == 0) {
            mbar_expect_tx(kv_bar, 2 * KV_BYTES);
            for (int c = 0; c < D / 64; c++) {
                tma_3d(Ks + c * (BK * 128), &p.map_k, hk * D + 64 * c, k0, b, kv_bar);
                tma_3d(Vs + c * (BK * 128), &p.map_v, hk * D + 64 * c, k0, b, kv_bar);
            }
            for (int it = 0; it < n_it; it++) {
                const int st = it % STAGES, gl = it / nper, qt = qt0 + it - gl * nper, h = hk * group + g0 + gl;
                const uint32_t Qt = ring + st * 2 * T_BYTES, dOt = Qt + T_BYTES, fb = full_bar(st);
                mbar_wait(empty_bar(st), ((it / STAGES) & 1) ^ 1);
                mbar_expect_tx(fb, 2 * T_BYTES);
                for (int c = 0; c < D / 64; c++) {
                    tma_3d(Qt + c * (BQ * 128), &p.map_q, h * D + 64 * c, qt * BQ, b, fb);
                    tma_3d(dOt + c * (BQ * 128), &p.map_do, h * D + 64 * c, qt * BQ, b, fb);
                }
            }
        } else if (warp == 1) {
            for (int it = 0; it < n_it; it++) {
                const int st = it % STAGES, gl = it / nper, qt = qt0 + it - gl * nper, h = hk * group + g0 + gl;
                const size_t loff = ((size_t)b * Hq + h) * S;
                mbar_wait(empty_bar(st), ((it / STAGES) & 1) ^ 1);
                for (int r = lane; r < BQ; r += 32) {
                    const int row = qt * BQ + r;
                    ls[st * BQ + r] = row < S ? p.lse2[loff + row] : 0.0f;
                    dls[st * BQ + r] = row < S ? p.delta[loff + row] : 0.0f;
                }
                mbar_arrive(full_bar(st)); /* release: the stores above are seen by the waiters */
            }
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    setmaxnreg_inc<240>();
    const int g = lane >> 2, t = lane & 3;
    const int wk0 = k0 + 64 * wg;         /* the warpgroup's first key */
    const int key0 = wk0 + 16 * warp + g; /* the thread's keys: key0, key0 + 8 */
    const float scale_log2 = p.scale_log2;

    /* the warpgroup's first active tile starts dK and dV (there is one for every key < S) */
    float dka[NA], dva[NA];
    undef_regs(dka);
    undef_regs(dva);
    int started = 0, pend = -1; /* pend: the tile whose products may still read its stage */

    mbar_wait(kv_bar, 0);
    /* the tile's head in the part (gl) and query tile (qt), stepped rather than divided out of it:
     * the integer division sat on every tile's critical path (~3% of the consumers' stall samples) */
    int gl = 0, qt = qt0 - 1;
    for (int it = 0; it < n_it; it++) {
        if (++qt == nqt) qt = qt0, gl++;
        const int st = it % STAGES;
        mbar_wait(full_bar(st), (it / STAGES) & 1);
        const int gi = g0 + gl, q0 = qt * BQ;
        if (q0 + BQ - 1 < wk0 || wk0 >= S) { /* no query of the tile sees a key of the group */
            skip_tile(empty_bar(0), STAGES, st, pend, lane);
            continue;
        }
        const uint32_t Qt = ring + st * 2 * T_BYTES, dOt = Qt + T_BYTES;
        const float *lt = ls + st * BQ, *dt = dls + st * BQ;
        float s[32], dp[32], pt[32];
        /* the rows' log-sum-exps into registers before Sᵀ and dPᵀ are issued. Read after the
         * wait, under the MMAs' shared-memory traffic, their latency stalled the first
         * exponentials; read between the issue and the wait they still did (~8% of the pass's
         * stall samples, Nsight Compute). Ahead of the issue: the backward with dS stored 1.275
         * against 1.340 ms (H200, bench_attention, the same bits; forty-ninth session). */
        float2 l2[8];
#pragma unroll
        for (int j = 0; j < 8; j++) l2[j] = *reinterpret_cast<const float2 *>(lt + 8 * j + 2 * t);
        bwd_scores<D, BK, BQ>(s, Ks, 64 * wg, Qt);  /* Sᵀ = K·Qᵀ */
        bwd_scores<D, BK, BQ>(dp, Vs, 64 * wg, dOt); /* dPᵀ = V·dOᵀ */
        wgmma_wait<1>(); /* Sᵀ has landed: every product of the tiles before has retired */
        fence_regs(s);
        if (pend >= 0) release_stage(empty_bar(pend % STAGES), lane);

        auto probs = [&](auto masked) { /* two straight-line copies: with one, the compiler
                                         * if-converts the mask into every tile */
#pragma unroll
            for (int j = 0; j < 8; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float pr = ex2(fmaf(s[4 * j + e], scale_log2, (e & 1) ? -l2[j].y : -l2[j].x));
                    if constexpr (decltype(masked)::value) {
                        const int key = key0 + ((e >> 1) << 3), qi = q0 + 8 * j + 2 * t + (e & 1);
                        if (qi < key || qi >= S) pr = 0.0f;
                    }
                    pt[4 * j + e] = pr;
                }
            }
        };
        if (q0 < wk0 + 63 || q0 + BQ > S) probs(std::true_type{});
        else probs(std::false_type{});
        bwd_product<D, BQ>(dva, pt, dOt, started); /* dV += Pᵀ·dO */
        float2 d2[8]; /* the rows' deltas, as the log-sum-exps above */
#pragma unroll
        for (int j = 0; j < 8; j++) d2[j] = *reinterpret_cast<const float2 *>(dt + 8 * j + 2 * t);
        wgmma_wait<0>();
        fence_regs(dp);
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) pt[4 * j + e] *= dp[4 * j + e] - ((e & 1) ? d2[j].y : d2[j].x);
        uint32_t dsa[4][4]; /* dSᵀ in bf16: the tile stored below and dK's operand */
        pack_a64(dsa, pt);
        if constexpr (STORE_DS) {
            /* the tile's dSᵀ goes out for the dQ pass: into the warpgroup's staging tile once the
             * previous tile's bulk store has read it, then one bulk store */
            const uint32_t dst = ds_stage + wg * DS_TILE_BYTES;
            if (warp == 0 && lane == 0) bulk_wait_read();
            wg_bar_sync(wg);
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const uint32_t v = dsa[j >> 1][2 * (j & 1) + r]; /* pt[4j + 2r], pt[4j + 2r + 1] */
                    const uint32_t a = dst + (16 * warp + g + 8 * r) * 128 + ((j ^ g) << 4) + 4 * t;
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
                }
            fence_proxy_async();
            wg_bar_sync(wg);
            if (warp == 0 && lane == 0) {
                bulk_store(p.ds + ds_tile_offset(p, b, hk * group + gi, q0 / 64, wk0 / 64), dst, DS_TILE_BYTES);
                bulk_commit();
            }
        }
        /* dK += dSᵀ·Q. Issued before the staging above (so that the warpgroup had an MMA in flight
         * while it stored), the pass took 8% longer (H200, bench_attention; ptxas spilled 24 bytes). */
        bwd_product_packed<D, BQ>(dka, dsa, Qt, started);
        started = 1;
        pend = it;
    }
    wgmma_wait<0>();
    fence_regs(dka);
    fence_regs(dva);
    if (STORE_DS && warp == 0 && lane == 0) bulk_wait_all(); /* the staging tile outlives its reads */
    const size_t kstride = (size_t)Hkv * D, at = (size_t)b * S * kstride + (size_t)hk * D + 2 * t;
    if (gridDim.z == 1) {
        bwd_store_rows<D>(p.dk + at, kstride, dka, key0, S, p.scale);
        bwd_store_rows<D>(p.dv + at, kstride, dva, key0, S, 1.0f);
    } else { /* the part's sums, unscaled: dkdv_sum_kernel scales their total as above */
        const size_t plane = (size_t)gridDim.x / Hkv * S * kstride;
        bwd_store_rows<D>(p.dkdv_part + blockIdx.z * plane + at, kstride, dka, key0, S, 1.0f);
        bwd_store_rows<D>(p.dkdv_part + (gridDim.z + blockIdx.z) * plane + at, kstride, dva, key0, S, 1.0f);
    }
#endif
}

/* dK = scale · Σ parts, dV = Σ parts, in part order (n elements each; n % 4 == 0) */
__global__ void dkdv_sum_kernel(bf16 *dk, bf16 *dv, const float *part, size_t n, int parts, float scale)
{
    pdl_wait(); /* first: launch.cuh */
    for (size_t i = 4 * (blockIdx.x * (size_t)blockDim.x + threadIdx.x); i < n; i += 4 * (size_t)gridDim.x * blockDim.x) {
        float4 sk = *reinterpret_cast<const float4 *>(part + i);
        float4 sv = *reinterpret_cast<const float4 *>(part + parts * n + i);
        for (int z = 1; z < parts; z++) {
            const float4 k = *reinterpret_cast<const float4 *>(part + z * n + i);
            const float4 v = *reinterpret_cast<const float4 *>(part + (parts + z) * n + i);
            sk.x += k.x, sk.y += k.y, sk.z += k.z, sk.w += k.w;
            sv.x += v.x, sv.y += v.y, sv.z += v.z, sv.w += v.w;
        }
        __nv_bfloat162 *k2 = reinterpret_cast<__nv_bfloat162 *>(dk + i), *v2 = reinterpret_cast<__nv_bfloat162 *>(dv + i);
        k2[0] = __floats2bfloat162_rn(sk.x * scale, sk.y * scale);
        k2[1] = __floats2bfloat162_rn(sk.z * scale, sk.w * scale);
        v2[0] = __floats2bfloat162_rn(sv.x, sv.y);
        v2[1] = __floats2bfloat162_rn(sv.z, sv.w);
    }
}

/* dK/dV over key tiles of DKDV_BK per (batch, kv head), in a.dkdv_split parts of the kv group */
template <int D, int STAGES, bool STORE_DS> void dkdv_tma_launch(const attn_bwd_args &a)
{
    const int parts = a.dkdv_split > 1 ? a.dkdv_split : 1;
    launch<tc_bwd_dkdv_tma_kernel<D, STAGES, STORE_DS>>(
        dkdv_tma_smem_bytes<D, STAGES, STORE_DS>(),
        dim3((unsigned)(a.B * a.Hkv), (unsigned)((a.S + DKDV_BK - 1) / DKDV_BK), (unsigned)parts),
        tma_params(a, D, DKDV_BQ, DKDV_BK, "attention backward dk dv (TMA)"));
    if (parts == 1) return;
    const size_t n = (size_t)a.B * a.S * a.Hkv * D;
    const size_t want = (n / 4 + 255) / 256, most = (size_t)g_cuda.num_sms * 8;
    const unsigned blocks = (unsigned)(want < most ? want : most);
    cuda_launch(dkdv_sum_kernel, blocks, 256, 0, a.dk, a.dv, a.dkdv_part, n, parts, a.scale);
    CUDA_LAUNCH_CHECK("attention backward dk dv part sums");
}

} /* namespace */

void attn_tma_dkdv(const attn_bwd_args &a, int D)
{
    if (D == 128) dkdv_tma_launch<128, 4, false>(a);
    else dkdv_tma_launch<64, 4, false>(a);
}

void attn_tma_bwd_ds(const attn_bwd_args &a, int D)
{
    if (D == 128) dkdv_tma_launch<128, 4, true>(a);
    else dkdv_tma_launch<64, 4, true>(a);
    attn_tma_dq_from_ds(a, D);
}
