/* Tests of the fp32 CPU backend (src/cpu/): every backward against central finite differences of
 * its own forward, and the forwards against independent double-precision restatements of the
 * maths (spec §3, §5).
 *
 * This file: the backend table, memory, embedding, RMSNorm, matmul, RoPE and attention;
 * test_cpu_moe_ops.c the router, the MoE row ops, expert matmul, SwiGLU, the loss and AdamW.
 *
 * The gradient check and its tolerance: cpu_grad_util.h. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "cpu/cpu_ops.h"
#include "cpu_grad_util.h"
#include "ops.h"

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
