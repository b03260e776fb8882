/* scripts/ncu-kernels.sh: the table it makes of Nsight Compute's text reports (real reports from an
 * H200 in tests/fixtures/ncu/), the names it takes from the program's `launch:` lines, and its
 * one-line errors when ncu or the tools are missing or ncu fails. No GPU: a stand-in ncu prints the
 * fixtures. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../test_util.h"

/* the rows' values are the report's own, converted by hand: Duration 589.63 us -> 0.590 ms,
 * 1.22 ms -> 1.220; SM Frequency, Compute (SM), DRAM and L2 Throughput rounded as printed; SMs
 * active: SM Active Cycles / Elapsed Cycles, 767,956.42 / 787,798 -> 97.5 and 1,636,071.68 /
 * 1,659,359 -> 98.6 */
Test(ncu_script, table_of_a_real_report)
{
    char *out = NULL;
    const int rc = tu_run("bash scripts/ncu-kernels.sh --table tests/fixtures/ncu/attention.txt", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "| 1 | tc_fwd_tma_kernel<128, 128, 3, 1> |  | 64,32,1 | 0.590 | 1.32 | 67.2 | 97.5 | 4.8 | 33.2 |"),
              "%s", out);
    cr_expect(strstr(out, "| 3 | tc_bwd_dkdv_tma_kernel<128, 4, 1> |  | 8,32,1 | 1.220 | 1.36 | 62.4 | 98.6 | 43.2 | 59.1 |"),
              "%s", out);
    cr_expect(strstr(out, "| 4 | tc_bwd_dq_ds_kernel<128, 4, 2> |"), "%s", out);
    cr_expect(!strstr(out, "| 5 |"), "four kernel records, more rows:\n%s", out);
    free(out);
}

/* launch lines name the records in order; one line fewer than records is said, not hidden */
Test(ncu_script, launch_lines_name_the_rows)
{
    char *out = NULL;
    int rc = tu_run("bash scripts/ncu-kernels.sh --table tests/fixtures/ncu/grouped.txt", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "| 1 | grouped_gemm_kernel<0, 0> | balanced fwd gate_up | 132,1,1 | 0.656 | 1.34 | 87.0 |"),
              "%s", out);
    cr_expect(strstr(out, "| 3 | grouped_gemm_kernel<2, 0> | balanced wgrad down (8 sets) | 132,1,1 | 2.620 |"), "%s",
              out);
    cr_expect(!strstr(out, "unreliable"), "%s", out);
    free(out);
    char path[] = "/tmp/mt_ncu_fewer_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "grep -v '^launch: balanced dgrad' tests/fixtures/ncu/grouped.txt > %s", path);
    cr_assert_eq(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "bash scripts/ncu-kernels.sh --table %s", path);
    rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, ": 3 kernel records but 2 launch lines"), "%s", out);
    free(out);
    unlink(path);
}

