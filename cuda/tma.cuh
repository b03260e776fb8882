/* Hopper bulk-tensor copies (TMA) and the shared-memory mbarriers that track them, shared by the
 * warp-specialised kernels (grouped_gemm.cu, attention_tma_fwd.cu): device wrappers here, the
 * tensor-map encoder in tma.cu. Device wrappers compile to nothing useful off sm_90a; the kernels
 * that call them are never launched there (see wgmma.cuh). */
#ifndef MT_CUDA_TMA_CUH
#define MT_CUDA_TMA_CUH

#include "cuda_common.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

/* A bf16 tensor map, 128-byte swizzle, zeros out of bounds. dims innermost first; strides in
 * bytes for dims 1..; `what` names the caller in the error message. */
void tma_make_map(CUtensorMap *m, const void *base, int rank, const cuuint64_t *dims,
                  const cuuint64_t *strides, const cuuint32_t *box, const char *what);
/* the same for an fp32 tensor (the box's inner dimension is then at most 32 elements) */
void tma_make_map_f32(CUtensorMap *m, const void *base, int rank, const cuuint64_t *dims,
                      const cuuint64_t *strides, const cuuint32_t *box, const char *what);

namespace {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}"
                 ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar)
                 : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity)
{
    uint32_t ok;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return ok != 0;
}

__device__ __forceinline__ uint64_t global_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* A wait that never returns is a bug in this file (a miscounted barrier); after 10 s it stores to
 * address 0, so it surfaces as a launch failure (illegal address) instead of a hung process. Not
 * a trap: ptxas ignores a warpgroup's setmaxnreg budget in a region that holds a trap, and the
 * attention kernels' consumers need that budget (attention_tma_fwd.cu). */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    if (mbar_try_wait(bar, parity)) return;
    const uint64_t t0 = global_ns();
    for (uint32_t n = 1; !mbar_try_wait(bar, parity); n++)
        if ((n & 0xffffu) == 0 && global_ns() - t0 > 10000000000ull)
            asm volatile("st.global.u32 [%0], 1;" ::"l"(0ull) : "memory");
}

__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                       uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void tma_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                       uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}

/* shared -> global: a box of the tensor at (c0, c1) from the 128-byte-swizzled tile at src, as
 * one bulk group of this thread (rows and columns outside the tensor are not written) */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, uint32_t src, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
/* shared -> global for a 3-D tensor: the box stored (tma_store_3d) or added element-wise onto the
 * tensor's values by the L2 (tma_reduce_add_3d) */
__device__ __forceinline__ void tma_store_3d(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2)
{
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];"
                 ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2)
{
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];"
                 ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(src)
                 : "memory");
}
/* global <-> shared without a tensor map: `bytes` (a multiple of 16, both addresses 16-aligned)
 * copied whole; the load completes on the mbarrier, the store is one bulk group of this thread */
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_store(void *dst, uint32_t src, uint32_t bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
/* this thread's bulk stores have read their shared memory (it may be rewritten) */
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
/* ... and have completed */
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

} /* namespace */

#endif
