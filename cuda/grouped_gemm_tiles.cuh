/* The grouped expert GEMM's shapes and tile schedule (included by grouped_gemm.cu only): tile
 * and stage sizes, the kernel's parameters, and how a CTA finds a tile's expert, rows and K
 * blocks from the device offsets. */
#ifndef MT_CUDA_GROUPED_GEMM_TILES_CUH
#define MT_CUDA_GROUPED_GEMM_TILES_CUH

#include "cuda_common.cuh"
#include "ops.h" /* MT_WGRAD_MAX_SETS */
#include "tma.cuh" /* CUtensorMap */

#include <stdlib.h>
#include <string.h>

namespace {


constexpr int BM = 128, BN = 256;
constexpr int THREADS = 384;                 /* producer warpgroup + 2 consumer warpgroups */
constexpr int MAX_EXPERTS = 256;             /* per launch: its tile starts live in shared memory */
constexpr int MAX_SETS = MT_WGRAD_MAX_SETS;  /* wgrad row sets a launch (grouped_gemm_wgrad_sets) */
/* Forward/dgrad visit an expert's tiles in groups of GROUP_M row tiles, every column tile of a
 * group before the next group, so the CTAs running together share both operands' tiles in L2.
 * Down an expert's whole row range first (as before), a large expert's concurrent tiles each read
 * another of its ~60 row tiles. H200, skewed rows: gate_up forward 609 -> 623 TFLOPS (4 and 16
 * the same as 8); balanced experts (4 row tiles) are visited as before. */
constexpr int GROUP_M = 8;

enum { KIND_FWD, KIND_DGRAD, KIND_WGRAD };

/* Every kind stages its output tile in shared memory for the TMA: forward/dgrad the bf16 tile
 * (64 KB) beside 3 operand stages of 64 K; wgrad half its fp32 tile at a time (64 KB: the dw warp
 * sends one half while the consumers wait, then the other under the next tile's MMAs) beside 3
 * stages of 64 K, so each stage handshake feeds four MMAs a warpgroup, as in the forward. Before:
 * the whole fp32 tile (128 KB) beside 4 stages of 32 K (2 of 64 fed the MMAs 12% slower: H200,
 * wgrad2 gate_up without its epilogue 1.45 ms against 1.29; half the tile beside 6 of 32 was no
 * faster in the step: docs/benchmarks.md, nineteenth session). */
constexpr int WGRAD_HALVES = 2; /* the fp32 tile is staged in this many column halves */
template <int KIND> __host__ __device__ constexpr int bk_of() { return 64; }
template <int KIND> __host__ __device__ constexpr int stages_of() { return 3; }
template <int KIND> __host__ __device__ constexpr int a_bytes_of() { return BM * bk_of<KIND>() * 2; }
template <int KIND> __host__ __device__ constexpr int b_bytes_of() { return BN * bk_of<KIND>() * 2; }
/* one MN-major box: 64 MN-elements x bk K-rows */
template <int KIND> __host__ __device__ constexpr int box_bytes_of() { return 64 * bk_of<KIND>() * 2; }
template <int KIND> __host__ __device__ constexpr int stage_bytes_of() { return a_bytes_of<KIND>() + b_bytes_of<KIND>(); }
template <int KIND> __host__ __device__ constexpr int out_bytes_of() { return KIND == KIND_WGRAD ? BM * BN * 4 / WGRAD_HALVES : BM * BN * 2; }
/* wgrad: the dw map's boxes (32 fp32 columns x BM rows) in one staged part of the tile */
constexpr int WGRAD_BOXES_PER_PART = BN / 32 / WGRAD_HALVES;
template <int KIND> constexpr int smem_bytes_of()
{
    return stages_of<KIND>() * stage_bytes_of<KIND>() + out_bytes_of<KIND>() + 1024 /* alignment slack */ +
           2 * stages_of<KIND>() * 8 + 2 * 8 /* wgrad: free, staged */ +
           stages_of<KIND>() * 32 /* a tile header per stage */ + 16 /* wgrad: the staged tile's */;
}
/* beside the dynamic part: the tile starts, a scan's warp totals and the expert order (tile_starts) */
constexpr int STATIC_SMEM = (MAX_EXPERTS + 1 + THREADS / 32) * 4 + MAX_EXPERTS;
static_assert(MAX_EXPERTS <= 256, "the expert order is one byte an expert");
static_assert(smem_bytes_of<KIND_WGRAD>() + STATIC_SMEM <= 227 * 1024, "wgrad shared memory exceeds the SM's 227 KB");
static_assert(smem_bytes_of<KIND_FWD>() + STATIC_SMEM <= 227 * 1024, "shared memory exceeds the SM's 227 KB");

struct gg_params {
    /* forward/dgrad: [0] only; wgrad: one pair per row set (micro-step), K walks the sets in order */
    CUtensorMap map_a[MAX_SETS], map_b[MAX_SETS];
    CUtensorMap map_out;        /* forward/dgrad: out [R, N] bf16, boxes of 64 columns × BM rows;
                                 * wgrad: dw [n_exp, M, N] fp32, boxes of 32 columns × BM rows */
    void *out;          /* bf16 [R, N] (forward, dgrad) or fp32 dw [n_exp, M, N] (wgrad) */
    int M, N, K;        /* wgrad: M = O, N = I; forward/dgrad: N, K (M is the expert's rows) */
    int overwrite;      /* wgrad: dw = acc (dw not read; experts with no rows get zero tiles) */
    /* wgrad, overwriting, whole launches: each tile slot's Σ acc² (the values it stores), one
     * double a consumer warp ([tiles of the launch][8]), or NULL */
    double *sumsq;
    int dw_pace;        /* wgrad: the dw warp spreads a tile's adds over this many thousandths of
                         * the next tile's MMA time at the SM's peak (0: all at once) */
    int heavy_first;    /* wgrad: experts visited in order of falling K blocks, each full round of
                         * the grid over the tiles in the opposite direction to the one before
                         * (tile_starts, decode); 0: in expert order */
    int n_exp, e_base;  /* experts [e_base, e_base + n_exp) in this launch (n_exp <= MAX_EXPERTS) */
    int tiles_m;        /* row tiles an expert: wgrad ceil(M / BM); 0: ceil(its rows / BM) */
    /* device: each row set's n_exp + 1 absolute row offsets (from expert e_base on); each CTA
     * turns them into tile starts in shared memory */
    const int64_t *off[MAX_SETS];
    /* device: set 0's row ends, expert e's rows [off[0][e], end0[e]) (off[0] + 1 but for a forward
     * over part of each expert's rows: moe.c's rows of one source rank) */
    const int64_t *end0;
    int n_sets;         /* 1 (forward, dgrad) .. MAX_SETS */
    /* wgrad in parts (grouped_gemm_wgrad_part): the CTAs take tiles from claim[0] (device; the
     * next tile of the launch's order) instead of every grid-th one, and set claim[1] once none
     * is left; NULL: the grid-stride schedule. With stop_flags they take no more tiles once the
     * exchange has arrived: stop_flags[d] - stop_epoch >= 0 for every d < stop_n but stop_skip. */
    int *claim;
    const uint32_t *stop_flags;
    uint32_t stop_epoch;
    int stop_n, stop_skip;
};

/* kernel parameters live in the 4 KB constant bank of a launch */
static_assert(sizeof(gg_params) <= 4096, "gg_params exceeds the kernel parameter space");

/* ---------------------------------------------------------------- tile schedule */

struct tile_info {
    int e;     /* expert */
    int r0;    /* the expert's first row (forward/dgrad; wgrad: in the first row set) */
    int rows;  /* its row count (forward/dgrad >= 1; wgrad: in the first row set) */
    int nk;    /* wgrad: the K blocks of all its row sets (0: an overwriting wgrad's zero tile);
                * each set's rows are read where the producer's walk reaches the set (set_walk),
                * so that the sets a launch takes (MAX_SETS) cost no registers */
    int mi, ni; /* tile coordinates. Forward/dgrad: M fastest within groups of GROUP_M row
                 * tiles, so CTAs running together share a weight slab (measured on H100: 5-25%
                 * faster than N fastest, skewed rows included); wgrad: N fastest (measured only
                 * that way) */
};

/* Every thread of the CTA (THREADS >= MAX_EXPERTS): the order in which the launch's experts are
 * visited (order[i] = the i-th expert) and tile_start[i] = the tiles of the experts before the
 * i-th, tile_start[n_exp] = all of them. An expert has tiles when it has rows in any set, or
 * always when overwriting. Ends with the block's barrier.
 *
 * Wgrad (heavy_first): a tile's MMAs take its expert's K blocks, which follow the routing (the
 * bench's experts get 0-5x the mean rows), and the CTAs take every grid-th tile, so some CTAs drew
 * several of the heaviest experts' tiles and finished last. Visiting the experts heaviest first
 * (ties by index) and turning every other full round of the grid (decode) deals the tiles out as
 * longest-first does, whatever the routing; with equal rows the order is the launch order.
 * scratch: MAX_EXPERTS ints of shared memory nothing else uses yet. */
template <int KIND>
__device__ void tile_starts(const gg_params &p, int *tile_start /*[MAX_EXPERTS + 1] smem*/,
                            uint8_t *order /*[MAX_EXPERTS] smem*/, int *scratch)
{
    static_assert(THREADS >= MAX_EXPERTS, "one thread an expert");
    __shared__ int warp_tot[THREADS / 32];
    const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
    int v = 0, k_total = 0;
    if (e < p.n_exp) {
        const int64_t rows = __ldg(p.end0 + e) - __ldg(p.off[0] + e);
        bool any = rows > 0 || p.overwrite;
        k_total = (int)((rows + bk_of<KIND>() - 1) / bk_of<KIND>());
        for (int s = 1; KIND == KIND_WGRAD && s < p.n_sets; s++) { /* forward/dgrad: one set */
            const int64_t rs = __ldg(p.off[s] + e + 1) - __ldg(p.off[s] + e);
            any = any || rs > 0;
            k_total += (int)((rs + bk_of<KIND>() - 1) / bk_of<KIND>());
        }
        if (any) v = (p.tiles_m ? p.tiles_m : (int)((rows + BM - 1) / BM)) * ((p.N + BN - 1) / BN);
    }
    if (KIND == KIND_WGRAD && p.heavy_first) {
        if (e < p.n_exp) scratch[e] = k_total;
        __syncthreads();
        int place = 0; /* experts that go before e */
        for (int j = 0; e < p.n_exp && j < p.n_exp; j++) {
            const int kj = scratch[j];
            place += kj > k_total || (kj == k_total && j < e);
        }
        __syncthreads(); /* every count read */
        if (e < p.n_exp) scratch[place] = v, order[place] = (uint8_t)e;
        __syncthreads();
        v = e < p.n_exp ? scratch[e] : 0; /* from here on, thread i scans the i-th expert */
    } else if (e < p.n_exp) {
        order[e] = (uint8_t)e;
    }
    int x = v; /* inclusive scan within the warp, then over the warps' totals */
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_tot[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < THREADS / 32 ? warp_tot[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < THREADS / 32) warp_tot[lane] = w;
    }
    __syncthreads();
    if (e < p.n_exp) tile_start[e + 1] = x + (warp ? warp_tot[warp - 1] : 0);
    if (e == 0) tile_start[0] = 0;
    __syncthreads();
}

/* The tile a CTA takes at its slot t (blockIdx.x + k gridDim.x): tile t of the order tile_starts
 * made, except that with heavy_first every odd full round of the grid runs backwards (CTA b takes
 * the round's (gridDim.x - 1 - b)-th tile), so a CTA that drew a heavy tile in one round draws a
 * light one in the next. The last, partial round keeps its order, so every CTA's slots still end
 * at the first t >= the tile count. */
template <int KIND, bool PARTS>
__device__ __forceinline__ tile_info decode(const gg_params &p, const int *tile_start, const uint8_t *order, int t)
{
    if (KIND == KIND_WGRAD && p.heavy_first && !PARTS) { /* claimed tiles balance themselves */
        const int g = (int)gridDim.x, round = t / g;
        if ((round & 1) && (round + 1) * g <= tile_start[p.n_exp]) t = round * g + (g - 1 - (t - round * g));
    }
    /* the largest i with tile_start[i] <= t: an expert with no tiles shares its start with the
     * next one, so the search always lands on an expert that has tile t */
    int lo = 0, hi = p.n_exp - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tile_start[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    tile_info ti;
    const int e = order[lo];
    ti.e = e;
    ti.r0 = (int)__ldg(p.off[0] + e);
    ti.rows = (int)__ldg(p.end0 + e) - ti.r0;
    ti.nk = 0;
    if (KIND == KIND_WGRAD) {
        constexpr int BK = bk_of<KIND>();
        ti.nk = (ti.rows + BK - 1) / BK;
        for (int s = 1; s < p.n_sets; s++)
            ti.nk += ((int)(__ldg(p.off[s] + e + 1) - __ldg(p.off[s] + e)) + BK - 1) / BK;
    }
    const int local = t - tile_start[lo];
    if (KIND == KIND_WGRAD) {
        const int nt = (p.N + BN - 1) / BN;
        ti.ni = local % nt;
        ti.mi = local / nt;
    } else {
        const int mt = (ti.rows + BM - 1) / BM, nt = (p.N + BN - 1) / BN;
        const int g0 = local / (GROUP_M * nt) * GROUP_M, gm = min(GROUP_M, mt - g0);
        const int in = local - g0 * nt;
        ti.mi = g0 + in % gm;
        ti.ni = in / gm;
    }
    return ti;
}

/* wgrad's dw_pace: 1000 spreads a tile's adds over the next tile's MMA time at the tensor cores'
 * peak rate (about two thirds of what it takes in a step); MT_GG_DW_PACE (0-4000, 0 = all at
 * once) overrides it, for measuring */
inline int dw_pace(void)
{
    static int pace = -1;
    if (pace < 0) {
        const char *env = getenv("MT_GG_DW_PACE");
        pace = env ? atoi(env) : 1000;
        if (pace < 0 || pace > 4000) pace = 0;
    }
    return pace;
}

/* wgrad: heaviest experts first (tile_starts); MT_GG_HEAVY_FIRST=0 keeps the expert order, for
 * measuring */
inline int heavy_first(void)
{
    static int on = -1;
    if (on < 0) {
        const char *env = getenv("MT_GG_HEAVY_FIRST");
        on = !(env && !strcmp(env, "0"));
    }
    return on;
}

/* wgrad in parts: whether the exchange that stop_flags watch has arrived (never without them) */
__device__ __forceinline__ bool exchange_arrived(const gg_params &p)
{
    if (!p.stop_flags) return false;
    for (int d = 0; d < p.stop_n; d++) {
        if (d == p.stop_skip) continue;
        uint32_t v;
        asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p.stop_flags + d) : "memory");
        if ((int32_t)(v - p.stop_epoch) < 0) return false;
    }
    return true;
}

