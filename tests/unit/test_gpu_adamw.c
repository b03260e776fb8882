/* adamw_update_multi on the GPU (suite "gpu"): one launch over many segments of flat buffers must
 * give, bit for bit, what adamw_update (fp32 moments) or adamw_update_m16 (bf16 moments) gives on
 * each segment alone -- every byte of master, moments and compute copy, the gaps between segments
 * included (left untouched) -- in both compute dtypes. The layouts cover what the kernel special-
 * cases: segment starts off the 16-byte boundary (a scalar head), lengths not a multiple of its
 * 8-element packs (a scalar tail) and shorter than one pack, lengths around its 2048-element
 * blocks, empty segments, moments whose alignment differs from the master's (the whole segment
 * scalar), 50 segments in one call, a compute copy that is the master itself or absent, and a
 * second step over the same list (the table the op keeps on the device). The GPU results are also
 * checked against the CPU's multi op within the fp32 tolerance. A master held split
 * (train.master_weights: split) must leave, on the same layouts, the fp32 master's bits, moments
 * and the high half mt_master_split makes of them. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "gpu_backend.h"
#include "master_split.h"
#include "ops.h"
#include "safetensors.h"

struct seg_spec {
    size_t off, len;
    size_t mshift; /* the moments' offset is off + mshift (their alignment differs from the master's) */
};

enum param_kind { PARAM_OWN, PARAM_IS_MASTER, PARAM_NONE };

static void *dev_of(const struct backend *g, const void *h, size_t bytes)
{
    void *d = g->alloc(bytes ? bytes : 1);
    g->upload(d, h, bytes);
    return d;
}

static void *host_of(const struct backend *g, const void *d, size_t bytes)
{
    void *h = mt_malloc(bytes ? bytes : 1);
    g->download(h, d, bytes);
    return h;
}

static void expect_same(const char *what, const char *name, const void *a, const void *b, size_t bytes)
{
    const bool same = !memcmp(a, b, bytes);
    fprintf(stderr, "gpu adamw multi %-34s %-6s %s\n", name, what, same ? "bit-exact" : "DIFFERS");
    cr_expect(same, "adamw multi %s: %s differs from the per-segment op", name, what);
}

static double rel_err(const float *got, const float *ref, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) return INFINITY;
        d += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
        r += (double)ref[i] * ref[i];
    }
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

/* Two optimizer steps over the segments of N-element buffers: the multi op on one copy of the
 * state, the per-segment op on another, the CPU's multi op on a host copy. */
