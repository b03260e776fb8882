/* The side queue (side_stream.cuh). Both streams have the default priority unless
 * MT_SIDE_PRIORITY=low: then the compute stream is created with the highest priority the device
 * offers (CUDA's default is its lowest), so that when both streams have blocks waiting the block
 * scheduler starts the compute stream's first and the side work (memory-bound: the optimizer)
 * fills the SMs the compute kernels leave idle (their tails, the waits between them). */
#include "side_stream.cuh"

#include "cuda_common.cuh"
#include "env_flag.h"
#include "ops.h"

static struct {
    cudaStream_t stream;  /* the side stream (created on first use) */
    cudaStream_t compute; /* the compute stream while the side one is current (NULL: not) */
    cudaEvent_t start, end;
    cudaEvent_t mark[SIDE_MARKS];
    bool marked[SIDE_MARKS];
    bool ended; /* `end` recorded at least once */
} side;

static bool side_low(void)
{
    static const char *const prio[] = {"same", "low"};
    return mt_env_choice("MT_SIDE_PRIORITY", prio, 2, 0) == 1;
}

int cu_compute_stream_priority(void)
{
    int least = 0, greatest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    return side_low() ? greatest : least;
}

static void side_init(void)
{
    int least = 0, greatest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CUDA_CHECK(cudaStreamCreateWithPriority(&side.stream, cudaStreamNonBlocking, least));
    CUDA_CHECK(cudaEventCreateWithFlags(&side.start, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&side.end, cudaEventDisableTiming));
    for (int i = 0; i < SIDE_MARKS; i++) CUDA_CHECK(cudaEventCreateWithFlags(&side.mark[i], cudaEventDisableTiming));
}

void cu_side_begin(void)
{
    MT_CHECK(!side.compute, "side_begin: the side queue is current already");
    if (!side.stream) side_init();
    CUDA_CHECK(cudaEventRecord(side.start, g_cuda.stream));
    CUDA_CHECK(cudaStreamWaitEvent(side.stream, side.start, 0));
    side.compute = g_cuda.stream;
    g_cuda.stream = side.stream;
    CUBLAS_CHECK(cublasSetStream(g_cuda.blas, side.stream));
}

void cu_side_mark(int i)
{
    MT_CHECK(side.compute && i >= 0 && i < SIDE_MARKS, "side_mark(%d): outside side_begin/side_end or out of range", i);
    CUDA_CHECK(cudaEventRecord(side.mark[i], side.stream));
    side.marked[i] = true;
}

void cu_side_end(void)
{
    MT_CHECK(side.compute, "side_end without side_begin");
    CUDA_CHECK(cudaEventRecord(side.end, side.stream));
    side.ended = true;
    g_cuda.stream = side.compute;
    side.compute = NULL;
    CUBLAS_CHECK(cublasSetStream(g_cuda.blas, g_cuda.stream));
}

void cu_side_wait(int i)
{
    MT_CHECK(!side.compute && i >= -1 && i < SIDE_MARKS, "side_wait(%d): inside side_begin/side_end or out of range", i);
    if (i < 0 ? !side.ended : !side.marked[i]) return; /* nothing was queued there: nothing to wait for */
    CUDA_CHECK(cudaStreamWaitEvent(g_cuda.stream, i < 0 ? side.end : side.mark[i], 0));
}
