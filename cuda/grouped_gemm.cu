/* Grouped bf16 expert GEMMs on Hopper: a persistent, warp-specialised TMA + wgmma kernel.
 *
 * Every GEMM is D[M,N] (+)= A[M,K] · B[N,K]ᵀ with bf16 operands and fp32 accumulation, over a
 * flat list of 128×256 output tiles covering all experts. The expert row offsets are device memory
 * (the routing's, never read by the host): each CTA turns them into per-expert tile prefix sums in
 * shared memory when it starts, and finds a tile's expert by binary search over them.
 * The three expert GEMMs map as:
 *   forward  Y[rows,O]  = X[rows,I] · W[e]ᵀ     A = X  (K-major), B = W[e]  (K-major)
 *   dgrad    dX[rows,I] = dY[rows,O] · W[e]     A = dY (K-major), B = W[e]  (N-major: W is [O,I])
 *   wgrad    dW[e]     += dYᵀ · X  over rows   A = dY (M-major), B = X     (N-major), K = rows
 * Row matrices are one TMA tensor over all the rows they hold ([R, cols], R >= the last offset);
 * the rows of an expert are a row range of it. The weights are one 3-D tensor [n_exp, O, I], so a tile never reads another expert's
 * weights: its edges are out of bounds and TMA fills zeros. The row ranges are not so protected:
 *  - forward/dgrad (rows = M): a tile's last rows may be the next expert's; they only feed output
 *    rows that the epilogue does not store;
 *  - wgrad (rows = K): the last K block may hold the next expert's rows, which would be summed in;
 *    the consumers zero those rows of both operands in shared memory before the MMA.
 *
 * CTA: 3 warpgroups. Warpgroup 0 is the producer (one thread issues the TMA loads into a ring of
 * 3 stages of 64 K, each guarded by a "full" mbarrier the TMA completes and an "empty" one the
 * consumers release; a stage carries a header with the coordinates of the tile it starts);
 * warpgroups 1 and 2 each compute 64 rows × 256 columns of the tile with wgmma.m64n256k16 (128 fp32
 * accumulators a thread). Forward/dgrad write the bf16 tile into a shared-memory staging buffer
 * that one thread stores with TMA while the next tile's MMAs run. Wgrad stages its fp32 tile half
 * its columns at a time, and a second producer thread (the dw warp) has the L2 add each half onto
 * dw by TMA (each dw element belongs to exactly one tile, so the += is one add a call and
 * deterministic).
 *
 * Shared-memory layouts are the TMA's 128-byte swizzle, which is what wgmma's SW128 descriptors
 * read: a K-major operand tile is rows of 64 K-elements (128 B), 8-row groups 1024 B apart; an
 * MN-major tile is boxes of 64 MN-elements × BK K-rows (BK × 128 B each), the boxes LBO = one box
 * apart along MN and 8-K-row groups SBO = 1024 B apart.
 *
 * grouped_gemm_tiles.cuh holds the tile and stage sizes, the kernel's parameters and the tile
 * schedule; this file the kernel and the host side. */
#include "grouped_gemm.cuh"

#include "cuda_common.cuh"
#include "elementwise.cuh"
#include "grouped_gemm_mma.cuh"
#include "grouped_gemm_tiles.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

#include <stdlib.h>
#include <string.h>

