/* Tests of the fp32 CPU backend (src/cpu/): every backward against central finite differences of
 * its own forward, and the forwards against independent double-precision restatements of the
 * maths (spec §3, §5).
 *
 * Gradient checks. The loss is a random projection L = Σ r ⊙ out, summed in double. The finite
 * difference is Richardson-extrapolated from central differences at steps h and h/2,
 * (4·D(h/2) − D(h)) / 3, which cancels the h² truncation term, so a step of 1e-2 (on inputs of
 * size ~1) is possible; the remaining error is the fp32 rounding of the forward divided by the step,
 * ~1e-7·|out|/1e-2 ≈ 1e-5 relative. Only outputs that depend on the perturbed element change
 * between evaluations, so the noise does not grow with the tensor size. Every check asserts
 * max |analytic − fd| ≤ GRAD_TOL · max |fd| with GRAD_TOL = 1e-3: two orders above the expected
 * error, far below the O(1) error of any wrong term. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "cpu/cpu_ops.h"
#include "ops.h"
#include "safetensors.h"

#define GRAD_TOL 1e-3
#define FD_STEP 1e-2

/* ---------------------------------------------------------------- helpers */

static float *fnew(size_t n) { return mt_calloc(n ? n : 1, sizeof(float)); }
static double *dnew(size_t n) { return mt_calloc(n ? n : 1, sizeof(double)); }

static float *frand(mt_rng *rng, size_t n, double scale)
{
    float *x = fnew(n);
    for (size_t i = 0; i < n; i++) {
        double v = mt_rng_normal(rng) * scale;
        if (v == 0.0) v = scale * 0.5; /* never zeros */
        x[i] = (float)v;
    }
    return x;
}

static float *fdup(const float *x, size_t n)
{
    float *y = fnew(n);
    memcpy(y, x, n * sizeof(float));
    return y;
}

static double project(const float *r, const float *out, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)r[i] * out[i];
    return s;
}

typedef double (*loss_fn)(void *ctx);

/* fd[i] ≈ ∂L/∂x[i] by Richardson-extrapolated central differences, using the steps actually
 * representable in fp32. */
static void fd_grad(double *fd, float *x, size_t n, loss_fn f, void *ctx)
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

static void expect_grad(const char *what, const float *g, const double *fd, size_t n)
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
static float *added(const float *after, const float *before, size_t n)
{
    float *d = fnew(n);
    for (size_t i = 0; i < n; i++) d[i] = after[i] - before[i];
    return d;
}

/* A second identical backward call onto the result of the first must double it. Ops that add row
 * by row into dw round after each row, so this holds to the float rounding of the row sums:
 * 1e-6 of the largest entry is several ulps of the sum. */
static void expect_doubled(const char *what, const float *twice, const float *once, size_t n)
{
    double mx = 0.0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(once[i]));
    for (size_t i = 0; i < n; i++)
        cr_expect(fabs(twice[i] - 2.0 * once[i]) <= 1e-6 * mx, "%s: dw += twice is not 2x at %zu",
                  what, i);
}

/* ---------------------------------------------------------------- backend table, memory */

Test(cpu_ops, backend_table_is_complete)
{
    const struct backend *b = backend_cpu();
    cr_assert_not_null(b);
    cr_assert_str_eq(b->name, "cpu");
    cr_assert_eq(b->x_size, 4);
    /* every member after name and x_size is a function pointer */
    const char *p = (const char *)b + offsetof(struct backend, alloc);
    const char *end = (const char *)b + sizeof *b;
    for (int i = 0; p < end; p += sizeof(void (*)(void)), i++) {
        void (*fn)(void);
        memcpy(&fn, p, sizeof fn);
        cr_expect_not_null(fn, "backend_cpu() leaves function slot %d NULL", i);
    }
}

Test(cpu_ops, memory_and_elementwise)
{
    const struct backend *b = backend_cpu();
    mt_rng rng;
    mt_rng_seed(&rng, 11);
    const size_t n = 37;
    float *x = frand(&rng, n, 1.0), *y = frand(&rng, n, 1.0);
    float *d = b->alloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) cr_expect(isnan(d[i]), "fresh buffers are NaN-filled");
    b->upload(d, x, n * sizeof(float));
    b->add_inplace(d, y, n);
    float *h = fnew(n);
    b->download(h, d, n * sizeof(float));
    for (size_t i = 0; i < n; i++) cr_expect_eq(h[i], x[i] + y[i]);
    b->scale_f32(h, n, 0.5f);
    double ss = 0.0;
    for (size_t i = 0; i < n; i++) {
        cr_expect_eq(h[i], (x[i] + y[i]) * 0.5f);
        ss += (double)h[i] * h[i];
    }
    cr_expect(fabs(b->sumsq_f32(h, n) - ss) <= 1e-12 * ss);
    b->cast_x_to_f32(h, x, n);
    cr_expect(memcmp(h, x, n * sizeof(float)) == 0);
    b->zero(d, n * sizeof(float));
    for (size_t i = 0; i < n; i++) cr_expect_eq(d[i], 0.0f);
    b->copy(d, y, n * sizeof(float));
    cr_expect(memcmp(d, y, n * sizeof(float)) == 0);
    b->sync();
    b->free(d);
    free(x);
    free(y);
    free(h);
}

/* ---------------------------------------------------------------- embedding */

struct emb_ctx {
    const int32_t *ids;
    float *wte, *r, *out;
    int T, H;
};

static double emb_loss(void *p)
{
    struct emb_ctx *c = p;
    cpu_embedding_forward(c->out, c->ids, c->wte, c->T, c->H);
    return project(c->r, c->out, (size_t)c->T * c->H);
}

Test(cpu_ops, embedding_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 1);
    enum { V = 7, H = 5, T = 9 };
    const int32_t ids[T] = {3, 0, 3, 6, 1, 3, 0, 5, 2}; /* repeats must accumulate */
    struct emb_ctx c = {ids, frand(&rng, V * H, 1.0), frand(&rng, T * H, 1.0), fnew(T * H), T, H};
    /* forward is a plain row copy */
    emb_loss(&c);
    for (int t = 0; t < T; t++)
        cr_expect(memcmp(c.out + t * H, c.wte + ids[t] * H, H * sizeof(float)) == 0);
    float *dw0 = frand(&rng, V * H, 1.0), *dw = fdup(dw0, V * H);
    cpu_embedding_backward(dw, c.r, ids, T, H);
    float *g = added(dw, dw0, V * H);
    double *fd = dnew(V * H);
    fd_grad(fd, c.wte, V * H, emb_loss, &c);
    expect_grad("embedding dwte", g, fd, V * H);
    /* dw += twice doubles what one call adds */
    float *z = fnew(V * H), *z2 = fnew(V * H);
    cpu_embedding_backward(z, c.r, ids, T, H);
    cpu_embedding_backward(z2, c.r, ids, T, H);
    cpu_embedding_backward(z2, c.r, ids, T, H);
    expect_doubled("embedding", z2, z, V * H);
    free(c.wte), free(c.r), free(c.out), free(dw0), free(dw), free(g), free(fd), free(z), free(z2);
}

/* ---------------------------------------------------------------- rmsnorm */

struct rms_ctx {
    float *in, *w, *r, *out, *rstd;
    int N, C;
    float eps;
};

static double rms_loss(void *p)
{
    struct rms_ctx *c = p;
    cpu_rmsnorm_forward(c->out, c->rstd, c->in, c->w, c->N, c->C, c->eps);
    return project(c->r, c->out, (size_t)c->N * c->C);
}

