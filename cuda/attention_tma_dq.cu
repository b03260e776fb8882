/* The attention backward's dQ passes on Hopper (attention_tma_bwd.cuh says how both passes work):
 * recomputing S and dP, or from the dSᵀ tiles the dK/dV pass stored. */
#include "attention_tma_bwd.cuh"

#include <type_traits>

namespace {

template <int D, int STAGES> constexpr size_t dq_tma_smem_bytes()
{
    return 1024 + (size_t)2 * DQ_BQ * D * 2 + (size_t)STAGES * 2 * DQ_BC * D * 2 + (2 * STAGES + 1) * 8;
}

template <int D, int STAGES, int HEADS> constexpr size_t dq_ds_smem_bytes()
{
    return 1024 + (size_t)STAGES * (DQ_BC * D * 2 + 2 * HEADS * DS_TILE_BYTES) + (2 * STAGES + 1) * 8;
}

/* What a block of a dQ pass covers: (batch b, query heads h .. h + HEADS - 1 of kv head hk), the
 * queries q0 .. q0 + DQ_BQ - 1 of query tile qt (the last tiles first: the longest causal rows),
 * and the key tiles of DQ_BC that reach its last query (nkt) */
struct dq_block {
    int b, h, hk, qt, q0, nkt;
};
template <int HEADS> __device__ __forceinline__ dq_block dq_block_of(const bwd_tma_params &p, int bx, int by)
{
    dq_block k;
    const int head_blocks = p.Hq / HEADS;
    k.qt = (p.S + DQ_BQ - 1) / DQ_BQ - 1 - by;
    k.b = bx / head_blocks;
    k.h = (bx - k.b * head_blocks) * HEADS;
    k.hk = k.h / (p.Hq / p.Hkv);
    k.q0 = k.qt * DQ_BQ;
    k.nkt = (min(k.q0 + DQ_BQ, p.S) - 1) / DQ_BC + 1;
    return k;
}

template <int D, int STAGES>
__global__ void __launch_bounds__(TMA_BWD_THREADS, 1)
tc_bwd_dq_tma_kernel(const __grid_constant__ bwd_tma_params p)
{
    pdl_wait(); /* first: launch.cuh */
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
    const dq_block blk = dq_block_of<1>(p, (int)blockIdx.x, (int)blockIdx.y);
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

/* A CTA's blocks of the dQ-from-dS pass: PERSIST false, the one of its grid position; true, a grid
 * of at most one CTA an SM walks the blocks (heaviest first) in rounds of gridDim.x, every other
 * round backwards so that the same CTAs do not always take a round's heaviest. The ring runs on
 * across blocks: the producer loads the next block's first tiles while the consumers finish the
 * block before and store its rows, where a CTA a block left the SM's loads idle between CTAs.
 * H200, B=2 S=4096 Hq=32/4: 327 against 350 us a call (3.61 against 3.37 TB/s, Nsight Compute),
 * the whole backward -1.4% (-2.8% at B=8 S=1024), the step -0.28%; the same bits. */
template <bool PERSIST> struct dq_items {
    int cols, n, round, i; /* blocks a row of the grid, blocks, rounds walked, the block */
    __device__ dq_items(int cols_, int rows)
        : cols(cols_), n(cols_ * rows), round(0), i(PERSIST ? at(0) : (int)(blockIdx.y * cols_ + blockIdx.x))
    {
    }
    __device__ int at(int r) const
    {
        const int g = (int)gridDim.x, c = (int)blockIdx.x;
        return r * g + ((r & 1) ? g - 1 - c : c);
    }
    __device__ bool more() const { return i < n; }
    __device__ void next() { i = PERSIST ? at(++round) : n; }
};

/* dQ from the stored dS (variant ATTN_BWD_DS): blocks of (B·Hq / HEADS, query tiles of 128)
 * heaviest first as above, each HEADS query heads of one kv head, walked by a persistent grid
 * (dq_items). Per key tile of 64 it reads the K tile and the dSᵀ tiles the dK/dV pass left:
 * dQ += dS·K, one SS product with both operands MN-major, the one product of the five left to this pass. A unit is 64 query rows of one head
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
template <int D, int STAGES, int HEADS, bool PERSIST>
__global__ void __launch_bounds__(TMA_BWD_THREADS, 1)
tc_bwd_dq_ds_kernel(const __grid_constant__ bwd_tma_params p)
{
    pdl_wait(); /* first: launch.cuh */
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
    const int item_cols = p.Hq / HEADS * p.dq_batches;
    const int item_rows = (S + DQ_BQ - 1) / DQ_BQ;

    if (threadIdx.x == 0) init_ring(bars, STAGES, 1);
    __syncthreads();

    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    if (wg == 2) {
        /* ------------------------------------------------ producer */
        setmaxnreg_dec<24>();
        if (threadIdx.x != 256) return;
        int rj = 0; /* ring tiles so far */
        for (dq_items<PERSIST> it(item_cols, item_rows); it.more(); it.next()) {
            const dq_block blk = dq_block_of<HEADS>(p, it.i % item_cols, it.i / item_cols);
            const int qt = blk.qt, b = blk.b, h = blk.h, hk = blk.hk, q0 = blk.q0, nkt = blk.nkt;
            auto head_of = [&](int w, int u) { return HEADS == 1 ? h : h + w; };
            auto half_of = [&](int w, int u) { return HEADS == 1 ? w : u; };
            auto sees = [&](int half, int j) { return q0 + 64 * half < S && j <= 2 * qt + half; };
            for (int j = 0; j < nkt; j++, rj++) {
                const int st = rj % STAGES;
                const uint32_t Kt = ring + st * STAGE_BYTES, fb = full_bar(st);
                int tiles = 0;
                for (int w = 0; w < 2; w++)
                    for (int u = 0; u < HEADS; u++) tiles += sees(half_of(w, u), j);
                mbar_wait(empty_bar(st), ((rj / STAGES) & 1) ^ 1);
                mbar_expect_tx(fb, K_BYTES + tiles * DS_TILE_BYTES);
                for (int c = 0; c < D / 64; c++) tma_3d(Kt + c * (BC * 128), &p.map_k, hk * D + 64 * c, j * BC, b, fb);
                for (int w = 0; w < 2; w++)
                    for (int u = 0; u < HEADS; u++)
                        if (sees(half_of(w, u), j))
                            bulk_load(Kt + K_BYTES + (w * HEADS + u) * DS_TILE_BYTES,
                                      p.ds + ds_tile_offset(p, b, head_of(w, u), 2 * qt + half_of(w, u), j),
                                      DS_TILE_BYTES, fb);
            }
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    setmaxnreg_inc<240>();
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int t = lane & 3;
    int rj0 = 0; /* ring tiles of the items before */
    for (dq_items<PERSIST> it(item_cols, item_rows); it.more(); it.next()) {
        const dq_block blk = dq_block_of<HEADS>(p, it.i % item_cols, it.i / item_cols);
        const int qt = blk.qt, b = blk.b, h = blk.h, q0 = blk.q0, nkt = blk.nkt;
        auto head_of = [&](int w, int u) { return HEADS == 1 ? h : h + w; };
        auto half_of = [&](int w, int u) { return HEADS == 1 ? w : u; };
        float acc[HEADS][NA]; /* each started by key tile 0, which every unit with a row < S sees */
#pragma unroll
        for (int u = 0; u < HEADS; u++) undef_regs(acc[u]);
        int pend = -1; /* a ring tile */
        /* key tiles [j0, j1), each into the units of MASK (bit u: unit u). Which units take a tile
         * is a loop's template argument, not a branch around the MMAs: ptxas serialises every
         * wgmma of a kernel where one sits in a path it cannot prove uniform (C7520). */
        auto take = [&](auto mask, int j0, int j1) {
            constexpr int MASK = decltype(mask)::value;
            for (int j = j0; j < j1; j++) {
                const int rj = rj0 + j, st = rj % STAGES;
                mbar_wait(full_bar(st), (rj / STAGES) & 1);
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
                pend = rj;
            }
        };
        /* the tiles each unit sees are a prefix [0, seen(u)) of the block's; a later unit's is
         * longer unless its rows are all past S */
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
            const int rj = rj0 + j;
            mbar_wait(full_bar(rj % STAGES), (rj / STAGES) & 1);
            skip_tile(empty_bar(0), STAGES, rj % STAGES, pend, lane);
        }
        wgmma_wait<0>();
        if (PERSIST && pend >= 0) release_stage(empty_bar(pend % STAGES), lane); /* the next item's loads */
        rj0 += nkt;
        const size_t qstride = (size_t)Hq * D;
#pragma unroll
        for (int u = 0; u < HEADS; u++) {
            fence_regs(acc[u]);
            const int row0 = q0 + 64 * half_of(wg, u) + 16 * warp + (lane >> 2); /* and row0 + 8 */
            bwd_store_rows<D>(p.dq + (size_t)b * S * qstride + (size_t)head_of(wg, u) * D + 2 * t, qstride,
                              acc[u], row0, S, p.scale);
        }
    }
#endif
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
    bwd_tma_params p = tma_params(a, D, DQ_BQ, DQ_BC, "attention backward dq from dS (TMA)");
    p.dq_batches = a.B;
    const dim3 grid((unsigned)(a.B * a.Hq / HEADS), (unsigned)((a.S + DQ_BQ - 1) / DQ_BQ));
    if (a.dq_ctas < 0) {
        launch<tc_bwd_dq_ds_kernel<D, STAGES, HEADS, false>>(dq_ds_smem_bytes<D, STAGES, HEADS>(), grid, p);
        return;
    }
    const unsigned blocks = grid.x * grid.y, most = (unsigned)(a.dq_ctas > 0 ? a.dq_ctas : g_cuda.num_sms);
    launch<tc_bwd_dq_ds_kernel<D, STAGES, HEADS, true>>(dq_ds_smem_bytes<D, STAGES, HEADS>(),
                                                        dim3(blocks < most ? blocks : most), p);
}

/* two query heads a block where a kv head has an even number of them (the same bits as one;
 * H200, B=2 S=4096 Hq=32/4 D=128, in the training step: 341 us a call against 362) */
bool dq_two_heads(const attn_bwd_args &a)
{
    return (a.Hq / a.Hkv) % 2 == 0;
}

} /* namespace */

void attn_tma_dq(const attn_bwd_args &a, int D)
{
    if (D == 128) dq_tma_launch<128, 4>(a);
    else dq_tma_launch<64, 4>(a);
}

void attn_tma_dq_from_ds(const attn_bwd_args &a, int D)
{
    const bool two = dq_two_heads(a);
    if (D == 128) {
        if (two) dq_ds_launch<128, 4, 2>(a);
        else dq_ds_launch<128, 6, 1>(a);
    } else {
        if (two) dq_ds_launch<64, 5, 2>(a);
        else dq_ds_launch<64, 8, 1>(a);
    }
}
