/* Shared by the micro-benchmarks in tools/ (C files: the CUDA backend's CUDA_CHECK lives in a C++
 * header): a checked CUDA runtime call and cuBLAS call, ascending sorts of timings, and the median
 * time of a call measured in batches. */
#ifndef MT_TOOLS_BENCH_UTIL_H
#define MT_TOOLS_BENCH_UTIL_H

#include <stdlib.h>

#include "common.h"
#include "ops.h"

#ifdef MT_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#define CUDA_CALL(call)                                                                            \
    do {                                                                                           \
        cudaError_t ce_ = (call);                                                                  \
        if (ce_ != cudaSuccess) mt_fatal("%s: %s", #call, cudaGetErrorString(ce_));               \
    } while (0)

/* a checked cuBLAS / cuBLASLt call */
#define LT(call)                                                                                   \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) mt_fatal("%s: cuBLAS status %d", #call, (int)s_);        \
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

/* Median microseconds per call of run(arg): warm batches first, then reps samples, each a batch of
 * back-to-back calls between two syncs of the backend's stream (host wall clock), so launch gaps
 * are hidden as in a training step. */
static inline double bench_median_us(const struct backend *be, void (*run)(int), int arg, int warm,
                                     int batch, int reps)
{
    for (int i = 0; i < warm * batch; i++) run(arg);
    be->sync();
    double *us = (double *)mt_malloc((size_t)reps * sizeof *us);
    for (int s = 0; s < reps; s++) {
        const double t0 = mt_now();
        for (int i = 0; i < batch; i++) run(arg);
        be->sync();
        us[s] = (mt_now() - t0) * 1e6 / batch;
    }
    bench_sort_doubles(us, reps);
    const double med = reps % 2 ? us[reps / 2] : 0.5 * (us[reps / 2 - 1] + us[reps / 2]);
    free(us);
    return med;
}

#endif
