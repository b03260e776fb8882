/* Experiment: the MoE all-to-all moved by the GPUs' copy engines instead of NCCL's kernels.
 * Each rank exposes one receive buffer through CUDA IPC; every rank writes its block for peer d
 * straight into d's buffer with cudaMemcpyAsync on its own stream per peer (no SMs involved),
 * then all ranks synchronise. Same payload size and GB/s definition as tools/bench_alltoall.c (one
 * layer's top-8 rows of hidden 2048 in bf16, bytes leaving each rank over the median time), so the
 * two numbers compare directly. Not used by training: it measures whether this path beats NCCL's
 * point-to-point between two H200s (252 GB/s per direction, docs/benchmarks.md) before the comm
 * layer gets such a path.
 *
 *   mpirun -np N --bind-to none build/tools/bench_alltoall_ce [tokens_per_rank [reps]]
 *
 * Every received element is checked once (it carries its sender's rank). Without CUDA in the build
 * or without a GPU it prints why and exits 0. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#ifdef MT_HAVE_CUDA
#include <cuda_runtime_api.h>

#define CE_CHECK(call)                                                                         \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) mt_fatal("%s: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
    } while (0)

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void run(int rank, int P, int64_t tokens, int reps)
{
    MPI_Comm node;
    int local = 0, n_dev = 0;
    MT_CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
    MT_CHECK_MPI(MPI_Comm_rank(node, &local));
    MT_CHECK_MPI(MPI_Comm_free(&node));
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        if (rank == 0) printf("bench_alltoall_ce: skipped: no GPU\n");
        return;
    }
    CE_CHECK(cudaSetDevice(local % n_dev));
    /* one block of bf16 rows per destination: rows / P each, as bench_alltoall's even split */
    const size_t block = (size_t)(tokens * 8 / P) * 2048 * 2;
    uint8_t *send, *recv;
    CE_CHECK(cudaMalloc((void **)&send, block * P));
    CE_CHECK(cudaMalloc((void **)&recv, block * P));
    CE_CHECK(cudaMemset(send, rank + 1, block * P)); /* every byte names the sender */
    CE_CHECK(cudaMemset(recv, 0, block * P));

    cudaIpcMemHandle_t mine, *all = mt_malloc((size_t)P * sizeof *all);
    CE_CHECK(cudaIpcGetMemHandle(&mine, recv));
    MT_CHECK_MPI(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, MPI_COMM_WORLD));
    uint8_t **peer = mt_calloc((size_t)P, sizeof *peer);
    cudaStream_t *st = mt_malloc((size_t)P * sizeof *st);
    for (int d = 0; d < P; d++) {
        if (d == rank) peer[d] = recv;
        else CE_CHECK(cudaIpcOpenMemHandle((void **)&peer[d], all[d], cudaIpcMemLazyEnablePeerAccess));
        CE_CHECK(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking));
    }

    double *ms = mt_malloc((size_t)reps * sizeof *ms);
    for (int it = -3; it < reps; it++) {
        MT_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        const double t0 = mt_now();
        /* start with the next rank so that no destination is written by everyone at once */
        for (int i = 0; i < P; i++) {
            const int d = (rank + i) % P;
            CE_CHECK(cudaMemcpyAsync(peer[d] + (size_t)rank * block, send + (size_t)d * block, block,
                                     cudaMemcpyDeviceToDevice, st[d]));
        }
        for (int d = 0; d < P; d++) CE_CHECK(cudaStreamSynchronize(st[d]));
        MT_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD)); /* every write into every buffer is done */
        if (it >= 0) ms[it] = 1e3 * (mt_now() - t0);
    }

    uint8_t *host = mt_malloc(block * P);
    CE_CHECK(cudaMemcpy(host, recv, block * P, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int s = 0; s < P; s++)
        for (size_t i = 0; i < block; i++) bad += host[(size_t)s * block + i] != (uint8_t)(s + 1);
    MT_CHECK(bad == 0, "copy-engine all-to-all delivered %lld wrong bytes", (long long)bad);

    qsort(ms, (size_t)reps, sizeof *ms, cmp_double);
    const double med = ms[reps / 2], cross = (double)block * (P - 1);
    if (rank == 0)
        printf("copy-engine all-to-all over %d ranks (CUDA IPC, bf16): %lld tokens x top-8 x 2048 per "
               "rank, %.1f MB leave each rank; median %.3f ms -> %.1f GB/s per direction per rank\n",
               P, (long long)tokens, cross / 1e6, med, cross / (med * 1e-3) / 1e9);

    for (int d = 0; d < P; d++) {
        if (d != rank) CE_CHECK(cudaIpcCloseMemHandle(peer[d]));
        CE_CHECK(cudaStreamDestroy(st[d]));
    }
    CE_CHECK(cudaFree(send));
    CE_CHECK(cudaFree(recv));
    free(all), free(peer), free(st), free(ms), free(host);
}
#endif

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    const int rank = mt_rank(), P = mt_world();
    const int64_t tokens = argc > 1 ? atoll(argv[1]) : 8192;
    const int reps = argc > 2 ? atoi(argv[2]) : 20;
    if (tokens <= 0 || reps <= 0) mt_user_error("usage: bench_alltoall_ce [tokens_per_rank > 0 [reps > 0]]");
#ifdef MT_HAVE_CUDA
    run(rank, P, tokens, reps);
#else
    if (rank == 0) printf("bench_alltoall_ce: skipped: built without CUDA\n");
#endif
    MT_CHECK_MPI(MPI_Finalize());
    return 0;
}
