/* The fp32 CPU reference backend: one plain-C function per op of src/ops.h, on float * tensors.
 * cpu_backend.c wraps them into `struct backend`; tests may call them directly.
 *
 * Semantics (overwrite vs accumulate, layouts, aliasing) are exactly those documented in src/ops.h.
 *
 * Accumulation policy (the same in every op, so results are reproducible and comparable):
 *  - Dot products (matmul and expert matmul in both directions, attention scores and dP, the MoE
 *    combine weight gradient) sum in float over 8 interleaved partial sums, combined by a fixed
 *    tree, then the tail in order (cpu_dot.h). Each output element depends only on its own input
 *    rows, never on how a batch is blocked, so a row's result is bit-identical however the batch
 *    is split into micro-batches.
 *  - Row statistics (RMSNorm mean square and its backward projection, softmax denominators and
 *    log-sum-exp of attention, router and cross-entropy, the router backward projections,
 *    sumsq_f32) accumulate in double and are rounded to float once.
 *  - Weighted sums and scatter-adds of vectors (attention P·V, dK, dV, MoE combine, embedding and
 *    gather backward, RMSNorm dw) add in float in ascending index order, as PyTorch's index_add.
 *  - AdamW is elementwise float with its bias corrections formed in double.
 *
 * cpu_alloc fills new memory with NaN bytes so a buffer used before being written is loud. */
#ifndef MT_CPU_OPS_H
#define MT_CPU_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ops.h"

/* memory: host memory is the "device" */
void *cpu_alloc(size_t bytes);
void cpu_free(void *p);
void cpu_zero(void *p, size_t bytes);
void cpu_copy(void *dst, const void *src, size_t bytes);
void cpu_sync(void);

/* casts (fp32 to fp32; in and out may alias) and elementwise */
void cpu_cast_f32(float *out, const float *in, size_t n);
void cpu_add_inplace(float *y, const float *x, size_t n);
double cpu_device_used(void);
void cpu_scale_f32(float *x, size_t n, float s);
double cpu_sumsq_f32(const float *x, size_t n);

/* C[M,N] = A[M,K] · B[N,K]ᵀ (accumulate: C += ...). The kernel behind every matmul. */
void cpu_gemm_nt(float *c, const float *a, const float *b, int M, int K, int N, bool accumulate);
/* out[C,R] = in[R,C]ᵀ */
void cpu_transpose(float *out, const float *in, int R, int C);

void cpu_embedding_forward(float *out, const int32_t *ids, const float *wte, int T, int H);
void cpu_embedding_backward(float *dwte, const float *dout, const int32_t *ids, int T, int H);

void cpu_rmsnorm_forward(float *out, float *rstd, const float *in, const float *w, int N, int C,
                         float eps);
void cpu_rmsnorm_backward(float *din, float *dw, const float *dout, const float *in, const float *w,
                          const float *rstd, int N, int C, bool accumulate);

void cpu_matmul_forward(float *out, const float *in, const float *w, int N, int I, int O);
void cpu_matmul_backward(float *din, float *dw, const float *dout, const float *in, const float *w,
                         int N, int I, int O, bool accumulate);

/* inv_freq[i] = 1 / theta^((2i)/D), all in fp32 (D/2 entries) */
void cpu_rope_inv_freq(float *inv_freq, int D, float theta);
void cpu_rope_forward(float *out, const float *in, const int32_t *pos, int T, int nh, int D,
                      float theta);
void cpu_rope_backward(float *din, const float *dout, const int32_t *pos, int T, int nh, int D,
                       float theta);

void cpu_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                           int B, int S, int Hq, int Hkv, int D, const int32_t *seg /* [B,S] or NULL */);
/* `out` is not read: the backward recomputes each probability row from q, k and lse. */
void cpu_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                            const float *k, const float *v, const float *out, const float *lse,
                            int B, int S, int Hq, int Hkv, int D, const int32_t *seg);

