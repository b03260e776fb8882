/* Causal GQA flash attention on the tensor cores: bf16 operands, fp32 accumulation, FlashAttention-2
 * structure written for mma.sync.m16n8k16 (sm_80+; this build targets sm_90a); the backward's two
 * passes also exist on the Hopper warpgroup MMA (wgmma), which is what runs by default on sm_90
 * (see "backward on wgmma" below).
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
 * forward  grid (B·Hq, query tiles of 128), 4 warps × 32 query rows (two m16 blocks, so every K/V
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
 * Heavy blocks first: the tile index is the slow grid dimension and runs from the longest causal
 * rows (forward, dQ: the last query tiles; dK/dV: the first key tiles) to the shortest. */
#include "attention.cuh"
#include "attention_tc.cuh"

#include <type_traits>

namespace {

constexpr int TC_BC = 64;      /* keys per tile (forward, dQ); queries per tile (dK/dV) */
constexpr int TC_WARPS = 4;
constexpr int TC_THREADS = TC_WARPS * 32;
constexpr int BWD_BR = 16 * TC_WARPS;          /* 64 query rows per dQ block, 64 keys per dK/dV block */
constexpr float LOG2E = 1.4426950408889634f;

/* ---------------------------------------------------------------- PTX wrappers */

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

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
 * into dst[R][D+8]; rows at or past S are zero-filled. Issued by all NT threads, not committed. */
template <int R, int D, int NT>
__device__ __forceinline__ void load_rows(bf16 *dst, const bf16 *base, size_t stride, int row0, int S)
{
    constexpr int CPR = D / 8; /* 16-byte chunks per row */
    static_assert((R * CPR) % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int it = 0; it < R * CPR / NT; it++) {
        const int i = it * NT + (int)threadIdx.x;
        const int r = i / CPR, c = i - r * CPR;
        const int row = row0 + r;
        const bool ok = row < S;
        const bf16 *src = base + (size_t)(ok ? row : 0) * stride + c * 8;
        cp_async16(smem_u32(dst + r * (D + 8) + c * 8), src, ok);
    }
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

/* ---------------------------------------------------------------- forward */

template <int D, int MW, int NW, int MINB>
__global__ void __launch_bounds__(NW * 32, MINB)
tc_fwd_kernel(bf16 *__restrict__ out, float *__restrict__ lse, const bf16 *__restrict__ q,
              const bf16 *__restrict__ k, const bf16 *__restrict__ v, int S, int Hq, int Hkv,
              float scale, float scale_log2)
{
    constexpr int NT = NW * 32, BR = 16 * MW * NW, BC = TC_BC, LDS = D + 8, DB = D / 8;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16 *Qs = reinterpret_cast<bf16 *>(smem_raw);
    bf16 *Ks = Qs + BR * LDS; /* [2][BC][LDS] */
    bf16 *Vs = Ks + 2 * BC * LDS;

    const int nqt = (S + BR - 1) / BR;
    const int qt = nqt - 1 - (int)blockIdx.y;
    const int bh = blockIdx.x, b = bh / Hq, h = bh - b * Hq, hk = h / (Hq / Hkv);
    const int q0 = qt * BR;
    const int nkt = (min(q0 + BR, S) - 1) / BC + 1; /* key tiles up to the last real query */
    const size_t qstride = (size_t)Hq * D, kstride = (size_t)Hkv * D;
    const bf16 *qb = q + (size_t)b * S * qstride + (size_t)h * D;
    const bf16 *kb = k + (size_t)b * S * kstride + (size_t)hk * D;
    const bf16 *vb = v + (size_t)b * S * kstride + (size_t)hk * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wr0 = warp * 16 * MW;     /* the warp's first row in the tile */
    const int wlast = q0 + wr0 + 16 * MW - 1; /* the warp's last query */

    load_rows<BR, D, NT>(Qs, qb, qstride, q0, S);
    load_rows<BC, D, NT>(Ks, kb, kstride, 0, S);
    load_rows<BC, D, NT>(Vs, vb, kstride, 0, S);
    cp_async_commit();

    float o[MW][DB][4], m[MW][2], l[MW][2];
#pragma unroll
    for (int mi = 0; mi < MW; mi++) {
#pragma unroll
        for (int db = 0; db < DB; db++) o[mi][db][0] = o[mi][db][1] = o[mi][db][2] = o[mi][db][3] = 0.0f;
        m[mi][0] = m[mi][1] = -INFINITY;
        l[mi][0] = l[mi][1] = 0.0f;
    }

    for (int j = 0; j < nkt; j++) {
        const int buf = j & 1;
        if (j + 1 < nkt) {
            load_rows<BC, D, NT>(Ks + (buf ^ 1) * BC * LDS, kb, kstride, (j + 1) * BC, S);
            load_rows<BC, D, NT>(Vs + (buf ^ 1) * BC * LDS, vb, kstride, (j + 1) * BC, S);
        }
        cp_async_commit(); /* possibly empty: keeps the group count uniform */
        cp_async_wait<1>(); /* tile j (and Q) has landed */
        __syncthreads();

        const int k0 = j * BC;
        if (k0 <= wlast) { /* else every key of the tile is after every row of this warp */
            const bf16 *Kt = Ks + buf * BC * LDS, *Vt = Vs + buf * BC * LDS;
            float s[MW][8][4];
#pragma unroll
            for (int mi = 0; mi < MW; mi++)
#pragma unroll
                for (int nb = 0; nb < 8; nb++) s[mi][nb][0] = s[mi][nb][1] = s[mi][nb][2] = s[mi][nb][3] = 0.0f;
            mm_abt<D, MW>(s, Qs, wr0, Kt, lane);

            if (k0 + BC - 1 > q0 + wr0 || k0 + BC > S) { /* the tile crosses the diagonal or S */
#pragma unroll
                for (int mi = 0; mi < MW; mi++)
#pragma unroll
                    for (int nb = 0; nb < 8; nb++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int row = q0 + wr0 + mi * 16 + g + ((e >> 1) << 3);
                            const int col = k0 + nb * 8 + 2 * t + (e & 1);
                            if (col > row || col >= S) s[mi][nb][e] = -INFINITY;
                        }
            }

#pragma unroll
            for (int mi = 0; mi < MW; mi++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int nb = 0; nb < 8; nb++) mx = fmaxf(mx, fmaxf(s[mi][nb][2 * r], s[mi][nb][2 * r + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float mnew = fmaxf(m[mi][r], mx);
                    /* a row with nothing visible yet keeps p = 0 (not NaN) */
                    const float base = mnew == -INFINITY ? 0.0f : mnew * scale_log2;
                    const float alpha = ex2(m[mi][r] * scale_log2 - base);
                    float rs = 0.0f;
#pragma unroll
                    for (int nb = 0; nb < 8; nb++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const float p = ex2(fmaf(s[mi][nb][2 * r + e], scale_log2, -base));
                            s[mi][nb][2 * r + e] = p;
                            rs += p;
                        }
                    l[mi][r] = l[mi][r] * alpha + rs;
                    m[mi][r] = mnew;
#pragma unroll
                    for (int db = 0; db < DB; db++) {
                        o[mi][db][2 * r] *= alpha;
                        o[mi][db][2 * r + 1] *= alpha;
                    }
                }
            uint32_t pa[MW][4][4];
            pack_a<MW>(pa, s);
            mm_pb<D, MW>(o, pa, Vt, lane);
        }
        __syncthreads(); /* everyone is done with buffer `buf` before it is refilled */
    }

#pragma unroll
    for (int mi = 0; mi < MW; mi++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float ls = l[mi][r];
            ls += __shfl_xor_sync(0xffffffffu, ls, 1);
            ls += __shfl_xor_sync(0xffffffffu, ls, 2);
            const int row = q0 + wr0 + mi * 16 + g + 8 * r;
            if (row >= S) continue;
            const float inv = 1.0f / ls;
            bf16 *dst = out + ((size_t)b * S + row) * qstride + (size_t)h * D + 2 * t;
#pragma unroll
            for (int db = 0; db < DB; db++)
                *reinterpret_cast<__nv_bfloat162 *>(dst + db * 8) =
                    __floats2bfloat162_rn(o[mi][db][2 * r] * inv, o[mi][db][2 * r + 1] * inv);
            if (t == 0) lse[((size_t)b * Hq + h) * S + row] = m[mi][r] * scale + logf(ls);
        }
}

/* ---------------------------------------------------------------- backward */

/* delta[b,h,i] = Σ_d dO·O and lse2[b,h,i] = lse·log2(e) (both [B,Hq,S]); one warp per (b, i, h) */
__global__ void tc_bwd_prep_kernel(float *__restrict__ delta, float *__restrict__ lse2,
                                   const bf16 *__restrict__ dout, const bf16 *__restrict__ out,
                                   const float *__restrict__ lse, int B, int S, int Hq, int D)
{
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

template <int D>
__global__ void __launch_bounds__(TC_THREADS, 2)
tc_bwd_dkdv_kernel(bf16 *__restrict__ dk, bf16 *__restrict__ dv, const bf16 *__restrict__ dout,
                   const bf16 *__restrict__ q, const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                   const float *__restrict__ lse2, const float *__restrict__ delta, int S, int Hq,
                   int Hkv, float scale, float scale_log2)
{
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

            const bool mask = q0 < wkey + 15 || q0 + BQ > S;
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = nb * 8 + 2 * t + (e & 1);
                    float p = ex2(fmaf(st[0][nb][e], scale_log2, -lt[c]));
                    if (mask) {
                        const int key = wkey + g + ((e >> 1) << 3), qi = q0 + c;
                        if (qi < key || qi >= S) p = 0.0f;
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

template <int D>
__global__ void __launch_bounds__(TC_THREADS, 2)
tc_bwd_dq_kernel(bf16 *__restrict__ dq, const bf16 *__restrict__ dout, const bf16 *__restrict__ q,
                 const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                 const float *__restrict__ lse2, const float *__restrict__ delta, int S, int Hq,
                 int Hkv, float scale, float scale_log2)
{
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
            const bool mask = k0 + BC - 1 > q0 + wr0 || k0 + BC > S;
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = e >> 1;
                    float p = ex2(fmaf(s[0][nb][e], scale_log2, -lr[r]));
                    if (mask) {
                        const int row = q0 + wr0 + g + 8 * r, col = k0 + nb * 8 + 2 * t + (e & 1);
                        if (col > row || col >= S) p = 0.0f;
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

__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* keeps the compiler from moving reads of an accumulator above the wait for its MMA */
template <int N> __device__ __forceinline__ void fence_regs(float (&x)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(x[i])::"memory");
}

/* wgmma shared-memory descriptor: 128-byte swizzle, 8-row groups 1024 B apart, LBO as given */
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo)
{
    return (uint64_t)((addr & 0x3ffffu) >> 4) | ((uint64_t)(lbo >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

/* k step kk (columns 16kk ..) of the K-major operand rows r0 .. of a tile of R rows */
template <int R> __device__ __forceinline__ uint64_t desc_kmajor(uint32_t tile, int r0, int kk)
{
    return sw128_desc(tile + (uint32_t)(kk >> 2) * (R * 128) + (uint32_t)r0 * 128 + (kk & 3) * 32, 16);
}

/* k step kk (rows 16kk ..) of a tile of R rows read as an MN-major operand (n = the D columns) */
template <int R> __device__ __forceinline__ uint64_t desc_mnmajor(uint32_t tile, int kk)
{
    return sw128_desc(tile + (uint32_t)kk * 2048, R * 128);
}

/* d[64×64] (+)= A[64×16] · B[64×16]ᵀ, both K-major in shared memory */
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(acc));
}

/* d[64×64] (+)= A[64×16] · B[16×64], A in registers (the mma A fragment, warp w of the group
 * holding rows 16w ..), B MN-major in shared memory */
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

/* d[64×128] (+)= A[64×16] · B[16×128], A in registers (the mma A fragment, warp w of the group
 * holding rows 16w ..), B MN-major in shared memory */
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

template <int D>
__device__ __forceinline__ void wgmma_rs_nd(float (&d)[D / 2], const uint32_t (&a)[4], uint64_t db, int acc)
{
    if constexpr (D == 128) wgmma_rs_n128(d, a, db, acc);
    else wgmma_rs_n64(d, a, db, acc);
}

/* Accumulators are never zeroed by ordinary instructions: ptxas serializes every wgmma of a
 * function in which a non-wgmma instruction writes an accumulator register inside a span of
 * MMAs in flight, which with MMAs left running across loop iterations is the whole loop. Their
 * first MMA ignores the old contents instead (scale-d = 0); this marks them as set for the
 * compiler without an instruction. */
template <int N> __device__ __forceinline__ void undef_regs(float (&x)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "=f"(x[i]));
}

/* Rows row0 .. row0+R-1 of one head (as load_rows) into the swizzled layout at dst */
template <int R, int D, int NT>
__device__ __forceinline__ void load_rows_sw(uint32_t dst, const bf16 *base, size_t stride, int row0, int S)
{
    constexpr int CPR = D / 8;
    static_assert((R * CPR) % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int it = 0; it < R * CPR / NT; it++) {
        const int i = it * NT + (int)threadIdx.x;
        const int r = i / CPR, c = i - r * CPR;
        const int row = row0 + r;
        const bool ok = row < S;
        const bf16 *src = base + (size_t)(ok ? row : 0) * stride + c * 8;
        cp_async16(dst + (uint32_t)(c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4), src, ok);
    }
}

/* the C tile c[32] (64 rows × 64 columns over the warpgroup) as the A operands of a product
 * whose k dimension is those 64 columns: a[kk] covers columns 16kk .. 16kk+15 */
__device__ __forceinline__ void pack_a64(uint32_t a[4][4], const float c[32])
{
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        a[kk][0] = pack_bf16(c[8 * kk], c[8 * kk + 1]);
        a[kk][1] = pack_bf16(c[8 * kk + 2], c[8 * kk + 3]);
        a[kk][2] = pack_bf16(c[8 * kk + 4], c[8 * kk + 5]);
        a[kk][3] = pack_bf16(c[8 * kk + 6], c[8 * kk + 7]);
    }
}

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

            const bool mask = q0 < wk0 + 63 || q0 + BQ > S;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float2 l2 = *reinterpret_cast<const float2 *>(lt + 8 * j + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float p = ex2(fmaf(s[4 * j + e], scale_log2, (e & 1) ? -l2.y : -l2.x));
                    if (mask) {
                        const int key = key0 + ((e >> 1) << 3), qi = q0 + 8 * j + 2 * t + (e & 1);
                        if (qi < key || qi >= S) p = 0.0f;
                    }
                    pt[4 * j + e] = p;
                }
            }
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

            const bool mask = k0 + BC - 1 > wq0 || k0 + BC > S;
#pragma unroll
            for (int jb = 0; jb < 8; jb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = e >> 1;
                    float p = ex2(fmaf(s[4 * jb + e], scale_log2, -lr[r]));
                    if (mask) {
                        const int row = row0 + 8 * r, col = k0 + 8 * jb + 2 * t + (e & 1);
                        if (col > row || col >= S) p = 0.0f;
                    }
                    ds[4 * jb + e] = p;
                }
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
}

/* ---------------------------------------------------------------- launchers */

template <typename K> void smem_opt_in(K kernel, size_t bytes, bool *done)
{
    if (*done) return;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    *done = true;
}

/* The same fp32 scale as attention.cu and the CPU reference: head_dim ** -0.5 in double. */
float tc_scale(int D) { return (float)(1.0 / sqrt((double)D)); }

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Shapes and pointers these kernels take; anything else goes to attention.cu. */
bool tc_handles(int B, int S, int Hq, int Hkv, int D, const void *const *ptrs, int nptr)
{
    if (!g_cuda.ready) return false;
    if (D != 64 && D != 128) return false;
    if (B < 0 || S < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0) return false;
    /* grid limits: y counts tiles (<= 65535), x counts (batch, head) pairs */
    if ((S + TC_BC - 1) / TC_BC > 65535 || (long long)B * Hq > 0x7fffffffLL) return false;
    for (int i = 0; i < nptr; i++)
        if (!aligned16(ptrs[i])) return false;
    return true;
}

template <int D, int MW, int NW, int MINB>
void tc_fwd_launch_cfg(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                       int S, int Hq, int Hkv)
{
    constexpr int BR = 16 * MW * NW;
    constexpr size_t smem = fwd_smem_bytes<D, BR>();
    static bool opted;
    smem_opt_in(tc_fwd_kernel<D, MW, NW, MINB>, smem, &opted);
    const float scale = tc_scale(D);
    const dim3 grid((unsigned)(B * Hq), (unsigned)((S + BR - 1) / BR));
    tc_fwd_kernel<D, MW, NW, MINB><<<grid, NW * 32, smem, g_cuda.stream>>>(
        (bf16 *)out, lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, S, Hq, Hkv, scale,
        scale * LOG2E);
    CUDA_LAUNCH_CHECK("attention tc forward");
}

/* Forward tilings (query rows per warp × warps): 0 = 32 × 4 (the default), 1 = 16 × 4, 2 = 16 × 8.
 * All three are tested; attention_tc_set_variant picks one for benchmarking. 0 wins because each
 * K/V fragment read from shared memory feeds two mma (B=2 S=4096 Hq=32/4 D=128 on an H100:
 * 0.89 ms against 1.17 and 1.11), at the price of a few spilled softmax statistics (ptxas: 52 B). */
int g_fwd_variant = 0;

template <int D>
void tc_fwd_launch(void *out, float *lse, const void *q, const void *k, const void *v, int B, int S,
                   int Hq, int Hkv)
{
    switch (g_fwd_variant) {
    case 1: tc_fwd_launch_cfg<D, 1, 4, 2>(out, lse, q, k, v, B, S, Hq, Hkv); break;
    case 2: tc_fwd_launch_cfg<D, 1, 8, 1>(out, lse, q, k, v, B, S, Hq, Hkv); break;
    default: tc_fwd_launch_cfg<D, 2, 4, 2>(out, lse, q, k, v, B, S, Hq, Hkv); break;
    }
}

/* Backward kernels: 0 = mma.sync (tc_bwd_dkdv_kernel / tc_bwd_dq_kernel), 1..3 = wgmma with
 * (warpgroups per block, stages) = (2, 3), (1, 2), (2, 2); chosen separately for the dK/dV and
 * the dQ pass (attention_tc_set_bwd_variant). The wgmma kernels need compute capability 9.0.
 * H100, B=2 S=4096 Hq=32 Hkv=4, whole backward in ms (tools/bench_attention):
 *   D = 128: dkdv/dq 0/0 3.59, 1/0 2.69, 0/1 2.87, 1/1 1.98, 1/2 2.06, 1/3 2.03, 3/1 2.23, 2/1 2.46
 *   D = 64:  0/0 1.96, 1/1 1.34, 1/2 1.31, 1/3 1.36
 * Two warpgroups sharing the streamed tiles beat one warpgroup per block at two blocks per SM
 * (same registers and shared memory per SM, half the tile loads), and three stages beat two (the
 * last products of a tile overlap the next tile's barrier and first products). */
int g_bwd_dkdv = 1, g_bwd_dq = 1;

bool have_wgmma()
{
    static int cc = -1;
    if (cc < 0) {
        int major = 0, minor = 0;
        CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, g_cuda.device));
        CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, g_cuda.device));
        cc = major * 10 + minor;
    }
    return cc == 90;
}

