/* export_params_hf: the training run's export, streamed. For each piece the writer asks for (at
 * most HF_EXPORT_CHUNK elements of one tensor), every rank intersects it with the runs of its own
 * shard (params_for_each_run_of), rank 0 learns each rank's segment and element counts (int64)
 * and receives the segments; no rank ever holds more than one piece of the model beyond its shard.
 * Every count is int64; MPI messages are split below INT_MAX elements. */
#include <limits.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint_h5.h"
#include "checkpoint_index.h"
#include "common.h"
#include "hf_export.h"
#include "mesh.h"
#include "model.h"
#include "params.h"

#define MSG_MAX ((int64_t)1 << 28)   /* elements per MPI message */
#define TAG_META 7301
#define TAG_DATA 7302

struct seg {
    int64_t pos, soff, len;     /* piece offset, shard offset, elements */
};

struct gather {
    const struct params *p;
    const struct mesh *mesh;
    bool mpi;
    struct ck_runs *runs;       /* [tt.n] this rank's runs of each tensor */
    struct seg *segs;
    int n_segs, cap_segs;
    float *buf;                 /* [HF_EXPORT_CHUNK] send / receive staging */
    int64_t *meta;              /* [2 * cap_segs] (pos, len) pairs in flight */
};

static void collect_segments(struct gather *g, int tensor, int64_t A, int64_t n)
{
    const struct ck_runs *rs = &g->runs[tensor];
    g->n_segs = 0;
    for (int j = 0; j < rs->n; j++) {
        const struct ck_run *r = &rs->r[j];
        int64_t lo = MT_MAX(A, r->gidx), hi = MT_MIN(A + n, r->gidx + r->len);
        if (hi <= lo) continue;
        if (g->n_segs == g->cap_segs) {
            g->cap_segs = g->cap_segs ? 2 * g->cap_segs : 64;
            g->segs = mt_realloc(g->segs, (size_t)g->cap_segs * sizeof *g->segs);
            g->meta = mt_realloc(g->meta, (size_t)g->cap_segs * 2 * sizeof *g->meta);
        }
        g->segs[g->n_segs++] = (struct seg){lo - A, r->soff + (lo - r->gidx), hi - lo};
    }
}

static void send_split(const void *data, int64_t n, MPI_Datatype t, int elem_bytes, int tag, MPI_Comm comm)
{
    for (int64_t off = 0; off < n; off += MSG_MAX)
        MT_CHECK_MPI(MPI_Send((const char *)data + off * elem_bytes, (int)MT_MIN(MSG_MAX, n - off), t, 0, tag, comm));
}

static void recv_split(void *data, int64_t n, MPI_Datatype t, int elem_bytes, int src, int tag, MPI_Comm comm)
{
    for (int64_t off = 0; off < n; off += MSG_MAX)
        MT_CHECK_MPI(MPI_Recv((char *)data + off * elem_bytes, (int)MT_MIN(MSG_MAX, n - off), t, src, tag, comm,
                              MPI_STATUS_IGNORE));
}

static int cmp_pos(const void *a, const void *b)
{
    int64_t x = ((const int64_t *)a)[0], y = ((const int64_t *)b)[0];
    return (x > y) - (x < y);
}

