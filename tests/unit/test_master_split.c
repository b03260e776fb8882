/* train.master_weights: split (src/master_split.h): the fp32 master held as its bf16 compute copy
 * and a 16-bit low half. The pair must be the master's 32 bits for every bit pattern; the high half
 * must be the nearest bf16 but for exact ties (away from zero there, where nearest-even could need
 * a low half of +32768); the CPU's AdamW on split segments must leave the same master bits and
 * moments as on an fp32 master; and the config must refuse split where no bf16 copy exists. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "../test_util.h"
#include "config_test_util.h"
#include "master_split.h"
#include "memory_estimate.h"
#include "ops.h"
#include "tensors.h"

TestSuite(master_split, .init = make_tmp, .fini = remove_tmp);

static uint32_t bits_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* nearest-even bf16 of a non-NaN pattern, as the casts elsewhere round */
static uint16_t rne_hi(uint32_t u) { return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16); }

Test(master_split, every_pattern_round_trips_and_rounds_to_nearest)
{
    mt_rng rng;
    mt_rng_seed(&rng, 20261130);
    long ties = 0, checked = 0;
    for (long i = 0; i < 3000000; i++) {
        uint32_t u = (uint32_t)(mt_rng_uniform(&rng) * 4294967296.0);
        if (i % 7 == 0) u = (u & 0xffff0000u) | 0x8000u;             /* exact ties */
        if (i % 11 == 0) u = (u & 0xffff0000u) | (0x7fffu + (i & 3)); /* next to them */
        float x;
        memcpy(&x, &u, sizeof x);
        uint16_t hi, lo;
        mt_master_split(x, &hi, &lo);
        const float back = mt_master_join(hi, lo);
        cr_assert_eq(bits_of(back), u, "pattern %08x came back as %08x (hi %04x lo %04x)", u, bits_of(back), hi, lo);
        if (isnan(x) || (u & 0x7fffffffu) >= 0x7f7f8000u) continue; /* NaN, or rounds past the largest bf16 */
        checked++;
        if ((u & 0xffffu) == 0x8000u) {
            ties++;
            cr_assert_eq(hi, (uint16_t)((u >> 16) + 1), "tie %08x: high half %04x, not away from zero", u, hi);
        } else {
            cr_assert_eq(hi, rne_hi(u), "pattern %08x: high half %04x, nearest bf16 %04x", u, hi, rne_hi(u));
        }
    }
    cr_assert_gt(ties, 100000, "only %ld ties checked", ties);
    fprintf(stderr, "master split: 3000000 patterns round-trip; %ld rounded as nearest (%ld ties away from zero)\n",
            checked, ties);
}

/* Two steps of the CPU's adamw_update_multi over three segments (one without decay) of an fp32
 * master and of the same master split: the split run's joined master, its moments and its high
 * half (the master rounded as mt_master_split rounds) against the fp32 run's, bit for bit. */