struct bwd_args {
    bf16 *dq, *dk, *dv;
    const bf16 *dout, *q, *k, *v;
    const float *lse2, *delta;
    int B, S, Hq, Hkv;
    float scale, scale_log2;
};

template <int D, int NWG, int STAGES> void dkdv_wg_launch(const bwd_args &a)
{
    constexpr size_t smem = dkdv_wg_smem_bytes<D, NWG, STAGES>();
    static bool opted;
    smem_opt_in(tc_bwd_dkdv_wg_kernel<D, NWG, STAGES>, smem, &opted);
    const dim3 grid((unsigned)(a.B * a.Hkv), (unsigned)((a.S + 64 * NWG - 1) / (64 * NWG)));
    tc_bwd_dkdv_wg_kernel<D, NWG, STAGES><<<grid, NWG * 128, smem, g_cuda.stream>>>(
        a.dk, a.dv, a.dout, a.q, a.k, a.v, a.lse2, a.delta, a.S, a.Hq, a.Hkv, a.scale, a.scale_log2);
    CUDA_LAUNCH_CHECK("attention tc backward dk dv (wgmma)");
}

template <int D, int NWG, int STAGES> void dq_wg_launch(const bwd_args &a)
{
    constexpr size_t smem = dq_wg_smem_bytes<D, NWG, STAGES>();
    static bool opted;
    smem_opt_in(tc_bwd_dq_wg_kernel<D, NWG, STAGES>, smem, &opted);
    const dim3 grid((unsigned)(a.B * a.Hq), (unsigned)((a.S + 64 * NWG - 1) / (64 * NWG)));
    tc_bwd_dq_wg_kernel<D, NWG, STAGES><<<grid, NWG * 128, smem, g_cuda.stream>>>(
        a.dq, a.dout, a.q, a.k, a.v, a.lse2, a.delta, a.S, a.Hq, a.Hkv, a.scale, a.scale_log2);
    CUDA_LAUNCH_CHECK("attention tc backward dq (wgmma)");
}