void cpu_router_forward(int32_t *topk_idx, float *topk_w, float *probs, const float *logits,
                        const float *bias, int T, int E, int k, const struct router_opts *o);
void cpu_router_gather_weights(float *topk_w, const float *probs, const int32_t *topk_idx, int T,
                               int E, int k, const struct router_opts *o);
void cpu_router_backward(float *dlogits, const float *dtopk_w, const float *probs,
                         const int32_t *topk_idx, const float *aux_dp, int T, int E, int k,
                         const struct router_opts *o);
void cpu_aux_grad_from_stats(float *aux_dp, const float *stats, int L, int E, double scale, double rows);
void cpu_router_stats(float *psum, float *count, const float *probs, const int32_t *topk_idx,
                      int T, int E, int k);

void cpu_moe_route_plan(int32_t *topk_idx, float *topk_w, int32_t *src_row, int32_t *slot_row,
                        int64_t *off /*[E+1]*/, int T, int E, int k);
void cpu_moe_pair_plan(int32_t *topk_idx, float *topk_w, int32_t *pair_tok, int32_t *tok_pair,
                       int32_t *meta_idx, float *meta_w, int32_t *w_map, int64_t *count,
                       int64_t *rows, int T, int ep, int n_local, int k, int block);
void cpu_moe_rows_cap(int64_t *off, int32_t *src_row, int32_t *slot_row, int64_t *need, int n_slots,
                      int n_exp, int64_t cap);
void cpu_moe_rows_split(int64_t *lo, int64_t *hi, const int64_t *off, const int32_t *src_row, int n_exp,
                        int64_t src_lo, int64_t src_hi);
void cpu_gather_f32(float *out, const float *in, const int32_t *idx, int n);
void cpu_gather_rows(float *out, const float *in, const int32_t *idx, int R, int H);
void cpu_gather_rows_part(float *out, const float *in, const int32_t *idx, int R, int H, int lo, int hi, bool inside);
void cpu_dispatch_rows(float *out, const float *in, const int32_t *slot, int n, int k, int H);
void cpu_gather_rows_backward(float *din, const float *dout, const int32_t *idx, int R, int H);

void cpu_moe_combine_forward(float *out, const float *y, const int32_t *slot_row, const float *w,
                             int T, int k, int H);
void cpu_moe_combine_backward(float *dy, float *dw, const float *dout, const float *y,
                              const int32_t *slot_row, const float *w, int T, int k, int H);

/* end NULL, or [n_exp]: expert e's rows are [off[e], end[e]) (ops.h) */
void cpu_expert_matmul_forward(float *out, const float *in, const float *w, const int64_t *off,
                               const int64_t *end, int n_exp, int I, int O);
void cpu_expert_matmul_backward(float *din, float *dw, const float *dout, const float *in,
                                const float *w, const int64_t *off, int n_exp, int I, int O);

void cpu_swiglu_forward(float *out, const float *gu, int R, int I);
/* dgu may alias gu */
void cpu_swiglu_backward(float *dgu, const float *dout, const float *gu, int R, int I);

void cpu_cross_entropy_forward(float *losses, float *lse, const float *logits,
                               const int32_t *targets, int N, int V);
/* lse: the forward's; dlogits may alias logits */
void cpu_cross_entropy_backward(float *dlogits, const float *logits, const float *lse,
                                const int32_t *targets, int N, int V, float scale);

void cpu_adamw_update_m16(float *master, float *param, const float *grad, uint16_t *m, uint16_t *v,
                          size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                          int t, float grad_scale);
void cpu_adamw_update(float *master, float *param, const float *grad, float *m, float *v, size_t n,
                      float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                      float grad_scale);
struct adamw_segment; /* ops.h */
/* mom_bytes 4: fp32 moments (cpu_adamw_update per segment), 2: bf16 (cpu_adamw_update_m16) */
void cpu_adamw_update_multi(const struct adamw_segment *segs, int n_seg, size_t mom_bytes, float lr,
                            float beta1, float beta2, float eps, int t, float grad_scale);

#endif
