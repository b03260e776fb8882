/* The communication layer: collectives over one axis of the grid. MPI implements it on the CPU
 * path (comm_mpi.c); NCCL implements the same table on the GPU path. Buffers live in the memory of
 * the backend that goes with the comm (host for MPI, device for NCCL). A NULL `struct comm *`
 * means a group of one rank with HOST buffers: every operation is a local memmove. On the GPU
 * path always pass a real comm (size 1 is fine). Counts are in elements. */
#ifndef MT_COMM_H
#define MT_COMM_H

#include <mpi.h>
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
    /* optional (NULL for MPI): releases c->impl; comm_free calls it before freeing c */
    void (*destroy)(struct comm *c);
};

size_t comm_dtype_size(enum comm_dtype t);
/* The comm type of a backend's compute dtype (x_size 4: fp32, 2: bf16). */
static inline enum comm_dtype comm_dtype_of_x(size_t x_size) { return x_size == 4 ? COMM_F32 : COMM_BF16; }

/* Profiling (profile.c): when set, every collective below runs between begin() and end(). */
void comm_set_timer(void (*begin)(void), void (*end)(void));

/* Wrap an MPI communicator with the MPI (host memory) implementation. */
struct comm *comm_mpi_create(MPI_Comm mpi);
void comm_free(struct comm *c);

/* Null-safe wrappers: a NULL comm (or size 1) acts as a single rank. */
void comm_all_gather(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t);
void comm_reduce_scatter_sum(struct comm *c, void *recv, const void *send, size_t n,
                             enum comm_dtype t);
void comm_all_reduce_sum(struct comm *c, void *buf, size_t n, enum comm_dtype t);
void comm_all_to_all_v(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                       const int64_t *send_counts, enum comm_dtype t);
void comm_all_to_all(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t);
/* (for a NULL comm the result is `send` itself) */
const void *comm_all_to_all_inbox(struct comm *c, const int64_t *recv_counts, const void *send,
                                  const int64_t *send_counts, enum comm_dtype t);

#endif
