/* Tests of the fp32 CPU backend (src/cpu/), continued from test_cpu_ops.c (same suite, same
 * gradient check, cpu_grad_util.h): the router, gather and combine, expert matmul, SwiGLU,
 * cross-entropy and AdamW, each backward against finite differences of its own forward and the
 * forwards against double-precision restatements of the maths (the route and pair plans and the
 * dispatch's row copies: test_cpu_moe_plans.c). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "cpu/cpu_ops.h"
#include "cpu_grad_util.h"
#include "ops.h"
#include "safetensors.h"

/* ---------------------------------------------------------------- router */

enum { RT = 4, RE = 8, RK = 3 };

struct router_ctx {
    float *logits, *bias, *c, *aux, *probs, *w;
    int32_t *idx, *idx0;
    struct router_opts o;
    bool flipped;
};

static struct router_opts qwen_opts(bool norm)
{
    return (struct router_opts){.norm_topk = norm, .route_scale = 1.0f, .n_group = 1, .topk_group = 1};
}

/* L = Σ c ⊙ topk_w + Σ_{t,e} aux[e]·probs[t,e], whose dL/dprobs has the aux_dp form */
static double router_loss(void *p)
{
    struct router_ctx *c = p;
    cpu_router_forward(c->idx, c->w, c->probs, c->logits, c->bias, RT, RE, RK, &c->o);
    if (memcmp(c->idx, c->idx0, sizeof(int32_t) * RT * RK) != 0) c->flipped = true;
    double l = project(c->c, c->w, RT * RK);
    for (int t = 0; t < RT; t++) l += project(c->aux, c->probs + t * RE, RE);
    return l;
}

/* Logits on a grid 0.7 apart (plus small noise), shuffled per row, so that the perturbations of
 * the finite differences never change the top-k. */
static float *separated_logits(mt_rng *rng)
{
    float *z = fnew(RT * RE);
    for (int t = 0; t < RT; t++) {
        int perm[RE];
        for (int e = 0; e < RE; e++) perm[e] = e;
        for (int e = RE - 1; e > 0; e--) {
            int j = (int)(mt_rng_uniform(rng) * (e + 1));
            int tmp = perm[e];
            perm[e] = perm[j];
            perm[j] = tmp;
        }
        for (int e = 0; e < RE; e++)
            z[t * RE + e] = (float)(0.7 * perm[e] - 2.0 + 0.05 * mt_rng_normal(rng));
    }
    return z;
}

