/* train_check (src/train_check.h): the refusals `train` and `train --dry-run` share, and the CLI
 * showing the same one line either way. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "../test_util.h"
#include "config.h"
#include "mesh.h"
#include "train_check.h"

static bool check(struct config *c, int world, int *n_micro, char *err, int cap)
{
    struct mesh_dims d;
    cr_assert(mesh_dims_of(c, world, &d, err, cap), "%s", err);
    return train_check(c, &d, n_micro, err, cap);
}

Test(train_check, batch_must_divide_over_the_data_parallel_ranks)
{
    struct config c;
    config_defaults(&c);
    mt_strlcpy(c.path, "x.yaml", sizeof c.path);
    c.train.global_batch_size = 24;
    c.train.micro_batch_size = 2;
    c.parallel.expert_parallel_size = 2;
    char err[512] = "";
    int n_micro = 0;
    cr_assert(check(&c, 4, &n_micro, err, sizeof err), "%s", err);
    cr_assert_eq(n_micro, 3);
    c.train.global_batch_size = 20;
    cr_assert_not(check(&c, 4, &n_micro, err, sizeof err));
    cr_assert_str_eq(err, "x.yaml: train.global_batch_size 20 is not a multiple of train.micro_batch_size 2 "
                          "x 4 data-parallel ranks (ranks per pipeline stage)");
}

/* run `moetrain train ARGS` on np ranks; returns the exit status and the output */
static int train(int np, const char *args, char **out)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "timeout 120 %s -np %d %s/moetrain train configs/tiny.yaml %s", tu_mpirun(), np,
             tu_build(), args);
    return tu_run(cmd, out);
}

/* --dry-run refuses with the very line train refuses with */
static void same_refusal(int np, const char *sets, const char *key)
{
    char args[1024], *dry = NULL, *real = NULL;
    snprintf(args, sizeof args, "--dry-run %s", sets);
    cr_assert_eq(train(np, args, &dry), 1, "dry run of %s accepted:\n%s", sets, dry);
    snprintf(args, sizeof args, "--set train.steps=1 %s", sets);
    cr_assert_eq(train(np, args, &real), 1, "train with %s accepted:\n%s", sets, real);
    const char *line = strstr(dry, "moetrain: error: ");
    cr_assert_not_null(line, "%s", dry);
    cr_assert_not_null(strstr(line, key), "%s", line);
    const char *nl = strchr(line, '\n');
    char want[1024];
    snprintf(want, sizeof want, "%.*s", (int)(nl ? nl - line : (long)strlen(line)), line);
    cr_assert_not_null(strstr(real, want), "train said:\n%s\ndry run said:\n%s", real, want);
    /* one error line, not one per rank */
    cr_assert_null(strstr(line + 1, "moetrain: error: "), "%s", dry);
    free(dry);
    free(real);
}

/* and approves a pipeline, which train runs, with the step-wide aux loss too */
Test(train_check, dry_run_approves_a_pipeline, .timeout = 300)
{
    char *out = NULL;
    int rc = train(2, "--dry-run --set parallel.pipeline_parallel_size=2", &out);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert_not_null(strstr(out, "pp 2"), "%s", out);
    free(out);
    rc = train(2, "--dry-run --set parallel.pipeline_parallel_size=2 --set train.aux_loss_scope=global_batch", &out);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
}

Test(train_check, dry_run_refuses_an_indivisible_batch, .timeout = 300)
{
    same_refusal(2, "--set parallel.expert_parallel_size=2 --set train.global_batch_size=6", "train.global_batch_size");
}

/* a pipeline runs the step-wide aux loss, a routing file and validation
 * (tests/unit/test_pipeline_features.c): none of them is refused */
Test(train_check, pipeline_accepts_step_wide_aux_routing_files_and_validation)
{
    struct config c;
    config_defaults(&c);
    mt_strlcpy(c.path, "x.yaml", sizeof c.path);
    c.parallel.pipeline_parallel_size = 2;
    c.train.aux_loss_scope = MT_AUX_GLOBAL_BATCH;
    mt_strlcpy(c.data.routing_replay, "r.bin", sizeof c.data.routing_replay);
    mt_strlcpy(c.data.validation_path, "v.tokens", sizeof c.data.validation_path);
    char err[512] = "";
    int n_micro = 0;
    cr_assert(check(&c, 2, &n_micro, err, sizeof err), "%s", err);
    cr_assert_eq(n_micro, c.train.global_batch_size / c.train.micro_batch_size);
}

/* configs/qwen3-235b-a22b.yaml: the released model's size, laid out as its comments say */
Test(train_check, qwen3_235b_config_plans_on_128_ranks, .timeout = 120)
{
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s/moetrain plan configs/qwen3-235b-a22b.yaml --world 128 --gpus-per-node 8", tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_assert_not_null(strstr(out, "pp 4 x 32 ranks per stage (ep 8 x ep_fsdp 4)"), "%s", out);
    /* 235 B parameters, 22 B active per token (the model card's figures) */
    const char *p = strstr(out, "parameters: ");
    cr_assert_not_null(p, "%s", out);
    double total = 0, active = 0;
    const char *b = strstr(p, "(");
    cr_assert(b && sscanf(b, "(%lf B", &total) == 1, "%s", p);
    const char *a = strstr(p, "), ");
    cr_assert(a && sscanf(a, "), %lf active", &active) == 1, "%s", p);
    cr_assert(total > 234.5 && total < 235.5, "%.2f B parameters", total);
    cr_assert(active / 1e9 > 21.5 && active / 1e9 < 22.5, "%.3g active", active);
    free(out);
}
