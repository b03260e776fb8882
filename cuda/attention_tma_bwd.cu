/* The attention backward's two passes on Hopper, warp-specialised (sm_90a; the tile layout and
 * the MMA shapes: attention_wgmma.cuh). Off sm_90, and with document masks, the mma.sync kernels
 * of attention_tc_bwd.cu run, which give the same bits.
 *
 * CTA: warpgroup 2 is the producer (384 threads). It gives back its registers (setmaxnreg 24) so
 * that the two consumer warpgroups can hold 240 a thread: dK and dV of 64 keys × 128 columns are
 * 128 accumulators a thread before the scores, which at 168 (what ptxas allows three warpgroups
 * without setmaxnreg) spilled and serialised the MMAs. Producer warp 0, one thread, issues the TMA
 * loads into a ring of STAGES buffers, each guarded by a "full" mbarrier and an "empty" one that
 * every consumer warp releases once the products that read the buffer have retired (the wait for
 * the next tile's first product retires them). The consumers issue no loads and meet no
 * block-wide barrier.
 *
 * dK/dV: grid (B·Hkv, key tiles of 128), heaviest first; consumer warpgroup w owns keys 64w ..; the
 * block's K and V tiles are loaded once; each ring stage holds one query tile (64 rows of one head
 * of the kv group) of Q and dO, and its 64 lse·log2 e and delta values, which producer warp 1 copies
 * (32 threads, plain loads: rows past S read as 0, which TMA's 16-byte-aligned rows could not do
 * for an odd S). The full barrier counts the TMA thread's expect_tx arrival and those 32. Per tile:
 * Sᵀ and dPᵀ issued together, Pᵀ from Sᵀ while dPᵀ runs, dV += Pᵀ·dO, dSᵀ = Pᵀ ⊙ (dPᵀ - delta) once
 * dV has retired (with it still holding Pᵀ's registers dSᵀ needs more than 240 and ptxas serialises
 * every MMA), dK += dSᵀ·Q.
 * dQ: grid (B·Hq, query tiles of 128), heaviest first; consumer warpgroup w owns queries 64w ..;
 * the block's Q and dO tiles are loaded once, the K and V tiles of 64 keys stream through the ring.
 * Per tile: S and dP, P, dS, dQ += dS·K.
 *
 * Each pass recomputes P from q, k and lse: 7 products against FlashAttention-2's 5, whose dQ is
 * summed with atomics across key tiles; here every output element is accumulated by one thread in
 * a fixed order, so the gradients are the same bits run to run (and as the mma.sync kernels').
 * ATTN_BWD_DS (the default) gets to 5 products without atomics: the dK/dV pass also writes each
 * dSᵀ tile it forms (64 keys × 64 queries, bf16) through a staging tile per warpgroup and one bulk
 * store (two named barriers a tile: the previous store has read the staging tile; every warp has
 * written it), and tc_bwd_dq_ds_kernel streams those tiles back with the K tiles for dQ += dS·K.
 * The tiles are the bytes of a 128-byte-swizzled shared-memory tile, so both copies are single
 * bulk copies; bf16 dS is what the recomputing dQ pass feeds its MMA too, hence the same bits.
 * H200, B=2 S=4096 Hq=32/4 D=128: 1.38 ms for both passes against 1.54 (the dS round trip, 1 GiB
 * each way, is what the dQ pass now waits for); 1.36 since that pass reads each K tile once for
 * two query heads (tc_bwd_dq_ds_kernel). */
#include "attention_wgmma.cuh"

#include <type_traits>

