/* GPU parity tests (suite "gpu") of rmsnorm_rope_forward / rmsnorm_rope_backward, the per-head
 * q_norm/k_norm fused with the RoPE around it: bit for bit against the CUDA backend's own
 * rmsnorm and rope ops in turn (the fused kernels must not move a bit), and against the fp32 CPU
 * reference within the mode's tolerance, on fresh random inputs in both CUDA modes. Method and
 * tolerances: gpu_ops_util.h.
 *
 * Without a CUDA device (backend_cuda returns NULL) every test reports itself skipped; with
 * MT_REQUIRE_GPU=1 (scripts/test-gpu.sh) that is a failure instead. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>

#include "common.h"
#include "gpu_ops_util.h"
#include "ops.h"

static void rmsnorm_rope_case(const struct mode *M, mt_rng *rng, int T, int nh, int D)
{
    char what[96];
    const struct backend *g = M->g, *c = M->c;
    const size_t n = (size_t)T * nh * D;
    const int N = T * nh;
    const float eps = 1e-6f, theta = 1e6f;
    int32_t *pos = mt_malloc((size_t)T * sizeof *pos);
    for (int t = 0; t < T; t++) pos[t] = irand(rng, 4096);
    float *in = hrand(rng, n, 2.0), *w = hrand(rng, D, 1.0), *dout = hrand(rng, n, 1.0);
    float *dw0 = hrand(rng, D, 1.0);
    void *d_in = dx_from(M, in, n), *d_w = dx_from(M, w, D), *d_dout = dx_from(M, dout, n);
    int32_t *d_pos = di_from(M, pos, T);

    /* forward: fused, then the two ops, then in place */
    void *d_out = dx_poisoned(M, n), *d_out2 = dx_poisoned(M, n), *d_io = dx_from(M, in, n);
    float *d_rstd = df_poisoned(M, N), *d_rstd2 = df_poisoned(M, N), *d_rstd3 = df_poisoned(M, N);
    g->rmsnorm_rope_forward(d_out, d_rstd, d_in, d_w, d_pos, T, nh, D, eps, theta);
    g->rmsnorm_forward(d_out2, d_rstd2, d_in, d_w, N, D, eps);
    g->rope_forward(d_out2, d_out2, d_pos, T, nh, D, theta);
    g->rmsnorm_rope_forward(d_io, d_rstd3, d_io, d_w, d_pos, T, nh, D, eps, theta);
    float *out = hx_of(M, d_out, n), *out2 = hx_of(M, d_out2, n), *io = hx_of(M, d_io, n);
    float *rstd = hf_of(M, d_rstd, N), *rstd2 = hf_of(M, d_rstd2, N), *rstd3 = hf_of(M, d_rstd3, N);
    snprintf(what, sizeof what, "rmsnorm_rope fwd = the two ops T%d H%d D%d", T, nh, D);
    check_exact(M, what, out, out2, n * sizeof(float));
    snprintf(what, sizeof what, "rmsnorm_rope fwd rstd = rmsnorm's T%d H%d D%d", T, nh, D);
    check_exact(M, what, rstd, rstd2, N * sizeof(float));
    snprintf(what, sizeof what, "rmsnorm_rope fwd in place T%d H%d D%d", T, nh, D);
    check_exact(M, what, io, out, n * sizeof(float));
    check_exact(M, what, rstd3, rstd, N * sizeof(float));
    float *ref = fnew(n), *rstd_ref = fnew(N);
    c->rmsnorm_rope_forward(ref, rstd_ref, in, w, pos, T, nh, D, eps, theta);
    snprintf(what, sizeof what, "rmsnorm_rope fwd out T%d H%d D%d", T, nh, D);
    check_close(M, what, out, ref, n, M->tol);
    snprintf(what, sizeof what, "rmsnorm_rope fwd rstd T%d H%d D%d", T, nh, D);
    check_close(M, what, rstd, rstd_ref, N, TOL_F32); /* fp32 in both modes */

    /* backward from the CPU's rstd: fused, the two ops (through a separate rotated gradient),
     * then din = dout */
    float *d_rs = df_from(M, rstd_ref, N);
    void *d_din = dx_poisoned(M, n), *d_rot = dx_poisoned(M, n), *d_din2 = dx_poisoned(M, n);
    void *d_dio = dx_from(M, dout, n);
    float *d_dw = df_from(M, dw0, D), *d_dw2 = df_from(M, dw0, D), *d_dw3 = df_from(M, dw0, D);
    g->rmsnorm_rope_backward(d_din, d_dw, d_dout, d_in, d_w, d_rs, d_pos, T, nh, D, theta);
    g->rope_backward(d_rot, d_dout, d_pos, T, nh, D, theta);
    g->rmsnorm_backward(d_din2, d_dw2, d_rot, d_in, d_w, d_rs, N, D, false);
    g->rmsnorm_rope_backward(d_dio, d_dw3, d_dio, d_in, d_w, d_rs, d_pos, T, nh, D, theta);
    float *din = hx_of(M, d_din, n), *din2 = hx_of(M, d_din2, n), *dio = hx_of(M, d_dio, n);
    float *dw = hf_of(M, d_dw, D), *dw2 = hf_of(M, d_dw2, D), *dw3 = hf_of(M, d_dw3, D);
    snprintf(what, sizeof what, "rmsnorm_rope bwd din = the two ops T%d H%d D%d", T, nh, D);
    check_exact(M, what, din, din2, n * sizeof(float));
    snprintf(what, sizeof what, "rmsnorm_rope bwd dw = the two ops T%d H%d D%d", T, nh, D);
    check_exact(M, what, dw, dw2, D * sizeof(float));
    snprintf(what, sizeof what, "rmsnorm_rope bwd din = dout T%d H%d D%d", T, nh, D);
    check_exact(M, what, dio, din, n * sizeof(float));
    check_exact(M, what, dw3, dw, D * sizeof(float));
    float *din_ref = fnew(n), *dw_ref = hdup(dw0, D);
    c->rmsnorm_rope_backward(din_ref, dw_ref, dout, in, w, rstd_ref, pos, T, nh, D, theta);
    snprintf(what, sizeof what, "rmsnorm_rope bwd din T%d H%d D%d", T, nh, D);
    check_close(M, what, din, din_ref, n, M->tol);
    float *add = diff(dw, dw0, D), *add_ref = diff(dw_ref, dw0, D);
    snprintf(what, sizeof what, "rmsnorm_rope bwd dw T%d H%d D%d (added)", T, nh, D);
    check_close(M, what, add, add_ref, D, M->tol_long);

    void *dev[] = {d_in, d_w, d_dout, d_pos, d_out, d_out2, d_io, d_rstd, d_rstd2, d_rstd3, d_rs,
                   d_din, d_rot, d_din2, d_dio, d_dw, d_dw2, d_dw3};
    for (size_t k = 0; k < sizeof dev / sizeof dev[0]; k++) g->free(dev[k]);
    float *host[] = {in, w, dout, dw0, out, out2, io, rstd, rstd2, rstd3, ref, rstd_ref, din, din2,
                     dio, dw, dw2, dw3, din_ref, dw_ref, add, add_ref};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; k++) free(host[k]);
    free(pos);
}

