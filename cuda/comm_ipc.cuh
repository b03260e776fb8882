/* All-to-all between the GPUs of one host by the copy engines (CUDA IPC), for comm_nccl's
 * all_to_all_inbox. Each rank owns a receive window that every other rank has mapped; a sender
 * writes its block for rank d straight into d's window with cudaMemcpyAsync on a side stream (no
 * SMs: the transfer runs beside compute kernels, and between two H200s it moves 363 GB/s per
 * direction where NCCL's point-to-point kernels reach 277; docs/benchmarks.md).
 *
 * Ordering across processes uses flags in device memory that every rank has mapped, written and
 * waited on by stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32), so the host
 * never waits for a peer's GPU. Call number e (the same on every rank):
 *   1. the compute stream records an event once everything queued before is done (the send data
 *      written, the reader of the previous call's window finished), and the ranks exchange where
 *      each sender's block goes (MPI_Allgather of offsets, on the host);
 *   2. the copy stream to rank d waits for that event, writes e into ready_from[me] of d's flags
 *      (our window is free for d), waits for ready_from[d] >= e in our flags, copies, and writes e
 *      into arrived_from[me] of d's flags (the write is fenced behind the copy). No flag is
 *      written from the compute stream: its next kernel would wait for the fenced remote store;
 *   3. the compute stream waits for its own copies (the send buffer is free again) and for
 *      arrived_from[s] >= e from every peer s: all blocks for this rank have landed.
 * A window grows (all ranks together, after draining every stream) when a call needs more than it
 * holds; growth is rare (receive sizes settle in the first steps) and keeps 25% headroom. */
#ifndef MT_COMM_IPC_CUH
#define MT_COMM_IPC_CUH

#include <mpi.h>
#include <stddef.h>

struct ipc_a2a;

/* Collective over `mpi`. NULL (on every rank alike) when the group spans hosts, a pair of its
 * GPUs cannot map each other's memory, the driver lacks stream memory operations, or
 * MT_COMM_IPC=0 is set on any rank. */
struct ipc_a2a *ipc_a2a_create(MPI_Comm mpi);

/* Collective. send has send_bytes[d] bytes for rank d, packed in rank order; returns this rank's
 * window holding recv_bytes[s] bytes from each rank s, packed in rank order, valid for ops queued
 * on the compute stream before the next call. Byte counts must agree pairwise (checked). */
const void *ipc_a2a_run(struct ipc_a2a *x, const size_t *recv_bytes, const void *send,
                        const size_t *send_bytes);

/* ipc_a2a_run in two halves, for work that runs on the compute stream while the copies move: start
 * queues the copies (steps 1-2 above) and returns the window; finish makes the compute stream wait
 * for them (step 3). same_block: every rank's block is the same send_bytes[d] bytes at `send` (an
 * all-gather) instead of packed blocks. self_later: the block to self is not copied; its place in
 * the window is the caller's to write (comm.h comm_all_to_all_inbox_start_self_later). Between the
 * two, queued work may touch neither `send` nor the window (but that place), and no other call on
 * x may run. Both collective. */
const void *ipc_a2a_start(struct ipc_a2a *x, const size_t *recv_bytes, const void *send,
                          const size_t *send_bytes, bool same_block, bool self_later);
void ipc_a2a_finish(struct ipc_a2a *x);
struct exchange_arrival; /* ops.h */
/* Between start and finish: the flags the peers' copies set once their blocks have landed here
 * (ops.h struct exchange_arrival), for work that should run only until they have */
bool ipc_a2a_arrival(const struct ipc_a2a *x, struct exchange_arrival *out);

/* Collective. */
void ipc_a2a_free(struct ipc_a2a *x);

#endif
