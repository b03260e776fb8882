/* GPU parity tests (suite "gpu"), attention: the backend's attention forward and backward
 * (document masking, grouped heads, head dims 12 ... 128, ragged sequence lengths) and the
 * tensor-core kernels of cuda/attention_tc.cu called directly (bf16), against the fp32 CPU
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
#include "gpu_ops_util.h"
#include "ops.h"

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
    M->g->attention_backward(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out, d_lse, B, S, Hq, Hkv, D, d_seg,
                             NULL, 0);
    float *dq = hx_of(M, d_dq, nq), *dk = hx_of(M, d_dk, nk), *dv = hx_of(M, d_dv, nk);
    float *dq_ref = fnew(nq), *dk_ref = fnew(nk), *dv_ref = fnew(nk);
    M->c->attention_backward(dq_ref, dk_ref, dv_ref, dout, q, k, v, out_ref, lse_ref, B, S, Hq, Hkv, D, seg,
                             NULL, 0);
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
#include "../../cuda/grouped_gemm.cuh" /* grouped_gemm_available: a Hopper device in use */
#include "../../src/attention_parts.h"

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
    M->c->attention_backward(dq_ref, dk_ref, dv_ref, dout, q, k, v, out_ref, lse_ref, B, S, Hq, Hkv, D, NULL,
                             NULL, 0);
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
 * wgmma ones (3..6) and the five warp-specialised TMA ones (7..11: a producer warp or warpgroup,
 * 64- or 128-key tiles); on a GPU other than Hopper, or with MT_FORCE_SM80, 3..11 run tiling 0.
 * S = 300 and 257 give the wgmma kernels 3 to 5 key tiles (the pipelined steps and both P
 * buffers; the TMA rings of 2 to 4 stages wrap), S = 100 with 64-key
 * tiles a key tile wholly after the first warpgroup's queries (fully masked), S = 1 a Q box that
 * is mostly out of bounds. */
