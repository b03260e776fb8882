/* Loading a checkpoint onto any mesh (checkpoint.h). Three collective phases, each ending in an
 * agreement so that a bad checkpoint is one message and a non-zero exit on every rank, never a
 * hang:
 *   1. rank 0 checks the directory (COMPLETE marker) and the manifest (format, version, model
 *      shape) and broadcasts what it read;
 *   2. the old rank files are indexed, each by one rank (the slice attributes of every dataset,
 *      checked against the tensor table), and the index is all-gathered;
 *   3. each rank lists the runs of its own new shard (params_for_each_run_of), intersects them
 *      with the pieces of the index and reads the overlaps with hyperslab reads; one buffer at a
 *      time (master, m1, m2), each copied into p once every rank has read it.
 * Every check of files, names, slices and shapes happens before p changes; only a read error
 * (a checksum mismatch) in m1 or m2 can leave p's masters already replaced. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "checkpoint_internal.h"
#include "common.h"

struct manifest {               /* all int64 so that it travels as bytes */
    int64_t version, step, opt_step, data_pos, world, pp, ep, ep_fsdp, ep_outside, S;
    int64_t has_bias, bias_L, bias_E;
};

/* One tensor piece of one old rank file: a flat range [a, b) of a non-expert tensor, or experts
 * [e0, e1) x rows [r0, r1) (x all of dim 2) of an expert tensor. */
struct piece {
    int64_t file, tensor, a, b, e0, e1, r0, r1;
};
#define PIECE_INTS 8

static void fmt_shape(char *buf, size_t cap, const int64_t *v, int n)
{
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int j = 0; j < n && k < cap; j++) k += (size_t)snprintf(buf + k, cap - k, "%s%lld", j ? ", " : "", (long long)v[j]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

/* H5Fopen read-only with HDF5's reason in err on failure. */
static hid_t open_ro(const char *path, const char *what, char *err, int cap)
{
    hid_t fapl = ck_fapl();
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, fapl);
    if (f < 0) {
        char m[512];
        ck_h5_message(m, sizeof m);
        ck_errf(err, cap, "%s: cannot open %s (truncated or not an HDF5 file?): %s", path, what, m);
    }
    CK_H5(H5Pclose(fapl));
    return f;
}

static bool link_exists(hid_t loc, const char *name)
{
    htri_t ex = H5Lexists(loc, name, H5P_DEFAULT);
    return ex > 0;
}

/* --- phase 1: the manifest (rank 0) -------------------------------------------------------- */

static bool check_model(hid_t f, const char *path, const struct config *c, char *err, int cap)
{
    if (!link_exists(f, "model")) return ck_errf(err, cap, "%s: group 'model' is missing", path);
    hid_t g = CK_H5(H5Gopen2(f, "model", H5P_DEFAULT));
    char what[MT_PATH_MAX * 2 + 16];
    snprintf(what, sizeof what, "%s: model", path);
    struct ck_field fields[CK_MAX_FIELDS];
    int nf = ck_model_fields(&c->model, fields);
    bool ok = true;
    for (int j = 0; j < nf && ok; j++) {
        if (!fields[j].relevant) continue;
        int64_t v = 0;
        ok = ck_read_attr_i64(g, fields[j].name, &v, 1, NULL, what, err, cap);
        if (ok && v != fields[j].value)
            ok = ck_errf(err, cap, "%s: the checkpoint was saved with model.%s = %lld, the config has %lld "
                       "(the model shape must match; the mesh may differ)", path, fields[j].name,
                       (long long)v, (long long)fields[j].value);
    }
    const int L = c->model.num_hidden_layers;
    int64_t *moe = mt_malloc((size_t)L * sizeof(int64_t));
    if (ok) ok = ck_read_attr_i64(g, "moe_layers", moe, L, NULL, what, err, cap);
    for (int l = 0; l < L && ok; l++)
        if ((moe[l] != 0) != config_layer_is_moe(&c->model, l))
            ok = ck_errf(err, cap, "%s: layer %d is %s in the checkpoint and %s in the config "
                       "(model.decoder_sparse_step / mlp_only_layers must match)", path, l,
                       moe[l] ? "MoE" : "dense", moe[l] ? "dense" : "MoE");
    free(moe);
    CK_H5(H5Gclose(g));
    return ok;
}

