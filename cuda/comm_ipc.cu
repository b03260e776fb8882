/* Copy-engine all-to-all over CUDA IPC (comm_ipc.cuh has the protocol). */
#include "cuda_common.cuh"
#include "comm_ipc.cuh"

#include <stdlib.h>
#include <string.h>

struct ipc_a2a {
    MPI_Comm mpi;
    int rank, size;
    unsigned char **win;       /* [size] every rank's window as mapped here; win[rank] is ours */
    size_t *cap;               /* [size] bytes of each rank's window (0: none yet) */
    cudaEvent_t ready, done;   /* ours, interprocess */
    cudaEvent_t *peer_ready;   /* [size] the other ranks' events, opened here (ours at [rank]) */
    cudaEvent_t *peer_done;    /* [size] */
    cudaStream_t *copy;        /* [size] one copy stream per destination */
    cudaEvent_t *copied;       /* [size] end of the copy to each destination */
    int64_t *meta;             /* [size][1 + 2 size] every rank's {window bytes needed, offset of
                                  each sender's block, bytes expected from each sender} */
};

enum { GROW_ALIGN = 2 << 20 };

/* every rank's GPU, identified by PCI bus id so that ranks with different CUDA_VISIBLE_DEVICES
 * agree; true when this process can map each of them (the same GPU, or peer access over NVLink or
 * PCIe) */
static bool peers_mappable(MPI_Comm mpi, int size)
{
    char mine[32] = {0};
    CUDA_CHECK(cudaDeviceGetPCIBusId(mine, (int)sizeof mine, g_cuda.device));
    char *all = (char *)mt_malloc((size_t)size * sizeof mine);
    MT_CHECK_MPI(MPI_Allgather(mine, (int)sizeof mine, MPI_CHAR, all, (int)sizeof mine, MPI_CHAR, mpi));
    bool ok = true;
    for (int d = 0; d < size && ok; d++) {
        int dev = -1, can = 0;
        if (cudaDeviceGetByPCIBusId(&dev, all + (size_t)d * sizeof mine) != cudaSuccess) {
            (void)cudaGetLastError(); /* not visible to this process (e.g. per-task GPU binding) */
            ok = false;
        } else if (dev != g_cuda.device) {
            CUDA_CHECK(cudaDeviceCanAccessPeer(&can, g_cuda.device, dev));
            ok = can != 0;
        }
    }
    free(all);
    return ok;
}

struct ipc_a2a *ipc_a2a_create(MPI_Comm mpi)
{
    int rank, size, node_size;
    MT_CHECK_MPI(MPI_Comm_rank(mpi, &rank));
    MT_CHECK_MPI(MPI_Comm_size(mpi, &size));
    MPI_Comm node;
    MT_CHECK_MPI(MPI_Comm_split_type(mpi, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
    MT_CHECK_MPI(MPI_Comm_size(node, &node_size));
    MT_CHECK_MPI(MPI_Comm_free(&node));
    const char *env = getenv("MT_COMM_IPC");
    int ok = node_size == size && !(env && !strcmp(env, "0"));
    int all_ok = 0;
    MT_CHECK_MPI(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, mpi));
    if (all_ok) {
        ok = peers_mappable(mpi, size);
        MT_CHECK_MPI(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, mpi));
    }
    if (!all_ok) return NULL;

    struct ipc_a2a *x = (struct ipc_a2a *)mt_calloc(1, sizeof *x);
    x->mpi = mpi;
    x->rank = rank;
    x->size = size;
    x->win = (unsigned char **)mt_calloc((size_t)size, sizeof *x->win);
    x->cap = (size_t *)mt_calloc((size_t)size, sizeof *x->cap);
    x->peer_ready = (cudaEvent_t *)mt_calloc((size_t)size, sizeof(cudaEvent_t));
    x->peer_done = (cudaEvent_t *)mt_calloc((size_t)size, sizeof(cudaEvent_t));
    x->copy = (cudaStream_t *)mt_calloc((size_t)size, sizeof(cudaStream_t));
    x->copied = (cudaEvent_t *)mt_calloc((size_t)size, sizeof(cudaEvent_t));
    x->meta = (int64_t *)mt_malloc((size_t)size * (1 + 2 * (size_t)size) * sizeof(int64_t));

