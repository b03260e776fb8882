/* SwiGLU, elementwise over R × I pairs with the formulas of src/cpu/cpu_swiglu.c. In bf16 the SiLU
 * output is rounded before the multiply by up (spec §3.6); a no-op in fp32. Each (g, u) pair is
 * read and its gradients written by one thread, so dgu may alias gu.
 *
 * When I is a multiple of 8 and the pointers are 16-byte aligned each thread takes a chunk of 8
 * pairs (16-byte loads and stores in bf16); otherwise one pair per thread. With a row bound in
 * device memory (ops.h) the grid covers R rows and each thread stops at the bound.
 *
 * The maths (silu_x, swiglu_grad): fp32 mode, the verification mode, keeps cpu_swiglu.c's expf and
 * IEEE divisions. bf16 takes e^-g and 1 / (1 + e^-g) from the MUFU (exp_ftz, rcp_approx: a few ulp
 * of fp32 where the outputs are rounded to 8 bits): the precise pair cost ~20 issue slots an
 * element, which at the step's power-capped clock made these memory passes issue-bound. */
#include "swiglu.cuh"

enum { SW_BLOCK = 256 };

/* silu(g) before its rounding to the compute dtype */
template <typename T> __device__ __forceinline__ float silu_x(float g)
{
    if constexpr (sizeof(T) == sizeof(float)) return g / (1.0f + expf(-g));
    else return g * rcp_approx(1.0f + exp_ftz(-g));
}

/* dg = d·u·σ·(1 + g·(1 − σ)), du = d·silu(g) with silu formed (and rounded) as in the forward */
template <typename T>
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float &dg, float &du)
{
    if constexpr (sizeof(T) == sizeof(float)) {
        const float den = 1.0f + expf(-g);
        const float sig = 1.0f / den;
        dg = d * u * sig * (1.0f + g * (1.0f - sig));
        du = d * (g / den);
    } else {
        const float sig = rcp_approx(1.0f + exp_ftz(-g));
        dg = d * u * sig * (1.0f + g * (1.0f - sig));
        du = d * round_x<T>(g * sig);
    }
}

__device__ __forceinline__ int bounded(int R, const int64_t *rows)
{
    return rows && *rows < R ? (int)*rows : R;
}

template <typename T> __global__ void swiglu_fwd_kernel(T *out, const T *gu, int R, int I, const int64_t *rows)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t n = (size_t)bounded(R, rows) * I;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / I, c = i - r * I;
        const float g = to_f(gu[r * 2 * I + c]), u = to_f(gu[r * 2 * I + I + c]);
        out[i] = from_f<T>(round_x<T>(silu_x<T>(g)) * u);
    }
}

template <typename T> __global__ void swiglu_bwd_kernel(T *dgu, const T *dout, const T *gu, int R, int I, const int64_t *rows)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t n = (size_t)bounded(R, rows) * I;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / I, c = i - r * I;
        const size_t ig = r * 2 * I + c, iu = ig + I;
        const float g = to_f(gu[ig]), u = to_f(gu[iu]), d = to_f(dout[i]);
        float dg, du;
        swiglu_grad<T>(g, u, d, dg, du);
        dgu[ig] = from_f<T>(dg);
        dgu[iu] = from_f<T>(du);
    }
}

/* the vector kernels: chunk i of nci = I / 8 per row */
template <typename T> __global__ void swiglu_fwd_vec_kernel(T *out, const T *gu, int R, int I, const int64_t *rows)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t nci = (size_t)(I >> 3), n = (size_t)bounded(R, rows) * nci;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / nci, c = (i - r * nci) * 8;
        const T *row = gu + r * 2 * I;
        float g[8], u[8], y[8];
        load8f(row + c, g);
        load8f(row + I + c, u);
#pragma unroll
        for (int e = 0; e < 8; e++) y[e] = round_x<T>(silu_x<T>(g[e])) * u[e];
        store8f(out + r * I + c, y);
    }
}

template <typename T>
__global__ void swiglu_bwd_vec_kernel(T *dgu, const T *dout, const T *gu, int R, int I, const int64_t *rows)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t nci = (size_t)(I >> 3), n = (size_t)bounded(R, rows) * nci;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / nci, c = (i - r * nci) * 8;
        const size_t ig = r * 2 * I + c, iu = ig + I;
        float g[8], u[8], d[8], dg[8], du[8];
        load8f(gu + ig, g);
        load8f(gu + iu, u);
        load8f(dout + r * I + c, d);
#pragma unroll
        for (int e = 0; e < 8; e++) swiglu_grad<T>(g[e], u[e], d[e], dg[e], du[e]);
        store8f(dgu + ig, dg);
        store8f(dgu + iu, du);
    }
}

template <typename T> void cu_swiglu_forward(void *out, const void *gu, int R, int I, const int64_t *rows)
{
    MT_CHECK(R >= 0 && I >= 0, "swiglu: bad shape R=%d I=%d", R, I);
    if ((size_t)R * I == 0) return;
    if (I % 8 == 0 && aligned16(out) && aligned16(gu)) {
        const size_t n = (size_t)R * (I / 8);
        cuda_launch(swiglu_fwd_vec_kernel<T>, cuda_grid(n, SW_BLOCK), SW_BLOCK, 0,
            (T *)out, (const T *)gu, R, I, rows);
        CUDA_LAUNCH_CHECK("swiglu forward");
        return;
    }
    cuda_launch(swiglu_fwd_kernel<T>, cuda_grid((size_t)R * I, SW_BLOCK), SW_BLOCK, 0,
        (T *)out, (const T *)gu, R, I, rows);
    CUDA_LAUNCH_CHECK("swiglu forward");
}

template <typename T> void cu_swiglu_backward(void *dgu, const void *dout, const void *gu, int R, int I,
                                               const int64_t *rows)
{
    MT_CHECK(R >= 0 && I >= 0, "swiglu backward: bad shape R=%d I=%d", R, I);
    if ((size_t)R * I == 0) return;
    if (I % 8 == 0 && aligned16(dgu) && aligned16(dout) && aligned16(gu)) {
        const size_t n = (size_t)R * (I / 8);
        cuda_launch(swiglu_bwd_vec_kernel<T>, cuda_grid(n, SW_BLOCK), SW_BLOCK, 0,
            (T *)dgu, (const T *)dout, (const T *)gu, R, I, rows);
        CUDA_LAUNCH_CHECK("swiglu backward");
        return;
    }
    cuda_launch(swiglu_bwd_kernel<T>, cuda_grid((size_t)R * I, SW_BLOCK), SW_BLOCK, 0,
        (T *)dgu, (const T *)dout, (const T *)gu, R, I, rows);
    CUDA_LAUNCH_CHECK("swiglu backward");
}

template void cu_swiglu_forward<float>(void *, const void *, int, int, const int64_t *);
template void cu_swiglu_forward<bf16>(void *, const void *, int, int, const int64_t *);
template void cu_swiglu_backward<float>(void *, const void *, const void *, int, int, const int64_t *);
template void cu_swiglu_backward<bf16>(void *, const void *, const void *, int, int, const int64_t *);