namespace {

struct bwd_tma_params {
    CUtensorMap map_q, map_do, map_k, map_v; /* [B][S][H·D] bf16, boxes of 64 columns × rows */
    bf16 *dq, *dk, *dv;
    bf16 *ds;        /* the dSᵀ tiles (ds_tile_offset) when the dK/dV pass stores them, else null */
    const float *lse2, *delta;
    int S, Hq, Hkv;
    int ds_tiles;    /* dS tiles of one (batch, head): nt(nt + 1)/2, nt = ceil(S / 64) */
    float scale, scale_log2;
};

constexpr int TMA_BWD_THREADS = 384;
constexpr int DKDV_BK = 128, DKDV_BQ = 64; /* keys per block, queries per streamed tile */
constexpr int DQ_BQ = 128, DQ_BC = 64;     /* queries per block, keys per streamed tile */

constexpr uint32_t DS_TILE_BYTES = 64 * 64 * 2; /* one 64 × 64 bf16 dSᵀ tile */

template <int D, int STAGES, bool STORE_DS> constexpr size_t dkdv_tma_smem_bytes()
{
    return 1024 + (size_t)2 * DKDV_BK * D * 2 + (size_t)STAGES * 2 * DKDV_BQ * D * 2 +
           (STORE_DS ? 2 * DS_TILE_BYTES : 0) + (size_t)STAGES * 2 * DKDV_BQ * sizeof(float) +
           (2 * STAGES + 1) * 8;
}
template <int D, int STAGES, int HEADS> constexpr size_t dq_ds_smem_bytes()
{
    return 1024 + (size_t)STAGES * (DQ_BC * D * 2 + 2 * HEADS * DS_TILE_BYTES) + (2 * STAGES + 1) * 8;
}

/* Where the dSᵀ tile of query tile qt and key tile kt (64 each, kt <= qt) of (batch b, head h)
 * starts, in elements: the tiles of the causal lower triangle, row by row, of each (b, h) in turn.
 * A tile is the bytes of a 128-byte-swizzled [64 keys][64 queries] shared-memory tile, which is
 * the MN-major A operand (rows = the k dimension) of dQ += dS·K: it goes from shared memory to
 * global memory and back in single bulk copies. */
__device__ __forceinline__ size_t ds_tile_offset(const bwd_tma_params &p, int b, int h, int qt, int kt)
{
    return (((size_t)b * p.Hq + h) * p.ds_tiles + (size_t)qt * (qt + 1) / 2 + kt) * (64 * 64);
}

/* named barrier of one consumer warpgroup (ids 1, 2; 0 is __syncthreads) */
__device__ __forceinline__ void wg_bar_sync(int wg)
{
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
}
template <int D, int STAGES> constexpr size_t dq_tma_smem_bytes()
{
    return 1024 + (size_t)2 * DQ_BQ * D * 2 + (size_t)STAGES * 2 * DQ_BC * D * 2 + (2 * STAGES + 1) * 8;
}

/* a warp's reads of a ring stage are over (the empty barrier counts the 8 consumer warps) */
__device__ __forceinline__ void release_stage(uint32_t empty_bar, int lane)
{
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar);
}

/* a tile this warpgroup skips: every earlier product retires, so the pending tile's stage and this
 * one are released at once */
__device__ __forceinline__ void skip_tile(uint32_t empty_bar0, int stages, int st, int &pend, int lane)
{
    wgmma_wait<0>();
    if (pend >= 0) release_stage(empty_bar0 + 8u * (pend % stages), lane);
    release_stage(empty_bar0 + 8u * st, lane);
    pend = -1;
}