/* Wgrad's walk over the row sets' K blocks, in the producer: before each block, the set it comes
 * from, the block's first row there and how many of its BK rows are the expert's (sets with no
 * rows for the expert are passed over; a set's offsets are read when the walk reaches it). */
struct set_walk {
    int s = 0, kb = 0, r0 = 0, rows = 0;
    __device__ __forceinline__ void start(const tile_info &ti) { s = 0, kb = 0, r0 = ti.r0, rows = ti.rows; }
    /* the next K block: its first row (in set s) and its valid rows (<= BK) */
    __device__ __forceinline__ int next(const gg_params &p, int e, int *valid)
    {
        constexpr int BK = bk_of<KIND_WGRAD>();
        while (kb * BK >= rows) {
            s++, kb = 0;
            r0 = (int)__ldg(p.off[s] + e);
            rows = (int)__ldg(p.off[s] + e + 1) - r0;
        }
        const int left = rows - kb * BK;
        *valid = left < BK ? left : BK;
        return r0 + kb++ * BK;
    }
};

template <int KIND> __device__ __forceinline__ int k_blocks(const gg_params &p, const tile_info &ti)
{
    constexpr int BK = bk_of<KIND>();
    return KIND == KIND_WGRAD ? ti.nk : (p.K + BK - 1) / BK;
}

} // namespace

#endif
