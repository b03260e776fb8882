/* Checkpoints (design.md "Checkpoints"; docs/checkpoints.md has the file format).
 *
 * One directory per step, ROOT/step_XXXXXXXX/:
 *   rank_RRRRR.h5  one per world rank: groups master, adam_m, adam_v, each holding one dataset per
 *                  tensor piece the rank owns, named by the tensor table's stable name, with the
 *                  global shape and the slice held as attributes
 *   manifest.h5    format version, step, optimizer step, data position, mesh, model shape, the
 *                  config as YAML, the aux-free balancing bias when there is one
 *   COMPLETE       written last: a directory without it is never loaded
 * Written as step_XXXXXXXX.tmp, fsynced, renamed, then marked complete, so a crash never leaves
 * a checkpoint that looks whole. Loading on the same mesh is bit-exact; on any other mesh every
 * rank assembles its new shard from whichever old rank files hold the pieces (the values are
 * copied, so the restored fp32 state is bit-identical there too).
 *
 * A mesh whose world_comm is MPI_COMM_NULL (d.world 1) means one process without MPI (tests). */
#ifndef MT_CKPT_H
#define MT_CKPT_H

#include <stdbool.h>

#include "checkpoint_fs.h"       /* ckpt_check_dir, ckpt_latest, ckpt_due, ckpt_resume_dir, ckpt_is_checkpoint */
#include "checkpoint_manifest.h" /* ckpt_read_config */
#include "config.h"
#include "mesh.h"
#include "params.h"

/* Collective over mesh->world_comm. Saves p's master weights and Adam moments (p->step is the
 * optimizer step) as checkpoint `step` under `root`, then deletes complete checkpoints beyond
 * c->checkpoint.keep (0 = keep all; the one just written is always kept) and stale .tmp
 * directories. bias_host: the aux-free balancing bias [L, E] (identical on every rank) or NULL.
 * A root that cannot be created is a one-line error on every rank; an I/O failure while writing
 * aborts every rank (mt_fatal) and leaves only a .tmp directory behind. */
void ckpt_save(const char *root, int step, const struct params *p, const struct mesh *mesh,
               const struct config *c, const float *bias_host);

/* Collective. Restores p (master, m1, m2 of both groups and p->step; the compute-dtype copies of
 * the masters too) from checkpoint directory `dir`, which may come from any mesh; the caller then
 * runs params_gather_weights. The model shape recorded in the manifest must equal c->model's.
 * bias_host_out [L, E] (or NULL) receives the saved bias, zeros when the checkpoint has none.
 * *step_out (or NULL) receives the training step the checkpoint was taken after (the data
 * position). Any problem (missing, truncated or corrupt file, no COMPLETE marker, another model
 * shape): a one-line error naming the file and the problem, non-zero exit on every rank. */
void ckpt_load(const char *dir, struct params *p, const struct mesh *mesh, const struct config *c,
               float *bias_host_out, int *step_out);

/* As ckpt_load, but on failure returns false on every rank with the same one-line message in err.
 * p is untouched after every failure except a read error (checksum) in the Adam moments, which
 * can come after the masters were restored. weights_only: restore the master weights (and the
 * bias) only, zero the Adam moments and p->step (model.init_from a checkpoint). */
bool ckpt_load_checked(const char *dir, struct params *p, const struct mesh *mesh,
                       const struct config *c, float *bias_host_out, int *step_out,
                       bool weights_only, char *err, int errcap);

/* Not collective, one process: reads the master weights of checkpoint `dir` one flat range of one
 * tensor at a time (moetrain export), never the whole model. open checks the manifest against
 * c->model as ckpt_load does and indexes every rank file; *bias_out: the saved balancing bias
 * [L, E] (malloc'd) or NULL; *step_out: the checkpoint's step. NULL / false + one-line message. */
struct ckpt_reader;
struct ckpt_reader *ckpt_reader_open(const char *dir, const struct config *c, const struct tensor_table *tt,
                                     float **bias_out, int *step_out, char *err, int cap);
/* elements [A, A + n) of tensor `tensor`'s flattened global layout into dst */
bool ckpt_reader_read(struct ckpt_reader *r, int tensor, int64_t A, int64_t n, float *dst, char *err, int cap);
void ckpt_reader_close(struct ckpt_reader *r);

#endif
