/* GPU parity tests (suite "gpu"), the MoE ops: router, gather_rows (gather/scatter), moe_combine
 * and expert_matmul (incl. the grouped Hopper kernel and MT_FORCE_SM80), against the fp32 CPU
 * reference (src/cpu/) on the same fresh random inputs, in both CUDA modes. Method, tolerances
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
#include "env_flag.h"
#include "gpu_ops_util.h"
#include "ops.h"

#ifdef MT_HAVE_CUDA
#include "../../cuda/grouped_gemm.cuh"
#endif

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
    /* CUDA's expf is not glibc's, so probs and weights match the CPU only to an ulp; but from its
     * own probabilities and choices the GPU's weights are the CPU's arithmetic, bit for bit */
    {
        float *w_own = fnew(tk);
        M->c->router_gather_weights(w_own, probs, idx, T, E, K, o);
        snprintf(what, sizeof what, "router forward topk_w of its own probs %s", tag);
        check_exact(M, what, w, w_own, tk * sizeof(float));
        free(w_own);
    }
    /* run to run: the same inputs give the same bits */
    {
        int32_t *d_idx2 = M->g->alloc(tk * sizeof(int32_t)), *idx2 = mt_malloc(tk * sizeof(int32_t));
        poison(M, d_idx2, tk * sizeof(int32_t));
        float *d_w2 = df_poisoned(M, tk), *d_probs2 = df_poisoned(M, te);
        M->g->router_forward(d_idx2, d_w2, d_probs2, d_logits, d_bias, T, E, K, o);
        M->g->download(idx2, d_idx2, tk * sizeof(int32_t));
        float *w2 = hf_of(M, d_w2, tk), *probs2 = hf_of(M, d_probs2, te);
        snprintf(what, sizeof what, "router forward rerun %s", tag);
        check_exact(M, what, idx2, idx, tk * sizeof(int32_t));
        check_exact(M, what, w2, w, tk * sizeof(float));
        check_exact(M, what, probs2, probs, te * sizeof(float));
        M->g->free(d_idx2), M->g->free(d_w2), M->g->free(d_probs2);
        free(idx2), free(w2), free(probs2);
    }

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
    {
        float *d_dlogits2 = df_poisoned(M, te);
        M->g->router_backward(d_dlogits2, d_dtw, d_probs_ref, d_idx_ref, d_aux, T, E, K, o);
        float *dl2 = hf_of(M, d_dlogits2, te);
        snprintf(what, sizeof what, "router backward rerun %s", tag);
        check_exact(M, what, dl2, dl, te * sizeof(float));
        M->g->free(d_dlogits2), free(dl2);
    }

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
    {
        float *d_psum2 = df_from(M, psum0, E), *d_cnt2 = df_from(M, cnt0, E);
        M->g->router_stats(d_psum2, d_cnt2, d_probs_ref, d_idx_ref, T, E, K);
        float *psum2 = hf_of(M, d_psum2, E), *cnt2 = hf_of(M, d_cnt2, E);
        snprintf(what, sizeof what, "router_stats rerun %s", tag);
        check_exact(M, what, psum2, psum, E * sizeof(float));
        check_exact(M, what, cnt2, cnt, E * sizeof(float));
        M->g->free(d_psum2), M->g->free(d_cnt2), free(psum2), free(cnt2);
    }

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
        o.sigmoid = true, o.route_scale = 1, o.n_group = 36, o.topk_group = 20, o.force_balance = false;
        router_case_opts(&M, &rng, 128, 72, 33, &o, true, true);  /* lanes of two groups, k > 32 */
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
        /* E not a multiple of 32 and k above the warp; E past the experts kept in registers (512).
         * With the bias, the choices are far from ulp-level ties between the two expf. */
        router_case(&M, &rng, 32, 300, 40, true, true, true);
        router_case(&M, &rng, 24, 600, 9, true, true, false);
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
        M.g->moe_combine_forward(d_out, d_y, d_slot, d_w, NULL, T, K, H);
        float *out = hx_of(&M, d_out, (size_t)T * H), *ref = fnew((size_t)T * H);
        M.c->moe_combine_forward(ref, y, slot, w, NULL, T, K, H);
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
    M->g->moe_combine_forward(d_out, d_y, d_slot, d_w, NULL, T, K, H);
    float *out = hx_of(M, d_out, (size_t)T * H), *ref = fnew((size_t)T * H);
    M->c->moe_combine_forward(ref, y, slot, w, NULL, T, K, H);
    snprintf(what, sizeof what, "moe_combine forward T%d k%d H%d empty %d", T, K, H, n_empty);
    check_close(M, what, out, ref, (size_t)T * H, M->tol);

    /* with the residual: the same bits as the sum followed by add_inplace, and the CPU's sum + add */
    float *res = hrand(rng, (size_t)T * H, 1.0);
    void *d_res = dx_from(M, res, (size_t)T * H), *d_out_r = dx_poisoned(M, (size_t)T * H);
    M->g->moe_combine_forward(d_out_r, d_y, d_slot, d_w, d_res, T, K, H);
    M->g->add_inplace(d_out, d_res, (size_t)T * H);
    float *out_r = hx_of(M, d_out_r, (size_t)T * H), *out_add = hx_of(M, d_out, (size_t)T * H);
    snprintf(what, sizeof what, "moe_combine + resid T%d k%d H%d = combine, add_inplace", T, K, H);
    check_exact(M, what, out_r, out_add, (size_t)T * H * sizeof(float));
    M->c->moe_combine_forward(ref, y, slot, w, res, T, K, H);
    snprintf(what, sizeof what, "moe_combine + resid T%d k%d H%d (vs CPU)", T, K, H);
    check_close(M, what, out_r, ref, (size_t)T * H, M->tol);
    M->g->free(d_res), M->g->free(d_out_r);
    free(res), free(out_r), free(out_add);

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