Test(cpu_ops, rmsnorm_forward_matches_formula)
{
    mt_rng rng;
    mt_rng_seed(&rng, 2);
    enum { N = 4, C = 19 };
    const float eps = 1e-6f;
    float *x = frand(&rng, N * C, 1.5), *w = frand(&rng, C, 1.0), *ones = fnew(C);
    float *y = fnew(N * C), *rstd = fnew(N);
    for (int i = 0; i < C; i++) ones[i] = 1.0f;
    /* with w = 1 the output's mean square is ms/(ms + eps) */
    cpu_rmsnorm_forward(y, rstd, x, ones, N, C, eps);
    for (int n = 0; n < N; n++) {
        double ms = 0.0, msy = 0.0;
        for (int i = 0; i < C; i++) {
            ms += (double)x[n * C + i] * x[n * C + i] / C;
            msy += (double)y[n * C + i] * y[n * C + i] / C;
        }
        cr_expect(fabs(msy - ms / (ms + eps)) < 1e-6, "row %d: mean square %.9g", n, msy);
        cr_expect(fabs(rstd[n] - 1.0 / sqrt(ms + eps)) < 1e-6 / sqrt(ms));
    }
    /* general weight: y = w · x / sqrt(ms + eps) */
    cpu_rmsnorm_forward(y, rstd, x, w, N, C, eps);
    for (int n = 0; n < N; n++) {
        double ms = 0.0;
        for (int i = 0; i < C; i++) ms += (double)x[n * C + i] * x[n * C + i] / C;
        for (int i = 0; i < C; i++) {
            double ref = w[i] * x[n * C + i] / sqrt(ms + eps);
            cr_expect(fabs(y[n * C + i] - ref) <= 1e-6 * (fabs(ref) + 1e-3), "row %d col %d", n, i);
        }
    }
    free(x), free(w), free(ones), free(y), free(rstd);
}

Test(cpu_ops, rmsnorm_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 3);
    enum { N = 5, C = 11 };
    struct rms_ctx c = {frand(&rng, N * C, 1.0), frand(&rng, C, 1.0), frand(&rng, N * C, 1.0),
                        fnew(N * C), fnew(N), N, C, 1e-6f};
    rms_loss(&c);
    float *din = fnew(N * C), *dw0 = frand(&rng, C, 1.0), *dw = fdup(dw0, C);
    cpu_rmsnorm_backward(din, dw, c.r, c.in, c.w, c.rstd, N, C, false);
    float *gw = added(dw, dw0, C);
    double *fdx = dnew(N * C), *fdw = dnew(C);
    fd_grad(fdx, c.in, N * C, rms_loss, &c);
    fd_grad(fdw, c.w, C, rms_loss, &c);
    expect_grad("rmsnorm din", din, fdx, N * C);
    expect_grad("rmsnorm dw", gw, fdw, C);

    /* accumulate = true adds onto din; dw += twice doubles it */
    rms_loss(&c);
    float *prior = frand(&rng, N * C, 1.0), *din2 = fdup(prior, N * C);
    float *z = fnew(C), *z2 = fnew(C);
    cpu_rmsnorm_backward(din2, z, c.r, c.in, c.w, c.rstd, N, C, true);
    cpu_rmsnorm_backward(din, z2, c.r, c.in, c.w, c.rstd, N, C, false);
    cpu_rmsnorm_backward(NULL, z2, c.r, c.in, c.w, c.rstd, N, C, false);
    for (int i = 0; i < N * C; i++) cr_expect_eq(din2[i], prior[i] + din[i]);
    expect_doubled("rmsnorm", z2, z, C);
    free(c.in), free(c.w), free(c.r), free(c.out), free(c.rstd), free(din), free(dw0), free(dw);
    free(gw), free(fdx), free(fdw), free(prior), free(din2), free(z), free(z2);
}

/* ---------------------------------------------------------------- matmul */

struct mm_ctx {
    float *in, *w, *r, *out;
    int N, I, O;
};

static double mm_loss(void *p)
{
    struct mm_ctx *c = p;
    cpu_matmul_forward(c->out, c->in, c->w, c->N, c->I, c->O);
    return project(c->r, c->out, (size_t)c->N * c->O);
}

Test(cpu_ops, matmul_forward_matches_double)
{
    mt_rng rng;
    mt_rng_seed(&rng, 4);
    /* shapes that hit the 8-wide body, the scalar tail and a partial 4-row block */
    const int shapes[][3] = {{1, 1, 1}, {7, 13, 5}, {9, 40, 6}, {6, 64, 33}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int N = shapes[s][0], I = shapes[s][1], O = shapes[s][2];
        float *x = frand(&rng, (size_t)N * I, 1.0), *w = frand(&rng, (size_t)O * I, 1.0);
        float *y = fnew((size_t)N * O);
        cpu_matmul_forward(y, x, w, N, I, O);
        for (int n = 0; n < N; n++)
            for (int o = 0; o < O; o++) {
                double ref = 0.0, mag = 0.0;
                for (int i = 0; i < I; i++) {
                    ref += (double)x[n * I + i] * w[o * I + i];
                    mag += fabs((double)x[n * I + i] * w[o * I + i]);
                }
                /* float summation: error ≤ ~I·2⁻²⁴·Σ|terms|; 1e-6·Σ|terms| is ample for I ≤ 64 */
                cr_expect(fabs(y[n * O + o] - ref) <= 1e-6 * mag, "N=%d I=%d O=%d at (%d,%d)", N, I,
                          O, n, o);
            }
        /* a row's result does not depend on the rows batched with it (micro-batch invariance) */
        if (N > 1) {
            float *part = fnew((size_t)(N - 1) * O);
            cpu_matmul_forward(part, x + I, w, N - 1, I, O);
            cr_expect(memcmp(part, y + O, (size_t)(N - 1) * O * sizeof(float)) == 0,
                      "N=%d: rows computed in another blocking differ", N);
            free(part);
        }
        free(x), free(w), free(y);
    }
}

Test(cpu_ops, matmul_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 5);
    const int shapes[][3] = {{7, 13, 5}, {5, 17, 9}};
    for (size_t s = 0; s < 2; s++) {
        const int N = shapes[s][0], I = shapes[s][1], O = shapes[s][2];
        struct mm_ctx c = {frand(&rng, N * I, 1.0), frand(&rng, O * I, 1.0),
                           frand(&rng, N * O, 1.0), fnew(N * O), N, I, O};
        float *din = fnew(N * I), *dw0 = frand(&rng, O * I, 1.0), *dw = fdup(dw0, O * I);
        cpu_matmul_backward(din, dw, c.r, c.in, c.w, N, I, O, false);
        float *gw = added(dw, dw0, O * I);
        double *fdx = dnew(N * I), *fdw = dnew(O * I);
        fd_grad(fdx, c.in, N * I, mm_loss, &c);
        fd_grad(fdw, c.w, O * I, mm_loss, &c);
        expect_grad("matmul din", din, fdx, N * I);
        expect_grad("matmul dw", gw, fdw, O * I);

        /* accumulate adds onto din; dw += twice doubles; NULL skips; N = 0 leaves dw untouched */
        float *prior = frand(&rng, N * I, 1.0), *din2 = fdup(prior, N * I);
        float *z = fnew(O * I), *z2 = fnew(O * I);
        cpu_matmul_backward(din2, NULL, c.r, c.in, c.w, N, I, O, true);
        for (int i = 0; i < N * I; i++) cr_expect_eq(din2[i], prior[i] + din[i]);
        cpu_matmul_backward(NULL, z, c.r, c.in, c.w, N, I, O, false);
        cpu_matmul_backward(NULL, z2, c.r, c.in, c.w, N, I, O, false);
        cpu_matmul_backward(NULL, z2, c.r, c.in, c.w, N, I, O, false);
        for (int i = 0; i < O * I; i++) cr_expect_eq(z2[i], 2.0f * z[i]);
        memcpy(z, dw0, O * I * sizeof(float));
        z[0] = -0.0f;
        memcpy(z2, z, O * I * sizeof(float));
        cpu_matmul_backward(NULL, z2, c.r, c.in, c.w, 0, I, O, false);
        cr_expect(memcmp(z, z2, O * I * sizeof(float)) == 0, "N = 0 must not touch dw");
        free(c.in), free(c.w), free(c.r), free(c.out), free(din), free(dw0), free(dw), free(gw);
        free(fdx), free(fdw), free(prior), free(din2), free(z), free(z2);
    }
}

