/* The comm table over NCCL (src/comm_nccl.h): collectives on device buffers, on the CUDA
 * backend's stream. Variable all-to-all is one NCCL group of point-to-point sends and receives
 * (the block to self is a device copy); all_to_all_inbox uses the copy engines instead when every
 * rank is on this host (comm_ipc.cuh), else the same NCCL group into a buffer of its own. Buffers that are all host memory go to the MPI twin of the
 * same communicator. NVLink multicast (NVLS) is never asked for: NCCL_NVLS_ENABLE is forced to 0
 * unless the environment already sets it. Every live communicator is registered with the watchdog
 * (src/watchdog.h): its thread polls ncclCommGetAsyncError and, when it fires, ncclCommAbort
 * ends whatever NCCL kernel still waits for a stopped or dead peer. */
#include "cuda_common.cuh"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "comm.h"
#include "moe_timeline.h"
#include "watchdog.h"
}
#include "comm_ipc.cuh"
#include "memory.cuh"
#include "comm_nccl.h"

struct nccl_impl {
    ncclComm_t nccl;
    struct comm *host;   /* MPI implementation of the same communicator, for host buffers */
    struct ipc_a2a *ipc; /* copy-engine all_to_all_inbox when every rank is on this host */
    void *inbox;         /* all_to_all_inbox's buffer otherwise (NCCL moves the data) */
    size_t inbox_cap;
    cudaStream_t side;   /* p2p_start's and all_gather_start's transfers (created on first use) */
};

static struct nccl_impl *impl_of(struct comm *c) { return (struct nccl_impl *)c->impl; }

/* The communicators the watchdog thread may poll and abort (created and destroyed on the main
 * thread; a handful per process). */
enum { MAX_LIVE = 64 };
static pthread_mutex_t g_live_mu = PTHREAD_MUTEX_INITIALIZER;
static ncclComm_t g_live[MAX_LIVE];
static int g_n_live;

static bool poll_live(char *why, int cap)
{
    bool ok = true;
    pthread_mutex_lock(&g_live_mu);
    for (int i = 0; i < g_n_live && ok; i++) {
        ncclResult_t async = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(g_live[i], &async);
        if (r == ncclSuccess && (async == ncclSuccess || async == ncclInProgress)) continue;
        snprintf(why, (size_t)cap, "NCCL reports an asynchronous error: %s",
                 ncclGetErrorString(r != ncclSuccess ? r : async));
        ok = false;
    }
    pthread_mutex_unlock(&g_live_mu);
    return ok;
}

/* Without the lock: it runs once, right before the process ends, and must wait on nothing. */
static void abort_live(void)
{
    for (int i = 0; i < g_n_live; i++) ncclCommAbort(g_live[i]);
    g_n_live = 0;
}

static void register_live(ncclComm_t c)
{
    pthread_mutex_lock(&g_live_mu);
    MT_CHECK(g_n_live < MAX_LIVE, "comm_nccl: more than %d NCCL communicators", MAX_LIVE);
    g_live[g_n_live++] = c;
    pthread_mutex_unlock(&g_live_mu);
    watchdog_set_nccl_hooks(poll_live, abort_live);
}

static void unregister_live(ncclComm_t c)
{
    pthread_mutex_lock(&g_live_mu);
    for (int i = 0; i < g_n_live; i++)
        if (g_live[i] == c) g_live[i] = g_live[--g_n_live];
    pthread_mutex_unlock(&g_live_mu);
}

static ncclDataType_t nccl_type(enum comm_dtype t)
{
    switch (t) {
    case COMM_F32: return ncclFloat32;
    case COMM_F64: return ncclFloat64;
    case COMM_I32: return ncclInt32;
    case COMM_I64: return ncclInt64;
    case COMM_BYTE: return ncclUint8;
    case COMM_BF16: return ncclBfloat16;
    }
    mt_fatal("comm_nccl: unknown dtype %d", (int)t);
}

