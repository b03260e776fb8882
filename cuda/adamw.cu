/* AdamW, elementwise, in the order of src/cpu/cpu_adamw.c (decoupled decay first, then the Adam
 * step); the bias corrections are formed on the host in double and rounded once, as there.
 * adamw_update_multi runs every segment of an optimizer step in one launch: each block takes one
 * chunk of one segment (a table of segments and their first chunk, searched by the block), and
 * the element maths is the same function as the single-segment kernel's, so the bits match. */
#include "adamw.cuh"

#include <vector>

enum { AD_BLOCK = 256, AD_CHUNK = 16 * AD_BLOCK };

template <typename T>
__device__ __forceinline__ void adamw_elem(float *master, T *param, const float *grad, float *m,
                                           float *v, size_t i, float lr, float beta1, float beta2,
                                           float eps, float decay, float bc1, float bc2,
                                           float grad_scale)
{
    /* every operation rounded as written (no fused multiply-adds the compiler might form in one
     * kernel and not the other), so adamw_kernel and adamw_multi_kernel give the same bits */
    const float g = __fmul_rn(grad[i], grad_scale);
    const float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(1.0f - beta1, g));
    const float vi = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(1.0f - beta2, g), g));
    m[i] = mi;
    v[i] = vi;
    const float mhat = __fdiv_rn(mi, bc1), vhat = __fdiv_rn(vi, bc2);
    float p = __fmul_rn(master[i], decay);
    p = __fsub_rn(p, __fmul_rn(lr, __fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), eps))));
    master[i] = p;
    if (param) param[i] = from_f<T>(p); /* param may be master itself in fp32; NULL: no copy */
}

template <typename T>
__global__ void adamw_kernel(float *master, T *param, const float *grad, float *m, float *v,
                             size_t n, float lr, float beta1, float beta2, float eps, float decay,
                             float bc1, float bc2, float grad_scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        adamw_elem<T>(master, param, grad, m, v, i, lr, beta1, beta2, eps, decay, bc1, bc2,
                      grad_scale);
}

struct adamw_seg_dev {
    float *master;
    void *param;
    const float *grad;
    float *m, *v;
    long long n;
    long long chunk0; /* first chunk (block) of this segment */
    float decay;      /* 1 - lr * weight_decay, rounded on the host as adamw_update does */
};

template <typename T>
__global__ void adamw_multi_kernel(const adamw_seg_dev *__restrict__ segs, int n_seg, float lr,
                                   float beta1, float beta2, float eps, float bc1, float bc2,
                                   float grad_scale)
{
    __shared__ int seg;
    if (threadIdx.x == 0) { /* the last segment whose first chunk is at or before this block */
        int lo = 0, hi = n_seg - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (segs[mid].chunk0 <= (long long)blockIdx.x) lo = mid;
            else hi = mid - 1;
        }
        seg = lo;
    }
    __syncthreads();
    const adamw_seg_dev s = segs[seg];
    const long long i0 = ((long long)blockIdx.x - s.chunk0) * AD_CHUNK;
    const long long end = i0 + AD_CHUNK < s.n ? i0 + AD_CHUNK : s.n;
    for (long long i = i0 + threadIdx.x; i < end; i += AD_BLOCK)
        adamw_elem<T>(s.master, (T *)s.param, s.grad, s.m, s.v, (size_t)i, lr, beta1, beta2, eps,
                      s.decay, bc1, bc2, grad_scale);
}

static void bias_corrections(int t, float beta1, float beta2, float *bc1, float *bc2)
{
    MT_CHECK(t >= 1, "adamw: step %d must be >= 1 (bias correction divides by 1 - beta^t)", t);
    *bc1 = (float)(1.0 - pow((double)beta1, t));
    *bc2 = (float)(1.0 - pow((double)beta2, t));
}

template <typename T>
void cu_adamw_update(float *master, void *param, const float *grad, float *m, float *v, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                     float grad_scale)
{
    float bc1, bc2;
    bias_corrections(t, beta1, beta2, &bc1, &bc2);
    if (n == 0) return;
    const float decay = 1.0f - lr * weight_decay;
    adamw_kernel<T><<<cuda_grid(n, AD_BLOCK), AD_BLOCK, 0, g_cuda.stream>>>(
        master, (T *)param, grad, m, v, n, lr, beta1, beta2, eps, decay, bc1, bc2, grad_scale);
    CUDA_LAUNCH_CHECK("adamw");
}

