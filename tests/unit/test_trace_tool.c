/* tools/trace_gaps.py (the step report from tools/kernel_trace.c's timeline) on timelines made here
 * with a known answer: random kernel lengths and gaps on one stream, a second stream's kernel
 * overlapping it, three steps cut at the AdamW kernel; the report's busy and idle time, gap count
 * and per-kernel totals against the same quantities computed here from the timeline. And the
 * preload library (where CUPTI was found at build time): without a GPU driver it says in one line
 * that nothing is traced and the program runs on; a "%r" in its output path becomes the rank. With
 * --peer, the idle time split by what another rank's timeline did meanwhile; with --small-ops, the
 * stream time each copy and memset costs. */
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
    int gaps, norm_calls, host_waits, d2h;
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
            /* host waits (Y rows: no GPU time) and a device-to-host copy inside a kernel's span */
            if (i == 5) fprintf(f, "Y,%lld,%lld,0,stream synchronize\n", t, t + 3000);
            if (i == 15) fprintf(f, "Y,%lld,%lld,0,event synchronize\n", t + 10, t + 3010);
            if (i == 25) fprintf(f, "Y,%lld,%lld,7,stream wait event\n", t, t); /* orders the GPU only */
            if (i == 30 && last) fprintf(f, "Y,%lld,%lld,0,context synchronize\n", t, t + 3000);
            if (i == 20) fprintf(f, "C,%lld,%lld,11,memcpy kind 2 64 B\n", t + 10, t + 20);
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
            ex.host_waits = 3;
            ex.d2h = 1;
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
        cr_expect_eq(n, PER_STEP + 4, "records in the step: %d", n);
        cr_expect_float_eq(span, ex.span_ms, 0.006, "span %.3f against %.3f", span, ex.span_ms);
        cr_expect_float_eq(busy, ex.busy_ms, 0.006, "busy %.3f against %.3f", busy, ex.busy_ms);
        cr_expect_float_eq(idle, ex.idle_ms, 0.011, "idle %.3f against %.3f", idle, ex.idle_ms);
        cr_expect_eq(gaps, ex.gaps, "gaps %d against %d", gaps, ex.gaps);
        const char *hw = strstr(out, "host waits in the step:");
        int waits, d2h;
        double wait_ms;
        cr_assert(hw, "%s", out);
        cr_assert_eq(sscanf(hw, "host waits in the step: %d synchronisations", &waits), 1, "%s", hw);
        const char *tail = strstr(hw, "), ");
        cr_assert(tail && sscanf(tail, "), %lf ms; %d device-to-host copies", &wait_ms, &d2h) == 2, "%s", hw);
        cr_expect_eq(waits, ex.host_waits, "%s", hw);
        cr_expect_float_eq(wait_ms, 0.009, 1e-6, "%s", hw);
        cr_expect_eq(d2h, ex.d2h, "%s", hw);
        cr_expect(strstr(hw, "stream synchronize 1, event synchronize 1, context synchronize 1"), "%s", hw);
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

/* --peer: rank A's idle gaps in its last step split by whether rank B's GPU ran meanwhile. Both
 * timelines random (A: kernels and gaps, three steps cut at AdamW; B: one stream of kernels and
 * gaps over the same time, its AdamW 7 us after A's); the split against the overlap computed here
 * interval by interval. */
enum { PEER_KERNELS = 30, MAX_B = 4096 };
static long long llmax(long long a, long long b) { return a > b ? a : b; }
static long long llmin(long long a, long long b) { return a < b ? a : b; }

