/* The communication layer: collectives over one axis of the grid. MPI implements it on the CPU
 * path (comm_mpi.c); NCCL implements the same table on the GPU path. Buffers live in the memory of
 * the backend that goes with the comm (host for MPI, device for NCCL). A NULL `struct comm *`
 * means a group of one rank with HOST buffers: every operation is a local memmove. On the GPU
 * path always pass a real comm (size 1 is fine). Counts are in elements. */
#ifndef MT_COMM_H
#define MT_COMM_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* COMM_BF16 is 2-byte data for data movement only (no reductions on it). */
enum comm_dtype { COMM_F32, COMM_F64, COMM_I32, COMM_I64, COMM_BYTE, COMM_BF16 };

struct comm {
    MPI_Comm mpi;          /* the MPI communicator of this group (also used to bootstrap NCCL) */
    int rank, size;
    const struct comm_ops *ops;
    void *impl;            /* backend state (e.g. the ncclComm_t) */
};

/* One point-to-point transfer of a group (comm_p2p): peer is a rank of the comm. */
enum comm_p2p_kind { COMM_SEND, COMM_RECV };
struct comm_p2p_op {
    enum comm_p2p_kind kind;
    int peer;
    void *buf;             /* const for a send; device memory on NCCL, host on MPI */
    size_t count;          /* elements */
    enum comm_dtype dtype;
};

/* A transfer in flight between comm_p2p_start (or comm_all_gather_start) and comm_p2p_wait. */
struct comm_p2p_req {
    void *state;           /* the implementation's; NULL when nothing is in flight */
};

struct exchange_arrival; /* ops.h */

