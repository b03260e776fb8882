/* GPU parity tests (suite "gpu"): every op of the CUDA backend, forward and backward, against the
 * fp32 CPU reference (src/cpu/) on the same fresh random inputs, in both CUDA modes.
 *
 * Method. Inputs are drawn in fp32 on the host, uploaded and cast to the compute dtype on the
 * device, then cast back and downloaded, so the CPU reference sees exactly the (bf16-rounded)
 * values the GPU sees. Every GPU output buffer is poisoned with NaN bytes before the op runs, so an
 * element the op forgot to write fails the check (a NaN makes the error infinite). The measure is
 * ‖gpu − cpu‖ / ‖cpu‖ over the whole output (for accumulating outputs, over what the op added).
 *
 * Tolerances (each check prints its measured error to stderr):
 *  - TOL_F32 = 1e-5, fp32 mode. Both backends compute in fp32 with the same formulas; they differ
 *    only in summation order and in the last ulp of expf/sinf/cosf (CUDA's are within 2 ulp), so
 *    errors are a few ulp (~1e-7 … 1e-6). 1e-5 leaves an order of magnitude.
 *  - TOL_F32_LONG = 1e-4, fp32 mode, outputs that are long reductions of products whose terms
 *    cancel (attention backward: dP − Di, sums over every visible key and query), where the
 *    order-dependent rounding relative to a small result grows to ~1e-5.
 *  - TOL_BF16 = 1e-2, bf16 mode. bf16 keeps 8 significant bits, so one rounding of an output is a
 *    relative error up to 2^-9 ≈ 2e-3 (≈1.1e-3 rms); the GPU rounds at the points of spec §7
 *    (e.g. the RMSNorm value before the weight, cos/sin, SiLU) while the CPU stays in fp32, which
 *    puts the expected error at 1e-3 … 5e-3. 1e-2 is about 2^-7: any real bug (a wrong index, a
 *    missing term, a wrong scale) gives O(1).
 * Exact checks: gathers and copies move bits (error 0); top-k indices must match exactly (the
 * same inputs give the same fp32 probabilities up to an ulp, and ties, which bf16 inputs make
 * common, are broken toward the lower id by both); experts with no rows keep dw bit for bit.
 *
 * Without a CUDA device (backend_cuda returns NULL) every test reports itself skipped; with
 * MT_REQUIRE_GPU=1 (scripts/test-gpu.sh) that is a failure instead. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "env_flag.h"
#include "gpu_backend.h"
#include "ops.h"

#ifdef MT_HAVE_CUDA
#include "../../cuda/grouped_gemm.cuh"
#endif

#define TOL_F32 1e-5
#define TOL_F32_LONG 1e-4
#define TOL_BF16 1e-2

struct mode {
    const struct backend *g; /* the CUDA backend of this mode */
    const struct backend *c; /* the CPU reference */
    const char *name;        /* "fp32" or "bf16" */
    double tol, tol_long;
};

/* mode 0 is fp32, mode 1 bf16 */
static void mode_get(int i, struct mode *m)
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

static float *fnew(size_t n) { return mt_calloc(n ? n : 1, sizeof(float)); }

static float *hrand(mt_rng *r, size_t n, double scale)
{
    float *x = fnew(n);
    for (size_t i = 0; i < n; i++) {
        double v = mt_rng_normal(r) * scale;
        if (v == 0.0) v = 0.5 * scale; /* never zeros */
        x[i] = (float)v;
    }
    return x;
}

static float *hdup(const float *x, size_t n)
{
    float *y = fnew(n);
    memcpy(y, x, n * sizeof(float));
    return y;
}

static int irand(mt_rng *r, int n) { return (int)(mt_rng_uniform(r) * n) % n; }

static void shuffle(mt_rng *r, int32_t *a, int n)
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
static double rel_err(const float *got, const float *ref, size_t n)
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

static void check_close(const struct mode *m, const char *what, const float *got, const float *ref,
                        size_t n, double tol)
{
    const double e = rel_err(got, ref, n);
    fprintf(stderr, "gpu %s %-44s rel err %.2e (tol %.0e)\n", m->name, what, e, tol);
    cr_expect(e <= tol, "%s [%s]: relative error %.3e exceeds %.1e", what, m->name, e, tol);
}

static void check_exact(const struct mode *m, const char *what, const void *got, const void *ref,
                        size_t bytes)
{
    const bool same = memcmp(got, ref, bytes) == 0;
    fprintf(stderr, "gpu %s %-44s %s\n", m->name, what, same ? "bit-exact" : "DIFFERS");
    cr_expect(same, "%s [%s]: expected bit-identical results", what, m->name);
}

/* a - b elementwise (what an accumulating op added) */
static float *diff(const float *a, const float *b, size_t n)
{
    float *d = fnew(n);
    for (size_t i = 0; i < n; i++) d[i] = a[i] - b[i];
    return d;
}

/* ---------------------------------------------------------------- device helpers */

/* A device buffer of n compute-dtype elements holding h; h is overwritten with exactly the values
 * the device holds (rounded to bf16 in bf16 mode) so that the CPU reference uses the same input. */
static void *dx_from(const struct mode *m, float *h, size_t n)
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

static float *df_from(const struct mode *m, const float *h, size_t n)
{
    float *d = m->g->alloc(n * sizeof(float));
    m->g->upload(d, h, n * sizeof(float));
    return d;
}

static int32_t *di_from(const struct mode *m, const int32_t *h, size_t n)
{
    int32_t *d = m->g->alloc(n * sizeof(int32_t));
    m->g->upload(d, h, n * sizeof(int32_t));
    return d;
}

/* NaN bytes over a device output before the op under test runs */
static void poison(const struct mode *m, void *d, size_t bytes)
{
    void *h = mt_malloc(bytes);
    memset(h, 0xff, bytes);
    m->g->upload(d, h, bytes);
    free(h);
}

static void *dx_poisoned(const struct mode *m, size_t n)
{
    void *d = m->g->alloc(n * m->g->x_size);
    poison(m, d, n * m->g->x_size);
    return d;
}

static float *df_poisoned(const struct mode *m, size_t n)
{
    float *d = m->g->alloc(n * sizeof(float));
    poison(m, d, n * sizeof(float));
    return d;
}

/* host fp32 copies of device results */
static float *hx_of(const struct mode *m, const void *dx, size_t n)
{
    const struct backend *g = m->g;
    float *tmp = g->alloc(n * sizeof(float));
    float *h = fnew(n);
    g->cast_x_to_f32(tmp, dx, n);
    g->download(h, tmp, n * sizeof(float));
    g->free(tmp);
    return h;
}

static float *hf_of(const struct mode *m, const float *d, size_t n)
{
    float *h = fnew(n);
    m->g->download(h, d, n * sizeof(float));
    return h;
}

/* ---------------------------------------------------------------- table, memory, elementwise */

Test(gpu, backend_table_is_complete)
{
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        const char *p = (const char *)M.g + offsetof(struct backend, alloc);
        const char *end = (const char *)M.g + sizeof *M.g;
        for (int s = 0; p < end; p += sizeof(void (*)(void)), s++) {
            void (*fn)(void);
            memcpy(&fn, p, sizeof fn);
            cr_expect_not_null(fn, "backend_cuda(%s) leaves function slot %d NULL", M.name, s);
        }
    }
}

/* round-to-nearest-even fp32 -> bf16 -> fp32, written from the format's definition */
static float bf16_round(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    float y;
    memcpy(&y, &u, 4);
    return y;
}

Test(gpu, memory_and_elementwise)
{
    mt_rng rng;
    mt_rng_seed(&rng, 101);
    const size_t n = 100003;
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        const struct backend *g = M.g;
        float *x = hrand(&rng, n, 3.0), *y = hrand(&rng, n, 1.0);

        /* raw bytes round-trip; a fresh buffer reads as NaN */
        float *d = g->alloc(n * sizeof(float)), *h = fnew(n);
        g->download(h, d, n * sizeof(float));
        cr_expect(isnan(h[0]) && isnan(h[n - 1]), "[%s] fresh device buffers are NaN-filled", M.name);
        g->upload(d, x, n * sizeof(float));
        g->download(h, d, n * sizeof(float));
        check_exact(&M, "upload/download", h, x, n * sizeof(float));

        /* cast to the compute dtype rounds to nearest even (identity in fp32) */
        void *dx = g->alloc(n * g->x_size);
        g->cast_f32_to_x(dx, d, n);
        float *back = hx_of(&M, dx, n), *want = fnew(n);
        for (size_t k = 0; k < n; k++) want[k] = g->x_size == 4 ? x[k] : bf16_round(x[k]);
        check_exact(&M, "cast f32 -> x -> f32", back, want, n * sizeof(float));

        /* copy and zero */
        void *dx2 = dx_poisoned(&M, n);
        g->copy(dx2, dx, n * g->x_size);
        float *cp = hx_of(&M, dx2, n);
        check_exact(&M, "copy", cp, want, n * sizeof(float));
        g->zero(dx2, n * g->x_size);
        float *zz = hx_of(&M, dx2, n), *zeros = fnew(n);
        check_exact(&M, "zero", zz, zeros, n * sizeof(float));

        /* add_inplace: y += x in the compute dtype */
        float *yh = hdup(y, n);
        void *dy = dx_from(&M, yh, n);
        g->add_inplace(dy, dx, n);
        float *sum = hx_of(&M, dy, n), *ref = fnew(n);
        for (size_t k = 0; k < n; k++) ref[k] = yh[k] + want[k];
        check_close(&M, "add_inplace", sum, ref, n, g->x_size == 4 ? 0.0 : TOL_BF16);

        /* scale_f32 and sumsq_f32 (fp32 in both modes) */
        g->scale_f32(d, n, 0.37f);
        float *sc = hf_of(&M, d, n);
        double ss = 0.0;
        for (size_t k = 0; k < n; k++) {
            ref[k] = x[k] * 0.37f;
            ss += (double)ref[k] * ref[k];
        }
        check_exact(&M, "scale_f32", sc, ref, n * sizeof(float));
        const double got = g->sumsq_f32(d, n);
        /* both sum the same fp32 squares in double, in different orders: ~n·2^-53 relative */
        fprintf(stderr, "gpu %s %-44s rel err %.2e (tol 1e-12)\n", M.name, "sumsq_f32",
                fabs(got - ss) / ss);
        cr_expect(fabs(got - ss) <= 1e-12 * ss, "[%s] sumsq_f32 %.17g, expected %.17g", M.name, got, ss);
        cr_expect(g->sumsq_f32(d, 0) == 0.0);

        g->free(d), g->free(dx), g->free(dx2), g->free(dy);
        free(x), free(y), free(h), free(back), free(want), free(cp), free(zz), free(zeros);
        free(yh), free(sum), free(ref), free(sc);
    }
}

/* ---------------------------------------------------------------- embedding */

Test(gpu, embedding)
{
    mt_rng rng;
    mt_rng_seed(&rng, 102);
    enum { V = 300, H = 256, T = 512 };
    int32_t ids[T];
    for (int t = 0; t < T; t++) ids[t] = irand(&rng, V); /* 512 draws of 300: many repeats */
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        float *wte = hrand(&rng, (size_t)V * H, 0.5), *dout = hrand(&rng, (size_t)T * H, 1.0);
        void *d_wte = dx_from(&M, wte, (size_t)V * H), *d_dout = dx_from(&M, dout, (size_t)T * H);
        int32_t *d_ids = di_from(&M, ids, T);

        void *d_out = dx_poisoned(&M, (size_t)T * H);
        M.g->embedding_forward(d_out, d_ids, d_wte, T, H);
        float *out = hx_of(&M, d_out, (size_t)T * H), *ref = fnew((size_t)T * H);
        M.c->embedding_forward(ref, ids, wte, T, H);
        check_exact(&M, "embedding forward", out, ref, (size_t)T * H * sizeof(float));

        float *dw0 = hrand(&rng, (size_t)V * H, 1.0), *dw_ref = hdup(dw0, (size_t)V * H);
        float *d_dw = df_from(&M, dw0, (size_t)V * H);
        M.g->embedding_backward(d_dw, d_dout, d_ids, T, H);
        M.c->embedding_backward(dw_ref, dout, ids, T, H);
        float *dw = hf_of(&M, d_dw, (size_t)V * H);
        float *add = diff(dw, dw0, (size_t)V * H), *add_ref = diff(dw_ref, dw0, (size_t)V * H);
        /* same fp32 adds in the same order as the CPU: expected bit-exact, tolerance for safety */
        check_close(&M, "embedding backward dwte (added)", add, add_ref, (size_t)V * H, M.tol);

        M.g->free(d_wte), M.g->free(d_dout), M.g->free(d_ids), M.g->free(d_out), M.g->free(d_dw);
        free(wte), free(dout), free(out), free(ref), free(dw0), free(dw_ref), free(dw), free(add),
            free(add_ref);
    }
}

