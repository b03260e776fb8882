/* Casts and elementwise ops. Grid-stride loops over size_t indices; sumsq_f32 reduces in double
 * through fixed per-block partials, so its result does not depend on scheduling. The casts and
 * add_inplace take chunks of 8 elements (16-byte accesses) when every pointer is 16-byte aligned,
 * the n % 8 tail element-wise in the same launch. */
#include "elementwise.cuh"

enum { EW_BLOCK = 256, SUMSQ_BLOCKS = 1024 };

template <typename O, typename I>
__global__ void convert_kernel(O *__restrict__ out, const I *__restrict__ in, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = from_f<O>(to_f(in[i]));
}

template <typename O, typename I>
__global__ void convert_vec_kernel(O *__restrict__ out, const I *__restrict__ in, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t nch = n / 8, tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (size_t i = tid; i < nch; i += (size_t)gridDim.x * blockDim.x) {
        float f[8];
        load8f(in + i * 8, f);
        store8f(out + i * 8, f);
    }
    if (tid < n - nch * 8) out[nch * 8 + tid] = from_f<O>(to_f(in[nch * 8 + tid]));
}

template <typename O, typename I> static void convert(O *out, const I *in, size_t n)
{
    if (aligned16(out) && aligned16(in))
        cuda_launch(convert_vec_kernel<O, I>, cuda_grid(n / 8 + 1, EW_BLOCK), EW_BLOCK, 0, out, in, n);
    else
        cuda_launch(convert_kernel<O, I>, cuda_grid(n, EW_BLOCK), EW_BLOCK, 0, out, in, n);
    CUDA_LAUNCH_CHECK("convert");
}

template <typename T> void cu_cast_f32_to_x(void *out, const float *in, size_t n)
{
    if (n == 0) return;
    if ((const void *)out == (const void *)in) {
        /* in place is only meaningful when the dtypes match (fp32 mode): nothing to do */
        MT_CHECK(sizeof(T) == sizeof(float), "cast_f32_to_x: in-place cast to bf16 is not supported");
        return;
    }
    convert<T, float>((T *)out, in, n);
}

template <typename T> void cu_cast_x_to_f32(float *out, const void *in, size_t n)
{
    if (n == 0) return;
    if ((const void *)out == in) {
        MT_CHECK(sizeof(T) == sizeof(float), "cast_x_to_f32: in-place cast from bf16 is not supported");
        return;
    }
    convert<float, T>(out, (const T *)in, n);
}

template <typename T> __global__ void add_kernel(T *y, const T *x, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = from_f<T>(to_f(y[i]) + to_f(x[i]));
}

template <typename T> __global__ void add_vec_kernel(T *y, const T *x, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t nch = n / 8, tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (size_t i = tid; i < nch; i += (size_t)gridDim.x * blockDim.x) {
        float a[8], b[8];
        load8f(y + i * 8, a);
        load8f(x + i * 8, b);
#pragma unroll
        for (int e = 0; e < 8; e++) a[e] += b[e];
        store8f(y + i * 8, a);
    }
    if (tid < n - nch * 8) {
        const size_t i = nch * 8 + tid;
        y[i] = from_f<T>(to_f(y[i]) + to_f(x[i]));
    }
}

template <typename T> void cu_add_inplace(void *y, const void *x, size_t n)
{
    if (n == 0) return;
    if (aligned16(y) && aligned16(x)) {
        cuda_launch(add_vec_kernel<T>, cuda_grid(n / 8 + 1, EW_BLOCK), EW_BLOCK, 0,
            (T *)y, (const T *)x, n);
        CUDA_LAUNCH_CHECK("add_inplace");
        return;
    }
    cuda_launch(add_kernel<T>, cuda_grid(n, EW_BLOCK), EW_BLOCK, 0, (T *)y, (const T *)x, n);
    CUDA_LAUNCH_CHECK("add_inplace");
}

__global__ void scale_kernel(float *x, size_t n, float s)
{
    pdl_wait(); /* first: launch.cuh */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

void cu_add_f32(float *y, const float *x, size_t n) { cu_add_inplace<float>(y, x, n); }

void cu_scale_f32(float *x, size_t n, float s)
{
    if (n == 0) return;
    cuda_launch(scale_kernel, cuda_grid(n, EW_BLOCK), EW_BLOCK, 0, x, n, s);
    CUDA_LAUNCH_CHECK("scale_f32");
}

/* Four floats a load where x is 16-byte aligned (the n % 4 tail by the first threads): the
 * scalar loop moved ~2.5 TB/s on an H200, this one ~4.4 (the step's 5.6e9 gradients: 9.3 -> 5.1 ms). */
__global__ void sumsq_partial_kernel(double *partial, const float *x, size_t n, bool vec)
{
    pdl_wait(); /* first: launch.cuh */
    __shared__ double sh[32];
    double s = 0.0;
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const size_t n4 = n / 4;
        for (size_t i = tid; i < n4; i += stride) {
            const float4 v = ((const float4 *)x)[i];
            s += (double)v.x * v.x + (double)v.y * v.y + (double)v.z * v.z + (double)v.w * v.w;
        }
        if (tid < n - n4 * 4) s += (double)x[n4 * 4 + tid] * x[n4 * 4 + tid];
    } else {
        for (size_t i = tid; i < n; i += stride) s += (double)x[i] * x[i];
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/* out = Σ x in one block's fixed order (out may be x) */
__global__ void sum_f64_kernel(const double *x, size_t n, double *out)
{
    pdl_wait(); /* first: launch.cuh */
    __shared__ double sh[32];
    double s = 0.0;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) *out = s;
}

void cu_sum_f64_to(const double *x, size_t n, double *out)
{
    cuda_launch(sum_f64_kernel, 1, 1024, 0, x, n, out);
    CUDA_LAUNCH_CHECK("sum_f64");
}

void cu_sumsq_f32_to(const float *x, size_t n, double *out)
{
    if (n == 0) {
        CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), g_cuda.stream));
        return;
    }
    const unsigned blocks = cuda_grid(n, EW_BLOCK) < SUMSQ_BLOCKS ? cuda_grid(n, EW_BLOCK) : SUMSQ_BLOCKS;
    double *partial = (double *)cuda_scratch(SCRATCH_REDUCE, SUMSQ_BLOCKS * sizeof(double));
    cuda_launch(sumsq_partial_kernel, blocks, EW_BLOCK, 0, partial, x, n, ((uintptr_t)x & 15u) == 0);
    CUDA_LAUNCH_CHECK("sumsq partial");
    cu_sum_f64_to(partial, blocks, out);
}

double cu_sumsq_f32(const float *x, size_t n)
{
    if (n == 0) return 0.0;
    double *partial = (double *)cuda_scratch(SCRATCH_REDUCE, SUMSQ_BLOCKS * sizeof(double));
    cu_sumsq_f32_to(x, n, partial); /* the final sum reads the partials into partial[0] */
    double r = 0.0;
    CUDA_CHECK(cudaMemcpyAsync(&r, partial, sizeof r, cudaMemcpyDeviceToHost, g_cuda.stream));
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    return r;
}

template void cu_cast_f32_to_x<float>(void *, const float *, size_t);
template void cu_cast_f32_to_x<bf16>(void *, const float *, size_t);
template void cu_cast_x_to_f32<float>(float *, const void *, size_t);
template void cu_cast_x_to_f32<bf16>(float *, const void *, size_t);
template void cu_add_inplace<float>(void *, const void *, size_t);
template void cu_add_inplace<bf16>(void *, const void *, size_t);