Test(trace_tool, peer_split_of_the_idle_time_matches_the_two_timelines, .timeout = 60)
{
    char pa[] = "/tmp/mt_trace_a_XXXXXX", pb[] = "/tmp/mt_trace_b_XXXXXX";
    int fd = mkstemp(pa);
    cr_assert(fd >= 0);
    close(fd);
    fd = mkstemp(pb);
    cr_assert(fd >= 0);
    close(fd);
    for (unsigned seed = 11; seed <= 13; seed++) {
        srand(seed);
        FILE *fa = fopen(pa, "w");
        cr_assert(fa);
        fprintf(fa, "kind,start_ns,end_ns,stream,name\n");
        long long t = 1000000, gap0[PEER_KERNELS + 1], gap1[PEER_KERNELS + 1], adam_end[STEPS];
        int n_gaps = 0;
        for (int st = 0; st < STEPS; st++) {
            n_gaps = 0;
            for (int i = 0; i <= PEER_KERNELS; i++) {
                const long long gap = i ? 2000 + rand() % 60000 : 0, len = 1000 + rand() % 90000;
                if (gap) gap0[n_gaps] = t, gap1[n_gaps] = t + gap, n_gaps++;
                t += gap;
                fprintf(fa, "K,%lld,%lld,7,%s\n", t, t + len, i == PEER_KERNELS ? ADAM : NORM);
                t += len;
            }
            adam_end[st] = t;
            t += 50000;
        }
        fclose(fa);
        /* B: kernels and gaps from before A's first record to after its last */
        static long long b0[MAX_B], b1[MAX_B];
        int nb = 0;
        FILE *fb = fopen(pb, "w");
        cr_assert(fb);
        fprintf(fb, "kind,start_ns,end_ns,stream,name\n");
        long long u = 900000;
        int next_adam = 0;
        while (u < t + 100000 && nb < MAX_B - 1) {
            u += rand() % 30000;
            const long long len = 500 + rand() % 40000;
            if (next_adam < STEPS && u + len >= adam_end[next_adam] + 7000 - 3000) {
                /* B's AdamW ends 7 us after A's */
                const long long s0 = llmax(u, adam_end[next_adam] + 7000 - 3000);
                b0[nb] = s0, b1[nb] = adam_end[next_adam] + 7000;
                fprintf(fb, "K,%lld,%lld,3,%s\n", b0[nb], b1[nb], ADAM);
                u = b1[nb++];
                next_adam++;
                continue;
            }
            b0[nb] = u, b1[nb] = u + len;
            fprintf(fb, "K,%lld,%lld,3,%s\n", b0[nb], b1[nb], GEMM);
            u = b1[nb++];
        }
        fclose(fb);
        double idle = 0, waited = 0;
        for (int g = 0; g < n_gaps; g++) {
            idle += (double)(gap1[g] - gap0[g]);
            for (int j = 0; j < nb; j++) {
                const long long o0 = llmax(gap0[g], b0[j]), o1 = llmin(gap1[g], b1[j]);
                if (o1 > o0) waited += (double)(o1 - o0);
            }
        }
        char cmd[512], *out = NULL;
        snprintf(cmd, sizeof cmd, "python3 tools/trace_gaps.py %s --peer %s 2>&1", pa, pb);
        cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
        const char *line = strstr(out, "  against ");
        cr_assert(line, "%s", out);
        line = strstr(line, ": of the ");
        cr_assert(line, "%s", out);
        double r_idle, r_waited, r_both, apart;
        cr_assert_eq(sscanf(line, ": of the %lf ms idle, %lf ms while the peer's GPU ran kernels (waiting for its "
                                  "work), %lf ms while it idled too (both waiting); the two step ends are %lf us apart",
                            &r_idle, &r_waited, &r_both, &apart), 4, "%s", line);
        cr_expect_float_eq(r_idle, idle / 1e6, 0.006, "idle %.3f against %.3f", r_idle, idle / 1e6);
        cr_expect_float_eq(r_waited, waited / 1e6, 0.006, "waited %.3f against %.3f", r_waited, waited / 1e6);
        cr_expect_float_eq(r_both, (idle - waited) / 1e6, 0.011, "both idle %.3f against %.3f", r_both,
                           (idle - waited) / 1e6);
        cr_expect(waited > 0 && waited < idle, "the case splits the idle time: %.0f of %.0f ns", waited, idle);
        cr_expect_float_eq(apart, 7.0, 0.06, "step ends %.2f us apart, expected 7", apart);
        free(out);
    }
    unlink(pa);
    unlink(pb);
}

/* --gaps: the step's longest gaps, longest first, with their place in the step, the records either
 * side (by stream) and the host's waits over them; and the idle time before the step's first record.
 * Random kernels with gaps under 5 us, and three gaps of known length planted at random places. */
