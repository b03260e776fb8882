/* The MoE router: fp32 softmax, top-k (ties to the lower expert id), renormalisation, backward and
 * load statistics (ops.h, spec §3.6, §5). */
#ifndef MT_CUDA_ROUTER_CUH
#define MT_CUDA_ROUTER_CUH

#include "cuda_common.cuh"

/* logits and dlogits are fp32 in every precision (the router GEMM writes fp32, or its compute-dtype
 * output is widened first: src/moe.c) */
void cu_router_forward(int32_t *topk_idx, float *topk_w, float *probs, const float *logits,
                       const float *bias, int T_, int E, int k, const struct router_opts *o);
void cu_router_backward(float *dlogits, const float *dtopk_w, const float *probs,
                        const int32_t *topk_idx, const float *aux_dp, int T_, int E, int k,
                        const struct router_opts *o);
void cu_router_gather_weights(float *topk_w, const float *probs, const int32_t *topk_idx, int T_,
                              int E, int k, const struct router_opts *o);
void cu_aux_grad_from_stats(float *aux_dp, const float *stats, int L, int E, double scale, double rows);
void cu_router_stats(float *psum, float *count, const float *probs, const int32_t *topk_idx, int T_,
                     int E, int k);

#endif