/* expert offsets in the GPU backend's memory (ops.h: off is backend memory) */
static int64_t *doff_from(const struct mode *M, const int64_t *off, int n_exp)
{
    int64_t *d = M->g->alloc(((size_t)n_exp + 1) * sizeof *d);
    M->g->upload(d, off, ((size_t)n_exp + 1) * sizeof *d);
    return d;
}

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

        int64_t *d_off = doff_from(&M, off, NE);
        void *d_out = dx_poisoned(&M, ro);
        M.g->expert_matmul_forward(d_out, d_in, d_w, d_off, R, NE, I, O);
        float *out = hx_of(&M, d_out, ro), *ref = fnew(ro);
        M.c->expert_matmul_forward(ref, in, w, off, R, NE, I, O);
        check_close(&M, "expert_matmul forward", out, ref, ro, M.tol);

        float *dw0 = hrand(&rng, wn, 1.0), *dw_ref = hdup(dw0, wn);
        float *d_dw = df_from(&M, dw0, wn);
        void *d_din = dx_poisoned(&M, ri);
        M.g->expert_matmul_backward(d_din, d_dw, d_dout, d_in, d_w, d_off, R, NE, I, O, false);
        float *din = hx_of(&M, d_din, ri), *dw = hf_of(&M, d_dw, wn), *din_ref = fnew(ri);
        M.c->expert_matmul_backward(din_ref, dw_ref, dout, in, w, off, R, NE, I, O, false);
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
        M.g->free(d_din), M.g->free(d_off);
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

    int64_t *d_off = doff_from(M, off, NE);

    /* forward */
    void *d_out = dx_poisoned(M, ro);
    M->g->expert_matmul_forward(d_out, d_in, d_w, d_off, R, NE, I, O);
    float *out = hx_of(M, d_out, ro), *ref = fnew(ro);
    M->c->expert_matmul_forward(ref, in, w, off, R, NE, I, O);

    /* backward: din overwritten, dw accumulated onto random values */
    float *dw0 = hrand(rng, wn, 1.0), *dw_ref = hdup(dw0, wn);
    float *d_dw = df_from(M, dw0, wn);
    void *d_din = dx_poisoned(M, ri);
    M->g->expert_matmul_backward(d_din, d_dw, d_dout, d_in, d_w, d_off, R, NE, I, O, false);
    float *din = hx_of(M, d_din, ri), *dw = hf_of(M, d_dw, wn), *din_ref = fnew(ri);
    M->c->expert_matmul_backward(din_ref, dw_ref, dout, in, w, off, R, NE, I, O, false);
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
    M->g->expert_matmul_backward(NULL, d_dw, d_dout, d_in, d_w, d_off, R, NE, I, O, false);
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
    M->g->expert_matmul_backward(NULL, d_dwz, d_dout, d_in, d_w, d_off, R, NE, I, O, false);
    M->g->expert_matmul_backward(NULL, d_dwo, d_dout, d_in, d_w, d_off, R, NE, I, O, true);
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
        const bool f = grouped_gemm_forward(d_out2, d_in, d_w, d_off, R, NE, I, O);
        const bool g = grouped_gemm_dgrad(d_din2, d_dout, d_w, d_off, R, NE, I, O);
        const bool h = grouped_gemm_wgrad(d_dw2, d_dout, d_in, d_off, R, NE, I, O, false);
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
    M->g->free(d_din), M->g->free(d_off);
    free(off), free(in), free(wfull), free(dout), free(out), free(ref), free(dw0), free(dw_ref);
    free(din), free(dw), free(din_ref), free(add), free(add_ref), free(dw2), free(add2), free(din_again);
}

