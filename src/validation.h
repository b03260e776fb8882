/* The held-out validation pass of the training loop (data.validation_path). */
#ifndef MT_VALIDATION_H
#define MT_VALIDATION_H

#include <stdbool.h>

#include "comm.h"
#include "config.h"
#include "model.h"

/* validation_open returns NULL when none is configured and exits with a one-line error on every
 * rank when the files are bad. */
struct validation;
struct validation *validation_open(const struct config *c, int n_micro, int dp_rank, int dp_size);
void validation_close(struct validation *v);
bool validation_due(const struct validation *v, int step);
/* Mean cross-entropy over data.validation_batches global batches (forward only: no gradients;
 * the router statistics that model_forward leaves in m->stats_h are overwritten by the next
 * training micro-batch before anything reads them; a routing replay is off during the passes).
 * pp: NULL for a whole model, else the backend's comm of this rank's pipeline, and the batches
 * run as a forward-only pass through the stages (pipeline_forward.h). All ranks call it
 * together; world sums. */
double validation_run(struct validation *v, struct model *m, struct comm *dp_comm, struct comm *world,
                      struct comm *pp);
const char *validation_describe(const struct validation *v);

#endif
