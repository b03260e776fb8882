/* mpirun -np N ckpt_check save|load|fail DIR EP EP_OUTSIDE [PP]
 *
 * Checkpoints across meshes (src/checkpoint.h). The state is a pattern: element j of tensor i
 * holds value(buffer, i, j) in the master weights, m1 and m2, whatever the mesh, so every rank
 * can say what any element must be.
 *   save: fill this mesh's shards with the pattern (optimizer step 11, a bias), save as step 4
 *         under DIR.
 *   load: fill the shards with something else, load checkpoint directory DIR onto this mesh,
 *         then check bit for bit: every element of this rank's shard (padding zero), the
 *         working copy, the optimizer step, the bias, the step; and on rank 0 the GLOBAL tensors
 *         assembled from every rank (params_gather_global for the masters, the same gather
 *         done here for m1 and m2).
 *   fail: load DIR, which is expected to exit with a one-line error (exit 0 if it loads).
 * Exit 0 when everything matches; otherwise each failing rank prints its first problem and all
 * exit 1. */
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "checkpoint_index.h"
#include "comm.h"
#include "common.h"
#include "config.h"
#include "mesh.h"
#include "model.h"
#include "ops.h"
#include "params.h"

#define SAVED_STEP 4
#define SAVED_OPT_STEP 11

static char first_problem[512];
static int n_problems;

static void problem(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void problem(const char *fmt, ...)
{
    if (n_problems++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(first_problem, sizeof first_problem, fmt, ap);
        va_end(ap);
    }
}

/* The value of element j of tensor i in buffer b (0 master, 1 m1, 2 m2, 3 bias); salt != 0 gives
 * the "something else" a load must overwrite. */
static float value(int b, int i, int64_t j, uint64_t salt)
{
    uint64_t z = ((uint64_t)j + 1) * 0x9e3779b97f4a7c15ULL ^ ((uint64_t)(i + 1) << 40) ^ ((uint64_t)b << 56) ^ salt;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return (float)((double)(z >> 40) * 0x1.0p-24) - 0.5f + (float)b;
}

struct fill {
    float *host[TG_COUNT][3];
    uint64_t salt;
};

static void fill_run(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len)
{
    struct fill *f = ctx;
    for (int b = 0; b < 3; b++)
        for (int64_t j = 0; j < len; j++) f->host[g][b][soff + j] = value(b, i, gidx + j, f->salt);
}

static void fill_state(struct params *p, uint64_t salt)
{
    const struct backend *be = p->m->be;
    struct fill f = {.salt = salt};
    for (int k = 0; k < TG_COUNT; k++)
        for (int b = 0; b < 3; b++) f.host[k][b] = mt_calloc((size_t)MT_MAX(p->g[k].numel, 1), sizeof(float));
    params_for_each_run_of(p, p->S_rank, p->F_rank, p->m->expert0, fill_run, &f);
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        float *dst[3] = {g->master, (float *)g->m1, (float *)g->m2};
        for (int b = 0; b < 3; b++) {
            /* "something else" covers the padding too: the load must zero it */
            for (int64_t j = 0; salt && j < g->numel; j++) f.host[k][b][j] += 7.0f;
            be->upload(dst[b], f.host[k][b], (size_t)g->numel * sizeof(float));
            free(f.host[k][b]);
        }
        be->cast_f32_to_x(g->param_x, g->master, (size_t)g->numel);
    }
    p->step = salt ? 1 : SAVED_OPT_STEP;
}

/* --- checks of this rank's shard ----------------------------------------------------------- */

struct shard_check {
    float *host[TG_COUNT][3];
    char *covered[TG_COUNT];
};

static void check_run(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len)
{
    struct shard_check *c = ctx;
    for (int64_t j = 0; j < len; j++) {
        c->covered[g][soff + j] = 1;
        for (int b = 0; b < 3; b++) {
            float want = value(b, i, gidx + j, 0), got = c->host[g][b][soff + j];
            if (memcmp(&want, &got, sizeof want) != 0)
                problem("buffer %d tensor %d element %lld: %.9g, want %.9g", b, i, (long long)(gidx + j),
                        (double)got, (double)want);
        }
    }
}

