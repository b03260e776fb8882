/* AdamW, elementwise, in the order of src/cpu/cpu_adamw.c (decoupled decay first, then the Adam
 * step); the bias corrections are formed on the host in double and rounded once, as there.
 * adamw_update / adamw_update_m16 launch one scalar grid-stride kernel per tensor.
 * adamw_update_multi runs every segment of an optimizer step in one launch: each block takes one
 * chunk of one segment (a per-block segment index, built on the host and kept on the device while
 * the segment list stays the same), moves 8-element packs with 16-byte accesses, and does the
 * few elements before a segment's first 16-byte boundary and after its last whole pack one by
 * one. Every path runs the same adamw_math, every operation rounded as written, so the bits
 * match whichever kernel updated a segment. */
#include "adamw.cuh"

#include "master_split.h"

#include <string.h>
#include <vector>

/* Multi kernel: each thread has one pack's 16-byte loads in flight (8 with fp32 moments, 6 with
 * bf16), 128 or 80 bytes. At 58 registers (fp32 moments; 49 bf16) 4 blocks of 256 fit an SM:
 * ~128 KB in flight per SM, several times what hides the H100's memory latency. AD_UNROLL = 2
 * doubles the bytes per thread but needs 100 registers (2 blocks per SM): the same bytes in
 * flight with half the warps to hide the per-block segment lookup and the divisions. */
enum {
    AD_BLOCK = 256,
    AD_UNROLL = 1,                        /* packs per thread per block */
    AD_PACKS = AD_UNROLL * AD_BLOCK,      /* packs per block (multi kernel) */
    AD_CHUNK = 8 * AD_PACKS,              /* elements per block: 2048 */
};

struct adam_k {   /* one step's constants */
    float lr, beta1, beta2, eps, bc1, bc2, grad_scale;
};

/* 1 - lr * weight_decay, on the device in every kernel so they agree whatever the host compiler
 * would contract */
__device__ __forceinline__ float decay_of(const adam_k &k, float wd)
{
    return __fsub_rn(1.0f, __fmul_rn(k.lr, wd));
}

/* One element: m, v updated in fp32 (before any rounding to bf16 moments); returns the new
 * master. No fused multiply-adds (each op rounded as written), so every kernel gives the same
 * bits. */
__device__ __forceinline__ float adamw_math(const adam_k &k, float decay, float grad, float &m,
                                            float &v, float master)
{
    const float g = __fmul_rn(grad, k.grad_scale);
    m = __fadd_rn(__fmul_rn(k.beta1, m), __fmul_rn(1.0f - k.beta1, g));
    v = __fadd_rn(__fmul_rn(k.beta2, v), __fmul_rn(__fmul_rn(1.0f - k.beta2, g), g));
    const float mhat = __fdiv_rn(m, k.bc1), vhat = __fdiv_rn(v, k.bc2);
    const float p = __fmul_rn(master, decay);
    return __fsub_rn(p, __fmul_rn(k.lr, __fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), k.eps))));
}

/* element i; moments M (float, or bf16 rounded to nearest even as the CPU does); param may be
 * master itself in fp32, NULL: no compute copy */
template <typename T, typename M>
__device__ __forceinline__ void adamw_elem(const adam_k &k, float decay, float *master, T *param,
                                           const float *grad, M *m, M *v, long long i)
{
    float mi = to_f(m[i]), vi = to_f(v[i]);
    const float p = adamw_math(k, decay, grad[i], mi, vi, master[i]);
    m[i] = from_f<M>(mi);
    v[i] = from_f<M>(vi);
    master[i] = p;
    if (param) param[i] = from_f<T>(p);
}

/* element i of a segment whose master is held split (ops.h adamw_segment.master_lo): hi is its
 * bf16 compute copy */
template <typename M>
__device__ __forceinline__ void adamw_elem_split(const adam_k &k, float decay, uint16_t *hi, uint16_t *lo,
                                                 const float *grad, M *m, M *v, long long i)
{
    float mi = to_f(m[i]), vi = to_f(v[i]);
    const float p = adamw_math(k, decay, grad[i], mi, vi, __uint_as_float(mt_master_bits(hi[i], lo[i])));
    m[i] = from_f<M>(mi);
    v[i] = from_f<M>(vi);
    const uint32_t u = __float_as_uint(p);
    hi[i] = mt_master_hi_bits(u);
    lo[i] = mt_master_lo_bits(u, hi[i]);
}

template <typename T, typename M>
__global__ void adamw_kernel(adam_k k, float wd, float *master, T *param, const float *grad, M *m,
                             M *v, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    const float decay = decay_of(k, wd);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        adamw_elem<T, M>(k, decay, master, param, grad, m, v, (long long)i);
}

