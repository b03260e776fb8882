/* Cross-entropy, one block per row: the row max, then Σ exp(z − max) with fp32 exponentials summed
 * in double, lse = max + log(Σ) in double (src/cpu/cpu_loss.c sums double exponentials; the
 * difference is under 1e-6 relative). The backward forms softmax as exp(z − max) / Σ, reading the
 * whole row before writing it, so dlogits may alias logits. A target outside [0, V) that is not the
 * ignore index (the CPU backend aborts on it) gives a NaN loss and NaN gradients: loud, not silent. */
#include "loss.cuh"

enum { CE_BLOCK = 512 };

/* max and Σ exp(z − max) of one row, in every thread of the block */
template <typename T>
__device__ void row_stats(const T *z, int V, float *mx_out, double *sum_out)
{
    __shared__ float shf[32];
    __shared__ double shd[32];
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, to_f(z[i]));
    mx = block_max(mx, shf);
    double s = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(to_f(z[i]) - mx);
    *sum_out = block_sum(s, shd);
    *mx_out = mx;
}

template <typename T>
__global__ void __launch_bounds__(CE_BLOCK)
ce_fwd_kernel(float *losses, const T *logits, const int32_t *targets, int V)
{
    const int n = blockIdx.x;
    const int32_t tgt = targets[n];
    if (tgt == MT_IGNORE_INDEX) { /* uniform across the block: before any barrier */
        if (threadIdx.x == 0) losses[n] = 0.0f;
        return;
    }
    const T *z = logits + (size_t)n * V;
    float mx;
    double s;
    row_stats(z, V, &mx, &s);
    if (threadIdx.x == 0)
        losses[n] = (tgt >= 0 && tgt < V) ? (float)((double)mx + log(s) - (double)to_f(z[tgt])) : NAN;
}

template <typename T>
__global__ void __launch_bounds__(CE_BLOCK)
ce_bwd_kernel(T *dlogits, const T *logits, const int32_t *targets, int V, float scale)
{
    const int n = blockIdx.x;
    const int32_t tgt = targets[n];
    T *dz = dlogits + (size_t)n * V;
    if (tgt == MT_IGNORE_INDEX) {
        for (int i = threadIdx.x; i < V; i += blockDim.x) dz[i] = from_f<T>(0.0f);
        return;
    }
    const T *z = logits + (size_t)n * V;
    float mx;
    double s;
    row_stats(z, V, &mx, &s); /* ends in a barrier: the whole row is read before any write */
    const float sf = (float)s;
    const bool ok = tgt >= 0 && tgt < V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float p = expf(to_f(z[i]) - mx) / sf;
        dz[i] = from_f<T>(ok ? scale * (i == tgt ? p - 1.0f : p) : NAN);
    }
}

template <typename T>
void cu_cross_entropy_forward(float *losses, const void *logits, const int32_t *targets, int N, int V)
{
    MT_CHECK(N >= 0 && V > 0, "cross_entropy: bad shape N=%d V=%d", N, V);
    if (N == 0) return;
    ce_fwd_kernel<T><<<N, CE_BLOCK, 0, g_cuda.stream>>>(losses, (const T *)logits, targets, V);
    CUDA_LAUNCH_CHECK("cross_entropy forward");
}

template <typename T>
void cu_cross_entropy_backward(void *dlogits, const void *logits, const int32_t *targets, int N,
                               int V, float scale)
{
    MT_CHECK(N >= 0 && V > 0, "cross_entropy backward: bad shape N=%d V=%d", N, V);
    if (N == 0) return;
    ce_bwd_kernel<T><<<N, CE_BLOCK, 0, g_cuda.stream>>>((T *)dlogits, (const T *)logits, targets, V,
                                                         scale);
    CUDA_LAUNCH_CHECK("cross_entropy backward");
}

template void cu_cross_entropy_forward<float>(float *, const void *, const int32_t *, int, int);
template void cu_cross_entropy_forward<bf16>(float *, const void *, const int32_t *, int, int);
template void cu_cross_entropy_backward<float>(void *, const void *, const int32_t *, int, int, float);
template void cu_cross_entropy_backward<bf16>(void *, const void *, const int32_t *, int, int, float);
