/* Preemption (docs/slurm.md "Preemption"): SIGTERM or SIGUSR1 on any rank asks the job to stop.
 * The handler only sets a flag; at the end of every step the ranks agree on it (one MPI_Allreduce
 * of one int), save a checkpoint, say where it went and exit 0, so `--resume auto` continues from
 * that step. The handlers stay installed until exit: a second SIGTERM during the save is absorbed
 * instead of killing the writer (the save is also tmp-dir + rename + COMPLETE, so even SIGKILL
 * leaves no checkpoint that looks whole). */
#ifndef MT_PREEMPT_H
#define MT_PREEMPT_H

#include <mpi.h>
#include <stdbool.h>

struct config;

/* Installs the SIGTERM/SIGUSR1 handlers (not collective). */
void preempt_install(void);
/* Collective over world: whether any rank has received SIGTERM or SIGUSR1. */
bool preempt_requested(MPI_Comm world);
/* After the loop saved (or could not save) at `step`: one line saying where the checkpoint went
 * (or that nothing was saved because checkpoint.dir is empty), stop the watchdog, MPI_Finalize,
 * exit 0. */
_Noreturn void preempt_exit(const struct config *c, int step);

/* For tests: the signal number received so far (0 = none). */
int preempt_signal(void);

#endif
