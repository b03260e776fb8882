/* The hung/dead-rank watchdog (watchdog.h). The main thread only does atomic stores; the thread
 * does the clock checks, the heartbeat files and the abort, so a stuck collective cannot stop it. */
#include "watchdog.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "config.h"

static _Atomic(const char *) g_phase = "start-up";
static _Atomic(const char *) g_coll;
static atomic_int g_coll_ranks;
static atomic_int g_step;
static atomic_llong g_progress_ms; /* monotonic ms of the last watchdog_phase */
static bool (*g_poll_hook)(char *why, int cap);
static void (*g_abort_hook)(void);

static struct {
    bool running;
    int limit_s, rank, world;
    double hb_every_s, stale_s;
    char dir[MT_PATH_MAX], host[256];
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
} W = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };

static long long now_ms(void) { return (long long)(mt_now() * 1e3); }

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void watchdog_phase(int step, const char *phase)
{
    atomic_store_explicit(&g_step, step, memory_order_relaxed);
    atomic_store_explicit(&g_phase, phase, memory_order_relaxed);
    atomic_store_explicit(&g_progress_ms, now_ms(), memory_order_release);
}

void watchdog_collective(const char *name, int ranks)
{
    atomic_store_explicit(&g_coll_ranks, ranks, memory_order_relaxed);
    atomic_store_explicit(&g_coll, name, memory_order_release);
}

void watchdog_set_nccl_hooks(bool (*poll)(char *why, int cap), void (*abort)(void))
{
    g_poll_hook = poll;
    g_abort_hook = abort;
}

static void hb_path(const char *dir, int rank, char *out, size_t cap)
{
    snprintf(out, cap, "%s/rank_%05d", dir, rank);
}

/* One line, tab-separated: step pid host heartbeat_wall progress_wall phase. Written to a
 * temporary name and renamed, so a reader never sees half a line. */