struct comm_ops {
    /* recv[size * n] = concatenation of every rank's send[n], in rank order; in place when
     * send == recv + rank * n */
    void (*all_gather)(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t);
    /* recv[n] = sum over ranks of send[rank * n .. rank * n + n); in place when
     * recv == send + rank * n (send is then clobbered) */
    void (*reduce_scatter_sum)(struct comm *c, void *recv, const void *send, size_t n,
                               enum comm_dtype t);
    /* buf[n] = sum over ranks, in place */
    void (*all_reduce_sum)(struct comm *c, void *buf, size_t n, enum comm_dtype t);
    /* variable all-to-all: send_counts/recv_counts are HOST arrays [size] of elements; the blocks
     * are packed back to back in rank order on both sides */
    void (*all_to_all_v)(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                         const int64_t *send_counts, enum comm_dtype t);
    /* fixed all-to-all of n elements per rank pair (host or device memory per the backend) */
    void (*all_to_all)(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t);
    /* all_to_all_v into a buffer the comm owns: returns the received blocks (packed in rank order
     * as recv would hold them), valid for ops queued before the next all_to_all_inbox on c, which
     * may overwrite it. For data consumed once right after it lands (the MoE row exchanges): the
     * NCCL comm lets peers on one host copy straight into that buffer (comm_ipc.cuh). */
    const void *(*all_to_all_inbox)(struct comm *c, const int64_t *recv_counts, const void *send,
                                    const int64_t *send_counts, enum comm_dtype t);
    /* every op of ops[n] posted as one group, returned when all completed (NCCL: queued on the
     * stream in one ncclGroup, so neighbours that send to each other cannot deadlock whatever order
     * they list the ops in). Matching is by (peer, order): the k-th send to p meets p's k-th recv. */
    void (*p2p)(struct comm *c, const struct comm_p2p_op *ops, int n);
    /* p2p split in two so the transfers run while the caller computes: start posts the group
     * (MPI: Isend/Irecv; NCCL: on a side stream, after the work already queued on the compute
     * stream) and returns; wait makes the received data usable (MPI: Waitall; NCCL: the compute
     * stream waits for the side stream) and the send buffers writable again. Between the two the
     * buffers are the transfer's. Groups started on one comm complete in the order started. */
    void (*p2p_start)(struct comm *c, const struct comm_p2p_op *ops, int n, struct comm_p2p_req *r);
    /* all_gather started now and finished by p2p_wait (fsdp.c's prefetch of the next layer):
     * neither buffer may be touched in between; on NCCL it runs on the side stream after the work
     * already queued */
    void (*all_gather_start)(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t,
                             struct comm_p2p_req *r);
    /* all_to_all_v started now and finished by p2p_wait (moe_exchange.c: one chunk's rows cross
     * while another chunk's expert GEMMs run): neither buffer may be touched in between; the
     * counts are read before it returns. MPI: MPI_Ialltoallv; NCCL: on the side stream after the
     * work already queued on the compute stream (the block to self is a copy there too). Every
     * rank starts its exchanges on c in the same order. */
    void (*all_to_all_v_start)(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                               const int64_t *send_counts, enum comm_dtype t, struct comm_p2p_req *r);
    /* reduce_scatter_sum started now and finished by p2p_wait (fsdp.c: a unit's gradients reduce
     * while the unit before it runs its backward): neither buffer may be touched in between. MPI:
     * MPI_Ireduce_scatter_block; NCCL: on the side stream after the work already queued. */
    void (*reduce_scatter_sum_start)(struct comm *c, void *recv, const void *send, size_t n,
                                     enum comm_dtype t, struct comm_p2p_req *r);
    void (*p2p_wait)(struct comm *c, struct comm_p2p_req *r);
    /* optional (NULL for MPI): releases c->impl; comm_free calls it before freeing c */
    void (*destroy)(struct comm *c);
    /* optional (NULL: all_to_all_inbox runs whole): all_to_all_inbox started now and finished by
     * p2p_wait, so that compute queued in between runs while the rows move (the NCCL comm's copy
     * engines between GPUs of one host); in between, queued work may write neither `send` nor
     * the returned buffer (reading `send` is fine: the copies only read it) nor read the returned
     * buffer, and no other inbox exchange on c may start */
    const void *(*all_to_all_inbox_start)(struct comm *c, const int64_t *recv_counts, const void *send,
                                          const int64_t *send_counts, enum comm_dtype t,
                                          struct comm_p2p_req *r, bool self_later);
    /* all_to_all_inbox_start where every rank gets the same n elements of `send` (an all-gather
     * into the inbox: rank s's block at s·n of the returned buffer), finished by p2p_wait with
     * the same rules in between (MPI and NCCL across hosts: done on return, nothing in flight).
     * The MoE fixed exchange's token rows, whose blocks are the same for every rank. With
     * without_self the block to self need not be written (comm_all_gather_inbox_start_others). */
    const void *(*all_gather_inbox_start)(struct comm *c, const void *send, size_t n, enum comm_dtype t,
                                          struct comm_p2p_req *r, bool without_self);
    /* optional (NULL: none): how the device sees the arrival of the inbox exchange r, started
     * and not yet waited for (ops.h struct exchange_arrival: the flags the peers' copies set);
     * false where it cannot (a transfer that is not the copy engines', or nothing in flight) */
    bool (*exchange_arrival)(struct comm *c, const struct comm_p2p_req *r, struct exchange_arrival *out);
};

size_t comm_dtype_size(enum comm_dtype t);
/* The comm type of a backend's compute dtype (x_size 4: fp32, 2: bf16). */
static inline enum comm_dtype comm_dtype_of_x(size_t x_size) { return x_size == 4 ? COMM_F32 : COMM_BF16; }

/* Profiling (profile.c): when set, every collective below runs between begin() and end(). */
void comm_set_timer(void (*begin)(void), void (*end)(const char *op));

/* Wrap an MPI communicator with the MPI (host memory) implementation. */
struct comm *comm_mpi_create(MPI_Comm mpi);
void comm_free(struct comm *c);
/* Largest piece (elements) an MPI p2p transfer is cut into; INT_MAX normally. Tests lower it to
 * exercise the splitting without 2^31-element buffers (0 restores INT_MAX). */
void comm_mpi_set_p2p_chunk(size_t elements);

