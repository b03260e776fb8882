/* Checkpoints across processes: several ranks saving and reslicing onto other meshes
 * (tests/mpi/ckpt_check.c), damaged checkpoints failing on every rank, and whole training runs
 * resumed bit-exactly (build/moetrain under mpirun). The single-process tests: test_checkpoint.c. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../test_util.h"

/* --- several ranks (tests/mpi/ckpt_check.c) ------------------------------------------------ */

static int ckpt_check(int np, const char *args, char **out)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "timeout 120 %s -np %d %s/tests/mpi/ckpt_check %s", tu_mpirun(), np, tu_build(), args);
    return tu_run(cmd, out);
}

static void expect_ok(int np, const char *args)
{
    char *out = NULL;
    int rc = ckpt_check(np, args, &out);
    cr_expect_eq(rc, 0, "ckpt_check -np %d %s exited %d:\n%s", np, args, rc, out);
    free(out);
}

static void fresh_dir(char *dir, size_t cap, const char *tag)
{
    snprintf(dir, cap, "/tmp/mt_ckpt_mpi_%s_%d", tag, (int)getpid());
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

static void remove_dir(const char *dir)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_expect_eq(system(cmd), 0);
}

/* args: save|load DIR EP OUTSIDE */
Test(checkpoint_mpi, resliced_from_4_ranks_onto_other_meshes, .timeout = 300)
{
    char dir[128], args[256];
    fresh_dir(dir, sizeof dir, "from4");
    snprintf(args, sizeof args, "save %s 2 0", dir);
    expect_ok(4, args);                          /* ep 2 x ep_fsdp 2 */
    const struct { int np, ep, outside; } to[] = {
        {4, 2, 0},   /* the same mesh: every rank reads its own file */
        {2, 2, 0},   /* ep 2, no expert FSDP */
        {1, 1, 0},   /* one rank */
        {8, 4, 0},   /* ep 4 x ep_fsdp 2 */
        {3, 1, 0},   /* ep_fsdp 3: padded rows, uneven dense chunks */
        {4, 2, 1},   /* ep_outside */
    };
    for (size_t j = 0; j < sizeof to / sizeof to[0]; j++) {
        snprintf(args, sizeof args, "load %s/step_00000004 %d %d", dir, to[j].ep, to[j].outside);
        expect_ok(to[j].np, args);
    }
    remove_dir(dir);
}

Test(checkpoint_mpi, resliced_from_a_padded_mesh, .timeout = 300)
{
    char dir[128], args[256];
    fresh_dir(dir, sizeof dir, "from3");
    snprintf(args, sizeof args, "save %s 1 0", dir);
    expect_ok(3, args);                          /* ep_fsdp 3: the saved pieces have uneven rows */
    const int to[][2] = {{4, 2}, {1, 1}, {2, 1}};
    for (size_t j = 0; j < sizeof to / sizeof to[0]; j++) {
        snprintf(args, sizeof args, "load %s/step_00000004 %d 0", dir, to[j][1]);
        expect_ok(to[j][0], args);
    }
    remove_dir(dir);
}

/* Pipeline stages (args: ... PP): each stage writes only its own tensors (the tied embedding once,
 * by the first stage; a second copy would make the loader report overlapping pieces, a missing
 * one missing elements), and any mesh reads them back bit for bit; the global tensors are
 * assembled as a pipelined export does (export_gather_global). */
Test(checkpoint_mpi, pipeline_stages_save_their_own_tensors_and_reslice, .timeout = 400)
{
    char dir[128], args[256];
    fresh_dir(dir, sizeof dir, "pp2");
    snprintf(args, sizeof args, "save %s 2 0 2", dir);
    expect_ok(4, args);                          /* pp 2 x ep 2 */
    const struct { int np, ep, outside, pp; } to[] = {
        {4, 2, 0, 2},   /* the same mesh */
        {1, 1, 0, 1},   /* PP=2 -> one rank */
        {2, 1, 0, 1},   /* PP=2 -> PP=1 with two data-parallel ranks */
        {3, 1, 0, 3},   /* one layer per stage */
        {8, 2, 1, 2},   /* pp 2 x ep 2 x ep_fsdp 2, ep_outside */
    };
    for (size_t j = 0; j < sizeof to / sizeof to[0]; j++) {
        snprintf(args, sizeof args, "load %s/step_00000004 %d %d %d", dir, to[j].ep, to[j].outside, to[j].pp);
        expect_ok(to[j].np, args);
    }
    remove_dir(dir);
    /* and back: PP=1 -> PP=2 */
    fresh_dir(dir, sizeof dir, "pp1");
    snprintf(args, sizeof args, "save %s 1 0 1", dir);
    expect_ok(2, args);
    snprintf(args, sizeof args, "load %s/step_00000004 2 0 2", dir);
    expect_ok(4, args);
    remove_dir(dir);
}