static void check_shard(const struct params *p)
{
    const struct backend *be = p->m->be;
    struct shard_check c;
    for (int k = 0; k < TG_COUNT; k++) {
        const struct param_group_shard *g = &p->g[k];
        const float *src[3] = {g->master, (const float *)g->m1, (const float *)g->m2};
        size_t n = (size_t)MT_MAX(g->numel, 1);
        for (int b = 0; b < 3; b++) {
            c.host[k][b] = mt_malloc(n * sizeof(float));
            be->download(c.host[k][b], src[b], (size_t)g->numel * sizeof(float));
        }
        c.covered[k] = mt_calloc(n, 1);
        /* the working copy must be the loaded masters (fp32 on the CPU backend) */
        float *x = mt_malloc(n * sizeof(float));
        be->cast_x_to_f32(x, g->param_x, (size_t)g->numel);
        if (memcmp(x, c.host[k][0], (size_t)g->numel * sizeof(float)) != 0)
            problem("group %d: param_x is not the loaded master", k);
        free(x);
    }
    params_for_each_run_of(p, p->S_rank, p->F_rank, p->m->expert0, check_run, &c);
    for (int k = 0; k < TG_COUNT; k++) {
        for (int64_t j = 0; j < p->g[k].numel; j++)
            for (int b = 0; b < 3; b++)
                if (!c.covered[k][j] && c.host[k][b][j] != 0.0f)
                    problem("group %d buffer %d: padding element %lld is %g, not 0", k, b, (long long)j,
                            (double)c.host[k][b][j]);
        for (int b = 0; b < 3; b++) free(c.host[k][b]);
        free(c.covered[k]);
    }
}

/* --- checks of the global tensors (rank 0) ------------------------------------------------- */

struct to_global {
    const float *shard;     /* one rank's shard of group `group` */
    float *global;          /* the group's global buffer */
    int group;
    const struct tensor_table *tt;
};

static void to_global_run(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len)
{
    struct to_global *t = ctx;
    if ((int)g != t->group) return;
    memcpy(t->global + t->tt->t[i].offset + gidx, t->shard + soff, (size_t)len * sizeof(float));
}

/* rank 0 assembles group k of buffer b (1 = m1, 2 = m2) from every rank's shard */
static void gather_moment(const struct params *p, const struct mesh *mesh, int b, int k, float *global)
{
    const struct param_group_shard *g = &p->g[k];
    size_t n = (size_t)MT_MAX(g->numel, 1);
    float *mine = mt_calloc(n, sizeof(float)), *all = NULL;
    p->m->be->download(mine, b == 1 ? g->m1 : g->m2, (size_t)g->numel * sizeof(float));
    if (mesh->rank == 0) all = mt_malloc(n * (size_t)mesh->d.world * sizeof(float));
    MT_CHECK_MPI(MPI_Gather(mine, (int)n, MPI_FLOAT, all, (int)n, MPI_FLOAT, 0, mesh->world_comm));
    if (mesh->rank == 0) {
        for (int r = 0; r < mesh->d.world; r++) {
            struct mesh_coord co;
            mesh_coord_of(&mesh->d, r, &co);
            struct to_global t = {.shard = all + (size_t)r * n, .global = global, .group = k, .tt = &p->m->tt};
            params_for_each_run_of(p, co.local, co.fsdp_rank, (int64_t)co.ep_rank * p->m->n_local_experts,
                                   to_global_run, &t);
        }
    }
    free(mine);
    free(all);
}

/* Rank 0 assembles buffer b (0 master, 1 m1, 2 m2) of the whole model (table `full`) from every
 * rank's runs of its own stage's tensors (mesh_stage_owns), as a pipelined export takes them. */
