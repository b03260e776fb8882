/* Hopper PTX wrappers shared by the kernels that use wgmma (the grouped expert GEMM and the
 * attention backward): shared-memory addresses, the async-proxy fence, the wgmma fence / commit /
 * wait, and the 128-byte-swizzle shared-memory descriptor. The MMA instructions themselves stay
 * with their kernels: each uses its own shapes and operand sources. */
#ifndef MT_CUDA_WGMMA_CUH
#define MT_CUDA_WGMMA_CUH

#include "cuda_common.cuh"

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* makes this thread's generic-proxy writes to shared memory (st.shared, cp.async) visible to the
 * async proxy (wgmma operand reads, TMA) */
__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* wgmma shared-memory descriptor, 128-byte swizzle (layout type 1 in bits 62-63): start address,
 * leading and stride byte offsets */
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3ffffu) >> 4) | ((uint64_t)(lbo >> 4) << 16) |
           ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}

#endif
