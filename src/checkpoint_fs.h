/* A checkpoint directory on the filesystem (checkpoint_fs.c): the names of its files, finding the
 * newest checkpoint, the checks of checkpoint.dir at start-up, and the filesystem steps of a
 * crash-safe save (fsync, mkdir -p, rm -rf, cleanup). The public ckpt_* functions of this file
 * reach the rest of the program through checkpoint.h; the ck_* ones are private to the
 * checkpoint files (and hf_export.c's directory steps). Uses checkpoint_h5.h only. */
#ifndef MT_CKPT_FS_H
#define MT_CKPT_FS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "mesh.h"

/* the format version written into the manifest and every rank file */
#define CKPT_FORMAT_VERSION 1

#define CK_MANIFEST "manifest.h5"
#define CK_COMPLETE "COMPLETE"
#define CK_ROOT_MARKER ".moetrain-checkpoints"  /* in checkpoint.dir: moetrain writes here */
#define CK_FORMAT_MANIFEST "moetrain checkpoint manifest"
#define CK_FORMAT_RANK "moetrain checkpoint rank file"

/* --- public (checkpoint.h) ------------------------------------------------------------------ */

/* Collective; call once at start-up when checkpoint.dir is set. Creates checkpoint.dir (mkdir -p)
 * and checks that every rank sees it (checkpoints need a filesystem shared by all ranks), so a bad
 * path is a one-line error before training rather than at the first save. An existing directory
 * that holds other files and neither a moetrain checkpoint nor the marker of an earlier run is
 * refused unless force (--force); the marker is written when the directory is accepted. */
void ckpt_check_dir(const struct config *c, const struct mesh *mesh, bool force);

/* Not collective. The step of the newest complete moetrain checkpoint under root (its directory in
 * dir_out), or -1 when there is none (or root does not exist). Newest = the highest save sequence
 * recorded in the manifests (every save numbers itself 1 + the highest under root), then the
 * highest step: after a rewind, the rewound run's saves are newer than the stale higher steps. */
int ckpt_latest(const char *root, char *dir_out, int cap);

/* Whether the train loop saves after `step`: checkpoint.dir set and (step % interval == 0 or
 * step is the last one; interval 0 = only at the end). */
bool ckpt_due(const struct config *c, int step);

/* Collective. Interprets --resume (NULL = not given): "auto" = the newest complete checkpoint
 * under checkpoint.dir (false, i.e. start fresh, when there is none; a user error when
 * checkpoint.dir is empty); anything else = that checkpoint directory (checked by ckpt_load).
 * Rank 0 looks; every rank gets the same answer. Returns true with dir_out set to resume. */
bool ckpt_resume_dir(const char *resume, const struct config *c, const struct mesh *mesh,
                     char *dir_out, int cap);

/* Not collective: whether dir looks like a checkpoint directory (holds a manifest.h5), e.g. to
 * tell a checkpoint from a Hugging Face directory in model.init_from. */
bool ckpt_is_checkpoint(const char *dir);

/* --- private to the checkpoint files ---------------------------------------------------------- */

/* snprintf for paths: mt_fatal when it does not fit */
void ck_path(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void ck_step_dir(char *out, size_t cap, const char *root, int step, bool tmp);
void ck_rank_file(char *out, size_t cap, const char *dir, int rank);
bool ck_file_exists(const char *path);
/* fsync a file or directory by path; false with errno set on failure (EINVAL for a directory on
 * a filesystem without directory fsync counts as success) */
bool ck_fsync_path(const char *path);
/* rm -rf; false on the first failure (errno set) */
bool ck_remove_tree(const char *path);
/* mkdir -p; false with errno set on failure */
bool ck_mkdir_p(const char *path);
/* Collective, after rank 0 created directory `path`: every rank must see it (waits a few seconds
 * for a slow shared filesystem). False on every rank with a message otherwise. */
bool ck_every_rank_sees(const struct mesh *mesh, const char *path, const char *what, char *err, int cap);
/* Rank 0 after checkpoint `current` is complete: drops stale .tmp and unfinished directories that
 * hold only checkpoint files, and the complete checkpoints beyond the newest `keep` (newest =
 * highest save sequence, then step; never `current`). A step_* directory without a moetrain
 * manifest is never touched. */
void ck_cleanup(const char *root, int keep, int current);
/* Whether directory p holds nothing but checkpoint files (rank_NNNNN.h5, manifest.h5, COMPLETE);
 * false when it cannot be listed. */
bool ck_holds_only_checkpoint_files(const char *p);
/* Not collective: whether dir holds a readable moetrain manifest; *save_seq its save sequence
 * (0 for a checkpoint written before sequences were recorded). */
bool ck_manifest_identity(const char *dir, int64_t *save_seq);
/* The save sequence for the next checkpoint under root: 1 + the highest of its complete
 * checkpoints (1 when there is none). */
int64_t ck_next_save_seq(const char *root);

#endif
