/* The attention forward on Hopper, warp-specialised (sm_90a): the same maths and per-warpgroup
 * software pipeline as attention_wgmma_fwd.cu (S_j and P_{j-1}·V_{j-1} issued together, the softmax
 * of S_j while P·V runs), but the tiles arrive by TMA and no warpgroup waits for another.
 *
 * CTA: two consumer warpgroups and a producer: one warp (288 threads, 64-key tiles) or, with PWG,
 * a whole warpgroup (384 threads) that gives back its registers (setmaxnreg 24) so that each
 * consumer thread may hold 240. A consumer's S, O and two P tiles of 128 keys need ~200; without
 * setmaxnreg ptxas allows three warps of a scheduler 168 and spilled. (ptxas ignores a setmaxnreg
 * budget in code that can trap, hence the mbarrier wait's timeout in tma.cuh is no trap.) One
 * producer thread loads the block's Q tile once and then every key tile's K and V (BC keys × D,
 * 128-byte swizzle, rows past S zero-filled by the TMA)
 * into a ring of STAGES buffers, each guarded by a "full" mbarrier the TMA completes and an
 * "empty" one the consumers release. Warpgroups 0 and 1 own 64 queries each; a consumer releases
 * the stage of tile j-1 once its P·V has retired (one arrival per warp). With the producer doing
 * all the loads the consumers issue no load instructions and meet no block-wide barrier, so one
 * consumer's softmax overlaps the other's MMAs without any explicit schedule (an explicit one,
 * FlashAttention-3's ping-pong of named barriers that makes the two take turns to issue, measured
 * 0.595 ms against 0.589 at B=2 S=4096 32/4×128 on an H100, and was dropped).
 *
 * Grid (B·Hq, query tiles of 128), heaviest first. Every consumer runs every key tile of its block
 * (see attention_wgmma_fwd.cu on why a warpgroup-dependent skip would cost more). */
#include "attention_wgmma.cuh"
#include "tma.cuh"

namespace {

struct fwd_tma_params {
    CUtensorMap map_q, map_k, map_v; /* [B][S][H·D] bf16, boxes of 64 columns × rows */
    CUtensorMap map_o;               /* out [B][S][Hq·D] bf16, boxes of 64 columns × 16 rows */
    float *lse;
    int S, Hq, Hkv;
    float scale, scale_log2;
};

constexpr int TMA_BQ = 128; /* queries per block: two consumer warpgroups */
constexpr int OUT_ROWS = 16; /* rows of O a TMA store: one warp's */

/* The warp's 16 rows of O (normalised, bf16) into the rows of the Q tile they replace, 128-byte
 * swizzled as the TMA loaded Q (dst: the warp's first row in the first 64-column chunk), and the
 * rows' log-sum-exps to global. Only the warp's warpgroup reads those Q rows, and its MMAs have
 * all retired. One TMA store a chunk then takes the rows out: the 64 four-byte global stores a
 * thread the epilogue used to issue, with the kernel's exit draining them, were ~8% of the
 * consumers' stall samples (Nsight Compute, fiftieth session). Rows past S are staged and clipped
 * by the TMA. */
template <int D>
__device__ __forceinline__ void fwd_stage_rows(uint32_t dst, float *lse, const float (&o)[D / 2],
                                               const float (&mr)[2], const float (&lr)[2], int row0,
                                               int g, int t, int S, float scale)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float ls = lr[r];
        ls += __shfl_xor_sync(0xffffffffu, ls, 1);
        ls += __shfl_xor_sync(0xffffffffu, ls, 2);
        const float inv = 1.0f / ls;
#pragma unroll
        for (int jd = 0; jd < D / 8; jd++) {
            const __nv_bfloat162 v = __floats2bfloat162_rn(o[4 * jd + 2 * r] * inv, o[4 * jd + 2 * r + 1] * inv);
            const uint32_t a = dst + (jd >> 3) * (TMA_BQ * 128) + (g + 8 * r) * 128 + (((jd & 7) ^ g) << 4) + 4 * t;
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(a), "r"(*reinterpret_cast<const uint32_t *>(&v)) : "memory");
        }
        const int row = row0 + 8 * r;
        if (t == 0 && row < S) lse[row] = mr[r] * scale + logf(ls);
    }
}

template <int D, int BC, int STAGES> constexpr size_t fwd_tma_smem_bytes()
{
    return 1024 + (size_t)TMA_BQ * D * 2 + (size_t)STAGES * 2 * BC * D * 2 + (2 * STAGES + 1) * 8;
}

/* PWG: the producer is a whole warpgroup (384 threads) that gives its registers to the consumers
 * (setmaxnreg 24 / 240), which is what lets a consumer hold 128-key tiles; else one warp (288). */
template <bool PWG> constexpr int fwd_tma_threads() { return PWG ? 384 : 288; }