Test(cpu_ops, router_forward_properties)
{
    mt_rng rng;
    mt_rng_seed(&rng, 10);
    float *z = frand(&rng, RT * RE, 1.5), *probs = fnew(RT * RE), *w = fnew(RT * RK);
    int32_t idx[RT * RK];
    /* a tie in row 0 between experts 2 and 5, both the largest: the lower id must come first */
    z[2] = z[5] = 9.0f;
    for (int pass = 0; pass < 3; pass++) {
        const bool norm = pass != 1;
        float *bias = pass == 2 ? frand(&rng, RE, 0.2) : NULL;
        const struct router_opts opts = qwen_opts(norm);
        cpu_router_forward(idx, w, probs, z, bias, RT, RE, RK, &opts);
        for (int t = 0; t < RT; t++) {
            const float *p = probs + t * RE;
            double sum = 0.0, mx = -INFINITY, zsum = 0.0;
            for (int e = 0; e < RE; e++) mx = fmax(mx, z[t * RE + e]);
            for (int e = 0; e < RE; e++) zsum += exp(z[t * RE + e] - mx);
            for (int e = 0; e < RE; e++) {
                sum += p[e];
                cr_expect(fabs(p[e] - exp(z[t * RE + e] - mx) / zsum) <= 1e-6, "softmax t=%d", t);
            }
            cr_expect(fabs(sum - 1.0) <= 1e-6, "probs row %d sums to %.9g", t, sum);
            double wsum = 0.0, psel = 0.0;
            for (int j = 0; j < RK; j++) psel += p[idx[t * RK + j]];
            for (int j = 0; j < RK; j++) {
                const int e = idx[t * RK + j];
                double score = p[e] + (bias ? bias[e] : 0.0);
                /* chosen scores descend; ties go to the lower id */
                if (j > 0) {
                    const int ep = idx[t * RK + j - 1];
                    double sp = p[ep] + (bias ? bias[ep] : 0.0);
                    cr_expect(sp > score || (sp == score && ep < e), "t=%d: top-k not sorted", t);
                }
                /* every unchosen expert scores no higher than the last chosen one */
                for (int o = 0; o < RE; o++) {
                    bool chosen = false;
                    for (int jj = 0; jj < RK; jj++) chosen |= idx[t * RK + jj] == o;
                    if (!chosen) cr_expect((double)p[o] + (bias ? bias[o] : 0.0) <= score);
                }
                /* weights are the unbiased probabilities (renormalised over the selection) */
                double want = norm ? p[e] / psel : p[e];
                cr_expect(fabs(w[t * RK + j] - want) <= 1e-6 * want, "t=%d j=%d weight", t, j);
                wsum += w[t * RK + j];
            }
            if (norm) cr_expect(fabs(wsum - 1.0) <= 1e-6, "row %d weights sum to %.9g", t, wsum);
        }
        if (!bias) cr_expect(idx[0] == 2 && idx[1] == 5, "tie: got %d %d", idx[0], idx[1]);
        free(bias);
    }

    /* stats accumulate Σ_t probs and the selection counts */
    float psum[RE], count[RE], psum0[RE], count0[RE];
    for (int e = 0; e < RE; e++) psum0[e] = psum[e] = (float)e, count0[e] = count[e] = 2.0f * e;
    cpu_router_stats(psum, count, probs, idx, RT, RE, RK);
    for (int e = 0; e < RE; e++) {
        double ps = psum0[e];
        int n = 0;
        for (int t = 0; t < RT; t++) ps += probs[t * RE + e];
        for (int j = 0; j < RT * RK; j++) n += idx[j] == e;
        cr_expect(fabs(psum[e] - ps) <= 1e-5, "psum[%d]", e);
        cr_expect_eq(count[e], count0[e] + n, "count[%d]", e);
    }
    free(z), free(probs), free(w);
}

Test(cpu_ops, router_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 12);
    /* passes 4-7: the routing variants (sigmoid scores, route_scale, group-limited top-k) */
    for (int pass = 0; pass < 8; pass++) {
        struct router_ctx c = {separated_logits(&rng), NULL, frand(&rng, RT * RK, 1.0),
                               pass & 2 ? frand(&rng, RE, 1.0) : NULL, fnew(RT * RE),
                               fnew(RT * RK), mt_calloc(RT * RK, sizeof(int32_t)),
                               mt_calloc(RT * RK, sizeof(int32_t)), qwen_opts(pass & 1), false};
        /* a bias that reorders the selection (one step of the logit grid is ×2 in probability) */
        if (pass == 3 || pass == 7) c.bias = frand(&rng, RE, 0.05);
        if (pass >= 4) {
            c.o.sigmoid = pass != 6;
            c.o.route_scale = 2.5f;
            c.o.n_group = pass >= 6 ? 4 : 1;
            c.o.topk_group = pass >= 6 ? 2 : 1;
        }
        float *zero_aux = fnew(RE);
        if (!c.aux) c.aux = zero_aux;
        cpu_router_forward(c.idx0, c.w, c.probs, c.logits, c.bias, RT, RE, RK, &c.o);
        router_loss(&c);
        float *dz = fnew(RT * RE);
        cpu_router_backward(dz, c.c, c.probs, c.idx0, c.aux == zero_aux ? NULL : c.aux, RT, RE, RK,
                            &c.o);
        double *fd = dnew(RT * RE);
        fd_grad(fd, c.logits, RT * RE, router_loss, &c);
        cr_assert(!c.flipped, "pass %d: a finite-difference step changed the top-k selection", pass);
        char what[128];
        snprintf(what, sizeof what, "router dlogits (norm_topk %d, aux %d, bias %d, sigmoid %d, "
                 "scale %g, groups %d/%d)", c.o.norm_topk, c.aux != zero_aux, c.bias != NULL,
                 c.o.sigmoid, c.o.route_scale, c.o.topk_group, c.o.n_group);
        expect_grad(what, dz, fd, RT * RE);
        if (c.aux != zero_aux) free(c.aux);
        free(c.logits), free(c.bias), free(c.c), free(c.probs), free(c.w), free(c.idx);
        free(c.idx0), free(zero_aux), free(dz), free(fd);
    }
}

