/* Internal to the attention kernels on the Hopper warpgroup MMA (attention_tma_bwd.cu and
 * attention_tma_dq.cu: the backward's dK/dV and dQ passes; attention_tma_fwd.cu and attention_wgmma_fwd.cu: the forward):
 * the wgmma shapes they issue, the 128-byte-swizzle descriptors of their [rows][D] bf16 tiles, the
 * swizzled tile load, the register tricks that keep ptxas from serialising the MMAs, and the steps
 * the kernels share (the forward's softmax and row store, the backward's products and stores).
 * Device code only, file-local in each including file.
 *
 * Tiles: bf16 rows of one head in the layout of wgmma's 128-byte-swizzle descriptors: D/64 boxes
 * of R rows × 64 columns (128 B a row; box after box, R·128 B apart), 16-byte chunk c of row r
 * stored at chunk c ^ (r & 7), everything 1024-aligned (what TMA's 128-byte swizzle writes and
 * load_rows_sw below writes with cp.async). One such [rows][D] tile is both a K-major operand
 * (k = D: Q·Kᵀ, K·Qᵀ, V·dOᵀ; 8-row groups SBO = 1024 B apart, a k step of 16 is +32 B inside a
 * box) and an MN-major one (k = rows: P·V, Pᵀ·dO, dSᵀ·Q, dS·K; boxes LBO = R·128 B apart along D,
 * a k step of 16 rows is +2048 B) -- the conventions grouped_gemm.cu uses and tests. A warpgroup
 * owns 64 rows of each output; the scores come from SS wgmma m64n64k16 (or n128) into the
 * accumulator layout of mma.sync (warp w of the group: rows 16w + g, 16w + g + 8, columns 8j + 2t,
 * 2t+1), which packed to bf16 is the register A operand of the RS wgmma m64nDk16 that follows. */
#ifndef MT_CUDA_ATTENTION_WGMMA_CUH
#define MT_CUDA_ATTENTION_WGMMA_CUH

#include "attention_tc_common.cuh"

#include <type_traits>

namespace {

/* keeps the compiler from moving reads of an accumulator above the wait for its MMA */
template <int N> __device__ __forceinline__ void fence_regs(float (&x)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(x[i])::"memory");
}

/* 128-byte-swizzled tiles here keep their 8-row groups 1024 B apart (the stride byte offset) */
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo) { return smem_desc(addr, lbo, 1024); }

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

/* d[64×64] (+)= A[64×16] · B[16×64], both in shared memory, K-major unless TA / TB (then MN-major:
 * A's 64 rows, B's 64 columns contiguous) */
template <int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
}

/* d[64×128] (+)= A[64×16] · B[16×128], both in shared memory, K-major unless TA / TB (as wgmma_ss_n64) */
template <int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t da, uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
}

/* d (+)= A·B over 16 k with N = 64 or 128: the score tile of a key block (K-major A and B), or
 * dS·K in the backward's dQ pass (both MN-major) */
template <int N, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_ss_nn(float (&d)[N / 2], uint64_t da, uint64_t db, int acc)
{
    if constexpr (N == 128) wgmma_ss_n128<TA, TB>(d, da, db, acc);
    else wgmma_ss_n64<TA, TB>(d, da, db, acc);
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

/* Rows row0 .. row0+R-1 of one head (as load_rows) into the 128-byte-swizzled layout at dst:
 * 64-column slabs of R rows, chunk c of row r at chunk (c ^ r) mod 8 of its 128-byte line */
template <int R, int D, int NT>
__device__ __forceinline__ void load_rows_sw(uint32_t dst, const bf16 *base, size_t stride, int row0, int S)
{
    load_rows_at<R, D, NT>(
        [dst](int r, int c) {
            return dst + (uint32_t)(c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
        },
        base, stride, row0, S);
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

/* ---------------------------------------------------------------- the forward kernels' shared steps
 * (attention_wgmma_fwd.cu, attention_tma_fwd.cu). A warpgroup owns 64 queries; in the accumulator
 * layout a thread holds rows row0 and row0 + 8 and, of a tile of keys from k0, the columns
 * k0 + 8·(i/4) + 2t + (i&1) of element i. */

/* The online softmax of one landed score tile s (64 queries × BC keys): the row maxima mr (raw
 * scores) and this thread's partial row sums lr move on, P is packed to bf16 into pc (the A
 * operands of P·V) and alpha is the factor by which O must be rescaled. MASKED: keys after the
 * query or at or past S count as -inf. */
template <int BC, bool MASKED>
__device__ __forceinline__ void fwd_softmax_tile(const float (&s)[BC / 2], uint32_t (&pc)[BC / 16][4],
                                                 float (&alpha)[2], float (&mr)[2], float (&lr)[2],
                                                 int row0, int k0, int t, int S, float scale_log2)
{
    auto score = [&](int i) {
        if constexpr (!MASKED) return s[i];
        const int row = row0 + 8 * ((i >> 1) & 1), col = k0 + 8 * (i >> 2) + 2 * t + (i & 1);
        return col > row || col >= S ? -INFINITY : s[i];
    };
    float mx[2] = {-INFINITY, -INFINITY}, base[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < BC / 2; i++) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], score(i));
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mnew = fmaxf(mr[r], mx[r]);
        base[r] = mnew == -INFINITY ? 0.0f : mnew * scale_log2; /* nothing visible: p = 0 */
        alpha[r] = ex2(mr[r] * scale_log2 - base[r]);
        mr[r] = mnew;
    }
#pragma unroll
    for (int kk = 0; kk < BC / 16; kk++) {
        float p[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int i = 8 * kk + e;
            p[e] = ex2(fmaf(score(i), scale_log2, -base[(i >> 1) & 1]));
            rs[(i >> 1) & 1] += p[e];
        }
        pc[kk][0] = pack_bf16(p[0], p[1]);
        pc[kk][1] = pack_bf16(p[2], p[3]);
        pc[kk][2] = pack_bf16(p[4], p[5]);
        pc[kk][3] = pack_bf16(p[6], p[7]);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) lr[r] = lr[r] * alpha[r] + rs[r];
}

