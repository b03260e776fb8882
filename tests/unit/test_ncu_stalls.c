/* tools/ncu_stalls.py (Nsight Compute's per-instruction stall samples, summarised) on exports made
 * here with a known answer: two kernels of random instructions, each with random samples split
 * over three stall reasons (and the not-issued twins it must ignore) and executed counts in runs
 * of random lengths; the report's totals, reason shares, largest instructions and runs against
 * the same quantities computed here. And the two inputs it refuses, each with a one-line error. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../test_util.h"

enum { KERNELS = 2, N = 180, REASONS = 3, THRESHOLD = 400 };
static const char *const reason[REASONS] = {"barrier", "long_sb", "wait"};

struct kernel {
    int samples[N], by[N][REASONS], executed[N];
    int total, reason_total[REASONS];
};

static void make_kernel(struct kernel *k)
{
    memset(k, 0, sizeof *k);
    int run_left = 0, ex = 0;
    for (int i = 0; i < N; i++) {
        if (run_left == 0) run_left = 1 + rand() % 12, ex = 1 + rand() % 5000; /* a new run */
        run_left--;
        k->executed[i] = ex;
        for (int r = 0; r < REASONS; r++) {
            k->by[i][r] = rand() % 4 == 0 ? 0 : rand() % 120;
            k->samples[i] += k->by[i][r];
            k->reason_total[r] += k->by[i][r];
        }
        k->total += k->samples[i];
    }
}

static void write_kernel(FILE *f, const struct kernel *k, int which)
{
    fprintf(f, "\"Kernel Name\",\"void kernel_%d<(int)128>(params)\",\n", which);
    fprintf(f, "\"Address\",\"Source\",\"Warp Stall Sampling (All Samples)\",\"Warp Stall Sampling "
               "(Not-issued Samples)\",\"# Samples\",\"Instructions Executed\"");
    for (int r = 0; r < REASONS; r++) fprintf(f, ",\"stall_%s\"", reason[r]);
    for (int r = 0; r < REASONS; r++) fprintf(f, ",\"stall_%s (Not Issued)\"", reason[r]);
    fprintf(f, "\n");
    for (int i = 0; i < N; i++) {
        fprintf(f, "\"0x%x\",\"      HGMMA.64x128x16.F32.BF16 R%d, gdesc[UR4], RZ\",\"%d\",\"0\",\"%d\",\"%d\"",
                0x1000 + 16 * i, i, k->samples[i], k->samples[i], k->executed[i]);
        for (int r = 0; r < REASONS; r++) fprintf(f, ",\"%d\"", k->by[i][r]);
        for (int r = 0; r < REASONS; r++) fprintf(f, ",\"%d\"", 7777); /* must not count */
        fprintf(f, "\n");
    }
}

/* the section of out for kernel `which` (a pointer into out) */
static const char *section(const char *out, int which)
{
    char tag[64];
    snprintf(tag, sizeof tag, "kernel: void kernel_%d<", which);
    const char *s = strstr(out, tag);
    cr_assert(s, "no section for kernel %d in:\n%s", which, out);
    return s;
}