/* ---------------------------------------------------------------- rmsnorm */

static void rmsnorm_case(const struct mode *M, mt_rng *rng, int N, int C, bool accumulate)
{
    char what[96];
    const size_t nc = (size_t)N * C;
    const float eps = 1e-6f;
    float *in = hrand(rng, nc, 2.0), *w = hrand(rng, C, 1.0), *dout = hrand(rng, nc, 1.0);
    void *d_in = dx_from(M, in, nc), *d_w = dx_from(M, w, C), *d_dout = dx_from(M, dout, nc);

    void *d_out = dx_poisoned(M, nc);
    float *d_rstd = df_poisoned(M, N);
    M->g->rmsnorm_forward(d_out, d_rstd, d_in, d_w, N, C, eps);
    float *out = hx_of(M, d_out, nc), *rstd = hf_of(M, d_rstd, N);
    float *ref = fnew(nc), *rstd_ref = fnew(N);
    M->c->rmsnorm_forward(ref, rstd_ref, in, w, N, C, eps);
    snprintf(what, sizeof what, "rmsnorm forward out %dx%d", N, C);
    check_close(M, what, out, ref, nc, M->tol);
    snprintf(what, sizeof what, "rmsnorm forward rstd %dx%d", N, C);
    check_close(M, what, rstd, rstd_ref, N, TOL_F32); /* fp32 in both modes */

    /* backward from the CPU's rstd (the same input for both) */
    float *d_rstd_in = df_from(M, rstd_ref, N);
    float *din0 = hrand(rng, nc, 1.0), *dw0 = hrand(rng, C, 1.0);
    void *d_din = accumulate ? dx_from(M, din0, nc) : dx_poisoned(M, nc);
    float *d_dw = df_from(M, dw0, C);
    M->g->rmsnorm_backward(d_din, d_dw, d_dout, d_in, d_w, d_rstd_in, N, C, accumulate);
    float *din = hx_of(M, d_din, nc), *dw = hf_of(M, d_dw, C);
    float *din_ref = hdup(din0, nc), *dw_ref = hdup(dw0, C);
    M->c->rmsnorm_backward(din_ref, dw_ref, dout, in, w, rstd_ref, N, C, accumulate);
    snprintf(what, sizeof what, "rmsnorm backward din %dx%d%s", N, C, accumulate ? " (acc)" : "");
    check_close(M, what, din, din_ref, nc, M->tol);
    float *add = diff(dw, dw0, C), *add_ref = diff(dw_ref, dw0, C);
    snprintf(what, sizeof what, "rmsnorm backward dw %dx%d (added)", N, C);
    check_close(M, what, add, add_ref, C, M->tol_long);

    M->g->free(d_in), M->g->free(d_w), M->g->free(d_dout), M->g->free(d_out), M->g->free(d_rstd);
    M->g->free(d_rstd_in), M->g->free(d_din), M->g->free(d_dw);
    free(in), free(w), free(dout), free(out), free(rstd), free(ref), free(rstd_ref), free(din0);
    free(dw0), free(din), free(dw), free(din_ref), free(dw_ref), free(add), free(add_ref);
}

Test(gpu, rmsnorm)
{
    mt_rng rng;
    mt_rng_seed(&rng, 103);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        rmsnorm_case(&M, &rng, 256, 512, false);
        rmsnorm_case(&M, &rng, 1030, 128, true); /* per-head norm shape, rows not a multiple of 8 */
    }
}

/* Every layout of the vector path of cuda/rmsnorm.cu (G lanes per row, MC chunks of 8 per lane):
 * groups of 4 lanes with idle lanes (C = 24), 8 lanes, 32 lanes with lanes past the row (C = 1000),
 * groups spanning 2 to 8 warps (C = 2048, 8192), blocks that make several passes over their rows
 * (N = 3001, 5000); and the scalar path (C = 130; C = 8192 in fp32). */
Test(gpu, rmsnorm_shapes)
{
    mt_rng rng;
    mt_rng_seed(&rng, 116);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        rmsnorm_case(&M, &rng, 3001, 2048, true);
        rmsnorm_case(&M, &rng, 50, 1000, false);
        rmsnorm_case(&M, &rng, 33, 24, true);
        rmsnorm_case(&M, &rng, 5000, 64, false);
        rmsnorm_case(&M, &rng, 20, 130, false);
        rmsnorm_case(&M, &rng, 9, 8192, false);
    }
}

/* ops.h lets din alias dout or in: either gives the bits of a separate din. dw alone (din NULL)
 * adds the same bits as with din. A weight that is not 16-byte aligned (a view into a flat
 * parameter buffer) takes the scalar path, which must agree within the mode's tolerance. */
static void rmsnorm_alias_case(const struct mode *M, mt_rng *rng, int N, int C)
{
    char what[96];
    const struct backend *g = M->g;
    const size_t nc = (size_t)N * C;
    float *in = hrand(rng, nc, 2.0), *w = hrand(rng, C + 1, 1.0), *dout = hrand(rng, nc, 1.0);
    float *dw0 = hrand(rng, C, 1.0);
    void *d_in = dx_from(M, in, nc), *d_dout = dx_from(M, dout, nc);
    void *d_wbuf = dx_from(M, w, C + 1);
    void *d_w = dx_from(M, w + 1, C); /* the same values as the unaligned view below */
    const void *d_wu = (const char *)d_wbuf + g->x_size;
    void *d_out = dx_poisoned(M, nc);
    float *d_rstd = df_poisoned(M, N);
    g->rmsnorm_forward(d_out, d_rstd, d_in, d_w, N, C, 1e-6f);

    void *d_din = dx_poisoned(M, nc);
    float *d_dw = df_from(M, dw0, C);
    g->rmsnorm_backward(d_din, d_dw, d_dout, d_in, d_w, d_rstd, N, C, false);
    float *din = hx_of(M, d_din, nc), *dw = hf_of(M, d_dw, C);

    void *d_a = dx_from(M, dout, nc); /* dout is already rounded: the same bits as d_dout */
    float *d_dw2 = df_from(M, dw0, C);
    g->rmsnorm_backward(d_a, d_dw2, d_a, d_in, d_w, d_rstd, N, C, false);
    float *a = hx_of(M, d_a, nc), *dw2 = hf_of(M, d_dw2, C);
    snprintf(what, sizeof what, "rmsnorm backward din = dout %dx%d", N, C);
    check_exact(M, what, a, din, nc * sizeof(float));
    snprintf(what, sizeof what, "rmsnorm backward dw (din = dout) %dx%d", N, C);
    check_exact(M, what, dw2, dw, C * sizeof(float));

    void *d_b = dx_from(M, in, nc);
    g->rmsnorm_backward(d_b, NULL, d_dout, d_b, d_w, d_rstd, N, C, false);
    float *b = hx_of(M, d_b, nc);
    snprintf(what, sizeof what, "rmsnorm backward din = in %dx%d", N, C);
    check_exact(M, what, b, din, nc * sizeof(float));

    float *d_dw3 = df_from(M, dw0, C);
    g->rmsnorm_backward(NULL, d_dw3, d_dout, d_in, d_w, d_rstd, N, C, false);
    float *dw3 = hf_of(M, d_dw3, C);
    snprintf(what, sizeof what, "rmsnorm backward dw only %dx%d", N, C);
    check_exact(M, what, dw3, dw, C * sizeof(float));

    void *d_out2 = dx_poisoned(M, nc), *d_din2 = dx_poisoned(M, nc);
    float *d_dw4 = df_from(M, dw0, C);
    g->rmsnorm_forward(d_out2, d_rstd, d_in, d_wu, N, C, 1e-6f);
    g->rmsnorm_backward(d_din2, d_dw4, d_dout, d_in, d_wu, d_rstd, N, C, false);
    float *out = hx_of(M, d_out, nc), *out2 = hx_of(M, d_out2, nc), *din2 = hx_of(M, d_din2, nc);
    float *dw4 = hf_of(M, d_dw4, C);
    float *add = diff(dw, dw0, C), *add4 = diff(dw4, dw0, C);
    snprintf(what, sizeof what, "rmsnorm forward unaligned w %dx%d", N, C);
    check_close(M, what, out2, out, nc, M->tol);
    snprintf(what, sizeof what, "rmsnorm backward din unaligned w %dx%d", N, C);
    check_close(M, what, din2, din, nc, M->tol);
    snprintf(what, sizeof what, "rmsnorm backward dw unaligned w %dx%d", N, C);
    check_close(M, what, add4, add, C, M->tol_long);

    void *dev[] = {d_in, d_dout, d_wbuf, d_w, d_out, d_rstd, d_din, d_dw, d_a, d_dw2, d_b, d_dw3,
                   d_out2, d_din2, d_dw4};
    for (size_t k = 0; k < sizeof dev / sizeof dev[0]; k++) g->free(dev[k]);
    float *host[] = {in, w, dout, dw0, din, dw, a, dw2, b, dw3, out, out2, din2, dw4, add, add4};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; k++) free(host[k]);
}

Test(gpu, rmsnorm_alias)
{
    mt_rng rng;
    mt_rng_seed(&rng, 117);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        rmsnorm_alias_case(&M, &rng, 300, 2048);
        rmsnorm_alias_case(&M, &rng, 100, 128);
        rmsnorm_alias_case(&M, &rng, 40, 130);
    }
}

/* ---------------------------------------------------------------- matmul */

/* w_off shifts the weight by that many elements inside its buffer, so cuBLASLt sees a pointer that
 * is not 16-byte aligned (weights are views into flat parameter buffers). */
static void matmul_case(const struct mode *M, mt_rng *rng, int N, int I, int O, int w_off)
{
    char what[96];
    const size_t ni = (size_t)N * I, no = (size_t)N * O, oi = (size_t)O * I;
    float *in = hrand(rng, ni, 1.0), *wfull = hrand(rng, oi + w_off, 0.05), *dout = hrand(rng, no, 1.0);
    void *d_in = dx_from(M, in, ni), *d_dout = dx_from(M, dout, no);
    void *d_wfull = dx_from(M, wfull, oi + w_off);
    const float *w = wfull + w_off;
    const void *d_w = (const char *)d_wfull + (size_t)w_off * M->g->x_size;

    void *d_out = dx_poisoned(M, no);
    M->g->matmul_forward(d_out, d_in, d_w, N, I, O);
    float *out = hx_of(M, d_out, no), *ref = fnew(no);
    M->c->matmul_forward(ref, in, w, N, I, O);
    snprintf(what, sizeof what, "matmul forward %dx%dx%d%s", N, I, O, w_off ? " (unaligned w)" : "");
    check_close(M, what, out, ref, no, M->tol);

    for (int acc = 0; acc < 2; acc++) {
        float *din0 = hrand(rng, ni, 1.0), *dw0 = hrand(rng, oi, 1.0);
        void *d_din = acc ? dx_from(M, din0, ni) : dx_poisoned(M, ni);
        float *d_dw = df_from(M, dw0, oi);
        M->g->matmul_backward(d_din, d_dw, d_dout, d_in, d_w, N, I, O, acc);
        float *din = hx_of(M, d_din, ni), *dw = hf_of(M, d_dw, oi);
        float *din_ref = hdup(din0, ni), *dw_ref = hdup(dw0, oi);
        M->c->matmul_backward(din_ref, dw_ref, dout, in, w, N, I, O, acc);
        snprintf(what, sizeof what, "matmul backward din %dx%dx%d%s", N, I, O, acc ? " (acc)" : "");
        check_close(M, what, din, din_ref, ni, M->tol);
        float *add = diff(dw, dw0, oi), *add_ref = diff(dw_ref, dw0, oi);
        snprintf(what, sizeof what, "matmul backward dw %dx%dx%d (added)", N, I, O);
        check_close(M, what, add, add_ref, oi, M->tol);
        M->g->free(d_din), M->g->free(d_dw);
        free(din0), free(dw0), free(din), free(dw), free(din_ref), free(dw_ref), free(add), free(add_ref);
    }

    /* only din, only dw (the other NULL); N == 0 leaves dw bit for bit */
    float *dw0 = hrand(rng, oi, 1.0);
    float *d_dw = df_from(M, dw0, oi);
    M->g->matmul_backward(NULL, d_dw, d_dout, d_in, d_w, 0, I, O, false);
    float *dw = hf_of(M, d_dw, oi);
    check_exact(M, "matmul backward N=0 leaves dw", dw, dw0, oi * sizeof(float));
    void *d_din = dx_poisoned(M, ni);
    M->g->matmul_backward(d_din, NULL, d_dout, d_in, d_w, N, I, O, false);
    float *din = hx_of(M, d_din, ni), *din_ref = fnew(ni);
    M->c->matmul_backward(din_ref, NULL, dout, in, w, N, I, O, false);
    check_close(M, "matmul backward din only", din, din_ref, ni, M->tol);

    M->g->free(d_in), M->g->free(d_dout), M->g->free(d_wfull), M->g->free(d_out), M->g->free(d_dw);
    M->g->free(d_din);
    free(in), free(wfull), free(dout), free(out), free(ref), free(dw0), free(dw), free(din),
        free(din_ref);
}

