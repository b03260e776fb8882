/* The NCCL implementation of the comm table (src/comm.h), for the CUDA backend: collectives on
 * DEVICE buffers, ordered on the CUDA backend's stream (asynchronous like every op; download or
 * sync to wait). Call backend_cuda() first: the communicator binds to its device and stream.
 *
 * The NCCL unique id comes from rank 0 of `mpi` through MPI_Bcast; every rank of `mpi` must call.
 * Host buffers are also accepted: an operation whose buffers are all host memory runs through the
 * MPI implementation on the same communicator (small host-side reductions such as loss sums and
 * router statistics keep working when a caller swaps an MPI comm for an NCCL one). Mixing host and
 * device buffers in one call is an error. comm_free() destroys the NCCL communicator.
 *
 * Only defined in CUDA builds: the Makefile defines MT_HAVE_NCCL for C callers to guard with. */
#ifndef MT_COMM_NCCL_H
#define MT_COMM_NCCL_H

#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

struct comm *comm_nccl_create(MPI_Comm mpi);

#ifdef __cplusplus
}
#endif

#endif
