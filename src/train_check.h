/* The refusals `train` makes before it starts, shared with `train --dry-run` so that a dry run
 * approves exactly what a real run accepts. */
#ifndef MT_TRAIN_CHECK_H
#define MT_TRAIN_CHECK_H

#include <stdbool.h>

#include "config.h"
#include "mesh.h"

/* Checks config c on mesh d; on success sets *n_micro (micro-steps per optimizer step). Returns
 * false with one line naming the config file and key in err. */
bool train_check(const struct config *c, const struct mesh_dims *d, int *n_micro, char *err, int errcap);

/* train_check or mt_user_error (every rank sees the same config and mesh, so all exit together). */
int train_check_or_exit(const struct config *c, const struct mesh_dims *d);

#endif
