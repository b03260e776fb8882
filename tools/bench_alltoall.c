/* Micro-benchmark of the MoE dispatch traffic: the variable all-to-all of token rows through the
 * comm layer, at the size of one Qwen3-30B-A3B layer's dispatch: T tokens x top-8 rows of hidden
 * 2048 in bf16 per rank, spread evenly over the EP ranks. Four lines: all_to_all_inbox, which the
 * MoE layer uses (copy engines over CUDA IPC when the ranks share a host, else NCCL; MPI on the
 * CPU), one call at a time, back to back, and back to back without the copy of the block to self
 * (as the MoE's self-last exchanges run it); then all_to_all_v into a caller's buffer (NCCL
 * point-to-point on GPUs).
 *
 *   mpirun -np 2 build/tools/bench_alltoall [tokens_per_rank [reps]]   (default 8192 tokens, 20)
 *
 * Reports, per rank pair direction, the bytes that cross to OTHER ranks over the median time of
 * one all-to-all (the "GB/s per direction"), or over the mean time of calls queued back to
 * back. Payloads are random and checked once: every received row carries its sender's tag.
 * Without a GPU the MPI implementation is measured. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "bench_util.h"
#include "common.h"
#include "ops.h"
#ifdef MT_HAVE_NCCL
#include "comm_nccl.h"
#endif

/* elements of recv (P blocks of n, the compute dtype) that do not carry their sender's tag */
static int64_t wrong_elements(const struct backend *be, float *host, const void *recv, int P,
                              int64_t n, int rank)
{
    float *back = be->alloc((size_t)(P * n) * sizeof(float));
    be->cast_x_to_f32(back, recv, (size_t)(P * n));
    be->download(host, back, (size_t)(P * n) * sizeof(float));
    be->free(back);
    int64_t bad = 0;
    for (int s = 0; s < P; s++)
        for (int64_t i = 0; i < n; i++) bad += host[s * n + i] != (float)s + 0.25f * (float)(rank % 4);
    return bad;
}

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    int rank = mt_rank(), P = mt_world();
    const int64_t tokens = argc > 1 ? atoll(argv[1]) : 8192;
    const int reps = argc > 2 ? atoi(argv[2]) : 20;
    if (tokens <= 0 || reps <= 0) mt_user_error("usage: bench_alltoall [tokens_per_rank > 0 [reps > 0]]");
    const int64_t H = 2048, K = 8, rows = tokens * K;
    MPI_Comm node;
    int local = 0;
    MT_CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
    MT_CHECK_MPI(MPI_Comm_rank(node, &local));
    const struct backend *be = backend_cuda(false, local);
    struct comm *c = NULL;
#ifdef MT_HAVE_NCCL
    if (be) c = comm_nccl_create(MPI_COMM_WORLD);
