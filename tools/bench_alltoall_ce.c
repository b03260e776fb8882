/* Experiment: which way of moving the MoE all-to-all between GPUs of one host is fastest. Each
 * mode moves the same payload as tools/bench_alltoall (one layer's top-8 rows of hidden 2048 in
 * bf16 per rank, split evenly over the ranks) and reports the same number (bytes leaving each rank
 * over the median time), so the lines compare directly with NCCL's point-to-point as the comm layer
 * uses it (252 GB/s per direction between two H200s, docs/benchmarks.md):
 *
 *   nccl        ncclSend/ncclRecv group on cudaMalloc buffers (what comm_nccl does today)
 *   nccl-reg    the same group on ncclMemAlloc buffers registered with ncclCommRegister (NCCL
 *               writes straight into the peer's receive buffer instead of through its FIFO)
 *   nccl-regc   the same on cudaMalloc buffers registered with ncclCommRegister
 *   nccl-ce     ncclAlltoAll on ncclMemAlloc buffers in symmetric windows, communicator created
 *               with NCCL_CTA_POLICY_ZERO (NCCL moves it with the copy engines; equal splits only)
 *   ipc         CUDA IPC: each rank writes its block for peer d straight into d's receive buffer
 *               with cudaMemcpyAsync (copy engines, no SMs), one stream per peer
 *   ipc4        the same with each block cut in 4 pieces on 4 streams (more copy engines at once)
 *
 *   mpirun -np N --bind-to none build/tools/bench_alltoall_ce MODE [tokens_per_rank [reps]]
 *
 * Every received element is checked once (it carries its sender's rank). Without CUDA or NCCL in
 * the build, or without a GPU, it prints why and exits 0. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "common.h"

#if defined(MT_HAVE_CUDA) && defined(MT_HAVE_NCCL)
#include <cuda_runtime_api.h>
#include <nccl.h>

#define NC_CHECK(call)                                                                         \
    do {                                                                                       \
        ncclResult_t r_ = (call);                                                              \
        if (r_ != ncclSuccess) mt_fatal("%s: %s", #call, ncclGetErrorString(r_));              \
    } while (0)

enum { MAX_PIECES = 4 };

struct bench {
    const char *mode;
    int rank, P, pieces;
    size_t block;           /* bytes for one destination */
    uint8_t *send, *recv;   /* [P * block] each */
    bool nccl_mem;          /* send/recv came from ncclMemAlloc */
    ncclComm_t nccl;
    void *reg_send, *reg_recv;
    ncclWindow_t win_send, win_recv;
    uint8_t **peer;         /* [P] receive buffers of the peers (IPC modes) */
    cudaStream_t main, side[64 * MAX_PIECES];
    cudaEvent_t start, done[64 * MAX_PIECES];
};

static void nccl_setup(struct bench *b, bool cta_zero)
{
    ncclUniqueId id;
    if (b->rank == 0) NC_CHECK(ncclGetUniqueId(&id));
    MT_CHECK_MPI(MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    if (cta_zero) cfg.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    NC_CHECK(ncclCommInitRankConfig(&b->nccl, b->P, id, b->rank, &cfg));
}

static void buffers(struct bench *b, bool nccl_mem)
{
    const size_t n = b->block * (size_t)b->P;
    b->nccl_mem = nccl_mem;
    if (nccl_mem) {
        NC_CHECK(ncclMemAlloc((void **)&b->send, n));
        NC_CHECK(ncclMemAlloc((void **)&b->recv, n));
    } else {
        CUDA_CALL(cudaMalloc((void **)&b->send, n));
        CUDA_CALL(cudaMalloc((void **)&b->recv, n));
    }
    CUDA_CALL(cudaMemset(b->send, b->rank + 1, n)); /* every byte names the sender */
    CUDA_CALL(cudaMemset(b->recv, 0, n));
}

static void ipc_setup(struct bench *b)
{
    cudaIpcMemHandle_t mine, *all = mt_malloc((size_t)b->P * sizeof *all);
    CUDA_CALL(cudaIpcGetMemHandle(&mine, b->recv));
    MT_CHECK_MPI(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, MPI_COMM_WORLD));
    b->peer = mt_calloc((size_t)b->P, sizeof *b->peer);
    for (int d = 0; d < b->P; d++) {
        if (d == b->rank) b->peer[d] = b->recv;
        else CUDA_CALL(cudaIpcOpenMemHandle((void **)&b->peer[d], all[d], cudaIpcMemLazyEnablePeerAccess));
    }
    free(all);
}

