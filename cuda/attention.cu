/* Causal GQA attention, flash style: no S×S matrix is ever stored.
 *
 * Tiles of 64 queries × 64 keys, 256 threads as a 16 × 16 grid; thread (ty, tx) owns tile rows
 * ty·4 .. ty·4+3 and tile columns tx + 16·j (j < 4) of a score tile, and output columns tx + 16·c
 * (c < D/16) of a row tile. Q/K/V/dO tiles sit in shared memory as fp32 rows padded to D+1 floats
 * (so a column walk hits 32 different banks); all arithmetic is fp32, inputs and outputs are the
 * compute dtype. Head dims other than 16/32/64/128 run in the next wider kernel with the extra
 * columns zero-filled (so any head_dim up to 128 works).
 *
 * forward   grid (B·Hq, query tiles): online softmax over key tiles 0..qt; writes out and
 *           lse = m + log(l) of the scaled scores.
 * backward  Di = rowsum(dO ⊙ O) (= Σ_j P·dP, the softmax-backward projection), then two kernels
 *           that each recompute P = exp(s·scale − lse):
 *           dq:   grid (B·Hq, query tiles),  dQ = scale · Σ_key-tiles dS·K
 *           dkdv: grid (B·Hkv, key tiles),   dV = Σ Pᵀ·dO, dK = scale · Σ dSᵀ·Q over the query tiles
 *                 at or after the key tile and over the Hq/Hkv query heads of the kv group.
 *           Every output element is summed by one thread in a fixed order: no atomics, and the
 *           result is deterministic. */
#include "attention.cuh"

enum { AT_TILE = 64, AT_THREADS = 256, AT_PLD = AT_TILE + 1 };

/* ---------------------------------------------------------------- tile helpers */

/* dst[r][d] (row stride D+1) = src row (b, row0 + r, head h) of a [B, S, H, hd] tensor; rows past
 * S and columns past the real head dim hd (<= D, the tile width) are zeros, so they add nothing to
 * any dot product. */
template <typename T, int D>
__device__ __forceinline__ void load_tile(float *dst, const T *src, int b, int row0, int S, int H,
                                          int h, int hd)
{
    for (int idx = threadIdx.x; idx < AT_TILE * D; idx += AT_THREADS) {
        const int r = idx / D, d = idx - r * D;
        const int row = row0 + r;
        dst[r * (D + 1) + d] =
            row < S && d < hd ? to_f(src[(((size_t)b * S + row) * H + h) * hd + d]) : 0.0f;
    }
}

/* acc[i][j] += Σ_d A[ty·4+i][d] · B[tx+16j][d]   (A, B: 64 rows of stride D+1) */
template <int D>
__device__ __forceinline__ void mm_abt(float acc[4][4], const float *A, const float *B, int ty, int tx)
{
    const float *a = A + ty * 4 * (D + 1), *b = B + tx * (D + 1);
#pragma unroll 8
    for (int d = 0; d < D; d++) {
        float av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) av[i] = a[i * (D + 1) + d];
#pragma unroll
        for (int j = 0; j < 4; j++) bv[j] = b[j * 16 * (D + 1) + d];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[i][j] += av[i] * bv[j];
    }
}

/* acc[i][c] += Σ_j P[ty·4+i][j] · V[j][tx+16c]   (P: 64 × 64, stride 65; V: 64 rows, stride D+1) */
template <int D>
__device__ __forceinline__ void mm_ab(float acc[4][D / 16], const float *P, const float *V, int ty,
                                      int tx)
{
    const float *p = P + ty * 4 * AT_PLD, *v = V + tx;
#pragma unroll 4
    for (int j = 0; j < AT_TILE; j++) {
        float pv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) pv[i] = p[i * AT_PLD + j];
#pragma unroll
        for (int c = 0; c < D / 16; c++) {
            const float vv = v[j * (D + 1) + 16 * c];
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i][c] += pv[i] * vv;
        }
    }
}

