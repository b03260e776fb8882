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

/* Small zeroings and copies on the compute stream run as kernels of ours, not as the driver's
 * memset and copy operations. Those do not take part in programmatic dependent launch: in the
 * EP=2 bench step's timeline each of the ~500 small ones (route counters of 20-1024 bytes, the
 * router weight stacked for its backward, the meta exchange's block to itself) cost 5-10 us of an
 * idle compute stream between the kernels around it, where a kernel of ours costs 1-3 us
 * (docs/benchmarks.md, forty-third session). Large ones stay with the driver (the copy engines,
 * the memset at full bandwidth). */
enum { SMALL_OP_BYTES = 1 << 20, SMALL_OP_BLOCK = 256 };

__global__ void fill_bytes_kernel(unsigned char *p, unsigned char v, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t i0 = blockIdx.x * (size_t)blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
    if (((uintptr_t)p & 15u) == 0) { /* 16-byte stores, then the tail */
        const uint32_t w = v * 0x01010101u;
        const uint4 q = make_uint4(w, w, w, w);
        for (size_t i = i0; i < n / 16; i += step) ((uint4 *)p)[i] = q;
        for (size_t i = n / 16 * 16 + i0; i < n; i += step) p[i] = v;
    } else {
        for (size_t i = i0; i < n; i += step) p[i] = v;
    }
}

__global__ void copy_bytes_kernel(unsigned char *dst, const unsigned char *src, size_t n)
{
    pdl_wait(); /* first: launch.cuh */
    const size_t i0 = blockIdx.x * (size_t)blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
    if ((((uintptr_t)dst | (uintptr_t)src) & 15u) == 0) {
        for (size_t i = i0; i < n / 16; i += step) ((uint4 *)dst)[i] = ((const uint4 *)src)[i];
        for (size_t i = n / 16 * 16 + i0; i < n; i += step) dst[i] = src[i];
    } else {
        for (size_t i = i0; i < n; i += step) dst[i] = src[i];
    }
}

static unsigned small_op_grid(size_t bytes)
{
    return (unsigned)MT_MIN(cuda_grid((bytes + 15) / 16, SMALL_OP_BLOCK), (unsigned)(2 * g_cuda.num_sms));
}

void cu_zero(void *p, size_t bytes)
{
    if (!bytes) return;
    if (bytes <= SMALL_OP_BYTES) {
        cuda_launch(fill_bytes_kernel, small_op_grid(bytes), SMALL_OP_BLOCK, 0, (unsigned char *)p,
                    (unsigned char)0, bytes);
        CUDA_LAUNCH_CHECK("zero");
    } else {
        CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g_cuda.stream));
    }
}

void cu_copy_on(void *dst, const void *src, size_t bytes, cudaStream_t stream)
{
    if (!bytes || dst == src) return;
    if (bytes <= SMALL_OP_BYTES && stream == g_cuda.stream) {
        cuda_launch(copy_bytes_kernel, small_op_grid(bytes), SMALL_OP_BLOCK, 0, (unsigned char *)dst,
                    (const unsigned char *)src, bytes);
        CUDA_LAUNCH_CHECK("copy");
    } else {
        CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    }
}

void cu_copy(void *dst, const void *src, size_t bytes) { cu_copy_on(dst, src, bytes, g_cuda.stream); }

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
