/* GPU parity tests (suite "gpu"), the pointwise and row-wise passes: RoPE, SwiGLU, elementwise ops
 * on unaligned views, cross-entropy (separate and fused), AdamW and the aux-loss gradient --
 * against the fp32 CPU reference (src/cpu/) on the same fresh random inputs, in both CUDA modes;
 * the dense ops are in test_gpu_ops.c. Method, tolerances and exact checks: gpu_ops_util.h.
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
        M.g->swiglu_forward(d_out, d_gu, R, I, NULL);
        float *out = hx_of(&M, d_out, n), *ref = fnew(n);
        M.c->swiglu_forward(ref, gu, R, I, NULL);
        check_close(&M, "swiglu forward", out, ref, n, M.tol);

        void *d_dgu = dx_poisoned(&M, n2);
        M.g->swiglu_backward(d_dgu, d_dout, d_gu, R, I, NULL);
        float *dgu = hx_of(&M, d_dgu, n2), *dgu_ref = fnew(n2);
        M.c->swiglu_backward(dgu_ref, dout, gu, R, I, NULL);
        check_close(&M, "swiglu backward", dgu, dgu_ref, n2, M.tol);

        /* dgu may alias gu */
        M.g->swiglu_backward(d_gu, d_dout, d_gu, R, I, NULL);
        float *alias = hx_of(&M, d_gu, n2);
        check_exact(&M, "swiglu backward in place", alias, dgu, n2 * sizeof(float));

        M.g->free(d_gu), M.g->free(d_dout), M.g->free(d_out), M.g->free(d_dgu);
        free(gu), free(dout), free(out), free(ref), free(dgu), free(dgu_ref), free(alias);
    }
}

/* A row bound in device memory (the fixed MoE exchange's off[n_exp]): the first `used` rows as the
 * CPU's over those rows, the rest of the R rows untouched (still the NaN poison), forward and
 * backward, on the vector (I 384) and the scalar (I 100) kernels. */
