/* tools/trace_gaps.py (the step report from tools/kernel_trace.c's timeline) on timelines made here
 * with a known answer: random kernel lengths and gaps on one stream, a second stream's kernel
 * overlapping it, three steps cut at the AdamW kernel; the report's busy and idle time, gap count
 * and per-kernel totals against the same quantities computed here from the timeline. And the
 * preload library (where CUPTI was found at build time): without a GPU driver it says in one line
 * that nothing is traced and the program runs on; a "%r" in its output path becomes the rank. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../test_util.h"

enum { STEPS = 3, PER_STEP = 40 };

#define NORM "_Z22rmsnorm_bwd_vec_kernelI13__nv_bfloat16Li64ELi4ELi1ELb0EEvPT_"
#define GEMM "_ZN12_GLOBAL__N_119grouped_gemm_kernelILi2EEEvN12_GLOBAL__N_19gg_paramsE"
#define ADAM "_Z18adamw_multi_kernelI13__nv_bfloat16EvPK14adamw_segmenti"

struct expect {
    double span_ms, busy_ms, idle_ms;
    int gaps, norm_calls;
    double norm_ms, gemm_ms; /* the rmsnorm kernels' time; the grouped wgrad's, both streams */
};

/* writes the timeline to path and returns what the last step's report must say */
static struct expect write_timeline(const char *path, unsigned seed)
{
    srand(seed);
    FILE *f = fopen(path, "w");
    cr_assert(f, "cannot write %s", path);
    fprintf(f, "kind,start_ns,end_ns,stream,name\n");
    long long t = 1000000;
    struct expect ex = {0};
    for (int s = 0; s < STEPS; s++) {
        const bool last = s == STEPS - 1;
        const long long step_start = t;
        long long busy = 0, norm = 0, gemm = 0;
        int gaps = 0, norm_calls = 0;
        for (int i = 0; i < PER_STEP; i++) {
            const long long len = 1000 + rand() % 400000, gap = i ? rand() % 5000 : 0;
            if (gap) gaps++;
            t += gap;
            const bool is_norm = i % 3 == 0;
            fprintf(f, "K,%lld,%lld,7,%s\n", t, t + len, is_norm ? NORM : GEMM);
            if (is_norm) norm += len, norm_calls++;
            else gemm += len;
            if (i == 10) { /* another stream's kernel from the middle of this one to 2 us past it */
                fprintf(f, "K,%lld,%lld,9,%s\n", t + len / 2, t + len + 2000, GEMM);
                gemm += len - len / 2 + 2000;
                busy += 2000, t += 2000;
            }
            busy += len;
            t += len;
        }
        const long long gap = 3000;
        t += gap, gaps++;
        fprintf(f, "S,%lld,%lld,7,memset 4096 B\n", t, t + 1500);
        t += 1500, busy += 1500;
        fprintf(f, "K,%lld,%lld,7,%s\n", t, t + 700000, ADAM);
        t += 700000, busy += 700000;
        if (last) {
            ex.span_ms = (t - step_start) / 1e6;
            ex.busy_ms = busy / 1e6;
            ex.idle_ms = ex.span_ms - ex.busy_ms;
            ex.gaps = gaps;
            ex.norm_calls = norm_calls;
            ex.norm_ms = norm / 1e6;
            ex.gemm_ms = gemm / 1e6;
        }
        t += 20000 + rand() % 100000; /* the host's turn between steps */
    }
    fclose(f);
    return ex;
}

