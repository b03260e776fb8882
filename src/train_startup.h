/* The table `moetrain train` prints before its first step (rank 0): backend, model, mesh,
 * sharding, the expert weight-gradient grouping, batch, optimizer, data and initialisation. */
#ifndef MT_TRAIN_STARTUP_H
#define MT_TRAIN_STARTUP_H

#include <stdbool.h>

#include "config.h"
#include "data.h"
#include "mesh.h"
#include "model.h"

void train_print_startup(const struct config *c, const struct mesh *mesh, const struct backend *be,
                         const struct data_source *data, int n_micro, const struct model *m,
                         const char *init, bool keep_copy);

#endif