static bool read_bias(hid_t f, const char *path, struct manifest *man, float **bias, char *err, int cap)
{
    if (!link_exists(f, "balance_bias")) return true;
    hid_t d = H5Dopen2(f, "balance_bias", H5P_DEFAULT);
    if (d < 0) return ck_errf(err, cap, "%s: cannot open dataset balance_bias", path);
    hid_t sp = CK_H5(H5Dget_space(d));
    hsize_t dims[2] = {0, 0};
    bool ok = H5Sget_simple_extent_ndims(sp) == 2;
    if (ok) CK_H5(H5Sget_simple_extent_dims(sp, dims, NULL));
    ok = ok && dims[0] > 0 && dims[1] > 0 && dims[0] * dims[1] < ((hsize_t)1 << 31);
    if (!ok) ck_errf(err, cap, "%s: dataset balance_bias is not an [L, E] matrix", path);
    if (ok) {
        *bias = mt_malloc((size_t)(dims[0] * dims[1]) * sizeof(float));
        if (H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, *bias) < 0) {
            char m[512];
            ck_h5_message(m, sizeof m);
            ok = ck_errf(err, cap, "%s: cannot read balance_bias: %s", path, m);
        }
        man->has_bias = 1;
        man->bias_L = (int64_t)dims[0];
        man->bias_E = (int64_t)dims[1];
    }
    CK_H5(H5Sclose(sp));
    CK_H5(H5Dclose(d));
    return ok;
}

static bool read_manifest(const char *dir, const struct config *c, struct manifest *man, float **bias,
                          char *err, int cap)
{
    memset(man, 0, sizeof *man);
    char path[MT_PATH_MAX * 2];
    struct stat st;
    if (stat(dir, &st) != 0) return ck_errf(err, cap, "checkpoint %s: %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return ck_errf(err, cap, "checkpoint %s: not a directory", dir);
    ck_path(path, sizeof path, "%s/%s", dir, CK_MANIFEST);
    if (!ck_file_exists(path)) {
        char newest[MT_PATH_MAX * 2];
        if (ckpt_latest(dir, newest, (int)sizeof newest) >= 0)
            return ck_errf(err, cap, "%s is a checkpoint root, not a checkpoint (no %s); its newest "
                         "checkpoint is %s (--resume auto picks it)", dir, CK_MANIFEST, newest);
        return ck_errf(err, cap, "%s is not a checkpoint directory (no %s)", dir, CK_MANIFEST);
    }
    char marker[MT_PATH_MAX * 2];
    ck_path(marker, sizeof marker, "%s/%s", dir, CK_COMPLETE);
    if (!ck_file_exists(marker))
        return ck_errf(err, cap, "checkpoint %s is incomplete (no %s marker): its save did not finish", dir, CK_COMPLETE);

    hid_t f = open_ro(path, "the manifest", err, cap);
    if (f < 0) return false;
    char fmt[64] = "";
    char ignored[CK_ERR_CAP] = "";
    bool ok = ck_read_attr_str(f, "format", fmt, sizeof fmt, path, ignored, (int)sizeof ignored) &&
              !strcmp(fmt, CK_FORMAT_MANIFEST);
    if (!ok) ck_errf(err, cap, "%s: not a moetrain checkpoint manifest (its 'format' attribute is missing or wrong)", path);
    if (ok) ok = ck_read_attr_i64(f, "format_version", &man->version, 1, NULL, path, err, cap);
    if (ok && man->version != CKPT_FORMAT_VERSION)
        ok = ck_errf(err, cap, "%s: checkpoint format version %lld, this moetrain reads version %d", path,
                   (long long)man->version, CKPT_FORMAT_VERSION);
    const char *names[] = {"step", "optimizer_step", "data_position", "world", "pp", "ep", "ep_fsdp",
                           "ep_outside", "stage_size"};
    int64_t *dst[] = {&man->step, &man->opt_step, &man->data_pos, &man->world, &man->pp, &man->ep,
                      &man->ep_fsdp, &man->ep_outside, &man->S};
    for (size_t j = 0; j < sizeof names / sizeof names[0] && ok; j++)
        ok = ck_read_attr_i64(f, names[j], dst[j], 1, NULL, path, err, cap);
    if (ok && (man->world < 1 || man->world > (1 << 24) || man->step < 0 || man->step > INT32_MAX ||
               man->opt_step < 0 || man->opt_step > INT32_MAX))
        ok = ck_errf(err, cap, "%s: impossible values (world %lld, step %lld, optimizer_step %lld)", path,
                   (long long)man->world, (long long)man->step, (long long)man->opt_step);
    if (ok) ok = check_model(f, path, c, err, cap);
    if (ok) ok = read_bias(f, path, man, bias, err, cap);
    CK_H5(H5Fclose(f));
    return ok;
}

bool ckpt_read_config(const char *dir, int n_sets, char **sets, struct config *c, char *err, int cap)
{
    char path[MT_PATH_MAX * 2], marker[MT_PATH_MAX * 2];
    ck_path(path, sizeof path, "%s/%s", dir, CK_MANIFEST);
    ck_path(marker, sizeof marker, "%s/%s", dir, CK_COMPLETE);
    if (!ck_file_exists(path) || !ck_file_exists(marker))
        return ck_errf(err, cap, "%s is not a complete checkpoint (no %s or %s)", dir, CK_MANIFEST, CK_COMPLETE);
    hid_t f = open_ro(path, "the manifest", err, cap);
    if (f < 0) return false;
    bool ok = false;
    if (!link_exists(f, "config_yaml")) {
        ck_errf(err, cap, "%s: no 'config_yaml' dataset", path);
    } else {
        hid_t d = CK_H5(H5Dopen2(f, "config_yaml", H5P_DEFAULT));
        hid_t t = CK_H5(H5Dget_type(d));
        size_t len = H5Tget_size(t);
        char *yaml = mt_calloc(len + 1, 1);
        CK_H5(H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, yaml));
        ok = config_load_string_checked(c, path, yaml, strlen(yaml), n_sets, sets, err, cap);
        free(yaml);
        CK_H5(H5Tclose(t));
        CK_H5(H5Dclose(d));
    }
    CK_H5(H5Fclose(f));
    return ok;
}

