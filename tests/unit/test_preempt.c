/* Preemption signals (src/preempt.c) and the hung/dead-rank watchdog (src/watchdog.c): the
 * train.watchdog_s key, the heartbeat verdicts, and 2-rank runs that get SIGTERM, SIGUSR1 or have
 * a rank stopped. tests/slurm/run.sh repeats the signal cases under a real Slurm. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../test_util.h"
#include "config.h"
#include "watchdog.h"

Test(preempt, watchdog_s_key_default_and_range)
{
    struct config c;
    char err[1024] = "";
    cr_assert(config_load_checked(&c, "configs/tiny.yaml", 0, NULL, err, sizeof err), "%s", err);
    cr_expect_eq(c.train.watchdog_s, 600);
    char *ok[] = {"train.watchdog_s=0"};
    cr_assert(config_load_checked(&c, "configs/tiny.yaml", 1, ok, err, sizeof err), "%s", err);
    cr_expect_eq(c.train.watchdog_s, 0);
    char *neg[] = {"train.watchdog_s=-5"};
    cr_expect_not(config_load_checked(&c, "configs/tiny.yaml", 1, neg, err, sizeof err));
    cr_expect(strstr(err, "train.watchdog_s must be >= 0") && !strchr(err, '\n'), "%s", err);
    char *word[] = {"train.watchdog_s=ten"};
    cr_expect_not(config_load_checked(&c, "configs/tiny.yaml", 1, word, err, sizeof err));
    cr_expect(strstr(err, "watchdog_s"), "%s", err);
}

static void put_heartbeat(const char *dir, int rank, int step, long pid, const char *host, double wall)
{
    char path[512];
    snprintf(path, sizeof path, "%s/rank_%05d", dir, rank);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fprintf(f, "%d\t%ld\t%s\t%.3f\t%.3f\tbackward\n", step, pid, host, wall, wall);
    fclose(f);
}

Test(preempt, heartbeat_verdicts)
{
    char dir[] = "/tmp/mt_hb_XXXXXX", host[256] = "", out[512];
    cr_assert(mkdtemp(dir));
    gethostname(host, sizeof host - 1);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    const double now = (double)ts.tv_sec;

    watchdog_judge(dir, 1, 7, now, 3, out, sizeof out);
    cr_expect(strstr(out, "no heartbeat visible"), "%s", out);

    pid_t child = fork(); /* a pid that is surely gone: a child already reaped */
    if (child == 0) _exit(0);
    waitpid(child, NULL, 0);
    put_heartbeat(dir, 1, 7, child, host, now);
    watchdog_judge(dir, 1, 7, now, 3, out, sizeof out);
    cr_expect(strstr(out, "dead (pid") && strstr(out, "is gone"), "%s", out);

    child = fork(); /* a stopped process */
    if (child == 0) {
        pause();
        _exit(0);
    }
    kill(child, SIGSTOP);
    usleep(100 * 1000);
    put_heartbeat(dir, 2, 7, child, host, now);
    watchdog_judge(dir, 2, 7, now, 3, out, sizeof out);
    cr_expect(strstr(out, "stopped (pid"), "%s", out);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);

    put_heartbeat(dir, 3, 7, 12345, "another-node", now - 60); /* another host, silent for a minute */
    watchdog_judge(dir, 3, 7, now, 3, out, sizeof out);
    cr_expect(strstr(out, "silent for 60 s"), "%s", out);

    put_heartbeat(dir, 4, 5, 12345, "another-node", now); /* alive but two steps behind */
    watchdog_judge(dir, 4, 7, now, 3, out, sizeof out);
    cr_expect(strstr(out, "behind: still at step 5 in backward"), "%s", out);

    put_heartbeat(dir, 5, 7, (long)getpid(), host, now); /* alive, same step: not late */
    watchdog_judge(dir, 5, 7, now, 3, out, sizeof out);
    cr_expect_str_empty(out);

    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    tu_run(cmd, NULL);
}