template <int D, int BC, int STAGES, bool PWG>
__global__ void __launch_bounds__(fwd_tma_threads<PWG>(), 1)
tc_fwd_tma_kernel(const __grid_constant__ fwd_tma_params p)
{
    pdl_wait(); /* first: launch.cuh */
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    constexpr int NS = BC / 2, NO = D / 2, KP = BC / 16;
    constexpr uint32_t Q_BYTES = TMA_BQ * D * 2, T_BYTES = BC * D * 2; /* T: one K or V tile */
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t Qs = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t ring = Qs + Q_BYTES; /* stage s: K at ring + 2s·T_BYTES, V after it */
    const uint32_t bars = ring + STAGES * 2 * T_BYTES;
    auto full_bar = [&](int s) { return bars + 8u * s; };
    auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };
    const uint32_t q_bar = bars + 8u * 2 * STAGES;

    const int S = p.S, Hq = p.Hq;
    const int nqt = (S + TMA_BQ - 1) / TMA_BQ;
    const int qt = nqt - 1 - (int)blockIdx.y;
    const int bh = blockIdx.x, b = bh / Hq, h = bh - b * Hq, hk = h / (Hq / p.Hkv);
    const int q0 = qt * TMA_BQ;
    const int nkt = (min(q0 + TMA_BQ, S) - 1) / BC + 1;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full_bar(s), 1);  /* the producer's expect_tx arrival (+ the TMA bytes) */
            mbar_init(empty_bar(s), 8); /* one arrival per consumer warp */
        }
        mbar_init(q_bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    /* warp-uniform by construction (shuffled from lane 0), which ptxas needs to honour setmaxnreg */
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    if (wg == 2) {
        /* ------------------------------------------------ producer */
        if constexpr (PWG) setmaxnreg_dec<24>();
        if (threadIdx.x != 256) return;
        mbar_expect_tx(q_bar, Q_BYTES);
        for (int c = 0; c < D / 64; c++)
            tma_3d(Qs + c * (TMA_BQ * 128), &p.map_q, h * D + 64 * c, q0, b, q_bar);
        for (int j = 0; j < nkt; j++) {
            const int st = j % STAGES;
            const uint32_t Kt = ring + st * 2 * T_BYTES, Vt = Kt + T_BYTES, fb = full_bar(st);
            mbar_wait(empty_bar(st), ((j / STAGES) & 1) ^ 1);
            mbar_expect_tx(fb, 2 * T_BYTES); /* out-of-bounds box parts count too */
            for (int c = 0; c < D / 64; c++) {
                tma_3d(Kt + c * (BC * 128), &p.map_k, hk * D + 64 * c, j * BC, b, fb);
                tma_3d(Vt + c * (BC * 128), &p.map_v, hk * D + 64 * c, j * BC, b, fb);
            }
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    if constexpr (PWG) setmaxnreg_inc<240>();
    const int w = wg, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wq0 = q0 + 64 * w;          /* the warpgroup's first query */
    const int row0 = wq0 + 16 * warp + g; /* the thread's rows: row0, row0 + 8 */
    const float scale_log2 = p.scale_log2;

    float o[NO]; /* started by the first P·V */
    undef_regs(o);
    float mr[2] = {-INFINITY, -INFINITY}, lr[2] = {0.0f, 0.0f}; /* row max (raw scores), sum */
    uint32_t pa0[KP][4], pa1[KP][4];

    auto k_tile = [&](int j) { return ring + (j % STAGES) * 2 * T_BYTES; };
    auto wait_full = [&](int j) { mbar_wait(full_bar(j % STAGES), (j / STAGES) & 1); };
    auto release = [&](int j) { /* the warp's reads of tile j's stage are over */
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_bar(j % STAGES));
    };
    auto scores = [&](int j, float (&s)[NS]) { /* issues S_j = Q·K_jᵀ */
        const uint32_t Kt = k_tile(j);
        undef_regs(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss_nn<BC>(s, desc_kmajor<TMA_BQ>(Qs, 64 * w, kk), desc_kmajor<BC>(Kt, 0, kk), kk > 0);
        wgmma_commit();
    };
    auto pv = [&](int j, const uint32_t (&pj)[KP][4]) { /* issues O += P_j·V_j */
        const uint32_t Vt = k_tile(j) + T_BYTES;
#pragma unroll
        for (int kk = 0; kk < KP; kk++) wgmma_rs_nd<D>(o, pj[kk], desc_mnmajor<BC>(Vt, kk), kk > 0 || j > 0);
        wgmma_commit();
    };
    /* the online softmax of the landed S_j (P_j into pc; alpha rescales O) */
    auto softmax = [&](int j, const float (&s)[NS], uint32_t (&pc)[KP][4], float (&alpha)[2]) {
        fwd_softmax<BC>(s, pc, alpha, mr, lr, row0, wq0, j * BC, t, S, scale_log2);
    };
    auto finish = [&](int j, const uint32_t (&pj)[KP][4]) { /* the last tile's P·V at once */
        wgmma_fence();
        pv(j, pj);
        wgmma_wait<0>();
        fence_regs(o);
        release(j);
    };

    mbar_wait(q_bar, 0);
    wait_full(0);
    {
        float s[NS], alpha[2];
        scores(0, s);
        wgmma_wait<0>();
        fence_regs(s);
        softmax(0, s, pa0, alpha);
        if (nkt == 1) finish(0, pa0);
    }
    auto step = [&](int j, uint32_t (&pc)[KP][4], const uint32_t (&pp)[KP][4]) {
        wait_full(j);
        float s[NS], alpha[2];
        scores(j, s);
        pv(j - 1, pp);
        wgmma_wait<1>(); /* S_j has landed; P_{j-1}·V_{j-1} may still run */
        fence_regs(s);
        softmax(j, s, pc, alpha);
        wgmma_wait<0>(); /* O must not be rescaled under the MMA */
        fence_regs(o);
        release(j - 1);
#pragma unroll
        for (int i = 0; i < NO; i++) o[i] *= alpha[(i >> 1) & 1];
        if (j == nkt - 1) finish(j, pc);
    };
    for (int j = 1; j < nkt; j += 2) {
        step(j, pa1, pa0);
        if (j + 1 < nkt) step(j + 1, pa0, pa1);
    }

    const int wrow = wq0 + 16 * warp; /* the warp's first query */
    const uint32_t ostage = Qs + (wrow - q0) * 128;
    fwd_stage_rows<D>(ostage, p.lse + ((size_t)b * Hq + h) * S, o, mr, lr, row0, g, t, S, p.scale);
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
#pragma unroll
        for (int c = 0; c < D / 64; c++) tma_store_3d(&p.map_o, ostage + c * (TMA_BQ * 128), h * D + 64 * c, wrow, b);
        bulk_commit();
        bulk_wait_read(); /* the staged rows outlive the store's reads */
    }
#endif
}

template <int D, int BC, int STAGES, bool PWG>
void fwd_tma_launch(void *out, float *lse, const void *q, const void *k, const void *v, int B, int S,
                    int Hq, int Hkv, float scale)
{
    fwd_tma_params p;
    attn_head_map(&p.map_q, q, B, S, Hq, D, TMA_BQ, "attention forward (TMA)");
    attn_head_map(&p.map_k, k, B, S, Hkv, D, BC, "attention forward (TMA)");
    attn_head_map(&p.map_v, v, B, S, Hkv, D, BC, "attention forward (TMA)");
    attn_head_map(&p.map_o, out, B, S, Hq, D, OUT_ROWS, "attention forward (TMA)");
    p.lse = lse;
    p.S = S, p.Hq = Hq, p.Hkv = Hkv;
    p.scale = scale, p.scale_log2 = scale * LOG2E;
    constexpr size_t smem = fwd_tma_smem_bytes<D, BC, STAGES>();
    static bool opted;
    smem_opt_in(tc_fwd_tma_kernel<D, BC, STAGES, PWG>, smem, &opted);
    const dim3 grid((unsigned)(B * Hq), (unsigned)((S + TMA_BQ - 1) / TMA_BQ));
    cuda_launch(tc_fwd_tma_kernel<D, BC, STAGES, PWG>, grid, fwd_tma_threads<PWG>(), smem, p);
    CUDA_LAUNCH_CHECK("attention tc forward (TMA)");
}

} /* namespace */

