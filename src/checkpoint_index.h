/* The shard runs a rank saves or loads, grouped by tensor, and the index of an old checkpoint's
 * rank files that a load reads its pieces from (phase 2; checkpoint_index.c). Private to the
 * checkpoint files and the HF export's stream. Uses checkpoint_manifest.h, checkpoint_fs.h and
 * checkpoint_h5.h. */
#ifndef MT_CKPT_INDEX_H
#define MT_CKPT_INDEX_H

#include <stdbool.h>
#include <stdint.h>

#include "checkpoint_manifest.h"
#include "mesh.h"
#include "params.h"

/* --- shard runs (params_for_each_run_of), grouped by tensor --------------------------------- */

struct ck_run {
    int64_t gidx, soff, len;   /* global flat element, shard offset, elements */
};
struct ck_runs {
    struct ck_run *r;
    int n, cap;
};
/* params_run_fn appending to ((struct ck_runs *)ctx)[tensor] */
void ck_collect_run(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len);

/* --- the index of an old checkpoint's rank files ---------------------------------------------- */

/* One tensor piece of one old rank file: a flat range [a, b) of a non-expert tensor, or experts
 * [e0, e1) x rows [r0, r1) (x all of dim 2) of an expert tensor. */
struct ck_piece {
    int64_t file, tensor, a, b, e0, e1, r0, r1;
};
#define CK_PIECE_INTS 8
struct ck_pieces {
    struct ck_piece *v;
    int n, cap;
};
/* Collective over mesh (one process when it has no MPI): every rank indexes old files rank,
 * rank + W, ..., checking each dataset's slice against tt; the pieces are then all-gathered into
 * *all (the caller frees all->v). False on every rank with the same message otherwise. */
bool ck_build_index(const char *dir, const struct ck_manifest *man, const struct tensor_table *tt,
                    const struct mesh *mesh, struct ck_pieces *all, char *err, int cap);

#endif
