/* Causal GQA flash attention on the tensor cores: bf16 operands, fp32 accumulation, FlashAttention-2
 * structure written for mma.sync.m16n8k16 (sm_80+); the forward and the backward's two passes also
 * exist on the Hopper warpgroup MMA (wgmma), which is what runs by default on sm_90
 * (attention_tma_fwd.cu, attention_wgmma_fwd.cu, attention_tma_bwd.cu).
 *
 * Layout. q/out [B,S,Hq,D], k/v [B,S,Hkv,D] bf16 row-major; one head's rows are D contiguous
 * elements, H·D apart. Tiles are copied global -> shared with 16-byte cp.async (rows past S are
 * zero-filled) into rows padded to D+8 elements: the 16 B pad moves each row 4 banks on, so the 8
 * row addresses of an ldmatrix phase hit 8 different bank groups (no conflicts, no swizzle). Only
 * head_dim 64 and 128 have kernels (every other case goes to attention.cu's fp32 kernels).
 *
 * mma fragments (lane = 4·g + t): A 16×16 row-major, B 16×8 given as rows of Bᵀ, C 16×8 fp32 with
 * c0,c1 at (row g, cols 2t, 2t+1) and c2,c3 at (row g+8, same cols). A C tile of scores, packed to
 * bf16 pairs, is directly the A operand of the next product (P·V, dS·K, …), so P never leaves
 * registers. ldmatrix loads A operands and B operands stored as [n][k] (K for Q·Kᵀ); ldmatrix.trans
 * loads B operands stored as [k][n] (V for P·V).
 *
 * forward  (mma.sync; the wgmma forward is described in attention_wgmma_fwd.cu)
 *          grid (B·Hq, query tiles of 128), 4 warps × 32 query rows (two m16 blocks, so every K/V
 *          fragment read from shared memory feeds two mma). Key tiles of 64, double-buffered:
 *          tile j+1 is in flight while tile j is used. Online softmax in fp32 in the exp2 domain;
 *          the row sum l stays per thread until the end (the rescale factor is the same for the 4
 *          threads of a row). Tiles wholly above the diagonal are never loaded; within the last
 *          tiles a warp whose rows see none of the keys skips the tile, and only tiles that cross
 *          the diagonal (or S) pay for the mask.
 * backward (1) delta = rowsum(dO ⊙ O) and lse·log2(e), fp32, into scratch;
 *          (2) dK, dV: grid (B·Hkv, key tiles of 64), 4 warps × 16 keys; loops over the Hq/Hkv
 *              query heads of the kv group and, for each, the query tiles (64) at or after the key
 *              tile: Sᵀ = K·Qᵀ, Pᵀ = exp(Sᵀ·scale − lse), dV += Pᵀ·dO, dPᵀ = V·dOᵀ,
 *              dSᵀ = Pᵀ ⊙ (dPᵀ − delta), dK += dSᵀ·Q; dK·scale and dV leave registers once;
 *          (3) dQ: grid (B·Hq, query tiles of 64), 4 warps × 16 rows; loops over the key tiles up
 *              to the diagonal: S, P, dP = dO·Vᵀ, dS, dQ += dS·K.
 *          Each output element is accumulated by one thread in a fixed order: no atomics, so the
 *          result is deterministic (bit-identical run to run). Recomputing S and dP in the dQ pass
 *          costs 7 products instead of FA2's 5 with atomics.
 *          Passes (2) and (3) on wgmma do the same products in the same k order with the same fp32
 *          elementwise steps, and give the same bits as these mma.sync kernels (measured at the
 *          bench shape, D = 128 and 64): 1.98 ms against 3.59 ms on an H100 at B=2 S=4096 Hq=32/4
 *          D=128 (347 against 191 TFLOPS, counting 2.5× the forward's causal FLOPs).
 *          On Hopper by default (ATTN_BWD_DS) pass (2) also stores each dSᵀ tile (bf16, 1 GiB at
 *          that shape, in memory the caller lends or a scratch buffer) and pass (3) reads them
 *          back: dQ += dS·K only, 5 products, the same bits (H200: 1.38 ms against 1.54).
 * Heavy blocks first: the tile index is the slow grid dimension and runs from the longest causal
 * rows (forward, dQ: the last query tiles; dK/dV: the first key tiles) to the shortest.
 *
 * Files: this one holds the entry points (attention_tc.cuh) and the bf16-or-fp32 choice;
 * attention_tc_fwd.cu the mma.sync forward kernel and the choice of forward; attention_tma_fwd.cu
 * and attention_wgmma_fwd.cu the wgmma forwards; attention_tc_bwd.cu the backward's prep, the
 * mma.sync dK/dV and dQ kernels and the launch; attention_tma_bwd.cu and attention_tma_dq.cu the
 * wgmma backward;
 * attention_tc_common.cuh the device helpers (tile loads, ldmatrix/mma fragments) they share;
 * attention_wgmma.cuh the wgmma ones; attention_tc_launch.cuh the host-side
 * checks and the two launchers' declarations. */
