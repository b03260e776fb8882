/* Whole training runs on token files with the data features on: blended sources, shuffling,
 * document masking, no loss after EOS, validation. The same global batches must reach the model
 * whatever the mesh and across a resume, and validation must leave training untouched. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../test_util.h"
#include "common.h"
#include "data.h"
#include "eos_docs.h"

enum { EOS = 1, VOCAB = 512 };

static char dir[64];

static void setup(void)
{
    strcpy(dir, "/tmp/mt_traindata_XXXXXX");
    cr_assert(mkdtemp(dir));
    char p[160];
    snprintf(p, sizeof p, "%s/web.bin", dir);
    write_eos_docs(p, 1, 6000, EOS);
    snprintf(p, sizeof p, "%s/books", dir);
    cr_assert_eq(mkdir(p, 0700), 0);
    snprintf(p, sizeof p, "%s/books/shard-00000.bin", dir);
    write_eos_docs(p, 2, 2000, EOS);
    snprintf(p, sizeof p, "%s/books/shard-00001.bin", dir);
    write_eos_docs(p, 3, 1500, EOS);
    snprintf(p, sizeof p, "%s/val.bin", dir);
    write_eos_docs(p, 4, 1000, EOS);
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(train_data, .init = setup, .fini = teardown);

static int run(int np, const char *extra, char **out)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "timeout 300 %s -np %d %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.steps=4 --set train.seq_len=32 --set train.global_batch_size=8 "
             "--set log.interval=1 --set data.kind=tokens --set data.sources=%s/web.bin:2,%s/books:1 "
             "--set data.shuffle=true --set data.seed=9 --set data.eos_id=%d "
             "--set data.document_masking=true --set data.loss_after_eos=false "
             "--set data.validation_path=%s/val.bin --set data.validation_interval=2 "
             "--set data.validation_batches=2 %s",
             tu_mpirun(), np, tu_build(), dir, dir, EOS, dir, extra);
    return tu_run(cmd, out);
}

/* field of each step 1..4 by the "step" field; NAN where missing or null */
static void by_step(const char *path, const char *field, double v[5])
{
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s missing", path);
    char line[1 << 16], key[64];
    snprintf(key, sizeof key, "\"%s\": ", field);
    for (int s = 0; s < 5; s++) v[s] = NAN;
    while (fgets(line, sizeof line, f)) {
        int step = atoi(strstr(line, "\"step\": ") + 8);
        const char *k = strstr(line, key);
        if (k && step >= 1 && step <= 4)   /* JSON null (not computed) reads as NaN */
            v[step] = strncmp(k + strlen(key), "null", 4) ? strtod(k + strlen(key), NULL) : NAN;
    }
    fclose(f);
}

Test(train_data, blended_shuffled_masked_run_is_mesh_invariant_and_resumes, .timeout = 600)
{
    char extra[1024], *out = NULL, pa[128], pb[128], pc[128];
    snprintf(pa, sizeof pa, "%s/a.jsonl", dir);
    snprintf(pb, sizeof pb, "%s/b.jsonl", dir);
    snprintf(pc, sizeof pc, "%s/c.jsonl", dir);
    snprintf(extra, sizeof extra, "--set train.micro_batch_size=4 --set log.metrics=%s "
             "--set checkpoint.dir=%s/ck --set checkpoint.interval=2 --set checkpoint.keep=0", pa, dir);
    int rc = run(1, extra, &out);
    cr_assert_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "blend of 2 token datasets") && strstr(out, "shuffled (data.seed 9)") &&
              strstr(out, "document masking after eos 1") && strstr(out, "| val "), "%s", out);
    free(out);
    /* two data-parallel ranks, two sequences each per micro-step */
    snprintf(extra, sizeof extra, "--set train.micro_batch_size=2 --set log.metrics=%s", pb);
    rc = run(2, extra, &out);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    /* resume from step 2 on one rank */
    snprintf(extra, sizeof extra, "--set train.micro_batch_size=4 --set log.metrics=%s "
             "--resume %s/ck/step_00000002", pc, dir);
    rc = run(1, extra, &out);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);

    double la[5], lb[5], lc[5], va[5], vb[5], vc[5];
    by_step(pa, "loss", la), by_step(pb, "loss", lb), by_step(pc, "loss", lc);
    by_step(pa, "val_loss", va), by_step(pb, "val_loss", vb), by_step(pc, "val_loss", vc);
    for (int s = 1; s <= 4; s++) {
        cr_expect(fabs(la[s] - lb[s]) <= 1e-5 * fabs(la[s]), "step %d loss: 1 rank %.8g, 2 ranks %.8g",
                  s, la[s], lb[s]);
        const bool due = s % 2 == 0;
        cr_expect(due ? isfinite(va[s]) && va[s] > 0 : isnan(va[s]), "step %d val_loss %g", s, va[s]);
        if (due)
            cr_expect(fabs(va[s] - vb[s]) <= 1e-5 * va[s], "step %d val_loss: 1 rank %.8g, 2 ranks %.8g",
                      s, va[s], vb[s]);
    }
    for (int s = 3; s <= 4; s++)
        cr_expect(la[s] == lc[s], "step %d loss: uninterrupted %.10g, resumed %.10g", s, la[s], lc[s]);
    cr_expect(va[4] == vc[4], "val_loss at 4: uninterrupted %.10g, resumed %.10g", va[4], vc[4]);
    cr_expect(isnan(lc[1]) && isnan(lc[2]), "the resumed run logged steps before 3");
}