/* ---------------------------------------------------------------- gather and combine */

struct gather_ctx {
    float *in, *r, *out;
    const int32_t *idx;
    int R, H;
};

static double gather_loss(void *p)
{
    struct gather_ctx *c = p;
    cpu_gather_rows(c->out, c->in, c->idx, c->R, c->H);
    return project(c->r, c->out, (size_t)c->R * c->H);
}

Test(cpu_ops, gather_rows_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 13);
    enum { ROWS = 6, R = 8, H = 5 };
    const int32_t idx[R] = {4, 0, 4, 2, 5, 1, 4, 0};
    struct gather_ctx c = {frand(&rng, ROWS * H, 1.0), frand(&rng, R * H, 1.0), fnew(R * H), idx,
                           R, H};
    gather_loss(&c);
    for (int r = 0; r < R; r++)
        cr_expect(memcmp(c.out + r * H, c.in + idx[r] * H, H * sizeof(float)) == 0);
    float *d0 = frand(&rng, ROWS * H, 1.0), *d = fdup(d0, ROWS * H);
    cpu_gather_rows_backward(d, c.r, idx, R, H);
    float *g = added(d, d0, ROWS * H);
    double *fd = dnew(ROWS * H);
    fd_grad(fd, c.in, ROWS * H, gather_loss, &c);
    expect_grad("gather_rows din", g, fd, ROWS * H);
    /* rows are added in ascending r onto what din held */
    for (int row = 0; row < ROWS; row++)
        for (int h = 0; h < H; h++) {
            float want = d0[row * H + h];
            for (int r = 0; r < R; r++)
                if (idx[r] == row) want += c.r[r * H + h];
            cr_expect_eq(d[row * H + h], want);
        }
    free(c.in), free(c.r), free(c.out), free(d0), free(d), free(g), free(fd);
}

enum { CT = 4, CK = 3, CH = 10, CR = CT * CK + 2 }; /* two padding rows no token uses */

struct combine_ctx {
    float *y, *w, *r, *out;
    int32_t *slot;
};

static double combine_loss(void *p)
{
    struct combine_ctx *c = p;
    cpu_moe_combine_forward(c->out, c->y, c->slot, c->w, CT, CK, CH);
    return project(c->r, c->out, CT * CH);
}

Test(cpu_ops, moe_combine_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 14);
    int32_t slot[CT * CK];
    for (int i = 0; i < CT * CK; i++) slot[i] = (int32_t)((i * 5 + 3) % (CT * CK)); /* a shuffle */
    struct combine_ctx c = {frand(&rng, CR * CH, 1.0), frand(&rng, CT * CK, 1.0),
                            frand(&rng, CT * CH, 1.0), fnew(CT * CH), slot};
    combine_loss(&c);
    for (int t = 0; t < CT; t++)
        for (int h = 0; h < CH; h++) {
            double o = 0.0;
            for (int j = 0; j < CK; j++) o += (double)c.w[t * CK + j] * c.y[slot[t * CK + j] * CH + h];
            cr_expect(fabs(c.out[t * CH + h] - o) <= 1e-6 * (1.0 + fabs(o)));
        }
    float *dy = frand(&rng, CR * CH, 1.0), *dw = frand(&rng, CT * CK, 1.0);
    float *pad = fdup(dy + CT * CK * CH, 2 * CH);
    cpu_moe_combine_backward(dy, dw, c.r, c.y, slot, c.w, CT, CK, CH);
    double *fdy = dnew(CR * CH), *fdw = dnew(CT * CK);
    fd_grad(fdy, c.y, CT * CK * CH, combine_loss, &c); /* the used rows */
    fd_grad(fdw, c.w, CT * CK, combine_loss, &c);
    expect_grad("moe_combine dy", dy, fdy, CT * CK * CH);
    expect_grad("moe_combine dw", dw, fdw, CT * CK);
    cr_expect(memcmp(pad, dy + CT * CK * CH, 2 * CH * sizeof(float)) == 0,
              "rows no slot points at are left alone");
    free(c.y), free(c.w), free(c.r), free(c.out), free(dy), free(dw), free(pad), free(fdy);
    free(fdw);
}