/* the backend's matmul2 ops are the two matmuls of ops.h, bit for bit */
Test(cpu_ops, matmul2_is_two_matmuls)
{
    const struct backend *be = backend_cpu();
    mt_rng rng;
    mt_rng_seed(&rng, 21);
    enum { N = 11, I = 19, O = 7 };
    float *in = frand(&rng, N * I, 1.0), *wa = frand(&rng, O * I, 1.0), *wb = frand(&rng, O * I, 1.0);
    float *ya = fnew(N * O), *yb = fnew(N * O), *ra = fnew(N * O), *rb = fnew(N * O);
    be->matmul2_forward(ya, yb, in, wa, wb, N, I, O);
    be->matmul_forward(ra, in, wa, N, I, O);
    be->matmul_forward(rb, in, wb, N, I, O);
    cr_expect(memcmp(ya, ra, sizeof(float) * N * O) == 0 && memcmp(yb, rb, sizeof(float) * N * O) == 0);

    float *da = frand(&rng, N * O, 1.0), *db = frand(&rng, N * O, 1.0), *din0 = frand(&rng, N * I, 1.0);
    float *dw0 = frand(&rng, O * I, 1.0);
    for (int acc = 0; acc < 2; acc++) {
        float *din = fdup(din0, N * I), *dwa = fdup(dw0, O * I), *dwb = fdup(dw0, O * I);
        float *rdin = fdup(din0, N * I), *rdwa = fdup(dw0, O * I), *rdwb = fdup(dw0, O * I);
        be->matmul2_backward(din, dwa, dwb, da, db, in, wa, wb, N, I, O, acc);
        be->matmul_backward(rdin, rdwa, da, in, wa, N, I, O, acc);
        be->matmul_backward(rdin, rdwb, db, in, wb, N, I, O, true);
        cr_expect(memcmp(din, rdin, sizeof(float) * N * I) == 0, "din, accumulate %d", acc);
        cr_expect(memcmp(dwa, rdwa, sizeof(float) * O * I) == 0, "dw a, accumulate %d", acc);
        cr_expect(memcmp(dwb, rdwb, sizeof(float) * O * I) == 0, "dw b, accumulate %d", acc);
        free(din), free(dwa), free(dwb), free(rdin), free(rdwa), free(rdwb);
    }
    /* NULL skips, as in matmul_backward */
    float *dwa = fdup(dw0, O * I), *rdwa = fdup(dw0, O * I);
    be->matmul2_backward(NULL, dwa, NULL, da, db, in, wa, wb, N, I, O, false);
    be->matmul_backward(NULL, rdwa, da, in, wa, N, I, O, false);
    cr_expect(memcmp(dwa, rdwa, sizeof(float) * O * I) == 0, "dw a alone");
    free(in), free(wa), free(wb), free(ya), free(yb), free(ra), free(rb), free(da), free(db);
    free(din0), free(dw0), free(dwa), free(rdwa);
}

/* ---------------------------------------------------------------- rope */

struct rope_ctx {
    float *in, *r, *out;
    const int32_t *pos;
    int T, nh, D;
    float theta;
};

static double rope_loss(void *p)
{
    struct rope_ctx *c = p;
    cpu_rope_forward(c->out, c->in, c->pos, c->T, c->nh, c->D, c->theta);
    return project(c->r, c->out, (size_t)c->T * c->nh * c->D);
}

Test(cpu_ops, rope_forward_properties)
{
    mt_rng rng;
    mt_rng_seed(&rng, 6);
    enum { T = 4, NH = 3, D = 16 };
    const int32_t pos[T] = {0, 1, 7, 50};
    const float theta = 10000.0f;
    float *x = frand(&rng, T * NH * D, 1.0), *y = fnew(T * NH * D);
    cpu_rope_forward(y, x, pos, T, NH, D, theta);
    float inv[D / 2];
    cpu_rope_inv_freq(inv, D, theta);
    for (int i = 0; i < D / 2; i++) {
        double ref = pow(theta, -2.0 * i / D);
        cr_expect(fabs(inv[i] - ref) <= 1e-6 * ref, "inv_freq[%d] = %.9g, want %.9g", i, inv[i], ref);
    }
    /* position 0 is the identity */
    cr_expect(memcmp(y, x, NH * D * sizeof(float)) == 0, "rope at position 0 must be the identity");
    for (int t = 0; t < T; t++)
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < D / 2; i++) {
                const float *xv = x + (t * NH + h) * D, *yv = y + (t * NH + h) * D;
                double a = xv[i], b = xv[i + D / 2];
                /* each (i, i + D/2) pair is rotated by pos·inv_freq: norm preserved, angle moved */
                double nx = hypot(a, b), ny = hypot(yv[i], yv[i + D / 2]);
                cr_expect(fabs(nx - ny) <= 1e-6 * nx, "t=%d h=%d pair %d: norm %.9g -> %.9g", t, h, i,
                          nx, ny);
                double ang = (double)pos[t] * pow(theta, -2.0 * i / D);
                double ra = a * cos(ang) - b * sin(ang), rb = b * cos(ang) + a * sin(ang);
                /* fp32 angle pos·inv_freq is off by up to ~ulp(50) ≈ 4e-6 rad */
                cr_expect(fabs(yv[i] - ra) <= 2e-5 * nx && fabs(yv[i + D / 2] - rb) <= 2e-5 * nx,
                          "t=%d h=%d pair %d rotated wrongly", t, h, i);
            }
    /* in place gives the same result */
    float *z = fdup(x, T * NH * D);
    cpu_rope_forward(z, z, pos, T, NH, D, theta);
    cr_expect(memcmp(z, y, T * NH * D * sizeof(float)) == 0);
    free(x), free(y), free(z);
}

Test(cpu_ops, rope_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 7);
    enum { T = 3, NH = 2, D = 8 };
    const int32_t pos[T] = {5, 0, 12};
    struct rope_ctx c = {frand(&rng, T * NH * D, 1.0), frand(&rng, T * NH * D, 1.0),
                         fnew(T * NH * D), pos, T, NH, D, 1e6f};
    float *din = fnew(T * NH * D);
    cpu_rope_backward(din, c.r, pos, T, NH, D, c.theta);
    double *fd = dnew(T * NH * D);
    fd_grad(fd, c.in, T * NH * D, rope_loss, &c);
    expect_grad("rope din", din, fd, T * NH * D);
    float *z = fdup(c.r, T * NH * D);
    cpu_rope_backward(z, z, pos, T, NH, D, c.theta);
    cr_expect(memcmp(z, din, T * NH * D * sizeof(float)) == 0, "in-place rope backward differs");
    free(c.in), free(c.r), free(c.out), free(din), free(fd), free(z);
}

/* rmsnorm_rope_forward/_backward are rmsnorm then rope, rope backward then rmsnorm backward, to the
 * bit (dw added onto what it held; out = in and din = dout in place) */