static void gather_stages(const struct params *p, const struct mesh *mesh, int b, const struct tensor_table *full,
                          float *const global[TG_COUNT])
{
    const struct backend *be = p->m->be;
    float *shard[TG_COUNT];
    for (int k = 0; k < TG_COUNT; k++) {
        const struct param_group_shard *g = &p->g[k];
        shard[k] = mt_malloc((size_t)MT_MAX(g->numel, 1) * sizeof(float));
        be->download(shard[k], b == 0 ? g->master : b == 1 ? g->m1 : g->m2, (size_t)g->numel * sizeof(float));
    }
    struct ck_runs *rs = mt_calloc((size_t)p->m->tt.n, sizeof *rs);
    params_for_each_run_of(p, p->S_rank, p->F_rank, p->m->expert0, ck_collect_run, rs);
    /* (tensor, global element, length) triples and the values, one rank at a time to rank 0 */
    int64_t n_head = 0, n_data = 0;
    for (int i = 0; i < p->m->tt.n; i++)
        if (mesh_stage_owns(mesh, &p->m->tt.t[i]))
            for (int j = 0; j < rs[i].n; j++) n_head++, n_data += rs[i].r[j].len;
    int64_t *head = mt_malloc((size_t)MT_MAX(n_head, 1) * 3 * sizeof(int64_t)), h = 0, d = 0;
    float *data = mt_malloc((size_t)MT_MAX(n_data, 1) * sizeof(float));
    for (int i = 0; i < p->m->tt.n; i++) {
        if (!mesh_stage_owns(mesh, &p->m->tt.t[i])) continue;
        const int fi = tensor_find(full, p->m->tt.t[i].name);
        for (int j = 0; j < rs[i].n; j++) {
            const struct ck_run *r = &rs[i].r[j];
            head[3 * h] = fi, head[3 * h + 1] = r->gidx, head[3 * h + 2] = r->len;
            memcpy(data + d, shard[tensor_group_of(&p->m->tt.t[i])] + r->soff, (size_t)r->len * sizeof(float));
            h++, d += r->len;
        }
    }
    struct comm *w = comm_mpi_create(mesh->world_comm);
    for (int r = 0; r < mesh->d.world; r++) {
        int64_t sizes[2] = {n_head, n_data}, *hh = head;
        float *dd = data;
        if (r > 0 && (mesh->rank == r || mesh->rank == 0)) {
            const bool me = mesh->rank == r;
            struct comm_p2p_op op = {me ? COMM_SEND : COMM_RECV, me ? 0 : r, sizes, 2, COMM_I64};
            comm_p2p(w, &op, 1);
            if (!me) {
                hh = mt_malloc((size_t)MT_MAX(sizes[0], 1) * 3 * sizeof(int64_t));
                dd = mt_malloc((size_t)MT_MAX(sizes[1], 1) * sizeof(float));
            }
            struct comm_p2p_op ops[2] = {{op.kind, op.peer, hh, (size_t)(3 * sizes[0]), COMM_I64},
                                         {op.kind, op.peer, dd, (size_t)sizes[1], COMM_F32}};
            comm_p2p(w, ops, 2);
        } else if (r > 0 || mesh->rank != 0) {
            continue;
        }
        if (mesh->rank == 0) {
            const float *v = dd;
            for (int64_t k = 0; k < sizes[0]; k++) {
                const struct tensor_spec *s = &full->t[hh[3 * k]];
                memcpy(global[tensor_group_of(s)] + s->offset + hh[3 * k + 1], v, (size_t)hh[3 * k + 2] * sizeof(float));
                v += hh[3 * k + 2];
            }
            if (hh != head) free(hh), free(dd);
        }
    }
    comm_free(w);
    for (int i = 0; i < p->m->tt.n; i++) free(rs[i].r);
    free(rs);
    free(head);
    free(data);
    for (int k = 0; k < TG_COUNT; k++) free(shard[k]);
}

