/* Writing trained weights as a Hugging Face model directory: export_params_hf (any mesh; used by
 * train's checkpoint.export_hf) and `moetrain export CHECKPOINT OUT_DIR`, which does it for a
 * checkpoint on one process. The checkpoint is re-sliced onto a single rank, so the command needs
 * host memory for the whole model's fp32 master weights and moments (about 16 bytes per parameter);
 * for the largest models set checkpoint.export_hf in the training run instead. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "cli.h"
#include "comm.h"
#include "common.h"
#include "hf_export.h"
#include "mesh.h"
#include "model.h"
#include "params.h"

/* One rank's runs of its own stage's tensors: the whole-model tensor, where, how long, and the
 * values (from the shard buffers `shard`). */
struct owned_runs {
    const struct params *p;
    const struct mesh *mesh;
    const struct tensor_table *full;
    float *const *shard;             /* [TG_COUNT] host copies of the rank's buffer */
    int64_t *head;                   /* [3 n]: full tensor index, global element, length */
    float *data;                     /* the runs' values back to back */
    int64_t n, cap, n_data, cap_data;
};

static void collect_owned(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len)
{
    struct owned_runs *o = ctx;
    const struct tensor_spec *s = &o->p->m->tt.t[i];
    if (!mesh_stage_owns(o->mesh, s)) return;
    const int fi = tensor_find(o->full, s->name);
    MT_CHECK(fi >= 0, "export: the stage's tensor %s is not in the model's table", s->name);
    if (o->n == o->cap) o->head = mt_realloc(o->head, (size_t)(o->cap = o->cap ? 2 * o->cap : 64) * 3 * sizeof(int64_t));
    while (o->n_data + len > o->cap_data)
        o->data = mt_realloc(o->data, (size_t)(o->cap_data = o->cap_data ? 2 * o->cap_data : len + 1024) * sizeof(float));
    o->head[3 * o->n] = fi;
    o->head[3 * o->n + 1] = gidx;
    o->head[3 * o->n + 2] = len;
    o->n++;
    memcpy(o->data + o->n_data, o->shard[g] + soff, (size_t)len * sizeof(float));
    o->n_data += len;
}

static void place_runs(const struct tensor_table *full, const int64_t *head, int64_t n, const float *data,
                       float *const global[TG_COUNT])
{
    for (int64_t r = 0; r < n; r++) {
        const struct tensor_spec *s = &full->t[head[3 * r]];
        MT_CHECK(head[3 * r + 1] >= 0 && head[3 * r + 1] + head[3 * r + 2] <= s->numel,
                 "export: a run of %s lies outside it", s->name);
        memcpy(global[tensor_group_of(s)] + s->offset + head[3 * r + 1], data, (size_t)head[3 * r + 2] * sizeof(float));
        data += head[3 * r + 2];
    }
}

