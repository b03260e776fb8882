/* Definitions of the helpers of the GPU parity tests (suite "gpu"); see gpu_ops_util.h. */
#include "gpu_ops_util.h"

#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_backend.h"

/* mode 0 is fp32, mode 1 bf16 */
void mode_get(int i, struct mode *m)
{
    const bool fp32 = i == 0;
    m->g = gpu_backend_or_skip(fp32);
    m->c = backend_cpu();
    m->name = fp32 ? "fp32" : "bf16";
    m->tol = fp32 ? TOL_F32 : TOL_BF16;
    m->tol_long = fp32 ? TOL_F32_LONG : TOL_BF16;
    cr_assert_str_eq(m->g->name, "cuda");
    cr_assert_eq(m->g->x_size, fp32 ? 4u : 2u);
}

/* ---------------------------------------------------------------- host helpers */

float *fnew(size_t n) { return mt_calloc(n ? n : 1, sizeof(float)); }

float *hrand(mt_rng *r, size_t n, double scale)
{
    float *x = fnew(n);
    for (size_t i = 0; i < n; i++) {
        double v = mt_rng_normal(r) * scale;
        if (v == 0.0) v = 0.5 * scale; /* never zeros */
        x[i] = (float)v;
    }
    return x;
}

float *hdup(const float *x, size_t n)
{
    float *y = fnew(n);
    memcpy(y, x, n * sizeof(float));
    return y;
}

int irand(mt_rng *r, int n) { return (int)(mt_rng_uniform(r) * n) % n; }

void shuffle(mt_rng *r, int32_t *a, int n)
{
    for (int i = n - 1; i > 0; i--) {
        int j = irand(r, i + 1);
        int32_t t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

/* ‖got − ref‖ / ‖ref‖ (the plain norm of the difference if ref is zero); infinite if got holds a
 * NaN or an infinity */
double rel_err(const float *got, const float *ref, size_t n)
{
    double d = 0.0, r = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) return INFINITY;
        const double x = (double)got[i] - ref[i];
        d += x * x;
        r += (double)ref[i] * ref[i];
    }
    return r > 0.0 ? sqrt(d / r) : sqrt(d);
}

void check_close(const struct mode *m, const char *what, const float *got, const float *ref,
                 size_t n, double tol)
{
    const double e = rel_err(got, ref, n);
    fprintf(stderr, "gpu %s %-44s rel err %.2e (tol %.0e)\n", m->name, what, e, tol);
    cr_expect(e <= tol, "%s [%s]: relative error %.3e exceeds %.1e", what, m->name, e, tol);
}

void check_exact(const struct mode *m, const char *what, const void *got, const void *ref,
                 size_t bytes)
{
    const bool same = memcmp(got, ref, bytes) == 0;
    fprintf(stderr, "gpu %s %-44s %s\n", m->name, what, same ? "bit-exact" : "DIFFERS");
    cr_expect(same, "%s [%s]: expected bit-identical results", what, m->name);
}

/* a - b elementwise (what an accumulating op added) */
float *diff(const float *a, const float *b, size_t n)
{
    float *d = fnew(n);
    for (size_t i = 0; i < n; i++) d[i] = a[i] - b[i];
    return d;
}

/* ---------------------------------------------------------------- device helpers */

/* A device buffer of n compute-dtype elements holding h; h is overwritten with exactly the values
 * the device holds (rounded to bf16 in bf16 mode) so that the CPU reference uses the same input. */
void *dx_from(const struct mode *m, float *h, size_t n)
{
    const struct backend *g = m->g;
    float *tmp = g->alloc(n * sizeof(float));
    void *x = g->alloc(n * g->x_size);
    g->upload(tmp, h, n * sizeof(float));
    g->cast_f32_to_x(x, tmp, n);
    g->cast_x_to_f32(tmp, x, n);
    g->download(h, tmp, n * sizeof(float));
    g->free(tmp);
    return x;
}

float *df_from(const struct mode *m, const float *h, size_t n)
{
    float *d = m->g->alloc(n * sizeof(float));
    m->g->upload(d, h, n * sizeof(float));
    return d;
}

int32_t *di_from(const struct mode *m, const int32_t *h, size_t n)
{
    int32_t *d = m->g->alloc(n * sizeof(int32_t));
    m->g->upload(d, h, n * sizeof(int32_t));
    return d;
}

/* NaN bytes over a device output before the op under test runs */
void poison(const struct mode *m, void *d, size_t bytes)
{
    void *h = mt_malloc(bytes);
    memset(h, 0xff, bytes);
    m->g->upload(d, h, bytes);
    free(h);
}

void *dx_poisoned(const struct mode *m, size_t n)
{
    void *d = m->g->alloc(n * m->g->x_size);
    poison(m, d, n * m->g->x_size);
    return d;
}

float *df_poisoned(const struct mode *m, size_t n)
{
    float *d = m->g->alloc(n * sizeof(float));
    poison(m, d, n * sizeof(float));
    return d;
}

/* host fp32 copies of device results */
float *hx_of(const struct mode *m, const void *dx, size_t n)
{
    const struct backend *g = m->g;
    float *tmp = g->alloc(n * sizeof(float));
    float *h = fnew(n);
    g->cast_x_to_f32(tmp, dx, n);
    g->download(h, tmp, n * sizeof(float));
    g->free(tmp);
    return h;
}

float *hf_of(const struct mode *m, const float *d, size_t n)
{
    float *h = fnew(n);
    m->g->download(h, d, n * sizeof(float));
    return h;
}
