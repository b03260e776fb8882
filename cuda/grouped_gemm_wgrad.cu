/* The expert weight-gradient GEMM on Hopper, ping-pong: dw[e] += dYᵀ · X over expert e's rows.
 *
 * Why a kernel of its own: the wgrad's K is the expert's row count (~512 a micro-step at the
 * bench's shape), so an output tile has few K blocks, and its epilogue, an fp32 read-add-write of
 * dw (8 bytes an element against 2·K FLOPs), takes as long as its MMAs. In the cooperative kernel
 * (grouped_gemm.cu, variant 0) both consumer warpgroups share one 128x256 tile and reach the
 * epilogue together, so the tensor cores wait for every dw pass. Here each consumer warpgroup owns
 * whole 128x128 tiles and the two alternate: while one adds its tile into dw, the other's MMAs run.
 *
 * CTA: warpgroup 0 is the producer (one thread issues TMA loads into a 6-stage ring of 32 KB
 * stages: two 64x64 MN-major boxes of dY for the tile's 128 dw rows, two of X for its 128 dw
 * columns, 64 expert rows each); warpgroups 1 and 2 consume. The CTA's tiles are
 * t_i = blockIdx.x + i·gridDim.x, and warpgroup 1 + (i % 2) takes tile i. The producer fills the
 * ring in tile order, so every stage belongs to exactly one warpgroup, and both warpgroups walk
 * the ring's stage/phase sequence over all the CTA's tiles, stepping over the other one's stages;
 * their MMA loops take turns (an mbarrier each: "my MMAs of this tile are issued").
 * As in the cooperative kernel: the K rows of the last block past the expert's end (the next
 * expert's rows) are zeroed in shared memory before the MMAs, the tile's dw rows are prefetched
 * into L2 when the tile starts so the epilogue's reads hit L2, and each dw element belongs to
 * exactly one tile (no atomics; the result does not depend on the schedule). */
#include "grouped_gemm.cuh"

#include "cuda_common.cuh"
#include "grouped_gemm_sched.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

#include <string.h>

namespace {

constexpr int BM = 128, BN = 128, BK = 64;
constexpr int THREADS = 384;                   /* producer warpgroup + 2 consumer warpgroups */
constexpr int BOX_BYTES = 64 * BK * 2;         /* one 64x64 MN-major box, 8 KB */
constexpr int A_BYTES = BM * BK * 2;           /* 16 KB: boxes 0, 1 */
constexpr int B_BYTES = BN * BK * 2;           /* 16 KB: boxes 2, 3 */
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int OUT_COLS = 32;                   /* REDUCE: dw columns a staging buffer holds */
constexpr int OUT_BYTES = BM * OUT_COLS * 4;   /* 16 KB, two a consumer warpgroup */

/* REDUCE: the epilogue hands dw += acc to the TMA (staged through shared memory, which costs a
 * stage); else each thread reads, adds and writes dw from its registers */
template <bool REDUCE> __host__ __device__ constexpr int stages() { return REDUCE ? 5 : 6; }
template <bool REDUCE> constexpr int smem_bytes()
{
    return stages<REDUCE>() * STAGE_BYTES + (REDUCE ? 4 * OUT_BYTES : 0) + 1024 /* alignment slack */ +
           (2 * stages<REDUCE>() + 2) * 8;
}

struct wgrad_params {
    CUtensorMap map_a, map_b; /* dY [R, M] and X [R, N], 64x64 boxes */
    CUtensorMap map_dw;       /* REDUCE: dw [n_exp][M][N], boxes of 128 rows x 32 columns */
    float *dw;                /* [n_exp, M, N] fp32 */
    int M, N;
    gg_sched s;
};

#ifndef MT_NO_HOPPER_CODE
/* D[64x128] += A[64x16] · B[128x16]ᵀ, both operands MN-major in shared memory */
__device__ __forceinline__ void wgmma_mn_n128(float (&d)[64], uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(1) /* scale-d: D += A·B */
                 : "memory");
}
#endif

