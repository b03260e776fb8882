/* Picking the compute backend: CUDA when compiled in and a device is present, unless the config
 * (parallel.backend) or --backend asks for cpu. */
#ifndef MT_BACKEND_SELECT_H
#define MT_BACKEND_SELECT_H

#include "config.h"
#include "ops.h"

/* local_rank: this process's index among the ranks of its node (picks the GPU). */
const struct backend *backend_select(enum mt_backend_choice want, enum mt_precision precision,
                                     int local_rank);
/* --backend value over the config's choice ("auto" or NULL keeps the config's) */
enum mt_backend_choice backend_choice_from_cli(const char *s, enum mt_backend_choice dflt);

#endif
