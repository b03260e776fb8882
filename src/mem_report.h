/* Measured memory per rank against the plan: the peak of moetrain's tracked allocations
 * (mem_track.h) and, on a GPU, of the device's used memory, maxed over ranks. */
#ifndef MT_MEM_REPORT_H
#define MT_MEM_REPORT_H

#include "config.h"
#include "mem_track.h"
#include "mesh.h"
#include "ops.h"

struct mem_peak {
    double bytes;             /* max over ranks of the tracked peak */
    int rank;                 /* the rank that had it */
    double by_cat[MEM_N];     /* that rank's breakdown at its peak */
    double device_bytes;      /* max over ranks of the device's used memory (0 on the CPU) */
};

/* Samples this rank's device memory into the running maximum (cheap; call once per step). */
void mem_report_sample(const struct backend *be);
/* Collective: the largest tracked peak so far over the ranks (one small all-reduce), and its rank. */
double mem_report_step_peak(const struct mesh *mesh, int *rank);
/* Collective over the mesh's world. */
void mem_report_collect(const struct mesh *mesh, struct mem_peak *out);
/* Rank 0: one line "memory: peak ... (params .., grads .., ...); plan .. for that rank's stage". */
void mem_report_print(const struct config *c, const struct mesh *mesh, const struct mem_peak *pk,
                      bool keep_copy, size_t x_size);

#endif
