#include "mem_report.h"

#include <stdio.h>

#include "common.h"
#include "memory_estimate.h"
#include "tensors.h"

static double device_peak;

void mem_report_sample(const struct backend *be)
{
    double used = be->device_used();
    if (used > device_peak) device_peak = used;
}

double mem_report_step_peak(const struct mesh *mesh, int *rank)
{
    struct {
        double v;
        int r;
    } mine = {(double)mem_track_peak(NULL), mesh->rank}, top;
    MT_CHECK_MPI(MPI_Allreduce(&mine, &top, 1, MPI_DOUBLE_INT, MPI_MAXLOC, mesh->world_comm));
    *rank = top.r;
    return top.v;
}

void mem_report_collect(const struct mesh *mesh, struct mem_peak *out)
{
    double by[MEM_N];
    struct {
        double v;
        int r;
    } mine = {(double)mem_track_peak(by), mesh->rank}, top;
    MT_CHECK_MPI(MPI_Allreduce(&mine, &top, 1, MPI_DOUBLE_INT, MPI_MAXLOC, mesh->world_comm));
    MT_CHECK_MPI(MPI_Bcast(by, MEM_N, MPI_DOUBLE, top.r, mesh->world_comm));
    MT_CHECK_MPI(MPI_Allreduce(&device_peak, &out->device_bytes, 1, MPI_DOUBLE, MPI_MAX, mesh->world_comm));
    out->bytes = top.v;
    out->rank = top.r;
    for (int k = 0; k < MEM_N; k++) out->by_cat[k] = by[k];
}

void mem_report_print(const struct config *cfg, const struct mesh *mesh, const struct mem_peak *pk,
                      bool keep_copy, size_t x_size)
{
    if (mesh->rank != 0) return;
    struct config cc = *cfg, *c = &cc;
    if (x_size == 4) c->model.precision = MT_PREC_FP32;   /* the CPU computes in fp32 */
    const bool big = pk->bytes >= 1024.0 * 1024 * 1024;
    const double gib = big ? 1024.0 * 1024 * 1024 : 1024.0 * 1024;
    const char *unit = big ? "GiB" : "MiB";
    struct mesh_coord co;
    mesh_coord_of(&mesh->d, pk->rank, &co);
    struct tensor_table tt;
    tensor_table_build(&tt, &c->model);
    struct stage_estimate e;
    estimate_stage(c, &tt, &mesh->d, co.stage, keep_copy, &e);
    tensor_table_free(&tt);
    const double plan[MEM_N] = {e.param_bytes, e.grad_bytes, e.master_bytes, e.adam_bytes, e.act_bytes,
                                e.buffer_bytes};
    char parts[512];
    int n = 0;
    for (int k = 0; k < MEM_N; k++)
        n += snprintf(parts + n, sizeof parts - (size_t)n, "%s%s %.3f/%.3f", k ? ", " : "",
                      mem_cat_name((enum mem_cat)k), pk->by_cat[k] / gib, plan[k] / gib);
    printf("memory: peak %.3f %s (%.0f bytes) on rank %d, plan %.3f %s (%+.1f%%); measured/plan %s: %s",
           pk->bytes / gib, unit, pk->bytes, pk->rank, e.total_bytes / gib, unit,
           100.0 * (pk->bytes - e.total_bytes) / e.total_bytes, unit, parts);
    if (pk->device_bytes > 0) printf("; device in use %.3f %s", pk->device_bytes / gib, unit);
    printf("\n");
    fflush(stdout);
}