template <int D> void dkdv_launch(const bwd_args &a, int variant)
{
    switch (variant) {
    case 1: dkdv_wg_launch<D, 2, 3>(a); return;
    case 2: dkdv_wg_launch<D, 1, 2>(a); return;
    case 3: dkdv_wg_launch<D, 2, 2>(a); return;
    default: break;
    }
    static bool opted;
    smem_opt_in(tc_bwd_dkdv_kernel<D>, dkdv_smem_bytes<D>(), &opted);
    const unsigned ntiles = (unsigned)((a.S + TC_BC - 1) / TC_BC);
    tc_bwd_dkdv_kernel<D><<<dim3((unsigned)(a.B * a.Hkv), ntiles), TC_THREADS, dkdv_smem_bytes<D>(),
                            g_cuda.stream>>>(a.dk, a.dv, a.dout, a.q, a.k, a.v, a.lse2, a.delta,
                                             a.S, a.Hq, a.Hkv, a.scale, a.scale_log2);
    CUDA_LAUNCH_CHECK("attention tc backward dk dv");
}

template <int D> void dq_launch(const bwd_args &a, int variant)
{
    switch (variant) {
    case 1: dq_wg_launch<D, 2, 3>(a); return;
    case 2: dq_wg_launch<D, 1, 2>(a); return;
    case 3: dq_wg_launch<D, 2, 2>(a); return;
    default: break;
    }
    static bool opted;
    smem_opt_in(tc_bwd_dq_kernel<D>, dq_smem_bytes<D>(), &opted);
    const unsigned ntiles = (unsigned)((a.S + TC_BC - 1) / TC_BC);
    tc_bwd_dq_kernel<D><<<dim3((unsigned)(a.B * a.Hq), ntiles), TC_THREADS, dq_smem_bytes<D>(),
                          g_cuda.stream>>>(a.dq, a.dout, a.q, a.k, a.v, a.lse2, a.delta, a.S, a.Hq,
                                           a.Hkv, a.scale, a.scale_log2);
    CUDA_LAUNCH_CHECK("attention tc backward dq");
}

