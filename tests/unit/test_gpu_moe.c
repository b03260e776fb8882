/* GPU parity tests (suite "gpu"), the MoE ops: router, gather_rows (gather/scatter),
 * dispatch_rows and moe_combine, against the fp32 CPU reference (src/cpu/) on the same fresh random inputs, in both
 * CUDA modes; the expert GEMMs are in test_gpu_expert.c. Method, tolerances (TOL_F32, TOL_F32_LONG,
 * TOL_BF16) and exact checks: gpu_ops_util.h.
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

/* gather_rows_part (the self-last dispatch): rows whose index lies in [n, 2n) read from their own
 * buffer (at idx - n), the others from the whole one, whose middle block is poisoned on the GPU
 * (so a part that read it shows); together bit for bit the CPU's one gather over the whole
 * buffer. Some indices are negative (left as they are). */
static void gather_part_case(const struct mode *M, mt_rng *rng, int R, int n, int H)
{
    char what[96];
    const size_t nr = (size_t)R * H, nb = (size_t)n * H;
    int32_t *idx = malloc((size_t)R * sizeof *idx);
    for (int r = 0; r < R; r++) idx[r] = irand(rng, 8) == 0 ? -1 : irand(rng, 3 * n);
    float *all = hrand(rng, 3 * nb, 1.0), *poisoned = hdup(all, 3 * nb);
    for (size_t i = nb; i < 2 * nb; i++) poisoned[i] = NAN;
    void *d_all = dx_from(M, poisoned, 3 * nb), *d_own = dx_from(M, all + nb, nb);
    int32_t *d_idx = di_from(M, idx, R);
    float *start = hrand(rng, nr, 1.0), *ref = hdup(start, nr);
    void *d_out = dx_from(M, start, nr);
    M->g->gather_rows_part(d_out, d_own, d_idx, R, H, n, 2 * n, true);
    M->g->gather_rows_part(d_out, d_all, d_idx, R, H, n, 2 * n, false);
    float *out = hx_of(M, d_out, nr);
    M->c->gather_rows(ref, all, idx, R, H); /* the CPU's rounding of start and all, as the GPU's */
    void *d_ref = dx_from(M, ref, nr);
    float *ref_x = hx_of(M, d_ref, nr);
    snprintf(what, sizeof what, "gather_rows_part R=%d H=%d", R, H);
    check_exact(M, what, out, ref_x, nr * sizeof(float));
    M->g->free(d_all), M->g->free(d_own), M->g->free(d_idx), M->g->free(d_out), M->g->free(d_ref);
    free(idx), free(all), free(poisoned), free(start), free(ref), free(out), free(ref_x);
}

Test(gpu, gather_rows_part)
{
    mt_rng rng;
    mt_rng_seed(&rng, 131);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        gather_part_case(&M, &rng, 600, 128, 256);  /* vector kernel */
        gather_part_case(&M, &rng, 300, 50, 2056);  /* several rounds a lane */
        gather_part_case(&M, &rng, 200, 40, 12);    /* scalar kernel in bf16 */
    }
}

/* dispatch_rows (the MoE dispatch's copy by slot) against the CPU's gather by row over the same
 * route plan (T tokens, top-k of E experts, some slots empty, odd cases cut to a capacity), from
 * the same random start so that rows no slot names must come back as they were: bit for bit */
static void dispatch_case(const struct mode *M, mt_rng *rng, int T, int E, int K, int H, int64_t cap)
{
    char what[128];
    const size_t tk = (size_t)T * K, nr = tk * H, ni = (size_t)T * H;
    int32_t *idx = mt_malloc(tk * sizeof(int32_t)), *src = mt_malloc(tk * sizeof(int32_t));
    int32_t *slot = mt_malloc(tk * sizeof(int32_t));
    float *w = fnew(tk);
    int64_t off[E + 1], need[2] = {0, 0};
    for (int t = 0; t < T; t++)
        for (int j = 0; j < K; j++) { /* distinct experts a token, one slot in eight empty */
            int e;
            bool fresh;
            do {
                e = irand(rng, 8) == 0 ? MT_NO_EXPERT : irand(rng, E);
                fresh = true;
                for (int i = 0; i < j; i++) fresh = fresh && (e == MT_NO_EXPERT || idx[t * K + i] != e);
            } while (!fresh);
            idx[t * K + j] = e;
            w[t * K + j] = 1.0f;
        }
    for (size_t i = 0; i < tk; i++) src[i] = -1;
    M->c->moe_route_plan(idx, w, src, slot, off, T, E, K);
    if (cap > 0 && cap < off[E]) M->c->moe_rows_cap(off, src, slot, need, (int)tk, E, cap);
    const int R = (int)(cap > 0 ? MT_MIN(off[E], cap) : off[E]);
    float *in = hrand(rng, ni, 1.0), *start = hrand(rng, nr, 1.0);
    void *d_in = dx_from(M, in, ni), *d_out = dx_from(M, start, nr);
    int32_t *d_slot = di_from(M, slot, tk);
    M->g->dispatch_rows(d_out, d_in, d_slot, T, K, H);
    float *out = hx_of(M, d_out, nr), *ref = hdup(start, nr);
    M->c->gather_rows(ref, in, src, R, H);
    snprintf(what, sizeof what, "dispatch_rows T=%d E=%d k=%d H=%d capacity %lld (%d rows)", T, E, K, H,
             (long long)cap, R);
    check_exact(M, what, out, ref, nr * sizeof(float));
    M->g->free(d_in), M->g->free(d_out), M->g->free(d_slot);
    free(idx), free(src), free(slot), free(w), free(in), free(start), free(out), free(ref);
}

/* the vector kernel (rows of 16-byte chunks, k <= 32: H = 2048, 2056, and 100 in fp32) and the
 * scalar one (H = 100 in bf16, H = 12, k = 40) */
Test(gpu, dispatch_rows)
{
    mt_rng rng;
    mt_rng_seed(&rng, 131);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        dispatch_case(&M, &rng, 300, 16, 8, 2048, 0);
        dispatch_case(&M, &rng, 300, 16, 8, 2048, 1500);
        dispatch_case(&M, &rng, 97, 12, 3, 2056, 0);
        dispatch_case(&M, &rng, 97, 12, 3, 100, 200);
        dispatch_case(&M, &rng, 50, 7, 5, 12, 0);
        dispatch_case(&M, &rng, 20, 64, 40, 24, 0);
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
 * the scalar ones; the backward's vector kernel keeps k <= 8 slots' sums in registers, more in
 * dw; the vector kernels hold k <= 32 slots' rows and weights a lane, more they read each time. */
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
        combine_case(&M, &rng, 32, 8, 2056, 11); /* k <= 8: the dot products summed in registers */
        combine_case(&M, &rng, 24, 12, 2056, 9); /* k > 8: summed into dw in memory */
        combine_case(&M, &rng, 6, 40, 2056, 13); /* k > 32: each slot's row and weight read from memory */
        combine_case(&M, &rng, 64, 8, 256, 37);
        combine_case(&M, &rng, 33, 4, 20, 5);
    }
}