namespace {

/* ---------------------------------------------------------------- PTX wrappers: wgmma.cuh, tma.cuh,
 * grouped_gemm_mma.cuh */

/* ---------------------------------------------------------------- the kernel */

/* Wgrad, overwriting: Σ acc² of this consumer warp's share of the tile into *out, in double and in
 * an order fixed by the code alone (four running sums a thread, then a shuffle butterfly), so the
 * gradient norm needs no pass over the values the tile stores. A zero tile's sum is 0. */
__device__ __forceinline__ void warp_tile_sumsq(double *out, const float (&acc)[128], bool zero_tile, int lane)
{
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    if (!zero_tile)
#pragma unroll
        for (int i = 0; i < 128; i++) s[i & 3] = fma((double)acc[i], (double)acc[i], s[i & 3]);
    double v = (s[0] + s[1]) + (s[2] + s[3]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) *out = v;
}

/* PARTS (wgrad only): the launch takes its tiles from p.claim and may stop early, so every loop
 * ends on a sentinel header (expert -1) instead of at the CTA's last grid-stride tile. A separate
 * instantiation: with the sentinel in every wgrad launch, the whole calls' main loop compiled
 * slower (H200, balanced group of four, down 1.57 -> 1.83 ms, gate_up 3.36 -> 3.65; the bench
 * step +0.7%: docs/benchmarks.md, twenty-ninth session). */
template <int KIND, bool PARTS>
__global__ void __launch_bounds__(THREADS, 1) grouped_gemm_kernel(const __grid_constant__ gg_params p)
{
    pdl_wait(); /* first: launch.cuh */
    static_assert(!PARTS || KIND == KIND_WGRAD, "only the wgrad runs in parts");
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    constexpr int TA = KIND == KIND_WGRAD ? 1 : 0; /* A MN-major */
    constexpr int TB = KIND == KIND_FWD ? 0 : 1;   /* B MN-major */
    constexpr uint32_t A_KSTEP = TA ? 16 * 128 : 32, B_KSTEP = TB ? 16 * 128 : 32;
    constexpr int STAGES = stages_of<KIND>(), BK = bk_of<KIND>();
    constexpr int A_BYTES = a_bytes_of<KIND>(), BOX_BYTES = box_bytes_of<KIND>();
    constexpr int STAGE_BYTES = stage_bytes_of<KIND>();
    constexpr uint32_t A_LBO = TA ? BOX_BYTES : 16, B_LBO = TB ? BOX_BYTES : 16;

    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u; /* SW128 atoms: 1024-aligned */
    const uint32_t staging = base + STAGES * STAGE_BYTES; /* the output tile */
    const uint32_t bars = staging + out_bytes_of<KIND>();
    auto full_bar = [&](int s) { return bars + 8u * s; };
    auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };
    /* wgrad: the staging buffer is free (the previous tile's adds have read it) / the consumers
     * have written the tile into it */
    const uint32_t free_bar = bars + 16u * STAGES, staged_bar = free_bar + 8u;
    /* The producer writes each tile's coordinates into the header of the stage that holds its
     * first K block, and the consumers read them there instead of searching the schedule between
     * tiles (dependent loads on every tile's critical path; from the parameter space: H200,
     * balanced forward down 628 -> 653 TFLOPS, 3.5 ms a bench step). A wgrad zero tile
     * (overwrite, no rows) takes a stage with no data, for its header. */
    const uint32_t hdr0 = staged_bar + 8u;
    auto hdr = [&](int s) { return hdr0 + 32u * s; };
    /* wgrad: the staged tile's expert, row and column tile and K blocks, for the dw warp (expert
     * -1: no more tiles); guarded by free_bar / staged_bar as the staging buffer is */
    const uint32_t dw_hdr = hdr0 + 32u * STAGES;
    __shared__ int tile_start[MAX_EXPERTS + 1];
    __shared__ uint8_t order[MAX_EXPERTS];
    if constexpr (PARTS) { /* a part launch with nothing to do leaves at once */
        __shared__ int quit;
        if (threadIdx.x == 0) quit = *(volatile int *)(p.claim + 1) || exchange_arrived(p);
        __syncthreads();
        if (quit) return;
    }
    tile_starts<KIND>(p, tile_start, order, (int *)(smem_raw + (base - smem_u32(smem_raw))));
    const int total = tile_start[p.n_exp];

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full_bar(s), 1);  /* the producer's expect_tx arrival (+ the TMA bytes) */
            mbar_init(empty_bar(s), 8); /* one arrival per consumer warp */
        }
        mbar_init(free_bar, 1);    /* the dw warp's arrival */
        mbar_init(staged_bar, 8);  /* one arrival per consumer warp */
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        /* ------------------------------------------------ producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (KIND == KIND_WGRAD && threadIdx.x == 32) {
            /* ------------------------------------------- the dw warp (wgrad): per tile, once the
             * consumers have staged it, the L2 adds it onto dw (cp.reduce.async.bulk; overwrite:
             * stores it) while they run the next tile's MMAs; this thread waits for the buffer to
             * be read so that they never do. Against the read-add-write from registers after the
             * MMAs (H200, the bench step): 6-9 ms a step faster, though slower alone
             * (bench_grouped_gemm's back-to-back calls: wgrad2 gate_up 2.11 ms against 1.80);
             * loading dw's tile by TMA during the MMAs and storing the sum gained 3 ms
             * (docs/benchmarks.md, fourteenth session). */
            uint32_t ph = 0;
            for (int t = blockIdx.x; PARTS || t < total; t += gridDim.x) {
                /* the tile: whole launches decode it before the wait, parts read its header */
                tile_info ti = PARTS ? tile_info{} : decode<KIND, PARTS>(p, tile_start, order, t);
                int nk = 0, e = 0, nb = 0;
                auto place = [&] { e = p.e_base + ti.e, nb = min(BN / 32, (p.N - ti.ni * BN + 31) / 32); };
                if (!PARTS) place();
                for (int half = 0; half < WGRAD_HALVES; half++) {
                    mbar_arrive(free_bar);
                    mbar_wait(staged_bar, ph);
                    ph ^= 1;
                    if (PARTS && half == 0) {
                        asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                                     : "=r"(ti.e), "=r"(ti.mi), "=r"(ti.ni), "=r"(nk)
                                     : "r"(dw_hdr)
                                     : "memory");
                        if (ti.e < 0) break;
                        place();
                    }
                    /* Every CTA of a balanced launch stages its tile at about the same moment;
                     * issued at once, the adds (128 KB read and written in DRAM a CTA) hold up
                     * the next tile's operand loads. The last part's are spread over part of the
                     * next tile's MMAs (its K blocks times the 16 clocks a K row's MMAs take at
                     * the SM's peak), sharing DRAM with them; the parts before go at once, as
                     * the consumers wait for them to be read. A clock measured per tile misleads
                     * where experts have a few rows (a K block's tile is all epilogue). */
                    const int b0 = half * WGRAD_BOXES_PER_PART, b1 = min(nb, b0 + WGRAD_BOXES_PER_PART);
                    const long long now = clock64();
                    long long gap = 0;
                    if (half == WGRAD_HALVES - 1 && b1 > b0 && p.dw_pace && (PARTS || t + (int)gridDim.x < total)) {
                        /* claimed tiles: the next one is not known here; heaviest first, this
                         * one's K blocks are close to it */
                        const int nk_next = PARTS ? nk : k_blocks<KIND>(p, decode<KIND, PARTS>(p, tile_start, order, t + gridDim.x));
                        gap = 16ll * BK * nk_next * p.dw_pace / 1000 / (b1 - b0);
                    }
                    for (int b = b0; b < b1; b++) {
                        if (b > b0 && gap)
                            while (clock64() < now + (b - b0) * gap) __nanosleep(64);
                        const uint32_t src = staging + (b - b0) * (BM * 128);
                        if (p.overwrite) tma_store_3d(&p.map_out, src, ti.ni * BN + 32 * b, ti.mi * BM, e);
                        else tma_reduce_add_3d(&p.map_out, src, ti.ni * BN + 32 * b, ti.mi * BM, e);
                        bulk_commit();
                    }
                    bulk_wait_read();
                }
                if (PARTS && ti.e < 0) break;
            }
            bulk_wait_all();
            return;
        }
        if (threadIdx.x != 0) return;
        int stage = 0;
        uint32_t phase = 0;
        for (int slot = blockIdx.x; PARTS || slot < total; slot += gridDim.x) {
            int t = slot;
            if (PARTS) {
                if (exchange_arrived(p)) break; /* the rest is the next part's */
                t = atomicAdd(p.claim, 1);
                if (t >= total) *(volatile int *)(p.claim + 1) = 1; /* later parts leave at once */
            }
            if (t >= total) break;
            const tile_info ti = decode<KIND, PARTS>(p, tile_start, order, t);
            const int nk = k_blocks<KIND>(p, ti), e = p.e_base + ti.e;
            set_walk walk;
            walk.start(ti);
            for (int kb = 0; kb < (nk == 0 ? 1 : nk); kb++) {
                const uint32_t sa = base + stage * STAGE_BYTES, sb = sa + A_BYTES, fb = full_bar(stage);
                mbar_wait(empty_bar(stage), phase ^ 1);
                /* wgrad: the block's first row in its set and its valid rows, which the consumers
                 * read from the stage's header (the rows past them are the next expert's) */
                int k0 = 0, valid = BK;
                if (KIND == KIND_WGRAD && nk > 0) k0 = walk.next(p, ti.e, &valid);
                if (kb == 0) /* e, mi, ni, r0, rows, K blocks, -, the first block's valid rows */
                    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n\t"
                                 "st.shared.v4.s32 [%0+16], {%5, %6, %7, %8};" ::"r"(hdr(stage)),
                                 "r"(ti.e), "r"(ti.mi), "r"(ti.ni), "r"(ti.r0), "r"(ti.rows),
                                 "r"(nk), "r"(0), "r"(valid)
                                 : "memory");
                else if (KIND == KIND_WGRAD)
                    asm volatile("st.shared.s32 [%0+28], %1;" ::"r"(hdr(stage)), "r"(valid) : "memory");
                if (nk == 0) { /* the header alone; the arrive releases it to the consumers */
                    mbar_arrive(fb);
                    if (++stage == STAGES) stage = 0, phase ^= 1;
                    continue;
                }
                mbar_expect_tx(fb, STAGE_BYTES); /* out-of-bounds box parts count too; the arrive
                                                  * releases the header to the consumers */
                if (KIND == KIND_FWD) {
                    tma_2d(sa, &p.map_a[0], kb * BK, ti.r0 + ti.mi * BM, fb);
                    tma_3d(sb, &p.map_b[0], kb * BK, ti.ni * BN, e, fb);
                } else if (KIND == KIND_DGRAD) {
                    tma_2d(sa, &p.map_a[0], kb * BK, ti.r0 + ti.mi * BM, fb);
                    for (int j = 0; j < BN / 64; j++)
                        tma_3d(sb + j * BOX_BYTES, &p.map_b[0], ti.ni * BN + 64 * j, kb * BK, e, fb);
                } else { /* the K blocks of the row sets in order */
                    const CUtensorMap *ma = &p.map_a[walk.s], *mb = &p.map_b[walk.s];
                    for (int j = 0; j < BM / 64; j++)
                        tma_2d(sa + j * BOX_BYTES, ma, ti.mi * BM + 64 * j, k0, fb);
                    for (int j = 0; j < BN / 64; j++)
                        tma_2d(sb + j * BOX_BYTES, mb, ti.ni * BN + 64 * j, k0, fb);
                }
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
        }
        if (PARTS) { /* no more tiles: a header of expert -1 ends the consumers' loop */
            mbar_wait(empty_bar(stage), phase ^ 1);
            asm volatile("st.shared.s32 [%0], %1;" ::"r"(hdr(stage)), "r"(-1) : "memory");
            mbar_arrive(full_bar(stage));
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int ctid = threadIdx.x - 128;   /* 0..255 over both consumer warpgroups */
    const int w = wg - 1;                 /* this warpgroup's 64-row half of the tile */
    const int lane = threadIdx.x & 31;
    const int row_in_tile = w * 64 + ((threadIdx.x / 32) & 3) * 16 + (lane >> 2);
    const int col_in_tile = 2 * (lane & 3);
    int stage = 0;
    uint32_t phase = 0, tile_phase = 0;
    for (int t = blockIdx.x; PARTS || t < total; t += gridDim.x) {
        tile_info ti;
        int pad, valid0;
        mbar_wait(full_bar(stage), phase); /* the tile's first K block, and its header */
        asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%8];\n\t"
                     "ld.shared.v4.s32 {%4, %5, %6, %7}, [%8+16];"
                     : "=r"(ti.e), "=r"(ti.mi), "=r"(ti.ni), "=r"(ti.r0), "=r"(ti.rows),
                       "=r"(ti.nk), "=r"(pad), "=r"(valid0)
                     : "r"(hdr(stage))
                     : "memory");
        (void)pad, (void)valid0;
        if (PARTS && ti.e < 0) { /* no more tiles; the dw warp learns it as it learns of a staged tile */
            {
                mbar_wait(free_bar, tile_phase);
                if (ctid == 0) asm volatile("st.shared.s32 [%0], %1;" ::"r"(dw_hdr), "r"(-1) : "memory");
                __syncwarp();
                if (lane == 0) mbar_arrive(staged_bar);
            }
            break;
        }
        const int nk = k_blocks<KIND>(p, ti);
        /* The tile's first MMA overwrites (scale-d 0) instead of a zeroing here, on the tile's
         * critical path. A zero tile gives its header's stage back and stages zeros, not the
         * accumulators (whose registers only wgmma may define, or ptxas serialises the MMAs). */
        float acc[128];
        const bool zero_tile = nk == 0;
        if (zero_tile) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_bar(stage));
            if (++stage == STAGES) stage = 0, phase ^= 1;
        }

        /* Forward/dgrad: an expert's last tile often has <= 64 valid rows. The warpgroup whose 64
         * rows are all past them (never stored) skips its MMAs, leaving the SM's tensor cores to
         * the other; it still waits for and releases every stage with it. */
        const bool idle = KIND != KIND_WGRAD && w * 64 >= ti.rows - ti.mi * BM;
        if (idle)
            for (int kb = 0; kb < nk; kb++) {
                mbar_wait(full_bar(stage), phase);
                __syncwarp();
                if (lane == 0) mbar_arrive(empty_bar(stage));
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
        int prev = -1;
        for (int kb = 0; kb < (idle ? 0 : nk); kb++) {
            const uint32_t sa = base + stage * STAGE_BYTES, sb = sa + A_BYTES;
            mbar_wait(full_bar(stage), phase);
            int valid = BK;
            if (KIND == KIND_WGRAD) /* the producer's set_walk wrote it with the block */
                asm volatile("ld.shared.s32 %0, [%1+28];" : "=r"(valid) : "r"(hdr(stage)) : "memory");
            if (KIND == KIND_WGRAD && valid < BK) {
                /* K rows past the expert's end in its row set (the next expert's rows): zero them
                 * in all six boxes of the stage (A's 2 then B's 4, contiguous). Swizzling
                 * permutes 16-byte chunks within a 128-byte K row, so whole rows stay whole. */
                const int per_box = (BK - valid) * 8; /* 16-byte chunks, >= 8 */
                for (int i = ctid; i < 6 * per_box; i += 256) {
                    const int box = i / per_box, c = i - box * per_box;
                    const uint32_t a = sa + box * BOX_BYTES + valid * 128 + c * 16;
                    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(a), "r"(0) : "memory");
                }
                fence_proxy_async(); /* for wgmma's reads */
                asm volatile("bar.sync 1, 256;" ::: "memory");
            }
            const uint32_t a0 = sa + w * (A_BYTES / 2); /* rows 64w.. (K-major) or box w (MN-major) */
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++)
                wgmma_m64n256k16<TA, TB>(acc, smem_desc(a0 + kk * A_KSTEP, A_LBO, 1024),
                                         smem_desc(sb + kk * B_KSTEP, B_LBO, 1024),
                                         kb > 0 || kk > 0);
            wgmma_commit();
            wgmma_wait<1>(); /* the previous block's MMAs are done: release its stage */
            if (prev >= 0 && lane == 0) mbar_arrive(empty_bar(prev));
            prev = stage;
            if (++stage == STAGES) stage = 0, phase ^= 1;
        }
        wgmma_wait<0>();
        if (lane == 0 && prev >= 0) mbar_arrive(empty_bar(prev)); /* none: a zero tile */
