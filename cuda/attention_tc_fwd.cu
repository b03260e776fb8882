/* The tensor-core attention's forward: tc_fwd_kernel (mma.sync, online softmax, optional document
 * mask), its three tilings and their launch, tc_forward (what attention_tc.cu's entry points call)
 * and attention_tc_set_variant. How the kernel works: attention_tc.cu's header comment. */
#include "attention_tc.cuh"
#include "attention_tc_launch.cuh"

namespace {

/* DOCS: seg holds document ids (ops.h); false compiles the causal-only kernel as it always was. */
template <int D, int MW, int NW, int MINB, bool DOCS>
__global__ void __launch_bounds__(NW * 32, MINB)
tc_fwd_kernel(bf16 *__restrict__ out, float *__restrict__ lse, const bf16 *__restrict__ q,
              const bf16 *__restrict__ k, const bf16 *__restrict__ v, int S, int Hq, int Hkv,
              float scale, float scale_log2, const int32_t *__restrict__ seg)
{
    pdl_wait(); /* first: launch.cuh */
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
    cuda_launch(tc_fwd_kernel<D, MW, NW, MINB, DOCS>, grid, NW * 32, smem,
        (bf16 *)out, lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, S, Hq, Hkv, scale,
        scale * LOG2E, seg);
    CUDA_LAUNCH_CHECK("attention tc forward");
}

/* Forward kernels: mma.sync tilings (query rows per warp × warps) 0 = 32 × 4, 1 = 16 × 4,
 * 2 = 16 × 8; on sm_90a the wgmma kernels 3, 4, 5, 6 (attention_wgmma_fwd.cu: warpgroups × keys
 * per tile 2 × 128, 2 × 64, 1 × 64, 3 × 64) and 7 .. 11 (attention_tma_fwd.cu: TMA producer, two
 * consumer warpgroups; 7, 8 = a producer warp, 64-key tiles, 4 or 6 stages; 9, 10 = a producer
 * warpgroup that hands its registers to the consumers, 128-key tiles, 2 or 3 stages; 11 = the
 * same with 64-key tiles, 4 stages). -1, the default, takes 10 where the wgmma kernels may run (a
 * Hopper GPU without MT_FORCE_SM80) and 0 elsewhere. At B=2 S=4096 Hq=32/4 on an H100 (ms, tenth
 * session): D=128 10: 0.474 (580 TFLOPS), 11: 0.550, 7: 0.555, 8: 0.557, 5: 0.662, 3: 0.677,
 * 9: 0.729 (two stages: the next tile's load waits for the previous P·V), mma.sync 0: 0.848;
 * D=64 10: 0.338, 7: 0.389, 11: 0.390, 5: 0.399, 0: 0.448. Among the mma.sync tilings 0 wins
 * because each K/V fragment read from shared memory feeds two mma, at the price of a few spilled
 * softmax statistics (ptxas: 52 B). All are tested; attention_tc_set_variant picks one for
 * benchmarking. Documents always take tiling 0. */
int g_fwd_variant = -1;

template <int D>
void tc_fwd_launch(void *out, float *lse, const void *q, const void *k, const void *v, int B, int S,
                   int Hq, int Hkv, const int32_t *seg)
{
    if (seg) { /* one tiling for documents: the default */
        tc_fwd_launch_cfg<D, 2, 4, 2, true>(out, lse, q, k, v, B, S, Hq, Hkv, seg);
        return;
    }
    int variant = g_fwd_variant < 0 ? (g_cuda.hopper ? 10 : 0) : g_fwd_variant;
    if (variant >= 3 && !g_cuda.hopper) variant = 0;
    switch (variant) {
    case 1: tc_fwd_launch_cfg<D, 1, 4, 2, false>(out, lse, q, k, v, B, S, Hq, Hkv, nullptr); break;
    case 2: tc_fwd_launch_cfg<D, 1, 8, 1, false>(out, lse, q, k, v, B, S, Hq, Hkv, nullptr); break;
    case 3: case 4: case 5: case 6:
        attn_wgmma_forward(out, lse, q, k, v, B, S, Hq, Hkv, D, tc_scale(D), variant - 2);
        break;
    case 7: case 8: case 9: case 10: case 11:
        attn_tma_forward(out, lse, q, k, v, B, S, Hq, Hkv, D, tc_scale(D), variant - 6);
        break;
    default: tc_fwd_launch_cfg<D, 2, 4, 2, false>(out, lse, q, k, v, B, S, Hq, Hkv, nullptr); break;
    }
}

} /* namespace */

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

extern "C" int attention_tc_set_variant(int fwd)
{
    const int old = g_fwd_variant;
    if (fwd >= -1 && fwd <= 11) g_fwd_variant = fwd;
    return old;
}
