/* Device memory of the CUDA backend: plain cudaMalloc (never managed memory), and copies and
 * memsets ordered on the backend's one stream. */
#ifndef MT_CUDA_MEMORY_CUH
#define MT_CUDA_MEMORY_CUH

#include "cuda_common.cuh"

void *cu_alloc(size_t bytes);
void cu_free(void *p);
void cu_zero(void *p, size_t bytes);
void cu_copy(void *dst, const void *src, size_t bytes);
/* a device-to-device copy on `stream` (up to 1 MiB on the backend's stream: a kernel of ours) */
void cu_copy_on(void *dst, const void *src, size_t bytes, cudaStream_t stream);
/* ops.h copy_aside: a side stream of its own, ordered by events */
void cu_copy_aside(void *dst, const void *src, size_t bytes);
void cu_copy_aside_join(void);
void cu_upload(void *dst, const void *host_src, size_t bytes);
void cu_download(void *host_dst, const void *src, size_t bytes);
void cu_sync(void);
double cu_device_used(void);

/* Bad input that a kernel finds where the host does not wait for it (moe_route_plan's expert ids
 * outside [0, E)): the kernel adds the count of bad items to this device counter, the caller then
 * calls cu_deferred_error_fetch(what) (what: the message; the count is added), and the next
 * cu_download or cu_sync copies the counter and, once the stream has drained, stops the run with
 * that message if the count is not zero. Nothing of its own on the stream. */
int *cu_deferred_error_counter(void);
void cu_deferred_error_fetch(const char *what);

#endif