Test(gpu, matmul)
{
    mt_rng rng;
    mt_rng_seed(&rng, 104);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        matmul_case(&M, &rng, 256, 512, 384, 0);
        matmul_case(&M, &rng, 37, 72, 40, 1);
    }
}

/* The router GEMM with fp32 logits: compute-dtype operands (the CPU reference sees the same
 * rounded values), fp32 accumulation and output, fp32 products in the backward from fp32 dlogits
 * (bf16: the dlogits split in three exact bf16 parts). Only din is rounded to the compute dtype,
 * once, so logits and dw match the fp32 CPU to fp32 accumulation-order error in both modes. */
static void router_matmul_case(const struct mode *M, mt_rng *rng, int N, int I, int O)
{
    char what[96];
    const size_t ni = (size_t)N * I, no = (size_t)N * O, oi = (size_t)O * I;
    float *in = hrand(rng, ni, 1.0), *w = hrand(rng, oi, 0.05), *dl = hrand(rng, no, 1.0);
    void *d_in = dx_from(M, in, ni), *d_w = dx_from(M, w, oi);
    float *d_dl = df_from(M, dl, no);

    float *d_out = df_poisoned(M, no);
    M->g->router_matmul_forward(d_out, d_in, d_w, N, I, O);
    float *out = hf_of(M, d_out, no), *ref = fnew(no);
    M->c->matmul_forward(ref, in, w, N, I, O);
    snprintf(what, sizeof what, "router matmul forward %dx%dx%d (fp32 logits)", N, I, O);
    check_close(M, what, out, ref, no, TOL_F32);

    for (int acc = 0; acc < 2; acc++) {
        float *din0 = hrand(rng, ni, 1.0), *dw0 = hrand(rng, oi, 1.0);
        void *d_din = acc ? dx_from(M, din0, ni) : dx_poisoned(M, ni);
        float *d_dw = df_from(M, dw0, oi);
        M->g->router_matmul_backward(d_din, d_dw, d_dl, d_in, d_w, N, I, O, acc);
        float *din = hx_of(M, d_din, ni), *dw = hf_of(M, d_dw, oi);
        float *din_ref = hdup(din0, ni), *dw_ref = hdup(dw0, oi);
        M->c->matmul_backward(din_ref, dw_ref, dl, in, w, N, I, O, acc);
        snprintf(what, sizeof what, "router matmul backward din %dx%dx%d%s", N, I, O, acc ? " (acc)" : "");
        check_close(M, what, din, din_ref, ni, M->tol);
        float *add = diff(dw, dw0, oi), *add_ref = diff(dw_ref, dw0, oi);
        snprintf(what, sizeof what, "router matmul backward dw %dx%dx%d (added)", N, I, O);
        check_close(M, what, add, add_ref, oi, TOL_F32_LONG); /* N-long fp32 sums on the CPU */
        M->g->free(d_din), M->g->free(d_dw);
        free(din0), free(dw0), free(din), free(dw), free(din_ref), free(dw_ref), free(add), free(add_ref);
    }
    M->g->free(d_in), M->g->free(d_w), M->g->free(d_dl), M->g->free(d_out);
    free(in), free(w), free(dl), free(out), free(ref);
}

Test(gpu, router_matmul)
{
    mt_rng rng;
    mt_rng_seed(&rng, 112);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        router_matmul_case(&M, &rng, 512, 256, 64);
        router_matmul_case(&M, &rng, 300, 72, 8);
    }
}

/* ---------------------------------------------------------------- rope */

Test(gpu, rope)
{
    mt_rng rng;
    mt_rng_seed(&rng, 105);
    enum { T = 96, NH = 6, D = 64 };
    const size_t n = (size_t)T * NH * D;
    const float theta = 1e6f;
    int32_t pos[T];
    for (int t = 0; t < T; t++) pos[t] = irand(&rng, 4096);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        float *in = hrand(&rng, n, 1.0);
        void *d_in = dx_from(&M, in, n);
        int32_t *d_pos = di_from(&M, pos, T);
        float *ref = fnew(n);

        void *d_out = dx_poisoned(&M, n);
        M.g->rope_forward(d_out, d_in, d_pos, T, NH, D, theta);
        float *out = hx_of(&M, d_out, n);
        M.c->rope_forward(ref, in, pos, T, NH, D, theta);
        check_close(&M, "rope forward", out, ref, n, M.tol);

        M.g->rope_backward(d_out, d_in, d_pos, T, NH, D, theta);
        float *back = hx_of(&M, d_out, n);
        M.c->rope_backward(ref, in, pos, T, NH, D, theta);
        check_close(&M, "rope backward", back, ref, n, M.tol);

        /* in place gives the same bits as out of place */
        M.g->rope_forward(d_out, d_in, d_pos, T, NH, D, theta);
        float *oop = hx_of(&M, d_out, n);
        M.g->rope_forward(d_in, d_in, d_pos, T, NH, D, theta);
        float *inp = hx_of(&M, d_in, n);
        check_exact(&M, "rope in place", inp, oop, n * sizeof(float));

        M.g->free(d_in), M.g->free(d_pos), M.g->free(d_out);
        free(in), free(ref), free(out), free(back), free(oop), free(inp);
    }
}

/* The vector kernel with several tokens per block and a partial last block (D = 128 with 4 and 32
 * heads, D = 16: one chunk per half), and the scalar kernel (D = 20) */
static void rope_case(const struct mode *M, mt_rng *rng, int T, int NH, int D)
{
    char what[96];
    const size_t n = (size_t)T * NH * D;
    const float theta = 1e6f;
    int32_t *pos = mt_malloc((size_t)T * sizeof *pos);
    for (int t = 0; t < T; t++) pos[t] = irand(rng, 4096);
    float *in = hrand(rng, n, 1.0), *ref = fnew(n);
    void *d_in = dx_from(M, in, n);
    int32_t *d_pos = di_from(M, pos, T);
    void *d_out = dx_poisoned(M, n);
    M->g->rope_forward(d_out, d_in, d_pos, T, NH, D, theta);
    float *out = hx_of(M, d_out, n);
    M->c->rope_forward(ref, in, pos, T, NH, D, theta);
    snprintf(what, sizeof what, "rope forward T%d H%d D%d", T, NH, D);
    check_close(M, what, out, ref, n, M->tol);
    M->g->rope_backward(d_in, d_in, d_pos, T, NH, D, theta); /* in place */
    float *back = hx_of(M, d_in, n);
    M->c->rope_backward(ref, in, pos, T, NH, D, theta);
    snprintf(what, sizeof what, "rope backward in place T%d H%d D%d", T, NH, D);
    check_close(M, what, back, ref, n, M->tol);
    M->g->free(d_in), M->g->free(d_pos), M->g->free(d_out);
    free(pos), free(in), free(ref), free(out), free(back);
}

Test(gpu, rope_shapes)
{
    mt_rng rng;
    mt_rng_seed(&rng, 118);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        rope_case(&M, &rng, 37, 4, 128);
        rope_case(&M, &rng, 9, 32, 128);
        rope_case(&M, &rng, 11, 2, 16);
        rope_case(&M, &rng, 20, 3, 20);
    }
}

/* ---------------------------------------------------------------- attention */

/* seg: NULL, or host [B, S] document ids (document masking; the GPU gets a device copy) */
static void attention_case_seg(const struct mode *M, mt_rng *rng, int B, int S, int Hq, int Hkv,
                               int D, const int32_t *seg)
{
    char what[96];
    int32_t *d_seg = seg ? di_from(M, seg, (size_t)B * S) : NULL;
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * Hq * S;
    float *q = hrand(rng, nq, 1.0), *k = hrand(rng, nk, 1.0), *v = hrand(rng, nk, 1.0);
    float *dout = hrand(rng, nq, 1.0);
    void *d_q = dx_from(M, q, nq), *d_k = dx_from(M, k, nk), *d_v = dx_from(M, v, nk);
    void *d_dout = dx_from(M, dout, nq);

    void *d_out = dx_poisoned(M, nq);
    float *d_lse = df_poisoned(M, nl);
    M->g->attention_forward(d_out, d_lse, d_q, d_k, d_v, B, S, Hq, Hkv, D, d_seg);
    float *out = hx_of(M, d_out, nq), *lse = hf_of(M, d_lse, nl);
    float *out_ref = fnew(nq), *lse_ref = fnew(nl);
    M->c->attention_forward(out_ref, lse_ref, q, k, v, B, S, Hq, Hkv, D, seg);
    snprintf(what, sizeof what, "attention%s forward out B%d S%d H%d/%d D%d", seg ? " (seg)" : "", B,
             S, Hq, Hkv, D);
    check_close(M, what, out, out_ref, nq, M->tol);
    snprintf(what, sizeof what, "attention forward lse B%d S%d H%d/%d D%d", B, S, Hq, Hkv, D);
    check_close(M, what, lse, lse_ref, nl, TOL_F32); /* fp32 scores from the same inputs */

    /* the backward takes the GPU's own forward outputs (out, lse), as the model does */
    void *d_dq = dx_poisoned(M, nq), *d_dk = dx_poisoned(M, nk), *d_dv = dx_poisoned(M, nk);
    M->g->attention_backward(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out, d_lse, B, S, Hq, Hkv, D, d_seg);
    float *dq = hx_of(M, d_dq, nq), *dk = hx_of(M, d_dk, nk), *dv = hx_of(M, d_dv, nk);
    float *dq_ref = fnew(nq), *dk_ref = fnew(nk), *dv_ref = fnew(nk);
    M->c->attention_backward(dq_ref, dk_ref, dv_ref, dout, q, k, v, out_ref, lse_ref, B, S, Hq, Hkv, D, seg);
    snprintf(what, sizeof what, "attention backward dq B%d S%d H%d/%d D%d", B, S, Hq, Hkv, D);
    check_close(M, what, dq, dq_ref, nq, M->tol_long);
    snprintf(what, sizeof what, "attention backward dk B%d S%d H%d/%d D%d", B, S, Hq, Hkv, D);
    check_close(M, what, dk, dk_ref, nk, M->tol_long);
    snprintf(what, sizeof what, "attention backward dv B%d S%d H%d/%d D%d", B, S, Hq, Hkv, D);
    check_close(M, what, dv, dv_ref, nk, M->tol_long);

    M->g->free(d_q), M->g->free(d_k), M->g->free(d_v), M->g->free(d_dout), M->g->free(d_out);
    M->g->free(d_lse), M->g->free(d_dq), M->g->free(d_dk), M->g->free(d_dv);
    if (d_seg) M->g->free(d_seg);
    free(q), free(k), free(v), free(dout), free(out), free(lse), free(out_ref), free(lse_ref);
    free(dq), free(dk), free(dv), free(dq_ref), free(dk_ref), free(dv_ref);
}

static void attention_case(const struct mode *M, mt_rng *rng, int B, int S, int Hq, int Hkv, int D)
{
    attention_case_seg(M, rng, B, S, Hq, Hkv, D, NULL);
}

