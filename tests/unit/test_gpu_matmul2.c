/* GPU parity tests (suite "gpu") of matmul2_forward / matmul2_backward, two projections of one
 * input (attention's k and v) that the CUDA backend runs as one batched cuBLASLt GEMM: bit for bit
 * against the two matmul_forward / matmul_backward calls of ops.h on the same device buffers (the
 * algorithm a GEMM gets depends on its pointers' alignment, so the reference must use the very
 * same pointers), and against the fp32 CPU reference within the mode's tolerance, on fresh random
 * inputs in both CUDA modes. Method and tolerances: gpu_ops_util.h.
 *
 * The a and b tensors of each pair are placed as the batch sees them: separate allocations, views
 * of one buffer a then b (model weights and gradients), b then a (negative strides: the batch runs
 * in the other order), and weights a then b with outputs b then a (strides of both signs: the two
 * GEMMs one after the other). Every path must give the same bits.
 *
 * At the bench shape (8192 x 2048 -> 512) the CPU reference covers a sample, for time: every 61st
 * row of out and din, every 17th output feature of dw (the bit-exact comparison covers all).
 *
 * Without a CUDA device (backend_cuda returns NULL) every test reports itself skipped; with
 * MT_REQUIRE_GPU=1 (scripts/test-gpu.sh) that is a failure instead. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "gpu_ops_util.h"
#include "ops.h"

enum order { APART, A_THEN_B, B_THEN_A };

/* where the pairs lie: w for the weights and their gradients, y for the outputs and their
 * gradients */
struct placement {
    const char *name;
    enum order w, y;
};

static const struct placement PLACE_APART = {"apart", APART, APART};
static const struct placement PLACE_A_B = {"views a,b", A_THEN_B, A_THEN_B};
static const struct placement PLACE_B_A = {"views b,a", B_THEN_A, B_THEN_A};
static const struct placement PLACE_MIXED = {"views w a,b y b,a", A_THEN_B, B_THEN_A};

/* Two device tensors of n elements of es bytes each; buf holds what to free */
struct dpair {
    void *a, *b;
    void *buf[2];
};

static struct dpair dpair_new(const struct backend *g, size_t n, size_t es, enum order o)
{
    struct dpair p = {0};
    if (o == APART) {
        p.a = p.buf[0] = g->alloc(n * es);
        p.b = p.buf[1] = g->alloc(n * es);
    } else {
        char *base = p.buf[0] = g->alloc(2 * n * es);
        p.a = o == A_THEN_B ? base : base + n * es;
        p.b = o == A_THEN_B ? base + n * es : base;
    }
    return p;
}

static void dpair_free(const struct backend *g, struct dpair *p)
{
    for (int i = 0; i < 2; i++)
        if (p->buf[i]) g->free(p->buf[i]);
}

/* h into the existing compute-dtype tensor dst; h is overwritten with the values the device
 * holds, so that the CPU reference sees them */
static void x_upload(const struct mode *M, void *dst, float *h, size_t n)
{
    const struct backend *g = M->g;
    float *tmp = g->alloc(n * sizeof(float));
    g->upload(tmp, h, n * sizeof(float));
    g->cast_f32_to_x(dst, tmp, n);
    g->cast_x_to_f32(tmp, dst, n);
    g->download(h, tmp, n * sizeof(float));
    g->free(tmp);
}

static void *raw_of(const struct backend *g, const void *d, size_t bytes)
{
    void *h = mt_malloc(bytes);
    g->download(h, d, bytes);
    return h;
}

/* every step-th row of x [rows, cols] */
static float *rows_of(const float *x, int rows, int cols, int step)
{
    const int n = (rows + step - 1) / step;
    float *s = fnew((size_t)n * cols);
    for (int r = 0; r < n; r++) memcpy(s + (size_t)r * cols, x + (size_t)r * step * cols, (size_t)cols * sizeof(float));
    return s;
}

/* every step-th column of x [rows, cols] */
static float *cols_of(const float *x, int rows, int cols, int step)
{
    const int n = (cols + step - 1) / step;
    float *s = fnew((size_t)rows * n);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < n; c++) s[(size_t)r * n + c] = x[(size_t)r * cols + (size_t)c * step];
    return s;
}

static void expect_same(const struct mode *M, const char *what, const struct placement *P, int N, int I,
                        int O, const void *got, const void *ref, size_t bytes)
{
    char w[128];
    snprintf(w, sizeof w, "matmul2 %s %dx%dx%d %s", what, N, I, O, P->name);
    check_exact(M, w, got, ref, bytes);
}

