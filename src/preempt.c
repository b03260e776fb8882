/* Preemption signals (preempt.h). */
#include "preempt.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "common.h"
#include "config.h"
#include "watchdog.h"

static volatile sig_atomic_t g_signal;

static void on_signal(int sig)
{
    if (!g_signal) g_signal = sig; /* the first one names the cause; later ones are absorbed */
}

void preempt_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART; /* file writes of a save in progress carry on */
    MT_CHECK(sigaction(SIGTERM, &sa, NULL) == 0 && sigaction(SIGUSR1, &sa, NULL) == 0,
             "sigaction(SIGTERM/SIGUSR1) failed");
}

int preempt_signal(void) { return g_signal; }

bool preempt_requested(MPI_Comm world)
{
    int mine = g_signal, any = 0;
    MT_CHECK_MPI(MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, world));
    if (any && !g_signal) g_signal = any;
    return any != 0;
}

void preempt_exit(const struct config *c, int step)
{
    const char *name = g_signal == SIGUSR1 ? "SIGUSR1" : g_signal == SIGTERM ? "SIGTERM" : "a signal";
    char dir[MT_PATH_MAX + 32];
    if (!*c->checkpoint.dir)
        mt_log0("preempted (%s): stopped after step %d; NOTHING SAVED: checkpoint.dir is not set, "
                "a rerun starts from the beginning\n", name, step);
    else if (ckpt_latest(c->checkpoint.dir, dir, (int)sizeof dir) == step)
        mt_log0("preempted (%s): stopped after step %d; checkpoint saved in %s; continue with "
                "--resume auto\n", name, step, dir);
    else
        mt_log0("preempted (%s): stopped after step %d; no complete checkpoint of that step is in "
                "%s\n", name, step, c->checkpoint.dir);
    watchdog_stop();
    fflush(stdout);
    MPI_Finalize();
    exit(0);
}
