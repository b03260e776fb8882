/* The tensor pieces of rank files, and phase 2 of a load (checkpoint_load.c): every dataset of
 * every old rank file is one piece, whose slice attributes are read and checked against the
 * tensor table (shape, dtype, range, the same slice in master, adam_m and adam_v) by one rank per
 * file, and the index of all pieces is then all-gathered. Also the runs of a rank's own shard,
 * grouped by tensor (ck_collect_run), which the save and the load both start from. Separate from
 * checkpoint_load.c because every check of an old file's structure happens here, before any data
 * is read. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint_index.h"
#include "checkpoint_fs.h"
#include "checkpoint_h5.h"
#include "common.h"

/* --- the runs of a rank's shard (save and load) -------------------------------------------- */

void ck_collect_run(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len)
{
    (void)g;
    struct ck_runs *rs = (struct ck_runs *)ctx + i;
    if (rs->n == rs->cap) rs->r = mt_realloc(rs->r, (size_t)(rs->cap = rs->cap ? 2 * rs->cap : 4) * sizeof *rs->r);
    rs->r[rs->n++] = (struct ck_run){gidx, soff, len};
}

/* --- the index of the old rank files (phase 2 of a load) ----------------------------------- */

static void fmt_shape(char *buf, size_t cap, const int64_t *v, int n)
{
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int j = 0; j < n && k < cap; j++) k += (size_t)snprintf(buf + k, cap - k, "%s%lld", j ? ", " : "", (long long)v[j]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

struct name_slot {
    const char *name;
    int i;
};

static int cmp_slot(const void *a, const void *b)
{
    return strcmp(((const struct name_slot *)a)->name, ((const struct name_slot *)b)->name);
}

static int lookup(const struct name_slot *by_name, int n, const char *name)
{
    struct name_slot key = {name, -1};
    const struct name_slot *hit = bsearch(&key, by_name, (size_t)n, sizeof key, cmp_slot);
    return hit ? hit->i : -1;
}

static void push_piece(struct ck_pieces *ps, const struct ck_piece *pc)
{
    if (ps->n == ps->cap) ps->v = mt_realloc(ps->v, (size_t)(ps->cap = ps->cap ? 2 * ps->cap : 64) * sizeof *ps->v);
    ps->v[ps->n++] = *pc;
}

/* Reads and checks the slice attributes of dataset grp/name of old rank file `file`. */
static bool read_piece(hid_t grp, const char *gname, const char *name, const char *path, int file,
                       const struct tensor_table *tt, const struct name_slot *by_name, struct ck_piece *pc,
                       char *err, int cap)
{
    char what[MT_PATH_MAX * 2 + 256];
    snprintf(what, sizeof what, "%s: dataset %s/%s", path, gname, name);
    const int i = lookup(by_name, tt->n, name);
    if (i < 0) return ck_errf(err, cap, "%s is not a tensor of the configured model", what);
    const struct tensor_spec *s = &tt->t[i];
    hid_t d = H5Dopen2(grp, name, H5P_DEFAULT);
    if (d < 0) return ck_errf(err, cap, "%s cannot be opened", what);
    memset(pc, 0, sizeof *pc);
    pc->file = file;
    pc->tensor = i;
    int64_t shape[3] = {0, 0, 0};
    int nshape = 0;
    char a[64], b[64];
    bool ok = ck_read_attr_i64(d, "global_shape", shape, 3, &nshape, what, err, cap);
    if (ok && (nshape != s->ndim || memcmp(shape, s->shape, (size_t)nshape * sizeof(int64_t)) != 0)) {
        fmt_shape(a, sizeof a, shape, nshape);
        fmt_shape(b, sizeof b, s->shape, s->ndim);
        ok = ck_errf(err, cap, "%s has global shape %s, the model has %s", what, a, b);
    }
    hid_t t = CK_H5(H5Dget_type(d)), sp = CK_H5(H5Dget_space(d));
    if (ok && !(H5Tget_class(t) == H5T_FLOAT && H5Tget_size(t) == 4)) ok = ck_errf(err, cap, "%s is not fp32", what);
    int nd = H5Sget_simple_extent_ndims(sp);
    hsize_t dims[3] = {0, 0, 0};
    if (nd >= 1 && nd <= 3) CK_H5(H5Sget_simple_extent_dims(sp, dims, NULL));
    int64_t want[3] = {0, 0, 0};
    int want_nd = 0;
    if (ok && s->kind == TK_EXPERT) {
        int64_t ex[2], rows[2];
        ok = ck_read_attr_i64(d, "experts", ex, 2, NULL, what, err, cap) &&
             ck_read_attr_i64(d, "rows", rows, 2, NULL, what, err, cap);
        if (ok && !(0 <= ex[0] && ex[0] < ex[1] && ex[1] <= s->shape[0] && 0 <= rows[0] &&
                    rows[0] < rows[1] && rows[1] <= s->shape[1]))
            ok = ck_errf(err, cap, "%s holds experts [%lld, %lld) rows [%lld, %lld), outside its global shape",
                       what, (long long)ex[0], (long long)ex[1], (long long)rows[0], (long long)rows[1]);
        pc->e0 = ex[0], pc->e1 = ex[1], pc->r0 = rows[0], pc->r1 = rows[1];
        want_nd = 3;
        want[0] = ex[1] - ex[0], want[1] = rows[1] - rows[0], want[2] = s->shape[2];
    } else if (ok) {
        int64_t range[2];
        ok = ck_read_attr_i64(d, "range", range, 2, NULL, what, err, cap);
        if (ok && !(0 <= range[0] && range[0] < range[1] && range[1] <= s->numel))
            ok = ck_errf(err, cap, "%s holds elements [%lld, %lld), outside its %lld elements", what,
                       (long long)range[0], (long long)range[1], (long long)s->numel);
        pc->a = range[0], pc->b = range[1];
        want_nd = 1;
        want[0] = range[1] - range[0];
    }
    if (ok) {
        bool same = nd == want_nd;
        for (int j = 0; j < want_nd && same; j++) same = (int64_t)dims[j] == want[j];
        if (!same) {
            int64_t got[3] = {(int64_t)dims[0], (int64_t)dims[1], (int64_t)dims[2]};
            fmt_shape(a, sizeof a, got, nd > 0 && nd <= 3 ? nd : 0);
            fmt_shape(b, sizeof b, want, want_nd);
            ok = ck_errf(err, cap, "%s has shape %s, its slice attributes say %s", what, a, b);
        }
    }
    CK_H5(H5Tclose(t));
    CK_H5(H5Sclose(sp));
    CK_H5(H5Dclose(d));
    return ok;
}

static bool index_file(const char *dir, int file, const struct ck_manifest *man, const struct tensor_table *tt,
                       const struct name_slot *by_name, struct ck_pieces *out, char *err, int cap)
{
    char path[MT_PATH_MAX * 2];
    ck_rank_file(path, sizeof path, dir, file);
    if (!ck_file_exists(path))
        return ck_errf(err, cap, "checkpoint %s: rank file %s is missing (the checkpoint was written by %lld ranks)",
                     dir, strrchr(path, '/') + 1, (long long)man->world);
    hid_t f = ck_open_ro(path, "the rank file", err, cap);
    if (f < 0) return false;
    char fmt[64];
    int64_t rank = -1, step = -1;
    bool ok = ck_read_attr_str(f, "format", fmt, sizeof fmt, path, err, cap) &&
              ck_read_attr_i64(f, "rank", &rank, 1, NULL, path, err, cap) &&
              ck_read_attr_i64(f, "step", &step, 1, NULL, path, err, cap);
    if (ok && strcmp(fmt, CK_FORMAT_RANK) != 0) ok = ck_errf(err, cap, "%s: not a moetrain checkpoint rank file", path);
    if (ok && (rank != file || step != man->step))
        ok = ck_errf(err, cap, "%s: holds rank %lld of step %lld, the manifest expects rank %d of step %lld "
                   "(files of different checkpoints mixed?)", path, (long long)rank, (long long)step, file,
                   (long long)man->step);
    hid_t grp[CK_N_BUFS] = {-1, -1, -1};
    for (int b = 0; b < CK_N_BUFS && ok; b++) {
        if (!ck_link_exists(f, ck_buf_group[b])) ok = ck_errf(err, cap, "%s: group '%s' is missing", path, ck_buf_group[b]);
        else grp[b] = CK_H5(H5Gopen2(f, ck_buf_group[b], H5P_DEFAULT));
    }
    H5G_info_t info[CK_N_BUFS];
    for (int b = 0; b < CK_N_BUFS && ok; b++) CK_H5(H5Gget_info(grp[b], &info[b]));
    for (hsize_t j = 0; ok && j < info[CK_MASTER].nlinks; j++) {
        char name[256];
        ssize_t len = H5Lget_name_by_idx(grp[CK_MASTER], ".", H5_INDEX_NAME, H5_ITER_INC, j, name, sizeof name,
                                         H5P_DEFAULT);
        if (len < 0 || len >= (ssize_t)sizeof name) {
            ok = ck_errf(err, cap, "%s: cannot read the name of dataset %llu of group master", path, (unsigned long long)j);
            break;
        }
        struct ck_piece pc, other;
        ok = read_piece(grp[CK_MASTER], "master", name, path, file, tt, by_name, &pc, err, cap);
        for (int b = 1; b < CK_N_BUFS && ok; b++) {
            if (!ck_link_exists(grp[b], name)) {
                ok = ck_errf(err, cap, "%s: dataset %s/%s is missing (master has it)", path, ck_buf_group[b], name);
                break;
            }
            ok = read_piece(grp[b], ck_buf_group[b], name, path, file, tt, by_name, &other, err, cap);
            if (ok && memcmp(&pc, &other, sizeof pc) != 0)
                ok = ck_errf(err, cap, "%s: dataset %s/%s holds another slice than master/%s", path,
                           ck_buf_group[b], name, name);
        }
        if (ok) push_piece(out, &pc);
    }
    for (int b = 1; b < CK_N_BUFS && ok; b++)
        if (info[b].nlinks != info[CK_MASTER].nlinks)
            ok = ck_errf(err, cap, "%s: group %s holds %llu datasets, master %llu (a dataset of master is missing)",
                       path, ck_buf_group[b], (unsigned long long)info[b].nlinks,
                       (unsigned long long)info[CK_MASTER].nlinks);
    for (int b = 0; b < CK_N_BUFS; b++)
        if (grp[b] >= 0) CK_H5(H5Gclose(grp[b]));
    CK_H5(H5Fclose(f));
    return ok;
}

/* Every rank indexes old files rank, rank + W, ...; the pieces are then all-gathered. */
bool ck_build_index(const char *dir, const struct ck_manifest *man, const struct tensor_table *tt,
                    const struct mesh *mesh, struct ck_pieces *all, char *err, int cap)
{
    struct name_slot *by_name = mt_malloc((size_t)MT_MAX(tt->n, 1) * sizeof *by_name);
    for (int i = 0; i < tt->n; i++) by_name[i] = (struct name_slot){tt->t[i].name, i};
    qsort(by_name, (size_t)tt->n, sizeof *by_name, cmp_slot);
    struct ck_pieces mine = {0};
    const int W = ck_use_mpi(mesh) ? mesh->d.world : 1, me = ck_use_mpi(mesh) ? mesh->rank : 0;
    for (int64_t file = me; file < man->world && !err[0]; file += W)
        index_file(dir, (int)file, man, tt, by_name, &mine, err, cap);
    free(by_name);
    if (!ck_agree(mesh, err, cap)) {
        free(mine.v);
        return false;
    }
    if (!ck_use_mpi(mesh)) {
        *all = mine;
        return true;
    }
    int *counts = mt_malloc((size_t)W * sizeof(int)), *displs = mt_malloc((size_t)W * sizeof(int));
    int n_ints = mine.n * CK_PIECE_INTS;
    MT_CHECK_MPI(MPI_Allgather(&n_ints, 1, MPI_INT, counts, 1, MPI_INT, mesh->world_comm));
    int64_t total = 0;
    for (int r = 0; r < W; r++) {
        displs[r] = (int)total;
        total += counts[r];
    }
    MT_CHECK(total <= INT32_MAX, "checkpoint %s: the piece index is too large to gather", dir);
    all->n = all->cap = (int)(total / CK_PIECE_INTS);
    all->v = mt_malloc((size_t)MT_MAX(all->n, 1) * sizeof *all->v);
    int64_t none[CK_PIECE_INTS];
    MT_CHECK_MPI(MPI_Allgatherv(mine.v ? (void *)mine.v : (void *)none, n_ints, MPI_INT64_T, all->v,
                                counts, displs, MPI_INT64_T, mesh->world_comm));
    free(mine.v);
    free(counts);
    free(displs);
    return true;
}
