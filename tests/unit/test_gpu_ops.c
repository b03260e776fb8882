/* GPU parity tests (suite "gpu"), the dense ops: backend table, memory and elementwise (casts,
 * add_inplace), embedding, RMSNorm, matmul and router_matmul -- forward and backward, against the
 * fp32 CPU reference (src/cpu/) on the same fresh random inputs, in both CUDA modes; RoPE, SwiGLU,
 * unaligned views, cross-entropy and AdamW are in test_gpu_pointwise.c. Method, tolerances
 * (TOL_F32, TOL_F32_LONG, TOL_BF16) and exact checks: gpu_ops_util.h.
 *
 * Without a CUDA device (backend_cuda returns NULL) every test reports itself skipped; with
 * MT_REQUIRE_GPU=1 (scripts/test-gpu.sh) that is a failure instead. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "gpu_ops_util.h"
#include "ops.h"

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
        /* 16-byte aligned (four floats a load) with n % 4 == 3 above; here a misaligned start
         * (one float in: the scalar loop) and aligned starts with n % 4 == 2, 1, 0 */
        for (size_t lo = 1; lo <= 4; lo++) {
            const size_t hi = lo == 1 ? n : n - lo + 1;
            double want_ss = 0.0;
            for (size_t k = lo == 1 ? 1 : 0; k < hi; k++) want_ss += (double)ref[k] * ref[k];
            const double part = lo == 1 ? g->sumsq_f32((float *)d + 1, n - 1) : g->sumsq_f32(d, hi);
            cr_expect(fabs(part - want_ss) <= 1e-12 * want_ss, "[%s] sumsq_f32 case %zu: %.17g, expected %.17g",
                      M.name, lo, part, want_ss);
        }

        g->free(d), g->free(dx), g->free(dx2), g->free(dy);
        free(x), free(y), free(h), free(back), free(want), free(cp), free(zz), free(zeros);
        free(yh), free(sum), free(ref), free(sc);
    }
}

/* ---------------------------------------------------------------- embedding */

/* copy_aside: the copy sees what was queued before it (x doubled), runs beside later work that
 * only reads its source (a cast), and is there once joined; every bit, in both modes */
Test(gpu, copy_aside_is_ordered_and_joined)
{
    mt_rng rng;
    mt_rng_seed(&rng, 103);
    const size_t n = (size_t)3 << 20; /* 12 MB: long enough to still be moving when queued work runs */
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        const struct backend *g = M.g;
        float *xh = hrand(&rng, n, 2.0), *yh = malloc(n * sizeof(float));
        float *x = g->alloc(n * sizeof(float)), *y = g->alloc(n * sizeof(float));
        void *z = g->alloc(n * g->x_size);
        g->upload(x, xh, n * sizeof(float));
        g->scale_f32(x, n, 2.0f);
        g->copy_aside(y, x, n * sizeof(float));
        g->cast_f32_to_x(z, x, n);
        g->copy_aside_join();
        g->download(yh, y, n * sizeof(float));
        size_t bad = 0;
        for (size_t k = 0; k < n; k++) bad += yh[k] != 2.0f * xh[k];
        cr_expect_eq(bad, 0, "%s: %zu of %zu elements differ from the doubled source", M.name, bad, n);
        g->free(x);
        g->free(y);
        g->free(z);
        free(xh);
        free(yh);
    }
}

/* The backend's zero and copy (small ones are kernels of ours, large ones the driver's): every
 * byte of the range written, none beside it, at sizes around the 16-byte path's and the 1 MiB
 * switch's edges and at misaligned addresses, on fresh random bytes. */
Test(gpu, zero_and_copy_bytes)
{
    mt_rng rng;
    mt_rng_seed(&rng, 104);
    struct mode M;
    mode_get(0, &M);
    const struct backend *g = M.g;
    const size_t sizes[] = {1, 15, 16, 17, 1000, 262144, 262147, (size_t)1 << 20, ((size_t)1 << 20) + 16};
    const size_t shifts[] = {0, 1, 8, 16};
    const size_t pad = 64, cap = ((size_t)1 << 20) + 16 + 2 * pad + 16;
    unsigned char *src_h = malloc(cap), *dst_h = malloc(cap), *want = malloc(cap);
    unsigned char *src = g->alloc(cap), *dst = g->alloc(cap);
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
        for (size_t a = 0; a < sizeof shifts / sizeof *shifts; a++)
            for (size_t b = 0; b < sizeof shifts / sizeof *shifts; b++) {
                const size_t n = sizes[si], so = pad + shifts[a], dof = pad + shifts[b];
                for (size_t k = 0; k < cap; k++) {
                    src_h[k] = (unsigned char)mt_rng_next(&rng);
                    dst_h[k] = (unsigned char)mt_rng_next(&rng);
                }
                g->upload(src, src_h, cap);
                g->upload(dst, dst_h, cap);
                memcpy(want, dst_h, cap);
                memcpy(want + dof, src_h + so, n);
                g->copy(dst + dof, src + so, n);
                g->download(dst_h, dst, cap);
                size_t bad = 0;
                for (size_t k = 0; k < cap; k++) bad += dst_h[k] != want[k];
                cr_expect_eq(bad, 0, "copy of %zu bytes (source +%zu, destination +%zu): %zu bytes wrong", n,
                             shifts[a], shifts[b], bad);
                if (a) continue; /* zero: the destination's shift alone */
                memset(want + dof, 0, n);
                g->zero(dst + dof, n);
                g->download(dst_h, dst, cap);
                bad = 0;
                for (size_t k = 0; k < cap; k++) bad += dst_h[k] != want[k];
                cr_expect_eq(bad, 0, "zero of %zu bytes at +%zu: %zu bytes wrong", n, shifts[b], bad);
            }
    g->free(src);
    g->free(dst);
    free(src_h);
    free(dst_h);
    free(want);
}

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

/* Every layout of the vector path of cuda/rmsnorm_vec.cuh (G lanes per row, MC chunks of 8 per lane):
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

    /* out = resid + in Wᵀ, the residual read in the GEMM's epilogue; the residual shifted like w
     * (its alignment keys the plan with the output's) and left as it was */
    float *resfull = hrand(rng, no + w_off, 1.0);
    void *d_resfull = dx_from(M, resfull, no + w_off);
    const void *d_res = (const char *)d_resfull + (size_t)w_off * M->g->x_size;
    float *res_before = hx_of(M, d_resfull, no + w_off);
    void *d_out_r = dx_poisoned(M, no);
    M->g->matmul_forward_residual(d_out_r, d_in, d_w, d_res, N, I, O);
    float *out_r = hx_of(M, d_out_r, no), *ref_r = fnew(no), *res_after = hx_of(M, d_resfull, no + w_off);
    M->c->matmul_forward_residual(ref_r, in, w, resfull + w_off, N, I, O);
    snprintf(what, sizeof what, "matmul forward + residual %dx%dx%d%s", N, I, O, w_off ? " (unaligned)" : "");
    check_close(M, what, out_r, ref_r, no, M->tol);
    check_exact(M, "matmul forward + residual leaves the residual", res_after, res_before,
                (no + w_off) * sizeof(float));
    M->g->free(d_resfull), M->g->free(d_out_r);
    free(resfull), free(res_before), free(out_r), free(ref_r), free(res_after);

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