Test(ncu_stalls, totals_reasons_top_instructions_and_runs_against_the_export)
{
    srand(20261130);
    struct kernel ks[KERNELS];
    char path[] = "/tmp/mt_ncu_stalls_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    FILE *f = fdopen(fd, "w");
    for (int w = 0; w < KERNELS; w++) {
        make_kernel(&ks[w]);
        write_kernel(f, &ks[w], w);
    }
    fclose(f);

    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "python3 tools/ncu_stalls.py %s --top 5 --regions %d", path, THRESHOLD);
    cr_assert_eq(tu_run(cmd, &out), 0, "ncu_stalls failed:\n%s", out);
    for (int w = 0; w < KERNELS; w++) {
        const struct kernel *k = &ks[w];
        const char *s = section(out, w);
        const char *end = w + 1 < KERNELS ? section(out, w + 1) : s + strlen(s);
        int total = -1;
        cr_assert_eq(sscanf(strstr(s, "samples: "), "samples: %d", &total), 1);
        cr_assert_eq(total, k->total, "kernel %d: %d samples reported, %d in the export", w, total, k->total);
        for (int r = 0; r < REASONS; r++) { /* "<reason> <share>%" on the reasons line */
            char key[32];
            snprintf(key, sizeof key, " %s ", reason[r]);
            const char *at = strstr(strstr(s, "reasons:"), key);
            cr_assert(at && at < end, "kernel %d: no share for %s", w, reason[r]);
            double pct = -1;
            cr_assert_eq(sscanf(at + strlen(key), "%lf%%", &pct), 1);
            const double want = 100.0 * k->reason_total[r] / k->total;
            cr_assert(pct > want - 0.051 && pct < want + 0.051, "kernel %d %s: %.1f%% against %.3f%%", w,
                      reason[r], pct, want);
        }
        /* the largest instruction: most samples, the lowest index among equals */
        int best = 0;
        for (int i = 1; i < N; i++)
            if (k->samples[i] > k->samples[best]) best = i;
        int idx = -1, n = -1, ex = -1;
        const char *top = strchr(strstr(s, "top 5 instructions"), '\n') + 1;
        cr_assert_eq(sscanf(top, "%d %d %d", &idx, &n, &ex), 3, "kernel %d: no top line in:\n%s", w, s);
        cr_assert(idx == best && n == k->samples[best] && ex == k->executed[best],
                  "kernel %d: top %d (%d samples, %d executed) against %d (%d, %d)", w, idx, n, ex, best,
                  k->samples[best], k->executed[best]);
        /* every run of equal executed counts at or over the threshold, in order, and no other */
        const char *runs = strchr(strstr(s, "runs of instructions"), '\n') + 1;
        int listed = 0;
        for (int a = 0; a < N;) {
            int b = a;
            while (b + 1 < N && k->executed[b + 1] == k->executed[a]) b++;
            int sum = 0;
            for (int i = a; i <= b; i++) sum += k->samples[i];
            if (sum >= THRESHOLD) {
                int ra = -1, rb = -1, rs = -1, rex = -1;
                cr_assert_eq(sscanf(runs, " %d-%d %d %d", &ra, &rb, &rs, &rex), 4, "kernel %d: run %d-%d missing", w, a, b);
                cr_assert(ra == a && rb == b && rs == sum && rex == k->executed[a],
                          "kernel %d: run %d-%d %d %d reported, %d-%d %d %d expected", w, ra, rb, rs, rex, a, b, sum,
                          k->executed[a]);
                runs = strchr(runs, '\n') + 1;
                listed++;
            }
            a = b + 1;
        }
        cr_assert(listed > 0, "kernel %d: the threshold left no run to check", w);
        cr_assert(runs >= end || strncmp(runs, "  ", 2) != 0, "kernel %d: more runs than expected:\n%s", w, runs);
    }
    free(out);
    unlink(path);
}

Test(ncu_stalls, refuses_what_is_not_a_source_page_export_in_one_line)
{
    char path[] = "/tmp/mt_ncu_stalls_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "\"ID\",\"Kernel\",\"Duration\"\n\"0\",\"k\",\"12\"\n"); /* a details export */
    fclose(f);
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "python3 tools/ncu_stalls.py %s", path);
    cr_assert_neq(tu_run(cmd, &out), 0);
    cr_assert(strstr(out, path) && strstr(out, "no 'Kernel Name' line") && strchr(out, '\n') == out + strlen(out) - 1,
              "want one line naming the file: %s", out);
    free(out);

    f = fopen(path, "w");
    fprintf(f, "\"Kernel Name\",\"k\"\n\"Address\",\"Source\"\n\"0x0\",\"NOP\"\n"); /* no sample columns */
    fclose(f);
    snprintf(cmd, sizeof cmd, "python3 tools/ncu_stalls.py %s", path);
    cr_assert_neq(tu_run(cmd, &out), 0);
    cr_assert(strstr(out, path) && strstr(out, "Warp Stall Sampling (All Samples)") &&
                  strchr(out, '\n') == out + strlen(out) - 1,
              "want one line naming the file and the missing column: %s", out);
    free(out);
    unlink(path);
}
