/* Saving a checkpoint (checkpoint.h; format in docs/checkpoints.md): every rank writes its shard
 * pieces to its own HDF5 file in ROOT/step_N.tmp, rank 0 adds the manifest (checkpoint_manifest.c),
 * renames the directory and marks it COMPLETE. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "checkpoint_h5.h"
#include "checkpoint_index.h"
#include "common.h"

/* Elements per HDF5 chunk (1 MiB of fp32): each chunk carries a Fletcher-32 checksum, so a
 * corrupted file is an error on read rather than silently wrong weights. */
#define CK_CHUNK_ELEMS (1 << 18)

/* --- one rank's file ----------------------------------------------------------------------- */

static int cmp_run(const void *a, const void *b)
{
    int64_t x = ((const struct ck_run *)a)->gidx, y = ((const struct ck_run *)b)->gidx;
    return (x > y) - (x < y);
}

/* The piece of one tensor a rank holds, from its runs: a flat range [a, b) for non-expert
 * tensors; experts [e0, e1) x rows [r0, r1) x all of dim 2 for expert tensors. Also where each
 * run lands in the dataset, flattened (file_at). */
struct piece_shape {
    int ndim;
    hsize_t dims[3];
    int64_t a, b, e0, e1, r0, r1;
};

static void shape_piece(const struct tensor_spec *s, struct ck_runs *rs, struct piece_shape *ps,
                        int64_t *file_at)
{
    qsort(rs->r, (size_t)rs->n, sizeof *rs->r, cmp_run);
    memset(ps, 0, sizeof *ps);
    if (s->kind != TK_EXPERT) {
        ps->ndim = 1;
        ps->a = rs->r[0].gidx;
        for (int j = 0; j < rs->n; j++) {
            MT_CHECK(rs->r[j].gidx == (j ? rs->r[j - 1].gidx + rs->r[j - 1].len : ps->a),
                     "checkpoint: the shard of %s is not one flat range", s->name);
            file_at[j] = rs->r[j].gidx - ps->a;
        }
        ps->b = rs->r[rs->n - 1].gidx + rs->r[rs->n - 1].len;
        ps->dims[0] = (hsize_t)(ps->b - ps->a);
        return;
    }
    const int64_t d1 = s->shape[1], d2 = s->shape[2];
    ps->ndim = 3;
    ps->e0 = rs->r[0].gidx / (d1 * d2);
    ps->r0 = rs->r[0].gidx % (d1 * d2) / d2;
    ps->r1 = ps->r0 + rs->r[0].len / d2;
    ps->e1 = ps->e0 + rs->n;
    for (int j = 0; j < rs->n; j++) {
        MT_CHECK(rs->r[j].gidx == ((ps->e0 + j) * d1 + ps->r0) * d2 && rs->r[j].len == (ps->r1 - ps->r0) * d2,
                 "checkpoint: the shard of %s is not a block of experts x rows", s->name);
        file_at[j] = j * (ps->r1 - ps->r0) * d2;
    }
    ps->dims[0] = (hsize_t)(ps->e1 - ps->e0);
    ps->dims[1] = (hsize_t)(ps->r1 - ps->r0);
    ps->dims[2] = (hsize_t)d2;
}

static hid_t chunked_dcpl(const struct piece_shape *ps)
{
    hid_t dcpl = CK_H5(H5Pcreate(H5P_DATASET_CREATE));
    hsize_t chunk[3];
    if (ps->ndim == 1) {
        chunk[0] = MT_MIN(ps->dims[0], (hsize_t)CK_CHUNK_ELEMS);
    } else {
        chunk[0] = 1;
        chunk[1] = MT_MAX((hsize_t)1, MT_MIN(ps->dims[1], (hsize_t)CK_CHUNK_ELEMS / ps->dims[2]));
        chunk[2] = ps->dims[2];
    }
    CK_H5(H5Pset_chunk(dcpl, ps->ndim, chunk));
    CK_H5(H5Pset_fletcher32(dcpl));
    return dcpl;
}

static void write_piece(hid_t grp, const struct tensor_spec *s, const struct piece_shape *ps,
                        const struct ck_runs *rs, const int64_t *file_at, const float *host)
{
    hid_t sp = CK_H5(H5Screate_simple(ps->ndim, ps->dims, NULL));
    hid_t dcpl = chunked_dcpl(ps);
    hid_t d = CK_H5(H5Dcreate2(grp, s->name, H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT));
    ck_write_attr_i64(d, "global_shape", s->shape, s->ndim);
    if (ps->ndim == 1) {
        int64_t range[2] = {ps->a, ps->b};
        ck_write_attr_i64(d, "range", range, 2);
    } else {
        int64_t ex[2] = {ps->e0, ps->e1}, rows[2] = {ps->r0, ps->r1};
        ck_write_attr_i64(d, "experts", ex, 2);
        ck_write_attr_i64(d, "rows", rows, 2);
    }
    for (int j = 0; j < rs->n; j++) {
        char msg[512];
        /* the buffer is only read from on a write */
        if (!ck_flat_io(d, ps->ndim, ps->dims, file_at[j], rs->r[j].len, (float *)host + rs->r[j].soff,
                        true, msg, sizeof msg))
            mt_fatal("H5Dwrite of %s failed: %s%s", s->name, msg,
                     errno == ENOSPC || errno == EFBIG || errno == EDQUOT
                         ? " (out of disk space or quota: the unfinished save is ignored, earlier "
                           "checkpoints are untouched)" : "");
    }
    CK_H5(H5Dclose(d));
    CK_H5(H5Pclose(dcpl));
    CK_H5(H5Sclose(sp));
}