static bool is_device(const void *p)
{
    if (!p) return false;
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

/* true when the call's buffers are host memory (the MPI twin runs it); a zero-sized side (NULL
 * or an unused pointer) follows the other */
static bool on_host(const char *what, const void *a, size_t na, const void *b, size_t nb)
{
    if (na == 0 && nb == 0) return !is_device(a) && !is_device(b);
    if (na == 0) return !is_device(b);
    if (nb == 0) return !is_device(a);
    const bool da = is_device(a), db = is_device(b);
    MT_CHECK(da == db, "%s: one buffer is device memory and the other host memory", what);
    return !da;
}

static void nccl_all_gather(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t)
{
    struct nccl_impl *im = impl_of(c);
    if (on_host("all_gather", recv, n, send, n)) {
        im->host->ops->all_gather(im->host, recv, send, n, t);
        return;
    }
    const size_t es = comm_dtype_size(t);
    /* send == recv means "in place": this rank's block already sits at recv[rank·n] (MPI_IN_PLACE) */
    const void *src = send == recv ? (const char *)recv + (size_t)c->rank * n * es : send;
    NCCL_CHECK(ncclAllGather(src, recv, n, nccl_type(t), im->nccl, g_cuda.stream));
}

static void nccl_reduce_scatter_sum(struct comm *c, void *recv, const void *send, size_t n,
                                    enum comm_dtype t)
{
    struct nccl_impl *im = impl_of(c);
    if (on_host("reduce_scatter_sum", recv, n, send, n)) {
        im->host->ops->reduce_scatter_sum(im->host, recv, send, n, t);
        return;
    }
    NCCL_CHECK(ncclReduceScatter(send, recv, n, nccl_type(t), ncclSum, im->nccl, g_cuda.stream));
}

static void nccl_all_reduce_sum(struct comm *c, void *buf, size_t n, enum comm_dtype t)
{
    struct nccl_impl *im = impl_of(c);
    if (on_host("all_reduce_sum", buf, n, buf, n)) {
        im->host->ops->all_reduce_sum(im->host, buf, n, t);
        return;
    }
    NCCL_CHECK(ncclAllReduce(buf, buf, n, nccl_type(t), ncclSum, im->nccl, g_cuda.stream));
}

/* counts are elements; blocks packed back to back in rank order on both sides */
static void exchange_on(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                        const int64_t *send_counts, size_t fixed, enum comm_dtype t, cudaStream_t stream)
{
    struct nccl_impl *im = impl_of(c);
    const size_t es = comm_dtype_size(t);
    const ncclDataType_t nt = nccl_type(t);
    size_t so = 0, ro = 0;
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < c->size; p++) {
        const size_t sn = send_counts ? (size_t)send_counts[p] : fixed;
        const size_t rn = recv_counts ? (size_t)recv_counts[p] : fixed;
        const char *sp = (const char *)send + so * es;
        char *rp = (char *)recv + ro * es;
        if (p == c->rank) {
            MT_CHECK(sn == rn, "all_to_all_v: rank %d sends %zu elements to itself but expects %zu",
                     p, sn, rn);
            cu_copy_on(rp, sp, sn * es, stream);
        } else {
            if (sn) NCCL_CHECK(ncclSend(sp, sn, nt, p, im->nccl, stream));
            if (rn) NCCL_CHECK(ncclRecv(rp, rn, nt, p, im->nccl, stream));
        }
        so += sn;
        ro += rn;
    }
    NCCL_CHECK(ncclGroupEnd());
}

static void exchange(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                     const int64_t *send_counts, size_t fixed, enum comm_dtype t)
{
    exchange_on(c, recv, recv_counts, send, send_counts, fixed, t, g_cuda.stream);
}

static size_t total(const int64_t *counts, int n)
{
    size_t s = 0;
    for (int i = 0; i < n; i++) {
        MT_CHECK(counts[i] >= 0, "all_to_all_v: negative count %lld for rank %d", (long long)counts[i], i);
        s += (size_t)counts[i];
    }
    return s;
}