Test(gpu, attention_tc_vs_cpu)
{
    mt_rng rng;
    mt_rng_seed(&rng, 108);
    struct mode M;
    mode_get(1, &M);
    for (int variant = 0; variant < 12; variant++) {
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

/* Every backward kernel choice (attention_tc_set_bwd_variant: mma.sync or the warp-specialised
 * wgmma kernel for each of the dK/dV and dQ passes, or the 5-product ATTN_BWD_DS) against the CPU,
 * rerun bit for bit (tc_case):
 * ragged S against both the 64- and 128-row tiles, grouped and ungrouped heads, D 128 and 64;
 * the pairs of the same kind also on S = 1, exact tiles and a longer S. */
Test(gpu, attention_tc_bwd_variants)
{
    mt_rng rng;
    mt_rng_seed(&rng, 111);
    struct mode M;
    mode_get(1, &M);
    const int old = attention_tc_set_bwd_variant(0);
    for (int var = 0; var < ATTN_BWD_VARIANTS; var++) {
        fprintf(stderr, "gpu attention tc backward variant %d (dkdv %d, dq %d%s)\n", var,
                var % ATTN_BWD_KINDS, var / ATTN_BWD_KINDS % ATTN_BWD_KINDS,
                var == ATTN_BWD_DS ? ", dS stored" : "");
        attention_tc_set_bwd_variant(var);
        tc_case(&M, &rng, 1, 300, 4, 2, 128, 0);
        tc_case(&M, &rng, 2, 193, 4, 4, 64, 0);
        if (var % (ATTN_BWD_KINDS + 1) == 0 || var == ATTN_BWD_DS) {
            tc_case(&M, &rng, 1, 1, 2, 1, 128, 0);
            tc_case(&M, &rng, 2, 128, 6, 3, 128, 0);
            tc_case(&M, &rng, 1, 64, 4, 1, 64, 0);
            tc_case(&M, &rng, 1, 520, 8, 2, 128, 0);
        }
    }
    attention_tc_set_bwd_variant(old);
}

/* The warp-specialised backward (attention_tc_set_bwd_variant 1 + 2·1), the 5-product one
 * (ATTN_BWD_DS, once with its own scratch and once in memory lent by the caller) and the mma.sync
 * one (0) sum every product in the same order (16-wide k steps, one thread per output element),
 * so their gradients must be the same bits: ragged S (TMA zero-fills rows past S, cp.async did so
 * by hand), grouped heads, both head dims, and S long enough for the rings to wrap several times.
 * The lent memory must hold the dS tiles (written on Hopper) and nothing past them be touched.
 * The dQ pass from dS takes two query heads a block where a kv head has an even number of them
 * (8/2, 2/1, 8/1, 4/2 below) and one otherwise (4/4, 6/2).
 * (Off Hopper all run the mma.sync kernels.) */
static void tma_bwd_bits_case(const struct mode *M, mt_rng *rng, int B, int S, int Hq, int Hkv, int D)
{
    char what[112];
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * Hq * S;
    const size_t xs = M->g->x_size, nb[3] = {nq * xs, nk * xs, nk * xs};
    float *q = hrand(rng, nq, 1.0), *k = hrand(rng, nk, 1.0), *v = hrand(rng, nk, 1.0);
    float *dout = hrand(rng, nq, 1.0);
    void *d_q = dx_from(M, q, nq), *d_k = dx_from(M, k, nk), *d_v = dx_from(M, v, nk);
    void *d_dout = dx_from(M, dout, nq), *d_out = dx_poisoned(M, nq);
    float *d_lse = df_poisoned(M, nl);
    cr_assert(attention_tc_forward(d_out, d_lse, d_q, d_k, d_v, B, S, Hq, Hkv, D));
    void *d_g[3] = {dx_poisoned(M, nq), dx_poisoned(M, nk), dx_poisoned(M, nk)};
    void *got[4][3];
    const int variants[4] = {0, 1 + ATTN_BWD_KINDS * 1, ATTN_BWD_DS, ATTN_BWD_DS};
    const char *names[4] = {"", "tma bwd", "dS-stored bwd", "dS-stored bwd (lent memory)"};
    const size_t ds_bytes = attention_tc_ds_bytes(B, S, Hq), tail = 4096;
    void *work = M->g->alloc(ds_bytes + tail);
    for (int r = 0; r < 4; r++) {
        const int old = attention_tc_set_bwd_variant(variants[r]);
        for (int i = 0; i < 3; i++) poison(M, d_g[i], nb[i]);
        if (r == 3) poison(M, work, ds_bytes + tail);
        cr_assert(attention_tc_backward_work(d_g[0], d_g[1], d_g[2], d_dout, d_q, d_k, d_v, d_out, d_lse,
                                             B, S, Hq, Hkv, D, r == 3 ? work : NULL, r == 3 ? ds_bytes + tail : 0));
        attention_tc_set_bwd_variant(old);
        for (int i = 0; i < 3; i++) got[r][i] = hraw_of(M, d_g[i], nb[i]);
    }
    unsigned char *w = hraw_of(M, work, ds_bytes + tail);
    size_t tiles_touched = 0, tail_touched = 0;
    for (size_t i = 0; i < ds_bytes; i++) tiles_touched += w[i] != 0xff;
    for (size_t i = ds_bytes; i < ds_bytes + tail; i++) tail_touched += w[i] != 0xff;
    cr_expect(tail_touched == 0, "dS-stored bwd wrote %zu bytes past its %zu-byte tiles (B%d S%d H%d)",
              tail_touched, ds_bytes, B, S, Hq);
    if (grouped_gemm_available())
        cr_expect(tiles_touched > 0, "dS-stored bwd left the lent memory untouched on Hopper (B%d S%d H%d)",
                  B, S, Hq);
    free(w);
    M->g->free(work);
    for (int i = 0; i < 3; i++) {
        for (int r = 1; r < 4; r++) {
            snprintf(what, sizeof what, "%s d%c vs mma.sync B%d S%d H%d/%d D%d", names[r], "qkv"[i], B, S,
                     Hq, Hkv, D);
            check_exact(M, what, got[r][i], got[0][i], nb[i]);
        }
        for (int r = 0; r < 4; r++) free(got[r][i]);
        M->g->free(d_g[i]);
    }
    M->g->free(d_q), M->g->free(d_k), M->g->free(d_v), M->g->free(d_dout), M->g->free(d_out);
    M->g->free(d_lse);
    free(q), free(k), free(v), free(dout);
}

Test(gpu, attention_tma_bwd_same_bits_as_mma_sync)
{
    mt_rng rng;
    mt_rng_seed(&rng, 113);
    struct mode M;
    mode_get(1, &M);
    const int old_parts = attention_tc_set_dkdv_parts(1); /* parts sum in another order */
    tma_bwd_bits_case(&M, &rng, 1, 300, 8, 2, 128);
    tma_bwd_bits_case(&M, &rng, 2, 257, 4, 4, 64);
    tma_bwd_bits_case(&M, &rng, 1, 1, 2, 1, 128);
    tma_bwd_bits_case(&M, &rng, 1, 1111, 8, 1, 128);
    tma_bwd_bits_case(&M, &rng, 2, 512, 4, 2, 64);
    tma_bwd_bits_case(&M, &rng, 1, 449, 6, 2, 128);
    attention_tc_set_dkdv_parts(old_parts);
}

/* The dQ pass from dS is persistent (attention_tc_set_dq_ctas): capped at 1, 3 and 5 CTAs each CTA
 * walks many 128-query blocks in rounds (every other round backwards) with its ring running on
 * from one block into the next, and -1 is a CTA a block. Each must give the mma.sync kernels' bits
 * (tma_bwd_bits_case, which the test above runs at the default of a CTA an SM): two query heads a
 * block (8/2, 8/1, 4/2) and one (4/4, 6/2), ragged S, both head dims. */
Test(gpu, attention_dq_persistent_ctas)
{
    mt_rng rng;
    mt_rng_seed(&rng, 115);
    struct mode M;
    mode_get(1, &M);
    const int old_parts = attention_tc_set_dkdv_parts(1);
    const int caps[4] = {1, 3, 5, -1};
    for (int c = 0; c < 4; c++) {
        fprintf(stderr, "gpu attention dq from dS, %d CTAs\n", caps[c]);
        const int old = attention_tc_set_dq_ctas(caps[c]);
        tma_bwd_bits_case(&M, &rng, 1, 1111, 8, 2, 128);
        tma_bwd_bits_case(&M, &rng, 2, 257, 4, 4, 64);
        tma_bwd_bits_case(&M, &rng, 1, 449, 6, 2, 128);
        tma_bwd_bits_case(&M, &rng, 2, 700, 8, 1, 128);
        tma_bwd_bits_case(&M, &rng, 1, 513, 4, 2, 64);
        attention_tc_set_dq_ctas(old);
    }
    attention_tc_set_dkdv_parts(old_parts);
}

/* The dK/dV pass in parts of each kv group's query heads (attention_tc_set_dkdv_parts), for both
 * warp-specialised backwards (5 products with dS stored, 7 recomputing), with the parts' sums in
 * lent memory after the dS tiles and in the backend's scratch: against the CPU (check_tc), against
 * one part (dQ the same bits: its pass does not change; dK and dV differ only in the order their
 * fp32 sums are added before the one rounding to bf16, so by at most one bf16 ulp of the largest:
 * max|parts − one| <= 2^-7 · max|one|), the same bits on a rerun, the lent memory written from the
 * dS tiles' end (the start without them) through the sums' (on Hopper) and nothing past them. Ragged S, S = 1, groups of 2
 * to 8, both head dims. */
static void dkdv_parts_case(const struct mode *M, mt_rng *rng, int B, int S, int Hq, int Hkv, int D, int parts)
{
    char what[128];
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * Hq * S;
    const size_t xs = M->g->x_size, nb[3] = {nq * xs, nk * xs, nk * xs}, n[3] = {nq, nk, nk};
    float *q = hrand(rng, nq, 1.0), *k = hrand(rng, nk, 1.0), *v = hrand(rng, nk, 1.0);
    float *dout = hrand(rng, nq, 1.0);
    void *d_q = dx_from(M, q, nq), *d_k = dx_from(M, k, nk), *d_v = dx_from(M, v, nk);
    void *d_dout = dx_from(M, dout, nq), *d_out = dx_poisoned(M, nq);
    float *d_lse = df_poisoned(M, nl);
    cr_assert(attention_tc_forward(d_out, d_lse, d_q, d_k, d_v, B, S, Hq, Hkv, D));
    /* the reference from the CPU's own forward, as tc_case (at S = 1 dQ is rounding noise around
     * zero, which the bf16 O would make another noise) */
    float *out = fnew(nq), *lse = fnew(nl);
    M->c->attention_forward(out, lse, q, k, v, B, S, Hq, Hkv, D, NULL);
    float *ref[3] = {fnew(nq), fnew(nk), fnew(nk)};
    M->c->attention_backward(ref[0], ref[1], ref[2], dout, q, k, v, out, lse, B, S, Hq, Hkv, D, NULL, NULL, 0);
    const size_t ds_bytes = attention_tc_ds_bytes(B, S, Hq), tail = 4096;
    const size_t sums = (size_t)attn_dkdv_part_bytes(B, S, Hkv, D, parts);
    void *work = M->g->alloc(ds_bytes + sums + tail);
    void *d_g[3] = {dx_poisoned(M, nq), dx_poisoned(M, nk), dx_poisoned(M, nk)};
    const int variants[2] = {ATTN_BWD_DS, 1 + ATTN_BWD_KINDS * 1};
    for (int var = 0; var < 2; var++)
        for (int lend = 0; lend < 2; lend++) {
            void *one[3], *got[3], *again[3];
            const int old_var = attention_tc_set_bwd_variant(variants[var]);
            for (int run = 0; run < 3; run++) { /* one part, then `parts` twice */
                const int old_parts = attention_tc_set_dkdv_parts(run ? parts : 1);
                for (int i = 0; i < 3; i++) poison(M, d_g[i], nb[i]);
                if (lend) poison(M, work, ds_bytes + sums + tail);
                cr_assert(attention_tc_backward_work(d_g[0], d_g[1], d_g[2], d_dout, d_q, d_k, d_v, d_out, d_lse, B,
                                                     S, Hq, Hkv, D, lend ? work : NULL, lend ? ds_bytes + sums + tail : 0));
                attention_tc_set_dkdv_parts(old_parts);
                for (int i = 0; i < 3; i++) (run == 0 ? one : run == 1 ? got : again)[i] = hraw_of(M, d_g[i], nb[i]);
            }
            attention_tc_set_bwd_variant(old_var);
            const char *name = var ? "7-product" : "dS-stored";
            if (lend) {
                /* the sums follow the dS tiles; the 7-product backward stores none */
                const size_t at = var ? 0 : ds_bytes;
                unsigned char *w = hraw_of(M, work, ds_bytes + sums + tail);
                size_t sums_touched = 0, tail_touched = 0;
                for (size_t i = at; i < at + sums; i++) sums_touched += w[i] != 0xff;
                for (size_t i = at + sums; i < ds_bytes + sums + tail; i++) tail_touched += w[i] != 0xff;
                cr_expect(tail_touched == 0, "%s bwd in %d parts wrote %zu bytes past the lent sums (B%d S%d H%d/%d)",
                          name, parts, tail_touched, B, S, Hq, Hkv);
                if (grouped_gemm_available() && sums)
                    cr_expect(sums_touched > 0, "%s bwd in %d parts left the lent sums untouched on Hopper (B%d S%d H%d/%d)",
                              name, parts, B, S, Hq, Hkv);
                free(w);
            }
            for (int i = 0; i < 3; i++) {
                snprintf(what, sizeof what, "%s bwd %d parts%s d%c rerun B%d S%d H%d/%d D%d", name, parts,
                         lend ? " (lent)" : "", "qkv"[i], B, S, Hq, Hkv, D);
                check_exact(M, what, again[i], got[i], nb[i]);
                float *a = hx_of(M, d_g[i], n[i]); /* the last run's */
                snprintf(what, sizeof what, "%s bwd %d parts%s d%c B%d S%d H%d/%d D%d", name, parts,
                         lend ? " (lent)" : "", "qkv"[i], B, S, Hq, Hkv, D);
                check_tc(M, what, a, ref[i], n[i]);
                free(a);
                if (i == 0) {
                    check_exact(M, what, got[0], one[0], nb[0]);
                } else { /* bf16 bits to fp32, then one ulp of the largest */
                    double d = 0, r = 0;
                    for (size_t e = 0; e < n[i]; e++) {
                        const uint16_t *pg = (const uint16_t *)got[i], *po = (const uint16_t *)one[i];
                        union { uint32_t u; float f; } x = {.u = (uint32_t)pg[e] << 16}, y = {.u = (uint32_t)po[e] << 16};
                        d = fmax(d, fabs((double)x.f - y.f)), r = fmax(r, fabs((double)y.f));
                    }
                    if (xs == 2)
                        cr_expect(d <= r / 128, "%s: %d parts against one: max diff %.3e over max %.3e (> 2^-7)",
                                  what, parts, d, r);
                }
            }
            for (int i = 0; i < 3; i++) free(one[i]), free(got[i]), free(again[i]);
        }
    for (int i = 0; i < 3; i++) M->g->free(d_g[i]), free(ref[i]);
    M->g->free(work);
    M->g->free(d_q), M->g->free(d_k), M->g->free(d_v), M->g->free(d_dout), M->g->free(d_out);
    M->g->free(d_lse);
    free(q), free(k), free(v), free(dout), free(out), free(lse);
}

Test(gpu, attention_dkdv_parts)
{
    mt_rng rng;
    mt_rng_seed(&rng, 114);
    struct mode M;
    mode_get(1, &M);
    dkdv_parts_case(&M, &rng, 1, 300, 8, 2, 128, 2);
    dkdv_parts_case(&M, &rng, 1, 300, 8, 2, 128, 4);
    dkdv_parts_case(&M, &rng, 2, 257, 8, 1, 64, 8);
    dkdv_parts_case(&M, &rng, 1, 1, 4, 1, 128, 2);
    dkdv_parts_case(&M, &rng, 1, 1111, 16, 2, 128, 4);
    dkdv_parts_case(&M, &rng, 2, 449, 6, 2, 64, 3);
    /* the rule's choice: 235B's 4 kv heads of 16 query heads at micro-batch 1 make fewer blocks
     * than ATTN_DKDV_MIN_BLOCKS, the bench shape's (micro-batch 2, 8 query heads a kv head) do not */
    cr_expect(attn_dkdv_parts(1, 4096, 64, 4) > 1);
    cr_expect_eq(attn_dkdv_parts(2, 4096, 32, 4), 1);
    cr_expect_eq(attn_dkdv_parts(1, 300, 7, 7), 1); /* no group to split */
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
                                    r[w][4], B, S, Hq, Hkv, D, NULL, NULL, 0);
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