template <int D>
void tc_bwd_launch(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                   const void *v, const void *out, const float *lse, int B, int S, int Hq, int Hkv)
{
    const float scale = tc_scale(D);
    const size_t rows = (size_t)B * S * Hq;
    float *delta = (float *)cuda_scratch(SCRATCH_ATTN, 2 * rows * sizeof(float));
    float *lse2 = delta + rows;
    tc_bwd_prep_kernel<<<(unsigned)((rows + 7) / 8), 256, 0, g_cuda.stream>>>(
        delta, lse2, (const bf16 *)dout, (const bf16 *)out, lse, B, S, Hq, D);
    CUDA_LAUNCH_CHECK("attention tc backward prep");
    const bwd_args a = {(bf16 *)dq, (bf16 *)dk, (bf16 *)dv, (const bf16 *)dout, (const bf16 *)q,
                        (const bf16 *)k, (const bf16 *)v, lse2, delta, B, S, Hq, Hkv, scale,
                        scale * LOG2E};
    const bool wg = have_wgmma();
    dkdv_launch<D>(a, wg ? g_bwd_dkdv : 0);
    dq_launch<D>(a, wg ? g_bwd_dq : 0);
}

} /* namespace */

/* ---------------------------------------------------------------- entry points */

extern "C" bool attention_tc_forward(void *out, float *lse, const void *q, const void *k,
                                     const void *v, int B, int S, int Hq, int Hkv, int D)
{
    const void *ptrs[] = {out, q, k, v};
    if (!tc_handles(B, S, Hq, Hkv, D, ptrs, 4)) return false;
    if (B == 0 || S == 0) return true;
    if (D == 128) tc_fwd_launch<128>(out, lse, q, k, v, B, S, Hq, Hkv);
    else tc_fwd_launch<64>(out, lse, q, k, v, B, S, Hq, Hkv);
    return true;
}