static void cpu_split_case(size_t mom_bytes)
{
    const struct backend *c = backend_cpu();
    enum { N = 20011 };
    const size_t off[3] = {0, 7001, 7013}, len[3] = {7001, 12, N - 7013};
    mt_rng rng;
    mt_rng_seed(&rng, 77 + mom_bytes);
    float *master = mt_malloc(N * sizeof(float)), *grad = mt_malloc(N * sizeof(float));
    uint16_t *hi = mt_malloc(N * sizeof(uint16_t)), *lo = mt_malloc(N * sizeof(uint16_t));
    void *mom[2][2];
    for (int r = 0; r < 2; r++)
        for (int k = 0; k < 2; k++) mom[r][k] = mt_calloc(N, mom_bytes);
    for (int i = 0; i < N; i++) {
        master[i] = (float)(0.02 * mt_rng_normal(&rng));
        grad[i] = (float)(0.1 * mt_rng_normal(&rng));
        mt_master_split(master[i], &hi[i], &lo[i]);
    }
    struct adamw_segment fp[3], sp[3];
    for (int j = 0; j < 3; j++) {
        const float wd = j == 1 ? 0.0f : 0.1f;
        fp[j] = (struct adamw_segment){master + off[j], NULL, grad + off[j], (char *)mom[0][0] + off[j] * mom_bytes,
                                       (char *)mom[0][1] + off[j] * mom_bytes, len[j], wd, NULL};
        sp[j] = (struct adamw_segment){NULL, hi + off[j], grad + off[j], (char *)mom[1][0] + off[j] * mom_bytes,
                                       (char *)mom[1][1] + off[j] * mom_bytes, len[j], wd, lo + off[j]};
    }
    for (int t = 1; t <= 2; t++) {
        c->adamw_update_multi(fp, 3, mom_bytes, 1e-3f, 0.9f, 0.95f, 1e-8f, t, 0.8f);
        c->adamw_update_multi(sp, 3, mom_bytes, 1e-3f, 0.9f, 0.95f, 1e-8f, t, 0.8f);
    }
    long moved = 0;
    for (int i = 0; i < N; i++) {
        const uint32_t want = bits_of(master[i]), got = bits_of(mt_master_join(hi[i], lo[i]));
        cr_assert_eq(got, want, "element %d: split master %08x, fp32 master %08x", i, got, want);
        cr_assert_eq(hi[i], mt_master_hi_bits(want), "element %d: high half %04x", i, hi[i]);
        moved += master[i] != 0.0f;
    }
    for (int k = 0; k < 2; k++)
        cr_assert(!memcmp(mom[0][k], mom[1][k], N * mom_bytes), "moment %d differs (%zu-byte moments)", k + 1, mom_bytes);
    cr_assert_gt(moved, N / 2);
    free(master), free(grad), free(hi), free(lo);
    for (int r = 0; r < 2; r++)
        for (int k = 0; k < 2; k++) free(mom[r][k]);
}

Test(master_split, cpu_adamw_leaves_the_fp32_masters_bits)
{
    cpu_split_case(4);
    cpu_split_case(2);
}

Test(master_split, config_refuses_it_without_a_bf16_copy)
{
    const char *e = fails("model:\n  precision: fp32\ntrain:\n  master_weights: split\n");
    cr_expect(strstr(e, "train.master_weights") && strstr(e, "model.precision"), "%s", e);
    e = fails("train:\n  master_weights: split\n  weight_copy: cast\n");
    cr_expect(strstr(e, "train.master_weights") && strstr(e, "weight_copy"), "%s", e);
    e = fails("train:\n  master_weights: halves\n");
    cr_expect(strstr(e, "master_weights"), "%s", e);
}

/* plan: a split master holds 2 bytes a parameter, and its copy is always kept */
Test(master_split, plan_counts_two_bytes_a_parameter)
{
    struct config c;
    cr_assert(load(&c, put("a.yaml", "train:\n  weight_copy: keep\n"), 0, NULL), "%s", errbuf);
    struct mesh_dims d = {0};
    d.pp = d.ep = d.ep_fsdp = d.S = d.world = 1;
    struct tensor_table tt;
    tensor_table_build(&tt, &c.model);
    struct stage_estimate a, b;
    estimate_stage(&c, &tt, &d, 0, true, &a);
    c.train.master_weights = MT_MASTER_SPLIT;
    estimate_stage(&c, &tt, &d, 0, true, &b);
    cr_expect_eq(b.master_bytes * 2, a.master_bytes, "master %g against %g bytes", b.master_bytes, a.master_bytes);
    cr_expect_eq(b.param_bytes, a.param_bytes);
    cr_expect_eq(b.total_bytes + a.master_bytes / 2, a.total_bytes);
    c.train.weight_copy = MT_COPY_AUTO;
    cr_expect(estimate_keep_copy(&c, &d, 1e6), "auto weight_copy must keep the copy that is the master's high half");
    tensor_table_free(&tt);
}

