/* Checkpoints of pipelined runs (docs/pipeline.md): save and resume bit-exact on the same
 * pipeline, and a PP=2 checkpoint resumed on PP=1 and a PP=1 checkpoint on PP=2 train on to the
 * same losses. Tied embeddings, so the embedding the last stage keeps for its head is saved once
 * and loaded by both end stages. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../test_util.h"

#define COMMON "--set model.tie_word_embeddings=true --set train.steps=10 --set train.global_batch_size=8 " \
               "--set train.micro_batch_size=2 --set train.seq_len=32 --set log.interval=1"

static int run(int np, const char *extra, char **out)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "timeout 300 %s -np %d %s/moetrain train configs/tiny.yaml --backend cpu " COMMON " %s",
             tu_mpirun(), np, tu_build(), extra);
    return tu_run(cmd, out);
}

static void must_run(int np, const char *extra)
{
    char *out = NULL;
    int rc = run(np, extra, &out);
    cr_assert_eq(rc, 0, "train -np %d %s failed:\n%s", np, extra, out);
    free(out);
}

/* losses (or another field) by step from a metrics file; returns the lines read */
static int by_step(const char *path, const char *field, double *v)
{
    double steps[32], vals[32];
    int n = tu_read_metric(path, "step", steps, 32), m = tu_read_metric(path, field, vals, 32);
    cr_assert_eq(n, m);
    for (int j = 0; j < n; j++) v[(int)steps[j]] = vals[j];
    return n;
}

Test(checkpoint_pp, resume_bit_exact_and_across_pipeline_depths, .timeout = 900)
{
    char base[128], extra[1024], cmd[1024];
    snprintf(base, sizeof base, "/tmp/mt_ckpt_pp_%d", (int)getpid());
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s/b", base, base);
    cr_assert_eq(system(cmd), 0);

    /* a: PP=2, checkpoints at 5 and 10 */
    snprintf(extra, sizeof extra, "--set parallel.pipeline_parallel_size=2 --set checkpoint.dir=%s/a "
             "--set checkpoint.interval=5 --set checkpoint.keep=0 --set log.metrics=%s/a.jsonl "
             "--set checkpoint.export_hf=%s/a_hf", base, base, base);
    must_run(2, extra);
    /* b: PP=2 again from a's step 5 */
    snprintf(cmd, sizeof cmd, "cp -r %s/a/step_00000005 %s/b/", base, base);
    cr_assert_eq(system(cmd), 0);
    snprintf(extra, sizeof extra, "--set parallel.pipeline_parallel_size=2 --set checkpoint.dir=%s/b "
             "--set checkpoint.interval=5 --set log.metrics=%s/b.jsonl --set checkpoint.export_hf=%s/b_hf "
             "--resume auto", base, base, base);
    must_run(2, extra);
    const char *fields[] = {"loss", "aux_loss", "grad_norm"};
    char pa[256], pb[256];
    snprintf(pa, sizeof pa, "%s/a.jsonl", base);
    snprintf(pb, sizeof pb, "%s/b.jsonl", base);
    for (int f = 0; f < 3; f++) {
        double va[11], vb[11];
        cr_assert_eq(by_step(pa, fields[f], va), 10);
        cr_assert_eq(by_step(pb, fields[f], vb), 5);
        for (int s = 6; s <= 10; s++)
            cr_expect(va[s] == vb[s], "step %d %s: %.10g uninterrupted, %.10g resumed", s, fields[f], va[s], vb[s]);
    }
    snprintf(cmd, sizeof cmd, "cmp -s %s/a_hf/model.safetensors %s/b_hf/model.safetensors", base, base);
    cr_expect_eq(system(cmd), 0, "the final weights differ after a resume on the same pipeline");

    /* `moetrain export` of the PP=2 checkpoint of step 10 writes what the run exported after it */
    snprintf(cmd, sizeof cmd, "%s/moetrain export %s/a/step_00000010 %s/x_hf > /dev/null && "
             "cmp -s %s/a_hf/model.safetensors %s/x_hf/model.safetensors", tu_build(), base, base, base, base);
    cr_expect_eq(system(cmd), 0, "export of the PP=2 checkpoint differs from the run's own export");

    /* c: a's step 5 on one rank (PP=1); the global micro-batch is 2 sequences in both */
    snprintf(extra, sizeof extra, "--set log.metrics=%s/c.jsonl --resume %s/a/step_00000005", base, base);
    must_run(1, extra);
    double va[11], vc[11];
    cr_assert_eq(by_step(pa, "loss", va), 10);
    snprintf(pb, sizeof pb, "%s/c.jsonl", base);
    cr_assert_eq(by_step(pb, "loss", vc), 5);
    for (int s = 6; s <= 10; s++)
        cr_expect(fabs(va[s] - vc[s]) <= 1e-5 * fabs(va[s]), "step %d loss: %.8g with PP=2, %.8g resumed on PP=1",
                  s, va[s], vc[s]);

    /* d: a PP=1 run's step 5 resumed on PP=2 (e) */
    snprintf(extra, sizeof extra, "--set checkpoint.dir=%s/d --set checkpoint.interval=5 --set log.metrics=%s/d.jsonl",
             base, base);
    must_run(1, extra);
    snprintf(extra, sizeof extra, "--set parallel.pipeline_parallel_size=2 --set log.metrics=%s/e.jsonl "
             "--resume %s/d/step_00000005", base, base);
    must_run(2, extra);
    double vd[11], ve[11];
    snprintf(pa, sizeof pa, "%s/d.jsonl", base);
    snprintf(pb, sizeof pb, "%s/e.jsonl", base);
    cr_assert_eq(by_step(pa, "loss", vd), 10);
    cr_assert_eq(by_step(pb, "loss", ve), 5);
    for (int s = 6; s <= 10; s++)
        cr_expect(fabs(vd[s] - ve[s]) <= 1e-5 * fabs(vd[s]), "step %d loss: %.8g with PP=1, %.8g resumed on PP=2",
                  s, vd[s], ve[s]);
    snprintf(cmd, sizeof cmd, "rm -rf %s", base);
    cr_expect_eq(system(cmd), 0);
}