#include "attention.cuh"
#include "attention_tc.cuh"
#include "attention_tc_launch.cuh"

#include <type_traits>

/* ---------------------------------------------------------------- entry points */

extern "C" bool attention_tc_forward(void *out, float *lse, const void *q, const void *k,
                                     const void *v, int B, int S, int Hq, int Hkv, int D)
{
    return tc_forward(out, lse, q, k, v, B, S, Hq, Hkv, D, nullptr);
}

extern "C" bool attention_tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                                      const void *k, const void *v, const void *out,
                                      const float *lse, int B, int S, int Hq, int Hkv, int D)
{
    return tc_backward(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, nullptr, nullptr, 0);
}

extern "C" bool attention_tc_backward_work(void *dq, void *dk, void *dv, const void *dout,
                                           const void *q, const void *k, const void *v,
                                           const void *out, const float *lse, int B, int S, int Hq,
                                           int Hkv, int D, void *work, size_t work_bytes)
{
    return tc_backward(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, nullptr, work, work_bytes);
}

extern "C" void attention_simt_forward(void *out, float *lse, const void *q, const void *k,
                                       const void *v, int B, int S, int Hq, int Hkv, int D)
{
    cu_attention_forward<bf16>(out, lse, q, k, v, B, S, Hq, Hkv, D, nullptr);
}

extern "C" void attention_simt_backward(void *dq, void *dk, void *dv, const void *dout,
                                        const void *q, const void *k, const void *v,
                                        const void *out, const float *lse, int B, int S, int Hq,
                                        int Hkv, int D)
{
    cu_attention_backward<bf16>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, nullptr);
}

extern "C" void *attention_tc_stream(void) { return (void *)g_cuda.stream; }

template <typename T>
void cu_attention_tc_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                             int B, int S, int Hq, int Hkv, int D, const int32_t *seg)
{
    if (std::is_same<T, bf16>::value && tc_forward(out, lse, q, k, v, B, S, Hq, Hkv, D, seg))
        return;
    cu_attention_forward<T>(out, lse, q, k, v, B, S, Hq, Hkv, D, seg);
}

template <typename T>
void cu_attention_tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                              const void *k, const void *v, const void *out, const float *lse,
                              int B, int S, int Hq, int Hkv, int D, const int32_t *seg, void *work,
                              size_t work_bytes)
{
    if (std::is_same<T, bf16>::value &&
        tc_backward(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, seg, work, work_bytes))
        return;
    cu_attention_backward<T>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, seg);
}

template void cu_attention_tc_forward<float>(void *, float *, const void *, const void *,
                                             const void *, int, int, int, int, int,
                                             const int32_t *);
template void cu_attention_tc_forward<bf16>(void *, float *, const void *, const void *,
                                            const void *, int, int, int, int, int,
                                            const int32_t *);
template void cu_attention_tc_backward<float>(void *, void *, void *, const void *, const void *,
                                              const void *, const void *, const void *,
                                              const float *, int, int, int, int, int,
                                              const int32_t *, void *, size_t);
template void cu_attention_tc_backward<bf16>(void *, void *, void *, const void *, const void *,
                                             const void *, const void *, const void *,
                                             const float *, int, int, int, int, int,
                                             const int32_t *, void *, size_t);