/* Starts a 2-rank run in the background, waits for its 5th step line in the metrics, sends `sig`
 * (repeated `repeat` times, 20 ms apart, to both ranks, or to one when `one_rank`) and waits for
 * the end. The rank pids come
 * from the ranks' parent (mpirun). Prints "rc=N took=S" at the end of the output. */
static int run_signalled(const char *dir, const char *sets, const char *sig, int repeat, bool one_rank,
                         char **out)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "rm -rf %1$s && mkdir -p %1$s/tmp && export TMPDIR=%1$s/tmp && t0=$(date +%%s) && "
             "{ timeout 120 %2$s -np 2 %3$s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.global_batch_size=8 --set train.seq_len=32 --set train.steps=100000 "
             "--set log.interval=1000 --set log.metrics=%1$s/m.jsonl %4$s > %1$s/out 2>&1 & mp=$!; }; "
             "for i in $(seq 600); do [ -f %1$s/m.jsonl ] && [ $(wc -l < %1$s/m.jsonl) -ge 5 ] && break; sleep 0.1; done; "
             "ranks=$(pgrep -P $(pgrep -P $mp | head -1) -x moetrain; pgrep -P $mp -x moetrain); "
             "targets=$ranks; [ %7$d = 1 ] && targets=$(echo $ranks | cut -d' ' -f1); "
             "for i in $(seq %6$d); do kill -%5$s $targets 2>/dev/null; sleep 0.02; done; "
             "wait $mp; rc=$?; cat %1$s/out; echo rc=$rc took=$(( $(date +%%s) - t0 )); "
             "kill -9 $ranks 2>/dev/null; exit $rc",
             dir, tu_mpirun(), tu_build(), sets, sig, repeat, one_rank ? 1 : 0);
    return tu_run(cmd, out);
}

/* The watchdog's heartbeat directories a run left in its TMPDIR (run_signalled's dir/tmp) */
static int heartbeat_dirs_left(const char *dir)
{
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "ls -d %s/tmp/moetrain-heartbeat-* 2>/dev/null | wc -l", dir);
    tu_run(cmd, &out);
    const int n = out ? atoi(out) : -1;
    free(out);
    return n;
}

/* SIGTERM bursts on both ranks (so some land during the save): one checkpoint of the step where it
 * stopped, complete, its place printed, exit 0, and --resume auto continues from it. */
Test(preempt, sigterm_saves_a_checkpoint_and_exits_0, .timeout = 240)
{
    const char *dir = "/tmp/mt_preempt_term";
    char *out = NULL;
    int rc = run_signalled(dir, "--set checkpoint.dir=/tmp/mt_preempt_term/ck", "TERM", 25, false, &out);
    cr_expect_eq(rc, 0, "%s", out);
    int step = -1;
    const char *hit = strstr(out, "preempted (SIGTERM): stopped after step ");
    cr_assert(hit && sscanf(hit, "preempted (SIGTERM): stopped after step %d", &step) == 1, "%s", out);
    char want[256], path[256];
    snprintf(want, sizeof want, "checkpoint saved in %s/ck/step_%08d; continue with --resume auto", dir, step);
    cr_expect(strstr(out, want), "want '%s' in:\n%s", want, out);
    snprintf(path, sizeof path, "%s/ck/step_%08d/COMPLETE", dir, step);
    struct stat st;
    cr_expect_eq(stat(path, &st), 0, "%s missing", path);
    free(out);

    char cmd[1024];
    snprintf(cmd, sizeof cmd, "timeout 120 %s -np 2 %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.global_batch_size=8 --set train.seq_len=32 --set train.steps=%d "
             "--set checkpoint.dir=%s/ck --resume auto", tu_mpirun(), tu_build(), step + 2, dir);
    rc = tu_run(cmd, &out);
    snprintf(want, sizeof want, "resumed from %s/ck/step_%08d (step %d)", dir, step, step);
    cr_expect(rc == 0 && strstr(out, want), "rc %d, want '%s' in:\n%s", rc, want, out);
    free(out);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    tu_run(cmd, NULL);
}

