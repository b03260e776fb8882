/* Private to the checkpoint files: the HDF5 layer (checked calls, attributes, error text), the
 * collective error agreement, and the names of a rank file's buffers (checkpoint_h5.c). The
 * lowest of them: it uses no other checkpoint file.
 *
 * The checkpoint files, each using only those listed after it:
 *   checkpoint.c (save), checkpoint_load.c (load, export reader)   checkpoint.h: the public face
 *   checkpoint_index.c     shard runs, phase 2 of a load: indexing the old rank files
 *   checkpoint_manifest.c  writing the manifest, phase 1 of a load: reading and checking it
 *   checkpoint_fs.c        directories, fsync, newest / cleanup of checkpoints, the file names
 *   checkpoint_h5.c        HDF5 helpers, error messages, the collective agreement */
#ifndef MT_CKPT_H5_H
#define MT_CKPT_H5_H

#include <hdf5.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mesh.h"

#define CK_ERR_CAP 1024

/* the three shard buffers saved, in this order: p->g[k].master, .m1, .m2 */
enum { CK_MASTER, CK_ADAM_M, CK_ADAM_V, CK_N_BUFS };
extern const char *const ck_buf_group[CK_N_BUFS];   /* "master", "adam_m", "adam_v" */

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

/* Writes the message into err unless it already holds one (the first problem is reported);
 * returns false, for `return ck_errf(...)`. */
bool ck_errf(char *err, int cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Every rank passes its own error (empty = fine). True on every rank when no rank failed;
 * otherwise false on every rank, err holding the message of the lowest failing rank. */
bool ck_agree(const struct mesh *mesh, char *err, int cap);
bool ck_use_mpi(const struct mesh *mesh);

#endif