/* ---------------------------------------------------------------- expert matmul */

enum { XE = 4, XI = 19, XO = 7 };
static const int64_t xoff[XE + 1] = {0, 3, 3, 8, 11}; /* expert 1 has no rows */
#define XR 11

struct expert_ctx {
    float *in, *w, *r, *out;
};

static double expert_loss(void *p)
{
    struct expert_ctx *c = p;
    cpu_expert_matmul_forward(c->out, c->in, c->w, xoff, NULL, XE, XI, XO);
    return project(c->r, c->out, XR * XO);
}

Test(cpu_ops, expert_matmul_equals_per_expert_matmul)
{
    mt_rng rng;
    mt_rng_seed(&rng, 15);
    float *x = frand(&rng, XR * XI, 1.0), *w = frand(&rng, XE * XO * XI, 1.0);
    float *y = fnew(XR * XO), *ref = fnew(XR * XO);
    cpu_expert_matmul_forward(y, x, w, xoff, NULL, XE, XI, XO);
    for (int e = 0; e < XE; e++)
        if (xoff[e + 1] > xoff[e])
            cpu_matmul_forward(ref + xoff[e] * XO, x + xoff[e] * XI, w + e * XO * XI,
                               (int)(xoff[e + 1] - xoff[e]), XI, XO);
    cr_expect(memcmp(y, ref, XR * XO * sizeof(float)) == 0);
    free(x), free(w), free(y), free(ref);
}

/* moe_rows_split finds each expert's rows from one block of source pairs (checked by a scan), and
 * the forward over those parts, the rows before and after them, gives the whole forward's bits,
 * each call writing only its part. */
Test(cpu_ops, expert_matmul_in_parts_by_source_rank)
{
    mt_rng rng;
    mt_rng_seed(&rng, 17);
    /* sources ascending within each expert: 0-4 rank 0, 5-9 rank 1, 10-14 rank 2 */
    const int32_t src[XR] = {1, 7, 12, /* expert 1: none */ 0, 5, 6, 9, 13, 10, 11, 14};
    int64_t lo[XE + 1], hi[XE + 1];
    cpu_moe_rows_split(lo, hi, xoff, src, XE, 5, 10);
    for (int e = 0; e < XE; e++)
        for (int64_t r = xoff[e]; r < xoff[e + 1]; r++)
            cr_expect((src[r] >= 5 && src[r] < 10) == (r >= lo[e] && r < hi[e]), "row %lld of expert %d", (long long)r, e);
    cr_expect(lo[2] == 3 + 1 && hi[2] == 3 + 4 && lo[3] == 8 && hi[3] == 8, "expert 2 [%lld, %lld), 3 [%lld, %lld)",
              (long long)lo[2], (long long)hi[2], (long long)lo[3], (long long)hi[3]);
    cr_expect(lo[XE] == XR && hi[XE] == XR);
    float *x = frand(&rng, XR * XI, 1.0), *w = frand(&rng, XE * XO * XI, 1.0);
    float *y = fnew(XR * XO), *ref = fnew(XR * XO);
    cpu_expert_matmul_forward(ref, x, w, xoff, NULL, XE, XI, XO);
    for (int i = 0; i < XR * XO; i++) y[i] = NAN;
    const int64_t *begin[3] = {xoff, hi, lo}, *end[3] = {lo, xoff + 1, hi};
    bool done[XR] = {false};
    for (int k = 0; k < 3; k++) {
        cpu_expert_matmul_forward(y, x, w, begin[k], end[k], XE, XI, XO);
        for (int e = 0; e < XE; e++)
            for (int64_t r = begin[k][e]; r < end[k][e]; r++) done[r] = true;
        for (int r = 0; r < XR; r++)
            cr_expect(done[r] ? memcmp(y + r * XO, ref + r * XO, XO * sizeof(float)) == 0 : isnan(y[r * XO]),
                      "part %d, row %d", k, r);
    }
    free(x), free(w), free(y), free(ref);
}