#pragma unroll
        for (int i = 0; i < 128; i++) fence_operand(acc[i]);

        /* ------------------------------------------------ epilogue, through shared memory.
         * Accumulator j·4 + {0,1}: row row_in_tile, columns 8j + col_in_tile + {0,1};
         * j·4 + {2,3}: the same columns 8 rows down. */
        if (KIND == KIND_WGRAD) {
            /* the tile into the staging buffer, in the layout of the dw map's boxes: eight boxes
             * of 32 columns × 128 rows, 128-byte swizzled (conflict-free: a warp's 8 rows × 32
             * bytes land in distinct 16-byte chunk columns). */
            const int q = lane & 3;
#pragma unroll
            for (int half = 0; half < WGRAD_HALVES; half++) {
                mbar_wait(free_bar, tile_phase);
                tile_phase ^= 1;
                constexpr int JS = BN / 8 / WGRAD_HALVES; /* accumulator column groups a part */
#pragma unroll
                for (int jj = 0; jj < JS; jj++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int j = half * JS + jj;
                        const int row = row_in_tile + 8 * h, chunk = 2 * (j & 3) + (q >> 1);
                        const uint32_t a = staging + (jj >> 2) * (BM * 128) + row * 128 +
                                           ((chunk ^ (row & 7)) << 4) + 8 * (q & 1);
                        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(a),
                                     "f"(zero_tile ? 0.0f : acc[4 * j + 2 * h]),
                                     "f"(zero_tile ? 0.0f : acc[4 * j + 2 * h + 1])
                                     : "memory");
                    }
                if (PARTS && half == 0 && ctid == 0)
                    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};" ::"r"(dw_hdr), "r"(ti.e), "r"(ti.mi),
                                 "r"(ti.ni), "r"(nk)
                                 : "memory");
                fence_proxy_async(); /* for the TMA's reads */
                __syncwarp();
                if (lane == 0) mbar_arrive(staged_bar);
                /* while the dw warp sends the first half (the second waits for it anyway) */
                if (!PARTS && half == 0 && p.sumsq)
                    warp_tile_sumsq(p.sumsq + (size_t)t * 8 + (ctid >> 5), acc, zero_tile, lane);
            }
        } else {
            /* Through shared memory: the tile is written (bf16, in the 128-byte-swizzled layout of
             * four 64-column boxes) and stored by TMA, which runs on while the consumers start the
             * next tile's MMAs; from registers, each warp's 4-byte stores covered 16 bytes of 8
             * rows and the epilogue took as long as ~8 K blocks of MMAs. A tile whose last rows
             * belong to the next expert (valid_m < BM) is copied out row by row instead, 16
             * bytes a thread, as TMA would write the whole box. */
            if (ctid == 0) bulk_wait_read(); /* the previous tile's store has left the buffer */
            asm volatile("bar.sync 2, 256;" ::: "memory");
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int row = row_in_tile + 8 * h;
                    const uint32_t a = staging + (j >> 3) * (BM * 128) + row * 128 +
                                       (((j & 7) ^ (row & 7)) << 4) + 2 * col_in_tile;
                    __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(a), "r"(*(uint32_t *)&v) : "memory");
                }
            fence_proxy_async(); /* for the TMA's reads */
            asm volatile("bar.sync 2, 256;" ::: "memory");
            const int valid_m = ti.rows - ti.mi * BM;
            const int row0 = ti.r0 + ti.mi * BM;
            if (valid_m >= BM) {
                if (ctid == 0) {
                    for (int b = 0; b < BN / 64 && ti.ni * BN + 64 * b < p.N; b++)
                        tma_store_2d(&p.map_out, staging + b * (BM * 128), ti.ni * BN + 64 * b, row0);
                    bulk_commit();
                }
            } else {
                bf16 *out = (bf16 *)p.out;
                for (int i = ctid; i < valid_m * (BN / 8); i += 256) {
                    const int row = i / (BN / 8), c = i - row * (BN / 8), n = ti.ni * BN + 8 * c;
                    if (n >= p.N) continue; /* N % 8 == 0: a chunk is in or out whole */
                    const uint32_t a = staging + (c >> 3) * (BM * 128) + row * 128 + (((c & 7) ^ (row & 7)) << 4);
                    uint4 v;
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                                 : "r"(a));
                    *(uint4 *)(out + (size_t)(row0 + row) * p.N + n) = v;
                }
            }
        }
    }
    if (KIND != KIND_WGRAD && ctid == 0) bulk_wait_all(); /* the buffer lives as long as the CTA */
