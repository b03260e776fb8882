/* The MoE route plan: per-token sort of the top-k by expert id, per-expert row offsets (left on
 * the device) and the (expert, token) row order (ops.h moe_route_plan). */
#ifndef MT_CUDA_MOE_ROUTE_CUH
#define MT_CUDA_MOE_ROUTE_CUH

#include "cuda_common.cuh"

void cu_moe_route_plan(int32_t *topk_idx, float *topk_w, int32_t *src_row, int32_t *slot_row,
                       int64_t *off /*[E+1] device*/, int T, int E, int k);
void cu_moe_pair_plan(int32_t *topk_idx, float *topk_w, int32_t *pair_tok, int32_t *tok_pair,
                      int32_t *meta_idx, float *meta_w, int32_t *w_map, int64_t *count_host,
                      int64_t *rows_host, int T, int ep, int n_local, int k, int block);
void cu_moe_rows_cap(int64_t *off, int32_t *src_row, int32_t *slot_row, int64_t *need, int n_slots, int n_exp, int64_t cap);
void cu_moe_rows_split(int64_t *lo, int64_t *hi, const int64_t *off, const int32_t *src_row, int n_exp,
                       int64_t src_lo, int64_t src_hi);
void cu_gather_f32(float *out, const float *in, const int32_t *idx, int n);

#endif