/* Document masking: random document lengths 1..max_len packed into each row (ids as data_documents
 * makes them), checked against the CPU. In bf16 with D = 64 and 128 the backend runs the masked
 * tensor-core kernels (mma.sync backward); fp32 and the other head dims the CUDA-core kernels. */
static void attention_docs_case(const struct mode *M, mt_rng *rng, int B, int S, int Hq, int Hkv,
                                int D, int max_len)
{
    int32_t *seg = mt_malloc((size_t)B * S * sizeof(int32_t));
    for (int b = 0; b < B; b++) {
        int doc = 0, left = 0;
        for (int t = 0; t < S; t++) {
            if (left == 0) {
                left = 1 + (int)(mt_rng_next(rng) % (uint64_t)max_len);
                if (t) doc++;
            }
            seg[(size_t)b * S + t] = doc;
            left--;
        }
    }
    attention_case_seg(M, rng, B, S, Hq, Hkv, D, seg);
    free(seg);
}

Test(gpu, attention_document_masking)
{
    mt_rng rng;
    mt_rng_seed(&rng, 108);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        attention_docs_case(&M, &rng, 2, 128, 8, 2, 64, 40);    /* documents across tile edges */
        attention_docs_case(&M, &rng, 2, 128, 8, 2, 128, 90);
        attention_docs_case(&M, &rng, 1, 100, 4, 4, 32, 7);     /* many short documents, ragged S */
        attention_docs_case(&M, &rng, 2, 70, 6, 2, 16, 1);      /* every token its own document */
        attention_docs_case(&M, &rng, 1, 65, 4, 2, 12, 200);    /* one document: plain causal */
    }
}

Test(gpu, attention_d64_d128)
{
    mt_rng rng;
    mt_rng_seed(&rng, 106);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        attention_case(&M, &rng, 2, 128, 8, 2, 64);
        attention_case(&M, &rng, 2, 128, 8, 2, 128);
    }
}

/* sequence lengths that are not a multiple of the 64-row tile, no grouping, D = 16 and 32, and head
 * dims that run zero-padded in a wider kernel (12 as in the fixture variants, 80) */
Test(gpu, attention_ragged_small_heads)
{
    mt_rng rng;
    mt_rng_seed(&rng, 107);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        attention_case(&M, &rng, 1, 100, 4, 4, 32);
        attention_case(&M, &rng, 2, 70, 6, 2, 16);
        attention_case(&M, &rng, 1, 1, 2, 1, 64);
        attention_case(&M, &rng, 2, 65, 4, 2, 12);
        attention_case(&M, &rng, 1, 64, 2, 1, 80);
    }
}

/* ---------------------------------------------------------------- attention: tensor-core kernels
 * cuda/attention_tc.cu called directly (whatever the backend table points at), bf16 mode only.
 * Tolerances: outputs and gradients 1e-2 relative (TOL_BF16), both as ‖got − ref‖/‖ref‖ and as
 * max|got − ref| / max|ref|. Both sides see the same bf16 inputs; the kernels round P (for P·V and
 * Pᵀ·dO) and dS (for dS·K and dSᵀ·Q) to bf16 before the second product, a relative error up to
 * 2^-9 per term with random sign (about 1.1e-3 rms on a sum), round every output to bf16 (up to
 * 2^-9, about 1.1e-3 rms), and take rowsum(dO ⊙ O) from the bf16 O; together 2e-3 … 4e-3 expected.
 * The max-norm check catches what the 2-norm could average away (a key leaking past the causal
 * mask or past S in a few rows). lse within 1e-3 absolute: it comes from fp32 scores of the same
 * inputs (fp32 accumulation, sums in another order, the SFU's exp2 at about 2 ulp), so its error
 * is ~1e-6 of lse's size (a few units); a wrong scale or mask moves it by O(0.1). */
#ifdef MT_HAVE_CUDA
#include "../../cuda/attention_tc.cuh"

#define TOL_TC_LSE 1e-3

/* max|got − ref| / max|ref|; infinite if got holds a NaN or an infinity */
static double max_rel_err(const float *got, const float *ref, size_t n)
{
    double d = 0.0, r = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) return INFINITY;
        d = fmax(d, fabs((double)got[i] - ref[i]));
        r = fmax(r, fabs((double)ref[i]));
    }
    return r > 0.0 ? d / r : d;
}

static double max_abs_err(const float *got, const float *ref, size_t n)
{
    double d = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) return INFINITY;
        d = fmax(d, fabs((double)got[i] - ref[i]));
    }
    return d;
}

static void check_tc(const struct mode *m, const char *what, const float *got, const float *ref,
                     size_t n)
{
    check_close(m, what, got, ref, n, TOL_BF16);
    const double e = max_rel_err(got, ref, n);
    fprintf(stderr, "gpu %s %-44s max err %.2e (tol %.0e)\n", m->name, what, e, TOL_BF16);
    cr_expect(e <= TOL_BF16, "%s [%s]: max-norm relative error %.3e exceeds %.1e", what, m->name, e,
              TOL_BF16);
}

static void check_lse(const struct mode *m, const char *what, const float *got, const float *ref,
                      size_t n)
{
    const double e = max_abs_err(got, ref, n);
    fprintf(stderr, "gpu %s %-44s abs err %.2e (tol %.0e)\n", m->name, what, e, TOL_TC_LSE);
    cr_expect(e <= TOL_TC_LSE, "%s [%s]: lse off by %.3e (tolerance %.1e absolute)", what, m->name,
              e, TOL_TC_LSE);
}

/* raw compute-dtype bytes of a device tensor */
static void *hraw_of(const struct mode *m, const void *d, size_t bytes)
{
    void *h = mt_malloc(bytes);
    m->g->download(h, d, bytes);
    return h;
}

/* Forward tiling `variant`, then the backward on the kernel's own out/lse, against the CPU
 * reference; the backward runs twice and must give the same bits (no atomics, no races). */
static void tc_case(const struct mode *M, mt_rng *rng, int B, int S, int Hq, int Hkv, int D,
                    int variant)
{
    char what[112];
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * Hq * S;
    const size_t xs = M->g->x_size;
    float *q = hrand(rng, nq, 1.0), *k = hrand(rng, nk, 1.0), *v = hrand(rng, nk, 1.0);
    float *dout = hrand(rng, nq, 1.0);
    void *d_q = dx_from(M, q, nq), *d_k = dx_from(M, k, nk), *d_v = dx_from(M, v, nk);
    void *d_dout = dx_from(M, dout, nq);

    const int old_variant = attention_tc_set_variant(variant);
    void *d_out = dx_poisoned(M, nq);
    float *d_lse = df_poisoned(M, nl);
    cr_assert(attention_tc_forward(d_out, d_lse, d_q, d_k, d_v, B, S, Hq, Hkv, D),
              "attention_tc_forward declined B%d S%d H%d/%d D%d", B, S, Hq, Hkv, D);
    attention_tc_set_variant(old_variant);
    float *out = hx_of(M, d_out, nq), *lse = hf_of(M, d_lse, nl);
    float *out_ref = fnew(nq), *lse_ref = fnew(nl);
    M->c->attention_forward(out_ref, lse_ref, q, k, v, B, S, Hq, Hkv, D, NULL);
    snprintf(what, sizeof what, "tc fwd v%d out B%d S%d H%d/%d D%d", variant, B, S, Hq, Hkv, D);
    check_tc(M, what, out, out_ref, nq);
    snprintf(what, sizeof what, "tc fwd v%d lse B%d S%d H%d/%d D%d", variant, B, S, Hq, Hkv, D);
    check_lse(M, what, lse, lse_ref, nl);

    void *d_dq = dx_poisoned(M, nq), *d_dk = dx_poisoned(M, nk), *d_dv = dx_poisoned(M, nk);
    cr_assert(attention_tc_backward(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out, d_lse, B, S, Hq,
                                    Hkv, D),
              "attention_tc_backward declined B%d S%d H%d/%d D%d", B, S, Hq, Hkv, D);
    float *dq = hx_of(M, d_dq, nq), *dk = hx_of(M, d_dk, nk), *dv = hx_of(M, d_dv, nk);
    float *dq_ref = fnew(nq), *dk_ref = fnew(nk), *dv_ref = fnew(nk);
    M->c->attention_backward(dq_ref, dk_ref, dv_ref, dout, q, k, v, out_ref, lse_ref, B, S, Hq, Hkv, D, NULL);
    snprintf(what, sizeof what, "tc bwd dq B%d S%d H%d/%d D%d", B, S, Hq, Hkv, D);
    check_tc(M, what, dq, dq_ref, nq);
    snprintf(what, sizeof what, "tc bwd dk B%d S%d H%d/%d D%d", B, S, Hq, Hkv, D);
    check_tc(M, what, dk, dk_ref, nk);
    snprintf(what, sizeof what, "tc bwd dv B%d S%d H%d/%d D%d", B, S, Hq, Hkv, D);
    check_tc(M, what, dv, dv_ref, nk);

    void *r1[3] = {hraw_of(M, d_dq, nq * xs), hraw_of(M, d_dk, nk * xs), hraw_of(M, d_dv, nk * xs)};
    poison(M, d_dq, nq * xs), poison(M, d_dk, nk * xs), poison(M, d_dv, nk * xs);
    cr_assert(attention_tc_backward(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out, d_lse, B, S, Hq,
                                    Hkv, D));
    void *r2[3] = {hraw_of(M, d_dq, nq * xs), hraw_of(M, d_dk, nk * xs), hraw_of(M, d_dv, nk * xs)};
    const size_t nb[3] = {nq * xs, nk * xs, nk * xs};
    for (int i = 0; i < 3; i++) {
        snprintf(what, sizeof what, "tc bwd d%c rerun B%d S%d H%d/%d D%d", "qkv"[i], B, S, Hq, Hkv, D);
        check_exact(M, what, r2[i], r1[i], nb[i]);
        free(r1[i]), free(r2[i]);
    }

    M->g->free(d_q), M->g->free(d_k), M->g->free(d_v), M->g->free(d_dout), M->g->free(d_out);
    M->g->free(d_lse), M->g->free(d_dq), M->g->free(d_dk), M->g->free(d_dv);
    free(q), free(k), free(v), free(dout), free(out), free(lse), free(out_ref), free(lse_ref);
    free(dq), free(dk), free(dv), free(dq_ref), free(dk_ref), free(dv_ref);
}

/* S not a multiple of any tile (100, 257, 300), exact tiles (64, 128), S = 1; grouped (8/2, 6/3)
 * and ungrouped heads; D 128 and 64; each forward kernel: the three mma.sync tilings, the four
 * wgmma ones (3..6) and the two warp-specialised TMA ones (7, 8); on a GPU other than Hopper, or
 * with MT_FORCE_SM80, 3..8 run tiling 0. S = 300 and 257 give the wgmma kernels 3 to 5 key tiles
 * (the pipelined steps and both P buffers; with 4 stages the TMA ring wraps), S = 100 with 64-key
 * tiles a key tile wholly after the first warpgroup's queries (fully masked), S = 1 a Q box that
 * is mostly out of bounds. */
Test(gpu, attention_tc_vs_cpu)
{
    mt_rng rng;
    mt_rng_seed(&rng, 108);
    struct mode M;
    mode_get(1, &M);
    for (int variant = 0; variant < 9; variant++) {
        tc_case(&M, &rng, 2, 100, 8, 2, 128, variant);
        tc_case(&M, &rng, 2, 257, 8, 2, 64, variant);
        tc_case(&M, &rng, 1, 257, 4, 4, 128, variant);
        tc_case(&M, &rng, 1, 1, 2, 1, 128, variant);
        tc_case(&M, &rng, 1, 300, 4, 2, 128, variant);
    }
    tc_case(&M, &rng, 2, 128, 6, 3, 128, 0);
    tc_case(&M, &rng, 1, 300, 8, 8, 64, 0);
    tc_case(&M, &rng, 1, 64, 4, 1, 128, 1);
}

/* Every backward kernel choice (attention_tc_set_bwd_variant: mma.sync or one of three wgmma
 * tilings for each of the dK/dV and dQ passes) against the CPU, rerun bit for bit (tc_case):
 * ragged S against both the 64- and 128-row tiles, grouped and ungrouped heads, D 128 and 64;
 * the pairs of the same kind also on S = 1, exact tiles and a longer S. */