#endif
    if (!be) be = backend_cpu();
    if (!c) c = comm_mpi_create(MPI_COMM_WORLD);
    enum comm_dtype dt = comm_dtype_of_x(be->x_size);
    size_t es = be->x_size;

    int64_t *counts = mt_malloc((size_t)P * sizeof(int64_t));
    for (int r = 0; r < P; r++) counts[r] = (rows / P + (r < rows % P)) * H;
    int64_t total = 0;
    for (int r = 0; r < P; r++) total += counts[r];
    /* every rank sends the same split, so what a rank receives from each peer is counts[rank] */
    int64_t *recv_counts = mt_malloc((size_t)P * sizeof(int64_t));
    for (int r = 0; r < P; r++) recv_counts[r] = counts[rank];
    int64_t recv_total = (int64_t)P * counts[rank];

    /* payload: fp32 tag = sender rank + 0.25 * (destination block), cast to the compute dtype */
    float *host = mt_malloc((size_t)MT_MAX(total, recv_total) * sizeof(float));
    int64_t o = 0;
    for (int r = 0; r < P; r++)
        for (int64_t i = 0; i < counts[r]; i++) host[o++] = (float)rank + 0.25f * (float)(r % 4);
    float *tmp = be->alloc((size_t)total * sizeof(float));
    void *send = be->alloc((size_t)total * es), *recv = be->alloc((size_t)recv_total * es);
    be->upload(tmp, host, (size_t)total * sizeof(float));
    be->cast_f32_to_x(send, tmp, (size_t)total);
    be->free(tmp);

    comm_all_to_all_v(c, recv, recv_counts, send, counts, dt);
    int64_t bad = wrong_elements(be, host, recv, P, counts[rank], rank);
    MT_CHECK(bad == 0, "all_to_all_v delivered %lld wrong elements", (long long)bad);
    for (int round = 0; round < 2; round++) { /* twice: the second reuses the window */
        const void *in = comm_all_to_all_inbox(c, recv_counts, send, counts, dt);
        be->zero(recv, (size_t)recv_total * es);
        be->copy(recv, in, (size_t)recv_total * es);
    }
    bad = wrong_elements(be, host, recv, P, counts[rank], rank);
    MT_CHECK(bad == 0, "all_to_all_inbox delivered %lld wrong elements", (long long)bad);

    double *ms = mt_malloc((size_t)reps * sizeof(double));
    const double cross = (double)(total - counts[rank]) * (double)es; /* bytes leaving this rank */
    for (int inbox = 1; inbox >= 0; inbox--) {
        for (int it = -3; it < reps; it++) {
            be->sync();
            MT_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
            double t0 = mt_now();
            if (inbox) (void)comm_all_to_all_inbox(c, recv_counts, send, counts, dt);
            else comm_all_to_all_v(c, recv, recv_counts, send, counts, dt);
            be->sync();
            if (it >= 0) ms[it] = 1e3 * (mt_now() - t0);
        }
        bench_sort_doubles(ms, reps);
        const double med = ms[reps / 2];
        if (rank == 0)
            printf("%s over %d ranks (%s, %s): %lld tokens x top-%lld x %lld per rank, %.1f MB leave "
                   "each rank; median %.3f ms -> %.1f GB/s per direction per rank\n",
                   inbox ? "all_to_all_inbox (MoE path)" : "all_to_all_v", P, be->name,
                   es == 2 ? "bf16" : "fp32", (long long)tokens, (long long)K, (long long)H,
                   cross / 1e6, med, cross / (med * 1e-3) / 1e9);
        if (!inbox) continue;
        /* as the training step queues them: one after another, no host wait in between */
        be->sync();
        MT_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        double t0 = mt_now();
        for (int it = 0; it < reps; it++) (void)comm_all_to_all_inbox(c, recv_counts, send, counts, dt);
        be->sync();
        const double each = 1e3 * (mt_now() - t0) / reps;
        if (rank == 0)
            printf("all_to_all_inbox, %d back to back: %.3f ms each -> %.1f GB/s per direction per rank\n",
                   reps, each, cross / (each * 1e-3) / 1e9);
        /* the same without the copy of the block to self, as the MoE's self-last exchanges run
         * (parallel.moe_combine_self_last: the combine writes its own rows straight into the
         * inbox, the fixed exchange's all-gather skips them): on the copy engines the block to
         * self shares the HBM with the transfer to the peer */
        be->sync();
        MT_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        t0 = mt_now();
        for (int it = 0; it < reps; it++) {
            struct comm_p2p_req req;
            (void)comm_all_to_all_inbox_start_self_later(c, recv_counts, send, counts, dt, &req);
            comm_p2p_wait(c, &req);
        }
        be->sync();
        const double each_others = 1e3 * (mt_now() - t0) / reps;
        if (rank == 0)
            printf("all_to_all_inbox, %d back to back, no copy to self: %.3f ms each -> %.1f GB/s per "
                   "direction per rank\n", reps, each_others, cross / (each_others * 1e-3) / 1e9);
    }
    be->free(send);
    be->free(recv);
    free(host);
    free(ms);
    free(counts);
    free(recv_counts);
    comm_free(c);
    MT_CHECK_MPI(MPI_Comm_free(&node));
    MT_CHECK_MPI(MPI_Finalize());
    return 0;
}
