/* scripts/bench-soak.sh and tools/bench_soak: each GEMM kind at the power cap, joined with
 * nvidia-smi's clock and power samples. The script runs against a stand-in bench_soak (two phases
 * of known TFLOPS a second apart) and a stand-in nvidia-smi (samples of the current time at a fixed
 * clock and power) in a temporary directory; the real tool is run only where it has no GPU (it
 * must say so and exit 0) and with bad arguments. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../test_util.h"

#define SMS 132
#define FPC 4096
#define MHZ 1440
#define WATTS 693

/* dir/bin/nvidia-smi sampling the current time every 50 ms; dir/build/tools/bench_soak printing
 * `body` (a shell snippet) after its device line */
static void stand_ins(const char *dir, const char *body)
{
    char path[512], text[2048];
    snprintf(path, sizeof path, "mkdir -p %s/bin %s/build/tools", dir, dir);
    cr_assert_eq(system(path), 0);
    snprintf(path, sizeof path, "%s/bin/nvidia-smi", dir);
    snprintf(text, sizeof text,
             "#!/bin/bash\n"
             "for i in $(seq 1 200); do echo \"$(date '+%%Y/%%m/%%d %%H:%%M:%%S.%%3N'), %d.00, %d\"; sleep 0.05; done\n",
             WATTS, MHZ);
    cr_assert_eq(tu_write_exec(path, text), 0, "cannot write %s", path);
    snprintf(path, sizeof path, "%s/build/tools/bench_soak", dir);
    snprintf(text, sizeof text,
             "#!/bin/bash\n"
             "now() { date +%%s.%%N; }\n"
             "phase() { t0=$(now); sleep 0.3; t1=$(now); sleep 0.7; t2=$(now);\n"
             "  echo \"phase $1 $t0 $t1 $t2 400 calls, 1750.0 us a call, $2 TFLOPS\"; }\n"
             "%s\n",
             body);
    cr_assert_eq(tu_write_exec(path, text), 0, "cannot write %s", path);
}

static int run_soak(const char *body, const char *args, char **out)
{
    char dir[] = "/tmp/mt_soak_script_XXXXXX";
    cr_assert(mkdtemp(dir));
    stand_ins(dir, body);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "PATH=%s/bin:$PATH SOAK_OUT=%s/out timeout 60 bash scripts/bench-soak.sh %s/build %s",
             dir, dir, dir, args);
    const int rc = tu_run(cmd, out);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_expect_eq(system(cmd), 0);
    return rc;
}

/* a row a phase: its TFLOPS, the clock and power sampled during its timed half, and the share of
 * the tensor pipe that makes at that clock (TFLOPS over SMs x FLOP a clock x clock) */
Test(soak_script, rows_with_clock_power_and_share, .timeout = 90)
{
    char body[256];
    snprintf(body, sizeof body, "echo 'device Stand-in sms %d flop_per_clock %d'; phase gg_fwd_gu 608; phase lt_lm 702",
             SMS, FPC);
    char *out = NULL;
    const int rc = run_soak(body, "1 gg_fwd_gu lt_lm", &out);
    cr_expect_eq(rc, 0, "bench-soak.sh exited %d:\n%s", rc, out);
    char want[256];
    const double tflops[2] = {608, 702};
    const char *names[2] = {"gg_fwd_gu", "lt_lm"};
    for (int i = 0; i < 2; i++) {
        snprintf(want, sizeof want, "| %s | %.0f | %d | %d | %.1f%% |", names[i], tflops[i], MHZ, WATTS,
                 tflops[i] * 1e12 / ((double)SMS * FPC * MHZ * 1e6) * 100);
        cr_expect(strstr(out, want), "no '%s':\n%s", want, out);
    }
    cr_expect(strstr(out, "device Stand-in sms 132"), "%s", out);
    free(out);
}

/* what bench_soak says without a GPU is passed on, with no table and exit 0; its failure is the
 * script's, with its output */
Test(soak_script, no_gpu_and_failure, .timeout = 60)
{
    char *out = NULL;
    int rc = run_soak("echo 'bench_soak: no GPU here; nothing measured'", "1", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "bench_soak: no GPU here; nothing measured"), "%s", out);
    cr_expect(!strstr(out, "| kind |"), "%s", out);
    free(out);
    rc = run_soak("echo 'moetrain: error: bench_soak: unknown kind'; exit 1", "1 nope", &out);
    cr_expect_eq(rc, 1, "%s", out);
    cr_expect(strstr(out, "bench-soak: bench_soak exited 1"), "%s", out);
    cr_expect(strstr(out, "unknown kind"), "%s", out);
    free(out);
}

/* the real tool: an unknown kind or a bad duration is an error naming it (before any GPU work);
 * where no GPU is visible it says so and exits 0 */
Test(soak_script, the_tool_checks_its_arguments, .timeout = 60)
{
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s/tools/bench_soak 1 gg_fwd_gu nope", tu_build());
    int rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 1, "%s", out);
    cr_expect(strstr(out, "bench_soak: unknown kind 'nope'"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s/tools/bench_soak abc", tu_build());
    rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 1, "%s", out);
    cr_expect(strstr(out, "bench_soak: SECS abc"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "CUDA_VISIBLE_DEVICES= %s/tools/bench_soak 1", tu_build());
    rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "no GPU here") || strstr(out, "built without CUDA"), "%s", out);
    free(out);
    /* the library's kinds at the expert shapes are known names (an unknown one exits 1 above) */
    snprintf(cmd, sizeof cmd,
             "CUDA_VISIBLE_DEVICES= %s/tools/bench_soak 1 lt_gu lt_dn cb_gu cb_dn cb_dgrad_gu gg_wgrad8d_gu "
             "gg_wgrad1c_gu cb_wgrad8_gu",
             tu_build());
    rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "no GPU here") || strstr(out, "built without CUDA"), "%s", out);
    free(out);
}
