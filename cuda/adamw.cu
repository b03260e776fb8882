/* AdamW, elementwise, in the order of src/cpu/cpu_adamw.c (decoupled decay first, then the Adam
 * step); the bias corrections are formed on the host in double and rounded once, as there. */
#include "adamw.cuh"

enum { AD_BLOCK = 256 };

template <typename T>
__global__ void adamw_kernel(float *master, T *param, const float *grad, float *m, float *v,
                             size_t n, float lr, float beta1, float beta2, float eps, float decay,
                             float bc1, float bc2, float grad_scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float g = grad[i] * grad_scale;
        const float mi = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        const float mhat = mi / bc1, vhat = vi / bc2;
        float p = master[i] * decay;
        p -= lr * (mhat / (sqrtf(vhat) + eps));
        master[i] = p;
        if (param) param[i] = from_f<T>(p); /* param may be master itself in fp32 */
    }
}

template <typename T>
void cu_adamw_update(float *master, void *param, const float *grad, float *m, float *v, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                     float grad_scale)
{
    MT_CHECK(t >= 1, "adamw: step %d must be >= 1 (bias correction divides by 1 - beta^t)", t);
    if (n == 0) return;
    const float bc1 = (float)(1.0 - pow((double)beta1, t));
    const float bc2 = (float)(1.0 - pow((double)beta2, t));
    const float decay = 1.0f - lr * weight_decay;
    adamw_kernel<T><<<cuda_grid(n, AD_BLOCK), AD_BLOCK, 0, g_cuda.stream>>>(
        master, (T *)param, grad, m, v, n, lr, beta1, beta2, eps, decay, bc1, bc2, grad_scale);
    CUDA_LAUNCH_CHECK("adamw");
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
