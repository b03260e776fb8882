/* Internal to the tensor-core attention (cuda/attention_tc_fwd.cu: forward; attention_tc_bwd.cu:
 * mma.sync backward; attention_tma_bwd.cu, attention_tma_dq.cu: the backward on wgmma): tile constants, PTX wrappers, tile
 * loads and the mma.sync fragment helpers they use, and the backward's arguments. attention_tc.cu's
 * header comment says how the kernels work. Everything but attn_bwd_args and the two wgmma entry
 * points is file-local (an unnamed namespace) in each including file. */
#ifndef MT_CUDA_ATTENTION_TC_COMMON_CUH
#define MT_CUDA_ATTENTION_TC_COMMON_CUH

#include "cuda_common.cuh"
#include "tma.cuh"   /* CUtensorMap */
#include "wgmma.cuh" /* smem_u32 */

/* What the backward passes take (scratch from the prep kernel: delta, lse·log2 e). */
struct attn_bwd_args {
    bf16 *dq, *dk, *dv;
    const bf16 *dout, *q, *k, *v;
    const float *lse2, *delta;
    int B, S, Hq, Hkv;
    float scale, scale_log2;
    const int32_t *seg;   /* [B,S] document ids or nullptr; only the mma.sync kernels read it */
    bf16 *ds;             /* attn_tma_bwd_ds: room for attn_ds_bytes(B, S, Hq) */
    /* the dK/dV pass in dkdv_split parts of each kv group's query heads (attn_dkdv_split): each
     * part's fp32 sums go to dkdv_part, [2 (dK, dV)][dkdv_split][B][S][Hkv·D], and a last kernel
     * adds them in part order; dkdv_split 1: no parts, dK and dV written directly */
    float *dkdv_part;
    int dkdv_split;
    /* the dQ-from-dS pass's CTAs: 0 one an SM (persistent, the default), n > 0 at most n
     * (persistent; tests walk many blocks a CTA), -1 one a block of 128 queries (not persistent) */
    int dq_ctas;
};

/* The forward on wgmma (sm_90a, no document masks), D = 64 or 128, variant 1..4 = (warpgroups per
 * block, keys per tile) (2, 128), (2, 64), (1, 64), (3, 64). */
void attn_wgmma_forward(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                        int S, int Hq, int Hkv, int D, float scale, int variant);
/* The warp-specialised forward (TMA producer + two wgmma consumers, sm_90a, no document masks),
 * D = 64 or 128, variant 1..5 = (keys per tile, stages, producer) (64, 4, warp), (64, 6, warp),
 * (128, 2, warpgroup), (128, 3, warpgroup), (64, 4, warpgroup). */
void attn_tma_forward(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                      int S, int Hq, int Hkv, int D, float scale, int variant);
/* The warp-specialised backward passes (attention_tma_bwd.cu, attention_tma_dq.cu; sm_90a, causal
 * only): a TMA producer warpgroup and two wgmma consumer warpgroups per block. */
void attn_tma_dkdv(const attn_bwd_args &a, int D);
void attn_tma_dq(const attn_bwd_args &a, int D);
/* Both passes with 5 products instead of 7: the dK/dV pass also stores every dSᵀ tile (bf16) to
 * a.ds, and the dQ pass reads them back instead of recomputing S and dP. Same bits as the others. */
void attn_tma_bwd_ds(const attn_bwd_args &a, int D);
/* the bytes a.ds needs: the 64 × 64 tiles of the causal lower triangle of every (batch, head) */
inline size_t attn_ds_bytes(int B, int S, int Hq)
{
    const size_t nt = (size_t)(S + 63) / 64;
    return (size_t)B * Hq * (nt * (nt + 1) / 2) * 64 * 64 * sizeof(bf16);
}
/* [B][S][H·D] bf16 as a 3-D tensor map with boxes of 64 columns × `rows` rows (the layout of
 * wgmma's 128-byte-swizzle tiles); `what` names the kernel in the error message */