/* A segment as the multi kernel sees it (no padding: the host compares tables bytewise). Elements
 * [0, head) and [head + 8 packs, n) are scalar, the packs between start 16-byte aligned in every
 * array; scalar != 0 (arrays that never align together) makes the whole segment scalar, chunked
 * like the packs. */
struct adamw_seg_dev {
    float *master;    /* NULL where the master is held split */
    void *param;      /* NULL: no compute copy (or it is the master itself); split: the high half */
    uint16_t *lo;     /* the split master's low half, or NULL */
    const float *grad;
    void *m, *v;
    long long n, head, packs;
    int block0, blocks; /* this segment's blocks of the grid */
    float wd;
    int scalar;
};

/* SPLIT: every segment's master is held split (T is bf16, param its high half); a kernel of its
 * own, so that the fp32-master kernel's registers stay as they were */
template <typename T, typename M, bool SPLIT>
__global__ void __launch_bounds__(AD_BLOCK)
    adamw_multi_kernel(const adamw_seg_dev *__restrict__ segs, const int *__restrict__ block_seg,
                       adam_k k)
{
    pdl_wait(); /* first: launch.cuh */
    const adamw_seg_dev s = segs[block_seg[blockIdx.x]];
    const long long c = (long long)blockIdx.x - s.block0; /* chunk of the segment */
    M *m = (M *)s.m, *v = (M *)s.v;
    const float decay = decay_of(k, s.wd);
    if constexpr (SPLIT) {
        static_assert(AD_UNROLL == 1, "the split path takes one pack a thread");
        uint16_t *hi = (uint16_t *)s.param, *lo = s.lo;
        if (s.scalar) {
            const long long end = (c + 1) * AD_CHUNK < s.n ? (c + 1) * AD_CHUNK : s.n;
            for (long long i = c * AD_CHUNK + threadIdx.x; i < end; i += AD_BLOCK)
                adamw_elem_split<M>(k, decay, hi, lo, s.grad, m, v, i);
            return;
        }
        const long long tail0 = s.head + 8 * s.packs;
        if (c == 0 && threadIdx.x < s.head) adamw_elem_split<M>(k, decay, hi, lo, s.grad, m, v, threadIdx.x);
        if (c == s.blocks - 1 && threadIdx.x < s.n - tail0)
            adamw_elem_split<M>(k, decay, hi, lo, s.grad, m, v, tail0 + threadIdx.x);
        const long long pk = c * AD_PACKS + threadIdx.x;
        if (pk >= s.packs) return;
        const long long at = s.head + 8 * pk;
        const pack8<float> g = ld8(s.grad + at);
        const uint4 hv = *reinterpret_cast<const uint4 *>(hi + at), lv = *reinterpret_cast<const uint4 *>(lo + at);
        const pack8<M> mp = ld8(m + at), vp = ld8(v + at);
        float gf[8], wf[8], mf[8], vf[8];
        unpack8(g, gf), unpack8(mp, mf), unpack8(vp, vf);
        const uint32_t hw[4] = {hv.x, hv.y, hv.z, hv.w}, lw[4] = {lv.x, lv.y, lv.z, lv.w};
        uint32_t ho[4], lo_out[4];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const uint16_t h = (uint16_t)(hw[e / 2] >> (16 * (e & 1))), l = (uint16_t)(lw[e / 2] >> (16 * (e & 1)));
            wf[e] = adamw_math(k, decay, gf[e], mf[e], vf[e], __uint_as_float(mt_master_bits(h, l)));
        }
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            const uint32_t u0 = __float_as_uint(wf[e]), u1 = __float_as_uint(wf[e + 1]);
            const uint16_t h0 = mt_master_hi_bits(u0), h1 = mt_master_hi_bits(u1);
            ho[e / 2] = (uint32_t)h0 | (uint32_t)h1 << 16;
            lo_out[e / 2] = (uint32_t)mt_master_lo_bits(u0, h0) | (uint32_t)mt_master_lo_bits(u1, h1) << 16;
        }
        st8(m + at, pack8_of<M>(mf));
        st8(v + at, pack8_of<M>(vf));
        *reinterpret_cast<uint4 *>(hi + at) = make_uint4(ho[0], ho[1], ho[2], ho[3]);
        *reinterpret_cast<uint4 *>(lo + at) = make_uint4(lo_out[0], lo_out[1], lo_out[2], lo_out[3]);
        return;
    }
    float *master = s.master;
    T *param = (T *)s.param;
    if (s.scalar) {
        const long long end = (c + 1) * AD_CHUNK < s.n ? (c + 1) * AD_CHUNK : s.n;
        for (long long i = c * AD_CHUNK + threadIdx.x; i < end; i += AD_BLOCK)
            adamw_elem<T, M>(k, decay, master, param, s.grad, m, v, i);
        return;
    }
    const long long tail0 = s.head + 8 * s.packs;
    if (c == 0 && threadIdx.x < s.head)
        adamw_elem<T, M>(k, decay, master, param, s.grad, m, v, threadIdx.x);
    if (c == s.blocks - 1 && threadIdx.x < s.n - tail0)
        adamw_elem<T, M>(k, decay, master, param, s.grad, m, v, tail0 + threadIdx.x);

    /* every load of the thread's packs before any maths */
    pack8<float> g[AD_UNROLL], w[AD_UNROLL];
    pack8<M> mp[AD_UNROLL], vp[AD_UNROLL];
    long long at[AD_UNROLL];
