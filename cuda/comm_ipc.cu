/* Copy-engine all-to-all over CUDA IPC (comm_ipc.cuh has the protocol). */
#include "cuda_common.cuh"
#include "comm_ipc.cuh"

#include <cudaTypedefs.h>
#include <stdlib.h>
#include <string.h>

struct ipc_a2a {
    MPI_Comm mpi;
    int rank, size;
    unsigned char **win;       /* [size] every rank's window as mapped here; win[rank] is ours */
    size_t *cap;               /* [size] bytes of each rank's window (0: none yet) */
    uint32_t *flags;           /* [2 size] ours: ready_from[size], arrived_from[size] (epochs) */
    uint32_t **peer_flags;     /* [size] every rank's flags as mapped here; [rank] is ours */
    uint32_t epoch;            /* calls so far, the same on every rank */
    bool started;              /* ipc_a2a_start ran and ipc_a2a_finish has not yet */
    cudaEvent_t ready;         /* our send data exists (compute stream) */
    cudaStream_t *copy;        /* [size] one copy stream per destination */
    cudaEvent_t *copied;       /* [size] end of the copy to each destination */
    int64_t *meta;             /* [size][1 + 2 size] every rank's {window bytes needed, offset of
                                  each sender's block, bytes expected from each sender} */
};

enum { GROW_ALIGN = 2 << 20 };

/* stream memory operations, through the runtime's driver entry points (no link against libcuda) */
static PFN_cuStreamWaitValue32_v11070 wait_value32;
static PFN_cuStreamWriteValue32_v11070 write_value32;

static bool memops_found(void)
{
    void *w = NULL, *v = NULL;
    cudaDriverEntryPointQueryResult qw, qv;
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &w, 12000, cudaEnableDefault, &qw) != cudaSuccess ||
        cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &v, 12000, cudaEnableDefault, &qv) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    if (qw != cudaDriverEntryPointSuccess || qv != cudaDriverEntryPointSuccess || !w || !v) return false;
    wait_value32 = (PFN_cuStreamWaitValue32_v11070)w;
    write_value32 = (PFN_cuStreamWriteValue32_v11070)v;
    return true;
}

static void memop_check(CUresult r, const char *what, int peer)
{
    if (r != CUDA_SUCCESS)
        mt_fatal("all-to-all: %s (flag of rank %d) failed: CUresult %d", what, peer, (int)r);
}

/* stream waits until flags[i] >= epoch (wrap-safe: the driver compares the signed difference) */
static void flag_wait(cudaStream_t s, const uint32_t *flag, uint32_t epoch, int peer)
{
    memop_check(wait_value32((CUstream)s, (CUdeviceptr)flag, epoch, CU_STREAM_WAIT_VALUE_GEQ),
                "cuStreamWaitValue32", peer);
}

