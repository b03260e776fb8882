/* Shared by the micro-benchmarks in tools/ (C files: the CUDA backend's CUDA_CHECK lives in a C++
 * header): a checked CUDA runtime call and ascending sorts of timings. */
#ifndef MT_TOOLS_BENCH_UTIL_H
#define MT_TOOLS_BENCH_UTIL_H

#include <stdlib.h>

#include "common.h"

#ifdef MT_HAVE_CUDA
#include <cuda_runtime_api.h>

#define CUDA_CALL(call)                                                                            \
    do {                                                                                           \
        cudaError_t ce_ = (call);                                                                  \
        if (ce_ != cudaSuccess) mt_fatal("%s: %s", #call, cudaGetErrorString(ce_));               \
    } while (0)
#endif

static inline int bench_cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline int bench_cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static inline void bench_sort_doubles(double *x, int n) { qsort(x, (size_t)n, sizeof *x, bench_cmp_double); }
static inline void bench_sort_floats(float *x, int n) { qsort(x, (size_t)n, sizeof *x, bench_cmp_float); }

#endif