#endif
}

/* ---------------------------------------------------------------- host side */

bool aligned16(const void *q) { return ((uintptr_t)q & 15u) == 0; }

/* What the kernel handles: TMA wants 16-byte aligned bases and row strides (I, O multiples of 8),
 * coordinates are int32. */
bool supported(int I, int O, int64_t R, const void *a, const void *b, const void *c)
{
    if (I <= 0 || O <= 0 || I % 8 || O % 8) return false;
    if (R < 0 || R > INT32_MAX) return false;
    if (!aligned16(a) || !aligned16(b) || !aligned16(c)) return false;
    return g_cuda.ready && g_cuda.hopper; /* else the caller's sm_80 path (cuBLAS) */
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The tile schedule is built by every CTA from the device offsets, so the host never waits for
 * the routing; the grid is one CTA an SM unless fewer tiles are possible (a CTA without tiles
 * exits). R: the rows the row matrices hold (an upper bound on the tiles). ma/mb/off: n_sets row
 * sets (1 but for wgrad). Launches of up to MAX_EXPERTS. */
template <int KIND>
void launch(int n_sets, const CUtensorMap *ma, const CUtensorMap *mb, const int64_t *const *off,
            void *out, int64_t R, int n_exp, int M, int N, int K, const CUtensorMap *mout,
            bool overwrite = false, int *claim = nullptr, const struct exchange_arrival *until = nullptr,
            const int64_t *end = nullptr, double *sumsq = nullptr /* wgrad overwrite: [all tiles][8] */)
{
    static bool attr_set;
    if (!attr_set) {
        CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<KIND, false>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes_of<KIND>()));
        if (KIND == KIND_WGRAD)
            CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<KIND_WGRAD, true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes_of<KIND>()));
        attr_set = true;
    }
    gg_params p;
    memset(&p, 0, sizeof p);
    for (int s = 0; s < n_sets; s++) p.map_a[s] = ma[s], p.map_b[s] = mb[s];
    p.n_sets = n_sets;
    if (mout) p.map_out = *mout;
    p.out = out;
    p.M = M, p.N = N, p.K = K;
    p.overwrite = overwrite;
    p.dw_pace = dw_pace();
    p.heavy_first = KIND == KIND_WGRAD && heavy_first();
    p.tiles_m = KIND == KIND_WGRAD ? (int)cdiv(M, BM) : 0;
    p.claim = claim;
    if (until) {
        p.stop_flags = until->flags;
        p.stop_epoch = until->epoch;
        p.stop_n = until->n;
        p.stop_skip = until->skip;
    }
    MT_CHECK(!claim || n_exp <= MAX_EXPERTS, "grouped_gemm: %d experts in parts (a launch takes %d)", n_exp,
             MAX_EXPERTS);
    for (int e0 = 0; e0 < n_exp; e0 += MAX_EXPERTS) {
        const int ne = n_exp - e0 < MAX_EXPERTS ? n_exp - e0 : MAX_EXPERTS;
        const int64_t max_tiles = KIND == KIND_WGRAD ? ne * cdiv(M, BM) * cdiv(N, BN)
                                                     : (cdiv(R, BM) + ne) * cdiv(N, BN);
        MT_CHECK(max_tiles <= INT32_MAX, "grouped_gemm: up to %lld tiles, more than int32 counts",
                 (long long)max_tiles);
        p.n_exp = ne;
        p.e_base = e0;
        p.sumsq = sumsq ? sumsq + (size_t)e0 * cdiv(M, BM) * cdiv(N, BN) * 8 : nullptr;
        for (int s = 0; s < n_sets; s++) p.off[s] = off[s] + e0;
        p.end0 = (end ? end : off[0] + 1) + e0;
        const int grid = max_tiles < g_cuda.num_sms ? (int)max_tiles : g_cuda.num_sms;
        if (grid == 0) continue;
        if (KIND == KIND_WGRAD && claim)
            cuda_launch(grouped_gemm_kernel<KIND_WGRAD, true>, grid, THREADS, smem_bytes_of<KIND>(), p);
        else
            cuda_launch(grouped_gemm_kernel<KIND, false>, grid, THREADS, smem_bytes_of<KIND>(), p);
        CUDA_LAUNCH_CHECK("grouped_gemm_kernel");
    }
}

} // namespace