Test(gpu, expert_matmul_grouped)
{
    mt_rng rng;
    mt_rng_seed(&rng, 115);
    /* tile edges: 128 rows per tile, 32 rows per wgrad K block, 256 columns per tile */
    const int edges[] = {0, 1, 127, 129, 300, 0, 64, 65};
    const int odd[] = {70, 0, 1, 200, 33};
    const int few[] = {5, 0, 40};
    enum { MANY = 300 }; /* more experts than the schedule kernel's threads take one each of */
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
            int64_t *d_off0 = doff_from(&M, off0, NE0);
            const size_t wn0 = (size_t)NE0 * O0 * I0;
            float *nans = fnew(wn0), *zeros = fnew(wn0);
            for (size_t k = 0; k < wn0; k++) nans[k] = NAN;
            float *d_dw0 = df_from(&M, nans, wn0);
            void *d_x0 = dx_poisoned(&M, (size_t)O0 * I0);
            M.g->expert_matmul_backward(NULL, d_dw0, d_x0, d_x0, d_x0, d_off0, 0, NE0, I0, O0, true);
            float *dw0 = hf_of(&M, d_dw0, wn0);
            check_exact(&M, "grouped, no rows: dw overwrite gives zeros", dw0, zeros, wn0 * sizeof(float));
            M.g->free(d_dw0), M.g->free(d_x0), M.g->free(d_off0);
            free(nans), free(zeros), free(dw0);
        }
        /* wgrad does not read w, so only forward and dgrad fall back */
        grouped_case(&M, &rng, "unaligned w (fallback)", 3, few, 64, 64, 1, false, true);
    }
}

/* expert_matmul_wgrad_sets (several micro-steps' rows in one weight-gradient pass,
 * parallel.expert_wgrad_pairs / expert_wgrad_group) against the CPU's one backward add per set, per
 * expert: rows of some sets only, of all, of none (kept bit-exact when adding, zeros when
 * overwriting), ragged tile and K-block edges in each set, and whole sets empty. Tolerance
 * TOL_F32_LONG (fp32 sums of exact bf16 products, only the order differs). In bf16 mode on Hopper
 * the grouped kernel must take the call itself. rows[s][e]: set s's rows of expert e. */
