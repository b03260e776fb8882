/* What runs on a pipeline besides plain training (docs/pipeline.md): the global-batch aux loss
 * (a pipelined forward pre-pass), a routing replay file (each stage loads its layers' recorded
 * experts per micro-batch slot) and validation (a pipelined forward pass). Each on PP=2 (2 ranks)
 * and PP=2 x EP=2 (4 ranks) gives one rank's losses, gradient norms, aux and val_loss to 1e-5. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../test_util.h"
#include "common.h"
#include "data.h"
#include "eos_docs.h"

enum { STEPS = 5, EOS = 1 };

/* the pipelines: global micro-batch of 4 sequences, as one rank's */
static const char *const PP2 = "--set parallel.pipeline_parallel_size=2 --set train.micro_batch_size=4";
static const char *const PP2EP2 = "--set parallel.pipeline_parallel_size=2 --set parallel.expert_parallel_size=2 "
                                  "--set train.micro_batch_size=2 --set train.activation_checkpointing=true";

static void run(const char *tag, int np, const char *extra)
{
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd, "timeout 240 %s -np %d %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.steps=%d --set train.global_batch_size=16 --set train.micro_batch_size=4 "
             "--set log.metrics=/tmp/mt_ppf_%s.jsonl %s",
             tu_mpirun(), np, tu_build(), STEPS, tag, extra);
    cr_assert_eq(tu_run(cmd, &out), 0, "run %s failed:\n%s", tag, out);
    free(out);
}

/* field of steps 1..STEPS by the "step" field; NAN where missing or null */
static void by_step(const char *tag, const char *field, double v[STEPS + 1])
{
    char path[128], line[1 << 16], key[64];
    snprintf(path, sizeof path, "/tmp/mt_ppf_%s.jsonl", tag);
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s missing", path);
    snprintf(key, sizeof key, "\"%s\": ", field);
    for (int s = 0; s <= STEPS; s++) v[s] = NAN;
    while (fgets(line, sizeof line, f)) {
        const char *st = strstr(line, "\"step\": "), *k = strstr(line, key);
        const int step = st ? atoi(st + 8) : 0;
        if (k && step >= 1 && step <= STEPS)
            v[step] = strncmp(k + strlen(key), "null", 4) ? strtod(k + strlen(key), NULL) : NAN;
    }
    fclose(f);
}

/* every step's `field` of run `tag` equals the reference's to rel (both NaN where not computed) */
static void same(const char *ref, const char *tag, const char *field, double rel)
{
    double a[STEPS + 1], b[STEPS + 1];
    by_step(ref, field, a);
    by_step(tag, field, b);
    for (int s = 1; s <= STEPS; s++) {
        if (isnan(a[s])) {
            cr_expect(isnan(b[s]), "%s step %d: %s %.8g where one rank has none", tag, s, field, b[s]);
            continue;
        }
        cr_expect(fabs(a[s] - b[s]) <= rel * fabs(a[s]), "%s step %d: %s %.9g vs one rank's %.9g", tag, s,
                  field, b[s], a[s]);
    }
}

static void same_run(const char *ref, const char *tag, double rel)
{
    same(ref, tag, "loss", rel);
    same(ref, tag, "grad_norm", 1e-5);
    same(ref, tag, "aux_loss", 1e-5);
}

/* The step-wide statistic needs every micro-batch's expert counts before any backward: a large
 * coefficient so its gradient shows in the weights and losses of later steps. */
Test(pipeline_features, global_batch_aux_on_pipelines, .timeout = 600)
{
    const char *aux = "--set train.aux_loss_scope=global_batch --set model.router_aux_loss_coef=0.5";
    char extra[1024];
    run("aux_ref", 1, aux);
    snprintf(extra, sizeof extra, "%s %s", aux, PP2);
    run("aux_pp2", 2, extra);
    snprintf(extra, sizeof extra, "%s %s", aux, PP2EP2);
    run("aux_pp2ep2", 4, extra);
    same_run("aux_ref", "aux_pp2", 1e-5);
    same_run("aux_ref", "aux_pp2ep2", 1e-5);
    /* the step's statistic is not the mean of the 4 micro-batches' (what micro_batch scope prints) */
    run("aux_micro", 1, "--set model.router_aux_loss_coef=0.5");
    double g[STEPS + 1], m[STEPS + 1];
    by_step("aux_ref", "aux_loss", g);
    by_step("aux_micro", "aux_loss", m);
    cr_expect(fabs(g[1] - m[1]) > 1e-4 * g[1], "global and micro-batch aux agree: %.8g", g[1]);
    tu_run("rm -f /tmp/mt_ppf_aux_*", NULL);
}

/* Recorded from another initialisation (seed 99), so the replayed experts are not the ones the
 * trained router would pick: a stage that routed on its own router would show. With activation
 * checkpointing stage 0 forwards micro-batch 1 before micro-batch 0's backward, whose recompute
 * must still route micro-batch 0's sequences. */
