/* The attention forward on the Hopper warpgroup MMA (sm_90a): causal GQA flash attention, bf16
 * operands, fp32 accumulation and online softmax, the same maths as tc_fwd_kernel (mma.sync,
 * attention_tc_fwd.cu), which stays the sm_80 path and the one for document masks.
 *
 * Grid (B·Hq, query tiles of 64·NWG), heaviest tiles first; warpgroup w owns queries 64w .. 64w+63
 * of the tile. The Q tile is loaded once; key tiles of BC keys stream through shared memory (K in 2
 * buffers, V in 3, cp.async'd one tile ahead, in the 128-byte-swizzled layout of attention_wgmma.cuh).
 * Per key tile j a warpgroup issues S_j = Q·K_jᵀ (SS wgmma m64nBCk16) and then O += P_{j-1}·V_{j-1}
 * (RS wgmma m64nDk16, P from registers), waits for S_j only, and does tile j's softmax — max,
 * exponentials, row sums, packing P_j to bf16 — while P_{j-1}·V_{j-1} is still on the tensor
 * cores; only the rescale of O by exp(m_old − m_new) waits for it. This software pipelining is why
 * P is double-buffered in registers (an RS wgmma reads its A registers until it retires) and why V
 * needs a third buffer: V_{j-1} is read during step j while V_{j+1} is being loaded; the loads of
 * tile j+1 are issued after tile j's MMAs, so they overlap them. The last tile runs its P·V at once.
 * Every warpgroup runs every key tile of its block, also one wholly after its queries (fully
 * masked: p = 0, alpha = 1): a wgmma on one side of a warpgroup-dependent branch makes ptxas
 * serialise all of them, which costs far more than those tiles (none at 2 × 128 when S is a
 * multiple of 128).
 *
 * A score accumulator is never written by ordinary instructions (masked values are formed in a
 * temporary), and O is scaled only while no wgmma is in flight: see undef_regs in
 * attention_wgmma.cuh for why ptxas needs that to keep the MMAs asynchronous. */
#include "attention_wgmma.cuh"