static void rmsnorm_rope_case(mt_rng *rng, int T, int nh, int D)
{
    const struct backend *b = backend_cpu();
    const size_t n = (size_t)T * nh * D, N = (size_t)T * nh;
    const float eps = 1e-6f, theta = 1e6f;
    int32_t *pos = mt_malloc((size_t)T * sizeof *pos);
    for (int t = 0; t < T; t++) pos[t] = (int32_t)(mt_rng_uniform(rng) * 4096);
    float *in = frand(rng, n, 2.0), *w = frand(rng, D, 1.0), *dout = frand(rng, n, 1.0);
    float *dw0 = frand(rng, D, 1.0);

    float *out = fnew(n), *rstd = fnew(N), *ref = fnew(n), *rstd_ref = fnew(N);
    b->rmsnorm_rope_forward(out, rstd, in, w, pos, T, nh, D, eps, theta);
    b->rmsnorm_forward(ref, rstd_ref, in, w, (int)N, D, eps);
    b->rope_forward(ref, ref, pos, T, nh, D, theta);
    cr_expect(memcmp(out, ref, n * sizeof(float)) == 0, "T%d nh%d D%d: forward out", T, nh, D);
    cr_expect(memcmp(rstd, rstd_ref, N * sizeof(float)) == 0, "T%d nh%d D%d: rstd", T, nh, D);
    float *inplace = fdup(in, n);
    b->rmsnorm_rope_forward(inplace, rstd, inplace, w, pos, T, nh, D, eps, theta);
    cr_expect(memcmp(inplace, ref, n * sizeof(float)) == 0, "T%d nh%d D%d: forward in place", T,
              nh, D);

    float *din = fnew(n), *dw = fdup(dw0, D), *din_ref = fnew(n), *dw_ref = fdup(dw0, D);
    b->rmsnorm_rope_backward(din, dw, dout, in, w, rstd, pos, T, nh, D, theta);
    b->rope_backward(din_ref, dout, pos, T, nh, D, theta);
    b->rmsnorm_backward(din_ref, dw_ref, din_ref, in, w, rstd, (int)N, D, false);
    cr_expect(memcmp(din, din_ref, n * sizeof(float)) == 0, "T%d nh%d D%d: din", T, nh, D);
    cr_expect(memcmp(dw, dw_ref, D * sizeof(float)) == 0, "T%d nh%d D%d: dw", T, nh, D);
    float *dio = fdup(dout, n), *dw2 = fdup(dw0, D);
    b->rmsnorm_rope_backward(dio, dw2, dio, in, w, rstd, pos, T, nh, D, theta);
    cr_expect(memcmp(dio, din_ref, n * sizeof(float)) == 0, "T%d nh%d D%d: din = dout", T, nh, D);
    cr_expect(memcmp(dw2, dw_ref, D * sizeof(float)) == 0, "T%d nh%d D%d: dw (din = dout)", T, nh,
              D);

    float *bufs[] = {in, w, dout, dw0, out, rstd, ref, rstd_ref, inplace, din, dw, din_ref, dw_ref,
                     dio, dw2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(pos);
}

Test(cpu_ops, rmsnorm_rope_is_rmsnorm_then_rope)
{
    mt_rng rng;
    mt_rng_seed(&rng, 8);
    rmsnorm_rope_case(&rng, 9, 32, 128);
    rmsnorm_rope_case(&rng, 5, 4, 64);
    rmsnorm_rope_case(&rng, 3, 2, 8);
}

/* ---------------------------------------------------------------- attention */

enum { AB = 2, AS = 5, AHQ = 4, AHKV = 2, AD = 8 };
#define AQN (AB * AS * AHQ * AD)
#define AKN (AB * AS * AHKV * AD)

struct attn_ctx {
    float *q, *k, *v, *r, *out, *lse;
    const int32_t *seg;   /* [AB, AS] document ids or NULL */
};

static double attn_loss(void *p)
{
    struct attn_ctx *c = p;
    cpu_attention_forward(c->out, c->lse, c->q, c->k, c->v, AB, AS, AHQ, AHKV, AD, c->seg);
    return project(c->r, c->out, AQN);
}

Test(cpu_ops, attention_forward_matches_double)
{
    mt_rng rng;
    mt_rng_seed(&rng, 8);
    struct attn_ctx c = {frand(&rng, AQN, 1.0), frand(&rng, AKN, 1.0), frand(&rng, AKN, 1.0),
                         frand(&rng, AQN, 1.0), fnew(AQN), fnew(AB * AHQ * AS), NULL};
    attn_loss(&c);
    const double scale = 1.0 / sqrt(AD);
    for (int b = 0; b < AB; b++)
        for (int h = 0; h < AHQ; h++) {
            const int hk = h / (AHQ / AHKV);
            /* row 0 sees only token 0: its output is exactly v of token 0 */
            cr_expect(memcmp(c.out + ((b * AS) * AHQ + h) * AD, c.v + ((b * AS) * AHKV + hk) * AD,
                             AD * sizeof(float)) == 0,
                      "b=%d h=%d: attention row 0 is not v[0]", b, h);
            for (int i = 0; i < AS; i++) {
                double s[AS], mx = -INFINITY, sum = 0.0;
                for (int j = 0; j <= i; j++) {
                    s[j] = 0.0;
                    for (int d = 0; d < AD; d++)
                        s[j] += (double)c.q[((b * AS + i) * AHQ + h) * AD + d] *
                                c.k[((b * AS + j) * AHKV + hk) * AD + d];
                    s[j] *= scale;
                    mx = fmax(mx, s[j]);
                }
                for (int j = 0; j <= i; j++) sum += exp(s[j] - mx);
                cr_expect(fabs(c.lse[(b * AHQ + h) * AS + i] - (mx + log(sum))) <= 1e-5,
                          "lse b=%d h=%d i=%d", b, h, i);
                for (int d = 0; d < AD; d++) {
                    double o = 0.0;
                    for (int j = 0; j <= i; j++)
                        o += exp(s[j] - mx) / sum * c.v[((b * AS + j) * AHKV + hk) * AD + d];
                    cr_expect(fabs(c.out[((b * AS + i) * AHQ + h) * AD + d] - o) <= 1e-5,
                              "out b=%d h=%d i=%d d=%d", b, h, i, d);
                }
            }
        }
    free(c.q), free(c.k), free(c.v), free(c.r), free(c.out), free(c.lse);
}

Test(cpu_ops, attention_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 9);
    struct attn_ctx c = {frand(&rng, AQN, 1.0), frand(&rng, AKN, 1.0), frand(&rng, AKN, 1.0),
                         frand(&rng, AQN, 1.0), fnew(AQN), fnew(AB * AHQ * AS), NULL};
    attn_loss(&c);
    float *dq = fnew(AQN), *dk = frand(&rng, AKN, 1.0), *dv = frand(&rng, AKN, 1.0);
    /* dk and dv are overwritten (not accumulated) even though they sum over query heads */
    cpu_attention_backward(dq, dk, dv, c.r, c.q, c.k, c.v, c.out, c.lse, AB, AS, AHQ, AHKV, AD, NULL);
    double *fdq = dnew(AQN), *fdk = dnew(AKN), *fdv = dnew(AKN);
    fd_grad(fdq, c.q, AQN, attn_loss, &c);
    fd_grad(fdk, c.k, AKN, attn_loss, &c);
    fd_grad(fdv, c.v, AKN, attn_loss, &c);
    expect_grad("attention dq", dq, fdq, AQN);
    expect_grad("attention dk", dk, fdk, AKN);
    expect_grad("attention dv", dv, fdv, AKN);
    free(c.q), free(c.k), free(c.v), free(c.r), free(c.out), free(c.lse), free(dq), free(dk);
    free(dv), free(fdq), free(fdk), free(fdv);
}

/* Document masking: finite-difference gradients with documents of 2 and 3 tokens (row 0) and of 1,
 * 3 and 1 tokens (row 1, ids not in order). */
static const int32_t attn_seg[AB * AS] = {0, 0, 1, 1, 1, 3, 4, 4, 4, 7};

Test(cpu_ops, attention_seg_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 19);
    struct attn_ctx c = {frand(&rng, AQN, 1.0), frand(&rng, AKN, 1.0), frand(&rng, AKN, 1.0),
                         frand(&rng, AQN, 1.0), fnew(AQN), fnew(AB * AHQ * AS), attn_seg};
    attn_loss(&c);
    float *dq = fnew(AQN), *dk = fnew(AKN), *dv = fnew(AKN);
    cpu_attention_backward(dq, dk, dv, c.r, c.q, c.k, c.v, c.out, c.lse, AB, AS, AHQ, AHKV, AD,
                           attn_seg);
    double *fdq = dnew(AQN), *fdk = dnew(AKN), *fdv = dnew(AKN);
    fd_grad(fdq, c.q, AQN, attn_loss, &c);
    fd_grad(fdk, c.k, AKN, attn_loss, &c);
    fd_grad(fdv, c.v, AKN, attn_loss, &c);
    expect_grad("seg attention dq", dq, fdq, AQN);
    expect_grad("seg attention dk", dk, fdk, AKN);
    expect_grad("seg attention dv", dv, fdv, AKN);
    free(c.q), free(c.k), free(c.v), free(c.r), free(c.out), free(c.lse), free(dq), free(dk);
    free(dv), free(fdq), free(fdk), free(fdv);
}