void attn_head_map(CUtensorMap *m, const void *x, int B, int S, int H, int D, int rows, const char *what);

namespace {

constexpr int TC_BC = 64;      /* keys per tile (forward, dQ); queries per tile (dK/dV) */
constexpr int TC_WARPS = 4;
constexpr int TC_THREADS = TC_WARPS * 32;
constexpr int BWD_BR = 16 * TC_WARPS;          /* 64 query rows per dQ block, 64 keys per dK/dV block */
constexpr float LOG2E = 1.4426950408889634f;

/* ---------------------------------------------------------------- PTX wrappers */

/* 16 bytes global -> shared, bypassing L1; with valid false the 16 bytes are zero-filled and
 * nothing is read. */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, bool valid)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

/* wait until at most N of this thread's committed groups are still in flight */
template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c (16×8 fp32) += a (16×16 bf16) · b (16×8 bf16) */
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 2^x with the SFU's approximation (about 2 ulp; results under 2^-126 flush to 0, which only ever
 * drops a probability too small to count) */
__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* two fp32 -> one register of two bf16, lo in the low half (the lower column) */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &v, 4);
    return r;
}

/* The A operand for keys (or queries) 16·kk .. 16·kk+15 of a product whose left factor is the C
 * tile c[n-block][4] (rows × 8-column blocks): blocks 2kk and 2kk+1 side by side. */
__device__ __forceinline__ void c_to_a(uint32_t a[4], const float lo[4], const float hi[4])
{
    a[0] = pack_bf16(lo[0], lo[1]);
    a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]);
    a[3] = pack_bf16(hi[2], hi[3]);
}

/* ---------------------------------------------------------------- tile loads
 * Rows row0 .. row0+R-1 of one head (base = element (b, 0, h, 0), rows `stride` elements apart)
 * into shared memory, 16-byte chunk c of row r at the address at(r, c); rows at or past S are
 * zero-filled. Issued by all NT threads, not committed. */
template <int R, int D, int NT, class At>
__device__ __forceinline__ void load_rows_at(At at, const bf16 *base, size_t stride, int row0, int S)
{
    constexpr int CPR = D / 8; /* 16-byte chunks per row */
    if constexpr (NT % CPR == 0 && R % (NT / CPR) == 0) {
        /* a thread's chunks share their column and stand NT/CPR rows apart: one address, bumped
         * (these loads run every key tile; the general loop below cost the forward ~300 integer
         * instructions a tile per thread) */
        constexpr int RPI = NT / CPR;
        const int c = (int)threadIdx.x % CPR, r0 = (int)threadIdx.x / CPR;
        const bf16 *src = base + (size_t)(row0 + r0) * stride + c * 8;
        const size_t bump = (size_t)RPI * stride;
#pragma unroll
        for (int it = 0; it < R / RPI; it++) {
            const bool ok = row0 + r0 + it * RPI < S;
            cp_async16(at(r0 + it * RPI, c), ok ? src : base, ok);
            src += bump;
        }
    } else {
#pragma unroll
        for (int it = 0; it < (R * CPR + NT - 1) / NT; it++) {
            const int i = it * NT + (int)threadIdx.x;
            if ((R * CPR) % NT != 0 && i >= R * CPR) break; /* a last, partial round */
            const int r = i / CPR, c = i - r * CPR;
            const int row = row0 + r;
            const bool ok = row < S;
            const bf16 *src = base + (size_t)(ok ? row : 0) * stride + c * 8;
            cp_async16(at(r, c), src, ok);
        }
    }
}

/* into dst[R][D+8] (rows padded by 16 bytes against bank conflicts) */
template <int R, int D, int NT>
__device__ __forceinline__ void load_rows(bf16 *dst, const bf16 *base, size_t stride, int row0, int S)
{
    load_rows_at<R, D, NT>([dst](int r, int c) { return smem_u32(dst + r * (D + 8) + c * 8); }, base,
                           stride, row0, S);
}