/* A bad checkpoint under several ranks: one line from rank 0, non-zero exit, no hang. */
static void expect_mpi_failure(int np, const char *args, const char *want)
{
    char *out = NULL;
    int rc = ckpt_check(np, args, &out);
    cr_expect(rc != 0 && rc != 124, "ckpt_check -np %d %s exited %d (want a clean failure):\n%s", np, args, rc, out);
    const char *hit = strstr(out, want);
    cr_expect(hit != NULL, "no '%s' in:\n%s", want, out);
    if (hit) cr_expect(strstr(hit + 1, want) == NULL, "the message is printed more than once:\n%s", out);
    cr_expect(strstr(out, "moetrain: error: ") != NULL, "not a one-line user error:\n%s", out);
    free(out);
}

Test(checkpoint_mpi, damaged_checkpoints_fail_cleanly_on_every_rank, .timeout = 300)
{
    char dir[128], args[256], cmd[512];
    fresh_dir(dir, sizeof dir, "bad");
    snprintf(args, sizeof args, "save %s 2 0", dir);
    expect_ok(4, args);
    snprintf(args, sizeof args, "fail %s/step_00000004 2 0", dir);

    snprintf(cmd, sizeof cmd, "mv %s/step_00000004/rank_00002.h5 %s/r2", dir, dir);
    cr_assert_eq(system(cmd), 0);
    expect_mpi_failure(2, args, "rank file rank_00002.h5 is missing (the checkpoint was written by 4 ranks)");
    expect_mpi_failure(4, args, "rank file rank_00002.h5 is missing");

    snprintf(cmd, sizeof cmd, "head -c 3000 %s/r2 > %s/step_00000004/rank_00002.h5", dir, dir);
    cr_assert_eq(system(cmd), 0);
    expect_mpi_failure(2, args, "rank_00002.h5: cannot open the rank file (truncated");

    /* a rank file of another checkpoint in its place */
    snprintf(cmd, sizeof cmd, "cp %s/step_00000004/rank_00001.h5 %s/step_00000004/rank_00002.h5", dir, dir);
    cr_assert_eq(system(cmd), 0);
    expect_mpi_failure(4, args, "rank_00002.h5: holds rank 1 of step 4, the manifest expects rank 2");

    snprintf(cmd, sizeof cmd, "rm %s/step_00000004/COMPLETE", dir);
    cr_assert_eq(system(cmd), 0);
    expect_mpi_failure(2, args, "is incomplete (no COMPLETE marker)");
    remove_dir(dir);
}

/* --- whole runs (need train.c to save and resume) ------------------------------------------ */

static int train_run(int np, const char *extra, char **out)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "timeout 300 %s -np %d %s/moetrain train configs/tiny.yaml --set train.steps=10 "
             "--set train.global_batch_size=8 --set train.micro_batch_size=2 --set train.seq_len=32 "
             "--set log.interval=1 %s", tu_mpirun(), np, tu_build(), extra);
    return tu_run(cmd, out);
}

/* metric `field` of step s (1-based) from a JSONL file, by its "step" field */
static int read_by_step(const char *path, const char *field, double *by_step, int max_step)
{
    double steps[64], vals[64];
    int n = tu_read_metric(path, "step", steps, 64), m = tu_read_metric(path, field, vals, 64);
    if (n != m) return -1;
    for (int j = 0; j < n; j++)
        if (steps[j] >= 1 && steps[j] <= max_step) by_step[(int)steps[j]] = vals[j];
    return n;
}

static bool same_file(const char *a, const char *b)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "cmp -s %s %s", a, b);
    return system(cmd) == 0;
}

/* Train 10 steps with checkpoints at 5 and 10; then resume from the step-5 checkpoint (through
 * --resume auto in a root that holds only it) and train 6..10 again: the same mesh must give
 * bit-identical metrics and final weights. Then resume on another mesh (one rank): the same to
 * float rounding. `common`: options of every run (e.g. the balancing mode). */