/* max / sum over the 16 threads (tx) that share a tile row: lanes 0-15 or 16-31 of a warp */
__device__ __forceinline__ float row16_max(float v)
{
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float row16_sum(float v)
{
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int D> constexpr size_t fwd_smem() { return (3 * AT_TILE * (D + 1) + AT_TILE * AT_PLD) * sizeof(float); }
template <int D> constexpr size_t dq_smem() { return (4 * AT_TILE * (D + 1) + AT_TILE * AT_PLD + 2 * AT_TILE) * sizeof(float); }
template <int D> constexpr size_t dkdv_smem() { return (4 * AT_TILE * (D + 1) + 2 * AT_TILE * AT_PLD + 2 * AT_TILE) * sizeof(float); }

/* Document masking (ops.h): key kj is visible to query qi of sequence b only inside qi's document.
 * seg == nullptr keeps plain causal attention; rows and keys past S are masked by the callers'
 * bounds tests, which come first. */
__device__ __forceinline__ bool same_doc(const int32_t *seg, int b, int S, int qi, int kj)
{
    return !seg || seg[(size_t)b * S + qi] == seg[(size_t)b * S + kj];
}

/* ---------------------------------------------------------------- forward */

template <typename T, int D>
__global__ void __launch_bounds__(AT_THREADS)
attn_fwd_kernel(T *out, float *lse, const T *q, const T *k, const T *v, int S, int Hq, int Hkv,
                int hd, float scale, const int32_t *seg)
{
    pdl_wait(); /* first: launch.cuh */
    constexpr int LD = D + 1, DC = D / 16;
    extern __shared__ float smem[];
    float *Qs = smem, *Ks = Qs + AT_TILE * LD, *Vs = Ks + AT_TILE * LD, *Ps = Vs + AT_TILE * LD;
    const int bh = blockIdx.x, qt = blockIdx.y;
    const int b = bh / Hq, h = bh - b * Hq, hk = h / (Hq / Hkv);
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int q0 = qt * AT_TILE;

    load_tile<T, D>(Qs, q, b, q0, S, Hq, h, hd);
    float m[4], l[4], o[4][DC];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < DC; c++) o[i][c] = 0.0f;
    }

    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * AT_TILE;
        __syncthreads(); /* the previous tile's readers of Ks, Vs, Ps are done */
        load_tile<T, D>(Ks, k, b, k0, S, Hkv, hk, hd);
        load_tile<T, D>(Vs, v, b, k0, S, Hkv, hk, hd);
        __syncthreads();

        float s[4][4] = {};
        mm_abt<D>(s, Qs, Ks, ty, tx);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int qi = q0 + ty * 4 + i;
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int kj = k0 + tx + 16 * j;
                s[i][j] = (kj <= qi && kj < S && qi < S && same_doc(seg, b, S, qi, kj))
                              ? s[i][j] * scale : -INFINITY;
                mx = fmaxf(mx, s[i][j]);
            }
            mx = row16_max(mx);
            const float mnew = fmaxf(m[i], mx);
            /* a row may have no visible key in this tile (padding rows, or document masking);
             * its diagonal tile always has one */
            const float base = mnew == -INFINITY ? 0.0f : mnew;
            const float alpha = expf(m[i] - base);
            float rs = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float p = expf(s[i][j] - base);
                Ps[(ty * 4 + i) * AT_PLD + tx + 16 * j] = p;
                rs += p;
            }
            rs = row16_sum(rs);
            l[i] = l[i] * alpha + rs;
            m[i] = mnew;
#pragma unroll
            for (int c = 0; c < DC; c++) o[i][c] *= alpha;
        }
        __syncthreads();
        mm_ab<D>(o, Ps, Vs, ty, tx);
    }

#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int qi = q0 + ty * 4 + i;
        if (qi >= S) continue;
        const float inv = 1.0f / l[i];
        T *dst = out + (((size_t)b * S + qi) * Hq + h) * hd;
#pragma unroll
        for (int c = 0; c < DC; c++)
            if (tx + 16 * c < hd) dst[tx + 16 * c] = from_f<T>(o[i][c] * inv);
        if (tx == 0) lse[((size_t)b * Hq + h) * S + qi] = m[i] + logf(l[i]);
    }
}

/* ---------------------------------------------------------------- backward */