#pragma unroll
    for (int u = 0; u < AD_UNROLL; u++) {
        const long long pk = c * AD_PACKS + u * AD_BLOCK + threadIdx.x;
        at[u] = pk < s.packs ? s.head + 8 * pk : -1;
        if (at[u] < 0) continue;
        g[u] = ld8(s.grad + at[u]);
        w[u] = ld8(master + at[u]);
        mp[u] = ld8(m + at[u]);
        vp[u] = ld8(v + at[u]);
    }
#pragma unroll
    for (int u = 0; u < AD_UNROLL; u++) {
        if (at[u] < 0) continue;
        float gf[8], wf[8], mf[8], vf[8];
        unpack8(g[u], gf), unpack8(w[u], wf), unpack8(mp[u], mf), unpack8(vp[u], vf);
#pragma unroll
        for (int e = 0; e < 8; e++) wf[e] = adamw_math(k, decay, gf[e], mf[e], vf[e], wf[e]);
        st8(m + at[u], pack8_of<M>(mf));
        st8(v + at[u], pack8_of<M>(vf));
        st8(master + at[u], pack8_of<float>(wf));
        if (param) st8(param + at[u], pack8_of<T>(wf));
    }
}

static adam_k step_constants(float lr, float beta1, float beta2, float eps, int t, float grad_scale)
{
    MT_CHECK(t >= 1, "adamw: step %d must be >= 1 (bias correction divides by 1 - beta^t)", t);
    return adam_k{lr, beta1, beta2, eps, (float)(1.0 - pow((double)beta1, t)),
                  (float)(1.0 - pow((double)beta2, t)), grad_scale};
}

template <typename T>
void cu_adamw_update(float *master, void *param, const float *grad, float *m, float *v, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                     float grad_scale)
{
    const adam_k k = step_constants(lr, beta1, beta2, eps, t, grad_scale);
    if (n == 0) return;
    cuda_launch(adamw_kernel<T, float>, cuda_grid(n, AD_BLOCK), AD_BLOCK, 0,
        k, weight_decay, master, (T *)param, grad, m, v, n);
    CUDA_LAUNCH_CHECK("adamw");
}

template <typename T>
void cu_adamw_update_m16(float *master, void *param, const float *grad, void *m, void *v, size_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                         float grad_scale)
{
    const adam_k k = step_constants(lr, beta1, beta2, eps, t, grad_scale);
    if (n == 0) return;
    cuda_launch(adamw_kernel<T, bf16>, cuda_grid(n, AD_BLOCK), AD_BLOCK, 0,
        k, weight_decay, master, (T *)param, grad, (bf16 *)m, (bf16 *)v, n);
    CUDA_LAUNCH_CHECK("adamw_m16");
}

/* first element at which every array of the segment is 16-byte aligned, or -1 */
static long long common_head(const adamw_seg_dev &e, size_t x_size, size_t mom_bytes)
{
    for (long long h = 0; h < 8; h++) {
        const bool ok = (e.lo ? aligned16(e.lo + h) : aligned16(e.master + h)) && aligned16(e.grad + h) &&
                        aligned16((const char *)e.m + h * mom_bytes) &&
                        aligned16((const char *)e.v + h * mom_bytes) &&
                        (!e.param || aligned16((const char *)e.param + h * x_size));
        if (ok) return h;
    }
    return -1;
}

/* The device copy of the last segment table and its per-block segment index, one buffer (the
 * index is 4 bytes per 2048 parameters: 8 MB for a 4B-parameter shard): the train loop passes
 * the same segments every step, so after the first step a call builds the small table on the
 * host, finds it unchanged, and only launches. */
struct multi_plan {
    std::vector<adamw_seg_dev> table;
    std::vector<char> staged; /* table, then block_seg [blocks] */
    size_t mom_bytes = 0;
    long long blocks = 0;
    void *dev = NULL;
};