Test(cpu_ops, expert_matmul_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 16);
    struct expert_ctx c = {frand(&rng, XR * XI, 1.0), frand(&rng, XE * XO * XI, 1.0),
                           frand(&rng, XR * XO, 1.0), fnew(XR * XO)};
    float *din = frand(&rng, XR * XI, 1.0), *dw0 = frand(&rng, XE * XO * XI, 1.0);
    float *dw = fdup(dw0, XE * XO * XI);
    cpu_expert_matmul_backward(din, dw, c.r, c.in, c.w, xoff, XE, XI, XO);
    cr_expect(memcmp(dw + XO * XI, dw0 + XO * XI, XO * XI * sizeof(float)) == 0,
              "the expert with no rows must get nothing added");
    float *gw = added(dw, dw0, XE * XO * XI);
    double *fdx = dnew(XR * XI), *fdw = dnew(XE * XO * XI);
    fd_grad(fdx, c.in, XR * XI, expert_loss, &c);
    fd_grad(fdw, c.w, XE * XO * XI, expert_loss, &c);
    expect_grad("expert_matmul din", din, fdx, XR * XI);
    expect_grad("expert_matmul dw", gw, fdw, XE * XO * XI);
    free(c.in), free(c.w), free(c.r), free(c.out), free(din), free(dw0), free(dw), free(gw);
    free(fdx), free(fdw);
}

/* ---------------------------------------------------------------- swiglu */

struct swiglu_ctx {
    float *gu, *r, *out;
    int R, I;
};

static double swiglu_loss(void *p)
{
    struct swiglu_ctx *c = p;
    cpu_swiglu_forward(c->out, c->gu, c->R, c->I);
    return project(c->r, c->out, (size_t)c->R * c->I);
}

Test(cpu_ops, swiglu_forward_and_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 17);
    enum { R = 5, I = 7 };
    struct swiglu_ctx c = {frand(&rng, R * 2 * I, 2.0), frand(&rng, R * I, 1.0), fnew(R * I), R, I};
    swiglu_loss(&c);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < I; i++) {
            double g = c.gu[r * 2 * I + i], u = c.gu[r * 2 * I + I + i];
            double ref = g / (1.0 + exp(-g)) * u;
            cr_expect(fabs(c.out[r * I + i] - ref) <= 1e-6 * (fabs(ref) + 1e-6));
        }
    float *dgu = fnew(R * 2 * I);
    cpu_swiglu_backward(dgu, c.r, c.gu, R, I);
    double *fd = dnew(R * 2 * I);
    fd_grad(fd, c.gu, R * 2 * I, swiglu_loss, &c);
    expect_grad("swiglu dgu", dgu, fd, R * 2 * I);
    float *z = fdup(c.gu, R * 2 * I);
    cpu_swiglu_backward(z, c.r, z, R, I);
    cr_expect(memcmp(z, dgu, R * 2 * I * sizeof(float)) == 0, "in-place swiglu backward differs");
    free(c.gu), free(c.r), free(c.out), free(dgu), free(fd), free(z);
}

/* ---------------------------------------------------------------- cross-entropy */

enum { LN = 6, LV = 11 };
static const int32_t ltargets[LN] = {3, MT_IGNORE_INDEX, 0, 10, MT_IGNORE_INDEX, 3};
static const float lscale = 0.37f;

struct ce_ctx {
    float *z, *losses, *lse;
};

static double ce_loss(void *p)
{
    struct ce_ctx *c = p;
    cpu_cross_entropy_forward(c->losses, c->lse, c->z, ltargets, LN, LV);
    double l = 0.0;
    for (int n = 0; n < LN; n++) l += lscale * (double)c->losses[n];
    return l;
}