Test(trace_tool, longest_gaps_are_listed_with_their_neighbours_and_host_waits, .timeout = 60)
{
    char path[] = "/tmp/mt_trace_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    for (unsigned seed = 21; seed <= 23; seed++) {
        srand(seed);
        FILE *f = fopen(path, "w");
        cr_assert(f);
        fprintf(f, "kind,start_ns,end_ns,stream,name\n");
        long long t = 1000000, step_start = 0, prev_end = 0, at[3] = {0};
        const long long planted[3] = {900000 + rand() % 50000, 600000 + rand() % 50000, 300000 + rand() % 50000};
        int where[3] = {3 + rand() % 10, 15 + rand() % 10, 27 + rand() % 10};
        for (int st = 0; st < STEPS; st++) {
            const bool last = st == STEPS - 1;
            if (last) step_start = t;
            for (int i = 0; i < PER_STEP; i++) {
                long long gap = i ? rand() % 5000 : 0;
                int g = -1;
                for (int k = 0; k < 3; k++)
                    if (last && i == where[k]) g = k;
                if (g >= 0) {
                    gap = planted[g];
                    at[g] = t;
                    /* the host waits over the first planted gap, from before it to its middle */
                    if (g == 0) fprintf(f, "Y,%lld,%lld,0,stream synchronize\n", t - 20000, t + gap / 2);
                }
                t += gap;
                const long long len = 1000 + rand() % 200000;
                /* the record before a planted gap runs on stream 9, the one after it on 7 */
                const bool before_planted = last && (i + 1 == where[0] || i + 1 == where[1] || i + 1 == where[2]);
                fprintf(f, "K,%lld,%lld,%d,%s\n", t, t + len, before_planted ? 9 : 7, before_planted ? GEMM : NORM);
                t += len;
            }
            fprintf(f, "K,%lld,%lld,7,%s\n", t, t + 500000, ADAM);
            t += 500000;
            if (st == STEPS - 2) prev_end = t;
            t += 40000 + rand() % 100000;
        }
        fclose(f);
        char cmd[512], *out = NULL;
        snprintf(cmd, sizeof cmd, "python3 tools/trace_gaps.py %s --gaps 3 2>&1", path);
        cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
        const char *b = strstr(out, "before the step: ");
        double before_ms;
        cr_assert(b && sscanf(b, "before the step: %lf ms", &before_ms) == 1, "%s", out);
        cr_expect_float_eq(before_ms, (step_start - prev_end) / 1e6, 0.0006, "%s", b);
        const char *line = strstr(out, "longest gaps");
        cr_assert(line, "%s", out);
        for (int k = 0; k < 3; k++) {
            line = strchr(line, '\n');
            cr_assert(line, "%s", out);
            line++;
            double ms, us;
            cr_assert_eq(sscanf(line, "%lf %lf", &ms, &us), 2, "%s", line);
            cr_expect_float_eq(ms, (at[k] - step_start) / 1e6, 0.0006, "gap %d at %.4f ms: %s", k, ms, line);
            cr_expect_float_eq(us, planted[k] / 1e3, 0.06, "gap %d of %.1f us: %s", k, us, line);
            const char *eol = strchr(line, '\n');
            char text[512];
            snprintf(text, sizeof text, "%.*s", eol ? (int)(eol - line) : (int)strlen(line), line);
            cr_expect(strstr(text, "grouped_gemm_kernel<2> (stream 9) -> rmsnorm_bwd_vec_kernel<bf16> (stream 7)"),
                      "%s", text);
            if (k == 0) {
                const char *w = strstr(text, "; host: stream synchronize ");
                double wait_us;
                cr_assert(w && sscanf(w, "; host: stream synchronize %lf us", &wait_us) == 1, "%s", text);
                cr_expect_float_eq(wait_us, (planted[0] / 2 + 20000) / 1e3, 0.51, "%s", text);
            }
            else cr_expect(!strstr(text, "host:"), "%s", text);
        }
        free(out);
    }
    unlink(path);
}

/* --by-next: the last step's idle time summed by the record that ends each gap, against the sums
 * computed here: random gaps before two kinds of kernel (and one before AdamW), three steps. */