/* one all-to-all, queued on b->main (IPC modes fan out to side streams and join back) */
static void step(struct bench *b)
{
    const size_t blk = b->block;
    if (!strcmp(b->mode, "nccl-ce")) {
        NC_CHECK(ncclAlltoAll(b->send, b->recv, blk, ncclUint8, b->nccl, b->main));
        return;
    }
    if (!strncmp(b->mode, "nccl", 4)) {
        NC_CHECK(ncclGroupStart());
        for (int p = 0; p < b->P; p++) {
            NC_CHECK(ncclSend(b->send + (size_t)p * blk, blk, ncclUint8, p, b->nccl, b->main));
            NC_CHECK(ncclRecv(b->recv + (size_t)p * blk, blk, ncclUint8, p, b->nccl, b->main));
        }
        NC_CHECK(ncclGroupEnd());
        return;
    }
    /* IPC: every rank's receive buffer must be free before anyone writes into it */
    CUDA_CALL(cudaStreamSynchronize(b->main));
    MT_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    const size_t piece = blk / (size_t)b->pieces;
    for (int i = 0; i < b->P; i++) {
        const int d = (b->rank + i) % b->P; /* start with the next rank: no destination hit by all */
        for (int k = 0; k < b->pieces; k++) {
            const int s = d * b->pieces + k;
            const size_t off = (size_t)k * piece, len = k == b->pieces - 1 ? blk - off : piece;
            CUDA_CALL(cudaMemcpyAsync(b->peer[d] + (size_t)b->rank * blk + off, b->send + (size_t)d * blk + off,
                                     len, cudaMemcpyDeviceToDevice, b->side[s]));
        }
    }
    for (int s = 0; s < b->P * b->pieces; s++) CUDA_CALL(cudaStreamSynchronize(b->side[s]));
    MT_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD)); /* every write into every buffer is done */
}