static void nccl_all_to_all_v(struct comm *c, void *recv, const int64_t *recv_counts,
                              const void *send, const int64_t *send_counts, enum comm_dtype t)
{
    struct nccl_impl *im = impl_of(c);
    if (on_host("all_to_all_v", recv, total(recv_counts, c->size), send, total(send_counts, c->size))) {
        im->host->ops->all_to_all_v(im->host, recv, recv_counts, send, send_counts, t);
        return;
    }
    exchange(c, recv, recv_counts, send, send_counts, 0, t);
}

static void nccl_all_to_all(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t)
{
    struct nccl_impl *im = impl_of(c);
    if (on_host("all_to_all", recv, n, send, n)) {
        im->host->ops->all_to_all(im->host, recv, send, n, t);
        return;
    }
    exchange(c, recv, NULL, send, NULL, n, t);
}

/* the NCCL-moved inbox (no copy-engine path), holding at least `bytes` */
static void *nccl_inbox_of(struct nccl_impl *im, size_t bytes)
{
    if (bytes > im->inbox_cap) {
        if (im->inbox) {
            CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
            mem_track_free(im->inbox);
            CUDA_CHECK(cudaFree(im->inbox));
        }
        im->inbox_cap = bytes + bytes / 4;
        CUDA_CHECK(cudaMalloc(&im->inbox, im->inbox_cap));
        enum mem_cat was = mem_track_set(MEM_BUFFERS);
        mem_track_alloc(im->inbox, im->inbox_cap);
        mem_track_set(was);
    }
    return im->inbox;
}

static const void *nccl_all_to_all_inbox(struct comm *c, const int64_t *recv_counts,
                                         const void *send, const int64_t *send_counts,
                                         enum comm_dtype t)
{
    struct nccl_impl *im = impl_of(c);
    const size_t es = comm_dtype_size(t), n_out = total(send_counts, c->size);
    const size_t n_in = total(recv_counts, c->size);
    MT_CHECK(n_out == 0 || is_device(send), "all_to_all_inbox: the send buffer is not device memory");
    if (im->ipc) {
        size_t rb[c->size], sb[c->size];
        for (int p = 0; p < c->size; p++) {
            rb[p] = (size_t)recv_counts[p] * es;
            sb[p] = (size_t)send_counts[p] * es;
        }
        return ipc_a2a_run(im->ipc, rb, send, sb);
    }
    exchange(c, nccl_inbox_of(im, n_in * es), recv_counts, send, send_counts, 0, t);
    return im->inbox;
}

/* 1 when every sized op's buffer is host memory, 0 when all are device memory, -1 when none
 * has a size; a mix is an error. Also checks the peers. */
static int p2p_on_host(struct comm *c, const struct comm_p2p_op *ops, int n)
{
    int n_dev = 0, n_sized = 0;
    for (int i = 0; i < n; i++) {
        MT_CHECK(ops[i].peer >= 0 && ops[i].peer < c->size && ops[i].peer != c->rank,
                 "p2p: peer %d is not another rank of a group of %d (this is rank %d)", ops[i].peer,
                 c->size, c->rank);
        if (!ops[i].count) continue;
        n_sized++;
        n_dev += is_device(ops[i].buf);
    }
    if (n_sized == 0) return -1;
    MT_CHECK(n_dev == 0 || n_dev == n_sized, "p2p: %d of %d buffers are device memory (mixed)", n_dev,
             n_sized);
    return n_dev == 0;
}

static void p2p_group(struct nccl_impl *im, const struct comm_p2p_op *ops, int n, cudaStream_t stream)
{
    NCCL_CHECK(ncclGroupStart());
    for (int i = 0; i < n; i++) {
        const struct comm_p2p_op *o = &ops[i];
        if (!o->count) continue;
        if (o->kind == COMM_SEND)
            NCCL_CHECK(ncclSend(o->buf, o->count, nccl_type(o->dtype), o->peer, im->nccl, stream));
        else
            NCCL_CHECK(ncclRecv(o->buf, o->count, nccl_type(o->dtype), o->peer, im->nccl, stream));
    }
    NCCL_CHECK(ncclGroupEnd());
}