Test(gpu, attention_tc_bwd_variants)
{
    mt_rng rng;
    mt_rng_seed(&rng, 111);
    struct mode M;
    mode_get(1, &M);
    const int old = attention_tc_set_bwd_variant(0);
    for (int var = 0; var < 16; var++) {
        fprintf(stderr, "gpu attention tc backward variant %d (dkdv %d, dq %d)\n", var, var % 4, var / 4);
        attention_tc_set_bwd_variant(var);
        tc_case(&M, &rng, 1, 300, 4, 2, 128, 0);
        tc_case(&M, &rng, 2, 193, 4, 4, 64, 0);
        if (var % 5 == 0) {
            tc_case(&M, &rng, 1, 1, 2, 1, 128, 0);
            tc_case(&M, &rng, 2, 128, 6, 3, 128, 0);
            tc_case(&M, &rng, 1, 64, 4, 1, 64, 0);
            tc_case(&M, &rng, 1, 520, 8, 2, 128, 0);
        }
    }
    attention_tc_set_bwd_variant(old);
}

/* Cases the tensor-core kernels leave to attention.cu: they must decline without touching
 * anything (D not 64/128, a misaligned pointer). */
Test(gpu, attention_tc_declines)
{
    struct mode M;
    mode_get(1, &M);
    const int B = 1, S = 8, Hq = 2, Hkv = 1;
    void *d = dx_poisoned(&M, (size_t)B * S * Hq * 128 + 8);
    float *l = df_poisoned(&M, (size_t)B * Hq * S);
    cr_expect(!attention_tc_forward(d, l, d, d, d, B, S, Hq, Hkv, 80));
    cr_expect(!attention_tc_backward(d, d, d, d, d, d, d, d, l, B, S, Hq, Hkv, 96));
    char *odd = (char *)d + 2;
    cr_expect(!attention_tc_forward(odd, l, d, d, d, B, S, Hq, Hkv, 64));
    cr_expect(!attention_tc_backward(d, d, d, d, odd, d, d, d, l, B, S, Hq, Hkv, 128));
    M.g->free(d), M.g->free(l);
}

/* New kernels against the fp32 CUDA-core kernels of attention.cu (what the bf16 backend ran
 * before) on the same bf16 inputs at S = 1024: forward on each, then each backward from the
 * tensor-core forward's out/lse. */
Test(gpu, attention_tc_vs_simt)
{
    mt_rng rng;
    mt_rng_seed(&rng, 109);
    struct mode M;
    mode_get(1, &M);
    const int B = 2, S = 1024, Hq = 8, Hkv = 2, D = 128;
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * Hq * S;
    float *q = hrand(&rng, nq, 1.0), *k = hrand(&rng, nk, 1.0), *v = hrand(&rng, nk, 1.0);
    float *dout = hrand(&rng, nq, 1.0);
    void *d_q = dx_from(&M, q, nq), *d_k = dx_from(&M, k, nk), *d_v = dx_from(&M, v, nk);
    void *d_dout = dx_from(&M, dout, nq);
    void *o_tc = dx_poisoned(&M, nq), *o_st = dx_poisoned(&M, nq);
    float *l_tc = df_poisoned(&M, nl), *l_st = df_poisoned(&M, nl);
    cr_assert(attention_tc_forward(o_tc, l_tc, d_q, d_k, d_v, B, S, Hq, Hkv, D));
    attention_simt_forward(o_st, l_st, d_q, d_k, d_v, B, S, Hq, Hkv, D);
    float *a = hx_of(&M, o_tc, nq), *b = hx_of(&M, o_st, nq);
    check_tc(&M, "tc vs simt fwd out B2 S1024 H8/2 D128", a, b, nq);
    free(a), free(b);
    a = hf_of(&M, l_tc, nl), b = hf_of(&M, l_st, nl);
    check_lse(&M, "tc vs simt fwd lse B2 S1024 H8/2 D128", a, b, nl);
    free(a), free(b);

    void *g_tc[3], *g_st[3];
    const size_t n[3] = {nq, nk, nk};
    for (int i = 0; i < 3; i++) g_tc[i] = dx_poisoned(&M, n[i]), g_st[i] = dx_poisoned(&M, n[i]);
    cr_assert(attention_tc_backward(g_tc[0], g_tc[1], g_tc[2], d_dout, d_q, d_k, d_v, o_tc, l_tc, B,
                                    S, Hq, Hkv, D));
    attention_simt_backward(g_st[0], g_st[1], g_st[2], d_dout, d_q, d_k, d_v, o_tc, l_tc, B, S, Hq,
                            Hkv, D);
    for (int i = 0; i < 3; i++) {
        char what[96];
        snprintf(what, sizeof what, "tc vs simt bwd d%c B2 S1024 H8/2 D128", "qkv"[i]);
        a = hx_of(&M, g_tc[i], n[i]), b = hx_of(&M, g_st[i], n[i]);
        check_tc(&M, what, a, b, n[i]);
        free(a), free(b);
        M.g->free(g_tc[i]), M.g->free(g_st[i]);
    }
    M.g->free(d_q), M.g->free(d_k), M.g->free(d_v), M.g->free(d_dout);
    M.g->free(o_tc), M.g->free(o_st), M.g->free(l_tc), M.g->free(l_st);
    free(q), free(k), free(v), free(dout);
}

/* The bf16 backend table runs the tensor-core kernels where they apply: its results are the
 * same bits as attention_tc_* (the CUDA-core kernels would differ in rounding). */
Test(gpu, attention_backend_uses_tc)
{
    mt_rng rng;
    mt_rng_seed(&rng, 110);
    struct mode M;
    mode_get(1, &M);
    const int B = 1, S = 150, Hq = 4, Hkv = 2, D = 128;
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * Hq * S;
    float *q = hrand(&rng, nq, 1.0), *k = hrand(&rng, nk, 1.0), *v = hrand(&rng, nk, 1.0);
    float *dout = hrand(&rng, nq, 1.0);
    void *d_q = dx_from(&M, q, nq), *d_k = dx_from(&M, k, nk), *d_v = dx_from(&M, v, nk);
    void *d_dout = dx_from(&M, dout, nq);
    const size_t n[5] = {nq, nq, nk, nk, nl};
    const size_t bytes[5] = {nq * 2, nq * 2, nk * 2, nk * 2, nl * 4};
    void *r[2][5]; /* [table, direct][out, dq, dk, dv, lse] */
    for (int w = 0; w < 2; w++) {
        for (int i = 0; i < 4; i++) r[w][i] = dx_poisoned(&M, n[i]);
        r[w][4] = df_poisoned(&M, nl);
        if (w == 0) {
            M.g->attention_forward(r[w][0], r[w][4], d_q, d_k, d_v, B, S, Hq, Hkv, D, NULL);
            M.g->attention_backward(r[w][1], r[w][2], r[w][3], d_dout, d_q, d_k, d_v, r[w][0],
                                    r[w][4], B, S, Hq, Hkv, D, NULL);
        } else {
            cr_assert(attention_tc_forward(r[w][0], r[w][4], d_q, d_k, d_v, B, S, Hq, Hkv, D));
            cr_assert(attention_tc_backward(r[w][1], r[w][2], r[w][3], d_dout, d_q, d_k, d_v,
                                            r[w][0], r[w][4], B, S, Hq, Hkv, D));
        }
    }
    const char *names[5] = {"out", "dq", "dk", "dv", "lse"};
    for (int i = 0; i < 5; i++) {
        char what[64];
        snprintf(what, sizeof what, "backend table = tc kernels: %s", names[i]);
        void *a = hraw_of(&M, r[0][i], bytes[i]), *b = hraw_of(&M, r[1][i], bytes[i]);
        check_exact(&M, what, a, b, bytes[i]);
        free(a), free(b);
        M.g->free(r[0][i]), M.g->free(r[1][i]);
    }
    M.g->free(d_q), M.g->free(d_k), M.g->free(d_v), M.g->free(d_dout);
    free(q), free(k), free(v), free(dout);
}
#endif /* MT_HAVE_CUDA */

/* ---------------------------------------------------------------- router */

static void router_case_opts(const struct mode *M, mt_rng *rng, int T, int E, int K,
                             const struct router_opts *o, bool with_bias, bool with_aux)
{
    char tag[128], what[192];
    snprintf(tag, sizeof tag, "T%d E%d k%d%s%s%s%s scale %g groups %d/%d%s", T, E, K,
             o->norm_topk ? " norm" : "", with_bias ? " bias" : "", with_aux ? " aux" : "",
             o->sigmoid ? " sigmoid" : "", o->route_scale, o->topk_group, o->n_group,
             o->force_balance ? " round-robin" : "");
    const size_t te = (size_t)T * E, tk = (size_t)T * K;
    float *logits = hrand(rng, te, 2.0);
    /* row 0: all equal (every choice is a tie); row 1: equal pairs */
    for (int e = 0; e < E; e++) logits[e] = 0.25f;
    for (int e = 0; e < E; e++) logits[E + e] = (float)(e / 2) * 0.125f;
    float *bias = with_bias ? hrand(rng, E, 0.01) : NULL;
    float *d_logits = df_from(M, logits, te); /* fp32 in both modes (ops.h) */
    float *d_bias = with_bias ? df_from(M, bias, E) : NULL;

    int32_t *d_idx = M->g->alloc(tk * sizeof(int32_t));
    poison(M, d_idx, tk * sizeof(int32_t));
    float *d_w = df_poisoned(M, tk), *d_probs = df_poisoned(M, te);
    M->g->router_forward(d_idx, d_w, d_probs, d_logits, d_bias, T, E, K, o);
    int32_t *idx = mt_malloc(tk * sizeof(int32_t)), *idx_ref = mt_malloc(tk * sizeof(int32_t));
    M->g->download(idx, d_idx, tk * sizeof(int32_t));
    float *w = hf_of(M, d_w, tk), *probs = hf_of(M, d_probs, te);
    float *w_ref = fnew(tk), *probs_ref = fnew(te);
    M->c->router_forward(idx_ref, w_ref, probs_ref, logits, bias, T, E, K, o);
    snprintf(what, sizeof what, "router forward topk_idx %s", tag);
    check_exact(M, what, idx, idx_ref, tk * sizeof(int32_t));
    snprintf(what, sizeof what, "router forward probs %s", tag);
    check_close(M, what, probs, probs_ref, te, TOL_F32);
    snprintf(what, sizeof what, "router forward topk_w %s", tag);
    check_close(M, what, w, w_ref, tk, TOL_F32);

    /* the weights of a given selection (data.routing_replay), from the CPU's probs and top-k */
    float *d_wg = df_poisoned(M, tk);
    {
        float *d_pr = df_from(M, probs_ref, te);
        int32_t *d_ir = di_from(M, idx_ref, tk);
        M->g->router_gather_weights(d_wg, d_pr, d_ir, T, E, K, o);
        float *wg = hf_of(M, d_wg, tk), *wg_ref = fnew(tk);
        M->c->router_gather_weights(wg_ref, probs_ref, idx_ref, T, E, K, o);
        snprintf(what, sizeof what, "router_gather_weights %s", tag);
        check_close(M, what, wg, wg_ref, tk, TOL_F32);
        M->g->free(d_pr), M->g->free(d_ir), M->g->free(d_wg);
        free(wg), free(wg_ref);
    }

    /* backward from the CPU's forward outputs, so both see the same selection */
    float *dtw = hrand(rng, tk, 1.0), *aux = with_aux ? hrand(rng, E, 0.1) : NULL;
    float *d_dtw = df_from(M, dtw, tk), *d_aux = with_aux ? df_from(M, aux, E) : NULL;
    float *d_probs_ref = df_from(M, probs_ref, te);
    int32_t *d_idx_ref = di_from(M, idx_ref, tk);
    float *d_dlogits = df_poisoned(M, te);
    M->g->router_backward(d_dlogits, d_dtw, d_probs_ref, d_idx_ref, d_aux, T, E, K, o);
    float *dl = hf_of(M, d_dlogits, te), *dl_ref = fnew(te);
    M->c->router_backward(dl_ref, dtw, probs_ref, idx_ref, aux, T, E, K, o);
    snprintf(what, sizeof what, "router backward dlogits %s", tag);
    check_close(M, what, dl, dl_ref, te, TOL_F32);

    /* statistics accumulate onto starting values (counts start at whole numbers) */
    float *psum0 = hrand(rng, E, 1.0), *cnt0 = fnew(E);
    for (int e = 0; e < E; e++) cnt0[e] = (float)irand(rng, 50);
    float *d_psum = df_from(M, psum0, E), *d_cnt = df_from(M, cnt0, E);
    M->g->router_stats(d_psum, d_cnt, d_probs_ref, d_idx_ref, T, E, K);
    float *psum = hf_of(M, d_psum, E), *cnt = hf_of(M, d_cnt, E);
    float *psum_ref = hdup(psum0, E), *cnt_ref = hdup(cnt0, E);
    M->c->router_stats(psum_ref, cnt_ref, probs_ref, idx_ref, T, E, K);
    float *add = diff(psum, psum0, E), *add_ref = diff(psum_ref, psum0, E);
    snprintf(what, sizeof what, "router_stats psum (added) %s", tag);
    check_close(M, what, add, add_ref, E, TOL_F32_LONG); /* T-long fp32 sums on the CPU */
    snprintf(what, sizeof what, "router_stats count %s", tag);
    check_exact(M, what, cnt, cnt_ref, E * sizeof(float));

    M->g->free(d_logits), M->g->free(d_bias), M->g->free(d_idx), M->g->free(d_w);
    M->g->free(d_probs), M->g->free(d_dtw), M->g->free(d_aux), M->g->free(d_probs_ref);
    M->g->free(d_idx_ref), M->g->free(d_dlogits), M->g->free(d_psum), M->g->free(d_cnt);
    free(logits), free(bias), free(idx), free(idx_ref), free(w), free(probs), free(w_ref);
    free(probs_ref), free(dtw), free(aux), free(dl), free(dl_ref), free(psum0), free(cnt0);
    free(psum), free(cnt), free(psum_ref), free(cnt_ref), free(add), free(add_ref);
}