void export_gather_global(const struct params *p, const struct mesh *mesh, int buf,
                          const struct tensor_table *full, float *const global[TG_COUNT])
{
    const struct backend *be = p->m->be;
    float *shard[TG_COUNT];
    for (int k = 0; k < TG_COUNT; k++) {
        const struct param_group_shard *g = &p->g[k];
        const float *src = buf == 0 ? g->master : buf == 1 ? g->m1 : g->m2;
        shard[k] = mt_malloc((size_t)MT_MAX(g->numel, 1) * sizeof(float));
        be->download(shard[k], src, (size_t)g->numel * sizeof(float));
    }
    struct owned_runs o = {.p = p, .mesh = mesh, .full = full, .shard = shard};
    params_for_each_run_of(p, p->S_rank, p->F_rank, p->m->expert0, collect_owned, &o);
    const bool mpi = mesh->d.world > 1;
    if (mesh->rank == 0) {
        place_runs(full, o.head, o.n, o.data, global);
        /* one rank at a time: rank 0 holds the model and one shard's runs, never every shard */
        struct comm *w = mpi ? comm_mpi_create(mesh->world_comm) : NULL;
        for (int r = 1; r < mesh->d.world; r++) {
            int64_t sizes[2];
            struct comm_p2p_op op = {COMM_RECV, r, sizes, 2, COMM_I64};
            comm_p2p(w, &op, 1);
            int64_t *head = mt_malloc((size_t)MT_MAX(sizes[0], 1) * 3 * sizeof(int64_t));
            float *data = mt_malloc((size_t)MT_MAX(sizes[1], 1) * sizeof(float));
            struct comm_p2p_op ops[2] = {{COMM_RECV, r, head, (size_t)(3 * sizes[0]), COMM_I64},
                                         {COMM_RECV, r, data, (size_t)sizes[1], COMM_F32}};
            comm_p2p(w, ops, 2);
            place_runs(full, head, sizes[0], data, global);
            free(head);
            free(data);
        }
        comm_free(w);
    } else {
        struct comm *w = comm_mpi_create(mesh->world_comm);
        int64_t sizes[2] = {o.n, o.n_data};
        struct comm_p2p_op ops[3] = {{COMM_SEND, 0, sizes, 2, COMM_I64},
                                     {COMM_SEND, 0, o.head, (size_t)(3 * o.n), COMM_I64},
                                     {COMM_SEND, 0, o.data, (size_t)o.n_data, COMM_F32}};
        comm_p2p(w, ops, 1);
        comm_p2p(w, ops + 1, 2);
        comm_free(w);
    }
    free(o.head);
    free(o.data);
    for (int k = 0; k < TG_COUNT; k++) free(shard[k]);
}

bool export_params_hf(const struct params *p, const struct mesh *mesh, const struct model_config *mc,
                      const char *dir, char *err, int errcap)
{
    /* the file holds the whole model whatever this rank's stage keeps */
    struct tensor_table full;
    tensor_table_build(&full, mc);
    float *global[TG_COUNT] = {NULL, NULL};
    if (mesh->rank == 0)
        for (int g = 0; g < TG_COUNT; g++)
            global[g] = mt_calloc((size_t)MT_MAX(full.group_numel[g], 1), sizeof(float));
    export_gather_global(p, mesh, 0, &full, global);
    bool ok = mesh->rank != 0 || hf_export_model(dir, mc, &full, (const float *const *)global, err, errcap);
    for (int g = 0; g < TG_COUNT; g++) free(global[g]);
    tensor_table_free(&full);
    return ok;
}

int cmd_export(const struct cli *a)
{
    MT_CHECK_MPI(MPI_Init(NULL, NULL));
    if (mt_world() != 1) mt_user_error("export runs on one process (launched on %d)", mt_world());
    /* the saved config's model keys are all explicit; its hf_config may not exist here */
    char *sets[] = {"model.hf_config=", "parallel.pipeline_parallel_size=1", "parallel.pipeline_layers=[]",
                    "parallel.expert_parallel_size=1", "parallel.backend=cpu",
                    "checkpoint.dir=", "checkpoint.export_hf=", "log.metrics="};
    struct config c;
    char err[1024];
    if (!ckpt_read_config(a->model_dir, (int)(sizeof sets / sizeof sets[0]), sets, &c, err, sizeof err))
        mt_user_error("%s", err);
    struct mesh mesh;
    mesh_build(&mesh, &c, MPI_COMM_WORLD);
    struct model m;
    model_init(&m, backend_cpu(), &c.model, 1, 1, NULL, false);
    struct params p;
    params_init(&p, &m, NULL, NULL);
    int step = 0;
    if (!ckpt_load_checked(a->model_dir, &p, &mesh, &c, NULL, &step, true, err, sizeof err))
        mt_user_error("%s", err);
    if (!export_params_hf(&p, &mesh, &c.model, a->reference, err, sizeof err)) mt_user_error("%s", err);
    printf("exported step %d of %s to %s (config.json + model.safetensors, fp32)\n", step, a->model_dir,
           a->reference);
    params_free(&p);
    model_free(&m);
    mesh_free(&mesh);
    MT_CHECK_MPI(MPI_Finalize());
    return 0;
}
