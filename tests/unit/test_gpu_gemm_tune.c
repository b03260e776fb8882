/* MT_GEMM_TUNE (cuda/matmul_tune.cuh): the dense matmuls, at the call that queues the trial of
 * cuBLASLt's candidates and with the algorithm it chose by timing, give the bits of the heuristic's
 * first choice, in both CUDA modes, and the
 * CPU reference's values within the mode's tolerance (gpu_ops_util.h) on fresh random inputs.
 * Shapes of the bench's projections at 512 tokens (the CPU reference's time): q (2048 -> 4096), o
 * with its residual (4096 -> 2048) and k (2048 -> 512), forward, din and the fp32 dw += (in place:
 * its trial runs in a scratch, matmul.cu tune_in_place) onto a random starting dw. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>

#include "common.h"
#include "gpu_ops_util.h"
#include "ops.h"

#ifdef MT_HAVE_CUDA
#include "../../cuda/matmul_tune.cuh"

/* out, the residual's out, din and dw0 + dw of one shape under the current tuning level, as host
 * floats */
static void run_shape(const struct mode *M, void *d_in, void *d_w, void *d_res, void *d_dout, const float *dw0,
                      int N, int I, int O, float **out, float **out_r, float **din, float **dw)
{
    const size_t no = (size_t)N * O, ni = (size_t)N * I, oi = (size_t)O * I;
    void *d_out = dx_poisoned(M, no), *d_out_r = dx_poisoned(M, no), *d_din = dx_poisoned(M, ni);
    float *d_dw = df_from(M, dw0, oi);
    M->g->matmul_forward(d_out, d_in, d_w, N, I, O);
    M->g->matmul_forward_residual(d_out_r, d_in, d_w, d_res, N, I, O);
    M->g->matmul_backward(d_din, NULL, d_dout, d_in, d_w, N, I, O, false);
    M->g->matmul_backward(NULL, d_dw, d_dout, d_in, d_w, N, I, O, false);
    *out = hx_of(M, d_out, no), *out_r = hx_of(M, d_out_r, no), *din = hx_of(M, d_din, ni);
    *dw = hf_of(M, d_dw, oi);
    M->g->free(d_out), M->g->free(d_out_r), M->g->free(d_din), M->g->free(d_dw);
}

Test(gpu, gemm_tune_keeps_the_bits)
{
    static const int shapes[][3] = {{512, 2048, 4096}, {512, 4096, 2048}, {512, 2048, 512}};
    mt_rng rng;
    mt_rng_seed(&rng, 4242);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            const int N = shapes[s][0], I = shapes[s][1], O = shapes[s][2];
            const size_t ni = (size_t)N * I, no = (size_t)N * O, oi = (size_t)O * I;
            float *in = hrand(&rng, ni, 1.0), *w = hrand(&rng, oi, 0.05), *res = hrand(&rng, no, 1.0);
            float *dout = hrand(&rng, no, 1.0), *dw0 = hrand(&rng, oi, 1.0);
            void *d_in = dx_from(&M, in, ni), *d_w = dx_from(&M, w, oi), *d_res = dx_from(&M, res, no);
            void *d_dout = dx_from(&M, dout, no);
            /* the heuristic's choice; the calls that queue the trials; after they are read, the
             * tuned choice */
            float *out[3], *out_r[3], *din[3], *dw[3];
            for (int run = 0; run < 3; run++) {
                cuda_gemm_tune_set(run > 0);
                if (run == 2) cuda_gemm_tune_settle();
                run_shape(&M, d_in, d_w, d_res, d_dout, dw0, N, I, O, &out[run], &out_r[run], &din[run], &dw[run]);
            }
            cuda_gemm_tune_set(0);
            char what[128];
            for (int run = 1; run < 3; run++) {
                const char *when = run == 1 ? "while tuning" : "tuned";
                snprintf(what, sizeof what, "matmul forward %dx%dx%d %s: the untuned bits", N, I, O, when);
                check_exact(&M, what, out[run], out[0], no * sizeof(float));
                snprintf(what, sizeof what, "matmul forward + residual %dx%dx%d %s: the untuned bits", N, I, O, when);
                check_exact(&M, what, out_r[run], out_r[0], no * sizeof(float));
                snprintf(what, sizeof what, "matmul backward din %dx%dx%d %s: the untuned bits", N, I, O, when);
                check_exact(&M, what, din[run], din[0], ni * sizeof(float));
                snprintf(what, sizeof what, "matmul backward dw += %dx%dx%d %s: the untuned bits", N, I, O, when);
                check_exact(&M, what, dw[run], dw[0], oi * sizeof(float));
            }

            float *ref = fnew(no), *ref_r = fnew(no), *din_ref = fnew(ni), *dw_ref = hdup(dw0, oi);
            M.c->matmul_forward(ref, in, w, N, I, O);
            M.c->matmul_forward_residual(ref_r, in, w, res, N, I, O);
            M.c->matmul_backward(din_ref, NULL, dout, in, w, N, I, O, false);
            M.c->matmul_backward(NULL, dw_ref, dout, in, w, N, I, O, false);
            snprintf(what, sizeof what, "tuned matmul forward %dx%dx%d", N, I, O);
            check_close(&M, what, out[2], ref, no, M.tol);
            snprintf(what, sizeof what, "tuned matmul forward + residual %dx%dx%d", N, I, O);
            check_close(&M, what, out_r[2], ref_r, no, M.tol);
            snprintf(what, sizeof what, "tuned matmul backward din %dx%dx%d", N, I, O);
            check_close(&M, what, din[2], din_ref, ni, M.tol);
            snprintf(what, sizeof what, "tuned matmul backward dw += %dx%dx%d", N, I, O);
            check_close(&M, what, dw[2], dw_ref, oi, M.tol);
            for (int run = 0; run < 3; run++) free(out[run]), free(out_r[run]), free(din[run]), free(dw[run]);
            free(ref), free(ref_r), free(din_ref), free(dw_ref), free(in), free(w), free(res), free(dout), free(dw0);
            M.g->free(d_in), M.g->free(d_w), M.g->free(d_res), M.g->free(d_dout);
        }
    }
    /* what the choices came to: each tuned plan's first candidate is among those with its bits */
    struct gemm_tune_counts c;
    cuda_gemm_tune_counts(&c);
    fprintf(stderr, "gemm tune: %d plans tuned, %d candidates, %d with the first's bits, %d switched\n", c.plans,
            c.candidates, c.identical, c.switched);
    cr_expect(c.plans >= 1, "no plan had more than one candidate to choose from");
    cr_expect(c.identical >= c.plans && c.identical <= c.candidates && c.switched <= c.plans,
              "counts out of order: %d plans, %d candidates, %d identical, %d switched", c.plans, c.candidates,
              c.identical, c.switched);
}
#endif /* MT_HAVE_CUDA */