/* One ncclGroup on the backend's stream: asynchronous like every op here (what follows on the stream
 * sees the data). All-host op lists go to the MPI twin. */
static void nccl_p2p(struct comm *c, const struct comm_p2p_op *ops, int n)
{
    struct nccl_impl *im = impl_of(c);
    const int host = p2p_on_host(c, ops, n);
    if (host == 1) im->host->ops->p2p(im->host, ops, n);
    else if (host == 0) p2p_group(im, ops, n, g_cuda.stream);
}

struct nccl_p2p_state {
    struct comm_p2p_req host;  /* the MPI twin's request for host buffers */
    cudaEvent_t done;          /* recorded on the side stream after the group */
    bool ipc;                  /* a started copy-engine inbox exchange instead (ipc_a2a_finish) */
};

/* A started host-memory twin's request as this comm's (nothing when it ran to completion). */
static void wrap_host(const struct comm_p2p_req *host, struct comm_p2p_req *r)
{
    if (!host->state) return;
    struct nccl_p2p_state *st = (struct nccl_p2p_state *)mt_calloc(1, sizeof *st);
    st->host = *host;
    r->state = st;
}

/* The group goes on the side stream once the compute stream's queued work (which wrote the send
 * buffers and last read the receive buffers) is done. */
static void side_begin(struct nccl_impl *im);
static void side_end(struct nccl_impl *im, struct nccl_p2p_state *st);

static void nccl_p2p_start(struct comm *c, const struct comm_p2p_op *ops, int n, struct comm_p2p_req *r)
{
    struct nccl_impl *im = impl_of(c);
    r->state = NULL;
    const int host = p2p_on_host(c, ops, n);
    if (host < 0) return;
    struct nccl_p2p_state *st = (struct nccl_p2p_state *)mt_calloc(1, sizeof *st);
    if (host == 1) {
        im->host->ops->p2p_start(im->host, ops, n, &st->host);
    } else {
        side_begin(im);
        p2p_group(im, ops, n, im->side);
        side_end(im, st);
    }
    r->state = st;
}

/* The side stream runs after everything already queued on the main stream (the buffers' producers). */
static void side_begin(struct nccl_impl *im)
{
    if (!im->side) CUDA_CHECK(cudaStreamCreateWithFlags(&im->side, cudaStreamNonBlocking));
    cudaEvent_t ready;
    CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(ready, g_cuda.stream));
    CUDA_CHECK(cudaStreamWaitEvent(im->side, ready, 0));
    CUDA_CHECK(cudaEventDestroy(ready));
}