void attn_tma_forward(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                      int S, int Hq, int Hkv, int D, float scale, int variant)
{
    if (D == 128) {
        if (variant == 2) fwd_tma_launch<128, 64, 6, false>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
        else if (variant == 3) fwd_tma_launch<128, 128, 2, true>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
        else if (variant == 4) fwd_tma_launch<128, 128, 3, true>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
        else if (variant == 5) fwd_tma_launch<128, 64, 4, true>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
        else fwd_tma_launch<128, 64, 4, false>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
    } else {
        if (variant == 2) fwd_tma_launch<64, 64, 6, false>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
        else if (variant == 3) fwd_tma_launch<64, 128, 2, true>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
        else if (variant == 4) fwd_tma_launch<64, 128, 3, true>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
        else if (variant == 5) fwd_tma_launch<64, 64, 4, true>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
        else fwd_tma_launch<64, 64, 4, false>(out, lse, q, k, v, B, S, Hq, Hkv, scale);
    }
}

void attn_head_map(CUtensorMap *m, const void *x, int B, int S, int H, int D, int rows, const char *what)
{
    const cuuint64_t dims[3] = {(cuuint64_t)H * D, (cuuint64_t)S, (cuuint64_t)B};
    const cuuint64_t strides[2] = {(cuuint64_t)H * D * 2, (cuuint64_t)S * H * D * 2};
    const cuuint32_t box[3] = {64, (cuuint32_t)rows, 1};
    tma_make_map(m, x, 3, dims, strides, box, what);
}
