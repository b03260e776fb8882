/* Loading a checkpoint onto any mesh (checkpoint.h). Three collective phases, each ending in an
 * agreement so that a bad checkpoint is one message and a non-zero exit on every rank, never a
 * hang:
 *   1. rank 0 checks the directory (COMPLETE marker) and the manifest (format, version, model
 *      shape) and broadcasts what it read (checkpoint_manifest.c);
 *   2. the old rank files are indexed, each by one rank (the slice attributes of every dataset,
 *      checked against the tensor table), and the index is all-gathered (checkpoint_index.c);
 *   3. each rank lists the runs of its own new shard (params_for_each_run_of), intersects them
 *      with the pieces of the index and reads the overlaps with hyperslab reads; one buffer at a
 *      time (master, m1, m2), each copied into p once every rank has read it (here).
 * Every check of files, names, slices and shapes happens before p changes; only a read error
 * (a checksum mismatch) in m1 or m2 can leave p's masters already replaced.
 * Also the one-process reader of moetrain export, which reads the same pieces a range at a time. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "checkpoint_h5.h"
#include "checkpoint_index.h"
#include "common.h"

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

static bool for_each_overlap(const struct tensor_spec *s, const struct ck_piece *pc, int64_t A, int64_t B,
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
    const struct ck_piece *pc;
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
        rd->files[file] = ck_open_ro(path, "the rank file", rd->err, rd->cap);
    }
    return rd->files[file];
}

/* Reads every overlap of piece pc with the runs rs of its tensor into host (the shard of the
 * tensor's group); adds the elements read to covered[run]. */
static bool read_piece_overlaps(struct reader *rd, const struct ck_piece *pc, const struct ck_runs *rs,
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

/* Fills host[k] (zeroed, [numel] of group k) with buffer `buf` of this rank's shard. The pieces
 * name tensors of the whole model (`full`); the rank's runs those of its stage's table. */
static bool read_shard(const char *dir, const struct params *p, const struct tensor_table *full,
                       const struct ck_manifest *man, const struct ck_pieces *all, int buf,
                       float *host[TG_COUNT], char *err, int cap)
{
    const struct model *m = p->m;
    const struct tensor_table *tt = &m->tt;
    struct ck_runs *rs = mt_calloc((size_t)tt->n, sizeof *rs);
    params_for_each_run_of(p, p->S_rank, p->F_rank, m->expert0, ck_collect_run, rs);
    /* pieces of whole-model tensor i: order[first[i] .. first[i + 1]) */
    int *first = mt_calloc((size_t)full->n + 1, sizeof(int)), *order = mt_malloc((size_t)MT_MAX(all->n, 1) * sizeof(int));
    for (int j = 0; j < all->n; j++) first[all->v[j].tensor + 1]++;
    for (int i = 0; i < full->n; i++) first[i + 1] += first[i];
    int *fill = mt_calloc((size_t)full->n, sizeof(int));
    for (int j = 0; j < all->n; j++) order[first[all->v[j].tensor] + fill[all->v[j].tensor]++] = j;
    free(fill);

    struct reader rd = {.dir = dir, .tt = full, .buf = buf, .err = err, .cap = cap};
    rd.files = mt_malloc((size_t)man->world * sizeof(hid_t));
    for (int64_t f = 0; f < man->world; f++) rd.files[f] = -1;
    rd.dapl = CK_H5(H5Pcreate(H5P_DATASET_ACCESS));
    CK_H5(H5Pset_chunk_cache(rd.dapl, 521, (size_t)16 << 20, 1.0));
    bool ok = true;
    for (int i = 0; i < tt->n && ok; i++) {
        if (rs[i].n == 0) continue;
        const struct tensor_spec *s = &tt->t[i];
        const int fi = tensor_find(full, s->name);
        MT_CHECK(fi >= 0, "checkpoint: the stage's tensor %s is not in the model's table", s->name);
        int64_t *covered = mt_calloc((size_t)rs[i].n, sizeof(int64_t));
        for (int q = first[fi]; q < first[fi + 1] && ok; q++)
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
    struct ck_manifest man;
    memset(&man, 0, sizeof man);
    float *bias = NULL;
    const int L = c->model.num_hidden_layers, E = c->model.num_experts;
    if (mesh->rank == 0 && ck_read_manifest(dir, c, &man, &bias, e, sizeof e) && bias_host_out && man.has_bias &&
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
    /* the old files hold tensors of every stage of the old mesh: index them against the whole
     * model's table, whatever part of it this rank's stage keeps */
    struct tensor_table full;
    tensor_table_build(&full, &c->model);
    struct ck_pieces all = {0};
    if (ok) ok = ck_build_index(dir, &man, &full, mesh, &all, e, sizeof e);

    /* one buffer at a time (host memory of one shard); each goes to p once every rank has it */
    for (int b = 0; b < (weights_only ? 1 : CK_N_BUFS) && ok; b++) {
        float *host[TG_COUNT];
        for (int k = 0; k < TG_COUNT; k++) host[k] = mt_calloc((size_t)MT_MAX(p->g[k].numel, 1), sizeof(float));
        read_shard(dir, p, &full, &man, &all, b, host, e, sizeof e);
        ok = ck_agree(mesh, e, sizeof e);
        for (int k = 0; k < TG_COUNT && ok; k++) {
            struct param_group_shard *g = &p->g[k];
            if (b == CK_MASTER) params_master_write(p, (enum tensor_group)k, 0, g->numel, host[k]);
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
    tensor_table_free(&full);
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
    struct ck_manifest man;
    struct ck_pieces all;
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
    if (!ck_read_manifest(dir, c, &r->man, &bias, err, cap) || !ck_build_index(dir, &r->man, tt, &one, &r->all, err, cap)) {
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
