/* Device memory of the CUDA backend: plain cudaMalloc (never managed memory), and copies and
 * memsets ordered on the backend's one stream. */
#ifndef MT_CUDA_MEMORY_CUH
#define MT_CUDA_MEMORY_CUH

#include "cuda_common.cuh"

void *cu_alloc(size_t bytes);
void cu_free(void *p);
void cu_zero(void *p, size_t bytes);
void cu_copy(void *dst, const void *src, size_t bytes);
void cu_upload(void *dst, const void *host_src, size_t bytes);
void cu_download(void *host_dst, const void *src, size_t bytes);
void cu_sync(void);
double cu_device_used(void);

#endif