static void router_case(const struct mode *M, mt_rng *rng, int T, int E, int K, bool norm,
                        bool with_bias, bool with_aux)
{
    const struct router_opts o = {.norm_topk = norm, .route_scale = 1, .n_group = 1, .topk_group = 1};
    router_case_opts(M, rng, T, E, K, &o, with_bias, with_aux);
}

/* model.scoring, route_scale, n_group/topk_group, debug_force_balance (docs/router.md): the same
 * fresh random inputs through both routers; indices exact, weights and dlogits to TOL_F32. */
Test(gpu, router_variants)
{
    mt_rng rng;
    mt_rng_seed(&rng, 109);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        struct router_opts o = {.sigmoid = true, .norm_topk = true, .route_scale = 2.5f, .n_group = 8,
                                .topk_group = 4, .force_balance = false};
        router_case_opts(&M, &rng, 256, 64, 8, &o, true, true);   /* DeepSeek-V3-like */
        o.norm_topk = false, o.n_group = 1, o.topk_group = 1;
        router_case_opts(&M, &rng, 300, 8, 2, &o, false, true);   /* sigmoid, unnormalised */
        o.sigmoid = false, o.norm_topk = true, o.n_group = 40, o.topk_group = 3;
        router_case_opts(&M, &rng, 64, 200, 5, &o, true, false);  /* groups of 5, E > block */
        o.n_group = 1, o.topk_group = 1, o.force_balance = true;
        router_case_opts(&M, &rng, 100, 64, 8, &o, false, true);  /* round-robin */
    }
}

Test(gpu, router)
{
    mt_rng rng;
    mt_rng_seed(&rng, 108);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        router_case(&M, &rng, 256, 64, 8, true, false, true);
        router_case(&M, &rng, 256, 64, 8, true, true, false);
        router_case(&M, &rng, 300, 8, 2, false, false, true);
        router_case(&M, &rng, 64, 200, 5, true, true, true); /* E above the block size */
    }
}

/* ---------------------------------------------------------------- gather / scatter */

static void gather_case(const struct mode *M, mt_rng *rng, const char *tag, const int32_t *idx,
                        int R, int n_in, int H)
{
    char what[96];
    const size_t nr = (size_t)R * H, ni = (size_t)n_in * H;
    float *in = hrand(rng, ni, 1.0), *dout = hrand(rng, nr, 1.0);
    void *d_in = dx_from(M, in, ni), *d_dout = dx_from(M, dout, nr);
    int32_t *d_idx = di_from(M, idx, R);

    void *d_out = dx_poisoned(M, nr);
    M->g->gather_rows(d_out, d_in, d_idx, R, H);
    float *out = hx_of(M, d_out, nr), *ref = fnew(nr);
    M->c->gather_rows(ref, in, idx, R, H);
    snprintf(what, sizeof what, "gather_rows forward %s", tag);
    check_exact(M, what, out, ref, nr * sizeof(float));

    float *din0 = hrand(rng, ni, 1.0), *din_ref = hdup(din0, ni);
    void *d_din = dx_from(M, din0, ni);
    M->g->gather_rows_backward(d_din, d_dout, d_idx, R, H);
    M->c->gather_rows_backward(din_ref, dout, idx, R, H);
    float *din = hx_of(M, d_din, ni);
    snprintf(what, sizeof what, "gather_rows backward %s", tag);
    check_close(M, what, din, din_ref, ni, M->tol);

    /* deterministic: a second run from the same start gives the same bits */
    void *d_din2 = dx_from(M, din0, ni);
    M->g->gather_rows_backward(d_din2, d_dout, d_idx, R, H);
    float *din2 = hx_of(M, d_din2, ni);
    snprintf(what, sizeof what, "gather_rows backward repeatable %s", tag);
    check_exact(M, what, din2, din, ni * sizeof(float));

    M->g->free(d_in), M->g->free(d_dout), M->g->free(d_idx), M->g->free(d_out), M->g->free(d_din);
    M->g->free(d_din2);
    free(in), free(dout), free(out), free(ref), free(din0), free(din_ref), free(din), free(din2);
}

Test(gpu, gather_rows)
{
    mt_rng rng;
    mt_rng_seed(&rng, 109);
    enum { R = 512, H = 256, FEW = 64 };
    int32_t perm[R], many[R];
    for (int r = 0; r < R; r++) perm[r] = r;
    shuffle(&rng, perm, R);
    for (int r = 0; r < R; r++) many[r] = irand(&rng, FEW); /* ~8 sources per destination */
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        gather_case(&M, &rng, "permutation", perm, R, R, H);
        gather_case(&M, &rng, "many-to-one", many, R, FEW, H);
    }
}

/* rows of 257 chunks of 8 (several unrolled rounds per lane, a ragged last one), rows whose bytes
 * are a multiple of 16 only in fp32 (H = 100: vector gather, scalar scatter), and short rows that
 * take the scalar kernels (H = 12 in bf16) */
Test(gpu, gather_rows_shapes)
{
    mt_rng rng;
    mt_rng_seed(&rng, 119);
    enum { R = 96, FEW = 20 };
    int32_t perm[R], many[R];
    for (int r = 0; r < R; r++) perm[r] = r;
    shuffle(&rng, perm, R);
    for (int r = 0; r < R; r++) many[r] = irand(&rng, FEW);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        gather_case(&M, &rng, "permutation H=2056", perm, R, R, 2056);
        gather_case(&M, &rng, "many-to-one H=2056", many, R, FEW, 2056);
        gather_case(&M, &rng, "many-to-one H=100", many, R, FEW, 100);
        gather_case(&M, &rng, "permutation H=12", perm, R, R, 12);
    }
}

/* ---------------------------------------------------------------- moe combine */

Test(gpu, moe_combine)
{
    mt_rng rng;
    mt_rng_seed(&rng, 110);
    enum { T = 128, K = 4, H = 256, R = T * K };
    int32_t slot[R];
    for (int r = 0; r < R; r++) slot[r] = r;
    shuffle(&rng, slot, R);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        float *y = hrand(&rng, (size_t)R * H, 1.0), *dout = hrand(&rng, (size_t)T * H, 1.0);
        float *w = fnew(R);
        for (int r = 0; r < R; r++) w[r] = (float)mt_rng_uniform(&rng) + 0.05f;
        void *d_y = dx_from(&M, y, (size_t)R * H), *d_dout = dx_from(&M, dout, (size_t)T * H);
        float *d_w = df_from(&M, w, R);
        int32_t *d_slot = di_from(&M, slot, R);

        void *d_out = dx_poisoned(&M, (size_t)T * H);
        M.g->moe_combine_forward(d_out, d_y, d_slot, d_w, T, K, H);
        float *out = hx_of(&M, d_out, (size_t)T * H), *ref = fnew((size_t)T * H);
        M.c->moe_combine_forward(ref, y, slot, w, T, K, H);
        check_close(&M, "moe_combine forward", out, ref, (size_t)T * H, M.tol);

        void *d_dy = dx_poisoned(&M, (size_t)R * H);
        float *d_dw = df_poisoned(&M, R);
        M.g->moe_combine_backward(d_dy, d_dw, d_dout, d_y, d_slot, d_w, T, K, H);
        float *dy = hx_of(&M, d_dy, (size_t)R * H), *dw = hf_of(&M, d_dw, R);
        float *dy_ref = fnew((size_t)R * H), *dw_ref = fnew(R);
        M.c->moe_combine_backward(dy_ref, dw_ref, dout, y, slot, w, T, K, H);
        check_close(&M, "moe_combine backward dy", dy, dy_ref, (size_t)R * H, M.tol);
        check_close(&M, "moe_combine backward dw", dw, dw_ref, R, M.tol);

        M.g->free(d_y), M.g->free(d_dout), M.g->free(d_w), M.g->free(d_slot), M.g->free(d_out);
        M.g->free(d_dy), M.g->free(d_dw);
        free(y), free(dout), free(w), free(out), free(ref), free(dy), free(dw), free(dy_ref),
            free(dw_ref);
    }
}

/* n_empty of the T·K slots are empty (-1): they add nothing, and the backward leaves their dw (set
 * to 7 beforehand) alone. H = 2056 takes the vector kernels in several segments per row, H = 20
 * the scalar ones. */
static void combine_case(const struct mode *M, mt_rng *rng, int T, int K, int H, int n_empty)
{
    char what[96];
    const int S = T * K, R = S - n_empty;
    int32_t *slot = mt_malloc((size_t)S * sizeof *slot);
    for (int r = 0; r < S; r++) slot[r] = r < R ? r : -1;
    shuffle(rng, slot, S);
    float *y = hrand(rng, (size_t)R * H, 1.0), *dout = hrand(rng, (size_t)T * H, 1.0);
    float *w = fnew(S), *sevens = fnew(S);
    for (int r = 0; r < S; r++) w[r] = (float)mt_rng_uniform(rng) + 0.05f, sevens[r] = 7.0f;
    void *d_y = dx_from(M, y, (size_t)R * H), *d_dout = dx_from(M, dout, (size_t)T * H);
    float *d_w = df_from(M, w, S);
    int32_t *d_slot = di_from(M, slot, S);

    void *d_out = dx_poisoned(M, (size_t)T * H);
    M->g->moe_combine_forward(d_out, d_y, d_slot, d_w, T, K, H);
    float *out = hx_of(M, d_out, (size_t)T * H), *ref = fnew((size_t)T * H);
    M->c->moe_combine_forward(ref, y, slot, w, T, K, H);
    snprintf(what, sizeof what, "moe_combine forward T%d k%d H%d empty %d", T, K, H, n_empty);
    check_close(M, what, out, ref, (size_t)T * H, M->tol);

    void *d_dy = dx_poisoned(M, (size_t)R * H);
    float *d_dw = df_from(M, sevens, S);
    M->g->moe_combine_backward(d_dy, d_dw, d_dout, d_y, d_slot, d_w, T, K, H);
    float *dy = hx_of(M, d_dy, (size_t)R * H), *dw = hf_of(M, d_dw, S);
    float *dy_ref = fnew((size_t)R * H), *dw_ref = hdup(sevens, S);
    M->c->moe_combine_backward(dy_ref, dw_ref, dout, y, slot, w, T, K, H);
    snprintf(what, sizeof what, "moe_combine backward dy T%d k%d H%d empty %d", T, K, H, n_empty);
    check_close(M, what, dy, dy_ref, (size_t)R * H, M->tol);
    snprintf(what, sizeof what, "moe_combine backward dw T%d k%d H%d empty %d", T, K, H, n_empty);
    check_close(M, what, dw, dw_ref, S, M->tol);

    M->g->free(d_y), M->g->free(d_dout), M->g->free(d_w), M->g->free(d_slot), M->g->free(d_out);
    M->g->free(d_dy), M->g->free(d_dw);
    free(slot), free(y), free(dout), free(w), free(sevens), free(out), free(ref), free(dy), free(dw);
    free(dy_ref), free(dw_ref);
}