/* Di[b, h, i] = Σ_d dO[b, i, h, d] · O[b, i, h, d]; one warp per (b, i, h) row */
template <typename T>
__global__ void attn_bwd_di_kernel(float *Di, const T *dout, const T *out, int B, int S, int Hq, int D)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (size_t)B * S * Hq) return;
    const T *a = dout + row * D, *o = out + row * D;
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s += to_f(a[d]) * to_f(o[d]);
    s = warp_sum(s);
    if (lane == 0) {
        const int h = (int)(row % Hq);
        const size_t bi = row / Hq;
        const int i = (int)(bi % S), b = (int)(bi / S);
        Di[((size_t)b * Hq + h) * S + i] = s;
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(AT_THREADS)
attn_bwd_dq_kernel(T *dq, const T *dout, const T *q, const T *k, const T *v, const float *lse,
                   const float *Di, int S, int Hq, int Hkv, int hd, float scale, const int32_t *seg)
{
    pdl_wait(); /* first: launch.cuh */
    constexpr int LD = D + 1, DC = D / 16;
    extern __shared__ float smem[];
    float *Qs = smem, *dOs = Qs + AT_TILE * LD, *Ks = dOs + AT_TILE * LD, *Vs = Ks + AT_TILE * LD;
    float *dSs = Vs + AT_TILE * LD, *lse_s = dSs + AT_TILE * AT_PLD, *di_s = lse_s + AT_TILE;
    const int bh = blockIdx.x, qt = blockIdx.y;
    const int b = bh / Hq, h = bh - b * Hq, hk = h / (Hq / Hkv);
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int q0 = qt * AT_TILE;

    load_tile<T, D>(Qs, q, b, q0, S, Hq, h, hd);
    load_tile<T, D>(dOs, dout, b, q0, S, Hq, h, hd);
    if (threadIdx.x < AT_TILE) {
        const int qi = q0 + threadIdx.x;
        const size_t at = ((size_t)b * Hq + h) * S + qi;
        lse_s[threadIdx.x] = qi < S ? lse[at] : 0.0f;
        di_s[threadIdx.x] = qi < S ? Di[at] : 0.0f;
    }
    float acc[4][DC];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int c = 0; c < DC; c++) acc[i][c] = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * AT_TILE;
        __syncthreads();
        load_tile<T, D>(Ks, k, b, k0, S, Hkv, hk, hd);
        load_tile<T, D>(Vs, v, b, k0, S, Hkv, hk, hd);
        __syncthreads();
        float s[4][4] = {}, dp[4][4] = {};
        mm_abt<D>(s, Qs, Ks, ty, tx);
        mm_abt<D>(dp, dOs, Vs, ty, tx);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = ty * 4 + i, qi = q0 + r;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int kj = k0 + tx + 16 * j;
                const bool vis = kj <= qi && kj < S && qi < S && same_doc(seg, b, S, qi, kj);
                const float p = vis ? expf(s[i][j] * scale - lse_s[r]) : 0.0f;
                dSs[r * AT_PLD + tx + 16 * j] = p * (dp[i][j] - di_s[r]);
            }
        }
        __syncthreads();
        mm_ab<D>(acc, dSs, Ks, ty, tx);
    }

#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int qi = q0 + ty * 4 + i;
        if (qi >= S) continue;
        T *dst = dq + (((size_t)b * S + qi) * Hq + h) * hd;
#pragma unroll
        for (int c = 0; c < DC; c++)
            if (tx + 16 * c < hd) dst[tx + 16 * c] = from_f<T>(acc[i][c] * scale);
    }
}

