/* Cross-entropy, one block per row. The forward reads the row once: each thread keeps an online
 * (max, Σ exp(z − max)) pair in fp32 over 8-element chunks (16-byte accesses, cuda_common.cuh), the
 * block merges the pairs, and the row's lse = max + log Σ is stored for the backward, which is then
 * a single read-and-write pass dz = scale·(exp(z − lse) − onehot). The logits are 2.5 GB per micro-
 * step at the bench shape, so the loss is bandwidth work: one read forward, one read and one write
 * backward.
 *
 * fp32 partial sums of a few hundred exponentials each, merged in a tree, stay within a few ulp
 * of src/cpu/cpu_loss.c's double sum (relative 1e-7 at V = 151,936). A target outside [0, V) that
 * is not the ignore index (the CPU backend aborts on it) gives a NaN loss and NaN gradients: loud,
 * not silent. dlogits may alias logits: each element is read before it is written, by the same
 * thread. */
#include "loss.cuh"


#include "tma.cuh"
#include "wgmma.cuh" /* smem_u32, fence_proxy_async, MT_NO_HOPPER_CODE */

enum { CE_BLOCK = 256 };

/* (m, s) ⊕ (m2, s2): the pair of the union, rescaled to the larger max */
__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2)
{
    const float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return; /* both empty */
    s = s * exp_ftz(m - mn) + s2 * exp_ftz(m2 - mn);
    m = mn;
}

/* eight more values into a running (max, Σ exp(z − max)) pair */
__device__ __forceinline__ void lse_fold8(float &m, float &s, const float (&f)[8])
{
    float vm = f[0];
#pragma unroll
    for (int j = 1; j < 8; j++) vm = fmaxf(vm, f[j]);
    if (vm > m) { s *= exp_ftz(m - vm); m = vm; }
#pragma unroll
    for (int j = 0; j < 8; j++) s += exp_ftz(f[j] - m);
}

/* the gradient of eight logits from element e0 on: sc·(exp(z − l) − onehot). The target is looked
 * for once per chunk, not per element (an element's e − 0 is e: the same bits). */
__device__ __forceinline__ void ce_grad8(float (&f)[8], float sc, float l, int e0, int tgt)
{
#pragma unroll
    for (int j = 0; j < 8; j++) f[j] = exp_ftz(f[j] - l);
    if ((unsigned)(tgt - e0) < 8u) {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (e0 + j == tgt) f[j] -= 1.0f;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) f[j] = sc * f[j];
}