/* Qwen3-MoE's heads: 32 query and 4 key-value heads of 128, and of 64; odd token counts leave the
 * last block of rows partly empty */
Test(gpu, rmsnorm_rope)
{
    mt_rng rng;
    mt_rng_seed(&rng, 123);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        rmsnorm_rope_case(&M, &rng, 37, 32, 128);
        rmsnorm_rope_case(&M, &rng, 37, 4, 128);
        rmsnorm_rope_case(&M, &rng, 33, 32, 64);
        rmsnorm_rope_case(&M, &rng, 33, 4, 64);
    }
}

/* Backward blocks of several passes over their rows, each with its own angle tables (T = 1001 and
 * 9001; 20001 with 5 heads: tokens straddling passes and blocks), 3 heads (tokens straddling the
 * forward's blocks), a row per token (D = 256: the most tokens per table), 4 and 32 lanes a row
 * (D = 32, 256); and head sizes the fused kernels leave to the two ops (D = 16, 48, 512). */
Test(gpu, rmsnorm_rope_shapes)
{
    mt_rng rng;
    mt_rng_seed(&rng, 124);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        rmsnorm_rope_case(&M, &rng, 1001, 32, 128);
        rmsnorm_rope_case(&M, &rng, 9001, 4, 128);
        rmsnorm_rope_case(&M, &rng, 20001, 5, 32);
        rmsnorm_rope_case(&M, &rng, 301, 3, 64);
        rmsnorm_rope_case(&M, &rng, 77, 1, 256);
        rmsnorm_rope_case(&M, &rng, 13, 2, 16);
        rmsnorm_rope_case(&M, &rng, 11, 3, 48);
        rmsnorm_rope_case(&M, &rng, 5, 2, 512);
    }
}
