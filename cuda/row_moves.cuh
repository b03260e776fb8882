/* What the row kernels of moe_rows.cu and moe_combine.cu share: a warp per row, rows of H
 * elements moved in chunks of 8 (16-byte accesses) when H % 8 == 0 and the pointers allow. */
#ifndef MT_CUDA_ROW_MOVES_CUH
#define MT_CUDA_ROW_MOVES_CUH

#include "cuda_common.cuh"

enum { ROW_BLOCK = 256, RW_UNROLL = 4 }; /* threads a block; chunks of a row a lane has in flight */

/* warps of ROW_BLOCK threads for n rows, capped; the kernels loop over rows by warp */
static inline unsigned rw_grid(int n)
{
    const int per_block = ROW_BLOCK / 32;
    return (unsigned)MT_MIN((n + per_block - 1) / per_block, 65536);
}

/* rows of H elements at these pointers (c may be null) take the chunked kernels */
static inline bool rw_vec_ok(int H, const void *a, const void *b, const void *c)
{
    return H % 8 == 0 && aligned16(a) && aligned16(b) && (!c || aligned16(c));
}

#endif