extern "C" bool grouped_gemm_forward(void *out, const void *in, const void *w, const int64_t *off,
                                     const int64_t *end, int64_t rows, int n_exp, int I, int O)
{
    if (!supported(I, O, rows, out, in, w)) return false;
    if (n_exp <= 0 || rows == 0) return true; /* no rows */
    const cuuint64_t R = (cuuint64_t)rows;
    CUtensorMap ma, mb;
    const cuuint64_t da[2] = {(cuuint64_t)I, R}, sa[1] = {(cuuint64_t)I * 2};
    const cuuint32_t ba[2] = {64, BM};
    tma_make_map(&ma, in, 2, da, sa, ba, "grouped_gemm");
    const cuuint64_t db[3] = {(cuuint64_t)I, (cuuint64_t)O, (cuuint64_t)n_exp};
    const cuuint64_t sb[2] = {(cuuint64_t)I * 2, (cuuint64_t)O * I * 2};
    const cuuint32_t bb[3] = {64, BN, 1};
    tma_make_map(&mb, w, 3, db, sb, bb, "grouped_gemm");
    CUtensorMap mo;
    const cuuint64_t dout[2] = {(cuuint64_t)O, R}, so[1] = {(cuuint64_t)O * 2};
    tma_make_map(&mo, out, 2, dout, so, ba, "grouped_gemm");
    launch<KIND_FWD>(1, &ma, &mb, &off, out, rows, n_exp, 0, O, I, &mo, false, nullptr, nullptr, end);
    return true;
}