    const unsigned flags = cudaEventDisableTiming | cudaEventInterprocess;
    CUDA_CHECK(cudaEventCreateWithFlags(&x->ready, flags));
    CUDA_CHECK(cudaEventCreateWithFlags(&x->done, flags));
    cudaIpcEventHandle_t mine[2], *all = (cudaIpcEventHandle_t *)mt_malloc((size_t)size * sizeof mine);
    CUDA_CHECK(cudaIpcGetEventHandle(&mine[0], x->ready));
    CUDA_CHECK(cudaIpcGetEventHandle(&mine[1], x->done));
    MT_CHECK_MPI(MPI_Allgather(mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, mpi));
    for (int d = 0; d < size; d++) {
        if (d == rank) {
            x->peer_ready[d] = x->ready;
            x->peer_done[d] = x->done;
        } else {
            CUDA_CHECK(cudaIpcOpenEventHandle(&x->peer_ready[d], all[2 * d]));
            CUDA_CHECK(cudaIpcOpenEventHandle(&x->peer_done[d], all[2 * d + 1]));
        }
        CUDA_CHECK(cudaStreamCreateWithFlags(&x->copy[d], cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&x->copied[d], cudaEventDisableTiming));
    }
    free(all);
    return x;
}

static void drain(struct ipc_a2a *x)
{
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    for (int d = 0; d < x->size; d++) CUDA_CHECK(cudaStreamSynchronize(x->copy[d]));
    MT_CHECK_MPI(MPI_Barrier(x->mpi)); /* nobody reads or writes any window any more */
}

/* Every rank whose window is smaller than need[d] replaces it. No transfer is in flight anywhere
 * once drain() returns; the other ranks unmap a window before its owner frees it (freeing memory
 * another process still maps is undefined). */
static void grow(struct ipc_a2a *x, const int64_t *need)
{
    drain(x);
    const int me = x->rank;
    for (int d = 0; d < x->size; d++)
        if (d != me && x->win[d] && (size_t)need[d] > x->cap[d]) {
            CUDA_CHECK(cudaIpcCloseMemHandle(x->win[d]));
            x->win[d] = NULL;
        }
    MT_CHECK_MPI(MPI_Barrier(x->mpi));
    if (!x->win[me] || (size_t)need[me] > x->cap[me]) {
        if (x->win[me]) {
            mem_track_free(x->win[me]);
            CUDA_CHECK(cudaFree(x->win[me]));
        }
        size_t c = (size_t)need[me] + (size_t)need[me] / 4;
        c = (c + GROW_ALIGN - 1) / GROW_ALIGN * GROW_ALIGN;
        if (c == 0) c = GROW_ALIGN;
        cudaError_t e = cudaMalloc((void **)&x->win[me], c);
        if (e != cudaSuccess)
            mt_fatal("all-to-all receive window: cudaMalloc(%zu bytes): %s", c, cudaGetErrorString(e));
        x->cap[me] = c;
        enum mem_cat was = mem_track_set(MEM_BUFFERS);
        mem_track_alloc(x->win[me], c);
        mem_track_set(was);
    }
    struct {
        cudaIpcMemHandle_t h;
        size_t cap;
    } mine, *all = NULL;
    CUDA_CHECK(cudaIpcGetMemHandle(&mine.h, x->win[me]));
    mine.cap = x->cap[me];
    all = (decltype(all))mt_malloc((size_t)x->size * sizeof mine);
    MT_CHECK_MPI(MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, x->mpi));
    for (int d = 0; d < x->size; d++)
        if (d != me && !x->win[d]) {
            CUDA_CHECK(cudaIpcOpenMemHandle((void **)&x->win[d], all[d].h, cudaIpcMemLazyEnablePeerAccess));
            x->cap[d] = all[d].cap;
        }
    free(all);
}

