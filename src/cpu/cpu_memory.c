/* Memory, casts and elementwise ops of the CPU backend: host memory plays the device. */
#include "cpu/cpu_ops.h"
#include "common.h"
#include "mem_track.h"

#include <stdlib.h>
#include <string.h>

void *cpu_alloc(size_t bytes)
{
    void *p = mt_malloc(bytes);
    mem_track_alloc(p, bytes);
    /* All-ones bytes are a NaN in fp32 (and an invalid index in int32): reading a buffer that was
     * never written shows up at once instead of passing on zeros that a GPU would not give. */
    memset(p, 0xff, bytes);
    return p;
}

void cpu_free(void *p)
{
    mem_track_free(p);
    free(p);
}

void cpu_zero(void *p, size_t bytes)
{
    if (bytes) memset(p, 0, bytes);
}

void cpu_copy(void *dst, const void *src, size_t bytes)
{
    if (bytes && dst != src) memmove(dst, src, bytes);
}

void cpu_sync(void) {}

double cpu_device_used(void) { return 0; }

void cpu_cast_f32(float *out, const float *in, size_t n) { cpu_copy(out, in, n * sizeof(float)); }

void cpu_add_inplace(float *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

void cpu_scale_f32(float *x, size_t n, float s)
{
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

double cpu_sumsq_f32(const float *x, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return s;
}