static void expect_close(const struct mode *M, const char *what, const struct placement *P, int N, int I,
                         int O, const float *got, const float *ref, size_t n, double tol)
{
    char w[128];
    snprintf(w, sizeof w, "matmul2 %s %dx%dx%d %s", what, N, I, O, P->name);
    check_close(M, w, got, ref, n, tol);
}

/* rs, fs: the CPU reference checks every rs-th row of out and din and every fs-th output feature
 * of dw */
static void matmul2_case(const struct mode *M, mt_rng *rng, int N, int I, int O,
                         const struct placement *P, int rs, int fs)
{
    const struct backend *g = M->g, *c = M->c;
    const size_t xs = g->x_size, ni = (size_t)N * I, no = (size_t)N * O, oi = (size_t)O * I;
    float *in = hrand(rng, ni, 1.0), *w_a = hrand(rng, oi, 0.05), *w_b = hrand(rng, oi, 0.05);
    float *dout_a = hrand(rng, no, 1.0), *dout_b = hrand(rng, no, 1.0), *din0 = hrand(rng, ni, 1.0);
    float *dw0_a = hrand(rng, oi, 1.0), *dw0_b = hrand(rng, oi, 1.0);
    void *d_in = dx_from(M, in, ni), *d_din = g->alloc(ni * xs);
    struct dpair w = dpair_new(g, oi, xs, P->w), dw = dpair_new(g, oi, sizeof(float), P->w);
    struct dpair y = dpair_new(g, no, xs, P->y), dy = dpair_new(g, no, xs, P->y);
    x_upload(M, w.a, w_a, oi), x_upload(M, w.b, w_b, oi);
    x_upload(M, dy.a, dout_a, no), x_upload(M, dy.b, dout_b, no);
    void *din0_x = mt_malloc(ni * xs);
    {
        void *d = dx_from(M, din0, ni);
        g->download(din0_x, d, ni * xs);
        g->free(d);
    }

    /* forward: the two calls, then the pair, into the same buffers */
    poison(M, y.a, no * xs), poison(M, y.b, no * xs);
    g->matmul_forward(y.a, d_in, w.a, N, I, O);
    g->matmul_forward(y.b, d_in, w.b, N, I, O);
    void *ref_a = raw_of(g, y.a, no * xs), *ref_b = raw_of(g, y.b, no * xs);
    poison(M, y.a, no * xs), poison(M, y.b, no * xs);
    g->matmul2_forward(y.a, y.b, d_in, w.a, w.b, N, I, O);
    void *out_a = raw_of(g, y.a, no * xs), *out_b = raw_of(g, y.b, no * xs);
    expect_same(M, "forward a", P, N, I, O, out_a, ref_a, no * xs);
    expect_same(M, "forward b", P, N, I, O, out_b, ref_b, no * xs);

    float *in_s = rows_of(in, N, I, rs);
    const int ns = (N + rs - 1) / rs;
    float *ya = hx_of(M, y.a, no), *yb = hx_of(M, y.b, no);
    float *ya_s = rows_of(ya, N, O, rs), *yb_s = rows_of(yb, N, O, rs);
    float *ca = fnew((size_t)ns * O), *cb = fnew((size_t)ns * O);
    c->matmul2_forward(ca, cb, in_s, w_a, w_b, ns, I, O);
    expect_close(M, "forward a vs cpu", P, N, I, O, ya_s, ca, (size_t)ns * O, M->tol);
    expect_close(M, "forward b vs cpu", P, N, I, O, yb_s, cb, (size_t)ns * O, M->tol);
    free(ref_a), free(ref_b), free(out_a), free(out_b), free(ya), free(yb), free(ya_s), free(yb_s);
    free(ca), free(cb);

    /* backward as attention uses it (accumulating into din), then overwriting din */
    for (int acc = 1; acc >= 0; acc--) {
        void *got[3], *ref[3];
        const size_t bytes[3] = {ni * xs, oi * sizeof(float), oi * sizeof(float)};
        void *const dst[3] = {d_din, dw.a, dw.b};
        for (int pass = 0; pass < 2; pass++) {
            if (acc) g->upload(d_din, din0_x, ni * xs);
            else poison(M, d_din, ni * xs);
            g->upload(dw.a, dw0_a, oi * sizeof(float)), g->upload(dw.b, dw0_b, oi * sizeof(float));
            if (pass == 0) {
                g->matmul_backward(d_din, dw.a, dy.a, d_in, w.a, N, I, O, acc);
                g->matmul_backward(d_din, dw.b, dy.b, d_in, w.b, N, I, O, true);
            } else {
                g->matmul2_backward(d_din, dw.a, dw.b, dy.a, dy.b, d_in, w.a, w.b, N, I, O, acc);
            }
            for (int k = 0; k < 3; k++) (pass ? got : ref)[k] = raw_of(g, dst[k], bytes[k]);
        }
        expect_same(M, acc ? "backward din (acc)" : "backward din", P, N, I, O, got[0], ref[0], bytes[0]);
        expect_same(M, "backward dw a", P, N, I, O, got[1], ref[1], bytes[1]);
        expect_same(M, "backward dw b", P, N, I, O, got[2], ref[2], bytes[2]);

        float *din = hx_of(M, d_din, ni), *din_s = rows_of(din, N, I, rs);
        float *dya_s = rows_of(dout_a, N, O, rs), *dyb_s = rows_of(dout_b, N, O, rs);
        float *cdin = acc ? rows_of(din0, N, I, rs) : fnew((size_t)ns * I);
        c->matmul2_backward(cdin, NULL, NULL, dya_s, dyb_s, in_s, w_a, w_b, ns, I, O, acc);
        expect_close(M, acc ? "backward din (acc) vs cpu" : "backward din vs cpu", P, N, I, O,
                     din_s, cdin, (size_t)ns * I, M->tol);

        /* dw: what the op added, at every fs-th output feature (a row of dw) */
        const int os = (O + fs - 1) / fs;
        const float *dw0[2] = {dw0_a, dw0_b};
        float *gdw[2], *cdw[2] = {fnew((size_t)os * I), fnew((size_t)os * I)};
        for (int k = 0; k < 2; k++) {
            float *full = diff((const float *)got[1 + k], dw0[k], oi);
            gdw[k] = rows_of(full, O, I, fs);
            free(full);
        }
        float *dya_c = cols_of(dout_a, N, O, fs), *dyb_c = cols_of(dout_b, N, O, fs);
        c->matmul2_backward(NULL, cdw[0], cdw[1], dya_c, dyb_c, in, NULL, NULL, N, I, os, false);
        expect_close(M, "backward dw a (added) vs cpu", P, N, I, O, gdw[0], cdw[0], (size_t)os * I, M->tol_long);
        expect_close(M, "backward dw b (added) vs cpu", P, N, I, O, gdw[1], cdw[1], (size_t)os * I, M->tol_long);
        for (int k = 0; k < 3; k++) free(got[k]), free(ref[k]);
        for (int k = 0; k < 2; k++) free(gdw[k]), free(cdw[k]);
        free(din), free(din_s), free(dya_s), free(dyb_s), free(cdin), free(dya_c), free(dyb_c);
    }

    g->free(d_in), g->free(d_din);
    dpair_free(g, &w), dpair_free(g, &dw), dpair_free(g, &y), dpair_free(g, &dy);
    free(in), free(w_a), free(w_b), free(dout_a), free(dout_b), free(din0), free(dw0_a), free(dw0_b);
    free(din0_x), free(in_s);
}