Test(trace_tool, report_of_the_last_step_matches_the_timeline, .timeout = 60)
{
    char path[] = "/tmp/mt_trace_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    for (unsigned seed = 1; seed <= 3; seed++) {
        const struct expect ex = write_timeline(path, seed);
        char cmd[512], *out = NULL;
        snprintf(cmd, sizeof cmd, "python3 tools/trace_gaps.py %s 2>&1", path);
        cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
        double span, busy, idle;
        int n, gaps;
        const char *line = strstr(out, "last complete step:");
        cr_assert(line, "%s", out);
        cr_assert_eq(sscanf(line, "last complete step: %d kernels/copies/memsets over %lf ms; GPU busy %lf ms, "
                                  "idle %lf ms in %d gaps", &n, &span, &busy, &idle, &gaps), 5, "%s", out);
        cr_expect_eq(n, PER_STEP + 3, "records in the step: %d", n);
        cr_expect_float_eq(span, ex.span_ms, 0.006, "span %.3f against %.3f", span, ex.span_ms);
        cr_expect_float_eq(busy, ex.busy_ms, 0.006, "busy %.3f against %.3f", busy, ex.busy_ms);
        cr_expect_float_eq(idle, ex.idle_ms, 0.011, "idle %.3f against %.3f", idle, ex.idle_ms);
        cr_expect_eq(gaps, ex.gaps, "gaps %d against %d", gaps, ex.gaps);
        /* the per-kernel table names the kernel by its demangled name and first template argument */
        const char *row = strstr(out, "rmsnorm_bwd_vec_kernel<bf16>");
        cr_assert(row, "%s", out);
        while (row > out && row[-1] != '\n') row--;
        double ms, mean;
        int calls;
        cr_assert_eq(sscanf(row, "%lf %d %lf", &ms, &calls, &mean), 3, "%s", row);
        cr_expect_eq(calls, ex.norm_calls);
        cr_expect_float_eq(ms, ex.norm_ms, 0.006, "%.3f against %.3f", ms, ex.norm_ms);
        cr_expect(strstr(out, "grouped_gemm_kernel<2>"), "%s", out);
        /* the same kernels by kind: the grouped wgrad's time over both streams */
        const char *kind = strstr(out, "%  expert wgrad");
        cr_assert(kind, "%s", out);
        while (kind > out && kind[-1] != '\n') kind--;
        double kms;
        cr_assert_eq(sscanf(kind, "%lf", &kms), 1, "%s", kind);
        cr_expect_float_eq(kms, ex.gemm_ms, 0.006, "expert wgrad %.3f against %.3f", kms, ex.gemm_ms);
        free(out);
    }
    unlink(path);
}

Test(trace_tool, a_timeline_without_two_steps_fails_naming_the_file, .timeout = 30)
{
    char path[] = "/tmp/mt_trace_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    const char *text = "kind,start_ns,end_ns,stream,name\nK,100,200,7," NORM "\nK,300,900,7," ADAM "\n";
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "python3 tools/trace_gaps.py %s 2>&1", path);
    cr_expect_neq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, path) && strstr(out, "no complete step"), "%s", out);
    cr_expect_eq(strchr(out, '\n'), strrchr(out, '\n'), "one line: %s", out);
    free(out);
    unlink(path);
}

Test(trace_tool, preload_without_a_gpu_says_so_and_the_program_runs, .timeout = 30)
{
    char lib[512];
    snprintf(lib, sizeof lib, "%s/tools/libmt_trace.so", tu_build());
    if (access(lib, R_OK) != 0) cr_skip_test("%s not built (no CUDA or no CUPTI headers here)", lib);
    if (access("/dev/nvidia0", F_OK) == 0) cr_skip_test("a GPU is here: the no-driver message does not apply");
    char path[] = "/tmp/mt_trace_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    char cmd[1200], *out = NULL;
    snprintf(cmd, sizeof cmd, "MT_TRACE_OUT=%s LD_PRELOAD=%s sh -c 'echo ran' 2>&1", path, lib);
    cr_expect_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "ran"), "%s", out);
    cr_expect(strstr(out, "kernel_trace:") && strstr(out, "nothing is traced"), "%s", out);
    FILE *f = fopen(path, "r");
    cr_assert(f);
    char head[128] = {0};
    cr_expect(fgets(head, sizeof head, f) && !strcmp(head, "kind,start_ns,end_ns,stream,name\n"), "%s", head);
    fclose(f);
    free(out);
    unlink(path);

    /* "%r" in the path: the launcher's rank, so that every rank of a job writes its own file */
    char spec[256], ranked[256];
    snprintf(spec, sizeof spec, "%s_%%r.csv", path);
    snprintf(ranked, sizeof ranked, "%s_5.csv", path);
    snprintf(cmd, sizeof cmd, "OMPI_COMM_WORLD_RANK=5 MT_TRACE_OUT='%s' LD_PRELOAD=%s sh -c true 2>&1", spec, lib);
    cr_expect_eq(tu_run(cmd, &out), 0, "%s", out);
    free(out);
    cr_expect_eq(access(ranked, F_OK), 0, "no %s (from %s)", ranked, spec);
    unlink(ranked);
}