/* dw rows m, m + 8 (of M), columns n0 + 8j + {0, 1} (of N) += acc[4j + {0,1}], acc[4j + {2,3}]:
 * one m64n128 accumulator. All 32 loads are issued before the first add, so a warpgroup keeps
 * 32 KB of reads in flight (one at a time, the read latency dominated). */
__device__ __forceinline__ void add_into_dw(float *dw, const float (&acc)[64], int m, int n0, int M,
                                            int N)
{
    float2 v[16][2];
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            if (n0 + 8 * j < N && m + 8 * h < M)
                v[j][h] = __ldcg((const float2 *)(dw + (size_t)(m + 8 * h) * N + n0 + 8 * j));
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            if (n0 + 8 * j < N && m + 8 * h < M) {
                v[j][h].x += acc[4 * j + 2 * h];
                v[j][h].y += acc[4 * j + 2 * h + 1];
                *(float2 *)(dw + (size_t)(m + 8 * h) * N + n0 + 8 * j) = v[j][h];
            }
}

/* REDUCE's epilogue: the accumulators into shared memory 32 columns at a time, each chunk then
 * added into dw by one TMA reduction while the next is written. buf0: this warpgroup's two
 * staging buffers, 128 B rows in the 128-byte swizzle the tensor map names (16-byte chunk q of
 * row r at q ^ (r % 8)), so a warp's 8 rows land in different banks. */
__device__ __forceinline__ void reduce_into_dw(const wgrad_params &p, const gg_tile &ti, uint32_t buf0,
                                               const float (&acc0)[64], const float (&acc1)[64],
                                               int wtid, int bar_id)
{
    const int lane = wtid & 31, row_in_half = (wtid / 32) * 16 + (lane >> 2);
#pragma unroll
    for (int c = 0; c < BN / OUT_COLS; c++) {
        const uint32_t buf = buf0 + (c & 1) * OUT_BYTES;
        if (wtid == 0) bulk_wait_read<1>(); /* the reduction that last read buf (two chunks ago) */
        asm volatile("bar.sync %0, 128;" ::"r"(bar_id) : "memory");
#pragma unroll
        for (int jj = 0; jj < OUT_COLS / 8; jj++) {
            const int j = c * (OUT_COLS / 8) + jj, q = 2 * jj + ((lane & 3) >> 1);
#pragma unroll
            for (int h = 0; h < 4; h++) { /* rows +0, +8 of acc0, then of acc1 */
                const int r = (h >> 1) * 64 + row_in_half + 8 * (h & 1);
                const float *acc = h < 2 ? acc0 : acc1;
                const uint32_t a = buf + r * 128 + ((q ^ (r & 7)) << 4) + 8 * (lane & 1);
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(a), "f"(acc[4 * j + 2 * (h & 1)]),
                             "f"(acc[4 * j + 2 * (h & 1) + 1])
                             : "memory");
            }
        }
        fence_proxy_async(); /* for the TMA's reads */
        asm volatile("bar.sync %0, 128;" ::"r"(bar_id) : "memory");
        if (wtid == 0) {
            tma_reduce_add_3d(&p.map_dw, buf, ti.ni * BN + c * OUT_COLS, ti.mi * BM, p.s.e_base + ti.e);
            bulk_commit();
        }
    }
}