/* NULL din or NULL dw, bit for bit against the two calls with the same NULLs; N = 0 leaves every
 * dw bit for bit */
static void matmul2_partial_case(const struct mode *M, mt_rng *rng, int N, int I, int O)
{
    const struct backend *g = M->g;
    const size_t xs = g->x_size, ni = (size_t)N * I, no = (size_t)N * O, oi = (size_t)O * I;
    float *in = hrand(rng, ni, 1.0), *w_a = hrand(rng, oi, 0.05), *w_b = hrand(rng, oi, 0.05);
    float *dout_a = hrand(rng, no, 1.0), *dout_b = hrand(rng, no, 1.0), *dw0 = hrand(rng, oi, 1.0);
    void *d_in = dx_from(M, in, ni), *d_wa = dx_from(M, w_a, oi), *d_wb = dx_from(M, w_b, oi);
    void *d_dya = dx_from(M, dout_a, no), *d_dyb = dx_from(M, dout_b, no);
    void *d_din = g->alloc(ni * xs);
    float *d_dwa = g->alloc(oi * sizeof(float)), *d_dwb = g->alloc(oi * sizeof(float));
    const struct placement *P = &PLACE_APART;

    void *din[2];
    for (int pass = 0; pass < 2; pass++) {
        poison(M, d_din, ni * xs);
        if (pass == 0) {
            g->matmul_backward(d_din, NULL, d_dya, d_in, d_wa, N, I, O, false);
            g->matmul_backward(d_din, NULL, d_dyb, d_in, d_wb, N, I, O, true);
        } else {
            g->matmul2_backward(d_din, NULL, NULL, d_dya, d_dyb, d_in, d_wa, d_wb, N, I, O, false);
        }
        din[pass] = raw_of(g, d_din, ni * xs);
    }
    expect_same(M, "backward din only", P, N, I, O, din[1], din[0], ni * xs);

    /* only dw_b: the a half computes din alone */
    void *only[2][2];
    for (int pass = 0; pass < 2; pass++) {
        poison(M, d_din, ni * xs);
        g->upload(d_dwb, dw0, oi * sizeof(float));
        if (pass == 0) {
            g->matmul_backward(d_din, NULL, d_dya, d_in, d_wa, N, I, O, false);
            g->matmul_backward(d_din, d_dwb, d_dyb, d_in, d_wb, N, I, O, true);
        } else {
            g->matmul2_backward(d_din, NULL, d_dwb, d_dya, d_dyb, d_in, d_wa, d_wb, N, I, O, false);
        }
        only[pass][0] = raw_of(g, d_din, ni * xs);
        only[pass][1] = raw_of(g, d_dwb, oi * sizeof(float));
    }
    expect_same(M, "backward din + dw b only: din", P, N, I, O, only[1][0], only[0][0], ni * xs);
    expect_same(M, "backward din + dw b only: dw b", P, N, I, O, only[1][1], only[0][1], oi * sizeof(float));

    void *dw[2][2];
    for (int pass = 0; pass < 2; pass++) {
        g->upload(d_dwa, dw0, oi * sizeof(float)), g->upload(d_dwb, dw0, oi * sizeof(float));
        if (pass == 0) {
            g->matmul_backward(NULL, d_dwa, d_dya, d_in, d_wa, N, I, O, false);
            g->matmul_backward(NULL, d_dwb, d_dyb, d_in, d_wb, N, I, O, true);
        } else {
            g->matmul2_backward(NULL, d_dwa, d_dwb, d_dya, d_dyb, d_in, d_wa, d_wb, N, I, O, false);
        }
        dw[pass][0] = raw_of(g, d_dwa, oi * sizeof(float));
        dw[pass][1] = raw_of(g, d_dwb, oi * sizeof(float));
    }
    expect_same(M, "backward dw only: a", P, N, I, O, dw[1][0], dw[0][0], oi * sizeof(float));
    expect_same(M, "backward dw only: b", P, N, I, O, dw[1][1], dw[0][1], oi * sizeof(float));

    g->upload(d_dwa, dw0, oi * sizeof(float)), g->upload(d_dwb, dw0, oi * sizeof(float));
    g->matmul2_backward(NULL, d_dwa, d_dwb, d_dya, d_dyb, d_in, d_wa, d_wb, 0, I, O, false);
    void *z_a = raw_of(g, d_dwa, oi * sizeof(float)), *z_b = raw_of(g, d_dwb, oi * sizeof(float));
    expect_same(M, "backward N=0 leaves dw a", P, 0, I, O, z_a, dw0, oi * sizeof(float));
    expect_same(M, "backward N=0 leaves dw b", P, 0, I, O, z_b, dw0, oi * sizeof(float));

    for (int p = 0; p < 2; p++) free(din[p]), free(only[p][0]), free(only[p][1]), free(dw[p][0]), free(dw[p][1]);
    free(z_a), free(z_b);
    void *bufs[] = {d_in, d_wa, d_wb, d_dya, d_dyb, d_din, d_dwa, d_dwb};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) g->free(bufs[i]);
    free(in), free(w_a), free(w_b), free(dout_a), free(dout_b), free(dw0);
}

Test(gpu, matmul2_small_shapes)
{
    mt_rng rng;
    mt_rng_seed(&rng, 131);
    const struct placement *places[] = {&PLACE_APART, &PLACE_A_B, &PLACE_B_A, &PLACE_MIXED};
    const int shapes[][3] = {{100, 72, 40}, {256, 512, 128}};
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        for (int s = 0; s < 2; s++)
            for (int p = 0; p < 4; p++)
                matmul2_case(&M, &rng, shapes[s][0], shapes[s][1], shapes[s][2], places[p], 1, 1);
        matmul2_partial_case(&M, &rng, 100, 72, 40);
    }
}

/* attention's k and v at the bench shape: T = 8192, H = 2048, 4 kv heads of 128 */
Test(gpu, matmul2_bench_shape, .timeout = 600)
{
    mt_rng rng;
    mt_rng_seed(&rng, 132);
    const struct placement *places[] = {&PLACE_A_B, &PLACE_B_A};
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        for (int p = 0; p < 2; p++) matmul2_case(&M, &rng, 8192, 2048, 512, places[p], 61, 17);
    }
}