static void run(struct bench *b, int64_t tokens, int reps)
{
    MPI_Comm node;
    int local = 0, n_dev = 0;
    MT_CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
    MT_CHECK_MPI(MPI_Comm_rank(node, &local));
    MT_CHECK_MPI(MPI_Comm_free(&node));
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        if (b->rank == 0) printf("bench_alltoall_ce %s: skipped: no GPU\n", b->mode);
        return;
    }
    CUDA_CALL(cudaSetDevice(local % n_dev));
    MT_CHECK(b->P <= 64, "at most 64 ranks");
    b->block = (size_t)(tokens * 8 / b->P) * 2048 * 2 / 4096 * 4096; /* window alignment */
    CUDA_CALL(cudaStreamCreateWithFlags(&b->main, cudaStreamNonBlocking));

    const char *m = b->mode;
    if (!strcmp(m, "nccl")) {
        nccl_setup(b, false);
        buffers(b, false);
    } else if (!strcmp(m, "nccl-reg") || !strcmp(m, "nccl-regc")) {
        nccl_setup(b, false);
        buffers(b, !strcmp(m, "nccl-reg"));
        NC_CHECK(ncclCommRegister(b->nccl, b->send, b->block * b->P, &b->reg_send));
        NC_CHECK(ncclCommRegister(b->nccl, b->recv, b->block * b->P, &b->reg_recv));
    } else if (!strcmp(m, "nccl-ce")) {
        nccl_setup(b, true);
        buffers(b, true);
        NC_CHECK(ncclCommWindowRegister(b->nccl, b->send, b->block * b->P, &b->win_send, NCCL_WIN_COLL_SYMMETRIC));
        NC_CHECK(ncclCommWindowRegister(b->nccl, b->recv, b->block * b->P, &b->win_recv, NCCL_WIN_COLL_SYMMETRIC));
    } else if (!strcmp(m, "ipc") || !strcmp(m, "ipc4")) {
        b->pieces = !strcmp(m, "ipc4") ? 4 : 1;
        buffers(b, false);
        ipc_setup(b);
        for (int s = 0; s < b->P * b->pieces; s++)
            CUDA_CALL(cudaStreamCreateWithFlags(&b->side[s], cudaStreamNonBlocking));
    } else {
        mt_user_error("bench_alltoall_ce: unknown mode '%s' (nccl, nccl-reg, nccl-regc, nccl-ce, ipc, ipc4)", m);
    }

    double *ms = mt_malloc((size_t)reps * sizeof *ms);
    for (int it = -3; it < reps; it++) {
        CUDA_CALL(cudaStreamSynchronize(b->main));
        MT_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        const double t0 = mt_now();
        step(b);
        CUDA_CALL(cudaStreamSynchronize(b->main));
        if (it >= 0) ms[it] = 1e3 * (mt_now() - t0);
    }

    const size_t n = b->block * (size_t)b->P;
    uint8_t *host = mt_malloc(n);
    CUDA_CALL(cudaMemcpy(host, b->recv, n, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int s = 0; s < b->P; s++)
        for (size_t i = 0; i < b->block; i++) bad += host[(size_t)s * b->block + i] != (uint8_t)(s + 1);
    MT_CHECK(bad == 0, "%s all-to-all delivered %lld wrong bytes", m, (long long)bad);

    bench_sort_doubles(ms, reps);
    const double med = ms[reps / 2], cross = (double)b->block * (b->P - 1);
    if (b->rank == 0)
        printf("[%s] all-to-all over %d ranks: %lld tokens x top-8 x 2048 bf16 per rank, %.1f MB leave "
               "each rank; median %.3f ms (min %.3f) -> %.1f GB/s per direction per rank\n",
               m, b->P, (long long)tokens, cross / 1e6, med, ms[0], cross / (med * 1e-3) / 1e9);

    if (b->win_send) NC_CHECK(ncclCommWindowDeregister(b->nccl, b->win_send));
    if (b->win_recv) NC_CHECK(ncclCommWindowDeregister(b->nccl, b->win_recv));
    if (b->reg_send) NC_CHECK(ncclCommDeregister(b->nccl, b->reg_send));
    if (b->reg_recv) NC_CHECK(ncclCommDeregister(b->nccl, b->reg_recv));
    if (b->peer)
        for (int d = 0; d < b->P; d++)
            if (d != b->rank) CUDA_CALL(cudaIpcCloseMemHandle(b->peer[d]));
    if (b->nccl) NC_CHECK(ncclCommDestroy(b->nccl));
    if (b->nccl_mem) {
        NC_CHECK(ncclMemFree(b->send));
        NC_CHECK(ncclMemFree(b->recv));
    } else {
        CUDA_CALL(cudaFree(b->send));
        CUDA_CALL(cudaFree(b->recv));
    }
    free(b->peer), free(ms), free(host);
}
#endif

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    const int rank = mt_rank(), P = mt_world();
    if (argc < 2) mt_user_error("usage: bench_alltoall_ce MODE [tokens_per_rank > 0 [reps > 0]]");
    const int64_t tokens = argc > 2 ? atoll(argv[2]) : 8192;
    const int reps = argc > 3 ? atoi(argv[3]) : 20;
    if (tokens <= 0 || reps <= 0) mt_user_error("usage: bench_alltoall_ce MODE [tokens_per_rank > 0 [reps > 0]]");
#if defined(MT_HAVE_CUDA) && defined(MT_HAVE_NCCL)
    struct bench b = {.mode = argv[1], .rank = rank, .P = P};
    run(&b, tokens, reps);
#else
    (void)P;
    if (rank == 0) printf("bench_alltoall_ce: skipped: built without CUDA and NCCL\n");
#endif
    MT_CHECK_MPI(MPI_Finalize());
    return 0;
}