namespace {

template <int D, int NWG, int BC> constexpr size_t fwd_wg_smem_bytes()
{
    return 1024 /* alignment slack */ + (size_t)64 * NWG * D * 2 + (size_t)5 * BC * D * 2;
}

template <int D, int NWG, int BC>
__global__ void __launch_bounds__(NWG * 128, NWG == 1 ? 2 : 1)
tc_fwd_wg_kernel(bf16 *__restrict__ out, float *__restrict__ lse, const bf16 *__restrict__ q,
                 const bf16 *__restrict__ k, const bf16 *__restrict__ v, int S, int Hq, int Hkv,
                 float scale, float scale_log2)
{
    pdl_wait(); /* first: launch.cuh */
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    constexpr int NT = NWG * 128, BQ = 64 * NWG, NS = BC / 2, NO = D / 2, KP = BC / 16;
    constexpr uint32_t Q_BYTES = BQ * D * 2, KV_BYTES = BC * D * 2;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t Qs = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t Ks = Qs + Q_BYTES, Vs = Ks + 2 * KV_BYTES; /* [2] and [3] tiles */

    const int nqt = (S + BQ - 1) / BQ;
    const int qt = nqt - 1 - (int)blockIdx.y;
    const int bh = blockIdx.x, b = bh / Hq, h = bh - b * Hq, hk = h / (Hq / Hkv);
    const int q0 = qt * BQ;
    const int nkt = (min(q0 + BQ, S) - 1) / BC + 1; /* key tiles up to the block's last query */
    const size_t qstride = (size_t)Hq * D, kstride = (size_t)Hkv * D;
    const size_t qoff = (size_t)b * S * qstride + (size_t)h * D;
    const bf16 *kb = k + (size_t)b * S * kstride + (size_t)hk * D;
    const bf16 *vb = v + (size_t)b * S * kstride + (size_t)hk * D;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wq0 = q0 + 64 * wg;         /* the warpgroup's first query */
    const int row0 = wq0 + 16 * warp + g; /* the thread's rows: row0, row0 + 8 */

    load_rows_sw<BQ, D, NT>(Qs, q + qoff, qstride, q0, S);
    load_rows_sw<BC, D, NT>(Ks, kb, kstride, 0, S);
    load_rows_sw<BC, D, NT>(Vs, vb, kstride, 0, S);
    cp_async_commit();

    float o[NO]; /* started by the first P·V */
    undef_regs(o);
    float mr[2] = {-INFINITY, -INFINITY}, lr[2] = {0.0f, 0.0f}; /* row max (raw scores), sum */
    uint32_t pa0[KP][4], pa1[KP][4];

    /* waits for key tile j */
    auto wait_tile = [&]() {
        cp_async_wait<0>();
        fence_proxy_async(); /* this thread's cp.async bytes, visible to wgmma's reads */
        __syncthreads();     /* everyone's; and every warpgroup is past S_{j-1} and P_{j-2}·V_{j-2},
                              * whose K and V buffers load_next refills */
    };
    /* starts loading key tile j+1 (after the tile's MMAs are issued: the loads then overlap them) */
    auto load_next = [&](int j) {
        if (j + 1 < nkt) {
            load_rows_sw<BC, D, NT>(Ks + ((j + 1) & 1) * KV_BYTES, kb, kstride, (j + 1) * BC, S);
            load_rows_sw<BC, D, NT>(Vs + ((j + 1) % 3) * KV_BYTES, vb, kstride, (j + 1) * BC, S);
        }
        cp_async_commit();
    };
    /* issues S_j = Q·K_jᵀ */
    auto scores = [&](int j, float (&s)[NS]) {
        const uint32_t Kt = Ks + (j & 1) * KV_BYTES;
        undef_regs(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss_nn<BC>(s, desc_kmajor<BQ>(Qs, 64 * wg, kk), desc_kmajor<BC>(Kt, 0, kk), kk > 0);
        wgmma_commit();
    };
    /* issues O += P_j·V_j (O started by the first) */
    auto pv = [&](int j, const uint32_t (&pj)[KP][4]) {
        const uint32_t Vt = Vs + (j % 3) * KV_BYTES;
#pragma unroll
        for (int kk = 0; kk < KP; kk++) wgmma_rs_nd<D>(o, pj[kk], desc_mnmajor<BC>(Vt, kk), kk > 0 || j > 0);
        wgmma_commit();
    };
    /* the online softmax of the landed S_j (P_j into pc; alpha rescales O) */
    auto softmax = [&](int j, const float (&s)[NS], uint32_t (&pc)[KP][4], float (&alpha)[2]) {
        fwd_softmax<BC>(s, pc, alpha, mr, lr, row0, wq0, j * BC, t, S, scale_log2);
    };
    auto finish = [&](int j, const uint32_t (&pj)[KP][4]) {
        wgmma_fence();
        pv(j, pj);
        wgmma_wait<0>();
        fence_regs(o);
    };

    /* tile 0 (no P·V before it: peeled, since a wgmma issued on one side of a branch only makes
     * ptxas serialise them all) */
    wait_tile();
    {
        float s[NS], alpha[2];
        scores(0, s);
        load_next(0);
        wgmma_wait<0>();
        fence_regs(s);
        softmax(0, s, pa0, alpha);
        if (nkt == 1) finish(0, pa0);
    }
    /* key tile j >= 1: P_j into pc; pp holds P_{j-1} */
    auto step = [&](int j, uint32_t (&pc)[KP][4], const uint32_t (&pp)[KP][4]) {
        wait_tile();
        float s[NS], alpha[2];
        scores(j, s);
        pv(j - 1, pp);
        load_next(j);
        wgmma_wait<1>(); /* S_j has landed; P_{j-1}·V_{j-1} may still run */
        fence_regs(s);
        softmax(j, s, pc, alpha);
        wgmma_wait<0>(); /* O must not be rescaled under the MMA */
        fence_regs(o);
#pragma unroll
        for (int i = 0; i < NO; i++) o[i] *= alpha[(i >> 1) & 1];
        if (j == nkt - 1) finish(j, pc);
    };
    for (int j = 1; j < nkt; j += 2) {
        step(j, pa1, pa0);
        if (j + 1 < nkt) step(j + 1, pa0, pa1);
    }

    fwd_store_rows<D>(out + (size_t)b * S * qstride + (size_t)h * D, lse + ((size_t)b * Hq + h) * S, o, mr,
                      lr, row0, t, S, Hq, scale);
#endif
}

template <int D, int NWG, int BC>
void fwd_wg_launch(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, int B, int S,
                   int Hq, int Hkv, float scale)
{
    constexpr size_t smem = fwd_wg_smem_bytes<D, NWG, BC>();
    static bool opted;
    smem_opt_in(tc_fwd_wg_kernel<D, NWG, BC>, smem, &opted);
    const dim3 grid((unsigned)(B * Hq), (unsigned)((S + 64 * NWG - 1) / (64 * NWG)));
    cuda_launch(tc_fwd_wg_kernel<D, NWG, BC>, grid, NWG * 128, smem,
        out, lse, q, k, v, S, Hq, Hkv, scale, scale * LOG2E);
    CUDA_LAUNCH_CHECK("attention tc forward (wgmma)");
}

template <int D>
void fwd_wg_variant(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, int B,
                    int S, int Hq, int Hkv, float scale, int variant)
{
    if (variant == 2) fwd_wg_launch<D, 2, 64>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
    else if (variant == 3) fwd_wg_launch<D, 1, 64>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
    else if (variant == 4) fwd_wg_launch<D, 3, 64>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
    else fwd_wg_launch<D, 2, 128>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
}

} /* namespace */

void attn_wgmma_forward(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                        int S, int Hq, int Hkv, int D, float scale, int variant)
{
    if (D == 128)
        fwd_wg_variant<128>((bf16 *)out, lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, B, S,
                            Hq, Hkv, scale, variant);
    else
        fwd_wg_variant<64>((bf16 *)out, lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, B, S,
                           Hq, Hkv, scale, variant);
}