template <typename T>
__global__ void __launch_bounds__(CE_BLOCK)
ce_fwd_kernel(float *losses, float *lse, const T *logits, const int32_t *targets, int V, bool vec)
{
    pdl_wait(); /* first: launch.cuh */
    const int n = blockIdx.x;
    const int32_t tgt = targets[n];
    if (tgt == MT_IGNORE_INDEX) { /* uniform across the block: before any barrier */
        if (threadIdx.x == 0) { losses[n] = 0.0f; lse[n] = 0.0f; }
        return;
    }
    const T *z = logits + (size_t)n * V;
    float m = -INFINITY, s = 0.0f;
    if (vec) {
        for (int i = threadIdx.x; i < V / 8; i += CE_BLOCK) {
            float f[8];
            load8f(z + 8 * i, f);
            lse_fold8(m, s, f);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += CE_BLOCK) {
            const float x = to_f(z[i]);
            if (x > m) { s *= exp_ftz(m - x); m = x; }
            s += exp_ftz(x - m);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    __shared__ float shm[CE_BLOCK / 32], shs[CE_BLOCK / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { shm[warp] = m; shs[warp] = s; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < CE_BLOCK / 32; w++) lse_merge(m, s, shm[w], shs[w]);
        const float l = m + logf(s);
        lse[n] = l;
        losses[n] = (tgt >= 0 && tgt < V) ? l - to_f(z[tgt]) : NAN;
    }
}

template <typename T>
__global__ void __launch_bounds__(CE_BLOCK)
ce_bwd_kernel(T *dlogits, const T *logits, const float *lse, const int32_t *targets, int V,
              float scale, bool vec)
{
    pdl_wait(); /* first: launch.cuh */
    const int n = blockIdx.x;
    const int32_t tgt = targets[n];
    const bool ignore = tgt == MT_IGNORE_INDEX, ok = tgt >= 0 && tgt < V;
    /* ignored rows: exp(z − ∞) = 0, times scale 0; invalid targets: NaN */
    const float l = ignore ? INFINITY : lse[n], sc = ignore ? 0.0f : (ok ? scale : NAN);
    const T *z = logits + (size_t)n * V;
    T *dz = dlogits + (size_t)n * V;
    if (vec) {
        for (int i = threadIdx.x; i < V / 8; i += CE_BLOCK) {
            float f[8];
            load8f(z + 8 * i, f);
            ce_grad8(f, sc, l, 8 * i, tgt);
            store8f(dz + 8 * i, f);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += CE_BLOCK)
            dz[i] = from_f<T>(sc * (exp_ftz(to_f(z[i]) - l) - (i == tgt ? 1.0f : 0.0f)));
    }
}

/* whole 8-element chunks per row (cuda_common.cuh's load8f/store8f), from 16-byte-aligned rows */
static bool ce_vectorised(const void *p, int V) { return V % 8 == 0 && aligned16(p); }

template <typename T>
void cu_cross_entropy_forward(float *losses, float *lse, const void *logits, const int32_t *targets,
                              int N, int V)
{
    MT_CHECK(N >= 0 && V > 0, "cross_entropy: bad shape N=%d V=%d", N, V);
    if (N == 0) return;
    cuda_launch(ce_fwd_kernel<T>, N, CE_BLOCK, 0, losses, lse, (const T *)logits, targets, V,
        ce_vectorised(logits, V));
    CUDA_LAUNCH_CHECK("cross_entropy forward");
}

template <typename T>
void cu_cross_entropy_backward(void *dlogits, const void *logits, const float *lse,
                               const int32_t *targets, int N, int V, float scale)
{
    MT_CHECK(N >= 0 && V > 0, "cross_entropy backward: bad shape N=%d V=%d", N, V);
    if (N == 0) return;
    const bool vec = ce_vectorised(logits, V) && ce_vectorised(dlogits, V);
    cuda_launch(ce_bwd_kernel<T>, N, CE_BLOCK, 0, (T *)dlogits, (const T *)logits, lse,
        targets, V, scale, vec);
    CUDA_LAUNCH_CHECK("cross_entropy backward");
}

/* ---------------------------------------------------------------- forward and backward in one pass
 *
 * Hopper: a row is cut in CL equal slices, one CTA each, the CL CTAs one thread-block cluster. A
 * CTA copies its slice into shared memory in 16 KB chunks (bulk copies, one mbarrier each) and
 * folds each chunk into (max, Σ) as it lands, then reads the other slices' pairs from their shared
 * memory (DSMEM), merged in rank order so that every CTA gets the same lse; it writes the gradient
 * over its slice chunk by chunk and copies each chunk back over the logits under the next one's
 * arithmetic. The logits are read once and written once, 5 GB a micro-step at the bench shape
 * where the two kernels above move 7.5. Slices of at most CEF_SLICE bytes (Qwen3's 151,936: 4
 * CTAs of 76 KB a row in bf16), two CTAs an SM. bench_ops, H200: 1599 us a call against 1856 for
 * the two kernels; 256 threads beat 384 and 512 (1641, 1705), slices of 38 KB (8 a row, 5 CTAs an
 * SM) were slower (1841 us, 1738 with 128 threads), one 148 KB slice an SM slower still (1963). */
enum { CEF_THREADS = 256, CEF_CHUNK = 16384, CEF_MAX_CHUNKS = 7,
       CEF_SLICE = CEF_MAX_CHUNKS * CEF_CHUNK, CEF_MAX_CLUSTER = 8 };

/* (max, Σ) of the cluster's CTA `rank`, from its shared memory at our address `a` */
__device__ __forceinline__ float2 peer_pair(uint32_t a, uint32_t rank)
{
    uint32_t pa;
    float2 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(pa) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(pa) : "memory");
    return v;
}

template <typename T>
__global__ void __launch_bounds__(CEF_THREADS)
ce_fused_kernel(float *losses, float *lse, T *logits, const int32_t *targets, int V, int CL, int slice,
                float scale)
{
    pdl_wait(); /* first: launch.cuh */
#ifdef MT_NO_HOPPER_CODE
    __trap();
#else
    extern __shared__ __align__(128) unsigned char ce_smem[];
    T *zs = reinterpret_cast<T *>(ce_smem);
    __shared__ uint64_t full[CEF_MAX_CHUNKS]; /* chunk c of the slice has landed */
    __shared__ float2 pair; /* this slice's (max, Σ), read by the cluster */
    __shared__ float shm[CEF_THREADS / 32], shs[CEF_THREADS / 32];
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    constexpr int CE = CEF_CHUNK / sizeof(T); /* elements a chunk */
    const int n = blockIdx.x / CL, base = (int)rank * slice, n_chunks = (slice + CE - 1) / CE;
    const uint32_t zs_a = smem_u32(zs);
    T *z = logits + (size_t)n * V + base;
    const int32_t tgt = targets[n];
    const bool ignore = tgt == MT_IGNORE_INDEX, ok = tgt >= 0 && tgt < V, mine = ok && tgt / slice == (int)rank;
    if (threadIdx.x == 0) {
        for (int c = 0; c < n_chunks; c++) mbar_init(smem_u32(&full[c]), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int c = 0; c < n_chunks; c++) {
            const uint32_t len = (uint32_t)(min(CE, slice - c * CE) * sizeof(T)), bar = smem_u32(&full[c]);
            mbar_expect_tx(bar, len);
            bulk_load(zs_a + c * CEF_CHUNK, reinterpret_cast<const char *>(z + c * CE), len, bar);
        }
    }
    __syncthreads(); /* the barriers are initialised before anyone waits on them */

    /* (max, Σ) chunk by chunk as the chunks land */
    float m = -INFINITY, s = 0.0f;
    for (int c = 0; c < n_chunks; c++) {
        mbar_wait(smem_u32(&full[c]), 0);
        const int end = min(CE, slice - c * CE) / 8;
        for (int i = threadIdx.x; i < end; i += blockDim.x) {
            float f[8];
            load8f(zs + c * CE + 8 * i, f);
            lse_fold8(m, s, f);
        }
    }
    const float z_tgt = mine && threadIdx.x == 0 ? to_f(zs[tgt - base]) : 0.0f; /* before any write */
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { shm[warp] = m; shs[warp] = s; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)blockDim.x / 32; w++) lse_merge(m, s, shm[w], shs[w]);
        pair = make_float2(m, s);
    }
    /* every slice's pair is written; merged in rank order, the same bits in every CTA */
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    float lm = -INFINITY, ls = 0.0f;
    for (int r = 0; r < CL; r++) {
        const float2 v = peer_pair(smem_u32(&pair), (uint32_t)r);
        lse_merge(lm, ls, v.x, v.y);
    }
    /* our reads of the other CTAs' pairs are done: they may exit once they have waited for this */
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    const float l = lm + logf(ls);
    if (threadIdx.x == 0) {
        if (ignore) {
            if (rank == 0) losses[n] = 0.0f, lse[n] = 0.0f;
        } else if (!ok) {
            if (rank == 0) losses[n] = NAN, lse[n] = l;
        } else if (mine) {
            losses[n] = l - z_tgt, lse[n] = l;
        }
    }
    /* the backward's arithmetic (ce_bwd_kernel): ignored rows 0, invalid targets NaN; each chunk
     * is copied out as soon as its gradient is written, under the next chunk's */
    const float li = ignore ? INFINITY : l, sc = ignore ? 0.0f : (ok ? scale : NAN);
    for (int c = 0; c < n_chunks; c++) {
        const int len = min(CE, slice - c * CE), e0 = base + c * CE;
        for (int i = threadIdx.x; i < len / 8; i += blockDim.x) {
            float f[8];
            load8f(zs + c * CE + 8 * i, f);
            ce_grad8(f, sc, li, e0 + 8 * i, tgt);
            store8f(zs + c * CE + 8 * i, f);
        }
        fence_proxy_async(); /* the gradient, written by threads, for the bulk copy's reads */
        __syncthreads();
        if (threadIdx.x == 0)
            bulk_store(reinterpret_cast<char *>(z + c * CE), zs_a + c * CEF_CHUNK, (uint32_t)(len * sizeof(T)));
    }
    if (threadIdx.x == 0) {
        bulk_commit();
        bulk_wait_read(); /* shared memory lives as long as the CTA */
    }
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