template <typename T>
void cu_adamw_update_multi(const struct adamw_segment *segs, int n_seg, float lr, float beta1,
                           float beta2, float eps, int t, float grad_scale)
{
    float bc1, bc2;
    bias_corrections(t, beta1, beta2, &bc1, &bc2);
    MT_CHECK(n_seg >= 0 && (n_seg == 0 || segs), "adamw_multi: bad segment list (%d)", n_seg);
    /* kept between calls: the async copy below stages pageable memory before it returns, and the
     * next call refills it only after that */
    static std::vector<adamw_seg_dev> table;
    table.clear();
    long long chunks = 0;
    for (int i = 0; i < n_seg; i++) {
        const struct adamw_segment &s = segs[i];
        if (s.n == 0) continue;
        table.push_back({s.master, s.param, s.grad, s.m, s.v, (long long)s.n, chunks,
                         1.0f - lr * s.weight_decay});
        chunks += ((long long)s.n + AD_CHUNK - 1) / AD_CHUNK;
    }
    if (table.empty()) return;
    MT_CHECK(chunks <= INT32_MAX, "adamw_multi: %lld chunks exceed the grid", chunks);
    const size_t bytes = table.size() * sizeof(adamw_seg_dev);
    adamw_seg_dev *d_table = (adamw_seg_dev *)cuda_scratch(SCRATCH_ADAMW, bytes);
    CUDA_CHECK(cudaMemcpyAsync(d_table, table.data(), bytes, cudaMemcpyHostToDevice, g_cuda.stream));
    adamw_multi_kernel<T><<<(unsigned)chunks, AD_BLOCK, 0, g_cuda.stream>>>(
        d_table, (int)table.size(), lr, beta1, beta2, eps, bc1, bc2, grad_scale);
    CUDA_LAUNCH_CHECK("adamw multi");
}

/* bf16 moments: read, update in fp32, round to nearest-even bf16 (the CPU's rounding) */
template <typename T>
__global__ void adamw_m16_kernel(float *master, T *param, const float *grad, bf16 *m, bf16 *v, size_t n,
                                 float lr, float beta1, float beta2, float eps, float decay, float bc1,
                                 float bc2, float grad_scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float g = grad[i] * grad_scale;
        const float mi = beta1 * __bfloat162float(m[i]) + (1.0f - beta1) * g;
        const float vi = beta2 * __bfloat162float(v[i]) + (1.0f - beta2) * g * g;
        m[i] = __float2bfloat16_rn(mi);
        v[i] = __float2bfloat16_rn(vi);
        const float mhat = mi / bc1, vhat = vi / bc2;
        float p = master[i] * decay;
        p -= lr * (mhat / (sqrtf(vhat) + eps));
        master[i] = p;
        if (param) param[i] = from_f<T>(p);
    }
}

template <typename T>
void cu_adamw_update_m16(float *master, void *param, const float *grad, void *m, void *v, size_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                         float grad_scale)
{
    MT_CHECK(t >= 1, "adamw: step %d must be >= 1 (bias correction divides by 1 - beta^t)", t);
    if (n == 0) return;
    const float bc1 = (float)(1.0 - pow((double)beta1, t));
    const float bc2 = (float)(1.0 - pow((double)beta2, t));
    const float decay = 1.0f - lr * weight_decay;
    adamw_m16_kernel<T><<<cuda_grid(n, AD_BLOCK), AD_BLOCK, 0, g_cuda.stream>>>(
        master, (T *)param, grad, (bf16 *)m, (bf16 *)v, n, lr, beta1, beta2, eps, decay, bc1, bc2,
        grad_scale);
    CUDA_LAUNCH_CHECK("adamw_m16");
}

template void cu_adamw_update_m16<float>(float *, void *, const float *, void *, void *, size_t, float,
                                         float, float, float, float, int, float);
template void cu_adamw_update_m16<bf16>(float *, void *, const float *, void *, void *, size_t, float,
                                        float, float, float, float, int, float);

template void cu_adamw_update<float>(float *, void *, const float *, float *, float *, size_t, float,
                                     float, float, float, float, int, float);
template void cu_adamw_update<bf16>(float *, void *, const float *, float *, float *, size_t, float,
                                    float, float, float, float, int, float);
template void cu_adamw_update_multi<float>(const struct adamw_segment *, int, float, float, float,
                                           float, int, float);
template void cu_adamw_update_multi<bf16>(const struct adamw_segment *, int, float, float, float,
                                          float, int, float);