static void side_end(struct nccl_impl *im, struct nccl_p2p_state *st)
{
    CUDA_CHECK(cudaEventCreateWithFlags(&st->done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(st->done, im->side));
}

/* fsdp.c's prefetch: the all-gather on the side stream, overlapping the compute queued after it
 * on the main stream; p2p_wait makes the main stream wait for it. */
static void nccl_all_gather_start(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t,
                                  struct comm_p2p_req *r)
{
    struct nccl_impl *im = impl_of(c);
    r->state = NULL;
    if (on_host("all_gather", recv, n, send, n)) {
        struct comm_p2p_req host = {NULL};
        im->host->ops->all_gather_start(im->host, recv, send, n, t, &host);
        wrap_host(&host, r);
        return;
    }
    const size_t es = comm_dtype_size(t);
    const void *src = send == recv ? (const char *)recv + (size_t)c->rank * n * es : send;
    struct nccl_p2p_state *st = (struct nccl_p2p_state *)mt_calloc(1, sizeof *st);
    side_begin(im);
    NCCL_CHECK(ncclAllGather(src, recv, n, nccl_type(t), im->nccl, im->side));
    side_end(im, st);
    r->state = st;
}

/* moe_exchange.c's overlapped row exchanges: like all_gather_start. The spans on the side stream
 * go into the MoE timeline when it is recording (timeline.h). */
static void nccl_all_to_all_v_start(struct comm *c, void *recv, const int64_t *recv_counts,
                                    const void *send, const int64_t *send_counts, enum comm_dtype t,
                                    struct comm_p2p_req *r)
{
    struct nccl_impl *im = impl_of(c);
    r->state = NULL;
    if (on_host("all_to_all_v", recv, total(recv_counts, c->size), send, total(send_counts, c->size))) {
        struct comm_p2p_req host = {NULL};
        im->host->ops->all_to_all_v_start(im->host, recv, recv_counts, send, send_counts, t, &host);
        wrap_host(&host, r);
        return;
    }
    struct nccl_p2p_state *st = (struct nccl_p2p_state *)mt_calloc(1, sizeof *st);
    side_begin(im);
    moe_timeline_comm_mark(im->side, 0);
    exchange_on(c, recv, recv_counts, send, send_counts, 0, t, im->side);
    moe_timeline_comm_mark(im->side, 1);
    side_end(im, st);
    r->state = st;
}

/* fsdp.c's overlapped gradient reduction: like all_gather_start (in place when
 * recv == send + rank * n, NCCL's own convention) */
static void nccl_reduce_scatter_sum_start(struct comm *c, void *recv, const void *send, size_t n,
                                          enum comm_dtype t, struct comm_p2p_req *r)
{
    struct nccl_impl *im = impl_of(c);
    r->state = NULL;
    if (on_host("reduce_scatter_sum", recv, n, send, n)) {
        struct comm_p2p_req host = {NULL};
        im->host->ops->reduce_scatter_sum_start(im->host, recv, send, n, t, &host);
        wrap_host(&host, r);
        return;
    }
    struct nccl_p2p_state *st = (struct nccl_p2p_state *)mt_calloc(1, sizeof *st);
    side_begin(im);
    NCCL_CHECK(ncclReduceScatter(send, recv, n, nccl_type(t), ncclSum, im->nccl, im->side));
    side_end(im, st);
    r->state = st;
}

static void nccl_p2p_wait(struct comm *c, struct comm_p2p_req *r)
{
    struct nccl_impl *im = impl_of(c);
    struct nccl_p2p_state *st = (struct nccl_p2p_state *)r->state;
    if (!st) return;
    if (st->ipc) {
        ipc_a2a_finish(im->ipc);
    } else if (st->host.state) {
        im->host->ops->p2p_wait(im->host, &st->host);
    } else {
        CUDA_CHECK(cudaStreamWaitEvent(g_cuda.stream, st->done, 0));
        CUDA_CHECK(cudaEventDestroy(st->done));
    }
    free(st);
    r->state = NULL;
}

static void nccl_destroy(struct comm *c)
{
    struct nccl_impl *im = impl_of(c);
    if (!im) return;
    ipc_a2a_free(im->ipc);
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    if (im->inbox) CUDA_CHECK(cudaFree(im->inbox));
    if (im->side) {
        CUDA_CHECK(cudaStreamSynchronize(im->side));
        CUDA_CHECK(cudaStreamDestroy(im->side));
    }
    unregister_live(im->nccl);
    NCCL_CHECK(ncclCommFinalize(im->nccl));
    NCCL_CHECK(ncclCommDestroy(im->nccl));
    comm_free(im->host);
    free(im);
    c->impl = NULL;
}

/* The copy-engine inbox exchange's two halves (comm_ipc.cuh); without it, the whole exchange now. */
static const void *nccl_all_to_all_inbox_start(struct comm *c, const int64_t *recv_counts, const void *send,
                                               const int64_t *send_counts, enum comm_dtype t,
                                               struct comm_p2p_req *r, bool self_later)
{
    struct nccl_impl *im = impl_of(c);
    r->state = NULL;
    if (!im->ipc) return nccl_all_to_all_inbox(c, recv_counts, send, send_counts, t);
    const size_t es = comm_dtype_size(t);
    MT_CHECK(total(send_counts, c->size) == 0 || is_device(send),
             "all_to_all_inbox: the send buffer is not device memory");
    size_t rb[c->size], sb[c->size];
    for (int p = 0; p < c->size; p++) {
        rb[p] = (size_t)recv_counts[p] * es;
        sb[p] = (size_t)send_counts[p] * es;
    }
    const void *win = ipc_a2a_start(im->ipc, rb, send, sb, false, self_later);
    struct nccl_p2p_state *st = (struct nccl_p2p_state *)mt_calloc(1, sizeof *st);
    st->ipc = true;
    r->state = st;
    return win;
}

/* The same block for every rank: on the copy engines as the inbox all-to-all's two halves, or an
 * NCCL all-gather into the inbox now (across hosts). */
static const void *nccl_all_gather_inbox_start(struct comm *c, const void *send, size_t n, enum comm_dtype t,
                                               struct comm_p2p_req *r, bool without_self)
{
    struct nccl_impl *im = impl_of(c);
    r->state = NULL;
    if (n > 0 && !is_device(send))
        return im->host->ops->all_gather_inbox_start(im->host, send, n, t, r, without_self);
    const size_t es = comm_dtype_size(t);
    if (!im->ipc) {
        void *in = nccl_inbox_of(im, n * es * (size_t)c->size);
        NCCL_CHECK(ncclAllGather(send, in, n, nccl_type(t), im->nccl, g_cuda.stream));
        return in;
    }
    size_t b[c->size];
    for (int p = 0; p < c->size; p++) b[p] = n * es;
    /* without_self: the copy to self skipped, as the self-later all-to-all's (a copy within the
     * GPU holds the compute stream's next kernels back while it runs: docs/benchmarks.md) */
    const void *win = ipc_a2a_start(im->ipc, b, send, b, true, without_self);
    struct nccl_p2p_state *st = (struct nccl_p2p_state *)mt_calloc(1, sizeof *st);
    st->ipc = true;
    r->state = st;
    return win;
}

static bool nccl_exchange_arrival(struct comm *c, const struct comm_p2p_req *r, struct exchange_arrival *out)
{
    const struct nccl_p2p_state *st = (const struct nccl_p2p_state *)r->state;
    return st && st->ipc && ipc_a2a_arrival(impl_of(c)->ipc, out);
}

static const struct comm_ops nccl_ops = {
    nccl_all_gather, nccl_reduce_scatter_sum, nccl_all_reduce_sum, nccl_all_to_all_v,
    nccl_all_to_all, nccl_all_to_all_inbox, nccl_p2p, nccl_p2p_start, nccl_all_gather_start,
    nccl_all_to_all_v_start, nccl_reduce_scatter_sum_start, nccl_p2p_wait, nccl_destroy,
    nccl_all_to_all_inbox_start, nccl_all_gather_inbox_start, nccl_exchange_arrival,
};

extern "C" struct comm *comm_nccl_create(MPI_Comm mpi)
{
    MT_CHECK(g_cuda.ready, "comm_nccl_create: the CUDA backend is not set up (call backend_cuda first)");
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    struct comm *c = (struct comm *)mt_calloc(1, sizeof *c);
    c->mpi = mpi;
    MT_CHECK_MPI(MPI_Comm_rank(mpi, &c->rank));
    MT_CHECK_MPI(MPI_Comm_size(mpi, &c->size));
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (c->rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MT_CHECK_MPI(MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, mpi));
    struct nccl_impl *im = (struct nccl_impl *)mt_calloc(1, sizeof *im);
    CUDA_CHECK(cudaSetDevice(g_cuda.device));
    NCCL_CHECK(ncclCommInitRank(&im->nccl, c->size, id, c->rank));
    register_live(im->nccl);
    im->host = comm_mpi_create(mpi);
    im->ipc = ipc_a2a_create(mpi);
    c->ops = &nccl_ops;
    c->impl = im;
    return c;
}