/* Null-safe wrappers: a NULL comm (or size 1) acts as a single rank. */
void comm_all_gather(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t);
void comm_reduce_scatter_sum(struct comm *c, void *recv, const void *send, size_t n,
                             enum comm_dtype t);
void comm_all_reduce_sum(struct comm *c, void *buf, size_t n, enum comm_dtype t);
void comm_all_to_all_v(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                       const int64_t *send_counts, enum comm_dtype t);
void comm_all_to_all(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t);
/* Grouped sends/receives (ops->p2p). A NULL comm has no peers: only n == 0 is allowed. */
void comm_p2p(struct comm *c, const struct comm_p2p_op *ops, int n);
void comm_p2p_start(struct comm *c, const struct comm_p2p_op *ops, int n, struct comm_p2p_req *r);
/* (a request with nothing in flight returns at once) */
void comm_p2p_wait(struct comm *c, struct comm_p2p_req *r);
/* The all-gather in two halves (ops->all_gather_start); comm_p2p_wait finishes it. A NULL comm or a
 * group of one runs it at once. */
void comm_all_gather_start(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t,
                           struct comm_p2p_req *r);
/* The all_to_all_v in two halves (ops->all_to_all_v_start); comm_p2p_wait finishes it. A NULL
 * comm copies at once. */
void comm_all_to_all_v_start(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                             const int64_t *send_counts, enum comm_dtype t, struct comm_p2p_req *r);
/* The reduce-scatter in two halves (ops->reduce_scatter_sum_start); comm_p2p_wait finishes it. A
 * NULL comm runs it at once. */
void comm_reduce_scatter_sum_start(struct comm *c, void *recv, const void *send, size_t n,
                                   enum comm_dtype t, struct comm_p2p_req *r);
/* (for a NULL comm the result is `send` itself) */
const void *comm_all_to_all_inbox(struct comm *c, const int64_t *recv_counts, const void *send,
                                  const int64_t *send_counts, enum comm_dtype t);
/* The inbox exchange in two halves (ops->all_to_all_inbox_start); the returned rows are there once
 * comm_p2p_wait has run. A comm without the split (MPI, NCCL across hosts) runs it whole here and
 * leaves nothing in flight. */
const void *comm_all_to_all_inbox_start(struct comm *c, const int64_t *recv_counts, const void *send,
                                        const int64_t *send_counts, enum comm_dtype t, struct comm_p2p_req *r);
/* ops->exchange_arrival; false for a NULL comm or where the op is missing */
/* comm_all_to_all_inbox_start whose block to self the caller writes: it keeps its place in the
 * returned buffer (recv_counts[rank] elements, after the earlier ranks' blocks) and work queued
 * after this returns (on the compute stream; on the host for MPI) may write it there while the
 * other blocks cross; it must be written before the buffer is read after the wait, and send's
 * block to self need not hold anything. Where the exchange runs whole before returning (MPI,
 * NCCL across hosts, a group of one: then the buffer is `send` itself), send's block to self is
 * copied there first as usual, and the caller's write replaces it. */
void *comm_all_to_all_inbox_start_self_later(struct comm *c, const int64_t *recv_counts, const void *send,
                                             const int64_t *send_counts, enum comm_dtype t,
                                             struct comm_p2p_req *r);
bool comm_exchange_arrival(struct comm *c, const struct comm_p2p_req *r, struct exchange_arrival *out);
/* ops->all_gather_inbox_start; comm_p2p_wait finishes it. For a NULL comm the result is `send`. */
const void *comm_all_gather_inbox_start(struct comm *c, const void *send, size_t n, enum comm_dtype t,
                                        struct comm_p2p_req *r);
/* comm_all_gather_inbox_start for a caller that reads its own block from `send`: the returned
 * buffer's block to self is not written by the copy engines (it holds anything; the MPI comm fills
 * it with 0xff bytes, so that a reader of it shows in the tests). The other blocks as above. */
const void *comm_all_gather_inbox_start_others(struct comm *c, const void *send, size_t n, enum comm_dtype t,
                                               struct comm_p2p_req *r);

#endif
