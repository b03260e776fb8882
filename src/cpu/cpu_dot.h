/* The float dot-product kernel every CPU op shares (see the accumulation policy in cpu_ops.h):
 * 8 interleaved partial sums held in two 4-lane GCC vectors (SSE registers, the x86-64 baseline),
 * reduced by a fixed tree, then the tail added in order. Written with vector extensions rather
 * than left to the auto-vectoriser, which -O2 only applies to the cheapest loops. */
#ifndef MT_CPU_DOT_H
#define MT_CPU_DOT_H

#include <string.h>

typedef float cpu_v4f __attribute__((vector_size(16)));

static inline cpu_v4f cpu_load4(const float *p)
{
    cpu_v4f v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* Partial sums: lanes 0-3 of lo and of hi. Lane i of lo pairs with lane i of hi first. */
static inline float cpu_hsum8(cpu_v4f lo, cpu_v4f hi)
{
    cpu_v4f t = lo + hi;
    return (t[0] + t[2]) + (t[1] + t[3]);
}

static inline float cpu_dot(const float *a, const float *b, int n)
{
    cpu_v4f lo = {0}, hi = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        lo += cpu_load4(a + i) * cpu_load4(b + i);
        hi += cpu_load4(a + i + 4) * cpu_load4(b + i + 4);
    }
    float s = cpu_hsum8(lo, hi);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#endif