Test(gpu, moe_combine_shapes)
{
    mt_rng rng;
    mt_rng_seed(&rng, 120);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        combine_case(&M, &rng, 40, 3, 2056, 0);
        combine_case(&M, &rng, 64, 8, 256, 37);
        combine_case(&M, &rng, 33, 4, 20, 5);
    }
}

/* ---------------------------------------------------------------- expert matmul */

Test(gpu, expert_matmul)
{
    mt_rng rng;
    mt_rng_seed(&rng, 111);
    enum { NE = 6, I = 256, O = 192 };
    const int rows[NE] = {40, 0, 17, 64, 0, 35}; /* experts 1 and 4 get no rows */
    int64_t off[NE + 1] = {0};
    for (int e = 0; e < NE; e++) off[e + 1] = off[e] + rows[e];
    const int R = (int)off[NE];
    const size_t ri = (size_t)R * I, ro = (size_t)R * O, wn = (size_t)NE * O * I;
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        float *in = hrand(&rng, ri, 1.0), *w = hrand(&rng, wn, 0.05), *dout = hrand(&rng, ro, 1.0);
        void *d_in = dx_from(&M, in, ri), *d_w = dx_from(&M, w, wn), *d_dout = dx_from(&M, dout, ro);

        void *d_out = dx_poisoned(&M, ro);
        M.g->expert_matmul_forward(d_out, d_in, d_w, off, NE, I, O);
        float *out = hx_of(&M, d_out, ro), *ref = fnew(ro);
        M.c->expert_matmul_forward(ref, in, w, off, NE, I, O);
        check_close(&M, "expert_matmul forward", out, ref, ro, M.tol);

        float *dw0 = hrand(&rng, wn, 1.0), *dw_ref = hdup(dw0, wn);
        float *d_dw = df_from(&M, dw0, wn);
        void *d_din = dx_poisoned(&M, ri);
        M.g->expert_matmul_backward(d_din, d_dw, d_dout, d_in, d_w, off, NE, I, O, false);
        float *din = hx_of(&M, d_din, ri), *dw = hf_of(&M, d_dw, wn), *din_ref = fnew(ri);
        M.c->expert_matmul_backward(din_ref, dw_ref, dout, in, w, off, NE, I, O, false);
        check_close(&M, "expert_matmul backward din", din, din_ref, ri, M.tol);
        float *add = diff(dw, dw0, wn), *add_ref = diff(dw_ref, dw0, wn);
        check_close(&M, "expert_matmul backward dw (added)", add, add_ref, wn, M.tol);
        for (int e = 0; e < NE; e++)
            if (rows[e] == 0) {
                const size_t o = (size_t)e * O * I;
                check_exact(&M, "expert_matmul empty expert keeps dw", dw + o, dw0 + o,
                            (size_t)O * I * sizeof(float));
            }

        M.g->free(d_in), M.g->free(d_w), M.g->free(d_dout), M.g->free(d_out), M.g->free(d_dw);
        M.g->free(d_din);
        free(in), free(w), free(dout), free(out), free(ref), free(dw0), free(dw_ref), free(din);
        free(dw), free(din_ref), free(add), free(add_ref);
    }
}

/* The grouped Hopper kernel behind the bf16 expert_matmul (cuda/grouped_gemm.cu), case by case:
 * every output is checked per expert, so a tile that reads or writes a neighbour's rows (the
 * ragged edges: 0, 1, 127, 129 rows; the wgrad K loop stopping at the expert's end) shows even
 * when the neighbour is much larger. w_off shifts the weights off 16-byte alignment, which the
 * kernel does not take for forward and dgrad (cuBLAS does the work then). In bf16 mode the
 * kernel is also called directly: it must accept exactly the cases `kernel` (forward, dgrad) and
 * `kernel_wgrad` say, and give the same bits as the backend op (the same deterministic kernel).
 * dw tolerance: fp32 sums of exact products of bf16 values, differing from the CPU only in
 * order, ~1e-6; 1e-4 in both modes. */
static void grouped_case(const struct mode *M, mt_rng *rng, const char *tag, int NE, const int *rows,
                         int I, int O, int w_off, bool kernel, bool kernel_wgrad)
{
    char what[128];
    int64_t *off = mt_calloc((size_t)NE + 1, sizeof *off);
    for (int e = 0; e < NE; e++) off[e + 1] = off[e] + rows[e];
    const int R = (int)off[NE];
    const size_t ri = (size_t)R * I, ro = (size_t)R * O, wn = (size_t)NE * O * I;
    const size_t xs = M->g->x_size;
    float *in = hrand(rng, ri, 1.0), *wfull = hrand(rng, wn + w_off, 0.05), *dout = hrand(rng, ro, 1.0);
    void *d_in = dx_from(M, in, ri), *d_dout = dx_from(M, dout, ro);
    void *d_wfull = dx_from(M, wfull, wn + w_off);
    const float *w = wfull + w_off;
    const void *d_w = (const char *)d_wfull + (size_t)w_off * xs;

    /* forward */
    void *d_out = dx_poisoned(M, ro);
    M->g->expert_matmul_forward(d_out, d_in, d_w, off, NE, I, O);
    float *out = hx_of(M, d_out, ro), *ref = fnew(ro);
    M->c->expert_matmul_forward(ref, in, w, off, NE, I, O);

    /* backward: din overwritten, dw accumulated onto random values */
    float *dw0 = hrand(rng, wn, 1.0), *dw_ref = hdup(dw0, wn);
    float *d_dw = df_from(M, dw0, wn);
    void *d_din = dx_poisoned(M, ri);
    M->g->expert_matmul_backward(d_din, d_dw, d_dout, d_in, d_w, off, NE, I, O, false);
    float *din = hx_of(M, d_din, ri), *dw = hf_of(M, d_dw, wn), *din_ref = fnew(ri);
    M->c->expert_matmul_backward(din_ref, dw_ref, dout, in, w, off, NE, I, O, false);
    float *add = diff(dw, dw0, wn), *add_ref = diff(dw_ref, dw0, wn);

    double e_out = 0.0, e_din = 0.0, e_dw = 0.0;
    bool empty_kept = true;
    for (int e = 0; e < NE; e++) {
        const size_t oi = (size_t)e * O * I;
        if (rows[e] == 0) {
            empty_kept = empty_kept && memcmp(dw + oi, dw0 + oi, (size_t)O * I * sizeof(float)) == 0;
            continue;
        }
        const double a = rel_err(out + off[e] * O, ref + off[e] * O, (size_t)rows[e] * O);
        const double b = rel_err(din + off[e] * I, din_ref + off[e] * I, (size_t)rows[e] * I);
        const double c = rel_err(add + oi, add_ref + oi, (size_t)O * I);
        cr_expect(a <= M->tol && b <= M->tol && c <= TOL_F32_LONG,
                  "grouped %s [%s] expert %d (%d rows): rel err out %.2e din %.2e dw %.2e", tag,
                  M->name, e, rows[e], a, b, c);
        e_out = fmax(e_out, a), e_din = fmax(e_din, b), e_dw = fmax(e_dw, c);
    }
    fprintf(stderr, "gpu %s grouped %-36s worst expert: out %.2e din %.2e dw %.2e\n", M->name, tag,
            e_out, e_din, e_dw);
    snprintf(what, sizeof what, "grouped %s: empty experts keep dw", tag);
    fprintf(stderr, "gpu %s %-44s %s\n", M->name, what, empty_kept ? "bit-exact" : "DIFFERS");
    cr_expect(empty_kept, "%s [%s]", what, M->name);

    /* dw alone (din NULL): a second backward adds the same gradient again */
    M->g->expert_matmul_backward(NULL, d_dw, d_dout, d_in, d_w, off, NE, I, O, false);
    float *dw2 = hf_of(M, d_dw, wn), *add2 = diff(dw2, dw, wn);
    snprintf(what, sizeof what, "grouped %s: dw += again (din NULL)", tag);
    check_close(M, what, add2, add_ref, wn, TOL_F32_LONG);
    float *din_again = hx_of(M, d_din, ri);
    snprintf(what, sizeof what, "grouped %s: din NULL leaves din", tag);
    check_exact(M, what, din_again, din, ri * sizeof(float));

    /* dw_overwrite into NaN: the same bits as adding onto zeros, zeros for experts with no rows */
    float *zeros = fnew(wn), *nans = fnew(wn);
    for (size_t i = 0; i < wn; i++) nans[i] = NAN;
    float *d_dwz = df_from(M, zeros, wn), *d_dwo = df_from(M, nans, wn);
    M->g->expert_matmul_backward(NULL, d_dwz, d_dout, d_in, d_w, off, NE, I, O, false);
    M->g->expert_matmul_backward(NULL, d_dwo, d_dout, d_in, d_w, off, NE, I, O, true);
    float *dwz = hf_of(M, d_dwz, wn), *dwo = hf_of(M, d_dwo, wn);
    snprintf(what, sizeof what, "grouped %s: dw overwrite = zeros + add", tag);
    check_exact(M, what, dwo, dwz, wn * sizeof(float));
    snprintf(what, sizeof what, "grouped %s: dw overwrite (vs CPU)", tag);
    check_close(M, what, dwo, add_ref, wn, TOL_F32_LONG);
    M->g->free(d_dwz), M->g->free(d_dwo);
    free(zeros), free(nans), free(dwz), free(dwo);

#ifdef MT_HAVE_CUDA
    if (xs == 2) {
        /* on the sm_80 path (not a 9.0 device, or MT_FORCE_SM80=1) the kernel declines them all */
        kernel = kernel && grouped_gemm_available();
        kernel_wgrad = kernel_wgrad && grouped_gemm_available();
        void *d_out2 = dx_poisoned(M, ro), *d_din2 = dx_poisoned(M, ri);
        float *d_dw2 = df_from(M, dw0, wn);
        const bool f = grouped_gemm_forward(d_out2, d_in, d_w, off, NE, I, O);
        const bool g = grouped_gemm_dgrad(d_din2, d_dout, d_w, off, NE, I, O);
        const bool h = grouped_gemm_wgrad(d_dw2, d_dout, d_in, off, NE, I, O, false);
        cr_expect(f == kernel && g == kernel && h == kernel_wgrad,
                  "grouped %s: kernel took fwd %d dgrad %d wgrad %d, expected %d %d %d", tag, f, g,
                  h, kernel, kernel, kernel_wgrad);
        if (kernel && kernel_wgrad) {
            float *out2 = hx_of(M, d_out2, ro), *din2 = hx_of(M, d_din2, ri), *dw3 = hf_of(M, d_dw2, wn);
            snprintf(what, sizeof what, "grouped %s: direct call = op (fwd)", tag);
            check_exact(M, what, out2, out, ro * sizeof(float));
            snprintf(what, sizeof what, "grouped %s: direct call = op (dgrad)", tag);
            check_exact(M, what, din2, din, ri * sizeof(float));
            snprintf(what, sizeof what, "grouped %s: direct call = op (wgrad)", tag);
            check_exact(M, what, dw3, dw, wn * sizeof(float));
            free(out2), free(din2), free(dw3);
        }
        M->g->free(d_out2), M->g->free(d_din2), M->g->free(d_dw2);
    }
#endif

    M->g->free(d_in), M->g->free(d_wfull), M->g->free(d_dout), M->g->free(d_out), M->g->free(d_dw);
    M->g->free(d_din);
    free(off), free(in), free(wfull), free(dout), free(out), free(ref), free(dw0), free(dw_ref);
    free(din), free(dw), free(din_ref), free(add), free(add_ref), free(dw2), free(add2), free(din_again);
}