extern "C" bool attention_tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                                      const void *k, const void *v, const void *out,
                                      const float *lse, int B, int S, int Hq, int Hkv, int D)
{
    const void *ptrs[] = {dq, dk, dv, dout, q, k, v, out};
    if (!tc_handles(B, S, Hq, Hkv, D, ptrs, 8)) return false;
    if (B == 0 || S == 0) return true;
    if (D == 128) tc_bwd_launch<128>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv);
    else tc_bwd_launch<64>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv);
    return true;
}

extern "C" void attention_simt_forward(void *out, float *lse, const void *q, const void *k,
                                       const void *v, int B, int S, int Hq, int Hkv, int D)
{
    cu_attention_forward<bf16>(out, lse, q, k, v, B, S, Hq, Hkv, D);
}

extern "C" void attention_simt_backward(void *dq, void *dk, void *dv, const void *dout,
                                        const void *q, const void *k, const void *v,
                                        const void *out, const float *lse, int B, int S, int Hq,
                                        int Hkv, int D)
{
    cu_attention_backward<bf16>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D);
}

extern "C" void *attention_tc_stream(void) { return (void *)g_cuda.stream; }

extern "C" int attention_tc_set_bwd_variant(int variant)
{
    const int old = g_bwd_dkdv + 4 * g_bwd_dq;
    if (variant >= 0 && variant < 16) g_bwd_dkdv = variant % 4, g_bwd_dq = variant / 4;
    return old;
}