/* `plan` says what its master column holds, and the column halves */
Test(master_split, plan_says_so)
{
    char cmd[512], *out[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        snprintf(cmd, sizeof cmd, "%s/moetrain plan configs/tiny.yaml --world 1 --set train.weight_copy=keep%s 2>&1",
                 tu_build(), k ? " --set train.master_weights=split" : " --set train.master_weights=fp32");
        cr_assert_eq(tu_run(cmd, &out[k]), 0, "%s", out[k]);
    }
    cr_expect(strstr(out[0], "master = fp32 master weights of the shard"), "%s", out[0]);
    cr_expect(strstr(out[1], "master = the low 16 bits of the shard's fp32 master weights"), "%s", out[1]);
    free(out[0]), free(out[1]);
}


/* the CPU backend computes in fp32 and keeps no bf16 copy to be the master's high half: a one-line
 * error naming the key, on every rank, not a failed internal check */
Test(master_split, cpu_backend_refused)
{
    char cmd[640], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s -np 2 %s/moetrain train configs/tiny.yaml --backend cpu --set model.precision=bf16 "
             "--set train.master_weights=split --set train.steps=1 2>&1", tu_mpirun(), tu_build());
    const int rc = tu_run(cmd, &out);
    cr_expect_neq(rc, 0, "%s", out);
    cr_expect(strstr(out, "train.master_weights: split needs a bf16 compute copy, and the cpu backend computes in fp32"),
              "%s", out);
    cr_expect(!strstr(out, "src/params.c"), "an internal check fired instead of the user error: %s", out);
    free(out);
}

/* train.master_weights auto (the default): split where the master's high half can be the kept bf16
 * compute copy, fp32 where there is no such copy; split and fp32 as set stay */
Test(master_split, auto_resolves_by_copy)
{
    struct config c;
    cr_assert(load(&c, put("a.yaml", "model:\n  precision: bf16\n"), 0, NULL), "%s", errbuf);
    cr_expect_eq(c.train.master_weights, MT_MASTER_AUTO, "the default is auto");
    struct { enum mt_precision prec; enum mt_weight_copy copy; bool bf16_compute; enum mt_master_weights set, want; } k[] = {
        {MT_PREC_BF16, MT_COPY_AUTO, true, MT_MASTER_AUTO, MT_MASTER_SPLIT},
        {MT_PREC_BF16, MT_COPY_KEEP, true, MT_MASTER_AUTO, MT_MASTER_SPLIT},
        {MT_PREC_BF16, MT_COPY_CAST, true, MT_MASTER_AUTO, MT_MASTER_FP32},
        {MT_PREC_BF16, MT_COPY_AUTO, false, MT_MASTER_AUTO, MT_MASTER_FP32}, /* the CPU backend */
        {MT_PREC_FP32, MT_COPY_AUTO, true, MT_MASTER_AUTO, MT_MASTER_FP32},
        {MT_PREC_BF16, MT_COPY_AUTO, true, MT_MASTER_FP32, MT_MASTER_FP32},
        {MT_PREC_BF16, MT_COPY_KEEP, true, MT_MASTER_SPLIT, MT_MASTER_SPLIT},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        struct config t = c;
        t.model.precision = k[i].prec;
        t.train.weight_copy = k[i].copy;
        t.train.master_weights = k[i].set;
        config_resolve_master_weights(&t, k[i].bf16_compute);
        cr_expect_eq(t.train.master_weights, k[i].want, "case %zu: resolved %d, expected %d", i,
                     t.train.master_weights, k[i].want);
    }
}

/* plan and the start-up line follow the resolution: a bf16 config on GPUs plans the split master by
 * default, and the CPU backend trains with the fp32 master */
Test(master_split, auto_in_plan_and_train)
{
    char cmd[640], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s/moetrain plan configs/tiny.yaml --world 1 --set model.precision=bf16 2>&1",
             tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "master = the low 16 bits of the shard's fp32 master weights"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s/moetrain plan configs/tiny.yaml --world 1 --set model.precision=bf16 "
             "--set train.weight_copy=cast 2>&1", tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "master = fp32 master weights of the shard"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s/moetrain train configs/tiny.yaml --backend cpu --set model.precision=bf16 "
             "--set train.steps=1 2>&1", tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "(fp32 compute)"), "%s", out);
    free(out);
}