static void run_case(bool fp32, size_t mom_bytes, enum param_kind pk, const char *name,
                     const struct seg_spec *sp, int nseg, size_t N, uint64_t seed)
{
    const struct backend *g = gpu_backend_or_skip(fp32), *c = backend_cpu();
    if (pk == PARAM_IS_MASTER) cr_assert(fp32, "a compute copy can be the master only in fp32");
    mt_rng rng;
    mt_rng_seed(&rng, seed);
    const size_t xs = g->x_size, mb = mom_bytes;
    float *master = mt_malloc(N * sizeof(float)), *grad = mt_malloc(N * sizeof(float));
    float *mf = mt_malloc(N * sizeof(float)), *vf = mt_malloc(N * sizeof(float));
    for (size_t i = 0; i < N; i++) {
        master[i] = (float)mt_rng_normal(&rng);
        grad[i] = (float)(0.1 * mt_rng_normal(&rng));
        mf[i] = (float)(0.01 * mt_rng_normal(&rng));
        vf[i] = (float)fabs(0.001 * mt_rng_normal(&rng));
    }
    /* the moments as stored (bf16 rounded to nearest even), and their fp32 values for the CPU */
    void *mom[2];
    float *momf[2] = {mf, vf};
    for (int k = 0; k < 2; k++) {
        mom[k] = mt_malloc(N * mb);
        for (size_t i = 0; i < N; i++) {
            if (mb == 2) {
                ((uint16_t *)mom[k])[i] = st_f32_to_bf16(momf[k][i]);
                momf[k][i] = st_bf16_to_f32(((uint16_t *)mom[k])[i]);
            } else {
                ((float *)mom[k])[i] = momf[k][i];
            }
        }
    }
    void *poison = mt_malloc(N * xs);
    memset(poison, 0xff, N * xs);
    float *d_grad = dev_of(g, grad, N * sizeof(float));
    float *a_master = dev_of(g, master, N * sizeof(float)), *b_master = dev_of(g, master, N * sizeof(float));
    void *a_m = dev_of(g, mom[0], N * mb), *a_v = dev_of(g, mom[1], N * mb);
    void *b_m = dev_of(g, mom[0], N * mb), *b_v = dev_of(g, mom[1], N * mb);
    void *a_param = dev_of(g, poison, N * xs), *b_param = dev_of(g, poison, N * xs);
    float *c_master = mt_malloc(N * sizeof(float));
    memcpy(c_master, master, N * sizeof(float));

    struct adamw_segment *ga = mt_calloc((size_t)nseg, sizeof *ga), *cs = mt_calloc((size_t)nseg, sizeof *cs);
    for (int j = 0; j < nseg; j++) {
        const size_t o = sp[j].off, om = o + sp[j].mshift;
        cr_assert(om + sp[j].len <= N && o + sp[j].len <= N, "%s: segment %d out of range", name, j);
        const float wd = j % 3 ? 0.1f : 0.0f;
        void *ap = pk == PARAM_NONE ? NULL : pk == PARAM_IS_MASTER ? (void *)(a_master + o) : (char *)a_param + o * xs;
        ga[j] = (struct adamw_segment){a_master + o, ap, d_grad + o, (char *)a_m + om * mb,
                                       (char *)a_v + om * mb, sp[j].len, wd, NULL};
        cs[j] = (struct adamw_segment){c_master + o, NULL, grad + o, momf[0] + om, momf[1] + om,
                                       sp[j].len, wd, NULL};
    }
    const float lr[2] = {1e-3f, 7e-4f}, gs[2] = {0.7f, 1.0f};
    for (int t = 1; t <= 2; t++) {
        const float l = lr[t - 1], s = gs[t - 1];
        g->adamw_update_multi(ga, nseg, mb, l, 0.9f, 0.95f, 1e-8f, t, s);
        c->adamw_update_multi(cs, nseg, sizeof(float), l, 0.9f, 0.95f, 1e-8f, t, s);
        for (int j = 0; j < nseg; j++) {
            const size_t o = sp[j].off, om = o + sp[j].mshift;
            void *bp = pk == PARAM_NONE ? NULL : pk == PARAM_IS_MASTER ? (void *)(b_master + o) : (char *)b_param + o * xs;
            void *bm = (char *)b_m + om * mb, *bv = (char *)b_v + om * mb;
            if (mb == 2)
                g->adamw_update_m16(b_master + o, bp, d_grad + o, bm, bv, sp[j].len, l, 0.9f, 0.95f,
                                    1e-8f, ga[j].weight_decay, t, s);
            else
                g->adamw_update(b_master + o, bp, d_grad + o, bm, bv, sp[j].len, l, 0.9f, 0.95f,
                                1e-8f, ga[j].weight_decay, t, s);
        }
        /* the CPU keeps fp32 moments: round them as the GPU stores them before the next step */
        for (int k = 0; k < 2 && mb == 2; k++)
            for (size_t i = 0; i < N; i++) momf[k][i] = st_bf16_to_f32(st_f32_to_bf16(momf[k][i]));
    }

    float *am = host_of(g, a_master, N * sizeof(float)), *bmh = host_of(g, b_master, N * sizeof(float));
    void *a1 = host_of(g, a_m, N * mb), *b1 = host_of(g, b_m, N * mb);
    void *a2 = host_of(g, a_v, N * mb), *b2 = host_of(g, b_v, N * mb);
    void *ap = host_of(g, a_param, N * xs), *bp = host_of(g, b_param, N * xs);
    expect_same("master", name, am, bmh, N * sizeof(float));
    expect_same("m", name, a1, b1, N * mb);
    expect_same("v", name, a2, b2, N * mb);
    expect_same("param", name, ap, bp, N * xs);
    if (pk != PARAM_OWN) expect_same("param untouched", name, ap, poison, N * xs);

    /* the gaps keep their master weights; the segments moved */
    size_t gap_changed = 0, moved = 0, k = 0;
    for (int j = 0; j <= nseg; j++) {
        const size_t end = j < nseg ? sp[j].off : N;
        for (; k < end; k++) gap_changed += memcmp(&am[k], &master[k], sizeof(float)) != 0;
        if (j == nseg) break;
        for (; k < sp[j].off + sp[j].len; k++) moved += am[k] != master[k];
    }
    cr_expect(gap_changed == 0, "adamw multi %s: %zu elements between segments changed", name, gap_changed);
    cr_expect(moved > 0, "adamw multi %s: no element moved", name);
    const double e = rel_err(am, c_master, N);
    fprintf(stderr, "gpu adamw multi %-34s master vs CPU rel err %.2e\n", name, e);
    cr_expect(e <= 1e-5, "adamw multi %s: master vs CPU relative error %.3e", name, e);

    void *dbufs[] = {d_grad, a_master, b_master, a_m, a_v, b_m, b_v, a_param, b_param};
    for (size_t i = 0; i < sizeof dbufs / sizeof dbufs[0]; i++) g->free(dbufs[i]);
    void *hbufs[] = {master, grad, mf, vf, mom[0], mom[1], poison, c_master, ga, cs, am, bmh, a1, b1, a2, b2, ap, bp};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

/* ragged lengths around the packs (1, 7, 8, 9) and the 2048-element blocks (4095, 4096, 4097),
 * an empty segment, an unaligned start (5), one shorter than its head (3 at 32353), a long one;
 * gaps of 3 or more so that the shifted-moment case fits */
static const struct seg_spec ragged[] = {
    {0, 1, 0},     {5, 4095, 0},   {4104, 4096, 0},  {8203, 4097, 0},  {12304, 0, 0},
    {12310, 7, 0}, {12320, 8, 0},  {12331, 9, 0},    {12345, 20003, 0}, {32353, 3, 0},
};
enum { RAGGED_N = 32400 };

static void ragged_cases(size_t mb)
{
    const int n = (int)(sizeof ragged / sizeof ragged[0]);
    char name[64];
    for (int fp32 = 0; fp32 < 2; fp32++) {
        snprintf(name, sizeof name, "%s ragged, %s moments", fp32 ? "fp32" : "bf16", mb == 2 ? "bf16" : "fp32");
        run_case(fp32, mb, PARAM_OWN, name, ragged, n, RAGGED_N, 116 + mb + fp32);
        snprintf(name, sizeof name, "%s ragged no copy, %s mom.", fp32 ? "fp32" : "bf16", mb == 2 ? "bf16" : "fp32");
        run_case(fp32, mb, PARAM_NONE, name, ragged, n, RAGGED_N, 216 + mb + fp32);
    }
    snprintf(name, sizeof name, "fp32 copy = master, %s moments", mb == 2 ? "bf16" : "fp32");
    run_case(true, mb, PARAM_IS_MASTER, name, ragged, n, RAGGED_N, 316 + mb);
    /* moments one to three elements off the master's alignment: no common 16-byte boundary */
    struct seg_spec shifted[sizeof ragged / sizeof ragged[0]];
    for (int j = 0; j < n; j++) shifted[j] = ragged[j], shifted[j].mshift = 1 + (size_t)j % 3;
    for (int fp32 = 0; fp32 < 2; fp32++) {
        snprintf(name, sizeof name, "%s moments misaligned, %s mom.", fp32 ? "fp32" : "bf16", mb == 2 ? "bf16" : "fp32");
        run_case(fp32, mb, PARAM_OWN, name, shifted, n, RAGGED_N, 416 + mb + fp32);
    }
}

/* 50 segments of random lengths (a fifth of them empty) and random gaps */
static void many_cases(size_t mb)
{
    enum { NSEG = 50 };
    struct seg_spec sp[NSEG];
    mt_rng rng;
    mt_rng_seed(&rng, 50 + mb);
    size_t at = 0;
    for (int j = 0; j < NSEG; j++) {
        at += (size_t)(mt_rng_uniform(&rng) * 12);
        const size_t len = j % 5 == 2 ? 0 : 1 + (size_t)(mt_rng_uniform(&rng) * 9000);
        sp[j] = (struct seg_spec){at, len, 0};
        at += len;
    }
    char name[64];
    for (int fp32 = 0; fp32 < 2; fp32++) {
        snprintf(name, sizeof name, "%s 50 segments, %s moments", fp32 ? "fp32" : "bf16", mb == 2 ? "bf16" : "fp32");
        run_case(fp32, mb, PARAM_OWN, name, sp, NSEG, at + 16, 516 + mb + fp32);
    }
}

Test(gpu, adamw_multi)
{
    ragged_cases(sizeof(float));
    many_cases(sizeof(float));
}

Test(gpu, adamw_multi_m16)
{
    ragged_cases(2);
    many_cases(2);
}

/* Split masters (ops.h adamw_segment.master_lo): two steps over the segments with the master as
 * its bf16 high half and low half, against the same op on an fp32 master (no compute copy) on the
 * GPU: the joined master, both moments and the high half bit for bit over all N elements (the
 * gaps untouched in both); and the CPU's split op within the fp32 tolerance. */
static void run_split_case(size_t mb, const char *name, const struct seg_spec *sp, int nseg, size_t N,
                           uint64_t seed)
{
    const struct backend *g = gpu_backend_or_skip(false), *c = backend_cpu();
    mt_rng rng;
    mt_rng_seed(&rng, seed);
    float *master = mt_malloc(N * sizeof(float)), *grad = mt_malloc(N * sizeof(float));
    uint16_t *hi = mt_malloc(N * 2), *lo = mt_malloc(N * 2);
    void *mom = mt_calloc(N, mb);
    for (size_t i = 0; i < N; i++) {
        master[i] = (float)(0.05 * mt_rng_normal(&rng));
        grad[i] = (float)(0.1 * mt_rng_normal(&rng));
        mt_master_split(master[i], &hi[i], &lo[i]);
    }
    float *d_grad = dev_of(g, grad, N * 4), *a_master = dev_of(g, master, N * 4);
    uint16_t *b_hi = dev_of(g, hi, N * 2), *b_lo = dev_of(g, lo, N * 2);
    void *a_m = dev_of(g, mom, N * mb), *a_v = dev_of(g, mom, N * mb), *b_m = dev_of(g, mom, N * mb),
         *b_v = dev_of(g, mom, N * mb);
    void *c_m = mt_calloc(N, mb), *c_v = mt_calloc(N, mb);
    uint16_t *c_hi = mt_malloc(N * 2), *c_lo = mt_malloc(N * 2);
    memcpy(c_hi, hi, N * 2), memcpy(c_lo, lo, N * 2);
    struct adamw_segment *fa = mt_calloc((size_t)nseg, sizeof *fa), *sb = mt_calloc((size_t)nseg, sizeof *sb),
                         *sc = mt_calloc((size_t)nseg, sizeof *sc);
    for (int j = 0; j < nseg; j++) {
        const size_t o = sp[j].off, om = o + sp[j].mshift, n = sp[j].len;
        const float wd = j % 3 ? 0.1f : 0.0f;
        fa[j] = (struct adamw_segment){a_master + o, NULL, d_grad + o, (char *)a_m + om * mb, (char *)a_v + om * mb,
                                       n, wd, NULL};
        sb[j] = (struct adamw_segment){NULL, b_hi + o, d_grad + o, (char *)b_m + om * mb, (char *)b_v + om * mb,
                                       n, wd, b_lo + o};
        sc[j] = (struct adamw_segment){NULL, c_hi + o, grad + o, (char *)c_m + om * mb, (char *)c_v + om * mb,
                                       n, wd, c_lo + o};
    }
    for (int t = 1; t <= 2; t++) {
        g->adamw_update_multi(fa, nseg, mb, 1e-3f, 0.9f, 0.95f, 1e-8f, t, 0.9f);
        g->adamw_update_multi(sb, nseg, mb, 1e-3f, 0.9f, 0.95f, 1e-8f, t, 0.9f);
        c->adamw_update_multi(sc, nseg, mb, 1e-3f, 0.9f, 0.95f, 1e-8f, t, 0.9f);
    }
    float *am = host_of(g, a_master, N * 4);
    uint16_t *bh = host_of(g, b_hi, N * 2), *bl = host_of(g, b_lo, N * 2);
    float *joined = mt_malloc(N * 4), *cj = mt_malloc(N * 4);
    uint16_t *want_hi = mt_malloc(N * 2);
    size_t moved = 0;
    for (size_t i = 0; i < N; i++) {
        joined[i] = mt_master_join(bh[i], bl[i]);
        cj[i] = mt_master_join(c_hi[i], c_lo[i]);
        uint32_t u;
        memcpy(&u, &am[i], 4);
        want_hi[i] = mt_master_hi_bits(u);
        moved += am[i] != master[i];
    }
    expect_same("master", name, joined, am, N * 4);
    expect_same("high half", name, bh, want_hi, N * 2);
    void *a1 = host_of(g, a_m, N * mb), *b1 = host_of(g, b_m, N * mb), *a2 = host_of(g, a_v, N * mb),
         *b2 = host_of(g, b_v, N * mb);
    expect_same("m", name, a1, b1, N * mb);
    expect_same("v", name, a2, b2, N * mb);
    cr_expect(moved > 0, "adamw multi %s: no element moved", name);
    const double e = rel_err(joined, cj, N);
    fprintf(stderr, "gpu adamw multi %-34s split master vs CPU split rel err %.2e\n", name, e);
    cr_expect(e <= 1e-5, "adamw multi %s: split master vs the CPU's, relative error %.3e", name, e);
    void *dbufs[] = {d_grad, a_master, b_hi, b_lo, a_m, a_v, b_m, b_v};
    for (size_t i = 0; i < sizeof dbufs / sizeof dbufs[0]; i++) g->free(dbufs[i]);
    void *hbufs[] = {master, grad, hi, lo, mom, c_m, c_v, c_hi, c_lo, fa, sb, sc, am, bh, bl, joined, cj, want_hi,
                     a1, b1, a2, b2};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

Test(gpu, adamw_multi_split_master)
{
    const int n = (int)(sizeof ragged / sizeof ragged[0]);
    struct seg_spec shifted[sizeof ragged / sizeof ragged[0]];
    for (int j = 0; j < n; j++) shifted[j] = ragged[j], shifted[j].mshift = 1 + (size_t)j % 3;
    for (size_t mb = 2; mb <= 4; mb += 2) {
        char name[64];
        snprintf(name, sizeof name, "split ragged, %s moments", mb == 2 ? "bf16" : "fp32");
        run_split_case(mb, name, ragged, n, RAGGED_N, 616 + mb);
        snprintf(name, sizeof name, "split moments misaligned, %s mom.", mb == 2 ? "bf16" : "fp32");
        run_split_case(mb, name, shifted, n, RAGGED_N, 716 + mb);
    }
}