/* --- phase 2: the index of the old rank files ---------------------------------------------- */

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

struct pieces {
    struct piece *v;
    int n, cap;
};

static void push_piece(struct pieces *ps, const struct piece *pc)
{
    if (ps->n == ps->cap) ps->v = mt_realloc(ps->v, (size_t)(ps->cap = ps->cap ? 2 * ps->cap : 64) * sizeof *ps->v);
    ps->v[ps->n++] = *pc;
}

/* Reads and checks the slice attributes of dataset grp/name of old rank file `file`. */
static bool read_piece(hid_t grp, const char *gname, const char *name, const char *path, int file,
                       const struct tensor_table *tt, const struct name_slot *by_name, struct piece *pc,
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

static bool index_file(const char *dir, int file, const struct manifest *man, const struct tensor_table *tt,
                       const struct name_slot *by_name, struct pieces *out, char *err, int cap)
{
    char path[MT_PATH_MAX * 2];
    ck_rank_file(path, sizeof path, dir, file);
    if (!ck_file_exists(path))
        return ck_errf(err, cap, "checkpoint %s: rank file %s is missing (the checkpoint was written by %lld ranks)",
                     dir, strrchr(path, '/') + 1, (long long)man->world);
    hid_t f = open_ro(path, "the rank file", err, cap);
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
        if (!link_exists(f, ck_buf_group[b])) ok = ck_errf(err, cap, "%s: group '%s' is missing", path, ck_buf_group[b]);
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
        struct piece pc, other;
        ok = read_piece(grp[CK_MASTER], "master", name, path, file, tt, by_name, &pc, err, cap);
        for (int b = 1; b < CK_N_BUFS && ok; b++) {
            if (!link_exists(grp[b], name)) {
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
static bool build_index(const char *dir, const struct manifest *man, const struct tensor_table *tt,
                        const struct mesh *mesh, struct pieces *all, char *err, int cap)
{
    struct name_slot *by_name = mt_malloc((size_t)MT_MAX(tt->n, 1) * sizeof *by_name);
    for (int i = 0; i < tt->n; i++) by_name[i] = (struct name_slot){tt->t[i].name, i};
    qsort(by_name, (size_t)tt->n, sizeof *by_name, cmp_slot);
    struct pieces mine = {0};
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
    int n_ints = mine.n * PIECE_INTS;
    MT_CHECK_MPI(MPI_Allgather(&n_ints, 1, MPI_INT, counts, 1, MPI_INT, mesh->world_comm));
    int64_t total = 0;
    for (int r = 0; r < W; r++) {
        displs[r] = (int)total;
        total += counts[r];
    }
    MT_CHECK(total <= INT32_MAX, "checkpoint %s: the piece index is too large to gather", dir);
    all->n = all->cap = (int)(total / PIECE_INTS);
    all->v = mt_malloc((size_t)MT_MAX(all->n, 1) * sizeof *all->v);
    int64_t none[PIECE_INTS];
    MT_CHECK_MPI(MPI_Allgatherv(mine.v ? (void *)mine.v : (void *)none, n_ints, MPI_INT64_T, all->v,
                                counts, displs, MPI_INT64_T, mesh->world_comm));
    free(mine.v);
    free(counts);
    free(displs);
    return true;
}

/* --- phase 3: reading this rank's shard ---------------------------------------------------- */

struct reader {
    const char *dir;
    const struct tensor_table *tt;
    int buf;                    /* CK_MASTER, CK_ADAM_M or CK_ADAM_V */
    hid_t *files;               /* [old world], -1 until opened */
    hid_t dapl;
    char *err;
    int cap;
};

/* Calls fn for each overlap of the flat range [A, B) of tensor s with piece pc: global flat
 * [lo, hi) at flattened dataset position ds. Returns false if fn did. */
typedef bool (*overlap_fn)(void *ctx, int64_t lo, int64_t hi, int64_t ds);

static bool for_each_overlap(const struct tensor_spec *s, const struct piece *pc, int64_t A, int64_t B,
                             overlap_fn fn, void *ctx)
{
    if (s->kind != TK_EXPERT) {
        int64_t lo = MT_MAX(A, pc->a), hi = MT_MIN(B, pc->b);
        return hi <= lo || fn(ctx, lo, hi, lo - pc->a);
    }
    const int64_t d1 = s->shape[1], d2 = s->shape[2], nr = pc->r1 - pc->r0, per = d1 * d2;
    const int64_t e_lo = MT_MAX(pc->e0, A / per), e_hi = MT_MIN(pc->e1, MT_CEIL_DIV(B, per));
    for (int64_t e = e_lo; e < e_hi; e++) {
        const int64_t blk = (e * d1 + pc->r0) * d2;
        int64_t lo = MT_MAX(A, blk), hi = MT_MIN(B, blk + nr * d2);
        if (hi > lo && !fn(ctx, lo, hi, (e - pc->e0) * nr * d2 + (lo - blk))) return false;
    }
    return true;
}

static bool count_overlap(void *ctx, int64_t lo, int64_t hi, int64_t ds)
{
    (void)ds;
    *(int64_t *)ctx += hi - lo;
    return true;
}

struct read_ctx {
    struct reader *rd;
    const struct tensor_spec *s;
    const struct piece *pc;
    hid_t dset;
    hsize_t dims[3];
    int ndim;
    float *dst;                 /* host shard buffer at the run's first element */
    int64_t A;                  /* the run's first global element */
    int64_t covered;
};

static bool read_overlap(void *ctx, int64_t lo, int64_t hi, int64_t ds)
{
    struct read_ctx *x = ctx;
    char m[512];
    if (!ck_flat_io(x->dset, x->ndim, x->dims, ds, hi - lo, x->dst + (lo - x->A), false, m, sizeof m)) {
        char path[MT_PATH_MAX * 2];
        ck_rank_file(path, sizeof path, x->rd->dir, (int)x->pc->file);
        return ck_errf(x->rd->err, x->rd->cap, "%s: reading %s/%s failed (corrupt file?): %s", path,
                       ck_buf_group[x->rd->buf], x->s->name, m);
    }
    x->covered += hi - lo;
    return true;
}

static hid_t file_of(struct reader *rd, int64_t file)
{
    if (rd->files[file] < 0) {
        char path[MT_PATH_MAX * 2];
        ck_rank_file(path, sizeof path, rd->dir, (int)file);
        rd->files[file] = open_ro(path, "the rank file", rd->err, rd->cap);
    }
    return rd->files[file];
}

/* Reads every overlap of piece pc with the runs rs of its tensor into host (the shard of the
 * tensor's group); adds the elements read to covered[run]. */
static bool read_piece_overlaps(struct reader *rd, const struct piece *pc, const struct ck_runs *rs,
                                float *host, int64_t *covered)
{
    const struct tensor_spec *s = &rd->tt->t[pc->tensor];
    int64_t any = 0;
    for (int j = 0; j < rs->n; j++)
        for_each_overlap(s, pc, rs->r[j].gidx, rs->r[j].gidx + rs->r[j].len, count_overlap, &any);
    if (any == 0) return true;
    hid_t f = file_of(rd, pc->file);
    if (f < 0) return false;
    struct read_ctx x = {.rd = rd, .s = s, .pc = pc};
    if (s->kind == TK_EXPERT) {
        x.ndim = 3;
        x.dims[0] = (hsize_t)(pc->e1 - pc->e0), x.dims[1] = (hsize_t)(pc->r1 - pc->r0), x.dims[2] = (hsize_t)s->shape[2];
    } else {
        x.ndim = 1;
        x.dims[0] = (hsize_t)(pc->b - pc->a);
    }
    char name[300];
    snprintf(name, sizeof name, "%s/%s", ck_buf_group[rd->buf], s->name);
    x.dset = H5Dopen2(f, name, rd->dapl);
    if (x.dset < 0) {
        char path[MT_PATH_MAX * 2];
        ck_rank_file(path, sizeof path, rd->dir, (int)pc->file);
        return ck_errf(rd->err, rd->cap, "%s: dataset %s disappeared while loading", path, name);
    }
    bool ok = true;
    for (int j = 0; j < rs->n && ok; j++) {
        x.dst = host + rs->r[j].soff;
        x.A = rs->r[j].gidx;
        x.covered = 0;
        ok = for_each_overlap(s, pc, x.A, x.A + rs->r[j].len, read_overlap, &x);
        covered[j] += x.covered;
    }
    CK_H5(H5Dclose(x.dset));
    return ok;
}

/* Fills host[k] (zeroed, [numel] of group k) with buffer `buf` of this rank's shard. */
static bool read_shard(const char *dir, const struct params *p, const struct manifest *man,
                       const struct pieces *all, int buf, float *host[TG_COUNT], char *err, int cap)
{
    const struct model *m = p->m;
    const struct tensor_table *tt = &m->tt;
    struct ck_runs *rs = mt_calloc((size_t)tt->n, sizeof *rs);
    params_for_each_run_of(p, p->S_rank, p->F_rank, m->expert0, ck_collect_run, rs);
    /* pieces of tensor i: order[first[i] .. first[i + 1]) */
    int *first = mt_calloc((size_t)tt->n + 1, sizeof(int)), *order = mt_malloc((size_t)MT_MAX(all->n, 1) * sizeof(int));
    for (int j = 0; j < all->n; j++) first[all->v[j].tensor + 1]++;
    for (int i = 0; i < tt->n; i++) first[i + 1] += first[i];
    int *fill = mt_calloc((size_t)tt->n, sizeof(int));
    for (int j = 0; j < all->n; j++) order[first[all->v[j].tensor] + fill[all->v[j].tensor]++] = j;
    free(fill);

    struct reader rd = {.dir = dir, .tt = tt, .buf = buf, .err = err, .cap = cap};
    rd.files = mt_malloc((size_t)man->world * sizeof(hid_t));
    for (int64_t f = 0; f < man->world; f++) rd.files[f] = -1;
    rd.dapl = CK_H5(H5Pcreate(H5P_DATASET_ACCESS));
    CK_H5(H5Pset_chunk_cache(rd.dapl, 521, (size_t)16 << 20, 1.0));
    bool ok = true;
    for (int i = 0; i < tt->n && ok; i++) {
        if (rs[i].n == 0) continue;
        const struct tensor_spec *s = &tt->t[i];
        int64_t *covered = mt_calloc((size_t)rs[i].n, sizeof(int64_t));
        for (int q = first[i]; q < first[i + 1] && ok; q++)
            ok = read_piece_overlaps(&rd, &all->v[order[q]], &rs[i], host[tensor_group_of(s)], covered);
        for (int j = 0; j < rs[i].n && ok; j++) {
            const struct ck_run *r = &rs[i].r[j];
            if (covered[j] != r->len)
                ok = ck_errf(err, cap, "checkpoint %s: its rank files hold %lld of the %lld elements [%lld, %lld) "
                             "of %s (%s)", dir, (long long)covered[j], (long long)r->len, (long long)r->gidx,
                             (long long)(r->gidx + r->len), s->name,
                             covered[j] < r->len ? "a dataset is missing" : "pieces overlap");
        }
        free(covered);
    }
    for (int64_t f = 0; f < man->world; f++)
        if (rd.files[f] >= 0) CK_H5(H5Fclose(rd.files[f]));
    CK_H5(H5Pclose(rd.dapl));
    free(rd.files);
    for (int i = 0; i < tt->n; i++) free(rs[i].r);
    free(rs);
    free(first);
    free(order);
    return ok;
}

/* --- the whole load ------------------------------------------------------------------------ */

bool ckpt_load_checked(const char *dir, struct params *p, const struct mesh *mesh,
                       const struct config *c, float *bias_host_out, int *step_out,
                       bool weights_only, char *err, int errcap)
{
    ck_h5_init();
    const double t0 = mt_now();
    char e[CK_ERR_CAP] = "";
    struct manifest man;
    memset(&man, 0, sizeof man);
    float *bias = NULL;
    const int L = c->model.num_hidden_layers, E = c->model.num_experts;
    if (mesh->rank == 0 && read_manifest(dir, c, &man, &bias, e, sizeof e) && bias_host_out && man.has_bias &&
        (man.bias_L != L || man.bias_E != E))
        ck_errf(e, sizeof e, "%s/%s: balance_bias is [%lld, %lld], the model needs [%d, %d]", dir, CK_MANIFEST,
                (long long)man.bias_L, (long long)man.bias_E, L, E);
    bool ok = ck_agree(mesh, e, sizeof e);
    if (ok && ck_use_mpi(mesh)) {
        MT_CHECK_MPI(MPI_Bcast(&man, (int)sizeof man, MPI_BYTE, 0, mesh->world_comm));
        if (man.has_bias) {
            if (!bias) bias = mt_malloc((size_t)(man.bias_L * man.bias_E) * sizeof(float));
            MT_CHECK_MPI(MPI_Bcast(bias, (int)(man.bias_L * man.bias_E), MPI_FLOAT, 0, mesh->world_comm));
        }
    }
    struct pieces all = {0};
    if (ok) ok = build_index(dir, &man, &p->m->tt, mesh, &all, e, sizeof e);

    /* one buffer at a time (host memory of one shard); each goes to p once every rank has it */
    const struct backend *be = p->m->be;
    for (int b = 0; b < (weights_only ? 1 : CK_N_BUFS) && ok; b++) {
        float *host[TG_COUNT];
        for (int k = 0; k < TG_COUNT; k++) host[k] = mt_calloc((size_t)MT_MAX(p->g[k].numel, 1), sizeof(float));
        read_shard(dir, p, &man, &all, b, host, e, sizeof e);
        ok = ck_agree(mesh, e, sizeof e);
        for (int k = 0; k < TG_COUNT && ok; k++) {
            struct param_group_shard *g = &p->g[k];
            if (b == CK_MASTER) be->upload(g->master, host[k], (size_t)g->numel * sizeof(float));
            else params_moment_from_host(p, (enum tensor_group)k, b == CK_ADAM_M ? 1 : 2, host[k]);
        }
        if (ok && b == CK_MASTER) params_refresh_copy(p);
        for (int k = 0; k < TG_COUNT; k++) free(host[k]);
    }
    if (ok) {
        if (weights_only) params_moments_zero(p);
        p->step = weights_only ? 0 : (int)man.opt_step;
        if (bias_host_out) {
            if (man.has_bias) memcpy(bias_host_out, bias, (size_t)L * E * sizeof(float));
            else memset(bias_host_out, 0, (size_t)L * MT_MAX(E, 0) * sizeof(float));
        }
        if (step_out) *step_out = (int)man.step;
        mt_log0("checkpoint: loaded %s (step %lld, saved by %lld ranks = pp %lld x ep %lld x ep_fsdp %lld) "
                "in %.2f s\n", dir, (long long)man.step, (long long)man.world, (long long)man.pp,
                (long long)man.ep, (long long)man.ep_fsdp, mt_now() - t0);
    } else {
        mt_strlcpy(err, e, (size_t)errcap);
    }
    free(all.v);
    free(bias);
    return ok;
}

void ckpt_load(const char *dir, struct params *p, const struct mesh *mesh, const struct config *c,
               float *bias_host_out, int *step_out)
{
    char err[CK_ERR_CAP];
    if (!ckpt_load_checked(dir, p, mesh, c, bias_host_out, step_out, false, err, sizeof err))
        mt_user_error("%s", err);
}

/* --- reading one tensor range at a time (moetrain export) ---------------------------------- */

struct ckpt_reader {
    struct reader rd;
    struct manifest man;
    struct pieces all;
    int *first, *order;         /* pieces of tensor i: all.v[order[first[i] .. first[i + 1])] */
};

struct ckpt_reader *ckpt_reader_open(const char *dir, const struct config *c, const struct tensor_table *tt,
                                     float **bias_out, int *step_out, char *err, int cap)
{
    ck_h5_init();
    struct ckpt_reader *r = mt_calloc(1, sizeof *r);
    struct mesh one;
    memset(&one, 0, sizeof one);
    one.world_comm = MPI_COMM_NULL;
    one.d.world = 1;
    float *bias = NULL;
    err[0] = 0;
    if (!read_manifest(dir, c, &r->man, &bias, err, cap) || !build_index(dir, &r->man, tt, &one, &r->all, err, cap)) {
        free(bias);
        ckpt_reader_close(r);
        return NULL;
    }
    const int L = c->model.num_hidden_layers, E = c->model.num_experts;
    if (r->man.has_bias && (r->man.bias_L != L || r->man.bias_E != E)) {
        ck_errf(err, cap, "%s/%s: balance_bias is [%lld, %lld], the model needs [%d, %d]", dir, CK_MANIFEST,
                (long long)r->man.bias_L, (long long)r->man.bias_E, L, E);
        free(bias);
        ckpt_reader_close(r);
        return NULL;
    }
    *bias_out = r->man.has_bias ? bias : NULL;
    if (!r->man.has_bias) free(bias);
    *step_out = (int)r->man.step;
    r->first = mt_calloc((size_t)tt->n + 1, sizeof(int));
    r->order = mt_malloc((size_t)MT_MAX(r->all.n, 1) * sizeof(int));
    for (int j = 0; j < r->all.n; j++) r->first[r->all.v[j].tensor + 1]++;
    for (int i = 0; i < tt->n; i++) r->first[i + 1] += r->first[i];
    int *fill = mt_calloc((size_t)tt->n, sizeof(int));
    for (int j = 0; j < r->all.n; j++) r->order[r->first[r->all.v[j].tensor] + fill[r->all.v[j].tensor]++] = j;
    free(fill);
    r->rd = (struct reader){.dir = dir, .tt = tt, .buf = CK_MASTER};
    r->rd.files = mt_malloc((size_t)r->man.world * sizeof(hid_t));
    for (int64_t f = 0; f < r->man.world; f++) r->rd.files[f] = -1;
    r->rd.dapl = CK_H5(H5Pcreate(H5P_DATASET_ACCESS));
    CK_H5(H5Pset_chunk_cache(r->rd.dapl, 521, (size_t)16 << 20, 1.0));
    return r;
}

bool ckpt_reader_read(struct ckpt_reader *r, int tensor, int64_t A, int64_t n, float *dst, char *err, int cap)
{
    const struct tensor_spec *s = &r->rd.tt->t[tensor];
    struct ck_runs one = {.r = &(struct ck_run){.gidx = A, .soff = 0, .len = n}, .n = 1, .cap = 1};
    int64_t covered = 0;
    r->rd.err = err;
    r->rd.cap = cap;
    err[0] = 0;
    for (int q = r->first[tensor]; q < r->first[tensor + 1]; q++)
        if (!read_piece_overlaps(&r->rd, &r->all.v[r->order[q]], &one, dst, &covered)) return false;
    if (covered != n)
        return ck_errf(err, cap, "checkpoint %s: its rank files hold %lld of the %lld elements [%lld, %lld) of %s (%s)",
                       r->rd.dir, (long long)covered, (long long)n, (long long)A, (long long)(A + n), s->name,
                       covered < n ? "a dataset is missing" : "pieces overlap");
    return true;
}

void ckpt_reader_close(struct ckpt_reader *r)
{
    if (!r) return;
    for (int64_t f = 0; r->rd.files && f < r->man.world; f++)
        if (r->rd.files[f] >= 0) CK_H5(H5Fclose(r->rd.files[f]));
    if (r->rd.files) CK_H5(H5Pclose(r->rd.dapl));
    free(r->rd.files);
    free(r->all.v);
    free(r->first);
    free(r->order);
    free(r);
}
