/* mpirun -np N mesh_check PP EP EP_OUTSIDE [LAYERS EXPERTS]
 * Builds the real communicators with mesh_build and checks, with MPI collectives, that each one holds
 * exactly the world ranks design.md "The grid" says, in coordinate order, and that node indices agree
 * with the processor names. Exits non-zero on every rank on any mismatch. An impossible mesh exits
 * through mt_user_error (one line from rank 0, non-zero on every rank). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "mesh.h"

static int problems;

#define EXPECT(cond, ...)                                                  \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "mesh_check: rank %d: ", mt_rank());           \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
            problems++;                                                    \
        }                                                                  \
    } while (0)

/* The design's map, written out independently of mesh.c. */
static int rank_of(int S, int ep, int F, bool outside, int stage, int e, int f)
{
    return stage * S + (outside ? e * F + f : f * ep + e);
}

/* Allgathers the world rank over comm and compares with want[0..n). */
static void check_members(MPI_Comm comm, int world_rank, const int *want, int n, const char *what)
{
    int size = -1;
    MT_CHECK_MPI(MPI_Comm_size(comm, &size));
    EXPECT(size == n, "%s communicator size %d, expected %d", what, size, n);
    if (size != n) return;
    int *got = mt_malloc((size_t)n * sizeof *got);
    MT_CHECK_MPI(MPI_Allgather(&world_rank, 1, MPI_INT, got, 1, MPI_INT, comm));
    for (int i = 0; i < n; i++)
        EXPECT(got[i] == want[i], "%s member %d is world rank %d, expected %d", what, i, got[i], want[i]);
    free(got);
}

