/* Causal GQA flash attention on the tensor cores: bf16 operands, fp32 accumulation, FlashAttention-2
 * structure written for mma.sync.m16n8k16 (sm_80+; this build targets sm_90a); the backward's two
 * passes also exist on the Hopper warpgroup MMA (wgmma), which is what runs by default on sm_90
 * (attention_wgmma.cu).
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
#include "attention.cuh"
#include "attention_tc.cuh"
#include "attention_tc_common.cuh"

#include <type_traits>

namespace {

/* ---------------------------------------------------------------- forward */

/* DOCS: seg holds document ids (ops.h); false compiles the causal-only kernel as it always was. */
template <int D, int MW, int NW, int MINB, bool DOCS>
__global__ void __launch_bounds__(NW * 32, MINB)
tc_fwd_kernel(bf16 *__restrict__ out, float *__restrict__ lse, const bf16 *__restrict__ q,
              const bf16 *__restrict__ k, const bf16 *__restrict__ v, int S, int Hq, int Hkv,
              float scale, float scale_log2, const int32_t *__restrict__ seg)
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

            /* the tile crosses the diagonal or S, or documents are masked (DOCS: any tile) */
            if (DOCS || k0 + BC - 1 > q0 + wr0 || k0 + BC > S) {
                const int32_t *sb = DOCS ? seg + (size_t)b * S : nullptr;
#pragma unroll
                for (int mi = 0; mi < MW; mi++)
#pragma unroll
                    for (int nb = 0; nb < 8; nb++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int row = q0 + wr0 + mi * 16 + g + ((e >> 1) << 3);
                            const int col = k0 + nb * 8 + 2 * t + (e & 1);
                            if (col > row || col >= S || (sb && row < S && sb[row] != sb[col]))
                                s[mi][nb][e] = -INFINITY;
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

template <int D, bool DOCS>
__global__ void __launch_bounds__(TC_THREADS, 2)
tc_bwd_dkdv_kernel(bf16 *__restrict__ dk, bf16 *__restrict__ dv, const bf16 *__restrict__ dout,
                   const bf16 *__restrict__ q, const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                   const float *__restrict__ lse2, const float *__restrict__ delta, int S, int Hq,
                   int Hkv, float scale, float scale_log2, const int32_t *__restrict__ seg)
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

/* ---------------------------------------------------------------- launchers */

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

template <int D, int MW, int NW, int MINB, bool DOCS>
void tc_fwd_launch_cfg(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                       int S, int Hq, int Hkv, const int32_t *seg)
{
    constexpr int BR = 16 * MW * NW;
    constexpr size_t smem = fwd_smem_bytes<D, BR>();
    static bool opted;
    smem_opt_in(tc_fwd_kernel<D, MW, NW, MINB, DOCS>, smem, &opted);
    const float scale = tc_scale(D);
    const dim3 grid((unsigned)(B * Hq), (unsigned)((S + BR - 1) / BR));
    tc_fwd_kernel<D, MW, NW, MINB, DOCS><<<grid, NW * 32, smem, g_cuda.stream>>>(
        (bf16 *)out, lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, S, Hq, Hkv, scale,
        scale * LOG2E, seg);
    CUDA_LAUNCH_CHECK("attention tc forward");
}

/* Forward tilings (query rows per warp × warps): 0 = 32 × 4 (the default), 1 = 16 × 4, 2 = 16 × 8.
 * All three are tested; attention_tc_set_variant picks one for benchmarking. 0 wins because each
 * K/V fragment read from shared memory feeds two mma (B=2 S=4096 Hq=32/4 D=128 on an H100:
 * 0.89 ms against 1.17 and 1.11), at the price of a few spilled softmax statistics (ptxas: 52 B). */
int g_fwd_variant = 0;

template <int D>
void tc_fwd_launch(void *out, float *lse, const void *q, const void *k, const void *v, int B, int S,
                   int Hq, int Hkv, const int32_t *seg)
{
    if (seg) { /* one tiling for documents: the default */
        tc_fwd_launch_cfg<D, 2, 4, 2, true>(out, lse, q, k, v, B, S, Hq, Hkv, seg);
        return;
    }
    switch (g_fwd_variant) {
    case 1: tc_fwd_launch_cfg<D, 1, 4, 2, false>(out, lse, q, k, v, B, S, Hq, Hkv, nullptr); break;
    case 2: tc_fwd_launch_cfg<D, 1, 8, 1, false>(out, lse, q, k, v, B, S, Hq, Hkv, nullptr); break;
    default: tc_fwd_launch_cfg<D, 2, 4, 2, false>(out, lse, q, k, v, B, S, Hq, Hkv, nullptr); break;
    }
}

/* The forward with optional document ids (seg [B,S] or nullptr); false when the case is not one
 * the tensor-core kernels handle. */
bool tc_forward(void *out, float *lse, const void *q, const void *k, const void *v, int B, int S,
                int Hq, int Hkv, int D, const int32_t *seg)
{
    const void *ptrs[] = {out, q, k, v};
    if (!tc_handles(B, S, Hq, Hkv, D, ptrs, 4)) return false;
    if (B == 0 || S == 0) return true;
    if (D == 128) tc_fwd_launch<128>(out, lse, q, k, v, B, S, Hq, Hkv, seg);
    else tc_fwd_launch<64>(out, lse, q, k, v, B, S, Hq, Hkv, seg);
    return true;
}

/* Backward kernels: 0 = mma.sync (tc_bwd_dkdv_kernel / tc_bwd_dq_kernel), 1..3 = wgmma with
 * (warpgroups per block, stages) = (2, 3), (1, 2), (2, 2); chosen separately for the dK/dV and
 * the dQ pass (attention_tc_set_bwd_variant). The wgmma kernels need compute capability 9.0
 * (g_cuda.hopper; MT_FORCE_SM80=1 takes variant 0 on a Hopper GPU too).
 * H100, B=2 S=4096 Hq=32 Hkv=4, whole backward in ms (tools/bench_attention):
 *   D = 128: dkdv/dq 0/0 3.59, 1/0 2.69, 0/1 2.87, 1/1 1.98, 1/2 2.06, 1/3 2.03, 3/1 2.23, 2/1 2.46
 *   D = 64:  0/0 1.96, 1/1 1.34, 1/2 1.31, 1/3 1.36
 * Two warpgroups sharing the streamed tiles beat one warpgroup per block at two blocks per SM
 * (same registers and shared memory per SM, half the tile loads), and three stages beat two (the
 * last products of a tile overlap the next tile's barrier and first products). */
int g_bwd_dkdv = 1, g_bwd_dq = 1;

template <int D, bool DOCS> void dkdv_mma_launch(const attn_bwd_args &a)
{
    static bool opted;
    smem_opt_in(tc_bwd_dkdv_kernel<D, DOCS>, dkdv_smem_bytes<D>(), &opted);
    const unsigned ntiles = (unsigned)((a.S + TC_BC - 1) / TC_BC);
    tc_bwd_dkdv_kernel<D, DOCS><<<dim3((unsigned)(a.B * a.Hkv), ntiles), TC_THREADS,
                                  dkdv_smem_bytes<D>(), g_cuda.stream>>>(
        a.dk, a.dv, a.dout, a.q, a.k, a.v, a.lse2, a.delta, a.S, a.Hq, a.Hkv, a.scale,
        a.scale_log2, a.seg);
    CUDA_LAUNCH_CHECK("attention tc backward dk dv");
}

template <int D, bool DOCS> void dq_mma_launch(const attn_bwd_args &a)
{
    static bool opted;
    smem_opt_in(tc_bwd_dq_kernel<D, DOCS>, dq_smem_bytes<D>(), &opted);
    const unsigned ntiles = (unsigned)((a.S + TC_BC - 1) / TC_BC);
    tc_bwd_dq_kernel<D, DOCS><<<dim3((unsigned)(a.B * a.Hq), ntiles), TC_THREADS, dq_smem_bytes<D>(),
                                g_cuda.stream>>>(a.dq, a.dout, a.q, a.k, a.v, a.lse2, a.delta, a.S,
                                                 a.Hq, a.Hkv, a.scale, a.scale_log2, a.seg);
    CUDA_LAUNCH_CHECK("attention tc backward dq");
}

template <int D> void dkdv_launch(const attn_bwd_args &a, int variant)
{
    if (a.seg) dkdv_mma_launch<D, true>(a);
    else if (variant >= 1 && variant <= 3) attn_wgmma_dkdv(a, D, variant);
    else dkdv_mma_launch<D, false>(a);
}

template <int D> void dq_launch(const attn_bwd_args &a, int variant)
{
    if (a.seg) dq_mma_launch<D, true>(a);
    else if (variant >= 1 && variant <= 3) attn_wgmma_dq(a, D, variant);
    else dq_mma_launch<D, false>(a);
}

template <int D>
void tc_bwd_launch(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                   const void *v, const void *out, const float *lse, int B, int S, int Hq, int Hkv,
                   const int32_t *seg)
{
    const float scale = tc_scale(D);
    const size_t rows = (size_t)B * S * Hq;
    float *delta = (float *)cuda_scratch(SCRATCH_ATTN, 2 * rows * sizeof(float));
    float *lse2 = delta + rows;
    tc_bwd_prep_kernel<<<(unsigned)((rows + 7) / 8), 256, 0, g_cuda.stream>>>(
        delta, lse2, (const bf16 *)dout, (const bf16 *)out, lse, B, S, Hq, D);
    CUDA_LAUNCH_CHECK("attention tc backward prep");
    const attn_bwd_args a = {(bf16 *)dq, (bf16 *)dk, (bf16 *)dv, (const bf16 *)dout, (const bf16 *)q,
                        (const bf16 *)k, (const bf16 *)v, lse2, delta, B, S, Hq, Hkv, scale,
                        scale * LOG2E, seg};
    /* the sm_80 path takes mma.sync (variant 0); documents (a.seg) do too: the wgmma kernels know
     * only the causal mask */
    const bool wg = g_cuda.hopper;
    dkdv_launch<D>(a, wg ? g_bwd_dkdv : 0);
    dq_launch<D>(a, wg ? g_bwd_dq : 0);
}

} /* namespace */

/* ---------------------------------------------------------------- entry points */

extern "C" bool attention_tc_forward(void *out, float *lse, const void *q, const void *k,
                                     const void *v, int B, int S, int Hq, int Hkv, int D)
{
    return tc_forward(out, lse, q, k, v, B, S, Hq, Hkv, D, nullptr);
}

namespace {
/* The backward with optional document ids (seg [B,S] or nullptr: then the mma.sync kernels). */
bool tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                 const void *v, const void *out, const float *lse, int B, int S, int Hq, int Hkv,
                 int D, const int32_t *seg)
{
    const void *ptrs[] = {dq, dk, dv, dout, q, k, v, out};
    if (!tc_handles(B, S, Hq, Hkv, D, ptrs, 8)) return false;
    if (B == 0 || S == 0) return true;
    if (D == 128) tc_bwd_launch<128>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, seg);
    else tc_bwd_launch<64>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, seg);
    return true;
}
} /* namespace */

extern "C" bool attention_tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                                      const void *k, const void *v, const void *out,
                                      const float *lse, int B, int S, int Hq, int Hkv, int D)
{
    return tc_backward(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, nullptr);
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
                             int B, int S, int Hq, int Hkv, int D, const int32_t *seg)
{
    if (std::is_same<T, bf16>::value && tc_forward(out, lse, q, k, v, B, S, Hq, Hkv, D, seg))
        return;
    cu_attention_forward<T>(out, lse, q, k, v, B, S, Hq, Hkv, D, seg);
}

template <typename T>
void cu_attention_tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                              const void *k, const void *v, const void *out, const float *lse,
                              int B, int S, int Hq, int Hkv, int D, const int32_t *seg)
{
    if (std::is_same<T, bf16>::value &&
        tc_backward(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, seg))
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
                                              const int32_t *);
template void cu_attention_tc_backward<bf16>(void *, void *, void *, const void *, const void *,
                                             const void *, const void *, const void *,
                                             const float *, int, int, int, int, int,
                                             const int32_t *);