template <typename T>
void cu_adamw_update_multi(const struct adamw_segment *segs, int n_seg, size_t mom_bytes, float lr,
                           float beta1, float beta2, float eps, int t, float grad_scale)
{
    const adam_k k = step_constants(lr, beta1, beta2, eps, t, grad_scale);
    MT_CHECK(n_seg >= 0 && (n_seg == 0 || segs), "adamw_multi: bad segment list (%d)", n_seg);
    MT_CHECK(mom_bytes == 4 || mom_bytes == 2, "adamw_multi: moments of %zu bytes", mom_bytes);
    static multi_plan plan;
    std::vector<adamw_seg_dev> table;
    table.reserve((size_t)n_seg);
    long long blocks = 0;
    for (int i = 0; i < n_seg; i++) {
        const struct adamw_segment &s = segs[i];
        if (s.n == 0) continue;
        adamw_seg_dev e;
        memset(&e, 0, sizeof e);
        e.master = s.master;
        e.param = s.param == (void *)s.master ? NULL : s.param; /* fp32 copy = master: written once */
        e.lo = s.master_lo;
        MT_CHECK(!e.lo == !segs[0].master_lo && (!e.lo || (sizeof(T) == 2 && e.param && !e.master)),
                 "adamw_multi: segment %d: split masters in all segments or none, each with a bf16 high half", i);
        e.grad = s.grad;
        e.m = s.m, e.v = s.v;
        e.n = (long long)s.n;
        e.wd = s.weight_decay;
        const long long h = common_head(e, sizeof(T), mom_bytes);
        e.scalar = h < 0;
        e.head = h < 0 ? 0 : (h < e.n ? h : e.n);
        e.packs = h < 0 ? 0 : (e.n - e.head) / 8;
        const long long body = e.scalar ? (e.n + AD_CHUNK - 1) / AD_CHUNK
                                        : (e.packs + AD_PACKS - 1) / AD_PACKS;
        e.blocks = (int)(body > 0 ? body : 1);
        e.block0 = (int)blocks;
        blocks += e.blocks;
        MT_CHECK(blocks <= INT32_MAX, "adamw_multi: %lld blocks exceed the grid", blocks);
        table.push_back(e);
    }
    if (table.empty()) return;
    const size_t table_bytes = table.size() * sizeof(adamw_seg_dev);
    const size_t bytes = table_bytes + (size_t)blocks * sizeof(int);
    void *dev = cuda_scratch(SCRATCH_ADAMW, bytes);
    const bool same = dev == plan.dev && mom_bytes == plan.mom_bytes &&
                      table.size() == plan.table.size() &&
                      !memcmp(table.data(), plan.table.data(), table_bytes);
    if (!same) {
        plan.table = table;
        plan.mom_bytes = mom_bytes;
        plan.blocks = blocks;
        plan.dev = dev;
        plan.staged.resize(bytes);
        memcpy(plan.staged.data(), table.data(), table_bytes);
        int *block_seg = (int *)(plan.staged.data() + table_bytes);
        for (size_t i = 0; i < table.size(); i++)
            for (int b = 0; b < table[i].blocks; b++) block_seg[table[i].block0 + b] = (int)i;
        /* pageable source: staged before the call returns, so plan.staged may change after */
        CUDA_CHECK(cudaMemcpyAsync(dev, plan.staged.data(), bytes, cudaMemcpyHostToDevice,
                                   g_cuda.stream));
    }
    const adamw_seg_dev *d_table = (const adamw_seg_dev *)dev;
    const int *d_block_seg = (const int *)((const char *)dev + table_bytes);
    const bool split = table[0].lo != NULL;
    if (split && mom_bytes == 2)
        cuda_launch(adamw_multi_kernel<T, bf16, true>, (unsigned)blocks, AD_BLOCK, 0, d_table, d_block_seg, k);
    else if (split)
        cuda_launch(adamw_multi_kernel<T, float, true>, (unsigned)blocks, AD_BLOCK, 0, d_table, d_block_seg, k);
    else if (mom_bytes == 2)
        cuda_launch(adamw_multi_kernel<T, bf16, false>, (unsigned)blocks, AD_BLOCK, 0, d_table, d_block_seg, k);
    else
        cuda_launch(adamw_multi_kernel<T, float, false>, (unsigned)blocks, AD_BLOCK, 0, d_table, d_block_seg, k);
    CUDA_LAUNCH_CHECK("adamw multi");
}

#define ADAMW_INSTANTIATE(T)                                                                        \
    template void cu_adamw_update<T>(float *, void *, const float *, float *, float *, size_t,     \
                                     float, float, float, float, float, int, float);                \
    template void cu_adamw_update_m16<T>(float *, void *, const float *, void *, void *, size_t,   \
                                         float, float, float, float, float, int, float);            \
    template void cu_adamw_update_multi<T>(const struct adamw_segment *, int, size_t, float, float, \
                                           float, float, int, float);
ADAMW_INSTANTIATE(float)
ADAMW_INSTANTIATE(bf16)