/* stream writes epoch to a flag, after a fence that makes its earlier writes (the copy) visible */
static void flag_set(cudaStream_t s, uint32_t *flag, uint32_t epoch, int peer)
{
    memop_check(write_value32((CUstream)s, (CUdeviceptr)flag, epoch, CU_STREAM_WRITE_VALUE_DEFAULT),
                "cuStreamWriteValue32", peer);
}

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
    int ok = node_size == size && !(env && !strcmp(env, "0")) && memops_found();
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
    x->peer_flags = (uint32_t **)mt_calloc((size_t)size, sizeof *x->peer_flags);
    x->copy = (cudaStream_t *)mt_calloc((size_t)size, sizeof(cudaStream_t));
    x->copied = (cudaEvent_t *)mt_calloc((size_t)size, sizeof(cudaEvent_t));
    x->meta = (int64_t *)mt_malloc((size_t)size * (1 + 2 * (size_t)size) * sizeof(int64_t));

    CUDA_CHECK(cudaEventCreateWithFlags(&x->ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaMalloc((void **)&x->flags, 2 * (size_t)size * sizeof(uint32_t)));
    CUDA_CHECK(cudaMemset(x->flags, 0, 2 * (size_t)size * sizeof(uint32_t)));
    CUDA_CHECK(cudaDeviceSynchronize()); /* zeroed before any peer can write a flag */
    cudaIpcMemHandle_t mine, *all = (cudaIpcMemHandle_t *)mt_malloc((size_t)size * sizeof mine);
    CUDA_CHECK(cudaIpcGetMemHandle(&mine, x->flags));
    MT_CHECK_MPI(MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, mpi));
    for (int d = 0; d < size; d++) {
        if (d == rank)
            x->peer_flags[d] = x->flags;
        else
            CUDA_CHECK(cudaIpcOpenMemHandle((void **)&x->peer_flags[d], all[d], cudaIpcMemLazyEnablePeerAccess));
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

const void *ipc_a2a_start(struct ipc_a2a *x, const size_t *recv_bytes, const void *send,
                          const size_t *send_bytes, bool same_block, bool self_later)
{
    MT_CHECK(!x->started, "all_to_all_inbox: started while the previous one is still in flight");
    x->started = true;
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
    const uint32_t e = ++x->epoch;
    /* everything queued before, the readers of our window included, is done: peers may write it.
     * The copy streams tell them (below), not the compute stream: a flag write is a fenced store
     * to the peer's memory, and on the compute stream the next kernel waited for it (moving it
     * took ~1.5 ms off an EP=2 bench step; docs/benchmarks.md, forty-first session) */
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
    for (int d = 1; d < P; d++) send_off[d] = same_block ? 0 : send_off[d - 1] + send_bytes[d - 1];
    for (int i = 0; i < P; i++) {
        /* the next rank first (no window is everyone's first), the block to self last: the copies
         * over the link are queued before the one that stays on this GPU */
        const int d = (me + 1 + i) % P;
        const int64_t *m = x->meta + (size_t)d * row;
        CUDA_CHECK(cudaStreamWaitEvent(x->copy[d], x->ready, 0));
        if (d != me) {
            flag_set(x->copy[d], x->peer_flags[d] + me, e, d); /* our window is free for d */
            flag_wait(x->copy[d], x->flags + d, e, d);         /* d's window is free */
        }
        if (send_bytes[d] && !(self_later && d == me))
            CUDA_CHECK(cudaMemcpyAsync(x->win[d] + m[1 + me], (const unsigned char *)send + send_off[d],
                                       send_bytes[d], cudaMemcpyDeviceToDevice, x->copy[d]));
        if (d != me) flag_set(x->copy[d], x->peer_flags[d] + P + me, e, d); /* landed in d's window */
        CUDA_CHECK(cudaEventRecord(x->copied[d], x->copy[d]));
    }
    return x->win[me];
}

void ipc_a2a_finish(struct ipc_a2a *x)
{
    MT_CHECK(x->started, "all_to_all_inbox: finished without a start");
    x->started = false;
    const int P = x->size, me = x->rank;
    /* our send buffer is read (every copied[d]) and every block for us has landed */
    for (int d = 0; d < P; d++) {
        CUDA_CHECK(cudaStreamWaitEvent(g_cuda.stream, x->copied[d], 0));
        if (d != me) flag_wait(g_cuda.stream, x->flags + P + d, x->epoch, d);
    }
}

bool ipc_a2a_arrival(const struct ipc_a2a *x, struct exchange_arrival *out)
{
    if (!x->started) return false;
    out->flags = x->flags + x->size; /* arrived_from[d]: written by d's copy into our window */
    out->epoch = x->epoch;
    out->n = x->size;
    out->skip = x->rank;
    return true;
}

const void *ipc_a2a_run(struct ipc_a2a *x, const size_t *recv_bytes, const void *send,
                        const size_t *send_bytes)
{
    const void *win = ipc_a2a_start(x, recv_bytes, send, send_bytes, false, false);
    ipc_a2a_finish(x);
    return win;
}

void ipc_a2a_free(struct ipc_a2a *x)
{
    if (!x) return;
    drain(x);
    for (int d = 0; d < x->size; d++) {
        if (d == x->rank) continue;
        if (x->win[d]) CUDA_CHECK(cudaIpcCloseMemHandle(x->win[d]));
        CUDA_CHECK(cudaIpcCloseMemHandle(x->peer_flags[d]));
    }
    MT_CHECK_MPI(MPI_Barrier(x->mpi)); /* unmapped everywhere before anything is freed */
    if (x->win[x->rank]) {
        mem_track_free(x->win[x->rank]);
        CUDA_CHECK(cudaFree(x->win[x->rank]));
    }
    CUDA_CHECK(cudaFree(x->flags));
    for (int d = 0; d < x->size; d++) {
        CUDA_CHECK(cudaStreamDestroy(x->copy[d]));
        CUDA_CHECK(cudaEventDestroy(x->copied[d]));
    }
    CUDA_CHECK(cudaEventDestroy(x->ready));
    free(x->win), free(x->cap), free(x->peer_flags), free(x->copy), free(x->copied), free(x->meta);
    free(x);
}