/* fwd_softmax_tile for the tile of keys k0 .. k0+BC-1 seen by queries wq0 ..: the masked copy only
 * where the tile crosses the diagonal or S (one copy with a runtime test gets if-converted into
 * every tile) */
template <int BC>
__device__ __forceinline__ void fwd_softmax(const float (&s)[BC / 2], uint32_t (&pc)[BC / 16][4],
                                            float (&alpha)[2], float (&mr)[2], float (&lr)[2], int row0,
                                            int wq0, int k0, int t, int S, float scale_log2)
{
    if (k0 + BC - 1 > wq0 || k0 + BC > S)
        fwd_softmax_tile<BC, true>(s, pc, alpha, mr, lr, row0, k0, t, S, scale_log2);
    else
        fwd_softmax_tile<BC, false>(s, pc, alpha, mr, lr, row0, k0, t, S, scale_log2);
}

/* The thread's rows of out (O over the row sum, bf16) and of lse (natural log), rows past S not
 * written. out/lse point at (batch b, head h): out row r at out + r·Hq·D, lse row r at lse + r. */
template <int D>
__device__ __forceinline__ void fwd_store_rows(bf16 *out, float *lse, const float (&o)[D / 2],
                                               const float (&mr)[2], const float (&lr)[2], int row0,
                                               int t, int S, int Hq, float scale)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float ls = lr[r];
        ls += __shfl_xor_sync(0xffffffffu, ls, 1);
        ls += __shfl_xor_sync(0xffffffffu, ls, 2);
        const int row = row0 + 8 * r;
        if (row >= S) continue;
        const float inv = 1.0f / ls;
        bf16 *dst = out + (size_t)row * Hq * D + 2 * t;
#pragma unroll
        for (int jd = 0; jd < D / 8; jd++)
            *reinterpret_cast<__nv_bfloat162 *>(dst + jd * 8) =
                __floats2bfloat162_rn(o[4 * jd + 2 * r] * inv, o[4 * jd + 2 * r + 1] * inv);
        if (t == 0) lse[row] = mr[r] * scale + logf(ls);
    }
}

/* ---------------------------------------------------------------- the backward kernels' shared steps
 * (attention_tma_bwd.cu) */

/* d[64×64] = rows r0 .. r0+63 of the K-major tile a (RA rows) times the first 64 rows of the K-major
 * tile b (RB rows), transposed: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, S = Q·Kᵀ, dP = dO·Vᵀ; one commit group */
template <int D, int RA, int RB>
__device__ __forceinline__ void bwd_scores(float (&d)[32], uint32_t a, int r0, uint32_t b)
{
    undef_regs(d);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) wgmma_ss_n64(d, desc_kmajor<RA>(a, r0, kk), desc_kmajor<RB>(b, 0, kk), kk > 0);
    wgmma_commit();
}

/* acc[64×D] (+)= xa[64×64] (registers, bf16 as pack_a64 leaves them) · the R-row tile b read
 * MN-major (its first 64 rows): dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K; acc is overwritten when
 * !accumulate; one commit group */
template <int D, int R>
__device__ __forceinline__ void bwd_product_packed(float (&acc)[D / 2], const uint32_t (&xa)[4][4], uint32_t b,
                                                   int accumulate)
{
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wgmma_rs_nd<D>(acc, xa[kk], desc_mnmajor<R>(b, kk), kk > 0 || accumulate);
    wgmma_commit();
}

/* bwd_product_packed of x, packed to bf16 here */
template <int D, int R>
__device__ __forceinline__ void bwd_product(float (&acc)[D / 2], const float (&x)[32], uint32_t b, int accumulate)
{
    uint32_t xa[4][4];
    pack_a64(xa, x);
    bwd_product_packed<D, R>(acc, xa, b, accumulate);
}

/* The thread's rows row0 and row0 + 8 (of S) of a 64×D accumulator times scale, as bf16 (or,
 * unscaled, as fp32: a part's sums) at base + row·stride (base: the tensor at the head's first
 * column, plus 2t) */
template <int D, typename OUT>
__device__ __forceinline__ void bwd_store_rows(OUT *base, size_t stride, const float (&acc)[D / 2], int row0,
                                               int S, float scale)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= S) continue;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            const float x = acc[4 * j + 2 * r], y = acc[4 * j + 2 * r + 1];
            if constexpr (std::is_same<OUT, float>::value)
                *reinterpret_cast<float2 *>(base + (size_t)row * stride + j * 8) = make_float2(x, y);
            else
                *reinterpret_cast<__nv_bfloat162 *>(base + (size_t)row * stride + j * 8) =
                    __floats2bfloat162_rn(x * scale, y * scale);
        }
    }
}

} /* namespace */

#endif
