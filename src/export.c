/* Writing trained weights as a Hugging Face model directory: export_params_hf (any mesh; used by
 * train's checkpoint.export_hf) and `moetrain export CHECKPOINT OUT_DIR`, which does it for a
 * checkpoint on one process. The checkpoint is re-sliced onto a single rank, so the command needs
 * host memory for the whole model's fp32 master weights and moments (about 16 bytes per parameter);
 * for the largest models set checkpoint.export_hf in the training run instead. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "checkpoint.h"
#include "cli.h"
#include "common.h"
#include "hf_export.h"
#include "mesh.h"
#include "model.h"
#include "params.h"

bool export_params_hf(const struct params *p, const struct mesh *mesh, const struct model_config *mc,
                      const char *dir, char *err, int errcap)
{
    const struct tensor_table *tt = &p->m->tt;
    float *global[TG_COUNT] = {NULL, NULL};
    if (mesh->rank == 0)
        for (int g = 0; g < TG_COUNT; g++)
            global[g] = mt_calloc((size_t)MT_MAX(tt->group_numel[g], 1), sizeof(float));
    params_gather_global(p, mesh, global);
    bool ok = mesh->rank != 0 || hf_export_model(dir, mc, tt, (const float *const *)global, err, errcap);
    for (int g = 0; g < TG_COUNT; g++) free(global[g]);
    return ok;
}

int cmd_export(const struct cli *a)
{
    MT_CHECK_MPI(MPI_Init(NULL, NULL));
    if (mt_world() != 1) mt_user_error("export runs on one process (launched on %d)", mt_world());
    /* the saved config's model keys are all explicit; its hf_config may not exist here */
    char *sets[] = {"model.hf_config=", "parallel.pipeline_parallel_size=1",
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