/* Transposed roles: tile rows are keys (ty·4+i), tile columns are queries (tx+16j). */
template <typename T, int D>
__global__ void __launch_bounds__(AT_THREADS)
attn_bwd_dkdv_kernel(T *dk, T *dv, const T *dout, const T *q, const T *k, const T *v,
                     const float *lse, const float *Di, int S, int Hq, int Hkv, int hd,
                     float scale, const int32_t *seg)
{
    pdl_wait(); /* first: launch.cuh */
    constexpr int LD = D + 1, DC = D / 16;
    extern __shared__ float smem[];
    float *Ks = smem, *Vs = Ks + AT_TILE * LD, *Qs = Vs + AT_TILE * LD, *dOs = Qs + AT_TILE * LD;
    float *Ps = dOs + AT_TILE * LD, *dSs = Ps + AT_TILE * AT_PLD, *lse_s = dSs + AT_TILE * AT_PLD;
    float *di_s = lse_s + AT_TILE;
    const int bhk = blockIdx.x, kt = blockIdx.y;
    const int b = bhk / Hkv, hk = bhk - b * Hkv, group = Hq / Hkv;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int k0 = kt * AT_TILE, nqt = (S + AT_TILE - 1) / AT_TILE;

    load_tile<T, D>(Ks, k, b, k0, S, Hkv, hk, hd);
    load_tile<T, D>(Vs, v, b, k0, S, Hkv, hk, hd);
    float dka[4][DC], dva[4][DC];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int c = 0; c < DC; c++) dka[i][c] = dva[i][c] = 0.0f;

    for (int g = 0; g < group; g++) {
        const int h = hk * group + g;
        for (int qt = kt; qt < nqt; qt++) {
            const int q0 = qt * AT_TILE;
            __syncthreads(); /* the previous tile's readers of Qs, dOs, Ps, dSs are done */
            load_tile<T, D>(Qs, q, b, q0, S, Hq, h, hd);
            load_tile<T, D>(dOs, dout, b, q0, S, Hq, h, hd);
            if (threadIdx.x < AT_TILE) {
                const int qi = q0 + threadIdx.x;
                const size_t at = ((size_t)b * Hq + h) * S + qi;
                lse_s[threadIdx.x] = qi < S ? lse[at] : 0.0f;
                di_s[threadIdx.x] = qi < S ? Di[at] : 0.0f;
            }
            __syncthreads();
            float st[4][4] = {}, dpt[4][4] = {};
            mm_abt<D>(st, Ks, Qs, ty, tx);  /* sᵀ[key][query] */
            mm_abt<D>(dpt, Vs, dOs, ty, tx); /* dPᵀ[key][query] = V·dOᵀ */
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = ty * 4 + i, kj = k0 + r;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int c = tx + 16 * j, qi = q0 + c;
                    const bool vis = kj <= qi && qi < S && kj < S && same_doc(seg, b, S, qi, kj);
                    const float p = vis ? expf(st[i][j] * scale - lse_s[c]) : 0.0f;
                    Ps[r * AT_PLD + c] = p;
                    dSs[r * AT_PLD + c] = p * (dpt[i][j] - di_s[c]);
                }
            }
            __syncthreads();
            mm_ab<D>(dva, Ps, dOs, ty, tx);
            mm_ab<D>(dka, dSs, Qs, ty, tx);
        }
    }

#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int kj = k0 + ty * 4 + i;
        if (kj >= S) continue;
        const size_t base = (((size_t)b * S + kj) * Hkv + hk) * hd;
#pragma unroll
        for (int c = 0; c < DC; c++) {
            if (tx + 16 * c >= hd) continue;
            dk[base + tx + 16 * c] = from_f<T>(dka[i][c] * scale);
            dv[base + tx + 16 * c] = from_f<T>(dva[i][c]);
        }
    }
}

/* ---------------------------------------------------------------- launchers */

/* Raises a kernel's dynamic shared-memory limit once (above 48 KB it must be asked for). */
template <typename K> static void smem_opt_in(K kernel, size_t bytes, bool *done)
{
    if (*done) return;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    *done = true;
}

static void check_shape(const char *what, int B, int S, int Hq, int Hkv, int D)
{
    MT_CHECK(B >= 0 && S >= 0 && Hq > 0 && Hkv > 0 && Hq % Hkv == 0,
             "%s: bad shape B=%d S=%d Hq=%d Hkv=%d (Hq must be a multiple of Hkv)", what, B, S, Hq,
             Hkv);
    MT_CHECK(D > 0 && D <= 128, "%s: head_dim %d is not supported by the CUDA kernels (1 to 128)",
             what, D);
    MT_CHECK((S + AT_TILE - 1) / AT_TILE <= 65535, "%s: sequence length %d is too long", what, S);
}

static float attn_scale(int D) { return (float)(1.0 / sqrt((double)D)); } /* as the CPU backend */