static void wgrad_sets_case(const struct mode *M, mt_rng *rng, const char *tag, int NE, int NS,
                            const int *const *rows, int I, int O)
{
    char what[160];
    struct expert_rows g_sets[MT_WGRAD_MAX_SETS], c_sets[MT_WGRAD_MAX_SETS];
    int64_t *off[MT_WGRAD_MAX_SETS], *d_off[MT_WGRAD_MAX_SETS];
    float *in[MT_WGRAD_MAX_SETS], *dout[MT_WGRAD_MAX_SETS];
    void *d_in[MT_WGRAD_MAX_SETS], *d_dout[MT_WGRAD_MAX_SETS];
    const size_t wn = (size_t)NE * O * I;
    for (int k = 0; k < NS; k++) {
        off[k] = mt_calloc((size_t)NE + 1, sizeof *off[k]);
        for (int e = 0; e < NE; e++) off[k][e + 1] = off[k][e] + rows[k][e];
        const size_t r = (size_t)off[k][NE];
        in[k] = hrand(rng, MT_MAX(r, 1) * I, 1.0), dout[k] = hrand(rng, MT_MAX(r, 1) * O, 1.0);
        d_in[k] = dx_from(M, in[k], MT_MAX(r, 1) * I), d_dout[k] = dx_from(M, dout[k], MT_MAX(r, 1) * O);
        d_off[k] = doff_from(M, off[k], NE);
        g_sets[k] = (struct expert_rows){d_dout[k], d_in[k], d_off[k], (int64_t)r};
        c_sets[k] = (struct expert_rows){dout[k], in[k], off[k], (int64_t)r};
    }
    int *rows_all = mt_calloc((size_t)NE, sizeof *rows_all);
    for (int e = 0; e < NE; e++)
        for (int k = 0; k < NS; k++) rows_all[e] += rows[k][e];

    /* adding onto random dw */
    float *dw0 = hrand(rng, wn, 1.0), *dw_ref = hdup(dw0, wn);
    float *d_dw = df_from(M, dw0, wn);
    M->g->expert_matmul_wgrad_sets(d_dw, g_sets, NS, NE, I, O, false);
    M->c->expert_matmul_wgrad_sets(dw_ref, c_sets, NS, NE, I, O, false);
    float *dw = hf_of(M, d_dw, wn), *add = diff(dw, dw0, wn), *add_ref = diff(dw_ref, dw0, wn);
    double worst = 0;
    bool empty_kept = true;
    for (int e = 0; e < NE; e++) {
        const size_t oi = (size_t)e * O * I;
        if (rows_all[e] == 0) {
            empty_kept = empty_kept && memcmp(dw + oi, dw0 + oi, (size_t)O * I * sizeof(float)) == 0;
            continue;
        }
        const double err = rel_err(add + oi, add_ref + oi, (size_t)O * I);
        cr_expect(err <= TOL_F32_LONG, "wgrad %d sets %s [%s] expert %d (%d rows): rel err %.2e", NS, tag, M->name, e,
                  rows_all[e], err);
        worst = fmax(worst, err);
    }
    fprintf(stderr, "gpu %s wgrad %d sets %-34s worst expert dw %.2e; no-row experts %s\n", M->name, NS, tag, worst,
            empty_kept ? "kept bit-exact" : "CHANGED");
    cr_expect(empty_kept, "wgrad %d sets %s [%s]: experts with no rows in any set changed", NS, tag, M->name);

    /* overwriting NaN: the CPU's zeros + the adds, zeros for experts with no rows */
    float *nans = fnew(wn);
    for (size_t i = 0; i < wn; i++) nans[i] = NAN;
    float *zref = fnew(wn);
    float *d_dwo = df_from(M, nans, wn);
    M->g->expert_matmul_wgrad_sets(d_dwo, g_sets, NS, NE, I, O, true);
    M->c->expert_matmul_wgrad_sets(zref, c_sets, NS, NE, I, O, true);
    float *dwo = hf_of(M, d_dwo, wn);
    snprintf(what, sizeof what, "wgrad %d sets %s: overwrite (vs CPU)", NS, tag);
    check_close(M, what, dwo, zref, wn, TOL_F32_LONG);
    for (int e = 0; e < NE; e++)
        if (rows_all[e] == 0) {
            snprintf(what, sizeof what, "wgrad %d sets %s: overwrite gives zeros to expert %d", NS, tag, e);
            check_exact(M, what, dwo + (size_t)e * O * I, zref + (size_t)e * O * I, (size_t)O * I * sizeof(float));
        }

#ifdef MT_HAVE_CUDA
    if (M->g->x_size == 2 && grouped_gemm_available()) {
        float *d_dw3 = df_from(M, dw0, wn);
        const bool took = grouped_gemm_wgrad_sets(d_dw3, g_sets, NS, NE, I, O, false);
        const bool want = I % 8 == 0 && O % 8 == 0; /* what the kernel handles (grouped_gemm.cuh) */
        cr_expect(took == want, "wgrad %d sets %s: the grouped kernel took it: %d, expected %d", NS, tag, took, want);
        float *dw3 = hf_of(M, d_dw3, wn);
        snprintf(what, sizeof what, "wgrad %d sets %s: direct call = op", NS, tag);
        if (took) check_exact(M, what, dw3, dw, wn * sizeof(float));
        M->g->free(d_dw3);
        free(dw3);
    }
#endif
    for (int k = 0; k < NS; k++) {
        M->g->free(d_in[k]), M->g->free(d_dout[k]), M->g->free(d_off[k]);
        free(off[k]), free(in[k]), free(dout[k]);
    }
    M->g->free(d_dw), M->g->free(d_dwo);
    free(rows_all), free(dw0), free(dw_ref);
    free(dw), free(add), free(add_ref), free(nans), free(zref), free(dwo);
}