/* A document inside a packed row attends exactly as if it were a sequence of its own: the second
 * document of row 0 (tokens 2..4) against a B=1, S=3 run of the same q, k, v. */
Test(cpu_ops, attention_seg_matches_separate_document)
{
    mt_rng rng;
    mt_rng_seed(&rng, 20);
    float *q = frand(&rng, AQN, 1.0), *k = frand(&rng, AKN, 1.0), *v = frand(&rng, AKN, 1.0);
    float *out = fnew(AQN), *lse = fnew(AB * AHQ * AS);
    cpu_attention_forward(out, lse, q, k, v, AB, AS, AHQ, AHKV, AD, attn_seg);
    enum { S3 = 3 };
    float *out3 = fnew(S3 * AHQ * AD), *lse3 = fnew(AHQ * S3);
    cpu_attention_forward(out3, lse3, q + 2 * AHQ * AD, k + 2 * AHKV * AD, v + 2 * AHKV * AD, 1, S3,
                          AHQ, AHKV, AD, NULL);
    cr_expect(memcmp(out + 2 * AHQ * AD, out3, sizeof(float) * S3 * AHQ * AD) == 0,
              "document 2 of a packed row differs from the same tokens run alone");
    for (int h = 0; h < AHQ; h++)
        for (int i = 0; i < S3; i++)
            cr_expect(lse[h * AS + 2 + i] == lse3[h * S3 + i], "lse h=%d i=%d", h, i);
    /* and a masked run differs from the unmasked one (the mask is not a no-op) */
    float *out_c = fnew(AQN);
    cpu_attention_forward(out_c, lse, q, k, v, AB, AS, AHQ, AHKV, AD, NULL);
    cr_expect(memcmp(out + 2 * AHQ * AD, out_c + 2 * AHQ * AD, sizeof(float) * AHQ * AD) != 0);
    free(q), free(k), free(v), free(out), free(lse), free(out3), free(lse3), free(out_c);
}

/* ---------------------------------------------------------------- router */

enum { RT = 4, RE = 8, RK = 3 };

struct router_ctx {
    float *logits, *bias, *c, *aux, *probs, *w;
    int32_t *idx, *idx0;
    struct router_opts o;
    bool flipped;
};

static struct router_opts qwen_opts(bool norm)
{
    return (struct router_opts){.norm_topk = norm, .route_scale = 1.0f, .n_group = 1, .topk_group = 1};
}

/* L = Σ c ⊙ topk_w + Σ_{t,e} aux[e]·probs[t,e], whose dL/dprobs has the aux_dp form */
static double router_loss(void *p)
{
    struct router_ctx *c = p;
    cpu_router_forward(c->idx, c->w, c->probs, c->logits, c->bias, RT, RE, RK, &c->o);
    if (memcmp(c->idx, c->idx0, sizeof(int32_t) * RT * RK) != 0) c->flipped = true;
    double l = project(c->c, c->w, RT * RK);
    for (int t = 0; t < RT; t++) l += project(c->aux, c->probs + t * RE, RE);
    return l;
}

/* Logits on a grid 0.7 apart (plus small noise), shuffled per row, so that the perturbations of
 * the finite differences never change the top-k. */
static float *separated_logits(mt_rng *rng)
{
    float *z = fnew(RT * RE);
    for (int t = 0; t < RT; t++) {
        int perm[RE];
        for (int e = 0; e < RE; e++) perm[e] = e;
        for (int e = RE - 1; e > 0; e--) {
            int j = (int)(mt_rng_uniform(rng) * (e + 1));
            int tmp = perm[e];
            perm[e] = perm[j];
            perm[j] = tmp;
        }
        for (int e = 0; e < RE; e++)
            z[t * RE + e] = (float)(0.7 * perm[e] - 2.0 + 0.05 * mt_rng_normal(rng));
    }
    return z;
}

Test(cpu_ops, router_forward_properties)
{
    mt_rng rng;
    mt_rng_seed(&rng, 10);
    float *z = frand(&rng, RT * RE, 1.5), *probs = fnew(RT * RE), *w = fnew(RT * RK);
    int32_t idx[RT * RK];
    /* a tie in row 0 between experts 2 and 5, both the largest: the lower id must come first */
    z[2] = z[5] = 9.0f;
    for (int pass = 0; pass < 3; pass++) {
        const bool norm = pass != 1;
        float *bias = pass == 2 ? frand(&rng, RE, 0.2) : NULL;
        const struct router_opts opts = qwen_opts(norm);
        cpu_router_forward(idx, w, probs, z, bias, RT, RE, RK, &opts);
        for (int t = 0; t < RT; t++) {
            const float *p = probs + t * RE;
            double sum = 0.0, mx = -INFINITY, zsum = 0.0;
            for (int e = 0; e < RE; e++) mx = fmax(mx, z[t * RE + e]);
            for (int e = 0; e < RE; e++) zsum += exp(z[t * RE + e] - mx);
            for (int e = 0; e < RE; e++) {
                sum += p[e];
                cr_expect(fabs(p[e] - exp(z[t * RE + e] - mx) / zsum) <= 1e-6, "softmax t=%d", t);
            }
            cr_expect(fabs(sum - 1.0) <= 1e-6, "probs row %d sums to %.9g", t, sum);
            double wsum = 0.0, psel = 0.0;
            for (int j = 0; j < RK; j++) psel += p[idx[t * RK + j]];
            for (int j = 0; j < RK; j++) {
                const int e = idx[t * RK + j];
                double score = p[e] + (bias ? bias[e] : 0.0);
                /* chosen scores descend; ties go to the lower id */
                if (j > 0) {
                    const int ep = idx[t * RK + j - 1];
                    double sp = p[ep] + (bias ? bias[ep] : 0.0);
                    cr_expect(sp > score || (sp == score && ep < e), "t=%d: top-k not sorted", t);
                }
                /* every unchosen expert scores no higher than the last chosen one */
                for (int o = 0; o < RE; o++) {
                    bool chosen = false;
                    for (int jj = 0; jj < RK; jj++) chosen |= idx[t * RK + jj] == o;
                    if (!chosen) cr_expect((double)p[o] + (bias ? bias[o] : 0.0) <= score);
                }
                /* weights are the unbiased probabilities (renormalised over the selection) */
                double want = norm ? p[e] / psel : p[e];
                cr_expect(fabs(w[t * RK + j] - want) <= 1e-6 * want, "t=%d j=%d weight", t, j);
                wsum += w[t * RK + j];
            }
            if (norm) cr_expect(fabs(wsum - 1.0) <= 1e-6, "row %d weights sum to %.9g", t, wsum);
        }
        if (!bias) cr_expect(idx[0] == 2 && idx[1] == 5, "tie: got %d %d", idx[0], idx[1]);
        free(bias);
    }

    /* stats accumulate Σ_t probs and the selection counts */
    float psum[RE], count[RE], psum0[RE], count0[RE];
    for (int e = 0; e < RE; e++) psum0[e] = psum[e] = (float)e, count0[e] = count[e] = 2.0f * e;
    cpu_router_stats(psum, count, probs, idx, RT, RE, RK);
    for (int e = 0; e < RE; e++) {
        double ps = psum0[e];
        int n = 0;
        for (int t = 0; t < RT; t++) ps += probs[t * RE + e];
        for (int j = 0; j < RT * RK; j++) n += idx[j] == e;
        cr_expect(fabs(psum[e] - ps) <= 1e-5, "psum[%d]", e);
        cr_expect_eq(count[e], count0[e] + n, "count[%d]", e);
    }
    free(z), free(probs), free(w);
}

