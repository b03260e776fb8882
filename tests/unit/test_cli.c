/* The command line: every misuse is a one-line error and a non-zero exit, never a crash. */
#include <criterion/criterion.h>

#include "../test_util.h"

/* Runs `moetrain ARGS`, expects exit status 1 or 2 and exactly one output line containing `want`. */
static void expect_cli_error(const char *args, const char *want)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s/moetrain %s", tu_build(), args);
    int rc = tu_run(cmd, &out);
    cr_expect(rc == 1 || rc == 2, "'%s' exited %d:\n%s", args, rc, out);
    cr_expect(strstr(out, want) != NULL, "'%s': expected '%s' in:\n%s", args, want, out);
    int lines = 0;
    for (const char *p = out; *p; p++) lines += *p == '\n';
    cr_expect(rc == 2 || lines == 1, "'%s' printed %d lines:\n%s", args, lines, out);
    free(out);
}

Test(cli, no_arguments_prints_usage) { expect_cli_error("", "usage:"); }
Test(cli, unknown_command) { expect_cli_error("trian configs/tiny.yaml", "unknown command 'trian'"); }
Test(cli, unknown_option) { expect_cli_error("train configs/tiny.yaml --dryrun", "unknown option '--dryrun'"); }
Test(cli, option_without_value) { expect_cli_error("train configs/tiny.yaml --set", "option --set needs a value"); }
Test(cli, bad_backend) { expect_cli_error("train configs/tiny.yaml --backend tpu", "--backend expects cpu, cuda or auto"); }
Test(cli, train_needs_a_config) { expect_cli_error("train", "train needs exactly one CONFIG.yaml"); }
Test(cli, plan_needs_world) { expect_cli_error("plan configs/tiny.yaml", "plan needs --world N"); }
Test(cli, plan_bad_world) { expect_cli_error("plan configs/tiny.yaml --world -3", "--world expects a positive integer"); }
Test(cli, verify_needs_two_paths) { expect_cli_error("verify tests/fixtures/qwen3moe-tiny", "verify needs MODEL_DIR and REFERENCE"); }
Test(cli, verify_missing_model_dir)
{
    expect_cli_error("verify /nonexistent/model tests/fixtures/qwen3moe-tiny/reference.safetensors",
                     "/nonexistent/model: no such model directory");
}
Test(cli, verify_bad_tolerance)
{
    expect_cli_error("verify a b --tolerance zero", "--tolerance expects a positive number");
}
Test(cli, missing_config_file) { expect_cli_error("plan /nonexistent.yaml --world 2", "/nonexistent.yaml"); }

/* checkpoint.export_hf to a place nobody can write: one line naming it and a non-zero exit at
 * start-up, before any training. */
Test(cli, export_to_an_unwritable_directory, .timeout = 60)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=1 "
             "--set checkpoint.export_hf=/proc/mt_export", tu_build());
    int rc = tu_run(cmd, &out);
    cr_expect_neq(rc, 0, "%s", out);
    cr_expect(strstr(out, "/proc/mt_export: cannot create the export directory"), "%s", out);
    cr_expect(strstr(out, "step 1/1") == NULL, "trained before checking the export directory:\n%s", out);
    free(out);
}
