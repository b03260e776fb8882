/* The tile schedule shared by the grouped expert GEMM kernels (grouped_gemm.cu: forward, dgrad and
 * the cooperative wgrad; grouped_gemm_wgrad.cu: the ping-pong wgrad). A launch covers up to
 * GG_MAX_EXPERTS experts with one flat list of output tiles; the host writes each expert's row
 * offset and the prefix sums of its tile counts into the kernel parameter, a CTA finds a tile's
 * expert by binary search. Also the host-side checks of what the kernels take. Internal to those
 * two files. */
#ifndef MT_CUDA_GROUPED_GEMM_SCHED_CUH
#define MT_CUDA_GROUPED_GEMM_SCHED_CUH

#include "cuda_common.cuh"
#include "tma.cuh"

#include <stdint.h>

namespace {

constexpr int GG_MAX_EXPERTS = 256; /* per launch (the schedule is a kernel parameter) */

struct gg_sched {
    int n_exp, e_base;  /* experts [e_base, e_base + n_exp) in this launch */
    int total_tiles;
    int row_off[GG_MAX_EXPERTS + 1];    /* absolute row offsets */
    int tile_start[GG_MAX_EXPERTS + 1]; /* prefix sums of tiles per expert */
};

struct gg_tile {
    int e;      /* expert, relative to the launch's e_base */
    int r0;     /* the expert's first row */
    int rows;   /* its row count (>= 1) */
    int mi, ni; /* tile coordinates. Forward/dgrad (output rows = the expert's rows): M fastest, so
                 * CTAs running together share a weight slab (measured on H100: 5-25% faster than
                 * N fastest, skewed rows included). Wgrad (output = dw[e], M x N fixed): N fastest */
};

/* Tile t of the launch; BM x BN output tiles over N columns. WGRAD: every expert with rows has
 * the same cdiv(M, BM) x cdiv(N, BN) tiles. */
template <bool WGRAD, int BM, int BN>
__device__ __forceinline__ gg_tile gg_decode(const gg_sched &s, int N, int t)
{
    /* the largest e with tile_start[e] <= t: an expert with no tiles shares its start with the
     * next one, so the search always lands on an expert that has tile t */
    int lo = 0, hi = s.n_exp - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s.tile_start[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    gg_tile ti;
    ti.e = lo;
    ti.r0 = s.row_off[lo];
    ti.rows = s.row_off[lo + 1] - ti.r0;
    const int local = t - s.tile_start[lo];
    if (WGRAD) {
        const int nt = (N + BN - 1) / BN;
        ti.ni = local % nt;
        ti.mi = local / nt;
    } else {
        const int mt = (ti.rows + BM - 1) / BM;
        ti.mi = local % mt;
        ti.ni = local / mt;
    }
    return ti;
}

inline int64_t gg_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool gg_aligned16(const void *q) { return ((uintptr_t)q & 15u) == 0; }

/* What the kernels handle: TMA wants 16-byte aligned bases and row strides (I, O multiples of 8),
 * coordinates are int32. */
inline bool gg_supported(int I, int O, const int64_t *off, int n_exp, const void *a, const void *b,
                         const void *c)
{
    if (I <= 0 || O <= 0 || I % 8 || O % 8) return false;
    if (n_exp > 0 && off[n_exp] > INT32_MAX) return false;
    if (!gg_aligned16(a) || !gg_aligned16(b) || !gg_aligned16(c)) return false;
    return g_cuda.ready && g_cuda.hopper; /* else the caller's sm_80 path (cuBLAS) */
}

/* Splits the experts into launches of at most GG_MAX_EXPERTS, fills s for each and calls
 * launch(grid) for those with tiles (grid: one persistent CTA an SM, fewer for small jobs). */
template <bool WGRAD, int BM, int BN, typename F>
void gg_for_each_launch(gg_sched &s, const int64_t *off, int n_exp, int M, int N, F launch)
{
    for (int e0 = 0; e0 < n_exp; e0 += GG_MAX_EXPERTS) {
        const int ne = n_exp - e0 < GG_MAX_EXPERTS ? n_exp - e0 : GG_MAX_EXPERTS;
        int64_t total = 0;
        for (int i = 0; i < ne; i++) {
            const int64_t rows = off[e0 + i + 1] - off[e0 + i];
            s.row_off[i] = (int)off[e0 + i];
            s.tile_start[i] = (int)total;
            if (rows > 0) total += (WGRAD ? gg_cdiv(M, BM) : gg_cdiv(rows, BM)) * gg_cdiv(N, BN);
            MT_CHECK(total <= INT32_MAX, "grouped_gemm: too many tiles");
        }
        s.row_off[ne] = (int)off[e0 + ne];
        s.tile_start[ne] = (int)total;
        if (total == 0) continue;
        s.n_exp = ne;
        s.e_base = e0;
        s.total_tiles = (int)total;
        launch(total < g_cuda.num_sms ? (int)total : g_cuda.num_sms);
    }
}

} /* namespace */

/* dw[e] += dout[rows of e]^T . in[rows of e] by the ping-pong kernel (grouped_gemm_wgrad.cu);
 * ma/mb: dout [R, M] and in [R, N] as 64 x 64 boxes, the caller has checked the arguments.
 * reduce: the epilogue's adds done by TMA reductions instead of from registers. */
void gg_wgrad_pingpong(const CUtensorMap &ma, const CUtensorMap &mb, float *dw, const int64_t *off,
                       int n_exp, int M, int N, bool reduce);

#endif