Test(ncu_script, bad_input_is_one_line_and_nonzero)
{
    static const struct {
        const char *cmd;
        int rc;
        const char *says;
    } cases[] = {
        {"bash scripts/ncu-kernels.sh --table /nonexistent/report.txt", 2,
         "--table needs a readable ncu text report, got '/nonexistent/report.txt'"},
        {"bash scripts/ncu-kernels.sh --table tests/fixtures/README.md", 1,
         "tests/fixtures/README.md: no kernel records in the report"},
        {"NCU=/nonexistent/ncu bash scripts/ncu-kernels.sh build", 1, "no Nsight Compute at '/nonexistent/ncu'"},
        {"NCU=/bin/true bash scripts/ncu-kernels.sh /nonexistent/build", 1,
         "/nonexistent/build/tools/bench_grouped_gemm is missing"},
        {"NCU=/bin/true NCU_CLOCK=boost bash scripts/ncu-kernels.sh tests", 2,
         "NCU_CLOCK must be base or none, got 'boost'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *out = NULL;
        const int rc = tu_run(cases[i].cmd, &out);
        cr_expect_eq(rc, cases[i].rc, "%s: exit %d:\n%s", cases[i].cmd, rc, out);
        cr_expect(strstr(out, cases[i].says), "%s:\n%s", cases[i].cmd, out);
        cr_expect(!strchr(out, '\n') || strchr(out, '\n') == out + strlen(out) - 1, "%s: more than one line:\n%s",
                  cases[i].cmd, out);
        free(out);
    }
}

/* the whole run with a stand-in ncu: each tool's profile mode under it, both tables; an ncu that
 * fails stops the script with its report's last lines */
Test(ncu_script, run_with_a_stand_in_ncu)
{
    char dir[] = "/tmp/mt_ncu_run_XXXXXX";
    cr_assert(mkdtemp(dir));
    char path[600], text[1024], cmd[1400], *out = NULL;
    snprintf(cmd, sizeof cmd, "mkdir -p %s/build/tools && cp tests/fixtures/ncu/*.txt %s/", dir, dir);
    cr_assert_eq(system(cmd), 0);
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/build/tools/%s", dir, i ? "bench_attention" : "bench_grouped_gemm");
        cr_assert_eq(tu_write_exec(path, "#!/bin/bash\nexit 0\n"), 0, "cannot write %s", path);
    }
    /* prints the fixture of the tool it was given, after checking the tool's profile argument */
    snprintf(path, sizeof path, "%s/ncu", dir);
    snprintf(text, sizeof text,
             "#!/bin/bash\n"
             "[ -n \"$STANDIN_FAIL\" ] && { echo '==ERROR== the profiler failed'; exit 3; }\n"
             "echo \"$*\" >> %s/args\n"
             "tool=${@: -2:1}; [ \"${@: -1}\" = 0 ] || { echo \"not the profile mode: $*\"; exit 4; }\n"
             "case $tool in *grouped*) cat %s/grouped.txt;; *attention*) cat %s/attention.txt;; esac\n",
             dir, dir, dir);
    cr_assert_eq(tu_write_exec(path, text), 0, "cannot write %s", path);
    snprintf(cmd, sizeof cmd, "NCU=%s/ncu NCU_OUT=%s/out bash scripts/ncu-kernels.sh %s/build", dir, dir, dir);
    int rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "| balanced wgrad down (8 sets) |"), "%s", out);
    cr_expect(strstr(out, "| tc_bwd_dkdv_tma_kernel<128, 4, 1> |"), "%s", out);
    free(out);
    /* NCU_SECTIONS reaches ncu, and SpeedOfLight (which the table reads) is added when left out */
    snprintf(cmd, sizeof cmd, "rm -f %s/args && NCU_SECTIONS='WarpStateStats SourceCounters' NCU=%s/ncu NCU_OUT=%s/out "
             "bash scripts/ncu-kernels.sh %s/build && cat %s/args", dir, dir, dir, dir, dir);
    rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "-k regex:grouped_gemm_kernel --section WarpStateStats --section SourceCounters "
                          "--section SpeedOfLight --clock-control base "),
              "%s", out);
    cr_expect(strstr(out, "-k regex:tc_ --section WarpStateStats"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "rm -f %s/args && NCU_CLOCK=none NCU=%s/ncu NCU_OUT=%s/out bash scripts/ncu-kernels.sh %s/build "
             "&& cat %s/args", dir, dir, dir, dir, dir);
    rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "--section SpeedOfLight --clock-control none "), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "STANDIN_FAIL=1 NCU=%s/ncu NCU_OUT=%s/out bash scripts/ncu-kernels.sh %s/build", dir, dir,
             dir);
    rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 1, "%s", out);
    cr_expect(strstr(out, "ncu on bench_grouped_gemm failed") && strstr(out, "the profiler failed"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_expect_eq(system(cmd), 0);
}