static bool fetch_from_ranks(void *ctx, int tensor, int64_t A, int64_t n, float *dst, char *err, int errcap)
{
    (void)err, (void)errcap;   /* a rank holding the wrong pieces is broken state: fatal below */
    struct gather *g = ctx;
    const enum tensor_group tg = tensor_group_of(&g->p->m->tt.t[tensor]);
    collect_segments(g, tensor, A, n);
    int64_t mine[2] = {g->n_segs, 0};
    for (int j = 0; j < g->n_segs; j++) mine[1] += g->segs[j].len;
    const int W = g->mpi ? g->mesh->d.world : 1, me = g->mpi ? g->mesh->rank : 0;
    if (me != 0) {
        MT_CHECK_MPI(MPI_Gather(mine, 2, MPI_INT64_T, NULL, 2, MPI_INT64_T, 0, g->mesh->world_comm));
        if (g->n_segs == 0) return true;
        int64_t at = 0;
        for (int j = 0; j < g->n_segs; j++) {
            params_master_read(g->p, tg, g->segs[j].soff, g->segs[j].len, g->buf + at);
            g->meta[2 * j] = g->segs[j].pos;
            g->meta[2 * j + 1] = g->segs[j].len;
            at += g->segs[j].len;
        }
        send_split(g->meta, 2 * (int64_t)g->n_segs, MPI_INT64_T, 8, TAG_META, g->mesh->world_comm);
        send_split(g->buf, at, MPI_FLOAT, 4, TAG_DATA, g->mesh->world_comm);
        return true;
    }
    int64_t *counts = mt_malloc((size_t)W * 2 * sizeof(int64_t));
    if (g->mpi) MT_CHECK_MPI(MPI_Gather(mine, 2, MPI_INT64_T, counts, 2, MPI_INT64_T, 0, g->mesh->world_comm));
    else memcpy(counts, mine, sizeof mine);
    int64_t n_all = 0;
    for (int r = 0; r < W; r++) n_all += counts[2 * r];
    int64_t *cover = mt_malloc((size_t)MT_MAX(n_all, 1) * 2 * sizeof(int64_t)), nc = 0;
    for (int j = 0; j < g->n_segs; j++) {
        params_master_read(g->p, tg, g->segs[j].soff, g->segs[j].len, dst + g->segs[j].pos);
        cover[2 * nc] = g->segs[j].pos;
        cover[2 * nc++ + 1] = g->segs[j].len;
    }
    for (int r = 1; r < W; r++) {
        const int64_t ns = counts[2 * r], ne = counts[2 * r + 1];
        if (ns == 0) continue;
        MT_CHECK(ne <= n, "export: rank %d offers %lld elements of a %lld-element piece", r, (long long)ne, (long long)n);
        int64_t *meta = cover + 2 * nc;
        recv_split(meta, 2 * ns, MPI_INT64_T, 8, r, TAG_META, g->mesh->world_comm);
        recv_split(g->buf, ne, MPI_FLOAT, 4, r, TAG_DATA, g->mesh->world_comm);
        int64_t at = 0;
        for (int64_t j = 0; j < ns; j++) {
            MT_CHECK(meta[2 * j] >= 0 && meta[2 * j] + meta[2 * j + 1] <= n && at + meta[2 * j + 1] <= ne,
                     "export: rank %d sent a segment outside the piece", r);
            memcpy(dst + meta[2 * j], g->buf + at, (size_t)meta[2 * j + 1] * sizeof(float));
            at += meta[2 * j + 1];
        }
        nc += ns;
    }
    /* every element of the piece arrived exactly once */
    qsort(cover, (size_t)nc, 2 * sizeof(int64_t), cmp_pos);
    int64_t end = 0;
    for (int64_t j = 0; j < nc; j++) {
        MT_CHECK(cover[2 * j] == end, "export: %s elements [%lld, %lld): %s at %lld", g->p->m->tt.t[tensor].name,
                 (long long)A, (long long)(A + n), cover[2 * j] < end ? "held twice" : "held by no rank",
                 (long long)(A + MT_MIN(end, cover[2 * j])));
        end += cover[2 * j + 1];
    }
    MT_CHECK(end == n, "export: %s elements [%lld, %lld) held by no rank", g->p->m->tt.t[tensor].name,
             (long long)(A + end), (long long)(A + n));
    free(cover);
    free(counts);
    return true;
}

bool export_params_hf(const struct params *p, const struct mesh *mesh, const struct config *c,
                      const float *bias, bool force, const char *dir, char *err, int errcap)
{
    const struct tensor_table *tt = &p->m->tt;
    struct gather g = {.p = p, .mesh = mesh, .mpi = ck_use_mpi(mesh)};
    g.runs = mt_calloc((size_t)tt->n, sizeof *g.runs);
    params_for_each_run_of(p, p->S_rank, p->F_rank, p->m->expert0, ck_collect_run, g.runs);
    /* each element from one rank: a stage offers only its own tensors (not the tied embedding the
     * last stage keeps for its head) */
    for (int i = 0; i < tt->n; i++)
        if (!mesh_stage_owns(mesh, &tt->t[i])) g.runs[i].n = 0;
    g.buf = mt_malloc((size_t)HF_EXPORT_CHUNK * sizeof(float));
    struct hf_export_opts o = {
        .dtype = c->checkpoint.export_dtype == MT_PREC_FP32 ? ST_F32 : ST_BF16,
        .max_shard_bytes = c->checkpoint.export_shard_bytes,
        .force = force,
        .tokenizer_from = c->model.init_from,
    };
    const bool writer = !g.mpi || mesh->rank == 0;
    err[0] = 0;
    hf_export_stream(dir, &c->model, tt, bias, &o, writer, fetch_from_ranks, &g, err, errcap);
    if (g.mpi) MT_CHECK_MPI(MPI_Bcast(err, errcap, MPI_CHAR, 0, mesh->world_comm));
    for (int i = 0; i < tt->n; i++) free(g.runs[i].r);
    free(g.runs);
    free(g.segs);
    free(g.meta);
    free(g.buf);
    return err[0] == 0;
}