Test(pipeline_features, routing_replay_on_pipelines, .timeout = 600)
{
    char cmd[1024], *out = NULL, extra[1024];
    snprintf(cmd, sizeof cmd, "%s/moetrain route configs/tiny.yaml --record /tmp/mt_ppf_rr.bin --backend cpu "
             "--set train.steps=%d --set train.global_batch_size=16 --set train.seed=99", tu_build(), STEPS);
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    free(out);
    const char *rr = "--set data.routing_replay=/tmp/mt_ppf_rr.bin";
    run("rr_plain", 1, "");
    run("rr_ref", 1, rr);
    snprintf(extra, sizeof extra, "%s %s", rr, PP2);
    run("rr_pp2", 2, extra);
    snprintf(extra, sizeof extra, "%s %s", rr, PP2EP2);
    run("rr_pp2ep2", 4, extra);
    same_run("rr_ref", "rr_pp2", 1e-6);
    same_run("rr_ref", "rr_pp2ep2", 1e-5);
    double a[STEPS + 1], b[STEPS + 1];
    by_step("rr_plain", "loss", a);
    by_step("rr_ref", "loss", b);
    cr_expect(fabs(a[1] - b[1]) > 1e-5 * a[1], "the replayed routing changed nothing: loss %.8g", a[1]);
    tu_run("rm -f /tmp/mt_ppf_rr*", NULL);
}

/* Validation every 2 steps over 2 held-out batches, with document masking (each stage masks its
 * slot's documents) and labels that stop at EOS (the labelled count comes from the last stage). */
Test(pipeline_features, validation_on_pipelines, .timeout = 600)
{
    char dir[] = "/tmp/mt_ppf_val_XXXXXX", train[96], val[96], data[1024], extra[2048];
    cr_assert(mkdtemp(dir));
    snprintf(train, sizeof train, "%s/train.bin", dir);
    snprintf(val, sizeof val, "%s/val.bin", dir);
    write_eos_docs(train, 1, 8000, EOS);
    write_eos_docs(val, 2, 3000, EOS);
    snprintf(data, sizeof data, "--set data.kind=tokens --set data.path=%s --set data.eos_id=%d "
             "--set data.document_masking=true --set data.loss_after_eos=false --set data.validation_path=%s "
             "--set data.validation_interval=2 --set data.validation_batches=2", train, EOS, val);
    run("val_ref", 1, data);
    snprintf(extra, sizeof extra, "%s %s", data, PP2);
    run("val_pp2", 2, extra);
    snprintf(extra, sizeof extra, "%s %s", data, PP2EP2);
    run("val_pp2ep2", 4, extra);
    double v[STEPS + 1];
    by_step("val_ref", "val_loss", v);
    for (int s = 1; s <= STEPS; s++)
        cr_expect(s % 2 == 0 ? isfinite(v[s]) && v[s] > 0 : isnan(v[s]), "step %d val_loss %g", s, v[s]);
    const char *tags[] = {"val_pp2", "val_pp2ep2"};
    for (int k = 0; k < 2; k++) {
        same_run("val_ref", tags[k], 1e-5);
        same("val_ref", tags[k], "val_loss", 1e-5);
    }
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' /tmp/mt_ppf_val_ref.* /tmp/mt_ppf_val_pp2*", dir);
    tu_run(cmd, NULL);
}

/* The end of a pipelined run reports each stage's idle share of its 1F1B schedules beside the
 * theory (pp-1)/(m+pp-1): 16 sequences as 4 micro-batches of 4 on PP=2 -> 20.0%. The measured
 * shares are timings, so only their form and bounds are checked (waits within the schedule). */
Test(pipeline_features, the_run_reports_each_stage_idle_share, .timeout = 120)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "timeout 100 %s -np 2 %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.steps=3 --set train.global_batch_size=16 %s", tu_mpirun(), tu_build(), PP2);
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    const char *p = strstr(out, "pipeline: idle share of each stage's 1F1B schedules");
    cr_assert(p, "no idle report:\n%s", out);
    cr_expect(strstr(p, "1F1B bubble in theory 20.0% (pp 2, 4 micro-batches per step)"), "%.300s", p);
    for (int s = 0; s < 2; s++) {
        char key[32];
        snprintf(key, sizeof key, "  stage %d: ", s);
        const char *l = strstr(p, key);
        cr_assert(l, "no line for stage %d:\n%s", s, p);
        double pct = -1, wait = -1, run = -1;
        cr_assert_eq(sscanf(l + strlen(key), "%lf%% idle (%lf s of %lf s)", &pct, &wait, &run), 3, "%.200s", l);
        cr_expect(pct >= 0 && pct <= 100 && wait >= 0 && wait <= run && run > 0, "%.200s", l);
    }
    free(out);
}
