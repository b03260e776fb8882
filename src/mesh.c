/* The [PP, EP, EP_FSDP] grid: constraint checks, coordinate maps and the MPI communicators.
 * Formulas: mesh.h (design.md "The grid"). */
#include "mesh.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "tensors.h"

static bool fail(char *err, int errcap, const char *msg)
{
    if (err && errcap > 0) snprintf(err, (size_t)errcap, "%s", msg);
    return false;
}

bool mesh_dims_of(const struct config *c, int world, struct mesh_dims *d, char *err, int errcap)
{
    const struct model_config *m = &c->model;
    const int pp = c->parallel.pipeline_parallel_size, ep = c->parallel.expert_parallel_size;
    char msg[256];
    memset(d, 0, sizeof *d);

    /* Positive sizes first: the divisibility messages below would be meaningless otherwise. */
    const struct { const char *name; int v; } pos[] = {
        {"world size", world},
        {"parallel.pipeline_parallel_size", pp},
        {"parallel.expert_parallel_size", ep},
        {"model.num_hidden_layers", m->num_hidden_layers},
        {"model.num_attention_heads", m->num_attention_heads},
        {"model.num_key_value_heads", m->num_key_value_heads},
    };
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++) {
        if (pos[i].v <= 0) {
            snprintf(msg, sizeof msg, "%s must be positive, got %d", pos[i].name, pos[i].v);
            return fail(err, errcap, msg);
        }
    }
    if (m->num_experts < 0) {
        snprintf(msg, sizeof msg, "model.num_experts must be 0 (dense) or positive, got %d", m->num_experts);
        return fail(err, errcap, msg);
    }
    if (world % pp) {
        snprintf(msg, sizeof msg, "world size %d is not divisible by pipeline_parallel_size %d", world, pp);
        return fail(err, errcap, msg);
    }
    const int S = world / pp;
    if (S % ep) {
        snprintf(msg, sizeof msg,
                 "ranks per stage %d (world size %d / pipeline_parallel_size %d) is not divisible by "
                 "expert_parallel_size %d", S, world, pp, ep);
        return fail(err, errcap, msg);
    }
    if (m->num_experts > 0 && m->num_experts % ep) {
        snprintf(msg, sizeof msg, "num_experts %d is not divisible by expert_parallel_size %d",
                 m->num_experts, ep);
        return fail(err, errcap, msg);
    }
    if (m->num_hidden_layers < pp) {
        snprintf(msg, sizeof msg,
                 "num_hidden_layers %d is smaller than pipeline_parallel_size %d (every stage needs a layer)",
                 m->num_hidden_layers, pp);
        return fail(err, errcap, msg);
    }
    const struct parallel_config *pc = &c->parallel;
    if (pc->n_pipeline_layers > 0) {
        int sum = 0, smallest = INT_MAX;
        for (int i = 0; i < pc->n_pipeline_layers; i++) {
            sum += pc->pipeline_layers[i];
            smallest = MT_MIN(smallest, pc->pipeline_layers[i]);
        }
        if (pc->n_pipeline_layers != pp || sum != m->num_hidden_layers || smallest < 1) {
            snprintf(msg, sizeof msg,
                     "parallel.pipeline_layers has %d entries summing to %d (smallest %d), but needs "
                     "one entry >= 1 per stage (%d) summing to num_hidden_layers %d",
                     pc->n_pipeline_layers, sum, smallest, pp, m->num_hidden_layers);
            return fail(err, errcap, msg);
        }
    }
    if (m->num_attention_heads % m->num_key_value_heads) {
        snprintf(msg, sizeof msg, "num_attention_heads %d is not divisible by num_key_value_heads %d",
                 m->num_attention_heads, m->num_key_value_heads);
        return fail(err, errcap, msg);
    }
    d->world = world;
    d->pp = pp;
    d->ep = ep;
    d->S = S;
    d->ep_fsdp = S / ep;
    d->ep_outside = c->parallel.ep_outside;
    return true;
}

void mesh_coord_of(const struct mesh_dims *d, int rank, struct mesh_coord *out)
{
    out->stage = rank / d->S;
    out->local = rank % d->S;
    if (d->ep_outside) {
        out->ep_rank = out->local / d->ep_fsdp;
        out->fsdp_rank = out->local % d->ep_fsdp;
    } else {
        out->ep_rank = out->local % d->ep;
        out->fsdp_rank = out->local / d->ep;
    }
}

int mesh_rank_of(const struct mesh_dims *d, int stage, int ep_rank, int fsdp_rank)
{
    int local = d->ep_outside ? ep_rank * d->ep_fsdp + fsdp_rank : fsdp_rank * d->ep + ep_rank;
    return stage * d->S + local;
}

void mesh_stage_layers(int n_layers, int pp, int stage, int *l0, int *l1)
{
    int base = n_layers / pp, extra = n_layers % pp;
    *l0 = stage * base + MT_MIN(stage, extra);
    *l1 = *l0 + base + (stage < extra ? 1 : 0);
}

void mesh_stage_layers_cfg(const struct config *c, int pp, int stage, int *l0, int *l1)
{
    const struct parallel_config *p = &c->parallel;
    if (p->n_pipeline_layers != pp) {
        mesh_stage_layers(c->model.num_hidden_layers, pp, stage, l0, l1);
        return;
    }
    *l0 = 0;
    for (int s = 0; s < stage; s++) *l0 += p->pipeline_layers[s];
    *l1 = *l0 + p->pipeline_layers[stage];
}

