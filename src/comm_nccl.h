/* The NCCL implementation of the comm table (cuda/comm_nccl.cu): device buffers, the CUDA
 * backend's stream, one communicator per MPI group (its unique id broadcast over MPI). */
#ifndef MT_COMM_NCCL_H
#define MT_COMM_NCCL_H

#include <mpi.h>

#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

struct comm *comm_nccl_create(MPI_Comm mpi);

#ifdef __cplusplus
}
#endif

#endif