Test(preempt, sigusr1_without_checkpoint_dir_says_nothing_was_saved, .timeout = 240)
{
    char *out = NULL;
    int rc = run_signalled("/tmp/mt_preempt_usr1", "", "USR1", 1, true, &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "preempted (SIGUSR1): stopped after step ") &&
              strstr(out, "NOTHING SAVED: checkpoint.dir is not set"), "%s", out);
    cr_expect_eq(heartbeat_dirs_left("/tmp/mt_preempt_usr1"), 0, "%s", out);
    free(out);
    tu_run("rm -rf /tmp/mt_preempt_usr1", NULL);
}

/* A stopped rank: the other rank's watchdog names it and the job ends non-zero soon after
 * train.watchdog_s (3 s here), not never; the abort leaves no heartbeat directory behind (the
 * firing rank removes its own heartbeat and the stopped rank's). */
Test(preempt, watchdog_names_a_stopped_rank_and_ends_the_job, .timeout = 240)
{
    char *out = NULL;
    int rc = run_signalled("/tmp/mt_watchdog_stop", "--set train.watchdog_s=3", "STOP", 1, true, &out);
    cr_expect(rc != 0 && rc != 124, "rc %d (124 = hung until timeout):\n%s", rc, out);
    cr_expect(strstr(out, "watchdog    3 s without progress aborts the job"), "%s", out);
    const char *line = strstr(out, "watchdog: no progress for ");
    cr_expect(line && strstr(line, "(train.watchdog_s 3) at step ") && strstr(line, "; late: rank ") &&
              strstr(line, " stopped (pid "), "%s", out);
    int took = -1;
    const char *t = strstr(out, " took=");
    cr_expect(t && sscanf(t, " took=%d", &took) == 1 && took <= 40, "took %d s:\n%s", took, out);
    cr_expect_eq(heartbeat_dirs_left("/tmp/mt_watchdog_stop"), 0, "a moetrain-heartbeat-* directory "
                 "was left in /tmp/mt_watchdog_stop/tmp:\n%s", out);
    free(out);
    tu_run("rm -rf /tmp/mt_watchdog_stop", NULL);
}

Test(preempt, watchdog_off_is_stated, .timeout = 120)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "timeout 100 %s -np 2 %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.steps=2 --set train.watchdog_s=0", tu_mpirun(), tu_build());
    int rc = tu_run(cmd, &out);
    cr_expect(rc == 0 && strstr(out, "watchdog    off (train.watchdog_s 0)"), "rc %d:\n%s", rc, out);
    free(out);
}

/* mt_fatal runs the before-abort hook (the watchdog's heartbeat removal) before MPI_Abort, on the
 * failing rank; the job ends non-zero with that rank's one line */
Test(preempt, a_fatal_error_runs_the_before_abort_hook, .timeout = 120)
{
    const char *dir = "/tmp/mt_before_abort";
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "rm -rf %1$s && mkdir -p %1$s && timeout 60 %2$s -np 2 %3$s/tests/mpi/abort_check %1$s",
             dir, tu_mpirun(), tu_build());
    int rc = tu_run(cmd, &out);
    cr_expect(rc != 0 && rc != 124, "rc %d:\n%s", rc, out);
    cr_expect(strstr(out, "moetrain: rank 1: ") && strstr(out, "abort_check: the fatal error of rank 1"), "%s", out);
    char path[256];
    snprintf(path, sizeof path, "%s/before_abort_1", dir);
    struct stat st;
    cr_expect_eq(stat(path, &st), 0, "%s missing: the hook did not run before MPI_Abort:\n%s", path, out);
    free(out);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    tu_run(cmd, NULL);
}