Test(trace_tool, idle_time_by_the_record_after_it_matches_the_timeline, .timeout = 60)
{
    char path[] = "/tmp/mt_trace_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    for (unsigned seed = 31; seed <= 33; seed++) {
        srand(seed);
        FILE *f = fopen(path, "w");
        cr_assert(f);
        fprintf(f, "kind,start_ns,end_ns,stream,name\n");
        long long t = 1000000, idle_gemm = 0, idle_norm = 0;
        int n_gemm = 0, n_norm = 0;
        for (int st = 0; st < STEPS; st++) {
            const bool last = st == STEPS - 1;
            for (int i = 0; i < PER_STEP; i++) {
                const long long gap = i ? 1 + rand() % 20000 : 0, len = 1000 + rand() % 50000;
                const bool gemm = i % 3 == 0;
                if (last && gap) {
                    if (gemm) idle_gemm += gap, n_gemm++;
                    else idle_norm += gap, n_norm++;
                }
                t += gap;
                fprintf(f, "K,%lld,%lld,7,%s\n", t, t + len, gemm ? GEMM : NORM);
                t += len;
            }
            t += 3000;
            fprintf(f, "K,%lld,%lld,7,%s\n", t, t + 500000, ADAM);
            t += 500000 + 40000;
        }
        fclose(f);
        char cmd[512], *out = NULL;
        snprintf(cmd, sizeof cmd, "python3 tools/trace_gaps.py %s --by-next 5 2>&1", path);
        cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
        const char *names[] = {"grouped_gemm_kernel<2> (stream 7)", "rmsnorm_bwd_vec_kernel<bf16> (stream 7)",
                               "adamw_multi_kernel<bf16> (stream 7)"};
        const long long want_ns[] = {idle_gemm, idle_norm, 3000};
        const int want_n[] = {n_gemm, n_norm, 1};
        cr_assert(strstr(out, "idle time by the record after it"), "%s", out);
        for (int k = 0; k < 3; k++) {
            const char *at = strstr(out, names[k]);
            cr_assert(at, "no row for %s:\n%s", names[k], out);
            while (at > out && at[-1] != '\n') at--;
            double ms;
            int gaps;
            cr_assert_eq(sscanf(at, "%lf %d", &ms, &gaps), 2, "%s", at);
            cr_expect_float_eq(ms, want_ns[k] / 1e6, 0.0006, "%s: %.4f ms against %.4f", names[k], ms, want_ns[k] / 1e6);
            cr_expect_eq(gaps, want_n[k], "%s: %d gaps against %d", names[k], gaps, want_n[k]);
        }
        free(out);
    }
    unlink(path);
}

/* --small-ops: each copy or memset of the compute stream costs its own time, the gap after it and,
 * after a kernel, the gap before it; runs of two memsets and single copies between kernels with
 * random gaps, summed here by name. A copy stream's copies (long idle between them) are left out. */
Test(trace_tool, small_operations_cost_the_span_between_the_kernels_around_them, .timeout = 60)
{
    char path[] = "/tmp/mt_trace_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    for (unsigned seed = 41; seed <= 43; seed++) {
        srand(seed);
        FILE *f = fopen(path, "w");
        cr_assert(f);
        fprintf(f, "kind,start_ns,end_ns,stream,name\n");
        long long t = 1000000, cost_memset = 0, cost_copy = 0;
        int n_memset = 0, n_copy = 0;
        for (int st = 0; st < STEPS; st++) {
            const bool last = st == STEPS - 1;
            for (int i = 0; i < PER_STEP; i++) {
                const long long len = 1000 + rand() % 50000;
                fprintf(f, "K,%lld,%lld,7,%s\n", t, t + len, GEMM);
                t += len;
                const long long g0 = 500 + rand() % 9000; /* kernel -> first small op */
                if (i % 4 == 1) {                          /* two memsets, then a kernel */
                    const long long d1 = 1000 + rand() % 2000, g1 = 300 + rand() % 3000, d2 = 1000 + rand() % 2000,
                                    g2 = 500 + rand() % 9000;
                    fprintf(f, "S,%lld,%lld,7,memset 20 B\n", t + g0, t + g0 + d1);
                    fprintf(f, "S,%lld,%lld,7,memset 20 B\n", t + g0 + d1 + g1, t + g0 + d1 + g1 + d2);
                    if (last) cost_memset += g0 + d1 + g1 + d2 + g2, n_memset += 2;
                    t += g0 + d1 + g1 + d2 + g2;
                    /* a copy stream's copy meanwhile, far from anything on its stream */
                    fprintf(f, "C,%lld,%lld,9,memcpy kind 10 1024 B to device 1\n", t - g2, t - g2 + 800);
                } else if (i % 4 == 3) { /* one copy, then a kernel */
                    const long long d = 1000 + rand() % 3000, g1 = 500 + rand() % 9000;
                    fprintf(f, "C,%lld,%lld,7,memcpy kind 8 262144 B\n", t + g0, t + g0 + d);
                    /* the step's last copy waits on until AdamW, 3 us after the gap */
                    if (last) cost_copy += g0 + d + g1 + (i == PER_STEP - 1 ? 3000 : 0), n_copy++;
                    t += g0 + d + g1;
                } else {
                    t += 1 + rand() % 2000;
                }
            }
            t += 3000;
            fprintf(f, "K,%lld,%lld,7,%s\n", t, t + 500000, ADAM);
            t += 500000 + 40000;
        }
        fclose(f);
        char cmd[512], *out = NULL;
        snprintf(cmd, sizeof cmd, "python3 tools/trace_gaps.py %s --small-ops 5 2>&1", path);
        cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
        cr_assert(strstr(out, "copies and memsets by the stream time they cost"), "%s", out);
        cr_expect(!strstr(out, "to device 1 (stream 9)"), "a copy stream's copies are listed:\n%s", out);
        const char *names[] = {"memset 20 B (stream 7)", "memcpy kind 8 262144 B (stream 7)"};
        const long long want_ns[] = {cost_memset, cost_copy};
        const int want_n[] = {n_memset, n_copy};
        for (int k = 0; k < 2; k++) {
            const char *at = strstr(out, names[k]);
            cr_assert(at, "no row for %s:\n%s", names[k], out);
            while (at > out && at[-1] != '\n') at--;
            double ms;
            int count;
            cr_assert_eq(sscanf(at, "%lf %d", &ms, &count), 2, "%s", at);
            cr_expect_float_eq(ms, want_ns[k] / 1e6, 0.0006, "%s: %.4f ms against %.4f", names[k], ms, want_ns[k] / 1e6);
            cr_expect_eq(count, want_n[k], "%s: %d against %d", names[k], count, want_n[k]);
        }
        free(out);
    }
    unlink(path);
}