/* n fp32 values src[row0 ..] into dst[0 .. n), zeros past S */
template <int NT>
__device__ __forceinline__ void load_floats(float *dst, const float *src, int row0, int n, int S)
{
    for (int i = threadIdx.x; i < n; i += NT) {
        const bool ok = row0 + i < S;
        cp_async4(smem_u32(dst + i), src + (ok ? row0 + i : 0), ok);
    }
}

/* acc[MW][8 key blocks] += A(rows ar0 + 16·mi ..) · Bᵀ where A is [*, D] and B is [64 keys, D] in
 * shared memory (both row stride D+8): Q·Kᵀ, dO·Vᵀ, K·Qᵀ, V·dOᵀ. */
template <int D, int MW>
__device__ __forceinline__ void mm_abt(float acc[MW][8][4], const bf16 *A, int ar0, const bf16 *Bm,
                                       int lane)
{
    constexpr int LDS = D + 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[MW][4];
#pragma unroll
        for (int mi = 0; mi < MW; mi++)
            ldsm_x4(a[mi], smem_u32(A + (ar0 + mi * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int nb2 = 0; nb2 < 4; nb2++) {
            uint32_t bb[4];
            ldsm_x4(bb, smem_u32(Bm + (nb2 * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 +
                                 ((lane >> 3) & 1) * 8));
#pragma unroll
            for (int mi = 0; mi < MW; mi++) {
                mma16816(acc[mi][2 * nb2], a[mi], bb[0], bb[1]);
                mma16816(acc[mi][2 * nb2 + 1], a[mi], bb[2], bb[3]);
            }
        }
    }
}

/* The C tile p[MW][8][4] (rows × 64 columns, fp32) as the bf16 A operands of a product whose
 * k dimension is those 64 columns: a[mi][kk] covers columns 16·kk .. 16·kk+15. */
template <int MW>
__device__ __forceinline__ void pack_a(uint32_t a[MW][4][4], const float p[MW][8][4])
{
#pragma unroll
    for (int mi = 0; mi < MW; mi++)
#pragma unroll
        for (int kk = 0; kk < 4; kk++) c_to_a(a[mi][kk], p[mi][2 * kk], p[mi][2 * kk + 1]);
}

/* acc[MW][D/8 blocks] += P · Bm where P is given as packed A operands (pack_a: rows × 64) and Bm
 * is [64, D] in shared memory (row stride D+8): P·V, dS·K, Pᵀ·dO, dSᵀ·Q. */
template <int D, int MW>
__device__ __forceinline__ void mm_pb(float acc[MW][D / 8][4], const uint32_t a[MW][4][4],
                                      const bf16 *Bm, int lane)
{
    constexpr int LDS = D + 8;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
#pragma unroll
        for (int db2 = 0; db2 < D / 16; db2++) {
            uint32_t bb[4];
            ldsm_x4_t(bb, smem_u32(Bm + (kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * LDS +
                                   db2 * 16 + (lane >> 4) * 8));
#pragma unroll
            for (int mi = 0; mi < MW; mi++) {
                mma16816(acc[mi][2 * db2], a[mi][kk], bb[0], bb[1]);
                mma16816(acc[mi][2 * db2 + 1], a[mi][kk], bb[2], bb[3]);
            }
        }
    }
}

template <int D, int BR> constexpr size_t fwd_smem_bytes() { return (size_t)(BR + 4 * TC_BC) * (D + 8) * 2; }
template <int D> constexpr size_t dq_smem_bytes() { return (size_t)(2 * BWD_BR + 4 * TC_BC) * (D + 8) * 2; }
template <int D> constexpr size_t dkdv_smem_bytes()
{
    return (size_t)(2 * BWD_BR + 4 * TC_BC) * (D + 8) * 2 + 4 * TC_BC * sizeof(float);
}

template <typename K> void smem_opt_in(K kernel, size_t bytes, bool *done)
{
    if (*done) return;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    *done = true;
}

} /* namespace */

#endif