const void *ipc_a2a_run(struct ipc_a2a *x, const size_t *recv_bytes, const void *send,
                        const size_t *send_bytes)
{
    const int P = x->size, me = x->rank;
    const size_t row = 1 + 2 * (size_t)P;
    int64_t mine[row];
    int64_t total = 0;
    for (int s = 0; s < P; s++) {
        mine[1 + s] = total;
        mine[1 + P + s] = (int64_t)recv_bytes[s];
        total += (int64_t)recv_bytes[s];
    }
    mine[0] = total;
    CUDA_CHECK(cudaEventRecord(x->ready, g_cuda.stream));
    MT_CHECK_MPI(MPI_Allgather(mine, (int)row, MPI_INT64_T, x->meta, (int)row, MPI_INT64_T, x->mpi));

    bool grows = false;
    int64_t need[P];
    for (int d = 0; d < P; d++) {
        const int64_t *m = x->meta + (size_t)d * row;
        MT_CHECK(m[1 + P + me] == (int64_t)send_bytes[d],
                 "all_to_all: rank %d sends %zu bytes to rank %d, which expects %lld", me,
                 send_bytes[d], d, (long long)m[1 + P + me]);
        need[d] = m[0];
        grows |= !x->win[d] || (size_t)need[d] > x->cap[d];
    }
    if (grows) grow(x, need);

    size_t send_off[P];
    send_off[0] = 0;
    for (int d = 1; d < P; d++) send_off[d] = send_off[d - 1] + send_bytes[d - 1];
    for (int i = 0; i < P; i++) {
        const int d = (me + i) % P; /* start with the next rank: no window is everyone's first */
        const int64_t *m = x->meta + (size_t)d * row;
        CUDA_CHECK(cudaStreamWaitEvent(x->copy[d], x->ready, 0));
        if (d != me) CUDA_CHECK(cudaStreamWaitEvent(x->copy[d], x->peer_ready[d], 0));
        if (send_bytes[d])
            CUDA_CHECK(cudaMemcpyAsync(x->win[d] + m[1 + me], (const unsigned char *)send + send_off[d],
                                       send_bytes[d], cudaMemcpyDeviceToDevice, x->copy[d]));
        CUDA_CHECK(cudaEventRecord(x->copied[d], x->copy[d]));
    }
    for (int d = 0; d < P; d++)
        if (d != me) CUDA_CHECK(cudaStreamWaitEvent(x->copy[me], x->copied[d], 0));
    CUDA_CHECK(cudaEventRecord(x->done, x->copy[me]));
    MT_CHECK_MPI(MPI_Barrier(x->mpi)); /* every rank's `done` is recorded before anyone waits on it */
    for (int d = 0; d < P; d++) CUDA_CHECK(cudaStreamWaitEvent(g_cuda.stream, x->peer_done[d], 0));
    return x->win[me];
}

void ipc_a2a_free(struct ipc_a2a *x)
{
    if (!x) return;
    drain(x);
    for (int d = 0; d < x->size; d++) {
        if (d == x->rank) continue;
        if (x->win[d]) CUDA_CHECK(cudaIpcCloseMemHandle(x->win[d]));
        CUDA_CHECK(cudaEventDestroy(x->peer_ready[d]));
        CUDA_CHECK(cudaEventDestroy(x->peer_done[d]));
    }
    MT_CHECK_MPI(MPI_Barrier(x->mpi)); /* unmapped and detached everywhere before anything is freed */
    if (x->win[x->rank]) {
        mem_track_free(x->win[x->rank]);
        CUDA_CHECK(cudaFree(x->win[x->rank]));
    }
    for (int d = 0; d < x->size; d++) {
        CUDA_CHECK(cudaStreamDestroy(x->copy[d]));
        CUDA_CHECK(cudaEventDestroy(x->copied[d]));
    }
    CUDA_CHECK(cudaEventDestroy(x->ready));
    CUDA_CHECK(cudaEventDestroy(x->done));
    free(x->win), free(x->cap), free(x->peer_ready), free(x->peer_done), free(x->copy);
    free(x->copied), free(x->meta), free(x);
}