bool mesh_stage_owns(const struct mesh *m, const struct tensor_spec *s)
{
    if (m->d.pp <= 1) return true;   /* (also meshes built by hand, without layer ranges) */
    if (s->layer >= 0) return s->layer >= m->layer0 && s->layer < m->layer1;
    if (s->role == TR_EMBED) return m->me.stage == 0;
    return m->me.stage == m->d.pp - 1;
}

void mesh_expert_range(int n_experts, int ep, int ep_rank, int *e0, int *e1)
{
    int per = n_experts / ep;
    *e0 = per * ep_rank;
    *e1 = *e0 + per;
}

/* Split `parent` so that the new communicator's rank equals `key`; checks it did. */
static MPI_Comm split_checked(MPI_Comm parent, int color, int key, int want_size, const char *what)
{
    MPI_Comm out = MPI_COMM_NULL;
    int size = 0, rank = 0;
    MT_CHECK_MPI(MPI_Comm_split(parent, color, key, &out));
    MT_CHECK_MPI(MPI_Comm_size(out, &size));
    MT_CHECK_MPI(MPI_Comm_rank(out, &rank));
    MT_CHECK(size == want_size && rank == key, "%s communicator has size %d rank %d, expected %d and %d",
             what, size, rank, want_size, key);
    return out;
}

/* Node index = rank of this node's leader (its lowest world rank) among all leaders ordered by world
 * rank, so node indices follow the launcher's rank placement. local_rank orders a node's ranks by
 * world rank. */
static void detect_nodes(MPI_Comm world, int rank, int *node, int *n_nodes, int *local_rank)
{
    MPI_Comm node_comm = MPI_COMM_NULL, leaders = MPI_COMM_NULL;
    int node_rank = 0;
    MT_CHECK_MPI(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node_comm));
    MT_CHECK_MPI(MPI_Comm_rank(node_comm, &node_rank));
    *local_rank = node_rank;
    MT_CHECK_MPI(MPI_Comm_split(world, node_rank == 0 ? 0 : MPI_UNDEFINED, rank, &leaders));
    int info[2] = {0, 0};
    if (node_rank == 0) {
        MT_CHECK_MPI(MPI_Comm_rank(leaders, &info[0]));
        MT_CHECK_MPI(MPI_Comm_size(leaders, &info[1]));
        MT_CHECK_MPI(MPI_Comm_free(&leaders));
    }
    MT_CHECK_MPI(MPI_Bcast(info, 2, MPI_INT, 0, node_comm));
    MT_CHECK_MPI(MPI_Comm_free(&node_comm));
    *node = info[0];
    *n_nodes = info[1];
}

void mesh_build(struct mesh *m, const struct config *c, MPI_Comm world)
{
    memset(m, 0, sizeof *m);
    m->world_comm = m->stage_comm = m->ep_comm = m->fsdp_comm = m->pp_comm = m->ends_comm = MPI_COMM_NULL;
    int size = 0, rank = 0;
    MT_CHECK_MPI(MPI_Comm_size(world, &size));
    MT_CHECK_MPI(MPI_Comm_rank(world, &rank));
    char err[512];
    /* Every rank evaluates the same config and world size, so all fail together: no hang. */
    if (!mesh_dims_of(c, size, &m->d, err, sizeof err))
        mt_user_error("%s%s%s", c->path, c->path[0] ? ": " : "", err);

    const struct mesh_dims *d = &m->d;
    m->rank = rank;
    mesh_coord_of(d, rank, &m->me);
    mesh_stage_layers_cfg(c, d->pp, m->me.stage, &m->layer0, &m->layer1);
    if (c->model.num_experts > 0)
        mesh_expert_range(c->model.num_experts, d->ep, m->me.ep_rank, &m->expert0, &m->expert1);

    MT_CHECK_MPI(MPI_Comm_dup(world, &m->world_comm));
    const struct mesh_coord *me = &m->me;
    m->stage_comm = split_checked(world, me->stage, me->local, d->S, "stage");
    m->ep_comm = split_checked(world, me->stage * d->ep_fsdp + me->fsdp_rank, me->ep_rank, d->ep, "EP");
    m->fsdp_comm = split_checked(world, me->stage * d->ep + me->ep_rank, me->fsdp_rank, d->ep_fsdp,
                                 "EP_FSDP");
    m->pp_comm = split_checked(world, me->local, me->stage, d->pp, "PP");
    const bool end = me->stage == 0 || me->stage == d->pp - 1;
    MT_CHECK_MPI(MPI_Comm_split(world, end ? me->local : MPI_UNDEFINED, me->stage, &m->ends_comm));
    detect_nodes(world, rank, &m->node, &m->n_nodes, &m->local_rank);
}

void mesh_free(struct mesh *m)
{
    MPI_Comm *all[] = {&m->world_comm, &m->stage_comm, &m->ep_comm, &m->fsdp_comm, &m->pp_comm,
                       &m->ends_comm};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (*all[i] != MPI_COMM_NULL) MT_CHECK_MPI(MPI_Comm_free(all[i]));
}