Test(cpu_ops, router_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 12);
    /* passes 4-7: the routing variants (sigmoid scores, route_scale, group-limited top-k) */
    for (int pass = 0; pass < 8; pass++) {
        struct router_ctx c = {separated_logits(&rng), NULL, frand(&rng, RT * RK, 1.0),
                               pass & 2 ? frand(&rng, RE, 1.0) : NULL, fnew(RT * RE),
                               fnew(RT * RK), mt_calloc(RT * RK, sizeof(int32_t)),
                               mt_calloc(RT * RK, sizeof(int32_t)), qwen_opts(pass & 1), false};
        /* a bias that reorders the selection (one step of the logit grid is ×2 in probability) */
        if (pass == 3 || pass == 7) c.bias = frand(&rng, RE, 0.05);
        if (pass >= 4) {
            c.o.sigmoid = pass != 6;
            c.o.route_scale = 2.5f;
            c.o.n_group = pass >= 6 ? 4 : 1;
            c.o.topk_group = pass >= 6 ? 2 : 1;
        }
        float *zero_aux = fnew(RE);
        if (!c.aux) c.aux = zero_aux;
        cpu_router_forward(c.idx0, c.w, c.probs, c.logits, c.bias, RT, RE, RK, &c.o);
        router_loss(&c);
        float *dz = fnew(RT * RE);
        cpu_router_backward(dz, c.c, c.probs, c.idx0, c.aux == zero_aux ? NULL : c.aux, RT, RE, RK,
                            &c.o);
        double *fd = dnew(RT * RE);
        fd_grad(fd, c.logits, RT * RE, router_loss, &c);
        cr_assert(!c.flipped, "pass %d: a finite-difference step changed the top-k selection", pass);
        char what[128];
        snprintf(what, sizeof what, "router dlogits (norm_topk %d, aux %d, bias %d, sigmoid %d, "
                 "scale %g, groups %d/%d)", c.o.norm_topk, c.aux != zero_aux, c.bias != NULL,
                 c.o.sigmoid, c.o.route_scale, c.o.topk_group, c.o.n_group);
        expect_grad(what, dz, fd, RT * RE);
        if (c.aux != zero_aux) free(c.aux);
        free(c.logits), free(c.bias), free(c.c), free(c.probs), free(c.w), free(c.idx);
        free(c.idx0), free(zero_aux), free(dz), free(fd);
    }
}

/* ---------------------------------------------------------------- gather and combine */

struct gather_ctx {
    float *in, *r, *out;
    const int32_t *idx;
    int R, H;
};

static double gather_loss(void *p)
{
    struct gather_ctx *c = p;
    cpu_gather_rows(c->out, c->in, c->idx, c->R, c->H);
    return project(c->r, c->out, (size_t)c->R * c->H);
}

Test(cpu_ops, gather_rows_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 13);
    enum { ROWS = 6, R = 8, H = 5 };
    const int32_t idx[R] = {4, 0, 4, 2, 5, 1, 4, 0};
    struct gather_ctx c = {frand(&rng, ROWS * H, 1.0), frand(&rng, R * H, 1.0), fnew(R * H), idx,
                           R, H};
    gather_loss(&c);
    for (int r = 0; r < R; r++)
        cr_expect(memcmp(c.out + r * H, c.in + idx[r] * H, H * sizeof(float)) == 0);
    float *d0 = frand(&rng, ROWS * H, 1.0), *d = fdup(d0, ROWS * H);
    cpu_gather_rows_backward(d, c.r, idx, R, H);
    float *g = added(d, d0, ROWS * H);
    double *fd = dnew(ROWS * H);
    fd_grad(fd, c.in, ROWS * H, gather_loss, &c);
    expect_grad("gather_rows din", g, fd, ROWS * H);
    /* rows are added in ascending r onto what din held */
    for (int row = 0; row < ROWS; row++)
        for (int h = 0; h < H; h++) {
            float want = d0[row * H + h];
            for (int r = 0; r < R; r++)
                if (idx[r] == row) want += c.r[r * H + h];
            cr_expect_eq(d[row * H + h], want);
        }
    free(c.in), free(c.r), free(c.out), free(d0), free(d), free(g), free(fd);
}

enum { CT = 4, CK = 3, CH = 10, CR = CT * CK + 2 }; /* two padding rows no token uses */

struct combine_ctx {
    float *y, *w, *r, *out;
    int32_t *slot;
};

static double combine_loss(void *p)
{
    struct combine_ctx *c = p;
    cpu_moe_combine_forward(c->out, c->y, c->slot, c->w, CT, CK, CH);
    return project(c->r, c->out, CT * CH);
}

Test(cpu_ops, moe_combine_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 14);
    int32_t slot[CT * CK];
    for (int i = 0; i < CT * CK; i++) slot[i] = (int32_t)((i * 5 + 3) % (CT * CK)); /* a shuffle */
    struct combine_ctx c = {frand(&rng, CR * CH, 1.0), frand(&rng, CT * CK, 1.0),
                            frand(&rng, CT * CH, 1.0), fnew(CT * CH), slot};
    combine_loss(&c);
    for (int t = 0; t < CT; t++)
        for (int h = 0; h < CH; h++) {
            double o = 0.0;
            for (int j = 0; j < CK; j++) o += (double)c.w[t * CK + j] * c.y[slot[t * CK + j] * CH + h];
            cr_expect(fabs(c.out[t * CH + h] - o) <= 1e-6 * (1.0 + fabs(o)));
        }
    float *dy = frand(&rng, CR * CH, 1.0), *dw = frand(&rng, CT * CK, 1.0);
    float *pad = fdup(dy + CT * CK * CH, 2 * CH);
    cpu_moe_combine_backward(dy, dw, c.r, c.y, slot, c.w, CT, CK, CH);
    double *fdy = dnew(CR * CH), *fdw = dnew(CT * CK);
    fd_grad(fdy, c.y, CT * CK * CH, combine_loss, &c); /* the used rows */
    fd_grad(fdw, c.w, CT * CK, combine_loss, &c);
    expect_grad("moe_combine dy", dy, fdy, CT * CK * CH);
    expect_grad("moe_combine dw", dw, fdw, CT * CK);
    cr_expect(memcmp(pad, dy + CT * CK * CH, 2 * CH * sizeof(float)) == 0,
              "rows no slot points at are left alone");
    free(c.y), free(c.w), free(c.r), free(c.out), free(dy), free(dw), free(pad), free(fdy);
    free(fdw);
}

/* ---------------------------------------------------------------- expert matmul */

enum { XE = 4, XI = 19, XO = 7 };
static const int64_t xoff[XE + 1] = {0, 3, 3, 8, 11}; /* expert 1 has no rows */
#define XR 11

struct expert_ctx {
    float *in, *w, *r, *out;
};

static double expert_loss(void *p)
{
    struct expert_ctx *c = p;
    cpu_expert_matmul_forward(c->out, c->in, c->w, xoff, XE, XI, XO);
    return project(c->r, c->out, XR * XO);
}

Test(cpu_ops, expert_matmul_equals_per_expert_matmul)
{
    mt_rng rng;
    mt_rng_seed(&rng, 15);
    float *x = frand(&rng, XR * XI, 1.0), *w = frand(&rng, XE * XO * XI, 1.0);
    float *y = fnew(XR * XO), *ref = fnew(XR * XO);
    cpu_expert_matmul_forward(y, x, w, xoff, XE, XI, XO);
    for (int e = 0; e < XE; e++)
        if (xoff[e + 1] > xoff[e])
            cpu_matmul_forward(ref + xoff[e] * XO, x + xoff[e] * XI, w + e * XO * XI,
                               (int)(xoff[e + 1] - xoff[e]), XI, XO);
    cr_expect(memcmp(y, ref, XR * XO * sizeof(float)) == 0);
    free(x), free(w), free(y), free(ref);
}

Test(cpu_ops, expert_matmul_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 16);
    struct expert_ctx c = {frand(&rng, XR * XI, 1.0), frand(&rng, XE * XO * XI, 1.0),
                           frand(&rng, XR * XO, 1.0), fnew(XR * XO)};
    float *din = frand(&rng, XR * XI, 1.0), *dw0 = frand(&rng, XE * XO * XI, 1.0);
    float *dw = fdup(dw0, XE * XO * XI);
    cpu_expert_matmul_backward(din, dw, c.r, c.in, c.w, xoff, XE, XI, XO);
    cr_expect(memcmp(dw + XO * XI, dw0 + XO * XI, XO * XI * sizeof(float)) == 0,
              "the expert with no rows must get nothing added");
    float *gw = added(dw, dw0, XE * XO * XI);
    double *fdx = dnew(XR * XI), *fdw = dnew(XE * XO * XI);
    fd_grad(fdx, c.in, XR * XI, expert_loss, &c);
    fd_grad(fdw, c.w, XE * XO * XI, expert_loss, &c);
    expect_grad("expert_matmul din", din, fdx, XR * XI);
    expect_grad("expert_matmul dw", gw, fdw, XE * XO * XI);
    free(c.in), free(c.w), free(c.r), free(c.out), free(din), free(dw0), free(dw), free(gw);
    free(fdx), free(fdw);
}