static void check_nodes(const struct mesh *m, int world)
{
    char name[MPI_MAX_PROCESSOR_NAME];
    memset(name, 0, sizeof name);
    int len = 0;
    MT_CHECK_MPI(MPI_Get_processor_name(name, &len));
    char *names = mt_malloc((size_t)world * MPI_MAX_PROCESSOR_NAME);
    int *nodes = mt_malloc((size_t)world * sizeof *nodes);
    MT_CHECK_MPI(MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names, MPI_MAX_PROCESSOR_NAME,
                               MPI_CHAR, MPI_COMM_WORLD));
    MT_CHECK_MPI(MPI_Allgather(&m->node, 1, MPI_INT, nodes, 1, MPI_INT, MPI_COMM_WORLD));
    const int me = m->rank;
    int before = 0;  /* ranks on this host with a lower world rank */
    for (int q = 0; q < me; q++)
        before += !strcmp(names + (size_t)q * MPI_MAX_PROCESSOR_NAME, name);
    EXPECT(m->local_rank == before, "local_rank %d, expected %d", m->local_rank, before);
    /* expected node of rank r: how many distinct hosts first appear before r's host does */
    int n_hosts = 0;
    for (int r = 0; r < world; r++) {
        int first = r;
        for (int q = 0; q < r; q++)
            if (!strcmp(names + (size_t)q * MPI_MAX_PROCESSOR_NAME, names + (size_t)r * MPI_MAX_PROCESSOR_NAME)) {
                first = q;
                break;
            }
        if (first == r) {
            EXPECT(nodes[r] == n_hosts, "rank %d starts host %d but has node %d", r, n_hosts, nodes[r]);
            n_hosts++;
        } else {
            EXPECT(nodes[r] == nodes[first], "rank %d node %d differs from rank %d's %d on the same host", r,
                   nodes[r], first, nodes[first]);
        }
    }
    EXPECT(m->n_nodes == n_hosts, "n_nodes %d, expected %d", m->n_nodes, n_hosts);
    free(names);
    free(nodes);
}

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    if (argc != 4 && argc != 6) mt_user_error("usage: mesh_check PP EP EP_OUTSIDE [LAYERS EXPERTS]");
    const int pp = atoi(argv[1]), ep = atoi(argv[2]);
    const bool outside = atoi(argv[3]) != 0;
    int world = 0, rank = 0;
    MT_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world));
    MT_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    const int layers = argc == 6 ? atoi(argv[4]) : 2 * (pp > 0 ? pp : 1) + 1;
    const int experts = argc == 6 ? atoi(argv[5]) : 2 * (ep > 0 ? ep : 1);

    struct config c;
    memset(&c, 0, sizeof c);
    c.model.vocab_size = 64;
    c.model.hidden_size = 32;
    c.model.num_hidden_layers = layers;
    c.model.num_attention_heads = 4;
    c.model.num_key_value_heads = 2;
    c.model.head_dim = 8;
    c.model.num_experts = experts;
    c.model.num_experts_per_tok = 1;
    c.model.moe_intermediate_size = 16;
    c.model.decoder_sparse_step = 1;
    c.parallel.pipeline_parallel_size = pp;
    c.parallel.expert_parallel_size = ep;
    c.parallel.ep_outside = outside;

    struct mesh m;
    mesh_build(&m, &c, MPI_COMM_WORLD);

    const int S = world / pp, F = S / ep;
    /* this rank's coordinates, recovered by search rather than by mesh.c's division */
    int stage = -1, e = -1, f = -1;
    for (int s = 0; s < pp; s++)
        for (int ei = 0; ei < ep; ei++)
            for (int fi = 0; fi < F; fi++)
                if (rank_of(S, ep, F, outside, s, ei, fi) == rank) { stage = s; e = ei; f = fi; }
    EXPECT(stage >= 0, "rank not on the grid");
    EXPECT(m.rank == rank && m.me.stage == stage && m.me.ep_rank == e && m.me.fsdp_rank == f &&
           m.me.local == rank - stage * S, "coords (s%d e%d f%d l%d), expected (s%d e%d f%d)", m.me.stage,
           m.me.ep_rank, m.me.fsdp_rank, m.me.local, stage, e, f);
    EXPECT(m.d.world == world && m.d.pp == pp && m.d.ep == ep && m.d.ep_fsdp == F && m.d.S == S,
           "dims differ");

    int *want = mt_malloc((size_t)world * sizeof *want);
    for (int i = 0; i < S; i++) want[i] = stage * S + i;
    check_members(m.stage_comm, rank, want, S, "stage");
    for (int i = 0; i < ep; i++) want[i] = rank_of(S, ep, F, outside, stage, i, f);
    check_members(m.ep_comm, rank, want, ep, "EP");
    for (int i = 0; i < F; i++) want[i] = rank_of(S, ep, F, outside, stage, e, i);
    check_members(m.fsdp_comm, rank, want, F, "EP_FSDP");
    for (int i = 0; i < pp; i++) want[i] = i * S + (rank - stage * S);
    check_members(m.pp_comm, rank, want, pp, "PP");
    /* the tied-embedding pair: first and last stage of this local index */
    if (stage == 0 || stage == pp - 1) {
        want[0] = rank - stage * S;
        want[1] = (pp - 1) * S + (rank - stage * S);
        check_members(m.ends_comm, rank, want, pp > 1 ? 2 : 1, "ends");
    } else {
        EXPECT(m.ends_comm == MPI_COMM_NULL, "a middle stage has an ends communicator");
    }
    for (int i = 0; i < world; i++) want[i] = i;
    check_members(m.world_comm, rank, want, world, "world");
    free(want);

    /* the EP group's expert ranges tile [0, E) in order */
    int range[2] = {m.expert0, m.expert1};
    int *ranges = mt_malloc((size_t)ep * 2 * sizeof *ranges);
    MT_CHECK_MPI(MPI_Allgather(range, 2, MPI_INT, ranges, 2, MPI_INT, m.ep_comm));
    for (int i = 0; i < ep; i++)
        EXPECT(ranges[2 * i] == i * experts / ep && ranges[2 * i + 1] == (i + 1) * experts / ep,
               "EP member %d holds experts [%d,%d)", i, ranges[2 * i], ranges[2 * i + 1]);
    free(ranges);
    /* the PP group's layer ranges tile [0, L) */
    int lr[2] = {m.layer0, m.layer1};
    int *lrs = mt_malloc((size_t)pp * 2 * sizeof *lrs);
    MT_CHECK_MPI(MPI_Allgather(lr, 2, MPI_INT, lrs, 2, MPI_INT, m.pp_comm));
    EXPECT(lrs[0] == 0 && lrs[2 * pp - 1] == layers, "layers do not start at 0 and end at %d", layers);
    for (int i = 1; i < pp; i++) EXPECT(lrs[2 * i] == lrs[2 * i - 1], "stage %d does not continue stage %d", i, i - 1);
    free(lrs);

    check_nodes(&m, world);

    int bad = problems, any = 0;
    MT_CHECK_MPI(MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    mesh_free(&m);
    if (rank == 0 && !any) printf("mesh_check: %d ranks, pp %d ep %d ep_fsdp %d ep_outside %d: ok\n", world, pp, ep, F, outside);
    MT_CHECK_MPI(MPI_Finalize());
    return any ? 1 : 0;
}