template <typename T, int D>
static void fwd_launch(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                       int S, int Hq, int Hkv, int hd, const int32_t *seg)
{
    static bool opted;
    smem_opt_in(attn_fwd_kernel<T, D>, fwd_smem<D>(), &opted);
    dim3 grid(B * Hq, (S + AT_TILE - 1) / AT_TILE);
    cuda_launch(attn_fwd_kernel<T, D>, grid, AT_THREADS, fwd_smem<D>(),
        (T *)out, lse, (const T *)q, (const T *)k, (const T *)v, S, Hq, Hkv, hd, attn_scale(hd), seg);
    CUDA_LAUNCH_CHECK("attention forward");
}

template <typename T, int D>
static void bwd_launch(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                       const void *v, const void *out, const float *lse, int B, int S, int Hq,
                       int Hkv, int hd, const int32_t *seg)
{
    static bool opted_dq, opted_dkdv;
    smem_opt_in(attn_bwd_dq_kernel<T, D>, dq_smem<D>(), &opted_dq);
    smem_opt_in(attn_bwd_dkdv_kernel<T, D>, dkdv_smem<D>(), &opted_dkdv);
    const size_t rows = (size_t)B * S * Hq;
    float *Di = (float *)cuda_scratch(SCRATCH_ATTN, rows * sizeof(float));
    cuda_launch(attn_bwd_di_kernel<T>, (unsigned)((rows + 7) / 8), 256, 0,
        Di, (const T *)dout, (const T *)out, B, S, Hq, hd);
    CUDA_LAUNCH_CHECK("attention backward Di");
    const int ntiles = (S + AT_TILE - 1) / AT_TILE;
    const float scale = attn_scale(hd);
    cuda_launch(attn_bwd_dq_kernel<T, D>, dim3(B * Hq, ntiles), AT_THREADS, dq_smem<D>(),
        (T *)dq, (const T *)dout, (const T *)q, (const T *)k, (const T *)v, lse, Di, S, Hq, Hkv, hd,
        scale, seg);
    CUDA_LAUNCH_CHECK("attention backward dq");
    cuda_launch(attn_bwd_dkdv_kernel<T, D>, dim3(B * Hkv, ntiles), AT_THREADS, dkdv_smem<D>(),
        (T *)dk, (T *)dv, (const T *)dout, (const T *)q, (const T *)k, (const T *)v, lse, Di, S, Hq,
        Hkv, hd, scale, seg);
    CUDA_LAUNCH_CHECK("attention backward dk dv");
}

template <typename T>
void cu_attention_forward(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                          int S, int Hq, int Hkv, int D, const int32_t *seg)
{
    check_shape("attention", B, S, Hq, Hkv, D);
    if (B == 0 || S == 0) return;
    if (D <= 16) fwd_launch<T, 16>(out, lse, q, k, v, B, S, Hq, Hkv, D, seg);
    else if (D <= 32) fwd_launch<T, 32>(out, lse, q, k, v, B, S, Hq, Hkv, D, seg);
    else if (D <= 64) fwd_launch<T, 64>(out, lse, q, k, v, B, S, Hq, Hkv, D, seg);
    else fwd_launch<T, 128>(out, lse, q, k, v, B, S, Hq, Hkv, D, seg);
}

template <typename T>
void cu_attention_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                           const void *k, const void *v, const void *out, const float *lse, int B,
                           int S, int Hq, int Hkv, int D, const int32_t *seg)
{
    check_shape("attention backward", B, S, Hq, Hkv, D);
    if (B == 0 || S == 0) return;
    if (D <= 16) bwd_launch<T, 16>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, seg);
    else if (D <= 32) bwd_launch<T, 32>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, seg);
    else if (D <= 64) bwd_launch<T, 64>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, seg);
    else bwd_launch<T, 128>(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, seg);
}

template void cu_attention_forward<float>(void *, float *, const void *, const void *, const void *,
                                          int, int, int, int, int, const int32_t *);
template void cu_attention_forward<bf16>(void *, float *, const void *, const void *, const void *,
                                         int, int, int, int, int, const int32_t *);
template void cu_attention_backward<float>(void *, void *, void *, const void *, const void *,
                                           const void *, const void *, const void *, const float *,
                                           int, int, int, int, int, const int32_t *);
template void cu_attention_backward<bf16>(void *, void *, void *, const void *, const void *,
                                          const void *, const void *, const void *, const float *,
                                          int, int, int, int, int, const int32_t *);