Test(cpu_ops, cross_entropy_forward_and_grad)
{
    mt_rng rng;
    mt_rng_seed(&rng, 18);
    struct ce_ctx c = {frand(&rng, LN * LV, 2.0), fnew(LN), fnew(LN)};
    ce_loss(&c);
    for (int n = 0; n < LN; n++) {
        if (ltargets[n] == MT_IGNORE_INDEX) {
            cr_expect_eq(c.losses[n], 0.0f);
            continue;
        }
        double s = 0.0;
        for (int v = 0; v < LV; v++) s += exp((double)c.z[n * LV + v]);
        double ref = log(s) - c.z[n * LV + ltargets[n]];
        cr_expect(fabs(c.losses[n] - ref) <= 1e-6 * ref, "loss[%d] = %.9g want %.9g", n, c.losses[n],
                  ref);
    }
    float *dz = fnew(LN * LV);
    cpu_cross_entropy_backward(dz, c.z, c.lse, ltargets, LN, LV, lscale);
    double *fd = dnew(LN * LV);
    fd_grad(fd, c.z, LN * LV, ce_loss, &c);
    expect_grad("cross_entropy dlogits", dz, fd, LN * LV);
    for (int n = 0; n < LN; n++)
        if (ltargets[n] == MT_IGNORE_INDEX)
            for (int v = 0; v < LV; v++) cr_expect_eq(dz[n * LV + v], 0.0f, "ignored row %d", n);
    ce_loss(&c); /* the finite differences left the lse of a perturbed z behind */
    float *z = fdup(c.z, LN * LV);
    cpu_cross_entropy_backward(z, z, c.lse, ltargets, LN, LV, lscale);
    cr_expect(memcmp(z, dz, LN * LV * sizeof(float)) == 0, "in-place cross-entropy differs");
    free(c.z), free(c.losses), free(c.lse), free(dz), free(fd), free(z);
}

/* ---------------------------------------------------------------- adamw */

Test(cpu_ops, adamw_matches_scalar_formula)
{
    mt_rng rng;
    mt_rng_seed(&rng, 19);
    enum { N = 9 };
    const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
    for (int pass = 0; pass < 2; pass++) {
        const int t = pass == 0 ? 1 : 4;
        float *p = frand(&rng, N, 1.0), *g = frand(&rng, N, 1.0), *m = fnew(N), *v = fnew(N);
        if (t > 1)
            for (int i = 0; i < N; i++) {
                m[i] = (float)(0.1 * mt_rng_normal(&rng));
                v[i] = (float)(0.01 * mt_rng_uniform(&rng) + 1e-4);
            }
        float *p0 = fdup(p, N), *m0 = fdup(m, N), *v0 = fdup(v, N), *copy = fnew(N);
        /* pass 0: param is a separate buffer; pass 1: param aliases master */
        float *param = pass == 0 ? copy : p;
        cpu_adamw_update(p, param, g, m, v, N, lr, b1, b2, eps, wd, t, gs);
        for (int i = 0; i < N; i++) {
            double gg = (double)g[i] * gs;
            double mm = b1 * (double)m0[i] + (1.0 - b1) * gg;
            double vv = b2 * (double)v0[i] + (1.0 - b2) * gg * gg;
            double mhat = mm / (1.0 - pow(b1, t)), vhat = vv / (1.0 - pow(b2, t));
            double pp = (double)p0[i] * (1.0 - (double)lr * wd);
            pp -= lr * (mhat / (sqrt(vhat) + eps));
            /* float element maths: a few ulps of each quantity */
            cr_expect(fabs(m[i] - mm) <= 1e-6 * fabs(mm) + 1e-12, "m[%d] t=%d", i, t);
            cr_expect(fabs(v[i] - vv) <= 1e-6 * fabs(vv) + 1e-12, "v[%d] t=%d", i, t);
            cr_expect(fabs(p[i] - pp) <= 1e-6 * fabs(pp) + 1e-6 * lr, "p[%d] t=%d: %.9g want %.9g",
                      i, t, p[i], pp);
            cr_expect_eq(param[i], p[i], "param must equal master");
            cr_expect(fabs(p[i] - p0[i]) > 1e-5 * lr, "the step must move the parameter");
        }
        free(p), free(g), free(m), free(v), free(p0), free(m0), free(v0), free(copy);
    }
}

/* the multi-segment op is adamw_update per segment, bit for bit; a zero-length segment and the
 * elements between segments stay untouched */
