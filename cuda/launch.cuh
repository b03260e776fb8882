/* Kernel launches with programmatic dependent launch (PDL): on compute capability 9.0 and newer,
 * unless MT_PDL=0.
 *
 * Every kernel of ours is ordered after the one before it on g_cuda.stream. Launched plainly, the
 * next kernel's blocks are scheduled only once the previous grid has finished and the completion
 * has gone through the stream: 1-2 us of an idle GPU at each of the ~4,100 kernel boundaries of a
 * bench step (7 ms). With the PDL attribute the next grid is scheduled as soon as the last block
 * of the one before exits, and each of its blocks waits in pdl_wait() until that grid's writes
 * are visible. On an H200 this took 0.55% off the bench step (docs/benchmarks.md, thirty-seventh
 * session).
 *
 * No kernel triggers its successor early (griddepcontrol.launch_dependents). Triggering at the
 * start of every kernel made the step 0.6-0.8% slower instead: the next grid's blocks then sat on
 * the SMs, waiting, through the whole of the running kernel, holding registers and shared memory
 * it could have used.
 *
 * The rule that keeps this correct: every kernel calls pdl_wait() before it touches global
 * memory, since its blocks may start before the writes of the kernel before it are visible
 * (tests/unit/test_launch_rule.c checks the sources). A kernel launched without the attribute
 * (MT_PDL=0, an A100) waits for its predecessor as before, and pdl_wait() returns at once.
 * Library kernels are launched by their libraries: CUB's radix sort and NCCL's without the
 * attribute, so they wait for the kernel before them as before; where a library does use it
 * (CUB's merge sort, CUDA 13.0's headers), its kernels wait in griddepcontrol.wait as ours do. */
#ifndef MT_CUDA_LAUNCH_CUH
#define MT_CUDA_LAUNCH_CUH

#include <utility>

/* the grid before this one on the stream has completed and its writes are visible. Call it first. */
__device__ __forceinline__ void pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
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