static void hb_write(void)
{
    char path[MT_PATH_MAX + 32], tmp[MT_PATH_MAX + 40];
    hb_path(W.dir, W.rank, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return; /* a heartbeat is advisory: the watchdog still fires without it */
    const double wall = wall_now();
    const double idle_s = (now_ms() - atomic_load(&g_progress_ms)) / 1e3;
    fprintf(f, "%d\t%ld\t%s\t%.3f\t%.3f\t%s\n", atomic_load(&g_step), (long)getpid(), W.host, wall,
            wall - idle_s, atomic_load(&g_phase));
    if (fclose(f) == 0) rename(tmp, path);
}

struct heartbeat {
    int step;
    long pid;
    char host[256], phase[128];
    double beat_wall, progress_wall;
};

static bool hb_read(const char *dir, int rank, struct heartbeat *h)
{
    char path[MT_PATH_MAX + 32], line[1024];
    hb_path(dir, rank, path, sizeof path);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    return ok && sscanf(line, "%d\t%ld\t%255[^\t]\t%lf\t%lf\t%127[^\n]", &h->step, &h->pid, h->host,
                        &h->beat_wall, &h->progress_wall, h->phase) == 6;
}

/* Process state letter from /proc (R, S, D, T, t, Z, ...), 0 when the process is gone. */
static char proc_state(long pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return kill((pid_t)pid, 0) == 0 || errno == EPERM ? '?' : 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *rp = strrchr(buf, ')'); /* the command name may hold spaces */
    return rp && rp[1] == ' ' ? rp[2] : '?';
}

void watchdog_judge(const char *dir, int rank, int my_step, double now_wall, double stale_s,
                    char *out, int cap)
{
    struct heartbeat h;
    out[0] = 0;
    if (!hb_read(dir, rank, &h)) {
        snprintf(out, (size_t)cap, "no heartbeat visible in %s", dir);
        return;
    }
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    if (!strcmp(host, h.host)) {
        char st = proc_state(h.pid);
        if (st == 0 || st == 'Z') {
            snprintf(out, (size_t)cap, "dead (pid %ld on %s is gone; last heartbeat at step %d in %s)",
                     h.pid, h.host, h.step, h.phase);
            return;
        }
        if (st == 'T' || st == 't') {
            snprintf(out, (size_t)cap, "stopped (pid %ld on %s: SIGSTOP or a debugger; last heartbeat "
                     "at step %d in %s)", h.pid, h.host, h.step, h.phase);
            return;
        }
    }
    if (now_wall - h.beat_wall > stale_s) {
        snprintf(out, (size_t)cap, "silent for %.0f s (pid %ld on %s: stopped, dead or its node is "
                 "down; last heartbeat at step %d in %s)", now_wall - h.beat_wall, h.pid, h.host, h.step,
                 h.phase);
        return;
    }
    if (h.step < my_step)
        snprintf(out, (size_t)cap, "behind: still at step %d in %s", h.step, h.phase);
}

/* An error exit (mt_user_error) leaves no heartbeat of this rank behind; the thread dies with the
 * process. The directory goes with the last file in it. */
static void remove_own_heartbeat(void)
{
    char path[MT_PATH_MAX + 32];
    hb_path(W.dir, W.rank, path, sizeof path);
    unlink(path);
    rmdir(W.dir);
}

/* Before the abort: MPI_Abort runs no atexit handler, and a dead or stopped rank never cleans up
 * after itself, so the firing rank removes its own heartbeat and those of the ranks on this host
 * that the abort will reap (else each fired job left a moetrain-heartbeat-* directory in TMPDIR).
 * Live ranks keep theirs until they fire or exit: they may still be reading the others. */
static void remove_heartbeats_before_abort(void)
{
    for (int r = 0; r < W.world; r++) {
        struct heartbeat h;
        if (r != W.rank) {
            if (!hb_read(W.dir, r, &h) || strcmp(h.host, W.host)) continue;
            const char st = proc_state(h.pid);
            if (st != 0 && st != 'Z' && st != 'T' && st != 't') continue;
        }
        char path[MT_PATH_MAX + 32];
        hb_path(W.dir, r, path, sizeof path);
        unlink(path);
    }
    rmdir(W.dir); /* fails while a live rank's file is still there */
}

/* The one report line of this rank, then the job ends. Every live rank gets here within a few
 * seconds of the others (they stalled together), so each waits briefly before aborting to let
 * the others print. */
static _Noreturn void fire(double idle_s, const char *why)
{
    const char *coll = atomic_load(&g_coll);
    const int step = atomic_load(&g_step);
    char where[256], late[2048] = "", one[512];
    if (coll)
        snprintf(where, sizeof where, "in %s, inside collective %s over %d ranks",
                 atomic_load(&g_phase), coll, atomic_load(&g_coll_ranks));
    else
        snprintf(where, sizeof where, "in %s", atomic_load(&g_phase));
    const double now = wall_now();
    size_t used = 0;
    for (int r = 0; r < W.world && used < sizeof late - 1; r++) {
        if (r == W.rank) continue;
        watchdog_judge(W.dir, r, step, now, W.stale_s, one, sizeof one);
        if (!one[0]) continue;
        int n = snprintf(late + used, sizeof late - used, "%srank %d %s", used ? "; " : "", r, one);
        used += n > 0 ? (size_t)n : 0;
    }
    if (!late[0])
        mt_strlcpy(late, "none found (every rank's heartbeat is fresh and at this step)", sizeof late);
    char cause[600];
    if (why) snprintf(cause, sizeof cause, "%s after %.0f s without progress", why, idle_s);
    else snprintf(cause, sizeof cause, "no progress for %.0f s (train.watchdog_s %d)", idle_s, W.limit_s);
    fprintf(stderr, "moetrain: rank %d: watchdog: %s at step %d %s; late: %s; aborting the job\n",
            W.rank, cause, step, where, late);
    fflush(stderr);
    fflush(stdout);
    if (g_abort_hook) g_abort_hook();
    sleep(2);
    remove_heartbeats_before_abort();
    signal(SIGALRM, SIG_DFL);
    alarm(30); /* MPI_Abort itself could wait on a dead runtime */
    MPI_Abort(MPI_COMM_WORLD, 1);
    _exit(1);
}

static void *thread_main(void *arg)
{
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals belong to the main thread (preempt.c) */
    double next_beat = 0;
    pthread_mutex_lock(&W.mu);
    while (!W.stop) {
        const double t = mt_now();
        if (t >= next_beat) {
            hb_write();
            next_beat = t + W.hb_every_s;
        }
        const double idle_s = (now_ms() - atomic_load_explicit(&g_progress_ms, memory_order_acquire)) / 1e3;
        char why[512];
        if (g_poll_hook && !g_poll_hook(why, sizeof why)) {
            pthread_mutex_unlock(&W.mu);
            fire(idle_s, why);
        }
        if (idle_s > W.limit_s) {
            pthread_mutex_unlock(&W.mu);
            fire(idle_s, NULL);
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 250 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&W.cv, &W.mu, &ts);
    }
    pthread_mutex_unlock(&W.mu);
    return NULL;
}

static void choose_dir(const struct config *c, MPI_Comm world)
{
    char dir[MT_PATH_MAX] = "";
    if (*c->checkpoint.dir) {
        if (snprintf(dir, sizeof dir, "%s/.heartbeat", c->checkpoint.dir) >= (int)sizeof dir) dir[0] = 0;
    } else if (W.rank == 0) {
        const char *tmp = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/moetrain-heartbeat-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(dir)) dir[0] = 0;
    }
    MT_CHECK_MPI(MPI_Bcast(dir, (int)sizeof dir, MPI_CHAR, 0, world));
    if (*dir && mkdir(dir, 0777) != 0 && errno != EEXIST) dir[0] = 0;
    if (!*dir) mt_warn0("watchdog: no heartbeat directory could be made; it will not name late ranks\n");
    mt_strlcpy(W.dir, *dir ? dir : "/nonexistent", sizeof W.dir);
}