/* ---------------------------------------------------------------- swiglu */

struct swiglu_ctx {
    float *gu, *r, *out;
    int R, I;
};

static double swiglu_loss(void *p)
{
    struct swiglu_ctx *c = p;
    cpu_swiglu_forward(c->out, c->gu, c->R, c->I);
    return project(c->r, c->out, (size_t)c->R * c->I);
}

Test(cpu_ops, swiglu_forward_and_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 17);
    enum { R = 5, I = 7 };
    struct swiglu_ctx c = {frand(&rng, R * 2 * I, 2.0), frand(&rng, R * I, 1.0), fnew(R * I), R, I};
    swiglu_loss(&c);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < I; i++) {
            double g = c.gu[r * 2 * I + i], u = c.gu[r * 2 * I + I + i];
            double ref = g / (1.0 + exp(-g)) * u;
            cr_expect(fabs(c.out[r * I + i] - ref) <= 1e-6 * (fabs(ref) + 1e-6));
        }
    float *dgu = fnew(R * 2 * I);
    cpu_swiglu_backward(dgu, c.r, c.gu, R, I);
    double *fd = dnew(R * 2 * I);
    fd_grad(fd, c.gu, R * 2 * I, swiglu_loss, &c);
    expect_grad("swiglu dgu", dgu, fd, R * 2 * I);
    float *z = fdup(c.gu, R * 2 * I);
    cpu_swiglu_backward(z, c.r, z, R, I);
    cr_expect(memcmp(z, dgu, R * 2 * I * sizeof(float)) == 0, "in-place swiglu backward differs");
    free(c.gu), free(c.r), free(c.out), free(dgu), free(fd), free(z);
}

/* ---------------------------------------------------------------- cross-entropy */

enum { LN = 6, LV = 11 };
static const int32_t ltargets[LN] = {3, MT_IGNORE_INDEX, 0, 10, MT_IGNORE_INDEX, 3};
static const float lscale = 0.37f;

struct ce_ctx {
    float *z, *losses, *lse;
};

static double ce_loss(void *p)
{
    struct ce_ctx *c = p;
    cpu_cross_entropy_forward(c->losses, c->lse, c->z, ltargets, LN, LV);
    double l = 0.0;
    for (int n = 0; n < LN; n++) l += lscale * (double)c->losses[n];
    return l;
}

Test(cpu_ops, cross_entropy_forward_and_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 18);
    struct ce_ctx c = {frand(&rng, LN * LV, 2.0), fnew(LN), fnew(LN)};
    ce_loss(&c);
    for (int n = 0; n < LN; n++) {
        if (ltargets[n] == MT_IGNORE_INDEX) {
            cr_expect_eq(c.losses[n], 0.0f);
            continue;
        }
        double s = 0.0;
        for (int v = 0; v < LV; v++) s += exp((double)c.z[n * LV + v]);
        double ref = log(s) - c.z[n * LV + ltargets[n]];
        cr_expect(fabs(c.losses[n] - ref) <= 1e-6 * ref, "loss[%d] = %.9g want %.9g", n, c.losses[n],
                  ref);
    }
    float *dz = fnew(LN * LV);
    cpu_cross_entropy_backward(dz, c.z, c.lse, ltargets, LN, LV, lscale);
    double *fd = dnew(LN * LV);
    fd_grad(fd, c.z, LN * LV, ce_loss, &c);
    expect_grad("cross_entropy dlogits", dz, fd, LN * LV);
    for (int n = 0; n < LN; n++)
        if (ltargets[n] == MT_IGNORE_INDEX)
            for (int v = 0; v < LV; v++) cr_expect_eq(dz[n * LV + v], 0.0f, "ignored row %d", n);
    ce_loss(&c); /* the finite differences left the lse of a perturbed z behind */
    float *z = fdup(c.z, LN * LV);
    cpu_cross_entropy_backward(z, z, c.lse, ltargets, LN, LV, lscale);
    cr_expect(memcmp(z, dz, LN * LV * sizeof(float)) == 0, "in-place cross-entropy differs");
    free(c.z), free(c.losses), free(c.lse), free(dz), free(fd), free(z);
}

/* ---------------------------------------------------------------- adamw */

Test(cpu_ops, adamw_matches_scalar_formula)
{
    mt_rng rng;
    mt_rng_seed(&rng, 19);
    enum { N = 9 };
    const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
    for (int pass = 0; pass < 2; pass++) {
        const int t = pass == 0 ? 1 : 4;
        float *p = frand(&rng, N, 1.0), *g = frand(&rng, N, 1.0), *m = fnew(N), *v = fnew(N);
        if (t > 1)
            for (int i = 0; i < N; i++) {
                m[i] = (float)(0.1 * mt_rng_normal(&rng));
                v[i] = (float)(0.01 * mt_rng_uniform(&rng) + 1e-4);
            }
        float *p0 = fdup(p, N), *m0 = fdup(m, N), *v0 = fdup(v, N), *copy = fnew(N);
        /* pass 0: param is a separate buffer; pass 1: param aliases master */
        float *param = pass == 0 ? copy : p;
        cpu_adamw_update(p, param, g, m, v, N, lr, b1, b2, eps, wd, t, gs);
        for (int i = 0; i < N; i++) {
            double gg = (double)g[i] * gs;
            double mm = b1 * (double)m0[i] + (1.0 - b1) * gg;
            double vv = b2 * (double)v0[i] + (1.0 - b2) * gg * gg;
            double mhat = mm / (1.0 - pow(b1, t)), vhat = vv / (1.0 - pow(b2, t));
            double pp = (double)p0[i] * (1.0 - (double)lr * wd);
            pp -= lr * (mhat / (sqrt(vhat) + eps));
            /* float element maths: a few ulps of each quantity */
            cr_expect(fabs(m[i] - mm) <= 1e-6 * fabs(mm) + 1e-12, "m[%d] t=%d", i, t);
            cr_expect(fabs(v[i] - vv) <= 1e-6 * fabs(vv) + 1e-12, "v[%d] t=%d", i, t);
            cr_expect(fabs(p[i] - pp) <= 1e-6 * fabs(pp) + 1e-6 * lr, "p[%d] t=%d: %.9g want %.9g",
                      i, t, p[i], pp);
            cr_expect_eq(param[i], p[i], "param must equal master");
            cr_expect(fabs(p[i] - p0[i]) > 1e-5 * lr, "the step must move the parameter");
        }
        free(p), free(g), free(m), free(v), free(p0), free(m0), free(v0), free(copy);
    }
}

/* ---------------------------------------------------------------- route and pair plans */

/* T tokens, k distinct experts of E each in random order, weights naming their expert */
static void plan_routing(mt_rng *rng, int32_t *idx, float *w, int T, int E, int k)
{
    int32_t perm[64];
    for (int t = 0; t < T; t++) {
        for (int e = 0; e < E; e++) perm[e] = e;
        for (int j = 0; j < k; j++) {
            int p = j + (int)(mt_rng_next(rng) % (uint64_t)(E - j));
            int32_t x = perm[j]; perm[j] = perm[p]; perm[p] = x;
            idx[t * k + j] = perm[j];
            w[t * k + j] = (float)perm[j] + 0.5f;
        }
    }
}

/* The pair plan against its definition (ops.h): pairs by (rank, token), one per rank a token
 * uses; each choice's weight and local id where w_map says; the first choice per rank names the
 * pair. Then the receiver's route plan over the pairs' metadata, with its empty slots. */