/* the cluster size for a row of V, 0 where the fused kernel does not apply */
template <typename T> static int ce_cluster(const void *logits, int V)
{
    if (!g_cuda.hopper || !aligned16(logits)) return 0;
    for (int cl = 1; cl <= CEF_MAX_CLUSTER; cl *= 2)
        if (V % (8 * cl) == 0 && (size_t)(V / cl) * sizeof(T) <= CEF_SLICE) return cl;
    return 0;
}

template <typename T>
void cu_cross_entropy_fused(float *losses, float *lse, void *logits, const int32_t *targets, int N,
                            int V, float scale)
{
    MT_CHECK(N >= 0 && V > 0, "cross_entropy: bad shape N=%d V=%d", N, V);
    if (N == 0) return;
    const int cl = ce_cluster<T>(logits, V);
    if (cl == 0 || (int64_t)N * cl > INT32_MAX) {
        cu_cross_entropy_forward<T>(losses, lse, logits, targets, N, V);
        cu_cross_entropy_backward<T>(logits, logits, lse, targets, N, V, scale);
        return;
    }
    static bool attr_set;
    if (!attr_set) {
        CUDA_CHECK(cudaFuncSetAttribute(ce_fused_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        CEF_SLICE));
        attr_set = true;
    }
    const int slice = V / cl;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(N * cl));
    cfg.blockDim = dim3(CEF_THREADS);
    cfg.dynamicSmemBytes = (size_t)slice * sizeof(T);
    cfg.stream = g_cuda.stream;
    cudaLaunchAttribute attr[2] = {};
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)cl, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1 + cuda_pdl_attr(&attr[1]);
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, ce_fused_kernel<T>, losses, lse, (T *)logits, targets, V, cl, slice,
                                  scale));
    CUDA_LAUNCH_CHECK("cross_entropy fused");
}

template void cu_cross_entropy_fused<float>(float *, float *, void *, const int32_t *, int, int, float);
template void cu_cross_entropy_fused<bf16>(float *, float *, void *, const int32_t *, int, int, float);
template void cu_cross_entropy_forward<float>(float *, float *, const void *, const int32_t *, int, int);
template void cu_cross_entropy_forward<bf16>(float *, float *, const void *, const int32_t *, int, int);
template void cu_cross_entropy_backward<float>(void *, const void *, const float *, const int32_t *,
                                               int, int, float);
template void cu_cross_entropy_backward<bf16>(void *, const void *, const float *, const int32_t *,
                                              int, int, float);