void watchdog_start(const struct config *c, MPI_Comm world)
{
    MT_CHECK_MPI(MPI_Comm_rank(world, &W.rank));
    MT_CHECK_MPI(MPI_Comm_size(world, &W.world));
    W.limit_s = c->train.watchdog_s;
    atomic_store(&g_progress_ms, now_ms());
    if (W.limit_s <= 0) {
        mt_log0("  watchdog    off (train.watchdog_s 0): a hung or dead rank can stall the job\n");
        return;
    }
    gethostname(W.host, sizeof W.host - 1);
    W.hb_every_s = MT_MIN(MT_MAX(W.limit_s / 20.0, 1.0), 10.0);
    W.stale_s = 3 * W.hb_every_s;
    choose_dir(c, world);
    hb_write();
    atexit(remove_own_heartbeat);
    mt_set_before_abort(remove_own_heartbeat);
    W.stop = false;
    int rc = pthread_create(&W.thread, NULL, thread_main, NULL);
    MT_CHECK(rc == 0, "watchdog: pthread_create: %s", strerror(rc));
    W.running = true;
    mt_log0("  watchdog    %d s without progress aborts the job naming the late rank "
            "(train.watchdog_s; heartbeats in %s)\n", W.limit_s, W.dir);
}

void watchdog_stop(void)
{
    if (!W.running) return;
    pthread_mutex_lock(&W.mu);
    W.stop = true;
    pthread_cond_signal(&W.cv);
    pthread_mutex_unlock(&W.mu);
    pthread_join(W.thread, NULL);
    W.running = false;
    char path[MT_PATH_MAX + 32];
    hb_path(W.dir, W.rank, path, sizeof path);
    unlink(path);
    MT_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    rmdir(W.dir); /* succeeds for whichever rank comes last on each filesystem */
}
