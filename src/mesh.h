/* The [PP, EP, EP_FSDP] grid (design.md "The grid"):
 *   W = pp * S, S = ep * ep_fsdp, global rank g = stage * S + local.
 *   ep_outside false: local = f * ep + e   (consecutive ranks share an EP group)
 *   ep_outside true:  local = e * ep_fsdp + f
 * EP group: same stage, same f (size ep). EP_FSDP group: same stage, same e (size ep_fsdp).
 * Stage group: the S ranks of a stage (FSDP of non-expert weights, data parallel degree S).
 * PP group: same local index across stages. */
#ifndef MT_MESH_H
#define MT_MESH_H

#include <mpi.h>
#include <stdbool.h>

#include "config.h"

struct mesh_coord {
    int stage;      /* pipeline stage, 0..pp-1 */
    int local;      /* index inside the stage, 0..S-1 (also the data-parallel rank) */
    int ep_rank;    /* e, 0..ep-1 */
    int fsdp_rank;  /* f, 0..ep_fsdp-1 */
};

struct mesh_dims {
    int world, pp, ep, ep_fsdp, S;
    bool ep_outside;
};

/* Checks every hard constraint (W % pp, S % ep, E % ep, layers >= pp, positive sizes,
 * heads % kv_heads, pipeline_layers one positive entry per stage summing to the layers) for a world of `world` ranks and fills dims. Returns false with a one-line
 * reason in err. */
bool mesh_dims_of(const struct config *c, int world, struct mesh_dims *d, char *err, int errcap);
void mesh_coord_of(const struct mesh_dims *d, int rank, struct mesh_coord *out);
int mesh_rank_of(const struct mesh_dims *d, int stage, int ep_rank, int fsdp_rank);
/* Layers [*l0, *l1) of a stage: contiguous, sizes differ by at most one, earlier stages larger. */
void mesh_stage_layers(int n_layers, int pp, int stage, int *l0, int *l1);
/* Layers [*l0, *l1) of a stage under config c: parallel.pipeline_layers when given, else the even
 * split above. plan, the memory estimate and mesh_build all use this one. */
void mesh_stage_layers_cfg(const struct config *c, int pp, int stage, int *l0, int *l1);
/* Experts [*e0, *e1) held by EP rank e. */
void mesh_expert_range(int n_experts, int ep, int ep_rank, int *e0, int *e1);

struct mesh {
    struct mesh_dims d;
    int rank;                   /* world rank */
    struct mesh_coord me;
    int node, n_nodes;          /* node index of this rank (from MPI_Comm_split_type), node count */
    int local_rank;             /* index among the ranks of this node (picks the GPU) */
    int layer0, layer1;         /* this stage's layers [layer0, layer1) */
    int expert0, expert1;       /* experts held [expert0, expert1) */
    MPI_Comm world_comm;
    MPI_Comm stage_comm;        /* size S, rank = local */
    MPI_Comm ep_comm;           /* size ep, rank = ep_rank */
    MPI_Comm fsdp_comm;         /* size ep_fsdp, rank = fsdp_rank */
    MPI_Comm pp_comm;           /* size pp, rank = stage */
    MPI_Comm ends_comm;         /* the first and last stage's ranks of this local index (tied
                                 * embedding gradients); size 2 (1 when pp = 1), rank 0 = first
                                 * stage; MPI_COMM_NULL on the middle stages */
};

struct tensor_spec;
/* Whether m's stage is the one that saves, loads as its own and exports tensor s: the stage that
 * runs s's layer; the embedding is the first stage's and the final norm and LM head the last's
 * (a tied embedding the last stage keeps for its head is the first stage's tensor). */
bool mesh_stage_owns(const struct mesh *m, const struct tensor_spec *s);

/* Builds every communicator from `world`. Constraint violations: mt_user_error on every rank. */
void mesh_build(struct mesh *m, const struct config *c, MPI_Comm world);
void mesh_free(struct mesh *m);

#endif
