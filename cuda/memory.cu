/* Device memory, copies and the grow-only scratch buffers of the CUDA backend. */
#include "memory.cuh"

#include <string.h>

void *cu_alloc(size_t bytes)
{
    /* A zero-byte request still gets a distinct, valid pointer, as malloc-style callers expect. */
    const size_t n = bytes ? bytes : 256;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, n);
    if (e != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        (void)cudaGetLastError();
        (void)cudaMemGetInfo(&free_b, &total_b);
        mt_fatal("cudaMalloc(%zu bytes) on device %d: %s (%.2f GiB free of %.2f GiB)", n,
                 g_cuda.device, cudaGetErrorString(e), free_b / 1073741824.0,
                 total_b / 1073741824.0);
    }
    mem_track_alloc(p, n);
    /* All-ones bytes are NaN in fp32 and bf16 (and -1 in int32), as in the CPU backend: a buffer
     * read before it is written is loud. */
    CUDA_CHECK(cudaMemsetAsync(p, 0xff, n, g_cuda.stream));
    return p;
}

void cu_free(void *p)
{
    if (!p) return;
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream)); /* queued work may still use p */
    mem_track_free(p);
    CUDA_CHECK(cudaFree(p));
}

void cu_zero(void *p, size_t bytes)
{
    if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g_cuda.stream));
}

void cu_copy(void *dst, const void *src, size_t bytes)
{
    if (bytes && dst != src)
        CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g_cuda.stream));
}

static cudaStream_t aside_stream;
static cudaEvent_t aside_start, aside_done;
static bool aside_pending; /* started and not yet joined */

void cu_copy_aside(void *dst, const void *src, size_t bytes)
{
    MT_CHECK(!aside_pending, "copy_aside: started again before copy_aside_join");
    if (!aside_stream) {
        CUDA_CHECK(cudaStreamCreateWithFlags(&aside_stream, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&aside_start, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&aside_done, cudaEventDisableTiming));
    }
    CUDA_CHECK(cudaEventRecord(aside_start, g_cuda.stream));
    CUDA_CHECK(cudaStreamWaitEvent(aside_stream, aside_start, 0));
    if (bytes && dst != src)
        CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, aside_stream));
    CUDA_CHECK(cudaEventRecord(aside_done, aside_stream));
    aside_pending = true;
}

void cu_copy_aside_join(void)
{
    if (!aside_pending) return;
    CUDA_CHECK(cudaStreamWaitEvent(g_cuda.stream, aside_done, 0));
    aside_pending = false;
}

/* From pageable memory the call returns once the source has been staged, so the caller may reuse
 * host_src at once. */
void cu_upload(void *dst, const void *host_src, size_t bytes)
{
    if (bytes)
        CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, g_cuda.stream));
}

static int *deferred_dev, *deferred_host; /* the counter and its pinned copy */
static const char *deferred_what;         /* set while a check is due at the next sync */

int *cu_deferred_error_counter(void)
{
    if (!deferred_dev) {
        CUDA_CHECK(cudaMalloc(&deferred_dev, sizeof(int)));
        CUDA_CHECK(cudaMallocHost(&deferred_host, sizeof(int)));
        CUDA_CHECK(cudaMemsetAsync(deferred_dev, 0, sizeof(int), g_cuda.stream));
    }
    return deferred_dev;
}

/* The counter's copy is queued by the next download or sync, not here: a 4-byte copy to the host
 * after every MoE layer's route plan held the next kernel back ~9 us each (the kernel timeline,
 * docs/benchmarks.md, twenty-third session). The counter only grows, so the copy at the sync
 * sees every bad id counted before it. */
void cu_deferred_error_fetch(const char *what)
{
    (void)cu_deferred_error_counter();
    deferred_what = what;
}

/* queued before the stream drains */
static void deferred_copy(void)
{
    if (deferred_what)
        CUDA_CHECK(cudaMemcpyAsync(deferred_host, deferred_dev, sizeof(int), cudaMemcpyDeviceToHost,
                                   g_cuda.stream));
}

/* after the stream has drained */
static void deferred_check(void)
{
    if (!deferred_what) return;
    const char *what = deferred_what;
    deferred_what = NULL;
    if (*deferred_host) mt_fatal("%s (%d of them)", what, *deferred_host);
}

void cu_download(void *host_dst, const void *src, size_t bytes)
{
    if (bytes)
        CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, g_cuda.stream));
    deferred_copy();
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    deferred_check();
}

void cu_sync(void)
{
    deferred_copy();
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    deferred_check();
}

double cu_device_used(void)
{
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return (double)(total_b - free_b);
}

static void *scratch_buf[SCRATCH_COUNT];
static size_t scratch_cap[SCRATCH_COUNT];

void *cuda_scratch(enum cuda_scratch_slot slot, size_t bytes)
{
    if (bytes > scratch_cap[slot]) {
        if (scratch_buf[slot]) {
            CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
            mem_track_free(scratch_buf[slot]);
            CUDA_CHECK(cudaFree(scratch_buf[slot]));
        }
        size_t cap = scratch_cap[slot] + scratch_cap[slot] / 2;
        if (cap < bytes) cap = bytes;
        if (cap < 4096) cap = 4096;
        CUDA_CHECK(cudaMalloc(&scratch_buf[slot], cap));
        enum mem_cat was = mem_track_set(MEM_BUFFERS);
        mem_track_alloc(scratch_buf[slot], cap);
        mem_track_set(was);
        scratch_cap[slot] = cap;
    }
    return scratch_buf[slot];
}