__device__ __forceinline__ void init_ring(uint32_t bars, int stages, uint32_t full_count)
{
    for (int s = 0; s < stages; s++) {
        mbar_init(bars + 8u * s, full_count);
        mbar_init(bars + 8u * (stages + s), 8);
    }
    mbar_init(bars + 16u * stages, 1); /* the block's fixed tiles */
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

template <int D, int STAGES, bool STORE_DS>
__global__ void __launch_bounds__(TMA_BWD_THREADS, 1)
tc_bwd_dkdv_tma_kernel(const __grid_constant__ bwd_tma_params p)
{
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
    const int k0 = kt * BK;
    const int qt0 = k0 / BQ, nqt = (S + BQ - 1) / BQ, nper = nqt - qt0, n_it = group * nper;

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
                const int st = it % STAGES, gi = it / nper, qt = qt0 + it - gi * nper, h = hk * group + gi;
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
                const int st = it % STAGES, gi = it / nper, qt = qt0 + it - gi * nper, h = hk * group + gi;
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
    for (int it = 0; it < n_it; it++) {
        const int st = it % STAGES;
        mbar_wait(full_bar(st), (it / STAGES) & 1);
        const int gi = it / nper, q0 = (qt0 + it - gi * nper) * BQ;
        if (q0 + BQ - 1 < wk0 || wk0 >= S) { /* no query of the tile sees a key of the group */
            skip_tile(empty_bar(0), STAGES, st, pend, lane);
            continue;
        }
        const uint32_t Qt = ring + st * 2 * T_BYTES, dOt = Qt + T_BYTES;
        const float *lt = ls + st * BQ, *dt = dls + st * BQ;
        float s[32], dp[32], pt[32];
        bwd_scores<D, BK, BQ>(s, Ks, 64 * wg, Qt);  /* Sᵀ = K·Qᵀ */
        bwd_scores<D, BK, BQ>(dp, Vs, 64 * wg, dOt); /* dPᵀ = V·dOᵀ */
        wgmma_wait<1>(); /* Sᵀ has landed: every product of the tiles before has retired */
        fence_regs(s);
        if (pend >= 0) release_stage(empty_bar(pend % STAGES), lane);

        auto probs = [&](auto masked) { /* two straight-line copies: with one, the compiler
                                         * if-converts the mask into every tile */
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float2 l2 = *reinterpret_cast<const float2 *>(lt + 8 * j + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float pr = ex2(fmaf(s[4 * j + e], scale_log2, (e & 1) ? -l2.y : -l2.x));
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
        wgmma_wait<0>();
        fence_regs(dp);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float2 d2 = *reinterpret_cast<const float2 *>(dt + 8 * j + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; e++) pt[4 * j + e] *= dp[4 * j + e] - ((e & 1) ? d2.y : d2.x);
        }
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
                    const uint32_t v = pack_bf16(pt[4 * j + 2 * r], pt[4 * j + 2 * r + 1]);
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
        bwd_product<D, BQ>(dka, pt, Qt, started); /* dK += dSᵀ·Q */
        started = 1;
        pend = it;
    }
    wgmma_wait<0>();
    fence_regs(dka);
    fence_regs(dva);
    if (STORE_DS && warp == 0 && lane == 0) bulk_wait_all(); /* the staging tile outlives its reads */
    const size_t kstride = (size_t)Hkv * D, at = (size_t)b * S * kstride + (size_t)hk * D + 2 * t;
    bwd_store_rows<D>(p.dk + at, kstride, dka, key0, S, p.scale);
    bwd_store_rows<D>(p.dv + at, kstride, dva, key0, S, 1.0f);
#endif
}

/* What a block of a dQ pass covers: (batch b, query heads h .. h + HEADS - 1 of kv head hk), the
 * queries q0 .. q0 + DQ_BQ - 1 of query tile qt (the last tiles first: the longest causal rows),
 * and the key tiles of DQ_BC that reach its last query (nkt) */
struct dq_block {
    int b, h, hk, qt, q0, nkt;
};
template <int HEADS> __device__ __forceinline__ dq_block dq_block_of(const bwd_tma_params &p)
{
    dq_block k;
    const int head_blocks = p.Hq / HEADS;
    k.qt = (p.S + DQ_BQ - 1) / DQ_BQ - 1 - (int)blockIdx.y;
    k.b = (int)blockIdx.x / head_blocks;
    k.h = ((int)blockIdx.x - k.b * head_blocks) * HEADS;
    k.hk = k.h / (p.Hq / p.Hkv);
    k.q0 = k.qt * DQ_BQ;
    k.nkt = (min(k.q0 + DQ_BQ, p.S) - 1) / DQ_BC + 1;
    return k;
}

template <int D, int STAGES>
__global__ void __launch_bounds__(TMA_BWD_THREADS, 1)
tc_bwd_dq_tma_kernel(const __grid_constant__ bwd_tma_params p)
{
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    constexpr int BQ = DQ_BQ, BC = DQ_BC, NA = D / 2;
    constexpr uint32_t QT_BYTES = BQ * D * 2, T_BYTES = BC * D * 2;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t Qs = (smem_u32(smem_raw) + 1023u) & ~1023u, dOs = Qs + QT_BYTES;
    const uint32_t ring = dOs + QT_BYTES; /* stage s: K at ring + 2s·T_BYTES, V after it */
    const uint32_t bars = ring + STAGES * 2 * T_BYTES;
    auto full_bar = [&](int s) { return bars + 8u * s; };
    auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };
    const uint32_t q_bar = bars + 16u * STAGES;

    const int S = p.S, Hq = p.Hq;
    const dq_block blk = dq_block_of<1>(p);
    const int b = blk.b, h = blk.h, hk = blk.hk, q0 = blk.q0, nkt = blk.nkt;

    if (threadIdx.x == 0) init_ring(bars, STAGES, 1);
    __syncthreads();

    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    if (wg == 2) {
        /* ------------------------------------------------ producer */
        setmaxnreg_dec<24>();
        if (threadIdx.x != 256) return;
        mbar_expect_tx(q_bar, 2 * QT_BYTES);
        for (int c = 0; c < D / 64; c++) {
            tma_3d(Qs + c * (BQ * 128), &p.map_q, h * D + 64 * c, q0, b, q_bar);
            tma_3d(dOs + c * (BQ * 128), &p.map_do, h * D + 64 * c, q0, b, q_bar);
        }
        for (int j = 0; j < nkt; j++) {
            const int st = j % STAGES;
            const uint32_t Kt = ring + st * 2 * T_BYTES, Vt = Kt + T_BYTES, fb = full_bar(st);
            mbar_wait(empty_bar(st), ((j / STAGES) & 1) ^ 1);
            mbar_expect_tx(fb, 2 * T_BYTES);
            for (int c = 0; c < D / 64; c++) {
                tma_3d(Kt + c * (BC * 128), &p.map_k, hk * D + 64 * c, j * BC, b, fb);
                tma_3d(Vt + c * (BC * 128), &p.map_v, hk * D + 64 * c, j * BC, b, fb);
            }
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    setmaxnreg_inc<240>();
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wq0 = q0 + 64 * wg;         /* the warpgroup's first query */
    const int row0 = wq0 + 16 * warp + g; /* the thread's rows: row0, row0 + 8 */
    const float scale_log2 = p.scale_log2;

    float lr[2], dr[2]; /* lse·log2(e) and delta of the thread's rows */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        const size_t at = ((size_t)b * Hq + h) * S + row;
        lr[r] = row < S ? p.lse2[at] : 0.0f;
        dr[r] = row < S ? p.delta[at] : 0.0f;
    }
    float acc[NA]; /* started by the first key tile, which every row < S sees */
    undef_regs(acc);
    int pend = -1;

    mbar_wait(q_bar, 0);
    for (int j = 0; j < nkt; j++) {
        const int st = j % STAGES;
        mbar_wait(full_bar(st), (j / STAGES) & 1);
        const int k0 = j * BC;
        if (k0 > wq0 + 63 || wq0 >= S) { /* every key of the tile is after every query */
            skip_tile(empty_bar(0), STAGES, st, pend, lane);
            continue;
        }
        const uint32_t Kt = ring + st * 2 * T_BYTES, Vt = Kt + T_BYTES;
        float s[32], dp[32], ds[32];
        bwd_scores<D, BQ, BC>(s, Qs, 64 * wg, Kt);   /* S = Q·Kᵀ */
        bwd_scores<D, BQ, BC>(dp, dOs, 64 * wg, Vt); /* dP = dO·Vᵀ */
        wgmma_wait<1>(); /* S has landed: the previous tile's dQ product has retired */
        fence_regs(s);
        if (pend >= 0) release_stage(empty_bar(pend % STAGES), lane);

        auto probs = [&](auto masked) {
#pragma unroll
            for (int jb = 0; jb < 8; jb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = e >> 1;
                    float pr = ex2(fmaf(s[4 * jb + e], scale_log2, -lr[r]));
                    if constexpr (decltype(masked)::value) {
                        const int row = row0 + 8 * r, col = k0 + 8 * jb + 2 * t + (e & 1);
                        if (col > row || col >= S) pr = 0.0f;
                    }
                    ds[4 * jb + e] = pr;
                }
        };
        if (k0 + BC - 1 > wq0 || k0 + BC > S) probs(std::true_type{});
        else probs(std::false_type{});
        wgmma_wait<0>();
        fence_regs(dp);
#pragma unroll
        for (int i = 0; i < 32; i++) ds[i] *= dp[i] - dr[(i >> 1) & 1];
        bwd_product<D, BC>(acc, ds, Kt, j > 0); /* dQ += dS·K */
        pend = j;
    }
    wgmma_wait<0>();
    fence_regs(acc);
    const size_t qstride = (size_t)Hq * D;
    bwd_store_rows<D>(p.dq + (size_t)b * S * qstride + (size_t)h * D + 2 * t, qstride, acc, row0, S, p.scale);
#endif
}

/* dQ from the stored dS (variant ATTN_BWD_DS): grid (B·Hq / HEADS, query tiles of 128) heaviest
 * first as above, each block HEADS query heads of one kv head. Per key tile of 64 it reads the K
 * tile and the dSᵀ tiles the dK/dV pass left: dQ += dS·K, one SS product with both operands
 * MN-major, the one product of the five left to this pass. A unit is 64 query rows of one head
 * (one 64-row dSᵀ tile a key tile, one accumulator); consumer warpgroup w owns HEADS of them:
 * HEADS 1, the rows 64w .. of head h; HEADS 2, all 128 rows of head h + w. Ring stage s: K, then
 * the units' dS tiles, warpgroup 0's first; a tile no query of a unit sees was never stored and is
 * not loaded.
 *
 * Why two heads: the pass is bound by what the SMs load, 1 GiB of dS from memory and, with one
 * head a block, as many bytes of K again from L2 (every query tile re-reads its kv head's K). Two
 * heads of a kv group share each K tile, so K is a third of the bytes instead of half. The sums
 * run in the same order either way (each accumulator over the key tiles, then the 4 k-steps):
 * the same bits. */
template <int D, int STAGES, int HEADS>
__global__ void __launch_bounds__(TMA_BWD_THREADS, 1)
tc_bwd_dq_ds_kernel(const __grid_constant__ bwd_tma_params p)
{
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    static_assert(HEADS == 1 || HEADS == 2, "a warpgroup owns one or two 64-row units");
    constexpr int BC = DQ_BC, NA = D / 2;
    constexpr uint32_t K_BYTES = BC * D * 2, STAGE_BYTES = K_BYTES + 2 * HEADS * DS_TILE_BYTES;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t ring = (smem_u32(smem_raw) + 1023u) & ~1023u; /* stage s at ring + s·STAGE_BYTES */
    const uint32_t bars = ring + STAGES * STAGE_BYTES;
    auto full_bar = [&](int s) { return bars + 8u * s; };
    auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };

    const int S = p.S, Hq = p.Hq;
    const dq_block blk = dq_block_of<HEADS>(p);
    const int qt = blk.qt, b = blk.b, h = blk.h, hk = blk.hk, q0 = blk.q0, nkt = blk.nkt;
    /* unit u of warpgroup w: its head and which 64-row half of the query tile it holds */
    auto head_of = [&](int w, int u) { return HEADS == 1 ? h : h + w; };
    auto half_of = [&](int w, int u) { return HEADS == 1 ? w : u; };
    /* a half's queries see key tile j when j <= its 64-row tile and it has a query < S */
    auto sees = [&](int half, int j) { return q0 + 64 * half < S && j <= 2 * qt + half; };

    if (threadIdx.x == 0) init_ring(bars, STAGES, 1);
    __syncthreads();

    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    if (wg == 2) {
        /* ------------------------------------------------ producer */
        setmaxnreg_dec<24>();
        if (threadIdx.x != 256) return;
        for (int j = 0; j < nkt; j++) {
            const int st = j % STAGES;
            const uint32_t Kt = ring + st * STAGE_BYTES, fb = full_bar(st);
            int tiles = 0;
            for (int w = 0; w < 2; w++)
                for (int u = 0; u < HEADS; u++) tiles += sees(half_of(w, u), j);
            mbar_wait(empty_bar(st), ((j / STAGES) & 1) ^ 1);
            mbar_expect_tx(fb, K_BYTES + tiles * DS_TILE_BYTES);
            for (int c = 0; c < D / 64; c++) tma_3d(Kt + c * (BC * 128), &p.map_k, hk * D + 64 * c, j * BC, b, fb);
            for (int w = 0; w < 2; w++)
                for (int u = 0; u < HEADS; u++)
                    if (sees(half_of(w, u), j))
                        bulk_load(Kt + K_BYTES + (w * HEADS + u) * DS_TILE_BYTES,
                                  p.ds + ds_tile_offset(p, b, head_of(w, u), 2 * qt + half_of(w, u), j),
                                  DS_TILE_BYTES, fb);
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    setmaxnreg_inc<240>();
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int t = lane & 3;
    float acc[HEADS][NA]; /* each started by key tile 0, which every unit with a row < S sees */
#pragma unroll
    for (int u = 0; u < HEADS; u++) undef_regs(acc[u]);
    int pend = -1;
    /* key tiles [j0, j1), each into the units of MASK (bit u: unit u). Which units take a tile is
     * a loop's template argument, not a branch around the MMAs: ptxas serialises every wgmma of a
     * kernel where one sits in a path it cannot prove uniform (C7520). */
    auto take = [&](auto mask, int j0, int j1) {
        constexpr int MASK = decltype(mask)::value;
        for (int j = j0; j < j1; j++) {
            const int st = j % STAGES;
            mbar_wait(full_bar(st), (j / STAGES) & 1);
            const uint32_t Kt = ring + st * STAGE_BYTES;
            wgmma_fence();
#pragma unroll
            for (int u = 0; u < HEADS; u++)
                if ((MASK >> u) & 1) {
                    const uint32_t dSt = Kt + K_BYTES + (wg * HEADS + u) * DS_TILE_BYTES;
#pragma unroll
                    for (int kk = 0; kk < 4; kk++)
                        wgmma_ss_nn<D, 1, 1>(acc[u], desc_mnmajor<64>(dSt, kk), desc_mnmajor<BC>(Kt, kk),
                                             j > 0 || kk > 0);
                }
            wgmma_commit();
            wgmma_wait<1>(); /* the previous tile's products have retired */
            if (pend >= 0) release_stage(empty_bar(pend % STAGES), lane);
            pend = j;
        }
    };
    /* the tiles each unit sees are a prefix [0, seen(u)) of the block's; a later unit's is longer
     * unless its rows are all past S */
    auto seen = [&](int u) {
        const int half = half_of(wg, u);
        return q0 + 64 * half < S ? min(2 * qt + half + 1, nkt) : 0;
    };
    int j = 0;
    if constexpr (HEADS == 1) {
        take(std::integral_constant<int, 1>{}, 0, seen(0));
        j = seen(0);
    } else {
        const int n0 = seen(0), n1 = seen(1), both = min(n0, n1);
        take(std::integral_constant<int, 3>{}, 0, both);
        take(std::integral_constant<int, 1>{}, both, n0);
        j = max(both, n0);
        take(std::integral_constant<int, 2>{}, j, n1);
        j = max(j, n1);
    }
    for (; j < nkt; j++) { /* seen by none of this warpgroup's units */
        mbar_wait(full_bar(j % STAGES), (j / STAGES) & 1);
        skip_tile(empty_bar(0), STAGES, j % STAGES, pend, lane);
    }
    wgmma_wait<0>();
    const size_t qstride = (size_t)Hq * D;
#pragma unroll
    for (int u = 0; u < HEADS; u++) {
        fence_regs(acc[u]);
        const int row0 = q0 + 64 * half_of(wg, u) + 16 * warp + (lane >> 2); /* and row0 + 8 */
        bwd_store_rows<D>(p.dq + (size_t)b * S * qstride + (size_t)head_of(wg, u) * D + 2 * t, qstride, acc[u],
                          row0, S, p.scale);
    }
#endif
}

bwd_tma_params tma_params(const attn_bwd_args &a, int D, int q_rows, int kv_rows, const char *what)
{
    bwd_tma_params p;
    attn_head_map(&p.map_q, a.q, a.B, a.S, a.Hq, D, q_rows, what);
    attn_head_map(&p.map_do, a.dout, a.B, a.S, a.Hq, D, q_rows, what);
    attn_head_map(&p.map_k, a.k, a.B, a.S, a.Hkv, D, kv_rows, what);
    attn_head_map(&p.map_v, a.v, a.B, a.S, a.Hkv, D, kv_rows, what);
    p.dq = a.dq, p.dk = a.dk, p.dv = a.dv;
    p.lse2 = a.lse2, p.delta = a.delta;
    p.S = a.S, p.Hq = a.Hq, p.Hkv = a.Hkv;
    p.scale = a.scale, p.scale_log2 = a.scale_log2;
    const int nt = (a.S + 63) / 64;
    p.ds = a.ds, p.ds_tiles = nt * (nt + 1) / 2;
    return p;
}

/* one launch of KERNEL over grid (its shared memory opted into at the first) */
template <auto KERNEL> void launch(size_t smem, dim3 grid, const bwd_tma_params &p)
{
    static bool opted;
    smem_opt_in(KERNEL, smem, &opted);
    KERNEL<<<grid, TMA_BWD_THREADS, smem, g_cuda.stream>>>(p);
    CUDA_LAUNCH_CHECK("attention backward (TMA)");
}

/* dK/dV over key tiles of DKDV_BK per (batch, kv head) */
template <int D, int STAGES, bool STORE_DS> void dkdv_tma_launch(const attn_bwd_args &a)
{
    launch<tc_bwd_dkdv_tma_kernel<D, STAGES, STORE_DS>>(
        dkdv_tma_smem_bytes<D, STAGES, STORE_DS>(), dim3((unsigned)(a.B * a.Hkv), (unsigned)((a.S + DKDV_BK - 1) / DKDV_BK)),
        tma_params(a, D, DKDV_BQ, DKDV_BK, "attention backward dk dv (TMA)"));
}

/* dQ over query tiles of DQ_BQ per (batch, query head), recomputing */
template <int D, int STAGES> void dq_tma_launch(const attn_bwd_args &a)
{
    const dim3 grid((unsigned)(a.B * a.Hq), (unsigned)((a.S + DQ_BQ - 1) / DQ_BQ));
    launch<tc_bwd_dq_tma_kernel<D, STAGES>>(dq_tma_smem_bytes<D, STAGES>(), grid,
                                            tma_params(a, D, DQ_BQ, DQ_BC, "attention backward dq (TMA)"));
}

/* dQ from dS over query tiles of DQ_BQ per (batch, HEADS query heads) */
template <int D, int STAGES, int HEADS> void dq_ds_launch(const attn_bwd_args &a)
{
    const dim3 grid((unsigned)(a.B * a.Hq / HEADS), (unsigned)((a.S + DQ_BQ - 1) / DQ_BQ));
    launch<tc_bwd_dq_ds_kernel<D, STAGES, HEADS>>(dq_ds_smem_bytes<D, STAGES, HEADS>(), grid,
                                                  tma_params(a, D, DQ_BQ, DQ_BC, "attention backward dq from dS (TMA)"));
}

/* two query heads a block where a kv head has an even number of them (the same bits as one;
 * H200, B=2 S=4096 Hq=32/4 D=128, in the training step: 341 us a call against 362) */
bool dq_two_heads(const attn_bwd_args &a)
{
    return (a.Hq / a.Hkv) % 2 == 0;
}

} /* namespace */

void attn_tma_dkdv(const attn_bwd_args &a, int D)
{
    if (D == 128) dkdv_tma_launch<128, 4, false>(a);
    else dkdv_tma_launch<64, 4, false>(a);
}

void attn_tma_bwd_ds(const attn_bwd_args &a, int D)
{
    const bool two = dq_two_heads(a);
    if (D == 128) {
        dkdv_tma_launch<128, 4, true>(a);
        if (two) dq_ds_launch<128, 4, 2>(a);
        else dq_ds_launch<128, 6, 1>(a);
    } else {
        dkdv_tma_launch<64, 4, true>(a);
        if (two) dq_ds_launch<64, 5, 2>(a);
        else dq_ds_launch<64, 8, 1>(a);
    }
}

void attn_tma_dq(const attn_bwd_args &a, int D)
{
    if (D == 128) dq_tma_launch<128, 4>(a);
    else dq_tma_launch<64, 4>(a);
}
