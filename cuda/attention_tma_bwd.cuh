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
 * two query heads (tc_bwd_dq_ds_kernel).
 *
 * This header holds what both passes share (included by attention_tma_bwd.cu, the dK/dV pass, and
 * attention_tma_dq.cu, the dQ passes); everything in its unnamed namespace is file-local to each. */
#ifndef MT_CUDA_ATTENTION_TMA_BWD_CUH
#define MT_CUDA_ATTENTION_TMA_BWD_CUH

#include "attention_wgmma.cuh"

namespace {

struct bwd_tma_params {
    CUtensorMap map_q, map_do, map_k, map_v; /* [B][S][H·D] bf16, boxes of 64 columns × rows */
    bf16 *dq, *dk, *dv;
    bf16 *ds;        /* the dSᵀ tiles (ds_tile_offset) when the dK/dV pass stores them, else null */
    float *dkdv_part; /* gridDim.z > 1: [2][gridDim.z][B][S][Hkv·D] fp32 sums of each part (attn_bwd_args) */
    const float *lse2, *delta;
    int S, Hq, Hkv;
    int ds_tiles;    /* dS tiles of one (batch, head): nt(nt + 1)/2, nt = ceil(S / 64) */
    int dq_batches;  /* the dQ-from-dS pass: B, which its persistent grid does not give */
    float scale, scale_log2;
};

constexpr int TMA_BWD_THREADS = 384;
constexpr int DKDV_BK = 128, DKDV_BQ = 64; /* keys per block, queries per streamed tile */
constexpr int DQ_BQ = 128, DQ_BC = 64;     /* queries per block, keys per streamed tile */

constexpr uint32_t DS_TILE_BYTES = 64 * 64 * 2; /* one 64 × 64 bf16 dSᵀ tile */

/* Where the dSᵀ tile of query tile qt and key tile kt (64 each, kt <= qt) of (batch b, head h)
 * starts, in elements: the tiles of the causal lower triangle, row by row, of each (b, h) in turn.
 * A tile is the bytes of a 128-byte-swizzled [64 keys][64 queries] shared-memory tile, which is
 * the MN-major A operand (rows = the k dimension) of dQ += dS·K: it goes from shared memory to
 * global memory and back in single bulk copies. */
__device__ __forceinline__ size_t ds_tile_offset(const bwd_tma_params &p, int b, int h, int qt, int kt)
{
    return (((size_t)b * p.Hq + h) * p.ds_tiles + (size_t)qt * (qt + 1) / 2 + kt) * (64 * 64);
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

bwd_tma_params tma_params(const attn_bwd_args &a, int D, int q_rows, int kv_rows, const char *what)
{
    bwd_tma_params p;
    attn_head_map(&p.map_q, a.q, a.B, a.S, a.Hq, D, q_rows, what);
    attn_head_map(&p.map_do, a.dout, a.B, a.S, a.Hq, D, q_rows, what);
    attn_head_map(&p.map_k, a.k, a.B, a.S, a.Hkv, D, kv_rows, what);
    attn_head_map(&p.map_v, a.v, a.B, a.S, a.Hkv, D, kv_rows, what);
    p.dq = a.dq, p.dk = a.dk, p.dv = a.dv, p.dkdv_part = a.dkdv_part;
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
    cuda_launch(KERNEL, grid, TMA_BWD_THREADS, smem, p);
    CUDA_LAUNCH_CHECK("attention backward (TMA)");
}

} /* namespace */

/* dQ += dS·K from the dSᵀ tiles the dK/dV pass stored (attention_tma_dq.cu) */
void attn_tma_dq_from_ds(const attn_bwd_args &a, int D);

#endif
