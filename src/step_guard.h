/* The step verdict: after the gradient reduction every rank agrees whether the optimizer step is
 * applied, skipped (non-finite loss or gradient norm, or a loss spike) or the run stops
 * (train.nonfinite: stop, or train.max_skipped_steps skips in a row). docs/reliability.md. */
#ifndef MT_STEP_GUARD_H
#define MT_STEP_GUARD_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>

#include "config.h"

enum step_verdict { STEP_APPLY = 0, STEP_SKIP = 1, STEP_STOP = 2 };

#define STEP_GUARD_WINDOW 20      /* applied steps in the running mean of the spike test */
#define STEP_GUARD_MIN_HISTORY 5  /* applied steps before the spike test is active */

struct step_guard {
    enum mt_nonfinite nonfinite;
    int max_skipped;
    double spike_factor;         /* 0 = off */
    int consecutive;             /* skipped steps in a row */
    int total_skipped;           /* this process's run (not carried over a resume) */
    double recent[STEP_GUARD_WINDOW];  /* losses of the newest applied steps, a ring */
    int n_recent, next;
    char why[256];               /* the reason of the last skip or stop */
};

void step_guard_init(struct step_guard *g, const struct train_config *t);

/* This rank's verdict on step `step` from its (already reduced) loss and gradient norm; updates
 * the counters and the spike history as if the verdict were final. Not collective. */
enum step_verdict step_guard_judge(struct step_guard *g, int step, double loss, double grad_norm);

/* Collective over comm (MPI_COMM_NULL = one process): step_guard_judge, then every rank takes the
 * most severe verdict of any rank, so none applies a step another skipped. */
enum step_verdict step_guard_decide(struct step_guard *g, int step, double loss, double grad_norm,
                                    MPI_Comm comm);

/* The one-line error of a STEP_STOP verdict. */
void step_guard_stop_message(const struct step_guard *g, char *buf, size_t cap);

#endif