Test(cpu_ops, adamw_multi_is_per_segment)
{
    mt_rng rng;
    mt_rng_seed(&rng, 20);
    enum { N = 40, NSEG = 3 };
    const size_t off[NSEG] = {2, 10, 20}, len[NSEG] = {5, 0, 17};
    const float wd[NSEG] = {0.1f, 0.1f, 0.0f};
    float *p = frand(&rng, N, 1.0), *g = frand(&rng, N, 1.0), *m = frand(&rng, N, 0.1);
    float *v = frand(&rng, N, 0.01);
    for (int i = 0; i < N; i++) v[i] = fabsf(v[i]);
    float *p2 = fdup(p, N), *m2 = fdup(m, N), *v2 = fdup(v, N), *p0 = fdup(p, N);
    struct adamw_segment segs[NSEG];
    for (int j = 0; j < NSEG; j++) {
        segs[j] = (struct adamw_segment){p + off[j], p + off[j], g + off[j], m + off[j], v + off[j],
                                         len[j], wd[j], NULL};
        cpu_adamw_update(p2 + off[j], p2 + off[j], g + off[j], m2 + off[j], v2 + off[j], len[j],
                         1e-3f, 0.9f, 0.95f, 1e-8f, wd[j], 2, 0.5f);
    }
    cpu_adamw_update_multi(segs, NSEG, sizeof(float), 1e-3f, 0.9f, 0.95f, 1e-8f, 2, 0.5f);
    cr_expect(memcmp(p, p2, sizeof(float) * N) == 0, "master differs from per-segment updates");
    cr_expect(memcmp(m, m2, sizeof(float) * N) == 0, "m differs");
    cr_expect(memcmp(v, v2, sizeof(float) * N) == 0, "v differs");
    cr_expect(p[0] == p0[0] && p[7] == p0[7] && p[12] == p0[12] && p[39] == p0[39],
              "elements outside the segments changed");
    cr_expect(p[3] != p0[3] && p[21] != p0[21], "the segments must move");
    free(p), free(g), free(m), free(v), free(p2), free(m2), free(v2), free(p0);
}

/* the same with bf16 moments (mom_bytes 2): adamw_update_m16 per segment, bit for bit */
Test(cpu_ops, adamw_multi_bf16_moments_is_per_segment)
{
    mt_rng rng;
    mt_rng_seed(&rng, 21);
    enum { N = 40, NSEG = 3 };
    const size_t off[NSEG] = {1, 9, 19}, len[NSEG] = {6, 0, 20};
    const float wd[NSEG] = {0.0f, 0.1f, 0.1f};
    float *p = frand(&rng, N, 1.0), *g = frand(&rng, N, 1.0), *mf = frand(&rng, N, 0.1);
    float *vf = frand(&rng, N, 0.01);
    uint16_t m[N], v[N], m2[N], v2[N];
    for (int i = 0; i < N; i++) {
        m[i] = m2[i] = st_f32_to_bf16(mf[i]);
        v[i] = v2[i] = st_f32_to_bf16(fabsf(vf[i]));
    }
    float *p2 = fdup(p, N), *p0 = fdup(p, N);
    struct adamw_segment segs[NSEG];
    for (int j = 0; j < NSEG; j++) {
        segs[j] = (struct adamw_segment){p + off[j], NULL, g + off[j], m + off[j], v + off[j],
                                         len[j], wd[j], NULL};
        cpu_adamw_update_m16(p2 + off[j], NULL, g + off[j], m2 + off[j], v2 + off[j], len[j],
                             1e-3f, 0.9f, 0.95f, 1e-8f, wd[j], 3, 0.5f);
    }
    cpu_adamw_update_multi(segs, NSEG, 2, 1e-3f, 0.9f, 0.95f, 1e-8f, 3, 0.5f);
    cr_expect(memcmp(p, p2, sizeof(float) * N) == 0, "master differs from per-segment updates");
    cr_expect(memcmp(m, m2, sizeof m) == 0, "m differs");
    cr_expect(memcmp(v, v2, sizeof v) == 0, "v differs");
    cr_expect(p[0] == p0[0] && p[8] == p0[8] && p[39] == p0[39], "elements outside the segments changed");
    cr_expect(p[3] != p0[3] && p[25] != p0[25], "the segments must move");
    free(p), free(g), free(mf), free(vf), free(p2), free(p0);
}
