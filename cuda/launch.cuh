/* Kernel launches with programmatic dependent launch (PDL, compute capability 9.0; MT_PDL=1).
 *
 * Every kernel of ours is ordered after the one before it on g_cuda.stream. Launched plainly, the
 * next kernel's blocks are scheduled only once the previous grid has finished and its writes are
 * flushed: 1-2 us of an idle GPU at each of the ~4,100 kernel boundaries of a bench step (7 ms,
 * docs/benchmarks.md, twenty-third session), and a grid's last wave leaves most SMs empty while
 * the next grid has not started. With PDL the next grid's blocks may be scheduled as soon as every
 * block of the running grid has begun (`pdl_begin` below lets them), and each block then waits in
 * `pdl_begin` until the grid before has completed and its memory is visible.
 *
 * The rule that keeps this correct: every kernel calls pdl_begin() before it touches global
 * memory, so no kernel reads or writes anything while the kernel before it may still run
 * (tests/unit/test_launch_rule.c checks the sources). A kernel launched without the attribute
 * (MT_PDL unset, an A100) waits for its predecessor as before, and pdl_begin() is then a no-op.
 * Library kernels are launched by their libraries: CUB's radix sort and NCCL's without the
 * attribute, so they wait for the kernel before them whatever it triggers; where a library does
 * use it (CUB's merge sort, CUDA 13.0's headers), its kernels wait in griddepcontrol.wait as ours
 * do.
 * Built with -DMT_PDL_WAIT_ONLY (for measuring), a kernel never triggers early: the grid after it
 * launches when it exits, as without PDL, but skips the wait for the memory flush. */
#ifndef MT_CUDA_LAUNCH_CUH
#define MT_CUDA_LAUNCH_CUH

#include <utility>

/* the grid before this one on the stream has completed and its writes are visible; the grid after
 * this one may now be scheduled (its blocks wait in their own pdl_begin). Call it first. */
__device__ __forceinline__ void pdl_begin()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifndef MT_PDL_WAIT_ONLY
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
}

/* the programmatic-serialisation attribute when g_cuda.pdl, else none: the launch's attrs */
static inline unsigned cuda_pdl_attr(cudaLaunchAttribute *attr)
{
    if (!g_cuda.pdl) return 0;
    attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr->val.programmaticStreamSerializationAllowed = 1;
    return 1;
}

/* a launch of kernel on g_cuda.stream (as <<<grid, block, smem, g_cuda.stream>>>), with PDL when
 * g_cuda.pdl */
template <typename... Params, typename... Args>
void cuda_launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args &&...args)
{
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = g_cuda.stream;
    cfg.attrs = attr;
    cfg.numAttrs = cuda_pdl_attr(attr);
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

#endif
