/* Picking the compute backend: CUDA when compiled in and a device is present, unless the config
 * (parallel.backend) or --backend asks for cpu. */
#ifndef MT_BACKEND_SELECT_H
#define MT_BACKEND_SELECT_H

#include "config.h"
#include "ops.h"

const struct backend *backend_select(enum mt_backend_choice want);
/* --backend value over the config's choice ("auto" or NULL keeps the config's) */
enum mt_backend_choice backend_choice_from_cli(const char *s, enum mt_backend_choice dflt);

#endif
