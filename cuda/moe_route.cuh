/* The MoE route plan: per-token sort of the top-k by expert id, per-expert row counts and the
 * (expert, token) row order (ops.h moe_route_plan). */
#ifndef MT_CUDA_MOE_ROUTE_CUH
#define MT_CUDA_MOE_ROUTE_CUH

#include "cuda_common.cuh"

void cu_moe_route_plan(int32_t *topk_idx, float *topk_w, int32_t *src_row, int32_t *slot_row,
                       int64_t *count_host, int T, int E, int k);

#endif
