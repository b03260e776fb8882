/* train_check.h: the pre-flight refusals of `train` and `train --dry-run`. */
#include "train_check.h"

#include <stdio.h>

#include "common.h"

bool train_check(const struct config *c, const struct mesh_dims *d, int *n_micro, char *err, int errcap)
{
    const char *path = c->path[0] ? c->path : "config";
    const struct train_config *tc = &c->train;
    const int dp = d->S, mb = tc->micro_batch_size;
    if (tc->global_batch_size % (dp * mb) != 0) {
        snprintf(err, (size_t)errcap, "%s: train.global_batch_size %d is not a multiple of "
                 "train.micro_batch_size %d x %d data-parallel ranks (ranks per pipeline stage)",
                 path, tc->global_batch_size, mb, dp);
        return false;
    }
    *n_micro = tc->global_batch_size / (dp * mb);
    return true;
}

int train_check_or_exit(const struct config *c, const struct mesh_dims *d)
{
    char err[MT_PATH_MAX + 256];
    int n_micro = 0;
    if (!train_check(c, d, &n_micro, err, sizeof err)) mt_user_error("%s", err);
    return n_micro;
}