Test(gpu, swiglu_row_bound)
{
    mt_rng rng;
    mt_rng_seed(&rng, 131);
    enum { R = 300, USED = 211 };
    const int64_t used = USED;
    const int widths[2] = {384, 100};
    for (int i = 0; i < 2; i++)
        for (int w = 0; w < 2; w++) {
            struct mode M;
            mode_get(i, &M);
            const int I = widths[w];
            const size_t n = (size_t)R * I, n2 = 2 * n, nu = (size_t)USED * I;
            float *gu = hrand(&rng, n2, 2.0), *dout = hrand(&rng, n, 1.0);
            void *d_gu = dx_from(&M, gu, n2), *d_dout = dx_from(&M, dout, n);
            int64_t *d_used = M.g->alloc(sizeof used);
            M.g->upload(d_used, &used, sizeof used);
            void *d_out = dx_poisoned(&M, n), *d_dgu = dx_poisoned(&M, n2);
            float *poison_out = hx_of(&M, d_out, n), *poison_dgu = hx_of(&M, d_dgu, n2);
            M.g->swiglu_forward(d_out, d_gu, R, I, d_used);
            M.g->swiglu_backward(d_dgu, d_dout, d_gu, R, I, d_used);
            float *out = hx_of(&M, d_out, n), *dgu = hx_of(&M, d_dgu, n2);
            float *ref = fnew(n), *dgu_ref = fnew(n2);
            M.c->swiglu_forward(ref, gu, R, I, &used);
            M.c->swiglu_backward(dgu_ref, dout, gu, R, I, &used);
            char what[64];
            snprintf(what, sizeof what, "bounded swiglu forward I%d", I);
            check_close(&M, what, out, ref, nu, M.tol);
            snprintf(what, sizeof what, "bounded swiglu backward I%d", I);
            check_close(&M, what, dgu, dgu_ref, 2 * nu, M.tol);
            snprintf(what, sizeof what, "rows past the bound, forward I%d", I);
            check_exact(&M, what, out + nu, poison_out + nu, (n - nu) * sizeof(float));
            snprintf(what, sizeof what, "rows past the bound, backward I%d", I);
            check_exact(&M, what, dgu + 2 * nu, poison_dgu + 2 * nu, (n2 - 2 * nu) * sizeof(float));
            M.g->free(d_gu), M.g->free(d_dout), M.g->free(d_out), M.g->free(d_dgu), M.g->free(d_used);
            free(gu), free(dout), free(out), free(dgu), free(ref), free(dgu_ref), free(poison_out), free(poison_dgu);
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
    M->g->swiglu_forward(d_out, d_gu, R, I, NULL);
    float *out = hx_of(M, d_out, n), *ref = fnew(n);
    M->c->swiglu_forward(ref, gu, R, I, NULL);
    snprintf(what, sizeof what, "swiglu forward R%d I%d", R, I);
    check_close(M, what, out, ref, n, M->tol);
    void *d_dgu = dx_poisoned(M, n2);
    M->g->swiglu_backward(d_dgu, d_dout, d_gu, R, I, NULL);
    float *dgu = hx_of(M, d_dgu, n2), *dgu_ref = fnew(n2);
    M->c->swiglu_backward(dgu_ref, dout, gu, R, I, NULL);
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

/* random targets in [0, V), one in six ignored; returns how many are labelled */
static int ce_targets(mt_rng *rng, int32_t *tgt, int N, int V)
{
    int valid = 0;
    for (int n = 0; n < N; n++) {
        tgt[n] = irand(rng, 6) == 0 ? MT_IGNORE_INDEX : irand(rng, V);
        valid += tgt[n] != MT_IGNORE_INDEX;
    }
    return valid;
}

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
        const float scale = 1.0f / (float)ce_targets(&rng, tgt, N, V);
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

/* The forward and backward in one op: V = 151,936 (Qwen3's vocabulary) cuts each row over a cluster
 * of 4 CTAs in bf16 (8 in fp32), V = 5000 is one CTA a row, V = 4099 takes the two kernels. Against
 * the CPU's forward then backward, and one row with a target outside [0, V): NaN loss and
 * gradients (the CPU aborts on it, so its reference treats the row as ignored). */
Test(gpu, cross_entropy_fused)
{
    mt_rng rng;
    mt_rng_seed(&rng, 118);
    const int Vs[] = {151936, 5000, 4099}, Ns[] = {37, 96, 96};
    for (int vi = 0; vi < 3; vi++) {
        const int V = Vs[vi], N = Ns[vi], bad = N / 2;
        const size_t nv = (size_t)N * V;
        int32_t *tgt = mt_malloc((size_t)N * sizeof *tgt), *tgt_ref = mt_malloc((size_t)N * sizeof *tgt_ref);
        const float scale = 1.0f / (float)ce_targets(&rng, tgt, N, V);
        tgt[1] = V - 1; /* the last slice's last element */
        memcpy(tgt_ref, tgt, (size_t)N * sizeof *tgt);
        tgt[bad] = V + 3, tgt_ref[bad] = MT_IGNORE_INDEX;
        for (int i = 0; i < 2; i++) {
            struct mode M;
            mode_get(i, &M);
            float *z = hrand(&rng, nv, 3.0);
            void *d_z = dx_from(&M, z, nv);
            int32_t *d_tgt = di_from(&M, tgt, N);
            float *d_loss = df_poisoned(&M, N), *d_lse = df_poisoned(&M, N);
            M.g->cross_entropy_fused(d_loss, d_lse, d_z, d_tgt, N, V, scale);
            float *loss = hf_of(&M, d_loss, N), *lse = hf_of(&M, d_lse, N), *dz = hx_of(&M, d_z, nv);

            /* the invalid row: NaN, then set aside */
            bool nan_row = isnan(loss[bad]);
            for (int v = 0; v < V; v++) nan_row = nan_row && isnan(dz[(size_t)bad * V + v]);
            cr_expect(nan_row, "[%s] cross_entropy fused V=%d: a target outside [0, V) gives NaN", M.name, V);
            char what[96];
            loss[bad] = 0.0f, lse[bad] = 0.0f;
            for (int v = 0; v < V; v++) dz[(size_t)bad * V + v] = 0.0f;

            float *loss_ref = fnew(N), *lse_ref = fnew(N), *dz_ref = hdup(z, nv);
            M.c->cross_entropy_forward(loss_ref, lse_ref, z, tgt_ref, N, V);
            M.c->cross_entropy_backward(dz_ref, dz_ref, lse_ref, tgt_ref, N, V, scale);
            snprintf(what, sizeof what, "cross_entropy fused V=%d loss", V);
            check_close(&M, what, loss, loss_ref, N, TOL_F32);
            snprintf(what, sizeof what, "cross_entropy fused V=%d lse", V);
            check_close(&M, what, lse, lse_ref, N, TOL_F32);
            snprintf(what, sizeof what, "cross_entropy fused V=%d dlogits", V);
            check_close(&M, what, dz, dz_ref, nv, M.tol);

            M.g->free(d_z), M.g->free(d_tgt), M.g->free(d_loss), M.g->free(d_lse);
            free(z), free(loss), free(lse), free(dz), free(loss_ref), free(lse_ref), free(dz_ref);
        }
        free(tgt), free(tgt_ref);
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

/* adamw_update_multi: tests/unit/test_gpu_adamw.c */

/* aux_grad_from_stats (train.c's aux gradient on the device, src/step_stats.h): the same bits as
 * the CPU op, which train_test checks against the host formula, on fresh random statistics (fp32
 * psum, integer counts, zeros for a dense layer), in both modes (the op is fp32 in both). */
Test(gpu, aux_grad_from_stats_matches_the_cpu_bits)
{
    mt_rng rng;
    mt_rng_seed(&rng, 907);
    const int L = 5, E = 300;
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        float *stats = fnew((size_t)L * 2 * E);
        for (int l = 0; l < L; l++)
            for (int e = 0; l != 2 && e < E; e++) { /* layer 2 dense: zeros */
                stats[(size_t)l * 2 * E + e] = (float)(mt_rng_uniform(&rng) * 50.0);
                stats[(size_t)l * 2 * E + E + e] = (float)irand(&rng, 4000);
            }
        float *d_stats = df_from(&M, stats, (size_t)L * 2 * E), *d_dp = df_from(&M, stats, E);
        float *ref = fnew(E);
        const double scale = 0.001 / 3.0, rows = 4.0 * 8192.0;
        M.g->aux_grad_from_stats(d_dp, d_stats, L, E, scale, rows);
        M.c->aux_grad_from_stats(ref, stats, L, E, scale, rows);
        float *got = hf_of(&M, d_dp, E);
        check_exact(&M, "aux_grad_from_stats", got, ref, (size_t)E * sizeof(float));
        M.g->free(d_stats), M.g->free(d_dp);
        free(stats), free(ref), free(got);
    }
}