static void check_global(const struct tensor_table *tt, int b, float *const global[TG_COUNT])
{
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        const float *v = global[tensor_group_of(s)] + s->offset;
        for (int64_t j = 0; j < s->numel; j++) {
            float want = value(b, i, j, 0);
            if (memcmp(&want, &v[j], sizeof want) != 0) {
                problem("global %s of buffer %d, element %lld: %.9g, want %.9g", s->name, b, (long long)j,
                        (double)v[j], (double)want);
                break;
            }
        }
    }
}

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    if (argc < 5 || argc > 6 || (strcmp(argv[1], "save") && strcmp(argv[1], "load") && strcmp(argv[1], "fail")))
        mt_user_error("usage: ckpt_check save|load|fail DIR EP EP_OUTSIDE [PP]");
    const char *mode = argv[1], *dir = argv[2];
    struct config c;
    config_defaults(&c);
    struct model_config *mc = &c.model;
    mc->vocab_size = 90;          /* dense chunks that split tensors unevenly */
    mc->hidden_size = 24;
    mc->num_hidden_layers = 3;
    mc->num_attention_heads = 4;
    mc->num_key_value_heads = 2;
    mc->head_dim = 6;
    mc->num_experts = 8;
    mc->num_experts_per_tok = 2;
    mc->moe_intermediate_size = 10;   /* 20 gate_up rows: padded on 3 EP_FSDP ranks */
    mc->intermediate_size = 40;
    mc->n_mlp_only_layers = 1;
    mc->mlp_only_layers[0] = 0;
    c.parallel.expert_parallel_size = atoi(argv[3]);
    c.parallel.ep_outside = atoi(argv[4]) != 0;
    c.parallel.pipeline_parallel_size = argc > 5 ? atoi(argv[5]) : 1;
    c.train.seq_len = 8;
    c.train.micro_batch_size = 1;
    c.checkpoint.keep = 2;
    char err[512];
    if (!config_validate(&c, err, sizeof err)) mt_user_error("ckpt_check: %s", err);

    struct mesh mesh;
    mesh_build(&mesh, &c, MPI_COMM_WORLD);
    struct comm *stage = comm_mpi_create(mesh.stage_comm), *ep = comm_mpi_create(mesh.ep_comm);
    struct comm *fsdp = comm_mpi_create(mesh.fsdp_comm);
    struct model m;
    model_init(&m, backend_cpu(), mc, 1, 8, ep, false);
    struct params p;
    params_init(&p, &m, stage, fsdp);
    const int L = mc->num_hidden_layers, E = mc->num_experts;
    float *bias = mt_malloc((size_t)L * E * sizeof(float));

    if (!strcmp(mode, "save")) {
        fill_state(&p, 0);
        for (int j = 0; j < L * E; j++) bias[j] = value(3, 0, j, 0);
        ckpt_save(dir, SAVED_STEP, &p, &mesh, &c, bias);
    } else {
        fill_state(&p, 0x5eed);
        for (int j = 0; j < L * E; j++) bias[j] = -1.0f;
        int step = -1;
        ckpt_load(dir, &p, &mesh, &c, bias, &step);
        if (!strcmp(mode, "fail")) {
            mt_log0("ckpt_check: the load of %s succeeded, a failure was expected\n", dir);
        } else {
            if (step != SAVED_STEP) problem("step %d, want %d", step, SAVED_STEP);
            if (p.step != SAVED_OPT_STEP) problem("optimizer step %d, want %d", p.step, SAVED_OPT_STEP);
            for (int j = 0; j < L * E; j++) {
                float want = value(3, 0, j, 0);
                if (memcmp(&want, &bias[j], sizeof want) != 0) {
                    problem("bias[%d] = %g, want %g", j, (double)bias[j], (double)want);
                    break;
                }
            }
            check_shard(&p);
            float *global[TG_COUNT] = {NULL, NULL};
            if (mesh.rank == 0)
                for (int k = 0; k < TG_COUNT; k++) global[k] = mt_calloc((size_t)MT_MAX(m.tt.group_numel[k], 1), sizeof(float));
            if (mesh.d.pp > 1) {
                /* every stage's own tensors, assembled the way a pipelined export does it */
                struct tensor_table full;
                tensor_table_build(&full, mc);
                for (int b = 0; b <= 2; b++) {
                    if (mesh.rank == 0)
                        for (int k = 0; k < TG_COUNT; k++)
                            memset(global[k], 0xff, (size_t)MT_MAX(full.group_numel[k], 1) * sizeof(float));
                    gather_stages(&p, &mesh, b, &full, global);
                    if (mesh.rank == 0) check_global(&full, b, global);
                }
                tensor_table_free(&full);
            } else {
            params_gather_global(&p, &mesh, global);
            if (mesh.rank == 0) check_global(&m.tt, 0, global);
            }
            for (int b = 1; b <= 2 && mesh.d.pp == 1; b++) {
                if (mesh.rank == 0)
                    for (int k = 0; k < TG_COUNT; k++)
                        memset(global[k], 0xff, (size_t)MT_MAX(m.tt.group_numel[k], 1) * sizeof(float));
                for (int k = 0; k < TG_COUNT; k++) gather_moment(&p, &mesh, b, k, global[k]);
                if (mesh.rank == 0) check_global(&m.tt, b, global);
            }
            for (int k = 0; k < TG_COUNT; k++) free(global[k]);
        }
    }

    int bad = n_problems > 0, any = 0;
    MT_CHECK_MPI(MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    if (bad) fprintf(stderr, "ckpt_check: rank %d: %d problems, first: %s\n", mesh.rank, n_problems, first_problem);
    if (!any) mt_log0("ckpt_check %s: OK on %d ranks (pp %d x ep %d x ep_fsdp %d%s)\n", mode, mesh.d.world, mesh.d.pp, mesh.d.ep,
                      mesh.d.ep_fsdp, mesh.d.ep_outside ? ", ep_outside" : "");
    free(bias);
    params_free(&p);
    model_free(&m);
    comm_free(stage);
    comm_free(ep);
    comm_free(fsdp);
    mesh_free(&mesh);
    MT_CHECK_MPI(MPI_Finalize());
    return any ? 1 : 0;
}