template <bool REDUCE>
__global__ void __launch_bounds__(THREADS, 1) wgrad_pingpong_kernel(const __grid_constant__ wgrad_params p)
{
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    constexpr int STAGES = stages<REDUCE>();
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u; /* SW128 atoms: 1024-aligned */
    const uint32_t out_bufs = base + STAGES * STAGE_BYTES; /* REDUCE: 2 a consumer warpgroup */
    const uint32_t bars = out_bufs + (REDUCE ? 4 * OUT_BYTES : 0);
    auto full_bar = [&](int s) { return bars + 8u * s; };
    auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };
    auto issued_bar = [&](int w) { return bars + 8u * (2 * STAGES + w); };

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full_bar(s), 1);  /* the producer's expect_tx arrival (+ the TMA bytes) */
            mbar_init(empty_bar(s), 4); /* one arrival per warp of the stage's warpgroup */
        }
        for (int w = 0; w < 2; w++) mbar_init(issued_bar(w), 4); /* a warpgroup's 4 warps */
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        /* ------------------------------------------------ producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x != 0) return;
        int stage = 0;
        uint32_t phase = 0;
        for (int t = blockIdx.x; t < p.s.total_tiles; t += gridDim.x) {
            const gg_tile ti = gg_decode<true, BM, BN>(p.s, p.N, t);
            const int nk = (ti.rows + BK - 1) / BK;
            for (int kb = 0; kb < nk; kb++) {
                const uint32_t sa = base + stage * STAGE_BYTES, sb = sa + A_BYTES, fb = full_bar(stage);
                mbar_wait(empty_bar(stage), phase ^ 1);
                mbar_expect_tx(fb, STAGE_BYTES); /* out-of-bounds box parts count too */
                const int k0 = ti.r0 + kb * BK;
                for (int j = 0; j < 2; j++) tma_2d(sa + j * BOX_BYTES, &p.map_a, ti.mi * BM + 64 * j, k0, fb);
                for (int j = 0; j < 2; j++) tma_2d(sb + j * BOX_BYTES, &p.map_b, ti.ni * BN + 64 * j, k0, fb);
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int w = wg - 1;
    const int wtid = threadIdx.x & 127;
    const int lane = threadIdx.x & 31;
    const int row_in_half = (wtid / 32) * 16 + (lane >> 2); /* of a 64-row accumulator */
    const int col_in_tile = 2 * (lane & 3);
    int stage = 0;
    uint32_t phase = 0;
    int i = 0, mine = 0; /* the CTA's tile count, this warpgroup's */
    for (int t = blockIdx.x; t < p.s.total_tiles; t += gridDim.x, i++) {
        const gg_tile ti = gg_decode<true, BM, BN>(p.s, p.N, t);
        const int nk = (ti.rows + BK - 1) / BK;
        if ((i & 1) != w) { /* the other warpgroup's tile: step over its stages */
            const int s = stage + nk;
            phase ^= (uint32_t)((s / STAGES) & 1);
            stage = s % STAGES;
            continue;
        }
        float *dw = p.dw + (size_t)(p.s.e_base + ti.e) * p.M * p.N;
        {
            /* this tile's dw rows (512 B each) into L2 now, so that the epilogue's reads overlap
             * the MMAs instead of following them; N % 8 == 0 keeps size and address 16-aligned */
            const int row = ti.mi * BM + wtid, col = ti.ni * BN;
            if (row < p.M) {
                const int bytes = (p.N - col < BN ? p.N - col : BN) * 4;
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(dw + (size_t)row * p.N + col),
                             "r"(bytes)
                             : "memory");
            }
        }
        float acc0[64], acc1[64]; /* dw rows 0-63 and 64-127 of the tile */