/* the multi-segment op is adamw_update per segment, bit for bit; a zero-length segment and the
 * elements between segments stay untouched */
Test(cpu_ops, adamw_multi_is_per_segment)
{
    mt_rng rng;
    mt_rng_seed(&rng, 20);
    enum { N = 40, NSEG = 3 };
    const size_t off[NSEG] = {2, 10, 20}, len[NSEG] = {5, 0, 17};
    const float wd[NSEG] = {0.1f, 0.1f, 0.0f};
    float *p = frand(&rng, N, 1.0), *g = frand(&rng, N, 1.0), *m = frand(&rng, N, 0.1);
    float *v = frand(&rng, N, 0.01);
    for (int i = 0; i < N; i++) v[i] = fabsf(v[i]);
    float *p2 = fdup(p, N), *m2 = fdup(m, N), *v2 = fdup(v, N), *p0 = fdup(p, N);
    struct adamw_segment segs[NSEG];
    for (int j = 0; j < NSEG; j++) {
        segs[j] = (struct adamw_segment){p + off[j], p + off[j], g + off[j], m + off[j], v + off[j],
                                         len[j], wd[j]};
        cpu_adamw_update(p2 + off[j], p2 + off[j], g + off[j], m2 + off[j], v2 + off[j], len[j],
                         1e-3f, 0.9f, 0.95f, 1e-8f, wd[j], 2, 0.5f);
    }
    cpu_adamw_update_multi(segs, NSEG, sizeof(float), 1e-3f, 0.9f, 0.95f, 1e-8f, 2, 0.5f);
    cr_expect(memcmp(p, p2, sizeof(float) * N) == 0, "master differs from per-segment updates");
    cr_expect(memcmp(m, m2, sizeof(float) * N) == 0, "m differs");
    cr_expect(memcmp(v, v2, sizeof(float) * N) == 0, "v differs");
    cr_expect(p[0] == p0[0] && p[7] == p0[7] && p[12] == p0[12] && p[39] == p0[39],
              "elements outside the segments changed");
    cr_expect(p[3] != p0[3] && p[21] != p0[21], "the segments must move");
    free(p), free(g), free(m), free(v), free(p2), free(m2), free(v2), free(p0);
}

/* the same with bf16 moments (mom_bytes 2): adamw_update_m16 per segment, bit for bit */
Test(cpu_ops, adamw_multi_bf16_moments_is_per_segment)
{
    mt_rng rng;
    mt_rng_seed(&rng, 21);
    enum { N = 40, NSEG = 3 };
    const size_t off[NSEG] = {1, 9, 19}, len[NSEG] = {6, 0, 20};
    const float wd[NSEG] = {0.0f, 0.1f, 0.1f};
    float *p = frand(&rng, N, 1.0), *g = frand(&rng, N, 1.0), *mf = frand(&rng, N, 0.1);
    float *vf = frand(&rng, N, 0.01);
    uint16_t m[N], v[N], m2[N], v2[N];
    for (int i = 0; i < N; i++) {
        m[i] = m2[i] = st_f32_to_bf16(mf[i]);
        v[i] = v2[i] = st_f32_to_bf16(fabsf(vf[i]));
    }
    float *p2 = fdup(p, N), *p0 = fdup(p, N);
    struct adamw_segment segs[NSEG];
    for (int j = 0; j < NSEG; j++) {
        segs[j] = (struct adamw_segment){p + off[j], NULL, g + off[j], m + off[j], v + off[j],
                                         len[j], wd[j]};
        cpu_adamw_update_m16(p2 + off[j], NULL, g + off[j], m2 + off[j], v2 + off[j], len[j],
                             1e-3f, 0.9f, 0.95f, 1e-8f, wd[j], 3, 0.5f);
    }
    cpu_adamw_update_multi(segs, NSEG, 2, 1e-3f, 0.9f, 0.95f, 1e-8f, 3, 0.5f);
    cr_expect(memcmp(p, p2, sizeof(float) * N) == 0, "master differs from per-segment updates");
    cr_expect(memcmp(m, m2, sizeof m) == 0, "m differs");
    cr_expect(memcmp(v, v2, sizeof v) == 0, "v differs");
    cr_expect(p[0] == p0[0] && p[8] == p0[8] && p[39] == p0[39], "elements outside the segments changed");
    cr_expect(p[3] != p0[3] && p[25] != p0[25], "the segments must move");
    free(p), free(g), free(mf), free(vf), free(p2), free(p0);
}

Test(cpu_ops, pair_plan_and_route_plan_follow_their_definition)
{
    enum { T = 300, EP = 4, NL = 4, K = 6 };
    mt_rng rng;
    mt_rng_seed(&rng, 31);
    int32_t idx[T * K], pt[T * K], tp[T * K], wm[T * K], mi[T * K * K];
    float w[T * K], mw[T * K * K];
    int64_t cnt[EP];
    plan_routing(&rng, idx, w, T, EP * NL, K);
    cpu_moe_pair_plan(idx, w, pt, tp, mi, mw, wm, cnt, T, EP, NL, K);
    int64_t P = 0, want[EP] = {0};
    for (int t = 0; t < T; t++) {
        bool uses[EP] = {false};
        for (int j = 0; j < K; j++) {
            const int i = t * K + j, d = idx[i] / NL;
            if (j) cr_assert_lt(idx[i - 1], idx[i], "token %d not sorted", t);
            cr_expect_eq(w[i], (float)idx[i] + 0.5f, "weight did not travel with its expert");
            cr_expect_eq(mi[wm[i]], idx[i] - d * NL);
            cr_expect_eq(mw[wm[i]], w[i]);
            cr_expect_eq(pt[wm[i] / K], t);
            cr_expect_eq(tp[i], uses[d] ? -1 : wm[i] / K);
            uses[d] = true;
        }
        for (int d = 0; d < EP; d++) want[d] += uses[d];
    }
    for (int d = 0; d < EP; d++) {
        cr_expect_eq(cnt[d], want[d], "rank %d", d);
        P += cnt[d];
    }
    for (int64_t p = 1; p < P; p++) {
        /* (rank, token) order: the rank is that of the pair's first slot */
        int dp = pt[p - 1], dq = pt[p];
        int rp = -1, rq = -1;
        for (int j = 0; j < K; j++) {
            if (wm[dp * K + j] / K == p - 1) rp = idx[dp * K + j] / NL;
            if (wm[dq * K + j] / K == p) rq = idx[dq * K + j] / NL;
        }
        cr_expect(rp < rq || (rp == rq && dp < dq), "pairs %lld and %lld out of order", (long long)p - 1,
                  (long long)p);
    }
    for (int64_t p = 0; p < P; p++)
        for (int s = 1; s < K; s++)
            cr_expect(mi[p * K + s] > mi[p * K + s - 1] ||
                      (mi[p * K + s] == MT_NO_EXPERT && mi[p * K + s - 1] == MT_NO_EXPERT),
                      "pair %lld: slots not ascending, or a used slot after an empty one", (long long)p);

    /* the receiver's plan over these pairs (as if one rank received them all): rows by (local
     * expert, pair), none for empty slots */
    int32_t src[T * K * K], slot[T * K * K];
    int64_t off[NL + 1];
    cpu_moe_route_plan(mi, mw, src, slot, off, (int)P, NL, K);
    int64_t rows = 0;
    cr_expect_eq(off[0], 0);
    for (int e = 0; e < NL; e++) cr_expect_leq(off[e], off[e + 1], "offsets decrease at expert %d", e);
    for (int64_t p = 0; p < P; p++)
        for (int s = 0; s < K; s++) {
            if (mi[p * K + s] == MT_NO_EXPERT) {
                cr_expect_eq(slot[p * K + s], -1);
                continue;
            }
            rows++;
            const int r = slot[p * K + s], e = mi[p * K + s];
            cr_expect(r >= off[e] && r < off[e + 1], "slot row %d outside expert %d's rows", r, e);
            cr_expect_eq(src[r], (int32_t)p);
            if (r > off[e]) cr_expect_lt(src[r - 1], (int32_t)p);
        }
    cr_expect_eq(rows, off[NL]);
}
