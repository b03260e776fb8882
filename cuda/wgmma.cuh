/* Hopper PTX wrappers shared by the kernels that use wgmma (the grouped expert GEMM and the
 * attention backward): shared-memory addresses, the async-proxy fence, the wgmma fence / commit /
 * wait, and the 128-byte-swizzle shared-memory descriptor. The MMA instructions themselves stay
 * with their kernels: each uses its own shapes and operand sources. */
#ifndef MT_CUDA_WGMMA_CUH
#define MT_CUDA_WGMMA_CUH

#include "cuda_common.cuh"

/* One binary carries sm_80 and sm_90a machine code (Makefile CUDA_ARCH). In a device pass without
 * the sm_90a feature set (the sm_80 pass) the Hopper kernels' bodies compile to a trap and these
 * wrappers to nothing: those kernels are never launched there, because the host side takes the
 * sm_80 path whenever cuda_hopper() is false (compute capability other than 9.0, or
 * MT_FORCE_SM80=1). */
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MT_NO_HOPPER_CODE 1
#pragma nv_diag_suppress 177 /* the Hopper-only helpers go unused in this pass */
#endif

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* makes this thread's generic-proxy writes to shared memory (st.shared, cp.async) visible to the
 * async proxy (wgmma operand reads, TMA) */
__device__ __forceinline__ void fence_proxy_async()
{
#ifndef MT_NO_HOPPER_CODE
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

#ifndef MT_NO_HOPPER_CODE
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/* Moves registers between the warpgroups of a warp-specialised CTA: every warp of a warpgroup
 * executes the same one. ptxas sizes a kernel for its launch bound (65536 / threads), e.g. 168 a
 * thread at 384 threads; a producer warpgroup that gives back to 24 lets the two consumer
 * warpgroups grow to 240 (128·24 + 256·240 <= 65536), and ptxas allocates the code after the
 * increase with that budget. */
template <int N> __device__ __forceinline__ void setmaxnreg_inc()
{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec()
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N) : "memory");
}
#else
__device__ __forceinline__ void wgmma_fence() {}
__device__ __forceinline__ void wgmma_commit() {}
template <int N> __device__ __forceinline__ void wgmma_wait() {}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {}
#endif

/* wgmma shared-memory descriptor, 128-byte swizzle (layout type 1 in bits 62-63): start address,
 * leading and stride byte offsets */
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3ffffu) >> 4) | ((uint64_t)(lbo >> 4) << 16) |
           ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}

#endif
