/* Hung and dead ranks (docs/slurm.md "Watchdog"). A thread per rank watches for progress: the
 * main thread names the phase of the step it enters (forward, backward, gradient reduce, ...) and
 * every such call counts as progress. After train.watchdog_s seconds without any, the rank prints
 * one line -- the step, the phase, the collective it last entered, and which rank is late -- and
 * aborts the job (ncclCommAbort through the abort hook, then MPI_Abort; the process is killed by
 * SIGALRM if even that does not return).
 *
 * Which rank is late comes from heartbeat files: each rank's thread rewrites
 * DIR/rank_RRRRR (step, phase, pid, host, wall time) every few seconds, so a SIGSTOPped or dead
 * rank is the one whose file stops changing; on the same host the pid tells dead from stopped.
 * DIR is checkpoint.dir/.heartbeat (shared by every rank, checked at start-up), else a directory
 * in $TMPDIR (or /tmp) named by rank 0, which only shows the ranks of each node to each other.
 *
 * Phase and collective names must be string literals (stored as pointers, read by the thread). */
#ifndef MT_WATCHDOG_H
#define MT_WATCHDOG_H

#include <mpi.h>
#include <stdbool.h>

struct config;

/* Collective over world. Starts the thread (train.watchdog_s > 0) and writes this rank's first
 * heartbeat; rank 0 prints the start-up line stating the limit. */
void watchdog_start(const struct config *c, MPI_Comm world);
/* Collective. Stops the thread and removes the heartbeat files (normal end or preemption). */
void watchdog_stop(void);

/* Main thread: this rank now runs `phase` of `step` (counts as progress). */
void watchdog_phase(int step, const char *phase);
/* The comm layer: entering (name) or leaving (NULL) a collective over `ranks` ranks. */
void watchdog_collective(const char *name, int ranks);
/* The NCCL comm's hooks, called from the watchdog thread: `poll` (every tick) returns false with a
 * one-line reason when a communicator reports an asynchronous error (a peer died, the network
 * failed), which fires the watchdog at once; `abort` (before MPI_Abort) aborts every
 * communicator, so no kernel is left waiting for a peer that will never come. */
void watchdog_set_nccl_hooks(bool (*poll)(char *why, int cap), void (*abort)(void));

/* The heartbeat verdict on `rank` (for the one-line report): "dead (pid 12 on host x is gone)",
 * "stopped (SIGSTOP) ...", "silent for N s", "behind: step S in PHASE" or "" when it looks fine.
 * Reads DIR/rank_RRRRR; now_wall = this rank's wall clock. Exposed for the unit test. */
void watchdog_judge(const char *dir, int rank, int my_step, double now_wall, double stale_s,
                    char *out, int cap);

#endif
