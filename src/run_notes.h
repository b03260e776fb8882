/* One-line notes that say what a resumed run does differently from the run it continues. */
#ifndef MT_RUN_NOTES_H
#define MT_RUN_NOTES_H

#include "config.h"

/* Rank 0, at start-up after resuming from checkpoint `dir` at step start_step: states what
 * happens to the learning-rate schedule when train.steps (or the warmup, lr, min_lr) differ from
 * the checkpoint's config, and that nothing is left to train when start_step >= train.steps. */
void run_note_resume(const char *dir, const struct config *c, int start_step);

/* Rank 0, after the loop: "done: N steps in T s", or the nothing-to-train line. */
void run_note_done(const struct config *c, int start_step, double seconds);

/* Rank 0, --dry-run: notes what train would still need (a token file that is not there yet). */
void run_note_dry_run(const struct config *c);

#endif
