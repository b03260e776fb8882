/* Private to checkpoint*.c: the HDF5 layer (checked calls, attributes, error text), names of the
 * files of a checkpoint directory, the filesystem steps of a crash-safe save, the collective
 * error agreement of the loader, the manifest and the piece index the loader reads.
 *
 * The files, each using only those listed after it:
 *   checkpoint.c (save), checkpoint_load.c (load, export reader)
 *   checkpoint_index.c     shard runs, phase 2 of a load: indexing the old rank files
 *   checkpoint_manifest.c  writing the manifest, phase 1 of a load: reading and checking it
 *   checkpoint_fs.c        directories, fsync, newest / cleanup of checkpoints
 *   checkpoint_h5.c        HDF5 helpers, error messages, the collective agreement */
#ifndef MT_CKPT_INTERNAL_H
#define MT_CKPT_INTERNAL_H

#include <hdf5.h>
#include <mpi.h>
#include <stdbool.h>
#include <stdint.h>

#include "mesh.h"
#include "params.h"

#define CK_MANIFEST "manifest.h5"
#define CK_COMPLETE "COMPLETE"
#define CK_ROOT_MARKER ".moetrain-checkpoints"  /* in checkpoint.dir: moetrain writes here */
#define CK_FORMAT_MANIFEST "moetrain checkpoint manifest"
#define CK_FORMAT_RANK "moetrain checkpoint rank file"
#define CK_ERR_CAP 1024

/* the three shard buffers saved, in this order: p->g[k].master, .m1, .m2 */
enum { CK_MASTER, CK_ADAM_M, CK_ADAM_V, CK_N_BUFS };
extern const char *const ck_buf_group[CK_N_BUFS];   /* "master", "adam_m", "adam_v" */

/* --- HDF5 --------------------------------------------------------------------------------- */

/* Turns off HDF5's own error printing (errors become our one-line messages); idempotent. */
void ck_h5_init(void);
/* "api message: innermost message" of HDF5's current error stack (call right after a failure). */
void ck_h5_message(char *buf, size_t cap);
/* The file named in fatal HDF5 errors (NULL = none). */
void ck_h5_context(const char *path);
/* Checked call for failures that mean something broke (not a bad checkpoint): names the call,
 * file:line, rank, the file in context and HDF5's message, then mt_fatal. Returns the value. */
int64_t ck_h5_check(int64_t rc, const char *call, const char *file, int line);
#define CK_H5(call) ck_h5_check((int64_t)(call), #call, __FILE__, __LINE__)

/* File access properties: no file locking (it fails on some parallel filesystems and every
 * writer owns its file), and the caller closes them. */
hid_t ck_fapl(void);

/* Writers (fatal on failure). */
void ck_write_attr_i64(hid_t obj, const char *name, const int64_t *v, int n);
void ck_write_attr_str(hid_t obj, const char *name, const char *s);
void ck_write_string_dataset(hid_t loc, const char *name, const char *s, size_t len);

/* fp32 data of a dataset of rank 1 or 3 (dims: its shape), seen flattened: moves n elements
 * between buf (contiguous) and the flattened positions [start, start + n), as row hyperslabs.
 * False when H5Dread / H5Dwrite fails, with HDF5's reason in msg. */
bool ck_flat_io(hid_t dset, int ndim, const hsize_t *dims, int64_t start, int64_t n, float *buf,
                bool write, char *msg, size_t msgcap);

/* Readers for files that may be bad: false with "what: problem" in err. */
/* H5Fopen read-only with HDF5's reason in err on failure ("path: cannot open what ..."). */
hid_t ck_open_ro(const char *path, const char *what, char *err, int cap);
bool ck_link_exists(hid_t loc, const char *name);
/* n_out NULL: the attribute must hold exactly n integers; else up to n, the count in *n_out. */
bool ck_read_attr_i64(hid_t obj, const char *name, int64_t *v, int n, int *n_out, const char *what,
                      char *err, int cap);
bool ck_read_attr_str(hid_t obj, const char *name, char *s, size_t cap_s, const char *what,
                      char *err, int cap);

/* --- shard runs (params_for_each_run_of), grouped by tensor (checkpoint_index.c) ---------- */

struct ck_run {
    int64_t gidx, soff, len;   /* global flat element, shard offset, elements */
};
struct ck_runs {
    struct ck_run *r;
    int n, cap;
};
/* params_run_fn appending to ((struct ck_runs *)ctx)[tensor] */
void ck_collect_run(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len);

/* --- messages and paths ------------------------------------------------------------------ */

/* Writes the message into err unless it already holds one (the first problem is reported);
 * returns false, for `return ck_errf(...)`. */
bool ck_errf(char *err, int cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* snprintf for paths: mt_fatal when it does not fit */
void ck_path(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* --- the collective error agreement ------------------------------------------------------- */

/* Every rank passes its own error (empty = fine). True on every rank when no rank failed;
 * otherwise false on every rank, err holding the message of the lowest failing rank. */
bool ck_agree(const struct mesh *mesh, char *err, int cap);
bool ck_use_mpi(const struct mesh *mesh);

/* --- paths and files ---------------------------------------------------------------------- */

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

/* --- the manifest (checkpoint_manifest.c) ------------------------------------------------- */

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

/* --- the index of an old checkpoint's rank files (checkpoint_index.c) --------------------- */

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
