/* A checkpoint's manifest (checkpoint_manifest.c): written by rank 0 of a save once every rank
 * file is, and read and checked first by a load (phase 1). ckpt_read_config is public through
 * checkpoint.h; the rest is private to the checkpoint files. Uses checkpoint_fs.h and
 * checkpoint_h5.h. */
#ifndef MT_CKPT_MANIFEST_H
#define MT_CKPT_MANIFEST_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "mesh.h"
#include "params.h"

/* The config a checkpoint was saved with (its manifest's YAML), with `sets` applied after it. */
bool ckpt_read_config(const char *dir, int n_sets, char **sets, struct config *c, char *err, int cap);

struct ck_manifest {            /* all int64 so that it travels as bytes */
    int64_t version, step, opt_step, data_pos, world, pp, ep, ep_fsdp, ep_outside, S;
    int64_t has_bias, bias_L, bias_E;
};
/* Rank 0 of a save, every rank file written: creates and fsyncs manifest `path` (fatal on
 * failure). bias: [L, E] or NULL. */
void ck_write_manifest(const char *path, int step, const struct params *p, const struct mesh *mesh,
                       const struct config *c, const float *bias, int64_t save_seq);
/* Not collective: checks that dir is a complete checkpoint whose manifest is of this format and
 * version, with a consistent mesh and c->model's shape; fills man, and *bias (malloc'd [bias_L,
 * bias_E]) when the manifest has one. False with a one-line message in err. */
bool ck_read_manifest(const char *dir, const struct config *c, struct ck_manifest *man, float **bias,
                     char *err, int cap);

#endif