#pragma unroll
        for (int j = 0; j < 64; j++) acc0[j] = 0.0f, acc1[j] = 0.0f;

        /* The MMA loops take turns: tile i's starts when tile i-1's (the other warpgroup's) has
         * issued its last MMA. Not for the tensor cores' sake: the ring's parity waits are only
         * right for a waiter at most one phase ahead of a stage's barrier, and having stepped over
         * the other warpgroup's stages this one could otherwise be two ahead. */
        if (i > 0) mbar_wait(issued_bar(1 - w), (uint32_t)((w == 0 ? mine - 1 : mine) & 1));
        int prev = -1;
        for (int kb = 0; kb < nk; kb++) {
            const uint32_t sa = base + stage * STAGE_BYTES, sb = sa + A_BYTES;
            mbar_wait(full_bar(stage), phase);
            if (ti.rows - kb * BK < BK) {
                /* K rows past the expert's end: zero them in the stage's four boxes (contiguous).
                 * Swizzling permutes 16-byte chunks within a 128-byte K row, so rows stay whole. */
                const int valid = ti.rows - kb * BK;
                const int per_box = (BK - valid) * 8; /* 16-byte chunks */
                for (int c = wtid; c < 4 * per_box; c += 128) {
                    const int box = c / per_box, cc = c - box * per_box;
                    const uint32_t a = sa + box * BOX_BYTES + valid * 128 + cc * 16;
                    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(a), "r"(0) : "memory");
                }
                fence_proxy_async(); /* for wgmma's reads */
                asm volatile("bar.sync %0, 128;" ::"r"(1 + w) : "memory");
            }
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++) {
                const uint64_t db = smem_desc(sb + kk * 2048, BOX_BYTES, 1024);
                wgmma_mn_n128(acc0, smem_desc(sa + kk * 2048, BOX_BYTES, 1024), db);
                wgmma_mn_n128(acc1, smem_desc(sa + BOX_BYTES + kk * 2048, BOX_BYTES, 1024), db);
            }
            wgmma_commit();
            wgmma_wait<1>(); /* the previous block's MMAs are done: release its stage */
            if (prev >= 0 && lane == 0) mbar_arrive(empty_bar(prev));
            prev = stage;
            if (++stage == STAGES) stage = 0, phase ^= 1;
        }
        if (lane == 0) mbar_arrive(issued_bar(w));
        mine++;
        wgmma_wait<0>();
        if (lane == 0) mbar_arrive(empty_bar(prev));
#pragma unroll
        for (int j = 0; j < 64; j++) {
            asm volatile("" : "+f"(acc0[j])::"memory");
            asm volatile("" : "+f"(acc1[j])::"memory");
        }
        if (REDUCE) {
            reduce_into_dw(p, ti, out_bufs + w * 2 * OUT_BYTES, acc0, acc1, wtid, 1 + w);
        } else {
            const int m = ti.mi * BM + row_in_half, n0 = ti.ni * BN + col_in_tile;
            add_into_dw(dw, acc0, m, n0, p.M, p.N);
            add_into_dw(dw, acc1, m + 64, n0, p.M, p.N);
        }
    }
    if (REDUCE && wtid == 0) bulk_wait_all(); /* the staging buffers stay until the TMA has read them */
#endif
}

template <bool REDUCE> void launch(const wgrad_params &p, const int64_t *off, int n_exp)
{
    static bool attr_set;
    if (!attr_set) {
        CUDA_CHECK(cudaFuncSetAttribute(wgrad_pingpong_kernel<REDUCE>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<REDUCE>()));
        attr_set = true;
    }
    static wgrad_params q; /* 2 KB: kept off the stack; the launch copies it */
    q = p;
    gg_for_each_launch<true, BM, BN>(q.s, off, n_exp, p.M, p.N, [&](int grid) {
        wgrad_pingpong_kernel<REDUCE><<<grid, THREADS, smem_bytes<REDUCE>(), g_cuda.stream>>>(q);
        CUDA_LAUNCH_CHECK("wgrad_pingpong_kernel");
    });
}

} // namespace

void gg_wgrad_pingpong(const CUtensorMap &ma, const CUtensorMap &mb, float *dw, const int64_t *off,
                       int n_exp, int M, int N, bool reduce)
{
    static wgrad_params p;
    memset(&p, 0, sizeof p);
    p.map_a = ma;
    p.map_b = mb;
    p.dw = dw;
    p.M = M, p.N = N;
    if (reduce) {
        const cuuint64_t dims[3] = {(cuuint64_t)N, (cuuint64_t)M, (cuuint64_t)n_exp};
        const cuuint64_t strides[2] = {(cuuint64_t)N * 4, (cuuint64_t)M * N * 4};
        const cuuint32_t box[3] = {OUT_COLS, BM, 1};
        tma_make_map_f32(&p.map_dw, dw, 3, dims, strides, box, "grouped_gemm wgrad");
        launch<true>(p, off, n_exp);
    } else {
        launch<false>(p, off, n_exp);
    }
}
