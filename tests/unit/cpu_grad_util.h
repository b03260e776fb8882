/* The CPU backend tests' gradient check (test_cpu_ops.c, test_cpu_moe_ops.c), header-only (static
 * inline) so that these short names stay inside the two files that include it.
 *
 * The loss is a random projection L = Σ r ⊙ out, summed in double. The finite difference is
 * Richardson-extrapolated from central differences at steps h and h/2, (4·D(h/2) − D(h)) / 3,
 * which cancels the h² truncation term, so a step of 1e-2 (on inputs of size ~1) is possible; the
 * remaining error is the fp32 rounding of the forward divided by the step, ~1e-7·|out|/1e-2 ≈ 1e-5
 * relative. Only outputs that depend on the perturbed element change between evaluations, so the
 * noise does not grow with the tensor size. Every check asserts max |analytic − fd| ≤ GRAD_TOL ·
 * max |fd| with GRAD_TOL = 1e-3: two orders above the expected error, far below the O(1) error of
 * any wrong term. */
#ifndef MT_TESTS_CPU_GRAD_UTIL_H
#define MT_TESTS_CPU_GRAD_UTIL_H

#include <criterion/criterion.h>

#include <math.h>
#include <string.h>

#include "common.h"

#define GRAD_TOL 1e-3
#define FD_STEP 1e-2

static inline float *fnew(size_t n) { return mt_calloc(n ? n : 1, sizeof(float)); }
static inline double *dnew(size_t n) { return mt_calloc(n ? n : 1, sizeof(double)); }

static inline float *frand(mt_rng *rng, size_t n, double scale)
{
    float *x = fnew(n);
    for (size_t i = 0; i < n; i++) {
        double v = mt_rng_normal(rng) * scale;
        if (v == 0.0) v = scale * 0.5; /* never zeros */
        x[i] = (float)v;
    }
    return x;
}

static inline float *fdup(const float *x, size_t n)
{
    float *y = fnew(n);
    memcpy(y, x, n * sizeof(float));
    return y;
}

static inline double project(const float *r, const float *out, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)r[i] * out[i];
    return s;
}

typedef double (*loss_fn)(void *ctx);

/* fd[i] ≈ ∂L/∂x[i] by Richardson-extrapolated central differences, using the steps actually
 * representable in fp32. */
static inline void fd_grad(double *fd, float *x, size_t n, loss_fn f, void *ctx)
{
    for (size_t i = 0; i < n; i++) {
        const float x0 = x[i];
        double d[2];
        for (int s = 0; s < 2; s++) {
            const double h = FD_STEP / (1 << s);
            x[i] = (float)(x0 + h);
            const double xp = x[i];
            const double lp = f(ctx);
            x[i] = (float)(x0 - h);
            const double xm = x[i];
            const double lm = f(ctx);
            d[s] = (lp - lm) / (xp - xm);
        }
        x[i] = x0;
        fd[i] = (4.0 * d[1] - d[0]) / 3.0;
    }
}

static inline void expect_grad(const char *what, const float *g, const double *fd, size_t n)
{
    double maxfd = 0.0, maxerr = 0.0;
    size_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        maxfd = fmax(maxfd, fabs(fd[i]));
        double e = fabs((double)g[i] - fd[i]);
        if (e > maxerr) {
            maxerr = e;
            worst = i;
        }
    }
    cr_assert(maxfd > 0.0, "%s: the finite-difference gradient is all zero (test is vacuous)", what);
    cr_expect(maxerr <= GRAD_TOL * maxfd,
              "%s: max |analytic - fd| = %.3g at %zu (analytic %.6g, fd %.6g), max |fd| = %.3g",
              what, maxerr, worst, (double)g[worst], fd[worst], maxfd);
}

/* analytic gradient of an accumulating op: what it added to a random starting value */
static inline float *added(const float *after, const float *before, size_t n)
{
    float *d = fnew(n);
    for (size_t i = 0; i < n; i++) d[i] = after[i] - before[i];
    return d;
}

/* A second identical backward call onto the result of the first must double it. Ops that add row
 * by row into dw round after each row, so this holds to the float rounding of the row sums:
 * 1e-6 of the largest entry is several ulps of the sum. */
static inline void expect_doubled(const char *what, const float *twice, const float *once, size_t n)
{
    double mx = 0.0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(once[i]));
    for (size_t i = 0; i < n; i++)
        cr_expect(fabs(twice[i] - 2.0 * once[i]) <= 1e-6 * mx, "%s: dw += twice is not 2x at %zu",
                  what, i);
}

#endif