/* The first non-finite value of n floats, or -1. */
static int64_t first_nonfinite(const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return i;
    return -1;
}

/* One buffer at a time (master, then m1, then m2), so the host copy is one shard's worth. A
 * non-finite value stops the file there (err set): such a checkpoint is never published. */
static void write_rank_file(const char *path, int step, const struct params *p, const struct mesh *mesh,
                            char *err, int errcap)
{
    const struct model *m = p->m;
    const struct tensor_table *tt = &m->tt;
    struct ck_runs *rs = mt_calloc((size_t)tt->n, sizeof *rs);
    params_for_each_run_of(p, p->S_rank, p->F_rank, m->expert0, ck_collect_run, rs);
    struct piece_shape *ps = mt_calloc((size_t)tt->n, sizeof *ps);
    int64_t **file_at = mt_calloc((size_t)tt->n, sizeof *file_at);
    /* a stage writes only its own tensors (not the tied embedding the last stage keeps too), so
     * every element of the model is in exactly one piece per EP_FSDP position */
    for (int i = 0; i < tt->n; i++) {
        if (!mesh_stage_owns(mesh, &tt->t[i])) rs[i].n = 0;
        if (rs[i].n == 0) continue;
        file_at[i] = mt_malloc((size_t)rs[i].n * sizeof(int64_t));
        shape_piece(&tt->t[i], &rs[i], &ps[i], file_at[i]);
    }

    ck_h5_context(path);
    hid_t fapl = ck_fapl();
    hid_t f = CK_H5(H5Fcreate(path, H5F_ACC_EXCL, H5P_DEFAULT, fapl));
    ck_write_attr_str(f, "format", CK_FORMAT_RANK);
    int64_t meta[] = {CKPT_FORMAT_VERSION, mesh->rank, mesh->d.world, step, p->step};
    const char *meta_names[] = {"format_version", "rank", "world", "step", "optimizer_step"};
    for (size_t j = 0; j < sizeof meta / sizeof meta[0]; j++) ck_write_attr_i64(f, meta_names[j], &meta[j], 1);
    for (int b = 0; b < CK_N_BUFS; b++) {
        float *host[TG_COUNT];
        for (int k = 0; k < TG_COUNT; k++) {
            const struct param_group_shard *g = &p->g[k];
            host[k] = mt_malloc((size_t)MT_MAX(g->numel, 1) * sizeof(float));
            if (b == CK_MASTER) params_master_read(p, (enum tensor_group)k, 0, g->numel, host[k]);
            else params_moment_to_host(p, (enum tensor_group)k, b == CK_ADAM_M ? 1 : 2, host[k]);
            int64_t at = first_nonfinite(host[k], g->numel);
            if (at >= 0)
                ck_errf(err, errcap, "checkpoint of step %d not written: rank %d's %s holds a non-finite "
                        "value (shard element %lld of group %d); the previous checkpoints are kept",
                        step, mesh->rank, ck_buf_group[b], (long long)at, k);
        }
        if (*err) {
            for (int k = 0; k < TG_COUNT; k++) free(host[k]);
            break;
        }
        hid_t grp = CK_H5(H5Gcreate2(f, ck_buf_group[b], H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
        for (int i = 0; i < tt->n; i++)
            if (rs[i].n > 0)
                write_piece(grp, &tt->t[i], &ps[i], &rs[i], file_at[i], host[tensor_group_of(&tt->t[i])]);
        CK_H5(H5Gclose(grp));
        for (int k = 0; k < TG_COUNT; k++) free(host[k]);
    }
    CK_H5(H5Fflush(f, H5F_SCOPE_GLOBAL));
    CK_H5(H5Fclose(f));
    CK_H5(H5Pclose(fapl));
    ck_h5_context(NULL);
    if (!ck_fsync_path(path)) mt_fatal("fsync(%s): %s", path, strerror(errno));
    for (int i = 0; i < tt->n; i++) {
        free(rs[i].r);
        free(file_at[i]);
    }
    free(rs);
    free(ps);
    free(file_at);
}

/* --- the directory dance ------------------------------------------------------------------- */

static void fsync_or_die(const char *path)
{
    if (!ck_fsync_path(path)) mt_fatal("fsync(%s): %s", path, strerror(errno));
}

/* Rank 0: a fresh, empty ROOT/step_N.tmp (a leftover of a crashed save is removed). A step_N that
 * exists but is not a moetrain checkpoint is never replaced. */
static void prepare_tmp(const char *root, const char *tmp, const char *fin, char *err, int cap)
{
    struct stat st;
    int64_t seq;
    if (lstat(fin, &st) == 0 && !ck_manifest_identity(fin, &seq)) {
        ck_errf(err, cap, "checkpoint.dir '%s': %s exists and is not a moetrain checkpoint; not replacing "
                "it (move it away)", root, fin);
        return;
    }
    if (!ck_mkdir_p(root)) {
        ck_errf(err, cap, "checkpoint.dir '%s': cannot create the directory: %s", root, strerror(errno));
        return;
    }
    if (lstat(tmp, &st) == 0 && !ck_holds_only_checkpoint_files(tmp)) {
        ck_errf(err, cap, "checkpoint.dir '%s': %s holds files moetrain did not write; not removing it "
                "(move it away)", root, tmp);
        return;
    }
    if (!ck_remove_tree(tmp)) {
        ck_errf(err, cap, "checkpoint.dir '%s': cannot remove the stale %s: %s", root, tmp, strerror(errno));
        return;
    }
    if (mkdir(tmp, 0777) != 0)
        ck_errf(err, cap, "checkpoint.dir '%s': cannot create %s: %s", root, tmp, strerror(errno));
}

/* Rank 0, every rank file written: manifest, rename to the final name, COMPLETE. */
static void publish(const char *root, const char *tmp, const char *fin, int step, const struct params *p,
                    const struct mesh *mesh, const struct config *c, const float *bias)
{
    char path[MT_PATH_MAX * 2];
    ck_path(path, sizeof path, "%s/%s", tmp, CK_MANIFEST);
    ck_write_manifest(path, step, p, mesh, c, bias, ck_next_save_seq(root));
    fsync_or_die(tmp);
    /* saving a step that exists (a run resumed before it): the old copy steps aside first, so
     * there is never a moment with two directories of this step */
    char old[MT_PATH_MAX * 2];
    ck_path(old, sizeof old, "%s.replaced.tmp", fin);
    bool replaced = false;
    if (rename(fin, old) == 0) replaced = true;
    else if (errno != ENOENT) mt_fatal("rename(%s, %s): %s", fin, old, strerror(errno));
    if (rename(tmp, fin) != 0) mt_fatal("rename(%s, %s): %s", tmp, fin, strerror(errno));
    fsync_or_die(root);
    ck_path(path, sizeof path, "%s/%s", fin, CK_COMPLETE);
    FILE *f = fopen(path, "w");
    if (!f) mt_fatal("fopen(%s): %s", path, strerror(errno));
    if (fprintf(f, "moetrain checkpoint of step %d, %d rank files\n", step, mesh->d.world) < 0 ||
        fflush(f) != 0)
        mt_fatal("writing %s: %s", path, strerror(errno));
    if (fclose(f) != 0) mt_fatal("fclose(%s): %s", path, strerror(errno));
    fsync_or_die(path);
    fsync_or_die(fin);
    if (replaced && !ck_remove_tree(old)) mt_warn0("checkpoint: cannot remove %s: %s\n", old, strerror(errno));
}

void ckpt_save(const char *root, int step, const struct params *p, const struct mesh *mesh,
               const struct config *c, const float *bias_host)
{
    ck_h5_init();
    const double t0 = mt_now();
    char tmp[MT_PATH_MAX * 2], fin[MT_PATH_MAX * 2], err[CK_ERR_CAP] = "";
    ck_step_dir(tmp, sizeof tmp, root, step, true);
    ck_step_dir(fin, sizeof fin, root, step, false);
    if (mesh->rank == 0) prepare_tmp(root, tmp, fin, err, sizeof err);
    if (!ck_agree(mesh, err, sizeof err) || !ck_every_rank_sees(mesh, tmp, "checkpoint directory", err, sizeof err))
        mt_user_error("%s", err);

    char path[MT_PATH_MAX * 2];
    ck_rank_file(path, sizeof path, tmp, mesh->rank);
    write_rank_file(path, step, p, mesh, err, sizeof err);
    if (mesh->rank == 0 && bias_host) {
        const int64_t nb = (int64_t)c->model.num_hidden_layers * c->model.num_experts;
        if (first_nonfinite(bias_host, nb) >= 0)
            ck_errf(err, sizeof err, "checkpoint of step %d not written: the balancing bias holds a "
                    "non-finite value; the previous checkpoints are kept", step);
    }
    if (!ck_agree(mesh, err, sizeof err)) {
        if (mesh->rank == 0 && !ck_remove_tree(tmp))
            mt_warn0("checkpoint: cannot remove %s: %s\n", tmp, strerror(errno));
        mt_user_error("%s", err);
    }

    if (mesh->rank == 0) {
        publish(root, tmp, fin, step, p, mesh, c, bias_host);
        ck_cleanup(root, c->checkpoint.keep, step);
    }
    /* on return the checkpoint is complete for every rank */
    if (ck_use_mpi(mesh)) MT_CHECK_MPI(MPI_Barrier(mesh->world_comm));
    mt_log0("checkpoint: step %d saved to %s (%.2f s)\n", step, fin, mt_now() - t0);
}
