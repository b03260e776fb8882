/* The layout printout shared by `moetrain plan` (one process, no MPI launch), `moetrain train
 * --dry-run` (the real ranks) and train's start-up. Each decides the auto settings for the GPU
 * memory it is given: plan for PLAN_DEVICE_BYTES (none with the CPU backend), the dry run and the
 * training for the job's smallest GPU here (PLAN_DEVICE_BYTES with parallel.backend: cuda and no
 * GPU). For the same config, world size, node placement and GPU memory they print byte-identical
 * text: nothing else host- or time-dependent is printed. */
#ifndef MT_PLAN_H
#define MT_PLAN_H

#include <stdio.h>

#include "config.h"
#include "mesh.h"

/* The device memory `plan` assumes for the auto settings (train.weight_copy, the FSDP ones): an
 * 80 GB GPU. */
#define PLAN_DEVICE_BYTES (80.0 * 1024 * 1024 * 1024)

/* Ranks above which the per-rank table shows only its first and last PLAN_EDGE_ROWS rows. */
#define PLAN_FULL_TABLE_MAX 256
#define PLAN_EDGE_ROWS 64
/* Groups of each kind listed before "... N more". */
#define PLAN_MAX_GROUPS 8

/* Prints the header, the per-rank table, the communicator groups and node warnings to f.
 * node_of_rank: [d->world] node index of every global rank (dense, starting at 0). */
void plan_print(FILE *f, const struct config *c, const struct mesh_dims *d, const int *node_of_rank);

/* The same with one row per pipeline stage when fold is true (every rank of a stage has the same
 * layers, shard shapes and memory): train's start-up table; and with the auto settings resolved
 * for GPUs of device_bytes (plan_print: PLAN_DEVICE_BYTES; train: the job's smallest GPU, 0 on
 * the CPU backend), so that a job's start-up table is the layout it runs. */
void plan_print_opts(FILE *f, const struct config *c, const struct mesh_dims *d, const int *node_of_rank,
                     bool fold, double device_bytes);

/* Collective over m->world_comm: gathers every rank's node index to rank 0, which calls plan_print
 * on f. The other ranks print nothing. */
void plan_print_mesh(FILE *f, const struct config *c, const struct mesh *m);
void plan_print_mesh_opts(FILE *f, const struct config *c, const struct mesh *m, bool fold, double device_bytes);

#endif