extern "C" bool grouped_gemm_dgrad(void *din, const void *dout, const void *w, const int64_t *off,
                                   int64_t rows, int n_exp, int I, int O)
{
    if (!supported(I, O, rows, din, dout, w)) return false;
    if (n_exp <= 0 || rows == 0) return true;
    const cuuint64_t R = (cuuint64_t)rows;
    CUtensorMap ma, mb;
    const cuuint64_t da[2] = {(cuuint64_t)O, R}, sa[1] = {(cuuint64_t)O * 2};
    const cuuint32_t ba[2] = {64, BM};
    tma_make_map(&ma, dout, 2, da, sa, ba, "grouped_gemm");
    const cuuint64_t db[3] = {(cuuint64_t)I, (cuuint64_t)O, (cuuint64_t)n_exp};
    const cuuint64_t sb[2] = {(cuuint64_t)I * 2, (cuuint64_t)O * I * 2};
    const cuuint32_t bb[3] = {64, 64, 1};
    tma_make_map(&mb, w, 3, db, sb, bb, "grouped_gemm");
    CUtensorMap mo;
    const cuuint64_t dd[2] = {(cuuint64_t)I, R}, sd[1] = {(cuuint64_t)I * 2};
    tma_make_map(&mo, din, 2, dd, sd, ba, "grouped_gemm");
    launch<KIND_DGRAD>(1, &ma, &mb, &off, din, rows, n_exp, 0, I, O, &mo);
    return true;
}