static void check_resume(const char *tag, const char *common)
{
    char base[128], extra[1536], *out = NULL;
    fresh_dir(base, sizeof base, tag);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "mkdir -p %s/b", base);
    cr_assert_eq(system(cmd), 0);

    snprintf(extra, sizeof extra, "%s --set parallel.expert_parallel_size=2 --set checkpoint.dir=%s/a "
             "--set checkpoint.interval=5 --set checkpoint.keep=0 --set log.metrics=%s/a.jsonl "
             "--set checkpoint.export_hf=%s/a_hf", common, base, base, base);
    int rc = train_run(2, extra, &out);
    cr_assert_eq(rc, 0, "uninterrupted run failed:\n%s", out);
    free(out);
    char p[512];
    snprintf(p, sizeof p, "%s/a/step_00000005/COMPLETE", base);
    cr_assert_eq(access(p, F_OK), 0, "no checkpoint at step 5");
    snprintf(p, sizeof p, "%s/a/step_00000010/COMPLETE", base);
    cr_assert_eq(access(p, F_OK), 0, "no checkpoint at step 10");

    /* --resume auto in a root holding only the step-5 checkpoint */
    snprintf(cmd, sizeof cmd, "cp -r %s/a/step_00000005 %s/b/", base, base);
    cr_assert_eq(system(cmd), 0);
    snprintf(extra, sizeof extra, "%s --set parallel.expert_parallel_size=2 --set checkpoint.dir=%s/b "
             "--set checkpoint.interval=5 --set log.metrics=%s/b.jsonl --set checkpoint.export_hf=%s/b_hf "
             "--resume auto", common, base, base, base);
    rc = train_run(2, extra, &out);
    cr_assert_eq(rc, 0, "resumed run failed:\n%s", out);
    free(out);

    const char *fields[] = {"loss", "ce_loss", "aux_loss", "grad_norm", "lr"};
    char pa[256], pb[256];
    snprintf(pa, sizeof pa, "%s/a.jsonl", base);
    snprintf(pb, sizeof pb, "%s/b.jsonl", base);
    for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++) {
        double va[11], vb[11];
        for (int s = 0; s <= 10; s++) va[s] = vb[s] = NAN;
        cr_assert_eq(read_by_step(pa, fields[f], va, 10), 10);
        cr_assert_eq(read_by_step(pb, fields[f], vb, 10), 5, "the resumed run should log steps 6..10 only");
        for (int s = 6; s <= 10; s++)
            cr_expect(va[s] == vb[s], "%s step %d %s: %.10g uninterrupted, %.10g resumed", tag, s, fields[f],
                      va[s], vb[s]);
    }
    snprintf(pa, sizeof pa, "%s/a_hf/model.safetensors", base);
    snprintf(pb, sizeof pb, "%s/b_hf/model.safetensors", base);
    cr_expect(same_file(pa, pb), "%s: the final weights differ after a resume on the same mesh", tag);
    snprintf(p, sizeof p, "%s/b/step_00000010/COMPLETE", base);
    cr_expect_eq(access(p, F_OK), 0, "the resumed run did not save step 10");

    /* one rank from the same checkpoint. The global micro-batch stays 4 sequences (2 ranks x 2
     * before), so the pooled balancing statistics are those of the 2-rank run. */
    snprintf(extra, sizeof extra, "%s --set train.micro_batch_size=4 --set checkpoint.dir=%s/c "
             "--set log.metrics=%s/c.jsonl --resume %s/a/step_00000005", common, base, base, base);
    rc = train_run(1, extra, &out);
    cr_assert_eq(rc, 0, "resume on one rank failed:\n%s", out);
    free(out);
    snprintf(pa, sizeof pa, "%s/a.jsonl", base);
    snprintf(pb, sizeof pb, "%s/c.jsonl", base);
    double va[11], vc[11];
    for (int s = 0; s <= 10; s++) va[s] = vc[s] = NAN;
    cr_assert_eq(read_by_step(pa, "loss", va, 10), 10);
    cr_assert_eq(read_by_step(pb, "loss", vc, 10), 5);
    for (int s = 6; s <= 10; s++)
        cr_expect(fabs(va[s] - vc[s]) <= 1e-5 * fabs(va[s]), "%s step %d loss: %.8g on 2 ranks, %.8g resumed on 1",
                  tag, s, va[s], vc[s]);
    remove_dir(base);
}

Test(checkpoint_run, resume_is_bit_exact_on_the_same_mesh, .timeout = 600)
{
    check_resume("run_aux", "");
}

/* the aux-free balancing bias is part of the state: without it the resumed steps would differ */
Test(checkpoint_run, resume_restores_the_balancing_bias, .timeout = 600)
{
    check_resume("run_bias", "--set train.load_balance=bias --set train.bias_update_rate=0.05");
}

Test(checkpoint_run, resume_errors_are_one_line, .timeout = 300)
{
    char base[128], extra[512], *out = NULL;
    fresh_dir(base, sizeof base, "resume_err");
    snprintf(extra, sizeof extra, "--resume %s/nothing_here", base);
    int rc = train_run(1, extra, &out);
    cr_expect(rc != 0, "resuming from a missing directory succeeded:\n%s", out);
    cr_expect(strstr(out, "moetrain: error: checkpoint ") != NULL, "%s", out);
    free(out);
    /* auto with no checkpoint.dir */
    rc = train_run(1, "--resume auto", &out);
    cr_expect(rc != 0 && strstr(out, "--resume auto needs checkpoint.dir") != NULL, "%s", out);
    free(out);
}