/* A validation pass is forward only: with aux-free balancing (whose bias follows the routed counts)
 * the training losses are the same with and without it. */
Test(train_data, validation_leaves_training_untouched, .timeout = 300)
{
    char extra[1024], *out = NULL, pa[128], pb[128];
    snprintf(pa, sizeof pa, "%s/v1.jsonl", dir);
    snprintf(pb, sizeof pb, "%s/v2.jsonl", dir);
    const char *bal = "--set train.load_balance=bias --set train.bias_update_rate=0.05 "
                      "--set train.micro_batch_size=4";
    snprintf(extra, sizeof extra, "%s --set data.validation_interval=1 --set log.metrics=%s", bal, pa);
    cr_assert_eq(run(1, extra, &out), 0, "%s", out);
    free(out);
    snprintf(extra, sizeof extra, "%s --set data.validation_path= --set log.metrics=%s", bal, pb);
    cr_assert_eq(run(1, extra, &out), 0, "%s", out);
    cr_expect(!strstr(out, "| val "), "%s", out);
    free(out);
    double la[5], lb[5], va[5];
    by_step(pa, "loss", la), by_step(pb, "loss", lb), by_step(pa, "val_loss", va);
    for (int s = 1; s <= 4; s++) {
        cr_expect(la[s] == lb[s], "step %d loss: %.10g with validation, %.10g without", s, la[s], lb[s]);
        cr_expect(isfinite(va[s]), "step %d: no val_loss", s);
    }
}

Test(train_data, bad_data_files_are_one_line_on_every_rank, .timeout = 300)
{
    char extra[512], *out = NULL;
    snprintf(extra, sizeof extra, "--set train.micro_batch_size=2 --set data.validation_path=%s/nope.bin", dir);
    int rc = run(2, extra, &out);
    cr_expect(rc != 0, "%s", out);
    cr_expect(strstr(out, "moetrain: error: data.validation_path: ") && strstr(out, "nope.bin: cannot open"),
              "%s", out);
    free(out);
    snprintf(extra, sizeof extra, "--set train.micro_batch_size=2 --set data.sources=%s/web.bin:1,%s/x*.bin:1",
             dir, dir);
    rc = run(2, extra, &out);
    cr_expect(rc != 0, "%s", out);
    cr_expect(strstr(out, "moetrain: error: data.sources[2]: no file matches"), "%s", out);
    free(out);
}

/* train.aux_loss_scope: global_batch runs a forward pre-pass over the step's loaded micro-batches
 * (with their documents and labels); the run stays mesh-invariant with documents on. */
Test(train_data, global_batch_aux_with_documents_is_mesh_invariant, .timeout = 300)
{
    char extra[1024], *out = NULL, pa[128], pb[128];
    snprintf(pa, sizeof pa, "%s/g1.jsonl", dir);
    snprintf(pb, sizeof pb, "%s/g2.jsonl", dir);
    snprintf(extra, sizeof extra, "--set train.aux_loss_scope=global_batch --set train.micro_batch_size=4 "
             "--set log.metrics=%s", pa);
    cr_assert_eq(run(1, extra, &out), 0, "%s", out);
    free(out);
    snprintf(extra, sizeof extra, "--set train.aux_loss_scope=global_batch --set train.micro_batch_size=2 "
             "--set log.metrics=%s", pb);
    cr_assert_eq(run(2, extra, &out), 0, "%s", out);
    free(out);
    double la[5], lb[5], aa[5], ab[5];
    by_step(pa, "loss", la), by_step(pb, "loss", lb), by_step(pa, "aux_loss", aa), by_step(pb, "aux_loss", ab);
    for (int s = 1; s <= 4; s++) {
        cr_expect(fabs(la[s] - lb[s]) <= 1e-5 * fabs(la[s]), "step %d loss: 1 rank %.8g, 2 ranks %.8g",
                  s, la[s], lb[s]);
        cr_expect(fabs(aa[s] - ab[s]) <= 1e-5 * fabs(aa[s]), "step %d aux: 1 rank %.8g, 2 ranks %.8g",
                  s, aa[s], ab[s]);
    }
}