/* The row matrices of one wgrad row set as TMA maps: dY [R, O] and X [R, I], boxes of 64 columns ×
 * one K block of rows. */
static void wgrad_maps(CUtensorMap *ma, CUtensorMap *mb, const void *dout, const void *in, int64_t R,
                       int I, int O)
{
    const cuuint64_t da[2] = {(cuuint64_t)O, (cuuint64_t)R}, sa[1] = {(cuuint64_t)O * 2};
    const cuuint32_t box[2] = {64, (cuuint32_t)bk_of<KIND_WGRAD>()};
    tma_make_map(ma, dout, 2, da, sa, box, "grouped_gemm");
    const cuuint64_t db[2] = {(cuuint64_t)I, (cuuint64_t)R}, sb[1] = {(cuuint64_t)I * 2};
    tma_make_map(mb, in, 2, db, sb, box, "grouped_gemm");
}

extern "C" bool grouped_gemm_wgrad(float *dw, const void *dout, const void *in, const int64_t *off,
                                   int64_t rows, int n_exp, int I, int O, bool overwrite)
{
    const struct expert_rows set = {dout, in, off, rows};
    return grouped_gemm_wgrad_sets(dw, &set, 1, n_exp, I, O, overwrite, nullptr);
}

/* grouped_gemm_wgrad_sets, whole (claim NULL) or in parts (no sumsq) */
static bool wgrad_sets(float *dw, const struct expert_rows *sets, int n_sets, int n_exp, int I, int O,
                       bool overwrite, int *claim, const struct exchange_arrival *until, double *sumsq)
{
    MT_CHECK(!sumsq || !claim, "grouped_gemm_wgrad_part: no sum of squares in parts");
    MT_CHECK(n_sets >= 1 && n_sets <= MAX_SETS, "grouped_gemm_wgrad_sets: %d row sets (1 to %d)",
             n_sets, MAX_SETS);
    for (int s = 0; s < n_sets; s++)
        if (sets[s].rows > 0 && !supported(I, O, sets[s].rows, dw, sets[s].dout, sets[s].in)) return false;
    if (!supported(I, O, 0, dw, dw, dw)) return false;
    if (n_exp <= 0 || (claim && n_exp > MAX_EXPERTS)) { /* too many: whole, elsewhere */
        if (n_exp <= 0 && sumsq) CUDA_CHECK(cudaMemsetAsync(sumsq, 0, sizeof(double), g_cuda.stream));
        return n_exp <= 0;
    }
    if (until && !until->flags) return true; /* a wait the device cannot see: nothing taken */
    /* sets with no rows need no tensor map (and cannot have one of zero rows) */
    CUtensorMap ma[MAX_SETS], mb[MAX_SETS];
    const int64_t *off[MAX_SETS];
    int n = 0;
    for (int s = 0; s < n_sets; s++) {
        if (sets[s].rows <= 0) continue;
        wgrad_maps(&ma[n], &mb[n], sets[s].dout, sets[s].in, sets[s].rows, I, O);
        off[n++] = sets[s].off;
    }
    const size_t dw_numel = (size_t)n_exp * O * I;
    if (n == 0) { /* no tiles but zeros, which the last part writes */
        if (overwrite && !until) CUDA_CHECK(cudaMemsetAsync(dw, 0, dw_numel * sizeof(float), g_cuda.stream));
        if (sumsq) cu_sumsq_f32_to(dw, dw_numel, sumsq);
        return true;
    }
    CUtensorMap mw;
    const cuuint64_t dwd[3] = {(cuuint64_t)I, (cuuint64_t)O, (cuuint64_t)n_exp};
    const cuuint64_t dws[2] = {(cuuint64_t)I * 4, (cuuint64_t)O * I * 4};
    const cuuint32_t dwb[3] = {32, BM, 1};
    tma_make_map_f32(&mw, dw, 3, dwd, dws, dwb, "grouped_gemm");
    /* overwriting, the tiles' sums come from their accumulators; adding, a pass over dw after */
    const size_t tile_sums = (size_t)n_exp * cdiv(O, BM) * cdiv(I, BN) * 8;
    double *partial = sumsq && overwrite ? (double *)cuda_scratch(SCRATCH_GG_SUMSQ, tile_sums * sizeof(double)) : nullptr;
    launch<KIND_WGRAD>(n, ma, mb, off, dw, 0, n_exp, O, I, 0, &mw, overwrite, claim, until, nullptr, partial);
    if (partial) cu_sum_f64_to(partial, tile_sums, sumsq);
    else if (sumsq) cu_sumsq_f32_to(dw, dw_numel, sumsq);
    return true;
}

extern "C" bool grouped_gemm_wgrad_sets(float *dw, const struct expert_rows *sets, int n_sets,
                                        int n_exp, int I, int O, bool overwrite, double *sumsq)
{
    return wgrad_sets(dw, sets, n_sets, n_exp, I, O, overwrite, nullptr, nullptr, sumsq);
}

extern "C" bool grouped_gemm_wgrad_part(float *dw, const struct expert_rows *sets, int n_sets, int n_exp,
                                        int I, int O, bool overwrite, int32_t *cursor,
                                        const struct exchange_arrival *until)
{
    return wgrad_sets(dw, sets, n_sets, n_exp, I, O, overwrite, cursor, until, nullptr);
}

extern "C" bool grouped_gemm_available(void) { return g_cuda.ready && g_cuda.hopper; }

extern "C" void *grouped_gemm_stream(void) { return (void *)g_cuda.stream; }