/* A timeline of STEPS steps with random GEMM and norm kernels (the norm's only in `with_norm`);
 * the last step's GEMM and norm totals (ns) into last[0], last[1] */
static void write_two_kind_timeline(const char *path, bool with_norm, long long last[2])
{
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fprintf(f, "kind,start_ns,end_ns,stream,name\n");
    long long t = 1000000;
    last[0] = last[1] = 0;
    for (int st = 0; st < STEPS; st++) {
        for (int i = 0; i < PER_STEP; i++) {
            const bool gemm = i % 3 == 0 || !with_norm;
            const long long len = 1000 + rand() % 50000;
            if (st == STEPS - 1) last[gemm ? 0 : 1] += len;
            fprintf(f, "K,%lld,%lld,7,%s\n", t, t + len, gemm ? GEMM : NORM);
            t += len + 100 + rand() % 1000;
        }
        fprintf(f, "K,%lld,%lld,7,%s\n", t, t + 500000, ADAM);
        t += 540000;
    }
    fclose(f);
}

/* --against: the last step's time per kernel against another trace's, against the totals made
 * here; a kernel only one side has shows with 0 calls on the other. */
Test(trace_tool, the_step_against_another_trace_differs_by_kernel_as_made, .timeout = 60)
{
    char pa[] = "/tmp/mt_trace_XXXXXX", pb[] = "/tmp/mt_trace_XXXXXX";
    int fa = mkstemp(pa), fb = mkstemp(pb);
    cr_assert(fa >= 0 && fb >= 0);
    close(fa);
    close(fb);
    for (unsigned seed = 41; seed <= 42; seed++) {
        srand(seed);
        long long a[2], b[2];
        write_two_kind_timeline(pa, true, a);
        write_two_kind_timeline(pb, false, b);
        char cmd[512], *out = NULL;
        snprintf(cmd, sizeof cmd, "python3 tools/trace_gaps.py %s --against %s 2>&1", pa, pb);
        cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
        const char *names[] = {"grouped_gemm_kernel<2>", "rmsnorm_bwd_vec_kernel<bf16>"};
        const int calls_a[] = {(PER_STEP + 2) / 3, PER_STEP - (PER_STEP + 2) / 3}, calls_b[] = {PER_STEP, 0};
        for (int k = 0; k < 2; k++) {
            const char *at = strstr(out, names[k]);
            cr_assert(at, "no row for %s:\n%s", names[k], out);
            while (at > out && at[-1] != '\n') at--;
            double d, ta, tb;
            int ca, cb;
            cr_assert_eq(sscanf(at, "%lf %lf %d %lf %d", &d, &ta, &ca, &tb, &cb), 5, "%s", at);
            cr_expect_float_eq(ta, a[k] / 1e6, 0.006, "%s: %.3f ms against %.3f", names[k], ta, a[k] / 1e6);
            cr_expect_float_eq(tb, b[k] / 1e6, 0.006, "%s: other %.3f ms against %.3f", names[k], tb, b[k] / 1e6);
            cr_expect_float_eq(d, (a[k] - b[k]) / 1e6, 0.011, "%s: difference %.3f", names[k], d);
            cr_expect_eq(ca, calls_a[k], "%s: %d calls", names[k], ca);
            cr_expect_eq(cb, calls_b[k], "%s: other %d calls", names[k], cb);
        }
        free(out);
    }
    unlink(pa);
    unlink(pb);
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