extern "C" int attention_tc_set_variant(int fwd)
{
    const int old = g_fwd_variant;
    if (fwd >= 0 && fwd <= 2) g_fwd_variant = fwd;
    return old;
}

template <typename T>
void cu_attention_tc_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                             int B, int S, int Hq, int Hkv, int D)
{
    if (std::is_same<T, bf16>::value && attention_tc_forward(out, lse, q, k, v, B, S, Hq, Hkv, D))
        return;
    cu_attention_forward<T>(out, lse, q, k, v, B, S, Hq, Hkv, D);
}

template <typename T>
void cu_attention_tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                              const void *k, const void *v, const void *out, const float *lse,
                              int B, int S, int Hq, int Hkv, int D)
{
    if (std::is_same<T, bf16>::value &&
        attention_tc_backward(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D))
        return;
    cu_attention_backward<T>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D);
}

template void cu_attention_tc_forward<float>(void *, float *, const void *, const void *,
                                             const void *, int, int, int, int, int);
template void cu_attention_tc_forward<bf16>(void *, float *, const void *, const void *,
                                            const void *, int, int, int, int, int);
template void cu_attention_tc_backward<float>(void *, void *, void *, const void *, const void *,
                                              const void *, const void *, const void *,
                                              const float *, int, int, int, int, int);
template void cu_attention_tc_backward<bf16>(void *, void *, void *, const void *, const void *,
                                             const void *, const void *, const void *,
                                             const float *, int, int, int, int, int);