Test(gpu, expert_matmul_wgrad_sets)
{
    mt_rng rng;
    mt_rng_seed(&rng, 131);
    /* two sets: experts 1 and 5 have no rows in either; 3 set a only; 0 set b only */
    const int a[] = {0, 0, 127, 129, 300, 0, 64, 65};
    const int b[] = {65, 0, 1, 0, 200, 0, 63, 128};
    const int c[] = {31, 0, 0, 33, 0, 0, 1, 97};
    const int d[] = {0, 0, 40, 0, 0, 0, 128, 2};
    const int none[] = {0, 0, 0, 0, 0, 0, 0, 0};
    enum { MANY = 300 };
    int many[4][MANY];
    for (int k = 0; k < 4; k++)
        for (int e = 0; e < MANY; e++) many[k][e] = irand(&rng, 5);
    const int *ab[] = {a, b}, *ba[] = {b, a}, *a_[] = {a, none}, *_b[] = {none, b}, *__[] = {none, none};
    const int *many2[] = {many[0], many[1]}, *many4[] = {many[0], many[1], many[2], many[3]};
    const int *abc[] = {a, b, c}, *abcd[] = {a, b, c, d}, *a_c_[] = {a, none, c, none}, *_bcd[] = {none, b, c, d};
    const int *one[] = {b};
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        wgrad_sets_case(&M, &rng, "edges 256->512", 8, 2, ab, 256, 512);
        wgrad_sets_case(&M, &rng, "many tiles 1032->904", 8, 2, ab, 1032, 904);
        wgrad_sets_case(&M, &rng, "I, O not /64 (200->136)", 8, 2, ba, 200, 136);
        wgrad_sets_case(&M, &rng, "300 experts 64->72", MANY, 2, many2, 64, 72);
        wgrad_sets_case(&M, &rng, "second set empty", 8, 2, a_, 256, 128);
        wgrad_sets_case(&M, &rng, "first set empty", 8, 2, _b, 256, 128);
        wgrad_sets_case(&M, &rng, "I, O not /8 (fallback)", 8, 2, ab, 100, 60);
        wgrad_sets_case(&M, &rng, "no rows at all", 8, 2, __, 64, 72);
        wgrad_sets_case(&M, &rng, "one set", 8, 1, one, 256, 128);
        wgrad_sets_case(&M, &rng, "edges 256->512", 8, 3, abc, 256, 512);
        wgrad_sets_case(&M, &rng, "many tiles 1032->904", 8, 4, abcd, 1032, 904);
        wgrad_sets_case(&M, &rng, "sets 2 and 4 empty", 8, 4, a_c_, 200, 136);
        wgrad_sets_case(&M, &rng, "first of four empty", 8, 4, _bcd, 256, 128);
        wgrad_sets_case(&M, &rng, "300 experts 64->72", MANY, 4, many4, 64, 72);
        wgrad_sets_case(&M, &rng, "I, O not /8 (fallback)", 8, 4, abcd, 100, 60);
    }
}

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
