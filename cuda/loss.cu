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

enum { CE_BLOCK = 256 };

/* (m, s) ⊕ (m2, s2): the pair of the union, rescaled to the larger max */
__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2)
{
    const float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return; /* both empty */
    s = s * __expf(m - mn) + s2 * __expf(m2 - mn);
    m = mn;
}

template <typename T>
__global__ void __launch_bounds__(CE_BLOCK)
ce_fwd_kernel(float *losses, float *lse, const T *logits, const int32_t *targets, int V, bool vec)
{
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
            float vm = f[0];
#pragma unroll
            for (int j = 1; j < 8; j++) vm = fmaxf(vm, f[j]);
            if (vm > m) { s *= __expf(m - vm); m = vm; }
#pragma unroll
            for (int j = 0; j < 8; j++) s += __expf(f[j] - m);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += CE_BLOCK) {
            const float x = to_f(z[i]);
            if (x > m) { s *= __expf(m - x); m = x; }
            s += __expf(x - m);
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
#pragma unroll
            for (int j = 0; j < 8; j++)
                f[j] = sc * (__expf(f[j] - l) - (8 * i + j == tgt ? 1.0f : 0.0f));
            store8f(dz + 8 * i, f);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += CE_BLOCK)
            dz[i] = from_f<T>(sc * (__expf(to_f(z[i]) - l) - (i == tgt ? 1.0f : 0.0f)));
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
    ce_fwd_kernel<T><<<N, CE_BLOCK, 0, g_cuda.stream>>>(losses, lse, (const T *)logits, targets, V,
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
    ce_bwd_kernel<T><<<N, CE_BLOCK, 0, g_cuda.stream>>>((T *)dlogits, (const T *)logits, lse,
                                                       targets, V, scale, vec);
    CUDA_LAUNCH_CHECK("cross_entropy backward");
}

template void cu_cross_entropy_forward<float>(float *, float *, const void *, const int32_t *, int, int);
template void cu_cross_entropy_forward<bf16>(float *, float *, const void *, const int32_t *, int, int);
template void cu_cross_entropy_backward<float>(void *, const void *, const float *, const int32_t *,
                                               int, int, float);
template void cu_cross_entropy_backward<bf16>(void *, const void *, const float *, const int32_t *,
                                              int, int, float);