Test(gpu, expert_matmul_grouped)
{
    mt_rng rng;
    mt_rng_seed(&rng, 115);
    /* tile edges: 128 rows per tile, 64 rows per wgrad K block, 256 columns per tile */
    const int edges[] = {0, 1, 127, 129, 300, 0, 64, 65};
    const int odd[] = {70, 0, 1, 200, 33};
    const int few[] = {5, 0, 40};
    enum { MANY = 300 }; /* more experts than one launch's schedule holds (256) */
    int many[MANY];
    for (int e = 0; e < MANY; e++) many[e] = irand(&rng, 5);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        grouped_case(&M, &rng, "tile edges 256->512", 8, edges, 256, 512, 0, true, true);
        grouped_case(&M, &rng, "I, O not /64 (200->136)", 5, odd, 200, 136, 0, true, true);
        grouped_case(&M, &rng, "300 experts 64->72", MANY, many, 64, 72, 0, true, true);
        /* dw 904 x 1032 (ragged both ways), 40 wgrad tiles an expert, 240 in all: some CTAs run
         * two, so the ring's stages and phases carry over from one tile to the next */
        grouped_case(&M, &rng, "many tiles 1032->904", 8, edges, 1032, 904, 0, true, true);
        grouped_case(&M, &rng, "I, O not /8 (fallback)", 3, few, 100, 60, 0, false, false);
        {
            /* no rows at all (an EP rank nobody routed to): overwriting still zeroes every dw */
            enum { NE0 = 3, I0 = 64, O0 = 72 };
            const int64_t off0[NE0 + 1] = {0, 0, 0, 0};
            const size_t wn0 = (size_t)NE0 * O0 * I0;
            float *nans = fnew(wn0), *zeros = fnew(wn0);
            for (size_t k = 0; k < wn0; k++) nans[k] = NAN;
            float *d_dw0 = df_from(&M, nans, wn0);
            void *d_x0 = dx_poisoned(&M, (size_t)O0 * I0);
            M.g->expert_matmul_backward(NULL, d_dw0, d_x0, d_x0, d_x0, off0, NE0, I0, O0, true);
            float *dw0 = hf_of(&M, d_dw0, wn0);
            check_exact(&M, "grouped, no rows: dw overwrite gives zeros", dw0, zeros, wn0 * sizeof(float));
            M.g->free(d_dw0), M.g->free(d_x0);
            free(nans), free(zeros), free(dw0);
        }
        /* wgrad does not read w, so only forward and dgrad fall back */
        grouped_case(&M, &rng, "unaligned w (fallback)", 3, few, 64, 64, 1, false, true);
    }
}

/* adamw_update_multi: tests/unit/test_gpu_adamw.c */

/* MT_FORCE_SM80=1 (make test-gpu's sm_80 pass) must really take the sm_80 paths on a Hopper GPU,
 * or that pass would test the Hopper kernels twice. */
Test(gpu, force_sm80_declines_the_hopper_kernels)
{
    struct mode M;
    mode_get(1, &M);
#ifdef MT_HAVE_CUDA
    const bool forced = mt_env_flag("MT_FORCE_SM80");
    fprintf(stderr, "gpu MT_FORCE_SM80=%d: Hopper grouped GEMM %s\n", forced,
            grouped_gemm_available() ? "on" : "off (cuBLAS)");
    if (forced) cr_expect(!grouped_gemm_available(), "MT_FORCE_SM80=1 but the Hopper kernel runs");
#endif
}

/* ---------------------------------------------------------------- swiglu */

Test(gpu, swiglu)
{
    mt_rng rng;
    mt_rng_seed(&rng, 112);
    enum { R = 300, I = 384 };
    const size_t n = (size_t)R * I, n2 = 2 * n;
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        float *gu = hrand(&rng, n2, 2.0), *dout = hrand(&rng, n, 1.0);
        void *d_gu = dx_from(&M, gu, n2), *d_dout = dx_from(&M, dout, n);

        void *d_out = dx_poisoned(&M, n);
        M.g->swiglu_forward(d_out, d_gu, R, I);
        float *out = hx_of(&M, d_out, n), *ref = fnew(n);
        M.c->swiglu_forward(ref, gu, R, I);
        check_close(&M, "swiglu forward", out, ref, n, M.tol);

        void *d_dgu = dx_poisoned(&M, n2);
        M.g->swiglu_backward(d_dgu, d_dout, d_gu, R, I);
        float *dgu = hx_of(&M, d_dgu, n2), *dgu_ref = fnew(n2);
        M.c->swiglu_backward(dgu_ref, dout, gu, R, I);
        check_close(&M, "swiglu backward", dgu, dgu_ref, n2, M.tol);

        /* dgu may alias gu */
        M.g->swiglu_backward(d_gu, d_dout, d_gu, R, I);
        float *alias = hx_of(&M, d_gu, n2);
        check_exact(&M, "swiglu backward in place", alias, dgu, n2 * sizeof(float));

        M.g->free(d_gu), M.g->free(d_dout), M.g->free(d_out), M.g->free(d_dgu);
        free(gu), free(dout), free(out), free(ref), free(dgu), free(dgu_ref), free(alias);
    }
}

/* I not a multiple of 8 (scalar kernels), and small multiples of 8 with odd row counts */
static void swiglu_case(const struct mode *M, mt_rng *rng, int R, int I)
{
    char what[96];
    const size_t n = (size_t)R * I, n2 = 2 * n;
    float *gu = hrand(rng, n2, 2.0), *dout = hrand(rng, n, 1.0);
    void *d_gu = dx_from(M, gu, n2), *d_dout = dx_from(M, dout, n);
    void *d_out = dx_poisoned(M, n);
    M->g->swiglu_forward(d_out, d_gu, R, I);
    float *out = hx_of(M, d_out, n), *ref = fnew(n);
    M->c->swiglu_forward(ref, gu, R, I);
    snprintf(what, sizeof what, "swiglu forward R%d I%d", R, I);
    check_close(M, what, out, ref, n, M->tol);
    void *d_dgu = dx_poisoned(M, n2);
    M->g->swiglu_backward(d_dgu, d_dout, d_gu, R, I);
    float *dgu = hx_of(M, d_dgu, n2), *dgu_ref = fnew(n2);
    M->c->swiglu_backward(dgu_ref, dout, gu, R, I);
    snprintf(what, sizeof what, "swiglu backward R%d I%d", R, I);
    check_close(M, what, dgu, dgu_ref, n2, M->tol);
    M->g->free(d_gu), M->g->free(d_dout), M->g->free(d_out), M->g->free(d_dgu);
    free(gu), free(dout), free(out), free(ref), free(dgu), free(dgu_ref);
}

Test(gpu, swiglu_shapes)
{
    mt_rng rng;
    mt_rng_seed(&rng, 121);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        swiglu_case(&M, &rng, 7, 100);
        swiglu_case(&M, &rng, 33, 24);
        swiglu_case(&M, &rng, 5, 8);
    }
}

/* add_inplace and the casts on views that are not 16-byte aligned (scalar kernels), against the
 * aligned results */
Test(gpu, elementwise_unaligned)
{
    mt_rng rng;
    mt_rng_seed(&rng, 122);
    const size_t n = 1001;
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        const struct backend *g = M.g;
        const size_t xs = g->x_size;
        float *x = hrand(&rng, n, 1.0), *y = hrand(&rng, n, 1.0);
        void *d_x = dx_from(&M, x, n), *d_y = dx_from(&M, y, n);
        g->add_inplace((char *)d_y + xs, (const char *)d_x + xs, n - 1);
        float *sum = hx_of(&M, d_y, n), *ref = fnew(n);
        ref[0] = y[0];
        for (size_t k = 1; k < n; k++) ref[k] = y[k] + x[k];
        check_close(&M, "add_inplace unaligned", sum, ref, n, xs == 4 ? 0.0 : TOL_BF16);

        float *d_f = df_poisoned(&M, n), *zero = fnew(1);
        g->upload(d_f, zero, sizeof(float));
        g->cast_x_to_f32(d_f + 1, (const char *)d_x + xs, n - 1);
        float *back = hf_of(&M, d_f, n);
        x[0] = 0.0f;
        check_exact(&M, "cast x -> f32 unaligned", back, x, n * sizeof(float));

        g->free(d_x), g->free(d_y), g->free(d_f);
        free(x), free(y), free(sum), free(ref), free(zero), free(back);
    }
}

/* ---------------------------------------------------------------- cross-entropy */

/* V = 5000 takes the 16-byte vector path in both dtypes, V = 4099 the scalar one */
Test(gpu, cross_entropy)
{
    mt_rng rng;
    mt_rng_seed(&rng, 113);
    enum { N = 96 };
    const int Vs[] = {5000, 4099};
    for (int vi = 0; vi < 2; vi++) {
        const int V = Vs[vi];
        const size_t nv = (size_t)N * V;
        int32_t tgt[N];
        int valid = 0;
        for (int n = 0; n < N; n++) {
            tgt[n] = irand(&rng, 6) == 0 ? MT_IGNORE_INDEX : irand(&rng, V);
            valid += tgt[n] != MT_IGNORE_INDEX;
        }
        const float scale = 1.0f / (float)valid;
        for (int i = 0; i < 2; i++) {
            struct mode M;
            mode_get(i, &M);
            float *z = hrand(&rng, nv, 3.0);
            void *d_z = dx_from(&M, z, nv);
            int32_t *d_tgt = di_from(&M, tgt, N);

            float *d_loss = df_poisoned(&M, N), *d_lse = df_poisoned(&M, N);
            M.g->cross_entropy_forward(d_loss, d_lse, d_z, d_tgt, N, V);
            float *loss = hf_of(&M, d_loss, N), *loss_ref = fnew(N);
            float *lse = hf_of(&M, d_lse, N), *lse_ref = fnew(N);
            M.c->cross_entropy_forward(loss_ref, lse_ref, z, tgt, N, V);
            check_close(&M, "cross_entropy forward", loss, loss_ref, N, TOL_F32); /* fp32 inside */
            check_close(&M, "cross_entropy lse", lse, lse_ref, N, TOL_F32);

            void *d_dz = dx_poisoned(&M, nv);
            M.g->cross_entropy_backward(d_dz, d_z, d_lse, d_tgt, N, V, scale);
            float *dz = hx_of(&M, d_dz, nv), *dz_ref = fnew(nv);
            M.c->cross_entropy_backward(dz_ref, z, lse_ref, tgt, N, V, scale);
            check_close(&M, "cross_entropy backward", dz, dz_ref, nv, M.tol);

            /* dlogits may alias logits */
            M.g->cross_entropy_backward(d_z, d_z, d_lse, d_tgt, N, V, scale);
            float *alias = hx_of(&M, d_z, nv);
            check_exact(&M, "cross_entropy backward in place", alias, dz, nv * sizeof(float));

            M.g->free(d_z), M.g->free(d_tgt), M.g->free(d_loss), M.g->free(d_lse), M.g->free(d_dz);
            free(z), free(loss), free(loss_ref), free(lse), free(lse_ref), free(dz), free(dz_ref);
            free(alias);
        }
    }
}

/* ---------------------------------------------------------------- adamw */

Test(gpu, adamw)
{
    mt_rng rng;
    mt_rng_seed(&rng, 114);
    const size_t n = 50000;
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        float *master = hrand(&rng, n, 1.0), *grad = hrand(&rng, n, 0.1), *m = hrand(&rng, n, 0.01);
        float *v = hrand(&rng, n, 0.001);
        for (size_t k = 0; k < n; k++) v[k] = fabsf(v[k]);
        float *d_master = df_from(&M, master, n), *d_grad = df_from(&M, grad, n);
        float *d_m = df_from(&M, m, n), *d_v = df_from(&M, v, n);
        void *d_param = dx_poisoned(&M, n);
        const float lr = 1e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.7f;
        const int t = 3;
        M.g->adamw_update(d_master, d_param, d_grad, d_m, d_v, n, lr, b1, b2, eps, wd, t, gs);
        float *param_ref = fnew(n);
        M.c->adamw_update(master, param_ref, grad, m, v, n, lr, b1, b2, eps, wd, t, gs);
        float *gm = hf_of(&M, d_master, n), *g1 = hf_of(&M, d_m, n), *g2 = hf_of(&M, d_v, n);
        float *gp = hx_of(&M, d_param, n);
        /* elementwise fp32: a few ulp at most (fused multiply-adds on the GPU) */
        check_close(&M, "adamw master", gm, master, n, TOL_F32);
        check_close(&M, "adamw m", g1, m, n, TOL_F32);
        check_close(&M, "adamw v", g2, v, n, TOL_F32);
        check_close(&M, "adamw param (compute dtype)", gp, param_ref, n, M.tol);

        M.g->free(d_master), M.g->free(d_grad), M.g->free(d_m), M.g->free(d_v), M.g->free(d_param);
        free(master), free(grad), free(m), free(v), free(param_ref), free(gm), free(g1), free(g2),
            free(gp);
    }
}
